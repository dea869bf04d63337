//! The remote control API: the control socket's requests and answers ([`crate::control`]:
//! one JSON object per line, `"version": 1`) served over TCP with mutual TLS, for programs
//! that manage the target from another machine (`nvmeof-targetd ctl --remote HOST:PORT`).
//! Off unless `[target.remote_control]` is set.
//!
//! - A client must present a certificate signed by the configured CA; the handshake fails
//!   otherwise (no certificate, another CA).
//! - Its certificate's common name (CN) gives its role: `admins` may make every request,
//!   `readers` only `list` and `status`; any other name gets one error line and is closed.
//! - Changes are idempotent: a change already in effect (an object added before as the
//!   request describes it, or removed before) is answered `ok` with no changes, so a client
//!   that retries after a lost answer neither fails nor changes twice. `add-namespace` is
//!   retry-safe when it names its NSID.
//! - The limits of the control socket hold here too ([`ClientLimits`]), and a client has
//!   [`HANDSHAKE_TIMEOUT`] to finish the TLS handshake.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use nvmf_tls::{CertFiles, ClientContext, ServerContext, Stream, TlsError};
use tokio::net::{TcpListener, TcpStream};
use tracing::{debug, info, warn};

use crate::config::RemoteControl;
use crate::control::{
    ClientLimits, MAX_REQUEST, Request, Response, answer, decode, encode, is_read_only,
};
use crate::reconfigure::Registry;

/// How long a client has to finish the TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a client waits for an answer.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(60);

/// Why the remote control API could not be set up, or a remote request got no answer.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    /// A certificate, key or CA file could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// The TLS context could not be built, or the handshake failed.
    #[error("{addr}: {source}")]
    Tls {
        /// The address served or reached.
        addr: String,
        /// Cause.
        source: TlsError,
    },
    /// The address could not be bound or reached.
    #[error("{addr}: {source}")]
    Connect {
        /// The address.
        addr: String,
        /// Cause.
        source: std::io::Error,
    },
    /// The exchange failed.
    #[error("{addr}: {reason}")]
    Exchange {
        /// The address.
        addr: String,
        /// What went wrong.
        reason: String,
    },
}

fn read(path: &Path) -> Result<Vec<u8>, RemoteError> {
    std::fs::read(path).map_err(|source| RemoteError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// The server's TLS context of `cfg`: its certificate and key, and the CA of the clients.
pub fn server_context(cfg: &RemoteControl) -> Result<ServerContext, RemoteError> {
    let (cert, key, ca) = (read(&cfg.cert)?, read(&cfg.key)?, read(&cfg.ca)?);
    let files = CertFiles {
        cert: &cert,
        key: &key,
        ca: &ca,
    };
    ServerContext::mutual(&files).map_err(|source| RemoteError::Tls {
        addr: cfg.listen.to_string(),
        source,
    })
}

/// The remote control API, bound and ready to serve.
pub struct Server {
    listener: TcpListener,
    tls: ServerContext,
    admins: Vec<String>,
    readers: Vec<String>,
}

impl Server {
    /// Reads the certificates of `cfg` and binds its address.
    pub async fn bind(cfg: &RemoteControl) -> Result<Server, RemoteError> {
        let tls = server_context(cfg)?;
        let listener =
            TcpListener::bind(cfg.listen)
                .await
                .map_err(|source| RemoteError::Connect {
                    addr: cfg.listen.to_string(),
                    source,
                })?;
        Ok(Server {
            listener,
            tls,
            admins: cfg.admins.clone(),
            readers: cfg.readers.clone(),
        })
    }

    /// The address served (port resolved).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.listener.local_addr().ok()
    }

    /// Serves clients until the target shuts down, within `limits`.
    pub async fn serve(self, registry: Arc<Registry>, limits: ClientLimits) {
        let server = Arc::new(self);
        let mut shutdown = registry.target().subscribe_shutdown();
        let slots = Arc::new(tokio::sync::Semaphore::new(limits.max_clients));
        loop {
            tokio::select! {
                r = server.listener.accept() => match r {
                    Ok((tcp, peer)) => {
                        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
                            warn!(%peer, max = limits.max_clients, "remote control: too many clients, one refused");
                            continue;
                        };
                        let (server, registry) = (Arc::clone(&server), Arc::clone(&registry));
                        tokio::spawn(async move {
                            server.client(tcp, peer, registry, limits.idle_timeout).await;
                            drop(slot);
                        });
                    }
                    Err(e) => {
                        warn!(error = %e, "remote control: accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
                _ = shutdown.changed() => break,
            }
        }
    }

    async fn client(
        &self,
        tcp: TcpStream,
        peer: SocketAddr,
        registry: Arc<Registry>,
        idle: Duration,
    ) {
        let mut stream =
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, Stream::accept(&self.tls, tcp)).await {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    warn!(%peer, error = %e, "remote control: client refused");
                    return;
                }
                Err(_) => {
                    warn!(%peer, "remote control: TLS handshake timed out");
                    return;
                }
            };
        let id = stream.peer_common_name().unwrap_or_default();
        let admin = self.admins.contains(&id);
        if !admin && !self.readers.contains(&id) {
            warn!(%peer, identity = %id, "remote control: identity not allowed");
            // Its request is read first: closing with it unread would reset the connection,
            // and the client could lose the answer.
            let _ = tokio::time::timeout(idle, read_line(&mut stream, &mut Vec::new())).await;
            let resp = Response::error(format!(
                "client identity {id:?} is not allowed on this target"
            ));
            let _ = write_line(&mut stream, &resp).await;
            return;
        }
        debug!(%peer, identity = %id, admin, "remote control client");
        let mut buf = Vec::new();
        loop {
            let line = match tokio::time::timeout(idle, read_line(&mut stream, &mut buf)).await {
                Err(_) => {
                    let resp =
                        Response::error(format!("idle for {}s: disconnected", idle.as_secs()));
                    let _ = write_line(&mut stream, &resp).await;
                    return;
                }
                Ok(Ok(Some(line))) => line,
                Ok(Ok(None)) => return,
                Ok(Err(e)) => {
                    let _ = write_line(&mut stream, &Response::error(e)).await;
                    return;
                }
            };
            let resp = match decode(&line) {
                Err(e) => Response::error(e),
                Ok(req) if !admin && !is_read_only(&req) => {
                    warn!(%peer, identity = %id, "remote control: a read-only client asked for a change");
                    Response::error(format!(
                        "client identity {id:?} may only read (list, status)"
                    ))
                }
                Ok(req) => {
                    if !is_read_only(&req) {
                        info!(%peer, identity = %id, "remote control request");
                    }
                    let reg = Arc::clone(&registry);
                    tokio::task::spawn_blocking(move || answer(&reg, &req, true))
                        .await
                        .unwrap_or_else(|e| Response::error(format!("internal error: {e}")))
                }
            };
            let written = tokio::time::timeout(CLIENT_TIMEOUT, write_line(&mut stream, &resp));
            if !matches!(written.await, Ok(Ok(()))) {
                return;
            }
        }
    }
}

/// Reads one line (without its newline) into a `String`, keeping what follows in `buf`.
/// `None`: the peer closed the connection between lines.
async fn read_line(stream: &mut Stream, buf: &mut Vec<u8>) -> Result<Option<String>, String> {
    loop {
        if let Some(i) = buf.iter().position(|&b| b == b'\n') {
            let rest = buf.split_off(i + 1);
            let mut line = std::mem::replace(buf, rest);
            line.pop();
            return String::from_utf8(line)
                .map(Some)
                .map_err(|_| "malformed request: not UTF-8".into());
        }
        if buf.len() > MAX_REQUEST {
            return Err(format!("request longer than {MAX_REQUEST} bytes"));
        }
        let mut chunk = [0u8; 4096];
        match stream.read(&mut chunk).await {
            Ok(0) if buf.is_empty() => return Ok(None),
            Ok(0) => return Err("the request line ended without a newline".into()),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) => return Err(format!("read failed: {e}")),
        }
    }
}

