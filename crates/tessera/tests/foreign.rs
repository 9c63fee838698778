//! Foreign checkpoints (PyTorch DCP, Megatron torch_dist and zarr, OLMo-core) read through the
//! generic load API: every fixture in `tests/fixtures/foreign/` loads to exactly its
//! `NAME.expected.safetensors`, its non-tensor values match `NAME.expected.json`, resharded
//! loads return the right slices, and damaged files give errors, never panics.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::common::files::copy_dir;
use crate::common::fixtures::{assert_loads, boxes, json_eq, to_json, Expected};
use crate::common::{box_bytes, bytes_at, run_ranks, CountingComm};

use tessera::comm::SoloComm;
use tessera::index::FormatRecord;
use tessera::storage::{CountingStorage, LocalStorage};
use tessera::tools::verify;
use tessera::{
    load, open, Communicator, DType, Error, LoadOptions, ShardedObject, ShardedTensor, StateTree, Storage, TensorData,
    Value,
};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/foreign")
}

fn expected_tensors(name: &str) -> BTreeMap<String, Expected> {
    crate::common::fixtures::expected_tensors(&fixtures(), name)
}

fn expected_json(name: &str) -> serde_json::Value {
    crate::common::fixtures::expected_json(&fixtures(), name)
}

const ALL: &[(&str, &str)] = &[
    ("dcp_single", "torch_dcp"),
    ("dcp_fsdp2", "torch_dcp"),
    ("dcp_mesh2d", "torch_dcp"),
    ("dcp_zstd", "torch_dcp"),
    ("dcp_per_item", "torch_dcp"),
    ("dcp_legacy", "torch_dcp"),
    ("olmo_core", "olmo_core"),
    ("megatron_tp2_dp2", "torch_dist"),
    ("megatron_common_item", "torch_dist"),
    ("megatron_zarr", "zarr"),
    ("dcp_large_item", "torch_dcp"),
    ("megatron_core019", "torch_dist"),
    ("dcp_hf_sharded", "safetensors"),
    ("dcp_hf_consolidated", "safetensors"),
    ("dcp_no_collectives", "torch_dcp"),
];

/// `{"a": {"b": [1, 2]}}` → `{"a.b.0": 1, "a.b.1": 2}`: how the fixtures spell DCP byte items.
fn flatten(prefix: &str, v: &serde_json::Value, out: &mut BTreeMap<String, serde_json::Value>) {
    let join = |k: &str| if prefix.is_empty() { k.to_string() } else { format!("{prefix}.{k}") };
    match v {
        serde_json::Value::Object(m) if !m.is_empty() => m.iter().for_each(|(k, v)| flatten(&join(k), v, out)),
        serde_json::Value::Array(a) if !a.is_empty() => {
            a.iter().enumerate().for_each(|(i, v)| flatten(&join(&i.to_string()), v, out))
        }
        other => {
            out.insert(prefix.to_string(), other.clone());
        }
    }
}

fn fixture_storage(name: &str) -> LocalStorage {
    LocalStorage::new(fixtures().join(name))
}

