//! The command engine: what happens to a command between the [`Submit`](crate::queue::Submit)
//! of [`crate::queue`] and its single completion, the same for every transport.
//!
//! A transport (NVMe/TCP in [`crate::tcp`], NVMe/RDMA in [`crate::rdma`]) moves bytes, work
//! completions and data; it owns one [`Engine`] per connection and asks it to:
//!
//! - run data-plane requests ([`Engine::run`], [`Transport::start`]): inline for backends that never wait (memory,
//!   null), as a future otherwise, up to the queue depth; which is which is the engine's
//!   business, not the transport's;
//! - turn an outcome into the CQE to send, recording failures (with their LBA) in the
//!   controller's error log ([`Engine::io_completion`]); a transport that cannot carry a
//!   command names the [`Fault`] and the engine picks the status ([`Engine::fail`]);
//! - wait for the next thing that is not the transport's own I/O ([`Engine::next`]): a
//!   finished request, an asynchronous event for a held Asynchronous Event Request, the
//!   controller's teardown, the target's shutdown, the handshake timeout and the keep-alive
//!   timeout (which tears the controller down);
//! - log why the connection ended ([`Engine::finish`]).
//!
//! In return the transport implements [`Transport`]: send a finished request's data and
//! completion, and send the completion of a held command. Dispatch is static (generics): no
//! allocation, lock or dynamic call is added per command.
//!
//! `T` is the transport's tag for a running request: what it needs to answer it (the SQE on
//! NVMe/TCP, the command's slot token on NVMe/RDMA).

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use blockdev::IoBuf;
use futures_util::FutureExt;
use futures_util::stream::{FuturesUnordered, StreamExt};
use nvme_spec::status::generic;
use nvme_spec::{Cqe, Sqe, Status};
use tokio::sync::watch;
use tracing::{debug, info, warn};

use crate::admission::{DropReason, Permit};
use crate::controller::{Controller, EventReceiver};
use crate::queue::{IoOp, IoRequest, QueueState};

/// Why a connection ended.
#[derive(Debug)]
pub enum Closed {
    /// The host closed the connection.
    HostClosed,
    /// A socket error.
    Io(io::Error),
    /// The queue pair or connection failed.
    Transport(String),
    /// A protocol violation (a TermReq was sent where the transport has one).
    Protocol(String),
    /// The host sent a TermReq.
    HostTermReq(u16),
    /// Disconnect command, controller teardown, keep-alive timeout or target shutdown.
    Local(&'static str),
    /// ICReq (where the transport has one) and Connect were not done within the handshake
    /// timeout.
    HandshakeTimeout,
}

impl Closed {
    /// Whether the connection ended by a fault rather than in order.
    fn is_error(&self) -> bool {
        matches!(
            self,
            Closed::Io(_) | Closed::Transport(_) | Closed::Protocol(_) | Closed::HostTermReq(_)
        )
    }
}

impl std::fmt::Display for Closed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Closed::HostClosed => f.write_str("host closed the connection"),
            Closed::Io(e) => write!(f, "socket error: {e}"),
            Closed::Transport(e) => write!(f, "transport error: {e}"),
            Closed::Protocol(r) => write!(f, "protocol error: {r}"),
            Closed::HostTermReq(fes) => write!(f, "host sent TermReq (FES {fes:#x})"),
            Closed::Local(r) => f.write_str(r),
            Closed::HandshakeTimeout => f.write_str("handshake timeout"),
        }
    }
}

/// Why a transport could not carry a command: the engine turns it into the NVMe status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The command's data arrived damaged (a data digest error).
    DataDigest,
    /// The command identifier is already in use by a command still in the target.
    CommandIdConflict,
    /// The data descriptor is not one this transport can serve.
    SglType,
    /// The host's buffer could not be transferred at the length the command gives.
    SglLength,
    /// The target ran out of a resource (e.g. registered memory).
    Resources,
}

