//! Saving and loading the model of [`crate::model`] over in-process ranks, timed between
//! barriers (rank 0's view), shared by `demo` and the benchmarks (`tessera-bench`).

use std::time::Instant;

use anyhow::{Context, Result};
use tessera::comm::InProcessComm;
use tessera::{Communicator, LoadOptions, LoadStats, SaveOptions, SaveReport, Storage, TensorData};

use crate::model::{self, CheckReport, Layout, Leaf, ModelConfig};
use crate::progress::Progress;
use crate::ranks;

/// Called by rank 0 when the timed part starts (`true`: every rank's buffers are resident)
/// and when it ends (`false`), e.g. to measure memory.
pub type Hook<'h> = &'h (dyn Fn(bool) + Sync);

/// What a save did.
pub struct Saved {
    /// The save's report (rank 0).
    pub report: SaveReport,
    /// Seconds from the start barrier to the end barrier.
    pub secs: f64,
    /// Bytes of tensor data held by all ranks (replicas included).
    pub state_bytes: u64,
}

/// Generates the model in `layout` on its ranks and saves it to `storage`.
pub fn save(
    cfg: &ModelConfig,
    layout: Layout,
    storage: &dyn Storage,
    opts: &SaveOptions,
    hook: Hook<'_>,
) -> Result<Saved> {
    let world = layout.world();
    let grid = layout.rng_grid();
    let all: Vec<Vec<Leaf>> = (0..world).map(|r| model::leaves(cfg, layout, r, &grid)).collect();
    let state_bytes: u64 = all.iter().map(|l| model::data_bytes(l)).sum();
    let generating = Progress::new(&format!("generating state ({world} ranks)"), state_bytes);
    let results = InProcessComm::run(world, |comm| -> Result<Saved> {
        let rank = comm.rank();
        let leaves = &all[rank];
        let bufs = model::generate(leaves, Some(&generating));
        let tree = model::build_tree(leaves, bufs.iter().map(|b| TensorData::Ref(b)).collect(), true);
        ranks::all_ok(comm, tree.is_ok())?;
        let tree = tree?;
        if rank == 0 {
            generating.finish();
            hook(true);
        }
        comm.barrier()?;
        let bar = (rank == 0).then(|| Progress::writes(&format!("saving {}", layout.describe()), state_bytes));
        let start = Instant::now();
        let report = tessera::save(tree, storage, comm, opts);
        ranks::all_ok(comm, report.is_ok())?;
        let secs = start.elapsed().as_secs_f64();
        drop(bar);
        if rank == 0 {
            hook(false);
        }
        let report = report.with_context(|| format!("save {}, rank {rank}", layout.describe()))?;
        Ok(Saved { report, secs, state_bytes })
    });
    Ok(ranks::collect(results)?.swap_remove(0))
}

/// What a load did.
pub struct Loaded {
    /// Seconds from the start barrier to the end barrier.
    pub secs: f64,
    /// IO counters summed over ranks.
    pub stats: LoadStats,
    /// IO counters of each rank.
    pub per_rank: Vec<LoadStats>,
    /// Bytes of the target buffers of all ranks.
    pub target_bytes: u64,
    /// What the byte-by-byte check found.
    pub check: CheckReport,
}

struct RankLoad {
    bufs: Vec<Vec<u8>>,
    stats: LoadStats,
    secs: f64,
    check: CheckReport,
}

/// Loads the checkpoint in `storage` under `layout` (the RNG object saved with grid
/// `rng_grid`) into fresh buffers, then checks every byte, object and common value.
pub fn load(
    cfg: &ModelConfig,
    layout: Layout,
    rng_grid: &[u64],
    storage: &dyn Storage,
    opts: &LoadOptions,
    hook: Hook<'_>,
) -> Result<Loaded> {
    let world = layout.world();
    let all: Vec<Vec<Leaf>> = (0..world).map(|r| model::leaves(cfg, layout, r, rng_grid)).collect();
    let target_bytes: u64 = all.iter().map(|l| model::data_bytes(l)).sum();
    let results = InProcessComm::run(world, |comm| -> Result<RankLoad> {
        let rank = comm.rank();
        let leaves = &all[rank];
        let mut bufs = model::alloc_targets(leaves);
        let tree = model::build_tree(leaves, bufs.iter_mut().map(|b| TensorData::Mut(b)).collect(), false);
        ranks::all_ok(comm, tree.is_ok())?;
        let tree = tree?;
        if rank == 0 {
            hook(true);
        }
        comm.barrier()?;
        let bar = (rank == 0).then(|| Progress::reads(&format!("loading {}", layout.describe()), target_bytes));
        let start = Instant::now();
        let loaded = tessera::load(tree, storage, comm, opts);
        ranks::all_ok(comm, loaded.is_ok())?;
        let secs = start.elapsed().as_secs_f64();
        drop(bar);
        if rank == 0 {
            hook(false);
        }
        let loaded = loaded.with_context(|| format!("load {}, rank {rank}", layout.describe()))?;
        let check = model::check_tree(&loaded.state, leaves, cfg, rank);
        let stats = loaded.stats.clone();
        drop(loaded);
        Ok(RankLoad { bufs, stats, secs, check })
    });
    let results = ranks::collect(results)?;
    let mut stats = LoadStats::default();
    let mut check = CheckReport::default();
    let mut items: Vec<(&Leaf, &[u8])> = Vec::new();
    for (rank, r) in results.iter().enumerate() {
        stats.bytes_needed += r.stats.bytes_needed;
        stats.bytes_read += r.stats.bytes_read;
        stats.bytes_received += r.stats.bytes_received;
        stats.header_bytes_read += r.stats.header_bytes_read;
        stats.reads += r.stats.reads;
        check.merge(r.check.clone());
        items.extend(all[rank].iter().filter(|l| l.data_len().is_some()).zip(r.bufs.iter().map(Vec::as_slice)));
    }
    let checking = Progress::new(&format!("checking {}", layout.describe()), target_bytes);
    check.merge(model::check_buffers(&items, Some(&checking)));
    checking.finish();
    let per_rank = results.iter().map(|r| r.stats.clone()).collect();
    Ok(Loaded { secs: results[0].secs, stats, per_rank, target_bytes, check })
}
