//! Shapes and file numbers read from other people's bytes: a tensor with more axes than any
//! real one (tessera's cap is 64, torch's own limit for most operations) is refused by every
//! parser that reads shapes, with `Error::Corrupt` naming the file and the key, before the
//! geometry walks its axes (a 180 KB safetensors of 60,000 axes used to overflow the stack); a
//! native index naming a file number that does not fit 32 bits is refused instead of being
//! truncated onto file 0. Every input is built by the test.

use crate::common::hostile;

use std::path::Path;

use crate::common::files::copy_dir;
use crate::common::{shard, TempDir};
use hostile::*;
use tessera::comm::*;
use tessera::index::*;
use tessera::storage::*;
use tessera::tools::*;
use tessera::*;

/// The cap on axes, as the errors state it.
const CAP: usize = 64;

/// The `Corrupt` error of `r` as (path, reason), or a panic describing what came instead.
#[track_caller]
fn corrupt<T: std::fmt::Debug>(r: Result<T>) -> (String, String) {
    match r {
        Err(Error::Corrupt { path, reason }) => (path.to_string_lossy().into_owned(), reason),
        other => panic!("expected Error::Corrupt, got {other:?}"),
    }
}

/// Checks that `r` is the axes refusal: `Corrupt` naming a path ending in `file`, the key and
/// the number of axes.
#[track_caller]
fn assert_too_many_axes<T: std::fmt::Debug>(r: Result<T>, file: &str, key: &str, axes: usize) {
    let (path, reason) = corrupt(r);
    assert!(path.ends_with(file), "names {path}, expected {file}: {reason}");
    assert!(reason.contains(&format!("{key:?}")), "{reason} does not name {key:?}");
    assert!(reason.contains(&format!("{axes} axes")) && reason.contains(&CAP.to_string()), "{reason}");
}

/// [`plain_safetensors`] written at `path`.
fn write_plain_safetensors(path: &Path, axes: usize) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, plain_safetensors(axes)).unwrap();
}

#[test]
fn safetensors_of_60000_axes_is_refused_not_a_stack_overflow() {
    let dir = TempDir::new("axes-st");
    write_plain_safetensors(&dir.join("model.safetensors"), 60_000);
    assert!(std::fs::metadata(dir.join("model.safetensors")).unwrap().len() < 200_000);
    let st = LocalStorage::new(dir.path());
    assert_too_many_axes(open(&st).map(|_| ()), "model.safetensors", "w", 60_000);
    assert_too_many_axes(verify(&st, 2), "model.safetensors", "w", 60_000);
    // Just over the cap: the same; at the cap, the tensor loads.
    write_plain_safetensors(&dir.join("model.safetensors"), CAP + 1);
    assert_too_many_axes(open(&st).map(|_| ()), "model.safetensors", "w", CAP + 1);
    write_plain_safetensors(&dir.join("model.safetensors"), CAP);
    let got = open(&st).and_then(|c| c.read_tensors(None)).unwrap();
    assert_eq!(got["w"].data, 1.5f32.to_le_bytes());
    assert_eq!(got["w"].shape.len(), CAP);
}

/// A native checkpoint of one u8 tensor `w` [4] in `dir`.
fn native(dir: &TempDir, axes: usize) -> LocalStorage {
    let st = LocalStorage::new(dir.path());
    let data = vec![7u8; 4];
    let mut shape = vec![1u64; axes - 1];
    shape.push(4);
    let zeros = vec![0u64; axes];
    let mut tree = StateTree::map();
    let t = shard("w", DType::U8, &shape, &zeros, &shape, 0, None, TensorData::Ref(&data));
    tree.insert("w".to_string(), StateTree::Tensor(t));
    save(tree, &st, &SoloComm, &SaveOptions::default()).unwrap();
    st
}

