//! The NVMe/TCP transport: one task per connection, on the reactor that accepted it.
//!
//! Each loop iteration reads everything the socket has into the engine's receive buffer,
//! handles every complete PDU, starts backend I/O, and writes every queued PDU with one
//! vectored write. Memory and null namespaces complete inline with no task or allocation per
//! command, large reads from them leaving from the namespace's memory with no copy of ours;
//! file namespaces run concurrently up to the queue depth.
//!
//! A connection that has not finished the ICReq and the Fabrics Connect within the handshake
//! timeout is closed; until its ICReq is accepted it holds only a few hundred bytes of
//! buffers, and its receive buffer grows only as the host sends.
//!
//! What a host can make a connection hold is bounded: a command beyond the queue size (SQSIZE
//! of the Connect, counted until the command's completion has left through the socket) ends
//! the connection with a C2HTermReq (PDU Sequence Error); once [`MAX_PENDING_SEND`] bytes wait
//! to be sent, received PDUs are left unhandled until the host reads (the socket is read at
//! most `READ_CHUNK` bytes further, only to find a host that goes past its queue size); and
//! buffers shrink again when the connection goes idle.

use std::collections::HashMap;
use std::io;
use std::sync::Arc;

use blockdev::{Backend, BufPool, IoBuf};
use nvme_spec::{Cqe, Sqe, Status};
use nvmf_tcp::{TargetConfig, TargetConn, TargetEvent};
use nvmf_tls::Stream;
use tokio::io::Interest;
use tokio::net::TcpStream;
use tracing::{debug, warn};

use crate::admission::{DropReason, Permit};
use crate::config::Transport;
use crate::controller::QueueOrigin;
use crate::engine::{Closed, Done, Engine, Fault, Transport as _};
use crate::log_limited;
use crate::memory::Charge;
use crate::queue::{DataSource, IoOp, IoRequest, QueueState, Submit};
use crate::ratelimit::LogKind;
use crate::target::Target;

/// Stop handling received PDUs while this much waits to be sent: the send buffer of a
/// connection holds at most this, one command's data, and the data of the commands that were
/// running on a backend when it stopped (no more than the queue size).
pub const MAX_PENDING_SEND: usize = 8 << 20;
/// How long a connection closed for a protocol error waits for the host to read the TermReq
/// and close.
const LINGER: std::time::Duration = std::time::Duration::from_secs(2);
/// Capacity a connection's send and receive buffers keep when it goes idle.
const IDLE_KEEP: usize = 256 * 1024;
/// Commands accepted on a connection before its Connect gives the queue size: the Connect
/// itself and a few the host may send behind it.
const QUEUE_SIZE_BEFORE_CONNECT: usize = 32;
/// Most bytes asked of the socket per read (reads start smaller and grow while they fill).
const READ_CHUNK: usize = 256 * 1024;
/// While a batch of received commands is handled, the responses leave after every this many
/// commands, so that the host can start on the first completions before the batch's last is
/// handled. Answering a whole batch at once makes host and target take turns: on one queue
/// at QD32 each side then idles while the other works (see BENCHMARKS.md).
const FLUSH_EVERY: usize = 16;
/// Reads this large from memory and null namespaces are sent from the namespace's memory
/// without a copy into the send buffer; smaller ones are copied, which costs less than
/// holding and gathering the pieces.
const SHARED_READ_MIN: usize = 32 * 1024;
/// Most slices gathered into one vectored write.
const FLUSH_IOV: usize = 64;
/// How often a connection waiting for the memory budget looks again without being woken.
const BUDGET_RECHECK: std::time::Duration = std::time::Duration::from_millis(20);

/// A write (or Dataset Management) waiting for its data from the host.
struct PendingWrite {
    req: IoRequest,
    sqe: Sqe,
    buf: IoBuf,
    digest_error: bool,
}

struct Conn {
    stream: Stream,
    engine: TargetConn,
    /// The command engine; a running request's tag is its SQE.
    e: Engine<Sqe>,
    pool: BufPool,
    writes: HashMap<u16, PendingWrite>,
    next_ttag: u16,
    /// Commands handled since the last flush ([`FLUSH_EVERY`]).
    unflushed: usize,
    /// Received PDUs were left unhandled because the send backlog is full.
    paused: bool,
    /// Scratch list of the namespace memory a shared read sends from.
    pieces: Vec<blockdev::SharedPiece>,
    /// Data buffers of requests running on a backend, in bytes.
    in_flight_bytes: usize,
    /// What this connection holds of the daemon's memory budget.
    charge: Charge,
    /// Bytes of the free buffers in `pool`, as of the last turn of the connection's loop (the
    /// pool is counted once per turn, not per PDU).
    pool_cached: usize,
}

