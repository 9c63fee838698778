//! Load: open the index through the strategy registry, plan this rank's reads with no
//! communication, read only the needed bytes into the caller's buffers. Opt-in fully-parallel
//! load (`LoadOptions::exchange_reads`): the ranks announce their needs, each byte range needed
//! by several ranks is read by one of them (`plan::exchange`) and exchanged in bounded rounds.

// No `unsafe` here: load buffers are reached through ordinary borrows only.
#![forbid(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use crate::comm::{wire, Communicator};
use crate::error::{Error, Result};
use crate::format::CheckpointIndex;
use crate::load::open::{open_checkpoint, open_checkpoint_key_set, Checkpoint};
pub use crate::load::read::LoadStats;
use crate::load::read::{destination_order, execute, read_alone, verify_headers, Reading};
use crate::model::dtype::DType;
use crate::model::factories::{apply_factories, apply_merges, remove_paths, AppliedFactory};
use crate::model::{StatePath, StateTree, TensorData};
use crate::plan::exchange::{
    decode_needs, encode_needs, needed_ranges, plan_exchange, split_segs, ByteRange, ExchangePlan, ExchangeTuning,
    FileChunks, DEFAULT_MAX_PIECE, DEFAULT_ROUND_BYTES,
};
use crate::plan::load::{plan_reads, plan_request, CopySeg, ReadTuning, Request};
use crate::storage::Storage;

/// What to do about keys that do not match between the request and the checkpoint
/// (Megatron's `StrictHandling`). "Unexpected" keys are requested but absent from the
/// checkpoint; "missing" keys are in the checkpoint but requested by no rank (finding them
/// takes one all-gather, so every rank must call load in the `*All` modes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StrictHandling {
    /// No check; an unexpected key fails when its data is looked for.
    #[default]
    AssumeOkUnexpected,
    /// Warn about unexpected keys and skip them.
    LogUnexpected,
    /// Warn about unexpected and missing keys; skip unexpected ones.
    LogAll,
    /// Fail on unexpected keys.
    RaiseUnexpected,
    /// Fail on unexpected or missing keys.
    RaiseAll,
    /// Skip unexpected keys and return them.
    ReturnUnexpected,
    /// Skip unexpected keys; return unexpected and missing keys.
    ReturnAll,
    /// Skip unexpected keys silently.
    IgnoreAll,
}

impl StrictHandling {
    /// Parses Megatron's names (`"assume_ok_unexpected"`, `"raise_all"`, …).
    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "assume_ok_unexpected" => Self::AssumeOkUnexpected,
            "log_unexpected" => Self::LogUnexpected,
            "log_all" => Self::LogAll,
            "raise_unexpected" => Self::RaiseUnexpected,
            "raise_all" => Self::RaiseAll,
            "return_unexpected" => Self::ReturnUnexpected,
            "return_all" => Self::ReturnAll,
            "ignore_all" => Self::IgnoreAll,
            _ => return Err(Error::invalid(format!("unknown strict handling {s:?}"))),
        })
    }
    fn needs_missing(self) -> bool {
        matches!(self, Self::LogAll | Self::RaiseAll | Self::ReturnAll)
    }
}

/// How to load.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Verify the checksum of every block read (default on).
    pub verify_checksums: bool,
    /// Key-mismatch handling.
    pub strict: StrictHandling,
    /// IO threads.
    pub threads: usize,
    /// Read grouping.
    pub tuning: ReadTuning,
    /// Set it to stop the reads early: the load then fails with [`Error::Cancelled`] (target
    /// buffers hold partial data).
    pub cancel: Option<Arc<AtomicBool>>,
    /// Fully-parallel load (default off), for slow shared storage and replicated state (data
    /// parallelism). It makes load collective: every rank of `comm` must call it, with the same
    /// options. Each stored byte range needed by several ranks is read by exactly one of them
    /// (balanced by bytes) and sent to the others through [`Communicator::all_to_all`]. A
    /// failure on any rank before or during the exchange (planning, a read, a checksum) fails
    /// the load on every rank: with its own error there, [`Error::PeerFailed`] elsewhere.
    /// Objects and common state are still read by each rank.
    pub exchange_reads: bool,
    /// With `exchange_reads`: the most bytes a rank sends in one exchange round (a range
    /// needed by `k` ranks counts `k − 1` times), which bounds the memory of the exchange to
    /// about twice this per rank plus what it receives. Default 256 MiB.
    pub exchange_round_bytes: u64,
    /// Load a tensor stored in another dtype by converting it (as `tensor.to(dtype)`: floats
    /// rounded to nearest even as [`DType::cast_bytes`](crate::DType::cast_bytes) does, integers to floats
    /// rounded, floats to integers truncated toward zero and saturated, integers wrapped, bool
    /// as "not zero"; fp8 is never written) instead of failing with [`Error::Mismatch`]. Off by
    /// default: a dtype change is usually a mistake; Megatron-Core's load casts, and so does
    /// its mirror. Each cast tensor is staged once in its stored dtype.
    pub cast_dtypes: bool,
    /// With more than one rank in `comm` and `verify_checksums` (and without `exchange_reads`):
    /// check the blocks that several ranks read parts of together (default on), so that each
    /// rank reads only the bytes it needs from remote storage. Without it a rank reads every
    /// block it touches whole, so loading half of each row of a tensor saved by rows reads
    /// twice the bytes. It makes load collective: every rank of `comm` must call it, with the
    /// same options. The ranks announce their needs in one all-gather; when every rank's
    /// storage is remote ([`Storage::is_local`] false: object stores, network filesystems),
    /// they swap the CRCs of the parts they read (4 bytes per part) in one all-to-all, and each
    /// joins them, with its own, into the stored CRC of every block it touched, so each rank's
    /// own bytes are verified. From a local file every rank reads whole blocks as without the
    /// option: its gaps cost no transfer there, and a few large reads beat many small ones. A
    /// failure on any rank before the swap fails the load on every rank, as with
    /// `exchange_reads`.
    pub share_verification: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            verify_checksums: true,
            strict: StrictHandling::default(),
            threads: crate::threads::default_threads(),
            tuning: ReadTuning::default(),
            cancel: None,
            exchange_reads: false,
            exchange_round_bytes: DEFAULT_ROUND_BYTES,
            cast_dtypes: false,
            share_verification: true,
        }
    }
}

