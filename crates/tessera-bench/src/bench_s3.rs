//! `tessera-bench --dir D --s3 URL [--s3 URL …] [--storage-option K=V …] [--size S] [--ranks N]
//! [--rounds R] [--json]`, or `--emulators` instead of the URLs (moto, Azurite, fake-gcs-server):
//! the same save and resharded load into a local directory and into an object store, in one
//! run.
//!
//! The state is the model of `tessera-bench` (about S bytes, default 256 MiB), saved from N
//! in-process ranks (TP=N, default 4) and loaded under TP=N/2 (N/2 ranks; 1 rank whole when
//! N = 1), as in `tessera-bench`. Each round runs both sides back to back — the local directory
//! D/ckpt and the prefix URL/ckpt of the object store, local first in odd rounds and second in
//! even ones — and each side does: a save, a resharded load with checksum verification, and one
//! without (the local page cache dropped before each load). Every loaded byte is checked.
//!
//! Reported: each round's object-store / local time ratios for the save and both loads, with
//! their medians and min–max; the object store's requests, counted by the
//! [`ObjectStorage`] of the bench (`request_counts()` before and after each step, the largest
//! count over rounds): PUTs and multipart parts of the save, GETs of each load per loaded chunk
//! (the stored chunks each loading rank reads from, summed over ranks) and per rank, and the
//! bytes downloaded over the bytes the load needed (goal ≤ 1.05). The downloaded bytes include
//! what every load reads besides tensor data: the index (by every rank), the data-file headers
//! (verified loads), the RNG object shards. Verified loads read whole checksum blocks, so both
//! loads are reported. Both checkpoints are removed after every round (kept after the last with
//! `--keep`); the exit code is 1 if any load returned a wrong byte.

use std::collections::BTreeSet;

use anyhow::{Context, Result};
use serde_json::{json, Value as J};
use tessera::__plan::load::{plan_request, Request};
use tessera::index::CheckpointIndex;
use tessera::storage::Location;
use tessera::storage::{LocalStorage, ObjectStorage, ObjectStoreOptions, RequestCounts};
use tessera::{LoadOptions, SaveOptions};
use tessera_synth::jobs;
use tessera_synth::model::{self, Layout, ModelConfig};
use tessera_synth::sizes::{fmt_bytes, fmt_secs};
use tessera_synth::system;

use crate::bench::{ratio, Spread};
use crate::os;
use crate::scratch::Scratch;

/// Default state size: moto, the test server, keeps every object in the memory of one Python
/// process.
pub const DEFAULT_SIZE: &str = "256MiB";

/// Arguments of the object-store benchmark.
pub struct S3Args {
    /// Local directory (the local checkpoint goes to DIR/ckpt; with several stores, to
    /// DIR/store-I/ckpt for the I-th).
    pub dir: Location,
    /// The stores, each a name and its URL (the checkpoint goes to URL/ckpt).
    pub stores: Vec<(String, Location)>,
    /// Approximate state size.
    pub size: u64,
    /// Saving ranks.
    pub ranks: usize,
    /// Rounds.
    pub rounds: usize,
    /// Print one JSON object.
    pub json: bool,
    /// Keep both checkpoints of the last round.
    pub keep: bool,
}

/// What every round shares.
struct Setup {
    cfg: ModelConfig,
    save_layout: Layout,
    load_layout: Layout,
    local: Location,
    remote: Location,
    store: ObjectStorage,
}

/// One side's save and loads in one round.
struct Side {
    save: jobs::Saved,
    /// Verified load, then unverified.
    loads: [jobs::Loaded; 2],
    /// Object store only: requests of the save and of each load.
    save_req: RequestCounts,
    load_req: [RequestCounts; 2],
}

struct Round {
    local: Side,
    remote: Side,
}

impl Round {
    fn problems(&self) -> impl Iterator<Item = &String> {
        [&self.local, &self.remote].into_iter().flat_map(|s| s.loads.iter().flat_map(|l| l.check.problems.iter()))
    }
    fn save_ratio(&self) -> f64 {
        ratio(self.remote.save.secs, self.local.save.secs)
    }
    fn load_ratio(&self, which: usize) -> f64 {
        ratio(self.remote.loads[which].secs, self.local.loads[which].secs)
    }
}

