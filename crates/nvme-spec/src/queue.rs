//! Submission and completion queue entries (NVMe Base Specification 2.0, section 4.2 and 4.6).

use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::status::Status;

/// A 64-byte submission queue entry (NVMe Base 2.0, Figure 88 "Common Command Format").
///
/// The layout is shared by admin, I/O and fabrics commands; command-specific meaning of
/// the dwords is decoded by [`crate::command`].
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    FromBytes,
    IntoBytes,
    KnownLayout,
    Immutable,
    Unaligned,
)]
#[repr(C)]
pub struct Sqe {
    /// Opcode (CDW0 bits 7:0).
    pub opcode: u8,
    /// Fused operation (bits 1:0) and PRP/SGL selection PSDT (bits 7:6).
    pub flags: u8,
    /// Command identifier.
    pub cid: U16,
    /// Namespace identifier (for fabrics commands byte 4 is the fabrics command type).
    pub nsid: U32,
    /// Command dword 2.
    pub cdw2: U32,
    /// Command dword 3.
    pub cdw3: U32,
    /// Metadata pointer.
    pub mptr: U64,
    /// Data pointer: the first SGL descriptor (fabrics transports always use SGLs).
    pub dptr: SglDescriptor,
    /// Command dword 10.
    pub cdw10: U32,
    /// Command dword 11.
    pub cdw11: U32,
    /// Command dword 12.
    pub cdw12: U32,
    /// Command dword 13.
    pub cdw13: U32,
    /// Command dword 14.
    pub cdw14: U32,
    /// Command dword 15.
    pub cdw15: U32,
}
const _: () = assert!(size_of::<Sqe>() == 64);
const _: () = assert!(std::mem::offset_of!(Sqe, dptr) == 24);
const _: () = assert!(std::mem::offset_of!(Sqe, cdw10) == 40);

/// PSDT value selecting SGLs for the data transfer (the only mode NVMe-oF permits).
pub const PSDT_SGL_MPTR_CONTIGUOUS: u8 = 0b01;

impl Sqe {
    /// Parses an SQE from exactly 64 bytes.
    pub fn from_array(raw: &[u8; 64]) -> Self {
        Self::read_from_bytes(raw).unwrap_or_default()
    }

    /// Serializes the SQE into 64 bytes.
    pub fn to_array(&self) -> [u8; 64] {
        let mut out = [0u8; 64];
        out.copy_from_slice(self.as_bytes());
        out
    }

    /// The command identifier.
    pub fn cid(&self) -> u16 {
        self.cid.get()
    }

    /// The PRP or SGL for Data Transfer field (PSDT, bits 7:6 of byte 1).
    pub fn psdt(&self) -> u8 {
        self.flags >> 6
    }

    /// The fused operation field.
    pub fn fuse(&self) -> u8 {
        self.flags & 0b11
    }

    /// Sets PSDT so the data pointer is read as an SGL.
    pub fn set_sgl(&mut self) {
        self.flags = (self.flags & 0x3F) | (PSDT_SGL_MPTR_CONTIGUOUS << 6);
    }

    /// The fabrics command type (byte 4) of a fabrics command (opcode 0x7F).
    pub fn fctype(&self) -> u8 {
        self.nsid.get().to_le_bytes()[0]
    }
}

/// SGL descriptor types (NVMe Base 2.0, Figure 117), in the upper nibble of the identifier.
pub mod sgl_type {
    /// SGL Data Block descriptor.
    pub const DATA_BLOCK: u8 = 0x0;
    /// SGL Bit Bucket descriptor.
    pub const BIT_BUCKET: u8 = 0x1;
    /// SGL Segment descriptor.
    pub const SEGMENT: u8 = 0x2;
    /// SGL Last Segment descriptor.
    pub const LAST_SEGMENT: u8 = 0x3;
    /// Keyed SGL Data Block descriptor (RDMA).
    pub const KEYED_DATA_BLOCK: u8 = 0x4;
    /// Transport SGL Data Block descriptor (NVMe/TCP data not in the capsule).
    pub const TRANSPORT_DATA_BLOCK: u8 = 0x5;
}

