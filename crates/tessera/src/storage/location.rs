//! [`Location`]: where a checkpoint lives, as a user writes it (a path, `file://`, `mem://`,
//! `s3://`, `gs://`, `az://`), with the storage options it is opened with. The one parser of
//! location strings: the command line and the Python binding take theirs through it.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::{check_name, LocalStorage, MemoryStorage, ObjectWriter, Storage};
use crate::error::{Error, Result};

/// A checkpoint location: a local directory (a path or `file://` URL), `mem://name` (one
/// process-wide in-memory store per name: tests, demos), or an object-store URL (`s3://bucket/prefix`;
/// `gs://`, `az://` in builds with the `gcs` / `azure` features), and the storage options an
/// object store is opened with.
///
/// Storage options are `object_store` configuration keys and values (`("aws_endpoint",
/// "http://…")`, `("google_service_account", "/path/key.json")`, `("azure_storage_account_key",
/// "…")`, `azure_storage_connection_string`), applied over the environment and credential
/// files, as polars' and deltalake's `storage_options` are (see `ObjectStorage::open`). Local
/// paths and `mem://` take none and ignore them.
///
/// Its [`Display`](fmt::Display) is for messages and logs: it never shows option values, the
/// password of a URL or its query (where a SAS token would be); `Debug` shows option keys only.
///
/// ```
/// use tessera::storage::Location;
/// use tessera::{open, save, DType, SaveOptions, ShardedTensor, StateTree, TensorData};
/// use tessera::comm::SoloComm;
///
/// let dir = std::env::temp_dir().join(format!("tessera-doc-location-{}", std::process::id()));
/// let at = Location::parse(dir.to_str().unwrap()).join("step-1"); // created on first write
/// let w = ShardedTensor::full("w", DType::U8, &[3], TensorData::Owned(vec![1, 2, 3]));
/// save(StateTree::map().with("w", StateTree::Tensor(w)), &*at.open()?, &SoloComm, &SaveOptions::default())?;
/// let url = format!("file://{}/step-1", dir.display());
/// let tensors = open(&*Location::parse(&url).open()?)?.read_tensors(None)?;
/// std::fs::remove_dir_all(&dir).unwrap();
/// assert_eq!(tensors["w"].data, [1, 2, 3]);
///
/// // Options travel with the location; what is shown hides secrets.
/// let s3 = Location::parse("s3://bucket/run?sig=secret")
///     .with_options(&[("aws_secret_access_key".into(), "hunter2".into())]);
/// assert_eq!(s3.to_string(), "s3://bucket/run?…");
/// assert!(!format!("{s3:?}").contains("hunter2"));
/// assert_eq!(Location::parse("mem://doc").open()?.location(), "mem://doc");
/// # Ok::<(), tessera::Error>(())
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct Location {
    place: Place,
    options: Vec<(String, String)>,
}

#[derive(Clone, PartialEq, Eq, Debug)]
enum Place {
    Local(PathBuf),
    Memory(String),
    /// A URL of another scheme, without a trailing `/`.
    Url(String),
}

impl Location {
    /// Parses a location string: `mem://name`, `file://path`, any other `scheme://…` a URL
    /// (opened as an object store), anything else a local path (also one holding `://` after
    /// characters a scheme cannot have).
    pub fn parse(s: &str) -> Location {
        let place = if let Some(name) = s.strip_prefix("mem://") {
            Place::Memory(name.to_string())
        } else if let Some(path) = s.strip_prefix("file://") {
            Place::Local(PathBuf::from(path))
        } else {
            match s.split_once("://") {
                Some((scheme, _))
                    if !scheme.is_empty()
                        && scheme.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.')) =>
                {
                    Place::Url(s.trim_end_matches('/').to_string())
                }
                _ => Place::Local(PathBuf::from(s)),
            }
        };
        Location { place, options: Vec::new() }
    }

    /// A local directory.
    pub fn local(dir: impl Into<PathBuf>) -> Location {
        Location { place: Place::Local(dir.into()), options: Vec::new() }
    }

    /// This location opened with `options` (`object_store` configuration keys and values),
    /// replacing any it had. Local paths and `mem://` keep none.
    pub fn with_options(self, options: &[(String, String)]) -> Location {
        match self.place {
            Place::Url(_) => Location { options: options.to_vec(), ..self },
            _ => self,
        }
    }

    /// The storage options (none but for an object-store URL).
    pub fn options(&self) -> &[(String, String)] {
        &self.options
    }

    /// The local directory, if this is one.
    pub fn local_dir(&self) -> Option<&Path> {
        match &self.place {
            Place::Local(p) => Some(p),
            _ => None,
        }
    }

    /// The object-store URL (without a trailing `/`), if this is one. It may hold secrets
    /// (a SAS token): show the location itself instead.
    pub fn url(&self) -> Option<&str> {
        match &self.place {
            Place::Url(u) => Some(u),
            _ => None,
        }
    }

    /// `self/name`: a subdirectory, a sub-prefix of a URL (options kept), or a `mem://` store
    /// of that longer name.
    pub fn join(&self, name: &str) -> Location {
        let place = match &self.place {
            Place::Local(p) => Place::Local(p.join(name)),
            Place::Memory(m) => Place::Memory(format!("{}/{name}", m.trim_end_matches('/'))),
            Place::Url(u) => Place::Url(match u.split_once('?') {
                Some((base, query)) => format!("{}/{name}?{query}", base.trim_end_matches('/')),
                None => format!("{u}/{name}"),
            }),
        };
        Location { place, options: self.options.clone() }
    }

