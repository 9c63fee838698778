//! `tessera-bench --reshard --dir D [--size 1GiB] [--tensors 16] [--ranks 2] [--rounds 3] [--cold]
//! [--not-local]`:
//! a resharded load against a memcpy, and a save against a raw write, through the Rust API.
//!
//! The state is `--tensors` square f32 matrices of `--size` bytes in all, held by `--ranks`
//! in-process ranks: saved split by rows (each rank a band of rows, as DTensor `Shard(0)`), then
//! loaded in place into already-touched targets split by columns (`Shard(1)`), so every rank
//! needs a strided piece of every stored chunk. Each round, back to back:
//!
//! - raw write: each rank writes its share's bytes to its own file in D, then fsyncs it (tessera's
//!   save makes its files durable too);
//! - tessera save of the row-split state into D/ckpt;
//! - memcpy: each rank copies its share of the column-split state, already in memory, into its
//!   targets (the same bytes into the same touched buffers as the load);
//! - sequential read: the files of D/ckpt read once with a plain `read` loop, split over the ranks
//!   by files;
//! - tessera load into the column-split targets, every byte then compared with the truth.
//!
//! Every step runs on all ranks at once, timed from a barrier to a barrier (the slowest rank).
//! With `--cold`, the page cache of D/ckpt is dropped before the sequential read and before the
//! load (for a directory on disk); without it the files stay in the page cache (for D on tmpfs,
//! e.g. /dev/shm, where the load runs at memory speed). Ratios are per round, with their median:
//! load / memcpy (warm), load / sequential read (cold), save / raw write, as throughput or
//! time as labelled. Peak RSS of the load over its start (the targets already resident) is the
//! load's extra memory, all ranks together.
//!
//! With `--not-local`, tessera's save and load see D as not local
//! ([`LocalStorage::treat_as_local`]), so they take the paths they take on a network filesystem:
//! several writers per file, whole spans per read, and checksums verified by the ranks
//! together (each reads only the bytes it needs). The references do not change.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

use anyhow::{Context, Result};
use serde_json::json;
use tessera::comm::InProcessComm;
use tessera::storage::LocalStorage;
use tessera::storage::Location;
use tessera::{
    Communicator, DType, LoadOptions, LoadStats, PathSeg, ReplicaId, SaveOptions, ShardedTensor, StateTree, TensorData,
};
use tessera_synth::ranks;
use tessera_synth::sizes::{fmt_bytes, fmt_secs};
use tessera_synth::system;

use crate::bench::{ratio, Spread};
use crate::os;
use crate::scratch::Scratch;

/// Arguments of the resharding benchmark.
pub struct ReshardArgs {
    /// Directory to benchmark in (the checkpoint goes to DIR/ckpt).
    pub dir: PathBuf,
    /// Bytes of state, all ranks together.
    pub size: u64,
    /// Square f32 tensors the state is cut into.
    pub tensors: usize,
    /// Ranks that save and load.
    pub ranks: usize,
    /// Measurement rounds.
    pub rounds: usize,
    /// Drop the checkpoint's page cache before the sequential read and the load.
    pub cold: bool,
    /// IO threads per rank of the save and the load, if not the library's default.
    pub threads: Option<usize>,
    /// Treat the directory as not local, as a network filesystem is.
    pub not_local: bool,
    /// Print one JSON object.
    pub json: bool,
    /// Keep D/ckpt afterwards.
    pub keep: bool,
}

/// The checkpoint directory as tessera's save and load see it: judged by its filesystem, or
/// treated as not local (`--not-local`).
fn storage_at(ckpt: &Path, not_local: bool) -> LocalStorage {
    let storage = LocalStorage::new(ckpt);
    if not_local {
        storage.treat_as_local(false)
    } else {
        storage
    }
}

/// Tensors of the benchmark when `--tensors` is not given.
pub const DEFAULT_TENSORS: usize = 16;

