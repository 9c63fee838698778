//! How ranks talk during save and load: a handful of collectives over bytes.
//! Every rank must call the same collectives in the same order. What ranks send each other
//! about outcomes (ok, or the error that stopped a rank) is encoded one way, in `wire`.
//!
//! A job brings its own [`Communicator`] (the Python package wraps `torch.distributed`), or
//! takes one of these: [`SoloComm`] for one process, [`InProcessComm`] for ranks as threads of
//! one process (tests, tools), `MpiComm` over MPI (feature `mpi`, with the `mpi` crate
//! re-exported as `comm::mpi` for its `Universe`).

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

#[cfg(feature = "mpi")]
mod mpi_comm;
pub(crate) mod wire;

#[cfg(feature = "mpi")]
pub use self::mpi_comm::MpiComm;
/// The `mpi` crate (rsmpi), for its `Universe` and communicators (feature `mpi`).
#[cfg(feature = "mpi")]
pub use ::mpi;

use crate::error::{Error, Result};

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
    /// Personalized exchange: every rank gives one message per rank (`send[r]` goes to rank
    /// `r`, `send.len() == world_size()`); every rank receives `recv[r]`, the message rank `r`
    /// addressed to it.
    ///
    /// The default implementation is one [`Communicator::all_gather`] of all of a rank's
    /// messages, each rank keeping its own: correct, but every rank receives every message (N
    /// times the traffic of a real all-to-all). Communicators with point-to-point sends should
    /// override it.
    fn all_to_all(&self, send: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>> {
        default_all_to_all(self, send)
    }
}

/// [`Communicator::all_to_all`]'s default implementation, over `all_gather`, for
/// implementations that override it only in some cases.
pub fn default_all_to_all<C: Communicator + ?Sized>(comm: &C, send: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>> {
    let world = comm.world_size();
    let me = comm.rank();
    // The count is checked after the gather, so a wrong call fails on every rank instead
    // of leaving the others waiting.
    let all = comm.all_gather(&wire::messages(&send))?;
    drop(send);
    let mut recv = Vec::with_capacity(world);
    for (r, buf) in all.iter().enumerate() {
        let mine = wire::message_for(buf, world, me)
            .map_err(|why| Error::Comm { reason: format!("all_to_all: messages of rank {r}: {why}") })?;
        recv.push(mine.to_vec());
    }
    Ok(recv)
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
    fn all_to_all(&self, send: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>> {
        if send.len() != 1 {
            return Err(Error::Comm { reason: format!("all_to_all: {} messages for 1 rank", send.len()) });
        }
        Ok(send)
    }
}

/// What a rank brought to the current collective.
#[derive(Debug, Clone, Default)]
enum Slot {
    #[default]
    Empty,
    Gather(Vec<u8>),
    ToAll(Vec<Vec<u8>>),
}

#[derive(Debug)]
struct Round {
    generation: u64,
    arrived: usize,
    slots: Vec<Slot>,
    /// Result of the last all-gather (shared by every rank).
    result: Arc<Vec<Vec<u8>>>,
    /// Result of the last all-to-all: row `r` is what rank `r` receives (each rank takes its own).
    rows: Vec<Vec<Vec<u8>>>,
    /// Why the last collective failed (ranks called different collectives, or an all-to-all
    /// with the wrong number of messages).
    failed: Option<String>,
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
                slots: vec![Slot::Empty; world],
                result: Arc::new(Vec::new()),
                rows: Vec::new(),
                failed: None,
            }),
            cv: Condvar::new(),
            timeout,
        });
        (0..world).map(|rank| InProcessComm { rank, shared: shared.clone() }).collect()
    }

    /// Runs `f(comm)` on `world` threads, one per rank, and returns the results by rank.
    ///
    /// ```
    /// use tessera::Communicator;
    /// use tessera::comm::InProcessComm;
    ///
    /// let gathered = InProcessComm::run(3, |comm| comm.all_gather(&[comm.rank() as u8 * 10]));
    /// for got in gathered {
    ///     assert_eq!(got?, [vec![0], vec![10], vec![20]]);
    /// }
    /// # Ok::<(), tessera::Error>(())
    /// ```
    pub fn run<T: Send>(world: usize, f: impl Fn(&InProcessComm) -> T + Sync) -> Vec<T> {
        let comms = Self::group(world);
        std::thread::scope(|s| {
            let handles: Vec<_> = comms.iter().map(|c| s.spawn(|| f(c))).collect();
            handles.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
        })
    }
}

impl InProcessComm {
    /// Enters a collective with `slot`; returns the lock once every rank has entered and the
    /// last one has computed the result.
    fn arrive(&self, slot: Slot) -> Result<MutexGuard<'_, Round>> {
        let sh = &*self.shared;
        let mut st = sh.state.lock().unwrap();
        // A rank cannot start round g+1 before every rank has arrived in round g+1, so the
        // result of round g stays in place until every rank has read it.
        let gen = st.generation;
        st.slots[self.rank] = slot;
        st.arrived += 1;
        if st.arrived == sh.world {
            let slots = std::mem::replace(&mut st.slots, vec![Slot::Empty; sh.world]);
            complete(&mut st, slots);
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
        match &st.failed {
            Some(reason) => Err(Error::Comm { reason: reason.clone() }),
            None => Ok(st),
        }
    }
}

