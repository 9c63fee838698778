//! The thread helpers of the engines (`save/`, `load/`, `tools/`): a leaf every layer that
//! starts threads uses, so that none of them imports another for its threads. `plan/` and
//! `formats/` never start threads: they take a `ForEach` built from these.

use std::sync::atomic::{AtomicUsize, Ordering};

/// Calls `work(i)` for every `i` in `0..n`, from up to `threads` threads (each takes the next
/// index as it finishes one): per-file IO whose latency, not bandwidth, bounds it.
pub(crate) fn parallel_for(n: usize, threads: usize, work: impl Fn(usize) + Sync) {
    let next = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for _ in 0..threads.clamp(1, n.max(1)) {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    return;
                }
                work(i);
            });
        }
    });
}

/// Starts `n` threads named `name` in `scope`, each running `worker` (which takes its work from
/// a shared queue, so the threads that start do the work of any that cannot). Fails only when
/// not one thread could start: then nothing would run and the caller must not report success.
/// Named, so that a profile or a debugger tells the engine's threads apart.
pub(crate) fn spawn_named<'scope, F: Fn() + Sync>(
    scope: &'scope std::thread::Scope<'scope, '_>,
    name: &str,
    n: usize,
    worker: &'scope F,
) -> std::io::Result<()> {
    let mut last_error = None;
    let mut started = 0usize;
    for _ in 0..n.max(1) {
        match std::thread::Builder::new().name(name.into()).spawn_scoped(scope, worker) {
            Ok(_) => started += 1,
            Err(e) => last_error = Some(e),
        }
    }
    match (started, last_error) {
        (0, Some(e)) => Err(e),
        _ => Ok(()),
    }
}

/// Runs `work(i)` for every `i` in `0..n` on one thread per core (on the calling thread when
/// there is one part or one core): how CPU-bound parts of plan and format functions (decoding
/// an index or the save plans, validating the plans) run from `load/` and `save/`.
pub(crate) fn on_cores(n: usize, work: &(dyn Fn(usize) + Sync)) {
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    if n <= 1 || cores == 1 {
        (0..n).for_each(work);
    } else {
        parallel_for(n, cores, work);
    }
}

/// Reading or writing threads of a rank when the caller does not say: IO latency, not cores,
/// bounds them, so twice the cores, between 2 and 8.
pub(crate) fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(4, |n| (n.get() * 2).clamp(2, 8))
}

/// Bytes moved at once between a local file ([`Storage::is_local`](crate::storage::Storage::is_local))
/// and memory when they are also checksummed: a quarter of a core's L2 cache on current x86 and
/// ARM server parts, so that a piece is still cached when the checksum (or the copy) reads it
/// again, instead of crossing memory once more.
pub(crate) const LOCAL_PIECE: u64 = 256 << 10;
