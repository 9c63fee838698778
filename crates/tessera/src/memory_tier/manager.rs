//! The checkpoint manager: saves on a schedule to the memory tier (or straight to the
//! persistent location when there is none), drains every n-th step to the persistent location
//! from the memory copy, keeps the last k steps of each tier, and restores the newest step
//! complete in some tier. Everything after the staging runs on one background thread, job after
//! job in the order the saves were made (so every rank runs the same collectives in the same
//! order on the background communicator).

use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use super::commit::{agree, commit_step, Written};
use super::layout::{self, layout_crc, rank_copy, reassemble, rebuild_global, split, Parts};
use super::restore::{self, clear_from, decide, gather, listed_persistent_steps, load_copy, prune};
use super::{rank_dir_name, step_name, MemoryTier};
use crate::comm::{Communicator, SoloComm};
use crate::error::{Error, Result};
use crate::format::INDEX_FILE;
use crate::load::engine::LoadOptions;
use crate::load::open::open;
use crate::model::{ShardedObject, ShardedTensor, StatePath, StateTree, TensorData, Value};
use crate::save::async_save::{AsyncSave, AsyncSaver};
use crate::save::native::{save, NativeSession};
use crate::save::options::SaveOptions;
use crate::save::staging::StagingPool;
use crate::storage::{Location, MemoryStorage, Storage};

/// The manager's policy and tiers.
#[derive(Debug, Clone)]
pub struct ManagerOptions {
    /// The memory tier; `None` saves every checkpoint to `persistent` directly (in the
    /// background, like [`AsyncSaver`]).
    pub memory: Option<MemoryTier>,
    /// The persistent location (any [`Location`]: a directory, NFS, `s3://`, `gs://`, `az://`);
    /// each step is an ordinary tessera checkpoint in `step-NNNNNNNNNNNN/` under it.
    pub persistent: Option<Location>,
    /// Save at every step that is a multiple of this (default 1: every step).
    pub every: u64,
    /// Drain to the persistent location every step that is a multiple of this, from the
    /// memory copy (0: never). Without a memory tier, the persistent saves' schedule is `every`.
    pub persist_every: u64,
    /// Committed memory-tier steps kept per node (default 2).
    pub keep_last_memory: usize,
    /// Persistent steps kept (default 3; 0 keeps all).
    pub keep_last_persistent: usize,
    /// Bytes of staging memory for the copies (default 256 MiB).
    pub staging_bytes: u64,
}

impl Default for ManagerOptions {
    fn default() -> Self {
        ManagerOptions {
            memory: None,
            persistent: None,
            every: 1,
            persist_every: 0,
            keep_last_memory: 2,
            keep_last_persistent: 3,
            staging_bytes: 256 << 20,
        }
    }
}

/// Which tier a step was restored from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Tier {
    /// The memory tier: each rank's copy, in place (after rebuilding lost nodes' copies).
    Memory,
    /// The persistent location, resharded to the job's layout.
    Persistent,
}

/// A restored state.
#[derive(Debug)]
pub struct Restored<'a> {
    /// The step restored.
    pub step: u64,
    /// Where it came from.
    pub tier: Tier,
    /// The state, its buffers filled. From the memory tier, the tree and values are as saved
    /// (the tensors and object shards the caller's, by order); from the persistent tier, as a
    /// [`load`](crate::load) of the caller's tree returns it.
    pub state: StateTree<'a>,
    /// The step's common values with their paths (from the memory tier: this rank's own).
    pub common: Vec<(StatePath, Value)>,
    /// Ranks whose memory copies were rebuilt from other nodes' shards.
    pub rebuilt_ranks: Vec<usize>,
    /// Why newer steps were passed over (lost nodes beyond the parity, another world size),
    /// the same on every rank.
    pub notes: Vec<String>,
}

type Job = Box<dyn FnOnce(&dyn Communicator) -> Result<()> + Send>;

#[derive(Default)]
struct Progress {
    queued: u64,
    done: u64,
    failures: Vec<(u64, Error)>,
}

/// The background thread and what it reports.
struct Worker {
    tx: Option<mpsc::Sender<(u64, Job)>>,
    thread: Option<JoinHandle<()>>,
    progress: Arc<(Mutex<Progress>, Condvar)>,
}

