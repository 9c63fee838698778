//! Megatron-Core's legacy `zarr` checkpoints, read-only: `metadata.json` naming the backend, one
//! Zarr v2 array folder per tensor key (uncompressed chunk files), sharded objects as
//! `KEY/shard_OFFSETS_SHAPE.pt`, and `common.pt`.

#[cfg(feature = "fuzzing")]
pub(crate) mod fuzz;
pub(crate) mod zarray;

use crate::error::{Error, Result};
use crate::format::{Backend, CheckpointIndex, Crcs, StoredChunk, TensorEntry};
use crate::formats::dcp::{megatron_backend, parse_object_fqn};
use crate::formats::zarr::zarray::parse_zarray;
use crate::formats::{foreign_index, ForeignView, ObjectShards, Source};
use crate::formats::{ForEach, FormatRecord, LoadStrategy};
use crate::storage::Storage;

/// Reads Megatron `zarr` checkpoints (backend `"zarr"`, version 1).
#[derive(Debug, Clone, Copy, Default)]
pub struct ZarrStrategy;

const ZARRAY: &str = ".zarray";

impl LoadStrategy for ZarrStrategy {
    fn backend(&self) -> Backend {
        Backend::Zarr
    }
    fn supports_version(&self, version: u32) -> bool {
        version == 1
    }
    fn supported_versions(&self) -> String {
        "zarr v1".into()
    }
    fn detect(&self, storage: &dyn Storage) -> Result<Option<FormatRecord>> {
        Ok(match megatron_backend(storage)? {
            Some((b, v)) if b == Backend::Zarr.name() => Some(FormatRecord { backend: Backend::Zarr, version: v }),
            _ => None,
        })
    }
    fn open_checkpoint<'s>(
        &self,
        storage: &'s dyn Storage,
        _: ForEach<'_>,
    ) -> Result<(CheckpointIndex, Option<ForeignView<'s>>)> {
        let (index, view) = open_zarr(storage)?;
        Ok((index, Some(view)))
    }
}

fn open_zarr(storage: &dyn Storage) -> Result<(CheckpointIndex, ForeignView<'_>)> {
    let mut view = ForeignView::new(storage, "");
    let mut names = storage.list_recursive()?;
    names.sort();
    let mut tensors = Vec::new();
    let mut objects = ObjectShards::default();
    for name in &names {
        if let Some(key) = name.strip_suffix(&format!("/{ZARRAY}")) {
            let shown = format!("{}/{name}", storage.location());
            let arr =
                parse_zarray(&storage.read(name)?).map_err(|e| Error::corrupt(&shown, format!("{key:?}: {e}")))?;
            let esize = arr.dtype.size() as u64;
            if arr.shape.iter().try_fold(esize, |a, &n| a.checked_mul(n)).is_none() {
                return Err(Error::corrupt(
                    &shown,
                    format!("shape {:?} of {key:?} overflows 64 bits of bytes", arr.shape),
                ));
            }
            let grid = arr.grid();
            // Every chunk of the grid is a file of the array's folder: the grid may not be
            // larger than the folder, so a few bytes of `.zarray` cannot make it enumerate
            // (and index) more chunks than there are files.
            let folder = format!("{key}/");
            let from = names.partition_point(|n| n.as_str() < folder.as_str());
            let files = names[from..].iter().take_while(|n| n.starts_with(&folder)).count() as u64;
            let count = grid.iter().try_fold(1u64, |a, &g| a.checked_mul(g));
            if count.is_none_or(|c| c > files) {
                let count = count.map_or_else(|| "more than 2^64".to_string(), |c| c.to_string());
                return Err(Error::corrupt(
                    &shown,
                    format!(
                        "{key:?}: shape {:?} in chunks of {:?} is a grid of {count} chunks, but its folder holds {files} files",
                        arr.shape, arr.chunks
                    ),
                ));
            }
            let count = count.unwrap_or(0);
            let mut chunks = Vec::with_capacity(count as usize);
            let mut idx = vec![0u64; grid.len()];
            for _ in 0..count {
                let offset: Vec<u64> = idx.iter().zip(&arr.chunks).map(|(i, c)| i * c).collect();
                let shape: Vec<u64> =
                    offset.iter().zip(&arr.chunks).zip(&arr.shape).map(|((o, c), n)| (*c).min(n - o)).collect();
                let path = format!("{key}/{}", arr.chunk_name(&idx));
                let bytes = shape.iter().product::<u64>() * esize;
                let source =
                    Source::RawBox { path: path.clone(), stored: arr.chunks.clone(), shape: shape.clone(), esize };
                let file = view.add(path, Some(bytes), source);
                chunks.push(StoredChunk {
                    file,
                    byte_offset: 0,
                    offset: offset.as_slice().into(),
                    shape: shape.as_slice().into(),
                    flat: None,
                    crcs: Crcs::new(),
                });
                for d in (0..idx.len()).rev() {
                    idx[d] += 1;
                    if idx[d] < grid[d] {
                        break;
                    }
                    idx[d] = 0;
                }
            }
            tensors.push(TensorEntry::new(key.to_string(), arr.dtype, arr.shape, chunks));
        } else if let Some(stem) = name.strip_suffix(".pt") {
            let Some((key, offset, shape)) = parse_object_fqn(stem) else { continue };
            let file = view.add(name.clone(), None, Source::TorchFile { path: name.clone() });
            objects.add(key, offset, shape, file, &format!("{}/{name}", storage.location()))?;
        }
    }
    let common = view.megatron_common(None)?.unwrap_or_default();
    let index = foreign_index(Backend::Zarr, &view, common, tensors, objects);
    Ok((index, view))
}
