//! A pass-through storage that counts reads: how benchmarks and tests see how much of a
//! checkpoint an operation reads, on any backend.

use std::sync::atomic::{AtomicU64, Ordering};

use super::{ObjectWriter, Storage};
use crate::error::Result;

/// Wraps a [`Storage`], forwarding every call unchanged and counting the ranged reads
/// ([`Storage::read_at`], which whole reads also go through) and the bytes they return.
#[derive(Debug)]
pub struct CountingStorage<'a> {
    inner: &'a dyn Storage,
    reads: AtomicU64,
    bytes: AtomicU64,
}

impl<'a> CountingStorage<'a> {
    /// Counts the reads made through it into `inner`, from zero.
    pub fn new(inner: &'a dyn Storage) -> Self {
        CountingStorage { inner, reads: AtomicU64::new(0), bytes: AtomicU64::new(0) }
    }
    /// Ranged reads made so far.
    pub fn reads(&self) -> u64 {
        self.reads.load(Ordering::Relaxed)
    }
    /// Bytes read so far.
    pub fn bytes_read(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }
}

impl Storage for CountingStorage<'_> {
    fn location(&self) -> String {
        self.inner.location()
    }
    fn size(&self, name: &str) -> Result<u64> {
        self.inner.size(name)
    }
    fn is_local(&self) -> bool {
        self.inner.is_local()
    }
    fn read_at(&self, name: &str, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.reads.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(buf.len() as u64, Ordering::Relaxed);
        self.inner.read_at(name, offset, buf)
    }
    fn create(&self, name: &str, size: u64) -> Result<Box<dyn ObjectWriter>> {
        self.inner.create(name, size)
    }
    fn put_atomic(&self, name: &str, bytes: &[u8]) -> Result<()> {
        self.inner.put_atomic(name, bytes)
    }
    fn put_if_absent(&self, name: &str, bytes: &[u8]) -> Result<()> {
        self.inner.put_if_absent(name, bytes)
    }
    fn has_atomic_create(&self) -> bool {
        self.inner.has_atomic_create()
    }
    fn list(&self) -> Result<Vec<String>> {
        self.inner.list()
    }
    fn list_recursive(&self) -> Result<Vec<String>> {
        self.inner.list_recursive()
    }
    fn delete(&self, name: &str) -> Result<()> {
        self.inner.delete(name)
    }
}
