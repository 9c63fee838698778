//! Export of the tensors of any readable checkpoint as plain Hugging Face safetensors files
//! (one file, or shards with a `model.safetensors.index.json`), streamed with bounded memory.
//!
//! The headers come from the index (shapes, dtypes) before any data is read; then each tensor
//! is loaded as groups of rows (sub-boxes along axis 0, [`split_box`]) through the generic
//! loader, so a tensor larger than the memory budget is never held whole. A background thread
//! reads (and casts) the next slices while the calling thread writes the previous ones.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value as J};

use crate::error::{Error, Result};
use crate::format::{build_header, SafetensorsEntry, TensorEntry, SAFETENSORS_ALIGN};
use crate::load::engine::LoadOptions;
use crate::load::open::open_checkpoint;
use crate::model::dtype::{cast_into, DType};
use crate::plan::geometry::split_box_lazy;
use crate::save::outfile;
use crate::save::safetensors::{single_file_path, ExportFile, ExportFs, LocalFs, SafetensorsExport};
use crate::storage::Storage;
use crate::tools::pipeline::{
    batched, check_memory_budget, job_bytes, load_parts, pipeline, TensorPart, DEFAULT_MEMORY_BUDGET,
};

/// How to export.
#[derive(Debug, Clone)]
pub struct ExportOptions {
    /// Export only these tensors (exact keys; every one must exist). `None`: every tensor.
    pub keys: Option<Vec<String>>,
    /// Cast floating-point tensors (f64, f32, f16, bf16) to this type, which must be one of
    /// those four; fp8, integer and bool tensors are written unchanged.
    pub dtype: Option<DType>,
    /// Shard the output: `out` is then a directory that receives
    /// `model-00001-of-0000N.safetensors`, … and `model.safetensors.index.json`. Tensors are
    /// packed in key order, a new file starting when the next tensor would pass this size; a
    /// tensor larger than it gets a file of its own. `None`: one file, `out` itself, or
    /// `out/model.safetensors` when `out` is a directory (one that exists, or a path ending
    /// with a separator, `hf/`: the directory is created).
    pub max_shard_size: Option<u64>,
    /// About the most bytes of tensor data held in memory at once (default 512 MiB).
    pub memory_budget: u64,
    /// IO threads of the reads.
    pub threads: usize,
    /// Key prefixes to rename, `(from, to)`: a key starting with `from` is written as `to`
    /// followed by the rest of the key (an empty `to` strips the prefix), by the first rule
    /// that matches, e.g. to produce a Hugging Face layout. Two keys that end up with one name
    /// are refused, naming both.
    pub rename: Vec<(String, String)>,
}

impl Default for ExportOptions {
    fn default() -> Self {
        ExportOptions {
            keys: None,
            dtype: None,
            max_shard_size: None,
            memory_budget: DEFAULT_MEMORY_BUDGET,
            threads: crate::threads::default_threads(),
            rename: Vec::new(),
        }
    }
}

/// `key` as [`ExportOptions::rename`] names it in the output.
fn renamed(key: &str, rules: &[(String, String)]) -> String {
    for (from, to) in rules {
        if let Some(rest) = key.strip_prefix(from.as_str()) {
            return format!("{to}{rest}");
        }
    }
    key.to_string()
}

/// What an export wrote.
#[derive(Debug, Clone, Default)]
pub struct ExportReport {
    /// Tensors exported.
    pub tensors: usize,
    /// Bytes of tensor data written (after casting).
    pub bytes: u64,
    /// The safetensors files written, in order.
    pub files: Vec<PathBuf>,
    /// The index written next to them (sharded exports only).
    pub index: Option<PathBuf>,
    /// Temporary files beside the output that could not be removed (hidden names
    /// `.NAME.tmp-…`): the export is complete; remove them. Empty as a rule.
    pub leftovers: Vec<PathBuf>,
}

/// One tensor of the export.
struct Out<'i> {
    entry: &'i TensorEntry,
    /// Its name in the output.
    name: String,
    dtype: DType,
    file: usize,
}

impl Out<'_> {
    fn nbytes(&self) -> u64 {
        self.entry.global_shape.iter().product::<u64>() * self.dtype.size() as u64
    }
}

