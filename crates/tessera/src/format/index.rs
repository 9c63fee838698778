//! The global index (`tessera.index`): the commit marker and the map of every chunk.
//!
//! Layout (see FORMAT.md): `magic[8] | version u32le | head_len u64le | head | crc32c(head) u32le |
//! sections`, the head holding a directory of tensors and each section one tensor's chunk records
//! (version 2); version 1 has the chunk records inline in one checksummed body.

use std::sync::Mutex;

use crate::model::codec::{prealloc, Decoder, Encoder};
use crate::model::crcs::Crcs;
use crate::model::dims::{check_axes, numel, Dims};
use crate::model::dtype::DType;
use crate::model::Value;
use crate::model::{PathSeg, StatePath};
use crate::storage::names::check_file_name;

/// Name of the index file inside a checkpoint directory.
pub const INDEX_FILE: &str = "tessera.index";
/// First bytes of every index file.
pub const INDEX_MAGIC: &[u8; 8] = b"TESSERA\x00";
/// The native format version this build writes; it reads this one and version 1.
pub const FORMAT_VERSION: u32 = 2;
/// Name of the native backend, as its data files record it.
pub const NATIVE_BACKEND: &str = "tessera";
/// Default size of checksum blocks inside a chunk.
pub const DEFAULT_BLOCK_SIZE: u64 = 1 << 20;

pub(crate) use crate::model::ForEach;

/// Chunk records per part of an index decode: fewer are decoded on the calling thread.
const CHUNKS_PER_PART: usize = 1 << 18;
/// Most parts an index decode is cut into.
const MAX_PARTS: usize = 16;

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
    pub crcs: Crcs,
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
///
/// The chunks are kept in canonical order (by box offset, then flat range), with what it takes
/// to find the chunks meeting a range of rows by binary search instead of a scan
/// ([`TensorEntry::chunks_meeting_rows`]). Build one with [`TensorEntry::new`].
#[derive(Debug, Clone, PartialEq)]
pub struct TensorEntry {
    /// Global key.
    pub key: String,
    /// Element type.
    pub dtype: DType,
    /// Global shape.
    pub global_shape: Vec<u64>,
    chunks: Vec<StoredChunk>,
    search: ChunkSearch,
}

/// Bounds that make a binary search over the canonical order exact.
#[derive(Debug, Clone, PartialEq)]
struct ChunkSearch {
    /// Largest extent of a chunk along axis 0.
    max_rows: u64,
    /// When every chunk spans whole rows (all of axes 1..) and their first elements, in the
    /// tensor's row-major flattening, ascend in canonical order: the row length, so that a
    /// search can go by element (a row split of flat-range chunks, the distributed optimizer's
    /// layout, then narrows to the chunks holding the rows, not their whole box).
    row: Option<u64>,
    /// Most elements stored in one chunk.
    max_numel: u64,
}

impl ChunkSearch {
    fn of(global_shape: &[u64], chunks: &[StoredChunk]) -> ChunkSearch {
        let mut row = global_shape.get(1..).and_then(|rest| rest.iter().try_fold(1u64, |a, &b| a.checked_mul(b)));
        let (mut max_rows, mut max_numel, mut last_first) = (0, 0, 0);
        // Built before the validation gate has seen the chunks: total on any input (the gate
        // then refuses what this had to clamp).
        for c in chunks {
            max_rows = max_rows.max(c.shape.first().copied().unwrap_or(0));
            let numel = match c.flat {
                Some((s, e)) => e.saturating_sub(s),
                None => c.shape.iter().try_fold(1u64, |a, &b| a.checked_mul(b)).unwrap_or(u64::MAX),
            };
            max_numel = max_numel.max(numel);
            if c.offset.len() != global_shape.len() || c.shape.len() != global_shape.len() {
                row = None;
            }
            if let Some(r) = row {
                let whole_rows = c.offset[1..].iter().all(|&o| o == 0) && c.shape[1..] == global_shape[1..];
                match first_element(c, r) {
                    Some(first) if whole_rows && first >= last_first => last_first = first,
                    _ => row = None,
                }
            }
        }
        ChunkSearch { max_rows, row, max_numel }
    }
}

/// The position of a whole-rows chunk's first element in the tensor's flattening.
fn first_element(c: &StoredChunk, row: u64) -> Option<u64> {
    c.offset[0].checked_mul(row)?.checked_add(c.flat.map_or(0, |f| f.0))
}

