//! PyTorch Distributed Checkpoint directories, read-only: plain DCP (`torch_dcp`: one
//! `.metadata`, or every rank's `__{r}.metadata` of a save without collectives), Megatron
//! `torch_dist` (DCP + `metadata.json` + `common.pt`) and OLMo-core (`model_and_optim/`).

#[cfg(feature = "fuzzing")]
pub(crate) mod fuzz;
pub(crate) mod integrity;
pub(crate) mod metadata;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::format::{Backend, CheckpointIndex, Crcs, StoredChunk, TensorEntry};
use crate::formats::dcp::metadata::{parse_metadata, DcpMetadata};
use crate::formats::pickle::unpickle_view;
use crate::formats::pickle::PickleValue;
use crate::formats::torch_save::limits;
use crate::formats::{common_entries, foreign_index, ForeignView, ObjectShards, Source};
use crate::formats::{ForEach, FormatRecord, LoadStrategy};
use crate::model::Value;
use crate::model::{PathSeg, StatePath};
use crate::storage::{Storage, StorageExt};

pub use crate::formats::torch_dist::{DCP_METADATA, MEGATRON_COMMON, MEGATRON_METADATA};

/// Key of the sharded object newer Megatron stores the common state as.
const MEGATRON_COMMON_OBJECT: &str = "common_state";
/// Folder OLMo-core keeps its DCP checkpoint in.
pub const OLMO_FOLDER: &str = "model_and_optim";

/// Which writer's conventions a DCP directory follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DcpFlavor {
    /// `torch.distributed.checkpoint` (backend `"torch_dcp"`).
    Torch,
    /// Megatron-Core `torch_dist` (backend `"torch_dist"`).
    Megatron,
    /// OLMo-core (backend `"olmo_core"`): DCP under `model_and_optim/`.
    Olmo,
}

impl DcpFlavor {
    fn backend(self) -> Backend {
        match self {
            DcpFlavor::Torch => Backend::TorchDcp,
            DcpFlavor::Megatron => Backend::TorchDist,
            DcpFlavor::Olmo => Backend::OlmoCore,
        }
    }
    fn prefix(self) -> &'static str {
        match self {
            DcpFlavor::Olmo => "model_and_optim/",
            _ => "",
        }
    }
}

/// Reads DCP directories of one flavor.
#[derive(Debug, Clone, Copy)]
pub struct DcpStrategy(pub DcpFlavor);

/// Megatron's `metadata.json`: `(sharded_backend, sharded_backend_version)`, if present.
pub(crate) fn megatron_backend(storage: &dyn Storage) -> Result<Option<(String, u32)>> {
    let bytes = match storage.read(MEGATRON_METADATA) {
        Ok(b) => b,
        Err(Error::NotFound { .. }) => return Ok(None),
        Err(e) => return Err(e),
    };
    let shown = format!("{}/{MEGATRON_METADATA}", storage.location());
    let json: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|e| Error::corrupt(&shown, format!("not JSON: {e}")))?;
    if json.get("sharded_backend").is_none() && crate::formats::olmo::metadata::is_olmo_metadata(&bytes, true) {
        return Ok(None); // OLMo-core's metadata.json, not Megatron's
    }
    let backend = json
        .get("sharded_backend")
        .and_then(|b| b.as_str())
        .ok_or_else(|| Error::corrupt(&shown, "no \"sharded_backend\" string"))?;
    let version = json.get("sharded_backend_version").and_then(|v| v.as_u64()).unwrap_or(1);
    Ok(Some((backend.to_string(), u32::try_from(version).unwrap_or(u32::MAX))))
}

