//! `tessera-bench --fully-parallel --dir D [--size S] [--dp 2,4,8] [--tp T] [--rounds R] [--json]`:
//! how the fully-parallel save (`SaveOptions::distribute_replicas`) spreads the writing of
//! replicated tensors over their replicas.
//!
//! The state is the bf16 parameters of the model of `tessera-bench` (about S bytes, default
//! 256 MiB: embedding, 8 layers, layer norms), split by TP (default 1) and replicated over DP as
//! in data-parallel training, plus each rank's RNG object. The ranks are in-process, and the DP
//! replicas of a TP rank share one copy of its bytes (a replica costs no memory here).
//! For each DP degree, each round saves the state into D/ckpt (a local directory or an `s3://…`
//! prefix) twice, with `distribute_replicas`
//! and without it (only the main replicas write), in this order in odd rounds and the reverse in
//! even ones; the checkpoint is removed after each save.
//!
//! Reported per DP degree: the bytes each rank wrote (its data file, header included) — min,
//! mean, max, and max over the ideal (the checkpoint's tensor bytes / ranks; the largest chunk
//! bounds how close the max can get) — with and without distribution; and each round's save
//! time with distribution over the time without (each the largest over ranks from a common
//! barrier), with the median and min–max. The ranks share one disk, so no time gain is expected
//! here: the headline is the bytes per rank. The last round's two checkpoints are verified
//! (every checksum) and must hold the same chunks; the exit code is 1 otherwise.

use std::time::Instant;

use anyhow::{Context, Result};
use serde_json::json;
use tessera::comm::InProcessComm;
use tessera::storage::Location;
use tessera::{Communicator, SaveOptions, SaveReport, TensorData};
use tessera_synth::model::{self, Layout, Leaf, ModelConfig};
use tessera_synth::progress::Progress;
use tessera_synth::ranks;
use tessera_synth::sizes::{fmt_bytes, fmt_secs};

use crate::bench::{ratio, Spread};
use crate::scratch::Scratch;

/// Arguments of the fully-parallel save benchmark.
pub struct ParallelArgs {
    /// Directory (or URL) to benchmark in (the checkpoint goes to DIR/ckpt).
    pub dir: Location,
    /// Approximate bytes of the replicated parameters.
    pub size: u64,
    /// Tensor-parallel degree.
    pub tp: u64,
    /// Data-parallel degrees to run.
    pub dps: Vec<u64>,
    /// Rounds per DP degree.
    pub rounds: usize,
    /// Print one JSON object.
    pub json: bool,
}

/// Default size of the replicated parameters.
pub const DEFAULT_SIZE: &str = "256MiB";
/// Default DP degrees.
pub const DEFAULT_DPS: [u64; 3] = [2, 4, 8];

/// The parameters (and RNG object, and common values) of a training rank: its optimizer state
/// left out, so that every tensor is a DP replica.
fn param_leaves(cfg: &ModelConfig, layout: Layout, rank: usize) -> Vec<Leaf> {
    model::leaves(cfg, layout, rank, &layout.rng_grid())
        .into_iter()
        .filter(|leaf| match leaf {
            Leaf::Tensor { path, .. } | Leaf::Fused { path, .. } => path.starts_with("model."),
            Leaf::Object { .. } | Leaf::Value { .. } => true,
        })
        .collect()
}

/// Bytes each rank wrote in one save.
#[derive(Debug, Clone, Default)]
struct Written {
    per_rank: Vec<u64>,
}

impl Written {
    fn min(&self) -> u64 {
        self.per_rank.iter().copied().min().unwrap_or(0)
    }
    fn max(&self) -> u64 {
        self.per_rank.iter().copied().max().unwrap_or(0)
    }
    fn mean(&self) -> f64 {
        self.per_rank.iter().sum::<u64>() as f64 / self.per_rank.len().max(1) as f64
    }
    fn json(&self, ideal: f64) -> serde_json::Value {
        json!({
            "bytes_written_per_rank": self.per_rank,
            "min_bytes": self.min(),
            "mean_bytes": self.mean(),
            "max_bytes": self.max(),
            "max_vs_ideal": ratio(self.max() as f64, ideal),
            "min_vs_ideal": ratio(self.min() as f64, ideal),
        })
    }
}

/// One save: what each rank wrote, the time (largest over ranks), rank 0's report.
struct Saved {
    written: Written,
    secs: f64,
    report: SaveReport,
}

/// Everything measured at one DP degree.
struct DpRun {
    dp: u64,
    world: usize,
    checkpoint_bytes: u64,
    distribute: Written,
    main_only: Written,
    distribute_secs: Vec<f64>,
    main_only_secs: Vec<f64>,
    chunks: (usize, usize),
    problems: Vec<String>,
}