/// Puts `chunks` in canonical order, as a stable sort by [`chunk_order`] does. A save's chunks
/// arrive in rank order, far from canonical for a tensor cut across DP: sorting the chunks
/// themselves compares offsets of any length and moves 128 bytes at every step, where this
/// sorts small keys of a fixed size and then moves each chunk once, to its place.
fn sort_chunks(chunks: &mut [StoredChunk]) {
    if u32::try_from(chunks.len()).is_err() || chunks.iter().any(|c| c.offset.len() > SORT_AXES) {
        chunks.sort_by(chunk_order);
        return;
    }
    // Each chunk's place in chunk_order as a key of fixed size: the offset padded with zeros,
    // then its length (a shorter offset that is a prefix of a longer one comes first, as the
    // slices compare), then the flat range (none first). With the position last every key is
    // distinct, so the unstable sort gives the stable sort's order.
    let mut keys: Vec<SortKey> = chunks
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let mut off = [0u64; SORT_AXES];
            off[..c.offset.len()].copy_from_slice(&c.offset);
            (off, c.offset.len(), c.flat, i as u32)
        })
        .collect();
    keys.sort_unstable();
    let mut order: Vec<u32> = keys.into_iter().map(|k| k.3).collect();
    // Position i takes the chunk at order[i]: follow each cycle of the permutation, marking the
    // positions done.
    for start in 0..chunks.len() {
        let mut at = start;
        loop {
            let from = order[at] as usize;
            order[at] = at as u32;
            if from == start {
                break;
            }
            chunks.swap(at, from);
            at = from;
        }
    }
}

/// Offsets of at most this many axes are sorted by [`sort_chunks`] as fixed-size keys.
const SORT_AXES: usize = 3;

/// A chunk's key in [`sort_chunks`]: padded offset, its length, flat range, position.
type SortKey = ([u64; SORT_AXES], usize, Option<(u64, u64)>, u32);

/// The canonical order of a tensor's chunks: by box offset (lexicographic), then flat range.
fn chunk_order(a: &StoredChunk, b: &StoredChunk) -> std::cmp::Ordering {
    (&a.offset, a.flat).cmp(&(&b.offset, b.flat))
}

impl TensorEntry {
    /// A tensor entry with its chunks (main replicas, tiling the tensor), put in canonical order.
    pub fn new(key: String, dtype: DType, global_shape: Vec<u64>, mut chunks: Vec<StoredChunk>) -> Self {
        if !chunks.is_sorted_by(|a, b| chunk_order(a, b).is_le()) {
            sort_chunks(&mut chunks);
        }
        let search = ChunkSearch::of(&global_shape, &chunks);
        TensorEntry { key, dtype, global_shape, chunks, search }
    }

    /// The stored chunks, in canonical order (by box offset, then flat range).
    pub fn chunks(&self) -> &[StoredChunk] {
        &self.chunks
    }

    /// Takes the chunks out.
    pub fn into_chunks(self) -> Vec<StoredChunk> {
        self.chunks
    }

    /// The positions in [`TensorEntry::chunks`] of every chunk that may hold elements of rows
    /// `[lo, hi)` (axis 0): a superset found by binary search, exact for any set of chunks;
    /// chunks outside it hold none of those rows. All chunks for a scalar.
    pub fn chunks_meeting_rows(&self, lo: u64, hi: u64) -> std::ops::Range<usize> {
        if self.global_shape.is_empty() {
            return 0..self.chunks.len();
        }
        let ChunkSearch { max_rows, row, max_numel } = self.search;
        match row {
            Some(row) => {
                let (lo, hi) = (lo.saturating_mul(row), hi.saturating_mul(row));
                let first = |c: &StoredChunk| first_element(c, row).expect("checked when built");
                let end = self.chunks.partition_point(|c| first(c) < hi);
                let start = self.chunks[..end].partition_point(|c| first(c).saturating_add(max_numel) <= lo);
                start..end
            }
            None => {
                let end = self.chunks.partition_point(|c| c.offset[0] < hi);
                let start = self.chunks[..end].partition_point(|c| c.offset[0].saturating_add(max_rows) <= lo);
                start..end
            }
        }
    }
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

/// The program (and layout) that wrote a checkpoint: what [`open`](crate::open) recognised.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Backend {
    /// tessera's own format (`tessera.index`).
    Tessera,
    /// PyTorch `torch.distributed.checkpoint` (`.metadata`; also its no-collectives and
    /// Hugging Face layouts).
    TorchDcp,
    /// Megatron-Core `torch_dist`: DCP with Megatron's `metadata.json` and common state.
    TorchDist,
    /// OLMo-core 3.x: DCP under `model_and_optim/`.
    OlmoCore,
    /// Megatron-Core's legacy `zarr` backend.
    Zarr,
    /// OLMo-core 0.1.x: `model/` and `optim/` safetensors with `metadata.json`.
    OlmoSafetensors,
    /// Plain safetensors files (a Hugging Face model folder, or one file).
    Safetensors,
}

impl Backend {
    /// Every backend, in the order [`open`](crate::open) tries them.
    pub const ALL: [Backend; 7] = [
        Backend::Tessera,
        Backend::OlmoSafetensors,
        Backend::TorchDist,
        Backend::TorchDcp,
        Backend::OlmoCore,
        Backend::Zarr,
        Backend::Safetensors,
    ];

