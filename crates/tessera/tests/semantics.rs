//! The documented semantics of the API, one behaviour per test: strict key handling, factories,
//! non-persistent values, common state, content metadata, sharded objects, metadata-only and
//! plain loads, shape mismatch, prepended axes, narrow dtypes, empty and scalar tensors,
//! garbage collection, read amplification, the strategy registry and the safetensors files.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::common::*;
use tessera::comm::*;
use tessera::factory::*;
use tessera::index::*;
use tessera::storage::*;
use tessera::tools::*;
use tessera::*;

/// Saves `build(rank)` on `world` ranks; panics on any rank's error.
fn save_ranks(
    storage: &dyn Storage,
    world: usize,
    opts: &SaveOptions,
    build: impl Fn(usize) -> StateTree<'static> + Sync,
) -> Vec<SaveReport> {
    run_ranks(world, |c| save(build(c.rank()), storage, c, opts))
        .into_iter()
        .enumerate()
        .map(|(r, x)| x.unwrap_or_else(|e| panic!("save, rank {r}: {e}")))
        .collect()
}

fn owned_f32(key: &str, global: &[u64], off: &[u64], shape: &[u64], all: &[f32]) -> ShardedTensor<'static> {
    let truth = f32_bytes(all);
    let data = box_bytes(&truth, global, 4, off, shape);
    shard(key, DType::F32, global, off, shape, 0, None, TensorData::Owned(data))
}

fn full_request(key: &str, dtype: DType, shape: &[u64]) -> StateTree<'static> {
    StateTree::Tensor(ShardedTensor::full(key, dtype, shape, TensorData::None))
}

fn object_request(key: &str, grid: &[u64], cell: &[u64]) -> StateTree<'static> {
    StateTree::Object(ShardedObject {
        key: key.into(),
        data: None,
        global_shape: grid.to_vec(),
        global_offset: cell.to_vec(),
        replica_id: ReplicaId::main(),
    })
}

fn iota(n: usize, base: f32) -> Vec<f32> {
    (0..n).map(|i| base + i as f32).collect()
}

// ---------------------------------------------------------------------------------------------
// Strict handling.

/// One rank: tensors `a`, `b` ([4] f32) and object `o`.
fn strict_checkpoint() -> MemoryStorage {
    let storage = MemoryStorage::new();
    save_ranks(&storage, 1, &small_blocks(16), |_| {
        StateTree::map()
            .with("a", StateTree::Tensor(owned_f32("a", &[4], &[0], &[4], &iota(4, 1.0))))
            .with("b", StateTree::Tensor(owned_f32("b", &[4], &[0], &[4], &iota(4, 10.0))))
            .with("o", StateTree::Object(ShardedObject::new("o", b"obj".to_vec(), &[1], &[0])))
    });
    storage
}

/// Rank 0 asks for `a` and an unexpected tensor `x` (nested); rank 1 for `a` and an unexpected
/// object `y`. Nobody asks for `b` or `o` (missing).
fn strict_request(rank: usize) -> StateTree<'static> {
    let unexpected = if rank == 0 { full_request("x", DType::F32, &[4]) } else { object_request("y", &[1], &[0]) };
    StateTree::map()
        .with("a", full_request("a", DType::F32, &[4]))
        .with("nested", StateTree::map().with("u", unexpected).with("keep", StateTree::Value(Value::Int(1))))
}

