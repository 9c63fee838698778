//! Byte sizes: parsing `1GiB` / `512MB` / `4096` and printing them back for humans.

use anyhow::{bail, Result};

/// Parses a size such as `1GiB`, `64MiB`, `512MB`, `1.5G` or `4096`.
///
/// `KiB`/`MiB`/`GiB`/`TiB` (and the bare `K`/`M`/`G`/`T`) are powers of 1024; `KB`/`MB`/`GB`/`TB`
/// are powers of 1000. Case does not matter; spaces between number and unit are allowed.
pub fn parse_size(text: &str) -> Result<u64> {
    let s = text.trim();
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    if number.is_empty() {
        bail!("size {text:?} does not start with a number (examples: 64MiB, 1GiB, 512MB)");
    }
    let value: f64 = number.parse().map_err(|_| anyhow::anyhow!("size {text:?}: {number:?} is not a number"))?;
    let multiplier: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        other => bail!("size {text:?}: unknown unit {other:?} (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)"),
    };
    let bytes = value * multiplier as f64;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        bail!("size {text:?} is too large");
    }
    Ok(bytes.round() as u64)
}

/// `1.00 GiB`, `512.0 KiB`, `17 B`.
pub fn fmt_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut value = n as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if value >= 100.0 {
        format!("{value:.1} {}", UNITS[unit])
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

/// Throughput in decimal gigabytes per second (`1.23 GB/s`).
pub fn fmt_rate(bytes: u64, secs: f64) -> String {
    format!("{:.2} GB/s", gbps(bytes, secs))
}

/// Decimal gigabytes per second.
pub fn gbps(bytes: u64, secs: f64) -> f64 {
    if secs <= 0.0 {
        return 0.0;
    }
    bytes as f64 / secs / 1e9
}

/// A duration in seconds for humans: `812 ms`, `3.41 s`, `42 µs`.
pub fn fmt_secs(secs: f64) -> String {
    if secs < 1e-3 {
        format!("{:.0} µs", secs * 1e6)
    } else if secs < 1.0 {
        format!("{:.0} ms", secs * 1e3)
    } else {
        format!("{secs:.2} s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_binary_and_decimal_units() {
        assert_eq!(parse_size("1GiB").unwrap(), 1 << 30);
        assert_eq!(parse_size("64MiB").unwrap(), 64 << 20);
        assert_eq!(parse_size("512MB").unwrap(), 512_000_000);
        assert_eq!(parse_size("8m").unwrap(), 8 << 20);
        assert_eq!(parse_size("1.5 GiB").unwrap(), 3 << 29);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("10b").unwrap(), 10);
        assert!(parse_size("GiB").is_err());
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("").is_err());
    }

    #[test]
    fn formats_bytes() {
        assert_eq!(fmt_bytes(17), "17 B");
        assert_eq!(fmt_bytes(1 << 30), "1.00 GiB");
        assert_eq!(fmt_bytes(1536), "1.50 KiB");
        assert_eq!(fmt_bytes(300 << 20), "300.0 MiB");
    }
}
