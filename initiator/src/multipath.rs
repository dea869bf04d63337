//! Multipath: one subsystem reached over several paths, a layer above [`Controller`] as the
//! Linux host's multipath head is above its controllers.
//!
//! Each path is a [`Controller`] of its own (its connection, Keep Alive and reconnect
//! supervisor). The head ([`Multipath`]) reads each path's Asymmetric Namespace Access log
//! page when the path connects, after each reconnect, on each ANA change notice, and when an
//! I/O command completes with an ANA status. Which path a command takes is decided by a pure
//! state machine (unit-tested with synthetic events) by these rules:
//! - a path is usable when its controller is connected and the namespace's ANA group is
//!   optimized or non-optimized there (a controller that does not report ANA counts as
//!   optimized); inaccessible, persistent loss and change are never used;
//! - the best tier wins: an optimized path, else a non-optimized one, else a connected path
//!   whose ANA log page has not been read again since it reconnected;
//! - within the tier, [`PathPolicy::Failover`] (the default) takes the first path in the
//!   order the paths were given, [`PathPolicy::RoundRobin`] takes them in turn;
//! - so fail-back is immediate: once a better path is connected and reports a better
//!   state, the next command goes there.
//!
//! # Failover rule
//!
//! A command that fails on its path with a path error is sent again on another path (or on
//! the same one once it is usable again), until it completes or no path became usable within
//! [`MultipathOptions::no_path_timeout`]. Path errors are: an ANA status (Asymmetric Access
//! Inaccessible, Persistent Loss or Transition: the target did not carry the command out),
//! another path-related status without Do Not Retry, a lost or failed connection, a command
//! interrupted by a lost connection, and a command timeout (after which the path's queue
//! resets its connection). Any other error is the caller's.
//!
//! Reads and flushes change nothing, so one in flight on a path whose connection is lost is
//! abandoned at once and sent on another path. A write is sent again only once its first
//! attempt has ended on its path: refused with a path status (not applied), failed as
//! interrupted (the connection that carried it is gone), or timed out (its queue reset the
//! connection). A write of whole blocks writes the same data to the same blocks each time,
//! so carrying it out twice leaves what carrying it out once does; this is how the Linux host
//! treats writes. A write still waiting in a path's queue is never abandoned, so it cannot
//! be applied there after a later write to the same blocks. As on Linux, the one thing a
//! host cannot rule out is a target that goes on applying a write of a connection it already
//! lost after the write was carried out on another path.
//!
//! A path whose controller gives up reconnecting (its
//! [`ReconnectPolicy::ctrl_loss_timeout`](crate::ReconnectPolicy)) is connected afresh in
//! the background, as is a path that could not be connected at first; [`Multipath::connect`]
//! needs one path to succeed.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use nvme_spec::command::log_id;
use nvme_spec::identify::CMIC_ANA;
use nvme_spec::log::decode_ana_log;
use parking_lot::{Mutex, RwLock};
use serde::{Deserialize, Serialize};
use tokio::sync::{broadcast, watch};
use tokio::time::Instant;
use tracing::{info, warn};

use crate::controller::StateInfo;
use crate::paths::{AnaView, Failure, PathAction, PathEvent, PathPolicy, PathSet, Selection};
use crate::{
    ConnectOptions, Controller, ControllerEvent, ControllerState, DiscoveryLog, Error, Namespace,
    TargetAddr,
};

/// Bytes of the ANA log page read (a header, and a descriptor and NSID list per group).
const ANA_LOG_BYTES: u32 = 4096;
/// At most this many paths.
pub const MAX_PATHS: usize = 64;

/// How a [`Multipath`] chooses and waits for paths.
#[derive(Clone, Debug)]
pub struct MultipathOptions {
    /// How commands are spread over the best usable paths.
    pub policy: PathPolicy,
    /// How long a command waits for a usable path (all paths lost, inaccessible or
    /// changing) before it fails with [`Error::NoPath`].
    pub no_path_timeout: Duration,
}

