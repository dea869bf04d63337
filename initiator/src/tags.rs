//! A queue's free command identifiers (tags): callers take one for each command, waiting
//! while all are in flight; the GPU request rings take what is free without waiting (callers
//! that wait come first: while they do, no tag is free); a tag comes back when its command's
//! slot is released. One short lock per take and per give, no semaphore. A caller that finds
//! none free joins a queue of waiting callers, under the same lock, and a tag given back goes
//! straight to the oldest of them (it is not put back for anyone to take): the caller is woken
//! once, with its tag, and never looks again in vain.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::{Context, Poll, Waker};

use parking_lot::Mutex;

/// The free tags of one queue.
pub(crate) struct TagPool {
    inner: Mutex<Inner>,
    /// `free.len()`, readable without the lock.
    available: AtomicUsize,
    total: usize,
    closed: AtomicBool,
}

struct Inner {
    free: Vec<u16>,
    /// Waiting callers, oldest first (keys of `waits`). Never non-empty while `free` is not.
    queue: VecDeque<usize>,
    /// The waiting callers' entries, by key (`None`: vacant, its key in `vacant`).
    waits: Vec<Option<Wait>>,
    vacant: Vec<usize>,
}

/// A waiting caller: what wakes it, and the tag handed to it.
struct Wait {
    waker: Waker,
    tag: Option<u16>,
}

impl Inner {
    /// Hands `tag` to the oldest waiting caller (returning its waker, to be woken once the
    /// lock is let go), or puts it back.
    fn give(&mut self, tag: u16) -> Option<Waker> {
        while let Some(key) = self.queue.pop_front() {
            if let Some(Some(w)) = self.waits.get_mut(key) {
                w.tag = Some(tag);
                // Woken once: the entry keeps a waker that does nothing.
                return Some(std::mem::replace(&mut w.waker, Waker::noop().clone()));
            }
        }
        self.free.push(tag);
        None
    }

    /// Ends the wait of `key`: its entry goes, and the tag handed to it, if any, is returned.
    fn leave(&mut self, key: usize) -> Option<u16> {
        let w = self.waits.get_mut(key).and_then(Option::take)?;
        self.vacant.push(key);
        if w.tag.is_none() {
            self.queue.retain(|&k| k != key);
        }
        w.tag
    }
}

impl TagPool {
    /// A pool of the tags `0..n` (taken lowest first).
    pub fn new(n: u16) -> Self {
        TagPool {
            inner: Mutex::new(Inner {
                free: (0..n).rev().collect(),
                queue: VecDeque::new(),
                waits: Vec::new(),
                vacant: Vec::new(),
            }),
            available: AtomicUsize::new(usize::from(n)),
            total: usize::from(n),
            closed: AtomicBool::new(false),
        }
    }

    /// Takes a free tag, waiting while none is; `None` once the pool is closed.
    pub fn take(&self) -> Take<'_> {
        Take {
            pool: self,
            key: None,
        }
    }

    /// Takes a free tag if there is one (and the pool is open).
    pub fn try_take(&self) -> Option<u16> {
        if self.is_closed() {
            return None;
        }
        let mut inner = self.inner.lock();
        let t = inner.free.pop()?;
        self.available.store(inner.free.len(), Ordering::Relaxed);
        Some(t)
    }

    /// Takes up to `max` free tags without waiting, appending them to `out`.
    pub fn take_many(&self, max: usize, out: &mut Vec<u16>) {
        if max == 0 || self.is_closed() || self.available.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut inner = self.inner.lock();
        let free = &mut inner.free;
        let at = free.len() - max.min(free.len());
        out.extend(free.drain(at..));
        self.available.store(free.len(), Ordering::Relaxed);
    }

    /// Gives a tag back: to the oldest waiting caller, if one waits.
    pub fn give(&self, tag: u16) {
        let waker = {
            let mut inner = self.inner.lock();
            let w = inner.give(tag);
            self.available.store(inner.free.len(), Ordering::Relaxed);
            w
        };
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// Gives several tags back (to waiting callers first, oldest first).
    pub fn give_many(&self, tags: &[u16]) {
        if tags.is_empty() {
            return;
        }
        let mut wake = Vec::new();
        {
            let mut inner = self.inner.lock();
            for &t in tags {
                wake.extend(inner.give(t));
            }
            self.available.store(inner.free.len(), Ordering::Relaxed);
        }
        for w in wake {
            w.wake();
        }
    }

    /// Refuses every take from now on and wakes the callers that wait.
    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        let wake: Vec<Waker> = {
            let inner = self.inner.lock();
            inner
                .waits
                .iter()
                .flatten()
                .map(|w| w.waker.clone())
                .collect()
        };
        for w in wake {
            w.wake();
        }
    }

    /// Whether the pool is closed.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// Tags taken and not given back (a tag handed to a waiting caller counts as taken).
    pub fn in_use(&self) -> usize {
        self.total
            .saturating_sub(self.available.load(Ordering::Relaxed))
    }

    /// Ends the wait of `key`, passing on a tag handed to it meanwhile.
    fn leave(&self, key: usize) {
        let handed = self.inner.lock().leave(key);
        if let Some(t) = handed {
            self.give(t);
        }
    }

    /// Callers waiting for a tag.
    #[cfg(test)]
    fn waiting(&self) -> usize {
        self.inner.lock().queue.len()
    }
}

