//! Helpers for running in-process ranks: a success barrier and error collection.

use std::sync::Arc;

use anyhow::Result;
use tessera::comm::InProcessComm;
use tessera::Communicator;

/// The error of a rank that stopped because another rank failed.
#[derive(Debug)]
pub struct PeerFailed(pub usize);

impl std::fmt::Display for PeerFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "rank {} failed", self.0)
    }
}

impl std::error::Error for PeerFailed {}

/// A barrier that also tells every rank whether all succeeded, so that a rank whose call
/// failed alone does not leave the others waiting in the next collective.
pub fn all_ok(comm: &dyn Communicator, ok: bool) -> Result<()> {
    let all = comm.all_gather(&[ok as u8])?;
    match all.iter().position(|v| v.first() != Some(&1)) {
        Some(r) if ok => Err(PeerFailed(r).into()),
        _ => Ok(()),
    }
}

/// Results by rank → all values, or the first error of a rank that failed by itself.
pub fn collect<T>(results: Vec<Result<T>>) -> Result<Vec<T>> {
    let mut values = Vec::with_capacity(results.len());
    let mut peer: Option<anyhow::Error> = None;
    let mut own: Option<anyhow::Error> = None;
    for r in results {
        match r {
            Ok(v) => values.push(v),
            Err(e) if e.downcast_ref::<PeerFailed>().is_some() => {
                peer.get_or_insert(e);
            }
            Err(e) => {
                own.get_or_insert(e);
            }
        }
    }
    match own.or(peer) {
        Some(e) => Err(e),
        None => Ok(values),
    }
}

/// Runs `f(comm, commit_comm)` on `world` threads, one per rank, and returns the results by
/// rank. `commit_comm` is a second, separate in-process group for the background commits of
/// async saves (a collective on it never meets one on `comm`).
pub fn run_with_commit_group<T: Send>(
    world: usize,
    f: impl Fn(&InProcessComm, Arc<dyn Communicator>) -> T + Sync,
) -> Vec<T> {
    let comms = InProcessComm::group(world);
    let commits = InProcessComm::group(world);
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter()
            .zip(commits)
            .map(|(c, k)| {
                let f = &f;
                s.spawn(move || f(c, Arc::new(k) as Arc<dyn Communicator>))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
    })
}

/// The largest of every rank's `value` (a collective: every rank gets it).
pub fn max_over_ranks(comm: &dyn Communicator, value: f64) -> Result<f64> {
    let all = comm.all_gather(&value.to_le_bytes())?;
    let mut max = f64::NEG_INFINITY;
    for (r, bytes) in all.iter().enumerate() {
        let bytes: [u8; 8] = bytes.as_slice().try_into().map_err(|_| anyhow::anyhow!("bad value from rank {r}"))?;
        max = max.max(f64::from_le_bytes(bytes));
    }
    Ok(max)
}