impl DpRun {
    fn ideal(&self) -> f64 {
        self.checkpoint_bytes as f64 / self.world as f64
    }
    fn time_ratios(&self) -> Vec<f64> {
        self.distribute_secs.iter().zip(&self.main_only_secs).map(|(&d, &m)| ratio(d, m)).collect()
    }
    fn verified(&self) -> bool {
        self.problems.is_empty() && self.chunks.0 == self.chunks.1
    }
}

/// Saves the state of `layout` (rank `r` holding the bytes of TP rank `r % tp`) into `ckpt`.
fn save_once(
    layout: Layout,
    tp: u64,
    leaves: &[Vec<Leaf>],
    bufs: &[Vec<Vec<u8>>],
    ckpt: &Location,
    distribute: bool,
) -> Result<Saved> {
    let opts = SaveOptions { overwrite: true, distribute_replicas: distribute, ..SaveOptions::default() };
    let results = InProcessComm::run(layout.world(), |comm| -> Result<(SaveReport, f64)> {
        let rank = comm.rank();
        let data = bufs[rank % tp as usize].iter().map(|b| TensorData::Ref(b)).collect();
        let tree = model::build_tree(&leaves[rank], data, true);
        ranks::all_ok(comm, tree.is_ok())?;
        let tree = tree?;
        let storage = ckpt.open();
        ranks::all_ok(comm, storage.is_ok())?;
        let storage = storage?;
        comm.barrier()?;
        let start = Instant::now();
        let report = tessera::save(tree, storage.as_ref(), comm, &opts);
        let secs = start.elapsed().as_secs_f64();
        ranks::all_ok(comm, report.is_ok())?;
        let report = report.with_context(|| format!("save {}, rank {rank}", layout.describe()))?;
        Ok((report, ranks::max_over_ranks(comm, secs)?))
    });
    let results = ranks::collect(results)?;
    let written = Written { per_rank: results.iter().map(|(r, _)| r.bytes_written).collect() };
    let secs = results[0].1;
    let report = results.into_iter().next().map(|(r, _)| r).unwrap_or_default();
    Ok(Saved { written, secs, report })
}

fn run_dp(args: &ParallelArgs, cfg: &ModelConfig, bufs: &[Vec<Vec<u8>>], dp: u64) -> Result<DpRun> {
    let layout = Layout::Train { tp: args.tp, dp };
    let world = layout.world();
    let leaves: Vec<Vec<Leaf>> = (0..world).map(|r| param_leaves(cfg, layout, r)).collect();
    for (r, l) in leaves.iter().enumerate() {
        let lens: Vec<u64> = l.iter().filter_map(Leaf::data_len).collect();
        let have: Vec<u64> = bufs[r % args.tp as usize].iter().map(|b| b.len() as u64).collect();
        anyhow::ensure!(lens == have, "rank {r} of {}: its parameters are not its TP rank's", layout.describe());
    }
    let ckpt = args.dir.join("ckpt");
    let mut run = DpRun {
        dp,
        world,
        checkpoint_bytes: 0,
        distribute: Written::default(),
        main_only: Written::default(),
        distribute_secs: Vec::new(),
        main_only_secs: Vec::new(),
        chunks: (0, 0),
        problems: Vec::new(),
    };
    for round in 0..args.rounds {
        let last = round + 1 == args.rounds;
        let order = if round % 2 == 0 { [true, false] } else { [false, true] };
        for distribute in order {
            let saved = save_once(layout, args.tp, &leaves, bufs, &ckpt, distribute)?;
            if last {
                let v = tessera::tools::verify(ckpt.open()?.as_ref(), SaveOptions::default().threads)
                    .with_context(|| format!("verifying the checkpoint of {}", layout.describe()))?;
                let mode = if distribute { "distribute" } else { "main replicas only" };
                run.problems.extend(v.problems.into_iter().map(|p| format!("{mode}: {p}")));
            }
            run.checkpoint_bytes = saved.report.total_tensor_bytes;
            if distribute {
                run.distribute = saved.written;
                run.distribute_secs.push(saved.secs);
                run.chunks.0 = saved.report.chunks;
            } else {
                run.main_only = saved.written;
                run.main_only_secs.push(saved.secs);
                run.chunks.1 = saved.report.chunks;
            }
            ckpt.remove()?;
        }
    }
    Ok(run)
}

