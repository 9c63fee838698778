//! The GCS backend (`gs://`, cargo feature `gcs`) against fake-gcs-server behind the test
//! adapter of `crate::common::gcs` (which says what the emulator does and what the adapter rewrites):
//! the storage conformance suite, conditional creates, and multipart uploads (tessera's, and
//! `object_store`'s with more parts than one compose takes), and a checkpoint saved, loaded and
//! verified through it.

use std::sync::Arc;

use crate::common::{f32_bytes, f32s, gcs, run_ranks, shard, small_blocks};
use object_store::multipart::MultipartStore;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};
use tessera::storage::*;
use tessera::tools::*;
use tessera::*;

/// The conformance suite on a fresh prefix; no part objects are left behind.
#[test]
fn gcs_storage_conforms() {
    let url = gcs::fresh_url("conformance");
    let storage = ObjectStorage::open(&url, gcs::test_options()).unwrap();
    conformance::run(&storage);
    let prefix = url.trim_start_matches(&format!("gs://{}/", gcs::BUCKET));
    assert_eq!(gcs::list_keys(&format!("{}{prefix}", gcs::PARTS_PREFIX)), Vec::<String>::new());
}

/// Saves (2 ranks), loads and verifies a checkpoint through GCS (as `conformance.rs` does for
/// the other backends).
#[test]
fn checkpoint_round_trip() {
    let storage = gcs::fresh_storage("checkpoint");
    let w: Vec<f32> = (0..24).map(|i| i as f32 * 0.5).collect();
    let out = run_ranks(2, |c| {
        let r = c.rank() as u64;
        let bytes = f32_bytes(&w[r as usize * 12..][..12]);
        let t = shard("w", DType::F32, &[4, 6], &[2 * r, 0], &[2, 6], 0, None, TensorData::Owned(bytes));
        save(StateTree::map().with("w", StateTree::Tensor(t)), &storage, c, &small_blocks(32))
    });
    for r in out {
        r.unwrap();
    }
    assert_eq!(f32s(&open(&storage).and_then(|c| c.read_tensors(None)).unwrap()["w"].data), w);
    assert!(verify(&storage, 2).unwrap().problems.is_empty());
    for n in storage.list().unwrap() {
        storage.delete(&n).unwrap();
    }
}

#[test]
fn put_if_absent_of_an_existing_object_is_already_exists() {
    let storage = gcs::fresh_storage("if-absent");
    storage.put_if_absent("index", b"first").unwrap();
    let r = storage.put_if_absent("index", b"second");
    assert!(matches!(r, Err(Error::AlreadyExists { .. })), "{r:?}");
    assert_eq!(storage.read("index").unwrap(), b"first");
    storage.delete("index").unwrap();
}

fn store() -> Arc<object_store::gcp::GoogleCloudStorage> {
    let mut b = object_store::gcp::GoogleCloudStorageBuilder::new().with_bucket_name(gcs::BUCKET);
    for (k, v) in gcs::test_options().config {
        b = b.with_config(k.parse().unwrap(), v);
    }
    Arc::new(b.build().unwrap())
}

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(f)
}

/// `PutMode::Create` sends `x-goog-if-generation-match: 0`; a second create of a name is
/// refused by the emulator (412), which `object_store` reports as `AlreadyExists`.
#[test]
fn second_create_is_refused() {
    let store = store();
    let path = Path::from(format!("{}/x", gcs::fresh_url("create").rsplit('/').next().unwrap()));
    let create = || PutOptions { mode: PutMode::Create, ..Default::default() };
    block_on(async {
        let first = store.put_opts(&path, PutPayload::from_static(b"one"), create()).await.unwrap();
        assert!(first.e_tag.is_some() && first.version.is_some(), "{first:?}");
        let second = store.put_opts(&path, PutPayload::from_static(b"two"), create()).await;
        assert!(matches!(second, Err(object_store::Error::AlreadyExists { .. })), "{second:?}");
        let meta = store.head(&path).await.unwrap();
        assert_eq!((meta.size, meta.e_tag.as_deref()), (3, first.e_tag.as_deref()));
        assert_eq!(store.get(&path).await.unwrap().bytes().await.unwrap().as_ref(), b"one");
        // An overwrite replaces it; a create after a delete succeeds.
        store.put(&path, PutPayload::from_static(b"three")).await.unwrap();
        assert_eq!(store.get(&path).await.unwrap().bytes().await.unwrap().as_ref(), b"three");
        store.delete(&path).await.unwrap();
        store.put_opts(&path, PutPayload::from_static(b"four"), create()).await.unwrap();
        store.delete(&path).await.unwrap();
    });
}

/// 40 parts (more than one compose takes), uploaded out of order; then an aborted upload.
#[test]
fn object_store_multipart_upload() {
    let store = store();
    let prefix = gcs::fresh_url("multipart").rsplit('/').next().unwrap().to_string();
    let path = Path::from(format!("{prefix}/big"));
    let parts: Vec<Vec<u8>> = (0..40u8).map(|i| vec![i; 1000 + i as usize]).collect();
    block_on(async {
        let id = store.create_multipart(&path).await.unwrap();
        let mut ids = vec![None; parts.len()];
        for i in (0..parts.len()).rev() {
            ids[i] = Some(store.put_part(&path, &id, i, PutPayload::from(parts[i].clone())).await.unwrap());
        }
        let ids = ids.into_iter().map(Option::unwrap).collect();
        let done = store.complete_multipart(&path, &id, ids).await.unwrap();
        let got = store.get(&path).await.unwrap().bytes().await.unwrap();
        assert!(got.as_ref() == parts.concat(), "composed object differs ({} bytes)", got.len());
        assert_eq!(store.head(&path).await.unwrap().e_tag, done.e_tag);
        store.delete(&path).await.unwrap();

        let aborted = Path::from(format!("{prefix}/aborted"));
        let id = store.create_multipart(&aborted).await.unwrap();
        store.put_part(&aborted, &id, 0, PutPayload::from_static(b"a")).await.unwrap();
        store.put_part(&aborted, &id, 1, PutPayload::from_static(b"b")).await.unwrap();
        store.abort_multipart(&aborted, &id).await.unwrap();
        assert!(matches!(store.head(&aborted).await, Err(object_store::Error::NotFound { .. })));
    });
    assert_eq!(gcs::list_keys(&format!("{}{prefix}", gcs::PARTS_PREFIX)), Vec::<String>::new());
    assert_eq!(gcs::list_keys(&prefix), Vec::<String>::new());
}

/// tessera's multipart writer: 11 MiB in 5 MiB parts (3 parts), written from the end.
#[test]
fn tessera_multipart_object() {
    let storage = gcs::fresh_storage("tessera-multipart");
    let data = crate::common::Rng::new(7).bytes(11 << 20);
    let w = storage.create("big", data.len() as u64).unwrap();
    for (i, piece) in data.chunks(1 << 20).enumerate().rev() {
        w.write_at((i << 20) as u64, piece).unwrap();
    }
    w.finish().unwrap();
    assert_eq!(storage.request_counts().parts, 3);
    assert_eq!(storage.size("big").unwrap(), data.len() as u64);
    assert!(storage.read("big").unwrap() == data);
    let mut buf = vec![0u8; 100];
    storage.read_at("big", (5 << 20) - 50, &mut buf).unwrap();
    assert!(buf == data[(5 << 20) - 50..(5 << 20) + 50]);
    storage.delete("big").unwrap();
    assert_eq!(storage.list().unwrap(), Vec::<String>::new());
}
