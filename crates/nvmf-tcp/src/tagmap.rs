//! A small map keyed by 16-bit tags (command identifiers, transfer tags).
//!
//! `std`'s `HashMap` with a multiplicative hasher instead of SipHash: tags are chosen by the
//! local side or validated before lookup, so flooding is not a concern, and lookups sit on
//! the per-PDU path. Capacity is reserved up front; removing and re-inserting entries within
//! that capacity does not allocate.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Hasher for `u16` keys: Fibonacci hashing of the key.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct TagHasher(u64);

impl Hasher for TagHasher {
    fn finish(&self) -> u64 {
        self.0.wrapping_mul(0x9E37_79B9_7F4A_7C15)
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | u64::from(b);
        }
    }

    fn write_u16(&mut self, value: u16) {
        self.0 = u64::from(value);
    }
}

/// Map from a 16-bit tag to per-tag state.
pub(crate) type TagMap<V> = HashMap<u16, V, BuildHasherDefault<TagHasher>>;

/// A tag map with room for `capacity` entries.
pub(crate) fn tag_map<V>(capacity: usize) -> TagMap<V> {
    HashMap::with_capacity_and_hasher(capacity, BuildHasherDefault::default())
}
