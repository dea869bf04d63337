//! NVMe/TCP PDU headers (NVM Express TCP Transport Specification, revision 1.0).
//!
//! Every PDU starts with the 8-byte common header ([`CommonHeader`], section 3.6.2.1,
//! Figure 19) followed by a PDU-specific header; together they are `HLEN` bytes. When header
//! digests are negotiated a 4-byte CRC32C (`HDGST`) follows the header, then optional padding
//! up to `PDO`, the PDU data, and, when data digests are negotiated and data is present, a
//! 4-byte CRC32C of the data (`DDGST`). `PLEN` covers all of it.
//!
//! The structs here are the exact wire layout (`#[repr(C)]`, little-endian, no alignment
//! requirement) and can be viewed in place over a received byte buffer with
//! [`from_prefix`](CommonHeader::from_prefix) or serialized with
//! [`as_wire_bytes`](CommonHeader::as_wire_bytes). Fields are reached through named
//! accessors; no caller needs to shift or mask bits.

use core::mem::{offset_of, size_of};

use zerocopy::little_endian::{U16, U32};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

/// Length of the PDU common header (Figure 19).
pub const CH_LEN: usize = 8;
/// Length of a header or data digest (CRC32C), section 3.3.1.1.
pub const DIGEST_LEN: usize = 4;
/// Fixed HLEN and PLEN of ICReq and ICResp (Figures 20 and 21).
pub const IC_PDU_LEN: usize = 128;
/// Fixed HLEN of H2CTermReq and C2HTermReq (Figures 22 and 23).
pub const TERM_REQ_HLEN: usize = 24;
/// Largest amount of offending-header data a TermReq may carry (section 3.5).
pub const TERM_REQ_MAX_DATA: usize = 128;
/// Largest valid PLEN of a TermReq: 24-byte header plus 128 bytes of data (section 3.5).
pub const TERM_REQ_MAX_PLEN: usize = TERM_REQ_HLEN + TERM_REQ_MAX_DATA;
/// Fixed HLEN of CapsuleCmd: common header plus a 64-byte SQE (Figure 24).
pub const CAPSULE_CMD_HLEN: usize = 72;
/// Fixed HLEN of CapsuleResp: common header plus a 16-byte CQE (Figure 25).
pub const CAPSULE_RESP_HLEN: usize = 24;
/// Fixed HLEN of H2CData and C2HData (Figures 26 and 27).
pub const DATA_PDU_HLEN: usize = 24;
/// Fixed HLEN of R2T (Figure 28).
pub const R2T_HLEN: usize = 24;
/// Size of a submission queue entry carried in a CapsuleCmd.
pub const SQE_LEN: usize = 64;
/// Size of a completion queue entry carried in a CapsuleResp.
pub const CQE_LEN: usize = 16;
/// The only defined PDU format version (PFV), Figures 20 and 21.
pub const PFV_1_0: u16 = 0;
/// Largest valid HPDA/CPDA value (0's based dwords: 31 means 128-byte alignment).
pub const MAX_PDA: u8 = 31;
/// Smallest MAXH2CDATA that the Linux host accepts (the spec says "should be no less").
pub const MIN_MAXH2CDATA: u32 = 4096;

/// Common-header FLAGS bits (Figures 24 to 28). Which bits are defined depends on the PDU type.
pub mod flags {
    /// HDGSTF: a header digest follows the PDU header.
    pub const HDGSTF: u8 = 0x01;
    /// DDGSTF: a data digest follows the PDU data.
    pub const DDGSTF: u8 = 0x02;
    /// LAST_PDU: last H2CData PDU for an R2T, or last C2HData PDU for a command.
    pub const LAST_PDU: u8 = 0x04;
    /// SUCCESS (C2HData only): the command completed successfully and no CapsuleResp follows.
    pub const SUCCESS: u8 = 0x08;
}

/// Bits of the DGST field of ICReq and ICResp (Figures 20 and 21, byte 11).
pub mod dgst {
    /// HDGST_ENABLE: header digests requested (ICReq) or in use (ICResp).
    pub const HDGST_ENABLE: u8 = 0x01;
    /// DDGST_ENABLE: data digests requested (ICReq) or in use (ICResp).
    pub const DDGST_ENABLE: u8 = 0x02;
}

/// PDU type (opcode) from byte 0 of the common header (Figure 10).
///
/// Bit 0 is the direction: 0 for host to controller, 1 for controller to host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum PduType {
    /// Initialize Connection Request (host to controller), section 3.6.2.2.
    IcReq = 0x00,
    /// Initialize Connection Response (controller to host), section 3.6.2.3.
    IcResp = 0x01,
    /// Host to Controller Terminate Connection Request, section 3.6.2.4.
    H2cTermReq = 0x02,
    /// Controller to Host Terminate Connection Request, section 3.6.2.5.
    C2hTermReq = 0x03,
    /// Command Capsule (host to controller), section 3.6.2.6.
    CapsuleCmd = 0x04,
    /// Response Capsule (controller to host), section 3.6.2.7.
    CapsuleResp = 0x05,
    /// Host to Controller Data, section 3.6.2.8.
    H2cData = 0x06,
    /// Controller to Host Data, section 3.6.2.9.
    C2hData = 0x07,
    /// Ready to Transfer (controller to host), section 3.6.2.10.
    R2t = 0x09,
}

