//! The protocol of `nvmeof-initd` and its client.
//!
//! `nvmeof-initd` holds named attachments: a subsystem, a namespace and connection settings,
//! kept connected (admin queue with keep-alive, reconnect) and reported with their health.
//! It listens on a Unix socket (default [`DEFAULT_SOCKET`], or `$NVMEOF_INITD_SOCKET`).
//! Clients find it with [`client_socket_paths`]: the user's own daemon first, then the
//! system's.
//!
//! The protocol is one JSON object per line in each direction: a [`Request`] (tagged by its
//! `op` field), answered by one [`Response`].
//!
//! A process that wants the data of an attachment calls [`open_attached`]: it asks the
//! daemon for the attachment's parameters (including the host identity the daemon uses), then
//! connects its own controller and I/O queues, so the data path stays inside the process.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};

use crate::identity::{is_root, parse_hostid};
use crate::{
    ConnectOptions, Controller, ControllerInfo, DhchapSecrets, Error, ErrorClass, HostIdentity,
    Multipath, MultipathNamespace, MultipathOptions, Namespace, NamespaceInfo, PathInfo,
    TargetAddr, TlsOptions, Transport,
};

/// The daemon's socket path when running as root.
pub const DEFAULT_SOCKET: &str = "/run/nvmeof/initd.sock";
/// Environment variable naming the daemon's socket (for the CLI, the daemon and the library).
pub const SOCKET_ENV: &str = "NVMEOF_INITD_SOCKET";
/// How long a request to the daemon may take (attach connects to the target first).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);

/// The daemon socket to use: `$NVMEOF_INITD_SOCKET`, else [`DEFAULT_SOCKET`] for root, else
/// `$XDG_RUNTIME_DIR/nvmeof/initd.sock` when that variable is set, else [`DEFAULT_SOCKET`].
pub fn default_socket_path() -> PathBuf {
    if let Some(p) = std::env::var_os(SOCKET_ENV).filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    if !is_root() {
        if let Some(x) = std::env::var_os("XDG_RUNTIME_DIR").filter(|x| !x.is_empty()) {
            return PathBuf::from(x).join("nvmeof/initd.sock");
        }
    }
    PathBuf::from(DEFAULT_SOCKET)
}

/// The sockets a client tries, in order: `$NVMEOF_INITD_SOCKET` alone when it is set; else,
/// for a user other than root with `$XDG_RUNTIME_DIR` set, that user's own daemon
/// (`$XDG_RUNTIME_DIR/nvmeof/initd.sock`) and then the system daemon ([`DEFAULT_SOCKET`], which
/// members of its group may use); else [`DEFAULT_SOCKET`].
pub fn client_socket_paths() -> Vec<PathBuf> {
    let own = default_socket_path();
    let system = PathBuf::from(DEFAULT_SOCKET);
    let explicit = std::env::var_os(SOCKET_ENV).is_some_and(|p| !p.is_empty());
    if explicit || own == system {
        vec![own]
    } else {
        vec![own, system]
    }
}

/// What an attachment connects to, and how.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttachParams {
    /// Transport: `tcp` or `rdma`.
    pub transport: String,
    /// Target address.
    pub traddr: String,
    /// Target port.
    pub trsvcid: u16,
    /// Subsystem NQN.
    pub subnqn: String,
    /// Namespace ID.
    pub nsid: u32,
    /// Host NQN (the daemon fills in its own when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostnqn: Option<String>,
    /// Host identifier (the daemon fills in its own when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostid: Option<String>,
    /// Header digests.
    #[serde(default)]
    pub hdr_digest: bool,
    /// Data digests.
    #[serde(default)]
    pub data_digest: bool,
    /// Keep SQ flow control on ([`ConnectOptions::disable_sq_flow_control`] off).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub sq_flow_control: bool,
    /// I/O queues for processes that open the attachment (default: one per core).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nr_io_queues: Option<u16>,
    /// Entries per I/O queue.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_size: Option<u16>,
    /// Keep alive timeout in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kato_ms: Option<u32>,
    /// DH-HMAC-CHAP host secret (`DHHC-1:XX:<base64>:`), for controllers that require
    /// authentication. Stored in the daemon's root-only state file; never listed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dhchap_secret: Option<KeyText>,
    /// DH-HMAC-CHAP controller secret: the controller must authenticate itself too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dhchap_ctrl_secret: Option<KeyText>,
    /// Configured TLS PSK (`NVMeTLSkey-1:XX:<base64>:`): connect over NVMe/TCP TLS 1.3 with
    /// it. Stored in the daemon's root-only state file; never listed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_key: Option<KeyText>,
    /// More paths to the subsystem (same transport), after `traddr`/`trsvcid`: a multipath
    /// attachment (see [`crate::multipath`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub paths: Vec<PathAddr>,
}

