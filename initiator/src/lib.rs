//! The nvmeof-direct user-space NVMe-over-Fabrics initiator (NVMe/TCP and NVMe/RDMA).
//!
//! A library for programs that read and write remote NVMe namespaces directly (data loaders,
//! benchmarks), plus two binaries built on it: the `nvmeof` command line tool and the
//! `nvmeof-initd` daemon that holds named attachments.
//!
//! - [`discover`] asks a discovery controller which subsystems exist and where;
//!   [`discover_referrals`] and [`discover_all`] follow its referrals to other discovery
//!   controllers ([`ReferralWalk`]: each once, to a depth limit).
//! - [`Controller::connect`] sets up an association with an NVM subsystem: the admin queue
//!   (Fabrics Connect, controller enable, Identify, Number of Queues), then N I/O queues, each
//!   its own connection (TCP, or an RDMA-CM queue pair for [`Transport::Rdma`]) driven by its
//!   own task. Keep Alive is sent every KATO/2, an Asynchronous Event Request stays posted (a
//!   namespace change refreshes the namespace list), and a lost connection is re-established
//!   with exponential backoff: reads in flight are sent again, writes in flight fail with
//!   [`Error::Interrupted`] unless [`ConnectOptions::retry_writes`] is set. A queue whose
//!   Connect answer asks for in-band authentication runs DH-HMAC-CHAP with the
//!   [`ConnectOptions::dhchap`] secrets first ([`Error::Auth`] when it fails or none are given).
//! - [`Namespace`] does the I/O: [`read`](Namespace::read), [`write`](Namespace::write),
//!   [`flush`](Namespace::flush), [`write_zeroes`](Namespace::write_zeroes),
//!   [`deallocate`](Namespace::deallocate). Transfers above the controller's MDTS are split
//!   and reassembled; many commands are in flight per queue; small writes travel in the
//!   command capsule, larger ones on R2T (NVMe/RDMA: keyed SGLs the target RDMA READs and
//!   WRITEs). Buffers are `&mut [u8]` / `&[u8]`, or any
//!   [`ReadDest`] / [`WriteSource`] (the way other memory, such as GPU buffers, plugs in).
//! - [`QueuePair`] (and [`BlockingQueuePair`] for a plain OS thread) is the run-to-completion
//!   alternative for data-loader threads: the caller owns one I/O queue (a queue ID kept with
//!   [`ConnectOptions::queue_pairs`]), submits reads and writes into its own buffers with no
//!   channel or task in between, and reaps [`Completion`]s in batches with `poll` or `wait`.
//!   It reconnects with the controller, handing its commands in flight over as the shared
//!   queues do (see [`QueuePair`], "Lost connections").
//! - [`Controller::register_buffer`] gives memory registered once for NVMe/RDMA, which
//!   [`Namespace::read_registered`] / [`write_registered`](Namespace::write_registered) let the
//!   target write and read directly (no slot buffer, no copy; plain memory over NVMe/TCP);
//!   `Controller::register_gpu` does the same for GPU memory through dma-buf.
//! - [`gpu`] (feature `gpu`, on by default) reads into and writes from CUDA device memory:
//!   pinned staging slots, asynchronous copies on a stream, batched small reads scattered by a
//!   kernel.
//! - [`Controller::attach_gpu_rings`] lets GPU threads issue their own reads: the request
//!   rings of a [`gpu_ring::RingSet`] are served by the I/O queue tasks themselves (each
//!   wake-up takes a batch of requests, checks them, sends them with one write, and writes
//!   each completion word once the data is in the ring's slot); see [`AttachedRings`].
//! - [`Multipath`] reaches one subsystem over several paths (addresses given, or the entries
//!   of a discovery log with its NQN: [`paths_from_discovery`]): each path is a [`Controller`];
//!   commands take an ANA optimized path, else a non-optimized one, and a command that fails
//!   with a path error is sent again on another path ([`multipath`] says when a write is).
//! - [`open_attached`] opens a namespace that `nvmeof-initd` holds under a name: the daemon
//!   gives the connection parameters and the process makes its own queues, so data never
//!   passes through the daemon.
//!
//! Every wait is bounded ([`Timeouts`]): a silent or broken target gives a typed [`Error`],
//! never a hang. Errors from the controller carry the NVMe status and its name
//! ([`Error::Status`]).
//!
//! # Which queue a command uses
//!
//! A [`Namespace`] future hands its command to an I/O queue itself (over NVMe/TCP the capsule
//! joins the queue's send buffer: no channel, no other task woken) and, while it waits, drives
//! that queue: it writes the capsules of its round with one `write` (a round past 16
//! capsules is written as it grows), reads what arrived and
//! wakes the futures whose commands ended; one waiting future is woken when the socket has
//! more. The queue's own task handles timers, control, GPU rings, a queue another thread held
//! at that instant, and NVMe/RDMA. Which queue takes a command depends on the thread the
//! future is polled on ([`QueuePolicy::PerThread`], the default): each OS thread is given a
//! queue the first time it submits (threads in the order they first submit, modulo the
//! number of I/O queues) and keeps it, with no shared counter touched per command; a queue
//! used by one thread only is driven without contention.
//!
//! - **tokio multi-thread runtime:** each worker thread uses its own queue, so tasks spread
//!   over the queues as the scheduler spreads them over the workers; a task that moves to
//!   another worker uses that worker's queue from then on. Ask for as many I/O queues as
//!   worker threads so that no two share one. The queue tasks run on the runtime that called
//!   [`Controller::connect`].
//! - **tokio current-thread runtime:** every task of the runtime runs on its one thread and so
//!   uses one queue; pin handles with [`Namespace::on_queue`] (or choose
//!   [`QueuePolicy::RoundRobin`]) to use several.
//! - **plain OS thread:** drive the futures with a runtime handle (for example
//!   `Handle::block_on` of the runtime that connected); the thread gets its own queue like any
//!   other and drives it while it waits. A thread that wants to own its queue with no task in between uses a
//!   [`BlockingQueuePair`].
//!
//! Read data lands in the command's buffer and is copied to the caller's; a [`ReadDest`] that
//! lends its buffers (a `Vec<u8>` read in one command does) has it received straight into
//! them over NVMe/TCP.
//!
//! # Example
//!
//! ```no_run
//! use nvmeof_initiator::{ConnectOptions, Controller, HostIdentity, TargetAddr, default_state_dir};
//!
//! # async fn run() -> Result<(), nvmeof_initiator::Error> {
//! let host = HostIdentity::load_or_create(&default_state_dir())?;
//! let addr = TargetAddr::new("192.0.2.10", 4420);
//! let mut opts = ConnectOptions::new(addr, "nqn.2026-11.io.nvmeof-direct:default", host);
//! opts.io_queues = Some(4);
//! let ctrl = Controller::connect(opts).await?;
//! let ns = ctrl.namespace(1).await?;
//!
//! // Read 256 blocks starting at block 0 into a buffer.
//! let mut buf = vec![0u8; 256 * ns.block_size() as usize];
//! ns.read(0, &mut buf).await?;
//!
//! ctrl.disconnect().await?;
//! # Ok(())
//! # }
//! ```
//!
//! What this crate must not do: use `unsafe`, block a runtime thread, allocate per I/O on the
//! data path in steady state, or panic on anything a target sends.
#![forbid(unsafe_code)]