    /// The backend's name as tessera reports it (`"tessera"`, `"torch_dcp"`, `"torch_dist"`,
    /// `"olmo_core"`, `"zarr"`, `"olmo_safetensors"`, `"safetensors"`); Megatron's
    /// `sharded_backend` names where Megatron has one.
    ///
    /// ```
    /// use tessera::index::Backend;
    /// assert_eq!(Backend::TorchDist.name(), "torch_dist");
    /// assert_eq!(Backend::from_name("torch_dist"), Some(Backend::TorchDist));
    /// ```
    pub const fn name(self) -> &'static str {
        match self {
            Backend::Tessera => NATIVE_BACKEND,
            Backend::TorchDcp => "torch_dcp",
            Backend::TorchDist => "torch_dist",
            Backend::OlmoCore => "olmo_core",
            Backend::Zarr => "zarr",
            Backend::OlmoSafetensors => "olmo_safetensors",
            Backend::Safetensors => "safetensors",
        }
    }

    /// The backend of that [`name`](Backend::name), if there is one.
    pub fn from_name(name: &str) -> Option<Backend> {
        Backend::ALL.into_iter().find(|b| b.name() == name)
    }

    /// Whether the checkpoint is a PyTorch DCP directory (`.metadata` and `.distcp` files),
    /// which torch's own reader loads.
    pub const fn is_dcp(self) -> bool {
        matches!(self, Backend::TorchDcp | Backend::TorchDist | Backend::OlmoCore)
    }

    /// Whether the checkpoint carries Megatron-Core's `metadata.json`.
    pub const fn is_megatron(self) -> bool {
        matches!(self, Backend::TorchDist | Backend::Zarr)
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Everything a checkpoint holds, except the tensor bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckpointIndex {
    /// Backend that wrote the checkpoint.
    pub backend: Backend,
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
    /// Keys of the tensors a partial open left out of `tensors` (sorted; empty for a complete
    /// index). A partial index serves loads of the tensors it holds; it is never written back.
    pub omitted_tensors: Vec<String>,
}

impl CheckpointIndex {
    /// An index of `files` and `tensors` alone (no objects, common state or metadata), for
    /// unit tests of what reads by an index.
    #[cfg(test)]
    pub(crate) fn of_tensors(block_size: u64, files: Vec<FileEntry>, tensors: Vec<TensorEntry>) -> CheckpointIndex {
        CheckpointIndex {
            backend: Backend::Tessera,
            version: 1,
            block_size,
            content_metadata: Value::Null,
            common: Vec::new(),
            files,
            tensors,
            objects: Vec::new(),
            omitted_tensors: Vec::new(),
        }
    }

    /// The keys of every tensor in the checkpoint: those held and those omitted by a partial
    /// open.
    pub fn tensor_keys(&self) -> impl Iterator<Item = &str> {
        self.tensors.iter().map(|t| t.key.as_str()).chain(self.omitted_tensors.iter().map(String::as_str))
    }

    /// Puts tensors and objects in key order and each object's shards in grid order, as
    /// lookups ([`CheckpointIndex::tensor`], [`CheckpointIndex::object`]) need.
    pub fn sort_entries(&mut self) {
        self.tensors.sort_by(|a, b| a.key.cmp(&b.key));
        self.objects.sort_by(|a, b| a.key.cmp(&b.key));
        for o in &mut self.objects {
            o.shards.sort_by(|a, b| a.offset.cmp(&b.offset));
        }
    }

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

    /// Serializes to the on-disk layout of [`FORMAT_VERSION`], or of version 1 if this index
    /// says it is version 1 (rewriting an old checkpoint keeps it readable by old readers).
    /// Panics on a partial index (one with omitted tensors): writing it would drop them.
    pub fn encode(&self) -> Vec<u8> {
        assert!(self.omitted_tensors.is_empty(), "a partial index (opened for some keys) is never written back");
        let mut tensors: Vec<&TensorEntry> = self.tensors.iter().collect();
        let mut objects: Vec<&ObjectEntry> = self.objects.iter().collect();
        // Readers binary-search keys: write them sorted whatever order the caller built.
        tensors.sort_by(|a, b| a.key.cmp(&b.key));
        objects.sort_by(|a, b| a.key.cmp(&b.key));
        let mut e = Encoder::default();
        self.encode_prelude(&mut e);
        if self.version == 1 {
            e.var(tensors.len() as u64);
            for t in tensors {
                encode_tensor_head(&mut e, t);
                for c in &t.chunks {
                    encode_chunk(&mut e, c);
                }
            }
            encode_objects(&mut e, &objects);
            return frame(1, &e.buf, &[]);
        }
        let mut sections = Encoder::default();
        e.var(tensors.len() as u64);
        for t in tensors {
            let start = sections.buf.len();
            for c in &t.chunks {
                encode_chunk(&mut sections, c);
            }
            let section = &sections.buf[start..];
            encode_tensor_head(&mut e, t);
            e.var(section.len() as u64);
            e.u32_le(crate::model::crc::crc32c(section));
        }
        encode_objects(&mut e, &objects);
        e.var(sections.buf.len() as u64);
        frame_before(FORMAT_VERSION, &e.buf, sections.buf)
    }

    fn encode_prelude(&self, e: &mut Encoder) {
        // Every encoded index is native: its backend is fixed, the name kept for readers.
        e.str(self.backend.name());
        e.var(self.block_size);
        e.value(&self.content_metadata);
        e.var(self.common.len() as u64);
        for (path, v) in &self.common {
            encode_path(e, path);
            e.value(v);
        }
        e.var(self.files.len() as u64);
        for f in &self.files {
            e.str(&f.name);
            e.var(f.size);
            e.var(f.header_len);
            e.u32_le(f.header_crc);
        }
    }

    /// Reads the version from the first bytes of an index, if they are one.
    pub(crate) fn peek_version(head: &[u8]) -> Option<u32> {
        if head.len() >= 12 && &head[..8] == INDEX_MAGIC {
            Some(u32::from_le_bytes(head[8..12].try_into().unwrap()))
        } else {
            None
        }
    }

    /// Parses and checks an index of any supported version (checksums, bounds, names, chunk
    /// sizes, order). The tensors' sections are decoded in parts run by `for_each` (the caller
    /// chooses the threads; see [`IndexHead::decode_some`]).
    pub(crate) fn decode(bytes: &[u8], for_each: ForEach<'_>) -> Result<CheckpointIndex, IndexError> {
        let version = Self::peek_version(bytes)
            .ok_or_else(|| IndexError::Corrupt("not a tessera index (bad magic or truncated header)".into()))?;
        match version {
            1 => Self::decode_v1(bytes),
            FORMAT_VERSION => {
                let head = IndexHead::decode(bytes)?;
                if bytes.len() as u64 != head.file_size() {
                    return Err(IndexError::Corrupt(format!(
                        "index is {} bytes, its head says {} (truncated or extended)",
                        bytes.len(),
                        head.file_size()
                    )));
                }
                head.decode_all(bytes, for_each).map_err(IndexError::Corrupt)
            }
            v => Err(IndexError::Version(v)),
        }
    }

    fn decode_v1(bytes: &[u8]) -> Result<CheckpointIndex, IndexError> {
        let corrupt = |s: String| IndexError::Corrupt(s);
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
        if crate::model::crc::crc32c(body) != crc {
            return Err(corrupt("index checksum mismatch".into()));
        }
        Self::decode_v1_body(body).map_err(corrupt)
    }

    fn decode_v1_body(body: &[u8]) -> Result<CheckpointIndex, String> {
        let mut d = Decoder::new(body);
        let prelude = Prelude::decode(&mut d)?;
        let n = d.count()?;
        let mut tensors: Vec<TensorEntry> = Vec::with_capacity(prealloc(n));
        for _ in 0..n {
            let (key, dtype, global_shape, nchunks) = decode_tensor_head(&mut d)?;
            let shape = TensorShape { key: &key, dtype, global_shape: &global_shape };
            let chunks = decode_chunks(&mut d, &shape, nchunks, &prelude, false)?;
            if tensors.last().is_some_and(|prev| prev.key >= key) {
                return Err(format!("tensor keys not sorted/unique at {key:?}"));
            }
            tensors.push(TensorEntry::new(key, dtype, global_shape, chunks));
        }
        let objects = decode_objects(&mut d)?;
        if !d.is_done() {
            return Err("trailing bytes after the index body".into());
        }
        Ok(prelude.into_index(1, tensors, objects))
    }
}

/// Why an index could not be read.
#[derive(Debug)]
pub(crate) enum IndexError {
    Version(u32),
    Corrupt(String),
}

impl IndexError {
    pub(crate) fn into_error(self, path: &str) -> crate::error::Error {
        match self {
            IndexError::Version(v) => crate::error::Error::IncompatibleVersion {
                found: format!("{NATIVE_BACKEND} v{v}"),
                supported: format!("{NATIVE_BACKEND} v1, v{FORMAT_VERSION}"),
            },
            IndexError::Corrupt(reason) => crate::error::Error::corrupt(path, reason),
        }
    }
}

/// [`frame`] of `bytes` with `tail` (a large buffer, taken) moved back in place to make room:
/// the index is built in one buffer of its size instead of two (sections, then the whole).
fn frame_before(version: u32, bytes: &[u8], mut tail: Vec<u8>) -> Vec<u8> {
    let head = frame(version, bytes, &[]);
    let n = tail.len();
    tail.reserve_exact(head.len());
    tail.resize(n + head.len(), 0);
    tail.copy_within(..n, head.len());
    tail[..head.len()].copy_from_slice(&head);
    tail
}

/// `magic | version | len u64le | bytes | crc32c(bytes) u32le | tail`.
fn frame(version: u32, bytes: &[u8], tail: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len() + 24 + tail.len());
    out.extend_from_slice(INDEX_MAGIC);
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    out.extend_from_slice(bytes);
    out.extend_from_slice(&crate::model::crc::crc32c(bytes).to_le_bytes());
    out.extend_from_slice(tail);
    out
}

