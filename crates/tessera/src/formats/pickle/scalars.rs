//! The scalar arguments of opcodes: integers (text, or little-endian two's complement bytes)
//! and strings (Python's escapes and encodings), decoded as CPython's unpickler decodes them.

use super::PickleValue;

/// Two's complement negation in place (little-endian).
pub(super) fn negate_twos(b: &mut [u8]) {
    let mut carry = true;
    for x in b.iter_mut() {
        let (v, c) = (!*x).overflowing_add(u8::from(carry));
        *x = v;
        carry = c;
    }
}

/// An integer from little-endian two's complement bytes: [`PickleValue::Int`] if it fits in
/// 64 bits, otherwise a [`PickleValue::BigInt`] with redundant sign bytes removed.
pub(super) fn int_from_le_twos(mut b: Vec<u8>) -> PickleValue {
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
pub(super) fn parse_int_text(s: &[u8]) -> std::result::Result<PickleValue, String> {
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
pub(super) fn escape_decode(s: &[u8]) -> std::result::Result<Vec<u8>, &'static str> {
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
pub(super) fn raw_unicode_escape(s: &[u8]) -> std::result::Result<String, &'static str> {
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

/// A memo index in text (`PUT`/`GET` of protocol 0).
pub(super) fn parse_index(line: &[u8]) -> Option<u64> {
    std::str::from_utf8(line).ok()?.trim().parse::<u64>().ok()
}
