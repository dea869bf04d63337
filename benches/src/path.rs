//! I/O paths: how a worker reaches the storage in each mode.
//!
//! - [`DasPath`]: the `blockdev` backends directly, in this process (direct-attached storage,
//!   the baseline every fabric mode is compared with).
//! - [`TcpPath`]: NVMe/TCP through the `nvmeof-initiator` library, one controller association
//!   per target with `queue_pairs` I/O queues each; worker `w` uses queue `w % queue_pairs` of
//!   every controller. Its namespaces are those of every controller, target by target: index
//!   `t * K + k` is namespace `k` of target `t` (`K` namespaces per target).
//!
//! With `api = "rtc"` a [`TcpPath`] also keeps queue IDs for the workers' own run-to-completion
//! queue pairs ([`IoPath::queue_pair_namespace`]): one per namespace and queue of each worker
//! (a job's `queue_pairs` shared out among its workers, at least one each).
//!
//! Both take and return owned buffers, so a worker keeps `iodepth` buffers and never
//! allocates per I/O.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use blockdev::{AnyBackend, Backend, BackendSpec, IoBuf};
use nvmeof_initiator::{
    ConnectOptions, Controller, HostIdentity, Namespace, ReconnectPolicy, TargetAddr,
};

/// Host NQN the load generator connects with unless told otherwise (`hostnqn`).
pub const BENCH_HOSTNQN: &str =
    "nqn.2014-08.org.nvmexpress:uuid:6e766d65-6f66-2d62-656e-636800000001";
/// Host ID the load generator connects with.
pub const BENCH_HOSTID: [u8; 16] = [
    0x6e, 0x76, 0x6d, 0x65, 0x6f, 0x66, 0x2d, 0x62, 0x65, 0x6e, 0x63, 0x68, 0, 0, 0, 1,
];

/// The host identity a fabric mode connects with, and where it came from (said when a target
/// refuses the host).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostChoice {
    /// Host NQN and host ID.
    pub identity: HostIdentity,
    /// Where the host NQN came from, e.g. `--hostnqn` or `/etc/nvme/hostnqn`.
    pub source: String,
}

impl HostChoice {
    /// The load generator's own identity ([`BENCH_HOSTNQN`]): what it connects to the targets
    /// it starts with (they allow any host).
    pub fn bench() -> Self {
        HostChoice {
            identity: HostIdentity {
                hostnqn: BENCH_HOSTNQN.to_string(),
                hostid: BENCH_HOSTID,
            },
            source: "the load generator's built-in host NQN".into(),
        }
    }

    /// A host NQN given by the user, with the load generator's host ID.
    pub fn given(hostnqn: &str, source: &str) -> Result<Self, PathError> {
        Ok(HostChoice {
            identity: HostIdentity::new(hostnqn, BENCH_HOSTID)?,
            source: source.to_string(),
        })
    }

    /// The identity the `nvmeof` CLI uses: `/etc/nvme/hostnqn` and `/etc/nvme/hostid` when
    /// present, else the one stored in `state_dir` (generated there on first use).
    pub fn system(state_dir: &std::path::Path) -> Result<Self, PathError> {
        Self::system_from(
            std::path::Path::new(nvmeof_initiator::identity::ETC_NVME),
            state_dir,
        )
    }

    /// Like [`system`](Self::system) with another directory in place of `/etc/nvme`.
    pub fn system_from(
        etc: &std::path::Path,
        state_dir: &std::path::Path,
    ) -> Result<Self, PathError> {
        let identity = HostIdentity::load_or_create_from(etc, state_dir)?;
        let in_etc = etc.join("hostnqn");
        let from_etc = std::fs::read_to_string(&in_etc).is_ok_and(|s| s.trim() == identity.hostnqn);
        let source = if from_etc {
            in_etc
        } else {
            state_dir.join("hostnqn")
        };
        Ok(HostChoice {
            identity,
            source: source.display().to_string(),
        })
    }
}

