//! The failure paths of issue 29, one test each: a save that fails at its commit never loses
//! the last committed checkpoint, never leaves a mix of two saves, and a retry succeeds; `gc`
//! beside running saves removes none of their files. (Each failed before the one commit
//! protocol and the leases; `fault_sweep.rs` then fails every call in turn.)

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use crate::common::*;
use tessera::index::*;
use tessera::olmo::*;
use tessera::storage::*;
use tessera::tools::*;
use tessera::torch_dist::*;
use tessera::*;

/// A storage failing the puts (atomic or not) of `name`, and, once `armed`, the size queries of
/// `size_of`.
#[derive(Debug, Clone)]
struct FailPuts {
    inner: MemoryStorage,
    name: &'static str,
    size_of: Option<&'static str>,
    armed: Arc<AtomicBool>,
}

impl FailPuts {
    fn new(inner: &MemoryStorage, name: &'static str) -> Self {
        FailPuts { inner: inner.clone(), name, size_of: None, armed: Arc::default() }
    }
    fn injected(&self, what: &str) -> Error {
        Error::Io { path: what.into(), source: std::io::Error::other("injected failure") }
    }
}

impl Storage for FailPuts {
    fn location(&self) -> String {
        self.inner.location()
    }
    fn size(&self, name: &str) -> Result<u64> {
        if self.size_of == Some(name) && self.armed.load(Ordering::SeqCst) {
            return Err(self.injected(name));
        }
        self.inner.size(name)
    }
    fn read_at(&self, name: &str, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.inner.read_at(name, offset, buf)
    }
    fn create(&self, name: &str, size: u64) -> Result<Box<dyn ObjectWriter>> {
        self.inner.create(name, size)
    }
    fn put_atomic(&self, name: &str, bytes: &[u8]) -> Result<()> {
        if name == self.name {
            return Err(self.injected(name));
        }
        let r = self.inner.put_atomic(name, bytes);
        if self.size_of == Some(name) {
            self.armed.store(true, Ordering::SeqCst);
        }
        r
    }
    fn put_if_absent(&self, name: &str, bytes: &[u8]) -> Result<()> {
        if name == self.name {
            return Err(self.injected(name));
        }
        self.inner.put_if_absent(name, bytes)
    }
    fn has_atomic_create(&self) -> bool {
        self.inner.has_atomic_create()
    }
    fn list(&self) -> Result<Vec<String>> {
        self.inner.list()
    }
    fn delete(&self, name: &str) -> Result<()> {
        self.inner.delete(name)
    }
}

const WORLD: usize = 2;

/// Rank `rank`'s state of `step`: `w` [4, 3] f32 by rows, and (with `values`) the common value
/// `step`.
fn state(step: u64, rank: usize, values: bool) -> StateTree<'static> {
    let rows: Vec<f32> = (0..6).map(|i| (step * 100 + rank as u64 * 6 + i) as f32).collect();
    let w = ShardedTensor::from_rank_offsets(
        "w",
        DType::F32,
        &[2, 3],
        TensorData::Owned(f32_bytes(&rows)),
        &[(0, rank as u64, WORLD as u64)],
        0,
    )
    .unwrap();
    let t = StateTree::map().with("w", StateTree::Tensor(w));
    if values {
        t.with("step", StateTree::Value(Value::Int(step as i64)))
    } else {
        t
    }
}

fn w_of(step: u64) -> Vec<u8> {
    f32_bytes(&(0..12).map(|i| (step * 100 + i) as f32).collect::<Vec<_>>())
}

/// The step the checkpoint at `storage` holds, checking that tensors and (with `values`) the
/// common state agree; panics on anything else.
fn step_of(storage: &dyn Storage, values: bool) -> u64 {
    let ckpt = open(storage).unwrap_or_else(|e| panic!("the location must hold a checkpoint: {e}"));
    let w = ckpt.read_tensors(None).unwrap_or_else(|e| panic!("its tensors must load: {e}")).remove("w").unwrap();
    let step = [1, 2].into_iter().find(|&s| w.data == w_of(s)).expect("the tensors of no step");
    if values {
        let v = ckpt.common_state().get_dotted("step").and_then(|t| t.as_value().cloned());
        assert_eq!(v, Some(Value::Int(step as i64)), "tensors of step {step} with another step's common state");
    }
    step
}

