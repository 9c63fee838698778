//! Multi-rank save: one metadata exchange, global validation and writer assignment
//! ([`prepare`]), parallel writes of each rank's data file, then the index written last and
//! atomically by rank 0 ([`commit`]). The async save shares both halves.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::comm::{wire, Communicator};
use crate::error::{Error, Result};
use crate::format::is_data_file_name;
use crate::format::{CheckpointIndex, DEFAULT_BLOCK_SIZE, INDEX_FILE};
use crate::load::{default_threads, on_cores};
use crate::model::factories::apply_factories_collective;
use crate::model::{StatePath, StateTree, Value};
use crate::plan::fasthash::mix64;
use crate::plan::save::{
    assign_writers, build_index, cache_hit, data_file_name, file_header, layout_file, plan_digest, plan_options,
    validate_global_with, CacheCheck, FileLayout, ObjectMeta, RankPlan, ShardMeta, WrittenFile,
};
use crate::save::write::{write_sources, Source};
use crate::storage::Storage;

/// How to save.
#[derive(Debug, Clone)]
pub struct SaveOptions {
    /// Replace a committed checkpoint at the same location (atomically, at commit).
    pub overwrite: bool,
    /// Check globally that main replicas tile every tensor before writing (Megatron's
    /// `validate_access_integrity`). Turning it off skips the check, not the exchange.
    pub validate: bool,
    /// User metadata stored in the index, readable without loading anything.
    pub content_metadata: Value,
    /// IO threads per rank. Into a local file ([`Storage::is_local`](crate::Storage::is_local))
    /// a file is written from one thread whatever this says: the kernel serializes writes into
    /// one file there.
    pub threads: usize,
    /// Checksum block size in bytes (loads verify whole blocks).
    pub block_size: u64,
    /// Set it to stop the IO early: the save then fails with [`Error::Cancelled`] on this rank
    /// (and with `PeerFailed` on the others) and nothing is committed.
    pub cancel: Option<Arc<AtomicBool>>,
    /// Fully-parallel save: spread the writing of replicated chunks (data-parallel replicas
    /// that hold their bytes) over their holders instead of leaving it all to the main replica.
    /// The checkpoint holds the same chunks either way.
    pub distribute_replicas: bool,
    /// Reuse the global plan of the previous save through this cache when the structure is
    /// unchanged (PyTorch DCP's plan caching): see [`PlanCache`]. Give every rank its own
    /// cache, kept across saves; `None` (the default) plans every save from scratch.
    pub plan_cache: Option<Arc<PlanCache>>,
}

/// The global plan of a rank's last save, so that a save with the same structure skips the
/// exchange of full plans, the global validation and the writer assignment.
///
/// Every rank announces, in one all-gather of a few dozen bytes, whether its own plan (keys,
/// dtypes, shapes, boxes, replica ids, object sizes, and the options that shape the plan) hashes
/// to the one it cached, and which save its cache comes from. Only when every rank matches and
/// every cache comes from the same save is the cached plan reused, on every rank alike;
/// otherwise the save falls back to the full exchange and validation (one more all-gather) and
/// caches the result. The hash is 128 bits of a non-cryptographic hash over the plan's binary
/// encoding: it detects changes, not adversaries (the ranks are one trusted job). Rank 0 keeps
/// every rank's plan (it builds the index); the other ranks keep only their own.
#[derive(Default)]
pub struct PlanCache {
    last: std::sync::Mutex<Option<CachedPlan>>,
    hits: std::sync::atomic::AtomicU64,
    misses: std::sync::atomic::AtomicU64,
}

struct CachedPlan {
    digest: [u64; 2],
    /// Save id of the save that planned it: the same on every rank.
    generation: u64,
    plans: Arc<Vec<RankPlan>>,
}

impl std::fmt::Debug for PlanCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlanCache").field("hits", &self.hits()).field("misses", &self.misses()).finish()
    }
}

