//! Fully-parallel load (`LoadOptions::exchange_reads`): every byte range needed by several
//! ranks is read once within the group and exchanged. The result must be byte-identical to a
//! normal load, the group must read each needed byte exactly once, and a failure on any rank
//! must fail every rank instead of leaving one waiting.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::common::*;
use tessera::comm::*;
use tessera::factory::*;
use tessera::index::*;
use tessera::storage::*;
use tessera::*;

/// Every tensor leaf of a loaded state, by dotted path.
fn tensors_of(state: &StateTree<'_>) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    state.for_each_leaf(&mut |path, leaf| {
        if let StateTree::Tensor(t) = leaf {
            out.insert(path_string(path), t.data.bytes().unwrap_or_default().to_vec());
        }
    });
    out
}

type Loaded = Result<(BTreeMap<String, Vec<u8>>, LoadStats)>;

/// Loads `build(rank)` on `world` ranks.
fn load_ranks(
    storage: &dyn Storage,
    world: usize,
    opts: &LoadOptions,
    build: impl Fn(usize) -> StateTree<'static> + Sync,
) -> Vec<Loaded> {
    run_ranks(world, |c| load(build(c.rank()), storage, c, opts).map(|r| (tensors_of(&r.state), r.stats)))
}

/// Loads with and without the exchange; asserts both succeed with the same bytes on every
/// rank; returns the stats of the exchanged load and the loaded tensors.
fn load_both(
    storage: &dyn Storage,
    world: usize,
    opts: &LoadOptions,
    build: impl Fn(usize) -> StateTree<'static> + Sync,
) -> (Vec<LoadStats>, Vec<BTreeMap<String, Vec<u8>>>) {
    let normal = load_ranks(storage, world, &LoadOptions { exchange_reads: false, ..opts.clone() }, &build);
    let exchanged = load_ranks(storage, world, &LoadOptions { exchange_reads: true, ..opts.clone() }, &build);
    let mut stats = Vec::new();
    let mut data = Vec::new();
    for (r, (n, x)) in normal.into_iter().zip(exchanged).enumerate() {
        let (n, ns) = n.unwrap_or_else(|e| panic!("normal load, rank {r}: {e}"));
        let (x, xs) = x.unwrap_or_else(|e| panic!("exchanged load, rank {r}: {e}"));
        assert_eq!(n.keys().collect::<Vec<_>>(), x.keys().collect::<Vec<_>>(), "rank {r}");
        for (k, v) in &n {
            assert!(x[k] == *v, "rank {r}: {k:?} differs from a normal load");
        }
        assert_eq!(ns.bytes_received, 0);
        assert_eq!(xs.bytes_needed, ns.bytes_needed, "rank {r}");
        stats.push(xs);
        data.push(x);
    }
    (stats, data)
}

fn total_read(stats: &[LoadStats]) -> u64 {
    stats.iter().map(|s| s.bytes_read).sum()
}

// ---------------------------------------------------------------------------------------------
// Data-parallel replicas: everyone needs everything.

struct Spec {
    key: &'static str,
    dtype: DType,
    shape: Vec<u64>,
    truth: Vec<u8>,
}

fn replicated_specs() -> Vec<Spec> {
    let mut rng = Rng::new(7);
    let mut spec = |key, dtype: DType, shape: &[u64]| {
        let n = numel(shape) as usize * dtype.size();
        Spec { key, dtype, shape: shape.to_vec(), truth: rng.bytes(n) }
    };
    vec![
        spec("emb", DType::F32, &[2048, 1024]),
        spec("layers_0_w", DType::BF16, &[512, 700]),
        spec("layers_0_b", DType::F32, &[4096]),
        spec("layers_1_w", DType::F32, &[300, 301]),
        spec("ids", DType::I64, &[333]),
        spec("scale", DType::F32, &[]),
        spec("empty", DType::F32, &[0, 3]),
    ]
}

