//! The object-store backend under faults, and its request counts: every test talks to moto
//! through the fault-injecting, request-counting proxy of `crate::common::faults`, so the real client
//! stack (signing, retries with backoff, timeouts) runs.
//!
//! - Saves and resharded loads survive throttling (503 Slow Down) and stalls (client timeouts):
//!   same bytes, committed once, nothing half-committed.
//! - A commit that can never be written fails on every rank and leaves no checkpoint; a commit
//!   whose response is lost is recognised by the read-back.
//! - A resharded load issues exactly the GETs its plan says, and downloads what it needs.
//! - `ObjectStorage::request_counts` agrees with what went over the wire.
//! - Ranks that each need half of every row verify the blocks together and download what they
//!   need, not the whole blocks.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::common::faults::*;
use crate::common::*;
use tessera::__plan::load::{plan_reads, plan_request, ReadTuning, Request};
use tessera::comm::*;
use tessera::index::*;
use tessera::olmo::*;
use tessera::storage::*;
use tessera::tools::*;
use tessera::torch_dist::*;
use tessera::*;

/// These tests move tens of MiB through one moto server: one at a time keeps each well inside
/// the short client timeouts of the stall tests.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

const SAVE_WORLD: usize = 4;
const LOAD_WORLD: usize = 3;
const COLS: u64 = 1024;
const EMB: [u64; 2] = [512, 512];
const EXP: [u64; 2] = [128, 96];
/// Where the flat ranges of each TP half of "exp_avg" split between the two DP ranks.
const EXP_SPLIT: u64 = 2500;

/// The global truth of one checkpoint.
struct Truth {
    rows: u64,
    w: Vec<u8>,
    emb: Vec<u8>,
    exp: Vec<u8>,
    objs: Vec<Vec<u8>>,
}

impl Truth {
    /// "w" f32 [4·rows_per_rank, 1024] (4 KiB rows), "emb" f32 [512, 512], "exp_avg" f32
    /// [128, 96], one object shard per save rank.
    fn new(seed: u64, rows_per_rank: u64) -> Truth {
        let mut rng = Rng::new(seed);
        let rows = rows_per_rank * SAVE_WORLD as u64;
        Truth {
            rows,
            w: rng.bytes((rows * COLS * 4) as usize),
            emb: rng.bytes((numel(&EMB) * 4) as usize),
            exp: rng.bytes((numel(&EXP) * 4) as usize),
            objs: (0..SAVE_WORLD).map(|r| rng.bytes(100 + 37 * r)).collect(),
        }
    }

    fn w_shape(&self) -> [u64; 2] {
        [self.rows, COLS]
    }

    fn of(&self, key: &str) -> (&[u8], Vec<u64>) {
        match key {
            "w" => (&self.w, self.w_shape().to_vec()),
            "emb" => (&self.emb, EMB.to_vec()),
            "exp_avg" => (&self.exp, EXP.to_vec()),
            _ => panic!("no tensor {key}"),
        }
    }
}

/// Save rank `r` of 4: "w" split by rows (TP), "emb" replicated on every rank (written by one
/// of them), "exp_avg" TP 2 × DP 2 flat ranges of each TP box (distributed optimizer), "rng"
/// one object shard per rank, "step" a common value.
fn save_tree(r: usize, t: &Truth) -> StateTree<'_> {
    let rows = t.rows / SAVE_WORLD as u64;
    let row_bytes = (COLS * 4) as usize;
    let w = &t.w[r * rows as usize * row_bytes..(r + 1) * rows as usize * row_bytes];
    let (tp, dp) = (r as u64 / 2, r % 2);
    let half = [EXP[0] / 2, EXP[1]];
    let flat = if dp == 0 { 0..EXP_SPLIT } else { EXP_SPLIT..numel(&half) };
    let exp = shard_bytes(&t.exp, &EXP, 4, &[tp * half[0], 0], &half, Some(&flat));
    let mut emb = ShardedTensor::full("emb", DType::F32, &EMB, TensorData::Ref(&t.emb));
    emb.replica_id = ReplicaId::from(r as u32);
    StateTree::map()
        .with(
            "w",
            StateTree::Tensor(shard(
                "w",
                DType::F32,
                &t.w_shape(),
                &[r as u64 * rows, 0],
                &[rows, COLS],
                0,
                None,
                TensorData::Ref(w),
            )),
        )
        .with("emb", StateTree::Tensor(emb))
        .with(
            "exp_avg",
            StateTree::Tensor(shard(
                "exp_avg",
                DType::F32,
                &EXP,
                &[tp * half[0], 0],
                &half,
                0,
                Some(flat),
                TensorData::Owned(exp),
            )),
        )
        .with("rng", StateTree::Object(ShardedObject::new("rng", t.objs[r].clone(), &[4], &[r as u64])))
        .with("step", StateTree::Value(Value::Int(7)))
}

/// Load rank `k` of 3 (a different layout): "w" split by rows in 3, "emb" whole, "exp_avg" as a
/// third of the flattening of the whole tensor, every "rng" shard.
fn load_tree(k: usize, t: &Truth) -> StateTree<'static> {
    let cut = |n: u64, i: usize| n * i as u64 / LOAD_WORLD as u64;
    let (r0, r1) = (cut(t.rows, k), cut(t.rows, k + 1));
    let (f0, f1) = (cut(numel(&EXP), k), cut(numel(&EXP), k + 1));
    let mut tree = StateTree::map()
        .with(
            "w",
            StateTree::Tensor(shard(
                "w",
                DType::F32,
                &t.w_shape(),
                &[r0, 0],
                &[r1 - r0, COLS],
                0,
                None,
                TensorData::None,
            )),
        )
        .with("emb", StateTree::Tensor(ShardedTensor::full("emb", DType::F32, &EMB, TensorData::None)))
        .with(
            "exp_avg",
            StateTree::Tensor(shard("exp_avg", DType::F32, &EXP, &[0, 0], &EXP, 0, Some(f0..f1), TensorData::None)),
        );
    for i in 0..SAVE_WORLD as u64 {
        let mut o = ShardedObject::new("rng", Vec::new(), &[4], &[i]);
        o.data = None;
        tree.insert(format!("rng{i}"), StateTree::Object(o));
    }
    tree
}

/// Checks every leaf of a loaded `load_tree` against the truth.
fn check_loaded(state: &StateTree<'_>, t: &Truth) {
    for key in ["w", "emb", "exp_avg"] {
        let st = tensor_at(state, key);
        let (truth, global) = t.of(key);
        assert!(st.data.bytes().unwrap() == expected_for(st, truth, &global).as_slice(), "{key} differs");
    }
    for i in 0..SAVE_WORLD {
        match state.get_dotted(&format!("rng{i}")) {
            Some(StateTree::Object(o)) => assert_eq!(o.data.as_deref(), Some(t.objs[i].as_slice()), "rng{i}"),
            other => panic!("rng{i}: {other:?}"),
        }
    }
    assert!(matches!(state.get_dotted("step"), Some(StateTree::Value(Value::Int(7)))), "step");
}