fn torch_dist_save(storage: &dyn Storage, comm: &dyn Communicator, step: u64, overwrite: bool) -> Result<SaveReport> {
    let opts = SaveOptions { overwrite, ..SaveOptions::default() };
    save_torch_dist(state(step, comm.rank(), true), None, storage, comm, &opts, 1)
}

/// Collectives one rank makes in a clean save with `f`.
fn collectives(f: impl Fn(&dyn Communicator) -> Result<SaveReport> + Sync) -> usize {
    let counts = run_ranks(WORLD, |c| {
        let comm = FailingComm::new(c, None);
        f(&comm).unwrap();
        comm.calls()
    });
    counts[0]
}

#[test]
fn torch_dist_a_collective_failing_after_the_commit_deletes_no_committed_file() {
    let n = collectives(|c| torch_dist_save(&MemoryStorage::new(), c, 1, false));
    let storage = MemoryStorage::new();
    for r in run_ranks(WORLD, |c| torch_dist_save(&storage, c, 1, false)) {
        r.unwrap();
    }
    // The last collective (after rank 0 put `.metadata`) fails on rank 1 only.
    let out = run_ranks(WORLD, |c| {
        let comm = FailingComm::new(c, (c.rank() == 1).then_some(n - 1));
        torch_dist_save(&storage, &comm, 2, true)
    });
    assert!(out[0].is_ok(), "rank 0 committed: {:?}", out[0]);
    assert!(matches!(out[1], Err(Error::CommitUnknown { .. })), "rank 1 cannot know: {:?}", out[1]);
    assert_eq!(step_of(&storage, true), 2, "the new checkpoint is whole");
    assert!(verify(&storage, 2).unwrap().problems.is_empty());
}

#[test]
fn torch_dist_a_failed_overwrite_keeps_the_old_checkpoint_and_its_common_state() {
    let storage = MemoryStorage::new();
    for r in run_ranks(WORLD, |c| torch_dist_save(&storage, c, 1, false)) {
        r.unwrap();
    }
    let failing = FailPuts::new(&storage, ".metadata");
    for r in run_ranks(WORLD, |c| torch_dist_save(&failing, c, 2, true)) {
        assert!(r.is_err(), "the commit failed: {r:?}");
    }
    assert_eq!(step_of(&storage, true), 1, "the old checkpoint, with its own common.pt");
    // A retry succeeds.
    for r in run_ranks(WORLD, |c| torch_dist_save(&storage, c, 2, true)) {
        r.unwrap();
    }
    assert_eq!(step_of(&storage, true), 2);
}

#[test]
fn torch_dist_a_common_pt_of_a_save_that_never_committed_is_never_read_as_the_committed_one() {
    // A crash between the put of common.pt and that of .metadata pairs them wrongly: as if so.
    let (old, new) = (MemoryStorage::new(), MemoryStorage::new());
    for (s, step) in [(&old, 1), (&new, 2)] {
        for r in run_ranks(WORLD, |c| torch_dist_save(s, c, step, false)) {
            r.unwrap();
        }
    }
    old.put_atomic("common.pt", &new.read("common.pt").unwrap()).unwrap();
    // tessera reads the committed common state from the copy it keeps beside the checkpoint.
    assert_eq!(step_of(&old, true), 1);
    // Without that copy the pair is refused, never read as one checkpoint.
    let copy = names(&old).into_iter().find(|n| n.starts_with(".tessera-common-")).expect("a copy of common.pt");
    old.delete(&copy).unwrap();
    let Err(e) = open(&old) else { panic!("the pair must be refused, not read as one checkpoint") };
    assert!(matches!(e, Error::Corrupt { .. }) && e.to_string().contains("common.pt"), "{e}");
}

fn olmo_save(
    storage: &dyn Storage,
    comm: &dyn Communicator,
    step: u64,
    overwrite: bool,
) -> Result<Vec<OlmoSaveReport>> {
    let opts = SaveOptions { overwrite, ..SaveOptions::default() };
    save_olmo_dirs(vec![(state(step, comm.rank(), false), storage)], comm, &opts)
}