/// What a load returns: the tree with every tensor filled (in the caller's buffers, or in
/// owned buffers where none were given), objects and common values from the checkpoint,
/// non-persistent values as given.
#[derive(Debug)]
pub struct LoadResult<'a> {
    /// The loaded state.
    pub state: StateTree<'a>,
    /// Requested keys not in the checkpoint (in the modes that report them).
    pub unexpected_keys: Vec<String>,
    /// Checkpoint keys nobody requested (in the `*All` modes).
    pub missing_keys: Vec<String>,
    /// IO counters.
    pub stats: LoadStats,
}

/// Loads the state described by `tree` from the checkpoint in `storage`. Only the index
/// entries of the requested tensors are read and decoded (native format), except with
/// `exchange_reads`, where a rank reads for its peers and needs every tensor's chunks.
///
/// Buffers the caller lent (`TensorData::Mut`) are written in place as the bytes arrive, and
/// each checksum block is verified as its last byte passes: when the load fails (a checksum,
/// a read, a cancel), they hold unspecified bytes, possibly some of the block that failed.
///
/// ```
/// use tessera::{load, save, LoadOptions, SaveOptions};
/// use tessera::{DType, ShardedTensor, StateTree, TensorData};
/// use tessera::comm::SoloComm;
/// use tessera::storage::MemoryStorage;
///
/// let storage = MemoryStorage::new();
/// let w: Vec<u8> = (0..8).collect(); // a 2×4 u8 tensor, saved whole
/// let w = ShardedTensor::full("w", DType::U8, &[2, 4], TensorData::Owned(w));
/// save(StateTree::map().with("w", StateTree::Tensor(w)), &storage, &SoloComm, &SaveOptions::default())?;
///
/// // Load row 1 only (piece 1 of 2 along axis 0) into a buffer of our own.
/// let mut row = [0u8; 4];
/// let want = ShardedTensor::from_rank_offsets("w", DType::U8, &[1, 4], TensorData::Mut(&mut row), &[(0, 1, 2)], 0)?;
/// let tree = StateTree::map().with("w", StateTree::Tensor(want));
/// let stats = load(tree, &storage, &SoloComm, &LoadOptions::default())?.stats;
/// assert_eq!(row, [4, 5, 6, 7]);
/// assert_eq!(stats.bytes_needed, 4);
/// # Ok::<(), tessera::Error>(())
/// ```
pub fn load<'a>(
    tree: StateTree<'a>,
    storage: &dyn Storage,
    comm: &dyn Communicator,
    opts: &LoadOptions,
) -> Result<LoadResult<'a>> {
    let factories = apply_factories(tree);
    let mut keys: Vec<String> = Vec::new();
    if let Ok((tree, _)) = &factories {
        tree.for_each_leaf(&mut |_, leaf| {
            if let StateTree::Tensor(t) = leaf {
                keys.push(t.key.clone());
            }
        });
    }
    let ckpt = open_for_load(storage, &keys, comm, opts)?;
    load_with(&ckpt.index, factories, ckpt.storage_for(opts.verify_checksums), comm, opts)
}

impl Reading<'_> {
    /// The settings of `opts` that its reads follow.
    fn of(opts: &LoadOptions) -> Reading<'_> {
        Reading {
            verify: opts.verify_checksums,
            tuning: opts.tuning,
            threads: opts.threads,
            cancel: opts.cancel.as_deref(),
        }
    }
}

/// Whether a load with `opts` over `comm` checks blocks together with the other ranks
/// ([`LoadOptions::share_verification`]): decided from the options and the world alone, so
/// that a rank which failed to open the checkpoint still knows which collectives to make.
fn shares_verification(opts: &LoadOptions, comm: &dyn Communicator) -> bool {
    opts.share_verification && opts.verify_checksums && !opts.exchange_reads && comm.world_size() > 1
}

