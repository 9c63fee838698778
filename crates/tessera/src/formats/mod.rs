//! Read-only backends for checkpoints other programs wrote (PyTorch DCP, Megatron `torch_dist`
//! and `zarr`, OLMo-core: its DCP layout and its own 0.1.x format). Each opens its metadata into a [`CheckpointIndex`] whose "files"
//! are virtual: one per stored chunk or object, served by a [`ForeignView`] over the real
//! storage. The generic loader plans and reads against that index as for the native format, so
//! every load API works unchanged; the view turns a read of a virtual file into a ranged read of
//! the real bytes (uncompressed tensor data is located inside its item once, then read in place)
//! or, when the bytes must be decoded first (zstd items, strided tensors, padded zarr chunks,
//! objects), into a read of a decoded copy kept in a bounded cache.
//!
//! Foreign checkpoints carry no block checksums: their index has `block_size == 0` and no block
//! crcs, and unverified loads read only the requested bytes. Their `torch.save` archives carry
//! a zip CRC-32 per member, which the view checks (see [`ForeignView`]).

pub(crate) mod dcp;
pub(crate) mod dcp_values;
pub(crate) mod olmo;
pub(crate) mod pickle;
pub(crate) mod safetensors;
pub(crate) mod torch_dist;
pub(crate) mod torch_save;
pub(crate) mod zarr;

pub(crate) use crate::model::ForEach;

/// The backend and version a checkpoint says it was written with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FormatRecord {
    /// The program (and layout) that wrote it.
    pub backend: Backend,
    /// Backend version.
    pub version: u32,
}

/// Reads checkpoints of one backend: recognises them and produces their index, which the
/// generic loader then plans against.
pub(crate) trait LoadStrategy: Send + Sync {
    /// Backend read.
    fn backend(&self) -> Backend;
    /// Whether `version` of the backend can be read.
    fn supports_version(&self, version: u32) -> bool;
    /// Human-readable list of supported versions.
    fn supported_versions(&self) -> String;
    /// The record of a checkpoint of this backend at `storage`, or `None` if it is not one.
    fn detect(&self, storage: &dyn Storage) -> Result<Option<FormatRecord>>;
    /// Reads the checkpoint's metadata and, for formats whose index names virtual files (the
    /// foreign formats), the read-only view of `storage` those names resolve in (`None`: the
    /// files are read from `storage` itself).
    fn open_checkpoint<'s>(
        &self,
        storage: &'s dyn Storage,
        for_each: ForEach<'_>,
    ) -> Result<(CheckpointIndex, Option<ForeignView<'s>>)>;
    /// [`LoadStrategy::open_checkpoint`] for a reader that needs the chunks of the tensors
    /// `keys` only: the index MAY move every other tensor from [`CheckpointIndex::tensors`] to
    /// [`CheckpointIndex::omitted_tensors`]. The default opens everything.
    fn open_checkpoint_keys<'s>(
        &self,
        storage: &'s dyn Storage,
        keys: &BTreeSet<String>,
        for_each: ForEach<'_>,
    ) -> Result<(CheckpointIndex, Option<ForeignView<'s>>)> {
        let _ = keys;
        self.open_checkpoint(storage, for_each)
    }
}

/// A safetensors data file's header and its crc32c; `None` if the file does not exist.
pub(crate) type HeaderRead = Option<(crate::format::SafetensorsHeader, u32)>;

/// Reads the safetensors header of `name` (every entry checked against the file's real size:
/// `format::read_header`) and its crc32c, which readers check the header against before
/// reading by it. Shared by the OLMo-core and the plain safetensors strategies.
pub(crate) fn read_safetensors_header(storage: &dyn Storage, name: &str) -> Result<HeaderRead> {
    let shown = format!("{}/{name}", storage.location());
    let Some(size) = storage.size_if_present(name)? else { return Ok(None) };
    let mut crc = 0u32;
    let mut read = |off: u64, buf: &mut [u8]| {
        storage.read_at(name, off, buf)?;
        crc = crate::model::crc::crc32c_append(crc, buf);
        Ok(())
    };
    let header = crate::format::read_header(&mut read, size, &shown)?;
    Ok(Some((header, crc)))
}

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::fmt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use crate::error::{Error, Result};
use crate::format::{Backend, CheckpointIndex, ObjectEntry, StoredObject, TensorEntry};
use crate::formats::dcp::metadata::ItemLocation;
use crate::formats::pickle::PickleValue;
use crate::formats::torch_save::{
    crc32_update, crc_mismatch, decode_archive, find_central_directory, find_entry, gather, inner_name,
    local_header_len, mismatch_message, parse_central_directory, tensor_record, zip_entries, CentralEntry,
    TensorRecord, ZipEntry,
};
use crate::model::dtype::DType;
use crate::model::Value;
use crate::model::{PathSeg, StatePath};
use crate::plan::geometry::{copy_runs, Layout, Piece};
use crate::storage::{check_claimed, read_claimed, ObjectWriter, Storage, StorageExt};

