//! `tessera._native`: the Python bindings of tessera. Thin by design: conversions (`convert`),
//! error mapping (`errors`), the Python communicator (`comm`) and GIL handling; every decision
//! is the library's. The GIL is released around every call into the library.
//!
//! Tensors and objects are handed over as typed values (`SaveTensor`, `LoadTensor`,
//! `SaveObject`, `LoadObject`: `convert`, `python/tessera/_native.pyi`) and put in a flat state tree under a reserved top-level key, indexed by position, so results
//! map back to the caller's lists by position; the Python layer keeps its own structure.

mod async_save;
mod comm;
mod convert;
mod errors;
mod location;
mod manager;
mod plan_cache;
mod torch_dist;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};
use tessera::comm::SoloComm;
use tessera::{Communicator, LoadOptions, PathSeg, SaveOptions, ShardedObject, StateTree, Storage, StrictHandling};

use crate::comm::PyComm;
use crate::convert::{common_to_py, value_from_py, value_to_py, LoadObject, LoadTensor, SaveObject, SaveTensor};
use crate::errors::{invalid_argument, to_pyerr};
use crate::location::LocationArg;

/// Top-level key of the tree under which the tensors and objects of a call live; the common
/// values of `save` take the other top-level keys.
const ROOT: &str = "__tessera_native__";

fn tensor_slot(i: usize) -> String {
    format!("t{i:08}")
}

fn object_slot(i: usize) -> String {
    format!("o{i:08}")
}

/// Runs `work` without the GIL on a helper thread while this thread watches for signals:
/// on Ctrl-C the library is asked to stop (`cancel`), and once it has, the KeyboardInterrupt
/// is raised here. Signals are only delivered to Python's main thread, so from other threads
/// this is a plain blocking call.
fn interruptible<T: Send>(py: Python<'_>, cancel: &AtomicBool, work: impl FnOnce() -> T + Send) -> PyResult<T> {
    let mut interrupt: Option<PyErr> = None;
    let out = py.detach(|| {
        std::thread::scope(|scope| {
            let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
            let worker = scope.spawn(move || {
                let out = work();
                let _ = done_tx.send(());
                out
            });
            while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = done_rx.recv_timeout(SIGNAL_POLL) {
                if interrupt.is_none() {
                    if let Err(e) = Python::attach(|py| py.check_signals()) {
                        cancel.store(true, Ordering::Relaxed);
                        interrupt = Some(e);
                    }
                }
            }
            worker.join()
        })
    });
    match (interrupt, out) {
        (Some(e), _) => Err(e),
        (None, Ok(out)) => Ok(out),
        (None, Err(panic)) => std::panic::resume_unwind(panic),
    }
}

const SIGNAL_POLL: std::time::Duration = std::time::Duration::from_millis(50);

/// A library result as a Python result.
fn lib<T>(py: Python<'_>, result: tessera::Result<T>) -> PyResult<T> {
    result.map_err(|e| to_pyerr(py, e))
}

fn open(py: Python<'_>, location: &LocationArg) -> PyResult<Arc<dyn Storage>> {
    // Opening may wait up to a second on an instance-metadata service: without the GIL.
    lib(py, py.detach(|| location.open()))
}

fn communicator(comm: Option<&Bound<'_, PyAny>>) -> PyResult<Box<dyn Communicator>> {
    Ok(match comm {
        Some(obj) if !obj.is_none() => Box::new(PyComm::new(obj)?),
        _ => Box::new(SoloComm),
    })
}

/// The tree of a call: `ROOT -> {t<i>: tensor, o<i>: object}`.
fn slots<'a>(tensors: Vec<tessera::ShardedTensor<'a>>, objects: Vec<ShardedObject>) -> StateTree<'a> {
    let mut inner = BTreeMap::new();
    for (i, t) in tensors.into_iter().enumerate() {
        inner.insert(tensor_slot(i), StateTree::Tensor(t));
    }
    for (i, o) in objects.into_iter().enumerate() {
        inner.insert(object_slot(i), StateTree::Object(o));
    }
    StateTree::map().with(ROOT, StateTree::Map(inner))
}