mod admin;
mod auth;
mod buffer;
mod controller;
pub mod daemon;
mod discovery;
mod error;
mod establish;
#[cfg(feature = "gpu")]
pub mod gpu;
pub mod identity;
mod info;
mod link;
pub mod multipath;
mod namespace;
mod options;
mod paths;
mod queue;
mod queue_core;
mod queue_pair;
mod rdma;
mod registered;
mod ring_proxy;
mod ring_serve;
mod setup;
mod supervisor;
mod tags;
mod tcp;

pub use buffer::{BufferError, Lent, LentBuffer, ReadDest, WriteSource};
pub use controller::{Controller, ControllerEvent, ControllerState};
pub use daemon::{open_attached, open_attached_at};
pub use discovery::{
    DEFAULT_REFERRAL_DEPTH, DiscoveryEntry, DiscoveryLog, MAX_REFERRALS, RdmaTsas, ReferralWalk,
    ReferredLog, discover, discover_all, discover_referrals,
};
pub use error::{Error, ErrorClass, connect_hint, fes_name, status_name};
pub use error::{STATUS_INTERNAL, STATUS_PATH_ERROR, STATUS_TIMEOUT};
pub use identity::{HostIdentity, default_state_dir};
pub use info::{ControllerInfo, NamespaceInfo, hex_id, version_string};
pub use multipath::{
    AnaGroupState, Multipath, MultipathNamespace, MultipathOptions, PathInfo, paths_from_discovery,
};
pub use namespace::{
    Namespace, Registrant, ReservationStatus, ResvAcquire, ResvRegister, ResvRelease,
};
pub use options::{
    ConnectOptions, DEFAULT_BUSY_POLL, DEFAULT_DISCOVERY_PORT, DEFAULT_PORT, DEFAULT_RING_POLL,
    DhchapSecrets, DiscoveryOptions, QueuePolicy, ReconnectPolicy, TargetAddr, Timeouts,
    TlsOptions, Transport,
};
pub use paths::PathPolicy;
pub use queue::QueueStats;
pub use queue_pair::{BlockingQueuePair, Completion, QueuePair, Rejected};
pub use registered::RegisteredBuffer;
#[cfg(feature = "gpu")]
pub use registered::{DmabufRequest, RegisteredGpuBuffer};
pub use ring_proxy::AttachedRings;
pub use ring_serve::RING_BATCH;

