//! Full verification of a checkpoint: index, files, coverage, every checksum.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::error::Result;
use crate::format::data_file::decode_header;
use crate::format::{read_header, Backend, CheckpointIndex, SafetensorsHeader};
use crate::load::open::open_unvalidated;
use crate::plan::validate::index_defects;
use crate::storage::{Storage, StorageExt};
use crate::threads::parallel_for;

/// Outcome of [`verify`]: sound when `problems` is empty.
#[derive(Debug, Clone, Default)]
pub struct VerifyReport {
    /// Data files checked.
    pub files: usize,
    /// Tensor chunks checked.
    pub chunks: usize,
    /// Bytes read and checksummed.
    pub bytes_checked: u64,
    /// False for foreign formats, which carry no block checksums: their bytes were read and
    /// decoded (and the zip CRC-32 of every member of their `torch.save` archives checked:
    /// DCP items, Megatron's `common.pt` and objects).
    pub checksummed: bool,
    /// Files checked against the SHA-256 Megatron-Core's `integrity.json` records for them
    /// (0 without one).
    pub integrity_checked: usize,
    /// Everything found wrong, each naming the file or key.
    pub problems: Vec<String>,
    /// Files of tessera's own saves beside the committed checkpoint that it does not use (left
    /// by saves that failed or were replaced): not a defect of the checkpoint; `gc` removes them.
    pub leftovers: Vec<String>,
}