impl PlanCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }
    /// Saves that reused the cached plan.
    pub fn hits(&self) -> u64 {
        self.hits.load(std::sync::atomic::Ordering::Relaxed)
    }
    /// Saves that planned from scratch with this cache.
    pub fn misses(&self) -> u64 {
        self.misses.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Default for SaveOptions {
    fn default() -> Self {
        SaveOptions {
            overwrite: false,
            validate: true,
            content_metadata: Value::Null,
            threads: default_threads(),
            block_size: DEFAULT_BLOCK_SIZE,
            cancel: None,
            distribute_replicas: true,
            plan_cache: None,
        }
    }
}

/// What a save did, as seen from one rank.
#[derive(Debug, Clone, Default)]
pub struct SaveReport {
    /// The data file this rank wrote (none if it held no main replica).
    pub file: Option<String>,
    /// Bytes this rank wrote (its data file).
    pub bytes_written: u64,
    /// Tensor bytes in the whole checkpoint.
    pub total_tensor_bytes: u64,
    /// Data files in the checkpoint.
    pub files: usize,
    /// Chunks in the checkpoint.
    pub chunks: usize,
    /// Size of the index.
    pub index_bytes: u64,
}

pub(crate) struct Collected<'t> {
    pub plan: RankPlan,
    pub local_error: Option<Error>,
    /// Per tensor shard (plan order): its bytes, where the rank has them and may write them.
    pub tensor_data: Vec<Option<&'t [u8]>>,
    pub object_data: Vec<&'t [u8]>,
    pub common: Vec<(StatePath, Value)>,
}

/// `require_data`: main replicas must carry their bytes (save); validation alone needs none.
/// `offer_replicas`: replicas holding their bytes offer to write them (fully-parallel save).
pub(crate) fn collect<'t>(
    tree: &'t StateTree<'_>,
    rank: usize,
    require_data: bool,
    offer_replicas: bool,
) -> Collected<'t> {
    let mut c = Collected {
        plan: RankPlan::default(),
        local_error: None,
        tensor_data: Vec::new(),
        object_data: Vec::new(),
        common: Vec::new(),
    };
    let mut error: Option<Error> = None;
    tree.for_each_leaf(&mut |path, leaf| match leaf {
        StateTree::Tensor(t) => {
            let main = t.replica_id.is_main();
            if let Err(e) = t.check(true) {
                error.get_or_insert(e);
                return;
            }
            let data = t.data.bytes().filter(|_| main || offer_replicas);
            if main && require_data && data.is_none() {
                error.get_or_insert(Error::invalid(format!("{:?}: the main replica has no data to save", t.key)));
                return;
            }
            c.tensor_data.push(data);
            c.plan.tensors.push(ShardMeta {
                key: t.key.as_str().into(),
                dtype: t.dtype,
                global_shape: t.global_shape.as_slice().into(),
                offset: t.global_offset.as_slice().into(),
                shape: t.box_shape().into(),
                flat: t.flattened_range.as_ref().map(|r| (r.start, r.end)),
                main,
                has_data: data.is_some(),
            });
        }
        StateTree::Object(o) => {
            let main = o.replica_id.is_main();
            let len = o.data.as_ref().map_or(0, |d| d.len() as u64);
            if main && require_data {
                match &o.data {
                    Some(d) => c.object_data.push(d),
                    None => {
                        error.get_or_insert(Error::invalid(format!(
                            "{:?}: the main replica of the object has no data",
                            o.key
                        )));
                        return;
                    }
                }
            }
            c.plan.objects.push(ObjectMeta {
                key: o.key.clone(),
                global_shape: o.global_shape.clone(),
                offset: o.global_offset.clone(),
                main,
                len,
            });
        }
        StateTree::Value(v) if rank == 0 => c.common.push((path.to_vec(), v.clone())),
        _ => {}
    });
    c.local_error = error;
    c
}

/// Save ids start with the save's start time in milliseconds (40 bits), so that a commit can
/// tell the files of earlier saves (garbage once it commits) from those of a save that started
/// later (possibly still running); 24 random bits keep ids distinct.
pub(crate) fn new_save_id() -> u64 {
    // The 24 bits are a per-process base (splitmix64 of the first id's time and the pid: apart
    // between processes, no RNG dependency) plus a per-process count, so that saves of one
    // process never share an id: groups of one process saving to one location at once (threads
    // released by one barrier) read the same clock, and with equal ids, hence equal file names,
    // the losing group's cleanup would delete the winner's files.
    static BASE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    let base = *BASE.get_or_init(|| {
        let nanos = now.as_nanos() as u64;
        mix64((nanos ^ ((std::process::id() as u64) << 32)).wrapping_add(0x9e3779b97f4a7c15))
    });
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    ((now.as_millis() as u64 & ((1 << 40) - 1)) << 24) | (base.wrapping_add(seq) & 0xff_ffff)
}

