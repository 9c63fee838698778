//! Compact binary encoding shared by the index and the metadata exchange: LEB128 varints,
//! length-prefixed strings, and a tagged encoding of [`Value`].

use crate::model::dims::Dims;
use crate::model::Value;

/// Appends binary data.
#[derive(Debug, Default)]
pub struct Encoder {
    /// The bytes written so far.
    pub buf: Vec<u8>,
}

impl Encoder {
    pub fn u8(&mut self, x: u8) {
        self.buf.push(x);
    }
    pub fn u32_le(&mut self, x: u32) {
        self.buf.extend_from_slice(&x.to_le_bytes());
    }
    #[inline]
    pub fn var(&mut self, mut x: u64) {
        // One or two bytes for most (counts, dims, tags): stores of a known size.
        if x < 0x80 {
            self.buf.push(x as u8);
            return;
        }
        if x < 0x4000 {
            self.buf.extend_from_slice(&[x as u8 | 0x80, (x >> 7) as u8]);
            return;
        }
        while x >= 0x80 {
            self.buf.push((x as u8) | 0x80);
            x >>= 7;
        }
        self.buf.push(x as u8);
    }
    pub fn ivar(&mut self, x: i64) {
        self.var(((x << 1) ^ (x >> 63)) as u64);
    }
    pub fn bytes(&mut self, b: &[u8]) {
        self.var(b.len() as u64);
        self.buf.extend_from_slice(b);
    }
    pub fn str(&mut self, s: &str) {
        self.bytes(s.as_bytes());
    }
    pub fn dims(&mut self, d: &[u64]) {
        self.var(d.len() as u64);
        for &x in d {
            self.var(x);
        }
    }
    pub fn value(&mut self, v: &Value) {
        match v {
            Value::Null => self.u8(0),
            Value::Bool(false) => self.u8(1),
            Value::Bool(true) => self.u8(2),
            Value::Int(i) => {
                self.u8(3);
                self.ivar(*i);
            }
            Value::Float(f) => {
                self.u8(4);
                self.buf.extend_from_slice(&f.to_le_bytes());
            }
            Value::Str(s) => {
                self.u8(5);
                self.str(s);
            }
            Value::Bytes(b) => {
                self.u8(6);
                self.bytes(b);
            }
            Value::List(items) => {
                self.u8(7);
                self.var(items.len() as u64);
                for it in items {
                    self.value(it);
                }
            }
            Value::Map(entries) => {
                self.u8(8);
                self.var(entries.len() as u64);
                for (k, it) in entries {
                    self.str(k);
                    self.value(it);
                }
            }
        }
    }
}

/// Reads what [`Encoder`] wrote; every read is bounds-checked and fails with a reason.
#[derive(Debug)]
pub struct Decoder<'b> {
    buf: &'b [u8],
    pos: usize,
}

/// Room reserved up front for `n` decoded items, a count read from a file: at most a few
/// thousand, so a count (even one bounded by the bytes left) never sizes an allocation of
/// large items by itself; the vector grows as items are actually decoded.
pub(crate) fn prealloc(n: usize) -> usize {
    n.min(1 << 10)
}

/// Values nest at most this deep: bounds recursion on hostile input.
const MAX_DEPTH: usize = 128;

