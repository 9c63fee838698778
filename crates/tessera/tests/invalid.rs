//! Invalid shardings are rejected before any byte is written, with `InvalidSharding` naming
//! the key on every rank; local problems (bad buffers) fail every rank without hanging; a
//! committed checkpoint is never overwritten unless asked, and an overwrite leaves only the
//! new checkpoint's files.

use std::ops::Range;

use crate::common::*;
use tessera::comm::*;
use tessera::index::*;
use tessera::storage::*;
use tessera::tools::*;
use tessera::*;

/// A `[rows.start, rows.end) x all columns` box of an f32 tensor of global shape `global`,
/// with data of the right size.
fn rows(key: &str, global: &[u64], rows: Range<u64>) -> ShardedTensor<'static> {
    let mut shape = global.to_vec();
    shape[0] = rows.end - rows.start;
    let mut off = vec![0; global.len()];
    off[0] = rows.start;
    let n = numel(&shape) as usize;
    shard(key, DType::F32, global, &off, &shape, 0, None, TensorData::Owned(vec![0u8; n * 4]))
}

/// A flattened range of the whole `[4, 4]` f32 tensor `key`.
fn flat(key: &str, r: Range<u64>) -> ShardedTensor<'static> {
    let n = (r.end - r.start) as usize;
    shard(key, DType::F32, &[4, 4], &[0, 0], &[4, 4], 0, Some(r), TensorData::Owned(vec![0u8; n * 4]))
}

fn object(key: &str, grid: &[u64], cell: &[u64]) -> ShardedObject {
    ShardedObject::new(key, b"object bytes".to_vec(), grid, cell)
}

