//! The text parts of [`PickleValue::to_value_lossy`]: dict keys in a short Python-like repr,
//! and big integers in decimal.

use super::scalars::negate_twos;
use super::PickleValue;
use crate::model::Value;

/// A dict's pairs as a map, keys rendered by [`key_text`].
pub(super) fn lossy_map(pairs: &[(PickleValue, PickleValue)]) -> Value {
    Value::Map(pairs.iter().map(|(k, v)| (key_text(k), v.to_value_lossy())).collect())
}

/// Longest key rendering kept by [`key_text`] (then cut with "…").
pub(super) const KEY_TEXT_MAX: usize = 200;

/// A dict key as text: strings as they are, anything else in a short Python-like repr.
pub(super) fn key_text(k: &PickleValue) -> String {
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
        PickleValue::Str(s) => repr_str(s, out),
        PickleValue::Bytes(b) => repr_bytes(b, out),
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

/// Appends Python's repr of a string (`'…'`, with its escapes), cut once `out` is longer than
/// [`KEY_TEXT_MAX`].
fn repr_str(s: &str, out: &mut String) {
    use std::fmt::Write;
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

/// Appends Python's repr of bytes (`b'…'`), cut once `out` is longer than [`KEY_TEXT_MAX`].
fn repr_bytes(b: &[u8], out: &mut String) {
    use std::fmt::Write;
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
pub(super) fn bigint_text(b: &[u8]) -> String {
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
