//! The NVMe/TCP transport: one task per connection, on the reactor that accepted it.
//!
//! Each loop iteration reads everything the socket has into the PDU engine's receive buffer,
//! hands every command to the command engine ([`crate::engine`]) and acts on its
//! [`Step`] (an R2T when the data is in host memory), and writes every queued PDU with one
//! vectored write. The transport's side of the engine is `Wire`: a command's in-capsule
//! data (still in the receive buffer), its answer and data into the send buffer (a read from
//! memory or null written there in place, or, when large, sent from the namespace's memory
//! with no copy of ours), and pooled data buffers.
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
use std::time::Instant;

use blockdev::{BufPool, IoBuf, SharedPiece};
use nvme_spec::{Cqe, Sqe};
use nvmf_tcp::{Responder, TargetConfig, TargetConn, TargetEvent};
use nvmf_tls::Stream;
use tokio::io::Interest;
use tokio::net::TcpStream;
use tracing::{debug, warn};

use crate::admission::{DropReason, Permit};
use crate::config;
use crate::controller::QueueOrigin;
use crate::engine::{Closed, Engine, Fault, Fetch, Refused, Step, Transport};
use crate::log_limited;
use crate::memory::Charge;
use crate::queue::QueueState;
use crate::ratelimit::LogKind;
use crate::reactor::{self, ConnKey};
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
    fetch: Fetch<Sqe>,
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
    /// Data buffers of requests running on a backend, in bytes.
    in_flight_bytes: usize,
    /// What this connection holds of the daemon's memory budget.
    charge: Charge,
    /// Bytes of the free buffers in `pool`, as of the last turn of the connection's loop (the
    /// pool is counted once per turn, not per PDU).
    pool_cached: usize,
    /// This connection to its reactor's poller.
    key: ConnKey,
}

/// An accepted NVMe/TCP socket on its way to a reactor, with its place in the connection
/// limits.
pub struct Incoming {
    /// The socket.
    pub stream: std::net::TcpStream,
    /// Its place in the connection limits.
    pub permit: Permit,
}

