//! In-band authentication: the Authentication Receive/Send fabrics commands (NVMe Base 2.0
//! sections 6.1 and 6.2) and the DH-HMAC-CHAP messages they carry (section 8.13.5, the
//! message data figures; the same layouts as Linux's `include/linux/nvme.h`).
//!
//! [`AuthCommand`] reads and writes the command dwords; [`AuthMessage`] parses and encodes
//! the message payloads. Parsing never panics: every length is checked against the buffer and
//! a bad message yields an [`AuthParseError`]. Identifiers (hash, DH group, reason codes) are
//! kept as the raw bytes received so that the protocol layer can answer an unsupported value
//! with the right failure reason; [`HashId`], [`DhGroupId`] and [`FailureExplanation`] give
//! them names.

use thiserror::Error;
use zerocopy::little_endian::{U16, U32};
use zerocopy::{FromBytes, FromZeros, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::opcode::{FABRICS, fctype};
use crate::queue::Sqe;

/// Security protocol (SECP) of NVMe in-band authentication.
pub const SECP_AUTH: u8 = 0xE9;
/// SPSP0 and SPSP1 of the DH-HMAC-CHAP protocol.
pub const SPSP_DHCHAP: u8 = 0x01;
/// AUTH-Type of the messages common to all protocols (Negotiate, Failure1, Failure2).
pub const AUTH_TYPE_COMMON: u8 = 0x00;
/// AUTH-Type of the DH-HMAC-CHAP messages.
pub const AUTH_TYPE_DHCHAP: u8 = 0x01;
/// AUTH ID of the DH-HMAC-CHAP protocol in a Negotiate protocol descriptor.
pub const AUTHID_DHCHAP: u8 = 0x01;
/// The largest number of hash or DH group identifiers in one protocol descriptor.
pub const MAX_IDS: usize = 30;

/// Message identifiers (AUTH ID of the message header).
pub mod msg {
    /// AUTH_Negotiate (common message).
    pub const NEGOTIATE: u8 = 0x00;
    /// DH-HMAC-CHAP_Challenge.
    pub const CHALLENGE: u8 = 0x01;
    /// DH-HMAC-CHAP_Reply.
    pub const REPLY: u8 = 0x02;
    /// DH-HMAC-CHAP_Success1.
    pub const SUCCESS1: u8 = 0x03;
    /// DH-HMAC-CHAP_Success2.
    pub const SUCCESS2: u8 = 0x04;
    /// AUTH_Failure2 (host to controller; common message).
    pub const FAILURE2: u8 = 0xF0;
    /// AUTH_Failure1 (controller to host; common message).
    pub const FAILURE1: u8 = 0xF1;
}

/// Secure channel concatenation (SC_C) values of AUTH_Negotiate.
pub mod sc_c {
    /// No secure channel concatenation.
    pub const NONE: u8 = 0x00;
    /// Concatenate with a new TLS PSK.
    pub const NEW_TLS_PSK: u8 = 0x01;
    /// Replace the TLS PSK.
    pub const REPLACE_TLS_PSK: u8 = 0x02;
}

/// DH-HMAC-CHAP hash function identifiers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum HashId {
    /// SHA-256 (32-byte digests).
    Sha256 = 0x01,
    /// SHA-384 (48-byte digests).
    Sha384 = 0x02,
    /// SHA-512 (64-byte digests).
    Sha512 = 0x03,
}

impl HashId {
    /// All hash functions, strongest last.
    pub const ALL: [HashId; 3] = [HashId::Sha256, HashId::Sha384, HashId::Sha512];

    /// The identifier for a wire value.
    pub fn from_u8(v: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|h| *h as u8 == v)
    }

    /// Digest length in bytes (the HL of the messages).
    pub const fn digest_len(self) -> usize {
        match self {
            HashId::Sha256 => 32,
            HashId::Sha384 => 48,
            HashId::Sha512 => 64,
        }
    }

    /// Name as Linux spells it (`hmac(sha256)` ...).
    pub const fn name(self) -> &'static str {
        match self {
            HashId::Sha256 => "hmac(sha256)",
            HashId::Sha384 => "hmac(sha384)",
            HashId::Sha512 => "hmac(sha512)",
        }
    }
}

/// DH-HMAC-CHAP Diffie-Hellman group identifiers (RFC 7919 finite field groups).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DhGroupId {
    /// No Diffie-Hellman exchange.
    Null = 0x00,
    /// ffdhe2048.
    Ffdhe2048 = 0x01,
    /// ffdhe3072.
    Ffdhe3072 = 0x02,
    /// ffdhe4096.
    Ffdhe4096 = 0x03,
    /// ffdhe6144.
    Ffdhe6144 = 0x04,
    /// ffdhe8192.
    Ffdhe8192 = 0x05,
}

