//! `nvmeof-initd`: holds named NVMe-oF attachments, keeps them connected, reports their health,
//! and serves the `nvmeof` CLI and local programs over a Unix socket.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use clap::Parser;
use nvmeof_daemon::{LogFormat, Signal, Signals};
use nvmeof_initiator::daemon::{
    self, AttachParams, AttachmentStatus, DEFAULT_SOCKET, Request, Response,
};
use nvmeof_initiator::identity::{format_hostid, is_root};
use nvmeof_initiator::{
    ConnectOptions, Controller, ControllerEvent, ControllerState, HostIdentity, Multipath,
    MultipathOptions, ReconnectPolicy, default_state_dir,
};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

const LONG_ABOUT: &str = "\
Holds named NVMe-oF attachments for the nvmeof CLI and for programs using the
nvmeof-initiator library.

Each attachment (added with `nvmeof attach NAME -t tcp -a ADDRESS -s PORT -n NQN`) is a
namespace of a subsystem that the daemon keeps connected: Keep Alive on the admin queue,
reconnect with backoff after a lost connection, health reported by `nvmeof list`
(connected / reconnecting / failed, with the last error; removed while the target has
removed the namespace, which a Namespace Attribute Changed notice tells; a resized namespace
is listed at its new size). `nvmeof connect` attaches every namespace of a subsystem at
once. Attachments are stored in STATE_DIR/attachments.json (mode 0600: it holds the
DH-HMAC-CHAP secrets given with --dhchap-secret, which `nvmeof list` never shows) and
restored at start.