impl Fault {
    /// The status the host sees.
    pub fn status(self) -> Status {
        match self {
            Fault::DataDigest => Status::generic(generic::TRANSIENT_TRANSPORT_ERROR),
            Fault::CommandIdConflict => Status::generic(generic::COMMAND_ID_CONFLICT).with_dnr(),
            Fault::SglType => Status::generic(generic::SGL_TYPE_INVALID).with_dnr(),
            Fault::SglLength => Status::generic(generic::DATA_SGL_LENGTH_INVALID).with_dnr(),
            Fault::Resources => Status::generic(generic::INTERNAL_ERROR),
        }
    }
}

/// The transport contract: what the engine needs from a transport. The transport moves
/// bytes, work completions and data; everything about commands is the engine's.
pub trait Transport {
    /// What the transport needs to answer a running request.
    type Tag: 'static;

    /// The connection's engine.
    fn engine(&mut self) -> &mut Engine<Self::Tag>;

    /// Sends a finished request's data (a successful read's) and its completion, built with
    /// [`Engine::io_completion`].
    fn complete(&mut self, done: Done<Self::Tag>);

    /// Sends the completion of a held command (an Asynchronous Event Request).
    fn complete_held(&mut self, cqe: Cqe);

    /// Runs a request on the engine; an inline outcome is answered at once.
    fn start(&mut self, tag: Self::Tag, req: IoRequest, buf: IoBuf) {
        if let Some(done) = self.engine().run(tag, req, buf) {
            self.complete(done);
        }
    }

    /// Acts on what [`Engine::next`] woke for: answers finished requests (every one that has
    /// finished by now, so that their answers leave together) and events. Returns
    /// [`Closed::HandshakeTimeout`] when the handshake timeout passed.
    fn on_wake(&mut self, wake: Wake<Self::Tag>) -> Option<Closed> {
        match wake {
            Wake::Done(done) => {
                self.complete(done);
                while let Some(done) = self.engine().done_now() {
                    self.complete(done);
                }
            }
            Wake::Event(cqe) => self.complete_held(cqe),
            Wake::HandshakeExpired => return Some(Closed::HandshakeTimeout),
            Wake::Handled => {}
        }
        None
    }
}

/// A finished data-plane request.
pub struct Done<T> {
    /// The transport's tag.
    pub tag: T,
    /// The request.
    pub req: IoRequest,
    /// Its outcome.
    pub status: Status,
    /// The data buffer handed to [`Engine::run`], with a read's data.
    pub buf: IoBuf,
}

/// What [`Engine::next`] woke up for.
pub enum Wake<T> {
    /// A request finished: send its completion.
    Done(Done<T>),
    /// An asynchronous event: the completion of a held Asynchronous Event Request.
    Event(Cqe),
    /// The handshake timeout passed before the Connect (counted as a dropped connection).
    HandshakeExpired,
    /// Something the engine handled itself (closing set, or nothing to do).
    Handled,
}

type IoFuture<T> = Pin<Box<dyn Future<Output = Done<T>>>>;

/// The per-connection command engine (see the module documentation).
pub struct Engine<T> {
    /// The queue's command layer.
    pub q: QueueState,
    inflight: FuturesUnordered<IoFuture<T>>,
    events: Option<EventReceiver>,
    ctrl_shutdown: Option<watch::Receiver<bool>>,
    target_shutdown: watch::Receiver<bool>,
    /// Set once the connection is to close: no new commands, in-flight ones finish.
    pub closing: Option<Closed>,
    /// Until the Fabrics Connect succeeds: when the connection is closed.
    handshake_deadline: Option<Instant>,
    permit: Permit,
}

