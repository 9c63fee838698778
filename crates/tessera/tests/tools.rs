//! The whole-checkpoint tools: export to plain safetensors (one file, shards with their index
//! json, key subsets, casts, tiny memory budgets), conversion of a TP×DP checkpoint to the
//! native format (verified, loaded resharded, common state and objects kept, overwrite rules),
//! and diff (equal, values with and without tolerance, keys on one side, shapes, dtypes, common
//! state, objects, content metadata).

use std::collections::BTreeMap;
use std::path::Path;

use crate::common::*;
use serde_json::{json, Value as J};
use tessera::comm::*;
use tessera::index::*;
use tessera::storage::*;
use tessera::tools::diff::*;
use tessera::tools::*;
use tessera::*;

const TP: u64 = 2;
const DP: u64 = 2;

/// Dtype, global shape and bytes of every tensor of the TP×DP checkpoint.
fn truth() -> BTreeMap<&'static str, (DType, Vec<u64>, Vec<u8>)> {
    let f32s = |n: usize, f: &dyn Fn(usize) -> f32| f32_bytes(&(0..n).map(f).collect::<Vec<_>>());
    let mut t = BTreeMap::new();
    // Values that bf16 cannot hold exactly, so casts round.
    t.insert("w", (DType::F32, vec![8, 6], f32s(48, &|i| 1.0 / 3.0 + i as f32 * 0.1)));
    t.insert("opt.exp_avg", (DType::F32, vec![8, 6], f32s(48, &|i| -3.0 + i as f32 * 0.37)));
    t.insert("emb", (DType::BF16, vec![10, 4], bf16_bytes(&(0..40).map(|i| i as f32 - 7.0).collect::<Vec<_>>())));
    let stack = DType::F32.cast_bytes(&f32s(24, &|i| i as f32 * 0.5 - 2.0), DType::F16).unwrap();
    t.insert("stack", (DType::F16, vec![2, 4, 3], stack));
    t.insert("steps", (DType::I64, vec![3], i64_bytes(&[5, -6, 7])));
    t.insert("scale", (DType::F32, vec![], f32_bytes(&[0.1])));
    t.insert("empty", (DType::F32, vec![0, 5], Vec::new()));
    t
}

fn rng_bytes(rank: u64) -> Vec<u8> {
    vec![rank as u8 + 1; 3 + rank as usize]
}

/// Rank `rank` of TP=2 × DP=2: rows split by TP and replicated over DP; optimizer state as DP
/// flat ranges of the TP boxes; columns split by TP; a prepended layer axis; replicated small
/// tensors, a scalar and an empty tensor; an object per rank; common values.
fn tp_dp_rank(rank: u64) -> StateTree<'static> {
    let (tp, dp) = (rank % TP, rank / TP);
    let t = truth();
    let piece = |key: &str, off: &[u64], shape: &[u64], prepend: usize, flat: Option<std::ops::Range<u64>>| {
        let (dtype, global, all) = &t[key];
        let data = shard_bytes(all, global, dtype.size(), off, shape, flat.as_ref());
        shard(key, *dtype, global, off, shape, prepend, flat, TensorData::Owned(data))
    };
    let replica = [0, dp as u32];
    let whole = |key: &str| {
        let (dtype, global, all) = &t[key];
        ShardedTensor::full(key, *dtype, global, TensorData::Owned(all.clone())).with_replica_id(rank as u32)
    };
    let mut tree = StateTree::map()
        .with("w", StateTree::Tensor(piece("w", &[4 * tp, 0], &[4, 6], 0, None).with_replica_id(replica)))
        .with("opt", StateTree::Tensor(piece("opt.exp_avg", &[4 * tp, 0], &[4, 6], 0, Some(12 * dp..12 * dp + 12))))
        .with("emb", StateTree::Tensor(piece("emb", &[0, 2 * tp], &[10, 2], 0, None).with_replica_id(replica)))
        .with("stack", StateTree::Tensor(piece("stack", &[tp, 0, 0], &[1, 4, 3], 1, None).with_replica_id(replica)))
        .with("steps", StateTree::Tensor(whole("steps")))
        .with("scale", StateTree::Tensor(whole("scale")))
        .with("empty", StateTree::Tensor(whole("empty")))
        .with("rng", StateTree::Object(ShardedObject::new("rng", rng_bytes(rank), &[TP, DP], &[tp, dp])));
    if rank == 0 {
        tree.insert("iteration", StateTree::Value(Value::Int(7)));
        tree.insert(
            "config",
            StateTree::map()
                .with("lr", StateTree::Value(Value::Float(0.1)))
                .with("name", StateTree::Value(Value::Str("gpt".into()))),
        );
    }
    tree
}

fn save_opts() -> SaveOptions {
    SaveOptions { content_metadata: Value::Str("tools test".into()), ..small_blocks(16) }
}

/// The 4-rank TP×DP checkpoint.
fn tp_dp_checkpoint(storage: &dyn Storage) {
    for (r, res) in run_ranks((TP * DP) as usize, |c| save(tp_dp_rank(c.rank() as u64), storage, c, &save_opts()))
        .into_iter()
        .enumerate()
    {
        res.unwrap_or_else(|e| panic!("save, rank {r}: {e}"));
    }
}

fn memory_checkpoint() -> MemoryStorage {
    let s = MemoryStorage::new();
    tp_dp_checkpoint(&s);
    s
}

