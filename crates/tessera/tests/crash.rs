//! Crash injection (issue 4): a child process saving checkpoints is killed with SIGKILL at random
//! instants, and every directory it was writing into is then checked.
//!
//! The test binary re-executes itself as the child (`crash_child`, ignored in a normal run and a
//! no-op without `TESSERA_CRASH_ROOT`). With 4 in-process ranks (TP 2 × DP 2: row and column
//! splits, an expert axis, distributed-optimizer flat ranges, replicated shards, sharded objects,
//! common values) it saves step 1, 2, … — content a deterministic function of the step — each into
//! a new directory `step-<N>` and then over the committed `latest` (`overwrite`). It prints a line
//! before and after every save, so the parent knows which saves committed and which was in flight.
//!
//! After the kill, every directory under the root must either load (the full state, every byte
//! equal to the step the checkpoint says it holds, and `verify` finds no problem) or be reported
//! `NotCommitted` by both load and verify. The previous checkpoints (`step-0`, `latest`, earlier
//! steps) and every save the child reported must load. Then `gc` runs on every directory:
//! committed checkpoints load identically afterwards, uncommitted ones keep no tessera file.
//!
//! Kill delays are drawn (seeded) over the duration of an uninterrupted calibration run of the
//! child (2 steps: 4 saves), mostly inside its saves. Environment: `TESSERA_CRASH_INSTANTS`
//! (default 50), `TESSERA_CRASH_MODE` (`sync`), `TESSERA_CRASH_SEED`, `TESSERA_CRASH_VERBOSE`
//! (a line per instant). `scripts/ci/crash_test.sh` runs it in release with 500 instants.
#![cfg(unix)]

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::ops::Range;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::common::*;
use tessera::comm::*;
use tessera::index::*;
use tessera::storage::*;
use tessera::tools::*;
use tessera::*;

const ROOT_ENV: &str = "TESSERA_CRASH_ROOT";
/// gc after the child was killed: its leases would hold until they expire.
const BROKEN: GcOptions = GcOptions { break_leases: true };
const MODE_ENV: &str = "TESSERA_CRASH_MODE";
const FIRST_ENV: &str = "TESSERA_CRASH_FIRST";
const STEPS_ENV: &str = "TESSERA_CRASH_STEPS";
/// Prefix of the child's protocol lines (libtest may print before it on the same line).
const MARK: &str = "crash-child:";
const TP: usize = 2;
const DP: usize = 2;
const WORLD: usize = TP * DP;
/// Steps of the uninterrupted calibration run: the kill delays are spread over its duration.
const CALIBRATION_STEPS: u64 = 2;
/// Steps a killed child would save at most (it is normally killed within the first two).
const MAX_STEPS: u64 = 20;

// ---------------------------------------------------------------------------------------------
// The saved state: a deterministic function of the step.

/// How a tensor is spread over the ranks (`tp = rank % TP`, `dp = rank / TP`).
#[derive(Debug, Clone, Copy)]
enum Split {
    /// Column-parallel: axis 0 split over TP, DP ranks hold replicas.
    Rows,
    /// Row-parallel: axis 1 split over TP (non-contiguous boxes), DP ranks hold replicas.
    Cols,
    /// One expert (axis 0, absent from the local shape) per rank.
    Experts,
    /// Distributed optimizer: the TP row box, its flattening split unevenly over DP.
    RowsFlatDp,
    /// The last axis split over all ranks.
    Last,
    /// Whole on every rank, replica id = rank.
    Replicated,
    /// Whole on every rank, replica id `[tp, dp]`.
    ReplicatedTpDp,
}

struct Spec {
    key: &'static str,
    dtype: DType,
    shape: &'static [u64],
    split: Split,
}

/// About 4.4 MiB in all.
const TENSORS: &[Spec] = &[
    Spec { key: "qkv", dtype: DType::F32, shape: &[768, 512], split: Split::Rows },
    Spec { key: "proj", dtype: DType::BF16, shape: &[512, 768], split: Split::Cols },
    Spec { key: "embedding", dtype: DType::F16, shape: &[1000, 256], split: Split::Rows },
    Spec { key: "experts", dtype: DType::I32, shape: &[4, 64, 96], split: Split::Experts },
    Spec { key: "qkv_exp_avg", dtype: DType::F32, shape: &[768, 512], split: Split::RowsFlatDp },
    Spec { key: "tokens", dtype: DType::U16, shape: &[2, 3, 1000], split: Split::Last },
    Spec { key: "norm", dtype: DType::F64, shape: &[512], split: Split::ReplicatedTpDp },
    Spec { key: "counters", dtype: DType::I64, shape: &[7], split: Split::Replicated },
    Spec { key: "scale", dtype: DType::F8E4M3, shape: &[], split: Split::Replicated },
];

/// Sharded objects: key and grid; "rng" has one cell per rank, "dataloader" one per TP rank
/// (DP ranks hold replicas).
const OBJECTS: &[(&str, u64)] = &[("rng", WORLD as u64), ("dataloader", TP as u64)];

