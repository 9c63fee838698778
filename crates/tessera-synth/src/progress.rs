//! Progress of long work on stderr: a bar redrawn every 100 ms when stderr is a terminal;
//! otherwise (a script, a pipeline, a log) a plain line every 30 s. `--progress SECONDS`
//! ([`set_interval`]) prints plain lines every SECONDS instead, terminal or not, plus one when
//! the work starts and one when it ends; `--progress 0` prints nothing.
//!
//! A background thread reads a counter that workers bump with [`Progress::add`], or — for
//! library calls we cannot instrument (save, load, verify, diff) — this process's read or write
//! byte counters in `/proc/self/io`.

use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::sizes::fmt_bytes;
use crate::system;

/// How progress is shown, from `--progress`.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    /// A bar on a terminal, else a line every [`QUIET_INTERVAL`].
    Auto,
    /// Plain lines at this interval, with a first and a last line.
    Lines(Duration),
    /// Nothing.
    Off,
}

/// Lines' interval when stderr is not a terminal and `--progress` was not given.
const QUIET_INTERVAL: Duration = Duration::from_secs(30);

static MODE: OnceLock<Mode> = OnceLock::new();

/// The `--progress SECONDS` option of the commands (flattened into their clap parsers).
#[derive(clap::Args, Debug, Clone, Copy)]
pub struct ProgressArg {
    /// Progress of long work on stderr: by default a bar on a terminal and otherwise a plain
    /// line every 30 s; with SECONDS, a plain line every SECONDS (terminal or not) and one when
    /// the work starts and ends; 0: none.
    #[arg(long, global = true, value_name = "SECONDS")]
    pub progress: Option<f64>,
}

impl ProgressArg {
    /// Applies the option ([`set_interval`]) when it was given.
    pub fn apply(&self) {
        if let Some(seconds) = self.progress {
            set_interval(seconds);
        }
    }
}

/// `--progress SECONDS`: plain lines every SECONDS (0: no progress at all). Call once, before
/// any progress is shown.
pub fn set_interval(seconds: f64) {
    let mode = if seconds <= 0.0 { Mode::Off } else { Mode::Lines(Duration::from_secs_f64(seconds)) };
    let _ = MODE.set(mode);
}

fn mode() -> Mode {
    *MODE.get_or_init(|| Mode::Auto)
}

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

    fn line(&self) {
        let done = self.current();
        let frac = if self.total == 0 { 1.0 } else { done as f64 / self.total as f64 };
        eprintln!(
            "tessera: {}: {:.0}% ({} / {}), {:.1} s",
            self.label,
            frac * 100.0,
            fmt_bytes(done),
            fmt_bytes(self.total),
            self.start.elapsed().as_secs_f64()
        );
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

/// The progress of one long step; a bar is cleared when finished or dropped.
pub struct Progress {
    shared: Arc<Shared>,
    ticker: Mutex<Option<JoinHandle<()>>>,
    /// How it is shown: a bar (true) or lines.
    bar: bool,
    /// Lines at the start and the end (`--progress SECONDS`).
    ends: bool,
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
        let (bar, every, ends) = match mode() {
            Mode::Off => return Progress { shared, ticker: Mutex::new(None), bar: false, ends: false },
            Mode::Auto if system::stderr_is_tty() => (true, Duration::from_millis(100), false),
            Mode::Auto => (false, QUIET_INTERVAL, false),
            Mode::Lines(every) => (false, every, true),
        };
        if ends {
            shared.line();
        }
        let s = shared.clone();
        let ticker = std::thread::spawn(move || {
            let mut last = Instant::now();
            while !s.stop.load(Ordering::Relaxed) {
                std::thread::sleep(if bar { every } else { every.min(Duration::from_millis(100)) });
                if bar {
                    s.draw();
                } else if last.elapsed() >= every {
                    s.line();
                    last = Instant::now();
                }
            }
        });
        Progress { shared, ticker: Mutex::new(Some(ticker)), bar, ends }
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
            if self.bar {
                let mut err = std::io::stderr().lock();
                let _ = write!(err, "\r\x1b[2K");
                let _ = err.flush();
            } else if self.ends {
                self.shared.line();
            }
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.finish();
    }
}
