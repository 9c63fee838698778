//! The memory tier and the checkpoint manager, 8 ranks on 4 simulated nodes (threads here, a
//! memory root per node; `scripts/ci/memory_tier_processes.sh` runs real processes under MPI
//! and torch.distributed): any m nodes lost restore bit-exact from memory, m + 1 fall back to
//! the persistent tier, saying why; a new world size restores from the persistent tier,
//! resharded.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tessera::comm::InProcessComm;
use tessera::memory_tier::{CheckpointManager, ManagerOptions, MemoryTier, Tier};
use tessera::storage::Location;
use tessera::{Communicator, DType, ShardedObject, ShardedTensor, StateTree, TensorData, Value};

use crate::common::{run_ranks, TempDir};

const WORLD: usize = 8;
const NODES: usize = 4;
/// Elements of "w" per rank.
const PER_RANK: u64 = 300;

fn node_of(rank: usize, world: usize) -> usize {
    rank * NODES / world
}

/// Rank `rank`'s bytes of the state at `step`: its slice of "w" (f32, sharded along axis 0),
/// a tensor of its own of uneven length, and the replicated "b".
fn truth_w(step: u64, world: usize) -> Vec<u8> {
    let n = PER_RANK * WORLD as u64;
    let _ = world;
    (0..n).flat_map(|i| ((step * 1000 + i) as f32).to_le_bytes()).collect()
}

fn own(step: u64, rank: usize) -> Vec<u8> {
    (0..(rank * 37 + 5)).map(|i| (i as u64 * 7 + step + rank as u64) as u8).collect()
}

/// The state of `rank` in a job of `world` ranks, borrowing `w` (its slice) and `mine`.
fn state<'a>(
    rank: usize,
    world: usize,
    w: &'a mut [u8],
    mine: &'a mut [u8],
    b: &'a mut [u8],
    obj: Option<Vec<u8>>,
) -> StateTree<'a> {
    let per = PER_RANK * WORLD as u64 / world as u64;
    let wt = ShardedTensor::from_rank_offsets(
        "w",
        DType::F32,
        &[per],
        TensorData::Mut(w),
        &[(0, rank as u64, world as u64)],
        0,
    )
    .unwrap();
    let bt = ShardedTensor::full("b", DType::U8, &[b.len() as u64], TensorData::Mut(b)).with_replica_id(rank as u32);
    let mut tree = StateTree::map().with("w", StateTree::Tensor(wt)).with("b", StateTree::Tensor(bt));
    if world == WORLD {
        let n = mine.len() as u64;
        tree.insert(
            format!("own{rank}"),
            StateTree::Tensor(ShardedTensor::full(format!("own{rank}"), DType::U8, &[n], TensorData::Mut(mine))),
        );
    }
    if world == WORLD {
        tree.insert(
            "rng",
            StateTree::Object(ShardedObject {
                key: "rng".into(),
                data: obj,
                global_shape: vec![world as u64],
                global_offset: vec![rank as u64],
                replica_id: tessera::ReplicaId::main(),
            }),
        );
    }
    tree.insert(
        "meta",
        StateTree::List(vec![StateTree::Value(Value::Str("tessera".into())), StateTree::Value(Value::Int(0))]),
    );
    tree
}

fn opts(dir: &Path, rank: usize, world: usize) -> ManagerOptions {
    opts_on(dir, node_of(rank, world))
}

/// The options of a rank running on node `node`.
fn opts_on(dir: &Path, node: usize) -> ManagerOptions {
    ManagerOptions {
        memory: Some(
            MemoryTier::new(dir.join(format!("node{node}")))
                .node(format!("node{node}"))
                .redundancy(2, 2)
                .chunk_bytes(256),
        ),
        persistent: Some(Location::local(dir.join("persistent"))),
        every: 1,
        persist_every: 3,
        keep_last_memory: 3,
        keep_last_persistent: 2,
        staging_bytes: 1 << 20,
    }
}

/// Runs steps `1..=last` of the job, saving each, and waits for the background.
fn train(dir: &Path, last: u64) {
    train_steps(dir, 1..=last, 0);
}

/// Runs `steps` of a job whose state at step s is the truth of step s + `salt` (another run
/// saving the same step numbers), saving each, and waits for the background.
fn train_steps(dir: &Path, steps: std::ops::RangeInclusive<u64>, salt: u64) {
    let bg = InProcessComm::group(WORLD);
    run_ranks(WORLD, |comm| {
        let rank = comm.rank();
        let mut mgr = CheckpointManager::new(opts(dir, rank, WORLD), Arc::new(bg[rank].clone())).unwrap();
        for step in steps.clone() {
            let truth = step + salt;
            let per = (PER_RANK * 4) as usize;
            let mut w = truth_w(truth, WORLD)[rank * per..(rank + 1) * per].to_vec();
            let mut mine = own(truth, rank);
            let mut b = vec![truth as u8; 64];
            let obj = Some(format!("rng of {rank} at {truth}").into_bytes());
            let tree = state(rank, WORLD, &mut w, &mut mine, &mut b, obj);
            assert!(mgr.save(step, tree, comm).unwrap());
        }
        mgr.wait().unwrap();
    });
}

struct Outcome {
    step: u64,
    tier: Tier,
    rebuilt: Vec<usize>,
    notes: Vec<String>,
}

/// Restores a job of `world` ranks; checks every byte against step `want`'s truth.
fn restore(dir: &Path, world: usize, want: u64) -> Vec<Outcome> {
    restore_on(dir, world, want, |rank| node_of(rank, world))
}