impl Worker {
    fn start(comm: Arc<dyn Communicator>) -> Result<Worker> {
        let (tx, rx) = mpsc::channel::<(u64, Job)>();
        let progress: Arc<(Mutex<Progress>, Condvar)> = Arc::default();
        let p = progress.clone();
        let thread = std::thread::Builder::new()
            .name("tessera-checkpoint-manager".into())
            .spawn(move || {
                for (step, job) in rx {
                    let r = job(comm.as_ref());
                    let (lock, cv) = &*p;
                    let mut g = lock.lock().unwrap();
                    if let Err(e) = r {
                        g.failures.push((step, e));
                    }
                    g.done += 1;
                    cv.notify_all();
                }
            })
            .map_err(|e| Error::Io { path: "(thread)".into(), source: e })?;
        Ok(Worker { tx: Some(tx), thread: Some(thread), progress })
    }

    fn submit(&self, step: u64, job: Job) {
        self.progress.0.lock().unwrap().queued += 1;
        if let Some(tx) = &self.tx {
            // The thread ends only when `tx` is dropped, so the send succeeds.
            let _ = tx.send((step, job));
        }
    }

    fn is_idle(&self) -> bool {
        let g = self.progress.0.lock().unwrap();
        g.done == g.queued
    }

    /// Waits for every job; returns the failures since the last call.
    fn wait(&self) -> Vec<(u64, Error)> {
        let (lock, cv) = &*self.progress;
        let mut g = lock.lock().unwrap();
        while g.done < g.queued {
            g = cv.wait(g).unwrap();
        }
        std::mem::take(&mut g.failures)
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Saves on a schedule to the memory tier and the persistent location, and restores the newest
/// step complete in either.
///
/// Collective: every rank makes the same calls with the same steps. The background work (the
/// parity exchange and commit of the memory tier, drains, persistent commits) runs collectives
/// on `background`, a communicator nothing else uses (MPI: a duplicate; torch: a second
/// process group).
///
/// ```
/// use std::sync::Arc;
/// use tessera::comm::InProcessComm;
/// use tessera::memory_tier::{CheckpointManager, ManagerOptions, MemoryTier, Tier};
/// use tessera::storage::Location;
/// use tessera::{DType, ShardedTensor, StateTree, TensorData};
///
/// let dir = std::env::temp_dir().join(format!("tessera-doc-manager-{}", std::process::id()));
/// let background = InProcessComm::group(4);
/// let restored = InProcessComm::run(4, |comm| {
///     let rank = tessera::Communicator::rank(comm);
///     let opts = ManagerOptions {
///         // 4 ranks on 4 nodes, RS(2, 1): one node may be lost.
///         memory: Some(MemoryTier::new(dir.join(format!("shm-node{rank}"))).node(format!("node{rank}")).redundancy(2, 1)),
///         persistent: Some(Location::local(dir.join("persistent"))),
///         persist_every: 10,
///         ..ManagerOptions::default()
///     };
///     let mut mgr = CheckpointManager::new(opts, Arc::new(background[rank].clone()))?;
///     for step in 1..=3u64 {
///         let w = vec![step as u8 + rank as u8; 16];
///         let t = ShardedTensor::from_rank_offsets("w", DType::U8, &[16], TensorData::Ref(&w), &[(0, rank as u64, 4)], 0)?;
///         mgr.save(step, StateTree::map().with("w", StateTree::Tensor(t)), comm)?;
///     }
///     mgr.wait()?;
///     let mut w = vec![0u8; 16];
///     let t = ShardedTensor::from_rank_offsets("w", DType::U8, &[16], TensorData::Mut(&mut w), &[(0, rank as u64, 4)], 0)?;
///     let r = mgr.restore(StateTree::map().with("w", StateTree::Tensor(t)), comm)?.expect("a step");
///     assert_eq!((r.step, r.tier), (3, Tier::Memory));
///     drop(r);
///     Ok::<_, tessera::Error>(w)
/// });
/// assert_eq!(restored[2].as_ref().unwrap(), &vec![5u8; 16]);
/// std::fs::remove_dir_all(&dir).unwrap();
/// ```
pub struct CheckpointManager {
    opts: ManagerOptions,
    node: String,
    saver: AsyncSaver,
    worker: Worker,
    background: Arc<dyn Communicator>,
    /// The step of the last save; `None` until one and after a restore. A save of a step not
    /// after it first checks that the persistent tier holds no later step, then clears that
    /// step and every later one from every node's memory (both collective): what a run that
    /// went further, or a restore passed over, left there.
    last_step: Option<u64>,
}

impl std::fmt::Debug for CheckpointManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CheckpointManager").field("opts", &self.opts).field("node", &self.node).finish()
    }
}

