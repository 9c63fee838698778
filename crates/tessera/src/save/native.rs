//! The native write session: [`NativeSession::plan`] (collective: the exchange, every check,
//! each file's layout; rank 0 takes the save's lease) → [`NativeSession::write_file`] (local,
//! each of this process's data files) → [`NativeSession::commit`] (collective: the index put
//! last, by the one commit protocol of `save::commit`). [`save`], the async save and `convert`
//! are compositions of it.

use std::sync::Arc;

use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::format::lease::LeaseFiles;
use crate::format::{data_file_name, parse_data_file_name, CheckpointIndex, INDEX_FILE};
use crate::model::factories::apply_factories_collective;
use crate::model::{StatePath, StateTree, Value};
use crate::plan::save::{build_index, layout_file, FileLayout, RankPlan, WrittenFile};
use crate::save::commit::{classify_put, commit, Place, Publish, Published};
use crate::save::lease::{kept_while, LeaseHold};
use crate::save::options::{SaveOptions, SaveReport};
use crate::save::plan::{
    collect, new_save_id, plan_globally, plan_with_cache, refuse_foreign_files, save_time, MEGATRON_COMPANIONS,
};
use crate::save::write::{write_sources, Source};
use crate::storage::{ObjectWriter, Storage};
use crate::threads::on_cores;

/// The bytes a rank writes into its data file, borrowed from its state tree: each main tensor
/// shard's and object shard's, in layout order.
#[derive(Debug, Default)]
pub(crate) struct RankBytes<'t> {
    pub tensors: Vec<&'t [u8]>,
    pub objects: Vec<&'t [u8]>,
}

/// A native save being written: what every rank knows once the plans are exchanged and
/// validated. Owns no borrowed bytes, so it can move to a background thread (async save).
pub(crate) struct NativeSession {
    /// Every plan on rank 0 (it builds the index); elsewhere at least this rank's.
    plans: Arc<Vec<RankPlan>>,
    save_id: u64,
    /// This process's data files: the plan each is written by (its "rank") and its layout.
    files: Vec<(usize, FileLayout)>,
    /// Rank 0: the common values.
    common: Vec<(StatePath, Value)>,
    content_metadata: Value,
    block_size: u64,
    overwrite: bool,
    /// Rank 0: the save's lease.
    lease: Option<Arc<LeaseHold>>,
}

