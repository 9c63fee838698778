//! Entry points of the `dcp` fuzz target (feature `fuzzing`): DCP's `.metadata` and
//! Megatron-Core's `integrity.json` as the reader parses them, returning plain data.

use crate::formats::pickle;
use crate::formats::torch_save;

/// A DCP `.metadata` pickle as the DCP reader decodes it (its limits), then interpreted:
/// `(tensors, chunks, byte items)`.
pub fn dcp_metadata(bytes: &[u8]) -> Result<(usize, usize, usize), String> {
    let root = pickle::unpickle_view(bytes, "fuzz/.metadata", &torch_save::limits()).map_err(|e| e.to_string())?;
    let m = super::metadata::parse_metadata(root.root())?;
    Ok((m.tensors.len(), m.tensors.iter().map(|t| t.chunks.len()).sum(), m.bytes.len()))
}

/// Megatron-Core's `integrity.json` as `verify` parses it: how many files it lists.
pub fn integrity_manifest(bytes: &[u8]) -> Result<usize, String> {
    super::integrity::parse_integrity(bytes).map(|m| m.len())
}
