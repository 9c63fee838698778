//! Builders of hostile checkpoints, made byte by byte: a small pickle writer, stored zip archives
//! (`torch.save`), zstd frames of RLE blocks (huge output from a few bytes), and DCP directories
//! (`.metadata` + `__0_0.distcp`). Used by the library's hostile-input tests
//! (`tests/hostile_memory.rs`, `tests/hostile_shapes.rs`, …) and the CLI's `tests/hostile_rss.rs`.

use std::path::Path;

/// A value to pickle.
#[derive(Debug, Clone)]
pub enum P {
    /// `None`.
    None,
    /// `True` / `False`.
    Bool(bool),
    /// A non-negative integer.
    Int(u64),
    /// A string.
    Str(String),
    /// A tuple.
    Tuple(Vec<P>),
    /// A list.
    List(Vec<P>),
    /// A dict of (key, value) pairs, in order.
    Dict(Vec<(P, P)>),
    /// The global `module.name`.
    Global(&'static str, &'static str),
    /// `cls.__new__(cls)` with `BUILD` state.
    Obj(&'static str, &'static str, Box<P>),
    /// `callable(*args)`.
    Call(Box<P>, Vec<P>),
    /// A persistent id.
    Persistent(Box<P>),
    /// Raw opcodes, spliced in as they are.
    Raw(Vec<u8>),
}

/// The string `x`.
pub fn s(x: &str) -> P {
    P::Str(x.to_string())
}

/// Protocol 2 opcodes for `v`, then `STOP`.
pub fn pickle(v: &P) -> Vec<u8> {
    let mut out = vec![0x80, 2];
    emit(v, &mut out);
    out.push(b'.');
    out
}

fn emit(v: &P, out: &mut Vec<u8>) {
    match v {
        P::None => out.push(b'N'),
        P::Bool(b) => out.push(if *b { 0x88 } else { 0x89 }),
        P::Int(i) => {
            // LONG1: little-endian two's complement, with a zero sign byte.
            out.extend_from_slice(&[0x8a, 9]);
            out.extend_from_slice(&i.to_le_bytes());
            out.push(0);
        }
        P::Str(x) => {
            out.push(b'X');
            out.extend_from_slice(&(x.len() as u32).to_le_bytes());
            out.extend_from_slice(x.as_bytes());
        }
        P::Tuple(xs) => {
            out.push(b'(');
            xs.iter().for_each(|x| emit(x, out));
            out.push(b't');
        }
        P::List(xs) => {
            out.push(b']');
            if !xs.is_empty() {
                out.push(b'(');
                xs.iter().for_each(|x| emit(x, out));
                out.push(b'e');
            }
        }
        P::Dict(kv) => {
            out.push(b'}');
            if !kv.is_empty() {
                out.push(b'(');
                for (k, v) in kv {
                    emit(k, out);
                    emit(v, out);
                }
                out.push(b'u');
            }
        }
        P::Global(m, n) => {
            out.push(b'c');
            out.extend_from_slice(format!("{m}\n{n}\n").as_bytes());
        }
        P::Obj(m, n, state) => {
            emit(&P::Global(m, n), out);
            out.push(b')');
            out.push(0x81); // NEWOBJ
            emit(state, out);
            out.push(b'b'); // BUILD
        }
        P::Call(f, args) => {
            emit(f, out);
            emit(&P::Tuple(args.clone()), out);
            out.push(b'R');
        }
        P::Persistent(pid) => {
            emit(pid, out);
            out.push(b'Q');
        }
        P::Raw(b) => out.extend_from_slice(b),
    }
}

/// CRC-32 (IEEE, zip's), bit by bit: the tests' own reference.
pub fn crc32(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 != 0 { (crc >> 1) ^ 0xEDB8_8320 } else { crc >> 1 };
        }
    }
    !crc
}

