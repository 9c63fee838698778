//! Saving in OLMo-core 0.1.x's own format (`formats::olmo`), which ai2-olmo-core itself loads.
//!
//! The write session is [`OlmoSave`]: `plan` → `write_file(k)` → `commit`. The global plan is
//! the native save's: one exchange of shard metadata per directory, the check that the shards
//! tile every tensor (before anything is written), and the spreading of replicated shards over
//! the ranks that hold them; copies are told apart by OLMo-core's rule (identical shards are
//! replicas, `formats::olmo::choose_main_replicas`). Each rank then writes its rank file of
//! every directory (per key its shards back to back as one 1-D tensor; block checksums in the
//! header's `__metadata__`), and rank 0 puts `metadata.json` once every rank's files are
//! complete: the commit, by the one commit protocol (`save::commit`).
//!
//! OLMo-core reads the files its `metadata.json` names, so a save never writes into a file the
//! committed checkpoint uses: in a directory without rank files it takes OLMo-core's own names
//! (`rank_{r}.safetensors`), elsewhere names of its own (`rank_{r}-{save_id}.safetensors`). The
//! checkpoint being replaced stays whole until the new `metadata.json` replaces it; its files
//! are removed after. Several directories saved together (`model/` and `optim/`) are planned
//! and validated all before any is written, and committed in order; if one's commit fails, the
//! `metadata.json` of those committed before it is put back as it was.

use std::collections::BTreeSet;
use std::sync::Arc;

use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::format::lease::LeaseFiles;
use crate::format::Backend;
use crate::formats::olmo::metadata::{
    choose_main_replicas, metadata_from_plans, metadata_json, parse_rank_file_name, rank_file_name, RankFileLayout,
    SaveMark, METADATA_FILE,
};
use crate::load::open::detect_format;
use crate::model::factories::apply_factories_collective;
use crate::model::{path_string, StateTree};
use crate::plan::save::RankPlan;
use crate::save::commit::{classify_put, commit, remove_files, Place, Publish, Published};
use crate::save::lease::{kept_while, live_leases, LeaseHold};
use crate::save::options::SaveOptions;
use crate::save::plan::{collect, new_save_id, plan_globally, Collected};
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
    /// Files of this directory the save left for `tessera gc` (see
    /// [`SaveReport::leftovers`](crate::SaveReport::leftovers)). Empty as a rule.
    pub leftovers: Vec<String>,
}

/// Saves this rank's tensors as one OLMo-core 0.1.x checkpoint directory (what
/// `Checkpointer.save` writes). Every rank of `comm` calls it with its own tree; the tree holds
/// tensors only (the format has no objects or common values), and tensor keys become the
/// metadata's keys. Identical shards held by several ranks are written once. Errors come out
/// identically on every rank.
///
/// ```
/// use tessera::{open, SaveOptions};
/// use tessera::olmo::{read_olmo_metadata, save_olmo};
/// use tessera::{DType, ShardedTensor, StateTree, TensorData};
/// use tessera::comm::SoloComm;
/// use tessera::storage::MemoryStorage;
///
/// let storage = MemoryStorage::new();
/// let w = ShardedTensor::full("w", DType::U8, &[4], TensorData::Owned(vec![1, 2, 3, 4]));
/// let tree = StateTree::map().with("w", StateTree::Tensor(w));
/// let report = save_olmo(tree, &storage, &SoloComm, &SaveOptions::default())?;
/// assert_eq!(report.files, ["rank_0.safetensors", "metadata.json"]);
/// assert_eq!(read_olmo_metadata(&storage)?, report.metadata);
///
/// let ckpt = open(&storage)?;
/// assert_eq!(ckpt.format().backend, tessera::index::Backend::OlmoSafetensors);
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
/// use tessera::{open, SaveOptions};
/// use tessera::olmo::save_olmo_dirs;
/// use tessera::{DType, ShardedTensor, StateTree, TensorData};
/// use tessera::comm::SoloComm;
/// use tessera::storage::MemoryStorage;
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
    let (mut trees, storages): (Vec<_>, Vec<_>) =
        dirs.into_iter().map(|(tree, storage)| (apply_factories_collective(tree), storage)).unzip();
    let session = OlmoSave::plan(&mut trees, &storages, comm, opts)?;
    let leases: Vec<(Arc<LeaseHold>, &dyn Storage)> =
        session.dirs.iter().filter_map(|d| d.lease.clone().map(|l| (l, d.storage))).collect();
    kept_while(leases.iter().map(|(l, s)| (&**l, *s)), || {
        let written = (0..session.files()).try_for_each(|k| session.write_file(k, opts));
        session.commit(written, comm, opts)
    })
}

