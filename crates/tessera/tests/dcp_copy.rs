//! `convert_to_dcp` (`tessera convert --to dcp`): the copy holds the common state as PyTorch DCP
//! itself stores a state dict's values (byte items under DCP's flattened keys, their paths in
//! `planner_data`), which `torch.distributed.checkpoint.load` needs, beside Megatron's
//! `common.pt`; and tessera reads the copy back with the source's values, not doubled
//! (`tests/python/test_dcp_copy.py` has torch load the same kind of copy).

use crate::common::hostile;

use std::path::Path;

use crate::common::{f32_bytes, TempDir};
use hostile::{pickle, s, zip, P};
use tessera::comm::SoloComm;
use tessera::index::FormatRecord;
use tessera::storage::LocalStorage;
use tessera::tools::diff::{diff, DiffOptions};
use tessera::tools::{convert_to_dcp, ConvertOptions};
use tessera::{open, save, DType, PathSeg, SaveOptions, ShardedObject, ShardedTensor, StateTree, TensorData, Value};

/// The `torch.save` archive of the object `obj` (no tensors).
fn torch_save(obj: &P) -> Vec<u8> {
    zip(&[("archive/data.pkl", &pickle(obj)), ("archive/version", b"3\n"), ("archive/byteorder", b"little")])
}

/// A value the Python package holds only as `torch.save` bytes.
fn blob(obj: &P) -> Value {
    Value::Map(vec![("__tessera_torch_save__".into(), Value::Bytes(torch_save(obj)))])
}

fn float(x: f64) -> P {
    let mut op = vec![b'G'];
    op.extend_from_slice(&x.to_be_bytes());
    P::Raw(op)
}

fn key(k: &str) -> PathSeg {
    PathSeg::Key(k.into())
}

fn at(i: u64) -> PathSeg {
    PathSeg::Index(i)
}

/// The common values of the source, as `tessera.torch` saves a state dict's (leaf by leaf:
/// lists element by element, a tuple as a list, an object as its `torch.save` bytes).
fn values() -> Vec<(Vec<PathSeg>, Value)> {
    let group = |i: u64| vec![key("optim"), key("param_groups"), at(i)];
    let with = |mut p: Vec<PathSeg>, more: &[PathSeg]| {
        p.extend_from_slice(more);
        p
    };
    let namespace =
        P::Obj("argparse", "Namespace", Box::new(P::Dict(vec![(s("lr"), float(0.1)), (s("name"), s("x"))])));
    vec![
        (vec![key("step")], Value::Int(7)),
        (with(group(0), &[key("lr")]), Value::Float(0.1)),
        (with(group(0), &[key("betas")]), Value::List(vec![Value::Float(0.9), Value::Float(0.95)])),
        (with(group(0), &[key("weight_decay")]), Value::Float(0.01)),
        (with(group(0), &[key("params"), at(0)]), Value::Str("model.w".into())),
        (with(group(1), &[key("lr")]), Value::Float(0.2)),
        (with(group(1), &[key("params"), at(0)]), Value::Str("b".into())),
        (vec![key("extra"), key("name")], Value::Str("run".into())),
        (vec![key("extra"), key("nested")], Value::List(vec![Value::List(vec![Value::Int(1)]), Value::List(vec![])])),
        (vec![key("extra"), key("none")], Value::Null),
        (vec![key("extra"), key("empty")], Value::Map(vec![])),
        (vec![key("args")], blob(&namespace)),
        (vec![key("pair")], blob(&P::Tuple(vec![P::Int(1), s("x")]))),
    ]
}

