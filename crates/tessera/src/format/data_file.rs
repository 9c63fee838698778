//! The native data file (FORMAT.md, "Data files"): a safetensors file named
//! `<save_id>-r<rank>.safetensors` whose `__metadata__` describes every entry it holds. Its name
//! both ways, and its header encoded (by the writers) and decoded (by `verify`, which checks
//! every header against the index that commits the file).

use serde_json::{json, Map, Value as J};

use crate::error::{Error, Result};
use crate::format::index::{FORMAT_VERSION, NATIVE_BACKEND};
use crate::format::safetensors::{build_header, crc_hex, SafetensorsEntry, SafetensorsHeader, DATA_ALIGN};
use crate::model::dtype::DType;

/// Name of the data file written by `rank` in save `save_id`.
pub fn data_file_name(save_id: u64, rank: usize) -> String {
    format!("{save_id:016x}-r{rank:05}.safetensors")
}

/// The save id and rank a data file's name carries (`<16 hex>-r<rank>.safetensors`); `None` for
/// any other name.
pub fn parse_data_file_name(name: &str) -> Option<(u64, usize)> {
    let stem = name.strip_suffix(".safetensors")?;
    let (id, r) = stem.split_once("-r")?;
    if id.len() != 16 || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    if r.is_empty() || !r.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((u64::from_str_radix(id, 16).ok()?, r.parse().ok()?))
}

/// True for names tessera gives its data files.
pub fn is_data_file_name(name: &str) -> bool {
    parse_data_file_name(name).is_some()
}

/// A tensor chunk as a data-file header describes it (borrowed, for encoding).
#[derive(Debug, Clone, Copy)]
pub struct ChunkDesc<'a> {
    /// Global key.
    pub key: &'a str,
    /// Element type.
    pub dtype: DType,
    /// Global shape.
    pub global_shape: &'a [u64],
    /// Box offset.
    pub offset: &'a [u64],
    /// Box shape.
    pub shape: &'a [u64],
    /// Flattened range of the box, if any.
    pub flat: Option<(u64, u64)>,
}

/// An object shard as a data-file header describes it (borrowed, for encoding).
#[derive(Debug, Clone, Copy)]
pub struct ObjectDesc<'a> {
    /// Global key.
    pub key: &'a str,
    /// Grid shape.
    pub global_shape: &'a [u64],
    /// Grid position.
    pub offset: &'a [u64],
}