/// A tree with a valid tensor `good` (split by rows over `world` ranks) and the given leaves.
fn tree_with(rank: usize, world: usize, leaves: Vec<StateTree<'static>>) -> StateTree<'static> {
    let (r, w) = (rank as u64, world as u64);
    let good = rows("good", &[8, 2], r * 8 / w..(r + 1) * 8 / w);
    StateTree::map()
        .with("good", StateTree::Tensor(good))
        .with("bad", StateTree::List(leaves))
        .with("step", StateTree::Value(Value::Int(1)))
}

/// Saves `leaves(rank)` (next to a valid tensor) on `world` ranks into a fresh directory.
/// Returns every rank's outcome and what the directory holds afterwards.
fn try_save(
    world: usize,
    leaves: impl Fn(usize) -> Vec<StateTree<'static>> + Sync,
) -> (Vec<Result<SaveReport>>, Vec<String>) {
    let dir = TempDir::new("invalid");
    let storage = LocalStorage::new(dir.path());
    let out = run_ranks(world, |c| save(tree_with(c.rank(), world, leaves(c.rank())), &storage, c, &small_blocks(16)));
    let left = names(&storage);
    (out, left)
}

/// Every rank fails with `InvalidSharding` naming `key` (and `reason_has` in the reason), and
/// nothing was written.
#[track_caller]
fn assert_rejected(
    world: usize,
    key: &str,
    reason_has: &str,
    leaves: impl Fn(usize) -> Vec<StateTree<'static>> + Sync,
) {
    let (out, left) = try_save(world, leaves);
    for (rank, r) in out.iter().enumerate() {
        match r {
            Err(Error::InvalidSharding { key: k, reason }) => {
                assert_eq!(k, key, "rank {rank}: wrong key named ({reason})");
                assert!(
                    reason.to_lowercase().contains(reason_has),
                    "rank {rank}: reason {reason:?} does not mention {reason_has:?}"
                );
            }
            other => panic!("rank {rank}: expected InvalidSharding for {key:?}, got {other:?}"),
        }
    }
    assert!(left.is_empty(), "a rejected save left files behind: {left:?}");
}

#[test]
fn overlapping_boxes_are_rejected() {
    assert_rejected(2, "w", "overlap", |r| {
        let rs = if r == 0 { 0..3 } else { 2..4 };
        vec![StateTree::Tensor(rows("w", &[4, 4], rs))]
    });
}

#[test]
fn a_gap_is_rejected() {
    assert_rejected(2, "w", "gap", |r| {
        let rs = if r == 0 { 0..1 } else { 2..4 };
        vec![StateTree::Tensor(rows("w", &[4, 4], rs))]
    });
}

#[test]
fn a_gap_left_by_replicas_only_is_rejected() {
    // Rows 2..4 exist only as non-main replicas: nobody writes them.
    assert_rejected(2, "w", "gap", |r| {
        let t = if r == 0 { rows("w", &[4, 4], 0..2) } else { rows("w", &[4, 4], 2..4).with_replica_id(1) };
        vec![StateTree::Tensor(t)]
    });
}

#[test]
fn dtype_mismatch_across_ranks_is_rejected() {
    assert_rejected(2, "w", "dtype", |r| {
        let mut t = rows("w", &[4, 4], r as u64 * 2..r as u64 * 2 + 2);
        if r == 1 {
            t.dtype = DType::F16;
            t.data = TensorData::Owned(vec![0u8; 2 * 4 * 2]);
        }
        vec![StateTree::Tensor(t)]
    });
}

#[test]
fn global_shape_mismatch_across_ranks_is_rejected() {
    assert_rejected(3, "w", "global shape", |r| {
        // Ranks 0 and 1 tile a [4, 4] tensor; rank 2 believes it is [6, 4] and holds rows 4..6.
        let global: &[u64] = if r == 2 { &[6, 4] } else { &[4, 4] };
        let rs = [0..2, 2..4, 4..6][r].clone();
        vec![StateTree::Tensor(rows("w", global, rs))]
    });
}

#[test]
fn overlapping_flat_ranges_are_rejected() {
    assert_rejected(2, "w", "overlap", |r| {
        let range = if r == 0 { 0..10 } else { 8..16 };
        vec![StateTree::Tensor(flat("w", range))]
    });
}

#[test]
fn flat_ranges_with_a_hole_are_rejected() {
    assert_rejected(2, "w", "gap", |r| {
        let range = if r == 0 { 0..7 } else { 9..16 };
        vec![StateTree::Tensor(flat("w", range))]
    });
}

#[test]
fn a_flat_range_and_a_box_overlapping_are_rejected() {
    // Rank 0 holds rows 0..2 as a box; rank 1 holds flattened elements 6..16 (rows 1.5..4).
    assert_rejected(2, "w", "overlap", |r| {
        let t = if r == 0 { rows("w", &[4, 4], 0..2) } else { flat("w", 6..16) };
        vec![StateTree::Tensor(t)]
    });
}

#[test]
fn a_box_outside_the_global_shape_is_rejected() {
    assert_rejected(2, "w", "exceeds", |r| {
        let t = if r == 0 {
            rows("w", &[4, 4], 0..2)
        } else {
            shard("w", DType::F32, &[4, 4], &[3, 0], &[2, 4], 0, None, TensorData::Owned(vec![0; 32]))
        };
        vec![StateTree::Tensor(t)]
    });
}

#[test]
fn a_flat_range_outside_its_box_is_rejected() {
    assert_rejected(2, "w", "flattened range", |r| {
        let t = if r == 0 { flat("w", 0..8) } else { flat("w", 8..17) };
        vec![StateTree::Tensor(t)]
    });
}

#[test]
fn a_missing_object_shard_is_rejected() {
    // Grid of 2 shards: shard 1 exists only as a non-main replica.
    assert_rejected(2, "rng", "missing", |r| {
        let o = if r == 0 { object("rng", &[2], &[0]) } else { object("rng", &[2], &[0]).with_replica_id(1) };
        vec![StateTree::Object(o)]
    });
}

#[test]
fn a_duplicate_object_shard_is_rejected() {
    assert_rejected(2, "rng", "more than one", |r| {
        let cells: &[&[u64]] = if r == 0 { &[&[0], &[1]] } else { &[&[1]] };
        cells.iter().map(|c| StateTree::Object(object("rng", &[2], c))).collect()
    });
}

#[test]
fn an_object_grid_mismatch_is_rejected() {
    assert_rejected(2, "rng", "grid", |r| {
        let grid: &[u64] = if r == 0 { &[2] } else { &[3] };
        vec![StateTree::Object(object("rng", grid, &[r as u64]))]
    });
}

#[test]
fn bad_axis_fragmentations_are_rejected_on_every_rank() {
    // Rank 1 says axis 0 is cut into 3 fragments, but its box is half the tensor.
    assert_rejected(2, "w", "fragment", |r| {
        let data = TensorData::Owned(vec![0u8; 2 * 4 * 4]);
        let mut t = ShardedTensor::from_rank_offsets("w", DType::F32, &[2, 4], data, &[(0, r as u64, 2)], 0).unwrap();
        if r == 1 {
            t.axis_fragmentations = Some(vec![3, 1]);
        }
        vec![StateTree::Tensor(t)]
    });
    // Wrong number of axes.
    assert_rejected(2, "w", "axis_fragmentations", |r| {
        let data = TensorData::Owned(vec![0u8; 2 * 4 * 4]);
        let mut t = ShardedTensor::from_rank_offsets("w", DType::F32, &[2, 4], data, &[(0, r as u64, 2)], 0).unwrap();
        t.axis_fragmentations = Some(vec![2]);
        vec![StateTree::Tensor(t)]
    });
    // An offset off the fragment grid.
    assert_rejected(2, "w", "fragment boundary", |r| {
        let data = TensorData::Owned(vec![0u8; 2 * 4 * 4]);
        let mut t = ShardedTensor::from_rank_offsets("w", DType::F32, &[2, 4], data, &[(0, r as u64, 2)], 0).unwrap();
        if r == 1 {
            t.global_offset = vec![1, 0];
        }
        vec![StateTree::Tensor(t)]
    });
}

#[test]
fn from_rank_offsets_rejects_bad_arguments() {
    let mk = |offsets: &[(usize, u64, u64)]| {
        ShardedTensor::from_rank_offsets("w", DType::F32, &[2, 4], TensorData::None, offsets, 0).unwrap_err()
    };
    for e in [mk(&[(2, 0, 2)]), mk(&[(0, 2, 2)]), mk(&[(0, 0, 0)]), mk(&[(0, 0, 2), (0, 1, 2)])] {
        assert!(matches!(&e, Error::InvalidSharding { key, .. } if key == "w"), "{e:?}");
    }
    let t = ShardedTensor::from_rank_offsets("w", DType::F32, &[2, 4], TensorData::None, &[(1, 1, 3), (0, 2, 5)], 1)
        .unwrap();
    // Axes are global axes: axis 0 is the prepended one, axis 1 the first local axis.
    assert_eq!(t.global_shape, vec![5, 6, 4]);
    assert_eq!(t.global_offset, vec![2, 2, 0]);
    assert_eq!(t.box_shape(), vec![1, 2, 4]);
    assert_eq!(t.axis_fragmentations, Some(vec![5, 3, 1]));
    t.check(true).unwrap();
}

/// Every rank fails (any error but a communication timeout), and nothing was written.
#[track_caller]
fn assert_all_fail(world: usize, leaves: impl Fn(usize) -> Vec<StateTree<'static>> + Sync) -> Vec<Error> {
    let (out, left) = try_save(world, leaves);
    let errs: Vec<Error> = out
        .into_iter()
        .enumerate()
        .map(|(rank, r)| match r {
            Err(Error::Comm { reason }) => panic!("rank {rank} hung in a collective: {reason}"),
            Err(e) => e,
            Ok(rep) => panic!("rank {rank} saved: {rep:?}"),
        })
        .collect();
    assert!(left.is_empty(), "a failed save left files behind: {left:?}");
    errs
}

#[test]
fn a_buffer_of_the_wrong_size_fails_every_rank_without_hanging() {
    let errs = assert_all_fail(3, |r| {
        let mut t = rows("w", &[3, 4], r as u64..r as u64 + 1);
        if r == 1 {
            t.data = TensorData::Owned(vec![0u8; 15]);
        }
        vec![StateTree::Tensor(t)]
    });
    assert!(matches!(&errs[1], Error::InvalidArgument { reason } if reason.contains("\"w\"")), "{:?}", errs[1]);
    for r in [0, 2] {
        assert!(
            matches!(&errs[r], Error::PeerFailed { rank: 1, .. } | Error::InvalidArgument { .. }),
            "rank {r}: {:?}",
            errs[r]
        );
    }
}

#[test]
fn a_main_replica_without_data_fails_every_rank() {
    let errs = assert_all_fail(2, |r| {
        let mut t = rows("w", &[2, 4], r as u64..r as u64 + 1);
        if r == 0 {
            t.data = TensorData::None;
        }
        vec![StateTree::Tensor(t)]
    });
    assert!(matches!(&errs[0], Error::InvalidArgument { .. }), "{:?}", errs[0]);
    assert!(matches!(&errs[1], Error::PeerFailed { rank: 0, .. } | Error::InvalidArgument { .. }), "{:?}", errs[1]);
}

#[test]
fn a_zero_block_size_fails_every_rank() {
    let dir = TempDir::new("invalid-block");
    let storage = LocalStorage::new(dir.path());
    let out = run_ranks(2, |c| {
        let t = rows("w", &[2, 4], c.rank() as u64..c.rank() as u64 + 1);
        save(StateTree::map().with("w", StateTree::Tensor(t)), &storage, c, &small_blocks(0))
    });
    for r in out {
        assert!(matches!(r, Err(Error::InvalidArgument { .. } | Error::PeerFailed { .. })), "{r:?}");
    }
    assert!(names(&storage).is_empty());
}

// ---------------------------------------------------------------------------------------------
// Overwrite protection.

/// `w` = `[4, 3]` f32 filled with `base + i`, split by rows over `world` ranks; common `version`.
fn versioned_save(storage: &dyn Storage, world: usize, base: f32, overwrite: bool) -> Vec<Result<SaveReport>> {
    let global: Vec<f32> = (0..12).map(|i| base + i as f32).collect();
    run_ranks(world, |c| {
        let r = c.rank() as u64;
        let per = 4 / world as u64;
        let rs = r * per..if c.rank() + 1 == world { 4 } else { (r + 1) * per };
        let bytes = f32_bytes(&global[rs.start as usize * 3..rs.end as usize * 3]);
        let t =
            shard("w", DType::F32, &[4, 3], &[rs.start, 0], &[rs.end - rs.start, 3], 0, None, TensorData::Owned(bytes));
        let tree = StateTree::map()
            .with("w", StateTree::Tensor(t))
            .with("version", StateTree::Value(Value::Float(base as f64)));
        save(tree, storage, c, &SaveOptions { overwrite, ..small_blocks(16) })
    })
}

fn load_w(storage: &dyn Storage) -> (Vec<f32>, Value) {
    let plain = open(storage).and_then(|c| c.read_tensors(None)).unwrap();
    let common = tree_value(&open(storage).map(|c| c.common_state()).unwrap()).unwrap();
    (f32s(&plain["w"].data), common.get("version").cloned().unwrap())
}

fn check_overwrite(storage: &dyn Storage) {
    for r in versioned_save(storage, 2, 100.0, false) {
        r.unwrap();
    }
    let before = names(storage);
    let index_before = storage.read(INDEX_FILE).unwrap();
    assert_eq!(data_files(storage).len(), 2);

    // Again without overwrite: refused on every rank, nothing touched.
    for (rank, r) in versioned_save(storage, 2, 200.0, false).into_iter().enumerate() {
        assert!(matches!(r, Err(Error::AlreadyExists { .. })), "rank {rank}: {r:?}");
    }
    assert_eq!(names(storage), before);
    assert_eq!(storage.read(INDEX_FILE).unwrap(), index_before);
    let (w, v) = load_w(storage);
    assert_eq!(w, (0..12).map(|i| 100.0 + i as f32).collect::<Vec<_>>());
    assert_eq!(v, Value::Float(100.0));

    // With overwrite, from a different world size: only the new files remain.
    let old_files = data_files(storage);
    let reports: Vec<SaveReport> = versioned_save(storage, 3, 300.0, true).into_iter().map(Result::unwrap).collect();
    let new_files = data_files(storage);
    assert_eq!(new_files.len(), 3, "{new_files:?}");
    assert!(new_files.iter().all(|f| !old_files.contains(f)), "old {old_files:?}, new {new_files:?}");
    let mut reported: Vec<String> = reports.iter().filter_map(|r| r.file.clone()).collect();
    reported.sort();
    assert_eq!(reported, new_files);
    let index = open(storage).map(Checkpoint::into_index).unwrap();
    let mut indexed: Vec<String> = index.files.iter().map(|f| f.name.clone()).collect();
    indexed.sort();
    assert_eq!(indexed, new_files);
    let mut expected_names = new_files.clone();
    expected_names.push(INDEX_FILE.to_string());
    expected_names.sort();
    assert_eq!(names(storage), expected_names, "stray files after overwrite");
    let (w, v) = load_w(storage);
    assert_eq!(w, (0..12).map(|i| 300.0 + i as f32).collect::<Vec<_>>());
    assert_eq!(v, Value::Float(300.0));
    assert!(verify(storage, 2).unwrap().problems.is_empty());
}

#[test]
fn overwrite_is_refused_unless_asked_local() {
    let dir = TempDir::new("overwrite");
    check_overwrite(&LocalStorage::new(dir.path()));
}

#[test]
fn overwrite_is_refused_unless_asked_memory() {
    check_overwrite(&MemoryStorage::new());
}

#[test]
fn a_rejected_save_leaves_the_committed_checkpoint_intact() {
    let storage = MemoryStorage::new();
    for r in versioned_save(&storage, 2, 1.0, false) {
        r.unwrap();
    }
    let before = names(&storage);
    // An invalid overwrite: rejected before writing, the old checkpoint still loads.
    let out = run_ranks(2, |c| {
        let t = rows("w", &[4, 3], 0..3); // both ranks claim rows 0..3
        save(
            StateTree::map().with("w", StateTree::Tensor(t)),
            &storage,
            c,
            &SaveOptions { overwrite: true, ..small_blocks(16) },
        )
    });
    for r in out {
        assert!(matches!(&r, Err(Error::InvalidSharding { key, .. }) if key == "w"), "{r:?}");
    }
    assert_eq!(names(&storage), before);
    assert_eq!(load_w(&storage).0, (0..12).map(|i| 1.0 + i as f32).collect::<Vec<_>>());
}

#[test]
fn two_main_shards_of_the_same_box_on_one_rank_overlap() {
    assert_rejected(1, "w", "overlap", |_| {
        vec![StateTree::Tensor(rows("w", &[2, 4], 0..2)), StateTree::Tensor(rows("w", &[2, 4], 0..2))]
    });
}

#[test]
fn without_validation_an_invalid_checkpoint_is_written_and_verify_reports_it() {
    // `validate: false` skips the global check (Megatron's validate_access_integrity=False);
    // the damage is then visible to verify, naming the key.
    let storage = MemoryStorage::new();
    let opts = SaveOptions { validate: false, ..small_blocks(16) };
    let out = run_ranks(2, |c| {
        let rs = if c.rank() == 0 { 0..3 } else { 2..4 };
        save(StateTree::map().with("w", StateTree::Tensor(rows("w", &[4, 4], rs))), &storage, c, &opts)
    });
    for r in out {
        r.unwrap();
    }
    let report = verify(&storage, 2).unwrap();
    assert!(report.problems.iter().any(|p| p.contains("\"w\"") && p.contains("overlap")), "{:?}", report.problems);
}

#[test]
fn loading_a_region_an_unvalidated_checkpoint_lacks_names_the_key_and_region() {
    // Rows 2..4 were never saved (validation off); asking for them fails, naming key and region.
    let storage = MemoryStorage::new();
    let opts = SaveOptions { validate: false, ..small_blocks(16) };
    let tree = StateTree::map().with("w", StateTree::Tensor(rows("w", &[4, 4], 0..2)));
    save(tree, &storage, &SoloComm, &opts).unwrap();
    let request = |rs: Range<u64>| {
        let t = shard("w", DType::F32, &[4, 4], &[rs.start, 0], &[rs.end - rs.start, 4], 0, None, TensorData::None);
        StateTree::map().with("w", StateTree::Tensor(t))
    };
    load(request(0..2), &storage, &SoloComm, &load_opts()).unwrap();
    match load(request(1..3), &storage, &SoloComm, &load_opts()) {
        Err(Error::NotCovered { key, region }) => {
            assert_eq!(key, "w");
            assert!(region.contains("1:3"), "region {region:?}");
        }
        other => panic!("{other:?}"),
    }
    assert!(!verify(&storage, 1).unwrap().problems.is_empty());
}

#[test]
fn validate_sharding_integrity_checks_without_writing() {
    let ok = run_ranks(3, |c| validate_sharding_integrity(tree_with(c.rank(), 3, vec![]), c));
    assert!(ok.iter().all(Result::is_ok), "{ok:?}");
    let bad = run_ranks(3, |c| {
        let overlap = StateTree::Tensor(rows("w", &[4, 2], 0..3 - c.rank() as u64));
        validate_sharding_integrity(tree_with(c.rank(), 3, vec![overlap]), c)
    });
    for r in &bad {
        assert!(matches!(r, Err(Error::InvalidSharding { key, .. }) if key == "w"), "{r:?}");
    }
}
