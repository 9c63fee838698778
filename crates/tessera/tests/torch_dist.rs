//! tessera's Megatron `torch_dist` writer (`save_torch_dist`): what it writes reads back
//! through tessera's own DCP / torch_dist reader, whole and resharded, with exact bytes
//! (objects and common state included); an existing checkpoint is kept unless overwriting;
//! what the format cannot hold is refused on every rank before anything is written.
//! (`tests/python/test_torch_dist_write.py` has torch load the same files;
//! `scripts/interop/check_torch_dist_interop.py` has megatron-core load them.)

use crate::common::hostile;

use std::path::Path;

use crate::common::{box_bytes, run_ranks, seeded_truth as truth, shard, TempDir};
use tessera::comm::SoloComm;
use tessera::index::FormatRecord;
use tessera::storage::LocalStorage;
use tessera::torch_dist::{save_torch_dist, TorchDistSave};
use tessera::{
    load, open, Communicator, DType, Error, LoadOptions, PathSeg, ReplicaId, SaveOptions, ShardedObject, ShardedTensor,
    StateTree, TensorData, Value,
};

struct Layout {
    key: &'static str,
    dtype: DType,
    shape: Vec<u64>,
}

fn layouts() -> Vec<Layout> {
    vec![
        Layout { key: "rows.weight", dtype: DType::BF16, shape: vec![9, 4] }, // split on axis 0
        Layout { key: "cols.weight", dtype: DType::F32, shape: vec![3, 10] }, // split on axis 1
        Layout { key: "stacked", dtype: DType::F32, shape: vec![4, 2, 3] },   // one layer per part, prepended axis
        Layout { key: "norm.weight", dtype: DType::F32, shape: vec![6] },     // replicated everywhere
        Layout { key: "step", dtype: DType::I64, shape: vec![] },             // 0-d
        Layout { key: "empty", dtype: DType::F32, shape: vec![0, 4] },        // no elements
    ]
}

fn buffers() -> Vec<Vec<u8>> {
    layouts().iter().enumerate().map(|(i, l)| truth(l.dtype, &l.shape, i as u64 + 1)).collect()
}

fn plain_object(v: &Value) -> Vec<u8> {
    [b"TSV1".as_slice(), &v.to_bytes()].concat() // tessera's tag of a plain-value object payload
}

fn rng_state(r: usize) -> Value {
    Value::Map(vec![("rank".into(), Value::Int(r as i64)), ("seed".into(), Value::Bytes(vec![r as u8, 0, 255]))])
}

/// Rank `r` of `world`'s shards of every layout, its object and (rank 0) common values.
fn rank_tree<'a>(r: usize, world: usize, buffers: &'a [Vec<u8>]) -> StateTree<'a> {
    let mut tree = StateTree::map();
    let (r64, w) = (r as u64, world as u64);
    for (i, (l, data)) in layouts().iter().zip(buffers).enumerate() {
        let split = |n: u64| (n * r64 / w, n * (r64 + 1) / w);
        let es = l.dtype.size();
        let t = match i {
            0 | 1 => {
                let axis = i;
                let (a, b) = split(l.shape[axis]);
                let mut off = vec![0; l.shape.len()];
                let mut sub = l.shape.clone();
                off[axis] = a;
                sub[axis] = b - a;
                let bytes = box_bytes(data, &l.shape, es, &off, &sub);
                shard(l.key, l.dtype, &l.shape, &off, &sub, 0, None, TensorData::Owned(bytes))
            }
            2 => {
                // Megatron's stacked layers: every rank holds whole layers (layer r, r + world, …)
                // as parts with one prepended axis; the rest of the layers are other ranks'.
                let mut tree_parts = Vec::new();
                for layer in (r64..l.shape[0]).step_by(world) {
                    let off = vec![layer, 0, 0];
                    let sub = vec![1, 2, 3];
                    let bytes = box_bytes(data, &l.shape, es, &off, &sub);
                    tree_parts.push(shard(l.key, l.dtype, &l.shape, &off, &sub, 1, None, TensorData::Owned(bytes)));
                }
                for (n, t) in tree_parts.into_iter().enumerate() {
                    tree.insert(format!("{}.{n}", l.key), StateTree::Tensor(t));
                }
                continue;
            }
            _ => {
                let mut t = ShardedTensor::full(l.key, l.dtype, &l.shape, TensorData::Ref(data));
                t.replica_id = ReplicaId::from(r as u32);
                t
            }
        };
        tree.insert(l.key, StateTree::Tensor(t));
    }
    let obj = ShardedObject::new("rng_state", plain_object(&rng_state(r)), &[world as u64], &[r as u64]);
    tree.insert("rng_state", StateTree::Object(obj));
    if r == 0 {
        tree.insert("iteration", StateTree::Value(Value::Int(7)));
        tree.insert("args", StateTree::Value(Value::Map(vec![("lr".into(), Value::Float(0.25))])));
    }
    tree
}

