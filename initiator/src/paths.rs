//! Path selection for multipath: which of several controllers (paths) of one subsystem a
//! command goes to, as a pure state machine with no sockets and no timers.
//!
//! [`PathSet`] holds, per path, whether its controller is connected and what its ANA log
//! page said about each ANA group; [`PathSet::on`] takes what happened ([`PathEvent`]: a log
//! page read, a connection lost or back, an ANA change notice, an I/O completed with an ANA
//! status) and answers what to do ([`PathAction`]: read a path's ANA log page);
//! [`PathSet::select`] picks the path for a command to a namespace of one group.
//!
//! The rules:
//! - a path is usable when its controller is connected and the group is ANA optimized or
//!   non-optimized there (a controller that does not report ANA counts as optimized);
//!   inaccessible, persistent loss and change are never used;
//! - the best tier wins: an optimized path, else a non-optimized one, else a connected path
//!   whose ANA state is not known yet (after a reconnect, before its log page is read again);
//! - within the tier, [`PathPolicy::Failover`] takes the first path in the order the paths
//!   were given, [`PathPolicy::RoundRobin`] takes them in turn;
//! - so fail-back is immediate: once a better path is connected and reports a better state,
//!   the next command goes there.

use std::collections::BTreeMap;

use nvme_spec::Status;
use nvme_spec::log::{AnaGroup, AnaState};
use nvme_spec::status::{path as path_sc, sct};

use crate::Error;

/// How commands are spread over the usable paths of the best ANA tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PathPolicy {
    /// Every command goes to the first usable path of the best tier, in the order the paths
    /// were given (an active/standby pair keeps its I/O on one path).
    #[default]
    Failover,
    /// Commands take the usable paths of the best tier in turn.
    RoundRobin,
}

/// What a path's ANA log page said, as the path set keeps it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AnaView {
    /// The controller does not report ANA (CMIC bit 3 clear): every group counts as
    /// optimized.
    NotReported,
    /// Not read since the path (re)connected, or the last read failed.
    Unknown,
    /// The state of each group the log page listed.
    Groups(BTreeMap<u32, AnaState>),
}

/// One path as the set sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PathView {
    /// Whether the path's controller is connected.
    pub connected: bool,
    /// What its ANA log page said.
    pub ana: AnaView,
}

impl PathView {
    /// The ANA state of group `grpid` on this path: `None` when not known (not read, or a
    /// group the page does not list), optimized where ANA is not reported.
    pub fn state(&self, grpid: u32) -> Option<AnaState> {
        match &self.ana {
            AnaView::NotReported => Some(AnaState::Optimized),
            AnaView::Unknown => None,
            AnaView::Groups(g) => g.get(&grpid).copied(),
        }
    }
}

/// Something that happened to a path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PathEvent {
    /// The path's controller is connected (first time or after a reconnect); `ana` tells
    /// whether it reports ANA (then its log page must be read).
    Connected {
        /// The path.
        path: usize,
        /// Whether the controller reports ANA.
        ana: bool,
    },
    /// The path's controller lost its connection (reconnecting) or failed.
    Lost {
        /// The path.
        path: usize,
    },
    /// The path's ANA log page was read: its groups.
    AnaLog {
        /// The path.
        path: usize,
        /// The groups and their states.
        groups: Vec<AnaGroup>,
    },
    /// Reading the path's ANA log page failed.
    AnaLogFailed {
        /// The path.
        path: usize,
    },
    /// The path's controller sent an Asymmetric Namespace Access Change notice.
    AnaChanged {
        /// The path.
        path: usize,
    },
    /// An I/O command to a namespace of group `grpid` completed on the path with the ANA
    /// status `state` (inaccessible, persistent loss or transition).
    AnaStatus {
        /// The path.
        path: usize,
        /// The namespace's group.
        grpid: u32,
        /// The state the status tells.
        state: AnaState,
    },
}

/// What the set asks its owner to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PathAction {
    /// Read the ANA log page of this path (and report it with [`PathEvent::AnaLog`] or
    /// [`PathEvent::AnaLogFailed`]).
    ReadAnaLog(usize),
}

/// The answer of [`PathSet::select`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Selection {
    /// Send the command on this path.
    Path(usize),
    /// No path is usable now, but one may become usable (a path is reconnecting, changing
    /// state or inaccessible): wait for an event and ask again.
    Wait,
    /// No path can ever carry the command: every path is in ANA persistent loss.
    Never,
}

/// The paths of one subsystem and the state of each.
#[derive(Clone, Debug)]
pub struct PathSet {
    paths: Vec<PathView>,
    policy: PathPolicy,
    cursor: usize,
}

