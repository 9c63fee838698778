//! Plain safetensors as a checkpoint, read-only: a Hugging Face sharded directory
//! (`model.safetensors.index.json` naming the file of every tensor), or a directory of
//! `*.safetensors` files (one `model.safetensors`, or `tessera unshard`'s output), every tensor
//! whole in one file. Detected last, so that every other format (tessera's own data files are
//! safetensors too) wins; the data files of an unfinished save (tessera's, OLMo-core's
//! `rank_*.safetensors` without `metadata.json`) are never taken for one.
//! No checksums: `verify` reads and decodes every byte.

use std::collections::BTreeMap;
use std::sync::Mutex;

use serde_json::Value as J;

use crate::error::{Error, Result};
use crate::format::is_data_file_name;
use crate::format::{CheckpointIndex, Crcs, FileEntry, StoredChunk, TensorEntry};
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

/// Reads plain safetensors files (backend [`BACKEND`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct SafetensorsStrategy;

impl LoadStrategy for SafetensorsStrategy {
    fn backend(&self) -> &str {
        BACKEND
    }
    fn supports_version(&self, version: u32) -> bool {
        version == 1
    }
    fn supported_versions(&self) -> String {
        format!("{BACKEND} v1")
    }
    fn detect(&self, storage: &dyn Storage) -> Result<Option<FormatRecord>> {
        Ok(files(storage)?.map(|_| FormatRecord { backend: BACKEND.into(), version: 1 }))
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
    let mut tensors: BTreeMap<String, TensorEntry> = BTreeMap::new();
    for (id, (name, r)) in names.iter().zip(read).enumerate() {
        let shown = format!("{}/{name}", storage.location());
        let (header, header_crc) =
            r.into_inner().unwrap().expect("every header was read")?.ok_or_else(|| Error::not_found(shown.clone()))?;
        files.push(FileEntry { name: name.clone(), size: header.size, header_len: header.header_len, header_crc });
        for (key, e) in header.tensors {
            if let Some(map) = &weight_map {
                if map.get(&key) != Some(name) {
                    // A tensor the index places elsewhere (or not at all) is not read from here.
                    continue;
                }
            }
            if tensors.contains_key(&key) {
                return Err(Error::corrupt(shown, format!("tensor {key:?} is stored in more than one file")));
            }
            let chunk = StoredChunk {
                file: id as u32,
                byte_offset: e.offset,
                offset: vec![0; e.shape.len()].into(),
                shape: e.shape.clone().into(),
                flat: None,
                crcs: Crcs::new(),
            };
            tensors.insert(key.clone(), TensorEntry::new(key, e.dtype, e.shape, vec![chunk]));
        }
    }
    if let Some(map) = &weight_map {
        if let Some((key, file)) = map.iter().find(|(k, _)| !tensors.contains_key(*k)) {
            return Err(Error::corrupt(
                format!("{}/{HF_INDEX}", storage.location()),
                format!("tensor {key:?} is not in {file}, where the index places it"),
            ));
        }
    }
    let mut index = CheckpointIndex {
        backend: BACKEND.into(),
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
