//! `tessera bench --dir D --size S [--ranks N] [--json]`: tessera against the raw device.
//!
//! In one run: (a) the reference, a raw sequential write + fsync of S bytes into a file in D,
//! dropped from the page cache, then read back sequentially; (b) a tessera save of a model of
//! about S bytes from N in-process ranks (TP=N) into D/ckpt, whose files are then dropped from
//! the page cache; (c) a resharded load of it under TP=N/2 (N/2 ranks; every saved chunk is
//! read whole by exactly one rank, so reads stay contiguous). Throughputs are compared with
//! the raw ones; memory is the peak RSS of each phase over the RSS when it started (the state
//! or the load targets, already resident).

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Mutex;
use std::time::Instant;

use anyhow::{Context, Result};
use serde_json::json;
use tessera::{LoadOptions, SaveOptions};

use crate::jobs;
use crate::model::{self, Layout, ModelConfig};
use crate::progress::Progress;
use crate::sizes::{fmt_bytes, fmt_secs, gbps};
use crate::system;

/// Arguments of the IO benchmark.
pub struct BenchArgs {
    /// Directory to benchmark in.
    pub dir: PathBuf,
    /// Bytes to write.
    pub size: u64,
    /// Saving ranks.
    pub ranks: usize,
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
            system::trim_heap();
            self.overall_peak = self.overall_peak.max(system::peak_rss().unwrap_or(0));
            self.resettable = system::reset_peak_rss();
            *phase = Phase { rss_start: system::current_rss().unwrap_or(0), peak: 0 };
        } else {
            phase.peak = system::peak_rss().unwrap_or(0);
            self.overall_peak = self.overall_peak.max(phase.peak);
        }
    }
}

struct Raw {
    write_secs: f64,
    read_secs: f64,
}

/// Sequential write + fsync of `size` bytes, page cache dropped, sequential read.
fn raw_reference(dir: &Path, size: u64) -> Result<Raw> {
    let path = dir.join(RAW_FILE);
    let mut block = vec![0u8; RAW_BLOCK];
    for (i, chunk) in block.chunks_exact_mut(8).enumerate() {
        chunk.copy_from_slice(&model::mix(i as u64).to_le_bytes());
    }
    let bar = Progress::new("raw write + fsync", size);
    let start = Instant::now();
    let mut f = File::create(&path).with_context(|| format!("creating {}", path.display()))?;
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
    system::drop_file_cache(&f).with_context(|| format!("dropping {} from the page cache", path.display()))?;
    drop(f);

    let bar = Progress::new("raw read", size);
    let start = Instant::now();
    let mut f = File::open(&path).with_context(|| format!("opening {}", path.display()))?;
    let mut total = 0u64;
    loop {
        let n = f.read(&mut block).with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            break;
        }
        total += n as u64;
        bar.add(n as u64);
    }
    let read_secs = start.elapsed().as_secs_f64();
    bar.finish();
    drop(f);
    std::fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
    anyhow::ensure!(total == size, "read {total} bytes of {} back from {}", size, path.display());
    Ok(Raw { write_secs, read_secs })
}

