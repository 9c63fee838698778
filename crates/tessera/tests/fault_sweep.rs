//! The fault-injection sweep of every writer (issue 29): for each writer (native sync and
//! async save, `torch_dist`, OLMo-core with its two directories, `convert`, `convert_to_dcp`,
//! the safetensors export), into a new location and over a committed checkpoint, every storage
//! call in turn fails (an error; and a lost response: the call takes effect, then fails), on
//! each rank, and every collective in turn fails (on one rank, on all). After each run:
//!
//! - the location holds exactly the old state or exactly the new one (nothing, or the new one,
//!   in a new location), never a mix, and no rank reports success unless the new one is there;
//!   a rank that fails where the new state is committed says so ([`Error::CommitUnknown`], or
//!   rank 0's "committed, the other ranks could not be told");
//! - `verify` agrees (sound where a checkpoint loads, `NotCommitted` / `NotFound` elsewhere);
//! - `gc` afterwards leaves exactly the committed checkpoint's files;
//! - a retry with the same arguments succeeds (or, in a new location where the failed run did
//!   commit, is refused with `AlreadyExists`, the new state being there already), and `gc`
//!   again leaves exactly the committed files.
//!
//! Each test prints its size (cases and outcomes); README.md reports them.
//! `TESSERA_SWEEP_VERBOSE=1` prints every case.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::*;
use tessera::comm::*;
use tessera::index::*;
use tessera::olmo::*;
use tessera::storage::*;
use tessera::tools::*;
use tessera::torch_dist::*;
use tessera::*;

// ---------------------------------------------------------------------------------------------
// Faults.

/// How an injected fault acts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// The call fails without effect.
    Error,
    /// The call takes effect, then fails (a response lost on its way back).
    Lost,
}

/// Where a run's fault goes: the `at`-th storage call of one rank, or the `at`-th collective on
/// one rank or on all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    None,
    Storage { rank: usize, at: usize, mode: Mode },
    Collective { rank: Option<usize>, at: usize },
}

/// One rank's count of its storage calls, failing the one its plan names.
#[derive(Debug)]
struct Calls {
    count: AtomicUsize,
    fail: Option<(usize, Mode)>,
    /// What each call was (the first run, to name a failing case).
    log: Mutex<Vec<String>>,
}

impl Calls {
    fn new(fail: Option<(usize, Mode)>) -> Arc<Calls> {
        Arc::new(Calls { count: AtomicUsize::new(0), fail, log: Mutex::default() })
    }

    fn call<T>(&self, what: impl Fn() -> String, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let n = self.count.fetch_add(1, Ordering::SeqCst);
        self.log.lock().unwrap().push(what());
        match self.fail {
            Some((at, mode)) if at == n => {
                if mode == Mode::Lost {
                    let _ = f();
                }
                Err(Error::Io {
                    path: what().into(),
                    source: std::io::Error::other(format!("injected fault ({mode:?}) at storage call {n}")),
                })
            }
            _ => f(),
        }
    }
}

/// A storage whose calls go through a rank's [`Calls`].
#[derive(Debug, Clone)]
struct Faulty {
    inner: Arc<dyn Storage>,
    calls: Arc<Calls>,
}

impl Storage for Faulty {
    fn location(&self) -> String {
        self.inner.location()
    }
    fn size(&self, name: &str) -> Result<u64> {
        self.calls.call(|| format!("size {name}"), || self.inner.size(name))
    }
    fn read_at(&self, name: &str, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.calls.call(|| format!("read_at {name}@{offset}"), || self.inner.read_at(name, offset, buf))
    }
    fn create(&self, name: &str, size: u64) -> Result<Box<dyn ObjectWriter>> {
        let inner = self.calls.call(|| format!("create {name}"), || self.inner.create(name, size))?;
        Ok(Box::new(FaultyWriter { inner, name: name.into(), calls: self.calls.clone() }))
    }
    fn put_atomic(&self, name: &str, bytes: &[u8]) -> Result<()> {
        self.calls.call(|| format!("put_atomic {name}"), || self.inner.put_atomic(name, bytes))
    }
    fn put_if_absent(&self, name: &str, bytes: &[u8]) -> Result<()> {
        self.calls.call(|| format!("put_if_absent {name}"), || self.inner.put_if_absent(name, bytes))
    }
    fn has_atomic_create(&self) -> bool {
        self.inner.has_atomic_create()
    }
    fn is_local(&self) -> bool {
        self.inner.is_local()
    }
    fn list(&self) -> Result<Vec<String>> {
        self.calls.call(|| "list".into(), || self.inner.list())
    }
    fn list_recursive(&self) -> Result<Vec<String>> {
        self.calls.call(|| "list_recursive".into(), || self.inner.list_recursive())
    }
    fn delete(&self, name: &str) -> Result<()> {
        self.calls.call(|| format!("delete {name}"), || self.inner.delete(name))
    }
}