/// A PDU type byte that names no defined PDU (0x08 and 0x0A..=0xFF are reserved).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnknownPduType(pub u8);

impl core::fmt::Display for UnknownPduType {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "unknown NVMe/TCP PDU type {:#04x}", self.0)
    }
}

impl core::error::Error for UnknownPduType {}

impl TryFrom<u8> for PduType {
    type Error = UnknownPduType;

    fn try_from(value: u8) -> Result<Self, Self::Error> {
        Ok(match value {
            0x00 => Self::IcReq,
            0x01 => Self::IcResp,
            0x02 => Self::H2cTermReq,
            0x03 => Self::C2hTermReq,
            0x04 => Self::CapsuleCmd,
            0x05 => Self::CapsuleResp,
            0x06 => Self::H2cData,
            0x07 => Self::C2hData,
            0x09 => Self::R2t,
            other => return Err(UnknownPduType(other)),
        })
    }
}

impl From<PduType> for u8 {
    fn from(value: PduType) -> Self {
        value as u8
    }
}

impl PduType {
    /// True for PDUs that travel from the controller to the host (bit 0 of the opcode).
    pub const fn is_controller_to_host(self) -> bool {
        (self as u8) & 0x01 != 0
    }

    /// The fixed HLEN of this PDU type.
    pub const fn header_len(self) -> usize {
        match self {
            Self::IcReq | Self::IcResp => IC_PDU_LEN,
            Self::H2cTermReq | Self::C2hTermReq => TERM_REQ_HLEN,
            Self::CapsuleCmd => CAPSULE_CMD_HLEN,
            Self::CapsuleResp => CAPSULE_RESP_HLEN,
            Self::H2cData | Self::C2hData => DATA_PDU_HLEN,
            Self::R2t => R2T_HLEN,
        }
    }

    /// The FLAGS bits defined for this PDU type; all others are reserved.
    pub const fn defined_flags(self) -> u8 {
        match self {
            Self::IcReq | Self::IcResp | Self::H2cTermReq | Self::C2hTermReq => 0,
            Self::CapsuleCmd => flags::HDGSTF | flags::DDGSTF,
            Self::CapsuleResp | Self::R2t => flags::HDGSTF,
            Self::H2cData => flags::HDGSTF | flags::DDGSTF | flags::LAST_PDU,
            Self::C2hData => flags::HDGSTF | flags::DDGSTF | flags::LAST_PDU | flags::SUCCESS,
        }
    }

    /// True for PDU types that may carry PDU data after the header (and so a data digest).
    pub const fn may_carry_data(self) -> bool {
        matches!(self, Self::CapsuleCmd | Self::H2cData | Self::C2hData)
    }
}

/// Fatal Error Status (FES) of a TermReq (Figures 22 and 23, bytes 09:08).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum FatalErrorStatus {
    /// Invalid PDU Header Field; FEI holds the byte offset of the lowest invalid field.
    InvalidPduHeaderField = 0x01,
    /// PDU Sequence Error: an unexpected protocol sequence; FEI is reserved.
    PduSequenceError = 0x02,
    /// Header Digest Error; FEI holds the HDGST value that was received.
    HeaderDigestError = 0x03,
    /// Data Transfer Out of Range: data offset or offset plus length outside the
    /// command buffer (C2HData) or the R2T range (H2CData); FEI is reserved.
    DataTransferOutOfRange = 0x04,
    /// Data Transfer Limit Exceeded (in a C2HTermReq: H2CData longer than MAXH2CDATA);
    /// the same value means R2T Limit Exceeded in an H2CTermReq. FEI is reserved.
    DataTransferLimitExceeded = 0x05,
    /// Unsupported Parameter; FEI holds the byte offset of the unsupported field.
    UnsupportedParameter = 0x06,
}

impl FatalErrorStatus {
    /// R2T Limit Exceeded (H2CTermReq): an R2T beyond MAXR2T was received. Same code as
    /// [`FatalErrorStatus::DataTransferLimitExceeded`].
    pub const R2T_LIMIT_EXCEEDED: Self = Self::DataTransferLimitExceeded;

    /// The wire value.
    pub const fn code(self) -> u16 {
        self as u16
    }
}

/// A FES value that is reserved (0x0000 or 0x0007..=0xFFFF).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReservedFatalErrorStatus(pub u16);

impl core::fmt::Display for ReservedFatalErrorStatus {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "reserved NVMe/TCP fatal error status {:#06x}", self.0)
    }
}

