//! Hostile checkpoints on a local directory: a file that is a symbolic link (to a file outside,
//! to `/proc/self/environ`, even to a file inside with the right bytes), a folder that is a link,
//! a FIFO in place of a file, a name leading out of the checkpoint. Every reader (load, verify,
//! export, each format) must refuse them with `Error::Corrupt` naming the entry, never read
//! through them, never hang, and `verify` must never call such a checkpoint sound.

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use crate::common::files::copy_dir;
use crate::common::TempDir;
use tessera::index::INDEX_FILE;
use tessera::storage::LocalStorage;
use tessera::tools::{export_safetensors, verify, ExportOptions};
use tessera::{open, Checkpoint, Error, Storage};

fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(rel)
}
/// A scratch directory holding `ckpt/` (a copy of fixture `rel`) and room outside it.
fn scratch(tag: &str, rel: &str) -> (TempDir, PathBuf) {
    let dir = TempDir::created(tag);
    let ckpt = dir.join("ckpt");
    copy_dir(&fixture(rel), &ckpt);
    (dir, ckpt)
}

/// Moves `ckpt/name` to `outside` and leaves a link to it in its place: the same bytes, reached
/// through a link.
fn link_out(ckpt: &Path, name: &str, outside: &Path) {
    std::fs::rename(ckpt.join(name), outside).unwrap();
    symlink(outside, ckpt.join(name)).unwrap();
}

/// Replaces `ckpt/name` with a FIFO (no writer ever opens it: a reader that opens it blocks).
fn fifo_in_place(ckpt: &Path, name: &str) {
    let path = ckpt.join(name);
    std::fs::remove_file(&path).unwrap();
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo {}", path.display());
}

/// Runs `f` on a thread and fails the test if it has not returned within a minute: a reader
/// that opens a FIFO would otherwise hang the suite instead of failing it.
fn within_a_minute<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(60)).unwrap_or_else(|_| panic!("{what}: still blocked after a minute"))
}

/// `e` is `Corrupt` about `name` (the path ends with it, the message says it) and says `why`.
fn assert_refused(e: &Error, name: &str, why: &str) {
    assert!(
        matches!(e, Error::Corrupt { path, reason } if path.ends_with(name) && reason.contains(why)),
        "expected Corrupt naming {name} ({why}), got {e:?}"
    );
    assert!(e.to_string().contains(name), "{e}");
}

/// Load, verify and export of `ckpt` all refuse `name` for `why`: load and export with the
/// error, verify either with the error or with a problem naming it — never "sound".
fn assert_every_reader_refuses(ckpt: &Path, name: &str, why: &str) {
    let storage = LocalStorage::new(ckpt);
    let e = open(&storage).and_then(|c| c.read_tensors(None)).expect_err("load must refuse");
    assert_refused(&e, name, why);
    match verify(&storage, 2) {
        Ok(report) => assert!(
            report.problems.iter().any(|p| p.contains(name) && p.contains(why)),
            "verify must report {name}: {:?}",
            report.problems
        ),
        Err(e) => assert_refused(&e, name, why),
    }
    let out = ckpt.parent().unwrap().join("export.safetensors");
    let e = export_safetensors(&storage, &out, &ExportOptions::default(), &mut |_, _| {}).expect_err("export");
    assert_refused(&e, name, why);
}

const LINK: &str = "is a symbolic link";
const FIFO: &str = "is a FIFO";

/// The golden native checkpoint's first data file.
const NATIVE_DATA: &str = "a209342d75b9d537-r00000.safetensors";

#[test]
fn native_data_file_linked_outside_is_refused() {
    let (dir, ckpt) = scratch("hostile-native-out", "golden_v2");
    link_out(&ckpt, NATIVE_DATA, &dir.join("elsewhere.safetensors"));
    assert_every_reader_refuses(&ckpt, NATIVE_DATA, LINK);
}

#[test]
fn native_data_file_linked_inside_with_the_right_bytes_is_still_refused() {
    let (_dir, ckpt) = scratch("hostile-native-in", "golden_v2");
    std::fs::rename(ckpt.join(NATIVE_DATA), ckpt.join("copy.bin")).unwrap();
    symlink("copy.bin", ckpt.join(NATIVE_DATA)).unwrap();
    assert_every_reader_refuses(&ckpt, NATIVE_DATA, LINK);
}

