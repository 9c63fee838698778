//! Save planning: what each rank announces, global validation, data-file layout, index build.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use serde_json::{json, Map, Value as J};

use super::fasthash::FastMap;
use super::geometry::{check_tiling, decompose_flat_into, numel, Piece};
use super::ForEach;
use crate::error::{Error, Result};
use crate::format::{
    crc_hex, CheckpointIndex, Crcs, FileEntry, ObjectEntry, SafetensorsEntry, StoredChunk, StoredObject, TensorEntry,
    FORMAT_VERSION, NATIVE_BACKEND,
};
use crate::model::codec::{Decoder, Encoder};
use crate::model::dims::Dims;
use crate::model::dtype::DType;
use crate::model::{StatePath, Value};

/// What a rank says about one of its tensor shards before anything is written.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardMeta {
    /// Global key.
    pub key: Arc<str>,
    /// Element type.
    pub dtype: DType,
    /// Global shape.
    pub global_shape: Dims,
    /// Box offset.
    pub offset: Dims,
    /// Box shape (prepended axes included, as size 1).
    pub shape: Dims,
    /// Flattened range of the box held.
    pub flat: Option<(u64, u64)>,
    /// Written by this rank. Before [`assign_writers`]: the main replica.
    pub main: bool,
    /// This rank holds the bytes (main replicas always do; a replica may be metadata only).
    /// Replicas that hold their bytes can be chosen to write in the main replica's place.
    pub has_data: bool,
}

impl ShardMeta {
    /// Elements held.
    pub fn numel(&self) -> u64 {
        self.flat.map_or_else(|| numel(&self.shape), |(s, e)| e - s)
    }
    /// Bytes held.
    pub fn nbytes(&self) -> u64 {
        self.numel() * self.dtype.size() as u64
    }
    /// The boxes this shard covers (the tests' reference; the planner appends them to a list
    /// it reuses, with `pieces_into`).
    #[cfg(test)]
    pub fn pieces(&self) -> Vec<Piece> {
        let mut out = Vec::new();
        self.pieces_into(&mut out);
        out
    }
    /// The boxes this shard covers, appended to `out`.
    pub fn pieces_into(&self, out: &mut Vec<Piece>) {
        match self.flat {
            Some((s, e)) => decompose_flat_into(&self.offset, &self.shape, s, e, out),
            None => out.push(Piece { off: self.offset.clone(), shape: self.shape.clone() }),
        }
    }
}

/// What a rank says about one of its object shards.
#[derive(Debug, Clone, PartialEq)]
pub struct ObjectMeta {
    /// Global key.
    pub key: String,
    /// Grid shape.
    pub global_shape: Vec<u64>,
    /// Grid position.
    pub offset: Vec<u64>,
    /// Main replica (written).
    pub main: bool,
    /// Serialized size.
    pub len: u64,
}

/// Everything one rank announces in the single metadata exchange of a save.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RankPlan {
    /// Rank 0 only: a committed checkpoint exists and overwrite was not asked for.
    pub refuse_overwrite: bool,
    /// Rank 0 only: the id that names this save's data files.
    pub save_id: u64,
    /// Tensor shards, in the rank's order.
    pub tensors: Vec<ShardMeta>,
    /// Object shards, in the rank's order.
    pub objects: Vec<ObjectMeta>,
}

const PLAN_TAG: u8 = 0x71;

/// Most parts [`RankPlan::decode_all_with`] cuts the messages into (each part holds its own
/// copy of every key).
pub const DECODE_PARTS: usize = 8;
/// Fewest ranks in a part of [`RankPlan::decode_all_with`] (fewer messages: one part).
const MIN_RANKS_PER_PART: usize = 64;
/// Keys per part of [`validate_global_with`].
pub const KEYS_PER_PART: usize = 16;

