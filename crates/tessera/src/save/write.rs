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

/// Writes bytes `start..end` of `s` (whole blocks, but for the last) and returns their blocks'
/// checksums: in one write, or in cache-sized pieces when `local`.
fn write_direct(writer: &dyn ObjectWriter, s: &Source<'_>, start: u64, end: u64, local: bool) -> Result<Vec<u32>> {
    let bytes = &s.data[start as usize..end as usize];
    if !local {
        let crcs = bytes.chunks(s.block as usize).map(crate::model::crc::crc32c).collect();
        writer.write_at(s.file_off + start, bytes)?;
        return Ok(crcs);
    }
    let mut crcs = Vec::with_capacity(bytes.len().div_ceil(s.block as usize));
    let mut at = s.file_off + start;
    for block in bytes.chunks(s.block as usize) {
        let mut crc = 0;
        for piece in block.chunks(crate::threads::LOCAL_PIECE as usize) {
            crc = crate::model::crc::crc32c_append(crc, piece);
            writer.write_at(at, piece)?;
            at += piece.len() as u64;
        }
        crcs.push(crc);
    }
    Ok(crcs)
}

/// Writes every source and returns, per source, the crc32c of each of its blocks. Into a local
/// file (`local`, see [`Storage::is_local`](crate::storage::Storage::is_local)) from one thread
/// in cache-sized pieces, each checksummed just before it is written; elsewhere from `threads`
/// threads, a block's checksum computed before its unit is written.
pub(crate) fn write_sources(
    writer: &dyn ObjectWriter,
    sources: &[Source<'_>],
    threads: usize,
    local: bool,
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
    // Writes into one local file serialize on the file in the kernel: more threads only wait.
    let workers = if local { 1 } else { threads.clamp(1, units.len().max(1)) };
    let writer_thread = || {
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
                    write_direct(writer, s, *start, *end, local).map(|block_crcs| {
                        let block0 = (start / s.block) as usize;
                        crcs[*src].lock().unwrap()[block0..block0 + block_crcs.len()].copy_from_slice(&block_crcs);
                    })
                }
                Unit::Batch { first, last } => {
                    staging.clear();
                    for (k, s) in sources[*first..=*last].iter().enumerate() {
                        staging.extend_from_slice(s.data);
                        *crcs[first + k].lock().unwrap() =
                            s.data.chunks(s.block as usize).map(crate::model::crc::crc32c).collect();
                    }
                    writer.write_at(sources[*first].file_off, &staging)
                }
            };
            if let Err(e) = r {
                first_error.lock().unwrap().get_or_insert(e);
                return;
            }
        }
    };
    std::thread::scope(|scope| {
        if let Err(e) = crate::threads::spawn_named(scope, "tessera-write", workers, &writer_thread) {
            first_error.lock().unwrap().get_or_insert(crate::error::Error::io("the save's writer threads", e));
        }
    });
    if let Some(e) = first_error.into_inner().unwrap() {
        return Err(e);
    }
    Ok(crcs.into_iter().map(|m| m.into_inner().unwrap()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::{MemoryStorage, Storage};

    #[test]
    fn local_and_remote_writes_give_the_same_bytes_and_checksums() {
        // A large source (units of whole blocks, written in pieces when local, pieces not
        // dividing the blocks) and small ones batched together.
        let big: Vec<u8> = (0..3_000_000u32).map(|i| (i % 253) as u8).collect();
        let small: Vec<u8> = (0..1000u32).map(|i| (i % 7) as u8).collect();
        let block = 300_000;
        let sources = [
            Source { data: &big, file_off: 0, block },
            Source { data: &small, file_off: 3_000_000, block },
            Source { data: &small[..10], file_off: 3_001_000, block },
        ];
        let mut results = Vec::new();
        for local in [false, true] {
            let storage = MemoryStorage::new();
            let w = storage.create("f", 3_001_010).unwrap();
            let crcs = write_sources(w.as_ref(), &sources, 3, local, None).unwrap();
            w.finish().unwrap();
            results.push((storage.read("f").unwrap(), crcs));
        }
        assert_eq!(results[0], results[1]);
        let (bytes, crcs) = &results[1];
        assert_eq!(bytes[..3_000_000], big[..]);
        assert_eq!(bytes[3_000_000..3_001_000], small[..]);
        let want: Vec<u32> = big.chunks(block as usize).map(crate::model::crc::crc32c).collect();
        assert_eq!(crcs[0], want);
        assert_eq!(crcs[2], [crate::model::crc::crc32c(&small[..10])]);
    }
}