#[test]
fn native_index_linked_is_refused() {
    let (dir, ckpt) = scratch("hostile-native-index", "golden_v2");
    link_out(&ckpt, INDEX_FILE, &dir.join("elsewhere.index"));
    assert_every_reader_refuses(&ckpt, INDEX_FILE, LINK);
}

#[test]
fn native_fifo_in_place_of_a_data_file_or_the_index_is_refused_without_blocking() {
    for name in [NATIVE_DATA, INDEX_FILE] {
        let (dir, ckpt) = scratch("hostile-native-fifo", "golden_v2");
        fifo_in_place(&ckpt, name);
        within_a_minute(name, move || {
            assert_every_reader_refuses(&ckpt, name, FIFO);
            drop(dir);
        });
    }
}

#[test]
fn native_index_naming_a_file_outside_is_corrupt() {
    let (_dir, ckpt) = scratch("hostile-native-dotdot", "golden_v2");
    let storage = LocalStorage::new(&ckpt);
    let mut index = open(&storage).map(Checkpoint::into_index).unwrap();
    index.files[0].name = format!("../{NATIVE_DATA}");
    std::fs::write(ckpt.join(INDEX_FILE), index.encode()).unwrap();
    let storage = LocalStorage::new(&ckpt);
    let e = open(&storage).and_then(|c| c.read_tensors(None)).unwrap_err();
    assert_refused(&e, INDEX_FILE, "not a plain name");
    let e = verify(&storage, 2).unwrap_err();
    assert_refused(&e, INDEX_FILE, "not a plain name");
}

#[test]
fn a_root_given_through_a_link_is_read() {
    // The root is the caller's choice: only what lies below it must not be a link.
    let (dir, ckpt) = scratch("hostile-root-link", "golden_v2");
    let alias = dir.join("alias");
    symlink(&ckpt, &alias).unwrap();
    let storage = LocalStorage::new(&alias);
    assert_eq!(
        open(&storage).and_then(|c| c.read_tensors(None)).unwrap().len(),
        open(&LocalStorage::new(&ckpt)).and_then(|c| c.read_tensors(None)).unwrap().len()
    );
    assert!(verify(&storage, 2).unwrap().problems.is_empty());
}

#[test]
fn dcp_item_file_linked_is_refused() {
    let (dir, ckpt) = scratch("hostile-dcp", "foreign/dcp_single");
    link_out(&ckpt, "__0_0.distcp", &dir.join("elsewhere.distcp"));
    assert_every_reader_refuses(&ckpt, "__0_0.distcp", LINK);
}

#[test]
fn dcp_metadata_as_a_fifo_is_refused_without_blocking() {
    let (dir, ckpt) = scratch("hostile-dcp-fifo", "foreign/dcp_single");
    fifo_in_place(&ckpt, ".metadata");
    within_a_minute(".metadata", move || {
        assert_every_reader_refuses(&ckpt, ".metadata", FIFO);
        drop(dir);
    });
}

#[test]
fn dcp_metadata_naming_a_file_outside_is_corrupt() {
    // Same-length replacements keep the pickle's string lengths right.
    for bad in ["../0_0.distc", "__0_0\\distcp", "__0_0\0distcp", "/_0_0.distcp"] {
        let (_dir, ckpt) = scratch("hostile-dcp-dotdot", "foreign/dcp_single");
        let path = ckpt.join(".metadata");
        let bytes = std::fs::read(&path).unwrap();
        let (from, to) = (b"__0_0.distcp".as_slice(), bad.as_bytes());
        assert_eq!(from.len(), to.len());
        let mut out = Vec::with_capacity(bytes.len());
        let mut i = 0;
        while i < bytes.len() {
            if bytes[i..].starts_with(from) {
                out.extend_from_slice(to);
                i += from.len();
            } else {
                out.push(bytes[i]);
                i += 1;
            }
        }
        assert_ne!(out, bytes);
        std::fs::write(&path, out).unwrap();
        let storage = LocalStorage::new(&ckpt);
        let e = open(&storage).and_then(|c| c.read_tensors(None)).unwrap_err();
        assert_refused(&e, ".metadata", "not a plain relative name");
        let e = verify(&storage, 2).unwrap_err();
        assert_refused(&e, ".metadata", "not a plain relative name");
    }
}

