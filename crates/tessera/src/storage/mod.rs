//! Where checkpoint bytes live. A checkpoint is a flat set of named objects (a directory on a
//! filesystem, a prefix in an object store); every backend implements [`Storage`] with the
//! semantics written on each method, and passes the conformance suite in `tests/`.

mod counting;
mod local;
mod memory;
pub(crate) mod names;
#[cfg(any(feature = "s3", feature = "gcs", feature = "azure"))]
mod object;

pub use counting::CountingStorage;
pub use local::LocalStorage;
pub use memory::MemoryStorage;
#[cfg(any(feature = "s3", feature = "gcs", feature = "azure"))]
pub use object::{ObjectStorage, ObjectStoreOptions, RequestCounts};

use std::fmt;
use std::sync::Arc;

use crate::error::{Error, Result};

/// A namespace of objects holding one checkpoint.
///
/// Names are relative paths: plain components joined by `/` (no empty component, no `.` or
/// `..`, no `\\` or NUL); backends reject anything else with [`Error::InvalidArgument`], so
/// nothing is ever read or written outside the checkpoint. Writes and deletes take
/// single-component names only (nested ones are `InvalidArgument`); nested names are read in
/// the folders of foreign formats (zarr arrays, OLMo-core).
pub trait Storage: Send + Sync + fmt::Debug {
    /// Human-readable location, used in error messages (`/ckpt/step100`, `mem://x`).
    fn location(&self) -> String;

    /// Size of object `name`. Absent: [`Error::NotFound`].
    fn size(&self, name: &str) -> Result<u64>;

    /// Reads exactly `buf.len()` bytes of `name` from `offset`. Absent: [`Error::NotFound`];
    /// shorter than `offset + buf.len()`: [`Error::Corrupt`] (truncated). Safe to call from many
    /// threads at once.
    fn read_at(&self, name: &str, offset: u64, buf: &mut [u8]) -> Result<()>;

    /// Reads the whole object.
    fn read(&self, name: &str) -> Result<Vec<u8>> {
        let n = self.size(name)?;
        let mut buf = vec![0u8; n as usize];
        self.read_at(name, 0, &mut buf)?;
        Ok(buf)
    }

    /// Creates `name` (replacing any object of that name) with room for `size` bytes, for
    /// positioned writes from many threads. Not atomic: until [`ObjectWriter::finish`] returns,
    /// readers may see any mix of old, zero and new bytes, and a crash may leave it partial.
    /// The commit protocol never points at such an object before it is finished.
    fn create(&self, name: &str, size: u64) -> Result<Box<dyn ObjectWriter>>;

    /// Replaces `name` with `bytes` atomically: a reader sees the old object (or none) or the
    /// new one whole, never a mix, and after return the new object survives a crash.
    fn put_atomic(&self, name: &str, bytes: &[u8]) -> Result<()>;

    /// Like [`Storage::put_atomic`], but only if `name` does not exist: otherwise fails with
    /// [`Error::AlreadyExists`] and leaves the existing object alone. Atomic where the backend
    /// has a create-if-absent primitive (local: `link`; S3, GCS, Azure: a conditional put);
    /// [`Storage::has_atomic_create`] says whether it does. Without one, the check and the put
    /// are two steps and a concurrent writer can slip in between.
    fn put_if_absent(&self, name: &str, bytes: &[u8]) -> Result<()> {
        match self.size(name) {
            Ok(_) => Err(Error::AlreadyExists { path: format!("{}/{name}", self.location()).into() }),
            Err(Error::NotFound { .. }) => self.put_atomic(name, bytes),
            Err(e) => Err(e),
        }
    }

    /// True when [`Storage::put_if_absent`] is atomic.
    fn has_atomic_create(&self) -> bool {
        false
    }

    /// Names of the objects directly in the checkpoint (single-component names), in no
    /// particular order. A missing checkpoint location lists empty.
    fn list(&self) -> Result<Vec<String>>;

    /// Names of all objects at any depth (`/`-joined), in no particular order. The default is
    /// [`Storage::list`], right for backends that hold no nested names. An entry no read could
    /// serve (on a local directory: a link, a FIFO) is refused with [`Error::Corrupt`] naming
    /// it, not left out: the formats that list take the listing as the checkpoint's contents.
    fn list_recursive(&self) -> Result<Vec<String>> {
        self.list()
    }

    /// Removes `name`. Absent is not an error. Not atomic with respect to other objects.
    fn delete(&self, name: &str) -> Result<()>;
}

/// Positioned writes into one object being created.
pub trait ObjectWriter: Send + Sync {
    /// Writes `data` at `offset`. Regions written by concurrent calls must not overlap.
    fn write_at(&self, offset: u64, data: &[u8]) -> Result<()>;
    /// Makes every written byte durable and visible; after it returns the object is complete.
    fn finish(self: Box<Self>) -> Result<()>;
}

