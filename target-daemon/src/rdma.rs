//! The NVMe/RDMA transport (RoCE v2, InfiniBand, iWARP) on `nvmf-rdma`.
//!
//! An acceptor task per listener (started by the launcher, at start or live) takes RDMA-CM
//! connection requests, validates the NVMe
//! private data (record format, queue ID, HSQSIZE, HRQSIZE, the host's IRD) and rejects bad
//! ones with the matching NVMe reject status; good ones go to a reactor thread (the same pool
//! as NVMe/TCP's, with the same busy-poll window), which sets up the queue pair and accepts. Each connection then runs like an NVMe/TCP one (see
//! [`crate::tcp`]):
//!
//! - command capsules arrive by SEND into HSQSIZE + 1 pre-posted registered receive buffers
//!   of 64 bytes plus the in-capsule data size (IOCCSZ); a buffer is posted again when its
//!   command is answered, so a host never has more commands in the target than it may, and
//!   with HRQSIZE >= HSQSIZE + 1 (checked at connect) the completions never overrun its
//!   receive queue; each command gets a token in `Wire`, the transport's side of the
//!   command engine ([`crate::engine`]), which the engine answers it by;
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
use std::sync::Arc;
use std::time::Duration;

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
use crate::config::{self, ListenAddr};
use crate::controller::QueueOrigin;
use crate::engine::{Closed, Engine, Fault, Fetch, Refused, Step, Transport};
use crate::log_limited;
use crate::queue::{HostSgl, QueueState};
use crate::ratelimit::LogKind;
use crate::reactor::{ConnKey, Pool};
use crate::target::Target;

/// Largest data a non-I/O command may bring (Connect carries 1 KiB).
const MAX_ADMIN_DATA: usize = 64 * 1024;
/// Pool buffers kept per connection, in bytes (registered memory is pinned).
const POOL_BYTES: usize = 16 << 20;

/// A validated connection request on its way to a reactor.
pub struct Incoming {
    req: ConnectRequest,
    params: QueueRequest,
    ord: u8,
    permit: Permit,
}

