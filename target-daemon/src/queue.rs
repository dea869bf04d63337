//! Transport-independent queue logic: Connect, properties, dispatch to the controller's admin
//! command set, and validation of I/O commands into [`IoRequest`]s for the transport to run.
//!
//! A transport (TCP today) turns bytes into `(Sqe, in-capsule data)` pairs, calls
//! [`QueueState::submit`], moves data as the returned [`Submit`] says, and sends exactly one
//! completion per command built by [`QueueState::completion`].

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use nvme_auth::tls::PskIdentity;
use nvme_auth::{CtrlAction, CtrlEvent, DhWork};
use nvme_spec::auth::AuthCommand;
use nvme_spec::command::{AdminCommand, FabricsCommand, IoCommand, ReadWrite};
use nvme_spec::fabrics::{
    CONNECT_AUTHREQ_ATR, CONNECT_DATA_CNTLID_OFFSET, CONNECT_DATA_HOSTNQN_OFFSET,
    CONNECT_DATA_SUBNQN_OFFSET, ConnectData, DISCOVERY_NQN, connect_invalid_param_dw0,
};
use nvme_spec::queue::{sgl_subtype, sgl_type};
use nvme_spec::status::{generic, specific};
use nvme_spec::{Cqe, Sqe, Status};
use tracing::{debug, info, warn};

use crate::auth::{Answer, MAX_SEND_LEN, QueueAuth, failure_reason};
use crate::config::Transport;
use crate::controller::{AdminReply, Controller, ControllerKind, EventReceiver, QueueOrigin};
use crate::log_limited;
use crate::metrics::QueueMetrics;
pub use crate::op::{DataSource, IoOp};
use crate::ratelimit::LogKind;
use crate::reservation::Access;
use crate::subsystem::{Namespace, Subsystem};
use crate::target::Target;

/// Byte offset of QID in a Connect SQE (for invalid-parameter answers).
const SQE_QID_OFFSET: u16 = 42;
/// Byte offset of SQSIZE in a Connect SQE.
const SQE_SQSIZE_OFFSET: u16 = 44;

/// How a transport carries command data that is not in the capsule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostSgl {
    /// Transport SGL data blocks (NVMe/TCP: R2T/H2CData and C2HData).
    Transport,
    /// Keyed SGL data blocks (NVMe/RDMA: RDMA READ and RDMA WRITE with the host's key).
    Keyed,
}

/// A validated data-plane request.
pub struct IoRequest {
    /// Command identifier.
    pub cid: u16,
    /// Namespace (None only for a Flush of every namespace).
    pub ns: Option<QueueNs>,
    /// What to do.
    pub op: IoOp,
    /// When the command arrived (its latency runs from here).
    pub arrived: Instant,
}

/// A queue's own handle on a namespace. Cloning it for each command touches a count that only
/// this queue uses, where cloning the namespace's `Arc` would bump a count every reactor
/// serving the namespace shares (a cache line bouncing between their cores on every command).
#[derive(Clone)]
pub struct QueueNs(Arc<NsHandle>);

/// The allocation a [`QueueNs`] counts on: one per queue and namespace.
struct NsHandle {
    ns: Arc<Namespace>,
}

impl QueueNs {
    /// A new handle on `ns` (made when a queue takes a snapshot of its namespaces).
    pub fn new(ns: &Arc<Namespace>) -> QueueNs {
        QueueNs(Arc::new(NsHandle { ns: Arc::clone(ns) }))
    }
}

impl std::ops::Deref for QueueNs {
    type Target = Namespace;

    fn deref(&self) -> &Namespace {
        &self.0.ns
    }
}

/// What the transport must do with a submitted command.
pub enum Submit {
    /// Send this completion.
    Complete(Cqe),
    /// Send `data` to the host, then the completion.
    CompleteWithData(Vec<u8>, Cqe),
    /// Send this completion, then close the queue (Disconnect).
    CompleteAndClose(Cqe),
    /// Nothing now: the command completes later through the controller's event channel.
    Held,
    /// No answer: the queue's controller is gone (its admin queue closed, its keep-alive
    /// timer ran out, the target is shutting down), so the queue closes without answering.
    /// The host sends the command again in its next association; an error status with Do Not
    /// Retry would fail it instead.
    Abandon,
    /// Run this data-plane request.
    Io(IoRequest),
}

/// How often one queue's received commands may restart its controller's keep-alive timer.
pub const TRAFFIC_KEEP_ALIVE: Duration = Duration::from_millis(100);

