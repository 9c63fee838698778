//! On-disk formats: the binary index (commit marker), safetensors data files, and the compact
//! codec both use. Pure data in, data out: nothing here touches storage.

pub(crate) mod index;
pub(crate) mod pickle;
pub(crate) mod pickle_write;
pub(crate) mod safetensors;

pub(crate) use index::check_file_name;
pub use index::{
    CheckpointIndex, FileEntry, ObjectEntry, StoredChunk, StoredObject, TensorEntry, DEFAULT_BLOCK_SIZE,
    FORMAT_VERSION, INDEX_FILE, INDEX_MAGIC, NATIVE_BACKEND,
};
pub use pickle::{unpickle, PickleObject, PickleValue, UnpickleLimits};
pub use safetensors::{build_header, crc_hex, parse_header, SafetensorsEntry};
