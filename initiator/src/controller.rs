//! Controllers: the association with an NVM subsystem (admin queue and I/O queues), its
//! keep-alive, asynchronous events, reconnect after a lost connection, and graceful
//! disconnect.
//!
//! Tasks, per controller:
//! - one queue task per queue ([`crate::queue`]);
//! - the supervisor, which owns the association: it reconnects (admin queue, then every I/O
//!   queue) with exponential backoff when a queue reports a lost connection, and performs the
//!   graceful shutdown;
//! - the keep-alive task (Keep Alive every KATO/2 on the admin queue);
//! - the event task, which keeps an Asynchronous Event Request posted and reacts to events
//!   (a namespace attribute change refreshes the namespace list).

use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use nvme_spec::command::{build, cns, log_id};
use nvme_spec::fabrics::{Cc, property};
use nvme_spec::identify::{
    IdentifyController, IdentifyNamespace, OAES_NS_ATTRIBUTE, SGLS_KEYED, cntrltype,
};
use nvme_spec::{FromBytes, features};
use parking_lot::{Mutex, RwLock};
use serde::{Deserialize, Serialize};
use tokio::sync::{broadcast, mpsc, oneshot, watch};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::admin::{self, Admin, admin_request};
use crate::info::{ControllerInfo, NamespaceInfo, fill_from_identify, namespace_info};
use crate::link::Link;
use crate::queue::{
    DataDir, QueueConfig, QueueCtl, QueueHandle, QueueStats, Request, Retry, SupMsg,
};
use crate::queue_core::LinkLimits;
use crate::rdma::SharedPd;
use crate::setup::{QueueSpec, SetupConn};
use crate::{ConnectOptions, Error, QueuePolicy, RegisteredBuffer, Transport};

/// Entries of the admin queue.
const ADMIN_QUEUE_ENTRIES: u16 = 32;
/// Transfer limit used when the controller reports none (MDTS 0).
const DEFAULT_MAX_TRANSFER: u64 = 1 << 20;

/// Connection state of a controller.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "lowercase")]
pub enum ControllerState {
    /// All queues are connected.
    Connected,
    /// A connection was lost; the association is being re-established.
    Reconnecting {
        /// Attempts made so far.
        attempt: u32,
        /// Why the last connection or attempt failed.
        last_error: String,
    },
    /// Reconnecting gave up; every command fails.
    Failed {
        /// The last error.
        error: String,
    },
    /// Disconnected by the host.
    Closed,
}

/// Something that happened to a controller.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ControllerEvent {
    /// The association was re-established after a connection loss.
    Reconnected {
        /// New controller ID.
        cntlid: u16,
    },
    /// An asynchronous event completed (NVMe Base 2.0 section 5.2).
    AsyncEvent {
        /// Event type (0 error, 1 SMART/health, 2 notice, 6 I/O command set, 7 vendor).
        event_type: u8,
        /// Event information.
        info: u8,
        /// Log page to read for details.
        log_page: u8,
    },
    /// The namespace list was refreshed after a namespace attribute change.
    NamespacesChanged {
        /// Active namespace IDs now.
        nsids: Vec<u32>,
        /// The namespaces the Changed Namespace List log page (04h) names; `None` when it
        /// could not be read or names more than 1024 (then any namespace may have changed).
        changed: Option<Vec<u32>>,
    },
}

#[derive(Clone, Debug)]
struct StateInfo {
    state: ControllerState,
    generation: u64,
}

/// The namespace cache.
#[derive(Default)]
struct NsCache {
    active: Vec<u32>,
    info: BTreeMap<u32, NamespaceInfo>,
}

/// State shared by a controller's handles and tasks.
pub(crate) struct CtrlShared {
    pub opts: ConnectOptions,
    pub addr: String,
    pub admin: QueueHandle,
    pub io: Vec<QueueHandle>,
    active_io: AtomicUsize,
    round_robin: AtomicUsize,
    max_transfer: AtomicU32,
    info: RwLock<ControllerInfo>,
    identify: RwLock<Box<IdentifyController>>,
    namespaces: RwLock<NsCache>,
    state: watch::Sender<StateInfo>,
    events: broadcast::Sender<ControllerEvent>,
    reconnects: AtomicU64,
    /// The protection domain of the NVMe/RDMA queues (kept across reconnects).
    pub pd: SharedPd,
    /// What the transport allows.
    pub limits: LinkLimits,
    /// I/O queue IDs of queue pairs.
    pair_qids: Mutex<PairQids>,
}

/// The I/O queue IDs kept for queue pairs: those past the shared I/O queues, up to the
/// highest the controller granted.
struct PairQids {
    max_qid: u16,
    used: BTreeSet<u16>,
}

/// An I/O queue ID held by a queue pair; given back when dropped.
pub(crate) struct PairQid {
    shared: Arc<CtrlShared>,
    qid: u16,
}

impl PairQid {
    /// The queue ID.
    pub fn qid(&self) -> u16 {
        self.qid
    }
}

impl Drop for PairQid {
    fn drop(&mut self) {
        self.shared.pair_qids.lock().used.remove(&self.qid);
    }
}

impl CtrlShared {
    /// Largest transfer per command in bytes.
    pub fn info_max_transfer(&self) -> u32 {
        self.max_transfer.load(Ordering::Relaxed)
    }

    /// Reads a field of the controller information.
    pub fn info_flag(&self, f: impl FnOnce(&ControllerInfo) -> bool) -> bool {
        f(&self.info.read())
    }

    fn generation(&self) -> u64 {
        self.state.borrow().generation
    }

