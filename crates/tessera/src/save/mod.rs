//! Saving: one write session per output format, each `plan` (collective: the exchange and every
//! check) → `write_file(k)` (local, any thread) → `commit` (collective), ending in the one commit
//! protocol (`commit`); the sync and async saves, `convert`, `convert_to_dcp` and the export are
//! compositions of a session. Writing threads start here.
//!
//! - `plan`: what every writer does first (collect, exchange, validate, assign writers, plan
//!   cache, save ids, the look at the location); `options`: what writers take and report.
//! - `native`, `async_save` (+ `staging`), `olmo`, `torch_dist`, `safetensors`: the sessions.
//! - `commit`: the commit protocol; `lease`: the lease of a running save; `write`: positioned
//!   writes with block checksums; `outfile`: rules for files written outside a checkpoint.

pub(crate) mod async_save;
pub(crate) mod commit;
pub(crate) mod lease;
pub(crate) mod native;
pub(crate) mod olmo;
pub(crate) mod options;
pub(crate) mod outfile;
pub(crate) mod plan;
pub(crate) mod safetensors;
pub(crate) mod staging;
pub(crate) mod torch_dist;
pub(crate) mod write;