fn encode_tensor_head(e: &mut Encoder, t: &TensorEntry) {
    e.str(&t.key);
    e.u8(t.dtype.code());
    e.dims(&t.global_shape);
    e.var(t.chunks.len() as u64);
}

fn decode_tensor_head(d: &mut Decoder<'_>) -> Result<(String, DType, Vec<u64>, usize), String> {
    let key = d.str()?;
    let code = d.u8()?;
    let dtype = DType::from_code(code).ok_or_else(|| format!("{key:?}: unknown dtype code {code}"))?;
    let global_shape = decode_shape(d, &key)?;
    let nchunks = d.var()?;
    // Every chunk record takes at least 3 bytes: a count beyond what any section could hold is
    // corruption, and must not size an allocation.
    let nchunks = usize::try_from(nchunks).map_err(|_| format!("{key:?}: chunk count {nchunks} too large"))?;
    Ok((key, dtype, global_shape, nchunks))
}

/// A tensor's shape or an object's grid (`dims`) of at most
/// [`MAX_AXES`](crate::model::dims::MAX_AXES) axes, counted before the axes are read: each
/// axis of a shape is read again in every chunk record and walked by the validation's geometry.
fn decode_shape(d: &mut Decoder<'_>, key: &str) -> Result<Vec<u64>, String> {
    let n = d.count()?;
    check_axes(n).map_err(|e| format!("{key:?}: the shape has {e}"))?;
    (0..n).map(|_| d.var()).collect()
}

