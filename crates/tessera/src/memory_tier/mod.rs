//! The memory tier and the checkpoint manager (ARCHITECTURE.md, "The memory tier"; FORMAT.md,
//! "The memory tier").
//!
//! A save to the memory tier writes each rank's state, as an ordinary tessera checkpoint of that
//! rank alone, into node-local memory that outlives the process (`/dev/shm` or a configured
//! directory), then protects it with Reed–Solomon parity: ranks on different nodes form groups
//! of up to k data shards whose m parity shards are stored on m further nodes. Any m nodes
//! lost, every group still has enough shards, and a restore rebuilds what the lost nodes held.
//! The caller blocks only while its bytes are staged; the copy, the parity exchange and the
//! commit run in the background over a communicator of their own. Every n-th memory step is
//! drained to the persistent location as an ordinary tessera checkpoint, read from the memory
//! copy. [`CheckpointManager`] runs the policy and restores the newest step complete in some
//! tier.

mod commit;
mod fs;
#[cfg(feature = "fuzzing")]
pub(crate) mod fuzz;
mod layout;
mod manager;
mod restore;
mod shard;

use std::path::{Path, PathBuf};

#[cfg(feature = "fault-injection")]
#[doc(hidden)]
pub use fs::{FaultHook, FaultWhen};
pub use manager::{CheckpointManager, ManagerOptions, Restored, Tier};

use crate::error::{Error, Result};

/// Where and how a job keeps its memory tier: the node-local root, this process's node, and
/// RS(k, m), k data shards and m parity shards per group.
///
/// ```
/// use tessera::memory_tier::MemoryTier;
/// let tier = MemoryTier::new("/dev/shm/tessera/job-17").redundancy(4, 1);
/// assert_eq!(tier.redundancy_shards(), (4, 1));
/// ```
#[derive(Debug, Clone)]
pub struct MemoryTier {
    root: PathBuf,
    node: Option<String>,
    k: usize,
    m: usize,
    chunk_bytes: u64,
    fs: fs::NodeFs,
}

/// Environment variable naming this process's node when no node is set with
/// [`MemoryTier::node`] (schedulers that know better than the host name, and tests).
pub const NODE_ENV: &str = "TESSERA_NODE";

impl MemoryTier {
    /// A memory tier rooted at `root` (one directory per node, on tmpfs for memory speed; every
    /// rank of the node uses the same root), RS(4, 1), this node named by [`NODE_ENV`] or the
    /// host name.
    pub fn new(root: impl Into<PathBuf>) -> MemoryTier {
        MemoryTier { root: root.into(), node: None, k: 4, m: 1, chunk_bytes: 8 << 20, fs: fs::NodeFs::default() }
    }

    /// Names this process's node (ranks with the same name share a failure domain).
    pub fn node(mut self, name: impl Into<String>) -> MemoryTier {
        self.node = Some(name.into());
        self
    }

    /// Up to `k` data shards per group, protected by `m` parity shards: any `m` nodes may be
    /// lost. The memory held is (k + m) / k times the state (fewer data shards per group where
    /// the job has fewer than k + m nodes).
    pub fn redundancy(mut self, k: usize, m: usize) -> MemoryTier {
        self.k = k;
        self.m = m;
        self
    }

    /// Bytes of each shard exchanged per round of the parity exchange and of a rebuild (even;
    /// default 8 MiB): what each rank holds in flight, per peer it sends to.
    pub fn chunk_bytes(mut self, bytes: u64) -> MemoryTier {
        self.chunk_bytes = bytes;
        self
    }

    /// Fails the file operations `hook` picks (feature `fault-injection`, for the fault sweep):
    /// every file call of the memory tier on this node's root passes it.
    #[cfg(feature = "fault-injection")]
    #[doc(hidden)]
    pub fn fault_hook(mut self, hook: fs::FaultHook) -> MemoryTier {
        self.fs = fs::NodeFs::with_hook(hook);
        self
    }

    /// The node-local root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// (k, m): data and parity shards per group.
    pub fn redundancy_shards(&self) -> (usize, usize) {
        (self.k, self.m)
    }

    /// This process's node: as set, else [`NODE_ENV`], else the host name.
    pub fn node_name(&self) -> Result<String> {
        if let Some(n) = &self.node {
            return Ok(n.clone());
        }
        if let Ok(n) = std::env::var(NODE_ENV) {
            if !n.is_empty() {
                return Ok(n);
            }
        }
        hostname()
    }

    fn check(&self) -> Result<()> {
        if self.k == 0 || self.m == 0 {
            return Err(Error::invalid(format!("memory tier: RS({}, {}) needs k ≥ 1 and m ≥ 1", self.k, self.m)));
        }
        if self.chunk_bytes < 2 || self.chunk_bytes % 2 == 1 {
            return Err(Error::invalid(format!("memory tier: chunk of {} bytes is not even", self.chunk_bytes)));
        }
        Ok(())
    }

    fn step_dir(&self, step: u64) -> PathBuf {
        self.root.join(step_name(step))
    }
}

/// The directory of step `step`, in either tier.
pub(crate) fn step_name(step: u64) -> String {
    format!("step-{step:012}")
}

/// The step a directory name stands for.
pub(crate) fn parse_step_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    (digits.len() == 12 && digits.bytes().all(|b| b.is_ascii_digit())).then(|| digits.parse().ok()).flatten()
}

fn rank_dir_name(rank: usize) -> String {
    format!("rank-{rank:06}")
}

fn parity_name(group: usize, p: usize) -> String {
    format!("parity-g{group:06}-p{p:03}.bin")
}

fn marker_name(rank: usize) -> String {
    format!("commit-r{rank:06}.json")
}

fn hostname() -> Result<String> {
    let mut buf = [0u8; 256];
    // SAFETY: the pointer and length describe `buf`, which outlives the call; gethostname
    // writes at most `len` bytes into it.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return Err(Error::io("(host name)", std::io::Error::last_os_error()));
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    Ok(String::from_utf8_lossy(&buf[..end]).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_names_round_trip_and_nothing_else_parses() {
        assert_eq!(parse_step_name(&step_name(42)), Some(42));
        for bad in ["step-42", "step-00000000004x", "rank-000000000042", "step-0000000000420"] {
            assert_eq!(parse_step_name(bad), None, "{bad}");
        }
    }

    #[test]
    fn the_node_is_as_set_or_the_host_name() {
        assert_eq!(MemoryTier::new("/x").node("n3").node_name().unwrap(), "n3");
        assert!(!hostname().unwrap().is_empty());
        assert!(MemoryTier::new("/x").redundancy(2, 0).check().is_err());
        assert!(MemoryTier::new("/x").chunk_bytes(3).check().is_err());
    }
}
