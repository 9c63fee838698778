//! A [`Communicator`] over MPI (cargo feature `mpi`): how Rust programs run tessera across
//! processes and machines, with `mpirun` starting the ranks and a shared filesystem or an object
//! store holding the checkpoint.
//!
//! Messages of varying size travel as a size exchange followed by the `v` variant of the
//! collective (`MPI_Allgatherv`, `MPI_Alltoallv`), so nothing is padded to the largest message.
//! MPI counts are 32-bit: a message of 2 GiB or more is refused with [`Error::Comm`] (tessera's
//! collectives carry metadata, and exchanged reads are sent in rounds of 256 MiB by default).

use std::sync::Mutex;

use mpi::datatype::PartitionMut;
use mpi::environment::Universe;
use mpi::topology::Communicator as _;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use mpi::Threading;

use super::Communicator;
use crate::error::{Error, Result};

/// The ranks of an MPI communicator. Calls are serialized per communicator; give a background
/// commit (async save) its own with [`MpiComm::duplicate`].
pub struct MpiComm {
    comm: Mutex<SimpleCommunicator>,
    rank: usize,
    size: usize,
}

impl std::fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiComm").field("rank", &self.rank).field("size", &self.size).finish()
    }
}

// SAFETY: an `MpiComm` exists only where MPI runs at `MPI_THREAD_MULTIPLE`: `new` queries the
// level and refuses anything less (`init` asks for it), and `duplicate` copies a communicator
// that was checked. At that level MPI may be called from any thread, and the communicator
// handle is plain data, so moving it to another thread (Send) is sound; calls on one
// communicator are serialized by the mutex (Sync), as MPI requires of collectives on one
// communicator.
unsafe impl Send for MpiComm {}
unsafe impl Sync for MpiComm {}

impl MpiComm {
    /// Initializes MPI (thread level `MPI_THREAD_MULTIPLE`) and returns the universe, which
    /// finalizes MPI when dropped (keep it alive while ranks talk), and `MPI_COMM_WORLD`.
    pub fn init() -> Result<(Universe, MpiComm)> {
        let (universe, _) = mpi::initialize_with_threading(Threading::Multiple)
            .ok_or_else(|| Error::Comm { reason: "MPI is already initialized".into() })?;
        let world = MpiComm::new(universe.world())?;
        Ok((universe, world))
    }

    /// Wraps a communicator; fails unless MPI was initialized with `MPI_THREAD_MULTIPLE` (tessera
    /// calls MPI from its IO threads and from an async save's background thread).
    pub fn new(comm: SimpleCommunicator) -> Result<Self> {
        let level = mpi::environment::threading_support();
        if level < Threading::Multiple {
            return Err(Error::Comm {
                reason: format!("this MPI provides thread level {level:?}; tessera needs Multiple"),
            });
        }
        Ok(MpiComm::checked(comm))
    }

    /// Wraps a communicator of an MPI known to run at `MPI_THREAD_MULTIPLE`.
    fn checked(comm: SimpleCommunicator) -> Self {
        let (rank, size) = (comm.rank() as usize, comm.size() as usize);
        MpiComm { comm: Mutex::new(comm), rank, size }
    }

    /// A new communicator over the same ranks (`MPI_Comm_dup`; collective).
    pub fn duplicate(&self) -> Self {
        // The level was checked when `self` was made.
        MpiComm::checked(self.comm.lock().unwrap().duplicate())
    }
}

/// A message size as an MPI count; -1 (sent in its place, so that every rank fails alike
/// instead of some waiting forever) when it does not fit MPI's 32-bit counts.
fn count(n: usize) -> i32 {
    i32::try_from(n).unwrap_or(-1)
}

fn refused(what: &str, rank: usize) -> Error {
    Error::Comm { reason: format!("{what}: rank {rank}'s message is invalid or over MPI's 2 GiB limit") }
}