/// Writes the tensors of the checkpoint in `src` as safetensors (see [`ExportOptions`]): a
/// header with `__metadata__ = {"format": "pt"}` and the tensors in sorted key order, each with
/// its global shape, C-contiguous. Every file is written under a new temporary name in its final
/// directory (created exclusively: nothing already there is opened or followed) and renamed
/// into place once all are complete; an existing regular file of the same name is replaced.
/// An unsharded export into a directory (existing, or `out` ending with a separator) writes
/// `model.safetensors` there. Refused ([`Error::InvalidArgument`], naming the path) before anything is written: an output
/// that is the source checkpoint's directory or inside it, and an output name that exists as
/// anything but a regular file (directory, symlink, FIFO, device node). `progress(bytes_done,
/// bytes_total)` is called as data is written.
///
/// ```
/// use tessera::{open, save, SaveOptions};
/// use tessera::tools::{export_safetensors, ExportOptions};
/// use tessera::{DType, ShardedTensor, StateTree, TensorData};
/// use tessera::comm::SoloComm;
/// use tessera::storage::MemoryStorage;
///
/// let storage = MemoryStorage::new();
/// let w: Vec<u8> = [1.0f32, 2.0].iter().flat_map(|x| x.to_le_bytes()).collect();
/// let t = ShardedTensor::full("model.w", DType::F32, &[2], TensorData::Owned(w));
/// save(StateTree::map().with("model.w", StateTree::Tensor(t)), &storage, &SoloComm, &SaveOptions::default())?;
///
/// let out = std::env::temp_dir().join(format!("tessera-doc-export-{}.safetensors", std::process::id()));
/// let rename = vec![("model.".into(), "".into())];
/// let opts = ExportOptions { dtype: Some(DType::BF16), rename, ..ExportOptions::default() };
/// let report = export_safetensors(&storage, &out, &opts, &mut |_done, _total| {})?;
/// assert_eq!(report.files, [out.clone()]);
///
/// // A plain safetensors file, which tessera opens too: bf16 1.0 and 2.0, renamed.
/// let file = tessera::storage::Location::parse(out.to_str().unwrap()).open()?;
/// let ckpt = open(&*file)?;
/// let (format, tensors) = (ckpt.format().backend.clone(), ckpt.read_tensors(None)?);
/// std::fs::remove_file(&out).unwrap();
/// assert_eq!(format, tessera::index::Backend::Safetensors);
/// assert_eq!(tensors["w"].data, [0x80, 0x3f, 0x00, 0x40]);
/// # Ok::<(), tessera::Error>(())
/// ```
pub fn export_safetensors(
    src: &dyn Storage,
    out: &Path,
    opts: &ExportOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<ExportReport> {
    export_with(src, out, opts, progress, &LocalFs)
}

/// [`export_safetensors`] with its file operations through `fs` (tests fail them one by one).
#[doc(hidden)]
pub fn export_with(
    src: &dyn Storage,
    out: &Path,
    opts: &ExportOptions,
    progress: &mut dyn FnMut(u64, u64),
    fs: &dyn ExportFs,
) -> Result<ExportReport> {
    let single;
    let out = match opts.max_shard_size {
        None => {
            single = single_file_path(out)?;
            single.as_ref()
        }
        Some(_) => out,
    };
    outfile::check_outside(out, &src.location())?;
    let ckpt = open_checkpoint(src)?;
    check_memory_budget(opts.memory_budget, &ckpt.index, &src.location())?;
    let (index, src) = (&ckpt.index, ckpt.storage());
    if let Some(d) = opts.dtype {
        if !d.is_castable() {
            return Err(Error::invalid(format!("cannot export as {d}: the target type must be f64, f32, f16 or bf16")));
        }
    }
    let selected: Vec<&TensorEntry> = match &opts.keys {
        None => index.tensors.iter().collect(),
        Some(keys) => {
            let mut keys: Vec<&String> = keys.iter().collect();
            keys.sort();
            keys.dedup();
            keys.into_iter()
                .map(|k| index.tensor(k).ok_or_else(|| Error::not_found(format!("{}: tensor {k:?}", src.location()))))
                .collect::<Result<_>>()?
        }
    };
    if selected.is_empty() {
        return Err(Error::invalid(format!("{}: no tensors to export", src.location())));
    }
    if opts.max_shard_size == Some(0) {
        return Err(Error::invalid("the maximum shard size must be positive"));
    }

    // Output names, in the sorted order safetensors files list them.
    let mut named: Vec<(String, &TensorEntry)> =
        selected.into_iter().map(|e| (renamed(&e.key, &opts.rename), e)).collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    if let Some(w) = named.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(Error::invalid(format!(
            "renaming gives tensors {:?} and {:?} of {} the same name {:?}",
            w[0].1.key,
            w[1].1.key,
            src.location(),
            w[0].0
        )));
    }
    if let Some((name, e)) = named.iter().find(|(n, _)| n.is_empty()) {
        return Err(Error::invalid(format!("renaming leaves tensor {:?} without a name {name:?}", e.key)));
    }

    // Tensors, packed into files.
    let mut tensors: Vec<Out<'_>> = Vec::with_capacity(named.len());
    let mut file_bytes: Vec<u64> = Vec::new();
    for (name, entry) in named {
        let dtype = match opts.dtype {
            Some(d) if entry.dtype.is_castable() => d,
            _ => entry.dtype,
        };
        let mut t = Out { entry, name, dtype, file: 0 };
        let n = t.nbytes();
        let start_new = match (opts.max_shard_size, file_bytes.last()) {
            (_, None) => true,
            (Some(limit), Some(&used)) => used > 0 && used + n > limit,
            (None, Some(_)) => false,
        };
        if start_new {
            file_bytes.push(0);
        }
        t.file = file_bytes.len() - 1;
        *file_bytes.last_mut().expect("pushed above") += n;
        tensors.push(t);
    }
    let nfiles = file_bytes.len();
    let names =
        opts.max_shard_size.map(|_| (1..=nfiles).map(|i| format!("model-{i:05}-of-{nfiles:05}.safetensors")).collect());
    let mut headers: Vec<Vec<u8>> = Vec::with_capacity(nfiles);
    for f in 0..nfiles {
        let mut entries = Vec::new();
        let mut start = 0;
        for t in tensors.iter().filter(|t| t.file == f) {
            let len = t.nbytes();
            entries.push(SafetensorsEntry {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.entry.global_shape.clone(),
                start,
                len,
            });
            start += len;
        }
        let mut meta = Map::new();
        meta.insert("format".into(), J::String("pt".into()));
        headers.push(build_header(&entries, &meta, SAFETENSORS_ALIGN));
    }
    let weight_map: Vec<(String, usize)> = tensors.iter().map(|t| (t.name.clone(), t.file)).collect();
    let total: u64 = file_bytes.iter().sum();
    let session = SafetensorsExport::plan(fs, out, names, headers, &weight_map, total)?;
    let written = write_files(src, index, &tensors, &session, opts, progress);
    let done = session.commit(written)?;
    Ok(ExportReport {
        tensors: tensors.len(),
        bytes: total,
        files: done.files,
        index: done.index,
        leftovers: done.leftovers,
    })
}

