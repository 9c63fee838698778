//! Load planning: intersect what a rank asks for with the stored chunks, then group the needed
//! bytes into few large ranged reads. Pure: the plan is executed by `io::read`.

use super::geometry::{copy_runs, decompose_flat, numel, Layout, Piece};
use crate::error::{Error, Result};
use crate::format::CheckpointIndex;
use crate::model::dtype::DType;

/// A tensor region a rank wants, described like a [`crate::model::ShardedTensor`].
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// Global key.
    pub key: String,
    /// Element type expected.
    pub dtype: DType,
    /// Global shape expected.
    pub global_shape: Vec<u64>,
    /// Box offset.
    pub offset: Vec<u64>,
    /// Box shape (prepended axes as size 1).
    pub shape: Vec<u64>,
    /// Range of the box's flattening held by the buffer.
    pub flat: Option<(u64, u64)>,
    /// Accept a different stored global shape (overlap read, rest zero).
    pub allow_shape_mismatch: bool,
    /// Which target buffer receives the data.
    pub target: usize,
}

impl Request {
    /// Elements in the target buffer.
    #[cfg_attr(not(feature = "plan-internals"), allow(dead_code))] // the benchmarks'
    pub fn numel(&self) -> u64 {
        self.flat.map_or_else(|| numel(&self.shape), |(s, e)| e - s)
    }
    fn pieces(&self) -> Vec<Piece> {
        match self.flat {
            Some((s, e)) => decompose_flat(&self.offset, &self.shape, s, e),
            None => vec![Piece::new(&self.offset, &self.shape)],
        }
    }
    fn describe(&self) -> String {
        let b = Piece::new(&self.offset, &self.shape).describe();
        match self.flat {
            Some((s, e)) => format!("{b} flattened [{s}, {e})"),
            None => b,
        }
    }
}

/// Bytes to move from a file into a target buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct CopySeg {
    /// File index in the checkpoint index.
    pub file: u32,
    /// Byte offset in the file.
    pub file_off: u64,
    /// Length in bytes.
    pub len: u64,
    /// Target buffer.
    pub target: usize,
    /// Byte offset in the target.
    pub dst_off: u64,
    /// Tensor index in the checkpoint index.
    pub tensor: u32,
    /// Chunk index within the tensor.
    pub chunk: u32,
}

/// The copy segments of one request, and whether its target must be zeroed first.
#[derive(Debug, Default)]
pub struct RequestPlan {
    /// Segments.
    pub segs: Vec<CopySeg>,
    /// Part of the buffer lies outside the stored tensor (shape mismatch allowed): zero it first.
    pub zero_fill: bool,
}

/// Plans one request against the index: every element must come from exactly one stored chunk.
pub fn plan_request(index: &CheckpointIndex, req: &Request) -> Result<RequestPlan> {
    plan_request_with(index, req, true)
}

