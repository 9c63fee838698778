//! The golden checkpoints: tiny checkpoints committed under `tests/fixtures/golden_vN/`, one
//! per format version, each saved once from two in-process ranks, that every future build must
//! load bit-exactly. A change that breaks one of these tests breaks every checkpoint of that
//! version in the wild: bump the format version (and keep a reader for the old one) instead of
//! regenerating a fixture. `golden_v1` was written by tessera 0.1 (format version 1) and can no
//! longer be regenerated; `golden_v2` holds the same state in format version 2.
//!
//! Regenerate the current version's fixture only when deliberately creating it (file names
//! change, content does not):
//!
//! ```text
//! cargo test -p tessera --test integration -- --ignored golden::regenerate_golden_v2
//! ```

use std::collections::BTreeMap;

use crate::common::*;
use tessera::index::*;
use tessera::storage::*;
use tessera::tools::*;
use tessera::*;

const GOLDEN_V1: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/golden_v1");
const GOLDEN_V2: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/golden_v2");

/// `embedding` (bf16 [4, 6]): element (i, j) is `(6i + j) / 2 - 3`, exact in bf16.
fn embedding() -> Vec<f32> {
    (0..24).map(|k| k as f32 * 0.5 - 3.0).collect()
}

/// `decoder.mlp.weight` (f32 [2, 3, 4], stacked layers): `100 l + 4 i + j + 0.25`.
fn layers() -> Vec<f32> {
    (0..2).flat_map(|l| (0..12).map(move |k| 100.0 * l as f32 + k as f32 + 0.25)).collect()
}

/// `optimizer.exp_avg` (f32 [5, 3], saved as two flattened ranges): `k / 8`.
fn exp_avg() -> Vec<f32> {
    (0..15).map(|k| k as f32 / 8.0).collect()
}

const STEPS: [i64; 4] = [-2, 0, 1 << 40, i64::MAX];
/// f16 1.0, -2.0, 0.5.
const NORM_F16: [u8; 6] = [0x00, 0x3c, 0x00, 0xc0, 0x00, 0x38];
const MASK: [u8; 5] = [1, 0, 1, 1, 0];
/// fp8 e4m3fn 1.0, 2.0, -1.0, 0.0.
const SCALE_FP8: [u8; 4] = [0x38, 0x40, 0xb8, 0x00];

fn rng_state(rank: u64) -> Vec<u8> {
    format!("golden rng state of rank {rank}").into_bytes()
}

fn common_state() -> Value {
    Value::Map(vec![
        (
            "args".into(),
            Value::Map(vec![
                ("lr".into(), Value::Float(0.0003)),
                ("model".into(), Value::Str("gpt-golden".into())),
                ("tp".into(), Value::Int(2)),
                ("flags".into(), Value::List(vec![Value::Bool(true), Value::Null, Value::Bytes(vec![0xde, 0xad])])),
            ]),
        ),
        ("iteration".into(), Value::Int(1234)),
    ])
}

fn content_metadata() -> Value {
    Value::Map(vec![
        ("distrib_optim_sharding_type".into(), Value::Str("fully_sharded_model_space".into())),
        ("golden".into(), Value::Int(1)),
    ])
}

/// The state of `rank` (of 2) at save time.
fn golden_state(rank: u64) -> StateTree<'static> {
    let emb = bf16_bytes(&embedding());
    let emb = shard(
        "embedding",
        DType::BF16,
        &[4, 6],
        &[2 * rank, 0],
        &[2, 6],
        0,
        None,
        TensorData::Owned(emb[rank as usize * 24..][..24].to_vec()),
    );
    let layer = f32_bytes(&layers()[rank as usize * 12..][..12]);
    let layer = ShardedTensor::from_rank_offsets(
        "decoder.mlp.weight",
        DType::F32,
        &[3, 4],
        TensorData::Owned(layer),
        &[(0, rank, 2)],
        1,
    )
    .unwrap();
    let range = if rank == 0 { 0..7 } else { 7..15 };
    let avg = f32_bytes(&exp_avg()[range.start as usize..range.end as usize]);
    let avg = shard("optimizer.exp_avg", DType::F32, &[5, 3], &[0, 0], &[5, 3], 0, Some(range), TensorData::Owned(avg));
    let steps = i64_bytes(&STEPS[rank as usize * 2..][..2]);
    let steps = shard("step_counts", DType::I64, &[4], &[2 * rank], &[2], 0, None, TensorData::Owned(steps));
    let norm = ShardedTensor::full("final_norm", DType::F16, &[3], TensorData::Owned(NORM_F16.to_vec()))
        .with_replica_id(rank as u32);
    let mut tree = StateTree::map()
        .with(
            "model",
            StateTree::map()
                .with("embedding", StateTree::Tensor(emb))
                .with("layers", StateTree::List(vec![StateTree::Tensor(layer)]))
                .with("final_norm", StateTree::Tensor(norm)),
        )
        .with("optimizer", StateTree::map().with("exp_avg", StateTree::Tensor(avg)))
        .with("steps", StateTree::Tensor(steps))
        .with("rng", StateTree::Object(ShardedObject::new("rng_state", rng_state(rank), &[2], &[rank])))
        .with("local_only", StateTree::NonPersistent(Value::Str("not saved".into())));
    if rank == 0 {
        tree.insert(
            "scale",
            StateTree::Tensor(ShardedTensor::full(
                "scale_fp8",
                DType::F8E4M3,
                &[4],
                TensorData::Owned(SCALE_FP8.to_vec()),
            )),
        );
        if let Value::Map(entries) = common_state() {
            for (k, v) in entries {
                tree.insert(k, StateTree::Value(v));
            }
        }
    } else {
        tree.insert(
            "mask",
            StateTree::Tensor(ShardedTensor::full("mask", DType::Bool, &[5], TensorData::Owned(MASK.to_vec()))),
        );
    }
    tree
}

