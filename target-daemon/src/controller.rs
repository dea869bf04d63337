//! Controllers: per-host state created by a Connect on an admin queue, and the admin command set.
//!
//! A controller is shared by its admin queue and its I/O queues (which may live on other
//! reactor threads). Its mutable state is touched only by admin-path commands, behind a mutex;
//! the I/O path reads immutable fields and bumps its thread's stripe of the controller's
//! counters ([`IoCounters`]), so reactors serving one controller share no written cache line.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use blockdev::Backend;
use nvme_spec::command::{AdminCommand, GetLogPage, Identify, cns, log_id};
use nvme_spec::fabrics::{Cap, Cc, VERSION_1_4, csts, property};
use nvme_spec::identify::{
    CMIC_ANA, CMIC_MULTI_CONTROLLER, IdentifyController, IdentifyNamespace, LPA_EXTENDED, ONCS_DSM,
    ONCS_RESERVATIONS, ONCS_WRITE_ZEROES, SGLS_KEYED, SGLS_OFFSET, SGLS_SUPPORTED, SGLS_TRANSPORT,
    anacap, cntrltype, encode_ns_descriptors, encode_ns_list, nidt, put_ascii_padded,
    put_nul_padded,
};
use nvme_spec::log::{
    ANA_LSP_GROUPS_ONLY, AnaGroup, ErrorLogEntry, SmartLog, encode_ana_log, u128_le,
};
use nvme_spec::status::{generic, specific};
use nvme_spec::{Cqe, IntoBytes, Sqe, Status, features};
use parking_lot::Mutex;
use tokio::sync::{mpsc, watch};

use crate::discovery;
use crate::subsystem::{FIRMWARE_REVISION, Subsystem};
use crate::target::Target;

/// CTRATT: 128-bit host identifiers.
const CTRATT_HOSTID_128: u32 = 1;
/// CTRATT: traffic-based keep alive (NVMe 1.4): any command restarts the keep-alive timer.
const CTRATT_TBKAS: u32 = 1 << 6;

/// Number of error log entries kept (ELPE + 1).
pub const ERROR_LOG_ENTRIES: usize = 64;
/// Asynchronous Event Requests held at once (AERL + 1).
pub const MAX_AERS: usize = 4;
/// Timeout reported in CAP.TO, in 500 ms units.
const CAP_TIMEOUT_500MS: u8 = 30;

/// What a controller exports.
pub enum ControllerKind {
    /// An I/O controller of an NVM subsystem.
    Io(Arc<Subsystem>),
    /// A discovery controller.
    Discovery,
}

/// Mutable admin-path state.
struct AdminState {
    cc: u32,
    csts: u32,
    kato_ms: u32,
    io_queues: u16,
    /// I/O queue IDs connected now (each may be connected once at a time).
    connected_queues: BTreeSet<u16>,
    queues_set: bool,
    aec: u32,
    aers: Vec<u16>,
    /// Events raised while no Asynchronous Event Request was held, oldest first.
    pending_events: VecDeque<u32>,
    /// NSIDs changed since the host last read the Changed Namespace List.
    changed_ns: Vec<u32>,
    /// A Namespace Attribute Notice was raised and the log page not read yet: further
    /// changes only add to the list.
    ns_notice_outstanding: bool,
    /// Likewise for the Discovery Log Page Change notice.
    discovery_notice_outstanding: bool,
    /// Likewise for the Asymmetric Namespace Access Change notice.
    ana_notice_outstanding: bool,
    errors: Vec<ErrorLogEntry>,
    error_count: u64,
    /// Reservation notifications not read yet (type, NSID), oldest first.
    resv_notices: VecDeque<(u8, u32)>,
    /// Reservation Notification log pages made so far (the page's Log Page Count).
    resv_count: u64,
    /// A reservation event was raised and the log page not read yet.
    resv_notice_outstanding: bool,
    /// Reservation Notification Mask by NSID (bits 1..3 mask the notice types).
    resv_masks: std::collections::BTreeMap<u32, u32>,
}

/// Reservation notifications kept for the host (the log page's Number of Available Log Pages
/// counts to 255).
const MAX_RESERVATION_NOTICES: usize = 255;

/// Entries of the Changed Namespace List log page; one more change reports FFFFFFFFh alone.
pub const CHANGED_NS_LIST_ENTRIES: usize = 1024;
/// Events kept for the host while it holds no Asynchronous Event Request.
const MAX_PENDING_EVENTS: usize = 16;
/// OAES bit: Namespace Attribute Notices are supported.
pub const OAES_NS_ATTRIBUTE: u32 = 1 << 8;
/// OAES bit: Asymmetric Namespace Access Change Notices are supported.
pub const OAES_ANA_CHANGE: u32 = 1 << 11;
/// OAES bit: Discovery Log Page Change Notices are supported.
pub const OAES_DISCOVERY_LOG_CHANGE: u32 = 1 << 31;

/// Stripes of [`IoCounters`].
const STRIPES: usize = 16;

static NEXT_STRIPE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

thread_local! {
    /// The stripe this thread counts in: reactor threads take stripes in turn.
    static STRIPE: usize = NEXT_STRIPE.fetch_add(1, Ordering::Relaxed) % STRIPES;
}

/// One thread's share of [`IoCounters`], on a cache line of its own.
#[derive(Default)]
#[repr(align(64))]
struct Stripe {
    reads: AtomicU64,
    writes: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
    media_errors: AtomicU64,
}

/// Counters for the SMART / health log, bumped by I/O queues. Each thread counts in a stripe
/// of its own (16 stripes, taken in turn), so the reactors serving one controller's queues
/// do not bounce a shared cache line on every command; [`IoCounters::totals`] adds them up.
#[derive(Default)]
pub struct IoCounters {
    stripes: [Stripe; STRIPES],
}

/// The sums of [`IoCounters`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IoTotals {
    /// Read commands completed.
    pub reads: u64,
    /// Write commands completed.
    pub writes: u64,
    /// Bytes read.
    pub bytes_read: u64,
    /// Bytes written.
    pub bytes_written: u64,
    /// Commands completed with a media or internal error.
    pub media_errors: u64,
}

impl IoCounters {
    fn mine(&self) -> &Stripe {
        &self.stripes[STRIPE.with(|s| *s)]
    }

