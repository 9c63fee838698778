//! The non-tensor values of a checkpoint as PyTorch DCP writes them, for the writers of DCP
//! directories: the common values assembled into one tree, flattened as
//! `torch.distributed.checkpoint`'s default planner flattens a state dict (its
//! `flatten_state_dict`), each terminal value a byte item holding `torch.save(value)`, with the
//! path `planner_data` records for it. Also the pickling of those values (plain data as Python
//! holds it; a value tessera holds only as `torch.save` bytes spliced in as that object), which
//! `common.pt` shares.
//!
//! DCP's flattening, which a DCP load of a state dict repeats to find each value's key: a dict
//! is always descended into, by `str(key)`; a list is descended into, by index, when it holds a
//! dict or a list that is itself descended into, and is otherwise one value (a list of numbers,
//! strings, or lists of them); anything else (a tuple, a number, an object) is one value. The
//! key is the path's segments joined with `.`.
//!
//! Pure: values in, bytes out.

use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::formats::pickle::write::Pk;
use crate::formats::torch_save::write::{archive_parts, value_archive};
use crate::model::{path_string, PathSeg, StatePath, Value};

/// A map key that Python's glue uses for a value only `torch.load` can rebuild: tessera holds
/// its `torch.save` bytes, not the value (FORMAT.md, "What the Python package adds").
pub const TORCH_SAVE_KEY: &str = "__tessera_torch_save__";

/// How the Python package spells a dict key that is a Python `int` in a path segment
/// (`"\0int:7"`): DCP writes such a key as `str(7)`, as it writes every key.
const PYTHON_INT_KEY: &str = "\u{0}int:";

/// The `torch.save` bytes of `v` when it is the wrapper of a value tessera holds only as those
/// bytes (`{"__tessera_torch_save__": <bytes>}`).
pub(crate) fn torch_blob(v: &Value) -> Option<&[u8]> {
    match v {
        Value::Map(kv) if kv.len() == 1 && kv[0].0 == TORCH_SAVE_KEY => match &kv[0].1 {
            Value::Bytes(b) => Some(b),
            _ => None,
        },
        _ => None,
    }
}

/// A common value's tree while it is assembled: leaves as given, containers made by the paths.
enum Node {
    Leaf(Value),
    Map(Vec<(String, Node)>),
    List(Vec<(u64, Node)>),
}

impl Node {
    fn into_value(self) -> Value {
        match self {
            Node::Leaf(v) => v,
            Node::Map(kv) => Value::Map(kv.into_iter().map(|(k, v)| (k, v.into_value())).collect()),
            Node::List(mut xs) => {
                xs.sort_by_key(|(i, _)| *i);
                let mut out = Vec::with_capacity(xs.len());
                for (i, v) in xs {
                    // Positions no value was given for: None, as Python's list would need.
                    while (out.len() as u64) < i {
                        out.push(Value::Null);
                    }
                    out.push(v.into_value());
                }
                Value::List(out)
            }
        }
    }
}

/// The node under `node` at `seg`, created empty if new (an empty map becomes a list when
/// indexed); `None` if `node` cannot have it (a value, or a map indexed by position).
fn child<'a>(node: &'a mut Node, seg: &PathSeg) -> Option<&'a mut Node> {
    if matches!((&*node, seg), (Node::Map(kv), PathSeg::Index(_)) if kv.is_empty()) {
        *node = Node::List(Vec::new());
    }
    match (node, seg) {
        (Node::Map(kv), PathSeg::Key(k)) => {
            let at = kv.iter().position(|(x, _)| x == k).unwrap_or_else(|| {
                kv.push((k.clone(), Node::Map(Vec::new())));
                kv.len() - 1
            });
            Some(&mut kv[at].1)
        }
        (Node::List(xs), PathSeg::Index(i)) => {
            let at = xs.iter().position(|(x, _)| x == i).unwrap_or_else(|| {
                xs.push((*i, Node::Map(Vec::new())));
                xs.len() - 1
            });
            Some(&mut xs[at].1)
        }
        _ => None,
    }
}