/// Saves `t` with 4 in-process ranks sharing `storage`; every rank's outcome.
fn save_all(storage: &dyn Storage, t: &Truth) -> Vec<Result<SaveReport>> {
    run_ranks(SAVE_WORLD, |c| {
        save(save_tree(c.rank(), t), storage, c, &SaveOptions { threads: 2, ..Default::default() })
    })
}

/// Loads `load_tree` with 3 in-process ranks and checks every byte.
fn load_all_and_check(storage: &dyn Storage, t: &Truth) -> Vec<LoadStats> {
    run_ranks(LOAD_WORLD, |c| {
        let loaded = load(load_tree(c.rank(), t), storage, c, &load_opts()).unwrap();
        check_loaded(&loaded.state, t);
        loaded.stats
    })
}

/// The committed checkpoint is whole: it verifies, and its data files are exactly those in the
/// location (nothing left over from retried or failed requests).
fn assert_committed_whole(storage: &dyn Storage) {
    verify(storage, 2).unwrap();
    let index = open(storage).map(Checkpoint::into_index).unwrap();
    let mut referenced: Vec<String> = index.files.iter().map(|f| f.name.clone()).collect();
    referenced.sort();
    assert_eq!(data_files(storage), referenced);
    assert!(names(storage).iter().all(|n| n == INDEX_FILE || n.ends_with(".safetensors")), "{:?}", names(storage));
}

/// The store behind a test: moto (S3) or Azurite (Azure), each with the test's small parts.
#[derive(Debug, Clone, Copy)]
enum Store {
    S3,
    Azure,
    /// No fault proxy (the emulator sits behind the harness's adapter).
    Gcs,
}

impl Store {
    fn proxy(self, plan: FaultPlan) -> FaultProxy {
        match self {
            Store::S3 => FaultProxy::start(plan),
            Store::Azure => FaultProxy::start_azure(plan),
            Store::Gcs => panic!("no fault proxy in front of GCS"),
        }
    }

    fn fresh_url(self, tag: &str) -> String {
        match self {
            Store::S3 => s3::fresh_url(tag),
            Store::Azure => azure::fresh_url(tag),
            Store::Gcs => gcs::fresh_url(tag),
        }
    }

    fn options(self) -> ObjectStoreOptions {
        match self {
            Store::S3 => s3::test_options(),
            Store::Azure => azure::test_options(),
            Store::Gcs => gcs::test_options(),
        }
    }
}

/// Options through `proxy` with a client timeout (and the test's small parts).
fn opts_via(proxy: &FaultProxy, timeout: Duration, max_retries: usize) -> ObjectStoreOptions {
    opts_via_to(Store::S3, proxy, timeout, max_retries)
}

/// [`opts_via`] for `store`.
fn opts_via_to(store: Store, proxy: &FaultProxy, timeout: Duration, max_retries: usize) -> ObjectStoreOptions {
    proxy.options(ObjectStoreOptions { timeout, max_retries, ..store.options() })
}

/// For every counter of `rc`, the requests the proxy relayed to the client: each logical
/// request is one delivered attempt, whatever faults its earlier attempts met.
fn delivered_counts(c: &Counts) -> RequestCounts {
    RequestCounts {
        gets: c.delivered(Kind::Get) + c.delivered(Kind::GetRange),
        bytes_downloaded: c.bytes_down,
        heads: c.delivered(Kind::Head),
        puts: c.delivered(Kind::Put),
        parts: c.delivered(Kind::PutPart),
        bytes_uploaded: c.bytes_up,
        lists: c.delivered(Kind::List),
        deletes: c.delivered(Kind::Delete),
    }
}

fn sum(a: RequestCounts, b: RequestCounts) -> RequestCounts {
    RequestCounts {
        gets: a.gets + b.gets,
        bytes_downloaded: a.bytes_downloaded + b.bytes_downloaded,
        heads: a.heads + b.heads,
        puts: a.puts + b.puts,
        parts: a.parts + b.parts,
        bytes_uploaded: a.bytes_uploaded + b.bytes_uploaded,
        lists: a.lists + b.lists,
        deletes: a.deletes + b.deletes,
    }
}

fn save_and_resharded_load_succeed_through_throttling_and_stalls_on(store: Store) {
    let _serial = serial();
    // ~12 MiB per rank's data file: 3 parts of 5 MiB.
    let t = Truth::new(1, 2816);
    // A fifth of the requests throttled; every 7th GET/HEAD/part PUT stalls, 3 times in all.
    let proxy = store.proxy(FaultPlan::random(11, 20, 7, 3));
    let url = store.fresh_url("faults");
    let saving = proxy.storage(&url, opts_via_to(store, &proxy, Duration::from_secs(2), 10));
    let reports = save_all(&saving, &t);
    for (r, rep) in reports.iter().enumerate() {
        let rep = rep.as_ref().unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert!(rep.bytes_written > 10 << 20, "rank {r}: {rep:?}");
    }
    let save_counts = proxy.counts();
    assert!(save_counts.n(Kind::PutPart) >= (3 * SAVE_WORLD) as u64, "{save_counts:?}");

    let loading = proxy.storage(&url, opts_via_to(store, &proxy, Duration::from_secs(2), 10));
    load_all_and_check(&loading, &t);

    let c = proxy.counts();
    assert!(c.by_fault.get(&Fault::SlowDown).copied().unwrap_or(0) > 0, "no 503 injected: {c:?}");
    assert_eq!(c.by_fault.get(&Fault::Stall).copied().unwrap_or(0), 3, "stalls: {c:?}");
    assert!(c.faulted(Kind::PutPart) + c.faulted(Kind::GetRange) > 0, "{c:?}");
    // Each faulted attempt was retried: what the client counted is what was delivered (a
    // timeout nobody injected would add an undelivered attempt, hence ≥).
    let rc = sum(saving.request_counts(), loading.request_counts());
    let d = delivered_counts(&c);
    for (what, logical, delivered, all) in [
        ("gets", rc.gets, d.gets, c.gets()),
        ("heads", rc.heads, d.heads, c.n(Kind::Head)),
        ("puts", rc.puts, d.puts, c.n(Kind::Put)),
        ("parts", rc.parts, d.parts, c.n(Kind::PutPart)),
    ] {
        assert!(
            all >= delivered && delivered >= logical,
            "{what}: {logical} logical, {delivered} delivered, {all} sent"
        );
    }

    let direct = ObjectStorage::open(&url, store.options()).unwrap();
    assert_committed_whole(&direct);
    assert_eq!(open(&direct).and_then(|c| c.read_tensors(None)).unwrap()["w"].data, t.w);
}

