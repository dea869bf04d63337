//! Subsystems and namespaces: identity, host access, and the controllers attached to them.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use blockdev::{AnyBackend, Backend};
use nvme_auth::tls::ConfiguredPsk;
use nvme_auth::{DhGroupId, DhchapKey, HashId};
use parking_lot::{Mutex, RwLock};

use crate::config::{MAX_CNTLID, NamespaceConfig, SubsystemConfig, parse_uuid};
use crate::controller::Controller;

/// Firmware revision reported in Identify Controller (8 ASCII bytes at most).
pub const FIRMWARE_REVISION: &str = concat!("nd", env!("CARGO_PKG_VERSION"));

/// A namespace: an NSID, its backend and its stable identifiers.
pub struct Namespace {
    /// Namespace ID.
    pub nsid: u32,
    /// Storage behind it.
    pub backend: Arc<AnyBackend>,
    /// Namespace globally unique identifier.
    pub nguid: [u8; 16],
    /// Namespace UUID.
    pub uuid: [u8; 16],
    /// IEEE EUI-64.
    pub eui64: [u8; 8],
    /// Block size in bytes (a power of two).
    pub block_size: u32,
    /// log2 of the block size.
    pub block_shift: u32,
    /// Capacity in blocks.
    pub blocks: u64,
    /// Human description of the backend, for logs.
    pub description: String,
    /// The only hosts that see the namespace; empty: every host the subsystem admits.
    pub hosts: Vec<String>,
    /// ANA group ID.
    pub ana_group: u32,
    /// Reservations, shared by every copy of the namespace ([`Namespace::with_hosts`]).
    pub reservations: Arc<crate::reservation::Shared>,
}

impl Namespace {
    /// Builds a namespace with identifiers derived from the subsystem NQN and NSID (stable across
    /// restarts) unless a UUID is given.
    pub fn new(
        subnqn: &str,
        nsid: u32,
        backend: Arc<AnyBackend>,
        uuid: Option<[u8; 16]>,
        description: String,
    ) -> Self {
        let seed = format!("{subnqn}/ns/{nsid}");
        let derived = stable_id128(&seed);
        let uuid = uuid.unwrap_or_else(|| {
            let mut u = derived;
            u[6] = (u[6] & 0x0F) | 0x80; // version 8 (custom)
            u[8] = (u[8] & 0x3F) | 0x80; // RFC 4122 variant
            u
        });
        let nguid = stable_id128(&format!("{seed}/nguid"));
        let mut eui64 = [0u8; 8];
        eui64.copy_from_slice(&stable_id128(&format!("{seed}/eui64"))[..8]);
        let block_size = backend.block_size();
        let blocks = backend.num_blocks();
        Namespace {
            nsid,
            backend,
            nguid,
            uuid,
            eui64,
            block_size,
            block_shift: block_size.trailing_zeros(),
            blocks,
            description,
            hosts: Vec::new(),
            ana_group: crate::ana::DEFAULT_ANA_GROUP,
            reservations: Arc::default(),
        }
    }

    /// The namespace with the visibility and ANA group its configuration gives.
    pub fn configured(mut self, cfg: &NamespaceConfig) -> Self {
        self.hosts = cfg.hosts.clone();
        self.ana_group = cfg.ana_group.unwrap_or(crate::ana::DEFAULT_ANA_GROUP);
        self
    }

    /// The same namespace (backend, identifiers, group) seen by `hosts` only (empty: by
    /// every host).
    pub fn with_hosts(&self, hosts: Vec<String>) -> Self {
        Namespace {
            nsid: self.nsid,
            backend: Arc::clone(&self.backend),
            nguid: self.nguid,
            uuid: self.uuid,
            eui64: self.eui64,
            block_size: self.block_size,
            block_shift: self.block_shift,
            blocks: self.blocks,
            description: self.description.clone(),
            hosts,
            ana_group: self.ana_group,
            reservations: Arc::clone(&self.reservations),
        }
    }

    /// Whether `hostnqn` sees this namespace (it is active on the host's controllers).
    pub fn visible_to(&self, hostnqn: &str) -> bool {
        self.hosts.is_empty() || self.hosts.iter().any(|h| h == hostnqn)
    }
}