#[test]
fn strict_handling_modes() {
    let storage = strict_checkpoint();
    let unexpected = |r: usize| vec![if r == 0 { "x" } else { "y" }.to_string()];
    let missing = vec!["b".to_string(), "o".to_string()];
    use StrictHandling as S;
    for mode in [
        S::AssumeOkUnexpected,
        S::LogUnexpected,
        S::LogAll,
        S::RaiseUnexpected,
        S::RaiseAll,
        S::ReturnUnexpected,
        S::ReturnAll,
        S::IgnoreAll,
    ] {
        for share in [true, false] {
            let opts = LoadOptions { strict: mode, share_verification: share, ..load_opts() };
            let out = run_ranks(2, |c| load(strict_request(c.rank()), &storage, c, &opts));
            for (r, res) in out.into_iter().enumerate() {
                let ctx = format!("{mode:?}, shared verification {share}, rank {r}");
                match mode {
                    S::AssumeOkUnexpected => match res {
                        Err(Error::NotCovered { key, .. }) => {
                            assert_eq!(vec![key], unexpected(r), "{ctx}")
                        }
                        // Rank 0's unexpected tensor fails it before the checksums are swapped;
                        // rank 1's unexpected object would fail only after.
                        Err(Error::PeerFailed { rank: 0, .. }) if share && r == 1 => {}
                        other => {
                            panic!("{ctx}: the unexpected key fails when looked for; got {other:?}")
                        }
                    },
                    S::RaiseUnexpected => match res {
                        Err(Error::KeyMismatch { unexpected: u, missing: m }) => {
                            assert_eq!((u, m), (unexpected(r), vec![]), "{ctx}")
                        }
                        other => panic!("{ctx}: {other:?}"),
                    },
                    S::RaiseAll => match res {
                        Err(Error::KeyMismatch { unexpected: u, missing: m }) => {
                            assert_eq!((u, m), (unexpected(r), missing.clone()), "{ctx}")
                        }
                        other => panic!("{ctx}: {other:?}"),
                    },
                    _ => {
                        let res = res.unwrap_or_else(|e| panic!("{ctx}: {e}"));
                        // The unexpected leaf is removed, everything else is there.
                        assert!(res.state.get_dotted("nested.u").is_none(), "{ctx}: unexpected leaf kept");
                        assert_eq!(
                            res.state.get_dotted("nested.keep").and_then(StateTree::as_value),
                            Some(&Value::Int(1))
                        );
                        assert_eq!(f32s(bytes_at(&res.state, "a")), iota(4, 1.0), "{ctx}");
                        match mode {
                            S::ReturnUnexpected => {
                                assert_eq!((res.unexpected_keys, res.missing_keys), (unexpected(r), vec![]), "{ctx}")
                            }
                            S::ReturnAll => {
                                assert_eq!(
                                    (res.unexpected_keys, res.missing_keys),
                                    (unexpected(r), missing.clone()),
                                    "{ctx}"
                                )
                            }
                            S::IgnoreAll => {
                                assert!(res.unexpected_keys.is_empty() && res.missing_keys.is_empty(), "{ctx}")
                            }
                            _ => {}
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn strict_handling_with_matching_keys_succeeds_in_every_mode() {
    let storage = strict_checkpoint();
    use StrictHandling as S;
    for mode in [S::AssumeOkUnexpected, S::LogAll, S::RaiseUnexpected, S::RaiseAll, S::ReturnAll, S::IgnoreAll] {
        let opts = LoadOptions { strict: mode, ..load_opts() };
        // Rank 0 asks for a and o, rank 1 for b: together every key.
        let out = run_ranks(2, |c| {
            let tree = if c.rank() == 0 {
                StateTree::map()
                    .with("a", full_request("a", DType::F32, &[4]))
                    .with("o", object_request("o", &[1], &[0]))
            } else {
                StateTree::map().with("b", full_request("b", DType::F32, &[4]))
            };
            load(tree, &storage, c, &opts)
        });
        for res in out {
            let res = res.unwrap_or_else(|e| panic!("{mode:?}: {e}"));
            assert!(res.unexpected_keys.is_empty() && res.missing_keys.is_empty(), "{mode:?}");
        }
    }
    // Only missing keys: RaiseAll refuses, RaiseUnexpected does not care.
    let only_a = || StateTree::map().with("a", full_request("a", DType::F32, &[4]));
    let opts = LoadOptions { strict: S::RaiseAll, ..load_opts() };
    match load(only_a(), &storage, &SoloComm, &opts) {
        Err(Error::KeyMismatch { unexpected, missing }) => {
            assert!(unexpected.is_empty());
            assert_eq!(missing, ["b", "o"]);
        }
        other => panic!("{other:?}"),
    }
    let opts = LoadOptions { strict: S::RaiseUnexpected, ..load_opts() };
    load(only_a(), &storage, &SoloComm, &opts).unwrap();
}

#[test]
fn strict_handling_parses_megatron_names() {
    use StrictHandling as S;
    let names = [
        ("assume_ok_unexpected", S::AssumeOkUnexpected),
        ("log_unexpected", S::LogUnexpected),
        ("log_all", S::LogAll),
        ("raise_unexpected", S::RaiseUnexpected),
        ("raise_all", S::RaiseAll),
        ("return_unexpected", S::ReturnUnexpected),
        ("return_all", S::ReturnAll),
        ("ignore_all", S::IgnoreAll),
    ];
    for (name, mode) in names {
        assert_eq!(S::parse(name).unwrap(), mode);
        assert_eq!(S::parse(&name.to_uppercase()).unwrap(), mode);
    }
    assert!(matches!(S::parse("raise_some"), Err(Error::InvalidArgument { .. })));
    assert_eq!(S::default(), S::AssumeOkUnexpected);
}

// ---------------------------------------------------------------------------------------------
// Factories.

/// A SwiGLU-style fused `[w; v]` weight: rank `r` of `tp` holds rows `r*n..(r+1)*n` of `w`
/// followed by the same rows of `v` (both `[8, 4]` globally).
fn fused_factory(tp: u64, r: u64) -> SplitFactory {
    let n = 8 / tp;
    let part = |key: &str| PartSpec {
        key: key.into(),
        dtype: DType::F32,
        local_shape: vec![n, 4],
        global_shape: vec![8, 4],
        global_offset: vec![r * n, 0],
        prepend_axis_num: 0,
    };
    SplitFactory { local_shape: vec![2 * n, 4], parts: vec![("w".into(), part("mlp.w")), ("v".into(), part("mlp.v"))] }
}

fn fused_local(w: &[f32], v: &[f32], tp: u64, r: u64) -> Vec<f32> {
    let n = (8 / tp) as usize * 4;
    let r = r as usize;
    [&w[r * n..(r + 1) * n], &v[r * n..(r + 1) * n]].concat()
}

#[test]
fn split_factory_round_trip_across_tp_layouts() {
    let w = iota(32, 100.0);
    let v = iota(32, -100.0);
    let storage = MemoryStorage::new();
    // Save at TP=2; the fused buffer is borrowed, never copied whole.
    let fused: Vec<Vec<u8>> = (0..2).map(|r| f32_bytes(&fused_local(&w, &v, 2, r))).collect();
    let out = run_ranks(2, |c| {
        let r = c.rank() as u64;
        let f = ShardedTensorFactory {
            key: "mlp.fc1".into(),
            data: TensorData::Ref(&fused[r as usize]),
            replica_id: ReplicaId::main(),
            factory: Arc::new(fused_factory(2, r)),
        };
        save(StateTree::map().with("fc1", StateTree::Factory(f)), &storage, c, &small_blocks(24))
    });
    for r in out {
        r.unwrap();
    }
    // The parts are ordinary tensors of the checkpoint.
    let plain = open(&storage).and_then(|c| c.read_tensors(None)).unwrap();
    assert_eq!(plain.keys().collect::<Vec<_>>(), ["mlp.v", "mlp.w"]);
    assert_eq!(f32s(&plain["mlp.w"].data), w);
    assert_eq!(f32s(&plain["mlp.v"].data), v);

    // Load at TP=4, in place: the parts are loaded into the caller's buffer. The merged tensor
    // holds a copy of its bytes (re-joining the parts' borrows into one is not sound).
    let results = run_ranks(4, |c| {
        let r = c.rank() as u64;
        let mut buf = vec![0xEEu8; 2 * 2 * 4 * 4];
        let f = ShardedTensorFactory {
            key: "mlp.fc1".into(),
            data: TensorData::Mut(&mut buf),
            replica_id: ReplicaId::main(),
            factory: Arc::new(fused_factory(4, r)),
        };
        let res = load(StateTree::map().with("fc1", StateTree::Factory(f)), &storage, c, &load_opts()).unwrap();
        let t = tensor_at(&res.state, "fc1");
        assert_eq!(t.key, "mlp.fc1");
        assert_eq!(t.local_shape, vec![4, 4]);
        let merged = t.data.bytes().unwrap().to_vec();
        drop(res);
        assert_eq!(merged, buf, "the merged tensor holds the bytes loaded in place");
        f32s(&buf)
    });
    for (r, got) in results.into_iter().enumerate() {
        assert_eq!(got, fused_local(&w, &v, 4, r as u64), "TP=4 rank {r}");
    }

    // Load whole on one rank, buffers allocated by load.
    let f = ShardedTensorFactory {
        key: "mlp.fc1".into(),
        data: TensorData::None,
        replica_id: ReplicaId::main(),
        factory: Arc::new(fused_factory(1, 0)),
    };
    let res = load(StateTree::map().with("fc1", StateTree::Factory(f)), &storage, &SoloComm, &load_opts()).unwrap();
    let t = tensor_at(&res.state, "fc1");
    assert_eq!(t.local_shape, vec![16, 4]);
    assert_eq!(f32s(t.data.bytes().unwrap()), [w.clone(), v.clone()].concat());
}

#[test]
fn a_factory_with_a_wrong_buffer_size_fails() {
    let storage = MemoryStorage::new();
    let buf = vec![0u8; 10];
    let f = ShardedTensorFactory {
        key: "mlp.fc1".into(),
        data: TensorData::Ref(&buf),
        replica_id: ReplicaId::main(),
        factory: Arc::new(fused_factory(1, 0)),
    };
    let r = save(StateTree::map().with("fc1", StateTree::Factory(f)), &storage, &SoloComm, &small_blocks(16));
    assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
    assert!(names(&storage).is_empty());
}

// ---------------------------------------------------------------------------------------------
// Non-persistent values, common state, content metadata.

#[test]
fn non_persistent_values_are_dropped_on_save_and_returned_as_given() {
    let storage = MemoryStorage::new();
    save_ranks(&storage, 2, &small_blocks(16), |r| {
        StateTree::map()
            .with("w", StateTree::Tensor(owned_f32("w", &[2], &[r as u64], &[1], &[1.0, 2.0])))
            .with("np", StateTree::NonPersistent(Value::Str("never saved".into())))
            .with("step", StateTree::Value(Value::Int(5)))
    });
    let common = tree_value(&open(&storage).map(|c| c.common_state()).unwrap()).unwrap();
    assert_eq!(common, Value::Map(vec![("step".into(), Value::Int(5))]));
    // On load, non-persistent leaves come back as given, even where the common state has a value.
    let tree = StateTree::map()
        .with("np", StateTree::NonPersistent(Value::Int(42)))
        .with("step", StateTree::NonPersistent(Value::Str("mine".into())));
    let res = load(tree, &storage, &SoloComm, &load_opts()).unwrap();
    assert!(matches!(res.state.get_dotted("np"), Some(StateTree::NonPersistent(Value::Int(42)))));
    assert!(matches!(res.state.get_dotted("step"), Some(StateTree::NonPersistent(Value::Str(s))) if s == "mine"));
}

/// Every kind of value, nested; map entries deliberately not in key order.
fn rich_value() -> Value {
    Value::Map(vec![
        ("zeta".into(), Value::Null),
        ("alpha".into(), Value::Bool(true)),
        ("no".into(), Value::Bool(false)),
        ("ints".into(), Value::List(vec![Value::Int(i64::MIN), Value::Int(-1), Value::Int(0), Value::Int(i64::MAX)])),
        (
            "floats".into(),
            Value::List(vec![
                Value::Float(-0.0),
                Value::Float(1e-4),
                Value::Float(f64::INFINITY),
                Value::Float(f64::NEG_INFINITY),
                Value::Float(5e-324),
                Value::Float(1.5e300),
            ]),
        ),
        ("str".into(), Value::Str("ünïcødé ✓ with \"quotes\" and \0 nul".into())),
        ("empty_str".into(), Value::Str(String::new())),
        ("bytes".into(), Value::Bytes((0..=255).collect())),
        ("empty_list".into(), Value::List(vec![])),
        ("empty_map".into(), Value::Map(vec![])),
        (
            "nested".into(),
            Value::List(vec![Value::Map(vec![("k".into(), Value::List(vec![Value::Int(3), Value::Null]))])]),
        ),
    ])
}

fn common_tree(rank: usize) -> StateTree<'static> {
    let mine = |v: Value| StateTree::Value(if rank == 0 { v } else { Value::Str(format!("rank {rank}")) });
    let mut t = StateTree::map()
        .with("args", mine(rich_value()))
        .with("iteration", mine(Value::Int(1000)))
        .with("nan", mine(Value::Float(f64::NAN)))
        .with(
            "tree",
            StateTree::map()
                .with(
                    "inner",
                    StateTree::List(vec![
                        mine(Value::Int(1)),
                        StateTree::Tensor(owned_f32("t", &[2, 2], &[0, 0], &[2, 2], &[1.0, 2.0, 3.0, 4.0])),
                        mine(Value::Str("after the tensor".into())),
                    ]),
                )
                .with(
                    "deep",
                    StateTree::map().with("deeper", StateTree::map().with("deepest", mine(Value::Bool(false)))),
                ),
        );
    if rank != 0 {
        // Only rank 0's values are saved.
        t.insert("only_on_rank_1", StateTree::Value(Value::Int(1)));
    }
    t
}

fn expected_common() -> Value {
    Value::Map(vec![
        ("args".into(), rich_value()),
        ("iteration".into(), Value::Int(1000)),
        ("nan".into(), Value::Float(f64::NAN)),
        (
            "tree".into(),
            Value::Map(vec![
                (
                    "deep".into(),
                    Value::Map(vec![("deeper".into(), Value::Map(vec![("deepest".into(), Value::Bool(false))]))]),
                ),
                (
                    // The tensor's slot is padded with null in the common state alone.
                    "inner".into(),
                    Value::List(vec![Value::Int(1), Value::Null, Value::Str("after the tensor".into())]),
                ),
            ]),
        ),
    ])
}

/// Equality that treats NaN as equal to NaN and tells -0.0 from 0.0 (bit equality of floats).
fn same_value(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Float(x), Value::Float(y)) => x.to_bits() == y.to_bits(),
        (Value::List(x), Value::List(y)) => x.len() == y.len() && x.iter().zip(y).all(|(a, b)| same_value(a, b)),
        (Value::Map(x), Value::Map(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|((ka, a), (kb, b))| ka == kb && same_value(a, b))
        }
        _ => a == b,
    }
}

#[test]
fn common_state_round_trips_every_value_kind_from_rank_0() {
    let storage = MemoryStorage::new();
    let reports = run_ranks(2, |c| {
        let mut tree = common_tree(c.rank());
        if c.rank() == 1 {
            // Rank 1 holds the tensor as a non-main replica.
            tree = tree.with(
                "tree",
                StateTree::map().with(
                    "inner",
                    StateTree::List(vec![
                        StateTree::Value(Value::Null),
                        StateTree::Tensor(
                            owned_f32("t", &[2, 2], &[0, 0], &[2, 2], &[1.0, 2.0, 3.0, 4.0]).with_replica_id(1),
                        ),
                    ]),
                ),
            );
        }
        save(tree, &storage, c, &small_blocks(16))
    });
    for r in reports {
        r.unwrap();
    }
    let got = tree_value(&open(&storage).map(|c| c.common_state()).unwrap()).unwrap();
    assert!(same_value(&got, &expected_common()), "load_common_state:\n{got:?}\nexpected\n{:?}", expected_common());

    // Through load: common values form the base, the tensor stays where it was requested.
    let request = StateTree::map().with(
        "tree",
        StateTree::map().with(
            "inner",
            StateTree::List(vec![
                StateTree::map(),
                StateTree::Tensor(ShardedTensor::full("t", DType::F32, &[2, 2], TensorData::None)),
            ]),
        ),
    );
    let res = load(request, &storage, &SoloComm, &load_opts()).unwrap();
    assert_eq!(f32s(bytes_at(&res.state, "tree.inner.1")), [1.0, 2.0, 3.0, 4.0]);
    let value = |p: &str| res.state.get_dotted(p).and_then(StateTree::as_value).cloned();
    assert_eq!(value("tree.inner.0"), Some(Value::Int(1)));
    assert_eq!(value("tree.inner.2"), Some(Value::Str("after the tensor".into())));
    assert_eq!(value("tree.deep.deeper.deepest"), Some(Value::Bool(false)));
    assert_eq!(value("iteration"), Some(Value::Int(1000)));
    assert!(same_value(&value("args").unwrap(), &rich_value()));
    assert!(matches!(value("nan"), Some(Value::Float(f)) if f.is_nan()));
    assert!(res.state.get_dotted("only_on_rank_1").is_none());
}

#[test]
fn content_metadata_is_readable_without_loading() {
    let storage = MemoryStorage::new();
    let meta = Value::Map(vec![
        ("distrib_optim_sharding_type".into(), Value::Str("fully_sharded_model_space".into())),
        ("singleton_local_shards".into(), Value::Bool(false)),
        ("chained_optim_avoid_prefix".into(), Value::Bool(true)),
        ("step".into(), Value::Int(123)),
        ("extra".into(), rich_value()),
    ]);
    let opts = SaveOptions { content_metadata: meta.clone(), ..small_blocks(16) };
    save_ranks(&storage, 2, &opts, |r| {
        StateTree::map().with("w", StateTree::Tensor(owned_f32("w", &[2], &[r as u64], &[1], &[1.0, 2.0])))
    });
    assert!(same_value(&open(&storage).map(|c| c.content_metadata().clone()).unwrap(), &meta));
    // None given: null.
    let other = MemoryStorage::new();
    save_ranks(&other, 1, &small_blocks(16), |_| {
        StateTree::map().with("w", StateTree::Tensor(owned_f32("w", &[2], &[0], &[2], &[1.0, 2.0])))
    });
    assert_eq!(open(&other).map(|c| c.content_metadata().clone()).unwrap(), Value::Null);
}

// ---------------------------------------------------------------------------------------------
// Sharded objects, metadata, plain tensors.

fn object_bytes(cell: &[u64]) -> Vec<u8> {
    format!("object at {cell:?}").into_bytes()
}

/// 4 ranks: object `rng` on a [2, 2] grid (rank r main for cell r, replica of cell r+1 with
/// different bytes), tensors `a` (f32 [4, 2], rows split) and `b` (i64 [3]).
fn objects_checkpoint() -> MemoryStorage {
    let storage = MemoryStorage::new();
    save_ranks(&storage, 4, &small_blocks(16), |r| {
        let cell = |r: usize| vec![(r / 2) as u64, (r % 2) as u64];
        let main = ShardedObject::new("rng", object_bytes(&cell(r)), &[2, 2], &cell(r));
        let replica =
            ShardedObject::new("rng", b"stale copy".to_vec(), &[2, 2], &cell((r + 1) % 4)).with_replica_id([0, 1]);
        let mut tree = StateTree::map()
            .with("objs", StateTree::List(vec![StateTree::Object(replica), StateTree::Object(main)]))
            .with("a", StateTree::Tensor(owned_f32("a", &[4, 2], &[r as u64, 0], &[1, 2], &iota(8, 0.0))));
        if r == 3 {
            let b = shard("b", DType::I64, &[3], &[0], &[3], 0, None, TensorData::Owned(i64_bytes(&[-1, 0, i64::MAX])));
            tree.insert("b", StateTree::Tensor(b));
        }
        tree
    })
    .iter()
    .for_each(|rep| assert_eq!(rep.files, 4));
    storage
}

#[test]
fn sharded_objects_load_through_load_and_load_sharded_objects() {
    let storage = objects_checkpoint();
    let cells = [[0u64, 0], [0, 1], [1, 0], [1, 1]];
    let request = || {
        StateTree::map()
            .with("objs", StateTree::List(cells.iter().map(|c| object_request("rng", &[2, 2], c)).collect()))
            .with("untouched", StateTree::Value(Value::Int(7)))
    };
    let res = load(request(), &storage, &SoloComm, &load_opts()).unwrap();
    for (i, c) in cells.iter().enumerate() {
        let o = res.state.get_dotted(&format!("objs.{i}")).and_then(StateTree::as_object).unwrap();
        assert_eq!(o.data.as_deref(), Some(&object_bytes(c)[..]), "cell {c:?}");
    }
    let tree = open(&storage).and_then(|c| c.load_objects(request())).unwrap();
    for (i, c) in cells.iter().enumerate() {
        let o = tree.get_dotted(&format!("objs.{i}")).and_then(StateTree::as_object).unwrap();
        assert_eq!(o.data.as_deref(), Some(&object_bytes(c)[..]), "cell {c:?}");
    }
    assert_eq!(tree.get_dotted("untouched").and_then(StateTree::as_value), Some(&Value::Int(7)));
    // A shard outside the grid, and an absent object key.
    let bad = StateTree::map().with("o", object_request("rng", &[2, 2], &[2, 0]));
    assert!(matches!(load(bad, &storage, &SoloComm, &load_opts()), Err(Error::NotCovered { key, .. }) if key == "rng"));
    let bad = StateTree::map().with("o", object_request("nope", &[1], &[0]));
    assert!(
        matches!(open(&storage).and_then(|c| c.load_objects(bad)), Err(Error::NotCovered { key, .. }) if key == "nope")
    );
}

#[test]
fn tensors_metadata_lists_every_tensor_and_nothing_else() {
    let storage = objects_checkpoint();
    let meta = open(&storage).map(|c| c.tensors_metadata()).unwrap();
    let want: BTreeMap<String, TensorMeta> = [
        ("a".to_string(), TensorMeta { dtype: DType::F32, global_shape: vec![4, 2] }),
        ("b".to_string(), TensorMeta { dtype: DType::I64, global_shape: vec![3] }),
    ]
    .into_iter()
    .collect();
    assert_eq!(meta, want);
}

#[test]
fn plain_tensors_with_a_key_subset() {
    let storage = objects_checkpoint();
    let only_b = open(&storage).and_then(|c| c.read_tensors(Some(&["b"]))).unwrap();
    assert_eq!(only_b.len(), 1);
    assert_eq!(only_b["b"], PlainTensor { dtype: DType::I64, shape: vec![3], data: i64_bytes(&[-1, 0, i64::MAX]) });
    let both = open(&storage).and_then(|c| c.read_tensors(Some(&["a", "b"]))).unwrap();
    assert_eq!(both.keys().collect::<Vec<_>>(), ["a", "b"]);
    assert_eq!(f32s(&both["a"].data), iota(8, 0.0));
    assert_eq!(open(&storage).and_then(|c| c.read_tensors(None)).unwrap(), both);
    assert!(open(&storage).and_then(|c| c.read_tensors(Some(&[]))).unwrap().is_empty());
    assert!(matches!(open(&storage).and_then(|c| c.read_tensors(Some(&["a", "nope"]))), Err(Error::NotFound { .. })));
}

// ---------------------------------------------------------------------------------------------
// Shape mismatch, prepended axes, dtypes, empty and scalar tensors.

/// `m`: f32 [6, 4] holding 1..=24.
fn mismatch_checkpoint() -> MemoryStorage {
    let storage = MemoryStorage::new();
    save_ranks(&storage, 2, &small_blocks(16), |r| {
        StateTree::map()
            .with("m", StateTree::Tensor(owned_f32("m", &[6, 4], &[3 * r as u64, 0], &[3, 4], &iota(24, 1.0))))
    });
    storage
}

fn load_mismatched(
    storage: &dyn Storage,
    global: &[u64],
    off: &[u64],
    shape: &[u64],
    flat: Option<std::ops::Range<u64>>,
) -> Result<Vec<f32>> {
    let n = flat.as_ref().map_or(numel(shape), |r| r.end - r.start) as usize;
    let mut buf = vec![0xFFu8; n * 4];
    let t =
        shard("m", DType::F32, global, off, shape, 0, flat, TensorData::Mut(&mut buf)).with_allow_shape_mismatch(true);
    load(StateTree::map().with("m", StateTree::Tensor(t)), storage, &SoloComm, &load_opts())?;
    Ok(f32s(&buf))
}

#[test]
fn allow_shape_mismatch_zero_pads_and_truncates() {
    let storage = mismatch_checkpoint();
    let truth = iota(24, 1.0);
    // Larger: rows 6..8 are zero.
    let got = load_mismatched(&storage, &[8, 4], &[0, 0], &[8, 4], None).unwrap();
    assert_eq!(got[..24], truth[..]);
    assert_eq!(got[24..], [0.0; 8]);
    // Smaller: truncated.
    assert_eq!(load_mismatched(&storage, &[4, 4], &[0, 0], &[4, 4], None).unwrap(), truth[..16]);
    // Fewer columns.
    let got = load_mismatched(&storage, &[6, 2], &[0, 0], &[6, 2], None).unwrap();
    assert_eq!(got, (0..6).flat_map(|i| [truth[i * 4], truth[i * 4 + 1]]).collect::<Vec<_>>());
    // Sharded larger request: the second half of [8, 4] is rows 4..6 stored, then zeros.
    let got = load_mismatched(&storage, &[8, 4], &[4, 0], &[4, 4], None).unwrap();
    assert_eq!(got[..8], truth[16..24]);
    assert_eq!(got[8..], [0.0; 8]);
    // Entirely outside the stored tensor: all zeros.
    assert_eq!(load_mismatched(&storage, &[8, 4], &[6, 0], &[2, 4], None).unwrap(), [0.0; 8]);
    // A flattened range across the stored edge.
    let got = load_mismatched(&storage, &[8, 4], &[0, 0], &[8, 4], Some(20..30)).unwrap();
    assert_eq!(got[..4], truth[20..24]);
    assert_eq!(got[4..], [0.0; 6]);
    // Same shape with the flag: identical.
    assert_eq!(load_mismatched(&storage, &[6, 4], &[0, 0], &[6, 4], None).unwrap(), truth);
}

#[test]
fn shape_and_dtype_mismatches_are_refused_without_the_flag() {
    let storage = mismatch_checkpoint();
    fn req(t: ShardedTensor<'_>) -> StateTree<'_> {
        StateTree::map().with("m", StateTree::Tensor(t))
    }
    let r =
        load(req(ShardedTensor::full("m", DType::F32, &[8, 4], TensorData::None)), &storage, &SoloComm, &load_opts());
    assert!(matches!(&r, Err(Error::Mismatch { key, .. }) if key == "m"), "{r:?}");
    let r =
        load(req(ShardedTensor::full("m", DType::F16, &[6, 4], TensorData::None)), &storage, &SoloComm, &load_opts());
    assert!(matches!(&r, Err(Error::Mismatch { key, reason }) if key == "m" && reason.contains("dtype")), "{r:?}");
    // A different number of axes is refused even with the flag.
    let t = ShardedTensor::full("m", DType::F32, &[24], TensorData::None).with_allow_shape_mismatch(true);
    assert!(matches!(load(req(t), &storage, &SoloComm, &load_opts()), Err(Error::Mismatch { .. })));
    // A region outside the global shape is not covered.
    let t = shard("m", DType::F32, &[6, 4], &[5, 0], &[2, 4], 0, None, TensorData::None);
    assert!(
        matches!(load(req(t), &storage, &SoloComm, &load_opts()), Err(Error::NotCovered { key, .. }) if key == "m")
    );
    // A read-only buffer cannot be loaded into.
    let ro = vec![0u8; 96];
    let t = ShardedTensor::full("m", DType::F32, &[6, 4], TensorData::Ref(&ro));
    assert!(matches!(load(req(t), &storage, &SoloComm, &load_opts()), Err(Error::InvalidArgument { .. })));
}

#[test]
fn cast_dtypes_converts_a_tensor_stored_in_another_dtype() {
    let storage = mismatch_checkpoint();
    let opts = LoadOptions { cast_dtypes: true, ..load_opts() };
    // f32 1..=24 into an i64 request of rows 2..5, with a shape mismatch (zero rows past 6).
    let mut buf = vec![0xFFu8; 4 * 4 * 8];
    let t = shard("m", DType::I64, &[8, 4], &[3, 0], &[4, 4], 0, None, TensorData::Mut(&mut buf))
        .with_allow_shape_mismatch(true);
    load(StateTree::map().with("m", StateTree::Tensor(t)), &storage, &SoloComm, &opts).unwrap();
    let got: Vec<i64> = buf.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect();
    let want: Vec<i64> = (13..=24).chain([0; 4]).collect();
    assert_eq!(got, want);
    // A buffer tessera allocates (TensorData::None) is cast too.
    let t = ShardedTensor::full("m", DType::BF16, &[6, 4], TensorData::None);
    let r = load(StateTree::map().with("m", StateTree::Tensor(t)), &storage, &SoloComm, &opts).unwrap();
    let mut leaves = Vec::new();
    r.state.for_each_leaf(&mut |_, l| {
        if let StateTree::Tensor(t) = l {
            leaves.push(t.data.bytes().unwrap().to_vec());
        }
    });
    let back: Vec<f32> =
        leaves[0].chunks_exact(2).map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16)).collect();
    assert_eq!(back, iota(24, 1.0));
    // Without the option the same request is a dtype mismatch.
    let t = ShardedTensor::full("m", DType::BF16, &[6, 4], TensorData::None);
    let r = load(StateTree::map().with("m", StateTree::Tensor(t)), &storage, &SoloComm, &load_opts());
    assert!(matches!(&r, Err(Error::Mismatch { reason, .. }) if reason.contains("dtype")), "{r:?}");
}

#[test]
fn stacked_layers_saved_per_layer_load_as_one_tensor() {
    // 3 layers of [4, 2]: layer l lives on rank l, without the layer axis (prepend_axis_num 1).
    let layers: Vec<Vec<f32>> = (0..3).map(|l| iota(8, 10.0 * l as f32)).collect();
    let storage = MemoryStorage::new();
    save_ranks(&storage, 3, &small_blocks(16), |r| {
        let data = TensorData::Owned(f32_bytes(&layers[r]));
        let t =
            ShardedTensor::from_rank_offsets("decoder.w", DType::F32, &[4, 2], data, &[(0, r as u64, 3)], 1).unwrap();
        assert_eq!(t.global_shape, vec![3, 4, 2]);
        StateTree::map().with("layers", StateTree::List(vec![StateTree::Tensor(t)]))
    });
    let all = layers.concat();
    let plain = open(&storage).and_then(|c| c.read_tensors(None)).unwrap();
    assert_eq!(plain["decoder.w"].shape, vec![3, 4, 2]);
    assert_eq!(f32s(&plain["decoder.w"].data), all);
    // One rank, one full tensor.
    let res = load(
        StateTree::map().with("w", full_request("decoder.w", DType::F32, &[3, 4, 2])),
        &storage,
        &SoloComm,
        &load_opts(),
    )
    .unwrap();
    assert_eq!(f32s(bytes_at(&res.state, "w")), all);
    // One rank, every layer separately (a pipeline stage holding all layers as a list).
    let list: Vec<StateTree<'static>> = (0..3u64)
        .map(|l| {
            let t =
                ShardedTensor::from_rank_offsets("decoder.w", DType::F32, &[4, 2], TensorData::None, &[(0, l, 3)], 1)
                    .unwrap();
            StateTree::Tensor(t)
        })
        .collect();
    let res = load(StateTree::map().with("layers", StateTree::List(list)), &storage, &SoloComm, &load_opts()).unwrap();
    for (l, layer) in layers.iter().enumerate() {
        let t = tensor_at(&res.state, &format!("layers.{l}"));
        assert_eq!(t.local_shape, vec![4, 2]);
        assert_eq!(&f32s(t.data.bytes().unwrap()), layer);
    }
    // Layers 1..3 with a column split, prepended axis and a second sharded axis.
    let t = ShardedTensor::from_rank_offsets(
        "decoder.w",
        DType::F32,
        &[4, 1],
        TensorData::None,
        &[(0, 2, 3), (2, 1, 2)],
        1,
    )
    .unwrap();
    let res = load(StateTree::map().with("w", StateTree::Tensor(t)), &storage, &SoloComm, &load_opts()).unwrap();
    assert_eq!(f32s(bytes_at(&res.state, "w")), (0..4).map(|i| layers[2][i * 2 + 1]).collect::<Vec<_>>());
}

#[test]
fn bf16_and_fp8_round_trip_bit_exactly() {
    let bf16_values: Vec<f32> = vec![1.0, -2.5, 0.15625, 65280.0, -0.0, f32::INFINITY, 3.0, f32::MIN_POSITIVE];
    let bf16 = bf16_bytes(&bf16_values);
    let fp8: Vec<u8> = (0..=255).collect();
    let storage = MemoryStorage::new();
    save_ranks(&storage, 2, &small_blocks(16), |r| {
        let r = r as u64;
        let b = shard(
            "h",
            DType::BF16,
            &[2, 4],
            &[r, 0],
            &[1, 4],
            0,
            None,
            TensorData::Owned(bf16[r as usize * 8..][..8].to_vec()),
        );
        let e4 =
            shard("e4m3", DType::F8E4M3, &[256], &[0], &[256], 0, Some(r * 100..if r == 0 { 100 } else { 256 }), {
                let range = if r == 0 { 0..100 } else { 100..256 };
                TensorData::Owned(fp8[range].to_vec())
            });
        let e5 = ShardedTensor::full("e5m2", DType::F8E5M2, &[16, 16], TensorData::Owned(fp8.clone()))
            .with_replica_id(r as u32);
        StateTree::map()
            .with("h", StateTree::Tensor(b))
            .with("e4m3", StateTree::Tensor(e4))
            .with("e5m2", StateTree::Tensor(e5))
    });
    let meta = open(&storage).map(|c| c.tensors_metadata()).unwrap();
    assert_eq!(meta["h"].dtype, DType::BF16);
    assert_eq!(meta["e4m3"].dtype, DType::F8E4M3);
    assert_eq!(meta["e5m2"].dtype, DType::F8E5M2);
    let plain = open(&storage).and_then(|c| c.read_tensors(None)).unwrap();
    assert_eq!(plain["h"].data, bf16);
    assert_eq!(plain["e4m3"].data, fp8);
    assert_eq!(plain["e5m2"].data, fp8);
    let back: Vec<f32> =
        plain["h"].data.chunks(2).map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16)).collect();
    assert_eq!(
        back.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        bf16_values.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    );
    // A column of the bf16 tensor, resharded.
    let t = shard("h", DType::BF16, &[2, 4], &[0, 1], &[2, 1], 0, None, TensorData::None);
    let res = load(StateTree::map().with("h", StateTree::Tensor(t)), &storage, &SoloComm, &load_opts()).unwrap();
    assert_eq!(bytes_at(&res.state, "h"), [&bf16[2..4], &bf16[10..12]].concat());
}

#[test]
fn dtype_names_and_sizes() {
    for d in DType::ALL {
        assert_eq!(DType::parse(d.name()).unwrap(), d);
        assert_eq!(DType::parse(d.safetensors_name()).unwrap(), d);
        assert_eq!(DType::parse(&d.name().to_uppercase()).unwrap(), d);
        assert_eq!(d.to_string(), d.name());
    }
    assert_eq!(DType::parse("bf16").unwrap(), DType::BF16);
    assert_eq!(DType::parse("F8_E4M3").unwrap(), DType::F8E4M3);
    assert_eq!(DType::parse("f8_e4m3fn").unwrap(), DType::F8E4M3);
    assert_eq!(DType::parse("f8_e5m2").unwrap(), DType::F8E5M2);
    assert!(matches!(DType::parse("f128"), Err(Error::InvalidArgument { .. })));
    let sizes: Vec<usize> = DType::ALL.iter().map(|d| d.size()).collect();
    assert_eq!(sizes, [8, 4, 2, 2, 1, 1, 8, 4, 2, 1, 1, 2, 4, 8, 1]);
}

#[test]
fn zero_size_and_scalar_tensors() {
    let storage = MemoryStorage::new();
    let loss = 2.75f64.to_le_bytes().to_vec();
    save_ranks(&storage, 2, &small_blocks(16), |r| {
        let empty = shard("empty", DType::F32, &[0, 5], &[0, 0], &[0, 5], 0, None, TensorData::Owned(vec![]));
        let rows = shard(
            "no_cols",
            DType::I32,
            &[3, 0],
            &[r as u64, 0],
            &[if r == 0 { 1 } else { 2 }, 0],
            0,
            None,
            TensorData::Owned(vec![]),
        );
        // The scalar: rank 0 main, rank 1 a replica.
        let scalar =
            ShardedTensor::full("loss", DType::F64, &[], TensorData::Owned(loss.clone())).with_replica_id(r as u32);
        StateTree::map()
            .with("empty", StateTree::Tensor(empty))
            .with("no_cols", StateTree::Tensor(rows))
            .with("loss", StateTree::Tensor(scalar))
    });
    let meta = open(&storage).map(|c| c.tensors_metadata()).unwrap();
    assert_eq!(meta["empty"].global_shape, vec![0, 5]);
    assert_eq!(meta["no_cols"].global_shape, vec![3, 0]);
    assert_eq!(meta["loss"].global_shape, Vec::<u64>::new());
    let plain = open(&storage).and_then(|c| c.read_tensors(None)).unwrap();
    assert_eq!(plain["loss"].data, loss);
    assert!(plain["empty"].data.is_empty() && plain["no_cols"].data.is_empty());
    let out = run_ranks(3, |c| {
        let mut buf = [0u8; 8];
        let tree = StateTree::map()
            .with("loss", StateTree::Tensor(ShardedTensor::full("loss", DType::F64, &[], TensorData::Mut(&mut buf))))
            .with("empty", full_request("empty", DType::F32, &[0, 5]))
            .with(
                "part",
                StateTree::Tensor(shard(
                    "no_cols",
                    DType::I32,
                    &[3, 0],
                    &[c.rank() as u64, 0],
                    &[1, 0],
                    0,
                    None,
                    TensorData::None,
                )),
            );
        let res = load(tree, &storage, c, &load_opts()).unwrap();
        assert!(bytes_at(&res.state, "empty").is_empty());
        assert!(bytes_at(&res.state, "part").is_empty());
        drop(res);
        f64::from_le_bytes(buf)
    });
    assert_eq!(out, [2.75; 3]);
    assert!(verify(&storage, 2).unwrap().problems.is_empty());
}

#[test]
fn an_empty_object_round_trips() {
    let storage = MemoryStorage::new();
    let tree = StateTree::map()
        .with("o", StateTree::Object(ShardedObject::new("o", Vec::new(), &[1], &[0])))
        .with("w", StateTree::Tensor(owned_f32("w", &[2], &[0], &[2], &[1.0, 2.0])));
    save(tree, &storage, &SoloComm, &small_blocks(16)).unwrap();
    let res =
        load(StateTree::map().with("o", object_request("o", &[1], &[0])), &storage, &SoloComm, &load_opts()).unwrap();
    assert_eq!(res.state.get_dotted("o").and_then(StateTree::as_object).unwrap().data, Some(vec![]));
    assert!(verify(&storage, 1).unwrap().problems.is_empty());
}

// ---------------------------------------------------------------------------------------------
// Garbage collection and interrupted saves.

/// A storage whose index commit always fails and whose data files cannot be removed: a save
/// that crashes before committing (no chance to clean up).
#[derive(Debug)]
struct NoCommit(LocalStorage);

impl Storage for NoCommit {
    fn location(&self) -> String {
        self.0.location()
    }
    fn size(&self, name: &str) -> Result<u64> {
        self.0.size(name)
    }
    fn read_at(&self, name: &str, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.0.read_at(name, offset, buf)
    }
    fn create(&self, name: &str, size: u64) -> Result<Box<dyn ObjectWriter>> {
        self.0.create(name, size)
    }
    fn put_atomic(&self, name: &str, bytes: &[u8]) -> Result<()> {
        if name == INDEX_FILE {
            return Err(Error::Io { path: name.into(), source: std::io::Error::other("injected crash before commit") });
        }
        self.0.put_atomic(name, bytes)
    }
    fn list(&self) -> Result<Vec<String>> {
        self.0.list()
    }
    fn delete(&self, name: &str) -> Result<()> {
        if name.ends_with(".safetensors") {
            return Err(Error::Io { path: name.into(), source: std::io::Error::other("injected crash") });
        }
        self.0.delete(name)
    }
}

fn rows_tree(world: usize, r: usize, base: f32) -> StateTree<'static> {
    let per = 4 / world as u64;
    StateTree::map()
        .with("w", StateTree::Tensor(owned_f32("w", &[4, 2], &[r as u64 * per, 0], &[per, 2], &iota(8, base))))
}

