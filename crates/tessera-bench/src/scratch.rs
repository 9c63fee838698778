//! A benchmark's scratch space at a [`Location`]: claimed empty before a run (so removing it
//! later deletes only what the benchmark wrote), emptied between rounds, removed at the end.

use anyhow::{Context, Result};
use tessera::storage::Location;
use tessera::Storage;

/// What a benchmark does with the locations it writes to.
pub trait Scratch {
    /// Makes sure the location can hold objects: creates a local directory (and its parents);
    /// nothing to do for a URL (prefixes exist once an object is under them).
    fn create(&self) -> Result<()>;
    /// Claims the location as the benchmark's own: refused if anything is there already — a
    /// local path that is not an empty directory, or a prefix with objects under it. Creates
    /// the local directory.
    fn claim(&self) -> Result<()>;
    /// Removes everything at the location: the local directory (absent is fine), or every
    /// object directly under the prefix.
    fn remove(&self) -> Result<()>;
}

impl Scratch for Location {
    fn create(&self) -> Result<()> {
        if let Some(p) = self.local_dir() {
            std::fs::create_dir_all(p).with_context(|| format!("creating {}", p.display()))?;
        }
        Ok(())
    }

    fn claim(&self) -> Result<()> {
        let taken = match self.local_dir() {
            Some(p) => match std::fs::symlink_metadata(p) {
                Ok(m) if m.is_dir() => {
                    std::fs::read_dir(p).with_context(|| format!("reading {}", p.display()))?.next().is_some()
                }
                Ok(_) => true,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
                Err(e) => return Err(e).with_context(|| format!("examining {}", p.display())),
            },
            None => !self.open()?.list_recursive().with_context(|| format!("listing {self}"))?.is_empty(),
        };
        anyhow::ensure!(
            !taken,
            "{self} already exists and is not empty: this command writes its checkpoint there and deletes it \
             afterwards; remove it or choose another location"
        );
        self.create()
    }

    fn remove(&self) -> Result<()> {
        match self.local_dir() {
            Some(p) => match std::fs::remove_dir_all(p) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    Err(e).with_context(|| format!("removing {}", p.display()))
                }
                _ => Ok(()),
            },
            None => remove_objects(self.open()?.as_ref()).with_context(|| format!("removing {self}")),
        }
    }
}

/// Deletes every object of `storage`.
pub fn remove_objects(storage: &dyn Storage) -> tessera::Result<()> {
    for name in storage.list()? {
        storage.delete(&name)?;
    }
    Ok(())
}