impl CheckpointManager {
    /// A manager with `opts`, running its background collectives on `background`.
    pub fn new(opts: ManagerOptions, background: Arc<dyn Communicator>) -> Result<CheckpointManager> {
        if opts.memory.is_none() && opts.persistent.is_none() {
            return Err(Error::invalid("checkpoint manager: neither a memory tier nor a persistent location"));
        }
        if opts.every == 0 {
            return Err(Error::invalid("checkpoint manager: `every` must be at least 1"));
        }
        if opts.persist_every > 0 && !opts.persist_every.is_multiple_of(opts.every) && opts.memory.is_some() {
            return Err(Error::invalid(format!(
                "checkpoint manager: persist_every ({}) must be a multiple of every ({}): a drain reads a memory step",
                opts.persist_every, opts.every
            )));
        }
        let node = match &opts.memory {
            Some(t) => {
                t.check()?;
                t.node_name()?
            }
            None => String::new(),
        };
        let commit: Arc<dyn Communicator> = if opts.memory.is_some() { Arc::new(SoloComm) } else { background.clone() };
        let saver = AsyncSaver::new(StagingPool::new(opts.staging_bytes)?, commit);
        let worker = Worker::start(background.clone())?;
        Ok(CheckpointManager { opts, node, saver, worker, background, last_step: None })
    }

    /// The policy's answer for `step`: is it saved?
    pub fn is_save_step(&self, step: u64) -> bool {
        step.is_multiple_of(self.opts.every)
    }

    /// Saves `tree` as step `step` if the policy says so (returns whether it did). Blocks only
    /// while the state is staged; the rest runs in the background ([`CheckpointManager::wait`]
    /// reports its failures). Every rank must call it with the same `step`.
    pub fn save(&mut self, step: u64, tree: StateTree<'_>, comm: &dyn Communicator) -> Result<bool> {
        if !self.is_save_step(step) {
            return Ok(false);
        }
        print_failures(self.worker_failures_if_idle());
        if self.last_step.is_none_or(|last| step <= last) {
            // The tiers may hold later steps from a run that went further (no restore since,
            // or training went back). A restore would pick a later persistent step over every
            // step of this run: refused, deleting nothing. Later memory steps are scratch:
            // their markers must be gone on every node before a copy of this step is written.
            print_failures(self.worker.wait());
            self.refuse_later_persistent_steps(step, comm)?;
            if let Some(tier) = &self.opts.memory {
                clear_from(tier, &self.node, Some(step), comm)?;
            }
        }
        self.last_step = Some(step);
        match self.opts.memory.clone() {
            Some(tier) => self.save_memory(step, tree, tier),
            None => self.save_persistent(step, tree, comm),
        }
        .map(|()| true)
    }

    /// Fails on every rank alike if the persistent tier holds a committed step after `step`
    /// (collective: rank 0 lists, every rank gets its answer). A tier that cannot be listed is
    /// said and passed, as a restore passes it.
    fn refuse_later_persistent_steps(&self, step: u64, comm: &dyn Communicator) -> Result<()> {
        let persistent = self.opts.persistent.as_ref();
        let later: Vec<u64> = match listed_persistent_steps(persistent, comm) {
            Ok(steps) => steps.into_iter().filter(|&s| s > step).collect(),
            Err(e @ Error::Comm { .. }) => return Err(e),
            Err(e) => {
                eprintln!(
                    "tessera: checkpoint manager: cannot list the persistent tier to check it holds no step after \
                     {step}: {e}"
                );
                Vec::new()
            }
        };
        if later.is_empty() {
            return Ok(());
        }
        // Every rank decides on rank 0's listing, whatever location it was given itself.
        let loc = persistent.map_or_else(|| "of rank 0".to_owned(), |l| l.to_string());
        let why = match self.last_step {
            // The run itself goes back over steps it drained.
            Some(last) => format!(
                "going back from step {last} to step {step}, but the persistent tier {loc} holds this run's later \
                 step(s) {later:?}; a restore would pick them over every step saved from now on. Delete them first"
            ),
            None => format!(
                "the persistent tier {loc} holds step(s) {later:?}, after step {step}, from a run that went further; \
                 a restore would pick them over every step of this run. Call restore() first to resume from them, \
                 or use a fresh persistent location (or delete those steps)"
            ),
        };
        Err(Error::invalid(format!("checkpoint manager: {why}; nothing was saved or deleted")))
    }

    fn worker_failures_if_idle(&self) -> Vec<(u64, Error)> {
        if self.worker.is_idle() {
            self.worker.wait()
        } else {
            Vec::new()
        }
    }

