//! Conversion of any readable checkpoint (every format a load strategy recognises) into the
//! native format, keeping its chunk structure.
//!
//! Each stored chunk of the source becomes a native chunk with the same box (or flat range);
//! a chunk larger than a job's share of the memory budget is cut into several valid chunks
//! ([`split_box`]). Chunks are read through the generic loader, several per load call, on a
//! background thread while the previous ones are written; the data files, their headers and
//! checksums, and the commit of the index are those of a native save (shared code in
//! `io/save.rs` and `io/write.rs`).

use std::collections::HashMap;
use std::sync::Arc;

use crate::comm::SoloComm;
use crate::error::{Error, Result};
use crate::format::{CheckpointIndex, ObjectEntry, StoredObject, DEFAULT_BLOCK_SIZE};
use crate::load::engine::{read_object, LoadOptions};
use crate::load::open::{detect_format, open_checkpoint};
use crate::plan::geometry::split_box_lazy;
use crate::plan::save::{validate_global_with, ObjectMeta, RankPlan, ShardMeta, WrittenFile};
use crate::save::lease::kept_while;
use crate::save::native::NativeSession;
use crate::save::write::{write_sources, Source};
use crate::storage::{ObjectWriter, Storage};
use crate::threads::on_cores;
use crate::tools::pipeline::{
    batches, check_memory_budget, job_bytes, load_parts, pipeline, TensorPart, DEFAULT_MEMORY_BUDGET,
};

/// How to convert.
#[derive(Debug, Clone)]
pub struct ConvertOptions {
    /// Replace a committed checkpoint at the destination (atomically, at commit).
    pub overwrite: bool,
    /// About the most bytes of data held in memory at once (default 512 MiB); chunks larger
    /// than a quarter of it are split.
    pub memory_budget: u64,
    /// IO threads (reads and writes).
    pub threads: usize,
    /// Checksum block size of the native checkpoint.
    pub block_size: u64,
    /// Chunks are packed into data files of about this size (a new file starts when the next
    /// chunk would pass it). Default 4 GiB.
    pub max_file_size: u64,
}

impl Default for ConvertOptions {
    fn default() -> Self {
        ConvertOptions {
            overwrite: false,
            memory_budget: DEFAULT_MEMORY_BUDGET,
            threads: crate::threads::default_threads(),
            block_size: DEFAULT_BLOCK_SIZE,
            max_file_size: 4 << 30,
        }
    }
}

/// What a conversion wrote.
#[derive(Debug, Clone, Default)]
pub struct ConvertReport {
    /// Tensors converted.
    pub tensors: usize,
    /// Chunks of the native checkpoint.
    pub chunks: usize,
    /// Object shards converted.
    pub object_shards: usize,
    /// Data files written.
    pub files: usize,
    /// Bytes of tensor and object data written.
    pub bytes: u64,
    /// Size of the index.
    pub index_bytes: u64,
    /// Files left for `tessera gc` (see [`SaveReport::leftovers`](crate::SaveReport::leftovers)).
    pub leftovers: Vec<String>,
}

/// One thing to copy: a (part of a) stored chunk, or an object shard.
enum Item<'i> {
    Chunk(TensorPart<'i>),
    Object(&'i ObjectEntry, &'i StoredObject),
}

impl Item<'_> {
    fn nbytes(&self) -> u64 {
        match self {
            Item::Chunk(p) => p.nbytes(),
            Item::Object(_, s) => s.len,
        }
    }
}

/// Where an item goes: its data file and its entry in that file's layout.
#[derive(Clone, Copy)]
struct Slot {
    file: usize,
    entry: usize,
}

/// Refuses a destination that holds a committed checkpoint of any format a load strategy
/// recognises (native index, DCP `.metadata`, Megatron `metadata.json`, OLMo-core's), or of a
/// version this build cannot read: converting there would shadow it, or (native) replace it.
fn refuse_committed(dst: &dyn Storage) -> Result<()> {
    match detect_format(dst) {
        Ok(_) | Err(Error::IncompatibleVersion { .. }) => Err(Error::AlreadyExists { path: dst.location().into() }),
        Err(Error::NotFound { .. } | Error::NotCommitted { .. }) => Ok(()),
        Err(e) => Err(e),
    }
}
/// Most chunks a conversion adds by splitting the source's chunks to the memory budget (each
/// is a planned chunk, then an index record): the source's own chunks are as many as its
/// index holds, and only a claimed shape far larger than its bytes splits into more.
const MAX_EXTRA_PARTS: u64 = 1 << 20;

