//! Reading the native index for some keys only: the head (directory of every tensor) with one
//! ranged read in the common case, then only the chunk sections of the wanted tensors, so a
//! rank loading a few keys of a 100 MiB index reads and decodes a few KiB of it.

use std::collections::BTreeSet;

use crate::error::{Error, Result};
use crate::format::index::IndexHead;
use crate::format::{CheckpointIndex, TensorEntry, FORMAT_VERSION, INDEX_FILE};
use crate::storage::Storage;
use crate::threads::on_cores;

/// The first read of an index: most heads (every key, file and object) fit in it.
const FIRST_READ: u64 = 256 << 10;
/// Sections closer than this are fetched by one read (a gap costs less than a request).
const MERGE_GAP: u64 = 64 << 10;
/// When the wanted sections are at least this share of all of them, read everything at once.
const READ_ALL_SHARE: u64 = 4;

impl CheckpointIndex {
    /// Parses index bytes (as read from `path`, used in errors), checking magic, version,
    /// checksum, bounds and names. A large index is decoded on every core.
    pub fn from_bytes(bytes: &[u8], path: &str) -> Result<CheckpointIndex> {
        Self::decode(bytes, &on_cores).map_err(|e| e.into_error(path))
    }
}

/// The native index at `storage` with the chunk maps of only the tensors in `keys`; the other
/// tensors are listed as omitted. Version 1 has no directory: it is read whole.
pub(crate) fn open_native_keys(storage: &dyn Storage, keys: &BTreeSet<String>) -> Result<CheckpointIndex> {
    let shown = format!("{}/{INDEX_FILE}", storage.location());
    let size = storage.size(INDEX_FILE)?;
    // The bytes from the start of the file read so far; grown in place, never read twice.
    let mut prefix = Vec::new();
    let grow = |prefix: &mut Vec<u8>, end: u64| -> Result<()> {
        let at = prefix.len();
        if end as usize > at {
            prefix.resize(end as usize, 0);
            storage.read_at(INDEX_FILE, at as u64, &mut prefix[at..])?;
        }
        Ok(())
    };
    grow(&mut prefix, size.min(FIRST_READ))?;
    if CheckpointIndex::peek_version(&prefix) != Some(FORMAT_VERSION) {
        grow(&mut prefix, size)?;
        let mut index = CheckpointIndex::from_bytes(&prefix, &shown)?;
        let (held, omitted): (Vec<TensorEntry>, _) =
            std::mem::take(&mut index.tensors).into_iter().partition(|t| keys.contains(&t.key));
        index.tensors = held;
        index.omitted_tensors = omitted.into_iter().map(|t| t.key).collect();
        return Ok(index);
    }
    let extent = IndexHead::extent(&prefix).map_err(|e| e.into_error(&shown))?;
    if extent > size {
        return Err(Error::corrupt(
            &shown,
            format!("index head needs {extent} bytes, the file has {size} (truncated)"),
        ));
    }
    grow(&mut prefix, extent)?;
    let head = IndexHead::decode(&prefix).map_err(|e| e.into_error(&shown))?;
    if head.file_size() != size {
        return Err(Error::corrupt(
            &shown,
            format!("index is {size} bytes, its head says {} (truncated or extended)", head.file_size()),
        ));
    }
    let wanted: Vec<usize> = (0..head.tensors.len()).filter(|&i| keys.contains(&head.tensors[i].key)).collect();

    // When most sections are wanted, the rest of the file is read at once; otherwise the wanted
    // sections past what is read, merged across small gaps, each range covering whole sections.
    let wanted_bytes: u64 = wanted.iter().map(|&i| head.tensors[i].range.end - head.tensors[i].range.start).sum();
    if wanted_bytes * READ_ALL_SHARE >= size - extent {
        grow(&mut prefix, size)?;
    }
    let have = prefix.len() as u64;
    let mut fetch: Vec<(u64, u64)> = Vec::new();
    // Empty sections (tensors with no stored chunk) need no read.
    for r in wanted.iter().map(|&i| &head.tensors[i].range).filter(|r| r.end > have && r.end > r.start) {
        match fetch.last_mut() {
            Some(last) if r.start <= last.1 + MERGE_GAP => last.1 = r.end,
            _ => fetch.push((r.start, r.end)),
        }
    }
    let mut fetched: Vec<(u64, Vec<u8>)> = Vec::with_capacity(fetch.len());
    for (start, end) in fetch {
        let mut buf = vec![0u8; (end - start) as usize];
        storage.read_at(INDEX_FILE, start, &mut buf)?;
        fetched.push((start, buf));
    }
    let section = |i: usize| -> &[u8] {
        let r = &head.tensors[i].range;
        if r.start == r.end {
            return &[];
        }
        if r.end <= have {
            return &prefix[r.start as usize..r.end as usize];
        }
        let k = fetched.partition_point(|(s, b)| s + b.len() as u64 <= r.start);
        let (s, b) = &fetched[k];
        &b[(r.start - s) as usize..(r.end - s) as usize]
    };
    let tensors = head.decode_some(&wanted, section, &on_cores).map_err(|reason| Error::corrupt(&shown, reason))?;
    Ok(head.into_index(tensors))
}