    fn save_memory(&mut self, step: u64, tree: StateTree<'_>, tier: MemoryTier) -> Result<()> {
        let me = self.background.rank();
        let dir = tier.step_dir(step).join(rank_dir_name(me));
        // A local failure is carried into the background commit, which every rank joins: the
        // step then fails on every rank alike.
        let staged: Result<(AsyncSave, u32)> = (|| {
            let parts = split(tree)?;
            let layout = layout_crc(&parts.layout);
            tier.fs.create_dir_all(&dir)?;
            let storage = tier.fs.storage(&dir);
            let opts = SaveOptions { overwrite: true, ..SaveOptions::default() };
            let pending = self.saver.save(rank_copy(parts), storage, &SoloComm, &opts)?;
            Ok((pending, layout))
        })();
        let reported = staged.as_ref().err().map(super::commit::clone_error);
        let node = self.node.clone();
        let persistent = self
            .opts
            .persistent
            .clone()
            .filter(|_| self.opts.persist_every > 0 && step.is_multiple_of(self.opts.persist_every));
        let (keep_memory, keep_persistent) = (self.opts.keep_last_memory, self.opts.keep_last_persistent);
        self.worker.submit(
            step,
            Box::new(move |bg| {
                let (copy, layout) = match staged {
                    Ok((pending, layout)) => (pending.finalize().map(|_| ()), layout),
                    Err(e) => (Err(e), 0),
                };
                let (manifest, mut result) = commit_step(&tier, &node, Written { step, copy, layout }, bg)?;
                if let Some(loc) = persistent {
                    let drained = drain(&tier, step, &loc, bg);
                    let drained = match drained {
                        Ok(()) if bg.rank() == 0 => prune_persistent(&loc, keep_persistent, step),
                        other => other,
                    };
                    result = result.and(drained);
                }
                // One rank per node prunes the node's root.
                if manifest.nodes.iter().position(|n| *n == node) == Some(bg.rank()) {
                    result = result.and(prune(&tier, keep_memory, step));
                }
                result
            }),
        );
        match reported {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn save_persistent(&mut self, step: u64, tree: StateTree<'_>, comm: &dyn Communicator) -> Result<()> {
        let loc = self.opts.persistent.clone().expect("checked in new: one tier at least");
        // Every rank opens the step's location; all go on only if all could.
        let storage = agree(loc.join(&step_name(step)).open(), comm)?;
        let opts = SaveOptions { overwrite: true, ..SaveOptions::default() };
        let pending = self.saver.save(tree, storage, comm, &opts)?;
        let keep = self.opts.keep_last_persistent;
        self.worker.submit(
            step,
            Box::new(move |bg| {
                pending.finalize()?;
                if bg.rank() == 0 {
                    prune_persistent(&loc, keep, step)?;
                }
                Ok(())
            }),
        );
        Ok(())
    }

    /// Waits for every background job; the first failure since the last call, if any (the
    /// others are printed).
    pub fn wait(&mut self) -> Result<()> {
        let mut failures = self.worker.wait().into_iter();
        let first = failures.next();
        print_failures(failures);
        match first {
            Some((_, e)) => Err(e),
            None => Ok(()),
        }
    }

    /// Restores the newest step complete in some tier into `tree` (collective): from memory in
    /// place when every rank's layout is the one saved, rebuilding what lost nodes held from
    /// the survivors' copies and parity; otherwise from the persistent location, resharded.
    /// `Ok(None)` when neither tier holds a step (a fresh start); an error when steps exist
    /// but none can be restored, saying why.
    pub fn restore<'a>(&mut self, tree: StateTree<'a>, comm: &dyn Communicator) -> Result<Option<Restored<'a>>> {
        print_failures(self.worker.wait());
        // Whatever is restored, the next memory save first clears its step and every later
        // one from every node (steps passed over stay until then: a job that fails again
        // before saving may still restore them).
        self.last_step = None;
        // Every rank goes on only if every rank's state could be described (a rank returning
        // alone would leave the others waiting in the next collective).
        let mut parts = agree(split(tree), comm)?;
        let mut seen =
            gather(self.opts.memory.as_ref(), &self.node, &parts.layout, self.opts.persistent.as_ref(), comm)?;
        let mut notes = std::mem::take(&mut seen.notes);
        let mut d = decide(&seen.reports, &seen.persistent);
        let note = |notes: &mut Vec<String>, more: Vec<String>| {
            for n in more {
                if !notes.contains(&n) {
                    notes.push(n);
                }
            }
        };
        note(&mut notes, std::mem::take(&mut d.notes));
        // Shards already found corrupt (and planned without): each pass must learn something
        // new or pass over the step, so the loop ends.
        let mut known_bad: Vec<(u64, usize, restore::Shard)> = Vec::new();
        while let (Some(plan), Some(tier)) = (d.memory.take(), self.opts.memory.clone()) {
            let step = plan.manifest.step;
            let rebuilt: Vec<usize> = plan.rebuild.iter().map(|(x, _)| *x).collect();
            let done = restore::rebuild(&tier, &plan, comm)
                .and_then(|()| agree(load_copy(&tier, step, comm.rank(), &mut parts), comm));
            match done {
                Ok((stored, objects)) => {
                    let state =
                        finish_in_place(&mut parts, &stored, objects, &tier.step_dir(step).display().to_string())?;
                    let common = layout::layout_values(&stored);
                    return Ok(Some(Restored {
                        step,
                        tier: Tier::Memory,
                        state,
                        common,
                        rebuilt_ranks: rebuilt,
                        notes,
                    }));
                }
                Err(e) => {
                    // Find which shards are corrupt and plan again without them (a corrupt
                    // copy or parity shard is then rebuilt from, or replaced by, the others);
                    // where no checksum shows why, pass over the step.
                    let mut bad = restore::find_corrupt(&tier, &plan, comm)?;
                    bad.retain(|(holder, shard)| !known_bad.contains(&(step, *holder, *shard)));
                    known_bad.extend(bad.iter().map(|(holder, shard)| (step, *holder, *shard)));
                    let then = if bad.is_empty() {
                        seen.drop_step(step);
                        "passing over it".to_owned()
                    } else {
                        seen.drop_shards(step, &bad);
                        let mut names: Vec<String> = Vec::new();
                        for name in bad.iter().map(|(holder, shard)| match shard {
                            restore::Shard::Copy(y) => {
                                format!("rank {y}'s copy on node {}", seen.reports[*holder].node)
                            }
                            restore::Shard::Parity(g, p) => {
                                format!("parity shard {p} of group {g} on node {}", seen.reports[*holder].node)
                            }
                        }) {
                            // Two ranks of a node may both have checked a shard there.
                            if !names.contains(&name) {
                                names.push(name);
                            }
                        }
                        format!("corrupt: {}; planning again without them", names.join(", "))
                    };
                    notes.push(format!("memory tier: step {step} failed to restore ({e}); {then}"));
                    d = decide(&seen.reports, &seen.persistent);
                    note(&mut notes, std::mem::take(&mut d.notes));
                }
            }
        }
        if let Some(p) = d.persistent.filter(|_| !notes.is_empty()) {
            note(&mut notes, vec![format!("restoring step {p} from the persistent tier")]);
        }
        match d.persistent {
            Some(p) => self.restore_persistent(parts, p, notes, comm).map(Some),
            None if notes.is_empty() => Ok(None),
            None => Err(Error::NotFound {
                path: self.opts.memory.as_ref().map(|t| t.root().to_owned()).unwrap_or_default(),
                detail: Some(format!("no step can be restored from any tier:\n{}", notes.join("\n"))),
            }),
        }
    }