#[test]
fn native_index_of_65_axes_is_refused() {
    let dir = TempDir::new("axes-native");
    let st = native(&dir, 2);
    let index = open(&st).map(Checkpoint::into_index).unwrap();
    // The same bytes described with 63 more leading axes of length 1: a consistent index.
    let deep = |index: &CheckpointIndex, axes: usize| {
        let mut index = index.clone();
        let t = index.tensors.remove(0);
        let mut shape = vec![1u64; axes - 1];
        shape.push(4);
        let chunks = t
            .chunks()
            .iter()
            .map(|c| StoredChunk { offset: vec![0u64; axes].into(), shape: shape.clone().into(), ..c.clone() })
            .collect();
        index.tensors.push(TensorEntry::new(t.key.clone(), t.dtype, shape, chunks));
        index.encode()
    };
    std::fs::write(dir.join(INDEX_FILE), deep(&index, CAP + 1)).unwrap();
    assert_too_many_axes(open(&st).map(|_| ()), INDEX_FILE, "w", CAP + 1);
    assert_too_many_axes(verify(&st, 2), INDEX_FILE, "w", CAP + 1);
    std::fs::write(dir.join(INDEX_FILE), deep(&index, CAP)).unwrap();
    let got = open(&st).and_then(|c| c.read_tensors(None)).unwrap();
    assert_eq!(got["w"].data, vec![7u8; 4]);
}

#[test]
fn saving_a_tensor_of_65_axes_is_refused() {
    // What every reader refuses, the writer refuses up front.
    let dir = TempDir::new("axes-save");
    let st = LocalStorage::new(dir.path());
    let data = vec![7u8; 4];
    let mut shape = vec![1u64; CAP];
    shape.push(4);
    let zeros = vec![0u64; CAP + 1];
    let tree = StateTree::map()
        .with("w", StateTree::Tensor(shard("w", DType::U8, &shape, &zeros, &shape, 0, None, TensorData::Ref(&data))));
    match save(tree, &st, &SoloComm, &SaveOptions::default()) {
        Err(e @ Error::InvalidSharding { .. }) => assert!(e.to_string().contains("65 axes"), "{e}"),
        other => panic!("expected a sharding error, got {other:?}"),
    }
    // The 64-axis version is saved and read back.
    native(&TempDir::new("axes-save-64"), CAP);
}

#[test]
fn dcp_metadata_of_65_axes_is_refused() {
    let dir = TempDir::new("axes-dcp");
    let size = vec![1u64; CAP + 1];
    let item = torch_save_tensor(&size, &size, &[0u8; 4]);
    write_dcp(dir.path(), &[Item::Tensor { fqn: "w", size, data: item, transforms: vec![] }]);
    assert_too_many_axes(open(&LocalStorage::new(dir.path())).map(|_| ()), ".metadata", "w", CAP + 1);
}

#[test]
fn torch_save_record_of_65_axes_is_refused() {
    // The metadata says [1]; the item's own record has 65 axes.
    let dir = TempDir::new("axes-torch-save");
    let deep = vec![1u64; CAP + 1];
    let item = torch_save_tensor(&deep, &deep, &[0u8; 4]);
    write_dcp(dir.path(), &[Item::Tensor { fqn: "w", size: vec![1], data: item, transforms: vec![] }]);
    let r = open(&LocalStorage::new(dir.path())).and_then(|c| c.read_tensors(None));
    assert_too_many_axes(r, "__0_0.distcp", "w", CAP + 1);
}

#[test]
fn zarr_array_of_65_axes_is_refused() {
    let key = "decoder.final_norm.weight";
    let dir = TempDir::new("axes-zarr");
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/foreign/megatron_zarr");
    copy_dir(&fixture, dir.path());
    let dims = |last: u64| {
        let mut d = vec![1u64; CAP];
        d.push(last);
        serde_json::to_string(&d).unwrap()
    };
    let zarray =
        format!(r#"{{"chunks":{},"compressor":null,"dtype":"<f2","shape":{},"zarr_format":2}}"#, dims(6), dims(6));
    std::fs::write(dir.join(key).join(".zarray"), zarray).unwrap();
    assert_too_many_axes(open(&LocalStorage::new(dir.path())).map(|_| ()), ".zarray", key, CAP + 1);
}

#[test]
fn olmo_metadata_of_65_axes_is_refused() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/olmo/olmo01_fsdp_w2");
    let dir = TempDir::new("axes-olmo");
    copy_dir(&src, dir.path());
    let meta = dir.join("model/metadata.json");
    let mut json: serde_json::Value = serde_json::from_slice(&std::fs::read(&meta).unwrap()).unwrap();
    // [64, 32] as 63 axes of 1, then [64, 32]: the same 2048 elements, the same flat specs.
    let mut shape = vec![1u64; CAP - 1];
    shape.extend([64, 32]);
    json["tensors"]["embed.weight"]["shape"] = serde_json::json!(shape);
    std::fs::write(&meta, serde_json::to_vec(&json).unwrap()).unwrap();
    let st = LocalStorage::new(dir.join("model"));
    assert_too_many_axes(open(&st).map(|_| ()), "metadata.json", "embed.weight", CAP + 1);
}