    /// The running admin queue as an [`Admin`].
    fn admin_api(&self) -> AdminQueue<'_> {
        AdminQueue(self)
    }

    async fn identify_namespace_raw(&self, nsid: u32) -> Result<IdentifyNamespace, Error> {
        let raw = self.admin_api().identify(cns::NAMESPACE, nsid).await?;
        IdentifyNamespace::read_from_bytes(&raw)
            .map_err(|_| Error::Refused("short Identify Namespace data".into()))
    }

    async fn load_namespace(&self, nsid: u32) -> Result<Option<NamespaceInfo>, Error> {
        let id = self.identify_namespace_raw(nsid).await?;
        let desc = self
            .admin_api()
            .identify(cns::NS_DESCRIPTORS, nsid)
            .await
            .ok();
        Ok(namespace_info(nsid, &id, desc.as_deref()))
    }

    async fn active_namespace_ids(&self) -> Result<Vec<u32>, Error> {
        let mut out = Vec::new();
        let mut after = 0u32;
        loop {
            let raw = self
                .admin_api()
                .identify(cns::ACTIVE_NS_LIST, after)
                .await?;
            let ids = nvme_spec::identify::decode_ns_list(&raw);
            let full = ids.len() == 1024;
            let last = ids.last().copied();
            out.extend(ids);
            match last {
                Some(l) if full && l < 0xFFFF_FFFE => after = l,
                _ => return Ok(out),
            }
        }
    }

    /// Re-reads the active namespace list and the namespaces already looked at.
    async fn refresh_namespaces(&self) -> Result<Vec<u32>, Error> {
        let active = self.active_namespace_ids().await?;
        let known: Vec<u32> = self.namespaces.read().info.keys().copied().collect();
        let mut info = BTreeMap::new();
        for nsid in known {
            if active.contains(&nsid) {
                if let Some(i) = self.load_namespace(nsid).await? {
                    info.insert(nsid, i);
                }
            }
        }
        let mut cache = self.namespaces.write();
        cache.active = active.clone();
        cache.info = info;
        Ok(active)
    }

    fn set_state(&self, state: ControllerState, generation: u64) {
        self.state.send_replace(StateInfo { state, generation });
    }
}

/// A connection to one NVM subsystem: an admin queue and a set of I/O queues, each its own
/// TCP connection or RDMA queue pair. Cheap to clone; the connection closes (gracefully, in the background) when
/// the last clone and the last [`Namespace`](crate::Namespace) of it are dropped, or at once with
/// [`disconnect`](Self::disconnect).
#[derive(Clone)]
pub struct Controller {
    inner: Arc<CtrlInner>,
}

pub(crate) struct CtrlInner {
    pub shared: Arc<CtrlShared>,
    sup_tx: mpsc::UnboundedSender<SupMsg>,
}

impl Drop for CtrlInner {
    fn drop(&mut self) {
        let _ = self.sup_tx.send(SupMsg::Shutdown { reply: None });
    }
}

impl std::fmt::Debug for Controller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let info = self.info();
        f.debug_struct("Controller")
            .field("addr", &info.addr)
            .field("subnqn", &info.subnqn)
            .field("cntlid", &info.cntlid)
            .field("state", &self.state())
            .finish()
    }
}

/// The result of setting up an association.
struct Established {
    admin: Link,
    ios: Vec<Link>,
    /// The highest I/O queue ID granted (queue pairs use those past the shared queues).
    max_qid: u16,
    info: ControllerInfo,
    identify: Box<IdentifyController>,
    active_ns: Vec<u32>,
}

