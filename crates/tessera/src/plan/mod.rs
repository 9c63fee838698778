//! Planning: pure, synchronous functions from metadata to plans. Geometry of chunks, the save
//! exchange and validation, data-file layout, index assembly, load intersection and read
//! grouping, the fully-parallel load exchange, verification shared between ranks. Nothing here
//! does IO, so all of it is unit- and property-testable and can be run for 10,000 simulated
//! ranks.

pub mod exchange;
pub(crate) mod fasthash;
pub mod geometry;
pub mod load;
pub mod placement;
pub mod save;
pub mod shared;
pub mod validate;

pub use crate::model::ForEach;
