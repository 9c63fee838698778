use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::fs::{self, File, OpenOptions};
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::{check_name, ObjectWriter, Storage};
use crate::error::{Error, Result};

/// A checkpoint in a local directory. Reads use positioned reads on cached handles; writes use
/// positioned writes; commits use write-temp, fsync, rename, fsync-directory.
///
/// Every file is reached from the root without following a symbolic link at any component below
/// it (the root itself is the caller's and may be or pass through a link), and only regular files
/// are read: a checkpoint is untrusted input, and a link (`0.0 -> /proc/self/environ`) would
/// put bytes from outside it into a load, while a FIFO would block every reader forever. Such
/// entries are refused with [`Error::Corrupt`] naming them.
#[derive(Debug)]
pub struct LocalStorage {
    root: PathBuf,
    handles: Mutex<HashMap<String, Arc<File>>>,
    /// What [`Storage::is_local`] answers when the caller said ([`LocalStorage::treat_as_local`]).
    local: Option<bool>,
}

const NOT_FOLLOWED: &str = "is a symbolic link; tessera does not follow links out of a checkpoint";

/// Filesystems whose files live on this machine's disks or memory, by `statfs` magic number
/// (linux/magic.h): ext2/3/4, xfs, btrfs, tmpfs, ramfs, f2fs, zfs, overlayfs, bcachefs. Only
/// these take the local path of [`Storage::is_local`]; a network or parallel filesystem (NFS,
/// Lustre, GPFS, CephFS, CIFS) or a FUSE mount may serve concurrent writes into one file in
/// parallel and make every request a round trip, so it keeps several large requests in flight.
const LOCAL_FILESYSTEMS: [u64; 9] =
    [0xEF53, 0x5846_5342, 0x9123_683E, 0x0102_1994, 0x8584_58F6, 0xF2F5_2010, 0x2FC1_2FC1, 0x794C_7630, 0xCA45_1A4E];

/// Whether `dir` (or, while it does not exist yet, its nearest existing ancestor) is on one of
/// [`LOCAL_FILESYSTEMS`]. False where that cannot be told.
fn on_local_filesystem(dir: &Path) -> bool {
    #[cfg(target_os = "linux")]
    for at in dir.ancestors().filter(|a| !a.as_os_str().is_empty()) {
        let Ok(c) = std::ffi::CString::new(at.as_os_str().as_encoded_bytes()) else { return false };
        let mut st = std::mem::MaybeUninit::<libc::statfs>::zeroed();
        // SAFETY: `c` is a NUL-terminated path and `st` a writable `statfs`, which the call
        // fills whole when it returns 0; it is read only then.
        let st = unsafe { (libc::statfs(c.as_ptr(), st.as_mut_ptr()) == 0).then(|| st.assume_init()) };
        if let Some(st) = st {
            // The magic is 32 bits, in a field that is signed on some targets.
            return LOCAL_FILESYSTEMS.contains(&(st.f_type as u64 & 0xFFFF_FFFF));
        }
    }
    false
}

/// Why an entry of type `mode` (`st_mode`) is not read as a file, or `None` for a regular file.
fn not_regular(mode: libc::mode_t) -> Option<&'static str> {
    match mode & libc::S_IFMT {
        libc::S_IFREG => None,
        libc::S_IFLNK => Some(NOT_FOLLOWED),
        libc::S_IFIFO => Some("is a FIFO, not a regular file"),
        libc::S_IFDIR => Some("is a directory, not a regular file"),
        libc::S_IFSOCK => Some("is a socket, not a regular file"),
        libc::S_IFCHR | libc::S_IFBLK => Some("is a device, not a regular file"),
        _ => Some("is not a regular file"),
    }
}

