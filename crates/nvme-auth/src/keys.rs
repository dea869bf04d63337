//! The DHHC-1 secret representation (`DHHC-1:XX:<base64(key || crc32)>:`) and the host and
//! controller key transformation (NVMe Base 2.0 section 8.13.5).

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use nvme_spec::auth::HashId;
use rand_core::CryptoRng;
use thiserror::Error;

use crate::{Secret, hash};

/// Why a DHHC-1 or TLS PSK interchange string was rejected.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum KeyError {
    /// The string does not have the `PREFIX:XX:<base64>:` shape.
    #[error("key is not in the {0} format")]
    Format(&'static str),
    /// The transformation/hash field is not a known value.
    #[error("unknown key hash {0:?}")]
    Hash(String),
    /// The base64 part does not decode.
    #[error("key is not valid base64")]
    Base64,
    /// The decoded key has a length the format does not allow.
    #[error("key length {0} bytes is not allowed here")]
    Length(usize),
    /// The CRC-32 after the key does not match it.
    #[error("key CRC-32 mismatch (stored {stored:08x}, computed {computed:08x})")]
    Crc {
        /// The CRC carried by the string.
        stored: u32,
        /// The CRC of the key bytes.
        computed: u32,
    },
}

/// Decodes `<base64(key || le32 crc32(key))>`, checking the CRC and that the key length is in
/// `lens`.
pub(crate) fn decode_with_crc(b64: &str, lens: &[usize]) -> Result<Secret, KeyError> {
    let raw = Secret::new(STANDARD.decode(b64).map_err(|_| KeyError::Base64)?);
    let n = raw
        .len()
        .checked_sub(4)
        .ok_or(KeyError::Length(raw.len()))?;
    if !lens.contains(&n) {
        return Err(KeyError::Length(n));
    }
    let (key, crc) = raw.expose().split_at(n);
    let stored = u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]]);
    let computed = crc32fast::hash(key);
    if stored != computed {
        return Err(KeyError::Crc { stored, computed });
    }
    Ok(Secret::from(key))
}

/// Encodes `<base64(key || le32 crc32(key))>`.
pub(crate) fn encode_with_crc(key: &[u8]) -> String {
    let mut raw = zeroize::Zeroizing::new(Vec::with_capacity(key.len() + 4));
    raw.extend_from_slice(key);
    raw.extend_from_slice(&crc32fast::hash(key).to_le_bytes());
    STANDARD.encode(&raw[..])
}

/// Splits `PREFIX:XX:<body>:` (the trailing colon optional) into XX and body.
pub(crate) fn split_fields<'a>(
    s: &'a str,
    prefix: &'static str,
) -> Result<(&'a str, &'a str), KeyError> {
    let rest = s
        .trim()
        .strip_prefix(prefix)
        .ok_or(KeyError::Format(prefix))?;
    let (xx, body) = rest.split_once(':').ok_or(KeyError::Format(prefix))?;
    let body = body.strip_suffix(':').unwrap_or(body);
    if xx.len() != 2 || body.is_empty() || body.contains(':') {
        return Err(KeyError::Format(prefix));
    }
    Ok((xx, body))
}

/// A DH-HMAC-CHAP secret: the key bytes and the hash (if any) that transforms it before use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DhchapKey {
    secret: Secret,
    transform: Option<HashId>,
}

impl DhchapKey {
    /// Key lengths the DHHC-1 representation allows.
    pub const LENGTHS: [usize; 3] = [32, 48, 64];

    /// Builds a key from its bytes (32, 48 or 64 of them).
    pub fn new(secret: Secret, transform: Option<HashId>) -> Result<Self, KeyError> {
        if !Self::LENGTHS.contains(&secret.len()) {
            return Err(KeyError::Length(secret.len()));
        }
        Ok(Self { secret, transform })
    }

