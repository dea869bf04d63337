//! The nvmeof-direct NVMe-over-Fabrics target.
//!
//! Exports namespaces (memory, null, files, block devices) of NVM subsystems over NVMe/TCP to
//! any standard host: the Linux kernel's `nvme-tcp`, SPDK's host, and the nvmeof-direct
//! initiator. The discovery service answers on every listener and on dedicated discovery
//! listeners.
//!
//! Layers, from the wire inwards:
//! - [`tcp`]: one task per connection on a reactor thread; bytes become PDUs through the
//!   sans-IO `nvmf-tcp` engine; data moves by C2HData and R2T/H2CData.
//! - [`rdma`]: NVMe/RDMA on `nvmf-rdma` (libibverbs/librdmacm loaded at run time): capsules by
//!   SEND/RECV, data by RDMA READ/WRITE of the host's keyed buffers.
//! - [`engine`]: the command engine every transport shares, from a command's arrival to its
//!   single completion: submission, inline or concurrent execution (the memory/null read fast
//!   path too), the error log, asynchronous events, keep-alive, the closing drain and grace,
//!   shutdown and the closing log. Transports supply only where bytes come from and go.
//! - [`queue`]: transport-independent queue logic (Connect, properties, validation of I/O
//!   commands into [`queue::IoRequest`]s of an [`op::IoOp`]). Transports never look at
//!   opcodes.
//! - [`auth`]: in-band authentication (DH-HMAC-CHAP) of each queue (the queue's side, and
//!   the refusal of other commands until it succeeds, are in [`queue`]).
//! - [`controller`]: per-host controllers and the admin command set; [`discovery`] builds the
//!   discovery log page; [`ana`]: the ANA state of each group on each listener.
//! - [`io`]: runs data-plane requests against `blockdev` backends.
//! - [`target`]: the registry: subsystems, the table of listeners, limits, the shutdown
//!   signal. It binds nothing.
//! - [`plan`]: the vocabulary of changes and `plan(old, new)`, pure; [`reconfigure`]: carries
//!   changes out on the running target (prepare what can fail, then commit), with the hosts
//!   notified; [`control`]: the control socket's protocol, one change per request;
//!   [`remote`]: the same requests over TCP with mutual TLS.
//! - [`launcher`] and [`reactor`]: the listener seam (binding, accept loops) and one pool of
//!   thread-per-core reactors for every transport (with the busy-poll window), orderly
//!   shutdown.
//! - [`metrics`]: per-queue counter cells and latency histograms (a leaf the hot path
//!   writes) and the [`metrics::MetricsSnapshot`] they add up to at scrape time;
//!   [`exporter`]: the Prometheus endpoint over a running target.
//! - [`admission`]: connection limits per listener and in total, and the log of connections
//!   dropped by a limit or by the handshake timeout.
//! - [`ratelimit`]: the log limits of per-connection events and the authentication budgets
//!   per host NQN and source address, and the threads authentication work runs on.
//!
//! This crate never panics on input from the network: every malformed command gets an NVMe
//! status, and every protocol violation a TermReq and a closed connection.
#![forbid(unsafe_code)]

pub mod admission;
pub mod advertise;
pub mod ana;
pub mod auth;
pub mod config;
pub mod control;
pub mod controller;
pub mod discovery;
pub mod engine;
pub mod exporter;
pub mod io;
pub mod launcher;
pub mod memory;
pub mod metrics;
pub mod op;
pub mod plan;
pub mod queue;
pub mod ratelimit;
pub mod rdma;
pub mod reactor;
pub mod reconfigure;
pub mod remote;
pub mod reservation;
pub mod subsystem;
pub mod target;
pub mod tcp;
#[cfg(test)]
mod testing;

pub use config::Config;
pub use launcher::RunningTarget;
pub use target::Target;