fn save_world(dir: &Path, world: usize, opts: &SaveOptions) -> Vec<tessera::Result<tessera::SaveReport>> {
    let buffers = buffers();
    run_ranks(world, |comm| {
        let storage = LocalStorage::new(dir);
        save_torch_dist(rank_tree(comm.rank(), world, &buffers), None, &storage, comm, opts, 2)
    })
}

fn check_written(dir: &Path, world: usize) {
    let storage = LocalStorage::new(dir);
    assert_eq!(FormatRecord::detect(&storage).unwrap().backend, tessera::index::Backend::TorchDist);
    let got = open(&storage).and_then(|c| c.read_tensors(None)).unwrap();
    let keys: Vec<&str> = got.keys().map(String::as_str).collect();
    assert_eq!(keys, ["cols.weight", "empty", "norm.weight", "rows.weight", "stacked", "step"]);
    for (i, l) in layouts().iter().enumerate() {
        let g = &got[l.key];
        assert_eq!((g.dtype, &g.shape), (l.dtype, &l.shape), "{}", l.key);
        assert!(g.data == truth(l.dtype, &l.shape, i as u64 + 1), "{}", l.key);
    }
    // The objects, one per rank of the save, as their plain values.
    let mut tree = StateTree::map();
    for r in 0..world {
        let mut o = ShardedObject::new("rng_state", Vec::new(), &[world as u64], &[r as u64]);
        o.data = None;
        tree.insert(format!("o{r}"), StateTree::Object(o));
    }
    let StateTree::Map(objects) = open(&storage).and_then(|c| c.load_objects(tree)).unwrap() else {
        panic!("not a map")
    };
    for r in 0..world {
        let Some(StateTree::Object(o)) = objects.get(&format!("o{r}")) else { panic!("object {r} missing") };
        assert_eq!(o.data.as_deref(), Some(plain_object(&rng_state(r)).as_slice()), "object {r}");
    }
    // The common state, from common.pt.
    let common = open(&storage).map(|c| c.common_state()).unwrap();
    assert_eq!(common.get(&[PathSeg::Key("iteration".into())]).and_then(StateTree::as_value), Some(&Value::Int(7)));
    let lr = [PathSeg::Key("args".into()), PathSeg::Key("lr".into())];
    let args = common.get(&lr[..1]).and_then(StateTree::as_value);
    assert_eq!(args, Some(&Value::Map(vec![("lr".into(), Value::Float(0.25))])));
}

#[test]
fn written_checkpoints_read_back_exactly_whole_and_resharded() {
    for world in [1, 2, 3] {
        let dir = TempDir::new("torch-dist-write");
        let meta = Value::Map(vec![("format".into(), Value::Int(world as i64))]);
        let opts = SaveOptions { threads: 2, content_metadata: meta.clone(), ..Default::default() };
        for (r, rep) in save_world(dir.path(), world, &opts).into_iter().enumerate() {
            let rep = rep.unwrap_or_else(|e| panic!("world {world} rank {r}: {e}"));
            let file = rep.file.clone().unwrap_or_default();
            assert_eq!(file, format!("__{r}_0.distcp"), "a fresh directory has DCP's own names");
            assert_eq!(rep.index_bytes > 0, r == 0);
        }
        for name in [".metadata", "metadata.json", "common.pt"] {
            assert!(dir.join(name).exists(), "world {world}: {name}");
        }
        let mut want: Vec<String> =
            (0..world).flat_map(|r| [format!("__{r}_0.distcp"), format!("__{r}_1.distcp")]).collect();
        want.sort();
        assert_eq!(data_files(dir.path()), want, "two data files per rank (Megatron's thread_count)");
        let json = std::fs::read_to_string(dir.join("metadata.json")).unwrap();
        assert!(json.contains("\"sharded_backend\": \"torch_dist\""), "{json}");
        check_written(dir.path(), world);
        let common = open(&LocalStorage::new(dir.path())).map(|c| c.common_state()).unwrap();
        let got = common.get(&[PathSeg::Key("content_metadata".into())]).and_then(StateTree::as_value);
        assert_eq!(got, Some(&meta), "content metadata sits in common.pt, as Megatron keeps it");

        // A resharded load: rows split 2 / 7 on one rank, whatever the save's split was.
        let storage = LocalStorage::new(dir.path());
        let l = &layouts()[0];
        let all = truth(l.dtype, &l.shape, 1);
        let mut tree = StateTree::map();
        for (n, (a, b)) in [(0u64, 2u64), (2, 9)].into_iter().enumerate() {
            let buf = vec![0u8; ((b - a) * 4 * 2) as usize];
            let t = shard(l.key, l.dtype, &l.shape, &[a, 0], &[b - a, 4], 0, None, TensorData::Owned(buf));
            tree.insert(format!("part{n}"), StateTree::Tensor(t));
        }
        let res = load(tree, &storage, &SoloComm, &LoadOptions::default()).unwrap();
        let StateTree::Map(parts) = res.state else { panic!("not a map") };
        for (n, (a, b)) in [(0u64, 2u64), (2, 9)].into_iter().enumerate() {
            let Some(StateTree::Tensor(t)) = parts.get(&format!("part{n}")) else { panic!("part {n}") };
            let want = box_bytes(&all, &l.shape, 2, &[a, 0], &[b - a, 4]);
            assert!(t.data.bytes() == Some(want.as_slice()), "world {world}: rows {a}..{b}");
        }
    }
}