    /// A fresh random key of `len` bytes.
    pub fn generate(
        rng: &mut impl CryptoRng,
        len: usize,
        transform: Option<HashId>,
    ) -> Result<Self, KeyError> {
        let mut k = vec![0u8; len];
        rng.fill_bytes(&mut k);
        Self::new(Secret::new(k), transform)
    }

    /// Parses `DHHC-1:XX:<base64>:`, XX being 00 (no transformation), 01 (SHA-256),
    /// 02 (SHA-384) or 03 (SHA-512), as `nvme gen-dhchap-key` writes it.
    pub fn parse(s: &str) -> Result<Self, KeyError> {
        let (xx, b64) = split_fields(s, "DHHC-1:")?;
        let transform = match xx {
            "00" => None,
            _ => Some(
                xx.parse::<u8>()
                    .ok()
                    .and_then(HashId::from_u8)
                    .ok_or_else(|| KeyError::Hash(xx.to_string()))?,
            ),
        };
        let secret = decode_with_crc(b64, &Self::LENGTHS)?;
        Ok(Self { secret, transform })
    }

    /// The DHHC-1 representation. It contains the key: do not log it.
    pub fn to_dhhc1(&self) -> String {
        let xx = self.transform.map_or(0, |h| h as u8);
        format!("DHHC-1:{xx:02}:{}:", encode_with_crc(self.secret.expose()))
    }

    /// The key bytes as the representation carries them (before any transformation).
    pub fn secret(&self) -> &Secret {
        &self.secret
    }

    /// The hash that transforms the key, if any.
    pub fn transform_hash(&self) -> Option<HashId> {
        self.transform
    }

    /// The key transformed for `nqn` (the host NQN for a host key, the subsystem NQN for a
    /// controller key): HMAC-H(key, nqn || "NVMe-over-Fabrics"), or the key itself when it
    /// names no transformation.
    pub fn transformed(&self, nqn: &str) -> Secret {
        match self.transform {
            None => self.secret.clone(),
            Some(h) => Secret::new(hash::hmac(
                h,
                self.secret.expose(),
                &[nqn.as_bytes(), b"NVMe-over-Fabrics"],
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_bad_strings() {
        let good = DhchapKey::new(Secret::new(vec![7; 32]), Some(HashId::Sha256)).unwrap();
        let s = good.to_dhhc1();
        assert_eq!(DhchapKey::parse(&s).unwrap(), good);
        assert_eq!(DhchapKey::parse(s.trim_end_matches(':')).unwrap(), good);
        assert_eq!(
            DhchapKey::parse("DHHC-2:00:AAAA:"),
            Err(KeyError::Format("DHHC-1:"))
        );
        assert_eq!(
            DhchapKey::parse("DHHC-1:0:AAAA:"),
            Err(KeyError::Format("DHHC-1:"))
        );
        assert_eq!(
            DhchapKey::parse("DHHC-1:04:AAAA:"),
            Err(KeyError::Hash("04".into()))
        );
        assert_eq!(DhchapKey::parse("DHHC-1:00:!!!!:"), Err(KeyError::Base64));
        assert_eq!(
            DhchapKey::parse("DHHC-1:00:AAAA:"),
            Err(KeyError::Length(3))
        );
        let mut flipped = s.into_bytes();
        flipped[12] = if flipped[12] == b'A' { b'B' } else { b'A' };
        let flipped = String::from_utf8(flipped).unwrap();
        assert!(matches!(
            DhchapKey::parse(&flipped),
            Err(KeyError::Crc { .. })
        ));
        assert_eq!(
            DhchapKey::new(Secret::new(vec![0; 16]), None),
            Err(KeyError::Length(16))
        );
    }

    #[test]
    fn debug_hides_the_key() {
        let k = DhchapKey::new(Secret::new(vec![0xAB; 32]), None).unwrap();
        let shown = format!("{k:?}");
        assert!(
            !shown.to_lowercase().contains("ab, ") && !shown.contains("171"),
            "{shown}"
        );
    }
}
