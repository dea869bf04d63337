//! Letting received data age before the GPU reads it (`copy_lag`): the `gpu` destination's
//! large reads ([`crate::gpu`]) land in pinned slots on their worker's core, and each waits
//! with its copy to the GPU until a number of bytes of the worker's other reads have landed,
//! or until none of them is on its way. On the H200 machine, loopback TCP receivers that
//! copied each MiB to the GPU the moment they wrote it moved 20-22 GB/s, and 27-29 GB/s when
//! each copy waited for 2 MiB more to arrive first (`benches/scripts/tcp-gpu-ceiling.py
//! --why`, the `lag` row); cache write-back hints on the fresh lines did not help. A read that
//! waits holds its slot and keeps its worker from issuing the next read, so fewer reads
//! travel at a given `iodepth`. This module keeps the count; it runs without a GPU (its unit
//! tests drive it directly).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use parking_lot::Mutex;

/// The landings of one worker's large reads (shared by its buffers; one thread uses it, so the
/// lock is not contended).
pub struct Lag {
    /// How many bytes of the worker's other reads land before a read's copy leaves.
    bytes: u64,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Bytes landed so far.
    landed: u64,
    /// Reads on their way from the network.
    travelling: usize,
    /// The reads waiting: until when, and their wakers.
    waiting: Vec<(u64, Waker)>,
}

impl State {
    fn ready(&self, until: u64) -> bool {
        self.landed >= until || self.travelling == 0
    }

    /// Wakes the waits that may go now.
    fn wake(&mut self) {
        let mut i = 0;
        while i < self.waiting.len() {
            if self.ready(self.waiting[i].0) {
                self.waiting.swap_remove(i).1.wake();
            } else {
                i += 1;
            }
        }
    }
}

impl Lag {
    /// Copies wait for `bytes` more bytes to land.
    pub fn new(bytes: u64) -> Self {
        Lag {
            bytes,
            state: Mutex::default(),
        }
    }

    /// A read leaves for the network; it lands with [`Trip::land`], or, dropped, counts as gone.
    pub fn depart(&self) -> Trip<'_> {
        self.state.lock().travelling += 1;
        Trip(Some(self))
    }

    fn arrive(&self, bytes: u64) -> u64 {
        let mut st = self.state.lock();
        st.travelling = st.travelling.saturating_sub(1);
        st.landed += bytes;
        st.wake();
        st.landed + self.bytes
    }
}

/// A read of a [`Lag`]'s worker on its way from the network.
pub struct Trip<'a>(Option<&'a Lag>);

impl<'a> Trip<'a> {
    /// The read's `bytes` landed: ready once the lag's bytes more have landed after them, or
    /// at once when no other read is on its way.
    pub fn land(mut self, bytes: usize) -> LagWait<'a> {
        let lag = self.0.take();
        let until = lag.map_or(0, |l| l.arrive(bytes as u64));
        LagWait { lag, until }
    }
}

impl Drop for Trip<'_> {
    fn drop(&mut self) {
        if let Some(l) = self.0.take() {
            l.arrive(0);
        }
    }
}

/// The wait of a read that landed ([`Trip::land`]).
pub struct LagWait<'a> {
    lag: Option<&'a Lag>,
    until: u64,
}

impl Future for LagWait<'_> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let Some(lag) = self.lag else {
            return Poll::Ready(());
        };
        let mut st = lag.state.lock();
        if st.ready(self.until) {
            return Poll::Ready(());
        }
        let known = st
            .waiting
            .iter()
            .any(|(u, w)| *u == self.until && w.will_wake(cx.waker()));
        if !known {
            st.waiting.push((self.until, cx.waker().clone()));
        }
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::Wake;

    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn poll(w: &mut LagWait<'_>, waker: &Waker) -> bool {
        Pin::new(w).poll(&mut Context::from_waker(waker)).is_ready()
    }

    const MIB: usize = 1 << 20;
    const LAG: u64 = 2 << 20;

    #[test]
    fn a_read_waits_for_two_mib_more_while_others_travel() {
        let lag = Lag::new(LAG);
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(Arc::clone(&count));
        let (a, b, c, d) = (lag.depart(), lag.depart(), lag.depart(), lag.depart());
        let mut wa = a.land(MIB);
        assert!(!poll(&mut wa, &waker), "three reads are still on their way");
        let mut wb = b.land(MIB);
        assert!(!poll(&mut wa, &waker) && !poll(&mut wb, &waker));
        assert_eq!(count.0.load(Ordering::Relaxed), 0);
        let mut wc = c.land(MIB);
        assert_eq!(
            count.0.load(Ordering::Relaxed),
            1,
            "2 MiB landed after a: a is woken"
        );
        assert!(poll(&mut wa, &waker));
        assert!(!poll(&mut wb, &waker) && !poll(&mut wc, &waker));
        // The last read on its way lands: nothing more will land, so every wait goes.
        let mut wd = d.land(MIB);
        assert!(poll(&mut wb, &waker) && poll(&mut wc, &waker) && poll(&mut wd, &waker));
    }

    #[test]
    fn a_read_alone_or_after_failures_does_not_wait() {
        let lag = Lag::new(LAG);
        let waker = Waker::from(Arc::new(Count(AtomicUsize::new(0))));
        let mut w = lag.depart().land(MIB);
        assert!(poll(&mut w, &waker), "no other read is on its way");
        let (a, b) = (lag.depart(), lag.depart());
        let mut wa = a.land(MIB);
        assert!(!poll(&mut wa, &waker));
        drop(b);
        assert!(
            poll(&mut wa, &waker),
            "the other read failed: nothing more will land"
        );
    }

    #[test]
    fn a_small_landing_counts_its_bytes() {
        let lag = Lag::new(LAG);
        let waker = Waker::from(Arc::new(Count(AtomicUsize::new(0))));
        let (a, b, c) = (lag.depart(), lag.depart(), lag.depart());
        let mut wa = a.land(MIB);
        let _wb = b.land(LAG as usize - 1);
        assert!(!poll(&mut wa, &waker), "one byte short of the lag");
        let _wc = c.land(1);
        assert!(poll(&mut wa, &waker));
    }
}
