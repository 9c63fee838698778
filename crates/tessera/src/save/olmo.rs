//! Saving in OLMo-core 0.1.x's own format (`formats::olmo`), which ai2-olmo-core itself loads.
//!
//! The global plan is the native save's: one exchange of shard metadata per directory, the
//! check that the shards tile every tensor (before anything is written or removed), and the
//! spreading of replicated shards over the ranks that hold them; copies are told apart by
//! OLMo-core's rule (identical shards are replicas, `formats::olmo::choose_main_replicas`).
//! Each rank then writes `rank_{r}.safetensors` (per key its shards back to back as one 1-D
//! tensor; block checksums in the header's `__metadata__`), and rank 0 writes `metadata.json`
//! once every rank's file is complete: the commit. With `overwrite`, the old `metadata.json` is
//! removed after validation and before any file is rewritten, so a crash leaves no loadable mix
//! of old and new files. Several directories saved together (`model/` and `optim/`) are planned
//! and validated all before any is touched, and committed in order.

use std::collections::BTreeSet;

use crate::comm::{wire, Communicator};
use crate::error::{Error, Result};
use crate::formats::olmo::metadata::{
    choose_main_replicas, metadata_from_plans, metadata_json, rank_file_name, RankFileLayout, BACKEND, METADATA_FILE,
};
use crate::load::open::detect_format;
use crate::model::factories::apply_factories_collective;
use crate::model::{path_string, StateTree};
use crate::plan::save::RankPlan;
use crate::save::native::{collect, plan_globally, SaveOptions};
use crate::save::write::{write_sources, Source};
use crate::storage::Storage;

/// What an OLMo-core save did to one directory, as seen from one rank.
#[derive(Debug, Clone, Default)]
pub struct OlmoSaveReport {
    /// Files this rank created (its data file; `metadata.json` too on rank 0), relative to the
    /// directory.
    pub files: Vec<String>,
    /// Bytes this rank wrote.
    pub bytes_written: u64,
    /// Text of the committed `metadata.json`.
    pub metadata: String,
}

/// Saves this rank's tensors as one OLMo-core 0.1.x checkpoint directory (what
/// `Checkpointer.save` writes). Every rank of `comm` calls it with its own tree; the tree holds
/// tensors only (the format has no objects or common values), and tensor keys become the
/// metadata's keys. Identical shards held by several ranks are written once. Errors come out
/// identically on every rank.
///
/// ```
/// use tessera::{open, read_olmo_metadata, save_olmo, SaveOptions};
/// use tessera::{DType, MemoryStorage, ShardedTensor, SoloComm, StateTree, TensorData};
///
/// let storage = MemoryStorage::new();
/// let w = ShardedTensor::full("w", DType::U8, &[4], TensorData::Owned(vec![1, 2, 3, 4]));
/// let tree = StateTree::map().with("w", StateTree::Tensor(w));
/// let report = save_olmo(tree, &storage, &SoloComm, &SaveOptions::default())?;
/// assert_eq!(report.files, ["rank_0.safetensors", "metadata.json"]);
/// assert_eq!(read_olmo_metadata(&storage)?, report.metadata);
///
/// let ckpt = open(&storage)?;
/// assert_eq!(ckpt.format().backend, "olmo_safetensors");
/// assert_eq!(ckpt.read_tensors(None)?["w"].data, [1, 2, 3, 4]);
/// # Ok::<(), tessera::Error>(())
/// ```
pub fn save_olmo(
    tree: StateTree<'_>,
    storage: &dyn Storage,
    comm: &dyn Communicator,
    opts: &SaveOptions,
) -> Result<OlmoSaveReport> {
    Ok(save_olmo_dirs(vec![(tree, storage)], comm, opts)?.pop().expect("one directory, one report"))
}

