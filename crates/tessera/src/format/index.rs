//! The global index (`tessera.index`): the commit marker and the map of every chunk.
//!
//! Layout (see FORMAT.md): `magic[8] | version u32le | body_len u64le | body | crc32c(body) u32le`.

use super::codec::{Decoder, Encoder};
use crate::plan::dims::Dims;
use crate::plan::geometry::numel;
use crate::state::{PathSeg, StatePath};
use crate::{DType, Value};

/// Name of the index file inside a checkpoint directory.
pub const INDEX_FILE: &str = "tessera.index";
/// First bytes of every index file.
pub const INDEX_MAGIC: &[u8; 8] = b"TESSERA\x00";
/// The native format version this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// Name of the native backend, as recorded for strategy lookup.
pub const NATIVE_BACKEND: &str = "tessera";
/// Default size of checksum blocks inside a chunk.
pub const DEFAULT_BLOCK_SIZE: u64 = 1 << 20;

/// A data file of the checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct FileEntry {
    /// File name, relative to the checkpoint directory (never a path).
    pub name: String,
    /// Size in bytes.
    pub size: u64,
    /// Size of the safetensors header (length prefix included): data starts here.
    pub header_len: u64,
    /// crc32c of the header bytes `[0, header_len)`.
    pub header_crc: u32,
}

/// Where one stored chunk of a tensor lives and how to check it.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredChunk {
    /// Index into [`CheckpointIndex::files`].
    pub file: u32,
    /// Byte offset of the chunk data in the file.
    pub byte_offset: u64,
    /// Offset of the chunk's box in the global tensor.
    pub offset: Dims,
    /// Shape of the chunk's box.
    pub shape: Dims,
    /// The chunk holds only this range of the box's flattening.
    pub flat: Option<(u64, u64)>,
    /// crc32c of each `block_size` block of the chunk's bytes (the last may be shorter).
    pub crcs: Vec<u32>,
}

impl StoredChunk {
    /// Elements stored.
    pub fn numel(&self) -> u64 {
        match self.flat {
            Some((s, e)) => e - s,
            None => numel(&self.shape),
        }
    }
}

/// A global tensor: its type, shape and stored chunks.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorEntry {
    /// Global key.
    pub key: String,
    /// Element type.
    pub dtype: DType,
    /// Global shape.
    pub global_shape: Vec<u64>,
    /// Chunks (main replicas), tiling the tensor exactly.
    pub chunks: Vec<StoredChunk>,
}

/// One stored shard of a sharded object.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredObject {
    /// Position in the grid of shards.
    pub offset: Vec<u64>,
    /// Index into [`CheckpointIndex::files`].
    pub file: u32,
    /// Byte offset in the file.
    pub byte_offset: u64,
    /// Length in bytes.
    pub len: u64,
    /// crc32c of the bytes.
    pub crc: u32,
}

/// A sharded object: its grid and stored shards.
#[derive(Debug, Clone, PartialEq)]
pub struct ObjectEntry {
    /// Global key.
    pub key: String,
    /// Shape of the grid of shards.
    pub global_shape: Vec<u64>,
    /// One entry per grid cell.
    pub shards: Vec<StoredObject>,
}

/// Everything a checkpoint holds, except the tensor bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckpointIndex {
    /// Backend that wrote the checkpoint (`"tessera"` for the native format).
    pub backend: String,
    /// Format version of that backend.
    pub version: u32,
    /// Checksum block size in bytes.
    pub block_size: u64,
    /// User-visible metadata given at save.
    pub content_metadata: Value,
    /// The common (non-sharded) state: plain values at their paths.
    pub common: Vec<(StatePath, Value)>,
    /// Data files.
    pub files: Vec<FileEntry>,
    /// Tensors, sorted by key.
    pub tensors: Vec<TensorEntry>,
    /// Sharded objects, sorted by key.
    pub objects: Vec<ObjectEntry>,
}

