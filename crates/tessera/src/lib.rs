//! tessera: distributed checkpointing for large-model training.
//!
//! Each rank of a job describes its piece of every tensor as a [`ShardedTensor`] in a
//! [`StateTree`]; [`save`] writes the pieces as one checkpoint (safetensors data files plus a
//! binary index written last, atomically: the commit marker), and [`load`] reads any other
//! layout back (any parallelism, any world size), touching only the bytes each rank needs.
//! [`open`] opens a checkpoint of any format tessera reads (its own, PyTorch DCP, Megatron
//! torch_dist and zarr, OLMo-core, plain safetensors) as a [`Checkpoint`] with every read
//! operation.
//!
//! ```
//! use tessera::{load, open, save, DType, InProcessComm, LoadOptions, MemoryStorage, SaveOptions};
//! use tessera::{ShardedTensor, StateTree, TensorData};
//!
//! let bytes = |xs: &[f32]| xs.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
//! let storage = MemoryStorage::new();
//! // Two ranks each hold one half (along axis 0) of a 4-element tensor and save together.
//! InProcessComm::run(2, |comm| {
//!     let rank = tessera::Communicator::rank(comm);
//!     let half = bytes(if rank == 0 { &[1.0, 2.0] } else { &[3.0, 4.0] });
//!     let t = ShardedTensor::from_rank_offsets("w", DType::F32, &[2], TensorData::Owned(half), &[(0, rank as u64, 2)], 0)?;
//!     save(StateTree::map().with("w", StateTree::Tensor(t)), &storage, comm, &SaveOptions::default())
//! })
//! .into_iter()
//! .collect::<Result<Vec<_>, _>>()?;
//!
//! // One process loads the whole tensor: another layout, another world size.
//! let mut whole = vec![0u8; 16];
//! let want = ShardedTensor::full("w", DType::F32, &[4], TensorData::Mut(&mut whole));
//! load(StateTree::map().with("w", StateTree::Tensor(want)), &storage, &tessera::SoloComm, &LoadOptions::default())?;
//! assert_eq!(whole, bytes(&[1.0, 2.0, 3.0, 4.0]));
//! assert_eq!(open(&storage)?.read_tensors(None)?["w"].data, whole);
//! # Ok::<(), tessera::Error>(())
//! ```
//!
//! Whole-checkpoint tools work on every readable format through the same index and loader:
//! [`verify`], [`diff`], [`convert`] (native format), [`convert_to_dcp`] (torch_dist / DCP),
//! [`export_safetensors`] (plain Hugging Face safetensors), [`gc`]; all stream with bounded
//! memory.
//!
//! The crate's folders follow the flow (ARCHITECTURE.md): `model` (what users build), `plan`
//! (pure planning and the one validation gate), `format` (the native bytes), `formats` (other
//! programs' formats), `storage` and `comm` (leaves), `save` and `load` (the engines), `tools`.
#![deny(missing_docs)]

mod comm;
mod error;
mod format;
mod formats;
mod load;
mod model;
mod plan;
mod save;
mod storage;
#[cfg(test)]
mod test_rng;
mod threads;
mod tools;

// The data model.
pub use model::dtype::{cast_bytes, DType};
pub use model::{
    path_string, PartSpec, PathSeg, ReplicaId, ShardedObject, ShardedTensor, ShardedTensorFactory, SplitFactory,
    StatePath, StateTree, TensorData, TensorFactory, Value,
};

// Errors.
pub use error::{Error, Result};

// Where bytes live, and how ranks talk.
#[cfg(feature = "mpi")]
pub use comm::MpiComm;
pub use comm::{default_all_to_all, Communicator, InProcessComm, SoloComm};
/// The `mpi` crate (rsmpi), for its `Universe` and communicators (feature `mpi`).
#[cfg(feature = "mpi")]
pub use mpi;
/// The storage conformance suite every backend runs (feature `conformance`).
#[cfg(feature = "conformance")]
pub use storage::conformance;
pub use storage::{
    open_location, open_location_with, CountingStorage, LocalStorage, MemoryStorage, ObjectWriter, Storage, StorageExt,
};
#[cfg(any(feature = "s3", feature = "gcs", feature = "azure"))]
pub use storage::{ObjectStorage, ObjectStoreOptions, RequestCounts};

// Opening and reading any checkpoint.
pub use format::{
    CheckpointIndex, Crcs, FileEntry, ObjectEntry, StoredChunk, StoredObject, TensorEntry, DEFAULT_BLOCK_SIZE,
    FORMAT_VERSION, INDEX_FILE,
};
pub use formats::olmo::read_olmo_metadata;
pub use formats::FormatRecord;
pub use load::engine::{load, LoadOptions, LoadResult, LoadStats, PlainTensor, StrictHandling, TensorMeta};
pub use load::open::{open, open_with, Checkpoint, OpenOptions};

