//! Typed decoding of submission queue entries into command enums.
//!
//! 0's based fields are converted to counts here, so handlers never see them. Commands the
//! decoder does not know are `Unknown` rather than an error: the controller answers them with
//! Invalid Command Opcode.

use crate::opcode::{self, admin, fctype, io};
use crate::queue::Sqe;

/// An admin queue command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AdminCommand {
    /// Get Log Page.
    GetLogPage(GetLogPage),
    /// Identify.
    Identify(Identify),
    /// Abort a command on a submission queue.
    Abort {
        /// Submission queue of the command to abort.
        sqid: u16,
        /// Command identifier to abort.
        cid: u16,
    },
    /// Set Features.
    SetFeatures {
        /// Feature identifier.
        fid: u8,
        /// Save across resets.
        save: bool,
        /// Command dword 11 (the feature value).
        cdw11: u32,
    },
    /// Get Features.
    GetFeatures {
        /// Feature identifier.
        fid: u8,
        /// Select: 0 current, 1 default, 2 saved, 3 supported capabilities.
        sel: u8,
        /// Command dword 11.
        cdw11: u32,
    },
    /// Asynchronous Event Request.
    AsyncEventRequest,
    /// Keep Alive.
    KeepAlive,
    /// A fabrics command (opcode 0x7F).
    Fabrics(FabricsCommand),
    /// Any other opcode.
    Unknown(u8),
}

/// Get Log Page fields (NVMe Base 2.0, Figure 196-199).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GetLogPage {
    /// Log page identifier.
    pub lid: u8,
    /// Log specific parameter.
    pub lsp: u8,
    /// Retain asynchronous event.
    pub rae: bool,
    /// Number of bytes to return (converted from the 0's based dword count).
    pub len: u64,
    /// Log page offset in bytes.
    pub offset: u64,
}

/// Identify fields (NVMe Base 2.0, Figure 273).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Identify {
    /// Controller or namespace structure.
    pub cns: u8,
    /// Controller identifier.
    pub cntid: u16,
    /// Namespace identifier from the SQE.
    pub nsid: u32,
    /// Command set identifier.
    pub csi: u8,
}

/// Identify CNS values.
pub mod cns {
    /// Identify Namespace (NVM command set).
    pub const NAMESPACE: u8 = 0x00;
    /// Identify Controller.
    pub const CONTROLLER: u8 = 0x01;
    /// Active Namespace ID list.
    pub const ACTIVE_NS_LIST: u8 = 0x02;
    /// Namespace Identification Descriptor list.
    pub const NS_DESCRIPTORS: u8 = 0x03;
    /// I/O Command Set specific Identify Namespace.
    pub const CSI_NAMESPACE: u8 = 0x05;
    /// I/O Command Set specific Identify Controller.
    pub const CSI_CONTROLLER: u8 = 0x06;
    /// I/O Command Set specific Active Namespace ID list.
    pub const CSI_ACTIVE_NS_LIST: u8 = 0x07;
    /// I/O Command Set Independent Identify Namespace.
    pub const CS_INDEPENDENT_NAMESPACE: u8 = 0x08;
}

/// Log page identifiers.
pub mod log_id {
    /// Error Information.
    pub const ERROR_INFO: u8 = 0x01;
    /// SMART / Health Information.
    pub const SMART: u8 = 0x02;
    /// Firmware Slot Information.
    pub const FW_SLOT: u8 = 0x03;
    /// Changed Namespace List.
    pub const CHANGED_NS_LIST: u8 = 0x04;
    /// Commands Supported and Effects.
    pub const CMD_EFFECTS: u8 = 0x05;
    /// Asymmetric Namespace Access.
    pub const ANA: u8 = 0x0C;
    /// Discovery.
    pub const DISCOVERY: u8 = 0x70;
    /// Reservation Notification.
    pub const RESERVATION_NOTIFICATION: u8 = 0x80;
}

