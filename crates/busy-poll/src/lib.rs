//! When a queue should busy-poll instead of sleeping.
//!
//! A thread that sleeps until its socket is readable pays a wake-up for every message: on
//! virtual machines and in deep C-states that is tens of microseconds, more than the rest of
//! a 4 KiB read over loopback. Polling for a short window after activity removes that cost
//! while I/O flows, and an idle queue still sleeps. A fixed window wastes CPU when traffic is
//! sparse, though: if the next message comes long after the window, every window is spun for
//! nothing.
//!
//! [`PollGate`] decides. Each arrival (data received) is scored as a *hit* when it came within
//! the window of the previous activity (an arrival or a submission), so polling would have
//! caught it without a sleep, and a *miss* otherwise. The gate polls after activity only while
//! enough recent arrivals were hits (an exponentially weighted share of at least a quarter):
//!
//! - dense traffic (a QD1 loop, a busy queue): arrivals are hits and the window stays open;
//! - sparse traffic (a message every few milliseconds): arrivals are misses, the share decays
//!   within a dozen arrivals and the queue goes back to sleeping between messages;
//! - idle: no activity, so no window, whatever the share;
//! - saturated: when nearly every poll finds data waiting or comes back late because other
//!   threads had the CPU (an exponentially weighted share of at least seven eighths,
//!   [`PollGate::polled`]), a readiness wait would do as well, and the spinning only takes
//!   CPU from whatever produces the data (a target on the same machine, the other queues):
//!   the gate stays closed for a cool-off of 64 windows, then polls again to look.
//!
//! Sans-IO: the caller passes the time; no clock, thread or allocation inside.

use std::time::{Duration, Instant};

/// Full scale of the hit share (fixed point: 256 = every recent arrival was a hit).
const FULL: u16 = 256;
/// Polls while the hit share is at least this (a quarter).
const THRESHOLD: u16 = FULL / 4;
/// Weight of the newest arrival or poll: 1/8.
const SHIFT: u16 = 3;
/// Polls that did not pay, at least this share: saturated.
const SATURATED: u16 = FULL - FULL / 8;
/// Windows the gate stays closed once saturated.
const COOL_OFF_WINDOWS: u32 = 64;

/// Moves an exponentially weighted share (of [`FULL`]) by one event, weight 1/8.
fn step(share: u16, hit: bool) -> u16 {
    if hit {
        share + ((FULL - share) >> SHIFT).max(u16::from(share < FULL))
    } else {
        share - (share >> SHIFT).max(share.min(1))
    }
}

/// The busy-poll decision of one queue or thread (see the crate documentation).
#[derive(Debug, Clone, Copy)]
pub struct PollGate {
    window: Duration,
    last: Option<Instant>,
    share: u16,
    /// Share of recent polls that did not pay (see [`PollGate::polled`]).
    useless: u16,
    /// Closed until then after saturation.
    cool_off_until: Option<Instant>,
}

impl PollGate {
    /// A gate with this window; a zero window never polls. Starts closed: polling begins
    /// once a few arrivals show traffic dense enough to pay for it.
    pub fn new(window: Duration) -> Self {
        PollGate {
            window,
            last: None,
            share: 0,
            useless: 0,
            cool_off_until: None,
        }
    }

    /// The window.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// Notes data received at `now`, scoring it against the previous activity.
    pub fn arrived(&mut self, now: Instant) {
        let hit = self
            .last
            .is_some_and(|last| now.saturating_duration_since(last) < self.window);
        self.share = step(self.share, hit);
        self.last = Some(now);
    }

    /// Notes the outcome of one poll: a check of the connection made because
    /// [`polling`](Self::polling) said so, begun (the yield to the runtime) at `since` and
    /// done at `now`, which found data or not. A poll pays only when it comes back quickly and
    /// finds nothing yet, so that the data is caught the moment it arrives: one that finds data
    /// waiting could as well have slept (a readiness wait returns at once), and one that took
    /// more than a quarter of the window came back late because other threads needed the CPU,
    /// which the spinning takes from them. When nearly every poll is of those kinds the gate
    /// closes for a cool-off (see the crate documentation).
    pub fn polled(&mut self, since: Instant, now: Instant, found: bool) {
        let late = now.saturating_duration_since(since) > self.window / 4;
        self.useless = step(self.useless, found || late);
        if self.useless >= SATURATED {
            self.cool_off_until = Some(now + self.window.saturating_mul(COOL_OFF_WINDOWS));
            // Half way: after the cool-off a short run of polls tells whether it still is.
            self.useless = FULL / 2;
        }
    }