// Saving.
pub use save::async_save::{AsyncSave, AsyncSaver};
pub use save::native::save;
pub use save::olmo::{save_olmo, save_olmo_dirs, OlmoSaveReport};
pub use save::options::{PlanCache, SaveOptions, SaveReport};
pub use save::plan::validate_sharding_integrity;
pub use save::staging::{StagingPool, DEFAULT_STAGING_BUFFER};
pub use save::torch_dist::{save_torch_dist, TorchDistSave};

// Whole-checkpoint tools.
pub use tools::convert::{convert, ConvertOptions, ConvertReport};
pub use tools::convert_dcp::convert_to_dcp;
pub use tools::diff::{
    diff, CommonDiff, DiffOptions, DiffReport, ObjectDiff, ObjectDifference, TensorDiff, TensorDifference, ValueDiff,
};
pub use tools::export::{export_safetensors, ExportOptions, ExportReport};
pub use tools::maintenance::{gc, remove_sharded_tensors, GcOptions, GcReport, RunningSave};
pub use tools::pipeline::DEFAULT_MEMORY_BUDGET;
pub use tools::verify::{verify, VerifyReport};

/// How tessera's Python package stores what the data model has no type for (FORMAT.md, "What
/// the Python package adds"): the Rust core reads these when it converts a checkpoint to
/// another program's format, the Python package takes them from here.
pub mod python_conventions {
    pub use crate::formats::torch_dist::{
        INT_KEY_PREFIX, OBJECT_TAG_TORCH, OBJECT_TAG_TORCH_LIST, OBJECT_TAG_VALUE, TORCH_SAVE_KEY,
    };
}

/// The planner's pure functions for the plan simulator and benchmarks (`crates/tessera-bench`,
/// feature `plan-internals`). Not API: no stability promise.
#[cfg(feature = "plan-internals")]
#[doc(hidden)]
pub mod __plan {
    pub use crate::format::data_file;
    pub use crate::model::dims;
    pub use crate::plan::{exchange, geometry, load, save, validate};
}

/// Seams for the fault-injection tests (feature `fault-injection`): an export whose file
/// operations a test provides, and can fail one by one. Not API: no stability promise.
#[cfg(feature = "fault-injection")]
#[doc(hidden)]
pub mod __testing {
    pub use crate::save::safetensors::{ExportFileIo, ExportFs, LocalFs};
    pub use crate::tools::export::export_with;
}

/// Entry points into crate-private parsers for the fuzz targets in `fuzz/` (feature
/// `fuzzing`). Not API: thin wrappers returning plain data, no stability promise.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod __fuzz {
    pub use crate::format::safetensors::parse_header;
    pub use crate::formats::pickle::{unpickle, PickleValue, UnpickleLimits};

    use crate::formats::dcp::metadata as dcp;
    use crate::formats::pickle;
    use crate::formats::torch_save;
    use crate::formats::zarr::zarray as zarr;

    /// The storage a checkpoint's index names resolve in (a foreign format's virtual files),
    /// for tests that read one directly.
    pub fn checkpoint_storage<'a>(ckpt: &'a crate::Checkpoint<'_>) -> &'a dyn crate::Storage {
        ckpt.storage()
    }

    /// A `.zarray` as [`zarray`] returns it: shape, chunks, chunk grid, name of the last chunk.
    pub type Zarray = (Vec<u64>, Vec<u64>, Vec<u64>, String);
    /// Zip entries: name, offset (of the data, or of the local header), size.
    pub type ZipEntries = Vec<(String, u64, u64)>;

    /// A DCP `.metadata` pickle as the DCP reader decodes it (its limits), then interpreted:
    /// `(tensors, chunks, byte items)`.
    pub fn dcp_metadata(bytes: &[u8]) -> Result<(usize, usize, usize), String> {
        let root = pickle::unpickle_view(bytes, "fuzz/.metadata", &torch_save::limits()).map_err(|e| e.to_string())?;
        let m = dcp::parse_metadata(root.root())?;
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

    /// How many members of a whole zip archive have data that does not match their CRC-32.
    pub fn zip_crc_mismatches(archive: &[u8]) -> Result<usize, String> {
        let entries = torch_save::zip_entries(archive)?;
        Ok(entries.iter().filter(|e| torch_save::crc_mismatch(archive, e).is_some()).count())
    }

    /// Megatron-Core's `integrity.json` as `verify` parses it: how many files it lists.
    pub fn integrity_manifest(bytes: &[u8]) -> Result<usize, String> {
        crate::formats::dcp::integrity::parse_integrity(bytes).map(|m| m.len())
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
