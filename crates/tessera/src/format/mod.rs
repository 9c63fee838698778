//! The native bytes: the binary index (the commit marker; v1 and v2), the data file (its name
//! both ways, its header encoded and decoded), the one validating reader of safetensors headers
//! every format uses (FORMAT.md). Pure data in, data out: nothing here touches storage or starts
//! a thread.

pub mod data_file;
pub(crate) mod index;
pub(crate) mod lease;
pub(crate) mod safetensors;
pub(crate) mod tier_manifest;

pub use crate::model::crcs::Crcs;
pub(crate) use data_file::{data_file_name, is_data_file_name, parse_data_file_name};
pub(crate) use index::NATIVE_BACKEND;
pub use index::{
    Backend, CheckpointIndex, FileEntry, ObjectEntry, StoredChunk, StoredObject, TensorEntry, DEFAULT_BLOCK_SIZE,
    FORMAT_VERSION, INDEX_FILE,
};
pub(crate) use safetensors::{
    build_header, crc_hex, read_header, SafetensorsEntry, SafetensorsHeader, SAFETENSORS_ALIGN,
};