/// Start time (ms) of the save that wrote data file `name`.
fn save_time_of_file(name: &str) -> Option<u64> {
    u64::from_str_radix(name.get(..16)?, 16).ok().map(|id| id >> 24)
}

/// The one metadata exchange: every rank's plan, or the first error any rank reported
/// (this rank's own error keeps its type; another rank's sharding error stays `InvalidSharding`).
fn exchange_plans(comm: &dyn Communicator, c: &mut Collected<'_>) -> Result<Vec<RankPlan>> {
    let mine = match &c.local_error {
        Some(e) => wire::failed(e),
        None => wire::ok(&c.plan.encode()),
    };
    let gathered = comm.all_gather(&mine)?;
    drop(mine);
    let payloads = wire::outcomes(&gathered, comm.rank(), &mut c.local_error)?;
    RankPlan::decode_all_with(&payloads, &on_cores)
        .map_err(|(r, e)| Error::Comm { reason: format!("bad plan from rank {r}: {e}") })
}

/// Checks, collectively and without writing anything, that the ranks' trees describe a valid
/// global state (Megatron's `validate_sharding_integrity`): the same exchange and validation a
/// save does first. Every rank must call it; every rank gets the same verdict.
///
/// ```
/// use tessera::{validate_sharding_integrity, DType, Error, InProcessComm, ShardedTensor, StateTree, TensorData};
///
/// // Both ranks claim elements 0..2 of a 4-element tensor as their main replica: the shards
/// // overlap (and 2..4 is missing). Metadata only: validating needs no tensor data.
/// let verdicts = InProcessComm::run(2, |comm| {
///     let t = ShardedTensor::from_rank_offsets("w", DType::F32, &[2], TensorData::None, &[(0, 0, 2)], 0)?;
///     validate_sharding_integrity(StateTree::map().with("w", StateTree::Tensor(t)), comm)
/// });
/// assert!(verdicts.iter().all(|v| matches!(v, Err(Error::InvalidSharding { key, .. }) if key == "w")));
///
/// // Rank r holding piece r tiles the tensor.
/// let verdicts = InProcessComm::run(2, |comm| {
///     let r = tessera::Communicator::rank(comm) as u64;
///     let t = ShardedTensor::from_rank_offsets("w", DType::F32, &[2], TensorData::None, &[(0, r, 2)], 0)?;
///     validate_sharding_integrity(StateTree::map().with("w", StateTree::Tensor(t)), comm)
/// });
/// assert!(verdicts.iter().all(|v| v.is_ok()));
/// # Ok::<(), tessera::Error>(())
/// ```
pub fn validate_sharding_integrity(tree: StateTree<'_>, comm: &dyn Communicator) -> Result<()> {
    let (tree, factory_error) = apply_factories_collective(tree);
    let mut c = collect(&tree, comm.rank(), false, false);
    if let Some(e) = factory_error {
        c.local_error = Some(e);
    }
    let plans = exchange_plans(comm, &mut c)?;
    validate_global_with(&plans, &on_cores)
}

/// What every rank knows once the exchange and validation are done: the plans (writers
/// assigned), this save's id, and this rank's file layout with the bytes to put in it.
pub(crate) struct Prepared<'t> {
    pub rank: usize,
    /// Every rank's plan on rank 0; elsewhere at least this rank's (shared with a plan cache).
    pub plans: Arc<Vec<RankPlan>>,
    pub save_id: u64,
    pub layout: FileLayout,
    /// Bytes of each tensor shard this rank writes, in layout order.
    pub tensor_data: Vec<&'t [u8]>,
    /// Bytes of each object shard this rank writes, in layout order.
    pub object_data: Vec<&'t [u8]>,
    /// Rank 0: the common values.
    pub common: Vec<(StatePath, Value)>,
}