impl crate::reactor::Incoming for Incoming {
    fn serve(
        self: Box<Self>,
        target: Arc<Target>,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()>>> {
        Box::pin(serve(target, *self))
    }

    fn refuse(self: Box<Self>) {
        let _ = self.req.reject(&reject_data(reject::NO_RESOURCES));
    }
}

/// Starts the acceptor task of RDMA-CM listener `l` bound on `addr`, on the current tokio
/// runtime; accepted connections go to the reactors of `pool`. The task ends when the target
/// shuts down, or when it is aborted (the listener removed live), which closes the listener.
pub fn accept(
    target: &Arc<Target>,
    addr: ListenAddr,
    l: Listener,
    pool: Arc<Pool>,
) -> tokio::task::JoinHandle<()> {
    info!(listener = %addr, "listening");
    tokio::spawn(accept_loop(Arc::clone(target), addr, l, pool))
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
                        if pool.hand(Box::new(inc)).is_err() {
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
    /// Received; nothing held.
    Received,
    /// Fetching the data of an admin or fabrics command before handing it to the engine.
    AdminData,
    /// The data of an admin or fabrics command, fetched: the command's "in-capsule" data.
    Fetched(Registered<IoBuf>),
    /// Fetching the data of a write (or Dataset Management) before running it.
    HostData(Fetch<u32>),
    /// The command's data buffer is with the engine; its registration waits here.
    Buffer(nvmf_rdma::Registration),
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
    /// The command engine; a command's tag is its token in [`Wire::cmds`].
    e: Engine<u32>,
    w: Wire,
    /// This connection to its reactor's poller.
    key: ConnKey,
}

/// The transport's side of the engine ([`Transport`]) on one NVMe/RDMA queue pair: the
/// commands received and not answered, their registered buffers, and the queue pair their
/// answers and data go through.
struct Wire {
    q: CapsuleQueue<IoBuf>,
    pool: RegPool,
    cmds: Vec<Option<Cmd>>,
    free_tokens: Vec<u32>,
    /// Held commands (Asynchronous Event Requests) by CID.
    held: HashMap<u16, u32>,
    /// Why the queue pair can no longer send, once it cannot.
    broken: Option<String>,
    /// What [`Transport::sqe`] names for a token that is gone.
    blank: Sqe,
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
        .on_listener(config::Transport::Rdma);
    let mut conn = Conn {
        e: Engine::new(state, permit),
        w: Wire {
            q,
            pool: RegPool {
                classes: HashMap::new(),
            },
            cmds: Vec::new(),
            free_tokens: Vec::new(),
            held: HashMap::new(),
            broken: None,
            blank: Sqe::from_array(&[0; 64]),
        },
        key: ConnKey::new(),
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
        loop {
            if let Err(e) = self.w.q.poll(&mut evs) {
                return Closed::Transport(e.to_string());
            }
            if !evs.is_empty() {
                self.e.q.tick();
                crate::reactor::note_activity(self.key);
            }
            for ev in evs.drain(..) {
                self.on_event(ev);
            }
            if let Some(f) = self.w.q.failed() {
                self.e.close(Closed::Transport(f.to_string()));
            }
            if let Some(why) = self.w.broken.take() {
                self.e.close(Closed::Transport(why));
            }
            if self.e.closing.is_some() {
                let idle = self.w.q.is_idle() || self.w.q.failed().is_some();
                if let Some(reason) = self.e.drained(idle) {
                    return reason;
                }
            }
            tokio::select! {
                biased;
                wake = self.e.next() => {
                    if let Some(reason) = self.e.on_wake(&mut self.w, wake) {
                        self.e.close(reason);
                    }
                }
                r = self.w.q.wait() => {
                    if let Err(e) = r {
                        return Closed::Transport(e.to_string());
                    }
                }
                ev = self.w.q.cm_event() => match ev {
                    Ok(CmEvent::Established) => debug!(peer = %self.e.q.origin.peer, "NVMe/RDMA connection established"),
                    Ok(CmEvent::Disconnected) => self.e.close(Closed::HostClosed),
                    Ok(CmEvent::Other(what)) => debug!(peer = %self.e.q.origin.peer, event = %what, "RDMA-CM event"),
                    Ok(other) => self.e.close(Closed::Transport(format!("{other:?}"))),
                    Err(e) => self.e.close(Closed::Transport(e.to_string())),
                },
            }
        }
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
                    self.w.pool.put(b);
                }
                if !ok {
                    let why = self.w.q.failed().unwrap_or("send failed").to_string();
                    self.e.close(Closed::Transport(why));
                }
            }
            Event::ReadDone { token, buf, ok } => self.read_done(token as u32, buf, ok),
        }
    }

    /// A command capsule arrived: its data is fetched first when the command layer reads it
    /// at submission (Connect data in host memory), then it goes to the engine.
    fn on_command(&mut self, slot: RecvSlot) {
        let msg = self.w.q.message(&slot);
        if msg.len() < 64 {
            let why = format!("capsule of {} bytes", msg.len());
            self.e.close(Closed::Protocol(why));
            return;
        }
        let mut raw = [0u8; 64];
        raw.copy_from_slice(&msg[..64]);
        let sqe = Sqe::from_array(&raw);
        let token = self.w.alloc_token(Cmd {
            slot,
            sqe,
            stage: Stage::Received,
        });
        if self.e.q.wants_data_at_submit(&sqe)
            && let Some(remote) = keyed_remote(&sqe.dptr).filter(|r| r.len > 0)
        {
            let len = remote.len as usize;
            // Longer than any such command needs: handed over without it (the command
            // layer answers with the right status).
            if len <= MAX_ADMIN_DATA {
                let pd = Arc::clone(self.w.q.pd());
                let buf = match self.w.pool.get(&pd, len) {
                    Ok(buf) => buf,
                    Err(e) => {
                        log_limited!(
                            LogKind::Transport,
                            warn!(error = %e, "cannot register a buffer for command data")
                        );
                        self.e.fail(&mut self.w, token, Fault::Resources);
                        return;
                    }
                };
                self.w.set_stage(token, Stage::AdminData);
                if let Err((e, buf)) = self.w.q.read(buf, len, remote, u64::from(token)) {
                    debug!(error = %e, "cannot fetch command data");
                    self.w.pool.put(buf);
                    self.w.set_stage(token, Stage::Received);
                    self.e.fail(&mut self.w, token, Fault::Resources);
                }
                return;
            }
        }
        self.command(token);
    }

    /// Hands the command `token` to the engine and does what it says.
    fn command(&mut self, token: u32) {
        match self.e.command(&mut self.w, token) {
            Step::Fetch(f) => self.fetch(f),
            Step::Held(token) => {
                let cid = self.w.sqe(&token).cid();
                if let Some(old) = self.w.held.insert(cid, token) {
                    // A held command reusing the CID of another: answer the older one.
                    self.e.fail(&mut self.w, old, Fault::CommandIdConflict);
                }
            }
            Step::Answered | Step::Started | Step::Close => {}
        }
    }

    /// Fetches a write's data from the host's keyed buffer by RDMA READ.
    fn fetch(&mut self, f: Fetch<u32>) {
        let token = *f.tag();
        let len = f.len();
        // queue.rs accepted a keyed descriptor of exactly this length.
        let Some(remote) = keyed_remote(&self.w.sqe(&token).dptr) else {
            self.e.fetch_failed(&mut self.w, f, Fault::SglType);
            return;
        };
        let pd = Arc::clone(self.w.q.pd());
        let buf = match self.w.pool.get(&pd, len) {
            Ok(b) => b,
            Err(e) => {
                log_limited!(
                    LogKind::Transport,
                    warn!(error = %e, "cannot register a buffer for write data")
                );
                self.e.fetch_failed(&mut self.w, f, Fault::Resources);
                return;
            }
        };
        self.w.set_stage(token, Stage::HostData(f));
        if let Err((e, buf)) = self.w.q.read(buf, len, remote, u64::from(token)) {
            debug!(error = %e, "cannot fetch write data");
            self.w.pool.put(buf);
            if let Some(Stage::HostData(f)) = self.w.set_stage(token, Stage::Received) {
                self.e.fetch_failed(&mut self.w, f, Fault::SglLength);
            }
        }
    }

    fn read_done(&mut self, token: u32, buf: Registered<IoBuf>, ok: bool) {
        if !ok {
            // The queue pair is in the error state: nothing more can be sent.
            self.w.pool.put(buf);
            let why = self.w.q.failed().unwrap_or("RDMA READ failed").to_string();
            self.e.close(Closed::Transport(why));
            if let Some(cmd) = self.w.take_cmd(token) {
                self.w.release(cmd.stage);
            }
            return;
        }
        match self.w.set_stage(token, Stage::Received) {
            Some(Stage::AdminData) => {
                self.w.set_stage(token, Stage::Fetched(buf));
                self.command(token);
            }
            Some(Stage::HostData(f)) => {
                let (b, reg) = buf.detach();
                self.w.set_stage(token, Stage::Buffer(reg));
                let _ = self.e.fetched(&mut self.w, f, b);
            }
            other => {
                self.w.pool.put(buf);
                if let Some(stage) = other {
                    self.w.set_stage(token, stage);
                }
            }
        }
    }
}

