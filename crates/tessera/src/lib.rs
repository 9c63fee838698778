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
//! use tessera::comm::{InProcessComm, SoloComm};
//! use tessera::storage::MemoryStorage;
//! use tessera::{load, open, save, DType, LoadOptions, SaveOptions, ShardedTensor, StateTree, TensorData};
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
//! load(StateTree::map().with("w", StateTree::Tensor(want)), &storage, &SoloComm, &LoadOptions::default())?;
//! assert_eq!(whole, bytes(&[1.0, 2.0, 3.0, 4.0]));
//! assert_eq!(open(&storage)?.read_tensors(None)?["w"].data, whole);
//! # Ok::<(), tessera::Error>(())
//! ```
//!
//! At the root is what every job touches: [`open`], [`save`], [`load`] and their options and
//! reports, the [`AsyncSaver`], the state tree ([`StateTree`], [`ShardedTensor`],
//! [`ShardedObject`], [`Value`], [`DType`]), and the two things a job brings: where bytes live
//! ([`Storage`]) and how its ranks talk ([`Communicator`]); all fail with one [`Error`]. The
//! rest is in modules named for what a user reaches for:
//!
//! - [`storage`]: the backends (local, memory, object stores), [`storage::Location`] to open
//!   one from a string, and the storage conformance suite (feature `conformance`);
//! - [`comm`]: communicators (one process, threads, MPI);
//! - [`factory`]: tensors that are saved as other tensors (Megatron's `ShardedTensorFactory`);
//! - [`index`]: what a checkpoint holds, as [`Checkpoint::index`] shows it, and
//!   [`index::Backend`], the formats tessera reads;
//! - [`tools`]: whole-checkpoint tools on every readable format, streaming with bounded memory:
//!   verify, [`tools::diff`], convert (native, or torch_dist / DCP), export to plain
//!   safetensors, gc;
//! - [`olmo`], [`torch_dist`]: the other programs' formats tessera writes.
//!
//! The crate's private folders follow the flow (ARCHITECTURE.md): `model` (what users build),
//! `plan` (pure planning and the one validation gate), `format` (the native bytes), `formats`
//! (other programs' formats), `storage` and `comm` (leaves), `save` and `load` (the engines),
//! `tools`.
#![deny(missing_docs)]
// Every type a user can reach, a user can name (the doc-hidden doors for the fuzz targets, the
// plan simulator and the tests hand out internal types, behind their features: not API).
#![cfg_attr(
    not(any(feature = "fuzzing", feature = "plan-internals", feature = "fault-injection")),
    deny(unnameable_types)
)]

pub mod comm;
mod error;
mod format;
mod formats;
mod load;
pub mod memory_tier;
mod model;
mod plan;
mod save;
pub mod storage;
#[cfg(test)]
mod test_rng;
mod threads;
pub mod tools;

// The state tree: what each rank describes and saves or loads.
pub use model::dtype::DType;
pub use model::{
    path_string, PathSeg, ReplicaId, ShardedObject, ShardedTensor, StatePath, StateTree, TensorData, Value,
};

// What a job brings, and how everything fails.
pub use comm::Communicator;
pub use error::{Error, Result};
pub use storage::Storage;

// Opening and reading any checkpoint.
pub use load::open::{open, open_with, Checkpoint, OpenOptions};

// Saving, now or in the background.
pub use save::async_save::{AsyncSave, AsyncSaver};
pub use save::native::save;
pub use save::options::{PlanCache, SaveOptions, SaveReport};
pub use save::plan::validate_sharding_integrity;
pub use save::staging::StagingPool;

// Loading into any layout.
pub use load::engine::{load, LoadOptions, LoadResult, LoadStats, PlainTensor, StrictHandling, TensorMeta};
pub use plan::load::ReadTuning;

/// Tensors saved and loaded as other tensors: a [`StateTree::Factory`] holds a
/// [`ShardedTensorFactory`], whose [`TensorFactory`] builds the sub-state actually stored
/// (Megatron-Core's `ShardedTensorFactory`); [`SplitFactory`] is the one tessera provides, a
/// fused tensor stored as its parts ([`PartSpec`]).
pub mod factory {
    pub use crate::model::{PartSpec, ShardedTensorFactory, SplitFactory, TensorFactory};
}

/// What a checkpoint holds, as [`Checkpoint::index`](crate::Checkpoint::index) shows it: the
/// files, tensors (and the chunks they are stored in), sharded objects and common state,
/// from whichever format it was read ([`Backend`], in [`FormatRecord`]); every index passed
/// one validation before anything reads by it. The native format's constants are here too.
pub mod index {
    pub use crate::format::{
        Backend, CheckpointIndex, Crcs, FileEntry, ObjectEntry, StoredChunk, StoredObject, TensorEntry,
        DEFAULT_BLOCK_SIZE, FORMAT_VERSION, INDEX_FILE,
    };
    pub use crate::formats::FormatRecord;
    pub use crate::model::dims::Dims;
}

/// OLMo-core 0.1.x checkpoints (`model/` and `optim/` safetensors with `metadata.json`), which
/// tessera writes as well as reads: [`save_olmo`] (every rank's part, collectively),
/// [`save_olmo_dirs`] (a whole checkpoint from a native one), and [`read_olmo_metadata`].
pub mod olmo {
    pub use crate::formats::olmo::read_olmo_metadata;
    pub use crate::save::olmo::{save_olmo, save_olmo_dirs, OlmoSaveReport};
}

/// Megatron-Core `torch_dist` / PyTorch DCP directories, which tessera writes as well as reads:
/// [`save_torch_dist`] (every rank's part, collectively), [`TorchDistSave`] (the same save in
/// its three steps, for callers that run the file writes themselves), and how tessera's Python
/// package stores what the data model has no type for (FORMAT.md, "What the Python package
/// adds"): the Rust core reads these when it converts a checkpoint to another program's
/// format, the Python package takes them from here.
pub mod torch_dist {
    pub use crate::formats::torch_dist::{
        INT_KEY_PREFIX, OBJECT_TAG_TORCH, OBJECT_TAG_TORCH_LIST, OBJECT_TAG_VALUE, TORCH_SAVE_KEY,
    };
    pub use crate::save::torch_dist::{save_torch_dist, TorchDistSave};
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

/// Entry points into crate-private parsers for the fuzz targets in `fuzz/` and the
/// hostile-input tests (feature `fuzzing`), each defined beside its parser. Not API: thin
/// wrappers returning plain data, no stability promise.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod __fuzz {
    pub use crate::format::safetensors::parse_header;
    pub use crate::formats::dcp::fuzz::{dcp_metadata, integrity_manifest};
    pub use crate::formats::pickle::{unpickle, PickleValue, UnpickleLimits};
    pub use crate::formats::torch_save::fuzz::{
        torch_save, torch_save_tensor, zip_crc_mismatches, zip_entries, zip_tail, ZipEntries,
    };
    pub use crate::formats::zarr::fuzz::{zarray, Zarray};
    pub use crate::load::open::checkpoint_storage;
    pub use crate::memory_tier::fuzz::manifest_plan;
}
