use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::{check_name, ObjectWriter, Storage};
use crate::{Error, Result};

/// A checkpoint in a local directory. Reads use positioned reads on cached handles; writes use
/// positioned writes; commits use write-temp, fsync, rename, fsync-directory.
#[derive(Debug)]
pub struct LocalStorage {
    root: PathBuf,
    handles: Mutex<HashMap<String, Arc<File>>>,
}

impl LocalStorage {
    /// A checkpoint rooted at directory `root` (created on first write).
    pub fn new(root: impl Into<PathBuf>) -> Self {
        LocalStorage { root: root.into(), handles: Mutex::new(HashMap::new()) }
    }

    /// The directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn path(&self, name: &str) -> Result<PathBuf> {
        check_name(name)?;
        Ok(self.root.join(name))
    }

    fn handle(&self, name: &str) -> Result<Arc<File>> {
        let mut handles = self.handles.lock().unwrap();
        if let Some(f) = handles.get(name) {
            return Ok(f.clone());
        }
        let path = self.path(name)?;
        let f = Arc::new(File::open(&path).map_err(|e| Error::io(&path, e))?);
        handles.insert(name.to_string(), f.clone());
        Ok(f)
    }

    fn forget(&self, name: &str) {
        self.handles.lock().unwrap().remove(name);
    }

    /// Writes `bytes` to a fresh temporary file, fsyncs it, then `install`s it under `name`
    /// (rename or link) and fsyncs the directory.
    fn publish(
        &self,
        name: &str,
        bytes: &[u8],
        install: impl FnOnce(&Path, &Path) -> std::io::Result<()>,
    ) -> Result<()> {
        super::check_plain_name(name)?;
        let path = self.path(name)?;
        fs::create_dir_all(&self.root).map_err(|e| Error::io(&self.root, e))?;
        let nonce =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        let tmp = self.root.join(format!(".{name}.tmp-{}-{nonce}", std::process::id()));
        let write = || -> std::io::Result<()> {
            let f = OpenOptions::new().create_new(true).write(true).open(&tmp)?;
            f.write_all_at(bytes, 0)?;
            f.sync_all()?;
            install(&tmp, &path)
        };
        if let Err(e) = write() {
            let _ = fs::remove_file(&tmp);
            if e.kind() == std::io::ErrorKind::AlreadyExists {
                return Err(Error::AlreadyExists { path });
            }
            return Err(Error::io(&path, e));
        }
        self.forget(name);
        self.sync_dir()
    }

    /// Makes the directory's entries durable, and its own entry in its parent: a checkpoint
    /// directory created by this save must survive a power loss along with its index.
    fn sync_dir(&self) -> Result<()> {
        File::open(&self.root).and_then(|d| d.sync_all()).map_err(|e| Error::io(&self.root, e))?;
        if let Some(parent) = self.root.parent().filter(|p| !p.as_os_str().is_empty()) {
            match File::open(parent).and_then(|d| d.sync_all()) {
                // A parent we may not open was not created by us; its entry is not ours to sync.
                Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {}
                r => r.map_err(|e| Error::io(parent, e))?,
            }
        }
        Ok(())
    }
}

impl Storage for LocalStorage {
    fn location(&self) -> String {
        self.root.display().to_string()
    }

    fn size(&self, name: &str) -> Result<u64> {
        let path = self.path(name)?;
        Ok(fs::metadata(&path).map_err(|e| Error::io(&path, e))?.len())
    }

    fn read_at(&self, name: &str, offset: u64, buf: &mut [u8]) -> Result<()> {
        let f = self.handle(name)?;
        if offset.checked_add(buf.len() as u64).is_none_or(|end| end > i64::MAX as u64) {
            return Err(Error::corrupt(
                self.root.join(name),
                format!("truncated: {} bytes at offset {offset} are past any possible end", buf.len()),
            ));
        }
        f.read_exact_at(buf, offset).map_err(|e| {
            let path = self.root.join(name);
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                Error::corrupt(path, format!("truncated: {} bytes at offset {offset} are not all there", buf.len()))
            } else {
                Error::io(path, e)
            }
        })
    }

    fn create(&self, name: &str, size: u64) -> Result<Box<dyn ObjectWriter>> {
        super::check_plain_name(name)?;
        let path = self.path(name)?;
        fs::create_dir_all(&self.root).map_err(|e| Error::io(&self.root, e))?;
        self.forget(name);
        let file =
            OpenOptions::new().create(true).write(true).truncate(true).open(&path).map_err(|e| Error::io(&path, e))?;
        file.set_len(size).map_err(|e| Error::io(&path, e))?;
        Ok(Box::new(LocalWriter { file, path }))
    }

    fn put_atomic(&self, name: &str, bytes: &[u8]) -> Result<()> {
        self.publish(name, bytes, |tmp, path| fs::rename(tmp, path))
    }

    fn put_if_absent(&self, name: &str, bytes: &[u8]) -> Result<()> {
        // link(2) fails with EEXIST instead of replacing: an atomic create-if-absent.
        self.publish(name, bytes, |tmp, path| {
            let linked = fs::hard_link(tmp, path);
            let _ = fs::remove_file(tmp);
            linked
        })
    }

    fn has_atomic_create(&self) -> bool {
        true
    }

    fn list_recursive(&self) -> Result<Vec<String>> {
        let mut out = Vec::new();
        let mut dirs = vec![(self.root.clone(), String::new())];
        while let Some((dir, rel)) = dirs.pop() {
            let rd = match fs::read_dir(&dir) {
                Ok(rd) => rd,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(Error::io(&dir, e)),
            };
            for entry in rd {
                let entry = entry.map_err(|e| Error::io(&dir, e))?;
                let Some(n) = entry.file_name().to_str().map(str::to_string) else { continue };
                let name = if rel.is_empty() { n } else { format!("{rel}/{n}") };
                // Symlinked folders are not followed: a cycle cannot make the walk endless.
                match entry.file_type() {
                    Ok(t) if t.is_dir() => dirs.push((entry.path(), name)),
                    Ok(t) if t.is_file() => out.push(name),
                    Ok(t) if t.is_symlink() && entry.path().is_file() => out.push(name),
                    _ => {}
                }
            }
        }
        Ok(out)
    }

    fn list(&self) -> Result<Vec<String>> {
        let rd = match fs::read_dir(&self.root) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(Error::io(&self.root, e)),
        };
        let mut out = Vec::new();
        for entry in rd {
            let entry = entry.map_err(|e| Error::io(&self.root, e))?;
            if entry.file_type().map(|t| t.is_file()).unwrap_or(false) {
                if let Some(n) = entry.file_name().to_str() {
                    out.push(n.to_string());
                }
            }
        }
        Ok(out)
    }

    fn delete(&self, name: &str) -> Result<()> {
        super::check_plain_name(name)?;
        let path = self.path(name)?;
        self.forget(name);
        match fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io(&path, e)),
        }
    }
}

struct LocalWriter {
    file: File,
    path: PathBuf,
}

impl ObjectWriter for LocalWriter {
    fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.file.write_all_at(data, offset).map_err(|e| Error::io(&self.path, e))
    }

    fn finish(self: Box<Self>) -> Result<()> {
        self.file.sync_all().map_err(|e| Error::io(&self.path, e))
    }
}
