use crate::error::{Error, Result};

/// Element type of a tensor. Names follow safetensors (`BF16`, `F8_E4M3`, …).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum DType {
    /// 64-bit float.
    F64,
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    BF16,
    /// fp8 e4m3fn.
    F8E4M3,
    /// fp8 e5m2.
    F8E5M2,
    /// signed 64-bit.
    I64,
    /// signed 32-bit.
    I32,
    /// signed 16-bit.
    I16,
    /// signed 8-bit.
    I8,
    /// unsigned 8-bit.
    U8,
    /// unsigned 16-bit.
    U16,
    /// unsigned 32-bit.
    U32,
    /// unsigned 64-bit.
    U64,
    /// boolean, one byte.
    Bool,
}

/// Every dtype, in the order of their on-disk codes.
pub const ALL_DTYPES: [DType; 15] = [
    DType::F64,
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::F8E4M3,
    DType::F8E5M2,
    DType::I64,
    DType::I32,
    DType::I16,
    DType::I8,
    DType::U8,
    DType::U16,
    DType::U32,
    DType::U64,
    DType::Bool,
];

impl DType {
    /// Converts `src` (elements of this type, little-endian) to `to` in a new buffer. Casts
    /// between F64, F32, F16 and BF16 round to nearest, ties to even, with infinities, NaNs
    /// (made quiet; sign and payload kept where they fit) and subnormals handled as IEEE-754
    /// does; `self == to` copies. Other pairs are refused with [`Error::InvalidArgument`].
    ///
    /// ```
    /// use tessera::DType;
    /// let half = DType::F32.cast_bytes(&1.5f32.to_le_bytes(), DType::F16)?;
    /// assert_eq!(half, 0x3e00u16.to_le_bytes());
    /// # Ok::<(), tessera::Error>(())
    /// ```
    pub fn cast_bytes(self, src: &[u8], to: DType) -> Result<Vec<u8>> {
        cast_bytes(src, self, to)
    }

