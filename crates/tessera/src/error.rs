use std::path::PathBuf;

/// Everything that can go wrong in tessera. Variants are named for what the caller does next
/// and always carry the key or path involved.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A file or directory that must exist does not. For a checkpoint location that holds
    /// none, `detail` says what it holds and what to do (the whole message then).
    #[error("{}", detail.clone().unwrap_or_else(|| format!("not found: {}", path.display())))]
    NotFound {
        /// What was looked for.
        path: PathBuf,
        /// When `path` is a location opened as a checkpoint: what was looked for there, what it
        /// holds, what to do (e.g. "no checkpoint in D: it holds step100/, step200/
        /// (checkpoints): pass one of them").
        detail: Option<String>,
    },
    /// The directory holds no committed checkpoint (no index: never finished, or crashed).
    #[error(
        "{}",
        detail.clone().unwrap_or_else(|| format!(
            "not a committed checkpoint: {} (no index; the save never finished or was interrupted)",
            path.display()
        ))
    )]
    NotCommitted {
        /// Checkpoint location.
        path: PathBuf,
        /// What was looked for there, what it holds and what to do, as for [`Error::NotFound`].
        detail: Option<String>,
    },
    /// A committed checkpoint is already there and overwriting was not asked for.
    #[error("a committed checkpoint already exists at {path}; pass overwrite to replace it")]
    AlreadyExists {
        /// Checkpoint location.
        path: PathBuf,
    },
    /// Bytes on storage do not match what the index promises (checksum, size, structure).
    #[error("corrupt checkpoint file {path}: {reason}")]
    Corrupt {
        /// File that failed the check.
        path: PathBuf,
        /// What did not match.
        reason: String,
    },
    /// The checkpoint was written in a format version this build cannot read.
    #[error("incompatible format version {found}; this build supports {supported}")]
    IncompatibleVersion {
        /// Version (or backend/version) found in the checkpoint.
        found: String,
        /// Versions this build reads.
        supported: String,
    },
    /// The shards given by the ranks do not describe a valid global state.
    #[error("invalid sharding of {key:?}: {reason}")]
    InvalidSharding {
        /// Global key of the tensor or object.
        key: String,
        /// Why it is invalid.
        reason: String,
    },
    /// A requested region is not (fully) present in the checkpoint.
    #[error("{key:?}: requested region {region} is not covered by the checkpoint")]
    NotCovered {
        /// Global key.
        key: String,
        /// Human-readable description of the uncovered region.
        region: String,
    },
    /// The request does not match the stored tensor (dtype, global shape).
    #[error("{key:?}: {reason}")]
    Mismatch {
        /// Global key.
        key: String,
        /// What differs.
        reason: String,
    },
    /// Keys the strict-handling mode refuses (unexpected: requested but absent; missing: stored but not requested).
    #[error(
        "strict load failed: requested but not in the checkpoint (unexpected) {unexpected:?}; in the checkpoint \
         but not requested (missing) {missing:?}"
    )]
    KeyMismatch {
        /// Requested keys that the checkpoint does not hold.
        unexpected: Vec<String>,
        /// Stored keys no rank requested.
        missing: Vec<String>,
    },
    /// No registered strategy can handle this backend.
    #[error("no strategy registered for backend {backend:?} version {version} ({action})")]
    UnknownStrategy {
        /// Backend name.
        backend: String,
        /// Backend version.
        version: u32,
        /// save or load.
        action: String,
    },
    /// An argument is malformed (buffer size, path outside the checkpoint, option).
    #[error("invalid argument: {reason}")]
    InvalidArgument {
        /// What is wrong.
        reason: String,
    },
    /// Another rank failed; this rank stops with the same verdict.
    #[error("rank {rank} failed: {message}")]
    PeerFailed {
        /// The rank that failed first.
        rank: usize,
        /// Its error, as text.
        message: String,
    },
    /// The communicator failed (peer gone, mismatched collective).
    #[error("communication failed: {reason}")]
    Comm {
        /// What failed.
        reason: String,
    },
    /// The caller cancelled the operation (e.g. Ctrl-C); a save so stopped is not committed.
    #[error("cancelled")]
    Cancelled,
    /// The store refused the request's credentials, or no credentials were found for it: fix
    /// the configuration (environment, credential files, storage options) and retry.
    #[error("access to {path} denied: {reason}")]
    AccessDenied {
        /// The location or object refused.
        path: PathBuf,
        /// What the store answered, or which credential sources were tried.
        reason: String,
    },
    /// A save reached its commit, but this rank cannot tell whether the checkpoint committed
    /// (the commit marker's put, or the verdict that rank 0 sends, failed without saying). The
    /// save's files are kept: open the location (or `tessera verify` it) to see which checkpoint
    /// it holds; `tessera gc` removes the files if the save did not commit.
    #[error(
        "whether the save into {path} committed is unknown: {reason}; its files were kept (open or `tessera \
         verify` the location to see which checkpoint it holds; `tessera gc` removes them if it did not commit)"
    )]
    CommitUnknown {
        /// Checkpoint location.
        path: PathBuf,
        /// What failed.
        reason: String,
    },
    /// An operating-system IO error on a path.
    #[error("io error on {path}: {source}")]
    Io {
        /// File involved.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// Result with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// [`Error::NotFound`] of `path`, without detail.
    pub fn not_found(path: impl Into<PathBuf>) -> Self {
        Error::NotFound { path: path.into(), detail: None }
    }
    /// [`Error::NotCommitted`] of `path`, without detail.
    pub fn not_committed(path: impl Into<PathBuf>) -> Self {
        Error::NotCommitted { path: path.into(), detail: None }
    }
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        let path = path.into();
        if source.kind() == std::io::ErrorKind::NotFound {
            Error::NotFound { path, detail: None }
        } else {
            Error::Io { path, source }
        }
    }
    pub(crate) fn corrupt(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        Error::Corrupt { path: path.into(), reason: reason.into() }
    }
    pub(crate) fn sharding(key: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::InvalidSharding { key: key.into(), reason: reason.into() }
    }
    pub(crate) fn invalid(reason: impl Into<String>) -> Self {
        Error::InvalidArgument { reason: reason.into() }
    }
}