/// A parsed safetensors file: `__metadata__`, then per tensor its dtype name, shape and bytes.
/// Checks that the data of the tensors lies back to back in key order and fills the file.
#[allow(clippy::type_complexity)]
fn read_safetensors(path: &Path) -> (J, BTreeMap<String, (String, Vec<u64>, Vec<u8>)>) {
    let bytes = std::fs::read(path).unwrap();
    // The safetensors layout read here on its own: an 8-byte little-endian header length, the
    // JSON header, then the data.
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    let start = 8 + header_len;
    let mut tensors = BTreeMap::new();
    let mut next = 0;
    for (name, e) in header.as_object().unwrap() {
        if name == "__metadata__" {
            continue;
        }
        let offs: Vec<usize> =
            e["data_offsets"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as usize).collect();
        assert_eq!(offs[0], next, "{}: {name} follows the previous tensor", path.display());
        next = offs[1];
        let shape = e["shape"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
        let data = bytes[start + offs[0]..start + offs[1]].to_vec();
        tensors.insert(name.clone(), (e["dtype"].as_str().unwrap().to_string(), shape, data));
    }
    assert_eq!(start + next, bytes.len(), "{}: data fills the file", path.display());
    (header["__metadata__"].clone(), tensors)
}

fn dir_names(dir: &Path) -> Vec<String> {
    let mut n: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    n.sort();
    n
}

fn no_progress() -> impl FnMut(u64, u64) {
    |_, _| {}
}

// ---------------------------------------------------------------------------------------------
// Export.

#[test]
fn export_single_file_holds_every_tensor_whole() {
    let src = memory_checkpoint();
    let dir = TempDir::created("export-single");
    let out = dir.join("model.safetensors");
    let mut calls = Vec::new();
    let report = export_safetensors(&src, &out, &ExportOptions::default(), &mut |d, t| calls.push((d, t))).unwrap();
    let truth = truth();
    let total: u64 = truth.values().map(|(_, _, b)| b.len() as u64).sum();
    assert_eq!((report.tensors, report.bytes, report.files.clone(), report.index), (7, total, vec![out.clone()], None));
    assert_eq!(calls.last(), Some(&(total, total)));
    assert!(calls.windows(2).all(|w| w[0].0 <= w[1].0 && w[0].1 == total), "{calls:?}");

    let (meta, tensors) = read_safetensors(&out);
    assert_eq!(meta, json!({"format": "pt"}));
    let plain = open(&src).and_then(|c| c.read_tensors(None)).unwrap();
    assert_eq!(tensors.keys().collect::<Vec<_>>(), plain.keys().collect::<Vec<_>>());
    for (key, p) in &plain {
        let (dtype, shape, data) = &tensors[key];
        assert_eq!((dtype.as_str(), shape, data), (p.dtype.safetensors_name(), &p.shape, &p.data), "{key}");
        assert_eq!(data, &truth[key.as_str()].2, "{key}");
    }
    assert_eq!(tensors["scale"].1, Vec::<u64>::new(), "0-d tensor");
    assert!(tensors["empty"].2.is_empty());
    assert_eq!(dir_names(dir.path()), ["model.safetensors"], "no temporary file left");

    // Exporting again replaces the file; a directory receives model.safetensors (here: the
    // same file again).
    export_safetensors(&src, &out, &ExportOptions::default(), &mut no_progress()).unwrap();
    assert_eq!(read_safetensors(&out).1, tensors);
    let report = export_safetensors(&src, dir.path(), &ExportOptions::default(), &mut no_progress()).unwrap();
    assert_eq!(report.files, std::slice::from_ref(&out));
    assert_eq!(read_safetensors(&out).1, tensors);
    assert_eq!(dir_names(dir.path()), ["model.safetensors"]);
}

#[test]
fn export_sharded_packs_greedily_in_key_order_with_an_index() {
    let src = memory_checkpoint();
    let dir = TempDir::new("export-sharded");
    let out = dir.join("hf");
    let opts = ExportOptions { max_shard_size: Some(100), ..Default::default() };
    let report = export_safetensors(&src, &out, &opts, &mut no_progress()).unwrap();
    // Sizes in key order: emb 80, empty 0 | opt.exp_avg 192 (alone: larger than the limit) |
    // scale 4, stack 48, steps 24 | w 192.
    let name = |i: usize| format!("model-{i:05}-of-00004.safetensors");
    let expected: BTreeMap<&str, String> = [
        ("emb", name(1)),
        ("empty", name(1)),
        ("opt.exp_avg", name(2)),
        ("scale", name(3)),
        ("stack", name(3)),
        ("steps", name(3)),
        ("w", name(4)),
    ]
    .into_iter()
    .collect();
    assert_eq!(report.files, (1..=4).map(|i| out.join(name(i))).collect::<Vec<_>>());
    assert_eq!(report.index, Some(out.join("model.safetensors.index.json")));
    let mut names: Vec<String> = (1..=4).map(name).collect();
    names.push("model.safetensors.index.json".into());
    names.sort();
    assert_eq!(dir_names(&out), names);

    let index: J = serde_json::from_slice(&std::fs::read(out.join("model.safetensors.index.json")).unwrap()).unwrap();
    let truth = truth();
    let total: u64 = truth.values().map(|(_, _, b)| b.len() as u64).sum();
    assert_eq!(index["metadata"]["total_size"], total);
    assert_eq!(report.bytes, total);
    let weight_map: BTreeMap<&str, String> = index["weight_map"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str().unwrap().to_string()))
        .collect();
    assert_eq!(weight_map, expected);
    for i in 1..=4 {
        let (meta, tensors) = read_safetensors(&out.join(name(i)));
        assert_eq!(meta, json!({"format": "pt"}));
        let here: Vec<&str> = expected.iter().filter(|(_, f)| **f == name(i)).map(|(k, _)| *k).collect();
        assert_eq!(tensors.keys().map(String::as_str).collect::<Vec<_>>(), here, "file {i}");
        for (key, (dtype, shape, data)) in &tensors {
            let (d, s, b) = &truth[key.as_str()];
            assert_eq!((dtype.as_str(), shape, data), (d.safetensors_name(), s, b), "{key}");
        }
    }
}

