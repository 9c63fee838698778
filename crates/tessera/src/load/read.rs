//! Executes a [`ReadPlan`]: parallel ranged reads, checksum verification, scatter into the
//! caller's buffers.

// No `unsafe` here: the read engine writes caller buffers from several threads, and that no two
// of them write one byte is structural (split_at_mut). Keep it so.
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use crate::error::{Error, Result};
use crate::format::CheckpointIndex;
use crate::plan::load::{plan_reads, BlockRun, CopySeg, ReadPlan, ReadTuning, Span};
use crate::storage::Storage;

/// Counters of one rank's load.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoadStats {
    /// Bytes the requested tensors needed.
    pub bytes_needed: u64,
    /// Bytes of tensor data this rank read from storage: whole checksum blocks when verifying
    /// alone; with [`LoadOptions::share_verification`](crate::LoadOptions::share_verification)
    /// from remote storage, its own bytes and the bytes nobody needs that it checksums for the
    /// others. With `exchange_reads`, only the ranges assigned to this rank.
    pub bytes_read: u64,
    /// Bytes of tensor data received from other ranks (`exchange_reads`).
    pub bytes_received: u64,
    /// Bytes of data-file headers read to verify them (verified loads only).
    pub header_bytes_read: u64,
    /// Ranged reads the plan made (a read of a local file goes to the kernel in cache-sized
    /// pieces: one read here, several calls there).
    pub reads: usize,
}

/// How one rank's reads run: the settings of a load that the read engine follows.
pub(crate) struct Reading<'a> {
    /// Read every checksum block touched whole and check it.
    pub verify: bool,
    /// Read grouping.
    pub tuning: ReadTuning,
    /// Reading threads.
    pub threads: usize,
    /// Set to stop the reads early.
    pub cancel: Option<&'a AtomicBool>,
}

/// Reads this rank's `segs` into `targets` with no help from other ranks: every checksum block
/// a segment touches is read whole and checked (with `how.verify`), then the headers of the
/// files read.
pub(crate) fn read_alone(
    index: &CheckpointIndex,
    storage: &dyn Storage,
    how: &Reading<'_>,
    segs: Vec<CopySeg>,
    targets: &mut [&mut [u8]],
) -> Result<LoadStats> {
    let plan = plan_reads(index, segs, how.verify, how.tuning);
    execute(storage, index, &plan, targets, how.threads, how.cancel)?;
    let mut header_bytes_read = 0;
    if how.verify {
        let mut files: Vec<u32> = plan.spans.iter().map(|s| s.file).collect();
        files.dedup();
        header_bytes_read = verify_headers(storage, index, &files)?;
    }
    Ok(LoadStats {
        bytes_needed: plan.bytes_needed,
        bytes_read: plan.bytes_read,
        bytes_received: 0,
        header_bytes_read,
        reads: plan.spans.len(),
    })
}

/// Checks that the destinations of `segs` lie inside their targets (`target_lens[s.target]`
/// bytes each) and that no two of them overlap within a target. Returns the segment indices
/// sorted by (target, destination offset, length), the order [`split_destinations`] cuts them in.
///
/// A valid index never yields overlapping destinations (stored chunks tile the tensor), so an
/// overlap means a hostile or damaged index: the load is refused before any byte is written,
/// whatever the index validation upstream let through.
pub(crate) fn destination_order(
    index: &CheckpointIndex,
    segs: &[CopySeg],
    target_lens: &[usize],
) -> Result<Vec<usize>> {
    let key = |s: &CopySeg| index.tensors.get(s.tensor as usize).map_or("?", |t| t.key.as_str()).to_string();
    let mut order: Vec<usize> = (0..segs.len()).collect();
    order.sort_unstable_by_key(|&i| (segs[i].target, segs[i].dst_off, segs[i].len));
    // End of the previous destination in the same target.
    let mut prev: Option<(usize, u64)> = None;
    for &i in &order {
        let s = &segs[i];
        let Some(&len) = target_lens.get(s.target) else {
            return Err(Error::invalid(format!("copy into target {} of {}", s.target, target_lens.len())));
        };
        let end = s.dst_off.checked_add(s.len).filter(|&e| e <= len as u64).ok_or_else(|| {
            Error::sharding(
                key(s),
                format!("copy of {} bytes at {} past the end of a {len}-byte buffer", s.len, s.dst_off),
            )
        })?;
        if s.len == 0 {
            continue;
        }
        if let Some((t, prev_end)) = prev {
            if t == s.target && s.dst_off < prev_end {
                return Err(Error::sharding(
                    key(s),
                    format!(
                        "stored chunks overlap: bytes {}..{prev_end} of the load buffer are written twice",
                        s.dst_off
                    ),
                ));
            }
        }
        prev = Some((s.target, end));
    }
    Ok(order)
}

