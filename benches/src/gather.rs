//! Waiting for batches: the reads of one worker whose data leaves together (the `gpu`
//! destination's gather, [`crate::gpu`]) wait for their batch to end, and one of them at a
//! time is the *poller*: it looks at the batches (ending those that finished and sending what
//! is due), while the others wait to be woken, each when its own batch ends. While many of the
//! worker's reads are on their way from the network ([`Waits::depart`]: a quarter of them, and
//! at least [`PARK_MIN`]) the poller looks again when the next one arrives ([`Waits::arrive`]),
//! so that a busy worker does not spin on its batches; with fewer, arrivals may be far apart
//! and it looks between yields. A read that leaves while it polls, or that was to poll (it was
//! woken to, or found no one polling and looked itself), hands the polling to a read still
//! waiting, so a read never waits with no poller. [`Batches`] is what is waited for; this
//! module only keeps the turns, and runs without a GPU (its unit tests drive it with synthetic
//! batches).

use std::task::{Context, Poll, Waker};

/// The fewest reads on their way for which a poller waits for the next arrival instead of
/// looking between yields (with fewer, the next one may be a network round trip away).
pub const PARK_MIN: usize = 16;

/// The batches reads wait for.
pub trait Batches {
    /// How a read's batch ended.
    type Done;

    /// Ends the batches that finished, giving the ending of each of their reads (by id) to
    /// `end`, and sends what is due.
    fn retire(&mut self, end: &mut dyn FnMut(usize, Self::Done));

    /// The reads still waiting for their batch, oldest batch first.
    fn pending(&self) -> impl Iterator<Item = usize> + '_;
}

/// The batches of a worker's reads, and whose turn it is to look at them.
pub struct Waits<B: Batches> {
    /// The batches.
    pub batches: B,
    /// Reads whose batch ended (and how), by read id.
    done: Vec<Option<B::Done>>,
    /// Whether a read polls.
    polling: bool,
    /// The wakers of the reads that wait while another polls, by read id.
    waiting: Vec<Option<Waker>>,
    /// Reads on their way from the network that will join a batch or go.
    arriving: usize,
    /// From how many reads on their way the poller waits for arrivals.
    park_at: usize,
    /// The poller's waker while it waits for the next arrival.
    parked: Option<Waker>,
}

/// Records how read `id`'s batch ended and wakes the read if it waits.
fn end_read<D>(done: &mut [Option<D>], waiting: &mut [Option<Waker>], id: usize, d: D) {
    done[id] = Some(d);
    if let Some(w) = waiting[id].take() {
        w.wake();
    }
}

impl<B: Batches> Waits<B> {
    /// Turns for reads `0..reads` of `batches`.
    pub fn new(batches: B, reads: usize) -> Self {
        Waits {
            batches,
            done: (0..reads).map(|_| None).collect(),
            polling: false,
            waiting: (0..reads).map(|_| None).collect(),
            arriving: 0,
            park_at: (reads / 4).max(PARK_MIN),
            parked: None,
        }
    }

    /// A read leaves for the network: while enough are on their way, until they
    /// [arrive](Self::arrive), a poller that found nothing ended waits for arrivals instead of
    /// looking again at once.
    pub fn depart(&mut self) {
        self.arriving += 1;
    }

    /// A read that [departed](Self::depart) is back (to join a batch, or gone): the poller, if
    /// it waits for arrivals, looks again.
    pub fn arrive(&mut self) {
        self.arriving = self.arriving.saturating_sub(1);
        if let Some(w) = &self.parked {
            w.wake_by_ref();
        }
    }

    /// Runs `f` on the batches with the means to end reads (for a batch that failed to
    /// leave, for example).
    pub fn with_batches<R>(
        &mut self,
        f: impl FnOnce(&mut B, &mut dyn FnMut(usize, B::Done)) -> R,
    ) -> R {
        let Waits {
            batches,
            done,
            waiting,
            ..
        } = self;
        f(batches, &mut |id, d| end_read(done, waiting, id, d))
    }

    /// Read `id` joins a batch: an ending left from its previous read goes.
    pub fn join(&mut self, id: usize) {
        self.done[id] = None;
    }