/// A fabrics command (NVMe-oF 1.1, section 3.3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FabricsCommand {
    /// Connect (data: 1024-byte [`crate::fabrics::ConnectData`]).
    Connect(Connect),
    /// Property Get.
    PropertyGet {
        /// True for an 8-byte property.
        size8: bool,
        /// Property offset.
        offset: u32,
    },
    /// Property Set.
    PropertySet {
        /// True for an 8-byte property.
        size8: bool,
        /// Property offset.
        offset: u32,
        /// Value to set.
        value: u64,
    },
    /// Disconnect (an I/O queue).
    Disconnect,
    /// Authentication Send.
    AuthSend,
    /// Authentication Receive.
    AuthReceive,
    /// Any other fabrics command type.
    Unknown(u8),
}

/// Connect attribute (CATTR) bit 2: the host asks to disable SQ flow control.
pub const CATTR_SQ_FLOW_CONTROL_DISABLE: u8 = 0b100;

/// Connect command fields (NVMe-oF 1.1, Figure 21).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Connect {
    /// Record format (0).
    pub recfmt: u16,
    /// Queue identifier (0 = admin).
    pub qid: u16,
    /// Submission queue size as a count (converted from the 0's based field).
    pub sqsize: u32,
    /// Connect attributes.
    pub cattr: u8,
    /// Keep alive timeout in milliseconds (admin queue only).
    pub kato_ms: u32,
}

impl Connect {
    /// Whether the host asks to disable SQ flow control (CATTR bit 2).
    pub fn sq_flow_control_disabled(&self) -> bool {
        self.cattr & CATTR_SQ_FLOW_CONTROL_DISABLE != 0
    }
}

/// An I/O queue command of the NVM command set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoCommand {
    /// Read.
    Read(ReadWrite),
    /// Write.
    Write(ReadWrite),
    /// Flush.
    Flush,
    /// Write Zeroes.
    WriteZeroes {
        /// Starting LBA and block count.
        range: ReadWrite,
        /// Deallocate the blocks (DEAC).
        deallocate: bool,
    },
    /// Dataset Management.
    DatasetManagement {
        /// Number of 16-byte ranges in the data (converted from the 0's based NR).
        ranges: u16,
        /// Attribute: deallocate.
        deallocate: bool,
    },
    /// Reservation Register, Acquire or Release (the opcode says which): CDW10 and 16 bytes
    /// of data (8 for Release), decoded by the target's reservation module.
    Reservation {
        /// The opcode.
        opcode: u8,
        /// Command dword 10 (action, IEKEY, RTYPE, CPTPL).
        cdw10: u32,
    },
    /// Reservation Report.
    ReservationReport {
        /// Bytes the host's buffer holds (from the 0's based NUMD, in dwords).
        len: u64,
        /// Extended data structure (128-bit host identifiers).
        eds: bool,
    },
    /// A fabrics command (opcode 0x7F) on an I/O queue.
    Fabrics(FabricsCommand),
    /// Any other opcode.
    Unknown(u8),
}

/// Read/Write/Write Zeroes range fields (NVM Command Set 1.0, Figure 39).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadWrite {
    /// Namespace identifier.
    pub nsid: u32,
    /// Starting LBA.
    pub slba: u64,
    /// Number of logical blocks (converted from the 0's based NLB).
    pub nlb: u32,
    /// Force unit access.
    pub fua: bool,
}

fn slba(sqe: &Sqe) -> u64 {
    u64::from(sqe.cdw10.get()) | (u64::from(sqe.cdw11.get()) << 32)
}

fn read_write(sqe: &Sqe) -> ReadWrite {
    let cdw12 = sqe.cdw12.get();
    ReadWrite {
        nsid: sqe.nsid.get(),
        slba: slba(sqe),
        nlb: (cdw12 & 0xFFFF) + 1,
        fua: cdw12 & (1 << 30) != 0,
    }
}

impl FabricsCommand {
    /// Decodes a fabrics command (the SQE opcode must be 0x7F).
    pub fn parse(sqe: &Sqe) -> Self {
        let b = sqe.to_array();
        let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let u64_at = |o: usize| u64::from(u32_at(o)) | (u64::from(u32_at(o + 4)) << 32);
        match sqe.fctype() {
            fctype::CONNECT => FabricsCommand::Connect(Connect {
                recfmt: u16_at(40),
                qid: u16_at(42),
                sqsize: u32::from(u16_at(44)) + 1,
                cattr: b[46],
                kato_ms: u32_at(48),
            }),
            fctype::PROPERTY_GET => FabricsCommand::PropertyGet {
                size8: b[40] & 0x7 == 1,
                offset: u32_at(44),
            },
            fctype::PROPERTY_SET => FabricsCommand::PropertySet {
                size8: b[40] & 0x7 == 1,
                offset: u32_at(44),
                value: u64_at(48),
            },
            fctype::DISCONNECT => FabricsCommand::Disconnect,
            fctype::AUTH_SEND => FabricsCommand::AuthSend,
            fctype::AUTH_RECEIVE => FabricsCommand::AuthReceive,
            other => FabricsCommand::Unknown(other),
        }
    }