/// Per-queue (per-connection) state.
pub struct QueueState {
    /// The target.
    pub target: Arc<Target>,
    /// Addresses of the connection.
    pub origin: QueueOrigin,
    /// Queue ID once connected.
    pub qid: u16,
    /// Submission queue size once connected.
    pub sqsize: u32,
    /// The controller once connected.
    pub ctrl: Option<Arc<Controller>>,
    /// Whether the host disabled SQ flow control at Connect.
    pub sq_flow_disabled: bool,
    /// Asynchronous completions for an admin queue (taken by the transport after Connect).
    pub events: Option<EventReceiver>,
    /// The queue's counters, once connected to an NVM subsystem.
    pub metrics: Option<QueueMetrics>,
    /// In-band authentication, when the host must authenticate this queue.
    pub(crate) auth: Option<QueueAuth>,
    /// When the transport's current batch of received data arrived ([`QueueState::tick`]):
    /// the arrival time of every command in it, so that a batch costs one clock read.
    clock: Instant,
    /// When this queue last restarted its controller's keep-alive timer (traffic-based keep
    /// alive: received commands count as keep alives, at most every [`TRAFFIC_KEEP_ALIVE`]).
    keep_alive_noted: Instant,
    /// Whether the connection is TLS, and the host and subsystem NQNs of the PSK identity it
    /// authenticated with.
    tls: Option<Option<PskIdentity>>,
    host_sgl: HostSgl,
    discovery_only: bool,
    sqhd: u32,
    mdts_bytes: usize,
    /// The namespaces the controller's host sees, each with the status its I/O is refused
    /// with on this queue's listener (ANA), as of a subsystem namespace generation and an
    /// ANA generation: refreshed when either moves, so looking a namespace up per command
    /// takes no lock.
    namespaces: Option<NamespaceSnapshot>,
}

impl Drop for QueueState {
    fn drop(&mut self) {
        if self.qid != 0
            && let Some(ctrl) = &self.ctrl
        {
            ctrl.release_queue(self.qid);
        }
    }
}

/// A queue's view of its namespaces: the generations it was taken at and, by NSID, each
/// namespace its host sees and the ANA status that refuses its I/O here, if any.
type NamespaceSnapshot = ((u64, u64), BTreeMap<u32, (QueueNs, Option<Status>)>);

fn status_cqe(cid: u16, status: Status) -> Submit {
    Submit::Complete(Cqe::new(cid, status, 0))
}

impl QueueState {
    /// A new, unconnected queue.
    pub fn new(target: Arc<Target>, origin: QueueOrigin) -> Self {
        let mdts_bytes = target.settings.mdts_kib as usize * 1024;
        QueueState {
            target,
            origin,
            qid: 0,
            sqsize: 0,
            ctrl: None,
            sq_flow_disabled: false,
            events: None,
            metrics: None,
            auth: None,
            clock: Instant::now(),
            keep_alive_noted: Instant::now(),
            tls: None,
            host_sgl: HostSgl::Transport,
            discovery_only: false,
            sqhd: 0,
            mdts_bytes,
            namespaces: None,
        }
    }

    /// Sets the kind of SGL data block the transport takes for data outside the capsule
    /// (NVMe/TCP's transport SGLs by default).
    pub fn with_host_sgl(mut self, host_sgl: HostSgl) -> Self {
        self.host_sgl = host_sgl;
        self
    }

    /// Notes which kind of listener accepted the connection: on a dedicated discovery
    /// listener, Connect is accepted for the discovery subsystem only.
    pub fn on_listener(mut self, transport: Transport) -> Self {
        self.discovery_only = self
            .target
            .is_discovery_only_listener(transport, self.origin.local);
        self
    }

    /// Notes a connection's TLS session: Connect then accepts only the host and subsystem of
    /// the PSK identity, and a host with a TLS PSK only over TLS.
    pub fn with_tls(mut self, tls: bool, identity: Option<&str>) -> Self {
        if tls {
            self.tls = Some(identity.and_then(PskIdentity::parse));
        }
        self
    }

    /// Whether [`QueueState::submit`] reads this command's data from the host itself (Connect
    /// and other admin or fabrics commands that transfer data to the controller). A
    /// transport that fetches data from the host (RDMA READ) must then fetch it first and
    /// pass it as in-capsule data. I/O writes are not among them: they come back as
    /// [`Submit::Io`] with [`DataSource::Host`].
    pub fn wants_data_at_submit(&self, sqe: &Sqe) -> bool {
        // Data direction: bits 1:0 of the opcode, or of the fabrics command type.
        let direction = if sqe.opcode == nvme_spec::opcode::FABRICS {
            sqe.fctype() & 0b11
        } else {
            sqe.opcode & 0b11
        };
        direction == 0b01
            && (self.ctrl.is_none() || self.qid == 0 || sqe.opcode == nvme_spec::opcode::FABRICS)
    }

    /// Largest data transfer accepted, in bytes.
    pub fn mdts_bytes(&self) -> usize {
        self.mdts_bytes
    }

    /// Builds the completion for `cid`, with the SQ head pointer and queue ID filled in.
    pub fn completion(&self, cid: u16, status: Status, dw0: u32) -> Cqe {
        let mut cqe = Cqe::new(cid, status, dw0);
        cqe.sqhd.set(self.sqhd as u16);
        cqe.sqid.set(self.qid);
        cqe
    }

    /// Records a failed data-plane command (error log, counters).
    pub fn record_error(&self, sqe: &Sqe, status: Status, lba: u64) {
        if let Some(c) = &self.ctrl {
            c.log_error(self.qid, sqe, status, lba);
        }
    }