/// Why an index could not be read.
#[derive(Debug)]
pub(crate) enum IndexError {
    Version(u32),
    Corrupt(String),
}

impl CheckpointIndex {
    /// The tensor with this key.
    pub fn tensor(&self, key: &str) -> Option<&TensorEntry> {
        self.tensors.binary_search_by(|t| t.key.as_str().cmp(key)).ok().map(|i| &self.tensors[i])
    }

    /// The object with this key.
    pub fn object(&self, key: &str) -> Option<&ObjectEntry> {
        self.objects.binary_search_by(|t| t.key.as_str().cmp(key)).ok().map(|i| &self.objects[i])
    }

    /// Total bytes of tensor data.
    pub fn tensor_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.chunks.iter().map(|c| c.numel()).sum::<u64>() * t.dtype.size() as u64).sum()
    }

    /// Total number of chunks.
    pub fn chunk_count(&self) -> usize {
        self.tensors.iter().map(|t| t.chunks.len()).sum()
    }

    /// Serializes to the on-disk layout.
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Encoder::default();
        e.str(&self.backend);
        e.var(self.block_size);
        e.value(&self.content_metadata);
        e.var(self.common.len() as u64);
        for (path, v) in &self.common {
            encode_path(&mut e, path);
            e.value(v);
        }
        e.var(self.files.len() as u64);
        for f in &self.files {
            e.str(&f.name);
            e.var(f.size);
            e.var(f.header_len);
            e.u32_le(f.header_crc);
        }
        // Readers binary-search keys: write them sorted whatever order the caller built.
        let mut tensors: Vec<&TensorEntry> = self.tensors.iter().collect();
        tensors.sort_by(|a, b| a.key.cmp(&b.key));
        let mut objects: Vec<&ObjectEntry> = self.objects.iter().collect();
        objects.sort_by(|a, b| a.key.cmp(&b.key));
        e.var(tensors.len() as u64);
        for t in tensors {
            e.str(&t.key);
            e.u8(t.dtype.code());
            e.dims(&t.global_shape);
            e.var(t.chunks.len() as u64);
            for c in &t.chunks {
                e.var(c.file as u64);
                e.var(c.byte_offset);
                for &x in c.offset.iter().chain(&c.shape) {
                    e.var(x);
                }
                match c.flat {
                    None => e.u8(0),
                    Some((s, x)) => {
                        e.u8(1);
                        e.var(s);
                        e.var(x - s);
                    }
                }
                for &crc in &c.crcs {
                    e.u32_le(crc);
                }
            }
        }
        e.var(objects.len() as u64);
        for o in objects {
            e.str(&o.key);
            e.dims(&o.global_shape);
            e.var(o.shards.len() as u64);
            for s in &o.shards {
                for &x in &s.offset {
                    e.var(x);
                }
                e.var(s.file as u64);
                e.var(s.byte_offset);
                e.var(s.len);
                e.u32_le(s.crc);
            }
        }
        let body = e.buf;
        let mut out = Vec::with_capacity(body.len() + 24);
        out.extend_from_slice(INDEX_MAGIC);
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&(body.len() as u64).to_le_bytes());
        out.extend_from_slice(&body);
        out.extend_from_slice(&crc32c::crc32c(&body).to_le_bytes());
        out
    }

    /// Parses index bytes (as read from `path`, used in errors), checking magic, version,
    /// checksum, bounds and names.
    pub fn from_bytes(bytes: &[u8], path: &str) -> crate::Result<CheckpointIndex> {
        Self::decode(bytes).map_err(|e| match e {
            IndexError::Version(v) => crate::Error::IncompatibleVersion {
                found: format!("{NATIVE_BACKEND} v{v}"),
                supported: format!("{NATIVE_BACKEND} v{FORMAT_VERSION}"),
            },
            IndexError::Corrupt(reason) => crate::Error::corrupt(path, reason),
        })
    }

    /// Reads the version from the first bytes of an index, if they are one.
    pub(crate) fn peek_version(head: &[u8]) -> Option<u32> {
        if head.len() >= 12 && &head[..8] == INDEX_MAGIC {
            Some(u32::from_le_bytes(head[8..12].try_into().unwrap()))
        } else {
            None
        }
    }

    /// Parses and checks an index (checksum, bounds, names, chunk sizes).
    pub(crate) fn decode(bytes: &[u8]) -> Result<CheckpointIndex, IndexError> {
        let corrupt = |s: String| IndexError::Corrupt(s);
        let version = Self::peek_version(bytes).ok_or_else(|| corrupt("not a tessera index (bad magic)".into()))?;
        if version != FORMAT_VERSION {
            return Err(IndexError::Version(version));
        }
        if bytes.len() < 24 {
            return Err(corrupt(format!("index truncated at {} bytes", bytes.len())));
        }
        let body_len = u64::from_le_bytes(bytes[12..20].try_into().unwrap());
        if body_len != bytes.len() as u64 - 24 {
            return Err(corrupt(format!(
                "index body length {body_len} does not match file size {} (truncated or extended)",
                bytes.len()
            )));
        }
        let body = &bytes[20..bytes.len() - 4];
        let crc = u32::from_le_bytes(bytes[bytes.len() - 4..].try_into().unwrap());
        if crc32c::crc32c(body) != crc {
            return Err(corrupt("index checksum mismatch".into()));
        }
        Self::decode_body(version, body).map_err(corrupt)
    }

    fn decode_body(version: u32, body: &[u8]) -> Result<CheckpointIndex, String> {
        let mut d = Decoder::new(body);
        let backend = d.str()?;
        let block_size = d.var()?;
        if block_size == 0 {
            return Err("block size 0".into());
        }
        let content_metadata = d.value()?;
        let n = d.count()?;
        let mut common = Vec::with_capacity(n);
        for _ in 0..n {
            let path = decode_path(&mut d)?;
            common.push((path, d.value()?));
        }
        let n = d.count()?;
        let mut files = Vec::with_capacity(n);
        for _ in 0..n {
            let name = d.str()?;
            check_file_name(&name)?;
            let size = d.var()?;
            let header_len = d.var()?;
            if header_len > size {
                return Err(format!("{name}: header longer than the file"));
            }
            let header_crc = d.u32_le()?;
            files.push(FileEntry { name, size, header_len, header_crc });
        }
        let n = d.count()?;
        let mut tensors: Vec<TensorEntry> = Vec::with_capacity(n);
        for _ in 0..n {
            let key = d.str()?;
            let code = d.u8()?;
            let dtype = DType::from_code(code).ok_or_else(|| format!("{key:?}: unknown dtype code {code}"))?;
            let global_shape = d.dims()?;
            let ndim = global_shape.len();
            let nchunks = d.count()?;
            let mut chunks = Vec::with_capacity(nchunks);
            for _ in 0..nchunks {
                let file = d.var()?;
                let byte_offset = d.var()?;
                let mut offset = Dims::with_capacity(ndim);
                let mut shape = Dims::with_capacity(ndim);
                for _ in 0..ndim {
                    offset.push(d.var()?);
                }
                for _ in 0..ndim {
                    shape.push(d.var()?);
                }
                let flat = match d.u8()? {
                    0 => None,
                    1 => {
                        let s = d.var()?;
                        let len = d.var()?;
                        Some((s, s.checked_add(len).ok_or("flat range overflows")?))
                    }
                    t => return Err(format!("{key:?}: bad flat-range tag {t}")),
                };
                for dd in 0..ndim {
                    if offset[dd].checked_add(shape[dd]).is_none_or(|end| end > global_shape[dd]) {
                        return Err(format!("{key:?}: chunk box outside the global shape"));
                    }
                }
                let box_numel = shape.iter().try_fold(1u64, |a, &b| a.checked_mul(b)).ok_or("chunk too large")?;
                if let Some((s, e)) = flat {
                    if e > box_numel {
                        return Err(format!("{key:?}: flat range past the chunk box"));
                    }
                    let _ = s;
                }
                let numel = flat.map_or(box_numel, |(s, e)| e - s);
                let nbytes = numel.checked_mul(dtype.size() as u64).ok_or("chunk too large")?;
                let f = files
                    .get(file as usize)
                    .ok_or_else(|| format!("{key:?}: chunk names file #{file}, there are {}", files.len()))?;
                if byte_offset.checked_add(nbytes).is_none_or(|end| end > f.size) {
                    return Err(format!("{key:?}: chunk bytes past the end of {}", f.name));
                }
                let ncrc = nbytes.div_ceil(block_size);
                if ncrc > d.remaining() as u64 / 4 {
                    return Err("truncated checksums".into());
                }
                let mut crcs = Vec::with_capacity(ncrc as usize);
                for _ in 0..ncrc {
                    crcs.push(d.u32_le()?);
                }
                chunks.push(StoredChunk { file: file as u32, byte_offset, offset, shape, flat, crcs });
            }
            if let Some(prev) = tensors.last() {
                if prev.key >= key {
                    return Err(format!("tensor keys not sorted/unique at {key:?}"));
                }
            }
            tensors.push(TensorEntry { key, dtype, global_shape, chunks });
        }
        let n = d.count()?;
        let mut objects: Vec<ObjectEntry> = Vec::with_capacity(n);
        for _ in 0..n {
            let key = d.str()?;
            let global_shape = d.dims()?;
            let ns = d.count()?;
            let mut shards = Vec::with_capacity(ns);
            for _ in 0..ns {
                let mut offset = Vec::with_capacity(global_shape.len());
                for _ in 0..global_shape.len() {
                    offset.push(d.var()?);
                }
                let file = d.var()?;
                let byte_offset = d.var()?;
                let len = d.var()?;
                let crc = d.u32_le()?;
                let f = files.get(file as usize).ok_or_else(|| format!("{key:?}: object names file #{file}"))?;
                if byte_offset.checked_add(len).is_none_or(|end| end > f.size) {
                    return Err(format!("{key:?}: object bytes past the end of {}", f.name));
                }
                shards.push(StoredObject { offset, file: file as u32, byte_offset, len, crc });
            }
            if let Some(prev) = objects.last() {
                if prev.key >= key {
                    return Err(format!("object keys not sorted/unique at {key:?}"));
                }
            }
            objects.push(ObjectEntry { key, global_shape, shards });
        }
        if !d.is_done() {
            return Err("trailing bytes after the index body".into());
        }
        Ok(CheckpointIndex { backend, version, block_size, content_metadata, common, files, tensors, objects })
    }
}

/// File names in an index are plain names: no separators, no `..`, nothing hidden outside.
pub(crate) fn check_file_name(name: &str) -> Result<(), String> {
    if name.is_empty()
        || name == "."
        || name == ".."
        || name.contains('/')
        || name.contains('\\')
        || name.contains('\0')
    {
        return Err(format!("file name {name:?} is not a plain name inside the checkpoint"));
    }
    Ok(())
}

fn encode_path(e: &mut Encoder, path: &[PathSeg]) {
    e.var(path.len() as u64);
    for seg in path {
        match seg {
            PathSeg::Key(k) => {
                e.u8(0);
                e.str(k);
            }
            PathSeg::Index(i) => {
                e.u8(1);
                e.var(*i);
            }
        }
    }
}

fn decode_path(d: &mut Decoder<'_>) -> Result<StatePath, String> {
    let n = d.count()?;
    (0..n)
        .map(|_| match d.u8()? {
            0 => Ok(PathSeg::Key(d.str()?)),
            1 => Ok(PathSeg::Index(d.var()?)),
            t => Err(format!("bad path tag {t}")),
        })
        .collect()
}