impl core::error::Error for ReservedFatalErrorStatus {}

impl TryFrom<u16> for FatalErrorStatus {
    type Error = ReservedFatalErrorStatus;

    fn try_from(value: u16) -> Result<Self, Self::Error> {
        Ok(match value {
            0x01 => Self::InvalidPduHeaderField,
            0x02 => Self::PduSequenceError,
            0x03 => Self::HeaderDigestError,
            0x04 => Self::DataTransferOutOfRange,
            0x05 => Self::DataTransferLimitExceeded,
            0x06 => Self::UnsupportedParameter,
            other => return Err(ReservedFatalErrorStatus(other)),
        })
    }
}

/// Adds the size assert, in-place view and serialization helpers to a wire struct.
macro_rules! wire_struct {
    ($ty:ty, $size:expr) => {
        const _: () = assert!(size_of::<$ty>() == $size);

        impl $ty {
            /// Size of this structure on the wire.
            pub const WIRE_LEN: usize = $size;

            /// Views the first bytes of `bytes` as this structure, without copying.
            /// Returns `None` when `bytes` is too short.
            pub fn from_prefix(bytes: &[u8]) -> Option<&Self> {
                <Self as FromBytes>::ref_from_prefix(bytes)
                    .ok()
                    .map(|(v, _)| v)
            }

            /// Copies this structure out of the first bytes of `bytes`.
            /// Returns `None` when `bytes` is too short.
            pub fn read_from_prefix(bytes: &[u8]) -> Option<Self> {
                <Self as FromBytes>::read_from_prefix(bytes)
                    .ok()
                    .map(|(v, _)| v)
            }

            /// The wire bytes of this structure.
            pub fn as_wire_bytes(&self) -> &[u8] {
                <Self as IntoBytes>::as_bytes(self)
            }
        }
    };
}

/// PDU Common Header, CH (section 3.6.2.1, Figure 19).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned,
)]
#[repr(C)]
pub struct CommonHeader {
    pdu_type: u8,
    flags: u8,
    hlen: u8,
    pdo: u8,
    plen: U32,
}
wire_struct!(CommonHeader, CH_LEN);

impl CommonHeader {
    /// Byte offset of PDU-Type.
    pub const OFFSET_PDU_TYPE: u32 = offset_of!(Self, pdu_type) as u32;
    /// Byte offset of FLAGS.
    pub const OFFSET_FLAGS: u32 = offset_of!(Self, flags) as u32;
    /// Byte offset of HLEN.
    pub const OFFSET_HLEN: u32 = offset_of!(Self, hlen) as u32;
    /// Byte offset of PDO.
    pub const OFFSET_PDO: u32 = offset_of!(Self, pdo) as u32;
    /// Byte offset of PLEN.
    pub const OFFSET_PLEN: u32 = offset_of!(Self, plen) as u32;

    /// Builds a common header.
    pub fn new(pdu_type: PduType, flags: u8, hlen: u8, pdo: u8, plen: u32) -> Self {
        Self {
            pdu_type: pdu_type as u8,
            flags,
            hlen,
            pdo,
            plen: U32::new(plen),
        }
    }

    /// The raw PDU-Type byte.
    pub fn pdu_type_raw(&self) -> u8 {
        self.pdu_type
    }

    /// The PDU type, or an error for a reserved opcode.
    pub fn pdu_type(&self) -> Result<PduType, UnknownPduType> {
        PduType::try_from(self.pdu_type)
    }

    /// The raw FLAGS byte.
    pub fn flags(&self) -> u8 {
        self.flags
    }

    /// True when every bit of `flag` (see [`flags`]) is set.
    pub fn has_flag(&self, flag: u8) -> bool {
        self.flags & flag == flag
    }

    /// HDGSTF: a header digest follows the header.
    pub fn hdgstf(&self) -> bool {
        self.has_flag(flags::HDGSTF)
    }

    /// DDGSTF: a data digest follows the data.
    pub fn ddgstf(&self) -> bool {
        self.has_flag(flags::DDGSTF)
    }

    /// LAST_PDU flag (data PDUs).
    pub fn last_pdu(&self) -> bool {
        self.has_flag(flags::LAST_PDU)
    }

    /// SUCCESS flag (C2HData).
    pub fn success(&self) -> bool {
        self.has_flag(flags::SUCCESS)
    }

    /// HLEN: header length, not counting the header digest.
    pub fn hlen(&self) -> u8 {
        self.hlen
    }

    /// PDO: offset of the PDU data from the start of the PDU (0 when there is no data).
    pub fn pdo(&self) -> u8 {
        self.pdo
    }

    /// PLEN: total PDU length including digests, padding and data.
    pub fn plen(&self) -> u32 {
        self.plen.get()
    }

    /// Replaces FLAGS.
    pub fn set_flags(&mut self, flags: u8) {
        self.flags = flags;
    }