/// LEB128, as the index encodes `var`.
fn var(out: &mut Vec<u8>, mut x: u64) {
    loop {
        let b = (x & 0x7f) as u8;
        x >>= 7;
        if x == 0 {
            out.push(b);
            return;
        }
        out.push(b | 0x80);
    }
}

/// crc32c (Castagnoli), bit by bit: the index's checksum.
fn crc32c(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 { (crc >> 1) ^ 0x82F6_3B78 } else { crc >> 1 };
        }
    }
    !crc
}

/// A version-1 index (FORMAT.md) of `index`'s one file and one tensor, whose chunks name file
/// number `file` in place of their own.
fn v1_index_naming_file(index: &CheckpointIndex, file: u64) -> Vec<u8> {
    let str_ = |out: &mut Vec<u8>, s: &str| {
        var(out, s.len() as u64);
        out.extend_from_slice(s.as_bytes());
    };
    let mut body = Vec::new();
    str_(&mut body, index.backend.name());
    var(&mut body, index.block_size);
    body.push(0); // content_metadata: null
    var(&mut body, 0); // common
    var(&mut body, index.files.len() as u64);
    for f in &index.files {
        str_(&mut body, &f.name);
        var(&mut body, f.size);
        var(&mut body, f.header_len);
        body.extend_from_slice(&f.header_crc.to_le_bytes());
    }
    var(&mut body, index.tensors.len() as u64);
    for t in &index.tensors {
        str_(&mut body, &t.key);
        body.push(DType::ALL.iter().position(|&d| d == t.dtype).unwrap() as u8);
        var(&mut body, t.global_shape.len() as u64);
        t.global_shape.iter().for_each(|&d| var(&mut body, d));
        var(&mut body, t.chunks().len() as u64);
        for c in t.chunks() {
            var(&mut body, file);
            var(&mut body, c.byte_offset);
            c.offset.iter().chain(c.shape.iter()).for_each(|&d| var(&mut body, d));
            assert!(c.flat.is_none());
            body.push(0);
            c.crcs.iter().for_each(|crc| body.extend_from_slice(&crc.to_le_bytes()));
        }
    }
    var(&mut body, 0); // objects
    let mut out = b"TESSERA\0".to_vec();
    out.extend_from_slice(&1u32.to_le_bytes());
    out.extend_from_slice(&(body.len() as u64).to_le_bytes());
    out.extend_from_slice(&body);
    out.extend_from_slice(&crc32c(&body).to_le_bytes());
    out
}

#[test]
fn native_index_naming_file_2_32_is_refused_not_truncated() {
    let dir = TempDir::new("file-number");
    let st = native(&dir, 1);
    let index = open(&st).map(Checkpoint::into_index).unwrap();
    // The builder writes what the saver wrote when it names file 0: that index loads.
    std::fs::write(dir.join(INDEX_FILE), v1_index_naming_file(&index, 0)).unwrap();
    assert_eq!(open(&st).and_then(|c| c.read_tensors(None)).unwrap()["w"].data, vec![7u8; 4]);
    // File 2^32 (and 2^32 + 1, 2^64 - 1) would be file 0 (1) once truncated to 32 bits.
    for file in [1u64 << 32, (1 << 32) + 1, u64::MAX] {
        std::fs::write(dir.join(INDEX_FILE), v1_index_naming_file(&index, file)).unwrap();
        for r in [open(&st).and_then(|c| c.read_tensors(None)).map(|_| ()), verify(&st, 2).map(|_| ())] {
            let (path, reason) = corrupt(r);
            assert!(path.ends_with(INDEX_FILE), "{path}: {reason}");
            assert!(reason.contains("\"w\"") && reason.contains(&format!("file {file}")), "{reason}");
        }
    }
    // A number that fits 32 bits but names no file is the validation gate's (reported by
    // verify, naming the key).
    std::fs::write(dir.join(INDEX_FILE), v1_index_naming_file(&index, 9)).unwrap();
    let (path, reason) = corrupt(open(&st).map(|_| ()));
    assert!(path.ends_with(INDEX_FILE) && reason.contains("\"w\"") && reason.contains("file #9"), "{reason}");
}