fn plan_request_with(index: &CheckpointIndex, req: &Request, fast_rows: bool) -> Result<RequestPlan> {
    let ti = index.tensors.binary_search_by(|t| t.key.as_str().cmp(&req.key)).map_err(|_| Error::NotCovered {
        key: req.key.clone(),
        region: "(the whole tensor: key not in checkpoint)".into(),
    })?;
    let entry = &index.tensors[ti];
    // The reasons name no option of any API (the front ends differ in what they offer: a
    // Megatron-style load casts and may allow a shape mismatch, a DCP-style one does neither);
    // each starts with a fixed phrase, "stored dtype is" or "stored global shape is", after
    // which a front end may add its own way out.
    if entry.dtype != req.dtype {
        return Err(Error::Mismatch {
            key: req.key.clone(),
            reason: format!(
                "stored dtype is {}, the request has {}: load it into a {} tensor (the checkpoint's dtype) and \
                 convert that after loading",
                entry.dtype, req.dtype, entry.dtype
            ),
        });
    }
    if entry.global_shape.len() != req.global_shape.len()
        || (entry.global_shape != req.global_shape && !req.allow_shape_mismatch)
    {
        return Err(Error::Mismatch {
            key: req.key.clone(),
            reason: format!(
                "stored global shape is {:?}, the request has {:?}: load it into a tensor of the stored shape",
                entry.global_shape, req.global_shape
            ),
        });
    }
    let nd = req.shape.len();
    if req.offset.len() != nd {
        return Err(Error::invalid(format!("{:?}: offset and shape ranks differ", req.key)));
    }
    let esize = entry.dtype.size() as u64;
    let stored_box = Piece::new(&vec![0; nd], &entry.global_shape);
    let mut pieces = req.pieces();
    let mut zero_fill = false;
    if entry.global_shape != req.global_shape {
        let want: u64 = pieces.iter().map(Piece::numel).sum();
        pieces = pieces.iter().filter_map(|p| p.intersect(&stored_box)).collect();
        zero_fill = pieces.iter().map(Piece::numel).sum::<u64>() != want;
    }
    let expected: u64 = pieces.iter().map(Piece::numel).sum();
    let dst = Layout { box_off: &req.offset, box_shape: &req.shape, base: req.flat.map_or(0, |f| f.0) };
    let mut segs = Vec::new();
    let mut covered = 0u64;
    // Rows fast path: a dense request that spans whole rows of a chunk (the same extent on every
    // axis after the first) meets the chunk, or any flat range of it, in one contiguous range of
    // both: one segment, computed directly. This is every TP/DP row split.
    let rows_path = fast_rows && nd > 0 && req.flat.is_none() && entry.global_shape == req.global_shape;
    let candidates = match nd {
        0 => 0..entry.chunks().len(),
        _ => entry.chunks_meeting_rows(req.offset[0], req.offset[0].saturating_add(req.shape[0])),
    };
    for (ci, c) in entry.chunks().iter().enumerate().take(candidates.end).skip(candidates.start) {
        if nd > 0 && !boxes_meet(&c.offset, &c.shape, &req.offset, &req.shape) {
            continue;
        }
        if rows_path && c.offset[1..] == req.offset[1..] && c.shape[1..] == req.shape[1..] {
            let row: u64 = c.shape[1..].iter().product();
            let (s, e) = c.flat.unwrap_or((0, c.shape[0] * row));
            // The request's rows, in the chunk's flattening (clipped to the chunk).
            let lo = req.offset[0].saturating_sub(c.offset[0]).min(c.shape[0]) * row;
            let hi = (req.offset[0] + req.shape[0]).saturating_sub(c.offset[0]).min(c.shape[0]) * row;
            let (a, b) = (s.max(lo), e.min(hi));
            if a < b {
                covered += b - a;
                segs.push(CopySeg {
                    file: c.file,
                    file_off: c.byte_offset + (a - s) * esize,
                    len: (b - a) * esize,
                    target: req.target,
                    dst_off: (c.offset[0] * row + a - req.offset[0] * row) * esize,
                    tensor: ti as u32,
                    chunk: ci as u32,
                });
            }
            continue;
        }
        let chunk_box = Piece::new(&c.offset, &c.shape);
        let src = Layout { box_off: &c.offset, box_shape: &c.shape, base: c.flat.map_or(0, |f| f.0) };
        let chunk_pieces = match c.flat {
            Some((s, e)) => decompose_flat(&c.offset, &c.shape, s, e),
            None => vec![chunk_box],
        };
        for cp in &chunk_pieces {
            for rp in &pieces {
                let Some(region) = (if nd == 0 { Some(cp.clone()) } else { cp.intersect(rp) }) else { continue };
                copy_runs(src, dst, &region, &mut |s, d, len| {
                    covered += len;
                    segs.push(CopySeg {
                        file: c.file,
                        file_off: c.byte_offset + s * esize,
                        len: len * esize,
                        target: req.target,
                        dst_off: d * esize,
                        tensor: ti as u32,
                        chunk: ci as u32,
                    });
                });
            }
        }
    }
    if covered != expected {
        return Err(Error::NotCovered {
            key: req.key.clone(),
            region: format!(
                "{} ({} of {expected} elements found in the stored chunks)",
                req.describe(),
                covered.min(expected)
            ),
        });
    }
    Ok(RequestPlan { segs, zero_fill })
}

