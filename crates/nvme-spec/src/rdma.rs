//! NVMe/RDMA RDMA-CM private data (NVMe-oF 1.1 section 7.3).

use zerocopy::little_endian::U16;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

/// RDMA_CM_REQUEST private data, 32 bytes (NVMe-oF 1.1, Figure 52).
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
pub struct CmRequest {
    /// Record format (0).
    pub recfmt: U16,
    /// Queue ID.
    pub qid: U16,
    /// Host receive queue size (0's based).
    pub hrqsize: U16,
    /// Host send queue size (0's based).
    pub hsqsize: U16,
    /// Controller ID (0xFFFF for the admin queue).
    pub cntlid: U16,
    /// Reserved.
    pub rsvd: [u8; 22],
}
const _: () = assert!(size_of::<CmRequest>() == 32);

/// RDMA_CM_ACCEPT private data, 32 bytes (NVMe-oF 1.1, Figure 53).
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
pub struct CmAccept {
    /// Record format (0).
    pub recfmt: U16,
    /// Controller receive queue size.
    pub crqsize: U16,
    /// Reserved.
    pub rsvd: [u8; 28],
}
const _: () = assert!(size_of::<CmAccept>() == 32);

/// RDMA_CM_REJECT private data, 4 bytes (NVMe-oF 1.1, Figure 54).
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
pub struct CmReject {
    /// Record format (0).
    pub recfmt: U16,
    /// Status ([`reject`]).
    pub status: U16,
}
const _: () = assert!(size_of::<CmReject>() == 4);

/// RDMA_CM_REJECT status codes (NVMe-oF 1.1, Figure 55).
pub mod reject {
    /// Invalid private data length.
    pub const INVALID_LENGTH: u16 = 0x01;
    /// Invalid record format.
    pub const INVALID_RECFMT: u16 = 0x02;
    /// Invalid queue ID.
    pub const INVALID_QID: u16 = 0x03;
    /// Invalid host send queue size.
    pub const INVALID_HSQSIZE: u16 = 0x04;
    /// Invalid host receive queue size.
    pub const INVALID_HRQSIZE: u16 = 0x05;
    /// No resources.
    pub const NO_RESOURCES: u16 = 0x06;
    /// Invalid IRD.
    pub const INVALID_IRD: u16 = 0x07;
    /// Invalid ORD.
    pub const INVALID_ORD: u16 = 0x08;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_round_trip() {
        let r = CmRequest {
            qid: U16::new(2),
            hrqsize: U16::new(127),
            hsqsize: U16::new(127),
            cntlid: U16::new(1),
            ..Default::default()
        };
        let raw = r.as_bytes();
        assert_eq!(&raw[2..4], &[2, 0]);
        assert_eq!(CmRequest::read_from_bytes(raw).unwrap(), r);
    }
}
