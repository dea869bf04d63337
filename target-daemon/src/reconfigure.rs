//! Changes to a running target. A change comes as a list of [`Change`]s: one from a control
//! request ([`crate::control`]), the plan between the running configuration and the file
//! from a reload (SIGHUP, [`crate::plan::plan`]). [`Registry`] carries it out entirely or not
//! at all:
//!
//! 1. the changes are applied to a copy of the running configuration, which must pass
//!    [`Config::validate`];
//! 2. prepare ([`Prepared`]) does everything that can fail, change by change: bind the new
//!    listeners and make them ready on the reactors, open the new namespaces' backends,
//!    grow the resized ones, build the new subsystems. A failure drops what was prepared,
//!    which closes the listeners bound and the backends opened, and changes nothing;
//! 3. commit, which cannot fail: start and stop listeners, swap the listener, subsystem,
//!    host, namespace and ANA tables, then tell the hosts: a Namespace Attribute Notice (and
//!    the Changed Namespace List) on every controller whose host saw or sees a namespace that
//!    changed (of a namespace shown to other hosts, only where the host's view changed), an
//!    ANA Change notice on every controller connected through a listener where a group of
//!    its namespaces changed state, a disconnect for the controllers of a host no longer
//!    allowed or of a removed subsystem, and a Discovery Log Page Change notice on every
//!    discovery controller when the discovery log changed.
//!
//! A command already running on a namespace that is removed holds the namespace's backend
//! and completes normally; the commands that follow fail with Invalid Namespace. A removed
//! namespace's backend is flushed, then closed when its last command completes. A file grown
//! by a resize stays grown when a later step of the same change fails.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use blockdev::Backend;
use parking_lot::Mutex;
use serde_json::{Value, json};
use tracing::{info, warn};

use crate::ana::AnaTable;
use crate::config::{
    Config, ListenAddr, NamespaceConfig, TargetSettings, parse_uuid, write_private,
};
use crate::launcher::{ReadyListener, RunningTarget, bind_listener};
use crate::plan::{Change, Host, ana_state, plan};
pub use crate::plan::{ChangeError, refused};
use crate::subsystem::{HostAccess, Namespace, NamespaceMap, Subsystem};
use crate::target::{Listeners, StartError, Target, log_namespace_ready, open_backend};

/// A running target and the configuration it runs, changed together.
pub struct Registry {
    running: RunningTarget,
    config: Mutex<Config>,
    files: ConfigFiles,
}

/// Where the running configuration is written.
#[derive(Clone, Debug, Default)]
pub struct ConfigFiles {
    /// The file the target was started from and the `[target]` settings it holds (the
    /// running ones may come from flags): every change applied through [`Registry::change`]
    /// or [`Registry::edit`] is written back to it (see [`write_private`]), the previous
    /// version kept as `FILE.bak`, so that a restart runs what ran.
    pub persist: Option<(PathBuf, TargetSettings)>,
    /// The only directory [`Registry::save`] writes to; `None`: saving is off.
    pub save_dir: Option<PathBuf>,
}

/// What changes in one running subsystem.
struct Staged {
    sub: Arc<Subsystem>,
    access: Option<HostAccess>,
    namespaces: Option<NamespaceMap>,
    changed_nsids: Vec<u32>,
    /// Namespaces shown to other hosts (the same backend): a host is told of them only
    /// where it sees them now and did not, or did and does not.
    masked: Vec<u32>,
    removed: Vec<Arc<Namespace>>,
}

/// A change made ready: what can fail is done. Dropping it instead of committing rolls back:
/// the listeners it bound and the backends it opened close.
pub struct Prepared {
    started: Vec<(ListenAddr, ReadyListener)>,
    stopped: Vec<ListenAddr>,
    added: Vec<Arc<Subsystem>>,
    removed: Vec<Arc<Subsystem>>,
    staged: BTreeMap<String, Staged>,
    discovery_changed: bool,
    lines: Vec<String>,
}

