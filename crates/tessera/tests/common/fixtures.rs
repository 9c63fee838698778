//! The expected files beside the foreign-format fixtures (`NAME.expected.safetensors`: every
//! full tensor; `NAME.expected.json`: the other values), and what tests compare them with.

use std::collections::BTreeMap;
use std::path::Path;

use tessera::comm::SoloComm;
use tessera::{load, DType, LoadOptions, StateTree, Storage, Value};

/// A full tensor as a fixture's expected file holds it.
pub struct Expected {
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub data: Vec<u8>,
}

/// Every tensor of `dir/NAME.expected.safetensors`.
pub fn expected_tensors(dir: &Path, name: &str) -> BTreeMap<String, Expected> {
    let bytes = std::fs::read(dir.join(format!("{name}.expected.safetensors"))).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    let mut out = BTreeMap::new();
    for (k, v) in header.as_object().unwrap() {
        if k == "__metadata__" {
            continue;
        }
        let dtype = DType::parse(v["dtype"].as_str().unwrap()).unwrap();
        let shape = v["shape"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
        let off = v["data_offsets"].as_array().unwrap();
        let (a, b) = (off[0].as_u64().unwrap() as usize, off[1].as_u64().unwrap() as usize);
        out.insert(k.clone(), Expected { dtype, shape, data: data[a..b].to_vec() });
    }
    out
}

/// `dir/NAME.expected.json`.
pub fn expected_json(dir: &Path, name: &str) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(dir.join(format!("{name}.expected.json"))).unwrap()).unwrap()
}

/// A plain value as JSON (bytes shown by their length).
pub fn to_json(v: &Value) -> serde_json::Value {
    use serde_json::Value as J;
    match v {
        Value::Null => J::Null,
        Value::Bool(b) => J::Bool(*b),
        Value::Int(i) => J::from(*i),
        Value::Float(f) => J::from(*f),
        Value::Str(s) => J::from(s.clone()),
        Value::Bytes(b) => J::from(format!("<{} bytes>", b.len())),
        Value::List(xs) => J::Array(xs.iter().map(to_json).collect()),
        Value::Map(m) => J::Object(m.iter().map(|(k, v)| (k.clone(), to_json(v))).collect()),
    }
}

/// JSON equality with numbers compared as f64.
pub fn json_eq(a: &serde_json::Value, b: &serde_json::Value) -> bool {
    use serde_json::Value as J;
    match (a, b) {
        (J::Number(x), J::Number(y)) => x.as_f64() == y.as_f64(),
        (J::Array(x), J::Array(y)) => x.len() == y.len() && x.iter().zip(y).all(|(a, b)| json_eq(a, b)),
        (J::Object(x), J::Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| json_eq(v, w)))
        }
        _ => a == b,
    }
}

/// Boxes cutting each axis of `shape` into `parts` near-equal pieces.
pub fn boxes(shape: &[u64], parts: u64) -> Vec<(Vec<u64>, Vec<u64>)> {
    let mut out = vec![(Vec::new(), Vec::new())];
    for &n in shape {
        let p = parts.min(n.max(1));
        let mut next = Vec::new();
        for (o, s) in &out {
            for i in 0..p {
                let (a, b) = (n * i / p, n * (i + 1) / p);
                let (mut o, mut s) = (o.clone(), s.clone());
                o.push(a);
                s.push(b - a);
                next.push((o, s));
            }
        }
        out = next;
    }
    out
}

/// Loads `tree` (one rank) from `storage` and checks the tensor at each `id` of `expect`
/// (top-level keys) against its bytes; `what` names the case in failures.
pub fn assert_loads(storage: &dyn Storage, tree: StateTree<'_>, expect: Vec<(String, Vec<u8>)>, what: &str) {
    let loaded = load(tree, storage, &SoloComm, &LoadOptions::default()).unwrap_or_else(|e| panic!("{what}: {e}"));
    let StateTree::Map(got) = loaded.state else { panic!("{what}: not a map") };
    for (id, bytes) in expect {
        let StateTree::Tensor(t) = &got[&id] else { panic!("{what}: {id}") };
        assert!(t.data.bytes().unwrap() == bytes.as_slice(), "{what}: {id}");
    }
}
