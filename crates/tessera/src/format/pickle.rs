//! A restricted unpickler for the pickles other checkpoint formats write (PyTorch DCP
//! `.metadata`, `torch.save`'s `data.pkl`, Megatron `common.pt`). It interprets the opcode
//! stream of protocols 0–5 as data only: globals stay names, calls stay unevaluated objects,
//! and nothing is ever imported or executed. Depth and memory are bounded by [`UnpickleLimits`].
//!
//! How it works: the opcodes build values in an arena (one node per value, containers hold
//! node ids), so the memo and `DUP` share references as Python does: a list memoized, fetched
//! again and appended to later shows its items everywhere it is referenced. At `STOP` the
//! arena is checked (no cycles, depth, number of values and bytes the tree will hold, shared
//! references counted once per copy) and only then materialized into a [`PickleValue`] tree,
//! iteratively. Behaviour choices:
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

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hash, Hasher};

use crate::error::{Error, Result};
use crate::model::Value;

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
    /// Deepest nesting of containers and objects (in the result; scalars do not count).
    pub max_depth: usize,
    /// Most values created (every opcode that pushes counts, and every item a known call or a
    /// merging `BUILD` copies); separately, most values in the result, where a value shared
    /// through the memo counts once per copy.
    pub max_values: usize,
    /// Most bytes of string and bytes payloads, in total (read from the input; separately,
    /// held by the result, counting every copy and the class names of objects).
    pub max_bytes: usize,
    /// Memory budget relative to the input: the values built (in the unpickler's arena, and
    /// again in the result, where a shared value counts once per copy) and their string bytes,
    /// estimated at their in-memory size, may take at most `output_floor + output_per_input_byte
    /// × input length` bytes. This is what keeps a small pickle from growing to gigabytes
    /// (memo sharing, millions of `None`s) whatever the absolute limits above allow.
    pub output_per_input_byte: usize,
    /// See [`UnpickleLimits::output_per_input_byte`].
    pub output_floor: usize,
}

impl Default for UnpickleLimits {
    fn default() -> Self {
        UnpickleLimits {
            max_depth: 512,
            max_values: 50_000_000,
            max_bytes: 1 << 32,
            output_per_input_byte: 32,
            output_floor: 8 << 20,
        }
    }
}

/// Estimated bytes one value costs in memory (an arena node and its id on the stack, or a
/// [`PickleValue`] of the result), for [`UnpickleLimits::output_per_input_byte`].
const VALUE_COST: u64 = {
    let node = std::mem::size_of::<Node>() + std::mem::size_of::<Id>();
    let value = std::mem::size_of::<PickleValue>();
    (if node > value { node } else { value }) as u64
};

/// Decodes one pickle (protocol 0–5 opcodes; out-of-band buffers and the extension registry
/// are refused). `origin` names the file in errors, which are [`Error::Corrupt`] with the byte
/// offset of the opcode that failed.
pub fn unpickle(data: &[u8], origin: &str, limits: &UnpickleLimits) -> Result<PickleValue> {
    let mut m = Machine::new(data, origin, limits);
    let root = m.run()?;
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
    pub fn class(&self) -> Option<(&str, &str)> {
        match self {
            PickleValue::Global { module, name } => Some((module, name)),
            PickleValue::Object(o) => Some((&o.module, &o.name)),
            _ => None,
        }
    }
}

fn lossy_map(pairs: &[(PickleValue, PickleValue)]) -> Value {
    Value::Map(pairs.iter().map(|(k, v)| (key_text(k), v.to_value_lossy())).collect())
}

/// Longest key rendering kept by [`key_text`] (then cut with "…").
const KEY_TEXT_MAX: usize = 200;

/// A dict key as text: strings as they are, anything else in a short Python-like repr.
fn key_text(k: &PickleValue) -> String {
    match k {
        PickleValue::Str(s) => s.clone(),
        _ => {
            let mut out = String::new();
            repr_into(k, &mut out);
            if out.len() > KEY_TEXT_MAX {
                let mut cut = KEY_TEXT_MAX;
                while !out.is_char_boundary(cut) {
                    cut -= 1;
                }
                out.truncate(cut);
                out.push('…');
            }
            out
        }
    }
}

/// Appends a Python-like repr of `v`, stopping once `out` is longer than [`KEY_TEXT_MAX`]
/// (which also bounds the recursion: every level writes at least one character).
fn repr_into(v: &PickleValue, out: &mut String) {
    use std::fmt::Write;
    if out.len() > KEY_TEXT_MAX {
        return;
    }
    let seq = |items: &[PickleValue], open: &str, close: &str, out: &mut String| {
        out.push_str(open);
        for (i, item) in items.iter().enumerate() {
            if out.len() > KEY_TEXT_MAX {
                return;
            }
            if i > 0 {
                out.push_str(", ");
            }
            repr_into(item, out);
        }
        if open == "(" && items.len() == 1 {
            out.push(',');
        }
        out.push_str(close);
    };
    match v {
        PickleValue::None => out.push_str("None"),
        PickleValue::Bool(true) => out.push_str("True"),
        PickleValue::Bool(false) => out.push_str("False"),
        PickleValue::Int(i) => {
            let _ = write!(out, "{i}");
        }
        PickleValue::BigInt(b) => out.push_str(&bigint_text(b)),
        PickleValue::Float(f) => out.push_str(&float_repr(*f)),
        PickleValue::Str(s) => {
            out.push('\'');
            for c in s.chars() {
                if out.len() > KEY_TEXT_MAX {
                    return;
                }
                match c {
                    '\\' => out.push_str("\\\\"),
                    '\'' => out.push_str("\\'"),
                    '\n' => out.push_str("\\n"),
                    '\r' => out.push_str("\\r"),
                    '\t' => out.push_str("\\t"),
                    c if c.is_control() => {
                        let _ = write!(out, "\\x{:02x}", c as u32);
                    }
                    c => out.push(c),
                }
            }
            out.push('\'');
        }
        PickleValue::Bytes(b) => {
            out.push_str("b'");
            for &x in b {
                if out.len() > KEY_TEXT_MAX {
                    return;
                }
                match x {
                    b'\\' => out.push_str("\\\\"),
                    b'\'' => out.push_str("\\'"),
                    0x20..=0x7e => out.push(x as char),
                    _ => {
                        let _ = write!(out, "\\x{x:02x}");
                    }
                }
            }
            out.push('\'');
        }
        PickleValue::List(items) => seq(items, "[", "]", out),
        PickleValue::Tuple(items) => seq(items, "(", ")", out),
        PickleValue::Set(items) if items.is_empty() => out.push_str("set()"),
        PickleValue::Set(items) => seq(items, "{", "}", out),
        PickleValue::Dict(pairs) => {
            out.push('{');
            for (i, (k, v)) in pairs.iter().enumerate() {
                if out.len() > KEY_TEXT_MAX {
                    return;
                }
                if i > 0 {
                    out.push_str(", ");
                }
                repr_into(k, out);
                out.push_str(": ");
                repr_into(v, out);
            }
            out.push('}');
        }
        PickleValue::Global { module, name } => {
            let _ = write!(out, "{module}.{name}");
        }
        PickleValue::Object(o) => {
            let _ = write!(out, "<{}.{} object>", o.module, o.name);
        }
        PickleValue::PersistentId(p) => {
            out.push_str("persistent_id(");
            repr_into(p, out);
            out.push(')');
        }
    }
}

/// Python's `repr` of a float, near enough: `1.0`, `1e+100` style exponents aside.
fn float_repr(f: f64) -> String {
    if f.is_nan() {
        "nan".into()
    } else if f.is_infinite() {
        if f > 0.0 { "inf" } else { "-inf" }.into()
    } else {
        format!("{f:?}")
    }
}

/// Most magnitude bytes [`bigint_text`] renders in decimal (about 4300 digits, CPython's
/// default `int` to `str` limit); larger integers are rendered in hexadecimal.
const BIGINT_DECIMAL_MAX_BYTES: usize = 1786;

/// Decimal text of a little-endian two's complement integer (hexadecimal when huge).
fn bigint_text(b: &[u8]) -> String {
    let neg = b.last().is_some_and(|&x| x & 0x80 != 0);
    let mut mag = b.to_vec();
    if neg {
        negate_twos(&mut mag);
    }
    while mag.last() == Some(&0) {
        mag.pop();
    }
    let sign = if neg { "-" } else { "" };
    if mag.is_empty() {
        return "0".into();
    }
    if mag.len() > BIGINT_DECIMAL_MAX_BYTES {
        let hex: String = mag.iter().rev().map(|x| format!("{x:02x}")).collect();
        return format!("{sign}0x{}", hex.trim_start_matches('0'));
    }
    let mut limbs: Vec<u32> = mag
        .chunks(4)
        .map(|c| {
            let mut x = [0u8; 4];
            x[..c.len()].copy_from_slice(c);
            u32::from_le_bytes(x)
        })
        .collect();
    let mut parts = Vec::new();
    while !limbs.is_empty() {
        let mut rem = 0u64;
        for limb in limbs.iter_mut().rev() {
            let cur = (rem << 32) | u64::from(*limb);
            *limb = (cur / 1_000_000_000) as u32;
            rem = cur % 1_000_000_000;
        }
        parts.push(rem as u32);
        while limbs.last() == Some(&0) {
            limbs.pop();
        }
    }
    let mut out = sign.to_string();
    for (i, p) in parts.iter().rev().enumerate() {
        if i == 0 {
            out.push_str(&p.to_string());
        } else {
            out.push_str(&format!("{p:09}"));
        }
    }
    out
}

/// Two's complement negation in place (little-endian).
fn negate_twos(b: &mut [u8]) {
    let mut carry = true;
    for x in b.iter_mut() {
        let (v, c) = (!*x).overflowing_add(u8::from(carry));
        *x = v;
        carry = c;
    }
}

/// An integer from little-endian two's complement bytes: [`PickleValue::Int`] if it fits in
/// 64 bits, otherwise a [`PickleValue::BigInt`] with redundant sign bytes removed.
fn int_from_le_twos(mut b: Vec<u8>) -> PickleValue {
    while b.len() > 1 {
        let last = b[b.len() - 1];
        let prev = b[b.len() - 2];
        if (last == 0 && prev & 0x80 == 0) || (last == 0xff && prev & 0x80 != 0) {
            b.pop();
        } else {
            break;
        }
    }
    if b.len() <= 8 {
        let neg = b.last().is_some_and(|&x| x & 0x80 != 0);
        let mut buf = if neg { [0xffu8; 8] } else { [0u8; 8] };
        buf[..b.len()].copy_from_slice(&b);
        PickleValue::Int(i64::from_le_bytes(buf))
    } else {
        PickleValue::BigInt(b)
    }
}

/// Most digits of a text integer (`INT`, `LONG`), as CPython's `int()` allows by default.
const MAX_INT_DIGITS: usize = 4300;

/// Parses the argument of the text `INT`/`LONG` opcodes (`int(text, 0)` in Python).
fn parse_int_text(s: &[u8]) -> std::result::Result<PickleValue, String> {
    let s = s.trim_ascii();
    let (neg, digits) = match s.split_first() {
        Some((b'-', rest)) => (true, rest),
        Some((b'+', rest)) => (false, rest),
        _ => (false, s),
    };
    let radix = match digits {
        [b'0', b'x' | b'X', ..] => 16,
        [b'0', b'o' | b'O', ..] => 8,
        [b'0', b'b' | b'B', ..] => 2,
        _ => 10,
    };
    if radix != 10 {
        let text = std::str::from_utf8(digits.get(2..).unwrap_or_default()).map_err(|_| "invalid integer")?;
        let v = u64::from_str_radix(text, radix)
            .map_err(|_| format!("invalid or too large integer {:?}", text.chars().take(40).collect::<String>()))?;
        let v = if neg { -i128::from(v) } else { i128::from(v) };
        return Ok(int_from_le_twos(v.to_le_bytes().to_vec()));
    }
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return Err(format!("invalid integer {:?}", String::from_utf8_lossy(&s[..s.len().min(40)])));
    }
    if digits.len() > MAX_INT_DIGITS {
        return Err(format!("integer of {} digits (more than {MAX_INT_DIGITS})", digits.len()));
    }
    // Magnitude in base 2^32 limbs, little-endian, fed 9 digits at a time.
    let mut limbs: Vec<u32> = Vec::new();
    for chunk in digits.chunks(9) {
        let mut mul = 1u64;
        let mut add = 0u64;
        for &d in chunk {
            mul *= 10;
            add = add * 10 + u64::from(d - b'0');
        }
        let mut carry = add;
        for limb in limbs.iter_mut() {
            let cur = u64::from(*limb) * mul + carry;
            *limb = cur as u32;
            carry = cur >> 32;
        }
        if carry > 0 {
            limbs.push(carry as u32);
        }
    }
    let mut bytes: Vec<u8> = limbs.iter().flat_map(|l| l.to_le_bytes()).collect();
    bytes.push(0);
    if neg {
        negate_twos(&mut bytes);
    }
    Ok(int_from_le_twos(bytes))
}

/// Python's `codecs.escape_decode`, for the quoted argument of the text `STRING` opcode.
fn escape_decode(s: &[u8]) -> std::result::Result<Vec<u8>, &'static str> {
    let mut out = Vec::with_capacity(s.len());
    let mut i = 0;
    while let Some(&c) = s.get(i) {
        i += 1;
        if c != b'\\' {
            out.push(c);
            continue;
        }
        let Some(&e) = s.get(i) else { return Err("trailing \\ in string") };
        i += 1;
        match e {
            b'\n' => {}
            b'\\' | b'\'' | b'"' => out.push(e),
            b'b' => out.push(8),
            b'f' => out.push(12),
            b't' => out.push(9),
            b'n' => out.push(10),
            b'r' => out.push(13),
            b'v' => out.push(11),
            b'a' => out.push(7),
            b'0'..=b'7' => {
                let mut v = u32::from(e - b'0');
                for _ in 0..2 {
                    match s.get(i) {
                        Some(&d @ b'0'..=b'7') => {
                            v = v * 8 + u32::from(d - b'0');
                            i += 1;
                        }
                        _ => break,
                    }
                }
                out.push((v & 0xff) as u8);
            }
            b'x' => {
                let hex = s.get(i..i + 2).ok_or("invalid \\x escape")?;
                let hi = (hex[0] as char).to_digit(16).ok_or("invalid \\x escape")?;
                let lo = (hex[1] as char).to_digit(16).ok_or("invalid \\x escape")?;
                out.push((hi * 16 + lo) as u8);
                i += 2;
            }
            other => {
                out.push(b'\\');
                out.push(other);
            }
        }
    }
    Ok(out)
}

