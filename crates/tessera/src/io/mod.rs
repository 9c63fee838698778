//! Everything that moves bytes: save and load orchestration, parallel reads and writes,
//! the strategy registry, verification, and the whole-checkpoint tools (export to plain
//! safetensors, conversion to the native format, diff). Plans come from `plan/`; bytes go
//! through `storage/`.

pub(crate) mod async_save;
pub(crate) mod convert;
pub(crate) mod convert_dcp;
pub(crate) mod diff;
pub(crate) mod export;
pub(crate) mod factories;
pub(crate) mod foreign;
pub(crate) mod index_read;
pub(crate) mod load;
pub(crate) mod maintenance;
pub(crate) mod outfile;
pub(crate) mod pipeline;
pub(crate) mod read;
pub(crate) mod save;
pub(crate) mod staging;
pub(crate) mod strategy;
pub(crate) mod verify;
pub(crate) mod write;

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