impl Prepared {
    /// Prepares `changes`, which turn the running configuration `cur` into `new`.
    fn new(
        running: &RunningTarget,
        cur: &Config,
        new: &Config,
        changes: &[Change],
    ) -> Result<Prepared, ChangeError> {
        let live = running.target.subsystems();
        let mut p = Prepared {
            started: Vec::new(),
            stopped: Vec::new(),
            added: Vec::new(),
            removed: Vec::new(),
            staged: BTreeMap::new(),
            discovery_changed: false,
            lines: Vec::new(),
        };
        // Subsystems added by this change: built last, from `new`, with all their namespaces.
        let mut building = BTreeSet::new();
        // Resizes change files: done last, once everything else is prepared.
        let mut resizes = Vec::new();
        for c in changes {
            if let Some(nqn) = c.subsystem()
                && building.contains(nqn)
                && !matches!(c, Change::RemoveSubsystem { .. })
            {
                continue;
            }
            match c {
                Change::AddListener { listener, .. } => {
                    let l = running.ready(bind_listener(&listener.address)?)?;
                    p.started.push((listener.address.clone(), l));
                }
                Change::RemoveListener { address, discovery } => {
                    p.stopped.push(address.clone());
                    p.discovery_changed |= !*discovery;
                }
                Change::SetListenerTls { .. } => p.discovery_changed = true,
                Change::AddReferral { address } => {
                    p.lines.push(format!("discovery log refers to {address}"));
                }
                Change::RemoveReferral { address } => {
                    p.lines
                        .push(format!("discovery log no longer refers to {address}"));
                }
                Change::AddSubsystem(s) => {
                    building.insert(s.nqn.clone());
                }
                Change::RemoveSubsystem { nqn } => {
                    p.staged.remove(nqn);
                    if !building.remove(nqn) {
                        let sub = live.get(nqn).cloned();
                        let Some(sub) = sub else {
                            return refused(format!("subsystem {nqn} is not running"));
                        };
                        p.removed.push(sub);
                    }
                    p.lines.push(format!("removed subsystem {nqn}"));
                }
                Change::AllowAnyHost { subsystem, allow } => {
                    p.access(&live, new, subsystem)?;
                    p.lines
                        .push(format!("subsystem {subsystem}: allow_any_host = {allow}"));
                }
                Change::AddHost { subsystem, host } => {
                    p.access(&live, new, subsystem)?;
                    let keys = if matches!(host, Host::Keyed(_)) {
                        " (with keys)"
                    } else {
                        ""
                    };
                    p.lines.push(format!(
                        "subsystem {subsystem}: allowed host {}{keys}",
                        host.nqn()
                    ));
                }
                Change::SetHostKeys { subsystem, host } => {
                    p.access(&live, new, subsystem)?;
                    p.lines.push(format!(
                        "subsystem {subsystem}: new keys for host {}",
                        host.nqn()
                    ));
                }
                Change::RemoveHost { subsystem, host } => {
                    p.access(&live, new, subsystem)?;
                    p.lines.push(format!(
                        "subsystem {subsystem}: no longer allowed host {host}"
                    ));
                }
                Change::AddNamespace {
                    subsystem,
                    namespace: n,
                } => {
                    let id = n.nsid.unwrap_or(0);
                    let backend = open_backend(subsystem, id, &n.backend)?;
                    let uuid = n.uuid.as_deref().and_then(parse_uuid);
                    let ns = Namespace::new(subsystem, id, backend, uuid, n.backend.to_string())
                        .configured(n);
                    p.namespaces(&live, subsystem)?.put(ns);
                    p.lines.push(format!(
                        "subsystem {subsystem}: added namespace {id} ({})",
                        n.backend
                    ));
                }
                Change::RemoveNamespace { subsystem, nsid } => {
                    let old = p.namespaces(&live, subsystem)?.take(*nsid)?;
                    p.lines.push(format!(
                        "subsystem {subsystem}: removed namespace {nsid} ({})",
                        old.description
                    ));
                }
                Change::ResizeNamespace {
                    subsystem,
                    nsid,
                    size,
                } => resizes.push((subsystem, *nsid, *size)),
                Change::ReplaceBackend {
                    subsystem,
                    nsid,
                    backend,
                } => {
                    let configured = namespace_config(new, subsystem, *nsid);
                    let uuid = configured.and_then(|n| n.uuid.as_deref().and_then(parse_uuid));
                    let opened = open_backend(subsystem, *nsid, backend)?;
                    let s = p.namespaces(&live, subsystem)?;
                    let old = s.take(*nsid)?;
                    let was = namespace_config(cur, subsystem, *nsid)
                        .map_or_else(|| old.description.clone(), |n| n.backend.to_string());
                    let mut ns =
                        Namespace::new(subsystem, *nsid, opened, uuid, backend.to_string());
                    if let Some(n) = configured {
                        ns = ns.configured(n);
                    }
                    s.put(ns);
                    p.lines.push(format!(
                        "subsystem {subsystem}: namespace {nsid} is now {backend} (was {was})"
                    ));
                }
                Change::AddNamespaceHost {
                    subsystem,
                    nsid,
                    host,
                }
                | Change::RemoveNamespaceHost {
                    subsystem,
                    nsid,
                    host,
                } => {
                    let hosts = namespace_config(new, subsystem, *nsid)
                        .map(|n| n.hosts.clone())
                        .unwrap_or_default();
                    let seen = match hosts.is_empty() {
                        true => "every host".to_string(),
                        false => format!("{} only", hosts.join(", ")),
                    };
                    p.namespaces(&live, subsystem)?.mask(*nsid, hosts)?;
                    let how = match c {
                        Change::AddNamespaceHost { .. } => "shown to",
                        _ => "hidden from",
                    };
                    p.lines.push(format!(
                        "subsystem {subsystem}: namespace {nsid} is now seen by {seen} ({how} {host})"
                    ));
                }
                Change::SetAnaState {
                    address,
                    group,
                    state,
                } => {
                    let was = cur
                        .listeners
                        .iter()
                        .find(|l| l.address == *address)
                        .map(|l| ana_state(l, *group))
                        .unwrap_or_default();
                    if was != *state {
                        p.lines.push(format!(
                            "listener {address}: ANA group {group} is now {state} (was {was})"
                        ));
                    }
                }
            }
        }
        for s in new.subsystems.iter().filter(|s| building.contains(&s.nqn)) {
            let backends = s
                .nsids()
                .zip(&s.namespaces)
                .map(|(id, ns)| {
                    Ok((
                        open_backend(&s.nqn, id, &ns.backend)?,
                        ns.backend.to_string(),
                    ))
                })
                .collect::<Result<Vec<_>, StartError>>()?;
            p.added.push(Arc::new(Subsystem::new(s, backends)));
            p.lines.push(format!("added subsystem {}", s.nqn));
        }
        for (subsystem, nsid, size) in resizes {
            let s = p.namespaces(&live, subsystem)?;
            let old = s.take(nsid)?;
            // Resized in place: the old namespace is not flushed as a removed one.
            s.removed.pop();
            let backend = old
                .backend
                .resized(size)
                .map_err(|source| StartError::Backend {
                    nqn: subsystem.clone(),
                    nsid,
                    source,
                })?;
            let configured = namespace_config(new, subsystem, nsid);
            let desc =
                configured.map_or_else(|| old.description.clone(), |n| n.backend.to_string());
            let mut ns = Namespace::new(subsystem, nsid, Arc::new(backend), Some(old.uuid), desc);
            if let Some(n) = configured {
                ns = ns.configured(n);
            }
            let line = format!(
                "subsystem {subsystem}: resized namespace {nsid} from {} to {} blocks",
                old.blocks, ns.blocks
            );
            s.put(ns);
            p.lines.push(line);
        }
        Ok(p)
    }

