//! Fuzzes the `torch.save` archive reader (zip and zip64, stored entries): the input as a whole
//! archive (entries, their CRC-32s, the pickled object, a tensor's bytes as a DCP tensor item is decoded), its
//! last 4 KiB as the ranged reader sees them (central directory from the tail of a longer
//! item), and through the public API as the `common.pt` and a sharded object `.pt` of a
//! Megatron `zarr` checkpoint in a in-memory storage (opened, common state loaded, verified).
//! Any input must give entries/values or an error — no panic, no allocation beyond the archive.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tessera::__fuzz;
use tessera::open;
use tessera::tools::verify;

mod common;

const ZARR_META: &[u8] = br#"{"sharded_backend": "zarr", "sharded_backend_version": 1}"#;

fuzz_target!(|data: &[u8]| {
    if let Ok(entries) = __fuzz::zip_entries(data) {
        for (name, at, size) in entries {
            assert!(at.checked_add(size).is_some_and(|e| e <= data.len() as u64), "{name:?} runs past the archive");
        }
    }
    let _ = __fuzz::zip_crc_mismatches(data);
    let _ = __fuzz::torch_save(data);
    if let Ok(bytes) = __fuzz::torch_save_tensor(data) {
        // Strided reads may repeat elements, but only within the numel the pickle claims;
        // the pickle is at most the archive.
        let _ = bytes.len();
    }
    let tail = &data[data.len().saturating_sub(4096)..];
    let _ = __fuzz::zip_tail(tail, data.len() as u64);
    // The same tail as the end of a longer item (its start not read).
    let _ = __fuzz::zip_tail(tail, data.len() as u64 + (1 << 20));

    let common = common::Files::new([("metadata.json", ZARR_META), ("common.pt", data)]);
    let _ = open(&common).map(|c| c.common_state());

    let object = common::Files::new([("metadata.json", ZARR_META), ("rng_state/shard_0_1.pt", data)]);
    let _ = verify(&object, 1);
});