/// Builds a string from code points: escaped surrogate pairs are combined, lone surrogates
/// become U+FFFD.
#[derive(Default)]
struct CodePoints {
    out: String,
    high: Option<u32>,
}

impl CodePoints {
    fn push(&mut self, cp: u32) {
        if (0xDC00..0xE000).contains(&cp) {
            if let Some(high) = self.high.take() {
                let c = 0x10000 + ((high - 0xD800) << 10) + (cp - 0xDC00);
                self.out.push(char::from_u32(c).unwrap_or(char::REPLACEMENT_CHARACTER));
            } else {
                self.out.push(char::REPLACEMENT_CHARACTER);
            }
            return;
        }
        if self.high.take().is_some() {
            self.out.push(char::REPLACEMENT_CHARACTER);
        }
        if (0xD800..0xDC00).contains(&cp) {
            self.high = Some(cp);
        } else {
            self.out.push(char::from_u32(cp).unwrap_or(char::REPLACEMENT_CHARACTER));
        }
    }
    fn finish(mut self) -> String {
        if self.high.is_some() {
            self.out.push(char::REPLACEMENT_CHARACTER);
        }
        self.out
    }
}

/// Python's `raw-unicode-escape` decoding, for the text `UNICODE` opcode: bytes are Latin-1
/// code points except `\uXXXX` / `\UXXXXXXXX` after an odd number of backslashes.
fn raw_unicode_escape(s: &[u8]) -> std::result::Result<String, &'static str> {
    let mut cps = CodePoints { out: String::with_capacity(s.len()), high: None };
    let mut i = 0;
    while let Some(&c) = s.get(i) {
        if c != b'\\' {
            cps.push(u32::from(c));
            i += 1;
            continue;
        }
        let start = i;
        while s.get(i) == Some(&b'\\') {
            i += 1;
        }
        let n = i - start;
        let kind = s.get(i).copied();
        let escape = n % 2 == 1 && matches!(kind, Some(b'u' | b'U'));
        for _ in 0..(if escape { n - 1 } else { n }) {
            cps.push(u32::from(b'\\'));
        }
        if !escape {
            continue;
        }
        let count = if kind == Some(b'u') { 4 } else { 8 };
        i += 1;
        let hex = s.get(i..i + count).ok_or("truncated \\uXXXX escape")?;
        let mut cp = 0u32;
        for &h in hex {
            let d = (h as char).to_digit(16).ok_or("truncated \\uXXXX escape")?;
            cp = cp.checked_mul(16).and_then(|x| x.checked_add(d)).ok_or("\\Uxxxxxxxx out of range")?;
        }
        if cp > 0x10FFFF {
            return Err("\\Uxxxxxxxx out of range");
        }
        i += count;
        cps.push(cp);
    }
    Ok(cps.finish())
}

/// A string from UTF-8 that may hold surrogates (Python's `surrogatepass`): invalid
/// sequences become U+FFFD.
fn utf8_lossy(b: &[u8]) -> String {
    match std::str::from_utf8(b) {
        Ok(s) => s.to_string(),
        Err(_) => String::from_utf8_lossy(b).into_owned(),
    }
}

/// Python 2 `str`: text when it is UTF-8, bytes otherwise.
fn str_or_bytes(b: Vec<u8>) -> PickleValue {
    match String::from_utf8(b) {
        Ok(s) => PickleValue::Str(s),
        Err(e) => PickleValue::Bytes(e.into_bytes()),
    }
}

/// Encodes `s` as `_codecs.encode(s, encoding)` would, for the encodings pickles use.
fn encode_str(s: &str, encoding: &str) -> Option<Vec<u8>> {
    let enc = encoding.to_ascii_lowercase().replace('_', "-");
    match enc.as_str() {
        "latin1" | "latin-1" | "iso-8859-1" | "iso8859-1" | "l1" => {
            s.chars().map(|c| u8::try_from(u32::from(c)).ok()).collect()
        }
        "utf-8" | "utf8" => Some(s.as_bytes().to_vec()),
        _ => None,
    }
}

// ---------------------------------------------------------------------------------------------
// The machine.

/// Index of a node in the arena.
type Id = usize;

/// Deepest tuple nesting hashed as a dict key (deeper keys are not deduplicated).
const KEY_DEPTH: usize = 32;

/// Keys (and, for dicts, values) with a hash index to deduplicate keys as Python does.
#[derive(Default)]
struct Keyed {
    keys: Vec<Id>,
    /// Parallel to `keys` for dicts; empty for sets.
    values: Vec<Id>,
    index: HashMap<u64, Vec<usize>>,
}

/// One value under construction. Containers refer to their items by id, so that every
/// reference to a container sees later mutations (`APPEND` after a memo `GET`).
enum Node {
    /// None, Bool, Int, BigInt, Float, Str, Bytes, Global.
    Leaf(PickleValue),
    List(Vec<Id>),
    Tuple(Vec<Id>),
    Dict(Box<Keyed>),
    Set(Box<Keyed>),
    Object(Box<ObjNode>),
    Persistent(Id),
}

struct ObjNode {
    /// A `Leaf(Global)` node.
    class: Id,
    args: Vec<Id>,
    kwargs: Keyed,
    state: Option<Id>,
    /// `state` is a dict this object made by merging (no one else refers to it).
    state_owned: bool,
    list_items: Vec<Id>,
    dict_items: Keyed,
}

/// Which key collection of a node an insertion goes to.
#[derive(Clone, Copy)]
enum Slot {
    /// A dict's items, or a set's elements.
    Main,
    /// An object's `dict_items`.
    ObjItems,
}

/// Callables and classes the unpickler turns into plain values.
#[derive(Clone, Copy)]
enum Known {
    Dict,
    TorchSize,
    CodecsEncode,
    Bytes,
    Set,
    List,
    Tuple,
    Reconstructor,
    NewObj,
    NewObjEx,
}

fn known_kind(module: &str, name: &str) -> Option<Known> {
    let module = match module {
        "__builtin__" => "builtins",
        "copy_reg" => "copyreg",
        m => m,
    };
    Some(match (module, name) {
        ("collections", "OrderedDict") | ("builtins", "dict") => Known::Dict,
        ("torch", "Size") => Known::TorchSize,
        ("_codecs", "encode") => Known::CodecsEncode,
        ("builtins", "bytes" | "bytearray") => Known::Bytes,
        ("builtins", "set" | "frozenset") => Known::Set,
        ("builtins", "list") => Known::List,
        ("builtins", "tuple") => Known::Tuple,
        ("copyreg", "_reconstructor") => Known::Reconstructor,
        ("copyreg", "__newobj__") => Known::NewObj,
        ("copyreg", "__newobj_ex__") => Known::NewObjEx,
        _ => return None,
    })
}

/// A hashable key reduced to what Python's equality compares.
#[derive(Hash, PartialEq)]
enum Atom<'a> {
    None,
    Int(i64),
    Float(u64),
    Big(&'a [u8]),
    Str(&'a str),
    Bytes(&'a [u8]),
    Global(&'a str, &'a str),
}

fn atom(v: &PickleValue) -> Option<Atom<'_>> {
    Some(match v {
        PickleValue::None => Atom::None,
        PickleValue::Bool(b) => Atom::Int(i64::from(*b)),
        PickleValue::Int(i) => Atom::Int(*i),
        PickleValue::Float(f) if f.is_nan() => return None,
        PickleValue::Float(f) => {
            if f.fract() == 0.0 && *f >= -9_223_372_036_854_775_808.0 && *f < 9_223_372_036_854_775_808.0 {
                Atom::Int(*f as i64)
            } else {
                Atom::Float(f.to_bits())
            }
        }
        PickleValue::BigInt(b) => Atom::Big(b),
        PickleValue::Str(s) => Atom::Str(s),
        PickleValue::Bytes(b) => Atom::Bytes(b),
        PickleValue::Global { module, name } => Atom::Global(module, name),
        _ => return None,
    })
}

struct Machine<'a> {
    data: &'a [u8],
    pos: usize,
    /// Offset of the opcode being executed (for errors).
    op_pos: usize,
    origin: &'a str,
    limits: UnpickleLimits,
    nodes: Vec<Node>,
    stack: Vec<Id>,
    /// Stack lengths at each `MARK`.
    marks: Vec<usize>,
    memo: HashMap<u64, Id>,
    /// Values pushed or copied so far.
    values: usize,
    /// String and bytes payload so far.
    bytes: usize,
    hasher: RandomState,
    hash_cache: HashMap<Id, Option<u64>>,
    /// Union-find over keys found equal, so that each is compared in full once.
    alias: HashMap<Id, Id>,
}

impl<'a> Machine<'a> {
    fn new(data: &'a [u8], origin: &'a str, limits: &UnpickleLimits) -> Self {
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

    fn err(&self, what: impl std::fmt::Display) -> Error {
        Error::corrupt(self.origin, format!("pickle: at byte {}: {what}", self.op_pos))
    }

    // --- input -------------------------------------------------------------------------------

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let data = self.data;
        let end = self.pos.checked_add(n).filter(|&e| e <= data.len()).ok_or_else(|| self.err("truncated input"))?;
        let s = data.get(self.pos..end).ok_or_else(|| self.err("truncated input"))?;
        self.pos = end;
        Ok(s)
    }

