//! The change plan: the vocabulary of changes to a running target ([`Change`]), what each
//! does to a configuration ([`Change::apply`]), and [`plan`], which turns two configurations
//! into the changes between them. Everything here is pure: no backend is opened and no socket
//! bound, so a plan is tested on pairs of TOML texts. [`crate::reconfigure`] carries a plan
//! out on a running target (prepare, then commit); a control request
//! ([`crate::control::Request`]) is one change, a SIGHUP reload is `plan(running, file)`.

use std::collections::BTreeMap;

use blockdev::BackendSpec;
use nvme_spec::log::AnaState;
use serde_json::Value;

use crate::config::{
    AnaGroupState, Config, ConfigError, HostAuthConfig, ListenAddr, ListenerConfig,
    NamespaceConfig, SubsystemConfig, TargetSettings, TlsRequirement,
};
use crate::target::StartError;

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

/// An allowed host of a subsystem: its NQN, with keys when it must authenticate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Host {
    /// Allowed by NQN alone (`hosts`).
    Plain(String),
    /// Allowed with keys (a `[[subsystem.host]]` table).
    Keyed(HostAuthConfig),
}

impl Host {
    /// The host's NQN.
    pub fn nqn(&self) -> &str {
        match self {
            Host::Plain(n) => n,
            Host::Keyed(h) => &h.nqn,
        }
    }
}

/// One change to a running target. A change names what it changes (subsystem NQN, NSID,
/// host NQN, address) and carries the new state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    /// A new subsystem, with its namespaces.
    AddSubsystem(SubsystemConfig),
    /// A subsystem goes; its controllers are disconnected.
    RemoveSubsystem {
        /// Its NQN.
        nqn: String,
    },
    /// A subsystem starts or stops admitting any host.
    AllowAnyHost {
        /// Subsystem NQN.
        subsystem: String,
        /// Whether any host may connect.
        allow: bool,
    },
    /// A host is allowed.
    AddHost {
        /// Subsystem NQN.
        subsystem: String,
        /// The host.
        host: Host,
    },
    /// An allowed host gets other keys (or none); its connected controllers stay.
    SetHostKeys {
        /// Subsystem NQN.
        subsystem: String,
        /// The host with its new keys.
        host: Host,
    },
    /// A host is no longer allowed; its controllers are disconnected.
    RemoveHost {
        /// Subsystem NQN.
        subsystem: String,
        /// Host NQN.
        host: String,
    },
    /// A new namespace (its NSID given).
    AddNamespace {
        /// Subsystem NQN.
        subsystem: String,
        /// The namespace.
        namespace: NamespaceConfig,
    },
    /// A namespace goes.
    RemoveNamespace {
        /// Subsystem NQN.
        subsystem: String,
        /// NSID.
        nsid: u32,
    },
    /// A namespace's backend gets another size.
    ResizeNamespace {
        /// Subsystem NQN.
        subsystem: String,
        /// NSID.
        nsid: u32,
        /// New size in bytes.
        size: u64,
    },
    /// A namespace is served by another backend under the same NSID and UUID.
    ReplaceBackend {
        /// Subsystem NQN.
        subsystem: String,
        /// NSID.
        nsid: u32,
        /// The new backend.
        backend: BackendSpec,
    },
    /// The target starts listening on an address.
    AddListener {
        /// The listener.
        listener: ListenerConfig,
        /// A dedicated discovery listener (else an I/O listener).
        discovery: bool,
    },
    /// An I/O listener starts or stops requiring TLS (it is not bound again).
    SetListenerTls {
        /// Its address.
        address: ListenAddr,
        /// The new requirement.
        tls: Option<TlsRequirement>,
    },
    /// The target stops listening on an address; connections it accepted stay.
    RemoveListener {
        /// Its address.
        address: ListenAddr,
        /// A dedicated discovery listener (else an I/O listener).
        discovery: bool,
    },
    /// A namespace is shown to one more host by name (a namespace that names no host is
    /// seen by every host; one that names hosts, by them only). Hosts whose view changes
    /// are told.
    AddNamespaceHost {
        /// Subsystem NQN.
        subsystem: String,
        /// NSID.
        nsid: u32,
        /// Host NQN.
        host: String,
    },
    /// A host named by a namespace is no longer; the namespace is seen by the hosts it
    /// still names (by every host when it names none).
    RemoveNamespaceHost {
        /// Subsystem NQN.
        subsystem: String,
        /// NSID.
        nsid: u32,
        /// Host NQN.
        host: String,
    },
    /// An ANA group gets another state on an I/O listener; controllers connected through it
    /// that have a namespace in the group are told.
    SetAnaState {
        /// The listener's address.
        address: ListenAddr,
        /// ANA group ID.
        group: u32,
        /// The new state (optimized: the group is no longer named on the listener).
        state: AnaState,
    },
    /// The discovery log refers hosts to one more discovery controller.
    AddReferral {
        /// Its address.
        address: ListenAddr,
    },
    /// The discovery log no longer refers hosts to a discovery controller.
    RemoveReferral {
        /// Its address.
        address: ListenAddr,
    },
}

fn subsystem<'a>(cfg: &'a mut Config, nqn: &str) -> Result<&'a mut SubsystemConfig, ChangeError> {
    match cfg.subsystems.iter_mut().find(|s| s.nqn == nqn) {
        Some(s) => Ok(s),
        None => refused(format!("no subsystem {nqn}")),
    }
}

/// The place of namespace `nsid` in `s`'s list.
fn namespace(s: &SubsystemConfig, nsid: u32) -> Result<usize, ChangeError> {
    match s.nsids().position(|id| id == nsid) {
        Some(i) => Ok(i),
        None => refused(format!("subsystem {} has no namespace {nsid}", s.nqn)),
    }
}

