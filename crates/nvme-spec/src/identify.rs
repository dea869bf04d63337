//! Identify data structures (NVMe Base 2.0 section 5.17.2, NVM Command Set 1.0 section 4.1.5).

use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

/// Identify Controller data structure, CNS 01h (NVMe Base 2.0, Figure 275).
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct IdentifyController {
    /// PCI Vendor ID.
    pub vid: U16,
    /// PCI Subsystem Vendor ID.
    pub ssvid: U16,
    /// Serial number (ASCII, space padded).
    pub sn: [u8; 20],
    /// Model number (ASCII, space padded).
    pub mn: [u8; 40],
    /// Firmware revision (ASCII, space padded).
    pub fr: [u8; 8],
    /// Recommended arbitration burst.
    pub rab: u8,
    /// IEEE OUI identifier.
    pub ieee: [u8; 3],
    /// Controller multi-path I/O and namespace sharing capabilities.
    pub cmic: u8,
    /// Maximum data transfer size (power of two in units of CAP.MPSMIN; 0 = no limit).
    pub mdts: u8,
    /// Controller ID.
    pub cntlid: U16,
    /// Version.
    pub ver: U32,
    /// RTD3 resume latency.
    pub rtd3r: U32,
    /// RTD3 entry latency.
    pub rtd3e: U32,
    /// Optional asynchronous events supported.
    pub oaes: U32,
    /// Controller attributes.
    pub ctratt: U32,
    /// Read recovery levels supported.
    pub rrls: U16,
    /// Reserved.
    pub rsvd102: [u8; 9],
    /// Controller type (1 I/O, 2 discovery, 3 administrative).
    pub cntrltype: u8,
    /// FRU globally unique identifier.
    pub fguid: [u8; 16],
    /// Command retry delay times.
    pub crdt: [U16; 3],
    /// Reserved.
    pub rsvd134: [u8; 106],
    /// NVMe-MI management endpoint capabilities area.
    pub nvmemi: [u8; 16],
    /// Optional admin command support.
    pub oacs: U16,
    /// Abort command limit (0's based).
    pub acl: u8,
    /// Asynchronous event request limit (0's based).
    pub aerl: u8,
    /// Firmware updates.
    pub frmw: u8,
    /// Log page attributes.
    pub lpa: u8,
    /// Error log page entries (0's based).
    pub elpe: u8,
    /// Number of power states support (0's based).
    pub npss: u8,
    /// Admin vendor specific command configuration.
    pub avscc: u8,
    /// Autonomous power state transition attributes.
    pub apsta: u8,
    /// Warning composite temperature threshold (Kelvin).
    pub wctemp: U16,
    /// Critical composite temperature threshold (Kelvin).
    pub cctemp: U16,
    /// Fields 270..320 (MTFA through FWUG) this target leaves zero.
    pub rsvd270: [u8; 50],
    /// Keep alive support (granularity in 100 ms units; 0 = not supported).
    pub kas: U16,
    /// Fields 322..342 (HCTMA through ENDGIDMAX) this target leaves zero.
    pub rsvd322: [u8; 20],
    /// ANA transition time: the most seconds a group stays in the ANA Change state.
    pub anatt: u8,
    /// Asymmetric namespace access capabilities (the `ANACAP_*` bits).
    pub anacap: u8,
    /// ANA group identifier maximum.
    pub anagrpmax: U32,
    /// Number of ANA group identifiers.
    pub nanagrpid: U32,
    /// Fields 352..512 (PELS through the reserved area) this target leaves zero.
    pub rsvd352: [u8; 160],
    /// Submission queue entry size (max << 4 | required).
    pub sqes: u8,
    /// Completion queue entry size (max << 4 | required).
    pub cqes: u8,
    /// Maximum outstanding commands.
    pub maxcmd: U16,
    /// Number of namespaces (highest namespace ID).
    pub nn: U32,
    /// Optional NVM command support.
    pub oncs: U16,
    /// Fused operation support.
    pub fuses: U16,
    /// Format NVM attributes.
    pub fna: u8,
    /// Volatile write cache.
    pub vwc: u8,
    /// Atomic write unit normal.
    pub awun: U16,
    /// Atomic write unit power fail.
    pub awupf: U16,
    /// I/O command set vendor specific command configuration.
    pub icsvscc: u8,
    /// Namespace write protection capabilities.
    pub nwpc: u8,
    /// Atomic compare and write unit.
    pub acwu: U16,
    /// Copy descriptor formats supported.
    pub ocfs: U16,
    /// SGL support.
    pub sgls: U32,
    /// Maximum number of allowed namespaces.
    pub mnan: U32,
    /// Reserved (MAXDNA, MAXCNA and reserved area).
    pub rsvd544: [u8; 224],
    /// NVM subsystem NVMe qualified name (NUL padded).
    pub subnqn: [u8; 256],
    /// Reserved.
    pub rsvd1024: [u8; 768],
    /// I/O queue command capsule supported size (16-byte units).
    pub ioccsz: U32,
    /// I/O queue response capsule supported size (16-byte units).
    pub iorcsz: U32,
    /// In-capsule data offset (16-byte units).
    pub icdoff: U16,
    /// Fabrics controller attributes.
    pub fcatt: u8,
    /// Maximum SGL data block descriptors.
    pub msdbd: u8,
    /// Optional fabric commands support.
    pub ofcs: U16,
    /// Reserved.
    pub rsvd1806: [u8; 242],
    /// Power state descriptors.
    pub psd: [[u8; 32]; 32],
    /// Vendor specific.
    pub vs: [u8; 1024],
}
const _: () = assert!(size_of::<IdentifyController>() == 4096);
const _: () = assert!(std::mem::offset_of!(IdentifyController, cntrltype) == 111);
const _: () = assert!(std::mem::offset_of!(IdentifyController, anatt) == 342);
const _: () = assert!(std::mem::offset_of!(IdentifyController, anacap) == 343);
const _: () = assert!(std::mem::offset_of!(IdentifyController, anagrpmax) == 344);
const _: () = assert!(std::mem::offset_of!(IdentifyController, nanagrpid) == 348);
const _: () = assert!(std::mem::offset_of!(IdentifyController, sqes) == 512);

