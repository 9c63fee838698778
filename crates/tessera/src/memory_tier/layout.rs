//! A rank's state as the memory tier keeps it: every tensor this rank holds (its local bytes,
//! 1-D) and every object shard, as one ordinary tessera checkpoint of this rank alone, with the
//! state's layout (the tree, each tensor's global placement, the common values) stored as its
//! common value `layout`. The layout is what an in-place restore checks the asked-for state
//! against, and what a drain rebuilds the global state from.

use crate::error::{Error, Result};
use crate::model::crc::crc32c;
use crate::model::dtype::DType;
use crate::model::{PathSeg, ReplicaId, ShardedObject, ShardedTensor, StatePath, StateTree, TensorData, Value};

/// The common value of a rank's copy holding the layout.
pub(crate) const LAYOUT_KEY: &str = "layout";

/// The key of the `i`-th tensor of a rank's copy.
pub(crate) fn tensor_key(i: usize) -> String {
    format!("t{i}")
}

/// The key of the `i`-th object shard of a rank's copy (stored as a `u8` tensor).
pub(crate) fn object_key(i: usize) -> String {
    format!("o{i}")
}

/// A state taken apart: its layout (a [`Value`]: the tree's shape, tensors and objects by
/// index with their placement, common and local values), its tensors and its object shards.
pub(crate) struct Parts<'a> {
    pub layout: Value,
    pub tensors: Vec<ShardedTensor<'a>>,
    pub objects: Vec<ShardedObject>,
}

fn ints(xs: &[u64]) -> Value {
    Value::List(xs.iter().map(|&x| Value::Int(x as i64)).collect())
}

fn node(tag: &str, v: Value) -> Value {
    Value::Map(vec![(tag.to_owned(), v)])
}

/// Takes `tree` apart (see [`Parts`]).
pub(crate) fn split(tree: StateTree<'_>) -> Result<Parts<'_>> {
    let mut parts = Parts { layout: Value::Null, tensors: Vec::new(), objects: Vec::new() };
    parts.layout = walk(tree, &mut parts)?;
    Ok(parts)
}

fn walk<'a>(tree: StateTree<'a>, parts: &mut Parts<'a>) -> Result<Value> {
    Ok(match tree {
        StateTree::Map(m) => {
            let mut out = Vec::with_capacity(m.len());
            for (k, v) in m {
                out.push((k, walk(v, parts)?));
            }
            node("map", Value::Map(out))
        }
        StateTree::List(l) => node("list", Value::List(l.into_iter().map(|v| walk(v, parts)).collect::<Result<_>>()?)),
        StateTree::Tensor(t) => {
            let v = Value::Map(vec![
                ("i".into(), Value::Int(parts.tensors.len() as i64)),
                ("key".into(), Value::Str(t.key.clone())),
                ("dtype".into(), Value::Str(t.dtype.name().into())),
                ("local_shape".into(), ints(&t.local_shape)),
                ("global_shape".into(), ints(&t.global_shape)),
                ("global_offset".into(), ints(&t.global_offset)),
                ("axis_fragmentations".into(), t.axis_fragmentations.as_deref().map_or(Value::Null, ints)),
                ("replica_id".into(), Value::List(t.replica_id.0.iter().map(|&x| Value::Int(x.into())).collect())),
                ("prepend_axis_num".into(), Value::Int(t.prepend_axis_num as i64)),
                ("flattened_range".into(), t.flattened_range.as_ref().map_or(Value::Null, |r| ints(&[r.start, r.end]))),
            ]);
            parts.tensors.push(t);
            node("tensor", v)
        }
        StateTree::Object(o) => {
            let v = Value::Map(vec![
                ("i".into(), Value::Int(parts.objects.len() as i64)),
                ("key".into(), Value::Str(o.key.clone())),
                ("global_shape".into(), ints(&o.global_shape)),
                ("global_offset".into(), ints(&o.global_offset)),
                ("replica_id".into(), Value::List(o.replica_id.0.iter().map(|&x| Value::Int(x.into())).collect())),
            ]);
            parts.objects.push(o);
            node("object", v)
        }
        StateTree::Factory(f) => {
            return Err(Error::invalid(format!(
                "the memory tier stores plain tensors; {:?} is a factory: apply it (build the tensors it stands for) \
                 before saving to the memory tier",
                f.key
            )))
        }
        StateTree::Value(v) => node("value", v),
        StateTree::NonPersistent(v) => node("local", v),
    })
}

