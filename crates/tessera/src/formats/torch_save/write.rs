//! Writing `torch.save` archives (the layout `format/torch_save.rs` reads): a zip of stored
//! entries under one top folder, every entry's data 64-byte aligned (padding in a `FB` extra
//! field, as PyTorch's writer does), CRC-32 and sizes in the local headers, zip64 records
//! where a size or offset needs them. Pure: the tensor's bytes are not copied here — the
//! caller gets the bytes before and after them and writes the data itself, in place.
//!
//! torch checks the entries' CRC-32 when it reads them, so the data's checksum is an input.

use crate::formats::pickle::write::{pickle, Pk};
use crate::model::dtype::DType;

/// Entry order and contents as `torch.save` (format version 1, serialization version 3) writes.
const FORMAT_VERSION: &[u8] = b"1";
const STORAGE_ALIGNMENT: &[u8] = b"64";
const BYTEORDER: &[u8] = b"little";
const VERSION: &[u8] = b"3\n";
/// Alignment of every entry's data (what `.storage_alignment` promises).
const ALIGN: u64 = 64;
/// Top folder of every archive tessera writes (torch reads any single folder name).
const TOP: &str = "archive";

/// Sizes and offsets from this one on are written as zip64.
const ZIP64_AT: u64 = u32::MAX as u64;

/// CRC-32 (IEEE 802.3, the zip checksum), slicing by 8.
pub(crate) fn crc32(data: &[u8]) -> u32 {
    crc32_update(0, data)
}

/// Continues a CRC-32 computed so far as `crc` over `data`.
pub(crate) fn crc32_update(crc: u32, data: &[u8]) -> u32 {
    let mut c = !crc;
    let mut chunks = data.chunks_exact(8);
    for b in &mut chunks {
        let lo = c ^ u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        let t = &CRC_TABLES;
        c = t[7][(lo & 0xff) as usize]
            ^ t[6][((lo >> 8) & 0xff) as usize]
            ^ t[5][((lo >> 16) & 0xff) as usize]
            ^ t[4][(lo >> 24) as usize]
            ^ t[3][b[4] as usize]
            ^ t[2][b[5] as usize]
            ^ t[1][b[6] as usize]
            ^ t[0][b[7] as usize];
    }
    for &b in chunks.remainder() {
        c = CRC_TABLES[0][((c ^ b as u32) & 0xff) as usize] ^ (c >> 8);
    }
    !c
}

static CRC_TABLES: [[u32; 256]; 8] = crc_tables();

const fn crc_tables() -> [[u32; 256]; 8] {
    let mut t = [[0u32; 256]; 8];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 { 0xEDB8_8320 ^ (c >> 1) } else { c >> 1 };
            k += 1;
        }
        t[0][i] = c;
        i += 1;
    }
    let mut s = 1;
    while s < 8 {
        let mut i = 0;
        while i < 256 {
            let prev = t[s - 1][i];
            t[s][i] = (prev >> 8) ^ t[0][(prev & 0xff) as usize];
            i += 1;
        }
        s += 1;
    }
    t
}

struct CentralRecord {
    name: String,
    crc: u32,
    size: u64,
    offset: u64,
}

/// Builds one archive. Entries added with [`ZipBuilder::add_external`] are laid out but their
/// data is not held: bytes before it go to `prefix`, after it to `suffix` (one external entry).
struct ZipBuilder {
    prefix: Vec<u8>,
    suffix: Option<Vec<u8>>,
    pos: u64,
    central: Vec<CentralRecord>,
    zip64_at: u64,
}

impl ZipBuilder {
    fn new(zip64_at: u64) -> Self {
        ZipBuilder { prefix: Vec::new(), suffix: None, pos: 0, central: Vec::new(), zip64_at }
    }

    fn out(&mut self) -> &mut Vec<u8> {
        self.suffix.as_mut().unwrap_or(&mut self.prefix)
    }

    fn emit(&mut self, bytes: &[u8]) {
        self.pos += bytes.len() as u64;
        self.out().extend_from_slice(bytes);
    }

