//! `tessera-bench --memory-tier --dir D [--memory-root M] [--size S] [--ranks N] [--redundancy K,M]
//! [--rounds R] [--emulators] [--json]`: the memory tier against its references, in the same run.
//!
//! N in-process ranks (default 8) on `--nodes` simulated nodes (default 4; rank r on node
//! ⌊r · nodes / N⌋), each a memory
//! root of its own under M, default `/dev/shm`), each holding S/N bytes of f32 (default S =
//! 512 MiB), RS(K, M) parity (default 2, 2). Each round, with fresh roots:
//!
//! - memcpy reference: every rank copies its state into a pre-faulted buffer of its size, all
//!   ranks at once (as they stage at once); the figure is the slowest rank's time;
//! - the blocking time of [`CheckpointManager::save`] (steps 1 and 2; the slowest rank, the mean of
//!   the two steps): staging into pre-faulted pools; then the background time to commit (copy,
//!   parity exchange and encoding, manifest), until [`CheckpointManager::wait`] returns; step 2
//!   is drained to D (on disk);
//! - the memory the tier holds for a step (every file of the step under every node's root) over
//!   the state's bytes, against (m + 1)× for full copies tolerating the same m lost nodes;
//! - the time of a restore by fresh managers with no node lost (in-place load of every rank's
//!   copy, every byte checked: the part of a restore every rank does), then with one node's
//!   root deleted (rebuild + the same load), into buffers touched before the clock starts (a
//!   model exists before it resumes; the same for the loads), both against a load of the same
//!   step into the same layout from D (page cache dropped first) and, with `--emulators`, from
//!   an S3 server on loopback (moto);
//! - Reed–Solomon encode throughput of one core (RS(K, M) of 8 MiB shards), against a memcpy of
//!   the same bytes on the same core.
//!
//! Then, once: steps lost per failure. A loop of 24 steps of 250 ms of "compute" over a 16 MiB
//! state, saving every step with a drain every 8th; after each save, the newest step complete in memory (a marker on
//! a node) and in the persistent tier (a committed index) are read from the files: a failure at
//! that moment loses the steps since. Reported as the mean over the steps from the 8th on, memory
//! tier against persistent saves every 8 steps.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use serde_json::json;
use tessera::comm::InProcessComm;
use tessera::memory_tier::{CheckpointManager, ManagerOptions, MemoryTier, Tier};
use tessera::storage::Location;
use tessera::{load, save, Communicator, DType, LoadOptions, SaveOptions, ShardedTensor, StateTree, TensorData};
use tessera_synth::sizes::{fmt_bytes, fmt_secs};

use crate::bench::{ratio, Spread};

/// Arguments of the memory-tier benchmark.
pub struct MemoryTierArgs {
    /// The persistent tier's directory (on disk).
    pub dir: PathBuf,
    /// Where the simulated nodes' memory roots go (tmpfs).
    pub memory_root: PathBuf,
    /// Bytes of the whole state.
    pub size: u64,
    /// In-process ranks.
    pub ranks: usize,
    /// Simulated nodes.
    pub nodes: usize,
    /// RS(k, m).
    pub redundancy: (usize, usize),
    /// Rounds.
    pub rounds: usize,
    /// Also load from an S3 server on loopback (moto).
    pub emulators: bool,
    /// Print one JSON object.
    pub json: bool,
}

/// Default size of the whole state.
pub const DEFAULT_SIZE: &str = "512MiB";
/// The state and the "compute" of each step of the steps-lost loop: a step longer than this
/// machine's background commit of that state (2 cores for every simulated rank), as a training
/// step is longer than its checkpoint's background work; otherwise the commits queue up and the
/// figure measures the machine, not the schedule.
const LOST_STATE: u64 = 16 << 20;
const LOST_COMPUTE: Duration = Duration::from_millis(250);
/// Columns of each rank's f32 tensor.
const COLS: u64 = 1024;

