//! OLMo-core 0.1.x checkpoints (`olmo_core.distributed.checkpoint`): the real checkpoints in
//! `tests/fixtures/olmo/` (written by ai2-olmo-core 0.1.0 itself) load to exactly their
//! expected tensors in any layout, whole or as `model/` / `optim/` alone, with the pickled
//! optimizer fields decoded; tessera's own writer produces checkpoints the reader (and, in
//! `scripts/interop/olmo_interop.sh`, OLMo-core) loads; damaged metadata is a clear error.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::common::files::copy_dir;
use crate::common::fixtures::{assert_loads, boxes, to_json, Expected};
use crate::common::{box_bytes, run_ranks, seeded_truth as truth, shard, TempDir};
use tessera::comm::SoloComm;
use tessera::index::{Backend, FormatRecord};
use tessera::olmo::save_olmo;
use tessera::storage::{CountingStorage, LocalStorage};
use tessera::tools::verify;
use tessera::{
    load, open, DType, Error, LoadOptions, ReplicaId, SaveOptions, ShardedObject, ShardedTensor, StateTree, Storage,
    TensorData,
};

const BACKEND: Backend = Backend::OlmoSafetensors;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/olmo")
}

/// Every fixture and whether it is a `save_model_and_optim_state` directory (model/ + optim/).
const ALL: &[(&str, bool)] = &[
    ("olmo01_fsdp_w2", true),
    ("olmo_fsdp1_w2", true),
    ("olmo_fsdp1_w3", true),
    ("olmo_fsdp2_w2", true),
    ("olmo_ddp_w2", true),
    ("olmo_single", false),
    ("olmo_dtensor2d_w4", false),
];

fn expected_tensors(name: &str) -> BTreeMap<String, Expected> {
    crate::common::fixtures::expected_tensors(&fixtures(), name)
}

fn expected_json(name: &str) -> serde_json::Value {
    crate::common::fixtures::expected_json(&fixtures(), name)
}

fn fixture_storage(name: &str) -> LocalStorage {
    LocalStorage::new(fixtures().join(name))
}

fn assert_tensors(name: &str, got: &BTreeMap<String, tessera::PlainTensor>, want: &BTreeMap<String, Expected>) {
    assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>(), "{name}: keys");
    for (k, w) in want {
        let g = &got[k];
        assert_eq!((g.dtype, &g.shape), (w.dtype, &w.shape), "{name}: {k}");
        assert!(g.data == w.data, "{name}: {k}: values differ");
    }
}

