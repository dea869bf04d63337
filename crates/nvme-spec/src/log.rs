//! Log pages: discovery (NVMe-oF 1.1 section 5.3), error information and SMART / health
//! (NVMe Base 2.0 sections 5.16.1.2 and 5.16.1.3).

use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

/// Discovery log page header, 1024 bytes (NVMe-oF 1.1, Figure 38).
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct DiscoveryLogHeader {
    /// Generation counter: changes whenever the log changes.
    pub genctr: U64,
    /// Number of records that follow.
    pub numrec: U64,
    /// Record format (0).
    pub recfmt: U16,
    /// Reserved.
    pub rsvd: [u8; 1006],
}
const _: () = assert!(size_of::<DiscoveryLogHeader>() == 1024);

/// Discovery log page entry, 1024 bytes (NVMe-oF 1.1, Figure 39).
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct DiscoveryLogEntry {
    /// Transport type ([`trtype`]).
    pub trtype: u8,
    /// Address family ([`adrfam`]).
    pub adrfam: u8,
    /// Subsystem type ([`subtype`]).
    pub subtype: u8,
    /// Transport requirements ([`treq`]).
    pub treq: u8,
    /// Port ID.
    pub portid: U16,
    /// Controller ID (0xFFFF: dynamic controller model).
    pub cntlid: U16,
    /// Admin max submission queue size.
    pub asqsz: U16,
    /// Entry flags.
    pub eflags: U16,
    /// Reserved.
    pub rsvd12: [u8; 20],
    /// Transport service identifier (port number as ASCII, space padded).
    pub trsvcid: [u8; 32],
    /// Reserved.
    pub rsvd64: [u8; 192],
    /// Subsystem NQN (NUL padded).
    pub subnqn: [u8; 256],
    /// Transport address (ASCII, space padded).
    pub traddr: [u8; 256],
    /// Transport specific address subtype.
    pub tsas: [u8; 256],
}
const _: () = assert!(size_of::<DiscoveryLogEntry>() == 1024);
const _: () = assert!(std::mem::offset_of!(DiscoveryLogEntry, trsvcid) == 32);
const _: () = assert!(std::mem::offset_of!(DiscoveryLogEntry, subnqn) == 256);
const _: () = assert!(std::mem::offset_of!(DiscoveryLogEntry, traddr) == 512);
const _: () = assert!(std::mem::offset_of!(DiscoveryLogEntry, tsas) == 768);

impl DiscoveryLogEntry {
    /// An all-zero entry to fill in.
    pub fn zeroed() -> Self {
        <Self as zerocopy::FromZeros>::new_zeroed()
    }
}

impl DiscoveryLogHeader {
    /// An all-zero header to fill in.
    pub fn zeroed() -> Self {
        <Self as zerocopy::FromZeros>::new_zeroed()
    }
}

/// Transport types.
pub mod trtype {
    /// RDMA.
    pub const RDMA: u8 = 1;
    /// Fibre Channel.
    pub const FC: u8 = 2;
    /// TCP.
    pub const TCP: u8 = 3;
}

/// Address families.
pub mod adrfam {
    /// IPv4.
    pub const IPV4: u8 = 1;
    /// IPv6.
    pub const IPV6: u8 = 2;
}

/// Subsystem types.
pub mod subtype {
    /// A referral to another discovery service.
    pub const DISCOVERY_REFERRAL: u8 = 1;
    /// An NVM subsystem.
    pub const NVME: u8 = 2;
    /// The current discovery subsystem.
    pub const CURRENT_DISCOVERY: u8 = 3;
}

/// Transport requirements.
pub mod treq {
    /// Secure channel required (bits 1:0 = 01b).
    pub const SECURE_CHANNEL_REQUIRED: u8 = 0b01;
    /// Secure channel not required (bits 1:0 = 10b).
    pub const SECURE_CHANNEL_NOT_REQUIRED: u8 = 0b10;
    /// The host may disable SQ flow control (bit 2).
    pub const SQ_FLOW_CONTROL_DISABLE: u8 = 1 << 2;
}

/// NVMe/TCP transport specific address subtype, byte 0: the security type (NVMe/TCP
/// Transport 1.0, Figure 11).
pub mod tcp_sectype {
    /// No security.
    pub const NONE: u8 = 0;
    /// Transport Layer Security version 1.3.
    pub const TLS13: u8 = 2;
}

