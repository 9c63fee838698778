//! The gate every index passes before anything reads by it, whatever format it came from
//! (native v1/v2, DCP, Megatron torch_dist and zarr, OLMo-core): the openers run
//! [`validate_index`] on what a strategy produced (the tools' loads reuse an opener's validated
//! index), and `verify` reports every [`IndexDefect`] it finds.
//!
//! After the gate, readers may rely on: every shape has at most `MAX_AXES` (64) axes, and its
//! element and byte counts fit in `u64`; every chunk box lies inside its tensor and every flat
//! range inside its box; every chunk and object shard names a file of the index and lies inside
//! that file's data (past its header, before its end); a checksummed index has one checksum per
//! block of every chunk; keys are sorted and unique; file names are plain names; and no two
//! chunks of a tensor hold the same element, so the destinations of a load never overlap. The one defect the gate lets through
//! is a region no chunk stores (a gap): the load of anything touching it fails naming the key
//! (`NotCovered`), and `verify` reports it.

use std::fmt;

use crate::error::{Error, Result};
use crate::format::{CheckpointIndex, FileEntry, ObjectEntry, TensorEntry};
use crate::model::dims::check_axes;
use crate::plan::geometry::{decompose_flat, tiling_faults, Piece};
use crate::storage::names::check_relative_name;

/// Something wrong with an index, naming the tensor, object or file it concerns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexDefect {
    /// What the defect concerns: `tensor "key"`, `object "key"`, `file "name"` or `index`.
    pub subject: String,
    /// What is wrong.
    pub reason: String,
    /// True for a region no chunk stores: the index is usable for every other region.
    pub uncovered: bool,
}

impl fmt::Display for IndexDefect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.subject, self.reason)
    }
}

/// Checks `index` and fails on its first defect other than an uncovered region, as
/// `Error::Corrupt` naming `path` (the index or metadata file) and the key or file.
pub fn validate_index(index: &CheckpointIndex, path: &str) -> Result<()> {
    let mut first = None;
    walk(index, &mut |d| {
        if d.uncovered {
            return true;
        }
        first = Some(d);
        false
    });
    match first {
        Some(d) => Err(Error::corrupt(path, d.to_string())),
        None => Ok(()),
    }
}

/// Every defect of `index`, uncovered regions included (at most one per tensor or object).
pub fn index_defects(index: &CheckpointIndex) -> Vec<IndexDefect> {
    let mut out = Vec::new();
    walk(index, &mut |d| {
        out.push(d);
        true
    });
    out
}

/// Calls `found` with each defect until it returns false.
fn walk(index: &CheckpointIndex, found: &mut dyn FnMut(IndexDefect) -> bool) {
    let mut report =
        |subject: String, reason: String, uncovered: bool| found(IndexDefect { subject, reason, uncovered });
    for f in &index.files {
        if let Err(reason) = check_relative_name(&f.name) {
            if !report(format!("file {:?}", f.name), reason, false) {
                return;
            }
        }
        if f.header_len > f.size {
            let reason = format!("header of {} bytes in a file of {}", f.header_len, f.size);
            if !report(format!("file {:?}", f.name), reason, false) {
                return;
            }
        }
    }
    if let Some(w) = index.tensors.windows(2).find(|w| w[0].key >= w[1].key) {
        if !report(format!("tensor {:?}", w[1].key), "tensor keys not sorted and unique".into(), false) {
            return;
        }
    }
    if let Some(w) = index.objects.windows(2).find(|w| w[0].key >= w[1].key) {
        if !report(format!("object {:?}", w[1].key), "object keys not sorted and unique".into(), false) {
            return;
        }
    }
    let mut total = Some(0u64);
    for t in &index.tensors {
        if let Err(d) = check_tensor(t, &index.files, index.block_size) {
            if !report(format!("tensor {:?}", t.key), d.reason, d.uncovered) {
                return;
            }
        }
        let bytes = t.global_shape.iter().try_fold(t.dtype.size() as u64, |a, &b| a.checked_mul(b));
        if let Some(b) = bytes {
            // A tensor too large by itself is reported above.
            total = total.and_then(|a| a.checked_add(b));
        }
    }
    if total.is_none() && !report("index".into(), "its tensors hold more than 2^64 bytes in all".into(), false) {
        return;
    }
    for o in &index.objects {
        if let Err(d) = check_object(o, &index.files) {
            if !report(format!("object {:?}", o.key), d.reason, d.uncovered) {
                return;
            }
        }
    }
    if let Some((subject, reason)) = shared_bytes(index) {
        report(subject, reason, false);
    }
}