impl LoadStrategy for DcpStrategy {
    fn backend(&self) -> Backend {
        self.0.backend()
    }
    fn supports_version(&self, version: u32) -> bool {
        version == 1
    }
    fn supported_versions(&self) -> String {
        format!("{} v1", self.0.backend())
    }
    fn detect(&self, storage: &dyn Storage) -> Result<Option<FormatRecord>> {
        let record = |version| Some(FormatRecord { backend: self.0.backend(), version });
        match self.0 {
            DcpFlavor::Megatron => match megatron_backend(storage)? {
                Some((b, v)) if b == "torch_dist" => Ok(record(v)),
                _ => Ok(None),
            },
            DcpFlavor::Torch => {
                // `.metadata`, or the per-rank metadata of a save without collectives.
                if !storage.exists(DCP_METADATA)? && !has_rank_metadata(storage)? {
                    return Ok(None);
                }
                match megatron_backend(storage)? {
                    Some((b, _)) if b == "torch_dist" => Ok(None),
                    _ => Ok(record(1)),
                }
            }
            DcpFlavor::Olmo => {
                if storage.exists(DCP_METADATA)? || !storage.exists(&format!("{OLMO_FOLDER}/{DCP_METADATA}"))? {
                    return Ok(None);
                }
                Ok(record(1))
            }
        }
    }
    fn open_checkpoint<'s>(
        &self,
        storage: &'s dyn Storage,
        _: ForEach<'_>,
    ) -> Result<(CheckpointIndex, Option<ForeignView<'s>>)> {
        let (index, view) = open_dcp(storage, self.0)?;
        Ok((index, Some(view)))
    }
}

/// The data files the `.metadata` at the root of `storage` names (what a committed DCP
/// checkpoint there uses), or those every rank's `__{r}.metadata` names (a save without
/// collectives; an error if a rank's is missing, so that nothing of it is taken for garbage),
/// with the copy of its `common.pt` tessera keeps; `None` when there is no metadata.
pub(crate) fn referenced_files(storage: &dyn Storage) -> Result<Option<std::collections::BTreeSet<String>>> {
    let meta = match read_metadata(storage, DcpFlavor::Torch) {
        Ok((meta, _)) => meta,
        Err(Error::NotFound { .. }) => return Ok(None),
        Err(e) => return Err(e),
    };
    let copy = meta.save_id.as_deref().and_then(crate::formats::torch_dist::committed_common);
    let copy = copy.map(|(id, _)| crate::formats::torch_dist::common_copy_name(id));
    let chunks = meta.tensors.iter().flat_map(|t| t.chunks.iter().map(|c| &*c.location.relative_path));
    let files = chunks.chain(meta.bytes.iter().map(|b| &*b.location.relative_path)).map(str::to_string);
    Ok(Some(files.chain(copy).collect()))
}

/// `"__3.metadata"` → 3: the metadata one rank writes when it saves without collectives.
pub(crate) fn parse_rank_metadata_name(name: &str) -> Option<u32> {
    let digits = name.strip_prefix("__")?.strip_suffix(DCP_METADATA)?;
    (!digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())).then(|| digits.parse().ok())?
}

/// `"__3_0.distcp"` → 3: the rank whose data file it is.
fn parse_data_file_rank(name: &str) -> Option<u32> {
    let (rank, rest) = name.strip_prefix("__")?.split_once('_')?;
    let index = rest.strip_suffix(".distcp")?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    (digits(rank) && digits(index)).then(|| rank.parse().ok())?
}

/// Whether the folder holds the per-rank metadata of a save without collectives (and no
/// `.metadata`, checked by the caller).
fn has_rank_metadata(storage: &dyn Storage) -> Result<bool> {
    Ok(storage.list()?.iter().any(|n| parse_rank_metadata_name(n).is_some()))
}

/// The checkpoint's metadata, and the name of the file(s) it came from for messages: its
/// `.metadata`, or (plain torch DCP only) the merge of every rank's `__{r}.metadata` of a
/// `dcp.save(..., use_collectives=False)`. `NotFound` when there is neither.
fn read_metadata(storage: &dyn Storage, flavor: DcpFlavor) -> Result<(DcpMetadata, String)> {
    let meta_name = format!("{}{DCP_METADATA}", flavor.prefix());
    let shown = format!("{}/{meta_name}", storage.location());
    match storage.read(&meta_name) {
        Ok(bytes) => {
            // Read in place: a tree of the whole pickle would take several times its arena.
            let pickle = unpickle_view(&bytes, &shown, &limits())?;
            let meta = parse_metadata(pickle.root()).map_err(|e| Error::corrupt(&shown, e))?;
            Ok((meta, shown))
        }
        Err(Error::NotFound { .. }) if flavor == DcpFlavor::Torch && has_rank_metadata(storage)? => {
            merged_rank_metadata(storage)
        }
        Err(e) => Err(e),
    }
}

