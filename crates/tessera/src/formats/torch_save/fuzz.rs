//! Entry points of the `zip` fuzz target (feature `fuzzing`): the zip and `torch.save` parsers
//! as the readers call them, returning plain data.

use super::{crc_mismatch, decode_archive, find_central_directory, find_entry, gather, limits, local_header_len};
use super::{parse_central_directory, tensor_record, zip_entries as entries};
use crate::formats::pickle::{self, PickleValue};

/// Zip entries: name, offset (of the data, or of the local header), size.
pub type ZipEntries = Vec<(String, u64, u64)>;

/// Every entry of a whole zip archive: `(name, data offset, size)`.
pub fn zip_entries(archive: &[u8]) -> Result<ZipEntries, String> {
    Ok(entries(archive)?.into_iter().map(|e| (e.name, e.data_offset, e.size)).collect())
}

/// The ranged zip path of the DCP reader: the central directory found from the last bytes
/// `tail` of an `archive_len`-byte archive, then parsed when it lies inside `tail`:
/// `(name, local header offset, size)` per entry.
pub fn zip_tail(tail: &[u8], archive_len: u64) -> Result<Option<ZipEntries>, String> {
    let Some((off, size, count)) = find_central_directory(tail, archive_len)? else { return Ok(None) };
    let base = archive_len - tail.len() as u64;
    if off < base {
        return Ok(None);
    }
    let cd = &tail[(off - base) as usize..(off - base + size) as usize];
    let entries = parse_central_directory(cd, count, archive_len)?;
    for e in &entries {
        if let Some(at) = e.local_offset.checked_sub(base) {
            let _ = local_header_len(tail.get(at as usize..).unwrap_or(&[]));
        }
    }
    Ok(Some(entries.into_iter().map(|e| (e.name, e.local_offset, e.size)).collect()))
}

/// How many members of a whole zip archive have data that does not match their CRC-32.
pub fn zip_crc_mismatches(archive: &[u8]) -> Result<usize, String> {
    let entries = entries(archive)?;
    Ok(entries.iter().filter(|e| crc_mismatch(archive, e).is_some()).count())
}

/// A whole `torch.save` archive decoded as the object readers do.
pub fn torch_save(archive: &[u8]) -> Result<PickleValue, String> {
    decode_archive(archive, "fuzz.pt")
}

/// A `torch.save` of one tensor decoded as a DCP tensor item is: its C-order bytes.
pub fn torch_save_tensor(archive: &[u8]) -> Result<Vec<u8>, String> {
    let entries = entries(archive)?;
    let pkl = find_entry(&entries, "data.pkl").ok_or("no data.pkl")?;
    let v = pickle::unpickle(
        &archive[pkl.data_offset as usize..(pkl.data_offset + pkl.size) as usize],
        "fuzz.pt",
        &limits(),
    )
    .map_err(|e| e.to_string())?;
    let rec = tensor_record(&v)?;
    let e = find_entry(&entries, &format!("data/{}", rec.storage_key)).ok_or("no storage entry")?;
    gather(&archive[e.data_offset as usize..(e.data_offset + e.size) as usize], &rec)
}