#[test]
fn save_and_resharded_load_succeed_through_throttling_and_stalls() {
    save_and_resharded_load_succeed_through_throttling_and_stalls_on(Store::S3);
}

#[test]
fn save_and_resharded_load_succeed_through_throttling_and_stalls_on_azure() {
    save_and_resharded_load_succeed_through_throttling_and_stalls_on(Store::Azure);
}

fn is_index_put(r: &Logged) -> bool {
    r.kind == Kind::Put && r.name() == INDEX_FILE
}

fn a_commit_that_cannot_be_written_fails_on_every_rank_and_commits_nothing_on(store: Store) {
    let _serial = serial();
    let t = Truth::new(2, 64);
    // Every PUT of the index is throttled, every retry too; everything else goes through.
    let proxy = store.proxy(FaultPlan::always(Fault::SlowDown, is_index_put));
    let url = store.fresh_url("no-commit");
    let storage = proxy.storage(&url, opts_via_to(store, &proxy, Duration::from_secs(30), 2));
    let outcomes = save_all(&storage, &t);
    for (r, o) in outcomes.iter().enumerate() {
        assert!(o.is_err(), "rank {r} reports success: {o:?}");
    }
    assert!(matches!(outcomes[0], Err(Error::Io { .. })), "rank 0 (the committer): {:?}", outcomes[0]);
    for o in &outcomes[1..] {
        assert!(matches!(o, Err(Error::PeerFailed { rank: 0, .. })), "{o:?}");
    }
    // The put was tried 1 + max_retries times and never reached the store.
    let index_puts: Vec<Logged> = proxy.log().into_iter().filter(is_index_put).collect();
    assert_eq!(index_puts.len(), 3, "{index_puts:?}");
    assert!(index_puts.iter().all(|r| r.fault == Some(Fault::SlowDown) && r.upstream_status == 0));

    // Nothing committed, and each rank removed the data file it wrote: nothing is left.
    let direct = ObjectStorage::open(&url, store.options()).unwrap();
    assert!(
        matches!(open(&direct).map(Checkpoint::into_index), Err(Error::NotFound { .. })),
        "{:?}",
        open(&direct).map(Checkpoint::into_index)
    );
    assert_eq!(names(&direct), Vec::<String>::new());
    assert_eq!(gc(&direct, &GcOptions::default()).unwrap().removed, Vec::<String>::new());
}

#[test]
fn a_commit_that_cannot_be_written_fails_on_every_rank_and_commits_nothing() {
    a_commit_that_cannot_be_written_fails_on_every_rank_and_commits_nothing_on(Store::S3);
}

#[test]
fn a_commit_that_cannot_be_written_fails_on_every_rank_and_commits_nothing_on_azure() {
    a_commit_that_cannot_be_written_fails_on_every_rank_and_commits_nothing_on(Store::Azure);
}

