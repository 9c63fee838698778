//! Checkpoint locations as the commands take them: a local directory (or `file://` path), or a
//! URL that [`tessera::open_location`] opens (`s3://bucket/prefix`, `mem://name`, …).

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use tessera::Storage;

/// Where a checkpoint (or a benchmark's scratch space) lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// A local directory.
    Local(PathBuf),
    /// An object-store (or other non-local) URL, without a trailing `/`.
    Url(String),
}

impl Location {
    /// Parses a location string: `scheme://…` (other than `file://`) is a URL, anything else a
    /// local path.
    pub fn parse(s: &str) -> Location {
        if let Some(path) = s.strip_prefix("file://") {
            return Location::Local(PathBuf::from(path));
        }
        match s.split_once("://") {
            Some((scheme, _))
                if !scheme.is_empty()
                    && scheme.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.')) =>
            {
                Location::Url(s.trim_end_matches('/').to_string())
            }
            _ => Location::Local(PathBuf::from(s)),
        }
    }

    /// The local directory, if this is one.
    pub fn local(&self) -> Option<&Path> {
        match self {
            Location::Local(p) => Some(p),
            Location::Url(_) => None,
        }
    }

    /// `self/name`: a subdirectory, or the URL with `/name` appended (a sub-prefix).
    pub fn join(&self, name: &str) -> Location {
        match self {
            Location::Local(p) => Location::Local(p.join(name)),
            Location::Url(u) => Location::Url(format!("{u}/{name}")),
        }
    }

    /// Opens the storage of this location ([`tessera::open_location`]; object stores are
    /// configured from the environment: `AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, …).
    pub fn open(&self) -> Result<Arc<dyn Storage>> {
        let s = match self {
            Location::Local(p) => p.to_str().with_context(|| format!("{}: not a UTF-8 path", p.display()))?.to_string(),
            Location::Url(u) => u.clone(),
        };
        tessera::open_location(&s).with_context(|| format!("opening {self}"))
    }

    /// Makes sure the location can hold objects: creates a local directory (and its parents);
    /// nothing to do for a URL (prefixes exist once an object is under them).
    pub fn create(&self) -> Result<()> {
        if let Location::Local(p) = self {
            std::fs::create_dir_all(p).with_context(|| format!("creating {}", p.display()))?;
        }
        Ok(())
    }

    /// Claims the location as a command's own scratch space (a benchmark's checkpoint, which it
    /// removes between rounds and at the end): refused if anything is there already — a local
    /// path that is not an empty directory (a file, a symlink, a directory with entries), or a
    /// prefix with objects under it — so that removing it later deletes only what the command
    /// wrote. Creates the local directory.
    pub fn claim(&self) -> Result<()> {
        let taken = match self {
            Location::Local(p) => match std::fs::symlink_metadata(p) {
                Ok(m) if m.is_dir() => {
                    std::fs::read_dir(p).with_context(|| format!("reading {}", p.display()))?.next().is_some()
                }
                Ok(_) => true,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
                Err(e) => return Err(e).with_context(|| format!("examining {}", p.display())),
            },
            Location::Url(_) => !self.open()?.list_recursive().with_context(|| format!("listing {self}"))?.is_empty(),
        };
        anyhow::ensure!(
            !taken,
            "{self} already exists and is not empty: this command writes its checkpoint there and deletes it \
             afterwards; remove it or choose another location"
        );
        self.create()
    }

    /// Removes everything at the location: the local directory (absent is fine), or every
    /// object directly under the prefix.
    pub fn remove(&self) -> Result<()> {
        match self {
            Location::Local(p) => match std::fs::remove_dir_all(p) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    Err(e).with_context(|| format!("removing {}", p.display()))
                }
                _ => Ok(()),
            },
            Location::Url(_) => remove_objects(self.open()?.as_ref()).with_context(|| format!("removing {self}")),
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

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Local(p) => write!(f, "{}", p.display()),
            Location::Url(u) => f.write_str(u),
        }
    }
}

/// What a command looked for and what it found instead, for an error that says one of the
/// command's `locations` holds no (committed) checkpoint: `Some(message)` when `err` is such
/// an error about one of them (not about a file inside one).
pub fn explain_missing(err: &anyhow::Error, locations: &[String]) -> Option<String> {
    let (path, committed_missing) = err.chain().find_map(|c| match c.downcast_ref::<tessera::Error>()? {
        tessera::Error::NotFound { path } => Some((path.clone(), false)),
        tessera::Error::NotCommitted { path } => Some((path.clone(), true)),
        _ => None,
    })?;
    let shown = path.to_str()?;
    if !locations.iter().any(|l| l.trim_end_matches('/') == shown.trim_end_matches('/')) {
        return None;
    }
    if !shown.contains("://") && !path.exists() {
        return Some(format!("no checkpoint at {shown}: no such directory"));
    }
    let storage = tessera::open_location(shown).ok()?;
    let names = match storage.list() {
        Ok(names) => names,
        Err(_) if !committed_missing => {
            return Some(format!("no checkpoint at {}: no such directory", path.display()));
        }
        Err(_) => return None,
    };
    let looked = "found neither tessera.index (tessera), .metadata (PyTorch DCP, Megatron torch_dist), \
                  metadata.json (Megatron, OLMo-core) nor model_and_optim/ (OLMo-core)";
    let data = names.iter().filter(|n| n.ends_with(".safetensors") || n.ends_with(".distcp")).count();
    Some(if names.is_empty() {
        format!("no checkpoint in {}: the directory is empty ({looked})", path.display())
    } else if committed_missing && data > 0 {
        format!(
            "no committed checkpoint in {}: {looked}, but {data} data file(s) of a save that never finished (or was \
             interrupted); `tessera gc {}` removes them",
            path.display(),
            path.display()
        )
    } else {
        let shown: Vec<&str> = names.iter().take(5).map(String::as_str).collect();
        let more = if names.len() > shown.len() { format!(", … ({} in all)", names.len()) } else { String::new() };
        format!("no checkpoint in {}: {looked}; it holds {}{more}", path.display(), shown.join(", "))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_join() {
        assert_eq!(Location::parse("/tmp/x"), Location::Local("/tmp/x".into()));
        assert_eq!(Location::parse("rel/dir"), Location::Local("rel/dir".into()));
        assert_eq!(Location::parse("file:///tmp/x"), Location::Local("/tmp/x".into()));
        assert_eq!(Location::parse("s3://b/p/"), Location::Url("s3://b/p".into()));
        assert_eq!(Location::parse("s3://b/p").join("ckpt"), Location::Url("s3://b/p/ckpt".into()));
        assert_eq!(Location::parse("s3://b").join("ckpt").to_string(), "s3://b/ckpt");
        assert_eq!(Location::parse("/tmp/x").join("ckpt"), Location::Local("/tmp/x/ckpt".into()));
        // Not a scheme: a local path that happens to contain "://".
        assert_eq!(Location::parse("a b://c"), Location::Local("a b://c".into()));
        assert!(Location::parse("s3://b/p").local().is_none());
    }
}