#[test]
fn gc_removes_the_leftovers_of_a_save_that_never_committed() {
    let dir = TempDir::new("gc");
    let crashing = NoCommit(LocalStorage::new(dir.path()));
    let out = run_ranks(2, |c| save(rows_tree(2, c.rank(), 0.0), &crashing, c, &small_blocks(16)));
    for (r, x) in out.into_iter().enumerate() {
        let e = x.expect_err("every rank must learn that the commit failed");
        assert!(e.to_string().contains("run `tessera gc"), "rank {r}: {e}");
    }
    let storage = LocalStorage::new(dir.path());
    let leftovers = data_files(&storage);
    assert_eq!(leftovers.len(), 2, "the data files were written");
    assert!(
        matches!(open(&storage).map(Checkpoint::into_index), Err(Error::NotCommitted { .. })),
        "but nothing looks committed"
    );
    std::fs::write(dir.join("notes.txt"), b"not ours").unwrap();
    std::fs::write(dir.join(".tessera.index.tmp-1-2"), b"half an index").unwrap();
    let mut expected = leftovers.clone();
    expected.push(".tessera.index.tmp-1-2".into());
    expected.sort();
    assert_eq!(gc(&storage, &GcOptions::default()).unwrap().removed, expected);
    assert_eq!(names(&storage), ["notes.txt"], "gc removes only tessera's files");
    assert!(gc(&storage, &GcOptions::default()).unwrap().removed.is_empty(), "idempotent");
}