    /// Every element type, in code order.
    pub const ALL: [DType; 15] = ALL_DTYPES;

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 | DType::U64 => 8,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F16 | DType::BF16 | DType::I16 | DType::U16 => 2,
            DType::F8E4M3 | DType::F8E5M2 | DType::I8 | DType::U8 | DType::Bool => 1,
        }
    }

    /// The safetensors name (`"BF16"`).
    pub fn safetensors_name(self) -> &'static str {
        match self {
            DType::F64 => "F64",
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::F8E4M3 => "F8_E4M3",
            DType::F8E5M2 => "F8_E5M2",
            DType::I64 => "I64",
            DType::I32 => "I32",
            DType::I16 => "I16",
            DType::I8 => "I8",
            DType::U8 => "U8",
            DType::U16 => "U16",
            DType::U32 => "U32",
            DType::U64 => "U64",
            DType::Bool => "BOOL",
        }
    }

    /// The short lowercase name used by the CLI and JSON (`"bf16"`, `"f8_e4m3fn"`).
    pub fn name(self) -> &'static str {
        match self {
            DType::F64 => "f64",
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F8E4M3 => "f8_e4m3fn",
            DType::F8E5M2 => "f8_e5m2",
            DType::I64 => "i64",
            DType::I32 => "i32",
            DType::I16 => "i16",
            DType::I8 => "i8",
            DType::U8 => "u8",
            DType::U16 => "u16",
            DType::U32 => "u32",
            DType::U64 => "u64",
            DType::Bool => "bool",
        }
    }

    /// Parses either naming ([`DType::name`] or [`DType::safetensors_name`]).
    pub fn parse(s: &str) -> Result<DType> {
        ALL_DTYPES
            .iter()
            .copied()
            .find(|d| d.name().eq_ignore_ascii_case(s) || d.safetensors_name().eq_ignore_ascii_case(s))
            .ok_or_else(|| Error::invalid(format!("unknown dtype {s:?}")))
    }

    /// True for the floating-point types (fp8 included).
    pub fn is_float(self) -> bool {
        matches!(self, DType::F64 | DType::F32 | DType::F16 | DType::BF16 | DType::F8E4M3 | DType::F8E5M2)
    }

    /// True for the types [`DType::cast_bytes`] converts between: F64, F32, F16 and BF16.
    pub fn is_castable(self) -> bool {
        matches!(self, DType::F64 | DType::F32 | DType::F16 | DType::BF16)
    }

    pub(crate) fn code(self) -> u8 {
        ALL_DTYPES.iter().position(|d| *d == self).unwrap() as u8
    }

    pub(crate) fn from_code(code: u8) -> Option<DType> {
        ALL_DTYPES.get(code as usize).copied()
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A binary IEEE-754-style format: exponent and mantissa widths (sign bit implied), with
/// infinities and NaNs at the all-ones exponent.
#[derive(Clone, Copy)]
struct Fmt {
    exp: u32,
    man: u32,
}

const FMT_F64: Fmt = Fmt { exp: 11, man: 52 };
const FMT_F32: Fmt = Fmt { exp: 8, man: 23 };
const FMT_F16: Fmt = Fmt { exp: 5, man: 10 };
const FMT_BF16: Fmt = Fmt { exp: 8, man: 7 };
const FMT_E5M2: Fmt = Fmt { exp: 5, man: 2 };

impl Fmt {
    fn bias(self) -> i64 {
        (1i64 << (self.exp - 1)) - 1
    }
    fn max_exp(self) -> u64 {
        (1u64 << self.exp) - 1
    }
}

/// `sig / 2^shift` rounded to nearest, ties to even (`shift` ≤ 63).
fn round_shift(sig: u64, shift: u32) -> u64 {
    if shift == 0 {
        return sig;
    }
    let q = sig >> shift;
    let rem = sig & ((1u64 << shift) - 1);
    let half = 1u64 << (shift - 1);
    if rem > half || (rem == half && q & 1 == 1) {
        q + 1
    } else {
        q
    }
}

/// Converts the bits of one value from format `s` to format `d` with a single rounding (to
/// nearest, ties to even): overflow becomes infinity, underflow goes through `d`'s subnormals
/// to a signed zero, infinities stay infinities. A NaN becomes a quiet NaN (as IEEE-754
/// conversions and the hardware do) with its sign and the top bits of its payload, so
/// narrowing a widened value gives back the original bits (a signalling NaN comes back quiet).
fn convert_bits(x: u64, s: Fmt, d: Fmt) -> u64 {
    let sign = (x >> (s.exp + s.man)) & 1;
    let exp = (x >> s.man) & s.max_exp();
    let man = x & ((1u64 << s.man) - 1);
    let out_sign = sign << (d.exp + d.man);
    if exp == s.max_exp() {
        if man == 0 {
            return out_sign | d.max_exp() << d.man;
        }
        let payload = if d.man >= s.man { man << (d.man - s.man) } else { man >> (s.man - d.man) };
        return out_sign | d.max_exp() << d.man | payload | 1 << (d.man - 1);
    }
    if exp == 0 && man == 0 {
        return out_sign;
    }
    // value = sig · 2^(e − s.man), with sig's leading one at bit s.man.
    let (sig, e) = if exp == 0 {
        let msb = 63 - man.leading_zeros();
        let lift = s.man - msb;
        (man << lift, 1 - s.bias() - lift as i64)
    } else {
        (man | 1 << s.man, exp as i64 - s.bias())
    };
    let mut biased = e + d.bias();
    if biased >= 1 {
        let mut m = if d.man >= s.man { sig << (d.man - s.man) } else { round_shift(sig, s.man - d.man) };
        if m >> (d.man + 1) != 0 {
            m >>= 1;
            biased += 1;
        }
        if biased >= d.max_exp() as i64 {
            return out_sign | d.max_exp() << d.man;
        }
        return out_sign | (biased as u64) << d.man | (m & ((1u64 << d.man) - 1));
    }
    // A subnormal of `d` (or zero): value / 2^(1 − bias − d.man), rounded. A carry into the
    // exponent field gives the smallest normal, which is the right encoding.
    let shift = s.man as i64 - d.man as i64 + 1 - biased;
    let m = if shift <= 0 {
        sig << (-shift)
    } else if shift >= s.man as i64 + 2 {
        0
    } else {
        round_shift(sig, shift as u32)
    };
    out_sign | m
}

fn castable_fmt(d: DType) -> Option<Fmt> {
    match d {
        DType::F64 => Some(FMT_F64),
        DType::F32 => Some(FMT_F32),
        DType::F16 => Some(FMT_F16),
        DType::BF16 => Some(FMT_BF16),
        _ => None,
    }
}

fn read_le(bytes: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    b[..bytes.len()].copy_from_slice(bytes);
    u64::from_le_bytes(b)
}

/// Converts `src` (elements of `from`, little-endian) to `to`, writing `dst`, which must hold
/// exactly as many elements. Casts between F64, F32, F16 and BF16 round to nearest, ties to
/// even, with infinities, NaNs (made quiet; sign and payload kept where they fit) and
/// subnormals handled as IEEE-754 does; `from == to` copies. Other pairs are refused with
/// [`Error::InvalidArgument`].
pub fn cast_into(src: &[u8], from: DType, to: DType, dst: &mut [u8]) -> Result<()> {
    let (fs, ts) = (from.size(), to.size());
    if !src.len().is_multiple_of(fs) {
        return Err(Error::invalid(format!("{} bytes are not a whole number of {from} elements", src.len())));
    }
    let n = src.len() / fs;
    if dst.len() != n * ts {
        return Err(Error::invalid(format!(
            "cast of {n} {from} elements needs a {}-byte {to} buffer, got {} bytes",
            n * ts,
            dst.len()
        )));
    }
    if from == to {
        dst.copy_from_slice(src);
        return Ok(());
    }
    let (Some(f), Some(t)) = (castable_fmt(from), castable_fmt(to)) else {
        return Err(Error::invalid(format!("cannot cast {from} to {to} (casts are between f64, f32, f16 and bf16)")));
    };
    for (a, b) in src.chunks_exact(fs).zip(dst.chunks_exact_mut(ts)) {
        let bits = convert_bits(read_le(a), f, t);
        b.copy_from_slice(&bits.to_le_bytes()[..ts]);
    }
    Ok(())
}

/// A value as a load cast sees it: integers (and bools) exactly, floats as f64.
#[derive(Clone, Copy)]
enum Num {
    Int(i128),
    Float(f64),
}

fn read_num(bytes: &[u8], dtype: DType) -> Option<Num> {
    let raw = read_le(bytes);
    Some(match dtype {
        DType::I64 => Num::Int(raw as i64 as i128),
        DType::I32 => Num::Int(raw as u32 as i32 as i128),
        DType::I16 => Num::Int(raw as u16 as i16 as i128),
        DType::I8 => Num::Int(raw as u8 as i8 as i128),
        DType::U8 | DType::U16 | DType::U32 | DType::U64 => Num::Int(raw as i128),
        DType::Bool => Num::Int((raw != 0) as i128),
        DType::F64 | DType::F32 | DType::F16 | DType::BF16 | DType::F8E4M3 | DType::F8E5M2 => {
            Num::Float(element_to_f64(bytes, dtype))
        }
    })
}

/// The little-endian bits of `v` as `to`, or None for a target no load cast writes (fp8).
fn write_num(v: Num, to: DType) -> Option<u64> {
    let (lo, hi) = match to {
        DType::I64 => (i64::MIN as i128, i64::MAX as i128),
        DType::I32 => (i32::MIN as i128, i32::MAX as i128),
        DType::I16 => (i16::MIN as i128, i16::MAX as i128),
        DType::I8 => (i8::MIN as i128, i8::MAX as i128),
        DType::U64 => (0, u64::MAX as i128),
        DType::U32 => (0, u32::MAX as i128),
        DType::U16 => (0, u16::MAX as i128),
        _ => (0, u8::MAX as i128),
    };
    let int = |v: Num| match v {
        Num::Int(i) => i,
        // Truncated toward zero as a C cast; out of the target's range it saturates there (NaN
        // is 0), where C's cast is undefined.
        Num::Float(f) => (f as i128).clamp(lo, hi),
    };
    let float = |v: Num| match v {
        Num::Int(i) => i as f64,
        Num::Float(f) => f,
    };
    Some(match to {
        DType::F64 => float(v).to_bits(),
        // From an integer, one rounding straight to f32 (an i64 past 2^53 would round twice via f64).
        DType::F32 => match v {
            Num::Int(i) => (i as f32).to_bits() as u64,
            Num::Float(f) => convert_bits(f.to_bits(), FMT_F64, FMT_F32),
        },
        DType::F16 => convert_bits(float(v).to_bits(), FMT_F64, FMT_F16),
        DType::BF16 => convert_bits(float(v).to_bits(), FMT_F64, FMT_BF16),
        // Two's complement wrap, as torch's integer casts do.
        DType::I64 | DType::I32 | DType::I16 | DType::I8 | DType::U8 | DType::U16 | DType::U32 | DType::U64 => {
            int(v) as u128 as u64
        }
        DType::Bool => match v {
            Num::Int(i) => (i != 0) as u64,
            Num::Float(f) => (f != 0.0) as u64,
        },
        DType::F8E4M3 | DType::F8E5M2 => return None,
    })
}

/// Converts `src` (elements of `from`) to `to` into `dst` as `tensor.to(dtype)` would, for a
/// load into a buffer of another dtype (Megatron-Core casts there): float to float as
/// [`cast_into`] (round to nearest even); integer to float rounded to nearest (an integer past
/// 2^53 in magnitude rounds twice into f16/bf16); float to integer truncated toward zero,
/// saturating at the target's range (NaN is 0) where torch's cast is undefined; integer to
/// integer wrapped; anything to bool is "not zero". Writing fp8 is refused.
pub fn cast_numeric(src: &[u8], from: DType, to: DType, dst: &mut [u8]) -> Result<()> {
    if from == to || (castable_fmt(from).is_some() && castable_fmt(to).is_some()) {
        return cast_into(src, from, to, dst);
    }
    let (fs, ts) = (from.size(), to.size());
    let n = src.len() / fs;
    if !src.len().is_multiple_of(fs) || dst.len() != n * ts {
        return Err(Error::invalid(format!(
            "cast of {} bytes of {from} into {} bytes of {to}: not the same number of elements",
            src.len(),
            dst.len()
        )));
    }
    if write_num(Num::Int(0), to).is_none() {
        return Err(Error::invalid(format!("cannot cast {from} to {to}: fp8 is not written by a cast")));
    }
    for (a, b) in src.chunks_exact(fs).zip(dst.chunks_exact_mut(ts)) {
        let bits = read_num(a, from).and_then(|v| write_num(v, to)).unwrap_or(0);
        b.copy_from_slice(&bits.to_le_bytes()[..ts]);
    }
    Ok(())
}

/// Converts `src` (elements of `from`, little-endian) to `to` in a new buffer: the function
/// behind [`DType::cast_bytes`].
pub(crate) fn cast_bytes(src: &[u8], from: DType, to: DType) -> Result<Vec<u8>> {
    let mut out = vec![0u8; src.len() / from.size() * to.size()];
    cast_into(src, from, to, &mut out)?;
    Ok(out)
}

/// fp8 e4m3fn: bias 7, no infinities, NaN only at `S.1111.111`.
fn e4m3fn_to_f64(b: u8) -> f64 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = (b >> 3) & 0xf;
    let man = (b & 7) as f64;
    if b & 0x7f == 0x7f {
        return f64::NAN.copysign(sign);
    }
    let v = if exp == 0 { man / 8.0 * 2f64.powi(-6) } else { (1.0 + man / 8.0) * 2f64.powi(exp as i32 - 7) };
    sign * v
}

