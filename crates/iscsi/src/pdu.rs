//! iSCSI PDU wire format (RFC 7143, section 11).
//!
//! Every PDU starts with the 48-byte Basic Header Segment ([`Bhs`], section 11.2.1), then
//! `TotalAHSLength` dwords of additional header segments, then the data segment padded to a
//! multiple of 4 bytes. [`Bhs`] is the exact wire layout (`#[repr(C)]`, big-endian, no
//! alignment requirement); its fields mean different things per opcode, so callers use the
//! named accessors and builders here ([`Bhs::scsi_command`], [`TargetPdu::parse`]) rather
//! than the raw fields.

use core::mem::{offset_of, size_of};

use zerocopy::big_endian::U32;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

/// Length of the Basic Header Segment (section 11.2.1).
pub const BHS_LEN: usize = 48;
/// The reserved initiator task tag: "no task" (section 11.18.3).
pub const RESERVED_TAG: u32 = 0xffff_ffff;

/// Initiator opcodes (section 11.2.1.2).
pub mod opcode {
    /// NOP-Out.
    pub const NOP_OUT: u8 = 0x00;
    /// SCSI Command.
    pub const SCSI_COMMAND: u8 = 0x01;
    /// Login Request.
    pub const LOGIN_REQUEST: u8 = 0x03;
    /// SCSI Data-Out.
    pub const DATA_OUT: u8 = 0x05;
    /// Logout Request.
    pub const LOGOUT_REQUEST: u8 = 0x06;
    /// NOP-In.
    pub const NOP_IN: u8 = 0x20;
    /// SCSI Response.
    pub const SCSI_RESPONSE: u8 = 0x21;
    /// Text Response.
    pub const TEXT_RESPONSE: u8 = 0x24;
    /// Login Response.
    pub const LOGIN_RESPONSE: u8 = 0x23;
    /// SCSI Data-In.
    pub const DATA_IN: u8 = 0x25;
    /// Logout Response.
    pub const LOGOUT_RESPONSE: u8 = 0x26;
    /// Ready To Transfer.
    pub const R2T: u8 = 0x31;
    /// Asynchronous Message.
    pub const ASYNC_MESSAGE: u8 = 0x32;
    /// Reject.
    pub const REJECT: u8 = 0x3f;
    /// The immediate-delivery bit of byte 0 (initiator PDUs).
    pub const IMMEDIATE: u8 = 0x40;
    /// The opcode bits of byte 0.
    pub const MASK: u8 = 0x3f;
}

/// The Basic Header Segment (section 11.2.1, and the per-opcode layouts of sections 11.3 to
/// 11.18). Fields are named by their generic role; bytes 20..48 are opcode specific.
#[repr(C)]
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    FromBytes,
    IntoBytes,
    KnownLayout,
    Immutable,
    Unaligned,
)]
pub struct Bhs {
    /// Byte 0: immediate bit and opcode.
    pub opcode: u8,
    /// Byte 1: opcode-specific flags (F, R, W, T, C, S, ...).
    pub flags: u8,
    /// Byte 2: opcode specific (Response, Version-max, Reject reason).
    pub byte2: u8,
    /// Byte 3: opcode specific (Status, Version-min/active).
    pub byte3: u8,
    /// TotalAHSLength in 4-byte words.
    pub total_ahs_len: u8,
    /// DataSegmentLength, 24-bit big-endian.
    pub data_segment_len: [u8; 3],
    /// LUN, or ISID and TSIH in login PDUs.
    pub lun: [u8; 8],
    /// Initiator Task Tag.
    pub itt: U32,
    /// Bytes 20..24: Expected Data Transfer Length, Target Transfer Tag, or CID.
    pub word20: U32,
    /// Bytes 24..28: CmdSN (initiator) or StatSN (target).
    pub word24: U32,
    /// Bytes 28..32: ExpStatSN (initiator) or ExpCmdSN (target).
    pub word28: U32,
    /// Bytes 32..48: the CDB (SCSI Command), or MaxCmdSN, DataSN/R2TSN/status, Buffer Offset
    /// and Residual Count/Desired Data Transfer Length.
    pub tail: [u8; 16],
}

