//! The seeded data pattern used to prove that blocks landed where they belong.
//!
//! Namespace byte `o` holds byte `o % 8` (little-endian) of [`pattern_word`]`(seed, o & !7)`:
//! every aligned 8-byte word of a namespace is a hash of the seed and the word's namespace byte
//! offset. A block read from the wrong LBA, a block landed at the wrong destination offset, a
//! shifted or torn copy all show up as mismatches. `common.cuh` holds the identical CUDA
//! definition; the GPU tests compare both sides.

/// Weyl constant (2^64 / golden ratio) used to spread offsets.
pub const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;
const MIX1: u64 = 0xBF58_476D_1CE4_E5B9;
const MIX2: u64 = 0x94D0_49BB_1331_11EB;

/// 64-bit finaliser (the splitmix64 output function); a bijection on `u64`.
pub const fn fmix64(mut z: u64) -> u64 {
    z ^= z >> 30;
    z = z.wrapping_mul(MIX1);
    z ^= z >> 27;
    z = z.wrapping_mul(MIX2);
    z ^ (z >> 31)
}

/// The pattern word for the 8 namespace bytes starting at `word_offset & !7`.
pub const fn pattern_word(seed: u64, word_offset: u64) -> u64 {
    fmix64(seed ^ fmix64((word_offset & !7) ^ GOLDEN))
}

/// The pattern byte at namespace byte offset `ns_offset`.
pub const fn pattern_byte(seed: u64, ns_offset: u64) -> u8 {
    (pattern_word(seed, ns_offset) >> ((ns_offset & 7) * 8)) as u8
}

/// Fills `buf` with the pattern of the namespace bytes starting at `ns_offset` (any offset).
pub fn fill_pattern(seed: u64, ns_offset: u64, buf: &mut [u8]) {
    let mut pos = 0usize;
    let mut ns = ns_offset;
    while pos < buf.len() {
        let word = pattern_word(seed, ns).to_le_bytes();
        let skip = (ns & 7) as usize;
        let take = (8 - skip).min(buf.len() - pos);
        buf[pos..pos + take].copy_from_slice(&word[skip..skip + take]);
        pos += take;
        ns = ns.wrapping_add(take as u64);
    }
}

/// A new vector of `len` pattern bytes starting at namespace offset `ns_offset`.
pub fn pattern_vec(seed: u64, ns_offset: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fill_pattern(seed, ns_offset, &mut v);
    v
}

/// Outcome of a pattern check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct VerifyReport {
    /// Number of bytes that differ from the pattern.
    pub mismatched_bytes: u64,
    /// Offset (relative to the checked buffer) of the first differing byte.
    pub first_mismatch: Option<u64>,
}

impl VerifyReport {
    /// True when every byte matched.
    pub fn is_ok(&self) -> bool {
        self.mismatched_bytes == 0
    }

    /// Combines two reports over disjoint parts of the same buffer.
    pub fn merge(self, other: VerifyReport) -> VerifyReport {
        VerifyReport {
            mismatched_bytes: self.mismatched_bytes + other.mismatched_bytes,
            first_mismatch: match (self.first_mismatch, other.first_mismatch) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            },
        }
    }
}