    fn restore_persistent<'a>(
        &self,
        mut parts: Parts<'a>,
        step: u64,
        notes: Vec<String>,
        comm: &dyn Communicator,
    ) -> Result<Restored<'a>> {
        let loc = self.opts.persistent.as_ref().expect("a persistent step was found");
        let mut tensors: Vec<Option<ShardedTensor<'a>>> =
            std::mem::take(&mut parts.tensors).into_iter().map(Some).collect();
        let mut objects: Vec<Option<ShardedObject>> =
            std::mem::take(&mut parts.objects).into_iter().map(Some).collect();
        // Every rank opens the step and rebuilds its request; all go on to the collective load
        // only if all could (a rank failing alone would leave the others waiting in it).
        let prepared = loc.join(&step_name(step)).open().and_then(|storage| {
            let tree = reassemble(&parts.layout, &mut tensors, &mut objects)?;
            Ok((storage, tree))
        });
        let (storage, tree) = agree(prepared, comm)?;
        let ckpt = agree(open(storage.as_ref()), comm)?;
        let common = ckpt.index().common.clone();
        let state = ckpt.load(tree, comm, &LoadOptions::default())?.state;
        Ok(Restored { step, tier: Tier::Persistent, state, common, rebuilt_ranks: Vec::new(), notes })
    }
}

