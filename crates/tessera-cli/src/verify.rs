//! `tessera verify DIR`: index, coverage and every checksum.

use std::path::Path;
use std::process::ExitCode;

use anyhow::Result;
use tessera::LocalStorage;

use crate::sizes::fmt_bytes;

/// Runs `tessera verify`: exit 0 if the checkpoint is sound, 1 if anything is wrong or it
/// cannot be opened (not committed, corrupt index, unsupported version).
pub fn run(dir: &Path) -> Result<ExitCode> {
    let storage = LocalStorage::new(dir);
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get()).clamp(2, 8);
    let report = match tessera::verify(&storage, threads) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("tessera verify: {}: {e}", dir.display());
            return Ok(ExitCode::FAILURE);
        }
    };
    if report.problems.is_empty() {
        println!(
            "{}: sound ({} files, {} chunks, {} checksummed)",
            dir.display(),
            report.files,
            report.chunks,
            fmt_bytes(report.bytes_checked)
        );
        Ok(ExitCode::SUCCESS)
    } else {
        println!(
            "{}: CORRUPT: {} problem(s) in {} files, {} chunks ({} checksummed)",
            dir.display(),
            report.problems.len(),
            report.files,
            report.chunks,
            fmt_bytes(report.bytes_checked)
        );
        for p in &report.problems {
            println!("  {p}");
        }
        Ok(ExitCode::FAILURE)
    }
}