/// Two stored items (chunks, object shards) whose bytes overlap in one file: every writer gives
/// each its own bytes, and read planning relies on it (checksum blocks of one read belong to
/// one chunk). The gate runs it only on items that passed the per-item checks; `verify`'s report
/// also on the others, where its saturating arithmetic keeps it total.
fn shared_bytes(index: &CheckpointIndex) -> Option<(String, String)> {
    // (file, start, end, owner): owners below tensors.len() are tensors, the rest objects.
    let mut ranges: Vec<(u32, u64, u64, u32)> = Vec::with_capacity(index.chunk_count());
    for (ti, t) in index.tensors.iter().enumerate() {
        let esize = t.dtype.size() as u64;
        for c in t.chunks() {
            let len = c.numel().saturating_mul(esize);
            if len > 0 {
                ranges.push((c.file, c.byte_offset, c.byte_offset.saturating_add(len), ti as u32));
            }
        }
    }
    for (oi, o) in index.objects.iter().enumerate() {
        for s in o.shards.iter().filter(|s| s.len > 0) {
            let owner = (index.tensors.len() + oi) as u32;
            ranges.push((s.file, s.byte_offset, s.byte_offset.saturating_add(s.len), owner));
        }
    }
    ranges.sort_unstable();
    let name = |owner: u32| match index.tensors.get(owner as usize) {
        Some(t) => format!("tensor {:?}", t.key),
        None => format!("object {:?}", index.objects[owner as usize - index.tensors.len()].key),
    };
    let w = ranges.windows(2).find(|w| w[0].0 == w[1].0 && w[1].1 < w[0].2)?;
    let file = index.files.get(w[0].0 as usize).map_or("?", |f| f.name.as_str());
    Some((
        name(w[1].3),
        format!("its bytes {}..{} of {file} are also those of {}", w[1].1, w[0].2.min(w[1].2), name(w[0].3)),
    ))
}

struct Fault {
    reason: String,
    uncovered: bool,
}

fn invalid(reason: String) -> Fault {
    Fault { reason, uncovered: false }
}

/// Where a stored byte range must lie: inside the named file's data.
fn check_bytes(
    files: &[FileEntry],
    file: u32,
    byte_offset: u64,
    len: u64,
    what: &dyn Fn() -> String,
) -> Result<(), Fault> {
    let f = files
        .get(file as usize)
        .ok_or_else(|| invalid(format!("{} names file #{file}; the index has {}", what(), files.len())))?;
    let end = byte_offset
        .checked_add(len)
        .ok_or_else(|| invalid(format!("{}: byte range {byte_offset} + {len} overflows", what())))?;
    if byte_offset < f.header_len || end > f.size {
        return Err(invalid(format!(
            "{}: bytes {byte_offset}..{end} outside the data of {} (bytes {}..{})",
            what(),
            f.name,
            f.header_len,
            f.size
        )));
    }
    Ok(())
}

fn check_tensor(t: &TensorEntry, files: &[FileEntry], block_size: u64) -> Result<(), Fault> {
    let esize = t.dtype.size() as u64;
    let ndim = t.global_shape.len();
    // Every parser refuses more axes already; an index built in memory passes here too.
    check_axes(ndim).map_err(|e| invalid(format!("the global shape has {e}")))?;
    let numel = t.global_shape.iter().try_fold(1u64, |a, &b| a.checked_mul(b));
    if numel.and_then(|n| n.checked_mul(esize)).is_none() {
        return Err(invalid(format!("global shape {:?} of {} holds more than 2^64 bytes", t.global_shape, t.dtype)));
    }
    let mut pieces: Vec<Piece> = Vec::with_capacity(t.chunks().len());
    for (i, c) in t.chunks().iter().enumerate() {
        let what = || format!("chunk {i}");
        if c.offset.len() != ndim || c.shape.len() != ndim {
            return Err(invalid(format!(
                "{} has offset {:?} and shape {:?} for a tensor of {ndim} dimensions",
                what(),
                &c.offset[..],
                &c.shape[..]
            )));
        }
        for d in 0..ndim {
            if c.offset[d].checked_add(c.shape[d]).is_none_or(|end| end > t.global_shape[d]) {
                return Err(invalid(format!(
                    "{} box at {:?} of shape {:?} lies outside the global shape {:?}",
                    what(),
                    &c.offset[..],
                    &c.shape[..],
                    t.global_shape
                )));
            }
        }
        // Inside the tensor, so no product below overflows (the tensor's byte count does not).
        let box_numel: u64 = c.shape.iter().product();
        if let Some((s, e)) = c.flat {
            if s > e || e > box_numel {
                return Err(invalid(format!("{} flat range {s}..{e} outside its box of {box_numel} elements", what())));
            }
        }
        let nbytes = c.numel() * esize;
        check_bytes(files, c.file, c.byte_offset, nbytes, &what)?;
        if block_size > 0 && c.crcs.len() as u64 != nbytes.div_ceil(block_size) {
            return Err(invalid(format!(
                "{} of {nbytes} bytes has {} checksums; blocks of {block_size} bytes need {}",
                what(),
                c.crcs.len(),
                nbytes.div_ceil(block_size)
            )));
        }
        match c.flat {
            Some((s, e)) => pieces.extend(decompose_flat(&c.offset, &c.shape, s, e)),
            None => pieces.push(Piece::new(&c.offset, &c.shape)),
        }
    }
    let faults = tiling_faults(&t.global_shape, &pieces);
    if let Some(overlap) = faults.overlap {
        return Err(invalid(overlap));
    }
    if let Some(gap) = faults.gap {
        return Err(Fault { reason: gap, uncovered: true });
    }
    Ok(())
}