/// A checksum of the layout's tensors and object shards, in order, with their placements
/// (key, dtype, global shape and offset, flat range, element count; the tree around them and
/// its values left out): equal for two states one can be restored into the other in place.
pub(crate) fn layout_crc(layout: &Value) -> u32 {
    fn leaves(v: &Value, out: &mut Vec<serde_json::Value>) {
        if let Value::Map(entries) = v {
            if let [(tag, inner)] = entries.as_slice() {
                match (tag.as_str(), inner) {
                    ("tensor" | "object", _) => {
                        // Where the bytes go, not how a save deduplicates them (replica ids) or
                        // how a caller spelled the shape (prepended axes): a load's request
                        // describes the same placement without those.
                        let placement: Vec<serde_json::Value> =
                            ["i", "key", "dtype", "global_shape", "global_offset", "flattened_range"]
                                .iter()
                                .map(|k| inner.get(k).map_or(serde_json::Value::Null, Value::to_json))
                                .collect();
                        let numel: Option<u64> = match inner.get("local_shape") {
                            Some(Value::List(xs)) => xs.iter().try_fold(1u64, |a, x| match x {
                                Value::Int(i) => a.checked_mul(*i as u64),
                                _ => None,
                            }),
                            _ => None,
                        };
                        out.push(serde_json::json!([tag, placement, numel]));
                    }
                    ("map", Value::Map(children)) => children.iter().for_each(|(_, c)| leaves(c, out)),
                    ("list", Value::List(children)) => children.iter().for_each(|c| leaves(c, out)),
                    _ => {}
                }
            }
        }
    }
    let mut out = Vec::new();
    leaves(layout, &mut out);
    crc32c(serde_json::Value::Array(out).to_string().as_bytes())
}