#[test]
fn formats_are_detected() {
    for (name, backend) in ALL {
        let record = FormatRecord::detect(&fixture_storage(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(record.backend.name(), *backend, "{name}");
    }
}

#[test]
fn every_fixture_loads_to_its_expected_tensors() {
    for (name, _) in ALL {
        let want = expected_tensors(name);
        let got =
            open(&fixture_storage(name)).and_then(|c| c.read_tensors(None)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>(), "{name}: keys");
        for (k, w) in &want {
            let g = &got[k];
            assert_eq!((g.dtype, &g.shape), (w.dtype, &w.shape), "{name}: {k}");
            assert!(g.data == w.data, "{name}: {k}: values differ");
        }
    }
}

fn common_json(storage: &dyn Storage) -> serde_json::Value {
    let mut map = serde_json::Map::new();
    if let StateTree::Map(m) = open(storage).map(|c| c.common_state()).unwrap() {
        for (k, v) in m {
            map.insert(k, tree_json(&v));
        }
    }
    serde_json::Value::Object(map)
}

fn tree_json(t: &StateTree<'_>) -> serde_json::Value {
    match t {
        StateTree::Value(v) => to_json(v),
        StateTree::Map(m) => serde_json::Value::Object(m.iter().map(|(k, v)| (k.clone(), tree_json(v))).collect()),
        StateTree::List(xs) => serde_json::Value::Array(xs.iter().map(tree_json).collect()),
        other => panic!("unexpected leaf in common state: {other:?}"),
    }
}

#[test]
fn non_tensor_values_match_the_expected_json() {
    for (name, backend) in ALL {
        let storage = fixture_storage(name);
        let want = expected_json(name);
        let common = common_json(&storage);
        if backend.starts_with("torch_dist") || *backend == "zarr" {
            assert!(json_eq(&common, &want["common"]), "{name}: common {common} vs {}", want["common"]);
            let ckpt = open(&storage).unwrap();
            let objects = want["sharded_objects"].as_object().cloned().unwrap_or_default();
            let mut tree = StateTree::map();
            for fqn in objects.keys() {
                let (key, rest) = fqn.rsplit_once("/shard_").unwrap();
                let (off, shape) = rest.split_once('_').unwrap();
                let dims = |s: &str| s.split('.').map(|x| x.parse().unwrap()).collect::<Vec<u64>>();
                tree.insert(
                    fqn.clone(),
                    StateTree::Object(ShardedObject {
                        data: None,
                        ..ShardedObject::new(key, Vec::new(), &dims(shape), &dims(off))
                    }),
                );
            }
            assert_eq!(ckpt.index().objects.iter().map(|o| o.shards.len()).sum::<usize>(), objects.len(), "{name}");
            let StateTree::Map(loaded) = open(&storage).and_then(|c| c.load_objects(tree)).unwrap() else { panic!() };
            for (fqn, node) in loaded {
                let StateTree::Object(o) = node else { panic!("{fqn}") };
                let data = o.data.unwrap();
                assert_eq!(
                    &data[..4],
                    b"TSV1", // the tag of a plain-value payload
                    "{name}: {fqn} is plain"
                );
                let v = Value::from_bytes(&data[4..]).unwrap();
                assert!(json_eq(&to_json(&v), &objects[&fqn]), "{name}: {fqn}: {:?}", to_json(&v));
            }
        } else {
            let mut flat = BTreeMap::new();
            flatten("", &common, &mut flat);
            let mut want_flat = BTreeMap::new();
            flatten("", &want, &mut want_flat);
            for (k, w) in &want_flat {
                // A tuple (Adam's betas) is kept as its torch.save bytes, so that it stays a
                // tuple for Python and in a DCP copy: its items are not plain values here.
                let in_tuple = |k: &str| {
                    k.rsplit_once('.').is_some_and(|(parent, i)| {
                        i.parse::<u64>().is_ok() && flat.contains_key(&format!("{parent}.__tessera_torch_save__"))
                    })
                };
                if in_tuple(k) {
                    continue;
                }
                let g = flat.get(k).unwrap_or_else(|| panic!("{name}: no value {k}; have {flat:?}"));
                assert!(json_eq(g, w), "{name}: {k}: {g} vs {w}");
            }
        }
    }
}

#[test]
fn resharded_loads_return_the_right_slices() {
    for (name, _) in ALL {
        let storage = fixture_storage(name);
        let want = expected_tensors(name);
        for parts in [2u64, 3] {
            let mut tree = StateTree::map();
            let mut expect = Vec::new();
            for (k, w) in &want {
                if w.shape.is_empty() {
                    continue;
                }
                for (i, (off, sub)) in boxes(&w.shape, parts).into_iter().enumerate() {
                    let mut t = ShardedTensor::full(k.clone(), w.dtype, &sub, TensorData::None);
                    t.global_shape = w.shape.clone();
                    t.global_offset = off.clone();
                    let id = format!("{k}#{i}");
                    expect.push((id.clone(), box_bytes(&w.data, &w.shape, w.dtype.size(), &off, &sub)));
                    tree.insert(id, StateTree::Tensor(t));
                }
            }
            assert_loads(&storage, tree, expect, &format!("{name} in {parts} parts"));
        }
    }
}

#[test]
fn ranks_loading_from_a_network_filesystem_share_no_checks_of_a_foreign_format() {
    // Foreign formats carry no block checksums: a multi-rank verified load from storage that is
    // not local has nothing to check together and reads alone, in one collective.
    for (name, _) in ALL {
        let storage = fixture_storage(name).treat_as_local(false);
        let want = expected_tensors(name);
        let out = run_ranks(2, |c| {
            let mut tree = StateTree::map();
            let mut expect = Vec::new();
            for (k, w) in want.iter().filter(|(_, w)| !w.shape.is_empty()) {
                let mine = boxes(&w.shape, 2).into_iter().enumerate().filter(|(i, _)| i % 2 == c.rank());
                for (i, (off, sub)) in mine {
                    let mut t = ShardedTensor::full(k.clone(), w.dtype, &sub, TensorData::None);
                    (t.global_shape, t.global_offset) = (w.shape.clone(), off.clone());
                    let id = format!("{}#{i}", k.replace('.', "_")); // a path, not dotted
                    expect.push((id.clone(), box_bytes(&w.data, &w.shape, w.dtype.size(), &off, &sub)));
                    tree.insert(id, StateTree::Tensor(t));
                }
            }
            let counting = CountingComm::new(c);
            let loaded = load(tree, &storage, &counting, &LoadOptions::default())?;
            for (k, bytes) in expect {
                assert!(bytes_at(&loaded.state, &k) == bytes.as_slice(), "{name}, rank {}: {k}", c.rank());
            }
            Ok::<_, Error>(counting.calls.load(std::sync::atomic::Ordering::Relaxed))
        });
        for (r, x) in out.into_iter().enumerate() {
            assert_eq!(x.unwrap_or_else(|e| panic!("{name}, rank {r}: {e}")), 1, "{name}, rank {r}");
        }
    }
}

#[test]
fn verify_reads_every_item() {
    for (name, _) in ALL {
        let report = verify(&fixture_storage(name), 2).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(report.problems.is_empty(), "{name}: {:?}", report.problems);
        assert!(report.bytes_checked > 0, "{name}");
    }
}

#[test]
fn a_small_box_reads_only_its_bytes_after_locating_the_item() {
    // megatron_zarr chunks are plain files: a box inside one chunk reads exactly its rows.
    let base = fixture_storage("megatron_zarr");
    let counting = CountingStorage::new(&base);
    let ckpt = open(&counting).unwrap();
    let t = ckpt.index().tensors.iter().find(|t| t.global_shape.len() == 2 && t.global_shape[0] >= 2).unwrap();
    let (key, dtype, shape) = (t.key.clone(), t.dtype, t.global_shape.clone());
    let before = counting.bytes_read();
    let mut st = ShardedTensor::full(key.clone(), dtype, &[1, shape[1]], TensorData::None);
    st.global_shape = shape.clone();
    let mut tree = StateTree::map();
    tree.insert("x", StateTree::Tensor(st));
    let opts = LoadOptions::default();
    ckpt.load(tree, &SoloComm, &opts).unwrap();
    let row = shape[1] * dtype.size() as u64;
    assert_eq!(counting.bytes_read() - before, row, "{key}: one row read");
}

#[test]
fn a_few_rows_of_a_dcp_item_are_read_in_place() {
    // dcp_large_item's "w" item holds 68 KiB of data: unverified, rows 100..102 cost the 4 KiB
    // read at each end of the item to locate the data, plus the rows, not the whole item.
    let base = fixture_storage("dcp_large_item");
    let counting = CountingStorage::new(&base);
    let ckpt = open(&counting).unwrap();
    let before = counting.bytes_read();
    let w = expected_tensors("dcp_large_item").remove("w").unwrap();
    let rows = |name: &str, at: u64, n: u64| {
        let mut st = ShardedTensor::full("w", DType::F32, &[n, 128], TensorData::None);
        st.global_shape = vec![136, 128];
        st.global_offset = vec![at, 0];
        let mut tree = StateTree::map();
        tree.insert(name, StateTree::Tensor(st));
        tree
    };
    let unverified = LoadOptions { verify_checksums: false, ..LoadOptions::default() };
    let out = ckpt.load(rows("x", 100, 2), &SoloComm, &unverified).unwrap();
    let read = counting.bytes_read() - before;
    assert_eq!(read, 2 * (4 << 10) + 2 * 128 * 4, "both ends + two rows");
    let StateTree::Map(m) = out.state else { panic!() };
    let StateTree::Tensor(t) = &m["x"] else { panic!() };
    assert_eq!(t.data.bytes().unwrap(), &w.data[100 * 512..102 * 512]);
    // Located once: a second load of other rows reads only those rows.
    let before = counting.bytes_read();
    ckpt.load(rows("y", 0, 1), &SoloComm, &unverified).unwrap();
    assert_eq!(counting.bytes_read() - before, 512);
    // Verified, the zip CRC-32 of each member of the item is checked: the item is read whole
    // once (a CRC covers its whole member, as a native checksum covers its whole block), then
    // only the rows.
    let before = counting.bytes_read();
    ckpt.load(rows("z", 3, 1), &SoloComm, &LoadOptions::default()).unwrap();
    let read = counting.bytes_read() - before;
    assert!(read > w.data.len() as u64 && read < 2 * w.data.len() as u64, "{read}");
    let before = counting.bytes_read();
    ckpt.load(rows("z", 5, 1), &SoloComm, &LoadOptions::default()).unwrap();
    assert_eq!(counting.bytes_read() - before, 512);
}

// ---- damage ---------------------------------------------------------------------------------
fn scratch(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tessera-foreign-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Opens and fully loads a checkpoint; any error is fine, a panic is not.
fn try_everything(dir: &Path) -> Result<(), Error> {
    let s = LocalStorage::new(dir);
    open(&s).and_then(|c| c.read_tensors(None))?;
    open(&s).map(|c| c.common_state())?;
    let report = verify(&s, 1)?;
    match report.problems.first() {
        Some(p) => Err(Error::Corrupt { path: dir.into(), reason: p.clone() }),
        None => Ok(()),
    }
}

#[test]
fn truncated_metadata_is_corrupt() {
    for name in ["dcp_single", "megatron_tp2_dp2"] {
        let dir = scratch(&format!("trunc-meta-{name}"));
        copy_dir(&fixtures().join(name), &dir);
        let meta = std::fs::read(dir.join(".metadata")).unwrap();
        for cut in (0..meta.len()).step_by(197).chain([meta.len() - 1]) {
            std::fs::write(dir.join(".metadata"), &meta[..cut]).unwrap();
            match try_everything(&dir) {
                Err(Error::Corrupt { path, reason }) => {
                    assert!(path.ends_with(".metadata"), "{path:?}: {reason}");
                }
                other => panic!("{name}: .metadata cut at {cut}: {other:?}"),
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn flipped_metadata_bytes_never_panic() {
    let dir = scratch("flip-meta");
    copy_dir(&fixtures().join("dcp_mesh2d"), &dir);
    let meta = std::fs::read(dir.join(".metadata")).unwrap();
    let mut ok = 0;
    for i in 0..meta.len() {
        let mut m = meta.clone();
        m[i] ^= 0x5A;
        std::fs::write(dir.join(".metadata"), &m).unwrap();
        if try_everything(&dir).is_ok() {
            ok += 1;
        }
    }
    // Most flips break the pickle; the few that survive (a changed hint or name) still load.
    assert!(ok < meta.len() / 2, "{ok} of {} flips loaded", meta.len());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn truncated_or_damaged_data_files_give_clear_errors() {
    for name in ["dcp_fsdp2", "dcp_zstd", "dcp_large_item", "megatron_tp2_dp2", "megatron_zarr"] {
        let dir = scratch(&format!("trunc-data-{name}"));
        copy_dir(&fixtures().join(name), &dir);
        let s = LocalStorage::new(&dir);
        let mut files: Vec<String> = s
            .list_recursive()
            .unwrap()
            .into_iter()
            .filter(|f| f.ends_with(".distcp") || f.rsplit('/').next().is_some_and(|l| l.starts_with('0')))
            .collect();
        files.sort();
        assert!(!files.is_empty(), "{name}");
        for f in &files {
            let path = dir.join(f);
            let orig = std::fs::read(&path).unwrap();
            if orig.is_empty() {
                continue;
            }
            for cut in [0, orig.len() / 3, orig.len() - 1] {
                std::fs::write(&path, &orig[..cut]).unwrap();
                match try_everything(&dir) {
                    Err(Error::Corrupt { .. }) | Err(Error::NotFound { .. }) => {}
                    other => panic!("{name}: {f} cut at {cut} of {}: {other:?}", orig.len()),
                }
            }
            // Damage bytes throughout the file in turn: errors or (when only tensor values
            // changed) a successful load, never a panic.
            for i in (0..orig.len()).step_by((orig.len() / 40).max(1)) {
                let mut d = orig.clone();
                d[i] ^= 0xFF;
                std::fs::write(&path, &d).unwrap();
                let _ = try_everything(&dir);
            }
            std::fs::write(&path, &orig).unwrap();
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn missing_data_file_is_not_found_and_bad_metadata_json_is_corrupt() {
    let dir = scratch("missing");
    copy_dir(&fixtures().join("megatron_tp2_dp2"), &dir);
    std::fs::remove_file(dir.join("__1_0.distcp")).unwrap();
    assert!(matches!(try_everything(&dir), Err(Error::NotFound { .. })));
    std::fs::write(dir.join("metadata.json"), b"{not json").unwrap();
    assert!(matches!(FormatRecord::detect(&LocalStorage::new(&dir)), Err(Error::Corrupt { .. })));
    std::fs::write(dir.join("metadata.json"), br#"{"sharded_backend": "torch_dist", "sharded_backend_version": 9}"#)
        .unwrap();
    assert!(matches!(FormatRecord::detect(&LocalStorage::new(&dir)), Err(Error::IncompatibleVersion { .. })));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn foreign_checkpoints_are_read_only() {
    let s = fixture_storage("dcp_single");
    let ckpt = open(&s).unwrap();
    assert!(tessera::__fuzz::checkpoint_storage(&ckpt).put_atomic("x", b"y").is_err());
    // gc cleans DCP locations too: a committed DCP checkpoint has nothing to remove.
    assert!(tessera::tools::gc(&s, &tessera::tools::GcOptions::default()).unwrap().removed.is_empty());
    assert!(tessera::tools::remove_sharded_tensors(&s, "model").is_err());
}

// ---- tools on foreign checkpoints -----------------------------------------------------------

#[test]
fn every_fixture_unshards_to_its_expected_safetensors() {
    for (name, _) in ALL {
        let dir = scratch(&format!("unshard-{name}"));
        std::fs::create_dir_all(&dir).unwrap();
        let out = dir.join("model.safetensors");
        let opts = tessera::tools::ExportOptions::default();
        tessera::tools::export_safetensors(&fixture_storage(name), &out, &opts, &mut |_, _| {})
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        // Read the produced file with the same reader as the expected one.
        let got = {
            let bytes = std::fs::read(&out).unwrap();
            let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
            let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
            let mut m = BTreeMap::new();
            for (k, v) in header.as_object().unwrap() {
                if k == "__metadata__" {
                    continue;
                }
                let off = v["data_offsets"].as_array().unwrap();
                let (a, b) = (off[0].as_u64().unwrap() as usize + 8 + n, off[1].as_u64().unwrap() as usize + 8 + n);
                m.insert(k.clone(), (v["dtype"].clone(), v["shape"].clone(), bytes[a..b].to_vec()));
            }
            m
        };
        let want = expected_tensors(name);
        assert_eq!(got.len(), want.len(), "{name}");
        for (k, w) in &want {
            let (dtype, shape, data) = &got[k];
            assert_eq!(dtype.as_str().unwrap(), w.dtype.safetensors_name(), "{name}: {k}");
            assert_eq!(shape, &serde_json::json!(w.shape), "{name}: {k}");
            assert!(data == &w.data, "{name}: {k}: values differ");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn every_fixture_converts_to_an_equal_native_checkpoint() {
    for (name, _) in ALL {
        let src = fixture_storage(name);
        let dst = tessera::storage::MemoryStorage::named(&format!("foreign-convert-{name}-{}", std::process::id()));
        let opts = tessera::tools::ConvertOptions::default();
        tessera::tools::convert(&src, &dst, &opts, &mut |_, _| {}).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(FormatRecord::detect(&dst).unwrap().backend, tessera::index::Backend::Tessera, "{name}");
        let report = verify(&dst, 2).unwrap();
        assert!(report.problems.is_empty(), "{name}: {:?}", report.problems);
        let d = tessera::tools::diff::diff(&src, &dst, &tessera::tools::diff::DiffOptions::default()).unwrap();
        assert!(d.is_equal(), "{name}: {d:?}");
        let want = expected_tensors(name);
        let got = open(&dst).and_then(|c| c.read_tensors(None)).unwrap();
        for (k, w) in &want {
            assert!(got[k].data == w.data, "{name}: {k}");
        }
    }
}

#[test]
fn diff_names_the_keys_that_differ_between_formats() {
    // dcp_single vs its native conversion with one tensor dropped is a difference naming it.
    let src = fixture_storage("dcp_single");
    let dst = tessera::storage::MemoryStorage::named(&format!("foreign-diff-{}", std::process::id()));
    tessera::tools::convert(&src, &dst, &tessera::tools::ConvertOptions::default(), &mut |_, _| {}).unwrap();
    tessera::tools::remove_sharded_tensors(&dst, "model.w_f16").unwrap();
    let d = tessera::tools::diff::diff(&src, &dst, &tessera::tools::diff::DiffOptions::default()).unwrap();
    assert!(!d.is_equal());
    let named: Vec<&str> = d.tensors.iter().map(|t| t.key.as_str()).collect();
    assert_eq!(named, ["model.w_f16"]);
}

#[test]
fn foreign_checkpoints_load_from_an_object_store() {
    // The same fixtures uploaded to S3 (moto): nested zarr folders, OLMo-core's subfolder, zstd
    // items and in-place reads all go through ObjectStorage.
    for name in ["megatron_zarr", "olmo_core", "dcp_zstd", "dcp_large_item", "megatron_tp2_dp2"] {
        let url = crate::common::s3::fresh_url(&format!("foreign-{name}"));
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
        let want = expected_tensors(name);
        assert_eq!(got.len(), want.len(), "{name}");
        for (k, w) in &want {
            assert!(got[k].data == w.data, "{name}: {k}");
        }
        assert!(json_eq(&common_json(&store), &common_json(&local)), "{name}: common state");
        let report = verify(&store, 2).unwrap();
        assert!(report.problems.is_empty(), "{name}: {:?}", report.problems);
    }
}

// ---- zip CRC-32s and Megatron's integrity.json -------------------------------------------

/// A copy of fixture `name` with one byte flipped in the stored bytes of tensor `key` (found
/// by its expected bytes, which occur once among the data files); returns the copy and the
/// data file changed.
fn with_tensor_byte_flipped(name: &str, key: &str, tag: &str) -> (PathBuf, String) {
    let dir = scratch(tag);
    copy_dir(&fixtures().join(name), &dir);
    let want = &expected_tensors(name)[key].data;
    let probe = &want[..16.min(want.len())];
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let mut bytes = std::fs::read(&path).unwrap();
        if let Some(at) = bytes.windows(probe.len()).position(|w| w == probe) {
            bytes[at + 1] ^= 0x10;
            std::fs::write(&path, &bytes).unwrap();
            return (dir, path.file_name().unwrap().to_string_lossy().into_owned());
        }
    }
    panic!("{name}: the bytes of {key} are in no file");
}

/// Loads tensor `key` of the checkpoint in `dir` whole, checking checksums or not.
fn load_whole(dir: &Path, key: &str, want: &crate::common::fixtures::Expected, verify: bool) -> Result<Vec<u8>, Error> {
    let t = ShardedTensor::full(key, want.dtype, &want.shape, TensorData::Owned(vec![0; want.data.len()]));
    let opts = LoadOptions { verify_checksums: verify, ..LoadOptions::default() };
    let r = load(StateTree::map().with("t", StateTree::Tensor(t)), &LocalStorage::new(dir), &SoloComm, &opts)?;
    let StateTree::Map(m) = r.state else { panic!("not a map") };
    let Some((_, StateTree::Tensor(t))) = m.into_iter().find(|(k, _)| k == "t") else { panic!("no tensor") };
    Ok(t.data.bytes().unwrap().to_vec())
}

#[test]
fn a_flipped_byte_in_a_torch_save_item_fails_verify_and_verified_loads() {
    // A small item (decoded whole) and one larger than the reader's probes (read in place).
    for (name, key) in [("megatron_tp2_dp2", "layers.norm.weight"), ("dcp_large_item", "w")] {
        let want = &expected_tensors(name)[key];
        let (dir, file) = with_tensor_byte_flipped(name, key, &format!("crc-{name}"));
        let report = verify(&LocalStorage::new(&dir), 2).unwrap();
        assert_eq!(report.problems.len(), 1, "{name}: {:?}", report.problems);
        let p = &report.problems[0];
        assert!(p.contains(&file) && p.contains(&format!("{key:?}")) && p.contains("CRC-32"), "{name}: {p}");
        match load_whole(&dir, key, want, true) {
            Err(Error::Corrupt { path, reason }) => {
                assert!(path.ends_with(&file), "{name}: {path:?}");
                assert!(reason.contains(&format!("{key:?}")) && reason.contains("data/0"), "{name}: {reason}");
            }
            other => panic!("{name}: a verified load gave {:?}", other.map(|b| b.len())),
        }
        // Without verification, as for native files, the bytes are read as they are.
        let got = load_whole(&dir, key, want, false).unwrap();
        assert_eq!(got.len(), want.data.len());
        assert_eq!(got.iter().zip(&want.data).filter(|(a, b)| a != b).count(), 1, "{name}: one byte differs");
        // A verified load after the unchecked one (a decoded copy cached) still checks.
        assert!(matches!(load_whole(&dir, key, want, true), Err(Error::Corrupt { .. })), "{name}");
        // The other tensors are untouched and load verified.
        for (k, w) in expected_tensors(name).iter().filter(|(k, _)| *k != key) {
            assert_eq!(load_whole(&dir, k, w, true).unwrap(), w.data, "{name}: {k}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn a_flipped_byte_in_common_pt_is_corrupt_naming_the_member() {
    let dir = scratch("crc-common");
    copy_dir(&fixtures().join("megatron_tp2_dp2"), &dir);
    let path = dir.join("common.pt");
    let mut bytes = std::fs::read(&path).unwrap();
    // Inside a string of the pickle: it still decodes; only the CRC tells.
    let at = bytes.windows(7).position(|w| w == b"fixture").unwrap();
    bytes[at] ^= 1;
    std::fs::write(&path, &bytes).unwrap();
    let s = LocalStorage::new(&dir);
    // The common state is read when the checkpoint opens, and checked then, as a native index.
    for r in [open(&s).map(|_| ()), verify(&s, 1).map(|_| ())] {
        match r {
            Err(Error::Corrupt { path, reason }) => {
                assert!(path.ends_with("common.pt"), "{path:?}");
                assert!(reason.contains("data.pkl") && reason.contains("CRC-32"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn megatron_019_integrity_json_is_checked_by_verify() {
    let name = "megatron_core019";
    let report = verify(&fixture_storage(name), 2).unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    assert_eq!(report.integrity_checked, 4, ".metadata, metadata.json and two data files");
    // 0.19 keeps the common state inside the DCP data: no common.pt.
    assert!(!fixtures().join(name).join("common.pt").exists());

    let dir = scratch("integrity");
    copy_dir(&fixtures().join(name), &dir);
    let s = LocalStorage::new(&dir);
    // A byte appended to a data file: the items still read, the SHA-256 differs.
    let mut d = std::fs::read(dir.join("__1_0.distcp")).unwrap();
    d.push(0);
    std::fs::write(dir.join("__1_0.distcp"), &d).unwrap();
    // A data file the manifest does not list.
    std::fs::copy(dir.join("__0_0.distcp"), dir.join("__7_0.distcp")).unwrap();
    let problems = verify(&s, 2).unwrap().problems;
    assert_eq!(problems.len(), 2, "{problems:?}");
    assert!(problems[0].contains("__1_0.distcp") && problems[0].contains("SHA-256"), "{problems:?}");
    assert!(problems[1].contains("__7_0.distcp") && problems[1].contains("does not list"), "{problems:?}");
    // A listed file missing.
    std::fs::remove_file(dir.join("__7_0.distcp")).unwrap();
    std::fs::write(dir.join("__1_0.distcp"), &d[..d.len() - 1]).unwrap();
    let manifest = std::fs::read_to_string(dir.join("integrity.json")).unwrap();
    std::fs::write(dir.join("integrity.json"), manifest.replace("metadata.json", "gone.json")).unwrap();
    let problems = verify(&s, 2).unwrap().problems;
    assert_eq!(problems.len(), 2, "{problems:?}");
    assert!(problems.iter().any(|p| p.contains("gone.json") && p.contains("missing")), "{problems:?}");
    assert!(problems.iter().any(|p| p.contains("metadata.json") && p.contains("does not list")), "{problems:?}");
    // A manifest of another shape is a problem, not a crash.
    for bad in [&b"{\"algorithm\": \"md5\", \"files\": {}}"[..], b"[1]", b"{\"files\": {\"../x\": \"00\"}}"] {
        std::fs::write(dir.join("integrity.json"), bad).unwrap();
        let problems = verify(&s, 2).unwrap().problems;
        assert!(problems.len() == 1 && problems[0].contains("integrity.json"), "{problems:?}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---- DCP's Hugging Face and per-rank layouts ------------------------------------------------

/// Rewrites the `DCP_SHARDING_INFO` of a `HuggingFaceStorageWriter(save_distributed=True)`
/// shard file with `edit` (the data section is kept: its offsets are relative to it).
fn edit_sharding_info(path: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let raw = header["__metadata__"]["DCP_SHARDING_INFO"].as_str().unwrap();
    let mut info: serde_json::Value = serde_json::from_str(raw).unwrap();
    edit(&mut info);
    header["__metadata__"]["DCP_SHARDING_INFO"] = serde_json::Value::String(info.to_string());
    let mut text = serde_json::to_vec(&header).unwrap();
    text.resize(text.len().next_multiple_of(8), b' ');
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&text);
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(path, out).unwrap();
}

const HF_SHARD_1: &str = "shard-00001-model-00001-of-00001.safetensors";
const HF_SHARD_2: &str = "shard-00002-model-00001-of-00001.safetensors";

#[test]
fn dcp_hf_sharded_pieces_are_placed_by_their_saved_offsets() {
    let s = fixture_storage("dcp_hf_sharded");
    let ckpt = open(&s).unwrap();
    // b is split unevenly on axis 1 (3 + 2 columns), in both files; the global shape, which
    // DCP does not record, is what the pieces span.
    let b = ckpt.index().tensor("b").unwrap();
    assert_eq!((b.dtype, b.global_shape.clone()), (DType::BF16, vec![3, 5]));
    let pieces: Vec<(Vec<u64>, Vec<u64>)> = b.chunks().iter().map(|c| (c.offset.to_vec(), c.shape.to_vec())).collect();
    assert_eq!(pieces, vec![(vec![0, 0], vec![3, 3]), (vec![0, 3], vec![3, 2])]);
    // The replicated r was stored once, by the second rank.
    assert_eq!(ckpt.index().tensor("r").unwrap().chunks().len(), 1);
    // The consolidated copy's pieces (sharded/) are a checkpoint of this layout too.
    let pieces = LocalStorage::new(fixtures().join("dcp_hf_consolidated/sharded"));
    let got = open(&pieces).and_then(|c| c.read_tensors(None)).unwrap();
    for (k, w) in expected_tensors("dcp_hf_consolidated") {
        assert!(got[&k].data == w.data && got[&k].shape == w.shape, "sharded/: {k}");
    }
}

/// The checkpoint at `dir` opens (the gate lets a region no chunk stores through), `verify`
/// reports the gap in `key`, and reading `key` fails naming it.
fn assert_gap(dir: &Path, key: &str) {
    let s = LocalStorage::new(dir);
    let report = verify(&s, 1).unwrap();
    let quoted = format!("{key:?}");
    assert!(report.problems.iter().any(|p| p.contains(&quoted) && p.contains("gap")), "{:?}", report.problems);
    match open(&s).and_then(|c| c.read_tensors(None)) {
        Err(e @ Error::NotCovered { .. }) => assert!(e.to_string().contains(key), "{e}"),
        other => panic!("{key}: {:?}", other.map(|_| ())),
    }
}

#[test]
fn a_dcp_sharding_offset_past_the_tensor_leaves_a_gap_verify_reports() {
    // DCP records no global shape: a piece placed past the others widens the span of the
    // tensor, and the rows between are stored by no file.
    let dir = scratch("hf-past");
    copy_dir(&fixtures().join("dcp_hf_sharded"), &dir);
    edit_sharding_info(&dir.join(HF_SHARD_2), |i| i["a"]["saved_offsets"] = serde_json::json!([9, 0]));
    assert_eq!(open(&LocalStorage::new(&dir)).unwrap().index().tensor("a").unwrap().global_shape, vec![12, 4]);
    assert_gap(&dir, "a");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn hostile_dcp_sharding_info_is_refused_naming_file_and_key() {
    // (tag, file edited, the edit, words the error must hold)
    type Case = (&'static str, &'static str, fn(&mut serde_json::Value), &'static [&'static str]);
    let cases: [Case; 4] = [
        // Two pieces of the same rows.
        ("overlap", HF_SHARD_2, |i| i["a"]["saved_offsets"] = serde_json::json!([1, 0]), &["\"a\"", "overlap"]),
        (
            "overflow",
            HF_SHARD_2,
            |i| i["c"]["saved_offsets"] = serde_json::json!([u64::MAX, 0]),
            &[HF_SHARD_2, "\"c\"", "overflow"],
        ),
        ("axes", HF_SHARD_1, |i| i["b"]["saved_offsets"] = serde_json::json!([0]), &[HF_SHARD_1, "\"b\"", "axes"]),
        (
            "absent",
            HF_SHARD_1,
            |i| {
                i.as_object_mut().unwrap().remove("c");
            },
            &[HF_SHARD_1, "\"c\"", "DCP_SHARDING_INFO"],
        ),
    ];
    for (tag, file, edit, words) in cases {
        let dir = scratch(&format!("hf-{tag}"));
        copy_dir(&fixtures().join("dcp_hf_sharded"), &dir);
        edit_sharding_info(&dir.join(file), edit);
        match open(&LocalStorage::new(&dir)) {
            Err(e @ Error::Corrupt { .. }) => {
                let msg = e.to_string();
                for w in words {
                    assert!(msg.contains(w), "{tag}: {msg:?} does not say {w}");
                }
            }
            other => panic!("{tag}: {:?}", other.map(|_| ())),
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn dcp_without_collectives_merges_the_ranks_metadata() {
    let s = fixture_storage("dcp_no_collectives");
    assert!(!fixtures().join("dcp_no_collectives/.metadata").exists(), "torch writes no .metadata without collectives");
    let ckpt = open(&s).unwrap();
    // Both ranks stored r (no rank deduplicates against another): one replica is read.
    assert_eq!(ckpt.index().tensor("r").unwrap().chunks().len(), 1);
    assert_eq!(ckpt.index().tensor("a").unwrap().chunks().len(), 2);
}

#[test]
fn dcp_without_collectives_missing_or_conflicting_rank_metadata_is_refused() {
    // A rank whose data file exists but whose metadata does not: not committed, named.
    let dir = scratch("nocoll-missing");
    copy_dir(&fixtures().join("dcp_no_collectives"), &dir);
    std::fs::remove_file(dir.join("__1.metadata")).unwrap();
    match open(&LocalStorage::new(&dir)) {
        Err(e @ Error::NotCommitted { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains("__1.metadata") && msg.contains("__1_0.distcp"), "{msg}");
        }
        other => panic!("{:?}", other.map(|_| ())),
    }
    // Rank 0's metadata in rank 1's place too: the same chunks twice are replicas, read once;
    // a's second half is then stored by no rank, which verify reports and a load refuses.
    std::fs::copy(dir.join("__0.metadata"), dir.join("__1.metadata")).unwrap();
    assert_gap(&dir, "a");
    // A key two ranks describe differently: dcp_large_item's .metadata has a bf16 "b" of
    // shape [4, 8], dcp_no_collectives' is [3, 5].
    std::fs::copy(fixtures().join("dcp_large_item/.metadata"), dir.join("__1.metadata")).unwrap();
    match open(&LocalStorage::new(&dir)) {
        Err(e @ Error::Corrupt { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains("__1.metadata") && msg.contains("__0.metadata") && msg.contains("\"b\""), "{msg}");
        }
        other => panic!("{:?}", other.map(|_| ())),
    }
    std::fs::copy(fixtures().join("dcp_no_collectives/__1.metadata"), dir.join("__1.metadata")).unwrap();
    assert!(open(&LocalStorage::new(&dir)).is_ok());
    // A third rank whose metadata lacks: ranks 0..=2 must all have one.
    std::fs::copy(dir.join("__0_0.distcp"), dir.join("__2_0.distcp")).unwrap();
    match open(&LocalStorage::new(&dir)) {
        Err(e @ Error::NotCommitted { .. }) => assert!(e.to_string().contains("__2.metadata"), "{e}"),
        other => panic!("{:?}", other.map(|_| ())),
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
