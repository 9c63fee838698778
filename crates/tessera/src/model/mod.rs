//! The data model: what users build and hand to save and load (sharded tensors and objects,
//! factories, the state tree, plain values, element types), and the compact encoding of its
//! values (`codec`) that the index and the wire between ranks share.

pub(crate) mod codec;
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