/// The common values as one dict, each at its path (keys make dicts, indices lists).
pub(crate) fn assemble(common: &[(StatePath, Value)]) -> Result<Value> {
    let mut root = Node::Map(Vec::new());
    for (path, value) in common {
        if path.is_empty() {
            return Err(Error::invalid("a common value has an empty path"));
        }
        let mut node = &mut root;
        for seg in path {
            node = child(node, seg).ok_or_else(|| {
                Error::invalid(format!("common value {:?}: its path crosses another value", path_string(path)))
            })?;
        }
        *node = Node::Leaf(value.clone());
    }
    Ok(root.into_value())
}

/// `v` as Python holds it, for a pickle: maps become dicts (in their order), a value held as
/// `torch.save` bytes becomes that object (its pickle spliced in). Such a value holding tensors
/// cannot be spliced (its storages would need new names in the archive): refused, naming `at`.
pub(crate) fn to_pickle(v: &Value, at: &str) -> Result<Pk> {
    if let Some(bytes) = torch_blob(v) {
        let (body, storages) = archive_parts(bytes)
            .map_err(|e| Error::invalid(format!("value {at:?}: its torch.save bytes do not read: {e}")))?;
        if !storages.is_empty() {
            return Err(Error::invalid(format!(
                "value {at:?} is a Python object holding tensors, which tessera holds only as torch.save bytes; \
                 it cannot be written inside another value (save its tensors as tensors)"
            )));
        }
        return Ok(Pk::Raw(body));
    }
    Ok(match v {
        Value::Map(kv) => {
            let mut items = Vec::with_capacity(kv.len());
            for (k, x) in kv {
                items.push((Pk::Str(k.clone()), to_pickle(x, &format!("{at}.{k}"))?));
            }
            Pk::Dict(items)
        }
        Value::List(xs) => {
            Pk::List(xs.iter().enumerate().map(|(i, x)| to_pickle(x, &format!("{at}.{i}"))).collect::<Result<_>>()?)
        }
        other => Pk::from(other),
    })
}

/// One segment of a DCP path (`planner_data`): a dict key (always a string) or a list index.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum DcpSeg {
    Key(String),
    Index(u64),
}

/// The key DCP gives a path: its segments joined with `.`.
pub(crate) fn dcp_key(path: &[DcpSeg]) -> String {
    let parts: Vec<String> = path
        .iter()
        .map(|s| match s {
            DcpSeg::Key(k) => k.clone(),
            DcpSeg::Index(i) => i.to_string(),
        })
        .collect();
    parts.join(".")
}

/// A DCP path as Python shows the tuple (`('optim', 'param_groups', 0, 'lr')`), for messages.
pub(crate) fn python_path(path: &[DcpSeg]) -> String {
    let parts: Vec<String> = path
        .iter()
        .map(|s| match s {
            DcpSeg::Key(k) => format!("'{}'", k.replace('\\', "\\\\").replace('\'', "\\'")),
            DcpSeg::Index(i) => i.to_string(),
        })
        .collect();
    match parts.as_slice() {
        [one] => format!("({one},)"),
        _ => format!("({})", parts.join(", ")),
    }
}

/// A map key as DCP writes it (`str(key)`): a Python int key, which the Python package spells
/// `"\0int:N"`, becomes `"N"`.
fn dcp_dict_key(k: &str) -> String {
    k.strip_prefix(PYTHON_INT_KEY).unwrap_or(k).to_string()
}

/// A non-tensor value as a DCP byte item.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct DcpValue {
    /// Its key (`state_dict_metadata`).
    pub fqn: String,
    /// Its path (`planner_data`).
    pub path: Vec<DcpSeg>,
    /// The item: `torch.save(value)`.
    pub item: Vec<u8>,
}

/// The common values flattened as DCP flattens them, and where the dicts and lists they form
/// lie (for the paths of tensors: [`DcpValues::tensor_path`]).
#[derive(Debug, Default)]
pub(crate) struct DcpValues {
    pub values: Vec<DcpValue>,
    /// Every container the values form (and each optimizer state dict the parameter groups
    /// name: see [`flatten`]), by its key.
    containers: HashMap<String, Vec<DcpSeg>>,
}

/// Whether DCP stores a list as one value: it holds no dict and no list it would descend into
/// (a value tessera holds as `torch.save` bytes counts as a value, whatever object it is).
fn terminal_list(xs: &[Value]) -> bool {
    xs.iter().all(|x| match x {
        Value::Map(_) => torch_blob(x).is_some(),
        Value::List(inner) => terminal_list(inner),
        _ => true,
    })
}