/// The common values of a layout, with their paths (what a load returns as common state).
pub(crate) fn layout_values(layout: &Value) -> Vec<(StatePath, Value)> {
    fn walk(v: &Value, path: &mut StatePath, out: &mut Vec<(StatePath, Value)>) {
        let Value::Map(entries) = v else { return };
        let [(tag, inner)] = entries.as_slice() else { return };
        match (tag.as_str(), inner) {
            ("value", v) => out.push((path.clone(), v.clone())),
            ("map", Value::Map(children)) => {
                for (k, c) in children {
                    path.push(PathSeg::Key(k.clone()));
                    walk(c, path, out);
                    path.pop();
                }
            }
            ("list", Value::List(children)) => {
                for (i, c) in children.iter().enumerate() {
                    path.push(PathSeg::Index(i as u64));
                    walk(c, path, out);
                    path.pop();
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(layout, &mut Vec::new(), &mut out);
    out
}

/// The checkpoint a rank saves into the memory tier: its tensors as 1-D tensors of their local
/// bytes, its object shards as `u8` tensors, the layout as common value.
pub(crate) fn rank_copy(parts: Parts<'_>) -> StateTree<'_> {
    let mut tree = StateTree::map().with(LAYOUT_KEY, StateTree::Value(parts.layout));
    for (i, t) in parts.tensors.into_iter().enumerate() {
        let n = t.data_numel();
        tree.insert(tensor_key(i), StateTree::Tensor(ShardedTensor::full(tensor_key(i), t.dtype, &[n], t.data)));
    }
    for (i, o) in parts.objects.into_iter().enumerate() {
        let data = o.data.unwrap_or_default();
        let n = data.len() as u64;
        tree.insert(
            object_key(i),
            StateTree::Tensor(ShardedTensor::full(object_key(i), DType::U8, &[n], TensorData::Owned(data))),
        );
    }
    tree
}

/// Reads the layout's parts back: a stored layout is ours, but it sits in a directory anyone
/// may write, so a malformed one is an error naming `path`, never a panic.
struct Reader<'p> {
    path: &'p str,
}

impl Reader<'_> {
    fn bad(&self, why: impl Into<String>) -> Error {
        Error::corrupt(self.path, format!("memory-tier layout: {}", why.into()))
    }
    fn tagged<'v>(&self, v: &'v Value) -> Result<(&'v str, &'v Value)> {
        match v {
            Value::Map(e) if e.len() == 1 => Ok((e[0].0.as_str(), &e[0].1)),
            _ => Err(self.bad("a node is not a tagged map")),
        }
    }
    fn u64s(&self, v: Option<&Value>, what: &str) -> Result<Vec<u64>> {
        match v {
            Some(Value::List(xs)) => xs
                .iter()
                .map(|x| match x {
                    Value::Int(i) if *i >= 0 => Ok(*i as u64),
                    _ => Err(self.bad(format!("{what} holds a non-count"))),
                })
                .collect(),
            _ => Err(self.bad(format!("{what} is not a list"))),
        }
    }
    fn index(&self, v: &Value, len: usize) -> Result<usize> {
        match v.get("i") {
            Some(Value::Int(i)) if *i >= 0 && (*i as usize) < len => Ok(*i as usize),
            _ => Err(self.bad(format!("an entry's index is not below {len}"))),
        }
    }
    fn str<'v>(&self, v: &'v Value, key: &str) -> Result<&'v str> {
        match v.get(key) {
            Some(Value::Str(s)) => Ok(s),
            _ => Err(self.bad(format!("{key} is not a string"))),
        }
    }
    fn replica(&self, v: &Value) -> Result<ReplicaId> {
        Ok(ReplicaId(self.u64s(v.get("replica_id"), "replica_id")?.into_iter().map(|x| x as u32).collect()))
    }
}

/// Rebuilds a state from `layout` with its tensors' data (`data[i]` for tensor `i`) and object
/// shards' bytes: what a drain saves, the global placement restored. Values come from the
/// layout.
pub(crate) fn rebuild_global<'a>(
    layout: &Value,
    data: &mut [Option<TensorData<'a>>],
    objects: &mut [Option<Vec<u8>>],
    path: &str,
) -> Result<StateTree<'a>> {
    let r = Reader { path };
    let (tag, inner) = r.tagged(layout)?;
    Ok(match tag {
        "map" => {
            let Value::Map(children) = inner else { return Err(r.bad("a map node holds no map")) };
            let mut tree = StateTree::map();
            for (k, c) in children {
                tree.insert(k.clone(), rebuild_global(c, data, objects, path)?);
            }
            tree
        }
        "list" => {
            let Value::List(children) = inner else { return Err(r.bad("a list node holds no list")) };
            StateTree::List(children.iter().map(|c| rebuild_global(c, data, objects, path)).collect::<Result<_>>()?)
        }
        "tensor" => {
            let i = r.index(inner, data.len())?;
            let bytes = data[i].take().ok_or_else(|| r.bad(format!("tensor {i} listed twice")))?;
            let flat = r.u64s(inner.get("flattened_range"), "flattened_range").ok();
            let frag = r.u64s(inner.get("axis_fragmentations"), "axis_fragmentations").ok();
            let prepend = match inner.get("prepend_axis_num") {
                Some(Value::Int(p)) if *p >= 0 => *p as usize,
                _ => return Err(r.bad("prepend_axis_num is not a count")),
            };
            let t = ShardedTensor {
                key: r.str(inner, "key")?.to_owned(),
                data: bytes,
                dtype: DType::parse(r.str(inner, "dtype")?).map_err(|e| r.bad(e.to_string()))?,
                local_shape: r.u64s(inner.get("local_shape"), "local_shape")?,
                global_shape: r.u64s(inner.get("global_shape"), "global_shape")?,
                global_offset: r.u64s(inner.get("global_offset"), "global_offset")?,
                axis_fragmentations: frag,
                replica_id: r.replica(inner)?,
                prepend_axis_num: prepend,
                allow_shape_mismatch: false,
                flattened_range: match flat.as_deref() {
                    Some(&[a, b]) => Some(a..b),
                    Some(_) => return Err(r.bad("flattened_range is not [start, end]")),
                    None => None,
                },
            };
            StateTree::Tensor(t)
        }
        "object" => {
            let i = r.index(inner, objects.len())?;
            let bytes = objects[i].take().ok_or_else(|| r.bad(format!("object {i} listed twice")))?;
            StateTree::Object(ShardedObject {
                key: r.str(inner, "key")?.to_owned(),
                data: Some(bytes),
                global_shape: r.u64s(inner.get("global_shape"), "global_shape")?,
                global_offset: r.u64s(inner.get("global_offset"), "global_offset")?,
                replica_id: r.replica(inner)?,
            })
        }
        "value" => StateTree::Value(inner.clone()),
        "local" => StateTree::NonPersistent(inner.clone()),
        other => return Err(r.bad(format!("unknown node {other:?}"))),
    })
}

