//! Fully-parallel load planning: each byte range of the data files needed by several ranks is
//! read by one of them and sent to the others. Pure: every rank runs [`plan_exchange`] on the
//! same gathered needs and gets the same plan, with no further agreement; `io::load` executes it.
//!
//! 1. Each rank lists the byte ranges its load would read ([`needed_ranges`]: the checksum
//!    blocks its copy segments touch when verifying, else the segments themselves), sorted and
//!    merged, and announces them in a compact varint encoding ([`encode_needs`]).
//! 2. [`plan_exchange`] cuts the union of all needs at every boundary of every rank's ranges:
//!    disjoint ranges, each needed whole by a set of ranks (its *needers*; adjacent ranges with
//!    the same needers are merged).
//! 3. A range with one needer is read by it. A range with several is split into pieces of at
//!    most `max_piece` bytes, and at most `round_bytes / (needers − 1)` so that one piece fits a
//!    round (never below [`MIN_PIECE`]; on checksum-block boundaries when verifying, so the
//!    reader can check every block it reads).
//! 4. Assignment: pieces largest first (ties by file and offset), each to the needer with the
//!    fewest bytes to read so far — counting the single-needer ranges every rank reads anyway —
//!    ties to the lowest rank. So every byte is read exactly once, by a rank that needs it, and
//!    a rank's total exceeds that of any rank that could have taken its last piece by at most
//!    that piece.
//! 5. Rounds: each reader packs its pieces, in file order, into rounds of at most `round_bytes`
//!    sent (a piece counts `len × (needers − 1)`; a piece larger than that is a round alone).
//!    The number of rounds is the largest over readers; in round `k`, a reader sends to each
//!    other needer the concatenation, in file order, of its round-`k` pieces that rank needs.

use std::collections::BTreeSet;
use std::ops::Range;

use super::load::CopySeg;
use crate::format::CheckpointIndex;
use crate::model::codec::{Decoder, Encoder};

/// Pieces of a range needed by several ranks are at most this long by default.
pub const DEFAULT_MAX_PIECE: u64 = 4 << 20;
/// Default bound on the bytes a rank sends in one exchange round.
pub const DEFAULT_ROUND_BYTES: u64 = 256 << 20;
/// Pieces are not cut shorter than this (unless the range is), whatever the round budget.
pub const MIN_PIECE: u64 = 4096;

/// A byte range of a data file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ByteRange {
    /// File index in the checkpoint index.
    pub file: u32,
    /// Byte offset in the file.
    pub off: u64,
    /// Length in bytes.
    pub len: u64,
}

impl ByteRange {
    /// One past the last byte.
    pub fn end(&self) -> u64 {
        self.off + self.len
    }
}

/// Sorts ranges and merges those that overlap or touch; drops empty ones.
fn merge(mut v: Vec<ByteRange>) -> Vec<ByteRange> {
    v.retain(|r| r.len > 0);
    v.sort_unstable();
    let mut out: Vec<ByteRange> = Vec::with_capacity(v.len());
    for r in v {
        match out.last_mut() {
            Some(l) if l.file == r.file && l.end() >= r.off => l.len = l.len.max(r.end() - l.off),
            _ => out.push(r),
        }
    }
    out
}

/// The byte ranges a rank's load reads for `segs`: with `verify`, every checksum block a
/// segment touches (read whole to be checked), else the segments (also for a checkpoint
/// without checksum blocks, a foreign one). Sorted, disjoint, merged.
pub fn needed_ranges(index: &CheckpointIndex, segs: &[CopySeg], verify: bool) -> Vec<ByteRange> {
    let verify = verify && index.block_size > 0;
    let raw = segs
        .iter()
        .filter(|s| s.len > 0)
        .map(|s| {
            if !verify {
                return ByteRange { file: s.file, off: s.file_off, len: s.len };
            }
            let t = &index.tensors[s.tensor as usize];
            let c = &t.chunks()[s.chunk as usize];
            let clen = c.numel() * t.dtype.size() as u64;
            let bs = index.block_size;
            let first = (s.file_off - c.byte_offset) / bs;
            let last = (s.file_off + s.len - 1 - c.byte_offset) / bs;
            let off = c.byte_offset + first * bs;
            let end = c.byte_offset + ((last + 1) * bs).min(clen);
            ByteRange { file: s.file, off, len: end - off }
        })
        .collect();
    merge(raw)
}