    fn take_array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u8(&mut self) -> Result<u8> {
        Ok(self.take_array::<1>()?[0])
    }

    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.take_array()?))
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take_array()?))
    }

    fn i32(&mut self) -> Result<i32> {
        Ok(i32::from_le_bytes(self.take_array()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take_array()?))
    }

    /// A line without its `\n`.
    fn line(&mut self) -> Result<&'a [u8]> {
        let data = self.data;
        let rest = data.get(self.pos..).unwrap_or_default();
        let n = rest.iter().position(|&b| b == b'\n').ok_or_else(|| self.err("truncated input (no end of line)"))?;
        self.pos += n + 1;
        Ok(&rest[..n])
    }

    fn utf8_line(&mut self) -> Result<&'a str> {
        let line = self.line()?;
        std::str::from_utf8(line).map_err(|_| self.err("text argument is not UTF-8"))
    }

    /// `n` payload bytes: checked against the input left before anything is allocated, then
    /// charged to `max_bytes`.
    fn payload(&mut self, n: u64) -> Result<&'a [u8]> {
        let left = self.data.len().saturating_sub(self.pos);
        let n = usize::try_from(n)
            .ok()
            .filter(|&n| n <= left)
            .ok_or_else(|| self.err(format!("truncated input (a length of {n} bytes with {left} bytes left)")))?;
        self.charge_bytes(n)?;
        self.take(n)
    }

    fn charge_bytes(&mut self, n: usize) -> Result<()> {
        self.bytes = self.bytes.saturating_add(n);
        if self.bytes > self.limits.max_bytes {
            return Err(self.err(format!("more than {} bytes of strings (max_bytes)", self.limits.max_bytes)));
        }
        self.check_budget(self.values as u64, self.bytes as u64, "")
    }

    fn charge_values(&mut self, n: usize) -> Result<()> {
        self.values = self.values.saturating_add(n);
        if self.values > self.limits.max_values {
            return Err(self.err(format!("more than {} values (max_values)", self.limits.max_values)));
        }
        self.check_budget(self.values as u64, self.bytes as u64, "")
    }

    /// The memory budget relative to the input length ([`UnpickleLimits::output_per_input_byte`]).
    fn budget(&self) -> u64 {
        (self.data.len() as u64)
            .saturating_mul(self.limits.output_per_input_byte as u64)
            .saturating_add(self.limits.output_floor as u64)
    }

    /// Fails when `values` values holding `bytes` bytes of strings exceed [`Machine::budget`].
    fn check_budget(&self, values: u64, bytes: u64, what: &str) -> Result<()> {
        let estimate = values.saturating_mul(VALUE_COST).saturating_add(bytes);
        if estimate > self.budget() {
            return Err(self.err(format!(
                "{what}{values} values and {bytes} bytes of strings would take about {estimate} bytes, more than \
                 the budget of {} bytes for a {}-byte pickle (output_per_input_byte {}, output_floor {})",
                self.budget(),
                self.data.len(),
                self.limits.output_per_input_byte,
                self.limits.output_floor
            )));
        }
        Ok(())
    }

    // --- stack ---------------------------------------------------------------------------------

    fn alloc(&mut self, node: Node) -> Result<Id> {
        self.charge_values(1)?;
        self.nodes.push(node);
        Ok(self.nodes.len() - 1)
    }

    fn push_new(&mut self, node: Node) -> Result<()> {
        let id = self.alloc(node)?;
        self.stack.push(id);
        Ok(())
    }

    fn push_leaf(&mut self, v: PickleValue) -> Result<()> {
        self.push_new(Node::Leaf(v))
    }

    fn push_existing(&mut self, id: Id) -> Result<()> {
        self.charge_values(1)?;
        self.stack.push(id);
        Ok(())
    }

    fn floor(&self) -> usize {
        self.marks.last().copied().unwrap_or(0)
    }

    fn pop(&mut self) -> Result<Id> {
        if self.stack.len() <= self.floor() {
            return Err(self.err("stack underflow"));
        }
        self.stack.pop().ok_or_else(|| self.err("stack underflow"))
    }

    fn top(&self) -> Result<Id> {
        if self.stack.len() <= self.floor() {
            return Err(self.err("stack underflow"));
        }
        self.stack.last().copied().ok_or_else(|| self.err("stack underflow"))
    }

    fn pop_mark(&mut self) -> Result<Vec<Id>> {
        let m = self.marks.pop().ok_or_else(|| self.err("missing MARK"))?;
        if m > self.stack.len() {
            return Err(self.err("stack underflow"));
        }
        Ok(self.stack.split_off(m))
    }

    fn memo_get(&mut self, i: u64) -> Result<()> {
        let id = *self.memo.get(&i).ok_or_else(|| self.err(format!("bad memo index {i}")))?;
        self.push_existing(id)
    }

    fn memo_put(&mut self, i: u64) -> Result<()> {
        let id = self.top()?;
        self.memo.insert(i, id);
        Ok(())
    }

    // --- node access -----------------------------------------------------------------------------

    fn node(&self, id: Id) -> Result<&Node> {
        self.nodes.get(id).ok_or_else(|| self.err("internal: bad node id"))
    }

    fn node_mut(&mut self, id: Id) -> Result<&mut Node> {
        if id >= self.nodes.len() {
            return Err(self.err("internal: bad node id"));
        }
        Ok(&mut self.nodes[id])
    }

    fn leaf(&self, id: Id) -> Option<&PickleValue> {
        match self.nodes.get(id) {
            Some(Node::Leaf(v)) => Some(v),
            _ => None,
        }
    }

    fn str_of(&self, id: Id) -> Option<&str> {
        match self.leaf(id) {
            Some(PickleValue::Str(s)) => Some(s),
            _ => None,
        }
    }

    fn is_global(&self, id: Id) -> bool {
        matches!(self.leaf(id), Some(PickleValue::Global { .. }))
    }

    /// Items of a list or tuple.
    fn seq(&self, id: Id) -> Option<Vec<Id>> {
        match self.nodes.get(id) {
            Some(Node::List(items) | Node::Tuple(items)) => Some(items.clone()),
            _ => None,
        }
    }

    /// Items of a list, tuple or set.
    fn iterable(&self, id: Id) -> Option<Vec<Id>> {
        match self.nodes.get(id) {
            Some(Node::Set(k)) => Some(k.keys.clone()),
            _ => self.seq(id),
        }
    }

    fn dict_pairs(&self, id: Id) -> Option<Vec<(Id, Id)>> {
        match self.nodes.get(id) {
            Some(Node::Dict(k)) => Some(k.keys.iter().copied().zip(k.values.iter().copied()).collect()),
            _ => None,
        }
    }

    // --- keys ------------------------------------------------------------------------------------

    fn find(&mut self, id: Id) -> Id {
        let mut root = id;
        while let Some(&next) = self.alias.get(&root) {
            root = next;
        }
        let mut cur = id;
        while let Some(&next) = self.alias.get(&cur) {
            if next != root {
                self.alias.insert(cur, root);
            }
            cur = next;
        }
        root
    }

    fn union(&mut self, a: Id, b: Id) {
        let (ra, rb) = (self.find(a), self.find(b));
        if ra != rb {
            // Aliases point to smaller ids, so chains end.
            self.alias.insert(ra.max(rb), ra.min(rb));
        }
    }

    /// Hash of a value as a dict key, `None` if it is not hashable (or too deep a tuple).
    fn key_hash(&mut self, id: Id, depth: usize) -> Option<u64> {
        if let Some(h) = self.hash_cache.get(&id) {
            return *h;
        }
        let h = match self.nodes.get(id) {
            Some(Node::Leaf(v)) => atom(v).map(|a| self.hasher.hash_one(a)),
            Some(Node::Tuple(items)) if depth < KEY_DEPTH => {
                let items = items.clone();
                let mut s = self.hasher.build_hasher();
                (7u8, items.len()).hash(&mut s);
                let mut ok = true;
                for item in items {
                    match self.key_hash(item, depth + 1) {
                        Some(h) => h.hash(&mut s),
                        None => {
                            ok = false;
                            break;
                        }
                    }
                }
                ok.then(|| s.finish())
            }
            // Hashable by identity.
            Some(Node::Object(_) | Node::Persistent(_) | Node::Set(_)) => Some(self.hasher.hash_one((8u8, id))),
            _ => None,
        };
        self.hash_cache.insert(id, h);
        h
    }

    /// Whether two keys with equal hashes are equal as Python compares them.
    fn key_eq(&mut self, a: Id, b: Id, depth: usize) -> bool {
        if a == b {
            return true;
        }
        let (a, b) = (self.find(a), self.find(b));
        if a == b {
            return true;
        }
        let eq = match (self.nodes.get(a), self.nodes.get(b)) {
            (Some(Node::Leaf(x)), Some(Node::Leaf(y))) => match (atom(x), atom(y)) {
                (Some(p), Some(q)) => p == q,
                _ => false,
            },
            (Some(Node::Tuple(x)), Some(Node::Tuple(y))) if depth < KEY_DEPTH && x.len() == y.len() => {
                let pairs: Vec<(Id, Id)> = x.iter().copied().zip(y.iter().copied()).collect();
                pairs.into_iter().all(|(p, q)| self.key_eq(p, q, depth + 1))
            }
            _ => false,
        };
        if eq {
            self.union(a, b);
        }
        eq
    }

    fn keyed(&self, target: Id, slot: Slot) -> Option<&Keyed> {
        match (self.nodes.get(target), slot) {
            (Some(Node::Dict(k) | Node::Set(k)), Slot::Main) => Some(&**k),
            (Some(Node::Object(o)), Slot::ObjItems) => Some(&o.dict_items),
            _ => None,
        }
    }

    fn keyed_mut(&mut self, target: Id, slot: Slot) -> Option<&mut Keyed> {
        match (self.nodes.get_mut(target), slot) {
            (Some(Node::Dict(k) | Node::Set(k)), Slot::Main) => Some(&mut **k),
            (Some(Node::Object(o)), Slot::ObjItems) => Some(&mut o.dict_items),
            _ => None,
        }
    }

    /// Inserts a key (and its value, for dicts) into a dict, set or object's dict items; an
    /// equal key keeps its place and takes the new value.
    fn insert(&mut self, target: Id, slot: Slot, k: Id, v: Option<Id>) -> Result<()> {
        let h = self.key_hash(k, 0);
        let mut found = None;
        if let Some(h) = h {
            let cands: Vec<(usize, Id)> = match self.keyed(target, slot) {
                Some(keyed) => keyed
                    .index
                    .get(&h)
                    .map(|c| c.iter().filter_map(|&i| keyed.keys.get(i).map(|&kk| (i, kk))).collect())
                    .unwrap_or_default(),
                None => return Err(self.err("internal: not a keyed node")),
            };
            for (i, kk) in cands {
                if self.key_eq(kk, k, 0) {
                    found = Some(i);
                    break;
                }
            }
        }
        let Some(keyed) = self.keyed_mut(target, slot) else {
            return Err(self.err("internal: not a keyed node"));
        };
        match found {
            Some(i) => {
                if let (Some(v), Some(slot)) = (v, keyed.values.get_mut(i)) {
                    *slot = v;
                }
            }
            None => {
                let i = keyed.keys.len();
                keyed.keys.push(k);
                if let Some(v) = v {
                    keyed.values.push(v);
                }
                if let Some(h) = h {
                    keyed.index.entry(h).or_default().push(i);
                }
            }
        }
        Ok(())
    }

    fn insert_pairs(&mut self, target: Id, slot: Slot, pairs: &[(Id, Id)]) -> Result<()> {
        for &(k, v) in pairs {
            self.insert(target, slot, k, Some(v))?;
        }
        Ok(())
    }

    /// A new dict holding `pairs`.
    fn new_dict(&mut self, pairs: &[(Id, Id)]) -> Result<Id> {
        let id = self.alloc(Node::Dict(Box::default()))?;
        self.insert_pairs(id, Slot::Main, pairs)?;
        Ok(id)
    }

    fn new_set(&mut self, items: &[Id]) -> Result<Id> {
        let id = self.alloc(Node::Set(Box::default()))?;
        for &item in items {
            self.insert(id, Slot::Main, item, None)?;
        }
        Ok(id)
    }

    /// Pairs from a mark's items `k1 v1 k2 v2 …`.
    fn pairs_of(&self, items: &[Id], what: &str) -> Result<Vec<(Id, Id)>> {
        if !items.len().is_multiple_of(2) {
            return Err(self.err(format!("{what} with an odd number of items")));
        }
        Ok(items.chunks_exact(2).map(|c| (c[0], c[1])).collect())
    }

    // --- calls -----------------------------------------------------------------------------------

    fn new_object(&mut self, class: Id, args: Vec<Id>, kwargs: Keyed) -> Result<Id> {
        self.alloc(Node::Object(Box::new(ObjNode {
            class,
            args,
            kwargs,
            state: None,
            state_owned: false,
            list_items: Vec::new(),
            dict_items: Keyed::default(),
        })))
    }

    /// A call (`REDUCE`, `OBJ`, `INST`) or instantiation (`NEWOBJ`, `NEWOBJ_EX`) of `class`:
    /// a plain value for the known callables, an unevaluated object otherwise. `known` is
    /// false for the class inside `copyreg.__newobj__`, so that the copyreg helpers do not
    /// nest.
    fn call(&mut self, class: Id, args: Vec<Id>, kwargs: Keyed, what: &str, known: bool) -> Result<Id> {
        let kind = match self.leaf(class) {
            Some(PickleValue::Global { module, name }) => known_kind(module, name),
            _ => return Err(self.err(format!("{what} of a value that is not a global"))),
        };
        // The copyreg helpers do not nest (their class argument is taken as given).
        let kind = kind.filter(|k| known || !matches!(k, Known::Reconstructor | Known::NewObj | Known::NewObjEx));
        if let (Some(kind), true) = (kind, kwargs.keys.is_empty()) {
            if let Some(id) = self.known_call(kind, &args)? {
                return Ok(id);
            }
        }
        self.new_object(class, args, kwargs)
    }

    /// The plain value a known callable makes of `args`, if they have the expected shape.
    fn known_call(&mut self, kind: Known, args: &[Id]) -> Result<Option<Id>> {
        Ok(Some(match (kind, args) {
            (Known::Dict, []) => self.new_dict(&[])?,
            (Known::Dict, [a]) => {
                let pairs = if let Some(pairs) = self.dict_pairs(*a) {
                    pairs
                } else if let Some(items) = self.iterable(*a) {
                    let mut pairs = Vec::with_capacity(items.len());
                    for item in items {
                        match self.seq(item).as_deref() {
                            Some(&[k, v]) => pairs.push((k, v)),
                            _ => return Ok(None),
                        }
                    }
                    pairs
                } else {
                    return Ok(None);
                };
                self.charge_values(pairs.len())?;
                self.new_dict(&pairs)?
            }
            (Known::TorchSize, [a]) => {
                let Some(items) = self.seq(*a) else { return Ok(None) };
                if !items.iter().all(|&i| matches!(self.leaf(i), Some(PickleValue::Int(_)))) {
                    return Ok(None);
                }
                self.charge_values(items.len())?;
                self.alloc(Node::Tuple(items))?
            }
            (Known::CodecsEncode, [s]) => {
                let Some(b) = self.str_of(*s).map(|s| s.as_bytes().to_vec()) else { return Ok(None) };
                self.new_bytes(b)?
            }
            (Known::CodecsEncode | Known::Bytes, [s, enc]) => {
                let (Some(s), Some(enc)) = (self.str_of(*s), self.str_of(*enc)) else { return Ok(None) };
                let Some(b) = encode_str(s, enc) else { return Ok(None) };
                self.new_bytes(b)?
            }
            (Known::Bytes, []) => self.new_bytes(Vec::new())?,
            (Known::Bytes, [a]) => {
                let b = match self.leaf(*a) {
                    Some(PickleValue::Bytes(b)) => b.clone(),
                    _ => {
                        let Some(items) = self.seq(*a) else { return Ok(None) };
                        let mut b = Vec::with_capacity(items.len());
                        for i in items {
                            match self.leaf(i) {
                                Some(PickleValue::Int(x)) => match u8::try_from(*x) {
                                    Ok(x) => b.push(x),
                                    Err(_) => return Ok(None),
                                },
                                _ => return Ok(None),
                            }
                        }
                        b
                    }
                };
                self.new_bytes(b)?
            }
            (Known::Set, []) => self.new_set(&[])?,
            (Known::Set, [a]) => {
                let Some(items) = self.iterable(*a) else { return Ok(None) };
                self.charge_values(items.len())?;
                self.new_set(&items)?
            }
            (Known::List | Known::Tuple, []) => {
                let node = if matches!(kind, Known::List) { Node::List(Vec::new()) } else { Node::Tuple(Vec::new()) };
                self.alloc(node)?
            }
            (Known::List | Known::Tuple, [a]) => {
                let Some(items) = self.iterable(*a) else { return Ok(None) };
                self.charge_values(items.len())?;
                let node = if matches!(kind, Known::List) { Node::List(items) } else { Node::Tuple(items) };
                self.alloc(node)?
            }
            (Known::Reconstructor, [cls, base, state]) if self.is_global(*cls) => {
                self.new_object(*cls, vec![*base, *state], Keyed::default())?
            }
            (Known::NewObj, [cls, rest @ ..]) if self.is_global(*cls) => {
                self.charge_values(rest.len())?;
                self.call(*cls, rest.to_vec(), Keyed::default(), "copyreg.__newobj__", false)?
            }
            (Known::NewObjEx, [cls, a, kw]) if self.is_global(*cls) => {
                let (Some(a), Some(kw)) = (self.seq(*a), self.dict_pairs(*kw)) else { return Ok(None) };
                self.charge_values(a.len() + kw.len())?;
                let kwargs = self.keyed_from(&kw)?;
                self.call(*cls, a, kwargs, "copyreg.__newobj_ex__", false)?
            }
            _ => return Ok(None),
        }))
    }

    fn new_bytes(&mut self, b: Vec<u8>) -> Result<Id> {
        self.charge_bytes(b.len())?;
        self.alloc(Node::Leaf(PickleValue::Bytes(b)))
    }

    /// A detached key collection (for keyword arguments) holding `pairs`.
    fn keyed_from(&mut self, pairs: &[(Id, Id)]) -> Result<Keyed> {
        // Build it in a scratch dict node, then take it out (the node stays, empty).
        let id = self.new_dict(pairs)?;
        match self.node_mut(id)? {
            Node::Dict(k) => Ok(std::mem::take(&mut **k)),
            _ => Err(self.err("internal: not a dict")),
        }
    }

    // --- opcodes ---------------------------------------------------------------------------------

    /// The pairs of a dict node, charged to `max_values` (they are copied).
    fn copied_pairs(&mut self, id: Id) -> Result<Option<Vec<(Id, Id)>>> {
        let n = match self.nodes.get(id) {
            Some(Node::Dict(k)) => k.keys.len(),
            _ => return Ok(None),
        };
        self.charge_values(n)?;
        Ok(self.dict_pairs(id))
    }

    fn is_dict(&self, id: Id) -> bool {
        matches!(self.nodes.get(id), Some(Node::Dict(_)))
    }

    fn build(&mut self) -> Result<()> {
        let state = self.pop()?;
        let target = self.top()?;
        match self.node(target)? {
            Node::Object(o) => {
                let (old, owned) = (o.state, o.state_owned);
                let (new_state, new_owned) = match old {
                    // dict.update of the earlier dict state: into a copy, unless this object
                    // made that dict itself by an earlier merge.
                    Some(old) if self.is_dict(old) && self.is_dict(state) => {
                        let merged = if owned {
                            old
                        } else {
                            let old_pairs = self.copied_pairs(old)?.unwrap_or_default();
                            self.new_dict(&old_pairs)?
                        };
                        let pairs = self.copied_pairs(state)?.unwrap_or_default();
                        self.insert_pairs(merged, Slot::Main, &pairs)?;
                        (merged, true)
                    }
                    _ => (state, false),
                };
                if let Node::Object(o) = self.node_mut(target)? {
                    o.state = Some(new_state);
                    o.state_owned = new_owned;
                }
                Ok(())
            }
            Node::Dict(_) => match self.copied_pairs(state)? {
                Some(pairs) => self.insert_pairs(target, Slot::Main, &pairs),
                None if matches!(self.leaf(state), Some(PickleValue::None)) => Ok(()),
                None => Err(self.err("BUILD of a dict with a state that is not a dict")),
            },
            _ => Err(self.err("BUILD on a value that is neither an object nor a dict")),
        }
    }

    fn append(&mut self, items: Vec<Id>) -> Result<()> {
        let target = self.top()?;
        match self.node_mut(target)? {
            Node::List(l) => l.extend(items),
            Node::Object(o) => o.list_items.extend(items),
            _ => return Err(self.err("APPEND to a value that is not a list")),
        }
        Ok(())
    }

    fn setitems(&mut self, pairs: Vec<(Id, Id)>) -> Result<()> {
        let target = self.top()?;
        let slot = match self.node(target)? {
            Node::Dict(_) => Slot::Main,
            Node::Object(_) => Slot::ObjItems,
            _ => return Err(self.err("SETITEM on a value that is not a dict")),
        };
        self.insert_pairs(target, slot, &pairs)
    }

    fn stack_global(&mut self) -> Result<()> {
        let name = self.pop()?;
        let module = self.pop()?;
        let (Some(module), Some(name)) = (self.str_of(module), self.str_of(name)) else {
            return Err(self.err("STACK_GLOBAL with a module or name that is not a string"));
        };
        let (module, name) = (module.to_string(), name.to_string());
        self.push_leaf(PickleValue::Global { module, name })
    }

    /// Runs the opcodes up to `STOP`; returns the id of the value on top of the stack then.
    fn run(&mut self) -> Result<Id> {
        loop {
            self.op_pos = self.pos;
            let Some(&op) = self.data.get(self.pos) else {
                return Err(self.err("no STOP opcode (truncated input)"));
            };
            self.pos += 1;
            match op {
                b'.' => return self.pop(), // STOP
                // Framing and protocol.
                0x80 => {
                    let proto = self.u8()?;
                    if proto > 5 {
                        return Err(self.err(format!("unsupported pickle protocol {proto}")));
                    }
                }
                0x95 => {
                    self.u64()?; // FRAME: frames are inline, the length is not needed
                }
                // Stack manipulation.
                b'(' => self.marks.push(self.stack.len()),
                b'0' => {
                    // POP: an empty stack above the mark pops the mark (as CPython does).
                    if self.stack.len() > self.floor() {
                        self.pop()?;
                    } else {
                        self.pop_mark()?;
                    }
                }
                b'1' => {
                    self.pop_mark()?;
                }
                b'2' => {
                    let id = self.top()?;
                    self.push_existing(id)?;
                }
                // Memo.
                b'p' => {
                    let line = self.line()?;
                    let i = parse_index(line).ok_or_else(|| self.err("bad PUT index"))?;
                    self.memo_put(i)?;
                }
                b'q' => {
                    let i = self.u8()?;
                    self.memo_put(u64::from(i))?;
                }
                b'r' => {
                    let i = self.u32()?;
                    self.memo_put(u64::from(i))?;
                }
                0x94 => {
                    let i = self.memo.len() as u64;
                    self.memo_put(i)?;
                }
                b'g' => {
                    let line = self.line()?;
                    let i = parse_index(line).ok_or_else(|| self.err("bad memo index"))?;
                    self.memo_get(i)?;
                }
                b'h' => {
                    let i = self.u8()?;
                    self.memo_get(u64::from(i))?;
                }
                b'j' => {
                    let i = self.u32()?;
                    self.memo_get(u64::from(i))?;
                }
                // Constants and numbers.
                b'N' => self.push_leaf(PickleValue::None)?,
                0x88 => self.push_leaf(PickleValue::Bool(true))?,
                0x89 => self.push_leaf(PickleValue::Bool(false))?,
                b'I' => {
                    let line = self.line()?;
                    let v = match line {
                        b"00" => PickleValue::Bool(false),
                        b"01" => PickleValue::Bool(true),
                        _ => parse_int_text(line).map_err(|e| self.err(e))?,
                    };
                    self.push_leaf(v)?;
                }
                b'L' => {
                    let line = self.line()?;
                    let line = line.strip_suffix(b"L").unwrap_or(line);
                    let v = parse_int_text(line).map_err(|e| self.err(e))?;
                    self.push_leaf(v)?;
                }
                b'J' => {
                    let v = self.i32()?;
                    self.push_leaf(PickleValue::Int(i64::from(v)))?;
                }
                b'K' => {
                    let v = self.u8()?;
                    self.push_leaf(PickleValue::Int(i64::from(v)))?;
                }
                b'M' => {
                    let v = self.u16()?;
                    self.push_leaf(PickleValue::Int(i64::from(v)))?;
                }
                0x8a => {
                    let n = self.u8()?;
                    let b = self.payload(u64::from(n))?.to_vec();
                    self.push_leaf(int_from_le_twos(b))?;
                }
                0x8b => {
                    let n = self.i32()?;
                    let n = u64::try_from(n).map_err(|_| self.err("LONG4 with a negative byte count"))?;
                    let b = self.payload(n)?.to_vec();
                    self.push_leaf(int_from_le_twos(b))?;
                }
                b'F' => {
                    let line = self.line()?;
                    let f = std::str::from_utf8(line)
                        .ok()
                        .and_then(|s| s.trim().parse::<f64>().ok())
                        .ok_or_else(|| self.err("invalid FLOAT"))?;
                    self.push_leaf(PickleValue::Float(f))?;
                }
                b'G' => {
                    let f = f64::from_be_bytes(self.take_array()?);
                    self.push_leaf(PickleValue::Float(f))?;
                }
                // Strings and bytes.
                b'S' => {
                    let line = self.line()?;
                    let inner = match line {
                        [q @ (b'\'' | b'"'), inner @ .., last] if last == q => inner,
                        _ => return Err(self.err("the STRING opcode argument must be quoted")),
                    };
                    let b = escape_decode(inner).map_err(|e| self.err(e))?;
                    self.charge_bytes(b.len())?;
                    self.push_leaf(str_or_bytes(b))?;
                }
                b'T' => {
                    let n = self.i32()?;
                    let n = u64::try_from(n).map_err(|_| self.err("BINSTRING with a negative length"))?;
                    let b = self.payload(n)?.to_vec();
                    self.push_leaf(str_or_bytes(b))?;
                }
                b'U' => {
                    let n = self.u8()?;
                    let b = self.payload(u64::from(n))?.to_vec();
                    self.push_leaf(str_or_bytes(b))?;
                }
                b'V' => {
                    let line = self.line()?;
                    let s = raw_unicode_escape(line).map_err(|e| self.err(e))?;
                    self.charge_bytes(s.len())?;
                    self.push_leaf(PickleValue::Str(s))?;
                }
                b'X' | 0x8c | 0x8d => {
                    let n = match op {
                        b'X' => u64::from(self.u32()?),
                        0x8c => u64::from(self.u8()?),
                        _ => self.u64()?,
                    };
                    let s = utf8_lossy(self.payload(n)?);
                    self.push_leaf(PickleValue::Str(s))?;
                }
                b'B' | b'C' | 0x8e | 0x96 => {
                    let n = match op {
                        b'B' => u64::from(self.u32()?),
                        b'C' => u64::from(self.u8()?),
                        _ => self.u64()?,
                    };
                    let b = self.payload(n)?.to_vec();
                    self.push_leaf(PickleValue::Bytes(b))?;
                }
                // Lists.
                b']' => self.push_new(Node::List(Vec::new()))?,
                b'l' => {
                    let items = self.pop_mark()?;
                    self.push_new(Node::List(items))?;
                }
                b'a' => {
                    let v = self.pop()?;
                    self.append(vec![v])?;
                }
                b'e' => {
                    let items = self.pop_mark()?;
                    self.append(items)?;
                }
                // Tuples.
                b')' => self.push_new(Node::Tuple(Vec::new()))?,
                b't' => {
                    let items = self.pop_mark()?;
                    self.push_new(Node::Tuple(items))?;
                }
                0x85..=0x87 => {
                    let n = usize::from(op - 0x84);
                    if self.stack.len() < self.floor() + n {
                        return Err(self.err("stack underflow"));
                    }
                    let items = self.stack.split_off(self.stack.len() - n);
                    self.push_new(Node::Tuple(items))?;
                }
                // Dicts.
                b'}' => self.push_new(Node::Dict(Box::default()))?,
                b'd' => {
                    let items = self.pop_mark()?;
                    let pairs = self.pairs_of(&items, "DICT")?;
                    let id = self.new_dict(&pairs)?;
                    self.stack.push(id);
                }
                b's' => {
                    let v = self.pop()?;
                    let k = self.pop()?;
                    self.setitems(vec![(k, v)])?;
                }
                b'u' => {
                    let items = self.pop_mark()?;
                    let pairs = self.pairs_of(&items, "SETITEMS")?;
                    self.setitems(pairs)?;
                }
                // Sets.
                0x8f => self.push_new(Node::Set(Box::default()))?,
                0x90 => {
                    let items = self.pop_mark()?;
                    let target = self.top()?;
                    if !matches!(self.node(target)?, Node::Set(_)) {
                        return Err(self.err("ADDITEMS to a value that is not a set"));
                    }
                    for item in items {
                        self.insert(target, Slot::Main, item, None)?;
                    }
                }
                0x91 => {
                    let items = self.pop_mark()?;
                    let id = self.new_set(&items)?;
                    self.stack.push(id);
                }
                // Globals, calls and objects.
                b'c' => {
                    let module = self.utf8_line()?.to_string();
                    let name = self.utf8_line()?.to_string();
                    self.charge_bytes(module.len() + name.len())?;
                    self.push_leaf(PickleValue::Global { module, name })?;
                }
                0x93 => self.stack_global()?,
                b'R' => {
                    let args = self.pop()?;
                    let func = self.pop()?;
                    if !self.is_global(func) {
                        return Err(self.err("REDUCE of a value that is not a global"));
                    }
                    let args = self.seq(args).ok_or_else(|| self.err("REDUCE arguments are not a tuple"))?;
                    self.charge_values(args.len())?;
                    let id = self.call(func, args, Keyed::default(), "REDUCE", true)?;
                    self.stack.push(id);
                }
                0x81 => {
                    let args = self.pop()?;
                    let cls = self.pop()?;
                    let args = self.seq(args).ok_or_else(|| self.err("NEWOBJ arguments are not a tuple"))?;
                    self.charge_values(args.len())?;
                    let id = self.call(cls, args, Keyed::default(), "NEWOBJ", true)?;
                    self.stack.push(id);
                }
                0x92 => {
                    let kwargs = self.pop()?;
                    let args = self.pop()?;
                    let cls = self.pop()?;
                    let args = self.seq(args).ok_or_else(|| self.err("NEWOBJ_EX arguments are not a tuple"))?;
                    let kw = self
                        .dict_pairs(kwargs)
                        .ok_or_else(|| self.err("NEWOBJ_EX keyword arguments are not a dict"))?;
                    self.charge_values(args.len() + kw.len())?;
                    let kwargs = self.keyed_from(&kw)?;
                    let id = self.call(cls, args, kwargs, "NEWOBJ_EX", true)?;
                    self.stack.push(id);
                }
                b'o' => {
                    let items = self.pop_mark()?;
                    let Some((&cls, args)) = items.split_first() else {
                        return Err(self.err("OBJ without a class"));
                    };
                    let id = self.call(cls, args.to_vec(), Keyed::default(), "OBJ", true)?;
                    self.stack.push(id);
                }
                b'i' => {
                    let module = self.utf8_line()?.to_string();
                    let name = self.utf8_line()?.to_string();
                    self.charge_bytes(module.len() + name.len())?;
                    let args = self.pop_mark()?;
                    let cls = self.alloc(Node::Leaf(PickleValue::Global { module, name }))?;
                    let id = self.call(cls, args, Keyed::default(), "INST", true)?;
                    self.stack.push(id);
                }
                b'b' => self.build()?,
                // Persistent ids.
                b'P' => {
                    let line = self.line()?;
                    if !line.is_ascii() {
                        return Err(self.err("persistent IDs in protocol 0 must be ASCII strings"));
                    }
                    self.charge_bytes(line.len())?;
                    let s = String::from_utf8_lossy(line).into_owned();
                    let pid = self.alloc(Node::Leaf(PickleValue::Str(s)))?;
                    self.push_new(Node::Persistent(pid))?;
                }
                b'Q' => {
                    let pid = self.pop()?;
                    self.push_new(Node::Persistent(pid))?;
                }
                // Refused.
                0x82..=0x84 => return Err(self.err("extension registry opcodes (EXT1/EXT2/EXT4) are not supported")),
                0x97 | 0x98 => {
                    return Err(self.err("out-of-band buffers (NEXT_BUFFER/READONLY_BUFFER) are not supported"))
                }
                _ => return Err(self.err(format!("unknown opcode 0x{op:02x}"))),
            }
        }
    }

    // --- result ----------------------------------------------------------------------------------

    /// Calls `f` on each child of a node, in the order materialization lays them out.
    fn for_each_child(&self, id: Id, mut f: impl FnMut(Id)) {
        let keyed = |k: &Keyed, f: &mut dyn FnMut(Id)| {
            if k.values.is_empty() {
                k.keys.iter().for_each(|&x| f(x));
            } else {
                for (&a, &b) in k.keys.iter().zip(&k.values) {
                    f(a);
                    f(b);
                }
            }
        };
        match self.nodes.get(id) {
            None | Some(Node::Leaf(_)) => {}
            Some(Node::List(items) | Node::Tuple(items)) => items.iter().for_each(|&x| f(x)),
            Some(Node::Dict(k) | Node::Set(k)) => keyed(k, &mut f),
            Some(Node::Persistent(p)) => f(*p),
            Some(Node::Object(o)) => {
                o.args.iter().for_each(|&x| f(x));
                keyed(&o.kwargs, &mut f);
                if let Some(s) = o.state {
                    f(s);
                }
                o.list_items.iter().for_each(|&x| f(x));
                keyed(&o.dict_items, &mut f);
            }
        }
    }

    /// Bytes of strings a node holds itself (not counting children).
    fn own_bytes(&self, id: Id) -> usize {
        let leaf_bytes = |v: &PickleValue| match v {
            PickleValue::Str(s) => s.len(),
            PickleValue::Bytes(b) | PickleValue::BigInt(b) => b.len(),
            PickleValue::Global { module, name } => module.len() + name.len(),
            _ => 0,
        };
        match self.nodes.get(id) {
            Some(Node::Leaf(v)) => leaf_bytes(v),
            Some(Node::Object(o)) => self.leaf(o.class).map_or(0, leaf_bytes),
            _ => 0,
        }
    }

    /// Checks, before building anything, that the tree under `root` is finite (no cycle) and
    /// within the limits: depth, values and string bytes counting every copy of shared values.
    /// Linear in the number of nodes reachable from `root`.
    fn check_tree(&self, root: Id) -> Result<()> {
        const WHITE: u8 = 0;
        const GREY: u8 = 1;
        const BLACK: u8 = 2;
        let n = self.nodes.len();
        let mut color = vec![WHITE; n];
        // Per node: values, bytes and height of its materialized subtree (saturating).
        let mut size = vec![(0u64, 0u64, 0u64); n];
        let mut todo: Vec<(Id, bool)> = vec![(root, false)];
        let cycle = || self.err("recursive structure (a container contains itself), which a tree cannot hold");
        while let Some((id, done)) = todo.pop() {
            let Some(&c) = color.get(id) else { return Err(self.err("internal: bad node id")) };
            if done {
                let (mut values, mut bytes, mut height) = (1u64, self.own_bytes(id) as u64, 0u64);
                let container = !matches!(self.nodes.get(id), Some(Node::Leaf(_)));
                self.for_each_child(id, |child| {
                    let (v, b, h) = size.get(child).copied().unwrap_or_default();
                    values = values.saturating_add(v);
                    bytes = bytes.saturating_add(b);
                    height = height.max(h);
                });
                if container {
                    height = height.saturating_add(1);
                }
                if height > self.limits.max_depth as u64 {
                    return Err(self.err(format!("nesting deeper than {} levels (max_depth)", self.limits.max_depth)));
                }
                if values > self.limits.max_values as u64 {
                    return Err(self.err(format!(
                        "the result would hold more than {} values (max_values; shared values count once per copy)",
                        self.limits.max_values
                    )));
                }
                if bytes > self.limits.max_bytes as u64 {
                    return Err(self.err(format!(
                        "the result would hold more than {} bytes of strings (max_bytes; shared values count once per copy)",
                        self.limits.max_bytes
                    )));
                }
                self.check_budget(values, bytes, "the result (shared values counted once per copy): ")?;
                size[id] = (values, bytes, height);
                color[id] = BLACK;
                continue;
            }
            match c {
                BLACK => continue,
                GREY => return Err(cycle()),
                _ => {}
            }
            color[id] = GREY;
            todo.push((id, true));
            let mut found_cycle = false;
            self.for_each_child(id, |child| match color.get(child) {
                Some(&GREY) => found_cycle = true,
                Some(&WHITE) => todo.push((child, false)),
                _ => {}
            });
            if found_cycle {
                return Err(cycle());
            }
        }
        Ok(())
    }

    /// Builds the tree under `root` (checked by [`Machine::check_tree`]) without recursion.
    fn materialize(&self, root: Id) -> Result<PickleValue> {
        enum Frame {
            Enter(Id),
            Exit(Id),
        }
        let mut frames = vec![Frame::Enter(root)];
        let mut out: Vec<PickleValue> = Vec::new();
        let internal = || self.err("internal: malformed value tree");
        while let Some(frame) = frames.pop() {
            match frame {
                Frame::Enter(id) => {
                    if let Node::Leaf(v) = self.node(id)? {
                        out.push(v.clone());
                        continue;
                    }
                    frames.push(Frame::Exit(id));
                    let mut children = Vec::new();
                    self.for_each_child(id, |c| children.push(c));
                    frames.extend(children.into_iter().rev().map(Frame::Enter));
                }
                Frame::Exit(id) => {
                    let mut count = 0usize;
                    self.for_each_child(id, |_| count += 1);
                    let start = out.len().checked_sub(count).ok_or_else(internal)?;
                    let mut items = out.split_off(start).into_iter();
                    let mut take = |n: usize| items.by_ref().take(n).collect::<Vec<_>>();
                    let pairs = |v: Vec<PickleValue>| {
                        let mut it = v.into_iter();
                        let mut pairs = Vec::new();
                        while let (Some(k), Some(v)) = (it.next(), it.next()) {
                            pairs.push((k, v));
                        }
                        pairs
                    };
                    let value = match self.node(id)? {
                        Node::Leaf(_) => return Err(internal()),
                        Node::List(_) => PickleValue::List(take(count)),
                        Node::Tuple(_) => PickleValue::Tuple(take(count)),
                        Node::Set(_) => PickleValue::Set(take(count)),
                        Node::Dict(_) => PickleValue::Dict(pairs(take(count))),
                        Node::Persistent(_) => PickleValue::PersistentId(Box::new(take(1).pop().ok_or_else(internal)?)),
                        Node::Object(o) => {
                            let (module, name) = match self.leaf(o.class) {
                                Some(PickleValue::Global { module, name }) => (module.clone(), name.clone()),
                                _ => return Err(internal()),
                            };
                            let args = take(o.args.len());
                            let kwargs = pairs(take(2 * o.kwargs.keys.len()));
                            let state = if o.state.is_some() { take(1).pop() } else { None };
                            let list_items = take(o.list_items.len());
                            let dict_items = pairs(take(2 * o.dict_items.keys.len()));
                            PickleValue::Object(Box::new(PickleObject {
                                module,
                                name,
                                args,
                                kwargs,
                                state,
                                list_items,
                                dict_items,
                            }))
                        }
                    };
                    out.push(value);
                }
            }
        }
        match (out.pop(), out.is_empty()) {
            (Some(v), true) => Ok(v),
            _ => Err(internal()),
        }
    }
}