impl Wire {
    fn alloc_token(&mut self, cmd: Cmd) -> u32 {
        if let Some(t) = self.free_tokens.pop() {
            self.cmds[t as usize] = Some(cmd);
            t
        } else {
            self.cmds.push(Some(cmd));
            (self.cmds.len() - 1) as u32
        }
    }

    fn cmd(&self, token: u32) -> Option<&Cmd> {
        self.cmds.get(token as usize)?.as_ref()
    }

    fn take_cmd(&mut self, token: u32) -> Option<Cmd> {
        let c = self.cmds.get_mut(token as usize)?.take()?;
        self.free_tokens.push(token);
        Some(c)
    }

    /// Sets the stage of command `token`; returns the one it had (None: no such command).
    fn set_stage(&mut self, token: u32, stage: Stage) -> Option<Stage> {
        let cmd = self.cmds.get_mut(token as usize)?.as_mut()?;
        Some(std::mem::replace(&mut cmd.stage, stage))
    }

    /// Gives back what a command's stage holds.
    fn release(&mut self, stage: Stage) {
        if let Stage::Fetched(b) = stage {
            self.pool.put(b);
        }
    }

    /// The registered form of a buffer handed back by the engine: joined with the
    /// registration its command kept (the backend hands back the same buffer), registered
    /// again otherwise.
    fn registered(&mut self, token: u32, buf: IoBuf) -> Option<Registered<IoBuf>> {
        match self.set_stage(token, Stage::Received) {
            Some(Stage::Buffer(reg)) => match reg.attach(buf) {
                Ok(b) => Some(b),
                Err((_, b)) => self.q.pd().register(b, Access::LOCAL_WRITE).ok(),
            },
            Some(other) => {
                self.set_stage(token, other);
                None
            }
            None => None,
        }
    }

