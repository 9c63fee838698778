//! The exception classes (one per `tessera::Error` variant, all under `TesseraError`, each also
//! subclassing the builtin that fits) and the mapping from `tessera::Error` to them.
//!
//! The classes need two bases (e.g. `TesseraError` and `FileNotFoundError`), which
//! `create_exception!` cannot express, so they are made once with `type(name, bases, ns)`.

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};
use pyo3::IntoPyObjectExt;

/// The exception classes, in the order of [`SPECS`].
#[derive(Debug, Clone, Copy)]
#[repr(usize)]
enum Kind {
    Base,
    NotFound,
    NotCommitted,
    AlreadyExists,
    Corrupt,
    IncompatibleVersion,
    InvalidSharding,
    NotCovered,
    Mismatch,
    KeyMismatch,
    UnknownStrategy,
    InvalidArgument,
    PeerFailed,
    Comm,
    StorageIO,
    AccessDenied,
    CommitUnknown,
}

/// `(class name, builtin base, docstring)`, indexed by [`Kind`].
const SPECS: [(&str, &str, &str); 17] = [
    ("TesseraError", "Exception", "Base class of every tessera error."),
    ("NotFoundError", "FileNotFoundError", "A file or directory that must exist does not."),
    ("NotCommittedError", "FileNotFoundError", "The directory holds no committed checkpoint (no index)."),
    ("AlreadyExistsError", "FileExistsError", "A committed checkpoint is already there; pass overwrite."),
    ("CorruptError", "ValueError", "Bytes on storage do not match what the index promises."),
    ("IncompatibleVersionError", "ValueError", "The checkpoint's format version cannot be read by this build."),
    ("InvalidShardingError", "ValueError", "The shards given by the ranks do not describe a valid global state."),
    ("NotCoveredError", "KeyError", "A requested region is not (fully) present in the checkpoint."),
    ("MismatchError", "ValueError", "The request does not match the stored tensor (dtype, global shape)."),
    ("KeyMismatchError", "KeyError", "Keys the strict-handling mode refuses."),
    ("UnknownStrategyError", "LookupError", "No registered strategy can handle this backend."),
    ("InvalidArgumentError", "ValueError", "An argument is malformed."),
    ("PeerFailedError", "RuntimeError", "Another rank failed; this rank stops with the same verdict."),
    ("CommError", "RuntimeError", "The communicator failed."),
    ("StorageIOError", "OSError", "An operating-system IO error on a path."),
    (
        "AccessDeniedError",
        "PermissionError",
        "The store refused the credentials, or none were found for it (see the message for what was tried).",
    ),
    (
        "CommitUnknownError",
        "RuntimeError",
        "A save reached its commit, but whether it committed is unknown on this rank; its files were kept.",
    ),
];

static CLASSES: PyOnceLock<Vec<Py<PyType>>> = PyOnceLock::new();

fn classes(py: Python<'_>) -> PyResult<&Vec<Py<PyType>>> {
    CLASSES.get_or_try_init(py, || {
        let builtins = py.import("builtins")?;
        let make_type = builtins.getattr("type")?;
        let mut out: Vec<Py<PyType>> = Vec::with_capacity(SPECS.len());
        for (name, builtin, doc) in SPECS {
            let ns = PyDict::new(py);
            ns.set_item("__module__", "tessera.errors")?;
            ns.set_item("__doc__", doc)?;
            if builtin == "KeyError" {
                // KeyError's str() quotes its message; these carry sentences, not keys.
                ns.set_item("__str__", builtins.getattr("BaseException")?.getattr("__str__")?)?;
            }
            let builtin = builtins.getattr(builtin)?;
            let bases = match out.first() {
                Some(base) => PyTuple::new(py, [base.bind(py).as_any(), &builtin])?,
                None => PyTuple::new(py, [&builtin])?,
            };
            let cls = make_type.call1((name, bases, ns))?.cast_into::<PyType>()?;
            out.push(cls.unbind());
        }
        Ok(out)
    })
}

/// Adds every exception class to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    for (cls, (name, _, _)) in classes(py)?.iter().zip(SPECS) {
        m.add(name, cls.bind(py))?;
    }
    Ok(())
}

