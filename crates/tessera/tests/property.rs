//! Property tests: random tensors (ndim 0–4, every dtype), random partitions into boxes and
//! flattened ranges, random replication, saved at a random world size A and loaded at a random
//! world size B in another random layout — every byte must match the global truth. Plus the
//! pure geometry (`check_tiling`, `decompose_flat`) against brute force.
//!
//! Reproduce a failing seed with `TESSERA_SEED=<seed> cargo test -p tessera --test integration property::`;
//! run more seeds with `TESSERA_SEEDS=<count>`.

use std::collections::BTreeMap;
use std::ops::Range;

use crate::common::*;
use tessera::__plan::geometry::{check_tiling, decompose_flat, Piece};
use tessera::__plan::load::ReadTuning;
use tessera::storage::*;
use tessera::tools::*;
use tessera::*;

/// One global tensor of a case and its contents.
struct TensorSpec {
    key: String,
    dtype: DType,
    shape: Vec<u64>,
    truth: Vec<u8>,
}

/// A piece of a tensor as a rank describes it.
#[derive(Debug, Clone)]
struct Part {
    tensor: usize,
    off: Vec<u64>,
    shape: Vec<u64>,
    flat: Option<Range<u64>>,
    prepend: usize,
}

struct SaveShard {
    part: Part,
    replica: ReplicaId,
    /// Main replicas: the true bytes. Other replicas: garbage (must never be written) or none.
    data: Option<Vec<u8>>,
    borrowed: bool,
}

struct SaveObject {
    cell: Vec<u64>,
    replica: ReplicaId,
    data: Vec<u8>,
}

struct LoadReq {
    part: Part,
    /// Caller's buffer (prefilled with garbage) or `TensorData::None` (allocated by load).
    in_place: bool,
}

fn random_shape(rng: &mut Rng) -> Vec<u64> {
    let ndim = rng.below(5) as usize;
    let max = [0, 10, 7, 5, 4][ndim];
    (0..ndim).map(|_| if rng.chance(1, 30) { 0 } else { rng.range(1, max) }).collect()
}

/// Random partition of `[0, shape)` into boxes by repeatedly splitting a random box along a
/// random axis at a random point.
fn random_boxes(rng: &mut Rng, shape: &[u64], max_splits: u64) -> Vec<(Vec<u64>, Vec<u64>)> {
    let mut boxes = vec![(vec![0u64; shape.len()], shape.to_vec())];
    for _ in 0..rng.below(max_splits + 1) {
        let i = rng.index(boxes.len());
        let (off, sh) = boxes[i].clone();
        let axes: Vec<usize> = (0..sh.len()).filter(|&d| sh[d] >= 2).collect();
        if axes.is_empty() {
            continue;
        }
        let d = *rng.pick(&axes);
        let cut = rng.range(1, sh[d] - 1);
        let (mut off2, mut sh2) = (off, sh);
        boxes[i].1[d] = cut;
        off2[d] += cut;
        sh2[d] -= cut;
        boxes.push((off2, sh2));
    }
    boxes
}

/// Cuts `[0, n)` at 1–3 random points (empty ranges allowed).
fn flat_split(rng: &mut Rng, n: u64) -> Vec<Range<u64>> {
    let mut cuts: Vec<u64> = (0..rng.range(1, 3)).map(|_| rng.range(0, n)).collect();
    cuts.sort_unstable();
    let mut out = Vec::new();
    let mut prev = 0;
    for c in cuts.into_iter().chain(std::iter::once(n)) {
        out.push(prev..c);
        prev = c;
    }
    out
}

/// A random layout of one tensor: boxes, some cut into flattened ranges, with a random number
/// of prepended axes where the box starts with size-1 axes.
fn random_parts(rng: &mut Rng, tensor: usize, shape: &[u64]) -> Vec<Part> {
    let mut parts = Vec::new();
    for (off, sh) in random_boxes(rng, shape, 5) {
        let leading_ones = sh.iter().take_while(|&&x| x == 1).count();
        let flats: Vec<Option<Range<u64>>> =
            if rng.chance(1, 3) { flat_split(rng, numel(&sh)).into_iter().map(Some).collect() } else { vec![None] };
        for flat in flats {
            let prepend = rng.below(leading_ones as u64 + 1) as usize;
            parts.push(Part { tensor, off: off.clone(), shape: sh.clone(), flat, prepend });
        }
    }
    parts
}