impl DhGroupId {
    /// All groups, the null group first.
    pub const ALL: [DhGroupId; 6] = [
        DhGroupId::Null,
        DhGroupId::Ffdhe2048,
        DhGroupId::Ffdhe3072,
        DhGroupId::Ffdhe4096,
        DhGroupId::Ffdhe6144,
        DhGroupId::Ffdhe8192,
    ];

    /// The identifier for a wire value.
    pub fn from_u8(v: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|g| *g as u8 == v)
    }

    /// Size in bytes of a DH value of this group (0 for the null group).
    pub const fn value_len(self) -> usize {
        match self {
            DhGroupId::Null => 0,
            DhGroupId::Ffdhe2048 => 256,
            DhGroupId::Ffdhe3072 => 384,
            DhGroupId::Ffdhe4096 => 512,
            DhGroupId::Ffdhe6144 => 768,
            DhGroupId::Ffdhe8192 => 1024,
        }
    }

    /// Name as Linux spells it (`null`, `ffdhe2048` ...).
    pub const fn name(self) -> &'static str {
        match self {
            DhGroupId::Null => "null",
            DhGroupId::Ffdhe2048 => "ffdhe2048",
            DhGroupId::Ffdhe3072 => "ffdhe3072",
            DhGroupId::Ffdhe4096 => "ffdhe4096",
            DhGroupId::Ffdhe6144 => "ffdhe6144",
            DhGroupId::Ffdhe8192 => "ffdhe8192",
        }
    }
}

/// Reason code of a Failure1/Failure2 message: the only one defined.
pub const FAILURE_REASON_AUTH_FAILED: u8 = 0x01;

/// Reason code explanations of a Failure1/Failure2 message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FailureExplanation {
    /// Authentication failed (wrong response: a wrong key).
    Failed = 0x01,
    /// No usable authentication protocol.
    ProtocolUnusable = 0x02,
    /// Secure channel concatenation mismatch.
    ConcatMismatch = 0x03,
    /// Hash function not usable.
    HashUnusable = 0x04,
    /// DH group not usable.
    DhGroupUnusable = 0x05,
    /// Incorrect payload (bad length, transaction ID or DH value).
    IncorrectPayload = 0x06,
    /// Incorrect protocol message (out of order or unexpected).
    IncorrectMessage = 0x07,
}

impl FailureExplanation {
    /// The explanation for a wire value.
    pub fn from_u8(v: u8) -> Option<Self> {
        use FailureExplanation::*;
        [
            Failed,
            ProtocolUnusable,
            ConcatMismatch,
            HashUnusable,
            DhGroupUnusable,
            IncorrectPayload,
            IncorrectMessage,
        ]
        .into_iter()
        .find(|e| *e as u8 == v)
    }

    /// A short description, for logs and errors.
    pub const fn describe(self) -> &'static str {
        match self {
            FailureExplanation::Failed => "authentication failed",
            FailureExplanation::ProtocolUnusable => "authentication protocol not usable",
            FailureExplanation::ConcatMismatch => "secure channel concatenation mismatch",
            FailureExplanation::HashUnusable => "hash function not usable",
            FailureExplanation::DhGroupUnusable => "DH group not usable",
            FailureExplanation::IncorrectPayload => "incorrect payload",
            FailureExplanation::IncorrectMessage => "incorrect protocol message",
        }
    }
}

/// Command dwords 10-11 of Authentication Send/Receive (bytes 40-47 of the SQE): the
/// command figures of NVMe Base 2.0 sections 6.1 and 6.2.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct AuthCommandDwords {
    /// Reserved.
    pub rsvd: u8,
    /// SP Specific 0.
    pub spsp0: u8,
    /// SP Specific 1.
    pub spsp1: u8,
    /// Security Protocol.
    pub secp: u8,
    /// Transfer Length (Send) or Allocation Length (Receive), in bytes.
    pub len: U32,
}
const _: () = assert!(size_of::<AuthCommandDwords>() == 8);
const _: () = assert!(std::mem::offset_of!(AuthCommandDwords, secp) == 3);

/// An Authentication Send or Receive command's fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AuthCommand {
    /// True for Authentication Send (host to controller), false for Receive.
    pub send: bool,
    /// Security Protocol.
    pub secp: u8,
    /// SP Specific 0.
    pub spsp0: u8,
    /// SP Specific 1.
    pub spsp1: u8,
    /// Transfer length (Send) or allocation length (Receive), in bytes.
    pub len: u32,
}

