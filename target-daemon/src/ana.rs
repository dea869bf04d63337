//! Asymmetric Namespace Access (NVMe Base 2.0, section 8.1.3): every namespace belongs to an
//! ANA group, and every I/O listener gives each group a state (optimized unless configured
//! otherwise), as Linux nvmet does per port. A host connected through a listener where a
//! group is inaccessible, in persistent loss or changing gets its I/O to that group's
//! namespaces refused with the matching path-related status, and fails over to another path.
//!
//! [`AnaTable`] is a pure value (the states of every listener), tested on its own; [`AnaStates`]
//! holds the running one and a generation counter that queues compare, as they do for the
//! namespaces, so the per-command check takes no lock.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use nvme_spec::log::AnaState;
use parking_lot::RwLock;

use crate::config::ListenerConfig;

pub use crate::config::{MAX_ANA_GROUPS, valid_group};
/// The group of a namespace that names none.
pub const DEFAULT_ANA_GROUP: u32 = 1;
/// ANA Transition Time reported in Identify Controller: a group stays in the Change state at
/// most this many seconds before the host may consider it failed.
pub const ANATT_SECONDS: u8 = 10;

/// The ANA states of each listener, by its bound address. Groups a listener does not name
/// are optimized there.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AnaTable {
    ports: Vec<(SocketAddr, BTreeMap<u32, AnaState>)>,
}

impl AnaTable {
    /// The states the listeners of a configuration give (their addresses as bound).
    pub fn from_listeners(listeners: &[ListenerConfig]) -> Self {
        AnaTable {
            ports: listeners
                .iter()
                .filter(|l| !l.ana.is_empty())
                .map(|l| {
                    let groups = l.ana.iter().map(|a| (a.group, a.state)).collect();
                    (l.address.addr, groups)
                })
                .collect(),
        }
    }

    /// The state of group `grpid` for a connection to `local`: that of the listener bound
    /// to exactly that address, else of one bound to every address on its port; optimized
    /// where no listener says otherwise.
    pub fn state(&self, local: SocketAddr, grpid: u32) -> AnaState {
        let exact = self.ports.iter().find(|(a, _)| *a == local);
        let wildcard = || {
            self.ports
                .iter()
                .find(|(a, _)| a.port() == local.port() && a.ip().is_unspecified())
        };
        exact
            .or_else(wildcard)
            .and_then(|(_, groups)| groups.get(&grpid).copied())
            .unwrap_or_default()
    }

    /// Whether a connection to `local` sees any of `groups` in another state in `other`.
    pub fn differs_at(
        &self,
        other: &AnaTable,
        local: SocketAddr,
        mut groups: impl Iterator<Item = u32>,
    ) -> bool {
        groups.any(|g| self.state(local, g) != other.state(local, g))
    }
}

/// The running target's ANA states.
pub struct AnaStates {
    table: RwLock<Arc<AnaTable>>,
    /// Moves after every change of the table; also the ANA log page's change count.
    generation: AtomicU64,
}

impl AnaStates {
    /// The states of `table`.
    pub fn new(table: AnaTable) -> Self {
        AnaStates {
            table: RwLock::new(Arc::new(table)),
            generation: AtomicU64::new(1),
        }
    }

    /// The current states.
    pub fn table(&self) -> Arc<AnaTable> {
        Arc::clone(&self.table.read())
    }

