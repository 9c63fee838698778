//! The storage conformance suite: the semantics written on [`Storage`] and [`ObjectWriter`],
//! checked as plain functions over `&dyn Storage`. Compiled only with the cargo feature
//! `conformance`; public as `tessera::storage::conformance`.
//!
//! Every backend's tests hand [`run`] a fresh, empty storage:
//!
//! ```ignore
//! #[test]
//! fn my_storage_conforms() {
//!     tessera::storage::conformance::run(&MyStorage::new(unique_location()));
//! }
//! ```
//!
//! with, in the backend's `Cargo.toml`, `tessera = { …, features = ["conformance"] }` under
//! `[dev-dependencies]`. Each check starts from and leaves behind an empty storage, so checks
//! are independent; they write plain names only (writes of nested names are refused by the
//! trait), and do not need the storage to hold a checkpoint.
//!
//! A read-only storage (a view that refuses writes) runs [`run_read_only`] instead, on objects
//! it holds.
//!
//! The suite panics (it is made for `#[test]`s) and prints one `conformance PASS <check>` or
//! `conformance FAIL <check>: <why>` line per check, so a run against a new store tells which
//! of its features work. It uses nothing but the standard library and this crate's storage
//! module.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::{ObjectWriter, Storage, StorageExt};
use crate::error::{Error, Result};

/// A check of one semantic, over a storage.
pub type Check = fn(&dyn Storage);

/// The checks [`run`] runs, in order, by name. Each needs an empty storage and leaves it empty.
pub const CHECKS: &[(&str, Check)] = &[
    ("location is named", location_is_named),
    ("missing objects are NotFound", missing_is_not_found),
    ("put_atomic then size, read, read_at", put_atomic_then_read),
    ("put_atomic replaces the whole object", put_atomic_replaces_whole),
    ("put_if_absent creates, and refuses an existing object", put_if_absent_refuses_existing),
    ("empty objects", empty_objects),
    ("create + write_at from several threads + finish", create_parallel_writes),
    ("create replaces an existing object", create_replaces_existing),
    ("a large object written in pieces", large_object),
    ("short reads are Corrupt", short_read_is_corrupt),
    ("reads past any possible end are Corrupt", overflowing_offset_is_corrupt),
    ("list and delete", list_and_delete),
    ("list_recursive lists what list does", list_recursive_covers_list),
    ("delete is idempotent", delete_is_idempotent),
    ("names outside the checkpoint are InvalidArgument", names_outside_are_rejected),
    ("plain names with dots, spaces, unicode are accepted", plain_names_are_accepted),
    ("concurrent reads", concurrent_reads),
];

/// Runs every check of [`CHECKS`] against `storage`, which must be empty (and stays so).
/// Panics naming the failing checks. Every check runs even after a failure (what a failed check
/// left behind is deleted before the next), and one line per check is printed.
pub fn run(storage: &dyn Storage) {
    run_checks(storage, CHECKS);
}

/// Runs `checks` (a selection of [`CHECKS`], or a backend's own) as [`run`] does.
pub fn run_checks(storage: &dyn Storage, checks: &[(&str, Check)]) {
    assert_eq!(names(storage), Vec::<String>::new(), "the suite needs an empty storage");
    let mut failed = Vec::new();
    for (name, check) in checks {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(storage))) {
            Ok(()) => println!("conformance PASS {name}"),
            Err(p) => {
                let msg = panic_message(p.as_ref());
                println!("conformance FAIL {name}: {msg}");
                failed.push(format!("{name:?}: {msg}"));
                for n in storage.list().unwrap_or_default() {
                    let _ = storage.delete(&n);
                }
            }
        }
        assert_eq!(names(storage), Vec::<String>::new(), "check {name:?} left objects behind");
    }
    assert!(failed.is_empty(), "storage {}: conformance checks failed:\n{}", storage.location(), failed.join("\n"));
}