/// Decodes one element (`bytes` holds exactly `dtype.size()` bytes, little-endian) as an f64:
/// exact for every float type (fp8 and bf16 included) and for integers up to 2^53 in magnitude,
/// rounded to nearest beyond; `bool` is 0 or 1.
pub fn element_to_f64(bytes: &[u8], dtype: DType) -> f64 {
    debug_assert_eq!(bytes.len(), dtype.size());
    let raw = read_le(bytes);
    match dtype {
        DType::F64 => f64::from_bits(raw),
        DType::F32 => f64::from_bits(convert_bits(raw, FMT_F32, FMT_F64)),
        DType::F16 => f64::from_bits(convert_bits(raw, FMT_F16, FMT_F64)),
        DType::BF16 => f64::from_bits(convert_bits(raw, FMT_BF16, FMT_F64)),
        DType::F8E5M2 => f64::from_bits(convert_bits(raw, FMT_E5M2, FMT_F64)),
        DType::F8E4M3 => e4m3fn_to_f64(raw as u8),
        DType::I64 => raw as i64 as f64,
        DType::I32 => raw as u32 as i32 as f64,
        DType::I16 => raw as u16 as i16 as f64,
        DType::I8 => raw as u8 as i8 as f64,
        DType::U8 | DType::U16 | DType::U32 | DType::U64 => raw as f64,
        DType::Bool => (raw != 0) as u8 as f64,
    }
}

