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

/// A 128-bit digest of `bytes` (two independently seeded sets of lanes of 64-bit
/// multiply-xorshift mixing, folded with the length): for detecting accidental change, not for
/// security. Words go round-robin to four lanes of each set, so the four chains of multiplies
/// run side by side instead of one after another (a plan cache hashes a rank's whole plan).
pub fn digest128(bytes: &[u8]) -> [u64; 2] {
    const LANES: usize = 4;
    let mut a: [u64; LANES] =
        [0x243f_6a88_85a3_08d3, 0xa409_3822_299f_31d0, 0x4528_21e6_38d0_1377, 0xc0ac_29b7_c97c_50dd];
    let mut b: [u64; LANES] =
        [0x1319_8a2e_0370_7344, 0x082e_fa98_ec4e_6c89, 0xbe54_66cf_34e9_0c6c, 0x3f84_d5b5_b547_0917];
    let mut step = |lane: usize, w: u64| {
        a[lane] = mix64(a[lane] ^ w).wrapping_add(0x9e37_79b9_7f4a_7c15);
        b[lane] = mix64(b[lane].rotate_left(23) ^ w.wrapping_mul(0xff51_afd7_ed55_8ccd));
    };
    let mut blocks = bytes.chunks_exact(8 * LANES);
    for block in &mut blocks {
        for (lane, w) in block.chunks_exact(8).enumerate() {
            step(lane, u64::from_le_bytes(w.try_into().unwrap()));
        }
    }
    // The last words, the last one padded with zeros (the length tells the padding apart).
    for (lane, w) in blocks.remainder().chunks(8).enumerate() {
        let mut buf = [0u8; 8];
        buf[..w.len()].copy_from_slice(w);
        step(lane, u64::from_le_bytes(buf));
    }
    let len = bytes.len() as u64;
    let fold = |lanes: [u64; LANES], seed: u64| lanes.iter().fold(seed, |h, &x| mix64(h ^ x).wrapping_add(x));
    [mix64(fold(a, len) ^ len), mix64(fold(b, len.rotate_left(32)) ^ len.rotate_left(32))]
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

    #[test]
    fn digests_differ_when_words_move_or_lengths_cross_a_block() {
        // Words swapped within a block (different lanes) or across blocks (one lane, another
        // step), and every length around the four-word blocks.
        let base: Vec<u8> = (1..=96u8).map(|b| b.wrapping_mul(37)).collect();
        let d = digest128(&base);
        for (i, j) in [(0, 1), (0, 4), (3, 7), (2, 10), (0, 11)] {
            let mut x = base.clone();
            for k in 0..8 {
                x.swap(8 * i + k, 8 * j + k);
            }
            assert_ne!(digest128(&x), d, "words {i} and {j}");
        }
        let mut seen = std::collections::HashSet::new();
        for n in 0..=base.len() {
            assert!(seen.insert(digest128(&base[..n])), "length {n}");
            assert!(seen.insert(digest128(&vec![0u8; n])) || n == 0, "zeros of length {n}");
        }
    }
}
