//! The verify pattern: every 512-byte block's contents follow from its byte offset and a seed.
//!
//! Word `j` (little-endian `u64`) of the block at byte offset `o` is `key[j] ^ o`, where the 64
//! key words come from the seed through SplitMix64. Blocks at different offsets differ in every
//! word, a block from another run (another seed) differs too, and zeros never match. Writes
//! fill their buffer with [`Pattern::fill`]; every read is checked with [`Pattern::check`]
//! before its buffer is reused, so a fast but wrong path shows up as verify errors.
//!
//! Filling and checking are plain XORs over the buffer (the compiler vectorizes them), so a
//! check costs about as much as reading the buffer once.

/// Granularity of the pattern in bytes; block sizes and offsets are multiples of it.
pub const VERIFY_BLOCK: usize = 512;
const WORDS: usize = VERIFY_BLOCK / 8;

/// The first difference a check found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "verify mismatch at byte {byte_offset:#x} (block at {block_offset:#x}): expected {expected:#018x}, found {found:#018x}"
)]
pub struct Mismatch {
    /// Byte offset (in the namespace) of the 512-byte block that differs.
    pub block_offset: u64,
    /// Byte offset (in the namespace) of the first differing word.
    pub byte_offset: u64,
    /// The word the pattern expects.
    pub expected: u64,
    /// The word that was read.
    pub found: u64,
}

/// A seeded pattern.
#[derive(Debug, Clone)]
pub struct Pattern {
    key: [u64; WORDS],
    seed: u64,
}

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Pattern {
    /// The pattern of `seed`.
    pub fn new(seed: u64) -> Self {
        let mut state = seed;
        let mut key = [0u64; WORDS];
        for k in &mut key {
            *k = splitmix64(&mut state);
        }
        Pattern { key, seed }
    }

    /// The key words: word `j` of the 512-byte block at byte offset `o` is `key[j] ^ o`.
    pub fn key(&self) -> &[u64] {
        &self.key
    }

    /// The seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Fills `buf` with the pattern of the blocks starting at namespace byte offset `offset`.
    ///
    /// `offset` and `buf.len()` must be multiples of [`VERIFY_BLOCK`]; a trailing partial block
    /// is left as it is.
    pub fn fill(&self, offset: u64, buf: &mut [u8]) {
        for (i, block) in buf.chunks_exact_mut(VERIFY_BLOCK).enumerate() {
            let o = offset + (i * VERIFY_BLOCK) as u64;
            for (word, k) in block.chunks_exact_mut(8).zip(self.key.iter()) {
                word.copy_from_slice(&(k ^ o).to_le_bytes());
            }
        }
    }

    /// Checks that `buf` holds the pattern of the blocks starting at byte offset `offset`.
    pub fn check(&self, offset: u64, buf: &[u8]) -> Result<(), Mismatch> {
        for (i, block) in buf.chunks_exact(VERIFY_BLOCK).enumerate() {
            let o = offset + (i * VERIFY_BLOCK) as u64;
            let mut diff = 0u64;
            for (word, k) in block.chunks_exact(8).zip(self.key.iter()) {
                let w = u64::from_le_bytes([
                    word[0], word[1], word[2], word[3], word[4], word[5], word[6], word[7],
                ]);
                diff |= w ^ k ^ o;
            }
            if diff != 0 {
                return Err(self.first_mismatch(o, block));
            }
        }
        Ok(())
    }

    fn first_mismatch(&self, block_offset: u64, block: &[u8]) -> Mismatch {
        for (j, (word, k)) in block.chunks_exact(8).zip(self.key.iter()).enumerate() {
            let found = u64::from_le_bytes([
                word[0], word[1], word[2], word[3], word[4], word[5], word[6], word[7],
            ]);
            let expected = k ^ block_offset;
            if found != expected {
                return Mismatch {
                    block_offset,
                    byte_offset: block_offset + (j * 8) as u64,
                    expected,
                    found,
                };
            }
        }
        // Unreachable in practice: the caller saw a difference in this block.
        Mismatch {
            block_offset,
            byte_offset: block_offset,
            expected: 0,
            found: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_then_check_round_trips() {
        let p = Pattern::new(7);
        let mut buf = vec![0u8; 8192];
        p.fill(4096 * 3, &mut buf);
        assert!(p.check(4096 * 3, &buf).is_ok());
        // A sub-range checks at its own offset.
        assert!(p.check(4096 * 3 + 512, &buf[512..1024]).is_ok());
    }

    #[test]
    fn detects_wrong_offset_seed_zeros_and_bit_flips() {
        let p = Pattern::new(7);
        let mut buf = vec![0u8; 4096];
        p.fill(0, &mut buf);
        let e = p.check(4096, &buf).unwrap_err();
        assert_eq!(e.block_offset, 4096);
        assert!(Pattern::new(8).check(0, &buf).is_err());
        assert!(p.check(0, &vec![0u8; 4096]).is_err());
        let mut flipped = buf.clone();
        flipped[3000] ^= 0x10;
        let e = p.check(0, &flipped).unwrap_err();
        assert_eq!(e.block_offset, 2560);
        assert_eq!(e.byte_offset, 3000 & !7);
        assert_ne!(e.expected, e.found);
        assert!(e.to_string().contains("0xbb8"));
    }

    #[test]
    fn neighbouring_blocks_differ() {
        let p = Pattern::new(1);
        let mut a = vec![0u8; 512];
        let mut b = vec![0u8; 512];
        p.fill(0, &mut a);
        p.fill(512, &mut b);
        assert!(a.chunks(8).zip(b.chunks(8)).all(|(x, y)| x != y));
    }
}
