//! `tessera inspect LOCATION [--json | --index-json]`: what a checkpoint holds.
//!
//! `--json` prints one object:
//!
//! ```json
//! {
//!   "path": "/ckpt",
//!   "format": {"backend": "tessera", "version": 1, "block_size": 1048576},
//!   "files": {"count": 8, "bytes": 1073741824},
//!   "tensors": {"KEY": {"dtype": "bf16", "shape": [8, 256, 64], "chunks": 32, "bytes": 262144}},
//!   "objects": {"KEY": {"shape": [4, 2], "shards": 8, "bytes": 800}},
//!   "common": {"iteration": 1000, "config": {"hidden": 64}},
//!   "content_metadata": {"producer": "tessera demo"},
//!   "totals": {"tensors": 19, "chunks": 700, "tensor_bytes": 1073741824, "object_bytes": 800}
//! }
//! ```
//!
//! Bytes values (`Value::Bytes`) appear as `{"$bytes": "<hex>"}`. `--index-json` dumps the
//! whole index, every chunk included, for debugging.

use anyhow::Result;
use serde_json::{json, Map, Value as J};
use tessera::{CheckpointIndex, PathSeg, TensorEntry};

use crate::location::Location;
use crate::sizes::fmt_bytes;

/// Output format.
pub enum Format {
    /// Human-readable.
    Text,
    /// The summary JSON object.
    Json,
    /// The full index as JSON.
    IndexJson,
}

fn tensor_bytes(t: &TensorEntry) -> u64 {
    t.chunks().iter().map(|c| c.numel()).sum::<u64>() * t.dtype.size() as u64
}

/// Inserts `value` at `path` in a nested JSON value (maps for keys, arrays for indices).
fn insert_json(root: &mut J, path: &[PathSeg], value: J) {
    let Some((first, rest)) = path.split_first() else {
        *root = value;
        return;
    };
    let slot = match first {
        PathSeg::Key(k) => {
            if !root.is_object() {
                *root = J::Object(Map::new());
            }
            root.as_object_mut().expect("just made an object").entry(k.clone()).or_insert(J::Null)
        }
        PathSeg::Index(i) => {
            if !root.is_array() {
                *root = J::Array(Vec::new());
            }
            let items = root.as_array_mut().expect("just made an array");
            let i = *i as usize;
            if items.len() <= i {
                items.resize(i + 1, J::Null);
            }
            &mut items[i]
        }
    };
    insert_json(slot, rest, value);
}

/// The common state as one nested JSON object.
pub fn common_json(index: &CheckpointIndex) -> J {
    let mut root = J::Object(Map::new());
    for (path, v) in &index.common {
        insert_json(&mut root, path, v.to_json());
    }
    root
}

/// The summary printed by `--json`.
pub fn summary_json(dir: &Location, index: &CheckpointIndex) -> J {
    let mut tensors = Map::new();
    for t in &index.tensors {
        tensors.insert(
            t.key.clone(),
            json!({"dtype": t.dtype.name(), "shape": t.global_shape, "chunks": t.chunks().len(), "bytes": tensor_bytes(t)}),
        );
    }
    let mut objects = Map::new();
    let mut object_bytes = 0;
    for o in &index.objects {
        let bytes: u64 = o.shards.iter().map(|s| s.len).sum();
        object_bytes += bytes;
        objects.insert(o.key.clone(), json!({"shape": o.global_shape, "shards": o.shards.len(), "bytes": bytes}));
    }
    json!({
        "path": dir.to_string(),
        "format": {"backend": index.backend, "version": index.version, "block_size": index.block_size},
        "files": {"count": index.files.len(), "bytes": index.files.iter().map(|f| f.size).sum::<u64>()},
        "tensors": tensors,
        "objects": objects,
        "common": common_json(index),
        "content_metadata": index.content_metadata.to_json(),
        "totals": {
            "tensors": index.tensors.len(),
            "chunks": index.chunk_count(),
            "tensor_bytes": index.tensor_bytes(),
            "object_bytes": object_bytes,
        },
    })
}