struct Flattener<'a> {
    out: DcpValues,
    /// Key → the path that made it, to refuse two paths DCP would give one key.
    seen: HashMap<String, Vec<DcpSeg>>,
    serialization_id: &'a dyn Fn(usize) -> String,
}

impl Flattener<'_> {
    fn visit(&mut self, path: &mut Vec<DcpSeg>, v: &Value) -> Result<()> {
        let descend = match v {
            Value::Map(kv) => torch_blob(v).is_none() && !kv.is_empty(),
            Value::List(xs) => !terminal_list(xs),
            _ => false,
        };
        if !descend {
            return self.emit(path, v);
        }
        if !path.is_empty() {
            self.out.containers.insert(dcp_key(path), path.clone());
        }
        match v {
            Value::Map(kv) => {
                self.optimizer_states(path, kv);
                for (k, x) in kv {
                    path.push(DcpSeg::Key(dcp_dict_key(k)));
                    self.visit(path, x)?;
                    path.pop();
                }
            }
            Value::List(xs) => {
                for (i, x) in xs.iter().enumerate() {
                    path.push(DcpSeg::Index(i as u64));
                    self.visit(path, x)?;
                    path.pop();
                }
            }
            _ => unreachable!("only containers are descended into"),
        }
        Ok(())
    }

    /// An optimizer state dict (torch's `get_optimizer_state_dict`, OLMo-core's): a dict with
    /// `param_groups`, each naming its parameters under `params`, and the tensors of each
    /// parameter under `state.<param>.`. The parameter names may hold dots, so the tensors'
    /// paths are known only from here: each `state.<param>` is a container.
    fn optimizer_states(&mut self, path: &[DcpSeg], kv: &[(String, Value)]) {
        let Some((_, Value::List(groups))) = kv.iter().find(|(k, _)| k == "param_groups") else { return };
        for g in groups {
            let Value::Map(g) = g else { continue };
            let Some((_, Value::List(params))) = g.iter().find(|(k, _)| k == "params") else { continue };
            for p in params {
                let name = match p {
                    Value::Str(s) => s.clone(),
                    Value::Int(i) => i.to_string(),
                    _ => continue,
                };
                let mut at = path.to_vec();
                at.extend([DcpSeg::Key("state".into()), DcpSeg::Key(name)]);
                self.out.containers.insert(dcp_key(&at), at);
            }
        }
    }

    fn emit(&mut self, path: &[DcpSeg], v: &Value) -> Result<()> {
        let fqn = dcp_key(path);
        if let Some(other) = self.seen.get(&fqn) {
            return Err(Error::invalid(format!(
                "common values {} and {} would both be stored under the DCP key {fqn:?} (DCP joins a value's \
                 path with dots): rename one of them",
                python_path(other),
                python_path(path)
            )));
        }
        self.seen.insert(fqn.clone(), path.to_vec());
        let item = match torch_blob(v) {
            // The object's own torch.save bytes: what DCP's writer makes of it.
            Some(bytes) => bytes.to_vec(),
            None => value_archive(&to_pickle(v, &fqn)?, &(self.serialization_id)(self.out.values.len()))?,
        };
        self.out.values.push(DcpValue { fqn, path: path.to_vec(), item });
        Ok(())
    }
}

/// The common values (each at its path) as DCP's default planner stores them: flattened (see
/// the module's note), each terminal value the byte item `torch.save(value)` (a value held as
/// `torch.save` bytes: those bytes). An empty dict, which DCP's flattening drops, is kept as a
/// value, so that a load of every key gives it back. `serialization_id(n)` names the n-th
/// archive made.
pub(crate) fn flatten(common: &[(StatePath, Value)], serialization_id: &dyn Fn(usize) -> String) -> Result<DcpValues> {
    let mut f = Flattener { out: DcpValues::default(), seen: HashMap::new(), serialization_id };
    if common.is_empty() {
        return Ok(f.out);
    }
    let Value::Map(top) = assemble(common)? else { unreachable!("the root is a dict") };
    f.optimizer_states(&[], &top);
    let mut path = Vec::new();
    for (k, v) in &top {
        path.push(DcpSeg::Key(dcp_dict_key(k)));
        f.visit(&mut path, v)?;
        path.pop();
    }
    Ok(f.out)
}