/// An I/O failure of a path.
#[derive(Debug, thiserror::Error)]
pub enum PathError {
    /// The backend failed (DAS).
    #[error("backend: {0}")]
    Backend(#[from] blockdev::BackendError),
    /// The initiator failed (fabric modes).
    #[error("initiator: {0}")]
    Initiator(#[from] nvmeof_initiator::Error),
    /// The namespaces are not what the job needs.
    #[error("{0}")]
    Setup(String),
    /// The iSCSI initiator failed (iscsi modes).
    #[error("iscsi: {0}")]
    Iscsi(#[from] iscsi_initiator::Error),
    /// The GPU side of the `gpu` destination failed.
    #[error("gpu: {0}")]
    Gpu(String),
}

/// One namespace's geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NsGeometry {
    /// The target (controller) it belongs to, from 0 (DAS: 0).
    pub target: u32,
    /// NSID (DAS: position + 1).
    pub nsid: u32,
    /// Bytes per block.
    pub block_size: u32,
    /// Capacity in bytes.
    pub bytes: u64,
}

/// The I/O interface a worker drives.
pub trait IoPath: Send + Sync + 'static {
    /// A data buffer of this path.
    type Buf: Send + 'static;

    /// The namespaces, in order.
    fn geometry(&self) -> &[NsGeometry];

    /// A buffer of `len` bytes.
    fn alloc(&self, len: usize) -> Self::Buf;

    /// `n` buffers of `len` bytes for one worker, which uses them from its one task (a path
    /// may let them share per-worker state).
    fn alloc_set(&self, len: usize, n: usize) -> Vec<Self::Buf> {
        (0..n).map(|_| self.alloc(len)).collect()
    }

    /// The buffer's bytes.
    fn bytes(buf: &Self::Buf) -> &[u8];

    /// The buffer's bytes, writable.
    fn bytes_mut(buf: &mut Self::Buf) -> &mut [u8];

    /// Reads `buf`'s length from namespace index `ns` at byte `offset`, on queue `queue`.
    fn read(
        &self,
        queue: usize,
        ns: usize,
        offset: u64,
        buf: Self::Buf,
    ) -> impl Future<Output = (Result<(), PathError>, Self::Buf)> + Send;

    /// Writes `buf` to namespace index `ns` at byte `offset`, on queue `queue`.
    fn write(
        &self,
        queue: usize,
        ns: usize,
        offset: u64,
        buf: Self::Buf,
    ) -> impl Future<Output = (Result<(), PathError>, Self::Buf)> + Send;

    /// Namespace index `ns`, when this path has queue IDs kept for run-to-completion queue
    /// pairs (`api = "rtc"`).
    fn queue_pair_namespace(&self, _ns: usize) -> Option<&Namespace> {
        None
    }
}

/// The backends directly.
pub struct DasPath {
    backends: Vec<Arc<AnyBackend>>,
    blocks: Vec<crate::gpu::DasBlocks>,
    geometry: Vec<NsGeometry>,
}

impl DasPath {
    /// Opens `count` backends of `spec`.
    pub fn open(spec: &BackendSpec, count: u32) -> Result<DasPath, PathError> {
        let mut backends = Vec::new();
        let mut geometry = Vec::new();
        for i in 0..count {
            // One file behind every namespace, and behind the tcp modes too: shared on purpose.
            let b = blockdev::open(&spec.shared())?;
            geometry.push(NsGeometry {
                target: 0,
                nsid: i + 1,
                block_size: b.block_size(),
                bytes: b.capacity_bytes(),
            });
            backends.push(Arc::new(b));
        }
        let blocks = backends
            .iter()
            .map(|b| crate::gpu::DasBlocks::new(Arc::clone(b)))
            .collect();
        Ok(DasPath {
            backends,
            blocks,
            geometry,
        })
    }

    /// Namespace index `ns` as a block source for the `gpu` destination.
    pub fn blocks(&self, ns: usize) -> &crate::gpu::DasBlocks {
        &self.blocks[ns]
    }
}

impl IoPath for DasPath {
    type Buf = IoBuf;

    fn geometry(&self) -> &[NsGeometry] {
        &self.geometry
    }

    fn alloc(&self, len: usize) -> IoBuf {
        IoBuf::new(len)
    }

    fn bytes(buf: &IoBuf) -> &[u8] {
        buf
    }

    fn bytes_mut(buf: &mut IoBuf) -> &mut [u8] {
        buf
    }

    fn read(
        &self,
        _queue: usize,
        ns: usize,
        offset: u64,
        buf: IoBuf,
    ) -> impl Future<Output = (Result<(), PathError>, IoBuf)> + Send {
        let b = &self.backends[ns];
        let lba = offset / u64::from(self.geometry[ns].block_size);
        async move {
            let (r, buf) = b.read(lba, buf).await;
            (r.map_err(PathError::from), buf)
        }
    }