#[test]
fn gc_after_a_failed_overwrite_keeps_the_committed_checkpoint() {
    let dir = TempDir::new("gc-overwrite");
    let storage = LocalStorage::new(dir.path());
    save_ranks(&storage, 2, &small_blocks(16), |r| rows_tree(2, r, 1.0));
    let committed = data_files(&storage);
    let crashing = NoCommit(LocalStorage::new(dir.path()));
    let opts = SaveOptions { overwrite: true, ..small_blocks(16) };
    for x in run_ranks(4, |c| save(rows_tree(4, c.rank(), 100.0), &crashing, c, &opts)) {
        assert!(x.is_err());
    }
    // The old checkpoint is intact and still committed.
    assert_eq!(f32s(&open(&storage).and_then(|c| c.read_tensors(None)).unwrap()["w"].data), iota(8, 1.0));
    let all = data_files(&storage);
    assert_eq!(all.len(), 2 + 4);
    let removed = gc(&storage, &GcOptions::default()).unwrap().removed;
    assert_eq!(removed.len(), 4);
    assert!(removed.iter().all(|n| !committed.contains(n)));
    assert_eq!(data_files(&storage), committed);
    assert_eq!(f32s(&open(&storage).and_then(|c| c.read_tensors(None)).unwrap()["w"].data), iota(8, 1.0));
    assert!(verify(&storage, 2).unwrap().problems.is_empty());
    // A later successful save cleans up by itself too.
    let crashing_again = NoCommit(LocalStorage::new(dir.path()));
    for x in run_ranks(2, |c| save(rows_tree(2, c.rank(), 5.0), &crashing_again, c, &opts)) {
        assert!(x.is_err());
    }
    save_ranks(&storage, 2, &opts, |r| rows_tree(2, r, 7.0));
    assert_eq!(data_files(&storage).len(), 2);
    assert_eq!(f32s(&open(&storage).and_then(|c| c.read_tensors(None)).unwrap()["w"].data), iota(8, 7.0));
}