/// A record's file number: an index into the files, which the validation gate bounds by their
/// count; one that does not even fit 32 bits is refused here rather than truncated onto
/// another file.
fn decode_file_number(d: &mut Decoder<'_>, key: &str) -> Result<u32, String> {
    let file = d.var()?;
    u32::try_from(file).map_err(|_| format!("{key:?}: names file {file}, past any file number (2^32)"))
}

fn encode_chunk(e: &mut Encoder, c: &StoredChunk) {
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

fn encode_objects(e: &mut Encoder, objects: &[&ObjectEntry]) {
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
}

fn decode_objects(d: &mut Decoder<'_>) -> Result<Vec<ObjectEntry>, String> {
    let n = d.count()?;
    let mut objects: Vec<ObjectEntry> = Vec::with_capacity(prealloc(n));
    for _ in 0..n {
        let key = d.str()?;
        let global_shape = decode_shape(d, &key)?;
        let ns = d.count()?;
        let mut shards = Vec::with_capacity(prealloc(ns));
        for _ in 0..ns {
            let mut offset = Vec::with_capacity(global_shape.len());
            for _ in 0..global_shape.len() {
                offset.push(d.var()?);
            }
            let file = decode_file_number(d, &key)?;
            let byte_offset = d.var()?;
            let len = d.var()?;
            let crc = d.u32_le()?;
            shards.push(StoredObject { offset, file, byte_offset, len, crc });
        }
        if objects.last().is_some_and(|prev| prev.key >= key) {
            return Err(format!("object keys not sorted/unique at {key:?}"));
        }
        objects.push(ObjectEntry { key, global_shape, shards });
    }
    Ok(objects)
}

/// What precedes the tensors in every version: backend, block size, metadata, common, files.
struct Prelude {
    backend: Backend,
    block_size: u64,
    content_metadata: Value,
    common: Vec<(StatePath, Value)>,
    files: Vec<FileEntry>,
}

impl Prelude {
    fn decode(d: &mut Decoder<'_>) -> Result<Prelude, String> {
        let name = d.str()?;
        let backend = Backend::from_name(&name).ok_or_else(|| format!("unknown backend {name:?}"))?;
        let block_size = d.var()?;
        if block_size == 0 {
            return Err("block size 0".into());
        }
        let content_metadata = d.value()?;
        let n = d.count()?;
        let mut common = Vec::with_capacity(prealloc(n));
        for _ in 0..n {
            let path = decode_path(d)?;
            common.push((path, d.value()?));
        }
        let n = d.count()?;
        let mut files = Vec::with_capacity(prealloc(n));
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
        Ok(Prelude { backend, block_size, content_metadata, common, files })
    }

    fn into_index(self, version: u32, tensors: Vec<TensorEntry>, objects: Vec<ObjectEntry>) -> CheckpointIndex {
        let Prelude { backend, block_size, content_metadata, common, files } = self;
        CheckpointIndex {
            backend,
            version,
            block_size,
            content_metadata,
            common,
            files,
            tensors,
            objects,
            omitted_tensors: Vec::new(),
        }
    }
}

/// What chunk records are checked against.
struct TensorShape<'a> {
    key: &'a str,
    dtype: DType,
    global_shape: &'a [u64],
}