/// The namespace `nsid` of subsystem `nqn` in `cfg`.
fn namespace_mut<'a>(
    cfg: &'a mut Config,
    nqn: &str,
    nsid: u32,
) -> Result<&'a mut NamespaceConfig, ChangeError> {
    let s = subsystem(cfg, nqn)?;
    let i = namespace(s, nsid)?;
    Ok(&mut s.namespaces[i])
}

/// The state of ANA group `group` on listener `l` (optimized where it names none).
pub fn ana_state(l: &ListenerConfig, group: u32) -> AnaState {
    l.ana
        .iter()
        .find(|a| a.group == group)
        .map(|a| a.state)
        .unwrap_or_default()
}

fn is_allowed(s: &SubsystemConfig, host: &str) -> bool {
    s.hosts.iter().any(|h| h == host) || s.auth_hosts.iter().any(|h| h.nqn == host)
}

fn put_host(s: &mut SubsystemConfig, host: &Host) {
    s.hosts.retain(|h| h != host.nqn());
    s.auth_hosts.retain(|h| h.nqn != host.nqn());
    match host {
        Host::Plain(n) => s.hosts.push(n.clone()),
        Host::Keyed(h) => s.auth_hosts.push(h.clone()),
    }
}

impl Change {
    /// Makes `cfg` what it is after this change. Refuses a change that names something
    /// missing or adds something present; the result is validated as a whole by the caller.
    pub fn apply(&self, cfg: &mut Config) -> Result<(), ChangeError> {
        match self {
            Change::AddSubsystem(s) => {
                if cfg.subsystems.iter().any(|o| o.nqn == s.nqn) {
                    return refused(format!("subsystem {} exists already", s.nqn));
                }
                cfg.subsystems.push(s.clone());
            }
            Change::RemoveSubsystem { nqn } => {
                subsystem(cfg, nqn)?;
                cfg.subsystems.retain(|s| &s.nqn != nqn);
            }
            Change::AllowAnyHost {
                subsystem: nqn,
                allow,
            } => {
                subsystem(cfg, nqn)?.allow_any_host = *allow;
            }
            Change::AddHost {
                subsystem: nqn,
                host,
            } => {
                let s = subsystem(cfg, nqn)?;
                if is_allowed(s, host.nqn()) {
                    return refused(format!(
                        "host {} is already allowed on {nqn} (--replace changes its keys)",
                        host.nqn()
                    ));
                }
                put_host(s, host);
            }
            Change::SetHostKeys {
                subsystem: nqn,
                host,
            } => {
                let s = subsystem(cfg, nqn)?;
                if !is_allowed(s, host.nqn()) {
                    return refused(format!(
                        "host {} is not on the allowed list of {nqn}",
                        host.nqn()
                    ));
                }
                put_host(s, host);
            }
            Change::RemoveHost {
                subsystem: nqn,
                host,
            } => {
                let s = subsystem(cfg, nqn)?;
                if !is_allowed(s, host) {
                    return refused(format!("host {host} is not on the allowed list of {nqn}"));
                }
                s.hosts.retain(|h| h != host);
                s.auth_hosts.retain(|h| h.nqn != *host);
            }
            Change::AddNamespace {
                subsystem: nqn,
                namespace: ns,
            } => {
                let s = subsystem(cfg, nqn)?;
                let nsid = ns.nsid.unwrap_or(0);
                if s.nsids().any(|id| id == nsid) {
                    return refused(format!("subsystem {nqn} already has namespace {nsid}"));
                }
                s.namespaces.push(ns.clone());
            }
            Change::RemoveNamespace {
                subsystem: nqn,
                nsid,
            } => {
                let s = subsystem(cfg, nqn)?;
                let i = namespace(s, *nsid)?;
                s.namespaces.remove(i);
            }
            Change::ResizeNamespace {
                subsystem: nqn,
                nsid,
                size: bytes,
            } => {
                let s = subsystem(cfg, nqn)?;
                let i = namespace(s, *nsid)?;
                match &mut s.namespaces[i].backend {
                    BackendSpec::Null { size, .. } | BackendSpec::Memory { size, .. } => {
                        *size = *bytes
                    }
                    BackendSpec::File(f) => f.create_size = Some(*bytes),
                    other => {
                        return refused(format!(
                            "{other}: only null and file namespaces can be resized"
                        ));
                    }
                }
            }
            Change::ReplaceBackend {
                subsystem: nqn,
                nsid,
                backend,
            } => {
                let s = subsystem(cfg, nqn)?;
                let i = namespace(s, *nsid)?;
                s.namespaces[i].backend = backend.clone();
            }
            Change::AddListener {
                listener,
                discovery,
            } => {
                let a = &listener.address;
                let io = cfg.listeners.iter().map(|l| &l.address);
                if io.chain(&cfg.discovery.listen).any(|l| l == a) {
                    return refused(format!("already listening on {a}"));
                }
                if *discovery {
                    cfg.discovery.listen.push(a.clone());
                } else {
                    cfg.listeners.push(listener.clone());
                }
            }
            Change::SetListenerTls { address, tls } => {
                match cfg.listeners.iter_mut().find(|l| l.address == *address) {
                    Some(l) => l.tls = *tls,
                    None => return refused(format!("no listener on {address}")),
                }
            }
            Change::RemoveListener { address, discovery } => {
                let before = cfg.listeners.len() + cfg.discovery.listen.len();
                if *discovery {
                    cfg.discovery.listen.retain(|l| l != address);
                } else {
                    cfg.listeners.retain(|l| l.address != *address);
                }
                if cfg.listeners.len() + cfg.discovery.listen.len() == before {
                    return refused(format!(
                        "no {}listener on {address}",
                        if *discovery { "discovery " } else { "" }
                    ));
                }
            }
            Change::AddNamespaceHost {
                subsystem: nqn,
                nsid,
                host,
            } => {
                let hosts = &mut namespace_mut(cfg, nqn, *nsid)?.hosts;
                if hosts.contains(host) {
                    return refused(format!(
                        "namespace {nsid} of {nqn} is already shown to {host}"
                    ));
                }
                hosts.push(host.clone());
            }
            Change::RemoveNamespaceHost {
                subsystem: nqn,
                nsid,
                host,
            } => {
                let hosts = &mut namespace_mut(cfg, nqn, *nsid)?.hosts;
                if !hosts.contains(host) {
                    return refused(format!(
                        "namespace {nsid} of {nqn} is not shown to {host} by name (its hosts: {})",
                        if hosts.is_empty() {
                            "every host".to_string()
                        } else {
                            hosts.join(", ")
                        }
                    ));
                }
                hosts.retain(|h| h != host);
            }
            Change::SetAnaState {
                address,
                group,
                state,
            } => {
                let Some(l) = cfg.listeners.iter_mut().find(|l| l.address == *address) else {
                    let io: Vec<String> = cfg
                        .listeners
                        .iter()
                        .map(|l| l.address.to_string())
                        .collect();
                    return refused(format!(
                        "no I/O listener on {address} (listeners: {})",
                        io.join(", ")
                    ));
                };
                l.ana.retain(|a| a.group != *group);
                if *state != AnaState::Optimized {
                    l.ana.push(AnaGroupState {
                        group: *group,
                        state: *state,
                    });
                    l.ana.sort_by_key(|a| a.group);
                }
            }
            Change::AddReferral { address } => {
                if cfg.discovery.referrals.contains(address) {
                    return refused(format!("a referral to {address} exists already"));
                }
                cfg.discovery.referrals.push(address.clone());
            }
            Change::RemoveReferral { address } => {
                if !cfg.discovery.referrals.contains(address) {
                    return refused(format!("no referral to {address}"));
                }
                cfg.discovery.referrals.retain(|r| r != address);
            }
        }
        Ok(())
    }

