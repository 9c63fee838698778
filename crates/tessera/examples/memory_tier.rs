//! The memory tier across real processes with MPI: ranks on simulated nodes (rank r of N on
//! node ⌊4r/N⌋, each node a memory root of its own under DIR), a checkpoint every step with
//! RS(2, 2) parity, a drain to DIR/persistent every 3rd step. `scripts/ci/memory_tier_processes.sh`
//! deletes nodes' roots and kills ranks between the runs. Build and run from the repository root:
//!
//! ```sh
//! cargo build --release -p tessera --features mpi --example memory_tier
//! mpirun -n 8 --oversubscribe target/release/examples/memory_tier train /tmp/mt 7
//! rm -rf /tmp/mt/node1 /tmp/mt/node3
//! mpirun -n 8 --oversubscribe target/release/examples/memory_tier restore /tmp/mt 7 memory
//! ```
//!
//! `train DIR STEPS [KILL_RANK save|drain]`: saves steps 1..=STEPS; with KILL_RANK, that rank
//! waits for step STEPS − 1 to be committed, starts step STEPS's save and kills itself
//! (SIGKILL): `save`, 3 ms later, while the step's copy and parity exchange run; `drain`, as
//! soon as its own commit marker of the step is written, while the drain to the persistent
//! tier runs.
//! `restore DIR MIN_STEP TIER`: restores, checks every byte against the step restored, and
//! that the step is at least MIN_STEP and came from TIER (`memory` or `persistent`).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use tessera::comm::MpiComm;
use tessera::memory_tier::{CheckpointManager, ManagerOptions, MemoryTier, Tier};
use tessera::storage::Location;
use tessera::{Communicator, DType, ShardedTensor, StateTree, TensorData, Value};

/// Rows of `w` (f32 [ROWS, COLS], split by rows over the ranks).
const ROWS: u64 = 4096;
const COLS: u64 = 64;

fn node(rank: usize, world: usize) -> usize {
    rank * 4 / world
}

fn w_rows(rank: usize, world: usize) -> (u64, u64) {
    let per = ROWS / world as u64;
    (rank as u64 * per, per)
}

fn w_bytes(step: u64, rank: usize, world: usize) -> Vec<u8> {
    let (start, n) = w_rows(rank, world);
    (start * COLS..(start + n) * COLS).flat_map(|i| (i as f32 * 0.25 + step as f32).to_le_bytes()).collect()
}

/// A tensor of this rank alone, of a length of its own (the copies are of unequal sizes).
fn own_bytes(step: u64, rank: usize) -> Vec<u8> {
    (0..(rank * 1013 + 77)).map(|i| (i as u64 * 31 + step * 3 + rank as u64) as u8).collect()
}

fn state<'a>(rank: usize, world: usize, w: &'a mut [u8], own: &'a mut [u8], step: u64) -> StateTree<'a> {
    let (start, n) = w_rows(rank, world);
    let wt = ShardedTensor {
        global_offset: vec![start, 0],
        local_shape: vec![n, COLS],
        ..ShardedTensor::full("w", DType::F32, &[ROWS, COLS], TensorData::Mut(w))
    };
    let key = format!("own{rank}");
    let ot = ShardedTensor::full(key.clone(), DType::U8, &[own.len() as u64], TensorData::Mut(own));
    let mut tree =
        StateTree::map().with("w", StateTree::Tensor(wt)).with("step", StateTree::Value(Value::Int(step as i64)));
    if world == 8 {
        tree.insert(key, StateTree::Tensor(ot));
    }
    tree
}

fn options(dir: &Path, rank: usize, world: usize) -> ManagerOptions {
    let n = node(rank, world);
    ManagerOptions {
        memory: Some(
            MemoryTier::new(dir.join(format!("node{n}")))
                .node(format!("node{n}"))
                .redundancy(2, 2)
                .chunk_bytes(64 << 10),
        ),
        persistent: Some(Location::local(dir.join("persistent"))),
        every: 1,
        persist_every: 3,
        keep_last_memory: 2,
        keep_last_persistent: 2,
        staging_bytes: 64 << 20,
    }
}

