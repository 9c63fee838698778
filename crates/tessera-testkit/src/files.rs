//! File helpers shared by the library's and the CLI's tests.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Copies the directory `src` (a fixture) to `dst`, recursively, every copy writable (so tests
/// can damage it).
pub fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        let to = dst.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &to);
        } else {
            std::fs::copy(e.path(), &to).unwrap();
            let mut p = std::fs::metadata(&to).unwrap().permissions();
            #[allow(clippy::permissions_set_readonly_false)]
            p.set_readonly(false);
            std::fs::set_permissions(&to, p).unwrap();
        }
    }
}

/// Every entry under `dir` (not following symlinks): its bytes, or what it points to.
pub fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    fn walk(dir: &Path, base: &Path, out: &mut BTreeMap<PathBuf, Vec<u8>>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let e = e.unwrap();
            let (p, t) = (e.path(), e.file_type().unwrap());
            let rel = p.strip_prefix(base).unwrap().to_path_buf();
            if t.is_dir() {
                out.insert(rel, b"<dir>".to_vec());
                walk(&p, base, out);
            } else if t.is_symlink() {
                out.insert(rel, format!("<link {}>", std::fs::read_link(&p).unwrap().display()).into_bytes());
            } else if t.is_file() {
                out.insert(rel, std::fs::read(&p).unwrap());
            } else {
                out.insert(rel, b"<special>".to_vec());
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}