Programs call nvmeof_initiator::open_attached(\"NAME\"): the daemon answers with the
connection parameters and its host identity, and the program connects its own I/O queues,
so data never passes through the daemon.

The socket is created with mode 0660, owned by root and by --group when given: only root
and members of that group can use it.";

#[derive(Parser)]
#[command(name = "nvmeof-initd", version, about = "NVMe-oF attachment daemon", long_about = LONG_ABOUT)]
struct Args {
    /// Unix socket to serve (default /run/nvmeof/initd.sock, or $NVMEOF_INITD_SOCKET).
    #[arg(long, env = "NVMEOF_INITD_SOCKET", value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Directory for attachments.json and the host identity (default /var/lib/nvmeof for
    /// root, else ~/.local/state/nvmeof).
    #[arg(long, env = "NVMEOF_STATE_DIR", value_name = "DIR")]
    state_dir: Option<PathBuf>,
    /// Group allowed to use the socket (besides root); a name or a numeric ID.
    #[arg(long, env = "NVMEOF_INITD_GROUP", value_name = "GROUP")]
    group: Option<String>,
    /// Log format.
    #[arg(long, value_enum, default_value = "text")]
    log_format: LogFormat,
}

/// The state file.
#[derive(Serialize, Deserialize, Default)]
struct StateFile {
    version: u32,
    attachments: Vec<Stored>,
}

#[derive(Serialize, Deserialize, Clone)]
struct Stored {
    name: String,
    params: AttachParams,
}

/// Health of one attachment, as reported.
struct Health {
    state: String,
    last_error: Option<String>,
    controller: Option<nvmeof_initiator::ControllerInfo>,
    namespace: Option<nvmeof_initiator::NamespaceInfo>,
}

struct Attachment {
    name: String,
    params: AttachParams,
    health: Mutex<Health>,
    ctrl: Mutex<Option<Controller>>,
    /// A multipath attachment's paths, and its namespace's ANA group.
    mp: Mutex<Option<(Multipath, u32)>>,
    task: Mutex<Option<JoinHandle<()>>>,
}

impl Attachment {
    fn status(&self) -> AttachmentStatus {
        let paths = self
            .mp
            .lock()
            .as_ref()
            .map(|(mp, group)| mp.paths_for_group(*group))
            .unwrap_or_default();
        let h = self.health.lock();
        let mut state = h.state.clone();
        if !paths.is_empty() {
            // A multipath attachment is connected while one of its paths is.
            let live = paths
                .iter()
                .any(|p| p.state == Some(ControllerState::Connected));
            state = if live { "connected" } else { "reconnecting" }.into();
        }
        AttachmentStatus {
            name: self.name.clone(),
            params: self.params.without_secrets(),
            state,
            last_error: h.last_error.clone(),
            controller: h.controller.clone(),
            namespace: h.namespace.clone(),
            paths,
        }
    }

    fn set(&self, state: &str, err: Option<String>) {
        let mut h = self.health.lock();
        h.state = state.to_string();
        if err.is_some() {
            h.last_error = err;
        }
    }
}

struct Daemon {
    state_file: PathBuf,
    identity: HostIdentity,
    attachments: tokio::sync::Mutex<BTreeMap<String, Arc<Attachment>>>,
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    if let Err(e) = nvmeof_daemon::init_logging(args.log_format, "info") {
        eprintln!("nvmeof-initd: error: {e}");
        return std::process::ExitCode::FAILURE;
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("nvmeof-initd: error: cannot start the runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(args)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!(
                "nvmeof-initd: error: {}",
                nvmeof_daemon::error_line(e.as_ref()).replace('\n', " ")
            );
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<()> {
    // Watched before anything else, so a signal during start-up is handled, not fatal.
    let mut signals = Signals::new().context("cannot install signal handlers")?;
    let socket = args.socket.unwrap_or_else(|| {
        if is_root() {
            PathBuf::from(DEFAULT_SOCKET)
        } else {
            daemon::default_socket_path()
        }
    });
    let state_dir = args.state_dir.unwrap_or_else(default_state_dir);
    std::fs::create_dir_all(&state_dir)
        .with_context(|| format!("cannot create the state directory {}", state_dir.display()))?;
    let identity = HostIdentity::load_or_create(&state_dir)?;
    let gid = match &args.group {
        Some(g) => Some(nvmeof_daemon::lookup_group(g)?),
        None => None,
    };
    let listener = nvmeof_daemon::bind_socket(&socket, gid, "nvmeof-initd")?;
    let d = Arc::new(Daemon {
        state_file: state_dir.join("attachments.json"),
        identity,
        attachments: tokio::sync::Mutex::new(BTreeMap::new()),
    });
    d.restore().await?;
    info!(
        socket = %socket.display(),
        state_dir = %state_dir.display(),
        hostnqn = %d.identity.hostnqn,
        "nvmeof-initd ready"
    );
    let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]);

    loop {
        tokio::select! {
            r = listener.accept() => match r {
                Ok((stream, _)) => {
                    let d = Arc::clone(&d);
                    tokio::spawn(async move { d.serve(stream).await });
                }
                Err(e) => {
                    warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            request = signals.recv() => match request {
                Signal::Stop(name) => {
                    info!("{name} received");
                    break;
                }
                Signal::Reload => {
                    info!("SIGHUP: nothing to reload (attachments are changed with nvmeof attach and detach); ignoring");
                }
            },
        }
    }
    info!("stopping: disconnecting attachments");
    let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Stopping]);
    drop(listener);
    let _ = std::fs::remove_file(&socket);
    d.stop_all().await;
    info!("stopped");
    Ok(())
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

impl Daemon {
    async fn restore(self: &Arc<Self>) -> Result<()> {
        let text = match std::fs::read_to_string(&self.state_file) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => {
                return Err(e)
                    .with_context(|| format!("cannot read {}", self.state_file.display()));
            }
        };
        // Files written before secrets were stored may be readable by others: root-only now.
        {
            use std::os::unix::fs::PermissionsExt;
            let f = &self.state_file;
            if std::fs::metadata(f).is_ok_and(|m| m.permissions().mode() & 0o077 != 0) {
                std::fs::set_permissions(f, std::fs::Permissions::from_mode(0o600))
                    .with_context(|| format!("cannot make {} root-only", f.display()))?;
            }
        }
        let state: StateFile = serde_json::from_str(&text)
            .with_context(|| format!("{} is not a valid state file", self.state_file.display()))?;
        let mut map = self.attachments.lock().await;
        for s in state.attachments {
            if !valid_name(&s.name) || map.contains_key(&s.name) {
                warn!(name = %s.name, "skipping an invalid or duplicate stored attachment");
                continue;
            }
            let a = Arc::new(Attachment {
                name: s.name.clone(),
                params: s.params,
                health: Mutex::new(Health {
                    state: "connecting".into(),
                    last_error: None,
                    controller: None,
                    namespace: None,
                }),
                ctrl: Mutex::new(None),
                mp: Mutex::new(None),
                task: Mutex::new(None),
            });
            info!(name = %a.name, subnqn = %a.params.subnqn, "restoring attachment");
            let task = if a.params.paths.is_empty() {
                tokio::spawn(monitor(Arc::clone(&a), None))
            } else {
                tokio::spawn(keep_multipath(Arc::clone(&a)))
            };
            *a.task.lock() = Some(task);
            map.insert(s.name, a);
        }
        Ok(())
    }

    fn persist(&self, map: &BTreeMap<String, Arc<Attachment>>) -> Result<()> {
        let state = StateFile {
            version: 1,
            attachments: map
                .values()
                .map(|a| Stored {
                    name: a.name.clone(),
                    params: a.params.clone(),
                })
                .collect(),
        };
        let text = serde_json::to_string_pretty(&state)?;
        let tmp = self.state_file.with_extension("json.tmp");
        // Root-only: attachments may hold DH-HMAC-CHAP secrets.
        let write = |text: String| {
            use std::io::Write;
            use std::os::unix::fs::OpenOptionsExt;
            let _ = std::fs::remove_file(&tmp);
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&tmp)?;
            f.write_all(text.as_bytes())?;
            f.sync_all()
        };
        write(text + "\n")
            .and_then(|()| std::fs::rename(&tmp, &self.state_file))
            .with_context(|| format!("cannot write {}", self.state_file.display()))
    }

    async fn serve(self: Arc<Self>, stream: UnixStream) {
        let peer = stream.peer_cred().ok();
        debug!(uid = peer.map(|c| c.uid()), "client connected");
        let (r, mut w) = stream.into_split();
        let mut reader = BufReader::new(r);
        loop {
            let mut line = String::new();
            let n = match (&mut reader).take(1 << 20).read_line(&mut line).await {
                Ok(n) => n,
                Err(e) => {
                    debug!(error = %e, "client read failed");
                    return;
                }
            };
            if n == 0 {
                return;
            }
            let resp = match serde_json::from_str::<Request>(&line) {
                Ok(req) => self.handle(req).await,
                Err(e) => Response::error(format!("bad request: {e}")),
            };
            let mut out = serde_json::to_string(&resp)
                .unwrap_or_else(|_| r#"{"ok":false,"error":"cannot encode the answer"}"#.into());
            out.push('\n');
            if w.write_all(out.as_bytes()).await.is_err() {
                return;
            }
        }
    }

    async fn handle(self: &Arc<Self>, req: Request) -> Response {
        match req {
            Request::Ping => Response::ok(),
            Request::List => {
                let map = self.attachments.lock().await;
                Response {
                    ok: true,
                    attachments: Some(map.values().map(|a| a.status()).collect()),
                    ..Default::default()
                }
            }
            Request::Get { name } => {
                let map = self.attachments.lock().await;
                match map.get(&name) {
                    // A process opening the attachment connects itself: it gets the secrets
                    // (the socket is root's and the daemon group's only).
                    Some(a) => Response {
                        ok: true,
                        attachment: Some(AttachmentStatus {
                            params: a.params.clone(),
                            ..a.status()
                        }),
                        ..Default::default()
                    },
                    None => Response::error(format!("no attachment named {name:?}")),
                }
            }
            Request::Detach { name } => match self.detach(&name).await {
                Ok(()) => Response::ok(),
                Err(e) => Response::error(format!("{e:#}")),
            },
            Request::ActiveNamespaces { params } => match self.active_namespaces(*params).await {
                Ok(nsids) => Response {
                    ok: true,
                    nsids: Some(nsids),
                    ..Default::default()
                },
                Err(e) => Response::failure(format!("{e:#}"), e.as_ref()),
            },
            Request::Attach { name, params } => match self.attach(name, *params).await {
                Ok(status) => Response {
                    ok: true,
                    attachment: Some(status),
                    ..Default::default()
                },
                Err(e) => Response::failure(format!("{e:#}"), e.as_ref()),
            },
        }
    }

    /// The active namespaces of the subsystem `params` name, read with the daemon's identity
    /// (unless `params` name another) over a connection made for it.
    async fn active_namespaces(&self, mut params: AttachParams) -> Result<Vec<u32>> {
        let host = params.identity(&self.identity)?;
        params.hostnqn = Some(host.hostnqn.clone());
        let mut opts = params.connect_options(host)?;
        opts.io_queues = Some(0);
        opts.reconnect.ctrl_loss_timeout = Some(Duration::ZERO);
        let ctrl = Controller::connect(opts)
            .await
            .map_err(|e| with_connect_hint(e, &params))
            .with_context(|| format!("cannot connect to {}", params.subnqn))?;
        let nsids = ctrl.namespace_ids();
        let _ = ctrl.disconnect().await;
        Ok(nsids)
    }

    async fn attach(
        self: &Arc<Self>,
        name: String,
        mut params: AttachParams,
    ) -> Result<AttachmentStatus> {
        if !valid_name(&name) {
            bail!("attachment name {name:?} must be 1-64 letters, digits, '.', '_' or '-'");
        }
        if self.attachments.lock().await.contains_key(&name) {
            bail!("an attachment named {name:?} exists already (detach it first)");
        }
        let host = params.identity(&self.identity)?;
        params.hostnqn = Some(host.hostnqn.clone());
        params.hostid = Some(format_hostid(&host.hostid));
        let a = Arc::new(Attachment {
            name: name.clone(),
            params,
            health: Mutex::new(Health {
                state: "connecting".into(),
                last_error: None,
                controller: None,
                namespace: None,
            }),
            ctrl: Mutex::new(None),
            mp: Mutex::new(None),
            task: Mutex::new(None),
        });
        // The first connection must work: the user learns about mistakes now.
        if !a.params.paths.is_empty() {
            connect_multipath(&a)
                .await
                .with_context(|| format!("cannot attach {name}"))?;
            let mut map = self.attachments.lock().await;
            if map.contains_key(&name) {
                stop(&a).await;
                bail!("an attachment named {name:?} exists already");
            }
            map.insert(name.clone(), Arc::clone(&a));
            if let Err(e) = self.persist(&map) {
                map.remove(&name);
                drop(map);
                stop(&a).await;
                return Err(e);
            }
            info!(name = %name, subnqn = %a.params.subnqn, nsid = a.params.nsid, paths = a.params.paths.len() + 1, "attached over several paths");
            return Ok(a.status());
        }
        let ctrl = connect_once(&a)
            .await
            .with_context(|| format!("cannot attach {name}"))?;
        let mut map = self.attachments.lock().await;
        if map.contains_key(&name) {
            let _ = ctrl.disconnect().await;
            bail!("an attachment named {name:?} exists already");
        }
        map.insert(name.clone(), Arc::clone(&a));
        if let Err(e) = self.persist(&map) {
            map.remove(&name);
            let _ = ctrl.disconnect().await;
            return Err(e);
        }
        drop(map);
        let task = tokio::spawn(monitor(Arc::clone(&a), Some(ctrl)));
        *a.task.lock() = Some(task);
        info!(name = %name, subnqn = %a.params.subnqn, nsid = a.params.nsid, "attached");
        Ok(a.status())
    }

    async fn detach(&self, name: &str) -> Result<()> {
        let a = {
            let mut map = self.attachments.lock().await;
            let a = map
                .remove(name)
                .ok_or_else(|| anyhow!("no attachment named {name:?}"))?;
            self.persist(&map)?;
            a
        };
        stop(&a).await;
        info!(name = %name, "detached");
        Ok(())
    }

    async fn stop_all(&self) {
        let all: Vec<Arc<Attachment>> = self.attachments.lock().await.values().cloned().collect();
        let mut set = tokio::task::JoinSet::new();
        for a in all {
            set.spawn(async move { stop(&a).await });
        }
        let _ = tokio::time::timeout(Duration::from_secs(20), async {
            while set.join_next().await.is_some() {}
        })
        .await;
    }
}

async fn stop(a: &Attachment) {
    if let Some(t) = a.task.lock().take() {
        t.abort();
    }
    let ctrl = a.ctrl.lock().take();
    if let Some(c) = ctrl {
        if let Err(e) = c.disconnect().await {
            debug!(name = %a.name, error = %e, "disconnect incomplete");
        }
    }
    let mp = a.mp.lock().take();
    if let Some((mp, _)) = mp {
        if let Err(e) = mp.disconnect().await {
            debug!(name = %a.name, error = %e, "disconnect incomplete");
        }
    }
}

/// Connects a multipath attachment: one admin-only controller per path, each path's ANA
/// states read and followed by the multipath head (which reconnects lost paths itself).
async fn connect_multipath(a: &Attachment) -> Result<()> {
    let opts = daemon_options(a)?;
    let mp = Multipath::connect(opts, a.params.addrs()?, MultipathOptions::default())
        .await
        .map_err(|e| with_connect_hint(e, &a.params))?;
    let nsid = a.params.nsid;
    let found = async {
        let ns = mp.namespace(nsid).await?;
        let ctrl = mp
            .controllers()
            .into_iter()
            .find(|c| c.state() == ControllerState::Connected)
            .ok_or_else(|| anyhow!("no path is connected"))?;
        let info = ctrl.namespace_info(nsid).await?;
        Ok::<_, anyhow::Error>((ns.ana_group(), info, ctrl.info()))
    }
    .await;
    match found {
        Ok((group, ns, ctrl)) => {
            let mut h = a.health.lock();
            h.namespace = Some(ns);
            h.controller = Some(ctrl);
            h.state = "connected".into();
            *a.mp.lock() = Some((mp, group));
            Ok(())
        }
        Err(e) => {
            let _ = mp.disconnect().await;
            Err(e)
        }
    }
}

/// Connects a restored multipath attachment, retrying until one path answers; from then on
/// its multipath head keeps the paths.
async fn keep_multipath(a: Arc<Attachment>) {
    let mut delay = Duration::from_secs(1);
    loop {
        match connect_multipath(&a).await {
            Ok(()) => return,
            Err(e) => {
                let msg = format!("{e:#}");
                warn!(name = %a.name, error = %msg, "connect failed");
                a.set("failed", Some(msg));
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(30));
                a.set("connecting", None);
            }
        }
    }
}