/// Reads the index and every data file: every defect of the index (the validation gate's
/// checks, all reported, not only the first), then sizes, safetensors headers and every block
/// and object checksum. A missing or unreadable index is
/// an error (`NotCommitted`, `Corrupt`, `IncompatibleVersion`); damage elsewhere is reported.
/// Foreign formats have no block checksums: every chunk and object is read (and decoded) in
/// full, which finds truncated, misplaced or undecodable items, and the zip CRC-32 of every
/// member of a `torch.save` archive is checked. A Megatron `torch_dist` checkpoint with an
/// `integrity.json` has every file it lists checked against its SHA-256, and every data file
/// it does not list reported.
///
/// ```
/// use tessera::{save, SaveOptions};
/// use tessera::tools::verify;
/// use tessera::{DType, ShardedTensor, StateTree, Storage, TensorData};
/// use tessera::comm::SoloComm;
/// use tessera::storage::MemoryStorage;
///
/// let storage = MemoryStorage::new();
/// let w = ShardedTensor::full("w", DType::U8, &[1024], TensorData::Owned(vec![3; 1024]));
/// let tree = StateTree::map().with("w", StateTree::Tensor(w));
/// let file = save(tree, &storage, &SoloComm, &SaveOptions::default())?.file.unwrap();
/// let report = verify(&storage, 2)?;
/// assert!(report.problems.is_empty() && report.checksummed);
/// assert_eq!((report.files, report.chunks), (1, 1));
///
/// // Flip the data file's last byte (tensor data): the block checksum catches it.
/// let mut bytes = storage.read(&file)?;
/// *bytes.last_mut().unwrap() ^= 1;
/// storage.put_atomic(&file, &bytes)?;
/// let report = verify(&storage, 2)?;
/// assert_eq!(report.problems.len(), 1);
/// assert!(report.problems[0].contains(&file));
/// # Ok::<(), tessera::Error>(())
/// ```
pub fn verify(storage: &dyn Storage, threads: usize) -> Result<VerifyReport> {
    let ckpt = open_unvalidated(storage)?;
    // The native index's own files: it may be invalid (then it is the report, not an error).
    let referenced =
        (ckpt.index.backend == Backend::Tessera).then(|| ckpt.index.files.iter().map(|f| f.name.clone()).collect());
    let leftovers = crate::tools::maintenance::analyse(storage, &Default::default(), referenced)?.0;
    // The checkpoint's own files (integrity.json names them), beside the view of its index.
    let base = storage;
    let (index, storage) = (&ckpt.index, ckpt.storage());
    let mut report =
        VerifyReport { files: index.files.len(), chunks: index.chunk_count(), leftovers, ..Default::default() };
    let defects = index_defects(index);
    let invalid = defects.iter().any(|d| !d.uncovered);
    report.problems.extend(defects.iter().map(|d| d.to_string()));
    if invalid {
        // Reading by an index that failed the gate could read outside its files or past the
        // tensors; what is wrong with it is the report.
        report.problems.push("the index is invalid: no data was read".into());
        return Ok(report);
    }
    report.checksummed = index.block_size > 0;
    if index.block_size == 0 {
        verify_readable(storage, index, threads, &mut report);
        // Megatron writes it beside torch_dist; a copy without its metadata.json opens as DCP.
        if matches!(ckpt.record.backend, Backend::TorchDist | Backend::TorchDcp) {
            verify_integrity(base, threads, &mut report)?;
        }
        return Ok(report);
    }
    // Per file, what it stores, in the order problems are reported (tensors by key and their
    // chunks in order, then objects): positions only, so that the walk below needs no memory
    // per block (a chunk saved with block size 1 has a block per byte).
    let mut stored: Vec<Vec<Stored>> = vec![Vec::new(); index.files.len()];
    for (ti, t) in index.tensors.iter().enumerate() {
        for (ci, c) in t.chunks().iter().enumerate() {
            stored[c.file as usize].push(Stored::Chunk(ti, ci));
        }
    }
    for (oi, o) in index.objects.iter().enumerate() {
        for (si, s) in o.shards.iter().enumerate() {
            stored[s.file as usize].push(Stored::Shard(oi, si));
        }
    }
    let problems = Mutex::new(Vec::new());
    let checked = AtomicUsize::new(0);
    parallel_for(index.files.len(), threads, |fi| {
        let f = &index.files[fi];
        let path = format!("{}/{}", storage.location(), f.name);
        match storage.size(&f.name) {
            Ok(n) if n == f.size => {}
            Ok(n) => {
                problems.lock().unwrap().push(format!("{path}: size {n}, the index says {}", f.size));
                return;
            }
            Err(e) => {
                problems.lock().unwrap().push(format!("{path}: {e}"));
                return;
            }
        }
        let mut read = |off: u64, buf: &mut [u8]| storage.read_at(&f.name, off, buf);
        match read_header(&mut read, f.size, &path) {
            Err(e) => problems.lock().unwrap().push(format!("{path}: bad safetensors header: {e}")),
            Ok(h) if h.header_len != f.header_len => problems
                .lock()
                .unwrap()
                .push(format!("{path}: safetensors header is {} bytes, the index says {}", h.header_len, f.header_len)),
            Ok(h) if index.backend == Backend::Tessera => {
                problems.lock().unwrap().extend(header_defects(index, fi, &h, &path))
            }
            Ok(_) => {}
        }
        if let Err(e) = crate::load::read::verify_headers(storage, index, &[fi as u32]) {
            problems.lock().unwrap().push(e.to_string());
        }
        checked.fetch_add(f.header_len as usize, Ordering::Relaxed);
        let mut file = FileCheck { storage, name: &f.name, path: &path, buf: Vec::new(), problems: &problems };
        for item in &stored[fi] {
            let r = match *item {
                Stored::Chunk(ti, ci) => {
                    let t = &index.tensors[ti];
                    let c = &t.chunks()[ci];
                    let len = c.numel() * t.dtype.size() as u64;
                    file.check(c.byte_offset, len, index.block_size, &c.crcs, &|| format!("tensor {:?}", t.key))
                }
                Stored::Shard(oi, si) => {
                    let (o, s) = (&index.objects[oi], &index.objects[oi].shards[si]);
                    file.check(s.byte_offset, s.len, s.len, &[s.crc], &|| {
                        format!("object {:?} shard {:?}", o.key, s.offset)
                    })
                }
            };
            match r {
                Ok(n) => {
                    checked.fetch_add(n as usize, Ordering::Relaxed);
                }
                Err(n) => {
                    // An unreadable file: what was read is counted, the rest of it skipped.
                    checked.fetch_add(n as usize, Ordering::Relaxed);
                    break;
                }
            }
        }
    });
    report.bytes_checked = checked.into_inner() as u64;
    report.problems.extend(problems.into_inner().unwrap());
    Ok(report)
}