/// SGL descriptor sub types (NVMe Base 2.0, Figure 118), in the lower nibble of the identifier.
pub mod sgl_subtype {
    /// The address field is a memory address (or a keyed remote address).
    pub const ADDRESS: u8 = 0x0;
    /// The address field is an offset into the in-capsule data.
    pub const OFFSET: u8 = 0x1;
    /// Transport specific format A (NVMe/TCP).
    pub const TRANSPORT_A: u8 = 0xA;
    /// Keyed descriptor asking the target to invalidate the key (RDMA).
    pub const INVALIDATE: u8 = 0xF;
}

/// A 16-byte SGL descriptor (NVMe Base 2.0, section 4.1.2).
///
/// For keyed descriptors the length is 24 bits (bytes 8-10) and bytes 11-14 hold the key.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    FromBytes,
    IntoBytes,
    KnownLayout,
    Immutable,
    Unaligned,
)]
#[repr(C)]
pub struct SglDescriptor {
    /// Address (or in-capsule offset).
    pub address: U64,
    /// Bytes 8-14: length (32-bit for unkeyed; 24-bit plus 32-bit key for keyed).
    pub body: [u8; 7],
    /// SGL identifier: type in bits 7:4, sub type in bits 3:0.
    pub identifier: u8,
}
const _: () = assert!(size_of::<SglDescriptor>() == 16);

impl SglDescriptor {
    /// Descriptor type (upper nibble of the identifier).
    pub fn desc_type(&self) -> u8 {
        self.identifier >> 4
    }

    /// Descriptor sub type (lower nibble of the identifier).
    pub fn subtype(&self) -> u8 {
        self.identifier & 0xF
    }

    /// Length of an unkeyed descriptor (32 bits at bytes 8-11).
    pub fn length(&self) -> u32 {
        u32::from_le_bytes([self.body[0], self.body[1], self.body[2], self.body[3]])
    }

    /// Length of a keyed descriptor (24 bits at bytes 8-10).
    pub fn keyed_length(&self) -> u32 {
        u32::from_le_bytes([self.body[0], self.body[1], self.body[2], 0])
    }

    /// Key of a keyed descriptor (bytes 11-14).
    pub fn key(&self) -> u32 {
        u32::from_le_bytes([self.body[3], self.body[4], self.body[5], self.body[6]])
    }

    /// The data length this descriptor describes, keyed or not.
    pub fn data_length(&self) -> u32 {
        if self.desc_type() == sgl_type::KEYED_DATA_BLOCK {
            self.keyed_length()
        } else {
            self.length()
        }
    }

    /// An unkeyed descriptor of the given type/subtype.
    pub fn unkeyed(desc_type: u8, subtype: u8, address: u64, length: u32) -> Self {
        let l = length.to_le_bytes();
        Self {
            address: U64::new(address),
            body: [l[0], l[1], l[2], l[3], 0, 0, 0],
            identifier: (desc_type << 4) | (subtype & 0xF),
        }
    }

    /// A keyed data block descriptor (RDMA): remote address, 24-bit length, remote key.
    pub fn keyed(address: u64, length: u32, key: u32, invalidate: bool) -> Self {
        let l = length.to_le_bytes();
        let k = key.to_le_bytes();
        let subtype = if invalidate {
            sgl_subtype::INVALIDATE
        } else {
            sgl_subtype::ADDRESS
        };
        Self {
            address: U64::new(address),
            body: [l[0], l[1], l[2], k[0], k[1], k[2], k[3]],
            identifier: (sgl_type::KEYED_DATA_BLOCK << 4) | subtype,
        }
    }

    /// The descriptor a host puts in a command whose data travels in the capsule
    /// (data block, offset subtype, offset 0).
    pub fn in_capsule(length: u32) -> Self {
        Self::unkeyed(sgl_type::DATA_BLOCK, sgl_subtype::OFFSET, 0, length)
    }

    /// The descriptor an NVMe/TCP host uses for data transferred by C2HData/H2CData PDUs.
    pub fn tcp_transport(length: u32) -> Self {
        Self::unkeyed(
            sgl_type::TRANSPORT_DATA_BLOCK,
            sgl_subtype::TRANSPORT_A,
            0,
            length,
        )
    }
}

