//! Where checkpoint bytes live. A checkpoint is a flat set of named objects (a directory on a
//! filesystem, a prefix in an object store); every backend implements [`Storage`] with the
//! semantics written on each method, and passes the conformance suite (`storage/conformance.rs`,
//! public as `tessera::storage::conformance` under the cargo feature `conformance`).
//!
//! The split follows the `object_store` crate's `ObjectStore` / `ObjectStoreExt`: [`Storage`]
//! holds what only a backend can do (each method with written atomicity, overwrite, visibility
//! and error semantics), [`StorageExt`] the conveniences built on it, implemented once for every
//! storage.

#[cfg(feature = "conformance")]
pub mod conformance;
mod counting;
mod local;
mod location;
mod memory;
pub(crate) mod names;
#[cfg(any(feature = "s3", feature = "gcs", feature = "azure"))]
mod object;

pub use counting::CountingStorage;
pub use local::LocalStorage;
pub use location::{parse_option, Location};
pub use memory::MemoryStorage;
#[cfg(any(feature = "s3", feature = "gcs", feature = "azure"))]
pub use object::{ObjectStorage, ObjectStoreOptions, RequestCounts};

use std::fmt;
use std::ops::Range;

use crate::error::{Error, Result};

/// The name prefix of the short-lived object an object store's first commit creates to learn
/// whether the store honours conditional puts. It lives, for moments, in the location a save
/// writes, so a concurrent save's check for foreign files must not take it for one.
pub(crate) const CONDITIONAL_PUT_PROBE: &str = ".tessera-conditional-put-probe-";

/// A namespace of objects holding one checkpoint.
///
/// Names are relative paths: plain components joined by `/` (no empty component, no `.` or
/// `..`, no `\\` or NUL); every method rejects anything else with [`Error::InvalidArgument`],
/// so nothing is ever read or written outside the checkpoint. Writes and deletes take
/// single-component names only (nested ones are `InvalidArgument`); nested names are read in
/// the folders of foreign formats (zarr arrays, OLMo-core).
///
/// A backend implements seven methods: [`location`](Storage::location),
/// [`size`](Storage::size), [`read_at`](Storage::read_at), [`create`](Storage::create),
/// [`put_atomic`](Storage::put_atomic), [`list`](Storage::list) and
/// [`delete`](Storage::delete). The provided ones ([`read`](Storage::read),
/// [`put_if_absent`](Storage::put_if_absent), [`has_atomic_create`](Storage::has_atomic_create),
/// [`list_recursive`](Storage::list_recursive)) have defaults built on those seven, and stay in
/// this trait because a backend may have to override them: for atomicity only it can provide,
/// for a listing only it knows, or to do in one request what the default does in two.
/// Conveniences no backend needs to change are in [`StorageExt`].
///
/// Errors, for every method: an absent object is [`Error::NotFound`]; bytes that are not what
/// the method promises (a short object, an entry that is no regular object) are
/// [`Error::Corrupt`]; a bad name is [`Error::InvalidArgument`]; a failure of the medium or the
/// network (after the backend's own retries) is [`Error::Io`].
///
/// Visibility: a call that returned is seen by every later call through the same storage
/// value, from any thread (read-after-write, list-after-write and read-after-delete). Across
/// processes, or other storage values on the same location, the medium's consistency applies:
/// S3, GCS and Azure are read-after-write consistent; a [`LocalStorage`] keeps files open for
/// [`read_at`](Storage::read_at), so an object another process replaced may still be read at
/// its old bytes there until this storage writes or deletes that name itself (its
/// [`size`](Storage::size), [`read`](Storage::read) and [`list`](Storage::list) see the new
/// one). An object being written with [`create`](Storage::create) is visible in full only once
/// its [`ObjectWriter::finish`] returns.
pub trait Storage: Send + Sync + fmt::Debug {
    /// Human-readable location, used in error messages (`/ckpt/step100`, `mem://x`). Never
    /// empty.
    fn location(&self) -> String;

    /// Size of object `name`. Absent: [`Error::NotFound`].
    fn size(&self, name: &str) -> Result<u64>;

    /// Reads exactly `buf.len()` bytes of `name` from `offset`. Absent: [`Error::NotFound`]
    /// (also for an empty `buf`); shorter than `offset + buf.len()`, or a range past any
    /// possible end (`offset + buf.len()` overflows, or exceeds `i64::MAX`): [`Error::Corrupt`]
    /// (truncated), never a panic and never a short read. Safe to call from many threads at
    /// once. Reads of an object being replaced may see the old or the new object; each call
    /// sees bytes of one of them only where the backend's replacement is atomic
    /// ([`put_atomic`](Storage::put_atomic)).
    fn read_at(&self, name: &str, offset: u64, buf: &mut [u8]) -> Result<()>;