/// Encodes sorted, disjoint ranges: a count, then per range the file delta, the gap from the
/// previous range's end in the same file (the offset in a new file) and the length, as varints.
pub fn encode_needs(ranges: &[ByteRange]) -> Vec<u8> {
    let mut e = Encoder::default();
    e.var(ranges.len() as u64);
    let (mut file, mut end) = (0u32, 0u64);
    for r in ranges {
        debug_assert!((r.file, r.off) >= (file, end), "ranges must be sorted and disjoint");
        if r.file != file {
            end = 0;
        }
        e.var((r.file - file) as u64);
        e.var(r.off - end);
        e.var(r.len);
        file = r.file;
        end = r.end();
    }
    e.buf
}

/// Decodes [`encode_needs`]; the ranges come out sorted, disjoint and non-empty, or it fails.
pub fn decode_needs(buf: &[u8]) -> Result<Vec<ByteRange>, String> {
    let mut d = Decoder::new(buf);
    let n = d.count()?;
    let mut out = Vec::with_capacity(n);
    let (mut file, mut end) = (0u32, 0u64);
    for _ in 0..n {
        let df = d.var()?;
        let nf = u32::try_from(file as u64 + df).map_err(|_| "file index overflows".to_string())?;
        if nf != file {
            end = 0;
        }
        let off = end.checked_add(d.var()?).ok_or("offset overflows")?;
        let len = d.var()?;
        if len == 0 {
            return Err("empty range".into());
        }
        end = off.checked_add(len).ok_or("range end overflows")?;
        file = nf;
        out.push(ByteRange { file, off, len });
    }
    if !d.is_done() {
        return Err(format!("{} trailing bytes", d.remaining()));
    }
    Ok(out)
}

/// A stored chunk's bytes in its file.
#[derive(Debug, Clone, Copy)]
struct ChunkBytes {
    off: u64,
    len: u64,
    tensor: u32,
    chunk: u32,
}

/// The stored chunks of every data file, by offset: maps file ranges back to chunks (to plan
/// their reads) and knows where checksum blocks start (to cut pieces on block boundaries).
#[derive(Debug, Clone)]
pub struct FileChunks {
    files: Vec<Vec<ChunkBytes>>,
    block_size: u64,
}

impl FileChunks {
    /// Indexes the chunks of `index`.
    pub fn new(index: &CheckpointIndex) -> Self {
        let mut files: Vec<Vec<ChunkBytes>> = vec![Vec::new(); index.files.len()];
        for (ti, t) in index.tensors.iter().enumerate() {
            let esize = t.dtype.size() as u64;
            for (ci, c) in t.chunks().iter().enumerate() {
                let len = c.numel() * esize;
                if len > 0 && (c.file as usize) < files.len() {
                    let cb = ChunkBytes { off: c.byte_offset, len, tensor: ti as u32, chunk: ci as u32 };
                    files[c.file as usize].push(cb);
                }
            }
        }
        for f in &mut files {
            f.sort_unstable_by_key(|c| c.off);
        }
        FileChunks { files, block_size: index.block_size.max(1) }
    }

    /// The chunk holding byte `at` of `file`.
    fn chunk_at(&self, file: u32, at: u64) -> Option<&ChunkBytes> {
        let cs = self.files.get(file as usize)?;
        let i = cs.partition_point(|c| c.off + c.len <= at);
        cs.get(i).filter(|c| c.off <= at)
    }

    /// The checksum block holding byte `at` of `file`: its bytes, and the chunk and block number
    /// that give its stored CRC.
    pub(crate) fn block_at(&self, file: u32, at: u64) -> Option<BlockAt> {
        let c = self.chunk_at(file, at)?;
        let k = (at - c.off) / self.block_size;
        let off = c.off + k * self.block_size;
        let range = ByteRange { file, off, len: self.block_size.min(c.off + c.len - off) };
        Some(BlockAt { range, tensor: c.tensor, chunk: c.chunk, block: k })
    }