const _: () = assert!(size_of::<Bhs>() == BHS_LEN);
const _: () = assert!(offset_of!(Bhs, total_ahs_len) == 4);
const _: () = assert!(offset_of!(Bhs, data_segment_len) == 5);
const _: () = assert!(offset_of!(Bhs, lun) == 8);
const _: () = assert!(offset_of!(Bhs, itt) == 16);
const _: () = assert!(offset_of!(Bhs, word20) == 20);
const _: () = assert!(offset_of!(Bhs, word24) == 24);
const _: () = assert!(offset_of!(Bhs, word28) == 28);
const _: () = assert!(offset_of!(Bhs, tail) == 32);

/// Flag bits of byte 1.
pub mod flags {
    /// F: final PDU (of a command's unsolicited data, of a sequence, of a NOP/Logout).
    pub const FINAL: u8 = 0x80;
    /// R (SCSI Command): data flows to the initiator.
    pub const READ: u8 = 0x40;
    /// W (SCSI Command): data flows to the target.
    pub const WRITE: u8 = 0x20;
    /// ATTR = Simple (SCSI Command).
    pub const ATTR_SIMPLE: u8 = 0x01;
    /// T (Login): transit to the next stage.
    pub const TRANSIT: u8 = 0x80;
    /// C (Login, Text): the text continues in the next PDU.
    pub const CONTINUE: u8 = 0x40;
    /// S (Data-In): the PDU carries the command's status.
    pub const STATUS: u8 = 0x01;
    /// U (Data-In, SCSI Response): residual underflow.
    pub const UNDERFLOW: u8 = 0x02;
    /// O (Data-In, SCSI Response): residual overflow.
    pub const OVERFLOW: u8 = 0x04;
}

/// Rounds a data segment length up to the 4-byte boundary it is padded to.
pub fn padded(len: usize) -> usize {
    (len + 3) & !3
}

/// An 8-byte LUN field for LUN number `lun` (SAM-5 4.7: peripheral addressing below 256,
/// flat-space addressing up to 16383).
pub fn encode_lun(lun: u16) -> [u8; 8] {
    let mut out = [0u8; 8];
    if lun < 256 {
        out[1] = lun as u8;
    } else {
        out[0] = 0x40 | ((lun >> 8) as u8 & 0x3f);
        out[1] = lun as u8;
    }
    out
}

impl Bhs {
    /// The header viewed over the first 48 bytes of `bytes`.
    pub fn read_from(bytes: &[u8; BHS_LEN]) -> Bhs {
        // The sizes are equal (asserted above), so this cannot fail.
        Bhs::read_from_bytes(bytes).unwrap_or_default()
    }

    /// The wire bytes.
    pub fn to_bytes(&self) -> [u8; BHS_LEN] {
        let mut out = [0u8; BHS_LEN];
        out.copy_from_slice(self.as_bytes());
        out
    }

    /// The opcode without the immediate bit.
    pub fn op(&self) -> u8 {
        self.opcode & opcode::MASK
    }

    /// DataSegmentLength.
    pub fn data_len(&self) -> usize {
        let [a, b, c] = self.data_segment_len;
        (usize::from(a) << 16) | (usize::from(b) << 8) | usize::from(c)
    }

    /// Sets DataSegmentLength (at most 2^24 - 1; callers never pass more).
    pub fn set_data_len(&mut self, len: usize) {
        let len = len.min(0xff_ffff);
        self.data_segment_len = [(len >> 16) as u8, (len >> 8) as u8, len as u8];
    }

    /// Length of the additional header segments that follow, in bytes.
    pub fn ahs_len(&self) -> usize {
        usize::from(self.total_ahs_len) * 4
    }

    fn tail_word(&self, i: usize) -> u32 {
        let b = &self.tail[i * 4..i * 4 + 4];
        u32::from_be_bytes([b[0], b[1], b[2], b[3]])
    }

    fn set_tail_word(&mut self, i: usize, v: u32) {
        self.tail[i * 4..i * 4 + 4].copy_from_slice(&v.to_be_bytes());
    }

