//! Python classes over `tessera::memory_tier::CheckpointManager` and its restore result.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};
use tessera::comm::SoloComm;
use tessera::memory_tier::{ManagerOptions, MemoryTier, Tier};
use tessera::{Communicator, ShardedObject, StateTree};

use crate::comm::PyComm;
use crate::convert::{common_to_py, LoadObject, LoadTensor, SaveObject, SaveTensor};
use crate::location::LocationArg;
use crate::{communicator, interruptible, lib, object_slot, save_request, slots, ROOT};

/// Saves on a schedule to a memory tier with erasure-coded parity and to a persistent
/// location, and restores the newest complete step; see `tessera::memory_tier`.
#[pyclass(module = "tessera._native")]
pub struct CheckpointManager {
    /// `None` once closed.
    inner: Mutex<Option<tessera::memory_tier::CheckpointManager>>,
}

impl CheckpointManager {
    /// Runs `f` on the open manager, or raises if it was closed.
    fn with<R>(&self, f: impl FnOnce(&mut tessera::memory_tier::CheckpointManager) -> PyResult<R>) -> PyResult<R> {
        let mut guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        match guard.as_mut() {
            Some(mgr) => f(mgr),
            None => Err(pyo3::exceptions::PyValueError::new_err("the checkpoint manager is closed")),
        }
    }
}

impl Drop for CheckpointManager {
    fn drop(&mut self) {
        let open = self.inner.get_mut().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(mgr) = open {
            // Dropping the manager waits for its background thread, whose queued jobs run
            // torch collectives that need the GIL: release it meanwhile.
            Python::attach(|py| py.detach(move || drop(mgr)));
        }
    }
}

/// What a restore gave back (the tensors were filled in place).
#[pyclass(frozen, module = "tessera._native")]
pub struct Restored {
    /// The step restored.
    #[pyo3(get)]
    step: u64,
    /// `"memory"` or `"persistent"`.
    #[pyo3(get)]
    tier: &'static str,
    /// Ranks whose memory copies were rebuilt from other nodes' shards.
    #[pyo3(get)]
    rebuilt_ranks: Vec<usize>,
    /// Why newer steps were passed over.
    #[pyo3(get)]
    notes: Vec<String>,
    /// Per requested tensor: filled.
    #[pyo3(get)]
    loaded: Vec<bool>,
    /// Per requested object: its bytes (None if the step has none).
    #[pyo3(get)]
    objects: Py<PyList>,
    /// The step's common values: (path, value) pairs.
    #[pyo3(get)]
    common: Py<PyList>,
}