#[test]
fn an_existing_checkpoint_is_kept_unless_overwriting() {
    let dir = TempDir::new("torch-dist-overwrite");
    let opts = SaveOptions { threads: 2, ..Default::default() };
    save_world(dir.path(), 3, &opts).into_iter().for_each(|r| drop(r.unwrap()));
    let before = std::fs::read(dir.join(".metadata")).unwrap();
    for r in save_world(dir.path(), 2, &opts) {
        assert!(matches!(r, Err(Error::AlreadyExists { .. }) | Err(Error::PeerFailed { .. })), "{r:?}");
    }
    assert_eq!(std::fs::read(dir.join(".metadata")).unwrap(), before, "nothing of the old checkpoint was touched");
    check_written(dir.path(), 3);
    // Overwriting with fewer ranks: the new checkpoint, and the old third rank's file is gone.
    let over = SaveOptions { overwrite: true, ..opts.clone() };
    let old_files = data_files(dir.path());
    save_world(dir.path(), 2, &over).into_iter().for_each(|r| drop(r.unwrap()));
    check_written(dir.path(), 2);
    let new_files = data_files(dir.path());
    assert_eq!(new_files.len(), 4, "{new_files:?}");
    assert!(new_files.iter().all(|f| !old_files.contains(f)), "the overwrite wrote files of its own: {new_files:?}");
    assert!(!dir.join("__2_0.distcp").exists() && !dir.join("__0_0.distcp").exists(), "replaced files removed");

    // A save that never committed (no .metadata) does not block a new one.
    std::fs::remove_file(dir.join(".metadata")).unwrap();
    save_world(dir.path(), 2, &opts).into_iter().for_each(|r| drop(r.unwrap()));
    check_written(dir.path(), 2);

    // Another format's checkpoint is never replaced by a torch_dist one.
    let native = TempDir::new("torch-dist-over-native");
    let data = truth(DType::F32, &[4], 1);
    let tree = || {
        let mut tree = StateTree::map();
        tree.insert("x", StateTree::Tensor(ShardedTensor::full("x", DType::F32, &[4], TensorData::Ref(&data))));
        tree
    };
    tessera::save(tree(), &LocalStorage::new(native.path()), &SoloComm, &opts).unwrap();
    let e = save_torch_dist(tree(), None, &LocalStorage::new(native.path()), &SoloComm, &over, 1).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }) && e.to_string().contains("tessera"), "{e}");
}

#[test]
fn what_the_format_cannot_hold_is_refused_on_every_rank() {
    let dir = TempDir::new("torch-dist-refuse");
    let data = truth(DType::F32, &[8], 1);
    // A flattened range (megatron-core 0.16.1 refuses them as well).
    let results = run_ranks(2, |comm| {
        let r = if comm.rank() == 0 { 0..5 } else { 5..8 };
        let bytes = &data[r.start as usize * 4..r.end as usize * 4];
        let t = shard("w", DType::F32, &[8], &[0], &[8], 0, Some(r), TensorData::Ref(bytes));
        let mut tree = StateTree::map();
        tree.insert("w", StateTree::Tensor(t));
        save_torch_dist(tree, None, &LocalStorage::new(dir.path()), comm, &SaveOptions::default(), 1)
    });
    for r in results {
        let e = r.unwrap_err().to_string();
        assert!(e.contains("\"w\"") && e.contains("flattened"), "{e}");
    }
    // Shards that do not tile the tensor.
    let results = run_ranks(2, |comm| {
        let (off, n) = if comm.rank() == 0 { (0, 5) } else { (4, 4) };
        let bytes = &data[off as usize * 4..(off + n) as usize * 4];
        let t = shard("w", DType::F32, &[8], &[off], &[n], 0, None, TensorData::Ref(bytes));
        let mut tree = StateTree::map();
        tree.insert("w", StateTree::Tensor(t));
        save_torch_dist(tree, None, &LocalStorage::new(dir.path()), comm, &SaveOptions::default(), 1)
    });
    for r in results {
        assert!(matches!(r, Err(Error::InvalidSharding { .. })), "{r:?}");
    }
}

