//! The plain-safetensors write session (the export, `tools::export`): [`SafetensorsExport::plan`]
//! (names, headers, every check of the output paths) → [`SafetensorsExport::open_file`] /
//! [`ExportFile`] for each file (its header, then its tensors' bytes in order) →
//! [`SafetensorsExport::commit`] (every file renamed into place, the index of a sharded export
//! last). Files are written under new temporary names in their final directory
//! (`save::outfile`): until the commit nothing at the output names changes, and a failure before
//! it removes the temporaries. The file operations go through [`ExportFs`], so that tests can
//! fail any of them.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value as J};

use crate::error::{Error, Result};
use crate::save::outfile;

/// Name of the index of a sharded export (as Hugging Face `transformers` names it).
pub const SAFETENSORS_INDEX_FILE: &str = "model.safetensors.index.json";

/// The file operations of an export: the local filesystem ([`LocalFs`]), or a test's.
#[doc(hidden)]
pub trait ExportFs: Sync {
    /// Creates `path`, which must not exist in any form (`O_CREAT | O_EXCL`).
    fn create_new(&self, path: &Path) -> Result<Box<dyn ExportFileIo>>;
    /// Renames `from` to `to`, replacing a regular file there.
    fn rename(&self, from: &Path, to: &Path) -> Result<()>;
    /// Makes `to` (which must not exist) a second name of the file `from`.
    fn hard_link(&self, from: &Path, to: &Path) -> Result<()>;
    /// Removes `path` (absent is not an error).
    fn remove(&self, path: &Path) -> Result<()>;
}

/// A file being written by an export.
#[doc(hidden)]
pub trait ExportFileIo: Send {
    /// Appends `data`.
    fn write_all(&mut self, data: &[u8]) -> Result<()>;
    /// Flushes and syncs the file.
    fn finish(self: Box<Self>) -> Result<()>;
}

/// The local filesystem.
#[doc(hidden)]
#[derive(Debug, Default, Clone, Copy)]
pub struct LocalFs;

struct LocalFile {
    writer: std::io::BufWriter<std::fs::File>,
    path: PathBuf,
}

impl ExportFs for LocalFs {
    fn create_new(&self, path: &Path) -> Result<Box<dyn ExportFileIo>> {
        let f = outfile::create_new(path)?;
        Ok(Box::new(LocalFile { writer: std::io::BufWriter::with_capacity(1 << 20, f), path: path.into() }))
    }
    fn rename(&self, from: &Path, to: &Path) -> Result<()> {
        std::fs::rename(from, to).map_err(|e| Error::io(to, e))
    }
    fn hard_link(&self, from: &Path, to: &Path) -> Result<()> {
        std::fs::hard_link(from, to).map_err(|e| Error::io(to, e))
    }
    fn remove(&self, path: &Path) -> Result<()> {
        match std::fs::remove_file(path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io(path, e)),
        }
    }
}

impl ExportFileIo for LocalFile {
    fn write_all(&mut self, data: &[u8]) -> Result<()> {
        self.writer.write_all(data).map_err(|e| Error::io(&self.path, e))
    }
    fn finish(self: Box<Self>) -> Result<()> {
        let f = self.writer.into_inner().map_err(|e| Error::io(&self.path, e.into_error()))?;
        f.sync_all().map_err(|e| Error::io(&self.path, e))
    }
}

/// One output file: its temporary and final names, and its header.
struct Pending {
    tmp: PathBuf,
    dest: PathBuf,
    header: Vec<u8>,
    /// Whether `tmp` was created by this export (only then is it removed on failure).
    created: std::sync::atomic::AtomicBool,
}

/// An export being written.
pub(crate) struct SafetensorsExport<'f> {
    fs: &'f dyn ExportFs,
    dir: PathBuf,
    files: Vec<Pending>,
    /// A sharded export: the index's final name and text.
    index: Option<(PathBuf, Vec<u8>)>,
}

/// A file of an export being written, its header already in.
pub(crate) struct ExportFile {
    io: Box<dyn ExportFileIo>,
}

impl ExportFile {
    /// Appends `data` (the next tensor's bytes, in the header's order).
    pub fn write(&mut self, data: &[u8]) -> Result<()> {
        self.io.write_all(data)
    }
}

/// The file an unsharded export writes into a directory: Hugging Face's name for one file.
const SINGLE_FILE_NAME: &str = "model.safetensors";

