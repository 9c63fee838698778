//! Strategies keyed by (backend, version), as in Megatron's strategy registry. A checkpoint
//! records its backend and version; load asks every registered loader to recognise the
//! location and then picks one that supports the recorded version.

use std::collections::BTreeSet;

use crate::error::{Error, Result};
use crate::format::{Backend, CheckpointIndex, FORMAT_VERSION, INDEX_FILE, NATIVE_BACKEND};
use crate::formats::dcp::{DcpFlavor, DcpStrategy};
use crate::formats::olmo::OlmoStrategy;
use crate::formats::safetensors::SafetensorsStrategy;
use crate::formats::zarr::ZarrStrategy;
use crate::formats::{ForEach, ForeignView, FormatRecord, LoadStrategy};
use crate::load::index_read::open_native_keys;
use crate::plan::validate::validate_index;
use crate::storage::{Storage, StorageExt};

/// The native format (writes [`FORMAT_VERSION`], reads versions 1 and 2).
#[derive(Debug, Default, Clone, Copy)]
pub struct NativeStrategy;

impl LoadStrategy for NativeStrategy {
    fn backend(&self) -> Backend {
        Backend::Tessera
    }
    fn supports_version(&self, version: u32) -> bool {
        (1..=FORMAT_VERSION).contains(&version)
    }
    fn supported_versions(&self) -> String {
        format!("{NATIVE_BACKEND} v1, v{FORMAT_VERSION}")
    }
    fn detect(&self, storage: &dyn Storage) -> Result<Option<FormatRecord>> {
        let Some(size) = storage.size_if_present(INDEX_FILE)? else { return Ok(None) };
        let mut head = vec![0u8; size.min(12) as usize];
        storage.read_at(INDEX_FILE, 0, &mut head)?;
        match CheckpointIndex::peek_version(&head) {
            Some(version) => Ok(Some(FormatRecord { backend: Backend::Tessera, version })),
            None => Err(Error::corrupt(index_path(storage), "not a tessera index (bad magic or truncated header)")),
        }
    }
    fn open_checkpoint<'s>(
        &self,
        storage: &'s dyn Storage,
        _: ForEach<'_>,
    ) -> Result<(CheckpointIndex, Option<ForeignView<'s>>)> {
        let bytes = storage.read(INDEX_FILE)?;
        Ok((CheckpointIndex::from_bytes(&bytes, &index_path(storage).to_string_lossy())?, None))
    }
    fn open_checkpoint_keys<'s>(
        &self,
        storage: &'s dyn Storage,
        keys: &BTreeSet<String>,
        _: ForEach<'_>,
    ) -> Result<(CheckpointIndex, Option<ForeignView<'s>>)> {
        Ok((open_native_keys(storage, keys)?, None))
    }
}

/// Threads for a format's per-file reads when it opens (headers of many rank files): latency,
/// not bandwidth, bounds them.
const OPEN_THREADS: usize = 16;

/// The [`ForEach`] formats open with: up to [`OPEN_THREADS`] threads.
fn parallel_open(n: usize, work: &(dyn Fn(usize) + Sync)) {
    crate::threads::parallel_for(n, OPEN_THREADS, work);
}

fn index_path(storage: &dyn Storage) -> std::path::PathBuf {
    format!("{}/{INDEX_FILE}", storage.location()).into()
}

/// Every format tessera reads, in the order detection asks them: the native format first, plain
/// safetensors last (tessera's own data files are safetensors too).
fn strategies() -> [&'static dyn LoadStrategy; 7] {
    [
        &NativeStrategy,
        &OlmoStrategy,
        &DcpStrategy(DcpFlavor::Megatron),
        &DcpStrategy(DcpFlavor::Torch),
        &DcpStrategy(DcpFlavor::Olmo),
        &ZarrStrategy,
        &SafetensorsStrategy,
    ]
}

/// Recognises the checkpoint at `storage`: its format record and the strategy to load it.
pub(crate) fn detect_format(storage: &dyn Storage) -> Result<(FormatRecord, &'static dyn LoadStrategy)> {
    let loaders = strategies();
    for l in loaders {
        if let Some(record) = l.detect(storage)? {
            if let Some(s) =
                loaders.iter().find(|s| s.backend() == record.backend && s.supports_version(record.version))
            {
                return Ok((record, *s));
            }
            let supported: Vec<String> =
                loaders.iter().filter(|s| s.backend() == record.backend).map(|s| s.supported_versions()).collect();
            return Err(Error::IncompatibleVersion {
                found: format!("{} v{}", record.backend, record.version),
                supported: supported.join(", "),
            });
        }
    }
    if storage.list()?.is_empty() {
        Err(Error::not_found(storage.location()))
    } else {
        Err(Error::not_committed(storage.location()))
    }
}