/// The restored state: the tree and values as `stored` (the layout the copy was saved with),
/// its tensors the caller's (`tensors`, by index; their buffers now hold the restored bytes),
/// its object shards the caller's with the stored bytes.
pub(crate) fn rebuild_in_place<'a>(
    stored: &Value,
    tensors: &mut [Option<ShardedTensor<'a>>],
    objects: &mut [Option<(ShardedObject, Vec<u8>)>],
    path: &str,
) -> Result<StateTree<'a>> {
    let r = Reader { path };
    let (tag, inner) = r.tagged(stored)?;
    Ok(match (tag, inner) {
        ("map", Value::Map(children)) => {
            let mut tree = StateTree::map();
            for (k, c) in children {
                tree.insert(k.clone(), rebuild_in_place(c, tensors, objects, path)?);
            }
            tree
        }
        ("list", Value::List(children)) => StateTree::List(
            children.iter().map(|c| rebuild_in_place(c, tensors, objects, path)).collect::<Result<_>>()?,
        ),
        ("tensor", _) => {
            let i = r.index(inner, tensors.len())?;
            StateTree::Tensor(tensors[i].take().ok_or_else(|| r.bad(format!("tensor {i} listed twice")))?)
        }
        ("object", _) => {
            let i = r.index(inner, objects.len())?;
            let (mut o, bytes) = objects[i].take().ok_or_else(|| r.bad(format!("object {i} listed twice")))?;
            o.data = Some(bytes);
            StateTree::Object(o)
        }
        ("value", v) => StateTree::Value(v.clone()),
        ("local", v) => StateTree::NonPersistent(v.clone()),
        _ => return Err(r.bad(format!("unknown node {tag:?}"))),
    })
}