    /// A SCSI Command PDU (section 11.3). `immediate` bytes of data follow in its data
    /// segment; `final_` says that no unsolicited Data-Out follows.
    #[allow(clippy::too_many_arguments)]
    pub fn scsi_command(
        lun: [u8; 8],
        itt: u32,
        cmd_sn: u32,
        exp_stat_sn: u32,
        cdb: &[u8; 16],
        dir: DataDir,
        expected_len: u32,
        immediate: usize,
        final_: bool,
    ) -> Bhs {
        let mut h = Bhs {
            opcode: opcode::SCSI_COMMAND,
            flags: flags::ATTR_SIMPLE
                | match dir {
                    DataDir::None => 0,
                    DataDir::In => flags::READ,
                    DataDir::Out => flags::WRITE,
                }
                | if final_ { flags::FINAL } else { 0 },
            lun,
            itt: itt.into(),
            word20: expected_len.into(),
            word24: cmd_sn.into(),
            word28: exp_stat_sn.into(),
            tail: *cdb,
            ..Bhs::default()
        };
        h.set_data_len(immediate);
        h
    }

    /// A SCSI Data-Out PDU (section 11.7) carrying `len` bytes at `offset`.
    #[allow(clippy::too_many_arguments)]
    pub fn data_out(
        lun: [u8; 8],
        itt: u32,
        ttt: u32,
        exp_stat_sn: u32,
        data_sn: u32,
        offset: u32,
        len: usize,
        final_: bool,
    ) -> Bhs {
        let mut h = Bhs {
            opcode: opcode::DATA_OUT,
            flags: if final_ { flags::FINAL } else { 0 },
            lun,
            itt: itt.into(),
            word20: ttt.into(),
            word28: exp_stat_sn.into(),
            ..Bhs::default()
        };
        h.set_tail_word(1, data_sn);
        h.set_tail_word(2, offset);
        h.set_data_len(len);
        h
    }

    /// A NOP-Out (section 11.18): an answer to a target's ping (`itt` reserved, `ttt` echoed,
    /// immediate, CmdSN not advanced) or a ping of our own.
    pub fn nop_out(itt: u32, ttt: u32, cmd_sn: u32, exp_stat_sn: u32, data_len: usize) -> Bhs {
        let mut h = Bhs {
            opcode: opcode::NOP_OUT | opcode::IMMEDIATE,
            flags: flags::FINAL,
            itt: itt.into(),
            word20: ttt.into(),
            word24: cmd_sn.into(),
            word28: exp_stat_sn.into(),
            ..Bhs::default()
        };
        h.set_data_len(data_len);
        h
    }

    /// A Login Request (section 11.12).
    #[allow(clippy::too_many_arguments)]
    pub fn login_request(
        isid: [u8; 6],
        tsih: u16,
        itt: u32,
        cid: u16,
        cmd_sn: u32,
        exp_stat_sn: u32,
        csg: Stage,
        nsg: Stage,
        transit: bool,
        data_len: usize,
    ) -> Bhs {
        let mut lun = [0u8; 8];
        lun[..6].copy_from_slice(&isid);
        lun[6..].copy_from_slice(&tsih.to_be_bytes());
        let mut h = Bhs {
            opcode: opcode::LOGIN_REQUEST | opcode::IMMEDIATE,
            flags: (csg as u8) << 2
                | if transit {
                    flags::TRANSIT | nsg as u8
                } else {
                    0
                },
            lun,
            itt: itt.into(),
            word20: (u32::from(cid) << 16).into(),
            word24: cmd_sn.into(),
            word28: exp_stat_sn.into(),
            ..Bhs::default()
        };
        h.set_data_len(data_len);
        h
    }

    /// A Logout Request closing the session (section 11.14, reason code 0).
    pub fn logout_request(itt: u32, cid: u16, cmd_sn: u32, exp_stat_sn: u32) -> Bhs {
        Bhs {
            opcode: opcode::LOGOUT_REQUEST | opcode::IMMEDIATE,
            flags: flags::FINAL,
            itt: itt.into(),
            word20: (u32::from(cid) << 16).into(),
            word24: cmd_sn.into(),
            word28: exp_stat_sn.into(),
            ..Bhs::default()
        }
    }
}

/// Direction of a command's data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataDir {
    /// No data.
    None,
    /// Target to initiator (reads).
    In,
    /// Initiator to target (writes).
    Out,
}