/// Like [`restore`], rank r running on node `node(r)`.
fn restore_on(dir: &Path, world: usize, want: u64, node: impl Fn(usize) -> usize + Sync) -> Vec<Outcome> {
    let bg = InProcessComm::group(world);
    run_ranks(world, |comm| {
        let rank = comm.rank();
        let mut mgr = CheckpointManager::new(opts_on(dir, node(rank)), Arc::new(bg[rank].clone())).unwrap();
        let per = (PER_RANK * WORLD as u64 / world as u64 * 4) as usize;
        let (mut w, mut mine, mut b) = (vec![0u8; per], vec![0u8; own(0, rank).len()], vec![0u8; 64]);
        let r = mgr.restore(state(rank, world, &mut w, &mut mine, &mut b, None), comm).unwrap().expect("a step");
        let out = Outcome { step: r.step, tier: r.tier, rebuilt: r.rebuilt_ranks.clone(), notes: r.notes.clone() };
        let StateTree::Map(m) = r.state else { panic!("a map") };
        if world == WORLD {
            let StateTree::Object(o) = &m["rng"] else { panic!("rng") };
            assert_eq!(o.data.as_deref(), Some(format!("rng of {rank} at {want}").as_bytes()), "rank {rank}");
        }
        let StateTree::List(meta) = &m["meta"] else { panic!("meta") };
        assert!(matches!(&meta[0], StateTree::Value(Value::Str(s)) if s == "tessera"));
        drop(m);
        assert_eq!(w, truth_w(want, world)[rank * per..(rank + 1) * per], "rank {rank}: w");
        assert_eq!(b, vec![want as u8; 64], "rank {rank}: b");
        if world == WORLD {
            assert_eq!(mine, own(want, rank), "rank {rank}: own tensor");
        }
        out
    })
}

fn copy_tree(src: &Path, dst: &Path) {
    tessera_testkit::files::copy_dir(src, dst);
}

fn fresh_copy(saved: &Path, tag: &str) -> TempDir {
    let d = TempDir::new(tag);
    copy_tree(saved, d.path());
    d
}

fn lose_nodes(dir: &Path, nodes: &[usize]) {
    for n in nodes {
        std::fs::remove_dir_all(dir.join(format!("node{n}"))).unwrap();
    }
}

fn saved_job(last: u64) -> TempDir {
    let d = TempDir::created("memtier-saved");
    train(d.path(), last);
    d
}

#[test]
fn any_two_lost_nodes_restore_bit_exact_from_memory() {
    let saved = saved_job(5);
    // The tiers kept what the policy says: 3 memory steps per node, drains at 3 (and 6, not reached).
    let steps: Vec<PathBuf> = std::fs::read_dir(saved.join("node0")).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(steps.len(), 3, "{steps:?}");
    assert!(saved.join("persistent/step-000000000003/tessera.index").exists());
    for a in 0..NODES {
        for b in a + 1..NODES {
            let d = fresh_copy(saved.path(), "memtier-lost2");
            lose_nodes(d.path(), &[a, b]);
            let out = restore(d.path(), WORLD, 5);
            let mut want: Vec<usize> = (0..WORLD).filter(|&r| [a, b].contains(&node_of(r, WORLD))).collect();
            want.sort();
            for o in &out {
                assert_eq!((o.step, o.tier), (5, Tier::Memory), "nodes {a},{b}: {:?}", o.notes);
                assert_eq!(o.rebuilt, want);
            }
            // The rebuilt copies are back on their nodes: a second restore rebuilds nothing.
            let again = restore(d.path(), WORLD, 5);
            assert!(again.iter().all(|o| o.tier == Tier::Memory && o.rebuilt.is_empty()));
        }
    }
}

#[test]
fn three_lost_nodes_fall_back_to_the_persistent_tier_saying_why() {
    let saved = saved_job(4);
    let d = fresh_copy(saved.path(), "memtier-lost3");
    lose_nodes(d.path(), &[0, 1, 3]);
    let out = restore(d.path(), WORLD, 3);
    for o in &out {
        assert_eq!((o.step, o.tier), (3, Tier::Persistent));
        let text = o.notes.join("\n");
        assert!(text.contains("step 4 cannot be restored") && text.contains("more than its 2 parity"), "{text}");
        assert!(text.contains("restoring step 3 from the persistent tier"), "{text}");
    }
}

#[test]
fn a_new_world_size_restores_from_the_persistent_tier_resharded() {
    let saved = saved_job(3);
    let d = fresh_copy(saved.path(), "memtier-world");
    for o in restore(d.path(), 4, 3) {
        assert_eq!((o.step, o.tier), (3, Tier::Persistent));
        assert!(o.notes.iter().any(|n| n.contains("saved by 8 ranks")), "{:?}", o.notes);
    }
}

