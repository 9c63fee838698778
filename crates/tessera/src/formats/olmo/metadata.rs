//! OLMo-core 0.1.x's own checkpoint format (`olmo_core.distributed.checkpoint.Checkpointer`).
//!
//! A checkpoint directory holds one `rank_{r}.safetensors` per rank and `metadata.json`, written
//! by rank 0 last. The metadata maps each tensor key to `{shape, is_sharded, dtype,
//! shard_spec_per_file: {file: spec}}`; a spec is either `flattened_offsets` (ranges
//! `[start, end)` of the tensor's row-major flattening, stored one after another in the file as
//! a single 1-D tensor under the key) or `local_shape` + `global_offset` (a box, as a DTensor
//! shard, stored flattened too). A rank holding none of a tensor is listed with `[[0, 0]]` and
//! its file may lack the key. `save_model_and_optim_state` writes two such directories,
//! `model/` and `optim/`; the optimizer's param groups and state-key list are pickles stored as
//! uint8 tensors (`param_group{i}`, `state_keys`).
//!
//! Everything here is pure: metadata and header bytes in, an index (or metadata) out. The
//! metadata is checked completely on parsing (checked arithmetic, every spec inside its
//! tensor); [`build_tensors`] checks every file entry against the real file and that the specs
//! tile each tensor exactly (identical specs in several files are replicas, read once).
//!
//! tessera writes the same files; each rank file then also carries block checksums in its
//! safetensors `__metadata__` (key [`CRC_METADATA_KEY`]), which OLMo-core ignores.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use serde_json::{json, Map, Value as J};

use crate::error::{Error, Result};
use crate::format::{
    build_header, Crcs, SafetensorsEntry, SafetensorsHeader, StoredChunk, TensorEntry, SAFETENSORS_ALIGN,
};
use crate::model::dims::{check_axes, Dims};
use crate::model::dtype::DType;
use crate::model::Value;
use crate::plan::save::RankPlan;

/// Name of the metadata file of an OLMo-core checkpoint directory.
pub const METADATA_FILE: &str = "metadata.json";
/// Backend name tessera records for OLMo-core 0.1.x checkpoints.
pub const BACKEND: &str = "olmo_safetensors";
/// The folders `save_model_and_optim_state` writes, each a checkpoint directory of its own.
pub const PARTS: [&str; 2] = ["model", "optim"];
/// Key, in a rank file's safetensors `__metadata__`, of the block checksums tessera adds.
pub const CRC_METADATA_KEY: &str = "tessera.olmo.crc32c";

/// Where one file's shard of a tensor lies in the tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShardSpec {
    /// Ranges of the row-major flattening, stored back to back.
    Flat(Vec<(u64, u64)>),
    /// A box (stored in row-major order).
    Box {
        /// Extent per axis.
        local_shape: Vec<u64>,
        /// Start per axis.
        global_offset: Vec<u64>,
    },
}

impl ShardSpec {
    /// Elements the file holds (checked when parsed).
    pub fn numel(&self) -> u64 {
        match self {
            ShardSpec::Flat(r) => r.iter().map(|(s, e)| e - s).sum(),
            ShardSpec::Box { local_shape, .. } => local_shape.iter().product(),
        }
    }
}

/// One tensor of the metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorMeta {
    /// Full shape.
    pub shape: Vec<u64>,
    /// Whether the writer held the tensor sharded.
    pub is_sharded: bool,
    /// Element type.
    pub dtype: DType,
    /// File name (relative to the directory) → the shard it holds (file-name order when parsed).
    pub files: Vec<(String, ShardSpec)>,
}

/// The whole `metadata.json` (tensors in key order, as parsed; the writer keeps its own order).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StorageMetadata {
    /// Key → tensor.
    pub tensors: Vec<(String, TensorMeta)>,
    /// What tessera records of the save that wrote it (OLMo-core ignores the field).
    pub save: Option<SaveMark>,
}

/// The save that wrote a `metadata.json`, as tessera records it under [`SAVE_KEY`]: a save of
/// several directories at once (`model/` and `optim/`) marks each with its id, so that a reader
/// tells a pair committed by one save from one that an interrupted save left mixed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SaveMark {
    /// The save's id.
    pub id: u64,
    /// Directories the save wrote together.
    pub dirs: u32,
}

/// The key of [`SaveMark`] in `metadata.json`, after `tensors` (OLMo-core's pydantic model
/// ignores keys it does not know).
pub const SAVE_KEY: &str = "tessera_save";

/// The name of rank `rank`'s data file in save `save_id`: OLMo-core's own name
/// (`rank_{rank}.safetensors`) for save id 0, which a save into a directory without rank files
/// takes; `rank_{rank}-{save_id:016x}.safetensors` otherwise, so that a save never writes into a
/// file the committed checkpoint uses (OLMo-core reads the files its `metadata.json` names).
pub fn rank_file_name(rank: usize, save_id: u64) -> String {
    match save_id {
        0 => format!("rank_{rank}.safetensors"),
        id => format!("rank_{rank}-{id:016x}.safetensors"),
    }
}