fn each<'py, T>(items: &[Bound<'py, PyAny>], f: impl Fn(&Bound<'py, PyAny>, usize) -> PyResult<T>) -> PyResult<Vec<T>> {
    items.iter().enumerate().map(|(i, x)| f(x, i)).collect()
}

fn objects_to_save(py: Python<'_>, objects: &[Bound<'_, SaveObject>]) -> Vec<ShardedObject> {
    objects.iter().map(|o| o.get().object(py)).collect()
}

/// The tree and options of a save call (sync or async).
///
/// # Safety
/// The tree borrows the memory of every tensor: the Python caller keeps it alive, C-contiguous
/// and unmodified until the save call returns (an async save has copied it by then); the tree
/// must be dropped before that.
#[allow(clippy::too_many_arguments)]
unsafe fn save_request<'py, 't>(
    py: Python<'py>,
    tensors: &[Bound<'py, SaveTensor>],
    objects: &[Bound<'py, SaveObject>],
    common: &[Bound<'py, PyAny>],
    overwrite: bool,
    validate: bool,
    content_metadata: Option<&Bound<'py, PyAny>>,
    threads: Option<usize>,
) -> PyResult<(StateTree<'t>, SaveOptions, Arc<AtomicBool>)> {
    let specs = tensors.iter().map(|t| t.get().spec());
    let objects = objects_to_save(py, objects);
    let common = each(common, convert::common_entry)?;
    let content_metadata = match content_metadata {
        Some(v) => value_from_py(v).map_err(|e| PyTypeError::new_err(format!("content_metadata: {e}")))?,
        None => tessera::Value::Null,
    };
    let tensors = specs
        // SAFETY: guaranteed by the caller of this function (see above).
        .map(|s| unsafe { s.read_only(py) })
        .collect::<PyResult<Vec<_>>>()?;
    let mut tree = slots(tensors, objects);
    for (path, value) in common {
        if path.is_empty() || path[0] == PathSeg::Key(ROOT.into()) {
            let shown = tessera::path_string(&path);
            return Err(invalid_argument(py, format!("common value path {shown:?} is empty or reserved")));
        }
        tree.set_path(&path, StateTree::Value(value));
    }
    let defaults = SaveOptions::default();
    let cancel = Arc::new(AtomicBool::new(false));
    let opts = SaveOptions {
        overwrite,
        validate,
        content_metadata,
        threads: threads.unwrap_or(defaults.threads),
        cancel: Some(cancel.clone()),
        ..defaults
    };
    Ok((tree, opts, cancel))
}

fn report_to_py<'py>(py: Python<'py>, report: tessera::SaveReport) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    out.set_item("file", report.file)?;
    out.set_item("bytes_written", report.bytes_written)?;
    out.set_item("total_tensor_bytes", report.total_tensor_bytes)?;
    out.set_item("files", report.files)?;
    out.set_item("chunks", report.chunks)?;
    out.set_item("index_bytes", report.index_bytes)?;
    warn_leftovers(py, &report.leftovers)?;
    out.set_item("leftovers", report.leftovers)?;
    Ok(out)
}

/// A committed save whose cleanup left files (`leftovers`) says so as a Python warning: the
/// checkpoint is good, the files are `tessera gc`'s.
fn warn_leftovers(py: Python<'_>, leftovers: &[String]) -> PyResult<()> {
    if leftovers.is_empty() {
        return Ok(());
    }
    let message = std::ffi::CString::new(format!(
        "checkpoint committed; clean-up incomplete: {} left for `tessera gc` ({})",
        leftovers.len(),
        leftovers.join(", ")
    ))
    .unwrap_or_default();
    PyErr::warn(py, &py.get_type::<pyo3::exceptions::PyRuntimeWarning>(), &message, 1)
}

/// Saves this rank's tensors, objects and (from rank 0) common values; collective over `comm`.
#[pyfunction]
#[pyo3(signature = (tensors, objects, common, location, comm=None, overwrite=false, validate=true,
                    content_metadata=None, threads=None, plan_cache=None))]
