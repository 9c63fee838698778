//! Checkpoints in object stores (S3 and S3-compatible, GCS, Azure) through the `object_store`
//! crate. One backend for all of them: ranged GETs for reads, multipart uploads with explicit
//! part numbers for positioned writes, conditional puts for the commit, retries with backoff.

use std::collections::HashMap;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use object_store::multipart::{MultipartStore, PartId};
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};

#[cfg(feature = "azure")]
mod azure;
mod credentials;
#[cfg(feature = "gcs")]
mod gcs;
#[cfg(feature = "s3")]
mod s3;

use super::{check_name, ObjectWriter, Storage, CONDITIONAL_PUT_PROBE};
use crate::error::{Error, Result};

/// How an [`ObjectStorage`] talks to its store.
#[derive(Clone)]
pub struct ObjectStoreOptions {
    /// Size of each part of a multipart upload (at least 5 MiB on S3; raised for objects
    /// that would need more than 10,000 parts).
    pub part_size: u64,
    /// Objects up to this size are uploaded with one PUT from a buffer.
    pub single_put_max: u64,
    /// Per-request timeout.
    pub timeout: Duration,
    /// Retries of a failed request (5xx, throttling, timeouts, dropped connections), with
    /// exponential backoff.
    pub max_retries: usize,
    /// Extra `object_store` configuration (`("aws_endpoint", "http://…")`, …) applied after the
    /// environment.
    pub config: Vec<(String, String)>,
}

impl std::fmt::Debug for ObjectStoreOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Configuration values are often secrets (keys, tokens, connection strings): keys only.
        let keys: Vec<&str> = self.config.iter().map(|(k, _)| k.as_str()).collect();
        f.debug_struct("ObjectStoreOptions")
            .field("part_size", &self.part_size)
            .field("single_put_max", &self.single_put_max)
            .field("timeout", &self.timeout)
            .field("max_retries", &self.max_retries)
            .field("config_keys", &keys)
            .finish()
    }
}

impl Default for ObjectStoreOptions {
    fn default() -> Self {
        ObjectStoreOptions {
            part_size: 16 << 20,
            single_put_max: 16 << 20,
            timeout: Duration::from_secs(60),
            max_retries: 10,
            config: Vec::new(),
        }
    }
}

/// Requests an [`ObjectStorage`] has issued (each retry of a request counts once more at the
/// HTTP level but once here).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestCounts {
    /// GETs (whole or ranged).
    pub gets: u64,
    /// Bytes received by GETs.
    pub bytes_downloaded: u64,
    /// HEADs.
    pub heads: u64,
    /// Single-request PUTs (small objects, the index).
    pub puts: u64,
    /// Parts uploaded.
    pub parts: u64,
    /// Bytes sent by PUTs and parts.
    pub bytes_uploaded: u64,
    /// LISTs.
    pub lists: u64,
    /// DELETEs.
    pub deletes: u64,
}

#[derive(Debug, Default)]
struct Counters {
    gets: AtomicU64,
    bytes_downloaded: AtomicU64,
    heads: AtomicU64,
    puts: AtomicU64,
    parts: AtomicU64,
    bytes_uploaded: AtomicU64,
    lists: AtomicU64,
    deletes: AtomicU64,
}

fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// A checkpoint under a prefix of an object store (`s3://bucket/prefix`).
pub struct ObjectStorage {
    url: String,
    store: Arc<dyn ObjectStore>,
    multipart: Option<Arc<dyn MultipartStore>>,
    prefix: Path,
    opts: ObjectStoreOptions,
    counters: Arc<Counters>,
    /// Set when no credentials were configured: the client asks the metadata service.
    credentials_fallback: Option<credentials::MetadataFallback>,
    /// Identifies the store for [`ObjectStorage::conditional_put_honoured`]'s cache.
    probe_key: String,
}

impl std::fmt::Debug for ObjectStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObjectStorage").field("url", &self.url).finish()
    }
}

