//! A Python communicator seen as a `tessera::Communicator`.
//!
//! The Python object has `rank()`, `world_size()`, `all_gather(data: bytes) -> list[bytes]` and
//! `broadcast(data: bytes, root: int) -> bytes`. The library calls it with the GIL released;
//! each call re-attaches to the interpreter for the duration of the Python call. A Python
//! exception raised by it becomes `tessera::Error::Comm` carrying the exception's text.

use std::borrow::Cow;

use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// A Python communicator. Rank and world size are read once, when it is wrapped.
pub struct PyComm {
    obj: Py<PyAny>,
    rank: usize,
    world: usize,
    /// The object has `all_to_all(list[bytes]) -> list[bytes]` (otherwise: the library's
    /// default over `all_gather`).
    has_all_to_all: bool,
}

impl PyComm {
    /// Wraps `obj`, asking it for its rank and world size (with the GIL held).
    pub fn new(obj: &Bound<'_, PyAny>) -> PyResult<Self> {
        let rank: usize = obj.call_method0("rank")?.extract()?;
        let world: usize = obj.call_method0("world_size")?.extract()?;
        let has_all_to_all = obj.hasattr("all_to_all")?;
        Ok(PyComm { obj: obj.clone().unbind(), rank, world, has_all_to_all })
    }
}

fn comm_error(method: &str, err: PyErr) -> tessera::Error {
    // PyErr's Display is "ExceptionType: message".
    tessera::Error::Comm { reason: format!("Python communicator {method}() raised {err}") }
}

impl tessera::Communicator for PyComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_gather(&self, data: &[u8]) -> tessera::Result<Vec<Vec<u8>>> {
        Python::attach(|py| {
            let run = || -> PyResult<Vec<Vec<u8>>> {
                let out = self.obj.bind(py).call_method1("all_gather", (PyBytes::new(py, data),))?;
                let mut parts = Vec::with_capacity(self.world);
                for part in out.try_iter()? {
                    parts.push(part?.extract::<Cow<'_, [u8]>>()?.into_owned());
                }
                Ok(parts)
            };
            run().map_err(|e| comm_error("all_gather", e))
        })
    }

    fn all_to_all(&self, send: Vec<Vec<u8>>) -> tessera::Result<Vec<Vec<u8>>> {
        if !self.has_all_to_all {
            return tessera::comm::default_all_to_all(self, send);
        }
        Python::attach(|py| {
            let run = || -> PyResult<Vec<Vec<u8>>> {
                let msgs: Vec<Bound<'_, PyBytes>> = send.iter().map(|m| PyBytes::new(py, m)).collect();
                let out = self.obj.bind(py).call_method1("all_to_all", (msgs,))?;
                let mut parts = Vec::with_capacity(self.world);
                for part in out.try_iter()? {
                    parts.push(part?.extract::<Cow<'_, [u8]>>()?.into_owned());
                }
                Ok(parts)
            };
            let parts = run().map_err(|e| comm_error("all_to_all", e))?;
            if parts.len() != self.world {
                let reason =
                    format!("Python communicator all_to_all() returned {} messages for {}", parts.len(), self.world);
                return Err(tessera::Error::Comm { reason });
            }
            Ok(parts)
        })
    }

    fn broadcast(&self, data: &[u8], root: usize) -> tessera::Result<Vec<u8>> {
        Python::attach(|py| {
            let run = || -> PyResult<Vec<u8>> {
                let out = self.obj.bind(py).call_method1("broadcast", (PyBytes::new(py, data), root))?;
                Ok(out.extract::<Cow<'_, [u8]>>()?.into_owned())
            };
            run().map_err(|e| comm_error("broadcast", e))
        })
    }
}