fn nonzero_replica(rng: &mut Rng) -> ReplicaId {
    match rng.below(3) {
        0 => ReplicaId::from(rng.range(1, 7) as u32),
        1 => ReplicaId::from([0, rng.range(1, 3) as u32]),
        _ => ReplicaId::from([rng.range(1, 2) as u32, rng.below(3) as u32, 0]),
    }
}

fn part_bytes(spec: &TensorSpec, p: &Part) -> Vec<u8> {
    shard_bytes(&spec.truth, &spec.shape, spec.dtype.size(), &p.off, &p.shape, p.flat.as_ref())
}

fn part_nbytes(spec: &TensorSpec, p: &Part) -> usize {
    let n = p.flat.as_ref().map_or(numel(&p.shape), |r| r.end - r.start);
    n as usize * spec.dtype.size()
}

fn cells(grid: &[u64]) -> Vec<Vec<u64>> {
    let mut out = Vec::new();
    let zeros = vec![0u64; grid.len()];
    for_each_in_box(grid, &zeros, grid, &mut |lin| {
        let mut cell = vec![0u64; grid.len()];
        let mut rest = lin;
        for d in (0..grid.len()).rev() {
            cell[d] = rest % grid[d];
            rest /= grid[d];
        }
        out.push(cell);
    });
    out
}

fn save_load_case(seed: u64) {
    save_load_case_worlds(seed, 1..=4, 1..=4);
}

