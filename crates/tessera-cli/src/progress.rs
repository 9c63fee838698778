//! A tiny progress bar on stderr, drawn only when stderr is a terminal.
//!
//! A background thread redraws the bar every 100 ms from a counter that workers bump with
//! [`Progress::add`], or — for library calls we cannot instrument (save, load) — from this
//! process's read or write byte counters in `/proc/self/io`.

use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::sizes::fmt_bytes;
use crate::system;

#[derive(Clone, Copy)]
enum Source {
    Counter,
    Reads(u64),
    Writes(u64),
}

struct Shared {
    label: String,
    total: u64,
    done: AtomicU64,
    stop: AtomicBool,
    source: Source,
    start: Instant,
}

impl Shared {
    fn current(&self) -> u64 {
        let io = || system::io_counters().unwrap_or((0, 0));
        let n = match self.source {
            Source::Counter => self.done.load(Ordering::Relaxed),
            Source::Reads(base) => io().0.saturating_sub(base),
            Source::Writes(base) => io().1.saturating_sub(base),
        };
        n.min(self.total)
    }

    fn draw(&self) {
        const WIDTH: usize = 30;
        let done = self.current();
        let frac = if self.total == 0 { 1.0 } else { done as f64 / self.total as f64 };
        let filled = ((frac * WIDTH as f64) as usize).min(WIDTH);
        let bar: String = "#".repeat(filled) + &"-".repeat(WIDTH - filled);
        let mut err = std::io::stderr().lock();
        let _ = write!(
            err,
            "\r\x1b[2K{:<28} [{bar}] {:>3.0}% {} / {}  {:.1}s",
            self.label,
            frac * 100.0,
            fmt_bytes(done),
            fmt_bytes(self.total),
            self.start.elapsed().as_secs_f64()
        );
        let _ = err.flush();
    }
}

/// A progress bar for one long step; cleared when finished or dropped.
pub struct Progress {
    shared: Arc<Shared>,
    ticker: Mutex<Option<JoinHandle<()>>>,
}

impl Progress {
    /// A bar advanced by [`Progress::add`], `total` bytes long.
    pub fn new(label: &str, total: u64) -> Self {
        Self::start(label, total, Source::Counter)
    }

    /// A bar that follows the bytes this process reads from now on.
    pub fn reads(label: &str, total: u64) -> Self {
        let base = system::io_counters().map_or(0, |c| c.0);
        Self::start(label, total, Source::Reads(base))
    }

    /// A bar that follows the bytes this process writes from now on.
    pub fn writes(label: &str, total: u64) -> Self {
        let base = system::io_counters().map_or(0, |c| c.1);
        Self::start(label, total, Source::Writes(base))
    }

    fn start(label: &str, total: u64, source: Source) -> Self {
        let shared = Arc::new(Shared {
            label: label.to_string(),
            total,
            done: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            source,
            start: Instant::now(),
        });
        let ticker = system::stderr_is_tty().then(|| {
            let s = shared.clone();
            std::thread::spawn(move || {
                while !s.stop.load(Ordering::Relaxed) {
                    s.draw();
                    std::thread::sleep(Duration::from_millis(100));
                }
            })
        });
        Progress { shared, ticker: Mutex::new(ticker) }
    }

    /// Counts `n` more bytes done.
    pub fn add(&self, n: u64) {
        self.shared.done.fetch_add(n, Ordering::Relaxed);
    }

    /// Stops and clears the bar (idempotent; also done on drop).
    pub fn finish(&self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        let ticker = self.ticker.lock().map(|mut t| t.take()).unwrap_or(None);
        if let Some(t) = ticker {
            let _ = t.join();
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "\r\x1b[2K");
            let _ = err.flush();
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.finish();
    }
}