impl AuthCommand {
    /// A DH-HMAC-CHAP Authentication Send of `len` bytes.
    pub fn send(len: u32) -> Self {
        Self {
            send: true,
            secp: SECP_AUTH,
            spsp0: SPSP_DHCHAP,
            spsp1: SPSP_DHCHAP,
            len,
        }
    }

    /// A DH-HMAC-CHAP Authentication Receive of at most `len` bytes.
    pub fn receive(len: u32) -> Self {
        Self {
            send: false,
            ..Self::send(len)
        }
    }

    /// Reads the fields of an Authentication Send/Receive SQE; `None` for any other command.
    pub fn from_sqe(sqe: &Sqe) -> Option<Self> {
        if sqe.opcode != FABRICS {
            return None;
        }
        let send = match sqe.fctype() {
            fctype::AUTH_SEND => true,
            fctype::AUTH_RECEIVE => false,
            _ => return None,
        };
        let mut raw = [0u8; 8];
        raw[..4].copy_from_slice(sqe.cdw10.as_bytes());
        raw[4..].copy_from_slice(sqe.cdw11.as_bytes());
        let d = AuthCommandDwords::read_from_bytes(&raw).ok()?;
        Some(Self {
            send,
            secp: d.secp,
            spsp0: d.spsp0,
            spsp1: d.spsp1,
            len: d.len.get(),
        })
    }

    /// Writes opcode, command type and dwords 10-11 into `sqe` (the data pointer is the
    /// transport's).
    pub fn write_to_sqe(&self, sqe: &mut Sqe) {
        sqe.opcode = FABRICS;
        let mut nsid = sqe.nsid.get().to_le_bytes();
        nsid[0] = if self.send {
            fctype::AUTH_SEND
        } else {
            fctype::AUTH_RECEIVE
        };
        sqe.nsid = U32::new(u32::from_le_bytes(nsid));
        let d = AuthCommandDwords {
            rsvd: 0,
            spsp0: self.spsp0,
            spsp1: self.spsp1,
            secp: self.secp,
            len: U32::new(self.len),
        };
        let b = d.as_bytes();
        sqe.cdw10 = U32::new(u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
        sqe.cdw11 = U32::new(u32::from_le_bytes([b[4], b[5], b[6], b[7]]));
    }

    /// Whether SECP/SPSP name DH-HMAC-CHAP.
    pub fn is_dhchap(&self) -> bool {
        self.secp == SECP_AUTH && self.spsp0 == SPSP_DHCHAP && self.spsp1 == SPSP_DHCHAP
    }
}

/// AUTH_Negotiate header, 8 bytes (the AUTH_Negotiate message figure), followed by NAPD
/// protocol descriptors.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct NegotiateHeader {
    /// AUTH-Type (common).
    pub auth_type: u8,
    /// AUTH ID (Negotiate).
    pub auth_id: u8,
    /// Reserved.
    pub rsvd: [u8; 2],
    /// Transaction identifier.
    pub t_id: U16,
    /// Secure channel concatenation.
    pub sc_c: u8,
    /// Number of authentication protocol descriptors.
    pub napd: u8,
}
const _: () = assert!(size_of::<NegotiateHeader>() == 8);
const _: () = assert!(std::mem::offset_of!(NegotiateHeader, t_id) == 4);

/// DH-HMAC-CHAP protocol descriptor, 64 bytes (the protocol descriptor figure).
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct ProtocolDescriptor {
    /// Authentication protocol identifier (DH-HMAC-CHAP = 1).
    pub authid: u8,
    /// Reserved.
    pub rsvd: u8,
    /// Number of hash identifiers.
    pub halen: u8,
    /// Number of DH group identifiers.
    pub dhlen: u8,
    /// Hash identifiers (bytes 0-29) and DH group identifiers (bytes 30-59).
    pub idlist: [u8; 60],
}
const _: () = assert!(size_of::<ProtocolDescriptor>() == 64);
const _: () = assert!(std::mem::offset_of!(ProtocolDescriptor, idlist) == 4);

