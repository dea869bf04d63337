//! The control socket of `nvmeof-targetd`: a small, versioned JSON protocol to inspect and
//! change the running target, and its client (`nvmeof-targetd ctl`).
//!
//! One JSON object per line in each direction. A request carries `"version": 1` and an `op`
//! with its fields ([`Request`]); unknown fields are refused. The answer ([`Response`]) has
//! `ok`, and either `error` (one line; nothing changed) or what the request produced:
//! `changes` (one line per change applied) or `status` (a JSON object, see
//! [`Registry::describe`]). A changing request is one [`Change`] ([`change_for`]), carried
//! out by [`Registry::change`]: validated as a whole, applied atomically.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use blockdev::BackendSpec;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tracing::{debug, warn};

use crate::config::{
    Config, DEFAULT_MODEL, HostAuthConfig, ListenerConfig, NamespaceConfig, SubsystemConfig,
};
use crate::plan::{Change, ChangeError, Host, refused};
use crate::reconfigure::Registry;

/// The protocol version this build speaks.
pub const PROTOCOL_VERSION: u32 = 1;
/// Longest request line accepted, in bytes.
pub const MAX_REQUEST: usize = 64 * 1024;
/// How long a client waits for an answer.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(60);

/// Limits on the clients of the control socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClientLimits {
    /// A client that sends no complete request for this long is disconnected.
    pub idle_timeout: Duration,
    /// Most clients connected at once; one more is answered with an error and closed.
    pub max_clients: usize,
}

impl Default for ClientLimits {
    fn default() -> Self {
        ClientLimits {
            idle_timeout: Duration::from_secs(60),
            max_clients: 64,
        }
    }
}