struct FaultyWriter {
    inner: Box<dyn ObjectWriter>,
    name: String,
    calls: Arc<Calls>,
}

impl ObjectWriter for FaultyWriter {
    fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.calls.call(|| format!("write_at {}@{offset}", self.name), || self.inner.write_at(offset, data))
    }
    fn finish(self: Box<Self>) -> Result<()> {
        let FaultyWriter { inner, name, calls } = *self;
        calls.call(|| format!("finish {name}"), move || inner.finish())
    }
}

// ---------------------------------------------------------------------------------------------
// The state every writer saves: a function of the step.

const WORLD: usize = 2;

/// `w`: f32 [4, 6], rows split over the ranks; `b`: bf16 [6], whole on every rank (replica id =
/// rank): both a function of `step`.
fn w_bytes(step: u64) -> Vec<u8> {
    f32_bytes(&(0..24).map(|i| (step * 100 + i) as f32).collect::<Vec<_>>())
}
fn b_bytes(step: u64) -> Vec<u8> {
    bf16_bytes(&(0..6).map(|i| (step * 10 + i) as f32).collect::<Vec<_>>())
}
/// Rank `rank`'s object of `step` (opaque bytes: every format stores them, the foreign ones
/// wrapped, so a read-back is checked for containing them).
fn rng_bytes(step: u64, rank: usize) -> Vec<u8> {
    format!("rng-{step}-{rank}").into_bytes()
}

/// Rank `rank`'s shard of `w` of `step`.
fn w_shard(step: u64, rank: usize) -> ShardedTensor<'static> {
    let rows = w_bytes(step)[rank * 48..(rank + 1) * 48].to_vec();
    ShardedTensor::from_rank_offsets(
        "w",
        DType::F32,
        &[2, 6],
        TensorData::Owned(rows),
        &[(0, rank as u64, WORLD as u64)],
        0,
    )
    .unwrap()
}

/// `b` of `step`, whole, as rank `rank`'s replica.
fn b_whole(step: u64, rank: usize) -> ShardedTensor<'static> {
    let mut b = ShardedTensor::full("b", DType::BF16, &[6], TensorData::Owned(b_bytes(step)));
    b.replica_id = ReplicaId(vec![rank as u32]);
    b
}

/// Rank `rank`'s tree of `step`: `w`, `b`, and with `extras` an object and a common value.
fn tree(step: u64, rank: usize, extras: bool) -> StateTree<'static> {
    let mut t = StateTree::map()
        .with("w", StateTree::Tensor(w_shard(step, rank)))
        .with("b", StateTree::Tensor(b_whole(step, rank)));
    if extras {
        let o = ShardedObject::new("rng", rng_bytes(step, rank), &[WORLD as u64], &[rank as u64]);
        t = t.with("rng", StateTree::Object(o)).with("step", StateTree::Value(Value::Int(step as i64)));
    }
    t
}

/// The tensors `keys` of a checkpoint of `step`.
fn expected(step: u64, keys: &[&str]) -> BTreeMap<String, Vec<u8>> {
    let all = [("w", w_bytes(step)), ("b", b_bytes(step))];
    all.into_iter().filter(|(k, _)| keys.contains(k)).map(|(k, v)| (k.to_string(), v)).collect()
}

