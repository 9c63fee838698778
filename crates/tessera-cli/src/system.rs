//! Small OS helpers: terminal detection, memory figures from `/proc`, page-cache dropping.

use std::fs::File;
use std::os::unix::io::AsRawFd;
use std::path::Path;

use anyhow::{Context, Result};

/// True when stderr is a terminal (progress bars are drawn only then).
pub fn stderr_is_tty() -> bool {
    use std::io::IsTerminal;
    std::io::stderr().is_terminal()
}

/// Restores the default SIGPIPE action, so `tessera inspect DIR | head` ends quietly instead
/// of panicking on a closed stdout.
pub fn default_sigpipe() {
    // SAFETY: SIG_DFL installs no handler of ours (nothing can run in signal context), and
    // `signal` takes no pointers into our memory; the previous disposition is not needed.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

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

/// Bytes this process has read and written through syscalls so far (`rchar`, `wchar` of
/// `/proc/self/io`); used to show progress of a save or load we cannot instrument.
pub fn io_counters() -> Option<(u64, u64)> {
    let io = std::fs::read_to_string("/proc/self/io").ok()?;
    let get = |name: &str| io.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(':')?.trim().parse::<u64>().ok());
    Some((get("rchar")?, get("wchar")?))
}

/// Flushes `file` to disk and asks the kernel to drop its pages from the page cache, so the
/// next read comes from the device.
pub fn drop_file_cache(file: &File) -> std::io::Result<()> {
    file.sync_all()?;
    // SAFETY: integer arguments only; the descriptor is open for as long as `file` is borrowed,
    // and fadvise reads or writes none of our memory.
    let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if rc != 0 {
        return Err(std::io::Error::from_raw_os_error(rc));
    }
    Ok(())
}

/// [`drop_file_cache`] for every regular file in `dir`.
pub fn drop_dir_cache(dir: &Path) -> Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let entry = entry?;
        if entry.file_type()?.is_file() {
            let path = entry.path();
            let f = File::open(&path).with_context(|| format!("opening {}", path.display()))?;
            drop_file_cache(&f).with_context(|| format!("dropping {} from the page cache", path.display()))?;
        }
    }
    Ok(())
}