/// `e` with a sentence naming the host NQN and the subsystem when the target refused the
/// Connect because of them.
fn with_connect_hint(e: nvmeof_initiator::Error, p: &AttachParams) -> anyhow::Error {
    let host = p.hostnqn.as_deref().unwrap_or_default();
    match nvmeof_initiator::connect_hint(&e, host, &p.subnqn) {
        Some(hint) => anyhow::Error::new(e).context(hint),
        None => e.into(),
    }
}

/// The options of the daemon's own controllers for an attachment: its host identity, the
/// admin queue only (programs make their own I/O queues), and the daemon's reconnect policy.
fn daemon_options(a: &Attachment) -> Result<ConnectOptions> {
    let host = HostIdentity::new(
        a.params.hostnqn.as_deref().unwrap_or_default(),
        a.params
            .hostid
            .as_deref()
            .and_then(nvmeof_initiator::identity::parse_hostid)
            .ok_or_else(|| anyhow!("attachment {} has no host ID", a.name))?,
    )?;
    let mut opts = a.params.connect_options(host)?;
    opts.io_queues = Some(0);
    opts.reconnect = ReconnectPolicy {
        initial_delay: Duration::from_millis(500),
        max_delay: Duration::from_secs(10),
        ctrl_loss_timeout: Some(Duration::from_secs(60)),
    };
    Ok(opts)
}

