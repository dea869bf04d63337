//! The command engine: what happens to a command from its arrival to its single completion,
//! the same for every transport.
//!
//! A transport (NVMe/TCP in [`crate::tcp`], NVMe/RDMA in [`crate::rdma`]) moves bytes, work
//! completions and data. It owns one [`Engine`] per connection and hands it each command
//! ([`Engine::command`]); the engine validates it ([`crate::queue`]), runs it and answers
//! it through the transport's side of the contract, [`Transport`], which says only where
//! bytes come from and where they go. What the transport does next is the returned [`Step`]:
//! nothing (answered, or running on a backend), fetch the data from the host and hand it
//! back ([`Engine::fetched`]), keep a held command, or close.
//!
//! The engine also:
//! - runs data-plane requests: inline for backends that never wait (memory, null), as a
//!   future otherwise, up to the queue depth; which is which is the engine's business, not
//!   the transport's. A read from memory or null goes straight where the transport sends
//!   from: written in place ([`Transport::send_read_with`]) or, when large, sent from the
//!   namespace's own memory ([`Transport::send_read_shared`]);
//! - turns an outcome into the CQE to send, recording failures (with their LBA) in the
//!   controller's error log; a transport that cannot carry a command names the [`Fault`]
//!   and the engine picks the status ([`Engine::fail`]);
//! - waits for the next thing that is not the transport's own I/O ([`Engine::next`]): a
//!   finished request, an asynchronous event for a held Asynchronous Event Request, the
//!   controller's teardown, the target's shutdown, the handshake timeout, the keep-alive
//!   timeout (which tears the controller down) and the end of the closing grace;
//! - decides when a closing connection may go ([`Engine::drained`]): once no request runs
//!   and the transport has nothing left to send, or the grace ran out;
//! - logs why the connection ended ([`Engine::finish`]).
//!
//! Dispatch is static (generics): no allocation, lock or dynamic call is added per command.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use blockdev::{Backend, IoBuf, SharedPiece};
use futures_util::FutureExt;
use futures_util::stream::{FuturesUnordered, StreamExt};
use nvme_spec::status::generic;
use nvme_spec::{Cqe, Sqe, Status};
use tokio::sync::watch;
use tracing::{debug, info, warn};

use crate::admission::{DropReason, Permit};
use crate::controller::{Controller, EventReceiver};
use crate::log_limited;
use crate::metrics::IoCell;
use crate::queue::{DataSource, IoOp, IoRequest, QueueState, Submit};
use crate::ratelimit::LogKind;

/// How long a closing connection waits for the transport to send what it has queued before
/// it goes anyway (requests running on a backend always finish first).
pub const CLOSE_GRACE: Duration = Duration::from_secs(10);

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

/// A command the transport could not answer as asked: its tag and why.
pub type Refused<T> = (T, Fault);

/// The transport's side of the command flow: where a command's bytes come from and where its
/// answer goes. The engine calls these while it takes a command in and answers it;
/// everything about commands (opcodes, backends, statuses) is the engine's.
///
/// `Tag` names a command from its arrival to its answer: what the transport needs to answer
/// it (the SQE on NVMe/TCP, the command's slot token on NVMe/RDMA).
pub trait Transport {
    /// What names a command until it is answered.
    type Tag: 'static;

    /// The command `tag` names.
    fn sqe<'a>(&'a self, tag: &'a Self::Tag) -> &'a Sqe;

    /// The command's in-capsule data (or its data fetched before it was handed over).
    fn capsule(&self, tag: &Self::Tag) -> &[u8];

    /// A buffer of `len` bytes for a request's data (a read's destination, a write's data);
    /// with `from_capsule` a copy of the command's in-capsule data, which is `len` bytes.
    /// It comes back through [`send_read`](Self::send_read) or
    /// [`recycle`](Self::recycle).
    fn buffer(&mut self, tag: &Self::Tag, len: usize, from_capsule: bool) -> Result<IoBuf, Fault>;

    /// Sends `cqe`, the answer to `tag`, after `data` for the host when there is any (an
    /// admin command's data); what the command held is let go. Refused when the command's
    /// data descriptor cannot carry `data`.
    fn respond(&mut self, tag: Self::Tag, data: &[u8], cqe: &Cqe)
    -> Result<(), Refused<Self::Tag>>;

    /// Sends a successful read's data, all of `buf`, then `cqe`; with `in_data` the
    /// completion may go with the data instead (NVMe/TCP's SUCCESS flag when the host
    /// disabled SQ flow control). Takes the buffer back.
    fn send_read(
        &mut self,
        tag: Self::Tag,
        buf: IoBuf,
        cqe: &Cqe,
        in_data: bool,
    ) -> Result<(), Refused<Self::Tag>>;

    /// Takes back a request's buffer that carries no data to the host.
    fn recycle(&mut self, tag: &Self::Tag, buf: IoBuf);

    /// Sends the completion of a held command (an Asynchronous Event Request).
    fn complete_held(&mut self, cqe: &Cqe);

    /// Sends `len` bytes of read data for `tag` with each piece written in place by
    /// `fill(offset, out)`, at offsets that are multiples of `align`: the data goes from the
    /// namespace to where the transport sends from with one copy. `Some(Ok(true))`: sent with
    /// the completion in it (only with `in_data`); `Some(Ok(false))`: the completion is still
    /// to be sent (also when the data could not be queued); the error of `fill` when it
    /// failed (nothing queued). None, doing nothing, when the transport cannot; the engine
    /// then reads into a [`buffer`](Self::buffer).
    fn send_read_with<E>(
        &mut self,
        _tag: &Self::Tag,
        _len: usize,
        _align: usize,
        _in_data: bool,
        _fill: impl FnMut(usize, &mut [u8]) -> Result<(), E>,
    ) -> Option<Result<bool, E>> {
        None
    }

    /// Reads of at least this many bytes from memory and null namespaces are sent from the
    /// namespace's own memory ([`send_read_shared`](Self::send_read_shared)); `usize::MAX`
    /// for never.
    fn shared_read_min(&self) -> usize {
        usize::MAX
    }

