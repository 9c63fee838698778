//! Sharded objects, factories and the state tree.

// No `unsafe` here: factories split and merge tensor data with safe code only.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use super::tensor::{ReplicaId, ShardedTensor, TensorData};
use super::value::Value;
use crate::error::Result;

/// An opaque object split over ranks: shard `global_offset` of a `global_shape` grid of shards.
/// Unlike tensors, objects cannot be resharded: a load asks for exactly the shards saved.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardedObject {
    /// Global key.
    pub key: String,
    /// Serialized object (opaque to tessera). `None` on load requests and metadata.
    pub data: Option<Vec<u8>>,
    /// Shape of the grid of shards.
    pub global_shape: Vec<u64>,
    /// Position of this shard in the grid.
    pub global_offset: Vec<u64>,
    /// Replica id; only main replicas are written.
    pub replica_id: ReplicaId,
}

impl ShardedObject {
    /// A shard with data, main replica.
    pub fn new(key: impl Into<String>, data: Vec<u8>, global_shape: &[u64], global_offset: &[u64]) -> Self {
        ShardedObject {
            key: key.into(),
            data: Some(data),
            global_shape: global_shape.to_vec(),
            global_offset: global_offset.to_vec(),
            replica_id: ReplicaId::main(),
        }
    }

    /// Sets the replica id.
    pub fn with_replica_id(mut self, replica_id: impl Into<ReplicaId>) -> Self {
        self.replica_id = replica_id.into();
        self
    }

    /// `key/shard_i_j_k`: the name of this shard, unique in a checkpoint.
    pub fn unique_key(&self) -> String {
        let parts: Vec<String> = self.global_offset.iter().map(u64::to_string).collect();
        let shape: Vec<String> = self.global_shape.iter().map(u64::to_string).collect();
        format!("{}/shard_{}_{}", self.key, parts.join("."), shape.join("."))
    }
}

/// Turns one tensor into a sub-state before saving and the loaded sub-state back after loading
/// (Megatron's `ShardedTensorFactory` build/merge pair), e.g. splitting a fused SwiGLU weight.
pub trait TensorFactory: Send + Sync {
    /// Builds the sub-state that is actually saved or loaded. `data` is the factory's tensor.
    fn build<'a>(&self, key: &str, data: TensorData<'a>, replica_id: &ReplicaId) -> Result<StateTree<'a>>;
    /// Merges the loaded sub-state back into what the caller gets in place of the factory.
    fn merge<'a>(&self, key: &str, loaded: StateTree<'a>) -> Result<StateTree<'a>>;
}

/// A tensor to be transformed by a [`TensorFactory`] on save and load.
pub struct ShardedTensorFactory<'a> {
    /// Key of the factory (sub-state keys are chosen by the factory).
    pub key: String,
    /// The tensor given to `build`.
    pub data: TensorData<'a>,
    /// Replica id given to `build`.
    pub replica_id: ReplicaId,
    /// The build/merge pair.
    pub factory: Arc<dyn TensorFactory>,
}

impl fmt::Debug for ShardedTensorFactory<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShardedTensorFactory")
            .field("key", &self.key)
            .field("bytes", &self.data.len())
            .field("replica_id", &self.replica_id)
            .finish()
    }
}

/// One step of a path into a [`StateTree`].
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PathSeg {
    /// Map key.
    Key(String),
    /// List index.
    Index(u64),
}

/// A path from the root of a [`StateTree`] to a node.
pub type StatePath = Vec<PathSeg>;

/// Renders a path as `a.b.0.c`.
pub fn path_string(path: &[PathSeg]) -> String {
    let parts: Vec<String> = path
        .iter()
        .map(|s| match s {
            PathSeg::Key(k) => k.clone(),
            PathSeg::Index(i) => i.to_string(),
        })
        .collect();
    parts.join(".")
}

