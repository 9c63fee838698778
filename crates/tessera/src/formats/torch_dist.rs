//! Writing PyTorch Distributed Checkpoint directories as Megatron-Core's `torch_dist` backend
//! lays them out (`TorchDistSaveShardedStrategy`, megatron-core 0.16.1): what
//! `torch.distributed.checkpoint.load` and `megatron.core.dist_checkpointing.load` read.
//! (Reading them is `format/dcp.rs` with `io/foreign/dcp.rs`.)
//!
//! - `__{rank}_0.distcp`: the rank's items back to back, each a complete `torch.save` archive —
//!   a tensor chunk (one per main-replica shard, the box Megatron gives it: prepended axes
//!   included, as size 1) or a byte item (a sharded object, `torch.save([obj])`, under
//!   `"{key}/shard_{offsets}_{grid}"`, dot-joined).
//! - `.metadata`: one pickle of `torch.distributed.checkpoint.metadata.Metadata`, rank 0, last:
//!   the commit marker. Keys are Megatron's: a tensor's key is its fqn.
//! - `metadata.json`: Megatron's backend record; `common.pt`: `torch.save` of the common dict.
//!
//! DCP has no block checksums: only the zip CRC-32 of each item's members can detect a flipped
//! bit later (tessera's `verify` and verified loads check them, as torch's zip reader does when
//! it extracts them; every structure and size also passes the one gate).
//!
//! Pure: descriptions in, bytes out.

use crate::error::{Error, Result};
use crate::formats::dcp_values::{assemble, to_pickle, DcpSeg};
use crate::formats::pickle::write::{pickle, Pk};
use crate::formats::torch_save::write::{torch_dtype_name, value_archive, wrap_archive_in_list};
use crate::model::dtype::DType;
use crate::model::{StatePath, Value};

/// DCP's metadata file (the commit marker).
pub const DCP_METADATA: &str = ".metadata";
/// Megatron's backend record.
pub const MEGATRON_METADATA: &str = "metadata.json";
/// Megatron's common state.
pub const MEGATRON_COMMON: &str = "common.pt";
/// The backend record megatron-core 0.16.1 writes for `torch_dist` (`CheckpointingConfig`).
pub const MEGATRON_METADATA_JSON: &str = r#"{"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", "common_backend_version": 1}"#;
/// The `Metadata.version` torch 2.4 – 2.15 write.
const DCP_VERSION: &str = "1.0.0";
const MD: &str = "torch.distributed.checkpoint.metadata";

/// DCP's data file `__{rank}_{k}.distcp`. DCP and Megatron find data files through
/// `.metadata` (each item's `relative_path`), not by name: `k` is free (see the save).
pub fn data_file_name(rank: usize, k: u64) -> String {
    format!("__{rank}_{k}.distcp")
}

/// Whether `name` is a DCP data file (`__{rank}_{k}.distcp`).
pub fn is_data_file_name(name: &str) -> bool {
    parse_data_file_name(name).is_some()
}

/// The rank and file number `k` of a DCP data file's name (`__{rank}_{k}.distcp`); `None` for
/// any other name.
pub fn parse_data_file_name(name: &str) -> Option<(usize, u64)> {
    let (r, k) = name.strip_prefix("__")?.strip_suffix(".distcp")?.split_once('_')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    (digits(r) && digits(k)).then_some(())?;
    Some((r.parse().ok()?, k.parse().ok()?))
}

/// Megatron's name for one shard of a sharded object (`ShardedObject.unique_key`).
pub fn object_fqn(key: &str, offset: &[u64], grid: &[u64]) -> String {
    let dotted = |xs: &[u64]| xs.iter().map(u64::to_string).collect::<Vec<_>>().join(".");
    format!("{key}/shard_{}_{}", dotted(offset), dotted(grid))
}

/// Where an item lies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ItemPlace {
    /// Data file (relative).
    pub file: String,
    /// Offset in it.
    pub offset: u64,
    /// Length.
    pub length: u64,
}