impl<'t> Prepared<'t> {
    /// Splits off the borrowed bytes (tensors, objects) from the rest, which can then move to a
    /// thread that outlives the caller's tree.
    pub fn split(self) -> (Prepared<'static>, Vec<&'t [u8]>, Vec<&'t [u8]>) {
        let Prepared { rank, plans, save_id, layout, tensor_data, object_data, common } = self;
        let rest = Prepared { rank, plans, save_id, layout, tensor_data: Vec::new(), object_data: Vec::new(), common };
        (rest, tensor_data, object_data)
    }

    pub fn file_name(&self) -> String {
        data_file_name(self.save_id, self.rank)
    }

    /// The header and this rank's report once every byte is written with checksums `crcs`
    /// (tensors in layout order, then objects).
    pub fn finish_file(&self, crcs: Vec<Vec<u32>>, block_size: u64) -> Result<(Vec<u8>, WrittenFile)> {
        finish_file(self.rank, &self.plans[self.rank], &self.layout, self.file_name(), crcs, block_size)
    }
}

/// The header of data file `name` (written by `rank` with plan `plan`, laid out as `layout`) and
/// the report of what it holds, once every byte is written with checksums `crcs` (tensors in
/// layout order, then objects). Shared by save, async save and convert.
pub(crate) fn finish_file(
    rank: usize,
    plan: &RankPlan,
    layout: &FileLayout,
    name: String,
    mut crcs: Vec<Vec<u32>>,
    block_size: u64,
) -> Result<(Vec<u8>, WrittenFile)> {
    // An object has exactly one checksum, even when empty.
    for c in crcs.iter_mut().skip(layout.tensor_entries.len()) {
        if c.is_empty() {
            c.push(crate::model::crc::crc32c(&[]));
        }
    }
    let header =
        file_header(rank, plan, block_size, &layout.entries, &layout.tensor_entries, &layout.object_entries, &crcs);
    if header.len() as u64 != layout.header_len {
        return Err(Error::invalid(format!(
            "data-file header is {} bytes, {} were laid out",
            header.len(),
            layout.header_len
        )));
    }
    let nt = layout.tensor_entries.len();
    let written = WrittenFile {
        name,
        size: layout.size,
        header_len: layout.header_len,
        header_crc: crate::model::crc::crc32c(&header),
        tensors: (0..nt).map(|n| (layout.header_len + layout.entries[n].start, crcs[n].as_slice().into())).collect(),
        objects: (0..layout.object_entries.len())
            .map(|n| {
                let e = &layout.entries[nt + n];
                (layout.header_len + e.start, e.len, crcs[nt + n].first().copied().unwrap_or(0))
            })
            .collect(),
    };
    Ok((header, written))
}

/// The collective first half of every save: collect, exchange, validate, assign writers, lay
/// out this rank's file. Errors come out identically on every rank, before anything is written.
pub(crate) fn prepare<'t>(
    tree: &'t StateTree<'_>,
    local_error: Option<Error>,
    storage: &dyn Storage,
    comm: &dyn Communicator,
    opts: &SaveOptions,
) -> Result<Prepared<'t>> {
    let rank = comm.rank();
    let mut c = collect(tree, rank, true, opts.distribute_replicas);
    if let Some(e) = local_error {
        c.local_error = Some(e);
    }
    if opts.block_size == 0 {
        c.local_error.get_or_insert(Error::invalid("block size must be positive"));
    }
    if rank == 0 {
        c.plan.save_id = new_save_id();
        if !opts.overwrite {
            match storage.size(INDEX_FILE) {
                Ok(_) => c.plan.refuse_overwrite = true,
                Err(Error::NotFound { .. }) => {
                    // The index itself: a save that committed meanwhile (the commit decides).
                    let ours = |n: &str| {
                        is_data_file_name(n)
                            || n == INDEX_FILE
                            || n.starts_with(&format!(".{INDEX_FILE}.tmp-"))
                            || MEGATRON_COMPANIONS.contains(&n)
                    };
                    if let Err(e) = refuse_foreign_files(storage, ours, "tessera") {
                        c.local_error.get_or_insert(e);
                    }
                }
                Err(e) => {
                    c.local_error.get_or_insert(e);
                }
            }
        }
    }
    let (plans, save_id) = match &opts.plan_cache {
        Some(cache) => plan_with_cache(comm, &mut c, cache, opts, storage)?,
        None => {
            let plans = plan_globally(comm, &mut c, opts, storage, None)?;
            let save_id = plans[0].save_id;
            (Arc::new(plans), save_id)
        }
    };
    let layout = layout_file(rank, &plans[rank], opts.block_size);
    let tensor_data = plans[rank]
        .tensors
        .iter()
        .zip(&c.tensor_data)
        .filter(|(t, _)| t.main)
        .map(|(t, d)| {
            d.ok_or_else(|| Error::invalid(format!("{:?}: chosen to write a shard it has no data for", t.key)))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Prepared { rank, plans, save_id, layout, tensor_data, object_data: c.object_data, common: c.common })
}

