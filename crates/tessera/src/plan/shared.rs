//! Verification shared between ranks: each rank reads only the bytes it needs, yet every
//! checksum block it touches is checked whole. Pure: every rank runs [`plan_shared_checks`] on
//! the same gathered needs; `load/` executes it.
//!
//! A verified load used to read every checksum block it touched whole, so a rank needing half
//! of each row of a tensor stored by rows read twice its bytes. Instead:
//!
//! 1. Each rank announces the byte ranges it needs (exact, not widened to blocks) and receives
//!    everyone's ([`super::exchange::needed_ranges`] without `verify`, one all-gather).
//! 2. Each block a rank touches is cut at every boundary of every rank's ranges inside it:
//!    *pieces*, each needed by a set of ranks (its needers), or by none (a *hole*). A block whose
//!    touchers all need it whole is not shared: each of them reads and checks it as before.
//!    A block only one rank touches is not shared either: that rank reads it whole.
//! 3. Every rank reads the bytes it needs and takes the CRC-32C of each piece it needs. For
//!    each rank that touches the block but does not need the piece, one of the piece's needers
//!    (picked by that rank's number, so that replicas share the work) *reports* it: sends its
//!    CRC. A hole is read and reported by the lowest rank touching its block (the only bytes
//!    read that nobody needs).
//! 4. With one all-to-all of CRCs, each rank holds a CRC for every piece of its shared blocks:
//!    its own for the pieces it read, a reporter's for the others. Joined in file order
//!    ([`crate::model::crc::CrcJoin`]), they must give the block's stored CRC. A rank's own
//!    bytes enter its own check, so what it loaded is verified, not only what a peer read.
//!
//! Every rank computes the same cuts from the same needs, so a sender and a receiver agree on
//! which CRCs a message carries and in which order without sending any offsets: a message is
//! the CRCs of the pieces the plan names, in file order.

use std::ops::Range;

use super::exchange::{union_by_needers, BlockAt, ByteRange, FileChunks};
use crate::format::CheckpointIndex;

/// A cut of a shared checksum block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// The bytes.
    pub range: ByteRange,
    /// Whether this rank needs (and so reads) these bytes.
    pub needed: bool,
    /// A hole (needed by no rank) that this rank reads, only to report its CRC.
    pub hole_to_read: bool,
}

/// A checksum block that this rank touches and checks from pieces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedBlock {
    /// Its bytes.
    pub range: ByteRange,
    /// Its stored CRC-32C.
    pub crc: u32,
    /// The tensor it belongs to (for error messages).
    pub tensor: u32,
    /// Its pieces, in file order (indices into [`SharedChecks::pieces`]).
    pub pieces: Range<usize>,
}

/// One rank's part of the shared verification. Any rank computing it for rank `me` from the
/// same gathered needs gets the same result, which is what lets ranks agree without talking.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SharedChecks {
    /// The shared blocks this rank touches, in file order. Its bytes outside them lie in blocks
    /// it needs whole, read and checked alone.
    pub blocks: Vec<SharedBlock>,
    /// The pieces of `blocks`, in file order.
    pub pieces: Vec<Piece>,
    /// Per rank: the pieces whose CRC this rank sends it, in file order.
    pub send: Vec<Vec<usize>>,
    /// Per rank: the pieces whose CRC this rank receives from it, in file order.
    pub recv: Vec<Vec<usize>>,
}

