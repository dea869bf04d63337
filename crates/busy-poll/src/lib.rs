//! When a queue should busy-poll instead of sleeping.
//!
//! A thread that sleeps until its socket is readable pays a wake-up for every message: on
//! virtual machines and in deep C-states that is tens of microseconds, more than the rest of
//! a 4 KiB read over loopback. Polling for a short window after activity removes that cost
//! while I/O flows, and an idle queue still sleeps. A fixed window wastes CPU when traffic is
//! sparse, though: if the next message comes long after the window, every window is spun for
//! nothing.
//!
//! [`PollGate`] decides. After a submission it polls for the window: the answer is due, and
//! catching it without a wake-up is what the window is for. Each arrival (data received) is
//! scored as a *hit* when it came within the window of the previous activity (an arrival or a
//! submission), so polling would have caught it without a sleep, and a *miss* otherwise. After
//! an arrival the gate polls only while enough recent arrivals were hits (an exponentially
//! weighted share of at least a quarter):
//!
//! - dense traffic (a QD1 loop, a busy queue): arrivals are hits and the window stays open;
//! - sparse traffic (a message every few milliseconds): arrivals are misses, the share decays
//!   within a dozen arrivals and the queue goes back to sleeping between messages (a
//!   submission still polls for its answer, at most one window);
//! - idle: no activity, so no window, whatever the share.
//!
//! A gate may also *hold* the window open longer than it scores by ([`PollGate::with_hold`]):
//! while traffic is dense, it then polls for the hold after the last activity, and arrivals
//! are still scored against the window. A peer that sends in bursts (a host that reads a
//! batch of answers, then submits the next commands) pauses between them for longer than the
//! window while most arrivals still come within it: the hold keeps the gate polling through
//! those pauses instead of sleeping and being woken for each burst, and steady traffic that
//! is merely slower than the window still sleeps (its arrivals are misses).
//!
//! Polling after a submission whatever the share matters when the peer sleeps between
//! messages too: each side's wake-up then makes every answer late, so arrivals score as misses
//! and neither side would start polling (two sleeping sides on a small virtual machine: ~90 µs
//! per QD1 read instead of ~11). Caught by polling, the answer comes back within the window,
//! the next command follows it at once, and the peer's own gate opens.
//!
//! Sans-IO: the caller passes the time; no clock, thread or allocation inside.

#![forbid(unsafe_code)]

use std::time::{Duration, Instant};

/// Full scale of the hit share (fixed point: 256 = every recent arrival was a hit).
const FULL: u16 = 256;
/// Polls while the hit share is at least this (a quarter).
const THRESHOLD: u16 = FULL / 4;
/// Weight of the newest arrival: 1/8.
const SHIFT: u16 = 3;

/// The longest a party that is [`Alone`] on its thread should read its socket in a loop before
/// the thread's other work runs again, whatever the window.
pub const SPIN_MAX: Duration = Duration::from_micros(50);

/// A party reading its socket in a loop looks at the clock (for [`SPIN_MAX`] and its window)
/// once every this many reads that found nothing, not on every one.
pub const SPIN_CLOCK_EVERY: u32 = 16;

/// Whether one party (a connection, a queue: any `u64` key) alone has been receiving data on
/// a thread that several share: the last one that did, and until when it has not been alone
/// (another one received data within the hold before that). A party alone on its thread may
/// read its own socket in a loop for a while (at most [`SPIN_MAX`] at a time) instead of
/// going back to the thread's event loop, which nobody else is then waiting for.
#[derive(Debug, Clone, Copy, Default)]
pub struct Alone {
    last: Option<u64>,
    shared_until: Option<Instant>,
}

impl Alone {
    /// Nobody received anything yet.
    pub const fn new() -> Alone {
        Alone {
            last: None,
            shared_until: None,
        }
    }

    /// Notes that `party` received data at `now`; another party's data ends its being alone
    /// until `hold` after that.
    pub fn arrived(&mut self, party: u64, now: Instant, hold: Duration) {
        if self.last != Some(party) {
            if self.last.is_some() {
                self.shared_until = Some(now + hold);
            }
            self.last = Some(party);
        }
    }

