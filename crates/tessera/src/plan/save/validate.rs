//! The global validation of a save's plans: every rank runs it on the same plans and gets the
//! same verdict.

use std::collections::HashMap;
use std::sync::Mutex;

use super::{KeyNumbers, ObjectMeta, RankPlan, ShardMeta, KEYS_PER_PART};
use crate::error::{Error, Result};
use crate::plan::fasthash::FastMap;
use crate::plan::geometry::{check_tiling, numel, Piece};
use crate::plan::ForEach;

/// Validates the union of all ranks' shards: consistent dtype and global shape per key, main
/// replicas tiling every tensor exactly (boxes and flattened ranges), every object shard present
/// once. Deterministic: every rank computing it on the same plans gets the same verdict. Runs on
/// the calling thread; [`validate_global_with`] runs its parts on the caller's threads.
#[cfg(test)]
pub fn validate_global(plans: &[RankPlan]) -> Result<()> {
    validate_global_with(plans, &|n, work| (0..n).for_each(work))
}

/// [`validate_global`], the keys checked in parts (runs of [`KEYS_PER_PART`] keys) that
/// `for_each` runs, side by side when the caller gives it threads. The verdict is the same:
/// the error of the first failing key in key order.
pub fn validate_global_with(plans: &[RankPlan], for_each: ForEach<'_>) -> Result<()> {
    let keys = KeyNumbers::of(plans)?;
    // Parts are runs of keys in order of first appearance, so of neighbours in the plans: a
    // part reads each rank's plan in one short stretch, where the shards of one key, or of
    // keys far apart, lie scattered over the memory of every plan (a cache miss per shard).
    // Every shard is listed part after part (a counting sort), within a part rank after rank.
    let parts = keys.firsts.len().div_ceil(KEYS_PER_PART);
    let mut starts = vec![0usize; parts + 1];
    for &id in &keys.ids {
        starts[id as usize / KEYS_PER_PART + 1] += 1;
    }
    for p in 0..parts {
        starts[p + 1] += starts[p];
    }
    let mut fill = starts.clone();
    let mut shards = vec![ShardAt::default(); keys.ids.len()];
    let mut ids = keys.ids.iter();
    for (rank, p) in plans.iter().enumerate() {
        for index in 0..p.tensors.len() {
            let id = *ids.next().expect("a number per shard") as usize;
            let at = &mut fill[id / KEYS_PER_PART];
            // In range: KeyNumbers::of checked that ranks and shards number fewer than 2^32.
            shards[*at] = ShardAt { rank: rank as u32, index: index as u32, key: (id % KEYS_PER_PART) as u32 };
            *at += 1;
        }
    }
    drop(keys.ids);
    // Keys are independent: parts may run side by side; the first failing key in key order wins.
    let first: Mutex<Option<(&str, Error)>> = Mutex::new(None);
    for_each(parts, &|p| {
        let firsts = &keys.firsts[p * KEYS_PER_PART..((p + 1) * KEYS_PER_PART).min(keys.firsts.len())];
        if let Some((key, e)) = validate_part(plans, firsts, &shards[starts[p]..starts[p + 1]]).err() {
            let mut first = first.lock().unwrap_or_else(|e| e.into_inner());
            if first.as_ref().is_none_or(|(f, _)| key < *f) {
                *first = Some((key, e));
            }
        }
    });
    if let Some((_, e)) = first.into_inner().unwrap_or_else(|e| e.into_inner()) {
        return Err(e);
    }
    validate_objects(plans)
}

/// A shard as [`validate_global_with`] lists it: its rank, its position in the rank's plan,
/// and its key's position in its part.
#[derive(Debug, Clone, Copy, Default)]
struct ShardAt {
    rank: u32,
    index: u32,
    key: u32,
}

