//! Polls a worker's I/O slot futures together in one task: each slot has a waker of its own,
//! made once, that marks the slot ready in a bitmap; a poll of the set polls the marked slots
//! only. What `futures::future::join_all` does for these futures, without its per-wake costs:
//! no task queue, and a wake that comes while the set is being polled (a slot that reads the
//! socket completes the others' commands) sets a bit and wakes nobody, since the poll that
//! runs looks at the bits again before it returns.
//!
//! A poll of the set polls the marked slots in passes (a slot woken during a pass, by itself or
//! by another, is polled in the next), and goes back to the runtime after polling as many slots
//! as the set has, so that slots that wake themselves (the initiator's queues do, to let the
//! other callers of a round add their commands first, or to come back once the thread that
//! holds their engine let go) cannot keep the runtime from running. Unlike `FuturesUnordered`
//! it does not go back to the runtime as soon as two slots woke themselves: on one thread
//! with two queues that doubled the turns through the runtime per round of commands and
//! halved what one client core read.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;

/// Which slots were woken, and whom to wake when one is.
struct Ready {
    /// One bit per slot: woken since its last poll.
    bits: Vec<AtomicU64>,
    /// The set is being polled: a wake only sets its bit (the poll looks at the bits again
    /// after it clears this).
    polling: AtomicBool,
    /// The task that polls the set.
    parent: AtomicWaker,
}

impl Ready {
    fn mark(&self, slot: usize) {
        self.bits[slot / 64].fetch_or(1 << (slot % 64), Ordering::SeqCst);
    }

    fn any(&self) -> bool {
        self.bits.iter().any(|w| w.load(Ordering::SeqCst) != 0)
    }
}

/// The waker of one slot.
struct SlotWake {
    ready: Arc<Ready>,
    slot: usize,
}

impl Wake for SlotWake {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.ready.mark(self.slot);
        if !self.ready.polling.load(Ordering::SeqCst) {
            self.ready.parent.wake();
        }
    }
}

/// A set of slot futures polled together; ends when all have ended.
pub struct Join<F> {
    futs: Vec<Option<Pin<Box<F>>>>,
    wakers: Vec<Waker>,
    ready: Arc<Ready>,
    left: usize,
}

/// Polls `futs` together until every one has ended.
pub fn join<F: Future<Output = ()>>(futs: impl IntoIterator<Item = F>) -> Join<F> {
    let futs: Vec<_> = futs.into_iter().map(|f| Some(Box::pin(f))).collect();
    let n = futs.len();
    let ready = Arc::new(Ready {
        bits: (0..n.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
        polling: AtomicBool::new(false),
        parent: AtomicWaker::new(),
    });
    // Every slot is polled first.
    for slot in 0..n {
        ready.mark(slot);
    }
    let wakers = (0..n)
        .map(|slot| {
            Waker::from(Arc::new(SlotWake {
                ready: Arc::clone(&ready),
                slot,
            }))
        })
        .collect();
    Join {
        futs,
        wakers,
        ready,
        left: n,
    }
}

impl<F: Future<Output = ()>> Join<F> {
    /// Polls the marked slots, pass after pass, until none is marked, or it stops early to let
    /// the runtime run (the marks it did not get to are kept).
    fn passes(&mut self) {
        let n = self.futs.len();
        let mut polled = 0usize;
        loop {
            let mut any = false;
            for w in 0..self.ready.bits.len() {
                let mut bits = self.ready.bits[w].swap(0, Ordering::SeqCst);
                while bits != 0 {
                    any = true;
                    let slot = w * 64 + bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    let Some(fut) = self.futs[slot].as_mut() else {
                        continue;
                    };
                    let mut cx = Context::from_waker(&self.wakers[slot]);
                    if fut.as_mut().poll(&mut cx).is_ready() {
                        self.futs[slot] = None;
                        self.left -= 1;
                    }
                    polled += 1;
                    if polled >= n {
                        if bits != 0 {
                            self.ready.bits[w].fetch_or(bits, Ordering::SeqCst);
                        }
                        return;
                    }
                }
            }
            if !any {
                return;
            }
        }
    }
}

impl<F: Future<Output = ()>> Future for Join<F> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        this.ready.parent.register(cx.waker());
        this.ready.polling.store(true, Ordering::SeqCst);
        this.passes();
        this.ready.polling.store(false, Ordering::SeqCst);
        if this.left == 0 {
            return Poll::Ready(());
        }
        if this.ready.any() {
            // Marks left by a pass that stopped early, or set by a wake that came while the
            // set was polled (it woke nobody): come back after the runtime had its turn.
            cx.waker().wake_by_ref();
        }
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

    /// Slots woken from other threads, some while the set is being polled, in random orders:
    /// every slot ends.
    #[test]
    fn every_slot_ends_whoever_wakes_it() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        for round in 0..50u64 {
            let done = Arc::new(AtomicUsize::new(0));
            let futs = (0..200u64).map(|i| {
                let done = Arc::clone(&done);
                async move {
                    for step in 0..3u64 {
                        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
                        let delay = (i * 7 + step * 13 + round) % 5;
                        std::thread::spawn(move || {
                            if delay > 0 {
                                std::thread::sleep(Duration::from_micros(delay * 20));
                            }
                            let _ = tx.send(());
                        });
                        rx.await.unwrap();
                    }
                    done.fetch_add(1, Ordering::Relaxed);
                }
            });
            let set = join(futs);
            rt.block_on(async {
                tokio::time::timeout(Duration::from_secs(30), set)
                    .await
                    .unwrap_or_else(|_| panic!("round {round}: a slot was never polled again"));
            });
            assert_eq!(done.load(Ordering::Relaxed), 200);
        }
    }

    /// Slots that wake themselves and wait for another task of the same thread: the set
    /// goes back to the runtime, so that task runs. (A set that kept polling them would never
    /// return: the runtime runs on a thread of its own, watched from here.)
    #[test]
    fn slots_that_wake_themselves_let_the_runtime_run() {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(self_waking_slots());
            let _ = tx.send(());
        });
        rx.recv_timeout(Duration::from_secs(10))
            .expect("the set starves the runtime");
    }

    async fn self_waking_slots() {
        let flag = Arc::new(AtomicBool::new(false));
        let futs = (0..4).map(|_| {
            let flag = Arc::clone(&flag);
            std::future::poll_fn(move |cx| {
                if flag.load(Ordering::Relaxed) {
                    Poll::Ready(())
                } else {
                    cx.waker().wake_by_ref();
                    Poll::Pending
                }
            })
        });
        let setter = tokio::spawn({
            let flag = Arc::clone(&flag);
            async move { flag.store(true, Ordering::Relaxed) }
        });
        join(futs).await;
        setter.await.unwrap();
    }

    /// A slot that ends at once, beside ones that end later, and an empty set.
    #[test]
    fn sets_of_any_size_end() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            join(Vec::<std::future::Ready<()>>::new()).await;
            let n = Arc::new(AtomicUsize::new(0));
            let futs = (0..130u64).map(|i| {
                let n = Arc::clone(&n);
                async move {
                    if i % 3 != 0 {
                        tokio::time::sleep(Duration::from_millis(i % 7)).await;
                    }
                    n.fetch_add(1, Ordering::Relaxed);
                }
            });
            join(futs).await;
            assert_eq!(n.load(Ordering::Relaxed), 130);
        });
    }
}
