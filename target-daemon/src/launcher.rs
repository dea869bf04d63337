//! The launcher: binds the listeners ([`bind`], [`bind_listener`]), starts the reactor pool
//! and the listeners' accept loops for a built [`Target`], NVMe/TCP and NVMe/RDMA side by
//! side, at start and live ([`RunningTarget::ready`], [`RunningTarget::start_listener`],
//! [`RunningTarget::stop_listener`]), and shuts them down in order: the one listener seam. The target itself ([`crate::target`]) is the
//! registry of subsystems, listeners and limits; transports serve connections
//! ([`crate::tcp`], [`crate::rdma`]) on the reactors of [`crate::reactor`].

use std::net::TcpListener as StdTcpListener;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tracing::{info, warn};

use crate::config::{Config, ListenAddr, Transport};
use crate::reactor::Pool;
use crate::target::{Listeners, StartError, Target};

/// A handle to a running target.
pub struct RunningTarget {
    /// Shared state.
    pub target: Arc<Target>,
    /// Taken at shutdown: reactors end once the last handle to the pool is gone.
    pool: Mutex<Option<Arc<Pool>>>,
    reactors: Mutex<Vec<std::thread::JoinHandle<()>>>,
    acceptors: Mutex<Vec<Acceptor>>,
}

/// A bound listener ready to accept.
pub struct BoundListener {
    /// The address as bound (port resolved).
    pub addr: ListenAddr,
    /// The socket.
    pub socket: ListenerSocket,
    /// A dedicated discovery listener (else an I/O listener).
    pub discovery: bool,
    /// An I/O listener that requires TLS.
    pub tls: bool,
}

/// The endpoint of a bound listener.
pub enum ListenerSocket {
    /// An NVMe/TCP listening socket.
    Tcp(StdTcpListener),
    /// An NVMe/RDMA RDMA-CM listener.
    Rdma(nvmf_rdma::Listener),
}

/// Binds every listener of `cfg`: the I/O listeners, then the dedicated discovery
/// listeners.
pub fn bind(cfg: &Config) -> Result<Vec<BoundListener>, StartError> {
    let io = cfg
        .listeners
        .iter()
        .map(|l| (&l.address, false, l.tls.is_some()));
    let discovery = cfg.discovery.listen.iter().map(|a| (a, true, false));
    io.chain(discovery)
        .map(|(addr, discovery, tls)| {
            Ok(BoundListener {
                discovery,
                tls,
                ..bind_listener(addr)?
            })
        })
        .collect()
}

/// Connection requests an RDMA-CM listener queues.
const RDMA_BACKLOG: i32 = 1024;

/// Binds a listener on `addr` (an NVMe/TCP socket or an RDMA-CM listener).
pub fn bind_listener(addr: &ListenAddr) -> Result<BoundListener, StartError> {
    let (socket, local) = if addr.transport == Transport::Rdma {
        // Loads the RDMA libraries; `addr` is an address of an RDMA interface.
        let l = nvmf_rdma::Listener::bind(addr.addr, RDMA_BACKLOG).map_err(|e| {
            StartError::Transport {
                addr: addr.to_string(),
                reason: e.to_string(),
            }
        })?;
        let local = l.local_addr();
        (ListenerSocket::Rdma(l), local)
    } else {
        let socket = bind_tcp(addr)?;
        let local = socket.local_addr().map_err(|source| StartError::Bind {
            addr: addr.to_string(),
            source,
        })?;
        (ListenerSocket::Tcp(socket), local)
    };
    Ok(BoundListener {
        addr: ListenAddr {
            transport: addr.transport,
            addr: local,
        },
        socket,
        discovery: false,
        tls: false,
    })
}