    /// Handles one command capsule.
    pub fn submit(&mut self, sqe: &Sqe, icd: &[u8]) -> Submit {
        let r = self.submit_uncounted(sqe, icd);
        if let Some(m) = &mut self.metrics {
            let status = match &r {
                Submit::Complete(c)
                | Submit::CompleteWithData(_, c)
                | Submit::CompleteAndClose(c) => Some(c.status()),
                Submit::Held | Submit::Abandon | Submit::Io(_) => None,
            };
            match (m.admin(), status) {
                (Some(a), status) => a.record(sqe.opcode, status),
                // I/O requests are counted when they finish.
                (None, Some(status)) => {
                    // Fabrics commands name no namespace.
                    let nsid = if sqe.opcode == nvme_spec::opcode::FABRICS {
                        0
                    } else {
                        sqe.nsid.get()
                    };
                    if let Some(c) = m.io(nsid) {
                        c.record_answered(sqe.opcode, status);
                    }
                }
                (None, None) => {}
            }
        }
        r
    }

    /// Notes that the transport received a new batch of data: the commands in it arrived now,
    /// and (traffic-based keep alive, CTRATT.TBKAS) they keep the controller alive as a Keep
    /// Alive command would. The controller's timer is restarted at most every
    /// [`TRAFFIC_KEEP_ALIVE`] per queue, so a busy queue writes it rarely.
    #[inline]
    pub fn tick(&mut self) {
        self.clock = Instant::now();
        if let Some(ctrl) = &self.ctrl
            && self.clock.saturating_duration_since(self.keep_alive_noted) >= TRAFFIC_KEEP_ALIVE
        {
            self.keep_alive_noted = self.clock;
            ctrl.keep_alive();
        }
    }

    /// Counts a request completed inline, within the batch it arrived in (so its latency is
    /// counted as zero: no clock is read per command).
    #[inline]
    pub fn record_io(&mut self, req: &IoRequest, status: Status) {
        if let Some(m) = &mut self.metrics {
            let nsid = req.ns.as_ref().map_or(0, |ns| ns.nsid);
            if let Some(c) = m.io(nsid) {
                let ns = self.clock.saturating_duration_since(req.arrived).as_nanos() as u64;
                c.record(&req.op, status, ns);
            }
        }
    }

    fn submit_uncounted(&mut self, sqe: &Sqe, icd: &[u8]) -> Submit {
        if self.sqsize > 0 {
            self.sqhd = (self.sqhd + 1) % self.sqsize;
        }
        let cid = sqe.cid();
        let seq_error = || {
            status_cqe(
                cid,
                Status::generic(generic::COMMAND_SEQUENCE_ERROR).with_dnr(),
            )
        };
        // Taken for the command and put back: cloning the Arc would bump a count that every
        // reactor serving the controller's queues shares.
        // Fused operations (Compare and Write) are not supported.
        if sqe.fuse() != 0 {
            return status_cqe(cid, Status::generic(generic::INVALID_FIELD).with_dnr());
        }
        let Some(ctrl) = self.ctrl.take() else {
            return match (sqe.opcode, FabricsCommand::parse(sqe)) {
                (nvme_spec::opcode::FABRICS, FabricsCommand::Connect(c)) => {
                    self.connect(sqe, c, icd)
                }
                _ => seq_error(),
            };
        };
        let r = self.submit_to(&ctrl, sqe, icd);
        self.ctrl = Some(ctrl);
        r
    }

    /// [`submit_uncounted`](Self::submit_uncounted) on a queue with a controller (taken out
    /// of `self.ctrl` for the call).
    fn submit_to(&mut self, ctrl: &Arc<Controller>, sqe: &Sqe, icd: &[u8]) -> Submit {
        let cid = sqe.cid();
        if ctrl.is_torn_down() {
            return Submit::Abandon;
        }
        if let Some(reply) = self.auth_gate(ctrl, sqe, icd) {
            return reply;
        }
        if self.qid == 0 {
            match AdminCommand::parse(sqe) {
                AdminCommand::Fabrics(f) => self.fabrics(ctrl, cid, f),
                cmd => match ctrl.admin(&self.target, self.origin, sqe, cmd) {
                    AdminReply::Held => Submit::Held,
                    AdminReply::Complete { status, dw0, data } => {
                        if !status.is_success() {
                            ctrl.log_error(0, sqe, status, 0);
                        }
                        let cqe = self.completion(cid, status, dw0);
                        match data {
                            Some(mut d) if status.is_success() => {
                                // Never send more than the host's buffer holds.
                                let room = sqe.dptr.data_length() as usize;
                                d.truncate(room);
                                if d.is_empty() {
                                    Submit::Complete(cqe)
                                } else {
                                    Submit::CompleteWithData(d, cqe)
                                }
                            }
                            _ => Submit::Complete(cqe),
                        }
                    }
                },
            }
        } else {
            match IoCommand::parse(sqe) {
                IoCommand::Fabrics(f) => self.fabrics(ctrl, cid, f),
                cmd => {
                    self.refresh_namespaces(ctrl);
                    match self.validate_io(ctrl, sqe, cmd, icd) {
                        Ok(req) => Submit::Io(req),
                        Err(status) => {
                            ctrl.log_error(self.qid, sqe, status, 0);
                            Submit::Complete(self.completion(cid, status, 0))
                        }
                    }
                }
            }
        }
    }

