//! CRC32C header and data digests (NVMe TCP Transport Specification 1.0, section 3.3.1.1).
//!
//! The digest is the standard CRC32C (Castagnoli) of the protected bytes, stored on the wire
//! little-endian. The `crc32c` crate uses the SSE4.2 / ARMv8 CRC instructions when present.

use nvme_spec::tcp::DIGEST_LEN;

/// CRC32C of `bytes`.
#[inline]
pub fn crc32c(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
}

/// The 4 wire bytes of the digest of `bytes` (header digest over a header, or data digest
/// over PDU data).
#[inline]
pub fn digest_bytes(bytes: &[u8]) -> [u8; DIGEST_LEN] {
    crc32c(bytes).to_le_bytes()
}

/// Reads a digest value from its 4 wire bytes.
#[inline]
pub(crate) fn read_digest(bytes: &[u8]) -> u32 {
    let mut raw = [0u8; DIGEST_LEN];
    let n = bytes.len().min(DIGEST_LEN);
    raw[..n].copy_from_slice(&bytes[..n]);
    u32::from_le_bytes(raw)
}

/// Incremental data digest, for PDU data that is produced or consumed in pieces
/// (for example a payload gathered from several buffers, or data received in chunks).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DataDigest {
    crc: u32,
}

impl DataDigest {
    /// A digest over no bytes yet.
    pub const fn new() -> Self {
        Self { crc: 0 }
    }

    /// Adds `bytes` to the digest.
    #[inline]
    pub fn update(&mut self, bytes: &[u8]) {
        self.crc = crc32c::crc32c_append(self.crc, bytes);
    }

    /// The digest value so far.
    pub fn value(&self) -> u32 {
        self.crc
    }

    /// The 4 wire bytes of the digest so far.
    pub fn to_bytes(&self) -> [u8; DIGEST_LEN] {
        self.crc.to_le_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_vector() {
        // The CRC32C check value from RFC 3720 / the Castagnoli polynomial catalogue.
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(digest_bytes(b"123456789"), [0x83, 0x92, 0x06, 0xE3]);
        assert_eq!(read_digest(&[0x83, 0x92, 0x06, 0xE3]), 0xE306_9283);
    }

    #[test]
    fn incremental_matches_one_shot() {
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
        let mut d = DataDigest::new();
        for chunk in data.chunks(37) {
            d.update(chunk);
        }
        assert_eq!(d.value(), crc32c(&data));
        assert_eq!(d.to_bytes(), digest_bytes(&data));
    }
}