/// CMIC bit: the subsystem may have more than one controller.
pub const CMIC_MULTI_CONTROLLER: u8 = 1 << 1;
/// CMIC bit: Asymmetric Namespace Access Reporting.
pub const CMIC_ANA: u8 = 1 << 3;

/// ANACAP bits (NVMe Base 2.0, Figure 275, byte 343).
pub mod anacap {
    /// Reports the ANA Optimized state.
    pub const OPTIMIZED: u8 = 1 << 0;
    /// Reports the ANA Non-Optimized state.
    pub const NON_OPTIMIZED: u8 = 1 << 1;
    /// Reports the ANA Inaccessible state.
    pub const INACCESSIBLE: u8 = 1 << 2;
    /// Reports the ANA Persistent Loss state.
    pub const PERSISTENT_LOSS: u8 = 1 << 3;
    /// Reports the ANA Change state.
    pub const CHANGE: u8 = 1 << 4;
    /// A namespace's ANAGRPID does not change while it is attached.
    pub const GRPID_STATIC: u8 = 1 << 6;
    /// A non-zero ANAGRPID is supported in Namespace Management.
    pub const GRPID_NONZERO: u8 = 1 << 7;
}
const _: () = assert!(std::mem::offset_of!(IdentifyController, oacs) == 256);
const _: () = assert!(std::mem::offset_of!(IdentifyController, kas) == 320);
const _: () = assert!(std::mem::offset_of!(IdentifyController, sqes) == 512);
const _: () = assert!(std::mem::offset_of!(IdentifyController, sgls) == 536);
const _: () = assert!(std::mem::offset_of!(IdentifyController, subnqn) == 768);
const _: () = assert!(std::mem::offset_of!(IdentifyController, ioccsz) == 1792);
const _: () = assert!(std::mem::offset_of!(IdentifyController, msdbd) == 1803);
const _: () = assert!(std::mem::offset_of!(IdentifyController, psd) == 2048);

/// Controller types (CNTRLTYPE).
pub mod cntrltype {
    /// I/O controller.
    pub const IO: u8 = 1;
    /// Discovery controller.
    pub const DISCOVERY: u8 = 2;
}

