//! A fast, non-cryptographic hasher for planning's hot maps (millions of short keys from a
//! trusted job; SipHash's flooding resistance is not needed and costs 3×).

use std::hash::{BuildHasherDefault, Hasher};

/// Multiply-rotate hashing of 8-byte words (the scheme rustc uses internally).
#[derive(Default, Clone, Copy)]
pub struct FastHasher(u64);

const K: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl FastHasher {
    #[inline]
    fn add(&mut self, w: u64) {
        self.0 = (self.0.rotate_left(5) ^ w).wrapping_mul(K);
    }
}

impl Hasher for FastHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            self.add(u64::from_le_bytes(c.try_into().unwrap()));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut buf = [0u8; 8];
            buf[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(buf));
        }
    }
    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.add(i as u64);
    }
    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
}

/// `HashMap` with [`FastHasher`].
pub type FastMap<K, V> = std::collections::HashMap<K, V, BuildHasherDefault<FastHasher>>;

/// The splitmix64 finalizer: every input bit affects every output bit.
pub(crate) fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A 128-bit digest of `bytes` (two independently seeded lanes of 64-bit multiply-xorshift
/// mixing, with the length): for detecting accidental change, not for security.
pub fn digest128(bytes: &[u8]) -> [u64; 2] {
    let mix = mix64;
    let mut a: u64 = 0x243f_6a88_85a3_08d3;
    let mut b: u64 = 0x1319_8a2e_0370_7344;
    let mut chunks = bytes.chunks_exact(8);
    for c in &mut chunks {
        let w = u64::from_le_bytes(c.try_into().unwrap());
        a = mix(a ^ w).wrapping_add(0x9e37_79b9_7f4a_7c15);
        b = mix(b.rotate_left(23) ^ w.wrapping_mul(0xff51_afd7_ed55_8ccd));
    }
    let rest = chunks.remainder();
    let mut buf = [0u8; 8];
    buf[..rest.len()].copy_from_slice(rest);
    let w = u64::from_le_bytes(buf);
    let len = bytes.len() as u64;
    [mix(mix(a ^ w) ^ len), mix(mix(b ^ w.rotate_left(17)) ^ len.rotate_left(32))]
}

#[cfg(test)]
mod tests {
    use super::digest128;

    #[test]
    fn digests_differ_for_padding_and_single_bit_changes() {
        assert_ne!(digest128(b"abc"), digest128(b"abc\0"));
        assert_ne!(digest128(b""), digest128(b"\0"));
        let base: Vec<u8> = (0..200u8).collect();
        let d = digest128(&base);
        for i in 0..base.len() {
            for bit in 0..8 {
                let mut x = base.clone();
                x[i] ^= 1 << bit;
                assert_ne!(digest128(&x), d, "byte {i} bit {bit}");
            }
        }
        assert_eq!(digest128(&base), d);
    }
}
