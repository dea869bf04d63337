//! The bytes a connection has queued for sending: its own encoded bytes (headers, small
//! payloads, digests) and, between them, payloads it shares with their owner (namespace
//! memory) and sends from there, so that a large read reaches the socket without being
//! copied into the send buffer first.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;

/// One run of queued bytes.
#[derive(Debug)]
enum Seg {
    /// The next `len` bytes of the queue's own buffer.
    Own { len: usize },
    /// A range of a shared buffer.
    Shared {
        data: Arc<[u8]>,
        range: Range<usize>,
    },
}

impl Seg {
    fn len(&self) -> usize {
        match self {
            Seg::Own { len } => *len,
            Seg::Shared { range, .. } => range.len(),
        }
    }
}

/// A position to roll the queue back to ([`SendQueue::rollback`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Mark {
    own: usize,
    segs: usize,
    last_len: usize,
    queued: u64,
}

/// Sent bytes at the front of the own buffer beyond which [`SendQueue::consume`] drops them
/// while unsent bytes remain (and the sent bytes are at least half of the buffer).
pub(crate) const COMPACT_AT: usize = 1 << 20;

/// Bytes waiting to be sent, in order.
#[derive(Debug, Default)]
pub(crate) struct SendQueue {
    own: Vec<u8>,
    /// Bytes of `own` already sent.
    own_pos: usize,
    segs: VecDeque<Seg>,
    /// Bytes of the front segment already sent.
    front_sent: usize,
    /// Bytes ever queued and ever sent: positions in the connection's outgoing stream.
    queued: u64,
    sent: u64,
}

impl SendQueue {
    /// Appends own bytes written by `f` into the own buffer.
    pub fn append(&mut self, f: impl FnOnce(&mut Vec<u8>)) {
        let before = self.own.len();
        f(&mut self.own);
        let added = self.own.len().saturating_sub(before);
        if added == 0 {
            return;
        }
        self.queued += added as u64;
        // Extend the last run of own bytes (when that is the front, partly sent, its
        // `front_sent` still counts from where it started).
        if let Some(Seg::Own { len }) = self.segs.back_mut() {
            *len += added;
        } else {
            self.segs.push_back(Seg::Own { len: added });
        }
    }

    /// Appends `data[range]`, sent from `data` itself. An empty range is ignored.
    pub fn push_shared(&mut self, data: Arc<[u8]>, range: Range<usize>) {
        if range.is_empty() {
            return;
        }
        self.queued += range.len() as u64;
        self.segs.push_back(Seg::Shared { data, range });
    }

    /// Where [`rollback`](Self::rollback) returns to.
    pub fn mark(&self) -> Mark {
        Mark {
            own: self.own.len(),
            segs: self.segs.len(),
            last_len: self.segs.back().map_or(0, Seg::len),
            queued: self.queued,
        }
    }

    /// Forgets everything queued after `m` (which must not have been sent yet).
    pub fn rollback(&mut self, m: Mark) {
        self.own.truncate(m.own);
        self.segs.truncate(m.segs);
        if let Some(Seg::Own { len }) = self.segs.back_mut() {
            *len = m.last_len;
        }
        self.queued = m.queued;
    }

    /// Bytes waiting to be sent.
    pub fn len(&self) -> usize {
        (self.queued - self.sent) as usize
    }

    /// Position in the outgoing stream of the end of what is queued.
    pub fn queued(&self) -> u64 {
        self.queued
    }

    /// Position in the outgoing stream of the end of what was sent.
    pub fn sent(&self) -> u64 {
        self.sent
    }

    /// The unsent bytes in order, as contiguous slices.
    pub fn slices(&self) -> impl Iterator<Item = &[u8]> {
        let mut own = self.own_pos;
        self.segs.iter().enumerate().map(move |(i, s)| {
            let skip = if i == 0 { self.front_sent } else { 0 };
            match s {
                Seg::Own { len } => {
                    let start = own;
                    own += len - skip;
                    &self.own[start..start + len - skip]
                }
                Seg::Shared { data, range } => &data[range.start + skip..range.end],
            }
        })
    }

    /// The first contiguous run of unsent bytes (empty when nothing waits).
    pub fn front(&self) -> &[u8] {
        self.slices().next().unwrap_or(&[])
    }

    /// Marks `n` bytes as sent (clamped to what waits).
    pub fn consume(&mut self, n: usize) {
        let mut n = n.min(self.len());
        self.sent += n as u64;
        while n > 0 {
            let Some(front) = self.segs.front() else {
                break;
            };
            let left = front.len() - self.front_sent;
            let take = left.min(n);
            if matches!(front, Seg::Own { .. }) {
                self.own_pos += take;
            }
            n -= take;
            if take == left {
                self.segs.pop_front();
                self.front_sent = 0;
            } else {
                self.front_sent += take;
            }
        }
        if self.segs.is_empty() {
            self.own.clear();
            self.own_pos = 0;
            self.front_sent = 0;
        } else if self.own_pos >= COMPACT_AT && self.own_pos * 2 >= self.own.len() {
            // A connection whose peer keeps a little unread at every write never empties
            // this queue, so the own buffer would keep the sent bytes and grow for as long as
            // the connection is busy: drop the sent prefix (moving at most as many bytes as
            // were sent since it was last dropped).
            self.own.drain(..self.own_pos);
            self.own_pos = 0;
        }
    }