/// Sets up the whole association: admin queue (Connect, enable, Identify, queues), then the
/// I/O queues. `want_io` is the number of I/O queues to ask for.
async fn establish(
    opts: &ConnectOptions,
    want_io: u16,
    pd: &SharedPd,
) -> Result<Established, Error> {
    let t = &opts.timeouts;
    let digests = (opts.header_digest, opts.data_digest);
    let admin_queue = QueueSpec {
        qid: 0,
        cntlid: 0xFFFF,
        depth: ADMIN_QUEUE_ENTRIES,
        in_capsule: 0,
    };
    let tls = crate::setup::tls_context(opts)?;
    let mut admin = SetupConn::open(
        &opts.addr,
        admin_queue,
        digests,
        t.connect,
        t.admin,
        pd,
        tls.as_ref(),
    )
    .await?;
    let kato_ms = opts.kato.as_millis().min(u128::from(u32::MAX)) as u32;
    let cntlid = admin
        .connect(
            0,
            u32::from(ADMIN_QUEUE_ENTRIES),
            kato_ms,
            0xFFFF,
            &opts.subnqn,
            &opts.host,
            opts.dhchap.as_ref(),
        )
        .await?;
    let cap = admin.property_get(property::CAP, true).await?;
    let cap_to_ms = ((cap >> 24) & 0xFF) as u32 * 500;
    let cc = admin.property_get(property::CC, false).await? as u32;
    if !Cc(cc).enabled() {
        admin::enable(&mut admin, cap_to_ms, Duration::from_millis(500)).await?;
    }
    let vs = admin.property_get(property::VS, false).await? as u32;
    let raw = admin.identify(cns::CONTROLLER, 0).await?;
    let id = IdentifyController::read_from_bytes(&raw)
        .map_err(|_| Error::Refused("short Identify Controller data".into()))?;
    if id.cntlid.get() != cntlid {
        return Err(Error::Refused(format!(
            "Identify Controller reports controller ID {} but Connect returned {cntlid}",
            id.cntlid.get()
        )));
    }
    if id.cntrltype == cntrltype::DISCOVERY {
        return Err(Error::Refused(format!(
            "{} is a discovery controller, not an I/O controller",
            opts.subnqn
        )));
    }
    if id.icdoff.get() != 0 {
        return Err(Error::Refused(format!(
            "in-capsule data offset {} is not supported",
            id.icdoff.get()
        )));
    }
    if id.sgls.get() & 0b11 == 0 {
        return Err(Error::Refused(
            "the controller does not support SGLs".into(),
        ));
    }
    if id.kas.get() == 0 && kato_ms != 0 {
        return Err(Error::Refused(
            "the controller does not support Keep Alive (KAS = 0)".into(),
        ));
    }
    let subnqn = nvme_spec::identify::get_trimmed(&id.subnqn);
    if !subnqn.is_empty() && subnqn != opts.subnqn {
        return Err(Error::Refused(format!(
            "the controller belongs to {subnqn}, not {}",
            opts.subnqn
        )));
    }
    // The keep alive timeout actually in force.
    let kato_ms = match admin
        .command(build::get_features(0, features::KEEP_ALIVE_TIMER), &[], 0)
        .await
    {
        Ok((cqe, _)) => cqe.dw0.get(),
        Err(_) => kato_ms,
    };
    if id.oaes.get() & OAES_NS_ATTRIBUTE != 0 {
        if let Err(e) = admin
            .set_features(features::ASYNC_EVENT_CONFIG, OAES_NS_ATTRIBUTE)
            .await
        {
            debug!(error = %e, "cannot enable namespace attribute notices");
        }
    }
    // Queue IDs past the shared I/O queues are kept for queue pairs.
    let ask = want_io.saturating_add(opts.queue_pairs).min(u16::MAX - 1);
    let granted_all = if ask == 0 {
        0
    } else {
        let n = u32::from(ask - 1);
        let dw0 = admin
            .set_features(features::NUMBER_OF_QUEUES, n | (n << 16))
            .await?;
        let nsqa = dw0 & 0xFFFF;
        let ncqa = dw0 >> 16;
        (nsqa.min(ncqa) + 1).min(u32::from(ask)) as u16
    };
    let granted = granted_all.min(want_io);
    let active_ns = {
        let raw = admin.identify(cns::ACTIVE_NS_LIST, 0).await?;
        nvme_spec::identify::decode_ns_list(&raw)
    };
    let mqe = (cap & 0xFFFF) as u32 + 1;
    let depth = u32::from(opts.queue_depth).min(mqe).max(2) as u16;
    let mpsmin = 4096u64 << ((cap >> 48) & 0xF);
    let mdts_bytes = (id.mdts != 0).then(|| mpsmin << id.mdts.min(20));
    let mut max_transfer = mdts_bytes.unwrap_or(DEFAULT_MAX_TRANSFER);
    if let Some(m) = opts.max_transfer {
        max_transfer = max_transfer.min(u64::from(m));
    }
    let limits = admin.link.limits();
    if let Some(m) = limits.max_transfer {
        max_transfer = max_transfer.min(m);
    }
    let max_transfer = max_transfer.min(u64::from(u32::MAX)) as u32;
    let ioccsz = id.ioccsz.get();
    let mut icd = if ioccsz >= 4 {
        (ioccsz.saturating_mul(16) - 64).min(1 << 20)
    } else {
        0
    };
    if let Some(m) = limits.max_in_capsule {
        icd = icd.min(m);
    }
    if limits.needs_keyed_sgls && id.sgls.get() & SGLS_KEYED == 0 {
        return Err(Error::Refused(
            "the controller does not support keyed SGL data blocks, which NVMe/RDMA needs".into(),
        ));
    }
    let mut info = ControllerInfo {
        addr: opts.addr.to_string(),
        subnqn: String::new(),
        hostnqn: opts.host.hostnqn.clone(),
        hostid: opts.host.hostid_string(),
        cntlid,
        model: String::new(),
        serial: String::new(),
        firmware: String::new(),
        version: crate::info::version_string(vs),
        controller_type: String::new(),
        mdts_bytes,
        max_transfer_bytes: max_transfer,
        in_capsule_data_bytes: icd,
        io_queues: granted,
        queue_depth: depth,
        max_queue_entries: mqe,
        kato_ms,
        header_digest: admin.params.digests.header,
        data_digest: admin.params.digests.data,
        nn: 0,
        write_zeroes: false,
        dataset_management: false,
        volatile_write_cache: false,
    };
    fill_from_identify(&mut info, &id);

    let mut set: JoinSet<Result<(u16, Link), Error>> = JoinSet::new();
    for qid in 1..=granted {
        let opts = opts.clone();
        let pd = pd.clone();
        set.spawn(async move {
            let spec = QueueSpec {
                qid,
                cntlid,
                depth,
                in_capsule: icd as usize,
            };
            Ok((qid, open_io_queue(&opts, &pd, spec).await?))
        });
    }
    let mut ios: Vec<Option<Link>> = (0..granted).map(|_| None).collect();
    while let Some(r) = set.join_next().await {
        let (qid, live) = r.map_err(|e| {
            Error::lost(
                &opts.addr.to_string(),
                format!("I/O queue set-up task failed: {e}"),
            )
        })??;
        ios[usize::from(qid) - 1] = Some(live);
    }
    let ios = ios.into_iter().flatten().collect();
    Ok(Established {
        admin: admin.into_link(limits.admin_in_capsule),
        ios,
        max_qid: granted_all,
        info,
        identify: Box::new(id),
        active_ns,
    })
}