/// A native checkpoint of two tensors, a sharded object, the values above and content
/// metadata.
fn source(dir: &Path) {
    let w = f32_bytes(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let m = f32_bytes(&[0.5; 6]);
    let t = |k: &str, d: &[u8]| {
        StateTree::Tensor(ShardedTensor::full(k, DType::F32, &[2, 3], TensorData::Owned(d.to_vec())))
    };
    let mut tree = StateTree::map()
        .with("model.w", t("model.w", &w))
        .with("optim.state.model.w.exp_avg", t("optim.state.model.w.exp_avg", &m));
    let payload = [b"TSV1".as_slice(), &Value::Int(42).to_bytes()].concat();
    tree.insert("rng", StateTree::Object(ShardedObject::new("rng", payload, &[1], &[0])));
    // An object only torch.load rebuilds, and bytes without a tag: stored in other encodings
    // (torch.save([obj]), Python bytes), the same objects.
    let state = [b"TPT1".as_slice(), &torch_save(&P::Tuple(vec![s("mt19937"), P::Int(5)]))].concat();
    tree.insert("rng_torch", StateTree::Object(ShardedObject::new("rng_torch", state, &[1], &[0])));
    tree.insert("raw", StateTree::Object(ShardedObject::new("raw", b"\x00\x01".to_vec(), &[1], &[0])));
    for (path, v) in values() {
        tree.set_path(&path, StateTree::Value(v));
    }
    let opts =
        SaveOptions { content_metadata: Value::Map(vec![("format".into(), Value::Int(2))]), ..Default::default() };
    save(tree, &LocalStorage::new(dir), &SoloComm, &opts).unwrap();
}

fn convert(src: &Path, dst: &Path) {
    convert_to_dcp(&LocalStorage::new(src), &LocalStorage::new(dst), &ConvertOptions::default(), &mut |_, _| {})
        .unwrap();
}

#[test]
fn a_dcp_copy_reads_back_with_the_values_of_its_source() {
    let (src, dst) = (TempDir::new("dcp-copy-src"), TempDir::new("dcp-copy-dst"));
    source(src.path());
    convert(src.path(), dst.path());
    let copy = LocalStorage::new(dst.path());
    assert_eq!(FormatRecord::detect(&copy).unwrap().backend, tessera::index::Backend::TorchDist);
    let report = diff(&LocalStorage::new(src.path()), &copy, &DiffOptions::default()).unwrap();
    assert!(report.is_equal(), "{report:?}");
    assert_eq!((report.tensors_compared, report.objects_compared), (2, 3));

    // The values come once (from common.pt), each where the source has it.
    let common = open(&copy).unwrap().common_state();
    let get = |path: &[PathSeg]| common.get(path).and_then(StateTree::as_value).cloned();
    assert_eq!(get(&[key("step")]), Some(Value::Int(7)));
    let groups = get(&[key("optim")]).unwrap();
    let Value::Map(optim) = &groups else { panic!("{groups:?}") };
    assert_eq!(optim.len(), 1, "param_groups only: {optim:?}");
    let Value::List(groups) = &optim[0].1 else { panic!("{optim:?}") };
    assert_eq!(groups.len(), 2);
    assert_eq!(
        groups[1],
        Value::Map(vec![
            ("lr".into(), Value::Float(0.2)),
            ("params".into(), Value::List(vec![Value::Str("b".into())]))
        ])
    );
    let index = open(&copy).unwrap().into_index();
    let mut paths: Vec<&PathSeg> = index.common.iter().map(|(p, _)| &p[0]).collect();
    paths.dedup();
    assert_eq!(paths.len(), index.common.len(), "one entry per top-level key: {:?}", index.common);
}

#[test]
fn a_dcp_copy_holds_its_values_as_dcp_byte_items_with_their_paths() {
    let (src, dst) = (TempDir::new("dcp-items-src"), TempDir::new("dcp-items-dst"));
    source(src.path());
    convert(src.path(), dst.path());

    // The keys DCP's flattening gives: dicts by key, lists of dicts by index, lists of plain
    // values (and objects) whole.
    let metadata = std::fs::read(dst.path().join(".metadata")).unwrap();
    let holds = |s: &str| metadata.windows(s.len()).any(|w| w == s.as_bytes());
    assert!(holds("BytesStorageMetadata"));
    for k in [
        "step",
        "optim.param_groups.0.lr",
        "optim.param_groups.0.betas",
        "optim.param_groups.0.params",
        "optim.param_groups.1.params",
        "extra.nested",
        "extra.empty",
        "args",
        "pair",
        "content_metadata.format",
        "rng/shard_0_1",
    ] {
        assert!(holds(k), "{k}");
    }
    assert!(!holds("optim.param_groups.0.params.0") && !holds("extra.nested.0"), "plain lists are one value");

    // Without Megatron's companions the directory is a plain DCP checkpoint: its values are
    // the byte items alone, each at the path planner_data records (else each would be one key,
    // "optim.param_groups.0.lr").
    let plain = TempDir::new("dcp-items-plain");
    std::fs::create_dir_all(plain.path()).unwrap();
    for e in std::fs::read_dir(dst.path()).unwrap() {
        let name = e.unwrap().file_name().to_string_lossy().into_owned();
        if name != "common.pt" && name != "metadata.json" && !name.starts_with(".tessera-common-") {
            std::fs::copy(dst.path().join(&name), plain.path().join(&name)).unwrap();
        }
    }
    let dcp = LocalStorage::new(plain.path());
    assert_eq!(FormatRecord::detect(&dcp).unwrap().backend, tessera::index::Backend::TorchDcp);
    let report = diff(&LocalStorage::new(src.path()), &dcp, &DiffOptions::default()).unwrap();
    assert!(report.tensors.is_empty(), "{report:?}");
    assert!(report.content_metadata.is_none(), "{report:?}");
    // Plain DCP has no sharded objects: Megatron's item is a value there.
    let mut common: Vec<String> = report.common.iter().map(|c| tessera::path_string(&c.path[..1])).collect();
    common.dedup();
    assert_eq!(common, ["raw/shard_0_1", "rng/shard_0_1", "rng_torch/shard_0_1"], "{report:?}");
    assert!(report.common.iter().all(|c| c.a.is_none()), "{report:?}");
    assert_eq!(report.objects.len(), 3);
}

#[test]
fn values_two_paths_or_a_tensor_would_store_under_one_key_are_refused_naming_both() {
    for (extra, both) in [
        ((vec![key("step.x")], Value::Int(1)), ["('step.x',)", "('step', 'x')"]),
        ((vec![key("model"), key("w")], Value::Int(1)), ["('model', 'w')", "tensor \"model.w\""]),
    ] {
        let (src, dst) = (TempDir::new("dcp-clash-src"), TempDir::new("dcp-clash-dst"));
        let w = f32_bytes(&[1.0]);
        let mut tree = StateTree::map()
            .with("model.w", StateTree::Tensor(ShardedTensor::full("model.w", DType::F32, &[1], TensorData::Owned(w))));
        tree.set_path(&[key("step"), key("x")], StateTree::Value(Value::Int(2)));
        tree.set_path(&extra.0, StateTree::Value(extra.1));
        save(tree, &LocalStorage::new(src.path()), &SoloComm, &SaveOptions::default()).unwrap();
        let e = convert_to_dcp(
            &LocalStorage::new(src.path()),
            &LocalStorage::new(dst.path()),
            &ConvertOptions::default(),
            &mut |_, _| {},
        )
        .unwrap_err()
        .to_string();
        assert!(both.iter().all(|b| e.contains(b)) && e.contains("rename"), "{e}");
        assert!(!dst.path().join(".metadata").exists(), "nothing committed");
    }
}
