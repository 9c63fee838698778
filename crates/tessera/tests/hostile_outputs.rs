//! Outputs that must not destroy user files: an export (`unshard`) inside its source checkpoint,
//! onto a FIFO, a symlink, a directory or a device node, or through a symlink planted at a
//! temporary name; a conversion into a directory that holds a committed checkpoint of any format
//! (native, DCP, Megatron torch_dist and zarr, OLMo-core) without overwrite.

use std::path::{Path, PathBuf};

use crate::common::files::{copy_dir, snapshot};
use crate::common::*;
use tessera::comm::*;
use tessera::index::*;
use tessera::storage::*;
use tessera::tools::*;
use tessera::*;

fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(rel)
}

/// A small native checkpoint at `dir`.
fn native_checkpoint(dir: &Path) -> LocalStorage {
    let s = LocalStorage::new(dir);
    let data: Vec<f32> = (0..24).map(|i| i as f32 * 0.25).collect();
    let tree = StateTree::map()
        .with(
            "w",
            StateTree::Tensor(ShardedTensor::full("w", DType::F32, &[4, 6], TensorData::Owned(f32_bytes(&data)))),
        )
        .with(
            "b",
            StateTree::Tensor(ShardedTensor::full("b", DType::I64, &[2], TensorData::Owned(i64_bytes(&[3, -4])))),
        );
    save(tree, &s, &SoloComm, &SaveOptions::default()).unwrap();
    s
}

fn sharded() -> ExportOptions {
    ExportOptions { max_shard_size: Some(1 << 20), ..Default::default() }
}

/// Expects a refusal naming `path`.
fn assert_refused(r: Result<ExportReport>, path: &Path) {
    match r {
        Err(Error::InvalidArgument { reason }) => {
            assert!(reason.contains(&path.display().to_string()), "the reason names {}: {reason}", path.display())
        }
        other => panic!("{}: expected InvalidArgument, got {other:?}", path.display()),
    }
}

fn no_progress() -> impl FnMut(u64, u64) {
    |_, _| {}
}

#[test]
fn export_into_its_own_source_is_refused_and_the_source_kept_byte_for_byte() {
    let dir = TempDir::created("hostile-inside");
    let ckpt = dir.join("ckpt");
    let src = native_checkpoint(&ckpt);
    std::os::unix::fs::symlink(&ckpt, dir.join("alias")).unwrap();
    let before = snapshot(&ckpt);
    let single = [
        ckpt.join(INDEX_FILE),
        ckpt.join("model.safetensors"),
        ckpt.join("sub/dir/model.safetensors"),
        dir.join("alias").join(INDEX_FILE),
        dir.join("ckpt/../ckpt/model.safetensors"),
    ];
    for out in &single {
        assert_refused(export_safetensors(&src, out, &ExportOptions::default(), &mut no_progress()), out);
    }
    for out in [ckpt.clone(), ckpt.join("shards"), dir.join("alias")] {
        assert_refused(export_safetensors(&src, &out, &sharded(), &mut no_progress()), &out);
    }
    // The source given as a file:// location, or through the symlink, is the same directory.
    for loc in [format!("file://{}", ckpt.display()), dir.join("alias").display().to_string()] {
        let s = tessera::storage::Location::parse(&loc).open().unwrap();
        let out = ckpt.join(INDEX_FILE);
        assert_refused(export_safetensors(s.as_ref(), &out, &ExportOptions::default(), &mut no_progress()), &out);
    }
    assert_eq!(snapshot(&ckpt), before, "the source is intact");
    assert!(!ckpt.join("sub").exists() && !ckpt.join("shards").exists(), "no directory created inside the source");
    assert!(verify(&src, 2).unwrap().problems.is_empty(), "the source verifies");

    // A foreign source too: DCP's `.metadata`.
    let dcp = dir.join("dcp");
    copy_dir(&fixture("foreign/dcp_single"), &dcp);
    let before = snapshot(&dcp);
    let out = dcp.join(".metadata");
    let s = LocalStorage::new(&dcp);
    assert_refused(export_safetensors(&s, &out, &ExportOptions::default(), &mut no_progress()), &out);
    assert_eq!(snapshot(&dcp), before);

    // Next to the source is fine.
    let out = dir.join("model.safetensors");
    export_safetensors(&src, &out, &ExportOptions::default(), &mut no_progress()).unwrap();
    assert!(out.is_file());
}

