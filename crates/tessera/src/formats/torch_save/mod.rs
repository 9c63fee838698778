//! `torch.save` archives as PyTorch writes them: a zip of stored (uncompressed) entries under
//! one top folder — `data.pkl` (the pickled object, tensors as persistent ids naming storages),
//! `data/<key>` (raw little-endian storage bytes, 64-byte aligned), and small version entries.
//! Pure byte parsing: the caller reads the bytes.

#[cfg(feature = "fuzzing")]
pub(crate) mod fuzz;
pub(crate) mod write;

use crate::formats::pickle::{unpickle, PickleValue, UnpickleLimits};
use crate::model::dims::check_axes;
use crate::model::dtype::DType;

/// One entry of a zip archive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ZipEntry {
    /// Full name inside the archive (`archive/data/0`).
    pub name: String,
    /// Offset of the entry's data from the start of the archive.
    pub data_offset: u64,
    /// Size of the stored data.
    pub size: u64,
    /// The CRC-32 (IEEE) the central directory records for the data.
    pub crc: u32,
}

impl ZipEntry {
    /// The name without its top folder (`data/0`, `data.pkl`).
    pub fn inner_name(&self) -> &str {
        inner_name(&self.name)
    }
}

/// An archive entry's name without its top folder (torch.save puts every entry under one).
pub(crate) fn inner_name(name: &str) -> &str {
    name.split_once('/').map_or(name, |(_, rest)| rest)
}

const LOCAL_SIG: u32 = 0x0403_4b50;
const CENTRAL_SIG: u32 = 0x0201_4b50;
const EOCD_SIG: u32 = 0x0605_4b50;
const EOCD64_SIG: u32 = 0x0606_4b50;
const EOCD64_LOCATOR_SIG: u32 = 0x0706_4b50;

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    b.get(at..at.checked_add(2)?).map(|s| u16::from_le_bytes([s[0], s[1]]))
}
fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    b.get(at..at.checked_add(4)?).map(|s| u32::from_le_bytes(s.try_into().unwrap()))
}
fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    b.get(at..at.checked_add(8)?).map(|s| u64::from_le_bytes(s.try_into().unwrap()))
}

/// Values of the zip64 extra field (id 1) that replace the 32-bit fields set to 0xFFFFFFFF, in
/// the order the format defines: uncompressed size, compressed size, local header offset.
fn zip64_values(extra: &[u8], wanted: usize) -> Result<Vec<u64>, String> {
    let mut at = 0;
    while at + 4 <= extra.len() {
        let id = u16_at(extra, at).unwrap();
        let len = u16_at(extra, at + 2).unwrap() as usize;
        let body = extra.get(at + 4..at + 4 + len).ok_or("zip extra field runs past its header")?;
        if id == 1 {
            return (0..wanted).map(|i| u64_at(body, i * 8).ok_or_else(|| "short zip64 extra field".into())).collect();
        }
        at += 4 + len;
    }
    if wanted == 0 {
        Ok(Vec::new())
    } else {
        Err("zip64 sizes announced but no zip64 extra field".into())
    }
}

/// Resolves the (compressed size, uncompressed size, offset) triple of a header whose 32-bit
/// fields may defer to the zip64 extra field.
fn resolve64(csize: u32, usize_: u32, offset: Option<u32>, extra: &[u8]) -> Result<(u64, u64, u64), String> {
    let big = |v: u32| v == u32::MAX;
    let wanted = big(usize_) as usize + big(csize) as usize + offset.is_some_and(big) as usize;
    let vals = zip64_values(extra, wanted)?;
    let mut it = vals.into_iter();
    let u = if big(usize_) { it.next().unwrap() } else { usize_ as u64 };
    let c = if big(csize) { it.next().unwrap() } else { csize as u64 };
    let o = match offset {
        Some(o) if big(o) => it.next().unwrap(),
        Some(o) => o as u64,
        None => 0,
    };
    Ok((c, u, o))
}

