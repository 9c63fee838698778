//! `tessera-bench --plan-only --ranks N --tensors T`: the metadata side of a save and a load
//! at scale, with no IO. N simulated ranks in a TP×DP layout each hold a shard of each of T
//! tensors: even tensors are parameters (split on axis 0 by TP, replicated over DP), odd ones
//! optimizer state (each TP box flattened and cut across the DP ranks at arbitrary points). With
//! `--fsdp` the parameters are cut across DP the same way, so every shard is a stored chunk.
//!
//! It runs the same pure functions as a real save: every rank's [`RankPlan`] is encoded (the
//! all-gather message), decoded by the receiver, validated globally, laid out, reported as
//! [`WrittenFile`]s, assembled into the index, encoded and opened again; then one rank of
//! another layout (TP doubled) plans its load against that index, and a rank that loads one
//! layer opens the stored index for those keys only and plans their load.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use serde_json::json;
use tessera::__plan::data_file::data_file_name;
use tessera::__plan::dims::Dims;
use tessera::__plan::load::{plan_reads, plan_request, ReadPlan, ReadTuning, Request};
use tessera::__plan::save::{
    build_index, cache_hit, layout_file, plan_digest, plan_options, validate_global_with, CacheCheck, ObjectMeta,
    RankPlan, ShardMeta, WrittenFile,
};
use tessera::index::{CheckpointIndex, DEFAULT_BLOCK_SIZE, INDEX_FILE};
use tessera::storage::{CountingStorage, MemoryStorage};
use tessera::{open_with, DType, OpenOptions, PathSeg, Storage, Value};
use tessera_synth::model::{jittered_bounds, key_seed, split_range};
use tessera_synth::sizes::{fmt_bytes, fmt_secs};

use crate::os;

/// Arguments of the planning benchmark.
pub struct PlanArgs {
    /// Simulated ranks.
    pub ranks: usize,
    /// Tensors per rank.
    pub tensors: usize,
    /// Parameters cut across DP too (every shard a stored chunk).
    pub fsdp: bool,
    /// Print one JSON object.
    pub json: bool,
}

const ROWS_PER_TP: u64 = 128;
const OBJECT_LEN: u64 = 96;
const SAVE_ID: u64 = 0x7e55_e7a0_0000_0001;

struct TensorSpec {
    key: Arc<str>,
    dtype: DType,
    global: [u64; 2],
    /// Cut points across DP of each TP box's flattening (optimizer state), else `None`.
    dp_bounds: Option<Vec<u64>>,
}

fn specs(tensors: usize, tp: u64, dp: u64, fsdp: bool) -> Vec<TensorSpec> {
    (0..tensors)
        .map(|i| {
            let cols = 1024 + 256 * (i as u64 % 3);
            let global = [tp * ROWS_PER_TP, cols];
            if i % 2 == 0 {
                let key: Arc<str> = format!("model.layers.{:04}.weight", i / 2).into();
                let dp_bounds = fsdp.then(|| jittered_bounds(ROWS_PER_TP * cols, dp, key_seed(&key)));
                TensorSpec { key, dtype: DType::BF16, global, dp_bounds }
            } else {
                let key: Arc<str> = format!("optimizer.exp_avg.model.layers.{:04}.weight", i / 2).into();
                let bounds = jittered_bounds(ROWS_PER_TP * cols, dp, key_seed(&key));
                TensorSpec { key, dtype: DType::F32, global, dp_bounds: Some(bounds) }
            }
        })
        .collect()
}

fn rank_plan(rank: u64, tp: u64, dp: u64, specs: &[TensorSpec]) -> RankPlan {
    let (t, d) = (rank % tp, rank / tp);
    let tensors = specs
        .iter()
        .map(|s| {
            let offset: Dims = [t * ROWS_PER_TP, 0].into();
            let shape: Dims = [ROWS_PER_TP, s.global[1]].into();
            let (flat, main) = match &s.dp_bounds {
                Some(b) => (Some((b[d as usize], b[d as usize + 1])), true),
                None => (None, d == 0),
            };
            ShardMeta {
                key: s.key.clone(),
                dtype: s.dtype,
                global_shape: s.global.into(),
                offset,
                shape,
                flat,
                main,
                has_data: true,
            }
        })
        .collect();
    let objects = vec![ObjectMeta {
        key: "rng_state".into(),
        global_shape: vec![tp, dp],
        offset: vec![t, d],
        main: true,
        len: OBJECT_LEN,
    }];
    RankPlan { refuse_overwrite: false, save_id: if rank == 0 { SAVE_ID } else { 0 }, tensors, objects }
}