/// A batch of parts loaded with one call: (tensor, part of it).
type Job<'i> = Vec<(usize, TensorPart<'i>)>;

/// Streams every tensor into the temporary files, in order.
fn write_files(
    src: &dyn Storage,
    index: &crate::format::CheckpointIndex,
    tensors: &[Out<'_>],
    session: &SafetensorsExport<'_>,
    opts: &ExportOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<()> {
    // Slices of rows, each costing at most a job's share of the budget (source bytes, plus the
    // cast copy when there is one), made as the reader gets to them: never all at once.
    let per_job = job_bytes(opts.memory_budget);
    let cost_of = |(i, p): &(usize, TensorPart<'_>)| {
        let t = &tensors[*i];
        p.nbytes() + if t.dtype != t.entry.dtype { p.part.numel() * t.dtype.size() as u64 } else { 0 }
    };
    let parts = tensors.iter().enumerate().flat_map(move |(i, t)| {
        let e = t.entry;
        let elem_cost = (e.dtype.size() + if t.dtype != e.dtype { t.dtype.size() } else { 0 }) as u64;
        let zeros = vec![0; e.global_shape.len()];
        split_box_lazy(&zeros, &e.global_shape, None, per_job / elem_cost)
            .map(move |part| (i, TensorPart { tensor: e, part }))
    });
    let jobs = batched(parts, per_job, cost_of);
    let load_opts = LoadOptions { threads: opts.threads, ..Default::default() };
    let total: u64 = tensors.iter().map(Out::nbytes).sum();
    let mut done = 0u64;
    let mut current: Option<(usize, ExportFile)> = None;
    progress(0, total);

    let read = |batch: &Job<'_>| -> Result<Vec<u8>> {
        let refs: Vec<&TensorPart<'_>> = batch.iter().map(|(_, p)| p).collect();
        let mut buf = vec![0u8; refs.iter().map(|p| p.nbytes()).sum::<u64>() as usize];
        load_parts(index, src, &refs, &mut buf, &load_opts)?;
        if batch.iter().all(|(i, _)| tensors[*i].dtype == tensors[*i].entry.dtype) {
            return Ok(buf);
        }
        let out_len: u64 = batch.iter().map(|(i, p)| p.part.numel() * tensors[*i].dtype.size() as u64).sum();
        let mut out = vec![0u8; out_len as usize];
        let (mut at_in, mut at_out) = (0usize, 0usize);
        for (i, p) in batch {
            let t = &tensors[*i];
            let n = p.part.numel() as usize;
            let (len_in, len_out) = (n * t.entry.dtype.size(), n * t.dtype.size());
            cast_into(&buf[at_in..at_in + len_in], t.entry.dtype, t.dtype, &mut out[at_out..at_out + len_out])?;
            at_in += len_in;
            at_out += len_out;
        }
        Ok(out)
    };
    let mut write = |job: &Job<'_>, data: Vec<u8>| -> Result<()> {
        let mut at = 0usize;
        for (i, p) in job {
            let t = &tensors[*i];
            if current.as_ref().is_none_or(|(f, _)| *f != t.file) {
                if let Some((_, w)) = current.take() {
                    session.finish_file(w)?;
                }
                current = Some((t.file, session.open_file(t.file)?));
            }
            let len = (p.part.numel() * t.dtype.size() as u64) as usize;
            let (_, w) = current.as_mut().expect("opened above");
            w.write(&data[at..at + len])?;
            at += len;
        }
        done += at as u64;
        progress(done, total);
        Ok(())
    };
    pipeline(jobs, opts.memory_budget, |j| j.iter().map(cost_of).sum(), read, &mut write)?;
    if let Some((_, w)) = current.take() {
        session.finish_file(w)?;
    }
    Ok(())
}