/// A memo index in text (`PUT`/`GET` of protocol 0).
fn parse_index(line: &[u8]) -> Option<u64> {
    std::str::from_utf8(line).ok()?.trim().parse::<u64>().ok()
}

#[cfg(test)]
mod tests {
    //! Vectors come from CPython 3.11's `pickle` (torch 2.15 for `torch.Size`), each with the
    //! expression that produced it. Some use a fake module made in the generating script:
    //! `fakemod = types.ModuleType('fakemod'); sys.modules['fakemod'] = fakemod` holding
    //! `@dataclass class Point: x: int; y: list`, `class Ex` (with `__getnewargs_ex__`) and
    //! `class Slotted: __slots__ = ('a',)`. NESTED is
    //! `{'a': [1, -2, 300, 70000, -(2**40), 2**70, -(2**70), 1.5, float('inf'), None, True, False],
    //!   'b': ('x', b'y\x00\xff', bytearray(b'ba'), 'é\n\\😀', ''),
    //!   'c': {'d': {1, 2}, 'e': frozenset([3])}, 'f': ()}`.
    use super::*;

    // pickle.dumps(NESTED, 0), NESTED as in the comment above
    const NESTED_P0: &[u8] = b"(dp0\nVa\np1\n(lp2\nI1\naI-2\naI300\naI70000\naL-1099511627776L\naL1180591620717411303424L\naL-1180591620717411303424L\naF1.5\naFinf\naNaI01\naI00\nasVb\np3\n(Vx\np4\nc_codecs\nencode\np5\n(Vy\\u0000\xff\np6\nVlatin1\np7\ntp8\nRp9\nc__builtin__\nbytearray\np10\n(g5\n(Vba\np11\ng7\ntp12\nRp13\ntp14\nRp15\nV\xe9\\u000a\\u005c\\U0001f600\np16\nV\np17\ntp18\nsVc\np19\n(dp20\nVd\np21\nc__builtin__\nset\np22\n((lp23\nI1\naI2\natp24\nRp25\nsVe\np26\nc__builtin__\nfrozenset\np27\n((lp28\nI3\natp29\nRp30\nssVf\np31\n(ts.";
    // pickle.dumps(NESTED, 1), NESTED as in the comment above
    const NESTED_P1: &[u8] = b"}q\x00(X\x01\x00\x00\x00aq\x01]q\x02(K\x01J\xfe\xff\xff\xffM,\x01Jp\x11\x01\x00L-1099511627776L\nL1180591620717411303424L\nL-1180591620717411303424L\nG?\xf8\x00\x00\x00\x00\x00\x00G\x7f\xf0\x00\x00\x00\x00\x00\x00NI01\nI00\neX\x01\x00\x00\x00bq\x03(X\x01\x00\x00\x00xq\x04c_codecs\nencode\nq\x05(X\x04\x00\x00\x00y\x00\xc3\xbfq\x06X\x06\x00\x00\x00latin1q\x07tq\x08Rq\x09c__builtin__\nbytearray\nq\n(h\x05(X\x02\x00\x00\x00baq\x0bh\x07tq\x0cRq\x0dtq\x0eRq\x0fX\x08\x00\x00\x00\xc3\xa9\n\\\xf0\x9f\x98\x80q\x10X\x00\x00\x00\x00q\x11tq\x12X\x01\x00\x00\x00cq\x13}q\x14(X\x01\x00\x00\x00dq\x15c__builtin__\nset\nq\x16(]q\x17(K\x01K\x02etq\x18Rq\x19X\x01\x00\x00\x00eq\x1ac__builtin__\nfrozenset\nq\x1b(]q\x1cK\x03atq\x1dRq\x1euX\x01\x00\x00\x00fq\x1f)u.";
    // pickle.dumps(NESTED, 2), NESTED as in the comment above
    const NESTED_P2: &[u8] = b"\x80\x02}q\x00(X\x01\x00\x00\x00aq\x01]q\x02(K\x01J\xfe\xff\xff\xffM,\x01Jp\x11\x01\x00\x8a\x06\x00\x00\x00\x00\x00\xff\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00@\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\xc0G?\xf8\x00\x00\x00\x00\x00\x00G\x7f\xf0\x00\x00\x00\x00\x00\x00N\x88\x89eX\x01\x00\x00\x00bq\x03(X\x01\x00\x00\x00xq\x04c_codecs\nencode\nq\x05X\x04\x00\x00\x00y\x00\xc3\xbfq\x06X\x06\x00\x00\x00latin1q\x07\x86q\x08Rq\x09c__builtin__\nbytearray\nq\nh\x05X\x02\x00\x00\x00baq\x0bh\x07\x86q\x0cRq\x0d\x85q\x0eRq\x0fX\x08\x00\x00\x00\xc3\xa9\n\\\xf0\x9f\x98\x80q\x10X\x00\x00\x00\x00q\x11tq\x12X\x01\x00\x00\x00cq\x13}q\x14(X\x01\x00\x00\x00dq\x15c__builtin__\nset\nq\x16]q\x17(K\x01K\x02e\x85q\x18Rq\x19X\x01\x00\x00\x00eq\x1ac__builtin__\nfrozenset\nq\x1b]q\x1cK\x03a\x85q\x1dRq\x1euX\x01\x00\x00\x00fq\x1f)u.";
    // pickle.dumps(NESTED, 3), NESTED as in the comment above
    const NESTED_P3: &[u8] = b"\x80\x03}q\x00(X\x01\x00\x00\x00aq\x01]q\x02(K\x01J\xfe\xff\xff\xffM,\x01Jp\x11\x01\x00\x8a\x06\x00\x00\x00\x00\x00\xff\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00@\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\xc0G?\xf8\x00\x00\x00\x00\x00\x00G\x7f\xf0\x00\x00\x00\x00\x00\x00N\x88\x89eX\x01\x00\x00\x00bq\x03(X\x01\x00\x00\x00xq\x04C\x03y\x00\xffq\x05cbuiltins\nbytearray\nq\x06C\x02baq\x07\x85q\x08Rq\x09X\x08\x00\x00\x00\xc3\xa9\n\\\xf0\x9f\x98\x80q\nX\x00\x00\x00\x00q\x0btq\x0cX\x01\x00\x00\x00cq\x0d}q\x0e(X\x01\x00\x00\x00dq\x0fcbuiltins\nset\nq\x10]q\x11(K\x01K\x02e\x85q\x12Rq\x13X\x01\x00\x00\x00eq\x14cbuiltins\nfrozenset\nq\x15]q\x16K\x03a\x85q\x17Rq\x18uX\x01\x00\x00\x00fq\x19)u.";
    // pickle.dumps(NESTED, 4), NESTED as in the comment above
    const NESTED_P4: &[u8] = b"\x80\x04\x95\xb2\x00\x00\x00\x00\x00\x00\x00}\x94(\x8c\x01a\x94]\x94(K\x01J\xfe\xff\xff\xffM,\x01Jp\x11\x01\x00\x8a\x06\x00\x00\x00\x00\x00\xff\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00@\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\xc0G?\xf8\x00\x00\x00\x00\x00\x00G\x7f\xf0\x00\x00\x00\x00\x00\x00N\x88\x89e\x8c\x01b\x94(\x8c\x01x\x94C\x03y\x00\xff\x94\x8c\x08builtins\x94\x8c\x09bytearray\x94\x93\x94C\x02ba\x94\x85\x94R\x94\x8c\x08\xc3\xa9\n\\\xf0\x9f\x98\x80\x94\x8c\x00\x94t\x94\x8c\x01c\x94}\x94(\x8c\x01d\x94\x8f\x94(K\x01K\x02\x90\x8c\x01e\x94(K\x03\x91\x94u\x8c\x01f\x94)u.";
    // pickle.dumps(NESTED, 5), NESTED as in the comment above
    const NESTED_P5: &[u8] = b"\x80\x05\x95\x9c\x00\x00\x00\x00\x00\x00\x00}\x94(\x8c\x01a\x94]\x94(K\x01J\xfe\xff\xff\xffM,\x01Jp\x11\x01\x00\x8a\x06\x00\x00\x00\x00\x00\xff\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00@\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\xc0G?\xf8\x00\x00\x00\x00\x00\x00G\x7f\xf0\x00\x00\x00\x00\x00\x00N\x88\x89e\x8c\x01b\x94(\x8c\x01x\x94C\x03y\x00\xff\x94\x96\x02\x00\x00\x00\x00\x00\x00\x00ba\x94\x8c\x08\xc3\xa9\n\\\xf0\x9f\x98\x80\x94\x8c\x00\x94t\x94\x8c\x01c\x94}\x94(\x8c\x01d\x94\x8f\x94(K\x01K\x02\x90\x8c\x01e\x94(K\x03\x91\x94u\x8c\x01f\x94)u.";
    // pickle.dumps(collections.OrderedDict([('a', 1), ('b', [2])]), 0)
    const ODICT_P0: &[u8] = b"ccollections\nOrderedDict\np0\n(tRp1\nVa\np2\nI1\nsVb\np3\n(lp4\nI2\nas.";
    // pickle.dumps(collections.OrderedDict([('a', 1), ('b', [2])]), 2)
    const ODICT_P2: &[u8] = b"\x80\x02ccollections\nOrderedDict\nq\x00)Rq\x01(X\x01\x00\x00\x00aq\x02K\x01X\x01\x00\x00\x00bq\x03]q\x04K\x02au.";
    // pickle.dumps([b'\x00\xffabc', 'é'.encode(), b''], 2)
    const BYTES_P2: &[u8] = b"\x80\x02]q\x00(c_codecs\nencode\nq\x01X\x06\x00\x00\x00\x00\xc3\xbfabcq\x02X\x06\x00\x00\x00latin1q\x03\x86q\x04Rq\x05h\x01X\x04\x00\x00\x00\xc3\x83\xc2\xa9q\x06h\x03\x86q\x07Rq\x08c__builtin__\nbytes\nq\x09)Rq\ne.";
    // a = [1]; pickle.dumps([a, a, (a,)], 2)
    const SHARED_P2: &[u8] = b"\x80\x02]q\x00(]q\x01K\x01ah\x01h\x01\x85q\x02e.";
    // pickle.dumps(fakemod.Point(1, [2, 3]), 0) (Point: a dataclass with x: int, y: list)
    const POINT_P0: &[u8] = b"ccopy_reg\n_reconstructor\np0\n(cfakemod\nPoint\np1\nc__builtin__\nobject\np2\nNtp3\nRp4\n(dp5\nVx\np6\nI1\nsVy\np7\n(lp8\nI2\naI3\nasb.";
    // pickle.dumps(fakemod.Point(1, [2, 3]), 4)
    const POINT_P4: &[u8] = b"\x80\x04\x95/\x00\x00\x00\x00\x00\x00\x00\x8c\x07fakemod\x94\x8c\x05Point\x94\x93\x94)\x81\x94}\x94(\x8c\x01x\x94K\x01\x8c\x01y\x94]\x94(K\x02K\x03eub.";
    // pickle.dumps(fakemod.Ex(5, k=6), 4) (Ex.__getnewargs_ex__ returns ((a,), {'k': k}))
    const EX_P4: &[u8] = b"\x80\x04\x950\x00\x00\x00\x00\x00\x00\x00\x8c\x07fakemod\x94\x8c\x02Ex\x94\x93\x94K\x05\x85\x94}\x94\x8c\x01k\x94K\x06s\x92\x94}\x94(\x8c\x01a\x94K\x05h\x05K\x06ub.";
    // s = fakemod.Slotted(); s.a = 9; pickle.dumps(s, 2) (__slots__ = ('a',))
    const SLOTTED_P2: &[u8] =
        b"\x80\x02cfakemod\nSlotted\nq\x00)\x81q\x01N}q\x02X\x01\x00\x00\x00aq\x03K\x09s\x86q\x04b.";
    // pickle.dumps(fractions.Fraction(1, 3), 2)
    const FRACTION_P2: &[u8] = b"\x80\x02cfractions\nFraction\nq\x00K\x01K\x03\x86q\x01Rq\x02.";
    // pickle.dumps(datetime.date(2020, 1, 2), 0)
    const DATE_P0: &[u8] =
        b"cdatetime\ndate\np0\n(c_codecs\nencode\np1\n(V\x07\xe4\x01\x02\np2\nVlatin1\np3\ntp4\nRp5\ntp6\nRp7\n.";
    // pickle.dumps(datetime.date(2020, 1, 2), 3)
    const DATE_P3: &[u8] = b"\x80\x03cdatetime\ndate\nq\x00C\x04\x07\xe4\x01\x02q\x01\x85q\x02Rq\x03.";
    // Pickler with persistent_id(b'T') = 'pid0': dump([b'T', 1]) with protocol 0
    const PERSID_P0: &[u8] = b"(lp0\nPpid0\naI1\na.";
    // Pickler with persistent_id(b'T') = ('storage', 'k0', 3): dump([b'T', 1]) with protocol 2
    const PERSID_P2: &[u8] =
        b"\x80\x02]q\x00(X\x07\x00\x00\x00storageq\x01X\x02\x00\x00\x00k0q\x02K\x03\x87q\x03QK\x01e.";
    // pickle.dumps([2**2040, -(2**2040)], 2)
    const LONG4_P2: &[u8] = b"\x80\x02]q\x00(\x8b\x00\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x01\x8b\x00\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\xffe.";
    // l = []; l.append(l); pickle.dumps(l, 2)
    const RECURSIVE_P2: &[u8] = b"\x80\x02]q\x00h\x00a.";
    // l = []; t = (l,); l.append(t); pickle.dumps(t, 2) (uses POP_MARK)
    const RECURSIVE_TUPLE_P2: &[u8] = b"\x80\x02]q\x00h\x00\x85q\x01a0h\x01.";
    // copyreg.add_extension('fakemod', 'Point', 42); pickle.dumps(fakemod.Point, 2)
    const EXT1_P2: &[u8] = b"\x80\x02\x82*.";
    // copyreg.add_extension('fakemod', 'Ex', 300); pickle.dumps(fakemod.Ex, 2)
    const EXT2_P2: &[u8] = b"\x80\x02\x83,\x01.";
    // copyreg.add_extension('fakemod', 'Slotted', 70000); pickle.dumps(fakemod.Slotted, 2)
    const EXT4_P2: &[u8] = b"\x80\x02\x84p\x11\x01\x00.";
    // pickle.dumps(pickle.PickleBuffer(bytearray(b'abc')), 5, buffer_callback=lambda b: False)
    const NEXT_BUFFER_P5: &[u8] = b"\x80\x05\x97.";
    // pickle.dumps(pickle.PickleBuffer(b'abc'), 5, buffer_callback=lambda b: False)
    const READONLY_BUFFER_P5: &[u8] = b"\x80\x05\x97\x98.";
    // pickle.dumps({'size': torch.Size([2, 3]), 'dtype': torch.float32}, 2) (torch 2.x)
    const TORCH_SIZE_P2: &[u8] = b"\x80\x02}q\x00(X\x04\x00\x00\x00sizeq\x01ctorch\nSize\nq\x02K\x02K\x03\x86q\x03\x85q\x04Rq\x05X\x05\x00\x00\x00dtypeq\x06ctorch\nfloat32\nq\x07u.";