/// Checks that `buf` holds the pattern of the namespace bytes starting at `ns_offset`.
pub fn verify_pattern(seed: u64, ns_offset: u64, buf: &[u8]) -> VerifyReport {
    let mut report = VerifyReport::default();
    let mut pos = 0usize;
    let mut ns = ns_offset;
    while pos < buf.len() {
        let word = pattern_word(seed, ns).to_le_bytes();
        let skip = (ns & 7) as usize;
        let take = (8 - skip).min(buf.len() - pos);
        for (k, (&got, &want)) in buf[pos..pos + take]
            .iter()
            .zip(&word[skip..skip + take])
            .enumerate()
        {
            if got != want {
                report.mismatched_bytes += 1;
                if report.first_mismatch.is_none() {
                    report.first_mismatch = Some((pos + k) as u64);
                }
            }
        }
        pos += take;
        ns = ns.wrapping_add(take as u64);
    }
    report
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn known_values_are_pinned() {
        // These values pin the definition shared with common.cuh; changing them breaks data
        // written by earlier versions and the CUDA mirror.
        assert_eq!(fmix64(0), 0);
        assert_eq!(fmix64(1), 0x5692_161D_100B_05E5);
        assert_eq!(pattern_word(0, 0), fmix64(fmix64(GOLDEN)));
        assert_eq!(pattern_word(7, 13), pattern_word(7, 8));
        assert_ne!(pattern_word(7, 8), pattern_word(7, 16));
        assert_ne!(pattern_word(7, 8), pattern_word(8, 8));
    }

    #[test]
    fn bytes_are_little_endian_words() {
        let seed = 0x1234_5678;
        let w = pattern_word(seed, 4096).to_le_bytes();
        for (k, &b) in w.iter().enumerate() {
            assert_eq!(pattern_byte(seed, 4096 + k as u64), b);
        }
    }

    #[test]
    fn fill_then_verify_at_unaligned_offsets() {
        for ns in [0u64, 1, 7, 8, 511, 4093] {
            for len in [0usize, 1, 7, 8, 9, 100, 4096] {
                let v = pattern_vec(42, ns, len);
                assert!(verify_pattern(42, ns, &v).is_ok(), "ns {ns} len {len}");
                for (i, &b) in v.iter().enumerate() {
                    assert_eq!(b, pattern_byte(42, ns + i as u64));
                }
            }
        }
    }

    #[test]
    fn verify_reports_count_and_first_offset() {
        let mut v = pattern_vec(9, 100, 1000);
        v[37] ^= 0xFF;
        v[500] = v[500].wrapping_add(1);
        v[999] ^= 1;
        let r = verify_pattern(9, 100, &v);
        assert_eq!(r.mismatched_bytes, 3);
        assert_eq!(r.first_mismatch, Some(37));
        // A shifted copy (data from the neighbouring offset) is caught.
        let shifted = pattern_vec(9, 101, 1000);
        assert!(!verify_pattern(9, 100, &shifted).is_ok());
        // Another seed is caught.
        assert!(!verify_pattern(10, 100, &pattern_vec(9, 100, 64)).is_ok());
    }

    #[test]
    fn merge_reports() {
        let a = VerifyReport {
            mismatched_bytes: 2,
            first_mismatch: Some(10),
        };
        let b = VerifyReport {
            mismatched_bytes: 1,
            first_mismatch: Some(4),
        };
        assert_eq!(
            a.merge(b),
            VerifyReport {
                mismatched_bytes: 3,
                first_mismatch: Some(4)
            }
        );
        assert_eq!(a.merge(VerifyReport::default()), a);
    }

    proptest! {
        #[test]
        fn pattern_is_position_dependent(seed in any::<u64>(), ns in 0u64..1 << 40, len in 1usize..300) {
            let v = pattern_vec(seed, ns, len);
            prop_assert!(verify_pattern(seed, ns, &v).is_ok());
            // Any sub-range is the pattern at its own offset.
            let mid = len / 2;
            prop_assert!(verify_pattern(seed, ns + mid as u64, &v[mid..]).is_ok());
        }

        #[test]
        fn single_byte_corruption_is_located(seed in any::<u64>(), ns in 0u64..1 << 40, len in 1usize..300, at in any::<prop::sample::Index>(), flip in 1u8..=255) {
            let mut v = pattern_vec(seed, ns, len);
            let i = at.index(len);
            v[i] ^= flip;
            let r = verify_pattern(seed, ns, &v);
            prop_assert_eq!(r.mismatched_bytes, 1);
            prop_assert_eq!(r.first_mismatch, Some(i as u64));
        }
    }
}