/// Saves the specs from `world` data-parallel replicas (fully-parallel save spreads the files).
fn save_replicated(storage: &dyn Storage, specs: &[Spec], world: usize, block_size: u64) {
    let out = run_ranks(world, |c| {
        let mut tree = StateTree::map();
        for s in specs {
            let t = ShardedTensor::full(s.key, s.dtype, &s.shape, TensorData::Ref(&s.truth))
                .with_replica_id(c.rank() as u32);
            tree.insert(s.key, StateTree::Tensor(t));
        }
        save(tree, storage, c, &SaveOptions { block_size, threads: 2, ..Default::default() })
    });
    for (r, x) in out.into_iter().enumerate() {
        x.unwrap_or_else(|e| panic!("save, rank {r}: {e}"));
    }
}

fn replicated_request(specs: &[Spec]) -> StateTree<'static> {
    let mut tree = StateTree::map();
    for s in specs {
        tree.insert(s.key, StateTree::Tensor(ShardedTensor::full(s.key, s.dtype, &s.shape, TensorData::None)));
    }
    tree
}

#[test]
fn replicated_state_is_read_once_across_four_ranks() {
    let specs = replicated_specs();
    let storage = MemoryStorage::new();
    save_replicated(&storage, &specs, 4, 256 << 10);
    let total = open(&storage).map(Checkpoint::into_index).unwrap().tensor_bytes();
    assert_eq!(total, specs.iter().map(|s| s.truth.len() as u64).sum::<u64>());
    // A 3 MiB round budget cuts 4-way shared ranges into 1 MiB pieces (3 copies sent each).
    for (verify, round_bytes, piece) in
        [(true, 3u64 << 20, 1u64 << 20), (false, 3 << 20, 1 << 20), (true, 256 << 20, 4 << 20)]
    {
        let ctx = format!("verify {verify}, rounds of {round_bytes}");
        let opts = LoadOptions { verify_checksums: verify, exchange_round_bytes: round_bytes, ..load_opts() };
        let (stats, data) = load_both(&storage, 4, &opts, |_| replicated_request(&specs));
        // The rounds: as many on every rank, each sending at most the budget (plus one flag
        // byte per message).
        let opts = LoadOptions { exchange_reads: true, ..opts };
        let sent = run_ranks(4, |c| {
            let counting = CountingComm::new(c);
            load(replicated_request(&specs), &storage, &counting, &opts).unwrap();
            counting.all_to_all_sent.into_inner().unwrap()
        });
        let rounds = (total * 3 / 4).div_ceil(round_bytes);
        for (r, s) in sent.iter().enumerate() {
            assert!(s.len() as u64 >= rounds, "{ctx}, rank {r}: {} rounds", s.len());
            assert_eq!(s.len(), sent[0].len(), "{ctx}, rank {r}");
            assert!(s.iter().all(|&b| b <= round_bytes + 3), "{ctx}, rank {r}: {s:?}");
            assert_eq!(s.iter().sum::<u64>(), 3 * stats[r].bytes_read + 3 * s.len() as u64, "{ctx}, rank {r}");
        }
        for (r, d) in data.iter().enumerate() {
            for s in &specs {
                assert!(d[s.key] == s.truth, "{ctx}, rank {r}: {} differs from what was saved", s.key);
            }
        }
        // The group reads each stored byte once; each rank about a quarter of it and gets the
        // rest from its peers.
        assert_eq!(total_read(&stats), total, "{ctx}: {stats:?}");
        for (r, s) in stats.iter().enumerate() {
            assert_eq!(s.bytes_needed, total, "{ctx}, rank {r}");
            assert_eq!(s.bytes_read + s.bytes_received, total, "{ctx}, rank {r}");
            assert!(s.bytes_read.abs_diff(total / 4) <= piece, "{ctx}, rank {r}: read {} of {total}", s.bytes_read);
            assert_eq!(s.header_bytes_read > 0, verify, "{ctx}, rank {r}");
        }
    }
}

#[test]
fn a_single_rank_group_loads_alone() {
    let specs = replicated_specs();
    let storage = MemoryStorage::new();
    save_replicated(&storage, &specs, 2, 1 << 20);
    let opts = LoadOptions { exchange_reads: true, ..load_opts() };
    let res = load(replicated_request(&specs), &storage, &SoloComm, &opts).unwrap();
    for s in &specs {
        assert!(bytes_at(&res.state, s.key) == s.truth, "{}", s.key);
    }
    assert_eq!(res.stats.bytes_received, 0);
    assert_eq!(res.stats.bytes_read, res.stats.bytes_needed);
}