    fn fabrics(&mut self, ctrl: &Arc<Controller>, cid: u16, f: FabricsCommand) -> Submit {
        let invalid_field = Status::generic(generic::INVALID_FIELD).with_dnr();
        match f {
            FabricsCommand::Connect(_) => status_cqe(
                cid,
                Status::generic(generic::COMMAND_SEQUENCE_ERROR).with_dnr(),
            ),
            FabricsCommand::PropertyGet { size8, offset } if self.qid == 0 => {
                match ctrl.property_get(&self.target, offset, size8) {
                    Ok(v) => {
                        let mut cqe = self.completion(cid, Status::SUCCESS, v as u32);
                        cqe.dw1.set((v >> 32) as u32);
                        Submit::Complete(cqe)
                    }
                    Err(s) => Submit::Complete(self.completion(cid, s, 0)),
                }
            }
            FabricsCommand::PropertySet {
                size8,
                offset,
                value,
            } if self.qid == 0 => match ctrl.property_set(offset, size8, value) {
                Ok(true) => {
                    debug!(
                        cntlid = ctrl.cntlid,
                        hostnqn = %ctrl.hostnqn,
                        peer = %self.origin.peer,
                        "controller shutdown requested by host: flushing"
                    );
                    // Completes once every namespace is flushed, before the host sees the
                    // shutdown finish.
                    Submit::Io(IoRequest {
                        cid,
                        ns: None,
                        op: IoOp::Flush,
                        arrived: self.clock,
                    })
                }
                Ok(false) => Submit::Complete(self.completion(cid, Status::SUCCESS, 0)),
                Err(s) => Submit::Complete(self.completion(cid, s, 0)),
            },
            FabricsCommand::Disconnect if self.qid != 0 => {
                Submit::CompleteAndClose(self.completion(cid, Status::SUCCESS, 0))
            }
            FabricsCommand::Unknown(_) | FabricsCommand::AuthSend | FabricsCommand::AuthReceive => {
                Submit::Complete(self.completion(
                    cid,
                    Status::generic(generic::INVALID_OPCODE).with_dnr(),
                    0,
                ))
            }
            _ => Submit::Complete(self.completion(cid, invalid_field, 0)),
        }
    }