    fn write(
        &self,
        _queue: usize,
        ns: usize,
        offset: u64,
        buf: IoBuf,
    ) -> impl Future<Output = (Result<(), PathError>, IoBuf)> + Send {
        let b = &self.backends[ns];
        let lba = offset / u64::from(self.geometry[ns].block_size);
        async move {
            let (r, buf) = b.write(lba, buf).await;
            (r.map_err(PathError::from), buf)
        }
    }
}

/// NVMe/TCP through the initiator: one controller per target.
pub struct TcpPath {
    ctrls: Vec<Controller>,
    /// `[target][queue][namespace]` handles pinned to their queue.
    handles: Vec<Vec<Vec<Namespace>>>,
    /// `(target, namespace on that target)` of each namespace index.
    index: Vec<(usize, usize)>,
    geometry: Vec<NsGeometry>,
    /// Queue IDs kept for queue pairs.
    rtc_pairs: u16,
}

/// Connection settings of a [`TcpPath`].
#[derive(Debug, Clone)]
pub struct TcpSettings {
    /// `HOST:PORT` of each target, one controller each (at least one).
    pub addrs: Vec<String>,
    /// Subsystem NQN.
    pub nqn: String,
    /// Host identity.
    pub host: HostChoice,
    /// I/O queues to ask for, per controller.
    pub queue_pairs: u16,
    /// Entries per queue to ask for.
    pub queue_depth: u16,
    /// How many namespaces of each controller to use (NSIDs in the controller's order).
    pub namespaces: u32,
    /// Busy-poll window of the initiator's I/O queues (zero: event-driven).
    pub busy_poll: Duration,
    /// Keep SQ flow control on at Connect.
    pub sq_flow_control: bool,
    /// Queue IDs to keep for run-to-completion queue pairs (`api = "rtc"`), per controller.
    pub rtc_pairs: u16,
}

impl TcpPath {
    /// Connects to the subsystem of every target and opens the first `namespaces` namespaces
    /// of each. Must run inside the runtime that will drive the I/O (the initiator's queue
    /// tasks live there).
    pub async fn connect(s: &TcpSettings) -> Result<TcpPath, PathError> {
        if s.addrs.is_empty() {
            return Err(PathError::Setup("no target address".into()));
        }
        let mut path = TcpPath {
            ctrls: Vec::new(),
            handles: Vec::new(),
            index: Vec::new(),
            geometry: Vec::new(),
            rtc_pairs: s.rtc_pairs,
        };
        for (t, addr) in s.addrs.iter().enumerate() {
            match Self::connect_one(s, addr).await {
                Ok((ctrl, nss)) => {
                    let queues = ctrl.io_queue_count();
                    for (k, n) in nss.iter().enumerate() {
                        path.index.push((t, k));
                        path.geometry.push(NsGeometry {
                            target: t as u32,
                            nsid: n.nsid(),
                            block_size: n.block_size(),
                            bytes: n.size_bytes(),
                        });
                    }
                    path.handles.push(
                        (0..queues.max(1))
                            .map(|q| nss.iter().map(|n| n.on_queue(q)).collect())
                            .collect(),
                    );
                    path.ctrls.push(ctrl);
                }
                Err(e) => {
                    let _ = path.disconnect().await;
                    return Err(if s.addrs.len() > 1 {
                        PathError::Setup(format!("target {t} at {addr}: {e}"))
                    } else {
                        e
                    });
                }
            }
        }
        Ok(path)
    }