/// The step the checkpoint at `storage` (holding the tensors `keys`) holds (`None`: nothing
/// committed), or what is wrong. `extras`: the common value `step` and the objects must say
/// the same.
fn step_at(
    storage: &dyn Storage,
    keys: &[&str],
    extras: bool,
    steps: &[u64],
) -> std::result::Result<Option<u64>, String> {
    let ckpt = match open(storage) {
        Ok(c) => c,
        Err(Error::NotCommitted { .. } | Error::NotFound { .. }) => return Ok(None),
        Err(e) => return Err(format!("open: {e}")),
    };
    let tensors = ckpt.read_tensors(None).map_err(|e| format!("read: {e}"))?;
    let got: BTreeMap<String, Vec<u8>> = tensors.into_iter().map(|(k, t)| (k, t.data)).collect();
    let Some(&step) = steps.iter().find(|&&s| got == expected(s, keys)) else {
        return Err(format!("the tensors are no step's: {:?}", got.keys().collect::<Vec<_>>()));
    };
    if extras {
        let value = ckpt.common_state().get_dotted("step").and_then(|t| t.as_value().cloned());
        if value != Some(Value::Int(step as i64)) {
            return Err(format!("tensors of step {step}, common value step = {value:?}: a mix"));
        }
        for r in 0..WORLD {
            let mut want = ShardedObject::new("rng", Vec::new(), &[WORLD as u64], &[r as u64]);
            want.data = None;
            let loaded = ckpt.load_objects(StateTree::Object(want)).map_err(|e| format!("objects: {e}"))?;
            let got = match &loaded {
                StateTree::Object(o) => o.data.clone(),
                _ => None,
            };
            let want = rng_bytes(step, r);
            if !got.is_some_and(|g| g.windows(want.len()).any(|w| w == want)) {
                return Err(format!("tensors of step {step}, object rng[{r}] of another step: a mix"));
            }
        }
    }
    Ok(Some(step))
}

/// The files of the committed checkpoint at `storage` (what gc must leave): the marker(s) and
/// the data files its index names.
fn committed_files(storage: &dyn Storage) -> BTreeSet<String> {
    let Ok(ckpt) = open(storage) else { return BTreeSet::new() };
    let backend = ckpt.format().backend;
    // Foreign formats name virtual files `file@offset`.
    let mut files: BTreeSet<String> =
        ckpt.index().files.iter().map(|f| f.name.split('@').next().unwrap().to_string()).collect();
    match backend.name() {
        "tessera" => {
            files.insert(INDEX_FILE.into());
        }
        "torch_dist" => {
            files.extend([".metadata", "common.pt", "metadata.json"].map(String::from));
            files.extend(committed_common_copy(storage));
        }
        "olmo_safetensors" => {
            files.insert("metadata.json".into());
        }
        other => panic!("unexpected backend {other}"),
    }
    files
}

// ---------------------------------------------------------------------------------------------
// The writers.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Writer {
    Native,
    Async,
    TorchDist,
    Olmo,
    Convert,
    ConvertDcp,
}

impl Writer {
    fn world(self) -> usize {
        match self {
            Writer::Convert | Writer::ConvertDcp => 1,
            _ => WORLD,
        }
    }
    /// Locations written (OLMo-core: `model/` and `optim/`).
    fn locations(self) -> usize {
        if self == Writer::Olmo {
            2
        } else {
            1
        }
    }
    /// Whether the state carries an object and a common value (OLMo-core holds tensors only).
    fn extras(self) -> bool {
        self != Writer::Olmo
    }
}

/// The sources `convert` and `convert_to_dcp` read: a native checkpoint of each step, made once.
fn source(step: u64) -> MemoryStorage {
    static SOURCES: std::sync::OnceLock<Mutex<BTreeMap<u64, MemoryStorage>>> = std::sync::OnceLock::new();
    let mut all = SOURCES.get_or_init(Default::default).lock().unwrap();
    all.entry(step)
        .or_insert_with(|| {
            let s = MemoryStorage::new();
            for r in run_ranks(WORLD, |c| save(tree(step, c.rank(), true), &s, c, &SaveOptions::default())) {
                r.unwrap();
            }
            s
        })
        .clone()
}