/// Where a zip's central directory is: `(offset, size, entry count)`, from the archive's last
/// bytes `tail` (which end at byte `archive_len` of the archive). `Ok(None)` if a record it
/// needs (zip64) lies before `tail`.
pub(crate) fn find_central_directory(tail: &[u8], archive_len: u64) -> Result<Option<(u64, u64, u64)>, String> {
    let min_eocd = 22;
    if tail.len() < min_eocd {
        return Err(format!("{} bytes is too short for a zip archive", tail.len()));
    }
    let base = archive_len.checked_sub(tail.len() as u64).ok_or("tail longer than the archive")?;
    // The end record sits in the last 22 + 65535 bytes (its comment may follow it).
    let lo = tail.len().saturating_sub(min_eocd + 0xFFFF);
    let eocd = (lo..=tail.len() - min_eocd)
        .rev()
        .find(|&i| u32_at(tail, i) == Some(EOCD_SIG))
        .ok_or("no zip end-of-central-directory record (truncated?)")?;
    let mut count = u16_at(tail, eocd + 10).unwrap() as u64;
    let mut cd_size = u32_at(tail, eocd + 12).unwrap() as u64;
    let mut cd_off = u32_at(tail, eocd + 16).unwrap() as u64;
    if count == 0xFFFF || cd_size == u32::MAX as u64 || cd_off == u32::MAX as u64 {
        let Some(loc) = eocd.checked_sub(20) else { return Ok(None) };
        if u32_at(tail, loc) != Some(EOCD64_LOCATOR_SIG) {
            return Err("zip64 locator missing".into());
        }
        let rec = u64_at(tail, loc + 8).unwrap();
        let Some(rec) = rec.checked_sub(base) else { return Ok(None) };
        let rec = usize::try_from(rec).map_err(|_| "zip64 record offset out of range")?;
        if u32_at(tail, rec) != Some(EOCD64_SIG) {
            return Err("zip64 end record missing".into());
        }
        count = u64_at(tail, rec + 32).ok_or("short zip64 end record")?;
        cd_size = u64_at(tail, rec + 40).ok_or("short zip64 end record")?;
        cd_off = u64_at(tail, rec + 48).ok_or("short zip64 end record")?;
    }
    if cd_off.checked_add(cd_size).is_none_or(|e| e > archive_len) {
        return Err("central directory out of bounds".into());
    }
    if count > cd_size / 46 + 1 {
        return Err(format!("{count} entries cannot fit a {cd_size}-byte central directory"));
    }
    Ok(Some((cd_off, cd_size, count)))
}

/// An entry as the central directory lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CentralEntry {
    pub name: String,
    /// Offset of the entry's local header in the archive.
    pub local_offset: u64,
    /// Stored size.
    pub size: u64,
    /// The CRC-32 (IEEE) of the data, as recorded here.
    pub crc: u32,
}

/// Parses `count` central directory headers; checks names are unique and entries stored.
pub(crate) fn parse_central_directory(cd: &[u8], count: u64, archive_len: u64) -> Result<Vec<CentralEntry>, String> {
    let mut out = Vec::with_capacity(count.min(1 << 16) as usize);
    let mut at = 0usize;
    for _ in 0..count {
        if u32_at(cd, at) != Some(CENTRAL_SIG) || at + 46 > cd.len() {
            return Err(format!("bad central directory header at {at}"));
        }
        let method = u16_at(cd, at + 10).unwrap();
        let crc = u32_at(cd, at + 16).unwrap();
        let csize = u32_at(cd, at + 20).unwrap();
        let usize_ = u32_at(cd, at + 24).unwrap();
        let nlen = u16_at(cd, at + 28).unwrap() as usize;
        let xlen = u16_at(cd, at + 30).unwrap() as usize;
        let clen = u16_at(cd, at + 32).unwrap() as usize;
        let local = u32_at(cd, at + 42).unwrap();
        let name = cd.get(at + 46..at + 46 + nlen).ok_or("central directory name out of bounds")?;
        let extra = cd.get(at + 46 + nlen..at + 46 + nlen + xlen).ok_or("central directory extra out of bounds")?;
        let name = String::from_utf8_lossy(name).into_owned();
        if method != 0 {
            return Err(format!("zip entry {name:?} is compressed (method {method}); torch.save stores entries"));
        }
        let (c, u, local) = resolve64(csize, usize_, Some(local), extra)?;
        if c != u {
            return Err(format!("zip entry {name:?}: stored sizes differ ({c} vs {u})"));
        }
        if local.checked_add(30 + u).is_none_or(|e| e > archive_len) {
            return Err(format!("zip entry {name:?}: data runs past the archive end"));
        }
        out.push(CentralEntry { name, local_offset: local, size: u, crc });
        at += 46 + nlen + xlen + clen;
    }
    let mut names: Vec<&str> = out.iter().map(|e| e.name.as_str()).collect();
    names.sort_unstable();
    if names.windows(2).any(|w| w[0] == w[1]) {
        return Err("duplicate zip entry names".into());
    }
    Ok(out)
}

