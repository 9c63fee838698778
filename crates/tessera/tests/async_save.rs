//! Async save (staging pool, background write and commit, one verdict on every rank) and the
//! fully-parallel save (replicated chunks written by their replicas, balanced).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use tessera::comm::*;
use tessera::index::*;
use tessera::storage::*;
use tessera::tools::*;
use tessera::*;

/// Runs `f(rank, save_comm, commit_comm)` on `world` threads.
fn run_async<T: Send>(world: usize, f: impl Fn(usize, &InProcessComm, Arc<dyn Communicator>) -> T + Sync) -> Vec<T> {
    let comms = InProcessComm::group_with_timeout(world, Duration::from_secs(20));
    let commit = InProcessComm::group_with_timeout(world, Duration::from_secs(20));
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter()
            .zip(commit)
            .enumerate()
            .map(|(r, (c, k))| {
                let f = &f;
                s.spawn(move || f(r, c, Arc::new(k) as Arc<dyn Communicator>))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
    })
}

/// The full tensors of step `step`: "w" [rows, cols] f32-sized rows, "b" [cols], "tiny" [3].
fn truth(step: u8, rows: u64, cols: u64) -> Vec<(String, Vec<u64>, Vec<u8>)> {
    let mut rng = Rng::new(1000 + step as u64);
    vec![
        ("w".into(), vec![rows, cols], rng.bytes((rows * cols * 4) as usize)),
        ("b".into(), vec![cols], rng.bytes((cols * 4) as usize)),
        ("tiny".into(), vec![3], rng.bytes(12)),
    ]
}

/// Rank `r` of `world`: "w" split by rows (TP), "b" and "tiny" replicated on every rank.
fn tp_tree<'a>(r: usize, world: usize, t: &'a [(String, Vec<u64>, Vec<u8>)], step: i64) -> StateTree<'a> {
    let (key, shape, data) = &t[0];
    let rows = shape[0] / world as u64;
    let row_bytes = (shape[1] * 4) as usize;
    let part = &data[r * rows as usize * row_bytes..(r + 1) * rows as usize * row_bytes];
    let mut tree = StateTree::map().with(
        key.as_str(),
        StateTree::Tensor(
            ShardedTensor::from_rank_offsets(
                key,
                DType::F32,
                &[rows, shape[1]],
                TensorData::Ref(part),
                &[(0, r as u64, world as u64)],
                0,
            )
            .unwrap(),
        ),
    );
    for (key, shape, data) in &t[1..] {
        let mut st = ShardedTensor::full(key, DType::F32, shape, TensorData::Ref(data));
        st.replica_id = ReplicaId::from(r as u32);
        tree.insert(key.clone(), StateTree::Tensor(st));
    }
    tree.insert("step", StateTree::Value(Value::Int(step)));
    tree.insert(
        "rng",
        StateTree::Object(ShardedObject::new("rng", vec![r as u8; 5 + r], &[world as u64], &[r as u64])),
    );
    tree
}

fn load_full(storage: &dyn Storage) -> std::collections::BTreeMap<String, PlainTensor> {
    open(storage).and_then(|c| c.read_tensors(None)).unwrap()
}

fn assert_holds(storage: &dyn Storage, t: &[(String, Vec<u64>, Vec<u8>)]) {
    let full = load_full(storage);
    assert_eq!(full.len(), t.len());
    for (key, shape, data) in t {
        assert_eq!(&full[key].shape, shape, "{key}");
        assert!(full[key].data == *data, "{key} differs");
    }
}