/// Random global bytes of every tensor, generated once per process (slow in a debug build).
fn bases() -> &'static [Vec<u8>] {
    static BASES: std::sync::OnceLock<Vec<Vec<u8>>> = std::sync::OnceLock::new();
    BASES.get_or_init(|| {
        TENSORS
            .iter()
            .enumerate()
            .map(|(i, s)| Rng::new(0x7e55_e4a0 + i as u64).bytes(numel(s.shape) as usize * s.dtype.size()))
            .collect()
    })
}

/// The global bytes of every tensor of `step`, in `TENSORS` order: its base rotated by an amount
/// that depends on the step (two copies, cheap), so bytes of another step or at another offset
/// differ.
fn truth(step: u64) -> Vec<Vec<u8>> {
    bases()
        .iter()
        .enumerate()
        .map(|(i, b)| {
            let k = ((step * 1_000_003 + i as u64 * 7919) % b.len() as u64) as usize;
            let mut v = Vec::with_capacity(b.len());
            v.extend_from_slice(&b[k..]);
            v.extend_from_slice(&b[..k]);
            v
        })
        .collect()
}

fn object_bytes(step: u64, object: usize, cell: u64) -> Vec<u8> {
    let mut rng = Rng::new(0x0b1e_c700_0000 ^ step << 16 ^ (object as u64) << 8 ^ cell);
    let len = 16 + rng.below(64) as usize;
    rng.bytes(len)
}

fn args_value(step: u64) -> Value {
    let s = step as i64;
    Value::Map(vec![
        ("lr".into(), Value::Float(1e-3 * (s + 1) as f64)),
        ("run".into(), Value::Str(format!("crash-{step}"))),
        ("flags".into(), Value::List(vec![Value::Bool(s % 2 == 0), Value::Null, Value::Int(-s)])),
    ])
}

fn content_metadata(step: u64) -> Value {
    Value::Map(vec![("step".into(), Value::Int(step as i64)), ("by".into(), Value::Str("crash-test".into()))])
}

/// One rank's piece of a tensor: box, prepended axes, flat range, replica id.
struct Piece {
    off: Vec<u64>,
    shape: Vec<u64>,
    prepend: usize,
    flat: Option<Range<u64>>,
    replica: ReplicaId,
}

fn piece(spec: &Spec, rank: usize) -> Piece {
    let (tp, dp) = ((rank % TP) as u64, (rank / TP) as u32);
    let g = spec.shape;
    let mut p = Piece { off: vec![0; g.len()], shape: g.to_vec(), prepend: 0, flat: None, replica: ReplicaId::main() };
    match spec.split {
        Split::Rows | Split::RowsFlatDp => {
            let n = g[0] / TP as u64;
            p.off[0] = tp * n;
            p.shape[0] = n;
            if matches!(spec.split, Split::RowsFlatDp) {
                let len = numel(&p.shape);
                let cut = len * 52 / 100 + 3; // uneven, not at a row boundary
                p.flat = Some(if dp == 0 { 0..cut } else { cut..len });
            } else {
                p.replica = ReplicaId::from(dp);
            }
        }
        Split::Cols => {
            let n = g[1] / TP as u64;
            p.off[1] = tp * n;
            p.shape[1] = n;
            p.replica = ReplicaId::from(dp);
        }
        Split::Experts => {
            p.off[0] = rank as u64;
            p.shape[0] = 1;
            p.prepend = 1;
        }
        Split::Last => {
            let last = g.len() - 1;
            let n = g[last] / WORLD as u64;
            p.off[last] = rank as u64 * n;
            p.shape[last] = n;
        }
        Split::Replicated => p.replica = ReplicaId::from(rank as u32),
        Split::ReplicatedTpDp => p.replica = ReplicaId::from([tp as u32, dp]),
    }
    p
}