/// [`element_to_f64`] of every element of `bytes` into `out` (as many elements), with the
/// dtype dispatch out of the loop.
pub(crate) fn elements_to_f64(bytes: &[u8], dtype: DType, out: &mut [f64]) {
    fn each<const N: usize>(bytes: &[u8], out: &mut [f64], f: impl Fn([u8; N]) -> f64) {
        for (o, c) in out.iter_mut().zip(bytes.chunks_exact(N)) {
            *o = f(c.try_into().expect("chunks of N bytes"));
        }
    }
    match dtype {
        DType::F64 => each(bytes, out, f64::from_le_bytes),
        DType::F32 => each(bytes, out, |b| f32::from_le_bytes(b) as f64),
        DType::BF16 => each(bytes, out, |b| f32::from_bits((u16::from_le_bytes(b) as u32) << 16) as f64),
        DType::I64 => each(bytes, out, |b| i64::from_le_bytes(b) as f64),
        DType::I32 => each(bytes, out, |b| i32::from_le_bytes(b) as f64),
        DType::U32 => each(bytes, out, |b| u32::from_le_bytes(b) as f64),
        DType::U8 => each(bytes, out, |b: [u8; 1]| b[0] as f64),
        _ => {
            let size = dtype.size();
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(size)) {
                *o = element_to_f64(c, dtype);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn cast_numeric_follows_torch_to() {
        let ints: Vec<u8> = [-3i64, 0, 7, 1 << 40].iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut f = vec![0u8; 16];
        cast_numeric(&ints, DType::I64, DType::F32, &mut f).unwrap();
        let got: Vec<f32> = f.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        assert_eq!(got, vec![-3.0, 0.0, 7.0, (1u64 << 40) as f32]);
        let floats: Vec<u8> = [-2.7f32, 0.5, 3.9, 300.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut i = vec![0u8; 4 * 8];
        cast_numeric(&floats, DType::F32, DType::I64, &mut i).unwrap();
        let got: Vec<i64> = i.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect();
        assert_eq!(got, vec![-2, 0, 3, 300]);
        let mut u = vec![0u8; 4];
        cast_numeric(&floats, DType::F32, DType::U8, &mut u).unwrap();
        assert_eq!(u, vec![0, 0, 3, 255], "saturated at the target's range");
        let wide: Vec<u8> = [1e19f64, -f64::INFINITY, f64::NAN, -1e30].iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut i = vec![0u8; 4 * 8];
        cast_numeric(&wide, DType::F64, DType::I64, &mut i).unwrap();
        let got: Vec<i64> = i.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect();
        assert_eq!(got, vec![i64::MAX, i64::MIN, 0, i64::MIN]);
        let ints: Vec<u8> = [300i64, -1].iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut w = vec![0u8; 2];
        cast_numeric(&ints, DType::I64, DType::U8, &mut w).unwrap();
        assert_eq!(w, vec![44, 255], "integers wrap, as torch's integer casts");
        let mut b = vec![0u8; 4];
        cast_numeric(&floats, DType::F32, DType::Bool, &mut b).unwrap();
        assert_eq!(b, vec![1, 1, 1, 1]);
        let mut h = vec![0u8; 8];
        cast_numeric(&floats, DType::F32, DType::BF16, &mut h).unwrap();
        let mut back = vec![0u8; 16];
        cast_into(&h, DType::BF16, DType::F32, &mut back).unwrap();
        assert_eq!(f32::from_le_bytes(back[12..16].try_into().unwrap()), 300.0);
        assert!(cast_numeric(&floats, DType::F32, DType::F8E4M3, &mut u).is_err());
        assert!(cast_numeric(&floats, DType::F32, DType::I64, &mut u).is_err(), "wrong length");
    }

    use super::*;

    fn f32_to(x: f32, to: DType) -> u64 {
        read_le(&cast_bytes(&x.to_le_bytes(), DType::F32, to).unwrap())
    }
    fn f64_to(x: f64, to: DType) -> u64 {
        read_le(&cast_bytes(&x.to_le_bytes(), DType::F64, to).unwrap())
    }
    fn to_f32(bits: u16, from: DType) -> f32 {
        f32::from_le_bytes(cast_bytes(&bits.to_le_bytes(), from, DType::F32).unwrap().try_into().unwrap())
    }

    /// `bits` of a 16-bit format with the quiet bit set if it is a NaN (what a round trip of a
    /// signalling NaN gives back).
    fn quieted(bits: u16, f: Fmt) -> u16 {
        let exp_mask = (f.max_exp() as u16) << f.man;
        let man_mask = (1u16 << f.man) - 1;
        if bits & exp_mask == exp_mask && bits & man_mask != 0 {
            bits | 1 << (f.man - 1)
        } else {
            bits
        }
    }

    #[test]
    fn f16_round_trips_through_f32_and_f64_exhaustively() {
        for bits in 0..=u16::MAX {
            let src = bits.to_le_bytes();
            for wide in [DType::F32, DType::F64] {
                let w = cast_bytes(&src, DType::F16, wide).unwrap();
                let back = cast_bytes(&w, wide, DType::F16).unwrap();
                assert_eq!(back, quieted(bits, FMT_F16).to_le_bytes(), "f16 {bits:#06x} through {wide}");
                let v = element_to_f64(&w, wide);
                let direct = element_to_f64(&src, DType::F16);
                assert!(v == direct || (v.is_nan() && direct.is_nan()), "{bits:#06x}");
            }
        }
    }

    #[test]
    fn bf16_round_trips_through_f32_and_f64_exhaustively() {
        for bits in 0..=u16::MAX {
            let src = bits.to_le_bytes();
            let q = quieted(bits, FMT_BF16);
            let w = cast_bytes(&src, DType::BF16, DType::F32).unwrap();
            // bf16 is the top half of an f32.
            assert_eq!(read_le(&w), (q as u64) << 16, "bf16 {bits:#06x}");
            assert_eq!(cast_bytes(&w, DType::F32, DType::BF16).unwrap(), q.to_le_bytes(), "bf16 {bits:#06x} via f32");
            let w = cast_bytes(&src, DType::BF16, DType::F64).unwrap();
            assert_eq!(cast_bytes(&w, DType::F64, DType::BF16).unwrap(), q.to_le_bytes(), "bf16 {bits:#06x} via f64");
        }
    }

    #[test]
    fn f16_decoding_matches_the_definition() {
        assert_eq!(to_f32(0x3c00, DType::F16), 1.0);
        assert_eq!(to_f32(0xc000, DType::F16), -2.0);
        assert_eq!(to_f32(0x7bff, DType::F16), 65504.0);
        assert_eq!(to_f32(0x0001, DType::F16), 2f32.powi(-24));
        assert_eq!(to_f32(0x03ff, DType::F16), 1023.0 * 2f32.powi(-24));
        assert_eq!(to_f32(0x0400, DType::F16), 2f32.powi(-14));
        assert_eq!(to_f32(0x7c00, DType::F16), f32::INFINITY);
        assert_eq!(to_f32(0xfc00, DType::F16), f32::NEG_INFINITY);
        assert!(to_f32(0x7e00, DType::F16).is_nan());
        assert_eq!(to_f32(0x8000, DType::F16).to_bits(), 0x8000_0000);
    }

    #[test]
    fn narrowing_rounds_to_nearest_even() {
        use DType::{BF16, F16, F32};
        // f16 has 10 mantissa bits: 1 + 2^-11 is halfway between 1 and 1 + 2^-10.
        assert_eq!(f32_to(1.0 + 2f32.powi(-11), F16), 0x3c00, "tie to even (down)");
        assert_eq!(f32_to(1.0 + 3.0 * 2f32.powi(-11), F16), 0x3c02, "tie to even (up)");
        assert_eq!(f32_to(1.0 + 2f32.powi(-11) + 2f32.powi(-20), F16), 0x3c01, "above the tie");
        assert_eq!(f32_to(65504.0, F16), 0x7bff);
        assert_eq!(f32_to(65519.0, F16), 0x7bff, "below the overflow tie");
        assert_eq!(f32_to(65520.0, F16), 0x7c00, "the tie overflows to infinity");
        assert_eq!(f32_to(-1e9, F16), 0xfc00);
        // Subnormals of f16.
        assert_eq!(f32_to(2f32.powi(-24), F16), 0x0001);
        assert_eq!(f32_to(2f32.powi(-25), F16), 0x0000, "half the smallest subnormal: tie to zero");
        assert_eq!(f32_to(1.5 * 2f32.powi(-25), F16), 0x0001);
        assert_eq!(f32_to(-3.0 * 2f32.powi(-25), F16), 0x8002, "tie to even, negative");
        assert_eq!(f32_to(1023.5 * 2f32.powi(-24), F16), 0x0400, "rounds up into the smallest normal");
        assert_eq!(f32_to(2f32.powi(-30), F16), 0x0000);
        assert_eq!(f32_to(-0.0, F16), 0x8000);
        // bf16 keeps the top 16 bits of an f32, rounded.
        assert_eq!(f32_to(f32::from_bits(0x3f80_8000), BF16), 0x3f80, "tie to even (down)");
        assert_eq!(f32_to(f32::from_bits(0x3f81_8000), BF16), 0x3f82, "tie to even (up)");
        assert_eq!(f32_to(f32::from_bits(0x3f80_8001), BF16), 0x3f81);
        assert_eq!(f32_to(f32::from_bits(0x3f80_7fff), BF16), 0x3f80);
        assert_eq!(f32_to(f32::MAX, BF16), 0x7f80, "rounds up to infinity");
        assert_eq!(f32_to(f32::from_bits(0x0000_0001), BF16), 0x0000, "f32 subnormals below bf16's");
        assert_eq!(f32_to(f32::from_bits(0x0001_8000), BF16), 0x0002);
        assert_eq!(f32_to(f32::NEG_INFINITY, BF16), 0xff80);
        // NaNs stay NaNs with their sign.
        let nan = f32_to(f32::NAN, BF16);
        assert!(nan & 0x7f80 == 0x7f80 && nan & 0x7f != 0);
        let nan = f32_to(-f32::NAN, F16);
        assert!(nan & 0xfc00 == 0xfc00 && nan & 0x3ff != 0);
        // NaNs come out quiet, even when their payload is only in the low bits.
        assert_eq!(f32_to(f32::from_bits(0x7f80_0001), BF16), 0x7fc0);
        assert_eq!(f32_to(f32::from_bits(0xff86_0000), F16), 0xfe30, "sign and top payload bits kept");
        assert_eq!(read_le(&cast_bytes(&0x7d01u16.to_le_bytes(), F16, F32).unwrap()), 0x7fe0_2000);
        // To f32: the same rounding as the hardware.
        assert_eq!(f64_to(0.1, F32) as u32, 0.1f32.to_bits());
    }

    #[test]
    fn every_tie_between_neighbours_rounds_to_even() {
        for narrow in [DType::F16, DType::BF16] {
            let largest_finite: u16 = if narrow == DType::F16 { 0x7bff } else { 0x7f7f };
            for bits in 0..largest_finite {
                let lo = element_to_f64(&bits.to_le_bytes(), narrow);
                let hi = element_to_f64(&(bits + 1).to_le_bytes(), narrow);
                // Neighbours have at most 11 significant bits: their midpoint is exact in f32.
                let mid = ((lo + hi) / 2.0) as f32;
                let even = if bits % 2 == 0 { bits } else { bits + 1 };
                for (x, want) in [
                    (mid, even),
                    (f32::from_bits(mid.to_bits() - 1), bits),
                    (f32::from_bits(mid.to_bits() + 1), bits + 1),
                ] {
                    assert_eq!(f32_to(x, narrow), want as u64, "{narrow} {x:e} between {bits:#06x} and the next");
                    assert_eq!(f32_to(-x, narrow), want as u64 | 0x8000, "{narrow} -{x:e}");
                }
            }
        }
    }

    #[test]
    fn f64_narrowing_rounds_once() {
        // Through f32 first, 1 + 2^-11 + 2^-40 would become the tie 1 + 2^-11 and then 1.0.
        assert_eq!(f64_to(1.0 + 2f64.powi(-11) + 2f64.powi(-40), DType::F16), 0x3c01);
        assert_eq!(f64_to(1.0 + 2f64.powi(-8) + 2f64.powi(-40), DType::BF16), 0x3f81);
        assert_eq!(f64_to(1e300, DType::F32), 0x7f80_0000);
        assert_eq!(f64_to(f64::from_bits(1), DType::F16), 0, "f64 subnormal");
        assert_eq!(f64_to(-f64::from_bits(1), DType::BF16), 0x8000);
        // f64 → f32 agrees with the hardware conversion on many values.
        let mut rng = crate::test_rng::TestRng::new(0x1234_5678_9abc_def0);
        for _ in 0..100_000 {
            let x = f64::from_bits(rng.next_u64());
            let got = f64_to(x, DType::F32) as u32;
            let want = (x as f32).to_bits();
            if x.is_nan() {
                assert!(f32::from_bits(got).is_nan());
            } else {
                assert_eq!(got, want, "{x:e}");
            }
        }
    }

    #[test]
    fn block_decoding_agrees_with_element_decoding() {
        let mut rng = crate::test_rng::TestRng::new(0x9e37_79b9_7f4a_7c15);
        let bytes: Vec<u8> = (0..4096).map(|_| (rng.next_u64() >> 56) as u8).collect();
        for d in ALL_DTYPES {
            let n = bytes.len() / d.size();
            let mut out = vec![0.0; n];
            elements_to_f64(&bytes, d, &mut out);
            for (i, (x, c)) in out.iter().zip(bytes.chunks_exact(d.size())).enumerate() {
                let y = element_to_f64(c, d);
                assert!(x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()), "{d} element {i}: {x} vs {y}");
            }
        }
    }

    #[test]
    fn identity_and_refused_casts() {
        let b = [1u8, 2, 3, 4, 5, 6, 7, 8];
        assert_eq!(cast_bytes(&b, DType::I32, DType::I32).unwrap(), b);
        assert_eq!(cast_bytes(&b, DType::F8E4M3, DType::F8E4M3).unwrap(), b);
        for (from, to) in [(DType::I32, DType::F32), (DType::F32, DType::I64), (DType::F8E5M2, DType::F16)] {
            assert!(matches!(cast_bytes(&b, from, to), Err(Error::InvalidArgument { .. })), "{from} → {to}");
        }
        assert!(matches!(cast_bytes(&[0u8; 3], DType::F16, DType::F32), Err(Error::InvalidArgument { .. })));
        let mut small = [0u8; 2];
        assert!(cast_into(&[0u8; 4], DType::F32, DType::BF16, &mut small).is_ok());
        assert!(cast_into(&[0u8; 8], DType::F32, DType::BF16, &mut small).is_err());
    }

    #[test]
    fn elements_decode_for_every_dtype() {
        assert_eq!(element_to_f64(&(-2.5f64).to_le_bytes(), DType::F64), -2.5);
        assert_eq!(element_to_f64(&0.1f32.to_le_bytes(), DType::F32), 0.1f32 as f64);
        assert_eq!(element_to_f64(&0x3e00u16.to_le_bytes(), DType::F16), 1.5);
        assert_eq!(element_to_f64(&0xbfc0u16.to_le_bytes(), DType::BF16), -1.5);
        // e4m3fn: 0x38 = 1.0, 0x7e = 448 (max), 0x01 = 2^-9, 0x7f NaN.
        assert_eq!(element_to_f64(&[0x38], DType::F8E4M3), 1.0);
        assert_eq!(element_to_f64(&[0x7e], DType::F8E4M3), 448.0);
        assert_eq!(element_to_f64(&[0xfe], DType::F8E4M3), -448.0);
        assert_eq!(element_to_f64(&[0x01], DType::F8E4M3), 2f64.powi(-9));
        assert!(element_to_f64(&[0x7f], DType::F8E4M3).is_nan());
        assert_eq!(element_to_f64(&[0x78], DType::F8E4M3), 256.0, "no infinities in e4m3fn");
        // e5m2: 0x3c = 1.0, 0x7b = 57344 (max), 0x7c inf, 0x01 = 2^-16.
        assert_eq!(element_to_f64(&[0x3c], DType::F8E5M2), 1.0);
        assert_eq!(element_to_f64(&[0x7b], DType::F8E5M2), 57344.0);
        assert_eq!(element_to_f64(&[0x7c], DType::F8E5M2), f64::INFINITY);
        assert_eq!(element_to_f64(&[0x01], DType::F8E5M2), 2f64.powi(-16));
        assert!(element_to_f64(&[0x7f], DType::F8E5M2).is_nan());
        assert_eq!(element_to_f64(&(-7i64).to_le_bytes(), DType::I64), -7.0);
        assert_eq!(element_to_f64(&(-7i32).to_le_bytes(), DType::I32), -7.0);
        assert_eq!(element_to_f64(&(-7i16).to_le_bytes(), DType::I16), -7.0);
        assert_eq!(element_to_f64(&[0xf9], DType::I8), -7.0);
        assert_eq!(element_to_f64(&[0xf9], DType::U8), 249.0);
        assert_eq!(element_to_f64(&65535u16.to_le_bytes(), DType::U16), 65535.0);
        assert_eq!(element_to_f64(&u32::MAX.to_le_bytes(), DType::U32), u32::MAX as f64);
        assert_eq!(element_to_f64(&(1u64 << 60).to_le_bytes(), DType::U64), 2f64.powi(60));
        assert_eq!(element_to_f64(&[0], DType::Bool), 0.0);
        assert_eq!(element_to_f64(&[1], DType::Bool), 1.0);
        for d in ALL_DTYPES {
            assert_eq!(element_to_f64(&vec![0u8; d.size()], d), 0.0, "{d}");
        }
    }
}
