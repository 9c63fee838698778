//! Async save: the caller blocks only for the exchange, validation and a copy of its bytes into
//! the staging pool; a background thread writes the data file, then commits over a dedicated
//! communicator. The verdict is collected by [`AsyncSave::finalize`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::model::factories::apply_factories_collective;
use crate::model::StateTree;
use crate::plan::save::WrittenFile;
use crate::save::lease::kept_while;
use crate::save::native::NativeSession;
use crate::save::options::{SaveOptions, SaveReport};
use crate::save::staging::{PoolBuffer, StagingPool};
use crate::storage::{ObjectWriter, Storage};

/// Runs async saves one after another with one staging pool.
///
/// The background commit of a save runs collectives on `commit_comm`, concurrently with
/// whatever the caller does on its own communicator, so `commit_comm` must be a communicator
/// used by nothing else (a second process group, like PyTorch DCP's async save). No poll
/// needs a collective: [`AsyncSave::is_done`] is local, and every rank gets the same verdict
/// from [`AsyncSave::finalize`] because rank 0 broadcast it.
///
/// ```
/// use std::sync::Arc;
/// use tessera::{open, AsyncSaver, SaveOptions, StagingPool};
/// use tessera::{DType, ShardedTensor, StateTree, TensorData};
/// use tessera::comm::SoloComm;
/// use tessera::storage::MemoryStorage;
///
/// let storage = MemoryStorage::new();
/// let mut saver = AsyncSaver::new(StagingPool::new(1 << 20)?, Arc::new(SoloComm));
/// let mut w = vec![7u8; 64];
/// let t = ShardedTensor::full("w", DType::U8, &[64], TensorData::Ref(&w));
/// let tree = StateTree::map().with("w", StateTree::Tensor(t));
/// let pending = saver.save(tree, Arc::new(storage.clone()), &SoloComm, &SaveOptions::default())?;
/// w.fill(0); // the bytes are staged: training may go on while the background thread writes
///
/// let report = pending.finalize()?;
/// assert_eq!(report.total_tensor_bytes, 64);
/// assert_eq!(open(&storage)?.read_tensors(None)?["w"].data, vec![7u8; 64]);
/// # Ok::<(), tessera::Error>(())
/// ```
pub struct AsyncSaver {
    pool: Arc<StagingPool>,
    commit_comm: Arc<dyn Communicator>,
    last: Option<Arc<Completion>>,
}

impl std::fmt::Debug for AsyncSaver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncSaver").field("pool", &self.pool).field("pending", &self.last.is_some()).finish()
    }
}

/// One async save in flight. Dropping it does not stop the save; its verdict is then lost.
#[derive(Debug)]
pub struct AsyncSave {
    completion: Arc<Completion>,
    thread: Option<JoinHandle<()>>,
}

#[derive(Debug, Default)]
struct Completion {
    result: Mutex<Option<Result<SaveReport>>>,
    done: AtomicBool,
    cv: Condvar,
}

impl Completion {
    fn set(&self, r: Result<SaveReport>) {
        *self.result.lock().unwrap() = Some(r);
        self.done.store(true, Ordering::Release);
        self.cv.notify_all();
    }

    fn wait(&self) {
        let mut g = self.result.lock().unwrap();
        while !self.done.load(Ordering::Acquire) {
            g = self.cv.wait(g).unwrap();
        }
    }
}

impl AsyncSave {
    /// True once this rank's part is over: its file written and the commit decided. Local:
    /// no communication, cheap enough to call every training step.
    pub fn is_done(&self) -> bool {
        self.completion.done.load(Ordering::Acquire)
    }

    /// Blocks until [`AsyncSave::is_done`].
    pub fn wait(&self) {
        self.completion.wait();
    }

    /// Waits for the save and returns its verdict: the same on every rank (the report, or the
    /// first failure of any rank, in which case nothing was committed). See the example on
    /// [`AsyncSaver`].
    pub fn finalize(mut self) -> Result<SaveReport> {
        self.completion.wait();
        if let Some(t) = self.thread.take() {
            t.join().map_err(|_| Error::invalid("the background save thread panicked"))?;
        }
        let taken = self.completion.result.lock().unwrap().take();
        taken.unwrap_or_else(|| Err(Error::invalid("async save finalized twice")))
    }
}

