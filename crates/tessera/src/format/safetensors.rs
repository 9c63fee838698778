//! Safetensors files, as tessera writes them (its data files, OLMo-core rank files, exports) and
//! reads them (every format whose data are safetensors): `u64le header_len | JSON header | data`,
//! the header mapping tensor names to `{dtype, shape, data_offsets}` beside a `__metadata__` map.
//! [`read_header`] is the one validating reader of headers.

use serde_json::{json, Map, Value as J};

use crate::error::Error;
use crate::model::dtype::DType;

/// One tensor entry of a data file.
#[derive(Debug, Clone)]
pub struct SafetensorsEntry {
    /// Unique name within the file.
    pub name: String,
    /// Element type (`U8` for object bytes).
    pub dtype: DType,
    /// Shape as safetensors sees it (the box, or `[n]` for a flattened range).
    pub shape: Vec<u64>,
    /// Offset of the data relative to the start of the data section.
    pub start: u64,
    /// Length in bytes.
    pub len: u64,
}

/// Renders a checksum as fixed-width hex, so a header's size does not depend on checksum values.
pub fn crc_hex(crcs: &[u32]) -> String {
    let parts: Vec<String> = crcs.iter().map(|c| format!("{c:08x}")).collect();
    parts.join(",")
}

/// Where the data section of safetensors' own files starts: a multiple of 8, as the format
/// requires.
pub const SAFETENSORS_ALIGN: u64 = 8;

/// Where the data section of tessera's data files starts: a multiple of the page size (a
/// multiple of [`SAFETENSORS_ALIGN`] too). The kernel copies between a caller's buffer and the
/// page cache fastest when both sit at the same offset within a cache line and a page: tensors
/// are allocated aligned, and a 1 GiB save into tmpfs took ~8% more CPU with its data at 8 mod
/// 64 than at a page boundary (issue 19).
pub const DATA_ALIGN: u64 = 4096;

/// Builds the header bytes: length prefix, then the JSON padded with spaces so that the data
/// section starts at a multiple of `align` (a multiple of [`SAFETENSORS_ALIGN`]).
pub fn build_header(entries: &[SafetensorsEntry], metadata: &Map<String, J>, align: u64) -> Vec<u8> {
    debug_assert!(align.is_multiple_of(SAFETENSORS_ALIGN), "data alignment {align}");
    let mut root = Map::new();
    root.insert("__metadata__".into(), J::Object(metadata.clone()));
    for e in entries {
        root.insert(
            e.name.clone(),
            json!({
                "dtype": e.dtype.safetensors_name(),
                "shape": e.shape,
                "data_offsets": [e.start, e.start + e.len],
            }),
        );
    }
    let mut text = serde_json::to_vec(&J::Object(root)).expect("JSON of plain values");
    let data_start = (text.len() as u64 + 8).next_multiple_of(align);
    text.resize(data_start as usize - 8, b' ');
    let mut out = Vec::with_capacity(text.len() + 8);
    out.extend_from_slice(&(text.len() as u64).to_le_bytes());
    out.extend_from_slice(&text);
    out
}

/// Parses the header of a data file from its first bytes. Returns the JSON and the size of
/// the header (where the data section starts).
pub fn parse_header(
    read: &mut dyn FnMut(u64, &mut [u8]) -> crate::error::Result<()>,
    file_size: u64,
) -> Result<(J, u64), String> {
    if file_size < 8 {
        return Err(format!("{file_size} bytes: too short for a safetensors header"));
    }
    let mut len = [0u8; 8];
    read(0, &mut len).map_err(|e| e.to_string())?;
    let n = u64::from_le_bytes(len);
    if n > 100 << 20 || 8 + n > file_size {
        return Err(format!("header length {n} impossible for a {file_size}-byte file"));
    }
    let mut text = vec![0u8; n as usize];
    read(8, &mut text).map_err(|e| e.to_string())?;
    let json: J = serde_json::from_slice(&text).map_err(|e| format!("header is not JSON: {e}"))?;
    Ok((json, 8 + n))
}