/// Length of the local header at the start of `header` (30 bytes + name + extra), which tells
/// where the entry's data starts. `Ok(None)` if `header` is shorter than 30 bytes.
pub(crate) fn local_header_len(header: &[u8]) -> Result<Option<u64>, String> {
    if header.len() < 30 {
        return Ok(None);
    }
    if u32_at(header, 0) != Some(LOCAL_SIG) {
        return Err("no zip local header where the central directory points".into());
    }
    Ok(Some(30 + u16_at(header, 26).unwrap() as u64 + u16_at(header, 28).unwrap() as u64))
}

/// Every entry of a whole archive, from its central directory (zip64 included), with the
/// offset of each entry's data.
pub(crate) fn zip_entries(archive: &[u8]) -> Result<Vec<ZipEntry>, String> {
    let len = archive.len() as u64;
    let (cd_off, cd_size, count) = find_central_directory(archive, len)?.ok_or("zip64 records out of place")?;
    let cd = &archive[cd_off as usize..(cd_off + cd_size) as usize];
    let mut out = Vec::new();
    for e in parse_central_directory(cd, count, len)? {
        let at = e.local_offset as usize;
        let hl =
            local_header_len(&archive[at..])?.ok_or_else(|| format!("zip entry {:?}: short local header", e.name))?;
        let data_offset = e.local_offset + hl;
        if data_offset.checked_add(e.size).is_none_or(|x| x > len) {
            return Err(format!("zip entry {:?}: data runs past the archive end", e.name));
        }
        out.push(ZipEntry { name: e.name, data_offset, size: e.size, crc: e.crc });
    }
    Ok(out)
}

pub(crate) use write::{crc32, crc32_update};

/// Why the data of `entry` does not match the CRC-32 its central directory records (`None`
/// when it does). The data is the entry's bytes as `zip_entries` located them in `archive`.
pub(crate) fn crc_mismatch(archive: &[u8], entry: &ZipEntry) -> Option<String> {
    let data = &archive[entry.data_offset as usize..(entry.data_offset + entry.size) as usize];
    let got = crc32(data);
    (got != entry.crc).then(|| mismatch_message(&entry.name, got, entry.crc))
}

/// The message of a member whose data has CRC-32 `got` where `want` is recorded.
pub(crate) fn mismatch_message(member: &str, got: u32, want: u32) -> String {
    format!("zip member {member:?}: its data has CRC-32 {got:08x}, the archive records {want:08x} (damaged bytes)")
}

/// The entry whose name below the top folder is `inner` (`data.pkl`, `data/0`).
pub(crate) fn find_entry<'e>(entries: &'e [ZipEntry], inner: &str) -> Option<&'e ZipEntry> {
    entries.iter().find(|e| e.inner_name() == inner)
}

/// A tensor as `torch._utils._rebuild_tensor_v2` describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TensorRecord {
    /// Storage key: the entry `data/<key>`.
    pub storage_key: String,
    /// Element type (from the storage class, or the explicit dtype of `_rebuild_tensor_v3`).
    pub dtype: DType,
    /// Offset into the storage, in elements.
    pub storage_offset: u64,
    /// Shape.
    pub size: Vec<u64>,
    /// Strides, in elements.
    pub stride: Vec<u64>,
}

impl TensorRecord {
    /// Whether the elements lie in C order without gaps (size-1 axes may have any stride).
    pub fn is_contiguous(&self) -> bool {
        let mut expect = 1u64;
        for (&n, &s) in self.size.iter().zip(&self.stride).rev() {
            if n != 1 && s != expect {
                return false;
            }
            expect = expect.saturating_mul(n);
        }
        true
    }

    /// Number of elements.
    pub fn numel(&self) -> u64 {
        // Saturating: a hostile shape must not overflow (a zero axis still gives 0).
        if self.size.contains(&0) {
            return 0;
        }
        self.size.iter().fold(1u64, |a, &n| a.saturating_mul(n))
    }

    /// One past the largest storage element the tensor touches (0 if it has none).
    pub fn storage_extent(&self) -> Option<u64> {
        if self.numel() == 0 {
            return Some(0);
        }
        let mut last = self.storage_offset;
        for (&n, &s) in self.size.iter().zip(&self.stride) {
            last = last.checked_add((n - 1).checked_mul(s)?)?;
        }
        last.checked_add(1)
    }
}