    /// The staged state of running subsystem `nqn`.
    fn staged(
        &mut self,
        live: &crate::target::SubsystemMap,
        nqn: &str,
    ) -> Result<&mut Staged, ChangeError> {
        if !self.staged.contains_key(nqn) {
            let Some(sub) = live.get(nqn) else {
                return refused(format!("subsystem {nqn} is not running"));
            };
            let staged = Staged {
                sub: Arc::clone(sub),
                access: None,
                namespaces: None,
                changed_nsids: Vec::new(),
                masked: Vec::new(),
                removed: Vec::new(),
            };
            self.staged.insert(nqn.to_string(), staged);
        }
        Ok(self.staged.get_mut(nqn).expect("staged above"))
    }

    /// Stages the host access of subsystem `nqn` as `new` says.
    fn access(
        &mut self,
        live: &crate::target::SubsystemMap,
        new: &Config,
        nqn: &str,
    ) -> Result<(), ChangeError> {
        let Some(cfg) = new.subsystems.iter().find(|s| s.nqn == nqn) else {
            return refused(format!("no subsystem {nqn}"));
        };
        self.staged(live, nqn)?.access = Some(HostAccess::from_config(cfg));
        self.discovery_changed = true;
        Ok(())
    }

    /// The staged namespaces of subsystem `nqn`.
    fn namespaces(
        &mut self,
        live: &crate::target::SubsystemMap,
        nqn: &str,
    ) -> Result<&mut Staged, ChangeError> {
        let s = self.staged(live, nqn)?;
        if s.namespaces.is_none() {
            s.namespaces = Some((*s.sub.namespaces()).clone());
        }
        Ok(s)
    }

    /// Carries the change out and returns what changed, one line each. Cannot fail.
    fn commit(self, running: &RunningTarget, new: &mut Config) -> Vec<String> {
        let Prepared {
            started,
            stopped,
            added,
            removed,
            staged,
            mut discovery_changed,
            mut lines,
        } = self;
        let target = &running.target;
        for a in &stopped {
            running.stop_listener(a);
            lines.push(format!("stopped listening on {a}"));
        }
        for (requested, l) in started {
            let bound = l.addr().clone();
            running.start_listener(l);
            lines.push(format!("listening on {bound}"));
            for l in &mut new.listeners {
                if l.address == requested {
                    l.address = bound.clone();
                    discovery_changed = true;
                }
            }
            for a in &mut new.discovery.listen {
                if *a == requested {
                    *a = bound.clone();
                }
            }
        }
        target.set_listeners(Listeners {
            io: new.listeners.iter().map(|l| l.address.clone()).collect(),
            discovery: new.discovery.listen.clone(),
            tls: new
                .listeners
                .iter()
                .filter(|l| l.tls.is_some())
                .map(|l| l.address.addr)
                .collect(),
        });

        discovery_changed |= target.set_referrals(&new.discovery.referrals);
        if !added.is_empty() || !removed.is_empty() {
            let mut map = (*target.subsystems()).clone();
            for s in &removed {
                map.remove(&s.nqn);
            }
            for s in &added {
                for ns in s.namespaces().values() {
                    log_namespace_ready(&s.nqn, ns);
                }
                map.insert(s.nqn.clone(), Arc::clone(s));
            }
            target.set_subsystems(map);
            discovery_changed = true;
        }
        for s in staged.values() {
            if let Some(access) = &s.access {
                s.sub.set_access(access.clone());
                for c in s.sub.controllers() {
                    if !access.allows(&c.hostnqn) && c.tear_down() {
                        lines.push(format!(
                            "subsystem {}: disconnected controller {} of {} ({}): host no longer allowed",
                            s.sub.nqn, c.cntlid, c.hostnqn, c.peer
                        ));
                    }
                }
            }
            if let Some(namespaces) = &s.namespaces {
                for ns in namespaces.values() {
                    if s.changed_nsids.contains(&ns.nsid) {
                        log_namespace_ready(&s.sub.nqn, ns);
                    }
                }
                let before = s.sub.namespaces();
                s.sub.set_namespaces(namespaces.clone());
                for c in s.sub.controllers() {
                    // A host is told of the namespaces it saw or sees now; of one shown to
                    // other hosts only, if its own view changed.
                    let seen = |m: &NamespaceMap, id: u32| {
                        m.get(&id).is_some_and(|ns| ns.visible_to(&c.hostnqn))
                    };
                    let changed = s
                        .changed_nsids
                        .iter()
                        .copied()
                        .filter(|&id| seen(&before, id) || seen(namespaces, id));
                    let masked = s.masked.iter().copied().filter(|&id| {
                        !s.changed_nsids.contains(&id) && seen(&before, id) != seen(namespaces, id)
                    });
                    let nsids: Vec<u32> = changed.chain(masked).collect();
                    if !nsids.is_empty() {
                        c.notify_namespaces_changed(&nsids);
                    }
                }
                flush_removed(s.removed.clone());
            }
        }
        for s in &removed {
            for c in s.controllers() {
                c.tear_down();
            }
            flush_removed(s.namespaces().values().cloned().collect());
        }
        // The ANA states of the listeners as bound: controllers connected where a group of
        // their namespaces changes state are told.
        let ana = AnaTable::from_listeners(&new.listeners);
        if *target.ana.table() != ana {
            let old = target.ana.replace(ana);
            let now = target.ana.table();
            for s in target.subsystems().values() {
                for c in s.controllers() {
                    if old.differs_at(&now, c.local, c.ana_groups().into_iter()) {
                        c.notify_ana_changed();
                    }
                }
            }
        }
        if discovery_changed {
            target.discovery_changed();
        }
        for l in &lines {
            info!("{l}");
        }
        lines
    }
}

/// Namespace `nsid` of subsystem `nqn` in `cfg`.
fn namespace_config<'a>(cfg: &'a Config, nqn: &str, nsid: u32) -> Option<&'a NamespaceConfig> {
    let s = cfg.subsystems.iter().find(|s| s.nqn == nqn)?;
    s.nsids()
        .zip(&s.namespaces)
        .find(|(id, _)| *id == nsid)
        .map(|(_, n)| n)
}