/// A (sharded) state dict: nested maps and lists whose leaves are sharded tensors, sharded
/// objects, factories, non-persistent values or plain common values.
#[derive(Debug)]
pub enum StateTree<'a> {
    /// Nested map (ordered by key).
    Map(BTreeMap<String, StateTree<'a>>),
    /// Nested list.
    List(Vec<StateTree<'a>>),
    /// A sharded tensor.
    Tensor(ShardedTensor<'a>),
    /// A sharded object.
    Object(ShardedObject),
    /// A tensor transformed by a factory.
    Factory(ShardedTensorFactory<'a>),
    /// A local value: dropped on save, returned unchanged on load.
    NonPersistent(Value),
    /// A plain common value, saved once (from rank 0) in the common state.
    Value(Value),
}

impl<'a> StateTree<'a> {
    /// An empty map.
    pub fn map() -> Self {
        StateTree::Map(BTreeMap::new())
    }

    /// Inserts `value` under `key` in a map node (no-op on other nodes); returns `self`.
    pub fn with(mut self, key: impl Into<String>, value: StateTree<'a>) -> Self {
        self.insert(key, value);
        self
    }

    /// Inserts `value` under `key` in a map node; returns false on other nodes.
    pub fn insert(&mut self, key: impl Into<String>, value: StateTree<'a>) -> bool {
        match self {
            StateTree::Map(m) => {
                m.insert(key.into(), value);
                true
            }
            _ => false,
        }
    }

    /// Follows `path` to a node.
    pub fn get(&self, path: &[PathSeg]) -> Option<&StateTree<'a>> {
        let mut node = self;
        for seg in path {
            node = match (node, seg) {
                (StateTree::Map(m), PathSeg::Key(k)) => m.get(k)?,
                (StateTree::List(l), PathSeg::Index(i)) => l.get(*i as usize)?,
                _ => return None,
            };
        }
        Some(node)
    }

    /// Follows a dotted path (`"a.b.0.c"`): a segment is a key in a map, an index in a list.
    pub fn get_dotted(&self, dotted: &str) -> Option<&StateTree<'a>> {
        dotted.split('.').try_fold(self, |node, seg| match node {
            StateTree::Map(m) => m.get(seg),
            StateTree::List(l) => l.get(seg.parse::<usize>().ok()?),
            _ => None,
        })
    }

    /// Visits every leaf with its path, depth first, maps in key order.
    pub fn for_each_leaf<'s>(&'s self, f: &mut dyn FnMut(&[PathSeg], &'s StateTree<'a>)) {
        fn walk<'s, 'a>(
            node: &'s StateTree<'a>,
            path: &mut StatePath,
            f: &mut dyn FnMut(&[PathSeg], &'s StateTree<'a>),
        ) {
            match node {
                StateTree::Map(m) => {
                    for (k, v) in m {
                        path.push(PathSeg::Key(k.clone()));
                        walk(v, path, f);
                        path.pop();
                    }
                }
                StateTree::List(l) => {
                    for (i, v) in l.iter().enumerate() {
                        path.push(PathSeg::Index(i as u64));
                        walk(v, path, f);
                        path.pop();
                    }
                }
                leaf => f(path, leaf),
            }
        }
        walk(self, &mut Vec::new(), f)
    }

    /// Rebuilds the tree, giving every leaf (by value) to `f` with its path.
    pub fn map_leaves<'b>(
        self,
        f: &mut dyn FnMut(&[PathSeg], StateTree<'a>) -> Result<StateTree<'b>>,
    ) -> Result<StateTree<'b>> {
        fn walk<'a, 'b>(
            node: StateTree<'a>,
            path: &mut StatePath,
            f: &mut dyn FnMut(&[PathSeg], StateTree<'a>) -> Result<StateTree<'b>>,
        ) -> Result<StateTree<'b>> {
            Ok(match node {
                StateTree::Map(m) => {
                    let mut out = BTreeMap::new();
                    for (k, v) in m {
                        path.push(PathSeg::Key(k.clone()));
                        out.insert(k, walk(v, path, f)?);
                        path.pop();
                    }
                    StateTree::Map(out)
                }
                StateTree::List(l) => {
                    let mut out = Vec::with_capacity(l.len());
                    for (i, v) in l.into_iter().enumerate() {
                        path.push(PathSeg::Index(i as u64));
                        out.push(walk(v, path, f)?);
                        path.pop();
                    }
                    StateTree::List(out)
                }
                leaf => f(path, leaf)?,
            })
        }
        walk(self, &mut Vec::new(), f)
    }

    /// Sets the node at `path`, creating maps (and growing lists with `Null` values) on the way.
    /// Existing sharded leaves are not replaced by common values.
    pub fn set_path(&mut self, path: &[PathSeg], value: StateTree<'a>) {
        let Some((last, parents)) = path.split_last() else {
            *self = value;
            return;
        };
        let mut node = self;
        for seg in parents {
            node = match seg {
                PathSeg::Key(k) => {
                    if !matches!(node, StateTree::Map(_)) {
                        *node = StateTree::map();
                    }
                    let StateTree::Map(m) = node else { unreachable!() };
                    m.entry(k.clone()).or_insert_with(StateTree::map)
                }
                PathSeg::Index(i) => {
                    if !matches!(node, StateTree::List(_)) {
                        *node = StateTree::List(Vec::new());
                    }
                    let StateTree::List(l) = node else { unreachable!() };
                    while l.len() <= *i as usize {
                        l.push(StateTree::Value(Value::Null));
                    }
                    &mut l[*i as usize]
                }
            };
        }
        match last {
            PathSeg::Key(k) => {
                if !matches!(node, StateTree::Map(_)) {
                    *node = StateTree::map();
                }
                let StateTree::Map(m) = node else { unreachable!() };
                m.insert(k.clone(), value);
            }
            PathSeg::Index(i) => {
                if !matches!(node, StateTree::List(_)) {
                    *node = StateTree::List(Vec::new());
                }
                let StateTree::List(l) = node else { unreachable!() };
                while l.len() <= *i as usize {
                    l.push(StateTree::Value(Value::Null));
                }
                l[*i as usize] = value;
            }
        }
    }

    /// The tensor leaf, if this is one.
    pub fn as_tensor(&self) -> Option<&ShardedTensor<'a>> {
        match self {
            StateTree::Tensor(t) => Some(t),
            _ => None,
        }
    }

    /// The object leaf, if this is one.
    pub fn as_object(&self) -> Option<&ShardedObject> {
        match self {
            StateTree::Object(o) => Some(o),
            _ => None,
        }
    }

    /// The plain value, if this is a `Value` or `NonPersistent` leaf.
    pub fn as_value(&self) -> Option<&Value> {
        match self {
            StateTree::Value(v) | StateTree::NonPersistent(v) => Some(v),
            _ => None,
        }
    }
}

