//! Sans-IO NVMe/TCP transport engine used by both the target and the host.
//!
//! This crate turns received bytes into protocol events and protocol requests into bytes to
//! send, following the NVM Express TCP Transport Specification 1.0:
//!
//! - [`TargetConn`] is the controller side (used by the target daemon): it answers the ICReq,
//!   delivers command capsules and H2CData checked against the R2Ts it sent, and encodes
//!   CapsuleResp, C2HData and R2T PDUs. It counts each command until its completion has been
//!   sent and ends the connection when a host goes past its queue size
//!   ([`TargetConn::set_queue_size`]).
//! - [`HostConn`] is the host side (used by the initiator): it sends the ICReq, validates the
//!   ICResp as the Linux host does, encodes CapsuleCmd and H2CData PDUs, and delivers
//!   CapsuleResp, C2HData (in pieces, as it arrives) and R2Ts checked against the commands it
//!   sent.
//! - [`PduHeader`] and [`digest_bytes`]/[`DataDigest`] are the low-level encoders for callers
//!   that gather header, payload and digest with one vectored write.
//!
//! Both sides check framing (HLEN, PDO, PLEN, flags), CRC32C header and data digests when
//! negotiated, and the data-transfer sequencing rules. A fatal violation yields a
//! [`ProtocolError`] carrying the Fatal Error Status and Fatal Error Information, with the
//! matching TermReq (and the offending header) queued in the send buffer. Data digest errors
//! are not fatal (section 3.5): they are reported as events and the connection continues.
//!
//! Receiving: read the socket into [`TargetConn::recv_buf`] (asking for
//! [`TargetConn::recv_hint`] bytes, so that a connection still waiting for its ICReq holds only
//! 128 bytes) and call
//! [`TargetConn::commit_recv`] (or [`TargetConn::feed`] a slice), then call
//! [`TargetConn::next_event`] until it returns `Ok(None)`. Event data borrows the receive
//! buffer: no copy is made. Sending: write [`TargetConn::pending_send_slices`] to the socket
//! (one vectored write) and report progress with [`TargetConn::consume_sent`]; read data
//! queued with [`TargetConn::send_c2h_data_shared`] is sent from the caller's shared buffers,
//! not copied. The host side works the same way, with [`HostConn::pending_send`].
//!
//! What this crate must not do: perform I/O, spawn tasks, depend on an async runtime, read
//! the clock, interpret NVMe commands beyond what the transport needs (the command
//! identifier, and for the host the SGL1 length and data direction), or panic on any input.
//! Buffers grow with the traffic (the target's receive buffer from 128 bytes before the ICReq,
//! its reads doubling while they fill) and are reused; steady-state traffic does not allocate
//! per PDU. [`TargetConn::release_buffers`] gives capacity back when a connection goes idle.
#![forbid(unsafe_code)]

mod digest;
mod encode;
mod error;
pub mod fuzzing;
mod host;
mod rx;
mod sendq;
mod tagmap;
mod target;

pub use digest::{DataDigest, crc32c, digest_bytes};
pub use encode::{Digests, MAX_HEADER_LEN, PduHeader, pda_alignment};
pub use error::{ConfigError, ProtocolError, SendError};
pub use host::{DataCommit, HostConfig, HostConn, HostEvent, HostParams, PendingData};
pub use nvme_spec::tcp::FatalErrorStatus;
pub use rx::RxBytes;
pub use target::{Responder, TargetConfig, TargetConn, TargetEvent, TargetParams};