/// One directory of an OLMo-core save.
struct Dir<'s, 't> {
    storage: &'s dyn Storage,
    /// Every rank's plan (writers assigned).
    plans: Vec<RankPlan>,
    /// This rank's bytes of each tensor shard (plan order), where it has them.
    data: Vec<Option<&'t [u8]>>,
    /// What names the files: 0 for OLMo-core's own names, else the save's id (`rank_file_name`).
    files_id: u64,
    /// This rank's file.
    layout: RankFileLayout,
    /// The text of the `metadata.json` that commits the directory.
    metadata: String,
    /// Rank 0: the save's lease in this directory.
    lease: Option<Arc<LeaseHold>>,
}

/// An OLMo-core save being written: [`OlmoSave::plan`] (collective) → [`OlmoSave::write_file`]
/// for each directory (local) → [`OlmoSave::commit`] (collective).
pub(crate) struct OlmoSave<'s, 't> {
    rank: usize,
    dirs: Vec<Dir<'s, 't>>,
}

impl<'s, 't> OlmoSave<'s, 't> {
    /// Plans and validates every directory (collective; the same verdict everywhere) before any
    /// is written. Rank 0 takes a lease in each.
    pub fn plan(
        trees: &'t mut [(StateTree<'t>, Option<Error>)],
        storages: &[&'s dyn Storage],
        comm: &dyn Communicator,
        opts: &SaveOptions,
    ) -> Result<Self> {
        let rank = comm.rank();
        let ndirs = trees.len();
        let mut dirs: Vec<Dir<'s, 't>> = Vec::with_capacity(ndirs);
        // One id for the whole save (rank 0's; each directory's plans carry it).
        let save_id = if rank == 0 { new_save_id() } else { 0 };
        let release = |dirs: &[Dir<'_, '_>]| {
            for d in dirs {
                if let Some(l) = &d.lease {
                    l.release(d.storage);
                }
            }
        };
        for ((tree, factory_error), &storage) in trees.iter_mut().zip(storages) {
            let mut c = collect(&*tree, rank, true, opts.distribute_replicas);
            let found = factory_error.take().or(c.local_error.take()).or_else(|| unsupported(&c, opts));
            c.local_error = found;
            let mut lease = None;
            if rank == 0 && c.local_error.is_none() {
                match look(storage, opts) {
                    Ok(Look::Refuse) => c.plan.refuse_overwrite = true,
                    Ok(Look::Write { fresh }) => {
                        // The save id's lowest bit says whether the files take OLMo-core's own
                        // names (a directory without rank files) or names of the save's own.
                        c.plan.save_id = if fresh { save_id | 1 } else { save_id & !1 };
                        let suffix = if fresh { String::new() } else { format!("-{:016x}", c.plan.save_id) };
                        match LeaseHold::take(storage, c.plan.save_id, LeaseFiles::Olmo { suffix }) {
                            Ok(l) => lease = Some(Arc::new(l)),
                            Err(e) => c.local_error = Some(e),
                        }
                    }
                    Err(e) => c.local_error = Some(e),
                }
            }
            let plans = match plan_globally(comm, &mut c, opts, storage, Some(choose_main_replicas)) {
                Ok(p) => p,
                Err(e) => {
                    lease.map(|l| l.release(storage));
                    release(&dirs);
                    return Err(e);
                }
            };
            let save_id = plans[0].save_id;
            let files_id = if save_id & 1 == 1 { 0 } else { save_id };
            let layout = RankFileLayout::new(&plans[rank], opts.block_size);
            // Every rank knows the metadata (callers return it, as OLMo-core's `Checkpointer.save`
            // does). A save of several directories marks each as its own.
            let mut meta = metadata_from_plans(&plans, files_id);
            if ndirs > 1 {
                meta.save = Some(SaveMark { id: save_id >> 1, dirs: ndirs as u32 });
            }
            let metadata = metadata_json(&meta);
            let Collected { tensor_data, .. } = c;
            dirs.push(Dir { storage, plans, data: tensor_data, files_id, layout, metadata, lease });
        }
        Ok(OlmoSave { rank, dirs })
    }

    /// The files this rank may write: one per directory.
    pub fn files(&self) -> usize {
        self.dirs.len()
    }

    /// Writes this rank's file of directory `k` (none when it holds nothing there).
    pub fn write_file(&self, k: usize, opts: &SaveOptions) -> Result<()> {
        let d = &self.dirs[k];
        if d.layout.keys.is_empty() {
            return Ok(());
        }
        let name = rank_file_name(self.rank, d.files_id);
        let writer = d.storage.create(&name, d.layout.size)?;
        let sources = d
            .layout
            .ranges()
            .zip(d.layout.range_offsets())
            .map(|((k, shard, at, n), file_off)| {
                let bytes = d.data[shard].ok_or_else(|| {
                    Error::invalid(format!("{:?}: chosen to write a shard it has no data for", k.key))
                })?;
                let es = k.dtype.size() as u64;
                Ok(Source {
                    data: &bytes[(at * es) as usize..((at + n) * es) as usize],
                    file_off,
                    block: opts.block_size,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let crcs =
            write_sources(writer.as_ref(), &sources, opts.threads, d.storage.is_local(), opts.cancel.as_deref())?;
        let header = d.layout.header(&crcs);
        if header.len() as u64 != d.layout.header_len {
            return Err(Error::invalid(format!(
                "header is {} bytes, {} were laid out",
                header.len(),
                d.layout.header_len
            )));
        }
        writer.write_at(0, &header)?;
        writer.finish()
    }

    /// Ends the save (collective): rank 0 puts each directory's `metadata.json`, in order, by
    /// the one commit protocol. Returns one report per directory.
    pub fn commit(
        self,
        written: Result<()>,
        comm: &dyn Communicator,
        opts: &SaveOptions,
    ) -> Result<Vec<OlmoSaveReport>> {
        let rank = self.rank;
        let places: Vec<Place<'_>> = self
            .dirs
            .iter()
            .map(|d| Place {
                storage: d.storage,
                own_files: if d.layout.keys.is_empty() { Vec::new() } else { vec![rank_file_name(rank, d.files_id)] },
                lease: d.lease.as_deref(),
            })
            .collect();
        let mut publish = MetadataPublish { dirs: &self.dirs, overwrite: opts.overwrite, rank };
        let done = commit(comm, &places, written.map(|()| Vec::new()), &mut publish)?;
        Ok(self
            .dirs
            .iter()
            .map(|d| {
                let mut files = Vec::new();
                if !d.layout.keys.is_empty() {
                    files.push(rank_file_name(rank, d.files_id));
                }
                if rank == 0 {
                    files.push(METADATA_FILE.into());
                }
                let bytes_written = if d.layout.keys.is_empty() { 0 } else { d.layout.size };
                let mine = |n: &&String| n.strip_prefix(&d.storage.location()).is_some_and(|r| r.starts_with('/'));
                let leftovers = done
                    .leftovers
                    .iter()
                    .filter(mine)
                    .map(|n| n[d.storage.location().len() + 1..].to_string())
                    .collect();
                OlmoSaveReport { files, bytes_written, metadata: d.metadata.clone(), leftovers }
            })
            .collect())
    }
}

/// The OLMo-core commit on rank 0: each directory's `metadata.json` in order, then the removal
/// of the rank files the new ones do not name. A failure puts back the `metadata.json` of the
/// directories committed before it.
struct MetadataPublish<'d, 's, 't> {
    dirs: &'d [Dir<'s, 't>],
    overwrite: bool,
    rank: usize,
}

impl Publish for MetadataPublish<'_, '_, '_> {
    fn publish(&mut self, _: &dyn Storage, _: &[&[u8]]) -> Published {
        debug_assert_eq!(self.rank, 0);
        let mut before: Vec<Option<Vec<u8>>> = Vec::with_capacity(self.dirs.len());
        for d in self.dirs {
            match d.storage.read(METADATA_FILE) {
                Ok(b) => before.push(Some(b)),
                Err(Error::NotFound { .. }) => before.push(None),
                Err(e) => return Published::NotCommitted(e),
            }
        }
        for (i, d) in self.dirs.iter().enumerate() {
            let text = d.metadata.as_bytes();
            let put = if self.overwrite {
                d.storage.put_atomic(METADATA_FILE, text)
            } else {
                d.storage.put_if_absent(METADATA_FILE, text)
            };
            let check = !self.overwrite && !d.storage.has_atomic_create();
            let ours = || match d.storage.read(METADATA_FILE) {
                Ok(b) => Ok(b == text),
                Err(Error::NotFound { .. }) => Ok(false),
                Err(e) => Err(e),
            };
            match classify_put(d.storage, METADATA_FILE, put, check, ours) {
                Ok(()) => {}
                Err(Published::NotCommitted(e)) => {
                    return Published::NotCommitted(put_back(&self.dirs[..i], &before[..i], e));
                }
                Err(Published::Unknown(e)) if i > 0 => {
                    // Those before are committed; this one may be: neither can be undone.
                    return Published::Unknown(Error::CommitUnknown {
                        path: d.storage.location().into(),
                        reason: format!(
                            "{e} ({} committed before it)",
                            self.dirs[..i].iter().map(|d| d.storage.location()).collect::<Vec<_>>().join(", ")
                        ),
                    });
                }
                Err(other) => return other,
            }
        }
        // Leftovers as `location/name`: the commit's list covers every directory.
        let mut leftovers = Vec::new();
        for d in self.dirs {
            leftovers.extend(remove_replaced(d).into_iter().map(|n| format!("{}/{n}", d.storage.location())));
        }
        Published::Committed { summary: Vec::new(), leftovers }
    }
}

/// Puts back the `metadata.json` of `dirs` as it was (`before`; removed where there was none)
/// after a commit that failed with `err`; returns `err`, saying so where one could not be.
fn put_back(dirs: &[Dir<'_, '_>], before: &[Option<Vec<u8>>], err: Error) -> Error {
    let failed: Vec<String> = dirs
        .iter()
        .zip(before)
        .filter_map(|(d, old)| {
            let r = match old {
                Some(b) => d.storage.put_atomic(METADATA_FILE, b),
                None => d.storage.delete(METADATA_FILE),
            };
            r.err().map(|e| format!("{}/{METADATA_FILE} ({e})", d.storage.location()))
        })
        .collect();
    if failed.is_empty() {
        return err;
    }
    Error::Io {
        path: dirs[0].storage.location().into(),
        source: std::io::Error::other(format!(
            "{err}; the directories committed before the failure could not be put back ({}): they hold this \
             save's state, the others the previous one: save again",
            failed.join(", ")
        )),
    }
}

/// After the commit: rank files the new `metadata.json` does not name (an earlier checkpoint's,
/// a failed save's) are garbage, unless a live lease covers them. Returns those that could not
/// be removed.
fn remove_replaced(d: &Dir<'_, '_>) -> Vec<String> {
    let named: BTreeSet<String> = d
        .plans
        .iter()
        .enumerate()
        .filter(|(_, p)| p.tensors.iter().any(|t| t.main))
        .map(|(r, _)| rank_file_name(r, d.files_id))
        .collect();
    let Ok(names) = d.storage.list() else { return Vec::new() };
    let leases = live_leases(d.storage, &names, d.lease.as_ref().map(|l| l.save_id()));
    let garbage: Vec<String> = names
        .into_iter()
        .filter(|n| parse_rank_file_name(n).is_some() && !named.contains(n) && !leases.iter().any(|l| l.covers(n)))
        .collect();
    remove_files(d.storage, &garbage)
}

/// What the format cannot hold (objects, common values) or a bad option: found locally, it
/// travels in the exchange so that every rank fails alike.
fn unsupported(c: &Collected<'_>, opts: &SaveOptions) -> Option<Error> {
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

/// What rank 0 finds where it is about to save.
enum Look {
    /// A committed OLMo-core checkpoint, and overwriting was not asked for.
    Refuse,
    /// Write there; `fresh`: no rank file is there (the save takes OLMo-core's own names).
    Write { fresh: bool },
}

/// Rank 0's look at the location: a committed OLMo-core checkpoint there refuses the save
/// unless overwriting; another format's checkpoint refuses it always; a directory of rank files
/// without `metadata.json` is an unfinished save (of any writer), whose files the commit
/// replaces.
fn look(storage: &dyn Storage, opts: &SaveOptions) -> Result<Look> {
    match detect_format(storage) {
        Ok((record, _)) if record.backend == Backend::OlmoSafetensors && !opts.overwrite => return Ok(Look::Refuse),
        Ok((record, _)) if record.backend != Backend::OlmoSafetensors => {
            return Err(Error::invalid(format!(
                "{} holds a {} checkpoint; an OLMo-core checkpoint cannot replace it there",
                storage.location(),
                record.backend
            )))
        }
        Ok(_) | Err(Error::NotFound { .. } | Error::NotCommitted { .. }) => {}
        Err(e) => return Err(e),
    }
    let fresh = !storage.list()?.iter().any(|n| parse_rank_file_name(n).is_some());
    Ok(Look::Write { fresh })
}
