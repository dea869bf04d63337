//! Log pages: discovery (NVMe-oF 1.1 section 5.3), error information, SMART / health and
//! Asymmetric Namespace Access (NVMe Base 2.0 sections 5.16.1.2, 5.16.1.3 and 5.16.1.13).

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
    /// Secure channel requirement not specified (bits 1:0 = 00b).
    pub const SECURE_CHANNEL_NOT_SPECIFIED: u8 = 0b00;
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

/// An Asymmetric Namespace Access state (NVMe Base 2.0, section 8.1.3 and Figure 222).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum AnaState {
    /// ANA Optimized: the best path to the group's namespaces.
    #[default]
    Optimized,
    /// ANA Non-Optimized: usable, at lower performance.
    NonOptimized,
    /// ANA Inaccessible: I/O is refused for now.
    Inaccessible,
    /// ANA Persistent Loss: I/O is refused and will stay refused.
    PersistentLoss,
    /// ANA Change: the group is changing state (at most ANATT seconds).
    Change,
}

impl AnaState {
    /// Every state, in the order of their codes.
    pub const ALL: [AnaState; 5] = [
        AnaState::Optimized,
        AnaState::NonOptimized,
        AnaState::Inaccessible,
        AnaState::PersistentLoss,
        AnaState::Change,
    ];

    /// The state's code in the ANA log page.
    pub const fn code(self) -> u8 {
        match self {
            AnaState::Optimized => 0x01,
            AnaState::NonOptimized => 0x02,
            AnaState::Inaccessible => 0x03,
            AnaState::PersistentLoss => 0x04,
            AnaState::Change => 0x0F,
        }
    }

    /// The state with log page code `code`.
    pub fn from_code(code: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.code() == code)
    }

    /// The name used in configuration and on command lines (`optimized`, `non-optimized`,
    /// `inaccessible`, `persistent-loss`, `change`).
    pub const fn name(self) -> &'static str {
        match self {
            AnaState::Optimized => "optimized",
            AnaState::NonOptimized => "non-optimized",
            AnaState::Inaccessible => "inaccessible",
            AnaState::PersistentLoss => "persistent-loss",
            AnaState::Change => "change",
        }
    }

    /// The path-related status (SCT 3) that I/O in this state completes with, if it is
    /// refused: Inaccessible, Persistent Loss and Transition.
    pub fn io_status(self) -> Option<crate::Status> {
        use crate::status::{path, sct};
        let sc = match self {
            AnaState::Optimized | AnaState::NonOptimized => return None,
            AnaState::Inaccessible => path::ANA_INACCESSIBLE,
            AnaState::PersistentLoss => path::ANA_PERSISTENT_LOSS,
            AnaState::Change => path::ANA_TRANSITION,
        };
        Some(crate::Status {
            sct: sct::PATH,
            sc,
            ..Default::default()
        })
    }
}

impl core::fmt::Display for AnaState {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(self.name())
    }
}

impl core::str::FromStr for AnaState {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|a| a.name() == s)
            .ok_or_else(|| {
                format!(
                    "unknown ANA state {s:?} (expected optimized, non-optimized, inaccessible, \
                     persistent-loss or change)"
                )
            })
    }
}

/// Get Log Page LSP bit of the ANA log page: Return Groups Only (no NSID lists).
pub const ANA_LSP_GROUPS_ONLY: u8 = 1;

/// ANA log page header, 16 bytes (NVMe Base 2.0, Figure 220).
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct AnaLogHeader {
    /// Change count: moves whenever the page's contents change.
    pub chgcnt: U64,
    /// Number of ANA group descriptors that follow.
    pub ngrps: U16,
    /// Reserved.
    pub rsvd10: [u8; 6],
}
const _: () = assert!(size_of::<AnaLogHeader>() == 16);

/// ANA group descriptor, 32 bytes followed by `nnsids` NSIDs (NVMe Base 2.0, Figure 221).
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct AnaGroupDescriptor {
    /// ANA group ID.
    pub grpid: U32,
    /// Number of NSIDs listed after the descriptor.
    pub nnsids: U32,
    /// Change count of this group.
    pub chgcnt: U64,
    /// ANA state ([`AnaState::code`]) in bits 3:0.
    pub state: u8,
    /// Reserved.
    pub rsvd17: [u8; 15],
}
const _: () = assert!(size_of::<AnaGroupDescriptor>() == 32);
const _: () = assert!(std::mem::offset_of!(AnaGroupDescriptor, state) == 16);