/// Serves one NVMe/TCP connection until it closes; `permit` is its place in the connection
/// limits. On a listener that requires TLS the TLS handshake comes first, within the
/// handshake timeout; a connection that fails it is closed.
pub async fn serve(target: Arc<Target>, stream: TcpStream, permit: Permit) {
    let (Ok(peer), Ok(local)) = (stream.peer_addr(), stream.local_addr()) else {
        return;
    };
    let _ = stream.set_nodelay(true);
    let s = &target.settings;
    let stream = if target.tls_required_at(local) {
        let accept = Stream::accept(&target.tls, stream);
        match tokio::time::timeout(s.handshake_timeout, accept).await {
            Ok(Ok(tls)) => tls,
            Ok(Err(e)) => {
                log_limited!(LogKind::Tls, warn!(%peer, %local, "connection closed: {e}"));
                return;
            }
            Err(_) => {
                permit.gate().note_dropped(DropReason::HandshakeTimeout);
                return;
            }
        }
    } else {
        Stream::Plain(stream)
    };
    let cfg = TargetConfig {
        maxh2cdata: s.max_c2h_data.max(4096),
        max_in_capsule_data: s.in_capsule_data.max(8192),
        allow_digests: true,
        max_c2h_data: s.max_c2h_data,
        recv_buffer_size: READ_CHUNK,
        queue_size: QUEUE_SIZE_BEFORE_CONNECT,
    };
    let engine = match TargetConn::new(cfg) {
        Ok(e) => e,
        Err(e) => {
            warn!(%peer, error = %e, "invalid transport settings");
            return;
        }
    };
    let mdts = s.mdts_kib as usize * 1024;
    let q = QueueState::new(Arc::clone(&target), QueueOrigin { local, peer })
        .on_listener(Transport::Tcp)
        .with_tls(stream.is_tls(), stream.psk_identity());
    let mut conn = Conn {
        stream,
        engine,
        e: Engine::new(q, permit),
        pool: BufPool::new(mdts, 32),
        writes: HashMap::new(),
        next_ttag: 0,
        unflushed: 0,
        paused: false,
        pieces: Vec::new(),
        in_flight_bytes: 0,
        charge: Charge::new(&target.memory),
        pool_cached: 0,
    };
    let reason = conn.run().await;
    let _ = conn.flush();
    if matches!(reason, Closed::Protocol(_)) {
        conn.linger().await;
    }
    conn.e.finish(&reason, peer, "tcp");
}

impl Conn {
    async fn run(&mut self) -> Closed {
        loop {
            if let Err(e) = self.flush() {
                return Closed::Io(e);
            }
            if let Some(reason) = self.e.closing.take() {
                if self.e.in_flight() == 0 && self.engine.pending_send().is_empty() {
                    return reason;
                }
                self.e.closing = Some(reason);
            }
            self.pool_cached = self.pool.cached_bytes();
            let over_budget = self.account();
            let backlog_full = self.engine.pending_send_len() >= MAX_PENDING_SEND || over_budget;
            if self.paused && !backlog_full && self.e.closing.is_none() {
                // The backlog drained: handle the PDUs left in the receive buffer.
                self.paused = false;
                if let Err(reason) = self.handle_events() {
                    if let Some(reason) = self.on_receive_error(reason) {
                        return reason;
                    }
                }
                continue;
            }
            // While the backlog is full, the socket is still read into the receive buffer (up
            // to READ_CHUNK bytes), unhandled, so that a host sending past its queue size is
            // found out.
            let held_back = self.paused || backlog_full;
            let can_read =
                self.e.closing.is_none() && (!held_back || self.engine.buffered() < READ_CHUNK);
            if !held_back
                && self.e.closing.is_none()
                && self.engine.pending_send().is_empty()
                && self.e.in_flight() == 0
                && self.writes.is_empty()
            {
                self.engine.release_buffers(IDLE_KEEP);
            }
            let want_write = !self.engine.pending_send().is_empty();
            let interest = match (can_read, want_write) {
                (true, true) => Some(Interest::READABLE | Interest::WRITABLE),
                (true, false) => Some(Interest::READABLE),
                (false, true) => Some(Interest::WRITABLE),
                (false, false) => None,
            };
            // Over the memory budget: look again once another connection gave some back (or
            // after a short while, in case that happened before this connection waited).
            let budget = over_budget.then(|| Arc::clone(self.charge.budget()));
            tokio::select! {
                biased;
                wake = self.e.next() => {
                    if let Some(reason) = self.on_wake(wake) {
                        return reason;
                    }
                }
                _ = async {
                    if let Some(b) = &budget {
                        let _ = tokio::time::timeout(BUDGET_RECHECK, b.freed()).await;
                    }
                }, if budget.is_some() => {}
                r = async { self.stream.ready(interest.unwrap_or(Interest::READABLE)).await }, if interest.is_some() => {
                    match r {
                        Ok(ready) if ready.is_readable() && can_read => {
                            if let Err(reason) = self.receive() {
                                if let Some(reason) = self.on_receive_error(reason) {
                                    return reason;
                                }
                            }
                        }
                        Ok(_) => {}
                        Err(e) => return Closed::Io(e),
                    }
                }
            }
        }
    }