/// ONCS bit: Write Zeroes supported.
pub const ONCS_WRITE_ZEROES: u16 = 1 << 3;
/// ONCS bit: reservations supported.
pub const ONCS_RESERVATIONS: u16 = 1 << 5;
/// ONCS bit: Dataset Management supported.
pub const ONCS_DSM: u16 = 1 << 2;
/// SGLS bits 1:0 = 01b: SGLs supported with no alignment requirement.
pub const SGLS_SUPPORTED: u32 = 0b01;
/// SGLS bit 2: keyed SGL data block descriptor supported.
pub const SGLS_KEYED: u32 = 1 << 2;
/// SGLS bit 20: address field may be an offset (in-capsule data).
pub const SGLS_OFFSET: u32 = 1 << 20;
/// SGLS bit 21: transport SGL data block descriptor supported.
pub const SGLS_TRANSPORT: u32 = 1 << 21;
/// OAES bit 8: namespace attribute notices.
pub const OAES_NS_ATTRIBUTE: u32 = 1 << 8;
/// OAES bit 11: Asymmetric Namespace Access change notices.
pub const OAES_ANA_CHANGE: u32 = 1 << 11;
/// OAES bit 31: discovery log page change notices.
pub const OAES_DISCOVERY_LOG_CHANGE: u32 = 1 << 31;
/// LPA bit 2: extended data for Get Log Page (offsets and large transfers).
pub const LPA_EXTENDED: u8 = 1 << 2;

impl IdentifyController {
    /// An all-zero structure to fill in.
    pub fn zeroed() -> Self {
        <Self as zerocopy::FromZeros>::new_zeroed()
    }
}

/// Copies `s` into `dst` padded with ASCII spaces (SN, MN, FR fields).
pub fn put_ascii_padded(dst: &mut [u8], s: &str) {
    dst.fill(b' ');
    let n = s.len().min(dst.len());
    dst[..n].copy_from_slice(&s.as_bytes()[..n]);
}

/// Copies `s` into `dst` padded with NULs (NQN fields).
pub fn put_nul_padded(dst: &mut [u8], s: &str) {
    dst.fill(0);
    let n = s.len().min(dst.len().saturating_sub(1));
    dst[..n].copy_from_slice(&s.as_bytes()[..n]);
}

/// Reads a space- or NUL-padded ASCII field back as a trimmed string.
pub fn get_trimmed(src: &[u8]) -> String {
    let end = src.iter().position(|&b| b == 0).unwrap_or(src.len());
    String::from_utf8_lossy(&src[..end]).trim_end().to_string()
}

/// LBA format descriptor (NVM Command Set 1.0, Figure 98).
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct LbaFormat {
    /// Metadata size in bytes.
    pub ms: U16,
    /// LBA data size as a power of two.
    pub lbads: u8,
    /// Relative performance (bits 1:0).
    pub rp: u8,
}
const _: () = assert!(size_of::<LbaFormat>() == 4);

/// Identify Namespace data structure for the NVM command set, CNS 00h (NVM Command Set 1.0,
/// Figure 97).
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct IdentifyNamespace {
    /// Namespace size in logical blocks.
    pub nsze: U64,
    /// Namespace capacity in logical blocks.
    pub ncap: U64,
    /// Namespace utilization in logical blocks.
    pub nuse: U64,
    /// Namespace features.
    pub nsfeat: u8,
    /// Number of LBA formats (0's based).
    pub nlbaf: u8,
    /// Formatted LBA size (index into `lbaf`).
    pub flbas: u8,
    /// Metadata capabilities.
    pub mc: u8,
    /// End-to-end data protection capabilities.
    pub dpc: u8,
    /// End-to-end data protection type settings.
    pub dps: u8,
    /// Namespace multi-path I/O and sharing capabilities.
    pub nmic: u8,
    /// Reservation capabilities.
    pub rescap: u8,
    /// Format progress indicator.
    pub fpi: u8,
    /// Deallocate logical block features (bits 2:0 = 001b: deallocated blocks read as zeros).
    pub dlfeat: u8,
    /// Fields 34..92 (NAWUN through NPDA and reserved) this target leaves zero.
    pub rsvd34: [u8; 58],
    /// ANA group identifier.
    pub anagrpid: U32,
    /// Fields 96..104 (reserved, NSATTR, NVMSETID, ENDGID) this target leaves zero.
    pub rsvd96: [u8; 8],
    /// Namespace globally unique identifier.
    pub nguid: [u8; 16],
    /// IEEE extended unique identifier.
    pub eui64: [u8; 8],
    /// LBA formats 0..63.
    pub lbaf: [LbaFormat; 64],
    /// Reserved and vendor specific.
    pub rsvd384: [u8; 3712],
}
const _: () = assert!(size_of::<IdentifyNamespace>() == 4096);
const _: () = assert!(std::mem::offset_of!(IdentifyNamespace, anagrpid) == 92);
const _: () = assert!(std::mem::offset_of!(IdentifyNamespace, nguid) == 104);
const _: () = assert!(std::mem::offset_of!(IdentifyNamespace, lbaf) == 128);

