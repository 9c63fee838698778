//! Maintenance of checkpoint locations: garbage collection beside running saves, and key
//! removal.

use std::collections::BTreeSet;

use crate::error::{Error, Result};
use crate::format::lease::{parse_lease_name, Lease, LEASE_TTL_MS};
use crate::format::{is_data_file_name, INDEX_FILE};
use crate::formats::olmo::metadata::{parse_rank_file_name, METADATA_FILE as OLMO_METADATA};
use crate::formats::torch_dist::{
    is_data_file_name as is_distcp_name, parse_common_copy_name, MEGATRON_COMMON, MEGATRON_METADATA,
};
use crate::load::open::open_index;
use crate::save::lease::now_ms;
use crate::storage::{temporary_target, temporary_time_ms, Storage, StorageExt};

/// How to collect garbage.
#[derive(Debug, Clone, Default)]
pub struct GcOptions {
    /// Treat every lease as expired: the caller asserts that no save into the location is
    /// running (a job that was killed: its leases would hold until they expire). Also removes
    /// the `common.pt` and `metadata.json` of a `torch_dist` save that never committed, which
    /// a running Megatron save may have written before its lease.
    pub break_leases: bool,
}

/// A save running in the location, as its lease says: gc left its files alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunningSave {
    /// The save's id (16 hex digits).
    pub save_id: String,
    /// Who runs it (`host:pid`), when the lease could be read.
    pub writer: String,
    /// Milliseconds until the lease expires unless renewed (by gc's clock), when it could be
    /// read.
    pub expires_in_ms: Option<u64>,
    /// Its files gc did not remove.
    pub files: Vec<String>,
    /// Why the lease could not be read (it is then taken to cover every file a save writes).
    pub unreadable: Option<String>,
}

/// What [`gc`] found and did.
#[derive(Debug, Clone, Default)]
pub struct GcReport {
    /// Files removed, sorted.
    pub removed: Vec<String>,
    /// Saves running in the location (unexpired leases), whose files were kept.
    pub running: Vec<RunningSave>,
    /// Files kept that only [`GcOptions::break_leases`] removes, or time: the companions of an
    /// unfinished `torch_dist` save, and temporaries of puts younger than a lease's lifetime
    /// (a save's first lease is being put).
    pub kept: Vec<String>,
}

/// Removes the leftovers of saves that never committed, or whose checkpoint was since replaced,
/// from a location of any format tessera writes (native, `torch_dist` / DCP, OLMo-core): data
/// files that no committed marker (`tessera.index`, `.metadata`, OLMo-core's `metadata.json`)
/// names, temporary files of puts that never finished, and expired leases. Files of a save that
/// is still running are left alone and reported: a running save holds a lease
/// (`.tessera-lease-<save id>`, renewed while it runs, FORMAT.md), and gc skips every file the
/// lease covers until it expires. Safe to run beside running saves; a location whose marker
/// cannot be read is refused (its files cannot be told apart). Returns what it removed and
/// what it kept.
///
/// ```
/// use tessera::{save, DType, SaveOptions, ShardedTensor, StateTree, Storage, TensorData};
/// use tessera::comm::SoloComm;
/// use tessera::storage::MemoryStorage;
/// use tessera::tools::{gc, GcOptions};
///
/// let storage = MemoryStorage::new();
/// let w = ShardedTensor::full("w", DType::U8, &[4], TensorData::Owned(vec![1, 2, 3, 4]));
/// save(StateTree::map().with("w", StateTree::Tensor(w)), &storage, &SoloComm, &SaveOptions::default())?;
/// // The data file of a save that crashed before its commit.
/// let leftover = "0123456789abcdef-r00003.safetensors";
/// storage.put_atomic(leftover, b"partial")?;
///
/// assert_eq!(gc(&storage, &GcOptions::default())?.removed, [leftover]);
/// assert!(!storage.list()?.iter().any(|n| n == leftover));
/// assert!(gc(&storage, &GcOptions::default())?.removed.is_empty());
/// assert_eq!(tessera::open(&storage)?.read_tensors(None)?["w"].data, [1, 2, 3, 4]);
/// # Ok::<(), tessera::Error>(())
/// ```
pub fn gc(storage: &dyn Storage, opts: &GcOptions) -> Result<GcReport> {
    let (garbage, report) = analyse(storage, opts, None)?;
    let mut report = report;
    for name in &garbage {
        match storage.delete(name) {
            Ok(()) | Err(Error::NotFound { .. }) => report.removed.push(name.clone()),
            Err(e) => return Err(e),
        }
    }
    Ok(report)
}