fn check_object(o: &ObjectEntry, files: &[FileEntry]) -> Result<(), Fault> {
    let ndim = o.global_shape.len();
    check_axes(ndim).map_err(|e| invalid(format!("the grid has {e}")))?;
    let Some(cells) = o.global_shape.iter().try_fold(1u64, |a, &b| a.checked_mul(b)) else {
        return Err(invalid(format!("grid {:?} has more than 2^64 cells", o.global_shape)));
    };
    let mut offsets: Vec<&[u64]> = Vec::with_capacity(o.shards.len());
    for s in &o.shards {
        let what = || format!("shard {:?}", s.offset);
        if s.offset.len() != ndim || s.offset.iter().zip(&o.global_shape).any(|(&i, &n)| i >= n) {
            return Err(invalid(format!("{} lies outside the grid {:?}", what(), o.global_shape)));
        }
        check_bytes(files, s.file, s.byte_offset, s.len, &what)?;
        offsets.push(&s.offset);
    }
    offsets.sort_unstable();
    if let Some(w) = offsets.windows(2).find(|w| w[0] == w[1]) {
        return Err(invalid(format!("shard {:?} stored twice", w[0])));
    }
    if offsets.len() as u64 != cells {
        let missing = first_missing_cell(&o.global_shape, &offsets);
        return Err(Fault {
            reason: format!("{} of {cells} shards stored; shard {missing:?} is missing", offsets.len()),
            uncovered: true,
        });
    }
    Ok(())
}