/// The element of tensor `t` at (`row`, `col`) of an `n`×`n` matrix, as bits: distinct enough
/// that a byte landing in the wrong place is caught.
fn element(t: usize, n: u64, row: u64, col: u64) -> u32 {
    let i = (t as u64 * n + row) * n + col;
    (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as u32
}

/// Rows (or columns) `[start, end)` of rank `r` of `ranks` over `n`.
fn band(n: u64, ranks: usize, r: usize) -> (u64, u64) {
    (n * r as u64 / ranks as u64, n * (r as u64 + 1) / ranks as u64)
}

/// Rank `r`'s rows of each tensor (row-split, contiguous).
fn rows_of(n: u64, tensors: usize, ranks: usize, r: usize) -> Vec<Vec<u8>> {
    let (r0, r1) = band(n, ranks, r);
    (0..tensors)
        .map(|t| {
            let mut out = Vec::with_capacity(((r1 - r0) * n * 4) as usize);
            for row in r0..r1 {
                out.extend((0..n).flat_map(|col| element(t, n, row, col).to_le_bytes()));
            }
            out
        })
        .collect()
}

/// Rank `r`'s columns of each tensor (column-split, each rank's block row-major).
fn cols_of(n: u64, tensors: usize, ranks: usize, r: usize) -> Vec<Vec<u8>> {
    let (c0, c1) = band(n, ranks, r);
    (0..tensors)
        .map(|t| {
            let mut out = Vec::with_capacity((n * (c1 - c0) * 4) as usize);
            for row in 0..n {
                out.extend((c0..c1).flat_map(|col| element(t, n, row, col).to_le_bytes()));
            }
            out
        })
        .collect()
}

/// The state tree of rank `r`: tensor `t` split on `axis` over the ranks, over `bufs`.
fn tree<'a>(n: u64, ranks: usize, r: usize, axis: usize, bufs: Vec<TensorData<'a>>) -> Result<StateTree<'a>> {
    let mut tree = StateTree::map();
    for (t, data) in bufs.into_iter().enumerate() {
        let (s, e) = band(n, ranks, r);
        let mut local = [n, n];
        local[axis] = e - s;
        let key = format!("t{t:02}");
        // Even bands are described by rank offsets, uneven ones (n not divisible) as a box.
        let tensor = if n.is_multiple_of(ranks as u64) {
            ShardedTensor::from_rank_offsets(&key, DType::F32, &local, data, &[(axis, r as u64, ranks as u64)], 0)?
        } else {
            let mut offset = vec![0, 0];
            offset[axis] = s;
            ShardedTensor {
                key: key.clone(),
                data,
                dtype: DType::F32,
                local_shape: local.to_vec(),
                global_shape: vec![n, n],
                global_offset: offset,
                axis_fragmentations: None,
                replica_id: ReplicaId::main(),
                prepend_axis_num: 0,
                allow_shape_mismatch: false,
                flattened_range: None,
            }
        };
        tree.set_path(&[PathSeg::Key(key)], StateTree::Tensor(tensor));
    }
    Ok(tree)
}

/// Zeroes every rank's targets: touched (a first load would otherwise pay for their page
/// faults), and holding nothing of the step before.
fn zero(targets: &[Mutex<Vec<Vec<u8>>>]) {
    for t in targets {
        for b in t.lock().unwrap().iter_mut() {
            b.fill(0);
        }
    }
}

/// Runs `step` on every rank at once, from a barrier to a barrier; returns its seconds (the
/// slowest rank's) and each rank's result.
fn timed<T: Send>(ranks: usize, step: impl Fn(&dyn Communicator) -> Result<T> + Sync) -> Result<(f64, Vec<T>)> {
    let results = InProcessComm::run(ranks, |comm| -> Result<(f64, T)> {
        comm.barrier()?;
        let start = Instant::now();
        let r = step(comm);
        ranks::all_ok(comm, r.is_ok())?;
        let secs = start.elapsed().as_secs_f64();
        let secs = ranks::max_over_ranks(comm, secs)?;
        Ok((secs, r?))
    });
    let results = ranks::collect(results)?;
    let secs = results[0].0;
    Ok((secs, results.into_iter().map(|(_, t)| t).collect()))
}

/// Files of `dir`, sorted.
fn files_of(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut names: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("listing {}", dir.display()))?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<_>>()?;
    names.sort();
    Ok(names)
}

/// One round's times in seconds, and the load's counters.
struct Round {
    raw_write: f64,
    save: f64,
    memcpy: f64,
    /// The needed bytes read run by run into the targets, no checksums.
    floor: f64,
    seq_read: f64,
    seq_read_bytes: u64,
    load: f64,
    /// CPU seconds of all ranks in the memcpy and in the load.
    memcpy_cpu: f64,
    load_cpu: f64,
    stats: LoadStats,
    /// Peak RSS of the load over its start, where the kernel's peak could be reset.
    load_extra: Option<u64>,
    mismatches: usize,
}