async fn write_all(stream: &mut Stream, mut data: &[u8]) -> std::io::Result<()> {
    while !data.is_empty() {
        let n = stream.write(data).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        data = &data[n..];
    }
    Ok(())
}

async fn write_line(stream: &mut Stream, resp: &Response) -> std::io::Result<()> {
    let mut out = serde_json::to_string(resp).unwrap_or_default();
    out.push('\n');
    write_all(stream, out.as_bytes()).await
}

/// A client's certificate files.
#[derive(Clone, Debug)]
pub struct ClientFiles {
    /// The client's certificate and key (PEM); `None`: none is presented (the target refuses
    /// the handshake).
    pub cert_key: Option<(PathBuf, PathBuf)>,
    /// The CA certificates the target's certificate must be signed by.
    pub ca: PathBuf,
}

/// Sends one request line (as given) to the remote control API at `addr` (`HOST:PORT`) and
/// returns the answer.
pub async fn request_line(
    addr: &str,
    files: &ClientFiles,
    line: &str,
) -> Result<Response, RemoteError> {
    let own = match &files.cert_key {
        Some((c, k)) => Some((read(c)?, read(k)?)),
        None => None,
    };
    let ca = read(&files.ca)?;
    let tls_err = |source| RemoteError::Tls {
        addr: addr.to_string(),
        source,
    };
    let ctx =
        ClientContext::mutual(own.as_ref().map(|(c, k)| (&c[..], &k[..])), &ca).map_err(tls_err)?;
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    let fail = |reason: String| RemoteError::Exchange {
        addr: addr.to_string(),
        reason,
    };
    let exchange = async {
        let tcp = TcpStream::connect(addr)
            .await
            .map_err(|source| RemoteError::Connect {
                addr: addr.to_string(),
                source,
            })?;
        let mut stream = Stream::connect_to(&ctx, tcp, host).await.map_err(tls_err)?;
        // In TLS 1.3 the target checks this client's certificate after the client's side of
        // the handshake is done: a refusal arrives as an alert, or as a reset, on the first
        // write or read.
        let ended = |e: String| {
            fail(format!(
                "the target ended the TLS session ({e}); is this client's certificate one the \
                 target accepts?"
            ))
        };
        write_all(&mut stream, format!("{line}\n").as_bytes())
            .await
            .map_err(|e| ended(e.to_string()))?;
        match read_line(&mut stream, &mut Vec::new()).await {
            Ok(Some(answer)) => Ok(answer),
            Ok(None) => Err(ended("closed without an answer".into())),
            Err(e) => Err(ended(e)),
        }
    };
    let answer = tokio::time::timeout(CLIENT_TIMEOUT, exchange)
        .await
        .map_err(|_| fail("no answer".into()))??;
    serde_json::from_str(&answer).map_err(|e| fail(format!("unreadable answer: {e}")))
}

/// Sends `req` to the remote control API at `addr` and returns the answer.
pub async fn request(
    addr: &str,
    files: &ClientFiles,
    req: &Request,
) -> Result<Response, RemoteError> {
    request_line(addr, files, &encode(req)).await
}
