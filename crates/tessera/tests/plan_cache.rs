//! Plan caching: successive saves with the same structure reuse the previous global plan (one
//! small all-gather instead of the full exchange and validation), and any change — of one
//! rank's structure, of the options, of which save the caches come from — falls back to full
//! planning on every rank alike.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::common::*;
use tessera::comm::*;
use tessera::storage::*;
use tessera::tools::*;
use tessera::*;

const WORLD: usize = 4;

/// Rank `rank`'s rows of `w` ([8 × WORLD, 64] f32) and `b` ([64], replicated), filled from
/// `step`, plus one object per rank.
fn state(rank: usize, step: u32, rows: u64) -> (StateTree<'static>, Vec<u8>) {
    let cols = 64u64;
    let w: Vec<u8> = (0..rows * cols)
        .flat_map(|i| ((step * 100_000) as f32 + (rank as u64 * rows * cols + i) as f32).to_le_bytes())
        .collect();
    let b: Vec<u8> = (0..cols).flat_map(|i| (step as f32 + i as f32).to_le_bytes()).collect();
    let mut wt = ShardedTensor::full("w", DType::F32, &[rows, cols], TensorData::Owned(w.clone()));
    wt.global_shape = vec![rows * WORLD as u64, cols];
    wt.global_offset = vec![rows * rank as u64, 0];
    let mut bt = ShardedTensor::full("b", DType::F32, &[cols], TensorData::Owned(b));
    bt.replica_id = ReplicaId::from(rank as u32);
    let tree = StateTree::map()
        .with("w", StateTree::Tensor(wt))
        .with("b", StateTree::Tensor(bt))
        .with("rng", StateTree::Object(ShardedObject::new("rng", vec![rank as u8; 8], &[WORLD as u64], &[rank as u64])))
        .with("step", StateTree::Value(Value::Int(step as i64)));
    (tree, w)
}

fn options(cache: &Arc<PlanCache>) -> SaveOptions {
    SaveOptions { overwrite: true, plan_cache: Some(cache.clone()), ..small_blocks(4096) }
}

/// Saves step `step` on every rank; returns (hits, misses, bytes sent) per rank.
fn save_step(
    storage: &dyn Storage,
    caches: &[Arc<PlanCache>],
    step: u32,
    rows: impl Fn(usize) -> u64 + Sync,
) -> Vec<Result<(u64, u64, u64)>> {
    run_ranks(WORLD, |c| {
        let counting = CountingComm::new(c);
        let (tree, _) = state(c.rank(), step, rows(c.rank()));
        let cache = &caches[c.rank()];
        save(tree, storage, &counting, &options(cache))?;
        Ok((cache.hits(), cache.misses(), counting.gathered.load(Ordering::Relaxed)))
    })
}

fn check_step(storage: &dyn Storage, step: u32) {
    let plain = open(storage).and_then(|c| c.read_tensors(None)).unwrap();
    let mut want = Vec::new();
    for r in 0..WORLD {
        want.extend(state(r, step, 8).1);
    }
    assert!(plain["w"].data == want, "step {step}: w");
    let b: Vec<u8> = (0..64u64).flat_map(|i| (step as f32 + i as f32).to_le_bytes()).collect();
    assert_eq!(plain["b"].data, b, "step {step}: b");
    let StateTree::Map(common) = open(storage).map(|c| c.common_state()).unwrap() else { panic!() };
    assert!(matches!(common["step"], StateTree::Value(Value::Int(s)) if s == step as i64));
}

fn caches() -> Vec<Arc<PlanCache>> {
    (0..WORLD).map(|_| Arc::new(PlanCache::new())).collect()
}

#[test]
fn an_unchanged_structure_reuses_the_plan_and_saves_the_new_bytes() {
    let storage = MemoryStorage::new();
    let caches = caches();
    let first: Vec<_> = save_step(&storage, &caches, 1, |_| 8).into_iter().map(Result::unwrap).collect();
    check_step(&storage, 1);
    for step in 2..=4 {
        let again: Vec<_> = save_step(&storage, &caches, step, |_| 8).into_iter().map(Result::unwrap).collect();
        check_step(&storage, step);
        for r in 0..WORLD {
            assert_eq!((again[r].0, again[r].1), (step as u64 - 1, 1), "rank {r}: hits, misses");
            // Planning sent a few dozen bytes instead of the whole plan (the write report,
            // with its checksums, is sent either way).
            assert!(again[r].2 < first[r].2, "rank {r}: {} bytes vs {} the first time", again[r].2, first[r].2);
        }
    }
    assert!(verify(&storage, 2).unwrap().problems.is_empty());
}