// ---- the common values as DCP byte items -------------------------------------------------------

fn key(k: &str) -> PathSeg {
    PathSeg::Key(k.into())
}

fn at(i: u64) -> PathSeg {
    PathSeg::Index(i)
}

/// A value the Python package holds only as `torch.save` bytes: the tuple `(1, "x")`.
fn tuple_blob() -> Value {
    use hostile::{pickle, s, zip, P};
    let obj = P::Tuple(vec![P::Int(1), s("x")]);
    let archive =
        zip(&[("archive/data.pkl", &pickle(&obj)), ("archive/version", b"3\n"), ("archive/byteorder", b"little")]);
    Value::Map(vec![("__tessera_torch_save__".into(), Value::Bytes(archive))])
}

/// Values at their paths.
type Values = Vec<(Vec<PathSeg>, Value)>;

/// Rank 0's common values, leaf by leaf as `tessera.torch` gives them (lists element by
/// element), and each as DCP's flattening stores it: (its path, its value).
fn dcp_values() -> (Values, Values) {
    let group = |i: u64, k: &str| vec![key("optim"), key("param_groups"), at(i), key(k)];
    let with = |mut p: Vec<PathSeg>, i: u64| {
        p.push(at(i));
        p
    };
    let f = Value::Float;
    let given = vec![
        (vec![key("step")], Value::Int(7)),
        (group(0, "lr"), f(0.1)),
        (with(group(0, "betas"), 0), f(0.9)),
        (with(group(0, "betas"), 1), f(0.95)),
        (with(group(0, "params"), 0), Value::Str("model.w".into())),
        (group(1, "lr"), f(0.2)),
        (with(group(1, "params"), 0), Value::Str("b".into())),
        (vec![key("extra"), key("name")], Value::Str("run".into())),
        (vec![key("extra"), key("empty")], Value::Map(vec![])),
        (vec![key("pair")], tuple_blob()),
    ];
    let stored = vec![
        (vec![key("step")], Value::Int(7)),
        (group(0, "lr"), f(0.1)),
        (group(0, "betas"), Value::List(vec![f(0.9), f(0.95)])),
        (group(0, "params"), Value::List(vec![Value::Str("model.w".into())])),
        (group(1, "lr"), f(0.2)),
        (group(1, "params"), Value::List(vec![Value::Str("b".into())])),
        (vec![key("extra"), key("name")], Value::Str("run".into())),
        (vec![key("extra"), key("empty")], Value::Map(vec![])),
        (vec![key("pair")], tuple_blob()),
    ];
    (given, stored)
}

/// Rank `r` of 2's state: `model.w` and its `exp_avg` split by rows, rank 0 the values.
fn values_tree(r: usize, w: &[u8]) -> StateTree<'_> {
    let rows = &w[r * 12..(r + 1) * 12];
    let t = |k: &str| {
        StateTree::Tensor(shard(k, DType::F32, &[2, 3], &[r as u64, 0], &[1, 3], 0, None, TensorData::Ref(rows)))
    };
    let mut tree = StateTree::map()
        .with("model.w", t("model.w"))
        .with("optim.state.model.w.exp_avg", t("optim.state.model.w.exp_avg"));
    if r == 0 {
        for (path, v) in dcp_values().0 {
            tree.set_path(&path, StateTree::Value(v));
        }
    }
    tree
}

/// The directory's DCP part alone (no `common.pt`, `metadata.json` or tessera's copy), in
/// `plain`: a plain DCP checkpoint, whose values are its byte items.
fn dcp_part(dir: &Path, plain: &Path) {
    std::fs::create_dir_all(plain).unwrap();
    for e in std::fs::read_dir(dir).unwrap() {
        let name = e.unwrap().file_name().to_string_lossy().into_owned();
        if name != "common.pt" && name != "metadata.json" && !name.starts_with(".tessera-common-") {
            std::fs::copy(dir.join(&name), plain.join(&name)).unwrap();
        }
    }
}