/// The read semantics, on a storage that holds `objects` (`(name, bytes)`, at least one, with
/// names of any depth) and refuses (or ignores) nothing that is read: sizes and whole reads,
/// ranged reads, short and overflowing reads `Corrupt`, missing objects `NotFound`, names
/// outside the checkpoint `InvalidArgument`, concurrent reads. For views that cannot be
/// written through (a file opened as a checkpoint, a foreign format's view): writes are not
/// checked, and the storage is left as it is. Panics naming what failed.
pub fn run_read_only(storage: &dyn Storage, objects: &[(&str, &[u8])]) {
    assert!(!objects.is_empty(), "run_read_only needs an object to read");
    assert!(!storage.location().is_empty(), "location is empty");
    let listed = storage.list_recursive().unwrap();
    for (name, data) in objects {
        assert!(listed.iter().any(|l| l == name), "{name:?} is not listed (list_recursive: {listed:?})");
        check_reads(storage, name, data);
        for (off, len) in [(data.len() as u64 + 1, 1usize), (u64::MAX - 2, 8), (i64::MAX as u64, 8), (1 << 63, 8)] {
            let r = storage.read_at(name, off, &mut vec![0u8; len]);
            assert!(matches!(r, Err(Error::Corrupt { .. })), "{name}: read_at({off}, {len}): {r:?}");
        }
    }
    let absent = "conformance-absent-object";
    assert_not_found(storage.size(absent), "size of an absent object");
    assert_not_found(storage.read(absent), "read of an absent object");
    assert_not_found(storage.read_at(absent, 0, &mut [0u8; 4]), "read_at of an absent object");
    for name in OUTSIDE {
        assert_invalid(storage.size(name), &format!("size({name:?})"));
        assert_invalid(storage.read(name), &format!("read({name:?})"));
        assert_invalid(storage.read_at(name, 0, &mut [0u8; 1]), &format!("read_at({name:?})"));
    }
    let (name, data) = objects[0];
    std::thread::scope(|s| {
        for t in 0..4u64 {
            s.spawn(move || random_reads(storage, name, data, 50 + t, 50));
        }
    });
}

/// Names no method may reach: `InvalidArgument` everywhere.
const OUTSIDE: &[&str] = &["../x", "..", ".", "", "/abs", "a\\b", "x\0y", "dir/", "a//b", "a/../b", "../../etc/passwd"];

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default()
}

/// splitmix64: deterministic data and positions, no dependency.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x2545_f491_4f6c_dd1d) ^ 0x9e37_79b9_7f4a_7c15)
    }
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next_u64() % n
        }
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(n + 8);
        while out.len() < n {
            out.extend_from_slice(&self.next_u64().to_le_bytes());
        }
        out.truncate(n);
        out
    }
    fn shuffle<T>(&mut self, xs: &mut [T]) {
        for i in (1..xs.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            xs.swap(i, j);
        }
    }
}

fn names(storage: &dyn Storage) -> Vec<String> {
    storage.list_sorted().unwrap_or_else(|e| panic!("list: {e}"))
}

fn put(storage: &dyn Storage, name: &str, bytes: &[u8]) {
    storage.put_atomic(name, bytes).unwrap_or_else(|e| panic!("put_atomic {name}: {e}"));
}

fn clean(storage: &dyn Storage) {
    for n in storage.list().unwrap() {
        storage.delete(&n).unwrap();
    }
}

#[track_caller]
fn assert_not_found<T: std::fmt::Debug>(r: Result<T>, what: &str) {
    assert!(matches!(r, Err(Error::NotFound { .. })), "{what}: expected NotFound, got {r:?}");
}

#[track_caller]
fn assert_invalid<T: std::fmt::Debug>(r: Result<T>, what: &str) {
    assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{what}: expected InvalidArgument, got {r:?}");
}

