//! `tessera convert SRC DST`: any readable checkpoint into the native format, same chunks.

use anyhow::{Context, Result};
use tessera::ConvertOptions;

use crate::location::Location;
use crate::progress::Progress;
use crate::sizes::fmt_bytes;

/// Runs `tessera convert`.
pub fn run(src: &Location, dst: &Location, overwrite: bool, memory: u64) -> Result<()> {
    let from = src.open()?;
    dst.create()?;
    let to = dst.open()?;
    let opts = ConvertOptions { overwrite, memory_budget: memory, ..Default::default() };
    let mut bar: Option<Progress> = None;
    let mut shown = 0;
    let report = tessera::convert(from.as_ref(), to.as_ref(), &opts, &mut |done, total| {
        let bar = bar.get_or_insert_with(|| Progress::new("convert", total));
        bar.add(done - shown);
        shown = done;
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
    Ok(())
}