/// Runs the IO benchmark.
pub fn run(args: BenchArgs) -> Result<ExitCode> {
    anyhow::ensure!(args.ranks >= 1, "--ranks must be at least 1");
    anyhow::ensure!(args.size > 0, "--size must be positive");
    std::fs::create_dir_all(&args.dir).with_context(|| format!("creating {}", args.dir.display()))?;
    let mem = Mutex::new(Memory::default());

    let raw = raw_reference(&args.dir, args.size)?;
    let raw_write = gbps(args.size, raw.write_secs);
    let raw_read = gbps(args.size, raw.read_secs);

    let cfg = ModelConfig::for_bytes(args.size);
    let save_layout = Layout::Train { tp: args.ranks as u64, dp: 1 };
    let load_layout = if args.ranks >= 2 { Layout::TpPp { tp: args.ranks as u64 / 2, pp: 1 } } else { Layout::Whole };
    let ckpt = args.dir.join("ckpt");
    let opts = SaveOptions { overwrite: true, ..SaveOptions::default() };
    let save_mem = Mutex::new(Phase::default());
    let save = jobs::save(&cfg, save_layout, &ckpt, &opts, &|start| mem.lock().unwrap().mark(start, &save_mem))?;
    let save_mem = save_mem.into_inner().unwrap();
    // The state is freed: give its memory back before the load allocates its targets.
    system::trim_heap();
    system::drop_dir_cache(&ckpt)?;
    let load_mem = Mutex::new(Phase::default());
    let load = jobs::load(&cfg, load_layout, &save_layout.rng_grid(), &ckpt, &LoadOptions::default(), &|start| {
        mem.lock().unwrap().mark(start, &load_mem)
    })?;
    let load_mem = load_mem.into_inner().unwrap();
    let mem = mem.into_inner().unwrap();
    if !args.keep {
        std::fs::remove_dir_all(&ckpt).with_context(|| format!("removing {}", ckpt.display()))?;
    }

    let save_rate = gbps(save.report.total_tensor_bytes, save.secs);
    let load_rate = gbps(load.stats.bytes_needed, load.secs);
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
    let read_vs_needed = load.stats.bytes_read as f64 / load.stats.bytes_needed.max(1) as f64;
    let verified = load.check.problems.is_empty();
    if args.json {
        let out = json!({
            "dir": args.dir.display().to_string(),
            "size_bytes": args.size,
            "ranks": args.ranks,
            "save_layout": save_layout.describe(),
            "load_layout": load_layout.describe(),
            "load_ranks": load_layout.world(),
            "raw_write_secs": raw.write_secs,
            "raw_write_gbps": raw_write,
            "raw_read_secs": raw.read_secs,
            "raw_read_gbps": raw_read,
            "state_bytes": save.state_bytes,
            "checkpoint_bytes": save.report.total_tensor_bytes,
            "files": save.report.files,
            "chunks": save.report.chunks,
            "index_bytes": save.report.index_bytes,
            "save_secs": save.secs,
            "save_gbps": save_rate,
            "load_secs": load.secs,
            "load_gbps": load_rate,
            "save_vs_raw": ratio(save_rate, raw_write),
            "load_vs_raw": ratio(load_rate, raw_read),
            "bytes_needed": load.stats.bytes_needed,
            "bytes_read": load.stats.bytes_read,
            "bytes_read_vs_needed": read_vs_needed,
            "reads": load.stats.reads,
            "peak_rss_bytes": mem.overall_peak,
            "peak_rss_minus_state_bytes": mem.overall_peak.saturating_sub(save.state_bytes),
            "peak_rss_per_phase": mem.resettable,
            "save_rss_start_bytes": save_mem.rss_start,
            "save_peak_rss_bytes": save_mem.peak,
            "save_extra_bytes": save_mem.extra(),
            "load_target_bytes": load.target_bytes,
            "load_rss_start_bytes": load_mem.rss_start,
            "load_peak_rss_bytes": load_mem.peak,
            "load_extra_bytes": load_mem.extra(),
            "verified": verified,
            "problems": load.check.problems.iter().take(20).collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!(
            "bench in {}: {} reference, model of {} ({} layers, hidden {})",
            args.dir.display(),
            fmt_bytes(args.size),
            fmt_bytes(save.state_bytes),
            cfg.layers,
            cfg.hidden
        );
        println!(
            "raw    sequential write+fsync {:>9}  {:>7.2} GB/s   read {:>9}  {:>7.2} GB/s",
            fmt_secs(raw.write_secs),
            raw_write,
            fmt_secs(raw.read_secs),
            raw_read
        );
        println!(
            "save   {:<26} {:>9}  {:>7.2} GB/s   {:.3}× raw write   ({} files, {} chunks, index {})",
            save_layout.describe(),
            fmt_secs(save.secs),
            save_rate,
            ratio(save_rate, raw_write),
            save.report.files,
            save.report.chunks,
            fmt_bytes(save.report.index_bytes)
        );
        println!(
            "load   {:<26} {:>9}  {:>7.2} GB/s   {:.3}× raw read    (read {} for {} needed: {:.3}×, {} reads)",
            load_layout.describe(),
            fmt_secs(load.secs),
            load_rate,
            ratio(load_rate, raw_read),
            fmt_bytes(load.stats.bytes_read),
            fmt_bytes(load.stats.bytes_needed),
            read_vs_needed,
            load.stats.reads
        );
        let per_phase = if mem.resettable { "" } else { " (per-phase peaks unavailable: whole-run peak)" };
        println!(
            "memory peak RSS {} ({} over the {} state); save: +{} over its start; load: +{} over its {} targets{per_phase}",
            fmt_bytes(mem.overall_peak),
            fmt_bytes(mem.overall_peak.saturating_sub(save.state_bytes)),
            fmt_bytes(save.state_bytes),
            fmt_bytes(save_mem.extra()),
            fmt_bytes(load_mem.extra()),
            fmt_bytes(load.target_bytes)
        );
        if verified {
            println!("check  every loaded byte matched ({})", fmt_bytes(load.check.bytes));
        } else {
            println!("check  FAILED: {} problem(s)", load.check.problems.len());
            for p in load.check.problems.iter().take(20) {
                println!("  {p}");
            }
        }
    }
    Ok(if verified { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}