    /// One controller of `addr` and its first `s.namespaces` namespaces.
    async fn connect_one(
        s: &TcpSettings,
        addr: &str,
    ) -> Result<(Controller, Vec<Namespace>), PathError> {
        let target: TargetAddr = addr
            .parse()
            .map_err(|e| PathError::Setup(format!("bad target address {addr}: {e}")))?;
        let mut opts = ConnectOptions::new(target, s.nqn.clone(), s.host.identity.clone());
        opts.io_queues = Some(s.queue_pairs);
        opts.queue_depth = s.queue_depth.max(2);
        opts.busy_poll = s.busy_poll;
        opts.disable_sq_flow_control = !s.sq_flow_control;
        opts.queue_pairs = s.rtc_pairs;
        opts.reconnect = ReconnectPolicy::never();
        opts.timeouts.io = Duration::from_secs(30);
        let ctrl = Controller::connect(opts).await.map_err(|e| {
            let invalid_host = e.status().is_some_and(|st| {
                st.sct == 1 && st.sc == nvme_spec::status::specific::CONNECT_INVALID_HOST
            });
            if invalid_host {
                PathError::Setup(format!(
                    "{e}: the target does not allow host {} (from {}); allow it on the target \
                     or connect as an allowed host with --hostnqn",
                    s.host.identity.hostnqn, s.host.source
                ))
            } else {
                e.into()
            }
        })?;
        let queues = ctrl.io_queue_count();
        if queues < usize::from(s.queue_pairs) {
            tracing::warn!(
                addr,
                asked = s.queue_pairs,
                granted = queues,
                "the target granted fewer I/O queues than asked for"
            );
        }
        let nss = match ctrl.namespaces().await {
            Ok(n) => n,
            Err(e) => {
                let _ = ctrl.disconnect().await;
                return Err(e.into());
            }
        };
        if nss.len() < s.namespaces as usize {
            let have = nss.len();
            let _ = ctrl.disconnect().await;
            return Err(PathError::Setup(format!(
                "the subsystem has {have} namespace(s), the job needs {}",
                s.namespaces
            )));
        }
        let nss = nss.into_iter().take(s.namespaces as usize).collect();
        Ok((ctrl, nss))
    }

    /// I/O queues in use per controller (the fewest any controller granted).
    pub fn queues(&self) -> usize {
        self.handles.iter().map(Vec::len).min().unwrap_or(0)
    }

    /// Controllers (one per target).
    pub fn targets(&self) -> usize {
        self.ctrls.len()
    }

    /// The controller of target `t`.
    pub fn controller(&self, t: usize) -> &Controller {
        &self.ctrls[t]
    }

    /// The handle of namespace index `ns` (of every target's, see the module docs) pinned to
    /// queue `queue` of its controller (modulo that controller's queues).
    pub fn handle(&self, queue: usize, ns: usize) -> &Namespace {
        let (t, k) = self.index[ns];
        let queues = &self.handles[t];
        &queues[queue % queues.len()][k]
    }

    /// Disconnects every controller gracefully (the first failure is returned, after trying
    /// them all).
    pub async fn disconnect(mut self) -> Result<(), PathError> {
        self.handles.clear();
        let mut first = Ok(());
        for c in self.ctrls.drain(..) {
            if let Err(e) = c.disconnect().await
                && first.is_ok()
            {
                first = Err(e.into());
            }
        }
        first
    }
}

impl IoPath for TcpPath {
    type Buf = Vec<u8>;

    fn geometry(&self) -> &[NsGeometry] {
        &self.geometry
    }

    fn alloc(&self, len: usize) -> Vec<u8> {
        vec![0u8; len]
    }

    fn bytes(buf: &Vec<u8>) -> &[u8] {
        buf
    }

    fn bytes_mut(buf: &mut Vec<u8>) -> &mut [u8] {
        buf
    }

    fn read(
        &self,
        queue: usize,
        ns: usize,
        offset: u64,
        mut buf: Vec<u8>,
    ) -> impl Future<Output = (Result<(), PathError>, Vec<u8>)> + Send {
        let h = self.handle(queue, ns);
        let lba = offset / u64::from(self.geometry[ns].block_size);
        async move {
            let r = h.read_into(lba, &mut buf).await;
            (r.map_err(PathError::from), buf)
        }
    }

    fn write(
        &self,
        queue: usize,
        ns: usize,
        offset: u64,
        buf: Vec<u8>,
    ) -> impl Future<Output = (Result<(), PathError>, Vec<u8>)> + Send {
        let h = self.handle(queue, ns);
        let lba = offset / u64::from(self.geometry[ns].block_size);
        async move {
            let r = h.write(lba, &buf).await;
            (r.map_err(PathError::from), buf)
        }
    }

    fn queue_pair_namespace(&self, ns: usize) -> Option<&Namespace> {
        if self.rtc_pairs == 0 {
            return None;
        }
        let &(t, k) = self.index.get(ns)?;
        self.handles.get(t)?.first()?.get(k)
    }
}
