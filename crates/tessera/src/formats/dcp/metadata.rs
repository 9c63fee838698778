//! The `.metadata` file of a PyTorch Distributed Checkpoint (torch ≥ 2.0, Megatron
//! `torch_dist`, OLMo-core): a pickle of `Metadata` whose dataclasses are read by field name,
//! whatever module names their classes (torch, older torch, Megatron, OLMo-core).

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hash};
use std::sync::Arc;

use crate::formats::pickle::{Items, PickleRef, PickleView};
use crate::formats::torch_save::torch_dtype;
use crate::model::dims::check_axes;
use crate::model::dtype::DType;
use crate::model::PathSeg;

/// Where one item (a tensor chunk or a byte value) is stored.
///
/// A checkpoint has a few data files and few kinds of transforms but may have millions of
/// items: every item of a file shares one copy of its name, and every item of the same
/// transforms one list (none is one shared empty list), so an item costs its 48 bytes and no
/// allocation of its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ItemLocation {
    /// Data file, relative to the checkpoint directory.
    pub relative_path: Arc<str>,
    /// Byte offset of the item in the file.
    pub offset: u64,
    /// Byte length of the item.
    pub length: u64,
    /// Transforms applied to the item's bytes, outermost last (`["stream.zstd/1"]`).
    pub transforms: Arc<[String]>,
}

/// A stored chunk of a tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DcpChunk {
    pub offsets: Vec<u64>,
    pub sizes: Vec<u64>,
    pub location: ItemLocation,
}

/// A tensor of the checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DcpTensor {
    pub fqn: String,
    pub dtype: DType,
    pub size: Vec<u64>,
    pub chunks: Vec<DcpChunk>,
}

/// A non-tensor value of the checkpoint (stored as `torch.save` of the value).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DcpBytes {
    pub fqn: String,
    /// Path in the original state dict (from `planner_data`), when recorded and other than
    /// `[fqn]` (a flat state dict's: not kept twice for each of a million items).
    pub path: Option<Vec<PathSeg>>,
    pub location: ItemLocation,
}

/// What a `.metadata` file describes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DcpMetadata {
    pub tensors: Vec<DcpTensor>,
    pub bytes: Vec<DcpBytes>,
    /// `storage_meta.save_id`, when recorded (torch: a uuid; tessera: see
    /// `formats::torch_dist::metadata_save_id`).
    pub save_id: Option<String>,
}

/// The keys and values of a dict.
type Fields<'p> = Items<'p>;

/// The field dict of a dataclass instance: its BUILD state (a dict, or the `(dict, slots)`
/// pair of a slotted class).
fn fields(v: PickleRef<'_>) -> Option<Fields<'_>> {
    match v.view() {
        PickleView::Object(o) => match o.state()?.view() {
            PickleView::Dict(d) => Some(d),
            PickleView::Tuple(t) => t.iter().collect::<Vec<_>>().into_iter().rev().find_map(|x| match x.view() {
                PickleView::Dict(d) if d.len() > 0 => Some(d),
                _ => None,
            }),
            _ => None,
        },
        PickleView::Dict(d) => Some(d),
        _ => None,
    }
}

fn field<'p>(f: Fields<'p>, name: &str) -> Option<PickleRef<'p>> {
    f.pairs().find(|(k, _)| k.as_str() == Some(name)).map(|(_, v)| v)
}

fn need<'p>(f: Fields<'p>, name: &str, what: &str) -> Result<PickleRef<'p>, String> {
    field(f, name).ok_or_else(|| format!("{what} has no field {name:?}"))
}

/// A `_StorageInfo` as the pickle holds it: checked, not yet copied out.
struct RawLocation<'p> {
    relative_path: &'p str,
    offset: u64,
    length: u64,
    /// Empty (no allocation) for the items with no transforms, nearly all of them.
    transforms: Vec<&'p str>,
}

