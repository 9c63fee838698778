//! Data files are safetensors files: `u64le header_len | JSON header | data`. The header maps
//! tensor names to `{dtype, shape, data_offsets}` and its `__metadata__` (string → string)
//! describes every chunk, so the index can be rebuilt from the data files alone.

use serde_json::{json, Map, Value as J};

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