#[allow(clippy::too_many_arguments)]
fn save<'py>(
    py: Python<'py>,
    tensors: Vec<Bound<'py, SaveTensor>>,
    objects: Vec<Bound<'py, SaveObject>>,
    common: Vec<Bound<'py, PyAny>>,
    location: LocationArg,
    comm: Option<Bound<'py, PyAny>>,
    overwrite: bool,
    validate: bool,
    content_metadata: Option<Bound<'py, PyAny>>,
    threads: Option<usize>,
    plan_cache: Option<PyRef<'py, plan_cache::PlanCache>>,
) -> PyResult<Bound<'py, PyDict>> {
    // SAFETY: the contract of `save`: the Python caller keeps every tensor's memory alive,
    // C-contiguous and unmodified until `save` returns; the tree is dropped before that.
    let (tree, mut opts, cancel) = unsafe {
        save_request(py, &tensors, &objects, &common, overwrite, validate, content_metadata.as_ref(), threads)?
    };
    opts.plan_cache = plan_cache.map(|c| c.inner.clone());
    let comm = communicator(comm.as_ref())?;
    let storage = open(py, &location)?;
    let report = lib(py, interruptible(py, &cancel, || tessera::save(tree, &*storage, &*comm, &opts))?)?;
    report_to_py(py, report)
}

/// Saves this rank's tensors and objects as a Megatron `torch_dist` checkpoint (DCP `.metadata`,
/// `files_per_rank` data files `__{rank}_{k}.distcp` per rank (Megatron's `thread_count`),
/// `metadata.json`, `common.pt`), which megatron-core and `torch.distributed.checkpoint` load;
/// collective over `comm`. `common_pt`, on rank 0, is the whole `common.pt` (`torch.save` of
/// the common dict); None makes it of `common`. `common`, on rank 0 (`(path, plain value)`
/// pairs, as `save`'s), is also written as DCP's own save writes a state dict's values: byte
/// items under DCP's flattened keys, with `planner_data` (the Megatron front end gives none).
#[pyfunction]
#[pyo3(signature = (tensors, objects, common_pt, location, comm=None, overwrite=false, validate=true, threads=None,
                    files_per_rank=1, common=None))]
#[allow(clippy::too_many_arguments)]
fn save_torch_dist<'py>(
    py: Python<'py>,
    tensors: Vec<Bound<'py, SaveTensor>>,
    objects: Vec<Bound<'py, SaveObject>>,
    common_pt: Option<Vec<u8>>,
    location: LocationArg,
    comm: Option<Bound<'py, PyAny>>,
    overwrite: bool,
    validate: bool,
    threads: Option<usize>,
    files_per_rank: usize,
    common: Option<Vec<Bound<'py, PyAny>>>,
) -> PyResult<Bound<'py, PyDict>> {
    // SAFETY: the contract of `save_torch_dist`, as of `save`: the Python caller keeps every
    // tensor's memory alive, C-contiguous and unmodified until it returns; the tree is dropped
    // before that.
    let (tree, opts, cancel) = unsafe {
        save_request(py, &tensors, &objects, common.as_deref().unwrap_or(&[]), overwrite, validate, None, threads)?
    };
    let comm = communicator(comm.as_ref())?;
    let storage = open(py, &location)?;
    let common = common_pt.as_deref();
    let report = lib(
        py,
        interruptible(py, &cancel, || {
            tessera::torch_dist::save_torch_dist(tree, common, &*storage, &*comm, &opts, files_per_rank)
        })?,
    )?;
    report_to_py(py, report)
}