    /// Replaces PDO.
    pub fn set_pdo(&mut self, pdo: u8) {
        self.pdo = pdo;
    }

    /// Replaces PLEN.
    pub fn set_plen(&mut self, plen: u32) {
        self.plen = U32::new(plen);
    }
}

/// Initialize Connection Request PDU, ICReq (section 3.6.2.2, Figure 20).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned,
)]
#[repr(C)]
pub struct IcReq {
    ch: CommonHeader,
    pfv: U16,
    hpda: u8,
    dgst: u8,
    maxr2t: U32,
    reserved: [u8; 112],
}
wire_struct!(IcReq, IC_PDU_LEN);

impl IcReq {
    /// Byte offset of PFV.
    pub const OFFSET_PFV: u32 = offset_of!(Self, pfv) as u32;
    /// Byte offset of HPDA.
    pub const OFFSET_HPDA: u32 = offset_of!(Self, hpda) as u32;
    /// Byte offset of DGST.
    pub const OFFSET_DGST: u32 = offset_of!(Self, dgst) as u32;
    /// Byte offset of MAXR2T.
    pub const OFFSET_MAXR2T: u32 = offset_of!(Self, maxr2t) as u32;

    /// Builds an ICReq with PFV 0. `maxr2t` is 0's based.
    pub fn new(hpda: u8, hdgst: bool, ddgst: bool, maxr2t: u32) -> Self {
        Self {
            ch: CommonHeader::new(PduType::IcReq, 0, IC_PDU_LEN as u8, 0, IC_PDU_LEN as u32),
            pfv: U16::new(PFV_1_0),
            hpda,
            dgst: dgst_bits(hdgst, ddgst),
            maxr2t: U32::new(maxr2t),
            reserved: [0; 112],
        }
    }

    /// The common header.
    pub fn common(&self) -> &CommonHeader {
        &self.ch
    }

    /// PFV: PDU format version.
    pub fn pfv(&self) -> u16 {
        self.pfv.get()
    }

    /// HPDA: host PDU data alignment, 0's based dwords.
    pub fn hpda(&self) -> u8 {
        self.hpda
    }

    /// The raw DGST byte.
    pub fn dgst(&self) -> u8 {
        self.dgst
    }

    /// HDGST_ENABLE: the host asks for header digests.
    pub fn hdgst_enable(&self) -> bool {
        self.dgst & dgst::HDGST_ENABLE != 0
    }

    /// DDGST_ENABLE: the host asks for data digests.
    pub fn ddgst_enable(&self) -> bool {
        self.dgst & dgst::DDGST_ENABLE != 0
    }

    /// MAXR2T: outstanding R2Ts per command the host supports, 0's based.
    pub fn maxr2t(&self) -> u32 {
        self.maxr2t.get()
    }

    /// Replaces PFV.
    pub fn set_pfv(&mut self, pfv: u16) {
        self.pfv = U16::new(pfv);
    }

    /// Replaces the raw DGST byte.
    pub fn set_dgst(&mut self, dgst: u8) {
        self.dgst = dgst;
    }
}

/// Initialize Connection Response PDU, ICResp (section 3.6.2.3, Figure 21).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned,
)]
#[repr(C)]
pub struct IcResp {
    ch: CommonHeader,
    pfv: U16,
    cpda: u8,
    dgst: u8,
    maxh2cdata: U32,
    reserved: [u8; 112],
}
wire_struct!(IcResp, IC_PDU_LEN);

impl IcResp {
    /// Byte offset of PFV.
    pub const OFFSET_PFV: u32 = offset_of!(Self, pfv) as u32;
    /// Byte offset of CPDA.
    pub const OFFSET_CPDA: u32 = offset_of!(Self, cpda) as u32;
    /// Byte offset of DGST.
    pub const OFFSET_DGST: u32 = offset_of!(Self, dgst) as u32;
    /// Byte offset of MAXH2CDATA.
    pub const OFFSET_MAXH2CDATA: u32 = offset_of!(Self, maxh2cdata) as u32;

    /// Builds an ICResp with PFV 0.
    pub fn new(cpda: u8, hdgst: bool, ddgst: bool, maxh2cdata: u32) -> Self {
        Self {
            ch: CommonHeader::new(PduType::IcResp, 0, IC_PDU_LEN as u8, 0, IC_PDU_LEN as u32),
            pfv: U16::new(PFV_1_0),
            cpda,
            dgst: dgst_bits(hdgst, ddgst),
            maxh2cdata: U32::new(maxh2cdata),
            reserved: [0; 112],
        }
    }

    /// The common header.
    pub fn common(&self) -> &CommonHeader {
        &self.ch
    }

    /// PFV: PDU format version.
    pub fn pfv(&self) -> u16 {
        self.pfv.get()
    }

    /// CPDA: controller PDU data alignment, 0's based dwords.
    pub fn cpda(&self) -> u8 {
        self.cpda
    }

    /// The raw DGST byte.
    pub fn dgst(&self) -> u8 {
        self.dgst
    }

