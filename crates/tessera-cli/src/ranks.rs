//! Helpers for running in-process ranks: a success barrier and error collection.

use anyhow::Result;
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