    /// Sends `len` bytes of read data for `tag` from `pieces` of namespace memory (held
    /// until sent). Returns whether the completion went with the data (only with
    /// `in_data`).
    fn send_read_shared(
        &mut self,
        _tag: &Self::Tag,
        _len: usize,
        _in_data: bool,
        _pieces: &[SharedPiece],
    ) -> bool {
        false
    }
}

/// What the transport does next with a command handed to [`Engine::command`].
#[must_use]
pub enum Step<T> {
    /// Nothing: the command was answered.
    Answered,
    /// Nothing now: the request runs on a backend and [`Engine::next`] returns it.
    Started,
    /// Keep `T` until the command's completion comes through
    /// [`Transport::complete_held`] (an Asynchronous Event Request).
    Held(T),
    /// Fetch the command's data from the host ([`Fetch::len`] bytes), then hand it to
    /// [`Engine::fetched`] (or the fault to [`Engine::fetch_failed`]).
    Fetch(Fetch<T>),
    /// The connection closes ([`Engine::closing`] is set): the command was answered, or
    /// left unanswered because its controller is gone (the host sends it again after it
    /// reconnects).
    Close,
}

/// A command waiting for its data from the host ([`Step::Fetch`]).
pub struct Fetch<T> {
    tag: T,
    req: IoRequest,
}

impl<T> Fetch<T> {
    /// The command's tag.
    pub fn tag(&self) -> &T {
        &self.tag
    }

    /// Bytes to fetch.
    pub fn len(&self) -> usize {
        self.req.op.host_data_len()
    }