    /// Whether `party` is the only one that received data within the hold before `now`.
    pub fn alone(&self, party: u64, now: Instant) -> bool {
        self.last == Some(party) && self.shared_until.is_none_or(|t| now >= t)
    }
}

/// Whether a queue has had at most one command in flight for a while: its caller waits for
/// one answer at a time (a QD1 loop), rather than finding a busy queue drained for a moment
/// (while its caller's other work, which a loop would hold up, refills it). Only such a
/// caller reads its socket in a loop for its answer.
#[derive(Debug, Clone, Copy, Default)]
pub struct OneInFlight {
    /// When a command was last submitted with another one in flight.
    crowded_at: Option<Instant>,
}

impl OneInFlight {
    /// Notes a submission at `now` that left `in_flight` commands in flight (itself included).
    pub fn submitted(&mut self, in_flight: usize, now: Instant) {
        if in_flight > 1 {
            self.crowded_at = Some(now);
        }
    }

    /// Whether no submission within `hold` before `now` found another command in flight.
    pub fn alone(&self, now: Instant, hold: Duration) -> bool {
        self.crowded_at
            .is_none_or(|t| now.saturating_duration_since(t) >= hold)
    }
}

/// The busy-poll decision of one queue or thread (see the crate documentation).
#[derive(Debug, Clone, Copy)]
pub struct PollGate {
    window: Duration,
    /// How long after the last activity dense traffic is polled for (at least `window`).
    hold: Duration,
    last: Option<Instant>,
    /// The last submission.
    submitted: Option<Instant>,
    share: u16,
}

impl PollGate {
    /// A gate with this window; a zero window never polls. Starts closed: polling begins
    /// once a few arrivals show traffic dense enough to pay for it.
    pub fn new(window: Duration) -> Self {
        Self::with_hold(window, window)
    }

    /// A gate that scores arrivals against `window` and, while traffic is dense, polls for
    /// `hold` after the last activity (`window` when `hold` is shorter). A zero window never
    /// polls.
    pub fn with_hold(window: Duration, hold: Duration) -> Self {
        PollGate {
            window,
            hold: hold.max(window),
            last: None,
            submitted: None,
            share: 0,
        }
    }

    /// The window arrivals are scored against.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// Notes data received at `now`, scoring it against the previous activity.
    pub fn arrived(&mut self, now: Instant) {
        let hit = self
            .last
            .is_some_and(|last| now.saturating_duration_since(last) < self.window);
        self.share = if hit {
            self.share + ((FULL - self.share) >> SHIFT).max(u16::from(self.share < FULL))
        } else {
            self.share - (self.share >> SHIFT).max(self.share.min(1))
        };
        self.last = Some(now);
    }

    /// Notes a submission at `now`: the window opens for its answer (the next arrival)
    /// whatever the share, and that answer is scored against the submission.
    pub fn submitted(&mut self, now: Instant) {
        self.last = Some(now);
        self.submitted = Some(now);
    }

    /// Whether to poll at `now` rather than sleep: within the window of the last submission,
    /// or within the hold of the last activity while recent traffic is dense enough.
    pub fn polling(&self, now: Instant) -> bool {
        !self.remaining(now).is_zero()
    }