/// Runs the resharding benchmark.
pub fn run(args: ReshardArgs) -> Result<u8> {
    anyhow::ensure!(args.ranks >= 1, "--ranks must be at least 1");
    anyhow::ensure!(args.rounds >= 1, "--rounds must be at least 1");
    anyhow::ensure!(args.tensors >= 1, "--tensors must be at least 1");
    let n = ((args.size / args.tensors as u64 / 4) as f64).sqrt() as u64;
    anyhow::ensure!(n >= args.ranks as u64, "--size {} is too small for {} tensors", args.size, args.tensors);
    std::fs::create_dir_all(&args.dir).with_context(|| format!("creating {}", args.dir.display()))?;
    let ckpt = args.dir.join("ckpt");
    Location::local(ckpt.clone()).claim()?;
    let (tensors, world) = (args.tensors, args.ranks);
    let sources: Vec<Vec<Vec<u8>>> = (0..world).map(|r| rows_of(n, tensors, world, r)).collect();
    let truth: Vec<Vec<Vec<u8>>> = (0..world).map(|r| cols_of(n, tensors, world, r)).collect();
    let targets: Vec<Mutex<Vec<Vec<u8>>>> =
        (0..world).map(|r| Mutex::new(truth[r].iter().map(|b| vec![0u8; b.len()]).collect())).collect();
    let state_bytes: u64 = sources.iter().flatten().map(|b| b.len() as u64).sum();
    if !args.json {
        println!(
            "reshard bench in {}: {} tensors of {n}×{n} f32 ({} in all), {world} ranks, saved by rows, loaded by \
             columns into touched targets, {}{}; {} round(s)",
            args.dir.display(),
            tensors,
            fmt_bytes(state_bytes),
            if args.cold { "cold (page cache dropped)" } else { "warm (files in page cache)" },
            if args.not_local { ", directory treated as not local" } else { "" },
            args.rounds
        );
    }
    let mut rounds = Vec::new();
    for round in 0..args.rounds {
        os::trim_heap();
        // Raw write: each rank its share into its own file, then fsync.
        let (raw_write, raw_files) = timed(world, |comm| {
            let path = args.dir.join(format!("tessera-bench-raw-{}.bin", comm.rank()));
            let mut f = File::options().write(true).create_new(true).open(&path).with_context(|| {
                format!(
                    "creating {} (the benchmark's scratch file; remove it if a run was interrupted)",
                    path.display()
                )
            })?;
            for b in &sources[comm.rank()] {
                f.write_all(b).with_context(|| format!("writing {}", path.display()))?;
            }
            f.sync_all().with_context(|| format!("fsync of {}", path.display()))?;
            Ok(path)
        })?;
        // Save, row-split, into an empty directory (the raw write's reference pays no deletes of
        // an earlier checkpoint either).
        if ckpt.exists() {
            std::fs::remove_dir_all(&ckpt).with_context(|| format!("removing {}", ckpt.display()))?;
        }
        let mut opts = SaveOptions::default();
        opts.threads = args.threads.unwrap_or(opts.threads);
        let storage = storage_at(&ckpt, args.not_local);
        let (save, _) = timed(world, |comm| {
            let bufs = sources[comm.rank()].iter().map(|b| TensorData::Ref(b)).collect();
            let tree = tree(n, world, comm.rank(), 0, bufs)?;
            tessera::save(tree, &storage, comm, &opts).with_context(|| format!("save, rank {}", comm.rank()))
        })?;
        zero(&targets);
        let cpu = os::cpu_secs().unwrap_or(0.0);
        let (memcpy, _) = timed(world, |comm| {
            let mut mine = targets[comm.rank()].lock().unwrap();
            for (dst, src) in mine.iter_mut().zip(&truth[comm.rank()]) {
                dst.copy_from_slice(src);
            }
            Ok(())
        })?;
        let memcpy_cpu = os::cpu_secs().unwrap_or(0.0) - cpu;
        zero(&targets);
        // The floor of any reader through the kernel: exactly the bytes a rank needs, each run
        // (a row's piece) read by `pread` straight into its place in the targets, no checksum,
        // from the raw write's files (each a saving rank's rows, tensor after tensor).
        if args.cold {
            system::drop_dir_cache(&args.dir)?;
        }
        let (floor, _) = timed(world, |comm| {
            use std::os::unix::fs::FileExt;
            let (c0, c1) = band(n, world, comm.rank());
            let width = ((c1 - c0) * 4) as usize;
            let mut mine = targets[comm.rank()].lock().unwrap();
            for (s, path) in raw_files.iter().enumerate() {
                let f = File::open(path).with_context(|| format!("opening {}", path.display()))?;
                let (r0, r1) = band(n, world, s);
                for (t, target) in mine.iter_mut().enumerate() {
                    for row in r0..r1 {
                        let at = ((t as u64 * (r1 - r0) + row - r0) * n + c0) * 4;
                        let dst = &mut target[row as usize * width..][..width];
                        f.read_exact_at(dst, at).with_context(|| format!("reading {}", path.display()))?;
                    }
                }
            }
            Ok(())
        })?;
        for p in &raw_files {
            std::fs::remove_file(p).with_context(|| format!("removing {}", p.display()))?;
        }
        let floor_ok = targets.iter().zip(&truth).all(|(t, want)| *t.lock().unwrap() == *want);
        anyhow::ensure!(floor_ok, "the floor reference read wrong bytes: the benchmark's layout arithmetic is off");
        zero(&targets);
        let files = files_of(&ckpt)?;
        if args.cold {
            system::drop_dir_cache(&ckpt)?;
        }
        let (seq_read, read) = timed(world, |comm| {
            let mut block = vec![0u8; 16 << 20];
            let mut total = 0u64;
            for path in files.iter().skip(comm.rank()).step_by(world) {
                let mut f = File::open(path).with_context(|| format!("opening {}", path.display()))?;
                loop {
                    let k = f.read(&mut block).with_context(|| format!("reading {}", path.display()))?;
                    if k == 0 {
                        break;
                    }
                    total += k as u64;
                }
            }
            Ok(total)
        })?;
        if args.cold {
            system::drop_dir_cache(&ckpt)?;
        }
        os::trim_heap();
        let rss_start = os::current_rss().unwrap_or(0);
        let peak_resettable = os::reset_peak_rss();
        let storage = storage_at(&ckpt, args.not_local);
        let cpu = os::cpu_secs().unwrap_or(0.0);
        let (load, stats) = timed(world, |comm| {
            let mut mine = targets[comm.rank()].lock().unwrap();
            let bufs = mine.iter_mut().map(|b| TensorData::Mut(b)).collect();
            let tree = tree(n, world, comm.rank(), 1, bufs)?;
            let defaults = LoadOptions::default();
            let opts = LoadOptions { threads: args.threads.unwrap_or(defaults.threads), ..defaults };
            let loaded =
                tessera::load(tree, &storage, comm, &opts).with_context(|| format!("load, rank {}", comm.rank()))?;
            Ok(loaded.stats)
        })?;
        let load_cpu = os::cpu_secs().unwrap_or(0.0) - cpu;
        // Without a reset the kernel's peak is the whole run's: the load's own is unknown.
        let load_extra = peak_resettable.then(|| os::peak_rss().unwrap_or(0).saturating_sub(rss_start));
        let mut mismatches = 0;
        for (t, want) in targets.iter().zip(&truth) {
            mismatches += t.lock().unwrap().iter().zip(want).filter(|(got, want)| got != want).count();
        }
        let mut total = LoadStats::default();
        for s in &stats {
            total.bytes_needed += s.bytes_needed;
            total.bytes_read += s.bytes_read;
            total.reads += s.reads;
        }
        let r = Round {
            raw_write,
            save,
            memcpy,
            floor,
            seq_read,
            seq_read_bytes: read.iter().sum(),
            load,
            memcpy_cpu,
            load_cpu,
            stats: total,
            load_extra,
            mismatches,
        };
        if !args.json {
            println!(
                "round {}/{}  raw write {}  save {} (speed {:.3}× raw)  memcpy {}  floor {} (time {:.3}× memcpy)  seq read {}  load {} (time {:.3}× memcpy, {:.3}× floor; speed {:.3}× seq read; cpu {:.3}× memcpy's){}",
                round + 1,
                args.rounds,
                fmt_secs(r.raw_write),
                fmt_secs(r.save),
                ratio(r.raw_write, r.save),
                fmt_secs(r.memcpy),
                fmt_secs(r.floor),
                ratio(r.floor, r.memcpy),
                fmt_secs(r.seq_read),
                fmt_secs(r.load),
                ratio(r.load, r.memcpy),
                ratio(r.load, r.floor),
                ratio(r.seq_read, r.load),
                ratio(r.load_cpu, r.memcpy_cpu),
                if r.mismatches == 0 { "" } else { "  MISMATCH" }
            );
        }
        rounds.push(r);
    }
    if !args.keep {
        std::fs::remove_dir_all(&ckpt).with_context(|| format!("removing {}", ckpt.display()))?;
    }
    let spread = |f: &dyn Fn(&Round) -> f64| Spread::of(&rounds.iter().map(f).collect::<Vec<_>>());
    let load_vs_memcpy = spread(&|r| ratio(r.load, r.memcpy));
    let floor_vs_memcpy = spread(&|r| ratio(r.floor, r.memcpy));
    let load_vs_floor = spread(&|r| ratio(r.load, r.floor));
    let load_vs_seq = spread(&|r| ratio(r.seq_read, r.load));
    let save_vs_raw = spread(&|r| ratio(r.raw_write, r.save));
    let last = rounds.last().expect("at least one round");
    let read_vs_needed = ratio(last.stats.bytes_read as f64, last.stats.bytes_needed as f64);
    let load_extra: Option<u64> =
        rounds.iter().map(|r| r.load_extra).collect::<Option<Vec<u64>>>().map(|v| v.into_iter().max().unwrap_or(0));
    let verified = rounds.iter().all(|r| r.mismatches == 0);
    if args.json {
        let out = json!({
            "dir": args.dir.display().to_string(),
            "state_bytes": state_bytes,
            "tensors": tensors,
            "n": n,
            "ranks": world,
            "cold": args.cold,
            "not_local": args.not_local,
            "load_time_vs_memcpy": load_vs_memcpy.median,
            "load_time_vs_memcpy_rounds": rounds.iter().map(|r| ratio(r.load, r.memcpy)).collect::<Vec<_>>(),
            "floor_time_vs_memcpy": floor_vs_memcpy.median,
            "load_time_vs_floor": load_vs_floor.median,
            "load_speed_vs_seq_read": load_vs_seq.median,
            "load_cpu_vs_memcpy_cpu_rounds": rounds.iter().map(|r| ratio(r.load_cpu, r.memcpy_cpu)).collect::<Vec<_>>(),
            "save_speed_vs_raw_write": save_vs_raw.median,
            "save_speed_vs_raw_write_rounds": rounds.iter().map(|r| ratio(r.raw_write, r.save)).collect::<Vec<_>>(),
            "seq_read_bytes": last.seq_read_bytes,
            "bytes_needed": last.stats.bytes_needed,
            "bytes_read": last.stats.bytes_read,
            "bytes_read_vs_needed": read_vs_needed,
            "reads": last.stats.reads,
            "load_extra_bytes": load_extra,
            "verified": verified,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!(
            "median  load {:.3}× the memcpy's time ({:.3}–{:.3})   load {:.3}× seq read speed ({:.3}–{:.3})   save \
             {:.3}× raw write speed ({:.3}–{:.3})",
            load_vs_memcpy.median,
            load_vs_memcpy.min,
            load_vs_memcpy.max,
            load_vs_seq.median,
            load_vs_seq.min,
            load_vs_seq.max,
            save_vs_raw.median,
            save_vs_raw.min,
            save_vs_raw.max
        );
        println!(
            "floor   reading the needed bytes run by run into the targets, no checksums: {:.3}× the memcpy's time \
             ({:.3}–{:.3}); load {:.3}× the floor's time ({:.3}–{:.3})",
            floor_vs_memcpy.median,
            floor_vs_memcpy.min,
            floor_vs_memcpy.max,
            load_vs_floor.median,
            load_vs_floor.min,
            load_vs_floor.max
        );
        println!(
            "load    read {} for {} needed ({:.3}×), {} reads; extra memory {} over the targets ({world} ranks)",
            fmt_bytes(last.stats.bytes_read),
            fmt_bytes(last.stats.bytes_needed),
            read_vs_needed,
            last.stats.reads,
            load_extra
                .map_or_else(|| "unknown (peak RSS not resettable)".to_string(), |b| format!("+{}", fmt_bytes(b)))
        );
        println!("check   {}", if verified { "every loaded byte matched in every round" } else { "MISMATCH" });
    }
    Ok(if verified { 0 } else { 1 })
}
