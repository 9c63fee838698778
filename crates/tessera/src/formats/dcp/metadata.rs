//! The `.metadata` file of a PyTorch Distributed Checkpoint (torch ≥ 2.0, Megatron
//! `torch_dist`, OLMo-core): a pickle of `Metadata` whose dataclasses are read by field name,
//! whatever module names their classes (torch, older torch, Megatron, OLMo-core).

use std::collections::HashMap;

use crate::formats::pickle::{Items, PickleRef, PickleView};
use crate::formats::torch_save::torch_dtype;
use crate::model::dims::{check_axes, Dims};
use crate::model::dtype::DType;
use crate::model::PathSeg;

/// Where one item (a tensor chunk or a byte value) is stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ItemLocation {
    /// Data file, relative to the checkpoint directory.
    pub relative_path: String,
    /// Byte offset of the item in the file.
    pub offset: u64,
    /// Byte length of the item.
    pub length: u64,
    /// Transforms applied to the item's bytes, outermost last (`["stream.zstd/1"]`).
    pub transforms: Vec<String>,
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
    /// Path in the original state dict (from `planner_data`), when recorded.
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

fn string(v: PickleRef<'_>, what: &str) -> Result<String, String> {
    match v.as_str() {
        Some(s) => Ok(s.to_string()),
        None => Err(format!("{what} is {}, expected a string", v.describe())),
    }
}

fn location(v: PickleRef<'_>, fqn: &str) -> Result<ItemLocation, String> {
    let what = format!("storage info of {fqn:?}");
    let f = fields(v).ok_or_else(|| format!("{what} is {}, expected a _StorageInfo", v.describe()))?;
    let relative_path = string(need(f, "relative_path", &what)?, &what)?;
    // The same rule as every name a Storage reads (plain components: no `..`, `\\`, NUL).
    if crate::storage::names::check_relative_name(&relative_path).is_err() {
        return Err(format!("{what}: data file {relative_path:?} is not a plain relative name"));
    }
    let offset = need(f, "offset", &what)?.as_u64().ok_or_else(|| format!("{what}: offset is not an int"))?;
    let length = need(f, "length", &what)?.as_u64().ok_or_else(|| format!("{what}: length is not an int"))?;
    if offset.checked_add(length).is_none() {
        return Err(format!("{what}: offset + length overflows"));
    }
    let transforms = match field(f, "transform_descriptors").map(PickleRef::view) {
        None | Some(PickleView::None) => Vec::new(),
        Some(PickleView::List(xs)) | Some(PickleView::Tuple(xs)) => {
            xs.iter().map(|x| string(x, &what)).collect::<Result<_, _>>()?
        }
        Some(_) => {
            let other = field(f, "transform_descriptors").map(PickleRef::describe).unwrap_or_default();
            return Err(format!("{what}: transform_descriptors is {other}"));
        }
    };
    Ok(ItemLocation { relative_path, offset, length, transforms })
}

/// Longest path the planner's data may give a byte item (a state dict nested deeper than any
/// value may be): a longer one is not taken for a path, and the item keeps its key.
const MAX_PATH_LEN: usize = 256;

fn planner_path(v: PickleRef<'_>) -> Option<Vec<PathSeg>> {
    let items = v.seq().filter(|xs| xs.len() <= MAX_PATH_LEN)?;
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
    let planner: HashMap<&str, PickleRef<'_>> = match field(top, "planner_data").map(PickleRef::view) {
        Some(PickleView::Dict(d)) => d.pairs().filter_map(|(k, v)| Some((k.as_str()?, v))).collect(),
        _ => HashMap::new(),
    };

    // (fqn, chunk offsets or None for byte items) → location.
    // Keyed by the fqn where the pickle holds it (no copy of a million names), to the storage
    // info where it is: each is checked here and read again where its item is.
    let mut locations: HashMap<(&str, Option<Dims>), PickleRef<'_>> =
        HashMap::with_capacity(storage.map_or(0, |d| d.len() / 2));
    for (k, v) in storage.into_iter().flat_map(Items::pairs) {
        let kf = fields(k).ok_or_else(|| format!("storage_data key is {}, expected a MetadataIndex", k.describe()))?;
        let fqn_ref = need(kf, "fqn", "MetadataIndex")?;
        let fqn = fqn_ref
            .as_str()
            .ok_or_else(|| format!("MetadataIndex fqn is {}, expected a string", fqn_ref.describe()))?;
        let offset = match field(kf, "offset").map(|o| (o, o.view())) {
            None | Some((_, PickleView::None)) => None,
            Some((o, _)) => {
                Some(Dims::from(o.as_dims().ok_or_else(|| format!("MetadataIndex of {fqn:?}: offset is not a tuple"))?))
            }
        };
        location(v, fqn)?;
        locations.insert((fqn, offset), v);
    }

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
                    let info = locations
                        .get(&(key, Some(Dims::from(offsets.as_slice()))))
                        .copied()
                        .ok_or_else(|| format!("{what}: chunk at {offsets:?} has no storage entry"))?;
                    let location = location(info, key)?;
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
                let info =
                    locations.remove(&(key, None)).ok_or_else(|| format!("byte item {fqn:?} has no storage entry"))?;
                let location = location(info, key)?;
                let path = planner.get(key).and_then(|&p| planner_path(p));
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