fn node(rank: usize, args: &MemoryTierArgs) -> usize {
    rank * args.nodes / args.ranks
}

/// Rows of each rank's part of "w" (f32 [rows × world, COLS], split by rows).
fn rows_per_rank(args: &MemoryTierArgs) -> u64 {
    (args.size / args.ranks as u64 / (COLS * 4)).max(1)
}

fn fill(step: u64, rank: usize, buf: &mut [u8]) {
    for (i, c) in buf.chunks_exact_mut(4).enumerate() {
        c.copy_from_slice(&((i as u64 * 7 + rank as u64 * 1_000_003 + step) as f32).to_le_bytes());
    }
}

fn state<'a>(rows: u64, rank: usize, world: usize, data: TensorData<'a>) -> StateTree<'a> {
    let t = ShardedTensor {
        global_offset: vec![rank as u64 * rows, 0],
        local_shape: vec![rows, COLS],
        ..ShardedTensor::full("w", DType::F32, &[rows * world as u64, COLS], data)
    };
    StateTree::map().with("w", StateTree::Tensor(t))
}

fn options(args: &MemoryTierArgs, mem: &Path, persistent: &Path, rank: usize, persist_every: u64) -> ManagerOptions {
    let n = node(rank, args);
    let share = rows_per_rank(args) * COLS * 4;
    ManagerOptions {
        memory: Some(
            MemoryTier::new(mem.join(format!("node{n}")))
                .node(format!("node{n}"))
                .redundancy(args.redundancy.0, args.redundancy.1),
        ),
        persistent: Some(Location::local(persistent)),
        every: 1,
        persist_every,
        keep_last_memory: 2,
        keep_last_persistent: 2,
        // A whole share per rank (plus the room a checksum block may leave in each buffer).
        staging_bytes: share + (share / (8 << 20) + 2) * (1 << 20),
    }
}

/// The slowest rank's time of `f`, started together.
fn slowest(times: &[Duration]) -> f64 {
    times.iter().map(Duration::as_secs_f64).fold(0.0, f64::max)
}

struct Round {
    memcpy: f64,
    blocking: f64,
    commit: f64,
    held_bytes: u64,
    /// Restore with no node lost (nothing rebuilt): the part of a restore every rank does.
    restore_intact: f64,
    restore: f64,
    load_disk: f64,
    load_s3: Option<f64>,
}

fn dir_bytes(dir: &Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(dir) else { return 0 };
    rd.flatten()
        .map(|e| {
            let p = e.path();
            if p.is_dir() {
                dir_bytes(&p)
            } else {
                e.metadata().map(|m| m.len()).unwrap_or(0)
            }
        })
        .sum()
}