// ---------------------------------------------------------------------------------------------
// Resharding: TP=2 x DP=2 loading a TP=4 save.

fn iota(n: usize, base: f32) -> Vec<f32> {
    (0..n).map(|i| base + i as f32 * 0.25).collect()
}

struct Tp4 {
    qkv: Vec<f32>,
    proj: Vec<f32>,
    norm: Vec<f32>,
    exp_avg: Vec<f32>,
}

/// Saves column-parallel `qkv` (rows split), row-parallel `proj` (columns split), a replicated
/// `norm` and an optimizer state `exp_avg` as flattened ranges (distributed optimizer), at TP=4.
fn save_tp4(storage: &dyn Storage, block_size: u64) -> Tp4 {
    let v = Tp4 { qkv: iota(512 * 64, 0.0), proj: iota(64 * 512, 0.5), norm: iota(64, -1.0), exp_avg: iota(4096, 9.0) };
    let t = (f32_bytes(&v.qkv), f32_bytes(&v.proj), f32_bytes(&v.norm), f32_bytes(&v.exp_avg));
    let out = run_ranks(4, |c| {
        let r = c.rank() as u64;
        let part = |key, truth: &[u8], global: &[u64], off: &[u64], shape: &[u64]| {
            let data = box_bytes(truth, global, 4, off, shape);
            StateTree::Tensor(shard(key, DType::F32, global, off, shape, 0, None, TensorData::Owned(data)))
        };
        let flat = r * 1024..(r + 1) * 1024;
        let exp_avg = ShardedTensor::full(
            "exp_avg",
            DType::F32,
            &[4096],
            TensorData::Ref(&t.3[flat.start as usize * 4..flat.end as usize * 4]),
        )
        .with_flattened_range(flat);
        let tree = StateTree::map()
            .with("qkv", part("qkv", &t.0, &[512, 64], &[128 * r, 0], &[128, 64]))
            .with("proj", part("proj", &t.1, &[64, 512], &[0, 128 * r], &[64, 128]))
            .with(
                "norm",
                StateTree::Tensor(
                    ShardedTensor::full("norm", DType::F32, &[64], TensorData::Ref(&t.2)).with_replica_id(r as u32),
                ),
            )
            .with("exp_avg", StateTree::Tensor(exp_avg));
        save(tree, storage, c, &SaveOptions { block_size, threads: 2, ..Default::default() })
    });
    for (r, x) in out.into_iter().enumerate() {
        x.unwrap_or_else(|e| panic!("save, rank {r}: {e}"));
    }
    v
}

/// Rank `r` of TP=2 x DP=2 (`tp = r % 2`): its TP shards, the whole `norm`, and a flattened
/// range of `exp_avg` that partly overlaps its neighbours'.
fn tp2_dp2_request(r: usize) -> StateTree<'static> {
    let tp = (r % 2) as u64;
    let flat = r as u64 * 900..if r == 3 { 4096 } else { r as u64 * 900 + 1500 };
    let none = |key, global: &[u64], off: &[u64], shape: &[u64]| {
        StateTree::Tensor(shard(key, DType::F32, global, off, shape, 0, None, TensorData::None))
    };
    StateTree::map()
        .with("qkv", none("qkv", &[512, 64], &[256 * tp, 0], &[256, 64]))
        .with("proj", none("proj", &[64, 512], &[0, 256 * tp], &[64, 256]))
        .with("norm", none("norm", &[64], &[0], &[64]))
        .with(
            "exp_avg",
            StateTree::Tensor(
                ShardedTensor::full("exp_avg", DType::F32, &[4096], TensorData::None).with_flattened_range(flat),
            ),
        )
}