/// [`save_olmo`] of several directories as one save (`save_model_and_optim_state`'s `model/`
/// and `optim/`): every directory is planned and validated before any is uncommitted or
/// written, and they are committed in the order given. Returns one report per directory.
///
/// ```
/// use tessera::{open, save_olmo_dirs, SaveOptions};
/// use tessera::{DType, MemoryStorage, ShardedTensor, SoloComm, StateTree, TensorData};
///
/// let (model, optim) = (MemoryStorage::new(), MemoryStorage::new());
/// let tree = |k: &str, v: u8| {
///     let t = ShardedTensor::full(k, DType::U8, &[2], TensorData::Owned(vec![v; 2]));
///     StateTree::map().with(k, StateTree::Tensor(t))
/// };
/// let dirs = vec![(tree("w", 1), &model as &dyn tessera::Storage), (tree("w.exp_avg", 2), &optim)];
/// let reports = save_olmo_dirs(dirs, &SoloComm, &SaveOptions::default())?;
/// assert_eq!(reports.len(), 2);
/// assert_eq!(open(&optim)?.read_tensors(None)?["w.exp_avg"].data, [2, 2]);
/// # Ok::<(), tessera::Error>(())
/// ```
pub fn save_olmo_dirs<'t>(
    dirs: Vec<(StateTree<'t>, &dyn Storage)>,
    comm: &dyn Communicator,
    opts: &SaveOptions,
) -> Result<Vec<OlmoSaveReport>> {
    let rank = comm.rank();
    let (mut trees, storages): (Vec<_>, Vec<_>) =
        dirs.into_iter().map(|(tree, storage)| (apply_factories_collective(tree), storage)).unzip();

    // Plan and validate every directory (collective, the same verdict everywhere).
    let mut planned = Vec::with_capacity(trees.len());
    for ((tree, factory_error), &storage) in trees.iter_mut().zip(&storages) {
        let mut c = collect(tree, rank, true, opts.distribute_replicas);
        let found = factory_error.take().or(c.local_error.take()).or_else(|| unsupported(&c, opts));
        c.local_error = found;
        if rank == 0 && c.local_error.is_none() {
            match existing(storage, opts) {
                Ok(refuse) => c.plan.refuse_overwrite = refuse,
                Err(e) => c.local_error = Some(e),
            }
        }
        let plans = plan_globally(comm, &mut c, opts, storage, Some(choose_main_replicas))?;
        planned.push((plans, c.tensor_data));
    }

    // Uncommit what is being replaced, before any of its files is rewritten in place. Every rank
    // agrees, whatever it was told about overwriting: rank 0 alone decides.
    let removed =
        if rank == 0 && opts.overwrite { storages.iter().try_for_each(|s| s.delete(METADATA_FILE)) } else { Ok(()) };
    agree(comm, removed)?;

    // Every rank writes its file of every directory.
    let mut layouts = Vec::with_capacity(planned.len());
    let mut written = Ok(());
    for ((plans, data), &storage) in planned.iter().zip(&storages) {
        let layout = RankFileLayout::new(&plans[rank], opts.block_size);
        let name = rank_file_name(rank);
        if written.is_ok() {
            written = if layout.keys.is_empty() {
                // Nothing to write here: a file an earlier save left must not pass for this one's.
                storage.delete(&name)
            } else {
                write_file(&layout, &name, data, storage, opts)
            };
        }
        layouts.push(layout);
    }
    agree(comm, written)?;

    // Rank 0 commits, directory after directory; everyone learns the verdict. Every rank knows
    // the metadata (callers return it, as OLMo-core's `Checkpointer.save` does).
    let metadata: Vec<String> = planned.iter().map(|(plans, _)| metadata_json(&metadata_from_plans(plans))).collect();
    let committed = if rank == 0 {
        storages.iter().zip(&metadata).zip(&planned).try_for_each(|((storage, text), (plans, _))| {
            if opts.overwrite {
                storage.put_atomic(METADATA_FILE, text.as_bytes())?;
            } else {
                storage.put_if_absent(METADATA_FILE, text.as_bytes())?;
            }
            remove_stale_files(*storage, plans);
            Ok(())
        })
    } else {
        Ok(())
    };
    agree(comm, committed)?;
    Ok(layouts
        .into_iter()
        .zip(metadata)
        .map(|(layout, metadata)| {
            let mut files = Vec::new();
            if !layout.keys.is_empty() {
                files.push(rank_file_name(rank));
            }
            if rank == 0 {
                files.push(METADATA_FILE.into());
            }
            let bytes_written = if layout.keys.is_empty() { 0 } else { layout.size };
            OlmoSaveReport { files, bytes_written, metadata }
        })
        .collect())
}

