//! OS helpers only the benchmarks use: memory figures from `/proc/self/status` (current and
//! peak RSS, resetting the peak), CPU time, and returning freed heap to the kernel. The helpers
//! the `tessera` command shares (page-cache dropping, IO counters) are in `tessera_synth::system`.

fn status_kib(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status.lines().find_map(|line| {
        let rest = line.strip_prefix(field)?.strip_prefix(':')?;
        let kib = rest.trim().strip_suffix("kB")?.trim();
        kib.parse::<u64>().ok()
    })
}

/// Peak resident set size of this process (VmHWM), in bytes.
pub fn peak_rss() -> Option<u64> {
    status_kib("VmHWM").map(|k| k * 1024)
}

/// Current resident set size (VmRSS), in bytes.
pub fn current_rss() -> Option<u64> {
    status_kib("VmRSS").map(|k| k * 1024)
}

/// CPU seconds (user + system) used so far by all threads of this process, or `None` where
/// `getrusage` fails: next to wall time, a measure of work that another process competing for
/// the cores does not inflate as much.
pub fn cpu_secs() -> Option<f64> {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: `usage` is a valid, writable `rusage`; getrusage writes it whole on success (0),
    // and it is read only then.
    let usage = unsafe { (libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) == 0).then(|| usage.assume_init()) }?;
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    Some(secs(usage.ru_utime) + secs(usage.ru_stime))
}

/// Resets the peak RSS to the current RSS (`5` into `/proc/self/clear_refs`), so the peak of
/// one phase can be measured. Returns false where the kernel does not allow it.
pub fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// Returns freed heap memory to the kernel (glibc keeps it otherwise), so that the RSS of a
/// phase does not include what an earlier phase freed.
pub fn trim_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim takes an integer, touches no memory of ours, and only returns pages
    // the allocator holds free (it is thread-safe: it takes the allocator's locks).
    unsafe {
        libc::malloc_trim(0);
    }
}