/// `after - before`, field by field.
fn delta(before: &RequestCounts, after: &RequestCounts) -> RequestCounts {
    RequestCounts {
        gets: after.gets - before.gets,
        bytes_downloaded: after.bytes_downloaded - before.bytes_downloaded,
        heads: after.heads - before.heads,
        puts: after.puts - before.puts,
        parts: after.parts - before.parts,
        bytes_uploaded: after.bytes_uploaded - before.bytes_uploaded,
        lists: after.lists - before.lists,
        deletes: after.deletes - before.deletes,
    }
}

/// Field-by-field maximum.
fn max_counts(a: &RequestCounts, b: &RequestCounts) -> RequestCounts {
    RequestCounts {
        gets: a.gets.max(b.gets),
        bytes_downloaded: a.bytes_downloaded.max(b.bytes_downloaded),
        heads: a.heads.max(b.heads),
        puts: a.puts.max(b.puts),
        parts: a.parts.max(b.parts),
        bytes_uploaded: a.bytes_uploaded.max(b.bytes_uploaded),
        lists: a.lists.max(b.lists),
        deletes: a.deletes.max(b.deletes),
    }
}

/// `f()`, with the store's requests it issued.
fn counted<T>(store: &ObjectStorage, f: impl FnOnce() -> Result<T>) -> Result<(T, RequestCounts)> {
    let before = store.request_counts();
    let out = f()?;
    Ok((out, delta(&before, &store.request_counts())))
}

const LOAD_MODES: [(&str, bool); 2] = [("verified", true), ("unverified", false)];

/// One side: save, then the verified and the unverified load.
fn run_side(setup: &Setup, remote: bool) -> Result<Side> {
    let opts = SaveOptions { overwrite: true, ..SaveOptions::default() };
    let rng_grid = setup.save_layout.rng_grid();
    let (save, save_req) = if remote {
        counted(&setup.store, || jobs::save(&setup.cfg, setup.save_layout, &setup.store, &opts, &|_| {}))?
    } else {
        let storage = local_storage(&setup.local)?;
        (jobs::save(&setup.cfg, setup.save_layout, &storage, &opts, &|_| {})?, RequestCounts::default())
    };
    os::trim_heap();
    let mut loads = Vec::with_capacity(2);
    let mut load_req = [RequestCounts::default(), RequestCounts::default()];
    for (i, (_, verify)) in LOAD_MODES.iter().enumerate() {
        let opts = LoadOptions { verify_checksums: *verify, ..LoadOptions::default() };
        let loaded = if remote {
            let (loaded, req) = counted(&setup.store, || {
                jobs::load(&setup.cfg, setup.load_layout, &rng_grid, &setup.store, &opts, &|_| {})
            })?;
            load_req[i] = req;
            loaded
        } else {
            let dir = setup.local.local_dir().expect("a local directory");
            system::drop_dir_cache(dir)?;
            // A fresh storage per load: LocalStorage keeps its files open.
            let storage = local_storage(&setup.local)?;
            jobs::load(&setup.cfg, setup.load_layout, &rng_grid, &storage, &opts, &|_| {})?
        };
        os::trim_heap();
        loads.push(loaded);
    }
    let loads: [jobs::Loaded; 2] = loads.try_into().map_err(|_| anyhow::anyhow!("two loads"))?;
    Ok(Side { save, loads, save_req, load_req })
}

fn local_storage(dir: &Location) -> Result<LocalStorage> {
    Ok(LocalStorage::new(dir.local_dir().context("the local side needs a directory")?))
}

/// Removes both checkpoints.
fn remove_both(setup: &Setup) -> Result<()> {
    setup.local.remove()?;
    crate::scratch::remove_objects(&setup.store).with_context(|| format!("removing {}", setup.remote))
}

