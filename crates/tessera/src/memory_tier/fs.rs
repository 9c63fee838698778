//! Every file operation of the memory tier on a node's root, in one place: the raw file calls
//! of the parity exchange, the rebuild, the scan and the deletions, and the [`Storage`] the
//! copies are written and read through. In builds with the `fault-injection` feature a test
//! can fail any one of them (before it takes effect, or after), as the fault sweep does for
//! every other writer.

use std::fs::{self, File};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::storage::{LocalStorage, Storage};

/// When an injected fault strikes a call (feature `fault-injection`).
#[cfg(feature = "fault-injection")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultWhen {
    /// The call fails without effect.
    Before,
    /// The call takes effect, then fails (a response lost on its way back).
    After,
}

/// Decides, for each file operation of the memory tier (its name and path), whether it fails.
#[cfg(feature = "fault-injection")]
pub type FaultHook = Arc<dyn Fn(&str, &Path) -> Option<FaultWhen> + Send + Sync>;

/// One entry of a directory listing.
pub(crate) struct Entry {
    pub name: String,
    pub path: PathBuf,
    pub is_dir: bool,
    pub len: u64,
}

/// The memory tier's file operations (plain `std::fs`, unless a fault hook is set).
#[derive(Clone, Default)]
pub(crate) struct NodeFs {
    #[cfg(feature = "fault-injection")]
    hook: Option<FaultHook>,
}

impl std::fmt::Debug for NodeFs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeFs").finish_non_exhaustive()
    }
}

/// Runs `f` under `hook`'s verdict for (`op`, `path`): as is, not at all, or with its result
/// replaced by the injected error.
#[cfg(feature = "fault-injection")]
fn strike<T>(hook: &FaultHook, op: &str, path: &Path, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let injected = || Error::io(path, std::io::Error::other(format!("injected fault in {op}")));
    match hook(op, path) {
        Some(FaultWhen::Before) => Err(injected()),
        Some(FaultWhen::After) => {
            let _ = f();
            Err(injected())
        }
        None => f(),
    }
}

impl NodeFs {
    #[cfg(feature = "fault-injection")]
    pub(crate) fn with_hook(hook: FaultHook) -> NodeFs {
        NodeFs { hook: Some(hook) }
    }

    #[cfg_attr(not(feature = "fault-injection"), allow(unused_variables))]
    fn run<T>(&self, op: &str, path: &Path, f: impl FnOnce() -> std::io::Result<T>) -> Result<T> {
        let f = || f().map_err(|e| Error::io(path, e));
        #[cfg(feature = "fault-injection")]
        if let Some(hook) = &self.hook {
            return strike(hook, op, path, f);
        }
        f()
    }

    /// The entries of `dir` with their kinds and sizes; entries that vanish meanwhile or whose
    /// names are not UTF-8 are left out.
    pub fn read_dir(&self, dir: &Path) -> Result<Vec<Entry>> {
        self.run("read_dir", dir, || {
            let mut out = Vec::new();
            for e in fs::read_dir(dir)?.flatten() {
                let (Ok(name), Ok(meta)) = (e.file_name().into_string(), e.metadata()) else { continue };
                out.push(Entry { name, path: e.path(), is_dir: meta.is_dir(), len: meta.len() });
            }
            Ok(out)
        })
    }

    pub fn read(&self, path: &Path) -> Result<Vec<u8>> {
        self.run("read", path, || fs::read(path))
    }

    /// Removes a file; one already gone is not an error.
    pub fn remove_file(&self, path: &Path) -> Result<()> {
        self.run("remove_file", path, || match fs::remove_file(path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            other => other,
        })
    }

    /// Removes a directory and what it holds; one already gone is not an error.
    pub fn remove_dir_all(&self, path: &Path) -> Result<()> {
        self.run("remove_dir_all", path, || match fs::remove_dir_all(path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            other => other,
        })
    }

    pub fn create_dir_all(&self, path: &Path) -> Result<()> {
        self.run("create_dir_all", path, || fs::create_dir_all(path))
    }

    pub fn rename(&self, from: &Path, to: &Path) -> Result<()> {
        self.run("rename", to, || fs::rename(from, to))
    }

    /// Opens a file to read, with its length.
    pub fn open(&self, path: &Path) -> Result<(File, u64)> {
        self.run("open", path, || {
            let f = File::open(path)?;
            let len = f.metadata()?.len();
            Ok((f, len))
        })
    }

