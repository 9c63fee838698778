//! `--emulators`: one object store of each kind on loopback — moto (S3), Azurite (Azure Blob)
//! and fake-gcs-server (GCS, behind the write adapter of its harness) — started by the same
//! harnesses the library's tests use (the `tessera-testkit` crate), in memory, and stopped with
//! this process. Emulators are not clouds: what they give is each store's request pattern and a
//! ratio against the local directory in the same run, not cloud speed.

use tessera_testkit::{azure, gcs, s3};

/// A store to benchmark: its name, a fresh URL and the storage options that reach it.
pub struct Store {
    /// `S3 (moto)`, …
    pub name: &'static str,
    /// A fresh prefix of the emulator's bucket or container.
    pub url: String,
    /// `object_store` configuration keys that reach the emulator.
    pub options: Vec<(String, String)>,
}

/// Starts the three emulators (each once per process) and returns a fresh prefix of each.
pub fn stores(tag: &str) -> Vec<Store> {
    vec![
        Store { name: "S3 (moto)", url: s3::fresh_url(tag), options: s3::test_options().config },
        Store { name: "Azure (Azurite)", url: azure::fresh_url(tag), options: azure::test_options().config },
        Store { name: "GCS (fake-gcs-server)", url: gcs::fresh_url(tag), options: gcs::test_options().config },
    ]
}