#[test]
fn a_tiny_memory_budget_slices_rows_and_gives_the_same_files() {
    let src = memory_checkpoint();
    let dir = TempDir::created("export-tiny");
    for (tag, base) in [
        ("plain", ExportOptions::default()),
        ("bf16", ExportOptions { dtype: Some(DType::BF16), ..Default::default() }),
        ("sharded", ExportOptions { max_shard_size: Some(150), ..Default::default() }),
    ] {
        let (big, small) = (dir.join(&format!("{tag}-big")), dir.join(&format!("{tag}-small")));
        export_safetensors(&src, &big, &base, &mut no_progress()).unwrap();
        let mut steps = 0;
        // 16 bytes: a job holds 4 bytes, one f32 element (or less than a row of anything).
        let tiny = ExportOptions { memory_budget: 16, threads: 1, ..base.clone() };
        export_safetensors(&src, &small, &tiny, &mut |_, _| steps += 1).unwrap();
        assert!(steps > 100, "{tag}: {steps} slices");
        if base.max_shard_size.is_some() {
            assert_eq!(dir_names(&big), dir_names(&small), "{tag}");
            for n in dir_names(&big) {
                assert_eq!(std::fs::read(big.join(&n)).unwrap(), std::fs::read(small.join(&n)).unwrap(), "{tag} {n}");
            }
        } else {
            assert_eq!(std::fs::read(&big).unwrap(), std::fs::read(&small).unwrap(), "{tag}");
        }
    }
}

#[test]
fn export_of_a_key_subset_and_refusals() {
    let src = memory_checkpoint();
    let dir = TempDir::created("export-keys");
    let out = dir.join("subset.safetensors");
    let keys = Some(vec!["w".to_string(), "scale".to_string(), "w".to_string()]);
    let report =
        export_safetensors(&src, &out, &ExportOptions { keys, ..Default::default() }, &mut no_progress()).unwrap();
    assert_eq!(report.tensors, 2);
    let (_, tensors) = read_safetensors(&out);
    assert_eq!(tensors.keys().collect::<Vec<_>>(), ["scale", "w"]);
    assert_eq!(tensors["w"].2, truth()["w"].2);

    let refused =
        |opts: ExportOptions| export_safetensors(&src, &dir.join("no.safetensors"), &opts, &mut no_progress());
    let unknown = refused(ExportOptions { keys: Some(vec!["w".into(), "nope".into()]), ..Default::default() });
    assert!(
        matches!(&unknown, Err(Error::NotFound { path, .. }) if path.to_string_lossy().contains("nope")),
        "{unknown:?}"
    );
    let empty = refused(ExportOptions { keys: Some(Vec::new()), ..Default::default() });
    assert!(matches!(empty, Err(Error::InvalidArgument { .. })), "{empty:?}");
    let not_float = refused(ExportOptions { dtype: Some(DType::I32), ..Default::default() });
    assert!(matches!(not_float, Err(Error::InvalidArgument { .. })), "{not_float:?}");
    let zero = refused(ExportOptions { max_shard_size: Some(0), ..Default::default() });
    assert!(matches!(zero, Err(Error::InvalidArgument { .. })), "{zero:?}");
    assert!(!dir.join("no.safetensors").exists());
    let missing = export_safetensors(&MemoryStorage::new(), &out, &ExportOptions::default(), &mut no_progress());
    assert!(matches!(missing, Err(Error::NotFound { .. })), "{missing:?}");
}

#[test]
fn export_casts_floating_tensors_only() {
    let src = memory_checkpoint();
    let dir = TempDir::created("export-cast");
    let out = dir.join("bf16.safetensors");
    let opts = ExportOptions { dtype: Some(DType::BF16), ..Default::default() };
    let report = export_safetensors(&src, &out, &opts, &mut no_progress()).unwrap();
    let (_, tensors) = read_safetensors(&out);
    let truth = truth();
    let mut total = 0;
    for (key, (dtype, shape, data)) in &tensors {
        let (d, s, b) = &truth[key.as_str()];
        assert_eq!(shape, s, "{key}");
        let (want_dtype, want) = match d {
            DType::F32 | DType::F16 | DType::BF16 => (DType::BF16, d.cast_bytes(b, DType::BF16).unwrap()),
            other => (*other, b.clone()),
        };
        assert_eq!((dtype.as_str(), data), (want_dtype.safetensors_name(), &want), "{key}");
        total += data.len() as u64;
    }
    assert_eq!(tensors["steps"].0, "I64", "integers are not cast");
    assert_ne!(tensors["w"].2, bf16_bytes(&f32s(&truth["w"].2)), "rounded, not truncated");
    assert_eq!(report.bytes, total);
}

// ---------------------------------------------------------------------------------------------
// Convert.

/// A chunk's box: offset, shape, flat range.
type ChunkBox = (Vec<u64>, Vec<u64>, Option<(u64, u64)>);

/// The box of every chunk of every tensor, sorted.
fn chunk_boxes(index: &CheckpointIndex) -> BTreeMap<String, Vec<ChunkBox>> {
    index
        .tensors
        .iter()
        .map(|t| {
            let mut c: Vec<_> = t.chunks().iter().map(|c| (c.offset.to_vec(), c.shape.to_vec(), c.flat)).collect();
            c.sort();
            (t.key.clone(), c)
        })
        .collect()
}