#[test]
fn an_invalid_change_on_one_rank_is_still_caught_everywhere() {
    let storage = MemoryStorage::new();
    let caches = caches();
    save_step(&storage, &caches, 1, |_| 8).into_iter().for_each(|r| {
        r.unwrap();
    });
    // Rank 2 now claims 9 rows: its box overlaps rank 3's and the global shape disagrees.
    let out = save_step(&storage, &caches, 2, |r| if r == 2 { 9 } else { 8 });
    for (r, res) in out.iter().enumerate() {
        assert!(matches!(res, Err(Error::InvalidSharding { .. })), "rank {r}: {res:?}");
        assert_eq!(caches[r].hits(), 0, "rank {r}");
    }
    // The last committed checkpoint is untouched.
    check_step(&storage, 1);
}

#[test]
fn a_valid_change_replans_then_caches_the_new_plan() {
    let storage = MemoryStorage::new();
    let caches = caches();
    for (step, rows) in [(1, 8), (2, 16), (3, 16)] {
        for r in save_step(&storage, &caches, step, |_| rows) {
            r.unwrap();
        }
        let plain = open(&storage).and_then(|c| c.read_tensors(None)).unwrap();
        assert_eq!(plain["w"].shape, vec![rows * WORLD as u64, 64]);
    }
    for c in &caches {
        assert_eq!((c.hits(), c.misses()), (1, 2));
    }
}

#[test]
fn one_rank_without_a_cache_makes_every_rank_replan() {
    let storage = MemoryStorage::new();
    let mut caches = caches();
    for r in save_step(&storage, &caches, 1, |_| 8) {
        r.unwrap();
    }
    caches[1] = Arc::new(PlanCache::new());
    for r in save_step(&storage, &caches, 2, |_| 8) {
        r.unwrap();
    }
    check_step(&storage, 2);
    for c in &caches {
        assert_eq!(c.hits(), 0);
    }
    // The caches now come from the same save again: the next save hits on every rank.
    for r in save_step(&storage, &caches, 3, |_| 8) {
        r.unwrap();
    }
    check_step(&storage, 3);
    assert!(caches.iter().all(|c| c.hits() == 1));
}

#[test]
fn changed_options_and_refused_overwrites_are_not_served_from_the_cache() {
    let storage = MemoryStorage::new();
    let caches = caches();
    for r in save_step(&storage, &caches, 1, |_| 8) {
        r.unwrap();
    }
    // Same structure, other block size: replanned.
    let out = run_ranks(WORLD, |c| {
        let (tree, _) = state(c.rank(), 2, 8);
        let opts = SaveOptions { block_size: 1024, ..options(&caches[c.rank()]) };
        save(tree, &storage, c, &opts)
    });
    out.into_iter().for_each(|r| {
        r.unwrap();
    });
    assert!(caches.iter().all(|c| c.hits() == 0 && c.misses() == 2));
    // Without overwrite, the existing checkpoint is refused on every rank, cache or not.
    let out = run_ranks(WORLD, |c| {
        let (tree, _) = state(c.rank(), 3, 8);
        let opts = SaveOptions { overwrite: false, block_size: 1024, ..options(&caches[c.rank()]) };
        save(tree, &storage, c, &opts)
    });
    for (r, res) in out.iter().enumerate() {
        assert!(matches!(res, Err(Error::AlreadyExists { .. })), "rank {r}: {res:?}");
    }
    check_step(&storage, 2);
}

#[test]
fn async_saves_use_the_cache_too() {
    let storage: Arc<dyn Storage> = Arc::new(MemoryStorage::new());
    let caches = caches();
    let commit = InProcessComm::group_with_timeout(WORLD, std::time::Duration::from_secs(20));
    run_ranks(WORLD, |c| {
        let k: Arc<dyn Communicator> = Arc::new(commit[c.rank()].clone());
        let mut saver = AsyncSaver::new(StagingPool::new(1 << 20).unwrap(), k);
        for step in 1..=3 {
            let (tree, _) = state(c.rank(), step, 8);
            saver.save(tree, storage.clone(), c, &options(&caches[c.rank()])).unwrap().finalize().unwrap();
        }
    });
    let storage = storage.as_ref();
    check_step(storage, 3);
    assert!(caches.iter().all(|c| (c.hits(), c.misses()) == (2, 1)));
}