/// Background failures no call returns: printed, so that they are not lost.
fn print_failures(failures: impl IntoIterator<Item = (u64, Error)>) {
    for (s, e) in failures {
        eprintln!("tessera: checkpoint of step {s} failed in the background: {e}");
    }
}

fn finish_in_place<'a>(
    parts: &mut Parts<'a>,
    stored: &Value,
    objects: Vec<Vec<u8>>,
    path: &str,
) -> Result<StateTree<'a>> {
    let mut tensors: Vec<Option<ShardedTensor<'a>>> =
        std::mem::take(&mut parts.tensors).into_iter().map(Some).collect();
    let mut objs: Vec<Option<(ShardedObject, Vec<u8>)>> =
        std::mem::take(&mut parts.objects).into_iter().zip(objects).map(Some).collect();
    layout::rebuild_in_place(stored, &mut tensors, &mut objs, path)
}

/// Writes memory step `step` to `loc`'s step directory as an ordinary tessera checkpoint, each
/// rank from its memory copy (collective on `comm`).
fn drain(tier: &MemoryTier, step: u64, loc: &Location, comm: &dyn Communicator) -> Result<()> {
    let dir = tier.step_dir(step).join(rank_dir_name(comm.rank()));
    let path = dir.display().to_string();
    let storage = loc.join(&step_name(step)).open();
    let copy = tier.fs.storage(&dir);
    let tree = (|| -> Result<StateTree<'static>> {
        let ckpt = open(copy.as_ref())?;
        let StateTree::Map(mut common) = ckpt.common_state() else {
            return Err(Error::corrupt(&dir, "memory-tier copy without its layout"));
        };
        let Some(StateTree::Value(layout)) = common.remove(layout::LAYOUT_KEY) else {
            return Err(Error::corrupt(&dir, "memory-tier copy without its layout"));
        };
        let mut data: Vec<Option<TensorData<'static>>> = Vec::new();
        let mut objects: Vec<Option<Vec<u8>>> = Vec::new();
        for (key, t) in ckpt.read_tensors(None)? {
            let (slot, i) = match (key.strip_prefix('t'), key.strip_prefix('o')) {
                (Some(i), _) => (0, i),
                (_, Some(i)) => (1, i),
                _ => return Err(Error::corrupt(&dir, format!("memory-tier copy holds an unknown tensor {key:?}"))),
            };
            let i: usize = i.parse().map_err(|_| Error::corrupt(&dir, format!("memory-tier copy holds {key:?}")))?;
            if slot == 0 {
                data.resize_with(data.len().max(i + 1), || None);
                data[i] = Some(TensorData::Owned(t.data));
            } else {
                objects.resize_with(objects.len().max(i + 1), || None);
                objects[i] = Some(t.data);
            }
        }
        rebuild_global(&layout, &mut data, &mut objects, &path)
    })();
    let opts = SaveOptions { overwrite: true, ..SaveOptions::default() };
    match (storage, tree) {
        (Ok(storage), Ok(tree)) => save(tree, storage.as_ref(), comm, &opts).map(|_| ()),
        (storage, tree) => {
            // This rank cannot take part with data; it still plans with its peers, carrying its
            // error, so every rank fails the drain alike.
            let e = tree.err().or(storage.as_ref().err().map(super::commit::clone_error)).expect("one failed");
            let fallback: Arc<dyn Storage> = storage.unwrap_or_else(|_| Arc::new(MemoryStorage::new()));
            let empty = StateTree::map();
            NativeSession::plan(&empty, Some(e), fallback.as_ref(), comm, &opts).map(|_| ())
        }
    }
}

/// Removes the persistent steps older than the newest `keep` up to `current` (0 keeps all):
/// each step's index first (the step is then no longer committed), then its files. Steps after
/// `current` (from a run that went further) are never counted nor removed.
fn prune_persistent(loc: &Location, keep: usize, current: u64) -> Result<()> {
    if keep == 0 {
        return Ok(());
    }
    let steps = restore::persistent_steps(loc)?;
    for &step in steps.iter().filter(|&&s| s <= current).rev().skip(keep) {
        let at = loc.join(&step_name(step));
        let storage = at.open()?;
        storage.delete(INDEX_FILE)?;
        for name in storage.list_recursive()? {
            if !name.contains('/') {
                storage.delete(&name)?;
            }
        }
        if let Some(dir) = at.local_dir() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
    Ok(())
}
