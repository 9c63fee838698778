//! Saving: the native engine (plan exchange, validation, the write pipeline, commit), async
//! save and its staging buffers, and the engines writing other programs' formats (OLMo-core,
//! Megatron torch_dist / DCP) with the same plan and validation. Writing threads start here.

pub(crate) mod async_save;
pub(crate) mod native;
pub(crate) mod olmo;
pub(crate) mod staging;
pub(crate) mod torch_dist;
pub(crate) mod write;
