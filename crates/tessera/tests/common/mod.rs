//! Shared helpers of the integration tests: a tiny deterministic PRNG (splitmix64), a seed
//! loop that names the failing seed, temporary directories, in-process ranks with a timeout
//! (so a library bug that leaves a rank waiting fails the test instead of hanging it), and
//! reference geometry (extracting a box or a flattened range of a global tensor by brute force).
//! The object-store emulators (`s3`, `azure`, `gcs`, on `server`), the `files` helpers and the
//! `hostile` input builders live in the `tessera-testkit` crate (the CLI's and the benchmarks'
//! tests use them too); they are re-exported here, so the tests name them `common::s3::…`.
#![allow(dead_code, unused_imports)]

pub mod faults;
pub mod fixtures;
pub mod rss;

pub use tessera_testkit::{azure, files, gcs, hostile, s3, server};

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use tessera::comm::*;
use tessera::*;

/// splitmix64: tiny, deterministic, good enough for picking shapes and layouts.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed` (different seeds give unrelated streams).
    pub fn new(seed: u64) -> Self {
        let mut r = Rng(seed.wrapping_mul(0x2545_f491_4f6c_dd1d) ^ 0x9e37_79b9_7f4a_7c15);
        r.next_u64();
        r
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (0 when `n == 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next_u64() % n
        }
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }

    /// Uniform index into a collection of `n` elements.
    pub fn index(&mut self, n: usize) -> usize {
        self.below(n as u64) as usize
    }

    /// True with probability `num / den`.
    pub fn chance(&mut self, num: u64, den: u64) -> bool {
        self.below(den) < num
    }

    /// One element of `xs`.
    pub fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.index(xs.len())]
    }

    /// Random bytes.
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(n + 8);
        while out.len() < n {
            out.extend_from_slice(&self.next_u64().to_le_bytes());
        }
        out.truncate(n);
        out
    }

    /// Fisher-Yates shuffle.
    pub fn shuffle<T>(&mut self, xs: &mut [T]) {
        for i in (1..xs.len()).rev() {
            let j = self.index(i + 1);
            xs.swap(i, j);
        }
    }
}

/// The seeds a property test runs: `TESSERA_SEED=N` runs only seed N (to reproduce a failure),
/// `TESSERA_SEEDS=K` runs K seeds instead of `default_count`.
pub fn seeds(default_count: u64) -> Vec<u64> {
    if let Some(s) = std::env::var("TESSERA_SEED").ok().and_then(|s| s.parse().ok()) {
        return vec![s];
    }
    let n = std::env::var("TESSERA_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(default_count);
    (0..n).collect()
}

/// Runs `case(seed)` for every seed of [`seeds`]; a failure panics with the seed and how to
/// reproduce it.
pub fn for_each_seed(test: &str, default_count: u64, case: impl Fn(u64)) {
    for seed in seeds(default_count) {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| case(seed)));
        if let Err(payload) = r {
            let msg = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "(non-string panic)".into());
            panic!("{test}: seed {seed} failed (reproduce with TESSERA_SEED={seed}): {msg}");
        }
    }
}

/// A fresh directory under the system temp dir, removed on drop.
#[derive(Debug)]
pub struct TempDir {
    path: PathBuf,
}

impl TempDir {
    /// A new, not yet existing, unique directory path (created by the first write).
    pub fn new(tag: &str) -> Self {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("tessera-test-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        TempDir { path }
    }

    /// A new directory that exists (empty).
    pub fn created(tag: &str) -> Self {
        let d = Self::new(tag);
        std::fs::create_dir_all(&d.path).unwrap();
        d
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A path inside.
    pub fn join(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// Like [`InProcessComm::run`], but a collective that waits more than 20 s fails instead of
/// hanging the test for ten minutes.
pub fn run_ranks<T: Send>(world: usize, f: impl Fn(&InProcessComm) -> T + Sync) -> Vec<T> {
    let comms = InProcessComm::group_with_timeout(world, Duration::from_secs(20));
    std::thread::scope(|s| {
        let handles: Vec<_> = comms.iter().map(|c| s.spawn(|| f(c))).collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
    })
}

/// A rank's communicator that counts what goes through it.
pub struct CountingComm<'c> {
    inner: &'c InProcessComm,
    /// Collectives called (all-gathers, broadcasts, all-to-alls).
    pub calls: AtomicUsize,
    /// Bytes this rank contributed to all-gathers.
    pub gathered: AtomicU64,
    /// For each all-to-all, the bytes this rank sent to the other ranks.
    pub all_to_all_sent: Mutex<Vec<u64>>,
}

impl<'c> CountingComm<'c> {
    pub fn new(inner: &'c InProcessComm) -> Self {
        CountingComm {
            inner,
            calls: AtomicUsize::new(0),
            gathered: AtomicU64::new(0),
            all_to_all_sent: Mutex::default(),
        }
    }
}

impl Communicator for CountingComm<'_> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.gathered.fetch_add(data.len() as u64, Ordering::Relaxed);
        self.inner.all_gather(data)
    }
    fn broadcast(&self, data: &[u8], root: usize) -> Result<Vec<u8>> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.inner.broadcast(data, root)
    }
    fn all_to_all(&self, send: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let me = self.rank();
        let bytes = send.iter().enumerate().filter(|(r, _)| *r != me).map(|(_, m)| m.len() as u64).sum();
        self.all_to_all_sent.lock().unwrap().push(bytes);
        self.inner.all_to_all(send)
    }
}

/// Save options with a small checksum block, so multi-block chunks are common.
pub fn small_blocks(block_size: u64) -> SaveOptions {
    SaveOptions { block_size, threads: 2, ..Default::default() }
}

/// Load options with verification on and two threads.
pub fn load_opts() -> LoadOptions {
    LoadOptions { threads: 2, ..Default::default() }
}

/// Number of elements of a shape (1 for a scalar).
/// The bytes of a test tensor: element i holds `seed * 1000 + i`, as f32, bf16 (f32's top
/// half) or i64.
pub fn seeded_truth(dtype: DType, shape: &[u64], seed: u64) -> Vec<u8> {
    let n: u64 = shape.iter().product();
    (0..n)
        .flat_map(|i| {
            let x = (seed * 1000 + i) as f32;
            match dtype {
                DType::F32 => x.to_le_bytes().to_vec(),
                DType::BF16 => ((x.to_bits() >> 16) as u16).to_le_bytes().to_vec(),
                DType::I64 => ((seed * 1000 + i) as i64).to_le_bytes().to_vec(),
                other => panic!("{other:?}"),
            }
        })
        .collect()
}

pub fn numel(shape: &[u64]) -> u64 {
    shape.iter().product()
}

/// Calls `f(global_linear_index)` for every element of the box, in the box's row-major order.
pub fn for_each_in_box(global: &[u64], off: &[u64], shape: &[u64], f: &mut dyn FnMut(u64)) {
    let n = shape.len();
    if numel(shape) == 0 {
        return;
    }
    let mut idx = vec![0u64; n];
    loop {
        let mut lin = 0u64;
        for d in 0..n {
            lin = lin * global[d] + off[d] + idx[d];
        }
        f(lin);
        let mut d = n;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

/// The bytes of the box (`off`, `shape`) of a global tensor, row-major, brute force.
pub fn box_bytes(truth: &[u8], global: &[u64], esize: usize, off: &[u64], shape: &[u64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(numel(shape) as usize * esize);
    for_each_in_box(global, off, shape, &mut |lin| {
        let at = lin as usize * esize;
        out.extend_from_slice(&truth[at..at + esize]);
    });
    out
}

/// The bytes a shard holds: its box, optionally restricted to a range of the box's flattening.
pub fn shard_bytes(
    truth: &[u8],
    global: &[u64],
    esize: usize,
    off: &[u64],
    shape: &[u64],
    flat: Option<&Range<u64>>,
) -> Vec<u8> {
    let b = box_bytes(truth, global, esize, off, shape);
    match flat {
        Some(r) => b[r.start as usize * esize..r.end as usize * esize].to_vec(),
        None => b,
    }
}

/// What a (loaded) sharded tensor must hold, given the global truth of its key.
pub fn expected_for(t: &ShardedTensor<'_>, truth: &[u8], global: &[u64]) -> Vec<u8> {
    shard_bytes(truth, global, t.dtype.size(), &t.global_offset, &t.box_shape(), t.flattened_range.as_ref())
}

/// A sharded tensor built field by field.
#[allow(clippy::too_many_arguments)]
pub fn shard<'a>(
    key: &str,
    dtype: DType,
    global: &[u64],
    off: &[u64],
    box_shape: &[u64],
    prepend: usize,
    flat: Option<Range<u64>>,
    data: TensorData<'a>,
) -> ShardedTensor<'a> {
    ShardedTensor {
        key: key.to_string(),
        data,
        dtype,
        local_shape: box_shape[prepend..].to_vec(),
        global_shape: global.to_vec(),
        global_offset: off.to_vec(),
        axis_fragmentations: None,
        replica_id: ReplicaId::main(),
        prepend_axis_num: prepend,
        allow_shape_mismatch: false,
        flattened_range: flat,
    }
}

/// Little-endian bytes of f32 values.
pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// f32 values from little-endian bytes.
pub fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

/// Little-endian bytes of i64 values.
pub fn i64_bytes(v: &[i64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// bf16 bytes (truncation of f32; exact for the values the tests use).
pub fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| ((x.to_bits() >> 16) as u16).to_le_bytes()).collect()
}

/// A tree of plain values (maps, lists, `Value` leaves) as one [`Value`], for comparisons.
/// Other leaves make it `None`.
pub fn tree_value(tree: &StateTree<'_>) -> Option<Value> {
    Some(match tree {
        StateTree::Map(m) => {
            let mut entries = Vec::new();
            for (k, v) in m {
                entries.push((k.clone(), tree_value(v)?));
            }
            Value::Map(entries)
        }
        StateTree::List(l) => Value::List(l.iter().map(tree_value).collect::<Option<Vec<_>>>()?),
        StateTree::Value(v) => v.clone(),
        _ => return None,
    })
}

/// Names of the objects of a storage, sorted.
pub fn names(storage: &dyn Storage) -> Vec<String> {
    let mut n = storage.list().unwrap();
    n.sort();
    n
}

/// Names of tessera data files in a storage, sorted.
pub fn data_files(storage: &dyn Storage) -> Vec<String> {
    names(storage).into_iter().filter(|n| n.ends_with(".safetensors")).collect()
}

/// The tensor leaf at a dotted path of a loaded state.
pub fn tensor_at<'s, 'a>(state: &'s StateTree<'a>, dotted: &str) -> &'s ShardedTensor<'a> {
    state
        .get_dotted(dotted)
        .and_then(StateTree::as_tensor)
        .unwrap_or_else(|| panic!("no tensor at {dotted:?} in {state:?}"))
}

/// The bytes of the tensor leaf at a dotted path of a loaded state.
pub fn bytes_at<'s>(state: &'s StateTree<'_>, dotted: &str) -> &'s [u8] {
    tensor_at(state, dotted).data.bytes().unwrap_or_else(|| panic!("tensor at {dotted:?} has no data"))
}

/// CRC-32C (Castagnoli), bit by bit: the tests' own reference for the checksums tessera writes.
pub fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 != 0 { (crc >> 1) ^ 0x82f6_3b78 } else { crc >> 1 };
        }
    }
    !crc
}

/// A rank's communicator whose `fail`-th collective (counted from 0 in `count`, which several
/// communicators of one rank may share) fails on this rank, after this rank took part in it:
/// its peers go on, as after a failure only this rank saw.
pub struct FailingComm {
    pub inner: InProcessComm,
    pub count: std::sync::Arc<AtomicUsize>,
    pub fail: Option<usize>,
}

impl FailingComm {
    pub fn new(inner: &InProcessComm, fail: Option<usize>) -> Self {
        FailingComm { inner: inner.clone(), count: Default::default(), fail }
    }

    fn check<T>(&self, what: &str, r: Result<T>) -> Result<T> {
        let n = self.count.fetch_add(1, Ordering::SeqCst);
        if self.fail == Some(n) {
            return Err(Error::Comm { reason: format!("injected fault in {what} (collective {n})") });
        }
        r
    }

    /// Collectives this rank made.
    pub fn calls(&self) -> usize {
        self.count.load(Ordering::SeqCst)
    }
}

impl Communicator for FailingComm {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        let r = self.inner.all_gather(data);
        self.check("all_gather", r)
    }
    fn broadcast(&self, data: &[u8], root: usize) -> Result<Vec<u8>> {
        let r = self.inner.broadcast(data, root);
        self.check("broadcast", r)
    }
    fn all_to_all(&self, send: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>> {
        let r = self.inner.all_to_all(send);
        self.check("all_to_all", r)
    }
}

/// The copy of its `common.pt` a committed `torch_dist` checkpoint tessera wrote keeps
/// (FORMAT.md, "Writing torch_dist"): named by the save id its `.metadata` records
/// (`storage_meta.save_id` = `<16 hex>-common-<8 hex>`), found in the pickle's bytes.
pub fn committed_common_copy(storage: &dyn Storage) -> Option<String> {
    let meta = storage.read(".metadata").ok()?;
    let at = meta.windows(8).position(|w| w == b"-common-")?;
    let id = std::str::from_utf8(meta.get(at.checked_sub(16)?..at)?).ok()?;
    Some(format!(".tessera-common-{id}.pt"))
}

/// The name of the test `name` of the module `module` (its `module_path!()`) as this binary's
/// harness knows it: `hostile_memory::name`, for running it alone with `--exact`.
pub fn test_path(module: &str, name: &str) -> String {
    match module.split_once("::") {
        Some((_, m)) => format!("{m}::{name}"),
        None => name.to_string(),
    }
}

/// A command that runs the test `path` (see [`test_path`]) of this test binary alone in a child
/// process: exactly that test, ignored or not, its output not captured, on one thread. The
/// callers add what the child needs (environment, pipes).
pub fn rerun_alone(path: &str) -> std::process::Command {
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args([path, "--exact", "--include-ignored", "--nocapture", "--test-threads=1"]);
    cmd
}

/// For a test that changes the process environment (`std::env::set_var`), which every other
/// test of this binary reads from its own threads: runs the test `name` of `module` alone in a
/// child process of this binary and checks that it ran and passed. Returns `true` in that
/// child (go on with the test), `false` in the parent (the child has run it: return).
pub fn in_own_process(module: &str, name: &str) -> bool {
    const MARK: &str = "TESSERA_TEST_OWN_PROCESS";
    let path = test_path(module, name);
    if std::env::var(MARK).is_ok_and(|v| v == path) {
        return true;
    }
    let out = rerun_alone(&path).env(MARK, &path).stdin(std::process::Stdio::null()).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("test result: ok. 1 passed"),
        "{path} in its own process ({}): {stdout}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    false
}