/// Key → (dtype, shape, bytes) of every tensor in the fixture.
fn expected_tensors() -> BTreeMap<&'static str, (DType, Vec<u64>, Vec<u8>)> {
    BTreeMap::from([
        ("embedding", (DType::BF16, vec![4, 6], bf16_bytes(&embedding()))),
        ("decoder.mlp.weight", (DType::F32, vec![2, 3, 4], f32_bytes(&layers()))),
        ("optimizer.exp_avg", (DType::F32, vec![5, 3], f32_bytes(&exp_avg()))),
        ("step_counts", (DType::I64, vec![4], i64_bytes(&STEPS))),
        ("final_norm", (DType::F16, vec![3], NORM_F16.to_vec())),
        ("mask", (DType::Bool, vec![5], MASK.to_vec())),
        ("scale_fp8", (DType::F8E4M3, vec![4], SCALE_FP8.to_vec())),
    ])
}

#[test]
#[ignore = "writes the committed fixture; run only to create it (see the module docs)"]
fn regenerate_golden_v2() {
    assert_eq!(FORMAT_VERSION, 2, "add a fixture for the new version instead");
    let _ = std::fs::remove_dir_all(GOLDEN_V2);
    std::fs::create_dir_all(GOLDEN_V2).unwrap();
    let storage = LocalStorage::new(GOLDEN_V2);
    let opts = SaveOptions { content_metadata: content_metadata(), ..small_blocks(16) };
    for r in run_ranks(2, |c| save(golden_state(c.rank() as u64), &storage, c, &opts)) {
        r.unwrap();
    }
    let report = verify(&storage, 2).unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
}

#[test]
fn golden_v1_loads_forever() {
    golden_loads(GOLDEN_V1, 1);
}

#[test]
fn golden_v2_loads_forever() {
    golden_loads(GOLDEN_V2, 2);
    // Version 2's directory: a reader of one tensor decodes only that tensor's chunks.
    let storage = LocalStorage::new(GOLDEN_V2);
    let ckpt = open_with(&storage, &OpenOptions { keys: Some(vec!["final_norm".into()]) }).unwrap();
    assert_eq!(ckpt.index().tensors.len(), 1);
    assert_eq!(ckpt.index().omitted_tensors.len(), expected_tensors().len() - 1);
    assert_eq!(ckpt.index().tensor_keys().count(), expected_tensors().len());
    assert_eq!(
        ckpt.index().tensor("final_norm"),
        open(&storage).map(Checkpoint::into_index).unwrap().tensor("final_norm")
    );
}