impl NativeSession {
    /// Plans the save of this rank's state `tree` (collective over `comm`; `local_error` is a
    /// failure the caller found already, which fails every rank alike). Every check runs here,
    /// before any byte is written; rank 0 takes the save's lease.
    pub fn plan<'t>(
        tree: &'t StateTree<'_>,
        local_error: Option<Error>,
        storage: &dyn Storage,
        comm: &dyn Communicator,
        opts: &SaveOptions,
    ) -> Result<(NativeSession, RankBytes<'t>)> {
        let rank = comm.rank();
        let mut c = collect(tree, rank, true, opts.distribute_replicas);
        if let Some(e) = local_error {
            c.local_error = Some(e);
        }
        if opts.block_size == 0 {
            c.local_error.get_or_insert(Error::invalid("block size must be positive"));
        }
        let mut lease = None;
        if rank == 0 {
            c.plan.save_id = new_save_id();
            if !opts.overwrite {
                match storage.size(INDEX_FILE) {
                    Ok(_) => c.plan.refuse_overwrite = true,
                    Err(Error::NotFound { .. }) => {
                        if let Err(e) = refuse_foreign_files(storage, is_native_name, "tessera") {
                            c.local_error.get_or_insert(e);
                        }
                    }
                    Err(e) => {
                        c.local_error.get_or_insert(e);
                    }
                }
            }
            if c.local_error.is_none() && !c.plan.refuse_overwrite {
                match LeaseHold::take(storage, c.plan.save_id, LeaseFiles::Native) {
                    Ok(l) => lease = Some(Arc::new(l)),
                    Err(e) => c.local_error = Some(e),
                }
            }
        }
        let planned = match &opts.plan_cache {
            Some(cache) => plan_with_cache(comm, &mut c, cache, opts, storage),
            None => plan_globally(comm, &mut c, opts, storage, None).map(|p| {
                let id = p[0].save_id;
                (Arc::new(p), id)
            }),
        };
        let (plans, save_id) = match planned {
            Ok(p) => p,
            Err(e) => {
                // Nothing was written: the lease only has to go.
                lease.map(|l| l.release(storage));
                return Err(e);
            }
        };
        let layout = layout_file(rank, &plans[rank], opts.block_size);
        let tensors = plans[rank]
            .tensors
            .iter()
            .zip(&c.tensor_data)
            .filter(|(t, _)| t.main)
            .map(|(t, d)| {
                d.ok_or_else(|| Error::invalid(format!("{:?}: chosen to write a shard it has no data for", t.key)))
            })
            .collect::<Result<Vec<_>>>();
        // Every rank has its plan; a rank without the bytes it was chosen for is a bug of the
        // assignment, reported at the commit like a failed write.
        let bytes = RankBytes { tensors: tensors.unwrap_or_default(), objects: c.object_data };
        let session = NativeSession {
            plans,
            save_id,
            files: vec![(rank, layout)],
            common: c.common,
            content_metadata: opts.content_metadata.clone(),
            block_size: opts.block_size,
            overwrite: opts.overwrite,
            lease,
        };
        Ok((session, bytes))
    }

    /// A session in which this process writes the data file of every plan (`convert`: the
    /// plans are the files the source is packed into, already validated). Takes the lease.
    pub fn of_plans(
        plans: Vec<RankPlan>,
        storage: &dyn Storage,
        block_size: u64,
        overwrite: bool,
        common: Vec<(StatePath, Value)>,
        content_metadata: Value,
    ) -> Result<NativeSession> {
        let save_id = new_save_id();
        let files = plans.iter().enumerate().map(|(n, p)| (n, layout_file(n, p, block_size))).collect();
        let lease = Some(Arc::new(LeaseHold::take(storage, save_id, LeaseFiles::Native)?));
        Ok(NativeSession {
            plans: Arc::new(plans),
            save_id,
            files,
            common,
            content_metadata,
            block_size,
            overwrite,
            lease,
        })
    }

    /// This process's data files.
    pub fn files(&self) -> usize {
        self.files.len()
    }

    /// The name of data file `k`.
    pub fn file_name(&self, k: usize) -> String {
        data_file_name(self.save_id, self.files[k].0)
    }

    /// The layout of data file `k`.
    pub fn layout(&self, k: usize) -> &FileLayout {
        &self.files[k].1
    }

    /// The save's lease (rank 0), for a thread that renews it while the session runs.
    pub fn lease(&self) -> Option<Arc<LeaseHold>> {
        self.lease.clone()
    }

    /// Where each of `bytes` goes in data file `k` (tensors checksummed in blocks, objects
    /// whole), in layout order.
    pub fn sources<'a>(&self, k: usize, bytes: &RankBytes<'a>) -> Result<Vec<Source<'a>>> {
        let layout = self.layout(k);
        let nt = layout.tensor_entries.len();
        if bytes.tensors.len() != nt || bytes.objects.len() != layout.object_entries.len() {
            return Err(Error::invalid(format!(
                "{}: {} tensor and {} object shards to write, {nt} and {} laid out (a shard chosen to be \
                 written here has no data)",
                self.file_name(k),
                bytes.tensors.len(),
                bytes.objects.len(),
                layout.object_entries.len()
            )));
        }
        let at = |n: usize| layout.header_len + layout.entries[n].start;
        let tensors =
            bytes.tensors.iter().enumerate().map(|(n, &data)| Source { data, file_off: at(n), block: self.block_size });
        let objects =
            bytes.objects.iter().enumerate().map(|(n, &data)| Source { data, file_off: at(nt + n), block: u64::MAX });
        Ok(tensors.chain(objects).collect())
    }

    /// Writes data file `k` whole from `bytes` (see [`NativeSession::sources`]); a file with
    /// nothing to hold is not created. Local: any thread.
    pub fn write_file(
        &self,
        k: usize,
        bytes: &RankBytes<'_>,
        storage: &dyn Storage,
        opts: &SaveOptions,
    ) -> Result<WrittenFile> {
        if self.layout(k).entries.is_empty() {
            return Ok(WrittenFile::default());
        }
        let sources = self.sources(k, bytes)?;
        let writer = storage.create(&self.file_name(k), self.layout(k).size)?;
        let crcs = write_sources(writer.as_ref(), &sources, opts.threads, storage.is_local(), opts.cancel.as_deref())?;
        self.finish_file(k, writer, crcs)
    }

    /// Ends data file `k` once every byte of it is written (with checksums `crcs`: per entry, in
    /// layout order): its header goes in last, then the file is finished. Returns the report the
    /// commit gathers.
    pub fn finish_file(&self, k: usize, writer: Box<dyn ObjectWriter>, mut crcs: Vec<Vec<u32>>) -> Result<WrittenFile> {
        let (plan_index, layout) = &self.files[k];
        let plan = &self.plans[*plan_index];
        // An object has exactly one checksum, even when empty.
        for c in crcs.iter_mut().skip(layout.tensor_entries.len()) {
            if c.is_empty() {
                c.push(crate::model::crc::crc32c(&[]));
            }
        }
        let header = layout.header(*plan_index, plan, self.block_size, &crcs);
        if header.len() as u64 != layout.header_len {
            return Err(Error::invalid(format!(
                "data-file header is {} bytes, {} were laid out",
                header.len(),
                layout.header_len
            )));
        }
        let nt = layout.tensor_entries.len();
        let written = WrittenFile {
            name: self.file_name(k),
            size: layout.size,
            header_len: layout.header_len,
            header_crc: crate::model::crc::crc32c(&header),
            tensors: (0..nt)
                .map(|n| (layout.header_len + layout.entries[n].start, crcs[n].as_slice().into()))
                .collect(),
            objects: (0..layout.object_entries.len())
                .map(|n| {
                    let e = &layout.entries[nt + n];
                    (layout.header_len + e.start, e.len, crcs[nt + n].first().copied().unwrap_or(0))
                })
                .collect(),
        };
        writer.write_at(0, &header)?;
        writer.finish()?;
        Ok(written)
    }

    /// Ends the save (collective over `comm`): `written` is this process's report of its files
    /// (in file order), or what stopped it. Rank 0 builds the index from every rank's report and
    /// puts it (the commit); see `save::commit` for what every rank then returns and removes.
    pub fn commit(
        self,
        written: Result<Vec<WrittenFile>>,
        storage: &dyn Storage,
        comm: &dyn Communicator,
    ) -> Result<SaveReport> {
        let own: Vec<String> = (0..self.files()).map(|k| self.file_name(k)).collect();
        let (bytes_written, file) = match &written {
            Ok(w) => (w.iter().map(|f| f.size).sum(), w.iter().find(|f| !f.name.is_empty()).map(|f| f.name.clone())),
            Err(_) => (0, None),
        };
        let report = written.map(|w| encode_reports(&w));
        let NativeSession { plans, save_id, common, content_metadata, block_size, overwrite, lease, .. } = self;
        let mut publish = IndexPublish { plans, save_id, common, content_metadata, block_size, overwrite };
        let place = Place { storage, own_files: own, lease: lease.as_deref() };
        let done = commit(comm, &[place], report, &mut publish)?;
        let summary = Summary::decode(&done.summary)?;
        Ok(SaveReport {
            file,
            bytes_written,
            total_tensor_bytes: summary.total_tensor_bytes,
            files: summary.files as usize,
            chunks: summary.chunks as usize,
            index_bytes: summary.index_bytes,
            leftovers: done.leftovers,
        })
    }
}

