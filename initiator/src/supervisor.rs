//! The supervisor of a controller's association: a state machine with no sockets and no
//! timers. It is fed events (the association came up, a connection was lost, keep-alive is
//! due, the reconnect timer fired, a reconnect attempt ended, an asynchronous event
//! completed, the host asked to disconnect), each with the time it happened, and answers
//! with actions for the controller to carry out. The controller's supervisor task
//! ([`crate::controller`]) owns one, sleeps until [`Supervisor::next_timer`], and performs
//! the actions.
//!
//! States follow Linux's `nvme_change_ctrl_state`:
//!
//! | from \ to  | Live | Resetting | Connecting | Deleting | Dead |
//! |------------|------|-----------|------------|----------|------|
//! | New        | yes  |           |            | yes      |      |
//! | Live       |      | yes       |            | yes      |      |
//! | Resetting  |      |           | yes        | yes      | yes  |
//! | Connecting | yes  |           | yes        | yes      | yes  |
//! | Dead       |      |           |            | yes      |      |
//!
//! Reconnecting follows `nvmf_should_reconnect`: the first attempt waits the policy's
//! initial delay, each failed one doubles the delay up to its maximum, and once the
//! association has been down for `ctrl_loss_timeout` the controller gives up (Dead) and
//! every queued command fails.

use std::time::{Duration, Instant};

use crate::{Error, ReconnectPolicy};

/// Shortest delay between reconnect attempts.
const MIN_RECONNECT_DELAY: Duration = Duration::from_millis(10);
/// Shortest keep-alive period.
const MIN_KEEP_ALIVE_PERIOD: Duration = Duration::from_millis(50);

/// Where the association stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum State {
    /// Not yet established.
    New,
    /// Every queue is connected.
    Live,
    /// A connection was lost; the queues are detached and the first attempt waits.
    Resetting,
    /// Reconnect attempts are made (or the next one waits its delay).
    Connecting,
    /// The host disconnects; nothing more happens.
    Deleting,
    /// Reconnecting gave up; every command fails.
    Dead,
}

/// Something that happened to the association.
#[derive(Debug)]
pub(crate) enum Event {
    /// The first association is up.
    Established,
    /// A queue lost its connection, or Keep Alive failed, in association `generation`.
    ConnectionLost {
        /// The association the report is about (older reports are ignored).
        generation: u64,
        /// What happened.
        error: Error,
    },
    /// The keep-alive timer fired.
    KeepAliveDue,
    /// The Keep Alive sent last ended: `None` when it succeeded.
    KeepAliveDone {
        /// The association it was sent in.
        generation: u64,
        /// The error it ended with.
        error: Option<Error>,
    },
    /// The reconnect timer fired.
    ReconnectTimer,
    /// The reconnect attempt succeeded.
    ReconnectSucceeded,
    /// The reconnect attempt failed.
    ReconnectFailed(Error),
    /// An Asynchronous Event Request completed with `dw0` in association `generation`.
    Aen {
        /// The association it completed in.
        generation: u64,
        /// Completion DW0.
        dw0: u32,
    },
    /// The host disconnects.
    ShutdownRequested,
}

/// What the controller has to do.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Action {
    /// Detach every queue (in-flight commands wait to be handed to the next association).
    DetachQueues,
    /// Make reconnect attempt `attempt` now: set up a new association.
    Reconnect {
        /// Attempts made so far, this one included.
        attempt: u32,
    },
    /// Hand the queues the association just set up, as generation `generation`.
    Install {
        /// The new association's generation.
        generation: u64,
    },
    /// Give up: fail every queue (and what waits in it), the controller having failed for
    /// `reason`.
    GiveUp {
        /// The last error.
        reason: String,
    },
    /// Send one Keep Alive, bounded by `timeout`.
    SendKeepAlive {
        /// The association it is sent in.
        generation: u64,
        /// How long it may take.
        timeout: Duration,
    },
    /// Handle an asynchronous event (read its log page, refresh the namespaces).
    HandleAsyncEvent(u32),
    /// Shut down: close the queues, with CC.SHN first when `graceful`.
    Shutdown {
        /// Whether the controller is connected and can be asked for a normal shutdown.
        graceful: bool,
    },
}

