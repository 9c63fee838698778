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
}
