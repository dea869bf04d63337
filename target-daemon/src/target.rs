//! The target: the registry of subsystems, bound listeners, limits and the shutdown signal.
//! [`crate::launcher`] starts and stops its reactors and accept loops.

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpListener as StdTcpListener};
use std::sync::Arc;
use std::sync::atomic::{AtomicU16, AtomicU64, Ordering};

use blockdev::Backend;
use nvme_auth::tls::{ConfiguredPsk, PskIdentity};
use tokio::sync::watch;
use tracing::{error, info, warn};

use crate::admission::{ConnectionCount, ListenerGate};
use crate::config::{Config, ListenAddr, TargetSettings, Transport};
use crate::subsystem::{Subsystem, stable_id128};

/// Errors starting the target.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A backend could not be opened.
    #[error("subsystem {nqn} namespace {index}: {source}")]
    Backend {
        /// Subsystem NQN.
        nqn: String,
        /// Namespace position in the configuration (1-based).
        index: usize,
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
        "subsystem {nqn} namespace {index}: {path} already backs {first}; a file or device can back only one namespace"
    )]
    SameFile {
        /// Subsystem NQN.
        nqn: String,
        /// Namespace position in the configuration (1-based).
        index: usize,
        /// The path as given.
        path: String,
        /// The namespace that uses it first.
        first: String,
    },
    /// A file namespace would be created in a directory that does not exist.
    #[error("subsystem {nqn} namespace {index}: cannot create {path}: {dir} is not a directory")]
    NoDirectory {
        /// Subsystem NQN.
        nqn: String,
        /// Namespace position in the configuration (1-based).
        index: usize,
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
}

/// The running target's shared state.
pub struct Target {
    /// Limits and sizes.
    pub settings: TargetSettings,
    /// Subsystems by NQN.
    pub subsystems: BTreeMap<String, Arc<Subsystem>>,
    /// I/O listeners with their bound addresses (they also serve discovery).
    pub io_listeners: Vec<ListenAddr>,
    /// Dedicated discovery listeners with their bound addresses.
    pub discovery_listeners: Vec<ListenAddr>,
    /// The bound addresses of the I/O listeners that require TLS.
    pub tls_listeners: Vec<SocketAddr>,
    /// The TLS context of those listeners (PSKs of every `[[subsystem.host]]` `tls_psk`).
    pub tls: Option<nvmf_tls::ServerContext>,
    /// Serial number of the discovery controller.
    pub discovery_serial: String,
    genctr: AtomicU64,
    next_discovery_cntlid: AtomicU16,
    shutdown_tx: watch::Sender<bool>,
    connections: Arc<ConnectionCount>,
    /// Target-wide counters (protocol errors).
    pub metrics: crate::metrics::TargetMetrics,
}

/// A bound listener ready to accept.
pub struct BoundListener {
    /// The address as bound (port resolved).
    pub addr: ListenAddr,
    /// The socket.
    pub socket: ListenerSocket,
}

/// The endpoint of a bound listener.
pub enum ListenerSocket {
    /// An NVMe/TCP listening socket.
    Tcp(StdTcpListener),
    /// An NVMe/RDMA RDMA-CM listener.
    Rdma(crate::rdma::RdmaListener),
}

/// What [`Target::check`] found would happen at start, besides what it opened and bound.
#[derive(Debug, Default)]
pub struct CheckReport {
    /// Files that starting would create (or extend from empty), with their size.
    pub would_create: Vec<(String, u64)>,
}