    /// The local header of an entry of `size` bytes with checksum `crc`, padded so that its
    /// data starts aligned.
    fn header(&mut self, inner: &str, size: u64, crc: u32) {
        let name = format!("{TOP}/{inner}");
        self.central.push(CentralRecord { name: name.clone(), crc, size, offset: self.pos });
        let big = size >= self.zip64_at;
        let zip64_len = if big { 20 } else { 0 };
        let fixed = self.pos + 30 + name.len() as u64 + zip64_len + 4;
        let pad = (ALIGN - fixed % ALIGN) % ALIGN;
        let mut h = Vec::with_capacity(30 + name.len() + 84);
        h.extend_from_slice(&0x0403_4b50u32.to_le_bytes());
        h.extend_from_slice(&(if big { 45u16 } else { 20 }).to_le_bytes()); // version needed
        h.extend_from_slice(&0x0800u16.to_le_bytes()); // names are UTF-8
        h.extend_from_slice(&[0; 6]); // stored; time and date 0 (reproducible bytes)
        h.extend_from_slice(&crc.to_le_bytes());
        let small = if big { u32::MAX } else { size as u32 };
        h.extend_from_slice(&small.to_le_bytes());
        h.extend_from_slice(&small.to_le_bytes());
        h.extend_from_slice(&(name.len() as u16).to_le_bytes());
        h.extend_from_slice(&((zip64_len + 4 + pad) as u16).to_le_bytes());
        h.extend_from_slice(name.as_bytes());
        if big {
            h.extend_from_slice(&1u16.to_le_bytes());
            h.extend_from_slice(&16u16.to_le_bytes());
            h.extend_from_slice(&size.to_le_bytes());
            h.extend_from_slice(&size.to_le_bytes());
        }
        h.extend_from_slice(b"FB");
        h.extend_from_slice(&(pad as u16).to_le_bytes());
        h.resize(h.len() + pad as usize, b'Z');
        self.emit(&h);
        debug_assert_eq!(self.pos % ALIGN, 0);
    }

    fn add(&mut self, inner: &str, data: &[u8]) {
        self.header(inner, data.len() as u64, crc32(data));
        self.emit(data);
    }

    /// Lays out an entry whose `size` bytes the caller writes at the returned offset.
    fn add_external(&mut self, inner: &str, size: u64, crc: u32) -> u64 {
        debug_assert!(self.suffix.is_none(), "one external entry per archive");
        self.header(inner, size, crc);
        let at = self.pos;
        self.pos += size;
        self.suffix = Some(Vec::new());
        at
    }

