//! Save planning: what each rank announces, global validation, data-file layout, index build.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use serde_json::{json, Map, Value as J};

use super::fasthash::FastMap;
use super::geometry::{check_tiling, decompose_flat, numel, Piece};
use super::ForEach;
use crate::error::{Error, Result};
use crate::format::{
    crc_hex, CheckpointIndex, FileEntry, ObjectEntry, SafetensorsEntry, StoredChunk, StoredObject, TensorEntry,
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
    /// The boxes this shard covers.
    pub fn pieces(&self) -> Vec<Piece> {
        match self.flat {
            Some((s, e)) => decompose_flat(&self.offset, &self.shape, s, e),
            None => vec![Piece::new(&self.offset, &self.shape)],
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
        Self::decode_interned(bytes, &mut FastMap::default())
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
        messages
            .iter()
            .enumerate()
            .map(|(i, m)| Self::decode_interned(m.as_ref(), &mut keys).map_err(|e| (first_rank + i, e)))
            .collect()
    }

    fn decode_interned(bytes: &[u8], keys: &mut FastMap<Box<[u8]>, Arc<str>>) -> Result<RankPlan, String> {
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
                    match keys.get(raw) {
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
            let global_shape = (0..nd).map(|_| d.var()).collect::<Result<Dims, _>>()?;
            let offset = (0..nd).map(|_| d.var()).collect::<Result<Dims, _>>()?;
            let shape = (0..nd).map(|_| d.var()).collect::<Result<Dims, _>>()?;
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
    let mut by_key: FastMap<&str, Vec<(usize, &ShardMeta)>> = FastMap::default();
    for (rank, p) in plans.iter().enumerate() {
        for t in &p.tensors {
            by_key.entry(&*t.key).or_default().push((rank, t));
        }
    }
    let mut keys: Vec<KeyShards<'_>> = by_key.into_iter().collect();
    keys.sort_unstable_by(|a, b| a.0.cmp(b.0));
    // Keys are independent: parts may run side by side; the first failing key in key order wins.
    let parts: Vec<&[KeyShards<'_>]> = keys.chunks(KEYS_PER_PART).collect();
    let first: Mutex<Option<(usize, Error)>> = Mutex::new(None);
    for_each(parts.len(), &|p| {
        if let Some((k, e)) = validate_keys(parts[p]).err() {
            let mut first = first.lock().unwrap_or_else(|e| e.into_inner());
            let at = p * KEYS_PER_PART + k;
            if first.as_ref().is_none_or(|(f, _)| at < *f) {
                *first = Some((at, e));
            }
        }
    });
    if let Some((_, e)) = first.into_inner().unwrap_or_else(|e| e.into_inner()) {
        return Err(e);
    }
    validate_objects(plans)
}

/// A key with its shards and the ranks that hold them.
type KeyShards<'p> = (&'p str, Vec<(usize, &'p ShardMeta)>);

/// Checks the shards of `keys` (each key with its shards and their ranks, as
/// [`validate_global`] groups them) on the calling thread: a part of its work. Fails with the
/// position in `keys` of the first failing key and its error.
fn validate_keys(keys: &[KeyShards<'_>]) -> std::result::Result<(), (usize, Error)> {
    for (k, (key, shards)) in keys.iter().enumerate() {
        validate_key(key, shards).map_err(|e| (k, e))?;
    }
    Ok(())
}

fn validate_key(key: &str, shards: &[(usize, &ShardMeta)]) -> Result<()> {
    let (r0, first) = shards[0];
    let mut pieces = Vec::new();
    for &(rank, t) in shards {
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
            if t.offset[d] + t.shape[d] > t.global_shape[d] {
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
            if s > e || e > numel(&t.shape) {
                return Err(Error::sharding(key, format!("rank {rank}: flattened range {s}..{e} outside its box")));
            }
        }
        if t.main {
            pieces.extend(t.pieces());
        }
    }
    check_tiling(&first.global_shape, &pieces).map_err(|reason| Error::sharding(key, reason))
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
    crate::format::build_header(entries, &meta)
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
    pub tensors: Vec<(u64, Vec<u32>)>,
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
            tensors.push((off, (0..k).map(|_| d.u32_le()).collect::<Result<Vec<_>, _>>()?));
        }
        let n = d.count()?;
        let mut objects = Vec::with_capacity(n);
        for _ in 0..n {
            objects.push((d.var()?, d.var()?, d.u32_le()?));
        }
        Ok(WrittenFile { name, size, header_len, header_crc, tensors, objects })
    }
}

/// Assembles the global index from every rank's plan and written file (rank order).
pub fn build_index(
    plans: &[RankPlan],
    written: &[WrittenFile],
    block_size: u64,
    common: Vec<(StatePath, Value)>,
    content_metadata: Value,
) -> Result<CheckpointIndex> {
    let mut files = Vec::new();
    // (key, dtype, global shape) and the chunks of each tensor, in order of first appearance.
    let mut tensors: Vec<(&ShardMeta, Vec<StoredChunk>)> = Vec::new();
    // Keys are interned per decoding thread: look up by pointer first, by text on a miss.
    let mut by_ptr: FastMap<usize, usize> = FastMap::default();
    let mut by_key: FastMap<&str, usize> = FastMap::default();
    let mut objects: HashMap<&str, ObjectEntry> = HashMap::new();
    for (rank, (plan, w)) in plans.iter().zip(written).enumerate() {
        let mains = plan.tensors.iter().filter(|t| t.main).count();
        let main_objects: Vec<&ObjectMeta> = plan.objects.iter().filter(|o| o.main).collect();
        if mains != w.tensors.len() || main_objects.len() != w.objects.len() {
            return Err(Error::Comm { reason: format!("rank {rank} reported a file that does not match its plan") });
        }
        let file = files.len() as u32;
        if mains > 0 || !main_objects.is_empty() {
            files.push(FileEntry {
                name: w.name.clone(),
                size: w.size,
                header_len: w.header_len,
                header_crc: w.header_crc,
            });
        }
        let mut written_chunks = w.tensors.iter();
        if rank == 0 {
            // Every rank usually holds a shard of every key: size the chunk lists once.
            tensors.reserve(plan.tensors.len());
        }
        for t in &plan.tensors {
            let ptr = Arc::as_ptr(&t.key) as *const u8 as usize;
            let ti = match by_ptr.get(&ptr) {
                Some(&i) => i,
                None => {
                    let i = *by_key.entry(&*t.key).or_insert_with(|| {
                        tensors.push((t, Vec::with_capacity(plans.len())));
                        tensors.len() - 1
                    });
                    by_ptr.insert(ptr, i);
                    i
                }
            };
            // Keys whose every shard is a replica or empty still belong to the checkpoint.
            if !t.main {
                continue;
            }
            let (byte_offset, crcs) = written_chunks.next().expect("counted above");
            tensors[ti].1.push(StoredChunk {
                file,
                byte_offset: *byte_offset,
                offset: t.offset.clone(),
                shape: t.shape.clone(),
                flat: t.flat,
                crcs: crcs.clone(),
            });
        }
        for (o, &(byte_offset, len, crc)) in main_objects.into_iter().zip(&w.objects) {
            let entry = objects.entry(o.key.as_str()).or_insert_with(|| ObjectEntry {
                key: o.key.clone(),
                global_shape: o.global_shape.clone(),
                shards: Vec::new(),
            });
            entry.shards.push(StoredObject { offset: o.offset.clone(), file, byte_offset, len, crc });
        }
    }
    let tensors = tensors
        .into_iter()
        .map(|(t, chunks)| TensorEntry::new(t.key.to_string(), t.dtype, t.global_shape.to_vec(), chunks))
        .collect();
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
}