impl Default for MultipathOptions {
    fn default() -> Self {
        MultipathOptions {
            policy: PathPolicy::Failover,
            no_path_timeout: Duration::from_secs(60),
        }
    }
}

/// One ANA group's state on a path, as [`PathInfo`] shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AnaGroupState {
    /// The ANA group ID.
    pub group: u32,
    /// `optimized`, `non-optimized`, `inaccessible`, `persistent-loss` or `change`.
    pub state: String,
}

/// One path of a [`Multipath`], as the CLI and `nvmeof-initd` show it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PathInfo {
    /// The path's address, as [`TargetAddr`] displays it.
    pub addr: String,
    /// Its controller's state; `None` while it has none (not connected yet).
    pub state: Option<ControllerState>,
    /// Its controller ID (of the last association).
    pub cntlid: Option<u16>,
    /// Whether the controller reports ANA.
    pub ana_reporting: bool,
    /// The ANA state of each group, as last read (empty when not known).
    pub ana: Vec<AnaGroupState>,
    /// Why the last attempt to connect it failed, while it has no controller.
    pub error: Option<String>,
    /// Whether the next command would take this path (see [`Multipath::paths_for_group`]).
    pub current: bool,
}

struct Slot {
    addr: TargetAddr,
    ctrl: RwLock<Option<Controller>>,
    error: Mutex<Option<String>>,
}

struct Head {
    template: ConnectOptions,
    opts: MultipathOptions,
    slots: Vec<Slot>,
    set: Mutex<PathSet>,
    /// Bumped on every change of the path set; commands waiting for a path watch it.
    changed: watch::Sender<u64>,
    closed: AtomicBool,
}

/// One NVM subsystem over several paths (see the [module documentation](self)). Cheap to
/// clone; the paths close when the last clone and the last [`MultipathNamespace`] are
/// dropped, or at once with [`disconnect`](Self::disconnect).
#[derive(Clone)]
pub struct Multipath {
    head: Arc<Head>,
}

impl std::fmt::Debug for Multipath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Multipath")
            .field("subnqn", &self.head.template.subnqn)
            .field("paths", &self.paths())
            .finish()
    }
}

/// The addresses of the entries of a discovery log that name subsystem `subnqn` over a
/// transport this host speaks, without duplicates, in the log's order.
pub fn paths_from_discovery(log: &DiscoveryLog, subnqn: &str) -> Vec<TargetAddr> {
    let mut out: Vec<TargetAddr> = Vec::new();
    for a in log
        .entries
        .iter()
        .filter(|e| e.subnqn == subnqn)
        .filter_map(|e| e.target_addr())
    {
        if !out.contains(&a) {
            out.push(a);
        }
    }
    out
}

impl Multipath {
    /// Connects to subsystem `template.subnqn` over each of `addrs` (every other setting, the
    /// host identity included, from `template`; its `addr` is not used), reads each path's
    /// ANA log page, and returns once all have been tried. Fails when no path connects;
    /// paths that fail are retried in the background.
    pub async fn connect(
        template: ConnectOptions,
        addrs: Vec<TargetAddr>,
        opts: MultipathOptions,
    ) -> Result<Multipath, Error> {
        if addrs.is_empty() || addrs.len() > MAX_PATHS {
            return Err(Error::InvalidArgument(format!(
                "a multipath attachment takes 1 to {MAX_PATHS} paths, not {}",
                addrs.len()
            )));
        }
        for (i, a) in addrs.iter().enumerate() {
            if addrs[..i].contains(a) {
                return Err(Error::InvalidArgument(format!("path {a} is given twice")));
            }
        }
        template.validate()?;
        let (changed, _) = watch::channel(0);
        let head = Arc::new(Head {
            set: Mutex::new(PathSet::new(addrs.len(), opts.policy)),
            slots: addrs
                .into_iter()
                .map(|addr| Slot {
                    addr,
                    ctrl: RwLock::new(None),
                    error: Mutex::new(None),
                })
                .collect(),
            template,
            opts,
            changed,
            closed: AtomicBool::new(false),
        });
        let mut tries = tokio::task::JoinSet::new();
        for i in 0..head.slots.len() {
            let o = head.path_options(i);
            tries.spawn(async move { (i, Controller::connect(o).await) });
        }
        let mut first_error = None;
        while let Some(r) = tries.join_next().await {
            let Ok((i, r)) = r else { continue };
            match r {
                Ok(ctrl) => head.install(i, ctrl).await,
                Err(e) => {
                    warn!(path = %head.slots[i].addr, error = %e, "path not connected; retrying in the background");
                    *head.slots[i].error.lock() = Some(e.to_string());
                    first_error.get_or_insert(e);
                    spawn_retry(&head, i);
                }
            }
        }
        if !head.slots.iter().any(|s| s.ctrl.read().is_some()) {
            head.closed.store(true, Ordering::Relaxed);
            return Err(first_error.unwrap_or(Error::Closed));
        }
        Ok(Multipath { head })
    }