/// Decodes `nchunks` chunk records, checking (with `canonical`) their order; what they say is
/// checked by the validation gate.
fn decode_chunks(
    d: &mut Decoder<'_>,
    t: &TensorShape<'_>,
    nchunks: usize,
    prelude: &Prelude,
    canonical: bool,
) -> Result<Vec<StoredChunk>, String> {
    let (key, ndim, block_size) = (t.key, t.global_shape.len(), prelude.block_size);
    if nchunks > d.remaining() / 3 {
        return Err(format!("{key:?}: {nchunks} chunks cannot fit in {} bytes", d.remaining()));
    }
    let mut chunks: Vec<StoredChunk> = Vec::with_capacity(prealloc(nchunks));
    for _ in 0..nchunks {
        let file = decode_file_number(d, key)?;
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
            tag => return Err(format!("{key:?}: bad flat-range tag {tag}")),
        };
        // Bounds, files and tiling are the validation gate's (plan::validate); decoding needs
        // only the byte count, for the number of checksums that follow.
        let numel = match flat {
            Some((s, e)) => e - s,
            None => shape
                .iter()
                .try_fold(1u64, |a, &b| a.checked_mul(b))
                .ok_or_else(|| format!("{key:?}: chunk too large"))?,
        };
        let nbytes = numel.checked_mul(t.dtype.size() as u64).ok_or_else(|| format!("{key:?}: chunk too large"))?;
        let ncrc = nbytes.div_ceil(block_size);
        if ncrc > d.remaining() as u64 / 4 {
            return Err("truncated checksums".into());
        }
        let mut crcs = Crcs::with_capacity(ncrc as usize);
        for _ in 0..ncrc {
            crcs.push(d.u32_le()?);
        }
        let chunk = StoredChunk { file, byte_offset, offset, shape, flat, crcs };
        if canonical && chunks.last().is_some_and(|prev| chunk_order(prev, &chunk).is_gt()) {
            return Err(format!("{key:?}: chunks not in canonical order (by offset, then flat range)"));
        }
        chunks.push(chunk);
    }
    Ok(chunks)
}

/// Where one tensor's chunk records are in a version-2 index.
#[derive(Debug, Clone)]
pub(crate) struct TensorDir {
    pub(crate) key: String,
    dtype: DType,
    global_shape: Vec<u64>,
    chunk_count: usize,
    /// Byte range of the section in the index file.
    pub(crate) range: std::ops::Range<u64>,
    crc: u32,
}

/// The head of a version-2 index: everything but the chunk records, plus where each tensor's
/// records are. A reader decodes it, then only the sections it needs.
pub(crate) struct IndexHead {
    prelude: Prelude,
    pub(crate) tensors: Vec<TensorDir>,
    objects: Vec<ObjectEntry>,
    /// Total size of the index file.
    file_size: u64,
}

/// Bytes before the head: magic, version, head length.
const FIXED_HEADER: u64 = 20;

impl IndexHead {
    /// From the first 20 bytes (or more) of a version-2 index: the bytes to read, from the
    /// start of the file, to hold its whole head.
    pub(crate) fn extent(prefix: &[u8]) -> Result<u64, IndexError> {
        match CheckpointIndex::peek_version(prefix) {
            None => return Err(IndexError::Corrupt("not a tessera index (bad magic or truncated header)".into())),
            Some(FORMAT_VERSION) => {}
            Some(v) => return Err(IndexError::Version(v)),
        }
        if prefix.len() < FIXED_HEADER as usize {
            return Err(IndexError::Corrupt(format!("index truncated at {} bytes", prefix.len())));
        }
        let head_len = u64::from_le_bytes(prefix[12..20].try_into().unwrap());
        head_len
            .checked_add(FIXED_HEADER + 4)
            .ok_or_else(|| IndexError::Corrupt(format!("head length {head_len} overflows")))
    }

    /// Decodes and checks the head from the start of the index file (`bytes` holds at least
    /// [`IndexHead::extent`] bytes).
    pub(crate) fn decode(bytes: &[u8]) -> Result<IndexHead, IndexError> {
        let extent = Self::extent(bytes)?;
        if (bytes.len() as u64) < extent {
            return Err(IndexError::Corrupt(format!(
                "index head needs {extent} bytes, the file has {} (truncated)",
                bytes.len()
            )));
        }
        let head = &bytes[FIXED_HEADER as usize..extent as usize - 4];
        let crc = u32::from_le_bytes(bytes[extent as usize - 4..extent as usize].try_into().unwrap());
        if crate::model::crc::crc32c(head) != crc {
            return Err(IndexError::Corrupt("index head checksum mismatch".into()));
        }
        Self::decode_head(head, extent).map_err(IndexError::Corrupt)
    }

    fn decode_head(head: &[u8], sections_start: u64) -> Result<IndexHead, String> {
        let mut d = Decoder::new(head);
        let prelude = Prelude::decode(&mut d)?;
        let n = d.count()?;
        let mut tensors: Vec<TensorDir> = Vec::with_capacity(prealloc(n));
        let mut at = sections_start;
        for _ in 0..n {
            let (key, dtype, global_shape, chunk_count) = decode_tensor_head(&mut d)?;
            let len = d.var()?;
            let crc = d.u32_le()?;
            if chunk_count as u64 > len / 3 {
                return Err(format!("{key:?}: {chunk_count} chunks cannot fit in a {len}-byte section"));
            }
            if tensors.last().is_some_and(|prev| prev.key >= key) {
                return Err(format!("tensor keys not sorted/unique at {key:?}"));
            }
            let end = at.checked_add(len).ok_or("section lengths overflow")?;
            tensors.push(TensorDir { key, dtype, global_shape, chunk_count, range: at..end, crc });
            at = end;
        }
        let objects = decode_objects(&mut d)?;
        let sections_len = d.var()?;
        if sections_len != at - sections_start {
            return Err(format!(
                "sections hold {sections_len} bytes, the tensors' sections add up to {}",
                at - sections_start
            ));
        }
        if !d.is_done() {
            return Err("trailing bytes after the index head".into());
        }
        Ok(IndexHead { prelude, tensors, objects, file_size: at })
    }