    /// The one place a completion leaves: re-posts the command's receive buffer, writes the
    /// data if any, and sends the CQE.
    fn send(&mut self, token: u32, cqe: &Cqe, data: Option<DataOut<IoBuf>>) {
        let Some(cmd) = self.take_cmd(token) else {
            if let Some(d) = data {
                self.pool.put(d.buf);
            }
            return;
        };
        let Cmd { slot, sqe, stage } = cmd;
        self.release(stage);
        let invalidate = invalidate_key(&sqe.dptr);
        if let Err(e) = self.q.respond(
            slot,
            &cqe.to_array(),
            data,
            invalidate,
            u64::from(cqe.cid()),
        ) {
            debug!(error = %e, cid = cqe.cid(), "cannot send the completion");
            self.broken.get_or_insert(e.to_string());
        }
    }
}

impl Transport for Wire {
    type Tag = u32;

    fn sqe<'a>(&'a self, token: &'a u32) -> &'a Sqe {
        self.cmd(*token).map_or(&self.blank, |c| &c.sqe)
    }

    fn capsule(&self, token: &u32) -> &[u8] {
        match self.cmd(*token) {
            Some(Cmd {
                stage: Stage::Fetched(b),
                ..
            }) => &b.get()[..],
            Some(c) => self.q.message(&c.slot).get(64..).unwrap_or(&[]),
            None => &[],
        }
    }

    fn buffer(&mut self, token: &u32, len: usize, from_capsule: bool) -> Result<IoBuf, Fault> {
        let pd = Arc::clone(self.q.pd());
        let mut b = match self.pool.get(&pd, len) {
            Ok(b) => b,
            Err(e) => {
                log_limited!(
                    LogKind::Transport,
                    warn!(error = %e, "cannot register a data buffer")
                );
                return Err(Fault::Resources);
            }
        };
        if from_capsule {
            let icd = self.capsule(token);
            let n = icd.len().min(len);
            b.bytes_mut()[..n].copy_from_slice(&icd[..n]);
        }
        let (b, reg) = b.detach();
        self.set_stage(*token, Stage::Buffer(reg));
        Ok(b)
    }

    /// Data (Identify, log pages...) goes by RDMA WRITE to the host's keyed buffer, posted
    /// with the completion's SEND.
    fn respond(&mut self, token: u32, data: &[u8], cqe: &Cqe) -> Result<(), Refused<u32>> {
        if data.is_empty() {
            self.send(token, cqe, None);
            return Ok(());
        }
        let Some(cmd) = self.cmd(token) else {
            return Ok(());
        };
        let Some(remote) = keyed_remote(&cmd.sqe.dptr).filter(|r| r.len as usize >= data.len())
        else {
            return Err((token, Fault::SglType));
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
                self.send(token, cqe, Some(out));
                Ok(())
            }
            Err(e) => {
                log_limited!(
                    LogKind::Transport,
                    warn!(error = %e, "cannot register a buffer for command data")
                );
                Err((token, Fault::Resources))
            }
        }
    }

    /// A read's data goes by RDMA WRITE to the host's keyed buffer, posted with the
    /// completion's SEND.
    fn send_read(
        &mut self,
        token: u32,
        buf: IoBuf,
        cqe: &Cqe,
        _in_data: bool,
    ) -> Result<(), Refused<u32>> {
        let len = buf.len();
        let Some(b) = self.registered(token, buf) else {
            return Err((token, Fault::Resources));
        };
        let Some(remote) = self.cmd(token).and_then(|c| keyed_remote(&c.sqe.dptr)) else {
            self.pool.put(b);
            return Err((token, Fault::SglType));
        };
        self.send(
            token,
            cqe,
            Some(DataOut {
                buf: b,
                len,
                remote,
            }),
        );
        Ok(())
    }

    fn recycle(&mut self, token: &u32, buf: IoBuf) {
        if let Some(b) = self.registered(*token, buf) {
            self.pool.put(b);
        }
    }

    /// Completes a held command (Asynchronous Event Request) with an event's CQE.
    fn complete_held(&mut self, cqe: &Cqe) {
        match self.held.remove(&cqe.cid()) {
            Some(token) => self.send(token, cqe, None),
            None => debug!(cid = cqe.cid(), "event for a command that is not held"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::target;

    #[test]
    fn keyed_descriptors_name_host_memory_and_the_key_to_invalidate() {
        let w = SglDescriptor::keyed(0x10_0000, 8192, 0xabcd, true);
        assert_eq!(
            keyed_remote(&w).map(|r| (r.addr, r.len, r.rkey)),
            Some((0x10_0000, 8192, 0xabcd))
        );
        assert_eq!(invalidate_key(&w), Some(0xabcd));
        // Address subtype: no invalidation.
        let r = SglDescriptor::keyed(0x20_0000, 4096, 0x55, false);
        assert_eq!(invalidate_key(&r), None);
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
