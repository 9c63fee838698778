//! tessera: distributed checkpointing for large-model training.
//!
//! Each rank of a job describes its piece of every tensor as a [`ShardedTensor`] in a
//! [`StateTree`]; [`save`] writes the pieces as one checkpoint (safetensors data files plus a
//! binary index written last, atomically: the commit marker), and [`load`] reads any other
//! layout back — any parallelism, any world size — touching only the bytes each rank needs.
//!
//! Whole-checkpoint tools work on every readable format through the same index and loader:
//! [`export_safetensors`] (plain Hugging Face safetensors, optionally sharded and cast),
//! [`convert`] (to the native format, keeping the chunk structure) and [`diff`]; all stream
//! with bounded memory. Element casts: [`cast_bytes`], [`element_to_f64`].
//!
//! Layout of the crate: `state` (the data model), `plan` (pure planning: geometry, validation,
//! read grouping), `format` (byte layouts), `storage` (where bytes live), `comm` (collectives),
//! `io` (orchestration: the only code that moves bytes). See ARCHITECTURE.md and FORMAT.md.
#![deny(missing_docs)]

mod comm;
mod error;
mod format;
mod formats;
mod load;
mod model;
pub mod plan;
mod save;
mod storage;
#[cfg(test)]
mod test_rng;
mod tools;

#[cfg(feature = "mpi")]
pub use comm::MpiComm;
pub use comm::{default_all_to_all, Communicator, InProcessComm, SoloComm};
pub use error::{Error, Result};
pub use format::{
    build_header, crc_hex, parse_header, unpickle, CheckpointIndex, FileEntry, ObjectEntry, PickleObject, PickleValue,
    SafetensorsEntry, StoredChunk, StoredObject, TensorEntry, UnpickleLimits, DEFAULT_BLOCK_SIZE, FORMAT_VERSION,
    INDEX_FILE, INDEX_MAGIC, NATIVE_BACKEND,
};
pub use formats::olmo::read_olmo_metadata;
pub use formats::FormatRecord;
pub use formats::{OBJECT_TAG_TORCH, OBJECT_TAG_TORCH_LIST, OBJECT_TAG_VALUE};
pub use load::engine::{
    load, load_checkpoint, load_common_state, load_content_metadata, load_from_index, load_plain_tensors,
    load_sharded_objects, load_tensors_metadata, open_for_load, LoadOptions, LoadResult, LoadStats, PlainTensor,
    StrictHandling, TensorMeta,
};
pub use load::open::{open_checkpoint, open_checkpoint_keys, open_index, OpenCheckpoint};
pub use model::dtype::{cast_bytes, cast_into, element_to_f64, DType, ALL_DTYPES};
pub use model::{
    path_string, PartSpec, PathSeg, ReplicaId, ShardedObject, ShardedTensor, ShardedTensorFactory, SplitFactory,
    StatePath, StateTree, TensorData, TensorFactory, Value,
};
/// The `mpi` crate (rsmpi), for its `Universe` and communicators (feature `mpi`).
#[cfg(feature = "mpi")]
pub use mpi;
pub use save::async_save::{AsyncSave, AsyncSaver};
pub use save::native::{save, validate_sharding_integrity, PlanCache, SaveOptions, SaveReport};
pub use save::olmo::{save_olmo, save_olmo_dirs, OlmoSaveReport};
pub use save::staging::{StagingPool, DEFAULT_STAGING_BUFFER};
pub use save::torch_dist::{save_torch_dist, TorchDistSave};
#[cfg(feature = "conformance")]
pub use storage::conformance;
pub use storage::{open_location, CountingStorage, LocalStorage, MemoryStorage, ObjectWriter, Storage, StorageExt};
#[cfg(any(feature = "s3", feature = "gcs", feature = "azure"))]
pub use storage::{ObjectStorage, ObjectStoreOptions, RequestCounts};
pub use tools::convert::{convert, ConvertOptions, ConvertReport};
pub use tools::convert_dcp::convert_to_dcp;
pub use tools::diff::{
    diff, CommonDiff, DiffOptions, DiffReport, ObjectDiff, ObjectDifference, TensorDiff, TensorDifference, ValueDiff,
};
pub use tools::export::{export_safetensors, ExportOptions, ExportReport, SAFETENSORS_INDEX_FILE};
pub use tools::maintenance::{gc, remove_sharded_tensors};
pub use tools::pipeline::DEFAULT_MEMORY_BUDGET;
pub use tools::verify::{verify, VerifyReport};