/// What a reader finds no checkpoint in (the markers of the formats it reads), for messages.
const LOOKED_FOR: &str =
    "found neither tessera.index (tessera), .metadata or __<rank>.metadata (PyTorch DCP, Megatron torch_dist), \
                          metadata.json (Megatron, OLMo-core), model_and_optim/ (OLMo-core) nor *.safetensors";

/// Names (relative to a folder) that make it a checkpoint a reader opens: a format's marker.
fn is_checkpoint_marker(rest: &str) -> bool {
    matches!(
        rest,
        INDEX_FILE
            | ".metadata"
            | "metadata.json"
            | "model_and_optim/.metadata"
            | "model/metadata.json"
            | "optim/metadata.json"
            | "model.safetensors.index.json"
    ) || (rest.ends_with(".safetensors") && !rest.contains('/'))
        || crate::formats::dcp::parse_rank_metadata_name(rest).is_some()
}

/// Up to five names, and how many there are in all when more.
fn some_of(names: &[String]) -> String {
    let shown: Vec<&str> = names.iter().take(5).map(String::as_str).collect();
    let more = if names.len() > shown.len() { format!(", … ({} in all)", names.len()) } else { String::new() };
    format!("{}{more}", shown.join(", "))
}

/// `err` of a reader's detection, with what the location holds and what to do when it says
/// the location holds no checkpoint (its `detail`): the location is listed, here only, so
/// that a save's look at its destination costs no more than detection.
fn explained(storage: &dyn Storage, err: Error) -> Error {
    let location = storage.location();
    match err {
        Error::NotFound { path, detail: None } if path.as_os_str() == location.as_str() => {
            let detail = absence(storage, false);
            Error::NotFound { path, detail }
        }
        Error::NotCommitted { path, detail: None } if path.as_os_str() == location.as_str() => {
            let detail = absence(storage, true);
            Error::NotCommitted { path, detail }
        }
        other => other,
    }
}

/// What a location holding no checkpoint holds, and what to do; `None` when it cannot be
/// listed. `files_there`: detection found files at its top (not committed) rather than none.
fn absence(storage: &dyn Storage, files_there: bool) -> Option<String> {
    let at = storage.location();
    let files = storage.list().ok()?;
    let all = storage.list_recursive().unwrap_or_default();
    let mut checkpoints = std::collections::BTreeSet::new();
    let mut folders = std::collections::BTreeSet::new();
    for name in &all {
        if let Some((folder, rest)) = name.split_once('/') {
            if is_checkpoint_marker(rest) {
                checkpoints.insert(folder.to_string());
            } else {
                folders.insert(folder.to_string());
            }
        }
    }
    let folders: Vec<String> = folders.difference(&checkpoints).map(|f| format!("{f}/")).collect();
    let checkpoints: Vec<String> = checkpoints.into_iter().map(|f| format!("{f}/")).collect();
    // A local directory (a location without a URL scheme, as every local storage has).
    let local = !at.contains("://");
    Some(if !checkpoints.is_empty() {
        format!("no checkpoint in {at}: it holds {} (checkpoints): pass one of them", some_of(&checkpoints))
    } else if files.is_empty() && folders.is_empty() {
        if local && !std::path::Path::new(&at).exists() {
            format!("no checkpoint at {at}: no such directory")
        } else if local {
            format!("no checkpoint in {at}: the directory is empty")
        } else {
            format!("no checkpoint at {at}: nothing is stored there")
        }
    } else if files.is_empty() {
        format!(
            "no checkpoint in {at}: {LOOKED_FOR}; it holds only folders, none of them a checkpoint: {}",
            some_of(&folders)
        )
    } else {
        let data = files.iter().filter(|n| n.ends_with(".safetensors") || n.ends_with(".distcp")).count();
        if files_there && data > 0 {
            format!(
                "no committed checkpoint in {at}: {LOOKED_FOR}, but {data} data file(s) of a save that never \
                 finished (or was interrupted); `tessera gc {at}` removes them"
            )
        } else {
            let mut files = files;
            files.sort();
            format!("no checkpoint in {at}: {LOOKED_FOR}; it holds {}", some_of(&files))
        }
    })
}

