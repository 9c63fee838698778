//! The `tessera-bench` command: tessera's benchmarks. Save and resharded load against raw IO
//! (`bench.rs`), an object store against a local directory (`bench_s3.rs`), the async save
//! (`bench_async.rs`), the fully-parallel save (`bench_parallel.rs`), the memory tier
//! (`bench_memory_tier.rs`) and the metadata planning of
//! many simulated ranks (`plansim.rs`, `--plan-only`). One implementation, [`run`], behind the
//! `tessera-bench` binary (`src/main.rs`).
//!
//! The benchmarks save and load the synthetic model of the `tessera` command's demo
//! ([`tessera_synth::model`], over in-process ranks with [`tessera_synth::jobs`]) and report
//! with that crate's progress, sizes and system helpers; the OS helpers only they use (memory
//! and CPU figures) are in `src/os.rs`. They do not depend on `tessera-cli`, and nothing but this
//! crate's binary depends on them.

#![deny(missing_docs)]

mod bench;
mod bench_async;
mod bench_memory_tier;
mod bench_parallel;
mod bench_reshard;
mod bench_s3;
mod emulators;
mod os;
mod peak;
mod plansim;
mod scratch;

use std::path::Path;

use anyhow::{bail, Result};
use clap::Parser;
use tessera::storage::Location;
use tessera_synth::progress::ProgressArg;
use tessera_synth::sizes;

/// The `--storage-option KEY=VALUE` option, as the `tessera` command takes it (global: it
/// reaches every location).
#[derive(clap::Args)]
struct StorageOptionArg {
    /// An `object_store` configuration key for object-store locations, over the environment
    /// and credential files (repeatable): aws_endpoint=http://host:9000,
    /// google_service_account=/path/key.json, azure_storage_account_key=…,
    /// azure_storage_connection_string=…
    #[arg(long = "storage-option", global = true, value_name = "KEY=VALUE", value_parser = parse_storage_option)]
    storage_options: Vec<(String, String)>,
}

fn parse_storage_option(s: &str) -> std::result::Result<(String, String), String> {
    tessera::storage::parse_option(s).map_err(|e| e.to_string())
}