    /// Size the index file must have.
    pub(crate) fn file_size(&self) -> u64 {
        self.file_size
    }

    /// Decodes the section of tensor `i` (`bytes`: exactly its [`TensorDir::range`]).
    pub(crate) fn tensor(&self, i: usize, bytes: &[u8]) -> Result<TensorEntry, String> {
        let t = &self.tensors[i];
        if bytes.len() as u64 != t.range.end - t.range.start {
            return Err(format!("{:?}: section truncated", t.key));
        }
        if crate::model::crc::crc32c(bytes) != t.crc {
            return Err(format!("{:?}: checksum mismatch in its chunk records", t.key));
        }
        let mut d = Decoder::new(bytes);
        let shape = TensorShape { key: &t.key, dtype: t.dtype, global_shape: &t.global_shape };
        let chunks = decode_chunks(&mut d, &shape, t.chunk_count, &self.prelude, true)?;
        if !d.is_done() {
            return Err(format!("{:?}: trailing bytes after its chunk records", t.key));
        }
        Ok(TensorEntry::new(t.key.clone(), t.dtype, t.global_shape.clone(), chunks))
    }

    /// Decodes every section of the whole index file `file`, in parts run by `for_each` when
    /// there are many chunks (see [`IndexHead::decode_some`]).
    pub(crate) fn decode_all(self, file: &[u8], for_each: ForEach<'_>) -> Result<CheckpointIndex, String> {
        let all: Vec<usize> = (0..self.tensors.len()).collect();
        let tensors = self.decode_some(
            &all,
            |i| {
                let r = &self.tensors[i].range;
                &file[r.start as usize..r.end as usize]
            },
            for_each,
        )?;
        Ok(self.into_index(tensors))
    }