/// Cuts `targets` into one disjoint `&mut` slice per segment of `segs` (indexed like `segs`), so
/// that the threads of a load can only ever write their own segments' bytes. Fails, before
/// anything is written, when a destination is out of bounds or overlaps another.
fn split_destinations<'t>(
    index: &CheckpointIndex,
    segs: &[CopySeg],
    targets: &'t mut [&mut [u8]],
) -> Result<Vec<&'t mut [u8]>> {
    let lens: Vec<usize> = targets.iter().map(|t| t.len()).collect();
    let order = destination_order(index, segs, &lens)?;
    let mut out: Vec<&'t mut [u8]> = segs.iter().map(|_| <&mut [u8]>::default()).collect();
    let mut order = order.into_iter().peekable();
    for (t, buf) in targets.iter_mut().enumerate() {
        // What is left of target `t` after the destinations cut so far, and where it starts.
        let mut rest: &'t mut [u8] = buf;
        let mut pos = 0u64;
        while let Some(i) = order.next_if(|&i| segs[i].target == t) {
            let s = &segs[i];
            if s.len == 0 {
                continue;
            }
            // `destination_order` proved dst_off >= pos and dst_off + len <= the target's length.
            let (_, tail) = std::mem::take(&mut rest).split_at_mut((s.dst_off - pos) as usize);
            let (dst, tail) = tail.split_at_mut(s.len as usize);
            out[i] = dst;
            rest = tail;
            pos = s.dst_off + s.len;
        }
    }
    Ok(out)
}

/// Runs every read of `plan` with `threads` workers, writing into `targets` (indexed by
/// [`CopySeg::target`]).
///
/// Before a thread starts, the targets are cut into disjoint `&mut` slices, one per segment,
/// and each read takes its segments' slices with it: two threads cannot write the same byte,
/// by construction (no `unsafe`), and a plan whose destinations overlap is refused whole.
pub(crate) fn execute(
    storage: &dyn Storage,
    index: &CheckpointIndex,
    plan: &ReadPlan,
    targets: &mut [&mut [u8]],
    threads: usize,
    cancel: Option<&AtomicBool>,
) -> Result<()> {
    // A local read costs no round trip: a span is then read in pieces the CPU cache holds, and
    // each piece is checksummed and scattered while it is there, instead of the whole span
    // crossing memory once into the scratch buffer and twice more out of it.
    let piece = if storage.is_local() { crate::threads::LOCAL_PIECE } else { u64::MAX };
    execute_in_pieces(storage, index, plan, targets, threads, cancel, piece)
}