    /// After a receive error: a protocol error flushes its queued TermReq, then closes (None);
    /// any other error closes at once (returned).
    fn on_receive_error(&mut self, reason: Closed) -> Option<Closed> {
        if !matches!(reason, Closed::Protocol(_)) {
            return Some(reason);
        }
        self.e.abandon_in_flight();
        self.writes.clear();
        self.e.closing = Some(reason);
        None
    }

    /// After a TermReq: ends the sending side behind it and discards what the host still
    /// sends until it closes, for at most [`LINGER`]. Closing a socket with bytes unread makes
    /// the kernel reset the connection and drop what it has not sent yet, the TermReq too.
    async fn linger(&mut self) {
        let _ = socket2::SockRef::from(self.stream.tcp()).shutdown(std::net::Shutdown::Write);
        let mut scratch = [0u8; 1024];
        let _ = tokio::time::timeout(LINGER, async {
            loop {
                if self.stream.ready(Interest::READABLE).await.is_err() {
                    return;
                }
                match self.stream.try_read(&mut scratch) {
                    Ok(0) => return,
                    Ok(_) => {}
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(_) => return,
                }
            }
        })
        .await;
    }

    /// Writes as much of the send buffer as the socket takes: its own bytes and the
    /// namespace memory that large reads send from ([`read_shared`](Self::read_shared)), with
    /// vectored writes.
    fn flush(&mut self) -> io::Result<()> {
        self.unflushed = 0;
        let first = self.engine.pending_send();
        if first.len() == self.engine.pending_send_len() {
            // Only bytes of our own (no shared namespace memory): one plain write.
            let n = self.stream.try_write_some(first)?;
            self.engine.consume_sent(n);
            return Ok(());
        }
        loop {
            let mut iov = [io::IoSlice::new(&[]); FLUSH_IOV];
            let mut used = 0;
            let mut bytes = 0;
            for (slot, s) in iov.iter_mut().zip(self.engine.pending_send_slices()) {
                *slot = io::IoSlice::new(s);
                used += 1;
                bytes += s.len();
            }
            if bytes == 0 {
                return Ok(());
            }
            let n = self.stream.try_write_vectored(&iov[..used])?;
            self.engine.consume_sent(n);
            if n < bytes {
                return Ok(());
            }
        }
    }

