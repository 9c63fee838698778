//! CRC-32C (Castagnoli), the checksum of every block, header and index tessera writes: one
//! implementation for the whole crate.
//!
//! Computed with `crc-fast`, which folds with carry-less multiplication (PCLMULQDQ / VPCLMULQDQ
//! on x86-64, PMULL on ARM), several bytes per cycle more than a loop of `crc32` instructions:
//! a verified load checksums every byte it reads, and a save every byte it writes, so from the
//! page cache this speed is part of theirs.

use crc_fast::{CrcAlgorithm, Digest};

/// CRC-32C of `data`.
pub(crate) fn crc32c(data: &[u8]) -> u32 {
    crc_fast::crc32_iscsi(data)
}

/// CRC-32C of the bytes whose CRC-32C is `crc`, followed by `data` (`crc32c(a ++ b) ==
/// crc32c_append(crc32c(a), b)`; `crc32c(b) == crc32c_append(0, b)`).
pub(crate) fn crc32c_append(crc: u32, data: &[u8]) -> u32 {
    // The running register is the finished CRC with the final XOR (all ones) undone.
    let mut digest = Digest::new_with_init_state(CrcAlgorithm::Crc32Iscsi, u64::from(!crc));
    digest.update(data);
    digest.finalize() as u32
}

/// The CRC-32C polynomial, bit-reflected (bit 31 is the coefficient of x⁰).
const POLY: u32 = 0x82F6_3B78;

/// `a · b mod POLY` in the bit-reflected representation.
const fn mul_mod(a: u32, mut b: u32) -> u32 {
    let (mut m, mut p) = (1u32 << 31, 0u32);
    while m != 0 {
        if a & m != 0 {
            p ^= b;
        }
        m >>= 1;
        b = if b & 1 != 0 { (b >> 1) ^ POLY } else { b >> 1 };
    }
    p
}

/// `X2N[k]` is `x^(2^k) mod POLY`, for every `k` that a byte count (`u64`, times 8) reaches.
const X2N: [u32; 67] = {
    let mut t = [0u32; 67];
    t[0] = 1 << 30; // x¹
    let mut k = 1;
    while k < t.len() {
        t[k] = mul_mod(t[k - 1], t[k - 1]);
        k += 1;
    }
    t
};

/// `x^(8·n) mod POLY`: the operator that appends `n` zero bytes to a CRC register.
fn shift_of(mut n: u64) -> u32 {
    let (mut p, mut k) = (1u32 << 31, 3usize); // x⁰; one byte is x^(2³)
    while n != 0 {
        if n & 1 != 0 {
            p = mul_mod(X2N[k], p);
        }
        n >>= 1;
        k += 1;
    }
    p
}

/// Joins CRC-32Cs of consecutive byte ranges into the CRC-32C of their concatenation, from the
/// CRCs and lengths alone: how ranks that each read part of a checksum block check it whole
/// without reading the rest. The shift for a length is kept, so that a run of ranges of one
/// length (the usual case: rows of a tensor) costs one multiplication each.
#[derive(Debug, Default)]
pub(crate) struct CrcJoin {
    /// The length last joined and its shift (`None` before the first join).
    last: Option<(u64, u32)>,
}

impl CrcJoin {
    /// CRC-32C of `a ++ b`, given `crc_a = crc32c(a)`, `crc_b = crc32c(b)` and `b.len()`.
    pub(crate) fn join(&mut self, crc_a: u32, crc_b: u32, len_b: u64) -> u32 {
        // The pre- and post-conditioning (all ones in, all ones out) cancel in the XOR: what is
        // left is the first CRC moved past `len_b` zero bytes, plus the second.
        let shift = match self.last {
            Some((len, s)) if len == len_b => s,
            _ => {
                let s = shift_of(len_b);
                self.last = Some((len_b, s));
                s
            }
        };
        mul_mod(shift, crc_a) ^ crc_b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values_and_appending() {
        // The check value of CRC-32C (RFC 3720, B.4).
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(crc32c(b""), 0);
        assert_eq!(crc32c(&[0u8; 32]), 0x8a91_36aa);
        let data: Vec<u8> = (0..100_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8).collect();
        let whole = crc32c(&data);
        for cut in [0, 1, 7, 64, 4095, 65_536, 99_999, 100_000] {
            let (a, b) = data.split_at(cut);
            assert_eq!(crc32c_append(crc32c(a), b), whole, "cut at {cut}");
        }
        assert_eq!(crc32c_append(0, &data), whole);
    }

    #[test]
    fn joined_crcs_are_the_crc_of_the_concatenation() {
        let data: Vec<u8> = (0..70_000u32).map(|i| (i.wrapping_mul(2_246_822_519) >> 23) as u8).collect();
        let whole = crc32c(&data);
        let mut join = CrcJoin::default();
        for cut in [0, 1, 3, 8, 4096, 8191, 65_536, 69_999, 70_000] {
            let (a, b) = data.split_at(cut);
            assert_eq!(join.join(crc32c(a), crc32c(b), b.len() as u64), whole, "cut at {cut}");
        }
        // Many equal pieces, folded from the CRC of nothing (0), as a block is checked.
        for piece in [1usize, 7, 1000, 8192] {
            let folded = data.chunks(piece).fold(0, |acc, p| join.join(acc, crc32c(p), p.len() as u64));
            assert_eq!(folded, whole, "pieces of {piece}");
        }
        // Lengths far past any file: the shift table reaches every bit of a u64.
        assert_eq!(shift_of(0), 1 << 31);
        assert_eq!(mul_mod(shift_of(1 << 40), shift_of(1 << 40)), shift_of(1 << 41));
        assert_eq!(mul_mod(shift_of(1 << 62), shift_of((1 << 62) + 5)), shift_of((1 << 63) + 5));
    }
}