impl RankPlan {
    /// Compact binary encoding (varints).
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Encoder::default();
        e.u8(PLAN_TAG);
        e.u8(self.refuse_overwrite as u8);
        e.var(self.save_id);
        self.encode_structure(&mut e);
        e.buf
    }

    /// The shards and objects (what a plan cache compares), appended to `e`.
    fn encode_structure(&self, e: &mut Encoder) {
        e.var(self.tensors.len() as u64);
        let mut last_key: &str = "";
        for t in &self.tensors {
            // Consecutive shards of one key (stacked layers, flat ranges) repeat the key: send it once.
            if &*t.key == last_key {
                e.u8(1);
            } else {
                e.u8(0);
                e.str(&t.key);
                last_key = &t.key;
            }
            e.u8(t.dtype.code());
            e.dims(&t.global_shape);
            for &x in t.offset.iter().chain(&t.shape) {
                e.var(x);
            }
            // Bit 0: flattened range follows; bit 1: not main; bit 2: a replica holding its bytes.
            let tag = t.flat.is_some() as u8 | (!t.main as u8) << 1 | ((!t.main && t.has_data) as u8) << 2;
            e.u8(tag);
            if let Some((s, x)) = t.flat {
                e.var(s);
                e.var(x - s);
            }
        }
        e.var(self.objects.len() as u64);
        for o in &self.objects {
            e.str(&o.key);
            e.dims(&o.global_shape);
            for &x in &o.offset {
                e.var(x);
            }
            e.u8(o.main as u8);
            e.var(o.len);
        }
    }

    /// Inverse of [`RankPlan::encode`].
    #[cfg(test)]
    pub fn decode(bytes: &[u8]) -> Result<RankPlan, String> {
        Self::decode_interned(bytes, &mut FastMap::default(), None)
    }

    /// Decodes every rank's message (`messages[r]` from rank `r`) on the calling thread,
    /// sharing one copy of each key among all ranks. Fails with the rank whose message is
    /// malformed.
    pub fn decode_all<M: AsRef<[u8]>>(messages: &[M]) -> Result<Vec<RankPlan>, (usize, String)> {
        Self::decode_ranks(messages, 0)
    }

    /// [`RankPlan::decode_all`] in parts that `for_each` runs (side by side when the caller
    /// gives it threads): contiguous runs of ranks, at most [`DECODE_PARTS`], each sharing one
    /// copy of each key. The result is the same as [`RankPlan::decode_all`]'s.
    pub fn decode_all_with<M: AsRef<[u8]> + Sync>(
        messages: &[M],
        for_each: ForEach<'_>,
    ) -> Result<Vec<RankPlan>, (usize, String)> {
        let parts = messages.len().div_ceil(MIN_RANKS_PER_PART).clamp(1, DECODE_PARTS);
        if parts == 1 {
            return Self::decode_all(messages);
        }
        let per = messages.len().div_ceil(parts);
        type Part = Option<Result<Vec<RankPlan>, (usize, String)>>;
        let done: Vec<Mutex<Part>> = (0..parts).map(|_| Mutex::new(None)).collect();
        for_each(parts, &|p| {
            let start = (p * per).min(messages.len());
            let end = (start + per).min(messages.len());
            *done[p].lock().unwrap_or_else(|e| e.into_inner()) = Some(Self::decode_ranks(&messages[start..end], start));
        });
        let mut out = Vec::with_capacity(messages.len());
        for (p, d) in done.into_iter().enumerate() {
            let part = d.into_inner().unwrap_or_else(|e| e.into_inner());
            out.extend(part.ok_or((p * per, "its part was not decoded".to_string()))??);
        }
        Ok(out)
    }

    /// Decodes the messages of ranks `first_rank..` (`messages[i]` from rank `first_rank + i`)
    /// on the calling thread, sharing one copy of each key among them: a part of
    /// [`RankPlan::decode_all`]'s work. Fails with the rank whose message is malformed.
    pub fn decode_ranks<M: AsRef<[u8]>>(messages: &[M], first_rank: usize) -> Result<Vec<RankPlan>, (usize, String)> {
        let mut keys = FastMap::default();
        let mut plans: Vec<RankPlan> = Vec::with_capacity(messages.len());
        for (i, m) in messages.iter().enumerate() {
            let plan = Self::decode_interned(m.as_ref(), &mut keys, plans.last()).map_err(|e| (first_rank + i, e))?;
            plans.push(plan);
        }
        Ok(plans)
    }

    /// Decodes one message, taking each key's shared copy from `keys` (which gains the new
    /// ones). Ranks of one layout announce the same keys in the same order: a key that is the
    /// one at its position in `prev` (the previous rank's plan) is taken from there, by
    /// comparing bytes, without hashing it.
    fn decode_interned(
        bytes: &[u8],
        keys: &mut FastMap<Box<[u8]>, Arc<str>>,
        prev: Option<&RankPlan>,
    ) -> Result<RankPlan, String> {
        let mut d = Decoder::new(bytes);
        if d.u8()? != PLAN_TAG {
            return Err("not a save plan message".into());
        }
        let refuse_overwrite = d.u8()? != 0;
        let save_id = d.var()?;
        let n = d.count()?;
        let mut tensors: Vec<ShardMeta> = Vec::with_capacity(n);
        for _ in 0..n {
            let key = match d.u8()? {
                1 => tensors.last().ok_or("repeated key with no previous shard")?.key.clone(),
                _ => {
                    let raw = d.bytes()?;
                    let at = prev.and_then(|p| p.tensors.get(tensors.len())).filter(|t| t.key.as_bytes() == raw);
                    match at.map(|t| &t.key).or_else(|| keys.get(raw)) {
                        Some(k) => k.clone(),
                        None => {
                            let k: Arc<str> = std::str::from_utf8(raw).map_err(|_| "key is not UTF-8")?.into();
                            keys.insert(raw.into(), k.clone());
                            k
                        }
                    }
                }
            };
            let code = d.u8()?;
            let dtype = DType::from_code(code).ok_or_else(|| format!("bad dtype code {code}"))?;
            let nd = d.count()?;
            let (global_shape, offset, shape) = if nd <= Dims::INLINE {
                // Into plain arrays first: a `Result<Dims, _>` per array, built and moved through
                // memory, costs more than decoding its varints.
                let mut v = [[0u64; Dims::INLINE]; 3];
                for a in &mut v {
                    d.vars_into(&mut a[..nd])?;
                }
                (Dims::from(&v[0][..nd]), Dims::from(&v[1][..nd]), Dims::from(&v[2][..nd]))
            } else {
                (d.dims_n(nd)?, d.dims_n(nd)?, d.dims_n(nd)?)
            };
            let tag = d.u8()?;
            let flat = if tag & 1 == 1 {
                let s = d.var()?;
                Some((s, s + d.var()?))
            } else {
                None
            };
            let main = tag & 2 == 0;
            let has_data = main || tag & 4 != 0;
            tensors.push(ShardMeta { key, dtype, global_shape, offset, shape, flat, main, has_data });
        }
        let n = d.count()?;
        let mut objects = Vec::with_capacity(n);
        for _ in 0..n {
            let key = d.str()?;
            let global_shape = d.dims()?;
            let offset = (0..global_shape.len()).map(|_| d.var()).collect::<Result<Vec<_>, _>>()?;
            let main = d.u8()? != 0;
            objects.push(ObjectMeta { key, global_shape, offset, main, len: d.var()? });
        }
        Ok(RankPlan { refuse_overwrite, save_id, tensors, objects })
    }
}

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