fn objects_of(storage: &dyn Storage) -> Vec<Vec<u8>> {
    let mut tree = StateTree::List(Vec::new());
    for tp in 0..TP {
        for dp in 0..DP {
            tree.set_path(
                &[PathSeg::Index(tp * DP + dp)],
                StateTree::Object(ShardedObject {
                    key: "rng".into(),
                    data: None,
                    global_shape: vec![TP, DP],
                    global_offset: vec![tp, dp],
                    replica_id: ReplicaId::main(),
                }),
            );
        }
    }
    let StateTree::List(l) = open(storage).and_then(|c| c.load_objects(tree)).unwrap() else { panic!("not a list") };
    l.iter().map(|o| o.as_object().unwrap().data.clone().unwrap()).collect()
}

/// Checks that `dst` is a sound native checkpoint holding what the TP×DP checkpoint `src` holds.
fn assert_same_checkpoint(src: &dyn Storage, dst: &dyn Storage) {
    let v = verify(dst, 2).unwrap();
    assert!(v.problems.is_empty(), "{:?}", v.problems);
    let di = open(dst).map(Checkpoint::into_index).unwrap();
    assert_eq!(di.backend, tessera::index::Backend::Tessera);
    assert_eq!(
        open(dst).and_then(|c| c.read_tensors(None)).unwrap(),
        open(src).and_then(|c| c.read_tensors(None)).unwrap()
    );
    assert_eq!(
        tree_value(&open(dst).map(|c| c.common_state()).unwrap()),
        tree_value(&open(src).map(|c| c.common_state()).unwrap())
    );
    assert_eq!(open(dst).map(|c| c.content_metadata().clone()).unwrap(), Value::Str("tools test".into()));
    let objects = objects_of(dst);
    assert_eq!(objects, objects_of(src));
    // Grid position (tp, dp) was saved by rank tp + TP·dp.
    assert_eq!(objects[1], rng_bytes(2));
    let d = diff(src, dst, &DiffOptions::default()).unwrap();
    assert!(d.is_equal(), "{d:?}");

    // Resharded load on 3 ranks: columns of `w` (3 × 2), flat thirds of the optimizer state,
    // rows of `emb`, one layer of `stack` each for two ranks.
    let truth = truth();
    run_ranks(3, |c| {
        let r = c.rank() as u64;
        let (_, wg, wt) = &truth["w"];
        let (_, og, ot) = &truth["opt.exp_avg"];
        let (_, eg, et) = &truth["emb"];
        let (sd, sg, st) = &truth["stack"];
        let mut tree = StateTree::map()
            .with("w", StateTree::Tensor(shard("w", DType::F32, wg, &[0, 2 * r], &[8, 2], 0, None, TensorData::None)))
            .with(
                "o",
                StateTree::Tensor(shard(
                    "opt.exp_avg",
                    DType::F32,
                    og,
                    &[0, 0],
                    &[8, 6],
                    0,
                    Some(16 * r..16 * r + 16),
                    TensorData::None,
                )),
            )
            .with(
                "e",
                StateTree::Tensor(shard(
                    "emb",
                    DType::BF16,
                    eg,
                    &[3 * r, 0],
                    &[4.min(10 - 3 * r), 4],
                    0,
                    None,
                    TensorData::None,
                )),
            );
        if r < 2 {
            tree.insert(
                "s",
                StateTree::Tensor(shard("stack", *sd, sg, &[r, 0, 0], &[1, 4, 3], 1, None, TensorData::None)),
            );
        }
        let loaded = load(tree, dst, c, &load_opts()).unwrap().state;
        assert_eq!(bytes_at(&loaded, "w"), box_bytes(wt, wg, 4, &[0, 2 * r], &[8, 2]), "w rank {r}");
        assert_eq!(bytes_at(&loaded, "o"), &ot[64 * r as usize..64 * r as usize + 64], "opt rank {r}");
        let rows = 4.min(10 - 3 * r);
        assert_eq!(bytes_at(&loaded, "e"), box_bytes(et, eg, 2, &[3 * r, 0], &[rows, 4]), "emb rank {r}");
        if r < 2 {
            assert_eq!(bytes_at(&loaded, "s"), &st[24 * r as usize..24 * r as usize + 24], "stack rank {r}");
        }
    });
}

#[test]
fn convert_keeps_the_chunks_and_loads_identically_in_any_layout() {
    let src = memory_checkpoint();
    let dst = MemoryStorage::new();
    let mut calls = Vec::new();
    let report =
        convert(&src, &dst, &ConvertOptions { threads: 2, ..Default::default() }, &mut |d, t| calls.push((d, t)))
            .unwrap();
    assert_same_checkpoint(&src, &dst);
    let (si, di) = (open(&src).map(Checkpoint::into_index).unwrap(), open(&dst).map(Checkpoint::into_index).unwrap());
    assert_eq!(chunk_boxes(&di), chunk_boxes(&si), "one native chunk per source chunk");
    assert_eq!(di.tensors.iter().find(|t| t.key == "empty").map(|t| t.global_shape.clone()), Some(vec![0, 5]));
    let object_bytes: u64 = (0..TP * DP).map(|r| rng_bytes(r).len() as u64).sum();
    assert_eq!(
        (report.tensors, report.chunks, report.object_shards, report.files, report.bytes),
        (7, si.chunk_count(), 4, 1, si.tensor_bytes() + object_bytes)
    );
    assert_eq!(calls.last(), Some(&(report.bytes, report.bytes)));
    assert_eq!(data_files(&dst).len(), 1);
}

