//! The stack machine: an arena of values under construction, the stack and memo of ids into
//! it, reading the input, and the loop that hands each opcode to its family in `handlers`.
//!
//! The arena is compact, because a pickle is mostly small values and the arena is what the
//! memory of a `.metadata` of millions of values is made of (issue 29): a node is 16 bytes and
//! `Copy`; small non-negative integers, `None` and the bools are not nodes at all but ids of
//! their own ([`inline`]); strings, bytes and big integers are ranges of the input (or of the
//! machine's own text, when decoding changed them), not copies; tuples and call arguments,
//! which never change once made, share one pool of ids; the memo is a vector while the pickle
//! numbers its entries in order, as every pickler does. Lists, dicts and objects, which later
//! opcodes change, keep their own vectors in side tables.

use std::collections::hash_map::RandomState;
use std::collections::HashMap;

use super::opcodes::*;
use super::UnpickleLimits;
use crate::error::{Error, Result};

/// A value of the arena: a node's index, or an inline scalar (see [`inline`]).
pub(super) type Id = u32;

/// Ids from here on are not nodes: they stand for `None`, `False`, `True`, then the integers
/// from 0 up (`INLINE + 3 + n` is the integer `n`). Most integers of real pickles (offsets,
/// sizes, indices) and every `None` and bool cost 4 bytes, as an id, and no node.
const INLINE: Id = 1 << 31;
/// Largest integer stored inline.
const INLINE_MAX: i64 = (u32::MAX - INLINE - 3) as i64;

/// The id of a scalar stored inline, if it is one (see [`INLINE`]).
pub(super) fn inline(node: &Node) -> Option<Id> {
    match *node {
        Node::None => Some(INLINE),
        Node::Bool(b) => Some(INLINE + 1 + Id::from(b)),
        Node::Int(i) if (0..=INLINE_MAX).contains(&i) => Some(INLINE + 3 + i as Id),
        _ => None,
    }
}

/// Where the text of a string, bytes or big integer is: `at` in the input, or, with
/// [`OWN_TEXT`] set, in the machine's own text.
pub(super) const OWN_TEXT: u64 = 1 << 63;

/// One value under construction; 16 bytes. Containers refer to their items by id (in the
/// pool, or in a side table for those later opcodes change), so that every reference to a
/// container sees later mutations (`APPEND` after a memo `GET`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Node {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    /// UTF-8 text (checked when made) of `len` bytes at `at` (see [`OWN_TEXT`]).
    Str {
        len: u32,
        at: u64,
    },
    Bytes {
        len: u32,
        at: u64,
    },
    /// Little-endian two's complement, too large for `Int`.
    BigInt {
        len: u32,
        at: u64,
    },
    /// A global: its module and name in [`Machine::globals`].
    Global(u32),
    /// A list: its items in [`Machine::lists`].
    List(u32),
    /// A tuple: `len` items from `at` in [`Machine::pool`].
    Tuple {
        len: u32,
        at: u64,
    },
    /// A dict: its items in [`Machine::keyeds`].
    Dict(u32),
    /// A set or frozenset: its items in [`Machine::keyeds`].
    Set(u32),
    /// An object: in [`Machine::objects`].
    Object(u32),
    Persistent(Id),
}

/// A range of text (see [`OWN_TEXT`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Text {
    pub(super) at: u64,
    pub(super) len: u32,
}

/// Ids held inline up to [`SMALL_IDS`], on the heap beyond: most dicts of a pickle are the
/// two or three fields of an object, and a heap vector each would cost more than they hold.
#[derive(Debug, Clone)]
pub(super) enum SmallIds {
    Inline(u8, [Id; SMALL_IDS]),
    Heap(Vec<Id>),
}

/// Ids a [`SmallIds`] holds inline.
const SMALL_IDS: usize = 6;

impl Default for SmallIds {
    fn default() -> Self {
        SmallIds::Inline(0, [0; SMALL_IDS])
    }
}

impl SmallIds {
    pub(super) fn push(&mut self, id: Id) {
        match self {
            SmallIds::Inline(n, a) if (*n as usize) < SMALL_IDS => {
                a[*n as usize] = id;
                *n += 1;
            }
            SmallIds::Inline(n, a) => {
                let mut v = Vec::with_capacity(2 * SMALL_IDS);
                v.extend_from_slice(&a[..*n as usize]);
                v.push(id);
                *self = SmallIds::Heap(v);
            }
            SmallIds::Heap(v) => v.push(id),
        }
    }
}