/// A request (the `op` field names it, in kebab-case; its fields are snake_case). It is also
/// the `nvmeof-targetd ctl` command line.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, clap::Subcommand)]
#[serde(tag = "op", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Request {
    /// Subsystems, namespaces, allowed hosts and listeners.
    List {},
    /// Like `list`, plus the connected controllers and the number of open connections.
    Status {},
    /// Adds a subsystem (without namespaces: add them with `add-namespace`).
    AddSubsystem {
        /// Its NQN.
        #[arg(long, value_name = "NQN")]
        nqn: String,
        /// Accept any host.
        #[serde(default)]
        #[arg(long)]
        allow_any_host: bool,
        /// Allowed host NQNs.
        #[serde(default)]
        #[arg(long = "host", value_name = "NQN")]
        hosts: Vec<String>,
        /// Serial number (default: derived from the NQN).
        #[serde(default)]
        #[arg(long, value_name = "SERIAL")]
        serial: Option<String>,
        /// Model number.
        #[serde(default)]
        #[arg(long, value_name = "MODEL")]
        model: Option<String>,
    },
    /// Removes a subsystem, disconnecting its controllers.
    RemoveSubsystem {
        /// Its NQN.
        #[arg(long, value_name = "NQN")]
        nqn: String,
    },
    /// Adds a namespace with any backend spec (`mem:`, `null:`, `file:`, `bdev:`, `pcie:`).
    AddNamespace {
        /// Subsystem NQN.
        #[arg(long, value_name = "NQN")]
        subsystem: String,
        /// Backend spec.
        #[arg(long, value_name = "SPEC")]
        backend: String,
        /// NSID (default: one more than the highest).
        #[serde(default)]
        #[arg(long, value_name = "NSID")]
        nsid: Option<u32>,
        /// UUID (default: derived from the subsystem NQN and NSID).
        #[serde(default)]
        #[arg(long, value_name = "UUID")]
        uuid: Option<String>,
        /// The only hosts that see the namespace (repeat; default: every host).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        #[arg(long = "host", value_name = "NQN")]
        hosts: Vec<String>,
        /// ANA group (default 1).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        #[arg(long, value_name = "GROUP")]
        ana_group: Option<u32>,
    },
    /// Shows a namespace to one more host (a namespace seen by listed hosts only). Hosts
    /// that now see it get a Namespace Attribute Notice.
    NsAddHost {
        /// Subsystem NQN.
        #[arg(long, value_name = "NQN")]
        subsystem: String,
        /// NSID.
        #[arg(long, value_name = "NSID")]
        nsid: u32,
        /// Host NQN.
        #[arg(long, value_name = "NQN")]
        host: String,
    },
    /// Hides a namespace from a host it was shown to; the host's controllers get a Namespace
    /// Attribute Notice and its I/O to the namespace fails with Invalid Namespace.
    NsRemoveHost {
        /// Subsystem NQN.
        #[arg(long, value_name = "NQN")]
        subsystem: String,
        /// NSID.
        #[arg(long, value_name = "NSID")]
        nsid: u32,
        /// Host NQN.
        #[arg(long, value_name = "NQN")]
        host: String,
    },
    /// Sets the ANA state of an ANA group on an I/O listener; hosts connected through it get
    /// an ANA Change notice, and I/O to the group's namespaces there is refused while it is
    /// inaccessible, in persistent loss or changing.
    SetAnaState {
        /// The listener, `tcp://ADDR:PORT` as `list` shows it.
        #[arg(long, value_name = "tcp://ADDR:PORT")]
        listener: String,
        /// ANA group ID.
        #[arg(long, value_name = "GROUP", default_value_t = 1)]
        #[serde(default = "default_ana_group")]
        group: u32,
        /// `optimized`, `non-optimized`, `inaccessible`, `persistent-loss` or `change`.
        #[arg(long, value_name = "STATE")]
        state: String,
    },
    /// Removes a namespace.
    RemoveNamespace {
        /// Subsystem NQN.
        #[arg(long, value_name = "NQN")]
        subsystem: String,
        /// NSID.
        #[arg(long, value_name = "NSID")]
        nsid: u32,
    },
    /// Changes a namespace's size (null namespaces; files grow only).
    ResizeNamespace {
        /// Subsystem NQN.
        #[arg(long, value_name = "NQN")]
        subsystem: String,
        /// NSID.
        #[arg(long, value_name = "NSID")]
        nsid: u32,
        /// New size, e.g. `2G`.
        #[arg(long, value_name = "SIZE")]
        size: String,
    },
    /// Allows a host; with keys, the host must authenticate (DH-HMAC-CHAP) or connect over
    /// TLS with its PSK, as a `[[subsystem.host]]` table says. With `--replace`, an allowed
    /// host gets these keys (or none) instead of its old ones: its connected controllers
    /// stay, the next authentications use the new keys.
    AddHost {
        /// Subsystem NQN.
        #[arg(long, value_name = "NQN")]
        subsystem: String,
        /// Host NQN.
        #[arg(long, value_name = "NQN")]
        host: String,
        /// The host's DH-HMAC-CHAP secret, `DHHC-1:XX:...:` (`nvme gen-dhchap-key`). A key on
        /// the command line lands in shell history: prefer --dhchap-key-file.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        #[arg(long, value_name = "KEY", conflicts_with = "dhchap_key_file")]
        dhchap_key: Option<String>,
        /// Reads --dhchap-key from FILE (`-`: standard input).
        #[serde(skip)]
        #[arg(long, value_name = "FILE")]
        dhchap_key_file: Option<PathBuf>,
        /// The controller's DH-HMAC-CHAP secret, for bidirectional authentication.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        #[arg(long, value_name = "KEY", conflicts_with = "dhchap_ctrl_key_file")]
        dhchap_ctrl_key: Option<String>,
        /// Reads --dhchap-ctrl-key from FILE (`-`: standard input).
        #[serde(skip)]
        #[arg(long, value_name = "FILE")]
        dhchap_ctrl_key_file: Option<PathBuf>,
        /// The host's configured TLS PSK, `NVMeTLSkey-1:01:...:` (`nvme gen-tls-key`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        #[arg(long, value_name = "KEY", conflicts_with = "tls_psk_file")]
        tls_psk: Option<String>,
        /// Reads --tls-psk from FILE (`-`: standard input).
        #[serde(skip)]
        #[arg(long, value_name = "FILE")]
        tls_psk_file: Option<PathBuf>,
        /// Replace the keys of a host already allowed, keeping its connections.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        #[arg(long)]
        replace: bool,
    },
    /// Stops allowing a host and disconnects its controllers.
    RemoveHost {
        /// Subsystem NQN.
        #[arg(long, value_name = "NQN")]
        subsystem: String,
        /// Host NQN.
        #[arg(long, value_name = "NQN")]
        host: String,
    },
    /// Starts listening on an address (NVMe/TCP).
    AddListener {
        /// `tcp://ADDR:PORT` or `rdma://ADDR:PORT`.
        #[arg(value_name = "tcp://ADDR:PORT")]
        address: String,
        /// A dedicated discovery listener.
        #[serde(default)]
        #[arg(long)]
        discovery: bool,
    },
    /// Stops listening on an address; connections it accepted stay.
    RemoveListener {
        /// `tcp://ADDR:PORT` or `rdma://ADDR:PORT`.
        #[arg(value_name = "tcp://ADDR:PORT")]
        address: String,
        /// A dedicated discovery listener.
        #[serde(default)]
        #[arg(long)]
        discovery: bool,
    },
    /// Lists another discovery controller in the discovery log (a referral entry); hosts
    /// connected to the discovery controller are told the log changed.
    AddReferral {
        /// `tcp://ADDR:PORT` or `rdma://ADDR:PORT` of the other discovery controller.
        #[arg(value_name = "tcp://ADDR:PORT")]
        address: String,
    },
    /// Takes a referral out of the discovery log.
    RemoveReferral {
        /// `tcp://ADDR:PORT` or `rdma://ADDR:PORT` of the other discovery controller.
        #[arg(value_name = "tcp://ADDR:PORT")]
        address: String,
    },
    /// Disconnects controllers by ID or host NQN.
    Disconnect {
        /// Subsystem NQN.
        #[arg(long, value_name = "NQN")]
        subsystem: String,
        /// Controller ID.
        #[serde(default)]
        #[arg(long, value_name = "CNTLID")]
        cntlid: Option<u16>,
        /// Host NQN.
        #[serde(default)]
        #[arg(long, value_name = "NQN")]
        host: Option<String>,
    },
    /// Writes the running configuration to a TOML file (absolute on the wire; `ctl` makes it
    /// absolute).
    Save {
        /// Where.
        #[arg(value_name = "FILE")]
        path: PathBuf,
    },
}

