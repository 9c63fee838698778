//! `tessera-bench --dir D --size S [--ranks N] [--rounds R] [--json]`: tessera against the raw device.
//!
//! Disk timings are noisy, so the benchmark runs in R rounds (default 3). Each round runs, back
//! to back: (a) the write reference, a raw sequential write + fsync of S bytes into a file in D;
//! (b) a tessera save of a model of about S bytes from N in-process ranks (TP=N) into D/ckpt;
//! (c) the read reference, a plain sequential `read` of every file of D/ckpt (the same bytes
//! on the same disk blocks as the load reads), and a resharded load of it under TP=N/2 (N/2
//! ranks), whose bytes are all checked; the page cache is dropped before each of the two, and
//! their order alternates from round to round.
//! Each round compares its own save and load throughputs with its own raw ones; the report
//! gives every round's ratios and their median with the min–max range. The other times and
//! rates are medians over rounds too (each taken on its own). Memory is the peak RSS of each
//! phase over the RSS when it started (the state or the load targets, already resident),
//! the largest over rounds. The checkpoint is removed after every round (kept after the last
//! with `--keep`); the exit code is 1 if any round loaded a wrong byte.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

use anyhow::{Context, Result};
use serde_json::json;
use tessera::storage::LocalStorage;
use tessera::storage::Location;
use tessera::{LoadOptions, SaveOptions};
use tessera_synth::jobs;
use tessera_synth::model::{self, Layout, ModelConfig};
use tessera_synth::progress::Progress;
use tessera_synth::sizes::{fmt_bytes, fmt_secs, gbps};
use tessera_synth::system;

use crate::os;
use crate::scratch::Scratch;

/// Arguments of the IO benchmark.
pub struct BenchArgs {
    /// Directory to benchmark in.
    pub dir: PathBuf,
    /// Bytes to write.
    pub size: u64,
    /// Saving ranks.
    pub ranks: usize,
    /// Measurement rounds (raw reference, save, load each).
    pub rounds: usize,
    /// Print one JSON object.
    pub json: bool,
    /// Keep the checkpoint (D/ckpt) afterwards.
    pub keep: bool,
}

const RAW_FILE: &str = "tessera-bench-raw.bin";
const RAW_BLOCK: usize = 16 << 20;

/// Peak-RSS bookkeeping across phases (the kernel's peak is reset at the start of each).
#[derive(Default)]
struct Memory {
    overall_peak: u64,
    resettable: bool,
}

#[derive(Default, Clone, Copy)]
struct Phase {
    rss_start: u64,
    peak: u64,
}

impl Phase {
    fn extra(&self) -> u64 {
        self.peak.saturating_sub(self.rss_start)
    }
}

impl Memory {
    /// Start (`true`) or end of a phase: reset the kernel's peak, or read it.
    fn mark(&mut self, start: bool, phase: &Mutex<Phase>) {
        let mut phase = phase.lock().unwrap();
        if start {
            os::trim_heap();
            self.overall_peak = self.overall_peak.max(os::peak_rss().unwrap_or(0));
            self.resettable = os::reset_peak_rss();
            *phase = Phase { rss_start: os::current_rss().unwrap_or(0), peak: 0 };
        } else {
            phase.peak = os::peak_rss().unwrap_or(0);
            self.overall_peak = self.overall_peak.max(phase.peak);
        }
    }
}

struct Raw {
    write_secs: f64,
    read_secs: f64,
    read_bytes: u64,
}

/// Sequential write + fsync of `size` bytes into a fresh file in `dir` (removed afterwards).
fn raw_write(dir: &Path, size: u64) -> Result<f64> {
    let path = dir.join(RAW_FILE);
    let mut block = vec![0u8; RAW_BLOCK];
    for (i, chunk) in block.chunks_exact_mut(8).enumerate() {
        chunk.copy_from_slice(&model::mix(i as u64).to_le_bytes());
    }
    let bar = Progress::new("raw write + fsync", size);
    let start = Instant::now();
    // A new file only: a file of this name that is not the benchmark's is neither truncated nor
    // removed.
    let mut f = File::options().write(true).create_new(true).open(&path).with_context(|| {
        format!("creating {} (the benchmark's scratch file; remove it if a run was interrupted)", path.display())
    })?;
    let mut left = size;
    while left > 0 {
        let n = left.min(RAW_BLOCK as u64) as usize;
        f.write_all(&block[..n]).with_context(|| format!("writing {}", path.display()))?;
        left -= n as u64;
        bar.add(n as u64);
    }
    f.sync_all().with_context(|| format!("fsync of {}", path.display()))?;
    let write_secs = start.elapsed().as_secs_f64();
    bar.finish();
    drop(f);
    std::fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
    Ok(write_secs)
}