/// The files Megatron's `serialization.save` writes before the sharded part (its common
/// strategy and its config): a save may find them in the location it writes.
pub(crate) const MEGATRON_COMPANIONS: [&str; 2] = ["common.pt", "metadata.json"];

/// A save without `overwrite` into a location that holds no checkpoint of its format (`what`)
/// writes there only if nothing else is there: its own kind of files (`ours`: leftovers of
/// saves that never committed, Megatron's companions) are fine; anything else (another
/// format's checkpoint, unrelated files) is refused, naming it.
pub(crate) fn refuse_foreign_files(storage: &dyn Storage, ours: impl Fn(&str) -> bool, what: &str) -> Result<()> {
    let names = storage.list()?;
    let foreign: Vec<&String> = names.iter().filter(|n| !ours(n)).collect();
    if foreign.is_empty() {
        return Ok(());
    }
    let shown: Vec<&str> = foreign.iter().take(5).map(|n| n.as_str()).collect();
    let more = if foreign.len() > shown.len() { format!(", … ({} in all)", foreign.len()) } else { String::new() };
    Err(Error::invalid(format!(
        "{} is not empty and holds no {what} checkpoint ({}{more}): save into an empty or new location, or pass \
         overwrite to write there anyway (the files there are left as they are)",
        storage.location(),
        shown.join(", ")
    )))
}

/// The full exchange: every rank's plan, validated, writers assigned.
/// `choose_main`, when given, decides which copies are main replicas before validation (a
/// format whose writers mark no main replica, OLMo-core's, designates them from the plans).
pub(crate) fn plan_globally(
    comm: &dyn Communicator,
    c: &mut Collected<'_>,
    opts: &SaveOptions,
    storage: &dyn Storage,
    choose_main: Option<fn(&mut [RankPlan])>,
) -> Result<Vec<RankPlan>> {
    let mut plans = exchange_plans(comm, c)?;
    if plans[0].refuse_overwrite {
        return Err(Error::AlreadyExists { path: storage.location().into() });
    }
    if let Some(choose) = choose_main {
        choose(&mut plans);
    }
    if opts.validate {
        validate_global_with(&plans, &on_cores)?;
    }
    if opts.distribute_replicas {
        assign_writers(&mut plans);
    }
    Ok(plans)
}