/// A chunk's offsets and sizes.
type ChunkBox = (Vec<u64>, Vec<u64>);

/// The per-rank metadata of a save without collectives, merged into one.
///
/// torch writes no commit marker for such a save: each rank writes its data files, then its
/// `__{r}.metadata` (renamed into place), whether or not it stored anything. So the directory
/// counts as committed when every rank from 0 to the highest one seen (in a metadata or a data
/// file name) has its metadata; a rank missing one is named. torch's own load of it
/// (`dcp.load(..., use_collectives=False)` falls back to `__{rank}.metadata`) reads each
/// rank's file alone, at the same world size; a merged index reads at any.
///
/// Without collectives no rank deduplicates against another: a replicated tensor's chunk and
/// every byte item are stored by each rank. A chunk with the same offsets and sizes as one
/// already taken is such a replica and is read from the lowest rank; so is a byte item. A key
/// two ranks describe differently (dtype, global shape, tensor vs value) is an error naming
/// both files; chunks that overlap without being equal are left to the validation gate.
fn merged_rank_metadata(storage: &dyn Storage) -> Result<(DcpMetadata, String)> {
    let names = storage.list()?;
    let mut ranks: BTreeSet<u32> = names.iter().filter_map(|n| parse_rank_metadata_name(n)).collect();
    let data_ranks: BTreeMap<u32, &String> = names.iter().filter_map(|n| Some((parse_data_file_rank(n)?, n))).collect();
    let highest = ranks.iter().chain(data_ranks.keys()).max().copied().unwrap_or(0);
    // Each rank writes its metadata even when it stored nothing: every rank up to the highest
    // one seen must have one.
    if let Some(missing) = (0..=highest).find(|r| !ranks.contains(r)) {
        let why = match data_ranks.get(&missing) {
            Some(data) => format!("rank {missing} wrote {data} but not its metadata"),
            None => format!("ranks up to {highest} saved, but rank {missing} left no metadata"),
        };
        return Err(Error::NotCommitted {
            path: storage.location().into(),
            detail: Some(format!(
                "not a committed checkpoint: {}/__{missing}{DCP_METADATA} is missing ({why}): a DCP save without \
                 collectives (no .metadata) is complete only when every rank wrote __{{rank}}{DCP_METADATA}; that \
                 rank's save did not finish",
                storage.location()
            )),
        });
    }
    let mut merged = DcpMetadata { tensors: Vec::new(), bytes: Vec::new(), save_id: None };
    // fqn -> (index in merged.tensors, the file that described it first, its chunk boxes).
    let mut tensors: BTreeMap<String, (usize, String, BTreeSet<ChunkBox>)> = BTreeMap::new();
    let mut bytes: BTreeMap<String, String> = BTreeMap::new();
    for rank in std::mem::take(&mut ranks) {
        let name = format!("__{rank}{DCP_METADATA}");
        let shown = format!("{}/{name}", storage.location());
        let data = storage.read(&name)?;
        let pickle = unpickle_view(&data, &shown, &limits())?;
        let meta: DcpMetadata = parse_metadata(pickle.root()).map_err(|e| Error::corrupt(&shown, e))?;
        let conflict = |key: &str, here: String, first: &str, there: String| {
            Error::corrupt(
                &shown,
                format!("{key:?} is {here} here but {there} in {first}: the ranks' metadata disagree"),
            )
        };
        for t in meta.tensors {
            if let Some(first) = bytes.get(&t.fqn) {
                return Err(conflict(&t.fqn, "a tensor".into(), first, "a value".into()));
            }
            match tensors.get_mut(&t.fqn) {
                None => {
                    let boxes = t.chunks.iter().map(|c| (c.offsets.clone(), c.sizes.clone())).collect();
                    tensors.insert(t.fqn.clone(), (merged.tensors.len(), name.clone(), boxes));
                    merged.tensors.push(t);
                }
                Some((i, first, boxes)) => {
                    let have = &mut merged.tensors[*i];
                    if have.dtype != t.dtype || have.size != t.size {
                        return Err(conflict(
                            &t.fqn,
                            format!("{} of shape {:?}", t.dtype.name(), t.size),
                            first,
                            format!("{} of shape {:?}", have.dtype.name(), have.size),
                        ));
                    }
                    for c in t.chunks {
                        if boxes.insert((c.offsets.clone(), c.sizes.clone())) {
                            have.chunks.push(c);
                        }
                    }
                }
            }
        }
        for b in meta.bytes {
            if let Some((_, first, _)) = tensors.get(&b.fqn) {
                return Err(conflict(&b.fqn, "a value".into(), first, "a tensor".into()));
            }
            if !bytes.contains_key(&b.fqn) {
                bytes.insert(b.fqn.clone(), name.clone());
                merged.bytes.push(b);
            }
        }
    }
    Ok((merged, format!("{}/__{{rank}}{DCP_METADATA}", storage.location())))
}