#[test]
fn convert_with_a_tiny_budget_splits_chunks_into_valid_ones() {
    let src = memory_checkpoint();
    let dst = MemoryStorage::new();
    // A job holds 16 bytes: the 96-byte row blocks of `w` become 1×4 and 1×2 boxes, the flat
    // ranges of the optimizer state ranges of 4 elements; files of about 100 bytes.
    let opts =
        ConvertOptions { memory_budget: 64, max_file_size: 100, block_size: 8, threads: 2, ..Default::default() };
    let report = convert(&src, &dst, &opts, &mut no_progress()).unwrap();
    assert_same_checkpoint(&src, &dst);
    let (si, di) = (open(&src).map(Checkpoint::into_index).unwrap(), open(&dst).map(Checkpoint::into_index).unwrap());
    assert!(report.chunks > 2 * si.chunk_count(), "{} chunks from {}", report.chunks, si.chunk_count());
    assert!(report.files > 5, "{} files", report.files);
    assert_eq!(report.files, data_files(&dst).len());
    let esize = |key: &str| di.tensor(key).unwrap().dtype.size() as u64;
    for t in &di.tensors {
        for c in t.chunks() {
            assert!(c.numel() * esize(&t.key) <= 16, "{}: chunk of {} elements", t.key, c.numel());
        }
    }
    let opt = di.tensor("opt.exp_avg").unwrap();
    assert!(opt.chunks().iter().all(|c| c.flat.is_some_and(|(s, e)| e - s <= 4)), "{:?}", opt.chunks());
}

#[test]
fn convert_refuses_a_committed_destination_unless_overwriting() {
    let dir = TempDir::new("convert-overwrite");
    let src = LocalStorage::new(dir.join("src"));
    tp_dp_checkpoint(&src);
    let dst = LocalStorage::new(dir.join("dst"));
    convert(&src, &dst, &ConvertOptions::default(), &mut no_progress()).unwrap();
    let before = data_files(&dst);
    let again = convert(&src, &dst, &ConvertOptions::default(), &mut no_progress());
    assert!(matches!(again, Err(Error::AlreadyExists { .. })), "{again:?}");
    assert_eq!(data_files(&dst), before, "nothing written by the refused conversion");
    // With overwrite, the new checkpoint replaces the old one (here in several files).
    let opts = ConvertOptions { overwrite: true, max_file_size: 200, ..Default::default() };
    let report = convert(&src, &dst, &opts, &mut no_progress()).unwrap();
    assert_same_checkpoint(&src, &dst);
    let after = data_files(&dst);
    assert_eq!(after.len(), report.files);
    assert!(after.iter().all(|f| !before.contains(f)), "the replaced checkpoint's files are removed: {after:?}");
    let refused = convert(&MemoryStorage::new(), &MemoryStorage::new(), &ConvertOptions::default(), &mut no_progress());
    assert!(matches!(refused, Err(Error::NotFound { .. })), "{refused:?}");
}

// ---------------------------------------------------------------------------------------------
// Diff.

struct Small {
    tensors: Vec<(&'static str, DType, Vec<u64>, Vec<u8>)>,
    common: Vec<(&'static str, Value)>,
    object: Vec<u8>,
    metadata: Value,
}

fn base() -> Small {
    let a: Vec<f32> = (0..12).map(|i| i as f32 * 0.5).collect();
    Small {
        tensors: vec![
            ("a", DType::F32, vec![4, 3], f32_bytes(&a)),
            ("b", DType::I32, vec![5], (0..5i32).flat_map(|i| (i * 100).to_le_bytes()).collect()),
            ("c", DType::F32, vec![2], f32_bytes(&[f32::NAN, 2.5])),
        ],
        common: vec![("iteration", Value::Int(1)), ("lr", Value::Float(0.5)), ("nan", Value::Float(f64::NAN))],
        object: vec![1, 2, 3],
        metadata: Value::Null,
    }
}

fn save_small(s: &Small) -> MemoryStorage {
    let storage = MemoryStorage::new();
    let mut tree =
        StateTree::map().with("obj", StateTree::Object(ShardedObject::new("o", s.object.clone(), &[1], &[0])));
    for (key, dtype, shape, data) in &s.tensors {
        tree.insert(*key, StateTree::Tensor(ShardedTensor::full(*key, *dtype, shape, TensorData::Owned(data.clone()))));
    }
    for (path, v) in &s.common {
        tree.insert(*path, StateTree::Value(v.clone()));
    }
    // Small checksum blocks: the tiny-budget cases may then cut the data into single elements.
    let opts = SaveOptions { content_metadata: s.metadata.clone(), ..small_blocks(8) };
    save(tree, &storage, &SoloComm, &opts).unwrap();
    storage
}

fn set_f32(s: &mut Small, key: &str, at: usize, v: f32) {
    let t = s.tensors.iter_mut().find(|t| t.0 == key).unwrap();
    t.3[4 * at..4 * at + 4].copy_from_slice(&v.to_le_bytes());
}

fn tensor_diff<'r>(r: &'r DiffReport, key: &str) -> &'r [TensorDifference] {
    &r.tensors.iter().find(|t| t.key == key).unwrap_or_else(|| panic!("{key} not reported: {r:?}")).differences
}

#[test]
fn diff_of_equal_checkpoints_is_empty() {
    let (a, b) = (save_small(&base()), save_small(&base()));
    let r = diff(&a, &b, &DiffOptions::default()).unwrap();
    assert!(r.is_equal(), "{r:?}");
    assert_eq!((r.tensors_compared, r.objects_compared, r.bytes_compared), (3, 1, 2 * (48 + 20 + 8)));
    let r = diff(&a, &b, &DiffOptions { atol: 0.1, ..Default::default() }).unwrap();
    assert!(r.is_equal(), "NaN equals NaN through f64 too: {r:?}");
}