/// What [`gc`] would remove (sorted), and the rest of its report (nothing removed yet).
/// `native_files`, when given, are the files the native index names (read by the caller, which
/// may not have validated it: `verify`); otherwise the index is opened and validated here.
pub(crate) fn analyse(
    storage: &dyn Storage,
    opts: &GcOptions,
    native_files: Option<BTreeSet<String>>,
) -> Result<(Vec<String>, GcReport)> {
    // The order matters beside running saves: the listing first, then the leases, then the
    // markers. A save puts its lease before any of its files and removes it only after its
    // marker: every file in the listing of a save whose lease is gone by the time the leases
    // are read is named by the marker read after them, if that save committed.
    let names = storage.list()?;
    let now = now_ms();
    let mut live: Vec<(String, std::result::Result<Lease, String>)> = Vec::new();
    let mut expired: Vec<String> = Vec::new();
    for name in names.iter().filter(|n| parse_lease_name(n).is_some()) {
        let shown = format!("{}/{name}", storage.location());
        match storage.read(name).and_then(|b| Lease::decode(&b, &shown)) {
            Err(Error::NotFound { .. }) => {}
            Ok(l) if opts.break_leases || !l.is_live(now) => expired.push(name.clone()),
            Ok(l) => live.push((name.clone(), Ok(l))),
            Err(_) if opts.break_leases => expired.push(name.clone()),
            Err(e) => live.push((name.clone(), Err(e.to_string()))),
        }
    }
    let mut referenced: BTreeSet<String> = BTreeSet::new();
    let mut committed = false;
    if let Some(files) = native_files {
        referenced.extend(files);
        committed = true;
    } else if storage.exists(INDEX_FILE)? {
        referenced.extend(open_index(storage)?.files.into_iter().map(|f| f.name));
        committed = true;
    }
    if let Some(files) = crate::formats::dcp::referenced_files(storage)? {
        referenced.extend(files);
        committed = true;
    }
    if let Some(files) = crate::formats::olmo::referenced_files(storage)? {
        referenced.extend(files);
        committed = true;
    }

    let mut report = GcReport::default();
    let mut running: Vec<RunningSave> = live
        .iter()
        .map(|(name, l)| match l {
            Ok(l) => RunningSave {
                save_id: format!("{:016x}", l.save_id),
                writer: l.writer.clone(),
                expires_in_ms: Some(l.expires_ms.saturating_sub(now)),
                files: Vec::new(),
                unreadable: None,
            },
            Err(e) => RunningSave {
                save_id: name.trim_start_matches(crate::format::lease::LEASE_PREFIX).to_string(),
                writer: String::new(),
                expires_in_ms: None,
                files: Vec::new(),
                unreadable: Some(e.clone()),
            },
        })
        .collect();
    let mut garbage = Vec::new();
    for name in &names {
        let save_file = is_data_file_name(name)
            || is_distcp_name(name)
            || parse_rank_file_name(name).is_some()
            || parse_common_copy_name(name).is_some();
        let temporary = temporary_target(name).is_some();
        if !(save_file || temporary) || referenced.contains(name) {
            if expired.contains(name) {
                garbage.push(name.clone());
            }
            continue;
        }
        // A temporary belongs to a put in progress while any save runs, and while it is young:
        // the put of a save's first lease makes one before that lease exists.
        let holder = live
            .iter()
            .position(|(_, l)| temporary || l.as_ref().map_or(true, |l| crate::save::lease::covers(l, name)));
        let young = temporary
            && !opts.break_leases
            && temporary_time_ms(name).is_none_or(|t| now.saturating_sub(t) < LEASE_TTL_MS);
        match holder {
            Some(i) => running[i].files.push(name.clone()),
            None if young => report.kept.push(name.clone()),
            None => garbage.push(name.clone()),
        }
    }
    // The companions of a torch_dist save that never committed (Megatron may write them before
    // the save's lease): only when no save runs and the caller says none will.
    for name in [MEGATRON_COMMON, MEGATRON_METADATA] {
        if !committed && names.iter().any(|n| n == name) && is_megatron_companion(storage, name)? {
            if opts.break_leases && live.is_empty() {
                garbage.push(name.to_string());
            } else {
                report.kept.push(name.to_string());
            }
        }
    }
    garbage.sort();
    garbage.dedup();
    report.running = running.into_iter().filter(|r| !r.files.is_empty() || r.unreadable.is_some()).collect();
    Ok((garbage, report))
}

