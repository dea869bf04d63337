//! The data-plane operations a validated I/O command comes to ([`crate::queue`] validates,
//! [`crate::engine`] runs, [`crate::metrics`] counts them).

/// Where the data of a host-to-controller command is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataSource {
    /// In the command capsule.
    InCapsule,
    /// To be fetched from the host by the transport (R2T for TCP, RDMA READ for RDMA).
    Host,
}

/// Data-plane operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoOp {
    /// Read `len` bytes at block `lba` and return them to the host.
    Read {
        /// First block.
        lba: u64,
        /// Bytes.
        len: usize,
    },
    /// Write `len` bytes at block `lba`.
    Write {
        /// First block.
        lba: u64,
        /// Bytes.
        len: usize,
        /// Where the data is.
        src: DataSource,
        /// Force Unit Access: durable before it completes.
        fua: bool,
    },
    /// Make written data durable.
    Flush,
    /// Write zeroes (optionally deallocating).
    WriteZeroes {
        /// First block.
        lba: u64,
        /// Blocks.
        nlb: u32,
        /// Deallocate instead of writing if possible.
        deallocate: bool,
        /// Force Unit Access: durable before it completes.
        fua: bool,
    },
    /// Dataset Management: the ranges in the command data (`ranges` 16-byte entries).
    Dsm {
        /// Number of ranges.
        ranges: u16,
        /// Bytes of command data (at least `ranges` * 16; hosts may send a whole page).
        len: usize,
        /// Where the range list is.
        src: DataSource,
        /// Deallocate the ranges (otherwise only hints, nothing to do).
        deallocate: bool,
    },
    /// Reservation Register, Acquire or Release: `len` bytes of keys in the command data.
    Reservation {
        /// The opcode.
        opcode: u8,
        /// Command dword 10.
        cdw10: u32,
        /// Bytes of command data.
        len: usize,
        /// Where the data is.
        src: DataSource,
    },
    /// Reservation Report: the reservation status, `len` bytes returned to the host.
    ReservationReport {
        /// Bytes the host's buffer holds.
        len: usize,
        /// Extended data structure.
        eds: bool,
    },
}

impl IoOp {
    /// Bytes the host must send before the operation runs (0 if none or in the capsule).
    pub fn host_data_len(&self) -> usize {
        match *self {
            IoOp::Write {
                len,
                src: DataSource::Host,
                ..
            } => len,
            IoOp::Dsm {
                len,
                src: DataSource::Host,
                ..
            }
            | IoOp::Reservation {
                len,
                src: DataSource::Host,
                ..
            } => len,
            _ => 0,
        }
    }
}