/// [`plan_globally`], skipped when every rank's structure matches the plan cached from the same
/// earlier save: one small all-gather decides, identically on every rank.
fn plan_with_cache(
    comm: &dyn Communicator,
    c: &mut Collected<'_>,
    cache: &PlanCache,
    opts: &SaveOptions,
    storage: &dyn Storage,
) -> Result<(Arc<Vec<RankPlan>>, u64)> {
    use std::sync::atomic::Ordering::Relaxed;
    let rank = comm.rank();
    let digest = plan_digest(&c.plan, &plan_options(opts.block_size, opts.validate, opts.distribute_replicas));
    let mut last = cache.last.lock().unwrap();
    let mine = CacheCheck {
        matches: last.as_ref().is_some_and(|l| l.digest == digest && l.plans.len() == comm.world_size()),
        generation: last.as_ref().map_or(0, |l| l.generation),
        save_id: c.plan.save_id,
        refuse_overwrite: c.plan.refuse_overwrite,
    };
    let mine = match &c.local_error {
        Some(e) => wire::failed(e),
        None => wire::ok(&mine.encode()),
    };
    let gathered = comm.all_gather(&mine)?;
    let checks = wire::outcomes(&gathered, rank, &mut c.local_error)?
        .into_iter()
        .enumerate()
        .map(|(r, m)| {
            CacheCheck::decode(m)
                .map_err(|e| Error::Comm { reason: format!("bad plan-cache message from rank {r}: {e}") })
        })
        .collect::<Result<Vec<_>>>()?;
    let (save_id, refuse) = (checks[0].save_id, checks[0].refuse_overwrite);
    if refuse {
        return Err(Error::AlreadyExists { path: storage.location().into() });
    }
    if cache_hit(&checks) {
        if let Some(l) = last.as_ref() {
            cache.hits.fetch_add(1, Relaxed);
            return Ok((l.plans.clone(), save_id));
        }
    }
    cache.misses.fetch_add(1, Relaxed);
    *last = None;
    let plans = Arc::new(plan_globally(comm, c, opts, storage, None)?);
    // Rank 0 builds the index from every plan; the others only need their own.
    let kept = if rank == 0 {
        plans.clone()
    } else {
        Arc::new((0..plans.len()).map(|r| if r == rank { plans[r].clone() } else { RankPlan::default() }).collect())
    };
    *last = Some(CachedPlan { digest, generation: save_id, plans: kept });
    Ok((plans, save_id))
}

/// Saves this rank's part of the state. Every rank of `comm` must call it with its own tree.
/// Errors (invalid sharding, an existing checkpoint, a failed write) are returned on every rank.
///
/// ```
/// use tessera::{open, save, DType, MemoryStorage, SaveOptions, ShardedTensor, SoloComm, StateTree, TensorData, Value};
///
/// let storage = MemoryStorage::new();
/// let tree = || {
///     let w = ShardedTensor::full("w", DType::U8, &[4], TensorData::Owned(vec![1, 2, 3, 4]));
///     StateTree::map().with("w", StateTree::Tensor(w)).with("step", StateTree::Value(Value::Int(100)))
/// };
/// let opts = SaveOptions { content_metadata: Value::Str("run-7".into()), ..SaveOptions::default() };
/// let report = save(tree(), &storage, &SoloComm, &opts)?;
/// assert_eq!((report.files, report.total_tensor_bytes), (1, 4));
///
/// let ckpt = open(&storage)?;
/// assert_eq!(ckpt.content_metadata(), &Value::Str("run-7".into()));
/// assert_eq!(ckpt.common_state().get_dotted("step").and_then(|t| t.as_value()), Some(&Value::Int(100)));
/// // A committed checkpoint is never replaced without `overwrite`.
/// assert!(matches!(save(tree(), &storage, &SoloComm, &opts), Err(tessera::Error::AlreadyExists { .. })));
/// # Ok::<(), tessera::Error>(())
/// ```
pub fn save(
    tree: StateTree<'_>,
    storage: &dyn Storage,
    comm: &dyn Communicator,
    opts: &SaveOptions,
) -> Result<SaveReport> {
    let (tree, factory_error) = apply_factories_collective(tree);
    let p = prepare(&tree, factory_error, storage, comm, opts)?;
    let layout = &p.layout;
    let write = || -> Result<WrittenFile> {
        let writer = storage.create(&p.file_name(), layout.size)?;
        let mut sources = Vec::with_capacity(layout.entries.len());
        for (n, data) in p.tensor_data.iter().enumerate() {
            sources.push(Source {
                data,
                file_off: layout.header_len + layout.entries[n].start,
                block: opts.block_size,
            });
        }
        for (n, data) in p.object_data.iter().enumerate() {
            let e = &layout.entries[layout.tensor_entries.len() + n];
            sources.push(Source { data, file_off: layout.header_len + e.start, block: u64::MAX });
        }
        let crcs = write_sources(writer.as_ref(), &sources, opts.threads, storage.is_local(), opts.cancel.as_deref())?;
        let (header, written) = p.finish_file(crcs, opts.block_size)?;
        writer.write_at(0, &header)?;
        writer.finish()?;
        Ok(written)
    };
    let written = if layout.entries.is_empty() { Ok(WrittenFile::default()) } else { write() };
    commit(&p, written, storage, comm, opts)
}