async fn next_event(rx: &mut Option<EventReceiver>) -> Option<Cqe> {
    match rx {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

async fn changed(rx: &mut Option<watch::Receiver<bool>>) {
    match rx {
        Some(rx) => {
            if rx.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
        None => std::future::pending().await,
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d.into()).await,
        None => std::future::pending().await,
    }
}

/// The LBA an error log entry names for a failed request.
fn error_lba(op: &IoOp) -> u64 {
    match *op {
        IoOp::Read { lba, .. } | IoOp::Write { lba, .. } | IoOp::WriteZeroes { lba, .. } => lba,
        _ => 0,
    }
}

async fn run_io<T>(ctrl: Arc<Controller>, tag: T, req: IoRequest, buf: IoBuf) -> Done<T> {
    let (status, buf) = crate::io::execute(&ctrl, &req, buf).await;
    Done {
        tag,
        req,
        status,
        buf,
    }
}

impl<T: 'static> Engine<T> {
    /// An engine for a new connection whose command layer is `q`; `permit` is its place in
    /// the connection limits. The handshake timeout starts now.
    pub fn new(q: QueueState, permit: Permit) -> Self {
        let target_shutdown = q.target.subscribe_shutdown();
        let handshake_deadline = Some(Instant::now() + q.target.settings.handshake_timeout);
        Engine {
            q,
            inflight: FuturesUnordered::new(),
            events: None,
            ctrl_shutdown: None,
            target_shutdown,
            closing: None,
            handshake_deadline,
            permit,
        }
    }

    /// Marks the connection closing for `reason`, unless it already is.
    pub fn close(&mut self, reason: Closed) {
        if self.closing.is_none() {
            self.closing = Some(reason);
        }
    }

    /// Requests running on a backend.
    pub fn in_flight(&self) -> usize {
        self.inflight.len()
    }

    /// Forgets the running requests (the connection is being torn down for a protocol error).
    pub fn abandon_in_flight(&mut self) {
        self.inflight.clear();
    }

    /// After a successful Connect: watch the controller and, on an admin queue, its events.
    /// Cheap to call after every command.
    pub fn watch_controller(&mut self) {
        if self.ctrl_shutdown.is_none() {
            if let Some(ctrl) = &self.q.ctrl {
                self.ctrl_shutdown = Some(ctrl.subscribe_shutdown());
                self.handshake_deadline = None;
                if self.events.is_none() {
                    self.events = self.q.events.take();
                }
            }
        }
    }

    /// Runs `req` with `buf` (a write's data, the destination of a read). Returns the outcome
    /// at once for backends that never wait; otherwise the request runs concurrently and
    /// [`Engine::next`] returns it when done.
    pub fn run(&mut self, tag: T, req: IoRequest, buf: IoBuf) -> Option<Done<T>> {
        let Some(ctrl) = self.q.ctrl.clone() else {
            let status = Status::generic(generic::COMMAND_SEQUENCE_ERROR).with_dnr();
            return Some(Done {
                tag,
                req,
                status,
                buf,
            });
        };
        if req
            .ns
            .as_ref()
            .is_some_and(|ns| crate::io::never_waits(&ns.backend))
        {
            let (status, buf) = match crate::io::execute(&ctrl, &req, buf).now_or_never() {
                Some(r) => r,
                None => (Status::generic(generic::INTERNAL_ERROR), IoBuf::new(0)),
            };
            return Some(Done {
                tag,
                req,
                status,
                buf,
            });
        }
        self.inflight.push(Box::pin(run_io(ctrl, tag, req, buf)));
        None
    }

    /// A request that finished by now, without waiting.
    pub fn done_now(&mut self) -> Option<Done<T>> {
        self.inflight.next().now_or_never().flatten()
    }

    /// The CQE of a finished request; a failure goes to the error log with its LBA.
    pub fn io_completion(&self, sqe: &Sqe, req: &IoRequest, status: Status) -> Cqe {
        if !status.is_success() {
            self.q.record_error(sqe, status, error_lba(&req.op));
        }
        self.q.completion(req.cid, status, 0)
    }

    /// The CQE failing `sqe` for `fault`, recorded in the error log (no LBA).
    pub fn fail(&self, sqe: &Sqe, fault: Fault) -> Cqe {
        let status = fault.status();
        self.q.record_error(sqe, status, 0);
        self.q.completion(sqe.cid(), status, 0)
    }

    /// Waits for a finished request, an asynchronous event, the controller's teardown, the
    /// target's shutdown, the handshake timeout or the keep-alive timeout, in that order of
    /// preference. Teardown, shutdown and keep-alive expiry set [`Engine::closing`].
    pub async fn next(&mut self) -> Wake<T> {
        let deadline = self.handshake_deadline.or_else(|| {
            self.q
                .ctrl
                .as_ref()
                .filter(|_| self.q.qid == 0)
                .and_then(|c| c.keep_alive_deadline())
        });
        tokio::select! {
            biased;
            Some(done) = self.inflight.next(), if !self.inflight.is_empty() => Wake::Done(done),
            Some(cqe) = next_event(&mut self.events) => Wake::Event(cqe),
            _ = changed(&mut self.ctrl_shutdown) => {
                self.close(Closed::Local("controller torn down"));
                self.ctrl_shutdown = None;
                Wake::Handled
            }
            _ = self.target_shutdown.changed() => {
                self.close(Closed::Local("target shutting down"));
                Wake::Handled
            }
            _ = sleep_until(deadline), if deadline.is_some() => self.deadline_passed(),
        }
    }

    fn deadline_passed(&mut self) -> Wake<T> {
        let now = Instant::now();
        if self.handshake_deadline.is_some_and(|d| d <= now) {
            self.handshake_deadline = None;
            self.permit
                .gate()
                .note_dropped(DropReason::HandshakeTimeout);
            return Wake::HandshakeExpired;
        }
        if let Some(ctrl) = &self.q.ctrl {
            if ctrl.keep_alive_deadline().is_some_and(|d| d <= now) {
                warn!(
                    cntlid = ctrl.cntlid,
                    hostnqn = %ctrl.hostnqn,
                    peer = %self.q.origin.peer,
                    "keep alive timeout expired: tearing the controller down"
                );
                ctrl.tear_down();
                self.closing = Some(Closed::Local("keep alive timeout"));
            }
        }
        Wake::Handled
    }

    /// Logs why the connection ended; an admin queue's end tears its controller down.
    pub fn finish(&self, reason: &Closed, peer: SocketAddr, transport: &'static str) {
        let Some(ctrl) = &self.q.ctrl else {
            match reason {
                Closed::Protocol(r) => {
                    warn!(%peer, transport, reason = %r, "connection closed: protocol error")
                }
                Closed::HostClosed | Closed::Local(_) => {
                    debug!(%peer, transport, "connection closed before Connect")
                }
                Closed::HandshakeTimeout => {
                    debug!(%peer, transport, "connection closed: no Connect within the handshake timeout")
                }
                other => {
                    info!(%peer, transport, reason = %other, "connection closed before Connect")
                }
            }
            return;
        };
        let error = reason.is_error();
        if self.q.qid == 0 {
            ctrl.tear_down();
            if error {
                warn!(cntlid = ctrl.cntlid, hostnqn = %ctrl.hostnqn, %peer, subnqn = ctrl.subnqn(), reason = %reason, transport, "controller disconnected");
            } else {
                info!(cntlid = ctrl.cntlid, hostnqn = %ctrl.hostnqn, %peer, subnqn = ctrl.subnqn(), reason = %reason, transport, "controller disconnected");
            }
        } else if error {
            warn!(cntlid = ctrl.cntlid, hostnqn = %ctrl.hostnqn, %peer, qid = self.q.qid, reason = %reason, transport, "I/O queue closed");
        } else {
            debug!(cntlid = ctrl.cntlid, hostnqn = %ctrl.hostnqn, %peer, qid = self.q.qid, reason = %reason, transport, "I/O queue closed");
        }
    }
}