#[test]
fn every_fixture_is_detected_and_unshards_exactly() {
    for (name, _) in ALL {
        let record = FormatRecord::detect(&fixture_storage(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(record.backend, BACKEND, "{name}");
        let got =
            open(&fixture_storage(name)).and_then(|c| c.read_tensors(None)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_tensors(name, &got, &expected_tensors(name));
    }
}

#[test]
fn model_and_optim_open_alone() {
    for (name, parts) in ALL.iter().filter(|(_, p)| *p) {
        assert!(parts);
        let want = expected_tensors(name);
        for part in ["model", "optim"] {
            let storage = LocalStorage::new(fixtures().join(name).join(part));
            let got =
                open(&storage).and_then(|c| c.read_tensors(None)).unwrap_or_else(|e| panic!("{name}/{part}: {e}"));
            let prefix = format!("{part}/");
            let want_part: BTreeMap<String, Expected> = want
                .iter()
                .filter_map(|(k, w)| {
                    let k = k.strip_prefix(&prefix)?;
                    Some((k.to_string(), Expected { dtype: w.dtype, shape: w.shape.clone(), data: w.data.clone() }))
                })
                .collect();
            assert_tensors(&format!("{name}/{part}"), &got, &want_part);
        }
    }
}

#[test]
fn pickled_optimizer_fields_are_decoded_without_executing_anything() {
    for (name, _) in ALL.iter().filter(|(_, p)| *p) {
        let want = expected_json(name);
        let StateTree::Map(root) = open(&fixture_storage(name)).map(|c| c.common_state()).unwrap() else {
            panic!("{name}")
        };
        let Some(StateTree::Map(optim)) = root.get("optim") else { panic!("{name}: no optim values") };
        let groups = match &optim["param_groups"] {
            StateTree::Value(v) => to_json(v),
            StateTree::List(xs) => serde_json::Value::Array(
                xs.iter()
                    .map(|x| match x {
                        StateTree::Value(v) => to_json(v),
                        other => panic!("{other:?}"),
                    })
                    .collect(),
            ),
            other => panic!("{name}: {other:?}"),
        };
        let n = want["num_param_groups"].as_u64().unwrap();
        let expect: Vec<serde_json::Value> = (0..n).map(|i| want[format!("param_group{i}")].clone()).collect();
        assert_eq!(groups, serde_json::Value::Array(expect), "{name}: param groups");
        let StateTree::Value(keys) = &optim["state_keys"] else { panic!() };
        assert_eq!(to_json(keys), want["state_keys"], "{name}: state keys");
    }
}

#[test]
fn resharded_loads_return_the_right_slices() {
    // Every tensor as a grid of boxes and as flat ranges (FSDP's layout) of other world sizes.
    for (name, _) in ALL {
        let storage = fixture_storage(name);
        let want = expected_tensors(name);
        for parts in [2u64, 3, 4] {
            let mut tree = StateTree::map();
            let mut expect = Vec::new();
            for (k, w) in &want {
                let es = w.dtype.size();
                for (i, (off, sub)) in boxes(&w.shape, parts).into_iter().enumerate() {
                    let t = shard(k, w.dtype, &w.shape, &off, &sub, 0, None, TensorData::None);
                    expect.push((format!("{k}#b{i}"), box_bytes(&w.data, &w.shape, es, &off, &sub)));
                    tree.insert(format!("{k}#b{i}"), StateTree::Tensor(t));
                }
                let n: u64 = w.shape.iter().product();
                for i in 0..parts {
                    let (a, b) = (n * i / parts, n * (i + 1) / parts);
                    if a == b {
                        continue;
                    }
                    let zeros = vec![0; w.shape.len()];
                    let t = shard(k, w.dtype, &w.shape, &zeros, &w.shape, 0, Some(a..b), TensorData::None);
                    expect.push((format!("{k}#f{i}"), w.data[a as usize * es..b as usize * es].to_vec()));
                    tree.insert(format!("{k}#f{i}"), StateTree::Tensor(t));
                }
            }
            assert_loads(&storage, tree, expect, &format!("{name} in {parts} parts"));
        }
    }
}

#[test]
fn verify_reads_every_file_and_says_there_are_no_checksums() {
    for (name, _) in ALL {
        let report = verify(&fixture_storage(name), 2).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(report.problems.is_empty(), "{name}: {:?}", report.problems);
        assert!(!report.checksummed && report.bytes_checked > 0, "{name}");
    }
}

#[test]
fn megatron_detection_is_not_fooled_by_olmo_metadata() {
    // OLMo's metadata.json is not Megatron's: the directory is OLMo-core's, never "corrupt".
    let storage = fixture_storage("olmo_single");
    assert_eq!(FormatRecord::detect(&storage).unwrap().backend, BACKEND);
    let model = LocalStorage::new(fixtures().join("olmo_fsdp1_w2/model"));
    assert_eq!(FormatRecord::detect(&model).unwrap().backend, BACKEND);
}

// ---- tessera's writer ------------------------------------------------------------------------

/// A model of tensors of every kind the writer handles, as `world` ranks hold it.
struct Layout {
    key: &'static str,
    dtype: DType,
    shape: Vec<u64>,
}

fn layouts() -> Vec<Layout> {
    vec![
        Layout { key: "flat.weight", dtype: DType::F32, shape: vec![13, 7] }, // FSDP1: uneven flat ranges
        Layout { key: "rows.weight", dtype: DType::BF16, shape: vec![9, 4] }, // FSDP2: Shard(0) boxes
        Layout { key: "cols.weight", dtype: DType::F32, shape: vec![3, 10] }, // TP column split
        Layout { key: "cube", dtype: DType::F32, shape: vec![3, 4, 5] },      // 3-D split on axis 1
        Layout { key: "norm.weight", dtype: DType::F32, shape: vec![6] },     // replicated everywhere
        Layout { key: "step", dtype: DType::I64, shape: vec![] },             // 0-d
        Layout { key: "empty", dtype: DType::F32, shape: vec![0, 4] },        // no elements
    ]
}

/// Rank `r` of `world`'s shards of every layout, over `buffers` (its data).
fn rank_tree<'a>(r: usize, world: usize, buffers: &'a [Vec<u8>]) -> StateTree<'a> {
    let mut tree = StateTree::map();
    let (r64, w) = (r as u64, world as u64);
    for (i, (l, data)) in layouts().iter().zip(buffers).enumerate() {
        let split = |n: u64| (n * r64 / w, n * (r64 + 1) / w);
        let es = l.dtype.size();
        let t = match i {
            0 => {
                let n: u64 = l.shape.iter().product();
                let (a, b) = split(n);
                let zeros = vec![0; l.shape.len()];
                let bytes = &data[a as usize * es..b as usize * es];
                shard(l.key, l.dtype, &l.shape, &zeros, &l.shape, 0, Some(a..b), TensorData::Ref(bytes))
            }
            1..=3 => {
                let axis = if i == 1 { 0 } else { 1 };
                let (a, b) = split(l.shape[axis]);
                let mut off = vec![0; l.shape.len()];
                let mut sub = l.shape.clone();
                off[axis] = a;
                sub[axis] = b - a;
                let bytes = box_bytes(data, &l.shape, es, &off, &sub);
                shard(l.key, l.dtype, &l.shape, &off, &sub, 0, None, TensorData::Owned(bytes))
            }
            _ => {
                let mut t = ShardedTensor::full(l.key, l.dtype, &l.shape, TensorData::Ref(data));
                t.replica_id = ReplicaId::from(r as u32);
                t
            }
        };
        tree.insert(l.key, StateTree::Tensor(t));
    }
    tree
}

fn save_world(dir: &Path, world: usize, opts: &SaveOptions) -> Vec<tessera::Result<tessera::olmo::OlmoSaveReport>> {
    let buffers: Vec<Vec<u8>> =
        layouts().iter().enumerate().map(|(i, l)| truth(l.dtype, &l.shape, i as u64 + 1)).collect();
    run_ranks(world, |comm| {
        let storage = LocalStorage::new(dir);
        save_olmo(rank_tree(tessera::Communicator::rank(comm), world, &buffers), &storage, comm, opts)
    })
}

fn check_written(dir: &Path) {
    let storage = LocalStorage::new(dir);
    assert_eq!(FormatRecord::detect(&storage).unwrap().backend, BACKEND);
    let got = open(&storage).and_then(|c| c.read_tensors(None)).unwrap();
    for (i, l) in layouts().iter().enumerate() {
        let g = &got[l.key];
        assert_eq!((g.dtype, &g.shape), (l.dtype, &l.shape), "{}", l.key);
        assert!(g.data == truth(l.dtype, &l.shape, i as u64 + 1), "{}", l.key);
    }
}

#[test]
fn written_checkpoints_load_back_in_any_layout_with_checksums() {
    for world in [1, 2, 3, 4] {
        let dir = TempDir::new("olmo-write");
        let opts = SaveOptions { block_size: 64, threads: 2, ..Default::default() };
        for (r, rep) in save_world(dir.path(), world, &opts).into_iter().enumerate() {
            let rep = rep.unwrap_or_else(|e| panic!("world {world} rank {r}: {e}"));
            assert_eq!(rep.files.contains(&"metadata.json".to_string()), r == 0);
        }
        check_written(dir.path());
        let report = verify(&LocalStorage::new(dir.path()), 2).unwrap();
        assert!(report.problems.is_empty() && report.checksummed, "world {world}: {:?}", report.problems);

        // metadata.json is OLMo-core's: 2-D boxes as local_shape/global_offset, flat shards and
        // boxes of 3-D tensors as flattened_offsets, the replicated tensor stored once.
        let meta: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("metadata.json")).unwrap()).unwrap();
        let t = &meta["tensors"];
        let specs = |k: &str| t[k]["shard_spec_per_file"].as_object().unwrap().clone();
        assert_eq!(specs("norm.weight").len(), 1, "a replicated tensor is written once");
        assert_eq!(t["norm.weight"]["is_sharded"], false);
        if world > 1 {
            assert_eq!(t["flat.weight"]["is_sharded"], true);
            let rows = specs("rows.weight");
            assert!(rows.values().all(|s| s["local_shape"].is_array() && s["flattened_offsets"].is_null()));
            let cube = specs("cube");
            assert!(cube.values().all(|s| s["flattened_offsets"].as_array().unwrap().len() == 3), "{cube:?}");
        }
        assert_eq!(t["empty"]["shape"], serde_json::json!([0, 4]));
        assert_eq!(t["step"]["shape"], serde_json::json!([]));
    }
}