    /// Memory this queue holds: its own buffer's capacity (sent bytes included until the
    /// queue empties) and the namespace memory its shared segments wait to send.
    pub fn held(&self) -> usize {
        let shared: usize = self
            .segs
            .iter()
            .filter(|s| matches!(s, Seg::Shared { .. }))
            .map(Seg::len)
            .sum();
        self.own.capacity() + shared
    }

    /// Gives back capacity of the own buffer beyond `keep` while nothing waits.
    pub fn shrink(&mut self, keep: usize) {
        if self.segs.is_empty() && self.own.capacity() > keep {
            self.own.shrink_to(keep);
        }
        if self.segs.is_empty() && self.segs.capacity() > 64 {
            self.segs.shrink_to(64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(q: &SendQueue) -> Vec<u8> {
        q.slices().flatten().copied().collect()
    }

    #[test]
    fn a_queue_that_never_drains_keeps_its_buffer_bounded() {
        let shared: Arc<[u8]> = (0..=255u8).collect::<Vec<_>>().into();
        let mut q = SendQueue::default();
        let (mut want, mut sent) = (Vec::new(), Vec::new());
        for round in 0..100_000usize {
            // Each round queues a header, shared data and a trailer; the socket takes all but
            // a few bytes: the queue never empties.
            let b = (round % 251) as u8;
            q.append(|v| v.extend_from_slice(&[b; 24]));
            q.push_shared(Arc::clone(&shared), 0..100);
            q.append(|v| v.extend_from_slice(&[b; 40]));
            want.extend_from_slice(&[b; 24]);
            want.extend(0..100u8);
            want.extend_from_slice(&[b; 40]);
            while q.len() > 7 {
                let f = q.front();
                let n = f.len().min(q.len() - 7);
                sent.extend_from_slice(&f[..n]);
                q.consume(n);
            }
            assert!(
                q.own.len() <= 2 * COMPACT_AT + 64,
                "round {round}: own buffer {} bytes for {} unsent",
                q.own.len(),
                q.len()
            );
        }
        sent.extend(q.slices().flatten().copied());
        assert_eq!(sent, want, "bytes leave in order across compactions");
    }

    #[test]
    fn own_and_shared_bytes_leave_in_order() {
        let shared: Arc<[u8]> = (0..100u8).collect::<Vec<_>>().into();
        let mut q = SendQueue::default();
        q.append(|v| v.extend_from_slice(b"hdr1"));
        q.push_shared(Arc::clone(&shared), 10..20);
        q.append(|v| v.extend_from_slice(b"dg"));
        q.append(|v| v.extend_from_slice(b"hdr2"));
        q.push_shared(Arc::clone(&shared), 0..3);
        let mut want = b"hdr1".to_vec();
        want.extend(10..20u8);
        want.extend_from_slice(b"dghdr2");
        want.extend([0, 1, 2]);
        assert_eq!(all(&q), want);
        assert_eq!(q.len(), want.len());
        assert_eq!(q.slices().count(), 4, "adjacent own bytes are one slice");
        // Consume in uneven steps across every boundary.
        let mut sent = Vec::new();
        while q.len() > 0 {
            let f = q.front();
            assert!(!f.is_empty());
            let n = f.len().min(3);
            sent.extend_from_slice(&f[..n]);
            q.consume(n);
            assert_eq!(all(&q), want[sent.len()..]);
        }
        assert_eq!(sent, want);
        assert_eq!(
            (q.queued(), q.sent()),
            (want.len() as u64, want.len() as u64)
        );
        assert!(q.front().is_empty());
        assert_eq!(
            Arc::strong_count(&shared),
            1,
            "sent shared data is released"
        );
    }

    #[test]
    fn rollback_forgets_what_followed_the_mark() {
        let shared: Arc<[u8]> = vec![7u8; 8].into();
        let mut q = SendQueue::default();
        q.append(|v| v.extend_from_slice(b"abc"));
        q.consume(1);
        let m = q.mark();
        q.append(|v| v.extend_from_slice(b"de"));
        q.push_shared(Arc::clone(&shared), 0..8);
        q.append(|v| v.extend_from_slice(b"f"));
        q.rollback(m);
        assert_eq!(all(&q), b"bc");
        assert_eq!(q.len(), 2);
        q.append(|v| v.extend_from_slice(b"x"));
        assert_eq!(all(&q), b"bcx");
        q.consume(usize::MAX);
        assert_eq!(q.len(), 0);
        assert_eq!(q.sent(), 4);
    }
}