    fn connect(&mut self, sqe: &Sqe, c: nvme_spec::command::Connect, icd: &[u8]) -> Submit {
        let cid = sqe.cid();
        let t = Arc::clone(&self.target);
        let peer = self.origin.peer;
        if c.recfmt != 0 {
            return status_cqe(
                cid,
                Status::specific(specific::CONNECT_INCOMPATIBLE_FORMAT).with_dnr(),
            );
        }
        let Some(data) = ConnectData::parse(icd) else {
            return status_cqe(
                cid,
                Status::generic(generic::DATA_SGL_LENGTH_INVALID).with_dnr(),
            );
        };
        let subnqn = data.subnqn();
        let hostnqn = data.hostnqn();
        let on_target = subnqn == DISCOVERY_NQN || t.subsystem(&subnqn).is_some();
        // Counted, and logged within the log limits with both NQNs and whether the subsystem
        // is on this target.
        let refused = |reason: &'static str, why: &str| {
            t.metrics.note_connect_refused(reason);
            log_limited!(
                LogKind::ConnectRefused,
                warn!(hostnqn = ?hostnqn, %peer, subnqn = ?subnqn, subsystem_on_target = on_target, qid = c.qid, "connect rejected: {why}")
            );
        };
        let invalid_param = |reason: &'static str, why: &str, in_data: bool, off: u16| {
            let field = if in_data { "connect data" } else { "command" };
            refused(
                reason,
                &format!("{why} (invalid parameter at {field} byte {off})"),
            );
            Submit::Complete(Cqe::new(
                cid,
                Status::specific(specific::CONNECT_INVALID_PARAMETERS).with_dnr(),
                connect_invalid_param_dw0(in_data, off),
            ))
        };
        // An empty host NQN is accepted as Linux nvmet and SPDK accept it (SPDK's tools send
        // none unless told): only subsystems that allow any host will take such a host.
        if !hostnqn.is_empty() && !crate::config::valid_nqn(&hostnqn) {
            return invalid_param(
                "invalid_host_nqn",
                "the host NQN is not a valid NQN",
                true,
                CONNECT_DATA_HOSTNQN_OFFSET,
            );
        }
        let max_depth = u32::from(t.settings.max_queue_depth);
        if c.sqsize < 2 || c.sqsize > max_depth {
            return invalid_param(
                "invalid_parameter",
                &format!("queue size {} outside 2..={max_depth}", c.sqsize),
                false,
                SQE_SQSIZE_OFFSET,
            );
        }
        // A host that asks for no keep alive still gets one, so stale controllers go away.
        let kato = if c.kato_ms == 0 {
            t.settings.default_kato_ms
        } else {
            c.kato_ms
        };
        if subnqn == DISCOVERY_NQN {
            if c.qid != 0 {
                return invalid_param(
                    "invalid_parameter",
                    "an I/O queue for the discovery controller",
                    false,
                    SQE_QID_OFFSET,
                );
            }
            let cntlid = t.alloc_discovery_cntlid();
            let (ctrl, events) = Controller::new(
                cntlid,
                ControllerKind::Discovery,
                hostnqn.clone(),
                data.hostid,
                self.origin,
                c.sqsize,
                kato,
            );
            t.add_discovery_controller(&ctrl);
            log_limited!(
                LogKind::Connect,
                info!(%hostnqn, %peer, cntlid, "discovery controller connected")
            );
            return self.connected(ctrl, Some(events), c, cid);
        }
        if self.discovery_only {
            return invalid_param(
                "discovery_only",
                &format!(
                    "this listener serves discovery only ({})",
                    self.origin.local
                ),
                true,
                CONNECT_DATA_SUBNQN_OFFSET,
            );
        }
        let Some(subsys) = t.subsystem(&subnqn) else {
            return invalid_param(
                "unknown_subsystem",
                "the subsystem is not on this target",
                true,
                CONNECT_DATA_SUBNQN_OFFSET,
            );
        };
        let tls_mismatch = match &self.tls {
            None => subsys.has_tls_psk(&hostnqn),
            Some(id) => !id
                .as_ref()
                .is_some_and(|id| id.hostnqn == hostnqn && id.subnqn == subnqn),
        };
        if tls_mismatch {
            let why = if self.tls.is_none() {
                "this host has a TLS PSK and must connect over TLS"
            } else {
                "the host or subsystem NQN is not the TLS PSK identity's"
            };
            refused("tls_mismatch", why);
            return Submit::Complete(Cqe::new(
                cid,
                Status::specific(specific::CONNECT_INVALID_HOST).with_dnr(),
                connect_invalid_param_dw0(true, CONNECT_DATA_HOSTNQN_OFFSET),
            ));
        }
        if !subsys.host_allowed(&hostnqn) {
            refused(
                "host_not_allowed",
                "host not allowed on the subsystem (invalid host)",
            );
            return Submit::Complete(Cqe::new(
                cid,
                Status::specific(specific::CONNECT_INVALID_HOST).with_dnr(),
                connect_invalid_param_dw0(true, CONNECT_DATA_HOSTNQN_OFFSET),
            ));
        }
        if c.qid == 0 {
            if data.cntlid.get() != 0xFFFF {
                return invalid_param(
                    "invalid_parameter",
                    "an admin queue Connect must ask for a dynamic controller (CNTLID FFFFh)",
                    true,
                    CONNECT_DATA_CNTLID_OFFSET,
                );
            }
            let Some(cntlid) = subsys.alloc_cntlid() else {
                return status_cqe(cid, Status::specific(specific::CONNECT_CONTROLLER_BUSY));
            };
            let (ctrl, events) = Controller::new(
                cntlid,
                ControllerKind::Io(Arc::clone(&subsys)),
                hostnqn.clone(),
                data.hostid,
                self.origin,
                c.sqsize,
                kato,
            );
            subsys.add_controller(Arc::clone(&ctrl));
            log_limited!(
                LogKind::Connect,
                info!(%hostnqn, %peer, subnqn = %subsys.nqn, cntlid, kato_ms = kato, "controller connected")
            );
            return self.connected(ctrl, Some(events), c, cid);
        }
        let cntlid = data.cntlid.get();
        let Some(ctrl) = subsys.controller(cntlid) else {
            return invalid_param(
                "unknown_controller",
                &format!("no controller {cntlid} on the subsystem"),
                true,
                CONNECT_DATA_CNTLID_OFFSET,
            );
        };
        if ctrl.hostnqn != hostnqn {
            return invalid_param(
                "invalid_parameter",
                &format!("controller {cntlid} belongs to another host"),
                true,
                CONNECT_DATA_HOSTNQN_OFFSET,
            );
        }
        if !ctrl.is_ready() {
            return status_cqe(
                cid,
                Status::generic(generic::COMMAND_SEQUENCE_ERROR).with_dnr(),
            );
        }
        if c.qid > ctrl.io_queues() {
            return invalid_param(
                "invalid_parameter",
                &format!("queue {} past the {} granted", c.qid, ctrl.io_queues()),
                false,
                SQE_QID_OFFSET,
            );
        }
        if !ctrl.claim_queue(c.qid) {
            // As Linux nvmet: a queue ID already connected is a command sequence error.
            info!(%hostnqn, %peer, cntlid, qid = c.qid, "connect rejected: I/O queue already connected");
            return status_cqe(
                cid,
                Status::generic(generic::COMMAND_SEQUENCE_ERROR).with_dnr(),
            );
        }
        debug!(%hostnqn, %peer, cntlid, qid = c.qid, sqsize = c.sqsize, "I/O queue connected");
        self.connected(ctrl, None, c, cid)
    }

    fn connected(
        &mut self,
        ctrl: Arc<Controller>,
        events: Option<EventReceiver>,
        c: nvme_spec::command::Connect,
        cid: u16,
    ) -> Submit {
        self.qid = c.qid;
        self.sqsize = c.sqsize;
        self.sqhd = 1 % c.sqsize;
        self.sq_flow_disabled = c.sq_flow_control_disabled();
        if c.qid == 0 && self.host_sgl == HostSgl::Keyed {
            ctrl.set_keyed_sgls();
        }
        self.events = events;
        let dw0 = u32::from(ctrl.cntlid) | self.require_auth(&ctrl);
        self.metrics = ctrl
            .subsystem()
            .map(|s| QueueMetrics::new(Arc::<Subsystem>::clone(s), c.qid));
        self.ctrl = Some(ctrl);
        Submit::Complete(self.completion(cid, Status::SUCCESS, dw0))
    }

    /// Brings the snapshot of the controller's namespaces up to date: one atomic load when
    /// nothing changed.
    fn refresh_namespaces(&mut self, ctrl: &Controller) {
        let Some(s) = ctrl.subsystem() else { return };
        let generation = (s.namespace_generation(), self.target.ana.generation());
        if self
            .namespaces
            .as_ref()
            .is_none_or(|(g, _)| *g != generation)
        {
            // Read the generations before the maps: a change in between is seen next time.
            let ana = self.target.ana.table();
            let map = s
                .namespaces()
                .iter()
                .filter(|(_, ns)| ns.visible_to(&ctrl.hostnqn))
                .map(|(&nsid, ns)| {
                    ns.reservations
                        .bind(self.target.settings.state_dir.as_deref(), &ns.nguid);
                    let refused = ana.state(self.origin.local, ns.ana_group).io_status();
                    (nsid, (QueueNs::new(ns), refused))
                })
                .collect();
            self.namespaces = Some((generation, map));
        }
    }

    /// Drops the snapshot of the namespaces (the next I/O command takes a new one), so that
    /// a removed namespace is not held by an idle queue.
    pub fn forget_namespaces(&mut self) {
        self.namespaces = None;
    }

    /// The namespace `nsid` for an I/O command: Invalid Namespace when the host does not see
    /// it, the ANA status when its group is not accessible through this queue's listener.
    fn namespace(&self, nsid: u32) -> Result<QueueNs, Status> {
        match self.namespaces.as_ref().and_then(|(_, m)| m.get(&nsid)) {
            None => Err(Status::generic(generic::INVALID_NAMESPACE).with_dnr()),
            Some((_, Some(refused))) => Err(*refused),
            Some((ns, None)) => Ok(ns.clone()),
        }
    }

    fn range(&self, ns: &Namespace, rw: &ReadWrite) -> Result<(), Status> {
        match rw.slba.checked_add(u64::from(rw.nlb)) {
            Some(end) if end <= ns.blocks => Ok(()),
            _ => Err(Status::generic(generic::LBA_OUT_OF_RANGE).with_dnr()),
        }
    }

    /// Checks the data pointer of a command moving `len` bytes; returns where host data is.
    fn data_source(
        &self,
        sqe: &Sqe,
        len: usize,
        icd: &[u8],
        to_host: bool,
    ) -> Result<DataSource, Status> {
        let sgl = sqe.dptr;
        // Fabrics carry SGLs only: PRPs (0) and the reserved value (3) are refused.
        if !matches!(sqe.psdt(), 1 | 2) {
            return Err(Status::generic(generic::INVALID_FIELD).with_dnr());
        }
        if sgl.data_length() as usize != len {
            return Err(Status::generic(generic::DATA_SGL_LENGTH_INVALID).with_dnr());
        }
        match (sgl.desc_type(), sgl.subtype()) {
            (sgl_type::DATA_BLOCK, sgl_subtype::OFFSET) if !to_host => {
                if sgl.address.get() != 0 || icd.len() != len {
                    return Err(Status::generic(generic::SGL_OFFSET_INVALID).with_dnr());
                }
                Ok(DataSource::InCapsule)
            }
            (sgl_type::TRANSPORT_DATA_BLOCK, sgl_subtype::TRANSPORT_A)
                if self.host_sgl == HostSgl::Transport =>
            {
                if !icd.is_empty() {
                    return Err(Status::generic(generic::INVALID_FIELD).with_dnr());
                }
                Ok(DataSource::Host)
            }
            (sgl_type::KEYED_DATA_BLOCK, sgl_subtype::ADDRESS | sgl_subtype::INVALIDATE)
                if self.host_sgl == HostSgl::Keyed =>
            {
                if !icd.is_empty() {
                    return Err(Status::generic(generic::INVALID_FIELD).with_dnr());
                }
                Ok(DataSource::Host)
            }
            _ => Err(Status::generic(generic::SGL_TYPE_INVALID).with_dnr()),
        }
    }

    fn validate_io(
        &self,
        ctrl: &Controller,
        sqe: &Sqe,
        cmd: IoCommand,
        icd: &[u8],
    ) -> Result<IoRequest, Status> {
        let cid = sqe.cid();
        if !ctrl.is_ready() {
            return Err(Status::generic(generic::COMMAND_SEQUENCE_ERROR).with_dnr());
        }
        let arrived = self.clock;
        let req = |ns, op| IoRequest {
            cid,
            ns,
            op,
            arrived,
        };
        match cmd {
            IoCommand::Read(rw) | IoCommand::Write(rw) => {
                let write = matches!(cmd, IoCommand::Write(_));
                let ns = self.namespace(rw.nsid)?;
                let access = if write { Access::Write } else { Access::Read };
                ns.reservations.check(&ctrl.hostid, access)?;
                self.range(&ns, &rw)?;
                let len = (rw.nlb as usize) << ns.block_shift;
                if len > self.mdts_bytes {
                    return Err(Status::generic(generic::INVALID_FIELD).with_dnr());
                }
                let src = self.data_source(sqe, len, icd, !write)?;
                let op = if write {
                    IoOp::Write {
                        lba: rw.slba,
                        len,
                        src,
                        fua: rw.fua,
                    }
                } else {
                    IoOp::Read { lba: rw.slba, len }
                };
                Ok(req(Some(ns), op))
            }
            IoCommand::Flush => {
                if sqe.nsid.get() == u32::MAX {
                    return Ok(req(None, IoOp::Flush));
                }
                let ns = self.namespace(sqe.nsid.get())?;
                ns.reservations.check(&ctrl.hostid, Access::Write)?;
                Ok(req(Some(ns), IoOp::Flush))
            }
            IoCommand::WriteZeroes { range, deallocate } => {
                let ns = self.namespace(range.nsid)?;
                ns.reservations.check(&ctrl.hostid, Access::Write)?;
                self.range(&ns, &range)?;
                Ok(req(
                    Some(ns),
                    IoOp::WriteZeroes {
                        lba: range.slba,
                        nlb: range.nlb,
                        deallocate,
                        fua: range.fua,
                    },
                ))
            }
            IoCommand::DatasetManagement { ranges, deallocate } => {
                let ns = self.namespace(sqe.nsid.get())?;
                ns.reservations.check(&ctrl.hostid, Access::Write)?;
                // Hosts may transfer more than the ranges (Linux always sends 4 KiB).
                let len = sqe.dptr.data_length() as usize;
                if len < usize::from(ranges) * 16 || len > 4096 {
                    return Err(Status::generic(generic::DATA_SGL_LENGTH_INVALID).with_dnr());
                }
                let src = self.data_source(sqe, len, icd, false)?;
                Ok(req(
                    Some(ns),
                    IoOp::Dsm {
                        ranges,
                        len,
                        src,
                        deallocate,
                    },
                ))
            }
            IoCommand::Reservation { opcode, cdw10 } => {
                let ns = self.namespace(sqe.nsid.get())?;
                // Register and Acquire carry two keys, Release one.
                let len = if opcode == nvme_spec::opcode::io::RESERVATION_RELEASE {
                    8
                } else {
                    16
                };
                let src = self.data_source(sqe, len, icd, false)?;
                Ok(req(
                    Some(ns),
                    IoOp::Reservation {
                        opcode,
                        cdw10,
                        len,
                        src,
                    },
                ))
            }
            IoCommand::ReservationReport { len, eds } => {
                let ns = self.namespace(sqe.nsid.get())?;
                let len = usize::try_from(len).unwrap_or(usize::MAX);
                if len > self.mdts_bytes {
                    return Err(Status::generic(generic::INVALID_FIELD).with_dnr());
                }
                self.data_source(sqe, len, icd, true)?;
                Ok(req(Some(ns), IoOp::ReservationReport { len, eds }))
            }
            IoCommand::Unknown(_) | IoCommand::Fabrics(_) => {
                Err(Status::generic(generic::INVALID_OPCODE).with_dnr())
            }
        }
    }
}

