//! The library's integration tests, one binary (as ripgrep keeps them): one module per subject,
//! `common` their shared helpers (and, re-exported from `tessera-testkit`, the object-store
//! emulators, file helpers and hostile-input builders). A test that must own its process (it
//! changes the environment, or measures its own memory, or is killed) re-runs itself alone in
//! a child process of this binary (`common::in_own_process`, `common::rss`, the crash tests).

mod common;

mod async_save;
mod cancel;
mod commit_protocol;
mod commit_race;
mod conformance;
mod corruption;
mod crash;
mod crash_writers;
mod dcp_copy;
mod fault_sweep;
mod foreign;
mod gcs;
mod golden;
mod hostile_index;
mod hostile_memory;
mod hostile_outputs;
mod hostile_paths;
mod hostile_shapes;
mod index_scale;
mod invalid;
mod memory_tier;
mod messages;
mod object_store;
mod olmo;
mod parallel_load;
mod plan_cache;
mod property;
mod semantics;
mod shared_verification;
mod tools;
mod torch_dist;