    /// Where to end a piece of `[off, end)` wanted to end at `want`: the last block boundary in
    /// `(off, want]`, or, when the block at `off` is longer, the end of that block. Block
    /// boundaries are the multiples of the block size from a chunk's start, and its end.
    fn cut(&self, file: u32, off: u64, want: u64, end: u64) -> u64 {
        if want >= end {
            return end;
        }
        let bs = self.block_size;
        if let Some(c) = self.chunk_at(file, want - 1) {
            let b = if want == c.off + c.len { want } else { c.off + (want - c.off) / bs * bs };
            if b > off {
                return b;
            }
        }
        match self.chunk_at(file, off) {
            Some(c) => (c.off + ((off - c.off) / bs + 1) * bs).min(c.off + c.len).min(end),
            None => want,
        }
    }

    /// Copy segments reading `range` into `target` at `dst_off` onwards, one per chunk it
    /// crosses; fails if a byte of the range belongs to no chunk.
    pub fn segs(&self, range: &ByteRange, target: usize, dst_off: u64, out: &mut Vec<CopySeg>) -> Result<(), String> {
        let mut at = range.off;
        while at < range.end() {
            let c = self
                .chunk_at(range.file, at)
                .ok_or_else(|| format!("byte {at} of file {} is in no stored chunk (range {range:?})", range.file))?;
            let len = (c.off + c.len).min(range.end()) - at;
            out.push(CopySeg {
                file: range.file,
                file_off: at,
                len,
                target,
                dst_off: dst_off + (at - range.off),
                tensor: c.tensor,
                chunk: c.chunk,
            });
            at += len;
        }
        Ok(())
    }
}

/// A checksum block of a data file ([`FileChunks::block_at`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BlockAt {
    /// Its bytes.
    pub range: ByteRange,
    /// The tensor it belongs to.
    pub tensor: u32,
    /// The stored chunk of that tensor it belongs to.
    pub chunk: u32,
    /// Its number in the chunk (the index of its CRC).
    pub block: u64,
}

/// Sizes of the exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExchangeTuning {
    /// Largest piece of a range needed by several ranks (the unit of balancing).
    pub max_piece: u64,
    /// Bytes a rank sends at most in one round (a single larger piece is a round alone).
    pub round_bytes: u64,
}

impl Default for ExchangeTuning {
    fn default() -> Self {
        ExchangeTuning { max_piece: DEFAULT_MAX_PIECE, round_bytes: DEFAULT_ROUND_BYTES }
    }
}

/// One disjoint range of the union of all needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedRange {
    /// The bytes.
    pub range: ByteRange,
    /// Indices into [`ExchangePlan::needers`]: the ranks that need this range (ascending).
    pub needers: Range<usize>,
    /// The rank that reads it (one of the needers).
    pub reader: u32,
    /// The round in which the reader sends it; `None` when it has no other needer.
    pub round: Option<u32>,
}

/// Who reads what and who receives what, identical on every rank.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExchangePlan {
    /// Disjoint ranges covering the union of the needs, sorted by file and offset.
    pub ranges: Vec<PlannedRange>,
    /// Needer lists, referenced by [`PlannedRange::needers`] (shared by the pieces of a range).
    pub needers: Vec<u32>,
    /// Bytes each rank reads from storage.
    pub read_bytes: Vec<u64>,
    /// Exchange rounds (0 when nothing is needed by two ranks).
    pub rounds: u32,
}

impl ExchangePlan {
    /// The ranks that need range `i`.
    pub fn needers_of(&self, i: usize) -> &[u32] {
        &self.needers[self.ranges[i].needers.clone()]
    }
}

/// The union of every rank's needs (`needs[r]`: sorted, disjoint), cut at every boundary of
/// every rank's ranges: disjoint ranges in file order, each with its needers (indices into the
/// returned list, ascending); adjacent ranges with the same needers are merged.
pub(crate) fn union_by_needers(needs: &[Vec<ByteRange>]) -> (Vec<(ByteRange, Range<usize>)>, Vec<u32>) {
    // Sweep over every range boundary; between two boundaries the needers are the active set.
    let mut events: Vec<(u32, u64, bool, u32)> = Vec::with_capacity(needs.iter().map(|n| 2 * n.len()).sum());
    for (r, rs) in needs.iter().enumerate() {
        for x in rs.iter().filter(|x| x.len > 0) {
            events.push((x.file, x.off, true, r as u32));
            events.push((x.file, x.end(), false, r as u32));
        }
    }
    events.sort_unstable();
    let mut unique: Vec<(ByteRange, Range<usize>)> = Vec::new();
    let mut needers: Vec<u32> = Vec::new();
    let mut active: BTreeSet<u32> = BTreeSet::new();
    let mut since: Option<(u32, u64)> = None;
    let mut i = 0;
    while i < events.len() {
        let (f, p) = (events[i].0, events[i].1);
        if let Some((sf, sp)) = since {
            if sf == f && p > sp && !active.is_empty() {
                let same = unique.last().is_some_and(|(u, nr)| {
                    u.file == f && u.end() == sp && needers[nr.clone()].iter().copied().eq(active.iter().copied())
                });
                if same {
                    unique.last_mut().unwrap().0.len += p - sp;
                } else {
                    let start = needers.len();
                    needers.extend(active.iter().copied());
                    unique.push((ByteRange { file: f, off: sp, len: p - sp }, start..needers.len()));
                }
            }
        }
        while i < events.len() && (events[i].0, events[i].1) == (f, p) {
            let (_, _, start, r) = events[i];
            if start {
                active.insert(r);
            } else {
                active.remove(&r);
            }
            i += 1;
        }
        since = Some((f, p));
    }
    (unique, needers)
}

