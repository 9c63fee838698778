//! Checkpoint formats other programs write, one module each: detection from a format's own
//! bytes and parsing of its metadata into a [`crate::CheckpointIndex`] (pure: bytes in, data
//! out, never panicking on any input). The reads that feed them live with the load strategies
//! (`io/foreign/`); the older foreign parsers (`format/dcp.rs`, `format/zarr.rs`) move here in
//! the re-cut of the crate.

pub(crate) mod olmo;
pub(crate) mod torch_dist;
