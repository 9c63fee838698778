//! `tessera-bench --async --dir D [--size S] [--ranks N] [--budget B] [--rounds R] [--json]`:
//! the async save against a plain memcpy and against the sync save, in the same rounds.
//!
//! The state is the model of `tessera-bench` (about S bytes, TP=N over N in-process ranks),
//! generated once. It is saved in two configurations, each with its own staging pools (one per
//! rank, created and pre-faulted before the rounds; their creation is timed once, apart): the
//! budget B per rank (default 64 MiB, so that with S = 1 GiB and N = 4 each rank's 256 MiB is
//! staged in waves: the save then returns once the last wave is staged, which includes writing
//! the earlier ones), and a budget that holds a rank's whole share (its bytes, plus the room lost
//! because a checksum block never spans two staging buffers). If B already holds the share,
//! only that configuration runs.
//!
//! Each round of a configuration runs, back to back: (a) the memcpy reference: every rank
//! copies its state into a buffer of the same size, allocated and faulted in before the rounds,
//! all ranks at once (as they stage at once); then the planning every save does before staging
//! (`validate_sharding_integrity`: the same exchange and validation, no IO), for context;
//! (b) an async save into D/ckpt ([`AsyncSaver::save`], then [`AsyncSave::finalize`]; the
//! background commits run on a second in-process group); (c) a sync [`tessera::save`] of the
//! same state into D/ckpt. (b) and (c) swap places in even rounds. Every time is the largest
//! over ranks of each rank's own time from a common barrier: the blocking time of the async save
//! runs from the call until it returns, its total time until `finalize` returns. Both saves use
//! the same options and storage (a local directory: data files fsynced, index committed by
//! write-temp + fsync + rename; or the object store of an `s3://…` D), and the checkpoint is
//! removed after each; there is no page cache to drop (`tessera-bench` drops it before reads only; these are writes, all fsynced,
//! into files deleted afterwards).
//!
//! Reported per configuration: each round's ratios blocking / memcpy, blocking / sync and
//! total / sync, with their median and min–max; host memory: the peak RSS during the async save
//! (VmHWM reset at its start, or VmRSS sampled where the kernel refuses the reset) over the RSS
//! before the pools were created, the largest over rounds, against the budget of the process
//! (the sum of the ranks' pools); how much of it the pools are (measured at their creation) and
//! how much the save added to the RSS it started with; and the most bytes the pools lent out at
//! once. Between the two, the peak over the RSS before the pools also counts what the earlier
//! saves of the run left in malloc's per-thread arenas (freed, but not given back by
//! `malloc_trim`; it disappears with `MALLOC_ARENA_MAX=1`). The last round's async checkpoint is
//! verified (every checksum) and must hold the same chunks as the sync one; the exit code is 1
//! otherwise.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use serde_json::json;
use tessera::comm::InProcessComm;
use tessera::index::DEFAULT_BLOCK_SIZE;
use tessera::storage::Location;
use tessera::{AsyncSave, AsyncSaver, Communicator, SaveOptions, StagingPool, Storage, TensorData};
use tessera_synth::model::{self, Layout, Leaf, ModelConfig};
use tessera_synth::progress::Progress;
use tessera_synth::ranks;
use tessera_synth::sizes::{fmt_bytes, fmt_secs};

use crate::bench::{ratio, Spread};
use crate::os;
use crate::peak::{self, PeakWatch};
use crate::scratch::Scratch;

/// Arguments of the async-save benchmark.
pub struct AsyncArgs {
    /// Directory (or URL) to benchmark in (the checkpoint goes to DIR/ckpt).
    pub dir: Location,
    /// Approximate size of the state.
    pub size: u64,
    /// In-process ranks (TP).
    pub ranks: usize,
    /// Staging budget per rank.
    pub budget: u64,
    /// Rounds per configuration.
    pub rounds: usize,
    /// Print one JSON object.
    pub json: bool,
}

/// Default staging budget per rank.
pub const DEFAULT_BUDGET: &str = "64MiB";

