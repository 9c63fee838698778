//! A restricted unpickler for the pickles other checkpoint formats write (PyTorch DCP
//! `.metadata`, `torch.save`'s `data.pkl`, Megatron `common.pt`). It interprets the opcode
//! stream of protocols 0–5 as data only: globals stay names, calls stay unevaluated objects,
//! and nothing is ever imported or executed. Depth and memory are bounded by [`UnpickleLimits`].
//!
//! How it works: the opcodes build values in an arena (one compact node per value, small
//! scalars as ids of their own, strings as ranges of the input; containers hold ids), so the
//! memo and `DUP` share references as Python does: a list memoized, fetched again and appended
//! to later shows its items everywhere it is referenced. At `STOP` the arena is checked (no
//! cycles, depth, number of values and bytes the tree will hold, shared references counted
//! once per copy) and only then materialized into a [`PickleValue`] tree, iteratively
//! ([`unpickle`]), or read in place ([`unpickle_view`], for the large DCP `.metadata`).
//! Behaviour choices:
//!
//! - A recursive structure (a container that contains itself, which Python can pickle) is an
//!   error ("recursive structure"): a tree cannot hold it.
//! - Shared references become copies; every copy counts against `max_values` and its strings
//!   against `max_bytes`, so a "billion laughs" pickle fails before anything is built.
//! - Dicts and sets deduplicate keys as Python would (equal strings, bytes, numbers — with
//!   `1 == 1.0 == True` — globals, tuples of those; other objects by identity); a repeated key
//!   keeps its first position and takes the last value. Unhashable keys (lists, dicts; only
//!   hand-made pickles have them) are kept as given.
//! - `BUILD` on an object sets its `state`; a later `BUILD` with a dict state merges into an
//!   earlier dict state (`dict.update`), any other later state replaces the earlier one.
//!   `BUILD` on a dict (an `OrderedDict` subclass) with a dict state merges it into the dict's
//!   items; a `None` state is ignored; any other target is an error.
//! - Strings that are not valid UTF-8 in `BINUNICODE` (lone surrogates, which Python writes
//!   with `surrogatepass`) and lone `\uXXXX` surrogates in protocol 0 become U+FFFD; escaped
//!   surrogate pairs are combined. `STRING`/`BINSTRING` (Python 2 `str`) are [`PickleValue::Str`]
//!   when valid UTF-8, [`PickleValue::Bytes`] otherwise.
//! - Text integers (`INT`, `LONG`) of more than 4300 digits are refused, as CPython refuses
//!   to convert them.
//! - Known callables (`collections.OrderedDict`, `torch.Size`, `_codecs.encode`, the
//!   `builtins` containers and bytes, the `copyreg` helpers; Python 2 names too) become plain
//!   values only when their arguments have the expected shape; otherwise the call stays a
//!   [`PickleValue::Object`]. Trailing bytes after `STOP` are ignored, as are values left on
//!   the stack under the result.
//!
//! Layout: this file has the values the unpickler returns and its entry point. `opcodes` names
//! the opcodes; `machine` holds the state (input, arena, stack, memo) and routes each opcode
//! to its family in `handlers`; `keys` deduplicates dict and set keys; `globals` turns the
//! known callables into plain values and records any other call; `limits` has
//! [`UnpickleLimits`] and the accounting against them; `tree` checks and materializes the
//! result; `view` reads it in place; `scalars` decodes integer and string arguments; `render`
//! is the lossy rendering.

mod globals;
mod handlers;
mod keys;
mod limits;
mod machine;
mod opcodes;
mod render;
mod scalars;
mod tree;
mod view;
pub(crate) mod write;

#[cfg(test)]
mod tests;

use crate::error::Result;
use crate::model::Value;

pub use limits::UnpickleLimits;
use machine::Machine;
use render::{bigint_text, lossy_map};
use scalars::int_from_le_twos;
pub(crate) use view::{unpickle_view, Items, PickleRef, PickleView};

/// A value decoded from a pickle. Known classes become typed values (`collections.OrderedDict`
/// is a [`PickleValue::Dict`], `torch.Size` a [`PickleValue::Tuple`], protocol-2 bytes built by
/// `_codecs.encode` are [`PickleValue::Bytes`]); any other call or class instance stays a
/// [`PickleValue::Object`] naming its class.
#[derive(Debug, Clone, PartialEq)]
pub enum PickleValue {
    /// `None`.
    None,
    /// `True` / `False`.
    Bool(bool),
    /// An integer that fits in 64 bits.
    Int(i64),
    /// A larger integer: little-endian two's complement bytes (as pickle's `LONG1`).
    BigInt(Vec<u8>),
    /// A float.
    Float(f64),
    /// A string.
    Str(String),
    /// Bytes (or a bytearray).
    Bytes(Vec<u8>),
    /// A list.
    List(Vec<PickleValue>),
    /// A tuple.
    Tuple(Vec<PickleValue>),
    /// A dict, in insertion order.
    Dict(Vec<(PickleValue, PickleValue)>),
    /// A set or frozenset.
    Set(Vec<PickleValue>),
    /// A reference to a global (a class, function or constant such as `torch.float32`).
    Global {
        /// Module name.
        module: String,
        /// Qualified name in the module.
        name: String,
    },
    /// An instance of, or a call to, a global that is not one of the known plain types.
    Object(Box<PickleObject>),
    /// A persistent id (torch.save uses them for tensor storages).
    PersistentId(Box<PickleValue>),
}