#[test]
fn a_save_with_values_holds_them_as_dcp_byte_items_at_their_paths() {
    let w = truth(DType::F32, &[2, 3], 5);
    let (_, stored) = dcp_values();
    for ready_made in [false, true] {
        let dir = TempDir::new("torch-dist-values");
        // With a ready-made common.pt (what the Python package passes beside the values), the
        // values are the byte items only.
        let common_pt = ready_made.then(|| {
            let src = TempDir::new("torch-dist-values-src");
            let tree = StateTree::map().with("step", StateTree::Value(Value::Int(7)));
            save_torch_dist(tree, None, &LocalStorage::new(src.path()), &SoloComm, &SaveOptions::default(), 1).unwrap();
            std::fs::read(src.join("common.pt")).unwrap()
        });
        run_ranks(2, |comm| {
            let storage = LocalStorage::new(dir.path());
            let common = common_pt.as_deref().filter(|_| comm.rank() == 0);
            save_torch_dist(values_tree(comm.rank(), &w), common, &storage, comm, &SaveOptions::default(), 2)
        })
        .into_iter()
        .for_each(|r| drop(r.unwrap()));
        if let Some(b) = &common_pt {
            assert_eq!(&std::fs::read(dir.join("common.pt")).unwrap(), b, "the caller's common.pt, as given");
        }

        // `.metadata` lists each value as a byte item under DCP's flattened key.
        let metadata = std::fs::read(dir.join(".metadata")).unwrap();
        let holds = |s: &str| metadata.windows(s.len()).any(|w| w == s.as_bytes());
        assert!(holds("BytesStorageMetadata"));
        for k in [
            "step",
            "optim.param_groups.0.lr",
            "optim.param_groups.0.betas",
            "optim.param_groups.1.params",
            "extra.empty",
            "pair",
        ] {
            assert!(holds(k), "{k}");
        }
        assert!(!holds("optim.param_groups.0.betas.0"), "a list of numbers is one value");

        // The tensors read back whole, and the DCP part alone is a plain DCP checkpoint whose
        // byte items are the values, each at the path `planner_data` records.
        let tensors = open(&LocalStorage::new(dir.path())).and_then(|c| c.read_tensors(None)).unwrap();
        assert_eq!(tensors["model.w"].data, w);
        let plain = TempDir::new("torch-dist-values-plain");
        dcp_part(dir.path(), plain.path());
        let dcp = LocalStorage::new(plain.path());
        assert_eq!(FormatRecord::detect(&dcp).unwrap().backend, tessera::index::Backend::TorchDcp);
        let tensors = open(&dcp).and_then(|c| c.read_tensors(None)).unwrap();
        assert_eq!(tensors["optim.state.model.w.exp_avg"].data, w);
        let mut got = open(&dcp).unwrap().into_index().common;
        let mut want = stored.clone();
        got.sort_by(|a, b| format!("{:?}", a.0).cmp(&format!("{:?}", b.0)));
        want.sort_by(|a, b| format!("{:?}", a.0).cmp(&format!("{:?}", b.0)));
        assert_eq!(got, want);
        if !ready_made {
            // And tessera reads the whole checkpoint's values once, from common.pt.
            let common = open(&LocalStorage::new(dir.path())).unwrap().into_index().common;
            let tops: Vec<String> = common.iter().map(|(p, _)| tessera::path_string(p)).collect();
            assert_eq!(tops, ["extra", "optim", "pair", "step"], "{common:?}");
        }
    }
}

#[test]
fn a_value_and_a_tensor_under_one_dcp_key_are_refused_on_every_rank() {
    let w = truth(DType::F32, &[2, 3], 5);
    // The tensor `model.w.x` is rank 0's (refused before any write) or rank 1's alone (known
    // to rank 0 only once the plans are exchanged: the commit fails on every rank).
    for holder in [0, 1] {
        let dir = TempDir::new("torch-dist-values-clash");
        let results = run_ranks(2, |comm| {
            let r = comm.rank();
            let mut tree = values_tree(r, &w);
            if r == holder {
                let t = ShardedTensor::full("model.w.x", DType::F32, &[2, 3], TensorData::Ref(&w));
                tree.insert("model.w.x", StateTree::Tensor(t));
            }
            if r == 0 {
                tree.set_path(&[key("model"), key("w"), key("x")], StateTree::Value(Value::Int(1)));
            }
            save_torch_dist(tree, None, &LocalStorage::new(dir.path()), comm, &SaveOptions::default(), 1)
        });
        for r in results {
            let e = r.unwrap_err().to_string();
            assert!(e.contains("model.w.x"), "holder {holder}: {e}");
        }
        assert!(!dir.join(".metadata").exists(), "holder {holder}: nothing committed");
        if dir.path().exists() {
            assert!(data_files(dir.path()).is_empty(), "holder {holder}: every data file removed");
        }
    }
}

