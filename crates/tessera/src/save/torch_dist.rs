//! Saving as Megatron-Core `torch_dist` (a PyTorch DCP directory plus Megatron's
//! `metadata.json` and `common.pt`, `formats::torch_dist`), which megatron-core 0.16.1 and
//! `torch.distributed.checkpoint` load themselves.
//!
//! The global plan is the native save's: one exchange of shard metadata, the check that the
//! shards tile every tensor (before anything is written or removed), the spreading of
//! replicated shards over the ranks that hold them. Each rank then writes `files_per_rank`
//! data files `__{rank}_{k}.distcp` (Megatron's `thread_count`; its items spread over them by
//! size, each a `torch.save` archive written around the caller's bytes, not through a copy),
//! and rank 0, once every rank's files are complete, writes `common.pt`, `metadata.json` and
//! last `.metadata`: the commit (DCP's readers and tessera's take a directory without
//! `.metadata` for an unfinished save), by the one commit protocol (`save::commit`). DCP finds
//! data files through `.metadata`, not by name: in a directory without data files `k` counts
//! from 0 (DCP's own names); where data files exist (a checkpoint being overwritten, a failed
//! save's leftovers) `k` counts from a number taken from the save id, so a save never writes
//! into files the committed checkpoint uses: it stays whole until the new `.metadata` replaces
//! it, and its files are removed after. If the commit fails before `.metadata` is this save's,
//! the `common.pt` and `metadata.json` it replaced are put back (FORMAT.md says what a crash in
//! between leaves for Megatron's loader, which reads `common.pt` by name).
//!
//! The session is [`TorchDistSave`]: `plan` (from a state tree: the exchange and every check;
//! or [`TorchDistSave::of_files`], a layout made elsewhere: `convert_to_dcp`) → `write_file(k)`
//! → `commit`.
//!
//! The common values (rank 0's) are written twice: in `common.pt`, which Megatron reads (made
//! of them, unless the caller gives it ready-made), and as PyTorch DCP's own save writes a state
//! dict's values (`dcp_values`: byte items under DCP's flattened keys, in rank 0's data files,
//! with `planner_data` in `.metadata`), which `torch.distributed.checkpoint.load` and OLMo-core
//! find. A save without values (Megatron's front end gives `common.pt` alone) writes neither
//! items nor `planner_data`, as Megatron's own writer: Megatron's `load_sharded_metadata` takes
//! every byte item for a sharded object's.
//!
//! What the format cannot hold is refused on every rank before anything is written: shards
//! with a flattened range (megatron-core 0.16.1 refuses them too: "ShardedTensor.flattened_range
//! is not supported"), and a value whose DCP key another item has. (A key taken by a tensor
//! only other ranks hold is found by rank 0 once the plans are exchanged: no file is written
//! then, and the commit fails on every rank.)

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::format::lease::LeaseFiles;
use crate::format::Backend;
use crate::formats::dcp::parse_object_fqn;
use crate::formats::dcp_values::{flatten, planner_data, DcpValue, DcpValues};
use crate::formats::torch_dist::{
    common_copy_name, common_pt, data_file_name, is_data_file_name, metadata_pickle, metadata_save_id, object_fqn,
    object_item, parse_common_copy_name, ChunkItem, ItemPlace, TensorItems, DCP_METADATA, MEGATRON_COMMON,
    MEGATRON_METADATA, MEGATRON_METADATA_JSON,
};
use crate::formats::torch_save::write::{crc32, tensor_archive};
use crate::load::open::detect_format;
use crate::model::factories::apply_factories_collective;
use crate::model::Value;
use crate::model::{StatePath, StateTree};
use crate::plan::save::RankPlan;
use crate::save::commit::{classify_put, commit, remove_files, Place, Publish, Published};
use crate::save::lease::{kept_while, live_leases, LeaseHold};
use crate::save::options::{SaveOptions, SaveReport};
use crate::save::plan::{collect, new_save_id, plan_globally, refuse_foreign_files, Collected, MEGATRON_COMPANIONS};
use crate::save::write::{write_sources, Source};
use crate::storage::{ObjectWriter, Storage, StorageExt};

/// Backends a `torch_dist` save may replace with `overwrite` (a DCP directory either way).
const REPLACEABLE: [Backend; 2] = [Backend::TorchDist, Backend::TorchDcp];