impl QueueState {
    /// Handles one Authentication Send (`data`: its payload) or Receive (`room`: the host's
    /// buffer) command.
    fn auth_command(&mut self, sqe: &Sqe, cmd: AuthCommand, data: &[u8], room: u32) -> Answer {
        // The completion of a held command, but for its status.
        let template = self.completion(sqe.cid(), Status::SUCCESS, 0);
        let Some(auth) = self.auth.as_mut() else {
            return Answer::Now(Status::generic(generic::INVALID_FIELD).with_dnr(), None);
        };
        if !cmd.is_dhchap() {
            return Answer::Now(Status::generic(generic::INVALID_FIELD).with_dnr(), None);
        }
        // One message at a time: the host waits for a command's completion before the next.
        let locked = if auth.busy() {
            None
        } else {
            auth.proto.try_lock()
        };
        let Some(mut proto) = locked else {
            return Answer::Now(
                Status::generic(generic::COMMAND_SEQUENCE_ERROR).with_dnr(),
                None,
            );
        };
        let mut rng = rand::rng();
        let action = if cmd.send {
            if cmd.len > MAX_SEND_LEN {
                return Answer::Now(Status::generic(generic::INVALID_FIELD).with_dnr(), None);
            }
            let Some(msg) = data.get(..cmd.len as usize) else {
                return Answer::Now(
                    Status::generic(generic::DATA_SGL_LENGTH_INVALID).with_dnr(),
                    None,
                );
            };
            let work = proto.dh_work(msg);
            if work == Some(DhWork::Negotiate) {
                // A new transaction: its outcome is still to be applied.
                auth.settled = false;
                auth.refused = None;
                let hostnqn = self.ctrl.as_ref().map_or("", |c| c.hostnqn.as_str());
                if let Err(over) = self.target.auth.budget.take(hostnqn, self.origin.peer.ip()) {
                    auth.refused = Some(over.reason());
                    proto.refuse(msg, "over the authentication budget");
                    drop(proto);
                    return auth.hold_refusal(template);
                }
            }
            if work.is_some() {
                drop(proto);
                let (proto, busy, done) = (
                    Arc::clone(&auth.proto),
                    Arc::clone(&auth.busy),
                    auth.done.clone(),
                );
                let msg = msg.to_vec();
                busy.store(true, Ordering::Release);
                let job = {
                    let busy = Arc::clone(&busy);
                    Box::new(move || {
                        let action = proto.lock().handle(CtrlEvent::Send(&msg), &mut rand::rng());
                        let status = match action {
                            CtrlAction::Error(s) => s.with_dnr(),
                            CtrlAction::Accepted | CtrlAction::Data(_) => Status::SUCCESS,
                        };
                        busy.store(false, Ordering::Release);
                        let mut cqe = Cqe::new(template.cid(), status, 0);
                        cqe.sqhd = template.sqhd;
                        cqe.sqid = template.sqid;
                        let _ = done.send(cqe);
                    })
                };
                if self.target.auth.pool.try_run(job) {
                    return Answer::Held;
                }
                busy.store(false, Ordering::Release);
                auth.refused = Some("busy");
                auth.proto
                    .lock()
                    .refuse(&data[..cmd.len as usize], "authentication threads busy");
                return auth.hold_refusal(template);
            }
            proto.handle(CtrlEvent::Send(msg), &mut rng)
        } else {
            let len = cmd.len.min(room);
            proto.handle(CtrlEvent::Receive { len }, &mut rng)
        };
        match action {
            CtrlAction::Accepted => Answer::Now(Status::SUCCESS, None),
            CtrlAction::Data(d) => Answer::Now(Status::SUCCESS, Some(d)),
            CtrlAction::Error(s) => Answer::Now(s.with_dnr(), None),
        }
    }