#[test]
fn async_save_stages_in_waves_through_a_small_pool_and_commits_identically() {
    let t = truth(1, 64, 1024); // 256 KiB of "w"
    let dir = TempDir::new("async-waves");
    // 16 KiB buffers, 3 of them: "w" alone needs 16 waves per rank at 4 ranks.
    let pools: Vec<_> = (0..4).map(|_| StagingPool::with_buffer_size(3 * 16384, 16384).unwrap()).collect();
    let reports = run_async(4, |r, c, k| {
        let storage = tessera::storage::Location::parse(dir.path().to_str().unwrap()).open().unwrap();
        let mut saver = AsyncSaver::new(pools[r].clone(), k);
        let opts = SaveOptions { block_size: 4096, threads: 2, ..Default::default() };
        let pending = saver.save(tp_tree(r, 4, &t, 1), storage, c, &opts).unwrap();
        pending.finalize().unwrap()
    });
    let storage = LocalStorage::new(dir.path());
    assert_holds(&storage, &t);
    verify(&storage, 2).unwrap();
    for (r, rep) in reports.iter().enumerate() {
        assert_eq!(rep.chunks, reports[0].chunks);
        assert!(pools[r].peak_bytes_in_use() <= pools[r].capacity());
        assert!(pools[r].peak_bytes_in_use() > 0);
    }
    // The same state saved synchronously commits the same chunks.
    let sync_dir = TempDir::new("async-waves-sync");
    run_ranks(4, |c| {
        let storage = LocalStorage::new(sync_dir.path());
        let opts = SaveOptions { block_size: 4096, threads: 2, ..Default::default() };
        save(tp_tree(c.rank(), 4, &t, 1), &storage, c, &opts).unwrap();
    });
    let a = open(&LocalStorage::new(dir.path())).map(Checkpoint::into_index).unwrap();
    let b = open(&LocalStorage::new(sync_dir.path())).map(Checkpoint::into_index).unwrap();
    assert_eq!(a.tensors.len(), b.tensors.len());
    for (x, y) in a.tensors.iter().zip(&b.tensors) {
        let geom = |e: &TensorEntry| {
            e.chunks().iter().map(|c| (c.offset.clone(), c.shape.clone(), c.crcs.clone())).collect::<Vec<_>>()
        };
        assert_eq!((&x.key, geom(x)), (&y.key, geom(y)));
    }
    assert_eq!(a.common, b.common);
}

#[test]
fn the_caller_may_change_its_tensors_as_soon_as_save_returns() {
    let t = truth(2, 8, 256);
    let dir = TempDir::new("async-mutate");
    run_async(2, |r, c, k| {
        let mut mine = t.clone();
        let mut saver = AsyncSaver::new(StagingPool::new(1 << 20).unwrap(), k);
        let pending = {
            let tree = tp_tree(r, 2, &mine, 2);
            saver.save(tree, Arc::new(LocalStorage::new(dir.path())), c, &SaveOptions::default()).unwrap()
        };
        // The next training step overwrites the parameters while the save is still writing.
        for x in &mut mine {
            x.2.iter_mut().for_each(|b| *b = !*b);
        }
        pending.finalize().unwrap();
    });
    assert_holds(&LocalStorage::new(dir.path()), &t);
}

#[test]
fn a_second_save_waits_for_the_first_and_polls_need_no_collective() {
    let t1 = truth(3, 32, 512);
    let t2 = truth(4, 32, 512);
    let root = TempDir::created("async-two");
    run_async(2, |r, c, k| {
        let counting = CountingComm::new(c);
        let mut saver = AsyncSaver::new(StagingPool::new(2 << 20).unwrap(), k);
        let s1 = Arc::new(LocalStorage::new(root.join("step1")));
        let first = saver.save(tp_tree(r, 2, &t1, 1), s1, &counting, &SaveOptions::default()).unwrap();
        let after_start = counting.calls.load(Ordering::Relaxed);
        let mut polls = 0;
        while !first.is_done() {
            polls += 1;
            std::thread::yield_now();
        }
        assert!(polls < usize::MAX);
        assert_eq!(counting.calls.load(Ordering::Relaxed), after_start, "polling ran a collective");
        // A second save before the first is finalized: it waits for the first's background work.
        let s2 = Arc::new(LocalStorage::new(root.join("step2")));
        let second = saver.save(tp_tree(r, 2, &t2, 2), s2, &counting, &SaveOptions::default()).unwrap();
        let a = first.finalize().unwrap();
        let b = second.finalize().unwrap();
        assert_eq!(a.chunks, b.chunks);
        assert!(saver.is_idle());
    });
    assert_holds(&LocalStorage::new(root.join("step1")), &t1);
    assert_holds(&LocalStorage::new(root.join("step2")), &t2);
}

/// Local storage whose data-file writes fail for one rank's file.
#[derive(Debug)]
struct FailingWrites {
    inner: LocalStorage,
    rank_tag: String,
}

impl Storage for FailingWrites {
    fn location(&self) -> String {
        self.inner.location()
    }
    fn size(&self, name: &str) -> Result<u64> {
        self.inner.size(name)
    }
    fn read_at(&self, name: &str, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.inner.read_at(name, offset, buf)
    }
    fn create(&self, name: &str, size: u64) -> Result<Box<dyn ObjectWriter>> {
        let w = self.inner.create(name, size)?;
        Ok(Box::new(FailingWriter { inner: w, fail: name.contains(&self.rank_tag) }))
    }
    fn put_atomic(&self, name: &str, bytes: &[u8]) -> Result<()> {
        self.inner.put_atomic(name, bytes)
    }
    fn list(&self) -> Result<Vec<String>> {
        self.inner.list()
    }
    fn delete(&self, name: &str) -> Result<()> {
        self.inner.delete(name)
    }
}