/// [`TagPool::take`]: a tag, or `None` once the pool is closed. Dropped while it waits, it
/// leaves the queue (a tag already handed to it goes to the next waiting caller).
pub(crate) struct Take<'a> {
    pool: &'a TagPool,
    /// Its entry among the waiting callers, once it waits.
    key: Option<usize>,
}

impl Future for Take<'_> {
    type Output = Option<u16>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<u16>> {
        let pool = self.pool;
        let mut inner = pool.inner.lock();
        // Read under the lock: `close` sets it before it takes the lock to wake the waiting
        // callers, so a caller that registers after that sees it.
        let closed = pool.is_closed();
        if let Some(key) = self.key {
            if closed {
                drop(inner);
                self.key = None;
                pool.leave(key);
                return Poll::Ready(None);
            }
            let Some(Some(w)) = inner.waits.get_mut(key) else {
                self.key = None;
                return Poll::Ready(None);
            };
            if w.tag.is_some() {
                self.key = None;
                return Poll::Ready(inner.leave(key));
            }
            if !w.waker.will_wake(cx.waker()) {
                w.waker = cx.waker().clone();
            }
            return Poll::Pending;
        }
        if closed {
            return Poll::Ready(None);
        }
        if let Some(t) = inner.free.pop() {
            pool.available.store(inner.free.len(), Ordering::Relaxed);
            return Poll::Ready(Some(t));
        }
        let wait = Wait {
            waker: cx.waker().clone(),
            tag: None,
        };
        let key = match inner.vacant.pop() {
            Some(k) if k < inner.waits.len() => {
                inner.waits[k] = Some(wait);
                k
            }
            _ => {
                inner.waits.push(Some(wait));
                inner.waits.len() - 1
            }
        };
        inner.queue.push_back(key);
        self.key = Some(key);
        Poll::Pending
    }
}