/// Saves this rank's tensors as OLMo-core 0.1.x checkpoint directories, one per
/// `(tensors, location)` in `dirs` (the files `Checkpointer.save` writes), all validated before
/// any is written and committed in order; collective over `comm`. Returns per directory the
/// files this rank created (relative to it), the bytes it wrote and the text of `metadata.json`.
#[pyfunction]
#[pyo3(signature = (dirs, comm=None, overwrite=false, threads=None))]
fn save_olmo<'py>(
    py: Python<'py>,
    dirs: Vec<(Vec<Bound<'py, SaveTensor>>, LocationArg)>,
    comm: Option<Bound<'py, PyAny>>,
    overwrite: bool,
    threads: Option<usize>,
) -> PyResult<Vec<Bound<'py, PyDict>>> {
    let mut trees = Vec::with_capacity(dirs.len());
    let mut storages = Vec::with_capacity(dirs.len());
    let mut opts_cancel = None;
    for (tensors, location) in &dirs {
        // SAFETY: the contract of `save_olmo`, as of `save`: the Python caller keeps every
        // tensor's memory alive, C-contiguous and unmodified until it returns; the trees are
        // dropped before.
        let (tree, opts, cancel) = unsafe { save_request(py, tensors, &[], &[], overwrite, true, None, threads)? };
        trees.push(tree);
        storages.push(open(py, location)?);
        opts_cancel.get_or_insert((opts, cancel));
    }
    let Some((opts, cancel)) = opts_cancel else { return Ok(Vec::new()) };
    let comm = communicator(comm.as_ref())?;
    let parts = trees.into_iter().zip(&storages).map(|(t, s)| (t, &**s as &dyn Storage)).collect();
    let reports = lib(py, interruptible(py, &cancel, || tessera::olmo::save_olmo_dirs(parts, &*comm, &opts))?)?;
    reports
        .into_iter()
        .map(|report| {
            let out = PyDict::new(py);
            out.set_item("files", report.files)?;
            out.set_item("bytes_written", report.bytes_written)?;
            out.set_item("metadata", report.metadata)?;
            warn_leftovers(py, &report.leftovers)?;
            out.set_item("leftovers", report.leftovers)?;
            Ok(out)
        })
        .collect()
}

/// The text of an OLMo-core `Checkpointer` directory's `metadata.json`, checked.
#[pyfunction]
fn olmo_metadata(py: Python<'_>, location: LocationArg) -> PyResult<String> {
    let storage = open(py, &location)?;
    lib(py, py.detach(|| tessera::olmo::read_olmo_metadata(&*storage)))
}

/// Checks collectively, writing nothing, that the ranks' shards form a valid global state.
#[pyfunction]
#[pyo3(signature = (tensors, objects, comm=None))]
fn validate_sharding<'py>(
    py: Python<'py>,
    tensors: Vec<Bound<'py, SaveTensor>>,
    objects: Vec<Bound<'py, SaveObject>>,
    comm: Option<Bound<'py, PyAny>>,
) -> PyResult<()> {
    let objects = objects_to_save(py, &objects);
    let tensors = tensors
        .iter()
        .map(|t| t.get().spec())
        .map(|s| match (s.data_ptr, s.nbytes) {
            (0, 0) => Ok(s.metadata_only()),
            // SAFETY: as in `save`: the caller keeps the memory alive and unmodified for the call.
            _ => unsafe { s.read_only(py) },
        })
        .collect::<PyResult<Vec<_>>>()?;
    let tree = slots(tensors, objects);
    let comm = communicator(comm.as_ref())?;
    lib(py, py.detach(|| tessera::validate_sharding_integrity(tree, &*comm)))
}

/// Loads tensors in place (into the caller's memory) and objects; collective over `comm`.
#[pyfunction]
#[pyo3(signature = (tensors, objects, location, comm=None, strict="assume_ok_unexpected", verify=true, threads=None,
                    exchange_reads=false, cast_dtypes=false))]