    /// Encodes this fabrics command into an SQE with the given command identifier.
    pub fn encode(&self, cid: u16) -> Sqe {
        let mut b = [0u8; 64];
        b[0] = opcode::FABRICS;
        b[2..4].copy_from_slice(&cid.to_le_bytes());
        match *self {
            FabricsCommand::Connect(c) => {
                b[4] = fctype::CONNECT;
                b[40..42].copy_from_slice(&c.recfmt.to_le_bytes());
                b[42..44].copy_from_slice(&c.qid.to_le_bytes());
                let sqsize = u16::try_from(c.sqsize.saturating_sub(1)).unwrap_or(u16::MAX);
                b[44..46].copy_from_slice(&sqsize.to_le_bytes());
                b[46] = c.cattr;
                b[48..52].copy_from_slice(&c.kato_ms.to_le_bytes());
            }
            FabricsCommand::PropertyGet { size8, offset } => {
                b[4] = fctype::PROPERTY_GET;
                b[40] = u8::from(size8);
                b[44..48].copy_from_slice(&offset.to_le_bytes());
            }
            FabricsCommand::PropertySet {
                size8,
                offset,
                value,
            } => {
                b[4] = fctype::PROPERTY_SET;
                b[40] = u8::from(size8);
                b[44..48].copy_from_slice(&offset.to_le_bytes());
                b[48..56].copy_from_slice(&value.to_le_bytes());
            }
            FabricsCommand::Disconnect => b[4] = fctype::DISCONNECT,
            FabricsCommand::AuthSend => b[4] = fctype::AUTH_SEND,
            FabricsCommand::AuthReceive => b[4] = fctype::AUTH_RECEIVE,
            FabricsCommand::Unknown(t) => b[4] = t,
        }
        let mut sqe = Sqe::from_array(&b);
        sqe.set_sgl();
        sqe
    }
}

impl AdminCommand {
    /// Decodes an admin queue SQE.
    pub fn parse(sqe: &Sqe) -> Self {
        let cdw10 = sqe.cdw10.get();
        let cdw11 = sqe.cdw11.get();
        match sqe.opcode {
            opcode::FABRICS => AdminCommand::Fabrics(FabricsCommand::parse(sqe)),
            admin::GET_LOG_PAGE => {
                let numdl = u64::from(cdw10 >> 16);
                let numdu = u64::from(cdw11 & 0xFFFF);
                let dwords = ((numdu << 16) | numdl) + 1;
                AdminCommand::GetLogPage(GetLogPage {
                    lid: (cdw10 & 0xFF) as u8,
                    lsp: ((cdw10 >> 8) & 0x7F) as u8,
                    rae: cdw10 & (1 << 15) != 0,
                    len: dwords * 4,
                    offset: u64::from(sqe.cdw12.get()) | (u64::from(sqe.cdw13.get()) << 32),
                })
            }
            admin::IDENTIFY => AdminCommand::Identify(Identify {
                cns: (cdw10 & 0xFF) as u8,
                cntid: (cdw10 >> 16) as u16,
                nsid: sqe.nsid.get(),
                csi: (cdw11 >> 24) as u8,
            }),
            admin::ABORT => AdminCommand::Abort {
                sqid: (cdw10 & 0xFFFF) as u16,
                cid: (cdw10 >> 16) as u16,
            },
            admin::SET_FEATURES => AdminCommand::SetFeatures {
                fid: (cdw10 & 0xFF) as u8,
                save: cdw10 & (1 << 31) != 0,
                cdw11,
            },
            admin::GET_FEATURES => AdminCommand::GetFeatures {
                fid: (cdw10 & 0xFF) as u8,
                sel: ((cdw10 >> 8) & 0x7) as u8,
                cdw11,
            },
            admin::ASYNC_EVENT_REQUEST => AdminCommand::AsyncEventRequest,
            admin::KEEP_ALIVE => AdminCommand::KeepAlive,
            other => AdminCommand::Unknown(other),
        }
    }
}