    /// Whether `cfg` is already what this change makes it: an added object present as the
    /// change describes it, a removed one absent (its subsystem present), a size or keys
    /// already set. A retried request is answered without changing anything again.
    pub fn in_effect(&self, cfg: &Config) -> bool {
        let sub = |nqn: &str| cfg.subsystems.iter().find(|s| s.nqn == nqn);
        let ns = |nqn: &str, nsid: u32| {
            sub(nqn).and_then(|s| s.nsids().zip(&s.namespaces).find(|(id, _)| *id == nsid))
        };
        match self {
            Change::AddSubsystem(s) => sub(&s.nqn).is_some_and(|o| {
                (&o.serial, &o.model, o.allow_any_host, &o.hosts)
                    == (&s.serial, &s.model, s.allow_any_host, &s.hosts)
            }),
            Change::RemoveSubsystem { nqn } => sub(nqn).is_none(),
            Change::AllowAnyHost { subsystem, allow } => {
                sub(subsystem).is_some_and(|s| s.allow_any_host == *allow)
            }
            Change::AddHost { subsystem, host } | Change::SetHostKeys { subsystem, host } => {
                sub(subsystem).is_some_and(|s| hosts(s).get(host.nqn()) == Some(host))
            }
            Change::RemoveHost { subsystem, host } => {
                sub(subsystem).is_some_and(|s| !is_allowed(s, host))
            }
            Change::AddNamespace {
                subsystem,
                namespace,
            } => ns(subsystem, namespace.nsid.unwrap_or(0)).is_some_and(|(_, n)| {
                (&n.backend, &n.uuid, &n.hosts, n.ana_group)
                    == (
                        &namespace.backend,
                        &namespace.uuid,
                        &namespace.hosts,
                        namespace.ana_group,
                    )
            }),
            Change::RemoveNamespace { subsystem, nsid } => {
                sub(subsystem).is_some() && ns(subsystem, *nsid).is_none()
            }
            Change::ResizeNamespace {
                subsystem,
                nsid,
                size,
            } => ns(subsystem, *nsid).is_some_and(|(_, n)| match &n.backend {
                BackendSpec::Null { size: s, .. } | BackendSpec::Memory { size: s, .. } => {
                    s == size
                }
                BackendSpec::File(f) => f.create_size == Some(*size),
                _ => false,
            }),
            Change::ReplaceBackend {
                subsystem,
                nsid,
                backend,
            } => ns(subsystem, *nsid).is_some_and(|(_, n)| n.backend == *backend),
            Change::AddListener {
                listener,
                discovery,
            } => match discovery {
                true => cfg.discovery.listen.contains(&listener.address),
                false => cfg.listeners.contains(listener),
            },
            Change::SetListenerTls { address, tls } => cfg
                .listeners
                .iter()
                .any(|l| l.address == *address && l.tls == *tls),
            Change::RemoveListener { address, discovery } => match discovery {
                true => !cfg.discovery.listen.contains(address),
                false => !cfg.listeners.iter().any(|l| l.address == *address),
            },
            Change::AddNamespaceHost {
                subsystem,
                nsid,
                host,
            } => ns(subsystem, *nsid).is_some_and(|(_, n)| n.hosts.contains(host)),
            Change::RemoveNamespaceHost {
                subsystem,
                nsid,
                host,
            } => ns(subsystem, *nsid).is_some_and(|(_, n)| !n.hosts.contains(host)),
            Change::SetAnaState {
                address,
                group,
                state,
            } => cfg
                .listeners
                .iter()
                .any(|l| l.address == *address && ana_state(l, *group) == *state),
            Change::AddReferral { address } => cfg.discovery.referrals.contains(address),
            Change::RemoveReferral { address } => !cfg.discovery.referrals.contains(address),
        }
    }