impl std::ops::Deref for SmallIds {
    type Target = [Id];
    fn deref(&self) -> &[Id] {
        match self {
            SmallIds::Inline(n, a) => &a[..*n as usize],
            SmallIds::Heap(v) => v,
        }
    }
}

impl std::ops::DerefMut for SmallIds {
    fn deref_mut(&mut self) -> &mut [Id] {
        match self {
            SmallIds::Inline(n, a) => &mut a[..*n as usize],
            SmallIds::Heap(v) => v,
        }
    }
}

/// Keys (and, for dicts, values, interleaved after their key) with, past a few keys, a hash
/// index to deduplicate keys as Python does.
#[derive(Default)]
pub(super) struct Keyed {
    /// `key` or `key, value` per entry.
    pub(super) items: SmallIds,
    /// Whether entries are pairs (a dict's items, keyword arguments) or keys (a set).
    pub(super) pairs: bool,
    /// Built once there are more than a few keys (small dicts are searched key by key).
    pub(super) index: Option<Box<KeyIndex>>,
}

/// Positions of the hashable keys of a [`Keyed`], by hash: the first of each hash, and after
/// each position the next with the same hash.
#[derive(Default)]
pub(super) struct KeyIndex {
    pub(super) first: HashMap<u64, u32>,
    pub(super) next: Vec<u32>,
}

impl Keyed {
    /// An empty dict's items (pairs) or set's keys.
    pub(super) fn new(pairs: bool) -> Self {
        Keyed { items: SmallIds::default(), pairs, index: None }
    }
    /// Entries held.
    pub(super) fn len(&self) -> usize {
        if self.pairs {
            self.items.len() / 2
        } else {
            self.items.len()
        }
    }
    pub(super) fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
    /// Key of entry `i`.
    pub(super) fn key(&self, i: usize) -> Id {
        self.items[if self.pairs { 2 * i } else { i }]
    }
    /// Keys in order.
    pub(super) fn keys(&self) -> impl Iterator<Item = Id> + '_ {
        self.items.iter().step_by(if self.pairs { 2 } else { 1 }).copied()
    }
    /// `(key, value)` of every entry (pairs only).
    pub(super) fn pairs(&self) -> impl Iterator<Item = (Id, Id)> + '_ {
        self.items.chunks_exact(2).map(|c| (c[0], c[1]))
    }
}

/// Which key collection of a node an insertion goes to.
#[derive(Clone, Copy)]
pub(super) enum Slot {
    /// A dict's items, or a set's elements.
    Main,
    /// An object's `dict_items`.
    ObjItems,
}

/// An unevaluated call or class instance.
pub(super) struct ObjNode {
    /// A `Global` node.
    pub(super) class: Id,
    /// Arguments: `args_len` ids from `args_at` in the pool.
    pub(super) args_at: u64,
    pub(super) args_len: u32,
    pub(super) state: Option<Id>,
    /// `state` is a dict this object made by merging (no one else refers to it).
    pub(super) state_owned: bool,
    /// What few objects have (keyword arguments, items of list and dict subclasses).
    pub(super) extra: Option<Box<ObjExtra>>,
}

/// The rarely used parts of an [`ObjNode`].
pub(super) struct ObjExtra {
    pub(super) kwargs: Keyed,
    pub(super) list_items: Vec<Id>,
    pub(super) dict_items: Keyed,
}

impl Default for ObjExtra {
    fn default() -> Self {
        ObjExtra { kwargs: Keyed::new(true), list_items: Vec::new(), dict_items: Keyed::new(true) }
    }
}

/// Entries per segment of [`Segmented`].
const SEGMENT: usize = 1 << 16;

/// A vector grown in fixed segments: no reallocation copies the whole (a vector that doubles
/// holds three times its size for a moment, and up to twice it for good).
pub(super) struct Segmented<T> {
    segs: Vec<Vec<T>>,
    len: usize,
}

impl<T> Segmented<T> {
    fn new() -> Self {
        Segmented { segs: Vec::new(), len: 0 }
    }
    pub(super) fn len(&self) -> usize {
        self.len
    }
    pub(super) fn push(&mut self, x: T) {
        if self.len.is_multiple_of(SEGMENT) {
            self.segs.push(Vec::with_capacity(SEGMENT));
        }
        if let Some(seg) = self.segs.last_mut() {
            seg.push(x);
        }
        self.len += 1;
    }
    pub(super) fn get(&self, i: usize) -> Option<&T> {
        self.segs.get(i / SEGMENT).and_then(|s| s.get(i % SEGMENT))
    }
    pub(super) fn get_mut(&mut self, i: usize) -> Option<&mut T> {
        self.segs.get_mut(i / SEGMENT).and_then(|s| s.get_mut(i % SEGMENT))
    }
    pub(super) fn iter_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.segs.iter_mut().flatten()
    }
}