/// Saves this rank's part of the state as a Megatron `torch_dist` checkpoint. Every rank of
/// `comm` calls it with its own tree. Tensor keys become DCP fqns; a sharded object becomes
/// the byte item `"{key}/shard_{offset}_{grid}"` holding `torch.save([obj])`, where the
/// object's payload says what `obj` is: `TSV1` + a plain value in tessera's value encoding,
/// `TPL1` + `torch.save([obj])` (stored as is, once checked), `TPT1` + `torch.save(obj)`
/// (wrapped in a list); any other payload is stored as Python `bytes`. The tree's values on rank
/// 0 (other ranks' are not read), with `opts.content_metadata` (when set) under
/// `content_metadata`, where Megatron keeps it, are the common values: byte items as DCP's save
/// writes them (see the module), and the dict of `common.pt`. `common`, given on rank 0
/// (ignored elsewhere), is instead the whole `common.pt` (`torch.save` of the common dict, as
/// Python makes it: the same state). Errors come out identically on every rank.
///
/// The report's `index_bytes` is the size of `.metadata` on rank 0 and 0 elsewhere. This is
/// [`TorchDistSave`]'s three steps in a row, the files written one after the other.
///
/// ```
/// use tessera::{open, SaveOptions};
/// use tessera::storage::StorageExt;
/// use tessera::torch_dist::save_torch_dist;
/// use tessera::{DType, ShardedTensor, StateTree, TensorData};
/// use tessera::comm::SoloComm;
/// use tessera::storage::MemoryStorage;
///
/// let storage = MemoryStorage::new();
/// let w: Vec<u8> = [1.0f32, 2.0, 3.0].iter().flat_map(|x| x.to_le_bytes()).collect();
/// let t = ShardedTensor::full("w", DType::F32, &[3], TensorData::Ref(&w));
/// let tree = StateTree::map().with("w", StateTree::Tensor(t));
/// save_torch_dist(tree, None, &storage, &SoloComm, &SaveOptions::default(), 1)?;
///
/// // A DCP directory that Megatron, PyTorch and tessera all load (with tessera's copy of the
/// // committed common.pt, `.tessera-common-<save id>.pt`, second in this order).
/// let names = storage.list_sorted()?;
/// assert_eq!(names.len(), 5);
/// assert!(names[1].starts_with(".tessera-common-"));
/// assert_eq!([&names[0], &names[2], &names[3], &names[4]], [".metadata", "__0_0.distcp", "common.pt", "metadata.json"]);
/// let ckpt = open(&storage)?;
/// assert_eq!(ckpt.format().backend, tessera::index::Backend::TorchDist);
/// assert_eq!(ckpt.read_tensors(None)?["w"].data, w);
/// # Ok::<(), tessera::Error>(())
/// ```
pub fn save_torch_dist(
    tree: StateTree<'_>,
    common: Option<&[u8]>,
    storage: &dyn Storage,
    comm: &dyn Communicator,
    opts: &SaveOptions,
    files_per_rank: usize,
) -> Result<SaveReport> {
    let save = TorchDistSave::plan(tree, common, storage, comm, opts, files_per_rank)?;
    let lease = save.lease.clone();
    kept_while(lease.as_deref().map(|l| (l, storage)), || {
        let written = (0..save.files()).try_fold(0u64, |n, k| Ok(n + save.write_file(k, storage, opts)?));
        save.commit(written, storage, comm, opts)
    })
}

/// A `torch_dist` save in three steps, for a caller that drives the writing of the data files
/// itself (Megatron's writer workers, each writing one file, possibly later, in the
/// background): [`plan`](Self::plan) (collective: the exchange, the checks, every file's
/// layout), [`write_file`](Self::write_file) for each of this rank's files (local, from any
/// thread, in any order), then [`commit`](Self::commit) (collective: every rank's verdict, the
/// commit on rank 0, or on a failure the removal of this save's files). Nothing is committed
/// before `commit`, and a save dropped without it leaves only uncommitted files (which
/// `tessera gc` removes).
///
/// ```
/// use tessera::{open, SaveOptions};
/// use tessera::torch_dist::TorchDistSave;
/// use tessera::{DType, ShardedTensor, StateTree, TensorData};
/// use tessera::comm::SoloComm;
/// use tessera::storage::MemoryStorage;
///
/// let storage = MemoryStorage::new();
/// let opts = SaveOptions::default();
/// let (a, b) = (vec![1u8; 8], vec![2u8; 8]);
/// let t = |k: &str, d| StateTree::Tensor(ShardedTensor::full(k, DType::U8, &[8], TensorData::Ref(d)));
/// let tree = StateTree::map().with("a", t("a", &a)).with("b", t("b", &b));
/// let save = TorchDistSave::plan(tree, None, &storage, &SoloComm, &opts, 2)?; // two data files
/// // Each data file may be written by a worker thread of its own.
/// let written = std::thread::scope(|s| {
///     let (save, storage, opts) = (&save, &storage, &opts);
///     let files: Vec<_> = (0..save.files()).map(|k| s.spawn(move || save.write_file(k, storage, opts))).collect();
///     files.into_iter().map(|f| f.join().unwrap()).sum::<tessera::Result<u64>>()
/// });
/// save.commit(written, &storage, &SoloComm, &opts)?;
/// assert_eq!(open(&storage)?.read_tensors(Some(&["b"]))?["b"].data, b);
/// # Ok::<(), tessera::Error>(())
/// ```
pub struct TorchDistSave<'a> {
    /// The state after its factories were applied: the data files are written from it (none:
    /// the caller writes the files, see [`TorchDistSave::of_files`]).
    tree: Option<StateTree<'a>>,
    rank: usize,
    plans: Vec<RankPlan>,
    save_id: u64,
    /// This rank's data files, in file order.
    names: Vec<String>,
    /// This rank's items in layout order, and the file each goes to.
    layout: Vec<Item>,
    bins: Vec<usize>,
    /// This rank's main objects as DCP byte items.
    object_items: Vec<Vec<u8>>,
    /// Rank 0: the common values as DCP byte items (after the objects in its files).
    values: Vec<DcpValue>,
    /// Rank 0: why the save cannot commit, found once every rank's plan was known (a value's
    /// DCP key taken by a tensor only another rank holds): no file is written, and the commit
    /// fails on every rank.
    refused: Option<Error>,
    /// Rank 0: what the commit puts.
    marker: Option<Marker>,
    /// Rank 0: the save's lease.
    lease: Option<Arc<LeaseHold>>,
}