    /// The subsystem this change is about, if any.
    pub fn subsystem(&self) -> Option<&str> {
        match self {
            Change::AddSubsystem(s) => Some(&s.nqn),
            Change::RemoveSubsystem { nqn } => Some(nqn),
            Change::AllowAnyHost { subsystem, .. }
            | Change::AddHost { subsystem, .. }
            | Change::SetHostKeys { subsystem, .. }
            | Change::RemoveHost { subsystem, .. }
            | Change::AddNamespace { subsystem, .. }
            | Change::RemoveNamespace { subsystem, .. }
            | Change::ResizeNamespace { subsystem, .. }
            | Change::ReplaceBackend { subsystem, .. }
            | Change::AddNamespaceHost { subsystem, .. }
            | Change::RemoveNamespaceHost { subsystem, .. } => Some(subsystem),
            Change::AddListener { .. }
            | Change::SetListenerTls { .. }
            | Change::RemoveListener { .. }
            | Change::SetAnaState { .. }
            | Change::AddReferral { .. }
            | Change::RemoveReferral { .. } => None,
        }
    }
}

/// The new capacity when `new` is `old` with another size, the only backend change a running
/// namespace takes in place.
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

/// The allowed hosts of `s` by NQN.
fn hosts(s: &SubsystemConfig) -> BTreeMap<&str, Host> {
    let plain = s.hosts.iter().map(|h| (h.as_str(), Host::Plain(h.clone())));
    let keyed = s
        .auth_hosts
        .iter()
        .map(|h| (h.nqn.as_str(), Host::Keyed(h.clone())));
    plain.chain(keyed).collect()
}