    /// The subsystem NQN.
    pub fn subnqn(&self) -> &str {
        &self.head.template.subnqn
    }

    /// The path controllers connected now, in the order of the paths.
    pub fn controllers(&self) -> Vec<Controller> {
        self.head
            .slots
            .iter()
            .filter_map(|s| s.ctrl.read().clone())
            .collect()
    }

    /// Every path: its address, controller state and ANA states; `current` for a namespace
    /// of the lowest ANA group any path lists.
    pub fn paths(&self) -> Vec<PathInfo> {
        let grp = self
            .head
            .set
            .lock()
            .paths()
            .iter()
            .find_map(|p| match &p.ana {
                AnaView::Groups(g) => g.keys().next().copied(),
                _ => None,
            });
        self.paths_for_group(grp.unwrap_or(0))
    }

    /// Every path, `current` telling which one the next command to a namespace of ANA group
    /// `grpid` would take (with [`PathPolicy::Failover`]).
    pub fn paths_for_group(&self, grpid: u32) -> Vec<PathInfo> {
        let set = self.head.set.lock().clone();
        let current = match PathSet::clone(&set).select(grpid) {
            Selection::Path(i) => Some(i),
            _ => None,
        };
        self.head
            .slots
            .iter()
            .zip(set.paths())
            .enumerate()
            .map(|(i, (s, v))| {
                let ctrl = s.ctrl.read().clone();
                PathInfo {
                    addr: s.addr.to_string(),
                    state: ctrl.as_ref().map(Controller::state),
                    cntlid: ctrl.as_ref().map(|c| c.info().cntlid),
                    ana_reporting: v.ana != AnaView::NotReported && ctrl.is_some(),
                    ana: match &v.ana {
                        AnaView::Groups(g) => g
                            .iter()
                            .map(|(&group, st)| AnaGroupState {
                                group,
                                state: st.name().to_string(),
                            })
                            .collect(),
                        _ => Vec::new(),
                    },
                    error: if ctrl.is_none() {
                        s.error.lock().clone()
                    } else {
                        None
                    },
                    current: current == Some(i),
                }
            })
            .collect()
    }

    /// Namespace `nsid` over every path (its size and ANA group from Identify Namespace on
    /// a connected path).
    pub async fn namespace(&self, nsid: u32) -> Result<MultipathNamespace, Error> {
        let mut last = Error::NoPath(format!("no path of {} is connected", self.subnqn()));
        for ctrl in self.controllers() {
            if ctrl.state() != ControllerState::Connected {
                continue;
            }
            let r = async {
                let info = ctrl.namespace_info(nsid).await?;
                let grpid = if ctrl.identify_data().cmic & CMIC_ANA != 0 {
                    ctrl.identify_namespace(nsid).await?.anagrpid.get()
                } else {
                    0
                };
                Ok::<_, Error>((info, grpid))
            }
            .await;
            match r {
                Ok((info, grpid)) => {
                    return Ok(MultipathNamespace {
                        head: Arc::clone(&self.head),
                        nsid,
                        grpid,
                        block_size: info.block_size,
                        blocks: info.blocks,
                    });
                }
                Err(e) if e.is_transport() => last = e,
                Err(e) => return Err(e),
            }
        }
        Err(last)
    }