    // Hand-made pickles (each checked with `pickle.loads` in CPython, result in the comment).
    // ([1], [1]): the list is memoized, put in a tuple twice, then appended to.
    const MEMO_LATE_APPEND: &[u8] = b"\x80\x04]\x94h\x00h\x00\x86h\x00K\x01a0.";
    // {b'key': b'va\\l\x00\nA\\q', b'\xff': 1} with encoding='bytes' (Python 2 `str`s, protocol 0).
    const PY2_STRINGS: &[u8] = b"(dp0\nS'key'\np1\nS'va\\\\l\\x00\\n\\101\\q'\np2\nsS'\\xff'\np3\nI1\ns.";
    // (b'abc', b'\xff\xfe'): SHORT_BINSTRING and BINSTRING.
    const PY2_BIN: &[u8] = b"\x80\x02U\x03abcT\x02\x00\x00\x00\xff\xfe\x86.";
    // (Point(x=1, y=None), Point(x=1, y=[])): INST then BUILD, and OBJ.
    const INST_OBJ: &[u8] = b"((ifakemod\nPoint\n(dVx\nI1\nsb(cfakemod\nPoint\nI1\n(lot.";
    // ([5], [5]): POP, POP_MARK, DUP (the 1 left on the stack is ignored).
    const STACK_OPS: &[u8] = b"\x80\x02K\x01K\x020(K\x03K\x041]2K\x05a\x86.";
    // ([], []): LONG_BINPUT / LONG_BINGET.
    const LONG_MEMO: &[u8] = b"\x80\x02]r\x00\x00\x01\x00j\x00\x00\x01\x00\x86.";
    // ('hi', b'z'): BINUNICODE8 and BINBYTES8.
    const EIGHT_BYTE_LENGTHS: &[u8] =
        b"\x80\x04\x8d\x02\x00\x00\x00\x00\x00\x00\x00hi\x8e\x01\x00\x00\x00\x00\x00\x00\x00z\x86.";
    // {1: 'c'}: keys 1, 1.0 and True are one key in Python.
    const DUP_KEYS: &[u8] =
        b"\x80\x02}(K\x01X\x01\x00\x00\x00aG?\xf0\x00\x00\x00\x00\x00\x00X\x01\x00\x00\x00b\x88X\x01\x00\x00\x00cu.";
    // A Point (NEWOBJ) built twice: {'x': 1, 'y': 2} then {'x': 3} -> __dict__ {'x': 3, 'y': 2}.
    const TWO_BUILDS: &[u8] =
        b"\x80\x02cfakemod\nPoint\n)\x81}(X\x01\x00\x00\x00xK\x01X\x01\x00\x00\x00yK\x02ub}X\x01\x00\x00\x00xK\x03sb.";