#[test]
fn olmo_a_failed_overwrite_stays_the_old_checkpoint_and_a_retry_succeeds() {
    let storage = MemoryStorage::new();
    for r in run_ranks(WORLD, |c| olmo_save(&storage, c, 1, false)) {
        r.unwrap();
    }
    let failing = FailPuts::new(&storage, "metadata.json");
    for r in run_ranks(WORLD, |c| olmo_save(&failing, c, 2, true)) {
        assert!(r.is_err(), "the commit failed: {r:?}");
    }
    assert_eq!(open(&storage).unwrap().format().backend, tessera::index::Backend::OlmoSafetensors);
    assert_eq!(step_of(&storage, false), 1, "the old checkpoint");
    for r in run_ranks(WORLD, |c| olmo_save(&storage, c, 2, true)) {
        r.unwrap();
    }
    assert_eq!(step_of(&storage, false), 2);
    // The old checkpoint's rank files went with the commit that replaced them.
    let files: Vec<String> = names(&storage).into_iter().filter(|n| n.starts_with("rank_")).collect();
    assert_eq!(files.len(), WORLD, "{files:?}");
}

#[test]
fn a_folder_of_rank_files_without_metadata_is_an_unfinished_olmo_save() {
    let storage = MemoryStorage::new();
    for r in run_ranks(WORLD, |c| olmo_save(&storage, c, 1, false)) {
        r.unwrap();
    }
    storage.delete("metadata.json").unwrap();
    assert!(matches!(open(&storage), Err(Error::NotCommitted { .. })), "never a plain safetensors checkpoint");
    // A retry (without overwrite: nothing is committed) replaces it.
    for r in run_ranks(WORLD, |c| olmo_save(&storage, c, 2, false)) {
        r.unwrap();
    }
    assert_eq!(step_of(&storage, false), 2);
    // And gc removes such files.
    let leftover = MemoryStorage::new();
    leftover.put_atomic("rank_0.safetensors", &storage.read(&names(&storage)[0]).unwrap()).unwrap();
    let report = gc(&leftover, &GcOptions::default()).unwrap();
    assert_eq!(report.removed, ["rank_0.safetensors"]);
}

fn native_save(storage: &dyn Storage, comm: &dyn Communicator, step: u64, overwrite: bool) -> Result<SaveReport> {
    let opts = SaveOptions { overwrite, ..SaveOptions::default() };
    save(state(step, comm.rank(), true), storage, comm, &opts)
}

#[test]
fn native_a_verdict_that_does_not_arrive_leaves_the_files_and_says_so() {
    let n = collectives(|c| native_save(&MemoryStorage::new(), c, 1, false));
    let storage = MemoryStorage::new();
    let out = run_ranks(WORLD, |c| {
        let comm = FailingComm::new(c, (c.rank() == 1).then_some(n - 1));
        native_save(&storage, &comm, 1, false)
    });
    assert!(out[0].is_ok(), "{:?}", out[0]);
    assert!(matches!(out[1], Err(Error::CommitUnknown { .. })), "{:?}", out[1]);
    assert_eq!(step_of(&storage, true), 1);
    assert!(verify(&storage, 2).unwrap().problems.is_empty());
}

#[test]
fn native_a_read_that_fails_after_the_index_was_put_deletes_no_committed_file() {
    let storage = MemoryStorage::new();
    for r in run_ranks(WORLD, |c| native_save(&storage, c, 1, false)) {
        r.unwrap();
    }
    // Once the new index is in, every size query of it fails (a store that stops answering).
    let flaky = FailPuts { size_of: Some(INDEX_FILE), ..FailPuts::new(&storage, "none") };
    let out = run_ranks(WORLD, |c| native_save(&flaky, c, 2, true));
    let step = step_of(&storage, true);
    assert!(verify(&storage, 2).unwrap().problems.is_empty(), "the committed checkpoint is whole");
    if step == 2 {
        for r in &out {
            assert!(r.is_ok() || matches!(r, Err(Error::CommitUnknown { .. })), "{r:?}");
        }
    }
}