/// Another path of a multipath attachment.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PathAddr {
    /// Target address.
    pub traddr: String,
    /// Target port.
    pub trsvcid: u16,
}

/// A secret in its text form. `Debug` shows no key material.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct KeyText(pub String);

impl std::fmt::Debug for KeyText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeyText([redacted])")
    }
}

impl AttachParams {
    /// The host identity these parameters name, or `fallback` for missing parts.
    pub fn identity(&self, fallback: &HostIdentity) -> Result<HostIdentity, Error> {
        let hostnqn = self.hostnqn.as_deref().unwrap_or(&fallback.hostnqn);
        let hostid = match &self.hostid {
            Some(s) => parse_hostid(s)
                .ok_or_else(|| Error::InvalidArgument(format!("{s:?} is not a host ID (UUID)")))?,
            None => fallback.hostid,
        };
        HostIdentity::new(hostnqn, hostid)
    }

    /// Connection settings for these parameters, with `host` as the identity.
    pub fn connect_options(&self, host: HostIdentity) -> Result<ConnectOptions, Error> {
        let transport: Transport = self.transport.parse()?;
        let mut o = ConnectOptions::new(
            TargetAddr::new(self.traddr.clone(), self.trsvcid).with_transport(transport),
            self.subnqn.clone(),
            host,
        );
        o.header_digest = self.hdr_digest;
        o.data_digest = self.data_digest;
        o.disable_sq_flow_control = !self.sq_flow_control;
        o.io_queues = self.nr_io_queues;
        if let Some(q) = self.queue_size {
            o.queue_depth = q;
        }
        if let Some(k) = self.kato_ms {
            o.kato = Duration::from_millis(u64::from(k));
        }
        o.dhchap = self.dhchap()?;
        o.tls = self
            .tls_key
            .as_ref()
            .map(|k| TlsOptions::parse(&k.0))
            .transpose()?;
        Ok(o)
    }

    /// Every path: `traddr`/`trsvcid` first, then [`paths`](Self::paths).
    pub fn addrs(&self) -> Result<Vec<TargetAddr>, Error> {
        let transport: Transport = self.transport.parse()?;
        Ok(std::iter::once((self.traddr.as_str(), self.trsvcid))
            .chain(self.paths.iter().map(|p| (p.traddr.as_str(), p.trsvcid)))
            .map(|(a, p)| TargetAddr::new(a, p).with_transport(transport))
            .collect())
    }

    /// The DH-HMAC-CHAP secrets, parsed (a controller secret needs a host secret).
    pub fn dhchap(&self) -> Result<Option<DhchapSecrets>, Error> {
        match (&self.dhchap_secret, &self.dhchap_ctrl_secret) {
            (None, None) => Ok(None),
            (None, Some(_)) => Err(Error::InvalidArgument(
                "a DH-HMAC-CHAP controller secret needs a host secret too".into(),
            )),
            (Some(h), c) => DhchapSecrets::parse(&h.0, c.as_ref().map(|c| c.0.as_str())).map(Some),
        }
    }

    /// The same parameters without the secrets, for listings.
    pub fn without_secrets(&self) -> Self {
        AttachParams {
            dhchap_secret: None,
            dhchap_ctrl_secret: None,
            tls_key: None,
            ..self.clone()
        }
    }
}