    /// Counts a read of `bytes`.
    #[inline]
    pub fn read(&self, bytes: u64) {
        let s = self.mine();
        s.reads.fetch_add(1, Ordering::Relaxed);
        s.bytes_read.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Counts a write of `bytes`.
    #[inline]
    pub fn write(&self, bytes: u64) {
        let s = self.mine();
        s.writes.fetch_add(1, Ordering::Relaxed);
        s.bytes_written.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Counts a command that ended with a media or internal error.
    pub fn media_error(&self) {
        self.mine().media_errors.fetch_add(1, Ordering::Relaxed);
    }

    /// The sums over every stripe.
    pub fn totals(&self) -> IoTotals {
        let mut t = IoTotals::default();
        for s in &self.stripes {
            t.reads += s.reads.load(Ordering::Relaxed);
            t.writes += s.writes.load(Ordering::Relaxed);
            t.bytes_read += s.bytes_read.load(Ordering::Relaxed);
            t.bytes_written += s.bytes_written.load(Ordering::Relaxed);
            t.media_errors += s.media_errors.load(Ordering::Relaxed);
        }
        t
    }
}

/// A controller (NVMe-oF dynamic controller model).
pub struct Controller {
    /// Controller ID.
    pub cntlid: u16,
    /// What it exports.
    pub kind: ControllerKind,
    /// Host NQN from Connect.
    pub hostnqn: String,
    /// Host identifier from Connect.
    pub hostid: [u8; 16],
    /// The host's address on the admin queue.
    pub peer: SocketAddr,
    /// The target's address the admin queue connected to: the listener (port) whose ANA
    /// states the controller reports.
    pub local: SocketAddr,
    /// Submission queue size of the admin queue.
    pub admin_sqsize: u32,
    state: Mutex<AdminState>,
    started: Instant,
    last_keep_alive_ms: AtomicU64,
    /// SMART counters.
    pub counters: IoCounters,
    /// Set when the controller is torn down; queues watch it.
    shutdown_tx: watch::Sender<bool>,
    torn_down: AtomicBool,
    /// Set when the admin queue's transport takes keyed SGL data blocks (NVMe/RDMA).
    keyed_sgls: AtomicBool,
    /// Completions produced outside the admin queue's request path (AERs).
    events_tx: mpsc::UnboundedSender<Cqe>,
    /// A discovery controller's log page and the generation it was built for: built once per
    /// generation, not per Get Log Page.
    discovery_page: Mutex<Option<(u64, Arc<[u8]>)>>,
}

/// The admin queue's receiver for asynchronous completions.
pub type EventReceiver = mpsc::UnboundedReceiver<Cqe>;

/// The result of an admin command.
pub enum AdminReply {
    /// Complete now, optionally returning data to the host first.
    Complete {
        /// Completion status.
        status: Status,
        /// Completion DW0.
        dw0: u32,
        /// Data for the host (controller-to-host commands).
        data: Option<Vec<u8>>,
    },
    /// The command is held (Asynchronous Event Request) and completes later through the
    /// controller's event channel.
    Held,
}

impl AdminReply {
    fn ok(dw0: u32) -> Self {
        AdminReply::Complete {
            status: Status::SUCCESS,
            dw0,
            data: None,
        }
    }

    fn err(status: Status) -> Self {
        AdminReply::Complete {
            status,
            dw0: 0,
            data: None,
        }
    }

    fn data(data: Vec<u8>) -> Self {
        AdminReply::Complete {
            status: Status::SUCCESS,
            dw0: 0,
            data: Some(data),
        }
    }
}

/// Where a command arrived, for answers that depend on the listener (discovery).
#[derive(Clone, Copy, Debug)]
pub struct QueueOrigin {
    /// Local address of the connection.
    pub local: SocketAddr,
    /// Remote address of the connection.
    pub peer: SocketAddr,
}

impl Controller {
    /// Creates a controller and the receiver its admin queue polls for asynchronous completions.
    pub fn new(
        cntlid: u16,
        kind: ControllerKind,
        hostnqn: String,
        hostid: [u8; 16],
        origin: QueueOrigin,
        admin_sqsize: u32,
        kato_ms: u32,
    ) -> (Arc<Self>, EventReceiver) {
        let (events_tx, events_rx) = mpsc::unbounded_channel();
        let (shutdown_tx, _) = watch::channel(false);
        let ctrl = Controller {
            cntlid,
            kind,
            hostnqn,
            hostid,
            peer: origin.peer,
            local: origin.local,
            admin_sqsize,
            state: Mutex::new(AdminState {
                cc: 0,
                csts: 0,
                kato_ms,
                io_queues: 0,
                connected_queues: BTreeSet::new(),
                queues_set: false,
                aec: 0,
                aers: Vec::new(),
                pending_events: VecDeque::new(),
                changed_ns: Vec::new(),
                ns_notice_outstanding: false,
                discovery_notice_outstanding: false,
                ana_notice_outstanding: false,
                errors: Vec::new(),
                error_count: 0,
                resv_notices: VecDeque::new(),
                resv_count: 0,
                resv_notice_outstanding: false,
                resv_masks: std::collections::BTreeMap::new(),
            }),
            started: Instant::now(),
            last_keep_alive_ms: AtomicU64::new(0),
            counters: IoCounters::default(),
            shutdown_tx,
            torn_down: AtomicBool::new(false),
            keyed_sgls: AtomicBool::new(false),
            events_tx,
            discovery_page: Mutex::new(None),
        };
        (Arc::new(ctrl), events_rx)
    }

    /// The subsystem of an I/O controller.
    pub fn subsystem(&self) -> Option<&Arc<Subsystem>> {
        match &self.kind {
            ControllerKind::Io(s) => Some(s),
            ControllerKind::Discovery => None,
        }
    }

    /// The subsystem NQN this controller belongs to.
    pub fn subnqn(&self) -> &str {
        match &self.kind {
            ControllerKind::Io(s) => &s.nqn,
            ControllerKind::Discovery => nvme_spec::fabrics::DISCOVERY_NQN,
        }
    }

    /// True for a discovery controller.
    pub fn is_discovery(&self) -> bool {
        matches!(self.kind, ControllerKind::Discovery)
    }

    /// Whether this is an I/O controller with a volatile write cache: one of its namespaces
    /// may lose completed writes that no Flush or Force Unit Access made durable.
    fn volatile_write_cache(&self) -> bool {
        self.subsystem().is_some_and(|s| {
            s.namespaces()
                .values()
                .any(|ns| ns.backend.volatile_write_cache())
        })
    }

    /// A receiver that turns true when the controller is torn down.
    pub fn subscribe_shutdown(&self) -> watch::Receiver<bool> {
        self.shutdown_tx.subscribe()
    }

    /// Tears the controller down: its queues observe the shutdown and close. Idempotent.
    /// Returns true the first time.
    pub fn tear_down(&self) -> bool {
        if self.torn_down.swap(true, Ordering::AcqRel) {
            return false;
        }
        self.shutdown_tx.send_replace(true);
        if let Some(s) = self.subsystem() {
            s.remove_controller(self.cntlid);
        }
        true
    }

    /// Records that the controller's transport takes keyed SGL data blocks (NVMe/RDMA), so
    /// Identify Controller advertises them. Called once, before Connect completes.
    pub fn set_keyed_sgls(&self) {
        self.keyed_sgls.store(true, Ordering::Release);
    }

    /// Whether the controller has been torn down.
    pub fn is_torn_down(&self) -> bool {
        self.torn_down.load(Ordering::Acquire)
    }

    /// Number of I/O queues granted by Set Features Number of Queues.
    pub fn io_queues(&self) -> u16 {
        self.state.lock().io_queues
    }

    /// Takes I/O queue `qid` for a connecting queue: false when it is beyond the queues
    /// granted by Set Features Number of Queues or already connected. Give it back with
    /// [`Controller::release_queue`] when the queue goes.
    pub fn claim_queue(&self, qid: u16) -> bool {
        let mut st = self.state.lock();
        qid != 0 && qid <= st.io_queues && st.connected_queues.insert(qid)
    }

    /// Gives back an I/O queue taken by [`Controller::claim_queue`].
    pub fn release_queue(&self, qid: u16) {
        self.state.lock().connected_queues.remove(&qid);
    }

    /// The keep alive timeout in milliseconds (0: none).
    pub fn kato_ms(&self) -> u32 {
        self.state.lock().kato_ms
    }

    /// Whether CC.EN = 1 and CSTS.RDY = 1.
    pub fn is_ready(&self) -> bool {
        self.state.lock().csts & csts::RDY != 0
    }

    /// Records keep-alive activity.
    pub fn keep_alive(&self) {
        let now = self.started.elapsed().as_millis() as u64;
        self.last_keep_alive_ms.store(now, Ordering::Relaxed);
    }

    /// When the keep-alive timer expires (None when KATO is 0).
    pub fn keep_alive_deadline(&self) -> Option<Instant> {
        let kato = self.state.lock().kato_ms;
        if kato == 0 {
            return None;
        }
        let last = self.last_keep_alive_ms.load(Ordering::Relaxed);
        Some(self.started + Duration::from_millis(last) + Duration::from_millis(u64::from(kato)))
    }

    /// Records a failed command in the error log.
    pub fn log_error(&self, sqid: u16, sqe: &Sqe, status: Status, lba: u64) {
        let mut st = self.state.lock();
        st.error_count += 1;
        let mut e = ErrorLogEntry::default();
        e.error_count.set(st.error_count);
        e.sqid.set(sqid);
        e.cid.set(sqe.cid());
        e.status.set(status.to_field() << 1);
        e.param_error_location.set(0xFFFF);
        e.lba.set(lba);
        e.nsid.set(sqe.nsid.get());
        e.trtype = nvme_spec::log::trtype::TCP;
        if st.errors.len() == ERROR_LOG_ENTRIES {
            st.errors.remove(0);
        }
        st.errors.push(e);
    }

    /// Completes one held Asynchronous Event Request with `dw0`, if one is held and the event is
    /// enabled in `mask` (an Asynchronous Event Configuration bit; 0 = always).
    pub fn raise_event(&self, mask: u32, dw0: u32) -> bool {
        let mut st = self.state.lock();
        if mask != 0 && st.aec & mask == 0 {
            return false;
        }
        let Some(cid) = st.aers.pop() else {
            return false;
        };
        drop(st);
        self.events_tx
            .send(Cqe::new(cid, Status::SUCCESS, dw0))
            .is_ok()
    }

    /// A sender into the admin queue's completions of held commands.
    pub(crate) fn event_sender(&self) -> mpsc::UnboundedSender<Cqe> {
        self.events_tx.clone()
    }

    /// Reports an event to the host: completes a held Asynchronous Event Request, or keeps
    /// the event until the host sends one.
    fn post_event(&self, st: &mut AdminState, dw0: u32) {
        match st.aers.pop() {
            Some(cid) => {
                tracing::debug!(cntlid = self.cntlid, subnqn = self.subnqn(), hostnqn = %self.hostnqn, dw0 = %format_args!("{dw0:#08x}"), "asynchronous event completed");
                let _ = self.events_tx.send(Cqe::new(cid, Status::SUCCESS, dw0));
            }
            None if st.pending_events.len() < MAX_PENDING_EVENTS => {
                st.pending_events.push_back(dw0);
            }
            None => {}
        }
    }

    /// Namespaces `nsids` of this I/O controller's subsystem were added, removed or resized:
    /// adds them to the Changed Namespace List and raises a Namespace Attribute Notice, unless
    /// one is outstanding (not yet followed by a read of the log page) or the host did not
    /// enable it.
    pub fn notify_namespaces_changed(&self, nsids: &[u32]) {
        let mut st = self.state.lock();
        for &nsid in nsids {
            if st.changed_ns.first() == Some(&u32::MAX) || st.changed_ns.contains(&nsid) {
                continue;
            }
            if st.changed_ns.len() == CHANGED_NS_LIST_ENTRIES {
                st.changed_ns = vec![u32::MAX];
            } else {
                st.changed_ns.push(nsid);
            }
        }
        if st.aec & features::AEC_NS_ATTRIBUTE_NOTICES == 0 || st.ns_notice_outstanding {
            return;
        }
        st.ns_notice_outstanding = true;
        let dw0 = features::aer_dw0(
            features::aer_type::NOTICE,
            features::aer_notice::NS_ATTRIBUTE_CHANGED,
            log_id::CHANGED_NS_LIST,
        );
        self.post_event(&mut st, dw0);
    }

    /// The ANA state of a group with namespaces of this I/O controller changed: raises an
    /// Asymmetric Namespace Access Change notice, unless one is outstanding (not yet followed
    /// by a read of the ANA log page) or the host did not enable it.
    pub fn notify_ana_changed(&self) {
        let mut st = self.state.lock();
        if st.aec & features::AEC_ANA_CHANGE == 0 || st.ana_notice_outstanding {
            return;
        }
        st.ana_notice_outstanding = true;
        let dw0 = features::aer_dw0(
            features::aer_type::NOTICE,
            features::aer_notice::ANA_CHANGE,
            log_id::ANA,
        );
        self.post_event(&mut st, dw0);
    }

    /// A reservation notice for namespace `nsid`: kept for the Reservation Notification log
    /// page, with an event unless one is outstanding, unless the host masked the type.
    pub fn notify_reservation(&self, nsid: u32, notice: crate::reservation::Notice) {
        let mut st = self.state.lock();
        let kind = notice as u8;
        if st
            .resv_masks
            .get(&nsid)
            .is_some_and(|m| m & (1 << kind) != 0)
        {
            return;
        }
        if st.resv_notices.len() == MAX_RESERVATION_NOTICES {
            st.resv_notices.pop_front();
        }
        st.resv_notices.push_back((kind, nsid));
        if st.resv_notice_outstanding {
            return;
        }
        st.resv_notice_outstanding = true;
        let dw0 = features::aer_dw0(
            features::AER_TYPE_IO_COMMAND_SPECIFIC,
            features::AER_RESERVATION_LOG_AVAILABLE,
            log_id::RESERVATION_NOTIFICATION,
        );
        self.post_event(&mut st, dw0);
    }

    /// The next Reservation Notification log page (NVMe Base 2.0, Figure 294): the oldest
    /// notice, taken off the list, or an empty page.
    fn reservation_log(&self, st: &mut AdminState) -> Vec<u8> {
        let mut page = vec![0u8; 64];
        if let Some((kind, nsid)) = st.resv_notices.pop_front() {
            st.resv_count = match st.resv_count.wrapping_add(1) {
                0 => 1,
                c => c,
            };
            page[0..8].copy_from_slice(&st.resv_count.to_le_bytes());
            page[8] = kind;
            page[9] = st.resv_notices.len() as u8;
            page[12..16].copy_from_slice(&nsid.to_le_bytes());
        }
        page
    }

    /// The ANA groups of the namespaces this I/O controller's host sees.
    pub fn ana_groups(&self) -> BTreeSet<u32> {
        self.subsystem().map_or_else(BTreeSet::new, |s| {
            s.namespaces()
                .values()
                .filter(|ns| ns.visible_to(&self.hostnqn))
                .map(|ns| ns.ana_group)
                .collect()
        })
    }

    /// The ANA log page of this I/O controller: every group of the namespaces its host sees,
    /// in the state of the listener its admin queue connected to, with their NSIDs unless
    /// `groups_only` (RGO).
    fn ana_log(&self, target: &Target, groups_only: bool) -> Vec<u8> {
        let mut groups: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
        if let Some(s) = self.subsystem() {
            for ns in s.namespaces().values() {
                if ns.visible_to(&self.hostnqn) {
                    groups.entry(ns.ana_group).or_default().push(ns.nsid);
                }
            }
        }
        // A controller always reports the default group, as Linux nvmet does.
        groups.entry(crate::ana::DEFAULT_ANA_GROUP).or_default();
        let table = target.ana.table();
        let chgcnt = target.ana.generation();
        let groups: Vec<AnaGroup> = groups
            .into_iter()
            .map(|(grpid, nsids)| AnaGroup {
                grpid,
                state: table.state(self.local, grpid),
                chgcnt,
                nsids,
            })
            .collect();
        encode_ana_log(chgcnt, &groups, groups_only)
    }

    /// The discovery log changed: raises a Discovery Log Page Change notice on this discovery
    /// controller, unless one is outstanding or the host did not enable it.
    pub fn notify_discovery_changed(&self) {
        let mut st = self.state.lock();
        if st.aec & features::AEC_DISCOVERY_LOG_CHANGE == 0 || st.discovery_notice_outstanding {
            return;
        }
        st.discovery_notice_outstanding = true;
        let dw0 = features::aer_dw0(
            features::aer_type::NOTICE,
            features::aer_notice::DISCOVERY_LOG_CHANGE,
            log_id::DISCOVERY,
        );
        self.post_event(&mut st, dw0);
    }

    /// Property Get.
    pub fn property_get(&self, target: &Target, offset: u32, size8: bool) -> Result<u64, Status> {
        let st = self.state.lock();
        let invalid = Status::generic(generic::INVALID_FIELD).with_dnr();
        match (offset, size8) {
            (property::CAP, true) => {
                let mqes = target.settings.max_queue_depth - 1;
                Ok(Cap::new(mqes, CAP_TIMEOUT_500MS).0)
            }
            (property::VS, false) => Ok(u64::from(VERSION_1_4)),
            (property::CC, false) => Ok(u64::from(st.cc)),
            (property::CSTS, false) => Ok(u64::from(st.csts)),
            _ => Err(invalid),
        }
    }

    /// Property Set. Returns true when the write requested a shutdown (the caller flushes the
    /// backends first; CSTS.SHST is already reported complete only after that flush).
    pub fn property_set(&self, offset: u32, size8: bool, value: u64) -> Result<bool, Status> {
        if offset != property::CC || size8 {
            return Err(Status::generic(generic::INVALID_FIELD).with_dnr());
        }
        let mut st = self.state.lock();
        let new = Cc(value as u32);
        let old = Cc(st.cc);
        st.cc = value as u32;
        if new.enabled() && !old.enabled() {
            if new.iosqes() != 6 || new.iocqes() != 4 {
                st.csts |= csts::CFS;
            } else {
                st.csts |= csts::RDY;
            }
        } else if !new.enabled() && old.enabled() {
            // A reset: the controller is not ready and its fatal status is cleared.
            st.csts &= !(csts::RDY | csts::CFS | csts::SHST_MASK);
        }
        if new.shutdown() != 0 && old.shutdown() == 0 {
            // As Linux nvmet: a shut-down controller is no longer ready, so commands other
            // than fabrics ones fail until the host resets (CC.EN 0) and enables it again.
            st.csts = (st.csts & !(csts::SHST_MASK | csts::RDY)) | csts::SHST_COMPLETE;
            return Ok(true);
        }
        Ok(false)
    }

    /// Executes an admin command (fabrics commands are handled by the queue).
    pub fn admin(
        &self,
        target: &Target,
        origin: QueueOrigin,
        sqe: &Sqe,
        cmd: AdminCommand,
    ) -> AdminReply {
        let invalid_field = AdminReply::err(Status::generic(generic::INVALID_FIELD).with_dnr());
        // Every admin command counts as host activity for the keep-alive timer.
        self.keep_alive();
        match cmd {
            AdminCommand::KeepAlive => AdminReply::ok(0),
            AdminCommand::Identify(id) => self.identify(target, id),
            AdminCommand::GetLogPage(glp) => self.get_log_page(target, origin, glp),
            AdminCommand::SetFeatures { fid, save, cdw11 } => {
                if save {
                    return AdminReply::err(
                        Status::specific(specific::FEATURE_NOT_SAVEABLE).with_dnr(),
                    );
                }
                if matches!(
                    fid,
                    features::RESERVATION_NOTIFICATION_MASK | features::RESERVATION_PERSISTENCE
                ) {
                    return self.reservation_feature(target, sqe.nsid.get(), fid, Some(cdw11));
                }
                self.set_features(target, fid, cdw11)
            }
            AdminCommand::GetFeatures { fid, sel, .. } => {
                if sel > 3 {
                    return invalid_field;
                }
                if sel == 3 {
                    // Supported capabilities: nothing saveable, nothing namespace specific;
                    // changeable for the features Set Features can change (not the volatile
                    // write cache, which stays enabled).
                    let changeable = matches!(
                        fid,
                        features::NUMBER_OF_QUEUES
                            | features::KEEP_ALIVE_TIMER
                            | features::ASYNC_EVENT_CONFIG
                    );
                    let per_ns = matches!(
                        fid,
                        features::RESERVATION_NOTIFICATION_MASK | features::RESERVATION_PERSISTENCE
                    );
                    return AdminReply::ok(if per_ns {
                        0b110
                    } else if changeable {
                        0b100
                    } else {
                        0
                    });
                }
                if matches!(
                    fid,
                    features::RESERVATION_NOTIFICATION_MASK | features::RESERVATION_PERSISTENCE
                ) {
                    return self.reservation_feature(target, sqe.nsid.get(), fid, None);
                }
                self.get_features(fid)
            }
            AdminCommand::AsyncEventRequest => {
                let mut st = self.state.lock();
                if let Some(dw0) = st.pending_events.pop_front() {
                    tracing::debug!(cntlid = self.cntlid, subnqn = self.subnqn(), hostnqn = %self.hostnqn, dw0 = %format_args!("{dw0:#08x}"), "asynchronous event completed");
                    return AdminReply::ok(dw0);
                }
                if st.aers.len() >= MAX_AERS {
                    return AdminReply::err(Status::specific(specific::AER_LIMIT_EXCEEDED));
                }
                st.aers.push(sqe.cid());
                AdminReply::Held
            }
            // Aborting is best effort; "not aborted" (DW0 bit 0) is always a legal answer and
            // commands on this target complete promptly on their own.
            AdminCommand::Abort { .. } => AdminReply::ok(1),
            AdminCommand::Fabrics(_) => invalid_field,
            AdminCommand::Unknown(_) => {
                AdminReply::err(Status::generic(generic::INVALID_OPCODE).with_dnr())
            }
        }
    }

    fn identify(&self, target: &Target, id: Identify) -> AdminReply {
        let invalid_field = AdminReply::err(Status::generic(generic::INVALID_FIELD).with_dnr());
        let invalid_ns = AdminReply::err(Status::generic(generic::INVALID_NAMESPACE).with_dnr());
        let subsys = self.subsystem();
        match id.cns {
            cns::CONTROLLER => {
                AdminReply::data(self.identify_controller(target).as_bytes().to_vec())
            }
            _ if subsys.is_none() => invalid_field,
            cns::NAMESPACE
            | cns::CS_INDEPENDENT_NAMESPACE
            | cns::NS_DESCRIPTORS
            | cns::CSI_NAMESPACE => {
                let Some(s) = subsys else {
                    return invalid_field;
                };
                if id.cns == cns::CSI_NAMESPACE && id.csi != 0 {
                    return invalid_field;
                }
                if id.nsid == 0 || (id.nsid > s.max_nsid() && id.nsid != u32::MAX) {
                    return invalid_ns;
                }
                let namespaces = s.namespaces();
                // A namespace masked from this host is inactive on its controllers.
                let visible = namespaces
                    .get(&id.nsid)
                    .filter(|ns| ns.visible_to(&self.hostnqn));
                let Some(ns) = visible else {
                    // An allocated but inactive NSID: a zero-filled structure.
                    if id.cns == cns::NS_DESCRIPTORS || id.nsid == u32::MAX {
                        return invalid_ns;
                    }
                    return AdminReply::data(vec![0; 4096]);
                };
                match id.cns {
                    cns::NAMESPACE => {
                        let mut n = IdentifyNamespace::zeroed();
                        n.nsze.set(ns.blocks);
                        n.ncap.set(ns.blocks);
                        n.nuse.set(ns.blocks);
                        n.nlbaf = 0;
                        n.flbas = 0;
                        n.nmic = 1;
                        n.dlfeat = if ns.backend.deallocate_reads_zeroes() {
                            0x1
                        } else {
                            0
                        };
                        n.anagrpid.set(ns.ana_group);
                        ns.reservations
                            .bind(target.settings.state_dir.as_deref(), &ns.nguid);
                        n.rescap = crate::reservation::RESCAP
                            & if ns.reservations.can_persist() {
                                0xFF
                            } else {
                                !1
                            };
                        n.nguid = ns.nguid;
                        n.eui64 = ns.eui64;
                        n.lbaf[0].lbads = ns.block_shift as u8;
                        AdminReply::data(n.as_bytes().to_vec())
                    }
                    cns::CS_INDEPENDENT_NAMESPACE => {
                        let mut d = vec![0u8; 4096];
                        d[1] = 1; // NMIC: may be shared
                        d[14] = 1; // NSTAT: namespace ready
                        AdminReply::data(d)
                    }
                    cns::NS_DESCRIPTORS => AdminReply::data(
                        encode_ns_descriptors(&[
                            (nidt::EUI64, &ns.eui64),
                            (nidt::NGUID, &ns.nguid),
                            (nidt::UUID, &ns.uuid),
                            (nidt::CSI, &[0]),
                        ])
                        .to_vec(),
                    ),
                    _ => AdminReply::data(vec![0; 4096]),
                }
            }
            cns::ACTIVE_NS_LIST | cns::CSI_ACTIVE_NS_LIST => {
                let Some(s) = subsys else {
                    return invalid_field;
                };
                if id.cns == cns::CSI_ACTIVE_NS_LIST && id.csi != 0 {
                    return invalid_field;
                }
                if id.nsid >= 0xFFFF_FFFE {
                    return invalid_ns;
                }
                let namespaces = s.namespaces();
                let active = namespaces
                    .values()
                    .filter(|ns| ns.visible_to(&self.hostnqn))
                    .map(|ns| ns.nsid);
                AdminReply::data(encode_ns_list(active, id.nsid).to_vec())
            }
            cns::CSI_CONTROLLER => {
                if id.csi != 0 {
                    return invalid_field;
                }
                AdminReply::data(vec![0; 4096])
            }
            _ => invalid_field,
        }
    }

    /// The Identify Controller structure of this controller.
    pub fn identify_controller(&self, target: &Target) -> IdentifyController {
        let t = &target.settings;
        let mut c = IdentifyController::zeroed();
        match &self.kind {
            ControllerKind::Io(s) => {
                put_ascii_padded(&mut c.sn, &s.serial);
                put_ascii_padded(&mut c.mn, &s.model);
                put_nul_padded(&mut c.subnqn, &s.nqn);
                c.cntrltype = cntrltype::IO;
                // More than one controller may attach; ANA reporting.
                c.cmic = CMIC_MULTI_CONTROLLER | CMIC_ANA;
                c.anatt = crate::ana::ANATT_SECONDS;
                c.anacap = anacap::OPTIMIZED
                    | anacap::NON_OPTIMIZED
                    | anacap::INACCESSIBLE
                    | anacap::PERSISTENT_LOSS
                    | anacap::CHANGE
                    | anacap::GRPID_STATIC;
                c.anagrpmax.set(crate::ana::MAX_ANA_GROUPS);
                c.nanagrpid.set(crate::ana::MAX_ANA_GROUPS);
                // MNAN sizes the host's ANA log buffer and must be non-zero and at most NN
                // (Linux refuses an ANA controller otherwise), so both are at least 1 even
                // while the subsystem has no namespace.
                let nn = s.max_nsid().max(1);
                c.nn.set(nn);
                c.mnan.set(nn);
                c.oncs.set(ONCS_WRITE_ZEROES | ONCS_DSM | ONCS_RESERVATIONS);
                // Flush with NSID FFFFFFFFh supported; a volatile write cache is present when a
                // namespace's backend has one (files and devices: the page cache or the
                // device's cache), so hosts send Flush and FUA only where they matter.
                c.vwc = 0b110 | u8::from(self.volatile_write_cache());
                c.oaes.set(OAES_NS_ATTRIBUTE | OAES_ANA_CHANGE);
            }
            ControllerKind::Discovery => {
                put_ascii_padded(&mut c.sn, &target.discovery_serial);
                put_ascii_padded(&mut c.mn, "nvmeof-direct discovery");
                put_nul_padded(&mut c.subnqn, nvme_spec::fabrics::DISCOVERY_NQN);
                c.cntrltype = cntrltype::DISCOVERY;
                c.oaes.set(OAES_DISCOVERY_LOG_CHANGE);
            }
        }
        put_ascii_padded(&mut c.fr, FIRMWARE_REVISION);
        c.rab = 6;
        c.mdts = (t.mdts_kib / 4).trailing_zeros() as u8;
        c.cntlid.set(self.cntlid);
        c.ver.set(VERSION_1_4);
        // 128-bit host identifier; traffic-based keep alive (commands restart the timer).
        c.ctratt.set(CTRATT_HOSTID_128 | CTRATT_TBKAS);
        c.acl = 3;
        c.aerl = (MAX_AERS - 1) as u8;
        c.lpa = LPA_EXTENDED;
        c.elpe = (ERROR_LOG_ENTRIES - 1) as u8;
        c.kas.set(1); // 100 ms granularity
        c.sqes = 0x66;
        c.cqes = 0x44;
        c.maxcmd.set(t.max_queue_depth);
        // NVMe/TCP: transport SGL data blocks; NVMe/RDMA: keyed SGL data blocks. Both take
        // in-capsule data through the offset form.
        c.sgls.set(if self.keyed_sgls.load(Ordering::Acquire) {
            SGLS_SUPPORTED | SGLS_OFFSET | SGLS_KEYED
        } else {
            SGLS_SUPPORTED | SGLS_OFFSET | SGLS_TRANSPORT
        });
        c.ioccsz.set((t.in_capsule_data + 64) / 16);
        c.iorcsz.set(1);
        c.icdoff.set(0);
        c.msdbd = 1;
        c
    }

    fn get_log_page(&self, target: &Target, origin: QueueOrigin, glp: GetLogPage) -> AdminReply {
        let invalid_field = AdminReply::err(Status::generic(generic::INVALID_FIELD).with_dnr());
        if glp.offset % 4 != 0 {
            return invalid_field;
        }
        let page: Arc<[u8]> = match (glp.lid, &self.kind) {
            (log_id::DISCOVERY, ControllerKind::Discovery) => {
                if !glp.rae {
                    self.state.lock().discovery_notice_outstanding = false;
                }
                self.discovery_page(target, origin)
            }
            (log_id::CHANGED_NS_LIST, ControllerKind::Io(_)) => {
                let mut st = self.state.lock();
                let mut page = vec![0u8; CHANGED_NS_LIST_ENTRIES * 4];
                for (slot, nsid) in page.chunks_exact_mut(4).zip(&st.changed_ns) {
                    slot.copy_from_slice(&nsid.to_le_bytes());
                }
                if !glp.rae {
                    st.changed_ns.clear();
                    st.ns_notice_outstanding = false;
                }
                page.into()
            }
            (log_id::ANA, ControllerKind::Io(_)) => {
                if !glp.rae {
                    self.state.lock().ana_notice_outstanding = false;
                }
                self.ana_log(target, glp.lsp & ANA_LSP_GROUPS_ONLY != 0)
                    .into()
            }
            (log_id::RESERVATION_NOTIFICATION, ControllerKind::Io(_)) => {
                let mut st = self.state.lock();
                if !glp.rae {
                    st.resv_notice_outstanding = false;
                }
                self.reservation_log(&mut st).into()
            }
            (log_id::ERROR_INFO, _) => {
                let st = self.state.lock();
                let mut page = vec![0u8; ERROR_LOG_ENTRIES * 64];
                for (slot, e) in page.chunks_exact_mut(64).zip(st.errors.iter().rev()) {
                    slot.copy_from_slice(e.as_bytes());
                }
                page.into()
            }
            (log_id::SMART, ControllerKind::Io(_)) => self.smart_log().as_bytes().into(),
            (log_id::FW_SLOT, ControllerKind::Io(_)) => {
                let mut page = vec![0u8; 512];
                page[0] = 1; // active slot 1
                put_ascii_padded(&mut page[8..16], FIRMWARE_REVISION);
                page.into()
            }
            _ => {
                return AdminReply::err(Status::specific(specific::INVALID_LOG_PAGE).with_dnr());
            }
        };
        let Ok(offset) = usize::try_from(glp.offset) else {
            return invalid_field;
        };
        if offset >= page.len() && !(offset == 0 && page.is_empty()) {
            return invalid_field;
        }
        let len = usize::try_from(glp.len).unwrap_or(usize::MAX);
        let mut out = vec![0u8; len.min(1 << 20)];
        let avail = &page[offset..];
        let n = avail.len().min(out.len());
        out[..n].copy_from_slice(&avail[..n]);
        AdminReply::data(out)
    }

    /// The discovery log page of the current generation, built on first use.
    fn discovery_page(&self, target: &Target, origin: QueueOrigin) -> Arc<[u8]> {
        let generation = target.discovery_genctr();
        let mut cached = self.discovery_page.lock();
        match &*cached {
            Some((g, page)) if *g == generation => Arc::clone(page),
            _ => {
                let page: Arc<[u8]> =
                    discovery::log_page(target, &self.hostnqn, origin.local).into();
                *cached = Some((generation, Arc::clone(&page)));
                page
            }
        }
    }

    fn smart_log(&self) -> SmartLog {
        let c = self.counters.totals();
        let mut s = SmartLog::zeroed();
        s.temperature.set(273 + 35);
        s.avail_spare = 100;
        s.spare_thresh = 10;
        // Data units are thousands of 512-byte units, rounded up.
        let units = |bytes: u64| u128::from(bytes.div_ceil(512 * 1000));
        s.data_units_read = u128_le(units(c.bytes_read));
        s.data_units_written = u128_le(units(c.bytes_written));
        s.host_reads = u128_le(u128::from(c.reads));
        s.host_writes = u128_le(u128::from(c.writes));
        s.power_cycles = u128_le(1);
        s.power_on_hours = u128_le(u128::from(self.started.elapsed().as_secs() / 3600));
        s.media_errors = u128_le(u128::from(c.media_errors));
        s.num_err_log_entries = u128_le(u128::from(self.state.lock().error_count));
        s
    }

    fn set_features(&self, target: &Target, fid: u8, cdw11: u32) -> AdminReply {
        let invalid_field = AdminReply::err(Status::generic(generic::INVALID_FIELD).with_dnr());
        let mut st = self.state.lock();
        match fid {
            features::NUMBER_OF_QUEUES if !self.is_discovery() => {
                let nsqr = cdw11 & 0xFFFF;
                let ncqr = cdw11 >> 16;
                if nsqr == 0xFFFF || ncqr == 0xFFFF {
                    return invalid_field;
                }
                if !st.queues_set {
                    let want = (nsqr.min(ncqr) + 1).min(u32::from(target.settings.max_io_queues));
                    st.io_queues = want as u16;
                    st.queues_set = true;
                }
                let n = u32::from(st.io_queues - 1);
                AdminReply::ok(n | (n << 16))
            }
            features::KEEP_ALIVE_TIMER => {
                // As at Connect: 0 does not switch keep alive off (a silent host would then
                // hold its controller forever); it means the target's default.
                st.kato_ms = if cdw11 == 0 {
                    target.settings.default_kato_ms
                } else {
                    cdw11
                };
                drop(st);
                self.keep_alive();
                AdminReply::ok(0)
            }
            features::ASYNC_EVENT_CONFIG => {
                st.aec = cdw11;
                AdminReply::ok(0)
            }
            features::VOLATILE_WRITE_CACHE if self.volatile_write_cache() => {
                // The cache cannot be turned off; writes are made durable by Flush and FUA.
                if cdw11 & 1 == 0 {
                    return AdminReply::err(Status::specific(specific::FEATURE_NOT_CHANGEABLE));
                }
                AdminReply::ok(0)
            }
            _ => invalid_field,
        }
    }

    /// Get (`set` None) or Set Features Reservation Notification Mask or Reservation
    /// Persistence of namespace `nsid`.
    fn reservation_feature(
        &self,
        target: &Target,
        nsid: u32,
        fid: u8,
        set: Option<u32>,
    ) -> AdminReply {
        let Some(ns) = self
            .subsystem()
            .and_then(|s| s.namespaces().get(&nsid).cloned())
            .filter(|ns| ns.visible_to(&self.hostnqn))
        else {
            return AdminReply::err(Status::generic(generic::INVALID_NAMESPACE).with_dnr());
        };
        ns.reservations
            .bind(target.settings.state_dir.as_deref(), &ns.nguid);
        match (fid, set) {
            (features::RESERVATION_NOTIFICATION_MASK, None) => AdminReply::ok(
                self.state
                    .lock()
                    .resv_masks
                    .get(&nsid)
                    .copied()
                    .unwrap_or(0),
            ),
            (features::RESERVATION_NOTIFICATION_MASK, Some(v)) => {
                self.state.lock().resv_masks.insert(nsid, v & 0b1110);
                AdminReply::ok(0)
            }
            (_, None) => AdminReply::ok(u32::from(ns.reservations.snapshot().ptpl())),
            (_, Some(v)) => match ns.reservations.set_ptpl(v & 1 != 0) {
                Ok(()) => AdminReply::ok(0),
                Err(s) => AdminReply::err(s),
            },
        }
    }

    fn get_features(&self, fid: u8) -> AdminReply {
        let st = self.state.lock();
        match fid {
            features::NUMBER_OF_QUEUES if !self.is_discovery() => {
                let n = u32::from(st.io_queues.max(1) - 1);
                AdminReply::ok(n | (n << 16))
            }
            features::KEEP_ALIVE_TIMER => AdminReply::ok(st.kato_ms),
            features::ASYNC_EVENT_CONFIG => AdminReply::ok(st.aec),
            // Without a volatile write cache the feature does not exist (Invalid Field).
            features::VOLATILE_WRITE_CACHE if self.volatile_write_cache() => AdminReply::ok(1),
            features::ARBITRATION
            | features::POWER_MANAGEMENT
            | features::TEMPERATURE_THRESHOLD
            | features::INTERRUPT_COALESCING
                if !self.is_discovery() =>
            {
                AdminReply::ok(0)
            }
            _ => AdminReply::err(Status::generic(generic::INVALID_FIELD).with_dnr()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A controller of the test target's subsystem, and the target.
    fn io_controller() -> (Arc<Target>, Arc<Controller>) {
        let t = crate::testing::target(&["mem:1M"]);
        let s = Arc::clone(t.subsystems().values().next().unwrap());
        let (c, _events) = Controller::new(
            1,
            ControllerKind::Io(s),
            "nqn.h".into(),
            [0; 16],
            crate::testing::origin(),
            32,
            0,
        );
        (t, c)
    }

    #[test]
    fn reservation_notices_fill_the_log_page_once_each_and_respect_the_mask() {
        use crate::reservation::Notice;
        use nvme_spec::command::build;
        let (t, c) = io_controller();
        let origin = crate::testing::origin();
        let page = |c: &Controller| {
            let sqe = build::get_log_page(1, log_id::RESERVATION_NOTIFICATION, 0, 64, 0);
            match c.admin(&t, origin, &sqe, AdminCommand::parse(&sqe)) {
                AdminReply::Complete {
                    data: Some(d),
                    status,
                    ..
                } if status.is_success() => d,
                _ => panic!("no log page"),
            }
        };
        c.notify_reservation(1, Notice::RegistrationPreempted);
        c.notify_reservation(1, Notice::ReservationReleased);
        let first = page(&c);
        assert_eq!(u64::from_le_bytes(first[0..8].try_into().unwrap()), 1);
        assert_eq!((first[8], first[9]), (1, 1), "type, one more available");
        assert_eq!(u32::from_le_bytes(first[12..16].try_into().unwrap()), 1);
        let second = page(&c);
        assert_eq!((second[0], second[8], second[9]), (2, 2, 0));
        assert!(page(&c).iter().all(|&b| b == 0), "empty once read");
        // Set Features 82h masks Reservation Released (bit 2) on namespace 1.
        let mut set = build::set_features(2, features::RESERVATION_NOTIFICATION_MASK, 1 << 2);
        set.nsid.set(1);
        let reply = c.admin(&t, origin, &set, AdminCommand::parse(&set));
        assert!(matches!(reply, AdminReply::Complete { status, .. } if status.is_success()));
        c.notify_reservation(1, Notice::ReservationReleased);
        assert!(page(&c).iter().all(|&b| b == 0), "masked");
    }

    #[test]
    fn cc_and_csts_follow_enable_reset_and_shutdown() {
        let (t, c) = io_controller();
        let csts = |c: &Controller| c.property_get(&t, property::CSTS, false).unwrap() as u32;
        let en = u64::from(Cc::enable_value());
        // Enabled with queue entry sizes it does not support: fatal status, not ready.
        c.property_set(property::CC, false, 1).unwrap();
        assert_eq!(csts(&c), csts::CFS);
        // A reset clears it; enabled properly, the controller is ready and not failed.
        c.property_set(property::CC, false, 0).unwrap();
        assert_eq!(csts(&c), 0);
        c.property_set(property::CC, false, en).unwrap();
        assert_eq!(csts(&c), csts::RDY);
        assert!(c.is_ready());
        // A normal shutdown completes and leaves the controller not ready.
        let shn = u64::from(Cc::shutdown_value(Cc::enable_value()));
        assert_eq!(c.property_set(property::CC, false, shn), Ok(true));
        assert_eq!(csts(&c), csts::SHST_COMPLETE);
        assert!(!c.is_ready());
        // Until a reset and a new enable.
        c.property_set(property::CC, false, 0).unwrap();
        c.property_set(property::CC, false, en).unwrap();
        assert_eq!(csts(&c), csts::RDY);
    }

    #[test]
    fn each_granted_io_queue_is_connected_once_at_a_time() {
        let (t, c) = io_controller();
        assert!(!c.claim_queue(1), "no queues granted yet");
        // Two I/O queues (0's based counts).
        let granted = c.set_features(&t, features::NUMBER_OF_QUEUES, 0x0001_0001);
        assert!(matches!(granted, AdminReply::Complete { status, .. } if status.is_success()));
        assert!(!c.claim_queue(0));
        assert!(c.claim_queue(1));
        assert!(!c.claim_queue(1), "already connected");
        assert!(c.claim_queue(2));
        assert!(!c.claim_queue(3), "beyond the queues granted");
        c.release_queue(1);
        assert!(c.claim_queue(1));
    }

    #[test]
    fn keep_alive_timer_zero_means_the_default() {
        let (t, c) = io_controller();
        c.set_features(&t, features::KEEP_ALIVE_TIMER, 0);
        assert_eq!(c.kato_ms(), t.settings.default_kato_ms);
        assert!(c.keep_alive_deadline().is_some());
        c.set_features(&t, features::KEEP_ALIVE_TIMER, 5000);
        assert_eq!(c.kato_ms(), 5000);
    }

    #[test]
    fn striped_counters_add_up_over_threads() {
        let c = Arc::new(IoCounters::default());
        let threads: Vec<_> = (0..20u64)
            .map(|t| {
                let c = Arc::clone(&c);
                std::thread::spawn(move || {
                    for _ in 0..1000 {
                        c.read(512);
                        c.write(4096 * (t + 1));
                    }
                    if t % 2 == 0 {
                        c.media_error();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let t = c.totals();
        assert_eq!(t.reads, 20_000);
        assert_eq!(t.bytes_read, 20_000 * 512);
        assert_eq!(t.writes, 20_000);
        assert_eq!(t.bytes_written, 1000 * 4096 * (1..=20).sum::<u64>());
        assert_eq!(t.media_errors, 10);
        // The threads counted in several stripes.
        let used = c
            .stripes
            .iter()
            .filter(|s| s.reads.load(Ordering::Relaxed) > 0)
            .count();
        assert!(used > 1, "{used} stripe(s) used");
        assert_eq!(std::mem::align_of::<Stripe>(), 64);
    }
}

/// Namespace masking and ANA as hosts see them, changed live through the control requests.
#[cfg(test)]
mod access_tests {
    use nvme_spec::command::{build, cns, log_id};
    use nvme_spec::features::{self, aer_dw0, aer_notice, aer_type};
    use nvme_spec::identify::{CMIC_ANA, IdentifyController, IdentifyNamespace};
    use nvme_spec::log::{AnaState, decode_ana_log};
    use nvme_spec::queue::SglDescriptor;
    use nvme_spec::status::{generic, path, sct};
    use nvme_spec::{Cqe, FromBytes, Sqe, Status};

    use crate::control::{Request, encode, handle};
    use crate::queue::{HostSgl, QueueState, Submit};
    use crate::reconfigure::Registry;
    use crate::testing::{HOST, NQN, connected_as, origin, registry};

    use super::QueueOrigin;

    const OTHER: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-0000000000bb";

    fn answer(q: &mut QueueState, sqe: &Sqe) -> Cqe {
        match q.submit(sqe, &[]) {
            Submit::Complete(c) | Submit::CompleteAndClose(c) | Submit::CompleteWithData(_, c) => c,
            Submit::Io(_) => Cqe::new(sqe.cid(), Status::SUCCESS, 0),
            Submit::Held => panic!("held"),
            Submit::Abandon => panic!("abandoned: the controller is gone"),
        }
    }

    fn data(q: &mut QueueState, sqe: &Sqe) -> Result<Vec<u8>, Status> {
        let mut sqe = *sqe;
        sqe.dptr = SglDescriptor::tcp_transport(4096);
        match q.submit(&sqe, &[]) {
            Submit::CompleteWithData(d, c) if c.status().is_success() => Ok(d),
            Submit::Complete(c) => Err(c.status()),
            _ => panic!("no answer"),
        }
    }

    fn read(cid: u16, nsid: u32) -> Sqe {
        let mut sqe = build::read_write(false, cid, nsid, 0, 1);
        sqe.dptr = SglDescriptor::tcp_transport(4096);
        sqe
    }

    fn active(admin: &mut QueueState) -> Vec<u32> {
        let list = data(admin, &build::identify(1, cns::ACTIVE_NS_LIST, 0)).unwrap();
        list.chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .take_while(|&n| n != 0)
            .collect()
    }

    fn ctl(r: &Registry, req: Request) -> Result<Vec<String>, String> {
        let resp = handle(r, &encode(&req));
        match resp.error {
            Some(e) => Err(e),
            None => Ok(resp.changes.unwrap_or_default()),
        }
    }

    /// Enables the notices of `aec` and holds an Asynchronous Event Request.
    fn hold_aer(admin: &mut QueueState, aec: u32) {
        let set = build::set_features(2, features::ASYNC_EVENT_CONFIG, aec);
        assert!(answer(admin, &set).status().is_success());
        assert!(matches!(
            admin.submit(&build::async_event_request(3), &[]),
            Submit::Held
        ));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_masked_namespace_is_inactive_for_other_hosts_until_shown_to_them() {
        let r = registry(&["mem:1M", "mem:1M"]);
        r.edit(|c| {
            c.subsystems[0].namespaces[1].hosts = vec![OTHER.into()];
            Ok(())
        })
        .unwrap();
        let (mut admin, mut io) = connected_as(r.target(), HostSgl::Transport, origin(), HOST);
        let (mut other_admin, mut other_io) =
            connected_as(r.target(), HostSgl::Transport, origin(), OTHER);
        let mut events = admin.events.take().unwrap();
        let mut other_events = other_admin.events.take().unwrap();

        assert_eq!(active(&mut admin), vec![1]);
        assert_eq!(active(&mut other_admin), vec![1, 2]);
        // As an inactive NSID: a zeroed Identify Namespace, no descriptors, no I/O.
        let id = data(&mut admin, &build::identify(4, cns::NAMESPACE, 2)).unwrap();
        assert!(id.iter().all(|&b| b == 0));
        let invalid_ns = Status::generic(generic::INVALID_NAMESPACE).with_dnr();
        assert_eq!(
            data(&mut admin, &build::identify(5, cns::NS_DESCRIPTORS, 2)),
            Err(invalid_ns)
        );
        assert_eq!(answer(&mut io, &read(6, 2)).status(), invalid_ns);
        assert!(answer(&mut other_io, &read(6, 2)).status().is_success());
        let id = data(&mut other_admin, &build::identify(4, cns::NAMESPACE, 2)).unwrap();
        assert_eq!(
            IdentifyNamespace::read_from_bytes(&id).unwrap().nsze.get(),
            256
        );

        // Shown to the host: its controller is told, the other host's is not.
        hold_aer(&mut admin, features::AEC_NS_ATTRIBUTE_NOTICES);
        hold_aer(&mut other_admin, features::AEC_NS_ATTRIBUTE_NOTICES);
        let add = |host: &str| Request::NsAddHost {
            subsystem: NQN.into(),
            nsid: 2,
            host: host.into(),
        };
        let lines = ctl(&r, add(HOST)).unwrap();
        assert!(lines[0].contains("seen by"), "{lines:?}");
        let notice = aer_dw0(
            aer_type::NOTICE,
            aer_notice::NS_ATTRIBUTE_CHANGED,
            log_id::CHANGED_NS_LIST,
        );
        assert_eq!(events.try_recv().unwrap().dw0.get(), notice);
        assert!(other_events.try_recv().is_err(), "nothing changed for it");
        assert_eq!(active(&mut admin), vec![1, 2]);
        assert!(answer(&mut io, &read(7, 2)).status().is_success());
        assert!(ctl(&r, add(HOST)).unwrap_err().contains("already shown"));

        // Hidden from the other host: its I/O fails at once.
        let remove = |host: &str| Request::NsRemoveHost {
            subsystem: NQN.into(),
            nsid: 2,
            host: host.into(),
        };
        ctl(&r, remove(OTHER)).unwrap();
        assert_eq!(other_events.try_recv().unwrap().dw0.get(), notice);
        assert_eq!(answer(&mut other_io, &read(8, 2)).status(), invalid_ns);
        assert_eq!(active(&mut other_admin), vec![1]);
        // The last host stays: removing it would show the namespace to every host.
        assert!(ctl(&r, remove(HOST)).unwrap_err().contains("last host"));
        assert!(ctl(&r, remove(OTHER)).unwrap_err().contains("not shown"));
        assert_eq!(r.config().subsystems[0].namespaces[1].hosts, vec![HOST]);

        // A namespace added for the other host only: that host is told, this one is not.
        let changed_log = build::get_log_page(9, log_id::CHANGED_NS_LIST, 0, 4096, 0);
        data(&mut admin, &changed_log).unwrap();
        data(&mut other_admin, &changed_log).unwrap();
        let added = Request::AddNamespace {
            subsystem: NQN.into(),
            backend: "mem:1M".into(),
            nsid: Some(3),
            uuid: None,
            hosts: vec![OTHER.into()],
            ana_group: None,
        };
        ctl(&r, added).unwrap();
        let aer = build::async_event_request(11);
        assert_eq!(answer(&mut other_admin, &aer).dw0.get(), notice);
        assert!(matches!(admin.submit(&aer, &[]), Submit::Held), "no notice");
        assert_eq!(active(&mut admin), vec![1, 2]);
        assert_eq!(active(&mut other_admin), vec![1, 3]);
        r.running().shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ana_states_follow_the_listener_and_refuse_io_with_path_statuses() {
        let r = registry(&["mem:1M", "mem:1M"]);
        let listener = r.config().listeners[0].address.clone();
        let here = QueueOrigin {
            local: listener.addr,
            peer: origin().peer,
        };
        let (mut admin, mut io) = connected_as(r.target(), HostSgl::Transport, here, HOST);
        // A controller connected elsewhere (another listener) keeps its states.
        let (mut elsewhere_admin, mut elsewhere_io) =
            connected_as(r.target(), HostSgl::Transport, origin(), HOST);
        let mut events = admin.events.take().unwrap();
        let mut elsewhere_events = elsewhere_admin.events.take().unwrap();

        let id = data(&mut admin, &build::identify(1, cns::CONTROLLER, 0)).unwrap();
        let id = IdentifyController::read_from_bytes(&id).unwrap();
        assert_ne!(id.cmic & CMIC_ANA, 0);
        assert_eq!(id.anacap & 0x1F, 0x1F, "every state reported");
        assert_eq!(id.anagrpmax.get(), crate::ana::MAX_ANA_GROUPS);
        assert_eq!(id.nanagrpid.get(), crate::ana::MAX_ANA_GROUPS);
        assert_ne!(id.anatt, 0);
        assert_ne!(id.oaes.get() & (1 << 11), 0, "OAES: ANA change notices");
        let ns = data(&mut admin, &build::identify(2, cns::NAMESPACE, 2)).unwrap();
        assert_eq!(
            IdentifyNamespace::read_from_bytes(&ns)
                .unwrap()
                .anagrpid
                .get(),
            1
        );

        let log = |q: &mut QueueState, rgo: bool| {
            let mut sqe = build::get_log_page(4, log_id::ANA, 0, 4096, 0);
            if rgo {
                sqe.cdw10.set(sqe.cdw10.get() | (1 << 8));
            }
            decode_ana_log(&data(q, &sqe).unwrap()).unwrap()
        };
        let (chgcnt, groups) = log(&mut admin, false);
        assert_eq!(groups.len(), 1);
        assert_eq!(
            (groups[0].grpid, groups[0].state, groups[0].nsids.clone()),
            (1, AnaState::Optimized, vec![1, 2])
        );

        hold_aer(&mut admin, features::AEC_ANA_CHANGE);
        hold_aer(&mut elsewhere_admin, features::AEC_ANA_CHANGE);
        let set = |state: &str| Request::SetAnaState {
            listener: listener.to_string(),
            group: 1,
            state: state.into(),
        };
        let lines = ctl(&r, set("inaccessible")).unwrap();
        assert_eq!(
            lines,
            vec![format!(
                "listener {listener}: ANA group 1 is now inaccessible (was optimized)"
            )]
        );
        let notice = aer_dw0(aer_type::NOTICE, aer_notice::ANA_CHANGE, log_id::ANA);
        assert_eq!(events.try_recv().unwrap().dw0.get(), notice);
        assert!(
            elsewhere_events.try_recv().is_err(),
            "its path did not change"
        );
        let refused = |sc| Status {
            sct: sct::PATH,
            sc,
            ..Default::default()
        };
        let st = answer(&mut io, &read(5, 1)).status();
        assert_eq!(st, refused(path::ANA_INACCESSIBLE));
        assert!(!st.dnr, "the host retries on another path");
        assert!(answer(&mut elsewhere_io, &read(5, 1)).status().is_success());
        let (later, groups) = log(&mut admin, true);
        assert!(later > chgcnt, "the change count moves");
        assert_eq!(groups[0].state, AnaState::Inaccessible);
        assert!(groups[0].nsids.is_empty(), "RGO: groups only");

        // A second notice waits for the log page to be read without RAE (done above).
        ctl(&r, set("persistent-loss")).unwrap();
        assert_eq!(
            answer(&mut admin, &build::async_event_request(6)).dw0.get(),
            notice
        );
        assert_eq!(
            answer(&mut io, &read(7, 1)).status(),
            refused(path::ANA_PERSISTENT_LOSS)
        );
        ctl(&r, set("change")).unwrap();
        assert_eq!(
            answer(&mut io, &read(8, 1)).status(),
            refused(path::ANA_TRANSITION)
        );
        ctl(&r, set("non-optimized")).unwrap();
        assert!(answer(&mut io, &read(9, 1)).status().is_success());
        ctl(&r, set("optimized")).unwrap();
        assert!(
            r.config().listeners[0].ana.is_empty(),
            "optimized is the default"
        );

        // Refusals name what is wrong.
        let e = ctl(&r, set("sleepy")).unwrap_err();
        assert!(e.contains("unknown ANA state"), "{e}");
        let e = ctl(
            &r,
            Request::SetAnaState {
                listener: "tcp://127.0.0.1:1".into(),
                group: 1,
                state: "optimized".into(),
            },
        )
        .unwrap_err();
        assert!(e.contains("no I/O listener"), "{e}");
        let e = ctl(
            &r,
            Request::SetAnaState {
                listener: listener.to_string(),
                group: 0,
                state: "optimized".into(),
            },
        )
        .unwrap_err();
        assert!(e.contains("ANA group 0"), "{e}");
        r.running().shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reload_changes_masking_and_ana_states_with_their_notices() {
        let r = registry(&["mem:1M", "mem:1M"]);
        let listener = r.config().listeners[0].address.clone();
        let here = QueueOrigin {
            local: listener.addr,
            peer: origin().peer,
        };
        let (mut admin, mut io) = connected_as(r.target(), HostSgl::Transport, here, HOST);
        let (mut other_admin, _other_io) =
            connected_as(r.target(), HostSgl::Transport, origin(), OTHER);
        let mut events = admin.events.take().unwrap();
        let mut other_events = other_admin.events.take().unwrap();
        let aec = features::AEC_NS_ATTRIBUTE_NOTICES | features::AEC_ANA_CHANGE;
        hold_aer(&mut admin, aec);
        hold_aer(&mut other_admin, aec);

        // The file now shows namespace 2 to the other host only and makes group 1
        // inaccessible on the listener this host connected through.
        let mut file = r.config();
        file.subsystems[0].namespaces[1].hosts = vec![OTHER.into()];
        file.listeners[0].ana = vec![crate::config::AnaGroupState {
            group: 1,
            state: AnaState::Inaccessible,
        }];
        let lines = r.apply(file).unwrap();
        assert!(
            lines
                .iter()
                .any(|l| l.contains("namespace 2 is now seen by")),
            "{lines:?}"
        );
        assert!(
            lines.contains(&format!(
                "listener {listener}: ANA group 1 is now inaccessible (was optimized)"
            )),
            "{lines:?}"
        );
        // This host lost namespace 2 and its path changed: both notices, one per AER.
        let ns_notice = aer_dw0(
            aer_type::NOTICE,
            aer_notice::NS_ATTRIBUTE_CHANGED,
            log_id::CHANGED_NS_LIST,
        );
        assert_eq!(events.try_recv().unwrap().dw0.get(), ns_notice);
        let ana_notice = aer_dw0(aer_type::NOTICE, aer_notice::ANA_CHANGE, log_id::ANA);
        assert_eq!(
            answer(&mut admin, &build::async_event_request(6)).dw0.get(),
            ana_notice
        );
        assert_eq!(active(&mut admin), vec![1]);
        let st = answer(&mut io, &read(7, 1)).status();
        assert_eq!((st.sct, st.sc), (sct::PATH, path::ANA_INACCESSIBLE));
        // The other host saw namespace 2 before and after, through another listener.
        assert!(other_events.try_recv().is_err(), "nothing changed for it");
        assert_eq!(active(&mut other_admin), vec![1, 2]);

        // The same file again changes nothing; an ANA group or controller ID range does not
        // change while the target runs.
        assert_eq!(r.apply(r.config()).unwrap(), Vec::<String>::new());
        let mut file = r.config();
        file.subsystems[0].cntlid_min = Some(100);
        let e = r.apply(file).unwrap_err().to_string();
        assert!(
            e.contains("cntlid_min and cntlid_max change only at a restart"),
            "{e}"
        );
        r.running().shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn masking_and_ana_requests_retried_remotely_change_nothing_twice() {
        let r = registry(&["mem:1M", "mem:1M"]);
        let listener = r.config().listeners[0].address.to_string();
        let retried = |req: Request| {
            let first = crate::control::answer(&r, &req, true);
            let again = crate::control::answer(&r, &req, true);
            assert!(first.ok && again.ok, "{req:?}: {first:?} {again:?}");
            assert!(!first.changes.unwrap_or_default().is_empty(), "{req:?}");
            assert_eq!(again.changes.unwrap_or_default(), Vec::<String>::new());
        };
        for host in [HOST, OTHER] {
            retried(Request::NsAddHost {
                subsystem: NQN.into(),
                nsid: 2,
                host: host.into(),
            });
        }
        retried(Request::NsRemoveHost {
            subsystem: NQN.into(),
            nsid: 2,
            host: OTHER.into(),
        });
        retried(Request::SetAnaState {
            listener,
            group: 3,
            state: "change".into(),
        });
        assert_eq!(r.config().subsystems[0].namespaces[1].hosts, vec![HOST]);
        r.running().shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn namespaces_in_other_groups_keep_their_state() {
        let r = registry(&["mem:1M", "mem:1M"]);
        let e = r.edit(|c| {
            c.subsystems[0].namespaces[1].ana_group = Some(2);
            Ok(())
        });
        assert!(e.unwrap_err().to_string().contains("only at a restart"));
        let r = {
            r.running().shutdown().await;
            let mut cfg = crate::testing::config(&["mem:1M", "mem:1M"]);
            cfg.target.reactors = 1;
            cfg.subsystems[0].namespaces[1].ana_group = Some(2);
            let (t, l) = (crate::Target::build(&cfg), crate::launcher::bind(&cfg));
            Registry::new(
                crate::RunningTarget::start(t.unwrap(), l.unwrap()).unwrap(),
                cfg,
            )
        };
        let listener = r.config().listeners[0].address.clone();
        let here = QueueOrigin {
            local: listener.addr,
            peer: origin().peer,
        };
        let (mut admin, mut io) = connected_as(r.target(), HostSgl::Transport, here, HOST);
        ctl(
            &r,
            Request::SetAnaState {
                listener: listener.to_string(),
                group: 2,
                state: "inaccessible".into(),
            },
        )
        .unwrap();
        assert!(answer(&mut io, &read(1, 1)).status().is_success());
        assert_eq!(
            answer(&mut io, &read(2, 2)).status().sc,
            path::ANA_INACCESSIBLE
        );
        let ns = data(&mut admin, &build::identify(2, cns::NAMESPACE, 2)).unwrap();
        assert_eq!(
            IdentifyNamespace::read_from_bytes(&ns)
                .unwrap()
                .anagrpid
                .get(),
            2
        );
        let page = data(&mut admin, &build::get_log_page(4, log_id::ANA, 0, 4096, 0)).unwrap();
        let (_, groups) = decode_ana_log(&page).unwrap();
        let summary: Vec<_> = groups
            .iter()
            .map(|g| (g.grpid, g.state, g.nsids.clone()))
            .collect();
        assert_eq!(
            summary,
            vec![
                (1, AnaState::Optimized, vec![1]),
                (2, AnaState::Inaccessible, vec![2])
            ]
        );
        r.running().shutdown().await;
    }
}