/// The runtime every object-store request runs on; the library's callers are plain threads.
fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("tessera-object-store")
            .enable_all()
            .build()
            .expect("starting the object-store runtime")
    })
}

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    runtime().block_on(f)
}

/// What every cloud's builder starts from: the URL, the retry and timeout settings, and the
/// storage options meant for this store (another cloud's keys are left out).
struct Common<'a> {
    url: &'a str,
    retry: object_store::RetryConfig,
    /// The client timeout, as a configuration value: set as a config key, not with
    /// `with_client_options`, which would replace the client options read from the
    /// environment (AWS_ALLOW_HTTP, proxies, …).
    timeout: String,
    config: Vec<(String, String)>,
}

impl<'a> Common<'a> {
    fn new(url: &'a str, scheme: &str, opts: &ObjectStoreOptions) -> Common<'a> {
        let retry = object_store::RetryConfig {
            max_retries: opts.max_retries,
            retry_timeout: Duration::from_secs(300),
            backoff: object_store::BackoffConfig {
                init_backoff: Duration::from_millis(100),
                max_backoff: Duration::from_secs(15),
                base: 2.0,
            },
        };
        let own_prefix = match scheme {
            "s3" | "s3a" => "aws_",
            "gs" | "gcs" => "google_",
            _ => "azure_",
        };
        let config = opts
            .config
            .iter()
            .filter(|(k, _)| {
                let k = k.to_ascii_lowercase();
                k.starts_with(own_prefix) || !["aws_", "google_", "azure_"].iter().any(|p| k.starts_with(p))
            })
            .cloned()
            .collect();
        Common { url, retry, timeout: format!("{}ms", opts.timeout.as_millis()), config }
    }

    /// A storage option the store does not know.
    fn key_err(&self, k: &str, e: object_store::Error) -> Error {
        Error::invalid(format!("{}: storage option {k:?} is not a configuration key of this store ({e})", self.url))
    }

    /// A builder that refused its configuration.
    fn build_err(&self, e: object_store::Error) -> Error {
        Error::invalid(format!("{:?}: {e}", self.url))
    }
}

/// What a cloud's builder gives back.
struct Built {
    store: Arc<dyn ObjectStore>,
    multipart: Arc<dyn MultipartStore>,
    /// The instance-metadata service the client falls back to, when no explicit credentials
    /// were found (its refusal then says what was tried).
    fallback: Option<credentials::MetadataFallback>,
    /// What, besides scheme and bucket, tells stores apart for the conditional-put probe: the
    /// resolved endpoint (never a secret).
    probe_key: String,
}

impl ObjectStorage {
    /// Opens `url` (`s3://bucket/prefix`, `gs://…`, `az://container/prefix`), configured as the
    /// clouds' own tools are, then by `opts.config` (`object_store` configuration keys, which
    /// win over everything else):
    ///
    /// - **S3**: `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` (/ `AWS_SESSION_TOKEN`),
    ///   `AWS_ENDPOINT_URL`, `AWS_REGION` / `AWS_DEFAULT_REGION`, `AWS_ALLOW_HTTP`; else the
    ///   profile `AWS_PROFILE` (else `default`) of `~/.aws/credentials` and `~/.aws/config`
    ///   (`region`, `endpoint_url`); web identity and container credentials; the instance
    ///   metadata service.
    /// - **GCS**: `GOOGLE_SERVICE_ACCOUNT` (a service-account JSON file, which may carry
    ///   `gcs_base_url` and `disable_oauth` for an emulator), `GOOGLE_APPLICATION_CREDENTIALS`
    ///   (the same fields honoured), gcloud's application-default credentials, the metadata
    ///   service.
    /// - **Azure**: `AZURE_STORAGE_ACCOUNT_NAME` with `AZURE_STORAGE_ACCOUNT_KEY` (or a SAS
    ///   token, client secret, workload identity, …), `AZURE_STORAGE_CONNECTION_STRING` (or the
    ///   key `azure_storage_connection_string`), `AZURE_STORAGE_USE_EMULATOR=true` (Azurite),
    ///   managed identity.
    ///
    /// When none of a store's explicit sources is configured and its instance-metadata service
    /// does not answer within a second, opening fails at once with [`Error::AccessDenied`]
    /// naming what was tried, instead of the client retrying for minutes. Keys of the other
    /// stores (`aws_…`, `google_…`, `azure_…`) are skipped, so that one set of options can
    /// serve a command reading one store and writing another; any other key unknown to the
    /// store is [`Error::InvalidArgument`].
    pub fn open(url: &str, opts: ObjectStoreOptions) -> Result<ObjectStorage> {
        let (scheme, rest) = url.split_once("://").ok_or_else(|| Error::invalid(format!("not a URL: {url:?}")))?;
        let prefix = rest.split_once('/').map_or("", |(_, p)| p).trim_matches('/');
        let prefix = Path::parse(prefix).map_err(|e| Error::invalid(format!("{url:?}: {e}")))?;
        let c = Common::new(url, scheme, &opts);
        let Built { store, multipart, fallback, probe_key } = match scheme {
            #[cfg(feature = "s3")]
            "s3" | "s3a" => s3::build(&c)?,
            #[cfg(feature = "gcs")]
            "gs" | "gcs" => gcs::build(&c)?,
            #[cfg(feature = "azure")]
            "az" | "azure" | "abfs" | "abfss" => azure::build(&c)?,
            other => {
                let _ = c;
                let built: Vec<&str> =
                    [(cfg!(feature = "s3"), "s3"), (cfg!(feature = "gcs"), "gcs"), (cfg!(feature = "azure"), "azure")]
                        .into_iter()
                        .filter_map(|(on, f)| on.then_some(f))
                        .collect();
                return Err(Error::invalid(format!(
                    "{url:?}: no object store for scheme {other:?} in this build (built with: {}; features: s3, \
                     gcs, azure)",
                    built.join(", ")
                )));
            }
        };
        let mut storage = Self::from_store(url, store, Some(multipart), prefix, opts);
        storage.credentials_fallback = fallback;
        storage.probe_key = format!("{} {probe_key}", storage.probe_key);
        Ok(storage)
    }