fn displacements(counts: &[i32]) -> Result<Vec<i32>> {
    let mut at = 0i64;
    counts
        .iter()
        .map(|&c| {
            let d =
                i32::try_from(at).map_err(|_| Error::Comm { reason: "over 2 GiB received in one collective".into() });
            at += c as i64;
            d
        })
        .collect()
}

fn split(buf: &[u8], counts: &[i32]) -> Vec<Vec<u8>> {
    let mut at = 0usize;
    counts
        .iter()
        .map(|&c| {
            let m = buf[at..at + c as usize].to_vec();
            at += c as usize;
            m
        })
        .collect()
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.size
    }

    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        let comm = self.comm.lock().unwrap();
        let mut counts = vec![0i32; self.size];
        comm.all_gather_into(&count(data.len()), &mut counts[..]);
        if let Some(r) = counts.iter().position(|&c| c < 0) {
            return Err(refused("all_gather", r));
        }
        let displs = displacements(&counts)?;
        let mut buf = distinct_buffer(counts.iter().map(|&c| c as usize).sum());
        let empty = distinct_buffer(0);
        let data = if data.is_empty() { &empty[..] } else { data };
        {
            let mut part = PartitionMut::new(&mut buf[..], &counts[..], &displs[..]);
            comm.all_gather_varcount_into(data, &mut part);
        }
        Ok(split(&buf, &counts))
    }

    fn broadcast(&self, data: &[u8], root: usize) -> Result<Vec<u8>> {
        if root >= self.size {
            return Err(Error::Comm { reason: format!("broadcast from rank {root} of {}", self.size) });
        }
        let comm = self.comm.lock().unwrap();
        let root_proc = comm.process_at_rank(root as i32);
        let mut len = if self.rank == root { count(data.len()) } else { 0 };
        root_proc.broadcast_into(&mut len);
        if len < 0 {
            return Err(refused("broadcast", root));
        }
        let mut buf = if self.rank == root { data.to_vec() } else { vec![0u8; len as usize] };
        root_proc.broadcast_into(&mut buf[..]);
        Ok(buf)
    }

    fn barrier(&self) -> Result<()> {
        self.comm.lock().unwrap().barrier();
        Ok(())
    }

    fn all_to_all(&self, send: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>> {
        let comm = self.comm.lock().unwrap();
        // A wrong message count must fail on every rank, not leave the others waiting: the
        // counts travel first, with -1 marking a rank whose call is invalid.
        let mut send_counts: Vec<i32> = send.iter().map(|m| count(m.len())).collect();
        if send_counts.len() != self.size || send_counts.contains(&-1) {
            // Marks every message, so that every rank learns of it.
            send_counts = vec![-1; self.size];
        }
        let mut recv_counts = vec![0i32; self.size];
        comm.all_to_all_into(&send_counts[..], &mut recv_counts[..]);
        if let Some(r) = recv_counts.iter().position(|&c| c < 0) {
            return Err(refused("all_to_all (one message per rank, each under 2 GiB)", r));
        }
        let mut send_buf = distinct_buffer(0);
        for m in &send {
            send_buf.extend_from_slice(m);
        }
        let send_displs = displacements(&send_counts)?;
        let recv_displs = displacements(&recv_counts)?;
        let mut recv_buf = distinct_buffer(recv_counts.iter().map(|&c| c as usize).sum());
        {
            let part_send = mpi::datatype::Partition::new(&send_buf[..], &send_counts[..], &send_displs[..]);
            let mut part_recv = PartitionMut::new(&mut recv_buf[..], &recv_counts[..], &recv_displs[..]);
            comm.all_to_all_varcount_into(&part_send, &mut part_recv);
        }
        Ok(split(&recv_buf, &recv_counts))
    }
}

/// A zeroed buffer of `len` bytes that owns an allocation even when empty. An empty `Vec`'s
/// pointer is a dangling constant, the same for every empty `Vec`: OpenMPI refuses a collective
/// whose send and receive buffers are the same address (`MPI_ERR_ARG`) even when both are
/// empty, as they are for a rank that sends and receives nothing.
fn distinct_buffer(len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len.max(1));
    v.resize(len, 0);
    v
}