/// Header of DH-HMAC-CHAP_Challenge, _Reply and _Success1, 16 bytes (their message figures).
///
/// The bytes 6-15 differ by message: Challenge has HL, rsvd, HashID, DHgID, DHVLEN, SEQNUM;
/// Reply has HL, rsvd, CVALID, rsvd, DHVLEN, SEQNUM; Success1 has HL, rsvd, RVALID, rsvd.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct DhchapHeader {
    /// AUTH-Type (DH-HMAC-CHAP).
    pub auth_type: u8,
    /// AUTH ID.
    pub auth_id: u8,
    /// Reserved.
    pub rsvd: [u8; 2],
    /// Transaction identifier.
    pub t_id: U16,
    /// Hash length.
    pub hl: u8,
    /// Reserved.
    pub rsvd7: u8,
    /// Challenge: hash identifier; Reply: CVALID; Success1: RVALID.
    pub b8: u8,
    /// Challenge: DH group identifier; otherwise reserved.
    pub b9: u8,
    /// Challenge and Reply: DH value length.
    pub dhvlen: U16,
    /// Challenge and Reply: sequence number.
    pub seqnum: U32,
}
const _: () = assert!(size_of::<DhchapHeader>() == 16);
const _: () = assert!(std::mem::offset_of!(DhchapHeader, hl) == 6);
const _: () = assert!(std::mem::offset_of!(DhchapHeader, dhvlen) == 10);
const _: () = assert!(std::mem::offset_of!(DhchapHeader, seqnum) == 12);

/// AUTH_Failure1/AUTH_Failure2, 8 bytes (the failure message figure).
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct FailureMessage {
    /// AUTH-Type (common).
    pub auth_type: u8,
    /// AUTH ID (Failure1 or Failure2).
    pub auth_id: u8,
    /// Reserved.
    pub rsvd: [u8; 2],
    /// Transaction identifier.
    pub t_id: U16,
    /// Reason code.
    pub reason: u8,
    /// Reason code explanation.
    pub explanation: u8,
}
const _: () = assert!(size_of::<FailureMessage>() == 8);

/// Size of a DH-HMAC-CHAP_Success2 message.
pub const SUCCESS2_LEN: usize = 16;

/// The DH-HMAC-CHAP entry of an AUTH_Negotiate: what the host offers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DhchapProtocol {
    /// Hash identifiers offered, host preference first (raw values).
    pub hash_ids: Vec<u8>,
    /// DH group identifiers offered, host preference first (raw values).
    pub dh_group_ids: Vec<u8>,
}

/// One authentication protocol descriptor of an AUTH_Negotiate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// DH-HMAC-CHAP.
    Dhchap(DhchapProtocol),
    /// Another protocol identifier (the descriptor's bytes are not interpreted).
    Other(u8),
}

/// A parsed authentication message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AuthMessage {
    /// AUTH_Negotiate (host to controller).
    Negotiate {
        /// Transaction identifier.
        t_id: u16,
        /// Secure channel concatenation.
        sc_c: u8,
        /// Protocol descriptors.
        protocols: Vec<Protocol>,
    },
    /// DH-HMAC-CHAP_Challenge (controller to host).
    Challenge {
        /// Transaction identifier.
        t_id: u16,
        /// Selected hash (raw value).
        hash_id: u8,
        /// Selected DH group (raw value).
        dh_group_id: u8,
        /// Sequence number S1.
        seqnum: u32,
        /// Challenge C1 (HL bytes).
        challenge: Vec<u8>,
        /// Controller DH value (empty for the null group).
        dh_value: Vec<u8>,
    },
    /// DH-HMAC-CHAP_Reply (host to controller).
    Reply {
        /// Transaction identifier.
        t_id: u16,
        /// Whether the host asks the controller to authenticate itself (C2 and S2 valid).
        cvalid: bool,
        /// Sequence number S2.
        seqnum: u32,
        /// Response R1 (HL bytes).
        response: Vec<u8>,
        /// Challenge C2 (HL bytes; zero when not valid).
        challenge: Vec<u8>,
        /// Host DH value (empty for the null group).
        dh_value: Vec<u8>,
    },
    /// DH-HMAC-CHAP_Success1 (controller to host).
    Success1 {
        /// Transaction identifier.
        t_id: u16,
        /// Hash length.
        hl: u8,
        /// Response R2, when the host asked for it.
        response: Option<Vec<u8>>,
    },
    /// DH-HMAC-CHAP_Success2 (host to controller).
    Success2 {
        /// Transaction identifier.
        t_id: u16,
    },
    /// AUTH_Failure1 (controller to host).
    Failure1 {
        /// Transaction identifier.
        t_id: u16,
        /// Reason code.
        reason: u8,
        /// Reason code explanation (raw value, see [`FailureExplanation`]).
        explanation: u8,
    },
    /// AUTH_Failure2 (host to controller).
    Failure2 {
        /// Transaction identifier.
        t_id: u16,
        /// Reason code.
        reason: u8,
        /// Reason code explanation (raw value, see [`FailureExplanation`]).
        explanation: u8,
    },
}