/// Identifies a file or device across the different paths that may name it.
fn file_identity(path: &std::path::Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

impl Target {
    /// Opens every backend and binds every listener described by `cfg`.
    pub fn build(cfg: &Config) -> Result<(Arc<Target>, Vec<BoundListener>), StartError> {
        Self::build_with(cfg, None)
    }

    /// Validates `cfg` as far as possible without changing anything: opens the backends that
    /// exist (taking their locks while the returned target lives) and binds the listeners, but
    /// creates no file; a file namespace that starting would create is reported instead.
    pub fn check(
        cfg: &Config,
    ) -> Result<(Arc<Target>, Vec<BoundListener>, CheckReport), StartError> {
        let mut report = CheckReport::default();
        let (t, l) = Self::build_with(cfg, Some(&mut report))?;
        Ok((t, l, report))
    }

    fn build_with(
        cfg: &Config,
        mut check: Option<&mut CheckReport>,
    ) -> Result<(Arc<Target>, Vec<BoundListener>), StartError> {
        let mut subsystems = BTreeMap::new();
        // Files and devices in use, by device and inode, with the namespace using each.
        let mut claimed: BTreeMap<(u64, u64), String> = BTreeMap::new();
        let mut to_create: BTreeMap<std::path::PathBuf, String> = BTreeMap::new();
        for s in &cfg.subsystems {
            let mut backends = Vec::new();
            for (i, ns) in s.namespaces.iter().enumerate() {
                let index = i + 1;
                let here = format!("subsystem {} namespace {index}", s.nqn);
                let mut spec = ns.backend.clone();
                if let blockdev::BackendSpec::File(f) | blockdev::BackendSpec::Bdev(f) = &ns.backend
                    && f.exclusive
                {
                    let same_file = |first: &String| StartError::SameFile {
                        nqn: s.nqn.clone(),
                        index,
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
                                nqn: s.nqn.clone(),
                                index,
                                path: f.path.display().to_string(),
                                dir: dir.display().to_string(),
                            });
                        }
                        if let Some(first) = to_create.insert(f.path.clone(), here.clone()) {
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
                let b = blockdev::open(&spec).map_err(|source| StartError::Backend {
                    nqn: s.nqn.clone(),
                    index,
                    source,
                })?;
                if let blockdev::BackendSpec::File(f) | blockdev::BackendSpec::Bdev(f) = &spec
                    && f.exclusive
                {
                    if let Some(id) = file_identity(&f.path) {
                        claimed.insert(id, here);
                    }
                }
                backends.push((Arc::new(b), ns.backend.to_string()));
            }
            let sub = Subsystem::new(s, backends);
            for ns in sub.namespaces.values() {
                info!(
                    subsystem = %sub.nqn,
                    nsid = ns.nsid,
                    backend = %ns.description,
                    blocks = ns.blocks,
                    block_size = ns.block_size,
                    "namespace ready"
                );
                if let Some(loss) = ns.backend.crash_warning() {
                    warn!(subsystem = %sub.nqn, nsid = ns.nsid, "{loss}");
                }
            }
            subsystems.insert(s.nqn.clone(), Arc::new(sub));
        }
        let mut bound = Vec::new();
        let mut io_listeners = Vec::new();
        let mut discovery_listeners = Vec::new();
        let mut tls_listeners = Vec::new();
        let wanted = cfg
            .listeners
            .iter()
            .map(|l| (l.address.clone(), false, l.tls.is_some()))
            .chain(
                cfg.discovery
                    .listen
                    .iter()
                    .map(|a| (a.clone(), true, false)),
            );
        for (addr, discovery_only, tls) in wanted {
            let (socket, local) = if addr.transport == Transport::Rdma {
                let l = crate::rdma::RdmaListener::bind(&addr).map_err(|reason| {
                    StartError::Transport {
                        addr: addr.to_string(),
                        reason,
                    }
                })?;
                let local = l.local_addr();
                (ListenerSocket::Rdma(l), local)
            } else {
                let socket = bind(&addr)?;
                let local = socket.local_addr().map_err(|source| StartError::Bind {
                    addr: addr.to_string(),
                    source,
                })?;
                (ListenerSocket::Tcp(socket), local)
            };
            let addr = ListenAddr {
                transport: addr.transport,
                addr: local,
            };
            if tls {
                tls_listeners.push(local);
            }
            if discovery_only {
                discovery_listeners.push(addr.clone());
            } else {
                io_listeners.push(addr.clone());
            }
            bound.push(BoundListener { addr, socket });
        }
        let (shutdown_tx, _) = watch::channel(false);
        let discovery_serial: String = stable_id128("discovery")[..10]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let tls = if tls_listeners.is_empty() {
            None
        } else {
            Some(tls_context(&subsystems).map_err(StartError::Tls)?)
        };
        let target = Target {
            settings: cfg.target.clone(),
            subsystems,
            io_listeners,
            discovery_listeners,
            tls_listeners,
            tls,
            discovery_serial,
            genctr: AtomicU64::new(1),
            next_discovery_cntlid: AtomicU16::new(1),
            shutdown_tx,
            connections: Arc::new(ConnectionCount::new(cfg.target.max_connections)),
            metrics: Default::default(),
        };
        Ok((Arc::new(target), bound))
    }

    /// Whether the I/O listener bound to `addr` requires TLS.
    pub fn requires_tls(&self, addr: &ListenAddr) -> bool {
        addr.transport == Transport::Tcp && self.tls_listeners.contains(&addr.addr)
    }

    /// Whether an NVMe/TCP connection to `local` arrived on a listener that requires TLS.
    pub fn tls_required_at(&self, local: SocketAddr) -> bool {
        self.tls_listeners
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
        self.discovery_listeners.iter().any(|l| accepts(&l))
            && !self.io_listeners.iter().any(|l| accepts(&l))
    }

    /// The discovery log generation counter.
    pub fn discovery_genctr(&self) -> u64 {
        self.genctr.load(Ordering::Relaxed)
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
        for s in self.subsystems.values() {
            for ns in s.namespaces.values() {
                if let Err(e) = ns.backend.flush().await {
                    error!(subsystem = %s.nqn, nsid = ns.nsid, error = %e, "flush failed");
                    failures += 1;
                }
            }
        }
        failures
    }
}

fn bind(addr: &ListenAddr) -> Result<StdTcpListener, StartError> {
    let err = |source| StartError::Bind {
        addr: addr.to_string(),
        source,
    };
    let domain = if addr.addr.is_ipv4() {
        socket2::Domain::IPV4
    } else {
        socket2::Domain::IPV6
    };
    let s = socket2::Socket::new(domain, socket2::Type::STREAM, None).map_err(err)?;
    s.set_reuse_address(true).map_err(err)?;
    if addr.addr.is_ipv6() {
        s.set_only_v6(true).map_err(err)?;
    }
    s.bind(&addr.addr.into()).map_err(err)?;
    s.listen(1024).map_err(err)?;
    s.set_nonblocking(true).map_err(err)?;
    Ok(s.into())
}

/// The TLS context of the TLS listeners: a host's identity (`NVMe0R01` or `NVMe1R01`, for a
/// subsystem that lists it with a `tls_psk`) selects the TLS PSK derived from its configured
/// PSK; any other identity fails the handshake.
fn tls_context(
    subsystems: &BTreeMap<String, Arc<Subsystem>>,
) -> Result<nvmf_tls::ServerContext, nvmf_tls::TlsError> {
    let psks: BTreeMap<(String, String), ConfiguredPsk> = subsystems
        .values()
        .flat_map(|s| {
            s.tls_psks
                .iter()
                .map(|(host, psk)| ((host.clone(), s.nqn.clone()), psk.clone()))
        })
        .collect();
    nvmf_tls::ServerContext::new(move |identity| {
        let id = PskIdentity::parse(identity)?;
        let psk = psks.get(&(id.hostnqn.clone(), id.subnqn.clone()))?;
        if psk.cipher_hash() != id.hash {
            return None;
        }
        let derived = psk.tls_psk(id.version, &id.hostnqn, &id.subnqn)?;
        (derived.identity == identity).then_some(derived.key)
    })
}
