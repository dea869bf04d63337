//! Key material that never shows itself: [`Secret`] redacts its `Debug` output and is zeroed
//! when dropped.

use std::fmt;

use zeroize::Zeroizing;

/// Bytes of key material (a key, a transformed key, a DH private value or shared secret, a
/// PSK). `Debug` prints only the length; the bytes are zeroed on drop.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(Zeroizing<Vec<u8>>);

impl Secret {
    /// Wraps key material.
    pub fn new(bytes: Vec<u8>) -> Self {
        Self(Zeroizing::new(bytes))
    }

    /// The key bytes. Callers must not log them.
    pub fn expose(&self) -> &[u8] {
        &self.0
    }

    /// The key bytes, to fill in place.
    pub(crate) fn expose_mut(&mut self) -> &mut [u8] {
        &mut self.0
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether the secret is empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl From<&[u8]> for Secret {
    fn from(b: &[u8]) -> Self {
        Self::new(b.to_vec())
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secret([redacted; {} bytes])", self.0.len())
    }
}

/// Compares two byte strings in time independent of where they differ.
pub(crate) fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_is_redacted() {
        let s = Secret::new(vec![0x41; 32]);
        let shown = format!("{s:?} {:?}", Some(&s));
        assert!(!shown.contains("65") && !shown.contains("41") && !shown.contains('A'));
        assert!(shown.contains("32 bytes"));
    }

    #[test]
    fn constant_time_compare() {
        assert!(ct_eq(b"abc", b"abc"));
        assert!(!ct_eq(b"abc", b"abd"));
        assert!(!ct_eq(b"abc", b"ab"));
    }
}