/// What rank 0 puts at the commit: `common.pt`, `.metadata`, and the names of every data file
/// of the save (the files the new `.metadata` names; every other DCP data file is replaced).
struct Marker {
    common: Vec<u8>,
    metadata: Vec<u8>,
    files: BTreeSet<String>,
    save_id: u64,
}

impl<'a> TorchDistSave<'a> {
    /// Plans the save (collective over `comm`; arguments as [`save_torch_dist`]'s). Every
    /// check runs here: a state the format cannot hold, a sharding that does not tile, a
    /// checkpoint in the way, fail every rank alike before any byte is written.
    pub fn plan(
        tree: StateTree<'a>,
        common: Option<&[u8]>,
        storage: &dyn Storage,
        comm: &dyn Communicator,
        opts: &SaveOptions,
        files_per_rank: usize,
    ) -> Result<Self> {
        let files_per_rank = files_per_rank.max(1);
        let rank = comm.rank();
        let (tree, factory_error) = apply_factories_collective(tree);
        let mut c = collect(&tree, rank, true, opts.distribute_replicas);
        let found = factory_error.or(c.local_error.take()).or_else(|| unsupported(&c, opts));
        c.local_error = found;

        // Object items are made before the exchange: their sizes travel in it (as the objects'
        // lengths), so rank 0 can place every item, and a payload that does not convert fails
        // every rank alike.
        let own_id = serialization_id(new_save_id(), rank as u64);
        let mut object_items = Vec::new();
        if c.local_error.is_none() {
            let mains = c.plan.objects.iter_mut().filter(|o| o.main);
            for (o, data) in mains.zip(&c.object_data) {
                match object_item(&o.key, data, &own_id) {
                    Ok(item) => {
                        o.len = item.len() as u64;
                        object_items.push(item);
                    }
                    Err(e) => {
                        c.local_error = Some(e);
                        break;
                    }
                }
            }
        }
        let mut common_bytes = None;
        let mut lease = None;
        if rank == 0 {
            c.plan.save_id = new_save_id();
            // The save id carries where this save's file numbers start (`first_file_number`).
            match storage.list() {
                Ok(names) => {
                    let fresh = !names.iter().any(|n| is_data_file_name(n));
                    c.plan.save_id = with_first_file_number(c.plan.save_id, fresh);
                }
                Err(e) => c.local_error = c.local_error.take().or(Some(e)),
            }
            if c.local_error.is_none() {
                match existing(storage, opts.overwrite) {
                    Ok(refuse) => c.plan.refuse_overwrite = refuse,
                    Err(e) => c.local_error = Some(e),
                }
            }
            if c.local_error.is_none() && !c.plan.refuse_overwrite && !opts.overwrite {
                if let Err(e) = refuse_foreign_files(storage, is_torch_dist_name, "torch_dist") {
                    c.local_error = Some(e);
                }
            }
            // `common.pt` and the values' byte items are made now: a value they cannot hold, or
            // a DCP key two items would share (as far as rank 0's own tensors and objects tell),
            // fails every rank before any write.
            if c.local_error.is_none() {
                let values = common_values(&c.common, opts);
                let made = common
                    .map(<[u8]>::to_vec)
                    .map_or_else(|| common_pt(&values, &serialization_id(c.plan.save_id, u64::MAX)), Ok)
                    .and_then(|b| {
                        let id = c.plan.save_id;
                        let items = flatten(&values, &|n| serialization_id(id, u64::MAX - 1 - n as u64))?;
                        let own_objects: BTreeSet<String> =
                            c.plan.objects.iter().map(|o| object_fqn(&o.key, &o.offset, &o.global_shape)).collect();
                        let own_tensors: BTreeSet<&str> = c.plan.tensors.iter().map(|t| &*t.key).collect();
                        let objects = own_objects.iter().map(String::as_str);
                        planner_data(own_tensors, objects, &items, is_object_key, &storage.location())?;
                        Ok((b, items))
                    });
                match made {
                    Ok(made) => common_bytes = Some(made),
                    Err(e) => c.local_error = Some(e),
                }
            }
            if c.local_error.is_none() && !c.plan.refuse_overwrite {
                let files =
                    LeaseFiles::Distcp { first: first_file_number(c.plan.save_id), count: files_per_rank as u64 };
                match LeaseHold::take(storage, c.plan.save_id, files) {
                    Ok(l) => lease = Some(Arc::new(l)),
                    Err(e) => c.local_error = Some(e),
                }
            }
        }
        let plans = match plan_globally(comm, &mut c, opts, storage, None) {
            Ok(p) => p,
            Err(e) => {
                lease.map(|l| l.release(storage));
                return Err(e);
            }
        };
        let save_id = plans[0].save_id;
        drop(c);
        // Files of this save's own names: what is replaced stays committed until the new
        // `.metadata` replaces it.
        let names = file_names(rank, save_id, files_per_rank);
        let (values, marker, refused) = match common_bytes {
            Some((common, values)) => {
                let location = storage.location();
                match dcp_metadata(&plans, save_id, files_per_rank, &common, &values, &location) {
                    Ok((metadata, files)) => (values.values, Some(Marker { common, metadata, files, save_id }), None),
                    Err(e) => (Vec::new(), None, Some(e)),
                }
            }
            None => (Vec::new(), None, None),
        };
        let layout = items(&plans[rank], save_id, &values);
        let bins = spread(&layout, files_per_rank);
        Ok(TorchDistSave {
            tree: Some(tree),
            rank,
            plans,
            save_id,
            names,
            layout,
            bins,
            object_items,
            values,
            refused,
            marker,
            lease,
        })
    }