    /// Opens the storage. A local path naming an existing `.safetensors` file opens its
    /// directory read-only, showing that file alone (a plain safetensors file is a
    /// checkpoint too). A key in the options that the URL's store does not know is
    /// [`Error::InvalidArgument`]; a URL in a build without object stores is too.
    pub fn open(&self) -> Result<Arc<dyn Storage>> {
        match &self.place {
            Place::Memory(name) => Ok(Arc::new(MemoryStorage::named(name))),
            Place::Local(path) => Ok(open_local(path)),
            Place::Url(url) => self.open_url(url),
        }
    }

    #[cfg(any(feature = "s3", feature = "gcs", feature = "azure"))]
    fn open_url(&self, url: &str) -> Result<Arc<dyn Storage>> {
        let opts = super::ObjectStoreOptions { config: self.options.clone(), ..Default::default() };
        Ok(Arc::new(super::ObjectStorage::open(url, opts)?))
    }

    #[cfg(not(any(feature = "s3", feature = "gcs", feature = "azure")))]
    fn open_url(&self, _url: &str) -> Result<Arc<dyn Storage>> {
        Err(Error::invalid(format!(
            "unsupported location {self} (this build has no object stores: local paths, file://, mem://)"
        )))
    }
}

impl From<&str> for Location {
    fn from(s: &str) -> Location {
        Location::parse(s)
    }
}

/// A URL as shown: no password and no query.
fn redacted(url: &str) -> String {
    let (url, query) = match url.split_once('?') {
        Some((u, _)) => (u, "?…"),
        None => (url, ""),
    };
    let Some((scheme, rest)) = url.split_once("://") else { return format!("{url}{query}") };
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    // `user:password@host`: the password goes; a bare `name@host` (Azure's
    // `container@account…`) holds none.
    let authority = match authority.rsplit_once('@') {
        Some((user, host)) if user.contains(':') => format!("{}:…@{host}", user.split(':').next().unwrap_or("")),
        _ => authority.to_string(),
    };
    format!("{scheme}://{authority}{path}{query}")
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.place {
            Place::Local(p) => write!(f, "{}", p.display()),
            Place::Memory(m) => write!(f, "mem://{m}"),
            Place::Url(u) => f.write_str(&redacted(u)),
        }
    }
}

impl fmt::Debug for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Option values are often secrets: keys only.
        let keys: Vec<&str> = self.options.iter().map(|(k, _)| k.as_str()).collect();
        f.debug_struct("Location").field("at", &self.to_string()).field("option_keys", &keys).finish()
    }
}

/// Parses one storage option given as `KEY=VALUE` (a command line's `--storage-option`).
///
/// ```
/// assert_eq!(tessera::storage::parse_option("aws_region=eu-west-1")?, ("aws_region".into(), "eu-west-1".into()));
/// assert!(tessera::storage::parse_option("novalue").is_err());
/// # Ok::<(), tessera::Error>(())
/// ```
pub fn parse_option(s: &str) -> Result<(String, String)> {
    match s.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_string(), v.to_string())),
        _ => Err(Error::invalid(format!(
            "storage option {s:?}: give KEY=VALUE (an object_store configuration key, e.g. aws_endpoint=http://…)"
        ))),
    }
}

fn open_local(path: &Path) -> Arc<dyn Storage> {
    // A plain safetensors file is a checkpoint too: its directory, showing only that file.
    if path.extension().is_some_and(|e| e == "safetensors") && std::fs::metadata(path).is_ok_and(|m| m.is_file()) {
        if let (Some(dir), Some(name)) = (path.parent(), path.file_name().and_then(|n| n.to_str())) {
            let dir = if dir.as_os_str().is_empty() { Path::new(".") } else { dir };
            return Arc::new(OneFile {
                dir: LocalStorage::new(dir),
                name: name.to_string(),
                shown: path.display().to_string(),
            });
        }
    }
    Arc::new(LocalStorage::new(path))
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
        check_name(name)?;
        if name == self.name {
            Ok(())
        } else {
            Err(Error::not_found(format!("{}: {name}", self.shown)))
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
    fn is_local(&self) -> bool {
        self.dir.is_local()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_join_and_show() {
        assert_eq!(Location::parse("/tmp/x").local_dir(), Some(Path::new("/tmp/x")));
        assert_eq!(Location::parse("rel/dir").local_dir(), Some(Path::new("rel/dir")));
        assert_eq!(Location::parse("file:///tmp/x"), Location::local("/tmp/x"));
        assert_eq!(Location::parse("s3://b/p/").url(), Some("s3://b/p"));
        assert_eq!(Location::parse("s3://b/p").join("ckpt").url(), Some("s3://b/p/ckpt"));
        assert_eq!(Location::parse("/tmp/x").join("ckpt"), Location::local("/tmp/x/ckpt"));
        assert_eq!(Location::parse("mem://a/").join("b").to_string(), "mem://a/b");
        // Not a scheme: a local path that happens to contain "://".
        assert_eq!(Location::parse("a b://c"), Location::local("a b://c"));
        let opts = vec![("aws_region".to_string(), "x".to_string())];
        assert_eq!(Location::parse("s3://b/p").with_options(&opts).join("c").options(), &opts[..]);
        assert!(Location::parse("/tmp/x").with_options(&opts).options().is_empty());
        assert_eq!(Location::parse("https://u:pw@host/c?sv=1&sig=s").to_string(), "https://u:…@host/c?…");
        assert_eq!(Location::parse("s3://b/p").to_string(), "s3://b/p");
        assert_eq!(
            Location::parse("abfss://c@acc.dfs.core.windows.net/p").to_string(),
            "abfss://c@acc.dfs.core.windows.net/p"
        );
        assert_eq!(Location::parse("https://h/c?sv=1").join("x").url(), Some("https://h/c/x?sv=1"));
        assert_eq!(parse_option("k=v=w").unwrap(), ("k".into(), "v=w".into()));
        assert!(parse_option("=v").is_err());
    }
}