/// The first grid cell, in row-major order, not among `sorted` (distinct, in bounds, fewer than
/// the cells).
fn first_missing_cell(grid: &[u64], sorted: &[&[u64]]) -> Vec<u64> {
    let mut cell = vec![0u64; grid.len()];
    for have in sorted {
        if *have != cell.as_slice() {
            return cell;
        }
        // Next cell in row-major order.
        for d in (0..grid.len()).rev() {
            cell[d] += 1;
            if cell[d] < grid[d] {
                break;
            }
            cell[d] = 0;
        }
    }
    cell
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::StoredChunk;
    use crate::model::dtype::DType;
    use crate::model::Value;

    fn file(size: u64) -> FileEntry {
        FileEntry { name: "data_0.safetensors".into(), size, header_len: 8, header_crc: 0 }
    }

    fn chunk(offset: &[u64], shape: &[u64], byte_offset: u64) -> StoredChunk {
        StoredChunk {
            file: 0,
            byte_offset,
            offset: offset.into(),
            shape: shape.into(),
            flat: None,
            crcs: vec![0].into(),
        }
    }

    fn index(tensors: Vec<TensorEntry>) -> CheckpointIndex {
        CheckpointIndex {
            backend: crate::format::Backend::Tessera,
            version: 2,
            block_size: 1 << 20,
            content_metadata: Value::Null,
            common: Vec::new(),
            files: vec![file(8 + 64)],
            tensors,
            objects: Vec::new(),
            omitted_tensors: Vec::new(),
        }
    }

    fn one(chunks: Vec<StoredChunk>, shape: &[u64]) -> CheckpointIndex {
        index(vec![TensorEntry::new("w".into(), DType::F32, shape.to_vec(), chunks)])
    }

    #[test]
    fn a_tiled_tensor_passes() {
        let ix = one(vec![chunk(&[0, 0], &[2, 4], 8), chunk(&[2, 0], &[2, 4], 40)], &[4, 4]);
        assert_eq!(index_defects(&ix), vec![]);
        validate_index(&ix, "x").unwrap();
    }

    #[test]
    fn overlapping_chunks_are_refused_even_with_a_gap_elsewhere() {
        // Rows 0..2 twice and rows 3..4 stored by nobody: the overlap decides.
        let ix = one(vec![chunk(&[0, 0], &[2, 4], 8), chunk(&[1, 0], &[2, 4], 40)], &[4, 4]);
        let e = validate_index(&ix, "ck/tessera.index").unwrap_err();
        assert!(
            matches!(&e, Error::Corrupt { reason, .. } if reason.contains("overlap") && reason.contains("\"w\"")),
            "{e}"
        );
    }

    #[test]
    fn a_gap_passes_the_gate_and_is_reported() {
        let ix = one(vec![chunk(&[0, 0], &[2, 4], 8)], &[4, 4]);
        validate_index(&ix, "x").unwrap();
        let d = index_defects(&ix);
        assert_eq!(d.len(), 1);
        assert!(d[0].uncovered && d[0].reason.contains("[2, 0]"), "{d:?}");
    }

    #[test]
    fn element_counts_that_wrap_are_refused() {
        let ix = one(vec![chunk(&[0, 0], &[1, 1], 8)], &[1 << 32, 1 << 32]);
        let e = validate_index(&ix, "x").unwrap_err();
        assert!(matches!(&e, Error::Corrupt { reason, .. } if reason.contains("2^64")), "{e}");
    }

    #[test]
    fn chunks_outside_the_tensor_or_file_are_refused() {
        for (c, want) in [
            (chunk(&[3, 0], &[2, 4], 8), "outside the global shape"),
            (chunk(&[u64::MAX, 0], &[2, 4], 8), "outside the global shape"),
            (chunk(&[0, 0], &[4, 4], 16), "outside the data"),
            (chunk(&[0, 0], &[4, 4], 0), "outside the data"),
            (chunk(&[0, 0], &[4, 4], u64::MAX - 3), "overflows"),
            (StoredChunk { file: 7, ..chunk(&[0, 0], &[4, 4], 8) }, "names file #7"),
            (StoredChunk { crcs: Vec::new().into(), ..chunk(&[0, 0], &[4, 4], 8) }, "checksums"),
            (StoredChunk { flat: Some((3, 17)), ..chunk(&[0, 0], &[4, 4], 8) }, "flat range"),
            (StoredChunk { shape: [4].as_slice().into(), ..chunk(&[0, 0], &[4, 4], 8) }, "dimensions"),
        ] {
            let e = validate_index(&one(vec![c], &[4, 4]), "x").unwrap_err();
            assert!(matches!(&e, Error::Corrupt { reason, .. } if reason.contains(want)), "{want}: {e}");
        }
    }

    #[test]
    fn unsorted_keys_and_bad_file_names_are_refused() {
        let mut ix = index(vec![
            TensorEntry::new("b".into(), DType::F32, vec![], vec![chunk(&[], &[], 8)]),
            TensorEntry::new("a".into(), DType::F32, vec![], vec![chunk(&[], &[], 12)]),
        ]);
        assert!(validate_index(&ix, "x").unwrap_err().to_string().contains("sorted"));
        ix.tensors.swap(0, 1);
        validate_index(&ix, "x").unwrap();
        ix.files[0].name = "../outside".into();
        assert!(matches!(validate_index(&ix, "x").unwrap_err(), Error::Corrupt { .. }));
    }

    #[test]
    fn chunks_sharing_file_bytes_are_refused() {
        // Two tiling chunks, the second pointing into the first's bytes.
        let ix = one(vec![chunk(&[0, 0], &[2, 4], 8), chunk(&[2, 0], &[2, 4], 24)], &[4, 4]);
        let e = validate_index(&ix, "x").unwrap_err();
        assert!(
            matches!(&e, Error::Corrupt { reason, .. } if reason.contains("are also those of tensor \"w\"")),
            "{e}"
        );
    }

    #[test]
    fn object_shards_are_checked() {
        use crate::format::StoredObject;
        let shard = |offset: Vec<u64>| StoredObject { offset, file: 0, byte_offset: 8, len: 4, crc: 0 };
        let mut ix = index(vec![]);
        ix.objects = vec![ObjectEntry { key: "o".into(), global_shape: vec![2, 2], shards: vec![shard(vec![0, 0])] }];
        let d = index_defects(&ix);
        assert!(d.len() == 1 && d[0].uncovered && d[0].reason.contains("[0, 1]"), "{d:?}");
        ix.objects[0].shards.push(shard(vec![0, 0]));
        assert!(validate_index(&ix, "x").unwrap_err().to_string().contains("twice"));
        ix.objects[0].shards[1] = shard(vec![0, 2]);
        assert!(validate_index(&ix, "x").unwrap_err().to_string().contains("outside the grid"));
    }
}