impl crate::reactor::Incoming for Incoming {
    fn serve(
        self: Box<Self>,
        target: Arc<Target>,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()>>> {
        Box::pin(async move {
            // Registered with the runtime of the reactor that runs it.
            match TcpStream::from_std(self.stream) {
                Ok(stream) => serve(target, stream, self.permit).await,
                Err(e) => warn!(error = %e, "cannot register connection"),
            }
        })
    }
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
        .on_listener(config::Transport::Tcp)
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
        in_flight_bytes: 0,
        charge: Charge::new(&target.memory),
        pool_cached: 0,
        key: ConnKey::new(),
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
            if self.e.closing.is_some()
                && let Some(reason) = self.e.drained(self.engine.pending_send().is_empty())
            {
                return reason;
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
            if can_read
                && !want_write
                && !held_back
                && self.e.closing.is_none()
                && self.e.in_flight() == 0
            {
                // Nothing runs on a backend and nothing waits to be sent: read the next
                // command the moment it comes if the reactor lets this connection do so.
                match self.spin_receive() {
                    Ok(true) => continue,
                    Ok(false) => {}
                    Err(reason) => {
                        if let Some(reason) = self.on_receive_error(reason) {
                            return reason;
                        }
                        continue;
                    }
                }
            }
            // Over the memory budget: look again once another connection gave some back (or
            // after a short while, in case that happened before this connection waited).
            let budget = over_budget.then(|| Arc::clone(self.charge.budget()));
            tokio::select! {
                biased;
                wake = self.e.next() => {
                    let mut w = Wire::new(self.engine.responder(), &self.pool, &mut self.in_flight_bytes);
                    if let Some(reason) = self.e.on_wake(&mut w, wake) {
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

    /// While [`reactor::spin_until`] allows (plain TCP only: TLS records are read through
    /// the stream), reads the socket directly, without waiting for the runtime to report it
    /// readable, until data comes or the time passes. Returns whether data came (and was
    /// handled). The runtime's readiness of the socket is left as it was: at worst the next
    /// wait finds it readable and spends one read that finds nothing.
    fn spin_receive(&mut self) -> Result<bool, Closed> {
        if self.stream.is_tls() {
            return Ok(false);
        }
        let Some(until) = reactor::spin_until(self.key) else {
            return Ok(false);
        };
        let mut turns = 0u32;
        loop {
            let asked = self.engine.recv_hint(READ_CHUNK);
            let buf = self.engine.recv_buf(asked);
            match self.stream.read_now(buf) {
                // The end of the stream, like an error, is left to the runtime's wait to find.
                Ok(0) => return Ok(false),
                Ok(n) => {
                    self.received(n)?;
                    return Ok(true);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    turns += 1;
                    if turns % busy_poll::SPIN_CLOCK_EVERY == 0 && Instant::now() >= until {
                        return Ok(false);
                    }
                }
                Err(_) => return Ok(false),
            }
        }
    }

    /// Takes `n` bytes just read into the receive buffer and handles every complete PDU.
    fn received(&mut self, n: usize) -> Result<(), Closed> {
        self.engine.commit_recv(n);
        self.e.q.tick();
        reactor::note_activity(self.key);
        self.handle_events()
    }

    /// Reads what the socket has and handles every complete PDU.
    fn receive(&mut self) -> Result<(), Closed> {
        for _ in 0..4 {
            let asked = self.engine.recv_hint(READ_CHUNK);
            let buf = self.engine.recv_buf(asked);
            match self.stream.try_read(buf) {
                Ok(0) => return Err(Closed::HostClosed),
                Ok(n) => {
                    self.received(n)?;
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
            let (ev, out) = match self.engine.next_event_and_responder() {
                Ok(Some(ev)) => ev,
                Ok(None) => return Ok(()),
                Err(e) => return Err(Closed::Protocol(e.to_string())),
            };
            let mut w = Wire::new(out, &self.pool, &mut self.in_flight_bytes);
            match ev {
                TargetEvent::Connected(p) => {
                    debug!(peer = %self.e.q.origin.peer, hdgst = p.digests.header, ddgst = p.digests.data, "NVMe/TCP connection initialized");
                    continue;
                }
                TargetEvent::Command { sqe, data } => {
                    w.icd = data;
                    if let Step::Fetch(f) = self.e.command(&mut w, Sqe::from_array(&sqe)) {
                        w.icd = &[];
                        fetch(
                            &mut self.e,
                            &mut w,
                            &mut self.writes,
                            &mut self.next_ttag,
                            f,
                        );
                    }
                }
                TargetEvent::CommandDataDigestError { sqe } => {
                    self.e
                        .fail(&mut w, Sqe::from_array(&sqe), Fault::DataDigest);
                }
                TargetEvent::H2CData {
                    ttag,
                    datao,
                    data,
                    last,
                    ..
                } => {
                    if let Some(pw) = self.writes.get_mut(&ttag) {
                        let off = datao as usize;
                        if let Some(dst) = pw.buf.get_mut(off..off + data.len()) {
                            dst.copy_from_slice(data);
                        }
                    }
                    if last {
                        fetched(&mut self.e, &mut w, &mut self.writes, ttag);
                    }
                    continue;
                }
                TargetEvent::H2CDataDigestError { ttag, last, .. } => {
                    if let Some(pw) = self.writes.get_mut(&ttag) {
                        pw.digest_error = true;
                    }
                    if last {
                        fetched(&mut self.e, &mut w, &mut self.writes, ttag);
                    }
                    continue;
                }
                TargetEvent::TermReq { fes, .. } => return Err(Closed::HostTermReq(fes)),
            }
            // A command was handled.
            if self.e.q.sqsize > 0 {
                self.engine.set_queue_size(self.e.q.sqsize as usize);
            }
            self.unflushed += 1;
            if self.unflushed >= FLUSH_EVERY && !self.engine.pending_send().is_empty() {
                self.flush().map_err(Closed::Io)?;
            }
        }
    }
}

/// Asks the host for a command's data with an R2T; the write waits in `writes` until the
/// data is in.
fn fetch(
    e: &mut Engine<Sqe>,
    w: &mut Wire<'_>,
    writes: &mut HashMap<u16, PendingWrite>,
    next_ttag: &mut u16,
    f: Fetch<Sqe>,
) {
    let cid = f.cid();
    if writes.values().any(|pw| pw.fetch.cid() == cid) {
        // Another write with this identifier still waits for its data.
        e.fetch_failed(w, f, Fault::CommandIdConflict);
        return;
    }
    let ttag = loop {
        let t = *next_ttag;
        *next_ttag = next_ttag.wrapping_add(1);
        if !writes.contains_key(&t) {
            break t;
        }
    };
    let len = f.len();
    match w.out.send_r2t(cid, ttag, 0, len as u32) {
        Ok(()) => {
            let buf = w.pool.get(len);
            writes.insert(
                ttag,
                PendingWrite {
                    fetch: f,
                    buf,
                    digest_error: false,
                },
            );
        }
        Err(err) => {
            debug!(error = %err, cid, "cannot queue R2T");
            e.fetch_failed(w, f, Fault::CommandIdConflict);
        }
    }
}

/// The last of a write's data arrived: runs it (or fails it, its data damaged).
fn fetched(
    e: &mut Engine<Sqe>,
    w: &mut Wire<'_>,
    writes: &mut HashMap<u16, PendingWrite>,
    ttag: u16,
) {
    let Some(pw) = writes.remove(&ttag) else {
        return;
    };
    if pw.digest_error {
        w.pool.put(pw.buf);
        e.fetch_failed(w, pw.fetch, Fault::DataDigest);
        return;
    }
    *w.in_flight_bytes += pw.buf.len();
    let _ = e.fetched(w, pw.fetch, pw.buf);
}

/// The transport's side of the engine ([`Transport`]) on one NVMe/TCP connection: a command's
/// in-capsule data, where its answer and data go (the connection's send buffer), and its
/// data buffers.
struct Wire<'a> {
    out: Responder<'a>,
    /// In-capsule data of the command being handed to the engine.
    icd: &'a [u8],
    pool: &'a BufPool,
    /// Data buffers of requests handed to the engine, in bytes.
    in_flight_bytes: &'a mut usize,
}

impl<'a> Wire<'a> {
    fn new(out: Responder<'a>, pool: &'a BufPool, in_flight_bytes: &'a mut usize) -> Self {
        Wire {
            out,
            icd: &[],
            pool,
            in_flight_bytes,
        }
    }

    fn send_cqe(&mut self, cqe: &Cqe) {
        if let Err(e) = self.out.send_capsule_resp(&cqe.to_array()) {
            debug!(error = %e, cid = cqe.cid(), "cannot queue CapsuleResp");
        }
    }
}

impl Transport for Wire<'_> {
    type Tag = Sqe;

    fn sqe<'s>(&'s self, tag: &'s Sqe) -> &'s Sqe {
        tag
    }

    fn capsule(&self, _: &Sqe) -> &[u8] {
        self.icd
    }

    fn buffer(&mut self, _: &Sqe, len: usize, from_capsule: bool) -> Result<IoBuf, Fault> {
        let mut b = self.pool.get(len);
        if from_capsule {
            b.copy_from_slice(self.icd);
        }
        *self.in_flight_bytes += b.len();
        Ok(b)
    }

    /// Data goes in C2HData PDUs before the CapsuleResp.
    fn respond(&mut self, _: Sqe, data: &[u8], cqe: &Cqe) -> Result<(), Refused<Sqe>> {
        if !data.is_empty() {
            if let Err(e) = self.out.send_c2h_data(cqe.cid(), 0, data, true, false) {
                debug!(error = %e, "cannot queue C2HData");
            }
        }
        self.send_cqe(cqe);
        Ok(())
    }

    /// With `in_data`, the SUCCESS flag of the last C2HData PDU stands for the completion.
    fn send_read(
        &mut self,
        _: Sqe,
        buf: IoBuf,
        cqe: &Cqe,
        in_data: bool,
    ) -> Result<(), Refused<Sqe>> {
        let cid = cqe.cid();
        *self.in_flight_bytes = self.in_flight_bytes.saturating_sub(buf.len());
        if let Err(e) = self.out.send_c2h_data(cid, 0, &buf, true, in_data) {
            debug!(error = %e, cid, "cannot queue C2HData");
        }
        self.pool.put(buf);
        if !in_data {
            self.send_cqe(cqe);
        }
        Ok(())
    }

    fn recycle(&mut self, _: &Sqe, buf: IoBuf) {
        *self.in_flight_bytes = self.in_flight_bytes.saturating_sub(buf.len());
        self.pool.put(buf);
    }

    fn complete_held(&mut self, cqe: &Cqe) {
        self.send_cqe(cqe);
    }

    /// Each C2HData PDU's payload is written straight into the send buffer.
    fn send_read_with<E>(
        &mut self,
        tag: &Sqe,
        len: usize,
        align: usize,
        in_data: bool,
        fill: impl FnMut(usize, &mut [u8]) -> Result<(), E>,
    ) -> Option<Result<bool, E>> {
        if self.out.config().max_c2h_data as usize % align != 0 {
            return None;
        }
        match self
            .out
            .send_c2h_data_with(tag.cid(), len as u32, in_data, fill)
        {
            Ok(Ok(())) => Some(Ok(in_data)),
            Ok(Err(e)) => Some(Err(e)),
            Err(e) => {
                debug!(error = %e, cid = tag.cid(), "cannot queue C2HData");
                Some(Ok(false))
            }
        }
    }

    fn shared_read_min(&self) -> usize {
        SHARED_READ_MIN
    }

    /// The C2HData PDUs go out from the namespace's memory, held until the socket has taken
    /// them, so the kernel's copy into the socket is the only one.
    fn send_read_shared(
        &mut self,
        tag: &Sqe,
        len: usize,
        in_data: bool,
        pieces: &[SharedPiece],
    ) -> bool {
        let Ok(len) = u32::try_from(len) else {
            return false;
        };
        match self
            .out
            .send_c2h_data_shared(tag.cid(), len, in_data, pieces)
        {
            Ok(()) => in_data,
            Err(e) => {
                debug!(error = %e, cid = tag.cid(), "cannot queue C2HData");
                false
            }
        }
    }
}