/// Names a native save may find in a location it writes into without `overwrite`: leftovers of
/// its own kind (data files of saves that never committed, their leases, temporary files of an
/// index being put) and Megatron's companions.
fn is_native_name(n: &str) -> bool {
    crate::format::is_data_file_name(n)
        || n == INDEX_FILE
        || crate::format::lease::parse_lease_name(n).is_some()
        || crate::storage::temporary_target(n)
            .is_some_and(|t| t == INDEX_FILE || crate::format::lease::parse_lease_name(t).is_some())
        || MEGATRON_COMPANIONS.contains(&n)
}

/// A process's reports of its files, as one message.
fn encode_reports(files: &[WrittenFile]) -> Vec<u8> {
    let mut e = crate::model::codec::Encoder::default();
    e.var(files.len() as u64);
    for f in files {
        e.bytes(&f.encode());
    }
    e.buf
}

fn decode_reports(bytes: &[u8], rank: usize, out: &mut Vec<WrittenFile>) -> Result<()> {
    let bad = |e: String| Error::Comm { reason: format!("bad write report from rank {rank}: {e}") };
    let mut d = crate::model::codec::Decoder::new(bytes);
    for _ in 0..d.count().map_err(bad)? {
        out.push(WrittenFile::decode(d.bytes().map_err(bad)?).map_err(bad)?);
    }
    Ok(())
}