/// Checks the keys of a part (`firsts`: each key's first shard and its rank) on the calling
/// thread, from their shards `shards` (rank after rank): a part of [`validate_global_with`]'s
/// work. Each key's shards are checked in rank order, the first failing one giving the key's
/// error, then whether its main shards tile it. Fails with the failing key first in key order
/// and its error.
fn validate_part<'p>(
    plans: &'p [RankPlan],
    firsts: &[(usize, &'p ShardMeta)],
    shards: &[ShardAt],
) -> std::result::Result<(), (&'p str, Error)> {
    let shard = |s: &ShardAt| &plans[s.rank as usize].tensors[s.index as usize];
    let mut failed: Vec<Option<Error>> = firsts.iter().map(|&(_, f)| check_global(f).err()).collect();
    let mut boxes: Vec<BoxRanges<'_>> = firsts.iter().map(|_| BoxRanges::default()).collect();
    for s in shards {
        let k = s.key as usize;
        if failed[k].is_some() {
            continue;
        }
        let t = shard(s);
        match check_shard(firsts[k], s.rank as usize, t) {
            Ok(()) if t.main => boxes[k].add(t),
            Ok(()) => {}
            Err(e) => {
                failed[k] = Some(e);
                boxes[k] = BoxRanges::default();
            }
        }
    }
    let mut keys: Vec<usize> = (0..firsts.len()).collect();
    keys.sort_unstable_by(|&a, &b| firsts[a].1.key.cmp(&firsts[b].1.key));
    for k in keys {
        let first = firsts[k].1;
        if let Some(e) = failed[k].take() {
            return Err((&first.key, e));
        }
        if std::mem::take(&mut boxes[k]).tile(&first.global_shape) {
            continue;
        }
        // Not tiled box by box: the general check decides, and says what is wrong.
        let mut pieces = Vec::new();
        for t in shards.iter().filter(|s| s.key as usize == k).map(shard).filter(|t| t.main) {
            t.pieces_into(&mut pieces);
        }
        check_tiling(&first.global_shape, &pieces)
            .map_err(|reason| (&*first.key, Error::sharding(&*first.key, reason)))?;
    }
    Ok(())
}

/// A box: its offset and shape.
type BoxId<'p> = (&'p [u64], &'p [u64]);

/// The main shards of a key grouped by box (offset and shape), each as the range of the box's
/// flattening it holds (all of it when not flattened): the layouts of real saves (boxes of a
/// TP split, each whole or cut into flat ranges across DP) are checked from these, without
/// cutting a flat range into the boxes it covers and sweeping them.
#[derive(Default)]
struct BoxRanges<'p> {
    /// Position in `ranges` of each box.
    index: FastMap<BoxId<'p>, usize>,
    /// Each box with its ranges, in the order the shards came.
    ranges: Vec<(BoxId<'p>, Vec<(u64, u64)>)>,
}

impl<'p> BoxRanges<'p> {
    /// Adds a shard that passed [`check_shard`] (so its element counts fit).
    fn add(&mut self, t: &'p ShardMeta) {
        let range = t.flat.unwrap_or((0, numel(&t.shape)));
        let BoxRanges { index, ranges } = self;
        let at = *index.entry((&t.offset, &t.shape)).or_insert_with(|| {
            ranges.push(((&t.offset, &t.shape), Vec::new()));
            ranges.len() - 1
        });
        ranges[at].1.push(range);
    }

    /// True when the ranges of every box cover its flattening exactly once and the boxes tile
    /// `global` exactly: then every element of the tensor is held exactly once (it lies in one
    /// box, whose shards hold it once; the shards of other boxes hold only elements of theirs).
    /// False says nothing: the general check decides.
    fn tile(self, global: &[u64]) -> bool {
        let mut pieces = Vec::with_capacity(self.ranges.len());
        for ((off, shape), mut ranges) in self.ranges {
            // DP ranks hold ascending ranges of a box: sorted already, in rank order.
            if !ranges.is_sorted() {
                ranges.sort_unstable();
            }
            let mut end = 0;
            for (s, e) in ranges.into_iter().filter(|(s, e)| s < e) {
                if s != end {
                    return false;
                }
                end = e;
            }
            if end != numel(shape) {
                return false;
            }
            pieces.push(Piece::new(off, shape));
        }
        check_tiling(global, &pieces).is_ok()
    }
}

/// The global shape of a key (as its first shard gives it) holds at most 2^64 bytes, so that
/// element and byte counts of every box inside it fit in `u64`.
pub(super) fn check_global(first: &ShardMeta) -> Result<()> {
    let bytes = first.global_shape.iter().try_fold(first.dtype.size() as u64, |a, &b| a.checked_mul(b));
    match bytes {
        Some(_) => Ok(()),
        None => Err(Error::sharding(
            &*first.key,
            format!("global shape {:?} holds more than 2^64 bytes", first.global_shape),
        )),
    }
}

/// Checks one shard of a key against the key's first shard `(r0, first)` (whose global shape
/// passed [`check_global`]): same dtype and global shape, box inside the tensor (checked
/// arithmetic), flattened range inside the box.
pub(super) fn check_shard((r0, first): (usize, &ShardMeta), rank: usize, t: &ShardMeta) -> Result<()> {
    let key = &*first.key;
    if t.dtype != first.dtype {
        return Err(differs(key, "dtype", (r0, &first.dtype), (rank, &t.dtype)));
    }
    if t.global_shape != first.global_shape {
        return Err(differs(key, "global shape", (r0, &first.global_shape), (rank, &t.global_shape)));
    }
    if t.offset.len() != t.global_shape.len() || t.shape.len() != t.global_shape.len() {
        return Err(Error::sharding(key, format!("rank {rank}: box rank differs from the global shape's")));
    }
    for d in 0..t.shape.len() {
        if t.offset[d].checked_add(t.shape[d]).is_none_or(|end| end > t.global_shape[d]) {
            return Err(Error::sharding(
                key,
                format!(
                    "rank {rank}: box {} exceeds global shape {:?}",
                    Piece::new(&t.offset, &t.shape).describe(),
                    t.global_shape
                ),
            ));
        }
    }
    if let Some((s, e)) = t.flat {
        // The box lies inside the tensor, whose element count fits (check_global).
        if s > e || e > numel(&t.shape) {
            return Err(Error::sharding(key, format!("rank {rank}: flattened range {s}..{e} outside its box")));
        }
    }
    Ok(())
}

fn differs(key: &str, what: &str, a: (usize, &dyn std::fmt::Debug), b: (usize, &dyn std::fmt::Debug)) -> Error {
    Error::sharding(key, format!("{what} differs across ranks: rank {} has {:?}, rank {} has {:?}", a.0, a.1, b.0, b.1))
}

pub(super) fn validate_objects(plans: &[RankPlan]) -> Result<()> {
    let mut objects: HashMap<&str, Vec<(usize, &ObjectMeta)>> = HashMap::new();
    for (rank, p) in plans.iter().enumerate() {
        for o in &p.objects {
            objects.entry(o.key.as_str()).or_default().push((rank, o));
        }
    }
    let mut keys: Vec<&str> = objects.keys().copied().collect();
    keys.sort_unstable();
    for key in keys {
        let shards = &objects[key];
        let (r0, first) = shards[0];
        let mut offsets: Vec<&Vec<u64>> = Vec::new();
        for &(rank, o) in shards {
            if o.global_shape != first.global_shape {
                return Err(differs(key, "object grid", (r0, &first.global_shape), (rank, &o.global_shape)));
            }
            if o.offset.len() != o.global_shape.len() || o.offset.iter().zip(&o.global_shape).any(|(a, b)| a >= b) {
                return Err(Error::sharding(
                    key,
                    format!("rank {rank}: object shard {:?} outside grid {:?}", o.offset, o.global_shape),
                ));
            }
            if o.main {
                offsets.push(&o.offset);
            }
        }
        offsets.sort_unstable();
        if let Some(w) = offsets.windows(2).find(|w| w[0] == w[1]) {
            return Err(Error::sharding(key, format!("object shard {:?} saved by more than one main replica", w[0])));
        }
        let want = numel(&first.global_shape);
        if offsets.len() as u64 != want {
            let missing = first_missing_cell(&first.global_shape, &offsets);
            return Err(Error::sharding(
                key,
                format!(
                    "object has {} of {want} shards; shard {:?} is missing",
                    offsets.len(),
                    missing.unwrap_or_default()
                ),
            ));
        }
    }
    Ok(())
}

fn first_missing_cell(grid: &[u64], sorted: &[&Vec<u64>]) -> Option<Vec<u64>> {
    let mut cell = vec![0u64; grid.len()];
    for present in sorted {
        if **present != cell {
            return Some(cell);
        }
        let mut d = grid.len();
        while d > 0 {
            d -= 1;
            cell[d] += 1;
            if cell[d] < grid[d] {
                break;
            }
            cell[d] = 0;
        }
    }
    if (sorted.len() as u64) < numel(grid) {
        Some(cell)
    } else {
        None
    }
}