/// The rank and save id (0 for OLMo-core's own name) of a rank file's name; `None` for any
/// other name.
pub fn parse_rank_file_name(name: &str) -> Option<(usize, u64)> {
    let stem = name.strip_prefix("rank_")?.strip_suffix(".safetensors")?;
    let (rank, id) = match stem.split_once('-') {
        Some((r, id)) if id.len() == 16 && id.bytes().all(|b| b.is_ascii_hexdigit()) => {
            (r, u64::from_str_radix(id, 16).ok()?)
        }
        Some(_) => return None,
        None => (stem, 0),
    };
    if rank.is_empty() || !rank.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((rank.parse().ok()?, id))
}

/// Whether `head`, the start of a `metadata.json` (`complete` when it is the whole file), is
/// OLMo-core's: an object whose key is `tensors` (Megatron's has `sharded_backend`). A prefix
/// of a large file is recognised by its first key, which OLMo-core always writes first.
pub fn is_olmo_metadata(head: &[u8], complete: bool) -> bool {
    if complete {
        return match serde_json::from_slice::<J>(head) {
            Ok(J::Object(m)) => m.get("tensors").is_some_and(J::is_object) && !m.contains_key("sharded_backend"),
            _ => false,
        };
    }
    let rest = head.trim_ascii_start();
    rest.first() == Some(&b'{') && rest[1..].trim_ascii_start().starts_with(b"\"tensors\"")
}

fn uint(v: &J, what: &str) -> std::result::Result<u64, String> {
    v.as_u64().ok_or_else(|| format!("{what} is {v}, not a non-negative integer"))
}

fn dims(v: &J, what: &str) -> std::result::Result<Vec<u64>, String> {
    let xs = v.as_array().ok_or_else(|| format!("{what} is {v}, not a list"))?;
    xs.iter().enumerate().map(|(i, x)| uint(x, &format!("{what}[{i}]"))).collect()
}

/// A tensor's shape: [`dims`] of at most [`MAX_AXES`](crate::model::dims::MAX_AXES) axes,
/// counted before the numbers are read.
fn shape_dims(v: &J, what: &str) -> std::result::Result<Vec<u64>, String> {
    if let Some(xs) = v.as_array() {
        check_axes(xs.len()).map_err(|e| format!("{what} has {e}"))?;
    }
    dims(v, what)
}

/// `[[s, e], …]` (or the legacy single `[s, e]`) checked against a tensor of `numel` elements.
fn ranges(v: &J, numel: u64, what: &str) -> std::result::Result<Vec<(u64, u64)>, String> {
    let xs = v.as_array().ok_or_else(|| format!("{what} is {v}, not a list of [start, end] pairs"))?;
    let pairs: Vec<&J> = if xs.len() == 2 && xs.iter().all(J::is_number) { vec![v] } else { xs.iter().collect() };
    pairs
        .into_iter()
        .enumerate()
        .map(|(i, p)| {
            let r = dims(p, &format!("{what}[{i}]"))?;
            match r[..] {
                [s, e] if s <= e && e <= numel => Ok((s, e)),
                [s, e] => Err(format!("{what}[{i}] = [{s}, {e}] is not a range inside the tensor's {numel} elements")),
                _ => Err(format!("{what}[{i}] has {} numbers, not [start, end]", r.len())),
            }
        })
        .collect()
}

fn spec_of(v: &J, shape: &[u64], numel: u64) -> std::result::Result<ShardSpec, String> {
    let field = |name: &str| v.get(name).filter(|x| !x.is_null());
    if !v.is_object() {
        return Err(format!("spec is {v}, not an object"));
    }
    if let Some(r) = field("flattened_offsets") {
        let r = ranges(r, numel, "flattened_offsets")?;
        checked_numel(&r)?;
        return Ok(ShardSpec::Flat(r));
    }
    match (field("local_shape"), field("global_offset")) {
        (Some(ls), Some(go)) => {
            let (local_shape, global_offset) = (dims(ls, "local_shape")?, dims(go, "global_offset")?);
            if local_shape.len() != shape.len() || global_offset.len() != shape.len() {
                return Err(format!(
                    "local_shape {local_shape:?} / global_offset {global_offset:?} do not have the tensor's {} axes",
                    shape.len()
                ));
            }
            let inside = (0..shape.len())
                .all(|i| global_offset[i].checked_add(local_shape[i]).is_some_and(|end| end <= shape[i]));
            if !inside {
                return Err(format!(
                    "box at {global_offset:?} of shape {local_shape:?} is outside the tensor's shape {shape:?}"
                ));
            }
            Ok(ShardSpec::Box { local_shape, global_offset })
        }
        _ => Err("spec has neither flattened_offsets nor local_shape + global_offset".into()),
    }
}

/// The dtype OLMo-core (and safetensors) spell `name`, exactly (`F32`, `BF16`, …).
fn olmo_dtype(name: &str) -> std::result::Result<DType, String> {
    crate::model::dtype::ALL_DTYPES
        .into_iter()
        .find(|d| d.safetensors_name() == name)
        .ok_or(format!("unknown dtype {name:?}"))
}

/// The ranges' element count, which must fit 64 bits (every later sum relies on it).
fn checked_numel(r: &[(u64, u64)]) -> std::result::Result<u64, String> {
    r.iter()
        .try_fold(0u64, |a, (s, e)| a.checked_add(e - s))
        .ok_or("flattened offsets hold more elements than a 64-bit count".into())
}