/// Benchmarks: save and resharded load against raw IO; an object store against a local
/// directory (--s3); async save (--async); fully-parallel save (--fully-parallel); metadata
/// planning at scale (--plan-only).
///
/// Default: tessera save and resharded load against raw sequential IO (a local directory).
/// --s3 URL: the same save and resharded load into --dir and into the object store, with the
/// store's requests (PUTs, parts, GETs per chunk, bytes downloaded / needed). --async: the
/// async save against a memcpy and against the sync save. --fully-parallel: the bytes each
/// rank writes with and without distribute_replicas. --plan-only: the metadata planning of a
/// save and a load for many simulated ranks, no IO. The IO modes report ratios to a reference
/// measured in the same rounds (every round, the median and min–max), not bare times.
#[derive(Parser)]
#[command(
    name = "tessera-bench",
    version,
    after_help = "Locations: a local directory, or an object-store URL (s3://, gs://, az://) configured as for \
                  the `tessera` command (see `tessera --help`): the clouds' environment variables and credential \
                  files, and --storage-option KEY=VALUE."
)]
struct Cli {
    #[command(flatten)]
    progress: ProgressArg,
    /// Directory to benchmark in (the checkpoint goes to DIR/ckpt, which must be absent or
    /// empty: the benchmark deletes it afterwards). --async and
    /// --fully-parallel also take s3://bucket/prefix; the default benchmark and --s3 need a
    /// local directory (raw IO reference, page cache).
    #[arg(long, required_unless_present = "plan_only")]
    dir: Option<String>,
    /// Object store against local directory: save and resharded load into --dir and into
    /// URL/ckpt (s3://bucket/prefix, gs://…, az://container/prefix), in the same rounds.
    /// Repeatable (alias --store): each store in turn, then a summary of the ratios.
    #[arg(long, alias = "store", value_name = "URL", conflicts_with_all = ["plan_only", "async_save", "fully_parallel"])]
    s3: Vec<String>,
    /// --s3 against one emulator of each store, started here on loopback: moto (S3), Azurite
    /// (Azure) and fake-gcs-server (GCS), as the tests start them (scripts/bench/bench_stores.sh).
    #[arg(long, conflicts_with_all = ["plan_only", "async_save", "fully_parallel", "s3"])]
    emulators: bool,
    #[command(flatten)]
    storage: StorageOptionArg,
    /// Bytes to write (default 1GiB; 256MiB with --s3); with --fully-parallel, bytes of the
    /// replicated parameters (default 256MiB).
    #[arg(long)]
    size: Option<String>,
    /// Saving ranks (default 4; with --async, TP=N in-process ranks), or simulated ranks with
    /// --plan-only (default 10000).
    #[arg(long, conflicts_with = "fully_parallel")]
    ranks: Option<usize>,
    /// No IO: simulate the planning of a save and a load.
    #[arg(long, conflicts_with_all = ["async_save", "fully_parallel"])]
    plan_only: bool,
    /// Resharded load against a memcpy and save against a raw write, through the Rust API:
    /// square f32 tensors saved split by rows, loaded in place split by columns (default 2
    /// ranks, 16 tensors, 1GiB). Put --dir on tmpfs for the warm figure, on disk with --cold
    /// for the cold one.
    #[arg(long, conflicts_with_all = ["plan_only", "async_save", "fully_parallel", "s3"])]
    reshard: bool,
    /// With --reshard: drop the checkpoint's page cache before the sequential read and the load.
    #[arg(long, requires = "reshard")]
    cold: bool,
    /// With --reshard: IO threads per rank of the save and the load (default: the library's).
    #[arg(long, requires = "reshard")]
    threads: Option<usize>,
    /// With --reshard: treat --dir as not local (`LocalStorage::treat_as_local(false)`), so the
    /// save and the load take the paths they take on a network filesystem.
    #[arg(long, requires = "reshard")]
    not_local: bool,
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
    /// Tensors per simulated rank (--plan-only, default 1000), or tensors of the state
    /// (--reshard, default 16).
    #[arg(long)]
    tensors: Option<usize>,
    /// With --plan-only: the parameters too are cut across DP (FSDP, ZeRO-3), not replicated,
    /// so every shard is a stored chunk (10 M for 10,000 ranks × 1,000 tensors).
    #[arg(long, requires = "plan_only")]
    fsdp: bool,
    /// The memory tier (tessera::memory_tier): N in-process ranks (default 8) on 4 simulated
    /// nodes, RS(--redundancy): save blocking time against a memcpy, memory held against full
    /// copies, encode throughput against a memcpy, restore after a lost node against a load
    /// from --dir (and, with --emulators, from S3 on loopback), steps lost per failure.
    #[arg(long, conflicts_with_all = ["plan_only", "async_save", "fully_parallel", "s3", "reshard"])]
    memory_tier: bool,
    /// With --memory-tier: where the simulated nodes' memory roots go (tmpfs; default /dev/shm).
    #[arg(long, requires = "memory_tier")]
    memory_root: Option<String>,
    /// With --memory-tier: K,M of RS(K, M) (default 2,2; K + M ≤ the nodes).
    #[arg(long, requires = "memory_tier", value_delimiter = ',')]
    redundancy: Vec<usize>,
    /// With --memory-tier: simulated nodes (default 4).
    #[arg(long, requires = "memory_tier")]
    nodes: Option<usize>,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
    /// Keep the benchmark checkpoint in DIR/ckpt (and URL/ckpt with --s3).
    #[arg(long, conflicts_with_all = ["async_save", "fully_parallel"])]
    keep: bool,
}