#[test]
fn diff_reports_values_with_and_without_tolerance() {
    let a = save_small(&base());
    let mut changed = base();
    set_f32(&mut changed, "a", 7, 3.5 + 0.25); // element (2, 1)
    set_f32(&mut changed, "a", 9, 4.5 + 1.0); // element (3, 0)
    let b = save_small(&changed);
    let r = diff(&a, &b, &DiffOptions::default()).unwrap();
    assert!(!r.is_equal());
    assert_eq!(r.tensors.len(), 1, "{r:?}");
    assert_eq!(
        tensor_diff(&r, "a"),
        [TensorDifference::Values(ValueDiff { count: 2, max_abs_diff: 1.0, first_index: vec![2, 1] })]
    );
    assert!(r.objects.is_empty() && r.common.is_empty() && r.content_metadata.is_none());
    let within = diff(&a, &b, &DiffOptions { atol: 1.0, ..Default::default() }).unwrap();
    assert!(within.is_equal(), "{within:?}");
    let half = diff(&a, &b, &DiffOptions { atol: 0.5, ..Default::default() }).unwrap();
    assert_eq!(
        tensor_diff(&half, "a"),
        [TensorDifference::Values(ValueDiff { count: 1, max_abs_diff: 1.0, first_index: vec![3, 0] })]
    );
    // A tiny budget (one element per slice) finds the same.
    let tiny = diff(&a, &b, &DiffOptions { memory_budget: 8, ..Default::default() }).unwrap();
    assert_eq!(tiny, r);
    // At atol 0, -0.0 and 0.0 differ (bytes), by 0.
    let mut zero = base();
    set_f32(&mut zero, "a", 0, -0.0);
    let r = diff(&a, &save_small(&zero), &DiffOptions::default()).unwrap();
    assert_eq!(
        tensor_diff(&r, "a"),
        [TensorDifference::Values(ValueDiff { count: 1, max_abs_diff: 0.0, first_index: vec![0, 0] })]
    );
    // NaN against a number: an infinite difference.
    let mut nan = base();
    set_f32(&mut nan, "c", 1, f32::NAN);
    let r = diff(&a, &save_small(&nan), &DiffOptions { atol: 100.0, ..Default::default() }).unwrap();
    assert_eq!(
        tensor_diff(&r, "c"),
        [TensorDifference::Values(ValueDiff { count: 1, max_abs_diff: f64::INFINITY, first_index: vec![1] })]
    );
    assert!(matches!(
        diff(&a, &a, &DiffOptions { atol: -1.0, ..Default::default() }),
        Err(Error::InvalidArgument { .. })
    ));
}

#[test]
fn diff_reports_keys_shapes_dtypes_objects_common_and_metadata() {
    let a = save_small(&base());
    let mut other = base();
    other.tensors.retain(|t| t.0 != "b");
    other.tensors.push(("d", DType::U8, vec![2], vec![1, 2]));
    // `a` reshaped, `c` stored as f64 with the same values.
    other.tensors[0].2 = vec![3, 4];
    other.tensors[1] = ("c", DType::F64, vec![2], [f64::NAN, 2.5].iter().flat_map(|x| x.to_le_bytes()).collect());
    other.common = vec![("iteration", Value::Int(2)), ("extra", Value::Bool(true)), ("nan", Value::Float(f64::NAN))];
    other.object = vec![1, 2, 4];
    other.metadata = Value::Str("other".into());
    let b = save_small(&other);
    let r = diff(&a, &b, &DiffOptions::default()).unwrap();
    assert_eq!(r.tensors.iter().map(|t| t.key.as_str()).collect::<Vec<_>>(), ["a", "b", "c", "d"]);
    assert_eq!(tensor_diff(&r, "a"), [TensorDifference::Shape { a: vec![4, 3], b: vec![3, 4] }]);
    assert_eq!(tensor_diff(&r, "b"), [TensorDifference::OnlyInA]);
    assert_eq!(tensor_diff(&r, "c"), [TensorDifference::DType { a: DType::F32, b: DType::F64 }], "values agree");
    assert_eq!(tensor_diff(&r, "d"), [TensorDifference::OnlyInB]);
    assert_eq!(r.tensors_compared, 2);
    assert_eq!(r.objects, [ObjectDiff { key: "o".into(), difference: ObjectDifference::Shards(vec![vec![0]]) }]);
    let common: Vec<(String, Option<Value>, Option<Value>)> =
        r.common.iter().map(|c| (path_string(&c.path), c.a.clone(), c.b.clone())).collect();
    assert_eq!(
        common,
        [
            ("extra".to_string(), None, Some(Value::Bool(true))),
            ("iteration".to_string(), Some(Value::Int(1)), Some(Value::Int(2))),
            ("lr".to_string(), Some(Value::Float(0.5)), None),
        ]
    );
    assert_eq!(r.content_metadata, Some((Value::Null, Value::Str("other".into()))));
    assert_eq!(tensor_diff(&r, "a")[0].to_string(), "shape [4, 3] vs [3, 4]");

    // A key subset: only those keys, no common state or metadata.
    let only = diff(&a, &b, &DiffOptions { keys: Some(vec!["c".into(), "d".into()]), ..Default::default() }).unwrap();
    assert_eq!(only.tensors.iter().map(|t| t.key.as_str()).collect::<Vec<_>>(), ["c", "d"]);
    assert!(only.objects.is_empty() && only.common.is_empty() && only.content_metadata.is_none(), "{only:?}");
    let same = diff(&a, &b, &DiffOptions { keys: Some(vec!["o".into()]), ..Default::default() }).unwrap();
    assert_eq!(same.tensors, []);
    assert_eq!(same.objects.len(), 1);
    let unknown = diff(&a, &b, &DiffOptions { keys: Some(vec!["zz".into()]), ..Default::default() });
    assert!(matches!(unknown, Err(Error::NotFound { .. })), "{unknown:?}");
}