/// The supervisor's state machine.
#[derive(Debug)]
pub(crate) struct Supervisor {
    state: State,
    policy: ReconnectPolicy,
    /// Keep-alive period (None: keep-alive off).
    keep_alive: Option<Duration>,
    /// Admin command timeout (bounds each Keep Alive).
    admin_timeout: Duration,
    /// The association's generation; queue reports of older ones are ignored.
    generation: u64,
    /// When the next Keep Alive is due (while Live).
    keep_alive_at: Option<Instant>,
    /// Whether a Keep Alive is on its way.
    keep_alive_sent: bool,
    /// When the connection was lost (while Resetting or Connecting).
    lost_at: Option<Instant>,
    /// When the next reconnect attempt starts (while waiting for it).
    reconnect_at: Option<Instant>,
    /// Whether an attempt runs.
    attempting: bool,
    /// The delay before the next attempt.
    delay: Duration,
    /// Attempts made since the connection was lost.
    attempt: u32,
    /// Why the connection or the last attempt failed.
    last_error: Option<Error>,
    /// Asynchronous events that completed while reconnecting, handled once live again.
    held_events: Vec<u32>,
}

impl Supervisor {
    /// A supervisor for an association not yet established. `kato` is the keep alive
    /// timeout in force (zero: keep-alive off): Keep Alive goes out every `kato / 2`.
    pub fn new(policy: ReconnectPolicy, kato: Duration, admin_timeout: Duration) -> Self {
        let keep_alive = (!kato.is_zero()).then(|| (kato / 2).max(MIN_KEEP_ALIVE_PERIOD));
        Supervisor {
            state: State::New,
            delay: policy.initial_delay,
            policy,
            keep_alive,
            admin_timeout,
            generation: 1,
            keep_alive_at: None,
            keep_alive_sent: false,
            lost_at: None,
            reconnect_at: None,
            attempting: false,
            attempt: 0,
            last_error: None,
            held_events: Vec::new(),
        }
    }

    /// The state now.
    pub fn state(&self) -> State {
        self.state
    }

    /// The association's generation.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Attempts made since the connection was lost.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// Why the connection or the last attempt failed (while reconnecting or dead).
    pub fn last_error(&self) -> Option<&Error> {
        self.last_error.as_ref()
    }

    /// The next timer: when it fires and the event to feed then.
    pub fn next_timer(&self) -> Option<(Instant, Event)> {
        match self.state {
            State::Live if !self.keep_alive_sent => {
                self.keep_alive_at.map(|at| (at, Event::KeepAliveDue))
            }
            State::Resetting | State::Connecting if !self.attempting => {
                self.reconnect_at.map(|at| (at, Event::ReconnectTimer))
            }
            _ => None,
        }
    }

    /// Moves to `to` if the state table allows it.
    fn change(&mut self, to: State) -> bool {
        use State::*;
        let ok = matches!(
            (self.state, to),
            (New, Live | Deleting)
                | (Live, Resetting | Deleting)
                | (Resetting, Connecting | Deleting | Dead)
                | (Connecting, Live | Connecting | Deleting | Dead)
                | (Dead, Deleting)
        );
        if ok {
            self.state = to;
        }
        ok
    }