    /// Closes every path gracefully (see [`Controller::disconnect`]); commands waiting for
    /// a path fail with [`Error::Closed`].
    pub async fn disconnect(self) -> Result<(), Error> {
        self.head.closed.store(true, Ordering::Relaxed);
        self.head.changed.send_modify(|g| *g += 1);
        let ctrls: Vec<Controller> = self
            .head
            .slots
            .iter()
            .filter_map(|s| s.ctrl.write().take())
            .collect();
        let mut result = Ok(());
        for c in ctrls {
            if let Err(e) = c.disconnect().await {
                result = Err(e);
            }
        }
        result
    }
}

impl Head {
    fn path_options(&self, i: usize) -> ConnectOptions {
        let mut o = self.template.clone();
        o.addr = self.slots[i].addr.clone();
        o
    }

    fn bump(&self) {
        self.changed.send_modify(|g| *g = g.wrapping_add(1));
    }

    /// Takes an event into the path set; returns the action it asks for.
    fn event(&self, ev: PathEvent) -> Option<PathAction> {
        let a = self.set.lock().on(ev);
        self.bump();
        a
    }

    /// A controller for path `i` is connected: keeps it, reads its ANA log page, and
    /// watches it.
    async fn install(self: &Arc<Self>, i: usize, ctrl: Controller) {
        if self.closed.load(Ordering::Relaxed) {
            let _ = ctrl.disconnect().await;
            return;
        }
        let ana = ctrl.identify_data().cmic & CMIC_ANA != 0;
        let states = ctrl.watch_state();
        let events = ctrl.subscribe_events();
        info!(path = %self.slots[i].addr, cntlid = ctrl.info().cntlid, ana, "path connected");
        *self.slots[i].ctrl.write() = Some(ctrl);
        *self.slots[i].error.lock() = None;
        if let Some(PathAction::ReadAnaLog(p)) = self.event(PathEvent::Connected { path: i, ana }) {
            self.read_ana(p).await;
        }
        tokio::spawn(monitor(Arc::downgrade(self), i, states, events));
    }

    /// Reads path `i`'s ANA log page into the path set.
    async fn read_ana(&self, i: usize) {
        let Some(ctrl) = self.slots[i].ctrl.read().clone() else {
            return;
        };
        let r = ctrl
            .get_log_page(log_id::ANA, 0xFFFF_FFFF, ANA_LOG_BYTES, 0)
            .await;
        let ev = match r.as_deref().map(decode_ana_log) {
            Ok(Some((_, groups))) => {
                info!(
                    path = %self.slots[i].addr,
                    states = %groups
                        .iter()
                        .map(|g| format!("{}={}", g.grpid, g.state))
                        .collect::<Vec<_>>()
                        .join(","),
                    "ANA log page read"
                );
                PathEvent::AnaLog { path: i, groups }
            }
            Ok(None) => {
                warn!(path = %self.slots[i].addr, "malformed ANA log page");
                PathEvent::AnaLogFailed { path: i }
            }
            Err(e) => {
                warn!(path = %self.slots[i].addr, error = %e, "cannot read the ANA log page");
                PathEvent::AnaLogFailed { path: i }
            }
        };
        self.event(ev);
    }
}

/// Reads path `i`'s ANA log page in the background.
fn spawn_read_ana(head: &Arc<Head>, i: usize) {
    let h = Arc::clone(head);
    tokio::spawn(async move { h.read_ana(i).await });
}