/// Where the header of native data file `fi` (read and validated: `h`) disagrees with the index
/// about what the file holds: each chunk and object shard the index places in the file must be
/// recorded there (at the same byte offset, with the same key, dtype, shapes, flat range and
/// checksums), under the index's block size and format version. Records the index does not use
/// (keys since removed) are no defect.
fn header_defects(index: &CheckpointIndex, fi: usize, h: &SafetensorsHeader, path: &str) -> Vec<String> {
    let header = match decode_header(h, path) {
        Ok(d) => d,
        Err(e) => return vec![format!("{path}: {e}")],
    };
    let mut out = Vec::new();
    if header.block_size != index.block_size {
        out.push(format!("{path}: the header's block size is {}, the index's {}", header.block_size, index.block_size));
    }
    if header.format_version != index.version {
        out.push(format!(
            "{path}: the header says format version {}, the index {}",
            header.format_version, index.version
        ));
    }
    // Records by byte offset: chunks without elements share the offset of the next one.
    let mut chunks: std::collections::HashMap<u64, Vec<&crate::format::data_file::HeaderChunk>> = Default::default();
    for r in &header.chunks {
        chunks.entry(r.byte_offset).or_default().push(r);
    }
    for t in &index.tensors {
        for c in t.chunks().iter().filter(|c| c.file as usize == fi) {
            let same = |r: &&crate::format::data_file::HeaderChunk| {
                r.key == t.key
                    && r.dtype == t.dtype
                    && r.global_shape == t.global_shape
                    && r.offset[..] == c.offset[..]
                    && r.shape[..] == c.shape[..]
                    && r.flat == c.flat
                    && r.crcs[..] == c.crcs[..]
            };
            let at = chunks.get(&c.byte_offset).map_or(&[][..], Vec::as_slice);
            let Some(r) = at.iter().find(|r| r.key == t.key).or(at.first()) else {
                out.push(format!("{path}: no header record for tensor {:?} at byte {}", t.key, c.byte_offset));
                continue;
            };
            if !at.iter().any(same) {
                out.push(format!(
                    "{path}: the header's record at byte {} ({:?} {} {:?} at {:?}, flat {:?}) is not the index's \
                     chunk of {:?} ({} {:?} at {:?}, flat {:?}) or its checksums differ",
                    c.byte_offset,
                    r.key,
                    r.dtype.name(),
                    r.shape,
                    r.offset,
                    r.flat,
                    t.key,
                    t.dtype.name(),
                    &c.shape[..],
                    &c.offset[..],
                    c.flat
                ));
            }
        }
    }
    let objects: std::collections::HashMap<u64, &crate::format::data_file::HeaderObject> =
        header.objects.iter().map(|o| (o.byte_offset, o)).collect();
    for o in &index.objects {
        for sh in o.shards.iter().filter(|s| s.file as usize == fi) {
            match objects.get(&sh.byte_offset) {
                Some(r) if r.key == o.key && r.offset == sh.offset && r.len == sh.len && r.crc == sh.crc => {}
                Some(_) => out.push(format!(
                    "{path}: the header's record at byte {} is not the index's shard {:?} of object {:?}",
                    sh.byte_offset, sh.offset, o.key
                )),
                None => out.push(format!(
                    "{path}: no header record for shard {:?} of object {:?} at byte {}",
                    sh.offset, o.key, sh.byte_offset
                )),
            }
        }
    }
    out
}

/// A checksummed range of a data file, by position in the index.
#[derive(Debug, Clone, Copy)]
enum Stored {
    /// Chunk `.1` of tensor `.0`.
    Chunk(usize, usize),
    /// Shard `.1` of object `.0`.
    Shard(usize, usize),
}

/// Bytes read at once by [`FileCheck::check`]: many small blocks per read, a large block in
/// several reads.
const READ_BYTES: u64 = 4 << 20;

/// The checksums of one data file being checked, and where its problems go.
struct FileCheck<'a> {
    storage: &'a dyn Storage,
    name: &'a str,
    /// The file as problems name it.
    path: &'a str,
    /// Bytes read, reused from range to range.
    buf: Vec<u8>,
    problems: &'a Mutex<Vec<String>>,
}

