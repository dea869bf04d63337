//! Accounting of the resources a queue pair must never overrun, without any I/O, so that it
//! is tested everywhere.
//!
//! - Send queue: every posted work request holds one entry until the signaled completion that
//!   ends its chain arrives ([`SendCredits`]).
//! - Message buffers: a SEND's bytes stay in their registered slot until its completion
//!   ([`SlotPool`]).
//! - Receive buffers: a slot is either posted (the device may write it) or held by the
//!   command that arrived in it ([`RecvRing`]). The target keeps HSQSIZE + 1 posted or held,
//!   and re-posts a slot only when the command that used it is answered, so it never has more
//!   commands than the host may send; the host, in turn, keeps HRQSIZE >= HSQSIZE + 1
//!   receives for the single completion of each command (checked at connect).

/// Send queue entries in use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SendCredits {
    capacity: u32,
    used: u32,
}

impl SendCredits {
    /// A send queue of `capacity` entries.
    pub fn new(capacity: u32) -> Self {
        SendCredits { capacity, used: 0 }
    }

    /// Takes `n` entries if that many are free.
    pub fn try_take(&mut self, n: u32) -> bool {
        match self.used.checked_add(n) {
            Some(u) if u <= self.capacity => {
                self.used = u;
                true
            }
            _ => false,
        }
    }

    /// Returns `n` entries; false (and nothing changes) if fewer are in use.
    pub fn release(&mut self, n: u32) -> bool {
        match self.used.checked_sub(n) {
            Some(u) => {
                self.used = u;
                true
            }
            None => false,
        }
    }

    /// Entries in use.
    pub fn in_use(&self) -> u32 {
        self.used
    }

    /// Entries free.
    pub fn available(&self) -> u32 {
        self.capacity - self.used
    }
}

/// A fixed set of numbered buffers handed out one at a time.
#[derive(Clone, Debug)]
pub struct SlotPool {
    free: Vec<u32>,
    busy: Vec<bool>,
}

impl SlotPool {
    /// `n` free slots numbered 0..n.
    pub fn new(n: u32) -> Self {
        SlotPool {
            free: (0..n).rev().collect(),
            busy: vec![false; n as usize],
        }
    }

    /// Takes a free slot.
    pub fn take(&mut self) -> Option<u32> {
        let i = self.free.pop()?;
        self.busy[i as usize] = true;
        Some(i)
    }

    /// Returns a slot; false if it was not taken (a double release is refused).
    pub fn give(&mut self, i: u32) -> bool {
        match self.busy.get_mut(i as usize) {
            Some(b) if *b => {
                *b = false;
                self.free.push(i);
                true
            }
            _ => false,
        }
    }

    /// Slots taken.
    pub fn in_use(&self) -> usize {
        self.busy.len() - self.free.len()
    }

    /// Total slots.
    pub fn len(&self) -> usize {
        self.busy.len()
    }

    /// Whether the pool has no slots at all.
    pub fn is_empty(&self) -> bool {
        self.busy.is_empty()
    }
}

/// State of each receive slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecvState {
    /// Not posted and not holding a command (before the first post, or after an error).
    Idle,
    /// Posted: the device may write it.
    Posted,
    /// Holding a received command until it is answered.
    Held,
}

/// The receive slots of a queue.
#[derive(Clone, Debug)]
pub struct RecvRing {
    state: Vec<RecvState>,
}

impl RecvRing {
    /// `n` idle slots.
    pub fn new(n: u32) -> Self {
        RecvRing {
            state: vec![RecvState::Idle; n as usize],
        }
    }

    /// The state of slot `i`.
    pub fn state(&self, i: u32) -> Option<RecvState> {
        self.state.get(i as usize).copied()
    }

    /// Marks slot `i` posted; false unless it was idle or held.
    pub fn posted(&mut self, i: u32) -> bool {
        match self.state.get_mut(i as usize) {
            Some(s @ (RecvState::Idle | RecvState::Held)) => {
                *s = RecvState::Posted;
                true
            }
            _ => false,
        }
    }

    /// Marks slot `i` as holding a received command; false unless it was posted.
    pub fn received(&mut self, i: u32) -> bool {
        match self.state.get_mut(i as usize) {
            Some(s @ RecvState::Posted) => {
                *s = RecvState::Held;
                true
            }
            _ => false,
        }
    }

    /// Marks slot `i` idle (its receive was flushed or could not be posted again).
    pub fn idle(&mut self, i: u32) {
        if let Some(s) = self.state.get_mut(i as usize) {
            *s = RecvState::Idle;
        }
    }