impl DcpValues {
    /// The path `planner_data` gives the tensor of key `key` (a tensor's key is its DCP key; the
    /// state dict's nesting is not recorded with it): under the longest container of the values
    /// that its key extends, as one more key (`optim.state.<param>` + `exp_avg`); else under
    /// its first dotted part (`model` + `layers.0.weight`: a module's `state_dict()` under a
    /// top-level key, what DCP records for it); a key without dots alone.
    pub(crate) fn tensor_path(&self, key: &str) -> Vec<DcpSeg> {
        let mut best: Option<&Vec<DcpSeg>> = None;
        let mut end = key.len();
        while let Some(dot) = key[..end].rfind('.') {
            if let Some(c) = self.containers.get(&key[..dot]) {
                best = Some(c);
                break;
            }
            end = dot;
        }
        match best {
            Some(c) => {
                let mut path = c.clone();
                path.push(DcpSeg::Key(key[dcp_key(c).len() + 1..].to_string()));
                path
            }
            None => match key.split_once('.') {
                Some((first, rest)) => vec![DcpSeg::Key(first.into()), DcpSeg::Key(rest.into())],
                None => vec![DcpSeg::Key(key.into())],
            },
        }
    }
}

/// `planner_data` of a DCP directory holding `tensor_keys` (each once), the byte items
/// `object_fqns` (Megatron's sharded objects) and `values`: every key's path in the state dict,
/// as DCP's save records it (a load of every key rebuilds the nesting from it: OLMo-core's
/// `load_keys` and `unshard_checkpoint`). Values have their own paths; tensors the paths
/// [`DcpValues::tensor_path`] finds; a sharded object's item (no nesting) its key. Two items
/// under one key are refused, naming both, and so is a value whose key `is_object_key` (the
/// reader's `parse_object_fqn`: one ending like a sharded object's, which Megatron's loader and
/// tessera's reader would take for one). `location` names the checkpoint in errors.
pub(crate) fn planner_data<'k>(
    tensor_keys: impl IntoIterator<Item = &'k str>,
    object_fqns: impl IntoIterator<Item = &'k str>,
    values: &DcpValues,
    is_object_key: impl Fn(&str) -> bool,
    location: &str,
) -> Result<Vec<(String, Vec<DcpSeg>)>> {
    let mut planner = Vec::new();
    let mut owner: HashMap<String, String> = HashMap::new();
    let mut claim = |fqn: &str, what: String| -> Result<()> {
        if let Some(first) = owner.insert(fqn.to_string(), what.clone()) {
            return Err(Error::invalid(format!(
                "{location}: {first} and {what} would both be stored under the DCP key {fqn:?}: rename one of them"
            )));
        }
        Ok(())
    };
    for key in tensor_keys {
        claim(key, format!("tensor {key:?}"))?;
        planner.push((key.to_string(), values.tensor_path(key)));
    }
    for fqn in object_fqns {
        claim(fqn, format!("a shard of object {:?}", fqn.rsplit_once("/shard_").map_or(fqn, |(k, _)| k)))?;
        planner.push((fqn.to_string(), vec![DcpSeg::Key(fqn.to_string())]));
    }
    for v in &values.values {
        if is_object_key(&v.fqn) {
            return Err(Error::invalid(format!(
                "{location}: common value {:?} would be read as a shard of a sharded object (its DCP key ends \
                 like Megatron's /shard_<offsets>_<grid>): rename it",
                v.fqn
            )));
        }
        claim(&v.fqn, format!("common value {}", python_path(&v.path)))?;
        planner.push((v.fqn.clone(), v.path.clone()));
    }
    Ok(planner)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::pickle::PickleValue;
    use crate::formats::torch_save::decode_archive;
    use crate::formats::torch_save::write::value_archive;

    fn k(s: &str) -> PathSeg {
        PathSeg::Key(s.into())
    }

    fn ids(n: usize) -> String {
        format!("{n:040}")
    }

    #[test]
    fn values_flatten_as_dcp_flattens_a_state_dict() {
        let group = |lr: f64| {
            Value::Map(vec![
                ("lr".into(), Value::Float(lr)),
                ("betas".into(), Value::List(vec![Value::Float(0.9), Value::Float(0.95)])),
                ("params".into(), Value::List(vec![Value::Str("layers.0.weight".into()), Value::Str("b".into())])),
            ])
        };
        let common = vec![
            (vec![k("step")], Value::Int(7)),
            // One group given whole, the other leaf by leaf (as the Python package saves).
            (vec![k("optim"), k("param_groups"), PathSeg::Index(0)], group(0.1)),
            (vec![k("optim"), k("param_groups"), PathSeg::Index(1), k("lr")], Value::Float(0.2)),
            (vec![k("nested"), k("\u{0}int:3"), k("x")], Value::Str("int key".into())),
            (vec![k("empty")], Value::Map(vec![])),
            (vec![k("none_list")], Value::List(vec![])),
        ];
        let out = flatten(&common, &ids).unwrap();
        let keys: Vec<&str> = out.values.iter().map(|v| v.fqn.as_str()).collect();
        assert_eq!(
            keys,
            [
                "step",
                "optim.param_groups.0.lr",
                "optim.param_groups.0.betas",
                "optim.param_groups.0.params",
                "optim.param_groups.1.lr",
                "nested.3.x",
                "empty",
                "none_list"
            ]
        );
        let by = |fqn: &str| out.values.iter().find(|v| v.fqn == fqn).unwrap();
        assert_eq!(
            by("optim.param_groups.0.lr").path,
            [
                DcpSeg::Key("optim".into()),
                DcpSeg::Key("param_groups".into()),
                DcpSeg::Index(0),
                DcpSeg::Key("lr".into())
            ]
        );
        assert_eq!(decode_archive(&by("step").item, "s").unwrap(), PickleValue::Int(7));
        let params = decode_archive(&by("optim.param_groups.0.params").item, "p").unwrap();
        assert_eq!(
            params.to_plain().unwrap(),
            Value::List(vec![Value::Str("layers.0.weight".into()), Value::Str("b".into())])
        );
        assert_eq!(decode_archive(&by("empty").item, "e").unwrap(), PickleValue::Dict(vec![]));

        // Tensors: under the optimizer state the groups name, else under their first part.
        let path = |key: &str| dcp_key(&out.tensor_path(key));
        assert_eq!(out.tensor_path("optim.state.layers.0.weight.exp_avg").len(), 4);
        assert_eq!(path("optim.state.layers.0.weight.exp_avg"), "optim.state.layers.0.weight.exp_avg");
        assert_eq!(out.tensor_path("optim.state.layers.0.weight.exp_avg")[2], DcpSeg::Key("layers.0.weight".into()));
        assert_eq!(
            out.tensor_path("model.layers.0.weight"),
            [DcpSeg::Key("model".into()), DcpSeg::Key("layers.0.weight".into())]
        );
        assert_eq!(out.tensor_path("w"), [DcpSeg::Key("w".into())]);
    }

    #[test]
    fn values_held_as_torch_save_bytes_are_stored_as_those_bytes_or_spliced() {
        let tuple = value_archive(&Pk::Tuple(vec![Pk::Float(0.9), Pk::Float(0.95)]), "1").unwrap();
        let blob = Value::Map(vec![(TORCH_SAVE_KEY.into(), Value::Bytes(tuple.clone()))]);
        let common =
            vec![(vec![k("betas")], blob.clone()), (vec![k("pair")], Value::List(vec![blob.clone(), Value::Int(1)]))];
        let out = flatten(&common, &ids).unwrap();
        assert_eq!(out.values[0].item, tuple, "the object's own bytes");
        let pair = decode_archive(&out.values[1].item, "p").unwrap();
        let t = PickleValue::Tuple(vec![PickleValue::Float(0.9), PickleValue::Float(0.95)]);
        assert_eq!(pair, PickleValue::List(vec![t, PickleValue::Int(1)]));
    }

    #[test]
    fn two_paths_of_one_key_are_refused() {
        let common = vec![(vec![k("a.b")], Value::Int(1)), (vec![k("a"), k("b")], Value::Int(2))];
        let e = flatten(&common, &ids).unwrap_err().to_string();
        assert!(e.contains("\"a.b\"") && e.contains("rename"), "{e}");
    }
}
