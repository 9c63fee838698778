//! Safe handling of the local files the whole-checkpoint tools write outside a checkpoint (the
//! safetensors of an export and their index json): where they may go, and their temporary names.
//!
//! Rules:
//! - An output is never inside the source checkpoint (both resolved, symlinks included).
//! - An output name is either new or an existing regular file (replaced atomically by a rename);
//!   a directory, symlink, FIFO, socket or device node there is refused and left as it is.
//! - Temporary files get an unpredictable name and are created with `create_new` (`O_EXCL`:
//!   never opens, truncates or follows whatever is already at that name).

use std::fs::{File, OpenOptions};
use std::hash::{BuildHasher, Hasher};
use std::path::{Component, Path, PathBuf};

use crate::error::{Error, Result};

/// A temporary name for `dest` in `dir`: `.NAME.tmp-PID-NONCE`, the nonce 64 random bits (so a
/// name cannot be guessed and planted in advance).
pub(crate) fn tmp_name(dir: &Path, name: &str) -> PathBuf {
    // RandomState draws its keys from the OS; a counter makes each call's hash distinct.
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    dir.join(format!(".{name}.tmp-{}-{:016x}", std::process::id(), h.finish()))
}

/// Creates `path`, which must not exist in any form (`O_CREAT | O_EXCL`: a symlink planted there
/// is not followed, an existing file not truncated).
pub(crate) fn create_new(path: &Path) -> Result<File> {
    OpenOptions::new().write(true).create_new(true).open(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::AlreadyExists {
            Error::invalid(format!(
                "{}: something is already at this temporary name; refusing to touch it",
                path.display()
            ))
        } else {
            Error::io(path, e)
        }
    })
}

/// Refuses an output name that exists as anything but a regular file (checked without following
/// a symlink): renaming over it would replace a device node, a FIFO or a symlink, and a
/// directory is no file.
pub(crate) fn check_replaceable(path: &Path) -> Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_file() => Ok(()),
        Ok(m) => Err(Error::invalid(format!(
            "{} exists and is {}, not a regular file: refusing to replace it (give a new name or a regular file)",
            path.display(),
            kind(&m.file_type())
        ))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io(path, e)),
    }
}

fn kind(t: &std::fs::FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "a FIFO";
        }
        if t.is_char_device() || t.is_block_device() {
            return "a device node";
        }
        if t.is_socket() {
            return "a socket";
        }
    }
    if t.is_symlink() {
        "a symlink"
    } else if t.is_dir() {
        "a directory"
    } else {
        "a special file"
    }
}

/// `path` made absolute with every symlink of its existing part resolved; the components that
/// do not exist yet are appended as they are (`..` among them refused: it could point anywhere
/// once they exist).
pub(crate) fn resolve(path: &Path) -> Result<PathBuf> {
    let abs = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir().map_err(|e| Error::io(".", e))?.join(path)
    };
    let mut existing = abs.as_path();
    let mut rest: Vec<&std::ffi::OsStr> = Vec::new();
    loop {
        match std::fs::canonicalize(existing) {
            Ok(mut p) => {
                for c in rest.iter().rev() {
                    p.push(c);
                }
                return Ok(p);
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let name = match existing.components().next_back() {
                    Some(Component::Normal(n)) => n,
                    Some(Component::CurDir) => std::ffi::OsStr::new(""),
                    _ => {
                        return Err(Error::invalid(format!(
                            "{}: cannot resolve a path with `..` into directories that do not exist",
                            path.display()
                        )))
                    }
                };
                if !name.is_empty() {
                    rest.push(name);
                }
                existing = existing.parent().ok_or_else(|| Error::not_found(path))?;
            }
            Err(e) => return Err(Error::io(existing, e)),
        }
    }
}

/// The local directory of a storage location (its [`crate::storage::Storage::location`]): a plain path
/// or `file://` URL; `None` for other URLs (object stores, `mem://`), which hold no local file.
pub(crate) fn local_root(location: &str) -> Option<PathBuf> {
    if let Some(p) = location.strip_prefix("file://") {
        return Some(p.into());
    }
    match location.split_once("://") {
        Some((scheme, _))
            if !scheme.is_empty() && scheme.chars().all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c)) =>
        {
            None
        }
        _ => Some(location.into()),
    }
}