fn tensor_of(v: &J) -> std::result::Result<TensorMeta, String> {
    let shape = shape_dims(v.get("shape").ok_or("no shape")?, "shape")?;
    let numel = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d)).ok_or(format!("shape {shape:?} overflows"))?;
    let is_sharded = v.get("is_sharded").and_then(J::as_bool).ok_or("no is_sharded boolean")?;
    let dtype_name = v.get("dtype").and_then(J::as_str).ok_or("no dtype string")?;
    let dtype = olmo_dtype(dtype_name)?;
    numel.checked_mul(dtype.size() as u64).ok_or(format!("shape {shape:?} of {dtype_name} overflows in bytes"))?;
    let mut files = Vec::new();
    if let Some(specs) = v.get("shard_spec_per_file") {
        let specs = specs.as_object().ok_or("shard_spec_per_file is not an object")?;
        for (file, s) in specs {
            files.push((file.clone(), spec_of(s, &shape, numel).map_err(|e| format!("file {file:?}: {e}"))?));
        }
    } else if let Some(per_file) = v.get("flattened_offsets_per_file") {
        // The layout before shard specs (OLMo-core < 0.1): file → ranges.
        let per_file = per_file.as_object().ok_or("flattened_offsets_per_file is not an object")?;
        for (file, r) in per_file {
            let r = ranges(r, numel, "flattened offsets").map_err(|e| format!("file {file:?}: {e}"))?;
            checked_numel(&r).map_err(|e| format!("file {file:?}: {e}"))?;
            files.push((file.clone(), ShardSpec::Flat(r)));
        }
    } else {
        return Err("no shard_spec_per_file".into());
    }
    for (file, _) in &files {
        crate::storage::names::check_file_name(file)?;
    }
    Ok(TensorMeta { shape, is_sharded, dtype, files })
}

/// Parses and checks a `metadata.json` (`shown` names it in errors).
pub fn parse_metadata(bytes: &[u8], shown: &str) -> Result<StorageMetadata> {
    let root: J = serde_json::from_slice(bytes).map_err(|e| Error::corrupt(shown, format!("not JSON: {e}")))?;
    let tensors =
        root.get("tensors").and_then(J::as_object).ok_or_else(|| Error::corrupt(shown, "no \"tensors\" object"))?;
    let mut out = Vec::with_capacity(tensors.len());
    for (key, v) in tensors {
        let t = tensor_of(v).map_err(|e| Error::corrupt(shown, format!("tensor {key:?}: {e}")))?;
        out.push((key.clone(), t));
    }
    let save = match root.get(SAVE_KEY) {
        None => None,
        Some(v) => {
            let id =
                v.get("id").and_then(J::as_str).filter(|s| s.len() == 16).and_then(|s| u64::from_str_radix(s, 16).ok());
            let dirs = v.get("dirs").and_then(J::as_u64).and_then(|d| u32::try_from(d).ok());
            match (id, dirs) {
                (Some(id), Some(dirs)) => Some(SaveMark { id, dirs }),
                _ => return Err(Error::corrupt(shown, format!("{SAVE_KEY} is {v}, not {{\"id\", \"dirs\"}}"))),
            }
        }
    };
    Ok(StorageMetadata { tensors: out, save })
}

/// Python's `json.dumps` of a string (`ensure_ascii`: every character outside printable ASCII
/// escaped), so that the files tessera writes read exactly like OLMo-core's.
fn py_str(s: &str, out: &mut String) {
    use std::fmt::Write;
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            ' '..='~' => out.push(c),
            _ => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{u:04x}");
                }
            }
        }
    }
    out.push('"');
}

fn py_list(xs: impl IntoIterator<Item = String>, out: &mut String) {
    out.push('[');
    for (i, x) in xs.into_iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        out.push_str(&x);
    }
    out.push(']');
}

fn py_dims(d: &[u64]) -> String {
    let mut s = String::new();
    py_list(d.iter().map(u64::to_string), &mut s);
    s
}

/// The text of `metadata.json` as OLMo-core writes it (`json.dump` of the pydantic model:
/// `", "` and `": "` separators, ASCII only, unset spec fields as `null`).
pub fn metadata_json(meta: &StorageMetadata) -> String {
    let mut out = String::from("{\"tensors\": {");
    for (i, (key, t)) in meta.tensors.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        py_str(key, &mut out);
        out.push_str(": {\"shape\": ");
        out.push_str(&py_dims(&t.shape));
        out.push_str(&format!(", \"is_sharded\": {}, \"dtype\": ", if t.is_sharded { "true" } else { "false" }));
        py_str(t.dtype.safetensors_name(), &mut out);
        out.push_str(", \"shard_spec_per_file\": {");
        for (j, (file, spec)) in t.files.iter().enumerate() {
            if j > 0 {
                out.push_str(", ");
            }
            py_str(file, &mut out);
            out.push_str(": {\"flattened_offsets\": ");
            match spec {
                ShardSpec::Flat(r) => {
                    py_list(r.iter().map(|(s, e)| format!("[{s}, {e}]")), &mut out);
                    out.push_str(", \"local_shape\": null, \"global_offset\": null}");
                }
                ShardSpec::Box { local_shape, global_offset } => {
                    out.push_str(&format!(
                        "null, \"local_shape\": {}, \"global_offset\": {}}}",
                        py_dims(local_shape),
                        py_dims(global_offset)
                    ));
                }
            }
        }
        out.push_str("}}");
    }
    out.push('}');
    if let Some(m) = &meta.save {
        out.push_str(&format!(", \"{SAVE_KEY}\": {{\"id\": \"{:016x}\", \"dirs\": {}}}", m.id, m.dirs));
    }
    out.push('}');
    out
}