impl PathSet {
    /// `n` paths, none connected yet.
    pub fn new(n: usize, policy: PathPolicy) -> Self {
        PathSet {
            paths: vec![
                PathView {
                    connected: false,
                    ana: AnaView::Unknown,
                };
                n
            ],
            policy,
            cursor: 0,
        }
    }

    /// Every path, in the order given.
    pub fn paths(&self) -> &[PathView] {
        &self.paths
    }

    /// Takes an event; returns what to do.
    pub fn on(&mut self, ev: PathEvent) -> Option<PathAction> {
        match ev {
            PathEvent::Connected { path, ana } => {
                let p = self.paths.get_mut(path)?;
                p.connected = true;
                if ana {
                    p.ana = AnaView::Unknown;
                    return Some(PathAction::ReadAnaLog(path));
                }
                p.ana = AnaView::NotReported;
                None
            }
            PathEvent::Lost { path } => {
                let p = self.paths.get_mut(path)?;
                p.connected = false;
                None
            }
            PathEvent::AnaLog { path, groups } => {
                let p = self.paths.get_mut(path)?;
                p.ana = AnaView::Groups(groups.iter().map(|g| (g.grpid, g.state)).collect());
                None
            }
            PathEvent::AnaLogFailed { path } => {
                let p = self.paths.get_mut(path)?;
                if p.ana != AnaView::NotReported {
                    p.ana = AnaView::Unknown;
                }
                None
            }
            PathEvent::AnaChanged { path } => {
                let p = self.paths.get(path)?;
                (p.connected && p.ana != AnaView::NotReported)
                    .then_some(PathAction::ReadAnaLog(path))
            }
            PathEvent::AnaStatus { path, grpid, state } => {
                let p = self.paths.get_mut(path)?;
                match &mut p.ana {
                    AnaView::Groups(g) => {
                        g.insert(grpid, state);
                    }
                    other => *other = AnaView::Groups(BTreeMap::from([(grpid, state)])),
                }
                p.connected.then_some(PathAction::ReadAnaLog(path))
            }
        }
    }

    /// The tier of path `i` for group `grpid`: 0 optimized, 1 non-optimized, 2 connected
    /// with the state not known, 3 more for a path in `avoid`; `None`: not usable.
    fn tier(&self, i: usize, grpid: u32, avoid: u64) -> Option<u8> {
        let p = &self.paths[i];
        if !p.connected {
            return None;
        }
        let t = match p.state(grpid) {
            Some(AnaState::Optimized) => 0,
            Some(AnaState::NonOptimized) => 1,
            Some(_) => return None,
            None => 2,
        };
        Some(if i < 64 && avoid & (1 << i) != 0 {
            t + 3
        } else {
            t
        })
    }

    /// The path for the next command to a namespace of ANA group `grpid` (0: a namespace
    /// without a group, on controllers without ANA).
    pub fn select(&mut self, grpid: u32) -> Selection {
        self.select_avoiding(grpid, 0)
    }

    /// As [`select`](Self::select), but the paths whose bit is set in `avoid` (those a
    /// command already failed on) are taken only when no other path is usable.
    pub fn select_avoiding(&mut self, grpid: u32, avoid: u64) -> Selection {
        let n = self.paths.len();
        let best = (0..n).filter_map(|i| self.tier(i, grpid, avoid)).min();
        let Some(best) = best else {
            let lost = n > 0
                && self
                    .paths
                    .iter()
                    .all(|p| p.state(grpid) == Some(AnaState::PersistentLoss));
            return if lost {
                Selection::Never
            } else {
                Selection::Wait
            };
        };
        let start = match self.policy {
            PathPolicy::Failover => 0,
            PathPolicy::RoundRobin => self.cursor,
        };
        let pick = (0..n)
            .map(|k| (start + k) % n)
            .find(|&i| self.tier(i, grpid, avoid) == Some(best))
            .expect("a path of the best tier exists");
        self.cursor = (pick + 1) % n;
        Selection::Path(pick)
    }
}

/// What a failed command on one path means for multipath.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// The path refused the command with an ANA status (it was not carried out): note the
    /// state and send it on another path.
    Ana(AnaState),
    /// The path failed (a path-related status, a lost or failed connection, a timeout):
    /// send it on another path.
    Path,
    /// The command's own failure (or the host closed the paths): give it to the caller.
    Final,
}

/// Classifies a command's error for failover. A status with Do Not Retry set is final, as
/// on Linux.
pub fn classify(e: &Error) -> Failure {
    match e {
        Error::Status { status, .. } => classify_status(*status),
        Error::ControllerFailed { .. } => Failure::Path,
        e if e.is_transport() => Failure::Path,
        _ => Failure::Final,
    }
}

