//! `tessera`: demo, inspect, verify, bench and gc for tessera checkpoints.

mod bench;
mod bench_async;
mod bench_parallel;
mod demo;
mod gc;
mod inspect;
mod jobs;
mod model;
mod peak;
mod plansim;
mod progress;
mod ranks;
mod sizes;
mod system;
mod verify;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Result};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "tessera", version, about = "Distributed checkpoints: demo, inspect, verify, bench, gc")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Save a GPT-like model + Adam state from 8 ranks (TP=4 × DP=2), load it under
    /// TP=2 × PP=2 and under 1 rank, and check every byte (exit 0 only if all match).
    Demo {
        /// Checkpoint directory, kept afterwards (overwritten if it holds a checkpoint).
        /// Without it, a temporary directory is used and removed.
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Approximate checkpoint size (e.g. 64MiB, 1GiB, 512MB).
        #[arg(long, default_value = "1GiB")]
        size: String,
    },
    /// Show what a checkpoint holds: format, tensors, objects, common state, metadata.
    Inspect {
        /// Checkpoint directory.
        dir: PathBuf,
        /// Print one JSON object (format, tensors, objects, common, content_metadata).
        #[arg(long, conflicts_with = "index_json")]
        json: bool,
        /// Dump the whole index as JSON, every chunk included.
        #[arg(long)]
        index_json: bool,
    },
    /// Check the index, coverage and every checksum; exit 1 if anything is wrong.
    Verify {
        /// Checkpoint directory.
        dir: PathBuf,
    },
    /// Benchmarks: save and resharded load against raw IO; async save (--async); fully-parallel
    /// save (--fully-parallel); metadata planning at scale (--plan-only).
    ///
    /// Default: tessera save and resharded load against raw sequential IO. --async: the async
    /// save against a memcpy and against the sync save. --fully-parallel: the bytes each rank
    /// writes with and without distribute_replicas. --plan-only: the metadata planning of a save
    /// and a load for many simulated ranks, no IO. The IO modes report ratios to a reference
    /// measured in the same rounds (every round, the median and min–max), not bare times.
    Bench {
        /// Directory to benchmark in (the checkpoint goes to DIR/ckpt).
        #[arg(long, required_unless_present = "plan_only")]
        dir: Option<PathBuf>,
        /// Bytes to write (default 1GiB); with --fully-parallel, bytes of the replicated
        /// parameters (default 256MiB).
        #[arg(long)]
        size: Option<String>,
        /// Saving ranks (default 4; with --async, TP=N in-process ranks), or simulated ranks with
        /// --plan-only (default 10000).
        #[arg(long, conflicts_with = "fully_parallel")]
        ranks: Option<usize>,
        /// No IO: simulate the planning of a save and a load.
        #[arg(long, conflicts_with_all = ["async_save", "fully_parallel"])]
        plan_only: bool,
        /// Async save (AsyncSaver): each round times a memcpy of every rank's state into a
        /// pre-faulted buffer, an async save (blocking part and total, up to finalize) and a sync
        /// save of the same state; reports blocking/memcpy, blocking/sync, total/sync and peak RSS
        /// against the staging budget, with the budget of --budget (staged in waves when smaller
        /// than a rank's share) and with one that holds a rank's whole share.
        #[arg(long = "async", conflicts_with = "fully_parallel")]
        async_save: bool,
        /// Staging budget per rank with --async (default 64MiB).
        #[arg(long, requires = "async_save")]
        budget: Option<String>,
        /// Fully-parallel save: the model's parameters replicated over DP (each degree of --dp,
        /// TP=--tp), saved with and without distribute_replicas; reports the bytes written per
        /// rank against the ideal share and the save-time ratio.
        #[arg(long)]
        fully_parallel: bool,
        /// DP degrees with --fully-parallel, comma-separated (default 2,4,8).
        #[arg(long, value_delimiter = ',', requires = "fully_parallel")]
        dp: Vec<u64>,
        /// TP degree with --fully-parallel (default 1).
        #[arg(long, requires = "fully_parallel")]
        tp: Option<u64>,
        /// Rounds (of raw reference + save + load; with --async, of memcpy + async + sync save
        /// per configuration; with --fully-parallel, of both saves per DP degree); each round's
        /// ratios are reported, with their median and range.
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// Tensors per simulated rank (--plan-only).
        #[arg(long, default_value_t = 1000)]
        tensors: usize,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
        /// Keep the benchmark checkpoint in DIR/ckpt.
        #[arg(long, conflicts_with_all = ["async_save", "fully_parallel"])]
        keep: bool,
    },
    /// Remove leftovers of saves that never committed.
    Gc {
        /// Checkpoint directory.
        dir: PathBuf,
    },
}

fn dispatch(command: Command) -> Result<ExitCode> {
    match command {
        Command::Demo { dir, size } => demo::run(demo::DemoArgs { dir, size: sizes::parse_size(&size)? }),
        Command::Inspect { dir, json, index_json } => {
            let format = match (json, index_json) {
                (_, true) => inspect::Format::IndexJson,
                (true, false) => inspect::Format::Json,
                (false, false) => inspect::Format::Text,
            };
            inspect::run(&dir, format)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Verify { dir } => verify::run(&dir),
        Command::Bench {
            dir,
            size,
            ranks,
            rounds,
            plan_only,
            async_save,
            budget,
            fully_parallel,
            dp,
            tp,
            tensors,
            json,
            keep,
        } => {
            if plan_only {
                plansim::run(plansim::PlanArgs { ranks: ranks.unwrap_or(10_000), tensors, json })?;
                return Ok(ExitCode::SUCCESS);
            }
            let Some(dir) = dir else { bail!("--dir is required (or use --plan-only)") };
            if fully_parallel {
                let size = sizes::parse_size(size.as_deref().unwrap_or(bench_parallel::DEFAULT_SIZE))?;
                let dps = if dp.is_empty() { bench_parallel::DEFAULT_DPS.to_vec() } else { dp };
                let tp = tp.unwrap_or(1);
                return bench_parallel::run(bench_parallel::ParallelArgs { dir, size, tp, dps, rounds, json });
            }
            let size = sizes::parse_size(size.as_deref().unwrap_or("1GiB"))?;
            let ranks = ranks.unwrap_or(4);
            if async_save {
                let budget = sizes::parse_size(budget.as_deref().unwrap_or(bench_async::DEFAULT_BUDGET))?;
                return bench_async::run(bench_async::AsyncArgs { dir, size, ranks, budget, rounds, json });
            }
            bench::run(bench::BenchArgs { dir, size, ranks, rounds, json, keep })
        }
        Command::Gc { dir } => {
            gc::run(&dir)?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn main() -> ExitCode {
    system::default_sigpipe();
    let cli = Cli::parse();
    match dispatch(cli.command) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("tessera: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
