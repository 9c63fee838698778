//! Plain safetensors as a checkpoint, read-only: a Hugging Face sharded directory
//! (`model.safetensors.index.json` naming the file of every tensor), or a directory of
//! `*.safetensors` files (one `model.safetensors`, or `tessera unshard`'s output), every tensor
//! whole in one file, or in pieces placed by the `DCP_SHARDING_INFO` of DCP's
//! `HuggingFaceStorageWriter(save_distributed=True)` (each rank's file says where its pieces lie
//! in the full tensor, whose shape is recorded nowhere). Detected last, so that every other format (tessera's own data files are
//! safetensors too) wins; the data files of an unfinished save (tessera's, OLMo-core's
//! `rank_*.safetensors` without `metadata.json`) are never taken for one.
//! No checksums: `verify` reads and decodes every byte.

use std::collections::BTreeMap;
use std::sync::Mutex;

use serde_json::Value as J;

use crate::error::{Error, Result};
use crate::format::is_data_file_name;
use crate::format::safetensors::uints;
use crate::format::{Backend, CheckpointIndex, Crcs, FileEntry, StoredChunk, TensorEntry};
use crate::formats::olmo::metadata::parse_rank_file_name;
use crate::formats::{read_safetensors_header, ForeignView, HeaderRead};
use crate::formats::{ForEach, FormatRecord, LoadStrategy};
use crate::model::Value;
use crate::storage::{Storage, StorageExt};

/// Backend name of plain safetensors checkpoints.
pub const BACKEND: &str = "safetensors";
/// Hugging Face's index of a sharded checkpoint.
const HF_INDEX: &str = "model.safetensors.index.json";
/// Largest index file read (Hugging Face's are a few hundred KiB).
const MAX_INDEX_BYTES: u64 = 64 << 20;
/// `__metadata__` entry in which DCP's `HuggingFaceStorageWriter(save_distributed=True)`
/// records where each tensor of the file lies in the full tensor: a JSON string
/// `{"key": {"saved_offsets": [..]}, ..}`.
const SHARDING_INFO: &str = "DCP_SHARDING_INFO";

/// The pieces of one tensor found so far.
struct Pieces {
    dtype: crate::model::dtype::DType,
    /// Per axis, the largest end of a piece: the tensor's shape once all files are read.
    extent: Vec<u64>,
    chunks: Vec<StoredChunk>,
    /// The first file it was found in, for messages.
    file: String,
    /// Whether the files holding it so far place it with DCP sharding info.
    sharded: bool,
}

/// A file's DCP sharding info: the `saved_offsets` of each tensor it names; `None` when the
/// file has none (a whole-tensor safetensors file). Hostile input: every value's type and
/// length is checked (`uints` bounds the axes), the offsets against the shapes by the caller.
fn sharding_info(metadata: &serde_json::Map<String, J>, shown: &str) -> Result<Option<BTreeMap<String, Vec<u64>>>> {
    let Some(raw) = metadata.get(SHARDING_INFO) else { return Ok(None) };
    let bad = |reason: String| Error::corrupt(shown, format!("{SHARDING_INFO}: {reason}"));
    let text = raw.as_str().ok_or_else(|| bad(format!("{raw} is not a string")))?;
    // Inside the header, whose size read_header bounded.
    let json: J = serde_json::from_str(text).map_err(|e| bad(format!("not JSON: {e}")))?;
    let map = json.as_object().ok_or_else(|| bad("not an object".into()))?;
    let mut out = BTreeMap::new();
    for (key, v) in map {
        let offsets = v.get("saved_offsets").ok_or_else(|| bad(format!("tensor {key:?}: no \"saved_offsets\"")))?;
        let offsets = uints(offsets, "saved_offsets").map_err(|e| bad(format!("tensor {key:?}: {e}")))?;
        out.insert(key.clone(), offsets);
    }
    Ok(Some(out))
}

/// Reads plain safetensors files (backend [`BACKEND`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct SafetensorsStrategy;

