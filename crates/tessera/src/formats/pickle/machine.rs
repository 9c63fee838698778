//! The stack machine: an arena of values under construction, the stack and memo of ids into
//! it, reading the input, and the loop that hands each opcode to its family in `handlers`.

use std::collections::hash_map::RandomState;
use std::collections::HashMap;

use super::opcodes::*;
use super::{PickleValue, UnpickleLimits};
use crate::error::{Error, Result};

/// Index of a node in the arena.
pub(super) type Id = usize;

/// Keys (and, for dicts, values) with a hash index to deduplicate keys as Python does.
#[derive(Default)]
pub(super) struct Keyed {
    pub(super) keys: Vec<Id>,
    /// Parallel to `keys` for dicts; empty for sets.
    pub(super) values: Vec<Id>,
    pub(super) index: HashMap<u64, Vec<usize>>,
}

/// Which key collection of a node an insertion goes to.
#[derive(Clone, Copy)]
pub(super) enum Slot {
    /// A dict's items, or a set's elements.
    Main,
    /// An object's `dict_items`.
    ObjItems,
}

/// One value under construction. Containers refer to their items by id, so that every
/// reference to a container sees later mutations (`APPEND` after a memo `GET`).
pub(super) enum Node {
    /// None, Bool, Int, BigInt, Float, Str, Bytes, Global.
    Leaf(PickleValue),
    List(Vec<Id>),
    Tuple(Vec<Id>),
    Dict(Box<Keyed>),
    Set(Box<Keyed>),
    Object(Box<ObjNode>),
    Persistent(Id),
}

pub(super) struct ObjNode {
    /// A `Leaf(Global)` node.
    pub(super) class: Id,
    pub(super) args: Vec<Id>,
    pub(super) kwargs: Keyed,
    pub(super) state: Option<Id>,
    /// `state` is a dict this object made by merging (no one else refers to it).
    pub(super) state_owned: bool,
    pub(super) list_items: Vec<Id>,
    pub(super) dict_items: Keyed,
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
    pub(super) nodes: Vec<Node>,
    pub(super) stack: Vec<Id>,
    /// Stack lengths at each `MARK`.
    pub(super) marks: Vec<usize>,
    pub(super) memo: HashMap<u64, Id>,
    /// Values pushed or copied so far.
    pub(super) values: usize,
    /// String and bytes payload so far.
    pub(super) bytes: usize,
    pub(super) hasher: RandomState,
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
            nodes: Vec::new(),
            stack: Vec::new(),
            marks: Vec::new(),
            memo: HashMap::new(),
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

    pub(super) fn utf8_line(&mut self) -> Result<&'a str> {
        let line = self.line()?;
        std::str::from_utf8(line).map_err(|_| self.err("text argument is not UTF-8"))
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

    // --- stack ---------------------------------------------------------------------------------

    pub(super) fn alloc(&mut self, node: Node) -> Result<Id> {
        self.charge_values(1)?;
        self.nodes.push(node);
        Ok(self.nodes.len() - 1)
    }

    pub(super) fn push_new(&mut self, node: Node) -> Result<()> {
        let id = self.alloc(node)?;
        self.stack.push(id);
        Ok(())
    }

    pub(super) fn push_leaf(&mut self, v: PickleValue) -> Result<()> {
        self.push_new(Node::Leaf(v))
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

    pub(super) fn memo_get(&mut self, i: u64) -> Result<()> {
        let id = *self.memo.get(&i).ok_or_else(|| self.err(format!("bad memo index {i}")))?;
        self.push_existing(id)
    }

    pub(super) fn memo_put(&mut self, i: u64) -> Result<()> {
        let id = self.top()?;
        self.memo.insert(i, id);
        Ok(())
    }

    // --- node access -----------------------------------------------------------------------------

    pub(super) fn node(&self, id: Id) -> Result<&Node> {
        self.nodes.get(id).ok_or_else(|| self.err("internal: bad node id"))
    }

    pub(super) fn node_mut(&mut self, id: Id) -> Result<&mut Node> {
        if id >= self.nodes.len() {
            return Err(self.err("internal: bad node id"));
        }
        Ok(&mut self.nodes[id])
    }

    pub(super) fn leaf(&self, id: Id) -> Option<&PickleValue> {
        match self.nodes.get(id) {
            Some(Node::Leaf(v)) => Some(v),
            _ => None,
        }
    }

    pub(super) fn str_of(&self, id: Id) -> Option<&str> {
        match self.leaf(id) {
            Some(PickleValue::Str(s)) => Some(s),
            _ => None,
        }
    }

    pub(super) fn is_global(&self, id: Id) -> bool {
        matches!(self.leaf(id), Some(PickleValue::Global { .. }))
    }

    /// Items of a list or tuple.
    pub(super) fn seq(&self, id: Id) -> Option<Vec<Id>> {
        match self.nodes.get(id) {
            Some(Node::List(items) | Node::Tuple(items)) => Some(items.clone()),
            _ => None,
        }
    }

    /// Items of a list, tuple or set.
    pub(super) fn iterable(&self, id: Id) -> Option<Vec<Id>> {
        match self.nodes.get(id) {
            Some(Node::Set(k)) => Some(k.keys.clone()),
            _ => self.seq(id),
        }
    }

    pub(super) fn dict_pairs(&self, id: Id) -> Option<Vec<(Id, Id)>> {
        match self.nodes.get(id) {
            Some(Node::Dict(k)) => Some(k.keys.iter().copied().zip(k.values.iter().copied()).collect()),
            _ => None,
        }
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
            | SHORT_BINBYTES | BINBYTES8 | BYTEARRAY8 => self.text(op),
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