/// Opens I/O queue `spec.qid` of controller `spec.cntlid`: its connection (with TLS when the
/// options ask for it) and its Fabrics Connect (and authentication), on the current runtime.
pub(crate) async fn open_io_queue(
    opts: &ConnectOptions,
    pd: &SharedPd,
    spec: QueueSpec,
) -> Result<Link, Error> {
    let t = &opts.timeouts;
    let tls = crate::setup::tls_context(opts)?;
    let digests = (opts.header_digest, opts.data_digest);
    let (qid, cntlid, depth, icd) = (spec.qid, spec.cntlid, spec.depth, spec.in_capsule);
    let mut q = SetupConn::open(
        &opts.addr,
        spec,
        digests,
        t.connect,
        t.admin,
        pd,
        tls.as_ref(),
    )
    .await?;
    let dhchap = opts.dhchap.as_ref();
    q.connect(
        qid,
        u32::from(depth),
        0,
        cntlid,
        &opts.subnqn,
        &opts.host,
        dhchap,
    )
    .await?;
    Ok(q.into_link(icd))
}

thread_local! {
    static QUEUE_HINT: Cell<usize> = const { Cell::new(usize::MAX) };
}
static NEXT_HINT: AtomicUsize = AtomicUsize::new(0);

fn thread_hint() -> usize {
    QUEUE_HINT.with(|c| {
        let v = c.get();
        if v != usize::MAX {
            return v;
        }
        let v = NEXT_HINT.fetch_add(1, Ordering::Relaxed);
        c.set(v);
        v
    })
}

impl Controller {
    /// Connects to the subsystem: admin queue (Connect, enable, Identify Controller, Number of
    /// Queues), then the I/O queues, then starts keep-alive and asynchronous event handling.
    ///
    /// Fails without retrying when the first association cannot be set up; reconnects happen
    /// only after a connection that was up is lost.
    pub async fn connect(opts: ConnectOptions) -> Result<Controller, Error> {
        opts.validate()?;
        let want = opts.wanted_io_queues();
        let pd = SharedPd::default();
        let est = establish(&opts, want, &pd).await?;
        let addr = opts.addr.to_string();
        let (sup_tx, sup_rx) = mpsc::unbounded_channel();
        let scan = |t: Duration| (t / 8).clamp(Duration::from_millis(10), Duration::from_secs(1));
        let admin = QueueHandle::spawn(
            QueueConfig {
                qid: 0,
                slots: ADMIN_QUEUE_ENTRIES - 1,
                addr: addr.clone(),
                retry_writes: false,
                scan_period: scan(opts.timeouts.admin),
                busy_poll: Duration::ZERO,
                ring_poll: Duration::ZERO,
            },
            sup_tx.clone(),
        );
        let depth = est.info.queue_depth;
        let io: Vec<QueueHandle> = (1..=est.info.io_queues)
            .map(|qid| {
                QueueHandle::spawn(
                    QueueConfig {
                        qid,
                        slots: depth - 1,
                        addr: addr.clone(),
                        retry_writes: opts.retry_writes,
                        scan_period: scan(opts.timeouts.io),
                        busy_poll: opts.busy_poll,
                        ring_poll: opts.ring_poll,
                    },
                    sup_tx.clone(),
                )
            })
            .collect();
        let (state, _) = watch::channel(StateInfo {
            state: ControllerState::Connected,
            generation: 1,
        });
        let (events, _) = broadcast::channel(64);
        let shared = Arc::new(CtrlShared {
            addr,
            admin,
            active_io: AtomicUsize::new(io.len()),
            io,
            round_robin: AtomicUsize::new(0),
            max_transfer: AtomicU32::new(est.info.max_transfer_bytes),
            info: RwLock::new(est.info.clone()),
            identify: RwLock::new(est.identify),
            namespaces: RwLock::new(NsCache {
                active: est.active_ns,
                info: BTreeMap::new(),
            }),
            state,
            events,
            reconnects: AtomicU64::new(0),
            pd,
            limits: est.admin.limits(),
            pair_qids: Mutex::new(PairQids {
                max_qid: est.max_qid,
                used: BTreeSet::new(),
            }),
            opts,
        });
        shared
            .admin
            .control(QueueCtl::Attach(Box::new(est.admin), 1));
        for (q, live) in shared.io.iter().zip(est.ios) {
            q.control(QueueCtl::Attach(Box::new(live), 1));
        }
        info!(
            addr = %shared.addr,
            subnqn = %est.info.subnqn,
            cntlid = est.info.cntlid,
            io_queues = est.info.io_queues,
            queue_depth = est.info.queue_depth,
            "controller connected"
        );
        let sup = Supervisor {
            shared: Arc::clone(&shared),
            rx: sup_rx,
            tx: sup_tx.clone(),
            generation: 1,
            helpers: Vec::new(),
            done: false,
        };
        tokio::spawn(sup.run());
        Ok(Controller {
            inner: Arc::new(CtrlInner { shared, sup_tx }),
        })
    }

    /// Allocates `len` bytes of zeroed, page-aligned host memory and, over NVMe/RDMA,
    /// registers it once with the protection domain all the controller's queues share: reads
    /// and writes through [`Namespace::read_registered`](crate::Namespace::read_registered) /
    /// [`Namespace::write_registered`](crate::Namespace::write_registered)
    /// then go straight between the target and this memory. Over NVMe/TCP the buffer is plain
    /// memory and the same calls copy as ordinary reads and writes do.
    ///
    /// Registered memory counts against `RLIMIT_MEMLOCK`.
    pub fn register_buffer(&self, len: usize) -> Result<RegisteredBuffer, Error> {
        let pd = self.rdma_pd()?;
        RegisteredBuffer::new(len, pd.as_ref())
    }

