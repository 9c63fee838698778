//! What every writer takes and gives back: [`SaveOptions`] (with its [`PlanCache`]) and
//! [`SaveReport`].

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use crate::format::DEFAULT_BLOCK_SIZE;
use crate::model::Value;
use crate::plan::save::RankPlan;
use crate::threads::default_threads;

/// How to save.
#[derive(Debug, Clone)]
pub struct SaveOptions {
    /// Replace a committed checkpoint at the same location (atomically, at commit).
    pub overwrite: bool,
    /// Check globally that main replicas tile every tensor before writing (Megatron's
    /// `validate_access_integrity`). Turning it off skips the check, not the exchange.
    pub validate: bool,
    /// User metadata stored in the index, readable without loading anything.
    pub content_metadata: Value,
    /// IO threads per rank. Into a local file ([`Storage::is_local`](crate::Storage::is_local))
    /// a file is written from one thread whatever this says: the kernel serializes writes into
    /// one file there.
    pub threads: usize,
    /// Checksum block size in bytes (loads verify whole blocks).
    pub block_size: u64,
    /// Set it to stop the IO early: the save then fails with [`Error::Cancelled`] on this rank
    /// (and with `PeerFailed` on the others) and nothing is committed.
    pub cancel: Option<Arc<AtomicBool>>,
    /// Fully-parallel save: spread the writing of replicated chunks (data-parallel replicas
    /// that hold their bytes) over their holders instead of leaving it all to the main replica.
    /// The checkpoint holds the same chunks either way.
    pub distribute_replicas: bool,
    /// Reuse the global plan of the previous save through this cache when the structure is
    /// unchanged (PyTorch DCP's plan caching): see [`PlanCache`]. Give every rank its own
    /// cache, kept across saves; `None` (the default) plans every save from scratch.
    pub plan_cache: Option<Arc<PlanCache>>,
}

impl Default for SaveOptions {
    fn default() -> Self {
        SaveOptions {
            overwrite: false,
            validate: true,
            content_metadata: Value::Null,
            threads: default_threads(),
            block_size: DEFAULT_BLOCK_SIZE,
            cancel: None,
            distribute_replicas: true,
            plan_cache: None,
        }
    }
}

/// What a save did, as seen from one rank.
#[derive(Debug, Clone, Default)]
pub struct SaveReport {
    /// The data file this rank wrote (none if it held no main replica).
    pub file: Option<String>,
    /// Bytes this rank wrote (its data file).
    pub bytes_written: u64,
    /// Tensor bytes in the whole checkpoint.
    pub total_tensor_bytes: u64,
    /// Data files in the checkpoint.
    pub files: usize,
    /// Chunks in the checkpoint.
    pub chunks: usize,
    /// Size of the index (of `.metadata` for a torch_dist save; 0 on ranks other than 0).
    pub index_bytes: u64,
    /// Files the save left for `tessera gc`: what the cleanup after the commit (removing the
    /// files of the checkpoint it replaced) could not remove, and the save's lease if it could
    /// not be removed. The checkpoint is committed either way; empty as a rule.
    pub leftovers: Vec<String>,
}

/// The global plan of a rank's last save, so that a save with the same structure skips the
/// exchange of full plans, the global validation and the writer assignment.
///
/// Every rank announces, in one all-gather of a few dozen bytes, whether its own plan (keys,
/// dtypes, shapes, boxes, replica ids, object sizes, and the options that shape the plan) hashes
/// to the one it cached, and which save its cache comes from. Only when every rank matches and
/// every cache comes from the same save is the cached plan reused, on every rank alike;
/// otherwise the save falls back to the full exchange and validation (one more all-gather) and
/// caches the result. The hash is 128 bits of a non-cryptographic hash over the plan's binary
/// encoding: it detects changes, not adversaries (the ranks are one trusted job). Rank 0 keeps
/// every rank's plan (it builds the index); the other ranks keep only their own.
#[derive(Default)]
pub struct PlanCache {
    pub(crate) last: std::sync::Mutex<Option<CachedPlan>>,
    pub(crate) hits: std::sync::atomic::AtomicU64,
    pub(crate) misses: std::sync::atomic::AtomicU64,
}

pub(crate) struct CachedPlan {
    pub digest: [u64; 2],
    /// Save id of the save that planned it: the same on every rank.
    pub generation: u64,
    pub plans: Arc<Vec<RankPlan>>,
}

impl std::fmt::Debug for PlanCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlanCache").field("hits", &self.hits()).field("misses", &self.misses()).finish()
    }
}

impl PlanCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }
    /// Saves that reused the cached plan.
    pub fn hits(&self) -> u64 {
        self.hits.load(std::sync::atomic::Ordering::Relaxed)
    }
    /// Saves that planned from scratch with this cache.
    pub fn misses(&self) -> u64 {
        self.misses.load(std::sync::atomic::Ordering::Relaxed)
    }
}