/// A staging budget that holds `share` bytes without waiting for a buffer: each buffer of
/// [`StagingPool::DEFAULT_BUFFER_SIZE`] bytes may leave up to a checksum block unused.
fn whole_share_budget(share: u64) -> u64 {
    let buffer = StagingPool::DEFAULT_BUFFER_SIZE as u64;
    (share.div_ceil(buffer - DEFAULT_BLOCK_SIZE) + 1) * buffer
}

/// One configuration: its name and staging budget per rank.
struct Config {
    name: &'static str,
    budget: u64,
}

/// One round of one configuration; times are the largest over ranks.
#[derive(Debug, Clone, Copy, Default)]
struct Round {
    memcpy: f64,
    /// `validate_sharding_integrity`: the exchange and validation of a save, no IO.
    plan: f64,
    blocking: f64,
    total: f64,
    sync: f64,
    /// RSS when the async save started, and its peak during the save (rank 0 only).
    rss_start: u64,
    peak_rss: u64,
}

impl Round {
    fn blocking_vs_memcpy(&self) -> f64 {
        ratio(self.blocking, self.memcpy)
    }
    fn blocking_vs_sync(&self) -> f64 {
        ratio(self.blocking, self.sync)
    }
    fn total_vs_sync(&self) -> f64 {
        ratio(self.total, self.sync)
    }
    /// What the async save added to the RSS it started with (the pools already resident).
    fn growth(&self) -> u64 {
        self.peak_rss.saturating_sub(self.rss_start)
    }
}

/// What the last round's checkpoints held (rank 0).
#[derive(Debug, Clone, Default)]
struct Check {
    files: usize,
    chunks: usize,
    sync_chunks: usize,
    bytes_checked: u64,
    problems: Vec<String>,
}

/// What one rank measured for one configuration (the memory figures and check: rank 0 only).
#[derive(Debug, Default)]
struct RankConfig {
    rounds: Vec<Round>,
    create_secs: f64,
    capacity: u64,
    /// Every rank's most bytes lent out by its pool at once.
    peaks: Vec<u64>,
    rss_before: u64,
    rss_after_pools: u64,
    check: Check,
}

/// Everything the ranks share.
struct Ctx<'a> {
    args: &'a AsyncArgs,
    ckpt: Location,
    share: u64,
    opts: SaveOptions,
}

/// The state tree of a rank over its buffers.
fn tree<'b>(leaves: &[Leaf], bufs: &'b [Vec<u8>]) -> tessera::Result<tessera::StateTree<'b>> {
    model::build_tree(leaves, bufs.iter().map(|b| TensorData::Ref(b)).collect(), true)
}

/// Removes the benchmark checkpoint, if any.
fn remove(ckpt: &Location) -> Result<()> {
    ckpt.remove()
}

/// Opens the checkpoint's storage on every rank (a fresh one for each save, as a training job
/// would); fails on every rank if it fails on one.
fn open(comm: &dyn Communicator, ckpt: &Location) -> Result<Arc<dyn Storage>> {
    let storage = ckpt.open();
    ranks::all_ok(comm, storage.is_ok())?;
    Ok(storage?)
}

/// Rank 0 runs `f` while the others wait; every rank gets its verdict.
fn on_rank0(comm: &dyn Communicator, f: impl FnOnce() -> Result<()>) -> Result<()> {
    let r = if comm.rank() == 0 { f() } else { Ok(()) };
    ranks::all_ok(comm, r.is_ok())?;
    r
}