impl LoadStrategy for SafetensorsStrategy {
    fn backend(&self) -> Backend {
        Backend::Safetensors
    }
    fn supports_version(&self, version: u32) -> bool {
        version == 1
    }
    fn supported_versions(&self) -> String {
        format!("{BACKEND} v1")
    }
    fn detect(&self, storage: &dyn Storage) -> Result<Option<FormatRecord>> {
        Ok(files(storage)?.map(|_| FormatRecord { backend: Backend::Safetensors, version: 1 }))
    }
    fn open_checkpoint<'s>(
        &self,
        storage: &'s dyn Storage,
        for_each: ForEach<'_>,
    ) -> Result<(CheckpointIndex, Option<ForeignView<'s>>)> {
        let (index, view) = open_safetensors(storage, for_each)?;
        Ok((index, Some(view)))
    }
}

/// The files of the checkpoint, and for a sharded one the file its index names for each tensor;
/// `None` if `storage` holds no plain safetensors checkpoint.
type Layout = (Vec<String>, Option<BTreeMap<String, String>>);

fn files(storage: &dyn Storage) -> Result<Option<Layout>> {
    if let Some(size) = storage.size_if_present(HF_INDEX)? {
        let shown = format!("{}/{HF_INDEX}", storage.location());
        if size > MAX_INDEX_BYTES {
            return Err(Error::corrupt(&shown, format!("{size} bytes: more than an index of tensor names needs")));
        }
        let json: J = serde_json::from_slice(&storage.read(HF_INDEX)?)
            .map_err(|e| Error::corrupt(&shown, format!("not JSON: {e}")))?;
        let map = json
            .get("weight_map")
            .and_then(J::as_object)
            .ok_or_else(|| Error::corrupt(&shown, "no \"weight_map\" object"))?;
        let mut weight_map = BTreeMap::new();
        for (key, file) in map {
            let file = file.as_str().ok_or_else(|| Error::corrupt(&shown, format!("{key:?}: file is not a string")))?;
            if file.contains('/') || file.contains('\\') || file.starts_with('.') || !file.ends_with(".safetensors") {
                return Err(Error::corrupt(
                    &shown,
                    format!("{key:?}: {file:?} is not a safetensors file beside the index"),
                ));
            }
            weight_map.insert(key.clone(), file.to_string());
        }
        let mut names: Vec<String> = weight_map.values().cloned().collect();
        names.sort();
        names.dedup();
        return Ok(Some((names, Some(weight_map))));
    }
    let mut names: Vec<String> = storage
        .list()?
        .into_iter()
        .filter(|n| n.ends_with(".safetensors") && !n.contains('/') && !n.starts_with('.'))
        .collect();
    // tessera's own data files, and OLMo-core's rank files: a checkpoint of those formats
    // (detected before) or an unfinished save of one, never a plain safetensors checkpoint.
    let unfinished = |n: &str| is_data_file_name(n) || parse_rank_file_name(n).is_some();
    if names.is_empty() || names.iter().any(|n| unfinished(n)) {
        return Ok(None);
    }
    names.sort();
    Ok(Some((names, None)))
}