/// A staged piece of the data file: `segments` of the sources laid out back to back.
struct Job {
    data: JobData,
    file_off: u64,
    segments: Vec<Segment>,
}

enum JobData {
    Pooled(PoolBuffer),
    Owned(Vec<u8>),
}

impl JobData {
    fn bytes(&self) -> &[u8] {
        match self {
            JobData::Pooled(b) => b,
            JobData::Owned(v) => v,
        }
    }
}

/// `len` bytes of source `src` starting at `src_off` (a multiple of its checksum block),
/// at `buf_off` in the job's buffer.
struct Segment {
    src: usize,
    src_off: u64,
    buf_off: usize,
    len: usize,
}

impl AsyncSaver {
    /// A saver staging through `pool`, committing over `commit_comm` (see the type's docs).
    pub fn new(pool: Arc<StagingPool>, commit_comm: Arc<dyn Communicator>) -> Self {
        AsyncSaver { pool, commit_comm, last: None }
    }

    /// The staging pool.
    pub fn pool(&self) -> &Arc<StagingPool> {
        &self.pool
    }

    /// True when no save is in flight.
    pub fn is_idle(&self) -> bool {
        self.last.as_ref().is_none_or(|c| c.done.load(Ordering::Acquire))
    }

    /// Starts saving this rank's part of the state. Every rank must call it (collective on
    /// `comm`, like [`crate::save::native::save`]); errors found before writing (invalid sharding, an existing
    /// checkpoint) are returned here, on every rank. Returns once every byte is copied into the
    /// staging pool (for a state larger than the pool, once the last wave is staged); the
    /// caller may then modify its tensors. A save still in flight is waited for first.
    pub fn save(
        &mut self,
        tree: StateTree<'_>,
        storage: Arc<dyn Storage>,
        comm: &dyn Communicator,
        opts: &SaveOptions,
    ) -> Result<AsyncSave> {
        if let Some(prev) = self.last.take() {
            prev.wait();
        }
        let block = opts.block_size;
        let (tree, mut local_error) = apply_factories_collective(tree);
        if comm.rank() != self.commit_comm.rank() || comm.world_size() != self.commit_comm.world_size() {
            local_error.get_or_insert(Error::invalid("the commit communicator must have the same ranks as the save's"));
        }
        if block > self.pool.buffer_size() as u64 {
            local_error.get_or_insert(Error::invalid(format!(
                "checksum block ({block} B) larger than a staging buffer ({} B)",
                self.pool.buffer_size()
            )));
        }
        let (session, bytes) = NativeSession::plan(&tree, local_error, storage.as_ref(), comm, opts)?;
        // A rank without the bytes it was chosen to write reports it at the commit, like a
        // failed write: every rank still takes part in the commit's collectives.
        let checked = session.sources(0, &bytes).map(|_| ());

        let layout = session.layout(0);
        let nt = layout.tensor_entries.len();
        let src_blocks: Vec<u64> = (0..layout.entries.len()).map(|i| if i < nt { block } else { u64::MAX }).collect();
        let file_offs: Vec<u64> = layout.entries.iter().map(|e| layout.header_len + e.start).collect();
        let completion = Arc::new(Completion::default());
        let failed = Arc::new(AtomicBool::new(checked.is_err()));
        let (tx, rx) =
            mpsc::sync_channel::<Job>(self.pool.capacity().div_ceil(self.pool.buffer_size() as u64) as usize);
        let background = Background {
            session,
            storage,
            comm: self.commit_comm.clone(),
            opts: opts.clone(),
            src_blocks,
            failed: failed.clone(),
            checked,
            completion: completion.clone(),
        };
        let thread = std::thread::Builder::new()
            .name("tessera-async-save".into())
            .spawn(move || background.run(rx))
            .map_err(|e| Error::Io { path: "(thread)".into(), source: e })?;

        let sources = (&bytes.tensors[..], &bytes.objects[..]);
        stage(sources, &self.pool, block, &file_offs, &tx, &failed, opts.cancel.as_deref());
        drop(tx);
        self.last = Some(completion.clone());
        Ok(AsyncSave { completion, thread: Some(thread) })
    }
}