    /// A counter that moves after every change: a reader that took the table at the same
    /// value has the current one.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Replaces the states; returns the old ones.
    pub fn replace(&self, table: AnaTable) -> Arc<AnaTable> {
        let old = std::mem::replace(&mut *self.table.write(), Arc::new(table));
        self.generation.fetch_add(1, Ordering::AcqRel);
        old
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{AnaGroupState, ListenAddr};

    fn listener(addr: &str, ana: &[(u32, AnaState)]) -> ListenerConfig {
        ListenerConfig {
            address: addr.parse::<ListenAddr>().unwrap(),
            tls: None,
            ana: ana
                .iter()
                .map(|&(group, state)| AnaGroupState { group, state })
                .collect(),
        }
    }

    fn at(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn each_listener_gives_its_groups_their_states() {
        let t = AnaTable::from_listeners(&[
            listener("tcp://10.0.0.1:4420", &[(1, AnaState::Inaccessible)]),
            listener(
                "tcp://0.0.0.0:4421",
                &[(1, AnaState::NonOptimized), (2, AnaState::PersistentLoss)],
            ),
            listener("tcp://10.0.0.1:4421", &[(2, AnaState::Change)]),
            listener("tcp://10.0.0.1:4422", &[]),
        ]);
        assert_eq!(t.state(at("10.0.0.1:4420"), 1), AnaState::Inaccessible);
        // Groups a listener does not name, and listeners naming none, are optimized.
        assert_eq!(t.state(at("10.0.0.1:4420"), 2), AnaState::Optimized);
        assert_eq!(t.state(at("10.0.0.1:4422"), 1), AnaState::Optimized);
        assert_eq!(t.state(at("10.0.0.2:4420"), 1), AnaState::Optimized);
        // The wildcard listener answers for every address on its port but an exact one.
        assert_eq!(t.state(at("10.0.0.9:4421"), 1), AnaState::NonOptimized);
        assert_eq!(t.state(at("10.0.0.9:4421"), 2), AnaState::PersistentLoss);
        assert_eq!(t.state(at("10.0.0.1:4421"), 2), AnaState::Change);
        assert_eq!(t.state(at("10.0.0.1:4421"), 1), AnaState::Optimized);
        assert_eq!(
            AnaTable::default().state(at("10.0.0.1:4420"), 7),
            AnaState::Optimized
        );
    }

    #[test]
    fn a_change_is_seen_only_where_a_group_changes_state() {
        let old = AnaTable::from_listeners(&[listener("tcp://10.0.0.1:4420", &[])]);
        let new = AnaTable::from_listeners(&[
            listener("tcp://10.0.0.1:4420", &[(2, AnaState::Inaccessible)]),
            listener("tcp://10.0.0.1:4421", &[(1, AnaState::Optimized)]),
        ]);
        assert!(old.differs_at(&new, at("10.0.0.1:4420"), [1, 2].into_iter()));
        assert!(!old.differs_at(&new, at("10.0.0.1:4420"), [1].into_iter()));
        // Naming a group optimized changes nothing for it.
        assert!(!old.differs_at(&new, at("10.0.0.1:4421"), [1, 2].into_iter()));
    }

    #[test]
    fn replacing_the_states_moves_the_generation() {
        let s = AnaStates::new(AnaTable::default());
        let g = s.generation();
        let t = AnaTable::from_listeners(&[listener(
            "tcp://10.0.0.1:4420",
            &[(1, AnaState::Inaccessible)],
        )]);
        let old = s.replace(t.clone());
        assert_eq!(*old, AnaTable::default());
        assert_eq!(*s.table(), t);
        assert!(s.generation() > g);
    }

    #[test]
    fn configuration_keys_round_trip_and_bad_ones_are_named() {
        let doc = |listener: &str, subsystem: &str, namespace: &str| {
            format!(
                "[[listener]]\naddress = \"tcp://127.0.0.1:4420\"\n{listener}\n\n[[subsystem]]\n\
                 nqn = \"nqn.2026-11.io.x:a\"\nallow_any_host = true\n{subsystem}\n\n\
                 [[subsystem.namespace]]\nbackend = \"mem:1M\"\n{namespace}\n"
            )
        };
        let host = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-000000000001";
        let good = doc(
            "ana = [{ group = 2, state = \"persistent-loss\" }]",
            "cntlid_min = 10\ncntlid_max = 20",
            &format!("hosts = [\"{host}\"]\nana_group = 2"),
        );
        let cfg = crate::Config::from_toml(&good).unwrap();
        assert_eq!(cfg.listeners[0].ana[0].state, AnaState::PersistentLoss);
        assert_eq!(cfg.subsystems[0].namespaces[0].hosts, vec![host]);
        let again = crate::Config::from_toml(&cfg.to_toml().unwrap()).unwrap();
        assert_eq!(again.listeners, cfg.listeners);
        assert_eq!(again.subsystems, cfg.subsystems);
        for (listener, subsystem, namespace, why) in [
            (
                "ana = [{ group = 0, state = \"optimized\" }]",
                "",
                "",
                "ANA group 0",
            ),
            (
                "ana = [{ group = 1, state = \"asleep\" }]",
                "",
                "",
                "unknown ANA state",
            ),
            (
                "ana = [{ group = 1, state = \"change\" }, { group = 1, state = \"change\" }]",
                "",
                "",
                "listed twice",
            ),
            ("", "cntlid_min = 0", "", "cntlid_min"),
            ("", "cntlid_min = 30\ncntlid_max = 20", "", "cntlid_min"),
            ("", "cntlid_max = 65520", "", "cntlid_max"),
            ("", "", "ana_group = 129", "ana_group 129"),
            ("", "", "hosts = [\"not an nqn\"]", "host NQN"),
        ] {
            let e = crate::Config::from_toml(&doc(listener, subsystem, namespace)).unwrap_err();
            assert!(e.to_string().contains(why), "{why}: {e}");
        }
    }

    #[test]
    fn groups_are_one_to_the_maximum() {
        assert!(!valid_group(0));
        assert!(valid_group(1));
        assert!(valid_group(MAX_ANA_GROUPS));
        assert!(!valid_group(MAX_ANA_GROUPS + 1));
    }
}
