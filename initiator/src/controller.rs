//! Controllers: the public API of an association with an NVM subsystem (admin queue and
//! I/O queues), and the tasks that keep it: the supervisor task, which carries out what the
//! [`Supervisor`] state machine decides (detach, reconnect, install, give up, Keep Alive,
//! asynchronous events, graceful shutdown), and the asynchronous event tasks.
//!
//! Where the parts live:
//! - setting up an association, first and after a loss: [`crate::establish`];
//! - what happens when (states, reconnect delays, giving up, keep-alive timing):
//!   [`crate::supervisor`], with no sockets and no timers;
//! - each queue's task, through which every command goes: [`crate::queue`].
//!
//! Tasks, per controller: one queue task per queue; the supervisor task; one task that keeps
//! an Asynchronous Event Request posted, and one that handles the events it completes with
//! (a namespace attribute change refreshes the namespace list); a short-lived task per Keep
//! Alive.

use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use nvme_spec::FromBytes;
use nvme_spec::command::{build, cns, log_id};
use nvme_spec::features;
use nvme_spec::identify::{IdentifyController, IdentifyNamespace};
use parking_lot::{Mutex, RwLock};
use serde::{Deserialize, Serialize};
use tokio::sync::{broadcast, mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::admin::{self, Admin, admin_request};
use crate::establish::{ADMIN_QUEUE_ENTRIES, Established, establish, open_io_queue};
use crate::info::{ControllerInfo, NamespaceInfo, namespace_info};
use crate::link::Link;
use crate::queue::{
    DataDir, QueueConfig, QueueCtl, QueueHandle, QueueStats, Request, Retry, SupMsg,
};
use crate::queue_core::LinkLimits;
use crate::rdma::SharedPd;
use crate::setup::QueueSpec;
use crate::supervisor::{Action, Event as SupEvent, State as SupState, Supervisor};
use crate::{ConnectOptions, Error, QueuePolicy, RegisteredBuffer, Transport};

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

/// The controller's state and the generation of its association (a new one after each
/// reconnect), as the supervisor task publishes them.
#[derive(Clone, Debug)]
pub(crate) struct StateInfo {
    pub state: ControllerState,
    pub generation: u64,
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

    /// The set-up of this I/O queue in the association now live, for `slots` commands at
    /// most (`None`: as many as the controller's queues take). Fails with a clear error when
    /// the controller, after a reconnect, no longer grants this queue ID or that many
    /// entries.
    pub fn spec(&self, slots: Option<u16>) -> Result<QueueSpec, Error> {
        let s = &self.shared;
        let max_qid = s.pair_qids.lock().max_qid;
        if self.qid > max_qid {
            return Err(Error::Refused(format!(
                "the controller grants I/O queue IDs up to {max_qid} since it reconnected; this queue pair's ({}) is gone",
                self.qid
            )));
        }
        let info = s.info.read();
        if let Some(slots) = slots {
            if info.queue_depth.saturating_sub(1) < slots {
                return Err(Error::Refused(format!(
                    "the controller's queues hold {} entries since it reconnected, fewer than this queue pair's {}",
                    info.queue_depth,
                    u32::from(slots) + 1
                )));
            }
        }
        Ok(QueueSpec {
            qid: self.qid,
            cntlid: info.cntlid,
            depth: slots.map_or(info.queue_depth, |n| n + 1),
            in_capsule: info.in_capsule_data_bytes as usize,
            sq_flow_off: !info.sq_flow_control,
        })
    }

    /// Opens this I/O queue as `spec` says (its connection and Fabrics Connect, on the
    /// current runtime).
    pub fn open(
        &self,
        spec: QueueSpec,
    ) -> impl Future<Output = Result<Link, Error>> + Send + 'static {
        let s = Arc::clone(&self.shared);
        async move { open_io_queue(&s.opts, &s.pd, spec).await }
    }

    /// The controller's limits for its transport.
    pub fn limits(&self) -> LinkLimits {
        self.shared.limits
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

/// Command slots of an I/O queue of `depth` entries: twice the commands the entries hold, so
/// that callers with more commands in flight than the queue takes wait in the queue's core
/// (sent as responses free entries) rather than for a slot. Command identifiers stay below
/// 0x8000.
fn io_slots(depth: u16) -> u16 {
    depth.saturating_sub(1).saturating_mul(2).clamp(1, 0x7FFF)
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
                        slots: io_slots(depth),
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
        let sup = SupervisorTask::new(Arc::clone(&shared), sup_tx.clone(), sup_rx);
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

    /// Takes a free queue-pair queue ID (given back when the lease is dropped); the
    /// controller must be connected.
    pub(crate) fn lease_pair_qid(&self) -> Result<PairQid, Error> {
        let s = &self.inner.shared;
        if self.state() != ControllerState::Connected {
            return Err(Error::lost(
                &s.addr,
                format!("the controller is not connected ({:?})", self.state()),
            ));
        }
        let first = s.io.len() as u16 + 1;
        let mut ids = s.pair_qids.lock();
        let free = (first..=ids.max_qid).find(|q| !ids.used.contains(q));
        let Some(qid) = free else {
            return Err(Error::InvalidArgument(format!(
                "no I/O queue ID is free for a queue pair ({} kept, all in use; see ConnectOptions::queue_pairs)",
                ids.max_qid.saturating_sub(first - 1)
            )));
        };
        ids.used.insert(qid);
        Ok(PairQid {
            shared: Arc::clone(s),
            qid,
        })
    }

    /// The controller's state and association generation, as they change.
    pub(crate) fn watch_state(&self) -> watch::Receiver<StateInfo> {
        self.inner.shared.state.subscribe()
    }

    /// Where queues report a lost connection.
    pub(crate) fn supervisor(&self) -> mpsc::UnboundedSender<SupMsg> {
        self.inner.sup_tx.clone()
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

/// The state of `machine` as the API reports it; `None` while new.
fn public_state(machine: &Supervisor) -> Option<ControllerState> {
    let last_error = || {
        machine
            .last_error()
            .map(Error::to_string)
            .unwrap_or_default()
    };
    Some(match machine.state() {
        SupState::New => return None,
        SupState::Live => ControllerState::Connected,
        SupState::Resetting | SupState::Connecting => ControllerState::Reconnecting {
            attempt: machine.attempt(),
            last_error: last_error(),
        },
        SupState::Dead => ControllerState::Failed {
            error: last_error(),
        },
        SupState::Deleting => ControllerState::Closed,
    })
}

/// What a controller's helper tasks report to its supervisor task.
enum Report {
    /// The Keep Alive sent in association `generation` succeeded (a failed one comes as
    /// [`SupMsg::KeepAliveFailed`]).
    KeepAliveDone { generation: u64 },
    /// An Asynchronous Event Request completed in association `generation`.
    AsyncEvent { generation: u64, dw0: u32 },
}

/// The supervisor task: feeds the [`Supervisor`] what happens to the controller (queue
/// reports, helper reports, its timers, the host's disconnect) and carries out its actions.
struct SupervisorTask {
    shared: Arc<CtrlShared>,
    machine: Supervisor,
    rx: mpsc::UnboundedReceiver<SupMsg>,
    /// Where Keep Alive failures go, as queues report theirs.
    tx: mpsc::UnboundedSender<SupMsg>,
    reports: mpsc::UnboundedReceiver<Report>,
    report_tx: mpsc::UnboundedSender<Report>,
    /// Asynchronous events to the task that handles them one after the other.
    events_tx: mpsc::UnboundedSender<u32>,
    helpers: Vec<JoinHandle<()>>,
    /// The association the last reconnect attempt set up, until installed.
    established: Option<Established>,
}

fn now() -> std::time::Instant {
    Instant::now().into_std()
}

impl SupervisorTask {
    /// The task of a controller whose first association is up.
    fn new(
        shared: Arc<CtrlShared>,
        tx: mpsc::UnboundedSender<SupMsg>,
        rx: mpsc::UnboundedReceiver<SupMsg>,
    ) -> Self {
        let (kato, t) = (shared.info.read().kato_ms, &shared.opts.timeouts);
        let kato = Duration::from_millis(u64::from(kato));
        let mut machine = Supervisor::new(shared.opts.reconnect.clone(), kato, t.admin);
        machine.handle(now(), SupEvent::Established);
        let (report_tx, reports) = mpsc::unbounded_channel();
        let (events_tx, events_rx) = mpsc::unbounded_channel();
        let helpers = vec![
            tokio::spawn(event_loop(Arc::clone(&shared), report_tx.clone())),
            tokio::spawn(event_handler(Arc::clone(&shared), events_rx)),
        ];
        SupervisorTask {
            shared,
            machine,
            rx,
            tx,
            reports,
            report_tx,
            events_tx,
            helpers,
            established: None,
        }
    }

    async fn run(mut self) {
        let mut reply = None;
        loop {
            let timer = self.machine.next_timer().map(|(at, _)| at);
            let event = tokio::select! {
                msg = self.rx.recv() => match msg {
                    None => SupEvent::ShutdownRequested,
                    Some(SupMsg::QueueFailed { qid, generation, error }) => {
                        debug!(addr = %self.shared.addr, qid, error = %error, "queue lost its connection");
                        SupEvent::ConnectionLost { generation, error }
                    }
                    Some(SupMsg::KeepAliveFailed { generation, error }) => {
                        SupEvent::KeepAliveDone { generation, error: Some(error) }
                    }
                    Some(SupMsg::Shutdown { reply: r }) => {
                        reply = r;
                        SupEvent::ShutdownRequested
                    }
                },
                Some(r) = self.reports.recv() => match r {
                    Report::KeepAliveDone { generation } => {
                        SupEvent::KeepAliveDone { generation, error: None }
                    }
                    Report::AsyncEvent { generation, dw0 } => {
                        SupEvent::Aen { generation, dw0 }
                    }
                },
                _ = tokio::time::sleep_until(Instant::from_std(timer.unwrap_or_else(now))),
                    if timer.is_some() =>
                {
                    match self.machine.next_timer() {
                        Some((_, ev)) => ev,
                        None => continue,
                    }
                },
            };
            if let Some(r) = self.step(event).await {
                if let Some(reply) = reply.take() {
                    let _ = reply.send(r);
                }
                return;
            }
        }
    }

    fn all_queues(&self) -> impl Iterator<Item = &QueueHandle> {
        std::iter::once(&self.shared.admin).chain(&self.shared.io)
    }

    /// Publishes the machine's state where it changed.
    fn publish(&self) {
        let Some(state) = public_state(&self.machine) else {
            return;
        };
        let generation = self.machine.generation();
        let now = self.shared.state.borrow().clone();
        if now.state != state || now.generation != generation {
            self.shared.set_state(state, generation);
        }
    }

    /// Feeds `event` and carries out what follows. Returns the shutdown's result once the
    /// controller is shut down.
    async fn step(&mut self, event: SupEvent) -> Option<Result<(), Error>> {
        let mut todo: VecDeque<Action> = self.machine.handle(now(), event).into();
        while let Some(action) = todo.pop_front() {
            let next = match action {
                Action::DetachQueues => {
                    if let Some(ControllerState::Reconnecting { last_error, .. }) =
                        public_state(&self.machine)
                    {
                        warn!(addr = %self.shared.addr, error = %last_error, "connection lost; reconnecting");
                    }
                    for q in self.all_queues() {
                        q.control(QueueCtl::Detach);
                    }
                    None
                }
                Action::Reconnect { attempt } => {
                    let want = self.shared.io.len() as u16;
                    Some(
                        match establish(&self.shared.opts, want, &self.shared.pd).await {
                            Ok(est) => {
                                self.established = Some(est);
                                SupEvent::ReconnectSucceeded
                            }
                            Err(e) => {
                                debug!(addr = %self.shared.addr, attempt, error = %e, "reconnect attempt failed");
                                SupEvent::ReconnectFailed(e)
                            }
                        },
                    )
                }
                Action::Install { generation } => {
                    if let Some(est) = self.established.take() {
                        self.install(est, generation);
                    }
                    None
                }
                Action::GiveUp { reason } => {
                    warn!(addr = %self.shared.addr, error = %reason, "giving up reconnecting");
                    let err = Error::ControllerFailed {
                        addr: self.shared.addr.clone(),
                        reason,
                    };
                    for q in self.all_queues() {
                        q.control(QueueCtl::Fail(err.clone()));
                    }
                    None
                }
                Action::SendKeepAlive {
                    generation,
                    timeout,
                } => {
                    // Detached: the report of a Keep Alive that outlives the task is dropped.
                    tokio::spawn(keep_alive(
                        Arc::clone(&self.shared),
                        self.tx.clone(),
                        self.report_tx.clone(),
                        generation,
                        timeout,
                    ));
                    None
                }
                Action::HandleAsyncEvent(dw0) => {
                    let _ = self.events_tx.send(dw0);
                    None
                }
                Action::Shutdown { graceful } => return Some(self.shutdown(graceful).await),
            };
            if let Some(event) = next {
                todo.extend(self.machine.handle(now(), event));
            }
        }
        self.publish();
        None
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
        self.publish();
        let _ = s.events.send(ControllerEvent::Reconnected { cntlid });
        info!(addr = %s.addr, cntlid, "controller reconnected");
    }

    /// Closes the queues, asking the controller for a normal shutdown first when `graceful`.
    async fn shutdown(&mut self, graceful: bool) -> Result<(), Error> {
        for h in self.helpers.drain(..) {
            h.abort();
        }
        for q in &self.shared.io {
            q.control(QueueCtl::Close);
        }
        let r = if graceful {
            admin::shutdown(
                &mut self.shared.admin_api(),
                self.shared.opts.timeouts.shutdown,
            )
            .await
        } else {
            Ok(())
        };
        self.shared.admin.control(QueueCtl::Close);
        self.publish();
        match &r {
            Ok(()) => info!(addr = %self.shared.addr, "controller disconnected"),
            Err(e) => warn!(addr = %self.shared.addr, error = %e, "controller shutdown incomplete"),
        }
        r
    }
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

/// Sends one Keep Alive and reports how it ended.
async fn keep_alive(
    s: Arc<CtrlShared>,
    failed: mpsc::UnboundedSender<SupMsg>,
    tx: mpsc::UnboundedSender<Report>,
    generation: u64,
    timeout: Duration,
) {
    let req = Request {
        sqe: build::keep_alive(0),
        dir: DataDir::None,
        len: 0,
        retry: Retry::Never,
        timeout: Some(timeout),
    };
    let _ = match s.admin.execute(req, |_| Ok(()), |_| ()).await {
        Ok(_) => tx.send(Report::KeepAliveDone { generation }).is_ok(),
        Err(error) => failed
            .send(SupMsg::KeepAliveFailed { generation, error })
            .is_ok(),
    };
}

/// Keeps one Asynchronous Event Request posted while the controller is connected and
/// reports what completes it.
async fn event_loop(s: Arc<CtrlShared>, tx: mpsc::UnboundedSender<Report>) {
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
            Ok((cqe, ())) => {
                let dw0 = cqe.dw0.get();
                let _ = tx.send(Report::AsyncEvent { generation, dw0 });
            }
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

/// Handles the asynchronous events the supervisor passes on, one after the other.
async fn event_handler(s: Arc<CtrlShared>, mut rx: mpsc::UnboundedReceiver<u32>) {
    while let Some(dw0) = rx.recv().await {
        handle_event(&s, dw0).await;
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
