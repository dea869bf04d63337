//! NVMe and NVMe-oF wire formats shared by the target and the initiator.
//!
//! Submission and completion queue entries, status codes with names, opcodes, typed command
//! decoding, Identify structures, log pages (discovery, error information, SMART), fabrics
//! Connect and properties, in-band authentication (Authentication Send/Receive and the
//! DH-HMAC-CHAP messages), NVMe/TCP PDU headers and NVMe/RDMA private data.
//!
//! Every wire structure is `#[repr(C)]`, byte aligned (zerocopy's little-endian integer types),
//! and checked by compile-time size and offset assertions against the specification's figures.
//! This crate performs no I/O and contains no `unsafe`.
#![forbid(unsafe_code)]

pub mod auth;
pub mod command;
pub mod fabrics;
pub mod features;
pub mod identify;
pub mod log;
pub mod opcode;
pub mod queue;
pub mod rdma;
pub mod status;
pub mod tcp;

pub use command::{AdminCommand, FabricsCommand, IoCommand};
pub use queue::{Cqe, SglDescriptor, Sqe};
pub use status::Status;
pub use zerocopy::{FromBytes, IntoBytes};