/// Why an authentication message could not be parsed.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum AuthParseError {
    /// The buffer ends before the structure it must hold.
    #[error("authentication message truncated: {need} bytes needed, {have} present")]
    Truncated {
        /// Bytes the message needs.
        need: usize,
        /// Bytes present.
        have: usize,
    },
    /// Unknown AUTH-Type/AUTH ID combination.
    #[error("unknown authentication message type {auth_type:#04x} id {auth_id:#04x}")]
    UnknownMessage {
        /// AUTH-Type.
        auth_type: u8,
        /// AUTH ID.
        auth_id: u8,
    },
    /// A descriptor lists more identifiers than it has room for.
    #[error("protocol descriptor lists {count} identifiers (at most 30)")]
    TooManyIds {
        /// The count given.
        count: u8,
    },
    /// A zero hash length in a message that needs one.
    #[error("hash length is zero")]
    ZeroHashLength,
}

impl AuthMessage {
    /// Transaction identifier of the message.
    pub fn t_id(&self) -> u16 {
        match self {
            AuthMessage::Negotiate { t_id, .. }
            | AuthMessage::Challenge { t_id, .. }
            | AuthMessage::Reply { t_id, .. }
            | AuthMessage::Success1 { t_id, .. }
            | AuthMessage::Success2 { t_id }
            | AuthMessage::Failure1 { t_id, .. }
            | AuthMessage::Failure2 { t_id, .. } => *t_id,
        }
    }

    /// The message's name, for logs and errors.
    pub fn name(&self) -> &'static str {
        match self {
            AuthMessage::Negotiate { .. } => "AUTH_Negotiate",
            AuthMessage::Challenge { .. } => "DH-HMAC-CHAP_Challenge",
            AuthMessage::Reply { .. } => "DH-HMAC-CHAP_Reply",
            AuthMessage::Success1 { .. } => "DH-HMAC-CHAP_Success1",
            AuthMessage::Success2 { .. } => "DH-HMAC-CHAP_Success2",
            AuthMessage::Failure1 { .. } => "AUTH_Failure1",
            AuthMessage::Failure2 { .. } => "AUTH_Failure2",
        }
    }

    /// Parses a message. Bytes after the message's own length are ignored (an Authentication
    /// Receive buffer may be longer than the message).
    pub fn parse(raw: &[u8]) -> Result<Self, AuthParseError> {
        let (auth_type, auth_id) = match raw {
            [t, i, ..] => (*t, *i),
            _ => return Err(truncated(2, raw.len())),
        };
        match (auth_type, auth_id) {
            (AUTH_TYPE_COMMON, msg::NEGOTIATE) => parse_negotiate(raw),
            (AUTH_TYPE_COMMON, msg::FAILURE1 | msg::FAILURE2) => {
                let (f, _) = FailureMessage::read_from_prefix(raw)
                    .map_err(|_| truncated(size_of::<FailureMessage>(), raw.len()))?;
                let (t_id, reason, explanation) = (f.t_id.get(), f.reason, f.explanation);
                Ok(if auth_id == msg::FAILURE1 {
                    AuthMessage::Failure1 {
                        t_id,
                        reason,
                        explanation,
                    }
                } else {
                    AuthMessage::Failure2 {
                        t_id,
                        reason,
                        explanation,
                    }
                })
            }
            (AUTH_TYPE_DHCHAP, msg::CHALLENGE | msg::REPLY | msg::SUCCESS1 | msg::SUCCESS2) => {
                parse_dhchap(raw)
            }
            _ => Err(AuthParseError::UnknownMessage { auth_type, auth_id }),
        }
    }

    /// Encodes the message.
    pub fn encode(&self) -> Vec<u8> {
        match self {
            AuthMessage::Negotiate {
                t_id,
                sc_c,
                protocols,
            } => {
                let hdr = NegotiateHeader {
                    auth_type: AUTH_TYPE_COMMON,
                    auth_id: msg::NEGOTIATE,
                    rsvd: [0; 2],
                    t_id: U16::new(*t_id),
                    sc_c: *sc_c,
                    napd: protocols.len().min(255) as u8,
                };
                let mut out = hdr.as_bytes().to_vec();
                for p in protocols.iter().take(255) {
                    let mut d = ProtocolDescriptor::new_zeroed();
                    match p {
                        Protocol::Dhchap(p) => {
                            let h = p.hash_ids.len().min(MAX_IDS);
                            let g = p.dh_group_ids.len().min(MAX_IDS);
                            d.authid = AUTHID_DHCHAP;
                            d.halen = h as u8;
                            d.dhlen = g as u8;
                            d.idlist[..h].copy_from_slice(&p.hash_ids[..h]);
                            d.idlist[MAX_IDS..MAX_IDS + g].copy_from_slice(&p.dh_group_ids[..g]);
                        }
                        Protocol::Other(id) => d.authid = *id,
                    }
                    out.extend_from_slice(d.as_bytes());
                }
                out
            }
            AuthMessage::Challenge {
                t_id,
                hash_id,
                dh_group_id,
                seqnum,
                challenge,
                dh_value,
            } => {
                let hdr = dhchap_header(msg::CHALLENGE, *t_id, challenge.len(), *hash_id).with(
                    *dh_group_id,
                    dh_value.len(),
                    *seqnum,
                );
                concat(&hdr, &[challenge, dh_value])
            }
            AuthMessage::Reply {
                t_id,
                cvalid,
                seqnum,
                response,
                challenge,
                dh_value,
            } => {
                let hdr = dhchap_header(msg::REPLY, *t_id, response.len(), u8::from(*cvalid)).with(
                    0,
                    dh_value.len(),
                    *seqnum,
                );
                concat(&hdr, &[response, challenge, dh_value])
            }
            AuthMessage::Success1 { t_id, hl, response } => {
                let hdr = dhchap_header(msg::SUCCESS1, *t_id, usize::from(*hl), 0);
                match response {
                    Some(r) => concat(&DhchapHeader { b8: 1, ..hdr }, &[r]),
                    None => concat(&hdr, &[&vec![0; usize::from(*hl)]]),
                }
            }
            AuthMessage::Success2 { t_id } => {
                concat(&dhchap_header(msg::SUCCESS2, *t_id, 0, 0), &[])
            }
            AuthMessage::Failure1 {
                t_id,
                reason,
                explanation,
            }
            | AuthMessage::Failure2 {
                t_id,
                reason,
                explanation,
            } => {
                let auth_id = if matches!(self, AuthMessage::Failure1 { .. }) {
                    msg::FAILURE1
                } else {
                    msg::FAILURE2
                };
                FailureMessage {
                    auth_type: AUTH_TYPE_COMMON,
                    auth_id,
                    rsvd: [0; 2],
                    t_id: U16::new(*t_id),
                    reason: *reason,
                    explanation: *explanation,
                }
                .as_bytes()
                .to_vec()
            }
        }
    }
}