    /// Reads what the socket has and handles every complete PDU.
    fn receive(&mut self) -> Result<(), Closed> {
        for _ in 0..4 {
            let asked = self.engine.recv_hint(READ_CHUNK);
            let buf = self.engine.recv_buf(asked);
            match self.stream.try_read(buf) {
                Ok(0) => return Err(Closed::HostClosed),
                Ok(n) => {
                    self.engine.commit_recv(n);
                    self.e.q.tick();
                    crate::reactor::note_activity();
                    self.handle_events()?;
                    if self.paused || n < asked {
                        break;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(Closed::Io(e)),
            }
        }
        Ok(())
    }

    /// Accounts what this connection holds now against the daemon's memory budget: its send
    /// and receive buffers (and the namespace memory waiting to be sent from), the buffers of
    /// writes waiting for their data and of requests running on a backend, and its free
    /// data buffers (as of the last turn of the loop). While the daemon is over its budget, gives back the capacity kept for
    /// later. Returns whether this connection must wait for memory
    /// ([`Charge::must_wait`]).
    fn account(&mut self) -> bool {
        if self.charge.budget().exceeded() {
            self.pool.clear();
            self.pool_cached = 0;
            self.engine.release_buffers(0);
        }
        let writes: usize = if self.writes.is_empty() {
            0
        } else {
            self.writes.values().map(|w| w.buf.capacity()).sum()
        };
        let busy = writes + self.in_flight_bytes;
        let held = self.engine.memory_held() + busy + self.pool_cached;
        self.charge.set(held as u64);
        let active = self.engine.pending_send_len() + self.engine.buffered() + busy;
        self.charge.must_wait(active as u64)
    }

    /// Whether this connection must stop taking on work: its send backlog is full
    /// ([`MAX_PENDING_SEND`]) or the daemon is over its memory budget and this connection
    /// has more than [`FREE_SHARE`](crate::memory::FREE_SHARE) of work under way.
    fn must_hold_back(&mut self) -> bool {
        self.engine.pending_send_len() >= MAX_PENDING_SEND || self.account()
    }

    /// Handles the complete PDUs in the receive buffer, until the send backlog is full
    /// ([`MAX_PENDING_SEND`]) or the daemon is over its memory budget; then `paused` is set
    /// and the rest waits for the host to read or for memory.
    fn handle_events(&mut self) -> Result<(), Closed> {
        loop {
            if self.must_hold_back() {
                self.flush().map_err(Closed::Io)?;
                if self.must_hold_back() {
                    self.paused = true;
                    // Commands already received past the queue size end the connection now.
                    return self
                        .engine
                        .check_buffered_commands()
                        .map_err(|e| Closed::Protocol(e.to_string()));
                }
            }
            let ev = match self.engine.next_event() {
                Ok(Some(ev)) => ev,
                Ok(None) => return Ok(()),
                Err(e) => return Err(Closed::Protocol(e.to_string())),
            };
            match ev {
                TargetEvent::Connected(p) => {
                    debug!(peer = %self.e.q.origin.peer, hdgst = p.digests.header, ddgst = p.digests.data, "NVMe/TCP connection initialized");
                }
                TargetEvent::Command { sqe, data } => {
                    let sqe = Sqe::from_array(&sqe);
                    // Copy in-capsule data out of the receive buffer only when needed.
                    let submit = self.e.q.submit(&sqe, data);
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
                    if self.e.q.sqsize > 0 {
                        self.engine.set_queue_size(self.e.q.sqsize as usize);
                    }
                    self.unflushed += 1;
                    if self.unflushed >= FLUSH_EVERY && !self.engine.pending_send().is_empty() {
                        self.flush().map_err(Closed::Io)?;
                    }
                }
                TargetEvent::CommandDataDigestError { sqe } => {
                    let sqe = Sqe::from_array(&sqe);
                    let cqe = self.e.fail(&sqe, Fault::DataDigest);
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
                self.e.closing = Some(Closed::Local("host disconnected the queue"));
            }
            Submit::Held => {}
            Submit::Io(req) => {
                self.e.watch_controller();
                let host_len = req.op.host_data_len();
                if host_len > 0 {
                    let cid = req.cid;
                    if self.writes.values().any(|w| w.req.cid == cid) {
                        // Another write with this identifier still waits for its data.
                        let cqe = self.e.fail(&sqe, Fault::CommandIdConflict);
                        self.respond(&cqe);
                        return;
                    }
                    let ttag = self.alloc_ttag();
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
                            let cqe = self.e.fail(&sqe, Fault::CommandIdConflict);
                            self.pool.put(buf);
                            self.respond(&cqe);
                        }
                    }
                    return;
                }
                if icd.is_none() && (self.read_shared(&req, &sqe) || self.read_in_place(&req, &sqe))
                {
                    return;
                }
                let buf = match (icd, req.op) {
                    (Some(b), _) => b,
                    (None, IoOp::Read { len, .. }) => self.pool.get(len),
                    (None, _) => IoBuf::new(0),
                };
                self.in_flight_bytes += buf.len();
                self.start(sqe, req, buf);
            }
        }
        self.e.watch_controller();
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
            let cqe = self.e.fail(&w.sqe, Fault::DataDigest);
            self.pool.put(w.buf);
            self.respond(&cqe);
            return;
        }
        self.in_flight_bytes += w.buf.len();
        self.start(w.sqe, w.req, w.buf);
    }