    /// How long from `now` the window stays open (zero when not polling).
    pub fn remaining(&self, now: Instant) -> Duration {
        let left = |t: Option<Instant>, span: Duration| {
            t.map_or(Duration::ZERO, |t| {
                span.saturating_sub(now.saturating_duration_since(t))
            })
        };
        let dense = if self.share >= THRESHOLD {
            left(self.last, self.hold)
        } else {
            Duration::ZERO
        };
        left(self.submitted, self.window).max(dense)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: Duration = Duration::from_micros(50);

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    /// Arrivals every `gap` starting at `t`; returns the time of the last.
    fn arrivals(g: &mut PollGate, mut t: Instant, gap: Duration, n: usize) -> Instant {
        for _ in 0..n {
            t += gap;
            g.arrived(t);
        }
        t
    }

    #[test]
    fn a_party_is_alone_until_another_receives_and_again_a_hold_later() {
        let hold = us(200);
        let t = Instant::now();
        let mut alone = Alone::default();
        assert!(!alone.alone(1, t), "nobody received anything yet");
        alone.arrived(1, t, hold);
        assert!(alone.alone(1, t) && !alone.alone(2, t));
        alone.arrived(1, t + us(10), hold);
        assert!(alone.alone(1, t + us(10)));

        // 2 receives: neither is alone until a hold has passed with only one of them.
        alone.arrived(2, t + us(20), hold);
        assert!(!alone.alone(1, t + us(21)) && !alone.alone(2, t + us(21)));
        alone.arrived(1, t + us(30), hold);
        assert!(!alone.alone(1, t + us(31)));
        assert!(!alone.alone(1, t + us(229)), "2 was active 200 us before");
        assert!(alone.alone(1, t + us(230)));
        assert!(!alone.alone(2, t + us(230)), "1 received last");
    }

    #[test]
    fn one_in_flight_only_after_a_hold_without_a_second_command() {
        let hold = us(200);
        let t = Instant::now();
        let mut one = OneInFlight::default();
        assert!(
            one.alone(t, hold),
            "nothing was ever in flight beside another"
        );
        one.submitted(1, t);
        assert!(one.alone(t + us(1), hold));

        // A busy queue drained to one command for a moment is not a QD1 caller.
        one.submitted(64, t + us(10));
        one.submitted(1, t + us(20));
        assert!(!one.alone(t + us(20), hold));
        assert!(!one.alone(t + us(209), hold));
        assert!(one.alone(t + us(210), hold));
        one.submitted(2, t + us(300));
        assert!(!one.alone(t + us(301), hold));
    }

    #[test]
    fn starts_closed_and_a_zero_window_never_polls() {
        let t = Instant::now();
        let mut g = PollGate::new(W);
        assert!(!g.polling(t));
        g.arrived(t);
        assert!(!g.polling(t), "one arrival is not yet dense traffic");

        let mut z = PollGate::new(Duration::ZERO);
        let end = arrivals(&mut z, t, us(1), 100);
        assert!(!z.polling(end));
        assert_eq!(z.remaining(end), Duration::ZERO);
    }

    #[test]
    fn dense_traffic_opens_the_window_within_a_few_arrivals() {
        let t = Instant::now();
        let mut g = PollGate::new(W);
        g.arrived(t);
        let mut opened_after = None;
        let mut now = t;
        for i in 1..=10 {
            now += us(30);
            g.arrived(now);
            if g.polling(now) && opened_after.is_none() {
                opened_after = Some(i);
            }
        }
        let n = opened_after.expect("the window opens");
        assert!(n <= 4, "opened after {n} hits");
        assert!(g.polling(now + us(49)));
        assert!(
            !g.polling(now + us(50)),
            "the window ends {W:?} after the last activity"
        );
        assert_eq!(g.remaining(now + us(20)), us(30));
    }

    #[test]
    fn sparse_traffic_closes_the_window() {
        let t = Instant::now();
        let mut g = PollGate::new(W);
        let t = arrivals(&mut g, t, us(20), 50);
        assert!(g.polling(t));
        let mut closed_after = None;
        let mut now = t;
        for i in 1..=40 {
            now += us(2_000);
            g.arrived(now);
            if !g.polling(now) && closed_after.is_none() {
                closed_after = Some(i);
            }
        }
        let n = closed_after.expect("the window closes");
        assert!(n <= 12, "closed after {n} misses");
        assert!(!g.polling(now), "stays closed while traffic is sparse");
    }

    #[test]
    fn idle_never_polls_whatever_the_share() {
        let t = Instant::now();
        let mut g = PollGate::new(W);
        let t = arrivals(&mut g, t, us(10), 100);
        assert!(g.polling(t));
        assert!(!g.polling(t + Duration::from_secs(1)));
    }

    #[test]
    fn a_submission_opens_the_window_for_its_answer() {
        let t = Instant::now();
        let mut g = PollGate::new(W);
        let mut now = arrivals(&mut g, t, us(10), 20);
        // A QD1 loop: submit, the answer 30 µs later, submit again at once.
        for _ in 0..20 {
            now += us(1);
            g.submitted(now);
            assert!(g.polling(now + us(29)));
            now += us(30);
            g.arrived(now);
        }
        assert!(g.polling(now));
    }

    #[test]
    fn answers_slower_than_the_window_stop_the_polling_they_cannot_use() {
        let t = Instant::now();
        let mut g = PollGate::new(W);
        let mut now = arrivals(&mut g, t, us(10), 20);
        for _ in 0..20 {
            now += us(1);
            g.submitted(now);
            now += us(200);
            g.arrived(now);
        }
        assert!(!g.polling(now + us(1)));
        // A submission still polls for its answer, one window and no longer.
        g.submitted(now);
        assert_eq!(g.remaining(now + us(20)), us(30));
        assert!(!g.polling(now + us(50)));
    }

    #[test]
    fn polling_for_answers_opens_the_gate_when_the_peer_answers_within_the_window() {
        // Both sides slept: every answer came 90 µs after its submission, all misses.
        let t = Instant::now();
        let mut g = PollGate::new(W);
        let mut now = t;
        for _ in 0..20 {
            g.submitted(now);
            now += us(90);
            g.arrived(now);
            now += us(1);
        }
        assert!(!g.polling(now + us(10)), "closed after an arrival");
        // Polled for, the answer comes in 45 µs (the peer's wake-up): hits, and the gate
        // opens after arrivals too.
        let mut opened_after = None;
        for i in 1..=10 {
            g.submitted(now);
            assert!(g.polling(now + us(44)), "polls for the answer");
            now += us(45);
            g.arrived(now);
            // 10 µs on, the submission's window has ended: only an open gate polls.
            if g.polling(now + us(10)) && opened_after.is_none() {
                opened_after = Some(i);
            }
            now += us(1);
        }
        let n = opened_after.expect("the gate opens");
        assert!(n <= 4, "opened after {n} answers");
    }

    #[test]
    fn a_hold_polls_through_the_pauses_of_bursty_traffic_only() {
        let t = Instant::now();
        // Bursts: three arrivals 10 us apart, then a pause of 120 us.
        let bursts = |g: &mut PollGate| {
            let mut now = t;
            let mut slept = 0;
            for _ in 0..40 {
                now = arrivals(g, now, us(10), 3);
                if !g.polling(now + us(119)) {
                    slept += 1;
                }
                now += us(110);
            }
            slept
        };
        let mut plain = PollGate::new(W);
        let mut held = PollGate::with_hold(W, 4 * W);
        assert_eq!(
            bursts(&mut plain),
            40,
            "a plain window sleeps in every pause"
        );
        assert!(bursts(&mut held) <= 3, "the hold polls through the pauses");
        assert!(
            !held.polling(t + Duration::from_secs(1)),
            "and ends when traffic does"
        );

        // Steady arrivals every 120 us: all misses, so no hold either.
        let mut steady = PollGate::with_hold(W, 4 * W);
        let end = arrivals(&mut steady, t, us(120), 50);
        assert!(!steady.polling(end));
        assert_eq!(steady.remaining(end), Duration::ZERO);

        // A submission still polls for one window only.
        let mut g = PollGate::with_hold(W, 4 * W);
        g.submitted(t);
        assert!(g.polling(t + us(49)));
        assert!(!g.polling(t + us(50)));

        // A zero window never polls, whatever the hold.
        let mut z = PollGate::with_hold(Duration::ZERO, W);
        let end = arrivals(&mut z, t, us(1), 100);
        assert!(!z.polling(end));
    }

    #[test]
    fn the_share_stays_in_range() {
        let t = Instant::now();
        let mut g = PollGate::new(W);
        let now = arrivals(&mut g, t, us(1), 10_000);
        assert!(g.share <= FULL);
        arrivals(&mut g, now, us(1_000), 10_000);
        assert_eq!(g.share, 0);
    }
}