    /// The central directory and end records; returns `(prefix, suffix)`.
    fn finish(mut self) -> (Vec<u8>, Vec<u8>) {
        let cd_start = self.pos;
        let records = std::mem::take(&mut self.central);
        for r in &records {
            let (big_size, big_off) = (r.size >= self.zip64_at, r.offset >= self.zip64_at);
            let mut extra = Vec::new();
            if big_size {
                extra.extend_from_slice(&r.size.to_le_bytes());
                extra.extend_from_slice(&r.size.to_le_bytes());
            }
            if big_off {
                extra.extend_from_slice(&r.offset.to_le_bytes());
            }
            let mut h = Vec::with_capacity(46 + r.name.len() + 20);
            h.extend_from_slice(&0x0201_4b50u32.to_le_bytes());
            let version: u16 = if extra.is_empty() { 20 } else { 45 };
            h.extend_from_slice(&version.to_le_bytes()); // made by
            h.extend_from_slice(&version.to_le_bytes()); // needed
            h.extend_from_slice(&0x0800u16.to_le_bytes());
            h.extend_from_slice(&[0; 6]);
            h.extend_from_slice(&r.crc.to_le_bytes());
            let size = if big_size { u32::MAX } else { r.size as u32 };
            h.extend_from_slice(&size.to_le_bytes());
            h.extend_from_slice(&size.to_le_bytes());
            h.extend_from_slice(&(r.name.len() as u16).to_le_bytes());
            let extra_len = if extra.is_empty() { 0 } else { 4 + extra.len() };
            h.extend_from_slice(&(extra_len as u16).to_le_bytes());
            h.extend_from_slice(&[0; 8]); // comment length, disk, internal and external attributes
            h.extend_from_slice(&[0; 2]);
            let off = if big_off { u32::MAX } else { r.offset as u32 };
            h.extend_from_slice(&off.to_le_bytes());
            h.extend_from_slice(r.name.as_bytes());
            if !extra.is_empty() {
                h.extend_from_slice(&1u16.to_le_bytes());
                h.extend_from_slice(&(extra.len() as u16).to_le_bytes());
                h.extend_from_slice(&extra);
            }
            self.emit(&h);
        }
        let cd_size = self.pos - cd_start;
        let count = records.len() as u64;
        let need64 = cd_start >= self.zip64_at || cd_size >= self.zip64_at || count >= 0xFFFF;
        if need64 {
            let rec_at = self.pos;
            let mut r = Vec::with_capacity(76);
            r.extend_from_slice(&0x0606_4b50u32.to_le_bytes());
            r.extend_from_slice(&44u64.to_le_bytes());
            r.extend_from_slice(&45u16.to_le_bytes());
            r.extend_from_slice(&45u16.to_le_bytes());
            r.extend_from_slice(&[0; 8]);
            r.extend_from_slice(&count.to_le_bytes());
            r.extend_from_slice(&count.to_le_bytes());
            r.extend_from_slice(&cd_size.to_le_bytes());
            r.extend_from_slice(&cd_start.to_le_bytes());
            r.extend_from_slice(&0x0706_4b50u32.to_le_bytes());
            r.extend_from_slice(&0u32.to_le_bytes());
            r.extend_from_slice(&rec_at.to_le_bytes());
            r.extend_from_slice(&1u32.to_le_bytes());
            self.emit(&r);
        }
        let mut e = Vec::with_capacity(22);
        e.extend_from_slice(&0x0605_4b50u32.to_le_bytes());
        e.extend_from_slice(&[0; 4]);
        let n = if need64 { 0xFFFF } else { count as u16 };
        e.extend_from_slice(&n.to_le_bytes());
        e.extend_from_slice(&n.to_le_bytes());
        let small = |x: u64| if need64 { u32::MAX } else { x as u32 };
        e.extend_from_slice(&small(cd_size).to_le_bytes());
        e.extend_from_slice(&small(cd_start).to_le_bytes());
        e.extend_from_slice(&0u16.to_le_bytes());
        self.emit(&e);
        let suffix = self.suffix.take().unwrap_or_default();
        (self.prefix, suffix)
    }

    fn small_entries_before(&mut self, pkl: &[u8]) {
        self.add("data.pkl", pkl);
        self.add(".format_version", FORMAT_VERSION);
        self.add(".storage_alignment", STORAGE_ALIGNMENT);
        self.add("byteorder", BYTEORDER);
    }

    fn small_entries_after(&mut self, serialization_id: &str) {
        self.add("version", VERSION);
        self.add(".data/serialization_id", serialization_id.as_bytes());
    }
}

/// A `torch.save` archive of one tensor, without the tensor's bytes: write `prefix`, then the
/// `data_len` bytes of the tensor (C order, little-endian), then `suffix`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TensorArchive {
    pub prefix: Vec<u8>,
    pub data_len: u64,
    pub suffix: Vec<u8>,
}

impl TensorArchive {
    /// Length of the whole archive.
    pub fn len(&self) -> u64 {
        self.prefix.len() as u64 + self.data_len + self.suffix.len() as u64
    }
}

/// `torch.<name>` of a dtype.
pub(crate) fn torch_dtype_name(d: DType) -> &'static str {
    match d {
        DType::F64 => "float64",
        DType::F32 => "float32",
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
        DType::F8E4M3 => "float8_e4m3fn",
        DType::F8E5M2 => "float8_e5m2",
        DType::I64 => "int64",
        DType::I32 => "int32",
        DType::I16 => "int16",
        DType::I8 => "int8",
        DType::U8 => "uint8",
        DType::U16 => "uint16",
        DType::U32 => "uint32",
        DType::U64 => "uint64",
        DType::Bool => "bool",
    }
}