/// The header bytes of a data file written by `rank`: safetensors `entries` (the chunks', then
/// the objects', in that order), and in `__metadata__` each chunk's and object's record with its
/// checksums (`crcs`: per entry, in entry order; an object has one). Checksums are fixed-width
/// hex, so the header's size does not depend on their values: a writer lays out the file with
/// placeholder checksums, writes the data, then writes the header last.
pub fn encode_header(
    rank: usize,
    block_size: u64,
    entries: &[SafetensorsEntry],
    chunks: &[ChunkDesc<'_>],
    objects: &[ObjectDesc<'_>],
    crcs: &[Vec<u32>],
) -> Vec<u8> {
    let chunk_records: Vec<J> = chunks
        .iter()
        .enumerate()
        .map(|(n, c)| {
            json!({
                "name": entries[n].name,
                "key": c.key,
                "dtype": c.dtype.name(),
                "global_shape": c.global_shape,
                "global_offset": c.offset,
                "shape": c.shape,
                "flat": c.flat.map(|(s, e)| vec![s, e]),
                "crc32c": crc_hex(&crcs[n]),
            })
        })
        .collect();
    let object_records: Vec<J> = objects
        .iter()
        .enumerate()
        .map(|(n, o)| {
            let e = chunks.len() + n;
            json!({
                "name": entries[e].name,
                "key": o.key,
                "global_shape": o.global_shape,
                "global_offset": o.offset,
                "crc32c": crc_hex(&crcs[e]),
            })
        })
        .collect();
    let mut meta = Map::new();
    meta.insert("format".into(), J::String(NATIVE_BACKEND.into()));
    meta.insert("format_version".into(), J::String(FORMAT_VERSION.to_string()));
    meta.insert("rank".into(), J::String(rank.to_string()));
    meta.insert("block_size".into(), J::String(block_size.to_string()));
    meta.insert("chunks".into(), J::String(J::Array(chunk_records).to_string()));
    meta.insert("objects".into(), J::String(J::Array(object_records).to_string()));
    build_header(entries, &meta, DATA_ALIGN)
}

/// A tensor chunk as a data file's header records it.
#[derive(Debug, Clone, PartialEq)]
pub struct HeaderChunk {
    /// Global key.
    pub key: String,
    /// Element type.
    pub dtype: DType,
    /// Global shape.
    pub global_shape: Vec<u64>,
    /// Box offset.
    pub offset: Vec<u64>,
    /// Box shape.
    pub shape: Vec<u64>,
    /// Flattened range of the box, if any.
    pub flat: Option<(u64, u64)>,
    /// Absolute byte offset of its data in the file.
    pub byte_offset: u64,
    /// Bytes it holds.
    pub len: u64,
    /// Block checksums.
    pub crcs: Vec<u32>,
}

/// An object shard as a data file's header records it.
#[derive(Debug, Clone, PartialEq)]
pub struct HeaderObject {
    /// Global key.
    pub key: String,
    /// Grid shape.
    pub global_shape: Vec<u64>,
    /// Grid position.
    pub offset: Vec<u64>,
    /// Absolute byte offset of its bytes in the file.
    pub byte_offset: u64,
    /// Bytes it holds.
    pub len: u64,
    /// Its checksum.
    pub crc: u32,
}

/// What a native data file's header says about the file.
#[derive(Debug, Clone, PartialEq)]
pub struct DataFileHeader {
    /// The format version of the index that commits the file.
    pub format_version: u32,
    /// The rank that wrote it.
    pub rank: usize,
    /// Checksum block size.
    pub block_size: u64,
    /// Its tensor chunks.
    pub chunks: Vec<HeaderChunk>,
    /// Its object shards.
    pub objects: Vec<HeaderObject>,
}

/// Decodes the records of a native data file from its validated safetensors header (`shown`
/// names the file in errors): every record must name an entry of the header, with a length that
/// matches its shape and dtype, and as many block checksums as its bytes span.
pub fn decode_header(h: &SafetensorsHeader, shown: &str) -> Result<DataFileHeader> {
    let bad = |reason: String| Error::corrupt(shown, reason);
    let meta = |key: &str| -> Result<&str> {
        h.metadata
            .get(key)
            .and_then(J::as_str)
            .ok_or_else(|| bad(format!("__metadata__ has no string {key:?}: not a tessera data file")))
    };
    if meta("format")? != NATIVE_BACKEND {
        return Err(bad(format!("__metadata__ format is {:?}, not {NATIVE_BACKEND:?}", meta("format")?)));
    }
    let number = |key: &str| -> Result<u64> {
        let text = meta(key)?;
        text.parse().map_err(|_| bad(format!("__metadata__ {key} is {text:?}, not a number")))
    };
    let format_version =
        u32::try_from(number("format_version")?).map_err(|_| bad("format_version too large".into()))?;
    let rank = usize::try_from(number("rank")?).map_err(|_| bad("rank too large".into()))?;
    let block_size = number("block_size")?;
    if block_size == 0 {
        return Err(bad("block_size is 0".into()));
    }
    let records = |key: &str| -> Result<Vec<J>> {
        match serde_json::from_str(meta(key)?) {
            Ok(J::Array(a)) => Ok(a),
            _ => Err(bad(format!("__metadata__ {key} is not a JSON array"))),
        }
    };
    let mut chunks = Vec::new();
    for (i, r) in records("chunks")?.iter().enumerate() {
        chunks.push(chunk_record(h, r, block_size).map_err(|e| bad(format!("chunk record {i}: {e}")))?);
    }
    let mut objects = Vec::new();
    for (i, r) in records("objects")?.iter().enumerate() {
        objects.push(object_record(h, r).map_err(|e| bad(format!("object record {i}: {e}")))?);
    }
    Ok(DataFileHeader { format_version, rank, block_size, chunks, objects })
}

fn field<'a>(r: &'a J, name: &str) -> std::result::Result<&'a J, String> {
    r.get(name).ok_or_else(|| format!("no {name:?}"))
}

