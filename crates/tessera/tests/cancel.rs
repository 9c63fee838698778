//! Cancellation: a set cancel flag stops a save (nothing committed, every rank fails) or a load.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use crate::common::*;
use tessera::comm::*;
use tessera::storage::*;
use tessera::*;

fn rows_tree(rank: usize, world: usize, data: &[u8]) -> StateTree<'_> {
    let rows = 64 / world as u64;
    let t = ShardedTensor::from_rank_offsets(
        "w",
        DType::U8,
        &[rows, 16],
        TensorData::Ref(data),
        &[(0, rank as u64, world as u64)],
        0,
    )
    .unwrap();
    StateTree::map().with("w", StateTree::Tensor(t))
}

#[test]
fn a_cancelled_rank_fails_the_save_everywhere_and_nothing_is_committed() {
    let dir = TempDir::new("cancel");
    let storage = LocalStorage::new(dir.path());
    let data = vec![7u8; 32 * 16];
    let out = run_ranks(2, |c| {
        let cancel = Arc::new(AtomicBool::new(c.rank() == 1));
        let opts = SaveOptions { cancel: Some(cancel), ..Default::default() };
        save(rows_tree(c.rank(), 2, &data), &storage, c, &opts)
    });
    assert!(matches!(out[1], Err(Error::Cancelled)), "{:?}", out[1]);
    assert!(matches!(out[0], Err(Error::PeerFailed { rank: 1, .. })), "{:?}", out[0]);
    // Nothing committed, and the failed save removed what it wrote.
    assert!(matches!(open(&storage).map(Checkpoint::into_index), Err(Error::NotFound { .. })));
    assert!(storage.list().unwrap().is_empty());
}

#[test]
fn a_cancelled_load_stops_with_cancelled() {
    let storage = MemoryStorage::new();
    let data = vec![3u8; 64 * 16];
    save(rows_tree(0, 1, &data), &storage, &SoloComm, &SaveOptions::default()).unwrap();
    let opts = LoadOptions { cancel: Some(Arc::new(AtomicBool::new(true))), ..Default::default() };
    let request =
        StateTree::map().with("w", StateTree::Tensor(ShardedTensor::full("w", DType::U8, &[64, 16], TensorData::None)));
    assert!(matches!(load(request, &storage, &SoloComm, &opts), Err(Error::Cancelled)));
}
