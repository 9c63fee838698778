//! Every backend of this crate runs the storage conformance suite, `tessera::storage::conformance`
//! (`src/storage/conformance.rs`, public under the cargo feature `conformance`; this crate's
//! `[dev-dependencies]` enable it on itself, so plain `cargo test` builds it).
//!
//! Each backend's test hands [`conformance::run`] a fresh, empty storage, then saves, loads and
//! verifies a small checkpoint through it ([`checkpoint_round_trip`]: end to end, so it lives
//! here and not in the library's suite, which depends on the storage module only). Read-only
//! views run [`conformance::run_read_only`] over the objects they show.

use std::path::Path;

use crate::common::*;
use tessera::storage::*;
use tessera::tools::*;
use tessera::*;

/// Saves (2 ranks), loads and verifies a checkpoint through `storage`, then empties it.
fn checkpoint_round_trip(storage: &dyn Storage) {
    let w: Vec<f32> = (0..24).map(|i| i as f32 * 0.5).collect();
    let out = run_ranks(2, |c| {
        let r = c.rank() as u64;
        let bytes = f32_bytes(&w[r as usize * 12..][..12]);
        let t = shard("w", DType::F32, &[4, 6], &[2 * r, 0], &[2, 6], 0, None, TensorData::Owned(bytes));
        save(StateTree::map().with("w", StateTree::Tensor(t)), storage, c, &small_blocks(32))
    });
    for r in out {
        r.unwrap();
    }
    assert_eq!(f32s(&open(storage).and_then(|c| c.read_tensors(None)).unwrap()["w"].data), w);
    assert!(verify(storage, 2).unwrap().problems.is_empty());
    clean(storage);
}

fn clean(storage: &dyn Storage) {
    for n in storage.list().unwrap() {
        storage.delete(&n).unwrap();
    }
}

/// The conformance suite, then a checkpoint through the backend.
fn conforms(storage: &dyn Storage) {
    conformance::run(storage);
    checkpoint_round_trip(storage);
}

#[test]
fn memory_storage_conforms() {
    conforms(&MemoryStorage::new());
}

#[test]
fn local_storage_conforms() {
    // The directory does not exist yet: a missing location lists empty; writes create it.
    let dir = TempDir::new("conformance");
    conforms(&LocalStorage::new(dir.path()));
    assert!(dir.path().is_dir());
}

#[test]
fn local_storage_conforms_in_an_existing_directory() {
    let dir = TempDir::created("conformance-existing");
    conforms(&LocalStorage::new(dir.path()));
}

/// The S3 backend against moto (or `TESSERA_TEST_S3_ENDPOINT`: Garage, in
/// `scripts/ci/garage_conformance.sh`, which runs this test by name).
#[test]
fn s3_storage_conforms() {
    conforms(&crate::common::s3::fresh_storage("conformance"));
}

#[test]
fn azure_storage_conforms() {
    conforms(&crate::common::azure::fresh_storage("conformance"));
}

/// The pass-through counter conforms over both local backends, and counts the reads the suite
/// made through it.
#[test]
fn counting_storage_conforms() {
    let mem = MemoryStorage::new();
    let counting = CountingStorage::new(&mem);
    conforms(&counting);
    assert!(counting.reads() > 0 && counting.bytes_read() > 3 << 20, "{} reads", counting.reads());
    assert!(counting.has_atomic_create(), "has_atomic_create passes through");
    assert!(counting.is_local(), "is_local passes through");
    let dir = TempDir::new("conformance-counting");
    let local = LocalStorage::new(dir.path());
    conforms(&CountingStorage::new(&local));
    assert_eq!(CountingStorage::new(&local).is_local(), local.is_local());
}