/// What rank `rank` would report after writing its file (offsets after a header of
/// `header_len` bytes; checksums are placeholders: no bytes exist).
fn written(rank: usize, plan: &RankPlan, header_len: u64) -> WrittenFile {
    let mut at = header_len;
    let mut tensors = Vec::new();
    for t in plan.tensors.iter().filter(|t| t.main) {
        let n = t.nbytes();
        tensors.push((at, (0..n.div_ceil(DEFAULT_BLOCK_SIZE)).map(|_| 0u32).collect()));
        at += n;
    }
    let mut objects = Vec::new();
    for o in plan.objects.iter().filter(|o| o.main) {
        objects.push((at, o.len, 0));
        at += o.len;
    }
    WrittenFile { name: data_file_name(SAVE_ID, rank), size: at, header_len, header_crc: 0, tensors, objects }
}

/// Rank 0's load plan at tensor-parallel size `tp` (rows split, no DP sharding) for `specs`.
fn load_plan(index: &CheckpointIndex, specs: &[&TensorSpec], tp: u64) -> Result<ReadPlan> {
    let mut segs = Vec::new();
    for (i, s) in specs.iter().enumerate() {
        let (row, rows) = split_range(s.global[0], tp, 0);
        let req = Request {
            key: s.key.to_string(),
            dtype: s.dtype,
            global_shape: s.global.to_vec(),
            offset: vec![row, 0],
            shape: vec![rows, s.global[1]],
            flat: None,
            allow_shape_mismatch: false,
            target: i,
        };
        segs.extend(plan_request(index, &req)?.segs);
    }
    Ok(plan_reads(index, segs, true, ReadTuning::default()))
}

/// Runs `work(i)` for every `i` in `0..n` on one thread per core, as a save decodes and
/// validates the plans.
fn on_cores(n: usize, work: &(dyn Fn(usize) + Sync)) {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let threads = std::thread::available_parallelism().map_or(1, |c| c.get()).min(n);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= n {
                    return;
                }
                work(i);
            });
        }
    });
}

fn timed<T>(f: impl FnOnce() -> T) -> (T, f64) {
    let start = Instant::now();
    let out = f();
    (out, start.elapsed().as_secs_f64())
}