/// Opens the checkpoint at `storage` as [`load`] does for a rank loading the tensors `keys`:
/// only their index entries, or the whole index with `exchange_reads`. Then
/// [`load_checkpoint`] loads from it. Opening can fail on some ranks only (a damaged section
/// is seen by the readers of its tensor): a rank that fails still makes the collectives its
/// peers' load makes before reading (the strict-mode key exchange; with `exchange_reads` or
/// shared verification, the exchange of needs, carrying the failure), so no rank is left waiting.
pub(crate) fn open_for_load<'s, K: AsRef<str>>(
    storage: &'s dyn Storage,
    keys: &[K],
    comm: &dyn Communicator,
    opts: &LoadOptions,
) -> Result<Checkpoint<'s>> {
    let opened = if opts.exchange_reads {
        open_checkpoint(storage)
    } else {
        open_checkpoint_key_set(storage, &keys.iter().map(|k| k.as_ref().to_string()).collect())
    };
    opened.or_else(|e| {
        if !matches!(e, Error::Comm { .. }) {
            if opts.strict.needs_missing() {
                comm.all_gather(&wire::strings::<&str>(&[]))?;
            }
            if opts.exchange_reads || shares_verification(opts, comm) {
                comm.all_gather(&wire::failed(&e))?;
            }
        }
        Err(e)
    })
}

/// [`load`] from a checkpoint already opened (reuse across loads) by [`open_for_load`],
/// [`crate::open`], or [`crate::open_with`] with at least the keys
/// requested (`exchange_reads` needs the whole index).
pub(crate) fn load_checkpoint<'a>(
    ckpt: &Checkpoint<'_>,
    tree: StateTree<'a>,
    comm: &dyn Communicator,
    opts: &LoadOptions,
) -> Result<LoadResult<'a>> {
    load_with(&ckpt.index, apply_factories(tree), ckpt.storage_for(opts.verify_checksums), comm, opts)
}

/// [`load`] from an index an opener gave (and so validated): the tools' loads of box
/// parts, one call per batch, skip a second run of the gate over the whole index.
pub(crate) fn load_opened<'a>(
    index: &CheckpointIndex,
    tree: StateTree<'a>,
    storage: &dyn Storage,
    comm: &dyn Communicator,
    opts: &LoadOptions,
) -> Result<LoadResult<'a>> {
    load_with(index, apply_factories(tree), storage, comm, opts)
}

type Built<'a> = Result<(StateTree<'a>, Vec<AppliedFactory>)>;

/// The load itself: `factories` is the tree with its factories applied (or why they failed:
/// reported in step with the other ranks).
fn load_with<'a>(
    index: &CheckpointIndex,
    factories: Built<'a>,
    storage: &dyn Storage,
    comm: &dyn Communicator,
    opts: &LoadOptions,
) -> Result<LoadResult<'a>> {
    let mut strict_gathered = false;
    let prepared = prepare(index, factories, comm, opts, &mut strict_gathered);
    let (prepared, stats) = if opts.exchange_reads || shares_verification(opts, comm) {
        // Received bytes are scattered outside `execute`, and shared verification runs two
        // `execute`s (each checks only its own destinations): every destination of the load
        // inside its buffer, none written twice, checked once before any byte is written,
        // whatever built the index.
        let prepared = prepared.and_then(|p| {
            let lens: Vec<usize> = p.datas.iter().map(TensorData::len).collect();
            destination_order(index, &p.segs, &lens).map(|_| p)
        });
        let mut p = match prepared {
            Ok(p) => p,
            Err(e @ Error::Comm { .. }) => return Err(e),
            Err(e) => {
                // Make the collectives the others make, carrying the failure, then report it.
                if opts.strict.needs_missing() && !strict_gathered {
                    comm.all_gather(&wire::strings::<&str>(&[]))?;
                }
                comm.all_gather(&wire::failed(&e))?;
                return Err(e);
            }
        };
        let stats = if opts.exchange_reads {
            load_exchanged(index, storage, comm, opts, &p.segs, &mut targets_of(&mut p.datas))?
        } else {
            let (segs, how) = (std::mem::take(&mut p.segs), Reading::of(opts));
            crate::load::shared::load_shared_checks(index, storage, comm, &how, segs, &mut targets_of(&mut p.datas))?
        };
        (p, stats)
    } else {
        let mut p = prepared?;
        let segs = std::mem::take(&mut p.segs);
        let stats = read_alone(index, storage, &Reading::of(opts), segs, &mut targets_of(&mut p.datas))?;
        (p, stats)
    };
    let Prepared { tree, mut datas, applied, objects_wanted, unexpected_keys, missing, casts, .. } = prepared;
    for c in casts.iter().rev() {
        let staged = datas.pop().unwrap_or_default();
        debug_assert_eq!(datas.len(), c.staging);
        let dst = datas[c.target].bytes_mut().unwrap_or_default();
        crate::model::dtype::cast_numeric(staged.bytes().unwrap_or_default(), c.stored, c.wanted, dst)
            .map_err(|e| Error::Mismatch { key: c.key.clone(), reason: format!("stored as {}: {e}", c.stored) })?;
    }
    // The loaded buffers go back into their leaves (the same walk that took them out).
    let mut datas = datas.into_iter();
    let mut tree = tree.map_leaves(&mut |_, leaf| {
        Ok(match leaf {
            StateTree::Tensor(mut t) => {
                t.data = datas.next().unwrap_or_default();
                StateTree::Tensor(t)
            }
            other => other,
        })
    })?;
    use StrictHandling as S;

    if objects_wanted > 0 {
        tree = tree.map_leaves(&mut |_, leaf| match leaf {
            StateTree::Object(mut o) => {
                o.data = Some(read_object(index, storage, &o.key, &o.global_offset, opts.verify_checksums)?);
                Ok(StateTree::Object(o))
            }
            other => Ok(other),
        })?;
    }

    // Common values form the base; sharded leaves loaded above stay where they are.
    for (path, v) in &index.common {
        let keep =
            matches!(tree.get(path), Some(StateTree::Tensor(_) | StateTree::Object(_) | StateTree::NonPersistent(_)));
        if !keep {
            tree.set_path(path, StateTree::Value(v.clone()));
        }
    }
    let state = apply_merges(tree, applied)?;
    let (unexpected_keys, missing_keys) = match opts.strict {
        S::ReturnAll | S::LogAll | S::RaiseAll => (unexpected_keys, missing),
        S::ReturnUnexpected | S::LogUnexpected | S::RaiseUnexpected => (unexpected_keys, Vec::new()),
        _ => (Vec::new(), Vec::new()),
    };
    Ok(LoadResult { state, unexpected_keys, missing_keys, stats })
}