/// Sequential read, with a plain `read` loop and the page cache dropped first, of every file of
/// the checkpoint: the same bytes, on the same disk blocks, as the load reads.
fn raw_read(ckpt: &Path) -> Result<(u64, f64)> {
    system::drop_dir_cache(ckpt)?;
    let mut block = vec![0u8; RAW_BLOCK];
    let mut names: Vec<PathBuf> = std::fs::read_dir(ckpt)
        .with_context(|| format!("listing {}", ckpt.display()))?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<_>>()?;
    names.sort();
    let start = Instant::now();
    let mut total = 0u64;
    for path in names {
        let mut f = File::open(&path).with_context(|| format!("opening {}", path.display()))?;
        loop {
            let n = f.read(&mut block).with_context(|| format!("reading {}", path.display()))?;
            if n == 0 {
                break;
            }
            total += n as u64;
        }
    }
    Ok((total, start.elapsed().as_secs_f64()))
}

/// What every round shares.
struct Setup {
    cfg: ModelConfig,
    save_layout: Layout,
    load_layout: Layout,
    ckpt: PathBuf,
}

/// One round: the raw reference, then tessera's save and resharded load.
struct Round {
    raw: Raw,
    save: jobs::Saved,
    load: jobs::Loaded,
    save_mem: Phase,
    load_mem: Phase,
    /// Peak RSS over the round (counted from the last reset of the kernel's peak before it).
    peak_rss: u64,
    /// Whether the kernel's peak could be reset for each phase.
    per_phase: bool,
    // Throughputs in GB/s, and tessera's over the raw ones of this round.
    raw_write_gbps: f64,
    raw_read_gbps: f64,
    save_gbps: f64,
    load_gbps: f64,
    save_vs_raw: f64,
    load_vs_raw: f64,
}

impl Round {
    fn verified(&self) -> bool {
        self.load.check.problems.is_empty()
    }
}

/// `a / b`, or 0 when `b` is not positive.
pub(crate) fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

/// Runs one round; removes the checkpoint afterwards unless `keep`.
fn run_round(args: &BenchArgs, setup: &Setup, round: usize, keep: bool) -> Result<Round> {
    // Give back what the previous round freed, so it does not count in this round's memory.
    os::trim_heap();
    let write_secs = raw_write(&args.dir, args.size)?;
    let mem = Mutex::new(Memory::default());
    let opts = SaveOptions { overwrite: true, ..SaveOptions::default() };
    let save_mem = Mutex::new(Phase::default());
    let save = jobs::save(&setup.cfg, setup.save_layout, &LocalStorage::new(&setup.ckpt), &opts, &|start| {
        mem.lock().unwrap().mark(start, &save_mem)
    })?;
    // The state is freed: give its memory back before the load allocates its targets.
    os::trim_heap();
    // The raw read goes first in odd rounds and second in even ones, so that whatever the disk
    // does to a first (or second) read after a write weighs on both sides alike.
    let mut reference = None;
    if round.is_multiple_of(2) {
        reference = Some(raw_read(&setup.ckpt)?);
    }
    system::drop_dir_cache(&setup.ckpt)?;
    let load_mem = Mutex::new(Phase::default());
    let rng_grid = setup.save_layout.rng_grid();
    // A fresh storage: LocalStorage keeps the files it opened open.
    let storage = LocalStorage::new(&setup.ckpt);
    let load = jobs::load(&setup.cfg, setup.load_layout, &rng_grid, &storage, &LoadOptions::default(), &|start| {
        mem.lock().unwrap().mark(start, &load_mem)
    })?;
    let (read_bytes, read_secs) = match reference {
        Some(r) => r,
        None => raw_read(&setup.ckpt)?,
    };
    let raw = Raw { write_secs, read_secs, read_bytes };
    if !keep {
        std::fs::remove_dir_all(&setup.ckpt).with_context(|| format!("removing {}", setup.ckpt.display()))?;
    }
    let mem = mem.into_inner().unwrap();
    let raw_write_gbps = gbps(args.size, raw.write_secs);
    let raw_read_gbps = gbps(raw.read_bytes, raw.read_secs);
    let save_gbps = gbps(save.report.total_tensor_bytes, save.secs);
    let load_gbps = gbps(load.stats.bytes_needed, load.secs);
    Ok(Round {
        raw,
        save,
        load,
        save_mem: save_mem.into_inner().unwrap(),
        load_mem: load_mem.into_inner().unwrap(),
        peak_rss: mem.overall_peak,
        per_phase: mem.resettable,
        raw_write_gbps,
        raw_read_gbps,
        save_gbps,
        load_gbps,
        save_vs_raw: ratio(save_gbps, raw_write_gbps),
        load_vs_raw: ratio(load_gbps, raw_read_gbps),
    })
}