impl FileCheck<'_> {
    /// Checks the bytes `[off, off + len)` as consecutive blocks of `block` bytes (the last
    /// may be shorter), block `i` against `crcs[i]`, reading at most [`READ_BYTES`] at a time;
    /// a mismatch is reported naming `what()`. Returns the bytes read; `Err` (with the bytes
    /// read before) when a read failed, which is reported too.
    fn check(&mut self, off: u64, len: u64, block: u64, crcs: &[u32], what: &dyn Fn() -> String) -> Result<u64, u64> {
        let end = off + len;
        // What `buf` holds: bytes [read_at, read_end) of the file.
        let (mut read_at, mut read_end) = (off, off);
        for (b, &stored) in crcs.iter().enumerate() {
            let block_off = off + b as u64 * block;
            let block_end = block_off.saturating_add(block).min(end);
            let mut crc = 0u32;
            let mut at = block_off;
            while at < block_end {
                if at >= read_end {
                    let n = READ_BYTES.min(end - at);
                    self.buf.resize(n as usize, 0);
                    if let Err(e) = self.storage.read_at(self.name, at, &mut self.buf) {
                        self.problems.lock().unwrap().push(format!("{}: {e}", self.path));
                        return Err(read_end - off);
                    }
                    (read_at, read_end) = (at, at + n);
                }
                let to = block_end.min(read_end);
                crc =
                    crate::model::crc::crc32c_append(crc, &self.buf[(at - read_at) as usize..(to - read_at) as usize]);
                at = to;
            }
            if crc != stored {
                let problem =
                    format!("{}: checksum mismatch in {} at bytes {block_off}..{block_end}", self.path, what());
                self.problems.lock().unwrap().push(problem);
            }
        }
        Ok(read_end - off)
    }
}

/// Reads every virtual file of a foreign checkpoint whole, in pieces of at most 8 MiB (a
/// virtual file's size is what the metadata claims: the buffer must not follow it).
fn verify_readable(
    storage: &dyn Storage,
    index: &crate::format::CheckpointIndex,
    threads: usize,
    report: &mut VerifyReport,
) {
    const PIECE: u64 = 8 << 20;
    let problems = Mutex::new(Vec::new());
    let checked = AtomicUsize::new(0);
    let object_files: std::collections::HashSet<u32> =
        index.objects.iter().flat_map(|o| o.shards.iter().map(|s| s.file)).collect();
    parallel_for(index.files.len(), threads, |fi| {
        let f = &index.files[fi];
        let r = if object_files.contains(&(fi as u32)) {
            storage.read(&f.name).map(|b| b.len())
        } else {
            let mut buf = Vec::new();
            let mut off = 0;
            let mut r = Ok(0);
            while off < f.size {
                let len = PIECE.min(f.size - off);
                buf.resize(len as usize, 0);
                if let Err(e) = storage.read_at(&f.name, off, &mut buf) {
                    r = Err(e);
                    break;
                }
                off += len;
            }
            r.map(|_: usize| f.size as usize)
        };
        match r {
            Ok(n) => {
                checked.fetch_add(n, Ordering::Relaxed);
            }
            Err(e) => problems.lock().unwrap().push(e.to_string()),
        }
    });
    report.bytes_checked = checked.into_inner() as u64;
    let mut p = problems.into_inner().unwrap();
    p.sort();
    report.problems.extend(p);
}