/// The changes that make a target running `old` run `new`, in order: listeners, removed
/// subsystems, then each subsystem of `new` (added, or its hosts and namespaces changed).
/// Refuses what a running target cannot take: other `[target]` settings, another serial,
/// model, controller ID range, namespace UUID or ANA group, other options of a file that
/// stays served, an address that moves between I/O and discovery listeners. Both configurations are taken as valid
/// ([`Config::validate`]).
pub fn plan(old: &Config, new: &Config) -> Result<Vec<Change>, ChangeError> {
    let old = old.clone().with_explicit_nsids();
    let new = new.clone().with_explicit_nsids();
    if new.target != old.target {
        return refused(format!(
            "[target] settings change only at a restart: {} changed",
            changed_settings(&old.target, &new.target).join(", ")
        ));
    }
    if new.discovery.mdns != old.discovery.mdns {
        return refused("[discovery] mdns changes only at a restart");
    }
    let mut changes = Vec::new();

    // Listeners.
    let io = |cfg: &Config, a: &ListenAddr| cfg.listeners.iter().find(|l| l.address == *a).cloned();
    let moved = |a: &ListenAddr| {
        refused(format!(
            "{a} cannot be an I/O and a discovery listener at once"
        ))
    };
    for l in &old.listeners {
        match io(&new, &l.address) {
            None if new.discovery.listen.contains(&l.address) => return moved(&l.address),
            None => changes.push(Change::RemoveListener {
                address: l.address.clone(),
                discovery: false,
            }),
            Some(n) => {
                if n.tls != l.tls {
                    changes.push(Change::SetListenerTls {
                        address: l.address.clone(),
                        tls: n.tls,
                    });
                }
                let mut groups: Vec<u32> = l.ana.iter().chain(&n.ana).map(|a| a.group).collect();
                groups.sort_unstable();
                groups.dedup();
                for group in groups {
                    let state = ana_state(&n, group);
                    if ana_state(l, group) != state {
                        changes.push(Change::SetAnaState {
                            address: l.address.clone(),
                            group,
                            state,
                        });
                    }
                }
            }
        }
    }
    for a in &old.discovery.listen {
        if !new.discovery.listen.contains(a) {
            if io(&new, a).is_some() {
                return moved(a);
            }
            changes.push(Change::RemoveListener {
                address: a.clone(),
                discovery: true,
            });
        }
    }
    for l in &new.listeners {
        if io(&old, &l.address).is_none() {
            changes.push(Change::AddListener {
                listener: l.clone(),
                discovery: false,
            });
        }
    }
    for a in &new.discovery.listen {
        if !old.discovery.listen.contains(a) {
            changes.push(Change::AddListener {
                listener: ListenerConfig {
                    address: a.clone(),
                    tls: None,
                    ana: Vec::new(),
                },
                discovery: true,
            });
        }
    }

    // Referrals.
    for a in &old.discovery.referrals {
        if !new.discovery.referrals.contains(a) {
            changes.push(Change::RemoveReferral { address: a.clone() });
        }
    }
    for a in &new.discovery.referrals {
        if !old.discovery.referrals.contains(a) {
            changes.push(Change::AddReferral { address: a.clone() });
        }
    }

    // Subsystems.
    for o in &old.subsystems {
        if !new.subsystems.iter().any(|s| s.nqn == o.nqn) {
            changes.push(Change::RemoveSubsystem { nqn: o.nqn.clone() });
        }
    }
    for s in &new.subsystems {
        let Some(o) = old.subsystems.iter().find(|o| o.nqn == s.nqn) else {
            changes.push(Change::AddSubsystem(s.clone()));
            continue;
        };
        let nqn = &s.nqn;
        if o.serial != s.serial || o.model != s.model {
            return refused(format!(
                "subsystem {nqn}: serial and model change only at a restart"
            ));
        }
        if (o.cntlid_min, o.cntlid_max) != (s.cntlid_min, s.cntlid_max) {
            return refused(format!(
                "subsystem {nqn}: cntlid_min and cntlid_max change only at a restart"
            ));
        }
        let (old_hosts, new_hosts) = (hosts(o), hosts(s));
        for (h, host) in &new_hosts {
            let subsystem = nqn.clone();
            let host = host.clone();
            match old_hosts.get(h) {
                None => changes.push(Change::AddHost { subsystem, host }),
                Some(was) if *was != host => changes.push(Change::SetHostKeys { subsystem, host }),
                Some(_) => {}
            }
        }
        for h in old_hosts.keys().filter(|h| !new_hosts.contains_key(*h)) {
            changes.push(Change::RemoveHost {
                subsystem: nqn.clone(),
                host: h.to_string(),
            });
        }
        if o.allow_any_host != s.allow_any_host {
            changes.push(Change::AllowAnyHost {
                subsystem: nqn.clone(),
                allow: s.allow_any_host,
            });
        }
        let old_ns: BTreeMap<u32, &NamespaceConfig> = o.nsids().zip(&o.namespaces).collect();
        let new_ns: BTreeMap<u32, &NamespaceConfig> = s.nsids().zip(&s.namespaces).collect();
        for &nsid in old_ns.keys().filter(|id| !new_ns.contains_key(id)) {
            changes.push(Change::RemoveNamespace {
                subsystem: nqn.clone(),
                nsid,
            });
        }
        for (&nsid, &n) in &new_ns {
            let Some(&on) = old_ns.get(&nsid) else {
                changes.push(Change::AddNamespace {
                    subsystem: nqn.clone(),
                    namespace: n.clone(),
                });
                continue;
            };
            if on == n {
                continue;
            }
            if on.uuid != n.uuid {
                return refused(format!(
                    "subsystem {nqn} namespace {nsid}: namespace UUIDs change only at a restart"
                ));
            }
            if on.ana_group != n.ana_group {
                return refused(format!(
                    "subsystem {nqn} namespace {nsid}: ANA groups change only at a restart"
                ));
            }
            let mut rest = on.clone();
            (rest.backend, rest.hosts) = (n.backend.clone(), n.hosts.clone());
            if rest != *n {
                // Settings of a namespace other than its backend and hosts need a change
                // kind of their own; none reopens the backend.
                return refused(format!(
                    "subsystem {nqn} namespace {nsid}: only its backend and hosts change while \
                     it runs"
                ));
            }
            for host in n.hosts.iter().filter(|h| !on.hosts.contains(h)) {
                changes.push(Change::AddNamespaceHost {
                    subsystem: nqn.clone(),
                    nsid,
                    host: host.clone(),
                });
            }
            for host in on.hosts.iter().filter(|h| !n.hosts.contains(h)) {
                changes.push(Change::RemoveNamespaceHost {
                    subsystem: nqn.clone(),
                    nsid,
                    host: host.clone(),
                });
            }
            if on.backend == n.backend {
                continue;
            }
            if let Some(size) = resized_to(&on.backend, &n.backend) {
                changes.push(Change::ResizeNamespace {
                    subsystem: nqn.clone(),
                    nsid,
                    size,
                });
                continue;
            }
            if let (
                BackendSpec::File(a) | BackendSpec::Bdev(a),
                BackendSpec::File(b) | BackendSpec::Bdev(b),
            ) = (&on.backend, &n.backend)
                && a.path == b.path
            {
                return refused(format!(
                    "subsystem {nqn} namespace {nsid}: {} cannot become {} while it serves the \
                     same file; other options of a served file change only at a restart (or \
                     remove the namespace and add it again)",
                    on.backend, n.backend
                ));
            }
            changes.push(Change::ReplaceBackend {
                subsystem: nqn.clone(),
                nsid,
                backend: n.backend.clone(),
            });
        }
    }
    Ok(changes)
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = r#"
[[listener]]
address = "tcp://127.0.0.1:4420"

[discovery]
listen = ["tcp://127.0.0.1:8009"]

[[subsystem]]
nqn = "nqn.2026-11.io.test:a"
allow_any_host = false
hosts = ["nqn.2026-11.io.test:h1"]

[[subsystem.namespace]]
backend = "mem:1M"

[[subsystem.namespace]]
backend = "null:1M"

[[subsystem]]
nqn = "nqn.2026-11.io.test:b"
allow_any_host = true
"#;

    const A: &str = "nqn.2026-11.io.test:a";

    /// The plan from BASE to BASE edited by `edit` (a text replacement, then appended text).
    fn plan_to(from: &str, to: &str, append: &str) -> Result<Vec<Change>, String> {
        let text = format!("{}{append}", BASE.replacen(from, to, 1));
        plan_between(BASE, &text)
    }

    /// The plan from the configuration `old` to `new`, checked to give `new` when carried out.
    fn plan_between(old: &str, text: &str) -> Result<Vec<Change>, String> {
        let old = Config::from_toml(old).unwrap();
        let new = Config::from_toml(text).map_err(|e| e.to_string())?;
        new.validate().map_err(|e| e.to_string())?;
        let changes = plan(&old, &new).map_err(|e| e.to_string())?;
        // Carried out on the old configuration, the plan gives the new one.
        let mut cfg = old.with_explicit_nsids();
        for c in &changes {
            c.apply(&mut cfg).unwrap();
        }
        let canon = |c: Config| {
            let mut c = c.with_explicit_nsids();
            for s in &mut c.subsystems {
                s.namespaces.sort_by_key(|n| n.nsid);
                s.hosts.sort();
                s.auth_hosts.sort_by(|a, b| a.nqn.cmp(&b.nqn));
            }
            c.subsystems.sort_by(|a, b| a.nqn.cmp(&b.nqn));
            c.to_toml().unwrap()
        };
        assert_eq!(canon(cfg), canon(new));
        Ok(changes)
    }

    #[test]
    fn the_same_configuration_plans_nothing() {
        assert_eq!(plan_to("", "", ""), Ok(vec![]));
        // NSIDs written out or left to their places are the same namespaces.
        let explicit = BASE.replacen(
            "backend = \"null:1M\"",
            "nsid = 2\nbackend = \"null:1M\"",
            1,
        );
        let old = Config::from_toml(BASE).unwrap();
        assert_eq!(
            plan(&old, &Config::from_toml(&explicit).unwrap()).unwrap(),
            vec![]
        );
    }

    #[test]
    fn namespaces_are_added_removed_resized_and_replaced() {
        let add = plan_to(
            "",
            "",
            "\n[[subsystem.namespace]]\nnsid = 7\nbackend = \"null:4M\"\n",
        )
        .unwrap();
        // Appended to the last subsystem, b.
        assert!(matches!(
            &add[..],
            [Change::AddNamespace { subsystem, namespace }]
                if subsystem == "nqn.2026-11.io.test:b" && namespace.nsid == Some(7)
        ));
        let gone = plan_to("[[subsystem.namespace]]\nbackend = \"mem:1M\"\n\n", "", "");
        // The null namespace keeps its place in the list, so it becomes NSID 1: NSID 2 goes,
        // NSID 1 gets another backend.
        assert_eq!(
            gone.unwrap(),
            vec![
                Change::RemoveNamespace {
                    subsystem: A.into(),
                    nsid: 2
                },
                Change::ReplaceBackend {
                    subsystem: A.into(),
                    nsid: 1,
                    backend: "null:1M".parse().unwrap()
                },
            ]
        );
        assert_eq!(
            plan_to("null:1M", "null:3M", "").unwrap(),
            vec![Change::ResizeNamespace {
                subsystem: A.into(),
                nsid: 2,
                size: 3 << 20
            }]
        );
        // Another block size is another backend.
        assert_eq!(
            plan_to("null:1M", "null:1M,bs=512", "").unwrap(),
            vec![Change::ReplaceBackend {
                subsystem: A.into(),
                nsid: 2,
                backend: "null:1M,bs=512".parse().unwrap()
            }]
        );
    }

    #[test]
    fn hosts_and_access_change_one_by_one() {
        let changes = plan_to(
            "hosts = [\"nqn.2026-11.io.test:h1\"]",
            "hosts = [\"nqn.2026-11.io.test:h2\"]",
            "",
        )
        .unwrap();
        assert_eq!(
            changes,
            vec![
                Change::AddHost {
                    subsystem: A.into(),
                    host: Host::Plain("nqn.2026-11.io.test:h2".into())
                },
                Change::RemoveHost {
                    subsystem: A.into(),
                    host: "nqn.2026-11.io.test:h1".into()
                },
            ]
        );
        let any = plan_to("allow_any_host = false", "allow_any_host = true", "").unwrap();
        assert_eq!(
            any,
            vec![Change::AllowAnyHost {
                subsystem: A.into(),
                allow: true
            }]
        );
    }

    #[test]
    fn referrals_come_and_go_one_by_one() {
        let a: ListenAddr = "tcp://192.0.2.1:8009".parse().unwrap();
        let b: ListenAddr = "tcp://192.0.2.2:8009".parse().unwrap();
        let changes = plan_to(
            "listen = [\"tcp://127.0.0.1:8009\"]",
            "listen = [\"tcp://127.0.0.1:8009\"]\nreferrals = [\"tcp://192.0.2.1:8009\"]",
            "",
        )
        .unwrap();
        assert_eq!(changes, vec![Change::AddReferral { address: a.clone() }]);
        let with_a = BASE.replacen(
            "listen = [\"tcp://127.0.0.1:8009\"]",
            "listen = [\"tcp://127.0.0.1:8009\"]\nreferrals = [\"tcp://192.0.2.1:8009\"]",
            1,
        );
        let to_b = with_a.replacen("192.0.2.1", "192.0.2.2", 1);
        assert_eq!(
            plan_between(&with_a, &to_b).unwrap(),
            vec![
                Change::RemoveReferral { address: a.clone() },
                Change::AddReferral { address: b.clone() },
            ]
        );
        // Twice, or removed while absent: refused; a retried change is already in effect.
        let mut cfg = Config::from_toml(&with_a).unwrap();
        let add = Change::AddReferral { address: a.clone() };
        assert!(add.in_effect(&cfg));
        assert!(
            add.apply(&mut cfg)
                .unwrap_err()
                .to_string()
                .contains("exists already")
        );
        let remove = Change::RemoveReferral { address: b };
        assert!(
            remove
                .apply(&mut cfg)
                .unwrap_err()
                .to_string()
                .contains("no referral")
        );
        // A referral must name a reachable address, once.
        for bad in ["tcp://0.0.0.0:8009", "tcp://192.0.2.1:0"] {
            let text = BASE.replacen(
                "listen = [\"tcp://127.0.0.1:8009\"]",
                &format!("listen = [\"tcp://127.0.0.1:8009\"]\nreferrals = [\"{bad}\"]"),
                1,
            );
            let err = Config::from_toml(&text).unwrap_err();
            assert!(err.to_string().contains("a referral names"), "{err}");
        }
        let twice = with_a.replacen(
            "referrals = [\"tcp://192.0.2.1:8009\"]",
            "referrals = [\"tcp://192.0.2.1:8009\", \"tcp://192.0.2.1:8009\"]",
            1,
        );
        let err = Config::from_toml(&twice).unwrap_err();
        assert!(err.to_string().contains("listed twice"), "{err}");
        // mDNS advertisement starts and stops with the daemon.
        let mdns = plan_to(
            "listen = [\"tcp://127.0.0.1:8009\"]",
            "listen = [\"tcp://127.0.0.1:8009\"]\nmdns = true",
            "",
        );
        assert!(mdns.unwrap_err().contains("mdns changes only at a restart"));
    }

    #[test]
    fn subsystems_and_listeners_come_and_go() {
        let changes = plan_to(
            "[[subsystem]]\nnqn = \"nqn.2026-11.io.test:b\"\nallow_any_host = true\n",
            "[[subsystem]]\nnqn = \"nqn.2026-11.io.test:c\"\nallow_any_host = true\n",
            "",
        )
        .unwrap();
        assert!(
            matches!(&changes[..], [Change::RemoveSubsystem { nqn }, Change::AddSubsystem(s)]
                if nqn == "nqn.2026-11.io.test:b" && s.nqn == "nqn.2026-11.io.test:c"),
            "{changes:?}"
        );
        let changes = plan_to(
            "address = \"tcp://127.0.0.1:4420\"",
            "address = \"tcp://127.0.0.1:4421\"",
            "",
        );
        let old: ListenAddr = "tcp://127.0.0.1:4420".parse().unwrap();
        let new: ListenAddr = "tcp://127.0.0.1:4421".parse().unwrap();
        assert!(matches!(&changes.unwrap()[..], [
                Change::RemoveListener { address, discovery: false },
                Change::AddListener { listener, discovery: false },
            ] if *address == old && listener.address == new));
        let disc = plan_to("listen = [\"tcp://127.0.0.1:8009\"]", "listen = []", "").unwrap();
        assert!(matches!(
            &disc[..],
            [Change::RemoveListener {
                discovery: true,
                ..
            }]
        ));
    }

    #[test]
    fn what_a_running_target_cannot_take_is_refused() {
        for (from, to, append, why) in [
            (
                "",
                "",
                "[target]\nmax_queue_depth = 64\n",
                "max_queue_depth changed",
            ),
            (
                "allow_any_host = true",
                "allow_any_host = true\nserial = \"S1\"",
                "",
                "serial and model change only at a restart",
            ),
            (
                "backend = \"mem:1M\"",
                "backend = \"mem:1M\"\nuuid = \"00000000-0000-4000-8000-000000000001\"",
                "",
                "UUIDs change only at a restart",
            ),
            (
                "backend = \"mem:1M\"",
                "backend = \"mem:1M\"\nana_group = 2",
                "",
                "ANA groups change only at a restart",
            ),
            (
                "allow_any_host = true",
                "allow_any_host = true\ncntlid_min = 10",
                "",
                "cntlid_min and cntlid_max change only at a restart",
            ),
            (
                "listen = [\"tcp://127.0.0.1:8009\"]",
                "listen = [\"tcp://127.0.0.1:4421\"]",
                "[[listener]]\naddress = \"tcp://127.0.0.1:8009\"\n",
                "cannot be an I/O and a discovery listener at once",
            ),
        ] {
            let text = format!("{}{append}", BASE.replacen(from, to, 1));
            let old = Config::from_toml(BASE).unwrap();
            let new = Config::from_toml(&text).unwrap();
            let e = plan(&old, &new).unwrap_err().to_string();
            assert!(e.contains(why), "{to}: {e}");
        }
        // The same file with other options is not opened twice.
        let old = Config::from_toml(&BASE.replacen("null:1M", "file:/tmp/x.img,size=1M", 1));
        let new =
            Config::from_toml(&BASE.replacen("null:1M", "file:/tmp/x.img,size=1M,direct=off", 1));
        let e = plan(&old.unwrap(), &new.unwrap()).unwrap_err().to_string();
        assert!(e.contains("serves the same file"), "{e}");
    }

    #[test]
    fn a_change_that_names_nothing_or_adds_twice_is_refused() {
        let mut cfg = Config::from_toml(BASE).unwrap().with_explicit_nsids();
        let before = cfg.to_toml().unwrap();
        for (c, why) in [
            (
                Change::RemoveNamespace {
                    subsystem: A.into(),
                    nsid: 9,
                },
                "has no namespace 9",
            ),
            (
                Change::RemoveSubsystem {
                    nqn: "nqn.2026-11.io.test:z".into(),
                },
                "no subsystem nqn.2026-11.io.test:z",
            ),
            (
                Change::AddHost {
                    subsystem: A.into(),
                    host: Host::Plain("nqn.2026-11.io.test:h1".into()),
                },
                "already allowed",
            ),
            (
                Change::RemoveHost {
                    subsystem: A.into(),
                    host: "nqn.2026-11.io.test:h9".into(),
                },
                "not on the allowed list",
            ),
            (
                Change::AddListener {
                    listener: ListenerConfig {
                        address: "tcp://127.0.0.1:8009".parse().unwrap(),
                        tls: None,
                        ana: Vec::new(),
                    },
                    discovery: false,
                },
                "already listening",
            ),
            (
                Change::ResizeNamespace {
                    subsystem: A.into(),
                    nsid: 3,
                    size: 1,
                },
                "has no namespace 3",
            ),
        ] {
            let e = c.apply(&mut cfg).unwrap_err().to_string();
            assert!(e.contains(why), "{c:?}: {e}");
        }
        assert_eq!(cfg.to_toml().unwrap(), before);
    }

    #[test]
    fn a_change_carried_out_is_in_effect() {
        let old = Config::from_toml(BASE).unwrap().with_explicit_nsids();
        let text = BASE.replacen("null:1M", "null:2M", 1).replacen(
            "hosts = [\"nqn.2026-11.io.test:h1\"]",
            "hosts = [\"nqn.2026-11.io.test:h2\"]",
            1,
        ) + "\n[[subsystem.namespace]]\nnsid = 5\nbackend = \"null:4M\"\n";
        let new = Config::from_toml(&text).unwrap();
        let changes = plan(&old, &new).unwrap();
        assert_eq!(changes.len(), 4, "{changes:?}");
        let mut cfg = old.clone();
        for c in &changes {
            assert!(!c.in_effect(&cfg), "{c:?} before");
            c.apply(&mut cfg).unwrap();
            assert!(c.in_effect(&cfg), "{c:?} after");
        }
        // Another namespace under an NSID in use is not the one asked for.
        let other = Change::AddNamespace {
            subsystem: "nqn.2026-11.io.test:b".into(),
            namespace: NamespaceConfig {
                nsid: Some(5),
                backend: "null:8M".parse().unwrap(),
                uuid: None,
                hosts: Vec::new(),
                ana_group: None,
            },
        };
        assert!(!other.in_effect(&cfg));
    }

    const H1: &str = "nqn.2026-11.io.test:h1";
    const H2: &str = "nqn.2026-11.io.test:h2";

    /// BASE with the memory namespace shown to `hosts` and ANA `ana` on the I/O listener.
    fn masked(hosts: &str, ana: &str) -> String {
        BASE.replacen(
            "backend = \"mem:1M\"",
            &format!("backend = \"mem:1M\"\nhosts = [{hosts}]"),
            1,
        )
        .replacen(
            "address = \"tcp://127.0.0.1:4420\"",
            &format!("address = \"tcp://127.0.0.1:4420\"\nana = [{ana}]"),
            1,
        )
    }

    #[test]
    fn namespace_hosts_and_ana_states_change_one_by_one() {
        let host = |h: &str| format!("\"{h}\"");
        let (h1, both) = (host(H1), format!("{}, {}", host(H1), host(H2)));
        let add = |h: &str| Change::AddNamespaceHost {
            subsystem: A.into(),
            nsid: 1,
            host: h.into(),
        };
        let remove = |h: &str| Change::RemoveNamespaceHost {
            subsystem: A.into(),
            nsid: 1,
            host: h.into(),
        };
        // Seen by every host, then by the listed ones only, and back.
        assert_eq!(plan_between(BASE, &masked(&h1, "")), Ok(vec![add(H1)]));
        assert_eq!(
            plan_between(&masked(&h1, ""), &masked(&host(H2), "")),
            Ok(vec![add(H2), remove(H1)])
        );
        assert_eq!(
            plan_between(&masked(&both, ""), BASE),
            Ok(vec![remove(H1), remove(H2)])
        );
        // A namespace whose hosts and backend change: both, the backend kept open otherwise.
        let resized = masked(&h1, "").replacen("mem:1M", "mem:2M", 1);
        assert_eq!(
            plan_between(BASE, &resized),
            Ok(vec![
                add(H1),
                Change::ResizeNamespace {
                    subsystem: A.into(),
                    nsid: 1,
                    size: 2 << 20
                }
            ])
        );

        let l: ListenAddr = "tcp://127.0.0.1:4420".parse().unwrap();
        let ana = |group, state| Change::SetAnaState {
            address: l.clone(),
            group,
            state,
        };
        let two = "{ group = 2, state = \"inaccessible\" }";
        assert_eq!(
            plan_between(BASE, &masked("", two)),
            Ok(vec![ana(2, AnaState::Inaccessible)])
        );
        let other = "{ group = 1, state = \"non-optimized\" }, { group = 2, state = \"change\" }";
        assert_eq!(
            plan_between(&masked("", two), &masked("", other)),
            Ok(vec![
                ana(1, AnaState::NonOptimized),
                ana(2, AnaState::Change)
            ])
        );
        // Optimized is what a listener that names no group gives.
        let optimized = "{ group = 2, state = \"optimized\" }";
        assert_eq!(
            plan_between(&masked("", two), BASE),
            Ok(vec![ana(2, AnaState::Optimized)])
        );
        let named = Config::from_toml(&masked("", optimized)).unwrap();
        assert_eq!(
            plan(&Config::from_toml(BASE).unwrap(), &named).unwrap(),
            vec![]
        );

        // Carried out, each is in effect; named again, each is refused.
        let mut cfg = Config::from_toml(BASE).unwrap().with_explicit_nsids();
        for c in [
            add(H1),
            add(H2),
            remove(H1),
            ana(2, AnaState::PersistentLoss),
        ] {
            assert!(!c.in_effect(&cfg), "{c:?} before");
            c.apply(&mut cfg).unwrap();
            assert!(c.in_effect(&cfg), "{c:?} after");
        }
        assert_eq!(cfg.subsystems[0].namespaces[0].hosts, vec![H2]);
        for (c, why) in [
            (add(H2), "already shown to"),
            (remove(H1), "is not shown to nqn.2026-11.io.test:h1 by name"),
            (
                Change::SetAnaState {
                    address: "tcp://127.0.0.1:8009".parse().unwrap(),
                    group: 1,
                    state: AnaState::Inaccessible,
                },
                "no I/O listener on tcp://127.0.0.1:8009 (listeners: tcp://127.0.0.1:4420)",
            ),
            (
                Change::AddNamespaceHost {
                    subsystem: A.into(),
                    nsid: 9,
                    host: H1.into(),
                },
                "has no namespace 9",
            ),
        ] {
            let e = c.apply(&mut cfg).unwrap_err().to_string();
            assert!(e.contains(why), "{c:?}: {e}");
        }
    }
}