    /// Registers GPU memory for NVMe/RDMA: the dma-buf of the buffer
    /// (`ibv_reg_dmabuf_mr`), or, where the export or the NIC refuses it, the device address
    /// (`ibv_reg_mr`, resolved by nvidia-peermem). Reads through
    /// [`Namespace::read_registered_gpu`](crate::Namespace::read_registered_gpu) then land in device memory straight from the NIC.
    ///
    /// On an NVMe/TCP controller this is [`Error::Unsupported`]: there read into GPU memory
    /// through [`gpu`](crate::gpu), which stages through pinned host memory.
    #[cfg(feature = "gpu")]
    pub fn register_gpu(
        &self,
        buf: gpu::DeviceBuffer,
    ) -> Result<crate::RegisteredGpuBuffer, Error> {
        match self.rdma_pd()? {
            Some(pd) => crate::RegisteredGpuBuffer::new(buf, &pd),
            None => Err(Error::Unsupported(
                "GPU memory is registered for NVMe/RDMA only; over NVMe/TCP read into GPU memory through nvmeof_initiator::gpu (pinned staging)".into(),
            )),
        }
    }

    /// The protection domain of an NVMe/RDMA controller (None over NVMe/TCP).
    pub(crate) fn rdma_pd(&self) -> Result<Option<Arc<nvmf_rdma::ProtectionDomain>>, Error> {
        if self.inner.shared.opts.addr.transport != Transport::Rdma {
            return Ok(None);
        }
        match self.inner.shared.pd.get() {
            Some(pd) => Ok(Some(pd)),
            None => Err(Error::Unsupported(
                "this controller's NVMe/RDMA queues have no shared protection domain (the RDMA device could not be anchored; see the debug log)".into(),
            )),
        }
    }

    /// Takes a free queue-pair queue ID and opens that I/O queue on the current runtime (its
    /// own connection and Fabrics Connect, as the shared queues are set up). Returns the
    /// queue ID (given back when dropped), the link and the queue's entries.
    pub(crate) async fn open_pair_queue(&self) -> Result<(PairQid, Link, u16), Error> {
        let s = &self.inner.shared;
        if self.state() != ControllerState::Connected {
            return Err(Error::lost(
                &s.addr,
                format!("the controller is not connected ({:?})", self.state()),
            ));
        }
        let first = s.io.len() as u16 + 1;
        let qid = {
            let mut ids = s.pair_qids.lock();
            let free = (first..=ids.max_qid).find(|q| !ids.used.contains(q));
            let Some(qid) = free else {
                return Err(Error::InvalidArgument(format!(
                    "no I/O queue ID is free for a queue pair ({} kept, all in use; see ConnectOptions::queue_pairs)",
                    ids.max_qid.saturating_sub(first - 1)
                )));
            };
            ids.used.insert(qid);
            qid
        };
        let lease = PairQid {
            shared: Arc::clone(s),
            qid,
        };
        let info = self.info();
        let spec = QueueSpec {
            qid,
            cntlid: info.cntlid,
            depth: info.queue_depth,
            in_capsule: info.in_capsule_data_bytes as usize,
        };
        let link = open_io_queue(&s.opts, &s.pd, spec).await?;
        Ok((lease, link, info.queue_depth))
    }

    pub(crate) fn shared(&self) -> &CtrlShared {
        &self.inner.shared
    }

    /// What the controller reported at the last (re)connect.
    pub fn info(&self) -> ControllerInfo {
        self.inner.shared.info.read().clone()
    }

    /// The Identify Controller data from the last (re)connect.
    pub fn identify_data(&self) -> IdentifyController {
        **self.inner.shared.identify.read()
    }

    /// The connection state now.
    pub fn state(&self) -> ControllerState {
        self.inner.shared.state.borrow().state.clone()
    }

    /// Waits until the state satisfies `f` (for example, until it is connected again), at most
    /// `timeout`. Returns the state that satisfied it.
    pub async fn wait_for_state(
        &self,
        timeout: Duration,
        f: impl Fn(&ControllerState) -> bool,
    ) -> Result<ControllerState, Error> {
        let mut rx = self.inner.shared.state.subscribe();
        let r = tokio::time::timeout(timeout, rx.wait_for(|s| f(&s.state))).await;
        match r {
            Err(_) => Err(Error::timeout("a controller state change", timeout)),
            Ok(Err(_)) => Err(Error::Closed),
            Ok(Ok(s)) => Ok(s.state.clone()),
        }
    }

    /// Events (reconnects, asynchronous events, namespace changes) from now on.
    pub fn subscribe_events(&self) -> broadcast::Receiver<ControllerEvent> {
        self.inner.shared.events.subscribe()
    }

    /// How many times the association was re-established after a connection loss.
    pub fn reconnects(&self) -> u64 {
        self.inner.shared.reconnects.load(Ordering::Relaxed)
    }

    /// Counters of every queue (admin queue first).
    pub fn queue_stats(&self) -> Vec<QueueStats> {
        let s = &self.inner.shared;
        std::iter::once(&s.admin)
            .chain(&s.io)
            .map(QueueHandle::stats)
            .collect()
    }

    /// Number of I/O queues.
    pub fn io_queue_count(&self) -> usize {
        self.inner.shared.active_io.load(Ordering::Relaxed)
    }