/// One stored chunk of a tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkItem {
    /// Global offset.
    pub offsets: Vec<u64>,
    /// Extent.
    pub sizes: Vec<u64>,
    /// Its item.
    pub place: ItemPlace,
}

/// A tensor of the checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorItems {
    /// Key (fqn).
    pub fqn: String,
    /// Element type.
    pub dtype: DType,
    /// Global shape.
    pub size: Vec<u64>,
    /// Chunks, each stored once.
    pub chunks: Vec<ChunkItem>,
}

fn size(xs: &[u64]) -> Pk {
    Pk::call("torch", "Size", vec![Pk::dims(xs)])
}

fn storage_info(p: &ItemPlace) -> Pk {
    Pk::object(
        "torch.distributed.checkpoint.filesystem",
        "_StorageInfo",
        Pk::fields(vec![
            ("relative_path", Pk::Str(p.file.clone())),
            ("offset", Pk::Int(p.offset as i64)),
            ("length", Pk::Int(p.length as i64)),
        ]),
    )
}

fn metadata_index(fqn: &str, offset: Option<&[u64]>) -> Pk {
    Pk::object(
        MD,
        "MetadataIndex",
        Pk::fields(vec![("fqn", Pk::str(fqn)), ("offset", offset.map_or(Pk::None, size)), ("index", Pk::None)]),
    )
}

/// `TensorProperties` with the 5-item tuple state both torch 2.10 (exactly 5) and torch 2.15
/// (5, or 6 with strides) accept: dtype, layout, requires_grad, memory format, pin_memory.
fn tensor_properties(dtype: DType) -> Pk {
    Pk::Obj {
        class: Box::new(Pk::global(MD, "TensorProperties")),
        args: Vec::new(),
        state: Some(Box::new(Pk::Tuple(vec![
            Pk::global("torch", torch_dtype_name(dtype)),
            Pk::call("torch.serialization", "_get_layout", vec![Pk::str("torch.strided")]),
            Pk::Bool(false),
            // _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT
            Pk::call(MD, "_MEM_FORMAT_ENCODING", vec![Pk::Int(0)]),
            Pk::Bool(false),
        ]))),
    }
}

/// The `.metadata` pickle (protocol 4, as `pickle.dump` writes it) of a checkpoint holding
/// `tensors` and the byte items `bytes` (fqn, place). `planner` is its `planner_data`: each
/// key's path in the state dict, as DCP's own save records it (`None`: none, as Megatron's
/// decentralised plan leaves it). `save_id` names the save.
pub fn metadata_pickle(
    tensors: &[TensorItems],
    bytes: &[(String, ItemPlace)],
    planner: Option<&[(String, Vec<DcpSeg>)]>,
    save_id: &str,
) -> Vec<u8> {
    let mut sdm = Vec::with_capacity(tensors.len() + bytes.len());
    let mut storage = Vec::new();
    for t in tensors {
        let chunks = t
            .chunks
            .iter()
            .map(|c| {
                storage.push((metadata_index(&t.fqn, Some(&c.offsets)), storage_info(&c.place)));
                Pk::object(
                    MD,
                    "ChunkStorageMetadata",
                    Pk::fields(vec![("offsets", size(&c.offsets)), ("sizes", size(&c.sizes))]),
                )
            })
            .collect();
        let meta = Pk::object(
            MD,
            "TensorStorageMetadata",
            Pk::fields(vec![
                ("properties", tensor_properties(t.dtype)),
                ("size", size(&t.size)),
                ("chunks", Pk::List(chunks)),
            ]),
        );
        sdm.push((Pk::Str(t.fqn.clone()), meta));
    }
    for (fqn, place) in bytes {
        sdm.push((Pk::Str(fqn.clone()), Pk::object(MD, "BytesStorageMetadata", Pk::Dict(Vec::new()))));
        storage.push((metadata_index(fqn, None), storage_info(place)));
    }
    let storage_meta = Pk::object(
        MD,
        "StorageMeta",
        Pk::fields(vec![
            ("checkpoint_id", Pk::None),
            ("save_id", Pk::str(save_id)),
            ("load_id", Pk::None),
            ("modules", Pk::List(Vec::new())),
        ]),
    );
    let root = Pk::object(
        MD,
        "Metadata",
        Pk::fields(vec![
            ("state_dict_metadata", Pk::Dict(sdm)),
            ("planner_data", planner.map_or(Pk::None, planner_data)),
            ("storage_data", Pk::Dict(storage)),
            ("storage_meta", storage_meta),
            ("version", Pk::str(DCP_VERSION)),
        ]),
    );
    pickle(&root, 4)
}