/// Computes the result of a collective every rank has entered.
fn complete(st: &mut Round, slots: Vec<Slot>) {
    let world = slots.len();
    st.failed = None;
    if slots.iter().all(|s| matches!(s, Slot::Gather(_))) {
        let data = slots.into_iter().map(|s| if let Slot::Gather(d) = s { d } else { Vec::new() }).collect();
        st.result = Arc::new(data);
    } else if slots.iter().all(|s| matches!(s, Slot::ToAll(m) if m.len() == world)) {
        let mut rows: Vec<Vec<Vec<u8>>> = (0..world).map(|_| Vec::with_capacity(world)).collect();
        for s in slots {
            if let Slot::ToAll(msgs) = s {
                for (dst, m) in msgs.into_iter().enumerate() {
                    rows[dst].push(m);
                }
            }
        }
        st.rows = rows;
    } else {
        let kinds: Vec<String> = slots
            .iter()
            .map(|s| match s {
                Slot::Gather(_) => "all_gather".to_string(),
                Slot::ToAll(m) => format!("all_to_all of {} messages", m.len()),
                Slot::Empty => "nothing".to_string(),
            })
            .collect();
        st.failed = Some(format!("ranks called different collectives (world size {world}): {kinds:?}"));
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
        let st = self.arrive(Slot::Gather(data.to_vec()))?;
        Ok((*st.result).clone())
    }

    fn all_to_all(&self, send: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>> {
        // The buffers move through the shared state: each message is handed to its receiver,
        // never copied, and nobody sees the messages addressed to others.
        let mut st = self.arrive(Slot::ToAll(send))?;
        Ok(std::mem::take(&mut st.rows[self.rank]))
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

    /// A communicator with only the required collectives, so `all_to_all` is the default one.
    struct GatherOnly(InProcessComm);

    impl Communicator for GatherOnly {
        fn rank(&self) -> usize {
            self.0.rank()
        }
        fn world_size(&self) -> usize {
            self.0.world_size()
        }
        fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
            self.0.all_gather(data)
        }
        fn broadcast(&self, data: &[u8], root: usize) -> Result<Vec<u8>> {
            self.0.broadcast(data, root)
        }
    }

    /// The message rank `src` sends to rank `dst` in round `round` (some empty, sizes vary).
    fn message(src: usize, dst: usize, round: usize) -> Vec<u8> {
        let n = (src * 7 + dst * 3 + round) % 5;
        (0..n).map(|i| (src * 100 + dst * 10 + i + round) as u8).collect()
    }

    /// Rounds of all-to-all interleaved with all-gathers on `comm`; checks every message.
    fn exchange_rounds(c: &dyn Communicator) {
        let (me, world) = (c.rank(), c.world_size());
        for round in 0..20 {
            let send = (0..world).map(|dst| message(me, dst, round)).collect();
            let recv = c.all_to_all(send).unwrap();
            let want: Vec<Vec<u8>> = (0..world).map(|src| message(src, me, round)).collect();
            assert_eq!(recv, want, "rank {me}, round {round}");
            if round % 3 == 0 {
                let g = c.all_gather(&[me as u8, round as u8]).unwrap();
                assert_eq!(g, (0..world).map(|r| vec![r as u8, round as u8]).collect::<Vec<_>>());
            }
        }
    }

    #[test]
    fn all_to_all_delivers_each_message_to_its_rank() {
        InProcessComm::run(4, |c| exchange_rounds(c));
        InProcessComm::run(3, |c| exchange_rounds(&GatherOnly(c.clone())));
        exchange_rounds(&SoloComm);
        exchange_rounds(&GatherOnly(InProcessComm::group(1).pop().unwrap()));
    }

    #[test]
    fn a_wrong_all_to_all_fails_on_every_rank() {
        // Rank 1 gives one message too few: every rank gets an error, none waits forever.
        let bad = |c: &dyn Communicator| {
            let n = if c.rank() == 1 { c.world_size() - 1 } else { c.world_size() };
            c.all_to_all(vec![vec![1u8]; n])
        };
        for r in InProcessComm::run(3, |c| bad(c)) {
            assert!(matches!(r, Err(Error::Comm { .. })), "{r:?}");
        }
        for r in InProcessComm::run(3, |c| bad(&GatherOnly(c.clone()))) {
            assert!(matches!(r, Err(Error::Comm { .. })), "{r:?}");
        }
        // Rank 0 calls all_gather while the others call all_to_all; the group works afterwards.
        let out = InProcessComm::run(3, |c| {
            let r = if c.rank() == 0 {
                c.all_gather(b"x").map(|_| ())
            } else {
                c.all_to_all(vec![Vec::new(); 3]).map(|_| ())
            };
            (r, c.all_to_all(vec![vec![c.rank() as u8]; 3]).unwrap())
        });
        for (r, after) in out {
            assert!(matches!(r, Err(Error::Comm { .. })), "{r:?}");
            assert_eq!(after, vec![vec![0], vec![1], vec![2]]);
        }
        assert!(SoloComm.all_to_all(vec![]).is_err());
    }
}
