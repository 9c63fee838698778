//! The index scales: a synthetic index of 1,000,000 chunks (1000 tensors × 1000 chunks, 2-D,
//! spread over 64 files) encodes to at most 100 bytes per chunk and decodes back unchanged.
//! No timing assertions: speed is measured by the CLI's bench, not by tests.

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
                        crcs: vec![crc],
                    }
                })
                .collect();
            TensorEntry {
                key: format!("model.decoder.layers.{t:04}.self_attention.linear_qkv.weight"),
                dtype: DType::BF16,
                global_shape: vec![chunks_per_tensor, cols],
                chunks,
            }
        })
        .collect();
    CheckpointIndex {
        backend: NATIVE_BACKEND.into(),
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
                .map(|f| StoredObject { offset: vec![f], file: f as u32, byte_offset: 0, len: 64, crc: f as u32 })
                .collect(),
        }],
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
        decoded.tensor("model.decoder.layers.0999.self_attention.linear_qkv.weight").unwrap().chunks.len(),
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