/// The dtype a `torch.*Storage` class name stands for.
pub(crate) fn storage_dtype(name: &str) -> Option<DType> {
    Some(match name {
        "FloatStorage" => DType::F32,
        "DoubleStorage" => DType::F64,
        "HalfStorage" => DType::F16,
        "BFloat16Storage" => DType::BF16,
        "LongStorage" => DType::I64,
        "IntStorage" => DType::I32,
        "ShortStorage" => DType::I16,
        "CharStorage" => DType::I8,
        "ByteStorage" => DType::U8,
        "BoolStorage" => DType::Bool,
        "UInt16Storage" => DType::U16,
        "UInt32Storage" => DType::U32,
        "UInt64Storage" => DType::U64,
        "Float8_e4m3fnStorage" => DType::F8E4M3,
        "Float8_e5m2Storage" => DType::F8E5M2,
        _ => return None,
    })
}

/// The dtype a `torch.<name>` global stands for.
pub(crate) fn torch_dtype(name: &str) -> Option<DType> {
    Some(match name {
        "float32" | "float" => DType::F32,
        "float64" | "double" => DType::F64,
        "float16" | "half" => DType::F16,
        "bfloat16" => DType::BF16,
        "int64" | "long" => DType::I64,
        "int32" | "int" => DType::I32,
        "int16" | "short" => DType::I16,
        "int8" => DType::I8,
        "uint8" => DType::U8,
        "uint16" => DType::U16,
        "uint32" => DType::U32,
        "uint64" => DType::U64,
        "bool" => DType::Bool,
        "float8_e4m3fn" => DType::F8E4M3,
        "float8_e5m2" => DType::F8E5M2,
        _ => return None,
    })
}

pub(crate) fn as_u64(v: &PickleValue) -> Option<u64> {
    match v {
        PickleValue::Int(i) => u64::try_from(*i).ok(),
        PickleValue::Bool(b) => Some(*b as u64),
        _ => None,
    }
}

pub(crate) fn as_dims(v: &PickleValue) -> Option<Vec<u64>> {
    match v {
        PickleValue::Tuple(xs) | PickleValue::List(xs) => xs.iter().map(as_u64).collect(),
        _ => None,
    }
}

/// Reads a rebuilt tensor: `_rebuild_tensor_v2`/`_v3` (possibly wrapped by `_rebuild_parameter`).
pub(crate) fn tensor_record(v: &PickleValue) -> Result<TensorRecord, String> {
    let PickleValue::Object(o) = v else { return Err(format!("expected a tensor, found {}", describe(v))) };
    match (o.module.as_str(), o.name.as_str()) {
        ("torch._utils", "_rebuild_parameter") | ("torch._utils", "_rebuild_parameter_with_state") => {
            return tensor_record(o.args.first().ok_or("_rebuild_parameter without arguments")?)
        }
        ("torch._utils", "_rebuild_tensor_v2") | ("torch._utils", "_rebuild_tensor_v3") => {}
        (m, n) => return Err(format!("expected a tensor, found a call to {m}.{n}")),
    }
    let arg = |i: usize| o.args.get(i).ok_or_else(|| format!("{} has only {} arguments", o.name, o.args.len()));
    let PickleValue::PersistentId(pid) = arg(0)? else { return Err("tensor storage is not a persistent id".into()) };
    let PickleValue::Tuple(pid) = pid.as_ref() else { return Err("storage persistent id is not a tuple".into()) };
    let (Some(PickleValue::Str(kind)), Some(class), Some(PickleValue::Str(key))) =
        (pid.first(), pid.get(1), pid.get(2))
    else {
        return Err("storage persistent id is not ('storage', class, key, …)".into());
    };
    if kind != "storage" {
        return Err(format!("persistent id of kind {kind:?}, expected 'storage'"));
    }
    let mut dtype = match class {
        PickleValue::Global { name, .. } => storage_dtype(name),
        _ => None,
    };
    if o.name == "_rebuild_tensor_v3" {
        if let Some(PickleValue::Global { module, name }) = o.args.get(6) {
            if module == "torch" {
                dtype = torch_dtype(name);
            }
        }
    }
    let dtype = dtype.ok_or_else(|| format!("unsupported tensor storage {}", describe(class)))?;
    let storage_offset = as_u64(arg(1)?).ok_or("storage offset is not an int")?;
    let size = as_dims(arg(2)?).ok_or("tensor size is not a tuple of ints")?;
    check_axes(size.len()).map_err(|e| format!("tensor size has {e}"))?;
    let stride = as_dims(arg(3)?).ok_or("tensor stride is not a tuple of ints")?;
    if size.len() != stride.len() {
        return Err(format!("size {size:?} and stride {stride:?} differ in rank"));
    }
    Ok(TensorRecord { storage_key: key.clone(), dtype, storage_offset, size, stride })
}