#[test]
fn megatron_item_file_linked_is_refused() {
    let (dir, ckpt) = scratch("hostile-megatron", "foreign/megatron_tp2_dp2");
    link_out(&ckpt, "__1_0.distcp", &dir.join("elsewhere.distcp"));
    assert_every_reader_refuses(&ckpt, "__1_0.distcp", LINK);
}

#[test]
fn zarr_chunk_linked_to_the_environment_is_refused() {
    let (_dir, ckpt) = scratch("hostile-zarr-environ", "foreign/megatron_zarr");
    std::fs::remove_file(ckpt.join("step_counts/0.1")).unwrap();
    symlink("/proc/self/environ", ckpt.join("step_counts/0.1")).unwrap();
    assert_every_reader_refuses(&ckpt, "step_counts/0.1", LINK);
}

#[test]
fn zarr_array_folder_linked_is_refused() {
    let (dir, ckpt) = scratch("hostile-zarr-dir", "foreign/megatron_zarr");
    link_out(&ckpt, "embedding.word_embeddings.weight", &dir.join("elsewhere"));
    assert_every_reader_refuses(&ckpt, "embedding.word_embeddings.weight", LINK);
}

#[test]
fn zarr_chunk_as_a_fifo_is_refused_without_blocking() {
    let (dir, ckpt) = scratch("hostile-zarr-fifo", "foreign/megatron_zarr");
    fifo_in_place(&ckpt, "step_counts/0.0");
    within_a_minute("zarr fifo", move || {
        assert_every_reader_refuses(&ckpt, "step_counts/0.0", FIFO);
        drop(dir);
    });
}

#[test]
fn olmo_rank_file_linked_is_refused() {
    let (dir, ckpt) = scratch("hostile-olmo", "olmo/olmo_single");
    link_out(&ckpt, "rank_0.safetensors", &dir.join("elsewhere.safetensors"));
    assert_every_reader_refuses(&ckpt, "rank_0.safetensors", LINK);
}

#[test]
fn olmo_metadata_as_a_fifo_is_refused_without_blocking() {
    let (dir, ckpt) = scratch("hostile-olmo-fifo", "olmo/olmo_single");
    fifo_in_place(&ckpt, "metadata.json");
    within_a_minute("olmo fifo", move || {
        assert_every_reader_refuses(&ckpt, "metadata.json", FIFO);
        drop(dir);
    });
}

#[test]
fn olmo_metadata_naming_a_file_outside_is_corrupt() {
    let (_dir, ckpt) = scratch("hostile-olmo-dotdot", "olmo/olmo_single");
    let path = ckpt.join("metadata.json");
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains("\"rank_0.safetensors\""));
    std::fs::write(&path, text.replace("\"rank_0.safetensors\"", "\"../rank_0.safetensors\"")).unwrap();
    let storage = LocalStorage::new(&ckpt);
    let e = open(&storage).and_then(|c| c.read_tensors(None)).unwrap_err();
    assert_refused(&e, "metadata.json", "not a plain name");
    let e = verify(&storage, 2).unwrap_err();
    assert_refused(&e, "metadata.json", "not a plain name");
}

// ---- the storage itself ---------------------------------------------------------------------

#[test]
fn reads_never_pass_through_a_linked_folder() {
    let dir = TempDir::created("hostile-storage-dir");
    let outside = dir.join("outside");
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::write(outside.join("f"), b"secret").unwrap();
    let root = dir.join("root");
    std::fs::create_dir_all(root.join("real")).unwrap();
    std::fs::write(root.join("real/f"), b"plain").unwrap();
    symlink(&outside, root.join("linked")).unwrap();
    let s = LocalStorage::new(&root);
    assert_eq!(s.read("real/f").unwrap(), b"plain");
    assert_eq!(s.size("real/f").unwrap(), 5);
    let mut buf = [0u8; 3];
    s.read_at("real/f", 1, &mut buf).unwrap();
    assert_eq!(&buf, b"lai");
    let e = s.read("linked/f").unwrap_err();
    assert_refused(&e, "linked", LINK);
    assert!(e.to_string().contains("linked/f"), "{e}");
    assert_refused(&s.size("linked/f").unwrap_err(), "linked", LINK);
    assert_refused(&s.read_at("linked/f", 0, &mut buf).unwrap_err(), "linked", LINK);
    // A listing neither descends into the link nor leaves it out silently.
    assert_refused(&s.list_recursive().unwrap_err(), "linked", LINK);
    // The flat listing (writers' cleanups) holds objects only: links are none.
    assert!(s.list().unwrap().is_empty());
}