fn location<'p>(v: PickleRef<'p>, fqn: &str) -> Result<RawLocation<'p>, String> {
    let what = format!("storage info of {fqn:?}");
    let f = fields(v).ok_or_else(|| format!("{what} is {}, expected a _StorageInfo", v.describe()))?;
    let path_ref = need(f, "relative_path", &what)?;
    let relative_path =
        path_ref.as_str().ok_or_else(|| format!("{what} is {}, expected a string", path_ref.describe()))?;
    // The same rule as every name a Storage reads (plain components: no `..`, `\\`, NUL).
    if crate::storage::names::check_relative_name(relative_path).is_err() {
        return Err(format!("{what}: data file {relative_path:?} is not a plain relative name"));
    }
    let offset = need(f, "offset", &what)?.as_u64().ok_or_else(|| format!("{what}: offset is not an int"))?;
    let length = need(f, "length", &what)?.as_u64().ok_or_else(|| format!("{what}: length is not an int"))?;
    if offset.checked_add(length).is_none() {
        return Err(format!("{what}: offset + length overflows"));
    }
    let transforms = match field(f, "transform_descriptors").map(PickleRef::view) {
        None | Some(PickleView::None) => Vec::new(),
        Some(PickleView::List(xs)) | Some(PickleView::Tuple(xs)) => xs
            .iter()
            .map(|x| x.as_str().ok_or_else(|| format!("{what} is {}, expected a string", x.describe())))
            .collect::<Result<_, _>>()?,
        Some(_) => {
            let other = field(f, "transform_descriptors").map(PickleRef::describe).unwrap_or_default();
            return Err(format!("{what}: transform_descriptors is {other}"));
        }
    };
    Ok(RawLocation { relative_path, offset, length, transforms })
}

/// The one copy of each data file name and each list of transforms that the items of a
/// `.metadata` share (see [`ItemLocation`]).
struct Shared<'p> {
    paths: HashMap<&'p str, Arc<str>>,
    transforms: HashMap<Vec<&'p str>, Arc<[String]>>,
    no_transforms: Arc<[String]>,
}

impl<'p> Shared<'p> {
    fn new() -> Self {
        Shared { paths: HashMap::new(), transforms: HashMap::new(), no_transforms: Arc::from(Vec::new()) }
    }

    fn location(&mut self, raw: RawLocation<'p>) -> ItemLocation {
        let relative_path = self.paths.entry(raw.relative_path).or_insert_with(|| Arc::from(raw.relative_path)).clone();
        let transforms = if raw.transforms.is_empty() {
            self.no_transforms.clone()
        } else {
            self.transforms
                .entry(raw.transforms)
                .or_insert_with_key(|t| t.iter().map(|x| x.to_string()).collect())
                .clone()
        };
        ItemLocation { relative_path, offset: raw.offset, length: raw.length, transforms }
    }
}

/// The entries of a dict by the hash of their keys: a lookup by key in a dict of millions of
/// entries for 8 bytes an entry and a second pass over the arena, where a `HashMap` of borrowed
/// keys took about 70 (issue 29). `key` reads the key of entry `i` again for each comparison
/// (`None`: not a key this table finds). An equal key given twice is found once, at its last
/// entry, as a map would keep it; each entry can be taken once ([`KeyTable::take`]).
struct KeyTable<K, F: Fn(usize) -> Option<K>> {
    /// `(hash, entry)`, sorted, one per distinct key.
    slots: Vec<(u32, u32)>,
    /// Whether each slot was taken.
    taken: Vec<bool>,
    hasher: RandomState,
    key: F,
}