impl<'b> Decoder<'b> {
    pub fn new(buf: &'b [u8]) -> Self {
        Decoder { buf, pos: 0 }
    }
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    pub fn is_done(&self) -> bool {
        self.pos == self.buf.len()
    }
    pub fn take(&mut self, n: usize) -> Result<&'b [u8], String> {
        if self.buf.len() - self.pos < n {
            return Err(format!("truncated: need {n} bytes at {} of {}", self.pos, self.buf.len()));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    #[inline]
    pub fn u8(&mut self) -> Result<u8, String> {
        match self.buf.get(self.pos) {
            Some(&b) => {
                self.pos += 1;
                Ok(b)
            }
            None => Ok(self.take(1)?[0]),
        }
    }
    pub fn u32_le(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    #[inline]
    pub fn var(&mut self) -> Result<u64, String> {
        // Most varints of a plan or an index (counts, dims, tags, offsets below 16384) are one
        // or two bytes: no loop for them.
        match self.buf.get(self.pos..self.pos + 2) {
            Some(&[b, _]) if b < 0x80 => {
                self.pos += 1;
                Ok(b as u64)
            }
            Some(&[b, c]) if c < 0x80 => {
                self.pos += 2;
                Ok((b & 0x7f) as u64 | (c as u64) << 7)
            }
            _ => self.var_long(),
        }
    }
    fn var_long(&mut self) -> Result<u64, String> {
        let mut x = 0u64;
        let mut shift = 0u32;
        loop {
            let b = self.u8()?;
            if shift == 63 && b > 1 {
                return Err("varint overflows 64 bits".into());
            }
            x |= ((b & 0x7f) as u64) << shift;
            if b & 0x80 == 0 {
                return Ok(x);
            }
            shift += 7;
            if shift > 63 {
                return Err("varint too long".into());
            }
        }
    }
    /// A varint used as a count of items that each take at least one byte: bounded by what is left.
    pub fn count(&mut self) -> Result<usize, String> {
        let n = self.var()?;
        if n > (self.buf.len() - self.pos) as u64 {
            return Err(format!("count {n} larger than the remaining {} bytes", self.buf.len() - self.pos));
        }
        Ok(n as usize)
    }
    pub fn ivar(&mut self) -> Result<i64, String> {
        let u = self.var()?;
        Ok(((u >> 1) as i64) ^ -((u & 1) as i64))
    }
    pub fn bytes(&mut self) -> Result<&'b [u8], String> {
        let n = self.count()?;
        self.take(n)
    }
    pub fn str(&mut self) -> Result<String, String> {
        let b = self.bytes()?;
        String::from_utf8(b.to_vec()).map_err(|_| "string is not UTF-8".to_string())
    }
    /// Varints into every element of `out`.
    #[inline]
    pub fn vars_into(&mut self, out: &mut [u64]) -> Result<(), String> {
        for x in out {
            *x = self.var()?;
        }
        Ok(())
    }
    /// `n` varints as [`Dims`].
    #[inline]
    pub fn dims_n(&mut self, n: usize) -> Result<Dims, String> {
        if n <= Dims::INLINE {
            let mut a = [0u64; Dims::INLINE];
            self.vars_into(&mut a[..n])?;
            return Ok(Dims::from(&a[..n]));
        }
        (0..n).map(|_| self.var()).collect()
    }
    pub fn dims(&mut self) -> Result<Vec<u64>, String> {
        let n = self.count()?;
        (0..n).map(|_| self.var()).collect()
    }
    pub fn value(&mut self) -> Result<Value, String> {
        self.value_at(0)
    }
    fn value_at(&mut self, depth: usize) -> Result<Value, String> {
        if depth > MAX_DEPTH {
            return Err("value nested too deeply".into());
        }
        Ok(match self.u8()? {
            0 => Value::Null,
            1 => Value::Bool(false),
            2 => Value::Bool(true),
            3 => Value::Int(self.ivar()?),
            4 => Value::Float(f64::from_le_bytes(self.take(8)?.try_into().unwrap())),
            5 => Value::Str(self.str()?),
            6 => Value::Bytes(self.bytes()?.to_vec()),
            7 => {
                let n = self.count()?;
                let mut items = Vec::with_capacity(prealloc(n));
                for _ in 0..n {
                    items.push(self.value_at(depth + 1)?);
                }
                Value::List(items)
            }
            8 => {
                let n = self.count()?;
                let mut entries = Vec::with_capacity(prealloc(n));
                for _ in 0..n {
                    let k = self.str()?;
                    entries.push((k, self.value_at(depth + 1)?));
                }
                Value::Map(entries)
            }
            t => return Err(format!("unknown value tag {t}")),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_values_and_varints() {
        let v = Value::Map(vec![
            ("a".into(), Value::Int(-5)),
            ("b".into(), Value::List(vec![Value::Float(1.5), Value::Null, Value::Bool(true)])),
            ("c".into(), Value::Bytes(vec![0, 255])),
            ("d".into(), Value::Str("é".into())),
            ("e".into(), Value::Int(i64::MIN)),
        ]);
        let mut e = Encoder::default();
        e.value(&v);
        e.var(u64::MAX);
        let mut d = Decoder::new(&e.buf);
        assert_eq!(d.value().unwrap(), v);
        assert_eq!(d.var().unwrap(), u64::MAX);
        assert!(d.is_done());
    }

    #[test]
    fn value_bytes_round_trip_and_reject_trailing_bytes() {
        let v = Value::List(vec![Value::Str("a".into()), Value::Map(vec![("k".into(), Value::Float(2.5))])]);
        assert_eq!(Value::from_bytes(&v.to_bytes()).unwrap(), v);
        let mut b = v.to_bytes();
        b.push(0);
        assert!(Value::from_bytes(&b).is_err());
    }

    #[test]
    fn varints_of_every_length_round_trip_and_truncation_is_an_error() {
        // Both sides of each length boundary: the one- and two-byte paths and the loop.
        let mut values = vec![0u64, 1, u64::MAX, u64::MAX - 1];
        for bits in (7..64).step_by(7) {
            values.extend([(1u64 << bits) - 1, 1u64 << bits, (1u64 << bits) + 1]);
        }
        for &x in &values {
            let mut e = Encoder::default();
            e.var(x);
            let want_len = (64 - x.leading_zeros()).div_ceil(7).max(1) as usize;
            assert_eq!(e.buf.len(), want_len, "{x}");
            for at in 0..e.buf.len() {
                assert!(Decoder::new(&e.buf[..at]).var().is_err(), "{x} cut at {at}");
            }
            let mut d = Decoder::new(&e.buf);
            assert_eq!(d.var().unwrap(), x);
            assert!(d.is_done());
            // Followed by more bytes, as in a message: the same value, the rest left.
            let mut e2 = Encoder { buf: e.buf.clone() };
            e2.var(x);
            let mut d = Decoder::new(&e2.buf);
            assert_eq!((d.var().unwrap(), d.var().unwrap()), (x, x));
            assert!(d.is_done());
        }
        // Dims of every length, inline or not.
        for n in 0..6usize {
            let mut e = Encoder::default();
            (0..n as u64).for_each(|i| e.var(i << (9 * i)));
            let dims = Decoder::new(&e.buf).dims_n(n).unwrap();
            assert_eq!(dims.as_slice(), (0..n as u64).map(|i| i << (9 * i)).collect::<Vec<_>>().as_slice());
            assert!(Decoder::new(&e.buf[..e.buf.len().saturating_sub(1)]).dims_n(n).is_err() || n == 0);
        }
    }

    #[test]
    fn hostile_input_is_an_error() {
        assert!(Decoder::new(&[7, 0xff, 0xff, 0xff, 0x0f]).value().is_err());
        assert!(Decoder::new(&[0xff; 11]).var().is_err());
        let deep = [7u8, 1].repeat(1000);
        assert!(Decoder::new(&deep).value().is_err());
    }
}