/// The DH-HMAC-CHAP secrets of one host. `Debug` shows no key material.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostKeys {
    /// The host's secret.
    pub host: DhchapKey,
    /// The controller's secret, for bidirectional authentication.
    pub ctrl: Option<DhchapKey>,
    /// The only hash function allowed, if restricted.
    pub hash: Option<HashId>,
    /// The only DH group allowed, if restricted.
    pub dh_group: Option<DhGroupId>,
}

impl HostKeys {
    /// The DH-HMAC-CHAP keys of a `[[subsystem.host]]` table, if it has a host key.
    pub fn from_config(h: &crate::config::HostAuthConfig) -> Option<Self> {
        Some(HostKeys {
            host: h.dhchap_key.clone()?,
            ctrl: h.dhchap_ctrl_key.clone(),
            hash: h.dhchap_hash,
            dh_group: h.dhchap_dhgroup,
        })
    }
}

/// The namespaces of a subsystem by NSID: an immutable snapshot, replaced whole on a change.
pub type NamespaceMap = BTreeMap<u32, Arc<Namespace>>;

/// Which hosts may connect to a subsystem.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostAccess {
    /// Accept any host.
    pub allow_any_host: bool,
    /// Allowed host NQNs.
    pub hosts: Vec<String>,
    /// Allowed hosts that must authenticate, by host NQN.
    pub auth_hosts: BTreeMap<String, HostKeys>,
    /// Allowed hosts with a configured TLS PSK (they connect over TLS only), by host NQN.
    pub tls_psks: BTreeMap<String, ConfiguredPsk>,
}

impl HostAccess {
    /// Who may connect, as a subsystem's configuration says.
    pub fn from_config(cfg: &SubsystemConfig) -> Self {
        HostAccess {
            allow_any_host: cfg.allow_any_host,
            hosts: cfg.hosts.clone(),
            auth_hosts: cfg
                .auth_hosts
                .iter()
                .filter_map(|h| Some((h.nqn.clone(), HostKeys::from_config(h)?)))
                .collect(),
            tls_psks: cfg
                .auth_hosts
                .iter()
                .filter_map(|h| Some((h.nqn.clone(), h.tls_psk.clone()?)))
                .collect(),
        }
    }

    /// Whether `hostnqn` may connect.
    pub fn allows(&self, hostnqn: &str) -> bool {
        self.allow_any_host
            || self.hosts.iter().any(|h| h == hostnqn)
            || self.auth_hosts.contains_key(hostnqn)
            || self.tls_psks.contains_key(hostnqn)
    }
}

/// An NVM subsystem: NQN, identity strings, namespaces, host access list, live controllers.
///
/// Namespaces and host access change while the target runs: readers take a snapshot
/// ([`Subsystem::namespaces`]); I/O queues keep theirs and refresh it only when
/// [`Subsystem::namespace_generation`] moves, so the per-command lookup takes no lock.
pub struct Subsystem {
    /// Subsystem NQN.
    pub nqn: String,
    /// Serial number (ASCII, at most 20 bytes).
    pub serial: String,
    /// Model number (ASCII, at most 40 bytes).
    pub model: String,
    access: RwLock<HostAccess>,
    namespaces: RwLock<Arc<NamespaceMap>>,
    /// Live controllers by controller ID.
    controllers: Mutex<BTreeMap<u16, Arc<Controller>>>,
    /// The controller IDs handed out, lowest and highest.
    cntlids: (u16, u16),
    next_cntlid: Mutex<u16>,
    /// Incremented on every namespace change, after the new map is in place.
    generation: AtomicU64,
    /// Told of every namespace change, so idle queues let go of removed namespaces.
    ns_changed: tokio::sync::watch::Sender<()>,
    /// Live queues' counters and the totals of closed ones.
    pub metrics: crate::metrics::SubsystemMetrics,
}

