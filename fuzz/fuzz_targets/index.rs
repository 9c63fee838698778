//! Fuzzes the native index reader: `tessera.index` bytes through `CheckpointIndex::from_bytes`,
//! then — next to the golden v2 checkpoint's data files, in a `MemoryStorage` — through the
//! public open APIs: the ranged v2 path (`open_checkpoint_keys`: head, then only the wanted
//! keys' sections), the whole index, a load of every tensor and `verify`. The checksums of the
//! v1 body and of the v2 head are also recomputed over the mutated bytes, so mutations reach the
//! decoder behind them. An input that is not an index is an edit script instead: field edits
//! (chunk file, byte offset, box, flat range, shapes, file sizes, block size, object shards,
//! dropped or repeated chunks) applied to the golden v1 or v2 index, re-encoded with valid
//! checksums, then read the same way — hostile values behind intact checksums. Any input must
//! give an index or an error — no panic, no hang, no allocation beyond what the bytes claim and
//! hold.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tessera::{open, open_with, OpenOptions, Storage};
use tessera::index::{CheckpointIndex, TensorEntry};
use tessera::storage::MemoryStorage;
use tessera::tools::verify;

const GOLDEN: [&[u8]; 2] = [
    include_bytes!("../../crates/tessera/tests/fixtures/golden_v1/tessera.index"),
    include_bytes!("../../crates/tessera/tests/fixtures/golden_v2/tessera.index"),
];

const DATA_FILES: [(&str, &[u8]); 2] = [
    (
        "a209342d75b9d537-r00000.safetensors",
        include_bytes!("../../crates/tessera/tests/fixtures/golden_v2/a209342d75b9d537-r00000.safetensors"),
    ),
    (
        "a209342d75b9d537-r00001.safetensors",
        include_bytes!("../../crates/tessera/tests/fixtures/golden_v2/a209342d75b9d537-r00001.safetensors"),
    ),
];
/// Keys of the golden checkpoint: a load of some of them reads only their sections.
const SOME_KEYS: [&str; 3] = ["embedding", "optimizer.exp_avg", "step_counts"];

/// The bytes with the v1 body crc or the v2 head crc made to match (FORMAT.md: magic, u32
/// version, u64 body/head length, body/head, crc32c).
fn with_checksums(data: &[u8]) -> Option<Vec<u8>> {
    if data.len() < 24 || &data[..8] != b"TESSERA\x00" {
        return None;
    }
    let mut out = data.to_vec();
    let version = u32::from_le_bytes(data[8..12].try_into().unwrap());
    let end = match version {
        1 => data.len(),
        _ => {
            let head_len = u64::from_le_bytes(data[12..20].try_into().unwrap());
            usize::try_from(head_len.checked_add(24)?).ok().filter(|&e| e <= data.len())?
        }
    };
    let crc = crc32c::crc32c(&out[20..end - 4]);
    out[end - 4..end].copy_from_slice(&crc.to_le_bytes());
    Some(out)
}

fn check(bytes: &[u8]) {
    if let Ok(index) = CheckpointIndex::from_bytes(bytes, "fuzz/tessera.index") {
        // What decodes re-encodes to bytes that decode to the same index.
        let again = index.encode();
        let back = CheckpointIndex::from_bytes(&again, "re-encoded").expect("a decoded index re-encodes readably");
        assert_eq!(back.encode(), again);
    }
    let storage = MemoryStorage::new();
    storage.put_atomic("tessera.index", bytes).expect("memory storage");
    for (name, data) in DATA_FILES {
        storage.put_atomic(name, data).expect("memory storage");
    }
    // The index sections of a few keys only, then the whole index.
    if let Ok(ckpt) =
        open_with(&storage, &OpenOptions { keys: Some(SOME_KEYS.iter().map(|k| k.to_string()).collect()) })
    {
        let _ = ckpt.read_tensors(Some(&SOME_KEYS));
    }
    let opened = open(&storage).map(|ckpt| ckpt.read_tensors(None));
    if opened.is_ok() {
        let _ = verify(&storage, 1);
    }
}

/// Reads edits from the input: `[op u8][which u8][dim u8][value: 1–8 bytes, little-endian,
/// length from the op's high bits]`.
struct Script<'a>(&'a [u8]);

impl Script<'_> {
    fn byte(&mut self) -> Option<u8> {
        let (&b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(b)
    }
    fn value(&mut self, len: usize) -> u64 {
        let n = len.min(self.0.len());
        let mut v = [0u8; 8];
        v[..n].copy_from_slice(&self.0[..n]);
        self.0 = &self.0[n..];
        u64::from_le_bytes(v)
    }
}

