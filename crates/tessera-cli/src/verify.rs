//! `tessera verify LOCATION`: index, coverage and every checksum.

use anyhow::Result;
use serde_json::json;
use tessera_synth::progress::Progress;
use tessera_synth::sizes::fmt_bytes;

use crate::location::Location;

/// Runs `tessera verify`: exit 0 if the checkpoint is sound, 1 if anything is wrong or it
/// cannot be opened (not committed, corrupt index, unsupported version). Leftover files of
/// other saves are listed but are not a defect.
pub fn run(dir: &Location, json: bool) -> Result<u8> {
    let fail = |e: anyhow::Error| {
        // The library's errors name the location as opened (a URL unredacted), not as shown.
        let opened = dir.url().map_or_else(|| dir.to_string(), str::to_string);
        let message = crate::location::explain_missing(&e, &[opened]).unwrap_or_else(|| format!("{e:#}"));
        if json {
            println!("{}", json!({ "location": dir.to_string(), "sound": false, "error": message }));
        } else {
            eprintln!("tessera verify: {message}");
        }
        Ok(1)
    };
    let storage = match dir.open() {
        Ok(s) => s,
        Err(e) => return fail(e.into()),
    };
    // What verify reads, for its progress: every chunk's bytes (an index that does not open
    // is verify's to report).
    let total = tessera::open(storage.as_ref())
        .map(tessera::Checkpoint::into_index)
        .map(|i| {
            i.tensors.iter().map(|t| t.chunks().iter().map(|c| c.numel()).sum::<u64>() * t.dtype.size() as u64).sum()
        })
        .unwrap_or(0);
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get()).clamp(2, 8);
    let bar = Progress::reads("verify", total);
    let report = tessera::tools::verify(storage.as_ref(), threads);
    bar.finish();
    let report = match report {
        Ok(r) => r,
        Err(e) => return fail(anyhow::Error::new(e).context(dir.to_string())),
    };
    let sound = report.problems.is_empty();
    let how = if report.checksummed {
        "checksummed".to_string()
    } else {
        "read and decoded (no block checksums in this format; zip CRC-32s checked where it has them)".to_string()
    };
    let how = match report.integrity_checked {
        0 => how,
        n => format!("{how}; {n} file(s) checked against integrity.json"),
    };
    if json {
        println!(
            "{}",
            json!({
                "location": dir.to_string(),
                "sound": sound,
                "files": report.files,
                "chunks": report.chunks,
                "bytes_checked": report.bytes_checked,
                "checksummed": report.checksummed,
                "integrity_checked": report.integrity_checked,
                "problems": report.problems,
                "leftovers": report.leftovers,
            })
        );
    } else {
        let (files, chunks, bytes) = (report.files, report.chunks, fmt_bytes(report.bytes_checked));
        if sound {
            println!("{dir}: sound ({files} files, {chunks} chunks, {bytes} {how})");
        } else {
            let n = report.problems.len();
            println!("{dir}: CORRUPT: {n} problem(s) in {files} files, {chunks} chunks ({bytes} {how})");
            for p in &report.problems {
                println!("  {p}");
            }
        }
        if !report.leftovers.is_empty() {
            println!(
                "{} leftover file(s) of failed or replaced saves, not used by the checkpoint (run `tessera gc {dir}`):",
                report.leftovers.len()
            );
            for name in &report.leftovers {
                println!("  {name}");
            }
        }
    }
    Ok(if sound { 0 } else { 1 })
}