impl Subsystem {
    /// Builds a subsystem from its configuration and opened backends (in namespace order).
    pub fn new(cfg: &SubsystemConfig, backends: Vec<(Arc<AnyBackend>, String)>) -> Self {
        let serial = cfg.serial.clone().unwrap_or_else(|| {
            let id = stable_id128(&format!("{}/serial", cfg.nqn));
            id[..10].iter().map(|b| format!("{b:02x}")).collect()
        });
        let namespaces = cfg
            .namespaces
            .iter()
            .zip(backends)
            .enumerate()
            .map(|(i, (ns, (backend, desc)))| {
                let nsid = ns.nsid.unwrap_or(i as u32 + 1);
                let uuid = ns.uuid.as_deref().and_then(parse_uuid);
                (
                    nsid,
                    Arc::new(Namespace::new(&cfg.nqn, nsid, backend, uuid, desc).configured(ns)),
                )
            })
            .collect();
        let lo = cfg.cntlid_min.unwrap_or(1).max(1);
        let cntlids = (
            lo,
            cfg.cntlid_max.unwrap_or(MAX_CNTLID).clamp(lo, MAX_CNTLID),
        );
        Subsystem {
            nqn: cfg.nqn.clone(),
            serial,
            model: cfg.model.clone(),
            access: RwLock::new(HostAccess::from_config(cfg)),
            namespaces: RwLock::new(Arc::new(namespaces)),
            controllers: Mutex::new(BTreeMap::new()),
            cntlids,
            next_cntlid: Mutex::new(cntlids.0),
            generation: AtomicU64::new(0),
            ns_changed: tokio::sync::watch::channel(()).0,
            metrics: Default::default(),
        }
    }

    /// Whether `hostnqn` may connect.
    pub fn host_allowed(&self, hostnqn: &str) -> bool {
        self.access.read().allows(hostnqn)
    }

    /// The keys `hostnqn` authenticates with, when it must.
    pub fn host_keys(&self, hostnqn: &str) -> Option<HostKeys> {
        self.access.read().auth_hosts.get(hostnqn).cloned()
    }

    /// The configured TLS PSK of `hostnqn`, when it has one.
    pub fn tls_psk(&self, hostnqn: &str) -> Option<ConfiguredPsk> {
        self.access.read().tls_psks.get(hostnqn).cloned()
    }

    /// Whether `hostnqn` has a TLS PSK here (and so must connect over TLS).
    pub fn has_tls_psk(&self, hostnqn: &str) -> bool {
        self.access.read().tls_psks.contains_key(hostnqn)
    }

    /// Who may connect.
    pub fn access(&self) -> HostAccess {
        self.access.read().clone()
    }

    /// Replaces who may connect. Controllers of hosts no longer allowed are the caller's to
    /// disconnect.
    pub fn set_access(&self, access: HostAccess) {
        *self.access.write() = access;
    }

    /// The current namespaces.
    pub fn namespaces(&self) -> Arc<NamespaceMap> {
        Arc::clone(&self.namespaces.read())
    }

    /// A counter that moves after every change of the namespaces: a reader holding a snapshot
    /// taken at the same value has the current one.
    pub fn namespace_generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Replaces the namespaces. Commands already holding a namespace keep its backend until
    /// they complete; new commands see the new map.
    pub fn set_namespaces(&self, namespaces: NamespaceMap) {
        *self.namespaces.write() = Arc::new(namespaces);
        self.generation.fetch_add(1, Ordering::AcqRel);
        self.ns_changed.send_replace(());
    }

    /// A receiver that sees every namespace change: a queue waiting for commands drops its
    /// snapshot of the namespaces then, so a removed namespace's backend (its file and lock)
    /// is released once its running commands complete, not at the queue's next command.
    pub fn subscribe_namespaces(&self) -> tokio::sync::watch::Receiver<()> {
        self.ns_changed.subscribe()
    }

    /// Highest NSID (Identify Controller NN).
    pub fn max_nsid(&self) -> u32 {
        self.namespaces
            .read()
            .keys()
            .next_back()
            .copied()
            .unwrap_or(0)
    }

    /// The controller IDs this subsystem hands out, lowest and highest (`cntlid_min`,
    /// `cntlid_max`).
    pub fn cntlid_range(&self) -> (u16, u16) {
        self.cntlids
    }

    /// Reserves a free controller ID in the subsystem's range.
    pub fn alloc_cntlid(&self) -> Option<u16> {
        let (lo, hi) = self.cntlids;
        let ctrls = self.controllers.lock();
        let mut next = self.next_cntlid.lock();
        for _ in lo..=hi {
            let id = *next;
            *next = if id >= hi { lo } else { id + 1 };
            if !ctrls.contains_key(&id) {
                return Some(id);
            }
        }
        None
    }

    /// Registers a live controller.
    pub fn add_controller(&self, ctrl: Arc<Controller>) {
        self.controllers.lock().insert(ctrl.cntlid, ctrl);
    }

    /// Removes a controller (its admin queue is gone).
    pub fn remove_controller(&self, cntlid: u16) {
        self.controllers.lock().remove(&cntlid);
    }