/// The bytes of box (`off`, `shape`) of a row-major global tensor, copied by innermost runs.
fn extract_box(truth: &[u8], global: &[u64], esize: usize, off: &[u64], shape: &[u64]) -> Vec<u8> {
    let n = global.len();
    if n == 0 {
        return truth.to_vec();
    }
    let mut out = Vec::with_capacity(numel(shape) as usize * esize);
    if numel(shape) == 0 {
        return out;
    }
    let run = shape[n - 1] as usize * esize;
    let mut idx = vec![0u64; n - 1];
    loop {
        let mut lin = 0u64;
        for d in 0..n - 1 {
            lin = lin * global[d] + off[d] + idx[d];
        }
        let at = (lin * global[n - 1] + off[n - 1]) as usize * esize;
        out.extend_from_slice(&truth[at..at + run]);
        let mut d = n - 1;
        loop {
            if d == 0 {
                return out;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

/// Rank `rank`'s state at `step` (owned bytes).
fn rank_tree(rank: usize, step: u64, truth: &[Vec<u8>]) -> StateTree<'static> {
    let mut tree = StateTree::map();
    for (spec, t) in TENSORS.iter().zip(truth) {
        let p = piece(spec, rank);
        let esize = spec.dtype.size();
        let mut data = extract_box(t, spec.shape, esize, &p.off, &p.shape);
        if let Some(r) = &p.flat {
            data = data[r.start as usize * esize..r.end as usize * esize].to_vec();
        }
        let st = shard(spec.key, spec.dtype, spec.shape, &p.off, &p.shape, p.prepend, p.flat, TensorData::Owned(data))
            .with_replica_id(p.replica);
        tree.insert(spec.key, StateTree::Tensor(st));
    }
    for (o, &(key, grid)) in OBJECTS.iter().enumerate() {
        let cell = rank as u64 % grid;
        let replica = (rank as u64 / grid) as u32;
        let obj = ShardedObject::new(key, object_bytes(step, o, cell), &[grid], &[cell]).with_replica_id(replica);
        tree.insert(key, StateTree::Object(obj));
    }
    tree.insert("step", StateTree::Value(Value::Int(step as i64)));
    tree.insert("args", StateTree::Value(args_value(step)));
    tree
}

// ---------------------------------------------------------------------------------------------
// Saving (the child; the parent also uses it for the initial step 0).

/// How the child saves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// `tessera::save`.
    Sync,
    /// `tessera::AsyncSaver::save` (staged through a small pool, in waves), then `finalize`.
    Async,
}

impl Mode {
    fn from_env() -> Mode {
        match std::env::var(MODE_ENV).ok().as_deref() {
            None | Some("") | Some("sync") => Mode::Sync,
            Some("async") => Mode::Async,
            Some(other) => panic!("{MODE_ENV}={other}: unknown mode (known: sync, async)"),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Mode::Sync => "sync",
            Mode::Async => "async",
        }
    }
}

/// What one rank keeps across its saves. Another mode adds a `Mode` variant (named in
/// `from_env` and `name`) and its arm in [`save_step`]; an async mode would keep its saver here
/// and finalize before returning, so "committed" is printed only once the index is in place.
struct RankSaver {
    mode: Mode,
    /// Async mode: this rank's saver (its pool holds less than a save, so saves go in waves).
    async_saver: Option<AsyncSaver>,
}

impl RankSaver {
    fn new(mode: Mode, commit_comm: InProcessComm) -> RankSaver {
        let async_saver = match mode {
            Mode::Sync => None,
            Mode::Async => {
                let pool = StagingPool::with_buffer_size(1 << 20, 256 << 10).unwrap();
                Some(AsyncSaver::new(pool, std::sync::Arc::new(commit_comm)))
            }
        };
        RankSaver { mode, async_saver }
    }
}

/// Saves one rank's `tree` into `dir`; returns once the checkpoint is committed.
fn save_step(
    saver: &mut RankSaver,
    tree: StateTree<'static>,
    dir: &Path,
    comm: &InProcessComm,
    opts: &SaveOptions,
) -> Result<()> {
    match saver.mode {
        Mode::Sync => save(tree, &LocalStorage::new(dir), comm, opts).map(|_| ()),
        Mode::Async => {
            let saver = saver.async_saver.as_mut().expect("async mode has a saver");
            let storage = std::sync::Arc::new(LocalStorage::new(dir));
            saver.save(tree, storage, comm, opts)?.finalize().map(|_| ())
        }
    }
}

/// Which directory a save goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Target {
    Step(u64),
    Latest,
}

impl Target {
    fn dir_name(self) -> String {
        match self {
            Target::Step(n) => format!("step-{n}"),
            Target::Latest => "latest".into(),
        }
    }

    fn parse(name: &str) -> Option<Target> {
        if name == "latest" {
            return Some(Target::Latest);
        }
        name.strip_prefix("step-")?.parse().ok().map(Target::Step)
    }
}

/// When the child said it was ready: its lines carry microseconds since then.
static READY: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();

fn report(what: &str, target: Target, step: u64) {
    let at = READY.get_or_init(Instant::now).elapsed().as_micros();
    let mut out = std::io::stdout().lock();
    writeln!(out, "{MARK} {what} {} {step} {at}", target.dir_name()).unwrap();
    out.flush().unwrap();
}

/// Saves steps `first..first + steps` into `root/step-<N>` (new) and `root/latest` (overwrite),
/// on `WORLD` in-process ranks. `verbose`: print a line before and after every save.
fn save_steps(root: &Path, mode: Mode, first: u64, steps: u64, verbose: bool) {
    let shared: std::sync::Mutex<std::sync::Arc<Vec<Vec<u8>>>> = Default::default();
    let commit = InProcessComm::group(WORLD);
    InProcessComm::run(WORLD, |c| {
        let rank = c.rank();
        let mut saver = RankSaver::new(mode, commit[rank].clone());
        for step in first..first + steps {
            if rank == 0 {
                *shared.lock().unwrap() = std::sync::Arc::new(truth(step));
            }
            c.barrier().unwrap();
            let t = shared.lock().unwrap().clone();
            for target in [Target::Step(step), Target::Latest] {
                // The state is built (copied out of the truth) before the save begins.
                let tree = rank_tree(rank, step, &t);
                c.barrier().unwrap();
                if rank == 0 && verbose {
                    report("begin", target, step);
                }
                let opts = SaveOptions {
                    overwrite: target == Target::Latest,
                    content_metadata: content_metadata(step),
                    threads: 2,
                    block_size: 256 << 10,
                    ..Default::default()
                };
                let dir = root.join(target.dir_name());
                save_step(&mut saver, tree, &dir, c, &opts)
                    .unwrap_or_else(|e| panic!("rank {rank}: saving step {step} into {}: {e}", dir.display()));
                if rank == 0 && verbose {
                    report("committed", target, step);
                }
            }
        }
    });
}

/// The child process. Does nothing unless started by the parent test (`TESSERA_CRASH_ROOT`).
#[test]
#[ignore = "child process of the crash test (kill9_at_random_instants_never_loads_half_written)"]
fn crash_child() {
    let Some(root) = std::env::var_os(ROOT_ENV) else { return };
    let num = |var: &str| std::env::var(var).ok().and_then(|s| s.parse::<u64>().ok());
    let first = num(FIRST_ENV).unwrap_or(1);
    let steps = num(STEPS_ENV).unwrap_or(MAX_STEPS).min(MAX_STEPS);
    bases();
    let mut out = std::io::stdout().lock();
    READY.get_or_init(Instant::now);
    writeln!(out, "{MARK} ready").unwrap();
    out.flush().unwrap();
    drop(out);
    save_steps(Path::new(&root), Mode::from_env(), first, steps, true);
}

// ---------------------------------------------------------------------------------------------
// Checking (the parent).

/// A line of the child: a save began, or committed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Event {
    committed: bool,
    target: Target,
    step: u64,
    /// When the child printed it, since it was ready.
    at: Duration,
}