/// Sorts by `(file, offset)`, stably. A load meets many files, and each request's items come
/// in file order: one counting pass by file, then a check (rarely a sort) within each file,
/// beats a comparison sort of the whole list.
fn sort_by_file<T: Copy>(items: Vec<T>, key: impl Fn(&T) -> (u32, u64)) -> Vec<T> {
    let Some(files) = items.iter().map(|x| key(x).0 as usize + 1).max() else { return items };
    if files > 4 * items.len() + 1024 {
        let mut items = items;
        items.sort_by_key(|x| key(x));
        return items;
    }
    let mut start = vec![0usize; files + 1];
    for x in &items {
        start[key(x).0 as usize + 1] += 1;
    }
    for f in 0..files {
        start[f + 1] += start[f];
    }
    let mut at = start.clone();
    let mut out = items.clone();
    for x in items {
        let f = key(&x).0 as usize;
        out[at[f]] = x;
        at[f] += 1;
    }
    for f in 0..files {
        let bucket = &mut out[start[f]..start[f + 1]];
        if !bucket.is_sorted_by_key(|x| key(x).1) {
            bucket.sort_by_key(|x| key(x).1);
        }
    }
    out
}

/// Whether two boxes overlap (every axis).
fn boxes_meet(a_off: &[u64], a_shape: &[u64], b_off: &[u64], b_shape: &[u64]) -> bool {
    a_off.len() == b_off.len()
        && (0..a_off.len()).all(|d| a_off[d] < b_off[d] + b_shape[d] && b_off[d] < a_off[d] + a_shape[d])
}

/// Consecutive checksum blocks of one chunk, to be read whole and verified by one read. Runs,
/// not one entry per block: a chunk saved with tiny blocks (block size 1) has as many blocks as
/// bytes, and a list of them would take several times the checkpoint's size in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct BlockRun {
    /// File index.
    pub file: u32,
    /// Byte offset in the file of the first block.
    pub file_off: u64,
    /// Bytes of the blocks: whole blocks, but for a chunk's last block, which may be shorter.
    pub len: u64,
    /// Tensor index (for error messages, and the checksums).
    pub tensor: u32,
    /// Chunk index within the tensor.
    pub chunk: u32,
    /// Index of the run's first block among the chunk's blocks (and its checksums).
    pub first: u64,
}

impl BlockRun {
    /// One past the run's last byte in the file.
    pub fn end(&self) -> u64 {
        self.file_off + self.len
    }
}

/// One ranged read.
#[derive(Debug, Clone, PartialEq)]
pub struct Span {
    /// File index.
    pub file: u32,
    /// Byte offset.
    pub off: u64,
    /// Length.
    pub len: u64,
    /// Segments (indices into [`ReadPlan::segs`]) served by this read.
    pub segs: std::ops::Range<usize>,
    /// Runs of blocks (indices into [`ReadPlan::blocks`]) checked on this read, each inside it.
    pub blocks: std::ops::Range<usize>,
    /// The read lands directly in the target (one segment covering the whole span).
    pub direct: bool,
}

/// Knobs of read grouping.
#[derive(Debug, Clone, Copy)]
pub struct ReadTuning {
    /// Largest single read through a scratch buffer (bounds extra memory per thread);
    /// values below 4096 are raised to 4096.
    pub max_span: u64,
    /// Gaps up to this size between needed ranges are read through rather than split, as long
    /// as they stay under 1/32 of the read (so read-through costs at most ~3% extra bytes).
    pub max_gap: u64,
}

impl Default for ReadTuning {
    fn default() -> Self {
        ReadTuning { max_span: 4 << 20, max_gap: 64 << 10 }
    }
}

/// All reads of a load, with the copies and checks they serve.
#[derive(Debug, Default)]
pub struct ReadPlan {
    /// Copy segments, sorted by (file, offset), split at span boundaries.
    pub segs: Vec<CopySeg>,
    /// Blocks to verify, in runs sorted by (file, offset), disjoint, each inside one span.
    pub blocks: Vec<BlockRun>,
    /// The reads.
    pub spans: Vec<Span>,
    /// Bytes the targets need.
    pub bytes_needed: u64,
    /// Bytes the reads fetch.
    pub bytes_read: u64,
}