#[test]
fn gc_on_an_empty_location_does_nothing() {
    assert!(gc(&MemoryStorage::new(), &GcOptions::default()).unwrap().removed.is_empty());
    let dir = TempDir::new("gc-absent");
    assert!(gc(&LocalStorage::new(dir.path()), &GcOptions::default()).unwrap().removed.is_empty());
}

#[test]
fn remove_sharded_tensors_commits_an_index_without_them() {
    let storage = MemoryStorage::new();
    save_ranks(&storage, 1, &small_blocks(16), |_| {
        StateTree::map()
            .with("a", StateTree::Tensor(owned_f32("opt.exp_avg", &[2], &[0], &[2], &[1.0, 2.0])))
            .with("b", StateTree::Tensor(owned_f32("opt.exp_avg_sq", &[2], &[0], &[2], &[3.0, 4.0])))
            .with("c", StateTree::Tensor(owned_f32("model.w", &[2], &[0], &[2], &[5.0, 6.0])))
    });
    let mut removed = remove_sharded_tensors(&storage, "opt.").unwrap();
    removed.sort();
    assert_eq!(removed, ["opt.exp_avg", "opt.exp_avg_sq"]);
    let meta = open(&storage).map(|c| c.tensors_metadata()).unwrap();
    assert_eq!(meta.keys().collect::<Vec<_>>(), ["model.w"]);
    assert_eq!(f32s(&open(&storage).and_then(|c| c.read_tensors(None)).unwrap()["model.w"].data), [5.0, 6.0]);
    assert!(remove_sharded_tensors(&storage, "opt.").unwrap().is_empty());
}