/// Every field of the index, as JSON.
pub fn index_json(index: &CheckpointIndex) -> J {
    let hex = |crcs: &[u32]| -> Vec<String> { crcs.iter().map(|c| format!("{c:08x}")).collect() };
    let file_name = |f: u32| index.files.get(f as usize).map_or("?", |e| e.name.as_str());
    let common: Vec<J> = index
        .common
        .iter()
        .map(|(path, v)| json!({"path": tessera::path_string(path), "value": v.to_json()}))
        .collect();
    let tensors: Vec<J> = index
        .tensors
        .iter()
        .map(|t| {
            let chunks: Vec<J> = t
                .chunks()
                .iter()
                .map(|c| {
                    json!({
                        "file": file_name(c.file),
                        "file_index": c.file,
                        "byte_offset": c.byte_offset,
                        "offset": c.offset.as_slice(),
                        "shape": c.shape.as_slice(),
                        "flat": c.flat.map(|(s, e)| [s, e]),
                        "crc32c": hex(&c.crcs),
                    })
                })
                .collect();
            json!({"key": t.key, "dtype": t.dtype.name(), "shape": t.global_shape, "chunks": chunks})
        })
        .collect();
    let objects: Vec<J> = index
        .objects
        .iter()
        .map(|o| {
            let shards: Vec<J> = o
                .shards
                .iter()
                .map(|s| {
                    json!({
                        "offset": s.offset,
                        "file": file_name(s.file),
                        "file_index": s.file,
                        "byte_offset": s.byte_offset,
                        "len": s.len,
                        "crc32c": format!("{:08x}", s.crc),
                    })
                })
                .collect();
            json!({"key": o.key, "shape": o.global_shape, "shards": shards})
        })
        .collect();
    json!({
        "backend": index.backend,
        "version": index.version,
        "block_size": index.block_size,
        "content_metadata": index.content_metadata.to_json(),
        "common": common,
        "files": index
            .files
            .iter()
            .map(|f| json!({"name": f.name, "size": f.size, "header_len": f.header_len, "header_crc32c": format!("{:08x}", f.header_crc)}))
            .collect::<Vec<_>>(),
        "tensors": tensors,
        "objects": objects,
    })
}

fn text(dir: &Location, index: &CheckpointIndex) {
    let file_bytes: u64 = index.files.iter().map(|f| f.size).sum();
    println!("checkpoint {dir}");
    if index.block_size == 0 {
        // Foreign formats: the index lists one virtual file per stored item, and no checksums.
        println!("format     {} v{} (foreign, read-only; no checksums)", index.backend, index.version);
        println!("items      {} ({} of tensor data)", index.files.len(), fmt_bytes(file_bytes));
    } else {
        println!("format     {} v{} (checksum block {})", index.backend, index.version, fmt_bytes(index.block_size));
        println!("files      {} ({})", index.files.len(), fmt_bytes(file_bytes));
    }
    println!(
        "tensors    {} ({} in {} chunks)",
        index.tensors.len(),
        fmt_bytes(index.tensor_bytes()),
        index.chunk_count()
    );
    println!("metadata   {}", index.content_metadata.to_json());
    if !index.tensors.is_empty() {
        let width = index.tensors.iter().map(|t| t.key.len()).max().unwrap_or(0).max(3);
        println!();
        println!("{:<width$}  {:<9}  {:<22}  {:>7}  {:>11}", "key", "dtype", "shape", "chunks", "bytes");
        for t in &index.tensors {
            println!(
                "{:<width$}  {:<9}  {:<22}  {:>7}  {:>11}",
                t.key,
                t.dtype.name(),
                format!("{:?}", t.global_shape),
                t.chunks().len(),
                fmt_bytes(tensor_bytes(t))
            );
        }
    }
    if !index.objects.is_empty() {
        println!();
        println!("objects");
        for o in &index.objects {
            let bytes: u64 = o.shards.iter().map(|s| s.len).sum();
            if index.block_size == 0 {
                println!("  {}  grid {:?}, {} shards", o.key, o.global_shape, o.shards.len());
            } else {
                println!("  {}  grid {:?}, {} shards, {}", o.key, o.global_shape, o.shards.len(), fmt_bytes(bytes));
            }
        }
    }
    if !index.common.is_empty() {
        println!();
        println!("common state");
        for (path, v) in &index.common {
            println!("  {} = {}", tessera::path_string(path), v.to_json());
        }
    }
}

/// Runs `tessera inspect`.
pub fn run(dir: &Location, format: Format) -> Result<()> {
    let storage = dir.open()?;
    let index = tessera::open(storage.as_ref()).map(tessera::Checkpoint::into_index)?;
    match format {
        Format::Text => text(dir, &index),
        Format::Json => println!("{}", serde_json::to_string_pretty(&summary_json(dir, &index))?),
        Format::IndexJson => println!("{}", serde_json::to_string_pretty(&index_json(&index))?),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn common_paths_become_nested_json() {
        let mut root = J::Object(Map::new());
        insert_json(&mut root, &[PathSeg::Key("a".into()), PathSeg::Key("b".into())], json!(1));
        insert_json(&mut root, &[PathSeg::Key("a".into()), PathSeg::Key("c".into())], json!("x"));
        insert_json(&mut root, &[PathSeg::Key("l".into()), PathSeg::Index(1)], json!(true));
        assert_eq!(root, json!({"a": {"b": 1, "c": "x"}, "l": [null, true]}));
    }
}
