//! What the errors a newcomer meets say (issue 30): each names what was looked for, what was
//! found and what to do, in the library's own text, which every front end shows as it is
//! (Python gets the message of the error). Opening a location that holds no checkpoint (a
//! folder of checkpoints, an empty or missing directory, other files); loading into a tensor
//! of another dtype or shape (the message names no option of any one API); exporting into a
//! directory.

use crate::common::{f32_bytes, TempDir};
use tessera::comm::SoloComm;
use tessera::index::FormatRecord;
use tessera::storage::{LocalStorage, MemoryStorage};
use tessera::tools::{export_safetensors, ExportOptions};
use tessera::{load, open, save, DType, Error, LoadOptions, SaveOptions, ShardedTensor, StateTree, TensorData};

fn checkpoint(dir: &std::path::Path) {
    let t = ShardedTensor::full("w", DType::BF16, &[2, 2], TensorData::Owned(vec![0; 8]));
    save(StateTree::map().with("w", StateTree::Tensor(t)), &LocalStorage::new(dir), &SoloComm, &SaveOptions::default())
        .unwrap();
}

fn request(dtype: DType, shape: &[u64]) -> StateTree<'static> {
    StateTree::map().with("w", StateTree::Tensor(ShardedTensor::full("w", dtype, shape, TensorData::None)))
}

/// The error of every way a reader opens `storage`: open, load, format detection. All the
/// same, and returned.
fn opening_error(storage: &LocalStorage) -> Error {
    let opened = open(storage).unwrap_err();
    let loaded = load(request(DType::BF16, &[2, 2]), storage, &SoloComm, &LoadOptions::default()).unwrap_err();
    let detected = FormatRecord::detect(storage).unwrap_err();
    assert_eq!(opened.to_string(), loaded.to_string());
    assert_eq!(opened.to_string(), detected.to_string());
    opened
}

#[test]
fn a_folder_of_checkpoints_says_which_to_pass() {
    let run = TempDir::new("messages-run");
    checkpoint(&run.join("step200"));
    checkpoint(&run.join("step100"));
    std::fs::create_dir_all(run.join("logs")).unwrap();
    std::fs::write(run.join("logs/out.txt"), b"x").unwrap();
    let e = opening_error(&LocalStorage::new(run.path()));
    assert!(matches!(e, Error::NotFound { .. }), "{e:?}");
    let at = run.path().display();
    assert_eq!(
        e.to_string(),
        format!("no checkpoint in {at}: it holds step100/, step200/ (checkpoints): pass one of them")
    );
}

#[test]
fn an_empty_or_missing_directory_says_so() {
    let empty = TempDir::created("messages-empty");
    let e = opening_error(&LocalStorage::new(empty.path()));
    assert!(matches!(e, Error::NotFound { .. }), "{e:?}");
    assert_eq!(e.to_string(), format!("no checkpoint in {}: the directory is empty", empty.path().display()));

    let missing = TempDir::new("messages-missing");
    let e = opening_error(&LocalStorage::new(missing.path()));
    assert_eq!(e.to_string(), format!("no checkpoint at {}: no such directory", missing.path().display()));

    let memory = MemoryStorage::new();
    let e = open(&memory).unwrap_err();
    assert!(e.to_string().ends_with(": nothing is stored there"), "{e}");
}

#[test]
fn a_directory_of_other_files_says_what_was_looked_for_and_found() {
    let dir = TempDir::created("messages-other");
    std::fs::write(dir.join("notes.txt"), b"x").unwrap();
    let e = opening_error(&LocalStorage::new(dir.path()));
    assert!(matches!(e, Error::NotCommitted { .. }), "{e:?}");
    let text = e.to_string();
    assert!(
        text.starts_with(&format!("no checkpoint in {}: found neither tessera.index", dir.path().display())),
        "{text}"
    );
    assert!(text.ends_with("; it holds notes.txt"), "{text}");

    // The data file of a save that never committed: what removes it.
    std::fs::write(dir.join("0123456789abcdef-r00000.safetensors"), b"x").unwrap();
    std::fs::remove_file(dir.join("notes.txt")).unwrap();
    let e = opening_error(&LocalStorage::new(dir.path()));
    let text = e.to_string();
    let gc = format!("`tessera gc {}` removes them", dir.path().display());
    assert!(text.starts_with("no committed checkpoint in") && text.ends_with(&gc), "{text}");
}

#[test]
fn a_dtype_mismatch_names_the_stored_dtype_and_what_to_do() {
    let dir = TempDir::new("messages-dtype");
    checkpoint(dir.path());
    let storage = LocalStorage::new(dir.path());
    let e = load(request(DType::F32, &[2, 2]), &storage, &SoloComm, &LoadOptions::default()).unwrap_err();
    assert!(matches!(e, Error::Mismatch { .. }), "{e:?}");
    assert_eq!(
        e.to_string(),
        "\"w\": stored dtype is bf16, the request has f32: load it into a bf16 tensor (the checkpoint's dtype) and \
         convert that after loading"
    );
}

#[test]
fn a_shape_mismatch_names_no_option_of_any_one_api() {
    let dir = TempDir::new("messages-shape");
    checkpoint(dir.path());
    let storage = LocalStorage::new(dir.path());
    for shape in [&[4u64, 1][..], &[4]] {
        let e = load(request(DType::BF16, shape), &storage, &SoloComm, &LoadOptions::default()).unwrap_err();
        let text = e.to_string();
        assert!(matches!(e, Error::Mismatch { .. }), "{e:?}");
        assert!(!text.contains("allow_shape_mismatch"), "{text}");
        assert_eq!(
            text,
            format!("\"w\": stored global shape is [2, 2], the request has {shape:?}: load it into a tensor of the stored shape")
        );
    }
}

#[test]
fn an_unsharded_export_into_a_directory_writes_model_safetensors_there() {
    let src = TempDir::new("messages-export-src");
    let w = f32_bytes(&[1.0, 2.0]);
    let t = ShardedTensor::full("w", DType::F32, &[2], TensorData::Owned(w));
    save(
        StateTree::map().with("w", StateTree::Tensor(t)),
        &LocalStorage::new(src.path()),
        &SoloComm,
        &SaveOptions::default(),
    )
    .unwrap();
    let out = TempDir::new("messages-export-out");
    let opts = ExportOptions::default();
    // A new directory, named with a trailing separator; an existing one, without.
    for given in [format!("{}/", out.path().display()), out.path().display().to_string()] {
        let report = export_safetensors(&LocalStorage::new(src.path()), given.as_ref(), &opts, &mut |_, _| {}).unwrap();
        let file = out.join("model.safetensors");
        assert_eq!(report.files, std::slice::from_ref(&file), "{given}");
        assert!(out.path().is_dir() && file.is_file());
        let storage = tessera::storage::Location::parse(file.to_str().unwrap()).open().unwrap();
        let read = open(&*storage).and_then(|c| c.read_tensors(None)).unwrap();
        assert_eq!(read["w"].data, f32_bytes(&[1.0, 2.0]));
    }
}