/// Median, minimum and maximum of one figure over the rounds.
#[derive(Debug, PartialEq)]
pub(crate) struct Spread {
    pub(crate) median: f64,
    pub(crate) min: f64,
    pub(crate) max: f64,
}

impl Spread {
    /// The spread of `values` (not empty); the median of an even count is the mean of the middle two.
    pub(crate) fn of(values: &[f64]) -> Spread {
        let mut v = values.to_vec();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let median = if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 };
        Spread { median, min: v[0], max: v[n - 1] }
    }
}

/// One figure of every round.
fn per_round(rounds: &[Round], figure: impl Fn(&Round) -> f64) -> Vec<f64> {
    rounds.iter().map(figure).collect()
}

fn median(rounds: &[Round], figure: impl Fn(&Round) -> f64) -> f64 {
    Spread::of(&per_round(rounds, figure)).median
}

fn max<T: Ord + Default>(rounds: &[Round], figure: impl Fn(&Round) -> T) -> T {
    rounds.iter().map(figure).max().unwrap_or_default()
}

fn print_header(args: &BenchArgs, setup: &Setup, first: &Round) {
    println!(
        "bench in {}: {} reference, model of {} ({} layers, hidden {}); save {}, load {}; {} round(s)",
        args.dir.display(),
        fmt_bytes(args.size),
        fmt_bytes(first.save.state_bytes),
        setup.cfg.layers,
        setup.cfg.hidden,
        setup.save_layout.describe(),
        setup.load_layout.describe(),
        args.rounds
    );
}

fn print_round(index: usize, count: usize, r: &Round) {
    println!(
        "round {:<4} raw write {:>7} {:>5.2} GB/s  read {:>7} {:>5.2} GB/s  save {:>7} {:>5.2} GB/s {:.3}× raw  load {:>7} {:>5.2} GB/s {:.3}× raw{}",
        format!("{}/{count}", index + 1),
        fmt_secs(r.raw.write_secs),
        r.raw_write_gbps,
        fmt_secs(r.raw.read_secs),
        r.raw_read_gbps,
        fmt_secs(r.save.secs),
        r.save_gbps,
        r.save_vs_raw,
        fmt_secs(r.load.secs),
        r.load_gbps,
        r.load_vs_raw,
        if r.verified() { "" } else { "  MISMATCH" }
    );
}

