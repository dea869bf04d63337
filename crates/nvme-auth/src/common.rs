//! Steps shared by the host and controller state machines.

use nvme_spec::auth::{
    AuthMessage, DhGroupId, FAILURE_REASON_AUTH_FAILED, FailureExplanation as Fx, HashId,
};
use rand_core::CryptoRng;

use crate::dh::DhKeyPair;
use crate::error::{Fail, ours};
use crate::{Secret, dhchap};

/// Parses a received message, turning the peer's failure message into [`Fail::Theirs`] and
/// checking the transaction ID (`None`: not known yet).
pub(crate) fn receive(raw: &[u8], t_id: Option<u16>) -> Result<AuthMessage, Fail> {
    let Ok(msg) = AuthMessage::parse(raw) else {
        return ours(Fx::IncorrectPayload, "malformed authentication message");
    };
    match msg {
        AuthMessage::Failure1 { explanation, .. } | AuthMessage::Failure2 { explanation, .. } => {
            Err(Fail::Theirs(explanation))
        }
        AuthMessage::Negotiate { .. } => Ok(msg),
        _ if t_id.is_some_and(|t| t != msg.t_id()) => {
            ours(Fx::IncorrectPayload, "transaction ID mismatch")
        }
        _ => Ok(msg),
    }
}

/// The failure message for `t_id`.
pub(crate) fn failure(controller: bool, t_id: u16, explanation: Fx) -> Vec<u8> {
    let (reason, explanation) = (FAILURE_REASON_AUTH_FAILED, explanation as u8);
    if controller {
        AuthMessage::Failure1 {
            t_id,
            reason,
            explanation,
        }
        .encode()
    } else {
        AuthMessage::Failure2 {
            t_id,
            reason,
            explanation,
        }
        .encode()
    }
}

/// A random challenge of the hash's length.
pub(crate) fn challenge(hash: HashId, rng: &mut impl CryptoRng) -> Vec<u8> {
    let mut c = vec![0u8; hash.digest_len()];
    rng.fill_bytes(&mut c);
    c
}

/// A random non-zero sequence number.
pub(crate) fn seqnum(rng: &mut impl CryptoRng) -> u32 {
    rng.next_u32().max(1)
}

/// The session key of a DH exchange with the peer's value `peer` (`None` for the null group,
/// which must carry no value).
pub(crate) fn session_key(
    group: DhGroupId,
    own: Option<&DhKeyPair>,
    peer: &[u8],
) -> Result<Option<Secret>, Fail> {
    match own {
        None if peer.is_empty() => Ok(None),
        None => ours(Fx::IncorrectPayload, "DH value sent with the null DH group"),
        Some(kp) => match kp.shared_secret(peer) {
            Ok(s) => Ok(Some(s)),
            Err(_) if peer.len() != group.value_len() => {
                ours(Fx::IncorrectPayload, "DH value has the wrong size")
            }
            Err(_) => ours(Fx::IncorrectPayload, "DH value out of range"),
        },
    }
}

/// The challenge as the response covers it: augmented with the session key when there is one.
pub(crate) fn augment(hash: HashId, session: Option<&Secret>, c: &[u8]) -> Vec<u8> {
    session.map_or_else(
        || c.to_vec(),
        |s| dhchap::augmented_challenge(hash, s.expose(), c),
    )
}

/// A fresh key pair for `group` (`None` for the null group).
pub(crate) fn key_pair(
    group: DhGroupId,
    rng: &mut impl CryptoRng,
) -> Result<Option<DhKeyPair>, Fail> {
    if group == DhGroupId::Null {
        return Ok(None);
    }
    DhKeyPair::generate(group, rng)
        .map(Some)
        .or_else(|_| ours(Fx::DhGroupUnusable, "DH group has no prime"))
}