/// The unpickler's state: the input and where it is read, the arena of values built, the stack
/// and memo of ids into it, what has been charged to the limits, and the key deduplication's
/// caches.
pub(super) struct Machine<'a> {
    pub(super) data: &'a [u8],
    pub(super) pos: usize,
    /// Offset of the opcode being executed (for errors).
    pub(super) op_pos: usize,
    pub(super) origin: &'a str,
    pub(super) limits: UnpickleLimits,
    pub(super) nodes: Segmented<Node>,
    /// Text the unpickler made (decoded escapes, repaired UTF-8, big integers, encoded bytes).
    pub(super) own: Vec<u8>,
    /// Module and name of each global.
    pub(super) globals: Vec<(Text, Text)>,
    /// Items of tuples and arguments of objects.
    pub(super) pool: Segmented<Id>,
    pub(super) lists: Vec<Vec<Id>>,
    pub(super) keyeds: Segmented<Keyed>,
    pub(super) objects: Segmented<ObjNode>,
    pub(super) stack: Vec<Id>,
    /// Stack lengths at each `MARK`.
    pub(super) marks: Vec<usize>,
    /// Memo entries `0..memo.len()`, as picklers number them; any other index in `memo_far`.
    pub(super) memo: Vec<Id>,
    pub(super) memo_far: HashMap<u64, Id>,
    /// The node of `()`, once made.
    pub(super) empty_tuple: Option<Id>,
    /// Values pushed or copied so far.
    pub(super) values: usize,
    /// String and bytes payload so far.
    pub(super) bytes: usize,
    pub(super) hasher: RandomState,
    /// Hashes of tuples used as keys (other keys are hashed again when needed).
    pub(super) hash_cache: HashMap<Id, Option<u64>>,
    /// Union-find over keys found equal, so that each is compared in full once.
    pub(super) alias: HashMap<Id, Id>,
}

impl<'a> Machine<'a> {
    pub(super) fn new(data: &'a [u8], origin: &'a str, limits: &UnpickleLimits) -> Self {
        Machine {
            data,
            pos: 0,
            op_pos: 0,
            origin,
            limits: *limits,
            nodes: Segmented::new(),
            own: Vec::new(),
            globals: Vec::new(),
            pool: Segmented::new(),
            lists: Vec::new(),
            keyeds: Segmented::new(),
            objects: Segmented::new(),
            stack: Vec::new(),
            marks: Vec::new(),
            memo: Vec::new(),
            memo_far: HashMap::new(),
            empty_tuple: None,
            values: 0,
            bytes: 0,
            hasher: RandomState::new(),
            hash_cache: HashMap::new(),
            alias: HashMap::new(),
        }
    }

    pub(super) fn err(&self, what: impl std::fmt::Display) -> Error {
        Error::corrupt(self.origin, format!("pickle: at byte {}: {what}", self.op_pos))
    }

    /// Drops what only running the opcodes needs (stack, memo, key caches), keeping the values.
    pub(super) fn finish_run(&mut self) {
        self.stack = Vec::new();
        self.marks = Vec::new();
        self.memo = Vec::new();
        self.memo_far = HashMap::new();
        self.hash_cache = HashMap::new();
        self.alias = HashMap::new();
        for k in self.keyeds.iter_mut() {
            k.index = None;
        }
    }

    // --- input -------------------------------------------------------------------------------