// The payload tags are the torch_dist writer's too: one definition, beside it.
pub use crate::formats::torch_dist::{OBJECT_TAG_TORCH, OBJECT_TAG_TORCH_LIST, OBJECT_TAG_VALUE};

/// Bytes read at each end of a tensor item to find where its data starts: its central
/// directory (≈ 7 entries) at the end, its `data.pkl` (a few hundred bytes) at the start.
const PROBE_BYTES: u64 = 4 << 10;
/// Decoded bytes kept for reuse across reads of the same virtual file.
const CACHE_BYTES: u64 = 512 << 20;
/// Bytes a `torch.save` archive of a tensor holds besides the tensor's data (`data.pkl`,
/// `byteorder`, `version`, the serialization id, zip headers and alignment): a compressed
/// tensor item may decompress to its data size plus this, no more.
const ARCHIVE_SLACK: u64 = 1 << 20;
/// A compressed item with no declared size (an object) may decompress to at most this many
/// times its compressed size, or [`OBJECT_DECODE_FLOOR`] when that is more.
const OBJECT_DECODE_RATIO: u64 = 1024;
/// See [`OBJECT_DECODE_RATIO`].
const OBJECT_DECODE_FLOOR: u64 = 32 << 20;

/// What a virtual file is made of.
#[derive(Debug, Clone)]
pub(crate) enum Source {
    /// A tensor chunk stored as one DCP item (a `torch.save` archive, maybe zstd-compressed).
    DcpTensor { item: ItemLocation, dtype: DType, shape: Vec<u64>, key: Arc<str> },
    /// A value stored as one DCP item, delivered as an object payload.
    DcpObject { item: ItemLocation, key: String, list_wrapped: bool },
    /// A whole file holding a `torch.save` of an object, delivered as an object payload.
    TorchFile { path: String },
    /// Raw C-order bytes at the start of a file whose stored box may be larger than the
    /// virtual one (zarr pads edge chunks to the full chunk shape).
    RawBox { path: String, stored: Vec<u64>, shape: Vec<u64>, esize: u64 },
}

struct VirtualFile {
    name: String,
    size: Option<u64>,
    source: Source,
    /// Where the bytes lie in place, once found (contiguous uncompressed data).
    direct: OnceLock<Option<(String, u64)>>,
    decoding: Mutex<()>,
    /// Set once the zip CRC-32 of every member of the file's `torch.save` archive matched:
    /// a checked read after that (or of a decoded copy cached by an unchecked one) need not
    /// read the member again.
    crcs_checked: OnceLock<()>,
}

/// Recently decoded virtual files, oldest evicted first past the byte budget.
#[derive(Default)]
struct DecodedCache {
    entries: HashMap<usize, Arc<Vec<u8>>>,
    order: VecDeque<usize>,
    bytes: u64,
}

impl DecodedCache {
    fn get(&self, id: usize) -> Option<Arc<Vec<u8>>> {
        self.entries.get(&id).cloned()
    }
    fn put(&mut self, id: usize, data: Arc<Vec<u8>>) {
        self.bytes += data.len() as u64;
        self.entries.insert(id, data);
        self.order.push_back(id);
        while self.bytes > CACHE_BYTES && self.order.len() > 1 {
            let old = self.order.pop_front().unwrap();
            if let Some(d) = self.entries.remove(&old) {
                self.bytes -= d.len() as u64;
            }
        }
    }
}

/// A read-only [`Storage`] over a foreign checkpoint: virtual files as its index names them;
/// any other name reads the real file under the checkpoint's root.
///
/// `torch.save` archives (DCP items, Megatron's `common.pt` and objects) carry a zip CRC-32 per
/// member, their only checksums. A view checks them ([`ForeignView::checks_crcs`]) on every
/// member it reads, as a verified load checks native blocks; [`ForeignView::unchecked`] is
/// the same view for loads with `verify_checksums` off. What the opener reads (common state,
/// byte items) is always checked, as a native index is.
pub(crate) struct ForeignView<'s> {
    base: &'s dyn Storage,
    /// Folder of the checkpoint inside `base` (`""` or `"model_and_optim/"`).
    prefix: String,
    /// The virtual files, shared by the checked and the unchecked view of one checkpoint.
    shared: Arc<ViewFiles>,
    check_crcs: bool,
}