    /// A storage over an existing store (tests, custom clients). Without `multipart`, objects
    /// written with [`Storage::create`] are buffered whole and uploaded with one PUT.
    pub fn from_store(
        url: &str,
        store: Arc<dyn ObjectStore>,
        multipart: Option<Arc<dyn MultipartStore>>,
        prefix: Path,
        opts: ObjectStoreOptions,
    ) -> ObjectStorage {
        // Scheme, bucket (or container) and the store's own description.
        let probe_key = format!("{} {store}", url.splitn(4, '/').take(3).collect::<Vec<_>>().join("/"));
        ObjectStorage {
            url: url.trim_end_matches('/').to_string(),
            store,
            multipart,
            prefix,
            opts,
            counters: Arc::default(),
            credentials_fallback: None,
            probe_key,
        }
    }

    /// Requests issued so far.
    pub fn request_counts(&self) -> RequestCounts {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        RequestCounts {
            gets: get(&c.gets),
            bytes_downloaded: get(&c.bytes_downloaded),
            heads: get(&c.heads),
            puts: get(&c.puts),
            parts: get(&c.parts),
            bytes_uploaded: get(&c.bytes_uploaded),
            lists: get(&c.lists),
            deletes: get(&c.deletes),
        }
    }

    /// Whether the store honours conditional creates: a second create-if-absent of one name
    /// fails. Tested once per store (bucket and endpoint) and process, on the first commit: a
    /// probe object under this prefix is created twice and deleted (so this call writes).
    /// Stores that accept the condition and ignore it (some S3-compatible servers and
    /// emulators) are reported on stderr once, and commits there fall back to check-then-put,
    /// with the read-back of the commit protocol as the guard (FORMAT.md). Stores that refuse
    /// the condition outright (`NotImplemented`) count as not honouring it. A probe that fails
    /// (a request error) is not remembered: the next call probes again.
    pub fn conditional_put_honoured(&self) -> Result<bool> {
        type Verdicts = Mutex<HashMap<String, Arc<Mutex<Option<bool>>>>>;
        static PROBED: OnceLock<Verdicts> = OnceLock::new();
        let verdict =
            PROBED.get_or_init(Default::default).lock().unwrap().entry(self.probe_key.clone()).or_default().clone();
        // One probe per store at a time: concurrent first commits wait for its verdict.
        let mut verdict = verdict.lock().unwrap();
        if let Some(known) = *verdict {
            return Ok(known);
        }
        static N: AtomicU64 = AtomicU64::new(0);
        let name = format!("{CONDITIONAL_PUT_PROBE}{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed));
        let path = self.path(&name)?;
        const PROBE: &[u8] = b"probe";
        let create = || {
            add(&self.counters.puts, 1);
            add(&self.counters.bytes_uploaded, PROBE.len() as u64);
            let opts = PutOptions { mode: PutMode::Create, ..Default::default() };
            block_on(self.store.put_opts(&path, PutPayload::from_static(PROBE), opts))
        };
        let refused = |r: &object_store::Result<_>| {
            matches!(r, Err(object_store::Error::AlreadyExists { .. } | object_store::Error::Precondition { .. }))
        };
        let honoured = match create() {
            // The first create landed, its answer was lost, and the client's retry was refused:
            // the condition held.
            first if refused(&first) => Ok(true),
            Ok(_) => match create() {
                second if refused(&second) => Ok(true),
                Ok(_) => Ok(false),
                Err(e) => Err(e),
            },
            Err(object_store::Error::NotImplemented { .. } | object_store::Error::NotSupported { .. }) => Ok(false),
            Err(e) => Err(e),
        };
        let _ = self.delete(&name);
        let honoured = honoured.map_err(|e| self.error(&name, e))?;
        if !honoured {
            eprintln!(
                "tessera: warning: {} does not honour conditional puts (a second create-if-absent of one object \
                 succeeded): commits there check, then put, and two saves racing into one location may both \
                 report success (FORMAT.md, commit protocol)",
                self.url
            );
        }
        *verdict = Some(honoured);
        Ok(honoured)
    }

    fn path(&self, name: &str) -> Result<Path> {
        check_name(name)?;
        Ok(name.split('/').fold(self.prefix.clone(), |p, part| p.join(part)))
    }

    fn shown(&self, name: &str) -> PathBuf {
        format!("{}/{name}", self.url).into()
    }

    fn error(&self, name: &str, e: object_store::Error) -> Error {
        if let Some(denied) = self.credentials_fallback.as_ref().and_then(|f| f.explain(self.shown(name), &e)) {
            return denied;
        }
        match e {
            object_store::Error::NotFound { .. } => Error::not_found(self.shown(name)),
            object_store::Error::AlreadyExists { .. } | object_store::Error::Precondition { .. } => {
                Error::AlreadyExists { path: self.shown(name) }
            }
            // 401 / 403: retrying cannot help; the configuration must change.
            e @ (object_store::Error::PermissionDenied { .. } | object_store::Error::Unauthenticated { .. }) => {
                Error::AccessDenied { path: self.shown(name), reason: credentials::refusal_text(&e.to_string()) }
            }
            // Its text already holds its sources' texts: carried as text, so that error reports
            // that print each source (anyhow's `{:#}`) do not repeat them.
            other => Error::Io { path: self.shown(name), source: std::io::Error::other(other.to_string()) },
        }
    }

    fn get_range(&self, name: &str, range: Range<u64>) -> Result<Vec<u8>> {
        let path = self.path(name)?;
        add(&self.counters.gets, 1);
        let want = range.end - range.start;
        match block_on(self.store.get_range(&path, range.clone())) {
            Ok(bytes) => {
                add(&self.counters.bytes_downloaded, bytes.len() as u64);
                if bytes.len() as u64 != want {
                    return Err(self.truncated(name, range));
                }
                Ok(bytes.to_vec())
            }
            Err(object_store::Error::NotFound { .. }) => Err(Error::not_found(self.shown(name))),
            Err(e) => {
                // A range past the end is refused by the store: report it as truncation.
                match self.size(name) {
                    Ok(size) if size < range.end => Err(self.truncated(name, range)),
                    _ => Err(self.error(name, e)),
                }
            }
        }
    }

    fn truncated(&self, name: &str, range: Range<u64>) -> Error {
        Error::corrupt(
            self.shown(name),
            format!("truncated: {} bytes at offset {} are not all there", range.end - range.start, range.start),
        )
    }
}

impl Storage for ObjectStorage {
    fn location(&self) -> String {
        self.url.clone()
    }

