//! `tessera convert SRC DST [--to native|dcp]`: any readable checkpoint into the native format
//! (same chunks), or into a Megatron torch_dist / PyTorch DCP directory.

use anyhow::{Context, Result};
use tessera::tools::ConvertOptions;

use crate::location::Location;
use crate::progress::Progress;
use crate::sizes::fmt_bytes;

/// The format `tessera convert` writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// tessera's own.
    Native,
    /// Megatron `torch_dist` (PyTorch DCP plus `metadata.json` and `common.pt`).
    Dcp,
}

/// Runs `tessera convert`.
pub fn run(src: &Location, dst: &Location, to: Target, overwrite: bool, memory: u64) -> Result<()> {
    let from = src.open()?;
    crate::location::create(dst)?;
    let dst_storage = dst.open()?;
    let opts = ConvertOptions { overwrite, memory_budget: memory, ..Default::default() };
    let mut bar: Option<Progress> = None;
    let mut shown = 0;
    let mut progress = |done: u64, total: u64| {
        let bar = bar.get_or_insert_with(|| Progress::new("convert", total));
        bar.add(done - shown);
        shown = done;
    };
    let report = match to {
        Target::Native => tessera::tools::convert(from.as_ref(), dst_storage.as_ref(), &opts, &mut progress),
        Target::Dcp => tessera::tools::convert_to_dcp(from.as_ref(), dst_storage.as_ref(), &opts, &mut progress),
    }
    .map_err(|e| match e {
        // The library's error says "pass overwrite" (its option); here that is the flag.
        tessera::Error::AlreadyExists { path } => anyhow::anyhow!(
            "a committed checkpoint already exists at {}: pass --overwrite to replace it",
            path.display()
        ),
        other => other.into(),
    })
    .with_context(|| format!("converting {src} to {dst}"))?;
    if let Some(b) = &bar {
        b.finish();
    }
    println!(
        "{src} -> {dst}: {} tensors in {} chunks, {} object shard(s), {} in {} data file(s), index {}",
        report.tensors,
        report.chunks,
        report.object_shards,
        fmt_bytes(report.bytes),
        report.files,
        fmt_bytes(report.index_bytes)
    );
    if !report.leftovers.is_empty() {
        eprintln!(
            "warning: committed; clean-up incomplete: {} left for `tessera gc {dst}`: {}",
            report.leftovers.len(),
            report.leftovers.join(", ")
        );
    }
    Ok(())
}