#[test]
fn tp2_dp2_loads_a_tp4_save_reading_each_byte_once() {
    let storage = MemoryStorage::new();
    let v = save_tp4(&storage, 4096);
    let total = open(&storage).map(Checkpoint::into_index).unwrap().tensor_bytes();
    for (verify, round_bytes) in [(true, 256u64 << 20), (false, 256 << 20), (true, 20_000), (false, 1)] {
        let ctx = format!("verify {verify}, rounds of {round_bytes}");
        let opts = LoadOptions { verify_checksums: verify, exchange_round_bytes: round_bytes, ..load_opts() };
        let (stats, data) = load_both(&storage, 4, &opts, tp2_dp2_request);
        for (r, d) in data.iter().enumerate() {
            let tp = (r % 2) as u64;
            let want_qkv = box_bytes(&f32_bytes(&v.qkv), &[512, 64], 4, &[256 * tp, 0], &[256, 64]);
            assert!(d["qkv"] == want_qkv, "{ctx}, rank {r}: qkv");
            let want_proj = box_bytes(&f32_bytes(&v.proj), &[64, 512], 4, &[0, 256 * tp], &[64, 256]);
            assert!(d["proj"] == want_proj, "{ctx}, rank {r}: proj");
            assert_eq!(f32s(&d["norm"]), v.norm, "{ctx}, rank {r}");
            let (s, e) = (r * 900, if r == 3 { 4096 } else { r * 900 + 1500 });
            assert_eq!(f32s(&d["exp_avg"]), v.exp_avg[s..e], "{ctx}, rank {r}");
        }
        // Together the ranks need every stored byte; the group reads each once.
        assert_eq!(total_read(&stats), total, "{ctx}: {stats:?}");
        for (r, s) in stats.iter().enumerate() {
            assert!(s.bytes_received > 0 && s.bytes_read < s.bytes_needed, "{ctx}, rank {r}: {s:?}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Random partial overlaps: the group reads exactly the union of what the ranks need.

#[test]
fn random_overlapping_flat_ranges_read_the_union_once() {
    for_each_seed("random_overlapping_flat_ranges_read_the_union_once", 12, |seed| {
        let mut rng = Rng::new(seed);
        let block = *rng.pick(&[16u64, 100, 4096]);
        // One chunk per tensor, all in one file, so the needed bytes are easy to work out.
        let lens: Vec<u64> = (0..1 + rng.below(3)).map(|_| rng.range(1, 3000)).collect();
        let truths: Vec<Vec<u8>> = lens.iter().map(|&n| rng.bytes(n as usize * 4)).collect();
        let storage = MemoryStorage::new();
        let mut tree = StateTree::map();
        for (i, t) in truths.iter().enumerate() {
            let key = format!("t{i}");
            tree.insert(
                key.clone(),
                StateTree::Tensor(ShardedTensor::full(&key, DType::F32, &[lens[i]], TensorData::Ref(t))),
            );
        }
        save(tree, &storage, &SoloComm, &SaveOptions { block_size: block, threads: 1, ..Default::default() }).unwrap();
        let world = rng.range(1, 5) as usize;
        // Each rank asks for random ranges of some tensors, sometimes twice under two paths.
        let mut asks: Vec<Vec<(usize, u64, u64)>> = vec![Vec::new(); world];
        for a in asks.iter_mut() {
            for (i, &n) in lens.iter().enumerate() {
                for _ in 0..rng.below(3) {
                    let s = rng.below(n);
                    a.push((i, s, rng.range(s + 1, n)));
                }
            }
        }
        let verify = rng.chance(1, 2);
        let opts = LoadOptions {
            verify_checksums: verify,
            exchange_round_bytes: *rng.pick(&[1u64, 5000, 256 << 20]),
            threads: rng.range(1, 3) as usize,
            ..LoadOptions::default()
        };
        let build = |r: usize| {
            let mut tree = StateTree::map();
            for (j, &(i, s, e)) in asks[r].iter().enumerate() {
                let t = ShardedTensor::full(format!("t{i}"), DType::F32, &[lens[i]], TensorData::None)
                    .with_flattened_range(s..e);
                tree.insert(format!("a{j}"), StateTree::Tensor(t));
            }
            tree
        };
        let (stats, data) = load_both(&storage, world, &opts, build);
        for (r, d) in data.iter().enumerate() {
            for (j, &(i, s, e)) in asks[r].iter().enumerate() {
                assert!(d[&format!("a{j}")] == truths[i][s as usize * 4..e as usize * 4], "rank {r}, ask {j}");
            }
        }
        // The union of the needs, in bytes: of the asked ranges, or of the blocks they touch.
        let mut union = 0;
        for (i, &n) in lens.iter().enumerate() {
            let (unit, len) = if verify { (block, n * 4) } else { (1, n * 4) };
            let mut needed = vec![false; len.div_ceil(unit) as usize];
            for &(_, s, e) in asks.iter().flatten().filter(|a| a.0 == i) {
                for u in (s * 4 / unit)..(e * 4).div_ceil(unit) {
                    needed[u as usize] = true;
                }
            }
            for (u, _) in needed.iter().enumerate().filter(|x| *x.1) {
                union += unit.min(len - u as u64 * unit);
            }
        }
        assert_eq!(total_read(&stats), union, "world {world}, verify {verify}: {stats:?}");
    });
}

// ---------------------------------------------------------------------------------------------
// Failures reach every rank.

/// A replicated state on local disk, with the index.
fn replicated_on_disk(tag: &str) -> (TempDir, Vec<Spec>, CheckpointIndex) {
    let dir = TempDir::new(tag);
    let mut rng = Rng::new(3);
    let specs: Vec<Spec> = ["a", "b", "c"]
        .into_iter()
        .map(|key| Spec { key, dtype: DType::F32, shape: vec![128, 256], truth: rng.bytes(128 * 256 * 4) })
        .collect();
    save_replicated(&LocalStorage::new(dir.path()), &specs, 4, 16 << 10);
    let index = open(&LocalStorage::new(dir.path())).map(Checkpoint::into_index).unwrap();
    (dir, specs, index)
}

#[test]
fn a_corrupt_chunk_fails_on_its_reader_and_on_every_peer() {
    let (dir, specs, index) = replicated_on_disk("exchange-corrupt");
    let storage = LocalStorage::new(dir.path());
    let c = &index.tensor("b").unwrap().chunks()[0];
    let file = index.files[c.file as usize].name.clone();
    let path = dir.join(&file);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[(c.byte_offset + 40_000) as usize] ^= 0x5a;
    std::fs::write(&path, bytes).unwrap();

    let opts = LoadOptions { exchange_reads: true, exchange_round_bytes: 100_000, ..load_opts() };
    let out = load_ranks(&storage, 4, &opts, |_| replicated_request(&specs));
    let readers: Vec<usize> = (0..4).filter(|&r| matches!(out[r], Err(Error::Corrupt { .. }))).collect();
    assert_eq!(readers.len(), 1, "exactly one rank reads the damaged block: {out:?}");
    for (r, x) in out.iter().enumerate() {
        match x {
            Err(Error::Corrupt { path, .. }) => assert!(path.to_string_lossy().ends_with(&file), "{path:?}"),
            Err(Error::PeerFailed { rank, message }) => {
                assert_eq!(*rank, readers[0], "rank {r}");
                assert!(message.contains("checksum mismatch"), "rank {r}: {message}");
            }
            other => panic!("rank {r}: expected an error, got {other:?}"),
        }
    }
    // Without verification the damaged byte arrives on every rank, as in a normal load.
    let opts = LoadOptions { verify_checksums: false, exchange_round_bytes: 100_000, ..load_opts() };
    let (_, data) = load_both(&storage, 4, &opts, |_| replicated_request(&specs));
    for d in &data {
        assert!(d["b"] != specs[1].truth && d["a"] == specs[0].truth);
    }
}

#[test]
fn a_missing_data_file_fails_every_rank() {
    let (dir, specs, index) = replicated_on_disk("exchange-missing");
    std::fs::remove_file(dir.join(&index.files[0].name)).unwrap();
    let opts = LoadOptions { exchange_reads: true, ..load_opts() };
    let out = load_ranks(&LocalStorage::new(dir.path()), 4, &opts, |_| replicated_request(&specs));
    assert!(out.iter().any(|x| matches!(x, Err(Error::NotFound { .. }))), "{out:?}");
    for (r, x) in out.iter().enumerate() {
        assert!(matches!(x, Err(Error::NotFound { .. } | Error::PeerFailed { .. })), "rank {r}: {x:?}");
    }
}

/// A factory whose build fails (before the strict-mode key exchange).
struct Broken;

impl TensorFactory for Broken {
    fn build<'a>(&self, key: &str, _: TensorData<'a>, _: &ReplicaId) -> Result<StateTree<'a>> {
        Err(Error::InvalidArgument { reason: format!("{key}: broken factory") })
    }
    fn merge<'a>(&self, _: &str, loaded: StateTree<'a>) -> Result<StateTree<'a>> {
        Ok(loaded)
    }
}

