//! Outcomes and errors of an authentication transaction.

use nvme_spec::auth::{DhGroupId, FailureExplanation, HashId};
use thiserror::Error;

/// What a successful DH-HMAC-CHAP transaction agreed on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Outcome {
    /// Hash function used.
    pub hash: HashId,
    /// DH group used.
    pub dh_group: DhGroupId,
    /// Whether the controller authenticated itself to the host too.
    pub bidirectional: bool,
}

/// Why an authentication transaction failed.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum AuthError {
    /// This side found the problem and sent (or queued) a Failure1/Failure2 message with this
    /// explanation.
    #[error("{}: {detail}", explanation.describe())]
    Sent {
        /// The reason code explanation sent to the peer.
        explanation: FailureExplanation,
        /// What was wrong, for logs.
        detail: &'static str,
    },
    /// The peer ended the transaction with a Failure1/Failure2 message.
    #[error("peer reported failure: {}", describe_raw(*explanation))]
    Received {
        /// The reason code explanation received (raw value).
        explanation: u8,
    },
}

impl AuthError {
    /// The explanation carried on the wire, in either direction.
    pub fn explanation(&self) -> u8 {
        match self {
            AuthError::Sent { explanation, .. } => *explanation as u8,
            AuthError::Received { explanation } => *explanation,
        }
    }
}

fn describe_raw(v: u8) -> String {
    FailureExplanation::from_u8(v).map_or_else(
        || format!("reason code explanation {v:#04x}"),
        |e| e.describe().to_string(),
    )
}

/// A failure found while handling one message.
pub(crate) enum Fail {
    /// Ours to report to the peer with a failure message.
    Ours(FailureExplanation, &'static str),
    /// The peer's failure message.
    Theirs(u8),
}

impl Fail {
    pub(crate) fn into_error(self) -> AuthError {
        match self {
            Fail::Ours(explanation, detail) => AuthError::Sent {
                explanation,
                detail,
            },
            Fail::Theirs(explanation) => AuthError::Received { explanation },
        }
    }
}

/// Shorthand for `Err(Fail::Ours(..))`.
pub(crate) fn ours<T>(e: FailureExplanation, detail: &'static str) -> Result<T, Fail> {
    Err(Fail::Ours(e, detail))
}