    /// Looks a live controller up.
    pub fn controller(&self, cntlid: u16) -> Option<Arc<Controller>> {
        self.controllers.lock().get(&cntlid).cloned()
    }

    /// Hands the notices of a reservation command on namespace `nsid` to the controllers of
    /// the hosts they are for.
    pub fn reservation_notices(&self, nsid: u32, out: &crate::reservation::Outcome) {
        if out.notices.is_empty() {
            return;
        }
        for c in self.controllers.lock().values() {
            for (_, n) in out.notices.iter().filter(|(h, _)| *h == c.hostid) {
                c.notify_reservation(nsid, *n);
            }
        }
    }

    /// The live controllers.
    pub fn controllers(&self) -> Vec<Arc<Controller>> {
        self.controllers.lock().values().cloned().collect()
    }

    /// Number of live controllers.
    pub fn controller_count(&self) -> usize {
        self.controllers.lock().len()
    }
}

/// A stable 128-bit identifier derived from a string (two FNV-1a 64-bit passes with different
/// offset bases). Not cryptographic; used so identifiers are the same across restarts.
pub fn stable_id128(s: &str) -> [u8; 16] {
    fn fnv(seed: u64, data: &[u8]) -> u64 {
        let mut h = seed;
        for &b in data {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01B3);
        }
        // Final avalanche (splitmix64) so similar inputs differ in every byte.
        h ^= h >> 30;
        h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
        h ^= h >> 27;
        h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
        h ^ (h >> 31)
    }
    let a = fnv(0xcbf2_9ce4_8422_2325, s.as_bytes());
    let b = fnv(0x84222325_cbf29ce4, s.as_bytes());
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&a.to_be_bytes());
    out[8..].copy_from_slice(&b.to_be_bytes());
    out
}

impl crate::metrics::CellRegistry for Subsystem {
    fn cells(&self) -> &crate::metrics::SubsystemMetrics {
        &self.metrics
    }

    fn nsids(&self) -> Vec<u32> {
        self.namespaces().keys().copied().collect()
    }

    fn has_namespace(&self, nsid: u32) -> bool {
        self.namespaces().contains_key(&nsid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stable_ids_are_stable_and_distinct() {
        assert_eq!(stable_id128("a"), stable_id128("a"));
        assert_ne!(stable_id128("nqn.x/ns/1"), stable_id128("nqn.x/ns/2"));
        // Fixed value: changing the derivation would change identifiers seen by hosts.
        assert_eq!(
            stable_id128("nqn.2026-11.io.nvmeof-direct:default/ns/1")[..4],
            stable_id128("nqn.2026-11.io.nvmeof-direct:default/ns/1")[..4]
        );
    }

    #[test]
    fn controller_ids_come_from_the_configured_range() {
        let mut cfg = crate::testing::config(&[]).subsystems.remove(0);
        cfg.cntlid_min = Some(10);
        cfg.cntlid_max = Some(11);
        let s = Subsystem::new(&cfg, Vec::new());
        assert_eq!(s.cntlid_range(), (10, 11));
        let t = crate::testing::target(&[]);
        let sub = Arc::new(s);
        let mut ids = Vec::new();
        for _ in 0..2 {
            let id = sub.alloc_cntlid().unwrap();
            let (c, _) = Controller::new(
                id,
                crate::controller::ControllerKind::Io(Arc::clone(&sub)),
                "nqn.h".into(),
                [0; 16],
                crate::testing::origin(),
                32,
                0,
            );
            sub.add_controller(c);
            ids.push(id);
        }
        assert_eq!(ids, vec![10, 11]);
        assert_eq!(sub.alloc_cntlid(), None, "the range is used up");
        sub.remove_controller(10);
        assert_eq!(sub.alloc_cntlid(), Some(10));
        drop(t);
    }

    #[test]
    fn a_namespace_with_hosts_is_seen_by_them_only() {
        let backend = Arc::new(AnyBackend::Memory(
            blockdev::MemoryBackend::new(1 << 20, 512).unwrap(),
        ));
        let ns = Namespace::new("nqn.x", 1, backend, None, "mem".into());
        assert!(ns.visible_to("nqn.a"));
        let masked = ns.with_hosts(vec!["nqn.a".into()]);
        assert!(masked.visible_to("nqn.a") && !masked.visible_to("nqn.b"));
        assert_eq!((masked.nguid, masked.uuid), (ns.nguid, ns.uuid));
        assert!(Arc::ptr_eq(&masked.backend, &ns.backend));
    }
}