#[allow(clippy::too_many_arguments)]
fn load<'py>(
    py: Python<'py>,
    tensors: Vec<Bound<'py, LoadTensor>>,
    objects: Vec<Bound<'py, LoadObject>>,
    location: LocationArg,
    comm: Option<Bound<'py, PyAny>>,
    strict: &str,
    verify: bool,
    threads: Option<usize>,
    exchange_reads: bool,
    cast_dtypes: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let specs: Vec<_> = tensors.iter().map(|t| t.get().spec()).collect();
    let objects: Vec<_> = objects.iter().map(|o| o.get().object()).collect();
    let (n_tensors, n_objects) = (specs.len(), objects.len());
    convert::check_disjoint(py, &specs)?;
    let keys: Vec<String> = specs.iter().map(|s| s.tensor.key.clone()).collect();
    let tensors = specs
        .into_iter()
        // SAFETY: the contract of `load`: the Python caller keeps every tensor's memory alive,
        // C-contiguous and untouched by anyone else until `load` returns; no two buffers overlap
        // (checked above); the tree, and with it every borrow, is dropped before returning.
        .map(|s| unsafe { s.writable(py) })
        .collect::<PyResult<Vec<_>>>()?;
    let tree = slots(tensors, objects);
    let defaults = LoadOptions::default();
    let cancel = Arc::new(AtomicBool::new(false));
    let opts = LoadOptions {
        verify_checksums: verify,
        exchange_reads,
        cast_dtypes,
        strict: lib(py, StrictHandling::parse(strict))?,
        threads: threads.unwrap_or(defaults.threads),
        cancel: Some(cancel.clone()),
        ..defaults
    };
    let comm = communicator(comm.as_ref())?;
    let storage = open(py, &location)?;
    let (common, result) = lib(
        py,
        interruptible(py, &cancel, || {
            let ckpt = tessera::Checkpoint::open_for_load(&*storage, &keys, &*comm, &opts)?;
            let result = ckpt.load(tree, &*comm, &opts)?;
            Ok((ckpt.index().common.clone(), result))
        })?,
    )?;

    let mut loaded = BTreeMap::new();
    if let StateTree::Map(mut root) = result.state {
        if let Some(StateTree::Map(inner)) = root.remove(ROOT) {
            loaded = inner;
        }
    }
    let flags = (0..n_tensors).map(|i| matches!(loaded.get(&tensor_slot(i)), Some(StateTree::Tensor(_))));
    let objects = (0..n_objects)
        .map(|i| match loaded.get(&object_slot(i)) {
            Some(StateTree::Object(ShardedObject { data: Some(d), .. })) => PyBytes::new(py, d).into_any(),
            _ => py.None().into_bound(py),
        })
        .collect::<Vec<_>>();
    let stats = PyDict::new(py);
    stats.set_item("bytes_needed", result.stats.bytes_needed)?;
    stats.set_item("bytes_read", result.stats.bytes_read)?;
    stats.set_item("header_bytes_read", result.stats.header_bytes_read)?;
    stats.set_item("reads", result.stats.reads)?;
    stats.set_item("bytes_received", result.stats.bytes_received)?;
    let out = PyDict::new(py);
    out.set_item("objects", PyList::new(py, objects)?)?;
    out.set_item("loaded", PyList::new(py, flags)?)?;
    out.set_item("common", common_to_py(py, &common)?)?;
    out.set_item("missing_keys", result.missing_keys)?;
    out.set_item("unexpected_keys", result.unexpected_keys)?;
    out.set_item("stats", stats)?;
    Ok(out)
}

/// Key -> (dtype, global shape) of every stored tensor.
#[pyfunction]
fn load_tensors_metadata<'py>(py: Python<'py>, location: LocationArg) -> PyResult<Bound<'py, PyDict>> {
    let storage = open(py, &location)?;
    let metas = lib(py, py.detach(|| tessera::open(&*storage).map(|c| c.tensors_metadata())))?;
    let out = PyDict::new(py);
    for (key, meta) in metas {
        out.set_item(key, (meta.dtype.name(), PyTuple::new(py, meta.global_shape)?))?;
    }
    Ok(out)
}