#[test]
fn a_damaged_byte_of_a_written_checkpoint_is_caught() {
    let dir = TempDir::new("olmo-damage");
    let opts = SaveOptions { block_size: 64, threads: 2, ..Default::default() };
    save_world(dir.path(), 2, &opts).into_iter().for_each(|r| drop(r.unwrap()));
    let file = dir.join("rank_1.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let at = bytes.len() - 3;
    bytes[at] ^= 0x40;
    std::fs::write(&file, bytes).unwrap();
    let storage = LocalStorage::new(dir.path());
    let report = verify(&storage, 2).unwrap();
    assert!(report.problems.iter().any(|p| p.contains("rank_1.safetensors") && p.contains("checksum")), "{report:?}");
    let e = open(&storage).and_then(|c| c.read_tensors(None)).unwrap_err();
    assert!(matches!(e, Error::Corrupt { .. }) && e.to_string().contains("rank_1.safetensors"), "{e}");
}

#[test]
fn an_fsdp_shard_reads_only_its_bytes() {
    // 4 ranks wrote flat shards of a 1 MiB tensor; a rank of 3 loading its flat shard reads what
    // it needs (≤ 1.05×), with checksums verified (whole 4 KiB blocks: at most one more per stored
    // range it cuts) and without.
    let dir = TempDir::new("olmo-fsdp-read");
    let n: u64 = 512 * 512;
    let data = truth(DType::F32, &[512, 512], 3);
    run_ranks(4, |comm| {
        let r = tessera::Communicator::rank(comm) as u64;
        let (a, b) = (n * r / 4, n * (r + 1) / 4);
        let t = shard(
            "w",
            DType::F32,
            &[512, 512],
            &[0, 0],
            &[512, 512],
            0,
            Some(a..b),
            TensorData::Ref(&data[a as usize * 4..b as usize * 4]),
        );
        let mut tree = StateTree::map();
        tree.insert("w", StateTree::Tensor(t));
        let opts = SaveOptions { block_size: 4 << 10, threads: 2, ..Default::default() };
        save_olmo(tree, &LocalStorage::new(dir.path()), comm, &opts).unwrap();
    });
    for verify_checksums in [true, false] {
        for r in 0..3u64 {
            let base = LocalStorage::new(dir.path());
            let counting = CountingStorage::new(&base);
            let (a, b) = (n * r / 3, n * (r + 1) / 3);
            let t = shard("w", DType::F32, &[512, 512], &[0, 0], &[512, 512], 0, Some(a..b), TensorData::None);
            let mut tree = StateTree::map();
            tree.insert("w", StateTree::Tensor(t));
            let opts = LoadOptions { verify_checksums, ..Default::default() };
            let out = load(tree, &counting, &SoloComm, &opts).unwrap();
            let StateTree::Map(m) = out.state else { panic!() };
            let StateTree::Tensor(t) = &m["w"] else { panic!() };
            assert!(t.data.bytes().unwrap() == &data[a as usize * 4..b as usize * 4]);
            let need = (b - a) * 4;
            let data_read = out.stats.bytes_read;
            assert!(data_read <= need + need / 20, "rank {r}: read {data_read} for {need} (verify {verify_checksums})");
            // Opening costs the metadata and one header per file, not the data.
            assert!(counting.bytes_read() < data_read + (64 << 10), "{}", counting.bytes_read());
        }
    }
}

#[test]
fn an_existing_checkpoint_is_kept_unless_overwriting() {
    let dir = TempDir::new("olmo-overwrite");
    let opts = SaveOptions { threads: 2, ..Default::default() };
    save_world(dir.path(), 4, &opts).into_iter().for_each(|r| drop(r.unwrap()));
    for r in save_world(dir.path(), 2, &opts) {
        assert!(matches!(r, Err(Error::AlreadyExists { .. }) | Err(Error::PeerFailed { .. })), "{r:?}");
    }
    assert!(dir.join("rank_3.safetensors").exists(), "nothing of the old checkpoint was touched");
    check_written(dir.path());
    // Overwriting with fewer ranks: the new checkpoint, and the old ranks' files are gone.
    let over = SaveOptions { overwrite: true, ..opts.clone() };
    save_world(dir.path(), 2, &over).into_iter().for_each(|r| drop(r.unwrap()));
    check_written(dir.path());
    assert!(!dir.join("rank_3.safetensors").exists() && !dir.join("rank_2.safetensors").exists());
    // Another format's checkpoint is never replaced by an OLMo-core one.
    let native = TempDir::new("olmo-over-native");
    let data = truth(DType::F32, &[4], 1);
    let mut tree = StateTree::map();
    tree.insert("x", StateTree::Tensor(ShardedTensor::full("x", DType::F32, &[4], TensorData::Ref(&data))));
    tessera::save(tree, &LocalStorage::new(native.path()), &SoloComm, &opts).unwrap();
    let mut tree = StateTree::map();
    tree.insert("x", StateTree::Tensor(ShardedTensor::full("x", DType::F32, &[4], TensorData::Ref(&data))));
    let e = save_olmo(tree, &LocalStorage::new(native.path()), &SoloComm, &over).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }) && e.to_string().contains("tessera"), "{e}");
}