#[allow(clippy::too_many_arguments)]
fn run_config(
    ctx: &Ctx<'_>,
    config: &Config,
    comm: &InProcessComm,
    commit: &Arc<dyn Communicator>,
    leaves: &[Leaf],
    bufs: &[Vec<u8>],
    reference: &mut [u8],
) -> Result<RankConfig> {
    let rank = comm.rank();
    let rounds = ctx.args.rounds;
    let mut out = RankConfig::default();
    // The RSS before the pools: every rank idle, the previous configuration's pools freed.
    comm.barrier()?;
    if rank == 0 {
        os::trim_heap();
        out.rss_before = os::current_rss().unwrap_or(0);
    }
    comm.barrier()?;
    let start = Instant::now();
    let pool = StagingPool::new(config.budget);
    let create = start.elapsed().as_secs_f64();
    ranks::all_ok(comm, pool.is_ok())?;
    let pool = pool?;
    out.create_secs = ranks::max_over_ranks(comm, create)?;
    out.capacity = pool.capacity();
    if rank == 0 {
        out.rss_after_pools = os::current_rss().unwrap_or(0);
    }
    let mut saver = AsyncSaver::new(pool.clone(), commit.clone());
    if rank == 0 && !ctx.args.json {
        let world = comm.world_size() as u64;
        let shape = if out.capacity >= whole_share_budget(ctx.share) {
            "holds a rank's whole share".to_string()
        } else {
            let waves = ctx.share.div_ceil(out.capacity.max(1));
            format!("≈ {waves} wave{}", if waves == 1 { "" } else { "s" })
        };
        println!(
            "── {}: staging budget {} per rank ({}); pools of {} in all ({} × {}) created in {}, +{} RSS",
            config.name.replace('_', " "),
            fmt_bytes(out.capacity),
            shape,
            fmt_bytes(out.capacity * world),
            world,
            fmt_bytes(out.capacity),
            fmt_secs(out.create_secs),
            fmt_bytes(out.rss_after_pools.saturating_sub(out.rss_before)),
        );
    }

    for round in 0..rounds {
        let mut r = Round::default();
        // (a) The memcpy reference into an already-faulted buffer.
        comm.barrier()?;
        let start = Instant::now();
        let mut at = 0;
        for b in bufs {
            reference[at..at + b.len()].copy_from_slice(b);
            at += b.len();
        }
        let memcpy = start.elapsed().as_secs_f64();
        std::hint::black_box(&*reference);
        r.memcpy = ranks::max_over_ranks(comm, memcpy)?;
        // The planning every save does before staging: the same exchange and validation.
        let t = tree(leaves, bufs);
        ranks::all_ok(comm, t.is_ok())?;
        let t = t?;
        comm.barrier()?;
        let start = Instant::now();
        let valid = tessera::validate_sharding_integrity(t, comm);
        let plan = start.elapsed().as_secs_f64();
        ranks::all_ok(comm, valid.is_ok())?;
        valid.with_context(|| format!("validate_sharding_integrity, rank {rank}"))?;
        r.plan = ranks::max_over_ranks(comm, plan)?;
        let last = round + 1 == rounds;
        let async_first = round % 2 == 0;
        for step in 0..2 {
            if (step == 0) == async_first {
                // (b) The async save.
                let t = tree(leaves, bufs);
                ranks::all_ok(comm, t.is_ok())?;
                let t = t?;
                let storage = open(comm, &ctx.ckpt)?;
                let watch = (rank == 0).then(PeakWatch::start);
                if rank == 0 {
                    r.rss_start = os::current_rss().unwrap_or(0);
                }
                comm.barrier()?;
                let start = Instant::now();
                let started = saver.save(t, storage, comm, &ctx.opts);
                let blocking = start.elapsed().as_secs_f64();
                let done = started.and_then(AsyncSave::finalize);
                let total = start.elapsed().as_secs_f64();
                ranks::all_ok(comm, done.is_ok())?;
                let report = done.with_context(|| format!("async save, rank {rank}"))?;
                if let Some(w) = watch {
                    r.peak_rss = w.finish();
                }
                r.blocking = ranks::max_over_ranks(comm, blocking)?;
                r.total = ranks::max_over_ranks(comm, total)?;
                on_rank0(comm, || {
                    if last {
                        let v = tessera::tools::verify(ctx.ckpt.open()?.as_ref(), ctx.opts.threads)
                            .context("verifying the async checkpoint")?;
                        out.check.files = report.files;
                        out.check.chunks = report.chunks;
                        out.check.bytes_checked = v.bytes_checked;
                        out.check.problems.extend(v.problems);
                    }
                    remove(&ctx.ckpt)
                })?;
            } else {
                // (c) The sync save.
                let t = tree(leaves, bufs);
                ranks::all_ok(comm, t.is_ok())?;
                let t = t?;
                let storage = open(comm, &ctx.ckpt)?;
                comm.barrier()?;
                let start = Instant::now();
                let done = tessera::save(t, storage.as_ref(), comm, &ctx.opts);
                let secs = start.elapsed().as_secs_f64();
                ranks::all_ok(comm, done.is_ok())?;
                let report = done.with_context(|| format!("sync save, rank {rank}"))?;
                r.sync = ranks::max_over_ranks(comm, secs)?;
                if last {
                    out.check.sync_chunks = report.chunks;
                }
                on_rank0(comm, || remove(&ctx.ckpt))?;
            }
        }
        if rank == 0 && !ctx.args.json {
            print_round(round, rounds, &r, out.rss_before);
        }
        out.rounds.push(r);
    }
    drop(saver);
    let peaks = comm.all_gather(&pool.peak_bytes_in_use().to_le_bytes())?;
    out.peaks = peaks.iter().map(|b| b.as_slice().try_into().map_or(0, u64::from_le_bytes)).collect();
    if rank == 0 && !ctx.args.json {
        Summary { config, rank: &out, world: comm.world_size() as u64 }.print();
    }
    Ok(out)
}

