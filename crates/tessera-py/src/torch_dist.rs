//! Python classes over `tessera::torch_dist::TorchDistSave`: a `torch_dist` save whose data files Python
//! has written one by one (Megatron's writer workers call `TorchDistFile.write`), then commits.

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, RwLock};

use pyo3::prelude::*;
use pyo3::types::PyDict;
use tessera::{SaveOptions, Storage};

use crate::errors::invalid_argument;
use crate::location::LocationArg;
use crate::{communicator, interruptible, lib, open, report_to_py, save_request};

/// What the save and its files share.
struct Shared {
    /// The planned save; None once committed.
    save: RwLock<Option<tessera::torch_dist::TorchDistSave<'static>>>,
    storage: Arc<dyn Storage>,
    opts: SaveOptions,
    cancel: Arc<AtomicBool>,
    /// What owns the memory `save` borrows (the caller's `owners`): held for as long as it can
    /// be read (declared after `save`, so dropped after it).
    _owners: Py<PyAny>,
}

/// A planned `torch_dist` save (see `tessera::torch_dist::TorchDistSave`): write every file of
/// [`files`](Self::files), then [`commit`](Self::commit).
#[pyclass(module = "tessera._native", frozen)]
pub struct TorchDistSave {
    shared: Arc<Shared>,
}

/// One data file of a planned `torch_dist` save.
#[pyclass(module = "tessera._native", frozen)]
pub struct TorchDistFile {
    shared: Arc<Shared>,
    index: usize,
    name: String,
}

/// Plans a `torch_dist` save of this rank's tensors and objects (collective over `comm`;
/// arguments as `save_torch_dist`'s). Nothing is written yet. `owners` is what owns the
/// tensors' memory (e.g. the list of the tensors): the returned save holds it until it is
/// dropped, and the memory must stay unmodified until the save is committed or dropped.
#[pyfunction]
#[pyo3(signature = (tensors, objects, common_pt, location, owners, comm=None, overwrite=false, validate=true,
                    threads=None, files_per_rank=1, common=None))]
#[allow(clippy::too_many_arguments)]
pub fn plan_torch_dist<'py>(
    py: Python<'py>,
    tensors: Vec<Bound<'py, crate::convert::SaveTensor>>,
    objects: Vec<Bound<'py, crate::convert::SaveObject>>,
    common_pt: Option<Vec<u8>>,
    location: LocationArg,
    owners: Bound<'py, PyAny>,
    comm: Option<Bound<'py, PyAny>>,
    overwrite: bool,
    validate: bool,
    threads: Option<usize>,
    files_per_rank: usize,
    common: Option<Vec<Bound<'py, PyAny>>>,
) -> PyResult<TorchDistSave> {
    // SAFETY: the tree borrows the memory the descriptors in `tensors` point to. The contract
    // of `plan_torch_dist`: `owners` owns that memory, which stays C-contiguous and unmodified
    // until the save is committed or dropped; `Shared` holds `owners` for as long as the tree
    // lives (it is dropped after the tree).
    let (tree, opts, cancel) = unsafe {
        save_request(py, &tensors, &objects, common.as_deref().unwrap_or(&[]), overwrite, validate, None, threads)?
    };
    let comm = communicator(comm.as_ref())?;
    let storage = open(py, &location)?;
    let common = common_pt.as_deref();
    let planned = interruptible(py, &cancel, || {
        tessera::torch_dist::TorchDistSave::plan(tree, common, &*storage, &*comm, &opts, files_per_rank)
    })?;
    let save = lib(py, planned)?;
    Ok(TorchDistSave {
        shared: Arc::new(Shared { save: RwLock::new(Some(save)), storage, opts, cancel, _owners: owners.unbind() }),
    })
}

#[pymethods]
impl TorchDistSave {
    /// This rank's data files, in order (each written once, from any thread, in any order).
    fn files(&self) -> Vec<TorchDistFile> {
        let guard = self.shared.save.read().unwrap();
        let Some(save) = guard.as_ref() else { return Vec::new() };
        (0..save.files())
            .map(|index| TorchDistFile {
                shared: self.shared.clone(),
                index,
                name: save.file_name(index).unwrap_or_default().to_string(),
            })
            .collect()
    }

    /// Ends the save (collective over `comm`): `failure`, this rank's error writing its files
    /// (None when every file was written), is every rank's verdict; with none anywhere rank 0
    /// commits, otherwise nothing is committed, the save's files are removed and every rank
    /// raises the first failure (another rank's as `PeerFailedError`). Returns the save report.
    #[pyo3(signature = (bytes_written, comm=None, failure=None))]
    fn commit<'py>(
        &self,
        py: Python<'py>,
        bytes_written: u64,
        comm: Option<Bound<'py, PyAny>>,
        failure: Option<String>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let comm = communicator(comm.as_ref())?;
        let taken = self.shared.save.write().unwrap().take();
        let Some(save) = taken else {
            return Err(invalid_argument(py, "this torch_dist save was already committed"));
        };
        let written = match failure {
            None => Ok(bytes_written),
            Some(message) => Err(tessera::Error::Io {
                path: self.shared.storage.location().into(),
                source: std::io::Error::other(message),
            }),
        };
        let (storage, opts) = (&*self.shared.storage, &self.shared.opts);
        let report = interruptible(py, &self.shared.cancel, || save.commit(written, storage, &*comm, opts))?;
        report_to_py(py, lib(py, report)?)
    }
}

#[pymethods]
impl TorchDistFile {
    /// The file's name, relative to the checkpoint.
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// Writes the file whole; returns its size in bytes.
    fn write(&self, py: Python<'_>) -> PyResult<u64> {
        let shared = &*self.shared;
        let written = interruptible(py, &shared.cancel, || {
            let guard = shared.save.read().unwrap();
            match guard.as_ref() {
                Some(save) => Ok(save.write_file(self.index, &*shared.storage, &shared.opts)),
                None => Err(()),
            }
        })?;
        match written {
            Ok(result) => lib(py, result),
            Err(()) => Err(invalid_argument(py, format!("{}: the save was already committed", self.name))),
        }
    }
}