fn classify_status(s: Status) -> Failure {
    if s.sct != sct::PATH || s.dnr {
        return Failure::Final;
    }
    match s.sc {
        path_sc::ANA_INACCESSIBLE => Failure::Ana(AnaState::Inaccessible),
        path_sc::ANA_PERSISTENT_LOSS => Failure::Ana(AnaState::PersistentLoss),
        path_sc::ANA_TRANSITION => Failure::Ana(AnaState::Change),
        _ => Failure::Path,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log(path: usize, states: &[(u32, AnaState)]) -> PathEvent {
        PathEvent::AnaLog {
            path,
            groups: states
                .iter()
                .map(|&(grpid, state)| AnaGroup {
                    grpid,
                    state,
                    chgcnt: 1,
                    nsids: vec![],
                })
                .collect(),
        }
    }

    /// Two connected ANA paths: A optimized, B non-optimized for group 1.
    fn pair(policy: PathPolicy) -> PathSet {
        let mut s = PathSet::new(2, policy);
        for p in 0..2 {
            assert_eq!(
                s.on(PathEvent::Connected { path: p, ana: true }),
                Some(PathAction::ReadAnaLog(p))
            );
        }
        s.on(log(0, &[(1, AnaState::Optimized)]));
        s.on(log(1, &[(1, AnaState::NonOptimized)]));
        s
    }

    #[test]
    fn optimized_first_then_non_optimized() {
        let mut s = pair(PathPolicy::Failover);
        assert_eq!(s.select(1), Selection::Path(0));
        assert_eq!(s.select(1), Selection::Path(0));
        s.on(log(0, &[(1, AnaState::NonOptimized)]));
        // Both non-optimized: the first in order.
        assert_eq!(s.select(1), Selection::Path(0));
        s.on(log(1, &[(1, AnaState::Optimized)]));
        assert_eq!(s.select(1), Selection::Path(1));
    }

    #[test]
    fn never_inaccessible_persistent_loss_or_change() {
        let mut s = pair(PathPolicy::Failover);
        for st in [
            AnaState::Inaccessible,
            AnaState::PersistentLoss,
            AnaState::Change,
        ] {
            s.on(log(0, &[(1, st)]));
            assert_eq!(s.select(1), Selection::Path(1), "{st}");
        }
        s.on(log(1, &[(1, AnaState::Inaccessible)]));
        assert_eq!(s.select(1), Selection::Wait);
        s.on(log(0, &[(1, AnaState::PersistentLoss)]));
        s.on(log(1, &[(1, AnaState::PersistentLoss)]));
        assert_eq!(s.select(1), Selection::Never);
    }

    #[test]
    fn ana_status_on_io_marks_the_group_and_asks_for_the_log() {
        let mut s = pair(PathPolicy::Failover);
        let a = s.on(PathEvent::AnaStatus {
            path: 0,
            grpid: 1,
            state: AnaState::Inaccessible,
        });
        assert_eq!(a, Some(PathAction::ReadAnaLog(0)));
        assert_eq!(s.paths()[0].state(1), Some(AnaState::Inaccessible));
        assert_eq!(s.select(1), Selection::Path(1));
        // The log page later says optimized again: fail-back.
        s.on(log(0, &[(1, AnaState::Optimized)]));
        assert_eq!(s.select(1), Selection::Path(0));
    }

    #[test]
    fn lost_path_fails_over_and_fails_back_after_reconnect_and_log() {
        let mut s = pair(PathPolicy::Failover);
        s.on(PathEvent::Lost { path: 0 });
        assert_eq!(s.select(1), Selection::Path(1));
        // Reconnected: its state is unknown until the log is read, so B (known
        // non-optimized) stays preferred.
        assert_eq!(
            s.on(PathEvent::Connected { path: 0, ana: true }),
            Some(PathAction::ReadAnaLog(0))
        );
        assert_eq!(s.select(1), Selection::Path(1));
        s.on(log(0, &[(1, AnaState::Optimized)]));
        assert_eq!(s.select(1), Selection::Path(0));
        // Both lost: wait for one to come back.
        s.on(PathEvent::Lost { path: 0 });
        s.on(PathEvent::Lost { path: 1 });
        assert_eq!(s.select(1), Selection::Wait);
        s.on(PathEvent::Connected { path: 1, ana: true });
        // Unknown state, but the only connected path: used (the target refuses what it
        // cannot serve with an ANA status, which marks it).
        assert_eq!(s.select(1), Selection::Path(1));
    }

    #[test]
    fn change_notice_asks_for_the_log_only_on_connected_ana_paths() {
        let mut s = pair(PathPolicy::Failover);
        assert_eq!(
            s.on(PathEvent::AnaChanged { path: 1 }),
            Some(PathAction::ReadAnaLog(1))
        );
        s.on(PathEvent::Lost { path: 1 });
        assert_eq!(s.on(PathEvent::AnaChanged { path: 1 }), None);
        assert_eq!(s.on(PathEvent::AnaChanged { path: 7 }), None);
        s.on(PathEvent::AnaLogFailed { path: 0 });
        assert_eq!(s.paths()[0].ana, AnaView::Unknown);
    }

    #[test]
    fn controllers_without_ana_count_as_optimized() {
        let mut s = PathSet::new(2, PathPolicy::RoundRobin);
        assert_eq!(
            s.on(PathEvent::Connected {
                path: 0,
                ana: false
            }),
            None
        );
        assert_eq!(
            s.on(PathEvent::Connected {
                path: 1,
                ana: false
            }),
            None
        );
        assert_eq!(s.select(0), Selection::Path(0));
        assert_eq!(s.select(0), Selection::Path(1));
        assert_eq!(s.select(0), Selection::Path(0));
        s.on(PathEvent::Lost { path: 0 });
        assert_eq!(s.select(0), Selection::Path(1));
        assert_eq!(s.select(0), Selection::Path(1));
    }

    #[test]
    fn round_robin_stays_within_the_best_tier() {
        let mut s = PathSet::new(3, PathPolicy::RoundRobin);
        for p in 0..3 {
            s.on(PathEvent::Connected { path: p, ana: true });
        }
        s.on(log(0, &[(1, AnaState::Optimized)]));
        s.on(log(1, &[(1, AnaState::NonOptimized)]));
        s.on(log(2, &[(1, AnaState::Optimized)]));
        let picks: Vec<_> = (0..4).map(|_| s.select(1)).collect();
        assert_eq!(
            picks,
            [0, 2, 0, 2].map(Selection::Path).to_vec(),
            "the non-optimized path is skipped"
        );
        // Another group is listed only on path 1: only it knows it; the others are
        // unknown (tier 2) and path 1 reports non-optimized (tier 1).
        s.on(log(
            1,
            &[(1, AnaState::NonOptimized), (2, AnaState::NonOptimized)],
        ));
        assert_eq!(s.select(2), Selection::Path(1));
    }

    #[test]
    fn a_path_a_command_failed_on_is_avoided_while_another_is_usable() {
        let mut s = pair(PathPolicy::Failover);
        assert_eq!(s.select_avoiding(1, 0b01), Selection::Path(1));
        assert_eq!(s.select_avoiding(1, 0b11), Selection::Path(0));
        s.on(PathEvent::Lost { path: 1 });
        assert_eq!(s.select_avoiding(1, 0b01), Selection::Path(0));
    }

    #[test]
    fn errors_are_classified_for_failover() {
        let st = |sct, sc, dnr| Error::Status {
            command: "Write",
            status: Status {
                sct,
                sc,
                dnr,
                ..Default::default()
            },
            name: "x",
        };
        assert_eq!(
            classify(&st(sct::PATH, path_sc::ANA_INACCESSIBLE, false)),
            Failure::Ana(AnaState::Inaccessible)
        );
        assert_eq!(
            classify(&st(sct::PATH, path_sc::ANA_PERSISTENT_LOSS, false)),
            Failure::Ana(AnaState::PersistentLoss)
        );
        assert_eq!(
            classify(&st(sct::PATH, path_sc::ANA_TRANSITION, false)),
            Failure::Ana(AnaState::Change)
        );
        assert_eq!(classify(&st(sct::PATH, 0x70, false)), Failure::Path);
        assert_eq!(
            classify(&st(sct::PATH, path_sc::ANA_INACCESSIBLE, true)),
            Failure::Final
        );
        assert_eq!(classify(&st(0, 0x80, false)), Failure::Final);
        assert_eq!(classify(&Error::lost("a", "reset")), Failure::Path);
        assert_eq!(
            classify(&Error::Interrupted {
                command: "Write",
                addr: "a".into(),
                reason: "reset".into()
            }),
            Failure::Path
        );
        assert_eq!(
            classify(&Error::ControllerFailed {
                addr: "a".into(),
                reason: "gave up".into()
            }),
            Failure::Path
        );
        assert_eq!(classify(&Error::Closed), Failure::Final);
        assert_eq!(
            classify(&Error::InvalidArgument("x".into())),
            Failure::Final
        );
    }
}
