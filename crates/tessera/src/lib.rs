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
mod dtype;
mod error;
mod format;
mod formats;
mod io;
pub mod plan;
mod save;
mod state;
mod storage;
#[cfg(test)]
mod test_rng;

#[cfg(feature = "mpi")]
pub use comm::MpiComm;
pub use comm::{default_all_to_all, Communicator, InProcessComm, SoloComm};
pub use dtype::{cast_bytes, cast_into, element_to_f64, DType, ALL_DTYPES};
pub use error::{Error, Result};
pub use format::{
    build_header, crc_hex, parse_header, unpickle, CheckpointIndex, FileEntry, ObjectEntry, PickleObject, PickleValue,
    SafetensorsEntry, StoredChunk, StoredObject, TensorEntry, UnpickleLimits, DEFAULT_BLOCK_SIZE, FORMAT_VERSION,
    INDEX_FILE, INDEX_MAGIC, NATIVE_BACKEND,
};
pub use io::async_save::{AsyncSave, AsyncSaver};
pub use io::convert::{convert, ConvertOptions, ConvertReport};
pub use io::diff::{
    diff, CommonDiff, DiffOptions, DiffReport, ObjectDiff, ObjectDifference, TensorDiff, TensorDifference, ValueDiff,
};
pub use io::export::{export_safetensors, ExportOptions, ExportReport, SAFETENSORS_INDEX_FILE};
pub use io::foreign::dcp::{DcpFlavor, DcpStrategy};
pub use io::foreign::olmo::{read_olmo_metadata, OlmoStrategy};
pub use io::foreign::zarr::ZarrStrategy;
pub use io::foreign::{OBJECT_TAG_TORCH, OBJECT_TAG_TORCH_LIST, OBJECT_TAG_VALUE};
pub use io::load::{
    load, load_checkpoint, load_common_state, load_content_metadata, load_from_index, load_plain_tensors,
    load_sharded_objects, load_tensors_metadata, open_for_load, LoadOptions, LoadResult, LoadStats, PlainTensor,
    StrictHandling, TensorMeta,
};
pub use io::maintenance::{gc, remove_sharded_tensors};
pub use io::pipeline::DEFAULT_MEMORY_BUDGET;
pub use io::save::{save, validate_sharding_integrity, PlanCache, SaveOptions, SaveReport};
pub use io::staging::{StagingPool, DEFAULT_STAGING_BUFFER};
pub use io::strategy::{
    detect_format, get_save_strategy, open_checkpoint, open_checkpoint_keys, open_index, register_load_strategy,
    register_save_strategy, FormatRecord, LoadStrategy, NativeStrategy, OpenCheckpoint, SaveStrategy, StrategyAction,
};
pub use io::verify::{verify, VerifyReport};
/// The `mpi` crate (rsmpi), for its `Universe` and communicators (feature `mpi`).
#[cfg(feature = "mpi")]
pub use mpi;
pub use save::olmo::{save_olmo, save_olmo_dirs, OlmoSaveReport};
pub use state::{
    path_string, PartSpec, PathSeg, ReplicaId, ShardedObject, ShardedTensor, ShardedTensorFactory, SplitFactory,
    StatePath, StateTree, TensorData, TensorFactory, Value,
};
pub use storage::{open_location, CountingStorage, LocalStorage, MemoryStorage, ObjectWriter, Storage};
#[cfg(any(feature = "s3", feature = "gcs", feature = "azure"))]
pub use storage::{ObjectStorage, ObjectStoreOptions, RequestCounts};