/// tessera's block checksums of a rank file: block size, and per key one list of block
/// checksums per stored range (in spec order).
pub type FileCrcs = (u64, HashMap<String, Vec<Vec<u32>>>);

/// tessera's block checksums in a rank file's header (`None`: OLMo-core wrote the file), from
/// its `__metadata__`.
pub fn file_crcs(header: &SafetensorsHeader, shown: &str) -> Result<Option<FileCrcs>> {
    let Some(text) = header.metadata.get(CRC_METADATA_KEY) else { return Ok(None) };
    let text = text.as_str().ok_or_else(|| Error::corrupt(shown, format!("{CRC_METADATA_KEY} is not a string")))?;
    parse_crcs(text).map(Some).map_err(|e| Error::corrupt(shown, format!("{CRC_METADATA_KEY}: {e}")))
}

fn parse_crcs(text: &str) -> std::result::Result<FileCrcs, String> {
    let v: J = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    let block = v.get("block_size").and_then(J::as_u64).filter(|&b| b > 0).ok_or("no positive block_size")?;
    let tensors = v.get("tensors").and_then(J::as_object).ok_or("no tensors object")?;
    let mut out = HashMap::with_capacity(tensors.len());
    for (key, lists) in tensors {
        let lists = lists.as_array().ok_or_else(|| format!("{key:?}: not a list"))?;
        let parsed = lists
            .iter()
            .map(|l| {
                let s = l.as_str().ok_or_else(|| format!("{key:?}: not a string of checksums"))?;
                s.split(',')
                    .filter(|x| !x.is_empty())
                    .map(|x| u32::from_str_radix(x, 16).map_err(|_| format!("{key:?}: bad checksum {x:?}")))
                    .collect::<std::result::Result<Vec<u32>, String>>()
            })
            .collect::<std::result::Result<Vec<_>, String>>()?;
        out.insert(key.clone(), parsed);
    }
    Ok((block, out))
}

/// The `__metadata__` entry carrying the block checksums of a rank file: per key, one list of
/// checksums per stored range. Checksums are fixed-width hex, so its length does not depend on
/// their values (the header is laid out before the data is written).
pub fn crc_metadata(block_size: u64, per_key: &[(&str, Vec<Vec<u32>>)]) -> Map<String, J> {
    let tensors: Map<String, J> = per_key
        .iter()
        .map(|(k, lists)| {
            (k.to_string(), J::Array(lists.iter().map(|l| J::String(crate::format::crc_hex(l))).collect()))
        })
        .collect();
    let text = json!({ "block_size": block_size, "tensors": tensors }).to_string();
    let mut m = Map::new();
    m.insert(CRC_METADATA_KEY.into(), J::String(text));
    m
}

/// Largest pickled optimizer field decoded (OLMo-core's are a few kilobytes).
pub const MAX_PICKLED_FIELD: u64 = 64 << 20;

/// The value of one of OLMo-core's pickled optimizer fields (`param_group{i}`, `state_keys`:
/// `pickle.dumps` bytes stored as a uint8 tensor), decoded by the restricted unpickler, which
/// never executes anything: plain when it is (tuples become lists), else its lossy rendering.
pub fn decode_pickled(bytes: &[u8], shown: &str) -> Result<Value> {
    let v = crate::formats::pickle::unpickle(bytes, shown, &crate::formats::torch_save::limits())?;
    Ok(v.to_plain().unwrap_or_else(|| v.to_value_lossy()))
}

/// Where a stored range lies in its tensor: box offset, box shape, flat range of the box.
type Placement = (Vec<u64>, Vec<u64>, Option<(u64, u64)>);

/// A file the metadata names, as the index knows it.
pub struct IndexedFile<'a> {
    /// Position in the index's file list.
    pub id: u32,
    /// Its checked header.
    pub header: &'a SafetensorsHeader,
    /// tessera's block checksums in it, if any.
    pub crcs: Option<&'a FileCrcs>,
    /// Its location, for errors.
    pub shown: String,
}