/// Rank `comm.rank()` of `writer` writes `step` into `dsts`; `commit_comm` is the async save's
/// second communicator.
fn write(
    writer: Writer,
    step: u64,
    dsts: &[Arc<dyn Storage>],
    comm: &dyn Communicator,
    commit_comm: Arc<dyn Communicator>,
    src: &dyn Storage,
    overwrite: bool,
) -> Result<()> {
    let rank = comm.rank();
    let opts = SaveOptions { overwrite, block_size: 64, ..SaveOptions::default() };
    match writer {
        Writer::Native => save(tree(step, rank, true), dsts[0].as_ref(), comm, &opts).map(drop),
        Writer::Async => {
            let mut saver = AsyncSaver::new(StagingPool::new(1 << 16)?, commit_comm);
            saver.save(tree(step, rank, true), dsts[0].clone(), comm, &opts)?.finalize().map(drop)
        }
        Writer::TorchDist => save_torch_dist(tree(step, rank, true), None, dsts[0].as_ref(), comm, &opts, 2).map(drop),
        Writer::Olmo => {
            let model = StateTree::map().with("w", StateTree::Tensor(w_shard(step, rank)));
            let optim = StateTree::map().with("b", StateTree::Tensor(b_whole(step, rank)));
            save_olmo_dirs(vec![(model, dsts[0].as_ref()), (optim, dsts[1].as_ref())], comm, &opts).map(drop)
        }
        Writer::Convert => {
            let copts = ConvertOptions { overwrite, block_size: 64, ..ConvertOptions::default() };
            convert(src, dsts[0].as_ref(), &copts, &mut |_, _| {}).map(drop)
        }
        Writer::ConvertDcp => {
            let copts = ConvertOptions { overwrite, ..ConvertOptions::default() };
            convert_to_dcp(src, dsts[0].as_ref(), &copts, &mut |_, _| {}).map(drop)
        }
    }
}

/// What the locations hold: one step for all, or what is wrong.
fn state(writer: Writer, dsts: &[Arc<dyn Storage>]) -> std::result::Result<Option<u64>, String> {
    // OLMo-core's `model/` holds `w`, its `optim/` `b`.
    let keys: &[&[&str]] = if writer == Writer::Olmo { &[&["w"], &["b"]] } else { &[&["w", "b"]] };
    let steps: Vec<Option<u64>> = dsts
        .iter()
        .zip(keys)
        .map(|(d, k)| step_at(d.as_ref(), k, writer.extras(), &[OLD, NEW]))
        .collect::<std::result::Result<_, _>>()?;
    if steps.windows(2).any(|w| w[0] != w[1]) {
        return Err(format!("the directories hold different steps: {steps:?}"));
    }
    Ok(steps[0])
}

const OLD: u64 = 1;
const NEW: u64 = 2;

