//! Verification shared between ranks, executed ([`crate::plan::shared`] has the plan and the
//! reasoning): read only the needed bytes, checksum the pieces of shared blocks from the
//! targets, swap the CRCs the plan names in one all-to-all, join them into each block's CRC.
//! Only from remote storage: from a local file, the ranks read alone (whole blocks).

// No `unsafe` here: load buffers are reached through ordinary borrows only.
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU32, Ordering};

use crate::comm::{wire, Communicator};
use crate::error::{Error, Result};
use crate::format::CheckpointIndex;
use crate::load::read::{execute, read_alone, verify_headers, LoadStats, Reading};
use crate::model::crc::{crc32c, crc32c_append, CrcJoin};
use crate::plan::exchange::{decode_needs, encode_needs, needed_ranges, ByteRange};
use crate::plan::load::{plan_reads, CopySeg};
use crate::plan::shared::{plan_shared_checks, SharedBlock, SharedChecks};
use crate::storage::Storage;

/// Pieces checksummed per task when the pieces of shared blocks are checksummed on all cores.
const PIECES_PER_TASK: usize = 256;

/// Bytes of holes (bytes nobody needs, read to be checksummed) read at once: bounds the buffer.
const HOLE_BATCH: u64 = 64 << 20;

/// Reads this rank's `segs` into `targets`, verifying every checksum block they touch: alone
/// for blocks every rank touching them needs whole, together with the other ranks for the rest.
/// Collective over `comm`, the same on every rank: one all-gather of the needs, then (unless a
/// rank reads a local file, when all read alone) one all-to-all of CRCs. A rank that fails
/// before the all-to-all sends its error in it, and every rank stops.
pub(crate) fn load_shared_checks(
    index: &CheckpointIndex,
    storage: &dyn Storage,
    comm: &dyn Communicator,
    how: &Reading<'_>,
    segs: Vec<CopySeg>,
    targets: &mut [&mut [u8]],
) -> Result<LoadStats> {
    let (me, world) = (comm.rank(), comm.world_size());
    // A rank reading a local file says so instead of sending its needs: then every rank reads
    // alone (see `LoadOptions::share_verification`); so does one reading a checkpoint without
    // checksums (a foreign format), which has nothing to share. Decided from what every rank
    // sent, so all agree on whether the swap follows.
    let share = !storage.is_local() && index.block_size > 0;
    let mut msg = vec![u8::from(share)];
    if share {
        msg.extend(encode_needs(&needed_ranges(index, &segs, false)));
    }
    let all = comm.all_gather(&wire::ok(&msg))?;
    let payloads = wire::outcomes(&all, me, &mut None)?;
    if payloads.iter().any(|m| m.first() != Some(&1)) {
        return read_alone(index, storage, how, segs, targets);
    }
    let mut stats = LoadStats { bytes_needed: segs.iter().map(|s| s.len).sum(), ..LoadStats::default() };
    let needs = (payloads.into_iter().enumerate())
        .map(|(r, m)| decode_needs(&m[1..]).map_err(|e| Error::Comm { reason: format!("needs of rank {r}: {e}") }))
        .collect::<Result<Vec<_>>>()?;
    drop(all);

    // From here on a failure is kept until the all-to-all, which carries it.
    let mut pending: Option<Error> = None;
    let plan = plan_shared_checks(index, &needs, me as u32).unwrap_or_else(|e| {
        pending = Some(Error::invalid(format!("shared verification plan: {e}")));
        SharedChecks::default()
    });
    drop(needs);
    let mut crcs: Vec<u32> = Vec::new();
    if pending.is_none() {
        match read_and_checksum(index, storage, how, &plan, segs, targets, &mut stats) {
            Ok(c) => crcs = c,
            Err(e) => pending = Some(e),
        }
    }

    let send: Vec<Vec<u8>> = match &pending {
        Some(e) => vec![wire::failed(e); world],
        None => (plan.send.iter())
            .map(|pieces| {
                let mut m = Vec::with_capacity(1 + 4 * pieces.len());
                wire::begin_ok(&mut m);
                pieces.iter().for_each(|&p| m.extend_from_slice(&crcs[p].to_le_bytes()));
                m
            })
            .collect(),
    };
    let recv = comm.all_to_all(send)?;
    if let Some(e) = pending {
        return Err(e);
    }
    // A failure after the last collective concerns this rank only: nobody waits for it.
    for (r, m) in wire::outcomes(&recv, me, &mut None)?.into_iter().enumerate() {
        let want = &plan.recv[r];
        if m.len() != 4 * want.len() {
            return Err(Error::Comm {
                reason: format!(
                    "shared verification: {} bytes of checksums from rank {r}, expected {}",
                    m.len(),
                    4 * want.len()
                ),
            });
        }
        for (&p, crc) in want.iter().zip(m.chunks_exact(4)) {
            crcs[p] = u32::from_le_bytes(crc.try_into().expect("chunks of 4"));
        }
    }
    check_blocks(index, storage, &plan, &crcs)?;
    Ok(stats)
}