/// The collective second half of every save: gather every rank's written file (or failure),
/// rank 0 writes the index (the commit), every rank gets the same verdict.
pub(crate) fn commit(
    p: &Prepared<'_>,
    written: Result<WrittenFile>,
    storage: &dyn Storage,
    comm: &dyn Communicator,
    opts: &SaveOptions,
) -> Result<SaveReport> {
    let rank = p.rank;
    let reports = comm.all_gather(&wire::outcome(&written, WrittenFile::encode))?;
    let (written, mut own_write_error) = match written {
        Ok(w) => (w, None),
        Err(e) => (WrittenFile::default(), Some(e)),
    };
    let written_all: Vec<WrittenFile> = wire::outcomes(&reports, rank, &mut own_write_error)
        .map_err(|err| clean_up_failed(p, storage, err))?
        .into_iter()
        .enumerate()
        .map(|(r, b)| {
            WrittenFile::decode(b).map_err(|e| Error::Comm { reason: format!("bad write report from rank {r}: {e}") })
        })
        .collect::<Result<_>>()?;

    // Rank 0 commits; everyone learns the verdict.
    let mut verdict = Vec::new();
    let mut own_commit_error = None;
    if rank == 0 {
        let r = commit_index(
            storage,
            &p.plans,
            written_all,
            opts.block_size,
            p.common.clone(),
            opts.content_metadata.clone(),
            opts.overwrite,
            p.save_id,
        );
        match r {
            Ok((index, index_bytes)) => {
                let mut e = crate::model::codec::Encoder::default();
                e.var(index_bytes);
                e.var(index.tensor_bytes());
                e.var(index.files.len() as u64);
                e.var(index.chunk_count() as u64);
                verdict = wire::ok(&e.buf);
            }
            Err(err) => {
                verdict = wire::failed(&err);
                own_commit_error = Some(err);
            }
        }
    }
    let verdict = comm.broadcast(&verdict, 0)?;
    let stats = match wire::outcomes(std::slice::from_ref(&verdict), rank, &mut own_commit_error) {
        Ok(payloads) => payloads[0],
        // Another save committed at the location first (the conditional put or the read-back
        // saw it): that save's files stay; this save's were removed by the commit.
        Err(Error::AlreadyExists { .. }) => return Err(Error::AlreadyExists { path: storage.location().into() }),
        Err(err) => return Err(clean_up_failed(p, storage, err)),
    };
    let mut d = crate::model::codec::Decoder::new(stats);
    let mut next = || d.var().map_err(|e| Error::Comm { reason: e });
    let index_bytes = next()?;
    let total = next()?;
    let files = next()? as usize;
    let chunks = next()? as usize;
    Ok(SaveReport {
        file: (!written.name.is_empty()).then(|| written.name.clone()),
        bytes_written: written.size,
        total_tensor_bytes: total,
        files,
        chunks,
        index_bytes,
    })
}

/// A save that failed (`err`) removes the data file this rank wrote, if any: nothing of it is
/// referenced, and its name is this save's own.
fn clean_up_failed(p: &Prepared<'_>, storage: &dyn Storage, err: Error) -> Error {
    remove_failed_save_files(storage, &[p.file_name()], err)
}

/// Removes `names`, the files this rank wrote for a save that failed with `err` (names of that
/// save's own, which no committed checkpoint uses), and returns the error to report: `err`, or,
/// where a file could not be removed, `err`'s text saying so and how to clean up (`tessera
/// gc`). Shared by every writer.
pub(crate) fn remove_failed_save_files(storage: &dyn Storage, names: &[String], err: Error) -> Error {
    for name in names {
        match storage.delete(name) {
            Ok(()) | Err(Error::NotFound { .. }) => {}
            Err(cleanup) => {
                return Error::Io {
                    path: storage.location().into(),
                    source: std::io::Error::other(format!(
                        "{err}; this save's data file {name} could not be removed ({cleanup}): run `tessera gc {}`",
                        storage.location()
                    )),
                }
            }
        }
    }
    err
}

