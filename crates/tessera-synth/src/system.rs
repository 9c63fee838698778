//! The OS helpers the `tessera` command and the benchmarks share: terminal detection, the
//! default SIGPIPE action, this process's IO counters (for [`crate::progress`]) and dropping a
//! checkpoint's files from the page cache (so that a timed load reads from the device).

use std::fs::File;
use std::os::unix::io::AsRawFd;
use std::path::Path;

use anyhow::{Context, Result};

/// True when stderr is a terminal (progress bars are drawn only then).
pub fn stderr_is_tty() -> bool {
    use std::io::IsTerminal;
    std::io::stderr().is_terminal()
}

/// Restores the default SIGPIPE action, so `tessera inspect DIR | head` (or `tessera-bench …
/// | head`) ends quietly instead of panicking on a closed stdout.
pub fn default_sigpipe() {
    // SAFETY: SIG_DFL installs no handler of ours (nothing can run in signal context), and
    // `signal` takes no pointers into our memory; the previous disposition is not needed.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
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
fn drop_file_cache(file: &File) -> std::io::Result<()> {
    file.sync_all()?;
    // SAFETY: integer arguments only; the descriptor is open for as long as `file` is borrowed,
    // and fadvise reads or writes none of our memory.
    let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if rc != 0 {
        return Err(std::io::Error::from_raw_os_error(rc));
    }
    Ok(())
}

/// Flushes every regular file in `dir` to disk and asks the kernel to drop its pages from the
/// page cache, so the next read comes from the device.
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