    /// One look of read `id`'s wait; `polling` is the wait's own record of whether it is
    /// the poller. Ready with the read's ending once its batch ended; the poller asks to
    /// be polled again at the next arrival while many reads are on their way, otherwise at
    /// once.
    pub fn poll_wait(
        &mut self,
        id: usize,
        polling: &mut bool,
        cx: &mut Context<'_>,
    ) -> Poll<B::Done> {
        if let Some(d) = self.done[id].take() {
            return self.finish(polling, false, d);
        }
        if self.polling && !*polling {
            match &mut self.waiting[id] {
                Some(w) if w.will_wake(cx.waker()) => {}
                w => *w = Some(cx.waker().clone()),
            }
            return Poll::Pending;
        }
        self.with_batches(|b, end| b.retire(end));
        if let Some(d) = self.done[id].take() {
            return self.finish(polling, true, d);
        }
        self.waiting[id] = None;
        self.polling = true;
        *polling = true;
        if self.arriving >= self.park_at {
            // Look again when the next read arrives (its join may send the open batch).
            match &mut self.parked {
                Some(w) if w.will_wake(cx.waker()) => {}
                p => *p = Some(cx.waker().clone()),
            }
        } else {
            // Look again once the runtime had its turn.
            self.parked = None;
            cx.waker().wake_by_ref();
        }
        Poll::Pending
    }

    /// Ends a wait with `d`, handing the polling on if the read held it or was to take it
    /// (`looked`: it looked at the batches itself).
    fn finish(&mut self, polling: &mut bool, looked: bool, d: B::Done) -> Poll<B::Done> {
        if *polling || looked {
            *polling = false;
            self.hand_over();
        }
        Poll::Ready(d)
    }

    /// Read `id`'s wait goes (its future dropped, finished or not).
    pub fn leave(&mut self, id: usize, polling: bool) {
        self.waiting[id] = None;
        if polling {
            self.hand_over();
        }
    }

