//! A position-keyed 64-bit checksum of byte regions, computable in parallel.
//!
//! The region is read as little-endian 8-byte words `w_i` (the last one zero-padded); the raw
//! sum is `Σ fmix64(w_i + (i + 1) · GOLDEN)` (wrapping), which any number of GPU threads can
//! accumulate in any order, and the checksum is `fmix64(sum ^ len · K)`. Swapped, shifted or
//! altered words change it. Not cryptographic. `common.cuh` mirrors [`checksum_term`].

use crate::pattern::{GOLDEN, fmix64};

const LEN_KEY: u64 = 0xC2B2_AE3D_27D4_EB4F;

/// Contribution of word number `index` (value `word`) to the raw sum.
pub const fn checksum_term(word: u64, index: u64) -> u64 {
    fmix64(word.wrapping_add(index.wrapping_add(1).wrapping_mul(GOLDEN)))
}

/// Raw (unfinalised) sum of a region, as the GPU kernel produces it.
pub fn checksum_raw(bytes: &[u8]) -> u64 {
    bytes.chunks(8).enumerate().fold(0u64, |sum, (i, chunk)| {
        let mut w = [0u8; 8];
        w[..chunk.len()].copy_from_slice(chunk);
        sum.wrapping_add(checksum_term(u64::from_le_bytes(w), i as u64))
    })
}

/// Finalises a raw sum of a region of `len` bytes.
pub const fn checksum_finalize(raw: u64, len: u64) -> u64 {
    fmix64(raw ^ len.wrapping_mul(LEN_KEY))
}

/// Checksum of `bytes`.
pub fn checksum(bytes: &[u8]) -> u64 {
    checksum_finalize(checksum_raw(bytes), bytes.len() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pattern::pattern_vec;

    #[test]
    fn pinned_values() {
        assert_eq!(checksum(&[]), fmix64(0));
        assert_eq!(checksum_raw(&[1]), checksum_term(1, 0));
        assert_eq!(
            checksum_raw(&[0; 16]),
            checksum_term(0, 0).wrapping_add(checksum_term(0, 1))
        );
    }

    #[test]
    fn detects_changes_swaps_and_length() {
        let data = pattern_vec(1, 0, 4096);
        let base = checksum(&data);
        let mut altered = data.clone();
        altered[100] ^= 1;
        assert_ne!(checksum(&altered), base);
        let mut swapped = data.clone();
        swapped[..8].copy_from_slice(&data[8..16]);
        swapped[8..16].copy_from_slice(&data[..8]);
        assert_ne!(checksum(&swapped), base);
        assert_ne!(checksum(&[0u8; 8]), checksum(&[0u8; 16]));
        assert_ne!(checksum(&[0u8; 7]), checksum(&[0u8; 8]));
    }

    #[test]
    fn raw_sum_is_order_independent() {
        // What the GPU relies on: partial sums over any split of the words add up.
        let data = pattern_vec(3, 5, 1000);
        let whole = checksum_raw(&data);
        let split = 512; // a multiple of 8 keeps word indices
        let first = checksum_raw(&data[..split]);
        let second = data[split..].chunks(8).enumerate().fold(0u64, |s, (i, c)| {
            let mut w = [0u8; 8];
            w[..c.len()].copy_from_slice(c);
            s.wrapping_add(checksum_term(u64::from_le_bytes(w), (split / 8 + i) as u64))
        });
        assert_eq!(whole, first.wrapping_add(second));
    }
}
