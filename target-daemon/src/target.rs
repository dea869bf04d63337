//! The target: the registry of subsystems, bound listeners, limits and the shutdown signal.
//! [`crate::launcher`] starts and stops its reactors and accept loops.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU16, AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use blockdev::Backend;
use nvme_auth::tls::PskIdentity;
use parking_lot::{Mutex, RwLock};
use tokio::sync::watch;
use tracing::{error, info, warn};

use crate::admission::{ConnectionCount, ListenerGate};
use crate::config::{Config, ListenAddr, TargetSettings, Transport};
use crate::controller::Controller;
use crate::subsystem::{Namespace, Subsystem, stable_id128};

/// Errors starting the target.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A backend could not be opened.
    #[error("subsystem {nqn} namespace {nsid}: {source}")]
    Backend {
        /// Subsystem NQN.
        nqn: String,
        /// The namespace's NSID.
        nsid: u32,
        /// Cause.
        source: blockdev::BackendError,
    },
    /// A listener could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: String,
        /// Cause.
        source: std::io::Error,
    },
    /// A transport is not available in this build or on this host.
    #[error("cannot listen on {addr}: {reason}")]
    Transport {
        /// The address.
        addr: String,
        /// Why.
        reason: String,
    },
    /// Two namespaces name the same file or device.
    #[error(
        "subsystem {nqn} namespace {nsid}: {path} already backs {first}; a file or device can back only one namespace"
    )]
    SameFile {
        /// Subsystem NQN.
        nqn: String,
        /// The namespace's NSID.
        nsid: u32,
        /// The path as given.
        path: String,
        /// The namespace that uses it first.
        first: String,
    },
    /// A file namespace would be created in a directory that does not exist or is not a
    /// directory.
    #[error("subsystem {nqn} namespace {nsid}: cannot create {path}: {dir} {why}")]
    NoDirectory {
        /// `does not exist` or `is not a directory`.
        why: &'static str,
        /// Subsystem NQN.
        nqn: String,
        /// The namespace's NSID.
        nsid: u32,
        /// The file to create.
        path: String,
        /// Its parent.
        dir: String,
    },
    /// The TLS context could not be built.
    #[error("cannot set up TLS: {0}")]
    Tls(nvmf_tls::TlsError),
    /// A reactor thread could not be started.
    #[error("cannot start reactor thread: {0}")]
    Reactor(std::io::Error),
    /// The reactors cannot be pinned to the CPUs of `cpus`.
    #[error("target.cpus: {0}")]
    Cpus(String),
}

/// The running target's shared state.
pub struct Target {
    /// Limits and sizes.
    pub settings: TargetSettings,
    subsystems: Arc<RwLock<Arc<SubsystemMap>>>,
    listeners: RwLock<Listeners>,
    referrals: RwLock<Vec<ListenAddr>>,
    /// The TLS context of the listeners that require TLS: its PSK lookup reads the current
    /// subsystems, so PSKs added or removed while running take effect at the next handshake.
    pub tls: nvmf_tls::ServerContext,
    /// Serial number of the discovery controller.
    pub discovery_serial: String,
    genctr: AtomicU64,
    discovery_controllers: Mutex<Vec<Weak<Controller>>>,
    next_discovery_cntlid: AtomicU16,
    shutdown_tx: watch::Sender<bool>,
    connections: Arc<ConnectionCount>,
    /// Target-wide counters (protocol errors).
    pub metrics: crate::metrics::TargetMetrics,
    /// Where authentication's Diffie-Hellman work runs, and its budgets.
    pub auth: crate::ratelimit::AuthWork,
    /// The memory all connections share ([`crate::memory`]).
    pub memory: Arc<crate::memory::MemoryBudget>,
    /// The ANA state of each group on each listener ([`crate::ana`]).
    pub ana: crate::ana::AnaStates,
}

/// The subsystems of a target by NQN: an immutable snapshot, replaced whole on a change.
pub type SubsystemMap = BTreeMap<String, Arc<Subsystem>>;

/// The addresses a target listens on, as bound (ports resolved).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Listeners {
    /// I/O listeners (they also serve discovery).
    pub io: Vec<ListenAddr>,
    /// Dedicated discovery listeners.
    pub discovery: Vec<ListenAddr>,
    /// The bound addresses of the I/O listeners that require TLS.
    pub tls: Vec<SocketAddr>,
}

/// What [`Target::check`] found would happen at start, besides what it opened.
#[derive(Debug, Default)]
pub struct CheckReport {
    /// Files that starting would create (or extend from empty), with their size.
    pub would_create: Vec<(String, u64)>,
}