    fn size(&self, name: &str) -> Result<u64> {
        let path = self.path(name)?;
        add(&self.counters.heads, 1);
        block_on(self.store.head(&path)).map(|m| m.size).map_err(|e| self.error(name, e))
    }

    fn read_at(&self, name: &str, offset: u64, buf: &mut [u8]) -> Result<()> {
        if buf.is_empty() {
            return self.size(name).map(|_| ());
        }
        let end = offset
            .checked_add(buf.len() as u64)
            .filter(|&e| e <= i64::MAX as u64)
            .ok_or_else(|| self.truncated(name, offset..u64::MAX))?;
        let bytes = self.get_range(name, offset..end)?;
        buf.copy_from_slice(&bytes);
        Ok(())
    }

    fn read(&self, name: &str) -> Result<Vec<u8>> {
        let path = self.path(name)?;
        add(&self.counters.gets, 1);
        let bytes = block_on(async { self.store.get(&path).await?.bytes().await }).map_err(|e| self.error(name, e))?;
        add(&self.counters.bytes_downloaded, bytes.len() as u64);
        Ok(bytes.to_vec())
    }

    fn create(&self, name: &str, size: u64) -> Result<Box<dyn ObjectWriter>> {
        super::check_plain_name(name)?;
        let path = self.path(name)?;
        let multipart = match &self.multipart {
            Some(m) if size > self.opts.single_put_max => m.clone(),
            _ => {
                return Ok(Box::new(BufferedWriter {
                    storage: self.clone_handle(),
                    name: name.to_string(),
                    buf: Mutex::new(vec![0u8; size as usize]),
                }))
            }
        };
        // S3 allows 10,000 parts: larger objects get larger parts.
        let part_size = self.opts.part_size.max(size.div_ceil(10_000)).max(5 << 20);
        let id = block_on(multipart.create_multipart(&path)).map_err(|e| self.error(name, e))?;
        let parts = size.div_ceil(part_size) as usize;
        Ok(Box::new(MultipartWriter {
            storage: self.clone_handle(),
            multipart,
            name: name.to_string(),
            path,
            id,
            size,
            part_size,
            open: Mutex::new(HashMap::new()),
            done: Mutex::new(vec![None; parts]),
            finished: Mutex::new(false),
        }))
    }

