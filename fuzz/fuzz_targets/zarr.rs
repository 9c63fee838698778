//! Fuzzes the Megatron `zarr` reader: a `.zarray` through its parser
//! (`tessera::__fuzz::zarray`: shape, chunks, grid, chunk names), then through the public API in
//! place of one array's `.zarray` (chosen by the input's first byte) of the `megatron_zarr`
//! fixture in a in-memory storage: opened, loaded whole, verified. Any input must give tensors or
//! an error — no panic, no hang, no allocation from a claimed shape beyond what the chunks hold.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tessera::open;
use tessera::tools::verify;

mod common;

macro_rules! files {
    ($($name:literal),* $(,)?) => {
        &[$(($name, include_bytes!(concat!("../../crates/tessera/tests/fixtures/foreign/megatron_zarr/", $name)) as &[u8])),*]
    };
}

const FILES: &[(&str, &[u8])] = files!(
    "metadata.json",
    "common.pt",
    "decoder.final_norm.weight/.zarray",
    "decoder.final_norm.weight/0",
    "decoder/layers.fc1.weight/.zarray",
    "decoder/layers.fc1.weight/0.0",
    "decoder/layers.fc1.weight/1.0",
    "decoder/layers.fc1.weight/2.0",
    "embedding.word_embeddings.weight/.zarray",
    "embedding.word_embeddings.weight/0.0",
    "embedding.word_embeddings.weight/1.0",
    "rng_state/shard_0_4.pt",
    "rng_state/shard_1_4.pt",
    "rng_state/shard_2_4.pt",
    "rng_state/shard_3_4.pt",
    "step_counts/.zarray",
    "step_counts/0.0",
    "step_counts/0.1",
);
const ARRAYS: [&str; 4] = [
    "decoder.final_norm.weight/.zarray",
    "decoder/layers.fc1.weight/.zarray",
    "embedding.word_embeddings.weight/.zarray",
    "step_counts/.zarray",
];

fuzz_target!(|data: &[u8]| {
    // [array u8] .zarray
    let Some((&which, zarray)) = data.split_first() else { return };
    if let Ok((shape, chunks, grid, _)) = tessera::__fuzz::zarray(zarray) {
        assert_eq!((shape.len(), chunks.len()), (grid.len(), grid.len()));
    }

    let replaced = ARRAYS[which as usize % ARRAYS.len()];
    let storage = common::Files::new(FILES.iter().map(|&(n, b)| (n, if n == replaced { zarray } else { b })));
    if open(&storage).is_err() {
        return;
    }
    if let Ok(tensors) = open(&storage).and_then(|c| c.read_tensors(None)) {
        // Edge chunks are cut, never padded: a load holds at most the chunk files' bytes.
        let held: usize = FILES.iter().filter(|(n, _)| !n.ends_with(".zarray")).map(|(_, b)| b.len()).sum();
        let total: usize = tensors.values().map(|t| t.data.len()).sum();
        assert!(total <= held, "{total} bytes loaded from {held} bytes of chunk files");
    }
    let _ = verify(&storage, 1);
});