#[test]
fn a_linked_file_is_refused_by_size_and_reads() {
    let dir = TempDir::created("hostile-storage-file");
    let root = dir.join("root");
    std::fs::create_dir_all(&root).unwrap();
    std::fs::write(dir.join("secret"), b"secret").unwrap();
    symlink(dir.join("secret"), root.join("f")).unwrap();
    symlink("/proc/self/environ", root.join("env")).unwrap();
    let s = LocalStorage::new(&root);
    for name in ["f", "env"] {
        assert_refused(&s.size(name).unwrap_err(), name, LINK);
        assert_refused(&s.read(name).unwrap_err(), name, LINK);
        assert_refused(&s.read_at(name, 0, &mut [0u8; 1]).unwrap_err(), name, LINK);
    }
    // Missing stays NotFound (detection relies on it), also below a folder that is missing.
    assert!(matches!(s.size("absent").unwrap_err(), Error::NotFound { .. }));
    assert!(matches!(s.read("no/such/file").unwrap_err(), Error::NotFound { .. }));
}

#[test]
fn names_leading_out_of_the_checkpoint_are_invalid() {
    let dir = TempDir::created("hostile-storage-names");
    std::fs::write(dir.join("f"), b"x").unwrap();
    let s = LocalStorage::new(dir.join("root"));
    for name in ["../f", "/etc/passwd", "a/../../f", "a//b", "", ".", "a/./b", "a\\b", "a\0b", "a/"] {
        assert!(matches!(s.read(name).unwrap_err(), Error::InvalidArgument { .. }), "{name:?}");
        assert!(matches!(s.size(name).unwrap_err(), Error::InvalidArgument { .. }), "{name:?}");
        assert!(matches!(s.read_at(name, 0, &mut [0u8; 1]).unwrap_err(), Error::InvalidArgument { .. }), "{name:?}");
    }
}

#[test]
fn writes_replace_a_planted_link_instead_of_writing_through_it() {
    let dir = TempDir::created("hostile-storage-write");
    let root = dir.join("root");
    std::fs::create_dir_all(&root).unwrap();
    let victim = dir.join("victim");
    std::fs::write(&victim, b"keep me").unwrap();
    symlink(&victim, root.join("created")).unwrap();
    symlink(&victim, root.join("published")).unwrap();
    let s = LocalStorage::new(&root);
    let w = s.create("created", 4).unwrap();
    w.write_at(0, b"new!").unwrap();
    w.finish().unwrap();
    s.put_atomic("published", b"new bytes").unwrap();
    assert_eq!(std::fs::read(&victim).unwrap(), b"keep me");
    assert_eq!(s.read("created").unwrap(), b"new!");
    assert_eq!(s.read("published").unwrap(), b"new bytes");
    assert!(std::fs::symlink_metadata(root.join("created")).unwrap().file_type().is_file());
    // A hard link to a file outside is replaced too, not written into.
    std::fs::remove_file(root.join("created")).unwrap();
    std::fs::hard_link(&victim, root.join("created")).unwrap();
    let w = s.create("created", 2).unwrap();
    w.write_at(0, b"ok").unwrap();
    w.finish().unwrap();
    assert_eq!(std::fs::read(&victim).unwrap(), b"keep me");
    // put_if_absent does not take a link for absence, nor write through it.
    symlink(&victim, root.join("absent?")).unwrap();
    assert!(matches!(s.put_if_absent("absent?", b"x").unwrap_err(), Error::AlreadyExists { .. }));
    assert_eq!(std::fs::read(&victim).unwrap(), b"keep me");
}

#[test]
fn a_fifo_is_refused_by_size_and_reads_without_blocking() {
    let dir = TempDir::created("hostile-storage-fifo");
    std::fs::write(dir.join("f"), b"x").unwrap();
    fifo_in_place(dir.path(), "f");
    let root = dir.path().to_path_buf();
    within_a_minute("storage fifo", move || {
        let s = LocalStorage::new(&root);
        assert_refused(&s.size("f").unwrap_err(), "f", FIFO);
        assert_refused(&s.read("f").unwrap_err(), "f", FIFO);
        assert_refused(&s.read_at("f", 0, &mut [0u8; 1]).unwrap_err(), "f", FIFO);
        assert_refused(&s.list_recursive().unwrap_err(), "f", FIFO);
        drop(dir);
    });
}