    /// The I/O queue for a command from this thread (or `index` when pinned).
    pub(crate) fn io_queue(&self, pinned: Option<usize>) -> Result<&QueueHandle, Error> {
        let s = &self.inner.shared;
        let n = s.active_io.load(Ordering::Relaxed);
        if n == 0 {
            return Err(Error::InvalidArgument(
                "the controller has no I/O queues".into(),
            ));
        }
        let i = match (pinned, s.opts.queue_policy) {
            (Some(i), _) => i,
            (None, QueuePolicy::PerThread) => thread_hint(),
            (None, QueuePolicy::RoundRobin) => s.round_robin.fetch_add(1, Ordering::Relaxed),
        };
        Ok(&s.io[i % n])
    }

    /// Active namespace IDs (as of the last refresh).
    pub fn namespace_ids(&self) -> Vec<u32> {
        self.inner.shared.namespaces.read().active.clone()
    }

    /// Re-reads the active namespace list from the controller.
    pub async fn refresh_namespaces(&self) -> Result<Vec<u32>, Error> {
        self.inner.shared.refresh_namespaces().await
    }

    /// What is known about namespace `nsid` (Identify Namespace), reading it if needed.
    pub async fn namespace_info(&self, nsid: u32) -> Result<NamespaceInfo, Error> {
        if let Some(i) = self.inner.shared.namespaces.read().info.get(&nsid) {
            return Ok(i.clone());
        }
        let info = self
            .inner
            .shared
            .load_namespace(nsid)
            .await?
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "namespace {nsid} is not active on {}",
                    self.inner.shared.opts.subnqn
                ))
            })?;
        self.inner
            .shared
            .namespaces
            .write()
            .info
            .insert(nsid, info.clone());
        Ok(info)
    }

    /// Identify Controller, read now.
    pub async fn identify_controller(&self) -> Result<IdentifyController, Error> {
        let raw = self
            .inner
            .shared
            .admin_api()
            .identify(cns::CONTROLLER, 0)
            .await?;
        IdentifyController::read_from_bytes(&raw)
            .map_err(|_| Error::Refused("short Identify Controller data".into()))
    }

    /// Identify Namespace (NVM command set), read now.
    pub async fn identify_namespace(&self, nsid: u32) -> Result<IdentifyNamespace, Error> {
        self.inner.shared.identify_namespace_raw(nsid).await
    }

    /// Get Log Page: `len` bytes (a multiple of 4) of log `lid` at byte `offset`.
    pub async fn get_log_page(
        &self,
        lid: u8,
        nsid: u32,
        len: u32,
        offset: u64,
    ) -> Result<Vec<u8>, Error> {
        if len == 0 || len % 4 != 0 {
            return Err(Error::InvalidArgument(
                "log page length must be a non-zero multiple of 4".into(),
            ));
        }
        self.inner
            .shared
            .admin_api()
            .get_log_page(lid, nsid, len, offset)
            .await
    }

    /// Get Features (current value); returns completion DW0.
    pub async fn get_features(&self, fid: u8) -> Result<u32, Error> {
        self.inner.shared.admin_api().get_features(fid).await
    }

    /// Sends one Keep Alive now.
    pub async fn keep_alive(&self) -> Result<(), Error> {
        self.inner
            .shared
            .admin_api()
            .run(build::keep_alive(0), &[], 0, Retry::Never)
            .await
            .map(|_| ())
    }

    /// Disconnects gracefully: closes the I/O queues (commands still queued fail with
    /// [`Error::Closed`]), asks the controller for a normal shutdown (CC.SHN) and waits for
    /// CSTS.SHST (bounded by the shutdown timeout), then closes the admin queue.
    pub async fn disconnect(self) -> Result<(), Error> {
        let (tx, rx) = oneshot::channel();
        let _ = self.inner.sup_tx.send(SupMsg::Shutdown { reply: Some(tx) });
        let t = &self.inner.shared.opts.timeouts;
        let limit = t.shutdown + t.admin * 3 + Duration::from_secs(1);
        match tokio::time::timeout(limit, rx).await {
            Err(_) => Err(Error::timeout("the controller shutdown", limit)),
            Ok(Err(_)) => Ok(()),
            Ok(Ok(r)) => r,
        }
    }
}

struct Supervisor {
    shared: Arc<CtrlShared>,
    rx: mpsc::UnboundedReceiver<SupMsg>,
    tx: mpsc::UnboundedSender<SupMsg>,
    generation: u64,
    helpers: Vec<JoinHandle<()>>,
    done: bool,
}

impl Supervisor {
    async fn run(mut self) {
        self.start_helpers();
        while let Some(msg) = self.rx.recv().await {
            match msg {
                SupMsg::QueueFailed {
                    qid,
                    generation,
                    error,
                } if generation == self.generation && !self.done => {
                    warn!(addr = %self.shared.addr, qid, error = %error, "connection lost; reconnecting");
                    if !self.recover(error).await {
                        return;
                    }
                }
                SupMsg::KeepAliveFailed { generation, error }
                    if generation == self.generation && !self.done =>
                {
                    warn!(addr = %self.shared.addr, error = %error, "keep alive failed; reconnecting");
                    if !self.recover(error).await {
                        return;
                    }
                }
                SupMsg::Shutdown { reply } => {
                    let r = self.shutdown().await;
                    if let Some(reply) = reply {
                        let _ = reply.send(r);
                    }
                    return;
                }
                _ => {}
            }
        }
        let _ = self.shutdown().await;
    }

    fn start_helpers(&mut self) {
        let kato = self.shared.info.read().kato_ms;
        if kato > 0 {
            let period = Duration::from_millis(u64::from(kato) / 2).max(Duration::from_millis(50));
            self.helpers.push(tokio::spawn(keep_alive_loop(
                Arc::clone(&self.shared),
                self.tx.clone(),
                period,
            )));
        }
        self.helpers
            .push(tokio::spawn(event_loop(Arc::clone(&self.shared))));
    }

