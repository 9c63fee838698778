//! Peak RSS of one phase: the kernel's peak (VmHWM) reset at the start where the kernel allows
//! it (`/proc/self/clear_refs`), otherwise VmRSS sampled every millisecond from a thread.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::os;

/// How the peak of a phase was measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// The kernel's VmHWM, reset at the start of the phase.
    Hwm,
    /// VmRSS sampled from a thread (misses peaks shorter than a sample period).
    Sampled,
}

impl Method {
    /// `VmHWM` or `sampled VmRSS`.
    pub fn describe(self) -> &'static str {
        match self {
            Method::Hwm => "VmHWM",
            Method::Sampled => "sampled VmRSS",
        }
    }
}

/// Watches the RSS from [`PeakWatch::start`] to [`PeakWatch::finish`].
pub struct PeakWatch {
    sampler: Option<(Arc<AtomicBool>, JoinHandle<u64>)>,
}

impl PeakWatch {
    /// Starts watching (after giving freed heap memory back to the kernel).
    pub fn start() -> PeakWatch {
        os::trim_heap();
        if os::reset_peak_rss() {
            return PeakWatch { sampler: None };
        }
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut peak = os::current_rss().unwrap_or(0);
            while !flag.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(1));
                peak = peak.max(os::current_rss().unwrap_or(0));
            }
            peak
        });
        PeakWatch { sampler: Some((stop, thread)) }
    }

    /// How this watch measures.
    pub fn method(&self) -> Method {
        if self.sampler.is_some() {
            Method::Sampled
        } else {
            Method::Hwm
        }
    }

    /// The peak RSS since the start, in bytes.
    pub fn finish(self) -> u64 {
        match self.sampler {
            None => os::peak_rss().unwrap_or(0),
            Some((stop, thread)) => {
                stop.store(true, Ordering::Relaxed);
                let sampled = thread.join().unwrap_or(0);
                sampled.max(os::current_rss().unwrap_or(0))
            }
        }
    }
}