/// The file that creating `path` would make, however it is spelled: a symlink at the name is
/// followed (it may dangle), then the parent directory is made canonical (`..`, symlinks).
fn creation_key(path: &std::path::Path) -> std::path::PathBuf {
    let mut p = path.to_path_buf();
    for _ in 0..40 {
        match std::fs::read_link(&p) {
            Ok(t) => p = p.parent().map_or_else(|| t.clone(), |d| d.join(&t)),
            Err(_) => break,
        }
    }
    match (p.parent(), p.file_name()) {
        (Some(d), Some(n)) => {
            let d = if d.as_os_str().is_empty() {
                std::path::Path::new(".")
            } else {
                d
            };
            d.canonicalize().map_or(p.clone(), |d| d.join(n))
        }
        _ => p,
    }
}

/// Identifies a file or device across the different paths that may name it.
fn file_identity(path: &std::path::Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

impl Target {
    /// Opens every backend described by `cfg`. It listens nowhere yet: the launcher binds
    /// the listeners ([`crate::launcher::bind`]) and records them as it starts them.
    pub fn build(cfg: &Config) -> Result<Arc<Target>, StartError> {
        Self::build_with(cfg, None)
    }

    /// Validates `cfg`'s subsystems as far as possible without changing anything: opens the
    /// backends that exist (taking their locks while the returned target lives), but creates
    /// no file; a file namespace that starting would create is reported instead.
    pub fn check(cfg: &Config) -> Result<(Arc<Target>, CheckReport), StartError> {
        let mut report = CheckReport::default();
        let t = Self::build_with(cfg, Some(&mut report))?;
        Ok((t, report))
    }

    fn build_with(
        cfg: &Config,
        mut check: Option<&mut CheckReport>,
    ) -> Result<Arc<Target>, StartError> {
        let mut subsystems = BTreeMap::new();
        // Files and devices in use, by device and inode, with the namespace using each.
        let mut claimed: BTreeMap<(u64, u64), String> = BTreeMap::new();
        let mut to_create: BTreeMap<std::path::PathBuf, String> = BTreeMap::new();
        for s in &cfg.subsystems {
            let mut backends = Vec::new();
            for (i, ns) in s.namespaces.iter().enumerate() {
                let nsid = ns.nsid.unwrap_or(i as u32 + 1);
                let here = format!("subsystem {} namespace {nsid}", s.nqn);
                let mut spec = ns.backend.clone();
                if let blockdev::BackendSpec::File(f) | blockdev::BackendSpec::Bdev(f) = &ns.backend
                    && f.exclusive
                {
                    let same_file = |first: &String| StartError::SameFile {
                        nqn: s.nqn.clone(),
                        nsid,
                        path: f.path.display().to_string(),
                        first: first.clone(),
                    };
                    if let Some(first) = file_identity(&f.path).and_then(|id| claimed.get(&id)) {
                        return Err(same_file(first));
                    }
                    let empty = std::fs::metadata(&f.path).map_or(true, |m| m.len() == 0);
                    if let (Some(report), Some(size), true) =
                        (check.as_deref_mut(), f.create_size, empty)
                    {
                        // Stand in for the file with a null namespace of its size.
                        let dir = match f.path.parent() {
                            Some(d) if d.as_os_str().is_empty() => std::path::Path::new("."),
                            Some(d) => d,
                            None => std::path::Path::new("/"),
                        };
                        if !dir.is_dir() {
                            return Err(StartError::NoDirectory {
                                why: if dir.exists() {
                                    "is not a directory"
                                } else {
                                    "does not exist"
                                },
                                nqn: s.nqn.clone(),
                                nsid,
                                path: f.path.display().to_string(),
                                dir: dir.display().to_string(),
                            });
                        }
                        if let Some(first) = to_create.insert(creation_key(&f.path), here.clone()) {
                            return Err(same_file(&first));
                        }
                        report
                            .would_create
                            .push((f.path.display().to_string(), size));
                        spec = blockdev::BackendSpec::Null {
                            size,
                            block_size: f.block_size.unwrap_or(blockdev::DEFAULT_BLOCK_SIZE),
                        };
                    }
                }
                let b = open_backend(&s.nqn, nsid, &spec)?;
                if let blockdev::BackendSpec::File(f) | blockdev::BackendSpec::Bdev(f) = &spec
                    && f.exclusive
                {
                    if let Some(id) = file_identity(&f.path) {
                        claimed.insert(id, here);
                    }
                }
                backends.push((b, ns.backend.to_string()));
            }
            let sub = Subsystem::new(s, backends);
            for ns in sub.namespaces().values() {
                log_namespace_ready(&sub.nqn, ns);
            }
            subsystems.insert(s.nqn.clone(), Arc::new(sub));
        }
        // The ANA states as configured; a listener bound to port 0 gets its states when the
        // registry records the bound address ([`crate::reconfigure::Registry::new`]).
        let ana = crate::ana::AnaTable::from_listeners(&cfg.listeners);
        let subsystems = Arc::new(RwLock::new(Arc::new(subsystems)));
        let tls = tls_context(Arc::clone(&subsystems)).map_err(StartError::Tls)?;
        let (shutdown_tx, _) = watch::channel(false);
        let discovery_serial: String = stable_id128("discovery")[..10]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let target = Target {
            settings: cfg.target.clone(),
            subsystems,
            listeners: RwLock::new(Listeners::default()),
            referrals: RwLock::new(cfg.discovery.referrals.clone()),
            tls,
            discovery_serial,
            genctr: AtomicU64::new(1),
            discovery_controllers: Mutex::new(Vec::new()),
            next_discovery_cntlid: AtomicU16::new(1),
            shutdown_tx,
            connections: Arc::new(ConnectionCount::new(cfg.target.max_connections)),
            metrics: Default::default(),
            auth: crate::ratelimit::AuthWork::new(&cfg.target),
            memory: crate::memory::MemoryBudget::new(cfg.target.memory_budget),
            ana: crate::ana::AnaStates::new(ana),
        };
        Ok(Arc::new(target))
    }

    /// Whether the I/O listener bound to `addr` requires TLS.
    pub fn requires_tls(&self, addr: &ListenAddr) -> bool {
        addr.transport == Transport::Tcp && self.listeners.read().tls.contains(&addr.addr)
    }

    /// Whether an NVMe/TCP connection to `local` arrived on a listener that requires TLS.
    pub fn tls_required_at(&self, local: SocketAddr) -> bool {
        self.listeners
            .read()
            .tls
            .iter()
            .any(|l| l.port() == local.port() && (l.ip() == local.ip() || l.ip().is_unspecified()))
    }

    /// Whether a connection to `local` over `transport` arrived on a dedicated discovery
    /// listener (and on no I/O listener): such a connection may reach only the discovery
    /// subsystem.
    pub fn is_discovery_only_listener(&self, transport: Transport, local: SocketAddr) -> bool {
        let accepts = |l: &&ListenAddr| {
            l.transport == transport
                && l.addr.port() == local.port()
                && (l.addr.ip() == local.ip() || l.addr.ip().is_unspecified())
        };
        let l = self.listeners.read();
        l.discovery.iter().any(|l| accepts(&l)) && !l.io.iter().any(|l| accepts(&l))
    }

    /// The current subsystems.
    pub fn subsystems(&self) -> Arc<SubsystemMap> {
        Arc::clone(&self.subsystems.read())
    }

    /// One subsystem by NQN.
    pub fn subsystem(&self, nqn: &str) -> Option<Arc<Subsystem>> {
        self.subsystems.read().get(nqn).cloned()
    }

    /// Replaces the subsystems (see [`crate::reconfigure`]).
    pub(crate) fn set_subsystems(&self, subsystems: SubsystemMap) {
        *self.subsystems.write() = Arc::new(subsystems);
    }

    /// The addresses listened on.
    pub fn listeners(&self) -> Listeners {
        self.listeners.read().clone()
    }

    /// Replaces the addresses listened on (see [`crate::launcher`], [`crate::reconfigure`]).
    pub(crate) fn set_listeners(&self, listeners: Listeners) {
        *self.listeners.write() = listeners;
    }

    /// The other discovery controllers the discovery log refers hosts to.
    pub fn referrals(&self) -> Vec<ListenAddr> {
        self.referrals.read().clone()
    }

    /// Replaces the referrals; whether they changed (see [`crate::reconfigure`]).
    pub(crate) fn set_referrals(&self, referrals: &[ListenAddr]) -> bool {
        let mut r = self.referrals.write();
        if *r == referrals {
            return false;
        }
        *r = referrals.to_vec();
        true
    }

    /// The discovery log generation counter.
    pub fn discovery_genctr(&self) -> u64 {
        self.genctr.load(Ordering::Relaxed)
    }

    /// Registers a connected discovery controller, to be told of discovery log changes.
    pub fn add_discovery_controller(&self, ctrl: &Arc<Controller>) {
        let mut list = self.discovery_controllers.lock();
        list.retain(|c| c.upgrade().is_some_and(|c| !c.is_torn_down()));
        list.push(Arc::downgrade(ctrl));
    }

    /// The connected discovery controllers.
    pub fn discovery_controllers(&self) -> Vec<Arc<Controller>> {
        let mut list = self.discovery_controllers.lock();
        list.retain(|c| c.upgrade().is_some_and(|c| !c.is_torn_down()));
        list.iter().filter_map(Weak::upgrade).collect()
    }

    /// The discovery log changed: moves its generation counter and raises a Discovery Log
    /// Page Change event on every connected discovery controller that asked for it.
    pub fn discovery_changed(&self) {
        self.genctr.fetch_add(1, Ordering::Relaxed);
        for c in self.discovery_controllers() {
            c.notify_discovery_changed();
        }
    }

    /// A controller ID for a new discovery controller.
    pub fn alloc_discovery_cntlid(&self) -> u16 {
        let id = self.next_discovery_cntlid.fetch_add(1, Ordering::Relaxed);
        if id == 0 || id > 0xFFEF {
            self.next_discovery_cntlid.store(2, Ordering::Relaxed);
            1
        } else {
            id
        }
    }

    /// A receiver that turns true when the target shuts down.
    pub fn subscribe_shutdown(&self) -> watch::Receiver<bool> {
        self.shutdown_tx.subscribe()
    }

    /// Signals shutdown to listeners and connections.
    pub(crate) fn begin_shutdown(&self) {
        self.shutdown_tx.send_replace(true);
    }

    /// Whether shutdown has begun.
    pub fn is_shutting_down(&self) -> bool {
        *self.shutdown_tx.borrow()
    }

    /// Number of open connections.
    pub fn connection_count(&self) -> usize {
        self.connections.open()
    }

    /// The admission gate of a new listener on `addr`, bounded by the per-listener and the
    /// target-wide connection limits.
    pub fn listener_gate(&self, addr: ListenAddr) -> Arc<ListenerGate> {
        ListenerGate::new(
            addr,
            self.settings.max_connections_per_listener,
            Arc::clone(&self.connections),
        )
    }

    /// Flushes every namespace's backend, logging failures. Returns the number of failures.
    pub async fn flush_all(&self) -> usize {
        let mut failures = 0;
        for s in self.subsystems().values() {
            for ns in s.namespaces().values() {
                if let Err(e) = ns.backend.flush().await {
                    error!(subsystem = %s.nqn, nsid = ns.nsid, error = %e, "flush failed");
                    failures += 1;
                }
            }
        }
        failures
    }
}

/// Opens the backend of namespace `nsid` (for messages) of subsystem `nqn`.
pub fn open_backend(
    nqn: &str,
    nsid: u32,
    spec: &blockdev::BackendSpec,
) -> Result<Arc<blockdev::AnyBackend>, StartError> {
    blockdev::open(spec)
        .map(Arc::new)
        .map_err(|source| StartError::Backend {
            nqn: nqn.to_string(),
            nsid,
            source,
        })
}

/// Logs a namespace that starts being served.
pub fn log_namespace_ready(nqn: &str, ns: &Namespace) {
    info!(
        subsystem = %nqn,
        nsid = ns.nsid,
        backend = %ns.description,
        blocks = ns.blocks,
        block_size = ns.block_size,
        "namespace ready"
    );
    if let Some(loss) = ns.backend.crash_warning() {
        warn!(subsystem = %nqn, nsid = ns.nsid, "{loss}");
    }
}

/// The TLS context of the TLS listeners: a host's identity (`NVMe0R01` or `NVMe1R01`, for a
/// subsystem that lists it with a `tls_psk`) selects the TLS PSK derived from its configured
/// PSK; any other identity fails the handshake.
fn tls_context(
    subsystems: Arc<RwLock<Arc<SubsystemMap>>>,
) -> Result<nvmf_tls::ServerContext, nvmf_tls::TlsError> {
    nvmf_tls::ServerContext::new(move |identity| {
        let id = PskIdentity::parse(identity)?;
        let psk = subsystems.read().get(&id.subnqn)?.tls_psk(&id.hostnqn)?;
        if psk.cipher_hash() != id.hash {
            return None;
        }
        let derived = psk.tls_psk(id.version, &id.hostnqn, &id.subnqn)?;
        (derived.identity == identity).then_some(derived.key)
    })
}