    /// How many data files this rank writes (`files_per_rank`; a file may hold no item).
    pub fn files(&self) -> usize {
        self.names.len()
    }

    /// The name of this rank's data file `k` (relative to the checkpoint).
    pub fn file_name(&self, k: usize) -> Option<&str> {
        self.names.get(k).map(String::as_str)
    }

    /// Writes this rank's data file `k`, whole (a `torch.save` archive per tensor chunk,
    /// written around the state's own bytes; the chunks' CRC-32s on `opts.threads` threads);
    /// returns its size. Local: several files may be written at once from several threads.
    pub fn write_file(&self, k: usize, storage: &dyn Storage, opts: &SaveOptions) -> Result<u64> {
        let Some(name) = self.names.get(k) else {
            return Err(Error::invalid(format!(
                "data file {k} of {}: this rank writes {}",
                self.rank,
                self.names.len()
            )));
        };
        let Some(tree) = &self.tree else {
            return Err(Error::invalid(format!("{name}: this save's files are written by its caller (create_file)")));
        };
        if let Some(e) = &self.refused {
            return Err(Error::invalid(format!("{name} not written: {e}")));
        }
        if let Some(l) = &self.lease {
            l.renew_if_due(storage);
        }
        let plan = &self.plans[self.rank];
        // The state's bytes, found again in the tree (in the plan's order, as `plan` found them).
        let c = collect(tree, self.rank, true, opts.distribute_replicas);
        let mut tensors: Vec<(usize, &[u8])> = Vec::new();
        let mut parts: Vec<Part> = Vec::new();
        for (item, _) in self.layout.iter().zip(&self.bins).filter(|(_, &b)| b == k) {
            match *item {
                Item::Tensor(i, _) => {
                    let t = &plan.tensors[i];
                    let data = c.tensor_data.get(i).copied().flatten().ok_or_else(|| {
                        Error::invalid(format!("{:?}: chosen to write a shard it has no data for", t.key))
                    })?;
                    parts.push(Part::Tensor(tensors.len()));
                    tensors.push((i, data));
                }
                Item::Object(i, _) => parts.push(Part::Object(i)),
                Item::Value(i, _) => parts.push(Part::Value(i)),
            }
        }
        let crcs = parallel_crc32(&tensors, opts.threads);
        let mut archives = Vec::with_capacity(tensors.len());
        for (&(i, bytes), &crc) in tensors.iter().zip(&crcs) {
            let t = &plan.tensors[i];
            let a = tensor_archive(t.dtype, &t.shape, crc, &serialization_id(self.save_id, i as u64));
            if a.data_len != bytes.len() as u64 {
                return Err(Error::invalid(format!(
                    "{:?}: {} bytes of data for a {:?} chunk of {} bytes",
                    t.key,
                    bytes.len(),
                    t.shape.to_vec(),
                    a.data_len
                )));
            }
            archives.push(a);
        }
        // The file's byte runs in order: each chunk's archive around the state's own bytes.
        let mut runs: Vec<&[u8]> = Vec::new();
        for part in &parts {
            match *part {
                Part::Tensor(n) => {
                    let a = &archives[n];
                    runs.extend([a.prefix.as_slice(), tensors[n].1, a.suffix.as_slice()]);
                }
                Part::Object(i) => {
                    let item = self
                        .object_items
                        .get(i)
                        .ok_or_else(|| Error::invalid(format!("{name}: object item {i} laid out, not made")))?;
                    runs.push(item);
                }
                Part::Value(i) => {
                    let value = self
                        .values
                        .get(i)
                        .ok_or_else(|| Error::invalid(format!("{name}: value item {i} laid out, not made")))?;
                    runs.push(&value.item);
                }
            }
        }
        let mut sources = Vec::with_capacity(runs.len());
        let mut at = 0u64;
        for data in runs {
            sources.push(Source { data, file_off: at, block: opts.block_size });
            at += data.len() as u64;
        }
        let planned: u64 = self.layout.iter().zip(&self.bins).filter(|(_, &b)| b == k).map(|(it, _)| it.len()).sum();
        if planned != at {
            return Err(Error::invalid(format!("{name}: {at} bytes laid out, {planned} planned")));
        }
        let writer = storage.create(name, at)?;
        write_sources(writer.as_ref(), &sources, opts.threads, storage.is_local(), opts.cancel.as_deref())?;
        writer.finish()?;
        Ok(at)
    }

