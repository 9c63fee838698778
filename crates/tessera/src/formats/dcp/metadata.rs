//! The `.metadata` file of a PyTorch Distributed Checkpoint (torch ≥ 2.0, Megatron
//! `torch_dist`, OLMo-core): a pickle of `Metadata` whose dataclasses are read by field name,
//! whatever module names their classes (torch, older torch, Megatron, OLMo-core).

use std::collections::HashMap;

use crate::formats::pickle::PickleValue;
use crate::formats::torch_save::{as_dims, as_u64, describe, torch_dtype};
use crate::model::dims::check_axes;
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
}

type Fields<'a> = &'a [(PickleValue, PickleValue)];

/// The field dict of a dataclass instance: its BUILD state (a dict, or the `(dict, slots)`
/// pair of a slotted class).
fn fields(v: &PickleValue) -> Option<Fields<'_>> {
    match v {
        PickleValue::Object(o) => match o.state.as_ref()? {
            PickleValue::Dict(d) => Some(d),
            PickleValue::Tuple(t) => t.iter().rev().find_map(|x| match x {
                PickleValue::Dict(d) if !d.is_empty() => Some(d.as_slice()),
                _ => None,
            }),
            _ => None,
        },
        PickleValue::Dict(d) => Some(d),
        _ => None,
    }
}

fn field<'a>(f: Fields<'a>, name: &str) -> Option<&'a PickleValue> {
    f.iter().find(|(k, _)| matches!(k, PickleValue::Str(s) if s == name)).map(|(_, v)| v)
}

fn need<'a>(f: Fields<'a>, name: &str, what: &str) -> Result<&'a PickleValue, String> {
    field(f, name).ok_or_else(|| format!("{what} has no field {name:?}"))
}

fn string(v: &PickleValue, what: &str) -> Result<String, String> {
    match v {
        PickleValue::Str(s) => Ok(s.clone()),
        other => Err(format!("{what} is {}, expected a string", describe(other))),
    }
}

fn location(v: &PickleValue, fqn: &str) -> Result<ItemLocation, String> {
    let what = format!("storage info of {fqn:?}");
    let f = fields(v).ok_or_else(|| format!("{what} is {}, expected a _StorageInfo", describe(v)))?;
    let relative_path = string(need(f, "relative_path", &what)?, &what)?;
    // The same rule as every name a Storage reads (plain components: no `..`, `\\`, NUL).
    if crate::storage::names::check_relative_name(&relative_path).is_err() {
        return Err(format!("{what}: data file {relative_path:?} is not a plain relative name"));
    }
    let offset = as_u64(need(f, "offset", &what)?).ok_or_else(|| format!("{what}: offset is not an int"))?;
    let length = as_u64(need(f, "length", &what)?).ok_or_else(|| format!("{what}: length is not an int"))?;
    if offset.checked_add(length).is_none() {
        return Err(format!("{what}: offset + length overflows"));
    }
    let transforms = match field(f, "transform_descriptors") {
        None | Some(PickleValue::None) => Vec::new(),
        Some(PickleValue::List(xs)) | Some(PickleValue::Tuple(xs)) => {
            xs.iter().map(|x| string(x, &what)).collect::<Result<_, _>>()?
        }
        Some(other) => return Err(format!("{what}: transform_descriptors is {}", describe(other))),
    };
    Ok(ItemLocation { relative_path, offset, length, transforms })
}

fn planner_path(v: &PickleValue) -> Option<Vec<PathSeg>> {
    let (PickleValue::Tuple(xs) | PickleValue::List(xs)) = v else { return None };
    xs.iter()
        .map(|x| match x {
            PickleValue::Str(s) => Some(PathSeg::Key(s.clone())),
            PickleValue::Int(i) => u64::try_from(*i).ok().map(PathSeg::Index),
            _ => None,
        })
        .collect()
}

/// The dtype recorded in `TensorProperties`: a tuple state `(dtype, layout, …)` (torch ≥ 2.0)
/// or a dict state with a `dtype` field.
fn properties_dtype(v: &PickleValue, fqn: &str) -> Result<DType, String> {
    let dtype = match v {
        PickleValue::Object(o) => match &o.state {
            Some(PickleValue::Tuple(t)) => t.first(),
            Some(PickleValue::Dict(d)) => field(d, "dtype"),
            _ => o.args.first(),
        },
        _ => None,
    };
    match dtype {
        Some(PickleValue::Global { module, name }) if module == "torch" => {
            torch_dtype(name).ok_or_else(|| format!("{fqn:?}: unsupported dtype torch.{name}"))
        }
        Some(other) => Err(format!("{fqn:?}: tensor dtype is {}", describe(other))),
        None => Err(format!("{fqn:?}: tensor properties carry no dtype ({})", describe(v))),
    }
}

