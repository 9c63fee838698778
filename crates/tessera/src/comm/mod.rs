//! How ranks talk during save and load: a handful of collectives over bytes.
//! Every rank must call the same collectives in the same order.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use crate::{Error, Result};

/// Collectives over byte messages between the ranks of one job.
pub trait Communicator: Send + Sync {
    /// This rank, in `0..world_size()`.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// Every rank contributes `data`; every rank receives all contributions, indexed by rank.
    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>>;
    /// `root` contributes `data` (ignored elsewhere); every rank receives it.
    fn broadcast(&self, data: &[u8], root: usize) -> Result<Vec<u8>>;
    /// Returns once every rank has entered.
    fn barrier(&self) -> Result<()> {
        self.all_gather(&[]).map(|_| ())
    }
}

/// A job of one rank.
#[derive(Debug, Default, Clone, Copy)]
pub struct SoloComm;

impl Communicator for SoloComm {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        Ok(vec![data.to_vec()])
    }
    fn broadcast(&self, data: &[u8], _root: usize) -> Result<Vec<u8>> {
        Ok(data.to_vec())
    }
}

#[derive(Debug)]
struct Round {
    generation: u64,
    arrived: usize,
    slots: Vec<Option<Vec<u8>>>,
    result: Arc<Vec<Vec<u8>>>,
}

#[derive(Debug)]
struct Shared {
    world: usize,
    state: Mutex<Round>,
    cv: Condvar,
    timeout: Duration,
}

/// One rank of a job whose ranks are threads of this process (tests, demos, benchmarks).
#[derive(Debug, Clone)]
pub struct InProcessComm {
    rank: usize,
    shared: Arc<Shared>,
}

impl InProcessComm {
    /// Communicators for `world` ranks; give one to each thread.
    pub fn group(world: usize) -> Vec<InProcessComm> {
        Self::group_with_timeout(world, Duration::from_secs(600))
    }

    /// Like [`InProcessComm::group`], failing a collective that waits longer than `timeout`.
    pub fn group_with_timeout(world: usize, timeout: Duration) -> Vec<InProcessComm> {
        let shared = Arc::new(Shared {
            world,
            state: Mutex::new(Round {
                generation: 0,
                arrived: 0,
                slots: vec![None; world],
                result: Arc::new(Vec::new()),
            }),
            cv: Condvar::new(),
            timeout,
        });
        (0..world).map(|rank| InProcessComm { rank, shared: shared.clone() }).collect()
    }

    /// Runs `f(comm)` on `world` threads, one per rank, and returns the results by rank.
    pub fn run<T: Send>(world: usize, f: impl Fn(&InProcessComm) -> T + Sync) -> Vec<T> {
        let comms = Self::group(world);
        std::thread::scope(|s| {
            let handles: Vec<_> = comms.iter().map(|c| s.spawn(|| f(c))).collect();
            handles.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
        })
    }
}

impl Communicator for InProcessComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        let sh = &*self.shared;
        let mut st = sh.state.lock().unwrap();
        // A rank cannot start round g+1 before every rank has arrived in round g+1, so the
        // result of round g stays in place until every rank has read it.
        let gen = st.generation;
        st.slots[self.rank] = Some(data.to_vec());
        st.arrived += 1;
        if st.arrived == sh.world {
            let slots: Vec<Vec<u8>> = st.slots.iter_mut().map(|s| s.take().unwrap_or_default()).collect();
            st.result = Arc::new(slots);
            st.arrived = 0;
            st.generation += 1;
            sh.cv.notify_all();
        } else {
            let deadline = std::time::Instant::now() + sh.timeout;
            while st.generation == gen {
                let left = deadline.saturating_duration_since(std::time::Instant::now());
                if left.is_zero() {
                    return Err(Error::Comm {
                        reason: format!("rank {} timed out in a collective waiting for peers", self.rank),
                    });
                }
                st = sh.cv.wait_timeout(st, left).unwrap().0;
            }
        }
        Ok((*st.result).clone())
    }

    fn broadcast(&self, data: &[u8], root: usize) -> Result<Vec<u8>> {
        if root >= self.shared.world {
            return Err(Error::invalid(format!("broadcast root {root} out of {} ranks", self.shared.world)));
        }
        let mine = if self.rank == root { data } else { &[] };
        let mut all = self.all_gather(mine)?;
        Ok(std::mem::take(&mut all[root]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_gather_and_broadcast_over_threads() {
        let out = InProcessComm::run(5, |c| {
            let mut rounds = Vec::new();
            for round in 0..50u8 {
                let g = c.all_gather(&[c.rank() as u8, round]).unwrap();
                rounds.push(g);
                let b = c.broadcast(&[round, 7], (round as usize) % 5).unwrap();
                assert_eq!(b, vec![round, 7]);
            }
            rounds
        });
        for rounds in out {
            for (round, g) in rounds.iter().enumerate() {
                let want: Vec<Vec<u8>> = (0..5).map(|r| vec![r as u8, round as u8]).collect();
                assert_eq!(g, &want);
            }
        }
    }
}