/// A stored (uncompressed) zip archive of `entries`, with each entry's CRC-32 (which verify
/// and verified loads check).
pub fn zip(entries: &[(&str, &[u8])]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut central = Vec::new();
    for (name, data) in entries {
        let at = out.len() as u32;
        let n = data.len() as u32;
        let crc = crc32(data);
        out.extend_from_slice(&0x0403_4b50u32.to_le_bytes());
        out.extend_from_slice(&[20, 0, 0, 0, 0, 0, 0, 0, 0, 0]); // version, flags, method 0, time, date
        out.extend_from_slice(&crc.to_le_bytes());
        out.extend_from_slice(&n.to_le_bytes());
        out.extend_from_slice(&n.to_le_bytes());
        out.extend_from_slice(&(name.len() as u16).to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(data);

        central.extend_from_slice(&0x0201_4b50u32.to_le_bytes());
        central.extend_from_slice(&[20, 0, 20, 0, 0, 0, 0, 0, 0, 0, 0, 0]); // made by, needed, flags, method, time, date
        central.extend_from_slice(&crc.to_le_bytes());
        central.extend_from_slice(&n.to_le_bytes());
        central.extend_from_slice(&n.to_le_bytes());
        central.extend_from_slice(&(name.len() as u16).to_le_bytes());
        central.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 0]); // extra, comment, disk, internal attrs
        central.extend_from_slice(&0u32.to_le_bytes()); // external attrs
        central.extend_from_slice(&at.to_le_bytes());
        central.extend_from_slice(name.as_bytes());
    }
    let cd_off = out.len() as u32;
    out.extend_from_slice(&central);
    out.extend_from_slice(&0x0605_4b50u32.to_le_bytes());
    out.extend_from_slice(&[0, 0, 0, 0]);
    out.extend_from_slice(&(entries.len() as u16).to_le_bytes());
    out.extend_from_slice(&(entries.len() as u16).to_le_bytes());
    out.extend_from_slice(&(central.len() as u32).to_le_bytes());
    out.extend_from_slice(&cd_off.to_le_bytes());
    out.extend_from_slice(&0u16.to_le_bytes());
    out
}

/// The `torch.save` archive of one f32 tensor: `size`, `stride`, over a storage of `storage`.
pub fn torch_save_tensor(size: &[u64], stride: &[u64], storage: &[u8]) -> Vec<u8> {
    let ints = |xs: &[u64]| P::Tuple(xs.iter().map(|&x| P::Int(x)).collect());
    let pid = P::Tuple(vec![
        s("storage"),
        P::Global("torch", "FloatStorage"),
        s("0"),
        s("cpu"),
        P::Int(storage.len() as u64 / 4),
    ]);
    let tensor = P::Call(
        Box::new(P::Global("torch._utils", "_rebuild_tensor_v2")),
        vec![
            P::Persistent(Box::new(pid)),
            P::Int(0),
            ints(size),
            ints(stride),
            P::Bool(false),
            P::Call(Box::new(P::Global("collections", "OrderedDict")), vec![]),
        ],
    );
    zip(&[("archive/data.pkl", &pickle(&tensor)), ("archive/data/0", storage)])
}

/// A zstd frame (no content size, no checksum) of `blocks` RLE blocks of 128 KiB each: a few
/// bytes per block, 128 KiB of output per block.
pub fn zstd_rle_bomb(blocks: usize) -> Vec<u8> {
    let mut out = 0xFD2F_B528u32.to_le_bytes().to_vec();
    out.push(0x00); // frame header descriptor: no content size, not single segment, no checksum
    out.push(0x38); // window descriptor: 2^(10 + 7) = 128 KiB
    for i in 0..blocks {
        let last = (i + 1 == blocks) as u32;
        let header = last | (1 << 1) | ((128u32 << 10) << 3); // RLE block of 128 KiB
        out.extend_from_slice(&header.to_le_bytes()[..3]);
        out.push(0x41);
    }
    out
}

/// One item of a DCP checkpoint.
pub enum Item {
    /// A tensor `fqn` (f32, one chunk at the origin covering `size`): the item's bytes and
    /// its transforms (`["stream.zstd/1"]` for a zstd item).
    Tensor {
        /// The item's key.
        fqn: &'static str,
        /// The tensor's shape.
        size: Vec<u64>,
        /// Its stored bytes.
        data: Vec<u8>,
        /// The transforms its location names.
        transforms: Vec<&'static str>,
    },
    /// A byte item `fqn` whose location claims `length` bytes (the file may hold fewer).
    Bytes {
        /// The item's key.
        fqn: &'static str,
        /// Its stored bytes.
        data: Vec<u8>,
        /// The length its location claims (`None`: that of `data`).
        length: Option<u64>,
    },
}