    /// Handles `event`, which happened at `now`, and says what to do.
    pub fn handle(&mut self, now: Instant, event: Event) -> Vec<Action> {
        match event {
            Event::Established => {
                if !self.change(State::Live) {
                    return Vec::new();
                }
                self.arm_keep_alive(now);
                Vec::new()
            }
            Event::ConnectionLost { generation, error } => self.lost(now, generation, error),
            Event::KeepAliveDue => {
                let due = self.keep_alive_at.is_some_and(|at| now >= at);
                match (self.state, self.keep_alive) {
                    (State::Live, Some(period)) if due && !self.keep_alive_sent => {
                        self.keep_alive_sent = true;
                        self.keep_alive_at = Some(now + period);
                        vec![Action::SendKeepAlive {
                            generation: self.generation,
                            timeout: self.admin_timeout.min(period * 2),
                        }]
                    }
                    _ => Vec::new(),
                }
            }
            Event::KeepAliveDone { generation, error } => {
                if generation == self.generation {
                    self.keep_alive_sent = false;
                }
                match error {
                    // A lost connection or a timeout is reported by the queue itself.
                    Some(e) if !matches!(e, Error::Closed) && !e.is_transport() => {
                        self.lost(now, generation, e)
                    }
                    _ => Vec::new(),
                }
            }
            Event::ReconnectTimer => {
                let due = self.reconnect_at.is_some_and(|at| now >= at);
                if !due || self.attempting || !self.change(State::Connecting) {
                    return Vec::new();
                }
                self.reconnect_at = None;
                self.attempting = true;
                self.attempt += 1;
                vec![Action::Reconnect {
                    attempt: self.attempt,
                }]
            }
            Event::ReconnectSucceeded => {
                if !self.attempting || !self.change(State::Live) {
                    return Vec::new();
                }
                self.attempting = false;
                self.lost_at = None;
                self.last_error = None;
                self.attempt = 0;
                self.delay = self.policy.initial_delay;
                self.keep_alive_sent = false;
                self.arm_keep_alive(now);
                let mut out = vec![Action::Install {
                    generation: self.generation,
                }];
                out.extend(self.held_events.drain(..).map(Action::HandleAsyncEvent));
                out
            }
            Event::ReconnectFailed(error) => {
                if !self.attempting || self.state != State::Connecting {
                    return Vec::new();
                }
                self.attempting = false;
                self.last_error = Some(error);
                self.delay = (self.delay * 2)
                    .min(self.policy.max_delay)
                    .max(MIN_RECONNECT_DELAY);
                self.give_up_or_wait(now)
            }
            Event::Aen { generation, dw0 } => match self.state {
                State::Live if generation == self.generation => {
                    vec![Action::HandleAsyncEvent(dw0)]
                }
                State::Resetting | State::Connecting => {
                    self.held_events.push(dw0);
                    Vec::new()
                }
                _ => Vec::new(),
            },
            Event::ShutdownRequested => {
                let graceful = self.state == State::Live;
                if !self.change(State::Deleting) {
                    return Vec::new();
                }
                self.attempting = false;
                self.held_events.clear();
                vec![Action::Shutdown { graceful }]
            }
        }
    }

    fn arm_keep_alive(&mut self, now: Instant) {
        self.keep_alive_at = self.keep_alive.map(|period| now + period);
    }

    /// The connection of association `generation` is lost.
    fn lost(&mut self, now: Instant, generation: u64, error: Error) -> Vec<Action> {
        if generation != self.generation || !self.change(State::Resetting) {
            return Vec::new();
        }
        self.generation += 1;
        self.lost_at = Some(now);
        self.attempt = 0;
        self.delay = self.policy.initial_delay;
        self.keep_alive_at = None;
        self.keep_alive_sent = false;
        self.last_error = Some(error);
        let mut out = vec![Action::DetachQueues];
        out.extend(self.give_up_or_wait(now));
        out
    }