fn one_round(args: &MemoryTierArgs, r: usize, s3: Option<&Location>) -> Result<Round> {
    let world = args.ranks;
    let rows = rows_per_rank(args);
    let share = (rows * COLS * 4) as usize;
    let mem = args.memory_root.join(format!("tessera-bench-memtier-{}-{r}", std::process::id()));
    let persistent = args.dir.join(format!("memtier-{r}"));
    let _ = std::fs::remove_dir_all(&mem);
    let _ = std::fs::remove_dir_all(&persistent);

    // memcpy, blocking save of steps 1 and 2, background commit.
    let bg = InProcessComm::group(world);
    let saved = InProcessComm::run(world, |comm| -> Result<(Duration, Duration, Duration)> {
        let rank = comm.rank();
        let mut src = vec![0u8; share];
        fill(2, rank, &mut src);
        let mut dst = vec![1u8; share];
        comm.barrier()?;
        let t = Instant::now();
        dst.copy_from_slice(&src);
        let memcpy = t.elapsed();
        std::hint::black_box(&dst);
        drop(dst);
        let mut mgr = CheckpointManager::new(options(args, &mem, &persistent, rank, 2), Arc::new(bg[rank].clone()))?;
        let (mut blocking, mut commit) = (Duration::ZERO, Duration::ZERO);
        for step in 1..=2u64 {
            fill(step, rank, &mut src);
            comm.barrier()?;
            let t = Instant::now();
            mgr.save(step, state(rows, rank, world, TensorData::Ref(&src)), comm)?;
            let b = t.elapsed();
            mgr.wait()?;
            blocking += b / 2;
            commit += (t.elapsed() - b) / 2;
        }
        Ok((memcpy, blocking, commit))
    });
    let saved = saved.into_iter().collect::<Result<Vec<_>>>()?;
    let held_bytes: u64 = (0..args.nodes).map(|n| dir_bytes(&mem.join(format!("node{n}/step-000000000002")))).sum();

    // Nothing lost, then one node lost: restores by fresh managers, against loads of the same
    // step.
    let intact = timed_restore(args, &mem, &persistent, false)?;
    std::fs::remove_dir_all(mem.join("node1")).context("deleting node 1's root")?;
    let restored = timed_restore(args, &mem, &persistent, true)?;

    let step_dir = persistent.join("step-000000000002");
    tessera_synth::system::drop_dir_cache(&step_dir)?;
    let load_disk = timed_load(rows, world, &Location::local(&step_dir))?;
    let load_s3 = match s3 {
        Some(base) => {
            let at = base.join(&format!("memtier-{}-{r}", std::process::id()));
            let storage = at.open()?;
            let storage = storage.as_ref();
            let saved = InProcessComm::run(world, |comm| {
                let mut src = vec![0u8; share];
                fill(2, comm.rank(), &mut src);
                save(state(rows, comm.rank(), world, TensorData::Ref(&src)), storage, comm, &SaveOptions::default())
            });
            saved.into_iter().collect::<tessera::Result<Vec<_>>>()?;
            Some(timed_load(rows, world, &at)?)
        }
        None => None,
    };
    let _ = std::fs::remove_dir_all(&mem);
    let _ = std::fs::remove_dir_all(&persistent);
    Ok(Round {
        memcpy: slowest(&saved.iter().map(|s| s.0).collect::<Vec<_>>()),
        blocking: slowest(&saved.iter().map(|s| s.1).collect::<Vec<_>>()),
        commit: slowest(&saved.iter().map(|s| s.2).collect::<Vec<_>>()),
        held_bytes,
        restore_intact: intact,
        restore: restored,
        load_disk,
        load_s3,
    })
}

/// The slowest rank's time to restore step 2 from the memory tier by fresh managers, every
/// byte checked; `lost`: node 1's root was deleted, its ranks' copies must be rebuilt.
fn timed_restore(args: &MemoryTierArgs, mem: &Path, persistent: &Path, lost: bool) -> Result<f64> {
    let world = args.ranks;
    let rows = rows_per_rank(args);
    let share = (rows * COLS * 4) as usize;
    let bg = InProcessComm::group(world);
    let restored = InProcessComm::run(world, |comm| -> Result<(Duration, Vec<usize>)> {
        let rank = comm.rank();
        let mut mgr = CheckpointManager::new(options(args, mem, persistent, rank, 2), Arc::new(bg[rank].clone()))?;
        // The state restored into exists already (a model is built before it resumes):
        // its pages are touched before the clock starts, as for the loads it is set against.
        let mut buf = vec![0xa5u8; share];
        comm.barrier()?;
        let t = Instant::now();
        let got =
            mgr.restore(state(rows, rank, world, TensorData::Mut(&mut buf)), comm)?.context("nothing restored")?;
        let took = t.elapsed();
        ensure!(
            got.step == 2 && got.tier == Tier::Memory,
            "restored step {} from {:?}: {:?}",
            got.step,
            got.tier,
            got.notes
        );
        let rebuilt = got.rebuilt_ranks.clone();
        drop(got);
        let mut want = vec![0u8; share];
        fill(2, rank, &mut want);
        ensure!(buf == want, "rank {rank}: restored bytes differ");
        Ok((took, rebuilt))
    });
    let restored = restored.into_iter().collect::<Result<Vec<_>>>()?;
    ensure!(restored[0].1.is_empty() != lost, "rebuilt {:?} with lost = {lost}", restored[0].1);
    Ok(slowest(&restored.iter().map(|s| s.0).collect::<Vec<_>>()))
}

