//! Everything that moves bytes: save and load orchestration, parallel reads and writes,
//! the strategy registry, verification. Plans come from `plan/`; bytes go through `storage/`.

pub(crate) mod async_save;
pub(crate) mod factories;
pub(crate) mod foreign;
pub(crate) mod load;
pub(crate) mod maintenance;
pub(crate) mod read;
pub(crate) mod save;
pub(crate) mod staging;
pub(crate) mod strategy;
pub(crate) mod verify;
pub(crate) mod write;