/// Runs the planning benchmark.
pub fn run(args: PlanArgs) -> Result<()> {
    anyhow::ensure!(args.ranks >= 1 && args.tensors >= 1, "--ranks and --tensors must be at least 1");
    let begin = Instant::now();
    let n = args.ranks as u64;
    let tp = [8u64, 4, 2, 1].into_iter().find(|t| n.is_multiple_of(*t)).unwrap_or(1);
    let dp = n / tp;
    let specs = specs(args.tensors, tp, dp, args.fsdp);

    // 1. Every rank describes its shards and encodes them: the message of the all-gather.
    let (messages, t_encode_all) = timed(|| (0..n).map(|r| rank_plan(r, tp, dp, &specs).encode()).collect::<Vec<_>>());
    let plan_bytes: u64 = messages.iter().map(|m| m.len() as u64).sum();
    let plan_max = messages.iter().map(Vec::len).max().unwrap_or(0) as u64;
    // 2. The receiver decodes all of them and validates the global sharding.
    let (plans, t_decode) = timed(|| RankPlan::decode_all_with(&messages, &on_cores));
    let plans = plans.map_err(|(r, e)| anyhow::anyhow!("decoding rank {r}'s plan: {e}"))?;
    drop(messages);
    let (valid, t_validate) = timed(|| validate_global_with(&plans, &on_cores));
    valid.context("validation of the simulated layout")?;
    // 2'. The same save with a plan cache hit: each rank hashes its plan and sends a few bytes;
    // every rank decodes all of them and decides; no plan is decoded or validated.
    let options = plan_options(DEFAULT_BLOCK_SIZE, true, true);
    let (digests, t_digest_all) =
        timed(|| (0..n).map(|r| plan_digest(&rank_plan(r, tp, dp, &specs), &options)).collect::<Vec<_>>());
    let checks: Vec<Vec<u8>> = digests
        .iter()
        .enumerate()
        .map(|(r, _)| {
            let id = if r == 0 { SAVE_ID } else { 0 };
            CacheCheck { matches: true, generation: SAVE_ID - 1, save_id: id, ..Default::default() }.encode()
        })
        .collect();
    let check_bytes: u64 = checks.iter().map(|m| m.len() as u64).sum();
    let (hit, t_checks) = timed(|| -> Result<bool, String> {
        let decoded = checks.iter().map(|m| CacheCheck::decode(m)).collect::<Result<Vec<_>, _>>()?;
        Ok(cache_hit(&decoded))
    });
    anyhow::ensure!(hit.map_err(|e| anyhow::anyhow!(e))?, "the simulated plan-cache check must hit");
    // 3. Each rank lays out its own file (timed for rank 0) and reports what it wrote.
    let (layout0, t_layout) = timed(|| layout_file(0, &plans[0], DEFAULT_BLOCK_SIZE));
    let reports: Vec<Vec<u8>> =
        plans.iter().enumerate().map(|(r, p)| written(r, p, layout0.header_len).encode()).collect();
    let written_bytes: u64 = reports.iter().map(|m| m.len() as u64).sum();
    let (files, t_written) = timed(|| reports.iter().map(|b| WrittenFile::decode(b)).collect::<Result<Vec<_>, _>>());
    let files = files.map_err(|e| anyhow::anyhow!("decoding a write report: {e}"))?;
    drop(reports);
    // 4. Rank 0 assembles and encodes the index; a loader opens it.
    let common = vec![(vec![PathSeg::Key("iteration".into())], Value::Int(1000))];
    let meta = Value::Map(vec![("producer".into(), "tessera-bench --plan-only".into())]);
    let (index, t_build) = timed(|| build_index(&plans, files, DEFAULT_BLOCK_SIZE, common, meta, &on_cores));
    let index = index.context("building the index")?;
    drop(plans);
    let (encoded, t_index_encode) = timed(|| index.encode());
    let chunks = index.chunk_count();
    drop(index);
    let (opened, t_open) = timed(|| CheckpointIndex::from_bytes(&encoded, "plan-only"));
    let index = opened.context("opening the encoded index")?;
    // 4'. A rank that loads one layer (its weight and optimizer state) opens the stored index
    // for those keys: the head, then their chunk records only.
    let few: Vec<&str> = specs.iter().take(2).map(|s| &*s.key).collect();
    let stored = MemoryStorage::named("plan-only");
    stored.put_atomic(INDEX_FILE, &encoded)?;
    let counted = CountingStorage::new(&stored);
    let (few_open, t_few_open) =
        timed(|| open_with(&counted, &OpenOptions { keys: Some(few.iter().map(|k| k.to_string()).collect()) }));
    let few_open = few_open.context("opening the index for a few keys")?;
    let few_read = (counted.bytes_read(), counted.reads());
    let few_specs: Vec<&TensorSpec> = specs.iter().take(2).collect();
    let (few_plan, t_few_plan) = timed(|| load_plan(few_open.index(), &few_specs, 2 * tp));
    let few_plan = few_plan?;
    drop(few_open);
    drop(stored);

    // 5. Rank 0 of another layout (TP doubled, no DP sharding) plans its load of every tensor.
    let all_specs: Vec<&TensorSpec> = specs.iter().collect();
    let (plan, t_load_plan) = timed(|| load_plan(&index, &all_specs, 2 * tp));
    let plan = plan?;
    let new_tp = 2 * tp;
    let total_secs = begin.elapsed().as_secs_f64();
    let per_rank_encode = t_encode_all / n as f64;
    let critical = per_rank_encode + t_decode + t_validate + t_layout + t_written + t_build + t_index_encode;
    let per_rank_digest = t_digest_all / n as f64;
    let critical_cached = per_rank_digest + t_checks + t_layout + t_written + t_build + t_index_encode;
    let peak = os::peak_rss().unwrap_or(0);
    let per_rank_sent = (plan_bytes + written_bytes) as f64 / n as f64;

    if args.json {
        let out = json!({
            "ranks": n,
            "tensors": args.tensors,
            "fsdp": args.fsdp,
            "layout": {"tp": tp, "dp": dp},
            "shards": n * args.tensors as u64,
            "chunks": chunks,
            "plan_bytes_per_rank": plan_bytes as f64 / n as f64,
            "plan_bytes_max": plan_max,
            "written_bytes_per_rank": written_bytes as f64 / n as f64,
            "bytes_sent_per_rank": per_rank_sent,
            "gathered_bytes_total": plan_bytes + written_bytes,
            "rank_plan_encode_secs": per_rank_encode,
            "simulate_all_ranks_secs": t_encode_all,
            "decode_plans_secs": t_decode,
            "validation_secs": t_validate,
            "layout_file_secs": t_layout,
            "decode_written_secs": t_written,
            "build_index_secs": t_build,
            "index_bytes": encoded.len(),
            "index_bytes_per_chunk": encoded.len() as f64 / chunks.max(1) as f64,
            "index_encode_secs": t_index_encode,
            "index_open_secs": t_open,
            "load_plan_secs": t_load_plan,
            "load_plan_bytes_needed": plan.bytes_needed,
            "load_plan_bytes_read": plan.bytes_read,
            "load_plan_reads": plan.spans.len(),
            "few_keys": {
                "keys": few.len(),
                "index_open_secs": t_few_open,
                "index_bytes_read": few_read.0,
                "index_reads": few_read.1,
                "load_plan_secs": t_few_plan,
                "load_plan_bytes_needed": few_plan.bytes_needed,
            },
            "save_critical_path_secs": critical,
            "plan_cache_hit": {
                "rank_plan_digest_secs": per_rank_digest,
                "check_bytes_per_rank": check_bytes as f64 / n as f64,
                "decide_secs": t_checks,
                "save_critical_path_secs": critical_cached,
            },
            "end_to_end_secs": total_secs,
            "peak_rss_bytes": peak,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!(
            "plan-only: {n} ranks (TP={tp} × DP={dp}{}) × {} tensors = {} shards, {} stored chunks",
            if args.fsdp { ", parameters cut across DP" } else { "" },
            args.tensors,
            n * args.tensors as u64,
            chunks
        );
        println!(
            "exchange    {} sent per rank (plan {} avg / {} max, write report {}); {} gathered in all",
            fmt_bytes(per_rank_sent as u64),
            fmt_bytes(plan_bytes / n),
            fmt_bytes(plan_max),
            fmt_bytes(written_bytes / n),
            fmt_bytes(plan_bytes + written_bytes)
        );
        println!(
            "rank plan   {} per rank to describe and encode ({} for all {n} simulated)",
            fmt_secs(per_rank_encode),
            fmt_secs(t_encode_all)
        );
        println!("decode      {} for all plans, {} for all write reports", fmt_secs(t_decode), fmt_secs(t_written));
        println!("validate    {}", fmt_secs(t_validate));
        println!("layout      {} (one rank's data file)", fmt_secs(t_layout));
        println!(
            "index       build {}, encode {}, {} ({:.1} bytes/chunk), open {}",
            fmt_secs(t_build),
            fmt_secs(t_index_encode),
            fmt_bytes(encoded.len() as u64),
            encoded.len() as f64 / chunks.max(1) as f64,
            fmt_secs(t_open)
        );
        println!(
            "load plan   {} for one rank at TP={new_tp}: {} needed, {} read in {} reads",
            fmt_secs(t_load_plan),
            fmt_bytes(plan.bytes_needed),
            fmt_bytes(plan.bytes_read),
            plan.spans.len()
        );
        println!(
            "few keys    a rank loading {} keys: index open {} ({} read in {} reads), load plan {}",
            few.len(),
            fmt_secs(t_few_open),
            fmt_bytes(few_read.0),
            few_read.1,
            fmt_secs(t_few_plan)
        );
        println!(
            "plan cache  hit: {} per rank to describe and hash its plan, {:.0} bytes sent per rank, {} to decide; \
             save critical path {}",
            fmt_secs(per_rank_digest),
            check_bytes as f64 / n as f64,
            fmt_secs(t_checks),
            fmt_secs(critical_cached)
        );
        println!(
            "total       save critical path {} (one rank's view); end to end {}; peak RSS {}",
            fmt_secs(critical),
            fmt_secs(total_secs),
            fmt_bytes(peak)
        );
    }
    Ok(())
}