/// The commit of save `save_id` once every data file is written (`written`, in the order of
/// `plans`): assembles the index, publishes it ([`publish_index`]) and removes the data files
/// of earlier saves it replaces. Returns the index and its size. If another save committed at
/// the location first (`AlreadyExists`), this save's data files are removed. Shared by save
/// (rank 0), async save and convert.
#[allow(clippy::too_many_arguments)]
pub(crate) fn commit_index(
    storage: &dyn Storage,
    plans: &[RankPlan],
    written: Vec<WrittenFile>,
    block_size: u64,
    common: Vec<(StatePath, Value)>,
    content_metadata: Value,
    overwrite: bool,
    save_id: u64,
) -> Result<(CheckpointIndex, u64)> {
    let r = (|| {
        let index = build_index(plans, written, block_size, common, content_metadata, &on_cores)?;
        let bytes = index.encode();
        publish_index(storage, &bytes, overwrite)?;
        remove_unreferenced(storage, &index, &bytes, save_id)?;
        Ok((index, bytes.len() as u64))
    })();
    if let Err(Error::AlreadyExists { .. }) = r {
        // Another save committed here first: this save's files are garbage now.
        remove_save_files(storage, save_id);
    }
    r
}

/// The commit: the index put last, create-if-absent unless overwriting was asked for, then read
/// back. The read-back catches a concurrent commit on stores whose conditional put is not
/// atomic (or is silently ignored): whoever's index is there afterwards owns the location.
fn publish_index(storage: &dyn Storage, bytes: &[u8], overwrite: bool) -> Result<()> {
    if overwrite {
        storage.put_atomic(INDEX_FILE, bytes)?;
    } else {
        storage.put_if_absent(INDEX_FILE, bytes)?;
    }
    check_index_is(storage, bytes)
}

/// Fails with `AlreadyExists` unless the committed index is `bytes` (compared by size and
/// tail: the index ends with its checksum).
fn check_index_is(storage: &dyn Storage, bytes: &[u8]) -> Result<()> {
    let tail = bytes.len().min(64);
    let mut stored = vec![0u8; tail];
    let size = storage.size(INDEX_FILE)?;
    let same = size == bytes.len() as u64
        && storage.read_at(INDEX_FILE, size - tail as u64, &mut stored).is_ok()
        && stored == bytes[bytes.len() - tail..];
    if !same {
        return Err(Error::AlreadyExists { path: format!("{}/{INDEX_FILE}", storage.location()).into() });
    }
    Ok(())
}

/// Removes the data files of save `save_id` (which lost the race to commit).
pub(crate) fn remove_save_files(storage: &dyn Storage, save_id: u64) {
    let Ok(names) = storage.list() else { return };
    let ours = format!("{save_id:016x}-r");
    for name in names.into_iter().filter(|n| n.starts_with(&ours) && is_data_file_name(n)) {
        let _ = storage.delete(&name);
    }
}

/// After a commit: data files of saves that started before this one (overwritten or crashed)
/// are garbage. Files of saves that started later are left alone (they may still be running;
/// `tessera gc` removes them if they never commit). The index is checked to still be ours
/// right before deleting, so a save whose index was replaced by a concurrent one on a store
/// without atomic create-if-absent deletes nothing and reports that it lost.
fn remove_unreferenced(storage: &dyn Storage, index: &CheckpointIndex, bytes: &[u8], save_id: u64) -> Result<()> {
    let Ok(names) = storage.list() else { return Ok(()) };
    let ours = save_id >> 24;
    let garbage: Vec<String> = names
        .into_iter()
        .filter(|name| {
            // Temporary index files may belong to a commit in progress: only gc removes them.
            let older = is_data_file_name(name) && save_time_of_file(name).is_some_and(|t| t <= ours);
            older && !index.files.iter().any(|f| &f.name == name)
        })
        .collect();
    if garbage.is_empty() {
        return Ok(());
    }
    check_index_is(storage, bytes)?;
    for name in garbage {
        let _ = storage.delete(&name);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn save_ids_taken_at_once_by_threads_of_one_process_differ() {
        let start = std::sync::Barrier::new(4);
        let mut ids: Vec<u64> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|_| {
                    s.spawn(|| {
                        start.wait();
                        (0..2000).map(|_| new_save_id()).collect::<Vec<_>>()
                    })
                })
                .collect();
            handles.into_iter().flat_map(|h| h.join().unwrap()).collect()
        });
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), 8000);
    }
}
