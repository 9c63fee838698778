//! Indexes that look valid but are not (correct checksums, wrong content) are refused by the
//! one validation gate before anything reads by them: overlapping chunks, element counts that
//! wrap, chunks outside their tensor or file, in the native format and in foreign ones (OLMo-
//! core's `metadata.json`). `verify` reports each defect and never calls such a checkpoint sound.

use std::ops::Range;

use crate::common::files::copy_dir;
use crate::common::*;
use tessera::comm::*;
use tessera::index::*;
use tessera::storage::*;
use tessera::tools::*;
use tessera::*;

/// Rows `rows` (all 4 columns) of the `[4, 4]` f32 tensor `w`, holding `fill`.
fn rows(rows: Range<u64>, fill: f32) -> ShardedTensor<'static> {
    let n = ((rows.end - rows.start) * 4) as usize;
    let data = TensorData::Owned(f32_bytes(&vec![fill; n]));
    shard("w", DType::F32, &[4, 4], &[rows.start, 0], &[rows.end - rows.start, 4], 0, None, data)
}

fn request(rows: Range<u64>) -> StateTree<'static> {
    let t = shard("w", DType::F32, &[4, 4], &[rows.start, 0], &[rows.end - rows.start, 4], 0, None, TensorData::None);
    StateTree::map().with("w", StateTree::Tensor(t))
}

/// A committed two-rank checkpoint of `w` (rows 0..2 hold 1.0, rows 2..4 hold 2.0).
fn saved() -> MemoryStorage {
    let storage = MemoryStorage::new();
    let out = run_ranks(2, |c| {
        let r = c.rank() as u64;
        let tree = StateTree::map().with("w", StateTree::Tensor(rows(2 * r..2 * r + 2, 1.0 + r as f32)));
        save(tree, &storage, c, &small_blocks(16))
    });
    for r in out {
        r.unwrap();
    }
    storage
}

/// Rewrites the committed index of `storage` through `edit` (the index stays self-consistent:
/// `encode` computes its checksums).
fn rewrite(storage: &MemoryStorage, edit: impl FnOnce(&mut CheckpointIndex)) {
    let mut index = CheckpointIndex::from_bytes(&storage.read("tessera.index").unwrap(), "orig").unwrap();
    edit(&mut index);
    storage.put_atomic("tessera.index", &index.encode()).unwrap();
}

/// Replaces the chunks of tensor `key`.
fn edit_chunks(index: &mut CheckpointIndex, key: &str, edit: impl FnOnce(&mut Vec<StoredChunk>, &mut Vec<u64>)) {
    let i = index.tensors.iter().position(|t| t.key == key).unwrap();
    let t = index.tensors.remove(i);
    let (dtype, mut shape) = (t.dtype, t.global_shape.clone());
    let mut chunks = t.into_chunks();
    edit(&mut chunks, &mut shape);
    index.tensors.insert(i, TensorEntry::new(key.into(), dtype, shape, chunks));
}

#[track_caller]
fn assert_corrupt_index<T: std::fmt::Debug>(r: Result<T>, file: &str, words: &[&str]) {
    match r {
        Err(Error::Corrupt { path, reason }) => {
            assert!(path.to_string_lossy().ends_with(file), "names {path:?}, expected {file}");
            for w in words {
                assert!(reason.contains(w), "{reason:?} lacks {w:?}");
            }
        }
        other => panic!("expected Corrupt naming {file}, got {other:?}"),
    }
}

#[track_caller]
fn assert_verify_reports(storage: &dyn Storage, words: &[&str]) {
    let report = verify(storage, 2).unwrap();
    assert!(
        report.problems.iter().any(|p| words.iter().all(|w| p.contains(w))),
        "verify should report {words:?}: {:?}",
        report.problems
    );
}

#[test]
fn overlapping_chunks_with_correct_checksums_are_refused_not_loaded() {
    let storage = saved();
    // Rank 1's chunk claims rows 1..3: its checksums still match its bytes, and the two chunks
    // would write row 1 both (the old behaviour: Ok, with whichever thread wrote last).
    rewrite(&storage, |ix| edit_chunks(ix, "w", |chunks, _| chunks[1].offset[0] = 1));
    let mut target = vec![0u8; 64];
    let t = shard("w", DType::F32, &[4, 4], &[0, 0], &[4, 4], 0, None, TensorData::Mut(&mut target));
    let tree = StateTree::map().with("w", StateTree::Tensor(t));
    assert_corrupt_index(load(tree, &storage, &SoloComm, &load_opts()), "tessera.index", &["\"w\"", "overlap"]);
    assert!(target.iter().all(|&b| b == 0), "nothing was written into the target");
    assert_corrupt_index(open(&storage).map(Checkpoint::into_index), "tessera.index", &["overlap"]);
    assert_verify_reports(&storage, &["\"w\"", "overlap"]);
    // Every rank of a collective load is refused, none left waiting.
    let out = run_ranks(2, |c| load(request(0..2), &storage, c, &load_opts()).map(|_| ()));
    for r in out {
        assert_corrupt_index(r, "tessera.index", &["overlap"]);
    }
}