/// Connects path `i` afresh, with the template's reconnect delays, until it connects or
/// the head is gone.
fn spawn_retry(head: &Arc<Head>, i: usize) {
    let weak = Arc::downgrade(head);
    let policy = head.template.reconnect.clone();
    tokio::spawn(async move {
        let mut delay = policy.initial_delay.max(Duration::from_millis(10));
        let max = policy.max_delay.max(delay);
        loop {
            tokio::time::sleep(delay).await;
            let Some(h) = weak.upgrade() else { return };
            if h.closed.load(Ordering::Relaxed) {
                return;
            }
            match Controller::connect(h.path_options(i)).await {
                Ok(c) => return h.install(i, c).await,
                Err(e) => *h.slots[i].error.lock() = Some(e.to_string()),
            }
            delay = (delay * 2).min(max);
        }
    });
}

/// Follows path `i`'s controller: its state (lost, connected again, failed) and its ANA
/// change notices.
async fn monitor(
    head: Weak<Head>,
    i: usize,
    mut states: watch::Receiver<StateInfo>,
    mut events: broadcast::Receiver<ControllerEvent>,
) {
    let mut connected = true;
    let mut generation = states.borrow().generation;
    loop {
        let ev = tokio::select! {
            r = states.changed() => {
                if r.is_err() {
                    None
                } else {
                    let (st, gen_now) = {
                        let s = states.borrow_and_update();
                        (s.state.clone(), s.generation)
                    };
                    let now = st == ControllerState::Connected;
                    // A loss and reconnect seen as one change (the watch keeps the latest
                    // value only) still counts as both: the generation moved.
                    if now && gen_now != generation {
                        connected = false;
                    }
                    generation = gen_now;
                    if matches!(st, ControllerState::Failed { .. }) {
                        let Some(h) = head.upgrade() else { return };
                        h.event(PathEvent::Lost { path: i });
                        *h.slots[i].error.lock() = Some(format!("{st:?}"));
                        h.slots[i].ctrl.write().take();
                        spawn_retry(&h, i);
                        return;
                    }
                    if now == connected {
                        continue;
                    }
                    connected = now;
                    Some(if now {
                        PathEvent::Connected { path: i, ana: true }
                    } else {
                        PathEvent::Lost { path: i }
                    })
                }
            }
            r = events.recv() => match r {
                Ok(ControllerEvent::AsyncEvent { log_page: log_id::ANA, .. })
                | Err(broadcast::error::RecvError::Lagged(_)) => Some(PathEvent::AnaChanged { path: i }),
                Ok(_) => continue,
                Err(broadcast::error::RecvError::Closed) => None,
            },
        };
        let Some(h) = head.upgrade() else { return };
        let Some(mut ev) = ev else {
            h.event(PathEvent::Lost { path: i });
            return;
        };
        if let PathEvent::Connected { ana, .. } = &mut ev {
            *ana = h.slots[i]
                .ctrl
                .read()
                .as_ref()
                .is_some_and(|c| c.identify_data().cmic & CMIC_ANA != 0);
            info!(path = %h.slots[i].addr, "path reconnected");
        } else if matches!(ev, PathEvent::Lost { .. }) {
            warn!(path = %h.slots[i].addr, "path lost");
        }
        if let Some(PathAction::ReadAnaLog(p)) = h.event(ev) {
            h.read_ana(p).await;
        }
    }
}

/// A namespace of a [`Multipath`]: reads and writes go to the path the head selects and
/// fail over as the [module documentation](self) says. Cheap to clone.
#[derive(Clone)]
pub struct MultipathNamespace {
    head: Arc<Head>,
    nsid: u32,
    grpid: u32,
    block_size: u32,
    blocks: u64,
}

impl std::fmt::Debug for MultipathNamespace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MultipathNamespace")
            .field("nsid", &self.nsid)
            .field("grpid", &self.grpid)
            .finish()
    }
}

impl MultipathNamespace {
    /// The namespace ID.
    pub fn nsid(&self) -> u32 {
        self.nsid
    }

    /// Its ANA group ID (0 when the controllers do not report ANA).
    pub fn ana_group(&self) -> u32 {
        self.grpid
    }

    /// Logical block size in bytes.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Size in logical blocks.
    pub fn num_blocks(&self) -> u64 {
        self.blocks
    }

