//! The collective first step of every writer: collect each rank's shards from its state tree,
//! exchange them in one all-gather, validate the union on every rank (the same verdict
//! everywhere, before anything is written), assign the writers of replicated chunks; with a
//! [`PlanCache`], skip all of it for a structure that did not change. Also the look at the
//! location that every writer makes first, and save ids.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::comm::{wire, Communicator};
use crate::error::{Error, Result};
use crate::model::factories::apply_factories_collective;
use crate::model::{StatePath, StateTree, Value};
use crate::plan::fasthash::mix64;
use crate::plan::save::{
    assign_writers, cache_hit, plan_digest, plan_options, validate_global_with, CacheCheck, ObjectMeta, RankPlan,
    ShardMeta,
};
use crate::save::options::{CachedPlan, PlanCache, SaveOptions};
use crate::storage::{Storage, CONDITIONAL_PUT_PROBE};
use crate::threads::on_cores;

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

/// Start time (ms) of save `save_id`.
pub(crate) fn save_time(save_id: u64) -> u64 {
    save_id >> 24
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
/// use tessera::{validate_sharding_integrity, DType, Error, ShardedTensor, StateTree, TensorData};
/// use tessera::comm::InProcessComm;
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

/// The files Megatron's `serialization.save` writes before the sharded part (its common
/// strategy and its config): a save may find them in the location it writes.
pub(crate) const MEGATRON_COMPANIONS: [&str; 2] = ["common.pt", "metadata.json"];

/// A save without `overwrite` into a location that holds no checkpoint of its format (`what`)
/// writes there only if nothing else is there: its own kind of files (`ours`: leftovers of
/// saves that never committed, Megatron's companions) are fine; anything else (another
/// format's checkpoint, unrelated files) is refused, naming it. A concurrent save's probe of
/// the store's conditional puts is not foreign: the race between the saves is the commit's to
/// decide (`AlreadyExists` for the loser), not this check's.
pub(crate) fn refuse_foreign_files(storage: &dyn Storage, ours: impl Fn(&str) -> bool, what: &str) -> Result<()> {
    let names = storage.list()?;
    let foreign: Vec<&String> = names.iter().filter(|n| !ours(n) && !n.starts_with(CONDITIONAL_PUT_PROBE)).collect();
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
pub(crate) fn plan_with_cache(
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
