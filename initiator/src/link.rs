//! The link contract: a queue's connection, NVMe/TCP ([`TcpConn`]) or NVMe/RDMA
//! ([`RdmaConn`]), as set-up, the queue core and the queue task see it. Each transport
//! implements [`Wire`] (how a command goes out), receives into the core (how completions and
//! read data come in), and states its limits ([`LinkLimits`]); this enum dispatches without
//! boxing. The contract itself ([`Wire`], [`LinkLimits`]) lives with the queue core.

use std::io;
use std::task::Context;

use tokio::io::Ready;

use crate::Error;
use crate::queue_core::{Cmd, Completions, Core, LinkLimits, QueueCounters, Wire};
use crate::rdma::{RdmaConn, RdmaWake};
use crate::tcp::TcpConn;

/// Receive budget of a poll that takes everything the connection has (queue tasks, set-up):
/// eight reads of the TCP receive buffer.
pub(crate) const RECEIVE_ALL: usize = 8 * crate::tcp::READ_CHUNK;

/// A connected queue connection.
// One value per queue, moved only while a connection is set up: no boxing on the data path.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Link {
    /// NVMe/TCP.
    Tcp(TcpConn),
    /// NVMe/RDMA.
    Rdma(RdmaConn),
}

/// What woke a queue task up on its link.
pub(crate) enum LinkWake {
    /// The socket is ready (or failed).
    Tcp(io::Result<Ready>),
    /// Completions or a connection-manager event.
    Rdma(RdmaWake),
}

impl Link {
    /// The transport's limits.
    pub fn limits(&self) -> LinkLimits {
        match self {
            Link::Tcp(_) => TcpConn::LIMITS,
            Link::Rdma(_) => RdmaConn::LIMITS,
        }
    }

    /// The queue's entries: `entries() - 1` commands fit on the wire at once.
    pub fn entries(&self) -> u16 {
        match self {
            Link::Tcp(t) => t.entries,
            Link::Rdma(r) => r.entries,
        }
    }

    /// Sets the largest write sent in the capsule.
    pub fn set_icd_limit(&mut self, icd_limit: usize) {
        match self {
            Link::Tcp(t) => t.icd_limit = icd_limit,
            Link::Rdma(r) => r.icd_limit = icd_limit,
        }
    }

    /// Whether callers drive the link themselves (NVMe/TCP: a socket whose readiness any
    /// thread can register for); NVMe/RDMA links are driven by their queue's task, which
    /// waits on the completion channel.
    pub fn callers_drive(&self) -> bool {
        matches!(self, Link::Tcp(_))
    }

    /// Whether bytes wait to be sent.
    pub fn has_unsent(&self) -> bool {
        match self {
            Link::Tcp(t) => !t.engine.pending_send().is_empty(),
            Link::Rdma(_) => false,
        }
    }

    /// Registers `cx` to be woken when the link has something to receive (or, with bytes
    /// waiting to be sent, room for them). Returns whether it has already; `false` for a link
    /// callers do not drive.
    pub fn poll_ready(&self, cx: &mut Context<'_>) -> bool {
        match self {
            Link::Tcp(t) => t.poll_ready(cx),
            Link::Rdma(_) => false,
        }
    }

    /// Waits until the link has something to handle (or can take more bytes).
    pub async fn ready(&self) -> LinkWake {
        match self {
            Link::Tcp(t) => LinkWake::Tcp(t.ready().await),
            Link::Rdma(r) => LinkWake::Rdma(r.ready().await),
        }
    }

    /// What a wake-up means for the link: `None` when there is something to receive (or
    /// room to send), the error that ended the connection otherwise.
    pub fn wake_error(&self, addr: &str, wake: LinkWake) -> Option<Error> {
        match wake {
            LinkWake::Tcp(Ok(_)) | LinkWake::Rdma(RdmaWake::Completions(Ok(()))) => None,
            LinkWake::Tcp(Err(e)) => Some(Error::lost(addr, format!("socket error: {e}"))),
            LinkWake::Rdma(RdmaWake::Completions(Err(e))) => {
                Some(Error::lost(addr, format!("completion queue: {e}")))
            }
            LinkWake::Rdma(RdmaWake::Cm(ev)) => match self {
                Link::Rdma(conn) => conn.cm_outcome(ev),
                Link::Tcp(_) => None,
            },
        }
    }

    /// Sends what waits to be sent, as far as possible without blocking (NVMe/RDMA posts
    /// each capsule when it is sent).
    pub fn try_flush(&mut self) -> io::Result<()> {
        match self {
            Link::Tcp(t) => t.try_flush(),
            Link::Rdma(_) => Ok(()),
        }
    }

    /// Takes what arrived (over NVMe/TCP, up to about `budget` bytes of PDUs read through
    /// the receive buffer) and hands it to `core`. Returns whether anything arrived.
    pub fn receive<C: Completions>(
        &mut self,
        core: &mut Core<C>,
        budget: usize,
    ) -> Result<bool, Error> {
        match self {
            Link::Tcp(t) => t.receive(core, budget),
            Link::Rdma(r) => r.process(core),
        }
    }

    /// [`receive`](Self::receive) without waiting for the runtime to have seen the link
    /// readable, for a caller that polls it in a loop: over plain NVMe/TCP a `recv` straight on
    /// the socket ([`TcpConn::receive_now`]); otherwise as `receive`.
    pub fn receive_now<C: Completions>(
        &mut self,
        core: &mut Core<C>,
        budget: usize,
    ) -> Result<bool, Error> {
        match self {
            Link::Tcp(t) => t.receive_now(core, budget),
            Link::Rdma(r) => r.process(core),
        }
    }

    /// Whether [`receive_now`](Self::receive_now) reads the connection without the runtime
    /// (plain NVMe/TCP), so that polling it in a loop can catch data sooner.
    pub fn reads_now(&self) -> bool {
        matches!(self, Link::Tcp(t) if !t.stream.is_tls())
    }

    /// Hands `core` what arrived already (without reading the connection).
    pub fn process<C: Completions>(&mut self, core: &mut Core<C>) -> Result<(), Error> {
        match self {
            Link::Tcp(t) => t.process(core),
            Link::Rdma(r) => r.process(core).map(|_| ()),
        }
    }
}

/// Event: the timer, for a queue driven over `link`: fails the commands past their deadline.
/// When one of them was on the wire the target stopped answering: the link is closed first,
/// so that no buffer goes back to its owner while the target can still reach it (an NVMe/RDMA
/// target writes host memory until its queue pair is destroyed), and the command's error is
/// returned for the queue to report the loss.
pub(crate) fn expire<C: Completions>(link: &mut Option<Link>, core: &mut Core<C>) -> Option<Error> {
    if core.sent_command_expired() {
        drop(link.take());
    }
    core.expire(link.as_mut())
}

impl Wire for Link {
    fn send(
        &mut self,
        tag: u16,
        cmd: &mut Cmd,
        c: &QueueCounters,
    ) -> Result<Result<(), Error>, Error> {
        match self {
            Link::Tcp(t) => t.send(tag, cmd, c),
            Link::Rdma(r) => r.send(tag, cmd, c),
        }
    }

    fn forget(&mut self, tag: u16) {
        match self {
            Link::Tcp(t) => t.forget(tag),
            Link::Rdma(r) => r.forget(tag),
        }
    }
}