    /// HDGST_ENABLE: header digests are in use.
    pub fn hdgst_enable(&self) -> bool {
        self.dgst & dgst::HDGST_ENABLE != 0
    }

    /// DDGST_ENABLE: data digests are in use.
    pub fn ddgst_enable(&self) -> bool {
        self.dgst & dgst::DDGST_ENABLE != 0
    }

    /// MAXH2CDATA: largest PDU data length of one H2CData PDU, in bytes.
    pub fn maxh2cdata(&self) -> u32 {
        self.maxh2cdata.get()
    }

    /// Replaces PFV.
    pub fn set_pfv(&mut self, pfv: u16) {
        self.pfv = U16::new(pfv);
    }

    /// Replaces CPDA.
    pub fn set_cpda(&mut self, cpda: u8) {
        self.cpda = cpda;
    }

    /// Replaces the raw DGST byte.
    pub fn set_dgst(&mut self, dgst: u8) {
        self.dgst = dgst;
    }

    /// Replaces MAXH2CDATA.
    pub fn set_maxh2cdata(&mut self, maxh2cdata: u32) {
        self.maxh2cdata = U32::new(maxh2cdata);
    }
}

/// Header of H2CTermReq and C2HTermReq (sections 3.6.2.4 and 3.6.2.5, Figures 22 and 23).
///
/// Up to [`TERM_REQ_MAX_DATA`] bytes follow it: the header of the PDU that was being
/// processed when the fatal error was detected. TermReq PDUs never carry digests.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned,
)]
#[repr(C)]
pub struct TermReqHeader {
    ch: CommonHeader,
    fes: U16,
    fei: U32,
    reserved: [u8; 10],
}
wire_struct!(TermReqHeader, TERM_REQ_HLEN);

impl TermReqHeader {
    /// Byte offset of FES.
    pub const OFFSET_FES: u32 = offset_of!(Self, fes) as u32;
    /// Byte offset of FEI.
    pub const OFFSET_FEI: u32 = offset_of!(Self, fei) as u32;

    /// Builds a TermReq header; `pdu_type` is [`PduType::H2cTermReq`] or
    /// [`PduType::C2hTermReq`]. `data_len` is clamped to [`TERM_REQ_MAX_DATA`].
    pub fn new(pdu_type: PduType, fes: FatalErrorStatus, fei: u32, data_len: usize) -> Self {
        let data_len = data_len.min(TERM_REQ_MAX_DATA);
        Self {
            ch: CommonHeader::new(
                pdu_type,
                0,
                TERM_REQ_HLEN as u8,
                0,
                (TERM_REQ_HLEN + data_len) as u32,
            ),
            fes: U16::new(fes.code()),
            fei: U32::new(fei),
            reserved: [0; 10],
        }
    }

    /// The common header.
    pub fn common(&self) -> &CommonHeader {
        &self.ch
    }

    /// The raw FES value (may be reserved when received from a peer).
    pub fn fes_raw(&self) -> u16 {
        self.fes.get()
    }

    /// The FES, or an error for a reserved value.
    pub fn fes(&self) -> Result<FatalErrorStatus, ReservedFatalErrorStatus> {
        FatalErrorStatus::try_from(self.fes.get())
    }

    /// FEI: fatal error information (meaning depends on FES).
    pub fn fei(&self) -> u32 {
        self.fei.get()
    }
}

/// Header of the Command Capsule PDU, CapsuleCmd (section 3.6.2.6, Figure 24).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned,
)]
#[repr(C)]
pub struct CapsuleCmdHeader {
    ch: CommonHeader,
    sqe: [u8; SQE_LEN],
}
wire_struct!(CapsuleCmdHeader, CAPSULE_CMD_HLEN);

impl CapsuleCmdHeader {
    /// Byte offset of the SQE.
    pub const OFFSET_SQE: u32 = offset_of!(Self, sqe) as u32;

    /// Builds a CapsuleCmd header from its common header fields and SQE.
    pub fn new(flags: u8, pdo: u8, plen: u32, sqe: &[u8; SQE_LEN]) -> Self {
        Self {
            ch: CommonHeader::new(
                PduType::CapsuleCmd,
                flags,
                CAPSULE_CMD_HLEN as u8,
                pdo,
                plen,
            ),
            sqe: *sqe,
        }
    }

    /// The common header.
    pub fn common(&self) -> &CommonHeader {
        &self.ch
    }

    /// The 64-byte submission queue entry.
    pub fn sqe(&self) -> &[u8; SQE_LEN] {
        &self.sqe
    }
}

/// Header of the Response Capsule PDU, CapsuleResp (section 3.6.2.7, Figure 25).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned,
)]
#[repr(C)]
pub struct CapsuleRespHeader {
    ch: CommonHeader,
    cqe: [u8; CQE_LEN],
}
wire_struct!(CapsuleRespHeader, CAPSULE_RESP_HLEN);

