//! Load planning: intersect what a rank asks for with the stored chunks, then group the needed
//! bytes into few large ranged reads. Pure: the plan is executed by `io::read`.

use super::geometry::{copy_runs, decompose_flat, numel, Layout, Piece};
use crate::format::CheckpointIndex;
use crate::{DType, Error, Result};

/// A tensor region a rank wants, described like a [`crate::ShardedTensor`].
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
    let ti = index.tensors.binary_search_by(|t| t.key.as_str().cmp(&req.key)).map_err(|_| Error::NotCovered {
        key: req.key.clone(),
        region: "(the whole tensor: key not in checkpoint)".into(),
    })?;
    let entry = &index.tensors[ti];
    if entry.dtype != req.dtype {
        return Err(Error::Mismatch {
            key: req.key.clone(),
            reason: format!("stored dtype is {}, the request has {}", entry.dtype, req.dtype),
        });
    }
    if entry.global_shape.len() != req.global_shape.len()
        || (entry.global_shape != req.global_shape && !req.allow_shape_mismatch)
    {
        return Err(Error::Mismatch {
            key: req.key.clone(),
            reason: format!(
                "stored global shape is {:?}, the request has {:?} (allow_shape_mismatch is off)",
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
    let req_box = Piece::new(&req.offset, &req.shape);
    let dst = Layout { box_off: &req.offset, box_shape: &req.shape, base: req.flat.map_or(0, |f| f.0) };
    let mut segs = Vec::new();
    let mut covered = 0u64;
    for (ci, c) in entry.chunks.iter().enumerate() {
        let chunk_box = Piece::new(&c.offset, &c.shape);
        if chunk_box.intersect(&req_box).is_none() && nd > 0 {
            continue;
        }
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

/// A checksum block to verify.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Block {
    /// File index.
    pub file: u32,
    /// Byte offset in the file.
    pub file_off: u64,
    /// Length.
    pub len: u64,
    /// Expected crc32c.
    pub crc: u32,
    /// Tensor index (for error messages).
    pub tensor: u32,
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
    /// Blocks (indices into [`ReadPlan::blocks`]) checked on this read.
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
    /// Blocks to verify, sorted by (file, offset).
    pub blocks: Vec<Block>,
    /// The reads.
    pub spans: Vec<Span>,
    /// Bytes the targets need.
    pub bytes_needed: u64,
    /// Bytes the reads fetch.
    pub bytes_read: u64,
}

/// Groups segments into reads. With `verify`, every block touched is read whole and checked.
pub fn plan_reads(index: &CheckpointIndex, mut segs: Vec<CopySeg>, verify: bool, tuning: ReadTuning) -> ReadPlan {
    // Foreign formats carry no checksums (block size 0): there is nothing to verify.
    let verify = verify && index.block_size > 0;
    let tuning = ReadTuning { max_span: tuning.max_span.max(4096), ..tuning };
    segs.sort_unstable();
    let bytes_needed = segs.iter().map(|s| s.len).sum();
    // Units: byte ranges that must be read whole (blocks when verifying, else segments).
    let mut blocks: Vec<Block> = Vec::new();
    let mut units: Vec<(u32, u64, u64)> = Vec::new();
    if verify {
        let bs = index.block_size;
        for s in &segs {
            let c = &index.tensors[s.tensor as usize].chunks[s.chunk as usize];
            let esize = index.tensors[s.tensor as usize].dtype.size() as u64;
            let clen = c.numel() * esize;
            let first = (s.file_off - c.byte_offset) / bs;
            let last = (s.file_off + s.len - 1 - c.byte_offset) / bs;
            for b in first..=last {
                let boff = c.byte_offset + b * bs;
                let blen = bs.min(clen - b * bs);
                blocks.push(Block {
                    file: s.file,
                    file_off: boff,
                    len: blen,
                    crc: c.crcs[b as usize],
                    tensor: s.tensor,
                });
            }
        }
        blocks.sort_unstable();
        blocks.dedup_by_key(|b| (b.file, b.file_off));
        units.extend(blocks.iter().map(|b| (b.file, b.file_off, b.len)));
    } else {
        for s in &segs {
            match units.last_mut() {
                Some(u) if u.0 == s.file && u.1 + u.2 >= s.file_off => u.2 = u.2.max(s.file_off + s.len - u.1),
                _ => units.push((s.file, s.file_off, s.len)),
            }
        }
        let mut split = Vec::with_capacity(units.len());
        for (f, mut off, mut len) in units {
            while len > tuning.max_span {
                split.push((f, off, tuning.max_span));
                off += tuning.max_span;
                len -= tuning.max_span;
            }
            split.push((f, off, len));
        }
        units = split;
    }
    let mut spans: Vec<Span> = Vec::new();
    for (i, &(f, off, len)) in units.iter().enumerate() {
        let extend = match spans.last() {
            Some(sp) => {
                let gap = off.wrapping_sub(sp.off + sp.len);
                sp.file == f
                    && off >= sp.off + sp.len
                    && gap <= tuning.max_gap
                    && gap * 32 <= off + len - sp.off
                    && off + len - sp.off <= tuning.max_span
            }
            None => false,
        };
        if extend {
            let sp = spans.last_mut().unwrap();
            sp.len = off + len - sp.off;
            if verify {
                sp.blocks.end = i + 1;
            }
        } else {
            let blocks = if verify { i..i + 1 } else { 0..0 };
            spans.push(Span { file: f, off, len, segs: 0..0, blocks, direct: false });
        }
    }
    // Assign segments to spans, splitting a segment that crosses span boundaries.
    let mut pieces: Vec<(usize, CopySeg)> = Vec::with_capacity(segs.len());
    for s in &segs {
        let mut i = spans.partition_point(|sp| (sp.file, sp.off + sp.len) <= (s.file, s.file_off));
        let mut cur = *s;
        while cur.len > 0 {
            let sp = &spans[i];
            debug_assert!(sp.file == cur.file && sp.off <= cur.file_off);
            let take = cur.len.min(sp.off + sp.len - cur.file_off);
            pieces.push((i, CopySeg { len: take, ..cur }));
            cur.file_off += take;
            cur.dst_off += take;
            cur.len -= take;
            i += 1;
        }
    }
    pieces.sort_by_key(|(i, _)| *i);
    let mut out_segs: Vec<CopySeg> = Vec::with_capacity(pieces.len());
    let mut pi = 0;
    for (i, sp) in spans.iter_mut().enumerate() {
        let start = out_segs.len();
        while pi < pieces.len() && pieces[pi].0 == i {
            out_segs.push(pieces[pi].1);
            pi += 1;
        }
        sp.segs = start..out_segs.len();
        sp.direct = sp.segs.len() == 1 && {
            let s = &out_segs[start];
            s.file_off == sp.off && s.len == sp.len
        };
    }
    let bytes_read = spans.iter().map(|s| s.len).sum();
    ReadPlan { segs: out_segs, blocks, spans, bytes_needed, bytes_read }
}