fn print_run(r: &DpRun, largest: u64) {
    let ideal = r.ideal();
    let bound = if largest as f64 > ideal {
        format!(
            " (the largest tensor, {}, is one rank's to write: {:.3}× ideal)",
            fmt_bytes(largest),
            largest as f64 / ideal
        )
    } else {
        String::new()
    };
    println!("DP={} ({} ranks): ideal {} per rank{bound}", r.dp, r.world, fmt_bytes(ideal as u64));
    for (name, w) in [("distribute", &r.distribute), ("main only", &r.main_only)] {
        println!(
            "  {name:<11} bytes written per rank: min {:>10}  mean {:>10}  max {:>10}  max/ideal {:.3}×",
            fmt_bytes(w.min()),
            fmt_bytes(w.mean() as u64),
            fmt_bytes(w.max()),
            ratio(w.max() as f64, ideal)
        );
    }
    let ratios = r.time_ratios();
    let s = Spread::of(&ratios);
    let rounds: Vec<String> = ratios.iter().map(|x| format!("{x:.3}")).collect();
    println!(
        "  save time distribute / main only: {:.3}× median (min–max {:.3}–{:.3}; rounds {}; {} vs {} median)",
        s.median,
        s.min,
        s.max,
        rounds.join(" "),
        fmt_secs(Spread::of(&r.distribute_secs).median),
        fmt_secs(Spread::of(&r.main_only_secs).median),
    );
    if !r.verified() {
        println!("  check FAILED: {} vs {} chunks, {} problem(s)", r.chunks.0, r.chunks.1, r.problems.len());
        for p in r.problems.iter().take(20) {
            println!("    {p}");
        }
    }
}

/// Runs the fully-parallel save benchmark.
pub fn run(args: ParallelArgs) -> Result<u8> {
    anyhow::ensure!(args.tp >= 1, "--tp must be at least 1");
    anyhow::ensure!(!args.dps.is_empty() && args.dps.iter().all(|&d| d >= 1), "--dp degrees must be at least 1");
    anyhow::ensure!(args.rounds >= 1, "--rounds must be at least 1");
    anyhow::ensure!(args.size > 0, "--size must be positive");
    args.dir.create()?;
    // Every round deletes the checkpoint: the location must be the benchmark's own.
    args.dir.join("ckpt").claim()?;
    // Parameters are 2 of the 10 bytes per parameter of the model's state.
    let cfg = ModelConfig::for_bytes(args.size.saturating_mul(5));
    let tp_layout = Layout::Train { tp: args.tp, dp: 1 };
    let tp_leaves: Vec<Vec<Leaf>> = (0..args.tp as usize).map(|t| param_leaves(&cfg, tp_layout, t)).collect();
    let param_bytes: u64 = tp_leaves.iter().map(|l| model::data_bytes(l)).sum();
    let largest = tp_leaves.iter().flatten().flat_map(|l| l.regions()).map(|(_, r)| r.nbytes()).max().unwrap_or(0);
    let tensors = tp_leaves[0].iter().flat_map(|l| l.regions()).count();
    if !args.json {
        println!(
            "bench --fully-parallel in {}: {} of bf16 parameters ({} layers, hidden {}; {} tensors per TP rank, the largest {}), TP={}, replicated over DP; {} round(s)",
            args.dir,
            fmt_bytes(param_bytes),
            cfg.layers,
            cfg.hidden,
            tensors,
            fmt_bytes(largest),
            args.tp,
            args.rounds
        );
    }
    let generating = Progress::new("generating parameters", param_bytes);
    let bufs: Vec<Vec<Vec<u8>>> = tp_leaves.iter().map(|l| model::generate(l, Some(&generating))).collect();
    generating.finish();

    let mut runs = Vec::with_capacity(args.dps.len());
    for &dp in &args.dps {
        let run = run_dp(&args, &cfg, &bufs, dp)?;
        if !args.json {
            print_run(&run, largest);
        }
        runs.push(run);
    }
    let verified = runs.iter().all(DpRun::verified);
    if args.json {
        let out = json!({
            "mode": "fully_parallel",
            "dir": args.dir.to_string(),
            "size_bytes": args.size,
            "param_bytes": param_bytes,
            "tp": args.tp,
            "rounds": args.rounds,
            "tensors_per_tp_rank": tensors,
            "largest_tensor_bytes": largest,
            "runs": runs.iter().map(|r| {
                let ratios = r.time_ratios();
                json!({
                    "dp": r.dp,
                    "ranks": r.world,
                    "checkpoint_bytes": r.checkpoint_bytes,
                    "ideal_bytes_per_rank": r.ideal(),
                    "max_lower_bound_bytes": r.ideal().max(largest as f64),
                    "distribute": r.distribute.json(r.ideal()),
                    "main_only": r.main_only.json(r.ideal()),
                    "distribute_secs": Spread::of(&r.distribute_secs).median,
                    "main_only_secs": Spread::of(&r.main_only_secs).median,
                    "time_distribute_vs_main_only": Spread::of(&ratios).median,
                    "time_distribute_vs_main_only_rounds": ratios,
                    "chunks": r.chunks.0,
                    "main_only_chunks": r.chunks.1,
                    "verified": r.verified(),
                    "problems": r.problems.iter().take(20).collect::<Vec<_>>(),
                })
            }).collect::<Vec<_>>(),
            "verified": verified,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else if verified {
        println!("check      every checkpoint of the last rounds verified; distributed or not, the same chunks");
    }
    Ok(if verified { 0 } else { 1 })
}
