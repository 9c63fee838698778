//! Fuzzes the memory tier's manifest (`commit-rNNNNNN.json`, the marker a restore reads from
//! every node's memory root): through its decoder (raw, or a body sealed with a valid checksum
//! so that mutations reach the checks behind it), its re-encoding, and the restore decision
//! over a job whose nodes hold what the manifest describes, less the nodes the first input
//! byte marks lost (`tessera::__fuzz::manifest_plan`). Any input must give a plan, no plan or
//! an error — no panic, no hang, no allocation beyond what the bytes hold.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Some((&lost, manifest)) = data.split_first() {
        let _ = tessera::__fuzz::manifest_plan(manifest, &[lost]);
    }
});