/// The legacy typed-storage class torch pickles a dtype's storage as; `None` for the dtypes
/// torch saves through `UntypedStorage` and `_rebuild_tensor_v3` (fp8, unsigned > 8 bits).
fn typed_storage(d: DType) -> Option<&'static str> {
    Some(match d {
        DType::F64 => "DoubleStorage",
        DType::F32 => "FloatStorage",
        DType::F16 => "HalfStorage",
        DType::BF16 => "BFloat16Storage",
        DType::I64 => "LongStorage",
        DType::I32 => "IntStorage",
        DType::I16 => "ShortStorage",
        DType::I8 => "CharStorage",
        DType::U8 => "ByteStorage",
        DType::Bool => "BoolStorage",
        DType::F8E4M3 | DType::F8E5M2 | DType::U16 | DType::U32 | DType::U64 => return None,
    })
}

/// C-order strides of `shape`, in elements.
fn contiguous_strides(shape: &[u64]) -> Vec<u64> {
    let mut strides = vec![1u64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1].max(1);
    }
    strides
}

/// The `data.pkl` of a tensor of `dtype` and `shape` whose storage is entry `data/0`:
/// what `torch.save(tensor)` pickles for a contiguous CPU tensor.
pub(crate) fn tensor_pickle(dtype: DType, shape: &[u64]) -> Vec<u8> {
    let numel: u64 = shape.iter().product();
    let size = Pk::dims(shape);
    let stride = Pk::dims(&contiguous_strides(shape));
    let hooks = Pk::call("collections", "OrderedDict", vec![]);
    // torch names the untyped storage class by its defining module (`torch.storage`), and its
    // weights-only unpickler allows it only under that name.
    let (storage_module, storage_class, storage_len) = match typed_storage(dtype) {
        Some(class) => ("torch", class, numel),
        None => ("torch.storage", "UntypedStorage", numel * dtype.size() as u64),
    };
    let pid = Pk::PersId(Box::new(Pk::Tuple(vec![
        Pk::str("storage"),
        Pk::global(storage_module, storage_class),
        Pk::str("0"),
        Pk::str("cpu"),
        Pk::Int(storage_len as i64),
    ])));
    let mut args = vec![pid, Pk::Int(0), size, stride, Pk::Bool(false), hooks];
    let rebuild = if typed_storage(dtype).is_some() {
        "_rebuild_tensor_v2"
    } else {
        args.push(Pk::global("torch", torch_dtype_name(dtype)));
        "_rebuild_tensor_v3"
    };
    pickle(&Pk::call("torch._utils", rebuild, args), 2)
}

/// The archive `torch.save` writes for a contiguous CPU tensor of `dtype` and `shape` whose
/// bytes have CRC-32 `data_crc`. `serialization_id` fills `.data/serialization_id`.
pub(crate) fn tensor_archive(dtype: DType, shape: &[u64], data_crc: u32, serialization_id: &str) -> TensorArchive {
    tensor_archive_with(dtype, shape, data_crc, serialization_id, ZIP64_AT)
}

fn tensor_archive_with(
    dtype: DType,
    shape: &[u64],
    data_crc: u32,
    serialization_id: &str,
    zip64_at: u64,
) -> TensorArchive {
    let data_len = shape.iter().product::<u64>() * dtype.size() as u64;
    let mut z = ZipBuilder::new(zip64_at);
    z.small_entries_before(&tensor_pickle(dtype, shape));
    z.add_external("data/0", data_len, data_crc);
    z.small_entries_after(serialization_id);
    let (prefix, suffix) = z.finish();
    TensorArchive { prefix, data_len, suffix }
}

