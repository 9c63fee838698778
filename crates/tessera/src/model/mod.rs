//! The data model: what users build and hand to save and load (sharded tensors and objects,
//! factories, the state tree, plain values, element types), and the compact encoding of its
//! values (`codec`) that the index and the wire between ranks share.

pub(crate) mod codec;
pub(crate) mod crc;
pub mod crcs;
pub mod dims;
pub(crate) mod dtype;
pub(crate) mod factories;
mod object;
mod tensor;
mod value;

pub use object::{
    path_string, PartSpec, PathSeg, ShardedObject, ShardedTensorFactory, SplitFactory, StatePath, StateTree,
    TensorFactory,
};
pub use tensor::{ReplicaId, ShardedTensor, TensorData};
pub use value::Value;

/// Runs `work(i)` for each `i` in `0..n`, in any order and possibly from several threads: how
/// the caller of a pure function (`plan/`), a decoder (`format/`) or a format's opener
/// (`formats/`) chooses the threads their independent parts run on. Those modules start no
/// thread; `save/`, `load/` and `tools/` choose (`threads::on_cores`, `threads::parallel_for`).
pub type ForEach<'a> = &'a (dyn Fn(usize, &(dyn Fn(usize) + Sync)) + Sync);