/// The state rebuilt from its parts unchanged (values and data as the caller gave them): what
/// a restore hands on to the persistent tier's load when the memory tier cannot serve.
pub(crate) fn reassemble<'a>(
    layout: &Value,
    tensors: &mut [Option<ShardedTensor<'a>>],
    objects: &mut [Option<ShardedObject>],
) -> Result<StateTree<'a>> {
    let r = Reader { path: "(the state)" };
    let (tag, inner) = r.tagged(layout)?;
    Ok(match (tag, inner) {
        ("map", Value::Map(children)) => {
            let mut tree = StateTree::map();
            for (k, c) in children {
                tree.insert(k.clone(), reassemble(c, tensors, objects)?);
            }
            tree
        }
        ("list", Value::List(children)) => {
            StateTree::List(children.iter().map(|c| reassemble(c, tensors, objects)).collect::<Result<_>>()?)
        }
        ("tensor", _) => {
            let i = r.index(inner, tensors.len())?;
            StateTree::Tensor(tensors[i].take().ok_or_else(|| r.bad("tensor listed twice"))?)
        }
        ("object", _) => {
            let i = r.index(inner, objects.len())?;
            StateTree::Object(objects[i].take().ok_or_else(|| r.bad("object listed twice"))?)
        }
        ("value", v) => StateTree::Value(v.clone()),
        ("local", v) => StateTree::NonPersistent(v.clone()),
        _ => return Err(r.bad(format!("unknown node {tag:?}"))),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state<'a>(a: &'a mut [u8], b: Vec<u8>) -> StateTree<'a> {
        let t = ShardedTensor::from_rank_offsets("w", DType::F32, &[2], TensorData::Mut(a), &[(0, 1, 2)], 0).unwrap();
        StateTree::map().with("w", StateTree::Tensor(t)).with(
            "opt",
            StateTree::List(vec![
                StateTree::Value(Value::Int(3)),
                StateTree::Object(ShardedObject::new("rng", b, &[2], &[1])),
                StateTree::NonPersistent(Value::Str("here".into())),
            ]),
        )
    }

    #[test]
    fn a_state_comes_apart_and_back_with_its_placement() {
        let (mut a, mut a2) = (vec![1u8; 8], vec![0u8; 8]);
        let parts = split(state(&mut a, vec![9, 9])).unwrap();
        let asked = split(state(&mut a2, vec![])).unwrap();
        assert_eq!(layout_crc(&parts.layout), layout_crc(&asked.layout));
        let layout = parts.layout.clone();
        let mut data: Vec<Option<TensorData>> = parts.tensors.into_iter().map(|t| Some(t.data)).collect();
        let mut objs: Vec<Option<Vec<u8>>> = parts.objects.into_iter().map(|o| o.data).collect();
        let g = rebuild_global(&layout, &mut data, &mut objs, "p").unwrap();
        let StateTree::Map(m) = &g else { panic!() };
        let StateTree::Tensor(t) = &m["w"] else { panic!() };
        assert_eq!((t.global_offset.as_slice(), t.global_shape.as_slice()), (&[2u64][..], &[4u64][..]));
        let StateTree::List(l) = &m["opt"] else { panic!() };
        assert!(matches!(&l[0], StateTree::Value(Value::Int(3))));
        assert!(matches!(&l[1], StateTree::Object(o) if o.data.as_deref() == Some(&[9, 9][..])));
    }

    #[test]
    fn another_placement_has_another_layout_checksum() {
        let (mut a, mut b) = (vec![0u8; 8], vec![0u8; 8]);
        let one = split(state(&mut a, vec![])).unwrap();
        let t =
            ShardedTensor::from_rank_offsets("w", DType::F32, &[2], TensorData::Mut(&mut b), &[(0, 0, 2)], 0).unwrap();
        let other = split(StateTree::map().with("w", StateTree::Tensor(t))).unwrap();
        assert_ne!(layout_crc(&one.layout), layout_crc(&other.layout));
    }

    #[test]
    fn a_malformed_layout_is_an_error_naming_its_file() {
        let e = rebuild_global(&Value::Int(1), &mut [], &mut [], "/shm/step/rank-3").err().unwrap().to_string();
        assert!(e.contains("/shm/step/rank-3"), "{e}");
        let bad = node("tensor", Value::Map(vec![("i".into(), Value::Int(5))]));
        assert!(rebuild_global(&bad, &mut [], &mut [], "p").is_err());
    }
}