impl Staged {
    /// Puts a new namespace in the staged map.
    fn put(&mut self, ns: Namespace) {
        let id = ns.nsid;
        if let Some(m) = &mut self.namespaces {
            m.insert(id, Arc::new(ns));
        }
        if !self.changed_nsids.contains(&id) {
            self.changed_nsids.push(id);
        }
    }

    /// Shows staged namespace `nsid` to `hosts` only (empty: to every host).
    fn mask(&mut self, nsid: u32, hosts: Vec<String>) -> Result<(), ChangeError> {
        let Some(m) = &mut self.namespaces else {
            return refused(format!("subsystem {} is not staged", self.sub.nqn));
        };
        let Some(ns) = m.get(&nsid) else {
            return refused(format!(
                "subsystem {} namespace {nsid} is not running",
                self.sub.nqn
            ));
        };
        let ns = Arc::new(ns.with_hosts(hosts));
        m.insert(nsid, ns);
        if !self.masked.contains(&nsid) {
            self.masked.push(nsid);
        }
        Ok(())
    }

    /// Takes namespace `nsid` out of the staged map; it goes as a removed namespace does.
    fn take(&mut self, nsid: u32) -> Result<Arc<Namespace>, ChangeError> {
        let Some(ns) = self.namespaces.as_mut().and_then(|m| m.remove(&nsid)) else {
            return refused(format!(
                "subsystem {} namespace {nsid} is not running",
                self.sub.nqn
            ));
        };
        if !self.changed_nsids.contains(&nsid) {
            self.changed_nsids.push(nsid);
        }
        self.removed.push(Arc::clone(&ns));
        Ok(ns)
    }
}

impl Registry {
    /// Takes over a started target and the configuration it was built from. NSIDs are written
    /// out and listener addresses replaced by the bound ones, so that [`Registry::save`]
    /// writes what runs.
    pub fn new(running: RunningTarget, cfg: Config) -> Self {
        let mut cfg = cfg.with_explicit_nsids();
        let bound = running.target.listeners();
        for (l, a) in cfg.listeners.iter_mut().zip(bound.io) {
            l.address = a;
        }
        for (l, a) in cfg.discovery.listen.iter_mut().zip(bound.discovery) {
            *l = a;
        }
        // The ANA states go to the listeners as bound (a port of 0 resolved).
        let ana = AnaTable::from_listeners(&cfg.listeners);
        if *running.target.ana.table() != ana {
            running.target.ana.replace(ana);
        }
        Registry {
            running,
            config: Mutex::new(cfg),
            files: ConfigFiles::default(),
        }
    }

    /// Sets where the running configuration is written.
    pub fn with_files(mut self, files: ConfigFiles) -> Self {
        self.files = files;
        self
    }

    /// The running target.
    pub fn running(&self) -> &RunningTarget {
        &self.running
    }

    /// The target's shared state.
    pub fn target(&self) -> &Arc<Target> {
        &self.running.target
    }

    /// The running configuration.
    pub fn config(&self) -> Config {
        self.config.lock().clone()
    }

    /// Carries out `changes` (see the module documentation), then writes the running
    /// configuration to the file the target started from, if any ([`ConfigFiles::persist`]).
    /// Returns what changed, one line each (and a warning line when the file could not be
    /// written: the change runs all the same); on an error nothing changed.
    pub fn change(&self, changes: &[Change]) -> Result<Vec<String>, ChangeError> {
        let mut cur = self.config.lock();
        let mut new = cur.clone();
        for c in changes {
            c.apply(&mut new)?;
        }
        let mut lines = self.carry_out(&mut cur, new, changes)?;
        if let Some((path, settings)) = &self.files.persist
            && !lines.is_empty()
        {
            let mut file = cur.clone();
            file.target = settings.clone();
            let written = file
                .to_toml()
                .map_err(std::io::Error::other)
                .and_then(|text| write_private(path, &text, true));
            match written {
                Ok(()) => info!(path = %path.display(), "configuration file updated"),
                Err(e) => {
                    let line = format!(
                        "warning: the change runs but {} could not be updated ({e}); a \
                         restart would not keep it",
                        path.display()
                    );
                    warn!("{line}");
                    lines.push(line);
                }
            }
        }
        Ok(lines)
    }

    /// Carries out the changes that `edit` makes to the running configuration, as
    /// [`Registry::change`] does.
    pub fn edit(
        &self,
        edit: impl FnOnce(&mut Config) -> Result<(), ChangeError>,
    ) -> Result<Vec<String>, ChangeError> {
        let cur = self.config();
        let mut new = cur.clone();
        edit(&mut new)?;
        new.validate()?;
        let changes = plan(&cur, &new)?;
        self.change(&changes)
    }

    /// Makes the target run `new` (a reloaded file): carries out `plan(running, new)`.
    /// Returns what changed, one line each; on an error nothing changed.
    pub fn apply(&self, new: Config) -> Result<Vec<String>, ChangeError> {
        new.validate()?;
        let mut cur = self.config.lock();
        let changes = plan(&cur, &new)?;
        self.carry_out(&mut cur, new, &changes)
    }

    /// Validates `new`, prepares `changes` and commits them; `cur` becomes `new` with the
    /// addresses as bound.
    fn carry_out(
        &self,
        cur: &mut Config,
        new: Config,
        changes: &[Change],
    ) -> Result<Vec<String>, ChangeError> {
        let mut new = new.with_explicit_nsids();
        new.validate()?;
        let prepared = Prepared::new(&self.running, cur, &new, changes)?;
        let lines = prepared.commit(&self.running, &mut new);
        *cur = new;
        Ok(lines)
    }