    /// The multipath attachment it belongs to.
    pub fn multipath(&self) -> Multipath {
        Multipath {
            head: Arc::clone(&self.head),
        }
    }

    /// The path for the next attempt of a command, avoiding the paths of `tried` while
    /// another is usable; waits for one until `deadline`.
    async fn pick(&self, deadline: Instant, tried: u64) -> Result<(usize, Namespace), Error> {
        let h = &self.head;
        let n = h.slots.len();
        if tried.count_ones() as usize >= n {
            // Every path failed this command once: pause before the next round.
            let pause = Instant::now() + Duration::from_millis(50);
            tokio::time::sleep_until(pause.min(deadline)).await;
        }
        let mut rx = h.changed.subscribe();
        loop {
            if h.closed.load(Ordering::Relaxed) {
                return Err(Error::Closed);
            }
            rx.borrow_and_update();
            let sel = h.set.lock().select_avoiding(self.grpid, tried);
            match sel {
                Selection::Path(i) => {
                    let ctrl = h.slots[i].ctrl.read().clone();
                    match ctrl {
                        Some(c) if c.state() == ControllerState::Connected => {
                            let ns =
                                c.namespace_unchecked(self.nsid, self.block_size, self.blocks)?;
                            return Ok((i, ns));
                        }
                        // Lost before its monitor told the set.
                        _ => {
                            h.event(PathEvent::Lost { path: i });
                            continue;
                        }
                    }
                }
                Selection::Never => {
                    return Err(Error::NoPath(format!(
                        "namespace {} of {} is in ANA persistent loss on every path",
                        self.nsid, h.template.subnqn
                    )));
                }
                Selection::Wait => {}
            }
            // Ask the connected paths again now and then: a group leaves the change state
            // without a notice where the target sends none.
            let wake = Instant::now() + Duration::from_secs(1);
            if wake >= deadline {
                if tokio::time::timeout_at(deadline, rx.changed())
                    .await
                    .is_err()
                {
                    return Err(Error::NoPath(format!(
                        "no path to namespace {} of {} became usable within {} ms",
                        self.nsid,
                        h.template.subnqn,
                        h.opts.no_path_timeout.as_millis()
                    )));
                }
            } else if tokio::time::timeout_at(wake, rx.changed()).await.is_err() {
                let connected: Vec<usize> = {
                    let set = h.set.lock();
                    (0..set.paths().len())
                        .filter(|&i| set.paths()[i].connected)
                        .collect()
                };
                for i in connected {
                    spawn_read_ana(h, i);
                }
            }
        }
    }

    /// What a failed attempt on path `i` means: `Err` for the caller, `Ok` to try again.
    fn failed(&self, i: usize, e: Error) -> Result<(), Error> {
        let h = &self.head;
        match crate::paths::classify(&e) {
            Failure::Final => Err(e),
            Failure::Ana(state) => {
                info!(path = %h.slots[i].addr, nsid = self.nsid, %state, "ANA status on I/O; failing over");
                if let Some(PathAction::ReadAnaLog(p)) = h.event(PathEvent::AnaStatus {
                    path: i,
                    grpid: self.grpid,
                    state,
                }) {
                    spawn_read_ana(h, p);
                }
                Ok(())
            }
            Failure::Path => {
                warn!(path = %h.slots[i].addr, nsid = self.nsid, error = %e, "path error; failing over");
                let connected = h.slots[i]
                    .ctrl
                    .read()
                    .as_ref()
                    .is_some_and(|c| c.state() == ControllerState::Connected);
                if !connected {
                    h.event(PathEvent::Lost { path: i });
                }
                Ok(())
            }
        }
    }

    fn deadline(&self) -> Instant {
        Instant::now() + self.head.opts.no_path_timeout
    }

