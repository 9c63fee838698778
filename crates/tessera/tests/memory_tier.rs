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
    ManagerOptions {
        memory: Some(
            MemoryTier::new(dir.join(format!("node{}", node_of(rank, world))))
                .node(format!("node{}", node_of(rank, world)))
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
    let bg = InProcessComm::group(WORLD);
    run_ranks(WORLD, |comm| {
        let rank = comm.rank();
        let mut mgr = CheckpointManager::new(opts(dir, rank, WORLD), Arc::new(bg[rank].clone())).unwrap();
        for step in 1..=last {
            let per = (PER_RANK * 4) as usize;
            let mut w = truth_w(step, WORLD)[rank * per..(rank + 1) * per].to_vec();
            let mut mine = own(step, rank);
            let mut b = vec![step as u8; 64];
            let obj = Some(format!("rng of {rank} at {step}").into_bytes());
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
    let bg = InProcessComm::group(world);
    run_ranks(world, |comm| {
        let rank = comm.rank();
        let mut mgr = CheckpointManager::new(opts(dir, rank, world), Arc::new(bg[rank].clone())).unwrap();
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

#[test]
fn a_corrupt_surviving_shard_fails_the_rebuild_and_falls_back() {
    let saved = saved_job(3);
    let d = fresh_copy(saved.path(), "memtier-corrupt");
    lose_nodes(d.path(), &[0]);
    // Flip a byte in every parity file and every copy on node 1: whatever node 0's ranks
    // decode from is wrong somewhere, and the rebuilt copy's checksum says so.
    let step = d.join("node1/step-000000000003");
    for e in walk(&step) {
        if e.extension().is_some_and(|x| x == "bin") || e.to_string_lossy().contains("rank-") {
            let mut b = std::fs::read(&e).unwrap();
            if !b.is_empty() {
                b[0] ^= 0xff;
                std::fs::write(&e, b).unwrap();
            }
        }
    }
    for o in restore(d.path(), WORLD, 3) {
        assert_eq!((o.step, o.tier), (3, Tier::Persistent), "{:?}", o.notes);
        assert!(o.notes.iter().any(|n| n.contains("failed to restore")), "{:?}", o.notes);
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