fn truncated(need: usize, have: usize) -> AuthParseError {
    AuthParseError::Truncated { need, have }
}

fn dhchap_header(auth_id: u8, t_id: u16, hl: usize, b8: u8) -> DhchapHeader {
    DhchapHeader {
        auth_type: AUTH_TYPE_DHCHAP,
        auth_id,
        rsvd: [0; 2],
        t_id: U16::new(t_id),
        hl: hl.min(255) as u8,
        rsvd7: 0,
        b8,
        b9: 0,
        dhvlen: U16::new(0),
        seqnum: U32::new(0),
    }
}

impl DhchapHeader {
    fn with(self, b9: u8, dhvlen: usize, seqnum: u32) -> Self {
        Self {
            b9,
            dhvlen: U16::new(dhvlen.min(usize::from(u16::MAX)) as u16),
            seqnum: U32::new(seqnum),
            ..self
        }
    }
}

fn concat(hdr: &DhchapHeader, parts: &[&Vec<u8>]) -> Vec<u8> {
    let mut out = hdr.as_bytes().to_vec();
    for p in parts {
        out.extend_from_slice(p);
    }
    out
}

fn parse_negotiate(raw: &[u8]) -> Result<AuthMessage, AuthParseError> {
    let (hdr, mut rest) = NegotiateHeader::read_from_prefix(raw)
        .map_err(|_| truncated(size_of::<NegotiateHeader>(), raw.len()))?;
    let need = size_of::<NegotiateHeader>() + usize::from(hdr.napd) * 64;
    let mut protocols = Vec::with_capacity(usize::from(hdr.napd));
    for _ in 0..hdr.napd {
        let (d, next) =
            ProtocolDescriptor::read_from_prefix(rest).map_err(|_| truncated(need, raw.len()))?;
        rest = next;
        if d.authid != AUTHID_DHCHAP {
            protocols.push(Protocol::Other(d.authid));
            continue;
        }
        for count in [d.halen, d.dhlen] {
            if usize::from(count) > MAX_IDS {
                return Err(AuthParseError::TooManyIds { count });
            }
        }
        protocols.push(Protocol::Dhchap(DhchapProtocol {
            hash_ids: d.idlist[..usize::from(d.halen)].to_vec(),
            dh_group_ids: d.idlist[MAX_IDS..MAX_IDS + usize::from(d.dhlen)].to_vec(),
        }));
    }
    Ok(AuthMessage::Negotiate {
        t_id: hdr.t_id.get(),
        sc_c: hdr.sc_c,
        protocols,
    })
}