/// `size`, `read`, and ranged reads at the edges of `name`, which holds `data`.
fn check_reads(storage: &dyn Storage, name: &str, data: &[u8]) {
    let n = data.len();
    assert_eq!(storage.size(name).unwrap_or_else(|e| panic!("size {name}: {e}")), n as u64, "size of {name}");
    assert!(storage.read(name).unwrap_or_else(|e| panic!("read {name}: {e}")) == data, "read of {name} differs");
    let ranges = [(0, n.min(1)), (0, n), (n / 2, (n - n / 2).min(100)), (n.saturating_sub(1), n.min(1)), (n, 0)];
    for (off, len) in ranges.into_iter().chain((n > 3).then_some((3, n - 3))) {
        let mut buf = vec![0u8; len];
        storage.read_at(name, off as u64, &mut buf).unwrap_or_else(|e| panic!("{name}: read_at({off}, {len}): {e}"));
        assert_eq!(buf, data[off..off + len], "{name}: read_at({off}, {len})");
    }
    let mut buf = vec![0u8; n + 1];
    let r = storage.read_at(name, 0, &mut buf);
    assert!(matches!(r, Err(Error::Corrupt { .. })), "{name}: read_at(0, {}) of {n} bytes: {r:?}", n + 1);
}

/// `rounds` reads of random ranges of `name` (holding `data`), each checked.
fn random_reads(storage: &dyn Storage, name: &str, data: &[u8], seed: u64, rounds: usize) {
    let mut rng = Rng::new(seed);
    for _ in 0..rounds {
        let off = rng.below(data.len() as u64) as usize;
        let len = rng.below((data.len() - off) as u64 + 1).min(4096) as usize;
        let mut buf = vec![0u8; len];
        storage.read_at(name, off as u64, &mut buf).unwrap_or_else(|e| panic!("read_at({off}, {len}): {e}"));
        assert!(buf == data[off..off + len], "read_at({off}, {len}) differs");
    }
}

fn location_is_named(storage: &dyn Storage) {
    assert!(!storage.location().is_empty());
}

fn missing_is_not_found(storage: &dyn Storage) {
    assert_not_found(storage.size("absent"), "size");
    assert_not_found(storage.read("absent"), "read");
    let mut buf = [0u8; 4];
    assert_not_found(storage.read_at("absent", 0, &mut buf), "read_at");
    assert_not_found(storage.read_at("absent", 0, &mut []), "empty read_at");
    assert_not_found(storage.size("absent/nested"), "size of a nested name");
    // A deleted object is missing again.
    put(storage, "gone", b"x");
    storage.delete("gone").unwrap();
    assert_not_found(storage.size("gone"), "size after delete");
    assert_not_found(storage.read("gone"), "read after delete");
    assert_not_found(storage.read_at("gone", 0, &mut buf[..1]), "read_at after delete");
}

fn put_atomic_then_read(storage: &dyn Storage) {
    let data = Rng::new(1).bytes(1000);
    put(storage, "a", &data);
    check_reads(storage, "a", &data);
    for (off, len) in [(0usize, 1usize), (0, 1000), (500, 100), (999, 1), (1000, 0), (3, 997)] {
        let mut buf = vec![0u8; len];
        storage.read_at("a", off as u64, &mut buf).unwrap_or_else(|e| panic!("read_at({off}, {len}): {e}"));
        assert_eq!(buf, data[off..off + len], "read_at({off}, {len})");
    }
    assert_eq!(names(storage), vec!["a".to_string()]);
    clean(storage);
}

fn put_atomic_replaces_whole(storage: &dyn Storage) {
    put(storage, "a", &[1u8; 500]);
    put(storage, "a", b"short");
    assert_eq!(storage.size("a").unwrap(), 5);
    assert_eq!(storage.read("a").unwrap(), b"short");
    put(storage, "a", &[7u8; 64]);
    assert_eq!(storage.read("a").unwrap(), vec![7u8; 64]);
    let mut buf = [0u8; 64];
    storage.read_at("a", 0, &mut buf).unwrap();
    assert_eq!(buf, [7u8; 64], "read_at after a replacement reads the new object");
    assert_eq!(names(storage), vec!["a".to_string()], "no temporary objects remain visible");
    clean(storage);
}

fn put_if_absent_refuses_existing(storage: &dyn Storage) {
    storage.put_if_absent("once", b"first").unwrap();
    assert_eq!(storage.read("once").unwrap(), b"first");
    let again = storage.put_if_absent("once", b"second");
    assert!(matches!(again, Err(Error::AlreadyExists { .. })), "second put_if_absent: {again:?}");
    assert_eq!(storage.read("once").unwrap(), b"first", "the existing object was replaced");
    // An object written otherwise is there too.
    put(storage, "put", b"x");
    let over = storage.put_if_absent("put", b"y");
    assert!(matches!(over, Err(Error::AlreadyExists { .. })), "put_if_absent over put_atomic: {over:?}");
    assert_eq!(storage.read("put").unwrap(), b"x");
    assert_eq!(names(storage), ["once", "put"], "no temporary objects remain visible");
    clean(storage);
}

