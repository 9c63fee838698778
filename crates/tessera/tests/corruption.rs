//! Damaged checkpoints give clear errors, never panics or wrong data: flipped bytes in data
//! files and in the index, truncated and missing files, a missing index, a future format
//! version, an empty or absent directory, an index naming a path outside the checkpoint.

use std::collections::BTreeMap;
use std::path::Path;

use crate::common::*;
use tessera::comm::*;
use tessera::index::*;
use tessera::storage::*;
use tessera::tools::*;
use tessera::*;

/// A committed checkpoint in a temporary directory and the truth it holds.
struct Fixture {
    dir: TempDir,
    tensors: BTreeMap<String, (DType, Vec<u64>, Vec<u8>)>,
    objects: Vec<Vec<u8>>,
}

impl Fixture {
    fn storage(&self) -> LocalStorage {
        LocalStorage::new(self.dir.path())
    }
    fn path(&self, name: &str) -> std::path::PathBuf {
        self.dir.join(name)
    }
    fn index(&self) -> CheckpointIndex {
        open(&self.storage()).map(Checkpoint::into_index).unwrap()
    }
}

/// Two ranks: `w` f32 [8, 6] split by rows, `opt` bf16 [5, 5] as two flattened ranges, `norm`
/// f32 [6] replicated (rank 0 main), object `rng` with one shard per rank, a common value.
/// Block size 16: every chunk has several checksum blocks.
fn fixture() -> Fixture {
    let mut rng = Rng::new(42);
    let w = rng.bytes(8 * 6 * 4);
    let opt = rng.bytes(25 * 2);
    let norm = rng.bytes(6 * 4);
    let objects = vec![b"rank zero rng state".to_vec(), b"rank one rng state!!".to_vec()];
    let dir = TempDir::new("corrupt");
    let storage = LocalStorage::new(dir.path());
    let out = run_ranks(2, |c| {
        let r = c.rank() as u64;
        let wt = shard(
            "w",
            DType::F32,
            &[8, 6],
            &[4 * r, 0],
            &[4, 6],
            0,
            None,
            TensorData::Ref(&w[r as usize * 96..][..96]),
        );
        let range = if r == 0 { 0..13 } else { 13..25 };
        let ot = shard(
            "opt",
            DType::BF16,
            &[5, 5],
            &[0, 0],
            &[5, 5],
            0,
            Some(range.clone()),
            TensorData::Ref(&opt[range.start as usize * 2..range.end as usize * 2]),
        );
        let nt = ShardedTensor::full("norm", DType::F32, &[6], TensorData::Ref(&norm)).with_replica_id(r as u32);
        let tree = StateTree::map()
            .with("w", StateTree::Tensor(wt))
            .with("opt", StateTree::Tensor(ot))
            .with("norm", StateTree::Tensor(nt))
            .with("rng", StateTree::Object(ShardedObject::new("rng", objects[r as usize].clone(), &[2], &[r])))
            .with("iteration", StateTree::Value(Value::Int(10)));
        save(tree, &storage, c, &small_blocks(16))
    });
    for r in out {
        r.unwrap();
    }
    let mut tensors = BTreeMap::new();
    tensors.insert("w".to_string(), (DType::F32, vec![8, 6], w));
    tensors.insert("opt".to_string(), (DType::BF16, vec![5, 5], opt));
    tensors.insert("norm".to_string(), (DType::F32, vec![6], norm));
    Fixture { dir, tensors, objects }
}

type Loaded = (BTreeMap<String, Vec<u8>>, Vec<Vec<u8>>);

/// Loads everything (whole tensors, both object shards) on one rank.
fn load_all(storage: &dyn Storage, fx: &Fixture, verify_checksums: bool) -> Result<Loaded> {
    let mut tree = StateTree::map();
    for (k, (dtype, shape, _)) in &fx.tensors {
        tree.insert(k.clone(), StateTree::Tensor(ShardedTensor::full(k, *dtype, shape, TensorData::None)));
    }
    let objs: Vec<StateTree<'_>> = (0..2u64)
        .map(|r| {
            let mut o = ShardedObject::new("rng", Vec::new(), &[2], &[r]);
            o.data = None;
            StateTree::Object(o)
        })
        .collect();
    tree.insert("objects", StateTree::List(objs));
    let res = load(tree, storage, &SoloComm, &LoadOptions { verify_checksums, ..load_opts() })?;
    let mut tensors = BTreeMap::new();
    for k in fx.tensors.keys() {
        tensors.insert(k.clone(), bytes_at(&res.state, k).to_vec());
    }
    let objects = (0..2)
        .map(|i| res.state.get_dotted(&format!("objects.{i}")).unwrap().as_object().unwrap().data.clone().unwrap())
        .collect();
    Ok((tensors, objects))
}

