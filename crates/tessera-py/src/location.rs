//! Checkpoint locations as Python hands them over: a plain string (a directory, `file://…`,
//! `s3://…`, `gs://…`, `az://…`), or a [`Location`] carrying `storage_options`.

use std::collections::BTreeMap;
use std::sync::Arc;

use pyo3::prelude::*;
use tessera::Storage;

/// A checkpoint location and the storage options it is opened with: `object_store`
/// configuration keys (`aws_endpoint`, `google_service_account`, `azure_storage_account_key`,
/// `azure_storage_connection_string`, …) applied over the environment and credential files,
/// as polars and deltalake take `storage_options`. Local paths ignore the options.
#[pyclass(frozen, from_py_object, module = "tessera._native")]
#[derive(Clone)]
pub struct Location {
    /// As given, for pickling and `url`.
    url: String,
    /// The storage options as given (a local path keeps them too, and ignores them).
    options: BTreeMap<String, String>,
    /// Parsed, with its options.
    location: tessera::storage::Location,
}

#[pymethods]
impl Location {
    /// `storage_options` values may be of any type: each is taken as its `str()` (`True` is
    /// `"True"`, which the stores read as true), as the `storage_options=` arguments do.
    #[new]
    #[pyo3(signature = (url, storage_options=None))]
    fn new(url: String, storage_options: Option<BTreeMap<String, Bound<'_, PyAny>>>) -> PyResult<Self> {
        let mut options = Vec::new();
        for (k, v) in storage_options.unwrap_or_default() {
            options.push((k, v.str()?.to_string()));
        }
        let location = tessera::storage::Location::parse(&url).with_options(&options);
        Ok(Location { url, options: options.into_iter().collect(), location })
    }

    /// Pickles as `Location(url, storage_options)` (to spawned ranks, say).
    fn __getnewargs__(&self) -> (String, BTreeMap<String, String>) {
        (self.url.clone(), self.storage_options())
    }

    /// The location as given.
    #[getter]
    fn url(&self) -> &str {
        &self.url
    }

    /// The storage options, as given.
    #[getter]
    fn storage_options(&self) -> BTreeMap<String, String> {
        self.options.clone()
    }

    /// The local directory (a plain path or `file://`), or None for other locations.
    #[getter]
    fn local_dir(&self) -> Option<String> {
        self.location.local_dir().map(|p| p.display().to_string())
    }

    fn __repr__(&self) -> String {
        // The location as the library shows it (no password, no query) and option keys only:
        // option values may be secrets.
        let keys: Vec<&str> = self.options.keys().map(String::as_str).collect();
        format!("Location({:?}, storage_options keys {keys:?})", self.location.to_string())
    }
}

/// A location argument of the native functions: a string, or a [`Location`].
#[derive(FromPyObject)]
pub enum LocationArg {
    /// With storage options.
    Configured(Location),
    /// A plain string: configured from the environment alone.
    Plain(String),
}

impl LocationArg {
    /// The library's location, with its options.
    pub fn location(&self) -> tessera::storage::Location {
        match self {
            LocationArg::Configured(l) => l.location.clone(),
            LocationArg::Plain(s) => tessera::storage::Location::parse(s),
        }
    }

    /// Opens the storage (the library's [`tessera::storage::Location`] parses it).
    pub fn open(&self) -> tessera::Result<Arc<dyn Storage>> {
        match self {
            LocationArg::Configured(l) => l.location.open(),
            LocationArg::Plain(s) => tessera::storage::Location::parse(s).open(),
        }
    }
}