// ---- tessera convert --to dcp ------------------------------------------------------------------

fn same_tensors(a: &Path, b: &Path, what: &str) {
    let (a, b) = (
        open(&LocalStorage::new(a)).and_then(|c| c.read_tensors(None)).unwrap(),
        open(&LocalStorage::new(b)).and_then(|c| c.read_tensors(None)).unwrap(),
    );
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>(), "{what}: keys");
    for (k, x) in &a {
        let y = &b[k];
        assert_eq!((x.dtype, &x.shape), (y.dtype, &y.shape), "{what}: {k}");
        assert!(x.data == y.data, "{what}: {k}: values differ");
    }
}

#[test]
fn a_native_checkpoint_with_flat_ranges_objects_and_common_state_converts_exactly() {
    let src = TempDir::new("to-dcp-src");
    let data = truth(DType::F32, &[13, 7], 3);
    let rows = truth(DType::BF16, &[5, 4], 4);
    run_ranks(2, |comm| {
        let r = comm.rank() as u64;
        let (a, b) = if r == 0 { (0u64, 40u64) } else { (40, 91) };
        let mut tree = StateTree::map();
        let flat = shard(
            "flat",
            DType::F32,
            &[13, 7],
            &[0, 0],
            &[13, 7],
            0,
            Some(a..b),
            TensorData::Ref(&data[a as usize * 4..b as usize * 4]),
        );
        tree.insert("flat", StateTree::Tensor(flat));
        let (o, n) = if r == 0 { (0u64, 2u64) } else { (2, 3) };
        let part = box_bytes(&rows, &[5, 4], 2, &[o, 0], &[n, 4]);
        tree.insert(
            "rows",
            StateTree::Tensor(shard("rows", DType::BF16, &[5, 4], &[o, 0], &[n, 4], 0, None, TensorData::Owned(part))),
        );
        let obj = ShardedObject::new("rng_state", plain_object(&rng_state(r as usize)), &[2], &[r]);
        tree.insert("rng", StateTree::Object(obj));
        if r == 0 {
            tree.insert("iteration", StateTree::Value(Value::Int(9)));
        }
        // Small checksum blocks, so that the small budget below may cut chunks finely.
        let content_metadata = Value::Map(vec![("format".into(), Value::Int(2))]);
        let opts = SaveOptions { content_metadata, block_size: 64, ..Default::default() };
        tessera::save(tree, &LocalStorage::new(src.path()), comm, &opts).unwrap();
    });
    let dst = TempDir::new("to-dcp-dst");
    // A small budget: chunks are cut, flat ranges into boxes.
    let opts = tessera::tools::ConvertOptions { memory_budget: 256, max_file_size: 200, ..Default::default() };
    let report = tessera::tools::convert_to_dcp(
        &LocalStorage::new(src.path()),
        &LocalStorage::new(dst.path()),
        &opts,
        &mut |_, _| {},
    )
    .unwrap();
    assert!(report.files > 1 && report.chunks > 4, "{report:?}");
    assert_eq!(
        FormatRecord::detect(&LocalStorage::new(dst.path())).unwrap().backend,
        tessera::index::Backend::TorchDist
    );
    same_tensors(src.path(), dst.path(), "native -> dcp");
    let storage = LocalStorage::new(dst.path());
    let mut tree = StateTree::map();
    for r in 0..2u64 {
        let mut o = ShardedObject::new("rng_state", Vec::new(), &[2], &[r]);
        o.data = None;
        tree.insert(format!("o{r}"), StateTree::Object(o));
    }
    let StateTree::Map(objects) = open(&storage).and_then(|c| c.load_objects(tree)).unwrap() else {
        panic!("not a map")
    };
    for r in 0..2 {
        let Some(StateTree::Object(o)) = objects.get(&format!("o{r}")) else { panic!("object {r}") };
        assert_eq!(o.data.as_deref(), Some(plain_object(&rng_state(r)).as_slice()));
    }
    let common = open(&storage).map(|c| c.common_state()).unwrap();
    assert_eq!(common.get(&[PathSeg::Key("iteration".into())]).and_then(StateTree::as_value), Some(&Value::Int(9)));
    let meta = common.get(&[PathSeg::Key("content_metadata".into())]).and_then(StateTree::as_value);
    assert_eq!(meta, Some(&Value::Map(vec![("format".into(), Value::Int(2))])));

    // Refused over a committed checkpoint unless overwriting; then replaced.
    let e =
        tessera::tools::convert_to_dcp(&LocalStorage::new(src.path()), &storage, &opts, &mut |_, _| {}).unwrap_err();
    assert!(matches!(e, Error::AlreadyExists { .. }), "{e}");
    let over = tessera::tools::ConvertOptions { overwrite: true, ..Default::default() };
    let report =
        tessera::tools::convert_to_dcp(&LocalStorage::new(src.path()), &storage, &over, &mut |_, _| {}).unwrap();
    assert_eq!(report.files, 1);
    assert_eq!(data_files(dst.path()).len(), 1, "the files of the replaced checkpoint are gone");
    same_tensors(src.path(), dst.path(), "native -> dcp, overwritten");
}

