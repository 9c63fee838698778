//! The native bytes: the binary index (the commit marker; v1 and v2), the safetensors header of
//! data files and its checksums, and the names of data files (FORMAT.md). Pure data in, data
//! out: nothing here touches storage or starts a thread.

pub(crate) mod index;
pub(crate) mod safetensors;

pub use crate::model::crcs::Crcs;
pub(crate) use index::NATIVE_BACKEND;
pub use index::{
    CheckpointIndex, FileEntry, ObjectEntry, StoredChunk, StoredObject, TensorEntry, DEFAULT_BLOCK_SIZE,
    FORMAT_VERSION, INDEX_FILE,
};
pub(crate) use safetensors::{build_header, crc_hex, parse_header, SafetensorsEntry, DATA_ALIGN, SAFETENSORS_ALIGN};

/// True for names tessera gives its data files (`<16 hex>-r<rank>.safetensors`).
pub(crate) fn is_data_file_name(name: &str) -> bool {
    let Some(stem) = name.strip_suffix(".safetensors") else { return false };
    let Some((id, r)) = stem.split_once("-r") else { return false };
    id.len() == 16
        && id.bytes().all(|b| b.is_ascii_hexdigit())
        && !r.is_empty()
        && r.bytes().all(|b| b.is_ascii_digit())
}