#[pymethods]
impl CheckpointManager {
    /// A manager; `memory_root` (with `node`, RS(`data_shards`, `parity_shards`)) enables the
    /// memory tier, `persistent` the persistent one. `background_comm` runs the background
    /// collectives: a communicator nothing else uses (None: a single process).
    #[new]
    #[pyo3(signature = (*, memory_root=None, node=None, data_shards=4, parity_shards=1, chunk_bytes=8_388_608,
                        persistent=None, every=1, persist_every=0, keep_last_memory=2, keep_last_persistent=3,
                        staging_bytes=268_435_456, background_comm=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        memory_root: Option<String>,
        node: Option<String>,
        data_shards: usize,
        parity_shards: usize,
        chunk_bytes: u64,
        persistent: Option<LocationArg>,
        every: u64,
        persist_every: u64,
        keep_last_memory: usize,
        keep_last_persistent: usize,
        staging_bytes: u64,
        background_comm: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let memory = memory_root.map(|root| {
            let tier = MemoryTier::new(root).redundancy(data_shards, parity_shards).chunk_bytes(chunk_bytes);
            match node {
                Some(n) => tier.node(n),
                None => tier,
            }
        });
        let opts = ManagerOptions {
            memory,
            persistent: persistent.map(|p| p.location()),
            every,
            persist_every,
            keep_last_memory,
            keep_last_persistent,
            staging_bytes,
        };
        let background: Arc<dyn Communicator> = match &background_comm {
            Some(obj) if !obj.is_none() => Arc::new(PyComm::new(obj)?),
            _ => Arc::new(SoloComm),
        };
        let inner = lib(py, py.detach(|| tessera::memory_tier::CheckpointManager::new(opts, background)))?;
        Ok(CheckpointManager { inner: Mutex::new(Some(inner)) })
    }

    /// Saves step `step` if the policy says so (collective over `comm`); returns whether it
    /// did, once every byte is staged.
    #[pyo3(signature = (step, tensors, objects, common, comm=None))]
    fn save<'py>(
        &self,
        py: Python<'py>,
        step: u64,
        tensors: Vec<Bound<'py, SaveTensor>>,
        objects: Vec<Bound<'py, SaveObject>>,
        common: Vec<Bound<'py, PyAny>>,
        comm: Option<Bound<'py, PyAny>>,
    ) -> PyResult<bool> {
        // SAFETY: the caller keeps every tensor's memory alive and unmodified until this call
        // returns; by then the bytes are staged and the tree is dropped.
        let (tree, _, cancel) = unsafe { save_request(py, &tensors, &objects, &common, true, true, None, None)? };
        let comm = communicator(comm.as_ref())?;
        self.with(|mgr| lib(py, interruptible(py, &cancel, || mgr.save(step, tree, &*comm))?))
    }

    /// Waits for the background work; raises its first failure since the last call.
    fn wait(&self, py: Python<'_>) -> PyResult<()> {
        self.with(|mgr| lib(py, py.detach(|| mgr.wait())))
    }

    /// Waits for the background work and stops the background thread; raises the work's first
    /// failure since the last wait. Closing twice does nothing; any other call after it raises.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let open = self.inner.lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some(mut mgr) = open else { return Ok(()) };
        lib(
            py,
            py.detach(move || {
                let waited = mgr.wait();
                drop(mgr);
                waited
            }),
        )
    }

    /// Restores the newest complete step into the tensors in place (collective over `comm`);
    /// None when no tier holds a step.
    #[pyo3(signature = (tensors, objects, comm=None))]
    fn restore<'py>(
        &self,
        py: Python<'py>,
        tensors: Vec<Bound<'py, LoadTensor>>,
        objects: Vec<Bound<'py, LoadObject>>,
        comm: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Option<Restored>> {
        let specs: Vec<_> = tensors.iter().map(|t| t.get().spec()).collect();
        let objects: Vec<_> = objects.iter().map(|o| o.get().object()).collect();
        let (n_tensors, n_objects) = (specs.len(), objects.len());
        crate::convert::check_disjoint(py, &specs)?;
        let tensors = specs
            .into_iter()
            // SAFETY: as for `load`: the Python caller keeps every tensor's memory alive,
            // C-contiguous and untouched by anyone else until this returns; no two buffers
            // overlap (checked above); the tree and every borrow are dropped before returning.
            .map(|s| unsafe { s.writable(py) })
            .collect::<PyResult<Vec<_>>>()?;
        let tree = slots(tensors, objects);
        let comm = communicator(comm.as_ref())?;
        let cancel = Arc::new(AtomicBool::new(false));
        let mut guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let Some(mgr) = guard.as_mut() else {
            return Err(pyo3::exceptions::PyValueError::new_err("the checkpoint manager is closed"));
        };
        let Some(r) = lib(py, interruptible(py, &cancel, || mgr.restore(tree, &*comm))?)? else { return Ok(None) };
        let mut loaded = BTreeMap::new();
        if let StateTree::Map(mut root) = r.state {
            if let Some(StateTree::Map(inner)) = root.remove(ROOT) {
                loaded = inner;
            }
        }
        let flags =
            (0..n_tensors).map(|i| matches!(loaded.get(&crate::tensor_slot(i)), Some(StateTree::Tensor(_)))).collect();
        let objects = (0..n_objects)
            .map(|i| match loaded.get(&object_slot(i)) {
                Some(StateTree::Object(ShardedObject { data: Some(d), .. })) => PyBytes::new(py, d).into_any(),
                _ => py.None().into_bound(py),
            })
            .collect::<Vec<_>>();
        Ok(Some(Restored {
            step: r.step,
            tier: match r.tier {
                Tier::Memory => "memory",
                _ => "persistent",
            },
            rebuilt_ranks: r.rebuilt_ranks,
            notes: r.notes,
            loaded: flags,
            objects: PyList::new(py, objects)?.unbind(),
            common: common_to_py(py, &r.common)?.unbind(),
        }))
    }
}