/// The `InvalidArgumentError` of a message (for arguments rejected by the bindings themselves).
pub fn invalid_argument(py: Python<'_>, message: impl Into<String>) -> PyErr {
    to_pyerr(py, tessera::Error::InvalidArgument { reason: message.into() })
}

/// The Python exception for a tessera error: its class, its message, and every field of the
/// variant as an attribute (`key`, `path`, `reason`, `found`, `supported`, `rank`, …).
pub fn to_pyerr(py: Python<'_>, err: tessera::Error) -> PyErr {
    match build(py, err) {
        Ok(e) => e,
        Err(e) => e,
    }
}

fn build(py: Python<'_>, err: tessera::Error) -> PyResult<PyErr> {
    use tessera::Error as E;
    let message = err.to_string();
    let path = |p: &std::path::Path| p.to_string_lossy().into_owned().into_py_any(py);
    let (kind, attrs): (Kind, Vec<(&str, Py<PyAny>)>) = match err {
        E::NotFound { path: p, .. } => (Kind::NotFound, vec![("path", path(&p)?)]),
        E::NotCommitted { path: p, .. } => (Kind::NotCommitted, vec![("path", path(&p)?)]),
        E::AlreadyExists { path: p } => (Kind::AlreadyExists, vec![("path", path(&p)?)]),
        E::Corrupt { path: p, reason } => {
            (Kind::Corrupt, vec![("path", path(&p)?), ("reason", reason.into_py_any(py)?)])
        }
        E::IncompatibleVersion { found, supported } => (
            Kind::IncompatibleVersion,
            vec![("found", found.into_py_any(py)?), ("supported", supported.into_py_any(py)?)],
        ),
        E::InvalidSharding { key, reason } => {
            (Kind::InvalidSharding, vec![("key", key.into_py_any(py)?), ("reason", reason.into_py_any(py)?)])
        }
        E::NotCovered { key, region } => {
            (Kind::NotCovered, vec![("key", key.into_py_any(py)?), ("region", region.into_py_any(py)?)])
        }
        E::Mismatch { key, reason } => {
            (Kind::Mismatch, vec![("key", key.into_py_any(py)?), ("reason", reason.into_py_any(py)?)])
        }
        E::KeyMismatch { unexpected, missing } => (
            Kind::KeyMismatch,
            vec![("unexpected", unexpected.into_py_any(py)?), ("missing", missing.into_py_any(py)?)],
        ),
        E::UnknownStrategy { backend, version, action } => (
            Kind::UnknownStrategy,
            vec![
                ("backend", backend.into_py_any(py)?),
                ("version", version.into_py_any(py)?),
                ("action", action.into_py_any(py)?),
            ],
        ),
        E::InvalidArgument { reason } => (Kind::InvalidArgument, vec![("reason", reason.into_py_any(py)?)]),
        E::PeerFailed { rank, message } => {
            (Kind::PeerFailed, vec![("rank", rank.into_py_any(py)?), ("message", message.into_py_any(py)?)])
        }
        E::Comm { reason } => (Kind::Comm, vec![("reason", reason.into_py_any(py)?)]),
        E::Io { path: p, source } => {
            let mut attrs = vec![("path", path(&p)?), ("reason", source.to_string().into_py_any(py)?)];
            if let Some(errno) = source.raw_os_error() {
                attrs.push(("errno", errno.into_py_any(py)?));
            }
            (Kind::StorageIO, attrs)
        }
        E::AccessDenied { path: p, reason } => {
            (Kind::AccessDenied, vec![("path", path(&p)?), ("reason", reason.into_py_any(py)?)])
        }
        E::CommitUnknown { path: p, reason } => {
            (Kind::CommitUnknown, vec![("path", path(&p)?), ("reason", reason.into_py_any(py)?)])
        }
        _ => (Kind::Base, Vec::new()),
    };
    let exc = classes(py)?[kind as usize].bind(py).call1((message,))?;
    for (name, value) in attrs {
        exc.setattr(name, value)?;
    }
    Ok(PyErr::from_value(exc))
}