/// The archive `torch.save(value)` writes for a value holding no tensors (`data.pkl` only).
/// Refused when a string or bytes value would not fit protocol 2's 4-byte length (bytes go
/// as latin-1 text there, up to twice as long), where Python's pickle refuses too.
pub(crate) fn value_archive(value: &Pk, serialization_id: &str) -> crate::error::Result<Vec<u8>> {
    fn longest(v: &Pk) -> usize {
        match v {
            Pk::Str(s) => s.len(),
            Pk::Bytes(b) => b.len().saturating_mul(2),
            Pk::List(xs) | Pk::Tuple(xs) => xs.iter().map(longest).max().unwrap_or(0),
            Pk::Dict(kv) => kv.iter().map(|(k, v)| longest(k).max(longest(v))).max().unwrap_or(0),
            Pk::Reduce(f, args) => longest(f).max(args.iter().map(longest).max().unwrap_or(0)),
            Pk::Raw(body) => body.len(),
            _ => 0,
        }
    }
    let n = longest(value);
    if n > u32::MAX as usize {
        return Err(crate::error::Error::invalid(format!(
            "a value of {n} bytes cannot be stored by torch.save's pickle (protocol 2: at most 4 GiB per string or bytes value)"
        )));
    }
    Ok(archive_of_pickle(&pickle(value, 2), &[], serialization_id))
}

/// An archive of a given `data.pkl` and storage entries (`data/<key>`, in order).
pub(crate) fn archive_of_pickle(pkl: &[u8], storages: &[(&str, &[u8])], serialization_id: &str) -> Vec<u8> {
    let mut z = ZipBuilder::new(ZIP64_AT);
    z.small_entries_before(pkl);
    for (key, data) in storages {
        z.add(&format!("data/{key}"), data);
    }
    z.small_entries_after(serialization_id);
    let (mut prefix, suffix) = z.finish();
    prefix.extend_from_slice(&suffix);
    prefix
}

/// The storage entries of a `torch.save` archive: `(key, bytes)` of each `data/<key>`.
pub(crate) type Storages = Vec<(String, Vec<u8>)>;

/// The pickle body of a `torch.save` archive (its `data.pkl` without `PROTO` and `STOP`, for
/// splicing into another pickle: [`Pk::Raw`]) and its storage entries (`data/<key>`, in order).
/// The pickle must be protocol ≤ 3 (what `torch.save` writes): later protocols frame their
/// opcodes, and a frame cannot be spliced into another pickle.
pub(crate) fn archive_parts(archive: &[u8]) -> Result<(Vec<u8>, Storages), String> {
    use crate::formats::torch_save::{find_entry, zip_entries};
    let entries = zip_entries(archive)?;
    let slice =
        |e: &crate::formats::torch_save::ZipEntry| &archive[e.data_offset as usize..(e.data_offset + e.size) as usize];
    let pkl = slice(find_entry(&entries, "data.pkl").ok_or("no data.pkl in the torch.save archive")?);
    let body = match pkl {
        [0x80, p, body @ .., b'.'] if *p <= 3 => body,
        [0x80, p, ..] => return Err(format!("data.pkl is pickle protocol {p}; only protocols 2-3 can be spliced")),
        [.., b'.'] => pkl.strip_suffix(b".").unwrap_or(pkl),
        _ => return Err("data.pkl does not end with STOP".into()),
    };
    let mut storages = Vec::new();
    for e in &entries {
        if let Some(key) = e.inner_name().strip_prefix("data/") {
            storages.push((key.to_string(), slice(e).to_vec()));
        }
    }
    Ok((body.to_vec(), storages))
}