    /// Reads the whole object: its size, then its bytes. Absent: [`Error::NotFound`].
    ///
    /// Stays in `Storage` (not [`StorageExt`]) because backends override it: the default is
    /// two steps ([`size`](Storage::size), then [`read_at`](Storage::read_at)), so an object
    /// replaced in between reads as `Corrupt` (shorter) or cut short (longer), and it costs two
    /// requests. An override returns the bytes of one object whole (local: one open file; object
    /// stores: one GET).
    fn read(&self, name: &str) -> Result<Vec<u8>> {
        let n = self.size(name)?;
        let n = usize::try_from(n)
            .map_err(|_| Error::corrupt(format!("{}/{name}", self.location()), "too large to read whole"))?;
        let mut buf = vec![0u8; n];
        self.read_at(name, 0, &mut buf)?;
        Ok(buf)
    }

    /// Creates `name` (replacing any object of that name) with room for `size` bytes, for
    /// positioned writes from many threads. Not atomic: until [`ObjectWriter::finish`] returns,
    /// readers may see any mix of old, zero and new bytes (or no object), and a crash may leave
    /// it partial. Bytes never written read as zeros. The commit protocol never points at such
    /// an object before it is finished. A plain name only (nested: `InvalidArgument`).
    fn create(&self, name: &str, size: u64) -> Result<Box<dyn ObjectWriter>>;

    /// Replaces `name` with `bytes` atomically: a reader sees the old object (or none) or the
    /// new one whole, never a mix, and after return the new object is visible and survives a
    /// crash. Overwrites any existing object; leaves no other object behind (no visible
    /// temporary). A plain name only (nested: `InvalidArgument`).
    fn put_atomic(&self, name: &str, bytes: &[u8]) -> Result<()>;

    /// Like [`Storage::put_atomic`], but only if `name` does not exist: otherwise fails with
    /// [`Error::AlreadyExists`] and leaves the existing object alone. A plain name only.
    ///
    /// Stays in `Storage` because only the backend can make it atomic: where it has a
    /// create-if-absent primitive (local: `link`; memory: one lock; S3, GCS, Azure: a
    /// conditional put) it overrides this and says so with
    /// [`has_atomic_create`](Storage::has_atomic_create). The default checks
    /// ([`size`](Storage::size)) then puts: two steps, and a concurrent writer can slip in
    /// between. The commit of a checkpoint is one such call.
    fn put_if_absent(&self, name: &str, bytes: &[u8]) -> Result<()> {
        check_plain_name(name)?;
        check_then_put(self, name, bytes)
    }

    /// True when [`Storage::put_if_absent`] is atomic: of concurrent calls for one name, at most
    /// one succeeds. A property of the backend, overridden together with `put_if_absent`;
    /// false by default.
    fn has_atomic_create(&self) -> bool {
        false
    }

    /// True when the bytes live on this machine (a local disk or tmpfs, through the page cache;
    /// memory; for [`LocalStorage`], a filesystem it knows to be local): a request has no round
    /// trip to amortize, and concurrent writes into one file gain nothing (the kernel serializes
    /// them on the file). The load then reads a long range in pieces the CPU cache holds and
    /// checks each piece while it is there, and the save writes a file from one thread,
    /// checksumming each piece just before writing it. Where a request has a latency or a price
    /// (object stores, network filesystems), they keep large requests, several in flight, and
    /// ranks loading together share the checking of blocks. A hint about cost only, never about
    /// results; false by default.
    fn is_local(&self) -> bool {
        false
    }

    /// Names of the objects directly in the checkpoint (single-component names), in no
    /// particular order. A missing checkpoint location lists empty. Lists exactly the objects
    /// that [`size`](Storage::size) finds at the time of the call: no temporary of an
    /// unfinished [`put_atomic`](Storage::put_atomic), no entry a read would refuse; an object
    /// still being written with [`create`](Storage::create) may or may not be listed.
    fn list(&self) -> Result<Vec<String>>;

    /// Names of all objects at any depth (`/`-joined), in no particular order; every name of
    /// [`list`](Storage::list) is among them. An entry no read could serve (on a local
    /// directory: a link, a FIFO) is refused with [`Error::Corrupt`] naming it, not left out:
    /// the formats that list take the listing as the checkpoint's contents.
    ///
    /// Stays in `Storage` because only the backend knows its nested names: the default is
    /// [`Storage::list`], right for backends that hold none.
    fn list_recursive(&self) -> Result<Vec<String>> {
        self.list()
    }

    /// Removes `name`. Absent is not an error (deleting twice succeeds). Affects no other
    /// object, and is not atomic with respect to other objects: a crash between two deletes
    /// leaves the second object in place. After return the object is absent for every reader.
    /// A plain name only (nested: `InvalidArgument`).
    fn delete(&self, name: &str) -> Result<()>;
}