/// Opens a checkpoint location given as a string: a local directory path (or `file://` URL),
/// `mem://name` for a process-wide in-memory store (tests, demos), or an object-store URL
/// (`s3://bucket/prefix`; `gs://`, `az://` in builds with the `gcs` / `azure` features)
/// configured from the environment (see [`ObjectStorage::open`]).
pub fn open_location(location: &str) -> Result<Arc<dyn Storage>> {
    if let Some(name) = location.strip_prefix("mem://") {
        return Ok(Arc::new(MemoryStorage::named(name)));
    }
    if let Some((scheme, _)) = location.split_once("://") {
        if scheme != "file" {
            #[cfg(any(feature = "s3", feature = "gcs", feature = "azure"))]
            return Ok(Arc::new(ObjectStorage::open(location, ObjectStoreOptions::default())?));
            #[cfg(not(any(feature = "s3", feature = "gcs", feature = "azure")))]
            return Err(Error::invalid(format!(
                "unsupported location scheme {scheme:?} in {location:?} (this build has no object stores: \
                 local paths, file://, mem://)"
            )));
        }
    }
    let path = location.strip_prefix("file://").unwrap_or(location);
    let p = std::path::Path::new(path);
    // A plain safetensors file is a checkpoint too: its directory, showing only that file.
    if path.ends_with(".safetensors") && std::fs::metadata(p).is_ok_and(|m| m.is_file()) {
        if let (Some(dir), Some(name)) = (p.parent(), p.file_name().and_then(|n| n.to_str())) {
            let dir = if dir.as_os_str().is_empty() { std::path::Path::new(".") } else { dir };
            return Ok(Arc::new(OneFile { dir: LocalStorage::new(dir), name: name.to_string(), shown: path.into() }));
        }
    }
    Ok(Arc::new(LocalStorage::new(path)))
}

/// One file of a local directory as a read-only location (a plain safetensors file opened as a
/// checkpoint): it lists that file only, and reads nothing else.
#[derive(Debug)]
struct OneFile {
    dir: LocalStorage,
    name: String,
    /// The path as given, for messages.
    shown: String,
}

impl OneFile {
    fn only(&self, name: &str) -> Result<()> {
        if name == self.name {
            Ok(())
        } else {
            Err(Error::NotFound { path: format!("{}: {name}", self.shown).into() })
        }
    }
    fn read_only(&self) -> Error {
        Error::invalid(format!("{} is a file, opened read-only as a checkpoint: write into a directory", self.shown))
    }
}

impl Storage for OneFile {
    fn location(&self) -> String {
        self.shown.clone()
    }
    fn size(&self, name: &str) -> Result<u64> {
        self.only(name)?;
        self.dir.size(name)
    }
    fn read_at(&self, name: &str, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.only(name)?;
        self.dir.read_at(name, offset, buf)
    }
    fn create(&self, _: &str, _: u64) -> Result<Box<dyn ObjectWriter>> {
        Err(self.read_only())
    }
    fn put_atomic(&self, _: &str, _: &[u8]) -> Result<()> {
        Err(self.read_only())
    }
    fn list(&self) -> Result<Vec<String>> {
        Ok(vec![self.name.clone()])
    }
    fn delete(&self, _: &str) -> Result<()> {
        Err(self.read_only())
    }
}

/// The size of `name`, or `None` if it does not exist (any other failure is an error).
pub(crate) fn size_if_present(storage: &dyn Storage, name: &str) -> Result<Option<u64>> {
    match storage.size(name) {
        Ok(s) => Ok(Some(s)),
        Err(Error::NotFound { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Checks that `len` bytes at `offset` of `name` — a length some file claims — lie inside the
/// object's real size, before anything is allocated for them. `what` names the claim (file and
/// key) in the error. Every reader that sizes a buffer from a number found in a file goes
/// through this (or [`read_claimed`]), so memory is bounded by what is on disk.
pub(crate) fn check_claimed(storage: &dyn Storage, name: &str, offset: u64, len: u64, what: &str) -> Result<()> {
    let size = storage.size(name)?;
    if offset.checked_add(len).is_none_or(|end| end > size) {
        return Err(Error::corrupt(
            format!("{}/{name}", storage.location()),
            format!("{what}: claims {len} bytes at offset {offset}, the file has {size}"),
        ));
    }
    if usize::try_from(len).is_err() {
        return Err(Error::corrupt(format!("{}/{name}", storage.location()), format!("{what}: {len} bytes")));
    }
    Ok(())
}

/// Reads `len` bytes of `name` at `offset` after [`check_claimed`].
pub(crate) fn read_claimed(storage: &dyn Storage, name: &str, offset: u64, len: u64, what: &str) -> Result<Vec<u8>> {
    check_claimed(storage, name, offset, len, what)?;
    let mut buf = vec![0u8; len as usize];
    storage.read_at(name, offset, &mut buf)?;
    Ok(buf)
}

/// Names tessera writes (and deletes): one plain component.
pub(crate) fn check_plain_name(name: &str) -> Result<()> {
    names::check_file_name(name).map_err(Error::invalid)
}

/// Names that may be read: plain components joined by `/`.
pub(crate) fn check_name(name: &str) -> Result<()> {
    names::check_relative_name(name).map_err(Error::invalid)
}