impl<K: Hash + Eq, F: Fn(usize) -> Option<K>> KeyTable<K, F> {
    /// The table of entries `0..n`; more than `u32::MAX` are refused (no pickle that fits the
    /// unpickler's limits holds as many).
    fn new(n: usize, key: F) -> Result<Self, String> {
        let n32 = u32::try_from(n).map_err(|_| format!("{n} entries: too many to index"))?;
        // Keyed by a random hash (a crafted file cannot make its keys collide), truncated to
        // 32 bits: the few collisions of a million keys are told apart by comparing the keys.
        let hasher = RandomState::new();
        let mut slots: Vec<(u32, u32)> =
            (0..n32).filter_map(|i| key(i as usize).map(|k| (hasher.hash_one(&k) as u32, i))).collect();
        slots.sort_unstable();
        // Equal keys are neighbours (equal hashes, entries in order): keep the last of each,
        // comparing each entry with the distinct keys of its hash kept so far.
        let mut kept: Vec<(u32, u32)> = Vec::with_capacity(slots.len());
        let mut run_start = 0;
        for (h, i) in slots {
            if kept.last().is_none_or(|&(last, _)| last != h) {
                run_start = kept.len();
            }
            let this = key(i as usize);
            match kept[run_start..].iter().position(|&(_, j)| key(j as usize) == this) {
                Some(p) => kept[run_start + p].1 = i,
                None => kept.push((h, i)),
            }
        }
        kept.shrink_to_fit();
        let taken = vec![false; kept.len()];
        Ok(KeyTable { slots: kept, taken, hasher, key })
    }

    /// The slot of `k`, if some entry has it.
    fn slot(&self, k: &K) -> Option<usize> {
        let h = self.hasher.hash_one(k) as u32;
        let start = self.slots.partition_point(|&(x, _)| x < h);
        let run = self.slots[start..].iter().take_while(|&&(x, _)| x == h);
        run.enumerate().find(|(_, &(_, i))| (self.key)(i as usize).as_ref() == Some(k)).map(|(p, _)| start + p)
    }

    /// The entry of key `k`.
    fn get(&self, k: &K) -> Option<usize> {
        self.slot(k).map(|s| self.slots[s].1 as usize)
    }

    /// The entry of key `k`, once: a second take of the same key finds none.
    fn take(&mut self, k: &K) -> Option<usize> {
        let s = self.slot(k).filter(|&s| !self.taken[s])?;
        self.taken[s] = true;
        Some(self.slots[s].1 as usize)
    }
}

/// The key of a `storage_data` entry: its `MetadataIndex`'s fqn and chunk offsets (`None` for a
/// byte item), borrowed where the pickle holds the fqn.
fn storage_key(k: PickleRef<'_>) -> Result<(&str, Option<Vec<u64>>), String> {
    let kf = fields(k).ok_or_else(|| format!("storage_data key is {}, expected a MetadataIndex", k.describe()))?;
    let fqn_ref = need(kf, "fqn", "MetadataIndex")?;
    let fqn =
        fqn_ref.as_str().ok_or_else(|| format!("MetadataIndex fqn is {}, expected a string", fqn_ref.describe()))?;
    let offset = match field(kf, "offset").map(|o| (o, o.view())) {
        None | Some((_, PickleView::None)) => None,
        Some((o, _)) => Some(o.as_dims().ok_or_else(|| format!("MetadataIndex of {fqn:?}: offset is not a tuple"))?),
    };
    Ok((fqn, offset))
}

/// Longest path the planner's data may give a byte item (a state dict nested deeper than any
/// value may be): a longer one is not taken for a path, and the item keeps its key.
const MAX_PATH_LEN: usize = 256;

/// The path the planner's data gives the byte item `fqn`; `None` when it gives none, or gives
/// `[fqn]` itself (every key of a flat state dict), which is the path the item gets without one.
fn planner_path(v: PickleRef<'_>, fqn: &str) -> Option<Vec<PathSeg>> {
    let items = v.seq().filter(|xs| xs.len() <= MAX_PATH_LEN)?;
    if items.len() == 1 && items.get(0).and_then(PickleRef::as_str) == Some(fqn) {
        return None;
    }
    items
        .iter()
        .map(|x| match x.view() {
            PickleView::Str(s) => Some(PathSeg::Key(s.to_string())),
            PickleView::Int(i) => u64::try_from(i).ok().map(PathSeg::Index),
            _ => None,
        })
        .collect()
}