fn a_commit_whose_response_is_lost_is_recognised_by_its_read_back_on(store: Store) {
    let _serial = serial();
    let t = Truth::new(3, 64);
    // The index reaches the store, but the client hears 503 and retries the conditional put,
    // which the store then refuses (the index exists): the read-back finds our own index.
    let proxy = store.proxy(FaultPlan::first(1, Fault::LostResponse, is_index_put));
    let url = store.fresh_url("lost-commit");
    let storage = proxy.storage(&url, opts_via_to(store, &proxy, Duration::from_secs(30), 10));
    for (r, o) in save_all(&storage, &t).into_iter().enumerate() {
        o.unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
    let index_puts: Vec<Logged> = proxy.log().into_iter().filter(is_index_put).collect();
    assert_eq!(index_puts.len(), 2, "{index_puts:?}");
    assert_eq!(index_puts[0].fault, Some(Fault::LostResponse));
    assert!(matches!(index_puts[0].upstream_status, 200 | 201), "the store took it: {:?}", index_puts[0]);
    assert!(index_puts.iter().all(|r| r.conditional), "commits are conditional puts");
    assert!(matches!(index_puts[1].status, 409 | 412), "the retry is refused: {:?}", index_puts[1]);
    let direct = ObjectStorage::open(&url, store.options()).unwrap();
    assert_committed_whole(&direct);
    load_all_and_check(&direct, &t);
}

#[test]
fn a_commit_whose_response_is_lost_is_recognised_by_its_read_back() {
    a_commit_whose_response_is_lost_is_recognised_by_its_read_back_on(Store::S3);
}

#[test]
fn a_commit_whose_response_is_lost_is_recognised_by_its_read_back_on_azure() {
    a_commit_whose_response_is_lost_is_recognised_by_its_read_back_on(Store::Azure);
}

/// A commit PUT that reaches the store but whose answer never comes: the client times out, and
/// object_store does not retry a conditional put after a timeout (it is not idempotent). The
/// save's verdict must match the store: `ObjectStorage::put_if_absent` reads the object back
/// after a failed put and finds its own index, so the save reports the commit it made.
#[test]
fn a_commit_that_times_out_after_reaching_the_store_reports_what_the_store_holds() {
    let _serial = serial();
    let t = Truth::new(4, 64);
    let proxy = FaultProxy::start(FaultPlan::first(1, Fault::ForwardThenStall, is_index_put));
    let url = s3::fresh_url("stalled-commit");
    let storage = proxy.storage(&url, opts_via(&proxy, Duration::from_secs(2), 10));
    let outcomes = save_all(&storage, &t);
    let direct = ObjectStorage::open(&url, s3::test_options()).unwrap();
    let committed = open(&direct).map(Checkpoint::into_index).is_ok();
    for (r, o) in outcomes.iter().enumerate() {
        assert_eq!(o.is_ok(), committed, "rank {r}: {o:?}, but the store holds a committed index: {committed}");
    }
}

#[test]
fn async_save_through_throttling_and_a_stall_commits() {
    let _serial = serial();
    // ~6 MiB per rank: 2 parts each.
    let t = Truth::new(5, 1536);
    let proxy = FaultProxy::start(FaultPlan::random(21, 20, 5, 1));
    let url = s3::fresh_url("async-faults");
    let storage: Arc<dyn Storage> = Arc::new(proxy.storage(&url, opts_via(&proxy, Duration::from_secs(2), 10)));
    let commit = InProcessComm::group_with_timeout(SAVE_WORLD, Duration::from_secs(20));
    let commit: Vec<Mutex<Option<InProcessComm>>> = commit.into_iter().map(|c| Mutex::new(Some(c))).collect();
    let reports = run_ranks(SAVE_WORLD, |c| {
        let k = commit[c.rank()].lock().unwrap().take().unwrap();
        let mut saver = AsyncSaver::new(StagingPool::with_buffer_size(8 << 20, 1 << 20).unwrap(), Arc::new(k));
        let opts = SaveOptions { threads: 2, ..Default::default() };
        let pending = saver.save(save_tree(c.rank(), &t), storage.clone(), c, &opts).unwrap();
        pending.finalize()
    });
    for (r, rep) in reports.iter().enumerate() {
        assert!(rep.is_ok(), "rank {r}: {rep:?}");
    }
    let c = proxy.counts();
    assert!(c.by_fault.get(&Fault::SlowDown).copied().unwrap_or(0) > 0, "no 503 injected: {c:?}");
    assert_eq!(c.by_fault.get(&Fault::Stall).copied().unwrap_or(0), 1, "{c:?}");
    assert!(c.n(Kind::PutPart) >= 2 * SAVE_WORLD as u64, "{c:?}");
    let direct = ObjectStorage::open(&url, s3::test_options()).unwrap();
    assert_committed_whole(&direct);
    load_all_and_check(&direct, &t);
}

/// What a load of `tree` reads from data files, by the plan (`plan_request` + `plan_reads`
/// with the default tuning, as `load` does): every ranged read `(object, start, end)`, sorted;
/// the number of reads of tensor data; the data files they touch; the stored chunks they
/// touch.
struct Planned {
    gets: Vec<(String, u64, u64)>,
    data_reads: usize,
    files: Vec<u32>,
    chunks: usize,
}

fn planned(index: &CheckpointIndex, tree: &StateTree<'_>, verify: bool) -> Planned {
    let mut segs = Vec::new();
    let mut objects = Vec::new();
    tree.for_each_leaf(&mut |_, leaf| match leaf {
        StateTree::Tensor(t) => {
            let req = Request {
                key: t.key.clone(),
                dtype: t.dtype,
                global_shape: t.global_shape.clone(),
                offset: t.global_offset.clone(),
                shape: t.box_shape(),
                flat: t.flattened_range.as_ref().map(|r| (r.start, r.end)),
                allow_shape_mismatch: t.allow_shape_mismatch,
                target: 0,
            };
            segs.extend(plan_request(index, &req).unwrap().segs);
        }
        StateTree::Object(o) => objects.push((o.key.clone(), o.global_offset.clone())),
        _ => {}
    });
    let mut chunks: Vec<(u32, u32)> = segs.iter().map(|s| (s.tensor, s.chunk)).collect();
    chunks.sort();
    chunks.dedup();
    let plan = plan_reads(index, segs, verify, ReadTuning::default());
    let name = |f: u32| index.files[f as usize].name.clone();
    let mut gets: Vec<(String, u64, u64)> = plan.spans.iter().map(|s| (name(s.file), s.off, s.off + s.len)).collect();
    let mut files: Vec<u32> = plan.spans.iter().map(|s| s.file).collect();
    files.sort();
    files.dedup();
    if verify {
        // Each touched file's safetensors header, checked against the index.
        gets.extend(files.iter().map(|&f| (name(f), 0, index.files[f as usize].header_len)));
    }
    for (key, off) in objects {
        let sh = index.object(&key).unwrap().shards.iter().find(|s| s.offset == off).unwrap();
        gets.push((name(sh.file), sh.byte_offset, sh.byte_offset + sh.len));
    }
    gets.sort();
    Planned { gets, data_reads: plan.spans.len(), files, chunks: chunks.len() }
}

/// Ranged GETs of data files in a log, sorted.
fn data_gets(log: &[Logged]) -> Vec<(String, u64, u64)> {
    let mut g: Vec<(String, u64, u64)> = log
        .iter()
        .filter(|r| r.kind == Kind::GetRange && r.name() != INDEX_FILE)
        .map(|r| (r.name().to_string(), r.range.unwrap().0, r.range.unwrap().1))
        .collect();
    g.sort();
    g
}

/// Opening the index for a load: a HEAD and a GET of its first 12 bytes to recognise the
/// format (`NativeStrategy::detect`), then a HEAD and one ranged GET of its first 256 KiB,
/// which holds all of a small index (`io::index_read`).
fn assert_index_opened_once(log: &[Logged], index_size: u64) {
    // Compared as a set: the proxy serves each connection on its own thread, so a request may
    // be logged before the previous response on another connection is (the client sends them
    // one after the other; the log's order is the proxy threads' race).
    let mut index: Vec<(Kind, Option<(u64, u64)>)> =
        log.iter().filter(|r| r.name() == INDEX_FILE).map(|r| (r.kind, r.range)).collect();
    index.sort();
    assert!(index_size < 256 << 10);
    let mut want = vec![
        (Kind::Head, None),
        (Kind::GetRange, Some((0, 12))),
        (Kind::Head, None),
        (Kind::GetRange, Some((0, index_size))),
    ];
    want.sort();
    assert_eq!(index, want);
}

#[test]
fn a_resharded_load_issues_exactly_the_planned_gets() {
    let _serial = serial();
    // 4 MiB of "w" per save rank.
    let t = Truth::new(6, 1024);
    let proxy = FaultProxy::start(FaultPlan::none());
    let url = s3::fresh_url("counts");
    let direct = ObjectStorage::open(&url, s3::test_options()).unwrap();
    for (r, o) in save_all(&direct, &t).into_iter().enumerate() {
        o.unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
    let index = open(&direct).map(Checkpoint::into_index).unwrap();
    let index_size = direct.size(INDEX_FILE).unwrap();
    let storage = proxy.storage(&url, s3::test_options());

    // Verified, resharded: each load rank in turn, so that the proxy's log is that rank's.
    for k in 0..LOAD_WORLD {
        let rc0 = storage.request_counts();
        let loaded = load(load_tree(k, &t), &storage, &SoloComm, &load_opts()).unwrap();
        check_loaded(&loaded.state, &t);
        let log = proxy.take_log();
        let plan = planned(&index, &load_tree(k, &t), true);
        let st = &loaded.stats;
        assert_index_opened_once(&log, index_size);
        assert_eq!(data_gets(&log), plan.gets, "load rank {k}: the ranged GETs are the planned ones");
        assert_eq!(log.len(), 4 + plan.gets.len(), "load rank {k}: nothing else: {log:?}");
        assert_eq!(st.reads, plan.data_reads);
        let header_bytes: u64 = plan.files.iter().map(|&f| index.files[f as usize].header_len).sum();
        assert_eq!(st.header_bytes_read, header_bytes);
        // GETs = the index (2) + ranged data reads + one header per touched file + objects.
        let c = Counts::of(&log);
        assert_eq!(c.gets() as usize, 2 + st.reads + plan.files.len() + SAVE_WORLD, "load rank {k}");
        assert_eq!(c.n(Kind::Head), 2);
        // No chunk is larger than one read (4 MiB): at most one GET per loaded chunk.
        assert!(st.reads <= plan.chunks, "load rank {k}: {} reads for {} chunks", st.reads, plan.chunks);
        let rc = storage.request_counts();
        assert_eq!(rc.gets - rc0.gets, c.gets(), "request_counts");
        assert_eq!(rc.bytes_downloaded - rc0.bytes_downloaded, c.bytes_down, "request_counts");
    }

    // Unverified, one large contiguous region (the middle 3/4 of "w" rows): the bytes downloaded
    // are the bytes needed, within 5% (the index is the rest), in one GET per chunk.
    let rows = t.rows;
    let (r0, r1) = (rows / 8, rows * 7 / 8);
    let tree = StateTree::map().with(
        "w",
        StateTree::Tensor(shard("w", DType::F32, &t.w_shape(), &[r0, 0], &[r1 - r0, COLS], 0, None, TensorData::None)),
    );
    let plan = planned(&index, &tree, false);
    let opts = LoadOptions { verify_checksums: false, ..load_opts() };
    let loaded = load(tree, &storage, &SoloComm, &opts).unwrap();
    let w = tensor_at(&loaded.state, "w");
    assert!(w.data.bytes().unwrap() == expected_for(w, &t.w, &t.w_shape()).as_slice());
    let log = proxy.take_log();
    let c = Counts::of(&log);
    let st = &loaded.stats;
    assert_index_opened_once(&log, index_size);
    assert_eq!(data_gets(&log), plan.gets);
    assert_eq!(st.bytes_needed, (r1 - r0) * COLS * 4);
    assert_eq!(st.bytes_read, st.bytes_needed, "contiguous: nothing read around it");
    let data_bytes: u64 = log.iter().filter(|r| r.name() != INDEX_FILE).map(|r| r.bytes_down).sum();
    assert_eq!(data_bytes, st.bytes_needed);
    assert!(
        c.bytes_down as f64 <= 1.05 * st.bytes_needed as f64,
        "{} downloaded for {} needed",
        c.bytes_down,
        st.bytes_needed
    );
    assert_eq!(plan.chunks, SAVE_WORLD, "the region spans every rank's chunk of w");
    assert_eq!(c.n(Kind::GetRange) as usize - 2, plan.chunks, "one GET per chunk");
}

#[test]
fn request_counts_agree_with_what_went_over_the_wire() {
    let _serial = serial();
    let t = Truth::new(7, 256);
    // A fifth of the requests throttled, and one uploaded part whose response is lost (the
    // store has the part; the client sends it again).
    let random = FaultPlan::random(31, 20, 1, 0);
    let lost_part = AtomicUsize::new(0);
    let plan = FaultPlan::new(31, Some(2), move |r, rng| {
        if r.kind == Kind::PutPart && lost_part.fetch_add(1, Ordering::Relaxed) == 0 {
            return Some(Fault::LostResponse);
        }
        random.decide(r, rng)
    });
    let proxy = FaultProxy::start(plan);
    let url = s3::fresh_url("agree");
    // A generous timeout: no timeout nobody injected, so every attempt is accounted for.
    let saving = proxy.storage(&url, opts_via(&proxy, Duration::from_secs(60), 10));
    for (r, o) in save_all(&saving, &t).into_iter().enumerate() {
        o.unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
    let loading = proxy.storage(&url, opts_via(&proxy, Duration::from_secs(60), 10));
    load_all_and_check(&loading, &t);
    let c = proxy.counts();
    assert!(c.total_faults() > 0 && c.by_fault.get(&Fault::LostResponse) == Some(&1), "{c:?}");
    let rc = sum(saving.request_counts(), loading.request_counts());
    // Logical requests = attempts delivered; attempts = logical + faults.
    assert_eq!(rc, delivered_counts(&c), "{c:?}");
    assert_eq!(c.gets(), rc.gets + c.faulted(Kind::Get) + c.faulted(Kind::GetRange));
    assert_eq!(c.n(Kind::Head), rc.heads + c.faulted(Kind::Head));
    assert_eq!(c.n(Kind::Put), rc.puts + c.faulted(Kind::Put));
    assert_eq!(c.n(Kind::PutPart), rc.parts + c.faulted(Kind::PutPart));
    assert_eq!(c.n(Kind::List), rc.lists + c.faulted(Kind::List));
    assert_eq!(c.n(Kind::Delete), rc.deletes + c.faulted(Kind::Delete));
    // Every multipart upload was started and completed once (logically).
    assert_eq!(c.delivered(Kind::CreateUpload), c.delivered(Kind::CompleteUpload));
    assert_eq!(c.n(Kind::AbortUpload), 0);
}

/// `s3://` locations opened by name (`storage::Location`, as the Python package and the CLI do)
/// take their endpoint and `AWS_ALLOW_HTTP` from the environment.
#[test]
fn an_s3_url_is_configured_from_the_aws_environment() {
    if !crate::common::in_own_process(module_path!(), "an_s3_url_is_configured_from_the_aws_environment") {
        return; // it changes the environment, which the other tests of this binary read
    }
    let _serial = serial();
    let endpoint = s3::endpoint();
    // This test runs alone in its own process (above): nothing else reads the environment.
    std::env::set_var("AWS_ENDPOINT_URL", endpoint);
    std::env::set_var("AWS_ALLOW_HTTP", "true");
    let url = s3::fresh_url("env");
    let r = (|| -> Result<Vec<u8>> {
        let storage = tessera::storage::Location::parse(&url).open()?;
        storage.put_atomic("x", b"hello")?;
        let back = storage.read("x")?;
        storage.delete("x")?;
        Ok(back)
    })();
    std::env::remove_var("AWS_ENDPOINT_URL");
    std::env::remove_var("AWS_ALLOW_HTTP");
    assert_eq!(r.unwrap(), b"hello");
}

/// The public conformance suite (`tessera::storage::conformance`, run against moto directly by
/// `tests/conformance.rs`) also holds through the proxy with a fifth of the requests throttled
/// (503 Slow Down): the client's retries keep every semantic, conditional puts included.
#[test]
fn the_conformance_suite_holds_through_throttling() {
    let _serial = serial();
    let proxy = FaultProxy::start(FaultPlan::random(41, 20, 0, 0));
    let storage = proxy.storage(&s3::fresh_url("conformance-throttled"), s3::test_options());
    conformance::run(&storage);
    let c = proxy.counts();
    assert!(c.by_fault.get(&Fault::SlowDown).copied().unwrap_or(0) > 0, "no 503 injected: {c:?}");
}

fn ranks_loading_halves_of_rows_download_only_their_halves_on(store: Store) {
    let _serial = serial();
    // 1 MiB of "w" per save rank: 4 KiB rows, 1 MiB blocks (256 rows each).
    let t = Truth::new(8, 256);
    let url = store.fresh_url("shared-verification");
    let storage = ObjectStorage::open(&url, store.options()).unwrap();
    for (r, o) in save_all(&storage, &t).into_iter().enumerate() {
        o.unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
    let half = COLS / 2;
    let request = |r: u64| {
        let cols = shard("w", DType::F32, &t.w_shape(), &[0, r * half], &[t.rows, half], 0, None, TensorData::None);
        StateTree::map().with("w", StateTree::Tensor(cols))
    };
    let needed = t.rows * COLS * 4;
    for share in [true, false] {
        let opts = LoadOptions { share_verification: share, ..load_opts() };
        let before = storage.request_counts();
        let out = run_ranks(2, |c| load(request(c.rank() as u64), &storage, c, &opts));
        let after = storage.request_counts();
        let mut read = 0;
        for (r, x) in out.into_iter().enumerate() {
            let x = x.unwrap_or_else(|e| panic!("shared {share}, rank {r}: {e}"));
            let w = tensor_at(&x.state, "w");
            assert!(w.data.bytes().unwrap() == expected_for(w, &t.w, &t.w_shape()).as_slice(), "rank {r}");
            read += x.stats.bytes_read;
        }
        // What went over the wire besides tensor data: the index and the files' headers, read
        // by each rank.
        let downloaded = after.bytes_downloaded - before.bytes_downloaded;
        if share {
            assert_eq!(read, needed, "each rank reads its own half of every row");
            assert!(downloaded as f64 <= 1.05 * needed as f64, "{downloaded} downloaded for {needed} needed");
        } else {
            assert_eq!(read, 2 * needed, "each rank reads whole blocks");
            assert!(downloaded >= 2 * needed, "{downloaded} downloaded for {needed} needed");
        }
    }
}

#[test]
fn ranks_loading_halves_of_rows_download_only_their_halves() {
    ranks_loading_halves_of_rows_download_only_their_halves_on(Store::S3);
}

#[test]
fn ranks_loading_halves_of_rows_download_only_their_halves_on_azure() {
    ranks_loading_halves_of_rows_download_only_their_halves_on(Store::Azure);
}

/// On GCS (fake-gcs-server), the checkpoint is read back through the emulator's own XML API:
/// ranged GETs, HEAD, listing.
#[test]
fn ranks_loading_halves_of_rows_download_only_their_halves_on_gcs() {
    ranks_loading_halves_of_rows_download_only_their_halves_on(Store::Gcs);
}

/// Azure, as a user configures it: the account's key wrong is one `AccessDenied` naming the
/// object, at once (a 403 is not retried); no credentials at all, off a cloud VM, fail at
/// open (the metadata service is not retried for minutes).
#[test]
fn a_wrong_azure_key_is_access_denied_at_once() {
    let _serial = serial();
    let url = azure::fresh_url("wrong-key");
    let mut opts = azure::test_options();
    for (k, v) in &mut opts.config {
        if k == "azure_storage_account_key" {
            // Valid base64, another key.
            v.replace_range(0..1, "F");
        }
    }
    let started = std::time::Instant::now();
    let storage = ObjectStorage::open(&url, opts).unwrap();
    let err = open(&storage).map(Checkpoint::into_index).unwrap_err();
    assert!(matches!(&err, Error::AccessDenied { path, .. } if path.to_string_lossy().starts_with(&url)), "{err}");
    assert!(started.elapsed() < Duration::from_secs(10), "took {:?}", started.elapsed());
}

/// The stores under test honour conditional creates, and the probe says so; a store that
/// accepts the condition and ignores it (the proxy strips it before moto sees it) is
/// detected, and a save there still commits exactly once and whole.
#[test]
fn conditional_creates_are_probed_and_a_store_that_ignores_them_is_detected() {
    let _serial = serial();
    assert!(s3::fresh_storage("probe").conditional_put_honoured().unwrap());
    assert!(azure::fresh_storage("probe").conditional_put_honoured().unwrap());
    assert!(gcs::fresh_storage("probe").conditional_put_honoured().unwrap());
    let proxy = FaultProxy::start(FaultPlan::none());
    proxy.drop_conditions();
    let url = s3::fresh_url("ignores-conditions");
    let storage = proxy.storage(&url, opts_via(&proxy, Duration::from_secs(30), 2));
    assert!(!storage.conditional_put_honoured().unwrap());
    assert!(!storage.has_atomic_create());
    assert!(storage.list().unwrap().is_empty(), "the probe object is removed: {:?}", storage.list());
    // The fallback itself: check, then put, refuses an existing object.
    storage.put_if_absent("marker", b"first").unwrap();
    assert!(matches!(storage.put_if_absent("marker", b"second"), Err(Error::AlreadyExists { .. })));
    assert_eq!(storage.read("marker").unwrap(), b"first");
    storage.delete("marker").unwrap();
    let t = Truth::new(9, 16);
    for (r, o) in save_all(&storage, &t).into_iter().enumerate() {
        o.unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
    // The commit did not rely on the condition: a second save is refused by its existence check.
    assert!(save_all(&storage, &t).iter().all(|o| matches!(o, Err(Error::AlreadyExists { .. }))));
    assert_committed_whole(&ObjectStorage::open(&url, s3::test_options()).unwrap());
}

/// `s3://` configured as the AWS CLI is: the profile `AWS_PROFILE` of the shared credentials
/// file (keys) and config file (`region`, `endpoint_url`), with no key in the environment.
/// Without the profile (and no instance metadata here) the same open fails at once, naming
/// what it tried.
#[test]
fn an_s3_url_is_configured_from_an_aws_profile() {
    if !crate::common::in_own_process(module_path!(), "an_s3_url_is_configured_from_an_aws_profile") {
        return; // it changes the environment, which the other tests of this binary read
    }
    let _serial = serial();
    let endpoint = s3::endpoint();
    let dir = TempDir::new("aws-profile");
    std::fs::create_dir_all(dir.path()).unwrap();
    let (creds, config) = (dir.path().join("credentials"), dir.path().join("config"));
    std::fs::write(
        &creds,
        "[default]\naws_access_key_id = wrong\n[ci]\naws_access_key_id = test\naws_secret_access_key = test\n",
    )
    .unwrap();
    std::fs::write(&config, format!("[profile ci]\nregion = us-east-1\nendpoint_url = {endpoint}\n")).unwrap();
    let saved: Vec<(&str, Option<String>)> =
        ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"].iter().map(|k| (*k, std::env::var(k).ok())).collect();
    for (k, _) in &saved {
        std::env::remove_var(k);
    }
    std::env::set_var("AWS_SHARED_CREDENTIALS_FILE", &creds);
    std::env::set_var("AWS_CONFIG_FILE", &config);
    std::env::set_var("AWS_ALLOW_HTTP", "true");
    std::env::set_var("AWS_PROFILE", "ci");
    let url = s3::fresh_url("profile");
    let with_profile = (|| -> Result<Vec<u8>> {
        let storage = tessera::storage::Location::parse(&url).open()?;
        storage.put_atomic("x", b"profile")?;
        storage.read("x")
    })();
    std::env::set_var("AWS_PROFILE", "missing");
    let missing_profile = tessera::storage::Location::parse(&url).open().map(|_| ());
    std::env::remove_var("AWS_PROFILE");
    std::env::set_var("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent");
    let no_credentials = ObjectStorage::open(
        &url,
        ObjectStoreOptions {
            config: vec![("aws_metadata_endpoint".into(), "http://127.0.0.1:9".into())],
            ..Default::default()
        },
    )
    .map(|_| ());
    for k in ["AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "AWS_ALLOW_HTTP"] {
        std::env::remove_var(k);
    }
    for (k, v) in saved {
        if let Some(v) = v {
            std::env::set_var(k, v);
        }
    }
    assert_eq!(with_profile.unwrap(), b"profile");
    let err = missing_profile.unwrap_err();
    assert!(matches!(&err, Error::AccessDenied { reason, .. } if reason.contains("AWS_PROFILE=missing")), "{err}");
    let err = no_credentials.unwrap_err();
    assert!(
        matches!(&err, Error::AccessDenied { path, reason } if path.to_string_lossy() == url && reason.contains("no S3 credentials found")),
        "{err}"
    );
}

/// What counts as configured credentials, store by store, with every metadata service pointed
/// at a dead loopback port: key-less sources the clients can use (web identity, container
/// credentials, a federated token, the emulator, anonymous access, a credentials file) open,
/// flags in any spelling `object_store` accepts (`1`, `True`, `yes`); nothing at all is
/// `AccessDenied` at open, at once. Opening makes no request, so no server is needed.
#[test]
fn configured_credentials_of_every_kind_pass_the_check_and_none_fails_it() {
    if !crate::common::in_own_process(
        module_path!(),
        "configured_credentials_of_every_kind_pass_the_check_and_none_fails_it",
    ) {
        return; // it changes the environment, which the other tests of this binary read
    }
    let _serial = serial();
    let dead = "http://127.0.0.1:9";
    let dir = TempDir::new("credential-kinds");
    std::fs::create_dir_all(dir.path()).unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "jwt").unwrap();
    let adc = dir.path().join("adc.json");
    std::fs::write(
        &adc,
        r#"{"type": "authorized_user", "client_id": "c", "client_secret": "s", "refresh_token": "r"}"#,
    )
    .unwrap();
    let token = token.to_str().unwrap();
    let adc = adc.to_str().unwrap();
    let vars =
        ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"];
    let saved: Vec<(&str, Option<String>)> = vars.iter().map(|k| (*k, std::env::var(k).ok())).collect();
    for k in vars {
        std::env::remove_var(k);
    }
    std::env::set_var("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent");
    std::env::set_var("AWS_CONFIG_FILE", "/nonexistent");
    std::env::set_var("GCE_METADATA_HOST", "127.0.0.1:9");
    std::env::set_var("GCE_METADATA_IP", "127.0.0.1:9");
    let open_with = |url: &str, config: &[(&str, &str)]| {
        let config = config.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        ObjectStorage::open(url, ObjectStoreOptions { config, ..Default::default() }).map(|_| ())
    };
    let s3 = [("aws_metadata_endpoint", dead)];
    let az = [("azure_storage_account_name", "acc"), ("azure_msi_endpoint", dead)];
    let configured: Vec<(&str, Vec<(&str, &str)>)> = vec![
        ("s3://b/p", vec![("aws_web_identity_token_file", token), ("aws_role_arn", "arn:aws:iam::1:role/r")]),
        ("s3://b/p", vec![("aws_container_credentials_relative_uri", "/v2/credentials/x")]),
        ("s3://b/p", vec![("aws_skip_signature", "True")]),
        ("gs://b/p", vec![("google_application_credentials", adc)]),
        ("gs://b/p", vec![("google_skip_signature", "yes")]),
        ("az://c/p", vec![("azure_storage_use_emulator", "1")]),
        ("az://c/p", vec![("azure_federated_token_file", token), ("azure_client_id", "id"), ("azure_tenant_id", "t")]),
        ("az://c/p", vec![("azure_use_azure_cli", "TRUE")]),
    ];
    let mut outcomes = Vec::new();
    for (url, mut config) in configured {
        config.extend(if url.starts_with("s3") {
            &s3[..]
        } else if url.starts_with("az") {
            &az[..]
        } else {
            &[][..]
        });
        outcomes.push((url, format!("{config:?}"), open_with(url, &config)));
    }
    let started = std::time::Instant::now();
    let none =
        [("s3://b/p", &s3[..]), ("gs://b/p", &[][..]), ("az://c/p", &az[..])].map(|(url, c)| (url, open_with(url, c)));
    let elapsed = started.elapsed();
    for k in ["AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "GCE_METADATA_HOST", "GCE_METADATA_IP"] {
        std::env::remove_var(k);
    }
    for (k, v) in saved {
        if let Some(v) = v {
            std::env::set_var(k, v);
        }
    }
    for (url, config, r) in outcomes {
        assert!(r.is_ok(), "{url} with {config}: {r:?}");
    }
    for (url, r) in none {
        assert!(
            matches!(&r, Err(Error::AccessDenied { reason, .. }) if reason.contains("credentials found: tried")),
            "{url}: {r:?}"
        );
    }
    assert!(elapsed < Duration::from_secs(10), "{elapsed:?}");
}

/// Issue 29's sweep against a real object store: for the native, `torch_dist` and OLMo-core
/// writers, into a new prefix and over a committed checkpoint, every request that changes the
/// store (a PUT, an upload's part, completion or abort, a DELETE) loses its response in turn: the
/// store acts on it, the client hears a 503 and retries as it does. The prefix then holds the old
/// state or the new one, whole (never a mix), `verify` agrees, `gc` leaves exactly the committed
/// files, and a retry succeeds.
#[test]
fn every_change_to_the_store_loses_its_response_in_turn_and_no_checkpoint_is_lost() {
    let _serial = serial();
    #[derive(Debug, Clone, Copy, PartialEq)]
    enum W {
        Native,
        TorchDist,
        Olmo,
    }
    const WORLD: usize = 2;
    let w_of = |step: u64| f32_bytes(&(0..64).map(|i| (step * 1000 + i) as f32).collect::<Vec<_>>());
    let write = |w: W, s: &dyn Storage, c: &dyn Communicator, step: u64, overwrite: bool| -> Result<()> {
        let rank = c.rank();
        let rows = w_of(step)[rank * 128..(rank + 1) * 128].to_vec();
        let t = ShardedTensor::from_rank_offsets(
            "w",
            DType::F32,
            &[4, 8],
            TensorData::Owned(rows),
            &[(0, rank as u64, 2)],
            0,
        )?;
        let mut tree = StateTree::map().with("w", StateTree::Tensor(t));
        if w != W::Olmo {
            tree = tree.with("step", StateTree::Value(Value::Int(step as i64)));
        }
        let opts = SaveOptions { overwrite, ..SaveOptions::default() };
        match w {
            W::Native => save(tree, s, c, &opts).map(drop),
            W::TorchDist => save_torch_dist(tree, None, s, c, &opts, 1).map(drop),
            W::Olmo => save_olmo(tree, s, c, &opts).map(drop),
        }
    };
    let step_at = |w: W, s: &dyn Storage| -> Option<u64> {
        let ckpt = match open(s) {
            Ok(c) => c,
            Err(Error::NotFound { .. } | Error::NotCommitted { .. }) => return None,
            Err(e) => panic!("{w:?}: {e}"),
        };
        let data = ckpt.read_tensors(None).unwrap().remove("w").unwrap().data;
        let step = [1, 2].into_iter().find(|&s| data == w_of(s)).expect("the tensors of no step");
        if w != W::Olmo {
            let v = ckpt.common_state().get_dotted("step").and_then(|t| t.as_value().cloned());
            assert_eq!(v, Some(Value::Int(step as i64)), "{w:?}: a mix");
        }
        Some(step)
    };
    let changes = |r: &Logged| {
        matches!(
            r.kind,
            Kind::Put | Kind::PutPart | Kind::CreateUpload | Kind::CompleteUpload | Kind::Delete | Kind::AbortUpload
        )
    };
    let mut cases = 0;
    for w in [W::Native, W::TorchDist, W::Olmo] {
        for overwrite in [false, true] {
            let run = |plan: FaultPlan| -> (String, ObjectStorage, Vec<Result<()>>, FaultProxy) {
                let url = s3::fresh_url("lost-sweep");
                let direct = ObjectStorage::open(&url, s3::test_options()).unwrap();
                if overwrite {
                    for r in run_ranks(WORLD, |c| write(w, &direct, c, 1, false)) {
                        r.unwrap();
                    }
                }
                let proxy = FaultProxy::start(plan);
                let storage = proxy.storage(&url, opts_via(&proxy, Duration::from_secs(30), 10));
                let out = run_ranks(WORLD, |c| write(w, &storage, c, 2, overwrite));
                (url, direct, out, proxy)
            };
            // A clean run counts the requests that change the store.
            let (_, _, out, proxy) = run(FaultPlan::none());
            out.into_iter().for_each(|r| r.unwrap());
            let n = proxy.log().iter().filter(|r| changes(r)).count();
            for k in 0..n {
                let seen = AtomicUsize::new(0);
                let plan = FaultPlan::new(0, Some(1), move |r, _| {
                    (changes(r) && seen.fetch_add(1, Ordering::SeqCst) == k).then_some(Fault::LostResponse)
                });
                let (_, direct, out, _proxy) = run(plan);
                let what = format!("{w:?}, overwrite {overwrite}, change {k} of {n} lost: {out:?}");
                let st = step_at(w, &direct);
                let allowed = if overwrite { [Some(1), Some(2)] } else { [None, Some(2)] };
                assert!(allowed.contains(&st), "{what}: holds {st:?}");
                if out.iter().all(Result::is_ok) {
                    assert_eq!(st, Some(2), "{what}");
                } else if st != Some(2) {
                    assert!(out.iter().all(Result::is_err), "{what}: a rank reports success");
                }
                match (st, verify(&direct, 2)) {
                    (Some(_), Ok(r)) => assert!(r.problems.is_empty(), "{what}: {:?}", r.problems),
                    (None, Err(Error::NotCommitted { .. } | Error::NotFound { .. })) => {}
                    (_, other) => panic!("{what}: verify says {other:?}"),
                }
                gc(&direct, &GcOptions { break_leases: true }).unwrap();
                assert!(
                    names(&direct).iter().all(|n| !n.starts_with(".tessera-lease-")),
                    "{what}: after gc: {:?}",
                    names(&direct)
                );
                for r in run_ranks(WORLD, |c| write(w, &direct, c, 2, overwrite)) {
                    match r {
                        Ok(()) => {}
                        Err(Error::AlreadyExists { .. }) if !overwrite && st == Some(2) => {}
                        Err(e) => panic!("{what}: the retry failed: {e}"),
                    }
                }
                assert_eq!(step_at(w, &direct), Some(2), "{what}: after the retry");
                cases += 1;
            }
        }
    }
    println!("lost-response sweep on S3: {cases} cases; data lost in none");
}

/// An Azure connection string that names the account's host by `DefaultEndpointsProtocol=http`
/// and `EndpointSuffix` (a private cloud or a gateway) reaches `http://ACCOUNT.blob.SUFFIX`
/// over plain HTTP. The host does not resolve here: the client goes through a proxy on
/// loopback that records each request line and answers that the blob does not exist.
#[test]
fn an_azure_connection_string_with_an_http_endpoint_suffix_reaches_the_account_host() {
    use std::io::{BufRead, BufReader, Write};

    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let proxy = format!("http://{}", listener.local_addr().unwrap());
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let log = seen.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { return };
            let mut reader = BufReader::new(conn.try_clone().unwrap());
            let mut line = String::new();
            let mut first = None;
            while reader.read_line(&mut line).is_ok_and(|n| n > 0) && line != "\r\n" {
                first.get_or_insert_with(|| line.trim_end().to_string());
                line.clear();
            }
            log.lock().unwrap().extend(first);
            let mut conn = conn;
            let _ = conn.write_all(
                b"HTTP/1.1 404 The specified blob does not exist.\r\nx-ms-error-code: BlobNotFound\r\n\
                  Content-Length: 0\r\nConnection: close\r\n\r\n",
            );
        }
    });
    let connection = "DefaultEndpointsProtocol=http;AccountName=acct;AccountKey=a2V5;EndpointSuffix=example.test";
    let config = [("azure_storage_connection_string", connection), ("proxy_url", &proxy)];
    let opts = ObjectStoreOptions {
        config: config.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        max_retries: 0,
        ..Default::default()
    };
    let storage = ObjectStorage::open("az://ckpts/run1", opts).unwrap();
    assert_eq!(storage.size_if_present("tessera.index").unwrap(), None);
    let seen = seen.lock().unwrap();
    assert!(
        seen.iter().any(|l| l.starts_with("HEAD http://acct.blob.example.test/ckpts/run1/tessera.index ")),
        "{seen:?}"
    );
}