/// What a rank knows before reading tensor data: its tree (factories applied, unexpected keys
/// removed), the copy segments of its tensors and their targets.
///
/// The tensors' buffers are taken out of the tree while the load writes them (`datas`, one per
/// tensor leaf in walk order; `CopySeg::target` indexes it): the reads get ordinary `&mut`
/// borrows of them, cut into disjoint pieces, and no raw pointer into the tree is needed.
struct Prepared<'a> {
    tree: StateTree<'a>,
    datas: Vec<TensorData<'a>>,
    applied: Vec<AppliedFactory>,
    segs: Vec<CopySeg>,
    objects_wanted: usize,
    unexpected_keys: Vec<String>,
    missing: Vec<String>,
    /// Requests read in their stored dtype into a staging buffer (in `datas` past the tree's
    /// buffers), converted into their own buffer once the bytes are in.
    casts: Vec<PendingCast>,
}

/// A request loaded through a staging buffer in the stored dtype (`LoadOptions::cast_dtypes`).
struct PendingCast {
    key: String,
    staging: usize,
    target: usize,
    stored: DType,
    wanted: DType,
}

/// The local part of a load: factories, key checks (with the strict-mode all-gather, after
/// which `strict_gathered` is set), requests and their copy segments; zero-fills targets that
/// extend past a stored tensor.
fn prepare<'a>(
    index: &CheckpointIndex,
    factories: Built<'a>,
    comm: &dyn Communicator,
    opts: &LoadOptions,
    strict_gathered: &mut bool,
) -> Result<Prepared<'a>> {
    if opts.exchange_reads && !index.omitted_tensors.is_empty() {
        return Err(Error::invalid(
            "exchange_reads reads for other ranks and needs every tensor's chunks: open with open_checkpoint",
        ));
    }
    let (mut tree, applied) = factories?;

    // Keys requested and their paths.
    let mut requested: BTreeSet<String> = BTreeSet::new();
    let mut unexpected: BTreeMap<String, Vec<StatePath>> = BTreeMap::new();
    tree.for_each_leaf(&mut |path, leaf| {
        let key = match leaf {
            StateTree::Tensor(t) => Some((&t.key, index.tensor(&t.key).is_some())),
            StateTree::Object(o) => Some((&o.key, index.object(&o.key).is_some())),
            _ => None,
        };
        if let Some((key, present)) = key {
            requested.insert(key.clone());
            if !present {
                unexpected.entry(key.clone()).or_default().push(path.to_vec());
            }
        }
    });
    let mut missing = Vec::new();
    if opts.strict.needs_missing() {
        let mine: Vec<&String> = requested.iter().collect();
        *strict_gathered = true;
        let all = comm.all_gather(&wire::strings(&mine))?;
        let mut anyone: BTreeSet<&str> = BTreeSet::new();
        for (r, b) in all.iter().enumerate() {
            let keys = wire::read_strings(b)
                .map_err(|why| Error::Comm { reason: format!("keys requested by rank {r}: {why}") })?;
            anyone.extend(keys);
        }
        let stored = index.tensor_keys().chain(index.objects.iter().map(|o| o.key.as_str()));
        missing = stored.filter(|k| !anyone.contains(k)).map(str::to_string).collect();
    }
    let unexpected_keys: Vec<String> = unexpected.keys().cloned().collect();
    use StrictHandling as S;
    match opts.strict {
        S::RaiseUnexpected if !unexpected_keys.is_empty() => {
            return Err(Error::KeyMismatch { unexpected: unexpected_keys, missing: Vec::new() })
        }
        S::RaiseAll if !unexpected_keys.is_empty() || !missing.is_empty() => {
            return Err(Error::KeyMismatch { unexpected: unexpected_keys, missing })
        }
        S::LogUnexpected | S::LogAll if !unexpected_keys.is_empty() || !missing.is_empty() => {
            eprintln!("tessera: warning: unexpected keys (skipped): {unexpected_keys:?}; missing keys: {missing:?}");
        }
        _ => {}
    }
    if opts.strict != S::AssumeOkUnexpected {
        let paths: Vec<StatePath> = unexpected.values().flatten().cloned().collect();
        remove_paths(&mut tree, &paths);
    }

    // Requests and targets; buffers not given are allocated once the plan shows the checkpoint
    // stores every byte of them (a shape read from a checkpoint may claim far more than it
    // holds: that is a `NotCovered` error, not an allocation of what it claims).
    let mut requests: Vec<Request> = Vec::new();
    let mut datas: Vec<TensorData<'a>> = Vec::new();
    let mut deferred: Vec<(usize, u64, String)> = Vec::new();
    let mut objects_wanted = 0usize;
    let tree = tree.map_leaves(&mut |_, leaf| {
        Ok(match leaf {
            StateTree::Tensor(mut t) => {
                t.check(false)?;
                if matches!(t.data, TensorData::None) {
                    deferred.push((datas.len(), t.data_nbytes(), t.key.clone()));
                } else if t.data.bytes_mut().is_none() {
                    return Err(Error::invalid(format!(
                        "{:?}: load needs a writable buffer (TensorData::Mut or Owned), got a read-only one",
                        t.key
                    )));
                }
                datas.push(std::mem::take(&mut t.data));
                requests.push(Request {
                    key: t.key.clone(),
                    dtype: t.dtype,
                    global_shape: t.global_shape.clone(),
                    offset: t.global_offset.clone(),
                    shape: t.box_shape(),
                    flat: t.flattened_range.as_ref().map(|r| (r.start, r.end)),
                    allow_shape_mismatch: t.allow_shape_mismatch,
                    target: datas.len() - 1,
                });
                StateTree::Tensor(t)
            }
            StateTree::Object(o) => {
                objects_wanted += 1;
                StateTree::Object(o)
            }
            other => other,
        })
    })?;

    let mut segs = Vec::new();
    let mut zero_fill = Vec::new();
    let mut casts = Vec::new();
    for r in &mut requests {
        let stored = index.tensor(&r.key).map(|t| t.dtype);
        if let Some(stored) = stored.filter(|d| opts.cast_dtypes && *d != r.dtype) {
            let target_bytes = match deferred.iter().find(|d| d.0 == r.target) {
                Some(d) => d.1,
                None => datas[r.target].len() as u64,
            };
            let nbytes = (target_bytes / r.dtype.size() as u64)
                .checked_mul(stored.size() as u64)
                .ok_or_else(|| Error::invalid(format!("{:?}: staging size overflows", r.key)))?;
            // Refused before any read if no cast exists; staged like a buffer the caller did not
            // give: allocated once the plan shows the checkpoint stores it.
            crate::model::dtype::cast_numeric(&[], stored, r.dtype, &mut [])
                .map_err(|e| Error::Mismatch { key: r.key.clone(), reason: format!("stored as {stored}: {e}") })?;
            datas.push(TensorData::None);
            deferred.push((datas.len() - 1, nbytes, r.key.clone()));
            casts.push(PendingCast {
                key: r.key.clone(),
                staging: datas.len() - 1,
                target: r.target,
                stored,
                wanted: r.dtype,
            });
            r.dtype = stored;
            r.target = datas.len() - 1;
        }
        let p = plan_request(index, r)?;
        if p.zero_fill {
            zero_fill.push(r.target);
        }
        segs.extend(p.segs);
    }
    for (target, nbytes, key) in &deferred {
        let buf = crate::load::zeroed(*nbytes)
            .ok_or_else(|| Error::invalid(format!("{key:?}: cannot allocate {nbytes} bytes for the tensor")))?;
        datas[*target] = TensorData::Owned(buf);
    }
    // Buffers just allocated are zero already (untouched pages stay free).
    zero_fill.retain(|t| deferred.binary_search_by_key(t, |d| d.0).is_err());
    for t in zero_fill {
        datas[t].bytes_mut().unwrap_or_default().fill(0);
    }
    Ok(Prepared { tree, datas, applied, segs, objects_wanted, unexpected_keys, missing, casts })
}