/// The tensors of one checkpoint directory as index entries, keys prefixed with `prefix`
/// (`""`, `"model/"`, `"optim/"`). `file(name)` finds a file the metadata names (`None`:
/// it does not exist); `shown` names the metadata in errors. Each chunk carries the file's
/// checksums when tessera wrote it (`crcs` empty otherwise); the caller keeps them only when
/// every chunk has them with one block size. That is the second result: `None` when there are
/// no chunks, `Some(Some(block size))` when every chunk has checksums of that block size,
/// `Some(None)` otherwise.
pub fn build_tensors<'a>(
    prefix: &str,
    meta: &StorageMetadata,
    shown: &str,
    file: &dyn Fn(&str) -> Option<IndexedFile<'a>>,
) -> Result<(Vec<TensorEntry>, Option<Option<u64>>)> {
    let mut out = Vec::with_capacity(meta.tensors.len());
    // None before the first chunk; then Some(Some(block size)) while every chunk carries
    // checksums of that block size, Some(None) once one does not.
    let mut block: Option<Option<u64>> = None;
    for (key, t) in &meta.tensors {
        let esize = t.dtype.size() as u64;
        let numel: u64 = t.shape.iter().product();
        let mut chunks: Vec<StoredChunk> = Vec::new();
        let mut seen: BTreeSet<Placement> = BTreeSet::new();
        for (name, spec) in &t.files {
            let local = spec.numel();
            if local == 0 {
                // OLMo-core lists ranks holding nothing ([[0, 0]]) and may omit the key there.
                continue;
            }
            let f = file(name).ok_or_else(|| {
                Error::corrupt(shown, format!("tensor {key:?}: file {name:?} is listed but does not exist"))
            })?;
            let entry = f.header.tensors.get(key).ok_or_else(|| {
                Error::corrupt(&f.shown, format!("no tensor {key:?}, which {METADATA_FILE} puts {local} elements in"))
            })?;
            if entry.dtype != t.dtype || entry.numel != local {
                return Err(Error::corrupt(
                    &f.shown,
                    format!(
                        "tensor {key:?} holds {} {} elements; {METADATA_FILE} says {local} {}",
                        entry.numel,
                        entry.dtype.safetensors_name(),
                        t.dtype.safetensors_name()
                    ),
                ));
            }
            let file_crcs = f.crcs.and_then(|(bs, m)| m.get(key).map(|l| (*bs, l)));
            // (placement, first element in the file's data for the key)
            let pieces: Vec<(Placement, u64)> = match spec {
                ShardSpec::Flat(ranges) => {
                    let mut at = 0;
                    let mut v = Vec::new();
                    for &(s, e) in ranges {
                        if s < e {
                            let flat = (s, e) != (0, numel);
                            v.push(((vec![0; t.shape.len()], t.shape.clone(), flat.then_some((s, e))), at));
                        }
                        at += e - s;
                    }
                    v
                }
                ShardSpec::Box { local_shape, global_offset } => {
                    vec![((global_offset.clone(), local_shape.clone(), None), 0)]
                }
            };
            if let Some((_, lists)) = file_crcs {
                if lists.len() != pieces.len() {
                    return Err(Error::corrupt(
                        &f.shown,
                        format!("tensor {key:?}: {} checksum lists for {} stored ranges", lists.len(), pieces.len()),
                    ));
                }
            }
            for (n, (placement, at)) in pieces.into_iter().enumerate() {
                let (offset, shape, flat) = placement.clone();
                let len = flat.map_or(local, |(s, e)| e - s) * esize;
                let crcs = match file_crcs {
                    Some((bs, lists)) => {
                        if lists[n].len() as u64 != len.div_ceil(bs) {
                            return Err(Error::corrupt(
                                &f.shown,
                                format!("tensor {key:?}: {} checksums for {len} bytes", lists[n].len()),
                            ));
                        }
                        lists[n].as_slice().into()
                    }
                    None => Crcs::new(),
                };
                let this = file_crcs.map(|(bs, _)| bs);
                block = Some(match block {
                    None => this,
                    Some(prev) if prev == this => prev,
                    Some(_) => None,
                });
                if !seen.insert(placement) {
                    continue; // the same shard stored again (a replica): read it once
                }
                chunks.push(StoredChunk {
                    file: f.id,
                    byte_offset: entry.offset + at * esize,
                    offset: offset.as_slice().into(),
                    shape: shape.as_slice().into(),
                    flat,
                    crcs,
                });
            }
        }
        out.push(TensorEntry::new(format!("{prefix}{key}"), t.dtype, t.shape.clone(), chunks));
    }
    Ok((out, block))
}

/// Global flat ranges, in storage order, of a shard: the box `offset`/`shape` of a tensor of
/// shape `global`, or only the `flat` range of the box's own flattening. Adjacent ranges are
/// merged, so a box spanning whole rows is one range.
pub fn flat_runs(global: &[u64], offset: &[u64], shape: &[u64], flat: Option<(u64, u64)>) -> Vec<(u64, u64)> {
    let numel: u64 = shape.iter().product();
    let (lo, hi) = flat.unwrap_or((0, numel));
    let mut out: Vec<(u64, u64)> = Vec::new();
    if lo >= hi {
        return out;
    }
    if global.is_empty() {
        return vec![(0, 1)];
    }
    let n = global.len();
    if shape[1..] == global[1..] {
        // Whole rows: contiguous in the tensor.
        let base = offset[0] * global[1..].iter().product::<u64>();
        return vec![(base + lo, base + hi)];
    }
    // Row-major strides of the global tensor.
    let mut stride = vec![1u64; n];
    for i in (0..n - 1).rev() {
        stride[i] = stride[i + 1] * global[i + 1];
    }
    let row = shape[n - 1];
    // Visit the box's rows (runs along the last axis) whose box-local elements meet [lo, hi).
    let mut push = |s: u64, e: u64| match out.last_mut() {
        Some(last) if last.1 == s => last.1 = e,
        _ => out.push((s, e)),
    };
    let first_row = lo / row;
    let last_row = (hi - 1) / row;
    for r in first_row..=last_row {
        // Box coordinates of row r's first element.
        let mut rem = r;
        let mut start = 0u64;
        for i in (0..n - 1).rev() {
            let c = rem % shape[i];
            rem /= shape[i];
            start += (offset[i] + c) * stride[i];
        }
        start += offset[n - 1];
        let (a, b) = (lo.max(r * row) - r * row, hi.min((r + 1) * row) - r * row);
        push(start + a, start + b);
    }
    out
}

