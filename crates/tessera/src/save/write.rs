//! Parallel positioned writes of borrowed buffers into one data file, checksumming on the way.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::error::Result;
use crate::storage::ObjectWriter;

/// Bytes to place at `file_off`, checksummed in blocks of `block` bytes.
pub(crate) struct Source<'a> {
    pub data: &'a [u8],
    pub file_off: u64,
    pub block: u64,
}

/// Largest single write from a caller's buffer.
const PIECE: u64 = 8 << 20;
/// Largest batch of small sources staged together (bounds extra memory per thread).
const BATCH: u64 = 2 << 20;
/// Sources below this size are copied into a batch buffer and written together.
const SMALL: u64 = 256 << 10;

enum Unit {
    /// `[start, end)` bytes of one large source, written straight from the caller's memory.
    Direct { src: usize, start: u64, end: u64 },
    /// Consecutive small sources, staged in one buffer and written at once.
    Batch { first: usize, last: usize },
}

/// Writes every source and returns, per source, the crc32c of each of its blocks.
pub(crate) fn write_sources(
    writer: &dyn ObjectWriter,
    sources: &[Source<'_>],
    threads: usize,
    cancel: Option<&AtomicBool>,
) -> Result<Vec<Vec<u32>>> {
    let mut units = Vec::new();
    let mut i = 0;
    while i < sources.len() {
        let s = &sources[i];
        let len = s.data.len() as u64;
        if len < SMALL {
            let first = i;
            let mut total = len;
            while i + 1 < sources.len()
                && (sources[i + 1].data.len() as u64) < SMALL
                && sources[i + 1].file_off == sources[i].file_off + sources[i].data.len() as u64
                && total + sources[i + 1].data.len() as u64 <= BATCH
            {
                i += 1;
                total += sources[i].data.len() as u64;
            }
            units.push(Unit::Batch { first, last: i });
        } else {
            let step = if s.block >= PIECE { s.block } else { PIECE / s.block * s.block };
            let mut start = 0;
            while start < len {
                let end = (start + step).min(len);
                units.push(Unit::Direct { src: i, start, end });
                start = end;
            }
        }
        i += 1;
    }
    let crcs: Vec<Mutex<Vec<u32>>> =
        sources.iter().map(|s| Mutex::new(vec![0u32; (s.data.len() as u64).div_ceil(s.block) as usize])).collect();
    let next = AtomicUsize::new(0);
    let first_error: Mutex<Option<crate::error::Error>> = Mutex::new(None);
    let workers = threads.clamp(1, units.len().max(1));
    std::thread::scope(|scope| {
        for _ in 0..workers {
            scope.spawn(|| {
                let mut staging: Vec<u8> = Vec::new();
                loop {
                    let u = next.fetch_add(1, Ordering::Relaxed);
                    if u >= units.len() || first_error.lock().unwrap().is_some() {
                        return;
                    }
                    if cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
                        first_error.lock().unwrap().get_or_insert(crate::error::Error::Cancelled);
                        return;
                    }
                    let r = match &units[u] {
                        Unit::Direct { src, start, end } => {
                            let s = &sources[*src];
                            let bytes = &s.data[*start as usize..*end as usize];
                            let block0 = (start / s.block) as usize;
                            let local: Vec<u32> = bytes.chunks(s.block as usize).map(crc32c::crc32c).collect();
                            crcs[*src].lock().unwrap()[block0..block0 + local.len()].copy_from_slice(&local);
                            writer.write_at(s.file_off + start, bytes)
                        }
                        Unit::Batch { first, last } => {
                            staging.clear();
                            for (k, s) in sources[*first..=*last].iter().enumerate() {
                                staging.extend_from_slice(s.data);
                                let local: Vec<u32> = s.data.chunks(s.block as usize).map(crc32c::crc32c).collect();
                                *crcs[first + k].lock().unwrap() = local;
                            }
                            writer.write_at(sources[*first].file_off, &staging)
                        }
                    };
                    if let Err(e) = r {
                        first_error.lock().unwrap().get_or_insert(e);
                        return;
                    }
                }
            });
        }
    });
    if let Some(e) = first_error.into_inner().unwrap() {
        return Err(e);
    }
    Ok(crcs.into_iter().map(|m| m.into_inner().unwrap()).collect())
}
