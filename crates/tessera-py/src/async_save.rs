//! Python classes over `tessera::AsyncSaver` and `tessera::AsyncSave`.

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use pyo3::prelude::*;
use pyo3::types::PyDict;
use tessera::comm::SoloComm;
use tessera::Communicator;

use crate::comm::PyComm;
use crate::location::LocationArg;
use crate::{communicator, interruptible, lib, open, report_to_py, save_request};

/// Async saves through one pre-faulted staging pool; see `tessera::AsyncSaver`.
#[pyclass(module = "tessera._native")]
pub struct AsyncSaver {
    inner: Mutex<tessera::AsyncSaver>,
}

/// One async save in flight; see `tessera::AsyncSave`.
#[pyclass(module = "tessera._native")]
pub struct AsyncSave {
    inner: Mutex<Option<tessera::AsyncSave>>,
    cancel: Arc<AtomicBool>,
}

#[pymethods]
impl AsyncSaver {
    /// `budget` bytes of staging buffers (of `buffer_size` bytes each), allocated and faulted in
    /// now. `commit_comm` runs the background commit: a communicator nothing else uses while a
    /// save is in flight (None: a single process).
    #[new]
    #[pyo3(signature = (budget, commit_comm=None, buffer_size=None))]
    fn new(
        py: Python<'_>,
        budget: u64,
        commit_comm: Option<Bound<'_, PyAny>>,
        buffer_size: Option<usize>,
    ) -> PyResult<Self> {
        let commit: Arc<dyn Communicator> = match &commit_comm {
            Some(obj) if !obj.is_none() => Arc::new(PyComm::new(obj)?),
            _ => Arc::new(SoloComm),
        };
        let pool = py.detach(|| match buffer_size {
            Some(size) => tessera::StagingPool::with_buffer_size(budget, size),
            None => tessera::StagingPool::new(budget),
        });
        let pool = lib(py, pool)?;
        Ok(AsyncSaver { inner: Mutex::new(tessera::AsyncSaver::new(pool, commit)) })
    }

    /// Starts a save (collective over `comm`); returns once every byte is staged.
    #[pyo3(signature = (tensors, objects, common, location, comm=None, overwrite=false, validate=true,
                        content_metadata=None, threads=None, plan_cache=None))]
    #[allow(clippy::too_many_arguments)]
    fn save<'py>(
        &self,
        py: Python<'py>,
        tensors: Vec<Bound<'py, crate::convert::SaveTensor>>,
        objects: Vec<Bound<'py, crate::convert::SaveObject>>,
        common: Vec<Bound<'py, PyAny>>,
        location: LocationArg,
        comm: Option<Bound<'py, PyAny>>,
        overwrite: bool,
        validate: bool,
        content_metadata: Option<Bound<'py, PyAny>>,
        threads: Option<usize>,
        plan_cache: Option<PyRef<'py, crate::plan_cache::PlanCache>>,
    ) -> PyResult<AsyncSave> {
        // SAFETY: the caller keeps every tensor's memory alive and unmodified until this call
        // returns; by then the bytes are staged and the tree is dropped.
        let (tree, mut opts, cancel) = unsafe {
            save_request(py, &tensors, &objects, &common, overwrite, validate, content_metadata.as_ref(), threads)?
        };
        opts.plan_cache = plan_cache.map(|c| c.inner.clone());
        let comm = communicator(comm.as_ref())?;
        let storage = open(py, &location)?;
        let mut guard = self.inner.lock().unwrap();
        let saver: &mut tessera::AsyncSaver = &mut guard;
        let started = interruptible(py, &cancel, || saver.save(tree, storage, &*comm, &opts))?;
        let handle = lib(py, started)?;
        Ok(AsyncSave { inner: Mutex::new(Some(handle)), cancel })
    }

    /// True when no save is in flight (local, no communication).
    fn is_idle(&self) -> bool {
        self.inner.lock().unwrap().is_idle()
    }

    /// Bytes of staging memory held.
    #[getter]
    fn capacity(&self) -> u64 {
        self.inner.lock().unwrap().pool().capacity()
    }

    /// Size of one staging buffer.
    #[getter]
    fn buffer_size(&self) -> usize {
        self.inner.lock().unwrap().pool().buffer_size()
    }

    /// Most staging bytes ever in use at once.
    #[getter]
    fn peak_bytes_in_use(&self) -> u64 {
        self.inner.lock().unwrap().pool().peak_bytes_in_use()
    }
}

#[pymethods]
impl AsyncSave {
    /// True once this rank's part is written and the commit decided (local, no communication).
    fn is_done(&self) -> bool {
        self.inner.lock().unwrap().as_ref().is_none_or(|h| h.is_done())
    }

    /// Waits for the save and returns its report; raises the save's error, the same on every
    /// rank. Ctrl-C while waiting cancels the save (nothing is committed).
    fn finalize<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let handle = self.inner.lock().unwrap().take();
        let Some(handle) = handle else {
            return Err(crate::errors::invalid_argument(py, "this async save was already finalized"));
        };
        let report = lib(py, interruptible(py, &self.cancel, || handle.finalize())?)?;
        report_to_py(py, report)
    }
}