/// Reads this rank's bytes (blocks it checks alone read whole and checked, as a load does), and
/// returns the CRC of every piece of `plan` it read: the needed ones from the targets, the holes
/// it reads from storage. Other pieces' entries are 0 until the exchange fills them.
fn read_and_checksum(
    index: &CheckpointIndex,
    storage: &dyn Storage,
    how: &Reading<'_>,
    plan: &SharedChecks,
    segs: Vec<CopySeg>,
    targets: &mut [&mut [u8]],
    stats: &mut LoadStats,
) -> Result<Vec<u32>> {
    let (alone, shared) = split_at_blocks(segs, &plan.blocks);
    let alone = plan_reads(index, alone, true, how.tuning);
    let shared = plan_reads(index, shared, false, how.tuning);
    execute(storage, index, &alone, targets, how.threads, how.cancel)?;
    execute(storage, index, &shared, targets, how.threads, how.cancel)?;

    let views = disjoint(&shared.segs);
    let targets: &[&mut [u8]] = targets;
    let crcs: Vec<AtomicU32> = plan.pieces.iter().map(|_| AtomicU32::new(0)).collect();
    // A needed piece that no read covered (1 + its index), which a consistent plan never has.
    let missing = std::sync::atomic::AtomicUsize::new(0);
    crate::threads::on_cores(plan.pieces.len().div_ceil(PIECES_PER_TASK), &|task| {
        let first = task * PIECES_PER_TASK;
        for (i, p) in plan.pieces.iter().enumerate().skip(first).take(PIECES_PER_TASK) {
            if p.needed {
                match piece_crc(&views, targets, &p.range) {
                    Some(c) => crcs[i].store(c, Ordering::Relaxed),
                    None => missing.store(i + 1, Ordering::Relaxed),
                }
            }
        }
    });
    if let Some(i) = missing.into_inner().checked_sub(1) {
        let r = &plan.pieces[i].range;
        return Err(Error::invalid(format!(
            "shared verification: bytes {}..{} of {} are needed but were not read",
            r.off,
            r.end(),
            index.files[r.file as usize].name
        )));
    }
    let mut crcs: Vec<u32> = crcs.into_iter().map(AtomicU32::into_inner).collect();

    // Holes: bytes nobody needs, read only to be checksummed, grouped into reads as a load's
    // are (from several threads, gaps read through), a bounded batch at a time.
    let mut hole_files: Vec<u32> = Vec::new();
    let mut buf: Vec<u8> = Vec::new();
    let mut batch: Vec<(usize, CopySeg)> = Vec::new();
    let mut batch_bytes = 0u64;
    let holes = (plan.blocks.iter())
        .flat_map(|b| b.pieces.clone().map(move |i| (i, b.tensor)))
        .filter(|&(i, _)| plan.pieces[i].hole_to_read);
    let mut holes = holes.peekable();
    while let Some((i, tensor)) = holes.next() {
        let r = plan.pieces[i].range;
        let seg =
            CopySeg { file: r.file, file_off: r.off, len: r.len, target: 0, dst_off: batch_bytes, tensor, chunk: 0 };
        batch.push((i, seg));
        batch_bytes += r.len;
        if batch_bytes < HOLE_BATCH && holes.peek().is_some() {
            continue;
        }
        buf.resize(batch_bytes as usize, 0);
        let rp = plan_reads(index, batch.iter().map(|(_, s)| *s).collect(), false, how.tuning);
        execute(storage, index, &rp, &mut [&mut buf[..]], how.threads, how.cancel)?;
        for (i, s) in batch.drain(..) {
            crcs[i] = crc32c(&buf[s.dst_off as usize..(s.dst_off + s.len) as usize]);
        }
        stats.bytes_read += rp.bytes_read;
        stats.reads += rp.spans.len();
        hole_files.extend(rp.spans.iter().map(|s| s.file));
        batch_bytes = 0;
    }

    stats.bytes_read += alone.bytes_read + shared.bytes_read;
    stats.reads += alone.spans.len() + shared.spans.len();
    let mut files: Vec<u32> = alone.spans.iter().chain(&shared.spans).map(|s| s.file).chain(hole_files).collect();
    files.sort_unstable();
    files.dedup();
    stats.header_bytes_read = verify_headers(storage, index, &files)?;
    Ok(crcs)
}