    /// Applies and logs the outcome of the queue's transaction once it is decided.
    fn settle_auth(&mut self, ctrl: &Controller) {
        let Some(auth) = self.auth.as_mut() else {
            return;
        };
        let (qid, peer) = (self.qid, self.origin.peer);
        match auth.settle() {
            Some(Ok(o)) => log_limited!(
                LogKind::AuthSucceeded,
                info!(
                    cntlid = ctrl.cntlid, hostnqn = %ctrl.hostnqn, %peer, qid,
                    hash = o.hash.name(), dhgroup = o.dh_group.name(), bidirectional = o.bidirectional,
                    "host authenticated"
                )
            ),
            Some(Err(e)) => {
                let reason = auth.refused.take().unwrap_or_else(|| failure_reason(&e));
                self.target.metrics.note_auth_failure(reason);
                log_limited!(
                    LogKind::AuthFailed,
                    warn!(
                        cntlid = ctrl.cntlid, hostnqn = %ctrl.hostnqn, %peer, qid, reason,
                        error = %e, "host authentication failed"
                    )
                );
            }
            None => {}
        }
    }
    /// After a successful Connect of `ctrl`: when the host must authenticate, arms the queue's
    /// authentication and returns the AUTHREQ bits for the Connect completion's DW0.
    pub(crate) fn require_auth(&mut self, ctrl: &Controller) -> u32 {
        let keys = ctrl
            .subsystem()
            .and_then(|s| s.host_keys(&ctrl.hostnqn).map(|k| (s, k)));
        match keys {
            Some((s, k)) => {
                // Held Authentication Sends complete through the queue's event channel: the
                // controller's on an admin queue, one of its own on an I/O queue.
                let done = match &self.events {
                    Some(_) => ctrl.event_sender(),
                    None => {
                        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
                        self.events = Some(rx);
                        tx
                    }
                };
                self.auth = Some(QueueAuth::new(&s.nqn, &ctrl.hostnqn, &k, done));
                CONNECT_AUTHREQ_ATR
            }
            None => {
                self.auth = None;
                0
            }
        }
    }