/// Positioned writes into one object being created ([`Storage::create`]).
pub trait ObjectWriter: Send + Sync {
    /// Writes `data` at `offset`. Regions written by concurrent calls must not overlap; writing
    /// past the size given to [`Storage::create`] is an error or grows the object, by backend.
    /// Nothing written is visible or durable before [`finish`](ObjectWriter::finish).
    fn write_at(&self, offset: u64, data: &[u8]) -> Result<()>;
    /// Makes every written byte durable and visible; after it returns the object is complete.
    /// A writer dropped without `finish` leaves the object absent or partial (never claimed
    /// complete); object stores abort the upload.
    fn finish(self: Box<Self>) -> Result<()>;
}

/// Conveniences over any [`Storage`], implemented once for all of them (the blanket impl
/// below): built on the trait's methods only, so no backend implements or overrides them.
/// Bring it into scope (`use tessera::storage::StorageExt;`) to call them.
pub trait StorageExt: Storage {
    /// The size of `name`, or `None` if it does not exist ([`Error::NotFound`]); any other
    /// failure is an error.
    fn size_if_present(&self, name: &str) -> Result<Option<u64>> {
        match self.size(name) {
            Ok(s) => Ok(Some(s)),
            Err(Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Whether `name` exists ([`StorageExt::size_if_present`] is `Some`).
    fn exists(&self, name: &str) -> Result<bool> {
        Ok(self.size_if_present(name)?.is_some())
    }

    /// Reads bytes `range` of `name` into a new buffer: [`Storage::read_at`] with the same
    /// errors (an empty or reversed range reads nothing, but still fails for an absent object).
    /// The caller bounds `range`: a length taken from untrusted bytes is checked against the
    /// object first.
    fn read_range(&self, name: &str, range: Range<u64>) -> Result<Vec<u8>> {
        let len = range.end.saturating_sub(range.start);
        let len = usize::try_from(len).map_err(|_| {
            Error::corrupt(format!("{}/{name}", self.location()), format!("{len} bytes at offset {}", range.start))
        })?;
        let mut buf = vec![0u8; len];
        self.read_at(name, range.start, &mut buf)?;
        Ok(buf)
    }

    /// The names of [`Storage::list`], sorted.
    fn list_sorted(&self) -> Result<Vec<String>> {
        let mut names = self.list()?;
        names.sort();
        Ok(names)
    }
}

impl<S: Storage + ?Sized> StorageExt for S {}

/// The two-step create-if-absent of backends without an atomic one: [`Storage::size`], then
/// [`Storage::put_atomic`] if `name` is not there (a concurrent writer can slip in between).
pub(crate) fn check_then_put<S: Storage + ?Sized>(storage: &S, name: &str, bytes: &[u8]) -> Result<()> {
    match storage.size(name) {
        Ok(_) => Err(Error::AlreadyExists { path: format!("{}/{name}", storage.location()).into() }),
        Err(Error::NotFound { .. }) => storage.put_atomic(name, bytes),
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
    storage.read_range(name, offset..offset + len)
}

/// The name of the temporary object an atomic put of `name` writes first (a local directory's
/// [`Storage::put_atomic`] and [`Storage::put_if_absent`]): `.{name}.tmp-{pid}-{nonce}`, hidden,
/// and told apart by writer and time (`nonce`: nanoseconds since the Unix epoch).
pub(crate) fn temporary_name(name: &str, pid: u32, nonce: u128) -> String {
    format!(".{name}.tmp-{pid}-{nonce}")
}

/// The object a temporary of [`temporary_name`] is for; `None` for any other name. A temporary
/// left behind is garbage of a put that never finished (`gc` removes them).
pub(crate) fn temporary_target(name: &str) -> Option<&str> {
    temporary_parts(name).map(|(target, _)| target)
}

/// When the temporary `name` of [`temporary_name`] was made, in milliseconds since the Unix
/// epoch (by its writer's clock); `None` for any other name.
pub(crate) fn temporary_time_ms(name: &str) -> Option<u64> {
    temporary_parts(name).and_then(|(_, nonce)| u64::try_from(nonce / 1_000_000).ok())
}

fn temporary_parts(name: &str) -> Option<(&str, u128)> {
    let rest = name.strip_prefix('.')?;
    let at = rest.rfind(".tmp-")?;
    let (pid, nonce) = rest[at + 5..].split_once('-')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !(digits(pid) && digits(nonce) && at > 0) {
        return None;
    }
    Some((&rest[..at], nonce.parse().ok()?))
}

/// Names tessera writes (and deletes): one plain component.
pub(crate) fn check_plain_name(name: &str) -> Result<()> {
    names::check_file_name(name).map_err(Error::invalid)
}

/// Names that may be read: plain components joined by `/`.
pub(crate) fn check_name(name: &str) -> Result<()> {
    names::check_relative_name(name).map_err(Error::invalid)
}