fn default_ana_group() -> u32 {
    crate::ana::DEFAULT_ANA_GROUP
}

/// An answer.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Response {
    /// The protocol version.
    pub version: u32,
    /// Whether the request succeeded.
    pub ok: bool,
    /// Why it failed (nothing changed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// What changed, one line each.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub changes: Option<Vec<String>>,
    /// The target's state (list, status).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<Value>,
}

impl Response {
    /// A refusal: `ok` false, `error` the one line saying why.
    pub fn error(msg: impl Into<String>) -> Self {
        Response {
            version: PROTOCOL_VERSION,
            error: Some(msg.into()),
            ..Default::default()
        }
    }

    fn ok() -> Self {
        Response {
            version: PROTOCOL_VERSION,
            ok: true,
            ..Default::default()
        }
    }
}

/// Encodes a request as one line (without the newline).
pub fn encode(req: &Request) -> String {
    let mut v = serde_json::to_value(req).unwrap_or(Value::Null);
    if let Value::Object(m) = &mut v {
        m.insert("version".into(), PROTOCOL_VERSION.into());
    }
    v.to_string()
}

/// Decodes a request line: a JSON object with `"version": 1`, an `op` and that op's fields.
pub fn decode(line: &str) -> Result<Request, String> {
    let v: Value = serde_json::from_str(line).map_err(|e| format!("malformed request: {e}"))?;
    let Value::Object(mut m) = v else {
        return Err("malformed request: expected a JSON object".into());
    };
    match m.remove("version") {
        Some(Value::Number(n)) if n.as_u64() == Some(u64::from(PROTOCOL_VERSION)) => {}
        Some(other) => {
            return Err(format!(
                "unsupported protocol version {other}; this target speaks version {PROTOCOL_VERSION}"
            ));
        }
        None => return Err(format!("missing \"version\" (use {PROTOCOL_VERSION})")),
    }
    serde_json::from_value(Value::Object(m)).map_err(|e| format!("invalid request: {e}"))
}

/// The `[[subsystem.host]]` table of `add-host` with keys. A key that does not parse is named
/// without its value.
fn host_keys(
    host: &str,
    dhchap_key: &Option<String>,
    dhchap_ctrl_key: &Option<String>,
    tls_psk: &Option<String>,
) -> Result<HostAuthConfig, ChangeError> {
    let dhchap = |what: &str, k: &Option<String>| match k {
        None => Ok(None),
        Some(k) => nvme_auth::DhchapKey::parse(k)
            .map(Some)
            .or_else(|e| refused(format!("{what}: {e}"))),
    };
    let tls_psk = match tls_psk {
        None => None,
        Some(k) => Some(crate::config::parse_tls_psk(k).or_else(refused)?),
    };
    Ok(HostAuthConfig {
        nqn: host.to_string(),
        dhchap_key: dhchap("dhchap_key", dhchap_key)?,
        dhchap_ctrl_key: dhchap("dhchap_ctrl_key", dhchap_ctrl_key)?,
        tls_psk,
        dhchap_hash: None,
        dhchap_dhgroup: None,
    })
}

