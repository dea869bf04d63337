//! Errors of the NVMe/TCP engine.

use nvme_spec::tcp::FatalErrorStatus;

/// A fatal NVMe/TCP protocol error detected in received bytes.
///
/// The connection is finished: when [`term_req_queued`](Self::term_req_queued) is set, a
/// TermReq PDU carrying `fes`, `fei` and the offending PDU header has been queued in the send
/// buffer; the caller flushes the send buffer and closes the socket. When it is not set (the
/// peer's own TermReq was malformed, which the specification answers with an immediate close),
/// the caller closes at once.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("NVMe/TCP fatal protocol error: {reason} (FES {fes:?}, FEI {fei:#x})")]
pub struct ProtocolError {
    /// Fatal Error Status sent in the TermReq.
    pub fes: FatalErrorStatus,
    /// Fatal Error Information sent in the TermReq (field offset, received digest, or 0).
    pub fei: u32,
    /// What was wrong, for logs.
    pub reason: &'static str,
    /// Whether a TermReq was queued in the send buffer.
    pub term_req_queued: bool,
}

/// A local request that the engine refused; nothing was queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SendError {
    /// The ICReq/ICResp exchange has not completed yet.
    #[error("the NVMe/TCP connection is not established yet")]
    NotEstablished,
    /// The connection failed or was terminated; nothing more may be sent.
    #[error("the NVMe/TCP connection is closed")]
    Closed,
    /// A data PDU or R2T must transfer at least one byte.
    #[error("a data transfer must not be empty")]
    EmptyData,
    /// The transfer does not fit the 32-bit offsets and lengths of the protocol.
    #[error("the transfer is too large for NVMe/TCP offsets and lengths")]
    TooLarge,
    /// SUCCESS may only be set on the last C2HData PDU of a command.
    #[error("SUCCESS requires the last C2HData PDU of the command")]
    SuccessWithoutLast,
    /// The transfer tag already has an outstanding R2T.
    #[error("transfer tag {0} already has an outstanding R2T")]
    TagInUse(u16),
    /// The command already has as many outstanding R2Ts as the host allows (MAXR2T).
    #[error("command {0} already has the maximum number of outstanding R2Ts")]
    R2tLimit(u16),
    /// The command identifier is already in use by an outstanding command.
    #[error("command identifier {0} is already outstanding")]
    CommandIdInUse(u16),
    /// No outstanding R2T has this command identifier and transfer tag.
    #[error("no outstanding R2T for command {cccid} with transfer tag {ttag}")]
    NoMatchingR2t {
        /// Command identifier given.
        cccid: u16,
        /// Transfer tag given.
        ttag: u16,
    },
    /// The data does not continue the transfer where the previous data ended.
    #[error("data offset {datao} does not continue the transfer at offset {expected}")]
    OutOfOrder {
        /// Offset given.
        datao: u32,
        /// Offset the transfer is at.
        expected: u32,
    },
    /// The data goes past the range the R2T asked for.
    #[error("data goes past the range requested by the R2T")]
    OutOfRange,
    /// `last` must be set exactly when the data ends the R2T range.
    #[error("the last flag does not match the end of the R2T range")]
    LastMismatch,
}

/// An engine configuration that the protocol does not allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// MAXH2CDATA must be at least 4096 and a multiple of 4.
    #[error("maxh2cdata {0} must be at least 4096 and a multiple of 4")]
    MaxH2cData(u32),
    /// The largest C2HData PDU must carry at least one byte.
    #[error("max_c2h_data must not be 0")]
    MaxC2hData,
}

/// Internal description of a violation before it becomes a [`ProtocolError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Violation {
    pub fes: FatalErrorStatus,
    pub fei: u32,
    pub reason: &'static str,
    /// False when the specification requires closing without a TermReq.
    pub reply: bool,
}

impl Violation {
    pub fn new(fes: FatalErrorStatus, fei: u32, reason: &'static str) -> Self {
        Self {
            fes,
            fei,
            reason,
            reply: true,
        }
    }

    /// Invalid PDU Header Field at byte offset `fei`.
    pub fn field(fei: u32, reason: &'static str) -> Self {
        Self::new(FatalErrorStatus::InvalidPduHeaderField, fei, reason)
    }

    /// PDU Sequence Error.
    pub fn sequence(reason: &'static str) -> Self {
        Self::new(FatalErrorStatus::PduSequenceError, 0, reason)
    }

    /// Unsupported Parameter at byte offset `fei`.
    pub fn unsupported(fei: u32, reason: &'static str) -> Self {
        Self::new(FatalErrorStatus::UnsupportedParameter, fei, reason)
    }

    /// Data Transfer Out of Range.
    pub fn out_of_range(reason: &'static str) -> Self {
        Self::new(FatalErrorStatus::DataTransferOutOfRange, 0, reason)
    }

    /// Data Transfer Limit Exceeded (R2T Limit Exceeded on the host side).
    pub fn limit(reason: &'static str) -> Self {
        Self::new(FatalErrorStatus::DataTransferLimitExceeded, 0, reason)
    }

    /// A malformed TermReq: close without answering.
    pub fn silent(fei: u32, reason: &'static str) -> Self {
        Self {
            reply: false,
            ..Self::field(fei, reason)
        }
    }

    pub fn into_error(self, term_req_queued: bool) -> ProtocolError {
        ProtocolError {
            fes: self.fes,
            fei: self.fei,
            reason: self.reason,
            term_req_queued,
        }
    }
}