    /// Notes a submission at `now`: it opens the window (its answer is the next arrival) but
    /// is not scored.
    pub fn submitted(&mut self, now: Instant) {
        self.last = Some(now);
    }

    /// Whether to poll at `now` rather than sleep: recent traffic is dense enough, the last
    /// activity is within the window, and the gate is not cooling off after saturation.
    pub fn polling(&self, now: Instant) -> bool {
        self.share >= THRESHOLD
            && !self.cooling_off(now)
            && self
                .last
                .is_some_and(|last| now.saturating_duration_since(last) < self.window)
    }

    /// Whether the gate is closed at `now` for the cool-off after saturation (a caller that
    /// polls on its own rule, after a submission say, should not poll then either).
    pub fn cooling_off(&self, now: Instant) -> bool {
        self.cool_off_until.is_some_and(|until| now < until)
    }

    /// How long from `now` the window stays open (zero when not polling).
    pub fn remaining(&self, now: Instant) -> Duration {
        match self.last {
            Some(last) if self.polling(now) => self
                .window
                .saturating_sub(now.saturating_duration_since(last)),
            _ => Duration::ZERO,
        }
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
    }

    /// Polls every microsecond while answers come every `gap`; returns the time at the end.
    fn poll_between(g: &mut PollGate, mut now: Instant, gap: u64, answers: usize) -> Instant {
        for _ in 0..answers {
            for i in 1..=gap {
                now += us(1);
                if g.polling(now) {
                    g.polled(now - us(1), now, i == gap);
                }
            }
            g.arrived(now);
        }
        now
    }

    #[test]
    fn polls_that_mostly_find_nothing_keep_the_window_open() {
        // A QD1 loop: the answer comes 10 µs after the submission, 9 polls of 10 are empty.
        let t = Instant::now();
        let mut g = PollGate::new(W);
        let mut now = arrivals(&mut g, t, us(10), 20);
        for _ in 0..1000 {
            g.submitted(now);
            now = poll_between(&mut g, now, 10, 1);
            assert!(g.polling(now), "closed in a QD1 loop");
        }
    }

    #[test]
    fn saturation_closes_the_gate_for_a_cool_off_then_it_looks_again() {
        let t = Instant::now();
        let mut g = PollGate::new(W);
        let mut now = arrivals(&mut g, t, us(1), 20);
        assert!(g.polling(now));
        // Every poll finds data: the gate closes within a few dozen polls.
        let mut closed_after = None;
        for i in 1..=100 {
            now += us(1);
            if !g.polling(now) {
                closed_after = Some(i);
                break;
            }
            g.polled(now - us(1), now, true);
            g.arrived(now);
        }
        let n = closed_after.expect("saturation closes the gate");
        assert!(n <= 20, "closed after {n} polls");
        // Closed for the cool-off, however dense the arrivals.
        let closed_at = now;
        while now < closed_at + W * 63 {
            now += us(5);
            g.arrived(now);
            assert!(!g.polling(now));
        }
        now = closed_at + W * 64;
        g.arrived(now);
        assert!(g.polling(now), "polls again after the cool-off");
        // Traffic is no longer saturated (a QD1 loop): it stays open.
        for _ in 0..200 {
            g.submitted(now);
            now = poll_between(&mut g, now, 10, 1);
        }
        assert!(g.polling(now));
        // Saturated again: closes again.
        for _ in 0..30 {
            now += us(1);
            if g.polling(now) {
                g.polled(now - us(1), now, true);
            }
            g.arrived(now);
        }
        assert!(!g.polling(now));
    }

    #[test]
    fn polls_that_come_back_late_close_the_gate() {
        // Other threads hold the CPU: each yield comes back 20 µs later (more than a quarter
        // of the window), though the answers still come within the window.
        let t = Instant::now();
        let mut g = PollGate::new(W);
        let mut now = arrivals(&mut g, t, us(10), 20);
        let mut closed = false;
        for _ in 0..40 {
            g.submitted(now);
            if !g.polling(now) {
                closed = true;
                break;
            }
            let since = now;
            now += us(20);
            g.polled(since, now, false);
            now += us(1);
            g.arrived(now);
        }
        assert!(closed, "late polls keep the gate open");
        assert!(g.cooling_off(now));
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