/// Login stages (section 11.12.3: CSG and NSG).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Stage {
    /// SecurityNegotiation.
    Security = 0,
    /// LoginOperationalNegotiation.
    Operational = 1,
    /// FullFeaturePhase.
    FullFeature = 3,
}

impl Stage {
    fn from_bits(b: u8) -> Option<Stage> {
        match b & 3 {
            0 => Some(Stage::Security),
            1 => Some(Stage::Operational),
            3 => Some(Stage::FullFeature),
            _ => None,
        }
    }
}

/// The sequence numbers a target PDU carries (StatSN is meaningful only where the PDU
/// carries a status).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Seq {
    /// StatSN.
    pub stat_sn: u32,
    /// ExpCmdSN.
    pub exp_cmd_sn: u32,
    /// MaxCmdSN.
    pub max_cmd_sn: u32,
}

/// A PDU from the target, decoded from its header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TargetPdu {
    /// NOP-In (section 11.19): a ping from the target when `ttt` is not reserved.
    NopIn {
        /// Initiator Task Tag (reserved for a target's ping).
        itt: u32,
        /// Target Transfer Tag (echoed in the answer).
        ttt: u32,
        /// Sequence numbers.
        seq: Seq,
    },
    /// SCSI Response (section 11.4).
    ScsiResponse {
        /// The command.
        itt: u32,
        /// Response: 0 command completed at target; else target failure.
        response: u8,
        /// SCSI status.
        status: u8,
        /// Byte 1: the residual flags.
        flags: u8,
        /// Residual Count.
        residual: u32,
        /// Sequence numbers.
        seq: Seq,
    },
    /// SCSI Data-In (section 11.7).
    DataIn {
        /// The command.
        itt: u32,
        /// Byte 1: F, A, O, U, S.
        flags: u8,
        /// Status (valid with S).
        status: u8,
        /// Buffer Offset.
        offset: u32,
        /// Residual Count (valid with S).
        residual: u32,
        /// Sequence numbers (StatSN valid with S).
        seq: Seq,
    },
    /// Ready To Transfer (section 11.8).
    R2t {
        /// The command.
        itt: u32,
        /// Target Transfer Tag to quote in the Data-Out.
        ttt: u32,
        /// Buffer Offset.
        offset: u32,
        /// Desired Data Transfer Length.
        length: u32,
        /// Sequence numbers.
        seq: Seq,
    },
    /// Login Response (section 11.13).
    LoginResponse {
        /// T bit.
        transit: bool,
        /// C bit.
        cont: bool,
        /// Current stage.
        csg: Stage,
        /// Next stage (valid with T).
        nsg: Stage,
        /// TSIH.
        tsih: u16,
        /// Status-Class.
        status_class: u8,
        /// Status-Detail.
        status_detail: u8,
        /// Sequence numbers.
        seq: Seq,
    },
    /// Logout Response (section 11.15).
    LogoutResponse {
        /// Response (0: closed successfully).
        response: u8,
        /// Sequence numbers.
        seq: Seq,
    },
    /// Reject (section 11.17): the rejected header is in the data segment.
    Reject {
        /// Reason code.
        reason: u8,
        /// Sequence numbers.
        seq: Seq,
    },
    /// Asynchronous Message (section 11.9).
    AsyncMessage {
        /// AsyncEvent.
        event: u8,
        /// Sequence numbers.
        seq: Seq,
    },
    /// Text Response (section 11.11); unused by this initiator.
    TextResponse {
        /// Sequence numbers.
        seq: Seq,
    },
}

/// A header that cannot be a target's PDU.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PduError {
    /// The opcode is not one a target sends.
    #[error("unknown or initiator-only opcode {0:#04x}")]
    UnknownOpcode(u8),
    /// A login stage value is reserved.
    #[error("login response with the reserved stage value 2")]
    BadStage,
    /// The data segment is longer than this initiator accepts.
    #[error("data segment of {len} bytes exceeds the limit of {max}")]
    TooLong {
        /// DataSegmentLength.
        len: usize,
        /// The limit.
        max: usize,
    },
}