/// `gc` in a loop beside saves of every writer into one location: no save is corrupted, and
/// every checkpoint loads whole after its save.
#[test]
fn gc_in_a_loop_beside_running_saves_corrupts_none() {
    let dir = TempDir::new("gc-beside-saves");
    type SaveFn = fn(&dyn Storage, &dyn Communicator, u64, bool) -> std::result::Result<(), Error>;
    let kinds: [(&str, SaveFn, bool); 3] = [
        ("native", |s, c, step, o| native_save(s, c, step, o).map(drop), true),
        ("torch_dist", |s, c, step, o| torch_dist_save(s, c, step, o).map(drop), true),
        ("olmo", |s, c, step, o| olmo_save(s, c, step, o).map(drop), false),
    ];
    let mut removed_total = BTreeMap::<&str, usize>::new();
    for (name, save_fn, values) in kinds {
        let storage = LocalStorage::new(dir.join(name));
        let stop = AtomicBool::new(false);
        let runs = AtomicUsize::new(0);
        /// Stops the gc loop however the saves end (a failed assertion included).
        struct Stop<'a>(&'a AtomicBool);
        impl Drop for Stop<'_> {
            fn drop(&mut self) {
                self.0.store(true, Ordering::SeqCst);
            }
        }
        std::thread::scope(|s| {
            let gcs = s.spawn(|| {
                let mut removed = 0;
                while !stop.load(Ordering::SeqCst) {
                    match gc(&storage, &GcOptions::default()) {
                        Ok(r) => removed += r.removed.len(),
                        // A marker being replaced as gc reads it: the next round sees it whole.
                        Err(Error::NotFound { .. }) => {}
                        Err(e) => panic!("{name}: gc failed: {e}"),
                    }
                    runs.fetch_add(1, Ordering::SeqCst);
                }
                removed
            });
            let stopping = Stop(&stop);
            for i in 0..12u64 {
                let step = 1 + i % 2;
                for r in run_ranks(WORLD, |c| save_fn(&storage, c, step, i > 0)) {
                    r.unwrap_or_else(|e| panic!("{name}: save {i} failed: {e}"));
                }
                assert_eq!(step_of(&storage, values), step, "{name}: save {i}");
                assert!(verify(&storage, 2).unwrap().problems.is_empty(), "{name}: save {i}");
            }
            drop(stopping);
            removed_total.insert(name, gcs.join().unwrap());
        });
        assert!(runs.load(Ordering::SeqCst) > 0, "{name}: gc ran");
    }
    println!("gc beside 12 saves of each writer: {removed_total:?} files removed, no save corrupted");
}

/// `model/` and `optim/` saved as one: opened together they must be of one save. A save of both
/// killed between their two commits leaves one new beside one old, which is refused as a pair
/// (each directory alone is whole); one committed beside none is not committed as a pair.
#[test]
fn olmo_model_and_optim_of_different_saves_are_refused_as_one_checkpoint() {
    let dir = TempDir::new("olmo-pair");
    let save_pair = |parent: &std::path::Path, step: u64| {
        let (m, o) = (LocalStorage::new(parent.join("model")), LocalStorage::new(parent.join("optim")));
        for r in run_ranks(WORLD, |c| {
            let dirs = vec![(state(step, c.rank(), false), &m as &dyn Storage), (state(step, c.rank(), false), &o)];
            save_olmo_dirs(dirs, c, &SaveOptions { overwrite: true, ..SaveOptions::default() })
        }) {
            r.unwrap();
        }
    };
    let (a, b) = (dir.join("a"), dir.join("b"));
    save_pair(&a, 1);
    save_pair(&b, 2);
    assert!(open(&LocalStorage::new(&a)).is_ok(), "one save's pair opens");
    // As if the save of step 2 into `a` was killed after model/'s commit.
    for e in std::fs::read_dir(b.join("model")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), a.join("model").join(e.file_name())).unwrap();
    }
    let Err(e) = open(&LocalStorage::new(&a)) else { panic!("a mixed pair must be refused") };
    assert!(matches!(e, Error::Corrupt { .. }) && e.to_string().contains("interrupted"), "{e}");
    for (sub, step) in [("model", 2), ("optim", 1)] {
        assert_eq!(step_of(&LocalStorage::new(a.join(sub)), false), step, "{sub}/ alone is whole");
    }
    // One directory committed, the other not at all.
    std::fs::remove_file(a.join("optim").join("metadata.json")).unwrap();
    assert!(matches!(open(&LocalStorage::new(&a)), Err(Error::NotCommitted { .. })));
}
