//! OLMo-core 0.1.x checkpoints (`formats::olmo`), read-only: a `Checkpointer` directory
//! (`metadata.json` + `rank_{r}.safetensors`), or what `save_model_and_optim_state` writes, a
//! directory holding `model/` and `optim/` (either alone opens too), whose keys are then
//! `model/…` and `optim/…`. The data files are plain safetensors, so the index names the real
//! files and every read is a ranged read of the bytes it needs; the read-only view only keeps
//! writers out.

pub(crate) mod metadata;

use std::collections::{BTreeSet, HashMap};
use std::sync::Mutex;

use crate::error::{Error, Result};
use crate::format::{Backend, CheckpointIndex, Crcs, FileEntry, SafetensorsHeader, StoredChunk, TensorEntry};
use crate::formats::olmo::metadata::{
    build_tensors, decode_pickled, file_crcs, is_olmo_metadata, parse_metadata, FileCrcs, IndexedFile, SaveMark,
    BACKEND, MAX_PICKLED_FIELD, METADATA_FILE, PARTS,
};
use crate::formats::{read_safetensors_header, ForeignView, HeaderRead};
use crate::formats::{ForEach, FormatRecord, LoadStrategy};
use crate::model::dtype::DType;
use crate::model::Value;
use crate::model::{PathSeg, StatePath};
use crate::storage::{Storage, StorageExt};

/// Reads OLMo-core 0.1.x checkpoints (backend [`BACKEND`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct OlmoStrategy;

/// Bytes of a `metadata.json` read to recognise it; larger files are recognised by their start.
const SNIFF_BYTES: u64 = 64 << 10;

impl LoadStrategy for OlmoStrategy {
    fn backend(&self) -> Backend {
        Backend::OlmoSafetensors
    }
    fn supports_version(&self, version: u32) -> bool {
        version == 1
    }
    fn supported_versions(&self) -> String {
        format!("{BACKEND} v1")
    }
    fn detect(&self, storage: &dyn Storage) -> Result<Option<FormatRecord>> {
        Ok(olmo_parts(storage)?.map(|_| FormatRecord { backend: Backend::OlmoSafetensors, version: 1 }))
    }
    fn open_checkpoint<'s>(
        &self,
        storage: &'s dyn Storage,
        for_each: ForEach<'_>,
    ) -> Result<(CheckpointIndex, Option<ForeignView<'s>>)> {
        let (index, view) = open_olmo(storage, for_each)?;
        Ok((index, Some(view)))
    }
}

/// Whether `name` is an OLMo-core `metadata.json` (by its content).
fn is_olmo_at(storage: &dyn Storage, name: &str) -> Result<bool> {
    let Some(size) = storage.size_if_present(name)? else { return Ok(false) };
    let head = storage.read_range(name, 0..size.min(SNIFF_BYTES))?;
    Ok(is_olmo_metadata(&head, head.len() as u64 == size))
}

/// The checkpoint directories at `storage` (as key prefixes): `[""]` for a `Checkpointer`
/// directory, else those of `model/` and `optim/` present; `None` if this is no OLMo-core
/// checkpoint.
pub(crate) fn olmo_parts(storage: &dyn Storage) -> Result<Option<Vec<String>>> {
    if is_olmo_at(storage, METADATA_FILE)? {
        return Ok(Some(vec![String::new()]));
    }
    let mut parts = Vec::new();
    for p in PARTS {
        if is_olmo_at(storage, &format!("{p}/{METADATA_FILE}"))? {
            parts.push(format!("{p}/"));
        }
    }
    Ok((!parts.is_empty()).then_some(parts))
}

/// Directories that one save wrote together (a [`SaveMark`] of several) must all be of that save:
/// a save of `model/` and `optim/` interrupted between their two commits leaves one new and the
/// other old, which is refused rather than read as one checkpoint.
fn check_one_save(marks: &[(String, Option<SaveMark>)], location: &str) -> Result<()> {
    let Some((shown, claim)) = marks.iter().find_map(|(s, m)| m.filter(|m| m.dirs > 1).map(|m| (s, m))) else {
        return Ok(());
    };
    if marks.len() < claim.dirs as usize {
        // Committed in one directory only: the save of both never finished (the directory alone
        // opens, as itself).
        return Err(Error::not_committed(location));
    }
    for (other, mark) in marks {
        if mark.map(|m| m.id) != Some(claim.id) {
            return Err(Error::corrupt(
                other,
                format!(
                    "is not of the save that wrote {shown} ({:016x}, which wrote {} directories together): a save of \
                     both was interrupted between their commits; each directory alone is whole, together they \
                     are no checkpoint: save again",
                    claim.id, claim.dirs
                ),
            ));
        }
    }
    Ok(())
}

