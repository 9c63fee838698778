//! Fuzzes the reader of OLMo-core 0.1.x checkpoints: a `metadata.json` and two rank files,
//! cut from the input, opened and read whole through the public load API. Any input must give
//! tensors or an error — no panic, no hang, no allocation beyond what the files hold.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tessera::{open, Storage};
use tessera::storage::MemoryStorage;
use tessera::tools::verify;

fuzz_target!(|data: &[u8]| {
    // [len_a u16][len_b u16] metadata.json | rank_0.safetensors (len_a) | rank_1.safetensors (len_b)
    if data.len() < 4 {
        return;
    }
    let len_a = u16::from_le_bytes([data[0], data[1]]) as usize;
    let len_b = u16::from_le_bytes([data[2], data[3]]) as usize;
    let rest = &data[4..];
    let meta_len = rest.len().saturating_sub(len_a + len_b);
    let (meta, files) = rest.split_at(meta_len);
    let (rank0, rank1) = files.split_at(len_a.min(files.len()));
    let storage = MemoryStorage::new();
    for (name, bytes) in [("metadata.json", meta), ("rank_0.safetensors", rank0), ("rank_1.safetensors", rank1)] {
        storage.put_atomic(name, bytes).expect("memory storage");
    }
    if let Ok(tensors) = open(&storage).and_then(|c| c.read_tensors(None)) {
        // Whatever loads was covered by real bytes: no tensor holds more than the files do.
        let total: usize = tensors.values().map(|t| t.data.len()).sum();
        assert!(total <= rank0.len() + rank1.len(), "{total} bytes loaded from {} bytes of files", files.len());
        let _ = verify(&storage, 1);
    }
});