/// Groups segments into reads. With `verify`, every block touched is read whole and checked.
pub fn plan_reads(index: &CheckpointIndex, segs: Vec<CopySeg>, verify: bool, tuning: ReadTuning) -> ReadPlan {
    // Foreign formats carry no checksums (block size 0): there is nothing to verify.
    let verify = verify && index.block_size > 0;
    let tuning = ReadTuning { max_span: tuning.max_span.max(4096), ..tuning };
    let bytes_needed = segs.iter().map(|s| s.len).sum();
    let mut blocks: Vec<BlockRun> = Vec::new();
    if verify {
        // The blocks each segment touches, as a run per segment; listed before the segments
        // are sorted: in request order, each tensor's chunks are visited in memory order.
        let bs = index.block_size;
        for s in segs.iter().filter(|s| s.len > 0) {
            let c = &index.tensors[s.tensor as usize].chunks()[s.chunk as usize];
            let esize = index.tensors[s.tensor as usize].dtype.size() as u64;
            let clen = c.numel() * esize;
            let first = (s.file_off - c.byte_offset) / bs;
            let last = (s.file_off + s.len - 1 - c.byte_offset) / bs;
            let file_off = c.byte_offset + first * bs;
            let end = c.byte_offset + ((last + 1) * bs).min(clen);
            blocks.push(BlockRun {
                file: s.file,
                file_off,
                len: end - file_off,
                tensor: s.tensor,
                chunk: s.chunk,
                first,
            });
        }
        // In file order, the runs of one chunk that meet or overlap merged into one.
        blocks = sort_by_file(blocks, |b| (b.file, b.file_off));
        let mut merged: Vec<BlockRun> = Vec::with_capacity(blocks.len());
        for b in blocks {
            match merged.last_mut() {
                Some(m) if (m.file, m.tensor, m.chunk) == (b.file, b.tensor, b.chunk) && b.file_off <= m.end() => {
                    m.len = m.len.max(b.end() - m.file_off);
                }
                _ => merged.push(b),
            }
        }
        blocks = merged;
    }
    let segs = sort_by_file(segs, |s| (s.file, s.file_off));
    // Units are byte ranges that must be read whole (blocks when verifying, else segments
    // merged where they overlap, cut at `max_span`); spans group nearby units into one read.
    let mut spans: Vec<Span> = Vec::new();
    let joins = |spans: &[Span], f: u32, off: u64, len: u64| {
        spans.last().is_some_and(|sp| {
            let gap = off.wrapping_sub(sp.off + sp.len);
            sp.file == f
                && off >= sp.off + sp.len
                && gap <= tuning.max_gap
                && gap * 32 <= off + len - sp.off
                && off + len - sp.off <= tuning.max_span
        })
    };
    if verify {
        // Each block is a unit. A block joins the last span when it fits; the blocks after it
        // in its run (no gap) join too, as many as fit in `max_span`: the runs are cut where
        // the spans are, so that each piece of a run lies inside one span.
        let bs = index.block_size;
        let runs = std::mem::take(&mut blocks);
        for run in runs {
            let mut off = run.file_off;
            while off < run.end() {
                let block_len = bs.min(run.end() - off);
                let joined = joins(&spans, run.file, off, block_len);
                let span_start = if joined { spans.last().map_or(off, |sp| sp.off) } else { off };
                // Whole blocks up to `max_span` from the span's start, at least the first.
                let limit = span_start.saturating_add(tuning.max_span);
                let end = if run.end() <= limit {
                    run.end()
                } else {
                    let fit = (limit.saturating_sub(off) / bs).max(1);
                    off.saturating_add(fit.saturating_mul(bs)).min(run.end())
                };
                let first = run.first + (off - run.file_off) / bs;
                blocks.push(BlockRun { file_off: off, len: end - off, first, ..run });
                let i = blocks.len() - 1;
                match spans.last_mut() {
                    Some(sp) if joined => {
                        sp.len = end - sp.off;
                        sp.blocks.end = i + 1;
                    }
                    _ => spans.push(Span {
                        file: run.file,
                        off,
                        len: end - off,
                        segs: 0..0,
                        blocks: i..i + 1,
                        direct: false,
                    }),
                }
                off = end;
            }
        }
    } else {
        let mut add_unit = |f: u32, off: u64, len: u64| {
            if joins(&spans, f, off, len) {
                let sp = spans.last_mut().expect("a span to join");
                sp.len = off + len - sp.off;
            } else {
                spans.push(Span { file: f, off, len, segs: 0..0, blocks: 0..0, direct: false });
            }
        };
        let mut emit = |(f, mut off, mut len): (u32, u64, u64)| {
            while len > tuning.max_span {
                add_unit(f, off, tuning.max_span);
                off += tuning.max_span;
                len -= tuning.max_span;
            }
            add_unit(f, off, len);
        };
        let mut unit: Option<(u32, u64, u64)> = None;
        for s in &segs {
            match &mut unit {
                Some(u) if u.0 == s.file && u.1 + u.2 >= s.file_off => u.2 = u.2.max(s.file_off + s.len - u.1),
                _ => {
                    if let Some(u) = unit.replace((s.file, s.file_off, s.len)) {
                        emit(u);
                    }
                }
            }
        }
        if let Some(u) = unit {
            emit(u);
        }
    }
    // Assign segments to spans. Segments and spans are both in file order: one merge walk finds
    // each segment's span. Usually every segment lies inside one span and they come grouped
    // by span, so the sorted segments are the result as they are.
    let mut first = 0usize;
    let mut span_of: Vec<u32> = Vec::with_capacity(segs.len());
    let mut whole = true;
    for s in &segs {
        while (spans[first].file, spans[first].off + spans[first].len) <= (s.file, s.file_off) {
            first += 1;
        }
        whole &= s.file_off + s.len <= spans[first].off + spans[first].len;
        span_of.push(first as u32);
    }
    let segs = if whole && span_of.is_sorted() { segs } else { split_at_spans(&segs, &spans, &mut span_of) };
    let mut pi = 0;
    for (i, sp) in spans.iter_mut().enumerate() {
        let start = pi;
        while pi < span_of.len() && span_of[pi] as usize == i {
            pi += 1;
        }
        sp.segs = start..pi;
        sp.direct = sp.segs.len() == 1 && {
            let s = &segs[start];
            s.file_off == sp.off && s.len == sp.len
        };
    }
    let bytes_read = spans.iter().map(|s| s.len).sum();
    ReadPlan { segs, blocks, spans, bytes_needed, bytes_read }
}

