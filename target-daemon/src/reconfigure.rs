//! Changes to a running target. Every change, from the control socket ([`crate::control`]) or
//! from a reloaded configuration file (SIGHUP), is a whole new [`Config`] that
//! [`Registry::apply`] compares with the running one and applies entirely or not at all:
//!
//! 1. validate: the new configuration must pass [`Config::validate`]; the `[target]`
//!    settings, a subsystem's serial and model and a namespace's UUID change only at a
//!    restart; a namespace whose backend changes other than in size gets the new
//!    backend under the same NSID (the old one goes as a removed namespace's does);
//! 2. prepare, the steps that can fail: bind the new listeners, open the new namespaces'
//!    backends, grow the resized files. A failure drops what was prepared and changes
//!    nothing;
//! 3. commit, which cannot fail: swap the listener, subsystem, host and namespace tables,
//!    then tell the hosts: a Namespace Attribute Notice (and the Changed Namespace List) on
//!    every controller of a subsystem whose namespaces changed, a disconnect for the
//!    controllers of a host no longer allowed or of a removed subsystem, and a Discovery Log
//!    Page Change notice on every discovery controller when the discovery log changed.
//!
//! A command already running on a namespace that is removed holds the namespace's backend
//! and completes normally; the commands that follow fail with Invalid Namespace. A removed
//! namespace's backend is flushed, then closed when its last command completes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use blockdev::{Backend, BackendSpec};
use parking_lot::Mutex;
use serde_json::{Value, json};
use tracing::{info, warn};

use crate::ana::AnaTable;
use crate::config::{
    Config, ConfigError, ListenAddr, ListenerConfig, NamespaceConfig, SubsystemConfig,
    TargetSettings, parse_uuid, write_private,
};
use crate::launcher::RunningTarget;
use crate::subsystem::{HostAccess, Namespace, NamespaceMap, Subsystem};
use crate::target::{
    Listeners, StartError, Target, bind_listener, log_namespace_ready, open_backend,
};

/// Why a change was refused. Nothing changed.
#[derive(Debug, thiserror::Error)]
pub enum ChangeError {
    /// The resulting configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A backend could not be opened or a listener bound.
    #[error(transparent)]
    Start(#[from] StartError),
    /// The change is not possible on a running target, or names something that does not
    /// exist.
    #[error("{0}")]
    Refused(String),
}

/// A [`ChangeError::Refused`] with `msg`.
pub fn refused<T>(msg: impl Into<String>) -> Result<T, ChangeError> {
    Err(ChangeError::Refused(msg.into()))
}

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
    /// running ones may come from flags): every change applied through [`Registry::edit`] is
    /// written back to it (see [`write_private`]), the previous version kept as `FILE.bak`,
    /// so that a restart runs what ran.
    pub persist: Option<(PathBuf, TargetSettings)>,
    /// The only directory [`Registry::save`] writes to; `None`: saving is off.
    pub save_dir: Option<PathBuf>,
}

/// What changes in one existing subsystem.
struct SubsystemPlan {
    sub: Arc<Subsystem>,
    access: Option<HostAccess>,
    namespaces: Option<NamespaceMap>,
    changed_nsids: Vec<u32>,
    /// Of `changed_nsids`, those whose hosts alone changed (the same backend, shown to
    /// other hosts).
    masked: Vec<u32>,
    removed: Vec<Arc<Namespace>>,
}

/// The new capacity when `new` is `old` with another size, the only backend change a running
/// namespace takes.
fn resized_to(old: &BackendSpec, new: &BackendSpec) -> Option<u64> {
    match (old, new) {
        (
            BackendSpec::Null { block_size: a, .. },
            BackendSpec::Null {
                size,
                block_size: b,
            },
        )
        | (
            BackendSpec::Memory { block_size: a, .. },
            BackendSpec::Memory {
                size,
                block_size: b,
            },
        ) if a == b => Some(*size),
        (BackendSpec::File(o), BackendSpec::File(n)) => {
            let mut same = o.clone();
            same.create_size = n.create_size;
            if same == *n { n.create_size } else { None }
        }
        _ => None,
    }
}