fn empty_objects(storage: &dyn Storage) {
    put(storage, "e", b"");
    assert_eq!(storage.size("e").unwrap(), 0);
    assert_eq!(storage.read("e").unwrap(), Vec::<u8>::new());
    storage.read_at("e", 0, &mut []).unwrap();
    let w = storage.create("c", 0).unwrap();
    w.finish().unwrap();
    assert_eq!(storage.size("c").unwrap(), 0);
    assert_eq!(names(storage), vec!["c".to_string(), "e".to_string()]);
    clean(storage);
}

fn create_parallel_writes(storage: &dyn Storage) {
    let data = Rng::new(2).bytes(100_003);
    let writer = storage.create("par", data.len() as u64).unwrap();
    // Disjoint pieces of uneven sizes, written by 6 threads in a scrambled order.
    let mut cuts: Vec<usize> = (1..40).map(|i| i * 2503 + (i * i) % 97).collect();
    cuts.push(0);
    cuts.push(data.len());
    cuts.sort_unstable();
    let mut pieces: Vec<(usize, usize)> = cuts.windows(2).map(|w| (w[0], w[1])).collect();
    Rng::new(3).shuffle(&mut pieces);
    let next = AtomicUsize::new(0);
    let writer_ref: &dyn ObjectWriter = writer.as_ref();
    std::thread::scope(|s| {
        for _ in 0..6 {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(&(a, b)) = pieces.get(i) else { return };
                writer_ref.write_at(a as u64, &data[a..b]).unwrap();
            });
        }
    });
    writer.finish().unwrap();
    assert_eq!(storage.size("par").unwrap(), data.len() as u64);
    assert!(storage.read("par").unwrap() == data, "the object differs from what was written");
    clean(storage);
}

fn create_replaces_existing(storage: &dyn Storage) {
    put(storage, "x", &[9u8; 100]);
    let w = storage.create("x", 10).unwrap();
    w.write_at(0, b"0123456789").unwrap();
    w.finish().unwrap();
    assert_eq!(storage.size("x").unwrap(), 10);
    assert_eq!(storage.read("x").unwrap(), b"0123456789");
    let mut buf = [0u8; 10];
    storage.read_at("x", 0, &mut buf).unwrap();
    assert_eq!(&buf, b"0123456789", "read_at after create reads the new object");
    // And put_atomic replaces a created object.
    put(storage, "x", b"atomic");
    assert_eq!(storage.read("x").unwrap(), b"atomic");
    clean(storage);
}

fn large_object(storage: &dyn Storage) {
    let data = Rng::new(4).bytes(3 << 20);
    let w = storage.create("large", data.len() as u64).unwrap();
    for (i, piece) in data.chunks(1 << 20).enumerate().rev() {
        w.write_at((i << 20) as u64, piece).unwrap();
    }
    w.finish().unwrap();
    assert_eq!(storage.size("large").unwrap(), 3 << 20);
    let mut buf = vec![0u8; 1 << 20];
    storage.read_at("large", (1 << 20) + 17, &mut buf).unwrap();
    assert!(buf == data[(1 << 20) + 17..(2 << 20) + 17], "a ranged read differs");
    assert!(storage.read("large").unwrap() == data, "the whole read differs");
    clean(storage);
}

fn short_read_is_corrupt(storage: &dyn Storage) {
    put(storage, "s", b"0123456789");
    for (off, len) in [(5u64, 10usize), (0, 11), (10, 1), (11, 1), (1 << 40, 4)] {
        let mut buf = vec![0u8; len];
        let r = storage.read_at("s", off, &mut buf);
        assert!(matches!(r, Err(Error::Corrupt { .. })), "read_at({off}, {len}) of 10 bytes: {r:?}");
    }
    clean(storage);
}