    fn all_queues(&self) -> impl Iterator<Item = &QueueHandle> {
        std::iter::once(&self.shared.admin).chain(&self.shared.io)
    }

    /// Re-establishes the association. Returns when connected again or failed (true), or
    /// shut down while waiting (false).
    async fn recover(&mut self, error: Error) -> bool {
        self.generation += 1;
        let generation = self.generation;
        for q in self.all_queues() {
            q.control(QueueCtl::Detach);
        }
        let policy = self.shared.opts.reconnect.clone();
        self.shared.set_state(
            ControllerState::Reconnecting {
                attempt: 0,
                last_error: error.to_string(),
            },
            generation,
        );
        let start = Instant::now();
        let mut delay = policy.initial_delay;
        let mut attempt = 0u32;
        let mut last = error;
        loop {
            if policy
                .ctrl_loss_timeout
                .is_some_and(|limit| start.elapsed() >= limit)
            {
                let err = Error::ControllerFailed {
                    addr: self.shared.addr.clone(),
                    reason: last.to_string(),
                };
                warn!(addr = %self.shared.addr, error = %last, "giving up reconnecting");
                for q in self.all_queues() {
                    q.control(QueueCtl::Fail(err.clone()));
                }
                self.shared.set_state(
                    ControllerState::Failed {
                        error: last.to_string(),
                    },
                    generation,
                );
                self.done = true;
                return true;
            }
            if !self.pause(delay).await {
                return false;
            }
            attempt += 1;
            let want = self.shared.io.len() as u16;
            match establish(&self.shared.opts, want, &self.shared.pd).await {
                Ok(est) => {
                    self.install(est, generation);
                    return true;
                }
                Err(e) => {
                    debug!(addr = %self.shared.addr, attempt, error = %e, "reconnect attempt failed");
                    self.shared.set_state(
                        ControllerState::Reconnecting {
                            attempt,
                            last_error: e.to_string(),
                        },
                        generation,
                    );
                    last = e;
                    delay = (delay * 2)
                        .min(policy.max_delay)
                        .max(Duration::from_millis(10));
                }
            }
        }
    }

    /// Sleeps, serving a shutdown request if one comes. Returns false when shut down.
    async fn pause(&mut self, delay: Duration) -> bool {
        let until = Instant::now() + delay;
        loop {
            tokio::select! {
                _ = tokio::time::sleep_until(until) => return true,
                msg = self.rx.recv() => match msg {
                    None => {
                        let _ = self.shutdown().await;
                        return false;
                    }
                    Some(SupMsg::Shutdown { reply }) => {
                        let r = self.shutdown().await;
                        if let Some(reply) = reply {
                            let _ = reply.send(r);
                        }
                        return false;
                    }
                    Some(_) => {}
                },
            }
        }
    }

    fn install(&mut self, est: Established, generation: u64) {
        let s = &self.shared;
        let granted = est.ios.len();
        let cntlid = est.info.cntlid;
        s.max_transfer
            .store(est.info.max_transfer_bytes, Ordering::Relaxed);
        {
            let mut info = s.info.write();
            let io_queues = info.io_queues;
            *info = est.info;
            info.io_queues = io_queues.min(granted as u16);
        }
        *s.identify.write() = est.identify;
        s.pair_qids.lock().max_qid = est.max_qid;
        s.namespaces.write().active = est.active_ns;
        s.admin
            .control(QueueCtl::Attach(Box::new(est.admin), generation));
        for (i, q) in s.io.iter().enumerate() {
            if i >= granted {
                q.control(QueueCtl::Fail(Error::Refused(format!(
                    "the controller granted only {granted} I/O queues after reconnecting"
                ))));
            }
        }
        for (q, live) in s.io.iter().zip(est.ios) {
            q.control(QueueCtl::Attach(Box::new(live), generation));
        }
        s.active_io
            .store(granted.min(s.io.len()), Ordering::Relaxed);
        s.reconnects.fetch_add(1, Ordering::Relaxed);
        s.set_state(ControllerState::Connected, generation);
        let _ = s.events.send(ControllerEvent::Reconnected { cntlid });
        info!(addr = %s.addr, cntlid, "controller reconnected");
    }

    /// Graceful shutdown; idempotent.
    async fn shutdown(&mut self) -> Result<(), Error> {
        for h in self.helpers.drain(..) {
            h.abort();
        }
        let was = self.shared.state.borrow().state.clone();
        if was == ControllerState::Closed {
            return Ok(());
        }
        self.done = true;
        for q in &self.shared.io {
            q.control(QueueCtl::Close);
        }
        let r = if was == ControllerState::Connected {
            shutdown_controller(&self.shared).await
        } else {
            Ok(())
        };
        self.shared.admin.control(QueueCtl::Close);
        self.shared
            .set_state(ControllerState::Closed, self.generation);
        match &r {
            Ok(()) => info!(addr = %self.shared.addr, "controller disconnected"),
            Err(e) => warn!(addr = %self.shared.addr, error = %e, "controller shutdown incomplete"),
        }
        r
    }
}

/// CC.SHN, then CSTS.SHST polling, through the admin queue.
async fn shutdown_controller(s: &CtrlShared) -> Result<(), Error> {
    admin::shutdown(&mut s.admin_api(), s.opts.timeouts.shutdown).await
}

/// A controller's running admin queue: commands go through its queue task, with the admin
/// timeout.
struct AdminQueue<'a>(&'a CtrlShared);