pub(crate) fn open_safetensors<'s>(
    storage: &'s dyn Storage,
    for_each: ForEach<'_>,
) -> Result<(CheckpointIndex, ForeignView<'s>)> {
    let (names, weight_map) = files(storage)?.ok_or_else(|| Error::not_committed(storage.location()))?;
    let read: Vec<Mutex<Option<Result<HeaderRead>>>> = names.iter().map(|_| Mutex::new(None)).collect();
    for_each(names.len(), &|i| {
        *read[i].lock().unwrap() = Some(read_safetensors_header(storage, &names[i]));
    });
    let mut files = Vec::with_capacity(names.len());
    let mut tensors: BTreeMap<String, Pieces> = BTreeMap::new();
    for (id, (name, r)) in names.iter().zip(read).enumerate() {
        let shown = format!("{}/{name}", storage.location());
        let (header, header_crc) =
            r.into_inner().unwrap().expect("every header was read")?.ok_or_else(|| Error::not_found(shown.clone()))?;
        files.push(FileEntry { name: name.clone(), size: header.size, header_len: header.header_len, header_crc });
        let sharding = sharding_info(&header.metadata, &shown)?;
        if let Some(info) = &sharding {
            if let Some(key) = info.keys().find(|k| !header.tensors.contains_key(*k)) {
                return Err(Error::corrupt(
                    shown,
                    format!("{SHARDING_INFO} names tensor {key:?}, which the file does not hold"),
                ));
            }
        }
        for (key, e) in header.tensors {
            if let Some(map) = &weight_map {
                if map.get(&key) != Some(name) {
                    // A tensor the index places elsewhere (or not at all) is not read from here.
                    continue;
                }
            }
            let offset = match &sharding {
                Some(info) => info
                    .get(&key)
                    .cloned()
                    .ok_or_else(|| Error::corrupt(&shown, format!("tensor {key:?} has no entry in {SHARDING_INFO}")))?,
                None => vec![0; e.shape.len()],
            };
            if offset.len() != e.shape.len() {
                return Err(Error::corrupt(
                    shown,
                    format!(
                        "tensor {key:?}: {SHARDING_INFO} saved_offsets {offset:?} do not match its {} axes",
                        e.shape.len()
                    ),
                ));
            }
            let end: Option<Vec<u64>> = offset.iter().zip(&e.shape).map(|(o, s)| o.checked_add(*s)).collect();
            let end = end.ok_or_else(|| {
                Error::corrupt(
                    &shown,
                    format!("tensor {key:?}: saved_offsets {offset:?} + shape {:?} overflow", e.shape),
                )
            })?;
            let chunk = StoredChunk {
                file: id as u32,
                byte_offset: e.offset,
                offset: offset.into(),
                shape: e.shape.clone().into(),
                flat: None,
                crcs: Crcs::new(),
            };
            let sharded = sharding.is_some();
            match tensors.get_mut(&key) {
                None => {
                    let p = Pieces { dtype: e.dtype, extent: end, chunks: vec![chunk], file: name.clone(), sharded };
                    tensors.insert(key, p);
                }
                Some(p) => {
                    // Only pieces DCP placed (every file holding them says where) make one
                    // tensor; the same name whole in two files is two tensors, not one.
                    if !(p.sharded && sharded) {
                        return Err(Error::corrupt(
                            shown,
                            format!("tensor {key:?} is stored in more than one file (also {})", p.file),
                        ));
                    }
                    if p.dtype != e.dtype || p.extent.len() != end.len() {
                        return Err(Error::corrupt(
                            shown,
                            format!(
                                "piece of tensor {key:?}: {} of {} axes, but its piece in {} is {} of {} axes",
                                e.dtype.name(),
                                end.len(),
                                p.file,
                                p.dtype.name(),
                                p.extent.len()
                            ),
                        ));
                    }
                    for (x, y) in p.extent.iter_mut().zip(&end) {
                        *x = (*x).max(*y);
                    }
                    p.chunks.push(chunk);
                }
            }
        }
    }
    // DCP records no global shape: the tensor spans what its pieces cover, and the validation
    // gate then checks that the pieces tile exactly that box (no gap, no overlap).
    let tensors: BTreeMap<String, TensorEntry> =
        tensors.into_iter().map(|(k, p)| (k.clone(), TensorEntry::new(k, p.dtype, p.extent, p.chunks))).collect();
    if let Some(map) = &weight_map {
        if let Some((key, file)) = map.iter().find(|(k, _)| !tensors.contains_key(*k)) {
            return Err(Error::corrupt(
                format!("{}/{HF_INDEX}", storage.location()),
                format!("tensor {key:?} is not in {file}, where the index places it"),
            ));
        }
    }
    let mut index = CheckpointIndex {
        backend: Backend::Safetensors,
        version: 1,
        block_size: 0,
        content_metadata: Value::Null,
        common: Vec::new(),
        files,
        tensors: tensors.into_values().collect(),
        objects: Vec::new(),
        omitted_tensors: Vec::new(),
    };
    index.sort_entries();
    Ok((index, ForeignView::new(storage, "")))
}