    /// Slots in a state.
    pub fn count(&self, st: RecvState) -> usize {
        self.state.iter().filter(|&&s| s == st).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn send_credits_never_exceed_capacity() {
        let mut c = SendCredits::new(4);
        assert!(c.try_take(2));
        assert!(c.try_take(2));
        assert!(!c.try_take(1));
        assert_eq!(c.available(), 0);
        assert!(c.release(2));
        assert!(c.try_take(1));
        assert!(!c.release(4));
        assert_eq!(c.in_use(), 3);
        assert!(!c.try_take(u32::MAX));
    }

    #[test]
    fn slot_pool_refuses_double_release() {
        let mut p = SlotPool::new(2);
        let a = p.take().unwrap();
        let b = p.take().unwrap();
        assert_ne!(a, b);
        assert!(p.take().is_none());
        assert!(p.give(a));
        assert!(!p.give(a));
        assert!(!p.give(7));
        assert_eq!(p.in_use(), 1);
        assert_eq!(p.take(), Some(a));
    }

    #[test]
    fn recv_slots_follow_post_receive_answer() {
        let mut r = RecvRing::new(2);
        assert!(!r.received(0), "an idle slot cannot receive");
        assert!(r.posted(0));
        assert!(!r.posted(0), "posting twice is refused");
        assert!(r.received(0));
        assert!(!r.received(0));
        assert_eq!(r.count(RecvState::Held), 1);
        assert!(r.posted(0));
        r.idle(0);
        assert_eq!(r.state(0), Some(RecvState::Idle));
        assert_eq!(r.state(5), None);
    }

    /// A host that respects its queue depth against the target's receive accounting: the
    /// target never holds more commands than it posted buffers for, and each command gets one
    /// completion, so the completions in flight to the host never exceed its receive buffers.
    #[derive(Debug, Clone)]
    enum Step {
        HostSends,
        TargetAnswers(usize),
        HostConsumes,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            Just(Step::HostSends),
            (0usize..64).prop_map(Step::TargetAnswers),
            Just(Step::HostConsumes),
        ]
    }

    proptest! {
        #[test]
        fn completions_never_overrun_host_receives(depth in 2u32..16, steps in proptest::collection::vec(step(), 0..400)) {
            let host_recv = depth; // HRQSIZE >= HSQSIZE + 1, the smallest legal value
            let mut ring = RecvRing::new(depth);
            for i in 0..depth { prop_assert!(ring.posted(i)); }
            let mut host_outstanding = 0u32; // commands sent, completion not yet consumed
            let mut held: Vec<u32> = Vec::new();
            let mut in_flight_cqes = 0u32; // completions delivered, not yet consumed by host
            for s in steps {
                match s {
                    Step::HostSends if host_outstanding < depth => {
                        // The command lands in some posted slot; one must exist.
                        let slot = (0..depth).find(|&i| ring.state(i) == Some(RecvState::Posted));
                        prop_assert!(slot.is_some(), "receive not posted: RNR");
                        let slot = slot.unwrap();
                        prop_assert!(ring.received(slot));
                        held.push(slot);
                        host_outstanding += 1;
                    }
                    Step::TargetAnswers(k) if !held.is_empty() => {
                        let slot = held.remove(k % held.len());
                        prop_assert!(ring.posted(slot));
                        in_flight_cqes += 1;
                        prop_assert!(in_flight_cqes <= host_recv);
                    }
                    Step::HostConsumes if in_flight_cqes > 0 => {
                        in_flight_cqes -= 1;
                        host_outstanding -= 1;
                    }
                    _ => {}
                }
                prop_assert!(ring.count(RecvState::Held) as u32 <= depth);
            }
        }

        #[test]
        fn send_credits_model(cap in 1u32..64, ops in proptest::collection::vec((any::<bool>(), 1u32..4), 0..200)) {
            let mut c = SendCredits::new(cap);
            let mut model = 0u32;
            for (take, n) in ops {
                if take {
                    let ok = c.try_take(n);
                    prop_assert_eq!(ok, model + n <= cap);
                    if ok { model += n; }
                } else {
                    let ok = c.release(n);
                    prop_assert_eq!(ok, n <= model);
                    if ok { model -= n; }
                }
                prop_assert_eq!(c.in_use(), model);
                prop_assert!(c.in_use() <= cap);
            }
        }
    }
}