/// A request to the daemon.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Adds an attachment (connects first; nothing is kept if that fails).
    Attach {
        /// Attachment name.
        name: String,
        /// Parameters (boxed: they dwarf the other requests).
        params: Box<AttachParams>,
    },
    /// Removes an attachment and disconnects it.
    Detach {
        /// Attachment name.
        name: String,
    },
    /// Lists the attachments.
    List,
    /// One attachment, with its parameters (for processes that open it).
    Get {
        /// Attachment name.
        name: String,
    },
    /// The active namespace IDs of a subsystem, read with the daemon's host identity (for
    /// `nvmeof connect`, which attaches every namespace); nothing is kept.
    ActiveNamespaces {
        /// Where to connect (the namespace ID is not used).
        params: Box<AttachParams>,
    },
    /// Liveness check.
    Ping,
}

/// Health and identity of an attachment.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttachmentStatus {
    /// Attachment name.
    pub name: String,
    /// Parameters, with the host identity filled in.
    pub params: AttachParams,
    /// `connecting`, `connected`, `reconnecting`, `failed`, or `removed` (connected, but the
    /// namespace was removed from the subsystem; `last_error` says so).
    pub state: String,
    /// The last connection error, if any.
    pub last_error: Option<String>,
    /// The controller, once connected.
    pub controller: Option<ControllerInfo>,
    /// The namespace, once connected.
    pub namespace: Option<NamespaceInfo>,
    /// Each path of a multipath attachment, with its state and ANA states (empty for a
    /// single-path one).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub paths: Vec<PathInfo>,
}

/// The daemon's answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Response {
    /// Whether the request succeeded.
    pub ok: bool,
    /// What went wrong.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Which kind of failure `error` is, when it happened at the target (absent: the daemon
    /// refused the request).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<ErrorClass>,
    /// Active namespace IDs (active_namespaces).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nsids: Option<Vec<u32>>,
    /// The attachment concerned (attach, get).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attachment: Option<AttachmentStatus>,
    /// Every attachment (list).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attachments: Option<Vec<AttachmentStatus>>,
}

impl Response {
    /// A failure answer.
    pub fn error(msg: impl Into<String>) -> Self {
        Response {
            ok: false,
            error: Some(msg.into()),
            ..Default::default()
        }
    }

    /// A failure answer saying `message` about `e`, classified by the first initiator error
    /// among the causes of `e`.
    pub fn failure(message: impl Into<String>, e: &(dyn std::error::Error + 'static)) -> Self {
        let mut class = None;
        let mut cause = Some(e);
        while let Some(c) = cause {
            if let Some(ie) = c.downcast_ref::<Error>() {
                class = Some(ie.class()).filter(|k| *k != ErrorClass::Daemon);
                break;
            }
            cause = c.source();
        }
        Response {
            class,
            ..Response::error(message)
        }
    }

    /// A success answer with nothing in it.
    pub fn ok() -> Self {
        Response {
            ok: true,
            ..Default::default()
        }
    }
}

/// A connection to the daemon.
pub struct DaemonClient {
    reader: BufReader<OwnedReadHalf>,
    writer: OwnedWriteHalf,
    path: PathBuf,
}

impl DaemonClient {
    /// Connects to the daemon's socket.
    pub async fn connect(path: &Path) -> Result<Self, Error> {
        let stream = tokio::time::timeout(Duration::from_secs(5), UnixStream::connect(path))
            .await
            .map_err(|_| Error::Daemon(format!("timed out connecting to {}", path.display())))?
            .map_err(|e| {
                Error::Daemon(format!(
                    "cannot connect to {} ({e}); is nvmeof-initd running?",
                    path.display()
                ))
            })?;
        Ok(Self::from_stream(stream, path))
    }