/// [`execute`], each span read `piece` bytes at a time.
fn execute_in_pieces(
    storage: &dyn Storage,
    index: &CheckpointIndex,
    plan: &ReadPlan,
    targets: &mut [&mut [u8]],
    threads: usize,
    cancel: Option<&AtomicBool>,
    piece: u64,
) -> Result<()> {
    let mut dsts = split_destinations(index, &plan.segs, targets)?;
    // Each read owns the slices of its segments: spans list consecutive runs of `plan.segs`.
    let mut work: Vec<(usize, &mut [&mut [u8]])> = Vec::with_capacity(plan.spans.len());
    let mut rest: &mut [&mut [u8]] = &mut dsts;
    let mut at = 0usize;
    for (i, sp) in plan.spans.iter().enumerate() {
        if sp.segs.start != at || sp.segs.end < at || sp.segs.end - at > rest.len() {
            return Err(Error::invalid(format!(
                "read plan: span {i} serves segments {:?}, expected them to start at {at}",
                sp.segs
            )));
        }
        let (mine, tail) = std::mem::take(&mut rest).split_at_mut(sp.segs.len());
        work.push((i, mine));
        rest = tail;
        at = sp.segs.end;
    }
    let work = Mutex::new(work.into_iter());
    let first_error: Mutex<Option<Error>> = Mutex::new(None);
    let workers = threads.clamp(1, plan.spans.len().max(1));
    let reader = || {
        let mut scratch: Vec<u8> = Vec::new();
        loop {
            if first_error.lock().unwrap().is_some() {
                return;
            }
            // The lock is held only to take the next read, not while it runs.
            let next = work.lock().unwrap().next();
            let Some((i, dsts)) = next else { return };
            if cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
                first_error.lock().unwrap().get_or_insert(Error::Cancelled);
                return;
            }
            let sp = &plan.spans[i];
            if let Err(e) = read_span(storage, index, plan, sp, dsts, &mut scratch, piece) {
                first_error.lock().unwrap().get_or_insert(e);
                return;
            }
        }
    };
    std::thread::scope(|scope| {
        if let Err(e) = crate::threads::spawn_named(scope, "tessera-read", workers, &reader) {
            first_error.lock().unwrap().get_or_insert(Error::io(storage.location(), e));
        }
    });
    match first_error.into_inner().unwrap() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Runs one read of a plan: the bytes of `sp`, `piece` bytes at a time, land in the caller's
/// buffer (a direct span) or in `scratch`, from which each piece is copied into the segments'
/// destinations `dsts`; the blocks of the span are checksummed piece by piece as they pass.
fn read_span(
    storage: &dyn Storage,
    index: &CheckpointIndex,
    plan: &ReadPlan,
    sp: &Span,
    dsts: &mut [&mut [u8]],
    scratch: &mut Vec<u8>,
    piece: u64,
) -> Result<()> {
    let name = &index.files[sp.file as usize].name;
    let blocks = &plan.blocks[sp.blocks.clone()];
    let segs = &plan.segs[sp.segs.clone()];
    let direct = sp.direct && dsts.len() == 1 && dsts[0].len() as u64 == sp.len;
    let end = sp.off + sp.len;
    // The walk below takes segments and blocks in file order, inside the span: a plan that
    // breaks this would leave bytes uncopied or unchecked, so it is refused, not trusted.
    let inside = |off: u64, len: u64| off >= sp.off && off.checked_add(len).is_some_and(|e| e <= end);
    let segs_ok = segs.iter().all(|s| inside(s.file_off, s.len)) && segs.is_sorted_by_key(|s| s.file_off);
    let blocks_ok = blocks.iter().all(|b| inside(b.file_off, b.len))
        && blocks.windows(2).all(|w| w[0].end() <= w[1].file_off)
        && (blocks.is_empty() || index.block_size > 0);
    if !segs_ok || !blocks_ok {
        return Err(Error::invalid(format!(
            "read plan: the copies or checks of the read of {name} at {}..{end} are not in file order inside it",
            sp.off
        )));
    }
    if !direct {
        scratch.resize(piece.min(sp.len) as usize, 0);
    }
    // The run of blocks being checked and its stored checksums, where its block being
    // checksummed starts and that block's crc so far; the first segment not yet passed.
    let bs = index.block_size;
    let mut run = 0usize;
    let mut run_crcs: &[u32] = match blocks.first() {
        Some(r) => stored_crcs(index, r, name)?,
        None => &[],
    };
    let (mut block_off, mut crc) = (blocks.first().map_or(0, |r| r.file_off), 0u32);
    let mut first_seg = 0usize;
    let mut at = sp.off;
    while at < end {
        let n = piece.min(end - at);
        let bytes: &[u8] = if direct {
            let dst = &mut dsts[0][(at - sp.off) as usize..][..n as usize];
            storage.read_at(name, at, dst)?;
            dst
        } else {
            let buf = &mut scratch[..n as usize];
            storage.read_at(name, at, buf)?;
            // Segments are in file order within a span (by start; with overlapping requests their
            // ends need not be): every one before `first_seg` ended before this piece.
            while segs.get(first_seg).is_some_and(|s| s.file_off + s.len <= at) {
                first_seg += 1;
            }
            for (s, dst) in segs.iter().zip(dsts.iter_mut()).skip(first_seg) {
                if s.file_off >= at + n {
                    break;
                }
                let (from, to) = (s.file_off.max(at), (s.file_off + s.len).min(at + n));
                if from < to {
                    dst[(from - s.file_off) as usize..(to - s.file_off) as usize]
                        .copy_from_slice(&buf[(from - at) as usize..(to - at) as usize]);
                }
            }
            buf
        };
        // The blocks of the runs, one after the other, as far as this piece reaches.
        while let Some(r) = blocks.get(run).filter(|_| block_off < at + n) {
            let block_end = (block_off + bs).min(r.end());
            let (from, to) = (block_off.max(at), block_end.min(at + n));
            crc = crate::model::crc::crc32c_append(crc, &bytes[(from - at) as usize..(to - at) as usize]);
            if block_end > at + n {
                break;
            }
            let stored = run_crcs[((block_off - r.file_off) / bs) as usize];
            if crc != stored {
                return Err(Error::corrupt(
                    format!("{}/{name}", storage.location()),
                    format!(
                        "checksum mismatch in {:?} at bytes {block_off}..{block_end} (stored {stored:08x}, read {crc:08x})",
                        index.tensors[r.tensor as usize].key,
                    ),
                ));
            }
            (block_off, crc) = (block_end, 0);
            if block_off == r.end() {
                run += 1;
                if let Some(next) = blocks.get(run) {
                    run_crcs = stored_crcs(index, next, name)?;
                    block_off = next.file_off;
                }
            }
        }
        at += n;
    }
    Ok(())
}

