//! `tessera`: demo, inspect, verify, bench and gc for tessera checkpoints.

mod bench;
mod demo;
mod gc;
mod inspect;
mod jobs;
mod model;
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
    /// Compare tessera save and resharded load with raw sequential IO, or (--plan-only)
    /// time the metadata planning of a save and a load for many simulated ranks.
    Bench {
        /// Directory to benchmark in (the checkpoint goes to DIR/ckpt).
        #[arg(long, required_unless_present = "plan_only")]
        dir: Option<PathBuf>,
        /// Bytes to write (e.g. 1GiB).
        #[arg(long, default_value = "1GiB")]
        size: String,
        /// Saving ranks (default 4), or simulated ranks with --plan-only (default 10000).
        #[arg(long)]
        ranks: Option<usize>,
        /// No IO: simulate the planning of a save and a load.
        #[arg(long)]
        plan_only: bool,
        /// Rounds of raw reference + save + load; each round's ratios to raw IO are reported,
        /// with their median and range.
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// Tensors per simulated rank (--plan-only).
        #[arg(long, default_value_t = 1000)]
        tensors: usize,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
        /// Keep the benchmark checkpoint in DIR/ckpt.
        #[arg(long)]
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
        Command::Bench { dir, size, ranks, rounds, plan_only, tensors, json, keep } => {
            if plan_only {
                plansim::run(plansim::PlanArgs { ranks: ranks.unwrap_or(10_000), tensors, json })?;
                return Ok(ExitCode::SUCCESS);
            }
            let Some(dir) = dir else { bail!("--dir is required (or use --plan-only)") };
            let size = sizes::parse_size(&size)?;
            bench::run(bench::BenchArgs { dir, size, ranks: ranks.unwrap_or(4), rounds, json, keep })
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