    /// Connects to the first of `paths` that answers (see [`client_socket_paths`]). The error
    /// names every path tried and why it failed.
    pub async fn connect_first(paths: &[PathBuf]) -> Result<Self, Error> {
        let mut tried = Vec::new();
        for p in paths {
            match tokio::time::timeout(Duration::from_secs(5), UnixStream::connect(p)).await {
                Ok(Ok(stream)) => return Ok(Self::from_stream(stream, p)),
                Ok(Err(e)) => {
                    let hint = if e.kind() == std::io::ErrorKind::PermissionDenied {
                        " (only root and the socket's group may use it)"
                    } else {
                        ""
                    };
                    tried.push(format!("{}: {e}{hint}", p.display()));
                }
                Err(_) => tried.push(format!("{}: timed out", p.display())),
            }
        }
        Err(Error::Daemon(format!(
            "not reachable (tried {}); is nvmeof-initd running? (--socket or ${SOCKET_ENV} \
             names another socket)",
            tried.join("; ")
        )))
    }

    fn from_stream(stream: UnixStream, path: &Path) -> Self {
        let (r, w) = stream.into_split();
        DaemonClient {
            reader: BufReader::new(r),
            writer: w,
            path: path.to_path_buf(),
        }
    }

    /// Sends a request and reads the answer. An answer with `ok: false` becomes
    /// [`Error::Daemon`].
    pub async fn request(&mut self, req: &Request) -> Result<Response, Error> {
        let mut line = serde_json::to_string(req)
            .map_err(|e| Error::Daemon(format!("cannot encode the request: {e}")))?;
        line.push('\n');
        let io = async {
            self.writer.write_all(line.as_bytes()).await?;
            let mut answer = String::new();
            let n = self.reader.read_line(&mut answer).await?;
            Ok::<_, std::io::Error>((n, answer))
        };
        let (n, answer) = tokio::time::timeout(REQUEST_TIMEOUT, io)
            .await
            .map_err(|_| Error::Daemon(format!("no answer from {}", self.path.display())))?
            .map_err(|e| Error::Daemon(format!("{}: {e}", self.path.display())))?;
        if n == 0 {
            return Err(Error::Daemon(format!(
                "{} closed the connection",
                self.path.display()
            )));
        }
        let resp: Response = serde_json::from_str(&answer)
            .map_err(|e| Error::Daemon(format!("unreadable answer: {e}")))?;
        if !resp.ok {
            let message = resp.error.unwrap_or_else(|| "request failed".into());
            return Err(match resp.class {
                Some(class) if class != ErrorClass::Daemon => Error::ViaDaemon { class, message },
                _ => Error::Daemon(message),
            });
        }
        Ok(resp)
    }

    /// Adds an attachment.
    pub async fn attach(
        &mut self,
        name: &str,
        params: AttachParams,
    ) -> Result<AttachmentStatus, Error> {
        let r = self
            .request(&Request::Attach {
                name: name.to_string(),
                params: Box::new(params),
            })
            .await?;
        r.attachment
            .ok_or_else(|| Error::Daemon("the answer has no attachment".into()))
    }

    /// The active namespace IDs of the subsystem `params` name, read by the daemon with its
    /// host identity.
    pub async fn active_namespaces(&mut self, params: AttachParams) -> Result<Vec<u32>, Error> {
        let r = self
            .request(&Request::ActiveNamespaces {
                params: Box::new(params),
            })
            .await?;
        Ok(r.nsids.unwrap_or_default())
    }

    /// Removes an attachment.
    pub async fn detach(&mut self, name: &str) -> Result<(), Error> {
        self.request(&Request::Detach {
            name: name.to_string(),
        })
        .await
        .map(|_| ())
    }

    /// Lists the attachments.
    pub async fn list(&mut self) -> Result<Vec<AttachmentStatus>, Error> {
        Ok(self
            .request(&Request::List)
            .await?
            .attachments
            .unwrap_or_default())
    }

    /// One attachment.
    pub async fn get(&mut self, name: &str) -> Result<AttachmentStatus, Error> {
        let r = self
            .request(&Request::Get {
                name: name.to_string(),
            })
            .await?;
        r.attachment
            .ok_or_else(|| Error::Daemon("the answer has no attachment".into()))
    }