/// The stored chunks each loading rank reads from (the load plan's chunks for its tensors).
fn chunks_per_rank(setup: &Setup, index: &CheckpointIndex) -> Result<Vec<u64>> {
    let grid = setup.save_layout.rng_grid();
    (0..setup.load_layout.world())
        .map(|rank| {
            let mut chunks = BTreeSet::new();
            for leaf in model::leaves(&setup.cfg, setup.load_layout, rank, &grid) {
                for (_, r) in leaf.regions() {
                    let req = Request {
                        key: r.key.clone(),
                        dtype: r.dtype,
                        global_shape: r.global_shape.clone(),
                        offset: r.offset.clone(),
                        shape: r.shape.clone(),
                        flat: r.flat,
                        allow_shape_mismatch: false,
                        target: 0,
                    };
                    let plan = plan_request(index, &req).with_context(|| format!("planning {}", r.describe()))?;
                    chunks.extend(plan.segs.iter().map(|s| (s.tensor, s.chunk)));
                }
            }
            Ok(chunks.len() as u64)
        })
        .collect()
}

/// Median and min–max of one figure over rounds.
fn spread(rounds: &[Round], f: impl Fn(&Round) -> f64) -> (Spread, Vec<f64>) {
    let v: Vec<f64> = rounds.iter().map(f).collect();
    (Spread::of(&v), v)
}

fn max_req(rounds: &[Round], f: impl Fn(&Round) -> &RequestCounts) -> RequestCounts {
    rounds.iter().map(f).fold(RequestCounts::default(), |a, b| max_counts(&a, b))
}

/// The figures of one load mode of the object store.
struct LoadFigures {
    req: RequestCounts,
    bytes_needed: u64,
    data_reads: u64,
    data_bytes_read: u64,
    header_bytes: u64,
    chunk_reads: u64,
    ranks: u64,
    reads_per_rank: Vec<u64>,
}

impl LoadFigures {
    fn of(rounds: &[Round], which: usize, chunks: &[u64]) -> LoadFigures {
        let req = max_req(rounds, |r| &r.remote.load_req[which]);
        let last = &rounds[rounds.len() - 1].remote.loads[which];
        LoadFigures {
            req,
            bytes_needed: last.stats.bytes_needed,
            data_reads: rounds.iter().map(|r| r.remote.loads[which].stats.reads as u64).max().unwrap_or(0),
            data_bytes_read: rounds.iter().map(|r| r.remote.loads[which].stats.bytes_read).max().unwrap_or(0),
            header_bytes: last.stats.header_bytes_read,
            chunk_reads: chunks.iter().sum(),
            ranks: chunks.len() as u64,
            reads_per_rank: last.per_rank.iter().map(|s| s.reads as u64).collect(),
        }
    }
    fn downloaded_vs_needed(&self) -> f64 {
        ratio(self.req.bytes_downloaded as f64, self.bytes_needed as f64)
    }
    fn gets_per_chunk(&self) -> f64 {
        ratio(self.req.gets as f64, self.chunk_reads as f64)
    }
    fn gets_per_rank(&self) -> f64 {
        ratio(self.req.gets as f64, self.ranks as f64)
    }
    fn json(&self) -> J {
        json!({
            "gets": self.req.gets,
            "heads": self.req.heads,
            "lists": self.req.lists,
            "bytes_downloaded": self.req.bytes_downloaded,
            "bytes_needed": self.bytes_needed,
            "bytes_downloaded_vs_needed": self.downloaded_vs_needed(),
            "tensor_bytes_read": self.data_bytes_read,
            "header_bytes_read": self.header_bytes,
            "tensor_data_gets": self.data_reads,
            "tensor_data_gets_per_rank": self.reads_per_rank,
            "chunk_reads": self.chunk_reads,
            "gets_per_chunk": self.gets_per_chunk(),
            "tensor_data_gets_per_chunk": ratio(self.data_reads as f64, self.chunk_reads as f64),
            "gets_per_rank": self.gets_per_rank(),
        })
    }
    fn print(&self, name: &str) {
        let per_rank: Vec<String> = self.reads_per_rank.iter().map(u64::to_string).collect();
        println!(
            "store load {:<12}{} GETs ({} ranged reads of tensor data: {} per rank; {} others: index, headers, objects), {} HEADs for {} chunk reads over {} ranks: {:.3} GETs per chunk, {:.1} per rank",
            format!("{name}:"),
            self.req.gets,
            self.data_reads,
            per_rank.join("/"),
            self.req.gets.saturating_sub(self.data_reads),
            self.req.heads,
            self.chunk_reads,
            self.ranks,
            self.gets_per_chunk(),
            self.gets_per_rank()
        );
        println!(
            "                       downloaded {} for {} needed: {:.4}× (tensor data {}, headers {}, index and objects {})",
            fmt_bytes(self.req.bytes_downloaded),
            fmt_bytes(self.bytes_needed),
            self.downloaded_vs_needed(),
            fmt_bytes(self.data_bytes_read),
            fmt_bytes(self.header_bytes),
            fmt_bytes(self.req.bytes_downloaded.saturating_sub(self.data_bytes_read + self.header_bytes)),
        );
    }
}