/// Key -> (grid shape, [grid offset of every stored shard]) of every stored object.
#[pyfunction]
fn load_objects_metadata<'py>(py: Python<'py>, location: LocationArg) -> PyResult<Bound<'py, PyDict>> {
    let storage = open(py, &location)?;
    let index = lib(py, py.detach(|| tessera::open(&*storage).map(tessera::Checkpoint::into_index)))?;
    let out = PyDict::new(py);
    for o in &index.objects {
        let offsets = o.shards.iter().map(|s| PyTuple::new(py, &s.offset)).collect::<PyResult<Vec<_>>>()?;
        out.set_item(&o.key, (PyTuple::new(py, &o.global_shape)?, offsets))?;
    }
    Ok(out)
}

/// The common state as `(path, value)` pairs, as stored (maps in key order).
#[pyfunction]
fn load_common<'py>(py: Python<'py>, location: LocationArg) -> PyResult<Bound<'py, PyList>> {
    let storage = open(py, &location)?;
    let index = lib(py, py.detach(|| tessera::open(&*storage).map(tessera::Checkpoint::into_index)))?;
    common_to_py(py, &index.common)
}

/// The content metadata given at save (None if none).
#[pyfunction]
fn load_content_metadata<'py>(py: Python<'py>, location: LocationArg) -> PyResult<Bound<'py, PyAny>> {
    let storage = open(py, &location)?;
    let value = lib(py, py.detach(|| tessera::open(&*storage).map(|c| c.content_metadata().clone())))?;
    value_to_py(py, &value)
}

/// The bytes of the given object shards, in order.
#[pyfunction]
fn load_objects<'py>(
    py: Python<'py>,
    objects: Vec<Bound<'py, LoadObject>>,
    location: LocationArg,
) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    let objects: Vec<_> = objects.iter().map(|o| o.get().object()).collect();
    let n = objects.len();
    let storage = open(py, &location)?;
    let tree = slots(Vec::new(), objects);
    let StateTree::Map(mut root) = lib(py, py.detach(|| tessera::open(&*storage).and_then(|c| c.load_objects(tree))))?
    else {
        unreachable!("load_sharded_objects keeps the tree's shape")
    };
    let Some(StateTree::Map(inner)) = root.remove(ROOT) else { unreachable!("the tree holds ROOT") };
    (0..n)
        .map(|i| match inner.get(&object_slot(i)) {
            Some(StateTree::Object(ShardedObject { data: Some(d), .. })) => Ok(PyBytes::new(py, d)),
            _ => Err(pyo3::exceptions::PyRuntimeError::new_err(format!("object {i} was not loaded"))),
        })
        .collect()
}

/// Removes every tensor whose key starts with `key_prefix`; returns the keys removed.
#[pyfunction]
fn remove_sharded_tensors(py: Python<'_>, location: LocationArg, key_prefix: &str) -> PyResult<Vec<String>> {
    let storage = open(py, &location)?;
    lib(py, py.detach(|| tessera::tools::remove_sharded_tensors(&*storage, key_prefix)))
}

/// Re-reads every file and checks every checksum.
#[pyfunction]
#[pyo3(signature = (location, threads=None))]
fn verify<'py>(py: Python<'py>, location: LocationArg, threads: Option<usize>) -> PyResult<Bound<'py, PyDict>> {
    let storage = open(py, &location)?;
    let threads = threads.unwrap_or(LoadOptions::default().threads);
    let report = lib(py, py.detach(|| tessera::tools::verify(&*storage, threads)))?;
    let out = PyDict::new(py);
    out.set_item("files", report.files)?;
    out.set_item("chunks", report.chunks)?;
    out.set_item("bytes_checked", report.bytes_checked)?;
    out.set_item("problems", report.problems)?;
    Ok(out)
}