#[test]
fn failures_on_a_corrupt_source_leave_nothing_behind() {
    let dir = TempDir::new("tools-corrupt");
    let src = LocalStorage::new(dir.join("src"));
    tp_dp_checkpoint(&src);
    // Flip the last byte of a data file: the data of its last object shard.
    let file = dir.join("src").join(&data_files(&src)[0]);
    let mut bytes = std::fs::read(&file).unwrap();
    *bytes.last_mut().unwrap() ^= 0xff;
    std::fs::write(&file, bytes).unwrap();

    let dst = LocalStorage::new(dir.join("dst"));
    let r = convert(&src, &dst, &ConvertOptions { memory_budget: 256, ..Default::default() }, &mut no_progress());
    assert!(matches!(r, Err(Error::Corrupt { .. })), "{r:?}");
    assert_eq!(names(&dst), Vec::<String>::new(), "no data file, no index");

    // The tensors are sound: export works; a checksum error in a tensor stops it.
    let out = dir.join("out");
    std::fs::create_dir_all(&out).unwrap();
    export_safetensors(&src, &out.join("ok.safetensors"), &ExportOptions::default(), &mut no_progress()).unwrap();
    let index = open(&src).map(Checkpoint::into_index).unwrap();
    let w = index.tensor("w").unwrap();
    let chunk = &w.chunks()[0];
    let name = &index.files[chunk.file as usize].name;
    let path = dir.join("src").join(name);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[chunk.byte_offset as usize] ^= 0xff;
    std::fs::write(&path, bytes).unwrap();
    let r = export_safetensors(&src, &out.join("bad.safetensors"), &ExportOptions::default(), &mut no_progress());
    assert!(matches!(r, Err(Error::Corrupt { .. })), "{r:?}");
    assert_eq!(dir_names(&out), ["ok.safetensors"], "no temporary file left");
    let r = diff(&src, &src, &DiffOptions::default());
    assert!(matches!(r, Err(Error::Corrupt { .. })), "{r:?}");
}

/// A memory budget below one checksum block (here 16 bytes) is refused before anything is
/// read or written, naming the minimum; the same for every tool.
#[test]
fn a_budget_below_one_block_is_refused_at_once_naming_the_minimum() {
    let src = memory_checkpoint();
    let dir = TempDir::created("tiny-budget");
    let out = dir.join("x.safetensors");
    let err =
        export_safetensors(&src, &out, &ExportOptions { memory_budget: 0, ..Default::default() }, &mut no_progress())
            .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }) && err.to_string().contains("minimum of 16 bytes"), "{err}");
    assert!(!out.exists() && std::fs::read_dir(dir.path()).unwrap().next().is_none(), "nothing written");
    let dst = MemoryStorage::new();
    let r = convert(&src, &dst, &ConvertOptions { memory_budget: 15, ..Default::default() }, &mut no_progress());
    assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
    let r = diff(&src, &src, &DiffOptions { memory_budget: 1, ..Default::default() });
    assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
    assert!(diff(&src, &src, &DiffOptions { memory_budget: 16, ..Default::default() }).unwrap().is_equal());
}

/// `rename` rewrites key prefixes (first matching rule; an empty replacement strips) in the
/// files and the sharded index, in sorted order of the new names; two keys that would share a
/// name are refused before anything is written.
#[test]
fn export_renames_key_prefixes_and_refuses_collisions() {
    let src = memory_checkpoint();
    let dir = TempDir::created("export-rename");
    let rename = vec![("opt.".to_string(), "optimizer.".to_string()), ("s".to_string(), String::new())];
    let opts = ExportOptions { rename, ..Default::default() };
    let out = dir.join("renamed.safetensors");
    export_safetensors(&src, &out, &opts, &mut no_progress()).unwrap();
    let (_, renamed) = read_safetensors(&out);
    let plain = dir.join("plain.safetensors");
    export_safetensors(&src, &plain, &ExportOptions::default(), &mut no_progress()).unwrap();
    let (_, original) = read_safetensors(&plain);
    let expect: BTreeMap<String, _> = original
        .into_iter()
        .map(|(k, v)| {
            let k = if let Some(rest) = k.strip_prefix("opt.") {
                format!("optimizer.{rest}")
            } else if let Some(rest) = k.strip_prefix('s') {
                rest.to_string()
            } else {
                k
            };
            (k, v)
        })
        .collect();
    assert_eq!(renamed, expect);
    assert!(
        renamed.contains_key("teps") && renamed.keys().any(|k| k.starts_with("optimizer.")),
        "{:?}",
        renamed.keys()
    );
    let clash = ExportOptions { rename: vec![("steps".into(), "scale".into())], ..Default::default() };
    let err = export_safetensors(&src, &dir.join("clash.safetensors"), &clash, &mut no_progress()).unwrap_err();
    assert!(err.to_string().contains("the same name \"scale\""), "{err}");
    assert!(!dir.join("clash.safetensors").exists());
}

