//! A bounded pool of reusable, pre-faulted host buffers for staging async saves.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use crate::error::{Error, Result};

/// Host memory for async saves: `budget / buffer_size` buffers allocated and touched once at
/// creation, then reused by every save. Staging takes buffers and the background writers give
/// them back, so a state larger than the budget is staged in waves and host memory never grows
/// past the budget. Fresh pages cost a page fault each on first touch (several times slower
/// than a memcpy), which is why the buffers are faulted in up front and kept.
#[derive(Debug)]
pub struct StagingPool {
    buffer_size: usize,
    count: usize,
    free: Mutex<Vec<Box<[u8]>>>,
    returned: Condvar,
    in_use: AtomicUsize,
    peak_in_use: AtomicUsize,
}

impl StagingPool {
    /// The size of one buffer of a pool made by [`StagingPool::new`] (8 MiB).
    pub const DEFAULT_BUFFER_SIZE: usize = 8 << 20;

    /// A pool of `budget` bytes in buffers of [`StagingPool::DEFAULT_BUFFER_SIZE`] (one smaller buffer
    /// if the budget is below that).
    pub fn new(budget: u64) -> Result<Arc<StagingPool>> {
        let size = (budget as usize).min(Self::DEFAULT_BUFFER_SIZE);
        Self::with_buffer_size(budget, size)
    }

    /// A pool of `budget / buffer_size` buffers of `buffer_size` bytes (at least one).
    pub fn with_buffer_size(budget: u64, buffer_size: usize) -> Result<Arc<StagingPool>> {
        if buffer_size == 0 {
            return Err(Error::invalid("staging buffers must not be empty"));
        }
        let count = ((budget / buffer_size as u64) as usize).max(1);
        let free = (0..count)
            .map(|_| {
                let mut b = vec![0u8; buffer_size].into_boxed_slice();
                // A zeroed allocation is mapped lazily: touch every page now, not during a save.
                // Every 4 KiB, the smallest page there is: with larger pages some writes hit a
                // page already touched, which costs nothing worth a page-size query.
                for x in b.iter_mut().step_by(TOUCH_STRIDE) {
                    // A plain store of 0 into memory known to be zeroed (calloc) may be optimized
                    // away; a volatile one is not.
                    // SAFETY: `x` is a `&mut u8`: valid, aligned and exclusive for the write.
                    unsafe { std::ptr::write_volatile(x, 0) };
                }
                b
            })
            .collect();
        Ok(Arc::new(StagingPool {
            buffer_size,
            count,
            free: Mutex::new(free),
            returned: Condvar::new(),
            in_use: AtomicUsize::new(0),
            peak_in_use: AtomicUsize::new(0),
        }))
    }

    /// Size of each buffer.
    pub fn buffer_size(&self) -> usize {
        self.buffer_size
    }

    /// Bytes the pool holds (all buffers).
    pub fn capacity(&self) -> u64 {
        (self.count * self.buffer_size) as u64
    }

    /// Most bytes ever lent out at once.
    pub fn peak_bytes_in_use(&self) -> u64 {
        (self.peak_in_use.load(Ordering::Relaxed) * self.buffer_size) as u64
    }

    /// A free buffer, if there is one now.
    pub(crate) fn try_take(self: &Arc<Self>) -> Option<PoolBuffer> {
        let buf = self.free.lock().unwrap().pop()?;
        let n = self.in_use.fetch_add(1, Ordering::Relaxed) + 1;
        self.peak_in_use.fetch_max(n, Ordering::Relaxed);
        Some(PoolBuffer { buf: Some(buf), pool: self.clone() })
    }

    /// Waits for a free buffer. Gives up (`None`) once `stop` is set.
    pub(crate) fn take(self: &Arc<Self>, stop: &AtomicBool) -> Option<PoolBuffer> {
        let mut free = self.free.lock().unwrap();
        loop {
            if stop.load(Ordering::Relaxed) {
                return None;
            }
            if let Some(buf) = free.pop() {
                let n = self.in_use.fetch_add(1, Ordering::Relaxed) + 1;
                self.peak_in_use.fetch_max(n, Ordering::Relaxed);
                return Some(PoolBuffer { buf: Some(buf), pool: self.clone() });
            }
            // Woken by every returned buffer; the timeout only bounds how late `stop` is seen.
            free = self.returned.wait_timeout(free, Duration::from_millis(50)).unwrap().0;
        }
    }
}

/// Stride of the pre-faulting writes: the smallest page size of the platforms tessera runs on.
const TOUCH_STRIDE: usize = 4096;

/// A buffer lent by a [`StagingPool`]; goes back to the pool when dropped.
#[derive(Debug)]
pub(crate) struct PoolBuffer {
    buf: Option<Box<[u8]>>,
    pool: Arc<StagingPool>,
}

impl std::ops::Deref for PoolBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.buf.as_deref().expect("present until drop")
    }
}

impl std::ops::DerefMut for PoolBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.buf.as_deref_mut().expect("present until drop")
    }
}

impl Drop for PoolBuffer {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.pool.in_use.fetch_sub(1, Ordering::Relaxed);
            self.pool.free.lock().unwrap().push(b);
            self.pool.returned.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_lent_returned_and_bounded() {
        let pool = StagingPool::with_buffer_size(3 * 4096 + 100, 4096).unwrap();
        assert_eq!(pool.capacity(), 3 * 4096);
        let stop = AtomicBool::new(false);
        let a = pool.take(&stop).unwrap();
        let b = pool.take(&stop).unwrap();
        let c = pool.take(&stop).unwrap();
        assert_eq!(pool.peak_bytes_in_use(), 3 * 4096);
        // The pool is empty: a fourth take waits until a buffer comes back.
        std::thread::scope(|s| {
            let waiter = s.spawn(|| pool.take(&stop).map(|b| b.len()));
            std::thread::sleep(Duration::from_millis(20));
            drop(b);
            assert_eq!(waiter.join().unwrap(), Some(4096));
        });
        drop((a, c));
        assert_eq!(pool.peak_bytes_in_use(), 3 * 4096);
        // A stop request ends a wait on an empty pool.
        let held: Vec<_> = (0..3).map(|_| pool.take(&stop).unwrap()).collect();
        stop.store(true, Ordering::Relaxed);
        assert!(pool.take(&stop).is_none());
        drop(held);
    }
}