fn parse<T: std::str::FromStr>(what: &str, s: &str) -> Result<T, ChangeError>
where
    T::Err: std::fmt::Display,
{
    s.parse()
        .map_err(|e| ChangeError::Refused(format!("{what} {s:?}: {e}")))
}

fn subsystem<'a>(cfg: &'a Config, nqn: &str) -> Result<&'a SubsystemConfig, ChangeError> {
    match cfg.subsystems.iter().find(|s| s.nqn == nqn) {
        Some(s) => Ok(s),
        None => refused(format!("no subsystem {nqn}")),
    }
}

/// The one change a changing request asks of a target running `cfg` (`None`: the request
/// changes nothing, as `list`). What the request leaves to the target (the NSID of a new
/// namespace) is decided here; what the change names is checked again when it is applied.
pub fn change_for(req: &Request, cfg: &Config) -> Result<Option<Change>, ChangeError> {
    let change = match req {
        Request::AddSubsystem {
            nqn,
            allow_any_host,
            hosts,
            serial,
            model,
        } => {
            if *allow_any_host && !hosts.is_empty() {
                return refused(
                    "--allow-any-host admits every host: drop --host, or drop --allow-any-host to admit only the listed hosts",
                );
            }
            Change::AddSubsystem(SubsystemConfig {
                nqn: nqn.clone(),
                serial: serial.clone(),
                model: model.clone().unwrap_or_else(|| DEFAULT_MODEL.into()),
                allow_any_host: *allow_any_host,
                hosts: hosts.clone(),
                auth_hosts: Vec::new(),
                namespaces: Vec::new(),
                cntlid_min: None,
                cntlid_max: None,
            })
        }
        Request::RemoveSubsystem { nqn } => Change::RemoveSubsystem { nqn: nqn.clone() },
        Request::AddNamespace {
            subsystem: nqn,
            backend,
            nsid,
            uuid,
            hosts,
            ana_group,
        } => {
            let backend: BackendSpec = parse("backend", backend)?;
            let s = subsystem(cfg, nqn)?;
            let nsid = match nsid {
                Some(n) => *n,
                None => s.nsids().max().unwrap_or(0).saturating_add(1),
            };
            Change::AddNamespace {
                subsystem: nqn.clone(),
                namespace: NamespaceConfig {
                    nsid: Some(nsid),
                    backend,
                    uuid: uuid.clone(),
                    hosts: hosts.clone(),
                    ana_group: *ana_group,
                },
            }
        }
        Request::RemoveNamespace {
            subsystem: nqn,
            nsid,
        } => Change::RemoveNamespace {
            subsystem: nqn.clone(),
            nsid: *nsid,
        },
        Request::ResizeNamespace {
            subsystem: nqn,
            nsid,
            size,
        } => Change::ResizeNamespace {
            subsystem: nqn.clone(),
            nsid: *nsid,
            size: blockdev::parse_size(size).map_err(|e| ChangeError::Refused(e.to_string()))?,
        },
        Request::AddHost {
            subsystem: nqn,
            host,
            dhchap_key,
            dhchap_ctrl_key,
            tls_psk,
            replace,
            ..
        } => {
            let s = subsystem(cfg, nqn)?;
            if let Some(why) = crate::config::nqn_problem(host) {
                return refused(format!("host NQN {host:?}: {why}"));
            }
            let keyless = dhchap_key.is_none() && tls_psk.is_none();
            if s.allow_any_host && keyless {
                return refused(format!(
                    "subsystem {nqn} admits any host: allowing {host} without keys would change nothing"
                ));
            }
            let entry = if keyless {
                Host::Plain(host.clone())
            } else {
                Host::Keyed(host_keys(host, dhchap_key, dhchap_ctrl_key, tls_psk)?)
            };
            let subsystem = nqn.clone();
            if *replace {
                Change::SetHostKeys {
                    subsystem,
                    host: entry,
                }
            } else {
                Change::AddHost {
                    subsystem,
                    host: entry,
                }
            }
        }
        Request::RemoveHost {
            subsystem: nqn,
            host,
        } => Change::RemoveHost {
            subsystem: nqn.clone(),
            host: host.clone(),
        },
        Request::AddListener { address, discovery } => Change::AddListener {
            listener: ListenerConfig {
                address: parse("address", address)?,
                tls: None,
                ana: Vec::new(),
            },
            discovery: *discovery,
        },
        Request::RemoveListener { address, discovery } => Change::RemoveListener {
            address: parse("address", address)?,
            discovery: *discovery,
        },
        Request::AddReferral { address } => Change::AddReferral {
            address: parse("address", address)?,
        },
        Request::RemoveReferral { address } => Change::RemoveReferral {
            address: parse("address", address)?,
        },
        Request::NsAddHost {
            subsystem: nqn,
            nsid,
            host,
        } => {
            if let Some(why) = crate::config::nqn_problem(host) {
                return refused(format!("host NQN {host:?}: {why}"));
            }
            Change::AddNamespaceHost {
                subsystem: nqn.clone(),
                nsid: *nsid,
                host: host.clone(),
            }
        }
        Request::NsRemoveHost {
            subsystem: nqn,
            nsid,
            host,
        } => {
            // The last host a namespace names stays: without it the namespace would be seen
            // by every host. (A reload may do that; a request does not by accident.)
            let s = subsystem(cfg, nqn)?;
            let named = s.nsids().zip(&s.namespaces).find(|(id, _)| id == nsid);
            if named.is_some_and(|(_, n)| n.hosts == [host.as_str()]) {
                return refused(format!(
                    "{host} is the last host namespace {nsid} of {nqn} is shown to: removing it \
                     would show the namespace to every host (show it to another host first, or \
                     remove the namespace)"
                ));
            }
            Change::RemoveNamespaceHost {
                subsystem: nqn.clone(),
                nsid: *nsid,
                host: host.clone(),
            }
        }
        Request::SetAnaState {
            listener,
            group,
            state,
        } => {
            let address = parse("listener", listener)?;
            let state = state.parse().or_else(refused)?;
            if !crate::ana::valid_group(*group) {
                return refused(format!(
                    "ANA group {group}: must be 1..={}",
                    crate::ana::MAX_ANA_GROUPS
                ));
            }
            Change::SetAnaState {
                address,
                group: *group,
                state,
            }
        }
        Request::List {}
        | Request::Status {}
        | Request::Disconnect { .. }
        | Request::Save { .. } => return Ok(None),
    };
    Ok(Some(change))
}