fn save_load_case_worlds(
    seed: u64,
    save_worlds: std::ops::RangeInclusive<u64>,
    load_worlds: std::ops::RangeInclusive<u64>,
) {
    let mut rng = Rng::new(seed);
    let names = ["model.layers.0.weight", "optimizer/état.exp_avg", "x"];
    let tensors: Vec<TensorSpec> = (0..rng.range(1, 3))
        .map(|i| {
            let dtype = *rng.pick(&DType::ALL);
            let shape = random_shape(&mut rng);
            let truth = rng.bytes(numel(&shape) as usize * dtype.size());
            TensorSpec { key: format!("{}{i}", rng.pick(&names)), dtype, shape, truth }
        })
        .collect();
    let save_world = rng.range(*save_worlds.start(), *save_worlds.end()) as usize;
    let load_world = rng.range(*load_worlds.start(), *load_worlds.end()) as usize;

    // Save layout: every part is a main replica on some rank, some have extra replicas.
    let mut save_shards: Vec<Vec<SaveShard>> = (0..save_world).map(|_| Vec::new()).collect();
    let mut mains = 0usize;
    // Fully-parallel save: replicas hold the true bytes (or none) and may be chosen to write.
    // Otherwise replicas may hold garbage, which must never be written.
    let distribute = rng.chance(1, 2);
    for (ti, spec) in tensors.iter().enumerate() {
        for part in random_parts(&mut rng, ti, &spec.shape) {
            let data = part_bytes(spec, &part);
            if rng.chance(1, 3) {
                for _ in 0..rng.range(1, 2) {
                    let garbage = match distribute {
                        true => rng.chance(1, 2).then(|| data.clone()),
                        false => rng.chance(1, 2).then(|| rng.bytes(data.len())),
                    };
                    let r = rng.index(save_world);
                    save_shards[r].push(SaveShard {
                        part: part.clone(),
                        replica: nonzero_replica(&mut rng),
                        data: garbage,
                        borrowed: rng.chance(1, 2),
                    });
                }
            }
            let r = rng.index(save_world);
            let borrowed = rng.chance(1, 2);
            save_shards[r].push(SaveShard { part, replica: ReplicaId::main(), data: Some(data), borrowed });
            mains += 1;
        }
    }
    for shards in &mut save_shards {
        rng.shuffle(shards);
    }

    // A sharded object over a small grid, main shards spread over ranks, plus replicas.
    let grid: Vec<u64> = (0..rng.range(1, 2)).map(|_| rng.range(1, 3)).collect();
    let grid_cells = cells(&grid);
    let object_truth: Vec<Vec<u8>> = grid_cells
        .iter()
        .map(|_| {
            // Non-empty: an empty object trips a library bug, covered in semantics.rs.
            let n = rng.range(1, 40) as usize;
            rng.bytes(n)
        })
        .collect();
    let mut save_objects: Vec<Vec<SaveObject>> = (0..save_world).map(|_| Vec::new()).collect();
    for (ci, cell) in grid_cells.iter().enumerate() {
        save_objects[rng.index(save_world)].push(SaveObject {
            cell: cell.clone(),
            replica: ReplicaId::main(),
            data: object_truth[ci].clone(),
        });
        if rng.chance(1, 3) {
            let garbage = rng.bytes(7);
            save_objects[rng.index(save_world)].push(SaveObject {
                cell: cell.clone(),
                replica: nonzero_replica(&mut rng),
                data: garbage,
            });
        }
    }

    let block_size = *rng.pick(&[16u64, 17, 32, 64, 100, 256]);
    let tmp = TempDir::new("prop");
    let mem = MemoryStorage::new();
    let local;
    let storage: &dyn Storage = if rng.chance(1, 4) {
        local = LocalStorage::new(tmp.path());
        &local
    } else {
        &mem
    };

    let reports = run_ranks(save_world, |c| {
        let r = c.rank();
        let mut per_key: BTreeMap<String, Vec<StateTree<'_>>> = BTreeMap::new();
        for s in &save_shards[r] {
            let spec = &tensors[s.part.tensor];
            let data = match (&s.data, s.borrowed) {
                (None, _) => TensorData::None,
                (Some(b), true) => TensorData::Ref(b),
                (Some(b), false) => TensorData::Owned(b.clone()),
            };
            let mut t = shard(
                &spec.key,
                spec.dtype,
                &spec.shape,
                &s.part.off,
                &s.part.shape,
                s.part.prepend,
                s.part.flat.clone(),
                data,
            );
            t.replica_id = s.replica.clone();
            per_key.entry(format!("t{}", s.part.tensor)).or_default().push(StateTree::Tensor(t));
        }
        let objects: Vec<StateTree<'_>> = save_objects[r]
            .iter()
            .map(|o| {
                StateTree::Object(
                    ShardedObject::new("rng_state", o.data.clone(), &grid, &o.cell).with_replica_id(o.replica.clone()),
                )
            })
            .collect();
        let tree = StateTree::map()
            .with("tensors", StateTree::Map(per_key.into_iter().map(|(k, v)| (k, StateTree::List(v))).collect()))
            .with("objects", StateTree::List(objects))
            .with("step", StateTree::Value(Value::Int(if r == 0 { seed as i64 } else { -1 })))
            .with("local", StateTree::NonPersistent(Value::Str(format!("rank {r}"))));
        let opts = SaveOptions { distribute_replicas: distribute, ..small_blocks(block_size) };
        save(tree, storage, c, &opts).map_err(|e| e.to_string())
    });
    let reports: Vec<SaveReport> = reports
        .into_iter()
        .enumerate()
        .map(|(r, x)| x.unwrap_or_else(|e| panic!("save rank {r} of {save_world}: {e}")))
        .collect();
    let total_bytes: u64 = tensors.iter().map(|t| t.truth.len() as u64).sum();
    let writers = match distribute {
        // Writers move to replicas: every rank holding a main shard or a replica with data may write.
        true => reports.iter().filter(|r| r.file.is_some()).count(),
        false => (0..save_world)
            .filter(|&r| {
                save_shards[r].iter().any(|s| s.replica.is_main())
                    || save_objects[r].iter().any(|o| o.replica.is_main())
            })
            .count(),
    };
    for rep in &reports {
        assert_eq!(rep.chunks, mains, "chunks in the save report");
        assert_eq!(rep.total_tensor_bytes, total_bytes, "tensor bytes in the save report");
        assert_eq!(rep.files, writers, "data files in the save report");
    }
    let files = data_files(storage);
    assert_eq!(files.len(), writers, "data files on storage: {files:?}");
    let written: u64 = reports.iter().map(|r| r.bytes_written).sum();
    let on_disk: u64 = files.iter().map(|f| storage.size(f).unwrap()).sum();
    assert_eq!(written, on_disk);

    // Load layout: another random partition over another world size, some parts requested twice.
    let mut load_reqs: Vec<Vec<LoadReq>> = (0..load_world).map(|_| Vec::new()).collect();
    for (ti, spec) in tensors.iter().enumerate() {
        for part in random_parts(&mut rng, ti, &spec.shape) {
            if rng.chance(1, 4) {
                load_reqs[rng.index(load_world)].push(LoadReq { part: part.clone(), in_place: rng.chance(1, 2) });
            }
            load_reqs[rng.index(load_world)].push(LoadReq { part, in_place: rng.chance(2, 3) });
        }
    }
    let mut load_objects: Vec<Vec<usize>> = (0..load_world).map(|_| Vec::new()).collect();
    for ci in 0..grid_cells.len() {
        load_objects[rng.index(load_world)].push(ci);
        if rng.chance(1, 4) {
            load_objects[rng.index(load_world)].push(ci);
        }
    }
    let opts = LoadOptions {
        verify_checksums: rng.chance(3, 4),
        strict: *rng.pick(&[
            StrictHandling::AssumeOkUnexpected,
            StrictHandling::RaiseAll,
            StrictHandling::ReturnAll,
            StrictHandling::IgnoreAll,
        ]),
        threads: rng.range(1, 3) as usize,
        tuning: ReadTuning {
            max_span: *rng.pick(&[1u64, 16, 100, 4096, 8 << 20]),
            max_gap: *rng.pick(&[0u64, 8, 1000, 64 << 10]),
        },
        ..LoadOptions::default()
    };
    let opened = rng.chance(1, 2).then(|| open(storage).unwrap());
    let ctx = format!(
        "save world {save_world}, load world {load_world}, block {block_size}, {opts:?}, tensors {:?}",
        tensors.iter().map(|t| (&t.key, t.dtype, &t.shape)).collect::<Vec<_>>()
    );

    let outcomes = run_ranks(load_world, |c| -> Result<(), String> {
        let r = c.rank();
        let reqs = &load_reqs[r];
        let mut bufs: Vec<Vec<u8>> = reqs
            .iter()
            .map(|q| if q.in_place { vec![0xA5; part_nbytes(&tensors[q.part.tensor], &q.part)] } else { Vec::new() })
            .collect();
        let mut per_key: BTreeMap<String, Vec<StateTree<'_>>> = BTreeMap::new();
        for (q, buf) in reqs.iter().zip(bufs.iter_mut()) {
            let spec = &tensors[q.part.tensor];
            let data = if q.in_place { TensorData::Mut(buf.as_mut_slice()) } else { TensorData::None };
            let t = shard(
                &spec.key,
                spec.dtype,
                &spec.shape,
                &q.part.off,
                &q.part.shape,
                q.part.prepend,
                q.part.flat.clone(),
                data,
            );
            per_key.entry(format!("t{}", q.part.tensor)).or_default().push(StateTree::Tensor(t));
        }
        let objects: Vec<StateTree<'_>> = load_objects[r]
            .iter()
            .map(|&ci| {
                StateTree::Object(ShardedObject {
                    key: "rng_state".into(),
                    data: None,
                    global_shape: grid.clone(),
                    global_offset: grid_cells[ci].clone(),
                    replica_id: ReplicaId::main(),
                })
            })
            .collect();
        let tree = StateTree::map()
            .with("tensors", StateTree::Map(per_key.into_iter().map(|(k, v)| (k, StateTree::List(v))).collect()))
            .with("objects", StateTree::List(objects))
            .with("local", StateTree::NonPersistent(Value::Int(r as i64)));
        let res = match &opened {
            Some(ckpt) => ckpt.load(tree, c, &opts),
            None => load(tree, storage, c, &opts),
        }
        .map_err(|e| format!("load on rank {r}: {e}"))?;
        if !res.unexpected_keys.is_empty() || !res.missing_keys.is_empty() {
            return Err(format!("key mismatch reported: {:?} {:?}", res.unexpected_keys, res.missing_keys));
        }
        // Every leaf holds what its own description says it should.
        let mut leaves = 0usize;
        let mut errors = Vec::new();
        res.state.for_each_leaf(&mut |path, leaf| match leaf {
            StateTree::Tensor(t) => {
                leaves += 1;
                let spec = tensors.iter().find(|s| s.key == t.key).expect("loaded key was requested");
                if t.data.bytes() != Some(&expected_for(t, &spec.truth, &spec.shape)[..]) {
                    errors.push(format!(
                        "tensor {:?} at {} (offset {:?}, box {:?}, flat {:?}) differs",
                        t.key,
                        path_string(path),
                        t.global_offset,
                        t.box_shape(),
                        t.flattened_range
                    ));
                }
            }
            StateTree::Object(o) => {
                let ci = grid_cells.iter().position(|c| *c == o.global_offset).unwrap();
                if o.data.as_deref() != Some(&object_truth[ci][..]) {
                    errors.push(format!("object shard {:?} differs", o.global_offset));
                }
            }
            _ => {}
        });
        if leaves != reqs.len() {
            errors.push(format!("{leaves} tensors returned, {} requested", reqs.len()));
        }
        if res.state.get_dotted("step").and_then(StateTree::as_value) != Some(&Value::Int(seed as i64)) {
            errors.push(format!("common value step = {:?}, rank 0 saved {seed}", res.state.get_dotted("step")));
        }
        match res.state.get_dotted("local") {
            Some(StateTree::NonPersistent(Value::Int(x))) if *x == r as i64 => {}
            other => errors.push(format!("non-persistent value came back as {other:?}")),
        }
        drop(res);
        // Buffers given by the caller were filled in place.
        for (q, buf) in reqs.iter().zip(&bufs) {
            if q.in_place && *buf != part_bytes(&tensors[q.part.tensor], &q.part) {
                errors.push(format!("caller buffer of {:?} not filled in place", q.part));
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(format!("rank {r}: {}", errors.join("; ")))
        }
    });
    for o in outcomes {
        if let Err(e) = o {
            panic!("{e}\n  case: {ctx}");
        }
    }

    let plain = open(storage)
        .and_then(|c| c.read_tensors(None))
        .unwrap_or_else(|e| panic!("load_plain_tensors: {e}\n  case: {ctx}"));
    assert_eq!(plain.len(), tensors.len());
    for spec in &tensors {
        let p = &plain[&spec.key];
        assert_eq!((p.dtype, &p.shape), (spec.dtype, &spec.shape), "plain tensor {:?}", spec.key);
        assert!(p.data == spec.truth, "plain tensor {:?} differs from the truth; case: {ctx}", spec.key);
    }
    let report = verify(storage, 2).unwrap();
    assert!(report.problems.is_empty(), "verify: {:?}", report.problems);
    assert_eq!(report.chunks, mains);
}

#[test]
fn save_at_world_a_load_at_world_b_in_random_layouts() {
    for_each_seed("save_at_world_a_load_at_world_b_in_random_layouts", 300, save_load_case);
}

#[test]
fn many_ranks_save_and_few_load_and_the_reverse() {
    for_each_seed("many_ranks (16 -> 1..5)", 15, |seed| save_load_case_worlds(1_000_000 + seed, 12..=16, 1..=5));
    for_each_seed("many_ranks (1..3 -> 16)", 15, |seed| save_load_case_worlds(2_000_000 + seed, 1..=3, 12..=16));
}

/// Coverage count per cell, by brute force: a tiling covers every cell exactly once, with no
/// non-empty box outside the global shape. (Empty boxes cover nothing; an empty tensor is
/// trivially tiled.)
fn brute_force_tiles(global: &[u64], pieces: &[Piece]) -> bool {
    if numel(global) == 0 {
        return true;
    }
    let mut count = vec![0u32; numel(global) as usize];
    for p in pieces {
        if numel(&p.shape) == 0 {
            continue;
        }
        if (0..global.len()).any(|d| p.off[d] + p.shape[d] > global[d]) {
            return false;
        }
        for_each_in_box(global, &p.off, &p.shape, &mut |lin| count[lin as usize] += 1);
    }
    count.iter().all(|&c| c == 1)
}

fn tiling_case(seed: u64) {
    let mut rng = Rng::new(seed);
    let ndim = rng.below(4) as usize;
    let global: Vec<u64> = (0..ndim).map(|_| rng.range(1, 4)).collect();
    let mut boxes: Vec<(Vec<u64>, Vec<u64>)> = if rng.chance(1, 2) {
        // An exact tiling, often perturbed.
        let mut b = random_boxes(&mut rng, &global, 6);
        match rng.below(6) {
            0 if b.len() > 1 => {
                let i = rng.index(b.len());
                b.remove(i);
            }
            1 => {
                let i = rng.index(b.len());
                b.push(b[i].clone());
            }
            2 if ndim > 0 => {
                let i = rng.index(b.len());
                let d = rng.index(ndim);
                b[i].1[d] += 1;
            }
            3 if ndim > 0 => {
                let i = rng.index(b.len());
                let d = rng.index(ndim);
                if b[i].0[d] > 0 {
                    b[i].0[d] -= 1;
                } else {
                    b[i].0[d] += 1;
                }
            }
            4 if ndim > 0 => {
                let d = rng.index(ndim);
                b.push((vec![0; ndim], (0..ndim).map(|x| if x == d { 0 } else { global[x] }).collect()));
            }
            _ => {}
        }
        b
    } else {
        (0..rng.range(0, 5))
            .map(|_| {
                let off: Vec<u64> = global.iter().map(|&g| rng.below(g)).collect();
                let shape: Vec<u64> = global
                    .iter()
                    .zip(&off)
                    .map(|(&g, &o)| rng.range(0, g - o) + u64::from(rng.chance(1, 10)))
                    .collect();
                (off, shape)
            })
            .collect()
    };
    rng.shuffle(&mut boxes);
    let pieces: Vec<Piece> = boxes.iter().map(|(o, s)| Piece::new(o, s)).collect();
    let want = brute_force_tiles(&global, &pieces);
    let got = check_tiling(&global, &pieces);
    assert_eq!(got.is_ok(), want, "global {global:?}, boxes {boxes:?}: check_tiling says {got:?}");
}

#[test]
fn check_tiling_agrees_with_brute_force() {
    for_each_seed("check_tiling_agrees_with_brute_force", 3000, tiling_case);
}

fn decompose_case(seed: u64) {
    let mut rng = Rng::new(seed);
    let ndim = rng.range(1, 4) as usize;
    let off: Vec<u64> = (0..ndim).map(|_| rng.below(3)).collect();
    let shape: Vec<u64> = (0..ndim).map(|_| rng.range(1, 4)).collect();
    let global: Vec<u64> = off.iter().zip(&shape).map(|(o, s)| o + s + rng.below(2)).collect();
    let n = numel(&shape);
    let s = rng.range(0, n);
    let e = rng.range(s, n);
    let pieces = decompose_flat(&off, &shape, s, e);
    assert!(pieces.len() < 2 * ndim, "{} pieces for ndim {ndim}", pieces.len());
    let mut all = Vec::new();
    for_each_in_box(&global, &off, &shape, &mut |lin| all.push(lin));
    let mut got = Vec::new();
    for p in &pieces {
        for_each_in_box(&global, &p.off, &p.shape, &mut |lin| got.push(lin));
    }
    assert_eq!(got, all[s as usize..e as usize], "box {off:?}+{shape:?} range {s}..{e}: {pieces:?}");
}

#[test]
fn decompose_flat_covers_exactly_the_range_in_order() {
    for_each_seed("decompose_flat_covers_exactly_the_range_in_order", 2000, decompose_case);
}