/// Plans the exchange from every rank's needs (`needs[r]`: sorted, disjoint ranges, as from
/// [`needed_ranges`] or [`decode_needs`]). With `blocks`, pieces are cut on checksum-block
/// boundaries. See the module documentation for the rules.
pub fn plan_exchange(needs: &[Vec<ByteRange>], blocks: Option<&FileChunks>, tuning: ExchangeTuning) -> ExchangePlan {
    let world = needs.len();
    let (unique, needers) = union_by_needers(needs);

    // Pieces; single-needer ranges go to their needer.
    let mut read_bytes = vec![0u64; world];
    let mut ranges: Vec<PlannedRange> = Vec::with_capacity(unique.len());
    for (u, nr) in unique {
        let k = nr.len() as u64;
        if k == 1 {
            let r = needers[nr.start];
            read_bytes[r as usize] += u.len;
            ranges.push(PlannedRange { range: u, needers: nr, reader: r, round: None });
            continue;
        }
        let max_len = tuning.max_piece.min(tuning.round_bytes / (k - 1)).max(MIN_PIECE);
        let mut off = u.off;
        while off < u.end() {
            let want = off.saturating_add(max_len).min(u.end());
            let cut = match blocks {
                Some(b) => b.cut(u.file, off, want, u.end()),
                None => want,
            };
            let cut = if cut > off && cut <= u.end() { cut } else { want };
            let piece = ByteRange { file: u.file, off, len: cut - off };
            ranges.push(PlannedRange { range: piece, needers: nr.clone(), reader: u32::MAX, round: None });
            off = cut;
        }
    }

    // Readers: largest piece first, to the least-loaded needer, ties to the lowest rank.
    let mut order: Vec<usize> = (0..ranges.len()).filter(|&i| ranges[i].reader == u32::MAX).collect();
    order.sort_unstable_by(|&a, &b| {
        let (ra, rb) = (&ranges[a].range, &ranges[b].range);
        rb.len.cmp(&ra.len).then_with(|| (ra.file, ra.off).cmp(&(rb.file, rb.off)))
    });
    for i in order {
        let nr = ranges[i].needers.clone();
        let w = *needers[nr].iter().min_by_key(|&&r| (read_bytes[r as usize], r)).expect("a range has needers");
        read_bytes[w as usize] += ranges[i].range.len;
        ranges[i].reader = w;
    }

    // Rounds: each reader packs its pieces in file order.
    let mut round = vec![0u32; world];
    let mut sent = vec![0u64; world];
    let mut rounds = 0;
    for p in ranges.iter_mut() {
        let k = p.needers.len() as u64;
        if k < 2 {
            continue;
        }
        let w = p.reader as usize;
        let cost = p.range.len.saturating_mul(k - 1);
        if sent[w] > 0 && sent[w].saturating_add(cost) > tuning.round_bytes {
            round[w] += 1;
            sent[w] = 0;
        }
        sent[w] = sent[w].saturating_add(cost);
        p.round = Some(round[w]);
        rounds = rounds.max(round[w] + 1);
    }
    ExchangePlan { ranges, needers, read_bytes, rounds }
}

