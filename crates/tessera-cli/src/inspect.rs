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
//!
//! A location that is no checkpoint but a training run's folder of them (`step-100/`,
//! `step_200/`, `iter_0000300/`, `global_step400/`, `checkpoint-500/`: see [`step_of`]) is
//! listed instead, newest step first, each with its format and whether it is committed
//! (loadable); `--json` prints `{"path", "steps": [{"step", "folder", "committed", "format",
//! "version", "data_files_of", "problem"}], "latest_committed"}` (`data_files_of`: whose data
//! files an uncommitted step holds, `"tessera"` or `"DCP"`, from their names).

use anyhow::Result;
use serde_json::{json, Map, Value as J};
use tessera::index::{CheckpointIndex, TensorEntry};
use tessera::PathSeg;
use tessera_synth::sizes::fmt_bytes;

use crate::location::Location;

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
        "format": {"backend": index.backend.name(), "version": index.version, "block_size": index.block_size},
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
        "backend": index.backend.name(),
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

/// The step a folder's name gives, for the names training loops give their checkpoints:
/// `step-N`, `step_N`, `stepN`, `global_stepN`, `iter_0000N` (Megatron), `iteration-N`,
/// `checkpoint-N` (Hugging Face), `ckpt-N`; `None` for any other name.
pub fn step_of(folder: &str) -> Option<u64> {
    let digits_at = folder.find(|c: char| c.is_ascii_digit())?;
    let (prefix, digits) = folder.split_at(digits_at);
    if !digits.bytes().all(|b| b.is_ascii_digit()) || digits.len() > 19 {
        return None;
    }
    let prefix = prefix.strip_suffix(['-', '_']).unwrap_or(prefix).to_ascii_lowercase();
    ["step", "global_step", "iter", "iteration", "checkpoint", "ckpt"]
        .contains(&prefix.as_str())
        .then(|| digits.parse().ok())?
}

/// One step folder of a training run's folder of checkpoints.
struct Step {
    step: u64,
    folder: String,
    /// Backend and version, when it opens.
    format: Option<(String, u32)>,
    /// Whose data files an uncommitted folder holds, from their names.
    data_of: Option<&'static str>,
    /// Why it does not open (not committed, damaged), when it does not.
    problem: Option<String>,
}

/// Whose data files `storage` holds, from their names (a save that never committed leaves its
/// data files and no marker): tessera's `<save id>-r<rank>.safetensors`, DCP's `.distcp`.
fn data_files_of(storage: &dyn tessera::Storage) -> Option<&'static str> {
    let names = storage.list().ok()?;
    let native = |n: &str| {
        n.strip_suffix(".safetensors")
            .and_then(|n| n.rsplit_once("-r"))
            .is_some_and(|(_, r)| !r.is_empty() && r.bytes().all(|b| b.is_ascii_digit()))
    };
    if names.iter().any(|n| native(n)) {
        Some("tessera")
    } else if names.iter().any(|n| n.ends_with(".distcp")) {
        Some("DCP")
    } else {
        None
    }
}

/// The step folders directly under `dir` (each opened to learn its format and whether it is
/// committed), newest first; empty when `dir` has none. A folder whose name gives no step is
/// not listed.
fn step_folders(dir: &Location, storage: &dyn tessera::Storage) -> Result<Vec<Step>> {
    let mut folders = std::collections::BTreeSet::new();
    for name in storage.list_recursive()? {
        if let Some((folder, _)) = name.split_once('/') {
            folders.insert(folder.to_string());
        }
    }
    let mut steps = Vec::new();
    for folder in folders {
        let Some(step) = step_of(&folder) else { continue };
        let sub = dir.join(&folder).open()?;
        let (format, problem) = match tessera::open(sub.as_ref()) {
            Ok(c) => (Some((c.format().backend.name().to_string(), c.format().version)), None),
            Err(e) => (None, Some(e.to_string())),
        };
        let data_of = format.is_none().then(|| data_files_of(sub.as_ref())).flatten();
        steps.push(Step { step, folder, format, data_of, problem });
    }
    steps.sort_by(|a, b| b.step.cmp(&a.step).then_with(|| b.folder.cmp(&a.folder)));
    Ok(steps)
}