fn flip(path: &Path, at: u64) {
    let mut b = std::fs::read(path).unwrap();
    b[at as usize] ^= 0x5a;
    std::fs::write(path, b).unwrap();
}

/// `Err(Corrupt)` whose path names `file`.
#[track_caller]
fn assert_corrupt<T: std::fmt::Debug>(r: Result<T>, file: &str, what: &str) {
    match r {
        Err(Error::Corrupt { path, reason }) => assert!(
            path.to_string_lossy().ends_with(file),
            "{what}: Corrupt names {path:?} ({reason}), expected {file}"
        ),
        other => panic!("{what}: expected Corrupt naming {file}, got {other:?}"),
    }
}

/// `verify` runs and reports at least one problem naming `file`.
#[track_caller]
fn assert_verify_names(storage: &dyn Storage, file: &str, what: &str) {
    let rep = verify(storage, 2).unwrap_or_else(|e| panic!("{what}: verify failed instead of reporting: {e}"));
    assert!(
        rep.problems.iter().any(|p| p.contains(file)),
        "{what}: verify reported {:?}, nothing about {file}",
        rep.problems
    );
}

#[test]
fn the_fixture_is_sound() {
    let fx = fixture();
    let storage = fx.storage();
    let (tensors, objects) = load_all(&storage, &fx, true).unwrap();
    for (k, (_, _, truth)) in &fx.tensors {
        assert_eq!(&tensors[k], truth, "{k}");
    }
    assert_eq!(objects, fx.objects);
    let rep = verify(&storage, 2).unwrap();
    assert!(rep.problems.is_empty(), "{:?}", rep.problems);
    assert_eq!(rep.files, 2);
    assert!(rep.bytes_checked > 0);
}

/// Every stored range of data (tensor chunks and object shards) of each file.
fn data_ranges(index: &CheckpointIndex) -> Vec<(u32, u64, u64, String)> {
    let mut out = Vec::new();
    for t in &index.tensors {
        for c in t.chunks() {
            out.push((c.file, c.byte_offset, c.numel() * t.dtype.size() as u64, format!("tensor {}", t.key)));
        }
    }
    for o in &index.objects {
        for s in &o.shards {
            out.push((s.file, s.byte_offset, s.len, format!("object {}", o.key)));
        }
    }
    out
}

#[test]
fn a_flipped_data_byte_in_any_chunk_of_any_file_is_corrupt() {
    let fx = fixture();
    let index = fx.index();
    let ranges = data_ranges(&index);
    assert!(ranges.iter().any(|r| r.0 == 0) && ranges.iter().any(|r| r.0 == 1), "both files hold data");
    for (file, off, len, what) in ranges {
        let name = &index.files[file as usize].name;
        let path = fx.path(name);
        let original = std::fs::read(&path).unwrap();
        for at in [off, off + len / 2, off + len - 1] {
            let what = format!("{what} in {name}, byte {at}");
            flip(&path, at);
            let storage = fx.storage();
            assert_corrupt(load_all(&storage, &fx, true), name, &what);
            assert_verify_names(&storage, name, &what);
            std::fs::write(&path, &original).unwrap();
        }
    }
    // Restored: sound again.
    assert!(verify(&fx.storage(), 2).unwrap().problems.is_empty());
}

#[test]
fn load_without_checksum_verification_reads_a_flipped_byte_silently() {
    // Documents `verify_checksums: false`: no error, and the damage shows up in the data.
    let fx = fixture();
    let index = fx.index();
    let w = index.tensor("w").unwrap();
    let c = &w.chunks()[1];
    let name = &index.files[c.file as usize].name;
    flip(&fx.path(name), c.byte_offset + 5);
    let storage = fx.storage();
    let (tensors, _) = load_all(&storage, &fx, false).unwrap();
    let truth = &fx.tensors["w"].2;
    let diffs: Vec<usize> = (0..truth.len()).filter(|&i| tensors["w"][i] != truth[i]).collect();
    // Chunk 1 holds rows 4..8: byte 5 of it is byte 96 + 5 of the tensor.
    assert_eq!(diffs, vec![96 + 5]);
    assert_eq!(tensors["w"][101], truth[101] ^ 0x5a);
    assert_eq!(tensors["opt"], fx.tensors["opt"].2);
    // With verification (the default) the same checkpoint is refused.
    assert_corrupt(load_all(&storage, &fx, true), name, "verified load");
}