/// Plans rank `me`'s share of the verification from every rank's needs (`needs[r]`: sorted,
/// disjoint, exact ranges). `index` must hold the chunks of every tensor `me` needs (a partial
/// index does: other ranks' ranges are looked at only inside `me`'s blocks). Fails when a needed
/// byte lies in no stored chunk, or its chunk lacks the block's CRC.
pub fn plan_shared_checks(index: &CheckpointIndex, needs: &[Vec<ByteRange>], me: u32) -> Result<SharedChecks, String> {
    let world = needs.len();
    let mine = needs.get(me as usize).ok_or_else(|| format!("rank {me} has no needs among the {world} gathered"))?;
    let mut out =
        SharedChecks { send: vec![Vec::new(); world], recv: vec![Vec::new(); world], ..SharedChecks::default() };
    if index.block_size == 0 {
        // No checksums (a foreign format): nothing to verify, together or alone.
        return Ok(out);
    }
    let chunks = FileChunks::new(index);
    // The blocks this rank touches, in file order, once each.
    let mut blocks: Vec<BlockAt> = Vec::new();
    for r in mine {
        let mut at = r.off;
        while at < r.end() {
            let b = chunks.block_at(r.file, at).ok_or_else(|| {
                let name = index.files.get(r.file as usize).map_or("?", |f| f.name.as_str());
                format!("byte {at} of {name} is needed but in no stored chunk")
            })?;
            at = b.range.end().min(r.end());
            if blocks.last().is_none_or(|l| l.range != b.range) {
                blocks.push(b);
            }
        }
    }
    // Other ranks' ranges matter only where they meet these blocks: the sweep sees only those,
    // so its cost follows this rank's neighbours, not the world. Every rank touching a block
    // keeps every range that meets it, so all of them cut it alike.
    let near: Vec<Vec<ByteRange>> = needs.iter().map(|rs| meeting(rs, &blocks)).collect();
    let (union, needers) = union_by_needers(&near);
    drop(near);
    let mut touchers: Vec<u32> = Vec::new();
    // (range, needers) of the block being cut; an empty needer list is a hole.
    let mut cuts: Vec<(ByteRange, Range<usize>)> = Vec::new();
    for b in &blocks {
        let (f, b0, b1) = (b.range.file, b.range.off, b.range.end());
        // Cut the block at the union's boundaries; what no range covers is a hole.
        cuts.clear();
        touchers.clear();
        let mut pos = b0;
        let mut i = union.partition_point(|(u, _)| (u.file, u.end()) <= (f, b0));
        while let Some((u, nr)) = union.get(i).filter(|(u, _)| u.file == f && u.off < b1) {
            if u.off > pos {
                cuts.push((ByteRange { file: f, off: pos, len: u.off - pos }, 0..0));
            }
            let end = u.end().min(b1);
            let from = u.off.max(b0);
            cuts.push((ByteRange { file: f, off: from, len: end - from }, nr.clone()));
            touchers.extend_from_slice(&needers[nr.clone()]);
            pos = end;
            i += 1;
        }
        if pos < b1 {
            cuts.push((ByteRange { file: f, off: pos, len: b1 - pos }, 0..0));
        }
        touchers.sort_unstable();
        touchers.dedup();
        // Not shared: a block its touchers all need whole, and one only this rank touches
        // (nobody else could report its other bytes; one read of it beats a read per hole).
        let whole = cuts.len() == 1 && needers[cuts[0].1.clone()].len() == touchers.len();
        if whole || touchers.len() == 1 {
            continue;
        }

        let t = &index.tensors[b.tensor as usize];
        let crc = t.chunks()[b.chunk as usize]
            .crcs
            .get(b.block as usize)
            .copied()
            .ok_or_else(|| format!("{:?}: no checksum for block {} of chunk {}", t.key, b.block, b.chunk))?;
        let first = out.pieces.len();
        for (range, nr) in &cuts {
            let who = &needers[nr.clone()];
            // Who tells rank `t` the CRC of this piece: a hole's lowest toucher (who reads it);
            // else one of the piece's needers, picked by `t`, so that with many replicas no
            // needer reports to every other rank.
            let reporter = |t: u32| if who.is_empty() { touchers[0] } else { who[t as usize % who.len()] };
            let needed = who.binary_search(&me).is_ok();
            let p = out.pieces.len();
            for &t in touchers.iter().filter(|&&t| t != me && who.binary_search(&t).is_err()) {
                if reporter(t) == me {
                    out.send[t as usize].push(p);
                }
            }
            if !needed && reporter(me) != me {
                out.recv[reporter(me) as usize].push(p);
            }
            out.pieces.push(Piece { range: *range, needed, hole_to_read: who.is_empty() && touchers[0] == me });
        }
        out.blocks.push(SharedBlock { range: b.range, crc, tensor: b.tensor, pieces: first..out.pieces.len() });
    }
    Ok(out)
}