fn text<'a>(r: &'a J, name: &str) -> std::result::Result<&'a str, String> {
    field(r, name)?.as_str().ok_or_else(|| format!("{name:?} is not a string"))
}

fn numbers(r: &J, name: &str) -> std::result::Result<Vec<u64>, String> {
    let list = field(r, name)?.as_array().ok_or_else(|| format!("{name:?} is not a list"))?;
    crate::model::dims::check_axes(list.len()).map_err(|e| format!("{name:?} has {e}"))?;
    list.iter().map(|x| x.as_u64().ok_or_else(|| format!("{name:?} holds {x}, not a number"))).collect()
}

fn crcs_of(r: &J) -> std::result::Result<Vec<u32>, String> {
    let t = text(r, "crc32c")?;
    t.split(',')
        .filter(|x| !x.is_empty())
        .map(|x| {
            if x.len() != 8 {
                return Err(format!("checksum {x:?} is not 8 hex digits"));
            }
            u32::from_str_radix(x, 16).map_err(|_| format!("checksum {x:?} is not hex"))
        })
        .collect()
}

/// The header's entry `name` as `(absolute byte offset, length, dtype, shape)`.
fn entry_of(h: &SafetensorsHeader, name: &str) -> std::result::Result<(u64, u64, DType, Vec<u64>), String> {
    let t = h.tensors.get(name).ok_or_else(|| format!("names entry {name:?}, which the header does not hold"))?;
    Ok((t.offset, t.numel * t.dtype.size() as u64, t.dtype, t.shape.clone()))
}

fn chunk_record(h: &SafetensorsHeader, r: &J, block_size: u64) -> std::result::Result<HeaderChunk, String> {
    let key = text(r, "key")?.to_string();
    let dtype_name = text(r, "dtype")?;
    let dtype = crate::model::dtype::ALL_DTYPES
        .into_iter()
        .find(|d| d.name() == dtype_name)
        .ok_or_else(|| format!("{key:?}: unknown dtype {dtype_name:?}"))?;
    let global_shape = numbers(r, "global_shape")?;
    let offset = numbers(r, "global_offset")?;
    let shape = numbers(r, "shape")?;
    let flat = match field(r, "flat")? {
        J::Null => None,
        v => match serde_json::from_value::<[u64; 2]>(v.clone()) {
            Ok([s, e]) if s <= e => Some((s, e)),
            _ => return Err(format!("{key:?}: flat is {v}, not [start, end]")),
        },
    };
    let (byte_offset, len, entry_dtype, entry_shape) = entry_of(h, text(r, "name")?)?;
    let numel = match flat {
        Some((s, e)) => Some(e - s),
        None => shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d)),
    };
    let want = numel.and_then(|n| n.checked_mul(dtype.size() as u64));
    if entry_dtype != dtype || want != Some(len) {
        return Err(format!(
            "{key:?}: a {dtype_name} chunk of shape {shape:?} (flat {flat:?}) in an entry of {} {entry_shape:?}",
            entry_dtype.name()
        ));
    }
    let crcs = crcs_of(r).map_err(|e| format!("{key:?}: {e}"))?;
    if crcs.len() as u64 != len.div_ceil(block_size) {
        return Err(format!("{key:?}: {} block checksums for {len} bytes in blocks of {block_size}", crcs.len()));
    }
    Ok(HeaderChunk { key, dtype, global_shape, offset, shape, flat, byte_offset, len, crcs })
}

