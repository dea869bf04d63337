//! NVMe/TCP TLS pre-shared keys (NVMe/TCP Transport 1.0 section 3.6.1): the PSK interchange
//! format `NVMeTLSkey-1:XX:<base64(psk || crc32)>:`, the retained PSK, the PSK digest, the
//! TLS PSK and the PSK identities of versions 0 and 1.
//!
//! The HKDF info strings are encoded as libnvme (and so `nvme-cli` and the Linux hosts that
//! load its keys) encodes them: the output length as two little-endian bytes, then "tls13 ",
//! the label and the context, with no length prefixes on the label and context. A TLS PSK
//! derived here is the one `nvme gen-tls-key`/`nvme check-tls-key` insert into the kernel
//! keyring for the same configured key and NQNs.

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use nvme_spec::auth::HashId;

use crate::keys::{KeyError, decode_with_crc, encode_with_crc, split_fields};
use crate::{Secret, hash};

/// A configured PSK, as the interchange format carries it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfiguredPsk {
    psk: Secret,
    hash: Option<HashId>,
}

/// The identity and key that TLS uses for one host/subsystem pair.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsPsk {
    /// PSK identity (`NVMe0R0X <hostnqn> <subnqn>` or `NVMe1R0X <hostnqn> <subnqn> <digest>`).
    pub identity: String,
    /// The TLS PSK.
    pub key: Secret,
}

impl ConfiguredPsk {
    /// Builds a configured PSK: 32 or 48 bytes; with a hash (SHA-256 for 32 bytes, SHA-384
    /// for 48) the retained PSK is derived with it, without one the PSK is used as is.
    pub fn new(psk: Secret, hash: Option<HashId>) -> Result<Self, KeyError> {
        let ok = match hash {
            None => psk.len() == 32 || psk.len() == 48,
            Some(h @ (HashId::Sha256 | HashId::Sha384)) => psk.len() == h.digest_len(),
            Some(HashId::Sha512) => return Err(KeyError::Hash("03".into())),
        };
        if !ok {
            return Err(KeyError::Length(psk.len()));
        }
        Ok(Self { psk, hash })
    }

    /// Parses `NVMeTLSkey-1:XX:<base64>:` (XX = 00, 01 or 02).
    pub fn parse(s: &str) -> Result<Self, KeyError> {
        let (xx, b64) = split_fields(s, "NVMeTLSkey-1:")?;
        let hash = match xx {
            "00" => None,
            "01" => Some(HashId::Sha256),
            "02" => Some(HashId::Sha384),
            _ => return Err(KeyError::Hash(xx.to_string())),
        };
        let psk = decode_with_crc(b64, &[32, 48])?;
        Self::new(psk, hash)
    }

    /// The interchange representation. It contains the key: do not log it.
    pub fn to_interchange(&self) -> String {
        let xx = self.hash.map_or(0, |h| h as u8);
        format!(
            "NVMeTLSkey-1:{xx:02x}:{}:",
            encode_with_crc(self.psk.expose())
        )
    }

    /// The hash of the TLS cipher suite this key goes with: the configured hash, or by the
    /// key length when there is none (32 bytes: SHA-256, 48: SHA-384).
    pub fn cipher_hash(&self) -> HashId {
        self.hash.unwrap_or(if self.psk.len() == 48 {
            HashId::Sha384
        } else {
            HashId::Sha256
        })
    }

    /// The retained PSK for `hostnqn`: HKDF-Expand-Label(HKDF-Extract(0, configured PSK),
    /// "HostNQN", NQNh, length) with the configured hash, or the configured PSK itself when
    /// it names no hash.
    pub fn retained(&self, hostnqn: &str) -> Secret {
        match self.hash {
            None => self.psk.clone(),
            Some(h) => expand(h, &self.psk, b"HostNQN", &[hostnqn.as_bytes()]),
        }
    }

    /// The TLS PSK and identity of `version` (0, or 1 with the PSK digest) for the pair.
    pub fn tls_psk(&self, version: u8, hostnqn: &str, subnqn: &str) -> Option<TlsPsk> {
        let h = self.cipher_hash();
        let retained = self.retained(hostnqn);
        let hh = format!("{:02}", h as u8);
        let (identity, key) = match version {
            0 => {
                let identity = format!("NVMe0R{hh} {hostnqn} {subnqn}");
                let key = expand(h, &retained, b"nvme-tls-psk", &[identity.as_bytes()]);
                (identity, key)
            }
            1 => {
                let digest = psk_digest(h, &retained, hostnqn, subnqn);
                let ctx = format!("{hh} ");
                let key = expand(
                    h,
                    &retained,
                    b"nvme-tls-psk",
                    &[ctx.as_bytes(), digest.as_bytes()],
                );
                (format!("NVMe1R{hh} {hostnqn} {subnqn} {digest}"), key)
            }
            _ => return None,
        };
        Some(TlsPsk { identity, key })
    }
}