/// Splits a rank's copy segments at the boundaries of the planned ranges: `(range index,
/// segment piece)`, sorted by range. Fails if a segment byte lies in no planned range or in one
/// `rank` does not need (the needs did not come from these segments).
pub fn split_segs(plan: &ExchangePlan, rank: u32, segs: &[CopySeg]) -> Result<Vec<(usize, CopySeg)>, String> {
    let mut out = Vec::with_capacity(segs.len());
    for s in segs.iter().filter(|s| s.len > 0) {
        let mut i = plan.ranges.partition_point(|p| (p.range.file, p.range.end()) <= (s.file, s.file_off));
        let mut cur = *s;
        while cur.len > 0 {
            let p = plan
                .ranges
                .get(i)
                .filter(|p| p.range.file == cur.file && p.range.off <= cur.file_off)
                .filter(|_| plan.needers_of(i).binary_search(&rank).is_ok())
                .ok_or_else(|| {
                    format!("bytes {}.. of file {} are not in this rank's planned needs", cur.file_off, cur.file)
                })?;
            let take = cur.len.min(p.range.end() - cur.file_off);
            out.push((i, CopySeg { len: take, ..cur }));
            cur.file_off += take;
            cur.dst_off += take;
            cur.len -= take;
            i += 1;
        }
    }
    out.sort_by_key(|(i, _)| *i);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn br(file: u32, off: u64, len: u64) -> ByteRange {
        ByteRange { file, off, len }
    }

    /// splitmix64.
    struct Rng(u64);
    impl Rng {
        fn below(&mut self, n: u64) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            (z ^ (z >> 31)) % n.max(1)
        }
    }

    /// Checks every rule of the plan against brute force over the bytes.
    fn check(needs: &[Vec<ByteRange>], plan: &ExchangePlan, tuning: ExchangeTuning) {
        let world = needs.len();
        // Ranges sorted and disjoint; pieces within their limits.
        for w in plan.ranges.windows(2) {
            assert!((w[0].range.file, w[0].range.end()) <= (w[1].range.file, w[1].range.off), "{w:?}");
        }
        // Every needed byte is in exactly one range, whose needers are exactly the ranks that
        // need the byte; no range holds an unneeded byte. Checked on one byte of each interval
        // between consecutive boundaries of the needs and of the plan.
        let mut cuts: Vec<(u32, u64)> =
            needs.iter().flatten().flat_map(|x| [(x.file, x.off), (x.file, x.end())]).collect();
        cuts.extend(plan.ranges.iter().flat_map(|p| [(p.range.file, p.range.off), (p.range.file, p.range.end())]));
        cuts.sort_unstable();
        cuts.dedup();
        for w in cuts.windows(2) {
            let ((f, a), (g, _)) = (w[0], w[1]);
            if f != g {
                continue;
            }
            let want: Vec<u32> = (0..world as u32)
                .filter(|&r| needs[r as usize].iter().any(|x| x.file == f && x.off <= a && a < x.end()))
                .collect();
            let holders: Vec<usize> = (0..plan.ranges.len())
                .filter(|&i| {
                    plan.ranges[i].range.file == f && plan.ranges[i].range.off <= a && a < plan.ranges[i].range.end()
                })
                .collect();
            match holders.as_slice() {
                [] => assert!(want.is_empty(), "byte {a} of file {f} needed by {want:?} but in no range"),
                [i] => assert_eq!(plan.needers_of(*i), want.as_slice(), "byte {a} of file {f}"),
                _ => panic!("byte {a} of file {f} in ranges {holders:?}"),
            }
        }
        let mut read = vec![0u64; world];
        for (i, p) in plan.ranges.iter().enumerate() {
            let nd = plan.needers_of(i);
            assert!(p.range.len > 0);
            assert!(nd.binary_search(&p.reader).is_ok(), "reader {} of {p:?} does not need it", p.reader);
            assert_eq!(p.round.is_some(), nd.len() > 1, "{p:?}");
            if nd.len() > 1 {
                let max = tuning.max_piece.min(tuning.round_bytes / (nd.len() as u64 - 1)).max(MIN_PIECE);
                assert!(p.range.len <= max, "{p:?} longer than {max}");
            }
            read[p.reader as usize] += p.range.len;
        }
        assert_eq!(read, plan.read_bytes);
        // Balance: a reader's total exceeds that of any rank that could have read its last
        // piece (in assignment order) by at most that piece.
        let mut order: Vec<usize> = (0..plan.ranges.len()).filter(|&i| plan.ranges[i].round.is_some()).collect();
        order.sort_by_key(|&i| {
            let r = &plan.ranges[i].range;
            (std::cmp::Reverse(r.len), r.file, r.off)
        });
        let mut last = vec![None; world];
        for i in order {
            last[plan.ranges[i].reader as usize] = Some(i);
        }
        for (w, l) in last.iter().enumerate() {
            if let Some(i) = *l {
                for &r in plan.needers_of(i) {
                    let len = plan.ranges[i].range.len;
                    assert!(plan.read_bytes[w] - len <= plan.read_bytes[r as usize], "rank {w} vs {r}");
                }
            }
        }
        // Rounds: at most round_bytes sent per rank per round, unless a piece is alone.
        let mut per: std::collections::BTreeMap<(u32, u32), (u64, usize)> = Default::default();
        for (i, p) in plan.ranges.iter().enumerate() {
            if let Some(k) = p.round {
                assert!(k < plan.rounds);
                let e = per.entry((p.reader, k)).or_default();
                e.0 += p.range.len * (plan.needers_of(i).len() as u64 - 1);
                e.1 += 1;
            }
        }
        for ((w, k), (bytes, n)) in per {
            assert!(bytes <= tuning.round_bytes || n == 1, "rank {w} round {k}: {bytes} bytes in {n} pieces");
        }
        // Deterministic.
        assert_eq!(&plan_exchange(needs, None, tuning), plan);
    }

    #[test]
    fn needs_round_trip_compactly() {
        let rs = vec![br(0, 0, 10), br(0, 20, 5), br(2, 7, 1), br(2, 8 + (1 << 40), 300), br(9, 0, 1)];
        let b = encode_needs(&rs);
        assert!(b.len() < 25, "{} bytes", b.len());
        assert_eq!(decode_needs(&b).unwrap(), rs);
        assert_eq!(decode_needs(&encode_needs(&[])).unwrap(), vec![]);
        // Truncated, trailing, empty ranges, overflow.
        assert!(decode_needs(&b[..b.len() - 1]).is_err());
        assert!(decode_needs(&[b.as_slice(), &[0]].concat()).is_err());
        assert!(decode_needs(&[1, 0, 0, 0]).is_err());
        let mut e = Encoder::default();
        e.var(2);
        for x in [0, u64::MAX - 1, 1, 0, 5, 1] {
            e.var(x);
        }
        assert!(decode_needs(&e.buf).is_err());
    }

    #[test]
    fn replicated_needs_are_read_once_and_spread_evenly() {
        // Four ranks need the same 10 MiB + 3 KiB of file 0 and 1 MiB of file 1 (DP replicas).
        let all = vec![br(0, 100, (10 << 20) + 3000), br(1, 0, 1 << 20)];
        let needs = vec![all.clone(); 4];
        let tuning = ExchangeTuning { max_piece: 1 << 20, round_bytes: 8 << 20 };
        let plan = plan_exchange(&needs, None, tuning);
        check(&needs, &plan, tuning);
        let total: u64 = all.iter().map(|r| r.len).sum();
        assert_eq!(plan.read_bytes.iter().sum::<u64>(), total);
        let (lo, hi) = (plan.read_bytes.iter().min().unwrap(), plan.read_bytes.iter().max().unwrap());
        assert!(hi - lo <= 1 << 20, "{:?}", plan.read_bytes);
        // 12 pieces, 3 per rank; each sends 3 MiB per piece: two pieces per 8 MiB round.
        assert_eq!(plan.rounds, 2);
    }

    #[test]
    fn partial_overlaps_are_cut_at_every_boundary() {
        let needs = vec![vec![br(0, 0, 100), br(1, 0, 10)], vec![br(0, 50, 100)], vec![br(0, 60, 10), br(1, 5, 10)]];
        let tuning = ExchangeTuning::default();
        let plan = plan_exchange(&needs, None, tuning);
        check(&needs, &plan, tuning);
        let got: Vec<(ByteRange, Vec<u32>, u32)> = (0..plan.ranges.len())
            .map(|i| (plan.ranges[i].range, plan.needers_of(i).to_vec(), plan.ranges[i].reader))
            .collect();
        assert_eq!(
            got,
            vec![
                (br(0, 0, 50), vec![0], 0),
                (br(0, 50, 10), vec![0, 1], 0),
                (br(0, 60, 10), vec![0, 1, 2], 2),
                (br(0, 70, 30), vec![0, 1], 1),
                (br(0, 100, 50), vec![1], 1),
                (br(1, 0, 5), vec![0], 0),
                (br(1, 5, 5), vec![0, 2], 2),
                (br(1, 10, 5), vec![2], 2),
            ]
        );
        assert_eq!(plan.rounds, 1);
    }

    #[test]
    fn random_needs_follow_every_rule() {
        for seed in 0..300u64 {
            let mut rng = Rng(seed);
            let world = 1 + rng.below(6) as usize;
            let mut needs = Vec::new();
            for _ in 0..world {
                let mut rs = Vec::new();
                for _ in 0..rng.below(6) {
                    let file = rng.below(3) as u32;
                    let off = rng.below(3000);
                    let max = if rng.below(4) == 0 { 12_000 } else { 300 };
                    rs.push(br(file, off, 1 + rng.below(max)));
                }
                needs.push(merge(rs));
            }
            let tuning = ExchangeTuning {
                max_piece: [1u64, 5000, 1 << 20][rng.below(3) as usize],
                round_bytes: [1u64, 6000, 20_000, 1 << 30][rng.below(4) as usize],
            };
            let plan = plan_exchange(&needs, None, tuning);
            let r = std::panic::catch_unwind(|| check(&needs, &plan, tuning));
            assert!(r.is_ok(), "seed {seed}: needs {needs:?}, tuning {tuning:?}");
            // Every rank's needs split over ranges it needs.
            for (r, rs) in needs.iter().enumerate() {
                let segs: Vec<CopySeg> = rs
                    .iter()
                    .map(|x| CopySeg {
                        file: x.file,
                        file_off: x.off,
                        len: x.len,
                        target: 0,
                        dst_off: 0,
                        tensor: 0,
                        chunk: 0,
                    })
                    .collect();
                let pieces = split_segs(&plan, r as u32, &segs).unwrap();
                assert_eq!(pieces.iter().map(|p| p.1.len).sum::<u64>(), rs.iter().map(|x| x.len).sum::<u64>());
                for (i, p) in pieces {
                    let q = &plan.ranges[i].range;
                    assert!(q.file == p.file && q.off <= p.file_off && p.file_off + p.len <= q.end());
                }
            }
        }
    }

    #[test]
    fn pieces_end_on_checksum_block_boundaries() {
        // File 0: chunk A at [100, 100 + 10_000), chunk B at [10_100, 10_100 + 5000); blocks of
        // 3000 bytes from each chunk's start.
        let blocks = FileChunks {
            files: vec![vec![
                ChunkBytes { off: 100, len: 10_000, tensor: 0, chunk: 0 },
                ChunkBytes { off: 10_100, len: 5000, tensor: 1, chunk: 0 },
            ]],
            block_size: 3000,
        };
        let needs = vec![vec![br(0, 100, 15_000)]; 2];
        let tuning = ExchangeTuning { max_piece: 4096, round_bytes: 1 << 20 };
        let plan = plan_exchange(&needs, Some(&blocks), tuning);
        let cuts: Vec<(u64, u64)> = plan.ranges.iter().map(|p| (p.range.off, p.range.end())).collect();
        // 6100..10_100 ends at the end of chunk A: the blocks of B start again at its start.
        assert_eq!(cuts, vec![(100, 3100), (3100, 6100), (6100, 10_100), (10_100, 13_100), (13_100, 15_100)]);
        // A block longer than the piece limit is one piece.
        let big = FileChunks { block_size: 8000, ..blocks.clone() };
        let plan = plan_exchange(&needs, Some(&big), tuning);
        let cuts: Vec<(u64, u64)> = plan.ranges.iter().map(|p| (p.range.off, p.range.end())).collect();
        assert_eq!(cuts, vec![(100, 8100), (8100, 10_100), (10_100, 15_100)]);
        // Ranges map back to chunk segments.
        let mut segs = Vec::new();
        blocks.segs(&br(0, 9000, 2000), 3, 40, &mut segs).unwrap();
        assert_eq!(
            segs,
            vec![
                CopySeg { file: 0, file_off: 9000, len: 1100, target: 3, dst_off: 40, tensor: 0, chunk: 0 },
                CopySeg { file: 0, file_off: 10_100, len: 900, target: 3, dst_off: 1140, tensor: 1, chunk: 0 },
            ]
        );
        assert!(blocks.segs(&br(0, 50, 100), 0, 0, &mut segs).is_err());
    }
}
