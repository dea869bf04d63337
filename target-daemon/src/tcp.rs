//! The NVMe/TCP transport: one task per connection, on the reactor that accepted it.
//!
//! Each loop iteration reads everything the socket has into the engine's receive buffer,
//! handles every complete PDU, starts backend I/O, and writes every queued PDU with one
//! `write` call. Memory and null namespaces complete inline with no task or allocation per
//! command; file namespaces run concurrently up to the queue depth.
//!
//! A connection that has not finished the ICReq and the Fabrics Connect within the handshake
//! timeout is closed; until its ICReq is accepted it holds only a few hundred bytes of
//! buffers.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use blockdev::{AnyBackend, Backend, BackendError, BufPool, IoBuf};
use futures_util::FutureExt;
use futures_util::stream::{FuturesUnordered, StreamExt};
use nvme_spec::status::generic;
use nvme_spec::{Cqe, Sqe, Status};
use nvmf_tcp::{TargetConfig, TargetConn, TargetEvent};
use tokio::io::Interest;
use tokio::net::TcpStream;
use tokio::sync::watch;
use tracing::{debug, info, warn};

use crate::admission::{DropReason, Permit};
use crate::config::Transport;
use crate::controller::{Controller, EventReceiver, QueueOrigin};
use crate::queue::{DataSource, IoOp, IoRequest, QueueState, Submit};
use crate::target::Target;

/// Stop reading from a host whose responses are not being read once this much is queued.
const MAX_PENDING_SEND: usize = 8 << 20;
/// Bytes asked of the socket per read.
const READ_CHUNK: usize = 256 * 1024;

type IoFuture = Pin<Box<dyn Future<Output = Done>>>;
/// A read from a backend that never waits: `(lba, out)`.
type ReadNow<'a> = &'a dyn Fn(u64, &mut [u8]) -> Result<(), BackendError>;

/// A finished data-plane request.
struct Done {
    req: IoRequest,
    sqe: Sqe,
    status: Status,
    buf: IoBuf,
}

/// A write (or Dataset Management) waiting for its data from the host.
struct PendingWrite {
    req: IoRequest,
    sqe: Sqe,
    buf: IoBuf,
    digest_error: bool,
}

