//! Two saves into one location at once, neither asking to overwrite: exactly one commits, the
//! other fails with `AlreadyExists` on all its ranks, and the location holds the winner whole.

use std::sync::{Arc, Barrier};

use crate::common::*;
use tessera::comm::*;
use tessera::index::*;
use tessera::storage::*;
use tessera::tools::*;
use tessera::*;

fn tree(rank: usize, data: &[u8]) -> StateTree<'_> {
    let half = data.len() / 2;
    let part = &data[rank * half..(rank + 1) * half];
    StateTree::map().with(
        "w",
        StateTree::Tensor(
            ShardedTensor::from_rank_offsets(
                "w",
                DType::U8,
                &[half as u64],
                TensorData::Ref(part),
                &[(0, rank as u64, 2)],
                0,
            )
            .unwrap(),
        ),
    )
}

fn race(storage: Arc<dyn Storage>) {
    let a = Rng::new(1).bytes(1 << 16);
    let b = Rng::new(2).bytes(1 << 16);
    let start = Barrier::new(4);
    let outcomes: Vec<(usize, Result<SaveReport>)> = std::thread::scope(|s| {
        let mut handles = Vec::new();
        for (g, data) in [&a, &b].into_iter().enumerate() {
            for c in InProcessComm::group(2) {
                let (storage, start) = (storage.clone(), &start);
                handles.push(s.spawn(move || {
                    start.wait();
                    (g, save(tree(c.rank(), data), storage.as_ref(), &c, &SaveOptions::default()))
                }));
            }
        }
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // Whatever the store, the location ends up holding one of the two states, whole.
    let stored = open(storage.as_ref()).and_then(|c| c.read_tensors(None)).unwrap().remove("w").unwrap().data;
    assert!(stored == a || stored == b, "the committed checkpoint is neither save's state");
    verify(storage.as_ref(), 2).unwrap();
    // With an atomic conditional put, exactly one save commits and the other is refused.
    let won: Vec<usize> = outcomes.iter().filter(|(_, r)| r.is_ok()).map(|(g, _)| *g).collect();
    assert_eq!(won.len(), 2, "exactly one group's two ranks commit: {outcomes:?}");
    assert_eq!(won[0], won[1]);
    for (g, r) in &outcomes {
        if *g != won[0] {
            assert!(matches!(r, Err(Error::AlreadyExists { .. })), "the losing group: {r:?}");
        }
    }
    let winner = if won[0] == 0 { &a } else { &b };
    assert_eq!(&open(storage.as_ref()).and_then(|c| c.read_tensors(None)).unwrap()["w"].data, winner);
    verify(storage.as_ref(), 2).unwrap();
    // The loser's data files are gone; only the winner's remain.
    let index = open(storage.as_ref()).map(Checkpoint::into_index).unwrap();
    let data_files: Vec<String> = storage.list().unwrap().into_iter().filter(|n| n.ends_with(".safetensors")).collect();
    assert_eq!(data_files.len(), index.files.len(), "{data_files:?}");
}

#[test]
fn concurrent_saves_into_memory() {
    race(Arc::new(MemoryStorage::new()));
}

#[test]
fn concurrent_saves_into_a_directory() {
    let dir = TempDir::new("race");
    race(Arc::new(LocalStorage::new(dir.path())));
}

#[test]
fn concurrent_saves_into_s3() {
    race(Arc::new(s3::fresh_storage("race")));
}

#[test]
fn concurrent_saves_into_azure() {
    race(Arc::new(azure::fresh_storage("race")));
}

#[test]
fn concurrent_saves_into_gcs() {
    race(Arc::new(gcs::fresh_storage("race")));
}

/// A store that accepts a conditional put and ignores the condition (Garage does), and whose
/// first existence check of the index misses (as if the other save had not committed yet).
#[derive(Debug)]
struct Ignoring {
    inner: MemoryStorage,
    checks: std::sync::atomic::AtomicUsize,
}

impl Storage for Ignoring {
    fn location(&self) -> String {
        self.inner.location()
    }
    fn size(&self, name: &str) -> Result<u64> {
        if name == INDEX_FILE && self.checks.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
            return Err(Error::not_found(name));
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
        self.inner.put_atomic(name, bytes)
    }
    fn put_if_absent(&self, name: &str, bytes: &[u8]) -> Result<()> {
        self.inner.put_atomic(name, bytes)
    }
    fn list(&self) -> Result<Vec<String>> {
        self.inner.list()
    }
    fn delete(&self, name: &str) -> Result<()> {
        self.inner.delete(name)
    }
}

fn solo_tree(data: &[u8]) -> StateTree<'_> {
    StateTree::map()
        .with("w", StateTree::Tensor(ShardedTensor::full("w", DType::U8, &[data.len() as u64], TensorData::Ref(data))))
}

#[test]
fn a_store_that_ignores_conditional_puts_never_ends_inconsistent() {
    let a = Rng::new(3).bytes(4096);
    let b = Rng::new(4).bytes(4096);
    let inner = MemoryStorage::new();
    save(solo_tree(&a), &inner, &SoloComm, &SaveOptions::default()).unwrap();
    // The second save misses the first's index at its start and its conditional put is not
    // honoured: it replaces the first. What it must not do is leave a broken checkpoint.
    std::thread::sleep(std::time::Duration::from_millis(2));
    let store = Ignoring { inner: inner.clone(), checks: Default::default() };
    save(solo_tree(&b), &store, &SoloComm, &SaveOptions::default()).unwrap();
    assert_eq!(open(&inner).and_then(|c| c.read_tensors(None)).unwrap()["w"].data, b);
    verify(&inner, 1).unwrap();
    let index = open(&inner).map(Checkpoint::into_index).unwrap();
    let files: Vec<String> = inner.list().unwrap().into_iter().filter(|n| n.ends_with(".safetensors")).collect();
    assert_eq!(files.len(), index.files.len(), "the replaced save's files are removed: {files:?}");
}

/// An object store's first commit leaves a probe object in the location for a moment (to learn
/// whether the store honours conditional puts): a save racing it must not refuse the location
/// as holding foreign files, or the loser of a race gets the wrong error (seen on GCS in CI).
#[test]
fn another_saves_conditional_put_probe_is_not_a_foreign_file() {
    let storage = MemoryStorage::new();
    storage.put_atomic(".tessera-conditional-put-probe-1-0", b"probe").unwrap();
    let data = Rng::new(3).bytes(64);
    let outcomes = InProcessComm::run(2, |c| save(tree(c.rank(), &data), &storage, c, &SaveOptions::default()));
    assert!(outcomes.iter().all(|r| r.is_ok()), "{outcomes:?}");
    assert_eq!(open(&storage).and_then(|c| c.read_tensors(None)).unwrap()["w"].data, data);
}