/// `planner_data`: a dict of each key's path, a tuple of dict keys (strings) and list indices.
fn planner_data(paths: &[(String, Vec<DcpSeg>)]) -> Pk {
    let seg = |s: &DcpSeg| match s {
        DcpSeg::Key(k) => Pk::Str(k.clone()),
        DcpSeg::Index(i) => Pk::Int(*i as i64),
    };
    Pk::Dict(paths.iter().map(|(k, path)| (Pk::Str(k.clone()), Pk::Tuple(path.iter().map(seg).collect()))).collect())
}

/// The `storage_meta.save_id` tessera writes into a `.metadata`: the save's id, and the
/// crc32c of the `common.pt` that the save commits beside it (torch reads the field as an
/// opaque string). `common.pt` is put before `.metadata`, by fixed names Megatron reads: a
/// crash between the two puts of an overwrite pairs the old `.metadata` with the new
/// `common.pt`, which tessera's reader then tells from this checksum.
pub fn metadata_save_id(save_id: u64, common: &[u8]) -> String {
    format!("{save_id:016x}-common-{:08x}", crate::model::crc::crc32c(common))
}

/// The copy of save `save_id`'s `common.pt`, which tessera keeps beside the checkpoint that
/// commits it: a reader finds the committed common state there when `common.pt` already holds
/// an interrupted overwrite's (see [`metadata_save_id`]). Hidden; readers of other programs
/// ignore it.
pub fn common_copy_name(save_id: u64) -> String {
    format!(".tessera-common-{save_id:016x}.pt")
}

/// The save id a [`common_copy_name`] carries; `None` for any other name.
pub fn parse_common_copy_name(name: &str) -> Option<u64> {
    let hex = name.strip_prefix(".tessera-common-")?.strip_suffix(".pt")?;
    (hex.len() == 16 && hex.bytes().all(|b| b.is_ascii_hexdigit())).then(|| u64::from_str_radix(hex, 16).ok())?
}

/// The save id and the crc32c of `common.pt` that a [`metadata_save_id`] records; `None` for any
/// other save id (torch's, Megatron's).
pub fn committed_common(save_id: &str) -> Option<(u64, u32)> {
    let (id, crc) = save_id.split_once("-common-")?;
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
    if !(hex(id, 16) && hex(crc, 8)) {
        return None;
    }
    Some((u64::from_str_radix(id, 16).ok()?, u32::from_str_radix(crc, 16).ok()?))
}

/// Prefix of an object payload that is a plain value in tessera's value encoding.
pub const OBJECT_TAG_VALUE: &[u8; 4] = b"TSV1";
/// Prefix of an object payload that is the `torch.save` bytes of the object.
pub const OBJECT_TAG_TORCH: &[u8; 4] = b"TPT1";
/// Prefix of an object payload that is the `torch.save` bytes of a one-element list holding the
/// object (how Megatron `torch_dist` stores sharded objects).
pub const OBJECT_TAG_TORCH_LIST: &[u8; 4] = b"TPL1";

