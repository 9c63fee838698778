//! What each opcode does, one function per family; [`Machine::step`] routes each opcode to
//! its family. Every function reads its arguments from the input, then works on the stack; a
//! family function handed an opcode not its own returns [`Machine::unknown_opcode`].

use super::machine::{Id, Keyed, Machine, Node, Slot, Text};
use super::opcodes::*;
use super::scalars::{escape_decode, int_from_le_twos, parse_index, parse_int_text, raw_unicode_escape};
use super::PickleValue;
use crate::error::Result;

impl Machine<'_> {
    // --- framing, stack and memo -----------------------------------------------------------------

    /// `PROTO`, `FRAME`.
    pub(super) fn framing(&mut self, op: u8) -> Result<()> {
        match op {
            PROTO => {
                let proto = self.u8()?;
                if proto > 5 {
                    return Err(self.err(format!("unsupported pickle protocol {proto}")));
                }
            }
            FRAME => {
                self.u64()?; // frames are inline, the length is not needed
            }
            _ => return Err(self.unknown_opcode(op)),
        }
        Ok(())
    }

    /// `MARK`, `POP`, `POP_MARK`, `DUP`.
    pub(super) fn stack_op(&mut self, op: u8) -> Result<()> {
        match op {
            MARK => self.marks.push(self.stack.len()),
            POP => {
                // An empty stack above the mark pops the mark (as CPython does).
                if self.stack.len() > self.floor() {
                    self.pop()?;
                } else {
                    self.pop_mark()?;
                }
            }
            POP_MARK => {
                self.pop_mark()?;
            }
            DUP => {
                let id = self.top()?;
                self.push_existing(id)?;
            }
            _ => return Err(self.unknown_opcode(op)),
        }
        Ok(())
    }

    /// `PUT`, `BINPUT`, `LONG_BINPUT`, `MEMOIZE`, `GET`, `BINGET`, `LONG_BINGET`.
    pub(super) fn memo_op(&mut self, op: u8) -> Result<()> {
        match op {
            PUT => {
                let line = self.line()?;
                let i = parse_index(line).ok_or_else(|| self.err("bad PUT index"))?;
                self.memo_put(i)
            }
            BINPUT => {
                let i = self.u8()?;
                self.memo_put(u64::from(i))
            }
            LONG_BINPUT => {
                let i = self.u32()?;
                self.memo_put(u64::from(i))
            }
            MEMOIZE => {
                let i = self.memo_len();
                self.memo_put(i)
            }
            GET => {
                let line = self.line()?;
                let i = parse_index(line).ok_or_else(|| self.err("bad memo index"))?;
                self.memo_get(i)
            }
            BINGET => {
                let i = self.u8()?;
                self.memo_get(u64::from(i))
            }
            LONG_BINGET => {
                let i = self.u32()?;
                self.memo_get(u64::from(i))
            }
            _ => Err(self.unknown_opcode(op)),
        }
    }

    // --- scalars ---------------------------------------------------------------------------------

    /// The constants (`NONE`, `NEWTRUE`, `NEWFALSE`), integers and floats.
    pub(super) fn scalar(&mut self, op: u8) -> Result<()> {
        let v = match op {
            NONE => Node::None,
            NEWTRUE => Node::Bool(true),
            NEWFALSE => Node::Bool(false),
            INT => {
                let line = self.line()?;
                match line {
                    b"00" => Node::Bool(false),
                    b"01" => Node::Bool(true),
                    _ => {
                        let v = parse_int_text(line).map_err(|e| self.err(e))?;
                        self.int_node(v)?
                    }
                }
            }
            LONG => {
                let line = self.line()?;
                let line = line.strip_suffix(b"L").unwrap_or(line);
                let v = parse_int_text(line).map_err(|e| self.err(e))?;
                self.int_node(v)?
            }
            BININT => Node::Int(i64::from(self.i32()?)),
            BININT1 => Node::Int(i64::from(self.u8()?)),
            BININT2 => Node::Int(i64::from(self.u16()?)),
            LONG1 => {
                let n = self.u8()?;
                let v = int_from_le_twos(self.payload(u64::from(n))?.to_vec());
                self.int_node(v)?
            }
            LONG4 => {
                let n = self.i32()?;
                let n = u64::try_from(n).map_err(|_| self.err("LONG4 with a negative byte count"))?;
                let v = int_from_le_twos(self.payload(n)?.to_vec());
                self.int_node(v)?
            }
            FLOAT => {
                let line = self.line()?;
                let f = std::str::from_utf8(line)
                    .ok()
                    .and_then(|s| s.trim().parse::<f64>().ok())
                    .ok_or_else(|| self.err("invalid FLOAT"))?;
                Node::Float(f)
            }
            BINFLOAT => Node::Float(f64::from_be_bytes(self.take_array()?)),
            _ => return Err(self.unknown_opcode(op)),
        };
        self.push_new(v)
    }

    /// The node of a decoded integer (`Int`, or `BigInt` with its bytes in the own text).
    fn int_node(&mut self, v: PickleValue) -> Result<Node> {
        Ok(match v {
            PickleValue::BigInt(b) => {
                let Text { at, len } = self.own_text(&b)?;
                Node::BigInt { len, at }
            }
            PickleValue::Int(i) => Node::Int(i),
            _ => return Err(self.err("internal: not an integer")),
        })
    }

    /// A string node of `s`, taken from the input when it is there unchanged (valid UTF-8).
    fn str_node(&mut self, s: &[u8], from_input: bool) -> Result<Node> {
        let t = if from_input { self.text_of_input(s)? } else { self.own_text(s)? };
        Ok(Node::Str { len: t.len, at: t.at })
    }

    /// A bytes node of `b` (see [`Machine::str_node`]).
    fn bytes_node(&mut self, b: &[u8], from_input: bool) -> Result<Node> {
        let t = if from_input { self.text_of_input(b)? } else { self.own_text(b)? };
        Ok(Node::Bytes { len: t.len, at: t.at })
    }

    /// Python 2 `str`: text when it is UTF-8, bytes otherwise.
    fn str_or_bytes_node(&mut self, b: &[u8], from_input: bool) -> Result<Node> {
        if std::str::from_utf8(b).is_ok() {
            self.str_node(b, from_input)
        } else {
            self.bytes_node(b, from_input)
        }
    }

    /// Strings (Python 2 `str` and text) and bytes.
    pub(super) fn text_op(&mut self, op: u8) -> Result<()> {
        let v = match op {
            STRING => {
                let line = self.line()?;
                let inner = match line {
                    [q @ (b'\'' | b'"'), inner @ .., last] if last == q => inner,
                    _ => return Err(self.err("the STRING opcode argument must be quoted")),
                };
                let b = escape_decode(inner).map_err(|e| self.err(e))?;
                self.charge_bytes(b.len())?;
                self.str_or_bytes_node(&b, false)?
            }
            BINSTRING => {
                let n = self.i32()?;
                let n = u64::try_from(n).map_err(|_| self.err("BINSTRING with a negative length"))?;
                let b = self.payload(n)?;
                self.str_or_bytes_node(b, true)?
            }
            SHORT_BINSTRING => {
                let n = self.u8()?;
                let b = self.payload(u64::from(n))?;
                self.str_or_bytes_node(b, true)?
            }
            UNICODE => {
                let line = self.line()?;
                let s = raw_unicode_escape(line).map_err(|e| self.err(e))?;
                self.charge_bytes(s.len())?;
                self.str_node(s.as_bytes(), false)?
            }
            BINUNICODE | SHORT_BINUNICODE | BINUNICODE8 => {
                let n = self.length(op)?;
                let b = self.payload(n)?;
                // Invalid UTF-8 (lone surrogates, which Python writes with `surrogatepass`)
                // becomes U+FFFD, in a repaired copy.
                match std::str::from_utf8(b) {
                    Ok(_) => self.str_node(b, true)?,
                    Err(_) => self.str_node(String::from_utf8_lossy(b).as_bytes(), false)?,
                }
            }
            BINBYTES | SHORT_BINBYTES | BINBYTES8 | BYTEARRAY8 => {
                let n = self.length(op)?;
                let b = self.payload(n)?;
                self.bytes_node(b, true)?
            }
            _ => return Err(self.unknown_opcode(op)),
        };
        self.push_new(v)
    }

    /// The length before the payload of a sized text or bytes opcode: one byte for the
    /// `SHORT_` ones, eight for the `8` ones, four for the others.
    fn length(&mut self, op: u8) -> Result<u64> {
        match op {
            SHORT_BINUNICODE | SHORT_BINBYTES => Ok(u64::from(self.u8()?)),
            BINUNICODE8 | BINBYTES8 | BYTEARRAY8 => self.u64(),
            _ => Ok(u64::from(self.u32()?)),
        }
    }

    // --- containers ------------------------------------------------------------------------------

    /// `EMPTY_LIST`, `LIST`, `APPEND`, `APPENDS`.
    pub(super) fn list_op(&mut self, op: u8) -> Result<()> {
        match op {
            EMPTY_LIST => {
                let id = self.new_list(Vec::new())?;
                self.stack.push(id);
                Ok(())
            }
            LIST => {
                let items = self.pop_mark()?;
                let id = self.new_list(items)?;
                self.stack.push(id);
                Ok(())
            }
            APPEND => {
                let v = self.pop()?;
                self.append(&[v])
            }
            APPENDS => {
                let items = self.pop_mark()?;
                self.append(&items)
            }
            _ => Err(self.unknown_opcode(op)),
        }
    }

    /// Appends to the list (or list subclass object) on top of the stack.
    fn append(&mut self, items: &[Id]) -> Result<()> {
        let target = self.top()?;
        match self.node(target)? {
            Node::List(l) => match self.lists.get_mut(l as usize) {
                Some(list) => list.extend_from_slice(items),
                None => return Err(self.err("internal: bad list")),
            },
            Node::Object(o) => match self.objects.get_mut(o as usize) {
                Some(o) => o.extra.get_or_insert_with(Box::default).list_items.extend_from_slice(items),
                None => return Err(self.err("internal: bad object")),
            },
            _ => return Err(self.err("APPEND to a value that is not a list")),
        }
        Ok(())
    }

    /// `EMPTY_TUPLE`, `TUPLE`, `TUPLE1`, `TUPLE2`, `TUPLE3`.
    pub(super) fn tuple_op(&mut self, op: u8) -> Result<()> {
        let items = match op {
            EMPTY_TUPLE => Vec::new(),
            TUPLE => self.pop_mark()?,
            TUPLE1..=TUPLE3 => {
                let n = usize::from(op - TUPLE1) + 1;
                if self.stack.len() < self.floor() + n {
                    return Err(self.err("stack underflow"));
                }
                self.stack.split_off(self.stack.len() - n)
            }
            _ => return Err(self.unknown_opcode(op)),
        };
        let id = self.new_tuple(&items)?;
        self.stack.push(id);
        Ok(())
    }

    /// `EMPTY_DICT`, `DICT`, `SETITEM`, `SETITEMS`.
    pub(super) fn dict_op(&mut self, op: u8) -> Result<()> {
        match op {
            EMPTY_DICT => {
                let id = self.new_keyed(true)?;
                self.stack.push(id);
                Ok(())
            }
            DICT => {
                let items = self.pop_mark()?;
                let pairs = self.pairs_of(&items, "DICT")?;
                let id = self.new_dict(&pairs)?;
                self.stack.push(id);
                Ok(())
            }
            SETITEM => {
                let v = self.pop()?;
                let k = self.pop()?;
                self.setitems(&[(k, v)])
            }
            SETITEMS => {
                let items = self.pop_mark()?;
                let pairs = self.pairs_of(&items, "SETITEMS")?;
                self.setitems(&pairs)
            }
            _ => Err(self.unknown_opcode(op)),
        }
    }

    /// Sets items in the dict (or dict subclass object) on top of the stack.
    fn setitems(&mut self, pairs: &[(Id, Id)]) -> Result<()> {
        let target = self.top()?;
        let slot = match self.node(target)? {
            Node::Dict(_) => Slot::Main,
            Node::Object(_) => Slot::ObjItems,
            _ => return Err(self.err("SETITEM on a value that is not a dict")),
        };
        self.insert_pairs(target, slot, pairs)
    }

    /// `EMPTY_SET`, `ADDITEMS`, `FROZENSET`.
    pub(super) fn set_op(&mut self, op: u8) -> Result<()> {
        match op {
            EMPTY_SET => {
                let id = self.new_keyed(false)?;
                self.stack.push(id);
                Ok(())
            }
            ADDITEMS => {
                let items = self.pop_mark()?;
                let target = self.top()?;
                if !matches!(self.node(target)?, Node::Set(_)) {
                    return Err(self.err("ADDITEMS to a value that is not a set"));
                }
                for item in items {
                    self.insert(target, Slot::Main, item, None)?;
                }
                Ok(())
            }
            FROZENSET => {
                let items = self.pop_mark()?;
                let id = self.new_set(&items)?;
                self.stack.push(id);
                Ok(())
            }
            _ => Err(self.unknown_opcode(op)),
        }
    }

    // --- globals, calls and persistent ids -------------------------------------------------------

    /// `GLOBAL`, `STACK_GLOBAL`.
    pub(super) fn global_op(&mut self, op: u8) -> Result<()> {
        let (module, name) = match op {
            GLOBAL => {
                let module = self.utf8_line()?;
                let name = self.utf8_line()?;
                self.charge_bytes(module.len as usize + name.len as usize)?;
                (module, name)
            }
            STACK_GLOBAL => {
                let name = self.pop()?;
                let module = self.pop()?;
                let (Some(module), Some(name)) = (self.str_text(module), self.str_text(name)) else {
                    return Err(self.err("STACK_GLOBAL with a module or name that is not a string"));
                };
                (module, name)
            }
            _ => return Err(self.unknown_opcode(op)),
        };
        let id = self.new_global(module, name)?;
        self.stack.push(id);
        Ok(())
    }

    /// A global node naming `module`.`name`.
    pub(super) fn new_global(&mut self, module: Text, name: Text) -> Result<Id> {
        let g = u32::try_from(self.globals.len()).map_err(|_| self.err("too many globals"))?;
        let id = self.alloc(Node::Global(g))?;
        self.globals.push((module, name));
        Ok(id)
    }

    /// `REDUCE`, `NEWOBJ`, `NEWOBJ_EX`, `OBJ`, `INST`: pushes the call ([`Machine::call`]).
    pub(super) fn call_op(&mut self, op: u8) -> Result<()> {
        let id = match op {
            REDUCE => {
                let args = self.pop()?;
                let func = self.pop()?;
                if !self.is_global(func) {
                    return Err(self.err("REDUCE of a value that is not a global"));
                }
                let args = self.seq(args).ok_or_else(|| self.err("REDUCE arguments are not a tuple"))?;
                self.charge_values(args.len())?;
                self.call(func, args, Keyed::new(true), "REDUCE", true)?
            }
            NEWOBJ => {
                let args = self.pop()?;
                let cls = self.pop()?;
                let args = self.seq(args).ok_or_else(|| self.err("NEWOBJ arguments are not a tuple"))?;
                self.charge_values(args.len())?;
                self.call(cls, args, Keyed::new(true), "NEWOBJ", true)?
            }
            NEWOBJ_EX => self.newobj_ex()?,
            OBJ => {
                let items = self.pop_mark()?;
                let Some((&cls, args)) = items.split_first() else {
                    return Err(self.err("OBJ without a class"));
                };
                self.call(cls, args.to_vec(), Keyed::new(true), "OBJ", true)?
            }
            INST => {
                let module = self.utf8_line()?;
                let name = self.utf8_line()?;
                self.charge_bytes(module.len as usize + name.len as usize)?;
                let args = self.pop_mark()?;
                let cls = self.new_global(module, name)?;
                self.call(cls, args, Keyed::new(true), "INST", true)?
            }
            _ => return Err(self.unknown_opcode(op)),
        };
        self.stack.push(id);
        Ok(())
    }

    /// `NEWOBJ_EX`: the call of a class with an argument tuple and a keyword dict.
    fn newobj_ex(&mut self) -> Result<Id> {
        let kwargs = self.pop()?;
        let args = self.pop()?;
        let cls = self.pop()?;
        let args = self.seq(args).ok_or_else(|| self.err("NEWOBJ_EX arguments are not a tuple"))?;
        let kw = self.dict_pairs(kwargs).ok_or_else(|| self.err("NEWOBJ_EX keyword arguments are not a dict"))?;
        self.charge_values(args.len() + kw.len())?;
        let kwargs = self.keyed_from(&kw)?;
        self.call(cls, args, kwargs, "NEWOBJ_EX", true)
    }

    /// `PERSID`, `BINPERSID`.
    pub(super) fn persistent_id(&mut self, op: u8) -> Result<()> {
        let pid = match op {
            PERSID => {
                let line = self.line()?;
                if !line.is_ascii() {
                    return Err(self.err("persistent IDs in protocol 0 must be ASCII strings"));
                }
                self.charge_bytes(line.len())?;
                let node = self.str_node(line, true)?;
                self.alloc(node)?
            }
            BINPERSID => self.pop()?,
            _ => return Err(self.unknown_opcode(op)),
        };
        self.push_new(Node::Persistent(pid))
    }
}