/// Runs the IO benchmark.
pub fn run(args: BenchArgs) -> Result<u8> {
    anyhow::ensure!(args.ranks >= 1, "--ranks must be at least 1");
    anyhow::ensure!(args.rounds >= 1, "--rounds must be at least 1");
    anyhow::ensure!(args.size > 0, "--size must be positive");
    std::fs::create_dir_all(&args.dir).with_context(|| format!("creating {}", args.dir.display()))?;
    let setup = Setup {
        cfg: ModelConfig::for_bytes(args.size),
        save_layout: Layout::Train { tp: args.ranks as u64, dp: 1 },
        load_layout: if args.ranks >= 2 { Layout::TpPp { tp: args.ranks as u64 / 2, pp: 1 } } else { Layout::Whole },
        ckpt: args.dir.join("ckpt"),
    };
    // The rounds delete the checkpoint directory: it must be the benchmark's own.
    Location::local(setup.ckpt.clone()).claim()?;

    let mut rounds = Vec::with_capacity(args.rounds);
    for i in 0..args.rounds {
        let round = run_round(&args, &setup, i, args.keep && i + 1 == args.rounds)?;
        if !args.json {
            if i == 0 {
                print_header(&args, &setup, &round);
            }
            print_round(i, args.rounds, &round);
        }
        rounds.push(round);
    }

    // Files, chunks and the bytes needed are the same every round; reads are the worst round's.
    let first = &rounds[0];
    let save_ratios = per_round(&rounds, |r| r.save_vs_raw);
    let load_ratios = per_round(&rounds, |r| r.load_vs_raw);
    let save_vs_raw = Spread::of(&save_ratios);
    let load_vs_raw = Spread::of(&load_ratios);
    let state_bytes = first.save.state_bytes;
    let bytes_needed = first.load.stats.bytes_needed;
    let bytes_read = max(&rounds, |r| r.load.stats.bytes_read);
    let reads = max(&rounds, |r| r.load.stats.reads);
    let read_vs_needed = bytes_read as f64 / bytes_needed.max(1) as f64;
    let peak_rss = max(&rounds, |r| r.peak_rss);
    let per_phase = rounds.iter().all(|r| r.per_phase);
    let save_extra = max(&rounds, |r| r.save_mem.extra());
    let load_extra = max(&rounds, |r| r.load_mem.extra());
    let failed: Vec<usize> = (0..rounds.len()).filter(|&i| !rounds[i].verified()).map(|i| i + 1).collect();
    let problems: Vec<String> = rounds
        .iter()
        .enumerate()
        .flat_map(|(i, r)| r.load.check.problems.iter().map(move |p| format!("round {}: {p}", i + 1)))
        .collect();
    let verified = failed.is_empty();

    if args.json {
        let out = json!({
            "dir": args.dir.display().to_string(),
            "size_bytes": args.size,
            "ranks": args.ranks,
            "rounds": args.rounds,
            "save_layout": setup.save_layout.describe(),
            "load_layout": setup.load_layout.describe(),
            "load_ranks": setup.load_layout.world(),
            "raw_write_secs": median(&rounds, |r| r.raw.write_secs),
            "raw_write_gbps": median(&rounds, |r| r.raw_write_gbps),
            "raw_read_secs": median(&rounds, |r| r.raw.read_secs),
            "raw_read_gbps": median(&rounds, |r| r.raw_read_gbps),
            "state_bytes": state_bytes,
            "checkpoint_bytes": first.save.report.total_tensor_bytes,
            "files": first.save.report.files,
            "chunks": first.save.report.chunks,
            "index_bytes": first.save.report.index_bytes,
            "save_secs": median(&rounds, |r| r.save.secs),
            "save_gbps": median(&rounds, |r| r.save_gbps),
            "load_secs": median(&rounds, |r| r.load.secs),
            "load_gbps": median(&rounds, |r| r.load_gbps),
            "save_vs_raw": save_vs_raw.median,
            "save_vs_raw_rounds": save_ratios,
            "load_vs_raw": load_vs_raw.median,
            "load_vs_raw_rounds": load_ratios,
            "bytes_needed": bytes_needed,
            "bytes_read": bytes_read,
            "bytes_read_vs_needed": read_vs_needed,
            "reads": reads,
            "peak_rss_bytes": peak_rss,
            "peak_rss_minus_state_bytes": peak_rss.saturating_sub(state_bytes),
            "peak_rss_per_phase": per_phase,
            "save_rss_start_bytes": max(&rounds, |r| r.save_mem.rss_start),
            "save_peak_rss_bytes": max(&rounds, |r| r.save_mem.peak),
            "save_extra_bytes": save_extra,
            "load_target_bytes": first.load.target_bytes,
            "load_rss_start_bytes": max(&rounds, |r| r.load_mem.rss_start),
            "load_peak_rss_bytes": max(&rounds, |r| r.load_mem.peak),
            "load_extra_bytes": load_extra,
            "verified": verified,
            "failed_rounds": failed,
            "problems": problems.iter().take(20).collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!(
            "median     save {:.3}× raw write (min–max {:.3}–{:.3})   load {:.3}× raw read (min–max {:.3}–{:.3})",
            save_vs_raw.median, save_vs_raw.min, save_vs_raw.max, load_vs_raw.median, load_vs_raw.min, load_vs_raw.max
        );
        println!(
            "save   {} files, {} chunks, index {}",
            first.save.report.files,
            first.save.report.chunks,
            fmt_bytes(first.save.report.index_bytes)
        );
        println!(
            "load   read {} for {} needed: {:.3}×, {} reads",
            fmt_bytes(bytes_read),
            fmt_bytes(bytes_needed),
            read_vs_needed,
            reads
        );
        let per_phase = if per_phase { "" } else { " (per-phase peaks unavailable: whole-run peak)" };
        println!(
            "memory peak RSS {} ({} over the {} state); save: +{} over its start; load: +{} over its {} targets{per_phase}",
            fmt_bytes(peak_rss),
            fmt_bytes(peak_rss.saturating_sub(state_bytes)),
            fmt_bytes(state_bytes),
            fmt_bytes(save_extra),
            fmt_bytes(load_extra),
            fmt_bytes(first.load.target_bytes)
        );
        if verified {
            println!(
                "check  every loaded byte matched in every round ({} per round)",
                fmt_bytes(first.load.check.bytes)
            );
        } else {
            let failed: Vec<String> = failed.iter().map(usize::to_string).collect();
            println!("check  FAILED in round(s) {}: {} problem(s)", failed.join(", "), problems.len());
            for p in problems.iter().take(20) {
                println!("  {p}");
            }
        }
    }
    Ok(if verified { 0 } else { 1 })
}

#[cfg(test)]
mod tests {
    use super::Spread;

    #[test]
    fn spread_of_odd_and_even_counts() {
        assert_eq!(Spread::of(&[0.9, 0.5, 1.2]), Spread { median: 0.9, min: 0.5, max: 1.2 });
        assert_eq!(Spread::of(&[2.0, 1.0, 4.0, 3.0]), Spread { median: 2.5, min: 1.0, max: 4.0 });
        assert_eq!(Spread::of(&[0.7]), Spread { median: 0.7, min: 0.7, max: 0.7 });
    }
}