impl IoCommand {
    /// Decodes an I/O queue SQE.
    pub fn parse(sqe: &Sqe) -> Self {
        match sqe.opcode {
            opcode::FABRICS => IoCommand::Fabrics(FabricsCommand::parse(sqe)),
            io::READ => IoCommand::Read(read_write(sqe)),
            io::WRITE => IoCommand::Write(read_write(sqe)),
            io::FLUSH => IoCommand::Flush,
            io::WRITE_ZEROES => IoCommand::WriteZeroes {
                range: read_write(sqe),
                deallocate: sqe.cdw12.get() & (1 << 25) != 0,
            },
            io::DATASET_MANAGEMENT => IoCommand::DatasetManagement {
                ranges: (sqe.cdw10.get() & 0xFF) as u16 + 1,
                deallocate: sqe.cdw11.get() & (1 << 2) != 0,
            },
            io::RESERVATION_REGISTER | io::RESERVATION_ACQUIRE | io::RESERVATION_RELEASE => {
                IoCommand::Reservation {
                    opcode: sqe.opcode,
                    cdw10: sqe.cdw10.get(),
                }
            }
            io::RESERVATION_REPORT => IoCommand::ReservationReport {
                len: (u64::from(sqe.cdw10.get()) + 1) * 4,
                eds: sqe.cdw11.get() & 1 != 0,
            },
            other => IoCommand::Unknown(other),
        }
    }
}

/// Builders for the SQEs a host sends. The data pointer is left for the transport to fill.
pub mod build {
    use super::*;
    use zerocopy::little_endian::{U16, U32};

    fn base(opcode: u8, cid: u16, nsid: u32) -> Sqe {
        let mut sqe = Sqe {
            opcode,
            cid: U16::new(cid),
            nsid: U32::new(nsid),
            ..Default::default()
        };
        sqe.set_sgl();
        sqe
    }

    /// Read or Write of `nlb` blocks (1..=65536) at `slba`.
    pub fn read_write(write: bool, cid: u16, nsid: u32, slba: u64, nlb: u32) -> Sqe {
        let mut sqe = base(if write { io::WRITE } else { io::READ }, cid, nsid);
        sqe.cdw10 = U32::new(slba as u32);
        sqe.cdw11 = U32::new((slba >> 32) as u32);
        sqe.cdw12 = U32::new(nlb.saturating_sub(1) & 0xFFFF);
        sqe
    }

    /// Reservation Register (`opcode` RESERVATION_REGISTER), Acquire or Release with
    /// command dword 10 `cdw10`; the data (the keys) goes with it.
    pub fn reservation(opcode: u8, cid: u16, nsid: u32, cdw10: u32) -> Sqe {
        let mut sqe = base(opcode, cid, nsid);
        sqe.cdw10 = U32::new(cdw10);
        sqe
    }

    /// Reservation Report into a buffer of `len` bytes (a multiple of 4, at least 4), with
    /// the extended data structure when `eds`.
    pub fn reservation_report(cid: u16, nsid: u32, len: u32, eds: bool) -> Sqe {
        let mut sqe = base(io::RESERVATION_REPORT, cid, nsid);
        sqe.cdw10 = U32::new((len / 4).saturating_sub(1));
        sqe.cdw11 = U32::new(u32::from(eds));
        sqe
    }

    /// Write of `nlb` blocks with Force Unit Access (CDW12 bit 30, NVM Command Set 1.0
    /// Figure 65): the controller completes it once the data is in non-volatile media.
    pub fn write_fua(cid: u16, nsid: u32, slba: u64, nlb: u32) -> Sqe {
        let mut sqe = read_write(true, cid, nsid, slba, nlb);
        sqe.cdw12 = U32::new(sqe.cdw12.get() | (1 << 30));
        sqe
    }

