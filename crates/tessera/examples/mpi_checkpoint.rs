//! tessera across processes with MPI: save from one world size, load under another layout and
//! world size, check every byte. Build and run from the repository root:
//!
//! ```sh
//! cargo build --release -p tessera --features mpi --example mpi_checkpoint
//! mpirun -n 4 --oversubscribe target/release/examples/mpi_checkpoint save /tmp/tessera-mpi
//! mpirun -n 3 --oversubscribe target/release/examples/mpi_checkpoint load /tmp/tessera-mpi
//! mpirun -n 1 target/release/examples/mpi_checkpoint load /tmp/tessera-mpi
//! ```
//!
//! The location may be a directory every rank sees (a shared filesystem across machines) or an
//! object store prefix (`s3://bucket/prefix`).
//!
//! Saved state (world size N): `w` f32 [840, 96] split by rows over the ranks, `emb` bf16
//! [64, 120] split by columns, `norm` f32 [96] replicated (rank 0 writes it), and `step`.
//! Loaded state (world size M): `w` split by columns, `emb` by rows, `norm` whole on every rank,
//! with the fully-parallel load (each byte range read once, exchanged with `MPI_Alltoallv`).

use std::process::ExitCode;

use tessera::comm::MpiComm;
use tessera::{
    load, save, Communicator, DType, LoadOptions, ReplicaId, SaveOptions, ShardedTensor, StateTree, TensorData, Value,
};

const W: [u64; 2] = [840, 96];
const EMB: [u64; 2] = [64, 120];
const NORM: [u64; 1] = [96];

/// The value every element of each tensor must hold, as bytes, from its global index.
fn element(key: &str, i: u64, j: u64) -> Vec<u8> {
    match key {
        "w" => ((i * W[1] + j) as f32 * 0.5).to_le_bytes().to_vec(),
        // bf16: the top half of an f32.
        "emb" => (((i * 7 + j) as f32 - 300.0).to_bits() >> 16).to_le_bytes()[..2].to_vec(),
        "norm" => (1.0f32 + j as f32 / 128.0).to_le_bytes().to_vec(),
        _ => unreachable!(),
    }
}

fn dtype(key: &str) -> DType {
    if key == "emb" {
        DType::BF16
    } else {
        DType::F32
    }
}

/// `[start, end)` of part `p` of `n` near-equal parts of `len`.
fn part(len: u64, p: usize, n: usize) -> (u64, u64) {
    (len * p as u64 / n as u64, len * (p as u64 + 1) / n as u64)
}

/// A box of a 2-D (or 1-D) global tensor with its expected bytes.
fn piece(key: &str, global: &[u64], offset: &[u64], shape: &[u64]) -> (ShardedTensor<'static>, Vec<u8>) {
    let mut bytes = Vec::new();
    let (rows, cols) = if shape.len() == 2 { (shape[0], shape[1]) } else { (1, shape[0]) };
    let (r0, c0) = if offset.len() == 2 { (offset[0], offset[1]) } else { (0, offset[0]) };
    for i in r0..r0 + rows {
        for j in c0..c0 + cols {
            bytes.extend(element(key, i, j));
        }
    }
    let mut t = ShardedTensor::full(key, dtype(key), shape, TensorData::None);
    t.global_shape = global.to_vec();
    t.global_offset = offset.to_vec();
    (t, bytes)
}

fn save_layout(rank: usize, world: usize) -> Vec<(ShardedTensor<'static>, Vec<u8>)> {
    let (r0, r1) = part(W[0], rank, world);
    let (c0, c1) = part(EMB[1], rank, world);
    let mut norm = piece("norm", &NORM, &[0], &NORM);
    norm.0.replica_id = ReplicaId::from(rank as u32);
    vec![piece("w", &W, &[r0, 0], &[r1 - r0, W[1]]), piece("emb", &EMB, &[0, c0], &[EMB[0], c1 - c0]), norm]
}

fn load_layout(rank: usize, world: usize) -> Vec<(ShardedTensor<'static>, Vec<u8>)> {
    let (c0, c1) = part(W[1], rank, world);
    let (r0, r1) = part(EMB[0], rank, world);
    vec![
        piece("w", &W, &[0, c0], &[W[0], c1 - c0]),
        piece("emb", &EMB, &[r0, 0], &[r1 - r0, EMB[1]]),
        piece("norm", &NORM, &[0], &NORM),
    ]
}

fn run(comm: &MpiComm, action: &str, location: &str) -> Result<bool, tessera::Error> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let storage = tessera::storage::Location::parse(location).open()?;
    match action {
        "save" => {
            let mut tree = StateTree::map();
            for (mut t, bytes) in save_layout(rank, world) {
                t.data = TensorData::Owned(bytes);
                tree.insert(t.key.clone(), StateTree::Tensor(t));
            }
            tree.insert("step", StateTree::Value(Value::Int(1000)));
            let opts = SaveOptions { overwrite: true, ..Default::default() };
            let report = save(tree, storage.as_ref(), comm, &opts)?;
            if rank == 0 {
                println!("saved {location} from {world} MPI ranks: {} bytes written by rank 0", report.bytes_written);
            }
            Ok(true)
        }
        "load" => {
            let mut tree = StateTree::map();
            let mut layout = Vec::new();
            for (t, want) in load_layout(rank, world) {
                layout.push((t.key.clone(), want));
                tree.insert(t.key.clone(), StateTree::Tensor(t));
            }
            // Fully-parallel load: each stored byte range is read by one rank and sent to the
            // others that need it (MPI_Alltoallv).
            let opts = LoadOptions { exchange_reads: true, ..Default::default() };
            let result = load(tree, storage.as_ref(), comm, &opts)?;
            let StateTree::Map(loaded) = result.state else { unreachable!("load returns the tree it is given") };
            let mut good = true;
            for (key, want) in &layout {
                let got = match loaded.get(key) {
                    Some(StateTree::Tensor(t)) => t.data.bytes(),
                    _ => None,
                };
                if got != Some(want.as_slice()) {
                    eprintln!("rank {rank}: {key} differs from what was saved");
                    good = false;
                }
            }
            let step = loaded.get("step");
            if !matches!(step, Some(StateTree::Value(Value::Int(1000)))) {
                eprintln!("rank {rank}: step is {step:?}");
                good = false;
            }
            // Every rank's verdict, so rank 0 can report for the job.
            let verdicts = comm.all_gather(&[good as u8])?;
            let all = verdicts.iter().all(|v| v == &[1]);
            if rank == 0 {
                let needed: u64 = layout.iter().map(|(_, b)| b.len() as u64).sum();
                println!(
                    "loaded {location} under {world} MPI ranks (w by columns, emb by rows): every byte {} \
                     (rank 0 needed {needed} bytes, read {}, received {} from other ranks)",
                    if all { "matches" } else { "DOES NOT match" },
                    result.stats.bytes_read,
                    result.stats.bytes_received
                );
            }
            Ok(all)
        }
        other => Err(tessera::Error::InvalidArgument { reason: format!("unknown action {other:?}: save or load") }),
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 3 {
        eprintln!("usage: mpirun -n N {} save|load LOCATION", args[0]);
        return ExitCode::from(2);
    }
    let (_universe, comm) = match MpiComm::init() {
        Ok(x) => x,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    match run(&comm, &args[1], &args[2]) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("rank {}: {e}", comm.rank());
            ExitCode::FAILURE
        }
    }
}