    const DCP_METADATA: &[u8] = include_bytes!("testdata/dcp_single.metadata");
    /// `common/data.pkl` of the Megatron fixture's `common.pt` (a torch.save zip).
    const MEGATRON_COMMON: &[u8] = include_bytes!("testdata/megatron_common_data.pkl");
    /// `data.pkl` of `torch.save({'w': torch.arange(6, dtype=torch.float32).reshape(2, 3), 'step': 5})`.
    const TORCH_SAVE: &[u8] = include_bytes!("testdata/torch_save_data.pkl");

    /// Every valid vector above, for the truncation and mutation tests.
    const VALID: &[&[u8]] = &[
        NESTED_P0,
        NESTED_P1,
        NESTED_P2,
        NESTED_P3,
        NESTED_P4,
        NESTED_P5,
        ODICT_P0,
        ODICT_P2,
        BYTES_P2,
        SHARED_P2,
        POINT_P0,
        POINT_P4,
        EX_P4,
        SLOTTED_P2,
        FRACTION_P2,
        DATE_P0,
        DATE_P3,
        PERSID_P0,
        PERSID_P2,
        LONG4_P2,
        TORCH_SIZE_P2,
        MEMO_LATE_APPEND,
        PY2_STRINGS,
        PY2_BIN,
        INST_OBJ,
        STACK_OPS,
        LONG_MEMO,
        EIGHT_BYTE_LENGTHS,
        DUP_KEYS,
        TWO_BUILDS,
        DCP_METADATA,
        MEGATRON_COMMON,
        TORCH_SAVE,
    ];

    fn load(data: &[u8]) -> PickleValue {
        unpickle(data, "test", &UnpickleLimits::default()).unwrap()
    }

    fn load_with(data: &[u8], limits: UnpickleLimits) -> Result<PickleValue> {
        unpickle(data, "test", &limits)
    }

    /// The reason of the error, checked to be a `Corrupt` naming the origin and an offset.
    fn fail(data: &[u8]) -> String {
        fail_with(data, UnpickleLimits::default())
    }

    fn fail_with(data: &[u8], limits: UnpickleLimits) -> String {
        match load_with(data, limits) {
            Err(Error::Corrupt { path, reason }) => {
                assert_eq!(path, std::path::Path::new("test"));
                assert!(reason.starts_with("pickle: at byte "), "{reason}");
                reason
            }
            other => panic!("expected a Corrupt error, got {other:?}"),
        }
    }

