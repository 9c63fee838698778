//! Whole-checkpoint tools, built on `load/` and `save/`: verify, diff, convert (native or
//! torch_dist / DCP), export to plain safetensors, garbage collection and maintenance. All
//! stream under a memory budget (`pipeline`).

pub(crate) mod convert;
pub(crate) mod convert_dcp;
pub mod diff;
pub(crate) mod export;
pub(crate) mod maintenance;
pub(crate) mod pipeline;
pub(crate) mod verify;

pub use convert::{convert, ConvertOptions, ConvertReport};
pub use convert_dcp::convert_to_dcp;
pub use export::{export_safetensors, ExportOptions, ExportReport};
pub use maintenance::{gc, remove_sharded_tensors, GcOptions, GcReport, RunningSave};
pub use verify::{verify, VerifyReport};