/// The general case of span assignment: segments (file order) cut where they cross span ends,
/// grouped by span (overlapping segments, two targets wanting the same bytes, can interleave
/// spans). `span_of` gets the span of each returned piece.
fn split_at_spans(segs: &[CopySeg], spans: &[Span], span_of: &mut Vec<u32>) -> Vec<CopySeg> {
    span_of.clear();
    let mut out: Vec<CopySeg> = Vec::with_capacity(segs.len());
    let mut first = 0usize;
    for s in segs {
        while (spans[first].file, spans[first].off + spans[first].len) <= (s.file, s.file_off) {
            first += 1;
        }
        let mut i = first;
        let mut cur = *s;
        while cur.len > 0 {
            let sp = &spans[i];
            debug_assert!(sp.file == cur.file && sp.off <= cur.file_off);
            let take = cur.len.min(sp.off + sp.len - cur.file_off);
            span_of.push(i as u32);
            out.push(CopySeg { len: take, ..cur });
            cur.file_off += take;
            cur.dst_off += take;
            cur.len -= take;
            i += 1;
        }
    }
    if !span_of.is_sorted() {
        let mut order: Vec<usize> = (0..out.len()).collect();
        order.sort_by_key(|&k| span_of[k]);
        out = order.iter().map(|&k| out[k]).collect();
        *span_of = order.iter().map(|&k| span_of[k]).collect();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{Crcs, StoredChunk, TensorEntry};

    /// (dst, src, len) runs with adjacent ones merged: equal coverage whatever the splitting.
    fn runs(mut segs: Vec<CopySeg>) -> Vec<(u64, u64, u64)> {
        segs.sort_by_key(|s| s.dst_off);
        let mut out: Vec<(u64, u64, u64)> = Vec::new();
        for s in segs {
            match out.last_mut() {
                Some(l) if l.0 + l.2 == s.dst_off && l.1 + l.2 == s.file_off => l.2 += s.len,
                _ => out.push((s.dst_off, s.file_off, s.len)),
            }
        }
        out
    }

    /// The reads and checks of a verified plan, planned block by block (one entry per block,
    /// as before runs): the reference the runs must match, as `(spans, blocks)` with each
    /// span `(file, off, len)` and each block `(file, off, len, crc)`.
    #[allow(clippy::type_complexity)]
    fn block_by_block(
        index: &CheckpointIndex,
        segs: &[CopySeg],
        tuning: ReadTuning,
    ) -> (Vec<(u32, u64, u64)>, Vec<(u32, u64, u64, u32)>) {
        let bs = index.block_size;
        let mut blocks = Vec::new();
        for s in segs.iter().filter(|s| s.len > 0) {
            let c = &index.tensors[s.tensor as usize].chunks()[s.chunk as usize];
            let clen = c.numel() * index.tensors[s.tensor as usize].dtype.size() as u64;
            for b in (s.file_off - c.byte_offset) / bs..=(s.file_off + s.len - 1 - c.byte_offset) / bs {
                blocks.push((s.file, c.byte_offset + b * bs, bs.min(clen - b * bs), c.crcs[b as usize]));
            }
        }
        blocks.sort_unstable();
        blocks.dedup_by_key(|b| (b.0, b.1));
        let mut spans: Vec<(u32, u64, u64)> = Vec::new();
        for &(f, off, len, _) in &blocks {
            match spans.last_mut() {
                Some(sp)
                    if sp.0 == f
                        && off >= sp.1 + sp.2
                        && off - (sp.1 + sp.2) <= tuning.max_gap
                        && (off - (sp.1 + sp.2)) * 32 <= off + len - sp.1
                        && off + len - sp.1 <= tuning.max_span =>
                {
                    sp.2 = off + len - sp.1
                }
                _ => spans.push((f, off, len)),
            }
        }
        (spans, blocks)
    }

    #[test]
    fn runs_of_blocks_plan_the_reads_and_checks_of_block_by_block_planning() {
        let mut rng = crate::test_rng::TestRng::new(0x5eed);
        for case in 0..300 {
            // Two files of u8 chunks, one after another, with gaps; blocks of 1 to 9 bytes and
            // chunks of up to 40 (many blocks to a read), or blocks of 100 to 3099 bytes and
            // chunks of up to 12,000 (runs cut where reads reach `max_span`).
            let big = rng.below(2) == 1;
            let bs = if big { 100 + rng.below(3000) } else { 1 + rng.below(9) };
            let mut chunks = Vec::new();
            let mut at = [0u64; 2];
            for i in 0..6 {
                let file = rng.below(2) as u32;
                at[file as usize] += rng.below(if big { 3000 } else { 20 });
                let len = 1 + rng.below(if big { 12_000 } else { 40 });
                let crcs = (0..len.div_ceil(bs)).map(|_| rng.next_u64() as u32).collect();
                chunks.push(StoredChunk {
                    file,
                    byte_offset: at[file as usize],
                    offset: [i * 12_000].as_slice().into(),
                    shape: [len].as_slice().into(),
                    flat: None,
                    crcs,
                });
                at[file as usize] += len;
            }
            let index = CheckpointIndex::of_tensors(
                bs,
                Vec::new(),
                vec![TensorEntry::new("x".into(), DType::U8, vec![72_000], chunks)],
            );
            // Random pieces of random chunks, overlapping at times.
            let segs: Vec<CopySeg> = (0..1 + rng.below(8))
                .map(|_| {
                    let ci = rng.below(6) as usize;
                    let c = &index.tensors[0].chunks()[ci];
                    let len = c.shape[0];
                    let from = rng.below(len);
                    let n = 1 + rng.below(len - from);
                    CopySeg {
                        file: c.file,
                        file_off: c.byte_offset + from,
                        len: n,
                        target: 0,
                        dst_off: 0,
                        tensor: 0,
                        chunk: ci as u32,
                    }
                })
                .collect();
            let tuning = ReadTuning { max_span: 4096, max_gap: rng.below(if big { 4000 } else { 16 }) };
            // `max_span` below 4096 is raised to it: the rule block by block sees the same.
            for max_span in [4096, 10_000] {
                let tuning = ReadTuning { max_span, ..tuning };
                let plan = plan_reads(&index, segs.clone(), true, tuning);
                let (want_spans, want_blocks) = block_by_block(&index, &segs, tuning);
                let spans: Vec<(u32, u64, u64)> = plan.spans.iter().map(|s| (s.file, s.off, s.len)).collect();
                assert_eq!(spans, want_spans, "case {case}");
                let mut blocks = Vec::new();
                for (i, sp) in plan.spans.iter().enumerate() {
                    for r in &plan.blocks[sp.blocks.clone()] {
                        assert!(
                            r.file == sp.file && r.file_off >= sp.off && r.end() <= sp.off + sp.len,
                            "case {case}, span {i}"
                        );
                        let c = &index.tensors[r.tensor as usize].chunks()[r.chunk as usize];
                        let mut off = r.file_off;
                        while off < r.end() {
                            let b = (off - c.byte_offset) / bs;
                            let len = bs.min(r.end() - off);
                            blocks.push((r.file, off, len, c.crcs[b as usize]));
                            off += len;
                        }
                    }
                }
                assert_eq!(blocks, want_blocks, "case {case}");
            }
        }
    }

    #[test]
    fn the_rows_fast_path_plans_what_the_general_path_plans() {
        // A [rows, 6, 4] tensor stored as TP row boxes, each cut into DP flat ranges.
        let mut rng = crate::test_rng::TestRng::new(0x1234_5678_u64);
        let mut next = |n: u64| rng.below(n);
        for _ in 0..300 {
            let tp = 1 + next(4);
            let rows_per = 1 + next(5);
            let shape = vec![tp * rows_per, 6, 4];
            let per_box = rows_per * 24;
            let mut chunks = Vec::new();
            let mut at = 0u64;
            for t in 0..tp {
                let dp = 1 + next(4);
                let mut cuts: Vec<u64> = (0..dp - 1).map(|_| next(per_box + 1)).collect();
                cuts.extend([0, per_box]);
                cuts.sort_unstable();
                for w in cuts.windows(2) {
                    if w[0] == w[1] {
                        continue;
                    }
                    let flat = if w[0] == 0 && w[1] == per_box && next(2) == 0 { None } else { Some((w[0], w[1])) };
                    chunks.push(StoredChunk {
                        file: 0,
                        byte_offset: at,
                        offset: [t * rows_per, 0, 0].as_slice().into(),
                        shape: [rows_per, 6, 4].as_slice().into(),
                        flat,
                        crcs: Crcs::new(),
                    });
                    at += (w[1] - w[0]) * 4;
                }
            }
            let index = CheckpointIndex::of_tensors(
                0,
                Vec::new(),
                vec![TensorEntry::new("x".into(), DType::F32, shape.clone(), chunks)],
            );
            let r0 = next(shape[0]);
            let r1 = r0 + 1 + next(shape[0] - r0);
            let req = Request {
                key: "x".into(),
                dtype: DType::F32,
                global_shape: shape.clone(),
                offset: vec![r0, 0, 0],
                shape: vec![r1 - r0, 6, 4],
                flat: None,
                allow_shape_mismatch: false,
                target: 0,
            };
            let fast = plan_request_with(&index, &req, true).unwrap();
            let general = plan_request_with(&index, &req, false).unwrap();
            assert_eq!(runs(fast.segs), runs(general.segs), "rows {r0}..{r1} of {shape:?}");
        }
    }
}
