//! `PlanCache`: the Rust plan cache, held by a Python object across saves.

use std::sync::Arc;

use pyo3::prelude::*;

/// The global plan of this rank's last save, reused when the structure is unchanged (see
/// `tessera::PlanCache`). Keep one per rank across saves and pass it to every save.
#[pyclass(module = "tessera._native", frozen)]
pub struct PlanCache {
    pub(crate) inner: Arc<tessera::PlanCache>,
}

#[pymethods]
impl PlanCache {
    #[new]
    fn new() -> Self {
        PlanCache { inner: Arc::new(tessera::PlanCache::new()) }
    }

    /// Saves that reused the cached plan.
    #[getter]
    fn hits(&self) -> u64 {
        self.inner.hits()
    }

    /// Saves that planned from scratch with this cache.
    #[getter]
    fn misses(&self) -> u64 {
        self.inner.misses()
    }
}