/// A short description of a value for error messages.
pub(crate) fn describe(v: &PickleValue) -> String {
    match v {
        PickleValue::Global { module, name } => format!("{module}.{name}"),
        PickleValue::Object(o) => format!("an object of {}.{}", o.module, o.name),
        PickleValue::None => "None".into(),
        PickleValue::Dict(_) => "a dict".into(),
        PickleValue::List(_) => "a list".into(),
        PickleValue::Tuple(_) => "a tuple".into(),
        other => format!("{other:?}").chars().take(60).collect(),
    }
}

/// Limits for pickles inside checkpoints: generous for metadata of huge jobs, still bounded.
pub(crate) fn limits() -> UnpickleLimits {
    UnpickleLimits::default()
}

/// Decodes the object a whole `torch.save` archive holds (tensors stay `_rebuild_tensor_v2`
/// objects; their bytes are not read).
pub(crate) fn decode_archive(archive: &[u8], origin: &str) -> Result<PickleValue, String> {
    let entries = zip_entries(archive)?;
    let pkl = find_entry(&entries, "data.pkl").ok_or("no data.pkl in the torch.save archive")?;
    let bytes = &archive[pkl.data_offset as usize..(pkl.data_offset + pkl.size) as usize];
    unpickle(bytes, origin, &limits()).map_err(|e| e.to_string())
}

/// How many bytes a tensor whose strides overlap may hold beyond its storage's size.
pub(crate) const STRIDED_SLACK: u64 = 16 << 20;