impl CapsuleRespHeader {
    /// Byte offset of the CQE.
    pub const OFFSET_CQE: u32 = offset_of!(Self, cqe) as u32;

    /// Builds a CapsuleResp header.
    pub fn new(flags: u8, plen: u32, cqe: &[u8; CQE_LEN]) -> Self {
        Self {
            ch: CommonHeader::new(
                PduType::CapsuleResp,
                flags,
                CAPSULE_RESP_HLEN as u8,
                0,
                plen,
            ),
            cqe: *cqe,
        }
    }

    /// The common header.
    pub fn common(&self) -> &CommonHeader {
        &self.ch
    }

    /// The 16-byte completion queue entry.
    pub fn cqe(&self) -> &[u8; CQE_LEN] {
        &self.cqe
    }
}

/// Header of the Host to Controller Data PDU, H2CData (section 3.6.2.8, Figure 26).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned,
)]
#[repr(C)]
pub struct H2cDataHeader {
    ch: CommonHeader,
    cccid: U16,
    ttag: U16,
    datao: U32,
    datal: U32,
    reserved: [u8; 4],
}
wire_struct!(H2cDataHeader, DATA_PDU_HLEN);

impl H2cDataHeader {
    /// Byte offset of CCCID.
    pub const OFFSET_CCCID: u32 = offset_of!(Self, cccid) as u32;
    /// Byte offset of TTAG.
    pub const OFFSET_TTAG: u32 = offset_of!(Self, ttag) as u32;
    /// Byte offset of DATAO.
    pub const OFFSET_DATAO: u32 = offset_of!(Self, datao) as u32;
    /// Byte offset of DATAL.
    pub const OFFSET_DATAL: u32 = offset_of!(Self, datal) as u32;

    /// Builds an H2CData header.
    pub fn new(ch: CommonHeader, cccid: u16, ttag: u16, datao: u32, datal: u32) -> Self {
        Self {
            ch,
            cccid: U16::new(cccid),
            ttag: U16::new(ttag),
            datao: U32::new(datao),
            datal: U32::new(datal),
            reserved: [0; 4],
        }
    }

    /// The common header.
    pub fn common(&self) -> &CommonHeader {
        &self.ch
    }

    /// CCCID: command identifier of the command this data belongs to.
    pub fn cccid(&self) -> u16 {
        self.cccid.get()
    }

    /// TTAG: transfer tag of the R2T being answered.
    pub fn ttag(&self) -> u16 {
        self.ttag.get()
    }

    /// DATAO: offset of this data in the command data buffer.
    pub fn datao(&self) -> u32 {
        self.datao.get()
    }

    /// DATAL: length of the PDU data.
    pub fn datal(&self) -> u32 {
        self.datal.get()
    }
}

/// Header of the Controller to Host Data PDU, C2HData (section 3.6.2.9, Figure 27).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned,
)]
#[repr(C)]
pub struct C2hDataHeader {
    ch: CommonHeader,
    cccid: U16,
    reserved1: [u8; 2],
    datao: U32,
    datal: U32,
    reserved2: [u8; 4],
}
wire_struct!(C2hDataHeader, DATA_PDU_HLEN);

impl C2hDataHeader {
    /// Byte offset of CCCID.
    pub const OFFSET_CCCID: u32 = offset_of!(Self, cccid) as u32;
    /// Byte offset of DATAO.
    pub const OFFSET_DATAO: u32 = offset_of!(Self, datao) as u32;
    /// Byte offset of DATAL.
    pub const OFFSET_DATAL: u32 = offset_of!(Self, datal) as u32;

    /// Builds a C2HData header.
    pub fn new(ch: CommonHeader, cccid: u16, datao: u32, datal: u32) -> Self {
        Self {
            ch,
            cccid: U16::new(cccid),
            reserved1: [0; 2],
            datao: U32::new(datao),
            datal: U32::new(datal),
            reserved2: [0; 4],
        }
    }

    /// The common header.
    pub fn common(&self) -> &CommonHeader {
        &self.ch
    }

    /// CCCID: command identifier of the command this data belongs to.
    pub fn cccid(&self) -> u16 {
        self.cccid.get()
    }

    /// DATAO: offset of this data in the command data buffer.
    pub fn datao(&self) -> u32 {
        self.datao.get()
    }

    /// DATAL: length of the PDU data.
    pub fn datal(&self) -> u32 {
        self.datal.get()
    }
}

/// Ready to Transfer PDU, R2T (section 3.6.2.10, Figure 28).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned,
)]
#[repr(C)]
pub struct R2tHeader {
    ch: CommonHeader,
    cccid: U16,
    ttag: U16,
    r2to: U32,
    r2tl: U32,
    reserved: [u8; 4],
}
wire_struct!(R2tHeader, R2T_HLEN);