/// `fstatat` of `name` in `dir`, not following a link.
fn lstat_at(dir: RawFd, name: &CStr) -> io::Result<libc::stat> {
    let mut st = MaybeUninit::<libc::stat>::uninit();
    // SAFETY: `name` is NUL-terminated and `st` is a valid out-pointer for one `stat`.
    let rc = unsafe { libc::fstatat(dir, name.as_ptr(), st.as_mut_ptr(), libc::AT_SYMLINK_NOFOLLOW) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fstatat succeeded, so it filled `st`.
    Ok(unsafe { st.assume_init() })
}

/// `openat` of `name` in `dir` for reading; never follows a link in `name`, never makes a tty
/// the controlling one.
fn open_at(dir: RawFd, name: &CStr, flags: libc::c_int) -> io::Result<OwnedFd> {
    let flags = flags | libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NOCTTY;
    // SAFETY: `name` is NUL-terminated; without O_CREAT no mode argument is read.
    let fd = unsafe { libc::openat(dir, name.as_ptr(), flags) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just opened and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Clears O_NONBLOCK (set so that opening a FIFO cannot block) once the file is known regular.
fn set_blocking(file: &File) -> io::Result<()> {
    let fd = file.as_raw_fd();
    // SAFETY: plain fcntl calls on a descriptor `file` owns.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags < 0 || libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// A name component as a C string (names were checked: no NUL).
fn c_name(component: &str) -> CString {
    CString::new(component).expect("checked names hold no NUL")
}

impl LocalStorage {
    /// A checkpoint rooted at directory `root` (created on first write).
    pub fn new(root: impl Into<PathBuf>) -> Self {
        LocalStorage { root: root.into(), handles: Mutex::new(HashMap::new()), local: None }
    }

    /// Says whether the directory keeps its files on this machine ([`Storage::is_local`]),
    /// instead of asking the filesystem: for a mount `statfs` misjudges (a FUSE mount of a
    /// local disk, a network filesystem behind an unknown type), or to see what a load does on
    /// a network filesystem from a local directory.
    pub fn treat_as_local(mut self, local: bool) -> Self {
        self.local = Some(local);
        self
    }

    /// The directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn path(&self, name: &str) -> Result<PathBuf> {
        check_name(name)?;
        Ok(self.root.join(name))
    }

    /// The directory holding `name`'s last component, and that component. The walk opens one
    /// component at a time relative to the last (O_NOFOLLOW, O_DIRECTORY), so no link below the
    /// root is followed even if one is planted while we walk.
    fn parent_of(&self, name: &str) -> Result<(OwnedFd, CString)> {
        check_name(name)?;
        let path = self.root.join(name);
        // The root is the caller's to choose: it is opened following links.
        let root = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
            .open(&self.root)
            .map_err(|e| Error::io(&path, e))?;
        let mut dir = OwnedFd::from(root);
        let (dirs, last) = name.rsplit_once('/').map_or(("", name), |(d, l)| (d, l));
        let mut walked = self.root.clone();
        for component in dirs.split('/').filter(|c| !c.is_empty()) {
            walked.push(component);
            let c = c_name(component);
            dir = match open_at(dir.as_raw_fd(), &c, libc::O_DIRECTORY) {
                Ok(fd) => fd,
                Err(e) => {
                    let is_link =
                        lstat_at(dir.as_raw_fd(), &c).is_ok_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFLNK);
                    return Err(if is_link {
                        Error::corrupt(walked, format!("{NOT_FOLLOWED} (reading {name} through it)"))
                    } else {
                        Error::io(&path, e)
                    });
                }
            };
        }
        Ok((dir, c_name(last)))
    }

    /// Opens `name` for reading: reached without following links, and a regular file.
    fn open_regular(&self, name: &str) -> Result<File> {
        let (dir, last) = self.parent_of(name)?;
        let path = self.root.join(name);
        // Looked at before opening: opening a device may act on it.
        let st = lstat_at(dir.as_raw_fd(), &last).map_err(|e| Error::io(&path, e))?;
        if let Some(why) = not_regular(st.st_mode) {
            return Err(Error::corrupt(path, why));
        }
        // The entry may be swapped between the look and the open: O_NOFOLLOW refuses a link,
        // O_NONBLOCK keeps a FIFO from blocking the open, and the descriptor's own type decides.
        let fd = open_at(dir.as_raw_fd(), &last, libc::O_NONBLOCK).map_err(|e| {
            if e.raw_os_error() == Some(libc::ELOOP) {
                Error::corrupt(&path, NOT_FOLLOWED)
            } else {
                Error::io(&path, e)
            }
        })?;
        let file = File::from(fd);
        let mode = file.metadata().map_err(|e| Error::io(&path, e))?.mode();
        if let Some(why) = not_regular(mode as libc::mode_t) {
            return Err(Error::corrupt(path, why));
        }
        set_blocking(&file).map_err(|e| Error::io(&path, e))?;
        Ok(file)
    }

    fn handle(&self, name: &str) -> Result<Arc<File>> {
        let mut handles = self.handles.lock().unwrap();
        if let Some(f) = handles.get(name) {
            return Ok(f.clone());
        }
        let f = Arc::new(self.open_regular(name)?);
        handles.insert(name.to_string(), f.clone());
        Ok(f)
    }

    fn read_from(&self, f: &File, name: &str, offset: u64, buf: &mut [u8]) -> Result<()> {
        if offset.checked_add(buf.len() as u64).is_none_or(|end| end > i64::MAX as u64) {
            return Err(Error::corrupt(
                self.root.join(name),
                format!("truncated: {} bytes at offset {offset} are past any possible end", buf.len()),
            ));
        }
        f.read_exact_at(buf, offset).map_err(|e| {
            let path = self.root.join(name);
            if e.kind() == io::ErrorKind::UnexpectedEof {
                Error::corrupt(path, format!("truncated: {} bytes at offset {offset} are not all there", buf.len()))
            } else {
                Error::io(path, e)
            }
        })
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
        let tmp = self.root.join(super::temporary_name(name, std::process::id(), nonce));
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
        // lstat of the entry itself, reached like a read: a link's target is never looked at.
        let (dir, last) = self.parent_of(name)?;
        let path = self.root.join(name);
        let st = lstat_at(dir.as_raw_fd(), &last).map_err(|e| Error::io(&path, e))?;
        if let Some(why) = not_regular(st.st_mode) {
            return Err(Error::corrupt(path, why));
        }
        Ok(st.st_size as u64)
    }

    fn read(&self, name: &str) -> Result<Vec<u8>> {
        // A fresh handle: its size and bytes are those of one file, even if `name` was just
        // replaced.
        let f = self.open_regular(name)?;
        let path = self.root.join(name);
        let n = f.metadata().map_err(|e| Error::io(&path, e))?.len();
        let mut buf = vec![0u8; usize::try_from(n).map_err(|_| Error::corrupt(&path, "too large to read whole"))?];
        self.read_from(&f, name, 0, &mut buf)?;
        Ok(buf)
    }

    fn read_at(&self, name: &str, offset: u64, buf: &mut [u8]) -> Result<()> {
        let f = self.handle(name)?;
        self.read_from(&f, name, offset, buf)
    }

    fn is_local(&self) -> bool {
        self.local.unwrap_or_else(|| on_local_filesystem(&self.root))
    }

    fn create(&self, name: &str, size: u64) -> Result<Box<dyn ObjectWriter>> {
        super::check_plain_name(name)?;
        let path = self.path(name)?;
        fs::create_dir_all(&self.root).map_err(|e| Error::io(&self.root, e))?;
        self.forget(name);
        // Replaced, never written through: whatever holds the name (a link to a file outside, a
        // hard link to one, a FIFO) is removed, and the new file is made with O_EXCL, which
        // follows no link.
        match fs::remove_file(&path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(Error::io(&path, e)),
            _ => {}
        }
        let file = OpenOptions::new().create_new(true).write(true).open(&path).map_err(|e| Error::io(&path, e))?;
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
                // The formats that list (zarr) take the listing as the checkpoint's contents: a
                // link or special file is refused rather than left out, or a folder behind a
                // link would silently drop out of the checkpoint. Links are never descended (a
                // folder swapped for one after this look could at most show names here: reads
                // walk from the root themselves and refuse it).
                let t = entry.file_type().map_err(|e| Error::io(entry.path(), e))?;
                if t.is_dir() {
                    dirs.push((entry.path(), name));
                } else if t.is_file() {
                    out.push(name);
                } else {
                    return Err(Error::corrupt(entry.path(), not_regular_type(t)));
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
        // Regular files only: links and special files are no objects of the checkpoint (reads
        // refuse them), and the writers' cleanups that list must not take them for theirs.
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

/// [`not_regular`] for a directory entry's type (which `read_dir` gives without following).
fn not_regular_type(t: fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if t.is_symlink() {
        NOT_FOLLOWED
    } else if t.is_fifo() {
        "is a FIFO, not a regular file"
    } else if t.is_socket() {
        "is a socket, not a regular file"
    } else if t.is_block_device() || t.is_char_device() {
        "is a device, not a regular file"
    } else {
        "is not a regular file"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(target_os = "linux")]
    #[test]
    fn local_filesystems_are_told_from_others() {
        // tmpfs is local; procfs is not among the listed ones; a directory not yet made is
        // judged by the nearest one that exists.
        if Path::new("/dev/shm").is_dir() {
            assert!(on_local_filesystem(Path::new("/dev/shm")));
            assert!(on_local_filesystem(Path::new("/dev/shm/not/made/yet")));
        }
        assert!(!on_local_filesystem(Path::new("/proc")));
        assert!(!on_local_filesystem(Path::new("/proc/not-there")));
        assert!(!LocalStorage::new("/proc/x").is_local());
        // What the caller says wins over what the filesystem says.
        assert!(LocalStorage::new("/proc/x").treat_as_local(true).is_local());
        assert!(!LocalStorage::new(std::env::temp_dir()).treat_as_local(false).is_local());
    }
}