/// The writable buffers of `datas`, indexed like them (`prepare` refused read-only ones).
fn targets_of<'d>(datas: &'d mut [TensorData<'_>]) -> Vec<&'d mut [u8]> {
    datas.iter_mut().map(|d| d.bytes_mut().unwrap_or_default()).collect()
}

/// Copies the bytes of `range` (in `data`) into the targets of `pieces` (segments within it).
fn scatter(range: &ByteRange, data: &[u8], pieces: &[(usize, CopySeg)], targets: &mut [&mut [u8]]) -> Result<()> {
    for (_, s) in pieces {
        let at = (s.file_off - range.off) as usize;
        let src = &data[at..at + s.len as usize];
        let dst = targets.get_mut(s.target).and_then(|t| {
            let start = usize::try_from(s.dst_off).ok()?;
            t.get_mut(start..start.checked_add(src.len())?)
        });
        let Some(dst) = dst else {
            return Err(Error::invalid(format!("copy of {} bytes at {} past the load buffer", s.len, s.dst_off)));
        };
        dst.copy_from_slice(src);
    }
    Ok(())
}

/// Fully-parallel tensor reads (`exchange_reads`). Collectives, the same on every rank: one
/// all-gather of the needs (or of a failure), then `plan.rounds` all-to-alls. A rank that fails
/// sends its error in the next collective instead of data, and everyone stops after it.
fn load_exchanged(
    index: &CheckpointIndex,
    storage: &dyn Storage,
    comm: &dyn Communicator,
    opts: &LoadOptions,
    segs: &[CopySeg],
    targets: &mut [&mut [u8]],
) -> Result<LoadStats> {
    let (me, world) = (comm.rank(), comm.world_size());
    let verify = opts.verify_checksums;
    let cancel = opts.cancel.as_deref();
    let mut stats = LoadStats { bytes_needed: segs.iter().map(|s| s.len).sum(), ..LoadStats::default() };

    let all = comm.all_gather(&wire::ok(&encode_needs(&needed_ranges(index, segs, verify))))?;
    let needs = wire::outcomes(&all, me, &mut None)?
        .into_iter()
        .enumerate()
        .map(|(r, m)| decode_needs(m).map_err(|e| Error::Comm { reason: format!("needs of rank {r}: {e}") }))
        .collect::<Result<Vec<_>>>()?;
    drop(all);
    let chunks = FileChunks::new(index);
    let tuning = ExchangeTuning { max_piece: DEFAULT_MAX_PIECE, round_bytes: opts.exchange_round_bytes.max(1) };
    let plan = plan_exchange(&needs, verify.then_some(&chunks), tuning);
    drop(needs);
    // Reads never run through bytes between needed ranges: those are another rank's to read.
    let read_tuning = ReadTuning { max_gap: 0, ..opts.tuning };

    // From here on a failure is kept until the next collective, which carries it.
    let mut pending: Option<Error> = None;
    let me32 = me as u32;
    let pieces = split_segs(&plan, me32, segs).unwrap_or_else(|e| {
        pending = Some(Error::Comm { reason: format!("exchange plan: {e}") });
        Vec::new()
    });
    let pieces_of = |i: usize| {
        let lo = pieces.partition_point(|p| p.0 < i);
        &pieces[lo..lo + pieces[lo..].partition_point(|p| p.0 == i)]
    };

    // Ranges only this rank needs: read straight into the targets, like a normal load.
    if pending.is_none() {
        let local: Vec<CopySeg> = pieces.iter().filter(|(i, _)| plan.ranges[*i].round.is_none()).map(|p| p.1).collect();
        let rp = plan_reads(index, local, verify, read_tuning);
        stats.bytes_read += rp.bytes_read;
        stats.reads += rp.spans.len();
        let mut r = execute(storage, index, &rp, targets, opts.threads, cancel);
        if r.is_ok() && verify {
            let mut files: Vec<u32> = plan.ranges.iter().filter(|p| p.reader == me32).map(|p| p.range.file).collect();
            files.dedup();
            r = verify_headers(storage, index, &files).map(|n| stats.header_bytes_read = n);
        }
        pending = r.err();
    }

    // Ranges needed by several ranks, by round: those this rank reads and those it receives.
    let rounds = plan.rounds as usize;
    let mut reads_in: Vec<Vec<usize>> = vec![Vec::new(); rounds];
    let mut recv_in: Vec<Vec<usize>> = vec![Vec::new(); rounds];
    for (i, p) in plan.ranges.iter().enumerate() {
        let Some(k) = p.round else { continue };
        if p.reader == me32 {
            reads_in[k as usize].push(i);
        } else if plan.needers_of(i).binary_search(&me32).is_ok() {
            recv_in[k as usize].push(i);
        }
    }
    let mut buf: Vec<u8> = Vec::new();
    for k in 0..rounds {
        if pending.is_none() && cancel.is_some_and(|c| c.load(std::sync::atomic::Ordering::Relaxed)) {
            pending = Some(Error::Cancelled);
        }
        let mut send: Vec<Vec<u8>> = Vec::new();
        if pending.is_none() {
            match read_round(index, storage, &chunks, &plan, &reads_in[k], &mut buf, opts, read_tuning) {
                Ok((bytes, spans)) => {
                    stats.bytes_read += bytes;
                    stats.reads += spans;
                    let mut size = vec![1usize; world];
                    for &i in &reads_in[k] {
                        for &r in plan.needers_of(i) {
                            size[r as usize] += plan.ranges[i].range.len as usize;
                        }
                    }
                    send = size
                        .iter()
                        .enumerate()
                        .map(|(r, &n)| Vec::with_capacity(if r == me { 1 } else { n }))
                        .collect();
                    send.iter_mut().for_each(wire::begin_ok);
                    let mut at = 0;
                    for &i in &reads_in[k] {
                        let p = &plan.ranges[i];
                        let data = &buf[at..at + p.range.len as usize];
                        at += data.len();
                        if let Err(e) = scatter(&p.range, data, pieces_of(i), targets) {
                            pending = Some(e);
                            break;
                        }
                        for &r in plan.needers_of(i).iter().filter(|&&r| r != me32) {
                            send[r as usize].extend_from_slice(data);
                        }
                    }
                }
                Err(e) => pending = Some(e),
            }
        }
        if let Some(e) = &pending {
            send = vec![wire::failed(e); world];
        }
        let recv = comm.all_to_all(send)?;
        if let Some(e) = pending.take() {
            return Err(e);
        }
        let recv = wire::outcomes(&recv, me, &mut None)?;
        let mut used = vec![0usize; world];
        for &i in &recv_in[k] {
            let p = &plan.ranges[i];
            let src = p.reader as usize;
            let len = p.range.len as usize;
            let Some(data) = recv[src].get(used[src]..used[src] + len) else {
                pending = Some(Error::Comm { reason: format!("exchange round {k}: short message from rank {src}") });
                break;
            };
            if let Err(e) = scatter(&p.range, data, pieces_of(i), targets) {
                pending = Some(e);
                break;
            }
            used[src] += len;
            stats.bytes_received += len as u64;
        }
        if pending.is_none() {
            if let Some(r) = (0..world).find(|&r| r != me && used[r] != recv[r].len()) {
                pending = Some(Error::Comm { reason: format!("exchange round {k}: unexpected bytes from rank {r}") });
            }
        }
    }
    // A failure after the last collective concerns this rank only: nobody waits for it.
    match pending {
        Some(e) => Err(e),
        None => Ok(stats),
    }
}

/// Reads (and verifies, when asked) the planned ranges `ranges`, back to back, into `buf`.
/// Returns the bytes read and the number of reads.
#[allow(clippy::too_many_arguments)]
fn read_round(
    index: &CheckpointIndex,
    storage: &dyn Storage,
    chunks: &FileChunks,
    plan: &ExchangePlan,
    ranges: &[usize],
    buf: &mut Vec<u8>,
    opts: &LoadOptions,
    tuning: ReadTuning,
) -> Result<(u64, usize)> {
    buf.clear();
    if ranges.is_empty() {
        return Ok((0, 0));
    }
    let mut segs = Vec::new();
    let mut at = 0u64;
    for &i in ranges {
        let r = &plan.ranges[i].range;
        chunks.segs(r, 0, at, &mut segs).map_err(|e| Error::Comm { reason: format!("exchange plan: {e}") })?;
        at += r.len;
    }
    buf.resize(at as usize, 0);
    let rp = plan_reads(index, segs, opts.verify_checksums, tuning);
    execute(storage, index, &rp, &mut [&mut buf[..]], opts.threads, opts.cancel.as_deref())?;
    Ok((rp.bytes_read, rp.spans.len()))
}

pub(crate) fn read_object(
    index: &CheckpointIndex,
    storage: &dyn Storage,
    key: &str,
    offset: &[u64],
    verify: bool,
) -> Result<Vec<u8>> {
    let entry = index
        .object(key)
        .ok_or_else(|| Error::NotCovered { key: key.into(), region: "(object not in checkpoint)".into() })?;
    let shard = entry
        .shards
        .iter()
        .find(|s| s.offset == offset)
        .ok_or_else(|| Error::NotCovered { key: key.into(), region: format!("object shard {offset:?}") })?;
    let name = &index.files[shard.file as usize].name;
    if index.block_size == 0 {
        // Foreign formats: each shard is a whole virtual file, decoded by the view.
        return storage.read(name);
    }
    let mut buf = vec![0u8; shard.len as usize];
    storage.read_at(name, shard.byte_offset, &mut buf)?;
    if verify && crate::model::crc::crc32c(&buf) != shard.crc {
        return Err(Error::corrupt(
            format!("{}/{name}", storage.location()),
            format!("checksum mismatch in object {key:?} shard {offset:?}"),
        ));
    }
    Ok(buf)
}

/// Dtype and global shape of a stored tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorMeta {
    /// Element type.
    pub dtype: DType,
    /// Global shape.
    pub global_shape: Vec<u64>,
}