/// The slowest rank's time to load step 2's state from `at` into the same layout, every byte
/// checked.
fn timed_load(rows: u64, world: usize, at: &Location) -> Result<f64> {
    let storage = at.open()?;
    let storage = storage.as_ref();
    let share = (rows * COLS * 4) as usize;
    let times = InProcessComm::run(world, |comm| -> Result<Duration> {
        let rank = comm.rank();
        let mut buf = vec![0xa5u8; share];
        comm.barrier()?;
        let t = Instant::now();
        load(state(rows, rank, world, TensorData::Mut(&mut buf)), storage, comm, &LoadOptions::default())?;
        let took = t.elapsed();
        let mut want = vec![0u8; share];
        fill(2, rank, &mut want);
        ensure!(buf == want, "rank {rank}: loaded bytes differ");
        Ok(took)
    });
    Ok(slowest(&times.into_iter().collect::<Result<Vec<_>>>()?))
}

/// Single-core Reed–Solomon encode throughput (bytes of data shards per second) and a memcpy of
/// the same bytes on the same core.
fn encode_throughput(k: usize, m: usize) -> Result<(f64, f64)> {
    const SHARD: usize = 8 << 20;
    const TOTAL: usize = 512 << 20;
    let shards: Vec<Vec<u8>> = (0..k).map(|i| (0..SHARD).map(|j| (i * 31 + j * 7) as u8).collect()).collect();
    let mut enc = reed_solomon_simd::ReedSolomonEncoder::new(k, m, SHARD)?;
    let iters = TOTAL.div_ceil(SHARD * k);
    let t = Instant::now();
    for _ in 0..iters {
        enc.reset(k, m, SHARD)?;
        for s in &shards {
            enc.add_original_shard(s)?;
        }
        let out = enc.encode()?;
        std::hint::black_box(out.recovery(0));
    }
    let encode = (iters * k * SHARD) as f64 / t.elapsed().as_secs_f64();
    let mut dst = vec![0u8; SHARD];
    let t = Instant::now();
    for _ in 0..iters {
        for s in &shards {
            dst.copy_from_slice(s);
            std::hint::black_box(&dst);
        }
    }
    let memcpy = (iters * k * SHARD) as f64 / t.elapsed().as_secs_f64();
    Ok((encode, memcpy))
}

/// The newest step with a marker under any node's root, and the newest committed persistent
/// step.
fn newest(mem: &Path, persistent: &Path, nodes: usize) -> (u64, u64) {
    let mut m = 0;
    for n in 0..nodes {
        for e in std::fs::read_dir(mem.join(format!("node{n}"))).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(step) = name.strip_prefix("step-").and_then(|s| s.parse::<u64>().ok()) else { continue };
            let marked = std::fs::read_dir(e.path())
                .into_iter()
                .flatten()
                .flatten()
                .any(|f| f.file_name().to_string_lossy().starts_with("commit-"));
            if marked {
                m = m.max(step);
            }
        }
    }
    let mut p = 0;
    for e in std::fs::read_dir(persistent).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if let Some(step) = name.strip_prefix("step-").and_then(|s| s.parse::<u64>().ok()) {
            if e.path().join(tessera::index::INDEX_FILE).exists() {
                p = p.max(step);
            }
        }
    }
    (m, p)
}