/// Whether `name` (`common.pt` or `metadata.json`) is Megatron's: `common.pt` always is; a
/// `metadata.json` is when it names a `sharded_backend` (OLMo-core's has `tensors`).
fn is_megatron_companion(storage: &dyn Storage, name: &str) -> Result<bool> {
    if name == MEGATRON_COMMON {
        return Ok(true);
    }
    debug_assert_eq!(name, MEGATRON_METADATA);
    let Some(size) = storage.size_if_present(OLMO_METADATA)? else { return Ok(false) };
    if size > 1 << 20 {
        return Ok(false);
    }
    let bytes = storage.read(OLMO_METADATA)?;
    Ok(serde_json::from_slice::<serde_json::Value>(&bytes).is_ok_and(|v| v.get("sharded_backend").is_some()))
}

/// Removes every tensor whose key starts with `key_prefix` from a committed checkpoint
/// (Megatron's `remove_sharded_tensors`), by committing a new index without them; data files
/// are left as they are. Returns the keys removed.
///
/// ```
/// use tessera::{open, save, SaveOptions};
/// use tessera::tools::remove_sharded_tensors;
/// use tessera::{DType, ShardedTensor, StateTree, TensorData};
/// use tessera::comm::SoloComm;
/// use tessera::storage::MemoryStorage;
///
/// let storage = MemoryStorage::new();
/// let t = |k: &str| StateTree::Tensor(ShardedTensor::full(k, DType::U8, &[1], TensorData::Owned(vec![0])));
/// let tree = StateTree::map().with("a", t("optim.a")).with("b", t("optim.b")).with("c", t("model.c"));
/// save(tree, &storage, &SoloComm, &SaveOptions::default())?;
///
/// let mut removed = remove_sharded_tensors(&storage, "optim.")?;
/// removed.sort();
/// assert_eq!(removed, ["optim.a", "optim.b"]);
/// assert_eq!(open(&storage)?.tensors_metadata().into_keys().collect::<Vec<_>>(), ["model.c"]);
/// # Ok::<(), tessera::Error>(())
/// ```
pub fn remove_sharded_tensors(storage: &dyn Storage, key_prefix: &str) -> Result<Vec<String>> {
    let mut index = open_index(storage)?;
    if index.backend != crate::format::Backend::Tessera {
        return Err(Error::invalid(format!("cannot edit a {} checkpoint in place", index.backend)));
    }
    let (removed, kept): (Vec<_>, Vec<_>) = index.tensors.into_iter().partition(|t| t.key.starts_with(key_prefix));
    index.tensors = kept;
    if !removed.is_empty() {
        storage.put_atomic(INDEX_FILE, &index.encode())?;
    }
    Ok(removed.into_iter().map(|t| t.key).collect())
}