/// The rank files the `metadata.json` of the OLMo-core `Checkpointer` directory `storage` names
/// (what the committed checkpoint there uses); `None` when there is no OLMo-core
/// `metadata.json`.
pub(crate) fn referenced_files(storage: &dyn Storage) -> Result<Option<BTreeSet<String>>> {
    if !is_olmo_at(storage, METADATA_FILE)? {
        return Ok(None);
    }
    let shown = format!("{}/{METADATA_FILE}", storage.location());
    let meta = parse_metadata(&storage.read(METADATA_FILE)?, &shown)?;
    Ok(Some(meta.tensors.iter().flat_map(|(_, t)| t.files.iter().map(|(f, _)| f.clone())).collect()))
}

pub(crate) fn open_olmo<'s>(
    storage: &'s dyn Storage,
    for_each: ForEach<'_>,
) -> Result<(CheckpointIndex, ForeignView<'s>)> {
    let parts = olmo_parts(storage)?.ok_or_else(|| Error::not_committed(storage.location()))?;
    let mut files: Vec<FileEntry> = Vec::new();
    let mut tensors: Vec<TensorEntry> = Vec::new();
    let mut common: Vec<(StatePath, Value)> = Vec::new();
    let mut block: Option<Option<u64>> = None;
    let mut marks: Vec<(String, Option<SaveMark>)> = Vec::new();
    for prefix in &parts {
        let meta_name = format!("{prefix}{METADATA_FILE}");
        let shown = format!("{}/{meta_name}", storage.location());
        let meta = parse_metadata(&storage.read(&meta_name)?, &shown)?;
        marks.push((shown.clone(), meta.save));
        // Files holding data, each header read once.
        let names: Vec<&str> = meta
            .tensors
            .iter()
            .flat_map(|(_, t)| t.files.iter().filter(|(_, s)| s.numel() > 0).map(|(f, _)| f.as_str()))
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let headers: Vec<Mutex<Option<Result<HeaderRead>>>> = names.iter().map(|_| Mutex::new(None)).collect();
        for_each(names.len(), &|i| {
            *headers[i].lock().unwrap() = Some(read_safetensors_header(storage, &format!("{prefix}{}", names[i])));
        });
        let mut by_name: HashMap<&str, (u32, SafetensorsHeader, Option<FileCrcs>)> =
            HashMap::with_capacity(names.len());
        for (name, h) in names.iter().zip(headers) {
            if let Some((header, header_crc)) = h.into_inner().unwrap().expect("every header was read")? {
                let id = u32::try_from(files.len()).map_err(|_| Error::corrupt(&shown, "too many files"))?;
                files.push(FileEntry {
                    name: format!("{prefix}{name}"),
                    size: header.size,
                    header_len: header.header_len,
                    header_crc,
                });
                let crcs = file_crcs(&header, &format!("{}/{prefix}{name}", storage.location()))?;
                by_name.insert(name, (id, header, crcs));
            }
        }
        let location = storage.location();
        let (part_tensors, part_block) = build_tensors(prefix, &meta, &shown, &|name| {
            by_name.get(name).map(|(id, header, crcs)| IndexedFile {
                id: *id,
                header,
                crcs: crcs.as_ref(),
                shown: format!("{location}/{prefix}{name}"),
            })
        })?;
        block = match (block, part_block) {
            (None, b) | (b, None) => b,
            (Some(a), Some(b)) => Some(if a == b { a } else { None }),
        };
        common.extend(optimizer_values(storage, prefix, &part_tensors, &files)?);
        tensors.extend(part_tensors);
    }
    // A directory opened itself is whole; `model/` and `optim/` opened together must be one save.
    if !parts[0].is_empty() {
        check_one_save(&marks, &storage.location())?;
    }
    let block_size = match block {
        Some(Some(bs)) => bs,
        _ => {
            // Checksums are only used when every chunk has them.
            tensors = tensors
                .into_iter()
                .map(|t| {
                    let (key, dtype, shape) = (t.key.clone(), t.dtype, t.global_shape.clone());
                    let chunks = t.into_chunks().into_iter().map(|c| StoredChunk { crcs: Crcs::new(), ..c });
                    TensorEntry::new(key, dtype, shape, chunks.collect())
                })
                .collect();
            0
        }
    };
    let mut index = CheckpointIndex {
        backend: Backend::OlmoSafetensors,
        version: 1,
        block_size,
        content_metadata: Value::Null,
        common,
        files,
        tensors,
        objects: Vec::new(),
        omitted_tensors: Vec::new(),
    };
    index.sort_entries();
    Ok((index, ForeignView::new(storage, "")))
}

/// The bytes of a whole (small) tensor of the index being built.
fn read_whole(storage: &dyn Storage, files: &[FileEntry], t: &TensorEntry) -> Result<Vec<u8>> {
    let esize = t.dtype.size() as u64;
    let numel: u64 = t.global_shape.iter().product();
    let len = numel * esize;
    if len > MAX_PICKLED_FIELD {
        let file = t.chunks().first().map_or("", |c| files[c.file as usize].name.as_str());
        return Err(Error::corrupt(
            file,
            format!("{:?}: {len} bytes is more than a pickled optimizer field may hold", t.key),
        ));
    }
    let mut out = vec![0u8; len as usize];
    for c in t.chunks() {
        // 1-D or 0-d: a chunk's elements are one range of the tensor.
        let (s, e) = c.flat.unwrap_or_else(|| {
            let s = c.offset.first().copied().unwrap_or(0);
            (s, s + c.numel())
        });
        storage.read_at(
            &files[c.file as usize].name,
            c.byte_offset,
            &mut out[(s * esize) as usize..(e * esize) as usize],
        )?;
    }
    Ok(out)
}