/// Connects the daemon's admin-only controller for an attachment and checks its namespace.
async fn connect_once(a: &Attachment) -> Result<Controller> {
    let opts = daemon_options(a)?;
    let ctrl = Controller::connect(opts)
        .await
        .map_err(|e| with_connect_hint(e, &a.params))?;
    match ctrl.namespace_info(a.params.nsid).await {
        Ok(ns) => {
            let mut h = a.health.lock();
            h.namespace = Some(ns);
            h.controller = Some(ctrl.info());
            h.state = "connected".into();
            Ok(ctrl)
        }
        Err(e) => {
            let _ = ctrl.clone().disconnect().await;
            Err(e.into())
        }
    }
}

/// Keeps an attachment connected: mirrors the controller state into the health record, and
/// when the controller gives up, starts over with a fresh connection after a pause.
async fn monitor(a: Arc<Attachment>, first: Option<Controller>) {
    let mut ctrl = first;
    let mut delay = Duration::from_secs(1);
    loop {
        let c = match ctrl.take() {
            Some(c) => c,
            None => match connect_once(&a).await {
                Ok(c) => c,
                Err(e) => {
                    let msg = format!("{e:#}");
                    warn!(name = %a.name, error = %msg, "connect failed");
                    a.set("failed", Some(msg));
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(30));
                    a.set("connecting", None);
                    continue;
                }
            },
        };
        delay = Duration::from_secs(1);
        *a.ctrl.lock() = Some(c.clone());
        // Whether the namespace was removed from the subsystem while connected.
        let mut removed = false;
        let mut events = c.subscribe_events();
        loop {
            let state = c.state();
            match &state {
                ControllerState::Connected => {
                    let mut h = a.health.lock();
                    h.state = if removed { "removed" } else { "connected" }.into();
                    h.controller = Some(c.info());
                }
                ControllerState::Reconnecting { last_error, .. } => {
                    a.set("reconnecting", Some(last_error.clone()));
                }
                ControllerState::Failed { error } => {
                    warn!(name = %a.name, error = %error, "attachment failed; starting over");
                    a.set("failed", Some(error.clone()));
                    break;
                }
                ControllerState::Closed => return,
            }
            let changed = c.wait_for_state(Duration::from_secs(3600), |s| *s != state);
            tokio::select! {
                _ = changed => {}
                ev = events.recv() => {
                    if let Ok(ControllerEvent::NamespacesChanged { nsids, changed }) = ev {
                        removed = namespace_changed(&a, &c, &nsids, changed.as_deref(), removed).await;
                    }
                }
            }
        }
        a.ctrl.lock().take();
        let _ = c.disconnect().await;
        tokio::time::sleep(delay).await;
        a.set("connecting", None);
    }
}