    /// Write Zeroes of `nlb` blocks, optionally deallocating them.
    pub fn write_zeroes(cid: u16, nsid: u32, slba: u64, nlb: u32, deallocate: bool) -> Sqe {
        let mut sqe = read_write(false, cid, nsid, slba, nlb);
        sqe.opcode = io::WRITE_ZEROES;
        if deallocate {
            sqe.cdw12 = U32::new(sqe.cdw12.get() | (1 << 25));
        }
        sqe
    }

    /// Dataset Management with `ranges` 16-byte ranges in the data, deallocate attribute set.
    pub fn deallocate(cid: u16, nsid: u32, ranges: u16) -> Sqe {
        let mut sqe = base(io::DATASET_MANAGEMENT, cid, nsid);
        sqe.cdw10 = U32::new(u32::from(ranges.saturating_sub(1)) & 0xFF);
        sqe.cdw11 = U32::new(1 << 2);
        sqe
    }

    /// Flush.
    pub fn flush(cid: u16, nsid: u32) -> Sqe {
        base(io::FLUSH, cid, nsid)
    }

    /// Identify with the given CNS and NSID.
    pub fn identify(cid: u16, cns: u8, nsid: u32) -> Sqe {
        let mut sqe = base(admin::IDENTIFY, cid, nsid);
        sqe.cdw10 = U32::new(u32::from(cns));
        sqe
    }

    /// Get Log Page of `len` bytes (a multiple of 4) at byte `offset`.
    pub fn get_log_page(cid: u16, lid: u8, nsid: u32, len: u32, offset: u64) -> Sqe {
        let mut sqe = base(admin::GET_LOG_PAGE, cid, nsid);
        let numd = (len / 4).saturating_sub(1);
        sqe.cdw10 = U32::new(u32::from(lid) | ((numd & 0xFFFF) << 16));
        sqe.cdw11 = U32::new(numd >> 16);
        sqe.cdw12 = U32::new(offset as u32);
        sqe.cdw13 = U32::new((offset >> 32) as u32);
        sqe
    }

    /// Set Features.
    pub fn set_features(cid: u16, fid: u8, cdw11: u32) -> Sqe {
        let mut sqe = base(admin::SET_FEATURES, cid, 0);
        sqe.cdw10 = U32::new(u32::from(fid));
        sqe.cdw11 = U32::new(cdw11);
        sqe
    }

    /// Get Features (current value).
    pub fn get_features(cid: u16, fid: u8) -> Sqe {
        let mut sqe = base(admin::GET_FEATURES, cid, 0);
        sqe.cdw10 = U32::new(u32::from(fid));
        sqe
    }

    /// Keep Alive.
    pub fn keep_alive(cid: u16) -> Sqe {
        base(admin::KEEP_ALIVE, cid, 0)
    }

    /// Asynchronous Event Request.
    pub fn async_event_request(cid: u16) -> Sqe {
        base(admin::ASYNC_EVENT_REQUEST, cid, 0)
    }