/// Where an unsharded export named `out` writes its one file: `out` itself, or
/// `out/model.safetensors` when `out` names a directory (one that exists, or a path ending with
/// a separator, `hf/`, which a file of the bare name may not be: refused, naming it).
pub(crate) fn single_file_path(out: &Path) -> Result<std::borrow::Cow<'_, Path>> {
    let text = out.as_os_str().to_str().unwrap_or_default();
    let bare = text.trim_end_matches(['/', std::path::MAIN_SEPARATOR]);
    // By length: paths compare by components, which a trailing separator is not.
    let slash = !bare.is_empty() && bare.len() < text.len();
    if slash && Path::new(bare).exists() && !Path::new(bare).is_dir() {
        return Err(Error::invalid(format!(
            "{} names a directory (it ends with a separator) but {bare} is a file: give the file's name without \
             the separator to replace it",
            out.display()
        )));
    }
    Ok(if slash || out.is_dir() { out.join(SINGLE_FILE_NAME).into() } else { out.into() })
}

impl<'f> SafetensorsExport<'f> {
    /// Plans an export to `out`: one file (`names` is None; `out` is the file) or shards in the
    /// directory `out` (`names` gives each file's name). `headers[k]` is file `k`'s header;
    /// `weight_map` (tensor name, file index), for a sharded export, makes its index with the
    /// total size `total`. Refuses, naming the path, an output that exists as anything but a
    /// regular file (directory, symlink, FIFO, device node), and a single-file output that is a
    /// directory. Creates the output directory.
    pub fn plan(
        fs: &'f dyn ExportFs,
        out: &Path,
        names: Option<Vec<String>>,
        headers: Vec<Vec<u8>>,
        weight_map: &[(String, usize)],
        total: u64,
    ) -> Result<Self> {
        let sharded = names.is_some();
        let (dir, names) = match names {
            None => {
                let name = out
                    .file_name()
                    .and_then(|n| n.to_str())
                    .ok_or_else(|| Error::invalid(format!("{}: not a file name", out.display())))?;
                outfile::check_replaceable(out)?;
                let parent = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
                std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
                (parent.to_path_buf(), vec![name.to_string()])
            }
            Some(names) => {
                if out.exists() && !out.is_dir() {
                    return Err(Error::invalid(format!(
                        "{} exists and is not a directory: a sharded export writes its files into a directory",
                        out.display()
                    )));
                }
                std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
                (out.to_path_buf(), names)
            }
        };
        let files: Vec<Pending> = names
            .iter()
            .zip(headers)
            .map(|(n, header)| Pending {
                tmp: outfile::tmp_name(&dir, n),
                dest: dir.join(n),
                header,
                created: Default::default(),
            })
            .collect();
        for p in &files {
            outfile::check_replaceable(&p.dest)?;
        }
        let index = if sharded {
            let dest = dir.join(SAFETENSORS_INDEX_FILE);
            outfile::check_replaceable(&dest)?;
            let mut map = Map::new();
            for (tensor, file) in weight_map {
                map.insert(tensor.clone(), J::String(names[*file].clone()));
            }
            let json = json!({"metadata": {"total_size": total}, "weight_map": map});
            Some((dest, serde_json::to_vec_pretty(&json).expect("JSON of plain values")))
        } else {
            None
        };
        Ok(SafetensorsExport { fs, dir, files, index })
    }

    /// Final paths of the files, in order.
    pub fn paths(&self) -> Vec<PathBuf> {
        self.files.iter().map(|p| p.dest.clone()).collect()
    }

    /// Creates file `k` under its temporary name and writes its header.
    pub fn open_file(&self, k: usize) -> Result<ExportFile> {
        let p = &self.files[k];
        // A create that failed may still have created the file (the name is this export's own,
        // unpredictable): it is removed on failure, unless something else was at the name.
        let io = self.fs.create_new(&p.tmp);
        let exists = matches!(&io, Err(Error::InvalidArgument { .. }));
        p.created.store(!exists, std::sync::atomic::Ordering::Relaxed);
        let mut io = io?;
        io.write_all(&p.header)?;
        Ok(ExportFile { io })
    }

    /// Ends file `k` once every byte is in: flushed and synced.
    pub fn finish_file(&self, file: ExportFile) -> Result<()> {
        file.io.finish()
    }

