//! `tessera unshard SRC --out PATH`: the tensors of a checkpoint (any readable format) as plain
//! Hugging Face safetensors, one file or shards with `model.safetensors.index.json`.

use std::path::PathBuf;

use anyhow::{Context, Result};
use tessera::tools::ExportOptions;
use tessera::DType;
use tessera_synth::progress::Progress;
use tessera_synth::sizes::fmt_bytes;

use crate::location::Location;

/// What to export and how.
pub struct UnshardArgs {
    pub src: Location,
    pub out: PathBuf,
    pub max_shard_size: Option<u64>,
    pub keys: Option<String>,
    pub dtype: Option<DType>,
    /// Key prefix renames, `(from, to)` ([`ExportOptions::rename`]).
    pub rename: Vec<(String, String)>,
    pub memory: u64,
}

/// Runs `tessera unshard`.
pub fn run(args: UnshardArgs) -> Result<()> {
    let storage = args.src.open()?;
    let keys = match &args.keys {
        None => None,
        Some(pattern) => {
            let index = tessera::open(storage.as_ref())
                .map(tessera::Checkpoint::into_index)
                .with_context(|| format!("opening {}", args.src))?;
            let what = format!("the tensors of {}", args.src);
            Some(crate::keys::select(pattern, index.tensors.iter().map(|t| t.key.as_str()), &what)?)
        }
    };
    let opts = ExportOptions {
        keys,
        dtype: args.dtype,
        max_shard_size: args.max_shard_size,
        memory_budget: args.memory,
        rename: args.rename,
        ..Default::default()
    };
    let mut bar: Option<Progress> = None;
    let mut shown = 0;
    let report = tessera::tools::export_safetensors(storage.as_ref(), &args.out, &opts, &mut |done, total| {
        let bar = bar.get_or_insert_with(|| Progress::new("unshard", total));
        bar.add(done - shown);
        shown = done;
    })
    .with_context(|| format!("exporting {} to {}", args.src, args.out.display()))?;
    if let Some(b) = &bar {
        b.finish();
    }
    println!(
        "{} -> {}: {} tensors, {} in {} file(s)",
        args.src,
        args.out.display(),
        report.tensors,
        fmt_bytes(report.bytes),
        report.files.len()
    );
    for f in report.files.iter().chain(&report.index) {
        println!("  {}", f.display());
    }
    for f in &report.leftovers {
        eprintln!("warning: the export is complete, but its temporary file {} could not be removed", f.display());
    }
    Ok(())
}