/// `"key/shard_0.1_2.4"` → `("key", [0, 1], [2, 4])`: Megatron's name for a sharded object.
pub(crate) fn parse_object_fqn(fqn: &str) -> Option<(&str, Vec<u64>, Vec<u64>)> {
    let (key, rest) = fqn.rsplit_once("/shard_")?;
    let (off, shape) = rest.split_once('_')?;
    let dims = |s: &str| -> Option<Vec<u64>> { s.split('.').map(|x| x.parse().ok()).collect() };
    let (off, shape) = (dims(off)?, dims(shape)?);
    (off.len() == shape.len() && off.iter().zip(&shape).all(|(o, s)| o < s)).then_some((key, off, shape))
}

fn open_dcp(storage: &dyn Storage, flavor: DcpFlavor) -> Result<(CheckpointIndex, ForeignView<'_>)> {
    let mut view = ForeignView::new(storage, flavor.prefix());
    let (meta, shown) = read_metadata(storage, flavor)?;
    let meta_save_id = meta.save_id.clone();

    let mut tensors = Vec::with_capacity(meta.tensors.len());
    for t in meta.tensors {
        let esize = t.dtype.size() as u64;
        let mut chunks = Vec::with_capacity(t.chunks.len());
        // One key for the sources of all the tensor's chunks (a tensor may have thousands).
        let key: Arc<str> = Arc::from(t.fqn.as_str());
        for c in t.chunks {
            let bytes = c.sizes.iter().try_fold(esize, |a, &s| a.checked_mul(s));
            let name = format!("{}@{}", c.location.relative_path, c.location.offset);
            let (offset, shape) = (c.offsets.as_slice().into(), c.sizes.as_slice().into());
            let source = Source::DcpTensor { item: c.location, dtype: t.dtype, shape: c.sizes, key: key.clone() };
            let file =
                view.add(name, Some(bytes.ok_or_else(|| Error::corrupt(&shown, "chunk size overflows"))?), source);
            chunks.push(StoredChunk { file, byte_offset: 0, offset, shape, flat: None, crcs: Crcs::new() });
        }
        tensors.push(TensorEntry::new(t.fqn, t.dtype, t.size, chunks));
    }

    let mut objects = ObjectShards::default();
    let mut common: Vec<(StatePath, Value)> = Vec::with_capacity(meta.bytes.len());
    let mut common_object: Option<PickleValue> = None;
    // Megatron's common state is common.pt. A torch_dist copy tessera writes holds its values
    // there and also as DCP byte items (what DCP's load reads): a byte item under a top-level
    // key common.pt has is the same value again, and is not read.
    let megatron_common = match flavor {
        DcpFlavor::Megatron => {
            view.megatron_common(meta_save_id.as_deref().and_then(crate::formats::torch_dist::committed_common))?
        }
        _ => None,
    };
    let in_common_pt: BTreeSet<&str> = megatron_common
        .iter()
        .flatten()
        .filter_map(|(path, _)| match path.first() {
            Some(PathSeg::Key(k)) => Some(k.as_str()),
            _ => None,
        })
        .collect();
    // Taken from the end, in order, and the vector shrunk as it empties: the items given back
    // as common values are not also held as items (a million of them are 96 MB).
    let mut items = meta.bytes;
    items.reverse();
    while let Some(b) = items.pop() {
        if items.len().is_multiple_of(1 << 16) {
            items.shrink_to_fit();
        }
        if flavor == DcpFlavor::Megatron {
            if let Some((key, offset, shape)) = parse_object_fqn(&b.fqn) {
                if key == MEGATRON_COMMON_OBJECT {
                    let archive = view.read_item(&b.location, None, &b.fqn)?;
                    let v =
                        view.decode_value(&archive, &format!("{}/{}", storage.location(), b.location.relative_path))?;
                    common_object = Some(match v {
                        PickleValue::List(mut xs) if xs.len() == 1 => xs.pop().unwrap(),
                        other => other,
                    });
                    continue;
                }
                let name = format!("{}@{}", b.location.relative_path, b.location.offset);
                let file = view.add(
                    name,
                    None,
                    Source::DcpObject { item: b.location, key: key.to_string(), list_wrapped: true },
                );
                objects.add(key, offset, shape, file, &shown)?;
                continue;
            }
        }
        let top = match b.path.as_deref().and_then(<[PathSeg]>::first) {
            Some(PathSeg::Key(k)) => k.as_str(),
            Some(PathSeg::Index(_)) => "",
            None => b.fqn.as_str(),
        };
        if in_common_pt.contains(top) {
            continue;
        }
        let archive = view.read_item(&b.location, None, &b.fqn)?;
        let item_shown = format!("{}/{}", storage.location(), b.location.relative_path);
        let v = view.decode_value(&archive, &item_shown)?;
        // A tuple has no plain form that keeps it a tuple (Adam's `betas`; OLMo-core 3.0 reads
        // them back and compares types): such a value, like any other that is not plain, stays
        // its torch.save bytes, from which Python callers rebuild the exact object and which a
        // DCP copy stores again as they are.
        let value = match v.to_plain().filter(|_| !holds_tuple(&v)) {
            Some(p) => p,
            None => Value::Map(vec![(TORCH_SAVE_KEY.to_string(), Value::Bytes(archive))]),
        };
        let path = b.path.unwrap_or_else(|| vec![PathSeg::Key(b.fqn.clone())]);
        common.push((path, value));
    }

    if flavor == DcpFlavor::Megatron {
        match megatron_common {
            Some(entries) => common.extend(entries),
            None => common.extend(common_object.as_ref().map(common_entries).unwrap_or_default()),
        }
    }
    let index = foreign_index(flavor.backend(), &view, common, tensors, objects);
    Ok((index, view))
}

