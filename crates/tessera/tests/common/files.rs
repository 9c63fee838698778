//! File helpers shared by the library's and the CLI's tests (the CLI's include this file by path).

use std::path::Path;

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