    fn put_atomic(&self, name: &str, bytes: &[u8]) -> Result<()> {
        super::check_plain_name(name)?;
        let path = self.path(name)?;
        add(&self.counters.puts, 1);
        add(&self.counters.bytes_uploaded, bytes.len() as u64);
        block_on(self.store.put(&path, PutPayload::from(bytes.to_vec()))).map(|_| ()).map_err(|e| self.error(name, e))
    }

    fn put_if_absent(&self, name: &str, bytes: &[u8]) -> Result<()> {
        super::check_plain_name(name)?;
        // A failed probe is no verdict: the conditional put itself decides, as the store
        // answers it.
        if let Ok(false) = self.conditional_put_honoured() {
            // The store would let a second create replace the first: check, then put, and the
            // commit's read-back judges a race.
            return super::check_then_put(self, name, bytes);
        }
        let path = self.path(name)?;
        add(&self.counters.puts, 1);
        add(&self.counters.bytes_uploaded, bytes.len() as u64);
        let opts = PutOptions { mode: PutMode::Create, ..Default::default() };
        match block_on(self.store.put_opts(&path, PutPayload::from(bytes.to_vec()), opts)) {
            Ok(_) => Ok(()),
            // A conditional put lost in transit and retried finds its own object: not a conflict.
            Err(object_store::Error::AlreadyExists { .. } | object_store::Error::Precondition { .. }) => {
                match self.read(name) {
                    Ok(existing) if existing == bytes => Ok(()),
                    _ => Err(Error::AlreadyExists { path: self.shown(name) }),
                }
            }
            // The put may have landed and only its answer been lost (a conditional put is not
            // retried after a timeout): what is there now tells.
            Err(e) => match self.read(name) {
                Ok(existing) if existing == bytes => Ok(()),
                Ok(_) => Err(Error::AlreadyExists { path: self.shown(name) }),
                Err(_) => Err(self.error(name, e)),
            },
        }
    }