#[test]
fn every_readable_fixture_converts_to_dcp_or_names_what_cannot_go() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let mut converted = 0;
    for group in ["foreign", "olmo", "golden_v2"] {
        let Ok(dirs) = std::fs::read_dir(root.join(group)) else { continue };
        let mut dirs: Vec<_> = dirs.map(|d| d.unwrap().path()).filter(|p| p.is_dir()).collect();
        dirs.sort();
        for src in dirs {
            let what = src.display().to_string();
            if FormatRecord::detect(&LocalStorage::new(&src)).is_err() {
                continue; // a fixture of a damaged or partial checkpoint
            }
            let dst = TempDir::new("fixture-to-dcp");
            let opts = tessera::tools::ConvertOptions::default();
            match tessera::tools::convert_to_dcp(
                &LocalStorage::new(&src),
                &LocalStorage::new(dst.path()),
                &opts,
                &mut |_, _| {},
            ) {
                Ok(_) => {
                    same_tensors(&src, dst.path(), &what);
                    // Objects, common state and content metadata too.
                    let (a, b) = (LocalStorage::new(&src), LocalStorage::new(dst.path()));
                    let report =
                        tessera::tools::diff::diff(&a, &b, &tessera::tools::diff::DiffOptions::default()).unwrap();
                    assert!(report.is_equal(), "{what}: {report:?}");
                    converted += 1;
                }
                Err(e) => {
                    let msg = e.to_string();
                    assert!(msg.contains("common value") && msg.contains("torch.save bytes"), "{what}: {msg}");
                }
            }
        }
    }
    assert!(converted >= 8, "only {converted} fixtures converted");
}

/// The DCP data files (`__{rank}_{k}.distcp`) in `dir`, sorted.
fn data_files(dir: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("__") && n.ends_with(".distcp"))
        .collect();
    names.sort();
    names
}

/// The three steps of [`TorchDistSave`], as Megatron's writer workers drive them: files
/// written from several threads in reverse order make the same checkpoint; a file that fails
/// on one rank fails every rank at the commit (the others with `PeerFailed` naming it), commits
/// nothing and leaves none of the save's files.
#[test]
fn a_save_driven_file_by_file_commits_only_when_every_file_of_every_rank_is_written() {
    let opts = SaveOptions { threads: 2, ..SaveOptions::default() };
    let buffers = buffers();
    let dir = TempDir::new("torch-dist-split");
    let results = run_ranks(2, |comm| {
        let storage = LocalStorage::new(dir.path());
        let tree = rank_tree(comm.rank(), 2, &buffers);
        let save = TorchDistSave::plan(tree, None, &storage, comm, &opts, 3)?;
        assert_eq!(save.files(), 3);
        assert!(save.file_name(3).is_none());
        let (plan, out, o) = (&save, &storage, &opts);
        let written: Vec<u64> = std::thread::scope(|s| {
            let write = |k| s.spawn(move || plan.write_file(k, out, o));
            let handles: Vec<_> = (0..save.files()).rev().map(write).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect::<tessera::Result<_>>()
        })?;
        save.commit(Ok(written.iter().sum()), &storage, comm, &opts)
    });
    for r in results {
        r.unwrap();
    }
    check_written(dir.path(), 2);
    assert_eq!(data_files(dir.path()).len(), 6);

    let dir = TempDir::new("torch-dist-split-fails");
    let results = run_ranks(2, |comm| {
        let storage = LocalStorage::new(dir.path());
        let save = TorchDistSave::plan(rank_tree(comm.rank(), 2, &buffers), None, &storage, comm, &opts, 2)?;
        let mut written = Ok(0);
        for k in 0..save.files() {
            written = if comm.rank() == 1 && k == 1 {
                Err(Error::Io { path: "__1_1.distcp".into(), source: std::io::Error::other("disk full") })
            } else {
                written.and_then(|n| Ok(n + save.write_file(k, &storage, &opts)?))
            };
        }
        save.commit(written, &storage, comm, &opts)
    });
    match &results[0] {
        Err(Error::PeerFailed { rank: 1, message }) => assert!(message.contains("disk full"), "{message}"),
        other => panic!("rank 0: {other:?}"),
    }
    assert!(matches!(&results[1], Err(Error::Io { .. })), "rank 1: {:?}", results[1]);
    assert!(!dir.path().join(".metadata").exists());
    assert_eq!(data_files(dir.path()), Vec::<String>::new());
}