    /// Decodes the sections of tensors `which` (positions in [`IndexHead::tensors`]), getting
    /// each one's bytes from `section`. Many chunks are cut into parts of about equal chunk
    /// counts (contiguous runs of `which`, decoded by [`IndexHead::decode_part`]) that
    /// `for_each` runs, side by side when the caller gives it threads; a few are decoded on the
    /// calling thread. The result is the same either way.
    pub(crate) fn decode_some<'b>(
        &self,
        which: &[usize],
        section: impl Fn(usize) -> &'b [u8] + Sync,
        for_each: ForEach<'_>,
    ) -> Result<Vec<TensorEntry>, String> {
        let parts = self.parts(which);
        if parts.len() == 1 {
            return self.decode_part(which, &section);
        }
        type Decoded = Option<Result<Vec<TensorEntry>, String>>;
        let done: Vec<Mutex<Decoded>> = parts.iter().map(|_| Mutex::new(None)).collect();
        for_each(parts.len(), &|p| {
            let r = self.decode_part(parts[p], &section);
            *done[p].lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
        });
        let mut out = Vec::with_capacity(which.len());
        for d in done {
            let part = d.into_inner().unwrap_or_else(|e| e.into_inner());
            out.extend(part.ok_or("an index part was not decoded")??);
        }
        Ok(out)
    }

    /// `which` cut into contiguous parts of about equal chunk counts: one part per
    /// [`CHUNKS_PER_PART`] chunks, at most [`MAX_PARTS`].
    fn parts<'w>(&self, which: &'w [usize]) -> Vec<&'w [usize]> {
        let chunks: usize = which.iter().map(|&i| self.tensors[i].chunk_count).sum();
        let n = (chunks / CHUNKS_PER_PART).clamp(1, MAX_PARTS);
        let mut parts: Vec<&[usize]> = Vec::with_capacity(n);
        let (mut start, mut acc) = (0, 0);
        for (k, &i) in which.iter().enumerate() {
            acc += self.tensors[i].chunk_count;
            if acc * n >= chunks * (parts.len() + 1) && parts.len() + 1 < n {
                parts.push(&which[start..=k]);
                start = k + 1;
            }
        }
        parts.push(&which[start..]);
        parts
    }

    /// Decodes the sections of tensors `part` on the calling thread: a part of
    /// [`IndexHead::decode_some`]'s work.
    pub(crate) fn decode_part<'b>(
        &self,
        part: &[usize],
        section: &impl Fn(usize) -> &'b [u8],
    ) -> Result<Vec<TensorEntry>, String> {
        part.iter().map(|&i| self.tensor(i, section(i))).collect()
    }

    /// The index with `tensors` (decoded sections, in directory order) and every other tensor
    /// of the directory listed as omitted.
    pub(crate) fn into_index(self, tensors: Vec<TensorEntry>) -> CheckpointIndex {
        let mut held = tensors.iter().map(|t| t.key.as_str()).peekable();
        let omitted = self
            .tensors
            .into_iter()
            .filter(|d| {
                let here = held.peek() == Some(&d.key.as_str());
                if here {
                    held.next();
                }
                !here
            })
            .map(|d| d.key)
            .collect();
        let mut index = self.prelude.into_index(FORMAT_VERSION, tensors, self.objects);
        index.omitted_tensors = omitted;
        index
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_are_sorted_as_a_stable_sort_by_chunk_order_does() {
        let mut rng = crate::test_rng::TestRng::new(0x51ed_2701);
        let mut next = |n: u64| rng.below(n);
        for round in 0..400 {
            // Few distinct values, so that offsets repeat and chunks tie; offsets of 0 to 4 axes
            // (past three, the plain sort), sometimes mixed in one list.
            let ndim = next(5) as usize;
            let chunks: Vec<StoredChunk> = (0..next(40))
                .map(|i| {
                    let n = if next(8) == 0 { next(5) as usize } else { ndim };
                    let offset: Vec<u64> = (0..n).map(|_| next(3)).collect();
                    let flat = match next(3) {
                        0 => None,
                        _ => Some((next(3), 3 + next(2))),
                    };
                    // The byte offset tells chunks that tie apart: their order must be kept.
                    StoredChunk {
                        file: 0,
                        byte_offset: i,
                        offset: offset.as_slice().into(),
                        shape: Dims::default(),
                        flat,
                        crcs: Crcs::new(),
                    }
                })
                .collect();
            let mut want = chunks.clone();
            want.sort_by(chunk_order);
            let mut got = chunks;
            sort_chunks(&mut got);
            assert_eq!(got, want, "round {round}");
        }
    }

    #[test]
    fn chunks_outside_the_searched_range_never_meet_the_rows() {
        let mut rng = crate::test_rng::TestRng::new(0x9e37_79b9_u64);
        let mut next = |n: u64| rng.below(n);
        for _ in 0..500 {
            let rows = 1 + next(40);
            let chunks: Vec<StoredChunk> = (0..next(30))
                .map(|_| {
                    let r0 = next(rows);
                    let flat = if next(3) == 0 { Some((next(4), 4 + next(4))) } else { None };
                    StoredChunk {
                        file: 0,
                        byte_offset: 0,
                        offset: [r0, next(3)].as_slice().into(),
                        shape: [next(rows - r0 + 1), 1 + next(3)].as_slice().into(),
                        flat,
                        crcs: Crcs::new(),
                    }
                })
                .collect();
            let t = TensorEntry::new("t".into(), DType::F32, vec![rows, 8], chunks);
            assert!(t.chunks().is_sorted_by(|a, b| chunk_order(a, b).is_le()));
            let lo = next(rows + 1);
            let hi = lo + next(rows + 1 - lo);
            let range = t.chunks_meeting_rows(lo, hi);
            for (i, c) in t.chunks().iter().enumerate() {
                let meets = match t.search.row {
                    // Whole rows (by chance, or no chunks): by the elements held.
                    Some(row) => {
                        let first = c.offset[0] * row + c.flat.map_or(0, |f| f.0);
                        first < hi * row && first + c.numel() > lo * row
                    }
                    None => c.offset[0] < hi && c.offset[0] + c.shape[0] > lo,
                };
                assert!(!meets || range.contains(&i), "chunk {i} {c:?} meets rows {lo}..{hi}, range {range:?}");
            }
        }
    }

    #[test]
    fn whole_row_chunks_outside_the_searched_range_hold_none_of_the_rows() {
        let mut rng = crate::test_rng::TestRng::new(0x2545_f491_u64);
        let mut next = |n: u64| rng.below(n);
        for _ in 0..500 {
            // TP boxes of whole rows, each cut into flat ranges (or whole), 3 elements per row.
            let (row, boxes) = (3u64, 1 + next(5));
            let mut chunks = Vec::new();
            let mut r0 = 0;
            for _ in 0..boxes {
                let h = 1 + next(4);
                let n = h * row;
                let mut cuts: Vec<u64> = (0..next(4)).map(|_| next(n + 1)).collect();
                cuts.extend([0, n]);
                cuts.sort_unstable();
                cuts.dedup();
                for w in cuts.windows(2) {
                    let flat = if w == [0, n] && next(2) == 0 { None } else { Some((w[0], w[1])) };
                    let (offset, shape) = ([r0, 0].as_slice().into(), [h, row].as_slice().into());
                    chunks.push(StoredChunk { file: 0, byte_offset: 0, offset, shape, flat, crcs: Crcs::new() });
                }
                r0 += h;
            }
            let t = TensorEntry::new("t".into(), DType::F32, vec![r0, row], chunks);
            assert_eq!(t.search.row, Some(row));
            let lo = next(r0 + 1);
            let hi = lo + next(r0 + 1 - lo);
            let range = t.chunks_meeting_rows(lo, hi);
            for (i, c) in t.chunks().iter().enumerate() {
                let first = c.offset[0] * row + c.flat.map_or(0, |f| f.0);
                let holds = first < hi * row && first + c.numel() > lo * row;
                assert!(!holds || range.contains(&i), "chunk {i} {c:?} holds rows {lo}..{hi}, range {range:?}");
            }
        }
    }
}