#[test]
fn export_onto_anything_but_a_regular_file_or_a_new_name_is_refused_untouched() {
    let dir = TempDir::created("hostile-special");
    let src = native_checkpoint(&dir.join("ckpt"));
    let outs = dir.join("outs");
    std::fs::create_dir_all(&outs).unwrap();

    // A FIFO (opening it for writing would block; renaming over it would replace it).
    let fifo = outs.join("fifo.safetensors");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
    // A symlink to a user file, and a dangling one.
    let victim = dir.join("victim.txt");
    std::fs::write(&victim, b"user data").unwrap();
    let link = outs.join("link.safetensors");
    std::os::unix::fs::symlink(&victim, &link).unwrap();
    let dangling = outs.join("dangling.safetensors");
    std::os::unix::fs::symlink(dir.join("nowhere"), &dangling).unwrap();
    // A directory, which receives model.safetensors: a link planted under that name.
    let sub = outs.join("sub.safetensors");
    std::fs::create_dir(&sub).unwrap();
    std::fs::write(sub.join("keep"), b"k").unwrap();
    let planted = sub.join("model.safetensors");
    std::os::unix::fs::symlink(&victim, &planted).unwrap();
    let before = snapshot(&outs);
    for out in [&fifo, &link, &dangling] {
        assert_refused(export_safetensors(&src, out, &ExportOptions::default(), &mut no_progress()), out);
    }
    assert_refused(export_safetensors(&src, &sub, &ExportOptions::default(), &mut no_progress()), &planted);
    // A sharded export into a FIFO, or whose shard or index name is taken by one of these.
    assert_refused(export_safetensors(&src, &fifo, &sharded(), &mut no_progress()), &fifo);
    let shards = dir.join("shards");
    std::fs::create_dir_all(&shards).unwrap();
    let shard = shards.join("model-00001-of-00001.safetensors");
    std::os::unix::fs::symlink(&victim, &shard).unwrap();
    assert_refused(export_safetensors(&src, &shards, &sharded(), &mut no_progress()), &shard);
    std::fs::remove_file(&shard).unwrap();
    let index = shards.join("model.safetensors.index.json");
    std::os::unix::fs::symlink(&victim, &index).unwrap();
    assert_refused(export_safetensors(&src, &shards, &sharded(), &mut no_progress()), &index);
    assert_eq!(snapshot(&outs), before, "nothing replaced, nothing left behind");
    assert_eq!(std::fs::read(&victim).unwrap(), b"user data");
    assert_eq!(std::fs::read_dir(&shards).unwrap().count(), 1, "only the planted link: no temporary file left");
    assert!(!dir.join("nowhere").exists());

    // A device node: refused without touching it (the test may run as root, where a rename
    // would replace /dev/null by a regular file).
    use std::os::unix::fs::MetadataExt;
    let null = Path::new("/dev/null");
    let m0 = std::fs::symlink_metadata(null).unwrap();
    assert_refused(export_safetensors(&src, null, &ExportOptions::default(), &mut no_progress()), null);
    let m1 = std::fs::symlink_metadata(null).unwrap();
    assert_eq!((m0.ino(), m0.mode(), m0.rdev()), (m1.ino(), m1.mode(), m1.rdev()));
    assert!(!Path::new("/dev").read_dir().unwrap().any(|e| e
        .unwrap()
        .file_name()
        .to_string_lossy()
        .starts_with(".null.tmp")));

    // An existing regular file is replaced (atomically), as before.
    let regular = outs.join("model.safetensors");
    std::fs::write(&regular, b"old export").unwrap();
    export_safetensors(&src, &regular, &ExportOptions::default(), &mut no_progress()).unwrap();
    assert_ne!(std::fs::read(&regular).unwrap(), b"old export");
}