/// A call or class instance recorded without running it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PickleObject {
    /// Module of the class or function.
    pub module: String,
    /// Qualified name of the class or function.
    pub name: String,
    /// Arguments of the call (`REDUCE`, `NEWOBJ`, `NEWOBJ_EX`, `OBJ`, `INST`).
    pub args: Vec<PickleValue>,
    /// Keyword arguments (`NEWOBJ_EX`).
    pub kwargs: Vec<(PickleValue, PickleValue)>,
    /// State given by `BUILD` (a dict, a tuple, or any value).
    pub state: Option<PickleValue>,
    /// Items appended with `APPEND`/`APPENDS` (list subclasses).
    pub list_items: Vec<PickleValue>,
    /// Items set with `SETITEM`/`SETITEMS` (dict subclasses).
    pub dict_items: Vec<(PickleValue, PickleValue)>,
}

/// Decodes one pickle (protocol 0–5 opcodes; out-of-band buffers and the extension registry
/// are refused). `origin` names the file in errors, which are
/// [`Error::Corrupt`](crate::error::Error::Corrupt) with the byte offset of the opcode that failed.
pub fn unpickle(data: &[u8], origin: &str, limits: &UnpickleLimits) -> Result<PickleValue> {
    let mut m = Machine::new(data, origin, limits);
    let root = m.run()?;
    m.finish_run();
    m.check_tree(root)?;
    m.materialize(root)
}

impl PickleValue {
    /// The value if it is plain (None, bool, int, float, str, bytes, list/tuple, str-keyed
    /// dict, recursively); `None` otherwise.
    pub fn to_plain(&self) -> Option<Value> {
        Some(match self {
            PickleValue::None => Value::Null,
            PickleValue::Bool(b) => Value::Bool(*b),
            PickleValue::Int(i) => Value::Int(*i),
            PickleValue::BigInt(b) => match int_from_le_twos(b.clone()) {
                PickleValue::Int(i) => Value::Int(i),
                _ => return None,
            },
            PickleValue::Float(f) => Value::Float(*f),
            PickleValue::Str(s) => Value::Str(s.clone()),
            PickleValue::Bytes(b) => Value::Bytes(b.clone()),
            PickleValue::List(items) | PickleValue::Tuple(items) => {
                Value::List(items.iter().map(PickleValue::to_plain).collect::<Option<Vec<_>>>()?)
            }
            PickleValue::Dict(pairs) => {
                let mut entries = Vec::with_capacity(pairs.len());
                for (k, v) in pairs {
                    match k {
                        PickleValue::Str(k) => entries.push((k.clone(), v.to_plain()?)),
                        _ => return None,
                    }
                }
                Value::Map(entries)
            }
            PickleValue::Set(_)
            | PickleValue::Global { .. }
            | PickleValue::Object(_)
            | PickleValue::PersistentId(_) => return None,
        })
    }

    /// A plain rendering of any value, for display and for non-Python consumers: plain values
    /// as in [`PickleValue::to_plain`]; dict keys that are not strings rendered as text;
    /// globals as `"module.name"`; objects as a map with `"__class__"` and, when present,
    /// `"args"`, `"kwargs"`, `"state"`, `"items"`; persistent ids as `{"__persistent_id__": …}`;
    /// big integers in decimal.
    ///
    /// Details: keys are rendered like Python's `repr` (ints in decimal, tuples as `(1, 'a')`),
    /// cut to about 200 characters; sets become lists; an object with both list and dict items
    /// has them under `"items"` and `"dict_items"`; integers of more than 4300 digits are
    /// rendered in hexadecimal (`0x…`).
    pub fn to_value_lossy(&self) -> Value {
        match self {
            PickleValue::None => Value::Null,
            PickleValue::Bool(b) => Value::Bool(*b),
            PickleValue::Int(i) => Value::Int(*i),
            PickleValue::BigInt(b) => Value::Str(bigint_text(b)),
            PickleValue::Float(f) => Value::Float(*f),
            PickleValue::Str(s) => Value::Str(s.clone()),
            PickleValue::Bytes(b) => Value::Bytes(b.clone()),
            PickleValue::List(items) | PickleValue::Tuple(items) | PickleValue::Set(items) => {
                Value::List(items.iter().map(PickleValue::to_value_lossy).collect())
            }
            PickleValue::Dict(pairs) => lossy_map(pairs),
            PickleValue::Global { module, name } => Value::Str(format!("{module}.{name}")),
            PickleValue::Object(o) => {
                let mut entries = vec![("__class__".to_string(), Value::Str(format!("{}.{}", o.module, o.name)))];
                if !o.args.is_empty() {
                    entries
                        .push(("args".into(), Value::List(o.args.iter().map(PickleValue::to_value_lossy).collect())));
                }
                if !o.kwargs.is_empty() {
                    entries.push(("kwargs".into(), lossy_map(&o.kwargs)));
                }
                if let Some(state) = &o.state {
                    entries.push(("state".into(), state.to_value_lossy()));
                }
                if !o.list_items.is_empty() {
                    let items = o.list_items.iter().map(PickleValue::to_value_lossy).collect();
                    entries.push(("items".into(), Value::List(items)));
                }
                if !o.dict_items.is_empty() {
                    let key = if o.list_items.is_empty() { "items" } else { "dict_items" };
                    entries.push((key.into(), lossy_map(&o.dict_items)));
                }
                Value::Map(entries)
            }
            PickleValue::PersistentId(v) => Value::Map(vec![("__persistent_id__".into(), v.to_value_lossy())]),
        }
    }

    /// `(module, name)` if this is a global, or an object of that class.
    #[cfg(test)]
    pub fn class(&self) -> Option<(&str, &str)> {
        match self {
            PickleValue::Global { module, name } => Some((module, name)),
            PickleValue::Object(o) => Some((&o.module, &o.name)),
            _ => None,
        }
    }
}