    /// Waits until path `i`'s controller is no longer connected.
    async fn path_gone(&self, i: usize) {
        let rx = self.head.slots[i]
            .ctrl
            .read()
            .as_ref()
            .map(Controller::watch_state);
        if let Some(mut rx) = rx {
            let _ = rx.wait_for(|s| s.state != ControllerState::Connected).await;
        }
    }

    /// Runs `command` on path `i`, abandoning it (a lost-connection error) if the path is
    /// lost first: only for commands that may be sent again at once (reads, flushes).
    async fn unless_lost(
        &self,
        i: usize,
        command: impl std::future::Future<Output = Result<(), Error>>,
        what: &str,
    ) -> Result<(), Error> {
        tokio::select! {
            r = command => r,
            () = self.path_gone(i) => Err(Error::lost(
                &self.head.slots[i].addr.to_string(),
                format!("the path was lost while the {what} was in flight"),
            )),
        }
    }

    /// Reads `buf.len()` bytes (a multiple of the block size) from block `lba`. A read on a
    /// path that is lost is abandoned and sent on another path at once.
    pub async fn read(&self, lba: u64, buf: &mut [u8]) -> Result<(), Error> {
        let deadline = self.deadline();
        let mut tried = 0u64;
        loop {
            let (i, ns) = self.pick(deadline, tried).await?;
            tried |= 1 << i;
            let r = self.unless_lost(i, ns.read(lba, &mut *buf), "read").await;
            match r {
                Ok(()) => return Ok(()),
                Err(e) => self.failed(i, e)?,
            }
        }
    }

    /// Writes `buf` (a multiple of the block size) at block `lba`; on a path error it is
    /// sent again on another path once its attempt has ended (see the failover rule in the
    /// [module documentation](self)).
    pub async fn write(&self, lba: u64, buf: &[u8]) -> Result<(), Error> {
        let deadline = self.deadline();
        let mut tried = 0u64;
        loop {
            let (i, ns) = self.pick(deadline, tried).await?;
            tried |= 1 << i;
            match ns.write(lba, buf).await {
                Ok(()) => return Ok(()),
                Err(e) => self.failed(i, e)?,
            }
        }
    }

    /// Flush on the selected path (on another one if that path fails).
    pub async fn flush(&self) -> Result<(), Error> {
        let deadline = self.deadline();
        let mut tried = 0u64;
        loop {
            let (i, ns) = self.pick(deadline, tried).await?;
            tried |= 1 << i;
            let r = self.unless_lost(i, ns.flush(), "flush").await;
            match r {
                Ok(()) => return Ok(()),
                Err(e) => self.failed(i, e)?,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DiscoveryEntry;

    fn entry(trtype: u8, traddr: &str, trsvcid: &str, subnqn: &str) -> DiscoveryEntry {
        DiscoveryEntry {
            trtype,
            adrfam: 1,
            subtype: 2,
            treq: 0,
            portid: 1,
            cntlid: 0xFFFF,
            asqsz: 32,
            eflags: 0,
            trsvcid: trsvcid.into(),
            traddr: traddr.into(),
            subnqn: subnqn.into(),
            rdma: None,
            tcp_sectype: None,
        }
    }

    #[test]
    fn discovery_entries_of_one_subsystem_become_its_paths() {
        let log = DiscoveryLog {
            genctr: 1,
            entries: vec![
                entry(3, "10.0.0.1", "4420", "nqn.x:a"),
                entry(3, "10.0.0.2", "4420", "nqn.x:b"),
                entry(3, "10.0.0.2", "4421", "nqn.x:a"),
                entry(3, "10.0.0.1", "4420", "nqn.x:a"),
                entry(3, "10.0.0.3", "not-a-port", "nqn.x:a"),
                entry(2, "10.0.0.4", "4420", "nqn.x:a"),
            ],
        };
        assert_eq!(
            paths_from_discovery(&log, "nqn.x:a"),
            [
                TargetAddr::new("10.0.0.1", 4420),
                TargetAddr::new("10.0.0.2", 4421)
            ]
        );
        assert!(paths_from_discovery(&log, "nqn.x:none").is_empty());
    }
}