fn steps_on(dir: &Path, node: usize) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir.join(format!("node{node}")))
        .map(|d| d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

#[test]
fn a_run_resumed_from_an_older_step_never_meets_the_steps_it_abandoned() {
    // Run A reached step 5 (memory: 3, 4, 5; persistent: 3). Three nodes are lost: the job
    // resumes from the persistent step 3, and node 2 still holds A's steps 4 and 5.
    let saved = saved_job(5);
    let d = fresh_copy(saved.path(), "memtier-resumed");
    lose_nodes(d.path(), &[0, 1, 3]);
    for o in restore(d.path(), WORLD, 3) {
        assert_eq!((o.step, o.tier), (3, Tier::Persistent), "{:?}", o.notes);
    }
    // The restore deleted nothing: until the job saves again, A's steps stay where they are.
    assert!(steps_on(d.path(), 2).contains(&"step-000000000005".to_string()));
    // Run B trains on from step 3 with other values and saves steps 4 and 5 again: its first
    // save clears A's steps 4 and 5 from every node, its steps are kept (not pruned as older
    // than A's), and a restore after losing two nodes gives B's step 5, never a mix with A's
    // markers, copies or parity.
    train_steps(d.path(), 4..=4, 100);
    assert_eq!(steps_on(d.path(), 2), vec!["step-000000000003".to_string(), "step-000000000004".to_string()]);
    train_steps(d.path(), 5..=5, 100);
    lose_nodes(d.path(), &[0, 1]);
    for o in restore(d.path(), WORLD, 105) {
        assert_eq!((o.step, o.tier), (5, Tier::Memory), "{:?}", o.notes);
    }
}

#[test]
fn a_run_started_over_an_old_memory_root_without_restoring_keeps_its_own_steps() {
    // Run A reached step 5; run B starts at step 1 over the same memory roots without a
    // restore (and with a new persistent location). Its first save removes A's steps from
    // every node; the keep-last rule then counts B's steps only.
    let saved = saved_job(5);
    let d = fresh_copy(saved.path(), "memtier-startover");
    std::fs::remove_dir_all(d.join("persistent")).unwrap();
    train_steps(d.path(), 1..=2, 100);
    for n in 0..NODES {
        assert_eq!(steps_on(d.path(), n), vec!["step-000000000001".to_string(), "step-000000000002".to_string()]);
    }
    lose_nodes(d.path(), &[1, 2]);
    for o in restore(d.path(), WORLD, 102) {
        assert_eq!((o.step, o.tier), (2, Tier::Memory), "{:?}", o.notes);
    }
}

#[test]
fn a_run_started_over_an_old_persistent_location_without_restoring_is_refused_deleting_nothing() {
    // Run A reached step 8 (persistent: 3 and 6). Run B starts at step 1 over the same
    // location without a restore: a restore would pick A's step 6 over every step of B, so
    // B's first save fails on every rank, naming the steps, and nothing of A's is touched.
    let saved = saved_job(8);
    let d = fresh_copy(saved.path(), "memtier-oldpersistent");
    let before: Vec<Vec<String>> = (0..NODES).map(|n| steps_on(d.path(), n)).collect();
    let bg = InProcessComm::group(WORLD);
    let errors = run_ranks(WORLD, |comm| {
        let rank = comm.rank();
        let mut mgr = CheckpointManager::new(opts(d.path(), rank, WORLD), Arc::new(bg[rank].clone())).unwrap();
        let per = (PER_RANK * 4) as usize;
        let mut w = truth_w(101, WORLD)[rank * per..(rank + 1) * per].to_vec();
        let (mut mine, mut b) = (own(101, rank), vec![0u8; 64]);
        let err = mgr.save(1, state(rank, WORLD, &mut w, &mut mine, &mut b, None), comm).unwrap_err().to_string();
        mgr.wait().unwrap();
        err
    });
    for e in errors {
        assert!(e.contains("holds step(s) [3, 6], after step 1") && e.contains("restore() first"), "{e}");
    }
    for (n, steps) in before.iter().enumerate() {
        assert_eq!(&steps_on(d.path(), n), steps, "node {n}");
    }
    // A restore still gives A's newest step.
    for o in restore(d.path(), WORLD, 8) {
        assert_eq!((o.step, o.tier), (8, Tier::Memory), "{:?}", o.notes);
    }
}

#[test]
fn a_run_going_back_over_its_own_persistent_steps_is_refused_deleting_nothing() {
    // Without a memory tier: steps 1 to 3 go to the persistent tier; saving step 2 again
    // would leave step 3 to win every later restore, so it is refused on every rank, saying
    // how to go back, and step 3 stays.
    let d = TempDir::created("memtier-goback");
    let opts = || ManagerOptions {
        memory: None,
        persistent: Some(Location::local(d.join("persistent"))),
        staging_bytes: 1 << 20,
        ..ManagerOptions::default()
    };
    let bg = InProcessComm::group(SMALL);
    let errors = run_ranks(SMALL, |comm| {
        let rank = comm.rank();
        let mut mgr = CheckpointManager::new(opts(), Arc::new(bg[rank].clone())).unwrap();
        for step in 1..=3 {
            let mut w = small_bytes(step, rank);
            assert!(mgr.save(step, small_state(rank, &mut w), comm).unwrap());
        }
        let mut w = small_bytes(2, rank);
        let err = mgr.save(2, small_state(rank, &mut w), comm).unwrap_err().to_string();
        mgr.wait().unwrap();
        err
    });
    for e in errors {
        assert!(e.contains("going back from step 3 to step 2") && e.contains("later step(s) [3]"), "{e}");
    }
    assert!(d.join("persistent/step-000000000003").exists());
    let bg = InProcessComm::group(SMALL);
    let restored = run_ranks(SMALL, |comm| {
        let rank = comm.rank();
        let mut mgr = CheckpointManager::new(opts(), Arc::new(bg[rank].clone())).unwrap();
        let mut w = vec![0u8; small_bytes(0, rank).len()];
        let r = mgr.restore(small_state(rank, &mut w), comm).unwrap().expect("a step");
        let step = r.step;
        drop(r);
        assert_eq!(w, small_bytes(3, rank), "rank {rank}");
        step
    });
    assert_eq!(restored, vec![3; SMALL]);
}

#[test]
fn a_hidden_leftover_in_a_copy_does_not_count_against_it() {
    // A save that could not delete its lease leaves `.tessera-lease-*` in the copy (the save
    // succeeds; the lease is not part of the copy). With nodes 0 and 1 lost, the copies on
    // nodes 2 and 3 must still count as intact, or the groups on those nodes (their parity
    // on the lost nodes) could not be restored.
    let saved = saved_job(3);
    let d = fresh_copy(saved.path(), "memtier-hidden");
    lose_nodes(d.path(), &[0, 1]);
    for n in [2, 3] {
        for e in std::fs::read_dir(d.join(&format!("node{n}/step-000000000003"))).unwrap() {
            let p = e.unwrap().path();
            if p.file_name().unwrap().to_string_lossy().starts_with("rank-") {
                std::fs::write(p.join(".tessera-lease-00000000000000aa"), b"left over").unwrap();
            }
        }
    }
    for o in restore(d.path(), WORLD, 3) {
        assert_eq!((o.step, o.tier), (3, Tier::Memory), "{:?}", o.notes);
        assert_eq!(o.rebuilt, vec![0, 1, 2, 3], "{:?}", o.notes);
    }
}

#[test]
fn an_uncommitted_newer_step_is_never_restored() {
    let saved = saved_job(4);
    let d = fresh_copy(saved.path(), "memtier-uncommitted");
    // Step 4 lost its markers on every node (as if killed before the commit): step 4's copies
    // and parity are all there, but it is not complete anywhere.
    for n in 0..NODES {
        let step = d.join(&format!("node{n}/step-000000000004"));
        for e in std::fs::read_dir(&step).unwrap() {
            let p = e.unwrap().path();
            if p.file_name().unwrap().to_string_lossy().starts_with("commit-") {
                std::fs::remove_file(p).unwrap();
            }
        }
    }
    for o in restore(d.path(), WORLD, 3) {
        assert_eq!((o.step, o.tier), (3, Tier::Memory));
    }
}

/// Flips a byte in every parity file and every copy of `step` on `node`.
fn corrupt_node(dir: &Path, node: usize, step: u64) {
    for e in walk(&dir.join(format!("node{node}/step-{step:012}"))) {
        if e.extension().is_some_and(|x| x == "bin") || e.to_string_lossy().contains("rank-") {
            let mut b = std::fs::read(&e).unwrap();
            if !b.is_empty() {
                b[0] ^= 0xff;
                std::fs::write(&e, b).unwrap();
            }
        }
    }
}

#[test]
fn corrupt_shards_on_one_more_node_are_found_and_rebuilt_around() {
    // Node 0 lost and every shard of step 3 on node 1 corrupt: two nodes' worth of shards gone,
    // within RS(2, 2). The first rebuild fails its checksums; the ranks then check what they
    // hold, plan again without node 1's corrupt shards, and rebuild node 0's and node 1's
    // copies from nodes 2 and 3.
    let saved = saved_job(3);
    let d = fresh_copy(saved.path(), "memtier-corrupt1");
    lose_nodes(d.path(), &[0]);
    corrupt_node(d.path(), 1, 3);
    for o in restore(d.path(), WORLD, 3) {
        assert_eq!((o.step, o.tier), (3, Tier::Memory), "{:?}", o.notes);
        assert_eq!(o.rebuilt, vec![0, 1, 2, 3], "{:?}", o.notes);
        let text = o.notes.join("\n");
        assert!(text.contains("step 3 failed to restore") && text.contains("rank 2's copy on node node1"), "{text}");
    }
    // Node 1's copies were replaced by good ones: nothing to rebuild but node 0's parity.
    for o in restore(d.path(), WORLD, 3) {
        assert_eq!((o.step, o.tier, o.rebuilt.len()), (3, Tier::Memory, 0), "{:?}", o.notes);
    }
}

#[test]
fn a_corrupt_copy_on_a_node_its_rank_moved_away_from_is_found_and_rebuilt_around() {
    // Ranks 0 and 2 swap nodes: rank 0's copy now streams from node 0, where rank 1 sends it,
    // and that copy is corrupt. The rank sending it finds it, so the copy is decoded from its
    // group and step 3 still restores from memory (not step 2, as when only owners checked).
    let saved = saved_job(3);
    let d = fresh_copy(saved.path(), "memtier-moved");
    for e in walk(&d.path().join("node0/step-000000000003/rank-000000")) {
        let mut b = std::fs::read(&e).unwrap();
        if !b.is_empty() {
            b[0] ^= 0xff;
            std::fs::write(&e, b).unwrap();
        }
    }
    let moved = |r: usize| match r {
        0 => 1,
        2 => 0,
        r => node_of(r, WORLD),
    };
    for o in restore_on(d.path(), WORLD, 3, moved) {
        assert_eq!((o.step, o.tier), (3, Tier::Memory), "{:?}", o.notes);
        assert_eq!(o.rebuilt, vec![0, 2], "{:?}", o.notes);
        let text = o.notes.join("\n");
        assert!(text.contains("corrupt: rank 0's copy on node node0"), "{text}");
    }
}

#[test]
fn a_corrupt_surviving_shard_beyond_the_parity_falls_back() {
    // Node 0 lost, node 1's and node 2's shards of step 3 corrupt: three nodes' worth, more
    // than RS(2, 2) covers; the persistent step 3 is restored, saying why.
    let saved = saved_job(3);
    let d = fresh_copy(saved.path(), "memtier-corrupt2");
    lose_nodes(d.path(), &[0]);
    corrupt_node(d.path(), 1, 3);
    corrupt_node(d.path(), 2, 3);
    for o in restore(d.path(), WORLD, 3) {
        assert_eq!((o.step, o.tier), (3, Tier::Persistent), "{:?}", o.notes);
        let text = o.notes.join("\n");
        assert!(text.contains("failed to restore") && text.contains("corrupt: "), "{text}");
        assert!(text.contains("restoring step 3 from the persistent tier"), "{text}");
    }
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

#[test]
fn a_fresh_start_restores_nothing() {
    let d = TempDir::created("memtier-fresh");
    let bg = InProcessComm::group(2);
    run_ranks(2, |comm| {
        let rank = comm.rank();
        let o = ManagerOptions {
            memory: Some(MemoryTier::new(d.join(&format!("n{rank}"))).node(format!("n{rank}")).redundancy(1, 1)),
            persistent: Some(Location::local(d.join("p"))),
            ..ManagerOptions::default()
        };
        let mut mgr = CheckpointManager::new(o, Arc::new(bg[rank].clone())).unwrap();
        let mut w = vec![0u8; 4];
        let t = ShardedTensor::full("w", DType::U8, &[4], TensorData::Mut(&mut w)).with_replica_id(rank as u32);
        assert!(mgr.restore(StateTree::map().with("w", StateTree::Tensor(t)), comm).unwrap().is_none());
    });
}

/// A communicator that fails its `n`-th collective on one rank (that rank does not join it; its
/// peers time out), as a lost peer or a broken link does.
struct FailingComm {
    inner: InProcessComm,
    countdown: std::sync::atomic::AtomicI64,
    /// While set, collectives wait: the test changes the files between the staging of a save
    /// and its background commit.
    hold: std::sync::atomic::AtomicBool,
}

impl FailingComm {
    fn new(inner: InProcessComm) -> Arc<FailingComm> {
        Arc::new(FailingComm { inner, countdown: i64::MAX.into(), hold: false.into() })
    }

    fn tick(&self) -> tessera::Result<()> {
        while self.hold.load(std::sync::atomic::Ordering::SeqCst) {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        if self.countdown.fetch_sub(1, std::sync::atomic::Ordering::SeqCst) == 0 {
            return Err(tessera::Error::Comm { reason: "injected: collective failed".into() });
        }
        Ok(())
    }
}

impl Communicator for FailingComm {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_gather(&self, data: &[u8]) -> tessera::Result<Vec<Vec<u8>>> {
        self.tick()?;
        self.inner.all_gather(data)
    }
    fn broadcast(&self, data: &[u8], root: usize) -> tessera::Result<Vec<u8>> {
        self.tick()?;
        self.inner.broadcast(data, root)
    }
    fn all_to_all(&self, send: Vec<Vec<u8>>) -> tessera::Result<Vec<Vec<u8>>> {
        self.tick()?;
        self.inner.all_to_all(send)
    }
}

const SMALL: usize = 4;

fn small_opts(dir: &Path, rank: usize) -> ManagerOptions {
    ManagerOptions {
        memory: Some(
            MemoryTier::new(dir.join(format!("node{rank}")))
                .node(format!("node{rank}"))
                .redundancy(2, 1)
                .chunk_bytes(1024),
        ),
        persistent: Some(Location::local(dir.join("persistent"))),
        persist_every: 0,
        staging_bytes: 1 << 20,
        ..ManagerOptions::default()
    }
}

fn small_bytes(step: u64, rank: usize) -> Vec<u8> {
    (0..(500 + rank * 71)).map(|i| (i as u64 * 13 + step * 7 + rank as u64) as u8).collect()
}

fn small_state(rank: usize, w: &mut [u8]) -> StateTree<'_> {
    let key = format!("w{rank}");
    let n = w.len() as u64;
    StateTree::map()
        .with(&key, StateTree::Tensor(ShardedTensor::full(key.clone(), DType::U8, &[n], TensorData::Mut(w))))
}

/// Saves step 1, then step 2 with the background communicator failing its `fail_at`-th
/// collective (counted from step 2's start) on `fail_rank`; returns each rank's verdict of
/// step 2.
fn save_with_fault(dir: &Path, fail_rank: usize, fail_at: i64) -> Vec<tessera::Result<()>> {
    let bg = InProcessComm::group_with_timeout(SMALL, std::time::Duration::from_secs(2));
    let bg: Vec<Arc<FailingComm>> = bg.into_iter().map(FailingComm::new).collect();
    run_ranks(SMALL, |comm| {
        let rank = comm.rank();
        let mut mgr = CheckpointManager::new(small_opts(dir, rank), bg[rank].clone()).unwrap();
        let mut w = small_bytes(1, rank);
        mgr.save(1, small_state(rank, &mut w), comm).unwrap();
        mgr.wait().unwrap();
        comm.barrier().unwrap();
        if rank == fail_rank {
            bg[rank].countdown.store(fail_at, std::sync::atomic::Ordering::SeqCst);
        }
        let mut w = small_bytes(2, rank);
        mgr.save(2, small_state(rank, &mut w), comm).unwrap();
        mgr.wait()
    })
}

fn restore_small(dir: &Path) -> Vec<(u64, Tier)> {
    let bg = InProcessComm::group(SMALL);
    run_ranks(SMALL, |comm| {
        let rank = comm.rank();
        let mut mgr = CheckpointManager::new(small_opts(dir, rank), Arc::new(bg[rank].clone())).unwrap();
        let mut w = vec![0u8; small_bytes(0, rank).len()];
        let r = mgr.restore(small_state(rank, &mut w), comm).unwrap().expect("a step");
        let got = (r.step, r.tier);
        if !r.notes.is_empty() {
            eprintln!("rank {rank}: {:?}", r.notes);
        }
        drop(r);
        assert_eq!(w, small_bytes(got.0, rank), "rank {rank} restored step {} wrong", got.0);
        got
    })
}

fn markers(dir: &Path, step: u64) -> usize {
    (0..SMALL)
        .flat_map(|n| std::fs::read_dir(dir.join(format!("node{n}/step-{step:012}"))).into_iter().flatten())
        .map(|e| e.unwrap())
        .filter(|e| e.file_name().to_string_lossy().starts_with("commit-") && e.path().is_file())
        .count()
}

/// Every collective of a memory-tier commit failing, on each rank in turn: the step is either
/// committed whole (every shard written: it restores bit-exact) or committed nowhere (the
/// previous step restores); never a marker beside a missing shard.
#[test]
fn a_failed_collective_at_any_point_of_a_commit_never_leaves_a_half_step() {
    // Count the collectives of one step's commit: phase 1, one per round, the verdict.
    let probe = TempDir::created("memtier-probe");
    let verdicts = save_with_fault(probe.path(), 0, i64::MAX);
    assert!(verdicts.iter().all(|v| v.is_ok()));
    // Each copy is a data file plus an index; a round streams 1 KiB of the longest.
    let copy = |r: usize| {
        std::fs::read_dir(probe.join(&format!("node{r}/step-000000000002/rank-{r:06}")))
            .unwrap()
            .map(|e| e.unwrap().metadata().unwrap().len())
            .sum::<u64>()
    };
    let longest = (0..SMALL).map(copy).max().unwrap();
    assert!(longest > 1024, "{longest}");
    let collectives = 1 + longest.div_ceil(1024) as i64 + 1;
    let mut committed = 0;
    for fail_at in 0..collectives {
        let fail_rank = fail_at as usize % SMALL;
        let d = TempDir::created("memtier-fault");
        let verdicts = save_with_fault(d.path(), fail_rank, fail_at);
        assert!(verdicts[fail_rank].is_err(), "collective {fail_at} on rank {fail_rank} did not fail");
        let n = markers(d.path(), 2);
        let restored = restore_small(d.path());
        let want = if n > 0 { 2 } else { 1 };
        committed += usize::from(n > 0);
        assert!(restored.iter().all(|r| *r == (want, Tier::Memory)), "fault at {fail_at}: {restored:?}, {n} markers");
    }
    // Only a failure in the last collective (the verdict, after every shard is written) can
    // leave markers, and only on the ranks that saw every verdict.
    assert!(committed <= 1, "{committed} faults left a committed step");
}

/// A storage failure at each write of a memory-tier save (the copy's directory, its files, a
/// parity shard, a marker), on one rank: the step is committed nowhere, or (the marker, written
/// last) committed where the others wrote theirs, and the newest complete step restores.
#[test]
fn a_failed_write_at_any_point_of_a_memory_save_leaves_the_last_step_loadable() {
    // Each case blocks one path of step 2 with a directory (or a file) where the
    // save must write, as a full or read-only filesystem would fail it.
    let cases: [(&str, &str, u64); 4] = [
        ("the step directory", "node1/step-000000000002", 1),
        ("the copy's directory", "node1/step-000000000002/rank-000001", 1),
        // Groups {0, 1} and {2, 3}: node 0 holds the second group's parity.
        ("a parity shard", "node0/step-000000000002/parity-g000001-p000.bin", 1),
        ("the marker", "node1/step-000000000002/commit-r000001.json", 2),
    ];
    for (what, blocked, want) in cases {
        let d = TempDir::created("memtier-writefault");
        let bg: Vec<Arc<FailingComm>> = InProcessComm::group(SMALL).into_iter().map(FailingComm::new).collect();
        let verdicts = run_ranks(SMALL, |comm| {
            let rank = comm.rank();
            let mut mgr = CheckpointManager::new(small_opts(d.path(), rank), bg[rank].clone()).unwrap();
            let mut w = small_bytes(1, rank);
            mgr.save(1, small_state(rank, &mut w), comm).unwrap();
            mgr.wait().unwrap();
            comm.barrier().unwrap();
            // Paths the staging makes are blocked before it; the others (parity, marker) after
            // it, before the background commit runs.
            let early = !blocked.contains(".bin") && !blocked.contains("commit-");
            let block = || {
                let p = d.join(blocked);
                if !blocked.contains(".") {
                    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
                    std::fs::write(&p, b"not a directory").unwrap();
                } else {
                    std::fs::create_dir_all(p.join("blocked")).unwrap();
                }
            };
            bg[rank].hold.store(true, std::sync::atomic::Ordering::SeqCst);
            if early && rank == 1 {
                block();
            }
            comm.barrier().unwrap();
            let mut w = small_bytes(2, rank);
            let staged = mgr.save(2, small_state(rank, &mut w), comm);
            comm.barrier().unwrap();
            if !early && rank == 0 {
                block();
            }
            comm.barrier().unwrap();
            bg[rank].hold.store(false, std::sync::atomic::Ordering::SeqCst);
            (staged.is_ok(), mgr.wait())
        });
        assert!(verdicts.iter().any(|(s, v)| !s || v.is_err()), "{what}: no rank saw the failure");
        // The marker case: every shard was written, the other ranks committed.
        assert_eq!(markers(d.path(), 2) > 0, want == 2, "{what}");
        // Unblock, so that a restore's rebuild may write there, and restore.
        let p = d.join(blocked);
        if p.is_dir() {
            std::fs::remove_dir_all(&p).unwrap();
        } else {
            std::fs::remove_file(&p).unwrap();
        }
        for r in restore_small(d.path()) {
            assert_eq!(r, (want, Tier::Memory), "{what}");
        }
    }
}

/// The golden fixture of the memory tier's manifest version 1 (FORMAT.md): 4 ranks on 4 nodes,
/// RS(2, 1), step 5, committed. Regenerate (only when its format version changes) with
/// `cargo test -p tessera --test integration -- --ignored memory_tier::regenerate_golden_memory_tier_v1`.
const GOLDEN_MEMORY_TIER_V1: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/golden_memory_tier_v1");

fn golden_opts(dir: &Path, rank: usize) -> ManagerOptions {
    ManagerOptions {
        memory: Some(
            MemoryTier::new(dir.join(format!("node{rank}")))
                .node(format!("node{rank}"))
                .redundancy(2, 1)
                .chunk_bytes(512),
        ),
        persistent: None,
        ..ManagerOptions::default()
    }
}

#[test]
#[ignore = "writes the golden fixture; run only when the manifest's version changes"]
fn regenerate_golden_memory_tier_v1() {
    let dir = Path::new(GOLDEN_MEMORY_TIER_V1);
    let _ = std::fs::remove_dir_all(dir);
    let bg = InProcessComm::group(SMALL);
    run_ranks(SMALL, |comm| {
        let rank = comm.rank();
        let mut mgr = CheckpointManager::new(golden_opts(dir, rank), Arc::new(bg[rank].clone())).unwrap();
        let mut w = small_bytes(5, rank);
        mgr.save(5, small_state(rank, &mut w), comm).unwrap();
        mgr.wait().unwrap();
    });
}

#[test]
fn golden_memory_tier_v1_restores_forever_with_a_node_lost() {
    for lost in 0..SMALL {
        let d = fresh_copy(Path::new(GOLDEN_MEMORY_TIER_V1), "memtier-golden");
        lose_nodes(d.path(), &[lost]);
        let bg = InProcessComm::group(SMALL);
        run_ranks(SMALL, |comm| {
            let rank = comm.rank();
            let mut mgr = CheckpointManager::new(golden_opts(d.path(), rank), Arc::new(bg[rank].clone())).unwrap();
            let mut w = vec![0u8; small_bytes(0, rank).len()];
            let r = mgr.restore(small_state(rank, &mut w), comm).unwrap().expect("the golden step");
            assert_eq!((r.step, r.tier, r.rebuilt_ranks.clone()), (5, Tier::Memory, vec![lost]));
            drop(r);
            assert_eq!(w, small_bytes(5, rank), "rank {rank}");
        });
    }
}

/// A persistent step that one rank cannot open fails the restore on every rank, with that
/// rank's error, instead of leaving the others waiting in the collective load.
#[test]
fn a_persistent_step_one_rank_cannot_open_fails_every_rank_alike() {
    let d = TempDir::created("memtier-oneopen");
    let bg = InProcessComm::group(SMALL);
    run_ranks(SMALL, |comm| {
        let rank = comm.rank();
        let o = ManagerOptions { memory: None, ..small_opts(d.path(), rank) };
        let mut mgr = CheckpointManager::new(o, Arc::new(bg[rank].clone())).unwrap();
        let mut w = small_bytes(1, rank);
        mgr.save(1, small_state(rank, &mut w), comm).unwrap();
        mgr.wait().unwrap();
    });
    let bg = InProcessComm::group(SMALL);
    let verdicts = run_ranks(SMALL, |comm| {
        let rank = comm.rank();
        // Rank 2 looks for the persistent tier elsewhere (rank 0 lists the steps for all).
        let at = if rank == 2 { d.join("elsewhere") } else { d.join("persistent") };
        let o = ManagerOptions { memory: None, persistent: Some(Location::local(at)), ..small_opts(d.path(), rank) };
        let mut mgr = CheckpointManager::new(o, Arc::new(bg[rank].clone())).unwrap();
        let mut w = vec![0u8; small_bytes(0, rank).len()];
        mgr.restore(small_state(rank, &mut w), comm).map(|r| r.map(|r| r.step)).map_err(|e| e.to_string())
    });
    for (rank, v) in verdicts.iter().enumerate() {
        let e = v.as_ref().expect_err("no rank may restore");
        assert!(rank == 2 || e.contains("rank 2"), "rank {rank}: {e}");
    }
}

// ---------------------------------------------------------------------------------------------
// Every file call of the memory tier failing in turn (feature `fault-injection`).

use tessera::memory_tier::{FaultHook, FaultWhen};

/// One rank's file calls: counted while armed; the `fail`-th fails.
#[derive(Default)]
struct FileCalls {
    armed: std::sync::atomic::AtomicBool,
    count: std::sync::atomic::AtomicUsize,
    fail: Option<(usize, FaultWhen)>,
    /// (operation, path) of the failed call, once it happened.
    hit: std::sync::Mutex<Option<String>>,
}

impl FileCalls {
    fn hook(self: &Arc<Self>) -> FaultHook {
        let me = self.clone();
        Arc::new(move |op: &str, path: &Path| {
            if !me.armed.load(std::sync::atomic::Ordering::SeqCst) {
                return None;
            }
            let n = me.count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let (at, when) = me.fail?;
            (n == at).then(|| {
                *me.hit.lock().unwrap() = Some(format!("{op} {}", path.display()));
                when
            })
        })
    }
}

fn faulty_opts(dir: &Path, rank: usize, calls: Option<&Arc<FileCalls>>) -> ManagerOptions {
    let mut o = small_opts(dir, rank);
    o.keep_last_memory = 2;
    if let (Some(tier), Some(calls)) = (o.memory.take(), calls) {
        o.memory = Some(tier.fault_hook(calls.hook()));
    } else {
        o.memory = small_opts(dir, rank).memory;
    }
    o
}

/// A job's memory roots after steps 1 and 2.
fn two_steps_saved() -> TempDir {
    let d = TempDir::created("memtier-twosteps");
    let bg = InProcessComm::group(SMALL);
    run_ranks(SMALL, |comm| {
        let r = comm.rank();
        let mut mgr = CheckpointManager::new(faulty_opts(d.path(), r, None), Arc::new(bg[r].clone())).unwrap();
        for step in 1..=2 {
            let mut w = small_bytes(step, r);
            mgr.save(step, small_state(r, &mut w), comm).unwrap();
        }
        mgr.wait().unwrap();
    });
    d
}

/// Over a copy of `two_steps`, a new manager saves step 3 (its first save clears step 3 on,
/// its background job prunes step 1) with rank `rank`'s `fail`-th file call failing; each
/// rank's verdict of step 3 (its save and its background work), rank `rank`'s call count, and
/// the call that failed.
fn save_with_file_fault(
    two_steps: &Path,
    dir: &Path,
    rank: usize,
    fail: Option<(usize, FaultWhen)>,
) -> (Vec<bool>, usize, Option<String>) {
    copy_tree(two_steps, dir);
    let calls: Vec<Arc<FileCalls>> =
        (0..SMALL).map(|r| Arc::new(FileCalls { fail: fail.filter(|_| r == rank), ..FileCalls::default() })).collect();
    let bg = InProcessComm::group_with_timeout(SMALL, std::time::Duration::from_secs(5));
    let ok = run_ranks(SMALL, |comm| {
        let r = comm.rank();
        let mut mgr = CheckpointManager::new(faulty_opts(dir, r, Some(&calls[r])), Arc::new(bg[r].clone())).unwrap();
        calls[r].armed.store(true, std::sync::atomic::Ordering::SeqCst);
        let mut w = small_bytes(3, r);
        let staged = mgr.save(3, small_state(r, &mut w), comm).is_ok();
        let done = mgr.wait().is_ok();
        calls[r].armed.store(false, std::sync::atomic::Ordering::SeqCst);
        staged && done
    });
    let n = calls[rank].count.load(std::sync::atomic::Ordering::SeqCst);
    let hit = calls[rank].hit.lock().unwrap().clone();
    (ok, n, hit)
}

/// Restores with rank `rank`'s `fail`-th file call failing; each rank's result (step or error)
/// and rank `rank`'s call count. A restored step is checked byte for byte.
fn restore_with_file_fault(dir: &Path, rank: usize, fail: Option<(usize, FaultWhen)>) -> (Vec<Option<u64>>, usize) {
    let calls: Vec<Arc<FileCalls>> =
        (0..SMALL).map(|r| Arc::new(FileCalls { fail: fail.filter(|_| r == rank), ..FileCalls::default() })).collect();
    let bg = InProcessComm::group(SMALL);
    let got = run_ranks(SMALL, |comm| {
        let r = comm.rank();
        let mut mgr = CheckpointManager::new(faulty_opts(dir, r, Some(&calls[r])), Arc::new(bg[r].clone())).unwrap();
        calls[r].armed.store(true, std::sync::atomic::Ordering::SeqCst);
        let mut w = vec![0u8; small_bytes(0, r).len()];
        let step = mgr.restore(small_state(r, &mut w), comm).ok().flatten().map(|x| x.step);
        if let Some(s) = step {
            assert_eq!(w, small_bytes(s, r), "rank {r} restored step {s} wrong");
        }
        step
    });
    (got, calls[rank].count.load(std::sync::atomic::Ordering::SeqCst))
}

/// Every file call of a memory-tier save (the copy, the parity exchange, the marker, the
/// prune of the oldest step) and of a restore that rebuilds a lost node (the scan, the shards
/// read, the rebuilt copy written and renamed, the load), on each rank in turn, failing before
/// it takes effect or after: the newest complete step always restores, bit-exact. A save
/// reported done on every rank is the one restored; a failed restore loses nothing (the next
/// one restores the newest step from memory).
#[test]
fn a_failed_file_call_at_any_point_of_a_memory_save_or_restore_keeps_the_newest_step() {
    // RS(2, 1) on 4 nodes: groups {0, 1} and {2, 3}, the parity of the second on node 0.
    // Rank 0 (a member and a parity holder) and rank 1 (a member only) are swept in a save;
    // in a restore after node 0 is lost, rank 0 (rebuilding), rank 1 (sending its copy) and
    // rank 2 (sending the first group's parity).
    let two = two_steps_saved();
    let (mut cases, mut committed) = (0usize, 0usize);
    for rank in [0, 1] {
        let probe = TempDir::new("memtier-fileprobe");
        let (ok, calls, _) = save_with_file_fault(two.path(), probe.path(), rank, None);
        assert!(ok.iter().all(|x| *x) && calls > 10, "rank {rank}: {calls} calls");
        for at in 0..calls {
            for when in [FaultWhen::Before, FaultWhen::After] {
                let d = TempDir::new("memtier-filefault");
                let (ok, _, hit) = save_with_file_fault(two.path(), d.path(), rank, Some((at, when)));
                if hit.is_none() {
                    continue; // this run made fewer calls (the writer's threads vary)
                }
                cases += 1;
                let restored = restore_small(d.path());
                let step = restored[0].0;
                assert!(restored.iter().all(|r| *r == (step, Tier::Memory)), "{hit:?} {when:?}: {restored:?}");
                assert!(step == 3 || step == 2, "{hit:?} {when:?}: step {step}");
                if ok.iter().all(|x| *x) {
                    assert_eq!(step, 3, "{hit:?} {when:?}: every rank reported step 3 saved");
                }
                committed += usize::from(step == 3);
            }
        }
    }
    eprintln!("memory-tier save: {cases} file faults, {committed} left step 3 committed");

    // The restore: node 0 lost, so ranks 0's copy and group parity are rebuilt.
    let saved = TempDir::new("memtier-filesaved");
    let (ok, _, _) = save_with_file_fault(two.path(), saved.path(), 0, None);
    assert!(ok.iter().all(|x| *x));
    let mut restores = 0usize;
    for rank in [0, 1, 2] {
        let probe = fresh_copy(saved.path(), "memtier-rprobe");
        lose_nodes(probe.path(), &[0]);
        let (got, calls) = restore_with_file_fault(probe.path(), rank, None);
        assert!(got.iter().all(|s| *s == Some(3)), "{got:?}");
        for at in 0..calls {
            for when in [FaultWhen::Before, FaultWhen::After] {
                let d = fresh_copy(saved.path(), "memtier-rfault");
                lose_nodes(d.path(), &[0]);
                let (got, _) = restore_with_file_fault(d.path(), rank, Some((at, when)));
                // Every rank alike: the same step, or every rank failed.
                assert!(got.iter().all(|s| *s == got[0]), "rank {rank} call {at} {when:?}: {got:?}");
                restores += 1;
                let (again, _) = restore_with_file_fault(d.path(), rank, None);
                assert!(again.iter().all(|s| *s == Some(3)), "after rank {rank} call {at} {when:?}: {again:?}");
            }
        }
    }
    eprintln!("memory-tier restore: {restores} file faults, each followed by a restore of step 3");
}
