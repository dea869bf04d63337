//! Fabrics Connect data and controller properties (NVMe-oF 1.1 section 3.3, NVMe Base 2.0
//! section 3.1.4).

use zerocopy::little_endian::U16;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::identify::{get_trimmed, put_nul_padded};

/// The well-known NQN of a discovery subsystem.
pub const DISCOVERY_NQN: &str = "nqn.2014-08.org.nvmexpress.discovery";

/// Connect command data, 1024 bytes (NVMe-oF 1.1, Figure 22).
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct ConnectData {
    /// Host identifier (UUID).
    pub hostid: [u8; 16],
    /// Controller ID: 0xFFFF on the admin queue (dynamic), the assigned ID on I/O queues.
    pub cntlid: U16,
    /// Reserved.
    pub rsvd18: [u8; 238],
    /// Subsystem NQN (NUL terminated).
    pub subnqn: [u8; 256],
    /// Host NQN (NUL terminated).
    pub hostnqn: [u8; 256],
    /// Reserved.
    pub rsvd768: [u8; 256],
}
const _: () = assert!(size_of::<ConnectData>() == 1024);
const _: () = assert!(std::mem::offset_of!(ConnectData, subnqn) == 256);
const _: () = assert!(std::mem::offset_of!(ConnectData, hostnqn) == 512);

/// Byte offset of `subnqn` within [`ConnectData`] (reported in Connect invalid-parameter status).
pub const CONNECT_DATA_SUBNQN_OFFSET: u16 = 256;
/// Byte offset of `hostnqn` within [`ConnectData`].
pub const CONNECT_DATA_HOSTNQN_OFFSET: u16 = 512;
/// Byte offset of `cntlid` within [`ConnectData`].
pub const CONNECT_DATA_CNTLID_OFFSET: u16 = 16;

impl ConnectData {
    /// Builds Connect data.
    pub fn new(hostid: [u8; 16], cntlid: u16, subnqn: &str, hostnqn: &str) -> Self {
        let mut d = <Self as zerocopy::FromZeros>::new_zeroed();
        d.hostid = hostid;
        d.cntlid = U16::new(cntlid);
        put_nul_padded(&mut d.subnqn, subnqn);
        put_nul_padded(&mut d.hostnqn, hostnqn);
        d
    }

    /// Parses Connect data; `None` if `raw` is shorter than 1024 bytes.
    pub fn parse(raw: &[u8]) -> Option<Self> {
        Self::read_from_prefix(raw).ok().map(|(d, _)| d)
    }

    /// The subsystem NQN.
    pub fn subnqn(&self) -> String {
        get_trimmed(&self.subnqn)
    }

    /// The host NQN.
    pub fn hostnqn(&self) -> String {
        get_trimmed(&self.hostnqn)
    }
}

/// Connect response DW0 for an Invalid Parameters status: IATTR (bit 0: 1 = in the data) and
/// the byte offset of the offending field (bits 31:16).
pub const fn connect_invalid_param_dw0(in_data: bool, offset: u16) -> u32 {
    (in_data as u32) | ((offset as u32) << 16)
}

/// Connect response DW0, AUTHREQ field: authentication (a DH-HMAC-CHAP transaction) is
/// required on this queue before any other command (ATR).
pub const CONNECT_AUTHREQ_ATR: u32 = 1 << 17;
/// Connect response DW0, AUTHREQ field: secure channel concatenation is required (ASCR).
pub const CONNECT_AUTHREQ_ASCR: u32 = 1 << 18;

/// Controller property offsets (NVMe Base 2.0, Figure 35).
pub mod property {
    /// Controller Capabilities (8 bytes).
    pub const CAP: u32 = 0x00;
    /// Version (4 bytes).
    pub const VS: u32 = 0x08;
    /// Controller Configuration (4 bytes).
    pub const CC: u32 = 0x14;
    /// Controller Status (4 bytes).
    pub const CSTS: u32 = 0x1C;
    /// NVM Subsystem Reset (4 bytes).
    pub const NSSR: u32 = 0x20;
}

/// Version value for NVMe 1.4 (major 31:16, minor 15:8).
pub const VERSION_1_4: u32 = 0x0001_0400;

/// Controller Capabilities (CAP) builder and accessors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Cap(pub u64);

impl Cap {
    /// CAP for a fabrics controller: MQES (0's based), timeout in 500 ms units, NVM command set,
    /// MPSMIN = MPSMAX = 4 KiB.
    pub fn new(mqes: u16, timeout_500ms: u8) -> Self {
        let mut v = u64::from(mqes);
        v |= 1 << 16; // CQR: contiguous queues required
        v |= u64::from(timeout_500ms) << 24;
        v |= 1 << 37; // CSS: NVM command set
        Cap(v)
    }

    /// Maximum queue entries supported, as a count.
    pub fn max_queue_entries(&self) -> u32 {
        (self.0 & 0xFFFF) as u32 + 1
    }

    /// Timeout in milliseconds.
    pub fn timeout_ms(&self) -> u32 {
        ((self.0 >> 24) & 0xFF) as u32 * 500
    }
}

/// Controller Configuration (CC) accessors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Cc(pub u32);

impl Cc {
    /// Enable.
    pub fn enabled(&self) -> bool {
        self.0 & 1 != 0
    }

    /// Shutdown notification (bits 15:14; 0 = none).
    pub fn shutdown(&self) -> u8 {
        ((self.0 >> 14) & 0b11) as u8
    }

    /// I/O submission queue entry size (bits 19:16, power of two).
    pub fn iosqes(&self) -> u8 {
        ((self.0 >> 16) & 0xF) as u8
    }

    /// I/O completion queue entry size (bits 23:20, power of two).
    pub fn iocqes(&self) -> u8 {
        ((self.0 >> 20) & 0xF) as u8
    }

    /// The value a host writes to enable a controller with 64-byte SQEs and 16-byte CQEs.
    pub fn enable_value() -> u32 {
        1 | (6 << 16) | (4 << 20)
    }

    /// The value a host writes to request a normal shutdown.
    pub fn shutdown_value(current: u32) -> u32 {
        (current & !(0b11 << 14)) | (1 << 14)
    }
}

/// Controller Status (CSTS) bits.
pub mod csts {
    /// Ready.
    pub const RDY: u32 = 1;
    /// Controller fatal status.
    pub const CFS: u32 = 1 << 1;
    /// Shutdown processing complete (SHST = 10b).
    pub const SHST_COMPLETE: u32 = 0b10 << 2;
    /// Mask of the shutdown status field.
    pub const SHST_MASK: u32 = 0b11 << 2;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_data_round_trip() {
        let d = ConnectData::new([1; 16], 0xFFFF, "nqn.sub", "nqn.host");
        let raw = d.as_bytes();
        assert_eq!(&raw[16..18], &[0xFF, 0xFF]);
        assert_eq!(&raw[256..263], b"nqn.sub");
        let back = ConnectData::parse(raw).unwrap();
        assert_eq!(back.subnqn(), "nqn.sub");
        assert_eq!(back.hostnqn(), "nqn.host");
        assert!(ConnectData::parse(&raw[..1000]).is_none());
    }

    #[test]
    fn registers() {
        let cap = Cap::new(127, 30);
        assert_eq!(cap.max_queue_entries(), 128);
        assert_eq!(cap.timeout_ms(), 15000);
        let cc = Cc(Cc::enable_value());
        assert!(cc.enabled());
        assert_eq!((cc.iosqes(), cc.iocqes()), (6, 4));
        assert_eq!(Cc(Cc::shutdown_value(cc.0)).shutdown(), 1);
    }
}