fn train(dir: &Path, steps: u64, kill: Option<usize>, during_drain: bool, comm: &MpiComm) -> tessera::Result<()> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let mut mgr = CheckpointManager::new(options(dir, rank, world), Arc::new(comm.duplicate()))?;
    for step in 1..=steps {
        if kill.is_some() && step == steps {
            // Step STEPS − 1 is committed everywhere before the one that is killed starts.
            mgr.wait()?;
            comm.barrier()?;
        }
        let mut w = w_bytes(step, rank, world);
        let mut own = own_bytes(step, rank);
        mgr.save(step, state(rank, world, &mut w, &mut own, step), comm)?;
        if kill == Some(rank) && step == steps {
            if during_drain {
                let marker = dir.join(format!("node{}/step-{step:012}/commit-r{rank:06}.json", node(rank, world)));
                while !marker.exists() {
                    std::thread::sleep(std::time::Duration::from_micros(200));
                }
            } else {
                std::thread::sleep(std::time::Duration::from_millis(3));
            }
            // SAFETY: raising a signal touches no memory; SIGKILL ends the process here.
            unsafe { libc::raise(libc::SIGKILL) };
        }
    }
    mgr.wait()
}

fn restore(dir: &Path, min_step: u64, tier: &str, comm: &MpiComm) -> Result<String, String> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let mut mgr =
        CheckpointManager::new(options(dir, rank, world), Arc::new(comm.duplicate())).map_err(|e| e.to_string())?;
    let mut w = vec![0u8; w_bytes(0, rank, world).len()];
    let mut own = vec![0u8; own_bytes(0, rank).len()];
    let r = mgr
        .restore(state(rank, world, &mut w, &mut own, 0), comm)
        .map_err(|e| e.to_string())?
        .ok_or("nothing to restore")?;
    let (step, got_tier, rebuilt, notes) = (r.step, r.tier, r.rebuilt_ranks.clone(), r.notes.clone());
    let StateTree::Map(m) = r.state else { return Err("not a map".into()) };
    if !matches!(m.get("step"), Some(StateTree::Value(Value::Int(s))) if *s as u64 == step) {
        return Err(format!("rank {rank}: the common value `step` is not {step}"));
    }
    drop(m);
    let want_tier = if tier == "memory" { Tier::Memory } else { Tier::Persistent };
    if got_tier != want_tier || step < min_step {
        return Err(format!(
            "rank {rank}: restored step {step} from {got_tier:?}, expected ≥ {min_step} from {want_tier:?}: {notes:?}"
        ));
    }
    if w != w_bytes(step, rank, world) {
        return Err(format!("rank {rank}: w differs from step {step}'s"));
    }
    if world == 8 && own != own_bytes(step, rank) {
        return Err(format!("rank {rank}: own{rank} differs from step {step}'s"));
    }
    Ok(format!("step {step} from {got_tier:?}, rebuilt ranks {rebuilt:?}; notes: {notes:?}"))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let (_universe, comm) = match MpiComm::init() {
        Ok(x) => x,
        Err(e) => {
            eprintln!("MPI: {e}");
            return ExitCode::FAILURE;
        }
    };
    let dir = PathBuf::from(args.get(2).cloned().unwrap_or_default());
    let num = |i: usize| args.get(i).and_then(|s| s.parse::<u64>().ok());
    let outcome = match (args.get(1).map(String::as_str), num(3)) {
        (Some("train"), Some(steps)) => {
            train(&dir, steps, num(4).map(|r| r as usize), args.get(5).is_some_and(|w| w == "drain"), &comm)
                .map(|()| format!("trained {steps} steps"))
                .map_err(|e| e.to_string())
        }
        (Some("restore"), Some(min)) => restore(&dir, min, args.get(4).map_or("memory", String::as_str), &comm),
        _ => {
            Err("usage: memory_tier train DIR STEPS [KILL_RANK save|drain] | restore DIR MIN_STEP memory|persistent"
                .into())
        }
    };
    // Every rank's verdict reaches rank 0, which prints one line for the job.
    let msg = match &outcome {
        Ok(s) => format!("ok {s}"),
        Err(e) => format!("FAILED {e}"),
    };
    let all = comm.all_gather(msg.as_bytes()).unwrap_or_default();
    let failed = all.iter().any(|m| m.starts_with(b"FAILED"));
    if comm.rank() == 0 {
        for (r, m) in all.iter().enumerate() {
            if m.starts_with(b"FAILED") || r == 0 {
                println!("rank {r}: {}", String::from_utf8_lossy(m));
            }
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