struct FailingWriter {
    inner: Box<dyn ObjectWriter>,
    fail: bool,
}

impl ObjectWriter for FailingWriter {
    fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        if self.fail && offset > 0 {
            return Err(Error::Io { path: "disk full".into(), source: std::io::Error::other("no space left") });
        }
        self.inner.write_at(offset, data)
    }
    fn finish(self: Box<Self>) -> Result<()> {
        self.inner.finish()
    }
}

#[test]
fn a_background_failure_surfaces_at_finalize_on_every_rank_and_nothing_is_committed() {
    let t = truth(5, 16, 256);
    let dir = TempDir::new("async-fail");
    let verdicts = run_async(3, |r, c, k| {
        let storage = Arc::new(FailingWrites { inner: LocalStorage::new(dir.path()), rank_tag: "-r00001".into() });
        let mut saver = AsyncSaver::new(StagingPool::new(1 << 20).unwrap(), k);
        let pending = saver.save(tp_tree(r, 3, &t, 5), storage, c, &SaveOptions::default()).unwrap();
        pending.finalize()
    });
    for (r, v) in verdicts.iter().enumerate() {
        match v {
            Err(Error::Io { .. }) if r == 1 => {}
            Err(Error::PeerFailed { rank: 1, .. }) if r != 1 => {}
            other => panic!("rank {r}: {other:?}"),
        }
    }
    // Nothing committed, and the failed save removed what it wrote.
    assert!(matches!(open(&LocalStorage::new(dir.path())).map(Checkpoint::into_index), Err(Error::NotFound { .. })));
    assert_eq!(LocalStorage::new(dir.path()).list().unwrap(), Vec::<String>::new());
}

#[test]
fn errors_found_before_writing_come_back_from_save_on_every_rank() {
    let t = truth(6, 8, 64);
    let dir = TempDir::new("async-invalid");
    let out = run_async(2, |r, c, k| {
        let mut saver = AsyncSaver::new(StagingPool::new(1 << 20).unwrap(), k);
        // Both ranks claim the first half of "w": the second half is not covered.
        let tree = tp_tree(0, 2, &t, 6).with("rng", StateTree::Value(Value::Int(r as i64)));
        saver.save(tree, Arc::new(LocalStorage::new(dir.path())), c, &SaveOptions::default()).map(|_| ())
    });
    // Both ranks also claim to be the main replica of "b": the first key in order is reported.
    for v in &out {
        assert!(matches!(v, Err(Error::InvalidSharding { key, .. }) if key == "b"), "{v:?}");
    }
    assert!(LocalStorage::new(dir.path()).list().unwrap().is_empty());
}

#[test]
fn a_cancelled_async_save_is_not_committed() {
    let t = truth(7, 64, 1024);
    let dir = TempDir::new("async-cancel");
    let out = run_async(2, |r, c, k| {
        let cancel = Arc::new(AtomicBool::new(r == 0));
        let mut saver = AsyncSaver::new(StagingPool::with_buffer_size(32768, 16384).unwrap(), k);
        let opts = SaveOptions { cancel: Some(cancel), block_size: 4096, ..Default::default() };
        let pending = saver.save(tp_tree(r, 2, &t, 7), Arc::new(LocalStorage::new(dir.path())), c, &opts).unwrap();
        pending.finalize()
    });
    assert!(matches!(out[0], Err(Error::Cancelled)), "{:?}", out[0]);
    assert!(matches!(out[1], Err(Error::PeerFailed { rank: 0, .. })), "{:?}", out[1]);
    // Nothing committed, and the failed save removed what it wrote.
    assert!(matches!(open(&LocalStorage::new(dir.path())).map(Checkpoint::into_index), Err(Error::NotFound { .. })));
    assert_eq!(LocalStorage::new(dir.path()).list().unwrap(), Vec::<String>::new());
}

#[test]
fn a_block_larger_than_a_staging_buffer_is_refused_on_every_rank_before_writing() {
    let t = truth(8, 8, 64);
    let dir = TempDir::new("async-block");
    let out = run_async(2, |r, c, k| {
        let mut saver = AsyncSaver::new(StagingPool::with_buffer_size(8192, 4096).unwrap(), k);
        let opts = SaveOptions { block_size: 8192, ..Default::default() };
        saver.save(tp_tree(r, 2, &t, 8), Arc::new(LocalStorage::new(dir.path())), c, &opts).map(|_| ())
    });
    for v in &out {
        assert!(matches!(v, Err(Error::InvalidArgument { .. } | Error::PeerFailed { .. })), "{v:?}");
    }
    assert!(LocalStorage::new(dir.path()).list().unwrap().is_empty());
}