/// The golden index (v1 or v2 by the first byte) with the script's edits, re-encoded.
fn edited(data: &[u8]) -> Option<Vec<u8>> {
    let (&first, rest) = data.split_first()?;
    let mut index = CheckpointIndex::from_bytes(GOLDEN[(first & 1) as usize], "golden").expect("golden index");
    let mut tensors: Vec<(String, tessera::DType, Vec<u64>, Vec<tessera::index::StoredChunk>)> =
        index.tensors.drain(..).map(|t| (t.key.clone(), t.dtype, t.global_shape.clone(), t.into_chunks())).collect();
    let mut script = Script(rest);
    while let (Some(op), Some(which), Some(dim)) = (script.byte(), script.byte(), script.byte()) {
        let v = script.value(1 + (op >> 5) as usize);
        let nt = tensors.len();
        let (_, _, global_shape, chunks) = &mut tensors[which as usize % nt];
        let nchunks = chunks.len();
        let ci = (nchunks > 0).then(|| (which as usize / 7) % nchunks);
        match (op & 31, ci) {
            (0, Some(i)) => chunks[i].file = v as u32,
            (1, Some(i)) => chunks[i].byte_offset = v,
            (2, Some(i)) if !chunks[i].offset.is_empty() => {
                let k = chunks[i].offset.len();
                chunks[i].offset[dim as usize % k] = v;
            }
            (3, Some(i)) if !chunks[i].shape.is_empty() => {
                let k = chunks[i].shape.len();
                chunks[i].shape[dim as usize % k] = v;
            }
            // TensorEntry::new (the constructor, not the reader) needs start <= end.
            (4, Some(i)) => {
                let (a, b) = (v & 0xFFFF_FFFF, v >> 32);
                chunks[i].flat = Some((a.min(b), a.max(b)));
            }
            (5, Some(i)) => chunks[i].flat = None,
            (6, Some(i)) => {
                let mut crcs = chunks[i].crcs.to_vec();
                crcs.resize((v as usize) % 4, 0);
                chunks[i].crcs = crcs.into();
            }
            (7, _) if !global_shape.is_empty() => {
                let k = global_shape.len();
                global_shape[dim as usize % k] = v;
            }
            (8, _) if nchunks > 0 => {
                chunks.remove(dim as usize % nchunks);
            }
            (9, _) if nchunks > 0 => {
                let c = chunks[dim as usize % nchunks].clone();
                chunks.push(c);
            }
            (10, _) => global_shape.push(v % 8),
            (11, _) if !index.files.is_empty() => {
                let n = index.files.len();
                index.files[dim as usize % n].size = v;
            }
            (12, _) if !index.files.is_empty() => {
                let n = index.files.len();
                index.files[dim as usize % n].header_len = v;
            }
            (13, _) => index.block_size = v,
            (14, _) | (15, _) | (16, _) if !index.objects.is_empty() => {
                let n = index.objects.len();
                let o = &mut index.objects[which as usize % n];
                if let Some(s) = (!o.shards.is_empty()).then(|| o.shards.len()).map(|k| &mut o.shards[dim as usize % k])
                {
                    match op & 31 {
                        14 => s.file = v as u32,
                        15 => s.byte_offset = v,
                        _ => s.len = v,
                    }
                }
            }
            (17, _) if !index.objects.is_empty() => {
                let n = index.objects.len();
                let o = &mut index.objects[which as usize % n];
                if !o.global_shape.is_empty() {
                    let k = o.global_shape.len();
                    o.global_shape[dim as usize % k] = v;
                }
            }
            _ => {}
        }
    }
    // TensorEntry::new (the constructor, not the reader) counts each chunk's elements: a box
    // whose volume overflows u64 is the script's doing, not the reader's, so it is skipped.
    let volume = |shape: &[u64]| shape.iter().try_fold(1u64, |a, &x| a.checked_mul(x));
    if tensors.iter().flat_map(|t| &t.3).any(|c| volume(&c.shape).is_none()) {
        return None;
    }
    index.tensors = tensors.into_iter().map(|(k, d, g, c)| TensorEntry::new(k, d, g, c)).collect();
    Some(index.encode())
}

fuzz_target!(|data: &[u8]| {
    if !data.starts_with(b"TESSERA\x00") {
        if let Some(bytes) = edited(data) {
            check(&bytes);
        }
        return;
    }
    check(data);
    if let Some(fixed) = with_checksums(data) {
        if fixed != data {
            check(&fixed);
        }
    }
});
