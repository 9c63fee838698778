//! A rank's copy as one data shard of its erasure-coding group: the copy's files (in the
//! manifest's order) read back to back, zeros past their end; and the writer that puts a
//! shard rebuilt elsewhere back as a copy, checked against its checksum before it appears.

use std::fs::File;
use std::path::{Path, PathBuf};

use super::fs::NodeFs;

use crate::error::{Error, Result};
use crate::format::INDEX_FILE;
use crate::model::crc::crc32c_append;

/// The files of a rank's copy in shard order, with their sizes: the index (the copy's commit
/// marker) last, so a rebuilt copy is written in the order a save writes it.
/// Whether a file of a copy's directory is part of the copy: hidden names never are (a lease
/// whose deletion failed, the temporary of an interrupted write; the manifest refuses them).
pub(crate) fn is_copy_file(name: &str) -> bool {
    !name.starts_with('.')
}

pub(crate) fn copy_files(fs: &NodeFs, dir: &Path) -> Result<Vec<(String, u64)>> {
    let mut files = Vec::new();
    for e in fs.read_dir(dir)? {
        if !is_copy_file(&e.name) {
            continue;
        }
        if e.is_dir {
            return Err(Error::corrupt(&e.path, "not a regular file in a memory-tier copy"));
        }
        files.push((e.name, e.len));
    }
    files.sort_by(|a, b| (a.0 == INDEX_FILE, &a.0).cmp(&(b.0 == INDEX_FILE, &b.0)));
    Ok(files)
}

/// A copy's files as ranks exchange them: `[[name, length], …]`.
pub(crate) fn files_to_json(files: &[(String, u64)]) -> serde_json::Value {
    serde_json::Value::Array(files.iter().map(|(n, l)| serde_json::json!([n, l])).collect())
}

/// The files of [`files_to_json`]; `None` if `v` is not such a list.
pub(crate) fn files_from_json(v: &serde_json::Value) -> Option<Vec<(String, u64)>> {
    v.as_array()?.iter().map(|f| Some((f[0].as_str()?.to_owned(), f[1].as_u64()?))).collect()
}

/// Reads ranges of a shard stored as files back to back.
pub(crate) struct ShardReader {
    fs: NodeFs,
    files: Vec<(PathBuf, u64, File)>,
}

impl ShardReader {
    /// The shard of the copy in `dir` made of `files` (names and sizes, in order); a file of
    /// another size is refused, naming it.
    pub fn open(fs: &NodeFs, dir: &Path, files: &[(String, u64)]) -> Result<ShardReader> {
        let mut out = Vec::with_capacity(files.len());
        for (name, len) in files {
            let path = dir.join(name);
            let (f, size) = fs.open(&path)?;
            if size != *len {
                return Err(Error::corrupt(&path, format!("{size} bytes, the memory tier's manifest says {len}")));
            }
            out.push((path, *len, f));
        }
        Ok(ShardReader { fs: fs.clone(), files: out })
    }

    /// A single-file shard (a parity shard) of `len` bytes.
    pub fn single(fs: &NodeFs, path: &Path, len: u64) -> Result<ShardReader> {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_owned();
        ShardReader::open(fs, path.parent().unwrap_or(Path::new(".")), &[(name, len)])
    }

    /// Fills `buf` with the shard's bytes from `offset`, zeros past its end.
    pub fn read(&self, mut offset: u64, buf: &mut [u8]) -> Result<()> {
        let mut done = 0usize;
        for (path, len, f) in &self.files {
            if done == buf.len() {
                break;
            }
            if offset >= *len {
                offset -= len;
                continue;
            }
            let n = ((len - offset) as usize).min(buf.len() - done);
            self.fs.read_at(f, path, &mut buf[done..done + n], offset)?;
            done += n;
            offset = 0;
        }
        buf[done..].fill(0);
        Ok(())
    }
}

