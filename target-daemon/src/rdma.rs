//! The NVMe/RDMA transport (RoCE v2, InfiniBand, iWARP) on `nvmf-rdma`.
//!
//! An acceptor task per listener takes RDMA-CM connection requests, validates the NVMe
//! private data (record format, queue ID, HSQSIZE, HRQSIZE, the host's IRD) and rejects bad
//! ones with the matching NVMe reject status; good ones go to a reactor thread (the same pool
//! as NVMe/TCP's, with the same busy-poll window), which sets up the queue pair and accepts. Each connection then runs like an NVMe/TCP one (see
//! [`crate::tcp`]):
//!
//! - command capsules arrive by SEND into HSQSIZE + 1 pre-posted registered receive buffers
//!   of 64 bytes plus the in-capsule data size (IOCCSZ); a buffer is posted again when its
//!   command is answered, so a host never has more commands in the target than it may, and
//!   with HRQSIZE >= HSQSIZE + 1 (checked at connect) the completions never overrun its
//!   receive queue;
//! - data of keyed SGL data blocks moves by RDMA READ (writes, Connect data) and RDMA WRITE
//!   (reads, admin data) between the host's memory and registered pool buffers that the
//!   backend then uses directly; in-capsule data comes through the offset SGL;
//! - the completion goes back by SEND (SEND with invalidate when the host asked for its key
//!   to be invalidated), exactly once per command: answering consumes the receive token.
//!
//! libibverbs and librdmacm are loaded only when an `rdma://` listener is configured; without
//! them (or without an RDMA device) the listener fails to start with a clear error and
//! NVMe/TCP is unaffected.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use blockdev::IoBuf;
use nvme_spec::queue::{SglDescriptor, sgl_subtype, sgl_type};
use nvme_spec::rdma::reject;
use nvme_spec::{Cqe, Sqe};
use nvmf_rdma::nvme::{
    QueueLimits, QueueRequest, accept_data, negotiate_ord, parse_request, reject_data,
    reject_reason,
};
use nvmf_rdma::{
    Access, CapsuleQueue, CmEvent, ConnectRequest, DataOut, Event, Listener, ProtectionDomain,
    QueueConfig, RecvSlot, Registered, RemoteKey,
};
use tracing::{debug, error, info, warn};

use crate::admission::Permit;
use crate::config::{ListenAddr, Transport};
use crate::controller::QueueOrigin;
use crate::engine::{Closed, Done, Engine, Fault, Transport as _};
use crate::log_limited;
use crate::queue::{DataSource, HostSgl, IoOp, IoRequest, QueueState, Submit};
use crate::ratelimit::LogKind;
use crate::reactor::{Connection, Pool};
use crate::target::Target;

/// Largest data a non-I/O command may bring (Connect carries 1 KiB).
const MAX_ADMIN_DATA: usize = 64 * 1024;
/// How long a closing connection waits for its in-flight work before it is torn down.
const CLOSE_GRACE: Duration = Duration::from_secs(10);
/// Pool buffers kept per connection, in bytes (registered memory is pinned).
const POOL_BYTES: usize = 16 << 20;

/// A bound RDMA-CM listener, not yet accepting.
pub struct RdmaListener {
    inner: Listener,
}

impl RdmaListener {
    /// Loads the RDMA libraries and listens on `addr` (an address of an RDMA interface).
    pub fn bind(addr: &ListenAddr) -> Result<RdmaListener, String> {
        Listener::bind(addr.addr, 1024)
            .map(|inner| RdmaListener { inner })
            .map_err(|e| e.to_string())
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.inner.local_addr()
    }
}

/// A validated connection request on its way to a reactor.
pub struct Incoming {
    req: ConnectRequest,
    params: QueueRequest,
    ord: u8,
    permit: Permit,
}

/// Starts one acceptor task per listener on the current tokio runtime; accepted connections
/// go to the reactors of `pool`. Returns the task handles, which end when the target shuts
/// down.
pub fn start(
    target: &Arc<Target>,
    listeners: Vec<(ListenAddr, RdmaListener)>,
    pool: &Arc<Pool>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let mut tasks = Vec::new();
    for (addr, l) in listeners {
        info!(listener = %addr, "listening");
        let t = Arc::clone(target);
        tasks.push(tokio::spawn(accept_loop(
            t,
            addr,
            l.inner,
            Arc::clone(pool),
        )));
    }
    tasks
}