    /// Creates (or truncates) a file of `len` bytes, to write.
    pub fn create(&self, path: &Path, len: u64) -> Result<File> {
        self.run("create", path, || {
            let f = File::create(path)?;
            f.set_len(len)?;
            Ok(f)
        })
    }

    pub fn read_at(&self, f: &File, path: &Path, buf: &mut [u8], offset: u64) -> Result<()> {
        self.run("read_at", path, || f.read_exact_at(buf, offset))
    }

    pub fn write_at(&self, f: &File, path: &Path, data: &[u8], offset: u64) -> Result<()> {
        self.run("write_at", path, || f.write_all_at(data, offset))
    }

    pub fn sync(&self, f: &File, path: &Path) -> Result<()> {
        self.run("sync", path, || f.sync_all())
    }

    /// The storage a copy (or the parity and markers of a step) is written and read through,
    /// rooted at `dir`: local, on tmpfs or a local disk.
    pub fn storage(&self, dir: &Path) -> Arc<dyn Storage> {
        let local = LocalStorage::new(dir).treat_as_local(true);
        #[cfg(feature = "fault-injection")]
        if let Some(hook) = &self.hook {
            return Arc::new(hooked::Hooked { inner: local, dir: dir.to_owned(), hook: hook.clone() });
        }
        Arc::new(local)
    }
}

/// A [`LocalStorage`] whose every call passes the fault hook first.
#[cfg(feature = "fault-injection")]
mod hooked {
    use std::path::PathBuf;

    use super::{strike, FaultHook};
    use crate::error::Result;
    use crate::storage::{LocalStorage, ObjectWriter, Storage};

    pub(super) struct Hooked {
        pub inner: LocalStorage,
        pub dir: PathBuf,
        pub hook: FaultHook,
    }

    impl std::fmt::Debug for Hooked {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("Hooked").field("dir", &self.dir).finish()
        }
    }

    fn run<T>(hook: &FaultHook, op: &str, path: PathBuf, f: impl FnOnce() -> Result<T>) -> Result<T> {
        strike(hook, op, &path, f)
    }

    impl Storage for Hooked {
        fn location(&self) -> String {
            self.inner.location()
        }
        fn size(&self, name: &str) -> Result<u64> {
            run(&self.hook, "size", self.dir.join(name), || self.inner.size(name))
        }
        fn is_local(&self) -> bool {
            true
        }
        fn read_at(&self, name: &str, offset: u64, buf: &mut [u8]) -> Result<()> {
            run(&self.hook, "read_at", self.dir.join(name), || self.inner.read_at(name, offset, buf))
        }
        fn read(&self, name: &str) -> Result<Vec<u8>> {
            run(&self.hook, "read", self.dir.join(name), || self.inner.read(name))
        }
        fn create(&self, name: &str, size: u64) -> Result<Box<dyn ObjectWriter>> {
            let w = run(&self.hook, "create", self.dir.join(name), || self.inner.create(name, size))?;
            Ok(Box::new(Writer { inner: w, path: self.dir.join(name), hook: self.hook.clone() }))
        }
        fn put_atomic(&self, name: &str, bytes: &[u8]) -> Result<()> {
            run(&self.hook, "put_atomic", self.dir.join(name), || self.inner.put_atomic(name, bytes))
        }
        fn put_if_absent(&self, name: &str, bytes: &[u8]) -> Result<()> {
            run(&self.hook, "put_if_absent", self.dir.join(name), || self.inner.put_if_absent(name, bytes))
        }
        fn has_atomic_create(&self) -> bool {
            self.inner.has_atomic_create()
        }
        fn list(&self) -> Result<Vec<String>> {
            run(&self.hook, "list", self.dir.clone(), || self.inner.list())
        }
        fn list_recursive(&self) -> Result<Vec<String>> {
            run(&self.hook, "list", self.dir.clone(), || self.inner.list_recursive())
        }
        fn delete(&self, name: &str) -> Result<()> {
            run(&self.hook, "delete", self.dir.join(name), || self.inner.delete(name))
        }
    }

    struct Writer {
        inner: Box<dyn ObjectWriter>,
        path: PathBuf,
        hook: FaultHook,
    }

    impl ObjectWriter for Writer {
        fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
            run(&self.hook, "write_at", self.path.clone(), || self.inner.write_at(offset, data))
        }
        fn finish(self: Box<Self>) -> Result<()> {
            let Writer { inner, path, hook } = *self;
            run(&hook, "finish", path, move || inner.finish())
        }
    }
}
