//! A queue's free command identifiers (tags): callers take one for each command, waiting
//! while all are in flight; the GPU request rings take what is free without waiting; a tag
//! comes back when its command's slot is released. One short lock per take and per give, no
//! semaphore: a caller waits on a [`Notify`] only when none is free, and a give notifies only
//! while a caller waits.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use parking_lot::Mutex;
use tokio::sync::Notify;

/// Uncounts a caller of [`TagPool::take`] however it ends (a tag, closed, or dropped).
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The free tags of one queue.
pub(crate) struct TagPool {
    free: Mutex<Vec<u16>>,
    /// `free.len()`, readable without the lock.
    available: AtomicUsize,
    total: usize,
    closed: AtomicBool,
    /// Callers in [`take`](Self::take) that found no tag: only then does a give notify.
    waiting: AtomicUsize,
    freed: Notify,
}

impl TagPool {
    /// A pool of the tags `0..n` (taken lowest first).
    pub fn new(n: u16) -> Self {
        TagPool {
            free: Mutex::new((0..n).rev().collect()),
            available: AtomicUsize::new(usize::from(n)),
            total: usize::from(n),
            closed: AtomicBool::new(false),
            waiting: AtomicUsize::new(0),
            freed: Notify::new(),
        }
    }

    /// Takes a free tag, waiting while none is; `None` once the pool is closed.
    pub async fn take(&self) -> Option<u16> {
        if let Some(t) = self.try_take() {
            return Some(t);
        }
        self.waiting.fetch_add(1, Ordering::SeqCst);
        let _waiting = Waiting(&self.waiting);
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            // Counted and registered before looking again: a tag given back from now on
            // wakes it (a give sees the count, or this look sees the tag).
            freed.as_mut().enable();
            if self.is_closed() {
                return None;
            }
            if let Some(t) = self.try_take() {
                return Some(t);
            }
            freed.await;
        }
    }

    /// Takes a free tag if there is one (and the pool is open).
    pub fn try_take(&self) -> Option<u16> {
        if self.is_closed() {
            return None;
        }
        let mut free = self.free.lock();
        let t = free.pop()?;
        self.available.store(free.len(), Ordering::Relaxed);
        Some(t)
    }

    /// Takes up to `max` free tags without waiting, appending them to `out`.
    pub fn take_many(&self, max: usize, out: &mut Vec<u16>) {
        if max == 0 || self.is_closed() || self.available.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut free = self.free.lock();
        let at = free.len() - max.min(free.len());
        out.extend(free.drain(at..));
        self.available.store(free.len(), Ordering::Relaxed);
    }

    /// Gives a tag back.
    pub fn give(&self, tag: u16) {
        {
            let mut free = self.free.lock();
            free.push(tag);
            self.available.store(free.len(), Ordering::Relaxed);
        }
        if self.waiting.load(Ordering::SeqCst) > 0 {
            self.freed.notify_one();
        }
    }

    /// Gives several tags back.
    pub fn give_many(&self, tags: &[u16]) {
        if tags.is_empty() {
            return;
        }
        {
            let mut free = self.free.lock();
            free.extend_from_slice(tags);
            self.available.store(free.len(), Ordering::Relaxed);
        }
        if self.waiting.load(Ordering::SeqCst) > 0 {
            // More than one caller may wait.
            self.freed.notify_waiters();
            self.freed.notify_one();
        }
    }

    /// Refuses every take from now on and wakes the callers that wait.
    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.freed.notify_waiters();
    }

    /// Whether the pool is closed.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// Tags taken and not given back.
    pub fn in_use(&self) -> usize {
        self.total
            .saturating_sub(self.available.load(Ordering::Relaxed))
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
        assert_eq!(p.waiting.load(Ordering::SeqCst), 1);
        waiter.abort();
        assert!(waiter.await.unwrap_err().is_cancelled());
        assert_eq!(p.waiting.load(Ordering::SeqCst), 0);
        p.give(t);
        assert_eq!(p.take().await, Some(t));
        assert_eq!(p.waiting.load(Ordering::SeqCst), 0);
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