/// The byte item Megatron stores for a sharded object: `torch.save([obj])`. The payload says
/// what `obj` is (the encodings tessera's Python layer writes): `TSV1` + a plain value,
/// `TPL1` + `torch.save([obj])` (stored as is, once checked), `TPT1` + `torch.save(obj)`
/// (wrapped in a list); any other payload is stored as Python `bytes`.
pub fn object_item(key: &str, payload: &[u8], serialization_id: &str) -> Result<Vec<u8>> {
    let bad = |e: String| Error::invalid(format!("object {key:?}: {e}"));
    let (tag, body) = payload.split_at(payload.len().min(4));
    if tag == OBJECT_TAG_VALUE {
        let v = Value::from_bytes(body).map_err(|e| bad(e.to_string()))?;
        value_archive(&Pk::List(vec![Pk::from(&v)]), serialization_id)
    } else if tag == OBJECT_TAG_TORCH_LIST {
        match crate::formats::torch_save::decode_archive(body, key) {
            Ok(crate::formats::pickle::PickleValue::List(xs)) if xs.len() == 1 => Ok(body.to_vec()),
            Ok(_) => Err(bad("the torch.save payload tagged TPL1 is not a one-element list".into())),
            Err(e) => Err(bad(format!("the torch.save payload tagged TPL1 does not read: {e}"))),
        }
    } else if tag == OBJECT_TAG_TORCH {
        wrap_archive_in_list(body, serialization_id).map_err(|e| bad(format!("torch.save payload: {e}")))
    } else {
        value_archive(&Pk::List(vec![Pk::Bytes(payload.to_vec())]), serialization_id)
    }
}

pub use crate::formats::dcp_values::TORCH_SAVE_KEY;
/// Prefix of a path segment that stands for an integer dict key (`"\0int:3"` for the key `3`
/// of an optimizer's `state`): the data model's map keys are strings, and a list index is
/// another thing than an integer key.
pub const INT_KEY_PREFIX: &str = "\0int:";