/// A key a rank writes: its main shards and how its file stores them.
#[derive(Debug, Clone)]
pub struct RankKey {
    /// The tensor's key.
    pub key: Arc<str>,
    /// Element type.
    pub dtype: DType,
    /// The tensor's shape.
    pub global_shape: Vec<u64>,
    /// What `metadata.json` says the file holds.
    pub spec: ShardSpec,
    /// The stored ranges, in file order: (position of the shard in the rank's plan, first
    /// element of the range in the shard's data, elements). One checksum list each.
    pub ranges: Vec<(usize, u64, u64)>,
    /// Elements stored.
    pub numel: u64,
}

/// The keys `plan`'s rank writes (its main shards grouped by key, in plan order). A key held as
/// one box of a 1-D or 2-D tensor is stored as the box (OLMo-core reads boxes of up to two
/// axes); anything else as the flat ranges its elements cover, shard after shard.
pub fn rank_keys(plan: &RankPlan) -> Vec<RankKey> {
    let mut order: Vec<Arc<str>> = Vec::new();
    let mut by_key: HashMap<Arc<str>, Vec<usize>> = HashMap::new();
    for (i, t) in plan.tensors.iter().enumerate().filter(|(_, t)| t.main) {
        by_key.entry(t.key.clone()).or_insert_with(|| {
            order.push(t.key.clone());
            Vec::new()
        });
        by_key.get_mut(&t.key).expect("inserted").push(i);
    }
    order
        .into_iter()
        .map(|key| {
            let shards = &by_key[&key];
            let first = &plan.tensors[shards[0]];
            let numel = shards.iter().map(|&i| plan.tensors[i].numel()).sum();
            let whole = first.offset.iter().all(|&o| o == 0) && first.shape[..] == first.global_shape[..];
            if let [i] = shards[..] {
                if first.flat.is_none() && !whole && (1..=2).contains(&first.global_shape.len()) {
                    return RankKey {
                        key,
                        dtype: first.dtype,
                        global_shape: first.global_shape.to_vec(),
                        spec: ShardSpec::Box {
                            local_shape: first.shape.to_vec(),
                            global_offset: first.offset.to_vec(),
                        },
                        ranges: vec![(i, 0, numel)],
                        numel,
                    };
                }
            }
            let mut runs = Vec::new();
            let mut ranges = Vec::new();
            for &i in shards {
                let t = &plan.tensors[i];
                let mut at = 0;
                for (s, e) in flat_runs(&t.global_shape, &t.offset, &t.shape, t.flat) {
                    runs.push((s, e));
                    ranges.push((i, at, e - s));
                    at += e - s;
                }
            }
            if runs.is_empty() {
                runs.push((0, 0)); // how OLMo-core spells "nothing of it here"
            }
            RankKey {
                key,
                dtype: first.dtype,
                global_shape: first.global_shape.to_vec(),
                spec: ShardSpec::Flat(runs),
                ranges,
                numel,
            }
        })
        .collect()
}

/// OLMo-core's rule for copies: shards of the same key at the same place (box and flat range)
/// are replicas, whatever their writers said, and the first holder (lowest rank, then plan
/// order) is the main one. Applied to the exchanged plans before validation, so that the
/// Python layer needs no exchange of its own to decide (FSDP's replicate groups, DDP, `step`).
pub fn choose_main_replicas(plans: &mut [RankPlan]) {
    type Place = (Arc<str>, Dims, Dims, Option<(u64, u64)>);
    let mut seen: HashSet<Place> = HashSet::new();
    for plan in plans.iter_mut() {
        for t in &mut plan.tensors {
            // Only a copy holding its bytes can be written.
            t.main = t.has_data && seen.insert((t.key.clone(), t.offset.clone(), t.shape.clone(), t.flat));
        }
    }
}

/// The `metadata.json` of save `save_id` whose ranks' plans (writers assigned) are `plans`:
/// every key, in the order ranks first hold it, with the file of each rank writing part of it.
pub fn metadata_from_plans(plans: &[RankPlan], save_id: u64) -> StorageMetadata {
    let mut tensors: Vec<(String, TensorMeta)> = Vec::new();
    let mut at: HashMap<Arc<str>, usize> = HashMap::new();
    for (r, plan) in plans.iter().enumerate() {
        for k in rank_keys(plan) {
            let i = *at.entry(k.key.clone()).or_insert_with(|| {
                let meta =
                    TensorMeta { shape: k.global_shape.clone(), is_sharded: false, dtype: k.dtype, files: Vec::new() };
                tensors.push((k.key.to_string(), meta));
                tensors.len() - 1
            });
            tensors[i].1.files.push((rank_file_name(r, save_id), k.spec));
        }
    }
    for (_, t) in &mut tensors {
        let n: u64 = t.shape.iter().product();
        t.is_sharded = !matches!(&t.files[..], [(_, ShardSpec::Flat(r))] if r[..] == [(0, n)]);
    }
    StorageMetadata { tensors, save: None }
}

