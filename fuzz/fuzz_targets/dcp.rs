//! Fuzzes the PyTorch DCP reader: a `.metadata` pickle through the parser the reader uses
//! (`tessera::__fuzz::dcp_metadata`: unpickle with the reader's limits, then the Metadata
//! dataclasses), then through the public API: the `.metadata` next to the real data files of
//! one fixture checkpoint (chosen by the input's first byte: plain DCP, zstd items, Megatron
//! `torch_dist` with `metadata.json` and `common.pt` or (0.19) the common state in the data and `integrity.json`, OLMo-core's `model_and_optim/`, or
//! as rank 0's `__0.metadata` of a save without collectives, merged with rank 1's) in a
//! in-memory storage, opened, loaded whole and verified. So a hostile `.metadata` points real
//! items (zips, zstd frames) at wrong offsets, lengths, shapes and dtypes. Any input must give
//! tensors or an error — no panic, no hang, no allocation beyond what the files hold.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tessera::open;
use tessera::tools::verify;

mod common;

macro_rules! files {
    ($dir:literal: $($name:literal),* $(,)?) => {
        &[$(($name, include_bytes!(concat!("../../crates/tessera/tests/fixtures/foreign/", $dir, "/", $name)) as &[u8])),*]
    };
}

/// (the name the input is stored as, the other files of the checkpoint).
type Fixture = (&'static str, &'static [(&'static str, &'static [u8])]);
const FIXTURES: [Fixture; 8] = [
    (".metadata", files!("dcp_single": "__0_0.distcp")),
    (".metadata", files!("dcp_zstd": "__0_0.distcp")),
    (".metadata", files!("dcp_legacy": "__0_0.distcp", "__1_0.distcp")),
    (
        ".metadata",
        files!("megatron_tp2_dp2": "__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__1_1.distcp", "__2_0.distcp",
            "__3_0.distcp", "common.pt", "metadata.json"),
    ),
    (".metadata", files!("megatron_common_item": "__0_0.distcp", "__1_0.distcp", "metadata.json")),
    (".metadata", files!("megatron_core019": "__0_0.distcp", "__1_0.distcp", "metadata.json", "integrity.json")),
    (
        "model_and_optim/.metadata",
        files!("olmo_core": "model_and_optim/__0_0.distcp", "model_and_optim/__1_0.distcp"),
    ),
    // A save without collectives: the input is rank 0's metadata, merged with rank 1's real one.
    ("__0.metadata", files!("dcp_no_collectives": "__0_0.distcp", "__1_0.distcp", "__1.metadata")),
];

fuzz_target!(|data: &[u8]| {
    // [fixture u8] .metadata
    let Some((&which, meta)) = data.split_first() else { return };
    let _ = tessera::__fuzz::dcp_metadata(meta);
    // The same bytes as Megatron-Core's integrity.json (JSON: the dictionary helps little here,
    // the unit tests pin its shape; verify below reads the fixture's real one beside a hostile
    // .metadata).
    let _ = tessera::__fuzz::integrity_manifest(meta);

    let (meta_name, files) = FIXTURES[which as usize % FIXTURES.len()];
    let storage = common::Files::new(files.iter().copied().chain([(meta_name, meta)]));
    if open(&storage).is_err() {
        return;
    }
    // Many chunks may name one item: no bound on the loaded bytes but the allocation cap.
    let _ = open(&storage).and_then(|c| c.read_tensors(None));
    let _ = open(&storage).map(|c| c.common_state());
    let _ = verify(&storage, 1);
});