#[test]
fn element_counts_that_wrap_are_refused_and_never_called_sound() {
    let storage = saved();
    // 2^32 x 2^32 elements: 2^64 wraps to 0 in u64 arithmetic.
    rewrite(&storage, |ix| {
        edit_chunks(ix, "w", |chunks, shape| {
            *shape = vec![1 << 32, 1 << 32];
            chunks.truncate(1);
        })
    });
    assert_corrupt_index(open(&storage).map(Checkpoint::into_index), "tessera.index", &["\"w\"", "2^64"]);
    assert_verify_reports(&storage, &["\"w\"", "2^64"]);
    assert!(!verify(&storage, 2).unwrap().problems.is_empty());
    let out = std::env::temp_dir().join(format!("tessera-wrap-{}.safetensors", std::process::id()));
    let r = export_safetensors(&storage, &out, &ExportOptions::default(), &mut |_, _| {});
    assert_corrupt_index(r, "tessera.index", &["2^64"]);
    assert!(!out.exists(), "no output was written");
}

#[test]
fn chunks_outside_their_tensor_or_file_are_refused() {
    type Edit = fn(&mut Vec<StoredChunk>, &mut Vec<u64>);
    let cases: [(Edit, &str); 4] = [
        (|c, _| c[1].offset[0] = 3, "outside the global shape"),
        (|c, _| c[1].offset[0] = u64::MAX, "outside the global shape"),
        (|c, _| c[1].byte_offset = u64::MAX - 8, "overflows"),
        (|c, _| c[1].file = 9, "names file #9"),
    ];
    for (edit, words) in cases {
        let storage = saved();
        rewrite(&storage, |ix| edit_chunks(ix, "w", edit));
        assert_corrupt_index(load(request(0..4), &storage, &SoloComm, &load_opts()), "tessera.index", &[words]);
        assert_verify_reports(&storage, &["\"w\"", words]);
    }
}

#[test]
fn a_gap_is_reported_and_only_loads_touching_it_fail() {
    let storage = saved();
    rewrite(&storage, |ix| edit_chunks(ix, "w", |chunks, _| chunks.truncate(1)));
    load(request(0..2), &storage, &SoloComm, &load_opts()).unwrap();
    match load(request(1..3), &storage, &SoloComm, &load_opts()) {
        Err(Error::NotCovered { key, .. }) => assert_eq!(key, "w"),
        other => panic!("{other:?}"),
    }
    assert_verify_reports(&storage, &["\"w\"", "gap", "[2, 0]"]);
}

/// A copy of an OLMo-core fixture whose `metadata.json` is edited by `edit`.
fn olmo_copy(name: &str, edit: impl FnOnce(&mut serde_json::Value)) -> (std::path::PathBuf, LocalStorage) {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/olmo").join(name);
    let dir = std::env::temp_dir().join(format!("tessera-hostile-olmo-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    copy_dir(&src, &dir);
    let meta = dir.join("model/metadata.json");
    let mut json: serde_json::Value = serde_json::from_slice(&std::fs::read(&meta).unwrap()).unwrap();
    edit(&mut json);
    std::fs::write(&meta, serde_json::to_vec(&json).unwrap()).unwrap();
    let storage = LocalStorage::new(dir.join("model"));
    (dir, storage)
}
#[test]
fn a_foreign_index_passes_the_same_gate() {
    // OLMo-core: rank 1's piece of embed.weight (elements 1856..2048 of 2048) moved to
    // 1800..1992: the same length, so it still fits its rank file, but it overlaps rank 0's.
    let (dir, storage) = olmo_copy("olmo01_fsdp_w2", |json| {
        let spec = &mut json["tensors"]["embed.weight"]["shard_spec_per_file"]["rank_1.safetensors"];
        assert_eq!(spec["flattened_offsets"], serde_json::json!([[1856, 2048]]));
        spec["flattened_offsets"] = serde_json::json!([[1800, 1992]]);
    });
    let r = open(&storage).map(|c| c.index().tensors.len());
    assert_corrupt_index(r, "metadata.json", &["\"embed.weight\"", "overlap"]);
    assert_verify_reports(&storage, &["\"embed.weight\"", "overlap"]);
    std::fs::remove_dir_all(dir).unwrap();
}