#[test]
fn what_the_format_cannot_hold_is_refused_on_every_rank() {
    let dir = TempDir::new("olmo-refuse");
    let data = truth(DType::F32, &[4], 1);
    let results = run_ranks(2, |comm| {
        let mut tree = StateTree::map();
        let mut t = ShardedTensor::full("x", DType::F32, &[4], TensorData::Ref(&data));
        t.replica_id = ReplicaId::from(tessera::Communicator::rank(comm) as u32);
        tree.insert("x", StateTree::Tensor(t));
        if tessera::Communicator::rank(comm) == 1 {
            tree.insert("rng", StateTree::Object(ShardedObject::new("rng", vec![1], &[2], &[1])));
        }
        save_olmo(tree, &LocalStorage::new(dir.path()), comm, &SaveOptions::default())
    });
    for r in results {
        let e = r.unwrap_err().to_string();
        assert!(e.contains("rng") && e.contains("tensors only"), "{e}");
    }
    assert!(!dir.join("metadata.json").exists());
    // Shards that do not tile the tensor: refused before anything is written.
    let data = truth(DType::F32, &[8], 1);
    let results = run_ranks(2, |comm| {
        let r = if tessera::Communicator::rank(comm) == 0 { 0..5 } else { 4..8 };
        let bytes = &data[r.start as usize * 4..r.end as usize * 4];
        let t = shard("w", DType::F32, &[8], &[0], &[8], 0, Some(r), TensorData::Ref(bytes));
        let mut tree = StateTree::map();
        tree.insert("w", StateTree::Tensor(t));
        save_olmo(tree, &LocalStorage::new(dir.path()), comm, &SaveOptions::default())
    });
    for r in results {
        assert!(matches!(r, Err(Error::InvalidSharding { .. })), "{r:?}");
    }
    assert!(!dir.join("rank_0.safetensors").exists());
}