/// The dtype recorded in `TensorProperties`: a tuple state `(dtype, layout, …)` (torch ≥ 2.0)
/// or a dict state with a `dtype` field.
fn properties_dtype(v: PickleRef<'_>, fqn: &str) -> Result<DType, String> {
    let dtype = match v.view() {
        PickleView::Object(o) => match o.state().map(PickleRef::view) {
            Some(PickleView::Tuple(t)) => t.get(0),
            Some(PickleView::Dict(d)) => field(d, "dtype"),
            _ => o.args().first().copied(),
        },
        _ => None,
    };
    match dtype.map(|d| (d, d.view())) {
        Some((_, PickleView::Global { module: "torch", name })) => {
            torch_dtype(name).ok_or_else(|| format!("{fqn:?}: unsupported dtype torch.{name}"))
        }
        Some((other, _)) => Err(format!("{fqn:?}: tensor dtype is {}", other.describe())),
        None => Err(format!("{fqn:?}: tensor properties carry no dtype ({})", v.describe())),
    }
}

/// Interprets a decoded `.metadata` pickle, read in place (`pickle::unpickle_view`).
pub(crate) fn parse_metadata(root: PickleRef<'_>) -> Result<DcpMetadata, String> {
    let top = fields(root).ok_or_else(|| format!("the pickle holds {}, not a DCP Metadata", root.describe()))?;
    let sdm = need(top, "state_dict_metadata", "Metadata")?;
    let PickleView::Dict(sdm) = sdm.view() else { return Err("state_dict_metadata is not a dict".into()) };
    let storage = match field(top, "storage_data").map(|v| (v, v.view())) {
        Some((_, PickleView::Dict(d))) => Some(d),
        Some((_, PickleView::None)) | None => None,
        Some((other, _)) => return Err(format!("storage_data is {}", other.describe())),
    };
    // Where each key of the planner's data is: only byte items' paths are read from it.
    let planner = match field(top, "planner_data").map(PickleRef::view) {
        Some(PickleView::Dict(d)) => Some(d),
        _ => None,
    };
    let planner_key = |i: usize| planner.and_then(|d| d.get(2 * i)).and_then(PickleRef::as_str);
    let planner_table =
        KeyTable::new(planner.map_or(0, |d| d.len() / 2), planner_key).map_err(|e| format!("planner_data: {e}"))?;

    // (fqn, chunk offsets or None for byte items) → location, found by key in storage_data
    // (see KeyTable): each entry is checked here and read again where its item is.
    let storage_len = storage.map_or(0, |d| d.len() / 2);
    for i in 0..storage_len {
        let (Some(k), Some(v)) = (storage.and_then(|d| d.get(2 * i)), storage.and_then(|d| d.get(2 * i + 1))) else {
            continue;
        };
        let (fqn, _) = storage_key(k)?;
        location(v, fqn)?;
    }
    let storage_entry = |i: usize| storage.and_then(|d| d.get(2 * i)).and_then(|k| storage_key(k).ok());
    let mut locations = KeyTable::new(storage_len, storage_entry).map_err(|e| format!("storage_data: {e}"))?;
    let info = |i: usize| storage.and_then(|d| d.get(2 * i + 1)).ok_or_else(|| "storage_data changed".to_string());
    let mut shared = Shared::new();

    let mut tensors = Vec::new();
    let mut bytes = Vec::new();
    for (k, v) in sdm.pairs() {
        // The fqn as the pickle holds it, for the lookups; a copy for the result.
        let key =
            k.as_str().ok_or_else(|| format!("state_dict_metadata key is {}, expected a string", k.describe()))?;
        let fqn = key.to_string();
        let f = fields(v);
        let chunks_field = f.and_then(|f| field(f, "chunks"));
        match (f, chunks_field) {
            (Some(f), Some(chunks)) => {
                let what = format!("tensor {fqn:?}");
                let size = need(f, "size", &what)?;
                // Counted before anything walks the axes (the chunks', the geometry's).
                if let Some(xs) = size.seq() {
                    check_axes(xs.len()).map_err(|e| format!("{what}: size has {e}"))?;
                }
                let size = size.as_dims().ok_or_else(|| format!("{what}: size is not a tuple"))?;
                let dtype = properties_dtype(need(f, "properties", &what)?, &fqn)?;
                let PickleView::List(cs) = chunks.view() else { return Err(format!("{what}: chunks is not a list")) };
                let mut out = Vec::with_capacity(cs.len());
                for c in cs.iter() {
                    let cf = fields(c).ok_or_else(|| format!("{what}: a chunk is {}", c.describe()))?;
                    let offsets =
                        need(cf, "offsets", &what)?.as_dims().ok_or_else(|| format!("{what}: chunk offsets"))?;
                    let sizes = need(cf, "sizes", &what)?.as_dims().ok_or_else(|| format!("{what}: chunk sizes"))?;
                    if offsets.len() != size.len() || sizes.len() != size.len() {
                        return Err(format!(
                            "{what}: chunk at {offsets:?} of shape {sizes:?} does not match rank {}",
                            size.len()
                        ));
                    }
                    // Looked up, not taken: chunks of no elements at the offsets of another share
                    // its entry (DCP keys storage by fqn and offsets; uneven shardings write
                    // them), and the tiling check then sees each where it lies.
                    let probe = (key, Some(offsets));
                    let entry = locations.get(&probe);
                    let offsets = probe.1.unwrap_or_default();
                    let entry = entry.ok_or_else(|| format!("{what}: chunk at {offsets:?} has no storage entry"))?;
                    let location = shared.location(location(info(entry)?, key)?);
                    out.push(DcpChunk { offsets, sizes, location });
                }
                tensors.push(DcpTensor { fqn, dtype, size, chunks: out });
            }
            _ => {
                let is_bytes =
                    matches!(v.view(), PickleView::Object(o) if o.class().1.ends_with("BytesStorageMetadata"));
                if !is_bytes {
                    return Err(format!("{fqn:?}: unknown storage metadata {}", v.describe()));
                }
                let entry =
                    locations.take(&(key, None)).ok_or_else(|| format!("byte item {fqn:?} has no storage entry"))?;
                let location = shared.location(location(info(entry)?, key)?);
                let path = planner_table
                    .get(&key)
                    .and_then(|i| planner.and_then(|d| d.get(2 * i + 1)))
                    .and_then(|p| planner_path(p, key));
                bytes.push(DcpBytes { fqn, path, location });
            }
        }
    }
    let save_id = field(top, "storage_meta")
        .and_then(fields)
        .and_then(|f| field(f, "save_id"))
        .and_then(|v| v.as_str().map(str::to_string));
    Ok(DcpMetadata { tensors, bytes, save_id })
}