/// The stored checksums of the blocks of `r` (in the file `name`), one per block: a plan whose
/// run the index holds no checksums for is refused, not trusted.
fn stored_crcs<'i>(index: &'i CheckpointIndex, r: &BlockRun, name: &str) -> Result<&'i [u32]> {
    let blocks = r.len.div_ceil(index.block_size.max(1));
    let chunk = index.tensors.get(r.tensor as usize).and_then(|t| t.chunks().get(r.chunk as usize));
    let crcs = chunk.and_then(|c| {
        let first = usize::try_from(r.first).ok()?;
        c.crcs.get(first..first.checked_add(usize::try_from(blocks).ok()?)?)
    });
    crcs.ok_or_else(|| {
        Error::invalid(format!(
            "read plan: the blocks at bytes {}..{} of {name} have no stored checksums",
            r.file_off,
            r.end()
        ))
    })
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
            crc = crate::model::crc::crc32c_append(crc, &buf);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{FileEntry, StoredChunk, TensorEntry};
    use crate::model::dtype::DType;
    use crate::plan::load::{plan_reads, BlockRun, ReadTuning};
    use crate::storage::MemoryStorage;

    /// One 16-byte file `d` holding bytes 0..16, and one tensor `x` for the errors to name.
    fn setup() -> (CheckpointIndex, MemoryStorage) {
        let index = CheckpointIndex::of_tensors(
            0,
            vec![FileEntry { name: "d".into(), size: 16, header_len: 0, header_crc: 0 }],
            vec![TensorEntry::new("x".into(), DType::U8, vec![16], Vec::new())],
        );
        let storage = MemoryStorage::new();
        let w = storage.create("d", 16).unwrap();
        w.write_at(0, &(0..16).collect::<Vec<u8>>()).unwrap();
        w.finish().unwrap();
        (index, storage)
    }

    fn seg(file_off: u64, len: u64, target: usize, dst_off: u64) -> CopySeg {
        CopySeg { file: 0, file_off, len, target, dst_off, tensor: 0, chunk: 0 }
    }

    fn sharding_of_x(r: Result<impl std::fmt::Debug>) -> bool {
        matches!(r, Err(Error::InvalidSharding { ref key, .. }) if key == "x")
    }

    #[test]
    fn destinations_in_order_and_disjoint_pass() {
        let (index, _) = setup();
        let segs = [seg(8, 4, 0, 4), seg(0, 4, 0, 0), seg(4, 0, 0, 4), seg(0, 8, 1, 0)];
        assert_eq!(destination_order(&index, &segs, &[8, 8]).unwrap(), [1, 2, 0, 3]);
    }

    #[test]
    fn overlapping_destinations_are_refused() {
        let (index, _) = setup();
        let r = destination_order(&index, &[seg(0, 4, 0, 0), seg(8, 4, 0, 2)], &[8]);
        assert!(sharding_of_x(r));
        // The same bytes in two different targets are fine (two requests of one tensor).
        destination_order(&index, &[seg(0, 4, 0, 0), seg(0, 4, 1, 0)], &[8, 8]).unwrap();
    }

    #[test]
    fn destinations_past_the_buffer_are_refused() {
        let (index, _) = setup();
        assert!(sharding_of_x(destination_order(&index, &[seg(0, 4, 0, 6)], &[8])));
        // dst_off + len overflows u64: refused, not wrapped.
        assert!(sharding_of_x(destination_order(&index, &[seg(0, 4, 0, u64::MAX - 1)], &[8])));
        let r = destination_order(&index, &[seg(0, 4, 3, 0)], &[8]);
        assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
    }

    #[test]
    fn execute_scatters_and_reads_direct() {
        let (index, storage) = setup();
        let (mut a, mut b) = (vec![0xEEu8; 8], vec![0xEEu8; 4]);
        // Scattered through scratch: one read of bytes 0..12 serving three segments.
        let plan =
            plan_reads(&index, vec![seg(8, 4, 0, 0), seg(0, 4, 0, 4), seg(4, 4, 1, 0)], false, ReadTuning::default());
        execute(&storage, &index, &plan, &mut [&mut a, &mut b], 2, None).unwrap();
        assert_eq!(a, [8, 9, 10, 11, 0, 1, 2, 3]);
        assert_eq!(b, [4, 5, 6, 7]);
        // A read that lands directly in the buffer.
        let plan = plan_reads(&index, vec![seg(2, 8, 0, 0)], false, ReadTuning::default());
        assert!(plan.spans.iter().all(|s| s.direct));
        execute(&storage, &index, &plan, &mut [&mut a], 1, None).unwrap();
        assert_eq!(a, [2, 3, 4, 5, 6, 7, 8, 9]);
    }

    /// A 100×100 u8 tensor in one chunk of file `d`, checksummed in blocks of 1000 bytes; the
    /// file's byte `i` is `i * 7 % 251`.
    fn checksummed() -> (CheckpointIndex, MemoryStorage, Vec<u8>) {
        let bytes: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let chunk = StoredChunk {
            file: 0,
            byte_offset: 0,
            offset: [0, 0].into(),
            shape: [100, 100].into(),
            flat: None,
            crcs: bytes.chunks(1000).map(crate::model::crc::crc32c).collect(),
        };
        let index = CheckpointIndex::of_tensors(
            1000,
            vec![FileEntry { name: "d".into(), size: 10_000, header_len: 0, header_crc: 0 }],
            vec![TensorEntry::new("x".into(), DType::U8, vec![100, 100], vec![chunk])],
        );
        let storage = MemoryStorage::new();
        let w = storage.create("d", 10_000).unwrap();
        w.write_at(0, &bytes).unwrap();
        w.finish().unwrap();
        (index, storage, bytes)
    }

    /// Columns 30..70 of every row into one target (strided), and rows 40..60 whole into
    /// another (contiguous, read straight into it).
    fn strided_and_whole() -> Vec<CopySeg> {
        let mut segs: Vec<CopySeg> = (0..100).map(|r| seg(r * 100 + 30, 40, 0, r * 40)).collect();
        segs.push(seg(4000, 2000, 1, 0));
        segs
    }

    #[test]
    fn reads_in_pieces_give_what_whole_reads_give() {
        let (index, storage, bytes) = checksummed();
        let whole_only = vec![seg(4000, 2000, 1, 0)];
        for (segs, verify) in [(strided_and_whole(), true), (strided_and_whole(), false), (whole_only, true)] {
            let only_whole = segs.len() == 1;
            for max_span in [4096, 64 << 10] {
                let plan = plan_reads(&index, segs.clone(), verify, ReadTuning { max_span, max_gap: 64 << 10 });
                // Two whole blocks, read straight into the target.
                assert_eq!(plan.spans.iter().all(|s| s.direct), only_whole);
                // Pieces smaller than a block, not dividing it, equal to it, and the whole span.
                for piece in [1, 7, 999, 1000, 4096, u64::MAX] {
                    let (mut a, mut b) = (vec![0u8; 4000], vec![0u8; 2000]);
                    execute_in_pieces(&storage, &index, &plan, &mut [&mut a, &mut b], 2, None, piece).unwrap();
                    if !only_whole {
                        for r in 0..100 {
                            assert_eq!(
                                a[r * 40..r * 40 + 40],
                                bytes[r * 100 + 30..r * 100 + 70],
                                "piece {piece}, row {r}"
                            );
                        }
                    }
                    assert_eq!(b, bytes[4000..6000], "piece {piece}");
                }
            }
        }
    }

    #[test]
    fn reads_in_pieces_find_a_damaged_byte_in_any_block_they_touch() {
        let (index, storage, bytes) = checksummed();
        // A byte the targets need, and one they do not in a block they touch (column 5).
        for at in [3535usize, 9905] {
            let mut damaged = bytes.clone();
            damaged[at] ^= 0x40;
            let w = storage.create("d", 10_000).unwrap();
            w.write_at(0, &damaged).unwrap();
            w.finish().unwrap();
            let plan = plan_reads(&index, strided_and_whole(), true, ReadTuning::default());
            for piece in [7, 1000, u64::MAX] {
                let (mut a, mut b) = (vec![0u8; 4000], vec![0u8; 2000]);
                let r = execute_in_pieces(&storage, &index, &plan, &mut [&mut a, &mut b], 1, None, piece);
                let block = at / 1000 * 1000;
                let want = format!("at bytes {block}..{}", block + 1000);
                assert!(
                    matches!(&r, Err(Error::Corrupt { reason, .. }) if reason.contains(&want)),
                    "byte {at}, piece {piece}: {r:?}"
                );
            }
        }
    }

    #[test]
    fn a_read_whose_copies_or_checks_leave_file_order_is_refused() {
        let (index, storage) = setup();
        let span = |segs, blocks| Span { file: 0, off: 0, len: 8, segs, blocks, direct: false };
        let block = |file_off| BlockRun { file: 0, file_off, len: 4, tensor: 0, chunk: 0, first: 0 };
        // Copies out of order; a copy past the read; a check past the read.
        let plans = [
            (vec![seg(4, 4, 0, 0), seg(0, 4, 0, 4)], Vec::new(), span(0..2, 0..0)),
            (vec![seg(6, 4, 0, 0)], Vec::new(), span(0..1, 0..0)),
            (vec![seg(0, 4, 0, 0)], vec![block(6)], span(0..1, 0..1)),
        ];
        for (segs, blocks, span) in plans {
            let mut a = vec![0xEEu8; 8];
            let plan = ReadPlan { segs, blocks, spans: vec![span], bytes_needed: 8, bytes_read: 8 };
            let r = execute_in_pieces(&storage, &index, &plan, &mut [&mut a], 1, None, 3);
            assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
            assert_eq!(a, [0xEE; 8]);
        }
    }

    #[test]
    fn execute_refuses_overlapping_destinations_before_writing() {
        let (index, storage) = setup();
        let mut a = vec![0xEEu8; 12];
        // Two chunks of a hostile index both claiming bytes 4..8 of the buffer.
        let plan = plan_reads(&index, vec![seg(0, 8, 0, 0), seg(8, 8, 0, 4)], false, ReadTuning::default());
        assert!(sharding_of_x(execute(&storage, &index, &plan, &mut [&mut a], 2, None)));
        assert!(a.iter().all(|&x| x == 0xEE), "nothing written: {a:?}");
    }

    #[test]
    fn execute_refuses_a_segment_served_by_two_reads() {
        let (index, storage) = setup();
        let mut a = vec![0xEEu8; 4];
        // Two reads of the same segment would be two threads writing the same bytes.
        let span = Span { file: 0, off: 0, len: 4, segs: 0..1, blocks: 0..0, direct: true };
        let plan = ReadPlan {
            segs: vec![seg(0, 4, 0, 0)],
            blocks: Vec::new(),
            spans: vec![span.clone(), span],
            bytes_needed: 4,
            bytes_read: 8,
        };
        let r = execute(&storage, &index, &plan, &mut [&mut a], 2, None);
        assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
        assert_eq!(a, [0xEE; 4]);
    }
}