impl R2tHeader {
    /// Byte offset of CCCID.
    pub const OFFSET_CCCID: u32 = offset_of!(Self, cccid) as u32;
    /// Byte offset of TTAG.
    pub const OFFSET_TTAG: u32 = offset_of!(Self, ttag) as u32;
    /// Byte offset of R2TO.
    pub const OFFSET_R2TO: u32 = offset_of!(Self, r2to) as u32;
    /// Byte offset of R2TL.
    pub const OFFSET_R2TL: u32 = offset_of!(Self, r2tl) as u32;

    /// Builds an R2T header.
    pub fn new(flags: u8, plen: u32, cccid: u16, ttag: u16, r2to: u32, r2tl: u32) -> Self {
        Self {
            ch: CommonHeader::new(PduType::R2t, flags, R2T_HLEN as u8, 0, plen),
            cccid: U16::new(cccid),
            ttag: U16::new(ttag),
            r2to: U32::new(r2to),
            r2tl: U32::new(r2tl),
            reserved: [0; 4],
        }
    }

    /// The common header.
    pub fn common(&self) -> &CommonHeader {
        &self.ch
    }

    /// CCCID: command identifier of the command whose data is requested.
    pub fn cccid(&self) -> u16 {
        self.cccid.get()
    }

    /// TTAG: controller-chosen transfer tag the H2CData PDUs must carry.
    pub fn ttag(&self) -> u16 {
        self.ttag.get()
    }

    /// R2TO: offset of the requested data in the command data buffer.
    pub fn r2to(&self) -> u32 {
        self.r2to.get()
    }

    /// R2TL: length of the requested data.
    pub fn r2tl(&self) -> u32 {
        self.r2tl.get()
    }
}

fn dgst_bits(hdgst: bool, ddgst: bool) -> u8 {
    let mut bits = 0;
    if hdgst {
        bits |= dgst::HDGST_ENABLE;
    }
    if ddgst {
        bits |= dgst::DDGST_ENABLE;
    }
    bits
}