fn bind_tcp(addr: &ListenAddr) -> Result<StdTcpListener, StartError> {
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

/// A bound listener with what it needs to accept ([`RunningTarget::ready`]).
pub struct ReadyListener {
    addr: ListenAddr,
    pool: Arc<Pool>,
    socket: ReadySocket,
}

enum ReadySocket {
    Tcp(tokio::net::TcpListener),
    Rdma(nvmf_rdma::Listener),
}

impl ReadyListener {
    /// The address as bound.
    pub fn addr(&self) -> &ListenAddr {
        &self.addr
    }
}

/// The accept loop of one listener.
struct Acceptor {
    addr: ListenAddr,
    task: tokio::task::JoinHandle<()>,
}

impl RunningTarget {
    /// Starts reactors and accept loops on the current tokio runtime, and records the
    /// listeners in the target's table.
    pub fn start(
        target: Arc<Target>,
        listeners: Vec<BoundListener>,
    ) -> Result<RunningTarget, StartError> {
        let mut table = Listeners::default();
        for l in &listeners {
            match l.discovery {
                true => table.discovery.push(l.addr.clone()),
                false => table.io.push(l.addr.clone()),
            }
            if l.tls {
                table.tls.push(l.addr.addr);
            }
        }
        target.set_listeners(table);
        let (pool, reactors) = Pool::start(&target)?;
        let running = RunningTarget {
            target,
            pool: Mutex::new(Some(pool)),
            reactors: Mutex::new(reactors),
            acceptors: Mutex::new(Vec::new()),
        };
        for l in listeners {
            let l = running.ready(l)?;
            running.start_listener(l);
        }
        // The summaries of suppressed per-connection log lines, every interval.
        let mut shutdown = running.target.subscribe_shutdown();
        tokio::spawn(async move {
            tokio::select! {
                _ = crate::ratelimit::LOG_LIMITS.report() => {}
                _ = shutdown.changed() => {}
            }
        });
        Ok(running)
    }

    /// Makes a bound listener ready to accept on this target's reactors: everything that can
    /// fail in starting a listener happens here, so that [`RunningTarget::start_listener`]
    /// cannot fail. Dropping the result closes the listener.
    pub fn ready(&self, l: BoundListener) -> Result<ReadyListener, StartError> {
        let pool = self.pool(&l.addr)?;
        let socket = match l.socket {
            ListenerSocket::Tcp(s) => {
                ReadySocket::Tcp(tokio::net::TcpListener::from_std(s).map_err(|source| {
                    StartError::Bind {
                        addr: l.addr.to_string(),
                        source,
                    }
                })?)
            }
            ListenerSocket::Rdma(r) => ReadySocket::Rdma(r),
        };
        Ok(ReadyListener {
            addr: l.addr,
            pool,
            socket,
        })
    }

    /// Starts accepting on a ready listener, NVMe/TCP or NVMe/RDMA, at start or while the
    /// target runs: the one place listeners are started.
    pub fn start_listener(&self, l: ReadyListener) {
        let addr = l.addr.clone();
        let task = match l.socket {
            ReadySocket::Tcp(s) => self.accept_tcp(l.addr, s, l.pool),
            ReadySocket::Rdma(r) => crate::rdma::accept(&self.target, l.addr, r, l.pool),
        };
        self.acceptors.lock().push(Acceptor { addr, task });
    }

    /// The reactor pool, while the target is not shutting down.
    fn pool(&self, addr: &ListenAddr) -> Result<Arc<Pool>, StartError> {
        self.pool
            .lock()
            .clone()
            .ok_or_else(|| StartError::Transport {
                addr: addr.to_string(),
                reason: "the target is shutting down".into(),
            })
    }

    /// Stops accepting on `addr` and closes its socket or RDMA-CM listener; connections it
    /// accepted stay.
    /// Returns false when nothing listens there.
    pub fn stop_listener(&self, addr: &ListenAddr) -> bool {
        let mut acceptors = self.acceptors.lock();
        let Some(i) = acceptors.iter().position(|a| &a.addr == addr) else {
            return false;
        };
        acceptors.remove(i).task.abort();
        info!(listener = %addr, "stopped listening");
        true
    }

    fn accept_tcp(
        &self,
        addr: ListenAddr,
        listener: tokio::net::TcpListener,
        pool: Arc<Pool>,
    ) -> tokio::task::JoinHandle<()> {
        info!(listener = %addr, "listening");
        let mut shutdown = self.target.subscribe_shutdown();
        let gate = self.target.listener_gate(addr.clone());
        let l = addr;
        tokio::spawn(async move {
            let report = gate.report_drops();
            tokio::pin!(report);
            loop {
                tokio::select! {
                    r = listener.accept() => match r {
                        Ok((stream, peer)) => {
                            // Over a limit: closed here, at once.
                            let Some(permit) = gate.admit() else { continue };
                            let stream = match stream.into_std() {
                                Ok(s) => s,
                                Err(e) => {
                                    warn!(%peer, error = %e, "cannot hand connection to a reactor");
                                    continue;
                                }
                            };
                            if pool.hand(Box::new(crate::tcp::Incoming { stream, permit })).is_err() {
                                break;
                            }
                        }
                        Err(e) => {
                            warn!(listener = %l, error = %e, "accept failed");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                    },
                    _ = shutdown.changed() => break,
                    _ = &mut report => {}
                }
            }
            gate.flush_drops();
        })
    }

    /// Stops accepting, lets connections finish their in-flight commands and close, then
    /// flushes every backend. Returns the number of flush failures.
    pub async fn shutdown(&self) -> usize {
        info!(
            connections = self.target.connection_count(),
            "shutting down: no new connections, completing in-flight commands"
        );
        self.target.begin_shutdown();
        let acceptors = std::mem::take(&mut *self.acceptors.lock());
        for a in acceptors {
            let _ = a.task.await;
        }
        self.pool.lock().take();
        let reactors = std::mem::take(&mut *self.reactors.lock());
        let _ = tokio::task::spawn_blocking(move || {
            for r in reactors {
                let _ = r.join();
            }
        })
        .await;
        crate::ratelimit::LOG_LIMITS.flush(true);
        let failures = self.target.flush_all().await;
        info!(flush_failures = failures, "shutdown complete");
        failures
    }
}