/// The `.metadata` pickle of `items`, laid out back to back in `__0_0.distcp`, and that file.
pub fn dcp_metadata(items: &[Item]) -> (Vec<u8>, Vec<u8>) {
    dcp_metadata_with(items, P::None)
}

/// [`dcp_metadata`] with `planner` as the `Metadata`'s `planner_data` (which the reader reads
/// only for the paths of byte items).
pub fn dcp_metadata_with(items: &[Item], planner: P) -> (Vec<u8>, Vec<u8>) {
    let mut file = Vec::new();
    let mut sdm = Vec::new();
    let mut storage = Vec::new();
    let ints = |xs: &[u64]| P::Tuple(xs.iter().map(|&x| P::Int(x)).collect());
    for item in items {
        let (fqn, data, length, transforms, offsets) = match item {
            Item::Tensor { fqn, size, data, transforms } => {
                let zeros = vec![0u64; size.len()];
                let chunk = P::Obj(
                    "torch.distributed.checkpoint.metadata",
                    "ChunkStorageMetadata",
                    Box::new(P::Dict(vec![(s("offsets"), ints(&zeros)), (s("sizes"), ints(size))])),
                );
                let props = P::Obj(
                    "torch.distributed.checkpoint.metadata",
                    "TensorProperties",
                    Box::new(P::Dict(vec![(s("dtype"), P::Global("torch", "float32"))])),
                );
                let md = P::Obj(
                    "torch.distributed.checkpoint.metadata",
                    "TensorStorageMetadata",
                    Box::new(P::Dict(vec![
                        (s("properties"), props),
                        (s("size"), ints(size)),
                        (s("chunks"), P::List(vec![chunk])),
                    ])),
                );
                sdm.push((s(fqn), md));
                (*fqn, data, data.len() as u64, transforms.clone(), Some(zeros))
            }
            Item::Bytes { fqn, data, length } => {
                let md =
                    P::Obj("torch.distributed.checkpoint.metadata", "BytesStorageMetadata", Box::new(P::Dict(vec![])));
                sdm.push((s(fqn), md));
                (*fqn, data, length.unwrap_or(data.len() as u64), vec![], None)
            }
        };
        let index = P::Obj(
            "torch.distributed.checkpoint.metadata",
            "MetadataIndex",
            Box::new(P::Dict(vec![
                (s("fqn"), s(fqn)),
                (s("offset"), offsets.as_deref().map_or(P::None, ints)),
                (s("index"), P::None),
            ])),
        );
        let info = P::Obj(
            "torch.distributed.checkpoint.filesystem",
            "_StorageInfo",
            Box::new(P::Dict(vec![
                (s("relative_path"), s("__0_0.distcp")),
                (s("offset"), P::Int(file.len() as u64)),
                (s("length"), P::Int(length)),
                (s("transform_descriptors"), P::List(transforms.iter().map(|t| s(t)).collect())),
            ])),
        );
        storage.push((index, info));
        file.extend_from_slice(data);
    }
    let meta = P::Obj(
        "torch.distributed.checkpoint.metadata",
        "Metadata",
        Box::new(P::Dict(vec![
            (s("state_dict_metadata"), P::Dict(sdm)),
            (s("planner_data"), planner),
            (s("storage_data"), P::Dict(storage)),
        ])),
    );
    (pickle(&meta), file)
}

/// Writes a DCP checkpoint of `items` into `dir` (created).
pub fn write_dcp(dir: &Path, items: &[Item]) {
    let (meta, file) = dcp_metadata(items);
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join(".metadata"), meta).unwrap();
    std::fs::write(dir.join("__0_0.distcp"), file).unwrap();
}