async fn accept_loop(
    target: Arc<Target>,
    addr: ListenAddr,
    mut listener: Listener,
    pool: Arc<Pool>,
) {
    let mut shutdown = target.subscribe_shutdown();
    let gate = target.listener_gate(addr.clone());
    let report = gate.report_drops();
    tokio::pin!(report);
    loop {
        tokio::select! {
            r = listener.next_request() => match r {
                Ok(req) => {
                    let Some(permit) = gate.admit() else {
                        let _ = req.reject(&reject_data(reject::NO_RESOURCES));
                        continue;
                    };
                    if let Some(inc) = validate(&target, req, permit) {
                        if let Err(Connection::Rdma(inc)) = pool.hand(Connection::Rdma(Box::new(inc))) {
                            let _ = inc.req.reject(&reject_data(reject::NO_RESOURCES));
                            break;
                        }
                    }
                }
                Err(e) => {
                    error!(listener = %addr, error = %e, "RDMA listener failed");
                    if matches!(e, nvmf_rdma::Error::Cm(_)) {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            _ = shutdown.changed() => break,
            _ = &mut report => {}
        }
    }
    gate.flush_drops();
}

/// The limits of NVMe/RDMA queues on this target.
fn limits(target: &Target) -> QueueLimits {
    let s = &target.settings;
    QueueLimits {
        max_admin_depth: s.max_queue_depth,
        max_io_depth: s.max_queue_depth,
        max_qid: s.max_io_queues,
    }
}

/// Checks a connection request; rejects it (and returns None) when it cannot be served.
fn validate(target: &Target, req: ConnectRequest, permit: Permit) -> Option<Incoming> {
    let peer = req.peer;
    let refuse = |req: ConnectRequest, code: u16, detail: String| {
        log_limited!(
            LogKind::Transport,
            info!(%peer, status = code, reason = reject_reason(code), %detail, "NVMe/RDMA connection rejected")
        );
        if let Err(e) = req.reject(&reject_data(code)) {
            debug!(%peer, error = %e, "cannot send the reject");
        }
        None
    };
    if target.is_shutting_down() {
        return refuse(req, reject::NO_RESOURCES, "target shutting down".into());
    }
    let params = match parse_request(&req.private_data, &limits(target)) {
        Ok(p) => p,
        Err(code) => {
            let detail = format!("{} bytes of private data", req.private_data.len());
            return refuse(req, code, detail);
        }
    };
    let attr = match req.device_attr() {
        Ok(a) => a,
        Err(e) => return refuse(req, reject::NO_RESOURCES, e.to_string()),
    };
    if attr.max_qp_wr > 0 && u32::from(params.depth) > attr.max_qp_wr {
        let detail = format!("device queues hold {} entries", attr.max_qp_wr);
        return refuse(req, reject::INVALID_HSQSIZE, detail);
    }
    let ord = match negotiate_ord(req.initiator_depth, attr.max_qp_init_rd_atom) {
        Ok(o) => o,
        Err(code) => return refuse(req, code, "host allows no RDMA READ".into()),
    };
    debug!(
        %peer,
        qid = params.qid,
        depth = params.depth,
        host_recv = params.host_recv,
        ord,
        "NVMe/RDMA connection request"
    );
    Some(Incoming {
        req,
        params,
        ord,
        permit,
    })
}

/// A command between its arrival and its answer.
struct Cmd {
    slot: RecvSlot,
    sqe: Sqe,
    stage: Stage,
}

enum Stage {
    /// Fetching the data of an admin or fabrics command before submitting it.
    AdminData,
    /// Fetching the data of a write (or Dataset Management) before running it.
    HostData(IoRequest),
    /// Running on the backend; the registration of its buffer waits here.
    Running(Option<nvmf_rdma::Registration>),
}

/// Registered I/O buffers by power-of-two size class.
struct RegPool {
    classes: HashMap<usize, Vec<Registered<IoBuf>>>,
}

impl RegPool {
    fn get(
        &mut self,
        pd: &Arc<ProtectionDomain>,
        len: usize,
    ) -> Result<Registered<IoBuf>, nvmf_rdma::Error> {
        let class = len.max(blockdev::IO_ALIGN).next_power_of_two();
        let mut buf = match self.classes.get_mut(&class).and_then(|v| v.pop()) {
            Some(b) => b,
            None => pd.register(IoBuf::new(class), Access::LOCAL_WRITE)?,
        };
        buf.set_len(len)
            .map_err(|e| nvmf_rdma::Error::Invalid(e.to_string()))?;
        Ok(buf)
    }

    fn put(&mut self, buf: Registered<IoBuf>) {
        let class = buf.capacity();
        if !class.is_power_of_two() {
            return;
        }
        let keep = (POOL_BYTES / class).clamp(2, 32);
        let list = self.classes.entry(class).or_default();
        if list.len() < keep {
            list.push(buf);
        }
    }
}

struct Conn {
    q: CapsuleQueue<IoBuf>,
    /// The command engine; a running request's tag is its command token.
    e: Engine<u32>,
    pool: RegPool,
    cmds: Vec<Option<Cmd>>,
    free_tokens: Vec<u32>,
    held: HashMap<u16, Cmd>,
}

/// Accepts a validated connection request and serves the queue pair until it closes.
pub(crate) async fn serve(target: Arc<Target>, inc: Incoming) {
    let Incoming {
        req,
        params,
        ord,
        permit,
    } = inc;
    let (local, peer) = (req.local, req.peer);
    let in_capsule = (target.settings.in_capsule_data as usize).max(8192);
    let cfg = QueueConfig::target(params.depth, in_capsule, ord);
    let q = match CapsuleQueue::accept(
        req,
        cfg,
        &accept_data(params.depth),
        &reject_data(reject::NO_RESOURCES),
    ) {
        Ok(q) => q,
        Err(e) => {
            log_limited!(
                LogKind::Transport,
                warn!(%peer, error = %e, "cannot set up NVMe/RDMA queue pair: rejected")
            );
            return;
        }
    };
    debug!(%peer, %local, qid = params.qid, depth = params.depth, "NVMe/RDMA queue pair accepted");
    let state = QueueState::new(Arc::clone(&target), QueueOrigin { local, peer })
        .with_host_sgl(HostSgl::Keyed)
        .on_listener(Transport::Rdma);
    let mut conn = Conn {
        q,
        e: Engine::new(state, permit),
        pool: RegPool {
            classes: HashMap::new(),
        },
        cmds: Vec::new(),
        free_tokens: Vec::new(),
        held: HashMap::new(),
    };
    let reason = conn.run().await;
    conn.e.finish(&reason, peer, "rdma");
}

/// The host memory a keyed SGL data block names, if the descriptor is one.
fn keyed_remote(sgl: &SglDescriptor) -> Option<RemoteKey> {
    let keyed = sgl.desc_type() == sgl_type::KEYED_DATA_BLOCK
        && matches!(
            sgl.subtype(),
            sgl_subtype::ADDRESS | sgl_subtype::INVALIDATE
        );
    keyed.then(|| RemoteKey {
        addr: sgl.address.get(),
        len: sgl.keyed_length(),
        rkey: sgl.key(),
    })
}

/// The key to invalidate with the completion, when the host asked for it.
fn invalidate_key(sgl: &SglDescriptor) -> Option<u32> {
    (sgl.desc_type() == sgl_type::KEYED_DATA_BLOCK
        && sgl.subtype() == sgl_subtype::INVALIDATE
        && sgl.keyed_length() > 0)
        .then(|| sgl.key())
}

impl Conn {
    async fn run(&mut self) -> Closed {
        let mut evs = Vec::new();
        let mut close_deadline: Option<Instant> = None;
        loop {
            if let Err(e) = self.q.poll(&mut evs) {
                return Closed::Transport(e.to_string());
            }
            if !evs.is_empty() {
                self.e.q.tick();
                crate::reactor::note_activity();
            }
            for ev in evs.drain(..) {
                self.on_event(ev);
            }
            if let Some(f) = self.q.failed() {
                self.e.close(Closed::Transport(f.to_string()));
            }
            if let Some(reason) = self.e.closing.take() {
                let deadline = *close_deadline.get_or_insert_with(|| Instant::now() + CLOSE_GRACE);
                let idle =
                    self.e.in_flight() == 0 && (self.q.is_idle() || self.q.failed().is_some());
                if idle || (Instant::now() >= deadline && self.e.in_flight() == 0) {
                    return reason;
                }
                self.e.closing = Some(reason);
            }
            tokio::select! {
                biased;
                wake = self.e.next() => {
                    if let Some(reason) = self.on_wake(wake) {
                        self.e.closing = Some(reason);
                    }
                }
                r = self.q.wait() => {
                    if let Err(e) = r {
                        return Closed::Transport(e.to_string());
                    }
                }
                ev = self.q.cm_event() => match ev {
                    Ok(CmEvent::Established) => debug!(peer = %self.e.q.origin.peer, "NVMe/RDMA connection established"),
                    Ok(CmEvent::Disconnected) => self.e.close(Closed::HostClosed),
                    Ok(CmEvent::Other(what)) => debug!(peer = %self.e.q.origin.peer, event = %what, "RDMA-CM event"),
                    Ok(other) => self.e.close(Closed::Transport(format!("{other:?}"))),
                    Err(e) => self.e.close(Closed::Transport(e.to_string())),
                },
                _ = tokio::time::sleep_until(close_deadline.unwrap_or_else(Instant::now).into()), if close_deadline.is_some() => {}
            }
        }
    }

    fn alloc_token(&mut self, cmd: Cmd) -> u32 {
        if let Some(t) = self.free_tokens.pop() {
            self.cmds[t as usize] = Some(cmd);
            t
        } else {
            self.cmds.push(Some(cmd));
            (self.cmds.len() - 1) as u32
        }
    }

    fn take_cmd(&mut self, token: u32) -> Option<Cmd> {
        let c = self.cmds.get_mut(token as usize)?.take()?;
        self.free_tokens.push(token);
        Some(c)
    }

    fn on_event(&mut self, ev: Event<IoBuf>) {
        match ev {
            Event::Received(slot) => {
                if self.e.closing.is_some() {
                    // No new work once closing; the slot goes with the queue.
                    return;
                }
                self.on_command(slot);
            }
            Event::Sent { data, ok, .. } => {
                if let Some(b) = data {
                    self.pool.put(b);
                }
                if !ok {
                    let why = self.q.failed().unwrap_or("send failed").to_string();
                    self.e.close(Closed::Transport(why));
                }
            }
            Event::ReadDone { token, buf, ok } => self.read_done(token as u32, buf, ok),
        }
    }

    fn on_command(&mut self, slot: RecvSlot) {
        let msg = self.q.message(&slot);
        if msg.len() < 64 {
            let why = format!("capsule of {} bytes", msg.len());
            self.e.closing = Some(Closed::Protocol(why));
            return;
        }
        let mut raw = [0u8; 64];
        raw.copy_from_slice(&msg[..64]);
        let sqe = Sqe::from_array(&raw);
        if self.e.q.wants_data_at_submit(&sqe) {
            if let Some(remote) = keyed_remote(&sqe.dptr).filter(|r| r.len > 0) {
                let len = remote.len as usize;
                if len <= MAX_ADMIN_DATA {
                    let pd = Arc::clone(self.q.pd());
                    match self.pool.get(&pd, len) {
                        Ok(buf) => {
                            let token = self.alloc_token(Cmd {
                                slot,
                                sqe,
                                stage: Stage::AdminData,
                            });
                            if let Err((e, buf)) = self.q.read(buf, len, remote, u64::from(token)) {
                                debug!(error = %e, "cannot fetch command data");
                                self.pool.put(buf);
                                if let Some(cmd) = self.take_cmd(token) {
                                    self.fail_cmd(cmd, Fault::Resources);
                                }
                            }
                            return;
                        }
                        Err(e) => {
                            log_limited!(
                                LogKind::Transport,
                                warn!(error = %e, "cannot register a buffer for command data")
                            );
                            self.fail_slot(slot, sqe, Fault::Resources);
                            return;
                        }
                    }
                }
                // Longer than any such command needs: submit without it (the command layer
                // answers with the right status).
            }
        }
        let icd = &msg[64..];
        let submit = self.e.q.submit(&sqe, icd);
        let needs_icd = matches!(
            &submit,
            Submit::Io(req) if matches!(
                req.op,
                IoOp::Write { src: DataSource::InCapsule, .. } | IoOp::Dsm { src: DataSource::InCapsule, .. }
            )
        );
        let icd_buf = if needs_icd {
            let pd = Arc::clone(self.q.pd());
            let icd_len = icd.len();
            match self.pool.get(&pd, icd_len) {
                Ok(mut b) => {
                    let msg = self.q.message(&slot);
                    b.bytes_mut()[..icd_len].copy_from_slice(&msg[64..64 + icd_len]);
                    Some(b)
                }
                Err(e) => {
                    log_limited!(
                        LogKind::Transport,
                        warn!(error = %e, "cannot register a buffer for in-capsule data")
                    );
                    self.fail_slot(slot, sqe, Fault::Resources);
                    return;
                }
            }
        } else {
            None
        };
        self.dispatch(slot, sqe, submit, icd_buf);
    }

    fn dispatch(
        &mut self,
        slot: RecvSlot,
        sqe: Sqe,
        submit: Submit,
        icd: Option<Registered<IoBuf>>,
    ) {
        match submit {
            Submit::Complete(cqe) => self.respond(slot, &sqe, cqe, None),
            Submit::CompleteWithData(data, cqe) => self.respond_with_data(slot, &sqe, cqe, &data),
            Submit::CompleteAndClose(cqe) => {
                self.respond(slot, &sqe, cqe, None);
                self.e.closing = Some(Closed::Local("host disconnected the queue"));
            }
            Submit::Held => {
                let cid = sqe.cid();
                if let Some(old) = self.held.insert(
                    cid,
                    Cmd {
                        slot,
                        sqe,
                        stage: Stage::Running(None),
                    },
                ) {
                    // A held command reusing the CID of another: answer the older one.
                    self.fail_cmd(old, Fault::CommandIdConflict);
                }
            }
            Submit::Io(req) => {
                self.e.watch_controller();
                let host_len = req.op.host_data_len();
                if host_len > 0 {
                    // queue.rs accepted a keyed descriptor of exactly this length.
                    let Some(remote) = keyed_remote(&sqe.dptr) else {
                        self.fail_slot(slot, sqe, Fault::SglType);
                        return;
                    };
                    let pd = Arc::clone(self.q.pd());
                    let buf = match self.pool.get(&pd, host_len) {
                        Ok(b) => b,
                        Err(e) => {
                            log_limited!(
                                LogKind::Transport,
                                warn!(error = %e, "cannot register a buffer for write data")
                            );
                            self.fail_slot(slot, sqe, Fault::Resources);
                            return;
                        }
                    };
                    let token = self.alloc_token(Cmd {
                        slot,
                        sqe,
                        stage: Stage::HostData(req),
                    });
                    if let Err((e, buf)) = self.q.read(buf, host_len, remote, u64::from(token)) {
                        debug!(error = %e, "cannot fetch write data");
                        self.pool.put(buf);
                        if let Some(cmd) = self.take_cmd(token) {
                            self.fail_cmd(cmd, Fault::SglLength);
                        }
                    }
                    return;
                }
                let buf = match (icd, req.op) {
                    (Some(b), _) => Some(b),
                    (None, IoOp::Read { len, .. }) => {
                        let pd = Arc::clone(self.q.pd());
                        match self.pool.get(&pd, len) {
                            Ok(b) => Some(b),
                            Err(e) => {
                                log_limited!(
                                    LogKind::Transport,
                                    warn!(error = %e, "cannot register a buffer for read data")
                                );
                                self.fail_slot(slot, sqe, Fault::Resources);
                                return;
                            }
                        }
                    }
                    (None, _) => None,
                };
                self.start_registered(slot, sqe, req, buf);
            }
        }
        self.e.watch_controller();
    }

    fn read_done(&mut self, token: u32, buf: Registered<IoBuf>, ok: bool) {
        let Some(cmd) = self.take_cmd(token) else {
            self.pool.put(buf);
            return;
        };
        if !ok {
            // The queue pair is in the error state: nothing more can be sent.
            self.pool.put(buf);
            let why = self.q.failed().unwrap_or("RDMA READ failed").to_string();
            self.e.close(Closed::Transport(why));
            drop(cmd.slot);
            return;
        }
        let Cmd { slot, sqe, stage } = cmd;
        match stage {
            Stage::AdminData => {
                let submit = self.e.q.submit(&sqe, &buf.get()[..]);
                self.pool.put(buf);
                self.dispatch(slot, sqe, submit, None);
            }
            Stage::HostData(req) => self.start_registered(slot, sqe, req, Some(buf)),
            Stage::Running(_) => {
                self.pool.put(buf);
                drop(slot);
            }
        }
    }

    /// Runs a request on the engine with its registered buffer, whose registration waits
    /// with the command.
    fn start_registered(
        &mut self,
        slot: RecvSlot,
        sqe: Sqe,
        req: IoRequest,
        buf: Option<Registered<IoBuf>>,
    ) {
        let (iobuf, reg) = match buf {
            Some(b) => {
                let (b, r) = b.detach();
                (b, Some(r))
            }
            None => (IoBuf::new(0), None),
        };
        let token = self.alloc_token(Cmd {
            slot,
            sqe,
            stage: Stage::Running(reg),
        });
        self.start(token, req, iobuf);
    }

    /// Answers a command with the status of `fault` (no data).
    fn fail_cmd(&mut self, cmd: Cmd, fault: Fault) {
        self.fail_slot(cmd.slot, cmd.sqe, fault);
    }

    /// Answers the command in `slot` with the status of `fault` (no data).
    fn fail_slot(&mut self, slot: RecvSlot, sqe: Sqe, fault: Fault) {
        let cqe = self.e.fail(&sqe, fault);
        self.respond(slot, &sqe, cqe, None);
    }

    /// Sends admin data (Identify, log pages...) to the host's keyed buffer, then the
    /// completion.
    fn respond_with_data(&mut self, slot: RecvSlot, sqe: &Sqe, cqe: Cqe, data: &[u8]) {
        if data.is_empty() {
            self.respond(slot, sqe, cqe, None);
            return;
        }
        let Some(remote) = keyed_remote(&sqe.dptr).filter(|r| r.len as usize >= data.len()) else {
            self.fail_slot(slot, *sqe, Fault::SglType);
            return;
        };
        let pd = Arc::clone(self.q.pd());
        match self.pool.get(&pd, data.len()) {
            Ok(mut b) => {
                b.bytes_mut()[..data.len()].copy_from_slice(data);
                let out = DataOut {
                    buf: b,
                    len: data.len(),
                    remote,
                };
                self.respond(slot, sqe, cqe, Some(out));
            }
            Err(e) => {
                log_limited!(
                    LogKind::Transport,
                    warn!(error = %e, "cannot register a buffer for command data")
                );
                self.fail_slot(slot, *sqe, Fault::Resources);
            }
        }
    }

    /// The one place a completion leaves: re-posts the command's receive buffer, writes the
    /// data if any, and sends the CQE.
    fn respond(&mut self, slot: RecvSlot, sqe: &Sqe, cqe: Cqe, data: Option<DataOut<IoBuf>>) {
        let invalidate = invalidate_key(&sqe.dptr);
        if let Err(e) = self.q.respond(
            slot,
            &cqe.to_array(),
            data,
            invalidate,
            u64::from(cqe.cid()),
        ) {
            debug!(error = %e, cid = cqe.cid(), "cannot send the completion");
            self.e.close(Closed::Transport(e.to_string()));
        }
    }
}

impl crate::engine::Transport for Conn {
    type Tag = u32;

    fn engine(&mut self) -> &mut Engine<u32> {
        &mut self.e
    }

    /// A read's data goes by RDMA WRITE to the host's keyed buffer, posted with the
    /// completion's SEND.
    fn complete(&mut self, done: Done<u32>) {
        let Done {
            tag: token,
            req,
            status,
            buf,
        } = done;
        let Some(cmd) = self.take_cmd(token) else {
            return;
        };
        let Cmd { slot, sqe, stage } = cmd;
        let reg = match stage {
            Stage::Running(r) => r,
            _ => None,
        };
        // Join the buffer with its registration again (the backend hands back the same one).
        let rbuf = match reg.map(|r| r.attach(buf)) {
            Some(Ok(b)) => Some(b),
            Some(Err((_, b))) if matches!(req.op, IoOp::Read { .. }) => {
                let pd = Arc::clone(self.q.pd());
                pd.register(b, Access::LOCAL_WRITE).ok()
            }
            _ => None,
        };
        let cqe = self.e.io_completion(&sqe, &req, status);
        match (status.is_success(), req.op, rbuf) {
            (true, IoOp::Read { len, .. }, Some(b)) => match keyed_remote(&sqe.dptr) {
                Some(remote) => self.respond(
                    slot,
                    &sqe,
                    cqe,
                    Some(DataOut {
                        buf: b,
                        len,
                        remote,
                    }),
                ),
                None => {
                    self.pool.put(b);
                    self.fail_slot(slot, sqe, Fault::SglType);
                }
            },
            (true, IoOp::Read { .. }, None) => self.fail_slot(slot, sqe, Fault::Resources),
            (_, _, b) => {
                if let Some(b) = b {
                    self.pool.put(b);
                }
                self.respond(slot, &sqe, cqe, None);
            }
        }
    }

    /// Completes a held command (Asynchronous Event Request) with an event's CQE.
    fn complete_held(&mut self, cqe: Cqe) {
        match self.held.remove(&cqe.cid()) {
            Some(cmd) => self.respond(cmd.slot, &cmd.sqe, cqe, None),
            None => debug!(cid = cqe.cid(), "event for a command that is not held"),
        }
    }
}

#[cfg(test)]
mod tests {
    use nvme_spec::FromBytes;
    use nvme_spec::Status;
    use nvme_spec::command::build;
    use nvme_spec::identify::{IdentifyController, SGLS_KEYED, SGLS_TRANSPORT};
    use nvme_spec::status::generic;

    use super::*;
    use crate::testing::{connected, status, target};

    fn sgls(admin: &mut QueueState) -> u32 {
        let mut id = build::identify(5, 1, 0);
        id.dptr = SglDescriptor::keyed(0x2000, 4096, 9, false);
        match admin.submit(&id, &[]) {
            Submit::CompleteWithData(data, cqe) => {
                assert!(cqe.status().is_success());
                IdentifyController::read_from_bytes(&data[..4096])
                    .unwrap()
                    .sgls
                    .get()
            }
            _ => panic!("Identify Controller returned no data"),
        }
    }

    #[test]
    fn rdma_queues_take_keyed_sgls_and_advertise_them() {
        let t = target(&["mem:4M"]);
        let (mut admin, mut io) = connected(&t, HostSgl::Keyed);
        let s = sgls(&mut admin);
        assert_ne!(s & SGLS_KEYED, 0, "keyed SGL data blocks advertised");
        assert_eq!(s & SGLS_TRANSPORT, 0, "no transport SGLs over RDMA");
        assert_ne!(s & 0b11, 0);

        // Write with a keyed descriptor: data comes from the host (RDMA READ).
        let mut w = build::read_write(true, 10, 1, 0, 2);
        w.dptr = SglDescriptor::keyed(0x10_0000, 8192, 0xabcd, true);
        assert!(
            !io.wants_data_at_submit(&w),
            "I/O writes are fetched after validation"
        );
        match io.submit(&w, &[]) {
            Submit::Io(req) => {
                assert_eq!(
                    req.op,
                    IoOp::Write {
                        lba: 0,
                        len: 8192,
                        src: DataSource::Host,
                        fua: false
                    }
                );
                assert_eq!(req.op.host_data_len(), 8192);
            }
            _ => panic!("keyed write not accepted"),
        }
        assert_eq!(
            keyed_remote(&w.dptr).map(|r| (r.addr, r.len, r.rkey)),
            Some((0x10_0000, 8192, 0xabcd))
        );
        assert_eq!(invalidate_key(&w.dptr), Some(0xabcd));

        // Read with a keyed descriptor (address subtype: no invalidation).
        let mut r = build::read_write(false, 11, 1, 0, 1);
        r.dptr = SglDescriptor::keyed(0x20_0000, 4096, 0x55, false);
        assert!(
            matches!(io.submit(&r, &[]), Submit::Io(req) if req.op == IoOp::Read { lba: 0, len: 4096 })
        );
        assert_eq!(invalidate_key(&r.dptr), None);

        // In-capsule write through the offset descriptor.
        let mut ic = build::read_write(true, 12, 1, 0, 1);
        ic.dptr = SglDescriptor::in_capsule(4096);
        assert!(
            matches!(io.submit(&ic, &[0u8; 4096]), Submit::Io(req) if req.op == IoOp::Write { lba: 0, len: 4096, src: DataSource::InCapsule, fua: false })
        );

        // NVMe/TCP's transport descriptor is refused on RDMA, as are keyed lengths that
        // differ from the command and keyed descriptors with in-capsule data.
        let mut bad = build::read_write(true, 13, 1, 0, 1);
        bad.dptr = SglDescriptor::tcp_transport(4096);
        assert_eq!(
            status(io.submit(&bad, &[])),
            Status::generic(generic::SGL_TYPE_INVALID).with_dnr()
        );
        bad.dptr = SglDescriptor::keyed(0x1000, 2048, 1, false);
        assert_eq!(
            status(io.submit(&bad, &[])),
            Status::generic(generic::DATA_SGL_LENGTH_INVALID).with_dnr()
        );
        bad.dptr = SglDescriptor::keyed(0x1000, 4096, 1, false);
        assert_eq!(
            status(io.submit(&bad, &[1u8; 16])),
            Status::generic(generic::INVALID_FIELD).with_dnr()
        );
        admin.ctrl.take().unwrap().tear_down();
    }

    #[test]
    fn tcp_queues_keep_transport_sgls() {
        let t = target(&["mem:4M"]);
        let (mut admin, mut io) = connected(&t, HostSgl::Transport);
        let s = sgls(&mut admin);
        assert_eq!(s & SGLS_KEYED, 0);
        assert_ne!(s & SGLS_TRANSPORT, 0);
        let mut w = build::read_write(true, 10, 1, 0, 1);
        w.dptr = SglDescriptor::keyed(0x1000, 4096, 1, false);
        assert_eq!(
            status(io.submit(&w, &[])),
            Status::generic(generic::SGL_TYPE_INVALID).with_dnr()
        );
        w.dptr = SglDescriptor::tcp_transport(4096);
        assert!(matches!(io.submit(&w, &[]), Submit::Io(_)));
        admin.ctrl.take().unwrap().tear_down();
    }

    #[test]
    fn descriptors_other_than_keyed_name_no_host_memory() {
        assert_eq!(keyed_remote(&SglDescriptor::in_capsule(4096)), None);
        assert_eq!(keyed_remote(&SglDescriptor::tcp_transport(4096)), None);
        // A keyed descriptor of zero length asks for no invalidation.
        assert_eq!(invalidate_key(&SglDescriptor::keyed(0, 0, 5, true)), None);
        let mut odd = SglDescriptor::keyed(0, 4096, 5, false);
        odd.identifier = (sgl_type::KEYED_DATA_BLOCK << 4) | 0x3;
        assert_eq!(keyed_remote(&odd), None);
    }

    #[test]
    fn limits_follow_the_target_settings() {
        let t = target(&["mem:4M"]);
        let l = limits(&t);
        assert_eq!(l.max_io_depth, t.settings.max_queue_depth);
        assert_eq!(l.max_qid, t.settings.max_io_queues);
        // The Linux host's admin (32) and I/O (128) queues fit the defaults.
        let mut pd = nvmf_rdma::nvme::request_data(0, 31, 32, 0xFFFF).to_vec();
        pd.resize(56, 0);
        assert!(parse_request(&pd, &l).is_ok());
        let pd = nvmf_rdma::nvme::request_data(1, 127, 128, 1);
        assert!(parse_request(&pd, &l).is_ok());
    }
}