/// What rank 0 tells every rank about the committed index.
#[derive(Debug, Default)]
struct Summary {
    index_bytes: u64,
    total_tensor_bytes: u64,
    files: u64,
    chunks: u64,
}

impl Summary {
    fn of(index: &CheckpointIndex, index_bytes: u64) -> Summary {
        Summary {
            index_bytes,
            total_tensor_bytes: index.tensor_bytes(),
            files: index.files.len() as u64,
            chunks: index.chunk_count() as u64,
        }
    }
    fn encode(&self) -> Vec<u8> {
        let mut e = crate::model::codec::Encoder::default();
        for v in [self.index_bytes, self.total_tensor_bytes, self.files, self.chunks] {
            e.var(v);
        }
        e.buf
    }
    fn decode(bytes: &[u8]) -> Result<Summary> {
        let mut d = crate::model::codec::Decoder::new(bytes);
        let mut next = || d.var().map_err(|e| Error::Comm { reason: format!("bad commit summary: {e}") });
        Ok(Summary { index_bytes: next()?, total_tensor_bytes: next()?, files: next()?, chunks: next()? })
    }
}

/// The native commit on rank 0: the index built from every rank's report, put last
/// (create-if-absent unless overwriting), then the removal of the data files it replaces.
struct IndexPublish {
    plans: Arc<Vec<RankPlan>>,
    save_id: u64,
    common: Vec<(StatePath, Value)>,
    content_metadata: Value,
    block_size: u64,
    overwrite: bool,
}

impl Publish for IndexPublish {
    fn publish(&mut self, storage: &dyn Storage, reports: &[&[u8]]) -> Published {
        let mut written = Vec::with_capacity(self.plans.len());
        for (r, b) in reports.iter().enumerate() {
            if let Err(e) = decode_reports(b, r, &mut written) {
                return Published::NotCommitted(e);
            }
        }
        let common = std::mem::take(&mut self.common);
        let meta = std::mem::replace(&mut self.content_metadata, Value::Null);
        let index = match build_index(&self.plans, written, self.block_size, common, meta, &on_cores) {
            Ok(i) => i,
            Err(e) => return Published::NotCommitted(e),
        };
        let bytes = index.encode();
        let put = if self.overwrite {
            storage.put_atomic(INDEX_FILE, &bytes)
        } else {
            storage.put_if_absent(INDEX_FILE, &bytes)
        };
        // A create-if-absent that is not atomic may have let a concurrent commit in.
        let check = !self.overwrite && !storage.has_atomic_create();
        if let Err(p) = classify_put(storage, INDEX_FILE, put, check, || index_is(storage, &bytes)) {
            return p;
        }
        let leftovers = match remove_replaced(storage, &index, &bytes, self.save_id) {
            Ok(l) => l,
            // A later save's index replaced this one meanwhile (a create-if-absent that is not
            // atomic): this save lost, and nothing names its files.
            Err(e @ Error::AlreadyExists { .. }) => return Published::NotCommitted(e),
            Err(_) => Vec::new(),
        };
        Published::Committed { summary: Summary::of(&index, bytes.len() as u64).encode(), leftovers }
    }
}