pub(crate) use crate::formats::torch_dist::TORCH_SAVE_KEY;

/// Whether a tuple is anywhere in `v`.
fn holds_tuple(v: &PickleValue) -> bool {
    match v {
        PickleValue::Tuple(_) => true,
        PickleValue::List(items) | PickleValue::Set(items) => items.iter().any(holds_tuple),
        PickleValue::Dict(pairs) => pairs.iter().any(|(k, v)| holds_tuple(k) || holds_tuple(v)),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::{parse_data_file_rank, parse_object_fqn, parse_rank_metadata_name};

    #[test]
    fn per_rank_names() {
        assert_eq!(parse_rank_metadata_name("__0.metadata"), Some(0));
        assert_eq!(parse_rank_metadata_name("__12.metadata"), Some(12));
        for no in [".metadata", "__.metadata", "__1.metadata.tmp", "__+1.metadata", "__99999999999.metadata"] {
            assert_eq!(parse_rank_metadata_name(no), None, "{no}");
        }
        assert_eq!(parse_data_file_rank("__3_0.distcp"), Some(3));
        assert_eq!(parse_data_file_rank("__3_12.distcp"), Some(3));
        for no in ["__3.distcp", "__3_.distcp", "__a_0.distcp", "_3_0.distcp", "__3_0.distcp.tmp"] {
            assert_eq!(parse_data_file_rank(no), None, "{no}");
        }
    }

    #[test]
    fn megatron_object_names() {
        assert_eq!(parse_object_fqn("rng_state/shard_0_4"), Some(("rng_state", vec![0], vec![4])));
        assert_eq!(parse_object_fqn("a/b/shard_1.2_2.4"), Some(("a/b", vec![1, 2], vec![2, 4])));
        assert_eq!(parse_object_fqn("x/shard_4_4"), None);
        assert_eq!(parse_object_fqn("x/shard_1_2.2"), None);
        assert_eq!(parse_object_fqn("model.weight"), None);
    }
}