impl IdentifyNamespace {
    /// An all-zero structure (also the answer for an inactive namespace).
    pub fn zeroed() -> Self {
        <Self as zerocopy::FromZeros>::new_zeroed()
    }

    /// The block size of the formatted LBA format.
    pub fn block_size(&self) -> u32 {
        let idx = usize::from(self.flbas & 0xF);
        let lbads = self.lbaf[idx].lbads;
        if (9..=31).contains(&lbads) {
            1 << lbads
        } else {
            0
        }
    }
}

/// Namespace identifier types for the descriptor list, CNS 03h (NVMe Base 2.0, Figure 280).
pub mod nidt {
    /// IEEE EUI-64 (8 bytes).
    pub const EUI64: u8 = 1;
    /// NGUID (16 bytes).
    pub const NGUID: u8 = 2;
    /// UUID (16 bytes).
    pub const UUID: u8 = 3;
    /// Command set identifier (1 byte).
    pub const CSI: u8 = 4;
}

/// Encodes a namespace identification descriptor list (4096 bytes) from (type, value) pairs.
pub fn encode_ns_descriptors(descs: &[(u8, &[u8])]) -> [u8; 4096] {
    let mut out = [0u8; 4096];
    let mut off = 0;
    for (t, v) in descs {
        if off + 4 + v.len() > out.len() {
            break;
        }
        out[off] = *t;
        out[off + 1] = v.len() as u8;
        out[off + 4..off + 4 + v.len()].copy_from_slice(v);
        off += 4 + v.len();
    }
    out
}

/// Decodes a namespace identification descriptor list into (type, value) pairs.
pub fn decode_ns_descriptors(raw: &[u8]) -> Vec<(u8, Vec<u8>)> {
    let mut out = Vec::new();
    let mut off = 0;
    while off + 4 <= raw.len() {
        let (t, l) = (raw[off], usize::from(raw[off + 1]));
        if t == 0 || l == 0 || off + 4 + l > raw.len() {
            break;
        }
        out.push((t, raw[off + 4..off + 4 + l].to_vec()));
        off += 4 + l;
    }
    out
}

/// Encodes an active namespace ID list (4096 bytes): IDs greater than `after`, ascending.
pub fn encode_ns_list(ids: impl IntoIterator<Item = u32>, after: u32) -> [u8; 4096] {
    let mut out = [0u8; 4096];
    let mut sorted: Vec<u32> = ids.into_iter().filter(|&id| id > after).collect();
    sorted.sort_unstable();
    for (slot, id) in out.chunks_exact_mut(4).zip(sorted) {
        slot.copy_from_slice(&id.to_le_bytes());
    }
    out
}

/// Decodes an active namespace ID list (stops at the first zero).
pub fn decode_ns_list(raw: &[u8]) -> Vec<u32> {
    raw.chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .take_while(|&id| id != 0)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ns_descriptor_round_trip() {
        let nguid = [7u8; 16];
        let raw = encode_ns_descriptors(&[(nidt::NGUID, &nguid), (nidt::CSI, &[0])]);
        assert_eq!(raw[0], 2);
        assert_eq!(raw[1], 16);
        assert_eq!(raw[20], 4);
        let back = decode_ns_descriptors(&raw);
        assert_eq!(back, vec![(2, nguid.to_vec()), (4, vec![0])]);
    }

    #[test]
    fn ns_list_round_trip() {
        let raw = encode_ns_list([3, 1, 2, 9], 1);
        assert_eq!(decode_ns_list(&raw), vec![2, 3, 9]);
    }

    #[test]
    fn identify_fields() {
        let mut c = IdentifyController::zeroed();
        put_ascii_padded(&mut c.mn, "model");
        put_nul_padded(&mut c.subnqn, "nqn.x");
        c.cntlid = U16::new(5);
        let raw = c.as_bytes();
        assert_eq!(&raw[24..29], b"model");
        assert_eq!(raw[29], b' ');
        assert_eq!(&raw[78..80], &[5, 0]);
        assert_eq!(get_trimmed(&c.mn), "model");
        assert_eq!(get_trimmed(&c.subnqn), "nqn.x");
        let mut n = IdentifyNamespace::zeroed();
        n.lbaf[0].lbads = 12;
        assert_eq!(n.block_size(), 4096);
    }
}