/// Refuses `out` (a file or directory the tool writes) when it is the checkpoint directory at
/// `src_location` or inside it: writing there could replace the checkpoint's own files.
pub(crate) fn check_outside(out: &Path, src_location: &str) -> Result<()> {
    let Some(root) = local_root(src_location) else { return Ok(()) };
    let root = match std::fs::canonicalize(&root) {
        Ok(r) => r,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::io(root, e)),
    };
    if resolve(out)?.starts_with(&root) {
        return Err(Error::invalid(format!(
            "{} is inside the source checkpoint {}: writing there could destroy it; choose an output outside it",
            out.display(),
            root.display()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("tessera-outfile-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn tmp_names_are_unpredictable_and_distinct() {
        let d = Path::new("/x");
        let (a, b) = (tmp_name(d, "m.safetensors"), tmp_name(d, "m.safetensors"));
        assert_ne!(a, b);
        let s = a.file_name().unwrap().to_str().unwrap();
        assert!(s.starts_with(&format!(".m.safetensors.tmp-{}-", std::process::id())), "{s}");
    }

    #[cfg(unix)]
    #[test]
    fn create_new_does_not_follow_a_planted_symlink_nor_truncate() {
        let d = scratch("create-new");
        let victim = d.join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let link = d.join(".out.tmp");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        assert!(matches!(create_new(&link), Err(Error::InvalidArgument { .. })));
        assert!(matches!(create_new(&victim), Err(Error::InvalidArgument { .. })));
        // A dangling link is not followed either (it would create its target).
        let dangling = d.join(".dangling.tmp");
        std::os::unix::fs::symlink(d.join("created-through-link"), &dangling).unwrap();
        assert!(create_new(&dangling).is_err());
        assert!(!d.join("created-through-link").exists());
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        std::io::Write::write_all(&mut create_new(&d.join("fresh")).unwrap(), b"ok").unwrap();
        assert_eq!(std::fs::read(d.join("fresh")).unwrap(), b"ok");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[cfg(unix)]
    #[test]
    fn only_new_names_and_regular_files_are_replaceable() {
        let d = scratch("replaceable");
        std::fs::write(d.join("f"), b"x").unwrap();
        std::os::unix::fs::symlink(d.join("f"), d.join("l")).unwrap();
        check_replaceable(&d.join("new")).unwrap();
        check_replaceable(&d.join("f")).unwrap();
        for (name, what) in [("l", "a symlink"), (".", "a directory")] {
            let e = check_replaceable(&d.join(name)).unwrap_err().to_string();
            assert!(e.contains(what) && e.contains(&d.join(name).display().to_string()), "{e}");
        }
        let e = check_replaceable(Path::new("/dev/null")).unwrap_err().to_string();
        assert!(e.contains("/dev/null") && e.contains("a device node"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[cfg(unix)]
    #[test]
    fn outputs_inside_the_source_are_refused() {
        let d = scratch("inside");
        let src = d.join("ckpt");
        std::fs::create_dir_all(&src).unwrap();
        std::os::unix::fs::symlink(&src, d.join("alias")).unwrap();
        for out in
            [src.clone(), src.join("tessera.index"), src.join("new/deeper/x"), d.join("alias/x"), src.join("./x")]
        {
            let e = check_outside(&out, src.to_str().unwrap()).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument { .. }), "{out:?}: {e}");
        }
        let file_url = format!("file://{}", src.display());
        assert!(check_outside(&src.join("x"), &file_url).is_err());
        assert!(check_outside(&src.join("new/../x"), src.to_str().unwrap()).is_err());
        check_outside(&d.join("ckpt2/x"), src.to_str().unwrap()).unwrap();
        check_outside(&d.join("x"), src.to_str().unwrap()).unwrap();
        check_outside(&src.join("x"), "s3://bucket/ckpt").unwrap();
        check_outside(&src.join("x"), "mem://ckpt").unwrap();
        std::fs::remove_dir_all(&d).unwrap();
    }
}