/// Opens the index of any recognised checkpoint. For a foreign format (DCP, Megatron, OLMo-core)
/// the index names virtual files: read its data through [`open_checkpoint`] instead.
pub(crate) fn open_index(storage: &dyn Storage) -> Result<CheckpointIndex> {
    let (record, strategy) = detect_format(storage)?;
    let (index, _) = strategy.open_checkpoint(storage, &parallel_open)?;
    validate_index(&index, &metadata_path(storage, &record))?;
    Ok(index)
}

/// The file a checkpoint's index comes from, as errors name it.
fn metadata_path(storage: &dyn Storage, record: &FormatRecord) -> String {
    let file = match record.backend {
        Backend::Tessera => INDEX_FILE,
        // A save without collectives has no `.metadata`: its index is every rank's merged.
        Backend::TorchDcp if !storage.exists(".metadata").unwrap_or(true) => "__<rank>.metadata",
        Backend::TorchDcp | Backend::TorchDist => ".metadata",
        Backend::OlmoCore => "model_and_optim/.metadata",
        Backend::OlmoSafetensors | Backend::Zarr => "metadata.json",
        Backend::Safetensors => return storage.location().to_string(),
    };
    format!("{}/{file}", storage.location())
}

impl FormatRecord {
    /// The format and version of the checkpoint at `storage`, recognised from its own marker
    /// files alone: nothing else is read or validated (that is [`open`]'s work).
    ///
    /// ```
    /// use tessera::index::FormatRecord;
    /// use tessera::storage::MemoryStorage;
    ///
    /// assert!(matches!(FormatRecord::detect(&MemoryStorage::new()), Err(tessera::Error::NotFound { .. })));
    /// ```
    pub fn detect(storage: &dyn Storage) -> Result<FormatRecord> {
        detect_format(storage).map(|(record, _)| record).map_err(|e| explained(storage, e))
    }
}

/// A checkpoint opened for reading, in any format tessera reads: what it is ([`Checkpoint::format`]),
/// its validated index ([`Checkpoint::index`]), and every read operation (`load`,
/// `read_tensors`, `common_state`, `load_objects`, `tensors_metadata`, `content_metadata`).
/// Opening once and reading many times reuses the decoded index.
///
/// ```
/// use tessera::{open, save, DType, SaveOptions, ShardedTensor, StateTree, TensorData};
/// use tessera::comm::SoloComm;
/// use tessera::storage::MemoryStorage;
///
/// let storage = MemoryStorage::new();
/// let w: Vec<u8> = [1.0f32, 2.0].iter().flat_map(|x| x.to_le_bytes()).collect();
/// let tree = StateTree::map().with("w", StateTree::Tensor(ShardedTensor::full("w", DType::F32, &[2], TensorData::Owned(w.clone()))));
/// save(tree, &storage, &SoloComm, &SaveOptions::default())?;
///
/// let ckpt = open(&storage)?;
/// assert_eq!(ckpt.format().backend, tessera::index::Backend::Tessera);
/// assert_eq!(ckpt.read_tensors(None)?["w"].data, w);
/// # Ok::<(), tessera::Error>(())
/// ```
pub struct Checkpoint<'s> {
    pub(crate) record: FormatRecord,
    pub(crate) index: CheckpointIndex,
    base: &'s dyn Storage,
    /// A foreign format's virtual files, read with their zip CRC-32s checked, and the same
    /// without (loads with `verify_checksums` off).
    view: Option<(ForeignView<'s>, ForeignView<'s>)>,
}

impl std::fmt::Debug for Checkpoint<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint").field("record", &self.record).field("location", &self.base.location()).finish()
    }
}

impl<'s> Checkpoint<'s> {
    /// A handle on an opened checkpoint; a foreign format's view is kept both as given (zip
    /// CRC-32s checked) and unchecked.
    fn new(record: FormatRecord, index: CheckpointIndex, base: &'s dyn Storage, view: Option<ForeignView<'s>>) -> Self {
        let view = view.map(|v| {
            let u = v.unchecked();
            (v, u)
        });
        Checkpoint { record, index, base, view }
    }
}

