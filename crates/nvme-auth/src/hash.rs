//! HMAC, digests and HKDF over the DH-HMAC-CHAP hash functions.

use hkdf::Hkdf;
use hmac::{Hmac, Mac};
use nvme_spec::auth::HashId;
use sha2::{Digest, Sha256, Sha384, Sha512};

use crate::Secret;

fn mac_parts<M: Mac + hmac::digest::KeyInit>(key: &[u8], parts: &[&[u8]]) -> Vec<u8> {
    // HMAC takes keys of any length (longer ones are hashed), so this cannot fail.
    let Ok(mut m) = <M as hmac::digest::KeyInit>::new_from_slice(key) else {
        unreachable!("HMAC accepts keys of every length")
    };
    for p in parts {
        m.update(p);
    }
    m.finalize().into_bytes().to_vec()
}

/// HMAC-`hash`(`key`, concatenation of `parts`).
pub fn hmac(hash: HashId, key: &[u8], parts: &[&[u8]]) -> Vec<u8> {
    match hash {
        HashId::Sha256 => mac_parts::<Hmac<Sha256>>(key, parts),
        HashId::Sha384 => mac_parts::<Hmac<Sha384>>(key, parts),
        HashId::Sha512 => mac_parts::<Hmac<Sha512>>(key, parts),
    }
}

/// `hash`(`data`).
pub fn digest(hash: HashId, data: &[u8]) -> Vec<u8> {
    match hash {
        HashId::Sha256 => Sha256::digest(data).to_vec(),
        HashId::Sha384 => Sha384::digest(data).to_vec(),
        HashId::Sha512 => Sha512::digest(data).to_vec(),
    }
}

/// HKDF-Extract with the all-zero salt (RFC 5869's default) followed by HKDF-Expand of `len`
/// bytes with `info` (the concatenation of `info_parts`). `len` is at most one digest here.
pub(crate) fn hkdf(hash: HashId, ikm: &[u8], info_parts: &[&[u8]], len: usize) -> Secret {
    let mut okm = Secret::new(vec![0u8; len]);
    let out = okm.expose_mut();
    let res = match hash {
        HashId::Sha256 => Hkdf::<Sha256>::new(None, ikm).expand_multi_info(info_parts, out),
        HashId::Sha384 => Hkdf::<Sha384>::new(None, ikm).expand_multi_info(info_parts, out),
        HashId::Sha512 => Hkdf::<Sha512>::new(None, ikm).expand_multi_info(info_parts, out),
    };
    // HKDF-Expand refuses only outputs longer than 255 digests.
    if res.is_err() {
        unreachable!("HKDF output of {len} bytes is within 255 digests");
    }
    okm
}
