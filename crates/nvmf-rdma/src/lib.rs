//! RDMA verbs and RDMA connection management for NVMe/RDMA (RoCE v2, InfiniBand, iWARP).
//!
//! What it offers:
//! - [`devices`]: the RDMA devices of the host and their limits.
//! - [`ProtectionDomain`] (a host shares one among its queue pairs on a device), [`Registered`]
//!   buffers (host memory; [`PageBuffer`] is page-aligned), [`DmabufRegion`]s (device memory
//!   exported as a dma-buf, e.g. GPU memory, registered with `ibv_reg_dmabuf_mr` from its fd,
//!   offset, length and IOVA) and [`DeviceRegion`]s (device memory registered by address with
//!   `ibv_reg_mr`, resolved by a peer-memory client such as nvidia-peermem; feature `gpu`
//!   makes CUDA device buffers [`DeviceMemory`]).
//! - [`Listener`] / [`ConnectRequest`]: RDMA-CM listen and accept/reject with the NVMe private
//!   data ([`nvme`] validates a host's request and builds the accept and reject records).
//! - [`CapsuleQueue`]: an RC queue pair with its completion queue (polled by the caller, with
//!   a completion channel registered with tokio for wakeups) that receives capsules into
//!   pre-posted registered slots, SENDs small messages, and RDMA READs / RDMA WRITEs caller
//!   buffers; [`CapsuleQueue::connect`] is the active side (a host's queues, sized with
//!   [`QueueConfig::host`]).
//! - [`credits`]: the accounting that keeps send queues, message slots and the peer's
//!   receive queue from overrunning, without I/O.
//!
//! libibverbs and librdmacm are loaded at run time (`dlopen`), never linked: a binary that
//! uses this crate starts on hosts without rdma-core, and RDMA calls then fail with
//! [`Error::Unavailable`]. The static inline fast-path functions of verbs.h
//! (`ibv_post_send`, `ibv_post_recv`, `ibv_poll_cq`, `ibv_req_notify_cq`) are called through
//! the provider's `context->ops` table, as verbs.h does.
//!
//! This is the only crate of the workspace with verbs `unsafe`; every block says why it is
//! sound, and the public API is safe: memory the device may access is owned by the queue
//! until the device is done with it.
//!
//! Not done here: shared receive queues, multiple SGEs per request, memory windows, and
//! inline sends (the completion is sent from a registered slot).
#![deny(unsafe_op_in_unsafe_fn)]

pub mod capsule;
pub mod cm;
pub mod credits;
mod loader;
pub mod nvme;
pub mod sys;
pub mod verbs;

pub use capsule::{CapsuleQueue, DataOut, Event, MAX_KEYED_LEN, QueueConfig, RecvSlot};
pub use cm::{CmEvent, ConnectRequest, Listener};
pub use loader::{available, unavailable_reason};
pub use verbs::{
    Access, DeviceAttr, DeviceInfo, DeviceMemory, DeviceRegion, DmabufRegion, PageBuffer,
    ProtectionDomain, Registered, Registration, RemoteKey, StableBuffer, devices,
};

/// Errors of RDMA operations.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// libibverbs/librdmacm cannot be loaded, or the host has no RDMA-CM device node.
    #[error("RDMA is not available on this host: {0}")]
    Unavailable(String),
    /// A verbs or RDMA-CM call failed.
    #[error("{op}: {source}")]
    Os {
        /// The call.
        op: &'static str,
        /// The error it returned.
        source: std::io::Error,
    },
    /// The installed libraries or the device lack a feature.
    #[error("not supported: {0}")]
    Unsupported(String),
    /// A caller error (sizes, ranges, foreign tokens).
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// The peer rejected the connection.
    #[error("connection rejected (reason {status}, {} bytes of private data)", private_data.len())]
    Rejected {
        /// Transport reject reason (IB CM: 28 = consumer reject).
        status: i32,
        /// The peer's private data (for NVMe, the reject record).
        private_data: Vec<u8>,
    },
    /// An unexpected connection event or timeout.
    #[error("connection: {0}")]
    Cm(String),
}

/// The error of a call that reported failure through `errno`.
pub(crate) fn os_error(op: &'static str) -> Error {
    Error::Os {
        op,
        source: std::io::Error::last_os_error(),
    }
}