fn parse_events(stdout: &str) -> std::result::Result<Vec<Event>, String> {
    let mut events = Vec::new();
    for line in stdout.lines() {
        let Some(at) = line.find(MARK) else { continue };
        let words: Vec<&str> = line[at + MARK.len()..].split_whitespace().collect();
        if words == ["ready"] {
            continue;
        }
        let bad = || format!("unparsable child line {line:?}");
        let [what, dir, step, at] = words[..] else { return Err(bad()) };
        events.push(Event {
            committed: match what {
                "begin" => false,
                "committed" => true,
                _ => return Err(bad()),
            },
            target: Target::parse(dir).ok_or_else(bad)?,
            step: step.parse().map_err(|_| bad())?,
            at: Duration::from_micros(at.parse().map_err(|_| bad())?),
        });
    }
    Ok(events)
}

/// Names tessera writes into a checkpoint directory (FORMAT.md), other than the index.
fn is_tessera_leftover_name(name: &str) -> bool {
    // Temporaries of puts that never finished (the index, a lease), and the leases of killed
    // saves.
    if (name.starts_with('.') && name.contains(".tmp-")) || name.starts_with(".tessera-lease-") {
        return true;
    }
    let Some(stem) = name.strip_suffix(".safetensors") else { return false };
    let Some((id, rank)) = stem.split_once("-r") else { return false };
    id.len() == 16
        && id.bytes().all(|b| b.is_ascii_hexdigit())
        && rank.len() == 5
        && rank.bytes().all(|b| b.is_ascii_digit())
}

/// The full state, as one rank of a job of one: every tensor whole, every object cell.
fn request_tree() -> StateTree<'static> {
    let mut tree = StateTree::map();
    for s in TENSORS {
        tree.insert(s.key, StateTree::Tensor(ShardedTensor::full(s.key, s.dtype, s.shape, TensorData::None)));
    }
    for &(key, grid) in OBJECTS {
        let cells = (0..grid)
            .map(|cell| {
                let mut o = ShardedObject::new(key, Vec::new(), &[grid], &[cell]);
                o.data = None;
                StateTree::Object(o)
            })
            .collect();
        tree.insert(key, StateTree::List(cells));
    }
    tree
}

type Truths = BTreeMap<u64, Vec<Vec<u8>>>;