/// A plain safetensors file holding one f32 tensor `w` (value 1.5) of `axes` axes of length
/// 1: 2 bytes of header per axis (60,000 axes in 120 KB).
pub fn plain_safetensors(axes: usize) -> Vec<u8> {
    let shape = vec!["1"; axes].join(",");
    let header = format!(r#"{{"w":{{"dtype":"F32","shape":[{shape}],"data_offsets":[0,4]}}}}"#);
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(&1.5f32.to_le_bytes());
    bytes
}

/// A list of `n` values of one opcode each (`value`: `N` for `None`, `[b'K', x]` for the
/// small integer `x`), appended in batches of 1000 as Python writes lists: a pickle made of
/// millions of plain values, one or two bytes each.
pub fn plain_values(n: usize, value: &[u8]) -> P {
    let mut v = vec![b']'];
    for start in (0..n).step_by(1000) {
        v.push(b'(');
        for _ in start..n.min(start + 1000) {
            v.extend_from_slice(value);
        }
        v.push(b'e');
    }
    P::Raw(v)
}

/// A one-tensor DCP checkpoint in `dir` whose `.metadata` also holds `planner` (see
/// [`dcp_metadata_with`]).
pub fn write_dcp_with(dir: &Path, planner: P) {
    let item = torch_save_tensor(&[4], &[1], &[0u8; 16]);
    let (meta, file) =
        dcp_metadata_with(&[Item::Tensor { fqn: "w", size: vec![4], data: item, transforms: vec![] }], planner);
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join(".metadata"), meta).unwrap();
    std::fs::write(dir.join("__0_0.distcp"), file).unwrap();
}

/// A pickle whose memo shares one `len`-byte string `copies` times: `len + 2 * copies` bytes
/// that a naive unpickler expands to `len * copies`.
pub fn memo_sharing_bomb(len: usize, copies: usize) -> Vec<u8> {
    let mut v = vec![0x80, 2, b']', b'(']; // EMPTY_LIST, MARK
    v.push(b'X');
    v.extend_from_slice(&(len as u32).to_le_bytes());
    v.extend(std::iter::repeat_n(b'a', len));
    v.extend_from_slice(&[b'q', 0]); // BINPUT 0
    for _ in 1..copies {
        v.extend_from_slice(&[b'h', 0]); // BINGET 0
    }
    v.extend_from_slice(b"e.");
    v
}

/// A pickle of a list of `n` `None`s: `n + 6` bytes.
pub fn nones(n: usize) -> Vec<u8> {
    let mut v = vec![0x80, 2, b']', b'('];
    v.extend(std::iter::repeat_n(b'N', n));
    v.extend_from_slice(b"e.");
    v
}

/// Total size of the files under `dir`.
pub fn dir_size(dir: &Path) -> u64 {
    let mut total = 0;
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        let m = e.metadata().unwrap();
        total += if m.is_dir() { dir_size(&e.path()) } else { m.len() };
    }
    total
}

/// Writes opcodes as Python's pickler does at protocol 4 (`SHORT_BINUNICODE` + `MEMOIZE`,
/// `STACK_GLOBAL`, memo gets for every value seen before), straight into bytes: the builder for
/// pickles of millions of entries, which a tree of [`P`] values would take gigabytes to hold.
pub struct Pickler {
    /// The pickle so far.
    pub out: Vec<u8>,
    memo: u32,
}

impl Pickler {
    /// `PROTO 4`.
    pub fn new() -> Self {
        Pickler { out: vec![0x80, 4], memo: 0 }
    }
    /// `MEMOIZE`: the memo index of the value on top of the stack.
    pub fn memoize(&mut self) -> u32 {
        self.out.push(0x94);
        self.memo += 1;
        self.memo - 1
    }
    /// A string, memoized.
    pub fn str(&mut self, x: &str) -> u32 {
        if x.len() < 256 {
            self.out.extend_from_slice(&[0x8c, x.len() as u8]);
        } else {
            self.out.push(b'X');
            self.out.extend_from_slice(&(x.len() as u32).to_le_bytes());
        }
        self.out.extend_from_slice(x.as_bytes());
        self.memoize()
    }
    /// `BINGET` or `LONG_BINGET` of memo entry `i`.
    pub fn get(&mut self, i: u32) {
        match u8::try_from(i) {
            Ok(b) => self.out.extend_from_slice(&[b'h', b]),
            Err(_) => {
                self.out.push(b'j');
                self.out.extend_from_slice(&i.to_le_bytes());
            }
        }
    }
    /// The string `x`, memoized under `*slot` the first time and fetched from the memo after.
    pub fn str_once(&mut self, slot: &mut Option<u32>, x: &str) {
        match *slot {
            Some(i) => self.get(i),
            None => *slot = Some(self.str(x)),
        }
    }
    /// The global `module.name` (`STACK_GLOBAL`), memoized under `*slot` the first time;
    /// `module` is the memo entry of the module's name.
    pub fn global_once(&mut self, slot: &mut Option<u32>, module: &mut Option<u32>, m: &str, name: &str) {
        if let Some(i) = *slot {
            return self.get(i);
        }
        self.str_once(module, m);
        self.str(name);
        self.out.push(0x93);
        *slot = Some(self.memoize());
    }
    /// A non-negative integer: `BININT1`, `BININT2` or `BININT`.
    pub fn int(&mut self, x: u32) {
        if x < 256 {
            self.out.extend_from_slice(&[b'K', x as u8]);
        } else if x < 65_536 {
            self.out.push(b'M');
            self.out.extend_from_slice(&(x as u16).to_le_bytes());
        } else {
            self.out.push(b'J');
            self.out.extend_from_slice(&(x as i32).to_le_bytes());
        }
    }
    /// `cls()` made with `EMPTY_TUPLE NEWOBJ`, `cls` being on the stack, memoized.
    pub fn new_obj(&mut self) {
        self.out.extend_from_slice(&[b')', 0x81]);
        self.memoize();
    }
    /// An empty dict, memoized, and the `MARK` of its first batch of items.
    pub fn dict_start(&mut self) {
        self.out.push(b'}');
        self.memoize();
        self.out.push(b'(');
    }
}