/// `torch.save([obj])` from the archive of `torch.save(obj)` (Megatron stores sharded objects
/// in a one-element list): the same entries, `data.pkl` wrapped in a list (see
/// [`archive_parts`] for the pickles this takes).
pub(crate) fn wrap_archive_in_list(archive: &[u8], serialization_id: &str) -> Result<Vec<u8>, String> {
    let (body, storages) = archive_parts(archive)?;
    // EMPTY_LIST, the object, APPEND: the memo indices the object uses are unchanged because
    // nothing before it is memoized.
    let mut wrapped = vec![0x80, 2, b']'];
    wrapped.extend_from_slice(&body);
    wrapped.extend_from_slice(b"a.");
    let storages: Vec<(&str, &[u8])> = storages.iter().map(|(k, d)| (k.as_str(), d.as_slice())).collect();
    Ok(archive_of_pickle(&wrapped, &storages, serialization_id))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::pickle::PickleValue;
    use crate::formats::torch_save::{decode_archive, find_entry, gather, tensor_record, zip_entries};

    #[test]
    fn crc32_check_values() {
        assert_eq!(crc32(b""), 0);
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7 + 3) as u8).collect();
        assert_eq!(crc32_update(crc32(&data[..333]), &data[333..]), crc32(&data));
    }

    fn whole(a: &TensorArchive, data: &[u8]) -> Vec<u8> {
        let mut out = a.prefix.clone();
        out.extend_from_slice(data);
        out.extend_from_slice(&a.suffix);
        out
    }

    fn check_tensor(zip64_at: u64) {
        for (dtype, shape) in [
            (DType::F32, vec![3u64, 4]),
            (DType::BF16, vec![2, 0, 5]),
            (DType::I64, vec![]),
            (DType::F8E4M3, vec![7]),
            (DType::U16, vec![2, 3]),
        ] {
            let n = shape.iter().product::<u64>() as usize * dtype.size();
            let data: Vec<u8> = (0..n).map(|i| (i * 13 + 1) as u8).collect();
            let a = tensor_archive_with(dtype, &shape, crc32(&data), "0123", zip64_at);
            assert_eq!(a.prefix.len() % 64, 0, "tensor data is 64-byte aligned");
            let archive = whole(&a, &data);
            assert_eq!(archive.len() as u64, a.len());
            let entries = zip_entries(&archive).unwrap();
            let names: Vec<&str> = entries.iter().map(|e| e.inner_name()).collect();
            assert_eq!(
                names,
                [
                    "data.pkl",
                    ".format_version",
                    ".storage_alignment",
                    "byteorder",
                    "data/0",
                    "version",
                    ".data/serialization_id"
                ]
            );
            for e in &entries {
                assert_eq!(e.data_offset % 64, 0, "{}", e.name);
            }
            let rec = tensor_record(&decode_archive(&archive, "t").unwrap()).unwrap();
            assert_eq!((rec.dtype, &rec.size), (dtype, &shape));
            let d = find_entry(&entries, "data/0").unwrap();
            let stored = &archive[d.data_offset as usize..(d.data_offset + d.size) as usize];
            assert_eq!(gather(stored, &rec).unwrap(), data);
        }
    }

    #[test]
    fn tensor_archives_read_back() {
        check_tensor(ZIP64_AT);
    }

    #[test]
    fn zip64_tensor_archives_read_back() {
        check_tensor(1);
    }

    #[test]
    fn value_archive_and_list_wrapping() {
        let v = Pk::Dict(vec![(Pk::str("a"), Pk::Bytes(vec![1, 2, 255]))]);
        let archive = value_archive(&v, "1").unwrap();
        let back = decode_archive(&archive, "v").unwrap();
        let expected = PickleValue::Dict(vec![(PickleValue::Str("a".into()), PickleValue::Bytes(vec![1, 2, 255]))]);
        assert_eq!(back, expected);
        let wrapped = wrap_archive_in_list(&archive, "2").unwrap();
        assert_eq!(decode_archive(&wrapped, "w").unwrap(), PickleValue::List(vec![expected]));

        // A tensor inside keeps its storage entry.
        let data = [1u8, 0, 0, 0, 2, 0, 0, 0];
        let a = tensor_archive(DType::I32, &[2], crc32(&data), "3");
        let wrapped = wrap_archive_in_list(&whole(&a, &data), "4").unwrap();
        let PickleValue::List(xs) = decode_archive(&wrapped, "w").unwrap() else { panic!("not a list") };
        let rec = tensor_record(&xs[0]).unwrap();
        let entries = zip_entries(&wrapped).unwrap();
        let d = find_entry(&entries, "data/0").unwrap();
        assert_eq!(gather(&wrapped[d.data_offset as usize..(d.data_offset + d.size) as usize], &rec).unwrap(), data);
    }
}
