//! Fuzzes the native index reader: `tessera.index` bytes through `CheckpointIndex::from_bytes`,
//! then — next to the golden v2 checkpoint's data files, in a `MemoryStorage` — through the
//! public open APIs: the ranged v2 path (`open_checkpoint_keys`: head, then only the wanted
//! keys' sections), the whole index, a load of every tensor and `verify`. The checksums of the
//! v1 body and of the v2 head are also recomputed over the mutated bytes, so mutations reach the
//! decoder behind them. Any input must give an index or an error — no panic, no hang, no
//! allocation beyond what the bytes claim and hold.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tessera::{load_plain_tensors, open_checkpoint_keys, open_index, verify, CheckpointIndex, MemoryStorage, Storage};

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
    if let Ok(ckpt) = open_checkpoint_keys(&storage, &SOME_KEYS) {
        let _ = load_plain_tensors(ckpt.storage(), Some(&SOME_KEYS));
    }
    if open_index(&storage).is_ok() {
        let _ = load_plain_tensors(&storage, None);
        let _ = verify(&storage, 1);
    }
}

fuzz_target!(|data: &[u8]| {
    check(data);
    if let Some(fixed) = with_checksums(data) {
        if fixed != data {
            check(&fixed);
        }
    }
});