/// Runs `writer` on every rank with `fault`; returns each rank's result and, per rank, the
/// storage calls and collectives it made.
fn run(
    writer: Writer,
    step: u64,
    dsts: &[Arc<dyn Storage>],
    overwrite: bool,
    fault: Fault,
) -> (Vec<Result<()>>, Vec<Vec<String>>, Vec<usize>) {
    let world = writer.world();
    // A rank whose collective failed leaves the save; its peers then wait at the next
    // collective until the communicator gives up, as with a real job's timeout: short here.
    let timeout = Duration::from_secs(if fault == Fault::None { 60 } else { 2 });
    let groups = [InProcessComm::group_with_timeout(world, timeout), InProcessComm::group_with_timeout(world, timeout)];
    let src = source(step);
    let out: Vec<(Result<()>, Vec<String>, usize)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let (groups, src) = (&groups, &src);
                s.spawn(move || {
                    let storage_fault = match fault {
                        Fault::Storage { rank: r, at, mode } if r == rank => Some((at, mode)),
                        _ => None,
                    };
                    let comm_fault = match fault {
                        Fault::Collective { rank: None, at } => Some(at),
                        Fault::Collective { rank: Some(r), at } if r == rank => Some(at),
                        _ => None,
                    };
                    let calls = Calls::new(storage_fault);
                    let count = Arc::new(AtomicUsize::new(0));
                    let faulty: Vec<Arc<dyn Storage>> = dsts
                        .iter()
                        .map(|d| Arc::new(Faulty { inner: d.clone(), calls: calls.clone() }) as Arc<dyn Storage>)
                        .collect();
                    // Both communicators of the rank count their collectives together.
                    let comm = FailingComm { inner: groups[0][rank].clone(), count: count.clone(), fail: comm_fault };
                    let commit: Arc<dyn Communicator> = Arc::new(FailingComm {
                        inner: groups[1][rank].clone(),
                        count: count.clone(),
                        fail: comm_fault,
                    });
                    let src_faulty = Faulty { inner: Arc::new(src.clone()), calls: calls.clone() };
                    let r = write(writer, step, &faulty, &comm, commit, &src_faulty, overwrite);
                    let log = calls.log.lock().unwrap().clone();
                    (r, log, count.load(Ordering::SeqCst))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut results = Vec::new();
    let mut logs = Vec::new();
    let mut collectives = Vec::new();
    for (r, l, c) in out {
        results.push(r);
        logs.push(l);
        collectives.push(c);
    }
    (results, logs, collectives)
}

fn fresh(writer: Writer) -> Vec<Arc<dyn Storage>> {
    (0..writer.locations()).map(|_| Arc::new(MemoryStorage::new()) as Arc<dyn Storage>).collect()
}

/// Whether a rank's error says that the save may have committed.
fn says_maybe_committed(e: &Error) -> bool {
    matches!(e, Error::CommitUnknown { .. }) || matches!(e, Error::Comm { reason } if reason.contains("is committed"))
}

/// Names of the files in `storage`, sorted.
fn files(storage: &dyn Storage) -> BTreeSet<String> {
    storage.list().unwrap().into_iter().collect()
}

/// Tallies of a sweep.
#[derive(Default, Debug)]
struct Tally {
    cases: usize,
    old_kept: usize,
    new_committed: usize,
    nothing: usize,
    unknown_reported: usize,
}

/// One case: the checks of the module's doc.
fn case(writer: Writer, overwrite: bool, fault: Fault, tally: &mut Tally) {
    let dsts = fresh(writer);
    if overwrite {
        let (results, ..) = run(writer, OLD, &dsts, false, Fault::None);
        for r in results {
            r.unwrap_or_else(|e| panic!("{writer:?}: the old checkpoint's save failed: {e}"));
        }
    }
    let (results, _, _) = run(writer, NEW, &dsts, overwrite, fault);
    let what = || format!("{writer:?}, overwrite {overwrite}, {fault:?}: {results:?}");
    let st = state(writer, &dsts).unwrap_or_else(|e| panic!("{}: the location holds {e}", what()));
    let allowed = if overwrite { [Some(OLD), Some(NEW)] } else { [None, Some(NEW)] };
    assert!(allowed.contains(&st), "{}: holds {st:?}", what());
    if results.iter().all(Result::is_ok) {
        assert_eq!(st, Some(NEW), "{}: every rank succeeded, the new state is not there", what());
    }
    if st == Some(NEW) {
        for e in results.iter().filter_map(|r| r.as_ref().err()) {
            assert!(says_maybe_committed(e), "{}: committed, yet a rank says it failed: {e}", what());
        }
        if results.iter().any(Result::is_err) {
            tally.unknown_reported += 1;
        }
        tally.new_committed += 1;
    } else {
        assert!(results.iter().all(Result::is_err), "{}: a rank reports success, the new state is not there", what());
        if st.is_some() {
            tally.old_kept += 1;
        } else {
            tally.nothing += 1;
        }
    }
    for d in &dsts {
        match (st, verify(d.as_ref(), 2)) {
            (Some(_), Ok(r)) => assert!(r.problems.is_empty(), "{}: verify: {:?}", what(), r.problems),
            (None, Err(Error::NotCommitted { .. } | Error::NotFound { .. })) => {}
            (_, other) => panic!("{}: holds {st:?}, verify says {other:?}", what()),
        }
        // The save has returned on every rank: its lease (if a fault kept it) is stale.
        gc(d.as_ref(), &GcOptions { break_leases: true }).unwrap_or_else(|e| panic!("{}: gc: {e}", what()));
        assert_eq!(files(d.as_ref()), committed_files(d.as_ref()), "{}: after gc", what());
    }
    assert_eq!(state(writer, &dsts), Ok(st), "{}: gc changed the state", what());
    // The retry.
    let (retry, ..) = run(writer, NEW, &dsts, overwrite, Fault::None);
    for r in retry {
        match r {
            Ok(()) => {}
            Err(Error::AlreadyExists { .. }) if !overwrite && st == Some(NEW) => {}
            Err(e) => panic!("{}: the retry failed: {e}", what()),
        }
    }
    assert_eq!(state(writer, &dsts), Ok(Some(NEW)), "{}: after the retry", what());
    for d in &dsts {
        gc(d.as_ref(), &GcOptions::default()).unwrap();
        assert_eq!(files(d.as_ref()), committed_files(d.as_ref()), "{}: after the retry and gc", what());
    }
    tally.cases += 1;
}

/// Every case of one writer, into a new location and over a committed checkpoint.
fn sweep(writer: Writer) {
    let verbose = std::env::var_os("TESSERA_SWEEP_VERBOSE").is_some();
    let mut tally = Tally::default();
    let mut storage_cases = 0;
    let mut collective_cases = 0;
    for overwrite in [false, true] {
        // A clean run counts each rank's storage calls and collectives.
        let dsts = fresh(writer);
        if overwrite {
            let (r, ..) = run(writer, OLD, &dsts, false, Fault::None);
            r.into_iter().for_each(|r| r.unwrap());
        }
        let (results, logs, collectives) = run(writer, NEW, &dsts, overwrite, Fault::None);
        results.into_iter().for_each(|r| r.unwrap());
        let mut faults = Vec::new();
        for (rank, log) in logs.iter().enumerate() {
            for at in 0..log.len() {
                for mode in [Mode::Error, Mode::Lost] {
                    faults.push(Fault::Storage { rank, at, mode });
                }
            }
        }
        storage_cases += faults.len();
        let n = collectives[0];
        assert!(collectives.iter().all(|&c| c == n), "{writer:?}: ranks made different collectives: {collectives:?}");
        for at in 0..n {
            faults.push(Fault::Collective { rank: None, at });
            collective_cases += 1;
            if writer.world() > 1 {
                for rank in 0..writer.world() {
                    faults.push(Fault::Collective { rank: Some(rank), at });
                    collective_cases += 1;
                }
            }
        }
        for fault in faults {
            if verbose {
                eprintln!("{writer:?} overwrite {overwrite} {fault:?}");
            }
            case(writer, overwrite, fault, &mut tally);
        }
    }
    println!(
        "fault sweep [{writer:?}]: {} cases ({storage_cases} storage faults, {collective_cases} collective faults): \
         old checkpoint kept {}, new one committed {} (of which {} with a rank reporting the outcome unknown), \
         nothing committed in a new location {}; data lost in none",
        tally.cases, tally.old_kept, tally.new_committed, tally.unknown_reported, tally.nothing
    );
}

#[test]
fn every_storage_call_and_collective_of_the_native_save_fails_in_turn() {
    sweep(Writer::Native);
}

#[test]
fn every_storage_call_and_collective_of_the_async_save_fails_in_turn() {
    sweep(Writer::Async);
}

#[test]
fn every_storage_call_and_collective_of_the_torch_dist_save_fails_in_turn() {
    sweep(Writer::TorchDist);
}

#[test]
fn every_storage_call_and_collective_of_the_olmo_save_fails_in_turn() {
    sweep(Writer::Olmo);
}

#[test]
fn every_storage_call_of_convert_fails_in_turn() {
    sweep(Writer::Convert);
}

#[test]
fn every_storage_call_of_convert_to_dcp_fails_in_turn() {
    sweep(Writer::ConvertDcp);
}

// ---------------------------------------------------------------------------------------------
// The export: local files, through its file operations.

/// The export's file operations, failing the `at`-th.
struct FaultyFs {
    calls: Arc<Calls>,
}

struct FaultyFile {
    inner: Box<dyn tessera::__testing::ExportFileIo>,
    path: PathBuf,
    calls: Arc<Calls>,
}

impl tessera::__testing::ExportFs for FaultyFs {
    fn create_new(&self, path: &Path) -> Result<Box<dyn tessera::__testing::ExportFileIo>> {
        let inner = self
            .calls
            .call(|| format!("create {}", path.display()), || tessera::__testing::LocalFs.create_new(path))?;
        Ok(Box::new(FaultyFile { inner, path: path.into(), calls: self.calls.clone() }))
    }
    fn rename(&self, from: &Path, to: &Path) -> Result<()> {
        self.calls.call(|| format!("rename {}", to.display()), || tessera::__testing::LocalFs.rename(from, to))
    }
    fn hard_link(&self, from: &Path, to: &Path) -> Result<()> {
        self.calls.call(|| format!("link {}", to.display()), || tessera::__testing::LocalFs.hard_link(from, to))
    }
    fn remove(&self, path: &Path) -> Result<()> {
        self.calls.call(|| format!("remove {}", path.display()), || tessera::__testing::LocalFs.remove(path))
    }
}

impl tessera::__testing::ExportFileIo for FaultyFile {
    fn write_all(&mut self, data: &[u8]) -> Result<()> {
        let (inner, path) = (&mut self.inner, &self.path);
        self.calls.call(|| format!("write {}", path.display()), || inner.write_all(data))
    }
    fn finish(self: Box<Self>) -> Result<()> {
        let FaultyFile { inner, path, calls } = *self;
        calls.call(|| format!("finish {}", path.display()), move || inner.finish())
    }
}

/// The tensors of the export at `out` (a file, or a sharded directory), by step; `None` when
/// nothing is there.
fn exported_step(out: &Path) -> std::result::Result<Option<u64>, String> {
    if !out.exists() {
        return Ok(None);
    }
    let storage = tessera::storage::Location::parse(out.to_str().unwrap()).open().map_err(|e| e.to_string())?;
    step_at(storage.as_ref(), &["w", "b"], false, &[OLD, NEW])
}

fn export_sweep(sharded: bool) {
    let root = TempDir::new(if sharded { "sweep-export-sharded" } else { "sweep-export" });
    let mut cases = 0;
    let mut outcomes = BTreeMap::<String, usize>::new();
    for overwrite in [false, true] {
        let opts = ExportOptions { max_shard_size: sharded.then_some(64), ..ExportOptions::default() };
        let export = |dir: &Path, step: u64, fail: Option<(usize, Mode)>| {
            let out = if sharded { dir.join("hf") } else { dir.join("model.safetensors") };
            let calls = Calls::new(fail);
            let r = tessera::__testing::export_with(
                &source(step),
                &out,
                &opts,
                &mut |_, _| {},
                &FaultyFs { calls: calls.clone() },
            );
            let n = calls.count.load(Ordering::SeqCst);
            (out, r, n)
        };
        let clean = root.join(&format!("clean-{overwrite}"));
        if overwrite {
            export(&clean, OLD, None).1.unwrap();
        }
        let (_, r, n) = export(&clean, NEW, None);
        r.unwrap();
        for at in 0..n {
            for mode in [Mode::Error, Mode::Lost] {
                let dir = root.join(&format!("case-{overwrite}-{at}-{mode:?}"));
                std::fs::create_dir_all(&dir).unwrap();
                if overwrite {
                    export(&dir, OLD, None).1.unwrap();
                }
                let (out, r, _) = export(&dir, NEW, Some((at, mode)));
                let what = format!("export (sharded {sharded}), overwrite {overwrite}, call {at} {mode:?}: {r:?}");
                let st = exported_step(&out).unwrap_or_else(|e| panic!("{what}: {e}"));
                // A failed export leaves the old export, or nothing: every output name is put back.
                let outcome = match (&r, st) {
                    (Ok(_), Some(NEW)) => "new",
                    (Err(_), Some(OLD)) if overwrite => "old kept",
                    (Err(_), None) if !overwrite => "nothing",
                    _ => panic!("{what}: holds {st:?}"),
                };
                *outcomes.entry(outcome.into()).or_default() += 1;
                // No temporary is left beside the output, but those a complete export reports.
                let leftover: BTreeSet<String> = std::fs::read_dir(if sharded { out.clone() } else { dir.clone() })
                    .map(|rd| {
                        rd.filter_map(|e| e.ok()?.file_name().into_string().ok())
                            .filter(|n| n.contains(".tmp-"))
                            .collect()
                    })
                    .unwrap_or_default();
                let reported: BTreeSet<String> = r.as_ref().map_or_else(
                    |_| BTreeSet::new(),
                    |rep| rep.leftovers.iter().map(|p| p.file_name().unwrap().to_str().unwrap().to_string()).collect(),
                );
                assert_eq!(leftover, reported, "{what}: temporaries left");
                // The retry.
                let (_, retry, _) = export(&dir, NEW, None);
                retry.unwrap_or_else(|e| panic!("{what}: the retry failed: {e}"));
                assert_eq!(exported_step(&out), Ok(Some(NEW)), "{what}: after the retry");
                std::fs::remove_dir_all(&dir).unwrap();
                cases += 1;
            }
        }
    }
    println!("fault sweep [export, sharded {sharded}]: {cases} cases: {outcomes:?}; data lost in none");
}

#[test]
fn every_file_operation_of_an_export_fails_in_turn() {
    export_sweep(false);
}

#[test]
fn every_file_operation_of_a_sharded_export_fails_in_turn() {
    export_sweep(true);
}