    /// Connection settings of attachment `name` (with the daemon's host identity) and its
    /// namespace ID, as [`attached_options`] returns them.
    pub async fn attached_options(&mut self, name: &str) -> Result<(ConnectOptions, u32), Error> {
        let a = self.get(name).await?;
        let (Some(hostnqn), Some(hostid)) = (&a.params.hostnqn, &a.params.hostid) else {
            return Err(Error::Daemon(format!(
                "attachment {name} has no host identity"
            )));
        };
        let id = parse_hostid(hostid)
            .ok_or_else(|| Error::Daemon(format!("attachment {name} has a bad host ID")))?;
        let host = HostIdentity::new(hostnqn, id)?;
        Ok((a.params.connect_options(host)?, a.params.nsid))
    }
}

/// Asks the daemon at `socket` for attachment `name`; returns connection settings for it
/// (with the daemon's host identity) and its namespace ID. Adjust the settings, then
/// [`Controller::connect`].
pub async fn attached_options(socket: &Path, name: &str) -> Result<(ConnectOptions, u32), Error> {
    DaemonClient::connect(socket)
        .await?
        .attached_options(name)
        .await
}

/// Opens the namespace attached as `name` in `nvmeof-initd` (the first socket of
/// [`client_socket_paths`] that answers): the daemon gives the parameters, this process
/// connects its own controller and I/O queues.
pub async fn open_attached(name: &str) -> Result<Namespace, Error> {
    let mut c = DaemonClient::connect_first(&client_socket_paths()).await?;
    let (opts, nsid) = c.attached_options(name).await?;
    drop(c);
    let ctrl = Controller::connect(opts).await?;
    ctrl.namespace(nsid).await
}

/// Opens the namespace attached as `name` over every path of the attachment (a multipath
/// attachment's, or its one path): this process connects a [`Multipath`] of its own, with
/// the daemon's parameters and host identity. [`open_attached`] uses the first path only.
pub async fn open_attached_multipath(
    socket: &Path,
    name: &str,
) -> Result<MultipathNamespace, Error> {
    let mut c = DaemonClient::connect(socket).await?;
    let (opts, nsid) = c.attached_options(name).await?;
    let a = c.get(name).await?;
    drop(c);
    let mp = Multipath::connect(opts, a.params.addrs()?, MultipathOptions::default()).await?;
    mp.namespace(nsid).await
}

/// [`open_attached`] with an explicit daemon socket.
pub async fn open_attached_at(socket: &Path, name: &str) -> Result<Namespace, Error> {
    let (opts, nsid) = attached_options(socket, name).await?;
    let ctrl = Controller::connect(opts).await?;
    ctrl.namespace(nsid).await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parameters of an attachment over NVMe/TCP with no keys and every option at its default.
    fn plain_params() -> AttachParams {
        AttachParams {
            transport: "tcp".into(),
            traddr: "127.0.0.1".into(),
            trsvcid: 4420,
            subnqn: "nqn.x:y".into(),
            nsid: 1,
            hostnqn: None,
            hostid: None,
            hdr_digest: false,
            data_digest: false,
            sq_flow_control: false,
            nr_io_queues: None,
            queue_size: None,
            kato_ms: None,
            dhchap_secret: None,
            dhchap_ctrl_secret: None,
            tls_key: None,
            paths: Vec::new(),
        }
    }

    #[test]
    fn multipath_params_list_every_path() {
        let p = AttachParams {
            paths: vec![PathAddr {
                traddr: "10.0.0.2".into(),
                trsvcid: 4421,
            }],
            ..plain_params()
        };
        let text = serde_json::to_string(&p).unwrap();
        assert!(text.contains(r#""paths":[{"traddr":"10.0.0.2","trsvcid":4421}]"#));
        assert_eq!(
            p.addrs().unwrap(),
            [
                TargetAddr::new("127.0.0.1", 4420),
                TargetAddr::new("10.0.0.2", 4421)
            ]
        );
        // Single-path parameters are written as before.
        assert!(
            !serde_json::to_string(&plain_params())
                .unwrap()
                .contains("paths")
        );
    }

    #[test]
    fn request_wire_format() {
        let r = Request::Detach { name: "a".into() };
        assert_eq!(
            serde_json::to_string(&r).unwrap(),
            r#"{"op":"detach","name":"a"}"#
        );
        let back: Request = serde_json::from_str(r#"{"op":"list"}"#).unwrap();
        assert_eq!(back, Request::List);
        let p = AttachParams {
            data_digest: true,
            nr_io_queues: Some(2),
            ..plain_params()
        };
        let s = serde_json::to_string(&Request::Attach {
            name: "n".into(),
            params: Box::new(p.clone()),
        })
        .unwrap();
        let back: Request = serde_json::from_str(&s).unwrap();
        assert_eq!(
            back,
            Request::Attach {
                name: "n".into(),
                params: Box::new(p.clone())
            }
        );
        let o = p
            .connect_options(HostIdentity::new("nqn.h:1", [1; 16]).unwrap())
            .unwrap();
        assert!(o.data_digest && !o.header_digest);
        assert!(o.disable_sq_flow_control);
        assert!(!s.contains("sq_flow_control"));
        assert_eq!(o.io_queues, Some(2));
        let host = HostIdentity::new("nqn.h:1", [1; 16]).unwrap();
        let rdma = AttachParams {
            transport: "rdma".into(),
            data_digest: false,
            ..p.clone()
        };
        let o = rdma.connect_options(host.clone()).unwrap();
        assert_eq!(o.addr, TargetAddr::rdma("127.0.0.1", 4420));
        let fc = AttachParams {
            transport: "fc".into(),
            ..p
        };
        assert!(fc.connect_options(host).is_err());
    }

    #[test]
    fn attachment_secrets_are_parsed_and_never_shown() {
        const TLS_KEY: &str = "NVMeTLSkey-1:01:BwcHBwcHBwcHBwcHBwcHBwcHBwcHBwcHBwcHBwcHBwfLJNij:";
        let key = "DHHC-1:00:ZXhhbXBsZS1rZXktZm9yLXVuaXQtdGVzdHMtMzJieXR38mKy:";
        let p = AttachParams {
            dhchap_secret: Some(KeyText(key.into())),
            dhchap_ctrl_secret: Some(KeyText(key.into())),
            tls_key: Some(KeyText(TLS_KEY.into())),
            ..plain_params()
        };
        let host = HostIdentity::new("nqn.h:1", [1; 16]).unwrap();
        let o = p.connect_options(host.clone()).unwrap();
        let d = o.dhchap.as_ref().unwrap();
        assert_eq!(d.host.to_dhhc1(), key);
        assert!(d.ctrl.is_some());
        assert!(o.tls.is_some(), "the TLS PSK reaches the connect options");
        for shown in [format!("{p:?}"), format!("{o:?}")] {
            assert!(!shown.contains(&key[10..30]), "{shown}");
            assert!(!shown.contains(&TLS_KEY[16..40]), "{shown}");
        }
        let listed = serde_json::to_string(&p.without_secrets()).unwrap();
        assert!(
            !listed.contains("dhchap") && !listed.contains("tls_key"),
            "{listed}"
        );
        let ctrl_only = AttachParams {
            dhchap_secret: None,
            ..p.clone()
        };
        assert!(ctrl_only.connect_options(host.clone()).is_err());
        let bad = AttachParams {
            dhchap_secret: Some(KeyText("DHHC-1:00:AAAA:".into())),
            ..p
        };
        let e = bad.connect_options(host).unwrap_err().to_string();
        assert!(e.contains("host secret"), "{e}");
    }

    #[test]
    fn failures_at_the_target_keep_their_class() {
        let auth = Error::Auth {
            qid: 0,
            reason: "authentication failed".into(),
        };
        let r = Response::failure("cannot attach x: authentication failed", &auth);
        let wire = serde_json::to_string(&r).unwrap();
        assert!(wire.contains(r#""class":"target""#), "{wire}");
        let back: Response = serde_json::from_str(&wire).unwrap();
        assert_eq!(back.class, Some(ErrorClass::Target));
        // The daemon's own refusals carry no class.
        let refused = Response::failure("no", &Error::Daemon("no".into()));
        assert_eq!(refused.class, None);
        let wire = serde_json::to_string(&Request::ActiveNamespaces {
            params: Box::new(plain_params()),
        })
        .unwrap();
        assert!(
            wire.starts_with(r#"{"op":"active_namespaces","params":{"#),
            "{wire}"
        );
    }
}