/// `common.pt`: `torch.save` of the dict the common values make (each at its path: keys make
/// dicts, indices lists). A value tessera holds only as `torch.save` bytes (a Python object
/// that is not plain data) goes in as that object; one holding tensors cannot, and is refused
/// naming it.
pub fn common_pt(common: &[(StatePath, Value)], serialization_id: &str) -> Result<Vec<u8>> {
    let root = assemble(common)?;
    let Value::Map(top) = &root else { unreachable!("the root is a dict") };
    let mut items = Vec::with_capacity(top.len());
    for (k, v) in top {
        items.push((Pk::Str(k.clone()), to_pickle(v, k)?));
    }
    value_archive(&Pk::Dict(items), serialization_id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::dcp::metadata::parse_metadata;
    use crate::formats::pickle::{unpickle_view, PickleValue, UnpickleLimits};
    use crate::formats::torch_save::decode_archive;
    use crate::model::PathSeg;

    #[test]
    fn metadata_reads_back() {
        let place = |o| ItemPlace { file: "__0_0.distcp".into(), offset: o, length: 10 };
        let tensors = vec![TensorItems {
            fqn: "a.w".into(),
            dtype: DType::BF16,
            size: vec![4, 2],
            chunks: vec![
                ChunkItem { offsets: vec![0, 0], sizes: vec![2, 2], place: place(0) },
                ChunkItem { offsets: vec![2, 0], sizes: vec![2, 2], place: place(10) },
            ],
        }];
        let bytes = vec![(object_fqn("rng", &[1], &[2]), place(20))];
        let pkl = metadata_pickle(&tensors, &bytes, None, "id");
        let meta = parse_metadata(unpickle_view(&pkl, "m", &UnpickleLimits::default()).unwrap().root()).unwrap();
        assert_eq!(meta.tensors.len(), 1);
        let t = &meta.tensors[0];
        assert_eq!((t.fqn.as_str(), t.dtype, t.size.clone()), ("a.w", DType::BF16, vec![4, 2]));
        assert_eq!(t.chunks[1].offsets, vec![2, 0]);
        assert_eq!(t.chunks[1].location.offset, 10);
        assert_eq!(meta.bytes.len(), 1);
        assert_eq!(meta.bytes[0].fqn, "rng/shard_1_2");
        assert_eq!(meta.bytes[0].location.offset, 20);
    }

    #[test]
    fn names() {
        assert_eq!(object_fqn("a/b", &[0, 3], &[1, 4]), "a/b/shard_0.3_1.4");
        assert!(is_data_file_name("__12_0.distcp"));
        assert!(!is_data_file_name("__x_0.distcp") && !is_data_file_name("__1.distcp"));
    }

    #[test]
    fn object_payloads() {
        let plain = [OBJECT_TAG_VALUE.as_slice(), &Value::Int(7).to_bytes()].concat();
        let item = object_item("o", &plain, "1").unwrap();
        assert_eq!(decode_archive(&item, "o").unwrap(), PickleValue::List(vec![PickleValue::Int(7)]));
        let list = [OBJECT_TAG_TORCH_LIST.as_slice(), &item].concat();
        assert_eq!(object_item("o", &list, "1").unwrap(), item);
        let single = value_archive(&Pk::Int(7), "1").unwrap();
        let wrapped = object_item("o", &[OBJECT_TAG_TORCH.as_slice(), &single].concat(), "1").unwrap();
        assert_eq!(decode_archive(&wrapped, "o").unwrap(), PickleValue::List(vec![PickleValue::Int(7)]));
        let raw = object_item("o", b"xy", "1").unwrap();
        assert_eq!(decode_archive(&raw, "o").unwrap(), PickleValue::List(vec![PickleValue::Bytes(b"xy".to_vec())]));
        assert!(object_item("o", &[OBJECT_TAG_TORCH_LIST.as_slice(), &single].concat(), "1").is_err());
    }

    #[test]
    fn common_dict() {
        let k = |s: &str| PathSeg::Key(s.into());
        let common = vec![
            (vec![k("iteration")], Value::Int(3)),
            (vec![k("args"), k("lr")], Value::Float(0.5)),
            (vec![k("list"), PathSeg::Index(1)], Value::Str("b".into())),
            (vec![k("list"), PathSeg::Index(0)], Value::Str("a".into())),
        ];
        let back = decode_archive(&common_pt(&common, "1").unwrap(), "c").unwrap().to_plain().unwrap();
        let expected = Value::Map(vec![
            ("iteration".into(), Value::Int(3)),
            ("args".into(), Value::Map(vec![("lr".into(), Value::Float(0.5))])),
            ("list".into(), Value::List(vec![Value::Str("a".into()), Value::Str("b".into())])),
        ]);
        assert_eq!(back, expected);
        // A value held as torch.save bytes goes in as its object; one holding tensors, or bytes
        // that do not read, are refused naming it.
        let tuple = value_archive(&Pk::Tuple(vec![Pk::Int(1), Pk::Str("x".into())]), "2").unwrap();
        let blob = |b: Vec<u8>| Value::Map(vec![(TORCH_SAVE_KEY.into(), Value::Bytes(b))]);
        let back = decode_archive(&common_pt(&[(vec![k("args"), k("t")], blob(tuple))], "1").unwrap(), "c").unwrap();
        let t = PickleValue::Tuple(vec![PickleValue::Int(1), PickleValue::Str("x".into())]);
        let args = PickleValue::Dict(vec![(PickleValue::Str("t".into()), t)]);
        assert_eq!(back, PickleValue::Dict(vec![(PickleValue::Str("args".into()), args)]));
        let err = common_pt(&[(vec![k("opaque")], blob(vec![1]))], "1").unwrap_err().to_string();
        assert!(err.contains("opaque"), "{err}");
        let data = [1u8, 0, 0, 0];
        let t = crate::formats::torch_save::write::tensor_archive(DType::I32, &[1], 0, "3");
        let tensor = [t.prefix.as_slice(), &data, &t.suffix].concat();
        let err = common_pt(&[(vec![k("holds"), PathSeg::Index(2)], blob(tensor))], "1").unwrap_err().to_string();
        assert!(err.contains("\"holds.2\"") && err.contains("tensors"), "{err}");
        assert_eq!(decode_archive(&common_pt(&[], "1").unwrap(), "c").unwrap(), PickleValue::Dict(vec![]));
    }
}