/// A load that exchanges reads between ranks (Megatron's fully parallel load) of a checkpoint
/// without checksum blocks, with checksum verification asked for: every rank needs the whole
/// of `rows.weight`, one reads each piece, all get exact bytes. (It once divided by the block
/// size, 0 in a foreign checkpoint.)
#[test]
fn a_load_exchanging_reads_between_ranks_works_without_checksum_blocks() {
    let dir = TempDir::new("torch-dist-exchange");
    for r in save_world(dir.path(), 2, &SaveOptions::default()) {
        r.unwrap();
    }
    let l = &layouts()[0];
    let all = truth(l.dtype, &l.shape, 1);
    let opts = LoadOptions { exchange_reads: true, verify_checksums: true, ..LoadOptions::default() };
    let results = run_ranks(3, |comm| -> tessera::Result<Option<Vec<u8>>> {
        let storage = LocalStorage::new(dir.path());
        let buf = vec![0u8; all.len()];
        let t = shard(l.key, l.dtype, &l.shape, &[0, 0], &l.shape, 0, None, TensorData::Owned(buf));
        let res = load(StateTree::map().with("w", StateTree::Tensor(t)), &storage, comm, &opts)?;
        let Some(StateTree::Tensor(t)) = res.state.get(&[PathSeg::Key("w".into())]) else { panic!("w") };
        Ok(t.data.bytes().map(<[u8]>::to_vec))
    });
    for (r, got) in results.into_iter().enumerate() {
        assert!(got.unwrap().as_deref() == Some(all.as_slice()), "rank {r}");
    }
}

/// A location holding other files and no checkpoint is refused (on every rank, naming the
/// file) unless overwriting, which leaves those files alone.
#[test]
fn a_location_holding_other_files_is_refused_unless_overwriting() {
    let dir = TempDir::new("torch-dist-busy");
    std::fs::create_dir_all(dir.path()).unwrap();
    std::fs::write(dir.join("notes.txt"), b"mine").unwrap();
    for (r, out) in save_world(dir.path(), 2, &SaveOptions::default()).into_iter().enumerate() {
        // Rank 0 looks; the other ranks learn its verdict.
        let e = out.unwrap_err();
        let kind_ok = if r == 0 {
            matches!(e, Error::InvalidArgument { .. })
        } else {
            matches!(e, Error::PeerFailed { rank: 0, .. })
        };
        assert!(kind_ok && e.to_string().contains("notes.txt"), "rank {r}: {e}");
    }
    assert!(!dir.join(".metadata").exists());
    for r in save_world(dir.path(), 2, &SaveOptions { overwrite: true, ..Default::default() }) {
        r.unwrap();
    }
    assert_eq!(std::fs::read(dir.join("notes.txt")).unwrap(), b"mine");
    check_written(dir.path(), 2);
}

/// Uneven shardings leave ranks with empty shards, several at one offset (Megatron's
/// `test_uneven_1d_sharding`): DCP keys their storage by fqn and offsets, so they share one
/// entry of `.metadata`, and a reader finds it for each.
#[test]
fn empty_shards_at_one_offset_save_and_load() {
    let storage = tessera::storage::MemoryStorage::new();
    let data: Vec<u8> = (0..4).collect();
    for r in run_ranks(3, |c| {
        let rank = tessera::Communicator::rank(c);
        let (off, len) = if rank == 0 { (0, 4) } else { (4, 0) };
        let bytes = data[off as usize..(off + len) as usize].to_vec();
        let t = shard("a", DType::U8, &[4], &[off], &[len], 0, None, TensorData::Owned(bytes));
        let tree = StateTree::map().with("a", StateTree::Tensor(t));
        save_torch_dist(tree, None, &storage, c, &SaveOptions::default(), 1)
    }) {
        r.unwrap();
    }
    assert_eq!(open(&storage).unwrap().read_tensors(None).unwrap()["a"].data, data);
}