// ---- damaged OLMo-core checkpoints ------------------------------------------------------------
/// `olmo_fsdp1_w2/model` copied, its metadata.json edited by `edit`; the error opening it.
fn damaged(tag: &str, edit: impl Fn(&mut serde_json::Value)) -> (TempDir, Error) {
    let dir = TempDir::new(tag);
    copy_dir(&fixtures().join("olmo_fsdp1_w2/model"), dir.path());
    let mut meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("metadata.json")).unwrap()).unwrap();
    edit(&mut meta);
    std::fs::write(dir.join("metadata.json"), serde_json::to_vec(&meta).unwrap()).unwrap();
    let e = open(&LocalStorage::new(dir.path())).and_then(|c| c.read_tensors(None)).unwrap_err();
    (dir, e)
}

fn spec<'v>(meta: &'v mut serde_json::Value, key: &str, file: &str) -> &'v mut serde_json::Value {
    &mut meta["tensors"][key]["shard_spec_per_file"][file]
}

#[test]
fn damaged_metadata_is_a_clear_error_naming_file_and_key() {
    const KEY: &str = "blocks.0.ff_in.weight"; // [12, 8]: 64 elements in rank_0, 32 in rank_1
    let key = KEY;
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "overlap",
            Box::new(|m| *spec(m, KEY, "rank_1.safetensors") = serde_json::json!({"flattened_offsets": [[63, 95]]})),
            "overlap",
        ),
        (
            "gap",
            Box::new(|m| *spec(m, KEY, "rank_1.safetensors") = serde_json::json!({"flattened_offsets": [[65, 96]]})),
            "gap",
        ),
        (
            "outside",
            Box::new(|m| *spec(m, KEY, "rank_1.safetensors") = serde_json::json!({"flattened_offsets": [[64, 97]]})),
            "inside the tensor",
        ),
        (
            "missing-file",
            Box::new(|m| {
                let s = spec(m, KEY, "rank_1.safetensors").clone();
                m["tensors"][KEY]["shard_spec_per_file"].as_object_mut().unwrap().remove("rank_1.safetensors");
                m["tensors"][KEY]["shard_spec_per_file"]["rank_7.safetensors"] = s;
            }),
            "rank_7.safetensors",
        ),
        ("dtype", Box::new(|m| m["tensors"][KEY]["dtype"] = "BF16".into()), "F32"),
        ("no-tensors", Box::new(|m| *m = serde_json::json!({"tensors": 3})), "tensors"),
    ];
    for (tag, edit, want) in cases {
        let (_dir, e) = damaged(tag, edit);
        let s = e.to_string();
        assert!(matches!(e, Error::Corrupt { .. }), "{tag}: {e:?}");
        assert!(s.contains(want), "{tag}: {s}");
        if tag != "no-tensors" {
            assert!(s.contains(key) || s.contains("rank_"), "{tag}: {s}");
        }
    }
}