/// One group of an ANA log page.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AnaGroup {
    /// ANA group ID (non-zero).
    pub grpid: u32,
    /// Its state.
    pub state: AnaState,
    /// Its change count.
    pub chgcnt: u64,
    /// The NSIDs in it (empty for a Return Groups Only page).
    pub nsids: Vec<u32>,
}

/// Encodes an ANA log page; with `groups_only` (RGO) no NSIDs are listed.
pub fn encode_ana_log(chgcnt: u64, groups: &[AnaGroup], groups_only: bool) -> Vec<u8> {
    let mut out = Vec::new();
    let mut h = AnaLogHeader::default();
    h.chgcnt.set(chgcnt);
    h.ngrps.set(groups.len() as u16);
    out.extend_from_slice(h.as_bytes());
    for g in groups {
        let nsids: &[u32] = if groups_only { &[] } else { &g.nsids };
        let mut d = AnaGroupDescriptor::default();
        d.grpid.set(g.grpid);
        d.nnsids.set(nsids.len() as u32);
        d.chgcnt.set(g.chgcnt);
        d.state = g.state.code();
        out.extend_from_slice(d.as_bytes());
        for n in nsids {
            out.extend_from_slice(&n.to_le_bytes());
        }
    }
    out
}

/// Decodes an ANA log page: its change count and groups. None when it is truncated or
/// names an unknown state.
pub fn decode_ana_log(page: &[u8]) -> Option<(u64, Vec<AnaGroup>)> {
    let (h, mut rest) = AnaLogHeader::read_from_prefix(page).ok()?;
    let mut groups = Vec::new();
    for _ in 0..h.ngrps.get() {
        let (d, tail) = AnaGroupDescriptor::read_from_prefix(rest).ok()?;
        let n = d.nnsids.get() as usize;
        let bytes = tail.get(..n.checked_mul(4)?)?;
        groups.push(AnaGroup {
            grpid: d.grpid.get(),
            state: AnaState::from_code(d.state & 0xF)?,
            chgcnt: d.chgcnt.get(),
            nsids: bytes
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        });
        rest = &tail[n * 4..];
    }
    Some((h.chgcnt.get(), groups))
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
    fn ana_log_round_trips_with_and_without_nsids() {
        let groups = vec![
            AnaGroup {
                grpid: 1,
                state: AnaState::Optimized,
                chgcnt: 3,
                nsids: vec![1, 2],
            },
            AnaGroup {
                grpid: 7,
                state: AnaState::PersistentLoss,
                chgcnt: 3,
                nsids: vec![9],
            },
        ];
        let page = encode_ana_log(3, &groups, false);
        assert_eq!(page.len(), 16 + 32 + 8 + 32 + 4);
        assert_eq!(page[8], 2, "NGRPS");
        assert_eq!(page[16 + 16], 0x01, "state of group 1");
        assert_eq!(decode_ana_log(&page), Some((3, groups.clone())));
        let rgo = encode_ana_log(3, &groups, true);
        assert_eq!(rgo.len(), 16 + 2 * 32);
        let (_, g) = decode_ana_log(&rgo).unwrap();
        assert!(g.iter().all(|g| g.nsids.is_empty()));
        assert_eq!(decode_ana_log(&page[..40]), None, "truncated");
        for s in AnaState::ALL {
            assert_eq!(AnaState::from_code(s.code()), Some(s));
            assert_eq!(s.name().parse::<AnaState>(), Ok(s));
        }
        assert_eq!(AnaState::Inaccessible.io_status().unwrap().sc, 0x02);
        assert!(AnaState::NonOptimized.io_status().is_none());
    }

    #[test]
    fn smart_counters() {
        let mut s = SmartLog::zeroed();
        s.host_reads = u128_le((1u128 << 70) + 5);
        assert_eq!(u128_from(s.host_reads), (1u128 << 70) + 5);
        assert_eq!(s.as_bytes()[64], 5);
    }
}
