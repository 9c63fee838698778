//! The index scales: a synthetic index of 1,000,000 chunks (1000 tensors × 1000 chunks, 2-D,
//! spread over 64 files) encodes to at most 100 bytes per chunk and decodes back unchanged; a
//! reader of a few keys reads the head and those keys' chunk records only, and damage to one
//! tensor's records fails exactly the readers of that tensor.
//! No timing assertions: speed is measured by the CLI's bench, not by tests.

use std::collections::BTreeSet;

use crate::common::*;
use tessera::index::*;
use tessera::storage::*;
use tessera::*;

const FILES: u64 = 64;

/// `tensors` bf16 tensors of `chunks` rows of 512, one chunk per row; every tenth tensor is
/// stored as flattened ranges instead.
fn synthetic_index(tensors: u64, chunks_per_tensor: u64) -> CheckpointIndex {
    let cols = 512u64;
    let chunk_bytes = cols * 2; // one bf16 row
    let block_size = DEFAULT_BLOCK_SIZE;
    // Chunk c of every tensor lives in file c % FILES, rows appended in tensor order.
    let per_file = tensors * chunks_per_tensor.div_ceil(FILES);
    let files: Vec<FileEntry> = (0..FILES)
        .map(|f| FileEntry {
            name: format!("{f:016x}-r{f:05}.safetensors"),
            size: 4096 + per_file * chunk_bytes,
            header_len: 4096,
            header_crc: 0x1234_5678,
        })
        .collect();
    let mut next_off = vec![4096u64; FILES as usize];
    let tensors = (0..tensors)
        .map(|t| {
            let flat = t % 10 == 9; // some tensors are stored as flattened ranges (distributed optimizer)
            let chunks = (0..chunks_per_tensor)
                .map(|c| {
                    let file = c % FILES;
                    let byte_offset = next_off[file as usize];
                    next_off[file as usize] += chunk_bytes;
                    let (offset, shape, flat) = if flat {
                        (vec![0, 0], vec![chunks_per_tensor, cols], Some((c * cols, (c + 1) * cols)))
                    } else {
                        (vec![c, 0], vec![1, cols], None)
                    };
                    let crc = (t * chunks_per_tensor + c).wrapping_mul(0x9e37_79b9) as u32;
                    StoredChunk {
                        file: file as u32,
                        byte_offset,
                        offset: offset.into(),
                        shape: shape.into(),
                        flat,
                        crcs: vec![crc].into(),
                    }
                })
                .collect();
            TensorEntry::new(
                format!("model.decoder.layers.{t:04}.self_attention.linear_qkv.weight"),
                DType::BF16,
                vec![chunks_per_tensor, cols],
                chunks,
            )
        })
        .collect();
    CheckpointIndex {
        backend: Backend::Tessera,
        version: FORMAT_VERSION,
        block_size,
        content_metadata: Value::Map(vec![("note".into(), Value::Str("synthetic".into()))]),
        common: Vec::new(),
        files,
        tensors,
        objects: vec![ObjectEntry {
            key: "rng".into(),
            global_shape: vec![FILES],
            shards: (0..FILES)
                .map(|f| StoredObject { offset: vec![f], file: f as u32, byte_offset: 4096, len: 64, crc: f as u32 })
                .collect(),
        }],
        omitted_tensors: Vec::new(),
    }
}

#[test]
fn a_million_chunk_index_is_compact_and_round_trips() {
    let index = synthetic_index(1000, 1000);
    assert_eq!(index.chunk_count(), 1_000_000);
    let bytes = index.encode();
    let per_chunk = bytes.len() as f64 / index.chunk_count() as f64;
    eprintln!("index of {} chunks: {} bytes, {per_chunk:.1} bytes per chunk", index.chunk_count(), bytes.len());
    assert!(per_chunk <= 100.0, "{per_chunk:.1} bytes per chunk ({} bytes)", bytes.len());
    let decoded = CheckpointIndex::from_bytes(&bytes, "synthetic").unwrap();
    assert!(decoded == index, "decoded index differs");
    assert_eq!(
        decoded.tensor("model.decoder.layers.0999.self_attention.linear_qkv.weight").unwrap().chunks().len(),
        1000
    );
    // Re-encoding is byte-identical (the encoding is canonical).
    assert!(decoded.encode() == bytes);
}

#[test]
fn encode_sorts_keys_whatever_the_build_order() {
    let mut index = synthetic_index(20, 3);
    index.tensors.reverse();
    let decoded = CheckpointIndex::from_bytes(&index.encode(), "reversed").unwrap();
    let keys: Vec<&str> = decoded.tensors.iter().map(|t| t.key.as_str()).collect();
    let mut sorted = keys.clone();
    sorted.sort_unstable();
    assert_eq!(keys, sorted);
    assert!(decoded.tensor(&index.tensors[3].key).is_some(), "binary search finds every key");
}

/// A synthetic index in which every seventh tensor has no stored chunk (as when all its shards
/// are empty): its bytes, as decoded (chunks in canonical order), and in a storage.
fn committed(tensors: u64, chunks_per_tensor: u64) -> (Vec<u8>, CheckpointIndex, MemoryStorage) {
    let mut index = synthetic_index(tensors, chunks_per_tensor);
    for t in index.tensors.iter_mut().step_by(7) {
        *t = TensorEntry::new(t.key.clone(), t.dtype, t.global_shape.clone(), Vec::new());
    }
    let bytes = index.encode();
    let full = CheckpointIndex::from_bytes(&bytes, "full").unwrap();
    let storage = stored(&bytes);
    (bytes, full, storage)
}