#[test]
fn a_file_lacking_a_listed_key_or_truncated_is_named() {
    let dir = TempDir::new("olmo-trunc");
    copy_dir(&fixtures().join("olmo_fsdp1_w2/model"), dir.path());
    let f = dir.join("rank_1.safetensors");
    let len = std::fs::metadata(&f).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&f).unwrap().set_len(len - 10).unwrap();
    let e = open(&LocalStorage::new(dir.path())).and_then(|c| c.read_tensors(None)).unwrap_err().to_string();
    assert!(e.contains("rank_1.safetensors") && e.contains("data_offsets"), "{e}");
    std::fs::write(&f, 2u64.to_le_bytes().iter().chain(b"{}").copied().collect::<Vec<u8>>()).unwrap();
    let e = open(&LocalStorage::new(dir.path())).and_then(|c| c.read_tensors(None)).unwrap_err().to_string();
    assert!(e.contains("rank_1.safetensors") && e.contains("no tensor"), "{e}");
}

#[test]
fn olmo_checkpoints_load_from_an_object_store() {
    for name in ["olmo_fsdp1_w3", "olmo_fsdp2_w2"] {
        let url = crate::common::s3::fresh_url(&format!("olmo-{name}"));
        let prefix = url.trim_start_matches("s3://");
        let local = LocalStorage::new(fixtures().join(name));
        for rel in local.list_recursive().unwrap() {
            let body = std::fs::read(fixtures().join(name).join(&rel)).unwrap();
            let code =
                crate::common::s3::http(crate::common::s3::endpoint(), "PUT", &format!("/{prefix}/{rel}"), &body);
            assert_eq!(code, 200, "uploading {rel}");
        }
        let store = tessera::storage::ObjectStorage::open(&url, crate::common::s3::test_options()).unwrap();
        let got = open(&store).and_then(|c| c.read_tensors(None)).unwrap_or_else(|e| panic!("{name} on S3: {e}"));
        assert_tensors(name, &got, &expected_tensors(name));
        let report = verify(&store, 2).unwrap();
        assert!(report.problems.is_empty(), "{name}: {:?}", report.problems);
    }
}