    /// Serves a read from a backend that never waits (memory, null) straight into the send
    /// buffer: one copy from the namespace to the socket's buffer, no staging buffer. Returns
    /// false, doing nothing, for other backends.
    fn read_in_place(&mut self, req: &IoRequest, sqe: &Sqe) -> bool {
        let (IoOp::Read { lba, len }, Some(ns), Some(ctrl)) = (req.op, &req.ns, &self.e.q.ctrl)
        else {
            return false;
        };
        if !crate::io::never_waits(&ns.backend) {
            return false;
        }
        let bs = ns.backend.block_size() as usize;
        if self.engine.config().max_c2h_data as usize % bs != 0 {
            return false;
        }
        let success = self.e.q.sq_flow_disabled;
        let sent = self
            .engine
            .send_c2h_data_with(req.cid, len as u32, success, |off, out| {
                crate::io::read_now(&ns.backend, lba + (off / bs) as u64, out).unwrap_or(Ok(()))
            });
        ctrl.counters.read(len as u64);
        let answered = success && matches!(sent, Ok(Ok(())));
        let status = match sent {
            Ok(r) => crate::io::status_of(ctrl, r),
            Err(e) => {
                debug!(error = %e, cid = req.cid, "cannot queue C2HData");
                Status::SUCCESS
            }
        };
        self.e.q.record_io(req, status);
        if answered {
            return true;
        }
        let cqe = self.e.io_completion(sqe, req, status);
        self.respond(&cqe);
        true
    }

    /// Serves a read of at least [`SHARED_READ_MIN`] bytes from a memory or null namespace
    /// with no copy of ours: the C2HData PDUs go out from the namespace's own memory
    /// ([`blockdev::MemoryBackend::read_shared`]), held until the socket has taken them, so
    /// the kernel's copy into the socket is the only one. Returns false, doing nothing, for
    /// other reads and backends.
    fn read_shared(&mut self, req: &IoRequest, sqe: &Sqe) -> bool {
        let (IoOp::Read { lba, len }, Some(ns), Some(ctrl)) = (req.op, &req.ns, &self.e.q.ctrl)
        else {
            return false;
        };
        let Ok(len32) = u32::try_from(len) else {
            return false;
        };
        if len < SHARED_READ_MIN || !crate::io::never_waits(&ns.backend) {
            return false;
        }
        self.pieces.clear();
        let read =
            crate::io::read_shared(&ns.backend, lba, len, &mut self.pieces).unwrap_or(Ok(()));
        ctrl.counters.read(len as u64);
        let success = self.e.q.sq_flow_disabled;
        let mut answered = false;
        if read.is_ok() {
            match self
                .engine
                .send_c2h_data_shared(req.cid, len32, success, &self.pieces)
            {
                Ok(()) => answered = success,
                Err(e) => debug!(error = %e, cid = req.cid, "cannot queue C2HData"),
            }
        }
        self.pieces.clear();
        let status = crate::io::status_of(ctrl, read);
        self.e.q.record_io(req, status);
        if !answered {
            let cqe = self.e.io_completion(sqe, req, status);
            self.respond(&cqe);
        }
        true
    }

    fn respond(&mut self, cqe: &Cqe) {
        if let Err(e) = self.engine.send_capsule_resp(&cqe.to_array()) {
            debug!(error = %e, cid = cqe.cid(), "cannot queue CapsuleResp");
        }
    }
}

impl crate::engine::Transport for Conn {
    type Tag = Sqe;

    fn engine(&mut self) -> &mut Engine<Sqe> {
        &mut self.e
    }

    /// A read's data goes in C2HData PDUs (with the SUCCESS flag in place of the completion
    /// when the host disabled SQ flow control), then the CapsuleResp.
    fn complete(&mut self, done: Done<Sqe>) {
        let cid = done.req.cid;
        let read_data = done.status.is_success() && matches!(done.req.op, IoOp::Read { .. });
        let success = read_data && self.e.q.sq_flow_disabled;
        self.in_flight_bytes = self.in_flight_bytes.saturating_sub(done.buf.len());
        if read_data {
            if let Err(e) = self.engine.send_c2h_data(cid, 0, &done.buf, true, success) {
                debug!(error = %e, cid, "cannot queue C2HData");
            }
        }
        self.pool.put(done.buf);
        if !success {
            let cqe = self.e.io_completion(&done.tag, &done.req, done.status);
            self.respond(&cqe);
        }
    }

    fn complete_held(&mut self, cqe: Cqe) {
        self.respond(&cqe);
    }
}