fn steps_text(dir: &Location, steps: &[Step]) {
    println!("{dir}: a folder of {} step checkpoint(s), newest first", steps.len());
    println!();
    println!("{:>12}  {:<24} {:<20} state", "step", "folder", "format");
    let latest = steps.iter().position(|s| s.format.is_some());
    for (i, s) in steps.iter().enumerate() {
        let format = match (&s.format, s.data_of) {
            (Some((b, v)), _) => format!("{b} v{v}"),
            (None, Some(d)) => format!("{d}, data only"),
            (None, None) => "-".to_string(),
        };
        let state = match &s.problem {
            None if Some(i) == latest => "committed  <- latest committed".to_string(),
            None => "committed".to_string(),
            Some(p) => format!("NOT committed: {p}"),
        };
        println!("{:>12}  {:<24} {format:<20} {state}", s.step, format!("{}/", s.folder));
    }
    println!();
    match latest.map(|i| &steps[i]) {
        Some(s) => println!(
            "latest committed: {} (step {}); inspect it: tessera inspect {}",
            s.folder,
            s.step,
            dir.join(&s.folder)
        ),
        None => println!("no step here is committed"),
    }
}

fn steps_json(dir: &Location, steps: &[Step]) -> J {
    let latest = steps.iter().find(|s| s.format.is_some()).map(|s| s.folder.clone());
    json!({
        "path": dir.to_string(),
        "steps": steps.iter().map(|s| json!({
            "step": s.step,
            "folder": s.folder,
            "committed": s.format.is_some(),
            "format": s.format.as_ref().map(|f| f.0.clone()),
            "version": s.format.as_ref().map(|f| f.1),
            "data_files_of": s.data_of,
            "problem": s.problem,
        })).collect::<Vec<_>>(),
        "latest_committed": latest,
    })
}

/// Runs `tessera inspect`.
pub fn run(dir: &Location, format: Format) -> Result<()> {
    let storage = dir.open()?;
    let index = match tessera::open(storage.as_ref()) {
        Ok(c) => c.into_index(),
        Err(e @ (tessera::Error::NotFound { .. } | tessera::Error::NotCommitted { .. })) => {
            // No checkpoint here: perhaps a run's folder of them.
            let steps = step_folders(dir, storage.as_ref())?;
            if steps.is_empty() {
                return Err(e.into());
            }
            match format {
                Format::Text => steps_text(dir, &steps),
                Format::Json | Format::IndexJson => {
                    println!("{}", serde_json::to_string_pretty(&steps_json(dir, &steps))?)
                }
            }
            return Ok(());
        }
        Err(e) => return Err(e.into()),
    };
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
    fn step_folder_names() {
        let named = [
            ("step-100", 100),
            ("step_7", 7),
            ("step42", 42),
            ("global_step300", 300),
            ("iter_0000100", 100),
            ("iteration-5", 5),
            ("checkpoint-500", 500),
            ("Step_3", 3),
        ];
        for (name, step) in named {
            assert_eq!(step_of(name), Some(step), "{name}");
        }
        for name in ["model", "step", "step-1a", "latest", "run-3", "step--1", "100", "step-99999999999999999999"] {
            assert_eq!(step_of(name), None, "{name}");
        }
    }

    #[test]
    fn common_paths_become_nested_json() {
        let mut root = J::Object(Map::new());
        insert_json(&mut root, &[PathSeg::Key("a".into()), PathSeg::Key("b".into())], json!(1));
        insert_json(&mut root, &[PathSeg::Key("a".into()), PathSeg::Key("c".into())], json!("x"));
        insert_json(&mut root, &[PathSeg::Key("l".into()), PathSeg::Index(1)], json!(true));
        assert_eq!(root, json!({"a": {"b": 1, "c": "x"}, "l": [null, true]}));
    }
}
