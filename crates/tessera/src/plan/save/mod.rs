//! Save planning, one file per job: what each rank announces (here: shards, objects, the
//! rank's plan and its encoding, the numbering of keys), the global validation of every plan
//! (`validate`), the spreading of replicated chunks over their holders (`assign`), the layout of
//! a data file (`layout`), the index assembled from the written files (`index`), and the plan
//! cache's check (`cache`).

mod assign;
mod cache;
mod index;
mod layout;
mod validate;

pub use assign::assign_writers;
pub use cache::{cache_hit, plan_digest, plan_options, CacheCheck};
pub use index::{build_index, WrittenFile};
pub use layout::{layout_file, FileLayout};
#[cfg(test)]
pub use validate::validate_global;
pub use validate::validate_global_with;

use std::sync::{Arc, Mutex};

use super::fasthash::FastMap;
use super::geometry::{decompose_flat_into, numel, Piece};
use super::ForEach;
use crate::error::{Error, Result};
use crate::model::codec::{Decoder, Encoder};
use crate::model::dims::Dims;
use crate::model::dtype::DType;

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

#[cfg(test)]
mod tests {
    use super::validate::{check_global, check_shard, validate_objects};
    use super::*;
    use crate::format::data_file_name;
    use crate::model::Value;
    use crate::plan::geometry::check_tiling;

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
        assert!(layout.header_len.is_multiple_of(crate::format::safetensors::DATA_ALIGN), "{}", layout.header_len);
        let crcs = vec![vec![0xdead_beef]; 3];
        let header = layout.header(0, &plan, 1 << 20, &crcs);
        assert_eq!(header.len() as u64, layout.header_len);
        let mut read = |at: u64, buf: &mut [u8]| {
            buf.copy_from_slice(&header[at as usize..][..buf.len()]);
            Ok(())
        };
        let (_, data_start) = crate::format::safetensors::parse_header(&mut read, header.len() as u64).unwrap();
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