impl Default for Pickler {
    fn default() -> Self {
        Self::new()
    }
}

/// The DCP checkpoint torch writes for a flat state dict of `n` non-tensor values and one
/// tensor (`torch.distributed.checkpoint.save`, torch 2.x, one or more ranks): its `.metadata`
/// holds `n` `BytesStorageMetadata` entries, each with its `planner_data` path (`(fqn,)`) and its
/// `_StorageInfo`, pickled op for op as torch's pickler writes them (names and classes shared
/// through the memo; items in batches of 1000). Every item `optim.param_groups.{i}.lr` points
/// at `item`, stored once at the start of each of `files` data files `__{r}_0.distcp` (item `i`
/// in file `i % files`), and the tensor `w` (f32 [4]) follows it in file 0. Returns the
/// `.metadata` and the data files' names and bytes.
pub fn dcp_byte_items(n: usize, files: usize, item: &[u8]) -> (Vec<u8>, Vec<(String, Vec<u8>)>) {
    let tensor = torch_save_tensor(&[4], &[1], &[0u8; 16]);
    let names: Vec<String> = (0..files).map(|r| format!("__{r}_0.distcp")).collect();
    let mut data: Vec<(String, Vec<u8>)> = names.iter().map(|f| (f.clone(), item.to_vec())).collect();
    data[0].1.extend_from_slice(&tensor);
    let fqn = |i: usize| format!("optim.param_groups.{i}.lr");
    let mut p = Pickler::new();
    let (mut metadata_mod, mut filesystem_mod) = (None, None);
    let (mut bsm, mut mi, mut si) = (None, None, None);
    let mut keys: [Option<u32>; 6] = [None; 6]; // fqn, index, relative_path, offset, length, offset (tensor)
    let mut file_names: Vec<Option<u32>> = vec![None; files];
    let mut fqn_memo = Vec::with_capacity(n);

    let mut top = None;
    p.global_once(&mut top, &mut metadata_mod, "torch.distributed.checkpoint.metadata", "Metadata");
    p.new_obj();
    p.dict_start();

    // state_dict_metadata: the tensor, then the byte items.
    p.str("state_dict_metadata");
    p.dict_start();
    let w = p.str("w");
    let mut tsm = None;
    p.global_once(&mut tsm, &mut metadata_mod, "torch.distributed.checkpoint.metadata", "TensorStorageMetadata");
    p.new_obj();
    p.dict_start();
    p.str("properties");
    let mut props = None;
    p.global_once(&mut props, &mut metadata_mod, "torch.distributed.checkpoint.metadata", "TensorProperties");
    p.new_obj();
    // Its state as torch ≥ 2.0 pickles it: (dtype, layout, requires_grad, memory_format,
    // pin_memory, strides).
    p.out.push(b'(');
    let (mut torch_mod, mut f32_global, mut layout, mut serialization) = (None, None, None, None);
    p.global_once(&mut f32_global, &mut torch_mod, "torch", "float32");
    p.global_once(&mut layout, &mut serialization, "torch.serialization", "_get_layout");
    p.str("torch.strided");
    p.out.push(0x85);
    p.memoize();
    p.out.push(b'R');
    p.memoize();
    p.out.push(0x89); // NEWFALSE
    let mut mem_format = None;
    p.global_once(&mut mem_format, &mut metadata_mod, "torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING");
    p.out.extend_from_slice(&[b'K', 0, 0x85]);
    p.memoize();
    p.out.push(b'R');
    p.memoize();
    p.out.push(0x89);
    p.out.extend_from_slice(&[b'K', 1, 0x85]);
    p.memoize();
    p.out.push(b't');
    p.memoize();
    p.out.push(b'b');
    p.str("size");
    p.out.push(b'(');
    p.int(4);
    p.out.push(b't');
    p.memoize();
    p.str("chunks");
    p.out.push(b']');
    p.memoize();
    let mut csm = None;
    p.global_once(&mut csm, &mut metadata_mod, "torch.distributed.checkpoint.metadata", "ChunkStorageMetadata");
    p.new_obj();
    p.dict_start();
    p.str("offsets");
    p.out.extend_from_slice(&[b'(', b'K', 0, b't']);
    p.memoize();
    p.str("sizes");
    p.out.extend_from_slice(&[b'(', b'K', 4, b't']);
    p.memoize();
    p.out.extend_from_slice(b"ub"); // the chunk's fields, BUILD
    p.out.extend_from_slice(b"a"); // APPEND to chunks
    p.out.extend_from_slice(b"ub"); // the tensor metadata's fields, BUILD
    for i in 0..n {
        if i > 0 && i % 1000 == 0 {
            p.out.extend_from_slice(b"u(");
        }
        fqn_memo.push(p.str(&fqn(i)));
        p.global_once(&mut bsm, &mut metadata_mod, "torch.distributed.checkpoint.metadata", "BytesStorageMetadata");
        p.new_obj();
    }
    p.out.push(b'u');

    // planner_data: each key's path in the state dict, `(fqn,)` for a flat one.
    p.str("planner_data");
    p.dict_start();
    p.get(w);
    p.get(w);
    p.out.push(0x85); // TUPLE1
    p.memoize();
    for (i, &f) in fqn_memo.iter().enumerate() {
        if i % 1000 == 999 {
            p.out.extend_from_slice(b"u(");
        }
        p.get(f);
        p.get(f);
        p.out.push(0x85);
        p.memoize();
    }
    p.out.push(b'u');

    // storage_data: MetadataIndex → _StorageInfo.
    p.str("storage_data");
    p.dict_start();
    let item_len = item.len() as u32;
    let mut entry = |p: &mut Pickler, fqn: u32, file: usize, offset: u32, length: u32, chunk: bool| {
        p.global_once(&mut mi, &mut metadata_mod, "torch.distributed.checkpoint.metadata", "MetadataIndex");
        p.new_obj();
        p.dict_start();
        p.str_once(&mut keys[0], "fqn");
        p.get(fqn);
        if chunk {
            p.str_once(&mut keys[5], "offset");
            p.out.extend_from_slice(&[b'(', b'K', 0, b't']);
            p.memoize();
        }
        p.str_once(&mut keys[1], "index");
        p.out.push(b'N');
        p.out.extend_from_slice(b"ub");
        p.global_once(&mut si, &mut filesystem_mod, "torch.distributed.checkpoint.filesystem", "_StorageInfo");
        p.new_obj();
        p.dict_start();
        p.str_once(&mut keys[2], "relative_path");
        p.str_once(&mut file_names[file], &names[file]);
        p.str_once(&mut keys[3], "offset");
        p.int(offset);
        p.str_once(&mut keys[4], "length");
        p.int(length);
        p.out.extend_from_slice(b"ub");
    };
    entry(&mut p, w, 0, item_len, tensor.len() as u32, true);
    for (i, &f) in fqn_memo.iter().enumerate() {
        if i % 1000 == 999 {
            p.out.extend_from_slice(b"u(");
        }
        entry(&mut p, f, i % files, 0, item_len, false);
    }
    p.out.push(b'u');

    p.str("version");
    p.str("1.0.0");
    p.out.extend_from_slice(b"ub.");
    (p.out, data)
}

/// The `torch.save` archive of a plain value: `value`'s opcodes as `data.pkl` (what DCP
/// stores for each non-tensor value of a state dict).
pub fn torch_save_value(value: &P) -> Vec<u8> {
    zip(&[("archive/data.pkl", &pickle(value)), ("archive/byteorder", b"little"), ("archive/version", b"3\n")])
}
