//! Zarr v2 array metadata (`.zarray`) as Megatron-Core's legacy `zarr` backend wrote it:
//! uncompressed C-order chunks, bf16 as a 2-byte void type whose name Megatron patched to
//! `"bfloat16"`.

use crate::model::dims::check_axes;
use crate::model::dtype::DType;

/// What a `.zarray` says about an array.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ZarrArray {
    pub shape: Vec<u64>,
    pub chunks: Vec<u64>,
    pub dtype: DType,
    /// Separator between chunk indices in chunk file names (`.` or `/`).
    pub separator: char,
}

impl ZarrArray {
    /// Number of chunks along each axis.
    pub fn grid(&self) -> Vec<u64> {
        self.shape.iter().zip(&self.chunks).map(|(&n, &c)| n.div_ceil(c)).collect()
    }

    /// File name (relative to the array folder) of the chunk at grid position `idx`.
    pub fn chunk_name(&self, idx: &[u64]) -> String {
        if idx.is_empty() {
            return "0".into();
        }
        let parts: Vec<String> = idx.iter().map(u64::to_string).collect();
        parts.join(&self.separator.to_string())
    }
}

fn dtype_of(s: &str) -> Result<DType, String> {
    if s == "bfloat16" || s == "<V2" || s == "|V2" {
        return Ok(DType::BF16);
    }
    let (order, code) = s.split_at(s.len().min(1));
    if order == ">" && !matches!(code, "i1" | "u1" | "b1") {
        return Err(format!("big-endian dtype {s:?} is not supported"));
    }
    Ok(match code {
        "f8" => DType::F64,
        "f4" => DType::F32,
        "f2" => DType::F16,
        "i8" => DType::I64,
        "i4" => DType::I32,
        "i2" => DType::I16,
        "i1" => DType::I8,
        "u1" => DType::U8,
        "u2" => DType::U16,
        "u4" => DType::U32,
        "u8" => DType::U64,
        "b1" => DType::Bool,
        _ => return Err(format!("unsupported zarr dtype {s:?}")),
    })
}

fn dims(v: &serde_json::Value, what: &str) -> Result<Vec<u64>, String> {
    v.as_array()
        .ok_or_else(|| format!("{what} is not a list"))?
        .iter()
        .map(|x| x.as_u64().ok_or_else(|| format!("{what} holds {x}, not a non-negative int")))
        .collect()
}

/// Parses a `.zarray`. Compressed, filtered or Fortran-ordered arrays are refused: Megatron
/// never wrote them, and reading their bytes in place would be wrong.
pub(crate) fn parse_zarray(bytes: &[u8]) -> Result<ZarrArray, String> {
    let j: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| format!("not JSON: {e}"))?;
    if j.get("zarr_format").and_then(|v| v.as_u64()) != Some(2) {
        return Err("not a zarr v2 array (zarr_format is not 2)".into());
    }
    let shape = j.get("shape").ok_or("no shape")?;
    // Counted before anything walks the axes (the grid, the chunk names).
    check_axes(shape.as_array().map_or(0, Vec::len)).map_err(|e| format!("shape has {e}"))?;
    let shape = dims(shape, "shape")?;
    let chunks = dims(j.get("chunks").ok_or("no chunks")?, "chunks")?;
    if chunks.len() != shape.len() || chunks.contains(&0) {
        return Err(format!("chunks {chunks:?} do not fit shape {shape:?}"));
    }
    let dtype = dtype_of(j.get("dtype").and_then(|d| d.as_str()).ok_or("dtype is not a string")?)?;
    if !j.get("compressor").is_none_or(|c| c.is_null()) {
        return Err(format!("compressed zarr arrays are not supported (compressor {})", j["compressor"]));
    }
    if !j.get("filters").is_none_or(|c| c.is_null() || c.as_array().is_some_and(|a| a.is_empty())) {
        return Err("zarr filters are not supported".into());
    }
    if j.get("order").and_then(|o| o.as_str()).unwrap_or("C") != "C" {
        return Err("Fortran-ordered zarr arrays are not supported".into());
    }
    let separator = match j.get("dimension_separator").and_then(|s| s.as_str()).unwrap_or(".") {
        "." => '.',
        "/" => '/',
        other => return Err(format!("unknown dimension_separator {other:?}")),
    };
    let bytes_per_chunk = chunks.iter().try_fold(dtype.size() as u64, |a, &c| a.checked_mul(c));
    if bytes_per_chunk.is_none_or(|b| b > 1 << 40) {
        return Err(format!("chunk shape {chunks:?} is too large"));
    }
    Ok(ZarrArray { shape, chunks, dtype, separator })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn megatron_zarray() {
        let a = parse_zarray(
            br#"{"chunks":[4,3],"compressor":null,"dimension_separator":".","dtype":"bfloat16",
                "fill_value":null,"filters":null,"order":"C","shape":[8,5],"zarr_format":2}"#,
        )
        .unwrap();
        assert_eq!(a.dtype, DType::BF16);
        assert_eq!(a.grid(), vec![2, 2]);
        assert_eq!(a.chunk_name(&[1, 0]), "1.0");
        let f = parse_zarray(br#"{"chunks":[2],"compressor":null,"dtype":"<f4","shape":[3],"zarr_format":2}"#).unwrap();
        assert_eq!((f.dtype, f.separator), (DType::F32, '.'));
        for bad in [
            &br#"{"chunks":[2],"compressor":{"id":"zstd"},"dtype":"<f4","shape":[3],"zarr_format":2}"#[..],
            br#"{"chunks":[2],"compressor":null,"dtype":">f4","shape":[3],"zarr_format":2}"#,
            br#"{"chunks":[0],"compressor":null,"dtype":"<f4","shape":[3],"zarr_format":2}"#,
            br#"{"chunks":[2],"compressor":null,"dtype":"<f4","shape":[3],"zarr_format":3}"#,
            br#"{"chunks":[2],"compressor":null,"dtype":"<f4","shape":[3],"order":"F","zarr_format":2}"#,
            br#"not json"#,
        ] {
            assert!(parse_zarray(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
    }
}
