//! The DH-HMAC-CHAP computations (NVMe Base 2.0 section 8.13.5), as the Linux host
//! and target perform them.

use nvme_spec::auth::HashId;

use crate::hash;

/// Response R1 of the host: HMAC-H(Kh', Ca1 || le32 S1 || le16 T_ID || SC_C || "HostHost" ||
/// NQNh || 0x00 || NQNc), Kh' being the transformed host key and Ca1 the (augmented) challenge.
#[allow(clippy::too_many_arguments)]
pub fn host_response(
    hash: HashId,
    transformed_host_key: &[u8],
    challenge: &[u8],
    seqnum: u32,
    t_id: u16,
    sc_c: u8,
    hostnqn: &str,
    subnqn: &str,
) -> Vec<u8> {
    hash::hmac(
        hash,
        transformed_host_key,
        &[
            challenge,
            &seqnum.to_le_bytes(),
            &t_id.to_le_bytes(),
            &[sc_c],
            b"HostHost",
            hostnqn.as_bytes(),
            &[0],
            subnqn.as_bytes(),
        ],
    )
}

/// Response R2 of the controller: HMAC-H(Kc', Ca2 || le32 S2 || le16 T_ID || 0x00 ||
/// "Controller" || NQNc || 0x00 || NQNh), Kc' being the transformed controller key.
pub fn ctrl_response(
    hash: HashId,
    transformed_ctrl_key: &[u8],
    challenge: &[u8],
    seqnum: u32,
    t_id: u16,
    hostnqn: &str,
    subnqn: &str,
) -> Vec<u8> {
    hash::hmac(
        hash,
        transformed_ctrl_key,
        &[
            challenge,
            &seqnum.to_le_bytes(),
            &t_id.to_le_bytes(),
            &[0],
            b"Controller",
            subnqn.as_bytes(),
            &[0],
            hostnqn.as_bytes(),
        ],
    )
}

/// The augmented challenge of a DH exchange: HMAC-H(H(g^xy mod p), C).
pub fn augmented_challenge(hash: HashId, shared_secret: &[u8], challenge: &[u8]) -> Vec<u8> {
    let hashed = crate::Secret::new(hash::digest(hash, shared_secret));
    hash::hmac(hash, hashed.expose(), &[challenge])
}