/// Acts on a Namespace Attribute Changed notice for attachment `a`: the controller has read
/// the Changed Namespace List and the active namespace list (`nsids`). A removed namespace
/// marks the attachment `removed`; a namespace still there is identified again (its size may
/// have changed). Returns whether the namespace is removed now.
async fn namespace_changed(
    a: &Attachment,
    c: &Controller,
    nsids: &[u32],
    changed: Option<&[u32]>,
    was_removed: bool,
) -> bool {
    let nsid = a.params.nsid;
    let subnqn = &a.params.subnqn;
    if changed.is_some_and(|list| !list.contains(&nsid)) && !was_removed {
        debug!(name = %a.name, ?changed, "namespace attribute change of other namespaces");
        return false;
    }
    if !nsids.contains(&nsid) {
        if !was_removed {
            warn!(
                name = %a.name,
                nsid,
                subnqn = %subnqn,
                "namespace {nsid} was removed from {subnqn}; the attachment waits for it to come back"
            );
            let mut h = a.health.lock();
            h.state = "removed".into();
            h.last_error = Some(format!("namespace {nsid} was removed from {subnqn}"));
            h.namespace = None;
        }
        return true;
    }
    let old = a.health.lock().namespace.clone();
    match c.namespace_info(nsid).await {
        Ok(ns) => {
            match &old {
                None => info!(
                    name = %a.name,
                    nsid,
                    blocks = ns.blocks,
                    block_size = ns.block_size,
                    "namespace {nsid} of {subnqn} is back"
                ),
                Some(o) if o.blocks != ns.blocks || o.block_size != ns.block_size => info!(
                    name = %a.name,
                    nsid,
                    old_blocks = o.blocks,
                    blocks = ns.blocks,
                    block_size = ns.block_size,
                    "namespace {nsid} of {subnqn} resized from {} to {} bytes",
                    o.size_bytes,
                    ns.size_bytes
                ),
                Some(_) => info!(name = %a.name, nsid, "namespace {nsid} of {subnqn} changed"),
            }
            let mut h = a.health.lock();
            h.namespace = Some(ns);
            if h.state == "removed" {
                h.state = "connected".into();
                h.last_error = None;
            }
            false
        }
        Err(e) => {
            warn!(name = %a.name, nsid, error = %e, "cannot identify namespace {nsid} again");
            was_removed
        }
    }
}