/// Loads the full state. `Ok(Ok(step))`: it loaded and holds exactly step `step`'s content;
/// `Ok(Err(e))`: load failed with `e`; `Err`: it loaded, but not a step's exact content.
fn load_and_check(storage: &LocalStorage, truths: &mut Truths) -> std::result::Result<Result<u64>, String> {
    let opts = LoadOptions { threads: 2, strict: StrictHandling::RaiseAll, ..Default::default() };
    let loaded = match load(request_tree(), storage, &SoloComm, &opts) {
        Ok(l) => l,
        Err(e) => return Ok(Err(e)),
    };
    let state = &loaded.state;
    let step = match state.get_dotted("step").and_then(StateTree::as_value) {
        Some(Value::Int(s)) if *s >= 0 => *s as u64,
        other => return Err(format!("loaded, but the common value \"step\" is {other:?}")),
    };
    let truth = truths.entry(step).or_insert_with(|| truth(step));
    for (spec, t) in TENSORS.iter().zip(truth.iter()) {
        let got = state.get_dotted(spec.key).and_then(StateTree::as_tensor).and_then(|x| x.data.bytes());
        let Some(got) = got else { return Err(format!("loaded, but tensor {:?} has no data", spec.key)) };
        if got != &t[..] {
            let first = got.iter().zip(t.iter()).position(|(a, b)| a != b).unwrap_or(got.len().min(t.len()));
            return Err(format!(
                "loaded step {step}, but tensor {:?} differs from its content (length {} vs {}, first difference at \
                 byte {first})",
                spec.key,
                got.len(),
                t.len()
            ));
        }
    }
    for (o, &(key, grid)) in OBJECTS.iter().enumerate() {
        for cell in 0..grid {
            let got = state.get_dotted(&format!("{key}.{cell}")).and_then(StateTree::as_object);
            let got = got.and_then(|x| x.data.as_deref());
            if got != Some(&object_bytes(step, o, cell)[..]) {
                return Err(format!("loaded step {step}, but object {key:?} cell {cell} differs"));
            }
        }
    }
    let args = state.get_dotted("args").and_then(tree_value);
    if args.as_ref() != Some(&args_value(step)) {
        return Err(format!("loaded step {step}, but the common value \"args\" is {args:?}"));
    }
    match open(storage).map(|c| c.content_metadata().clone()) {
        Ok(m) if m == content_metadata(step) => {}
        other => return Err(format!("loaded step {step}, but its content metadata is {other:?}")),
    }
    Ok(Ok(step))
}

/// What one directory turned out to be.
#[derive(Debug, Clone, Default)]
struct DirReport {
    /// The step it holds, when committed.
    step: Option<u64>,
    /// Tessera files the committed index (if any) does not reference, before gc.
    leftovers: usize,
}

macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err(format!($($fmt)+));
        }
    };
}

/// Checks one directory: loads and verifies; committed with a step in `allowed`, or (unless
/// `must_commit`) not committed; then gc and the same checks again.
fn check_dir(
    dir: &Path,
    allowed: &[u64],
    must_commit: bool,
    truths: &mut Truths,
) -> std::result::Result<DirReport, String> {
    let storage = LocalStorage::new(dir);
    let before = names(&storage);
    let stray: Vec<&String> = before.iter().filter(|n| *n != INDEX_FILE && !is_tessera_leftover_name(n)).collect();
    ensure!(stray.is_empty(), "files tessera does not write: {stray:?}");
    let tessera_files: BTreeSet<String> = before.iter().filter(|n| is_tessera_leftover_name(n)).cloned().collect();
    let loaded = load_and_check(&storage, truths)?;
    let verified = verify(&storage, 2);
    match loaded {
        Ok(step) => {
            ensure!(allowed.contains(&step), "committed, holding step {step}; expected one of {allowed:?}");
            match &verified {
                Ok(rep) if rep.problems.is_empty() && rep.files > 0 => {}
                other => return Err(format!("step {step} loads, but verify says {other:?}")),
            }
            let referenced: BTreeSet<String> = open(&storage)
                .map(Checkpoint::into_index)
                .map_err(|e| e.to_string())?
                .files
                .into_iter()
                .map(|f| f.name)
                .collect();
            let missing: Vec<&String> = referenced.difference(&tessera_files).collect();
            ensure!(missing.is_empty(), "the index references files that are not there: {missing:?}");
            let leftovers: Vec<String> = tessera_files.difference(&referenced).cloned().collect();
            let removed = gc(&storage, &BROKEN)
                .map(|r| r.removed)
                .map_err(|e| format!("gc of a committed checkpoint failed: {e}"))?;
            ensure!(removed == leftovers, "gc removed {removed:?}; the leftovers were {leftovers:?}");
            let after: BTreeSet<String> = names(&storage).into_iter().filter(|n| n != INDEX_FILE).collect();
            ensure!(after == referenced, "after gc: {after:?}; the index references {referenced:?}");
            match load_and_check(&storage, truths)? {
                Ok(s) if s == step => {}
                other => return Err(format!("step {step} loaded before gc; after gc: {other:?}")),
            }
            ensure!(
                matches!(verify(&storage, 2), Ok(ref r) if r.problems.is_empty()),
                "verify after gc: {:?}",
                verify(&storage, 2)
            );
            Ok(DirReport { step: Some(step), leftovers: leftovers.len() })
        }
        Err(Error::NotCommitted { .. }) => {
            ensure!(!must_commit, "must hold a committed checkpoint, but load says NotCommitted");
            ensure!(
                matches!(verified, Err(Error::NotCommitted { .. })),
                "load says NotCommitted, verify says {verified:?}"
            );
            let removed = gc(&storage, &BROKEN)
                .map(|r| r.removed)
                .map_err(|e| format!("gc of an uncommitted directory failed: {e}"))?;
            let leftovers: Vec<String> = tessera_files.iter().cloned().collect();
            ensure!(removed == leftovers, "gc removed {removed:?}; the leftovers were {leftovers:?}");
            let after = names(&storage);
            ensure!(after.is_empty(), "after gc of an uncommitted directory, left: {after:?}");
            // Nothing is left, so load sees an empty location.
            match load(request_tree(), &storage, &SoloComm, &LoadOptions::default()) {
                Err(Error::NotFound { .. } | Error::NotCommitted { .. }) => {}
                other => return Err(format!("after gc, load of an emptied directory: {other:?}")),
            }
            Ok(DirReport { step: None, leftovers: leftovers.len() })
        }
        // Created by the save, killed before its first file: an empty location.
        Err(Error::NotFound { .. }) if before.is_empty() => {
            ensure!(!must_commit, "must hold a committed checkpoint, but it is empty");
            ensure!(matches!(verified, Err(Error::NotFound { .. })), "load says NotFound, verify says {verified:?}");
            let removed = gc(&storage, &BROKEN)
                .map(|r| r.removed)
                .map_err(|e| format!("gc of an empty directory failed: {e}"))?;
            ensure!(removed.is_empty(), "gc of an empty directory removed {removed:?}");
            Ok(DirReport::default())
        }
        Err(e) => Err(format!("load failed with {e:?}: neither a committed checkpoint nor NotCommitted")),
    }
}