/// The ranges of `ranges` (sorted, disjoint) that share a byte with one of `blocks` (sorted,
/// disjoint).
fn meeting(ranges: &[ByteRange], blocks: &[BlockAt]) -> Vec<ByteRange> {
    let mut out = Vec::new();
    let mut j = 0;
    for x in ranges {
        while blocks.get(j).is_some_and(|b| (b.range.file, b.range.end()) <= (x.file, x.off)) {
            j += 1;
        }
        if blocks.get(j).is_some_and(|b| b.range.file == x.file && b.range.off < x.end()) {
            out.push(*x);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{FileEntry, StoredChunk, TensorEntry};
    use crate::model::dtype::DType;

    /// One u8 tensor of `len` bytes stored as one chunk at offset 0 of file 0, in blocks of
    /// `bs` whose stored CRCs are their numbers.
    fn index(len: u64, bs: u64) -> CheckpointIndex {
        let chunk = StoredChunk {
            file: 0,
            byte_offset: 0,
            offset: [0].into(),
            shape: [len].into(),
            flat: None,
            crcs: (0..len.div_ceil(bs) as u32).collect(),
        };
        CheckpointIndex::of_tensors(
            bs,
            vec![FileEntry { name: "d".into(), size: len, header_len: 0, header_crc: 0 }],
            vec![TensorEntry::new("x".into(), DType::U8, vec![len], vec![chunk])],
        )
    }

    fn r(off: u64, len: u64) -> ByteRange {
        ByteRange { file: 0, off, len }
    }

    fn ranges(p: &SharedChecks) -> Vec<(u64, u64, bool, bool)> {
        p.pieces.iter().map(|p| (p.range.off, p.range.len, p.needed, p.hole_to_read)).collect()
    }

    #[test]
    fn blocks_needed_whole_by_every_toucher_are_not_shared() {
        let idx = index(64, 16);
        // Rank 0 needs blocks 0 and 1 whole, rank 1 blocks 1 whole and 2 whole.
        let needs = vec![vec![r(0, 32)], vec![r(16, 32)]];
        for me in 0..2 {
            let p = plan_shared_checks(&idx, &needs, me).unwrap();
            assert!(p.blocks.is_empty() && p.pieces.is_empty(), "rank {me}: {p:?}");
            assert!(p.send.iter().chain(&p.recv).all(Vec::is_empty));
        }
    }

    #[test]
    fn interleaved_needs_are_cut_and_reported_both_ways() {
        let idx = index(32, 16);
        // Rows of 4 bytes: rank 0 needs the first half of each, rank 1 the second.
        let needs: Vec<Vec<ByteRange>> = (0..2).map(|k| (0..8).map(|row| r(row * 4 + k * 2, 2)).collect()).collect();
        let p0 = plan_shared_checks(&idx, &needs, 0).unwrap();
        let p1 = plan_shared_checks(&idx, &needs, 1).unwrap();
        for (me, p) in [(0, &p0), (1, &p1)] {
            assert_eq!(p.blocks.len(), 2);
            assert_eq!((p.blocks[0].crc, p.blocks[1].crc), (0, 1));
            assert_eq!(p.pieces.len(), 16);
            assert!(p.pieces.windows(2).all(|w| w[0].range.end() == w[1].range.off));
            // Each rank needs every other piece, starting with its own half.
            let needed: Vec<bool> = p.pieces.iter().map(|x| x.needed).collect();
            assert_eq!(needed, (0..16).map(|i| i % 2 == me).collect::<Vec<_>>());
        }
        // What one sends the other receives, piece for piece.
        assert_eq!(p0.send[1], p1.recv[0]);
        assert_eq!(p1.send[0], p0.recv[1]);
        assert_eq!(p0.send[1], (0..16).step_by(2).collect::<Vec<_>>());
        assert!(p0.send[0].is_empty() && p0.recv[0].is_empty());
    }

    #[test]
    fn holes_are_read_by_the_lowest_toucher_and_overlaps_reported_once() {
        let idx = index(16, 16);
        // Rank 1 needs 0..6, rank 2 needs 4..10, nobody 10..16; rank 0 needs nothing.
        let needs = vec![vec![], vec![r(0, 6)], vec![r(4, 6)]];
        let p0 = plan_shared_checks(&idx, &needs, 0).unwrap();
        assert_eq!(p0, SharedChecks { send: vec![vec![]; 3], recv: vec![vec![]; 3], ..Default::default() });
        let p1 = plan_shared_checks(&idx, &needs, 1).unwrap();
        let p2 = plan_shared_checks(&idx, &needs, 2).unwrap();
        assert_eq!(ranges(&p1), [(0, 4, true, false), (4, 2, true, false), (6, 4, false, false), (10, 6, false, true)]);
        assert_eq!(
            ranges(&p2),
            [(0, 4, false, false), (4, 2, true, false), (6, 4, true, false), (10, 6, false, false)]
        );
        // 4..6 is needed by both: each uses its own CRC, nobody sends it.
        assert_eq!(p1.send[2], [0, 3]);
        assert_eq!(p2.recv[1], [0, 3]);
        assert_eq!(p2.send[1], [2]);
        assert_eq!(p1.recv[2], [2]);
    }

    #[test]
    fn a_block_one_rank_touches_is_read_whole_by_it() {
        let idx = index(64, 16);
        // Rank 0 needs parts of blocks 0 and 1, rank 1 part of block 1 only.
        let needs = vec![vec![r(0, 4), r(20, 2)], vec![r(24, 2)]];
        let p = plan_shared_checks(&idx, &needs, 0).unwrap();
        assert_eq!(p.blocks.iter().map(|b| b.range.off).collect::<Vec<_>>(), [16]);
        assert_eq!(
            ranges(&p),
            [
                (16, 4, false, true),
                (20, 2, true, false),
                (22, 2, false, true),
                (24, 2, false, false),
                (26, 6, false, true)
            ]
        );
    }

    #[test]
    fn replicas_share_the_reporting() {
        let idx = index(16, 16);
        // Ranks 0 and 1 need the first half, ranks 2..6 the second half.
        let needs: Vec<Vec<ByteRange>> = (0..6).map(|k| vec![if k < 2 { r(0, 8) } else { r(8, 8) }]).collect();
        let plans: Vec<SharedChecks> = (0..6).map(|me| plan_shared_checks(&idx, &needs, me).unwrap()).collect();
        // The first half goes to ranks 2..6 from rank 0 or 1 by the receiver's parity; the
        // second half to rank 0 from rank 2 (0 mod 4 → the first of 2..6), to rank 1 from rank 3.
        assert_eq!(plans[0].send.iter().map(Vec::len).collect::<Vec<_>>(), [0, 0, 1, 0, 1, 0]);
        assert_eq!(plans[1].send.iter().map(Vec::len).collect::<Vec<_>>(), [0, 0, 0, 1, 0, 1]);
        assert_eq!(plans[2].send.iter().map(Vec::len).collect::<Vec<_>>(), [1, 0, 0, 0, 0, 0]);
        assert_eq!(plans[3].send.iter().map(Vec::len).collect::<Vec<_>>(), [0, 1, 0, 0, 0, 0]);
        assert!(plans[4].send.iter().chain(&plans[5].send).all(Vec::is_empty));
        for (me, p) in plans.iter().enumerate() {
            for (other, q) in plans.iter().enumerate() {
                assert_eq!(p.send[other].len(), q.recv[me].len(), "rank {me} to rank {other}");
            }
        }
    }

    #[test]
    fn a_checkpoint_without_checksums_shares_nothing() {
        let mut idx = index(64, 16);
        idx.block_size = 0;
        let needs = vec![vec![r(0, 3)], vec![r(3, 5)]];
        let p = plan_shared_checks(&idx, &needs, 0).unwrap();
        assert!(p.blocks.is_empty() && p.pieces.is_empty() && p.send.len() == 2 && p.recv.len() == 2);
    }

    #[test]
    fn a_byte_in_no_chunk_is_an_error() {
        let idx = index(16, 16);
        let e = plan_shared_checks(&idx, &[vec![r(20, 4)]], 0).unwrap_err();
        assert!(e.contains("no stored chunk"), "{e}");
        assert!(plan_shared_checks(&idx, &[vec![]], 1).is_err());
    }

    /// Random needs of 2–5 ranks over a 3-chunk file: every rank's plan tiles each of its shared
    /// blocks with pieces; what one rank sends another is, range for range, what that one
    /// expects from it; every piece a rank neither needs nor reads comes from exactly one peer.
    #[test]
    fn random_needs_give_plans_the_ranks_agree_on() {
        let mut rng = crate::test_rng::TestRng::new(11);
        let (mut swapped, mut holes) = (0, 0);
        for case in 0..300 {
            // Chunks of 40, 64 and 23 bytes in blocks of 16 (the last of each may be shorter).
            let lens = [40u64, 64, 23];
            let mut off = 0;
            let chunks: Vec<StoredChunk> = lens
                .iter()
                .map(|&len| {
                    let c = StoredChunk {
                        file: 0,
                        byte_offset: off,
                        offset: [off].into(),
                        shape: [len].into(),
                        flat: None,
                        crcs: (0..len.div_ceil(16) as u32).collect(),
                    };
                    off += len;
                    c
                })
                .collect();
            let idx = CheckpointIndex::of_tensors(
                16,
                vec![FileEntry { name: "d".into(), size: off, header_len: 0, header_crc: 0 }],
                vec![TensorEntry::new("x".into(), DType::U8, vec![off], chunks)],
            );
            let world = 2 + rng.below(4) as usize;
            let needs: Vec<Vec<ByteRange>> = (0..world)
                .map(|_| {
                    let mut v: Vec<ByteRange> = Vec::new();
                    let mut at = rng.below(8);
                    while at < off {
                        let len = (1 + rng.below(12)).min(off - at);
                        if rng.below(2) == 0 {
                            v.push(r(at, len));
                        }
                        at += len + rng.below(10);
                    }
                    // Merge touching ranges, as needed_ranges does.
                    v.dedup_by(|b, a| {
                        let touch = a.end() == b.off;
                        if touch {
                            a.len += b.len;
                        }
                        touch
                    });
                    v
                })
                .collect();
            let plans: Vec<SharedChecks> =
                (0..world).map(|me| plan_shared_checks(&idx, &needs, me as u32).unwrap()).collect();
            for (me, p) in plans.iter().enumerate() {
                let ctx = format!("case {case}, rank {me} of {world}: {needs:?}");
                for b in &p.blocks {
                    let pieces = &p.pieces[b.pieces.clone()];
                    assert_eq!(pieces[0].range.off, b.range.off, "{ctx}");
                    assert!(pieces.windows(2).all(|w| w[0].range.end() == w[1].range.off), "{ctx}");
                    assert_eq!(pieces.last().unwrap().range.end(), b.range.end(), "{ctx}");
                }
                for (other, q) in plans.iter().enumerate() {
                    let sent: Vec<ByteRange> = p.send[other].iter().map(|&i| p.pieces[i].range).collect();
                    let expected: Vec<ByteRange> = q.recv[me].iter().map(|&i| q.pieces[i].range).collect();
                    assert_eq!(sent, expected, "{ctx}: to rank {other}");
                    swapped += sent.len();
                }
                holes += p.pieces.iter().filter(|x| x.hole_to_read).count();
                let mut sources = vec![0; p.pieces.len()];
                for list in &p.recv {
                    list.iter().for_each(|&i| sources[i] += 1);
                }
                for (i, x) in p.pieces.iter().enumerate() {
                    let own = x.needed || x.hole_to_read;
                    assert_eq!(sources[i] + usize::from(own), 1, "{ctx}: piece {x:?}");
                    // A piece this rank needs lies inside its needs.
                    if x.needed {
                        assert!(needs[me].iter().any(|n| n.off <= x.range.off && x.range.end() <= n.end()), "{ctx}");
                    }
                }
            }
        }
        // The cases did exercise the swap and the holes.
        assert!(swapped > 100 && holes > 100, "{swapped} CRCs swapped, {holes} holes read");
    }
}