fn print_round(i: usize, count: usize, r: &Round) {
    let side = |s: &Side| {
        format!(
            "save {:>7}  load {:>7} / {:>7}",
            fmt_secs(s.save.secs),
            fmt_secs(s.loads[0].secs),
            fmt_secs(s.loads[1].secs)
        )
    };
    println!(
        "round {:<4} local: {}   store: {}   store/local: save {:.2}×  load {:.2}× / {:.2}×{}",
        format!("{}/{count}", i + 1),
        side(&r.local),
        side(&r.remote),
        r.save_ratio(),
        r.load_ratio(0),
        r.load_ratio(1),
        if r.problems().next().is_none() { "" } else { "  MISMATCH" }
    );
}

/// Runs the benchmark: each store against the local directory in turn, then, for more than
/// one, a table of the median ratios. With `--json`, one object for one store, an array for
/// several.
pub fn run(args: S3Args) -> Result<u8> {
    let mut worst = 0;
    let mut results = Vec::new();
    let several = args.stores.len() > 1;
    for (i, (name, url)) in args.stores.iter().enumerate() {
        let local = if several { args.dir.join(&format!("store-{i}")) } else { args.dir.clone() };
        if !args.json && several {
            println!("== {name}: {url}");
        }
        let (code, mut out) = measure(&args, url, &local)?;
        out["store"] = json!(name);
        worst = worst.max(code);
        results.push(out);
    }
    if args.json {
        let doc = if results.len() == 1 { results.remove(0) } else { J::Array(results) };
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else if results.len() > 1 {
        println!();
        println!("| store | save, store / local | load verified, store / local | load unverified | downloaded / needed (verified, unverified) |");
        println!("|---|---|---|---|---|");
        for r in &results {
            println!(
                "| {} | {:.2}× | {:.2}× | {:.2}× | {:.3}×, {:.3}× |",
                r["store"].as_str().unwrap_or(""),
                r["save_s3_vs_local"].as_f64().unwrap_or(f64::NAN),
                r["load_s3_vs_local"].as_f64().unwrap_or(f64::NAN),
                r["load_unverified_s3_vs_local"].as_f64().unwrap_or(f64::NAN),
                r["load"]["bytes_downloaded_vs_needed"].as_f64().unwrap_or(f64::NAN),
                r["load_unverified"]["bytes_downloaded_vs_needed"].as_f64().unwrap_or(f64::NAN),
            );
        }
    }
    Ok(worst)
}

/// One store (`store`, against the local directory `dir`): the rounds, the text report
/// (unless `--json`), and the figures as one JSON object.
fn measure(args: &S3Args, store: &Location, dir: &Location) -> Result<(u8, J)> {
    anyhow::ensure!(args.ranks >= 1, "--ranks must be at least 1");
    anyhow::ensure!(args.rounds >= 1, "--rounds must be at least 1");
    anyhow::ensure!(args.size > 0, "--size must be positive");
    anyhow::ensure!(dir.local_dir().is_some(), "--dir {dir}: the local side of --s3 needs a local directory");
    anyhow::ensure!(store.url().is_some(), "--s3 {store}: not an object-store URL (s3://bucket/prefix)");
    let store_shown = store.to_string();
    dir.create()?;
    let remote = store.join("ckpt");
    let remote_url = remote.url().expect("a sub-prefix of a URL is a URL").to_string();
    let opts = ObjectStoreOptions { config: store.options().to_vec(), ..ObjectStoreOptions::default() };
    let store = ObjectStorage::open(&remote_url, opts).with_context(|| format!("opening {remote}"))?;
    let setup = Setup {
        cfg: ModelConfig::for_bytes(args.size),
        save_layout: Layout::Train { tp: args.ranks as u64, dp: 1 },
        load_layout: if args.ranks >= 2 { Layout::TpPp { tp: args.ranks as u64 / 2, pp: 1 } } else { Layout::Whole },
        local: dir.join("ckpt"),
        remote,
        store,
    };
    // The rounds delete both checkpoints: both locations must be the benchmark's own.
    setup.local.claim()?;
    setup.remote.claim()?;
    let part_size = ObjectStoreOptions::default().part_size;

    let mut rounds: Vec<Round> = Vec::with_capacity(args.rounds);
    let mut chunks = Vec::new();
    for i in 0..args.rounds {
        let local_first = i % 2 == 0;
        let (local, remote) = if local_first {
            let l = run_side(&setup, false)?;
            (l, run_side(&setup, true)?)
        } else {
            let r = run_side(&setup, true)?;
            (run_side(&setup, false)?, r)
        };
        if i == 0 {
            let index = tessera::open(&setup.store)
                .map(tessera::Checkpoint::into_index)
                .context("opening the object store's index")?;
            chunks = chunks_per_rank(&setup, &index)?;
        }
        let round = Round { local, remote };
        if !(args.keep && i + 1 == args.rounds) {
            remove_both(&setup)?;
        }
        if !args.json {
            if i == 0 {
                let cfg = &setup.cfg;
                println!(
                    "bench --s3: {} against {}: model of {} ({} layers, hidden {}); save {}, load {}; {} round(s); multipart parts of {}",
                    setup.remote,
                    setup.local,
                    fmt_bytes(round.local.save.state_bytes),
                    cfg.layers,
                    cfg.hidden,
                    setup.save_layout.describe(),
                    setup.load_layout.describe(),
                    args.rounds,
                    fmt_bytes(part_size)
                );
                println!("(times: save, then the load verified / unverified)");
            }
            print_round(i, args.rounds, &round);
        }
        rounds.push(round);
    }

    let first = &rounds[0];
    let report = &first.remote.save.report;
    let (save_s, save_rounds) = spread(&rounds, Round::save_ratio);
    let (load_s, load_rounds) = spread(&rounds, |r| r.load_ratio(0));
    let (load_nv_s, load_nv_rounds) = spread(&rounds, |r| r.load_ratio(1));
    let save_req = max_req(&rounds, |r| &r.remote.save_req);
    let loads: Vec<LoadFigures> = (0..2).map(|w| LoadFigures::of(&rounds, w, &chunks)).collect();
    let local_read_vs_needed: Vec<f64> = (0..2)
        .map(|w| {
            let bytes_read = rounds.iter().map(|r| r.local.loads[w].stats.bytes_read).max().unwrap_or(0);
            ratio(bytes_read as f64, first.local.loads[w].stats.bytes_needed as f64)
        })
        .collect();
    let problems: Vec<String> = rounds
        .iter()
        .enumerate()
        .flat_map(|(i, r)| r.problems().map(move |p| format!("round {}: {p}", i + 1)))
        .collect();
    let verified = problems.is_empty();
    let med = |f: &dyn Fn(&Round) -> f64| Spread::of(&rounds.iter().map(f).collect::<Vec<_>>()).median;

    let out = json!({
        "mode": "s3",
        "dir": dir.to_string(),
        "url": store_shown,
        "size_bytes": args.size,
        "ranks": args.ranks,
        "rounds": args.rounds,
        "save_layout": setup.save_layout.describe(),
        "load_layout": setup.load_layout.describe(),
        "load_ranks": setup.load_layout.world(),
        "state_bytes": first.local.save.state_bytes,
        "checkpoint_bytes": report.total_tensor_bytes,
        "files": report.files,
        "chunks": report.chunks,
        "index_bytes": report.index_bytes,
        "part_size": part_size,
        "local_save_secs": med(&|r| r.local.save.secs),
        "s3_save_secs": med(&|r| r.remote.save.secs),
        "local_load_secs": med(&|r| r.local.loads[0].secs),
        "s3_load_secs": med(&|r| r.remote.loads[0].secs),
        "local_load_unverified_secs": med(&|r| r.local.loads[1].secs),
        "s3_load_unverified_secs": med(&|r| r.remote.loads[1].secs),
        "save_s3_vs_local": save_s.median,
        "save_s3_vs_local_rounds": save_rounds,
        "load_s3_vs_local": load_s.median,
        "load_s3_vs_local_rounds": load_rounds,
        "load_unverified_s3_vs_local": load_nv_s.median,
        "load_unverified_s3_vs_local_rounds": load_nv_rounds,
        "save_requests": {
            "puts": save_req.puts,
            "parts": save_req.parts,
            "bytes_uploaded": save_req.bytes_uploaded,
            "bytes_uploaded_vs_checkpoint": ratio(save_req.bytes_uploaded as f64, report.total_tensor_bytes as f64),
            "gets": save_req.gets,
            "heads": save_req.heads,
            "lists": save_req.lists,
            "deletes": save_req.deletes,
        },
        "chunk_reads_per_rank": chunks,
        "load": loads[0].json(),
        "load_unverified": loads[1].json(),
        "local_bytes_read_vs_needed": local_read_vs_needed[0],
        "local_unverified_bytes_read_vs_needed": local_read_vs_needed[1],
        "verified": verified,
        "problems": problems.iter().take(20).collect::<Vec<_>>(),
    });
    if !args.json {
        println!(
            "median     store/local time: save {:.2}× (min–max {:.2}–{:.2})   load verified {:.2}× ({:.2}–{:.2})   load unverified {:.2}× ({:.2}–{:.2})",
            save_s.median, save_s.min, save_s.max, load_s.median, load_s.min, load_s.max, load_nv_s.median, load_nv_s.min, load_nv_s.max
        );
        println!(
            "median     local: save {}, load {} / {};  store: save {}, load {} / {}",
            fmt_secs(med(&|r| r.local.save.secs)),
            fmt_secs(med(&|r| r.local.loads[0].secs)),
            fmt_secs(med(&|r| r.local.loads[1].secs)),
            fmt_secs(med(&|r| r.remote.save.secs)),
            fmt_secs(med(&|r| r.remote.loads[0].secs)),
            fmt_secs(med(&|r| r.remote.loads[1].secs)),
        );
        println!(
            "store save {} files, {} chunks, {} of tensor data: {} PUTs, {} parts, {} uploaded ({:.4}×), {} HEADs, {} GETs, {} LISTs, {} DELETEs",
            report.files,
            report.chunks,
            fmt_bytes(report.total_tensor_bytes),
            save_req.puts,
            save_req.parts,
            fmt_bytes(save_req.bytes_uploaded),
            ratio(save_req.bytes_uploaded as f64, report.total_tensor_bytes as f64),
            save_req.heads,
            save_req.gets,
            save_req.lists,
            save_req.deletes
        );
        for (figures, (name, _)) in loads.iter().zip(LOAD_MODES) {
            figures.print(name);
        }
        println!(
            "local load read / needed: {:.4}× verified, {:.4}× unverified",
            local_read_vs_needed[0], local_read_vs_needed[1]
        );
        if verified {
            println!("check      every loaded byte matched in every round (both sides, both loads)");
        } else {
            println!("check      FAILED: {} problem(s)", problems.len());
            for p in problems.iter().take(20) {
                println!("  {p}");
            }
        }
    }
    Ok((if verified { 0 } else { 1 }, out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deltas_and_maxima_of_counts() {
        let a = RequestCounts { gets: 1, bytes_downloaded: 10, puts: 2, ..Default::default() };
        let b = RequestCounts { gets: 4, bytes_downloaded: 15, puts: 2, parts: 3, ..Default::default() };
        assert_eq!(delta(&a, &b), RequestCounts { gets: 3, bytes_downloaded: 5, parts: 3, ..Default::default() });
        assert_eq!(max_counts(&a, &b), b);
    }
}