    /// Gives up the polling: wakes one read still waiting for its batch (of the oldest batch
    /// first) to poll next.
    fn hand_over(&mut self) {
        self.polling = false;
        self.parked = None;
        let Waits {
            batches, waiting, ..
        } = self;
        if let Some(w) = batches.pending().find_map(|id| waiting[id].take()) {
            w.wake();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::task::Wake;

    /// Batches whose end the test decides: a batch leaves when `send` is called and ends
    /// when `finish` is.
    #[derive(Default)]
    struct Synthetic {
        open: Vec<usize>,
        flights: VecDeque<(Vec<usize>, bool)>,
    }

    impl Batches for Synthetic {
        type Done = usize;

        fn retire(&mut self, end: &mut dyn FnMut(usize, usize)) {
            while self.flights.front().is_some_and(|f| f.1) {
                if let Some((members, _)) = self.flights.pop_front() {
                    for id in members {
                        end(id, id);
                    }
                }
            }
        }

        fn pending(&self) -> impl Iterator<Item = usize> + '_ {
            self.flights
                .iter()
                .flat_map(|f| f.0.iter().copied())
                .chain(self.open.iter().copied())
        }
    }

    impl Synthetic {
        fn send(&mut self) {
            if !self.open.is_empty() {
                self.flights
                    .push_back((std::mem::take(&mut self.open), false));
            }
        }

        /// Marks the `k`th batch in flight finished (the poller sees it on its next look).
        fn finish(&mut self, k: usize) {
            if let Some(f) = self.flights.get_mut(k) {
                f.1 = true;
            }
        }
    }

    struct Flag(AtomicBool);

    impl Wake for Flag {
        fn wake(self: Arc<Self>) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    /// A read's wait as a task: woken or not, polling or not, done or not.
    struct Read {
        flag: Arc<Flag>,
        polling: bool,
        waiting: bool,
        ended: Option<usize>,
    }

    impl Read {
        fn new() -> Self {
            Read {
                flag: Arc::new(Flag(AtomicBool::new(false))),
                polling: false,
                waiting: false,
                ended: None,
            }
        }
    }

    fn poll(w: &mut Waits<Synthetic>, reads: &mut [Read], id: usize) {
        let r = &mut reads[id];
        r.flag.0.store(false, Ordering::SeqCst);
        let waker = Waker::from(Arc::clone(&r.flag));
        let mut cx = Context::from_waker(&waker);
        if let Poll::Ready(d) = w.poll_wait(id, &mut r.polling, &mut cx) {
            assert_eq!(d, id, "a read got another read's ending");
            r.waiting = false;
            r.ended = Some(d);
            w.leave(id, r.polling);
        }
    }

    /// Reads join the open batch and wait.
    fn join(w: &mut Waits<Synthetic>, reads: &mut [Read], ids: &[usize]) {
        for &id in ids {
            w.join(id);
            w.batches.open.push(id);
            reads[id] = Read::new();
            reads[id].waiting = true;
            poll(w, reads, id);
        }
    }

    /// Polls woken reads, one at a time in the order `pick` gives, `steps` times or until
    /// none is woken (a poller wakes itself, so runs stop with it still looking).
    fn run(
        w: &mut Waits<Synthetic>,
        reads: &mut [Read],
        pick: &mut impl FnMut(usize) -> usize,
        steps: usize,
    ) {
        for _ in 0..steps {
            let woken: Vec<usize> = (0..reads.len())
                .filter(|&i| reads[i].waiting && reads[i].flag.0.load(Ordering::SeqCst))
                .collect();
            if woken.is_empty() {
                return;
            }
            let id = woken[pick(woken.len())];
            poll(w, reads, id);
        }
    }

    /// Whether a read still waiting will be polled again: some waiting read is woken.
    fn someone_looks(reads: &[Read]) -> bool {
        reads
            .iter()
            .any(|r| r.waiting && r.flag.0.load(Ordering::SeqCst))
    }

    #[test]
    fn the_first_read_polls_and_the_others_wait_for_their_own_batch() {
        let mut w = Waits::new(Synthetic::default(), 4);
        let mut reads: Vec<Read> = (0..4).map(|_| Read::new()).collect();
        join(&mut w, &mut reads, &[0, 1]);
        w.batches.send();
        join(&mut w, &mut reads, &[2, 3]);
        w.batches.send();
        assert!(reads[0].polling && !reads[1].polling);
        assert!(
            reads[0].flag.0.load(Ordering::SeqCst),
            "the poller looks again"
        );
        assert!(!reads[1].flag.0.load(Ordering::SeqCst));
        // The second batch ends first: nothing ends before the first one does (in order).
        w.batches.finish(1);
        poll(&mut w, &mut reads, 0);
        assert!(reads.iter().all(|r| r.ended.is_none()));
        // The first ends: both end, in order, and their reads are woken.
        w.batches.finish(0);
        poll(&mut w, &mut reads, 0);
        assert_eq!(reads[0].ended, Some(0));
        assert!(!reads[0].polling);
        for r in &reads[1..] {
            assert!(
                r.flag.0.load(Ordering::SeqCst),
                "a read whose batch ended sleeps"
            );
        }
        run(&mut w, &mut reads, &mut |_| 0, 100);
        assert!(reads.iter().all(|r| r.ended.is_some()), "every read ended");
    }

    #[test]
    fn the_poller_waits_for_arrivals_while_reads_are_on_their_way() {
        let w = Waits::new(Synthetic::default(), 256);
        assert_eq!(
            (w.park_at, Waits::new(Synthetic::default(), 8).park_at),
            (64, PARK_MIN)
        );
        let mut w = Waits::new(Synthetic::default(), 3);
        w.park_at = 1;
        let mut reads: Vec<Read> = (0..3).map(|_| Read::new()).collect();
        w.depart();
        w.depart();
        join(&mut w, &mut reads, &[0]);
        w.batches.send();
        assert!(reads[0].polling);
        assert!(
            !reads[0].flag.0.load(Ordering::SeqCst),
            "the poller spins while reads are on their way"
        );
        // An arrival wakes it; it looks and, one read still on its way, waits again; at two
        // it would look between yields.
        w.arrive();
        join(&mut w, &mut reads, &[1]);
        assert!(
            reads[0].flag.0.load(Ordering::SeqCst),
            "an arrival woke no one"
        );
        poll(&mut w, &mut reads, 0);
        assert!(!reads[0].flag.0.load(Ordering::SeqCst));
        w.park_at = 2;
        poll(&mut w, &mut reads, 0);
        assert!(
            reads[0].flag.0.load(Ordering::SeqCst),
            "the poller waits for arrivals with too few on their way"
        );
        w.park_at = 1;
        poll(&mut w, &mut reads, 0);
        // The last one goes without joining: the poller looks, and with no read on its way
        // looks again between yields.
        w.arrive();
        poll(&mut w, &mut reads, 0);
        assert!(
            reads[0].flag.0.load(Ordering::SeqCst),
            "no read is on its way and the poller waits"
        );
        w.batches.send();
        w.batches.finish(0);
        w.batches.finish(1);
        run(&mut w, &mut reads, &mut |_| 0, 100);
        assert_eq!(reads[0].ended, Some(0));
        assert_eq!(reads[1].ended, Some(1));
        // A new poller that leaves hands over with no waker of its kept for arrivals.
        w.depart();
        join(&mut w, &mut reads, &[2]);
        assert!(reads[2].polling && w.parked.is_some());
        w.leave(2, true);
        assert!(
            w.parked.is_none(),
            "a poller that left is still woken by arrivals"
        );
    }

    #[test]
    fn a_read_woken_to_poll_that_finds_its_batch_ended_hands_the_polling_on() {
        // Read 0 polls batch A; read 1 (batch B) and read 2 (open) wait. A ends: read 0
        // leaves and wakes read 1 to poll. B ends before read 1 looks: read 1's look ends
        // it, and read 1 must wake read 2, or read 2 waits with no poller.
        let mut w = Waits::new(Synthetic::default(), 3);
        let mut reads: Vec<Read> = (0..3).map(|_| Read::new()).collect();
        join(&mut w, &mut reads, &[0]);
        w.batches.send();
        join(&mut w, &mut reads, &[1]);
        w.batches.send();
        join(&mut w, &mut reads, &[2]);
        w.batches.finish(0);
        poll(&mut w, &mut reads, 0);
        assert_eq!(reads[0].ended, Some(0));
        assert!(reads[1].flag.0.load(Ordering::SeqCst), "read 1 is to poll");
        assert!(!reads[2].flag.0.load(Ordering::SeqCst));
        w.batches.finish(0);
        poll(&mut w, &mut reads, 1);
        assert_eq!(reads[1].ended, Some(1));
        assert!(
            reads[2].flag.0.load(Ordering::SeqCst),
            "read 2 waits with no poller"
        );
        run(&mut w, &mut reads, &mut |_| 0, 100);
        assert!(reads[2].polling, "read 2 polls its open batch");
        w.batches.send();
        w.batches.finish(0);
        run(&mut w, &mut reads, &mut |_| 0, 100);
        assert_eq!(reads[2].ended, Some(2));
    }

    #[test]
    fn every_read_ends_whatever_the_order_of_ends_and_looks() {
        // Synthetic runs: reads leave for the network and come back (or go), join, batches
        // leave and end, and woken reads are polled, all in pseudo-random orders; after each
        // step a read that still waits has someone to look for it (or a poller that an
        // arrival will wake), and at the end every read has its own ending.
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        let mut rand = move |n: usize| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % n as u64) as usize
        };
        for _ in 0..300 {
            let n = 1 + rand(12);
            let mut w = Waits::new(Synthetic::default(), n);
            w.park_at = 1 + rand(3);
            let mut reads: Vec<Read> = (0..n).map(|_| Read::new()).collect();
            let mut ended = 0;
            let mut joined = vec![false; n];
            let mut away = vec![false; n];
            for _ in 0..2000 {
                match rand(6) {
                    0 => {
                        let free: Vec<usize> = (0..n).filter(|&i| !joined[i]).collect();
                        if !free.is_empty() {
                            let id = free[rand(free.len())];
                            joined[id] = true;
                            if away[id] {
                                away[id] = false;
                                w.arrive();
                            }
                            join(&mut w, &mut reads, &[id]);
                        }
                    }
                    4 => {
                        let free: Vec<usize> = (0..n).filter(|&i| !joined[i] && !away[i]).collect();
                        if !free.is_empty() {
                            away[free[rand(free.len())]] = true;
                            w.depart();
                        }
                    }
                    5 => {
                        // A read on its way fails, or its future goes.
                        let gone: Vec<usize> = (0..n).filter(|&i| away[i]).collect();
                        if !gone.is_empty() {
                            away[gone[rand(gone.len())]] = false;
                            w.arrive();
                        }
                    }
                    1 => w.batches.send(),
                    2 => {
                        let f = w.batches.flights.len();
                        if f > 0 {
                            w.batches.finish(rand(f));
                        }
                    }
                    _ => {
                        let steps = 1 + rand(2 * n);
                        run(&mut w, &mut reads, &mut rand, steps);
                    }
                }
                let waits = reads.iter().any(|r| r.waiting);
                let parked = w.arriving >= w.park_at && w.parked.is_some();
                assert!(
                    !waits || someone_looks(&reads) || parked,
                    "a read waits and no one will look"
                );
                assert_eq!(w.arriving, away.iter().filter(|&&a| a).count());
                for (id, r) in reads.iter_mut().enumerate() {
                    if r.ended.take().is_some() {
                        ended += 1;
                        joined[id] = false;
                    }
                }
                if ended >= 4 * n {
                    break;
                }
            }
            // Let every read on its way arrive, and everything leave and end.
            for a in away.iter_mut().filter(|a| **a) {
                *a = false;
                w.arrive();
            }
            for _ in 0..100 {
                w.batches.send();
                for k in 0..w.batches.flights.len() {
                    w.batches.finish(k);
                }
                run(&mut w, &mut reads, &mut rand, 4 * n);
            }
            assert!(
                reads.iter().all(|r| !r.waiting),
                "reads left waiting: {:?}",
                (0..n).filter(|&i| reads[i].waiting).collect::<Vec<_>>()
            );
        }
    }
}