/// DP replicas of a state whose every tensor is replicated on all ranks, saved with and
/// without distribution: the same checkpoint, and with distribution each rank writes ~1/N.
#[test]
fn fully_parallel_save_spreads_replicated_bytes_over_the_replicas() {
    let mut rng = Rng::new(42);
    let tensors: Vec<(String, Vec<u8>)> =
        (0..24).map(|i| (format!("layer{i:02}.w"), rng.bytes(4 * (1000 + 37 * i as usize)))).collect();
    let total: u64 = tensors.iter().map(|t| t.1.len() as u64).sum();
    let largest = tensors.iter().map(|t| t.1.len() as u64).max().unwrap();
    for dp in [2usize, 4, 8] {
        let tree = |r: usize| {
            let mut tree = StateTree::map();
            for (key, data) in &tensors {
                let mut st = ShardedTensor::full(key, DType::F32, &[data.len() as u64 / 4], TensorData::Ref(data));
                st.replica_id = ReplicaId::from(r as u32);
                tree.insert(key.clone(), StateTree::Tensor(st));
            }
            tree
        };
        let mut written = Vec::new();
        for distribute in [true, false] {
            let storage = MemoryStorage::new();
            let reports = run_ranks(dp, |c| {
                let opts = SaveOptions { distribute_replicas: distribute, ..Default::default() };
                save(tree(c.rank()), &storage, c, &opts).unwrap()
            });
            let full = open(&storage).and_then(|c| c.read_tensors(None)).unwrap();
            for (key, data) in &tensors {
                assert!(full[key].data == *data, "dp {dp}: {key}");
            }
            let per_rank: Vec<u64> = reports.iter().map(|r| r.bytes_written).collect();
            written.push(per_rank);
        }
        let (spread, main_only) = (&written[0], &written[1]);
        // Without distribution rank 0 writes everything; with it, every rank is within one
        // tensor of an even share (headers included in bytes_written, hence the slack).
        assert!(main_only[1..].iter().all(|&b| b == 0), "dp {dp}: {main_only:?}");
        let ideal = total / dp as u64;
        for (r, &b) in spread.iter().enumerate() {
            assert!(b + largest >= ideal && b <= ideal + largest + 4096, "dp {dp} rank {r}: {b} vs ideal {ideal}");
        }
        println!("dp {dp}: bytes written per rank {spread:?} (main replica only: {main_only:?})");
    }
}

#[test]
fn replicas_without_data_leave_the_writing_to_the_main_replica() {
    let data = Rng::new(9).bytes(4096);
    let storage = MemoryStorage::new();
    let reports = run_ranks(3, |c| {
        let r = c.rank();
        let bytes = if r == 0 { TensorData::Ref(&data[..]) } else { TensorData::None };
        let mut st = ShardedTensor::full("w", DType::U8, &[4096], bytes);
        st.replica_id = ReplicaId::from(r as u32);
        save(StateTree::map().with("w", StateTree::Tensor(st)), &storage, c, &SaveOptions::default()).unwrap()
    });
    assert!(reports[0].bytes_written >= 4096);
    assert_eq!((reports[1].bytes_written, reports[2].bytes_written), (0, 0));
    assert_eq!(open(&storage).and_then(|c| c.read_tensors(None)).unwrap()["w"].data, data);
}

#[test]
fn a_commit_communicator_of_other_ranks_is_refused_on_every_rank() {
    let t = truth(10, 8, 64);
    let dir = TempDir::new("async-commit-comm");
    let comms = InProcessComm::group_with_timeout(2, Duration::from_secs(20));
    let wrong = InProcessComm::group_with_timeout(3, Duration::from_secs(20));
    let out: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter()
            .enumerate()
            .map(|(r, c)| {
                let (t, dir, k) = (&t, &dir, wrong[r].clone());
                s.spawn(move || {
                    let mut saver = AsyncSaver::new(StagingPool::new(1 << 20).unwrap(), Arc::new(k));
                    let storage = Arc::new(LocalStorage::new(dir.path()));
                    saver.save(tp_tree(r, 2, t, 10), storage, c, &SaveOptions::default()).map(|_| ())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for v in &out {
        assert!(matches!(v, Err(Error::InvalidArgument { .. } | Error::PeerFailed { .. })), "{v:?}");
    }
    assert!(LocalStorage::new(dir.path()).list().unwrap().is_empty());
}