/// A tensor entry of a safetensors header, checked against the file.
#[derive(Debug, Clone)]
pub struct HeaderTensor {
    /// Element type.
    pub dtype: DType,
    /// Elements stored.
    pub numel: u64,
    /// Shape the header gives (its product is `numel`).
    pub shape: Vec<u64>,
    /// Absolute byte offset of the data in the file.
    pub offset: u64,
}

/// A safetensors header, every entry checked against the file's real size.
#[derive(Debug, Clone, Default)]
pub struct SafetensorsHeader {
    /// Size of the file.
    pub size: u64,
    /// Size of the header, length prefix included (where data starts).
    pub header_len: u64,
    /// Tensors by name.
    pub tensors: std::collections::HashMap<String, HeaderTensor>,
    /// The `__metadata__` map (empty when absent).
    pub metadata: Map<String, J>,
}

/// The one reader of safetensors headers every format uses (tessera's data files, OLMo-core's
/// rank files, plain safetensors): reads the header of a `file_size`-byte file through `read`
/// and checks every entry (a known dtype, at most [`MAX_AXES`](crate::model::dims::MAX_AXES) axes,
/// checked arithmetic, data inside the data section, a length matching shape and dtype).
/// `shown` names the file in errors.
pub fn read_header(
    read: &mut dyn FnMut(u64, &mut [u8]) -> crate::error::Result<()>,
    file_size: u64,
    shown: &str,
) -> crate::error::Result<SafetensorsHeader> {
    let (json, header_len) = parse_header(read, file_size).map_err(|e| Error::corrupt(shown, e))?;
    validate_header(&json, header_len, file_size, shown)
}

/// Checks a parsed safetensors header (`json`, `header_len` bytes with its prefix) of a file
/// of `size` bytes.
fn validate_header(json: &J, header_len: u64, size: u64, shown: &str) -> crate::error::Result<SafetensorsHeader> {
    let bad = |reason: String| Error::corrupt(shown, reason);
    let root = json.as_object().ok_or_else(|| bad("safetensors header is not an object".into()))?;
    let data_len = size.checked_sub(header_len).ok_or_else(|| bad("header longer than the file".into()))?;
    let mut out = SafetensorsHeader { size, header_len, ..Default::default() };
    for (key, v) in root {
        if key == "__metadata__" {
            out.metadata = v.as_object().cloned().ok_or_else(|| bad("__metadata__ is not an object".into()))?;
            continue;
        }
        let entry = (|| -> std::result::Result<HeaderTensor, String> {
            let dtype_name = v.get("dtype").and_then(J::as_str).ok_or("no dtype")?;
            let dtype = crate::model::dtype::ALL_DTYPES
                .into_iter()
                .find(|d| d.safetensors_name() == dtype_name)
                .ok_or(format!("unknown dtype {dtype_name:?}"))?;
            let shape = uints(v.get("shape").ok_or("no shape")?, "shape")?;
            let numel = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d)).ok_or("shape overflows")?;
            let off = uints(v.get("data_offsets").ok_or("no data_offsets")?, "data_offsets")?;
            let [start, end] = off[..] else { return Err("data_offsets is not [start, end]".into()) };
            let want = numel.checked_mul(dtype.size() as u64).ok_or("byte size overflows")?;
            if start > end || end > data_len || end - start != want {
                return Err(format!(
                    "data_offsets [{start}, {end}] do not hold {numel} {dtype_name} elements inside the \
                     {data_len}-byte data section"
                ));
            }
            Ok(HeaderTensor { dtype, numel, shape, offset: header_len + start })
        })()
        .map_err(|e| bad(format!("tensor {key:?}: {e}")))?;
        out.tensors.insert(key.clone(), entry);
    }
    Ok(out)
}

/// A list of at most [`MAX_AXES`](crate::model::dims::MAX_AXES) numbers (a shape, offsets),
/// its length checked before its numbers are read.
pub(crate) fn uints(v: &J, what: &str) -> std::result::Result<Vec<u64>, String> {
    let xs = v.as_array().ok_or_else(|| format!("{what} is {v}, not a list"))?;
    crate::model::dims::check_axes(xs.len()).map_err(|e| format!("{what} has {e}"))?;
    xs.iter()
        .enumerate()
        .map(|(i, x)| x.as_u64().ok_or_else(|| format!("{what}[{i}] is {x}, not a non-negative integer")))
        .collect()
}
