//! Building blocks of the whole-checkpoint tools (export, convert, diff): loading parts of
//! stored tensors through the generic loader, grouping them into batches, and a two-stage
//! pipeline (reads on a background thread, writes on the caller's) under a memory budget.

use std::ops::Range;
use std::sync::mpsc;
use std::sync::{Condvar, Mutex};

use crate::comm::SoloComm;
use crate::error::{Error, Result};
use crate::format::{CheckpointIndex, TensorEntry};
use crate::load::engine::{load_opened, LoadOptions};
use crate::model::{ReplicaId, ShardedTensor, StateTree, TensorData};
use crate::plan::geometry::BoxPart;
use crate::storage::Storage;

/// Default memory budget of the tools: bytes of tensor data held at once.
pub const DEFAULT_MEMORY_BUDGET: u64 = 512 << 20;

/// The smallest memory budget a tool takes over `index`: what reading one piece needs, one
/// checksum block (a piece is verified whole-block) and at least one element of its widest
/// dtype. Below it the work would be cut into pieces that never end; it is refused at once,
/// naming this minimum.
pub(crate) fn min_memory_budget(index: &CheckpointIndex) -> u64 {
    let widest = index.tensors.iter().map(|t| t.dtype.size() as u64).max().unwrap_or(1);
    index.block_size.max(widest)
}

/// Refuses `budget` below [`min_memory_budget`] for the checkpoint `index` at `location`.
pub(crate) fn check_memory_budget(budget: u64, index: &CheckpointIndex, location: &str) -> Result<()> {
    let min = min_memory_budget(index);
    if budget < min {
        return Err(Error::invalid(format!(
            "memory budget of {budget} bytes is below the minimum of {min} bytes for {location} (one {} of its \
             data must fit)",
            if index.block_size >= min { "checksum block" } else { "element" }
        )));
    }
    Ok(())
}

/// The most bytes one job of a pipeline should cost, so that about four are in flight at once
/// (one being read, one being written, two queued) within `budget`.
pub(crate) fn job_bytes(budget: u64) -> u64 {
    (budget / 4).max(1)
}

/// A part of a stored tensor to load.
pub(crate) struct TensorPart<'i> {
    pub tensor: &'i TensorEntry,
    pub part: BoxPart,
}

impl TensorPart<'_> {
    pub fn nbytes(&self) -> u64 {
        self.part.numel() * self.tensor.dtype.size() as u64
    }
}

/// Loads `parts` of tensors of `index` (as an opener gave it: validated) through the generic
/// loader, back to back into `buf` (which must hold exactly their bytes), with one load call.
pub(crate) fn load_parts(
    index: &CheckpointIndex,
    storage: &dyn Storage,
    parts: &[&TensorPart<'_>],
    buf: &mut [u8],
    opts: &LoadOptions,
) -> Result<()> {
    let total: u64 = parts.iter().map(|p| p.nbytes()).sum();
    if total != buf.len() as u64 {
        return Err(Error::invalid(format!("{total} bytes of parts for a {}-byte buffer", buf.len())));
    }
    let mut tree = StateTree::map();
    let mut rest = buf;
    for (i, p) in parts.iter().enumerate() {
        let (data, tail) = std::mem::take(&mut rest).split_at_mut(p.nbytes() as usize);
        rest = tail;
        if data.is_empty() {
            continue;
        }
        let t = p.tensor;
        let request = ShardedTensor {
            key: t.key.clone(),
            data: TensorData::Mut(data),
            dtype: t.dtype,
            local_shape: p.part.shape.clone(),
            global_shape: t.global_shape.clone(),
            global_offset: p.part.off.clone(),
            axis_fragmentations: None,
            replica_id: ReplicaId::main(),
            prepend_axis_num: 0,
            allow_shape_mismatch: false,
            flattened_range: p.part.flat.map(|(s, e)| s..e),
        };
        tree.insert(i.to_string(), StateTree::Tensor(request));
    }
    if matches!(&tree, StateTree::Map(m) if m.is_empty()) {
        return Ok(());
    }
    // The bytes land in `buf`; the returned tree (which also carries the common state) is not needed.
    load_opened(index, tree, storage, &SoloComm, opts)?;
    Ok(())
}

/// Cuts `0..costs.len()` into consecutive batches of total cost at most `max` (an item costing
/// more gets a batch of its own); `split_before(i)` forces item `i` to start a new batch.
pub(crate) fn batches(costs: &[u64], max: u64, split_before: impl Fn(usize) -> bool) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut total = 0u64;
    for (i, &c) in costs.iter().enumerate() {
        if i > start && (total + c > max || split_before(i)) {
            out.push(start..i);
            start = i;
            total = 0;
        }
        total += c;
    }
    if start < costs.len() {
        out.push(start..costs.len());
    }
    out
}

/// Bytes in flight: taken before a job is read, given back once it is written.
struct Budget {
    limit: u64,
    state: Mutex<(u64, bool)>,
    cv: Condvar,
}

impl Budget {
    /// Waits until `n` more bytes fit (or nothing is in flight: a job larger than the whole
    /// budget runs alone). False once the pipeline is stopping.
    fn take(&self, n: u64) -> bool {
        let mut s = self.state.lock().unwrap();
        while !s.1 && s.0 > 0 && s.0 + n > self.limit {
            s = self.cv.wait(s).unwrap();
        }
        if s.1 {
            return false;
        }
        s.0 += n;
        true
    }