    /// Ends the save (collective over `comm`). `written` is this rank's verdict on its files
    /// (their total size, or the error that stopped one): when every rank's files are whole,
    /// rank 0 commits (`common.pt`, `metadata.json`, then `.metadata`), by the one commit
    /// protocol (`save::commit`): a save that fails commits nothing, and every rank removes
    /// the files of this save it wrote and gets the first failure (another rank's as
    /// [`Error::PeerFailed`]); one whose outcome a rank cannot know removes nothing
    /// ([`Error::CommitUnknown`]).
    pub fn commit(
        self,
        written: Result<u64>,
        storage: &dyn Storage,
        comm: &dyn Communicator,
        opts: &SaveOptions,
    ) -> Result<SaveReport> {
        let written = match self.refused {
            Some(e) => Err(e),
            None => written,
        };
        let bytes_written = *written.as_ref().unwrap_or(&0);
        let index_bytes = self.marker.as_ref().map_or(0, |m| m.metadata.len() as u64);
        let mut publish = DcpPublish { marker: self.marker, overwrite: opts.overwrite };
        let report = written.map(|_| Vec::new());
        let place = Place { storage, own_files: self.names.clone(), lease: self.lease.as_deref() };
        let done = commit(comm, &[place], report, &mut publish)?;
        let mains = self.plans.iter().flat_map(|p| p.tensors.iter().filter(|t| t.main));
        let (chunks, total_tensor_bytes) = mains.fold((0, 0), |(n, b), t| (n + 1, b + t.nbytes()));
        Ok(SaveReport {
            file: self.names.into_iter().next(),
            bytes_written,
            total_tensor_bytes,
            files: self.plans.len(),
            chunks,
            index_bytes,
            leftovers: done.leftovers,
        })
    }

    /// A session for data files laid out elsewhere (`convert_to_dcp`, one process writing every
    /// file): `files`, each `(name, size)`, all of this save (`save_id`, one file number per
    /// rank), and what the commit puts (`common.pt` and `.metadata`). Takes the save's lease;
    /// the caller writes each file through [`TorchDistSave::create_file`].
    pub(crate) fn of_files(
        files: Vec<(String, u64)>,
        save_id: u64,
        common: Vec<u8>,
        metadata: Vec<u8>,
        storage: &dyn Storage,
    ) -> Result<TorchDistSave<'static>> {
        let lease =
            LeaseHold::take(storage, save_id, LeaseFiles::Distcp { first: first_file_number(save_id), count: 1 })?;
        let names: Vec<String> = files.iter().map(|(n, _)| n.clone()).collect();
        let marker = Marker { common, metadata, files: names.iter().cloned().collect(), save_id };
        Ok(TorchDistSave {
            tree: None,
            rank: 0,
            plans: Vec::new(),
            save_id,
            names,
            layout: Vec::new(),
            bins: Vec::new(),
            object_items: Vec::new(),
            values: Vec::new(),
            refused: None,
            marker: Some(marker),
            lease: Some(Arc::new(lease)),
        })
    }

    /// Creates this process's data file `k` (`size` bytes), for a caller that writes its bytes
    /// itself ([`TorchDistSave::of_files`]).
    pub(crate) fn create_file(&self, k: usize, size: u64, storage: &dyn Storage) -> Result<Box<dyn ObjectWriter>> {
        let name = self.names.get(k).ok_or_else(|| Error::invalid(format!("no data file {k} in this save")))?;
        storage.create(name, size)
    }

    /// The save's lease (rank 0), for a thread that renews it while the files are written.
    pub(crate) fn lease(&self) -> Option<Arc<LeaseHold>> {
        self.lease.clone()
    }
}