    pub(super) fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let data = self.data;
        let end = self.pos.checked_add(n).filter(|&e| e <= data.len()).ok_or_else(|| self.err("truncated input"))?;
        let s = data.get(self.pos..end).ok_or_else(|| self.err("truncated input"))?;
        self.pos = end;
        Ok(s)
    }

    pub(super) fn take_array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    pub(super) fn u8(&mut self) -> Result<u8> {
        Ok(self.take_array::<1>()?[0])
    }

    pub(super) fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.take_array()?))
    }

    pub(super) fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take_array()?))
    }

    pub(super) fn i32(&mut self) -> Result<i32> {
        Ok(i32::from_le_bytes(self.take_array()?))
    }

    pub(super) fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take_array()?))
    }

    /// A line without its `\n`.
    pub(super) fn line(&mut self) -> Result<&'a [u8]> {
        let data = self.data;
        let rest = data.get(self.pos..).unwrap_or_default();
        let n = rest.iter().position(|&b| b == b'\n').ok_or_else(|| self.err("truncated input (no end of line)"))?;
        self.pos += n + 1;
        Ok(&rest[..n])
    }

    /// A UTF-8 line, as the range of the input it is.
    pub(super) fn utf8_line(&mut self) -> Result<Text> {
        let start = self.pos;
        let line = self.line()?;
        std::str::from_utf8(line).map_err(|_| self.err("text argument is not UTF-8"))?;
        self.input_text(start, line.len())
    }

    /// `n` payload bytes: checked against the input left before anything is allocated, then
    /// charged to `max_bytes`.
    pub(super) fn payload(&mut self, n: u64) -> Result<&'a [u8]> {
        let left = self.data.len().saturating_sub(self.pos);
        let n = usize::try_from(n)
            .ok()
            .filter(|&n| n <= left)
            .ok_or_else(|| self.err(format!("truncated input (a length of {n} bytes with {left} bytes left)")))?;
        self.charge_bytes(n)?;
        self.take(n)
    }

    // --- text ----------------------------------------------------------------------------------

    /// The range of `len` input bytes at `start`.
    pub(super) fn input_text(&self, start: usize, len: usize) -> Result<Text> {
        let len = u32::try_from(len).map_err(|_| self.err(format!("a text of {len} bytes (4 GiB or more)")))?;
        Ok(Text { at: start as u64, len })
    }

    /// The range of `s`, a slice of the input.
    pub(super) fn text_of_input(&self, s: &[u8]) -> Result<Text> {
        let start = (s.as_ptr() as usize).wrapping_sub(self.data.as_ptr() as usize);
        if start > self.data.len() || s.len() > self.data.len() - start {
            return Err(self.err("internal: text outside the input"));
        }
        self.input_text(start, s.len())
    }

    /// `bytes` appended to the machine's own text.
    pub(super) fn own_text(&mut self, bytes: &[u8]) -> Result<Text> {
        let len = u32::try_from(bytes.len()).map_err(|_| self.err(format!("a text of {} bytes", bytes.len())))?;
        let at = self.own.len() as u64 | OWN_TEXT;
        self.own.extend_from_slice(bytes);
        Ok(Text { at, len })
    }

    /// The bytes of a text range.
    pub(super) fn text(&self, t: Text) -> &[u8] {
        let (buf, at) = if t.at & OWN_TEXT != 0 { (&self.own[..], t.at & !OWN_TEXT) } else { (self.data, t.at) };
        let at = at as usize;
        buf.get(at..at + t.len as usize).unwrap_or_default()
    }

    /// A text range as `str` (every string node is UTF-8 when made).
    pub(super) fn text_str(&self, t: Text) -> &str {
        std::str::from_utf8(self.text(t)).unwrap_or_default()
    }

    // --- stack ---------------------------------------------------------------------------------

    /// Adds a value: an inline id for small scalars, else a new node.
    pub(super) fn alloc(&mut self, node: Node) -> Result<Id> {
        self.charge_values(1)?;
        if let Some(id) = inline(&node) {
            return Ok(id);
        }
        let id = self.nodes.len();
        if id >= INLINE as usize {
            return Err(self.err(format!("more than {INLINE} values")));
        }
        self.nodes.push(node);
        Ok(id as Id)
    }

    pub(super) fn push_new(&mut self, node: Node) -> Result<()> {
        let id = self.alloc(node)?;
        self.stack.push(id);
        Ok(())
    }

    pub(super) fn push_existing(&mut self, id: Id) -> Result<()> {
        self.charge_values(1)?;
        self.stack.push(id);
        Ok(())
    }

    pub(super) fn floor(&self) -> usize {
        self.marks.last().copied().unwrap_or(0)
    }

    pub(super) fn pop(&mut self) -> Result<Id> {
        if self.stack.len() <= self.floor() {
            return Err(self.err("stack underflow"));
        }
        self.stack.pop().ok_or_else(|| self.err("stack underflow"))
    }

    pub(super) fn top(&self) -> Result<Id> {
        if self.stack.len() <= self.floor() {
            return Err(self.err("stack underflow"));
        }
        self.stack.last().copied().ok_or_else(|| self.err("stack underflow"))
    }

    pub(super) fn pop_mark(&mut self) -> Result<Vec<Id>> {
        let m = self.marks.pop().ok_or_else(|| self.err("missing MARK"))?;
        if m > self.stack.len() {
            return Err(self.err("stack underflow"));
        }
        Ok(self.stack.split_off(m))
    }

    /// The number of memo entries (what `MEMOIZE` numbers the next one).
    pub(super) fn memo_len(&self) -> u64 {
        (self.memo.len() + self.memo_far.len()) as u64
    }

    pub(super) fn memo_get(&mut self, i: u64) -> Result<()> {
        let id =
            usize::try_from(i).ok().and_then(|i| self.memo.get(i).copied()).or_else(|| self.memo_far.get(&i).copied());
        let id = id.ok_or_else(|| self.err(format!("bad memo index {i}")))?;
        self.push_existing(id)
    }

    pub(super) fn memo_put(&mut self, i: u64) -> Result<()> {
        let id = self.top()?;
        match usize::try_from(i) {
            Ok(i) if i < self.memo.len() => self.memo[i] = id,
            Ok(i) if i == self.memo.len() => {
                self.memo.push(id);
                self.memo_far.remove(&(i as u64));
            }
            _ => {
                self.memo_far.insert(i, id);
            }
        }
        Ok(())
    }

    // --- node access -----------------------------------------------------------------------------

    /// The value `id` stands for (a copy: nodes are small).
    pub(super) fn node(&self, id: Id) -> Result<Node> {
        self.get(id).ok_or_else(|| self.err("internal: bad node id"))
    }

    /// [`Machine::node`], `None` for a bad id.
    pub(super) fn get(&self, id: Id) -> Option<Node> {
        if id >= INLINE {
            return Some(match id - INLINE {
                0 => Node::None,
                1 => Node::Bool(false),
                2 => Node::Bool(true),
                n => Node::Int(i64::from(n - 3)),
            });
        }
        self.nodes.get(id as usize).copied()
    }

    pub(super) fn str_of(&self, id: Id) -> Option<&str> {
        match self.get(id)? {
            Node::Str { len, at } => Some(self.text_str(Text { at, len })),
            _ => None,
        }
    }

    /// The text range of a string node.
    pub(super) fn str_text(&self, id: Id) -> Option<Text> {
        match self.get(id)? {
            Node::Str { len, at } => Some(Text { at, len }),
            _ => None,
        }
    }

    /// `(module, name)` of a global node.
    pub(super) fn global_of(&self, id: Id) -> Option<(&str, &str)> {
        match self.get(id)? {
            Node::Global(g) => {
                let (m, n) = *self.globals.get(g as usize)?;
                Some((self.text_str(m), self.text_str(n)))
            }
            _ => None,
        }
    }

    pub(super) fn is_global(&self, id: Id) -> bool {
        matches!(self.get(id), Some(Node::Global(_)))
    }

    /// `len` pool ids from `at`.
    pub(super) fn pooled(&self, at: u64, len: u32) -> Vec<Id> {
        (at..at + u64::from(len)).filter_map(|i| self.pool.get(i as usize).copied()).collect()
    }

    /// Ids appended to the pool: where they start.
    pub(super) fn pool_ids(&mut self, ids: &[Id]) -> Result<(u64, u32)> {
        let len = u32::try_from(ids.len()).map_err(|_| self.err("a tuple of 2^32 items or more"))?;
        let at = self.pool.len() as u64;
        for &id in ids {
            self.pool.push(id);
        }
        Ok((at, len))
    }

    /// A new tuple of `items`. Empty tuples are one node (as in Python, `()` is one object):
    /// every `NEWOBJ` of a pickle has one.
    pub(super) fn new_tuple(&mut self, items: &[Id]) -> Result<Id> {
        if items.is_empty() {
            if let Some(id) = self.empty_tuple {
                self.charge_values(1)?;
                return Ok(id);
            }
        }
        let (at, len) = self.pool_ids(items)?;
        let id = self.alloc(Node::Tuple { len, at })?;
        if items.is_empty() {
            self.empty_tuple = Some(id);
        }
        Ok(id)
    }

    /// A new list of `items`.
    pub(super) fn new_list(&mut self, items: Vec<Id>) -> Result<Id> {
        let i = u32::try_from(self.lists.len()).map_err(|_| self.err("too many lists"))?;
        let id = self.alloc(Node::List(i))?;
        self.lists.push(items);
        Ok(id)
    }

    /// A new empty dict (`pairs`) or set.
    pub(super) fn new_keyed(&mut self, pairs: bool) -> Result<Id> {
        let i = u32::try_from(self.keyeds.len()).map_err(|_| self.err("too many dicts"))?;
        let id = self.alloc(if pairs { Node::Dict(i) } else { Node::Set(i) })?;
        self.keyeds.push(Keyed::new(pairs));
        Ok(id)
    }

    /// Items of a list or tuple.
    pub(super) fn seq(&self, id: Id) -> Option<Vec<Id>> {
        match self.get(id)? {
            Node::List(l) => self.lists.get(l as usize).cloned(),
            Node::Tuple { len, at } => Some(self.pooled(at, len)),
            _ => None,
        }
    }

    /// Items of a list, tuple or set.
    pub(super) fn iterable(&self, id: Id) -> Option<Vec<Id>> {
        match self.get(id)? {
            Node::Set(k) => Some(self.keyeds.get(k as usize)?.keys().collect()),
            _ => self.seq(id),
        }
    }

    pub(super) fn dict_pairs(&self, id: Id) -> Option<Vec<(Id, Id)>> {
        match self.get(id)? {
            Node::Dict(k) => Some(self.keyeds.get(k as usize)?.pairs().collect()),
            _ => None,
        }
    }

    /// The arguments of object `o`.
    pub(super) fn args_of(&self, o: &ObjNode) -> Vec<Id> {
        self.pooled(o.args_at, o.args_len)
    }

    // --- dispatch --------------------------------------------------------------------------------

    /// Runs the opcodes up to `STOP`; returns the id of the value on top of the stack then.
    pub(super) fn run(&mut self) -> Result<Id> {
        loop {
            self.op_pos = self.pos;
            let Some(&op) = self.data.get(self.pos) else {
                return Err(self.err("no STOP opcode (truncated input)"));
            };
            self.pos += 1;
            if op == STOP {
                return self.pop();
            }
            self.step(op)?;
        }
    }

    /// Executes one opcode other than `STOP` by handing it to the function of its family (in
    /// `handlers`), or refuses it. This table is what says which opcodes are accepted; each
    /// family function matches its own opcodes again to read their arguments.
    fn step(&mut self, op: u8) -> Result<()> {
        match op {
            PROTO | FRAME => self.framing(op),
            MARK | POP | POP_MARK | DUP => self.stack_op(op),
            PUT | BINPUT | LONG_BINPUT | MEMOIZE | GET | BINGET | LONG_BINGET => self.memo_op(op),
            NONE | NEWTRUE | NEWFALSE | INT | LONG | BININT | BININT1 | BININT2 | LONG1 | LONG4 | FLOAT | BINFLOAT => {
                self.scalar(op)
            }
            STRING | BINSTRING | SHORT_BINSTRING | UNICODE | BINUNICODE | SHORT_BINUNICODE | BINUNICODE8 | BINBYTES
            | SHORT_BINBYTES | BINBYTES8 | BYTEARRAY8 => self.text_op(op),
            EMPTY_LIST | LIST | APPEND | APPENDS => self.list_op(op),
            EMPTY_TUPLE | TUPLE | TUPLE1 | TUPLE2 | TUPLE3 => self.tuple_op(op),
            EMPTY_DICT | DICT | SETITEM | SETITEMS => self.dict_op(op),
            EMPTY_SET | ADDITEMS | FROZENSET => self.set_op(op),
            GLOBAL | STACK_GLOBAL => self.global_op(op),
            REDUCE | NEWOBJ | NEWOBJ_EX | OBJ | INST => self.call_op(op),
            BUILD => self.build(),
            PERSID | BINPERSID => self.persistent_id(op),
            EXT1 | EXT2 | EXT4 => Err(self.err("extension registry opcodes (EXT1/EXT2/EXT4) are not supported")),
            NEXT_BUFFER | READONLY_BUFFER => {
                Err(self.err("out-of-band buffers (NEXT_BUFFER/READONLY_BUFFER) are not supported"))
            }
            _ => Err(self.unknown_opcode(op)),
        }
    }

    /// The error for an opcode this unpickler does not know. The family functions return it
    /// too for an opcode not theirs, which [`Machine::step`] never hands them: an error rather
    /// than a panic all the same.
    pub(super) fn unknown_opcode(&self, op: u8) -> Error {
        self.err(format!("unknown opcode 0x{op:02x}"))
    }
}