/// What happened to the save in flight when the child was killed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Outcome {
    /// It had committed (the child had no time to report it).
    Committed,
    /// It had written files but not committed; gc removed them.
    Leftovers,
    /// No file of it existed (killed in startup, between saves, or before the first file).
    BeforeAnyFile,
    /// The child finished all its steps before the kill (no save in flight).
    Finished,
}

/// Checks every directory under `root` against what the child reported.
fn check_root(root: &Path, events: &[Event], finished: bool) -> std::result::Result<Outcome, String> {
    let committed: BTreeSet<(Target, u64)> =
        events.iter().filter(|e| e.committed).map(|e| (e.target, e.step)).collect();
    let mut begun = BTreeSet::new();
    for e in events.iter().filter(|e| !e.committed) {
        ensure!(begun.insert((e.target, e.step)), "the child began {e:?} twice");
    }
    ensure!(committed.is_subset(&begun), "the child reported a commit it never began: {events:?}");
    let in_flight = match events.last() {
        Some(e) if !e.committed => Some((e.target, e.step)),
        _ => None,
    };
    ensure!(
        begun.len() == committed.len() + usize::from(in_flight.is_some()),
        "saves begun but neither committed nor in flight: {events:?}"
    );
    ensure!(!(finished && in_flight.is_some()), "the child exited successfully during a save: {events:?}");
    let last_latest = committed.iter().filter(|(t, _)| *t == Target::Latest).map(|(_, s)| *s).max().unwrap_or(0);

    let mut truths = Truths::new();
    let mut reports: BTreeMap<Target, DirReport> = BTreeMap::new();
    let entries = std::fs::read_dir(root).map_err(|e| format!("{}: {e}", root.display()))?;
    let mut dirs: Vec<String> = entries
        .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect::<std::io::Result<_>>()
        .map_err(|e| e.to_string())?;
    dirs.sort();
    for name in dirs {
        let target = Target::parse(&name).ok_or_else(|| format!("unexpected entry {name:?} in the root"))?;
        let (allowed, must_commit) = match target {
            Target::Step(0) => (vec![0], true),
            Target::Step(n) => {
                ensure!(begun.contains(&(target, n)), "{name}: the child never began saving step {n}");
                (vec![n], committed.contains(&(target, n)))
            }
            Target::Latest => {
                let mut allowed = vec![last_latest];
                if let Some((Target::Latest, s)) = in_flight {
                    allowed.push(s);
                }
                (allowed, true)
            }
        };
        let rep =
            check_dir(&root.join(&name), &allowed, must_commit, &mut truths).map_err(|e| format!("{name}: {e}"))?;
        reports.insert(target, rep);
    }
    for t in [Target::Step(0), Target::Latest].into_iter().chain(committed.iter().map(|(t, _)| *t)) {
        ensure!(reports.contains_key(&t), "{} is missing", t.dir_name());
    }
    Ok(match in_flight {
        None if finished => Outcome::Finished,
        None => Outcome::BeforeAnyFile,
        Some((target, step)) => match reports.get(&target) {
            Some(r) if r.step == Some(step) => Outcome::Committed,
            Some(r) if r.leftovers > 0 => Outcome::Leftovers,
            _ => Outcome::BeforeAnyFile,
        },
    })
}