/// One item of a data file being written: a tensor chunk (its index among the file's chunks)
/// or an object (its index among the rank's object items).
enum Part {
    Tensor(usize),
    Object(usize),
    Value(usize),
}

/// File numbers are `first_file_number(save_id) + k`; the modulus keeps them short.
const FILE_NUMBER_MODULUS: u64 = 1_000_000_007;

/// `save_id` changed so that this save's file numbers start at 0 in a directory without data
/// files (`fresh`), and elsewhere at a number no earlier save likely used (never 0).
pub(crate) fn with_first_file_number(save_id: u64, fresh: bool) -> u64 {
    let rest = save_id % FILE_NUMBER_MODULUS;
    match (fresh, rest) {
        (true, _) => save_id - rest,
        (false, 0) => save_id + 1,
        (false, _) => save_id,
    }
}

/// The number of this save's first data file per rank.
fn first_file_number(save_id: u64) -> u64 {
    save_id % FILE_NUMBER_MODULUS
}

/// The data files of `rank` in this save.
pub(crate) fn file_names(rank: usize, save_id: u64, files_per_rank: usize) -> Vec<String> {
    let first = first_file_number(save_id);
    (0..files_per_rank as u64).map(|k| data_file_name(rank, first + k)).collect()
}

/// Which of `n` files each item goes to: largest first into the least-filled file (ties to the
/// lower file), as Megatron spreads a rank's items over its writer threads' files.
fn spread(layout: &[Item], n: usize) -> Vec<usize> {
    let len = Item::len;
    let mut order: Vec<usize> = (0..layout.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(len(&layout[i])), i));
    let mut fill = vec![0u64; n];
    let mut out = vec![0usize; layout.len()];
    for i in order {
        let f = (0..n).min_by_key(|&f| (fill[f], f)).unwrap_or(0);
        fill[f] += len(&layout[i]);
        out[i] = f;
    }
    out
}

/// The `.data/serialization_id` of the archives a save writes: 40 digits, as torch's.
pub(crate) fn serialization_id(save_id: u64, n: u64) -> String {
    format!("{save_id:020}{n:020}")
}

/// What the format cannot hold, or a bad option: found locally, it travels in the exchange
/// so that every rank fails alike.
fn unsupported(c: &Collected<'_>, opts: &SaveOptions) -> Option<Error> {
    if let Some(t) = c.plan.tensors.iter().find(|t| t.flat.is_some()) {
        return Some(Error::sharding(
            &*t.key,
            "a shard with a flattened range cannot be saved as torch_dist (megatron-core 0.16.1 refuses \
             them too: ShardedTensor.flattened_range is not supported); save it in the native format",
        ));
    }
    (opts.block_size == 0).then(|| Error::invalid("block size must be positive"))
}

/// Rank 0's look at the location: `true` if a committed checkpoint is there and overwriting
/// was not asked for; an error if one of a format this save cannot replace is there. A DCP
/// directory is committed when it has `.metadata` (its `metadata.json` alone is a save that
/// never finished, or one being overwritten).
pub(crate) fn existing(storage: &dyn Storage, overwrite: bool) -> Result<bool> {
    if storage.exists(DCP_METADATA)? {
        return Ok(!overwrite);
    }
    match detect_format(storage) {
        Ok((record, _)) if REPLACEABLE.contains(&record.backend) => Ok(false),
        Ok(_) if !overwrite => Ok(true),
        Ok((record, _)) => Err(Error::invalid(format!(
            "{} holds a {} checkpoint; a torch_dist checkpoint cannot replace it there",
            storage.location(),
            record.backend
        ))),
        Err(Error::NotFound { .. } | Error::NotCommitted { .. }) => Ok(false),
        Err(e) => Err(e),
    }
}

/// One item of a rank's file: a tensor chunk (index of the shard in the rank's plan), an
/// object (index among the rank's main objects) or a common value (rank 0: index among the
/// values), and its length.
#[derive(Debug, Clone, Copy)]
enum Item {
    Tensor(usize, u64),
    Object(usize, u64),
    Value(usize, u64),
}

impl Item {
    fn len(&self) -> u64 {
        match *self {
            Item::Tensor(_, n) | Item::Object(_, n) | Item::Value(_, n) => n,
        }
    }
}

/// The items of the file of the rank with plan `plan`, in file order: its main tensor shards,
/// its main objects, then `values` (rank 0's common values; none for other ranks). Every rank
/// computes its layout from the plans alone (an archive's length does not depend on the data's
/// checksum), and rank 0 every rank's.
fn items(plan: &RankPlan, save_id: u64, values: &[DcpValue]) -> Vec<Item> {
    let id = serialization_id(save_id, 0);
    let mut out = Vec::new();
    for (i, t) in plan.tensors.iter().enumerate().filter(|(_, t)| t.main) {
        out.push(Item::Tensor(i, tensor_archive(t.dtype, &t.shape, 0, &id).len()));
    }
    for (i, o) in plan.objects.iter().filter(|o| o.main).enumerate() {
        out.push(Item::Object(i, o.len));
    }
    for (i, v) in values.iter().enumerate() {
        out.push(Item::Value(i, v.item.len() as u64));
    }
    out
}