/// Error information log entry, 64 bytes (NVMe Base 2.0, Figure 205).
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct ErrorLogEntry {
    /// Error count (unique, increasing; 0 = invalid entry).
    pub error_count: U64,
    /// Submission queue ID.
    pub sqid: U16,
    /// Command ID.
    pub cid: U16,
    /// Status field (with the phase tag bit as 0).
    pub status: U16,
    /// Parameter error location.
    pub param_error_location: U16,
    /// LBA.
    pub lba: U64,
    /// Namespace.
    pub nsid: U32,
    /// Vendor specific information available.
    pub vs: u8,
    /// Transport type.
    pub trtype: u8,
    /// Reserved.
    pub rsvd30: [u8; 2],
    /// Command specific information.
    pub cs: U64,
    /// Transport type specific information.
    pub trtype_info: U16,
    /// Reserved.
    pub rsvd42: [u8; 22],
}
const _: () = assert!(size_of::<ErrorLogEntry>() == 64);

/// SMART / Health information log, 512 bytes (NVMe Base 2.0, Figure 207).
///
/// 128-bit counters are stored as two little-endian u64 halves.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct SmartLog {
    /// Critical warning bits.
    pub critical_warning: u8,
    /// Composite temperature in Kelvin.
    pub temperature: U16,
    /// Available spare (percent).
    pub avail_spare: u8,
    /// Available spare threshold (percent).
    pub spare_thresh: u8,
    /// Percentage used.
    pub percent_used: u8,
    /// Endurance group critical warning summary.
    pub endu_grp_crit_warn: u8,
    /// Reserved.
    pub rsvd7: [u8; 25],
    /// Data units read (thousands of 512-byte units).
    pub data_units_read: [U64; 2],
    /// Data units written (thousands of 512-byte units).
    pub data_units_written: [U64; 2],
    /// Host read commands.
    pub host_reads: [U64; 2],
    /// Host write commands.
    pub host_writes: [U64; 2],
    /// Controller busy time (minutes).
    pub ctrl_busy_time: [U64; 2],
    /// Power cycles.
    pub power_cycles: [U64; 2],
    /// Power on hours.
    pub power_on_hours: [U64; 2],
    /// Unsafe shutdowns.
    pub unsafe_shutdowns: [U64; 2],
    /// Media and data integrity errors.
    pub media_errors: [U64; 2],
    /// Number of error information log entries.
    pub num_err_log_entries: [U64; 2],
    /// Reserved and remaining fields.
    pub rsvd192: [u8; 320],
}
const _: () = assert!(size_of::<SmartLog>() == 512);
const _: () = assert!(std::mem::offset_of!(SmartLog, data_units_read) == 32);
const _: () = assert!(std::mem::offset_of!(SmartLog, num_err_log_entries) == 176);

impl SmartLog {
    /// An all-zero log to fill in.
    pub fn zeroed() -> Self {
        <Self as zerocopy::FromZeros>::new_zeroed()
    }
}

/// Splits a u128 counter into the two little-endian halves SMART uses.
pub fn u128_le(v: u128) -> [U64; 2] {
    [U64::new(v as u64), U64::new((v >> 64) as u64)]
}

/// Reads a SMART 128-bit counter.
pub fn u128_from(v: [U64; 2]) -> u128 {
    u128::from(v[0].get()) | (u128::from(v[1].get()) << 64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identify::{get_trimmed, put_ascii_padded, put_nul_padded};
    use zerocopy::IntoBytes;

    #[test]
    fn discovery_entry_layout() {
        let mut e = DiscoveryLogEntry::zeroed();
        e.trtype = trtype::TCP;
        e.adrfam = adrfam::IPV4;
        e.subtype = subtype::NVME;
        e.cntlid = U16::new(0xFFFF);
        put_ascii_padded(&mut e.trsvcid, "4420");
        put_ascii_padded(&mut e.traddr, "127.0.0.1");
        put_nul_padded(&mut e.subnqn, "nqn.test");
        let raw = e.as_bytes();
        assert_eq!(raw[0], 3);
        assert_eq!(&raw[6..8], &[0xFF, 0xFF]);
        assert_eq!(&raw[32..36], b"4420");
        assert_eq!(&raw[512..521], b"127.0.0.1");
        let back = DiscoveryLogEntry::read_from_bytes(raw).unwrap();
        assert_eq!(get_trimmed(&back.traddr), "127.0.0.1");
        assert_eq!(get_trimmed(&back.subnqn), "nqn.test");
    }

    #[test]
    fn smart_counters() {
        let mut s = SmartLog::zeroed();
        s.host_reads = u128_le((1u128 << 70) + 5);
        assert_eq!(u128_from(s.host_reads), (1u128 << 70) + 5);
        assert_eq!(s.as_bytes()[64], 5);
    }
}