/// Mean steps lost per failure over a run of `steps` steps, memory tier against persistent saves
/// every `every` steps.
fn steps_lost(args: &MemoryTierArgs, steps: u64, every: u64, compute: Duration) -> Result<(f64, f64)> {
    let world = args.ranks;
    // A smaller state: what is measured is the schedule, not the bandwidth.
    let small = MemoryTierArgs {
        dir: args.dir.clone(),
        memory_root: args.memory_root.clone(),
        size: args.size.min(LOST_STATE),
        ranks: args.ranks,
        nodes: args.nodes,
        redundancy: args.redundancy,
        rounds: 1,
        emulators: false,
        json: false,
    };
    let rows = rows_per_rank(&small);
    let share = (rows * COLS * 4) as usize;
    let mem = args.memory_root.join(format!("tessera-bench-memtier-{}-lost", std::process::id()));
    let persistent = args.dir.join("memtier-lost");
    let _ = std::fs::remove_dir_all(&mem);
    let _ = std::fs::remove_dir_all(&persistent);
    let bg = InProcessComm::group(world);
    let samples = InProcessComm::run(world, |comm| -> Result<Vec<(u64, u64, u64)>> {
        let rank = comm.rank();
        let mut mgr =
            CheckpointManager::new(options(&small, &mem, &persistent, rank, every), Arc::new(bg[rank].clone()))?;
        let mut buf = vec![0u8; share];
        let mut out = Vec::new();
        for step in 1..=steps {
            std::thread::sleep(compute);
            fill(step, rank, &mut buf);
            mgr.save(step, state(rows, rank, world, TensorData::Ref(&buf)), comm)?;
            if rank == 0 {
                let (m, p) = newest(&mem, &persistent, small.nodes);
                out.push((step, m, p));
            }
            comm.barrier()?;
        }
        mgr.wait()?;
        Ok(out)
    });
    let samples = samples.into_iter().collect::<Result<Vec<_>>>()?.swap_remove(0);
    let _ = std::fs::remove_dir_all(&mem);
    let _ = std::fs::remove_dir_all(&persistent);
    let counted: Vec<&(u64, u64, u64)> = samples.iter().filter(|s| s.0 >= every).collect();
    let n = counted.len().max(1) as f64;
    let lost_memory = counted.iter().map(|s| (s.0 - s.1) as f64).sum::<f64>() / n;
    let lost_persistent = counted.iter().map(|s| (s.0 - s.2) as f64).sum::<f64>() / n;
    Ok((lost_memory, lost_persistent))
}