    /// Whether there is nothing to fetch (never, for a [`Step::Fetch`]).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The command identifier.
    pub fn cid(&self) -> u16 {
        self.req.cid
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
    /// The data buffer it ran with, with a read's data.
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
    ns_changed: Option<watch::Receiver<()>>,
    target_shutdown: watch::Receiver<bool>,
    /// Set once the connection is to close: in-flight requests finish, then
    /// [`Engine::drained`] lets the transport go.
    pub closing: Option<Closed>,
    /// Until the Fabrics Connect succeeds: when the connection is closed.
    handshake_deadline: Option<Instant>,
    /// Once closing: when the connection goes even with bytes still to send.
    grace_deadline: Option<Instant>,
    /// How long the closing grace is ([`CLOSE_GRACE`]).
    grace: Duration,
    permit: Permit,
    /// Scratch list of the namespace memory a shared read sends from.
    pieces: Vec<SharedPiece>,
}

async fn next_event(rx: &mut Option<EventReceiver>) -> Option<Cqe> {
    match rx {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

async fn changed<T>(rx: &mut Option<watch::Receiver<T>>) {
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

/// Whether the request's data comes in the command capsule.
fn from_capsule(op: &IoOp) -> bool {
    matches!(
        op,
        IoOp::Write {
            src: DataSource::InCapsule,
            ..
        } | IoOp::Dsm {
            src: DataSource::InCapsule,
            ..
        } | IoOp::Reservation {
            src: DataSource::InCapsule,
            ..
        }
    )
}

async fn run_io<T>(
    ctrl: Arc<Controller>,
    tag: T,
    req: IoRequest,
    buf: IoBuf,
    cell: Option<Arc<IoCell>>,
) -> Done<T> {
    let (status, buf) = crate::io::execute(&ctrl, &req, buf).await;
    if let Some(c) = cell {
        c.record_finished(&req.op, status, req.arrived);
    }
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
            ns_changed: None,
            target_shutdown,
            closing: None,
            handshake_deadline,
            grace_deadline: None,
            grace: CLOSE_GRACE,
            permit,
            pieces: Vec::new(),
        }
    }

    /// Marks the connection closing for `reason`, unless it already is.
    pub fn close(&mut self, reason: Closed) {
        if self.closing.is_none() {
            self.closing = Some(reason);
        }
    }

    /// Whether a closing connection may go now, and why it closes: no request runs on a
    /// backend and the transport is `idle` (nothing left to send), or the closing grace
    /// ([`CLOSE_GRACE`] from the first call) ran out. None while it is not closing. Call it
    /// on every turn of the transport's loop; [`Engine::next`] wakes at the grace's end.
    pub fn drained(&mut self, idle: bool) -> Option<Closed> {
        self.closing.as_ref()?;
        let now = Instant::now();
        let grace = *self.grace_deadline.get_or_insert(now + self.grace);
        if self.inflight.is_empty() && (idle || now >= grace) {
            return self.closing.take();
        }
        None
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
    /// The handshake timeout runs until the queue is authenticated when it must be.
    pub fn watch_controller(&mut self) {
        if self.ctrl_shutdown.is_none() {
            if let Some(ctrl) = &self.q.ctrl {
                self.ctrl_shutdown = Some(ctrl.subscribe_shutdown());
                if self.q.qid != 0 {
                    self.ns_changed = ctrl.subsystem().map(|s| s.subscribe_namespaces());
                }
                if self.events.is_none() {
                    self.events = self.q.events.take();
                }
            }
        }
        if self.handshake_deadline.is_some() && self.q.ctrl.is_some() && !self.q.auth_pending() {
            self.handshake_deadline = None;
        }
    }

    /// Takes the command `tag` names (with its in-capsule data from `w`) in: validates it,
    /// answers it or starts it, and says what the transport does next.
    pub fn command<W: Transport<Tag = T>>(&mut self, w: &mut W, tag: T) -> Step<T> {
        let submit = self.q.submit(w.sqe(&tag), w.capsule(&tag));
        let step = match submit {
            Submit::Complete(cqe) => {
                self.answer(w, tag, &[], &cqe);
                Step::Answered
            }
            Submit::CompleteWithData(data, cqe) => {
                self.answer(w, tag, &data, &cqe);
                Step::Answered
            }
            Submit::CompleteAndClose(cqe) => {
                self.answer(w, tag, &[], &cqe);
                self.close(Closed::Local("host disconnected the queue"));
                Step::Close
            }
            Submit::Held => Step::Held(tag),
            Submit::Abandon => {
                if self.closing.is_none() {
                    debug!(
                        peer = %self.q.origin.peer,
                        qid = self.q.qid,
                        "controller torn down: closing the queue, commands left unanswered for the host to send again"
                    );
                }
                self.close(Closed::Local("controller torn down"));
                Step::Close
            }
            Submit::Io(req) if req.op.host_data_len() > 0 => Step::Fetch(Fetch { tag, req }),
            Submit::Io(req) => self.start(w, tag, req),
        };
        self.watch_controller();
        step
    }

    /// Runs a request whose data the transport fetched from the host into `buf` (a
    /// [`Step::Fetch`]): [`Step::Answered`] or [`Step::Started`].
    pub fn fetched<W: Transport<Tag = T>>(
        &mut self,
        w: &mut W,
        f: Fetch<T>,
        buf: IoBuf,
    ) -> Step<T> {
        self.run(w, f.tag, f.req, buf)
    }

    /// Answers a command whose data could not be fetched with the status of `fault`.
    pub fn fetch_failed<W: Transport<Tag = T>>(&mut self, w: &mut W, f: Fetch<T>, fault: Fault) {
        self.fail(w, f.tag, fault);
    }

    /// Answers the command `tag` with the status of `fault`, recorded in the error log (no
    /// LBA).
    pub fn fail<W: Transport<Tag = T>>(&mut self, w: &mut W, tag: T, fault: Fault) {
        let cqe = self.fault_cqe(w.sqe(&tag), fault);
        if let Err((tag, fault)) = w.respond(tag, &[], &cqe) {
            debug!(cid = cqe.cid(), ?fault, "cannot send a completion");
            drop(tag);
        }
    }

    /// Acts on what [`Engine::next`] woke for: answers finished requests (every one that has
    /// finished by now, so that their answers leave together) and events. Returns
    /// [`Closed::HandshakeTimeout`] when the handshake timeout passed.
    pub fn on_wake<W: Transport<Tag = T>>(&mut self, w: &mut W, wake: Wake<T>) -> Option<Closed> {
        match wake {
            Wake::Done(done) => {
                self.finished(w, done);
                while let Some(done) = self.inflight.next().now_or_never().flatten() {
                    self.finished(w, done);
                }
            }
            Wake::Event(cqe) => w.complete_held(&cqe),
            Wake::HandshakeExpired => return Some(Closed::HandshakeTimeout),
            Wake::Handled => {}
        }
        None
    }

    /// Sends `data` and `cqe`; a descriptor that cannot carry the data gets its fault's status.
    fn answer<W: Transport<Tag = T>>(&mut self, w: &mut W, tag: T, data: &[u8], cqe: &Cqe) {
        if let Err((tag, fault)) = w.respond(tag, data, cqe) {
            self.fail(w, tag, fault);
        }
    }

    /// Starts a request that needs no data from the host.
    fn start<W: Transport<Tag = T>>(&mut self, w: &mut W, tag: T, req: IoRequest) -> Step<T> {
        let capsule = from_capsule(&req.op);
        let (tag, len) = match req.op {
            IoOp::Read { len, .. } => match self.read_inline(w, tag, &req) {
                Ok(()) => return Step::Answered,
                Err(tag) => (tag, len),
            },
            IoOp::ReservationReport { len, .. } => (tag, len),
            _ if capsule => {
                let len = w.capsule(&tag).len();
                (tag, len)
            }
            _ => (tag, 0),
        };
        let buf = if len > 0 || capsule {
            match w.buffer(&tag, len, capsule) {
                Ok(b) => b,
                Err(fault) => {
                    self.fail(w, tag, fault);
                    return Step::Answered;
                }
            }
        } else {
            IoBuf::new(0)
        };
        self.run(w, tag, req, buf)
    }

    /// Serves a read from a backend that never waits (memory, null) straight where the
    /// transport sends from: from the namespace's own memory when large enough, else written
    /// in place. Gives the tag back, doing nothing, for other backends and when the
    /// transport can do neither.
    fn read_inline<W: Transport<Tag = T>>(
        &mut self,
        w: &mut W,
        tag: T,
        req: &IoRequest,
    ) -> Result<(), T> {
        let (IoOp::Read { lba, len }, Some(ns), Some(ctrl)) = (req.op, &req.ns, &self.q.ctrl)
        else {
            return Err(tag);
        };
        if !crate::io::never_waits(&ns.backend) {
            return Err(tag);
        }
        let in_data = self.q.sq_flow_disabled;
        let (status, answered) = if len >= w.shared_read_min() {
            self.pieces.clear();
            let read =
                crate::io::read_shared(&ns.backend, lba, len, &mut self.pieces).unwrap_or(Ok(()));
            ctrl.counters.read(len as u64);
            let answered = read.is_ok() && w.send_read_shared(&tag, len, in_data, &self.pieces);
            self.pieces.clear();
            (crate::io::status_of(ctrl, read), answered)
        } else {
            let bs = ns.backend.block_size() as usize;
            let sent = w.send_read_with(&tag, len, bs, in_data, |off, out| {
                crate::io::read_now(&ns.backend, lba + (off / bs) as u64, out).unwrap_or(Ok(()))
            });
            let Some(sent) = sent else {
                return Err(tag);
            };
            ctrl.counters.read(len as u64);
            let answered = matches!(sent, Ok(true));
            (crate::io::status_of(ctrl, sent.map(|_| ())), answered)
        };
        self.q.record_io(req, status);
        if !answered {
            let cqe = self.io_completion(w.sqe(&tag), req, status);
            self.answer(w, tag, &[], &cqe);
        }
        Ok(())
    }

    /// Runs `req` with `buf` (a write's data, the destination of a read): at once for
    /// backends that never wait, answered before this returns; otherwise concurrently, and
    /// [`Engine::next`] returns it when done.
    fn run<W: Transport<Tag = T>>(
        &mut self,
        w: &mut W,
        tag: T,
        req: IoRequest,
        buf: IoBuf,
    ) -> Step<T> {
        match self.execute(tag, req, buf) {
            Some(done) => {
                self.finished(w, done);
                Step::Answered
            }
            None => Step::Started,
        }
    }

    /// Runs `req`: the outcome at once for backends that never wait (and on a queue without
    /// a controller); None when it runs concurrently.
    fn execute(&mut self, tag: T, req: IoRequest, buf: IoBuf) -> Option<Done<T>> {
        let Some(ctrl) = &self.q.ctrl else {
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
            let (status, buf) = match crate::io::execute(ctrl, &req, buf).now_or_never() {
                Some(r) => r,
                None => (Status::generic(generic::INTERNAL_ERROR), IoBuf::new(0)),
            };
            self.q.record_io(&req, status);
            return Some(Done {
                tag,
                req,
                status,
                buf,
            });
        }
        let ctrl = Arc::clone(ctrl);
        let cell = self.q.metrics.as_mut().and_then(|m| {
            let cell = m.io_handle(req.ns.as_ref().map_or(0, |ns| ns.nsid))?;
            cell.record_started();
            Some(cell)
        });
        self.inflight
            .push(Box::pin(run_io(ctrl, tag, req, buf, cell)));
        None
    }

    /// Answers a finished request: a successful read's data and completion, otherwise the
    /// completion (a failure goes to the error log with its LBA).
    fn finished<W: Transport<Tag = T>>(&mut self, w: &mut W, done: Done<T>) {
        let Done {
            tag,
            req,
            status,
            buf,
        } = done;
        let cqe = self.io_completion(w.sqe(&tag), &req, status);
        if status.is_success()
            && matches!(req.op, IoOp::Read { .. } | IoOp::ReservationReport { .. })
        {
            if let Err((tag, fault)) = w.send_read(tag, buf, &cqe, self.q.sq_flow_disabled) {
                self.fail(w, tag, fault);
            }
        } else {
            w.recycle(&tag, buf);
            self.answer(w, tag, &[], &cqe);
        }
    }

    /// The CQE of a finished request; a failure goes to the error log with its LBA.
    fn io_completion(&self, sqe: &Sqe, req: &IoRequest, status: Status) -> Cqe {
        if !status.is_success() {
            self.q.record_error(sqe, status, error_lba(&req.op));
        }
        self.q.completion(req.cid, status, 0)
    }

    /// The CQE failing `sqe` for `fault`, recorded in the error log (no LBA).
    fn fault_cqe(&self, sqe: &Sqe, fault: Fault) -> Cqe {
        let status = fault.status();
        self.q.record_error(sqe, status, 0);
        if let Some(m) = &self.q.metrics {
            m.record_fault(sqe, status);
        }
        self.q.completion(sqe.cid(), status, 0)
    }

    /// Waits for a finished request, an asynchronous event, the controller's teardown, the
    /// target's shutdown, the handshake timeout, the keep-alive timeout or the end of the
    /// closing grace, in that order of preference. Teardown, shutdown and keep-alive expiry
    /// set [`Engine::closing`].
    pub async fn next(&mut self) -> Wake<T> {
        let deadline = self.handshake_deadline.or_else(|| {
            self.q
                .ctrl
                .as_ref()
                .filter(|_| self.q.qid == 0)
                .and_then(|c| c.keep_alive_deadline())
        });
        // The grace's end wakes the transport once, to let it go.
        let grace = self
            .grace_deadline
            .filter(|g| self.closing.is_some() && *g > Instant::now());
        let deadline = match (deadline, grace) {
            (Some(d), Some(g)) => Some(d.min(g)),
            (d, g) => d.or(g),
        };
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
            _ = changed(&mut self.ns_changed) => {
                self.q.forget_namespaces();
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
                log_limited!(
                    LogKind::ConnectionError,
                    warn!(
                        cntlid = ctrl.cntlid,
                        hostnqn = %ctrl.hostnqn,
                        peer = %self.q.origin.peer,
                        "keep alive timeout expired: tearing the controller down"
                    )
                );
                ctrl.tear_down();
                if let Some(s) = ctrl.subsystem() {
                    s.metrics.note_keep_alive_expiry();
                }
                self.closing = Some(Closed::Local("keep alive timeout"));
            }
        }
        Wake::Handled
    }

    /// Logs why the connection ended; an admin queue's end tears its controller down.
    pub fn finish(&self, reason: &Closed, peer: SocketAddr, transport: &'static str) {
        match reason {
            Closed::Protocol(_) => self.q.target.metrics.note_protocol_error(transport),
            Closed::HostTermReq(_) => self.q.target.metrics.note_host_term_req(transport),
            _ => {}
        }
        let Some(ctrl) = &self.q.ctrl else {
            match reason {
                Closed::Protocol(r) => {
                    log_limited!(
                        LogKind::ConnectionError,
                        warn!(%peer, transport, reason = %r, "connection closed: protocol error")
                    )
                }
                Closed::HostClosed | Closed::Local(_) => {
                    debug!(%peer, transport, "connection closed before Connect")
                }
                Closed::HandshakeTimeout => {
                    debug!(%peer, transport, "connection closed: no Connect within the handshake timeout")
                }
                other => {
                    log_limited!(
                        LogKind::ConnectionError,
                        info!(%peer, transport, reason = %other, "connection closed before Connect")
                    )
                }
            }
            return;
        };
        let error = reason.is_error();
        if self.q.qid == 0 {
            ctrl.tear_down();
            if error {
                log_limited!(
                    LogKind::ConnectionError,
                    warn!(cntlid = ctrl.cntlid, hostnqn = %ctrl.hostnqn, %peer, subnqn = ctrl.subnqn(), reason = %reason, transport, "controller disconnected")
                );
            } else {
                log_limited!(
                    LogKind::Connect,
                    info!(cntlid = ctrl.cntlid, hostnqn = %ctrl.hostnqn, %peer, subnqn = ctrl.subnqn(), reason = %reason, transport, "controller disconnected")
                );
            }
        } else if error {
            log_limited!(
                LogKind::ConnectionError,
                warn!(cntlid = ctrl.cntlid, hostnqn = %ctrl.hostnqn, %peer, qid = self.q.qid, reason = %reason, transport, "I/O queue closed")
            );
        } else {
            debug!(cntlid = ctrl.cntlid, hostnqn = %ctrl.hostnqn, %peer, qid = self.q.qid, reason = %reason, transport, "I/O queue closed");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use nvme_spec::FromBytes;
    use nvme_spec::command::build;
    use nvme_spec::log::ErrorLogEntry;
    use nvme_spec::queue::SglDescriptor;
    use nvme_spec::status::{media, sct};

    use super::*;
    use crate::queue::{HostSgl, IoRequest, Submit};
    use crate::target::Target;
    use crate::testing::{ReadPath, Wire, connected, origin, target};

    /// A connection on the fake transport.
    struct Fake {
        e: Engine<Sqe>,
        w: Wire,
        /// The steps of the commands handed over, by kind.
        steps: Vec<&'static str>,
    }

    fn permit(t: &Target) -> Permit {
        t.listener_gate("tcp://127.0.0.1:4420".parse().unwrap())
            .admit()
            .unwrap()
    }

    impl Fake {
        fn new(q: QueueState) -> Fake {
            let p = permit(&q.target);
            let mut e = Engine::new(q, p);
            e.watch_controller();
            Fake {
                e,
                w: Wire::default(),
                steps: Vec::new(),
            }
        }

        /// What a transport does with a command that arrived with `data` in its capsule.
        fn command(&mut self, sqe: Sqe, data: &[u8]) {
            self.hand_over(sqe, data, &[]);
        }

        /// What a transport does with a command whose `data` is in host memory: fetched
        /// when the engine asks for it.
        fn command_from_host(&mut self, sqe: Sqe, data: &[u8]) {
            self.hand_over(sqe, &[], data);
        }

        fn hand_over(&mut self, sqe: Sqe, capsule: &[u8], host: &[u8]) {
            self.w.capsule = capsule.to_vec();
            let data = host;
            let step = self.e.command(&mut self.w, sqe);
            self.w.capsule.clear();
            let kind = match step {
                Step::Answered => "answered",
                Step::Started => "started",
                Step::Held(_) => "held",
                Step::Close => "close",
                Step::Fetch(f) => {
                    assert_eq!(f.len(), data.len(), "fetches what the host sends");
                    let mut buf = IoBuf::new(f.len());
                    buf.copy_from_slice(data);
                    self.w.buffers_out += 1;
                    match self.e.fetched(&mut self.w, f, buf) {
                        Step::Answered => "fetched, answered",
                        Step::Started => "fetched, started",
                        _ => "fetched, other",
                    }
                }
            };
            self.steps.push(kind);
        }

        /// The one completion sent since the last call.
        fn answer(&mut self) -> Cqe {
            assert_eq!(self.w.sent.len(), 1, "one completion: {:?}", self.w.sent);
            self.w.sent.pop().unwrap()
        }

        /// The step of the last command.
        fn step(&self) -> &'static str {
            self.steps.last().copied().unwrap_or("none")
        }

        /// Waits (at most 10 s) for the engine and acts on what it woke for, until `until`.
        fn drive(&mut self, rt: &tokio::runtime::Runtime, until: impl Fn(&Fake) -> bool) {
            rt.block_on(async {
                tokio::time::timeout(Duration::from_secs(10), async {
                    while !until(self) {
                        let wake = self.e.next().await;
                        if let Some(r) = self.e.on_wake(&mut self.w, wake) {
                            self.e.close(r);
                        }
                    }
                })
                .await
                .expect("engine woke for the expected event");
            });
        }
    }

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    fn queues(namespaces: &[&str]) -> (Fake, Fake) {
        let t = target(namespaces);
        let (admin, io) = connected(&t, HostSgl::Transport);
        (Fake::new(admin), Fake::new(io))
    }

    /// The error log's newest entry, read as a host reads it.
    fn last_error(admin: &mut Fake) -> ErrorLogEntry {
        let mut glp = build::get_log_page(40, nvme_spec::command::log_id::ERROR_INFO, 0, 64, 0);
        glp.dptr = SglDescriptor::tcp_transport(64);
        match admin.e.q.submit(&glp, &[]) {
            Submit::CompleteWithData(data, cqe) => {
                assert!(cqe.status().is_success());
                ErrorLogEntry::read_from_bytes(&data[..64]).unwrap()
            }
            _ => panic!("Get Log Page returned no data"),
        }
    }

    /// A write of 512-byte blocks with its data in the capsule.
    fn write(cid: u16, slba: u64, nlb: u32) -> Sqe {
        let mut sqe = build::read_write(true, cid, 1, slba, nlb);
        sqe.dptr = SglDescriptor::in_capsule(nlb * 512);
        sqe
    }

    /// A read of 512-byte blocks of namespace `nsid`, data by C2HData.
    fn read(cid: u16, nsid: u32, slba: u64, nlb: u32) -> Sqe {
        let mut sqe = build::read_write(false, cid, nsid, slba, nlb);
        sqe.dptr = SglDescriptor::tcp_transport(nlb * 512);
        sqe
    }

    #[test]
    fn memory_requests_complete_inline_exactly_once() {
        let (_admin, mut io) = queues(&["mem:1M,bs=512"]);
        io.command(write(1, 7, 2), &[0x5a; 1024]);
        assert_eq!(io.answer().status(), Status::SUCCESS);
        assert_eq!(io.e.in_flight(), 0, "memory runs inline");
        io.command(read(2, 1, 7, 2), &[]);
        let cqe = io.answer();
        assert_eq!((cqe.cid(), cqe.status()), (2, Status::SUCCESS));
        assert_eq!(
            io.w.data,
            vec![(2, vec![0x5a; 1024], Some(ReadPath::InPlace))]
        );
    }

    #[test]
    fn invalid_commands_get_their_status_and_an_error_log_entry() {
        let (mut admin, mut io) = queues(&["mem:1M,bs=512"]);
        let mut bad = read(3, 1, 0, 1);
        bad.opcode = 0x55;
        io.command(bad, &[]);
        let st = io.answer().status();
        assert_eq!(st, Status::generic(generic::INVALID_OPCODE).with_dnr());
        assert_eq!(last_error(&mut admin).cid.get(), 3);

        // 1 MiB of 512-byte blocks: block 2048 is past the end.
        io.command(read(4, 1, 2047, 2), &[]);
        let st = io.answer().status();
        assert_eq!(st, Status::generic(generic::LBA_OUT_OF_RANGE).with_dnr());
        assert_eq!(last_error(&mut admin).cid.get(), 4);

        io.command(read(5, 9, 0, 1), &[]);
        let st = io.answer().status();
        assert_eq!(st.sct, sct::GENERIC);
        assert!(st.dnr, "unknown namespace: {st}");
    }

    #[test]
    fn a_controller_not_ready_fails_io_and_a_queue_without_one_runs_nothing() {
        let (mut admin, mut io) = queues(&["mem:1M"]);
        let cc = nvme_spec::FabricsCommand::PropertySet {
            size8: false,
            offset: nvme_spec::fabrics::property::CC,
            value: 0,
        }
        .encode(9);
        admin.command(cc, &[]);
        assert!(admin.answer().status().is_success());
        io.command(read(6, 1, 0, 1), &[]);
        let st = io.answer().status();
        assert_eq!(
            st,
            Status::generic(generic::COMMAND_SEQUENCE_ERROR).with_dnr()
        );

        // The engine never runs a request on a queue without a controller.
        let t = target(&["mem:1M"]);
        let ns = t.subsystems().values().next().unwrap().namespaces()[&1].clone();
        let mut e: Engine<()> = Engine::new(QueueState::new(Arc::clone(&t), origin()), permit(&t));
        let req = IoRequest {
            cid: 1,
            ns: Some(crate::queue::QueueNs::new(&ns)),
            op: IoOp::Flush,
            arrived: Instant::now(),
        };
        let done = e.execute((), req, IoBuf::new(0)).expect("answered at once");
        assert_eq!(
            done.status,
            Status::generic(generic::COMMAND_SEQUENCE_ERROR).with_dnr()
        );
    }

    #[test]
    fn backend_media_errors_are_logged_with_their_lba() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ns");
        let spec = format!("file:{},size=1M,bs=512,direct=off", path.display());
        let (mut admin, mut io) = queues(&[spec.as_str()]);
        let rt = rt();
        // The file shrinks under the namespace: reads past its new end fail on the medium.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(4096)
            .unwrap();
        io.command(read(7, 1, 100, 1), &[]);
        assert_eq!(io.e.in_flight(), 1, "file requests run concurrently");
        io.drive(&rt, |f| !f.w.sent.is_empty());
        let cqe = io.answer();
        assert_eq!(cqe.cid(), 7);
        assert_eq!(cqe.status(), Status::media(media::UNRECOVERED_READ_ERROR));
        assert!(io.w.data.is_empty(), "no data for a failed read");
        let e = last_error(&mut admin);
        assert_eq!((e.cid.get(), e.lba.get(), e.sqid.get()), (7, 100, 1));
        let ctrl = admin.e.q.ctrl.clone().unwrap();
        assert_eq!(ctrl.counters.totals().media_errors, 1);
    }

    #[test]
    fn transport_faults_become_statuses_in_the_error_log() {
        let (mut admin, io) = queues(&["mem:1M"]);
        let table = [
            (
                Fault::DataDigest,
                Status::generic(generic::TRANSIENT_TRANSPORT_ERROR),
            ),
            (
                Fault::CommandIdConflict,
                Status::generic(generic::COMMAND_ID_CONFLICT).with_dnr(),
            ),
            (
                Fault::SglType,
                Status::generic(generic::SGL_TYPE_INVALID).with_dnr(),
            ),
            (
                Fault::SglLength,
                Status::generic(generic::DATA_SGL_LENGTH_INVALID).with_dnr(),
            ),
            (Fault::Resources, Status::generic(generic::INTERNAL_ERROR)),
        ];
        for (i, (fault, status)) in table.into_iter().enumerate() {
            let sqe = read(20 + i as u16, 1, 0, 1);
            let cqe = io.e.fault_cqe(&sqe, fault);
            assert_eq!((cqe.cid(), cqe.status()), (20 + i as u16, status));
            let e = last_error(&mut admin);
            assert_eq!(
                (e.cid.get(), e.status.get() >> 1),
                (20 + i as u16, status.to_field())
            );
        }
    }

    #[test]
    fn asynchronous_event_requests_are_held_until_an_event() {
        let (mut admin, _io) = queues(&["mem:1M"]);
        let rt = rt();
        admin.command(build::async_event_request(11), &[]);
        assert!(admin.w.sent.is_empty(), "an AER is held");
        assert_eq!(admin.step(), "held");
        let ctrl = admin.e.q.ctrl.clone().unwrap();
        assert!(ctrl.raise_event(0, 0x0002_0002));
        admin.drive(&rt, |f| !f.w.sent.is_empty());
        let cqe = admin.answer();
        assert_eq!(
            (cqe.cid(), cqe.status(), cqe.dw0.get()),
            (11, Status::SUCCESS, 0x0002_0002)
        );
        assert!(!ctrl.raise_event(0, 1), "no AER left to complete");
    }

    #[test]
    fn keep_alive_expiry_tears_the_controller_down() {
        let (mut admin, _io) = queues(&["mem:1M"]);
        let rt = rt();
        // Keep Alive Timer: 100 ms.
        admin.command(build::set_features(12, 0x0f, 100), &[]);
        assert!(admin.answer().status().is_success());
        let ctrl = admin.e.q.ctrl.clone().unwrap();
        admin.drive(&rt, |f| f.e.closing.is_some());
        assert!(matches!(
            admin.e.closing,
            Some(Closed::Local("keep alive timeout"))
        ));
        assert!(ctrl.is_torn_down());
        let figures = admin.e.q.target.metrics_snapshot();
        assert_eq!(
            figures.subsystems[crate::testing::NQN].keep_alive_expiries,
            1
        );
    }

    #[test]
    fn commands_on_a_torn_down_controller_are_left_for_the_next_association() {
        let (admin, mut io) = queues(&["mem:1M,bs=512"]);
        io.command(read(1, 1, 0, 1), &[]);
        assert!(io.answer().status().is_success());
        // The admin queue's connection ends (the target shutting down, a keep-alive expiry):
        // a command that reaches an I/O queue before it notices is not answered with an error
        // the host may not retry; the queue closes and the host sends it again after it
        // reconnects.
        let ctrl = admin.e.q.ctrl.clone().unwrap();
        assert!(ctrl.tear_down());
        io.command(read(2, 1, 0, 1), &[]);
        assert_eq!(io.step(), "close");
        assert!(io.w.sent.is_empty(), "answered: {:?}", io.w.sent);
        assert!(matches!(
            io.e.closing,
            Some(Closed::Local("controller torn down"))
        ));
        // Nothing runs: the connection may go at once.
        assert!(matches!(
            io.e.drained(true),
            Some(Closed::Local("controller torn down"))
        ));
    }

    #[test]
    fn io_traffic_keeps_the_controller_alive() {
        let (mut admin, mut io) = queues(&["mem:1M"]);
        let rt = rt();
        // Keep Alive Timer: 300 ms; I/O arrives every 50 ms for 1 s, no Keep Alive command.
        admin.command(build::set_features(12, 0x0f, 300), &[]);
        assert!(admin.answer().status().is_success());
        let ctrl = admin.e.q.ctrl.clone().unwrap();
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(1) {
            io.e.q.tick();
            io.command(read(1, 1, 0, 1), &[]);
            io.answer();
            std::thread::sleep(Duration::from_millis(50));
            assert!(
                ctrl.keep_alive_deadline().unwrap() > Instant::now(),
                "traffic restarts the timer"
            );
        }
        assert!(!ctrl.is_torn_down());
        // Without traffic the timer runs out.
        admin.drive(&rt, |f| f.e.closing.is_some());
        assert!(ctrl.is_torn_down());
    }

    #[test]
    fn a_queue_without_connect_expires_at_the_handshake_timeout() {
        let mut cfg = crate::testing::config(&["mem:1M"]);
        cfg.target.handshake_timeout = Duration::from_millis(50);
        let t = Target::build(&cfg).unwrap();
        let mut f = Fake::new(QueueState::new(Arc::clone(&t), origin()));
        f.drive(&rt(), |f| f.e.closing.is_some());
        assert!(matches!(f.e.closing, Some(Closed::HandshakeTimeout)));
    }

    #[test]
    fn shutdown_closes_but_lets_running_writes_complete() {
        let dir = tempfile::tempdir().unwrap();
        let spec = format!("file:{},size=1M,bs=512", dir.path().join("ns").display());
        let (_admin, mut io) = queues(&[spec.as_str()]);
        let rt = rt();
        io.command(write(13, 0, 8), &[0xa5; 4096]);
        assert_eq!(io.e.in_flight(), 1);
        io.e.q.target.begin_shutdown();
        io.drive(&rt, |f| f.e.closing.is_some() && f.e.in_flight() == 0);
        assert!(matches!(
            io.e.closing,
            Some(Closed::Local("target shutting down"))
        ));
        let cqe = io.answer();
        assert_eq!((cqe.cid(), cqe.status()), (13, Status::SUCCESS));
        io.command(read(14, 1, 0, 8), &[]);
        io.drive(&rt, |f| !f.w.sent.is_empty());
        assert_eq!(
            io.w.data,
            vec![(14, vec![0xa5; 4096], Some(ReadPath::Buffer))],
            "the acknowledged write is there"
        );
    }

    #[test]
    fn a_command_running_on_a_removed_namespace_completes_normally() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ns");
        let spec = format!("file:{},size=1M,bs=512", path.display());
        let (_admin, mut io) = queues(&[spec.as_str()]);
        let rt = rt();
        io.command(write(15, 0, 8), &[0x5a; 4096]);
        assert_eq!(io.e.in_flight(), 1);
        // Removed while the write runs: the write holds the backend and completes.
        let sub = io.e.q.target.subsystems().values().next().unwrap().clone();
        sub.set_namespaces(Default::default());
        io.drive(&rt, |f| f.e.in_flight() == 0 && !f.w.sent.is_empty());
        let cqe = io.answer();
        assert_eq!((cqe.cid(), cqe.status()), (15, Status::SUCCESS));
        // The next command on it finds no namespace.
        io.command(read(16, 1, 0, 8), &[]);
        io.drive(&rt, |f| !f.w.sent.is_empty());
        assert_eq!(
            io.answer().status(),
            Status::generic(generic::INVALID_NAMESPACE).with_dnr()
        );
        // The write reached the file.
        let data = std::fs::read(&path).unwrap();
        assert_eq!(&data[..4096], &[0x5a; 4096][..]);
    }

    /// A write of 512-byte blocks whose data the transport fetches from the host.
    fn host_write(cid: u16, slba: u64, nlb: u32) -> Sqe {
        let mut sqe = build::read_write(true, cid, 1, slba, nlb);
        sqe.dptr = SglDescriptor::tcp_transport(nlb * 512);
        sqe
    }

    #[test]
    fn each_step_tells_the_transport_what_to_do() {
        let dir = tempfile::tempdir().unwrap();
        let spec = format!("file:{},size=1M,bs=512", dir.path().join("ns").display());
        let (mut admin, mut io) = queues(&[spec.as_str()]);
        let rt = rt();
        // Answered at once, with data for the host.
        let mut identify = build::identify(1, 1, 0);
        identify.dptr = SglDescriptor::tcp_transport(4096);
        admin.command(identify, &[]);
        assert_eq!(admin.step(), "answered");
        assert!(admin.answer().status().is_success());
        assert_eq!(admin.w.data.len(), 1, "Identify data before its completion");
        // Held until an event.
        admin.command(build::async_event_request(2), &[]);
        assert_eq!(admin.step(), "held");
        assert!(admin.w.sent.is_empty());
        // Data fetched from the host, then started on the file.
        io.command_from_host(host_write(3, 0, 8), &[0x11; 4096]);
        assert_eq!(io.step(), "fetched, started");
        assert_eq!(io.e.in_flight(), 1);
        io.drive(&rt, |f| !f.w.sent.is_empty());
        assert_eq!(io.answer().status(), Status::SUCCESS);
        // Started: a read of the file, answered from its buffer.
        io.command(read(4, 1, 0, 8), &[]);
        assert_eq!(io.step(), "started");
        io.drive(&rt, |f| !f.w.sent.is_empty());
        assert_eq!(io.answer().status(), Status::SUCCESS);
        assert_eq!(
            io.w.data,
            vec![(4, vec![0x11; 4096], Some(ReadPath::Buffer))]
        );
        assert_eq!(io.w.buffers_out, 0, "every buffer came back");
        // Close: Disconnect answers, then the connection closes.
        io.command(nvme_spec::FabricsCommand::Disconnect.encode(5), &[]);
        assert_eq!(io.step(), "close");
        assert_eq!(io.answer().status(), Status::SUCCESS);
        assert!(matches!(
            io.e.closing,
            Some(Closed::Local("host disconnected the queue"))
        ));
    }

    #[test]
    fn in_capsule_and_fetched_writes_run_from_their_data() {
        let (mut admin, mut io) = queues(&["mem:1M,bs=512"]);
        io.command(write(1, 0, 2), &[0x22; 1024]);
        assert_eq!(io.step(), "answered", "memory writes run inline");
        assert_eq!(io.answer().status(), Status::SUCCESS);
        io.command_from_host(host_write(2, 2, 2), &[0x33; 1024]);
        assert_eq!(io.step(), "fetched, answered");
        assert_eq!(io.answer().status(), Status::SUCCESS);
        assert_eq!(io.w.buffers_out, 0);
        io.command(read(3, 1, 0, 4), &[]);
        assert_eq!(io.answer().status(), Status::SUCCESS);
        let mut want = vec![0x22; 1024];
        want.extend([0x33; 1024]);
        assert_eq!(io.w.data, vec![(3, want, Some(ReadPath::InPlace))]);

        // A fetch that fails gets its fault's status, in the error log.
        io.w.capsule.clear();
        let sqe = host_write(4, 0, 1);
        let Step::Fetch(f) = io.e.command(&mut io.w, sqe) else {
            panic!("a write of host data is fetched");
        };
        assert_eq!((f.cid(), f.len()), (4, 512));
        io.e.fetch_failed(&mut io.w, f, Fault::DataDigest);
        let cqe = io.answer();
        assert_eq!(
            (cqe.cid(), cqe.status()),
            (4, Status::generic(generic::TRANSIENT_TRANSPORT_ERROR))
        );
        assert_eq!(last_error(&mut admin).cid.get(), 4);

        // A transport out of buffers fails the command with its fault.
        io.w.no_buffers = Some(Fault::Resources);
        io.command(write(5, 0, 1), &[0; 512]);
        assert_eq!(
            io.answer().status(),
            Status::generic(generic::INTERNAL_ERROR)
        );
    }

    #[test]
    fn memory_reads_go_straight_where_the_transport_sends_from() {
        let (_admin, mut io) = queues(&["mem:1M,bs=512"]);
        let pattern: Vec<u8> = (0..65536u32).map(|i| (i / 512) as u8).collect();
        io.command(write(1, 0, 128), &pattern);
        assert_eq!(io.answer().status(), Status::SUCCESS);
        // Small: written in place, in pieces of the transport's size.
        io.command(read(2, 1, 0, 32), &[]);
        assert_eq!(io.answer().status(), Status::SUCCESS);
        // Large: sent from the namespace's memory.
        io.command(read(3, 1, 0, 128), &[]);
        assert_eq!(io.answer().status(), Status::SUCCESS);
        // A transport that cannot write in place gets a buffer.
        io.w.piece = 0;
        io.command(read(4, 1, 8, 8), &[]);
        assert_eq!(io.answer().status(), Status::SUCCESS);
        // So does one whose pieces do not hold whole blocks.
        io.w.piece = 1000;
        io.command(read(5, 1, 8, 8), &[]);
        assert_eq!(io.answer().status(), Status::SUCCESS);
        let got: Vec<_> =
            io.w.data
                .drain(..)
                .map(|(c, d, p)| (c, d.len(), p))
                .collect();
        assert_eq!(
            got,
            vec![
                (2, 16384, Some(ReadPath::InPlace)),
                (3, 65536, Some(ReadPath::Shared)),
                (4, 4096, Some(ReadPath::Buffer)),
                (5, 4096, Some(ReadPath::Buffer)),
            ]
        );
        assert_eq!(io.w.buffers_out, 0);
        // With SQ flow control disabled the completion goes with the data.
        io.e.q.sq_flow_disabled = true;
        io.w.piece = 8192;
        io.command(read(6, 1, 0, 8), &[]);
        io.command(read(7, 1, 0, 128), &[]);
        assert!(io.w.sent.is_empty(), "no separate completions");
        assert_eq!(io.w.in_data, 2);
        assert_eq!(io.w.data[0].1, pattern[..4096]);
        assert_eq!(io.w.data[1].1, pattern);
        let figures = io.e.q.target.metrics_snapshot();
        let ns = &figures.subsystems[crate::testing::NQN].namespaces[&1];
        assert_eq!(ns.bytes_read, 16384 + 65536 * 2 + 4096 * 3);
    }

    #[test]
    fn closing_waits_for_running_requests_then_for_the_transport() {
        let dir = tempfile::tempdir().unwrap();
        let spec = format!("file:{},size=1M,bs=512", dir.path().join("ns").display());
        let (_admin, mut io) = queues(&[spec.as_str()]);
        let rt = rt();
        assert!(io.e.drained(true).is_none(), "not closing");
        io.command(write(1, 0, 8), &[0x44; 4096]);
        assert_eq!(io.step(), "started");
        io.e.close(Closed::HostClosed);
        assert!(io.e.drained(true).is_none(), "a request still runs");
        io.drive(&rt, |f| f.e.in_flight() == 0);
        assert_eq!(io.answer().status(), Status::SUCCESS);
        assert!(
            io.e.drained(false).is_none(),
            "the transport still has bytes to send"
        );
        assert!(matches!(io.e.drained(true), Some(Closed::HostClosed)));
    }

    #[test]
    fn the_closing_grace_lets_a_connection_go_with_bytes_unsent() {
        let (_admin, mut io) = queues(&["mem:1M"]);
        let rt = rt();
        io.e.grace = Duration::from_millis(50);
        io.e.close(Closed::Local("target shutting down"));
        assert!(io.e.drained(false).is_none());
        // The engine wakes at the grace's end.
        rt.block_on(async {
            while io.e.drained(false).is_none() {
                let wake = io.e.next().await;
                assert!(matches!(wake, Wake::Handled));
            }
        });
        assert!(io.e.closing.is_none(), "the reason was handed over");
    }
}