/// A PSK identity as a host presents it in its TLS ClientHello, split into its fields.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PskIdentity {
    /// Identity version: 0 (`NVMe0R..`) or 1 (`NVMe1R..`, with the PSK digest).
    pub version: u8,
    /// The hash of the PSK (01: SHA-256, 02: SHA-384).
    pub hash: HashId,
    /// The host NQN.
    pub hostnqn: String,
    /// The subsystem NQN.
    pub subnqn: String,
}

impl PskIdentity {
    /// Parses `NVMe<v>R<hh> <hostnqn> <subnqn>[ <digest>]` for a retained PSK; `None` for
    /// anything else (other versions, generated PSKs, missing or extra fields).
    pub fn parse(identity: &str) -> Option<Self> {
        let mut fields = identity.split(' ');
        let prefix = fields.next()?.strip_prefix("NVMe")?;
        let (version, hh) = match prefix.split_once('R')? {
            ("0", hh) => (0, hh),
            ("1", hh) => (1, hh),
            _ => return None,
        };
        let hash = match hh {
            "01" => HashId::Sha256,
            "02" => HashId::Sha384,
            _ => return None,
        };
        let hostnqn = fields.next().filter(|f| !f.is_empty())?.to_string();
        let subnqn = fields.next().filter(|f| !f.is_empty())?.to_string();
        let digest = fields.next();
        if (version == 1) != digest.is_some() || fields.next().is_some() {
            return None;
        }
        Some(Self {
            version,
            hash,
            hostnqn,
            subnqn,
        })
    }
}

/// The PSK digest of identity version 1: base64(HMAC-H(PSK, NQNh || " " || NQNc || " " ||
/// "NVMe-over-Fabrics")).
pub fn psk_digest(hash: HashId, psk: &Secret, hostnqn: &str, subnqn: &str) -> String {
    let mac = hash::hmac(
        hash,
        psk.expose(),
        &[
            hostnqn.as_bytes(),
            b" ",
            subnqn.as_bytes(),
            b" NVMe-over-Fabrics",
        ],
    );
    STANDARD.encode(mac)
}

/// HKDF-Extract(0, ikm) then HKDF-Expand with libnvme's info: le16 length || "tls13 " ||
/// label || context, the output as long as `ikm`.
fn expand(hash: HashId, ikm: &Secret, label: &[u8], context: &[&[u8]]) -> Secret {
    let len = ikm.len() as u16;
    let len_bytes = len.to_le_bytes();
    let mut info: Vec<&[u8]> = vec![&len_bytes, b"tls13 ", label];
    info.extend_from_slice(context);
    hash::hkdf(hash, ikm.expose(), &info, ikm.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interchange_rejects_bad_keys() {
        assert_eq!(
            ConfiguredPsk::parse("NVMeTLSkey-1:03:AAAA:"),
            Err(KeyError::Hash("03".into()))
        );
        assert_eq!(
            ConfiguredPsk::parse("NVMeTLSkey-2:01:AAAA:"),
            Err(KeyError::Format("NVMeTLSkey-1:"))
        );
        let k48 = ConfiguredPsk::new(Secret::new(vec![1; 48]), None)
            .unwrap()
            .to_interchange();
        let as_sha256 = k48.replacen(":00:", ":01:", 1);
        assert_eq!(ConfiguredPsk::parse(&as_sha256), Err(KeyError::Length(48)));
        assert!(ConfiguredPsk::new(Secret::new(vec![1; 32]), Some(HashId::Sha512)).is_err());
        let psk = ConfiguredPsk::new(Secret::new(vec![1; 32]), Some(HashId::Sha256)).unwrap();
        assert!(psk.tls_psk(2, "h", "s").is_none());
        assert!(!format!("{psk:?}").contains("1, 1"));
    }

    #[test]
    fn psk_identities_parse_as_derived() {
        let psk = ConfiguredPsk::new(Secret::new(vec![7; 32]), Some(HashId::Sha256)).unwrap();
        for v in [0, 1] {
            let t = psk.tls_psk(v, "nqn.h", "nqn.s").unwrap();
            let id = PskIdentity::parse(&t.identity).unwrap();
            assert_eq!((id.version, id.hash), (v, HashId::Sha256));
            assert_eq!(
                (id.hostnqn.as_str(), id.subnqn.as_str()),
                ("nqn.h", "nqn.s")
            );
        }
        for bad in [
            "",
            "NVMe0G01 nqn.h nqn.s",
            "NVMe2R01 nqn.h nqn.s",
            "NVMe0R03 nqn.h nqn.s",
            "NVMe0R01 nqn.h",
            "NVMe0R01 nqn.h nqn.s extra",
            "NVMe1R01 nqn.h nqn.s",
            "NVMe0R01  nqn.s",
        ] {
            assert_eq!(PskIdentity::parse(bad), None, "{bad:?}");
        }
    }
}