/// Checks the files Megatron-Core's `integrity.json` lists (if there is one at the top of
/// `storage`) against their SHA-256: a listed file missing or different, a data file of the
/// checkpoint not listed, and a manifest that does not parse are each a problem.
fn verify_integrity(storage: &dyn Storage, threads: usize, report: &mut VerifyReport) -> Result<()> {
    use crate::formats::dcp::integrity::{hex, is_checkpoint_file, parse_integrity, INTEGRITY_FILE};
    use sha2::{Digest, Sha256};
    const PIECE: u64 = 8 << 20;
    let at = storage.location();
    let Some(size) = storage.size_if_present(INTEGRITY_FILE)? else { return Ok(()) };
    let shown = format!("{at}/{INTEGRITY_FILE}");
    if size > crate::formats::dcp::integrity::INTEGRITY_MAX_BYTES {
        report.problems.push(format!("{shown}: {size} bytes, too large for a manifest"));
        return Ok(());
    }
    let manifest = match parse_integrity(&storage.read(INTEGRITY_FILE)?) {
        Ok(m) => m,
        Err(e) => {
            report.problems.push(format!("{shown}: {e}"));
            return Ok(());
        }
    };
    let listed: Vec<(&String, &[u8; 32])> = manifest.iter().collect();
    let problems = Mutex::new(Vec::new());
    parallel_for(listed.len(), threads, |i| {
        let (name, want) = listed[i];
        let size = match storage.size_if_present(name) {
            Ok(Some(n)) => n,
            Ok(None) => {
                problems.lock().unwrap().push(format!("{at}/{name}: listed in {INTEGRITY_FILE} but missing"));
                return;
            }
            Err(e) => {
                problems.lock().unwrap().push(format!("{at}/{name}: {e}"));
                return;
            }
        };
        let (mut hasher, mut buf, mut off) = (Sha256::new(), Vec::new(), 0u64);
        while off < size {
            let n = PIECE.min(size - off);
            buf.resize(n as usize, 0);
            if let Err(e) = storage.read_at(name, off, &mut buf) {
                problems.lock().unwrap().push(format!("{at}/{name}: {e}"));
                return;
            }
            hasher.update(&buf);
            off += n;
        }
        let got: [u8; 32] = hasher.finalize().into();
        if &got != want {
            problems.lock().unwrap().push(format!(
                "{at}/{name}: SHA-256 {}, {INTEGRITY_FILE} records {} (the file changed after the save)",
                hex(&got),
                hex(want)
            ));
        }
    });
    let mut problems = problems.into_inner().unwrap();
    problems.sort();
    let mut unlisted: Vec<String> = storage
        .list()?
        .into_iter()
        .filter(|n| is_checkpoint_file(n) && !manifest.contains_key(n))
        .map(|n| format!("{at}/{n}: a file of the checkpoint that {INTEGRITY_FILE} does not list"))
        .collect();
    unlisted.sort();
    report.integrity_checked = manifest.len();
    report.problems.extend(problems);
    report.problems.extend(unlisted);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::crc::crc32c;
    use crate::storage::MemoryStorage;

    /// `bytes` as file `f` of a memory storage.
    fn stored(bytes: &[u8]) -> MemoryStorage {
        let storage = MemoryStorage::new();
        let w = storage.create("f", bytes.len() as u64).unwrap();
        w.write_at(0, bytes).unwrap();
        w.finish().unwrap();
        storage
    }

    /// Problems `FileCheck::check` reports for bytes `[off, off + len)` of `bytes` in blocks of
    /// `block`, against the checksums of `clean`; and the bytes it read.
    fn problems(clean: &[u8], bytes: &[u8], off: u64, len: u64, block: u64) -> (Vec<String>, u64) {
        let range = &clean[off as usize..(off + len) as usize];
        let crcs: Vec<u32> = if len == 0 { vec![0] } else { range.chunks(block as usize).map(crc32c).collect() };
        let storage = stored(bytes);
        let problems = Mutex::new(Vec::new());
        let mut file = FileCheck { storage: &storage, name: "f", path: "mem/f", buf: Vec::new(), problems: &problems };
        let read = file.check(off, len, block, &crcs, &|| "tensor \"w\"".into()).unwrap();
        (problems.into_inner().unwrap(), read)
    }

    #[test]
    fn blocks_smaller_and_larger_than_a_read_are_each_checked() {
        let clean: Vec<u8> = (0..(7u32 << 20) + 5).map(|i| (i % 251) as u8).collect();
        let len = clean.len() as u64 - 3;
        // Blocks of 1 byte (many per read), of 6 MiB (each across two reads), of the whole range.
        for block in [1u64, 3, 6 << 20, len] {
            assert_eq!(problems(&clean, &clean, 3, len, block), (vec![], len), "block {block}");
        }
        let mut damaged = clean.clone();
        for at in [3usize, (4 << 20) + 3, (6 << 20) + 4] {
            damaged[at] ^= 1;
        }
        let mismatch = |from: u64, to: u64| format!("mem/f: checksum mismatch in tensor \"w\" at bytes {from}..{to}");
        let want_1: Vec<String> = [3u64, (4 << 20) + 3, (6 << 20) + 4].iter().map(|&at| mismatch(at, at + 1)).collect();
        assert_eq!(problems(&clean, &damaged, 3, len, 1).0, want_1);
        let want_6m = vec![mismatch(3, (6 << 20) + 3), mismatch((6 << 20) + 3, len + 3)];
        assert_eq!(problems(&clean, &damaged, 3, len, 6 << 20).0, want_6m);
        // An empty object shard: its checksum is that of no bytes.
        assert_eq!(problems(&clean, &damaged, 8, 0, 0), (vec![], 0));
    }
}