fn print_round(index: usize, count: usize, r: &Round, rss_before: u64) {
    println!(
        "round {:<4} memcpy {:>7}  plan {:>7}  async: blocking {:>7} total {:>7}  sync {:>7}  blocking {:.3}× memcpy {:.3}× sync  total {:.3}× sync  peak RSS +{} (+{} over the save's start)",
        format!("{}/{count}", index + 1),
        fmt_secs(r.memcpy),
        fmt_secs(r.plan),
        fmt_secs(r.blocking),
        fmt_secs(r.total),
        fmt_secs(r.sync),
        r.blocking_vs_memcpy(),
        r.blocking_vs_sync(),
        r.total_vs_sync(),
        fmt_bytes(r.peak_rss.saturating_sub(rss_before)),
        fmt_bytes(r.growth()),
    );
}

/// A configuration's figures (rank 0's record).
struct Summary<'a> {
    config: &'a Config,
    rank: &'a RankConfig,
    world: u64,
}

impl Summary<'_> {
    fn values(&self, f: impl Fn(&Round) -> f64) -> Vec<f64> {
        self.rank.rounds.iter().map(f).collect()
    }
    fn spread(&self, f: impl Fn(&Round) -> f64) -> Spread {
        Spread::of(&self.values(f))
    }
    fn budget_total(&self) -> u64 {
        self.rank.capacity * self.world
    }
    fn peak_rss(&self) -> u64 {
        self.rank.rounds.iter().map(|r| r.peak_rss).max().unwrap_or(0)
    }
    fn peak_extra(&self) -> u64 {
        self.peak_rss().saturating_sub(self.rank.rss_before)
    }
    fn pool_rss(&self) -> u64 {
        self.rank.rss_after_pools.saturating_sub(self.rank.rss_before)
    }
    fn growth(&self) -> u64 {
        self.rank.rounds.iter().map(Round::growth).max().unwrap_or(0)
    }
    fn verified(&self) -> bool {
        self.rank.check.problems.is_empty() && self.rank.check.chunks == self.rank.check.sync_chunks
    }

    fn json(&self, share: u64) -> serde_json::Value {
        let r = self.rank;
        let spread = |f: fn(&Round) -> f64| self.spread(f).median;
        json!({
            "name": self.config.name,
            "budget_per_rank_bytes": self.config.budget,
            "pool_bytes_per_rank": r.capacity,
            "pool_bytes_total": self.budget_total(),
            "holds_share": r.capacity >= whole_share_budget(share),
            "waves": share as f64 / r.capacity.max(1) as f64,
            "pool_create_secs": r.create_secs,
            "pool_rss_bytes": self.pool_rss(),
            "pool_rss_vs_budget": ratio(self.pool_rss() as f64, self.budget_total() as f64),
            "memcpy_secs": spread(|r| r.memcpy),
            "plan_secs": spread(|r| r.plan),
            "blocking_secs": spread(|r| r.blocking),
            "total_secs": spread(|r| r.total),
            "sync_secs": spread(|r| r.sync),
            "blocking_vs_memcpy": spread(Round::blocking_vs_memcpy),
            "blocking_vs_memcpy_rounds": self.values(Round::blocking_vs_memcpy),
            "blocking_vs_sync": spread(Round::blocking_vs_sync),
            "blocking_vs_sync_rounds": self.values(Round::blocking_vs_sync),
            "total_vs_sync": spread(Round::total_vs_sync),
            "total_vs_sync_rounds": self.values(Round::total_vs_sync),
            "rss_before_pools_bytes": r.rss_before,
            "peak_rss_bytes": self.peak_rss(),
            "peak_rss_extra_bytes": self.peak_extra(),
            "peak_rss_extra_vs_budget": ratio(self.peak_extra() as f64, self.budget_total() as f64),
            "peak_rss_extra_rounds": self.rank.rounds.iter().map(|x| x.peak_rss.saturating_sub(r.rss_before)).collect::<Vec<_>>(),
            "save_rss_growth_bytes": self.growth(),
            "save_rss_growth_rounds": self.rank.rounds.iter().map(Round::growth).collect::<Vec<_>>(),
            "pool_peak_in_use_bytes": self.rank.peaks.iter().copied().max().unwrap_or(0),
            "pool_peak_in_use_bytes_per_rank": r.peaks,
            "files": r.check.files,
            "chunks": r.check.chunks,
            "sync_chunks": r.check.sync_chunks,
            "bytes_verified": r.check.bytes_checked,
            "verified": self.verified(),
            "problems": r.check.problems.iter().take(20).collect::<Vec<_>>(),
        })
    }

    fn print(&self) {
        let line = |name: &str, s: Spread, what: &str| {
            format!("{name} {:.3}× {what} (min–max {:.3}–{:.3})", s.median, s.min, s.max)
        };
        println!(
            "median     {}   {}   {}",
            line("blocking", self.spread(Round::blocking_vs_memcpy), "memcpy"),
            line("blocking", self.spread(Round::blocking_vs_sync), "sync save"),
            line("total", self.spread(Round::total_vs_sync), "sync save"),
        );
        let median = |f: fn(&Round) -> f64| fmt_secs(self.spread(f).median);
        println!(
            "times      medians: memcpy {}, planning (validate_sharding_integrity) {}, async blocking {} and total {}, sync {}",
            median(|r| r.memcpy),
            median(|r| r.plan),
            median(|r| r.blocking),
            median(|r| r.total),
            median(|r| r.sync),
        );
        println!(
            "memory     peak RSS during the async save +{} over the RSS before the pools: {:.3}× the budget of {} ({} × {}); the pools +{} ({:.3}×), the save itself at most +{} over its start; pools lent out at most {} per rank",
            fmt_bytes(self.peak_extra()),
            ratio(self.peak_extra() as f64, self.budget_total() as f64),
            fmt_bytes(self.budget_total()),
            self.world,
            fmt_bytes(self.rank.capacity),
            fmt_bytes(self.pool_rss()),
            ratio(self.pool_rss() as f64, self.budget_total() as f64),
            fmt_bytes(self.growth()),
            fmt_bytes(self.rank.peaks.iter().copied().max().unwrap_or(0)),
        );
        let c = &self.rank.check;
        if self.verified() {
            println!(
                "check      last async checkpoint verified: {} files, {} chunks (as many as the sync save's), {} checksummed",
                c.files,
                c.chunks,
                fmt_bytes(c.bytes_checked)
            );
        } else {
            println!(
                "check      FAILED: {} chunks async vs {} sync, {} problem(s)",
                c.chunks,
                c.sync_chunks,
                c.problems.len()
            );
            for p in c.problems.iter().take(20) {
                println!("  {p}");
            }
        }
    }
}

