//! Executes a [`ReadPlan`]: parallel ranged reads, checksum verification, scatter into the
//! caller's buffers.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::format::CheckpointIndex;
use crate::plan::load::ReadPlan;
use crate::storage::Storage;
use crate::{Error, Result};

/// A caller's buffer, written from several threads at disjoint places.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Target {
    pub ptr: *mut u8,
    pub len: usize,
}

// SAFETY: targets point into buffers exclusively borrowed by the load for its whole duration;
// the plan writes disjoint regions of them (stored chunks never overlap), each bounds-checked.
unsafe impl Send for Target {}
unsafe impl Sync for Target {}

impl Target {
    pub fn new(buf: &mut [u8]) -> Self {
        Target { ptr: buf.as_mut_ptr(), len: buf.len() }
    }

    /// # Safety
    /// No other live reference may cover `[off, off + len)`.
    unsafe fn slice<'t>(self, off: u64, len: u64) -> Result<&'t mut [u8]> {
        let end = off.checked_add(len).filter(|&e| e <= self.len as u64);
        if end.is_none() {
            return Err(Error::invalid(format!("copy of {len} bytes at {off} past a {}-byte buffer", self.len)));
        }
        Ok(std::slice::from_raw_parts_mut(self.ptr.add(off as usize), len as usize))
    }
}

/// Runs every read of `plan` with `threads` workers.
pub(crate) fn execute(
    storage: &dyn Storage,
    index: &CheckpointIndex,
    plan: &ReadPlan,
    targets: &[Target],
    threads: usize,
    cancel: Option<&AtomicBool>,
) -> Result<()> {
    let next = AtomicUsize::new(0);
    let first_error: Mutex<Option<Error>> = Mutex::new(None);
    let workers = threads.clamp(1, plan.spans.len().max(1));
    let path_of =
        |file: u32| -> PathBuf { format!("{}/{}", storage.location(), index.files[file as usize].name).into() };
    std::thread::scope(|scope| {
        for _ in 0..workers {
            scope.spawn(|| {
                let mut scratch: Vec<u8> = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= plan.spans.len() || first_error.lock().unwrap().is_some() {
                        return;
                    }
                    if cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
                        first_error.lock().unwrap().get_or_insert(Error::Cancelled);
                        return;
                    }
                    let sp = &plan.spans[i];
                    let name = &index.files[sp.file as usize].name;
                    let r = (|| -> Result<()> {
                        let segs = &plan.segs[sp.segs.clone()];
                        let buf: &mut [u8] = if sp.direct {
                            let s = &segs[0];
                            // SAFETY: segments of a plan write disjoint target regions.
                            unsafe { targets[s.target].slice(s.dst_off, s.len)? }
                        } else {
                            scratch.resize(sp.len as usize, 0);
                            &mut scratch[..]
                        };
                        storage.read_at(name, sp.off, buf)?;
                        for b in &plan.blocks[sp.blocks.clone()] {
                            let at = (b.file_off - sp.off) as usize;
                            let got = crc32c::crc32c(&buf[at..at + b.len as usize]);
                            if got != b.crc {
                                return Err(Error::corrupt(
                                    path_of(sp.file),
                                    format!(
                                        "checksum mismatch in {:?} at bytes {}..{} (stored {:08x}, read {got:08x})",
                                        index.tensors[b.tensor as usize].key,
                                        b.file_off,
                                        b.file_off + b.len,
                                        b.crc
                                    ),
                                ));
                            }
                        }
                        if !sp.direct {
                            for s in segs {
                                let at = (s.file_off - sp.off) as usize;
                                // SAFETY: as above.
                                let dst = unsafe { targets[s.target].slice(s.dst_off, s.len)? };
                                dst.copy_from_slice(&scratch[at..at + s.len as usize]);
                            }
                        }
                        Ok(())
                    })();
                    if let Err(e) = r {
                        first_error.lock().unwrap().get_or_insert(e);
                        return;
                    }
                }
            });
        }
    });
    match first_error.into_inner().unwrap() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Bytes of a safetensors header read at once when checking it.
const HEADER_PIECE: u64 = 1 << 20;

/// Checks the safetensors header of each file in `files` against the index; returns bytes read.
pub(crate) fn verify_headers(storage: &dyn Storage, index: &CheckpointIndex, files: &[u32]) -> Result<u64> {
    let mut total = 0;
    let mut buf = Vec::new();
    for &fi in files {
        let f = &index.files[fi as usize];
        // In pieces: `header_len` is what the index claims, and memory must not follow a claim
        // (a header past the file's real end fails at the first piece read beyond it).
        let mut crc = 0u32;
        let mut at = 0u64;
        while at < f.header_len {
            let n = (f.header_len - at).min(HEADER_PIECE);
            buf.resize(n as usize, 0);
            storage.read_at(&f.name, at, &mut buf)?;
            crc = crc32c::crc32c_append(crc, &buf);
            at += n;
        }
        total += f.header_len;
        if crc != f.header_crc {
            return Err(Error::corrupt(
                format!("{}/{}", storage.location(), f.name),
                "checksum mismatch in the safetensors header",
            ));
        }
    }
    Ok(total)
}