/// The layout of a rank's data file: one 1-D tensor per key.
#[derive(Debug, Clone)]
pub struct RankFileLayout {
    /// The keys, in file order.
    pub keys: Vec<RankKey>,
    /// Their safetensors entries (offsets relative to the data section).
    pub entries: Vec<SafetensorsEntry>,
    /// Header size, length prefix included.
    pub header_len: u64,
    /// File size.
    pub size: u64,
    /// Checksum block size.
    pub block_size: u64,
}

impl RankFileLayout {
    /// Lays out the file of the rank whose plan is `plan`.
    pub fn new(plan: &RankPlan, block_size: u64) -> RankFileLayout {
        let keys = rank_keys(plan);
        let mut start = 0;
        let entries = keys
            .iter()
            .map(|k| {
                let len = k.numel * k.dtype.size() as u64;
                let e = SafetensorsEntry { name: k.key.to_string(), dtype: k.dtype, shape: vec![k.numel], start, len };
                start += len;
                e
            })
            .collect();
        let mut layout = RankFileLayout { keys, entries, header_len: 0, size: 0, block_size };
        let placeholder: Vec<Vec<u32>> = layout
            .ranges()
            .map(|(k, _, _, n)| vec![0; (n * k.dtype.size() as u64).div_ceil(block_size) as usize])
            .collect();
        layout.header_len = layout.header(&placeholder).len() as u64;
        layout.size = layout.header_len + start;
        layout
    }

    /// Every stored range: (key, shard position in the plan, first element in the shard's
    /// data, elements), in file order.
    pub fn ranges(&self) -> impl Iterator<Item = (&RankKey, usize, u64, u64)> {
        self.keys.iter().flat_map(|k| k.ranges.iter().map(move |&(i, at, n)| (k, i, at, n)))
    }

    /// Byte offset in the file of each stored range, in [`RankFileLayout::ranges`] order.
    pub fn range_offsets(&self) -> Vec<u64> {
        let mut out = Vec::new();
        for (k, e) in self.keys.iter().zip(&self.entries) {
            let mut at = self.header_len + e.start;
            for &(_, _, n) in &k.ranges {
                out.push(at);
                at += n * k.dtype.size() as u64;
            }
        }
        out
    }