fn golden_loads(dir: &str, version: u32) {
    let storage = LocalStorage::new(dir);
    // Files: the index and one data file per rank, a few KB in all.
    let files = names(&storage);
    assert_eq!(files.len(), 3, "{files:?}");
    assert!(files.contains(&INDEX_FILE.to_string()));
    let total: u64 = files.iter().map(|f| storage.size(f).unwrap()).sum();
    assert!(total < 16 << 10, "the fixture must stay tiny ({total} bytes)");

    let index = open(&storage).map(Checkpoint::into_index).unwrap();
    assert_eq!((index.backend.name(), index.version, index.block_size), ("tessera", version, 16));
    assert_eq!(index.files.len(), 2);
    assert_eq!(FormatRecord::detect(&storage).unwrap(), FormatRecord { backend: Backend::Tessera, version });

    // Metadata and whole tensors, bit-exact.
    let expected = expected_tensors();
    let meta = open(&storage).map(|c| c.tensors_metadata()).unwrap();
    assert_eq!(meta.len(), expected.len());
    for (k, (dtype, shape, _)) in &expected {
        assert_eq!(meta[*k], TensorMeta { dtype: *dtype, global_shape: shape.clone() }, "{k}");
    }
    let plain = open(&storage).and_then(|c| c.read_tensors(None)).unwrap();
    for (k, (dtype, shape, bytes)) in &expected {
        let p = &plain[*k];
        assert_eq!((p.dtype, &p.shape, &p.data), (*dtype, shape, bytes), "{k}");
    }
    // A few values spelled out: bf16 -3.0 is 0xc040 and -2.5 is 0xc020, the last exp_avg is 14/8.
    assert_eq!(plain["embedding"].data[..4], [0x40, 0xc0, 0x20, 0xc0]);
    assert_eq!(f32s(&plain["optimizer.exp_avg"].data)[14], 1.75);
    assert_eq!(f32s(&plain["decoder.mlp.weight"].data)[12], 100.25);

    // A resharded load on 3 ranks: embedding by columns, exp_avg in another flat split,
    // one layer each for ranks 0 and 1, objects, common state.
    let emb_truth = bf16_bytes(&embedding());
    let avg_truth = f32_bytes(&exp_avg());
    let out = run_ranks(3, |c| {
        let r = c.rank() as u64;
        let emb = shard("embedding", DType::BF16, &[4, 6], &[0, 2 * r], &[4, 2], 0, None, TensorData::None);
        let range = [0..4, 4..11, 11..15][r as usize].clone();
        let avg =
            shard("optimizer.exp_avg", DType::F32, &[5, 3], &[0, 0], &[5, 3], 0, Some(range.clone()), TensorData::None);
        let mut tree = StateTree::map().with("emb", StateTree::Tensor(emb)).with("avg", StateTree::Tensor(avg)).with(
            "rng",
            StateTree::Object(ShardedObject { data: None, ..ShardedObject::new("rng_state", vec![], &[2], &[r % 2]) }),
        );
        if r < 2 {
            let l = ShardedTensor::from_rank_offsets(
                "decoder.mlp.weight",
                DType::F32,
                &[3, 4],
                TensorData::None,
                &[(0, r, 2)],
                1,
            )
            .unwrap();
            tree.insert("layer", StateTree::Tensor(l));
        }
        let opts = LoadOptions { strict: StrictHandling::RaiseUnexpected, ..load_opts() };
        let res = load(tree, &storage, c, &opts).unwrap();
        assert_eq!(bytes_at(&res.state, "emb"), box_bytes(&emb_truth, &[4, 6], 2, &[0, 2 * r], &[4, 2]), "rank {r}");
        assert_eq!(bytes_at(&res.state, "avg"), &avg_truth[range.start as usize * 4..range.end as usize * 4]);
        if r < 2 {
            assert_eq!(f32s(bytes_at(&res.state, "layer")), layers()[r as usize * 12..][..12]);
        }
        let obj = res.state.get_dotted("rng").and_then(StateTree::as_object).unwrap();
        assert_eq!(obj.data.as_deref(), Some(&rng_state(r % 2)[..]));
        assert_eq!(res.state.get_dotted("iteration").and_then(StateTree::as_value), Some(&Value::Int(1234)));
        assert!(res.state.get_dotted("local_only").is_none(), "non-persistent values are not saved");
    });
    assert_eq!(out.len(), 3);

    // Common state, content metadata, objects.
    assert_eq!(tree_value(&open(&storage).map(|c| c.common_state()).unwrap()).unwrap(), common_state());
    assert_eq!(open(&storage).map(|c| c.content_metadata().clone()).unwrap(), content_metadata());
    let objs = StateTree::List(
        (0..2u64)
            .map(|r| {
                StateTree::Object(ShardedObject { data: None, ..ShardedObject::new("rng_state", vec![], &[2], &[r]) })
            })
            .collect(),
    );
    let objs = open(&storage).and_then(|c| c.load_objects(objs)).unwrap();
    for r in 0..2u64 {
        let o = objs.get_dotted(&r.to_string()).and_then(StateTree::as_object).unwrap();
        assert_eq!(o.data.as_deref(), Some(&rng_state(r)[..]));
    }

    // And it verifies clean.
    let report = verify(&storage, 2).unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    assert_eq!(report.files, 2);
    assert_eq!(report.chunks, index.chunk_count());
    let data_bytes: u64 = expected.values().map(|(_, _, b)| b.len() as u64).sum();
    assert!(report.bytes_checked >= data_bytes);
}