/// Why a connection ended.
#[derive(Debug)]
enum Closed {
    /// The host closed the socket.
    Eof,
    /// A socket error.
    Io(io::Error),
    /// A protocol violation (a TermReq was sent).
    Protocol(String),
    /// The host sent a TermReq.
    HostTermReq(u16),
    /// Disconnect command, controller teardown or target shutdown.
    Local(&'static str),
    /// ICReq and Connect were not done within the handshake timeout.
    HandshakeTimeout,
}

struct Conn {
    stream: TcpStream,
    engine: TargetConn,
    q: QueueState,
    pool: BufPool,
    inflight: FuturesUnordered<IoFuture>,
    writes: HashMap<u16, PendingWrite>,
    next_ttag: u16,
    events: Option<EventReceiver>,
    ctrl_shutdown: Option<watch::Receiver<bool>>,
    target_shutdown: watch::Receiver<bool>,
    closing: Option<Closed>,
    /// Until the Fabrics Connect succeeds: when the connection is closed.
    handshake_deadline: Option<Instant>,
    permit: Permit,
}

/// Serves one NVMe/TCP connection until it closes; `permit` is its place in the connection
/// limits.
pub async fn serve(target: Arc<Target>, stream: TcpStream, permit: Permit) {
    let (Ok(peer), Ok(local)) = (stream.peer_addr(), stream.local_addr()) else {
        return;
    };
    let _ = stream.set_nodelay(true);
    let s = &target.settings;
    let cfg = TargetConfig {
        maxh2cdata: s.max_c2h_data.max(4096),
        max_in_capsule_data: s.in_capsule_data.max(8192),
        allow_digests: true,
        max_c2h_data: s.max_c2h_data,
        recv_buffer_size: READ_CHUNK,
        max_outstanding_r2t: usize::from(s.max_queue_depth),
    };
    let engine = match TargetConn::new(cfg) {
        Ok(e) => e,
        Err(e) => {
            warn!(%peer, error = %e, "invalid transport settings");
            return;
        }
    };
    let handshake_deadline = Some(Instant::now() + s.handshake_timeout);
    let mdts = s.mdts_kib as usize * 1024;
    let mut conn = Conn {
        stream,
        engine,
        q: QueueState::new(Arc::clone(&target), QueueOrigin { local, peer })
            .on_listener(Transport::Tcp),
        pool: BufPool::new(mdts, 32),
        inflight: FuturesUnordered::new(),
        writes: HashMap::new(),
        next_ttag: 0,
        events: None,
        ctrl_shutdown: None,
        target_shutdown: target.subscribe_shutdown(),
        closing: None,
        handshake_deadline,
        permit,
    };
    let reason = conn.run().await;
    conn.finish(reason, peer);
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

fn is_sync(backend: &AnyBackend) -> bool {
    matches!(backend, AnyBackend::Memory(_) | AnyBackend::Null(_))
}

impl Conn {
    async fn run(&mut self) -> Closed {
        loop {
            if let Err(e) = self.flush() {
                return Closed::Io(e);
            }
            if let Some(reason) = self.closing.take() {
                if self.inflight.is_empty() && self.engine.pending_send().is_empty() {
                    return reason;
                }
                self.closing = Some(reason);
            }
            let depth = self.q.sqsize.max(2) as usize;
            let can_read = self.closing.is_none()
                && self.inflight.len() + self.writes.len() < depth
                && self.engine.pending_send().len() < MAX_PENDING_SEND;
            let want_write = !self.engine.pending_send().is_empty();
            let interest = match (can_read, want_write) {
                (true, true) => Some(Interest::READABLE | Interest::WRITABLE),
                (true, false) => Some(Interest::READABLE),
                (false, true) => Some(Interest::WRITABLE),
                (false, false) => None,
            };
            if self.q.ctrl.is_some() {
                self.handshake_deadline = None;
            }
            let deadline = self.handshake_deadline.or_else(|| {
                self.q
                    .ctrl
                    .as_ref()
                    .filter(|_| self.q.qid == 0)
                    .and_then(|c| c.keep_alive_deadline())
            });
            tokio::select! {
                biased;
                Some(done) = self.inflight.next(), if !self.inflight.is_empty() => {
                    self.complete(done);
                    // Every other I/O that has finished by now too, so that their responses
                    // leave in one write. (The next `select!` polls `inflight` again with this
                    // task's waker before the task can sleep.)
                    while let Some(Some(done)) = self.inflight.next().now_or_never() {
                        self.complete(done);
                    }
                }
                r = async { self.stream.ready(interest.unwrap_or(Interest::READABLE)).await }, if interest.is_some() => {
                    match r {
                        Ok(ready) if ready.is_readable() && can_read => {
                            if let Err(reason) = self.receive() {
                                if !matches!(reason, Closed::Protocol(_)) {
                                    return reason;
                                }
                                // Flush the queued TermReq, then close.
                                self.inflight.clear();
                                self.writes.clear();
                                self.closing = Some(reason);
                            }
                        }
                        Ok(_) => {}
                        Err(e) => return Closed::Io(e),
                    }
                }
                Some(cqe) = next_event(&mut self.events) => self.respond(&cqe),
                _ = changed(&mut self.ctrl_shutdown) => {
                    if self.closing.is_none() {
                        self.closing = Some(Closed::Local("controller torn down"));
                    }
                    self.ctrl_shutdown = None;
                }
                _ = self.target_shutdown.changed() => {
                    if self.closing.is_none() {
                        self.closing = Some(Closed::Local("target shutting down"));
                    }
                }
                _ = sleep_until(deadline), if deadline.is_some() => {
                    if self.handshake_deadline.is_some_and(|d| d <= Instant::now()) {
                        self.permit.gate().note_dropped(DropReason::HandshakeTimeout);
                        return Closed::HandshakeTimeout;
                    }
                    if let Some(ctrl) = &self.q.ctrl {
                        if ctrl.keep_alive_deadline().is_some_and(|d| d <= Instant::now()) {
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
                }
            }
        }
    }

    /// Writes as much of the send buffer as the socket takes.
    fn flush(&mut self) -> io::Result<()> {
        while !self.engine.pending_send().is_empty() {
            match self.stream.try_write(self.engine.pending_send()) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => self.engine.consume_sent(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Reads what the socket has and handles every complete PDU.
    fn receive(&mut self) -> Result<(), Closed> {
        for _ in 0..4 {
            let buf = self.engine.recv_buf(self.engine.recv_hint(READ_CHUNK));
            match self.stream.try_read(buf) {
                Ok(0) => return Err(Closed::Eof),
                Ok(n) => {
                    self.engine.commit_recv(n);
                    crate::reactor::note_activity();
                    self.handle_events()?;
                    if n < READ_CHUNK {
                        break;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(Closed::Io(e)),
            }
        }
        Ok(())
    }

    fn handle_events(&mut self) -> Result<(), Closed> {
        loop {
            let ev = match self.engine.next_event() {
                Ok(Some(ev)) => ev,
                Ok(None) => return Ok(()),
                Err(e) => return Err(Closed::Protocol(e.to_string())),
            };
            match ev {
                TargetEvent::Connected(p) => {
                    debug!(peer = %self.q.origin.peer, hdgst = p.digests.header, ddgst = p.digests.data, "NVMe/TCP connection initialized");
                }
                TargetEvent::Command { sqe, data } => {
                    let sqe = Sqe::from_array(&sqe);
                    // Copy in-capsule data out of the receive buffer only when needed.
                    let submit = self.q.submit(&sqe, data);
                    let icd = match &submit {
                        Submit::Io(req)
                            if matches!(
                                req.op,
                                IoOp::Write {
                                    src: DataSource::InCapsule,
                                    ..
                                } | IoOp::Dsm {
                                    src: DataSource::InCapsule,
                                    ..
                                }
                            ) =>
                        {
                            let mut b = self.pool.get(data.len());
                            b.copy_from_slice(data);
                            Some(b)
                        }
                        _ => None,
                    };
                    self.dispatch(sqe, submit, icd);
                }
                TargetEvent::CommandDataDigestError { sqe } => {
                    let sqe = Sqe::from_array(&sqe);
                    let status = Status::generic(generic::TRANSIENT_TRANSPORT_ERROR);
                    self.q.record_error(&sqe, status, 0);
                    let cqe = self.q.completion(sqe.cid(), status, 0);
                    self.respond(&cqe);
                }
                TargetEvent::H2CData {
                    ttag,
                    datao,
                    data,
                    last,
                    ..
                } => {
                    if let Some(w) = self.writes.get_mut(&ttag) {
                        let off = datao as usize;
                        if let Some(dst) = w.buf.get_mut(off..off + data.len()) {
                            dst.copy_from_slice(data);
                        }
                    }
                    if last {
                        self.write_data_complete(ttag);
                    }
                }
                TargetEvent::H2CDataDigestError { ttag, last, .. } => {
                    if let Some(w) = self.writes.get_mut(&ttag) {
                        w.digest_error = true;
                    }
                    if last {
                        self.write_data_complete(ttag);
                    }
                }
                TargetEvent::TermReq { fes, .. } => return Err(Closed::HostTermReq(fes)),
            }
        }
    }

    fn dispatch(&mut self, sqe: Sqe, submit: Submit, icd: Option<IoBuf>) {
        match submit {
            Submit::Complete(cqe) => self.respond(&cqe),
            Submit::CompleteWithData(data, cqe) => {
                if let Err(e) = self.engine.send_c2h_data(cqe.cid(), 0, &data, true, false) {
                    debug!(error = %e, "cannot queue C2HData");
                }
                self.respond(&cqe);
            }
            Submit::CompleteAndClose(cqe) => {
                self.respond(&cqe);
                self.closing = Some(Closed::Local("host disconnected the queue"));
            }
            Submit::Held => {}
            Submit::Io(req) => {
                self.connected_hook();
                let host_len = req.op.host_data_len();
                if host_len > 0 {
                    let ttag = self.alloc_ttag();
                    let cid = req.cid;
                    let buf = self.pool.get(host_len);
                    match self.engine.send_r2t(cid, ttag, 0, host_len as u32) {
                        Ok(()) => {
                            self.writes.insert(
                                ttag,
                                PendingWrite {
                                    req,
                                    sqe,
                                    buf,
                                    digest_error: false,
                                },
                            );
                        }
                        Err(e) => {
                            debug!(error = %e, cid, "cannot queue R2T");
                            let st = Status::generic(generic::COMMAND_ID_CONFLICT).with_dnr();
                            let cqe = self.q.completion(cid, st, 0);
                            self.pool.put(buf);
                            self.respond(&cqe);
                        }
                    }
                    return;
                }
                if icd.is_none() && self.read_in_place(&req, &sqe) {
                    return;
                }
                let buf = match (icd, req.op) {
                    (Some(b), _) => b,
                    (None, IoOp::Read { len, .. }) => self.pool.get(len),
                    (None, _) => IoBuf::new(0),
                };
                self.start(req, sqe, buf);
            }
        }
        self.connected_hook();
    }

    /// After a successful Connect: watch the controller and, on an admin queue, its events.
    fn connected_hook(&mut self) {
        if self.ctrl_shutdown.is_none() {
            if let Some(ctrl) = &self.q.ctrl {
                self.ctrl_shutdown = Some(ctrl.subscribe_shutdown());
                if self.events.is_none() {
                    self.events = self.q.events.take();
                }
            }
        }
    }

    fn alloc_ttag(&mut self) -> u16 {
        loop {
            let t = self.next_ttag;
            self.next_ttag = self.next_ttag.wrapping_add(1);
            if !self.writes.contains_key(&t) {
                return t;
            }
        }
    }

    fn write_data_complete(&mut self, ttag: u16) {
        let Some(w) = self.writes.remove(&ttag) else {
            return;
        };
        if w.digest_error {
            let status = Status::generic(generic::TRANSIENT_TRANSPORT_ERROR);
            self.q.record_error(&w.sqe, status, 0);
            let cqe = self.q.completion(w.req.cid, status, 0);
            self.pool.put(w.buf);
            self.respond(&cqe);
            return;
        }
        self.start(w.req, w.sqe, w.buf);
    }

    /// Runs a request: inline for memory and null namespaces, as a future otherwise.
    fn start(&mut self, req: IoRequest, sqe: Sqe, buf: IoBuf) {
        let Some(ctrl) = self.q.ctrl.clone() else {
            return;
        };
        let inline = req.ns.as_ref().is_some_and(|ns| is_sync(&ns.backend));
        if inline {
            let done = match crate::io::execute(&ctrl, &req, buf).now_or_never() {
                Some((status, buf)) => Done {
                    req,
                    sqe,
                    status,
                    buf,
                },
                None => Done {
                    req,
                    sqe,
                    status: Status::generic(generic::INTERNAL_ERROR),
                    buf: IoBuf::new(0),
                },
            };
            self.complete(done);
        } else {
            self.inflight.push(Box::pin(run_io(ctrl, req, sqe, buf)));
        }
    }

    /// Serves a read from a backend that never waits (memory, null) straight into the send
    /// buffer: one copy from the namespace to the socket's buffer, no staging buffer. Returns
    /// false, doing nothing, for other backends.
    fn read_in_place(&mut self, req: &IoRequest, sqe: &Sqe) -> bool {
        let (IoOp::Read { lba, len }, Some(ns), Some(ctrl)) = (req.op, &req.ns, &self.q.ctrl)
        else {
            return false;
        };
        let read: ReadNow<'_> = match &*ns.backend {
            AnyBackend::Memory(m) => &|lba, out| m.read_into(lba, out),
            AnyBackend::Null(n) => &|lba, out| n.read_into(lba, out),
            AnyBackend::File(_) | AnyBackend::Cached(_) | AnyBackend::Pcie(_) => return false,
        };
        let bs = ns.backend.block_size() as usize;
        if self.engine.config().max_c2h_data as usize % bs != 0 {
            return false;
        }
        let success = self.q.sq_flow_disabled;
        let sent = self
            .engine
            .send_c2h_data_with(req.cid, len as u32, success, |off, out| {
                read(lba + (off / bs) as u64, out)
            });
        let c = &ctrl.counters;
        c.reads.fetch_add(1, Ordering::Relaxed);
        c.bytes_read.fetch_add(len as u64, Ordering::Relaxed);
        let status = match sent {
            Ok(Ok(())) if success => return true,
            Ok(r) => crate::io::status_of(ctrl, r),
            Err(e) => {
                debug!(error = %e, cid = req.cid, "cannot queue C2HData");
                Status::SUCCESS
            }
        };
        if !status.is_success() {
            self.q.record_error(sqe, status, lba);
        }
        let cqe = self.q.completion(req.cid, status, 0);
        self.respond(&cqe);
        true
    }

    fn complete(&mut self, done: Done) {
        let Done {
            req,
            sqe,
            status,
            buf,
        } = done;
        if !status.is_success() {
            let lba = match req.op {
                IoOp::Read { lba, .. }
                | IoOp::Write { lba, .. }
                | IoOp::WriteZeroes { lba, .. } => lba,
                _ => 0,
            };
            self.q.record_error(&sqe, status, lba);
        }
        let cid = req.cid;
        if status.is_success() && matches!(req.op, IoOp::Read { .. }) {
            let success = self.q.sq_flow_disabled;
            if let Err(e) = self.engine.send_c2h_data(cid, 0, &buf, true, success) {
                debug!(error = %e, cid, "cannot queue C2HData");
            }
            self.pool.put(buf);
            if success {
                return;
            }
        } else {
            self.pool.put(buf);
        }
        let cqe = self.q.completion(cid, status, 0);
        self.respond(&cqe);
    }

    fn respond(&mut self, cqe: &Cqe) {
        if let Err(e) = self.engine.send_capsule_resp(&cqe.to_array()) {
            debug!(error = %e, cid = cqe.cid(), "cannot queue CapsuleResp");
        }
    }

    fn finish(&mut self, reason: Closed, peer: SocketAddr) {
        let _ = self.flush();
        let ctrl: Option<Arc<Controller>> = self.q.ctrl.clone();
        let Some(ctrl) = ctrl else {
            match &reason {
                Closed::Protocol(r) => {
                    warn!(%peer, reason = %r, "connection closed: protocol error")
                }
                Closed::Eof | Closed::Local(_) => debug!(%peer, "connection closed before Connect"),
                Closed::HandshakeTimeout => {
                    debug!(%peer, "connection closed: no ICReq and Connect within the handshake timeout")
                }
                other => info!(%peer, reason = ?other, "connection closed before Connect"),
            }
            return;
        };
        let admin = self.q.qid == 0;
        let why = match &reason {
            Closed::Eof => "host closed the connection".to_string(),
            Closed::Io(e) => format!("socket error: {e}"),
            Closed::Protocol(r) => format!("protocol error: {r}"),
            Closed::HostTermReq(fes) => format!("host sent TermReq (FES {fes:#x})"),
            Closed::Local(r) => (*r).to_string(),
            Closed::HandshakeTimeout => "handshake timeout".to_string(),
        };
        let error = matches!(
            reason,
            Closed::Io(_) | Closed::Protocol(_) | Closed::HostTermReq(_)
        );
        if admin {
            ctrl.tear_down();
            if error {
                warn!(cntlid = ctrl.cntlid, hostnqn = %ctrl.hostnqn, %peer, subnqn = ctrl.subnqn(), reason = %why, "controller disconnected");
            } else {
                info!(cntlid = ctrl.cntlid, hostnqn = %ctrl.hostnqn, %peer, subnqn = ctrl.subnqn(), reason = %why, "controller disconnected");
            }
        } else if error {
            warn!(cntlid = ctrl.cntlid, hostnqn = %ctrl.hostnqn, %peer, qid = self.q.qid, reason = %why, "I/O queue closed");
        } else {
            debug!(cntlid = ctrl.cntlid, hostnqn = %ctrl.hostnqn, %peer, qid = self.q.qid, reason = %why, "I/O queue closed");
        }
    }
}

async fn run_io(ctrl: Arc<Controller>, req: IoRequest, sqe: Sqe, buf: IoBuf) -> Done {
    let (status, buf) = crate::io::execute(&ctrl, &req, buf).await;
    Done {
        req,
        sqe,
        status,
        buf,
    }
}