/// Whether the committed index is `bytes` (compared by size and tail: the index ends with its
/// checksum). An index of another size or tail, or none, is not.
fn index_is(storage: &dyn Storage, bytes: &[u8]) -> Result<bool> {
    let size = match storage.size(INDEX_FILE) {
        Ok(s) => s,
        Err(Error::NotFound { .. }) => return Ok(false),
        Err(e) => return Err(e),
    };
    if size != bytes.len() as u64 {
        return Ok(false);
    }
    let tail = bytes.len().min(64);
    let mut stored = vec![0u8; tail];
    storage.read_at(INDEX_FILE, size - tail as u64, &mut stored)?;
    Ok(stored == bytes[bytes.len() - tail..])
}

/// After the commit: the data files of saves that started before this one (replaced or
/// crashed) and that the new index does not name are garbage, unless a live lease covers them
/// (a save still running). Files of saves that started later are left alone (they may still be
/// running; `tessera gc` removes them if they never commit). Right before deleting, the index
/// is checked to still be this save's: if a concurrent save replaced it (a create-if-absent
/// that is not atomic), nothing is deleted and `AlreadyExists` says this save lost. Returns the
/// files that could not be removed.
fn remove_replaced(storage: &dyn Storage, index: &CheckpointIndex, bytes: &[u8], save_id: u64) -> Result<Vec<String>> {
    let names = storage.list()?;
    let leases = crate::save::lease::live_leases(storage, &names, Some(save_id));
    let started = save_time(save_id);
    let garbage: Vec<String> = names
        .into_iter()
        .filter(|name| {
            let earlier = parse_data_file_name(name).is_some_and(|(id, _)| id != save_id && save_time(id) <= started);
            earlier && !index.files.iter().any(|f| &f.name == name) && !leases.iter().any(|l| l.covers(name))
        })
        .collect();
    if garbage.is_empty() {
        return Ok(Vec::new());
    }
    if !index_is(storage, bytes)? {
        return Err(Error::AlreadyExists { path: format!("{}/{INDEX_FILE}", storage.location()).into() });
    }
    Ok(crate::save::commit::remove_files(storage, &garbage))
}

/// Saves this rank's part of the state. Every rank of `comm` must call it with its own tree.
/// Errors (invalid sharding, an existing checkpoint, a failed write) are returned on every rank;
/// a save that fails commits nothing and removes its files, and one whose outcome a rank cannot
/// know ([`Error::CommitUnknown`]) removes nothing.
///
/// ```
/// use tessera::{open, save, DType, SaveOptions, ShardedTensor, StateTree, TensorData, Value};
/// use tessera::comm::SoloComm;
/// use tessera::storage::MemoryStorage;
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
    let (session, bytes) = NativeSession::plan(&tree, factory_error, storage, comm, opts)?;
    let lease = session.lease();
    kept_while(lease.as_deref().map(|l| (l, storage)), || {
        let written =
            (0..session.files()).map(|k| session.write_file(k, &bytes, storage, opts)).collect::<Result<Vec<_>>>();
        session.commit(written, storage, comm)
    })
}