    /// The header, with the checksums of every range (in [`RankFileLayout::ranges`] order).
    pub fn header(&self, crcs: &[Vec<u32>]) -> Vec<u8> {
        let mut it = crcs.iter();
        let per_key: Vec<(&str, Vec<Vec<u32>>)> = self
            .keys
            .iter()
            .map(|k| (&*k.key, k.ranges.iter().map(|_| it.next().cloned().unwrap_or_default()).collect()))
            .collect();
        build_header(&self.entries, &crc_metadata(self.block_size, &per_key), SAFETENSORS_ALIGN)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const META: &str = r#"{"tensors": {"w": {"shape": [4, 3], "is_sharded": true, "dtype": "F32", "shard_spec_per_file": {"rank_0.safetensors": {"flattened_offsets": [[0, 5]], "local_shape": null, "global_offset": null}, "rank_1.safetensors": {"flattened_offsets": [[5, 12]], "local_shape": null, "global_offset": null}}}, "d": {"shape": [3, 2], "is_sharded": true, "dtype": "BF16", "shard_spec_per_file": {"rank_0.safetensors": {"flattened_offsets": null, "local_shape": [2, 2], "global_offset": [0, 0]}, "rank_1.safetensors": {"flattened_offsets": null, "local_shape": [1, 2], "global_offset": [2, 0]}}}, "s": {"shape": [], "is_sharded": false, "dtype": "I64", "shard_spec_per_file": {"rank_0.safetensors": {"flattened_offsets": [[0, 1]], "local_shape": null, "global_offset": null}}}}}"#;

    #[test]
    fn metadata_round_trips_in_olmo_layout() {
        let m = parse_metadata(META.as_bytes(), "m").unwrap();
        assert_eq!(m.tensors.len(), 3);
        let w = &m.tensors.iter().find(|(k, _)| k == "w").unwrap().1;
        assert_eq!(w.files[1].1, ShardSpec::Flat(vec![(5, 12)]));
        // serde_json reads keys in sorted order; written back in that order the text is OLMo's.
        let mut sorted = m.clone();
        sorted.tensors.sort_by(|a, b| a.0.cmp(&b.0));
        let text = metadata_json(&sorted);
        assert_eq!(parse_metadata(text.as_bytes(), "m").unwrap().tensors, sorted.tensors);
        assert!(text.starts_with("{\"tensors\": {\"d\": {\"shape\": [3, 2], \"is_sharded\": true, \"dtype\": \"BF16\""));
        assert!(text.contains("{\"flattened_offsets\": [[0, 5]], \"local_shape\": null, \"global_offset\": null}"));
    }

    #[test]
    fn detection_by_content() {
        assert!(is_olmo_metadata(META.as_bytes(), true));
        assert!(is_olmo_metadata(&META.as_bytes()[..40], false));
        assert!(!is_olmo_metadata(br#"{"sharded_backend": "torch_dist", "tensors": {}}"#, true));
        assert!(!is_olmo_metadata(br#"{"sharded_backend": "torch_dist"}"#, false));
        assert!(!is_olmo_metadata(b"not json", true));
    }

    #[test]
    fn bad_metadata_names_the_tensor() {
        let cases = [
            (
                r#"{"tensors": {"w": {"shape": [4], "is_sharded": true, "dtype": "F32", "shard_spec_per_file": {"a": {"flattened_offsets": [[0, 5]]}}}}}"#,
                "inside the tensor",
            ),
            (
                r#"{"tensors": {"w": {"shape": [4], "is_sharded": true, "dtype": "F32", "shard_spec_per_file": {"a": {"flattened_offsets": [[3, 2]]}}}}}"#,
                "not a range",
            ),
            (
                r#"{"tensors": {"w": {"shape": [4, 4], "is_sharded": true, "dtype": "F32", "shard_spec_per_file": {"a": {"local_shape": [2, 2], "global_offset": [3, 0]}}}}}"#,
                "outside",
            ),
            (
                r#"{"tensors": {"w": {"shape": [4], "is_sharded": true, "dtype": "Q7", "shard_spec_per_file": {}}}}"#,
                "unknown dtype",
            ),
            (r#"{"tensors": {"w": {"shape": [4], "dtype": "F32", "shard_spec_per_file": {}}}}"#, "is_sharded"),
            (
                r#"{"tensors": {"w": {"shape": [4294967296, 4294967296], "is_sharded": true, "dtype": "F32", "shard_spec_per_file": {}}}}"#,
                "overflows",
            ),
            (
                r#"{"tensors": {"w": {"shape": [4], "is_sharded": true, "dtype": "F32", "shard_spec_per_file": {"../x": {"flattened_offsets": [[0, 4]]}}}}}"#,
                "plain name",
            ),
            (
                r#"{"tensors": {"w": {"shape": [4], "is_sharded": true, "dtype": "F32", "shard_spec_per_file": {"a": {}}}}}"#,
                "neither",
            ),
            (
                r#"{"tensors": {"w": {"shape": [9223372036854775808], "is_sharded": true, "dtype": "U8", "flattened_offsets_per_file": {"a": [[0, 9223372036854775808], [0, 9223372036854775808]]}}}}"#,
                "64-bit",
            ),
            (
                r#"{"tensors": {"w": {"shape": [4], "is_sharded": true, "dtype": "float32", "shard_spec_per_file": {}}}}"#,
                "unknown dtype",
            ),
        ];
        for (text, want) in cases {
            let e = parse_metadata(text.as_bytes(), "dir/metadata.json").unwrap_err().to_string();
            assert!(e.contains("dir/metadata.json") && e.contains("\"w\"") && e.contains(want), "{e}");
        }
    }

    #[test]
    fn legacy_offsets_per_file() {
        let text = r#"{"tensors": {"w": {"shape": [4], "is_sharded": true, "dtype": "F32", "flattened_offsets_per_file": {"a": [0, 3], "b": [[3, 4]]}}}}"#;
        let m = parse_metadata(text.as_bytes(), "m").unwrap();
        assert_eq!(
            m.tensors[0].1.files,
            vec![("a".into(), ShardSpec::Flat(vec![(0, 3)])), ("b".into(), ShardSpec::Flat(vec![(3, 4)]))]
        );
    }

    #[test]
    fn non_ascii_keys_are_escaped_like_python() {
        let mut s = String::new();
        py_str("é\u{1F600}\"\\\n\u{7f}", &mut s);
        assert_eq!(s, "\"\\u00e9\\ud83d\\ude00\\\"\\\\\\n\\u007f\"");
    }

    #[test]
    fn runs_of_boxes_and_flat_ranges() {
        // Whole rows merge into one range.
        assert_eq!(flat_runs(&[4, 3], &[1, 0], &[2, 3], None), vec![(3, 9)]);
        // A column block is one range per row.
        assert_eq!(flat_runs(&[4, 3], &[0, 1], &[2, 2], None), vec![(1, 3), (4, 6)]);
        // A flat range of a box keeps only its part.
        assert_eq!(flat_runs(&[4, 3], &[0, 1], &[2, 2], Some((1, 3))), vec![(2, 3), (4, 5)]);
        assert_eq!(flat_runs(&[4, 3], &[0, 0], &[4, 3], Some((2, 7))), vec![(2, 7)]);
        assert_eq!(flat_runs(&[], &[], &[], None), vec![(0, 1)]);
        assert_eq!(flat_runs(&[2, 2, 2], &[1, 0, 1], &[1, 2, 1], None), vec![(5, 6), (7, 8)]);
        assert!(flat_runs(&[0, 3], &[0, 0], &[0, 3], None).is_empty());
    }
}