    /// Ends the export: `written` is the outcome of writing every file. On success every file
    /// is renamed into place, then (sharded) the index is written and renamed last; returns the
    /// final paths of the files and of the index. Each file an output name held before is kept
    /// under a second name until the export is complete, so that a rename that fails puts every
    /// output name back as it was (a file that was not there is removed): a failed export leaves
    /// the old export, or nothing. On any failure the temporaries are removed.
    pub fn commit(self, written: Result<()>) -> Result<Exported> {
        let index_tmp = outfile::tmp_name(&self.dir, SAFETENSORS_INDEX_FILE);
        let mut placed: Vec<Placed> = Vec::new();
        let r = written.and_then(|()| self.publish(&index_tmp, &mut placed));
        let undo_failed = if r.is_err() { self.undo(&placed) } else { Vec::new() };
        // Temporaries, and the second names of replaced files (their work is done): any that
        // cannot be removed is reported.
        let created = self.files.iter().filter(|p| p.created.load(std::sync::atomic::Ordering::Relaxed));
        let temporaries =
            created.map(|p| &p.tmp).chain([&index_tmp]).chain(placed.iter().filter_map(|p| p.backup.as_ref()));
        let present = |t: &PathBuf| std::fs::symlink_metadata(t).is_ok();
        let leftovers: Vec<PathBuf> =
            temporaries.filter(|t| present(t) && self.fs.remove(t).is_err() && present(t)).cloned().collect();
        match r {
            Ok((files, index)) => Ok(Exported { files, index, leftovers }),
            Err(e) if undo_failed.is_empty() => Err(e),
            Err(e) => Err(Error::Io {
                path: self.dir.clone(),
                source: std::io::Error::other(format!(
                    "{e}; and {} could not be put back as it was: the output mixes this export's files with the \
                     earlier ones: export again",
                    undo_failed.join(", ")
                )),
            }),
        }
    }

    /// Puts every file, then the index, at its output name (see [`SafetensorsExport::commit`]),
    /// recording each step in `placed`.
    fn publish(&self, index_tmp: &Path, placed: &mut Vec<Placed>) -> Result<(Vec<PathBuf>, Option<PathBuf>)> {
        // Checked again right before the renames: what appeared meanwhile is not replaced either.
        for dest in self.files.iter().map(|p| &p.dest).chain(self.index.as_ref().map(|(d, _)| d)) {
            outfile::check_replaceable(dest)?;
        }
        if let Some((_, text)) = &self.index {
            let mut f = self.fs.create_new(index_tmp)?;
            f.write_all(text)?;
            f.finish()?;
        }
        let moves = self.files.iter().map(|p| (p.tmp.clone(), p.dest.clone()));
        let moves = moves.chain(self.index.as_ref().map(|(dest, _)| (index_tmp.to_path_buf(), dest.clone())));
        for (tmp, dest) in moves {
            let name = dest.file_name().and_then(|n| n.to_str()).unwrap_or("output");
            let backup = dest.exists().then(|| outfile::tmp_name(&self.dir, name));
            // Recorded first: a link whose answer was lost is still removed at the end.
            placed.push(Placed { dest: dest.clone(), backup: backup.clone(), attempted: false });
            if let Some(b) = &backup {
                self.fs.hard_link(&dest, b)?;
            }
            placed.last_mut().expect("pushed above").attempted = true;
            self.fs.rename(&tmp, &dest)?;
        }
        Ok((self.paths(), self.index.as_ref().map(|(d, _)| d.clone())))
    }

    /// Puts back what the output names held before the steps `placed` (last first); returns
    /// the names that could not be.
    fn undo(&self, placed: &[Placed]) -> Vec<String> {
        let mut failed = Vec::new();
        // A rename that failed may have happened (its answer lost): undone either way.
        for p in placed.iter().rev().filter(|p| p.attempted) {
            let r = match &p.backup {
                Some(b) => self.fs.rename(b, &p.dest),
                None => self.fs.remove(&p.dest),
            };
            if r.is_err() {
                failed.push(p.dest.display().to_string());
            }
        }
        failed
    }
}

/// What a committed export wrote.
pub(crate) struct Exported {
    /// The files, in order.
    pub files: Vec<PathBuf>,
    /// The index of a sharded export.
    pub index: Option<PathBuf>,
    /// Temporary files that could not be removed (the export is complete either way).
    pub leftovers: Vec<PathBuf>,
}

/// One step of an export's commit: the output name `dest`, the second name its earlier file got
/// (`None`: there was none), and whether the rename into it was tried.
struct Placed {
    dest: PathBuf,
    backup: Option<PathBuf>,
    attempted: bool,
}
