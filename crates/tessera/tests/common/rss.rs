//! Peak memory of one piece of work: the test re-runs itself, alone, in a child process that
//! does only that work and then reports its own peak resident set size (`VmHWM` of
//! `/proc/self/status`). In-process numbers would include every other test of the binary
//! running beside it; and the child's `ru_maxrss` (from `wait4`) would not do either: Linux
//! counts in it the parent's peak, whose memory the child ran in until it called `exec`.

use std::ffi::OsStr;
use std::process::Stdio;

/// The line a child prints its peak RSS on (in bytes).
const MARK: &str = "TESSERA_TEST_PEAK_RSS=";

/// Runs the test `test` of the current test binary alone (`--exact`; ignored or not) in a child
/// process with the variables `env` set; checks that it passed and returns the peak RSS it
/// reported with [`report_peak_rss`], in bytes.
pub fn child_peak_rss(test: &str, env: &[(&str, &OsStr)]) -> u64 {
    let mut cmd = super::rerun_alone(test);
    cmd.stdin(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the child running {test} failed ({}): {stdout}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout.lines().find_map(|l| l.split_once(MARK)).map(|(_, n)| n.trim().to_string());
    line.and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("the child running {test} reported no peak RSS: {stdout}"))
}

/// In the child: prints this process's peak RSS so far for [`child_peak_rss`].
pub fn report_peak_rss() {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in /proc/self/status");
    println!("{MARK}{}", kib * 1024);
}

/// The bound on the memory a reader may take for an input of `input_bytes` (SECURITY.md):
/// 2 × the input + 64 MiB.
pub fn rss_bound(input_bytes: u64) -> u64 {
    2 * input_bytes + (64 << 20)
}