/// Entry points into crate-private parsers for the fuzz targets in `fuzz/` (feature
/// `fuzzing`). Not API: thin wrappers returning plain data, no stability promise.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod __fuzz {
    use crate::format::pickle;
    use crate::formats::dcp::metadata as dcp;
    use crate::formats::torch_save;
    use crate::formats::zarr::zarray as zarr;

    /// A `.zarray` as [`zarray`] returns it: shape, chunks, chunk grid, name of the last chunk.
    pub type Zarray = (Vec<u64>, Vec<u64>, Vec<u64>, String);
    /// Zip entries: name, offset (of the data, or of the local header), size.
    pub type ZipEntries = Vec<(String, u64, u64)>;

    /// A DCP `.metadata` pickle as the DCP reader decodes it (its limits), then interpreted:
    /// `(tensors, chunks, byte items)`.
    pub fn dcp_metadata(bytes: &[u8]) -> Result<(usize, usize, usize), String> {
        let root = pickle::unpickle(bytes, "fuzz/.metadata", &torch_save::limits()).map_err(|e| e.to_string())?;
        let m = dcp::parse_metadata(&root)?;
        Ok((m.tensors.len(), m.tensors.iter().map(|t| t.chunks.len()).sum(), m.bytes.len()))
    }

    /// A `.zarray`: `(shape, chunks, chunk grid, name of the last chunk)`.
    pub fn zarray(bytes: &[u8]) -> Result<Zarray, String> {
        let a = zarr::parse_zarray(bytes)?;
        let grid = a.grid();
        let last: Vec<u64> = grid.iter().map(|g| g.saturating_sub(1)).collect();
        let name = a.chunk_name(&last);
        Ok((a.shape, a.chunks, grid, name))
    }

    /// Every entry of a whole zip archive: `(name, data offset, size)`.
    pub fn zip_entries(archive: &[u8]) -> Result<ZipEntries, String> {
        Ok(torch_save::zip_entries(archive)?.into_iter().map(|e| (e.name, e.data_offset, e.size)).collect())
    }

    /// The ranged zip path of the DCP reader: the central directory found from the last bytes
    /// `tail` of an `archive_len`-byte archive, then parsed when it lies inside `tail`:
    /// `(name, local header offset, size)` per entry.
    pub fn zip_tail(tail: &[u8], archive_len: u64) -> Result<Option<ZipEntries>, String> {
        let Some((off, size, count)) = torch_save::find_central_directory(tail, archive_len)? else { return Ok(None) };
        let base = archive_len - tail.len() as u64;
        if off < base {
            return Ok(None);
        }
        let cd = &tail[(off - base) as usize..(off - base + size) as usize];
        let entries = torch_save::parse_central_directory(cd, count, archive_len)?;
        for e in &entries {
            if let Some(at) = e.local_offset.checked_sub(base) {
                let _ = torch_save::local_header_len(tail.get(at as usize..).unwrap_or(&[]));
            }
        }
        Ok(Some(entries.into_iter().map(|e| (e.name, e.local_offset, e.size)).collect()))
    }

    /// A whole `torch.save` archive decoded as the object readers do.
    pub fn torch_save(archive: &[u8]) -> Result<pickle::PickleValue, String> {
        torch_save::decode_archive(archive, "fuzz.pt")
    }

    /// A `torch.save` of one tensor decoded as a DCP tensor item is: its C-order bytes.
    pub fn torch_save_tensor(archive: &[u8]) -> Result<Vec<u8>, String> {
        let entries = torch_save::zip_entries(archive)?;
        let pkl = torch_save::find_entry(&entries, "data.pkl").ok_or("no data.pkl")?;
        let v = pickle::unpickle(
            &archive[pkl.data_offset as usize..(pkl.data_offset + pkl.size) as usize],
            "fuzz.pt",
            &torch_save::limits(),
        )
        .map_err(|e| e.to_string())?;
        let rec = torch_save::tensor_record(&v)?;
        let e = torch_save::find_entry(&entries, &format!("data/{}", rec.storage_key)).ok_or("no storage entry")?;
        torch_save::gather(&archive[e.data_offset as usize..(e.data_offset + e.size) as usize], &rec)
    }
}