/// Interprets a decoded `.metadata` pickle.
pub(crate) fn parse_metadata(root: &PickleValue) -> Result<DcpMetadata, String> {
    let top = fields(root).ok_or_else(|| format!("the pickle holds {}, not a DCP Metadata", describe(root)))?;
    let sdm = need(top, "state_dict_metadata", "Metadata")?;
    let PickleValue::Dict(sdm) = sdm else { return Err("state_dict_metadata is not a dict".into()) };
    let storage = match field(top, "storage_data") {
        Some(PickleValue::Dict(d)) => d.as_slice(),
        Some(PickleValue::None) | None => &[],
        Some(other) => return Err(format!("storage_data is {}", describe(other))),
    };
    let planner: HashMap<String, Vec<PathSeg>> = match field(top, "planner_data") {
        Some(PickleValue::Dict(d)) => d
            .iter()
            .filter_map(|(k, v)| match k {
                PickleValue::Str(k) => planner_path(v).map(|p| (k.clone(), p)),
                _ => None,
            })
            .collect(),
        _ => HashMap::new(),
    };

    // (fqn, chunk offsets or None for byte items) → location.
    let mut locations: HashMap<(String, Option<Vec<u64>>), ItemLocation> = HashMap::with_capacity(storage.len());
    for (k, v) in storage {
        let kf = fields(k).ok_or_else(|| format!("storage_data key is {}, expected a MetadataIndex", describe(k)))?;
        let fqn = string(need(kf, "fqn", "MetadataIndex")?, "MetadataIndex fqn")?;
        let offset = match field(kf, "offset") {
            None | Some(PickleValue::None) => None,
            Some(o) => Some(as_dims(o).ok_or_else(|| format!("MetadataIndex of {fqn:?}: offset is not a tuple"))?),
        };
        let loc = location(v, &fqn)?;
        locations.insert((fqn, offset), loc);
    }

    let mut tensors = Vec::new();
    let mut bytes = Vec::new();
    for (k, v) in sdm {
        let fqn = string(k, "state_dict_metadata key")?;
        let f = fields(v);
        let chunks_field = f.and_then(|f| field(f, "chunks"));
        match chunks_field {
            Some(chunks) => {
                let f = f.unwrap();
                let what = format!("tensor {fqn:?}");
                let size = need(f, "size", &what)?;
                // Counted before anything walks the axes (the chunks', the geometry's).
                if let PickleValue::Tuple(xs) | PickleValue::List(xs) = size {
                    check_axes(xs.len()).map_err(|e| format!("{what}: size has {e}"))?;
                }
                let size = as_dims(size).ok_or_else(|| format!("{what}: size is not a tuple"))?;
                let dtype = properties_dtype(need(f, "properties", &what)?, &fqn)?;
                let PickleValue::List(cs) = chunks else { return Err(format!("{what}: chunks is not a list")) };
                let mut out = Vec::with_capacity(cs.len());
                for c in cs {
                    let cf = fields(c).ok_or_else(|| format!("{what}: a chunk is {}", describe(c)))?;
                    let offsets =
                        as_dims(need(cf, "offsets", &what)?).ok_or_else(|| format!("{what}: chunk offsets"))?;
                    let sizes = as_dims(need(cf, "sizes", &what)?).ok_or_else(|| format!("{what}: chunk sizes"))?;
                    if offsets.len() != size.len() || sizes.len() != size.len() {
                        return Err(format!(
                            "{what}: chunk at {offsets:?} of shape {sizes:?} does not match rank {}",
                            size.len()
                        ));
                    }
                    let location = locations
                        .get(&(fqn.clone(), Some(offsets.clone())))
                        .cloned()
                        .ok_or_else(|| format!("{what}: chunk at {offsets:?} has no storage entry"))?;
                    out.push(DcpChunk { offsets, sizes, location });
                }
                tensors.push(DcpTensor { fqn, dtype, size, chunks: out });
            }
            None => {
                let is_bytes = matches!(v, PickleValue::Object(o) if o.name.ends_with("BytesStorageMetadata"));
                if !is_bytes {
                    return Err(format!("{fqn:?}: unknown storage metadata {}", describe(v)));
                }
                let location = locations
                    .get(&(fqn.clone(), None))
                    .cloned()
                    .ok_or_else(|| format!("byte item {fqn:?} has no storage entry"))?;
                let path = planner.get(&fqn).cloned();
                bytes.push(DcpBytes { fqn, path, location });
            }
        }
    }
    Ok(DcpMetadata { tensors, bytes })
}