/// The addresses in `a` that are not in `b`.
fn missing(a: &[ListenAddr], b: &[ListenAddr]) -> Vec<ListenAddr> {
    a.iter().filter(|x| !b.contains(x)).cloned().collect()
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

    /// Applies the running configuration as changed by `edit`, then writes it to the
    /// configuration file the target started from, if any ([`ConfigFiles::persist`]). Returns
    /// what changed, one line each (and a warning line when the file could not be written:
    /// the change runs all the same).
    pub fn edit(
        &self,
        edit: impl FnOnce(&mut Config) -> Result<(), ChangeError>,
    ) -> Result<Vec<String>, ChangeError> {
        let mut cur = self.config.lock();
        let mut new = cur.clone();
        edit(&mut new)?;
        let mut changes = self.apply_to(&mut cur, new)?;
        if let Some((path, settings)) = &self.files.persist
            && !changes.is_empty()
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
                    changes.push(line);
                }
            }
        }
        Ok(changes)
    }

    /// Makes the target run `new` (see the module documentation). Returns what changed, one
    /// line each; on an error nothing changed.
    pub fn apply(&self, new: Config) -> Result<Vec<String>, ChangeError> {
        let mut cur = self.config.lock();
        self.apply_to(&mut cur, new)
    }

    fn apply_to(&self, cur: &mut Config, new: Config) -> Result<Vec<String>, ChangeError> {
        let mut new = new.with_explicit_nsids();
        new.validate()?;
        if new.target != cur.target {
            return refused(format!(
                "[target] settings change only at a restart: {} changed",
                changed_settings(&cur.target, &new.target).join(", ")
            ));
        }
        let mut changes = Vec::new();
        let target = self.target();

        // Listeners.
        let old_io: Vec<ListenAddr> = cur.listeners.iter().map(|l| l.address.clone()).collect();
        let new_io: Vec<ListenAddr> = new.listeners.iter().map(|l| l.address.clone()).collect();
        let old_disc = cur.discovery.listen.clone();
        let new_disc = new.discovery.listen.clone();
        let gone: Vec<ListenAddr> = missing(&old_io, &new_io)
            .into_iter()
            .chain(missing(&old_disc, &new_disc))
            .collect();
        let added: Vec<ListenAddr> = missing(&new_io, &old_io)
            .into_iter()
            .chain(missing(&new_disc, &old_disc))
            .collect();
        if let Some(a) = added.iter().find(|a| gone.contains(a)) {
            return refused(format!(
                "{a} cannot be an I/O and a discovery listener at once"
            ));
        }

        // Subsystems: what to build, change and remove.
        let live = target.subsystems();
        let old_subs: BTreeMap<&str, &SubsystemConfig> =
            cur.subsystems.iter().map(|s| (s.nqn.as_str(), s)).collect();
        let mut new_subs = Vec::new();
        let mut plans = Vec::new();
        let mut resizes = Vec::new();
        for s in &new.subsystems {
            let Some(o) = old_subs.get(s.nqn.as_str()) else {
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
                new_subs.push(Arc::new(Subsystem::new(s, backends)));
                changes.push(format!("added subsystem {}", s.nqn));
                continue;
            };
            let Some(sub) = live.get(&s.nqn) else {
                return refused(format!("subsystem {} is not running", s.nqn));
            };
            if o.serial != s.serial || o.model != s.model {
                return refused(format!(
                    "subsystem {}: serial and model change only at a restart",
                    s.nqn
                ));
            }
            if (o.cntlid_min, o.cntlid_max) != (s.cntlid_min, s.cntlid_max) {
                return refused(format!(
                    "subsystem {}: cntlid_min and cntlid_max change only at a restart",
                    s.nqn
                ));
            }
            let mut plan = SubsystemPlan {
                sub: Arc::clone(sub),
                access: None,
                namespaces: None,
                changed_nsids: Vec::new(),
                masked: Vec::new(),
                removed: Vec::new(),
            };
            if (o.allow_any_host, &o.hosts, &o.auth_hosts)
                != (s.allow_any_host, &s.hosts, &s.auth_hosts)
            {
                for h in s.hosts.iter().filter(|h| !o.hosts.contains(h)) {
                    changes.push(format!("subsystem {}: allowed host {h}", s.nqn));
                }
                for h in o.hosts.iter().filter(|h| !s.hosts.contains(h)) {
                    changes.push(format!("subsystem {}: no longer allowed host {h}", s.nqn));
                }
                if o.allow_any_host != s.allow_any_host {
                    changes.push(format!(
                        "subsystem {}: allow_any_host = {}",
                        s.nqn, s.allow_any_host
                    ));
                }
                for h in &s.auth_hosts {
                    match o.auth_hosts.iter().find(|a| a.nqn == h.nqn) {
                        None => changes.push(format!(
                            "subsystem {}: allowed host {} (with keys)",
                            s.nqn, h.nqn
                        )),
                        Some(a) if a != h => changes
                            .push(format!("subsystem {}: new keys for host {}", s.nqn, h.nqn)),
                        Some(_) => {}
                    }
                }
                for a in o
                    .auth_hosts
                    .iter()
                    .filter(|a| !s.auth_hosts.iter().any(|h| h.nqn == a.nqn))
                {
                    changes.push(format!(
                        "subsystem {}: no longer allowed host {} (with keys)",
                        s.nqn, a.nqn
                    ));
                }
                plan.access = Some(HostAccess::from_config(s));
            }
            let old_ns: BTreeMap<u32, _> = o.nsids().zip(&o.namespaces).collect();
            let current = sub.namespaces();
            let mut map = NamespaceMap::new();
            for (id, n) in s.nsids().zip(&s.namespaces) {
                match old_ns.get(&id) {
                    Some(on) if *on == n => {
                        if let Some(ns) = current.get(&id) {
                            map.insert(id, Arc::clone(ns));
                        }
                    }
                    Some(on) => {
                        if on.uuid != n.uuid {
                            return refused(format!(
                                "subsystem {} namespace {id}: namespace UUIDs change only at a \
                                 restart",
                                s.nqn
                            ));
                        }
                        if on.ana_group != n.ana_group {
                            return refused(format!(
                                "subsystem {} namespace {id}: ANA groups change only at a \
                                 restart",
                                s.nqn
                            ));
                        }
                        if let Some(m) = masking_change(on, n) {
                            let Some(ns) = current.get(&id) else {
                                return refused(format!(
                                    "subsystem {} namespace {id} is not running",
                                    s.nqn
                                ));
                            };
                            map.insert(id, Arc::new(ns.with_hosts(n.hosts.clone())));
                            plan.changed_nsids.push(id);
                            plan.masked.push(id);
                            changes.push(format!("subsystem {}: namespace {id} {m}", s.nqn));
                            continue;
                        }
                        if let Some(size) = resized_to(&on.backend, &n.backend) {
                            resizes.push((plans.len(), id, size, n.clone()));
                            plan.changed_nsids.push(id);
                            continue;
                        }
                        // Another backend under the same NSID: the old one goes as a removed
                        // namespace does, the new one is opened first.
                        if let (
                            BackendSpec::File(a) | BackendSpec::Bdev(a),
                            BackendSpec::File(b) | BackendSpec::Bdev(b),
                        ) = (&on.backend, &n.backend)
                            && a.path == b.path
                        {
                            return refused(format!(
                                "subsystem {} namespace {id}: {} cannot become {} while it \
                                 serves the same file; other options of a served file change \
                                 only at a restart (or remove the namespace and add it again)",
                                s.nqn, on.backend, n.backend
                            ));
                        }
                        let backend = open_backend(&s.nqn, id, &n.backend)?;
                        let uuid = n.uuid.as_deref().and_then(parse_uuid);
                        let ns = Namespace::new(&s.nqn, id, backend, uuid, n.backend.to_string())
                            .configured(n);
                        map.insert(id, Arc::new(ns));
                        plan.changed_nsids.push(id);
                        plan.removed.extend(current.get(&id).cloned());
                        changes.push(format!(
                            "subsystem {}: namespace {id} is now {} (was {})",
                            s.nqn, n.backend, on.backend
                        ));
                    }
                    None => {
                        let backend = open_backend(&s.nqn, id, &n.backend)?;
                        let uuid = n.uuid.as_deref().and_then(parse_uuid);
                        let ns = Namespace::new(&s.nqn, id, backend, uuid, n.backend.to_string())
                            .configured(n);
                        map.insert(id, Arc::new(ns));
                        plan.changed_nsids.push(id);
                        changes.push(format!(
                            "subsystem {}: added namespace {id} ({})",
                            s.nqn, n.backend
                        ));
                    }
                }
            }
            for (id, on) in &old_ns {
                if !s.nsids().any(|n| n == *id) {
                    plan.changed_nsids.push(*id);
                    plan.removed.extend(current.get(id).cloned());
                    changes.push(format!(
                        "subsystem {}: removed namespace {id} ({})",
                        s.nqn, on.backend
                    ));
                }
            }
            if !plan.changed_nsids.is_empty() {
                plan.namespaces = Some(map);
            }
            if plan.access.is_some() || plan.namespaces.is_some() {
                plans.push(plan);
            }
        }
        let removed_subs: Vec<Arc<Subsystem>> = cur
            .subsystems
            .iter()
            .filter(|o| !new.subsystems.iter().any(|s| s.nqn == o.nqn))
            .filter_map(|o| live.get(&o.nqn).cloned())
            .collect();

        // Prepare what can fail, last the resizes, which change files.
        let mut bound = Vec::new();
        for a in &added {
            bound.push(bind_listener(a)?);
        }
        for (plan, id, size, n) in resizes {
            let p: &mut SubsystemPlan = &mut plans[plan];
            let old = p.sub.namespaces().get(&id).cloned();
            let Some(old) = old else {
                return refused(format!(
                    "subsystem {} namespace {id} is not running",
                    p.sub.nqn
                ));
            };
            let backend = old
                .backend
                .resized(size)
                .map_err(|source| StartError::Backend {
                    nqn: p.sub.nqn.clone(),
                    nsid: id,
                    source,
                })?;
            let uuid = Some(old.uuid);
            let desc = n.backend.to_string();
            let ns = Namespace::new(&p.sub.nqn, id, Arc::new(backend), uuid, desc).configured(&n);
            changes.push(format!(
                "subsystem {}: resized namespace {id} from {} to {} blocks",
                p.sub.nqn, old.blocks, ns.blocks
            ));
            if let Some(m) = &mut p.namespaces {
                m.insert(id, Arc::new(ns));
            }
        }

        // Commit.
        for a in &gone {
            self.running.stop_listener(a);
            changes.push(format!("stopped listening on {a}"));
        }
        let mut bound_addr = BTreeMap::new();
        for (requested, l) in added.iter().map(ToString::to_string).zip(bound) {
            let addr = l.addr.clone();
            if let Err(e) = self.running.start_listener(l) {
                warn!(listener = %addr, error = %e, "cannot accept");
            }
            changes.push(format!("listening on {addr}"));
            bound_addr.insert(requested, addr);
        }
        let as_bound = |a: &mut ListenAddr| {
            if let Some(b) = bound_addr.get(&a.to_string()) {
                *a = b.clone();
            }
        };
        new.listeners
            .iter_mut()
            .for_each(|l| as_bound(&mut l.address));
        new.discovery.listen.iter_mut().for_each(as_bound);
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

        let mut map = (*live).clone();
        for s in &removed_subs {
            map.remove(&s.nqn);
            changes.push(format!("removed subsystem {}", s.nqn));
        }
        for s in &new_subs {
            for ns in s.namespaces().values() {
                log_namespace_ready(&s.nqn, ns);
            }
            map.insert(s.nqn.clone(), Arc::clone(s));
        }
        target.set_subsystems(map);
        let mut discovery_changed = !new_subs.is_empty()
            || !removed_subs.is_empty()
            || missing(&old_io, &new_io).len() + missing(&new_io, &old_io).len() > 0;
        for p in &plans {
            if let Some(access) = &p.access {
                p.sub.set_access(access.clone());
                discovery_changed = true;
                for c in p.sub.controllers() {
                    if !access.allows(&c.hostnqn) && c.tear_down() {
                        changes.push(format!(
                            "subsystem {}: disconnected controller {} of {} ({}): host no longer allowed",
                            p.sub.nqn, c.cntlid, c.hostnqn, c.peer
                        ));
                    }
                }
            }
            if let Some(namespaces) = &p.namespaces {
                for ns in namespaces.values() {
                    if p.changed_nsids.contains(&ns.nsid) && !p.masked.contains(&ns.nsid) {
                        log_namespace_ready(&p.sub.nqn, ns);
                    }
                }
                let before = p.sub.namespaces();
                p.sub.set_namespaces(namespaces.clone());
                for c in p.sub.controllers() {
                    // A host is told of the namespaces it saw or sees now; of a change of
                    // who sees a namespace, only if it is one of them.
                    let seen = |m: &NamespaceMap, id: &u32| {
                        m.get(id).is_some_and(|ns| ns.visible_to(&c.hostnqn))
                    };
                    let nsids: Vec<u32> = p
                        .changed_nsids
                        .iter()
                        .filter(|id| {
                            let (was, is) = (seen(&before, id), seen(namespaces, id));
                            if p.masked.contains(id) {
                                was != is
                            } else {
                                was || is
                            }
                        })
                        .copied()
                        .collect();
                    if !nsids.is_empty() {
                        c.notify_namespaces_changed(&nsids);
                    }
                }
                flush_removed(p.removed.clone());
            }
        }
        for s in &removed_subs {
            for c in s.controllers() {
                c.tear_down();
            }
            flush_removed(s.namespaces().values().cloned().collect());
        }
        changes.extend(apply_ana(target, &cur.listeners, &new.listeners));
        if discovery_changed {
            target.discovery_changed();
        }
        *cur = new;
        for c in &changes {
            info!("{c}");
        }
        Ok(changes)
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

/// What a namespace's change is, when only the hosts that see it change: the line that
/// says so.
fn masking_change(old: &NamespaceConfig, new: &NamespaceConfig) -> Option<String> {
    let mut same = old.clone();
    same.hosts = new.hosts.clone();
    if same != *new {
        return None;
    }
    Some(if new.hosts.is_empty() {
        "is now seen by every host".into()
    } else {
        format!("is now seen by {} only", new.hosts.join(", "))
    })
}

/// Makes the target run the ANA states of the listeners `new` (see [`crate::ana`]): the
/// controllers connected through a listener where a group of their namespaces changes state
/// get an ANA Change notice. Returns what changed, one line each.
fn apply_ana(target: &Target, old: &[ListenerConfig], new: &[ListenerConfig]) -> Vec<String> {
    let table = AnaTable::from_listeners(new);
    if *target.ana.table() == table {
        return Vec::new();
    }
    let mut changes = Vec::new();
    for l in new {
        let before = old.iter().find(|o| o.address == l.address);
        let groups = l.ana.iter().map(|a| a.group).chain(
            before
                .into_iter()
                .flat_map(|o| o.ana.iter().map(|a| a.group)),
        );
        let mut groups: Vec<u32> = groups.collect();
        groups.sort_unstable();
        groups.dedup();
        let state = |ls: &ListenerConfig, g: u32| {
            ls.ana
                .iter()
                .find(|a| a.group == g)
                .map(|a| a.state)
                .unwrap_or_default()
        };
        for g in groups {
            let was = before.map(|o| state(o, g)).unwrap_or_default();
            let now = state(l, g);
            if was != now {
                changes.push(format!(
                    "listener {}: ANA group {g} is now {now} (was {was})",
                    l.address
                ));
            }
        }
    }
    let old = target.ana.replace(table);
    let table = target.ana.table();
    for s in target.subsystems().values() {
        for c in s.controllers() {
            if old.differs_at(&table, c.local, c.ana_groups().into_iter()) {
                c.notify_ana_changed();
            }
        }
    }
    changes
}

/// The names of the `[target]` settings that differ between `a` and `b`.
fn changed_settings(a: &TargetSettings, b: &TargetSettings) -> Vec<String> {
    let (Ok(Value::Object(a)), Ok(Value::Object(b))) =
        (serde_json::to_value(a), serde_json::to_value(b))
    else {
        return vec!["[target]".into()];
    };
    let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .filter(|k| a.get(*k) != b.get(*k))
        .cloned()
        .collect()
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