/// Runs the benchmark `cli` asks for; returns the exit status.
fn dispatch(cli: Cli) -> Result<u8> {
    let Cli {
        progress: _,
        dir,
        s3,
        emulators,
        storage,
        size,
        ranks,
        plan_only,
        reshard,
        cold,
        threads,
        not_local,
        async_save,
        budget,
        fully_parallel,
        dp,
        tp,
        rounds,
        tensors,
        fsdp,
        memory_tier,
        memory_root,
        redundancy,
        nodes,
        json,
        keep,
    } = cli;
    if plan_only {
        plansim::run(plansim::PlanArgs {
            ranks: ranks.unwrap_or(10_000),
            tensors: tensors.unwrap_or(1000),
            fsdp,
            json,
        })?;
        return Ok(0);
    }
    let Some(dir) = dir else { bail!("--dir is required (or use --plan-only)") };
    let dir = Location::parse(&dir).with_options(&storage.storage_options);
    if memory_tier {
        let Some(dir) = dir.local_dir().map(Path::to_path_buf) else {
            bail!("--dir {dir}: --memory-tier's persistent tier is a local directory (its load is the reference)")
        };
        let redundancy = match redundancy.as_slice() {
            [] => (2, 2),
            [k, m] => (*k, *m),
            _ => bail!("--redundancy K,M: two numbers"),
        };
        return bench_memory_tier::run(bench_memory_tier::MemoryTierArgs {
            dir,
            memory_root: memory_root.unwrap_or_else(|| "/dev/shm".into()).into(),
            size: sizes::parse_size(size.as_deref().unwrap_or(bench_memory_tier::DEFAULT_SIZE))?,
            ranks: ranks.unwrap_or(8),
            nodes: nodes.unwrap_or(4),
            redundancy,
            rounds,
            emulators,
            json,
        });
    }
    if emulators || !s3.is_empty() {
        let size = sizes::parse_size(size.as_deref().unwrap_or(bench_s3::DEFAULT_SIZE))?;
        let ranks = ranks.unwrap_or(4);
        let stores: Vec<(String, Location)> = if emulators {
            let tag = format!("bench-{}", std::process::id());
            emulators::stores(&tag)
                .into_iter()
                .map(|s| (s.name.to_string(), Location::parse(&s.url).with_options(&s.options)))
                .collect()
        } else {
            s3.iter().map(|u| (u.clone(), Location::parse(u).with_options(&storage.storage_options))).collect()
        };
        return bench_s3::run(bench_s3::S3Args { dir, stores, size, ranks, rounds, json, keep });
    }
    if fully_parallel {
        let size = sizes::parse_size(size.as_deref().unwrap_or(bench_parallel::DEFAULT_SIZE))?;
        let dps = if dp.is_empty() { bench_parallel::DEFAULT_DPS.to_vec() } else { dp };
        let tp = tp.unwrap_or(1);
        return bench_parallel::run(bench_parallel::ParallelArgs { dir, size, tp, dps, rounds, json });
    }
    let size = sizes::parse_size(size.as_deref().unwrap_or("1GiB"))?;
    if reshard {
        let Some(dir) = dir.local_dir().map(Path::to_path_buf) else {
            bail!("--dir {dir}: --reshard compares with memcpy and raw IO and needs a local directory")
        };
        let tensors = tensors.unwrap_or(bench_reshard::DEFAULT_TENSORS);
        let ranks = ranks.unwrap_or(2);
        return bench_reshard::run(bench_reshard::ReshardArgs {
            dir,
            size,
            tensors,
            ranks,
            rounds,
            cold,
            threads,
            not_local,
            json,
            keep,
        });
    }
    let ranks = ranks.unwrap_or(4);
    if async_save {
        let budget = sizes::parse_size(budget.as_deref().unwrap_or(bench_async::DEFAULT_BUDGET))?;
        return bench_async::run(bench_async::AsyncArgs { dir, size, ranks, budget, rounds, json });
    }
    let Some(dir) = dir.local_dir().map(Path::to_path_buf) else {
        bail!(
            "--dir {dir}: this benchmark compares with raw IO on a local disk (a write + fsync, a read \
             with the page cache dropped) and needs a local directory; for an object store, compare it \
             with a local directory: --dir LOCAL_DIR --s3 {dir}"
        )
    };
    bench::run(bench::BenchArgs { dir, size, ranks, rounds, json, keep })
}

/// Runs the command line `args` (the program name first, as `std::env::args_os` gives it) and
/// returns the process's exit status: 0 on success, 1 on failure (a benchmark that failed or
/// whose loaded bytes did not match), 2 on usage errors. Help and usage errors are printed as
/// clap prints them.
pub fn run<I, T>(args: I) -> u8
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    // Output into a closed pipe (`tessera-bench … | head`) ends the process quietly.
    tessera_synth::system::default_sigpipe();
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            // Help and the version (stdout) exit 0, usage errors (stderr) 2.
            let _ = e.print();
            return if e.use_stderr() { 2 } else { 0 };
        }
    };
    cli.progress.apply();
    match dispatch(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("tessera-bench: error: {e:#}");
            1
        }
    }
}