/// Joins the pieces' CRCs of each shared block and compares the result with the stored CRC.
fn check_blocks(index: &CheckpointIndex, storage: &dyn Storage, plan: &SharedChecks, crcs: &[u32]) -> Result<()> {
    let mut join = CrcJoin::default();
    for b in &plan.blocks {
        let got = b.pieces.clone().fold(0, |acc, p| join.join(acc, crcs[p], plan.pieces[p].range.len));
        if got != b.crc {
            let name = &index.files[b.range.file as usize].name;
            return Err(Error::corrupt(
                format!("{}/{name}", storage.location()),
                format!(
                    "checksum mismatch in {:?} at bytes {}..{} (stored {:08x}, read by the ranks together {got:08x})",
                    index.tensors[b.tensor as usize].key,
                    b.range.off,
                    b.range.end(),
                    b.crc
                ),
            ));
        }
    }
    Ok(())
}

/// Splits `segs` into the parts outside the shared `blocks` (sorted, disjoint) and the parts
/// inside them; drops empty segments.
fn split_at_blocks(segs: Vec<CopySeg>, blocks: &[SharedBlock]) -> (Vec<CopySeg>, Vec<CopySeg>) {
    if blocks.is_empty() {
        return (segs, Vec::new());
    }
    let (mut alone, mut shared) = (Vec::with_capacity(segs.len()), Vec::with_capacity(segs.len()));
    for s in segs.into_iter().filter(|s| s.len > 0) {
        let mut i = blocks.partition_point(|b| (b.range.file, b.range.end()) <= (s.file, s.file_off));
        let mut cur = s;
        while cur.len > 0 {
            let Some(b) = blocks.get(i).filter(|b| b.range.file == cur.file && b.range.off < cur.file_off + cur.len)
            else {
                alone.push(cur);
                break;
            };
            if b.range.off > cur.file_off {
                let (head, tail) = cut(cur, b.range.off - cur.file_off);
                alone.push(head);
                cur = tail;
            }
            let (head, tail) = cut(cur, (b.range.end() - cur.file_off).min(cur.len));
            shared.push(head);
            cur = tail;
            i += 1;
        }
    }
    (alone, shared)
}

/// The first `n` bytes of `s` and the rest.
fn cut(s: CopySeg, n: u64) -> (CopySeg, CopySeg) {
    let head = CopySeg { len: n, ..s };
    let tail = CopySeg { file_off: s.file_off + n, len: s.len - n, dst_off: s.dst_off + n, ..s };
    (head, tail)
}

/// Segments sorted by (file, offset), cut so that no file byte is covered twice (two targets
/// may want the same bytes: one copy of them is checksummed).
fn disjoint(segs: &[CopySeg]) -> Vec<CopySeg> {
    let mut out: Vec<CopySeg> = Vec::with_capacity(segs.len());
    let mut covered: Option<(u32, u64)> = None;
    for s in segs {
        let start = match covered {
            Some((f, end)) if f == s.file => s.file_off.max(end),
            _ => s.file_off,
        };
        let end = s.file_off + s.len;
        if start < end {
            out.push(cut(*s, start - s.file_off).1);
            covered = Some((s.file, end));
        }
    }
    out
}

/// CRC-32C of the file bytes `r` as they landed in `targets`, through `views` (disjoint,
/// sorted); `None` when some byte of `r` is in no view.
fn piece_crc(views: &[CopySeg], targets: &[&mut [u8]], r: &ByteRange) -> Option<u32> {
    let mut i = views.partition_point(|v| (v.file, v.file_off + v.len) <= (r.file, r.off));
    let (mut at, mut crc) = (r.off, 0u32);
    while at < r.end() {
        let v = views.get(i).filter(|v| v.file == r.file && v.file_off <= at)?;
        let to = (v.file_off + v.len).min(r.end());
        let from = (v.dst_off + (at - v.file_off)) as usize;
        crc = crc32c_append(crc, targets.get(v.target)?.get(from..from + (to - at) as usize)?);
        at = to;
        i += 1;
    }
    Some(crc)
}