/// The checks are not vacuous: a committed checkpoint with missing bytes, or holding bytes that
/// are not its step's, is rejected; one without its index is reported not committed and emptied.
#[test]
fn the_checks_reject_what_a_half_written_save_would_leave() {
    let root = TempDir::created("crash-checks");
    save_steps(root.path(), Mode::Sync, 3, 1, false);
    let mut truths = Truths::new();
    let step3 = root.join("step-3");
    assert_eq!(check_dir(&step3, &[3], true, &mut truths).unwrap().step, Some(3));
    let e = check_dir(&step3, &[4], true, &mut truths).unwrap_err();
    assert!(e.contains("holding step 3"), "{e}");

    // A data file cut short under a committed index.
    let file = step3.join(&data_files(&LocalStorage::new(&step3))[0]);
    let len = std::fs::metadata(&file).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&file).unwrap().set_len(len / 2).unwrap();
    let e = check_dir(&step3, &[3], true, &mut truths).unwrap_err();
    assert!(e.contains("Corrupt"), "{e}");

    // Consistent checksums, but step 4's tensors under step 3's name.
    let mixed = root.join("mixed");
    let t4 = truth(4);
    run_ranks(WORLD, |c| {
        let mut tree = rank_tree(c.rank(), 4, &t4);
        tree.insert("step", StateTree::Value(Value::Int(3)));
        let opts = SaveOptions { content_metadata: content_metadata(3), threads: 2, ..Default::default() };
        save(tree, &LocalStorage::new(&mixed), c, &opts).unwrap();
    });
    let e = check_dir(&mixed, &[3], true, &mut truths).unwrap_err();
    assert!(e.contains("differs"), "{e}");

    // No index: not committed; gc leaves nothing.
    let latest = root.join("latest");
    std::fs::remove_file(latest.join(INDEX_FILE)).unwrap();
    let e = check_dir(&latest, &[3], true, &mut truths).unwrap_err();
    assert!(e.contains("NotCommitted"), "{e}");
    let rep = check_dir(&latest, &[3], false, &mut truths).unwrap();
    assert_eq!((rep.step, rep.leftovers), (None, WORLD));
    assert!(names(&LocalStorage::new(&latest)).is_empty());
}

/// A fresh root holding copies of the template's committed `step-0` and `latest`.
fn fresh_root(template: &Path, tag: &str) -> PathBuf {
    let root = std::env::temp_dir().join(format!("tessera-crash-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    for dir in ["step-0", "latest"] {
        std::fs::create_dir_all(root.join(dir)).unwrap();
        for e in std::fs::read_dir(template.join(dir)).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), root.join(dir).join(e.file_name())).unwrap();
        }
    }
    root
}

/// How a child run ended.
struct ChildRun {
    status: std::process::ExitStatus,
    stdout: String,
    stderr: String,
    /// From the child's "ready" line to its end (exit or kill).
    span: Duration,
}

impl ChildRun {
    fn killed(&self) -> bool {
        self.status.signal() == Some(libc::SIGKILL)
    }

    fn describe(&self) -> String {
        format!("child {:?}\n--- stdout\n{}\n--- stderr\n{}", self.status, self.stdout, self.stderr)
    }
}

/// Runs a child saving `steps` steps into `root`; with `kill_after`, sends it SIGKILL that long
/// after it is ready (process started, before its first save).
fn run_child(root: &Path, mode: Mode, steps: u64, kill_after: Option<Duration>) -> ChildRun {
    use std::io::{BufRead, Read};
    let mut child = crate::common::rerun_alone(&crate::common::test_path(module_path!(), "crash_child"))
        .env(ROOT_ENV, root)
        .env(MODE_ENV, mode.name())
        .env(FIRST_ENV, "1")
        .env(STEPS_ENV, steps.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning the crash child");
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut text = String::new();
    loop {
        let len = text.len();
        if stdout.read_line(&mut text).unwrap() == 0 || text[len..].contains(&format!("{MARK} ready")) {
            break;
        }
    }
    let ready = Instant::now();
    if let Some(delay) = kill_after {
        std::thread::sleep(delay);
        // SAFETY: a plain syscall; the child is not reaped yet, so its pid cannot have been reused.
        let rc = unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGKILL) };
        assert_eq!(rc, 0, "kill: {}", std::io::Error::last_os_error());
    }
    stdout.read_to_string(&mut text).unwrap();
    let mut stderr = String::new();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    let status = child.wait().unwrap();
    ChildRun { status, stdout: text, stderr, span: ready.elapsed() }
}

