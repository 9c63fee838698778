//! Fuzzes the safetensors header reader (`parse_header`): the input as a whole data file, as a
//! file whose storage claims more bytes than it holds, and — in place of a data file of the
//! golden v2 checkpoint, in a `MemoryStorage` — through `verify` and a load; and alone, as a
//! plain safetensors checkpoint (`model.safetensors`, read by the `safetensors` strategy: its
//! tensor entries, shapes and offsets), through `verify` and a load; and as rank 1's file of
//! DCP's distributed Hugging Face layout beside rank 2's real one (its `DCP_SHARDING_INFO`
//! offsets place the pieces). Any input must give a
//! header or an error — no panic, no allocation beyond the bytes the file holds.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tessera::{open, Storage};
use tessera::storage::MemoryStorage;
use tessera::tools::verify;

const INDEX: &[u8] = include_bytes!("../../crates/tessera/tests/fixtures/golden_v2/tessera.index");
const FILE_0: &str = "a209342d75b9d537-r00000.safetensors";
const FILE_1: (&str, &[u8]) = (
    "a209342d75b9d537-r00001.safetensors",
    include_bytes!("../../crates/tessera/tests/fixtures/golden_v2/a209342d75b9d537-r00001.safetensors"),
);
/// Rank 2's file of DCP's `HuggingFaceStorageWriter(save_distributed=True)` checkpoint: the
/// input as rank 1's file beside it is pieced together by `DCP_SHARDING_INFO`.
const HF_SHARD_2: (&str, &[u8]) = (
    "shard-00002-model-00001-of-00001.safetensors",
    include_bytes!(
        "../../crates/tessera/tests/fixtures/foreign/dcp_hf_sharded/shard-00002-model-00001-of-00001.safetensors"
    ),
);
/// Size of `FILE_0` as the index records it (verify compares it first).
const FILE_0_SIZE: usize = 1968;

fn header(data: &[u8], claimed: u64) {
    let mut read = |off: u64, buf: &mut [u8]| -> tessera::Result<()> {
        let end = off.checked_add(buf.len() as u64).filter(|&e| e <= data.len() as u64);
        match end {
            Some(end) => {
                buf.copy_from_slice(&data[off as usize..end as usize]);
                Ok(())
            }
            None => Err(tessera::Error::not_found("past the end")),
        }
    };
    if let Ok((_, len)) = tessera::__fuzz::parse_header(&mut read, claimed) {
        assert!(len <= claimed, "header of {len} bytes in a {claimed}-byte file");
        assert!(len <= data.len() as u64, "header of {len} bytes read from {} bytes", data.len());
    }
}

fuzz_target!(|data: &[u8]| {
    header(data, data.len() as u64);
    // A storage that says the file is larger than what it can read (a lying or racing size).
    header(data, data.len() as u64 + 4096);

    let mut file = data.to_vec();
    file.resize(FILE_0_SIZE, b' ');
    let storage = MemoryStorage::new();
    for (name, bytes) in [("tessera.index", INDEX), (FILE_0, &file[..]), FILE_1] {
        storage.put_atomic(name, bytes).expect("memory storage");
    }
    let _ = verify(&storage, 1);
    let _ = open(&storage).and_then(|c| c.read_tensors(None));

    let plain = MemoryStorage::new();
    plain.put_atomic("model.safetensors", data).expect("memory storage");
    let _ = verify(&plain, 1);
    let _ = open(&plain).and_then(|c| c.read_tensors(None));

    let pieces = MemoryStorage::new();
    for (name, bytes) in [("shard-00001-model-00001-of-00001.safetensors", data), HF_SHARD_2] {
        pieces.put_atomic(name, bytes).expect("memory storage");
    }
    let _ = verify(&pieces, 1);
    let _ = open(&pieces).and_then(|c| c.read_tensors(None));
});