/// Copies this rank's bytes into pool buffers, filling each buffer with consecutive sources
/// (the data file holds them back to back). Full buffers are held back until the pool runs
/// dry or everything is staged, and only then handed to the writers: while the caller waits,
/// the copy has the cores to itself; writing starts when it must (a wave) or may (the end).
/// Stops early if the writers failed or the save is cancelled: the verdict will say so.
fn stage(
    (tensor_data, object_data): (&[&[u8]], &[&[u8]]),
    pool: &Arc<StagingPool>,
    block: u64,
    file_offs: &[u64],
    tx: &mpsc::SyncSender<Job>,
    failed: &AtomicBool,
    cancel: Option<&AtomicBool>,
) {
    let stop = || failed.load(Ordering::Relaxed) || cancel.is_some_and(|c| c.load(Ordering::Relaxed));
    let mut held: Vec<Job> = Vec::new();
    let release = |held: &mut Vec<Job>| held.drain(..).all(|j| tx.send(j).is_ok());
    // The buffer being filled: where its first byte goes in the file, and what it holds.
    let mut open: Option<(PoolBuffer, u64, Vec<Segment>)> = None;
    for (src, data) in tensor_data.iter().enumerate() {
        let len = data.len() as u64;
        let mut off = 0u64;
        while off < len {
            if stop() {
                return;
            }
            if open.is_none() {
                let buf = match pool.try_take() {
                    Some(b) => b,
                    None => {
                        if !release(&mut held) {
                            return;
                        }
                        let Some(b) = pool.take(failed) else { return };
                        b
                    }
                };
                open = Some((buf, file_offs[src] + off, Vec::new()));
            }
            let (buf, _, segments) = open.as_mut().expect("set above");
            let used = segments.last().map_or(0, |s| s.buf_off + s.len);
            let room = (buf.len() - used) as u64;
            // A segment starts on a checksum block of its source: a block never spans buffers.
            let take = if len - off <= room { len - off } else { room / block * block };
            if take == 0 {
                let (buf, file_off, segments) = open.take().expect("open");
                held.push(Job { data: JobData::Pooled(buf), file_off, segments });
                continue;
            }
            buf[used..used + take as usize].copy_from_slice(&data[off as usize..(off + take) as usize]);
            segments.push(Segment { src, src_off: off, buf_off: used, len: take as usize });
            off += take;
        }
    }
    if let Some((buf, file_off, segments)) = open.take() {
        held.push(Job { data: JobData::Pooled(buf), file_off, segments });
    }
    let nt = tensor_data.len();
    for (n, data) in object_data.iter().enumerate().filter(|(_, d)| !d.is_empty()) {
        let src = nt + n;
        held.push(Job {
            data: JobData::Owned(data.to_vec()),
            file_off: file_offs[src],
            segments: vec![Segment { src, src_off: 0, buf_off: 0, len: data.len() }],
        });
    }
    release(&mut held);
}

/// Background writers yield the CPU to the training loop (and to ranks still staging): a
/// checkpoint that lands a little later costs nothing, a slower training step does.
fn lower_priority() {
    // SAFETY: gettid takes no arguments, touches no memory of ours and cannot fail.
    let tid = unsafe { libc::syscall(libc::SYS_gettid) } as libc::id_t;
    // SAFETY: integer arguments only, no memory is passed; on failure (e.g. not permitted) the
    // priority stays as it was, which is harmless, so the result is ignored.
    unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, 10) };
}

/// What the background thread owns: everything but the caller's bytes.
struct Background {
    session: NativeSession,
    storage: Arc<dyn Storage>,
    comm: Arc<dyn Communicator>,
    opts: SaveOptions,
    src_blocks: Vec<u64>,
    failed: Arc<AtomicBool>,
    /// Whether the rank has every byte it was chosen to write (see `AsyncSaver::save`).
    checked: Result<()>,
    completion: Arc<Completion>,
}