    /// Abort command `abort_cid` on submission queue `sqid`.
    pub fn abort(cid: u16, sqid: u16, abort_cid: u16) -> Sqe {
        let mut sqe = base(admin::ABORT, cid, 0);
        sqe.cdw10 = U32::new(u32::from(sqid) | (u32::from(abort_cid) << 16));
        sqe
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_write_round_trip() {
        let sqe = build::read_write(true, 9, 1, 0x1_0000_0002, 65536);
        match IoCommand::parse(&sqe) {
            IoCommand::Write(rw) => {
                assert_eq!(rw.slba, 0x1_0000_0002);
                assert_eq!(rw.nlb, 65536);
                assert_eq!(rw.nsid, 1);
            }
            other => panic!("unexpected {other:?}"),
        }
        assert_eq!(sqe.cid(), 9);
    }

    #[test]
    fn write_with_fua() {
        let sqe = build::write_fua(5, 1, 7, 2);
        assert_eq!(
            IoCommand::parse(&sqe),
            IoCommand::Write(ReadWrite {
                nsid: 1,
                slba: 7,
                nlb: 2,
                fua: true
            })
        );
        assert!(matches!(
            IoCommand::parse(&build::read_write(true, 5, 1, 7, 2)),
            IoCommand::Write(ReadWrite { fua: false, .. })
        ));
    }

    #[test]
    fn write_zeroes_and_dsm() {
        let sqe = build::write_zeroes(1, 2, 10, 8, true);
        assert_eq!(
            IoCommand::parse(&sqe),
            IoCommand::WriteZeroes {
                range: ReadWrite {
                    nsid: 2,
                    slba: 10,
                    nlb: 8,
                    fua: false
                },
                deallocate: true
            }
        );
        let sqe = build::deallocate(1, 2, 256);
        assert_eq!(
            IoCommand::parse(&sqe),
            IoCommand::DatasetManagement {
                ranges: 256,
                deallocate: true
            }
        );
        assert_eq!(IoCommand::parse(&build::flush(3, 1)), IoCommand::Flush);
    }

    #[test]
    fn admin_round_trip() {
        let sqe = build::get_log_page(4, log_id::DISCOVERY, 0, 3072, 1024);
        assert_eq!(
            AdminCommand::parse(&sqe),
            AdminCommand::GetLogPage(GetLogPage {
                lid: 0x70,
                lsp: 0,
                rae: false,
                len: 3072,
                offset: 1024
            })
        );
        let sqe = build::get_log_page(4, log_id::ERROR_INFO, 0, 4 * 0x2_0000, 0);
        match AdminCommand::parse(&sqe) {
            AdminCommand::GetLogPage(g) => assert_eq!(g.len, 4 * 0x2_0000),
            other => panic!("unexpected {other:?}"),
        }
        let sqe = build::identify(5, cns::NS_DESCRIPTORS, 3);
        assert_eq!(
            AdminCommand::parse(&sqe),
            AdminCommand::Identify(Identify {
                cns: 3,
                cntid: 0,
                nsid: 3,
                csi: 0
            })
        );
        assert_eq!(
            AdminCommand::parse(&build::abort(1, 2, 77)),
            AdminCommand::Abort { sqid: 2, cid: 77 }
        );
        assert_eq!(
            AdminCommand::parse(&build::set_features(1, 7, 0x0003_0003)),
            AdminCommand::SetFeatures {
                fid: 7,
                save: false,
                cdw11: 0x0003_0003
            }
        );
        assert_eq!(
            AdminCommand::parse(&build::keep_alive(1)),
            AdminCommand::KeepAlive
        );
        assert_eq!(
            AdminCommand::parse(&build::async_event_request(1)),
            AdminCommand::AsyncEventRequest
        );
    }

    #[test]
    fn fabrics_round_trip() {
        let cmds = [
            FabricsCommand::Connect(Connect {
                recfmt: 0,
                qid: 3,
                sqsize: 128,
                cattr: 4,
                kato_ms: 5000,
            }),
            FabricsCommand::PropertyGet {
                size8: true,
                offset: 0,
            },
            FabricsCommand::PropertySet {
                size8: false,
                offset: 0x14,
                value: 0x46_0001,
            },
            FabricsCommand::Disconnect,
        ];
        for c in cmds {
            let sqe = c.encode(11);
            assert_eq!(sqe.opcode, 0x7F);
            assert_eq!(AdminCommand::parse(&sqe), AdminCommand::Fabrics(c));
            assert_eq!(IoCommand::parse(&sqe), IoCommand::Fabrics(c));
        }
    }

    #[test]
    fn unknown_opcodes() {
        let mut sqe = Sqe {
            opcode: 0x99,
            ..Default::default()
        };
        assert_eq!(AdminCommand::parse(&sqe), AdminCommand::Unknown(0x99));
        assert_eq!(IoCommand::parse(&sqe), IoCommand::Unknown(0x99));
        let r = build::reservation(io::RESERVATION_ACQUIRE, 1, 1, 0x0201);
        assert_eq!(
            IoCommand::parse(&r),
            IoCommand::Reservation {
                opcode: io::RESERVATION_ACQUIRE,
                cdw10: 0x0201
            }
        );
        assert_eq!(
            IoCommand::parse(&build::reservation_report(1, 1, 4096, true)),
            IoCommand::ReservationReport {
                len: 4096,
                eds: true
            }
        );
        sqe.opcode = 0x7F;
        sqe.nsid = zerocopy::little_endian::U32::new(0x42);
        assert_eq!(
            IoCommand::parse(&sqe),
            IoCommand::Fabrics(FabricsCommand::Unknown(0x42))
        );
    }
}
