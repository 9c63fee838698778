//! `tessera demo`: save a GPT-like model with Adam state from 8 ranks (TP=4 × DP=2), load it
//! back under TP=2 × PP=2 and under one rank, and check every byte.

use std::path::PathBuf;

use anyhow::{Context, Result};
use tessera::{LoadOptions, SaveOptions, Storage, StrictHandling, Value};
use tessera_synth::jobs;
use tessera_synth::model::{CheckReport, Layout, ModelConfig};
use tessera_synth::sizes::{fmt_bytes, fmt_rate, fmt_secs};
use tessera_synth::system;

use crate::location::Location;

/// Arguments of `tessera demo`.
pub struct DemoArgs {
    /// Checkpoint location to keep (a directory or a URL such as `s3://bucket/prefix`); a
    /// temporary directory otherwise.
    pub dir: Option<Location>,
    /// Approximate checkpoint size in bytes.
    pub size: u64,
}

/// Removes a temporary directory when dropped.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const SAVE_LAYOUT: Layout = Layout::Train { tp: 4, dp: 2 };

/// The producer the demo records in its checkpoints' content metadata.
const PRODUCER: &str = "tessera demo";

/// The demo saves with `overwrite`: refused over a committed checkpoint (of any format) that a
/// demo did not write, which the demo's index would replace or shadow.
fn check_replaceable(storage: &dyn Storage, dir: &Location) -> Result<()> {
    let index = match tessera::open(storage).map(tessera::Checkpoint::into_index) {
        Ok(index) => index,
        Err(tessera::Error::NotFound { .. } | tessera::Error::NotCommitted { .. }) => return Ok(()),
        Err(e) => {
            return Err(e)
                .with_context(|| format!("{dir} holds something the demo would overwrite; choose another --dir"))
        }
    };
    let by_demo = match &index.content_metadata {
        Value::Map(m) => m.iter().any(|(k, v)| k == "producer" && matches!(v, Value::Str(s) if s == PRODUCER)),
        _ => false,
    };
    anyhow::ensure!(
        by_demo,
        "{dir} holds a committed checkpoint that the demo did not write: refusing to overwrite it; choose another --dir"
    );
    Ok(())
}

/// Runs the demo; exit code 0 only if every byte matched.
pub fn run(args: DemoArgs) -> Result<u8> {
    let cfg = ModelConfig::for_bytes(args.size);
    let (dir, _temp) = match &args.dir {
        Some(d) => (d.clone(), None),
        None => {
            let nonce = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
            let d = std::env::temp_dir().join(format!("tessera-demo-{}-{nonce}", std::process::id()));
            // Created here, new (never a directory that was already there): the demo removes it.
            std::fs::create_dir(&d).with_context(|| format!("creating {}", d.display()))?;
            (Location::local(d.clone()), Some(TempDir(d)))
        }
    };
    let storage = dir.open()?;
    check_replaceable(storage.as_ref(), &dir)?;
    println!(
        "model: GPT-like, {} layers, hidden {}, SwiGLU ffn 2×{}, vocab {}: {:.1}M bf16 parameters + Adam exp_avg/exp_avg_sq (f32) = {}",
        cfg.layers,
        cfg.hidden,
        cfg.ffn,
        cfg.vocab,
        cfg.param_count() as f64 / 1e6,
        fmt_bytes(cfg.state_bytes())
    );
    println!("checkpoint: {dir}{}", if args.dir.is_some() { "" } else { " (temporary, removed at the end)" });

    let opts = SaveOptions {
        overwrite: true,
        content_metadata: Value::Map(vec![
            ("producer".into(), PRODUCER.into()),
            ("model".into(), "gpt-demo".into()),
            ("parallelism".into(), Value::Map(vec![("tp".into(), Value::Int(4)), ("dp".into(), Value::Int(2))])),
            ("iteration".into(), Value::Int(1000)),
        ]),
        ..SaveOptions::default()
    };
    let save = jobs::save(&cfg, SAVE_LAYOUT, storage.as_ref(), &opts, &|_| {})?;
    println!(
        "save  {:<26} {:>10} in {:>8}  {:>10}   {} files, {} chunks, index {}",
        SAVE_LAYOUT.describe(),
        fmt_bytes(save.report.total_tensor_bytes),
        fmt_secs(save.secs),
        fmt_rate(save.report.total_tensor_bytes, save.secs),
        save.report.files,
        save.report.chunks,
        fmt_bytes(save.report.index_bytes)
    );

    // Every stored key must be requested by some rank, and nothing else.
    let load_opts = LoadOptions { strict: StrictHandling::RaiseAll, ..LoadOptions::default() };
    let mut check = CheckReport::default();
    for layout in [Layout::TpPp { tp: 2, pp: 2 }, Layout::Whole] {
        if let Some(local) = dir.local_dir() {
            system::drop_dir_cache(local)?;
        }
        let loaded = jobs::load(&cfg, layout, &SAVE_LAYOUT.rng_grid(), storage.as_ref(), &load_opts, &|_| {})?;
        let (secs, stats, rep) = (loaded.secs, loaded.stats, loaded.check);
        println!(
            "load  {:<26} {:>10} in {:>8}  {:>10}   read {} for {} needed ({:.3}×), {} reads{}",
            layout.describe(),
            fmt_bytes(stats.bytes_needed),
            fmt_secs(secs),
            fmt_rate(stats.bytes_needed, secs),
            fmt_bytes(stats.bytes_read),
            fmt_bytes(stats.bytes_needed),
            stats.bytes_read as f64 / stats.bytes_needed.max(1) as f64,
            stats.reads,
            if rep.problems.is_empty() { ", every byte matched" } else { ", MISMATCHES" }
        );
        check.merge(rep);
    }

    if check.problems.is_empty() {
        println!(
            "check: {} tensor regions ({}), {} object shards, {} common values: every byte matched",
            check.regions,
            fmt_bytes(check.bytes),
            check.objects,
            check.values
        );
        if args.dir.is_some() {
            println!("next: tessera inspect {dir} ; tessera verify {dir}");
        }
        Ok(0)
    } else {
        println!("check FAILED: {} problem(s):", check.problems.len());
        for p in check.problems.iter().take(50) {
            println!("  {p}");
        }
        if check.problems.len() > 50 {
            println!("  … and {} more", check.problems.len() - 50);
        }
        Ok(1)
    }
}