    /// Disconnects the controllers of subsystem `nqn` with ID `cntlid` or of host `host`
    /// (the host may reconnect if it is still allowed).
    pub fn disconnect(
        &self,
        nqn: &str,
        cntlid: Option<u16>,
        host: Option<&str>,
    ) -> Result<Vec<String>, ChangeError> {
        let Some(sub) = self.target().subsystem(nqn) else {
            return refused(format!("no subsystem {nqn}"));
        };
        if cntlid.is_none() && host.is_none() {
            return refused("name a controller ID or a host NQN");
        }
        let mut changes = Vec::new();
        for c in sub.controllers() {
            let hit = cntlid.is_none_or(|id| id == c.cntlid) && host.is_none_or(|h| h == c.hostnqn);
            if hit && c.tear_down() {
                changes.push(format!(
                    "subsystem {nqn}: disconnected controller {} of {} ({})",
                    c.cntlid, c.hostnqn, c.peer
                ));
            }
        }
        if changes.is_empty() {
            return refused(format!("subsystem {nqn} has no such controller"));
        }
        for c in &changes {
            info!("{c}");
        }
        Ok(changes)
    }

    /// Writes the running configuration to `path` as TOML (see [`write_private`]), so that a
    /// restart with it serves the same subsystems, namespaces, hosts and listeners. `path`
    /// must name a file in [`ConfigFiles::save_dir`]; the configuration file the target
    /// started from keeps its previous version as `FILE.bak`.
    pub fn save(&self, path: &Path) -> Result<(), ChangeError> {
        let Some(dir) = &self.files.save_dir else {
            return refused(
                "saving is off: start with --config FILE (saves go to its directory) or \
                 --save-dir DIR",
            );
        };
        let outside = || {
            ChangeError::Refused(format!(
                "{}: saves go to {} only (save_dir)",
                path.display(),
                dir.display()
            ))
        };
        let (Some(parent), Some(_)) = (path.parent(), path.file_name()) else {
            return Err(outside());
        };
        let real = parent.canonicalize().map_err(|e| {
            ChangeError::Refused(format!("cannot save to {}: {e}", parent.display()))
        })?;
        if dir.canonicalize().ok() != Some(real) {
            return Err(outside());
        }
        let backup =
            self.files.persist.as_ref().is_some_and(|(p, _)| {
                p.canonicalize().ok() == path.canonicalize().ok() && p.exists()
            });
        let text = self.config.lock().to_toml()?;
        write_private(path, &text, backup)
            .map_err(|e| ChangeError::Refused(format!("cannot write {}: {e}", path.display())))?;
        info!(path = %path.display(), "saved the running configuration");
        Ok(())
    }

    /// What runs, as a JSON object: subsystems (namespaces, allowed hosts and, with
    /// `controllers`, the connected controllers), listeners and their ANA states.
    pub fn describe(&self, controllers: bool) -> Value {
        let target = self.target();
        let subsystems: Vec<Value> = target
            .subsystems()
            .values()
            .map(|s| {
                let access = s.access();
                let namespaces: Vec<Value> = s
                    .namespaces()
                    .values()
                    .map(|ns| {
                        json!({
                            "nsid": ns.nsid,
                            "backend": ns.description,
                            "block_size": ns.block_size,
                            "blocks": ns.blocks,
                            "size": ns.backend.capacity_bytes(),
                            "hosts": ns.hosts,
                            "ana_group": ns.ana_group,
                        })
                    })
                    .collect();
                let mut v = json!({
                    "nqn": s.nqn,
                    "serial": s.serial,
                    "model": s.model,
                    "allow_any_host": access.allow_any_host,
                    "hosts": access.hosts,
                    "dhchap_hosts": access.auth_hosts.keys().collect::<Vec<_>>(),
                    "tls_hosts": access.tls_psks.keys().collect::<Vec<_>>(),
                    "cntlid_range": [s.cntlid_range().0, s.cntlid_range().1],
                    "namespaces": namespaces,
                });
                if controllers {
                    v["controllers"] = s.controllers().iter().map(|c| controller_json(c)).collect();
                }
                v
            })
            .collect();
        let listeners = target.listeners();
        let ana: Vec<Value> = self
            .config
            .lock()
            .listeners
            .iter()
            .flat_map(|l| {
                l.ana.iter().map(|a| {
                    json!({
                        "listener": l.address.to_string(),
                        "group": a.group,
                        "state": a.state.name(),
                    })
                })
            })
            .collect();
        let mut v = json!({
            "ana": ana,
            "subsystems": subsystems,
            "listeners": listeners.io.iter().map(ToString::to_string).collect::<Vec<_>>(),
            "discovery_listeners": listeners.discovery.iter().map(ToString::to_string).collect::<Vec<_>>(),
            "referrals": target.referrals().iter().map(ToString::to_string).collect::<Vec<_>>(),
        });
        if controllers {
            v["connections"] = json!(target.connection_count());
            v["metrics"] = serde_json::to_value(target.metrics_snapshot()).unwrap_or(Value::Null);
            v["discovery_controllers"] = target
                .discovery_controllers()
                .iter()
                .map(|c| controller_json(c))
                .collect();
        }
        v
    }
}

fn controller_json(c: &crate::controller::Controller) -> Value {
    json!({
        "cntlid": c.cntlid,
        "host": c.hostnqn,
        "peer": c.peer.to_string(),
        "io_queues": c.io_queues(),
        "keep_alive_ms": c.kato_ms(),
    })
}