impl Background {
    fn run(mut self, rx: mpsc::Receiver<Job>) {
        let lease = self.session.lease();
        let storage = self.storage.clone();
        let checked = std::mem::replace(&mut self.checked, Ok(()));
        let verdict = kept_while(lease.as_deref().map(|l| (l, storage.as_ref())), move || {
            let written = match checked {
                Ok(()) => self.write(rx),
                Err(e) => {
                    for _ in rx {}
                    Err(e)
                }
            };
            if written.is_err() {
                self.failed.store(true, Ordering::Relaxed);
            }
            let Background { session, storage, comm, completion, .. } = self;
            let verdict = session.commit(written.map(|w| vec![w]), storage.as_ref(), comm.as_ref());
            (verdict, completion)
        });
        verdict.1.set(verdict.0);
    }

    fn write(&self, rx: mpsc::Receiver<Job>) -> Result<WrittenFile> {
        let layout = self.session.layout(0);
        let drain = |rx: mpsc::Receiver<Job>| for _ in rx {};
        if layout.entries.is_empty() {
            drain(rx);
            return Ok(WrittenFile::default());
        }
        let writer = match self.storage.create(&self.session.file_name(0), layout.size) {
            Ok(w) => w,
            Err(e) => {
                self.failed.store(true, Ordering::Relaxed);
                drain(rx);
                return Err(e);
            }
        };
        let crcs: Vec<Mutex<Vec<u32>>> = layout
            .entries
            .iter()
            .zip(&self.src_blocks)
            .map(|(e, &b)| Mutex::new(vec![0u32; e.len.div_ceil(b) as usize]))
            .collect();
        let rx = Mutex::new(rx);
        let first_error: Mutex<Option<Error>> = Mutex::new(None);
        let workers = self.opts.threads.max(1);
        std::thread::scope(|s| {
            for _ in 0..workers {
                s.spawn(|| {
                    lower_priority();
                    loop {
                        let Ok(job) = rx.lock().unwrap().recv() else { return };
                        if self.failed.load(Ordering::Relaxed) {
                            continue;
                        }
                        if self.opts.cancel.as_deref().is_some_and(|c| c.load(Ordering::Relaxed)) {
                            first_error.lock().unwrap().get_or_insert(Error::Cancelled);
                            self.failed.store(true, Ordering::Relaxed);
                            continue;
                        }
                        if let Err(e) = self.write_job(writer.as_ref(), &job, &crcs) {
                            first_error.lock().unwrap().get_or_insert(e);
                            self.failed.store(true, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        if let Some(e) = first_error.into_inner().unwrap() {
            return Err(e);
        }
        if self.opts.cancel.as_deref().is_some_and(|c| c.load(Ordering::Relaxed)) {
            return Err(Error::Cancelled);
        }
        let crcs: Vec<Vec<u32>> = crcs.into_iter().map(|m| m.into_inner().unwrap()).collect();
        self.session.finish_file(0, writer, crcs)
    }

    fn write_job(&self, writer: &dyn ObjectWriter, job: &Job, crcs: &[Mutex<Vec<u32>>]) -> Result<()> {
        let bytes = job.data.bytes();
        let end = job.segments.last().map_or(0, |s| s.buf_off + s.len);
        for seg in &job.segments {
            let block = self.src_blocks[seg.src];
            let data = &bytes[seg.buf_off..seg.buf_off + seg.len];
            let local: Vec<u32> = if block == u64::MAX {
                vec![crate::model::crc::crc32c(data)]
            } else {
                data.chunks(block as usize).map(crate::model::crc::crc32c).collect()
            };
            let first = if block == u64::MAX { 0 } else { (seg.src_off / block) as usize };
            crcs[seg.src].lock().unwrap()[first..first + local.len()].copy_from_slice(&local);
        }
        writer.write_at(job.file_off, &bytes[..end])
    }
}