/// Re-export of the GPU request ring crate ([`Controller::attach_gpu_rings`]).
pub use gpu_ring;
/// Re-export of the wire formats crate (Identify structures, status codes).
pub use nvme_spec;

#[cfg(test)]
mod tests {
    use super::*;

    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>(_: &T) {}

    #[test]
    fn handles_are_send_and_sync() {
        send_sync::<Controller>();
        send_sync::<Namespace>();
        send_sync::<Error>();
        send_sync::<Multipath>();
        send_sync::<MultipathNamespace>();
    }

    /// Compiles only if the multipath I/O futures can move between threads.
    #[allow(dead_code)]
    fn multipath_futures_are_send(ns: &MultipathNamespace, buf: &mut [u8], src: &[u8]) {
        send(&ns.read(0, buf));
        send(&ns.write(0, src));
        send(&ns.flush());
    }

    /// Compiles only if a queue pair can move to the thread or task that drives it.
    #[allow(dead_code)]
    fn queue_pairs_are_send(qp: QueuePair, bqp: BlockingQueuePair, ns: &Namespace) {
        send(&qp);
        send(&bqp);
        send(&QueuePair::open(ns));
    }

    /// Compiles only if the I/O futures can move between threads.
    #[allow(dead_code)]
    fn io_futures_are_send(ns: &Namespace, buf: &mut [u8], src: &[u8], v: &mut Vec<u8>) {
        send(&ns.read(0, buf));
        send(&ns.write(0, src));
        send(&ns.read_into(0, v));
        send(&ns.read_many([(0, &mut *buf), (8, &mut *v)]));
        send(&ns.flush());
        send(&ns.write_zeroes(0, 1));
        send(&ns.deallocate(0, 1));
        send(&Controller::connect(ConnectOptions::new(
            TargetAddr::new("h", 1),
            "nqn.x:y",
            HostIdentity::new("nqn.x:h", [0; 16]).unwrap(),
        )));
        send(&discover(&DiscoveryOptions::new(
            TargetAddr::new("h", 1),
            HostIdentity::new("nqn.x:h", [0; 16]).unwrap(),
        )));
    }
}
