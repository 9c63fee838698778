//! A restricted unpickler for the pickles other checkpoint formats write (PyTorch DCP
//! `.metadata`, `torch.save`'s `data.pkl`, Megatron `common.pt`). It interprets the opcode
//! stream of protocols 2–5 as data only: globals stay names, calls stay unevaluated objects,
//! and nothing is ever imported or executed. Depth and memory are bounded by [`UnpickleLimits`].

use crate::{Error, Result, Value};

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

/// Bounds on what one pickle may make the unpickler do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnpickleLimits {
    /// Deepest nesting of containers and objects.
    pub max_depth: usize,
    /// Most values created (every opcode that pushes counts).
    pub max_values: usize,
    /// Most bytes of string and bytes payloads, in total.
    pub max_bytes: usize,
}

impl Default for UnpickleLimits {
    fn default() -> Self {
        UnpickleLimits { max_depth: 512, max_values: 50_000_000, max_bytes: 1 << 32 }
    }
}

/// Decodes one pickle (protocol 0–5 opcodes; out-of-band buffers and the extension registry
/// are refused). `origin` names the file in errors, which are [`Error::Corrupt`] with the byte
/// offset of the opcode that failed.
pub fn unpickle(data: &[u8], origin: &str, limits: &UnpickleLimits) -> Result<PickleValue> {
    let _ = (data, limits);
    Err(Error::corrupt(origin, "unimplemented"))
}

impl PickleValue {
    /// The value if it is plain (None, bool, int, float, str, bytes, list/tuple, str-keyed
    /// dict, recursively); `None` otherwise.
    pub fn to_plain(&self) -> Option<Value> {
        None
    }

    /// A plain rendering of any value, for display and for non-Python consumers: plain values
    /// as in [`PickleValue::to_plain`]; dict keys that are not strings rendered as text;
    /// globals as `"module.name"`; objects as a map with `"__class__"` and, when present,
    /// `"args"`, `"kwargs"`, `"state"`, `"items"`; persistent ids as `{"__persistent_id__": …}`;
    /// big integers in decimal.
    pub fn to_value_lossy(&self) -> Value {
        Value::Null
    }

    /// `(module, name)` if this is a global, or an object of that class.
    pub fn class(&self) -> Option<(&str, &str)> {
        match self {
            PickleValue::Global { module, name } => Some((module, name)),
            PickleValue::Object(o) => Some((&o.module, &o.name)),
            _ => None,
        }
    }
}