    fn give(&self, n: u64) {
        self.state.lock().unwrap().0 -= n;
        self.cv.notify_all();
    }

    fn stop(&self) {
        self.state.lock().unwrap().1 = true;
        self.cv.notify_all();
    }
}

/// Groups `items` into consecutive batches of total cost at most `max` (an item costing more
/// gets a batch of its own), lazily: the lazy counterpart of [`batches`], for item streams too
/// long to hold (the parts of a huge tensor under a small budget).
pub(crate) fn batched<I: Iterator>(
    items: I,
    max: u64,
    cost: impl Fn(&I::Item) -> u64,
) -> impl Iterator<Item = Vec<I::Item>> {
    let mut items = items.peekable();
    std::iter::from_fn(move || {
        let first = items.next()?;
        let mut total = cost(&first);
        let mut batch = vec![first];
        while let Some(next) = items.peek() {
            let c = cost(next);
            if total.saturating_add(c) > max {
                break;
            }
            total += c;
            batch.push(items.next().expect("peeked"));
        }
        Some(batch)
    })
}

/// Runs `read` on every job, in order, on a background thread, and `write` on each result, in
/// the same order, on the calling thread: reading the next jobs overlaps with writing earlier
/// ones. At most `budget` bytes (as counted by `cost`) are read and not yet written. The first
/// error of either stage stops both and is returned. Jobs are drawn from `jobs` as they are
/// read, so a long stream of jobs is never held at once.
pub(crate) fn pipeline<J: Send, T: Send>(
    jobs: impl IntoIterator<Item = J, IntoIter: Send>,
    budget: u64,
    cost: impl Fn(&J) -> u64 + Sync,
    read: impl Fn(&J) -> Result<T> + Sync,
    mut write: impl FnMut(&J, T) -> Result<()>,
) -> Result<()> {
    let budget = Budget { limit: budget.max(1), state: Mutex::new((0, false)), cv: Condvar::new() };
    let jobs = jobs.into_iter();
    std::thread::scope(|scope| {
        let (tx, rx) = mpsc::channel::<(J, Result<T>)>();
        let (budget, cost, read) = (&budget, &cost, &read);
        scope.spawn(move || {
            for job in jobs {
                if !budget.take(cost(&job)) {
                    return;
                }
                let r = read(&job);
                let failed = r.is_err();
                if tx.send((job, r)).is_err() || failed {
                    return;
                }
            }
        });
        let r = (|| {
            // Ends when the reader is done with the jobs (and has dropped its sender).
            while let Ok((job, data)) = rx.recv() {
                write(&job, data?)?;
                budget.give(cost(&job));
            }
            Ok(())
        })();
        // Wake a reader waiting for room; once `rx` is dropped its next send fails and it ends.
        budget.stop();
        drop(rx);
        r
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    #[test]
    fn batches_respect_the_limit_and_forced_splits() {
        assert_eq!(batches(&[3, 3, 3, 10, 1, 1], 6, |_| false), vec![0..2, 2..3, 3..4, 4..6]);
        assert_eq!(batches(&[1, 1, 1, 1], 10, |i| i == 2), vec![0..2, 2..4]);
        assert!(batches(&[], 10, |_| false).is_empty());
    }

    #[test]
    fn pipeline_keeps_order_and_the_budget() {
        let jobs: Vec<u64> = (0..50).map(|i| 1 + i % 7).collect();
        let in_flight = AtomicU64::new(0);
        let peak = AtomicU64::new(0);
        let mut seen = Vec::new();
        pipeline(
            jobs.iter().copied(),
            10,
            |&c| c,
            |&c| {
                let now = in_flight.fetch_add(c, Ordering::SeqCst) + c;
                peak.fetch_max(now, Ordering::SeqCst);
                Ok(c)
            },
            |_, c| {
                std::thread::sleep(std::time::Duration::from_micros(200));
                in_flight.fetch_sub(c, Ordering::SeqCst);
                seen.push(c);
                Ok(())
            },
        )
        .unwrap();
        assert_eq!(seen, jobs);
        assert!(peak.load(Ordering::SeqCst) <= 10, "peak {}", peak.load(Ordering::SeqCst));
    }

    #[test]
    fn pipeline_stops_at_the_first_error_of_either_stage() {
        let jobs: Vec<u64> = (0..100).collect();
        let read_fails = pipeline(
            jobs.iter().copied(),
            1000,
            |_| 1,
            |&j| if j == 5 { Err(Error::invalid("read 5")) } else { Ok(j) },
            |_, _| Ok(()),
        );
        assert!(matches!(read_fails, Err(Error::InvalidArgument { reason }) if reason == "read 5"));
        let mut written = 0;
        let write_fails = pipeline(
            jobs.iter().copied(),
            3,
            |_| 1,
            |&j| Ok(j),
            |&j, _| {
                written += 1;
                if j == 7 {
                    Err(Error::invalid("write 7"))
                } else {
                    Ok(())
                }
            },
        );
        assert!(matches!(write_fails, Err(Error::InvalidArgument { reason }) if reason == "write 7"));
        assert_eq!(written, 8);
    }
}