/// Writes a shard back as the files of a copy, into a hidden directory beside `dir` that
/// becomes `dir` only once every byte is in and the shard's checksum matches.
pub(crate) struct ShardWriter {
    fs: NodeFs,
    dir: PathBuf,
    tmp: PathBuf,
    files: Vec<(String, u64, File)>,
    written: u64,
    crc: u32,
}

impl ShardWriter {
    /// A writer for the copy in `dir` made of `files`.
    pub fn create(fs: &NodeFs, dir: &Path, files: &[(String, u64)]) -> Result<ShardWriter> {
        let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or("copy");
        let tmp = dir.with_file_name(format!(".{name}.rebuild"));
        fs.remove_dir_all(&tmp)?;
        fs.create_dir_all(&tmp)?;
        let mut out = Vec::with_capacity(files.len());
        for (n, len) in files {
            out.push((n.clone(), *len, fs.create(&tmp.join(n), *len)?));
        }
        Ok(ShardWriter { fs: fs.clone(), dir: dir.to_owned(), tmp, files: out, written: 0, crc: 0 })
    }

    /// Appends the shard's next bytes (past the files' end, only zero padding may follow:
    /// it is dropped).
    pub fn append(&mut self, mut data: &[u8]) -> Result<()> {
        let mut at = self.written;
        for (n, len, f) in &self.files {
            if data.is_empty() {
                break;
            }
            if at >= *len {
                at -= len;
                continue;
            }
            let k = ((len - at) as usize).min(data.len());
            self.fs.write_at(f, &self.tmp.join(n), &data[..k], at)?;
            self.crc = crc32c_append(self.crc, &data[..k]);
            self.written += k as u64;
            data = &data[k..];
            at = 0;
        }
        Ok(())
    }

    /// Checks the shard against `crc` and puts the copy in place.
    pub fn finish(self, crc: u32) -> Result<()> {
        let total: u64 = self.files.iter().map(|f| f.1).sum();
        if self.written != total || self.crc != crc {
            let _ = self.fs.remove_dir_all(&self.tmp);
            return Err(Error::corrupt(
                &self.dir,
                format!(
                    "rebuilt copy: {} of {total} bytes, checksum {:08x}, the manifest says {crc:08x}",
                    self.written, self.crc
                ),
            ));
        }
        for (n, _, f) in &self.files {
            self.fs.sync(f, &self.tmp.join(n))?;
        }
        self.fs.remove_dir_all(&self.dir)?;
        self.fs.rename(&self.tmp, &self.dir)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::crc::crc32c;
    use std::fs;

    #[test]
    fn a_copy_reads_back_to_back_and_rebuilds_only_when_it_checks() {
        let root = std::env::temp_dir().join(format!("tessera-shard-{}", std::process::id()));
        let dir = root.join("rank-1");
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join(INDEX_FILE), b"IDX").unwrap();
        fs::write(dir.join("a"), b"hello").unwrap();
        let nfs = NodeFs::default();
        let files = copy_files(&nfs, &dir).unwrap();
        assert_eq!(files, vec![("a".to_string(), 5), (INDEX_FILE.to_string(), 3)]);
        let r = ShardReader::open(&nfs, &dir, &files).unwrap();
        let mut buf = [7u8; 10];
        r.read(3, &mut buf).unwrap();
        assert_eq!(&buf, b"loIDX\0\0\0\0\0");

        let copy = root.join("rank-2");
        let mut w = ShardWriter::create(&nfs, &copy, &files).unwrap();
        w.append(b"hel").unwrap();
        w.append(b"loIDX\0\0").unwrap();
        w.finish(crc32c(b"helloIDX")).unwrap();
        assert_eq!(fs::read(copy.join("a")).unwrap(), b"hello");

        let mut w = ShardWriter::create(&nfs, &root.join("rank-3"), &files).unwrap();
        w.append(b"helloIDY").unwrap();
        let e = w.finish(crc32c(b"helloIDX")).unwrap_err().to_string();
        assert!(e.contains("rank-3") && e.contains("checksum"), "{e}");
        assert!(!root.join("rank-3").exists() && !root.join(".rank-3.rebuild").exists());
        fs::remove_dir_all(&root).unwrap();
    }
}