    fn s(x: &str) -> PickleValue {
        PickleValue::Str(x.into())
    }
    fn i(x: i64) -> PickleValue {
        PickleValue::Int(x)
    }
    fn b(x: &[u8]) -> PickleValue {
        PickleValue::Bytes(x.to_vec())
    }
    fn list(v: Vec<PickleValue>) -> PickleValue {
        PickleValue::List(v)
    }
    fn tuple(v: Vec<PickleValue>) -> PickleValue {
        PickleValue::Tuple(v)
    }
    fn dict(v: Vec<(PickleValue, PickleValue)>) -> PickleValue {
        PickleValue::Dict(v)
    }
    fn global(module: &str, name: &str) -> PickleValue {
        PickleValue::Global { module: module.into(), name: name.into() }
    }
    fn object(module: &str, name: &str, f: impl FnOnce(&mut PickleObject)) -> PickleValue {
        let mut o = PickleObject { module: module.into(), name: name.into(), ..Default::default() };
        f(&mut o);
        PickleValue::Object(Box::new(o))
    }
    fn get<'v>(v: &'v PickleValue, key: &str) -> &'v PickleValue {
        match v {
            PickleValue::Dict(pairs) => {
                &pairs.iter().find(|(k, _)| *k == s(key)).unwrap_or_else(|| panic!("no key {key}")).1
            }
            other => panic!("not a dict: {other:?}"),
        }
    }
    fn state(v: &PickleValue) -> &PickleValue {
        match v {
            PickleValue::Object(o) => o.state.as_ref().expect("no state"),
            other => panic!("not an object: {other:?}"),
        }
    }

    fn nested_expected() -> PickleValue {
        let two70 = PickleValue::BigInt(vec![0, 0, 0, 0, 0, 0, 0, 0, 0x40]);
        let minus_two70 = PickleValue::BigInt(vec![0, 0, 0, 0, 0, 0, 0, 0, 0xc0]);
        dict(vec![
            (
                s("a"),
                list(vec![
                    i(1),
                    i(-2),
                    i(300),
                    i(70000),
                    i(-(1 << 40)),
                    two70,
                    minus_two70,
                    PickleValue::Float(1.5),
                    PickleValue::Float(f64::INFINITY),
                    PickleValue::None,
                    PickleValue::Bool(true),
                    PickleValue::Bool(false),
                ]),
            ),
            (s("b"), tuple(vec![s("x"), b(b"y\x00\xff"), b(b"ba"), s("é\n\\😀"), s("")])),
            (s("c"), dict(vec![(s("d"), PickleValue::Set(vec![i(1), i(2)])), (s("e"), PickleValue::Set(vec![i(3)]))])),
            (s("f"), tuple(vec![])),
        ])
    }

    #[test]
    fn nested_plain_values_in_every_protocol() {
        for (proto, data) in [NESTED_P0, NESTED_P1, NESTED_P2, NESTED_P3, NESTED_P4, NESTED_P5].iter().enumerate() {
            assert_eq!(load(data), nested_expected(), "protocol {proto}");
        }
    }

    #[test]
    fn python2_strings_and_text_opcodes() {
        assert_eq!(load(PY2_STRINGS), dict(vec![(s("key"), s("va\\l\x00\nA\\q")), (b(b"\xff"), i(1))]));
        assert_eq!(load(PY2_BIN), tuple(vec![s("abc"), b(b"\xff\xfe")]));
        assert_eq!(load(EIGHT_BYTE_LENGTHS), tuple(vec![s("hi"), b(b"z")]));
        // Text integers: python 2 wrote INT for any int that fits in a C long, LONG beyond.
        assert_eq!(load(b"I-9223372036854775808\n."), i(i64::MIN));
        assert_eq!(load(b"I9223372036854775808\n."), PickleValue::BigInt(vec![0, 0, 0, 0, 0, 0, 0, 0x80, 0]));
        assert_eq!(load(b"L12L\n."), i(12));
        assert_eq!(load(b"I0x1f\n."), i(31));
        assert_eq!(load(b"F-2.5e3\n."), PickleValue::Float(-2500.0));
        assert!(matches!(load(b"Fnan\n."), PickleValue::Float(f) if f.is_nan()));
        // raw-unicode-escape: an escaped surrogate pair is one character, a lone one U+FFFD,
        // and an even number of backslashes is no escape.
        assert_eq!(load(b"V\\ud83d\\ude00|\\ud800|\\\\u0041\n."), s("😀|\u{fffd}|\\\\u0041"));
        // BINUNICODE with a surrogate (Python writes them with surrogatepass).
        assert_eq!(load(b"X\x03\x00\x00\x00\xed\xa0\x80."), s("\u{fffd}\u{fffd}\u{fffd}"));
        let digits = "9".repeat(4301);
        assert!(fail(format!("L{digits}L\n.").as_bytes()).contains("4301 digits"));
        assert!(fail(b"S'abc\n.").contains("must be quoted"));
        assert!(fail(b"S'a\\x4'\n.").contains("\\x escape"));
        assert!(fail(b"V\\u12\n.").contains("truncated \\uXXXX"));
        assert!(fail(b"V\\U00110000\n.").contains("out of range"));
        assert!(fail(b"Iabc\n.").contains("invalid integer"));
        assert!(fail(b"Fx\n.").contains("invalid FLOAT"));
    }

    #[test]
    fn ordered_dict_is_a_dict() {
        let expected = dict(vec![(s("a"), i(1)), (s("b"), list(vec![i(2)]))]);
        assert_eq!(load(ODICT_P0), expected);
        assert_eq!(load(ODICT_P2), expected);
        // Python 2's OrderedDict.__reduce__: (OrderedDict, ([[k, v], ...],)).
        let py2 = b"\x80\x02ccollections\nOrderedDict\n](X\x01\x00\x00\x00aK\x01la\x85R.";
        assert_eq!(load(py2), dict(vec![(s("a"), i(1))]));
        // BUILD on a dict (an OrderedDict subclass's __dict__) merges; None is ignored.
        assert_eq!(load(b"\x80\x02}X\x01\x00\x00\x00xK\x01sNb}X\x01\x00\x00\x00yK\x02sb."), {
            dict(vec![(s("x"), i(1)), (s("y"), i(2))])
        });
        assert!(fail(b"\x80\x02}K\x01b.").contains("BUILD of a dict"));
    }

    #[test]
    fn torch_size_is_a_tuple_and_dtypes_stay_globals() {
        assert_eq!(
            load(TORCH_SIZE_P2),
            dict(vec![(s("size"), tuple(vec![i(2), i(3)])), (s("dtype"), global("torch", "float32"))])
        );
    }

    #[test]
    fn protocol_2_bytes_and_bytearray_calls() {
        assert_eq!(load(BYTES_P2), list(vec![b(b"\x00\xffabc"), b("é".as_bytes()), b(b"")]));
        // bytes given as a list of ints, _codecs.encode with utf-8.
        assert_eq!(load(b"c__builtin__\nbytes\n((I1\nI255\nltR."), b(b"\x01\xff"));
        assert_eq!(load(b"c_codecs\nencode\n(V\xe9\nVutf-8\ntR."), b("é".as_bytes()));
        // A code point above 255 cannot be latin-1: the call stays an object.
        assert_eq!(load(b"c_codecs\nencode\n(V\\u0100\nVlatin1\ntR.").class(), Some(("_codecs", "encode")));
    }

    #[test]
    fn builtin_container_calls() {
        assert_eq!(load(b"c__builtin__\nset\n((I1\nI2\nI1\nltR."), PickleValue::Set(vec![i(1), i(2)]));
        assert_eq!(load(b"cbuiltins\nlist\n((I1\nttR."), list(vec![i(1)]));
        assert_eq!(load(b"cbuiltins\ntuple\n((I1\nltR."), tuple(vec![i(1)]));
        assert_eq!(load(b"cbuiltins\ndict\n(((Va\nI1\ntltR."), dict(vec![(s("a"), i(1))]));
        assert_eq!(load(b"cbuiltins\ndict\n(tR."), dict(vec![]));
    }

    #[test]
    fn memo_shares_references() {
        let a = list(vec![i(1)]);
        assert_eq!(load(SHARED_P2), list(vec![a.clone(), a.clone(), tuple(vec![a.clone()])]));
        // The list is appended to after it was fetched from the memo: both references see it.
        assert_eq!(load(MEMO_LATE_APPEND), tuple(vec![a.clone(), a]));
        assert_eq!(load(LONG_MEMO), tuple(vec![list(vec![]), list(vec![])]));
        assert_eq!(load(STACK_OPS), tuple(vec![list(vec![i(5)]), list(vec![i(5)])]));
        // Text PUT/GET (protocol 0) are in NESTED_P0; MEMOIZE in NESTED_P4.
        assert!(fail(b"\x80\x02h\x07.").contains("bad memo index 7"));
        assert!(fail(b"g3\n.").contains("bad memo index 3"));
        assert!(fail(b"p-1\n.").contains("bad PUT index"));
        assert!(fail(b"\x80\x02q\x00.").contains("stack underflow"));
    }

    #[test]
    fn dict_keys_are_deduplicated_as_in_python() {
        assert_eq!(load(DUP_KEYS), dict(vec![(i(1), s("c"))]));
        // Equal tuple keys are one key; distinct objects are distinct keys; sets dedupe.
        let tuples = b"\x80\x02}(K\x01K\x02\x86K\x01K\x01K\x02\x86K\x02u.";
        assert_eq!(load(tuples), dict(vec![(tuple(vec![i(1), i(2)]), i(2))]));
        let objects = b"\x80\x02}(cm\nC\n)\x81K\x01cm\nC\n)\x81K\x02u.";
        assert!(matches!(load(objects), PickleValue::Dict(p) if p.len() == 2));
        assert_eq!(load(b"\x80\x04\x8f(K\x01K\x01K\x02\x90."), PickleValue::Set(vec![i(1), i(2)]));
        assert_eq!(load(b"\x80\x04(K\x02K\x02\x91."), PickleValue::Set(vec![i(2)]));
    }

    #[test]
    fn class_instances_newobj_reduce_and_build() {
        let state = dict(vec![(s("x"), i(1)), (s("y"), list(vec![i(2), i(3)]))]);
        assert_eq!(load(POINT_P4), object("fakemod", "Point", |o| o.state = Some(state.clone())), "NEWOBJ + BUILD");
        assert_eq!(
            load(POINT_P0),
            object("fakemod", "Point", |o| {
                o.args = vec![global("__builtin__", "object"), PickleValue::None];
                o.state = Some(state.clone());
            }),
            "copy_reg._reconstructor + BUILD"
        );
        assert_eq!(
            load(EX_P4),
            object("fakemod", "Ex", |o| {
                o.args = vec![i(5)];
                o.kwargs = vec![(s("k"), i(6))];
                o.state = Some(dict(vec![(s("a"), i(5)), (s("k"), i(6))]));
            }),
            "NEWOBJ_EX"
        );
        assert_eq!(
            load(SLOTTED_P2),
            object("fakemod", "Slotted", |o| o.state =
                Some(tuple(vec![PickleValue::None, dict(vec![(s("a"), i(9))])]))),
            "slots state"
        );
        assert_eq!(
            load(INST_OBJ),
            tuple(vec![
                object("fakemod", "Point", |o| o.state = Some(dict(vec![(s("x"), i(1))]))),
                object("fakemod", "Point", |o| o.args = vec![i(1), list(vec![])]),
            ]),
            "INST and OBJ"
        );
        // Two BUILDs with dict states merge (dict.update); a non-dict later state replaces.
        assert_eq!(
            load(TWO_BUILDS),
            object("fakemod", "Point", |o| o.state = Some(dict(vec![(s("x"), i(3)), (s("y"), i(2))])))
        );
        let replaced = b"\x80\x02cfakemod\nPoint\n)\x81}X\x01\x00\x00\x00xK\x01sbK\x07b.";
        assert_eq!(load(replaced), object("fakemod", "Point", |o| o.state = Some(i(7))));
        // APPEND and SETITEM on objects (list and dict subclasses).
        let items = b"\x80\x02cm\nL\n)\x81K\x01aK\x02K\x03s.";
        assert_eq!(
            load(items),
            object("m", "L", |o| {
                o.list_items = vec![i(1)];
                o.dict_items = vec![(i(2), i(3))];
            })
        );
    }

    #[test]
    fn reduce_of_unknown_globals_stays_an_object() {
        assert_eq!(load(FRACTION_P2), object("fractions", "Fraction", |o| o.args = vec![i(1), i(3)]));
        let date = object("datetime", "date", |o| o.args = vec![b(b"\x07\xe4\x01\x02")]);
        assert_eq!(load(DATE_P0), date);
        assert_eq!(load(DATE_P3), date);
        assert_eq!(load(b"cos\nsystem\n."), global("os", "system"));
        assert!(fail(b"\x80\x02cm\nf\n)R)R.").contains("REDUCE of a value that is not a global"));
        assert!(fail(b"\x80\x02cm\nf\nK\x01R.").contains("REDUCE arguments are not a tuple"));
        assert!(fail(b"\x80\x02K\x01)\x81.").contains("NEWOBJ of a value that is not a global"));
        assert!(fail(b"\x80\x04K\x01K\x02\x93.").contains("STACK_GLOBAL"));
        assert!(fail(b"\x80\x02]]b.").contains("BUILD on a value"));
        assert!(fail(b"\x80\x02)K\x01a.").contains("APPEND to a value"));
        assert!(fail(b"\x80\x02]K\x01K\x01s.").contains("SETITEM on a value"));
        assert!(fail(b"\x80\x04](K\x01\x90.").contains("ADDITEMS to a value"));
        assert!(fail(b"\x80\x02(o.").contains("OBJ without a class"));
    }

    #[test]
    fn persistent_ids() {
        assert_eq!(load(PERSID_P0), list(vec![PickleValue::PersistentId(Box::new(s("pid0"))), i(1)]));
        let pid = tuple(vec![s("storage"), s("k0"), i(3)]);
        assert_eq!(load(PERSID_P2), list(vec![PickleValue::PersistentId(Box::new(pid)), i(1)]));
        assert!(fail(b"P\xff\n.").contains("ASCII"));
    }

    #[test]
    fn big_integers() {
        let v = load(LONG4_P2);
        let PickleValue::List(items) = &v else { panic!("{v:?}") };
        assert_eq!(items.len(), 2);
        let Value::Str(text) = items[0].to_value_lossy() else { panic!() };
        assert_eq!(text.len(), 615);
        assert!(text.starts_with("12623830496605862226") && text.ends_with("81077553168201547776"), "{text}");
        assert_eq!(items[1].to_value_lossy(), Value::Str(format!("-{text}")));
        assert_eq!(items[0].to_plain(), None);
        // LONG1 with redundant sign bytes is still a small int; i64 bounds are exact.
        assert_eq!(load(b"\x80\x02\x8a\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff."), i(-1));
        assert_eq!(load(b"\x80\x02\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x80."), i(i64::MIN));
        assert_eq!(load(b"\x80\x02\x8a\x00."), i(0));
        let two63 = load(b"\x80\x02\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x80\x00.");
        assert_eq!(two63.to_value_lossy(), Value::Str("9223372036854775808".into()));
        assert_eq!(bigint_text(&[0x00, 0x80]), "-32768");
        // Past 4300 digits the text is hexadecimal.
        let mut huge = vec![0u8; 2000];
        huge.push(1);
        assert!(bigint_text(&huge).starts_with("0x1000"));
    }

    #[test]
    fn refused_opcodes() {
        for (data, what) in [
            (EXT1_P2, "extension registry"),
            (EXT2_P2, "extension registry"),
            (EXT4_P2, "extension registry"),
            (NEXT_BUFFER_P5, "out-of-band buffers"),
            (READONLY_BUFFER_P5, "out-of-band buffers"),
            (b"\x80\x02\xff.", "unknown opcode 0xff"),
            (b"\x80\x05\x99.", "unknown opcode 0x99"),
            (b"\x80\x02Z.", "unknown opcode 0x5a"),
        ] {
            let reason = fail(data);
            assert!(reason.contains(what), "{reason}");
            assert!(reason.starts_with("pickle: at byte 2: "), "{reason}");
        }
    }

    #[test]
    fn structural_errors() {
        assert_eq!(fail(b"\x80\x06N."), "pickle: at byte 0: unsupported pickle protocol 6");
        assert!(fail(b"").contains("no STOP"));
        assert!(fail(b"\x80\x02N").contains("no STOP"));
        assert!(fail(b"\x80\x02.").contains("stack underflow"));
        assert!(fail(b"\x80\x02(.").contains("stack underflow"));
        assert!(fail(b"\x80\x02Nt.").contains("missing MARK"));
        assert!(fail(b"\x80\x02(a.").contains("stack underflow"));
        assert!(fail(b"\x80\x02N(\x86.").contains("stack underflow"));
        assert!(fail(b"\x80\x02(K\x01d.").contains("odd number"));
        assert!(fail(b"\x80\x02}(K\x01u.").contains("odd number"));
        assert!(fail(b"\x80\x021.").contains("missing MARK"));
        assert_eq!(fail(b"\x80\x02NN\x860\x86."), "pickle: at byte 6: stack underflow");
        // Trailing bytes after STOP are ignored, as pickle.loads does with a file.
        assert_eq!(load(b"\x80\x02K\x05.garbage\xff"), i(5));
        // Stack items left under the result are ignored too.
        assert_eq!(load(b"\x80\x02K\x01K\x02."), i(2));
    }

    #[test]
    fn recursive_structures_are_errors() {
        assert!(fail(RECURSIVE_P2).contains("recursive structure"));
        assert!(fail(RECURSIVE_TUPLE_P2).contains("recursive structure"));
        // An object whose state holds itself.
        assert!(fail(b"\x80\x02cm\nC\n)\x81\x94}X\x01\x00\x00\x00sh\x00sb.").contains("recursive structure"));
    }

    #[test]
    fn truncation_at_every_offset_is_an_error() {
        for data in VALID {
            assert!(load_with(data, UnpickleLimits::default()).is_ok());
            for n in 0..data.len() {
                let reason = fail(&data[..n]);
                assert!(reason.contains("truncated") || reason.contains("no STOP"), "prefix {n}: {reason}");
            }
        }
    }

    #[test]
    fn mutated_inputs_never_panic() {
        // A cheap deterministic cousin of the fuzz target: every byte of every vector replaced
        // by a few values; each result must be a value or an error (tiny limits keep it fast).
        let limits =
            UnpickleLimits { max_depth: 32, max_values: 10_000, max_bytes: 1 << 16, ..UnpickleLimits::default() };
        for data in VALID {
            let mut m = data.to_vec();
            // Every byte of the small vectors, about 150 positions of the larger files.
            for pos in (0..m.len()).step_by(m.len() / 150 + 1) {
                let orig = m[pos];
                for x in [0x00, 0x01, 0x7f, 0x80, 0xff, orig ^ 0x20, b'(', b'h', b'.'] {
                    m[pos] = x;
                    if let Ok(v) = unpickle(&m, "mutated", &limits) {
                        let _ = (v.to_plain(), v.to_value_lossy());
                    }
                }
                m[pos] = orig;
            }
        }
    }

    #[test]
    fn untrusted_lengths_are_checked_before_allocating() {
        let mut cases: Vec<Vec<u8>> = Vec::new();
        for op in [0x8d, 0x8e, 0x96] {
            // BINUNICODE8, BINBYTES8, BYTEARRAY8 with a length of 2^60, 2^64-1.
            for n in [1u64 << 60, u64::MAX] {
                let mut v = vec![0x80, 4, op];
                v.extend_from_slice(&n.to_le_bytes());
                v.extend_from_slice(b"abc.");
                cases.push(v);
            }
        }
        for op in [b'X', b'B', b'T', 0x8b] {
            // 4-byte lengths: 0xffffffff (negative for BINSTRING and LONG4).
            let mut v = vec![0x80, 4, op];
            v.extend_from_slice(&u32::MAX.to_le_bytes());
            v.extend_from_slice(b"abc.");
            cases.push(v);
        }
        cases.push(b"\x80\x02\x8a\xff\x00.".to_vec());
        cases.push(b"\x80\x02C\xffab.".to_vec());
        for case in cases {
            let reason = fail(&case);
            assert!(reason.contains("truncated") || reason.contains("negative"), "{reason}");
        }
    }

    /// `n` lists nested in one another, as `[[[...]]]` (EMPTY_LIST n times, APPEND n-1 times).
    fn nested_lists(n: usize) -> Vec<u8> {
        let mut v = vec![0x80, 2];
        v.extend(std::iter::repeat_n(b']', n));
        v.extend(std::iter::repeat_n(b'a', n - 1));
        v.push(b'.');
        v
    }

    #[test]
    fn depth_limit() {
        let limits = UnpickleLimits::default();
        assert_eq!(limits.max_depth, 512);
        // Run on a small stack: neither decoding nor dropping may recurse deeply.
        std::thread::Builder::new()
            .stack_size(256 << 10)
            .spawn(move || {
                for n in [511, 512] {
                    let v = load_with(&nested_lists(n), limits).unwrap();
                    let mut depth = 0;
                    let mut cur = &v;
                    while let PickleValue::List(items) = cur {
                        depth += 1;
                        match items.first() {
                            Some(next) => cur = next,
                            None => break,
                        }
                    }
                    assert_eq!(depth, n);
                }
                let reason = fail_with(&nested_lists(513), limits);
                assert!(reason.contains("nesting deeper than 512"), "{reason}");
            })
            .unwrap()
            .join()
            .unwrap();
        // Depth counts objects and their state too; scalars do not count.
        // Point: object > state dict > list y.
        assert!(load_with(POINT_P4, UnpickleLimits { max_depth: 3, ..limits }).is_ok());
        assert!(fail_with(POINT_P4, UnpickleLimits { max_depth: 2, ..limits }).contains("nesting deeper than 2"));
        assert!(load_with(b"K\x01.", UnpickleLimits { max_depth: 0, ..limits }).is_ok());
        // Depth reached through memo references: list k+1 = [memo[k]].
        let mut v = vec![0x80, 2, b']', b'q', 0];
        for k in 0..600u32 {
            v.extend_from_slice(b"(j");
            v.extend_from_slice(&k.to_le_bytes());
            v.extend_from_slice(b"lr");
            v.extend_from_slice(&(k + 1).to_le_bytes());
        }
        v.push(b'.');
        assert!(fail(&v).contains("nesting deeper than 512"));
    }

    #[test]
    fn billion_laughs_hits_max_values() {
        // memo[0] = None; memo[k+1] = (memo[k], memo[k]): 2^61 values once copied out.
        let mut v = vec![0x80, 4, b'N', 0x94];
        for k in 0..60u8 {
            v.extend_from_slice(&[b'h', k, b'h', k, 0x86, 0x94]);
        }
        v.push(b'.');
        let start = std::time::Instant::now();
        let reason = fail(&v);
        // The budget relative to the input trips long before the absolute max_values.
        assert!(reason.contains("budget") && reason.contains("365-byte pickle"), "{reason}");
        let reason = fail_with(&v, UnpickleLimits { output_per_input_byte: usize::MAX, ..UnpickleLimits::default() });
        assert!(reason.contains("more than 50000000 values"), "{reason}");
        assert!(start.elapsed() < std::time::Duration::from_secs(5));
        // Just under and just over a small limit: 2^(k+1) - 1 values at level k.
        let mut v = vec![0x80, 4, b'N', 0x94];
        for k in 0..9u8 {
            v.extend_from_slice(&[b'h', k, b'h', k, 0x86, 0x94]);
        }
        v.push(b'.');
        let limits = |max_values| UnpickleLimits { max_values, ..UnpickleLimits::default() };
        assert!(load_with(&v, limits(1023)).is_ok());
        assert!(fail_with(&v, limits(1022)).contains("more than 1022 values"));
        // Values pushed while decoding count too.
        let many = [&b"\x80\x02("[..], &b"K\x01".repeat(100), b"l."].concat();
        assert!(fail_with(&many, limits(50)).contains("more than 50 values"));
    }

    #[test]
    fn bytes_limit() {
        let limits = |max_bytes| UnpickleLimits { max_bytes, ..UnpickleLimits::default() };
        let payload = [&b"\x80\x03B\x00\x01\x00\x00"[..], &[b'x'; 256], b"."].concat();
        assert!(load_with(&payload, limits(256)).is_ok());
        assert!(fail_with(&payload, limits(255)).contains("more than 255 bytes"));
        // A shared string counts once per copy in the result.
        let mut shared = [&b"\x80\x04C\x64"[..], &[b'y'; 100], b"\x94"].concat();
        for k in 0..4u8 {
            shared.extend_from_slice(&[b'h', k, b'h', k, 0x86, 0x94]);
        }
        shared.push(b'.');
        assert!(load_with(&shared, limits(1600)).is_ok());
        assert!(fail_with(&shared, limits(1599)).contains("more than 1599 bytes"));
    }

    #[test]
    fn to_plain() {
        let plain = load(ODICT_P2).to_plain().unwrap();
        assert_eq!(
            plain,
            Value::Map(vec![("a".into(), Value::Int(1)), ("b".into(), Value::List(vec![Value::Int(2)]))])
        );
        assert_eq!(
            load(MEGATRON_COMMON).to_plain().unwrap(),
            Value::Map(vec![
                ("iteration".into(), Value::Int(1234)),
                (
                    "args".into(),
                    Value::Map(vec![("lr".into(), Value::Float(0.001)), ("name".into(), Value::Str("fixture".into()))])
                ),
            ])
        );
        assert_eq!(
            load(PY2_BIN).to_plain(),
            Some(Value::List(vec![Value::Str("abc".into()), Value::Bytes(vec![0xff, 0xfe])]))
        );
        assert_eq!(load(b"N.").to_plain(), Some(Value::Null));
        // Not plain: sets, big ints, globals, objects, persistent ids, non-str keys.
        assert_eq!(nested_expected().to_plain(), None);
        assert_eq!(load(TORCH_SIZE_P2).to_plain(), None);
        assert_eq!(load(POINT_P4).to_plain(), None);
        assert_eq!(load(PERSID_P2).to_plain(), None);
        assert_eq!(load(DUP_KEYS).to_plain(), None);
        assert_eq!(load(b"\x80\x04\x8f.").to_plain(), None);
    }

    #[test]
    fn to_value_lossy() {
        let str = |x: &str| Value::Str(x.into());
        let nested = nested_expected().to_value_lossy();
        assert_eq!(nested.get("a").unwrap(), &{
            let Value::List(items) = nested.get("a").unwrap() else { panic!() };
            assert_eq!(items[5], str("1180591620717411303424"));
            assert_eq!(items[6], str("-1180591620717411303424"));
            Value::List(items.clone())
        });
        assert_eq!(
            nested.get("c").unwrap(),
            &Value::Map(vec![
                ("d".into(), Value::List(vec![Value::Int(1), Value::Int(2)])),
                ("e".into(), Value::List(vec![Value::Int(3)])),
            ])
        );
        assert_eq!(
            load(EX_P4).to_value_lossy(),
            Value::Map(vec![
                ("__class__".into(), str("fakemod.Ex")),
                ("args".into(), Value::List(vec![Value::Int(5)])),
                ("kwargs".into(), Value::Map(vec![("k".into(), Value::Int(6))])),
                ("state".into(), Value::Map(vec![("a".into(), Value::Int(5)), ("k".into(), Value::Int(6))])),
            ])
        );
        assert_eq!(
            load(b"\x80\x02cm\nL\n)\x81K\x01a.").to_value_lossy(),
            Value::Map(vec![("__class__".into(), str("m.L")), ("items".into(), Value::List(vec![Value::Int(1)]))])
        );
        assert_eq!(
            load(b"\x80\x02cm\nD\n)\x81K\x02K\x03s.").to_value_lossy(),
            Value::Map(vec![
                ("__class__".into(), str("m.D")),
                ("items".into(), Value::Map(vec![("2".into(), Value::Int(3))]))
            ])
        );
        assert_eq!(
            load(TORCH_SIZE_P2).to_value_lossy(),
            Value::Map(vec![
                ("size".into(), Value::List(vec![Value::Int(2), Value::Int(3)])),
                ("dtype".into(), str("torch.float32")),
            ])
        );
        assert_eq!(
            load(PERSID_P0).to_value_lossy(),
            Value::List(vec![Value::Map(vec![("__persistent_id__".into(), str("pid0"))]), Value::Int(1)])
        );
        // Keys that are not strings are rendered like Python's repr.
        let keys = b"\x80\x02}(K\x02N\x88NNNK\x00X\x01\x00\x00\x00a\x86NC\x02\x00zNG?\xf8\x00\x00\x00\x00\x00\x00Nu.";
        let Value::Map(entries) = load(keys).to_value_lossy() else { panic!() };
        let names: Vec<&str> = entries.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(names, ["2", "True", "None", "(0, 'a')", "b'\\x00z'", "1.5"]);
        // An unhashable key (a tuple holding a list) is kept as given.
        let odd_keys = load(b"\x80\x02}(K\x01K\x02\x86N]\x85Nu.");
        let names: Vec<String> = match odd_keys.to_value_lossy() {
            Value::Map(e) => e.into_iter().map(|(k, _)| k).collect(),
            other => panic!("{other:?}"),
        };
        assert_eq!(names, ["(1, 2)", "([],)"]);
        let tuple_key = tuple((0..500).map(i).collect());
        assert!(key_text(&tuple_key).chars().count() <= KEY_TEXT_MAX + 1);
    }

    #[test]
    fn real_dcp_metadata() {
        let md = load(DCP_METADATA);
        assert_eq!(md.class(), Some(("torch.distributed.checkpoint.metadata", "Metadata")));
        let st = state(&md);
        let PickleValue::Dict(sdm) = get(st, "state_dict_metadata") else { panic!() };
        let keys: Vec<&PickleValue> = sdm.iter().map(|(k, _)| k).collect();
        let expected = [
            "model.w_f32",
            "model.w_bf16",
            "model.w_f16",
            "model.ids_i64",
            "model.mask_bool",
            "model.bytes_u8",
            "model.scalar",
            "model.empty",
            "step",
            "note",
            "lrs",
        ];
        assert_eq!(keys, expected.iter().map(|k| s(k)).collect::<Vec<_>>().iter().collect::<Vec<_>>());
        let w = get(&PickleValue::Dict(sdm.clone()), "model.w_f32").clone();
        assert_eq!(w.class(), Some(("torch.distributed.checkpoint.metadata", "TensorStorageMetadata")));
        assert_eq!(get(state(&w), "size"), &tuple(vec![i(7), i(5)]));
        let props = get(state(&w), "properties");
        let PickleValue::Tuple(p) = state(props) else { panic!("{props:?}") };
        assert_eq!(p[0], global("torch", "float32"));
        let PickleValue::Dict(storage) = get(st, "storage_data") else { panic!() };
        assert_eq!(storage.len(), 11);
        let mut ends = Vec::new();
        for (k, v) in storage {
            assert_eq!(k.class(), Some(("torch.distributed.checkpoint.metadata", "MetadataIndex")));
            assert_eq!(v.class(), Some(("torch.distributed.checkpoint.filesystem", "_StorageInfo")));
            let info = state(v);
            assert_eq!(get(info, "relative_path"), &s("__0_0.distcp"));
            let (PickleValue::Int(offset), PickleValue::Int(length)) = (get(info, "offset"), get(info, "length"))
            else {
                panic!("{info:?}")
            };
            ends.push((*offset, *offset + *length));
        }
        // The items tile the data file.
        ends.sort();
        assert_eq!(ends[0].0, 0);
        assert!(ends.windows(2).all(|w| w[0].1 == w[1].0));
        assert_eq!(ends.last().unwrap().1, 16911);
        // The lossy rendering has the class names and, for keys that are objects, a repr.
        let lossy = md.to_value_lossy();
        assert_eq!(lossy.get("__class__"), Some(&Value::Str("torch.distributed.checkpoint.metadata.Metadata".into())));
        let storage = lossy.get("state").and_then(|s| s.get("storage_data")).unwrap();
        assert!(storage.get("<torch.distributed.checkpoint.metadata.MetadataIndex object>").is_some());
    }

    #[test]
    fn real_torch_save_data_pkl() {
        let v = load(TORCH_SAVE);
        assert_eq!(get(&v, "step"), &i(5));
        let w = get(&v, "w");
        assert_eq!(
            w,
            &object("torch._utils", "_rebuild_tensor_v2", |o| {
                o.args = vec![
                    PickleValue::PersistentId(Box::new(tuple(vec![
                        s("storage"),
                        global("torch", "FloatStorage"),
                        s("0"),
                        s("cpu"),
                        i(6),
                    ]))),
                    i(0),
                    tuple(vec![i(2), i(3)]),
                    tuple(vec![i(3), i(1)]),
                    PickleValue::Bool(false),
                    dict(vec![]),
                ]
            })
        );
    }
}