    /// After a loss or a failed attempt: gives up once the connection has been lost for
    /// `ctrl_loss_timeout`, else waits the delay before the next attempt.
    fn give_up_or_wait(&mut self, now: Instant) -> Vec<Action> {
        let lost_for = now.saturating_duration_since(self.lost_at.unwrap_or(now));
        if self
            .policy
            .ctrl_loss_timeout
            .is_some_and(|limit| lost_for >= limit)
            && self.change(State::Dead)
        {
            self.reconnect_at = None;
            self.held_events.clear();
            let reason = self
                .last_error
                .as_ref()
                .map(Error::to_string)
                .unwrap_or_default();
            return vec![Action::GiveUp { reason }];
        }
        self.reconnect_at = Some(now + self.delay);
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KATO: Duration = Duration::from_secs(10);
    const ADMIN: Duration = Duration::from_secs(3);

    fn policy(limit: Option<u64>) -> ReconnectPolicy {
        ReconnectPolicy {
            initial_delay: Duration::from_millis(100),
            max_delay: Duration::from_millis(500),
            ctrl_loss_timeout: limit.map(Duration::from_millis),
        }
    }

    fn lost() -> Error {
        Error::lost("a", "reset".to_string())
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// A live supervisor at time `t0`.
    fn live(limit: Option<u64>) -> (Supervisor, Instant) {
        let t0 = Instant::now();
        let mut s = Supervisor::new(policy(limit), KATO, ADMIN);
        assert_eq!(s.state(), State::New);
        assert!(s.handle(t0, Event::Established).is_empty());
        assert_eq!(s.state(), State::Live);
        (s, t0)
    }

    fn fire(s: &mut Supervisor) -> (Instant, Vec<Action>) {
        let (at, ev) = s.next_timer().expect("a timer");
        (at, s.handle(at, ev))
    }

    #[test]
    fn keep_alive_every_half_kato_one_at_a_time() {
        let (mut s, t0) = live(None);
        let (at, acts) = fire(&mut s);
        assert_eq!(at, t0 + KATO / 2);
        assert_eq!(
            acts,
            vec![Action::SendKeepAlive {
                generation: 1,
                timeout: ADMIN
            }]
        );
        // No second one while the first is on its way.
        assert!(s.next_timer().is_none());
        assert!(s.handle(at + KATO, Event::KeepAliveDue).is_empty());
        let done = Event::KeepAliveDone {
            generation: 1,
            error: None,
        };
        assert!(s.handle(at + ms(1), done).is_empty());
        let (next, _) = fire(&mut s);
        assert_eq!(next, at + KATO / 2);
        // Early timer events send nothing.
        let mut s = live(None).0;
        assert!(s.handle(t0, Event::KeepAliveDue).is_empty());
    }

    #[test]
    fn keep_alive_off_with_zero_kato() {
        let t0 = Instant::now();
        let mut s = Supervisor::new(policy(None), Duration::ZERO, ADMIN);
        s.handle(t0, Event::Established);
        assert!(s.next_timer().is_none());
        assert!(s.handle(t0 + KATO, Event::KeepAliveDue).is_empty());
    }

    #[test]
    fn keep_alive_error_status_reconnects_transport_errors_do_not() {
        let (mut s, t0) = live(None);
        let (at, _) = fire(&mut s);
        let timeout = Event::KeepAliveDone {
            generation: 1,
            error: Some(Error::timeout("Keep Alive", ADMIN)),
        };
        assert!(s.handle(at, timeout).is_empty());
        assert_eq!(s.state(), State::Live);
        let closed = Event::KeepAliveDone {
            generation: 1,
            error: Some(Error::Closed),
        };
        assert!(s.handle(at, closed).is_empty());
        let refused = Event::KeepAliveDone {
            generation: 1,
            error: Some(Error::Refused("no".into())),
        };
        assert_eq!(s.handle(t0, refused), vec![Action::DetachQueues]);
        assert_eq!(s.state(), State::Resetting);
    }

    #[test]
    fn loss_waits_the_delay_then_reconnects_and_installs() {
        let (mut s, t0) = live(None);
        let acts = s.handle(
            t0,
            Event::ConnectionLost {
                generation: 1,
                error: lost(),
            },
        );
        assert_eq!(acts, vec![Action::DetachQueues]);
        assert_eq!(s.state(), State::Resetting);
        assert_eq!(s.generation(), 2);
        assert_eq!(s.attempt(), 0);
        // The timer is not early.
        assert!(s.handle(t0 + ms(99), Event::ReconnectTimer).is_empty());
        let (at, acts) = fire(&mut s);
        assert_eq!(at, t0 + ms(100));
        assert_eq!(acts, vec![Action::Reconnect { attempt: 1 }]);
        assert_eq!(s.state(), State::Connecting);
        // No timer while the attempt runs.
        assert!(s.next_timer().is_none());
        let acts = s.handle(at + ms(5), Event::ReconnectSucceeded);
        assert_eq!(acts, vec![Action::Install { generation: 2 }]);
        assert_eq!(s.state(), State::Live);
        // Keep-alive runs again from the reconnect.
        let (next, _) = fire(&mut s);
        assert_eq!(next, at + ms(5) + KATO / 2);
    }

    #[test]
    fn failed_attempts_double_the_delay_up_to_the_maximum() {
        let (mut s, t0) = live(None);
        s.handle(
            t0,
            Event::ConnectionLost {
                generation: 1,
                error: lost(),
            },
        );
        let mut now = t0;
        let mut delays = Vec::new();
        for n in 1..=5 {
            let (at, acts) = fire(&mut s);
            delays.push(at - now);
            assert_eq!(acts, vec![Action::Reconnect { attempt: n }]);
            now = at;
            assert!(s.handle(now, Event::ReconnectFailed(lost())).is_empty());
            assert_eq!(s.state(), State::Connecting);
            assert_eq!(s.attempt(), n);
        }
        assert_eq!(delays, [100, 200, 400, 500, 500].map(ms));
        // A later loss starts from the initial delay again.
        let (at, _) = fire(&mut s);
        let now = at;
        s.handle(now, Event::ReconnectSucceeded);
        s.handle(
            now,
            Event::ConnectionLost {
                generation: 2,
                error: lost(),
            },
        );
        assert_eq!(fire(&mut s).0, now + ms(100));
    }

    #[test]
    fn gives_up_after_ctrl_loss_timeout() {
        let (mut s, t0) = live(Some(250));
        s.handle(
            t0,
            Event::ConnectionLost {
                generation: 1,
                error: lost(),
            },
        );
        let (at, _) = fire(&mut s); // t0 + 100
        assert!(s.handle(at, Event::ReconnectFailed(lost())).is_empty());
        let (at, _) = fire(&mut s); // t0 + 300
        let acts = s.handle(at, Event::ReconnectFailed(Error::Refused("gone".into())));
        assert!(matches!(
            acts.as_slice(),
            [Action::GiveUp { reason }] if reason.contains("gone")
        ));
        assert_eq!(s.state(), State::Dead);
        assert!(s.last_error().unwrap().to_string().contains("gone"));
        assert!(s.next_timer().is_none());
        // Nothing revives it but a shutdown ends it.
        assert!(s.handle(at, Event::ReconnectTimer).is_empty());
        let lost_again = Event::ConnectionLost {
            generation: 2,
            error: lost(),
        };
        assert!(s.handle(at, lost_again).is_empty());
        assert_eq!(
            s.handle(at, Event::ShutdownRequested),
            vec![Action::Shutdown { graceful: false }]
        );
        assert_eq!(s.state(), State::Deleting);
    }

    #[test]
    fn zero_ctrl_loss_timeout_gives_up_at_once() {
        let (mut s, t0) = live(Some(0));
        let acts = s.handle(
            t0,
            Event::ConnectionLost {
                generation: 1,
                error: lost(),
            },
        );
        assert!(matches!(
            acts.as_slice(),
            [Action::DetachQueues, Action::GiveUp { .. }]
        ));
        assert_eq!(s.state(), State::Dead);
    }

    #[test]
    fn reports_of_older_associations_are_ignored() {
        let (mut s, t0) = live(None);
        let report = |g| Event::ConnectionLost {
            generation: g,
            error: lost(),
        };
        s.handle(t0, report(1));
        // Every other queue of the same association reports the loss too.
        assert!(s.handle(t0, report(1)).is_empty());
        let (at, _) = fire(&mut s);
        s.handle(at, Event::ReconnectSucceeded);
        assert!(s.handle(at, report(1)).is_empty());
        assert_eq!(s.state(), State::Live);
        let stale_aen = Event::Aen {
            generation: 1,
            dw0: 2,
        };
        assert!(s.handle(at, stale_aen).is_empty());
        assert_eq!(s.handle(at, report(2)), vec![Action::DetachQueues]);
    }

    #[test]
    fn async_events_handled_when_live_held_while_reconnecting() {
        let (mut s, t0) = live(None);
        let aen = |g, dw0| Event::Aen { generation: g, dw0 };
        assert_eq!(
            s.handle(t0, aen(1, 0x0004_0002)),
            vec![Action::HandleAsyncEvent(0x0004_0002)]
        );
        s.handle(
            t0,
            Event::ConnectionLost {
                generation: 1,
                error: lost(),
            },
        );
        assert!(s.handle(t0, aen(1, 7)).is_empty());
        let (at, _) = fire(&mut s);
        assert!(s.handle(at, aen(1, 8)).is_empty());
        assert_eq!(
            s.handle(at, Event::ReconnectSucceeded),
            vec![
                Action::Install { generation: 2 },
                Action::HandleAsyncEvent(7),
                Action::HandleAsyncEvent(8)
            ]
        );
    }

    #[test]
    fn shutdown_while_reconnecting_stops_the_attempts() {
        let (mut s, t0) = live(None);
        s.handle(
            t0,
            Event::ConnectionLost {
                generation: 1,
                error: lost(),
            },
        );
        let (at, _) = fire(&mut s);
        assert_eq!(
            s.handle(at, Event::ShutdownRequested),
            vec![Action::Shutdown { graceful: false }]
        );
        assert_eq!(s.state(), State::Deleting);
        assert!(s.next_timer().is_none());
        // The attempt that was running ends into nothing.
        assert!(s.handle(at, Event::ReconnectSucceeded).is_empty());
        assert!(s.handle(at, Event::ReconnectFailed(lost())).is_empty());
        assert_eq!(s.state(), State::Deleting);
        // Shutdown during the wait before an attempt, too.
        let (mut s, t0) = live(None);
        s.handle(
            t0,
            Event::ConnectionLost {
                generation: 1,
                error: lost(),
            },
        );
        s.handle(t0, Event::ShutdownRequested);
        assert!(s.handle(t0 + KATO, Event::ReconnectTimer).is_empty());
    }

    #[test]
    fn shutdown_when_live_is_graceful_and_happens_once() {
        let (mut s, t0) = live(None);
        assert_eq!(
            s.handle(t0, Event::ShutdownRequested),
            vec![Action::Shutdown { graceful: true }]
        );
        assert!(s.handle(t0, Event::ShutdownRequested).is_empty());
        assert!(s.next_timer().is_none());
        assert!(s.handle(t0 + KATO, Event::KeepAliveDue).is_empty());
        let lost_now = Event::ConnectionLost {
            generation: 1,
            error: lost(),
        };
        assert!(s.handle(t0, lost_now).is_empty());
        assert_eq!(s.state(), State::Deleting);
        // Before the association is up.
        let mut s = Supervisor::new(policy(None), KATO, ADMIN);
        assert_eq!(
            s.handle(t0, Event::ShutdownRequested),
            vec![Action::Shutdown { graceful: false }]
        );
    }

    #[test]
    fn state_table() {
        use State::*;
        let all = [New, Live, Resetting, Connecting, Deleting, Dead];
        let legal = [
            (New, Live),
            (New, Deleting),
            (Live, Resetting),
            (Live, Deleting),
            (Resetting, Connecting),
            (Resetting, Deleting),
            (Resetting, Dead),
            (Connecting, Live),
            (Connecting, Connecting),
            (Connecting, Deleting),
            (Connecting, Dead),
            (Dead, Deleting),
        ];
        for from in all {
            for to in all {
                let mut s = Supervisor::new(policy(None), KATO, ADMIN);
                s.state = from;
                let ok = s.change(to);
                assert_eq!(ok, legal.contains(&(from, to)), "{from:?} -> {to:?}");
                assert_eq!(s.state, if ok { to } else { from });
            }
        }
    }

    #[test]
    fn events_out_of_place_are_refused() {
        let t0 = Instant::now();
        let mut s = Supervisor::new(policy(None), KATO, ADMIN);
        // Nothing but Established or a shutdown moves a new supervisor.
        for ev in [
            Event::ConnectionLost {
                generation: 1,
                error: lost(),
            },
            Event::ReconnectTimer,
            Event::ReconnectSucceeded,
            Event::ReconnectFailed(lost()),
            Event::KeepAliveDue,
        ] {
            assert!(s.handle(t0, ev).is_empty());
            assert_eq!(s.state(), State::New);
        }
        let (mut s, t0) = live(None);
        assert!(s.handle(t0, Event::Established).is_empty());
        assert!(s.handle(t0, Event::ReconnectSucceeded).is_empty());
        assert!(s.handle(t0, Event::ReconnectFailed(lost())).is_empty());
        assert!(s.handle(t0 + KATO, Event::ReconnectTimer).is_empty());
        assert_eq!(s.state(), State::Live);
    }
}
