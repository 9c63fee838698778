//! The sharded state model: what ranks hand to save and load.

mod object;
mod tensor;
mod value;

pub use object::{
    path_string, PartSpec, PathSeg, ShardedObject, ShardedTensorFactory, SplitFactory, StatePath, StateTree,
    TensorFactory,
};
pub use tensor::{ReplicaId, ShardedTensor, TensorData};
pub use value::Value;