/// The `op` of a request, as the protocol spells it.
fn op_name(req: &Request) -> String {
    serde_json::to_value(req)
        .ok()
        .and_then(|v| v.get("op").and_then(Value::as_str).map(str::to_string))
        .unwrap_or_default()
}

/// Answers one request line.
pub fn handle(registry: &Registry, line: &str) -> Response {
    match decode(line) {
        Ok(req) => answer(registry, &req, false),
        Err(e) => Response::error(e),
    }
}

/// Whether a request only reads (`list`, `status`).
pub fn is_read_only(req: &Request) -> bool {
    matches!(req, Request::List {} | Request::Status {})
}

/// Answers a decoded request. With `idempotent`, a change already in effect (an object
/// added before, as the request describes it, or one removed before) is answered with no
/// change instead of an error, so that a retried request does not fail or change twice.
pub fn answer(registry: &Registry, req: &Request, idempotent: bool) -> Response {
    let result = match req {
        Request::List {} | Request::Status {} => {
            return Response {
                status: Some(registry.describe(*req == Request::Status {})),
                ..Response::ok()
            };
        }
        Request::Save { path } if !path.is_absolute() => {
            return Response::error(format!("{}: give an absolute path", path.display()));
        }
        Request::Save { path } => registry
            .save(path)
            .map(|()| vec![format!("saved {}", path.display())]),
        Request::Disconnect {
            subsystem,
            cntlid,
            host,
        } => registry.disconnect(subsystem, *cntlid, host.as_deref()),
        _ => {
            let cfg = registry.config();
            change_for(req, &cfg).and_then(|c| match c {
                Some(c) if idempotent && c.in_effect(&cfg) => Ok(Vec::new()),
                c => registry.change(&Vec::from_iter(c)),
            })
        }
    };
    match result {
        Ok(changes) => Response {
            changes: Some(changes),
            ..Response::ok()
        },
        Err(e) => {
            let e = nvmeof_daemon::error_line(&e);
            // Not the request line itself: it may carry keys.
            warn!(op = %op_name(req), error = %e, "control request refused");
            Response::error(e)
        }
    }
}