/// A kill delay (since the child is ready): three times in four inside one of the calibration
/// run's saves (from its "begin" to its "committed" line, widened by a millisecond on each side),
/// otherwise anywhere in the run (startup, building the state, between saves).
fn pick_delay(rng: &mut Rng, saves: &[(Duration, Duration)], span: Duration) -> Duration {
    let us = |d: Duration| d.as_micros() as u64;
    if saves.is_empty() || rng.chance(1, 4) {
        return Duration::from_micros(rng.below(us(span) + 1));
    }
    let &(begin, committed) = rng.pick(saves);
    Duration::from_micros(rng.range(us(begin).saturating_sub(1000), us(committed) + 1000))
}

#[test]
fn kill9_during_sync_saves_never_loads_half_written() {
    kill9_campaign(Mode::Sync);
}

#[test]
fn kill9_during_async_saves_never_loads_half_written() {
    kill9_campaign(Mode::Async);
}

/// Kills a child saving in `mode` at `TESSERA_CRASH_INSTANTS` random instants and checks
/// every outcome.
fn kill9_campaign(mode: Mode) {
    let env_num = |var: &str, default: u64| std::env::var(var).ok().and_then(|s| s.parse().ok()).unwrap_or(default);
    let instants = env_num("TESSERA_CRASH_INSTANTS", 50);
    let seed = env_num("TESSERA_CRASH_SEED", 0x00c0_ffee);
    let verbose = std::env::var_os("TESSERA_CRASH_VERBOSE").is_some();
    let started = Instant::now();

    // The previous checkpoints every instant starts from: step-0 and latest (step 0), committed.
    let template = TempDir::created("crash-template");
    save_steps(template.path(), Mode::Sync, 0, 1, false);

    // Calibration: one uninterrupted child run, checked like the killed ones. Kill delays are
    // spread over its duration (startup excluded), which covers new-directory saves and overwrites.
    let root = fresh_root(template.path(), &format!("{}-calibration", mode.name()));
    let run = run_child(&root, mode, CALIBRATION_STEPS, None);
    assert!(run.status.success(), "calibration run failed: {}", run.describe());
    let span = run.span;
    let events = parse_events(&run.stdout).unwrap();
    let saves: Vec<(Duration, Duration)> = events
        .iter()
        .filter(|b| !b.committed)
        .filter_map(|b| {
            let c = events.iter().find(|c| c.committed && (c.target, c.step) == (b.target, b.step))?;
            Some((b.at, c.at))
        })
        .collect();
    assert_eq!(events.iter().filter(|e| e.committed).count() as u64, 2 * CALIBRATION_STEPS, "{events:?}");
    let outcome = check_root(&root, &events, true).unwrap_or_else(|e| panic!("calibration run: {e}"));
    assert_eq!(outcome, Outcome::Finished);
    std::fs::remove_dir_all(&root).unwrap();

    let mut rng = Rng::new(seed);
    let mut counts: BTreeMap<&str, u64> = BTreeMap::new();
    let mut kinds = BTreeSet::new();
    for i in 0..instants {
        let root = fresh_root(template.path(), &format!("{}-{i}", mode.name()));
        let delay = pick_delay(&mut rng, &saves, span);
        let run = run_child(&root, mode, MAX_STEPS, Some(delay));
        assert!(run.killed() || run.status.success(), "instant {i}: {}", run.describe());
        let context =
            || format!("instant {i} (seed {seed}, delay {delay:?}, root {} left for inspection)", root.display());
        let events = parse_events(&run.stdout).unwrap_or_else(|e| panic!("{}: {e}", context()));
        let outcome = check_root(&root, &events, !run.killed()).unwrap_or_else(|e| panic!("{}: {e}", context()));
        if verbose {
            let last = events.last().map(|e| {
                let what = if e.committed { "committed" } else { "begin" };
                format!("{what} {} {} @{:?}", e.target.dir_name(), e.step, e.at)
            });
            println!("crash: instant {i}: kill at {delay:?}, last line {last:?}: {outcome:?}");
        }
        kinds.insert(outcome);
        let key = match outcome {
            Outcome::Committed => "committed",
            Outcome::Leftovers => "leftovers",
            Outcome::BeforeAnyFile => "before",
            Outcome::Finished => "finished",
        };
        *counts.entry(key).or_default() += 1;
        *counts.entry("saves").or_default() += events.iter().filter(|e| e.committed).count() as u64;
        std::fs::remove_dir_all(&root).unwrap();
    }
    let n = |k: &str| counts.get(k).copied().unwrap_or(0);
    let finished =
        if n("finished") > 0 { format!(", {} finished before the kill", n("finished")) } else { String::new() };
    println!(
        "crash [{}]: {instants} instants: {} committed, {} not committed (leftovers removed by gc), {} before any \
         file{finished}; {} saves reported committed; kill delays 0..{} ms; {:.1} s",
        mode.name(),
        n("committed"),
        n("leftovers"),
        n("before"),
        n("saves"),
        span.as_millis(),
        started.elapsed().as_secs_f64()
    );
    if instants >= 10 {
        assert!(kinds.len() >= 2, "every instant had the same outcome ({kinds:?}): the test is vacuous");
    }
}