/// A plain safetensors file opened as a checkpoint (`Location::open` of `….safetensors`): a
/// read-only view of that one file.
#[test]
fn a_file_opened_as_a_location_conforms_read_only() {
    let dir = TempDir::created("conformance-one-file");
    let data: Vec<u8> = (0..5000u32).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(dir.join("model.safetensors"), &data).unwrap();
    std::fs::write(dir.join("other.bin"), b"not shown").unwrap();
    let view = tessera::storage::Location::parse(dir.join("model.safetensors").to_str().unwrap()).open().unwrap();
    conformance::run_read_only(view.as_ref(), &[("model.safetensors", &data)]);
    assert_eq!(view.list().unwrap(), ["model.safetensors"]);
    assert!(matches!(view.size("other.bin"), Err(Error::NotFound { .. })), "only the file is shown");
    for r in [view.put_atomic("x", b"x"), view.put_if_absent("x", b"x"), view.delete("model.safetensors")] {
        assert!(matches!(r, Err(Error::InvalidArgument { .. })), "writes are refused: {r:?}");
    }
    assert!(view.create("x", 1).is_err(), "create is refused");
    assert_eq!(std::fs::read(dir.join("model.safetensors")).unwrap(), data);
}

/// The read-only views of foreign formats (`OpenCheckpoint::storage`): every file they show
/// reads as the suite says.
#[test]
fn foreign_format_views_conform_read_only() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/foreign");
    for name in ["dcp_single", "dcp_large_item", "dcp_zstd", "megatron_zarr", "olmo_core"] {
        let base = LocalStorage::new(fixtures.join(name));
        let ckpt = open(&base).unwrap_or_else(|e| panic!("{name}: {e}"));
        let view = tessera::__fuzz::checkpoint_storage(&ckpt);
        let shown: Vec<(String, Vec<u8>)> = view
            .list()
            .unwrap()
            .into_iter()
            .map(|n| {
                let bytes = view.read(&n).unwrap_or_else(|e| panic!("{name}: read {n}: {e}"));
                (n, bytes)
            })
            .filter(|(_, b)| !b.is_empty())
            .collect();
        assert!(!shown.is_empty(), "{name}: the view shows no files");
        let objects: Vec<(&str, &[u8])> = shown.iter().map(|(n, b)| (n.as_str(), b.as_slice())).collect();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| conformance::run_read_only(view, &objects)));
        if let Err(p) = r {
            let msg = p.downcast_ref::<String>().cloned().unwrap_or_default();
            panic!("{name} ({}): {msg}", ckpt.format().backend);
        }
    }
}

#[test]
fn a_location_string_opens_the_backend_it_names() {
    let mem = tessera::storage::Location::parse("mem://conformance-open-location").open().unwrap();
    conforms(mem.as_ref());
    let dir = TempDir::new("open-location");
    let local = tessera::storage::Location::parse(dir.path().to_str().unwrap()).open().unwrap();
    conforms(local.as_ref());
    let url = format!("file://{}", dir.path().display());
    let via_url = tessera::storage::Location::parse(&url).open().unwrap();
    via_url.put_atomic("x", b"shared").unwrap();
    assert_eq!(local.read("x").unwrap(), b"shared", "file:// and a plain path are the same directory");
    via_url.delete("x").unwrap();
    assert!(matches!(
        tessera::storage::Location::parse("ftp://host/prefix").open(),
        Err(Error::InvalidArgument { .. })
    ));
}

#[test]
fn named_memory_storages_share_one_namespace() {
    let a = MemoryStorage::named("conformance-shared");
    let b = MemoryStorage::named("conformance-shared");
    let other = MemoryStorage::named("conformance-other");
    a.put_atomic("obj", b"hello").unwrap();
    assert_eq!(b.read("obj").unwrap(), b"hello");
    assert!(matches!(other.size("obj"), Err(Error::NotFound { .. })), "another name");
    assert!(matches!(MemoryStorage::new().size("obj"), Err(Error::NotFound { .. })), "an anonymous store");
    b.delete("obj").unwrap();
    assert!(matches!(a.size("obj"), Err(Error::NotFound { .. })), "deleted through the other handle");
}