impl Checkpoint<'_> {
    /// The format and version the checkpoint was written in.
    pub fn format(&self) -> &FormatRecord {
        &self.record
    }

    /// The checkpoint's index, validated: every tensor's chunks, objects, common state and files
    /// (with [`OpenOptions::keys`], the chunks of those tensors only; the others are listed in
    /// [`CheckpointIndex::omitted_tensors`]).
    pub fn index(&self) -> &CheckpointIndex {
        &self.index
    }

    /// The index, taken out of the handle (for a caller that keeps the index and drops the rest).
    pub fn into_index(self) -> CheckpointIndex {
        self.index
    }

    /// Where the checkpoint is (its storage's location).
    pub fn location(&self) -> String {
        self.base.location()
    }

    /// The storage the index's file names resolve in: the checkpoint's own for the native
    /// format, a read-only view for foreign ones.
    pub(crate) fn storage(&self) -> &dyn Storage {
        self.storage_for(true)
    }

    /// [`Checkpoint::storage`] for reads that check the checksums of what they read or not
    /// (`verify`, [`crate::LoadOptions::verify_checksums`]): a foreign format's view checks
    /// the zip CRC-32s of its `torch.save` archives only when asked, as native reads check
    /// their blocks.
    pub(crate) fn storage_for(&self, verify: bool) -> &dyn Storage {
        match &self.view {
            Some((checked, _)) if verify => checked,
            Some((_, unchecked)) => unchecked,
            None => self.base,
        }
    }
}

/// How [`open_with`] opens a checkpoint.
#[derive(Debug, Clone, Default)]
pub struct OpenOptions {
    /// Read and decode the index entries of these tensors only (native format; others formats
    /// open whole). Objects, common state and files are always complete. `None`: everything.
    pub keys: Option<Vec<String>>,
}

/// Opens the checkpoint at `storage` for reading: detects its format (native, PyTorch DCP,
/// Megatron torch_dist or zarr, OLMo-core, plain safetensors), reads its index and passes it
/// through the one validation gate every index passes before anything reads by it.
///
/// Errors: [`Error::NotFound`] (nothing there), [`Error::NotCommitted`] (files but no
/// checkpoint), [`Error::IncompatibleVersion`], [`Error::Corrupt`] naming the file and key.
pub fn open(storage: &dyn Storage) -> Result<Checkpoint<'_>> {
    open_with(storage, &OpenOptions::default())
}

/// [`open`] with options: a reader of a few tensors of a large native checkpoint opens only
/// their part of the index.
///
/// ```
/// use tessera::{open_with, OpenOptions};
/// use tessera::storage::MemoryStorage;
///
/// let empty = MemoryStorage::new();
/// let opts = OpenOptions { keys: Some(vec!["w".into()]) };
/// assert!(matches!(open_with(&empty, &opts), Err(tessera::Error::NotFound { .. })));
/// ```
pub fn open_with<'s>(storage: &'s dyn Storage, opts: &OpenOptions) -> Result<Checkpoint<'s>> {
    match &opts.keys {
        None => open_checkpoint(storage),
        Some(keys) => open_checkpoint_key_set(storage, &keys.iter().cloned().collect()),
    }
}

/// Detects the format of the checkpoint at `storage` and opens it for reading.
pub(crate) fn open_checkpoint(storage: &dyn Storage) -> Result<Checkpoint<'_>> {
    let ckpt = open_unvalidated(storage)?;
    validate_index(&ckpt.index, &metadata_path(storage, &ckpt.record))?;
    Ok(ckpt)
}

/// [`open_checkpoint`] without the validation gate, for `verify`, which reports every defect
/// of the index instead of stopping at the first. Nothing may read by such an index.
pub(crate) fn open_unvalidated(storage: &dyn Storage) -> Result<Checkpoint<'_>> {
    let (record, strategy) = detect_format(storage).map_err(|e| explained(storage, e))?;
    let (index, view) = strategy.open_checkpoint(storage, &parallel_open)?;
    Ok(Checkpoint::new(record, index, storage, view))
}

/// [`open_checkpoint`] for a reader of the tensors `keys` only: a native checkpoint's index is
/// read and decoded for those tensors alone (the others are listed in the index's
/// `omitted_tensors`). Objects, common state and files are always complete.
pub(crate) fn open_checkpoint_key_set<'s>(storage: &'s dyn Storage, keys: &BTreeSet<String>) -> Result<Checkpoint<'s>> {
    let (record, strategy) = detect_format(storage).map_err(|e| explained(storage, e))?;
    let (index, view) = strategy.open_checkpoint_keys(storage, keys, &parallel_open)?;
    validate_index(&index, &metadata_path(storage, &record))?;
    Ok(Checkpoint::new(record, index, storage, view))
}

/// The storage a checkpoint's index names resolve in (a foreign format's virtual files), for
/// the hostile-input tests that read one directly (feature `fuzzing`).
#[cfg(feature = "fuzzing")]
pub fn checkpoint_storage<'a>(ckpt: &'a Checkpoint<'_>) -> &'a dyn Storage {
    ckpt.storage()
}