#[derive(Default)]
struct ViewFiles {
    files: Vec<VirtualFile>,
    by_name: HashMap<String, usize>,
    cache: Mutex<DecodedCache>,
}

impl fmt::Debug for ForeignView<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ForeignView")
            .field("base", &self.base.location())
            .field("files", &self.shared.files.len())
            .field("check_crcs", &self.check_crcs)
            .finish()
    }
}

impl<'s> ForeignView<'s> {
    pub(crate) fn new(base: &'s dyn Storage, prefix: &str) -> Self {
        ForeignView { base, prefix: prefix.to_string(), shared: Arc::default(), check_crcs: true }
    }

    /// Adds a virtual file; returns its index (its position in the checkpoint index's files).
    pub(crate) fn add(&mut self, name: String, size: Option<u64>, source: Source) -> u32 {
        let shared = Arc::get_mut(&mut self.shared).expect("virtual files are added before the view is shared");
        let id = shared.files.len();
        shared.by_name.insert(name.clone(), id);
        shared.files.push(VirtualFile {
            name,
            size,
            source,
            direct: OnceLock::new(),
            decoding: Mutex::new(()),
            crcs_checked: OnceLock::new(),
        });
        id as u32
    }

    /// The same view (the same files and cache) without CRC checks.
    pub(crate) fn unchecked(&self) -> ForeignView<'s> {
        ForeignView { base: self.base, prefix: self.prefix.clone(), shared: self.shared.clone(), check_crcs: false }
    }

    /// Names and sizes of the virtual files, in index order.
    pub(crate) fn file_entries(&self) -> Vec<crate::format::FileEntry> {
        self.shared
            .files
            .iter()
            .map(|f| crate::format::FileEntry {
                name: f.name.clone(),
                size: f.size.unwrap_or(0),
                header_len: 0,
                header_crc: 0,
            })
            .collect()
    }

    fn real(&self, path: &str) -> String {
        format!("{}{path}", self.prefix)
    }

    fn shown(&self, path: &str) -> PathBuf {
        format!("{}/{}{path}", self.base.location(), self.prefix).into()
    }

    /// Reads a whole item of `key`, undoing its transforms. Its claimed length is checked
    /// against the real file first; a compressed item decodes to at most `expected` bytes (a
    /// tensor's archive), or a bounded multiple of its compressed size (an object).
    pub(crate) fn read_item(&self, item: &ItemLocation, expected: Option<u64>, key: &str) -> Result<Vec<u8>> {
        let what = format!("item of {key:?}");
        let mut raw = read_claimed(self.base, &self.real(&item.relative_path), item.offset, item.length, &what)?;
        for t in item.transforms.iter().rev() {
            raw = self.untransform(t, &raw, item, expected, key)?;
        }
        Ok(raw)
    }

    fn untransform(
        &self,
        t: &str,
        raw: &[u8],
        item: &ItemLocation,
        expected: Option<u64>,
        key: &str,
    ) -> Result<Vec<u8>> {
        let name = t.split('/').next().unwrap_or(t);
        match name {
            "stream.zstd" | "zstd" => {
                let limit = expected
                    .unwrap_or_else(|| (raw.len() as u64).saturating_mul(OBJECT_DECODE_RATIO).max(OBJECT_DECODE_FLOOR));
                zstd_decode(raw, limit).map_err(|e| {
                    Error::corrupt(
                        self.shown(&item.relative_path),
                        format!("zstd item of {key:?} at offset {} ({} bytes): {e}", item.offset, item.length),
                    )
                })
            }
            _ => Err(Error::IncompatibleVersion {
                found: format!("item transform {t:?} in {}", self.shown(&item.relative_path).display()),
                supported: "stream.zstd".into(),
            }),
        }
    }

    /// Decodes a `torch.save` archive held in a DCP byte item or a file, after checking the
    /// CRC-32 of each of its members (`shown` and the member are named on a mismatch): what
    /// the opener reads this way is checked whatever a later load asks, as a native index is.
    pub(crate) fn decode_value(&self, archive: &[u8], shown: &str) -> Result<PickleValue> {
        self.decode_value_checked(archive, shown, true)
    }

    /// [`ForeignView::decode_value`], checking the CRCs only with `check`.
    fn decode_value_checked(&self, archive: &[u8], shown: &str, check: bool) -> Result<PickleValue> {
        if check {
            check_archive(archive, shown)?;
        }
        decode_archive(archive, shown).map_err(|e| Error::corrupt(shown, format!("torch.save archive: {e}")))
    }

    /// The common state in Megatron's `common.pt`, if the checkpoint has one.
    /// Megatron's `common.pt` as common values; `None` when there is none. `committed`, when the
    /// `.metadata` records the save and the checksum of the `common.pt` it was committed with
    /// (`torch_dist::metadata_save_id`), must match: a `common.pt` of a save that never
    /// committed (an overwrite interrupted between its puts) is not read beside the committed
    /// tensors; the committed one is then read from the copy tessera keeps, or refused.
    pub(crate) fn megatron_common(&self, committed: Option<(u64, u32)>) -> Result<Option<Vec<(StatePath, Value)>>> {
        let name = self.real(dcp::MEGATRON_COMMON);
        match self.base.read(&name) {
            Ok(mut archive) => {
                let mut shown = format!("{}/{name}", self.base.location());
                if let Some((save_id, want)) = committed {
                    let got = crate::model::crc::crc32c(&archive);
                    if got != want {
                        let copy = self.real(&crate::formats::torch_dist::common_copy_name(save_id));
                        match self.base.read(&copy) {
                            Ok(b) if crate::model::crc::crc32c(&b) == want => {
                                archive = b;
                                shown = format!("{}/{copy}", self.base.location());
                            }
                            _ => {
                                return Err(Error::corrupt(
                                    &shown,
                                    format!(
                                        "its checksum is {got:08x}, the committed {} records {want:08x}, and no \
                                         intact copy of that one is kept ({copy}): this common.pt belongs to a save \
                                         that never committed; the tensors are the committed checkpoint's: save \
                                         again",
                                        dcp::DCP_METADATA
                                    ),
                                ));
                            }
                        }
                    }
                }
                Ok(Some(common_entries(&self.decode_value(&archive, &shown)?)))
            }
            Err(Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn item_error(&self, item: &ItemLocation, key: &str, reason: impl fmt::Display) -> Error {
        Error::corrupt(
            self.shown(&item.relative_path),
            format!("item of {key:?} at offset {} ({} bytes): {reason}", item.offset, item.length),
        )
    }

    /// Where an uncompressed, contiguous tensor item keeps its data, from the item's last and
    /// first bytes (central directory; `data.pkl`, written first); `None` if the data must be
    /// decoded instead (compressed, strided, small, or laid out unusually).
    fn locate(&self, item: &ItemLocation, dtype: DType, shape: &[u64], key: &str) -> Result<Option<(String, u64)>> {
        if !item.transforms.is_empty() || item.length <= 2 * PROBE_BYTES {
            return Ok(None);
        }
        let path = self.real(&item.relative_path);
        let read = |off: u64, len: u64| -> Result<Vec<u8>> {
            let mut b = vec![0u8; len as usize];
            self.base.read_at(&path, item.offset + off, &mut b)?;
            Ok(b)
        };
        let err = |e: String| self.item_error(item, key, e);
        let tail_at = item.length - PROBE_BYTES;
        let tail = read(tail_at, PROBE_BYTES)?;
        let Some((cd_off, cd_size, count)) = find_central_directory(&tail, item.length).map_err(err)? else {
            return Ok(None);
        };
        let cd_owned;
        let cd: &[u8] = if cd_off >= tail_at {
            &tail[(cd_off - tail_at) as usize..(cd_off - tail_at + cd_size) as usize]
        } else if cd_size <= 1 << 20 {
            cd_owned = read(cd_off, cd_size)?;
            &cd_owned
        } else {
            return Ok(None);
        };
        let entries = parse_central_directory(cd, count, item.length).map_err(err)?;
        let inner = |e: &CentralEntry, want: &str| inner_name(&e.name) == want;
        let pkl = entries.iter().find(|e| inner(e, "data.pkl")).ok_or_else(|| err("no data.pkl".into()))?;
        let head = read(0, PROBE_BYTES)?;
        let in_head = |off: u64, len: u64| off.checked_add(len).is_some_and(|e| e <= PROBE_BYTES);
        if !in_head(pkl.local_offset, 30) {
            return Ok(None);
        }
        let hl = local_header_len(&head[pkl.local_offset as usize..]).map_err(err)?.unwrap_or(u64::MAX);
        let pkl_at = pkl.local_offset.saturating_add(hl);
        if !in_head(pkl_at, pkl.size) {
            return Ok(None);
        }
        let rec = self.record(&head[pkl_at as usize..(pkl_at + pkl.size) as usize], item, key)?;
        check_record(&rec, dtype, shape).map_err(err)?;
        if !rec.is_contiguous() {
            return Ok(None);
        }
        let storage_name = format!("data/{}", rec.storage_key);
        let data = entries
            .iter()
            .find(|e| inner(e, &storage_name))
            .ok_or_else(|| err(format!("no storage entry {storage_name}")))?;
        let header = if in_head(data.local_offset, 30) {
            head[data.local_offset as usize..].to_vec()
        } else {
            read(data.local_offset, 30)?
        };
        let hl = local_header_len(&header).map_err(err)?.ok_or_else(|| err("short local header".into()))?;
        let data_at = data.local_offset + hl;
        let es = dtype.size() as u64;
        let start = rec.storage_offset * es;
        let len = rec.numel() * es;
        if start.checked_add(len).is_none_or(|e| e > data.size) || data_at + data.size > item.length {
            return Err(err(format!(
                "tensor bytes {start}..{} fall outside its {}-byte storage or the item",
                start + len,
                data.size
            )));
        }
        Ok(Some((path.clone(), item.offset + data_at + start)))
    }

    fn record(&self, pkl: &[u8], item: &ItemLocation, key: &str) -> Result<TensorRecord> {
        let shown = self.shown(&item.relative_path);
        let v = crate::formats::pickle::unpickle(pkl, &shown.to_string_lossy(), &crate::formats::torch_save::limits())?;
        tensor_record(&v).map_err(|e| self.item_error(item, key, e))
    }

    /// The decoded bytes of a virtual file (its archive's CRCs checked first when this view
    /// checks them: a copy an unchecked read left in the cache is decoded again, checked).
    fn materialize(&self, id: usize) -> Result<Arc<Vec<u8>>> {
        let f = &self.shared.files[id];
        // Evaluated again under the lock: another read may have checked the file meanwhile.
        let must_check = || self.check_crcs && f.crcs_checked.get().is_none() && f.source.has_crcs();
        let cached = |check: bool| if check { None } else { self.shared.cache.lock().unwrap().get(id) };
        if let Some(d) = cached(must_check()) {
            return Ok(d);
        }
        let _one_at_a_time = f.decoding.lock().unwrap();
        let check = must_check();
        if let Some(d) = cached(check) {
            return Ok(d);
        }
        let data = Arc::new(self.decode(&f.source, check)?);
        if check {
            let _ = f.crcs_checked.set(());
        }
        if let Some(size) = f.size {
            if data.len() as u64 != size {
                return Err(Error::corrupt(
                    self.shown(&f.name),
                    format!("decoded {} bytes, expected {size}", data.len()),
                ));
            }
        }
        self.shared.cache.lock().unwrap().put(id, data.clone());
        Ok(data)
    }

    /// The bytes of `source`, decoded; with `check`, after the CRC-32 of every member of its
    /// archive matched.
    fn decode(&self, source: &Source, check: bool) -> Result<Vec<u8>> {
        match source {
            Source::DcpTensor { item, dtype, shape, key } => {
                let nbytes = shape.iter().product::<u64>() * dtype.size() as u64;
                let archive = self.read_item(item, Some(nbytes.saturating_add(ARCHIVE_SLACK)), key)?;
                let entries: Vec<ZipEntry> = zip_entries(&archive).map_err(|e| self.item_error(item, key, e))?;
                if let Some(m) = entries.iter().filter(|_| check).find_map(|e| crc_mismatch(&archive, e)) {
                    return Err(self.item_error(item, key, m));
                }
                let pkl = find_entry(&entries, "data.pkl").ok_or_else(|| self.item_error(item, key, "no data.pkl"))?;
                let rec =
                    self.record(&archive[pkl.data_offset as usize..(pkl.data_offset + pkl.size) as usize], item, key)?;
                check_record(&rec, *dtype, shape).map_err(|e| self.item_error(item, key, e))?;
                let e = find_entry(&entries, &format!("data/{}", rec.storage_key))
                    .ok_or_else(|| self.item_error(item, key, format!("no storage entry data/{}", rec.storage_key)))?;
                gather(&archive[e.data_offset as usize..(e.data_offset + e.size) as usize], &rec)
                    .map_err(|e| self.item_error(item, key, e))
            }
            Source::DcpObject { item, key, list_wrapped } => {
                let archive = self.read_item(item, None, key)?;
                if let Some(m) = self.archive_mismatch(&archive, check) {
                    return Err(self.item_error(item, key, m));
                }
                let shown = self.shown(&item.relative_path).to_string_lossy().into_owned();
                let value = self.decode_value_checked(&archive, &shown, false)?;
                let inner = if *list_wrapped {
                    match &value {
                        PickleValue::List(xs) if xs.len() == 1 => &xs[0],
                        other => {
                            return Err(self.item_error(
                                item,
                                key,
                                format!("expected a one-element list around the object, found {other:?}"),
                            ))
                        }
                    }
                } else {
                    &value
                };
                let tag = if *list_wrapped { OBJECT_TAG_TORCH_LIST } else { OBJECT_TAG_TORCH };
                Ok(object_payload(inner, tag, archive))
            }
            Source::TorchFile { path } => {
                let archive = self.base.read(&self.real(path))?;
                let shown = self.shown(path).to_string_lossy().into_owned();
                let value = self.decode_value_checked(&archive, &shown, check)?;
                Ok(object_payload(&value, OBJECT_TAG_TORCH, archive))
            }
            Source::RawBox { path, stored, shape, esize } => {
                // The box's rows inside the stored (padded) chunk: the runs copy_runs finds.
                let real = self.real(path);
                let stored_bytes = stored.iter().try_fold(*esize, |a, &n| a.checked_mul(n)).unwrap_or(u64::MAX);
                check_claimed(self.base, &real, 0, stored_bytes, &format!("chunk {path:?} of shape {stored:?}"))?;
                // The box is inside the stored chunk, so no larger than what was just checked.
                let mut out = vec![0u8; (shape.iter().product::<u64>() * esize) as usize];
                let origin = vec![0u64; shape.len()];
                let src = Layout { box_off: &origin, box_shape: stored, base: 0 };
                let dst = Layout { box_off: &origin, box_shape: shape, base: 0 };
                let mut result = Ok(());
                copy_runs(src, dst, &Piece::new(&origin, shape), &mut |s, d, len| {
                    if result.is_ok() {
                        let (at, n) = ((d * esize) as usize, (len * esize) as usize);
                        result = self.base.read_at(&real, s * esize, &mut out[at..at + n]);
                    }
                });
                result.map(|()| out)
            }
        }
    }

    /// The first member of `archive` whose CRC-32 does not match (with `check`; a damaged
    /// directory is left to the decoder, which reports it).
    fn archive_mismatch(&self, archive: &[u8], check: bool) -> Option<String> {
        let entries = zip_entries(archive).ok().filter(|_| check)?;
        entries.iter().find_map(|e| crc_mismatch(archive, e))
    }

    /// Checks in place the CRC-32 of every member of the (untransformed) tensor item `item`:
    /// its central directory from the item's end, then each member's bytes streamed in pieces,
    /// so memory stays bounded whatever the item's size.
    fn check_item_in_place(&self, item: &ItemLocation, key: &str) -> Result<()> {
        const PIECE: u64 = 1 << 20;
        let path = self.real(&item.relative_path);
        let err = |e: String| self.item_error(item, key, e);
        let read = |off: u64, len: u64| -> Result<Vec<u8>> {
            let mut b = vec![0u8; len as usize];
            self.base.read_at(&path, item.offset + off, &mut b)?;
            Ok(b)
        };
        let tail_at = item.length.saturating_sub(PROBE_BYTES);
        let tail = read(tail_at, item.length - tail_at)?;
        let (cd_off, cd_size, count) = find_central_directory(&tail, item.length)
            .map_err(err)?
            .ok_or_else(|| err("zip64 records before the item's last bytes".into()))?;
        if cd_size > 64 << 20 {
            return Err(err(format!("a {cd_size}-byte central directory for one tensor")));
        }
        let cd = read(cd_off, cd_size)?;
        let mut piece = Vec::new();
        for e in parse_central_directory(&cd, count, item.length).map_err(err)? {
            let header = read(e.local_offset, 30)?;
            let hl = local_header_len(&header).map_err(err)?.ok_or_else(|| err("short local header".into()))?;
            let start = e.local_offset + hl;
            if start.checked_add(e.size).is_none_or(|end| end > item.length) {
                return Err(err(format!("zip member {:?} runs past the item", e.name)));
            }
            let (mut at, mut crc) = (0u64, 0u32);
            while at < e.size {
                let n = PIECE.min(e.size - at);
                piece.resize(n as usize, 0);
                self.base.read_at(&path, item.offset + start + at, &mut piece)?;
                crc = crc32_update(crc, &piece);
                at += n;
            }
            if crc != e.crc {
                return Err(err(mismatch_message(&e.name, crc, e.crc)));
            }
        }
        Ok(())
    }

    fn vfile(&self, name: &str) -> Option<usize> {
        self.shared.by_name.get(name).copied()
    }
}

impl Source {
    /// Whether the source is a `torch.save` archive, with zip CRC-32s to check.
    fn has_crcs(&self) -> bool {
        !matches!(self, Source::RawBox { .. })
    }
}

/// Checks the CRC-32 of every member of the `torch.save` archive `archive` (held by `shown`).
fn check_archive(archive: &[u8], shown: &str) -> Result<()> {
    let entries = zip_entries(archive).map_err(|e| Error::corrupt(shown, format!("torch.save archive: {e}")))?;
    match entries.iter().find_map(|e| crc_mismatch(archive, e)) {
        Some(m) => Err(Error::corrupt(shown, m)),
        None => Ok(()),
    }
}

/// Checks a tensor record against what the metadata promised.
fn check_record(rec: &TensorRecord, dtype: DType, shape: &[u64]) -> std::result::Result<(), String> {
    if rec.dtype != dtype {
        return Err(format!("stored dtype {} but the metadata says {}", rec.dtype.name(), dtype.name()));
    }
    if rec.size != shape {
        return Err(format!("stored shape {:?} but the metadata says {shape:?}", rec.size));
    }
    Ok(())
}

/// The payload the object APIs return: the plain value when there is one, else the raw
/// `torch.save` bytes under `torch_tag` (see FORMAT.md, "Objects of foreign checkpoints").
fn object_payload(value: &PickleValue, torch_tag: &[u8; 4], archive: Vec<u8>) -> Vec<u8> {
    match value.to_plain() {
        Some(v) => {
            let mut out = OBJECT_TAG_VALUE.to_vec();
            out.extend_from_slice(&v.to_bytes());
            out
        }
        None => {
            let mut out = torch_tag.to_vec();
            out.extend_from_slice(&archive);
            out
        }
    }
}

/// A common-state value from a decoded pickle: plain when it is, else the lossy rendering.
pub(crate) fn common_value(v: &PickleValue) -> Value {
    v.to_plain().unwrap_or_else(|| v.to_value_lossy())
}

/// Entries of a common-state dict: one per top-level key (plain values where possible); any
/// other value is one entry, `common`.
pub(crate) fn common_entries(v: &PickleValue) -> Vec<(StatePath, Value)> {
    match v {
        PickleValue::Dict(items) if items.iter().all(|(k, _)| matches!(k, PickleValue::Str(_))) => items
            .iter()
            .map(|(k, v)| {
                let PickleValue::Str(k) = k else { unreachable!() };
                (vec![PathSeg::Key(k.clone())], common_value(v))
            })
            .collect(),
        other => vec![(vec![PathSeg::Key("common".into())], common_value(other))],
    }
}

/// The sharded objects of a foreign checkpoint, gathered shard by shard as they are found.
#[derive(Default)]
pub(crate) struct ObjectShards(BTreeMap<String, ObjectEntry>);

impl ObjectShards {
    /// Adds the shard at grid position `offset` of `key`'s `grid`, stored in virtual file
    /// `file`; shards of one key must agree on the grid, of at most
    /// [`MAX_AXES`](crate::model::dims::MAX_AXES) axes (`shown` names the file otherwise).
    pub(crate) fn add(&mut self, key: &str, offset: Vec<u64>, grid: Vec<u64>, file: u32, shown: &str) -> Result<()> {
        crate::model::dims::check_axes(grid.len())
            .map_err(|e| Error::corrupt(shown, format!("object {key:?}: the grid has {e}")))?;
        let entry = self.0.entry(key.to_string()).or_insert_with(|| ObjectEntry {
            key: key.to_string(),
            global_shape: grid.clone(),
            shards: Vec::new(),
        });
        if entry.global_shape != grid {
            return Err(Error::corrupt(
                shown,
                format!("object {key:?}: shards disagree on the grid ({:?} vs {grid:?})", entry.global_shape),
            ));
        }
        entry.shards.push(StoredObject { offset, file, byte_offset: 0, len: 0, crc: 0 });
        Ok(())
    }
}

/// The index of a foreign checkpoint read through `view`: no checksums (`block_size` 0), keys
/// and shards sorted as the loader's lookups need.
pub(crate) fn foreign_index(
    backend: Backend,
    view: &ForeignView<'_>,
    common: Vec<(StatePath, Value)>,
    tensors: Vec<TensorEntry>,
    objects: ObjectShards,
) -> CheckpointIndex {
    let mut index = CheckpointIndex {
        backend,
        version: 1,
        block_size: 0,
        content_metadata: Value::Null,
        common,
        files: view.file_entries(),
        tensors,
        objects: objects.0.into_values().collect(),
        omitted_tensors: Vec::new(),
    };
    index.sort_entries();
    index
}

/// Decodes a zstd stream, streaming, into at most `limit` bytes: output past that is an error,
/// found after decoding at most 64 KiB past the limit, never by decoding everything first.
fn zstd_decode(raw: &[u8], limit: u64) -> std::result::Result<Vec<u8>, String> {
    use std::io::Read;
    let mut dec = ruzstd::decoding::StreamingDecoder::new(raw).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    let mut piece = vec![0u8; 64 << 10];
    loop {
        let n = dec.read(&mut piece).map_err(|e| e.to_string())?;
        if n == 0 {
            return Ok(out);
        }
        if out.len() as u64 + n as u64 > limit {
            return Err(format!("decompresses past {limit} bytes, more than the item may hold"));
        }
        out.extend_from_slice(&piece[..n]);
    }
}

impl Storage for ForeignView<'_> {
    fn is_local(&self) -> bool {
        // Never, whatever the base: a decoded file is served from a bounded cache, and reading
        // it in small pieces could decode it again for each piece once the cache has let it go.
        false
    }

    fn location(&self) -> String {
        format!(
            "{}{}",
            self.base.location(),
            self.prefix.strip_suffix('/').map(|p| format!("/{p}")).unwrap_or_default()
        )
    }

    fn size(&self, name: &str) -> Result<u64> {
        match self.vfile(name) {
            Some(id) => match self.shared.files[id].size {
                Some(s) => Ok(s),
                None => Ok(self.materialize(id)?.len() as u64),
            },
            None => self.base.size(&self.real(name)),
        }
    }

    fn read_at(&self, name: &str, offset: u64, buf: &mut [u8]) -> Result<()> {
        let Some(id) = self.vfile(name) else { return self.base.read_at(&self.real(name), offset, buf) };
        let f = &self.shared.files[id];
        if let Source::DcpTensor { item, dtype, shape, key } = &f.source {
            if f.direct.get().is_none() {
                let _ = f.direct.set(self.locate(item, *dtype, shape, key)?);
            }
            if let Some((path, start)) = f.direct.get().expect("located above") {
                if self.check_crcs && f.crcs_checked.get().is_none() {
                    self.check_item_in_place(item, key)?;
                    let _ = f.crcs_checked.set(());
                }
                let size = f.size.unwrap_or(0);
                if offset.checked_add(buf.len() as u64).is_none_or(|e| e > size) {
                    return Err(Error::corrupt(
                        self.shown(&f.name),
                        format!("{} bytes at {offset} are past the end of the {size}-byte tensor chunk", buf.len()),
                    ));
                }
                return self.base.read_at(path, start + offset, buf);
            }
        }
        if let Source::RawBox { path, stored, shape, .. } = &f.source {
            if stored == shape {
                return self.base.read_at(&self.real(path), offset, buf);
            }
        }
        let data = self.materialize(id)?;
        let end = offset.checked_add(buf.len() as u64).filter(|&e| e <= data.len() as u64);
        match end {
            Some(_) => {
                buf.copy_from_slice(&data[offset as usize..offset as usize + buf.len()]);
                Ok(())
            }
            None => Err(Error::corrupt(
                self.shown(&f.name),
                format!("{} bytes at {offset} are past its {}-byte end", buf.len(), data.len()),
            )),
        }
    }

    fn read(&self, name: &str) -> Result<Vec<u8>> {
        match self.vfile(name) {
            Some(id) => Ok(self.materialize(id)?.as_ref().clone()),
            None => self.base.read(&self.real(name)),
        }
    }

    fn create(&self, name: &str, _size: u64) -> Result<Box<dyn ObjectWriter>> {
        Err(read_only(name))
    }

    fn put_atomic(&self, name: &str, _bytes: &[u8]) -> Result<()> {
        Err(read_only(name))
    }

    fn put_if_absent(&self, name: &str, _bytes: &[u8]) -> Result<()> {
        Err(read_only(name))
    }

    fn list(&self) -> Result<Vec<String>> {
        Ok(self.shared.files.iter().map(|f| f.name.clone()).collect())
    }

    fn delete(&self, name: &str) -> Result<()> {
        Err(read_only(name))
    }
}

fn read_only(name: &str) -> Error {
    Error::invalid(format!("{name:?}: checkpoints in foreign formats are read-only; convert them to write"))
}