impl Admin for AdminQueue<'_> {
    async fn run(
        &mut self,
        sqe: nvme_spec::Sqe,
        data_out: &[u8],
        data_in: u32,
        retry: Retry,
    ) -> Result<(nvme_spec::Cqe, Vec<u8>), Error> {
        let s = self.0;
        let req = admin_request(sqe, data_out, data_in, retry, s.opts.timeouts.admin)?;
        s.admin
            .execute(
                req,
                |b| {
                    b[..data_out.len()].copy_from_slice(data_out);
                    Ok(())
                },
                |d: &[u8]| d.to_vec(),
            )
            .await
    }
}

async fn keep_alive_loop(s: Arc<CtrlShared>, tx: mpsc::UnboundedSender<SupMsg>, period: Duration) {
    let mut iv = tokio::time::interval(period);
    iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    iv.tick().await;
    loop {
        iv.tick().await;
        let (state, generation) = {
            let st = s.state.borrow();
            (st.state.clone(), st.generation)
        };
        match state {
            ControllerState::Connected => {}
            ControllerState::Reconnecting { .. } => continue,
            ControllerState::Failed { .. } | ControllerState::Closed => return,
        }
        let req = Request {
            sqe: build::keep_alive(0),
            dir: DataDir::None,
            len: 0,
            retry: Retry::Never,
            timeout: Some(s.opts.timeouts.admin.min(period * 2)),
        };
        match s.admin.execute(req, |_| Ok(()), |_| ()).await {
            Ok(_) => {}
            Err(Error::Closed) => return,
            // A lost connection or a timeout is reported by the queue itself.
            Err(e) if e.is_transport() => {}
            Err(e) => {
                if s.generation() == generation {
                    let _ = tx.send(SupMsg::KeepAliveFailed {
                        generation,
                        error: e,
                    });
                }
            }
        }
    }
}

/// Keeps one Asynchronous Event Request posted and handles what completes it.
async fn event_loop(s: Arc<CtrlShared>) {
    let mut rx = s.state.subscribe();
    loop {
        let generation = match rx
            .wait_for(|st| !matches!(st.state, ControllerState::Reconnecting { .. }))
            .await
        {
            Ok(st) if st.state == ControllerState::Connected => st.generation,
            _ => return,
        };
        let req = Request {
            sqe: build::async_event_request(0),
            dir: DataDir::None,
            len: 0,
            retry: Retry::Never,
            timeout: None,
        };
        match s.admin.execute(req, |_| Ok(()), |_| ()).await {
            Ok((cqe, ())) => handle_event(&s, cqe.dw0.get()).await,
            Err(Error::Closed) => return,
            Err(e) => {
                if !e.is_transport() {
                    debug!(error = %e, "asynchronous events unavailable");
                }
                // Wait for the next association before posting again.
                if rx
                    .wait_for(|st| {
                        st.generation != generation
                            || matches!(
                                st.state,
                                ControllerState::Closed | ControllerState::Failed { .. }
                            )
                    })
                    .await
                    .is_err()
                {
                    return;
                }
            }
        }
    }
}

async fn handle_event(s: &CtrlShared, dw0: u32) {
    let event_type = (dw0 & 0x7) as u8;
    let info = ((dw0 >> 8) & 0xFF) as u8;
    let log_page = ((dw0 >> 16) & 0xFF) as u8;
    info!(
        addr = %s.addr,
        event = event_name(event_type, info),
        event_type,
        info,
        log_page,
        "asynchronous event"
    );
    let _ = s.events.send(ControllerEvent::AsyncEvent {
        event_type,
        info,
        log_page,
    });
    // Reading the log page clears the event so the controller can report the next one.
    let mut page = None;
    if log_page != 0 {
        let len = if log_page == log_id::CHANGED_NS_LIST {
            4096
        } else {
            512
        };
        match s
            .admin_api()
            .get_log_page(log_page, 0xFFFF_FFFF, len, 0)
            .await
        {
            Ok(data) => page = Some(data),
            Err(e) => debug!(log_page, error = %e, "cannot read the event's log page"),
        }
    }
    let ns_changed = event_type == features::aer_type::NOTICE
        && info == features::aer_notice::NS_ATTRIBUTE_CHANGED;
    if ns_changed {
        // The Changed Namespace List: up to 1024 IDs, or 0xFFFFFFFF first when more changed.
        let changed = page
            .filter(|_| log_page == log_id::CHANGED_NS_LIST)
            .map(|p| nvme_spec::identify::decode_ns_list(&p))
            .filter(|l| l.first() != Some(&0xFFFF_FFFF));
        match s.refresh_namespaces().await {
            Ok(nsids) => {
                let _ = s
                    .events
                    .send(ControllerEvent::NamespacesChanged { nsids, changed });
            }
            Err(e) => warn!(addr = %s.addr, error = %e, "cannot refresh the namespace list"),
        }
    }
}

/// A readable name for an asynchronous event (NVMe Base 2.0, Figure 146-150).
fn event_name(event_type: u8, info: u8) -> &'static str {
    use features::{aer_notice, aer_type};
    match (event_type, info) {
        (aer_type::ERROR, _) => "error status",
        (aer_type::SMART, _) => "SMART / health status",
        (aer_type::NOTICE, aer_notice::NS_ATTRIBUTE_CHANGED) => "namespace attribute changed",
        (aer_type::NOTICE, aer_notice::DISCOVERY_LOG_CHANGE) => "discovery log page changed",
        (aer_type::NOTICE, _) => "notice",
        (6, _) => "I/O command set specific status",
        (7, _) => "vendor specific",
        _ => "unknown",
    }
}