/// A 16-byte completion queue entry (NVMe Base 2.0, Figure 89).
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    FromBytes,
    IntoBytes,
    KnownLayout,
    Immutable,
    Unaligned,
)]
#[repr(C)]
pub struct Cqe {
    /// Command specific dword 0.
    pub dw0: U32,
    /// Command specific dword 1.
    pub dw1: U32,
    /// Submission queue head pointer.
    pub sqhd: U16,
    /// Submission queue identifier.
    pub sqid: U16,
    /// Command identifier this entry completes.
    pub cid: U16,
    /// Phase tag (bit 0) and status field (bits 15:1).
    pub status: U16,
}
const _: () = assert!(size_of::<Cqe>() == 16);

impl Cqe {
    /// A completion for `cid` with the given status and dword 0.
    pub fn new(cid: u16, status: Status, dw0: u32) -> Self {
        Self {
            dw0: U32::new(dw0),
            dw1: U32::new(0),
            sqhd: U16::new(0),
            sqid: U16::new(0),
            cid: U16::new(cid),
            status: U16::new(status.to_field() << 1),
        }
    }

    /// Parses a CQE from exactly 16 bytes.
    pub fn from_array(raw: &[u8; 16]) -> Self {
        Self::read_from_bytes(raw).unwrap_or_default()
    }

    /// Serializes the CQE into 16 bytes.
    pub fn to_array(&self) -> [u8; 16] {
        let mut out = [0u8; 16];
        out.copy_from_slice(self.as_bytes());
        out
    }

    /// The status of this completion (phase tag stripped).
    pub fn status(&self) -> Status {
        Status::from_field(self.status.get() >> 1)
    }

    /// The command identifier.
    pub fn cid(&self) -> u16 {
        self.cid.get()
    }

    /// Dword 0 and dword 1 as one 64-bit value (Property Get of an 8-byte property).
    pub fn value64(&self) -> u64 {
        u64::from(self.dw0.get()) | (u64::from(self.dw1.get()) << 32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::{Status, generic};

    #[test]
    fn sqe_round_trip() {
        let mut sqe = Sqe {
            opcode: 0x02,
            cid: U16::new(0x1234),
            nsid: U32::new(1),
            cdw10: U32::new(0xdead_beef),
            ..Default::default()
        };
        sqe.set_sgl();
        sqe.dptr = SglDescriptor::tcp_transport(4096);
        let raw = sqe.to_array();
        assert_eq!(raw[0], 0x02);
        assert_eq!(&raw[2..4], &[0x34, 0x12]);
        assert_eq!(raw[1] >> 6, 1);
        assert_eq!(raw[39], 0x5A);
        assert_eq!(&raw[32..36], &4096u32.to_le_bytes());
        let back = Sqe::from_array(&raw);
        assert_eq!(back, sqe);
        assert_eq!(back.dptr.data_length(), 4096);
    }

    #[test]
    fn keyed_sgl_fields() {
        let d = SglDescriptor::keyed(0x1122_3344_5566_7788, 0x12_3456, 0xaabb_ccdd, true);
        let raw = d.as_bytes();
        assert_eq!(raw[15], 0x4F);
        assert_eq!(d.keyed_length(), 0x12_3456);
        assert_eq!(d.key(), 0xaabb_ccdd);
        assert_eq!(d.data_length(), 0x12_3456);
    }

    #[test]
    fn cqe_status_round_trip() {
        let s = Status::generic(generic::LBA_OUT_OF_RANGE).with_dnr();
        let cqe = Cqe::new(7, s, 42);
        let raw = cqe.to_array();
        let back = Cqe::from_array(&raw);
        assert_eq!(back.status(), s);
        assert_eq!(back.cid(), 7);
        assert_eq!(back.dw0.get(), 42);
        // Phase bit is zero, SC at bits 8:1.
        assert_eq!(u16::from_le_bytes([raw[14], raw[15]]) & 1, 0);
        assert_eq!((u16::from_le_bytes([raw[14], raw[15]]) >> 1) & 0xFF, 0x80);
    }
}