fn overflowing_offset_is_corrupt(storage: &dyn Storage) {
    put(storage, "s", b"0123456789");
    for off in [u64::MAX - 2, u64::MAX, i64::MAX as u64, 1 << 63] {
        let mut buf = vec![0u8; 8];
        let r = storage.read_at("s", off, &mut buf);
        assert!(matches!(r, Err(Error::Corrupt { .. })), "read_at({off}, 8) of 10 bytes: {r:?}");
    }
    clean(storage);
}

fn list_and_delete(storage: &dyn Storage) {
    for n in ["c", "a", "b"] {
        put(storage, n, n.as_bytes());
    }
    let w = storage.create("d", 1).unwrap();
    w.write_at(0, b"d").unwrap();
    w.finish().unwrap();
    assert_eq!(names(storage), ["a", "b", "c", "d"]);
    storage.delete("b").unwrap();
    assert_eq!(names(storage), ["a", "c", "d"]);
    assert_not_found(storage.size("b"), "size of a deleted object");
    assert_eq!(storage.read("c").unwrap(), b"c", "delete touches nothing else");
    clean(storage);
    assert!(names(storage).is_empty());
}

fn list_recursive_covers_list(storage: &dyn Storage) {
    assert_eq!(storage.list_recursive().unwrap(), Vec::<String>::new(), "an empty storage lists empty");
    for n in ["r1", "r2", "r3"] {
        put(storage, n, n.as_bytes());
    }
    let mut all = storage.list_recursive().unwrap();
    all.sort();
    assert_eq!(all, names(storage), "with plain names only, list_recursive is list");
    clean(storage);
}

fn delete_is_idempotent(storage: &dyn Storage) {
    storage.delete("never-existed").unwrap();
    put(storage, "d", b"x");
    storage.delete("d").unwrap();
    storage.delete("d").unwrap();
    assert!(names(storage).is_empty());
}

fn names_outside_are_rejected(storage: &dyn Storage) {
    for name in OUTSIDE {
        let what = |op: &str| format!("{op}({name:?})");
        assert_invalid(storage.size(name), &what("size"));
        assert_invalid(storage.read(name), &what("read"));
        assert_invalid(storage.read_at(name, 0, &mut [0u8; 1]), &what("read_at"));
        assert_invalid(storage.create(name, 1).map(|_| ()), &what("create"));
        assert_invalid(storage.put_atomic(name, b"x"), &what("put_atomic"));
        assert_invalid(storage.put_if_absent(name, b"x"), &what("put_if_absent"));
        assert_invalid(storage.delete(name), &what("delete"));
    }
    // Nested names are readable (foreign formats keep folders) but never written.
    assert!(matches!(storage.size("a/b"), Err(Error::NotFound { .. })), "size(\"a/b\") of nothing is NotFound");
    assert_invalid(storage.create("a/b", 1).map(|_| ()), "create(\"a/b\")");
    assert_invalid(storage.put_atomic("a/b", b"x"), "put_atomic(\"a/b\")");
    assert_invalid(storage.put_if_absent("a/b", b"x"), "put_if_absent(\"a/b\")");
    assert_invalid(storage.delete("a/b"), "delete(\"a/b\")");
    assert!(names(storage).is_empty(), "nothing was written");
    assert!(storage.list_recursive().unwrap().is_empty(), "nothing was written, at any depth");
}

fn plain_names_are_accepted(storage: &dyn Storage) {
    let ok = ["a..b", ".hidden", "with space", "ünïcode.bin", "x.safetensors", "0123abcd-r00001.safetensors"];
    for n in ok {
        put(storage, n, n.as_bytes());
        assert_eq!(storage.read(n).unwrap(), n.as_bytes());
    }
    let mut want: Vec<String> = ok.iter().map(|s| s.to_string()).collect();
    want.sort();
    assert_eq!(names(storage), want);
    clean(storage);
}

fn concurrent_reads(storage: &dyn Storage) {
    let data = Rng::new(5).bytes(1 << 16);
    put(storage, "r", &data);
    std::thread::scope(|s| {
        for t in 0..8u64 {
            let data = &data;
            s.spawn(move || random_reads(storage, "r", data, 100 + t, 200));
        }
    });
    clean(storage);
}