/// The tensor keys of a set of plans, numbered in order of first appearance (rank after rank,
/// in plan order), and the number of every shard's key.
struct KeyNumbers<'p> {
    /// Per key number: the first shard with that key, and its rank.
    firsts: Vec<(usize, &'p ShardMeta)>,
    /// The key number of each shard, rank after rank, in plan order.
    ids: Vec<u32>,
    /// Main shards per key number.
    key_mains: Vec<usize>,
    /// Main shards per rank.
    rank_mains: Vec<usize>,
}

impl<'p> KeyNumbers<'p> {
    /// Numbers the keys of `plans`. A shard's key is nearly always the key of the shard at the
    /// same position in the previous rank's plan (ranks of one layout announce the same keys in
    /// the same order): that is checked first, by pointer and then by text, so the map of keys
    /// is asked only where the plans of two ranks differ. Fails past 2^32 ranks or shards.
    fn of(plans: &'p [RankPlan]) -> Result<KeyNumbers<'p>> {
        let total: usize = plans.iter().map(|p| p.tensors.len()).sum();
        if u32::try_from(total).is_err() || u32::try_from(plans.len()).is_err() {
            return Err(Error::invalid(format!(
                "{} ranks announce {total} tensor shards; at most 2^32 of each are supported",
                plans.len()
            )));
        }
        let mut ids: Vec<u32> = Vec::with_capacity(total);
        let mut firsts: Vec<(usize, &ShardMeta)> = Vec::new();
        let mut key_mains: Vec<usize> = Vec::new();
        let mut rank_mains: Vec<usize> = Vec::with_capacity(plans.len());
        let mut by_key: FastMap<&str, u32> = FastMap::default();
        // The shards of the last rank that had any, and where their numbers start in `ids`.
        let mut prev: (&[ShardMeta], usize) = (&[], 0);
        for (rank, p) in plans.iter().enumerate() {
            let start = ids.len();
            let mut mains = 0;
            for (i, t) in p.tensors.iter().enumerate() {
                let id = match prev.0.get(i) {
                    Some(q) if q.key == t.key => ids[prev.1 + i],
                    _ => *by_key.entry(&*t.key).or_insert_with(|| {
                        firsts.push((rank, t));
                        key_mains.push(0);
                        (firsts.len() - 1) as u32
                    }),
                };
                ids.push(id);
                if t.main {
                    mains += 1;
                    key_mains[id as usize] += 1;
                }
            }
            rank_mains.push(mains);
            if !p.tensors.is_empty() {
                prev = (&p.tensors, start);
            }
        }
        Ok(KeyNumbers { firsts, ids, key_mains, rank_mains })
    }
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
fn check_global(first: &ShardMeta) -> Result<()> {
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
fn check_shard((r0, first): (usize, &ShardMeta), rank: usize, t: &ShardMeta) -> Result<()> {
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

fn validate_objects(plans: &[RankPlan]) -> Result<()> {
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

/// Spreads the writing of replicated chunks over the ranks that hold them (fully-parallel
/// save). A chunk is "replicated" when a main shard and replicas holding their bytes announce
/// the same key, box and flattened range. Each such chunk gets exactly one writer: groups are
/// taken largest first and go to the holder with the fewest bytes to write so far (ties to the
/// lowest rank), counting the unreplicated shards every rank writes anyway. Pure and
/// deterministic, so every rank computes the same assignment from the same plans with no extra
/// exchange; the set of chunks written, and so the checkpoint, does not change.
/// Returns the number of chunks whose writer moved off the main replica.
pub fn assign_writers(plans: &mut [RankPlan]) -> usize {
    type Ident<'a> = (&'a str, &'a [u64], &'a [u64], Option<(u64, u64)>);
    let ident = |t: &ShardMeta| -> (Arc<str>, Dims, Dims, Option<(u64, u64)>) {
        (t.key.clone(), t.offset.clone(), t.shape.clone(), t.flat)
    };
    // Holders (rank, shard index) of each replicated chunk; only chunks with a replica that
    // could write are considered, so layouts without replication cost one pass.
    /// Bytes of the chunk, its holders `(rank, shard index)`, how many of them are main.
    #[derive(Default)]
    struct Group {
        bytes: u64,
        holders: Vec<(usize, usize)>,
        mains: usize,
    }
    let mut groups: FastMap<Ident<'_>, Group> = FastMap::default();
    let owned: Vec<_>;
    {
        let mut replicas = Vec::new();
        for (r, p) in plans.iter().enumerate() {
            for (i, t) in p.tensors.iter().enumerate() {
                if !t.main && t.has_data && t.nbytes() > 0 {
                    replicas.push((r, i));
                }
            }
        }
        if replicas.is_empty() {
            return 0;
        }
        owned = replicas.iter().map(|&(r, i)| (r, i, ident(&plans[r].tensors[i]))).collect();
    }
    for (r, i, id) in &owned {
        let t = &plans[*r].tensors[*i];
        let g = groups.entry((&id.0, &id.1, &id.2, id.3)).or_default();
        g.bytes = t.nbytes();
        g.holders.push((*r, *i));
    }
    let mut load = vec![0u64; plans.len()];
    for (r, p) in plans.iter().enumerate() {
        for (i, t) in p.tensors.iter().enumerate() {
            if !t.main {
                continue;
            }
            match groups.get_mut(&(&*t.key, t.offset.as_slice(), t.shape.as_slice(), t.flat)) {
                Some(g) => {
                    g.holders.push((r, i));
                    g.mains += 1;
                }
                None => load[r] += t.nbytes(),
            }
        }
    }
    // Exactly one main replica: anything else is for validation to report, not to rebalance.
    let mut order: Vec<(Ident<'_>, Group)> = groups.into_iter().filter(|(_, g)| g.mains == 1).collect();
    order.sort_unstable_by(|a, b| b.1.bytes.cmp(&a.1.bytes).then_with(|| a.0.cmp(&b.0)));
    let mut flips = Vec::new();
    for (_, Group { bytes, mut holders, .. }) in order {
        holders.sort_unstable();
        let &(wr, wi) = holders.iter().min_by_key(|&&(r, _)| (load[r], r)).expect("a group has holders");
        load[wr] += bytes;
        for &(r, i) in &holders {
            flips.push((r, i, r == wr && i == wi));
        }
    }
    let mut moved = 0;
    for (r, i, writes) in flips {
        let t = &mut plans[r].tensors[i];
        if writes && !t.main {
            moved += 1;
        }
        t.main = writes;
    }
    moved
}

/// Name of the data file written by `rank` in save `save_id`.
pub fn data_file_name(save_id: u64, rank: usize) -> String {
    format!("{save_id:016x}-r{rank:05}.safetensors")
}

/// Layout of one rank's data file: safetensors entries for its main tensor shards (in plan
/// order), then its main object shards.
#[derive(Debug, Clone)]
pub struct FileLayout {
    /// Entries, tensors first.
    pub entries: Vec<SafetensorsEntry>,
    /// Size of the header; data starts here.
    pub header_len: u64,
    /// Total file size.
    pub size: u64,
    /// `(plan index, entry index)` of each main tensor shard.
    pub tensor_entries: Vec<usize>,
    /// Plan indices of the main object shards.
    pub object_entries: Vec<usize>,
}

/// Lays out a rank's data file. The header's size does not depend on checksum values.
pub fn layout_file(rank: usize, plan: &RankPlan, block_size: u64) -> FileLayout {
    let mut entries = Vec::new();
    let mut start = 0u64;
    let mut tensor_entries = Vec::new();
    let mut object_entries = Vec::new();
    for (i, t) in plan.tensors.iter().enumerate() {
        if !t.main {
            continue;
        }
        let len = t.nbytes();
        let shape = match t.flat {
            Some((s, e)) => vec![e - s],
            None => t.shape.to_vec(),
        };
        entries.push(SafetensorsEntry {
            name: format!("{}:{}", entries.len(), t.key),
            dtype: t.dtype,
            shape,
            start,
            len,
        });
        tensor_entries.push(i);
        start += len;
    }
    for (i, o) in plan.objects.iter().enumerate() {
        if !o.main {
            continue;
        }
        entries.push(SafetensorsEntry {
            name: format!("{}:{}", entries.len(), o.key),
            dtype: DType::U8,
            shape: vec![o.len],
            start,
            len: o.len,
        });
        object_entries.push(i);
        start += o.len;
    }
    let placeholder = placeholder_crcs(plan, &tensor_entries, &object_entries, block_size);
    let header = file_header(rank, plan, block_size, &entries, &tensor_entries, &object_entries, &placeholder);
    let header_len = header.len() as u64;
    FileLayout { entries, header_len, size: header_len + start, tensor_entries, object_entries }
}

fn placeholder_crcs(plan: &RankPlan, tensors: &[usize], objects: &[usize], block_size: u64) -> Vec<Vec<u32>> {
    let mut out: Vec<Vec<u32>> =
        tensors.iter().map(|&i| vec![0; plan.tensors[i].nbytes().div_ceil(block_size) as usize]).collect();
    out.extend(objects.iter().map(|_| vec![0u32]));
    out
}

/// The header bytes of a rank's data file, with the checksums of each entry (tensors, then objects).
pub fn file_header(
    rank: usize,
    plan: &RankPlan,
    block_size: u64,
    entries: &[SafetensorsEntry],
    tensor_entries: &[usize],
    object_entries: &[usize],
    crcs: &[Vec<u32>],
) -> Vec<u8> {
    let mut chunks = Vec::new();
    for (n, &i) in tensor_entries.iter().enumerate() {
        let t = &plan.tensors[i];
        chunks.push(json!({
            "name": entries[n].name,
            "key": &*t.key,
            "dtype": t.dtype.name(),
            "global_shape": t.global_shape.as_slice(),
            "global_offset": t.offset.as_slice(),
            "shape": t.shape.as_slice(),
            "flat": t.flat.map(|(s, e)| vec![s, e]),
            "crc32c": crc_hex(&crcs[n]),
        }));
    }
    let mut objects = Vec::new();
    for (n, &i) in object_entries.iter().enumerate() {
        let o = &plan.objects[i];
        let e = tensor_entries.len() + n;
        objects.push(json!({
            "name": entries[e].name,
            "key": o.key,
            "global_shape": o.global_shape,
            "global_offset": o.offset,
            "crc32c": crc_hex(&crcs[e]),
        }));
    }
    let mut meta = Map::new();
    meta.insert("format".into(), J::String(NATIVE_BACKEND.into()));
    meta.insert("format_version".into(), J::String(FORMAT_VERSION.to_string()));
    meta.insert("rank".into(), J::String(rank.to_string()));
    meta.insert("block_size".into(), J::String(block_size.to_string()));
    meta.insert("chunks".into(), J::String(J::Array(chunks).to_string()));
    meta.insert("objects".into(), J::String(J::Array(objects).to_string()));
    crate::format::build_header(entries, &meta, crate::format::DATA_ALIGN)
}

/// What a rank reports after writing its data file.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct WrittenFile {
    /// File name (empty: the rank wrote nothing).
    pub name: String,
    /// File size.
    pub size: u64,
    /// Header size.
    pub header_len: u64,
    /// crc32c of the header.
    pub header_crc: u32,
    /// Per main tensor shard (plan order): byte offset in the file and block checksums.
    pub tensors: Vec<(u64, Crcs)>,
    /// Per main object shard (plan order): byte offset, length, checksum.
    pub objects: Vec<(u64, u64, u32)>,
}

impl WrittenFile {
    /// Binary encoding.
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Encoder::default();
        e.str(&self.name);
        e.var(self.size);
        e.var(self.header_len);
        e.u32_le(self.header_crc);
        e.var(self.tensors.len() as u64);
        for (off, crcs) in &self.tensors {
            e.var(*off);
            e.var(crcs.len() as u64);
            for &c in crcs {
                e.u32_le(c);
            }
        }
        e.var(self.objects.len() as u64);
        for &(off, len, crc) in &self.objects {
            e.var(off);
            e.var(len);
            e.u32_le(crc);
        }
        e.buf
    }

    /// Inverse of [`WrittenFile::encode`].
    pub fn decode(bytes: &[u8]) -> Result<WrittenFile, String> {
        let mut d = Decoder::new(bytes);
        let name = d.str()?;
        let size = d.var()?;
        let header_len = d.var()?;
        let header_crc = d.u32_le()?;
        let n = d.count()?;
        let mut tensors = Vec::with_capacity(n);
        for _ in 0..n {
            let off = d.var()?;
            let k = d.count()?;
            let mut crcs = Crcs::with_capacity(k.min(d.remaining() / 4));
            for _ in 0..k {
                crcs.push(d.u32_le()?);
            }
            tensors.push((off, crcs));
        }
        let n = d.count()?;
        let mut objects = Vec::with_capacity(n);
        for _ in 0..n {
            objects.push((d.var()?, d.var()?, d.u32_le()?));
        }
        Ok(WrittenFile { name, size, header_len, header_crc, tensors, objects })
    }
}

/// Assembles the global index from every rank's plan and written file (rank order); the
/// checksums of the written files move into it. Each tensor's chunks are put in canonical
/// order by a task of `for_each` (side by side when the caller gives it threads).
pub fn build_index(
    plans: &[RankPlan],
    written: Vec<WrittenFile>,
    block_size: u64,
    common: Vec<(StatePath, Value)>,
    content_metadata: Value,
    for_each: ForEach<'_>,
) -> Result<CheckpointIndex> {
    if written.len() != plans.len() {
        return Err(Error::Comm { reason: format!("{} write reports for {} plans", written.len(), plans.len()) });
    }
    // Tensors are numbered in order of first appearance; keys whose every shard is a replica
    // or empty still belong to the checkpoint.
    let keys = KeyNumbers::of(plans)?;
    for (rank, (plan, w)) in plans.iter().zip(&written).enumerate() {
        let main_objects = plan.objects.iter().filter(|o| o.main).count();
        if keys.rank_mains[rank] != w.tensors.len() || main_objects != w.objects.len() {
            return Err(Error::Comm { reason: format!("rank {rank} reported a file that does not match its plan") });
        }
    }
    // Each tensor's list of chunks is allocated once, at its size.
    let mut chunks: Vec<Vec<StoredChunk>> = keys.key_mains.iter().map(|&n| Vec::with_capacity(n)).collect();
    let mut files = Vec::new();
    let mut objects: HashMap<&str, ObjectEntry> = HashMap::new();
    let mut ids = keys.ids.iter();
    for (plan, w) in plans.iter().zip(written) {
        let file = files.len() as u32;
        let WrittenFile { name, size, header_len, header_crc, tensors: written_chunks, objects: written_objects } = w;
        // Counted above: as many written entries as main shards.
        if !written_chunks.is_empty() || !written_objects.is_empty() {
            files.push(FileEntry { name, size, header_len, header_crc });
        }
        let mut written_chunks = written_chunks.into_iter();
        for t in &plan.tensors {
            let id = *ids.next().expect("a number per shard");
            if !t.main {
                continue;
            }
            let (byte_offset, crcs) = written_chunks.next().expect("counted above");
            chunks[id as usize].push(StoredChunk {
                file,
                byte_offset,
                offset: t.offset.clone(),
                shape: t.shape.clone(),
                flat: t.flat,
                crcs,
            });
        }
        for (o, (byte_offset, len, crc)) in plan.objects.iter().filter(|o| o.main).zip(written_objects) {
            let entry = objects.entry(o.key.as_str()).or_insert_with(|| ObjectEntry {
                key: o.key.clone(),
                global_shape: o.global_shape.clone(),
                shards: Vec::new(),
            });
            entry.shards.push(StoredObject { offset: o.offset.clone(), file, byte_offset, len, crc });
        }
    }
    // Canonical order: a sort per tensor, the tensors independent of each other.
    let chunks: Vec<Mutex<Vec<StoredChunk>>> = chunks.into_iter().map(Mutex::new).collect();
    let entries: Vec<Mutex<Option<TensorEntry>>> = chunks.iter().map(|_| Mutex::new(None)).collect();
    for_each(chunks.len(), &|i| {
        let list = std::mem::take(&mut *chunks[i].lock().unwrap_or_else(|e| e.into_inner()));
        let t = keys.firsts[i].1;
        let entry = TensorEntry::new(t.key.to_string(), t.dtype, t.global_shape.to_vec(), list);
        *entries[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(entry);
    });
    let tensors = entries
        .into_iter()
        .map(|e| e.into_inner().unwrap_or_else(|e| e.into_inner()))
        .collect::<Option<Vec<TensorEntry>>>()
        .ok_or_else(|| Error::invalid("a tensor of the index was not assembled (ForEach skipped a task)"))?;
    let mut index = CheckpointIndex {
        backend: NATIVE_BACKEND.into(),
        version: FORMAT_VERSION,
        block_size,
        content_metadata,
        common,
        files,
        tensors,
        objects: objects.into_values().collect(),
        omitted_tensors: Vec::new(),
    };
    index.sort_entries();
    Ok(index)
}

/// What a rank announces when saving with a plan cache: one small message instead of its plan.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CacheCheck {
    /// This rank's plan hashes to the one it cached.
    pub matches: bool,
    /// Save id of the save the rank's cache comes from (0: none).
    pub generation: u64,
    /// Rank 0 only: this save's id.
    pub save_id: u64,
    /// Rank 0 only: a committed checkpoint exists and overwrite was not asked for.
    pub refuse_overwrite: bool,
}

const CACHE_CHECK_TAG: u8 = 0x63;

impl CacheCheck {
    /// Binary encoding (a few dozen bytes).
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Encoder::default();
        e.u8(CACHE_CHECK_TAG);
        e.u8(self.matches as u8 | (self.refuse_overwrite as u8) << 1);
        e.var(self.generation);
        e.var(self.save_id);
        e.buf
    }

    /// Decodes [`CacheCheck::encode`]'s output.
    pub fn decode(b: &[u8]) -> std::result::Result<Self, String> {
        let mut d = Decoder::new(b);
        if d.u8()? != CACHE_CHECK_TAG {
            return Err("not a plan-cache message (do all ranks save with a plan cache?)".into());
        }
        let flags = d.u8()?;
        let generation = d.var()?;
        let save_id = d.var()?;
        Ok(CacheCheck { matches: flags & 1 != 0, generation, save_id, refuse_overwrite: flags & 2 != 0 })
    }
}

/// Whether every rank may reuse its cached plan: all match, and all caches come from the same
/// save (so they hold the same global plan). Every rank decides alike from the same messages.
pub fn cache_hit(checks: &[CacheCheck]) -> bool {
    checks.iter().all(|c| c.matches && c.generation != 0 && c.generation == checks[0].generation)
}

/// The save options that shape the global plan (checksum block size, validation, writer
/// assignment), as the `extra` bytes of [`plan_digest`].
pub fn plan_options(block_size: u64, validate: bool, distribute_replicas: bool) -> Vec<u8> {
    let mut b = block_size.to_le_bytes().to_vec();
    b.push(validate as u8);
    b.push(distribute_replicas as u8);
    b
}

/// The structure of a rank's plan (without the save's id or flags), plus `extra` bytes
/// (the options that shape the global plan), hashed to 128 bits.
pub fn plan_digest(plan: &RankPlan, extra: &[u8]) -> [u64; 2] {
    let mut e = Encoder::default();
    plan.encode_structure(&mut e);
    e.buf.extend_from_slice(extra);
    super::fasthash::digest128(&e.buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs the parts last to first: any order a caller's threads may give.
    fn reversed(n: usize, work: &(dyn Fn(usize) + Sync)) {
        (0..n).rev().for_each(work);
    }

    /// Rank `rank` of `world` holds row `rank` of every key of `keys` (each `[world, 4]`).
    fn rows(rank: usize, world: usize, keys: usize) -> RankPlan {
        let tensors = (0..keys)
            .map(|k| ShardMeta {
                key: format!("k{k:03}").into(),
                dtype: DType::F32,
                global_shape: vec![world as u64, 4].into(),
                offset: vec![rank as u64, 0].into(),
                shape: vec![1, 4].into(),
                flat: None,
                main: true,
                has_data: true,
            })
            .collect();
        RankPlan { save_id: rank as u64, tensors, ..RankPlan::default() }
    }

    #[test]
    fn the_data_section_starts_at_a_page_boundary() {
        let plan = rows(0, 2, 3);
        let layout = layout_file(0, &plan, 1 << 20);
        assert!(layout.header_len.is_multiple_of(crate::format::DATA_ALIGN), "{}", layout.header_len);
        let crcs = vec![vec![0xdead_beef]; 3];
        let header =
            file_header(0, &plan, 1 << 20, &layout.entries, &layout.tensor_entries, &layout.object_entries, &crcs);
        assert_eq!(header.len() as u64, layout.header_len);
        let mut read = |at: u64, buf: &mut [u8]| {
            buf.copy_from_slice(&header[at as usize..][..buf.len()]);
            Ok(())
        };
        let (_, data_start) = crate::format::parse_header(&mut read, header.len() as u64).unwrap();
        assert_eq!(data_start, layout.header_len);
    }

    #[test]
    fn decoding_in_parts_gives_the_serial_result() {
        let world = 300;
        let messages: Vec<Vec<u8>> = (0..world).map(|r| rows(r, world, 5).encode()).collect();
        let serial = RankPlan::decode_all(&messages).unwrap();
        assert_eq!(serial, (0..world).map(|r| rows(r, world, 5)).collect::<Vec<_>>());
        assert_eq!(RankPlan::decode_all_with(&messages, &reversed).unwrap(), serial);
        let mut bad = messages.clone();
        bad[170].truncate(3);
        bad[250].clear();
        assert_eq!(RankPlan::decode_all_with(&bad, &reversed).unwrap_err().0, 170);
        assert_eq!(RankPlan::decode_all(&bad).unwrap_err().0, 170);
    }

    #[test]
    fn validating_in_parts_reports_the_first_failing_key() {
        let world = 4;
        let keys = 3 * KEYS_PER_PART + 5;
        let mut plans: Vec<RankPlan> = (0..world).map(|r| rows(r, world, keys)).collect();
        validate_global_with(&plans, &reversed).unwrap();
        // Two keys in different parts lose a row: the earlier key is reported, however run.
        for k in [KEYS_PER_PART + 3, 3 * KEYS_PER_PART + 1] {
            plans[2].tensors[k].main = false;
        }
        let want = format!("k{:03}", KEYS_PER_PART + 3);
        for r in [validate_global(&plans), validate_global_with(&plans, &reversed)] {
            assert!(matches!(&r, Err(Error::InvalidSharding { key, .. }) if *key == want), "{r:?}");
        }
    }

    /// Validation as it was before key numbers, parts and box ranges: every key's shards in rank
    /// order, each flattened range cut into boxes, one sweep per key, keys in key order. What
    /// [`validate_global_with`] must agree with, error text included.
    fn reference(plans: &[RankPlan]) -> Result<()> {
        let mut by_key: std::collections::BTreeMap<&str, Vec<(usize, &ShardMeta)>> = Default::default();
        for (rank, p) in plans.iter().enumerate() {
            for t in &p.tensors {
                by_key.entry(&t.key).or_default().push((rank, t));
            }
        }
        for (key, shards) in &by_key {
            let (r0, first) = shards[0];
            check_global(first)?;
            let mut pieces = Vec::new();
            for &(rank, t) in shards {
                check_shard((r0, first), rank, t)?;
                if t.main {
                    pieces.extend(t.pieces());
                }
            }
            check_tiling(&first.global_shape, &pieces).map_err(|reason| Error::sharding(*key, reason))?;
        }
        validate_objects(plans)
    }

    /// Plans of up to 6 ranks holding keys of 1 to 4 axes, each split along axis 0 into boxes,
    /// each box whole or cut into flattened ranges, spread over random ranks in random orders,
    /// with replicas, and often one defect (a shard lost, doubled or stretched, another dtype or
    /// global shape, a box outside the tensor).
    fn random_plans(rng: &mut crate::test_rng::TestRng) -> Vec<RankPlan> {
        let mut next = |n: u64| rng.below(n);
        let world = 1 + next(6) as usize;
        let mut plans = vec![RankPlan::default(); world];
        for k in 0..1 + next(6) {
            // Keys collide at times: two layouts of one key.
            let key: Arc<str> = format!("k{}", if next(6) == 0 { 0 } else { k }).into();
            let ndim = 1 + next(4) as usize;
            let global: Vec<u64> = (0..ndim).map(|_| 1 + next(4)).collect();
            let mut cuts: Vec<u64> = (0..next(3)).map(|_| next(global[0] + 1)).collect();
            cuts.extend([0, global[0]]);
            cuts.sort_unstable();
            cuts.dedup();
            let mut shards = Vec::new();
            for w in cuts.windows(2) {
                let mut offset = vec![0; ndim];
                offset[0] = w[0];
                let mut shape = global.clone();
                shape[0] = w[1] - w[0];
                let n = numel(&shape);
                let meta = |flat| ShardMeta {
                    key: key.clone(),
                    dtype: DType::F32,
                    global_shape: global.as_slice().into(),
                    offset: offset.as_slice().into(),
                    shape: shape.as_slice().into(),
                    flat,
                    main: true,
                    has_data: true,
                };
                if next(2) == 0 {
                    shards.push(meta(None));
                } else {
                    let mut at: Vec<u64> = (0..next(4)).map(|_| next(n + 1)).collect();
                    at.extend([0, n]);
                    at.sort_unstable();
                    for r in at.windows(2) {
                        shards.push(meta(Some((r[0], r[1]))));
                    }
                }
            }
            if next(2) == 0 && !shards.is_empty() {
                let i = next(shards.len() as u64) as usize;
                match next(7) {
                    0 => drop(shards.remove(i)),
                    1 => shards.push(shards[i].clone()),
                    2 => shards[i].flat = shards[i].flat.map(|(s, e)| (s, e + 1)),
                    3 => shards[i].dtype = DType::BF16,
                    4 => shards[i].global_shape[0] += 1,
                    5 => shards[i].offset[0] += 1,
                    _ => shards[i].main = false,
                }
            }
            for t in shards {
                if next(3) == 0 {
                    let replica = ShardMeta { main: false, has_data: next(2) == 0, ..t.clone() };
                    plans[next(world as u64) as usize].tensors.push(replica);
                }
                plans[next(world as u64) as usize].tensors.push(t);
            }
        }
        for p in &mut plans {
            // Usually each rank in key order; sometimes reversed.
            if next(3) == 0 {
                p.tensors.reverse();
            }
        }
        plans
    }

    #[test]
    fn validation_agrees_with_the_plain_sweep_on_random_layouts() {
        let mut rng = crate::test_rng::TestRng::new(0x7e55_e7a0);
        let (mut valid, mut invalid) = (0, 0);
        for round in 0..3000 {
            let plans = random_plans(&mut rng);
            let want = reference(&plans);
            let got = validate_global_with(&plans, &reversed);
            assert_eq!(format!("{got:?}"), format!("{want:?}"), "round {round}: {plans:?}");
            // Decoding the messages gives the same plans, keys shared.
            let messages: Vec<Vec<u8>> = plans.iter().map(RankPlan::encode).collect();
            assert_eq!(RankPlan::decode_all(&messages).unwrap(), plans);
            if got.is_ok() {
                valid += 1;
            } else {
                invalid += 1;
            }
        }
        assert!(valid > 500 && invalid > 500, "{valid} valid, {invalid} invalid");
    }

    #[test]
    fn the_index_gets_every_shard_whatever_order_ranks_announce_keys_in() {
        // Rank r holds row r of a, b and c (each [3, 2]), in another order on each rank; rank 3
        // holds nothing.
        let orders = [["a", "b", "c"], ["c", "a", "b"], ["b", "c", "a"]];
        let mut plans: Vec<RankPlan> = orders
            .iter()
            .enumerate()
            .map(|(r, keys)| RankPlan {
                tensors: keys
                    .iter()
                    .map(|&k| ShardMeta {
                        key: k.into(),
                        dtype: DType::F32,
                        global_shape: [3, 2].into(),
                        offset: [r as u64, 0].into(),
                        shape: [1, 2].into(),
                        flat: None,
                        main: true,
                        has_data: true,
                    })
                    .collect(),
                ..RankPlan::default()
            })
            .collect();
        plans.push(RankPlan::default());
        validate_global(&plans).unwrap();
        let written: Vec<WrittenFile> = (0..plans.len())
            .map(|r| match r {
                3 => WrittenFile::default(),
                _ => WrittenFile {
                    name: data_file_name(1, r),
                    size: 200,
                    header_len: 100,
                    header_crc: 0,
                    tensors: (0..3).map(|i| (100 + 8 * i as u64, vec![(10 * r + i) as u32].into())).collect(),
                    objects: Vec::new(),
                },
            })
            .collect();
        let index = build_index(&plans, written, 1 << 20, Vec::new(), Value::Null, &reversed).unwrap();
        assert_eq!(index.files.len(), 3);
        assert_eq!(index.tensors.iter().map(|t| t.key.as_str()).collect::<Vec<_>>(), ["a", "b", "c"]);
        for t in &index.tensors {
            assert_eq!(t.chunks().len(), 3);
            for (r, c) in t.chunks().iter().enumerate() {
                let i = orders[r].iter().position(|&k| k == t.key).unwrap();
                assert_eq!((c.file as usize, c.offset.as_slice()), (r, [r as u64, 0].as_slice()));
                assert_eq!((c.byte_offset, c.crcs.as_slice()), (100 + 8 * i as u64, [(10 * r + i) as u32].as_slice()));
            }
        }
    }
}
