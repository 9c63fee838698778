//! Loading: one opener (location → detected format → index → validation → checkpoint), the
//! load engine (plans from `plan/`, reads through `storage/`, decoding and casts into the
//! caller's memory), ranged reads of the native index, and the exchange of reads shared
//! between ranks. Reading threads start here.

pub(crate) mod engine;
pub(crate) mod index_read;
pub(crate) mod open;
pub(crate) mod read;

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