/// Key → dtype and global shape of every tensor of `index`.
pub(crate) fn tensors_metadata(index: &CheckpointIndex) -> BTreeMap<String, TensorMeta> {
    index
        .tensors
        .iter()
        .map(|t| (t.key.clone(), TensorMeta { dtype: t.dtype, global_shape: t.global_shape.clone() }))
        .collect()
}

/// A whole tensor in memory.
#[derive(Debug, Clone, PartialEq)]
pub struct PlainTensor {
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<u64>,
    /// C-contiguous bytes.
    pub data: Vec<u8>,
}

/// Whole tensors of an opened checkpoint (all, or those whose key is in `keys`), unsharded.
pub(crate) fn read_plain_tensors(
    ckpt: &Checkpoint<'_>,
    keys: Option<&[&str]>,
) -> Result<BTreeMap<String, PlainTensor>> {
    let (index, storage) = (&ckpt.index, ckpt.storage());
    let mut tree = StateTree::map();
    for t in &index.tensors {
        if keys.is_some_and(|ks| !ks.contains(&t.key.as_str())) {
            continue;
        }
        tree.insert(
            t.key.clone(),
            StateTree::Tensor(crate::model::ShardedTensor::full(&t.key, t.dtype, &t.global_shape, TensorData::None)),
        );
    }
    if let Some(ks) = keys {
        if let Some(k) = ks.iter().find(|k| index.tensor(k).is_none()) {
            return Err(Error::not_found(format!("{}: tensor {k:?}", storage.location())));
        }
    }
    let loaded = load_opened(index, tree, storage, &crate::comm::SoloComm, &LoadOptions::default())?;
    let mut out = BTreeMap::new();
    if let StateTree::Map(m) = loaded.state {
        for (k, v) in m {
            if let StateTree::Tensor(t) = v {
                let data = match t.data {
                    TensorData::Owned(v) => v,
                    other => other.bytes().map(<[u8]>::to_vec).unwrap_or_default(),
                };
                out.insert(k, PlainTensor { dtype: t.dtype, shape: t.global_shape, data });
            }
        }
    }
    Ok(out)
}