fn header_len(path: &Path) -> u64 {
    let b = std::fs::read(path).unwrap();
    8 + u64::from_le_bytes(b[..8].try_into().unwrap())
}

/// Header bytes whose damage breaks the safetensors structure: the length prefix, the opening
/// brace, the last (padding) byte.
fn structural_header_positions(path: &Path) -> Vec<u64> {
    vec![0, 3, 7, 8, header_len(path) - 1]
}

#[test]
fn a_flipped_structural_header_byte_is_reported_by_verify() {
    let fx = fixture();
    let index = fx.index();
    for f in &index.files {
        let path = fx.path(&f.name);
        let original = std::fs::read(&path).unwrap();
        for at in structural_header_positions(&path) {
            flip(&path, at);
            assert_verify_names(&fx.storage(), &f.name, &format!("header byte {at} of {}", f.name));
            std::fs::write(&path, &original).unwrap();
        }
    }
}

#[test]
fn every_flipped_header_byte_is_reported_by_verify() {
    let fx = fixture();
    let index = fx.index();
    for f in &index.files {
        let path = fx.path(&f.name);
        let original = std::fs::read(&path).unwrap();
        let mut unreported = Vec::new();
        for at in 0..header_len(&path) {
            flip(&path, at);
            let rep = verify(&fx.storage(), 2).unwrap();
            if !rep.problems.iter().any(|p| p.contains(&f.name)) {
                unreported.push((at, original[at as usize] as char));
            }
            std::fs::write(&path, &original).unwrap();
        }
        assert!(unreported.is_empty(), "{}: flips at (byte, original char) {unreported:?} not reported", f.name);
    }
}

#[test]
fn a_flipped_header_byte_fails_a_verified_load() {
    let fx = fixture();
    let index = fx.index();
    for f in &index.files {
        let path = fx.path(&f.name);
        let original = std::fs::read(&path).unwrap();
        let n = header_len(&path);
        for at in [0, 8, n / 2, n - 1] {
            flip(&path, at);
            assert_corrupt(load_all(&fx.storage(), &fx, true), &f.name, &format!("header byte {at} of {}", f.name));
            std::fs::write(&path, &original).unwrap();
        }
    }
}

#[test]
fn every_flipped_index_byte_is_detected() {
    let fx = fixture();
    let path = fx.path(INDEX_FILE);
    let original = std::fs::read(&path).unwrap();
    for at in 0..original.len() as u64 {
        flip(&path, at);
        let storage = fx.storage();
        let r = open(&storage).map(Checkpoint::into_index);
        if (8..12).contains(&at) {
            // The version field: a version this build does not read.
            assert!(matches!(r, Err(Error::IncompatibleVersion { .. })), "byte {at}: {r:?}");
        } else {
            assert_corrupt(r, INDEX_FILE, &format!("index byte {at}"));
        }
        std::fs::write(&path, &original).unwrap();
    }
    // And through the public entry points, for one byte in the body.
    flip(&path, original.len() as u64 / 2);
    let storage = fx.storage();
    assert_corrupt(load_all(&storage, &fx, true), INDEX_FILE, "load");
    assert_corrupt(verify(&storage, 2), INDEX_FILE, "verify");
    assert_corrupt(open(&storage).and_then(|c| c.read_tensors(None)), INDEX_FILE, "load_plain_tensors");
    assert_corrupt(open(&storage).map(|c| c.common_state()), INDEX_FILE, "load_common_state");
    assert_corrupt(open(&storage).map(|c| c.tensors_metadata()), INDEX_FILE, "load_tensors_metadata");
}

