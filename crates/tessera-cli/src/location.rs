//! Checkpoint locations as the commands take them: a local directory (or `file://` path), or a
//! URL that [`tessera::open_location`] opens (`s3://bucket/prefix`, `mem://name`, …).

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use tessera::Storage;

/// Where a checkpoint (or a benchmark's scratch space) lives.
#[derive(Clone, PartialEq, Eq)]
pub enum Location {
    /// A local directory.
    Local(PathBuf),
    /// An object-store (or other non-local) URL, without a trailing `/`, and the storage
    /// options it is opened with (`object_store` configuration keys: `--storage-option`).
    Url(String, Vec<(String, String)>),
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
                Location::Url(s.trim_end_matches('/').to_string(), Vec::new())
            }
            _ => Location::Local(PathBuf::from(s)),
        }
    }

    /// This location opened with `options` (`KEY=VALUE` pairs of `object_store` configuration
    /// keys) if it is a URL; a local path takes none.
    pub fn with_options(self, options: &[(String, String)]) -> Location {
        match self {
            Location::Url(u, _) => Location::Url(u, options.to_vec()),
            local => local,
        }
    }

    /// The storage options of a URL (none for a local path).
    pub fn options(&self) -> &[(String, String)] {
        match self {
            Location::Url(_, options) => options,
            Location::Local(_) => &[],
        }
    }

    /// The local directory, if this is one.
    pub fn local(&self) -> Option<&Path> {
        match self {
            Location::Local(p) => Some(p),
            Location::Url(..) => None,
        }
    }

    /// `self/name`: a subdirectory, or the URL with `/name` appended (a sub-prefix).
    pub fn join(&self, name: &str) -> Location {
        match self {
            Location::Local(p) => Location::Local(p.join(name)),
            Location::Url(u, options) => Location::Url(format!("{u}/{name}"), options.clone()),
        }
    }

    /// Opens the storage of this location ([`tessera::open_location_with`]; object stores are
    /// configured from the environment and credential files — `AWS_ENDPOINT_URL`,
    /// `AWS_ACCESS_KEY_ID`, `~/.aws/credentials`, `GOOGLE_SERVICE_ACCOUNT`, `AZURE_STORAGE_*`,
    /// … — then from the storage options).
    pub fn open(&self) -> Result<Arc<dyn Storage>> {
        let s = match self {
            Location::Local(p) => p.to_str().with_context(|| format!("{}: not a UTF-8 path", p.display()))?.to_string(),
            Location::Url(u, _) => u.clone(),
        };
        tessera::open_location_with(&s, self.options()).with_context(|| format!("opening {self}"))
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
            Location::Url(..) => !self.open()?.list_recursive().with_context(|| format!("listing {self}"))?.is_empty(),
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
            Location::Url(..) => remove_objects(self.open()?.as_ref()).with_context(|| format!("removing {self}")),
        }
    }
}

/// The `--storage-option KEY=VALUE` option of the commands (flattened into their clap parsers,
/// global: it reaches every location of every subcommand).
#[derive(clap::Args, Clone, Default)]
pub struct StorageOptionArg {
    /// An `object_store` configuration key for object-store locations, over the environment
    /// and credential files (repeatable): aws_endpoint=http://host:9000,
    /// google_service_account=/path/key.json, azure_storage_account_key=…,
    /// azure_storage_connection_string=…
    #[arg(long = "storage-option", global = true, value_name = "KEY=VALUE", value_parser = parse_storage_option)]
    pub storage_options: Vec<(String, String)>,
}

fn parse_storage_option(s: &str) -> std::result::Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_string(), v.to_string())),
        _ => Err(format!("{s:?}: give KEY=VALUE (an object_store configuration key, e.g. aws_endpoint=http://…)")),
    }
}

/// Deletes every object of `storage`.
pub fn remove_objects(storage: &dyn Storage) -> tessera::Result<()> {
    for name in storage.list()? {
        storage.delete(&name)?;
    }
    Ok(())
}

impl fmt::Debug for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Local(p) => f.debug_tuple("Local").field(p).finish(),
            // Option values are often secrets: keys only.
            Location::Url(u, options) => {
                let keys: Vec<&str> = options.iter().map(|(k, _)| k.as_str()).collect();
                f.debug_tuple("Url").field(u).field(&keys).finish()
            }
        }
    }
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Local(p) => write!(f, "{}", p.display()),
            Location::Url(u, _) => f.write_str(u),
        }
    }
}

/// What a command looked for and what it found instead, for an error that says one of the
/// command's `locations` holds no (committed) checkpoint: `Some(message)` when `err` is such
/// an error about one of them (not about a file inside one). The message is the library's own
/// (what Python callers get too): the location's contents and what to do.
pub fn explain_missing(err: &anyhow::Error, locations: &[String]) -> Option<String> {
    let (path, detail) = err.chain().find_map(|c| match c.downcast_ref::<tessera::Error>()? {
        tessera::Error::NotFound { path, detail } | tessera::Error::NotCommitted { path, detail } => {
            Some((path, detail.as_ref()?))
        }
        _ => None,
    })?;
    let shown = path.to_str()?;
    locations.iter().any(|l| l.trim_end_matches('/') == shown.trim_end_matches('/')).then(|| detail.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_join() {
        assert_eq!(Location::parse("/tmp/x"), Location::Local("/tmp/x".into()));
        assert_eq!(Location::parse("rel/dir"), Location::Local("rel/dir".into()));
        assert_eq!(Location::parse("file:///tmp/x"), Location::Local("/tmp/x".into()));
        assert_eq!(Location::parse("s3://b/p/"), Location::Url("s3://b/p".into(), Vec::new()));
        assert_eq!(Location::parse("s3://b/p").join("ckpt"), Location::Url("s3://b/p/ckpt".into(), Vec::new()));
        assert_eq!(Location::parse("s3://b").join("ckpt").to_string(), "s3://b/ckpt");
        assert_eq!(Location::parse("/tmp/x").join("ckpt"), Location::Local("/tmp/x/ckpt".into()));
        // Not a scheme: a local path that happens to contain "://".
        assert_eq!(Location::parse("a b://c"), Location::Local("a b://c".into()));
        assert!(Location::parse("s3://b/p").local().is_none());
        let opts = vec![("aws_region".to_string(), "x".to_string())];
        assert_eq!(Location::parse("s3://b/p").with_options(&opts).join("c").options(), &opts[..]);
        assert!(Location::parse("/tmp/x").with_options(&opts).options().is_empty());
        assert_eq!(parse_storage_option("k=v=w"), Ok(("k".into(), "v=w".into())));
        assert!(parse_storage_option("novalue").is_err());
        assert!(parse_storage_option("=v").is_err());
    }
}