/// What the format cannot hold (objects, common values) or a bad option: found locally, it
/// travels in the exchange so that every rank fails alike.
fn unsupported(c: &crate::save::native::Collected<'_>, opts: &SaveOptions) -> Option<Error> {
    if let Some(o) = c.plan.objects.first() {
        return Some(Error::invalid(format!(
            "object {:?}: OLMo-core checkpoints hold tensors only (save it in the native format)",
            o.key
        )));
    }
    if let Some((path, _)) = c.common.first() {
        return Some(Error::invalid(format!(
            "common value {:?}: OLMo-core checkpoints hold tensors only (save it in the native format)",
            path_string(path)
        )));
    }
    (opts.block_size == 0).then(|| Error::invalid("block size must be positive"))
}

/// Rank 0's look at the location: `true` if an OLMo-core checkpoint is there and overwriting
/// was not asked for; an error if another format's checkpoint is there.
fn existing(storage: &dyn Storage, opts: &SaveOptions) -> Result<bool> {
    match detect_format(storage) {
        Ok((record, _)) if record.backend == BACKEND => Ok(!opts.overwrite),
        Ok((record, _)) => Err(Error::invalid(format!(
            "{} holds a {} checkpoint; an OLMo-core checkpoint cannot replace it there",
            storage.location(),
            record.backend
        ))),
        Err(Error::NotFound { .. } | Error::NotCommitted { .. }) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Writes this rank's data file of one directory.
fn write_file(
    layout: &RankFileLayout,
    name: &str,
    data: &[Option<&[u8]>],
    storage: &dyn Storage,
    opts: &SaveOptions,
) -> Result<()> {
    let writer = storage.create(name, layout.size)?;
    let sources = layout
        .ranges()
        .zip(layout.range_offsets())
        .map(|((k, shard, at, n), file_off)| {
            let bytes = data[shard]
                .ok_or_else(|| Error::invalid(format!("{:?}: chosen to write a shard it has no data for", k.key)))?;
            let es = k.dtype.size() as u64;
            Ok(Source { data: &bytes[(at * es) as usize..((at + n) * es) as usize], file_off, block: opts.block_size })
        })
        .collect::<Result<Vec<_>>>()?;
    let crcs = write_sources(writer.as_ref(), &sources, opts.threads, storage.is_local(), opts.cancel.as_deref())?;
    let header = layout.header(&crcs);
    if header.len() as u64 != layout.header_len {
        return Err(Error::invalid(format!("header is {} bytes, {} were laid out", header.len(), layout.header_len)));
    }
    writer.write_at(0, &header)?;
    writer.finish()
}

/// After the commit: data files of ranks that wrote nothing this time (an earlier save with
/// more ranks) are garbage. Best effort; the checkpoint is committed either way.
fn remove_stale_files(storage: &dyn Storage, plans: &[RankPlan]) {
    let writers: BTreeSet<String> = plans
        .iter()
        .enumerate()
        .filter(|(_, p)| p.tensors.iter().any(|t| t.main))
        .map(|(r, _)| rank_file_name(r))
        .collect();
    let Ok(names) = storage.list() else { return };
    for name in names {
        let is_rank_file = name
            .strip_prefix("rank_")
            .and_then(|s| s.strip_suffix(".safetensors"))
            .is_some_and(|r| !r.is_empty() && r.bytes().all(|b| b.is_ascii_digit()));
        if is_rank_file && !writers.contains(&name) {
            let _ = storage.delete(&name);
        }
    }
}

/// Every rank learns whether every rank succeeded, with the save's rule for which error each
/// returns ([`wire::outcomes`]: the first failing rank's; its own, on that rank).
pub(crate) fn agree<T>(comm: &dyn Communicator, mine: Result<T>) -> Result<T> {
    let all = comm.all_gather(&wire::outcome(&mine, |_| Vec::new()))?;
    let (value, mut local) = match mine {
        Ok(v) => (Some(v), None),
        Err(e) => (None, Some(e)),
    };
    wire::outcomes(&all, comm.rank(), &mut local)?;
    Ok(value.expect("no rank reported a failure, this one included"))
}