/// Runs the benchmark; prints the figures (text, or one JSON object with `--json`).
pub fn run(args: MemoryTierArgs) -> Result<u8> {
    ensure!(args.ranks >= args.nodes && args.nodes >= 2, "--memory-tier: at least 2 nodes, and a rank per node");
    let (k, m) = args.redundancy;
    let s3 = if args.emulators {
        let base = tessera_testkit::s3::fresh_url("bench-memtier");
        Some(Location::parse(&base).with_options(&tessera_testkit::s3::test_options().config))
    } else {
        None
    };
    let state_bytes = rows_per_rank(&args) * COLS * 4 * args.ranks as u64;
    let mut rounds = Vec::new();
    for r in 0..args.rounds {
        rounds.push(one_round(&args, r, s3.as_ref())?);
    }
    let (encode, memcpy_core) = encode_throughput(k, m)?;
    let (lost_memory, lost_persistent) = steps_lost(&args, 24, 8, LOST_COMPUTE)?;

    let blocking = Spread::of(&rounds.iter().map(|r| ratio(r.blocking, r.memcpy)).collect::<Vec<_>>());
    let overhead = rounds[0].held_bytes as f64 / state_bytes as f64;
    let restore_disk = Spread::of(&rounds.iter().map(|r| ratio(r.load_disk, r.restore)).collect::<Vec<_>>());
    let intact_disk = Spread::of(&rounds.iter().map(|r| ratio(r.load_disk, r.restore_intact)).collect::<Vec<_>>());
    let restore_s3 = rounds
        .iter()
        .map(|r| r.load_s3.map(|s| ratio(s, r.restore)))
        .collect::<Option<Vec<_>>>()
        .map(|v| Spread::of(&v));
    let commit = Spread::of(&rounds.iter().map(|r| ratio(r.commit, r.memcpy)).collect::<Vec<_>>());
    if args.json {
        let out = json!({
            "mode": "memory_tier",
            "ranks": args.ranks,
            "nodes": args.nodes,
            "k": k,
            "m": m,
            "state_bytes": state_bytes,
            "rounds": args.rounds,
            "blocking_vs_memcpy": blocking.median,
            "blocking_vs_memcpy_rounds": rounds.iter().map(|r| ratio(r.blocking, r.memcpy)).collect::<Vec<_>>(),
            "commit_vs_memcpy": commit.median,
            "memory_held_vs_state": overhead,
            "memory_held_ideal": (k + m) as f64 / k as f64,
            "replicas_for_same_loss": (m + 1) as f64,
            "encode_bytes_per_sec_per_core": encode,
            "encode_vs_memcpy": encode / memcpy_core,
            "disk_load_vs_restore": restore_disk.median,
            "disk_load_vs_restore_nothing_lost": intact_disk.median,
            "s3_load_vs_restore": restore_s3.as_ref().map(|s| s.median),
            "steps_lost_memory_every_step": lost_memory,
            "steps_lost_persistent_every_8": lost_persistent,
        });
        println!("{out}");
        return Ok(0);
    }
    println!(
        "memory tier: {} ranks on {} simulated nodes, RS({k}, {m}), state {} ({} per rank); {} round(s)",
        args.ranks,
        args.nodes,
        fmt_bytes(state_bytes),
        fmt_bytes(state_bytes / args.ranks as u64),
        args.rounds
    );
    for (i, r) in rounds.iter().enumerate() {
        println!(
            "  round {}: memcpy {}, save blocking {} ({:.2}×), commit in background {}, restore with nothing lost {}, after 1 lost node {}, disk load {}{}",
            i + 1,
            fmt_secs(r.memcpy),
            fmt_secs(r.blocking),
            ratio(r.blocking, r.memcpy),
            fmt_secs(r.commit),
            fmt_secs(r.restore_intact),
            fmt_secs(r.restore),
            fmt_secs(r.load_disk),
            r.load_s3.map(|s| format!(", S3 (moto) load {}", fmt_secs(s))).unwrap_or_default()
        );
    }
    println!(
        "save blocking / memcpy of the state: {:.2}× (min {:.2}, max {:.2}); goal ≤ 1.5×",
        blocking.median, blocking.min, blocking.max
    );
    println!(
        "memory held / state: {overhead:.3}× (ideal (k+m)/k = {:.3}×; full copies tolerating {m} lost nodes: {}×)",
        (k + m) as f64 / k as f64,
        m + 1
    );
    println!(
        "RS({k}, {m}) encode, one core: {}/s ({:.2}× a memcpy on that core); goal ≥ 2 GB/s",
        fmt_bytes(encode as u64),
        encode / memcpy_core
    );
    println!("restore after 1 lost node: {:.2}× faster than a load from local disk (cold cache) (min {:.2}, max {:.2}); goal ≥ 5×", restore_disk.median, restore_disk.min, restore_disk.max);
    println!(
        "restore with nothing lost (every rank's part of any restore, no rebuild): {:.2}× faster than that load (min {:.2}, max {:.2})",
        intact_disk.median, intact_disk.min, intact_disk.max
    );
    if let Some(s) = restore_s3 {
        println!(
            "restore after 1 lost node: {:.2}× faster than a load from S3 on loopback (moto) (min {:.2}, max {:.2})",
            s.median, s.min, s.max
        );
    }
    println!(
        "steps lost per failure (mean over a failure after any step; {} state, {} steps): {lost_memory:.2} saving to memory every step, {lost_persistent:.2} saving to the persistent tier every 8",
        fmt_bytes(LOST_STATE.min(args.size)),
        fmt_secs(LOST_COMPUTE.as_secs_f64())
    );
    Ok(0)
}