#[test]
fn export_does_not_follow_symlinks_planted_at_temporary_names() {
    let dir = TempDir::created("hostile-tmp");
    let src = native_checkpoint(&dir.join("ckpt"));
    let out = dir.join("out");
    std::fs::create_dir_all(&out).unwrap();
    let victim = dir.join("victim.txt");
    std::fs::write(&victim, b"user data").unwrap();
    // The names the temporary files used to get (`.NAME.tmp-PID`), and variations: the real ones
    // carry an unpredictable nonce and are created exclusively.
    let pid = std::process::id();
    let names = ["model.safetensors", "model-00001-of-00001.safetensors", "model.safetensors.index.json"];
    for n in names {
        for tmp in [format!(".{n}.tmp-{pid}"), format!(".{n}.tmp-{pid}-0"), format!(".{n}.tmp")] {
            std::os::unix::fs::symlink(&victim, out.join(tmp)).unwrap();
        }
    }
    let before = snapshot(&out);
    export_safetensors(&src, &out.join("model.safetensors"), &ExportOptions::default(), &mut no_progress()).unwrap();
    export_safetensors(&src, &out, &sharded(), &mut no_progress()).unwrap();
    assert_eq!(std::fs::read(&victim).unwrap(), b"user data", "the symlinks' target is untouched");
    let mut after = snapshot(&out);
    for n in names {
        assert!(after.remove(Path::new(n)).is_some_and(|b| b.len() > 20), "{n} written");
    }
    assert_eq!(after, before, "the planted links are still there, as they were; no temporary file left");
}

#[test]
fn convert_refuses_a_destination_holding_a_checkpoint_of_any_format_unless_overwriting() {
    let dir = TempDir::created("hostile-convert");
    let src = native_checkpoint(&dir.join("src"));
    for (i, rel) in [
        "foreign/dcp_single",
        "foreign/megatron_tp2_dp2",
        "foreign/megatron_zarr",
        "foreign/olmo_core",
        "olmo/olmo_single",
        "olmo/olmo01_fsdp_w2",
    ]
    .into_iter()
    .enumerate()
    {
        let dst_dir = dir.join(&format!("dst{i}"));
        copy_dir(&fixture(rel), &dst_dir);
        let dst = LocalStorage::new(&dst_dir);
        let record = open(&dst).unwrap().format().clone();
        assert_ne!(record.backend, tessera::index::Backend::Tessera, "{rel}");
        let before = snapshot(&dst_dir);
        match convert(&src, &dst, &ConvertOptions::default(), &mut no_progress()) {
            Err(Error::AlreadyExists { path }) => assert_eq!(path, dst_dir, "{rel}"),
            other => panic!("{rel}: expected AlreadyExists, got {other:?}"),
        }
        assert_eq!(snapshot(&dst_dir), before, "{rel}: nothing written");
        // With overwrite the native checkpoint is committed there (and is what loads).
        let opts = ConvertOptions { overwrite: true, ..Default::default() };
        convert(&src, &dst, &opts, &mut no_progress()).unwrap_or_else(|e| panic!("{rel}: {e}"));
        assert_eq!(open(&dst).unwrap().format().clone().backend, tessera::index::Backend::Tessera, "{rel}");
        assert_eq!(
            open(&dst).and_then(|c| c.read_tensors(None)).unwrap(),
            open(&src).and_then(|c| c.read_tensors(None)).unwrap(),
            "{rel}"
        );
    }
    // An empty or absent destination, or one holding only unrelated files, is fine.
    let other = dir.join("other");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(other.join("notes.txt"), b"n").unwrap();
    convert(&src, &LocalStorage::new(&other), &ConvertOptions::default(), &mut no_progress()).unwrap();
    assert_eq!(std::fs::read(other.join("notes.txt")).unwrap(), b"n");
    convert(&src, &LocalStorage::new(dir.join("absent")), &ConvertOptions::default(), &mut no_progress()).unwrap();
}