#[test]
fn a_planning_failure_on_one_rank_fails_every_rank() {
    let specs = replicated_specs();
    let storage = MemoryStorage::new();
    save_replicated(&storage, &specs, 1, 1 << 20);
    let broken = || ShardedTensorFactory {
        key: "f".into(),
        data: TensorData::None,
        replica_id: ReplicaId::main(),
        factory: Arc::new(Broken),
    };
    // Rank 2 asks for a key the checkpoint does not hold; then rank 2 has a broken factory,
    // with and without the strict-mode key exchange before the needs are announced.
    type Case = (StrictHandling, fn(&Result<(BTreeMap<String, Vec<u8>>, LoadStats)>) -> bool);
    let cases: [(bool, Case); 3] = [
        (false, (StrictHandling::AssumeOkUnexpected, |x| matches!(x, Err(Error::NotCovered { .. })))),
        (true, (StrictHandling::AssumeOkUnexpected, |x| matches!(x, Err(Error::InvalidArgument { .. })))),
        (true, (StrictHandling::RaiseAll, |x| matches!(x, Err(Error::InvalidArgument { .. })))),
    ];
    for (factory, (strict, own)) in cases {
        let opts = LoadOptions { exchange_reads: true, strict, ..load_opts() };
        let out = load_ranks(&storage, 4, &opts, |r| {
            let mut tree = replicated_request(&specs);
            if r == 2 && factory {
                tree.insert("f", StateTree::Factory(broken()));
            } else if r == 2 {
                tree.insert("x", StateTree::Tensor(ShardedTensor::full("nope", DType::F32, &[2], TensorData::None)));
            }
            tree
        });
        for (r, x) in out.iter().enumerate() {
            if r == 2 {
                assert!(own(x), "{strict:?}, rank 2: {x:?}");
            } else {
                assert!(matches!(x, Err(Error::PeerFailed { rank: 2, .. })), "{strict:?}, rank {r}: {x:?}");
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Without the exchange and without shared verification (or without verification): no
// collective, the usual reads.

/// A communicator whose collectives must not be called.
struct NoCollectives;

impl Communicator for NoCollectives {
    fn rank(&self) -> usize {
        1
    }
    fn world_size(&self) -> usize {
        4
    }
    fn all_gather(&self, _: &[u8]) -> Result<Vec<Vec<u8>>> {
        panic!("a default load made a collective")
    }
    fn broadcast(&self, _: &[u8], _: usize) -> Result<Vec<u8>> {
        panic!("a default load made a collective")
    }
    fn all_to_all(&self, _: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>> {
        panic!("a default load made a collective")
    }
}

#[test]
fn a_load_that_shares_nothing_makes_no_collective() {
    assert!(!LoadOptions::default().exchange_reads);
    let specs = replicated_specs();
    let storage = MemoryStorage::new();
    save_replicated(&storage, &specs, 2, 1 << 20);
    let total = open(&storage).map(Checkpoint::into_index).unwrap().tensor_bytes();
    for (verify, share) in [(true, false), (false, true)] {
        let opts = LoadOptions { verify_checksums: verify, share_verification: share, ..load_opts() };
        let res = load(replicated_request(&specs), &storage, &NoCollectives, &opts).unwrap();
        for s in &specs {
            assert!(bytes_at(&res.state, s.key) == s.truth, "{}", s.key);
        }
        let st = &res.stats;
        assert_eq!((st.bytes_needed, st.bytes_read, st.bytes_received), (total, total, 0));
        assert_eq!(st.header_bytes_read > 0, verify);
        assert!(st.reads > 0);
    }
}
