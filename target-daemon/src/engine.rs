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
use crate::log_limited;
use crate::metrics::IoCell;
use crate::queue::{IoOp, IoRequest, QueueState};
use crate::ratelimit::LogKind;

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
    ns_changed: Option<watch::Receiver<()>>,
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

    /// Runs `req` with `buf` (a write's data, the destination of a read). Returns the outcome
    /// at once for backends that never wait; otherwise the request runs concurrently and
    /// [`Engine::next`] returns it when done.
    pub fn run(&mut self, tag: T, req: IoRequest, buf: IoBuf) -> Option<Done<T>> {
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
        if let Some(m) = &self.q.metrics {
            m.record_fault(sqe, status);
        }
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
    use crate::queue::{HostSgl, Submit};
    use crate::target::Target;
    use crate::testing::{connected, origin, target};

    /// A transport that keeps what it would send.
    struct Fake {
        e: Engine<Sqe>,
        /// Completions in the order sent.
        sent: Vec<Cqe>,
        /// Data sent before a completion: (CID, bytes).
        data: Vec<(u16, Vec<u8>)>,
    }

    impl Transport for Fake {
        type Tag = Sqe;

        fn engine(&mut self) -> &mut Engine<Sqe> {
            &mut self.e
        }

        fn complete(&mut self, done: Done<Sqe>) {
            if done.status.is_success() && matches!(done.req.op, IoOp::Read { .. }) {
                self.data.push((done.req.cid, done.buf.to_vec()));
            }
            let cqe = self.e.io_completion(&done.tag, &done.req, done.status);
            self.sent.push(cqe);
        }

        fn complete_held(&mut self, cqe: Cqe) {
            self.sent.push(cqe);
        }
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
                sent: Vec::new(),
                data: Vec::new(),
            }
        }

        /// What a transport does with a command that arrived with `data`.
        fn command(&mut self, sqe: Sqe, data: &[u8]) {
            match self.e.q.submit(&sqe, data) {
                Submit::Complete(c) | Submit::CompleteWithData(_, c) => self.sent.push(c),
                Submit::CompleteAndClose(c) => {
                    self.sent.push(c);
                    self.e.close(Closed::Local("host disconnected the queue"));
                }
                Submit::Held => {}
                Submit::Io(req) => {
                    let buf = match req.op {
                        IoOp::Read { len, .. } => IoBuf::new(len),
                        _ => {
                            let mut b = IoBuf::new(data.len());
                            b.copy_from_slice(data);
                            b
                        }
                    };
                    self.start(sqe, req, buf);
                }
            }
            self.e.watch_controller();
        }

        /// The one completion sent since the last call.
        fn answer(&mut self) -> Cqe {
            assert_eq!(self.sent.len(), 1, "one completion: {:?}", self.sent);
            self.sent.pop().unwrap()
        }

        /// Waits (at most 10 s) for the engine and acts on what it woke for, until `until`.
        fn drive(&mut self, rt: &tokio::runtime::Runtime, until: impl Fn(&Fake) -> bool) {
            rt.block_on(async {
                tokio::time::timeout(Duration::from_secs(10), async {
                    while !until(self) {
                        let wake = self.e.next().await;
                        if let Some(r) = self.on_wake(wake) {
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
        assert_eq!(io.data, vec![(2, vec![0x5a; 1024])]);
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
        let done = e.run((), req, IoBuf::new(0)).expect("answered at once");
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
        io.drive(&rt, |f| !f.sent.is_empty());
        let cqe = io.answer();
        assert_eq!(cqe.cid(), 7);
        assert_eq!(cqe.status(), Status::media(media::UNRECOVERED_READ_ERROR));
        assert!(io.data.is_empty(), "no data for a failed read");
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
            let cqe = io.e.fail(&sqe, fault);
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
        assert!(admin.sent.is_empty(), "an AER is held");
        let ctrl = admin.e.q.ctrl.clone().unwrap();
        assert!(ctrl.raise_event(0, 0x0002_0002));
        admin.drive(&rt, |f| !f.sent.is_empty());
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
        let t = Target::build(&cfg).unwrap().0;
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
        io.drive(&rt, |f| !f.sent.is_empty());
        assert_eq!(
            io.data,
            vec![(14, vec![0xa5; 4096])],
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
        io.drive(&rt, |f| f.e.in_flight() == 0 && !f.sent.is_empty());
        let cqe = io.answer();
        assert_eq!((cqe.cid(), cqe.status()), (15, Status::SUCCESS));
        // The next command on it finds no namespace.
        io.command(read(16, 1, 0, 8), &[]);
        io.drive(&rt, |f| !f.sent.is_empty());
        assert_eq!(
            io.answer().status(),
            Status::generic(generic::INVALID_NAMESPACE).with_dnr()
        );
        // The write reached the file.
        let data = std::fs::read(&path).unwrap();
        assert_eq!(&data[..4096], &[0x5a; 4096][..]);
    }
}