/// Removes the leftovers of saves that never committed or were replaced, beside running saves
/// (see `tessera::tools::gc`); returns `{"removed": [names], "running": [{save_id, writer,
/// expires_in_ms, files, unreadable}], "kept": [names]}`.
#[pyfunction]
#[pyo3(signature = (location, break_leases=false))]
fn gc<'py>(py: Python<'py>, location: LocationArg, break_leases: bool) -> PyResult<Bound<'py, PyDict>> {
    let storage = open(py, &location)?;
    let report = lib(py, py.detach(|| tessera::tools::gc(&*storage, &tessera::tools::GcOptions { break_leases })))?;
    let out = PyDict::new(py);
    out.set_item("removed", report.removed)?;
    let running = report
        .running
        .into_iter()
        .map(|s| {
            let d = PyDict::new(py);
            d.set_item("save_id", s.save_id)?;
            d.set_item("writer", s.writer)?;
            d.set_item("expires_in_ms", s.expires_in_ms)?;
            d.set_item("files", s.files)?;
            d.set_item("unreadable", s.unreadable)?;
            Ok(d)
        })
        .collect::<PyResult<Vec<_>>>()?;
    out.set_item("running", running)?;
    out.set_item("kept", report.kept)?;
    Ok(out)
}

/// The bytes of the file `name` of the checkpoint at `location`, read as every reader reads
/// (a plain name; locally a regular file, no link followed), or None when it does not exist.
#[pyfunction]
fn read_file<'py>(py: Python<'py>, location: LocationArg, name: &str) -> PyResult<Option<Bound<'py, PyBytes>>> {
    let storage = open(py, &location)?;
    match py.detach(|| storage.read(name)) {
        Ok(bytes) => Ok(Some(PyBytes::new(py, &bytes))),
        Err(tessera::Error::NotFound { .. }) => Ok(None),
        Err(e) => Err(to_pyerr(py, e)),
    }
}

/// What wrote a checkpoint, as the library recognised it (`tessera::index::FormatRecord`).
#[pyclass(frozen, module = "tessera._native")]
struct CheckpointFormat {
    backend: tessera::index::Backend,
    /// The backend's format version.
    #[pyo3(get)]
    version: u32,
}

#[pymethods]
impl CheckpointFormat {
    /// The backend's name (`tessera`, `torch_dcp`, `torch_dist`, `olmo_core`, `zarr`,
    /// `olmo_safetensors`, `safetensors`).
    #[getter]
    fn backend(&self) -> &'static str {
        self.backend.name()
    }
    /// Whether it is a PyTorch DCP directory.
    #[getter]
    fn is_dcp(&self) -> bool {
        self.backend.is_dcp()
    }
    /// Whether it carries Megatron-Core's `metadata.json`.
    #[getter]
    fn is_megatron(&self) -> bool {
        self.backend.is_megatron()
    }
    /// Whether it is tessera's own format.
    #[getter]
    fn is_native(&self) -> bool {
        self.backend == tessera::index::Backend::Tessera
    }
    fn __repr__(&self) -> String {
        format!("CheckpointFormat({:?}, version={})", self.backend.name(), self.version)
    }
}

/// The format of the checkpoint at `location`, or None when there is none.
#[pyfunction]
fn detect(py: Python<'_>, location: LocationArg) -> PyResult<Option<CheckpointFormat>> {
    let storage = open(py, &location)?;
    match py.detach(|| tessera::index::FormatRecord::detect(&*storage)) {
        Ok(record) => Ok(Some(CheckpointFormat { backend: record.backend, version: record.version })),
        Err(tessera::Error::NotFound { .. } | tessera::Error::NotCommitted { .. }) => Ok(None),
        Err(e) => Err(to_pyerr(py, e)),
    }
}

/// A plain value in the library's safe tagged encoding (FORMAT.md "value"): data only, no code.
#[pyfunction]
fn encode_value<'py>(py: Python<'py>, value: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
    let value = value_from_py(value)?;
    Ok(PyBytes::new(py, &py.detach(|| value.to_bytes())))
}