fn object_record(h: &SafetensorsHeader, r: &J) -> std::result::Result<HeaderObject, String> {
    let key = text(r, "key")?.to_string();
    let (byte_offset, len, dtype, _) = entry_of(h, text(r, "name")?)?;
    if dtype != DType::U8 {
        return Err(format!("{key:?}: an object in an entry of {}", dtype.name()));
    }
    let crcs = crcs_of(r).map_err(|e| format!("{key:?}: {e}"))?;
    let [crc] = crcs[..] else {
        return Err(format!("{key:?}: {} checksums for an object (one expected)", crcs.len()));
    };
    Ok(HeaderObject {
        key,
        global_shape: numbers(r, "global_shape")?,
        offset: numbers(r, "global_offset")?,
        byte_offset,
        len,
        crc,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_both_ways() {
        let name = data_file_name(0x0123_4567_89ab_cdef, 42);
        assert_eq!(name, "0123456789abcdef-r00042.safetensors");
        assert_eq!(parse_data_file_name(&name), Some((0x0123_4567_89ab_cdef, 42)));
        for bad in ["0123456789abcdef-r.safetensors", "0123456789abcde-r00001.safetensors", "x-r1.safetensors"] {
            assert_eq!(parse_data_file_name(bad), None, "{bad}");
        }
        assert!(!is_data_file_name("rank_0.safetensors"));
    }

    #[test]
    fn a_header_decodes_to_what_was_encoded() {
        let entries = vec![
            SafetensorsEntry { name: "0:w".into(), dtype: DType::F32, shape: vec![2, 3], start: 0, len: 24 },
            SafetensorsEntry { name: "1:w".into(), dtype: DType::F32, shape: vec![2], start: 24, len: 8 },
            SafetensorsEntry { name: "2:rng".into(), dtype: DType::U8, shape: vec![5], start: 32, len: 5 },
        ];
        let chunks = [
            ChunkDesc {
                key: "w",
                dtype: DType::F32,
                global_shape: &[4, 3],
                offset: &[0, 0],
                shape: &[2, 3],
                flat: None,
            },
            ChunkDesc {
                key: "w",
                dtype: DType::F32,
                global_shape: &[4, 3],
                offset: &[2, 0],
                shape: &[2, 3],
                flat: Some((1, 3)),
            },
        ];
        let objects = [ObjectDesc { key: "rng", global_shape: &[2], offset: &[1] }];
        let crcs = vec![vec![1, 2], vec![3], vec![0xdead_beef]];
        let bytes = encode_header(3, 16, &entries, &chunks, &objects, &crcs);
        let mut file = bytes.clone();
        file.resize(bytes.len() + 37, 0);
        let mut read = |off: u64, buf: &mut [u8]| {
            buf.copy_from_slice(&file[off as usize..off as usize + buf.len()]);
            Ok(())
        };
        let h = crate::format::safetensors::read_header(&mut read, file.len() as u64, "f").unwrap();
        let d = decode_header(&h, "f").unwrap();
        assert_eq!((d.format_version, d.rank, d.block_size), (FORMAT_VERSION, 3, 16));
        let at = bytes.len() as u64;
        assert_eq!(
            d.chunks[1],
            HeaderChunk {
                key: "w".into(),
                dtype: DType::F32,
                global_shape: vec![4, 3],
                offset: vec![2, 0],
                shape: vec![2, 3],
                flat: Some((1, 3)),
                byte_offset: at + 24,
                len: 8,
                crcs: vec![3],
            }
        );
        assert_eq!(d.objects[0].crc, 0xdead_beef);
        assert_eq!((d.objects[0].byte_offset, d.objects[0].len), (at + 32, 5));
    }
}