// Field offsets as given in Figures 19 to 28.
const _: () = {
    assert!(offset_of!(CommonHeader, plen) == 4);
    assert!(offset_of!(IcReq, pfv) == 8);
    assert!(offset_of!(IcReq, hpda) == 10);
    assert!(offset_of!(IcReq, dgst) == 11);
    assert!(offset_of!(IcReq, maxr2t) == 12);
    assert!(offset_of!(IcResp, cpda) == 10);
    assert!(offset_of!(IcResp, dgst) == 11);
    assert!(offset_of!(IcResp, maxh2cdata) == 12);
    assert!(offset_of!(TermReqHeader, fes) == 8);
    assert!(offset_of!(TermReqHeader, fei) == 10);
    assert!(offset_of!(CapsuleCmdHeader, sqe) == 8);
    assert!(offset_of!(CapsuleRespHeader, cqe) == 8);
    assert!(offset_of!(H2cDataHeader, cccid) == 8);
    assert!(offset_of!(H2cDataHeader, ttag) == 10);
    assert!(offset_of!(H2cDataHeader, datao) == 12);
    assert!(offset_of!(H2cDataHeader, datal) == 16);
    assert!(offset_of!(C2hDataHeader, cccid) == 8);
    assert!(offset_of!(C2hDataHeader, datao) == 12);
    assert!(offset_of!(C2hDataHeader, datal) == 16);
    assert!(offset_of!(R2tHeader, cccid) == 8);
    assert!(offset_of!(R2tHeader, ttag) == 10);
    assert!(offset_of!(R2tHeader, r2to) == 12);
    assert!(offset_of!(R2tHeader, r2tl) == 16);
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pdu_type_round_trip_and_reserved() {
        for v in 0u8..=255 {
            match PduType::try_from(v) {
                Ok(t) => {
                    assert_eq!(u8::from(t), v);
                    assert_eq!(t.is_controller_to_host(), v & 1 == 1);
                }
                Err(e) => {
                    assert_eq!(e, UnknownPduType(v));
                    assert!(v == 0x08 || v >= 0x0a);
                }
            }
        }
    }

    #[test]
    fn fes_round_trip() {
        for v in 0u16..=8 {
            match FatalErrorStatus::try_from(v) {
                Ok(f) => assert_eq!(f.code(), v),
                Err(e) => assert!(v == 0 || v >= 7, "{e}"),
            }
        }
        assert_eq!(FatalErrorStatus::R2T_LIMIT_EXCEEDED.code(), 0x05);
    }

    #[test]
    fn ic_req_layout() {
        let req = IcReq::new(3, true, false, 0x0102_0304);
        let b = req.as_wire_bytes();
        assert_eq!(b.len(), 128);
        assert_eq!(&b[..8], &[0x00, 0, 128, 0, 128, 0, 0, 0]);
        assert_eq!(&b[8..16], &[0, 0, 3, 0x01, 0x04, 0x03, 0x02, 0x01]);
        let back = IcReq::from_prefix(b).unwrap();
        assert_eq!(back, &req);
        assert!(back.hdgst_enable() && !back.ddgst_enable());
        assert_eq!(back.maxr2t(), 0x0102_0304);
        assert_eq!(back.common().pdu_type(), Ok(PduType::IcReq));
    }

    #[test]
    fn ic_resp_layout() {
        let resp = IcResp::new(0, false, true, 131_072);
        let b = resp.as_wire_bytes();
        assert_eq!(&b[..8], &[0x01, 0, 128, 0, 128, 0, 0, 0]);
        assert_eq!(&b[8..16], &[0, 0, 0, 0x02, 0x00, 0x00, 0x02, 0x00]);
        let back = IcResp::read_from_prefix(b).unwrap();
        assert_eq!(back.maxh2cdata(), 131_072);
        assert!(back.ddgst_enable() && !back.hdgst_enable());
    }

    #[test]
    fn term_req_layout() {
        let t = TermReqHeader::new(
            PduType::C2hTermReq,
            FatalErrorStatus::HeaderDigestError,
            0xAABB_CCDD,
            72,
        );
        let b = t.as_wire_bytes();
        assert_eq!(&b[..8], &[0x03, 0, 24, 0, 96, 0, 0, 0]);
        assert_eq!(&b[8..14], &[0x03, 0x00, 0xDD, 0xCC, 0xBB, 0xAA]);
        let back = TermReqHeader::from_prefix(b).unwrap();
        assert_eq!(back.fes(), Ok(FatalErrorStatus::HeaderDigestError));
        assert_eq!(back.fei(), 0xAABB_CCDD);
        let clamped = TermReqHeader::new(
            PduType::H2cTermReq,
            FatalErrorStatus::PduSequenceError,
            0,
            999,
        );
        assert_eq!(clamped.common().plen() as usize, TERM_REQ_MAX_PLEN);
    }

    #[test]
    fn data_and_r2t_layouts() {
        let ch = CommonHeader::new(PduType::H2cData, flags::LAST_PDU, 24, 24, 24 + 512);
        let h = H2cDataHeader::new(ch, 0x1234, 0x5678, 4096, 512);
        let b = h.as_wire_bytes();
        assert_eq!(
            &b[8..20],
            &[0x34, 0x12, 0x78, 0x56, 0, 0x10, 0, 0, 0, 2, 0, 0]
        );
        let back = H2cDataHeader::from_prefix(b).unwrap();
        assert_eq!(
            (back.cccid(), back.ttag(), back.datao(), back.datal()),
            (0x1234, 0x5678, 4096, 512)
        );
        assert!(back.common().last_pdu());

        let ch = CommonHeader::new(
            PduType::C2hData,
            flags::LAST_PDU | flags::SUCCESS,
            24,
            24,
            24 + 8,
        );
        let c = C2hDataHeader::new(ch, 7, 16, 8);
        let back = C2hDataHeader::from_prefix(c.as_wire_bytes()).unwrap();
        assert_eq!((back.cccid(), back.datao(), back.datal()), (7, 16, 8));
        assert!(back.common().success());

        let r = R2tHeader::new(flags::HDGSTF, 28, 9, 10, 8192, 4096);
        let b = r.as_wire_bytes();
        assert_eq!(&b[..8], &[0x09, 0x01, 24, 0, 28, 0, 0, 0]);
        let back = R2tHeader::from_prefix(b).unwrap();
        assert_eq!(
            (back.cccid(), back.ttag(), back.r2to(), back.r2tl()),
            (9, 10, 8192, 4096)
        );
    }

    #[test]
    fn capsule_layouts() {
        let mut sqe = [0u8; SQE_LEN];
        for (i, b) in sqe.iter_mut().enumerate() {
            *b = i as u8;
        }
        let c = CapsuleCmdHeader::new(flags::HDGSTF | flags::DDGSTF, 76, 76 + 100 + 4, &sqe);
        let bytes = c.as_wire_bytes();
        assert_eq!(&bytes[..8], &[0x04, 0x03, 72, 76, 180, 0, 0, 0]);
        assert_eq!(&bytes[8..], &sqe[..]);
        assert_eq!(CapsuleCmdHeader::from_prefix(bytes).unwrap().sqe(), &sqe);

        let cqe = [0xA5u8; CQE_LEN];
        let r = CapsuleRespHeader::new(0, 24, &cqe);
        let back = CapsuleRespHeader::from_prefix(r.as_wire_bytes()).unwrap();
        assert_eq!(back.cqe(), &cqe);
        assert_eq!(back.common().pdu_type(), Ok(PduType::CapsuleResp));
    }

    #[test]
    fn short_input_is_rejected() {
        assert!(CommonHeader::from_prefix(&[0; 7]).is_none());
        assert!(IcReq::from_prefix(&[0; 127]).is_none());
        assert!(CapsuleCmdHeader::read_from_prefix(&[0; 71]).is_none());
    }
}