    /// Conditional puts (S3 `If-None-Match: *`, GCS `x-goog-if-generation-match: 0`, Azure
    /// `If-None-Match: *`) are atomic where the store honours them, which
    /// [`ObjectStorage::conditional_put_honoured`] tests once per store: the first call writes
    /// (and deletes) a probe object; false while the probe cannot run (no verdict).
    fn has_atomic_create(&self) -> bool {
        self.conditional_put_honoured().unwrap_or(false)
    }

    fn list_recursive(&self) -> Result<Vec<String>> {
        use futures::TryStreamExt;
        add(&self.counters.lists, 1);
        let prefix = (!self.prefix.as_ref().is_empty()).then_some(&self.prefix);
        let metas: Vec<object_store::ObjectMeta> =
            block_on(self.store.list(prefix).try_collect()).map_err(|e| self.error("", e))?;
        let skip = self.prefix.parts().count();
        Ok(metas
            .into_iter()
            .map(|m| m.location.parts().skip(skip).map(|p| decode_part(p.as_ref())).collect::<Vec<_>>().join("/"))
            .collect())
    }

    fn list(&self) -> Result<Vec<String>> {
        add(&self.counters.lists, 1);
        let prefix = (!self.prefix.as_ref().is_empty()).then_some(&self.prefix);
        let listed = block_on(self.store.list_with_delimiter(prefix)).map_err(|e| self.error("", e))?;
        Ok(listed.objects.into_iter().filter_map(|m| m.location.filename().map(decode_part)).collect())
    }