/// Copies the elements of `t` out of its storage bytes in C order.
pub(crate) fn gather(storage: &[u8], t: &TensorRecord) -> Result<Vec<u8>, String> {
    let es = t.dtype.size() as u64;
    let extent = t.storage_extent().ok_or("tensor extent overflows")?;
    if extent.checked_mul(es).is_none_or(|b| b > storage.len() as u64) {
        return Err(format!("tensor needs {extent} elements of a {}-byte storage", storage.len()));
    }
    let numel = t.numel();
    if numel == 0 {
        // An empty tensor reads nothing, whatever its storage offset says (the fuzzer's find:
        // an empty tensor at an offset past its empty storage was sliced there).
        return Ok(Vec::new());
    }
    // Overlapping strides (stride 0, `as_strided`) make a tensor larger than its storage: the
    // copy is bounded by what is stored, plus a little for small expanded tensors.
    let nbytes = numel.checked_mul(es).ok_or("tensor size overflows")?;
    if nbytes > (storage.len() as u64).saturating_add(STRIDED_SLACK) {
        return Err(format!(
            "a strided tensor of {nbytes} bytes over a {}-byte storage (overlapping strides expand it past what is stored)",
            storage.len()
        ));
    }
    if t.is_contiguous() {
        let at = (t.storage_offset * es) as usize;
        return Ok(storage[at..at + (numel * es) as usize].to_vec());
    }
    let mut out = Vec::with_capacity((numel * es) as usize);
    let nd = t.size.len();
    let mut idx = vec![0u64; nd];
    for _ in 0..numel {
        let el = t.storage_offset + idx.iter().zip(&t.stride).map(|(i, s)| i * s).sum::<u64>();
        let at = (el * es) as usize;
        out.extend_from_slice(&storage[at..at + es as usize]);
        for d in (0..nd).rev() {
            idx[d] += 1;
            if idx[d] < t.size[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored_zip(entries: &[(&str, &[u8])]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut central = Vec::new();
        for (name, data) in entries {
            let off = out.len() as u32;
            let crc = 0u32;
            out.extend_from_slice(&LOCAL_SIG.to_le_bytes());
            out.extend_from_slice(&[20, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
            out.extend_from_slice(&crc.to_le_bytes());
            out.extend_from_slice(&(data.len() as u32).to_le_bytes());
            out.extend_from_slice(&(data.len() as u32).to_le_bytes());
            out.extend_from_slice(&(name.len() as u16).to_le_bytes());
            out.extend_from_slice(&0u16.to_le_bytes());
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(data);
            central.extend_from_slice(&CENTRAL_SIG.to_le_bytes());
            central.extend_from_slice(&[20, 0, 20, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
            central.extend_from_slice(&crc.to_le_bytes());
            central.extend_from_slice(&(data.len() as u32).to_le_bytes());
            central.extend_from_slice(&(data.len() as u32).to_le_bytes());
            central.extend_from_slice(&(name.len() as u16).to_le_bytes());
            central.extend_from_slice(&[0; 12]);
            central.extend_from_slice(&off.to_le_bytes());
            central.extend_from_slice(name.as_bytes());
        }
        let cd_off = out.len() as u32;
        out.extend_from_slice(&central);
        out.extend_from_slice(&EOCD_SIG.to_le_bytes());
        out.extend_from_slice(&[0, 0, 0, 0]);
        out.extend_from_slice(&(entries.len() as u16).to_le_bytes());
        out.extend_from_slice(&(entries.len() as u16).to_le_bytes());
        out.extend_from_slice(&(central.len() as u32).to_le_bytes());
        out.extend_from_slice(&cd_off.to_le_bytes());
        out.extend_from_slice(&[0, 0]);
        out
    }

    #[test]
    fn entries_from_the_central_directory() {
        let z = stored_zip(&[("archive/data.pkl", b"abc"), ("archive/data/0", &[1, 2, 3, 4])]);
        let entries = zip_entries(&z).unwrap();
        assert_eq!(entries.len(), 2);
        let e = find_entry(&entries, "data/0").unwrap();
        assert_eq!(&z[e.data_offset as usize..][..4], &[1, 2, 3, 4]);
        // From the last bytes only: the directory is found and parsed the same way.
        let len = z.len() as u64;
        let (off, size, count) = find_central_directory(&z[z.len() - 100..], len).unwrap().unwrap();
        let cd = parse_central_directory(&z[off as usize..(off + size) as usize], count, len).unwrap();
        assert_eq!(cd[1].name, "archive/data/0");
        let hl = local_header_len(&z[cd[1].local_offset as usize..]).unwrap().unwrap();
        assert_eq!(cd[1].local_offset + hl, e.data_offset);
        assert_eq!(local_header_len(&z[..10]).unwrap(), None);
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let z = stored_zip(&[("a/data.pkl", b"xyz"), ("a/data/0", &[9; 10])]);
        for cut in 0..z.len() {
            assert!(zip_entries(&z[..cut]).is_err(), "cut at {cut}");
            let _ = find_central_directory(&z[cut..], z.len() as u64);
        }
        let mut flipped = z.clone();
        for i in 0..flipped.len() {
            flipped[i] ^= 0xFF;
            let _ = zip_entries(&flipped);
            flipped[i] ^= 0xFF;
        }
    }

    #[test]
    fn gather_follows_strides() {
        // A 2x3 int8-sized view transposed from a 3x2 storage.
        let storage: Vec<u8> = (0..6).collect();
        let t = TensorRecord {
            storage_key: "0".into(),
            dtype: DType::U8,
            storage_offset: 0,
            size: vec![2, 3],
            stride: vec![1, 2],
        };
        assert!(!t.is_contiguous());
        assert_eq!(gather(&storage, &t).unwrap(), vec![0, 2, 4, 1, 3, 5]);
        let c = TensorRecord { size: vec![1, 3], stride: vec![99, 1], storage_offset: 2, ..t.clone() };
        assert!(c.is_contiguous());
        assert_eq!(gather(&storage, &c).unwrap(), vec![2, 3, 4]);
        let past = TensorRecord { storage_offset: 5, ..c };
        assert!(gather(&storage, &past).is_err());
    }

    #[test]
    fn an_empty_tensor_past_its_storage_gathers_nothing() {
        // Size (0, 4) at storage offset 4 of an empty f32 storage: torch reads no element.
        let t = TensorRecord {
            storage_key: "0".into(),
            dtype: DType::F32,
            storage_offset: 4,
            size: vec![0, 4],
            stride: vec![4, 1],
        };
        assert_eq!(gather(&[], &t).unwrap(), Vec::<u8>::new());
    }
}