/// The plain value of what [`encode_value`] wrote; malformed bytes are an `InvalidArgumentError`.
#[pyfunction]
fn decode_value<'py>(py: Python<'py>, data: &[u8]) -> PyResult<Bound<'py, PyAny>> {
    value_to_py(py, &lib(py, py.detach(|| tessera::Value::from_bytes(data)))?)
}

/// Runs the `tessera` command line `argv` (program name first) as the `tessera` binary does;
/// returns its exit status. The `tessera` console script of the Python package calls it.
#[pyfunction]
fn cli(py: Python<'_>, argv: Vec<String>) -> u8 {
    py.detach(|| tessera_cli::run(argv))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<location::Location>()?;
    m.add_class::<CheckpointFormat>()?;
    m.add_class::<SaveTensor>()?;
    m.add_class::<LoadTensor>()?;
    m.add_class::<SaveObject>()?;
    m.add_class::<LoadObject>()?;
    m.add_function(wrap_pyfunction!(convert::from_rank_offsets, m)?)?;
    m.add_function(wrap_pyfunction!(save, m)?)?;
    m.add_function(wrap_pyfunction!(cli, m)?)?;
    m.add_function(wrap_pyfunction!(save_olmo, m)?)?;
    m.add_function(wrap_pyfunction!(save_torch_dist, m)?)?;
    m.add_function(wrap_pyfunction!(torch_dist::plan_torch_dist, m)?)?;
    m.add_class::<torch_dist::TorchDistSave>()?;
    m.add_class::<torch_dist::TorchDistFile>()?;
    m.add_function(wrap_pyfunction!(olmo_metadata, m)?)?;
    m.add_function(wrap_pyfunction!(validate_sharding, m)?)?;
    m.add_function(wrap_pyfunction!(load, m)?)?;
    m.add_function(wrap_pyfunction!(load_tensors_metadata, m)?)?;
    m.add_function(wrap_pyfunction!(load_objects_metadata, m)?)?;
    m.add_function(wrap_pyfunction!(load_common, m)?)?;
    m.add_function(wrap_pyfunction!(load_content_metadata, m)?)?;
    m.add_function(wrap_pyfunction!(load_objects, m)?)?;
    m.add_function(wrap_pyfunction!(remove_sharded_tensors, m)?)?;
    m.add_function(wrap_pyfunction!(verify, m)?)?;
    m.add_function(wrap_pyfunction!(gc, m)?)?;
    m.add_function(wrap_pyfunction!(detect, m)?)?;
    m.add_function(wrap_pyfunction!(read_file, m)?)?;
    m.add_function(wrap_pyfunction!(encode_value, m)?)?;
    m.add_function(wrap_pyfunction!(decode_value, m)?)?;
    m.add_class::<async_save::AsyncSaver>()?;
    m.add_class::<async_save::AsyncSave>()?;
    m.add_class::<plan_cache::PlanCache>()?;
    m.add_class::<manager::CheckpointManager>()?;
    m.add_class::<manager::Restored>()?;
    errors::register(m)?;
    m.add("DTYPES", tessera::DType::ALL.iter().map(|d| d.name()).collect::<Vec<_>>())?;
    m.add("FORMAT_VERSION", tessera::index::FORMAT_VERSION)?;
    {
        use tessera::torch_dist as pc;
        m.add("OBJECT_TAG_VALUE", PyBytes::new(m.py(), pc::OBJECT_TAG_VALUE))?;
        m.add("OBJECT_TAG_TORCH", PyBytes::new(m.py(), pc::OBJECT_TAG_TORCH))?;
        m.add("OBJECT_TAG_TORCH_LIST", PyBytes::new(m.py(), pc::OBJECT_TAG_TORCH_LIST))?;
        m.add("TORCH_SAVE_KEY", pc::TORCH_SAVE_KEY)?;
        m.add("INT_KEY_PREFIX", pc::INT_KEY_PREFIX)?;
    }
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