impl TargetPdu {
    /// Decodes a target PDU's header. `max_data` bounds DataSegmentLength, so a corrupt or
    /// hostile length can never make the caller allocate or wait for more.
    pub fn parse(h: &Bhs, max_data: usize) -> Result<TargetPdu, PduError> {
        if h.data_len() > max_data {
            return Err(PduError::TooLong {
                len: h.data_len(),
                max: max_data,
            });
        }
        let seq = Seq {
            stat_sn: h.word24.get(),
            exp_cmd_sn: h.word28.get(),
            max_cmd_sn: h.tail_word(0),
        };
        let itt = h.itt.get();
        Ok(match h.opcode {
            opcode::NOP_IN => TargetPdu::NopIn {
                itt,
                ttt: h.word20.get(),
                seq,
            },
            opcode::SCSI_RESPONSE => TargetPdu::ScsiResponse {
                itt,
                response: h.byte2,
                status: h.byte3,
                flags: h.flags,
                residual: h.tail_word(3),
                seq,
            },
            opcode::DATA_IN => TargetPdu::DataIn {
                itt,
                flags: h.flags,
                status: h.byte3,
                offset: h.tail_word(2),
                residual: h.tail_word(3),
                seq,
            },
            opcode::R2T => TargetPdu::R2t {
                itt,
                ttt: h.word20.get(),
                offset: h.tail_word(2),
                length: h.tail_word(3),
                seq,
            },
            opcode::LOGIN_RESPONSE => TargetPdu::LoginResponse {
                transit: h.flags & flags::TRANSIT != 0,
                cont: h.flags & flags::CONTINUE != 0,
                csg: Stage::from_bits(h.flags >> 2).ok_or(PduError::BadStage)?,
                nsg: if h.flags & flags::TRANSIT != 0 {
                    Stage::from_bits(h.flags).ok_or(PduError::BadStage)?
                } else {
                    Stage::from_bits(h.flags >> 2).ok_or(PduError::BadStage)?
                },
                tsih: u16::from_be_bytes([h.lun[6], h.lun[7]]),
                status_class: h.tail[4],
                status_detail: h.tail[5],
                seq,
            },
            opcode::LOGOUT_RESPONSE => TargetPdu::LogoutResponse {
                response: h.byte2,
                seq,
            },
            opcode::REJECT => TargetPdu::Reject {
                reason: h.byte2,
                seq,
            },
            opcode::ASYNC_MESSAGE => TargetPdu::AsyncMessage {
                event: h.tail[4],
                seq,
            },
            opcode::TEXT_RESPONSE => TargetPdu::TextResponse { seq },
            other => return Err(PduError::UnknownOpcode(other)),
        })
    }
}