impl Drop for Take<'_> {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            self.pool.leave(key);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;

    #[test]
    fn tags_are_taken_lowest_first_and_counted() {
        let p = TagPool::new(3);
        assert_eq!(p.try_take(), Some(0));
        assert_eq!(p.try_take(), Some(1));
        assert_eq!(p.in_use(), 2);
        let mut out = Vec::new();
        p.take_many(5, &mut out);
        assert_eq!(out, vec![2]);
        assert_eq!(p.try_take(), None);
        p.give_many(&out);
        p.give(0);
        assert_eq!(p.in_use(), 1);
    }

    /// A task that takes a tag from `p`, started and given time to find none free.
    async fn spawn_take(p: &Arc<TagPool>) -> tokio::task::JoinHandle<Option<u16>> {
        let p = Arc::clone(p);
        let waiter = tokio::spawn(async move { p.take().await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        waiter
    }

    #[tokio::test]
    async fn a_waiting_caller_gets_the_tag_given_back() {
        let p = Arc::new(TagPool::new(1));
        let t = p.try_take().unwrap();
        let waiter = spawn_take(&p).await;
        assert!(!waiter.is_finished());
        p.give(t);
        assert_eq!(waiter.await.unwrap(), Some(t));
    }

    #[tokio::test]
    async fn tags_given_back_together_wake_every_waiting_caller() {
        let p = Arc::new(TagPool::new(2));
        let taken = [p.try_take().unwrap(), p.try_take().unwrap()];
        let waiters = [spawn_take(&p).await, spawn_take(&p).await];
        p.give_many(&taken);
        let mut got = Vec::new();
        for w in waiters {
            got.push(w.await.unwrap().unwrap());
        }
        got.sort_unstable();
        assert_eq!(got, vec![0, 1]);
    }

    #[tokio::test]
    async fn a_caller_counts_as_waiting_only_while_it_waits() {
        let p = Arc::new(TagPool::new(1));
        let t = p.try_take().unwrap();
        let waiter = spawn_take(&p).await;
        assert_eq!(p.waiting(), 1);
        waiter.abort();
        assert!(waiter.await.unwrap_err().is_cancelled());
        assert_eq!(p.waiting(), 0);
        p.give(t);
        assert_eq!(p.take().await, Some(t));
        assert_eq!(p.waiting(), 0);
    }

    /// A tag given back goes to the oldest waiting caller, not to whoever asks next.
    #[tokio::test]
    async fn a_tag_given_back_goes_to_the_oldest_waiting_caller() {
        let p = Arc::new(TagPool::new(2));
        let (a, b) = (p.try_take().unwrap(), p.try_take().unwrap());
        let first = spawn_take(&p).await;
        let second = spawn_take(&p).await;
        assert_eq!(p.waiting(), 2);
        p.give(b);
        assert_eq!(p.try_take(), None, "handed over, not put back");
        assert_eq!(first.await.unwrap(), Some(b));
        assert!(!second.is_finished());
        p.give(a);
        assert_eq!(second.await.unwrap(), Some(a));
        assert_eq!(p.in_use(), 2);
    }

    /// A caller dropped after a tag was handed to it, before it looked, passes the tag on to
    /// the next waiting caller; with nobody waiting, the tag is free again.
    #[test]
    fn a_tag_handed_to_a_caller_that_is_gone_goes_on() {
        let p = TagPool::new(1);
        let t = p.try_take().unwrap();
        let waker = Waker::noop();
        let mut cx = Context::from_waker(waker);
        let mut first = Box::pin(p.take());
        let mut second = Box::pin(p.take());
        assert!(first.as_mut().poll(&mut cx).is_pending());
        assert!(second.as_mut().poll(&mut cx).is_pending());
        p.give(t);
        drop(first);
        assert_eq!(second.as_mut().poll(&mut cx), Poll::Ready(Some(t)));
        drop(second);
        let mut third = Box::pin(p.take());
        assert!(third.as_mut().poll(&mut cx).is_pending());
        p.give(t);
        drop(third);
        assert_eq!((p.waiting(), p.in_use()), (0, 0));
        assert_eq!(p.try_take(), Some(t));
    }

    /// Many callers on several threads taking and giving back far more often than there are
    /// tags, some of them giving up their wait: every take ends, no tag is lost or doubled.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn many_callers_share_few_tags_without_losing_one() {
        let p = Arc::new(TagPool::new(8));
        let held: Arc<Vec<AtomicBool>> = Arc::new((0..8).map(|_| AtomicBool::new(false)).collect());
        let mut tasks = Vec::new();
        for c in 0..64u32 {
            let (p, held) = (Arc::clone(&p), Arc::clone(&held));
            tasks.push(tokio::spawn(async move {
                for i in 0..500u32 {
                    if (c + i) % 7 == 0 {
                        // Give up a wait now and then (a tag handed to it meanwhile goes on).
                        let r = tokio::time::timeout(Duration::from_micros(50), p.take()).await;
                        if let Ok(Some(t)) = r {
                            p.give(t);
                        }
                        continue;
                    }
                    let t = p.take().await.expect("open pool");
                    let was = held[usize::from(t)].swap(true, Ordering::SeqCst);
                    assert!(!was, "tag {t} handed out twice");
                    tokio::task::yield_now().await;
                    held[usize::from(t)].store(false, Ordering::SeqCst);
                    p.give(t);
                }
            }));
        }
        for t in tasks {
            tokio::time::timeout(Duration::from_secs(30), t)
                .await
                .expect("every caller gets its tags")
                .expect("caller");
        }
        assert_eq!((p.waiting(), p.in_use()), (0, 0));
    }

    #[tokio::test]
    async fn closing_ends_the_wait_and_refuses_takes() {
        let p = Arc::new(TagPool::new(1));
        let _t = p.try_take().unwrap();
        let waiter = spawn_take(&p).await;
        p.close();
        assert_eq!(waiter.await.unwrap(), None);
        p.give(0);
        assert_eq!(p.try_take(), None);
        assert_eq!(p.take().await, None);
    }
}