fn parse_dhchap(raw: &[u8]) -> Result<AuthMessage, AuthParseError> {
    let (hdr, body) = DhchapHeader::read_from_prefix(raw)
        .map_err(|_| truncated(size_of::<DhchapHeader>(), raw.len()))?;
    let t_id = hdr.t_id.get();
    let hl = usize::from(hdr.hl);
    let dhvlen = usize::from(hdr.dhvlen.get());
    // Splits `body` into fields of the given lengths, or reports the total length needed.
    let take = |lens: &[usize]| -> Result<Vec<Vec<u8>>, AuthParseError> {
        let need: usize = lens.iter().sum();
        if body.len() < need {
            return Err(truncated(size_of::<DhchapHeader>() + need, raw.len()));
        }
        let mut at = 0;
        Ok(lens
            .iter()
            .map(|l| {
                let v = body[at..at + l].to_vec();
                at += l;
                v
            })
            .collect())
    };
    if hdr.auth_id != msg::SUCCESS2 && hl == 0 {
        return Err(AuthParseError::ZeroHashLength);
    }
    match hdr.auth_id {
        msg::CHALLENGE => {
            let mut f = take(&[hl, dhvlen])?;
            let dh_value = f.pop().unwrap_or_default();
            let challenge = f.pop().unwrap_or_default();
            Ok(AuthMessage::Challenge {
                t_id,
                hash_id: hdr.b8,
                dh_group_id: hdr.b9,
                seqnum: hdr.seqnum.get(),
                challenge,
                dh_value,
            })
        }
        msg::REPLY => {
            let mut f = take(&[hl, hl, dhvlen])?;
            let dh_value = f.pop().unwrap_or_default();
            let challenge = f.pop().unwrap_or_default();
            let response = f.pop().unwrap_or_default();
            Ok(AuthMessage::Reply {
                t_id,
                cvalid: hdr.b8 != 0,
                seqnum: hdr.seqnum.get(),
                response,
                challenge,
                dh_value,
            })
        }
        msg::SUCCESS1 => {
            let response = if hdr.b8 != 0 {
                take(&[hl])?.pop()
            } else {
                None
            };
            Ok(AuthMessage::Success1 {
                t_id,
                hl: hdr.hl,
                response,
            })
        }
        _ => Ok(AuthMessage::Success2 { t_id }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn roundtrip(m: AuthMessage) -> Vec<u8> {
        let raw = m.encode();
        assert_eq!(AuthMessage::parse(&raw).unwrap(), m, "{}", m.name());
        raw
    }

    #[test]
    fn negotiate_roundtrip_and_layout() {
        let raw = roundtrip(AuthMessage::Negotiate {
            t_id: 0x1234,
            sc_c: sc_c::NONE,
            protocols: vec![Protocol::Dhchap(DhchapProtocol {
                hash_ids: vec![1, 2, 3],
                dh_group_ids: vec![0, 1, 2, 3, 4, 5],
            })],
        });
        assert_eq!(raw.len(), 8 + 64);
        assert_eq!(&raw[..8], &[0x00, 0x00, 0, 0, 0x34, 0x12, 0, 1]);
        assert_eq!(&raw[8..12], &[AUTHID_DHCHAP, 0, 3, 6]);
        assert_eq!(&raw[12..15], &[1, 2, 3]);
        assert_eq!(&raw[12 + 30..12 + 36], &[0, 1, 2, 3, 4, 5]);
        roundtrip(AuthMessage::Negotiate {
            t_id: 1,
            sc_c: 0,
            protocols: vec![Protocol::Other(9)],
        });
    }

    #[test]
    fn challenge_reply_success_failure_roundtrip() {
        let raw = roundtrip(AuthMessage::Challenge {
            t_id: 7,
            hash_id: HashId::Sha384 as u8,
            dh_group_id: DhGroupId::Ffdhe2048 as u8,
            seqnum: 0xDEAD_BEEF,
            challenge: vec![0xAA; 48],
            dh_value: vec![0x55; 256],
        });
        assert_eq!(raw.len(), 16 + 48 + 256);
        assert_eq!(
            &raw[..16],
            &[1, 1, 0, 0, 7, 0, 48, 0, 2, 1, 0, 1, 0xEF, 0xBE, 0xAD, 0xDE]
        );
        let raw = roundtrip(AuthMessage::Reply {
            t_id: 7,
            cvalid: true,
            seqnum: 9,
            response: vec![1; 32],
            challenge: vec![2; 32],
            dh_value: vec![],
        });
        assert_eq!(raw.len(), 16 + 64);
        assert_eq!(raw[8], 1);
        roundtrip(AuthMessage::Success1 {
            t_id: 7,
            hl: 32,
            response: Some(vec![3; 32]),
        });
        let raw = roundtrip(AuthMessage::Success1 {
            t_id: 7,
            hl: 32,
            response: None,
        });
        assert_eq!(
            raw.len(),
            16 + 32,
            "Success1 carries HL bytes even without a response"
        );
        assert_eq!(
            roundtrip(AuthMessage::Success2 { t_id: 7 }).len(),
            SUCCESS2_LEN
        );
        let raw = roundtrip(AuthMessage::Failure1 {
            t_id: 7,
            reason: 1,
            explanation: 4,
        });
        assert_eq!(raw, [0, 0xF1, 0, 0, 7, 0, 1, 4]);
        roundtrip(AuthMessage::Failure2 {
            t_id: 7,
            reason: 1,
            explanation: 6,
        });
    }

    #[test]
    fn bad_messages_are_errors() {
        assert_eq!(AuthMessage::parse(&[]), Err(truncated(2, 0)));
        assert!(matches!(
            AuthMessage::parse(&[1, 9, 0, 0]),
            Err(AuthParseError::UnknownMessage {
                auth_type: 1,
                auth_id: 9
            })
        ));
        let mut raw = AuthMessage::Challenge {
            t_id: 1,
            hash_id: 1,
            dh_group_id: 0,
            seqnum: 1,
            challenge: vec![0; 32],
            dh_value: vec![],
        }
        .encode();
        raw[10] = 0xFF; // DHVLEN beyond the buffer
        assert!(matches!(
            AuthMessage::parse(&raw),
            Err(AuthParseError::Truncated { .. })
        ));
        raw[6] = 0;
        assert_eq!(
            AuthMessage::parse(&raw),
            Err(AuthParseError::ZeroHashLength)
        );
        let mut neg = AuthMessage::Negotiate {
            t_id: 1,
            sc_c: 0,
            protocols: vec![Protocol::Dhchap(DhchapProtocol {
                hash_ids: vec![1],
                dh_group_ids: vec![0],
            })],
        }
        .encode();
        neg[10] = 31;
        assert_eq!(
            AuthMessage::parse(&neg),
            Err(AuthParseError::TooManyIds { count: 31 })
        );
        neg[10] = 1;
        neg[7] = 2; // NAPD larger than the descriptors present
        assert!(matches!(
            AuthMessage::parse(&neg),
            Err(AuthParseError::Truncated { .. })
        ));
    }

    #[test]
    fn command_dwords() {
        let mut sqe = Sqe::default();
        AuthCommand::send(72).write_to_sqe(&mut sqe);
        let raw = sqe.to_array();
        assert_eq!(raw[0], FABRICS);
        assert_eq!(raw[4], fctype::AUTH_SEND);
        assert_eq!(&raw[40..48], &[0, 1, 1, 0xE9, 72, 0, 0, 0]);
        let cmd = AuthCommand::from_sqe(&sqe).unwrap();
        assert!(cmd.send && cmd.is_dhchap());
        assert_eq!(cmd.len, 72);
        AuthCommand::receive(4096).write_to_sqe(&mut sqe);
        let cmd = AuthCommand::from_sqe(&sqe).unwrap();
        assert!(!cmd.send);
        assert_eq!(cmd.len, 4096);
        sqe.opcode = 0x02;
        assert_eq!(AuthCommand::from_sqe(&sqe), None);
    }

    #[test]
    fn names() {
        assert_eq!(HashId::from_u8(2), Some(HashId::Sha384));
        assert_eq!(HashId::from_u8(4), None);
        assert_eq!(DhGroupId::from_u8(5).map(DhGroupId::value_len), Some(1024));
        assert_eq!(
            FailureExplanation::from_u8(7),
            Some(FailureExplanation::IncorrectMessage)
        );
        assert_eq!(FailureExplanation::from_u8(0), None);
    }

    proptest! {
        #[test]
        fn parse_never_panics(raw in proptest::collection::vec(any::<u8>(), 0..600)) {
            if let Ok(m) = AuthMessage::parse(&raw) {
                // Whatever parses encodes to a message that parses to the same value.
                prop_assert_eq!(AuthMessage::parse(&m.encode()), Ok(m));
            }
        }

        #[test]
        fn parse_never_panics_on_valid_headers(
            kind in 0usize..7, tail in proptest::collection::vec(any::<u8>(), 0..400)
        ) {
            let heads: [[u8; 2]; 7] = [[0, 0], [1, 1], [1, 2], [1, 3], [1, 4], [0, 0xF0], [0, 0xF1]];
            let mut raw = heads[kind].to_vec();
            raw.extend_from_slice(&tail);
            if let Ok(m) = AuthMessage::parse(&raw) {
                prop_assert_eq!(AuthMessage::parse(&m.encode()), Ok(m));
            }
        }
    }
}