/// Runs the async-save benchmark.
pub fn run(args: AsyncArgs) -> Result<u8> {
    anyhow::ensure!(args.ranks >= 1, "--ranks must be at least 1");
    anyhow::ensure!(args.rounds >= 1, "--rounds must be at least 1");
    anyhow::ensure!(args.size > 0, "--size must be positive");
    anyhow::ensure!(
        args.budget >= DEFAULT_BLOCK_SIZE,
        "--budget must be at least one checksum block ({})",
        fmt_bytes(DEFAULT_BLOCK_SIZE)
    );
    args.dir.create()?;
    let cfg = ModelConfig::for_bytes(args.size);
    let layout = Layout::Train { tp: args.ranks as u64, dp: 1 };
    let world = layout.world();
    let grid = layout.rng_grid();
    let all: Vec<Vec<Leaf>> = (0..world).map(|r| model::leaves(&cfg, layout, r, &grid)).collect();
    let shares: Vec<u64> = all.iter().map(|l| model::data_bytes(l)).collect();
    let state_bytes: u64 = shares.iter().sum();
    let share = shares.iter().copied().max().unwrap_or(0);
    let whole = whole_share_budget(share);
    let mut configs = Vec::new();
    if args.budget < whole {
        configs.push(Config { name: "waves", budget: args.budget });
    }
    configs.push(Config { name: "whole_share", budget: args.budget.max(whole) });
    let ctx = Ctx {
        args: &args,
        ckpt: args.dir.join("ckpt"),
        share,
        opts: SaveOptions { overwrite: true, ..SaveOptions::default() },
    };
    // The rounds delete the checkpoint: the location must be the benchmark's own.
    ctx.ckpt.claim()?;
    let method = {
        let probe = PeakWatch::start();
        let method = probe.method();
        probe.finish();
        method
    };
    if !args.json {
        println!(
            "bench --async in {}: model of {} ({} layers, hidden {}), {}, at most {} per rank; staging buffers of {}; peak RSS from {}; {} round(s) per configuration",
            args.dir,
            fmt_bytes(state_bytes),
            cfg.layers,
            cfg.hidden,
            layout.describe(),
            fmt_bytes(share),
            fmt_bytes(StagingPool::DEFAULT_BUFFER_SIZE as u64),
            method.describe(),
            args.rounds,
        );
    }

    let generating = Progress::new(&format!("generating state ({world} ranks)"), state_bytes);
    let results = ranks::run_with_commit_group(world, |comm, commit| -> Result<Vec<RankConfig>> {
        let rank = comm.rank();
        let leaves = &all[rank];
        let bufs = model::generate(leaves, Some(&generating));
        // The memcpy target: the same size as this rank's state, faulted in now.
        let mut reference = vec![0x5au8; shares[rank] as usize];
        ranks::all_ok(comm, true)?;
        if rank == 0 {
            generating.finish();
        }
        let mut out = Vec::with_capacity(configs.len());
        for config in &configs {
            out.push(run_config(&ctx, config, comm, &commit, leaves, &bufs, &mut reference)?);
        }
        Ok(out)
    });
    let results = ranks::collect(results)?;

    let summaries: Vec<Summary<'_>> =
        configs.iter().zip(&results[0]).map(|(config, rank)| Summary { config, rank, world: world as u64 }).collect();
    let verified = summaries.iter().all(Summary::verified);
    if args.json {
        let out = json!({
            "mode": "async",
            "dir": args.dir.to_string(),
            "size_bytes": args.size,
            "ranks": args.ranks,
            "rounds": args.rounds,
            "layout": layout.describe(),
            "state_bytes": state_bytes,
            "share_bytes_max": share,
            "staging_buffer_bytes": StagingPool::DEFAULT_BUFFER_SIZE,
            "block_bytes": DEFAULT_BLOCK_SIZE,
            "rss_method": method.describe(),
            "rss_per_phase": method == peak::Method::Hwm,
            "configs": summaries.iter().map(|s| s.json(share)).collect::<Vec<_>>(),
            "verified": verified,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    }
    Ok(if verified { 0 } else { 1 })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_whole_share_budget_leaves_room_for_the_unused_tail_of_every_buffer() {
        let buffer = StagingPool::DEFAULT_BUFFER_SIZE as u64;
        assert_eq!(whole_share_budget(1), 2 * buffer);
        let share = 256 << 20;
        let budget = whole_share_budget(share);
        assert!(budget / buffer * (buffer - DEFAULT_BLOCK_SIZE) >= share);
        assert!(budget <= share * 5 / 4);
    }
}