#[cfg(test)]
mod tests {
    use super::KeyTable;

    #[test]
    fn key_table_finds_the_last_of_equal_keys_and_takes_each_once() {
        let keys = ["a", "b", "a", "c", "", "b"];
        // "" stands for an entry that is no key (skipped, as a non-string planner key is).
        let mut t = KeyTable::new(keys.len(), |i| Some(keys[i]).filter(|k| !k.is_empty())).unwrap();
        assert_eq!(t.get(&"a"), Some(2));
        assert_eq!(t.get(&"b"), Some(5));
        assert_eq!(t.get(&"c"), Some(3));
        assert_eq!(t.get(&""), None);
        assert_eq!(t.get(&"d"), None);
        assert_eq!(t.take(&"a"), Some(2));
        assert_eq!(t.take(&"a"), None, "a key is taken once, whichever of its entries");
        assert_eq!(t.get(&"a"), Some(2), "get does not take");
        assert_eq!(t.take(&"c"), Some(3));
    }

    #[test]
    fn key_table_of_a_million_equal_keys_is_one_slot() {
        // A crafted storage_data may give one key a million times: one slot, not a run that
        // every lookup walks.
        let t = KeyTable::new(1_000_000, |_| Some(("w", Some(vec![0u64])))).unwrap();
        assert_eq!(t.slots.len(), 1);
        assert_eq!(t.get(&("w", Some(vec![0]))), Some(999_999));
    }
}