    fn delete(&self, name: &str) -> Result<()> {
        super::check_plain_name(name)?;
        let path = self.path(name)?;
        add(&self.counters.deletes, 1);
        match block_on(self.store.delete(&path)) {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.error(name, e)),
        }
    }
}

impl ObjectStorage {
    fn clone_handle(&self) -> ObjectStorage {
        ObjectStorage {
            url: self.url.clone(),
            store: self.store.clone(),
            multipart: self.multipart.clone(),
            prefix: self.prefix.clone(),
            opts: self.opts.clone(),
            counters: self.counters.clone(),
            credentials_fallback: self.credentials_fallback.clone(),
            probe_key: self.probe_key.clone(),
        }
    }
}

/// The name of a key part: `object_store` percent-encodes what S3 advises against in keys
/// (non-ASCII, `%`, `#`, …) when it builds a path from a name.
fn decode_part(raw: &str) -> String {
    let b = raw.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        match (b[i], b.get(i + 1).and_then(|&c| hex(c)), b.get(i + 2).and_then(|&c| hex(c))) {
            (b'%', Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            (c, _, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).unwrap_or_else(|_| raw.to_string())
}

/// Small objects: positioned writes into one buffer, one PUT at `finish`.
struct BufferedWriter {
    storage: ObjectStorage,
    name: String,
    buf: Mutex<Vec<u8>>,
}

impl ObjectWriter for BufferedWriter {
    fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        let mut buf = self.buf.lock().unwrap();
        let end = offset as usize + data.len();
        if end > buf.len() {
            return Err(Error::invalid(format!("write past the {} bytes of {:?}", buf.len(), self.name)));
        }
        buf[offset as usize..end].copy_from_slice(data);
        Ok(())
    }

    fn finish(self: Box<Self>) -> Result<()> {
        let buf = std::mem::take(&mut *self.buf.lock().unwrap());
        self.storage.put_atomic(&self.name, &buf)
    }
}

/// Large objects: a multipart upload whose parts are numbered by position, so positioned
/// writes from many threads complete parts in any order. A part is uploaded (from the
/// writing thread) as soon as all its bytes are written; only parts still being filled are
/// held in memory. The object appears at `finish`, whole, or not at all.
struct MultipartWriter {
    storage: ObjectStorage,
    multipart: Arc<dyn MultipartStore>,
    name: String,
    path: Path,
    id: String,
    size: u64,
    part_size: u64,
    /// Parts being filled: their bytes and how many are written.
    open: Mutex<HashMap<usize, (Vec<u8>, u64)>>,
    done: Mutex<Vec<Option<PartId>>>,
    finished: Mutex<bool>,
}

impl MultipartWriter {
    fn part_len(&self, idx: usize) -> u64 {
        let start = idx as u64 * self.part_size;
        (self.size - start).min(self.part_size)
    }

    fn upload(&self, idx: usize, bytes: Vec<u8>) -> Result<()> {
        let c = &self.storage.counters;
        add(&c.parts, 1);
        add(&c.bytes_uploaded, bytes.len() as u64);
        let part = block_on(self.multipart.put_part(&self.path, &self.id, idx, PutPayload::from(bytes)))
            .map_err(|e| self.storage.error(&self.name, e))?;
        self.done.lock().unwrap()[idx] = Some(part);
        Ok(())
    }
}

impl ObjectWriter for MultipartWriter {
    fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        if offset.checked_add(data.len() as u64).is_none_or(|end| end > self.size) {
            return Err(Error::invalid(format!("write past the {} bytes of {:?}", self.size, self.name)));
        }
        let mut at = 0usize;
        while at < data.len() {
            let pos = offset + at as u64;
            let idx = (pos / self.part_size) as usize;
            let in_part = pos - idx as u64 * self.part_size;
            let n = ((self.part_len(idx) - in_part) as usize).min(data.len() - at);
            let complete = {
                let mut open = self.open.lock().unwrap();
                let entry = open.entry(idx).or_insert_with(|| (vec![0u8; self.part_len(idx) as usize], 0));
                entry.0[in_part as usize..in_part as usize + n].copy_from_slice(&data[at..at + n]);
                entry.1 += n as u64;
                if entry.1 == self.part_len(idx) {
                    open.remove(&idx).map(|(bytes, _)| bytes)
                } else {
                    None
                }
            };
            if let Some(bytes) = complete {
                self.upload(idx, bytes)?;
            }
            at += n;
        }
        Ok(())
    }

    fn finish(self: Box<Self>) -> Result<()> {
        // Bytes never written read as zeros, as in a local file of this size.
        let rest: Vec<(usize, Vec<u8>)> = self.open.lock().unwrap().drain().map(|(i, (b, _))| (i, b)).collect();
        for (idx, bytes) in rest {
            self.upload(idx, bytes)?;
        }
        let never_written: Vec<usize> =
            self.done.lock().unwrap().iter().enumerate().filter(|(_, p)| p.is_none()).map(|(i, _)| i).collect();
        for idx in never_written {
            self.upload(idx, vec![0u8; self.part_len(idx) as usize])?;
        }
        let parts: Vec<PartId> =
            self.done.lock().unwrap().iter().map(|p| p.clone().expect("every part uploaded")).collect();
        block_on(self.multipart.complete_multipart(&self.path, &self.id, parts))
            .map_err(|e| self.storage.error(&self.name, e))?;
        *self.finished.lock().unwrap() = true;
        Ok(())
    }
}

impl Drop for MultipartWriter {
    fn drop(&mut self) {
        // An unfinished upload holds storage (and cost) until aborted.
        if !*self.finished.lock().unwrap() {
            let _ = block_on(self.multipart.abort_multipart(&self.path, &self.id));
        }
    }
}