/// The common (non-sharded) state of `index` as a tree of plain values.
pub(crate) fn common_state(index: &CheckpointIndex) -> StateTree<'static> {
    let mut tree = StateTree::map();
    for (path, v) in &index.common {
        tree.set_path(path, StateTree::Value(v.clone()));
    }
    tree
}

/// Fills the data of every [`crate::model::ShardedObject`] in `tree` from the checkpoint; other
/// leaves are left as they are.
pub(crate) fn load_sharded_objects<'a>(ckpt: &Checkpoint<'_>, tree: StateTree<'a>) -> Result<StateTree<'a>> {
    tree.map_leaves(&mut |_, leaf| match leaf {
        StateTree::Object(mut o) => {
            o.data = Some(read_object(&ckpt.index, ckpt.storage(), &o.key, &o.global_offset, true)?);
            Ok(StateTree::Object(o))
        }
        other => Ok(other),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::SoloComm;
    use crate::format::{Crcs, FileEntry, StoredChunk, TensorEntry};
    use crate::model::dtype::DType;
    use crate::model::ShardedTensor;
    use crate::storage::MemoryStorage;

    /// A hostile index: `x` (4 × u8) stored as chunk [0, 3) and chunk [2, 3), overlapping at
    /// element 2 (and so leaving element 3 out, while the elements add up to 4: the planner's
    /// coverage count does not see it), over a file holding bytes 0..8.
    fn overlapping() -> (CheckpointIndex, MemoryStorage) {
        let chunk = |offset: u64, len: u64, byte_offset: u64| StoredChunk {
            file: 0,
            byte_offset,
            offset: [offset].as_slice().into(),
            shape: [len].as_slice().into(),
            flat: None,
            crcs: Crcs::new(),
        };
        let index = CheckpointIndex::of_tensors(
            0,
            vec![FileEntry { name: "d".into(), size: 8, header_len: 0, header_crc: 0 }],
            vec![TensorEntry::new("x".into(), DType::U8, vec![4], vec![chunk(0, 3, 0), chunk(2, 1, 4)])],
        );
        let storage = MemoryStorage::new();
        let w = storage.create("d", 8).unwrap();
        w.write_at(0, &[1, 2, 3, 4, 5, 6, 7, 8]).unwrap();
        w.finish().unwrap();
        (index, storage)
    }

    /// The read engine's own check, independent of any validation of the index when it is
    /// opened: `load_with` is what every load entry point runs after opening.
    #[test]
    fn overlapping_chunks_are_refused_before_any_write() {
        let (index, storage) = overlapping();
        for exchange_reads in [false, true] {
            let mut buf = [0xEEu8; 4];
            let tree = StateTree::map()
                .with("x", StateTree::Tensor(ShardedTensor::full("x", DType::U8, &[4], TensorData::Mut(&mut buf))));
            let opts = LoadOptions { verify_checksums: false, exchange_reads, ..LoadOptions::default() };
            let r = load_with(&index, apply_factories(tree), &storage, &SoloComm, &opts);
            assert!(
                matches!(r, Err(Error::InvalidSharding { ref key, .. }) if key == "x"),
                "exchange_reads {exchange_reads}: {r:?}"
            );
            assert_eq!(buf, [0xEE; 4], "exchange_reads {exchange_reads}: nothing written");
        }
    }

    #[test]
    fn buffers_go_back_to_their_leaves() {
        let (mut index, storage) = overlapping();
        // Make the index valid: [0, 2) and [2, 4).
        let chunks =
            index.tensors[0].chunks().iter().map(|c| StoredChunk { shape: [2].as_slice().into(), ..c.clone() });
        index.tensors[0] = TensorEntry::new("x".into(), DType::U8, vec![4], chunks.collect());
        let mut buf = [0xEEu8; 4];
        let tree = StateTree::map()
            .with("a", StateTree::Tensor(ShardedTensor::full("x", DType::U8, &[4], TensorData::Mut(&mut buf))))
            .with("b", StateTree::Tensor(ShardedTensor::full("x", DType::U8, &[4], TensorData::None)));
        let opts = LoadOptions { verify_checksums: false, threads: 2, ..LoadOptions::default() };
        let res = load_with(&index, apply_factories(tree), &storage, &SoloComm, &opts).unwrap();
        let data = |k: &str| match res.state.get(&[crate::model::PathSeg::Key(k.into())]) {
            Some(StateTree::Tensor(t)) => t.data.bytes().map(<[u8]>::to_vec),
            _ => None,
        };
        assert_eq!(data("a").unwrap(), [1, 2, 5, 6]);
        assert_eq!(data("b").unwrap(), [1, 2, 5, 6]);
        assert!(
            matches!(res.state.get(&[crate::model::PathSeg::Key("a".into())]), Some(StateTree::Tensor(t)) if matches!(t.data, TensorData::Mut(_)))
        );
        drop(res);
        assert_eq!(buf, [1, 2, 5, 6]);
    }
}