/// CRC-32 of every buffer, on up to `threads` threads.
fn parallel_crc32(data: &[(usize, &[u8])], threads: usize) -> Vec<u32> {
    let out = Mutex::new(vec![0u32; data.len()]);
    let next = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..threads.clamp(1, data.len().max(1)) {
            s.spawn(|| loop {
                let n = next.fetch_add(1, Ordering::Relaxed);
                let Some(&(_, bytes)) = data.get(n) else { return };
                let crc = crc32(bytes);
                out.lock().unwrap()[n] = crc;
            });
        }
    });
    out.into_inner().unwrap()
}

/// The `.metadata` of the save of `plans` (every rank's items placed as each rank lays out its
/// files, rank 0's with the common `values`) committed beside `common` (its `common.pt`), and
/// the names of every data file of the save. With values, `planner_data` records every key's
/// path, as DCP's own save does (Megatron's leaves it empty, and so does a save without
/// values); two items under one DCP key are refused (`location` names the checkpoint).
fn dcp_metadata(
    plans: &[RankPlan],
    save_id: u64,
    files_per_rank: usize,
    common: &[u8],
    values: &DcpValues,
    location: &str,
) -> Result<(Vec<u8>, BTreeSet<String>)> {
    let mut tensors: Vec<TensorItems> = Vec::new();
    let mut by_key: HashMap<&str, usize> = HashMap::new();
    let mut bytes = Vec::new();
    let mut values_placed = Vec::new();
    for (r, plan) in plans.iter().enumerate() {
        let names = file_names(r, save_id, files_per_rank);
        let layout = items(plan, save_id, if r == 0 { &values.values } else { &[] });
        let bins = spread(&layout, files_per_rank);
        let mut at = vec![0u64; files_per_rank];
        for (it, &f) in layout.into_iter().zip(&bins) {
            let len = it.len();
            let place = ItemPlace { file: names[f].clone(), offset: at[f], length: len };
            at[f] += len;
            match it {
                Item::Tensor(i, _) => {
                    let t = &plan.tensors[i];
                    let k = *by_key.entry(&t.key).or_insert_with(|| {
                        tensors.push(TensorItems {
                            fqn: t.key.to_string(),
                            dtype: t.dtype,
                            size: t.global_shape.to_vec(),
                            chunks: Vec::new(),
                        });
                        tensors.len() - 1
                    });
                    tensors[k].chunks.push(ChunkItem { offsets: t.offset.to_vec(), sizes: t.shape.to_vec(), place });
                }
                Item::Object(i, _) => {
                    let o = plan.objects.iter().filter(|o| o.main).nth(i).expect("items() counted it");
                    bytes.push((object_fqn(&o.key, &o.offset, &o.global_shape), place));
                }
                Item::Value(i, _) => values_placed.push((values.values[i].fqn.clone(), place)),
            }
        }
    }
    let planner = if values.values.is_empty() {
        None
    } else {
        let tensor_keys = tensors.iter().map(|t| t.fqn.as_str());
        let objects = bytes.iter().map(|(fqn, _)| fqn.as_str());
        Some(planner_data(tensor_keys, objects, values, is_object_key, location)?)
    };
    bytes.extend(values_placed);
    let metadata = metadata_pickle(&tensors, &bytes, planner.as_deref(), &metadata_save_id(save_id, common));
    let files = (0..plans.len()).flat_map(|r| file_names(r, save_id, files_per_rank)).collect();
    Ok((metadata, files))
}

/// Whether a DCP key is read as a sharded object's (`KEY/shard_O_S`).
fn is_object_key(fqn: &str) -> bool {
    parse_object_fqn(fqn).is_some()
}

/// The common values that make `common.pt`: the tree's, with `opts.content_metadata` (when set)
/// under `content_metadata`, where Megatron keeps it.
fn common_values(values: &[(StatePath, Value)], opts: &SaveOptions) -> Vec<(StatePath, Value)> {
    let mut values = values.to_vec();
    if opts.content_metadata != Value::Null {
        values.push((vec![crate::model::PathSeg::Key("content_metadata".into())], opts.content_metadata.clone()));
    }
    values
}

/// Names a torch_dist save may find in a location it writes into without `overwrite`: DCP data
/// files (leftovers of saves that never committed), the marker, Megatron's companions, leases
/// and temporaries of puts that never finished.
fn is_torch_dist_name(n: &str) -> bool {
    is_data_file_name(n)
        || parse_common_copy_name(n).is_some()
        || n == DCP_METADATA
        || MEGATRON_COMPANIONS.contains(&n)
        || crate::format::lease::parse_lease_name(n).is_some()
        || crate::storage::temporary_target(n).is_some()
}