// ---------------------------------------------------------------------------------------------
// Read amplification.

#[test]
fn tp4_to_tp2_reads_at_most_5_percent_more_than_needed() {
    // Column-parallel qkv (rows split), row-parallel proj (columns split), a replicated norm.
    let qkv = iota(512 * 64, 0.0);
    let proj = iota(64 * 512, 0.5);
    let norm = iota(64, -1.0);
    let storage = MemoryStorage::new();
    save_ranks(&storage, 4, &SaveOptions { threads: 2, ..Default::default() }, |r| {
        let r64 = r as u64;
        StateTree::map()
            .with("qkv", StateTree::Tensor(owned_f32("qkv", &[512, 64], &[128 * r64, 0], &[128, 64], &qkv)))
            .with("proj", StateTree::Tensor(owned_f32("proj", &[64, 512], &[0, 128 * r64], &[64, 128], &proj)))
            .with("norm", StateTree::Tensor(owned_f32("norm", &[64], &[0], &[64], &norm).with_replica_id(r as u32)))
    });
    let stats = run_ranks(2, |c| {
        let r = c.rank() as u64;
        let tree = StateTree::map()
            .with(
                "qkv",
                StateTree::Tensor(shard(
                    "qkv",
                    DType::F32,
                    &[512, 64],
                    &[256 * r, 0],
                    &[256, 64],
                    0,
                    None,
                    TensorData::None,
                )),
            )
            .with(
                "proj",
                StateTree::Tensor(shard(
                    "proj",
                    DType::F32,
                    &[64, 512],
                    &[0, 256 * r],
                    &[64, 256],
                    0,
                    None,
                    TensorData::None,
                )),
            )
            .with("norm", full_request("norm", DType::F32, &[64]));
        let res = load(tree, &storage, c, &LoadOptions { verify_checksums: true, ..load_opts() }).unwrap();
        let t = f32_bytes(&qkv);
        assert_eq!(bytes_at(&res.state, "qkv"), box_bytes(&t, &[512, 64], 4, &[256 * r, 0], &[256, 64]));
        let t = f32_bytes(&proj);
        assert_eq!(bytes_at(&res.state, "proj"), box_bytes(&t, &[64, 512], 4, &[0, 256 * r], &[64, 256]));
        assert_eq!(f32s(bytes_at(&res.state, "norm")), norm);
        res.stats
    });
    for (r, s) in stats.iter().enumerate() {
        assert_eq!(s.bytes_needed, (256 * 64 * 2 + 64) * 4, "rank {r}");
        assert!(
            s.bytes_read as f64 <= 1.05 * s.bytes_needed as f64,
            "rank {r}: read {} for {} needed",
            s.bytes_read,
            s.bytes_needed
        );
        assert!(s.reads > 0);
    }
}

