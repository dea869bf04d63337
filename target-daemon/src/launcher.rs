//! The launcher: starts the reactor pool and the listeners' accept loops for a built
//! [`Target`], and shuts them down in order. The target itself ([`crate::target`]) is the
//! registry of subsystems, listeners and limits; transports serve connections
//! ([`crate::tcp`], [`crate::rdma`]) on the reactors of [`crate::reactor`].

use std::sync::Arc;
use std::time::Duration;

use tracing::{info, warn};

use crate::reactor::{Connection, Pool};
use crate::target::{BoundListener, ListenerSocket, StartError, Target};

/// A handle to a running target.
pub struct RunningTarget {
    /// Shared state.
    pub target: Arc<Target>,
    reactors: Vec<std::thread::JoinHandle<()>>,
    acceptors: Vec<tokio::task::JoinHandle<()>>,
}

impl RunningTarget {
    /// Starts reactors and accept loops on the current tokio runtime.
    pub fn start(
        target: Arc<Target>,
        listeners: Vec<BoundListener>,
    ) -> Result<RunningTarget, StartError> {
        let (pool, reactors) = Pool::start(&target)?;
        let mut acceptors = Vec::new();
        let mut rdma = Vec::new();
        for l in listeners {
            let socket = match l.socket {
                ListenerSocket::Tcp(s) => s,
                ListenerSocket::Rdma(r) => {
                    rdma.push((l.addr, r));
                    continue;
                }
            };
            let listener =
                tokio::net::TcpListener::from_std(socket).map_err(|source| StartError::Bind {
                    addr: l.addr.to_string(),
                    source,
                })?;
            info!(listener = %l.addr, "listening");
            let pool = Arc::clone(&pool);
            let mut shutdown = target.subscribe_shutdown();
            let gate = target.listener_gate(l.addr.clone());
            acceptors.push(tokio::spawn(async move {
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
                                if pool.hand(Connection::Tcp(stream, permit)).is_err() {
                                    break;
                                }
                            }
                            Err(e) => {
                                warn!(listener = %l.addr, error = %e, "accept failed");
                                tokio::time::sleep(Duration::from_millis(50)).await;
                            }
                        },
                        _ = shutdown.changed() => break,
                        _ = &mut report => {}
                    }
                }
                gate.flush_drops();
            }));
        }
        acceptors.extend(crate::rdma::start(&target, rdma, &pool));
        Ok(RunningTarget {
            target,
            reactors,
            acceptors,
        })
    }

    /// Stops accepting, lets connections finish their in-flight commands and close, then
    /// flushes every backend. Returns the number of flush failures.
    pub async fn shutdown(self) -> usize {
        info!(
            connections = self.target.connection_count(),
            "shutting down: no new connections, completing in-flight commands"
        );
        self.target.begin_shutdown();
        for a in self.acceptors {
            let _ = a.await;
        }
        let reactors = self.reactors;
        let _ = tokio::task::spawn_blocking(move || {
            for r in reactors {
                let _ = r.join();
            }
        })
        .await;
        let failures = self.target.flush_all().await;
        info!(flush_failures = failures, "shutdown complete");
        failures
    }
}