/// A factory that splits a tensor along its first local axis into consecutive parts, each
/// saved as its own sharded tensor (e.g. a fused SwiGLU `[w; v]` weight into `w` and `v`).
/// The split is zero-copy, and on load the parts are read in place into the caller's buffer;
/// the merged tensor then holds a copy of its bytes (split borrows cannot be soundly re-joined).
#[derive(Debug, Clone)]
pub struct SplitFactory {
    /// Local shape of the fused tensor, as returned after load.
    pub local_shape: Vec<u64>,
    /// `(sub-key suffix, where the part lives)`, in order along the first local axis.
    pub parts: Vec<(String, PartSpec)>,
}

/// Where a part of a [`SplitFactory`] lives in the global state.
#[derive(Debug, Clone)]
pub struct PartSpec {
    /// Global key of the part.
    pub key: String,
    /// Element type.
    pub dtype: crate::model::dtype::DType,
    /// Local shape of the part.
    pub local_shape: Vec<u64>,
    /// Global shape.
    pub global_shape: Vec<u64>,
    /// Global offset.
    pub global_offset: Vec<u64>,
    /// Prepended axes.
    pub prepend_axis_num: usize,
}

impl TensorFactory for SplitFactory {
    fn build<'a>(&self, key: &str, data: TensorData<'a>, replica_id: &ReplicaId) -> Result<StateTree<'a>> {
        let mut rest = data;
        let mut out = BTreeMap::new();
        // Part shapes are the user's numbers: sizes past u64 (or past one allocation) are refused.
        let sizes = self
            .parts
            .iter()
            .map(|(_, p)| {
                super::tensor::checked_nbytes(&p.local_shape, p.dtype.size()).ok_or_else(|| {
                    crate::error::Error::sharding(&p.key, format!("local shape {:?} overflows", p.local_shape))
                })
            })
            .collect::<Result<Vec<u64>>>()?;
        let total = sizes
            .iter()
            .try_fold(0u64, |t, &n| t.checked_add(n))
            .ok_or_else(|| crate::error::Error::sharding(key, "the sizes of the parts overflow"))?;
        if !matches!(rest, TensorData::None) && rest.len() as u64 != total {
            return Err(crate::error::Error::invalid(format!(
                "factory {key:?}: tensor holds {} bytes, its parts need {total}",
                rest.len()
            )));
        }
        for (i, ((suffix, p), &n)) in self.parts.iter().zip(&sizes).enumerate() {
            // At most isize::MAX (checked_nbytes), so it fits in usize.
            let n = n as usize;
            let avail = rest.len();
            let (head, tail) = std::mem::take(&mut rest).split_at(n.min(avail))?;
            rest = tail;
            let tensor = ShardedTensor {
                key: p.key.clone(),
                data: head,
                dtype: p.dtype,
                local_shape: p.local_shape.clone(),
                global_shape: p.global_shape.clone(),
                global_offset: p.global_offset.clone(),
                axis_fragmentations: None,
                replica_id: replica_id.clone(),
                prepend_axis_num: p.prepend_axis_num,
                allow_shape_mismatch: false,
                flattened_range: None,
            };
            out.insert(format!("{i:04}_{suffix}"), StateTree::Tensor(tensor));
        }
        Ok(StateTree::Map(out))
    }

    fn merge<'a>(&self, key: &str, loaded: StateTree<'a>) -> Result<StateTree<'a>> {
        let StateTree::Map(parts) = loaded else {
            return Err(crate::error::Error::invalid(format!("factory {key:?}: loaded sub-state is not a map")));
        };
        let mut datas = Vec::new();
        let mut first: Option<ShardedTensor<'a>> = None;
        for (_, node) in parts {
            let StateTree::Tensor(mut t) = node else {
                return Err(crate::error::Error::invalid(format!("factory {key:?}: loaded part is not a tensor")));
            };
            datas.push(std::mem::take(&mut t.data));
            first.get_or_insert(t);
        }
        let mut t = first.ok_or_else(|| crate::error::Error::invalid(format!("factory {key:?} has no parts")))?;
        t.key = key.to_string();
        t.data = TensorData::join(datas);
        t.local_shape = self.local_shape.clone();
        t.global_shape = self.local_shape.clone();
        t.global_offset = vec![0; self.local_shape.len()];
        t.prepend_axis_num = 0;
        Ok(StateTree::Tensor(t))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use crate::model::dtype::DType;

    fn part(key: &str, rows: u64) -> PartSpec {
        PartSpec {
            key: key.into(),
            dtype: DType::F32,
            local_shape: vec![rows, 4],
            global_shape: vec![rows, 4],
            global_offset: vec![0, 0],
            prepend_axis_num: 0,
        }
    }

    #[test]
    fn split_factory_refuses_part_sizes_that_overflow() {
        let f = SplitFactory { local_shape: vec![2, 4], parts: vec![("w".into(), part("w", 1 << 62))] };
        let r = f.build("fc", TensorData::None, &ReplicaId::main());
        assert!(matches!(r, Err(Error::InvalidSharding { ref key, .. }) if key == "w"), "{r:?}");
        // Each part fits (2^63 - 16 bytes), their sum does not.
        let rows = (1 << 59) - 1;
        let parts = ["a", "b", "c"].map(|k| (k.to_string(), part(k, rows))).to_vec();
        let f = SplitFactory { local_shape: vec![2, 4], parts };
        let r = f.build("fc", TensorData::None, &ReplicaId::main());
        assert!(matches!(r, Err(Error::InvalidSharding { ref key, .. }) if key == "fc"), "{r:?}");
    }

    #[test]
    fn split_factory_splits_and_merges_without_unsafe() {
        let f = SplitFactory {
            local_shape: vec![2, 4],
            parts: vec![("w".into(), part("w", 1)), ("v".into(), part("v", 1))],
        };
        let mut buf: Vec<u8> = (0..32).collect();
        let built = f.build("fc", TensorData::Mut(&mut buf), &ReplicaId::main()).unwrap();
        let merged = f.merge("fc", built).unwrap();
        let StateTree::Tensor(t) = merged else { panic!("not a tensor") };
        assert_eq!((t.key.as_str(), t.local_shape.as_slice()), ("fc", [2u64, 4].as_slice()));
        assert_eq!(t.data.bytes().unwrap(), (0..32).collect::<Vec<u8>>());
        let r = f.build("fc", TensorData::Owned(vec![0; 31]), &ReplicaId::main());
        assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
    }
}