/// OLMo-core's pickled optimizer fields of one directory, decoded into plain values under the
/// directory's folder: `param_groups` (the list of `param_group{i}`, `i < num_param_groups`)
/// and `state_keys`. A directory without `num_param_groups` holds none.
fn optimizer_values(
    storage: &dyn Storage,
    prefix: &str,
    tensors: &[TensorEntry],
    files: &[FileEntry],
) -> Result<Vec<(StatePath, Value)>> {
    let by_name: HashMap<&str, &TensorEntry> =
        tensors.iter().filter_map(|t| Some((t.key.strip_prefix(prefix)?, t))).collect();
    let find = |name: &str| by_name.get(name).copied();
    let Some(count) = find("num_param_groups").filter(|t| t.global_shape.is_empty() && t.dtype == DType::I64) else {
        return Ok(Vec::new());
    };
    let shown = |t: &TensorEntry| format!("{}/{prefix}{METADATA_FILE} ({:?})", storage.location(), t.key);
    let pickle = |name: &str| -> Result<Value> {
        let t = find(name).ok_or_else(|| {
            Error::corrupt(format!("{}/{prefix}{METADATA_FILE}", storage.location()), format!("no tensor {name:?}"))
        })?;
        if t.dtype != DType::U8 || t.global_shape.len() != 1 {
            return Err(Error::corrupt(shown(t), "a pickled optimizer field must be a 1-D uint8 tensor"));
        }
        decode_pickled(&read_whole(storage, files, t)?, &shown(t))
    };
    let n = i64::from_le_bytes(read_whole(storage, files, count)?.try_into().expect("an i64 scalar is 8 bytes"));
    // Each group is a tensor of its own: a count beyond the tensors present is damage.
    let n = u32::try_from(n).ok().filter(|&n| (n as usize) < tensors.len()).ok_or_else(|| {
        Error::corrupt(shown(count), format!("{n} param groups in a directory of {} tensors", tensors.len()))
    })?;
    let groups = (0..n).map(|i| pickle(&format!("param_group{i}"))).collect::<Result<Vec<_>>>()?;
    let folder: StatePath = prefix.strip_suffix('/').map(|p| vec![PathSeg::Key(p.into())]).unwrap_or_default();
    let at = |name: &str| {
        let mut p = folder.clone();
        p.push(PathSeg::Key(name.into()));
        p
    };
    Ok(vec![(at("param_groups"), Value::List(groups)), (at("state_keys"), pickle("state_keys")?)])
}

/// The text of the `metadata.json` of the OLMo-core `Checkpointer` directory at `storage`,
/// once it has passed the same checks a load makes of it (OLMo-core's `get_metadata`). A
/// `save_model_and_optim_state` directory has one in each of `model/` and `optim/`.
///
/// ```
/// use tessera::SaveOptions;
/// use tessera::olmo::{read_olmo_metadata, save_olmo};
/// use tessera::{DType, ShardedTensor, StateTree, TensorData};
/// use tessera::comm::SoloComm;
/// use tessera::storage::MemoryStorage;
///
/// let storage = MemoryStorage::new();
/// let w = ShardedTensor::full("w", DType::F32, &[4], TensorData::Owned(vec![0; 16]));
/// save_olmo(StateTree::map().with("w", StateTree::Tensor(w)), &storage, &SoloComm, &SaveOptions::default())?;
///
/// let json = read_olmo_metadata(&storage)?;
/// assert!(json.starts_with(r#"{"tensors": {"w": {"shape": [4]"#));
/// // Nothing there: no metadata to read.
/// assert!(read_olmo_metadata(&MemoryStorage::new()).is_err());
/// # Ok::<(), tessera::Error>(())
/// ```
pub fn read_olmo_metadata(storage: &dyn Storage) -> Result<String> {
    let shown = format!("{}/{METADATA_FILE}", storage.location());
    let bytes = match storage.read(METADATA_FILE) {
        Err(Error::NotFound { .. }) if olmo_parts(storage)?.is_some() => {
            return Err(Error::invalid(format!(
                "{} holds model/ and optim/, each a checkpoint with its own metadata: name one of them",
                storage.location()
            )))
        }
        other => other?,
    };
    if !is_olmo_metadata(&bytes, true) {
        return Err(Error::corrupt(&shown, "not an OLMo-core metadata.json (no \"tensors\" object)"));
    }
    parse_metadata(&bytes, &shown)?;
    String::from_utf8(bytes).map_err(|_| Error::corrupt(&shown, "not UTF-8"))
}