/// The torch_dist commit on rank 0: `common.pt` and `metadata.json`, then `.metadata` (the
/// commit: create-if-absent unless overwriting), then the removal of DCP data files the new
/// `.metadata` does not name. Until `.metadata` is this save's, what `common.pt` and
/// `metadata.json` held is kept, and put back if the commit fails.
struct DcpPublish {
    marker: Option<Marker>,
    overwrite: bool,
}

impl Publish for DcpPublish {
    fn publish(&mut self, storage: &dyn Storage, _reports: &[&[u8]]) -> Published {
        let Some(m) = self.marker.take() else {
            return Published::NotCommitted(Error::invalid("torch_dist commit without its marker (not rank 0?)"));
        };
        // What the companions hold now, to put back if the commit fails.
        let mut before: Vec<(&str, Option<Vec<u8>>)> = Vec::new();
        for name in [MEGATRON_COMMON, MEGATRON_METADATA] {
            match storage.read(name) {
                Ok(b) => before.push((name, Some(b))),
                Err(Error::NotFound { .. }) => before.push((name, None)),
                Err(e) => return Published::NotCommitted(e),
            }
        }
        let json = MEGATRON_METADATA_JSON.as_bytes();
        // The copy of this save's common.pt, kept beside the checkpoint once committed: a reader
        // finds the committed common state there if an overwrite is interrupted between the
        // put of common.pt and that of .metadata.
        let copy = common_copy_name(m.save_id);
        if let Err(e) = storage.put_atomic(&copy, &m.common) {
            let _ = storage.delete(&copy);
            return Published::NotCommitted(e);
        }
        let mut touched = 0;
        let mut companions = || -> Result<()> {
            touched = 1;
            storage.put_atomic(MEGATRON_COMMON, &m.common)?;
            if before[1].1.as_deref() != Some(json) {
                touched = 2;
                storage.put_atomic(MEGATRON_METADATA, json)?;
            }
            Ok(())
        };
        if let Err(e) = companions() {
            let _ = storage.delete(&copy);
            return Published::NotCommitted(restore(storage, &before[..touched], e));
        }
        let put = if self.overwrite {
            storage.put_atomic(DCP_METADATA, &m.metadata)
        } else {
            storage.put_if_absent(DCP_METADATA, &m.metadata)
        };
        let check = !self.overwrite && !storage.has_atomic_create();
        let ours = || match storage.read(DCP_METADATA) {
            Ok(b) => Ok(b == m.metadata),
            Err(Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(e),
        };
        match classify_put(storage, DCP_METADATA, put, check, ours) {
            Ok(()) => {}
            Err(Published::NotCommitted(e)) => {
                let _ = storage.delete(&copy);
                return Published::NotCommitted(restore(storage, &before[..touched], e));
            }
            Err(other) => return other,
        }
        let leftovers = remove_replaced(storage, &m.files, &copy, m.save_id);
        Published::Committed { summary: Vec::new(), leftovers }
    }
}

/// Puts back what the companions `before` held (an absent one is removed) after a commit that
/// failed with `err`; returns `err`, saying so where one could not be put back.
fn restore(storage: &dyn Storage, before: &[(&str, Option<Vec<u8>>)], err: Error) -> Error {
    let failed: Vec<String> = before
        .iter()
        .filter_map(|(name, old)| {
            let r = match old {
                Some(b) => storage.put_atomic(name, b),
                None => storage.delete(name),
            };
            r.err().map(|e| format!("{name} ({e})"))
        })
        .collect();
    if failed.is_empty() {
        return err;
    }
    Error::Io {
        path: storage.location().into(),
        source: std::io::Error::other(format!(
            "{err}; the commit failed and {} could not be put back as it was: the committed checkpoint's \
             tensors and objects are unchanged (torch.distributed.checkpoint and tessera read them), but \
             Megatron's loader would read this failed save's common state beside them: save again",
            failed.join(", ")
        )),
    }
}

/// After the commit: DCP data files the new `.metadata` does not name, and copies of
/// `common.pt` but its own (`copy`), are garbage (an earlier checkpoint's, a failed save's),
/// unless a live lease covers them (a save still running). Returns those that could not be
/// removed.
fn remove_replaced(storage: &dyn Storage, ours: &BTreeSet<String>, copy: &str, save_id: u64) -> Vec<String> {
    let Ok(names) = storage.list() else { return Vec::new() };
    let leases = live_leases(storage, &names, Some(save_id));
    let replaced =
        |n: &str| (is_data_file_name(n) && !ours.contains(n)) || (parse_common_copy_name(n).is_some() && n != copy);
    let garbage: Vec<String> =
        names.into_iter().filter(|n| replaced(n) && !leases.iter().any(|l| l.covers(n))).collect();
    remove_files(storage, &garbage)
}