    /// Whether the queue is connected but still has to authenticate.
    pub fn auth_pending(&self) -> bool {
        self.auth.as_ref().is_some_and(|a| !a.is_authenticated())
    }

    /// Authentication commands and the refusal of everything else until the queue is
    /// authenticated; `None` when the command is not the authentication's business.
    pub(crate) fn auth_gate(&mut self, ctrl: &Controller, sqe: &Sqe, icd: &[u8]) -> Option<Submit> {
        let auth = self.auth.as_ref()?;
        if !auth.busy() {
            // A transaction decided on a pool thread.
            self.settle_auth(ctrl);
        }
        let auth = self.auth.as_ref()?;
        let cid = sqe.cid();
        let Some(cmd) = AuthCommand::from_sqe(sqe) else {
            if auth.is_authenticated()
                || (sqe.opcode == nvme_spec::opcode::FABRICS
                    && matches!(FabricsCommand::parse(sqe), FabricsCommand::Disconnect))
            {
                return None;
            }
            let status = Status::specific(specific::AUTH_REQUIRED).with_dnr();
            return Some(Submit::Complete(self.completion(cid, status, 0)));
        };
        let (status, data) = match self.auth_command(sqe, cmd, icd, sqe.dptr.data_length()) {
            Answer::Held => return Some(Submit::Held),
            Answer::Now(status, data) => (status, data),
        };
        self.settle_auth(ctrl);
        let cqe = self.completion(cid, status, 0);
        Some(match data {
            Some(d) => Submit::CompleteWithData(d, cqe),
            None => Submit::Complete(cqe),
        })
    }
}

#[cfg(test)]
mod tests {
    use nvme_spec::FromBytes;
    use nvme_spec::command::build;
    use nvme_spec::identify::{IdentifyController, SGLS_KEYED, SGLS_TRANSPORT};
    use nvme_spec::queue::SglDescriptor;

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

        // Read with a keyed descriptor (address subtype: no invalidation).
        let mut r = build::read_write(false, 11, 1, 0, 1);
        r.dptr = SglDescriptor::keyed(0x20_0000, 4096, 0x55, false);
        assert!(
            matches!(io.submit(&r, &[]), Submit::Io(req) if req.op == IoOp::Read { lba: 0, len: 4096 })
        );

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
}