#[test]
fn a_missing_index_is_not_committed() {
    let fx = fixture();
    std::fs::remove_file(fx.path(INDEX_FILE)).unwrap();
    let storage = fx.storage();
    assert!(matches!(load_all(&storage, &fx, true), Err(Error::NotCommitted { .. })));
    assert!(matches!(verify(&storage, 2), Err(Error::NotCommitted { .. })));
    assert!(matches!(open(&storage).and_then(|c| c.read_tensors(None)), Err(Error::NotCommitted { .. })));
    assert!(matches!(open(&storage).map(|c| c.common_state()), Err(Error::NotCommitted { .. })));
    assert!(matches!(open(&storage).map(|c| c.content_metadata().clone()), Err(Error::NotCommitted { .. })));
    match open(&storage).map(Checkpoint::into_index) {
        Err(Error::NotCommitted { path, .. }) => assert_eq!(path, fx.dir.path()),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_truncated_data_file_is_corrupt_not_a_panic() {
    let fx = fixture();
    let index = fx.index();
    for f in &index.files {
        let path = fx.path(&f.name);
        let original = std::fs::read(&path).unwrap();
        let header = 8 + u64::from_le_bytes(original[..8].try_into().unwrap());
        for len in [0, 4, 8, header - 1, header, header + 3, f.size - 1] {
            std::fs::write(&path, &original[..len as usize]).unwrap();
            let storage = fx.storage();
            let what = format!("{} truncated to {len} bytes", f.name);
            assert_corrupt(load_all(&storage, &fx, true), &f.name, &what);
            assert_corrupt(load_all(&storage, &fx, false), &f.name, &what);
            assert_verify_names(&storage, &f.name, &what);
        }
        std::fs::write(&path, &original).unwrap();
    }
}

#[test]
fn an_extended_data_file_is_reported_by_verify() {
    let fx = fixture();
    let name = fx.index().files[0].name.clone();
    let mut b = std::fs::read(fx.path(&name)).unwrap();
    b.extend_from_slice(b"trailing garbage");
    std::fs::write(fx.path(&name), b).unwrap();
    assert_verify_names(&fx.storage(), &name, "extended file");
}

#[test]
fn a_missing_data_file_names_the_file() {
    let fx = fixture();
    let name = fx.index().files[1].name.clone();
    std::fs::remove_file(fx.path(&name)).unwrap();
    let storage = fx.storage();
    match load_all(&storage, &fx, true) {
        Err(Error::NotFound { path, .. }) => {
            assert!(path.to_string_lossy().ends_with(&name), "{path:?}")
        }
        other => panic!("expected NotFound naming {name}, got {other:?}"),
    }
    assert_verify_names(&storage, &name, "missing file");
}

#[test]
fn a_truncated_index_is_corrupt() {
    let fx = fixture();
    let path = fx.path(INDEX_FILE);
    let original = std::fs::read(&path).unwrap();
    let n = original.len();
    for len in [0, 1, 7, 8, 11, 12, 19, 20, 23, 24, n / 2, n - 5, n - 4, n - 1] {
        std::fs::write(&path, &original[..len]).unwrap();
        let storage = fx.storage();
        assert_corrupt(open(&storage).map(Checkpoint::into_index), INDEX_FILE, &format!("index truncated to {len}"));
        assert_corrupt(load_all(&storage, &fx, true), INDEX_FILE, &format!("load, index truncated to {len}"));
    }
    // Extended is as bad as truncated.
    let mut longer = original.clone();
    longer.push(0);
    std::fs::write(&path, &longer).unwrap();
    assert_corrupt(open(&fx.storage()).map(Checkpoint::into_index), INDEX_FILE, "index with a trailing byte");
}

#[test]
fn another_format_version_is_incompatible() {
    let fx = fixture();
    let path = fx.path(INDEX_FILE);
    let original = std::fs::read(&path).unwrap();
    assert_eq!(&original[..8], b"TESSERA\x00"); // the index magic (FORMAT.md)
    assert_eq!(u32::from_le_bytes(original[8..12].try_into().unwrap()), FORMAT_VERSION);
    for v in [FORMAT_VERSION + 1, 0, 1000, u32::MAX] {
        let mut b = original.clone();
        b[8..12].copy_from_slice(&v.to_le_bytes());
        std::fs::write(&path, &b).unwrap();
        let storage = fx.storage();
        for (what, r) in [
            ("open_index", open(&storage).map(Checkpoint::into_index).map(|_| ())),
            ("load", load_all(&storage, &fx, true).map(|_| ())),
            ("verify", verify(&storage, 2).map(|_| ())),
            ("load_plain_tensors", open(&storage).and_then(|c| c.read_tensors(None)).map(|_| ())),
        ] {
            match r {
                Err(Error::IncompatibleVersion { found, supported }) => {
                    assert!(found.contains(&v.to_string()), "{what}: found {found:?} for version {v}");
                    assert!(supported.contains(&FORMAT_VERSION.to_string()), "{what}: supported {supported:?}");
                }
                other => panic!("{what}, version {v}: expected IncompatibleVersion, got {other:?}"),
            }
        }
    }
    // Version 1 in the header of a version-2 index is not guessed around: the layout is wrong.
    let mut b = original.clone();
    b[8..12].copy_from_slice(&1u32.to_le_bytes());
    assert_corrupt(CheckpointIndex::from_bytes(&b, "v1 header"), "v1 header", "v1 header on a v2 index");
    // An index re-encoded as version 1 (what tessera 0.1 wrote) still reads, to the same index.
    let mut index = CheckpointIndex::from_bytes(&original, "orig").unwrap();
    index.version = 1;
    let v1 = index.encode();
    assert_eq!(u32::from_le_bytes(v1[8..12].try_into().unwrap()), 1);
    assert_eq!(CheckpointIndex::from_bytes(&v1, "v1").unwrap(), index);
    std::fs::write(&path, &v1).unwrap();
    let (tensors, objects) = load_all(&fx.storage(), &fx, true).unwrap();
    for (k, (_, _, truth)) in &fx.tensors {
        assert_eq!(&tensors[k], truth, "{k} from a version-1 index");
    }
    assert_eq!(objects, fx.objects);
}

#[test]
fn an_index_naming_a_path_outside_the_checkpoint_is_refused() {
    let fx = fixture();
    let original = std::fs::read(fx.path(INDEX_FILE)).unwrap();
    for evil in ["../outside.safetensors", "sub/dir.safetensors", "/etc/passwd", "..", ""] {
        let mut index = CheckpointIndex::from_bytes(&original, "orig").unwrap();
        index.files[0].name = evil.to_string();
        let bytes = index.encode();
        assert_corrupt(CheckpointIndex::from_bytes(&bytes, "evil.index"), "evil.index", evil);
        std::fs::write(fx.path(INDEX_FILE), &bytes).unwrap();
        assert_corrupt(load_all(&fx.storage(), &fx, true), INDEX_FILE, evil);
    }
}

#[test]
fn an_index_whose_chunks_point_past_their_file_is_refused() {
    let fx = fixture();
    let original = std::fs::read(fx.path(INDEX_FILE)).unwrap();
    let mut index = CheckpointIndex::from_bytes(&original, "orig").unwrap();
    let t = index.tensors.remove(0);
    let (key, dtype, shape) = (t.key.clone(), t.dtype, t.global_shape.clone());
    let mut chunks = t.into_chunks();
    chunks[0].byte_offset = index.files[chunks[0].file as usize].size;
    index.tensors.insert(0, TensorEntry::new(key, dtype, shape, chunks));
    // Decoding is not validation: the gate every opener and load applies refuses it.
    std::fs::write(fx.path(INDEX_FILE), index.encode()).unwrap();
    assert_corrupt(load_all(&fx.storage(), &fx, true), INDEX_FILE, "chunk past the end");
    assert_corrupt(open(&fx.storage()).map(Checkpoint::into_index), INDEX_FILE, "chunk past the end");
}

#[test]
fn an_empty_or_absent_directory_is_not_found() {
    let empty = TempDir::created("empty");
    let absent = TempDir::new("absent");
    for dir in [&empty, &absent] {
        let storage = LocalStorage::new(dir.path());
        assert!(matches!(open(&storage).map(Checkpoint::into_index), Err(Error::NotFound { .. })), "{dir:?}");
        assert!(matches!(verify(&storage, 2), Err(Error::NotFound { .. })));
        assert!(matches!(open(&storage).and_then(|c| c.read_tensors(None)), Err(Error::NotFound { .. })));
        assert!(matches!(open(&storage).map(|c| c.tensors_metadata()), Err(Error::NotFound { .. })));
        assert!(matches!(open(&storage).map(|c| c.common_state()), Err(Error::NotFound { .. })));
        let tree =
            StateTree::map().with("w", StateTree::Tensor(ShardedTensor::full("w", DType::F32, &[2], TensorData::None)));
        assert!(matches!(load(tree, &storage, &SoloComm, &load_opts()), Err(Error::NotFound { .. })));
    }
    assert!(!absent.path().exists(), "reading must not create the directory");
    assert!(matches!(open(&MemoryStorage::new()).map(Checkpoint::into_index), Err(Error::NotFound { .. })));
}

#[test]
fn a_directory_of_unrelated_files_is_not_committed() {
    let dir = TempDir::created("unrelated");
    std::fs::write(dir.join("notes.txt"), b"hello").unwrap();
    assert!(matches!(
        open(&LocalStorage::new(dir.path())).map(Checkpoint::into_index),
        Err(Error::NotCommitted { .. })
    ));
    // An index file that is not a tessera index at all.
    std::fs::write(dir.join(INDEX_FILE), b"{\"json\": true}").unwrap();
    assert_corrupt(open(&LocalStorage::new(dir.path())).map(Checkpoint::into_index), INDEX_FILE, "foreign index");
}

#[test]
fn a_damaged_section_fails_only_its_readers_and_leaves_no_rank_waiting() {
    let fx = fixture();
    // Sections are in key order (norm, opt, w): the index's last byte is in w's chunk records.
    let path = fx.path(INDEX_FILE);
    flip(&path, std::fs::metadata(&path).unwrap().len() - 1);
    let storage = fx.storage();
    assert_corrupt(open(&storage).map(Checkpoint::into_index), INDEX_FILE, "a full open decodes every section");
    let (_, _, norm) = &fx.tensors["norm"];
    // Without shared verification a load is collective only in the strict modes that gather
    // keys; with it (the default), always.
    for (strict, share) in [
        (StrictHandling::AssumeOkUnexpected, false),
        (StrictHandling::RaiseAll, false),
        (StrictHandling::AssumeOkUnexpected, true),
        (StrictHandling::RaiseAll, true),
    ] {
        // Rank 0 loads w and fails; rank 1 loads norm. Where the load is collective both take
        // part in its first exchange (run_ranks fails the test if a rank is left waiting).
        let opts = LoadOptions { strict, share_verification: share, ..load_opts() };
        let out = run_ranks(2, |c| {
            let (key, dtype, shape) =
                if c.rank() == 0 { ("w", DType::F32, vec![8, 6]) } else { ("norm", DType::F32, vec![6]) };
            let tree = StateTree::map()
                .with(key, StateTree::Tensor(ShardedTensor::full(key, dtype, &shape, TensorData::None)));
            load(tree, &storage, c, &opts).map(|r| bytes_at(&r.state, key).to_vec())
        });
        let mut out = out.into_iter();
        assert_corrupt(out.next().unwrap(), INDEX_FILE, "the reader of w");
        match (strict, share, out.next().unwrap()) {
            (StrictHandling::AssumeOkUnexpected, false, Ok(bytes)) => assert_eq!(&bytes, norm),
            // Nobody loaded w or opt (rank 0 failed): they are missing.
            (StrictHandling::RaiseAll, _, Err(Error::KeyMismatch { missing, .. })) => {
                assert!(missing.contains(&"w".to_string()))
            }
            (StrictHandling::AssumeOkUnexpected, true, Err(Error::PeerFailed { rank: 0, .. })) => {}
            (s, share, other) => panic!("{s:?}, shared verification {share}: the reader of norm got {other:?}"),
        }
    }
}

#[test]
fn exchange_reads_refuse_a_partial_index() {
    let fx = fixture();
    let storage = fx.storage();
    let ckpt = open_with(&storage, &OpenOptions { keys: Some(vec!["norm".into()]) }).unwrap();
    assert_eq!(ckpt.index().omitted_tensors, ["opt", "w"]);
    let tree = StateTree::map()
        .with("norm", StateTree::Tensor(ShardedTensor::full("norm", DType::F32, &[6], TensorData::None)));
    let opts = LoadOptions { exchange_reads: true, ..load_opts() };
    match ckpt.load(tree, &SoloComm, &opts) {
        Err(Error::InvalidArgument { reason }) => assert!(reason.contains("exchange_reads"), "{reason}"),
        other => panic!("{other:?}"),
    }
}