/// Copies the checkpoint in `src` (any format [`open`](crate::open) recognises) into `dst` as
/// a native checkpoint: the same tensors with the same chunks (large ones split), the sharded
/// objects' bytes, the common state and the content metadata. Refused with
/// [`Error::AlreadyExists`] if `dst` holds a committed checkpoint of any format (native or
/// foreign: it would be replaced or shadowed), unless `opts.overwrite`; the index is then
/// committed as a save commits it (create-if-absent unless overwriting, by the one commit
/// protocol): a conversion that fails commits nothing and removes its data files.
/// `progress(bytes_done, bytes_total)` is called as data is written.
///
/// ```
/// use tessera::{open, SaveOptions};
/// use tessera::tools::{convert, ConvertOptions};
/// use tessera::torch_dist::save_torch_dist;
/// use tessera::{DType, ShardedTensor, StateTree, TensorData};
/// use tessera::comm::SoloComm;
/// use tessera::storage::MemoryStorage;
///
/// // A Megatron torch_dist checkpoint...
/// let (src, dst) = (MemoryStorage::new(), MemoryStorage::new());
/// let w = ShardedTensor::full("w", DType::U8, &[2, 3], TensorData::Owned(vec![1, 2, 3, 4, 5, 6]));
/// let tree = StateTree::map().with("w", StateTree::Tensor(w));
/// save_torch_dist(tree, None, &src, &SoloComm, &SaveOptions::default(), 1)?;
///
/// // ...copied as a native one: the same tensors.
/// let report = convert(&src, &dst, &ConvertOptions::default(), &mut |_done, _total| {})?;
/// assert_eq!((report.tensors, report.bytes), (1, 6));
/// let ckpt = open(&dst)?;
/// assert_eq!(ckpt.format().backend, tessera::index::Backend::Tessera);
/// assert_eq!(ckpt.read_tensors(None)?, open(&src)?.read_tensors(None)?);
/// # Ok::<(), tessera::Error>(())
/// ```
pub fn convert(
    src: &dyn Storage,
    dst: &dyn Storage,
    opts: &ConvertOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<ConvertReport> {
    if opts.block_size == 0 {
        return Err(Error::invalid("block size must be positive"));
    }
    if !opts.overwrite {
        refuse_committed(dst)?;
    }
    let ckpt = open_checkpoint(src)?;
    check_memory_budget(opts.memory_budget, &ckpt.index, &src.location())?;
    let src = ckpt.storage();
    let mut index = ckpt.index.clone();
    if index.block_size == 0 {
        // Foreign formats learn an object's payload size only by decoding it (cached by the view);
        // each shard is a whole virtual file.
        for o in &mut index.objects {
            for s in &mut o.shards {
                let f = &mut index.files[s.file as usize];
                s.len = src.size(&f.name)?;
                f.size = s.len;
            }
        }
    }
    let per_job = job_bytes(opts.memory_budget);

    // Chunks in the order of the source's files (sequential reads), then object shards.
    // Every part becomes a chunk of the new index, so all are made: their number is counted
    // first (without making them), and a source whose chunks would split into more parts than
    // a plan can hold is refused before anything is allocated for them.
    let mut nparts = 0u64;
    for t in &index.tensors {
        let max_numel = per_job / t.dtype.size() as u64;
        for c in t.chunks() {
            nparts = nparts.saturating_add(split_box_lazy(&c.offset, &c.shape, c.flat, max_numel).count_parts());
            if nparts > MAX_EXTRA_PARTS.saturating_add(index.chunk_count() as u64) {
                return Err(Error::invalid(format!(
                    "{}: tensor {:?} (shape {:?}) and those before it would be cut into {MAX_EXTRA_PARTS} \
                     chunks of at most {per_job} bytes more than the source holds; raise the memory budget",
                    src.location(),
                    t.key,
                    t.global_shape
                )));
            }
        }
    }
    let mut chunks: Vec<(u32, u64, TensorPart<'_>)> = Vec::with_capacity(nparts as usize);
    for t in &index.tensors {
        let max_numel = per_job / t.dtype.size() as u64;
        for c in t.chunks() {
            for part in split_box_lazy(&c.offset, &c.shape, c.flat, max_numel) {
                chunks.push((c.file, c.byte_offset, TensorPart { tensor: t, part }));
            }
        }
    }
    chunks.sort_by_key(|(file, off, _)| (*file, *off));
    let mut items: Vec<Item<'_>> = chunks.into_iter().map(|(_, _, p)| Item::Chunk(p)).collect();
    for o in &index.objects {
        items.extend(o.shards.iter().map(|s| Item::Object(o, s)));
    }

    // Data files: items packed in order; each file's plan is what a rank of a save announces.
    let keys: HashMap<&str, Arc<str>> =
        index.tensors.iter().map(|t| (t.key.as_str(), Arc::from(t.key.as_str()))).collect();
    let mut plans: Vec<RankPlan> = Vec::new();
    let mut slots: Vec<Slot> = Vec::with_capacity(items.len());
    let mut used = 0u64;
    for item in &items {
        let n = item.nbytes();
        if plans.is_empty() || (used > 0 && used + n > opts.max_file_size) {
            plans.push(RankPlan::default());
            used = 0;
        }
        used += n;
        let file = plans.len() - 1;
        let plan = plans.last_mut().expect("pushed above");
        let entry = plan.tensors.len() + plan.objects.len();
        match item {
            Item::Chunk(p) => plan.tensors.push(ShardMeta {
                key: keys[p.tensor.key.as_str()].clone(),
                dtype: p.tensor.dtype,
                global_shape: p.tensor.global_shape.as_slice().into(),
                offset: p.part.off.as_slice().into(),
                shape: p.part.shape.as_slice().into(),
                flat: p.part.flat,
                main: true,
                has_data: true,
            }),
            Item::Object(o, s) => plan.objects.push(ObjectMeta {
                key: o.key.clone(),
                global_shape: o.global_shape.clone(),
                offset: s.offset.clone(),
                main: true,
                len: s.len,
            }),
        }
        slots.push(Slot { file, entry });
    }
    // Tensors without stored chunks (no elements) keep their entry: announced, not written.
    for t in index.tensors.iter().filter(|t| t.chunks().is_empty()) {
        if plans.is_empty() {
            plans.push(RankPlan::default());
        }
        plans.last_mut().expect("pushed above").tensors.push(ShardMeta {
            key: keys[t.key.as_str()].clone(),
            dtype: t.dtype,
            global_shape: t.global_shape.as_slice().into(),
            offset: vec![0; t.global_shape.len()].as_slice().into(),
            shape: t.global_shape.as_slice().into(),
            flat: None,
            main: false,
            has_data: false,
        });
    }
    validate_global_with(&plans, &on_cores)?;
    let session = NativeSession::of_plans(
        plans,
        dst,
        opts.block_size,
        opts.overwrite,
        index.common.clone(),
        index.content_metadata.clone(),
    )?;
    let lease = session.lease();
    let report = kept_while(lease.as_deref().map(|l| (l, dst)), || {
        let written = write_files(src, dst, &index, &items, &slots, &session, opts, progress);
        session.commit(written, dst, &SoloComm)
    })?;
    Ok(ConvertReport {
        tensors: index.tensors.len(),
        chunks: report.chunks,
        object_shards: index.objects.iter().map(|o| o.shards.len()).sum(),
        files: report.files,
        bytes: items.iter().map(Item::nbytes).sum(),
        index_bytes: report.index_bytes,
        leftovers: report.leftovers,
    })
}

/// A data file being written.
struct Open {
    file: usize,
    writer: Box<dyn ObjectWriter>,
    crcs: Vec<Vec<u32>>,
}

/// Streams every item into its data file of `session`; returns the written files, in file order
/// (an empty report for a file with nothing to write).
#[allow(clippy::too_many_arguments)]
fn write_files(
    src: &dyn Storage,
    dst: &dyn Storage,
    index: &CheckpointIndex,
    items: &[Item<'_>],
    slots: &[Slot],
    session: &NativeSession,
    opts: &ConvertOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<Vec<WrittenFile>> {
    let costs: Vec<u64> = items.iter().map(Item::nbytes).collect();
    let total: u64 = costs.iter().sum();
    // A batch is loaded with one call: only chunks or only objects, and within one data file.
    let is_object = |i: usize| matches!(items[i], Item::Object(..));
    let jobs = batches(&costs, job_bytes(opts.memory_budget), |i| {
        slots[i].file != slots[i - 1].file || is_object(i) != is_object(i - 1)
    });
    let load_opts = LoadOptions { threads: opts.threads, ..Default::default() };

    let read = |job: &std::ops::Range<usize>| -> Result<Vec<u8>> {
        let batch = &items[job.clone()];
        let mut buf = vec![0u8; costs[job.clone()].iter().sum::<u64>() as usize];
        if is_object(job.start) {
            let mut at = 0;
            for item in batch {
                let Item::Object(entry, s) = item else { continue };
                let data = read_object(index, src, &entry.key, &s.offset, true)?;
                if data.len() as u64 != s.len {
                    return Err(Error::corrupt(
                        src.location(),
                        format!(
                            "object {:?} shard {:?}: {} bytes read, {} indexed",
                            entry.key,
                            s.offset,
                            data.len(),
                            s.len
                        ),
                    ));
                }
                buf[at..at + data.len()].copy_from_slice(&data);
                at += data.len();
            }
        } else {
            let parts: Vec<&TensorPart<'_>> =
                batch.iter().filter_map(|i| if let Item::Chunk(p) = i { Some(p) } else { None }).collect();
            load_parts(index, src, &parts, &mut buf, &load_opts)?;
        }
        Ok(buf)
    };

    let mut written: Vec<WrittenFile> = Vec::with_capacity(session.files());
    let mut open: Option<Open> = None;
    let mut done = 0u64;
    let finish = |o: Open, written: &mut Vec<WrittenFile>| -> Result<()> {
        // Files with nothing in them come before (only tensors without chunks).
        while written.len() < o.file {
            written.push(WrittenFile::default());
        }
        written.push(session.finish_file(o.file, o.writer, o.crcs)?);
        Ok(())
    };
    progress(0, total);
    let mut write = |job: &std::ops::Range<usize>, data: Vec<u8>| -> Result<()> {
        let file = slots[job.start].file;
        if open.as_ref().is_none_or(|o| o.file != file) {
            if let Some(o) = open.take() {
                finish(o, &mut written)?;
            }
            let layout = session.layout(file);
            open = Some(Open {
                file,
                writer: dst.create(&session.file_name(file), layout.size)?,
                crcs: vec![Vec::new(); layout.entries.len()],
            });
        }
        let o = open.as_mut().expect("opened above");
        let layout = session.layout(file);
        let mut sources = Vec::with_capacity(job.len());
        let mut at = 0usize;
        for i in job.clone() {
            let len = costs[i] as usize;
            sources.push(Source {
                data: &data[at..at + len],
                file_off: layout.header_len + layout.entries[slots[i].entry].start,
                block: if is_object(i) { u64::MAX } else { opts.block_size },
            });
            at += len;
        }
        let crcs = write_sources(o.writer.as_ref(), &sources, opts.threads, dst.is_local(), None)?;
        for (i, c) in job.clone().zip(crcs) {
            o.crcs[slots[i].entry] = c;
        }
        done += at as u64;
        progress(done, total);
        Ok(())
    };
    pipeline(jobs.iter().cloned(), opts.memory_budget, |j| costs[j.clone()].iter().sum(), read, &mut write)?;
    if let Some(o) = open.take() {
        finish(o, &mut written)?;
    }
    // A plan with nothing to write (only tensors without chunks, or an empty checkpoint).
    while written.len() < session.files() {
        written.push(WrittenFile::default());
    }
    Ok(written)
}