/// Plain safetensors are checkpoints too: `export_safetensors`' own output (one file, opened by
/// its path, or a Hugging Face sharded directory) loads, verifies and converts like any other,
/// with the exporter's exact bytes; tessera's data files of a save that never committed are
/// not taken for one; a damaged index or header is an error naming the file and key.
#[test]
fn plain_safetensors_files_and_sharded_directories_read_as_checkpoints() {
    let src = memory_checkpoint();
    let want = open(&src).and_then(|c| c.read_tensors(None)).unwrap();
    let dir = TempDir::created("plain-st");
    let one = dir.join("one.safetensors");
    export_safetensors(&src, &one, &ExportOptions::default(), &mut no_progress()).unwrap();
    let sharded = dir.join("hf");
    let opts = ExportOptions { max_shard_size: Some(300), ..Default::default() };
    export_safetensors(&src, &sharded, &opts, &mut no_progress()).unwrap();
    for location in [one.to_str().unwrap(), sharded.to_str().unwrap()] {
        let storage = tessera::storage::Location::parse(location).open().unwrap();
        assert_eq!(
            FormatRecord::detect(storage.as_ref()).unwrap().backend,
            tessera::index::Backend::Safetensors,
            "{location}"
        );
        let got = open(storage.as_ref()).and_then(|c| c.read_tensors(None)).unwrap();
        assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>(), "{location}");
        for (k, t) in &want {
            assert!(got[k].data == t.data && got[k].shape == t.shape && got[k].dtype == t.dtype, "{location}: {k}");
        }
        let report = verify(storage.as_ref(), 2).unwrap();
        assert!(report.problems.is_empty() && !report.checksummed, "{location}: {report:?}");
        let native = MemoryStorage::new();
        convert(storage.as_ref(), &native, &ConvertOptions::default(), &mut no_progress()).unwrap();
        assert!(diff(storage.as_ref(), &native, &DiffOptions::default()).unwrap().is_equal(), "{location}");
    }
    // A file opened by its path is read-only.
    let file = tessera::storage::Location::parse(one.to_str().unwrap()).open().unwrap();
    assert!(matches!(file.put_atomic("x", b"y"), Err(Error::InvalidArgument { .. })));

    // The index places a tensor in a file that lacks it.
    let index_path = sharded.join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&index_path).unwrap();
    let mut index: J = serde_json::from_str(&text).unwrap();
    let files: Vec<String> = std::fs::read_dir(&sharded)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".safetensors"))
        .collect();
    let (key, file) = {
        let map = index["weight_map"].as_object().unwrap();
        let (k, f) = map.iter().next().unwrap();
        (k.clone(), files.iter().find(|n| *n != f.as_str().unwrap()).unwrap().clone())
    };
    index["weight_map"][&key] = json!(file);
    std::fs::write(&index_path, index.to_string()).unwrap();
    let err = open(tessera::storage::Location::parse(sharded.to_str().unwrap()).open().unwrap().as_ref())
        .map(Checkpoint::into_index)
        .unwrap_err();
    assert!(matches!(err, Error::Corrupt { .. }) && err.to_string().contains(&key), "{err}");
    std::fs::write(&index_path, text).unwrap();
    // A header whose offsets run past the file.
    let bytes = std::fs::read(&one).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    std::fs::write(&one, &bytes[..8 + n + 4]).unwrap();
    let err = open(tessera::storage::Location::parse(one.to_str().unwrap()).open().unwrap().as_ref())
        .map(Checkpoint::into_index)
        .unwrap_err();
    assert!(matches!(err, Error::Corrupt { .. }) && err.to_string().contains("one.safetensors"), "{err}");

    // tessera's own data files without an index: an unfinished save, not plain safetensors.
    let half = TempDir::created("plain-st-half");
    std::fs::write(half.join("0123456789abcdef-r00000.safetensors"), &bytes).unwrap();
    let err = open(&LocalStorage::new(half.path())).map(Checkpoint::into_index).unwrap_err();
    assert!(matches!(err, Error::NotCommitted { .. }), "{err}");
}

/// `verify` checks each native data file's header against the index that commits it: a header
/// whose records disagree (here: a chunk's key), even one whose checksum the index carries, is
/// reported, naming the file.
#[test]
fn verify_checks_every_native_header_against_the_index() {
    let storage = MemoryStorage::new();
    let w = ShardedTensor::full("w", DType::U8, &[8], TensorData::Owned((0..8).collect()));
    let file = save(StateTree::map().with("w", StateTree::Tensor(w)), &storage, &SoloComm, &SaveOptions::default())
        .unwrap()
        .file
        .unwrap();
    assert!(verify(&storage, 2).unwrap().problems.is_empty());
    // The header says the chunk is of "v"; the index, given the new header's checksum, of "w".
    let mut bytes = storage.read(&file).unwrap();
    let header_len = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let text = String::from_utf8(bytes[8..header_len].to_vec()).unwrap();
    let edited = text.replace("\\\"key\\\":\\\"w\\\"", "\\\"key\\\":\\\"v\\\"");
    assert_ne!(edited, text, "the record is in the header");
    bytes[8..header_len].copy_from_slice(edited.as_bytes());
    storage.put_atomic(&file, &bytes).unwrap();
    let mut index = open(&storage).unwrap().into_index();
    index.files[0].header_crc = crc32c(&bytes[..header_len]);
    storage.put_atomic(INDEX_FILE, &index.encode()).unwrap();
    let report = verify(&storage, 2).unwrap();
    assert_eq!(report.problems.len(), 1, "{:?}", report.problems);
    assert!(report.problems[0].contains(&file) && report.problems[0].contains("\"w\""), "{:?}", report.problems);
}