fn stored(bytes: &[u8]) -> MemoryStorage {
    let m = MemoryStorage::new();
    m.put_atomic(INDEX_FILE, bytes).unwrap();
    m
}

/// The full index with only the tensors in `keys`, the others omitted.
fn restricted(full: &CheckpointIndex, keys: &BTreeSet<String>) -> CheckpointIndex {
    let mut want = full.clone();
    want.tensors.retain(|t| keys.contains(&t.key));
    want.omitted_tensors = full.tensors.iter().filter(|t| !keys.contains(&t.key)).map(|t| t.key.clone()).collect();
    want
}

fn sorted_keys(index: &CheckpointIndex) -> Vec<String> {
    let mut keys: Vec<String> = index.tensor_keys().map(str::to_string).collect();
    keys.sort_unstable();
    keys
}

fn is_corrupt_index<T: std::fmt::Debug>(r: &Result<T>) -> bool {
    matches!(r, Err(Error::Corrupt { path, .. }) if path.to_string_lossy().ends_with(INDEX_FILE))
}

#[test]
fn a_reader_of_a_few_keys_reads_only_the_head_and_their_chunk_records() {
    let (bytes, full, base) = committed(1000, 200);
    let counting = CountingStorage::new(&base);
    // Tensors 500 and 994 have no stored chunk.
    let keys = [&full.tensors[10].key, &full.tensors[500].key, &full.tensors[994].key, &full.tensors[999].key];
    let ckpt = open_with(&counting, &OpenOptions { keys: Some(keys.iter().map(|k| k.to_string()).collect()) }).unwrap();
    let keys: BTreeSet<String> = keys.iter().map(|k| k.to_string()).collect();
    assert!(*ckpt.index() == restricted(&full, &keys), "the three tensors, objects, files and metadata");
    assert_eq!(sorted_keys(ckpt.index()), sorted_keys(&full), "every key, held or omitted");
    let read = counting.bytes_read();
    let reads = counting.reads();
    eprintln!("index of {} bytes: {read} bytes read in {reads} reads for 4 keys", bytes.len());
    // One read for format detection, one for the head, one per section past the head's read.
    assert!(reads <= 5, "{reads} reads");
    assert!(read * 8 < bytes.len() as u64, "{read} of {} bytes read", bytes.len());
}

#[test]
fn any_set_of_keys_opens_to_the_full_index_restricted_to_it() {
    // About 1.3 MB: sections lie inside the first read, across its end, and past it.
    let (_, full, storage) = committed(300, 300);
    let all: Vec<String> = full.tensors.iter().map(|t| t.key.clone()).collect();
    for_each_seed("any_set_of_keys_opens_to_the_full_index_restricted_to_it", 40, |seed| {
        let mut rng = Rng::new(seed);
        let density = *rng.pick(&[0u64, 1, 5, 50, 100]);
        let mut keys: BTreeSet<String> = all.iter().filter(|_| rng.below(100) < density).cloned().collect();
        if rng.chance(1, 2) {
            keys.insert("not.stored".into());
        }
        let list: Vec<&String> = keys.iter().collect();
        let ckpt =
            open_with(&storage, &OpenOptions { keys: Some(list.iter().map(|k| k.to_string()).collect()) }).unwrap();
        assert!(*ckpt.index() == restricted(&full, &keys), "seed {seed}: density {density}%");
        assert_eq!(sorted_keys(ckpt.index()), all);
    });
}

#[test]
fn a_damaged_chunk_record_fails_exactly_the_readers_of_its_tensor() {
    let (bytes, full, _) = committed(6, 8);
    // FORMAT.md: the head is `head_len` bytes at offset 20, then its crc, then the sections.
    let head_end = 24 + u64::from_le_bytes(bytes[12..20].try_into().unwrap()) as usize;
    assert!(head_end < bytes.len());
    for at in 12..bytes.len() {
        let mut damaged = bytes.clone();
        damaged[at] ^= 0x20;
        let storage = stored(&damaged);
        assert!(is_corrupt_index(&open(&storage).map(Checkpoint::into_index)), "byte {at}: the whole index is corrupt");
        let mut failed = 0;
        for t in &full.tensors {
            match open_with(&storage, &OpenOptions { keys: Some(vec![t.key.clone()]) }) {
                Ok(c) => assert_eq!(c.index().tensor(&t.key), Some(t), "byte {at}: {} decoded wrong", t.key),
                r => {
                    assert!(is_corrupt_index(&r), "byte {at}: {r:?}");
                    failed += 1;
                }
            }
        }
        let want = if at < head_end { full.tensors.len() } else { 1 };
        assert_eq!(failed, want, "byte {at} (head ends at {head_end}): readers that failed");
    }
}

#[test]
fn a_truncated_or_extended_index_fails_every_reader() {
    let index = synthetic_index(6, 8);
    let bytes = index.encode();
    let key = &index.tensors[5].key;
    let head_end = 24 + u64::from_le_bytes(bytes[12..20].try_into().unwrap()) as usize;
    for len in [0, 8, 12, 19, 20, head_end - 5, head_end - 1, head_end, head_end + 1, bytes.len() - 1] {
        let storage = stored(&bytes[..len]);
        let r = open_with(&storage, &OpenOptions { keys: Some(vec![key.into()]) });
        assert!(is_corrupt_index(&r) || matches!(r, Err(Error::NotCommitted { .. })), "length {len}: {r:?}");
    }
    let mut longer = bytes.clone();
    longer.push(0);
    assert!(is_corrupt_index(&open_with(&stored(&longer), &OpenOptions { keys: Some(vec![key.into()]) })));
}