/// Serial number arithmetic (RFC 1982, 32 bits): whether `a` is at or before `b`.
pub fn sn_le(a: u32, b: u32) -> bool {
    a == b || (b.wrapping_sub(a) as i32) > 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scsi_command_layout() {
        let mut cdb = [0u8; 16];
        cdb[0] = 0x88;
        let h = Bhs::scsi_command(encode_lun(1), 7, 100, 5, &cdb, DataDir::In, 4096, 0, true);
        let b = h.to_bytes();
        assert_eq!(b[0], 0x01);
        assert_eq!(b[1], 0x80 | 0x40 | 0x01);
        assert_eq!(&b[8..10], &[0, 1]);
        assert_eq!(&b[16..20], &7u32.to_be_bytes());
        assert_eq!(&b[20..24], &4096u32.to_be_bytes());
        assert_eq!(&b[24..28], &100u32.to_be_bytes());
        assert_eq!(&b[28..32], &5u32.to_be_bytes());
        assert_eq!(b[32], 0x88);
        let w = Bhs::scsi_command(encode_lun(0), 1, 1, 1, &cdb, DataDir::Out, 8192, 8192, true);
        assert_eq!(w.flags, 0x80 | 0x20 | 0x01);
        assert_eq!(w.data_len(), 8192);
        assert_eq!(&w.to_bytes()[5..8], &[0, 0x20, 0]);
    }

    #[test]
    fn login_and_data_out_layout() {
        let h = Bhs::login_request(
            [0x80, 1, 2, 3, 4, 5],
            0,
            0,
            0,
            1,
            0,
            Stage::Security,
            Stage::Operational,
            true,
            10,
        );
        let b = h.to_bytes();
        assert_eq!(b[0], 0x43);
        assert_eq!(b[1], 0x81);
        assert_eq!(&b[8..14], &[0x80, 1, 2, 3, 4, 5]);
        assert_eq!(h.data_len(), 10);
        let op = Bhs::login_request(
            [0; 6],
            0,
            0,
            0,
            1,
            0,
            Stage::Operational,
            Stage::FullFeature,
            true,
            0,
        );
        assert_eq!(op.flags, 0x87);
        let d = Bhs::data_out(encode_lun(2), 9, 0x1234, 3, 4, 65536, 512, true);
        let b = d.to_bytes();
        assert_eq!((b[0], b[1]), (0x05, 0x80));
        assert_eq!(&b[20..24], &0x1234u32.to_be_bytes());
        assert_eq!(&b[36..40], &4u32.to_be_bytes());
        assert_eq!(&b[40..44], &65536u32.to_be_bytes());
        assert_eq!(encode_lun(300), [0x41, 44, 0, 0, 0, 0, 0, 0]);
    }

    fn header(op: u8, fill: impl FnOnce(&mut [u8; 48])) -> Bhs {
        let mut b = [0u8; 48];
        b[0] = op;
        fill(&mut b);
        Bhs::read_from(&b)
    }

    #[test]
    fn target_pdus_decode() {
        let h = header(0x25, |b| {
            b[1] = 0x81;
            b[3] = 0;
            b[5..8].copy_from_slice(&[0, 0x10, 0]);
            b[16..20].copy_from_slice(&3u32.to_be_bytes());
            b[24..28].copy_from_slice(&11u32.to_be_bytes());
            b[32..36].copy_from_slice(&40u32.to_be_bytes());
            b[40..44].copy_from_slice(&8192u32.to_be_bytes());
        });
        assert_eq!(h.data_len(), 4096);
        match TargetPdu::parse(&h, 1 << 20).unwrap() {
            TargetPdu::DataIn {
                itt,
                flags,
                offset,
                seq,
                ..
            } => {
                assert_eq!((itt, flags, offset), (3, 0x81, 8192));
                assert_eq!((seq.stat_sn, seq.max_cmd_sn), (11, 40));
            }
            other => panic!("{other:?}"),
        }
        let r = header(0x23, |b| {
            b[1] = 0x87;
            b[14..16].copy_from_slice(&5u16.to_be_bytes());
            b[36] = 2;
            b[37] = 3;
        });
        assert_eq!(
            TargetPdu::parse(&r, 8192).unwrap(),
            TargetPdu::LoginResponse {
                transit: true,
                cont: false,
                csg: Stage::Operational,
                nsg: Stage::FullFeature,
                tsih: 5,
                status_class: 2,
                status_detail: 3,
                seq: Seq::default(),
            }
        );
    }

    #[test]
    fn malformed_headers_are_refused() {
        // Initiator opcodes, reserved opcodes.
        for op in [0x00, 0x01, 0x03, 0x05, 0x3e, 0x7f, 0xff] {
            assert!(
                matches!(
                    TargetPdu::parse(&header(op, |_| {}), 8192),
                    Err(PduError::UnknownOpcode(_))
                ),
                "{op:#x}"
            );
        }
        // A data segment beyond the negotiated limit.
        let long = header(0x25, |b| b[5..8].copy_from_slice(&[0xff, 0xff, 0xff]));
        assert_eq!(
            TargetPdu::parse(&long, 262_144),
            Err(PduError::TooLong {
                len: 0xff_ffff,
                max: 262_144
            })
        );
        // The reserved login stage 2.
        let stage = header(0x23, |b| b[1] = 0x80 | (2 << 2) | 3);
        assert_eq!(TargetPdu::parse(&stage, 8192), Err(PduError::BadStage));
        let next = header(0x23, |b| b[1] = 0x80 | (1 << 2) | 2);
        assert_eq!(TargetPdu::parse(&next, 8192), Err(PduError::BadStage));
    }

    #[test]
    fn serial_numbers_wrap() {
        assert!(sn_le(1, 1));
        assert!(sn_le(1, 2));
        assert!(!sn_le(2, 1));
        assert!(sn_le(u32::MAX, 0));
        assert!(!sn_le(0, u32::MAX));
        assert_eq!(padded(5), 8);
        assert_eq!(padded(8), 8);
    }
}