// ---------------------------------------------------------------------------------------------
// Data files are safetensors files describing their chunks.

#[test]
fn data_files_are_valid_safetensors_describing_their_chunks() {
    let storage = objects_checkpoint();
    let index = open(&storage).map(Checkpoint::into_index).unwrap();
    let mut chunks_seen = 0;
    for (fi, f) in index.files.iter().enumerate() {
        let bytes = storage.read(&f.name).unwrap();
        assert_eq!(bytes.len() as u64, f.size);
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        assert_eq!((8 + n) % 8, 0, "data section aligned to 8 bytes");
        let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).expect("header is JSON");
        let data = &bytes[8 + n..];
        let obj = header.as_object().unwrap();
        // Entries tile the data section (safetensors forbids holes).
        let mut spans: Vec<(u64, u64)> = Vec::new();
        for (name, e) in obj {
            if name == "__metadata__" {
                assert!(
                    e.as_object().unwrap().values().all(serde_json::Value::is_string),
                    "metadata values are strings"
                );
                continue;
            }
            let dtype = DType::parse(e["dtype"].as_str().unwrap()).unwrap();
            let shape: Vec<u64> = e["shape"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
            let offs: Vec<u64> = e["data_offsets"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
            assert_eq!(offs[1] - offs[0], numel(&shape) * dtype.size() as u64, "{name}");
            spans.push((offs[0], offs[1]));
        }
        spans.sort_unstable();
        let mut cursor = 0;
        for (s, e) in spans {
            assert_eq!(s, cursor, "{}: hole or overlap in the data section", f.name);
            cursor = e;
        }
        assert_eq!(cursor, data.len() as u64);
        // The metadata lists this file's chunks, matching the index.
        let meta = obj["__metadata__"].as_object().unwrap();
        assert_eq!(meta["format"], "tessera");
        assert_eq!(meta["format_version"], FORMAT_VERSION.to_string());
        let chunks: serde_json::Value = serde_json::from_str(meta["chunks"].as_str().unwrap()).unwrap();
        for c in chunks.as_array().unwrap() {
            let key = c["key"].as_str().unwrap();
            let t = index.tensor(key).unwrap();
            let off: Vec<u64> = c["global_offset"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
            let stored =
                t.chunks().iter().find(|s| s.file as usize == fi && s.offset == off).expect("chunk in the index");
            let entry = &obj[c["name"].as_str().unwrap()];
            let start = entry["data_offsets"][0].as_u64().unwrap();
            assert_eq!(8 + n as u64 + start, stored.byte_offset, "{key}: entry and index agree on the bytes");
            assert_eq!(c["dtype"], t.dtype.name());
            chunks_seen += 1;
        }
    }
    assert_eq!(chunks_seen, index.chunk_count());
}

// ---------------------------------------------------------------------------------------------
// The typical job, end to end (formerly the smoke test).

#[test]
fn tp4_save_then_tp2_load_with_flat_ranges_on_local_disk() {
    let dir = TempDir::new("tp4-tp2");
    let global = iota(8 * 6, 3.0);
    let global_bytes = f32_bytes(&global);
    // Save on 4 ranks: `w` split by rows (Megatron's from_rank_offsets), `b` as flattened
    // ranges of the whole tensor (a distributed optimizer's view), a common step.
    let out = InProcessComm::run(4, |c| {
        let r = c.rank();
        let rows = &global_bytes[r * 48..(r + 1) * 48];
        let w =
            ShardedTensor::from_rank_offsets("w", DType::F32, &[2, 6], TensorData::Ref(rows), &[(0, r as u64, 4)], 0)
                .unwrap();
        let b = ShardedTensor::full("b", DType::F32, &[8, 6], TensorData::Ref(rows))
            .with_flattened_range(r as u64 * 12..r as u64 * 12 + 12);
        let tree = StateTree::map()
            .with("w", StateTree::Tensor(w))
            .with("b", StateTree::Tensor(b))
            .with("step", StateTree::Value(Value::Int(7)));
        save(tree, &LocalStorage::new(dir.path()), c, &small_blocks(16))
    });
    for r in out {
        assert_eq!(r.unwrap().chunks, 8);
    }
    // Load on 2 ranks, in place: `w` split by columns, `b` in odd flattened ranges.
    let storage = LocalStorage::new(dir.path());
    let out = InProcessComm::run(2, |c| {
        let r = c.rank() as u64;
        let mut w = vec![0u8; 8 * 3 * 4];
        let mut b = vec![0u8; 17 * 4];
        let wt = ShardedTensor::from_rank_offsets("w", DType::F32, &[8, 3], TensorData::Mut(&mut w), &[(1, r, 2)], 0)
            .unwrap();
        let bt = ShardedTensor::full("b", DType::F32, &[8, 6], TensorData::Mut(&mut b))
            .with_flattened_range(5 + r * 17..22 + r * 17);
        let tree = StateTree::map().with("w", StateTree::Tensor(wt)).with("b", StateTree::Tensor(bt));
        let res = load(tree, &storage, c, &load_opts()).unwrap();
        assert_eq!(res.state.get_dotted("step").and_then(StateTree::as_value), Some(&Value::Int(7)));
        drop(res);
        (f32s(&w), f32s(&b))
    });
    for (r, (w, b)) in out.into_iter().enumerate() {
        let want_w: Vec<f32> = (0..8).flat_map(|i| global[i * 6 + r * 3..i * 6 + r * 3 + 3].to_vec()).collect();
        assert_eq!(w, want_w, "rank {r}");
        assert_eq!(b, global[5 + r * 17..22 + r * 17], "rank {r}");
    }
    assert_eq!(open(&storage).and_then(|c| c.read_tensors(None)).unwrap()["w"].data, global_bytes);
    let report = verify(&storage, 2).unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
}

#[test]
fn unusual_keys_round_trip() {
    // Keys end up in JSON headers, safetensors entry names and the binary index.
    let keys =
        ["a:b", "quote\"d", "new\nline", "back\\slash", "ünïcødé/ключ", "0:starts_like_an_entry", "__metadata__"];
    let storage = MemoryStorage::new();
    save_ranks(&storage, 2, &small_blocks(16), |r| {
        let mut tree = StateTree::map();
        for (i, k) in keys.iter().enumerate() {
            let t = owned_f32(k, &[2, 2], &[r as u64, 0], &[1, 2], &iota(4, 10.0 * i as f32));
            tree.insert(format!("k{i}"), StateTree::Tensor(t));
        }
        tree
    });
    let plain = open(&storage).and_then(|c| c.read_tensors(None)).unwrap();
    assert_eq!(plain.len(), keys.len());
    for (i, k) in keys.iter().enumerate() {
        assert_eq!(f32s(&plain[*k].data), iota(4, 10.0 * i as f32), "{k:?}");
    }
    assert!(verify(&storage, 2).unwrap().problems.is_empty());
}
