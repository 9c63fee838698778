//! `tessera verify LOCATION`: index, coverage and every checksum.

use std::process::ExitCode;

use anyhow::Result;

use crate::location::Location;
use crate::sizes::fmt_bytes;

/// Runs `tessera verify`: exit 0 if the checkpoint is sound, 1 if anything is wrong or it
/// cannot be opened (not committed, corrupt index, unsupported version).
pub fn run(dir: &Location) -> Result<ExitCode> {
    let storage = match dir.open() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("tessera verify: {e:#}");
            return Ok(ExitCode::FAILURE);
        }
    };
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get()).clamp(2, 8);
    let report = match tessera::verify(storage.as_ref(), threads) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("tessera verify: {dir}: {e}");
            return Ok(ExitCode::FAILURE);
        }
    };
    if report.problems.is_empty() {
        println!(
            "{dir}: sound ({} files, {} chunks, {} {})",
            report.files,
            report.chunks,
            fmt_bytes(report.bytes_checked),
            if report.checksummed { "checksummed" } else { "read and decoded (no checksums in this format)" }
        );
        Ok(ExitCode::SUCCESS)
    } else {
        println!(
            "{dir}: CORRUPT: {} problem(s) in {} files, {} chunks ({} {})",
            report.problems.len(),
            report.files,
            report.chunks,
            fmt_bytes(report.bytes_checked),
            if report.checksummed { "checksummed" } else { "read and decoded (no checksums in this format)" }
        );
        for p in &report.problems {
            println!("  {p}");
        }
        Ok(ExitCode::FAILURE)
    }
}