#[test]
fn identical_shards_from_several_ranks_are_written_once() {
    // HSDP: two replicate groups of two ranks, each flat-sharding the tensor over its group;
    // every rank calls its piece the main one. OLMo-core's rule makes copies replicas.
    let dir = TempDir::new("olmo-hsdp");
    let data = truth(DType::F32, &[10, 3], 7);
    run_ranks(4, |comm| {
        let r = tessera::Communicator::rank(comm);
        let (a, b) = if r % 2 == 0 { (0u64, 13u64) } else { (13, 30) };
        let bytes = &data[a as usize * 4..b as usize * 4];
        let t = shard("w", DType::F32, &[10, 3], &[0, 0], &[10, 3], 0, Some(a..b), TensorData::Ref(bytes));
        let mut tree = StateTree::map();
        tree.insert("w", StateTree::Tensor(t));
        save_olmo(tree, &LocalStorage::new(dir.path()), comm, &SaveOptions::default()).unwrap();
    });
    let meta: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("metadata.json")).unwrap()).unwrap();
    assert_eq!(meta["tensors"]["w"]["shard_spec_per_file"].as_object().unwrap().len(), 2, "{meta}");
    let got = open(&LocalStorage::new(dir.path())).and_then(|c| c.read_tensors(None)).unwrap();
    assert!(got["w"].data == data);
}

#[test]
fn directories_saved_together_are_all_validated_before_any_is_touched() {
    // model/ and optim/ as save_model_and_optim_state writes them, over an existing pair: an
    // invalid optim/ leaves both old directories committed and loadable.
    let root = TempDir::created("olmo-pair");
    let (model, optim) = (LocalStorage::new(root.join("model")), LocalStorage::new(root.join("optim")));
    let old = truth(DType::F32, &[4], 1);
    let new = truth(DType::F32, &[4], 2);
    fn tree<'a>(key: &str, data: &'a [u8], shape: &[u64]) -> StateTree<'a> {
        let mut t = StateTree::map();
        t.insert(key, StateTree::Tensor(ShardedTensor::full(key, DType::F32, shape, TensorData::Ref(data))));
        t
    }
    let pair = |m: &[u8], o: &[u8], o_shape: &[u64], overwrite: bool| {
        let dirs = vec![
            (tree("w", m, &[4]), &model as &dyn Storage),
            (tree("w.__exp_avg", o, o_shape), &optim as &dyn Storage),
        ];
        tessera::olmo::save_olmo_dirs(dirs, &SoloComm, &SaveOptions { overwrite, ..Default::default() })
    };
    pair(&old, &old, &[4], false).unwrap();
    // A shard outside its tensor in optim/: refused, nothing removed or rewritten.
    let e = pair(&new, &new, &[3], true).unwrap_err();
    assert!(matches!(e, Error::InvalidSharding { .. } | Error::InvalidArgument { .. }), "{e}");
    for s in [&model, &optim] {
        let got = open(s).and_then(|c| c.read_tensors(None)).unwrap();
        assert!(got.values().all(|t| t.data == old), "the old pair is intact");
    }
    // Without overwrite, an existing pair is refused as a whole.
    assert!(matches!(pair(&new, &new, &[4], false), Err(Error::AlreadyExists { .. })));
    pair(&new, &new, &[4], true).unwrap();
    let both = open(&LocalStorage::new(root.path())).and_then(|c| c.read_tensors(None)).unwrap();
    assert_eq!(both.keys().collect::<Vec<_>>(), ["model/w", "optim/w.__exp_avg"]);
    assert!(both.values().all(|t| t.data == new));
}