/// Serves the control socket until the target shuts down, within `limits`.
pub async fn serve(listener: UnixListener, registry: Arc<Registry>, limits: ClientLimits) {
    let mut shutdown = registry.target().subscribe_shutdown();
    let slots = Arc::new(tokio::sync::Semaphore::new(limits.max_clients));
    loop {
        tokio::select! {
            r = listener.accept() => match r {
                Ok((stream, _)) => {
                    let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
                        warn!(max = limits.max_clients, "control socket: too many clients, one refused");
                        tokio::spawn(refuse_client(stream, limits.max_clients));
                        continue;
                    };
                    let registry = Arc::clone(&registry);
                    tokio::spawn(async move {
                        serve_client(stream, registry, limits.idle_timeout).await;
                        drop(slot);
                    });
                }
                Err(e) => {
                    warn!(error = %e, "control socket: accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            _ = shutdown.changed() => break,
        }
    }
}

/// Answers a client over the limit with one error line, then closes.
async fn refuse_client(stream: UnixStream, max: usize) {
    let (_r, mut w) = stream.into_split();
    let resp = Response::error(format!(
        "too many control clients (at most {max} at once): try again"
    ));
    let _ = tokio::time::timeout(CLIENT_TIMEOUT, write_line(&mut w, &resp)).await;
}

async fn serve_client(stream: UnixStream, registry: Arc<Registry>, idle_timeout: Duration) {
    let (r, mut w) = stream.into_split();
    let mut r = BufReader::new(r).take(MAX_REQUEST as u64 + 1);
    loop {
        let mut line = String::new();
        let Ok(read) = tokio::time::timeout(idle_timeout, r.read_line(&mut line)).await else {
            debug!("control client idle: disconnected");
            let resp = Response::error(format!(
                "idle for {}s: disconnected",
                idle_timeout.as_secs()
            ));
            let _ = tokio::time::timeout(CLIENT_TIMEOUT, write_line(&mut w, &resp)).await;
            return;
        };
        let answer = match read {
            Ok(0) => return,
            Ok(_)
                if line.len() > MAX_REQUEST
                    || !line.ends_with('\n') && line.len() >= MAX_REQUEST =>
            {
                let resp = Response::error(format!("request longer than {MAX_REQUEST} bytes"));
                let _ = write_line(&mut w, &resp).await;
                return;
            }
            Ok(_) => {
                r.set_limit(MAX_REQUEST as u64 + 1);
                let reg = Arc::clone(&registry);
                match tokio::task::spawn_blocking(move || handle(&reg, &line)).await {
                    Ok(a) => a,
                    Err(e) => Response::error(format!("internal error: {e}")),
                }
            }
            Err(e) => {
                // Not UTF-8, or the socket failed.
                let resp = Response::error(format!("malformed request: {e}"));
                let _ = write_line(&mut w, &resp).await;
                return;
            }
        };
        // A client that does not read its answers does not hold the task forever either.
        let written = tokio::time::timeout(CLIENT_TIMEOUT, write_line(&mut w, &answer)).await;
        if !matches!(written, Ok(Ok(()))) {
            debug!("control client went away");
            return;
        }
    }
}

async fn write_line(
    w: &mut tokio::net::unix::OwnedWriteHalf,
    resp: &Response,
) -> std::io::Result<()> {
    let mut out = serde_json::to_string(resp).unwrap_or_default();
    out.push('\n');
    w.write_all(out.as_bytes()).await
}

/// Why a control request got no answer.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The socket could not be reached.
    #[error("cannot connect to {} ({source}){hint}; is nvmeof-targetd running? (--socket names another socket)", path.display())]
    Connect {
        /// The socket.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
        /// A hint for a permission problem.
        hint: &'static str,
    },
    /// The exchange failed.
    #[error("{}: {reason}", path.display())]
    Exchange {
        /// The socket.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
}

/// Sends one request line (as given) to the socket at `path` and returns the answer.
pub async fn request_line(path: &Path, line: &str) -> Result<Response, ClientError> {
    let fail = |reason: String| ClientError::Exchange {
        path: path.to_path_buf(),
        reason,
    };
    let stream = UnixStream::connect(path)
        .await
        .map_err(|source| ClientError::Connect {
            path: path.to_path_buf(),
            hint: if source.kind() == std::io::ErrorKind::PermissionDenied {
                " (only root and the socket's group may use it)"
            } else {
                ""
            },
            source,
        })?;
    let (r, mut w) = stream.into_split();
    let io = async {
        w.write_all(format!("{line}\n").as_bytes()).await?;
        let mut answer = String::new();
        BufReader::new(r).read_line(&mut answer).await?;
        Ok::<_, std::io::Error>(answer)
    };
    let answer = tokio::time::timeout(CLIENT_TIMEOUT, io)
        .await
        .map_err(|_| fail("no answer".into()))?
        .map_err(|e| fail(e.to_string()))?;
    if answer.is_empty() {
        return Err(fail("closed the connection without answering".into()));
    }
    serde_json::from_str(&answer).map_err(|e| fail(format!("unreadable answer: {e}")))
}

/// Sends `req` to the socket at `path` and returns the answer.
pub async fn request(path: &Path, req: &Request) -> Result<Response, ClientError> {
    request_line(path, &encode(req)).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn idle_clients_are_dropped_and_clients_are_capped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ctl.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let registry = Arc::new(crate::testing::registry(&["null:1M"]));
        let limits = ClientLimits {
            idle_timeout: Duration::from_secs(2),
            max_clients: 2,
        };
        tokio::spawn(serve(listener, Arc::clone(&registry), limits));
        let answer = |s: UnixStream| async move {
            let mut line = String::new();
            BufReader::new(s).read_line(&mut line).await.unwrap();
            serde_json::from_str::<Response>(&line).unwrap()
        };
        // Two clients connected (the first has been served once); a third is refused.
        let mut first = UnixStream::connect(&path).await.unwrap();
        first
            .write_all(b"{\"version\":1,\"op\":\"list\"}\n")
            .await
            .unwrap();
        let mut first = BufReader::new(first);
        let mut line = String::new();
        first.read_line(&mut line).await.unwrap();
        assert!(line.contains("\"ok\":true"), "{line}");
        let _second = UnixStream::connect(&path).await.unwrap();
        let third = answer(UnixStream::connect(&path).await.unwrap()).await;
        assert!(
            third.error.unwrap().contains("too many control clients"),
            "the third client"
        );
        // The idle first client is told and closed, and its slot is free again.
        line.clear();
        first.read_line(&mut line).await.unwrap();
        assert!(line.contains("idle for"), "{line}");
        line.clear();
        assert_eq!(first.read_line(&mut line).await.unwrap(), 0, "closed");
        drop(first);
        let mut again = UnixStream::connect(&path).await.unwrap();
        again
            .write_all(b"{\"version\":1,\"op\":\"list\"}\n")
            .await
            .unwrap();
        let a = answer(again).await;
        assert!(a.ok, "{a:?}");
        registry.running().shutdown().await;
    }

    #[test]
    fn hosts_that_would_change_nothing_are_refused() {
        let cfg = Config::from_toml(
            "[[listener]]\naddress = \"tcp://127.0.0.1:1\"\n[[subsystem]]\nnqn = \"nqn.2026-11.test:any\"\nallow_any_host = true",
        )
        .unwrap();
        let add = |host: &str, key: Option<&str>| Request::AddHost {
            subsystem: "nqn.2026-11.test:any".into(),
            host: host.into(),
            dhchap_key: key.map(Into::into),
            dhchap_key_file: None,
            dhchap_ctrl_key: None,
            dhchap_ctrl_key_file: None,
            tls_psk: None,
            tls_psk_file: None,
            replace: false,
        };
        let e = change_for(&add("nqn.2026-11.test:h", None), &cfg).unwrap_err();
        assert!(e.to_string().contains("admits any host"), "{e}");
        let both = Request::AddSubsystem {
            nqn: "nqn.2026-11.test:both".into(),
            allow_any_host: true,
            hosts: vec!["nqn.2026-11.test:h".into()],
            serial: None,
            model: None,
        };
        let e = change_for(&both, &cfg).unwrap_err();
        assert!(e.to_string().contains("drop --host"), "{e}");
    }

    /// What the `control` fuzz target does with each input, on lines of every kind.
    #[test]
    fn request_lines_go_through_the_plan_and_back() {
        let cfg = Config::from_toml(
            "[[listener]]\naddress = \"tcp://127.0.0.1:1\"\n[[subsystem]]\nnqn = \"nqn.2026-11.test:a\"\nallow_any_host = true\n[[subsystem.namespace]]\nbackend = \"mem:1M\"",
        )
        .unwrap()
        .with_explicit_nsids();
        let mut planned = 0;
        for line in [
            r#"{"version":1,"op":"add-namespace","subsystem":"nqn.2026-11.test:a","backend":"null:1M"}"#,
            r#"{"version":1,"op":"remove-namespace","subsystem":"nqn.2026-11.test:a","nsid":1}"#,
            r#"{"version":1,"op":"resize-namespace","subsystem":"nqn.2026-11.test:a","nsid":1,"size":"2M"}"#,
            r#"{"version":1,"op":"add-subsystem","nqn":"nqn.2026-11.test:b","allow_any_host":true}"#,
            r#"{"version":1,"op":"remove-subsystem","nqn":"nqn.2026-11.test:a"}"#,
            r#"{"version":1,"op":"add-listener","address":"tcp://127.0.0.1:2","discovery":true}"#,
            r#"{"version":1,"op":"remove-listener","address":"tcp://127.0.0.1:1"}"#,
            r#"{"version":1,"op":"list"}"#,
        ] {
            let req = decode(line).unwrap();
            let Some(change) = change_for(&req, &cfg).unwrap() else {
                continue;
            };
            assert!(!change.in_effect(&cfg), "{line}");
            let mut new = cfg.clone();
            if change.apply(&mut new).is_err() || new.validate().is_err() {
                continue;
            }
            assert!(change.in_effect(&new), "{line}");
            // The plan between the two is this very change.
            assert_eq!(
                crate::plan::plan(&cfg, &new).unwrap(),
                vec![change],
                "{line}"
            );
            planned += 1;
        }
        assert!(planned >= 5, "{planned}");
    }

    #[test]
    fn key_files_stay_off_the_wire() {
        let req = Request::AddHost {
            subsystem: "nqn.x".into(),
            host: "nqn.h".into(),
            dhchap_key: Some("k".into()),
            dhchap_key_file: Some("/secret".into()),
            dhchap_ctrl_key: None,
            dhchap_ctrl_key_file: None,
            tls_psk: None,
            tls_psk_file: None,
            replace: true,
        };
        let line = encode(&req);
        assert!(
            !line.contains("file") && line.contains("\"replace\":true"),
            "{line}"
        );
        let e = decode(&line.replace("\"replace\"", "\"dhchap_key_file\""));
        assert!(e.unwrap_err().contains("unknown field"));
    }

    #[test]
    fn requests_round_trip_and_strangers_are_refused() {
        let req = Request::AddNamespace {
            subsystem: "nqn.x".into(),
            backend: "null:1G".into(),
            nsid: Some(2),
            uuid: None,
            hosts: vec!["nqn.2014-08.org.nvmexpress:uuid:1".into()],
            ana_group: Some(2),
        };
        let line = encode(&req);
        assert!(line.contains("\"op\":\"add-namespace\""), "{line}");
        assert!(line.contains("\"version\":1"), "{line}");
        assert_eq!(decode(&line).unwrap(), req);
        assert_eq!(
            decode(r#"{"version":1,"op":"list"}"#).unwrap(),
            Request::List {}
        );
        for (bad, why) in [
            ("{not json", "malformed request"),
            ("[1]", "expected a JSON object"),
            (r#"{"op":"list"}"#, "missing \"version\""),
            (
                r#"{"version":2,"op":"list"}"#,
                "unsupported protocol version 2",
            ),
            (
                r#"{"version":1,"op":"list","extra":1}"#,
                "unknown field `extra`",
            ),
            (
                r#"{"version":1,"op":"remove-namespace","subsystem":"s","nsid":1,"nsdi":2}"#,
                "unknown field `nsdi`",
            ),
            (
                r#"{"version":1,"op":"format-disk"}"#,
                "unknown variant `format-disk`",
            ),
            (
                r#"{"version":1,"op":"remove-namespace","subsystem":"s"}"#,
                "missing field `nsid`",
            ),
        ] {
            let e = decode(bad).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }
}