/// Flushes the backends of removed namespaces in the background (their last commands may
/// still be running; each closes when its last user lets go).
fn flush_removed(namespaces: Vec<Arc<Namespace>>) {
    if namespaces.is_empty() {
        return;
    }
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        return;
    };
    rt.spawn(async move {
        for ns in namespaces {
            if let Err(e) = ns.backend.flush().await {
                warn!(nsid = ns.nsid, error = %e, "flush of a removed namespace failed");
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use nvme_spec::command::{build, log_id};
    use nvme_spec::fabrics::{Cc, ConnectData, DISCOVERY_NQN, property};
    use nvme_spec::features::{self, aer_dw0, aer_notice, aer_type};
    use nvme_spec::identify::IdentifyController;
    use nvme_spec::status::generic;
    use nvme_spec::{Cqe, FabricsCommand, FromBytes, IntoBytes, Sqe, Status};

    use super::*;
    use crate::config::{ListenerConfig, NamespaceConfig};
    use crate::queue::{HostSgl, QueueState, Submit};
    use crate::testing::{HOST, NQN, connect_sqe, connected, origin, registry, status};

    fn add_ns(r: &Registry, spec: &str, nsid: Option<u32>) -> Result<Vec<String>, ChangeError> {
        r.edit(|c| {
            c.subsystems[0].namespaces.push(NamespaceConfig {
                nsid,
                backend: spec.parse().unwrap(),
                uuid: None,
                hosts: Vec::new(),
                ana_group: None,
            });
            Ok(())
        })
    }

    fn nsids(r: &Registry) -> Vec<u32> {
        r.target()
            .subsystem(NQN)
            .unwrap()
            .namespaces()
            .keys()
            .copied()
            .collect()
    }

    fn aer(cid: u16) -> Sqe {
        build::async_event_request(cid)
    }

    fn read(cid: u16, nsid: u32) -> Sqe {
        let mut sqe = build::read_write(false, cid, nsid, 0, 1);
        sqe.dptr = nvme_spec::queue::SglDescriptor::tcp_transport(4096);
        sqe
    }

    /// Sends `sqe` on `q` and returns its completion.
    fn answer(q: &mut QueueState, sqe: &Sqe) -> Cqe {
        match q.submit(sqe, &[]) {
            Submit::Complete(c) | Submit::CompleteAndClose(c) | Submit::CompleteWithData(_, c) => c,
            Submit::Io(_) => Cqe::new(sqe.cid(), Status::SUCCESS, 0),
            Submit::Held => panic!("held"),
            Submit::Abandon => panic!("abandoned: the controller is gone"),
        }
    }

    fn data(q: &mut QueueState, sqe: &Sqe) -> Vec<u8> {
        let mut sqe = *sqe;
        sqe.dptr = nvme_spec::queue::SglDescriptor::tcp_transport(4096);
        match q.submit(&sqe, &[]) {
            Submit::CompleteWithData(d, c) if c.status().is_success() => d,
            _ => panic!("no data"),
        }
    }

    fn changed_ns_log(q: &mut QueueState) -> Vec<u32> {
        let page = data(
            q,
            &build::get_log_page(9, log_id::CHANGED_NS_LIST, 0, 4096, 0),
        );
        page.chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .take_while(|&n| n != 0)
            .collect()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_refused_change_changes_nothing() {
        let r = registry(&["mem:1M"]);
        let before = r.config();
        let listeners = r.target().listeners();
        // A new listener and a backend that fails to open, in one change: neither happens.
        let e = r
            .edit(|c| {
                c.listeners.push(ListenerConfig {
                    address: "tcp://127.0.0.1:0".parse().unwrap(),
                    tls: None,
                    ana: Vec::new(),
                });
                c.subsystems[0].namespaces.push(NamespaceConfig {
                    nsid: Some(2),
                    backend: "file:/nonexistent-dir/ns.img,size=1M".parse().unwrap(),
                    uuid: None,
                    hosts: Vec::new(),
                    ana_group: None,
                });
                Ok(())
            })
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("namespace 2") && e.contains("/nonexistent-dir/ns.img"),
            "{e}"
        );
        assert_eq!(r.target().listeners(), listeners);
        assert_eq!(nsids(&r), vec![1]);
        let e = add_ns(&r, "mem:1M", Some(1)).unwrap_err().to_string();
        assert!(e.contains("nsid 1 used twice"), "{e}");
        // A namespace is named by its NSID, not by its place in the list.
        let e = add_ns(&r, "file:/nonexistent-dir/ns.img,size=1M", Some(9))
            .unwrap_err()
            .to_string();
        assert!(e.contains("namespace 9:"), "{e}");
        let e = r
            .edit(|c| {
                c.target.max_queue_depth = 64;
                Ok(())
            })
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("change only at a restart: max_queue_depth changed"),
            "{e}"
        );
        let e = r
            .edit(|c| {
                c.subsystems[0].namespaces[0].uuid =
                    Some("00000000-0000-4000-8000-000000000001".into());
                Ok(())
            })
            .unwrap_err()
            .to_string();
        assert!(e.contains("UUIDs change only at a restart"), "{e}");
        let e = r
            .edit(|c| {
                c.subsystems[0].namespaces[0].backend = "mem:2M".parse().unwrap();
                Ok(())
            })
            .unwrap_err()
            .to_string();
        assert!(e.contains("mem namespaces cannot be resized"), "{e}");
        let e = r
            .edit(|c| {
                c.subsystems[0].allow_any_host = false;
                Ok(())
            })
            .unwrap_err()
            .to_string();
        assert!(e.contains("no host may connect"), "{e}");
        assert_eq!(r.config().to_toml().unwrap(), before.to_toml().unwrap());
        r.running().shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_prepare_closes_what_it_bound() {
        let r = registry(&["mem:1M"]);
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let address: ListenAddr = format!("tcp://127.0.0.1:{port}").parse().unwrap();
        let changes = [
            Change::AddListener {
                listener: ListenerConfig {
                    address: address.clone(),
                    tls: None,
                    ana: Vec::new(),
                },
                discovery: false,
            },
            Change::AddNamespace {
                subsystem: NQN.into(),
                namespace: NamespaceConfig {
                    nsid: Some(2),
                    backend: "file:/nonexistent-dir/ns.img,size=1M".parse().unwrap(),
                    uuid: None,
                    hosts: Vec::new(),
                    ana_group: None,
                },
            },
        ];
        let e = r.change(&changes).unwrap_err().to_string();
        assert!(e.contains("/nonexistent-dir/ns.img"), "{e}");
        // The listener bound for the change is closed again: its port binds.
        drop(std::net::TcpListener::bind(address.addr).expect("the port is free again"));
        assert!(!r.target().listeners().io.contains(&address));
        // The same change without the failing part goes through, on that very port.
        let lines = r.change(&changes[..1]).unwrap();
        assert_eq!(lines, vec![format!("listening on {address}")]);
        r.running().shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn rdma_listeners_change_live_like_tcp_ones() {
        let r = registry(&["mem:1M"]);
        let listeners = r.target().listeners();
        let rdma: ListenAddr = "rdma://127.0.0.1:4420".parse().unwrap();
        let added = r.edit(|c| {
            c.listeners.push(ListenerConfig {
                address: rdma.clone(),
                tls: None,
                ana: Vec::new(),
            });
            Ok(())
        });
        match added {
            // An RDMA device on the loopback address: the listener is live, and goes again.
            Ok(_) => {
                assert!(r.target().listeners().io.contains(&rdma));
                r.edit(|c| {
                    c.listeners.retain(|l| l.address != rdma);
                    Ok(())
                })
                .unwrap();
                assert_eq!(r.target().listeners(), listeners);
            }
            // Usually none (or no RDMA libraries): binding it fails, as a TCP bind can.
            Err(e) => {
                let e = e.to_string();
                assert!(e.contains("rdma://127.0.0.1:4420"), "{e}");
                assert!(!e.contains("restart"), "{e}");
                assert_eq!(r.target().listeners(), listeners);
            }
        }
        r.running().shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_backend_swap_keeps_the_nsid_and_tells_the_hosts() {
        let r = registry(&["mem:1M"]);
        let (mut admin, mut io) = connected(r.target(), HostSgl::Transport);
        let aec = build::set_features(
            4,
            features::ASYNC_EVENT_CONFIG,
            features::AEC_NS_ATTRIBUTE_NOTICES,
        );
        assert!(answer(&mut admin, &aec).status().is_success());
        assert!(answer(&mut io, &read(1, 1)).status().is_success());
        let old = Arc::clone(&r.target().subsystem(NQN).unwrap().namespaces()[&1]);
        let changes = r
            .edit(|c| {
                c.subsystems[0].namespaces[0].backend = "null:2M".parse().unwrap();
                Ok(())
            })
            .unwrap();
        assert!(
            changes[0].contains("namespace 1 is now null:2M") && changes[0].contains("was mem:1M"),
            "{changes:?}"
        );
        let ns = Arc::clone(&r.target().subsystem(NQN).unwrap().namespaces()[&1]);
        assert_eq!((ns.blocks, ns.uuid), (512, old.uuid));
        assert_eq!(changed_ns_log(&mut admin), vec![1]);
        assert!(answer(&mut io, &read(2, 1)).status().is_success());

        // The same file with other options is not opened twice.
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("ns.img");
        let spec = format!("file:{},size=1M", f.display());
        add_ns(&r, &spec, Some(2)).unwrap();
        let e = r
            .edit(|c| {
                c.subsystems[0].namespaces[1].backend =
                    format!("{spec},direct=off").parse().unwrap();
                Ok(())
            })
            .unwrap_err()
            .to_string();
        assert!(e.contains("serves the same file"), "{e}");
        r.running().shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_saved_configuration_restarts_to_the_same_state() {
        let dir = tempfile::tempdir().unwrap();
        let r = registry(&["mem:1M", "null:1M"]).with_files(ConfigFiles {
            persist: None,
            save_dir: Some(dir.path().to_path_buf()),
        });
        add_ns(&r, "null:4M", Some(7)).unwrap();
        r.edit(|c| {
            c.subsystems[0].namespaces.remove(0);
            c.subsystems[0].hosts.push(HOST.into());
            c.subsystems[0].allow_any_host = false;
            c.discovery
                .listen
                .push("tcp://127.0.0.1:0".parse().unwrap());
            Ok(())
        })
        .unwrap();
        assert_eq!(nsids(&r), vec![2, 7]);
        let path = dir.path().join("saved.toml");
        r.save(&path).unwrap();
        // Only into the save directory, however the path is spelled.
        let other = tempfile::tempdir().unwrap();
        let link = dir.path().join("elsewhere");
        std::os::unix::fs::symlink(other.path(), &link).unwrap();
        for bad in [
            other.path().join("x.toml"),
            link.join("x.toml"),
            dir.path().join("sub/../../x.toml"),
        ] {
            let e = r.save(&bad).unwrap_err().to_string();
            assert!(
                e.contains("saves go to") || e.contains("cannot save"),
                "{e}"
            );
        }
        assert_eq!(std::fs::read_dir(other.path()).unwrap().count(), 0);
        let off = registry(&["mem:1M"]);
        let e = off.save(&path).unwrap_err().to_string();
        assert!(e.contains("saving is off"), "{e}");
        off.running().shutdown().await;
        let saved = Config::from_file(&path).unwrap();
        assert_eq!(saved.to_toml().unwrap(), r.config().to_toml().unwrap());
        // Bound ports are written, not port 0.
        assert!(saved.discovery.listen.iter().all(|a| a.addr.port() != 0));
        assert_eq!(saved.subsystems[0].nsids().collect::<Vec<_>>(), vec![2, 7]);
        // Applying what runs changes nothing.
        assert!(r.apply(saved).unwrap().is_empty());
        r.running().shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn applied_changes_are_written_back_to_the_configuration_file() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("target.toml");
        let r = registry(&["mem:1M"]);
        let original = r.config();
        let mut file_settings = original.target.clone();
        file_settings.reactors = 0;
        std::fs::write(&path, "# the original\n").unwrap();
        let r = r.with_files(ConfigFiles {
            persist: Some((path.clone(), file_settings.clone())),
            save_dir: None,
        });
        add_ns(&r, "null:4M", None).unwrap();
        let written = Config::from_file(&path).unwrap();
        assert_eq!(
            written.subsystems[0].nsids().collect::<Vec<_>>(),
            vec![1, 2]
        );
        // The file's [target] settings, not the running ones (which may come from flags).
        assert_eq!(written.target, file_settings);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let bak = dir.path().join("target.toml.bak");
        assert_eq!(std::fs::read_to_string(&bak).unwrap(), "# the original\n");
        // A refused change writes nothing; an unwritable file is a warning line.
        assert!(add_ns(&r, "null:1M", Some(2)).is_err());
        assert_eq!(
            Config::from_file(&path).unwrap().to_toml().unwrap(),
            written.to_toml().unwrap()
        );
        std::fs::remove_file(&path).unwrap();
        std::fs::create_dir(&path).unwrap();
        let changes = add_ns(&r, "null:1M", None).unwrap();
        assert!(
            changes.last().unwrap().contains("could not be updated"),
            "{changes:?}"
        );
        assert_eq!(nsids(&r), vec![1, 2, 3]);
        r.running().shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn namespace_changes_raise_a_notice_and_fill_the_changed_list() {
        let r = registry(&["mem:1M"]);
        let (mut admin, mut io) = connected(r.target(), HostSgl::Transport);
        let mut events = admin.events.take().unwrap();
        let id = data(
            &mut admin,
            &build::identify(3, nvme_spec::command::cns::CONTROLLER, 0),
        );
        let id = IdentifyController::read_from_bytes(&id).unwrap();
        assert_ne!(
            id.oaes.get() & (1 << 8),
            0,
            "OAES: namespace attribute notices"
        );
        let aec = build::set_features(
            4,
            features::ASYNC_EVENT_CONFIG,
            features::AEC_NS_ATTRIBUTE_NOTICES,
        );
        assert!(answer(&mut admin, &aec).status().is_success());
        assert!(matches!(admin.submit(&aer(5), &[]), Submit::Held));
        let notice = aer_dw0(
            aer_type::NOTICE,
            aer_notice::NS_ATTRIBUTE_CHANGED,
            log_id::CHANGED_NS_LIST,
        );

        add_ns(&r, "null:1M", None).unwrap();
        let cqe = events.try_recv().expect("the held AER completes");
        assert_eq!((cqe.cid(), cqe.dw0.get()), (5, notice));
        assert!(
            answer(&mut io, &read(1, 2)).status().is_success(),
            "the new namespace serves I/O"
        );
        // Another change before the log page is read only adds to the list.
        r.edit(|c| {
            c.subsystems[0].namespaces[1].backend = "null:2M".parse().unwrap();
            Ok(())
        })
        .unwrap();
        assert!(events.try_recv().is_err());
        assert_eq!(changed_ns_log(&mut admin), vec![2]);
        assert_eq!(
            changed_ns_log(&mut admin),
            Vec::<u32>::new(),
            "reading clears it"
        );

        // Raised while no AER is held: the next AER completes at once.
        r.edit(|c| {
            c.subsystems[0].namespaces.remove(1);
            Ok(())
        })
        .unwrap();
        assert_eq!(answer(&mut admin, &aer(6)).dw0.get(), notice);
        assert_eq!(changed_ns_log(&mut admin), vec![2]);
        assert_eq!(
            answer(&mut io, &read(2, 2)).status(),
            Status::generic(generic::INVALID_NAMESPACE).with_dnr()
        );
        r.running().shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_removed_host_is_disconnected_and_discovery_controllers_are_told() {
        let r = registry(&["mem:1M"]);
        r.edit(|c| {
            let s = &mut c.subsystems[0];
            s.allow_any_host = false;
            s.hosts = vec![
                HOST.into(),
                "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-0000000000bb".into(),
            ];
            Ok(())
        })
        .unwrap();
        let (admin, _io) = connected(r.target(), HostSgl::Transport);
        let ctrl = admin.ctrl.clone().unwrap();

        // A discovery controller that asked for log change notices.
        let mut disc = QueueState::new(Arc::clone(r.target()), origin());
        let cd = ConnectData::new([7; 16], 0xFFFF, DISCOVERY_NQN, HOST);
        assert_eq!(
            status(disc.submit(&connect_sqe(0, false), cd.as_bytes())),
            Status::SUCCESS
        );
        let cc = FabricsCommand::PropertySet {
            size8: false,
            offset: property::CC,
            value: u64::from(Cc::enable_value()),
        }
        .encode(1);
        assert_eq!(status(disc.submit(&cc, &[])), Status::SUCCESS);
        let id = data(
            &mut disc,
            &build::identify(2, nvme_spec::command::cns::CONTROLLER, 0),
        );
        let id = IdentifyController::read_from_bytes(&id).unwrap();
        assert_ne!(
            id.oaes.get() & (1 << 31),
            0,
            "OAES: discovery log change notices"
        );
        let aec = build::set_features(
            3,
            features::ASYNC_EVENT_CONFIG,
            features::AEC_DISCOVERY_LOG_CHANGE,
        );
        assert!(answer(&mut disc, &aec).status().is_success());
        let mut events = disc.events.take().unwrap();
        assert!(matches!(disc.submit(&aer(4), &[]), Submit::Held));
        let genctr = r.target().discovery_genctr();

        let changes = r
            .edit(|c| {
                c.subsystems[0].hosts.retain(|h| h != HOST);
                Ok(())
            })
            .unwrap();
        assert!(
            changes.iter().any(|c| c.contains("host no longer allowed")),
            "{changes:?}"
        );
        assert!(ctrl.is_torn_down());
        assert!(!r.target().subsystem(NQN).unwrap().host_allowed(HOST));
        let cqe = events.try_recv().expect("discovery log change notice");
        let dlpc = aer_dw0(
            aer_type::NOTICE,
            aer_notice::DISCOVERY_LOG_CHANGE,
            log_id::DISCOVERY,
        );
        assert_eq!(cqe.dw0.get(), dlpc);
        assert!(r.target().discovery_genctr() > genctr);
        r.running().shutdown().await;
    }
}
