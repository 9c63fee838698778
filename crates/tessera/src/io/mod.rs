//! Everything that moves bytes: save and load orchestration, parallel reads and writes,
//! the strategy registry, verification, and the whole-checkpoint tools (export to plain
//! safetensors, conversion to the native format, diff). Plans come from `plan/`; bytes go
//! through `storage/`.

pub(crate) mod async_save;
pub(crate) mod convert;
pub(crate) mod diff;
pub(crate) mod export;
pub(crate) mod factories;
pub(crate) mod foreign;
pub(crate) mod index_read;
pub(crate) mod load;
pub(crate) mod maintenance;
pub(crate) mod pipeline;
pub(crate) mod read;
pub(crate) mod save;
pub(crate) mod staging;
pub(crate) mod strategy;
pub(crate) mod verify;
pub(crate) mod write;
