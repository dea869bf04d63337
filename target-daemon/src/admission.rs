//! Connection admission: the limits on open connections (per listener and in total), and one
//! rate-limited log line per listener and reason for the connections dropped because of a
//! limit or because they did not finish their handshake in time.
//!
//! Every connection holds a [`Permit`] from the moment it is accepted until it closes;
//! dropping the permit gives its place back. The transports enforce the handshake deadline
//! ([`crate::config::TargetSettings::handshake_timeout`]) and report it here.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::Notify;
use tracing::warn;

use crate::config::ListenAddr;

/// At most one log line per listener and reason in this interval.
pub const DROP_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Why a connection was dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DropReason {
    /// The listener or the target was at its connection limit: closed as soon as accepted.
    Limit,
    /// The host did not finish the transport handshake and the Fabrics Connect in time.
    HandshakeTimeout,
}

/// A count of open connections with an upper bound.
#[derive(Debug)]
pub struct ConnectionCount {
    open: AtomicUsize,
    max: usize,
}

impl ConnectionCount {
    /// A count that admits at most `max` connections.
    pub fn new(max: usize) -> Self {
        ConnectionCount {
            open: AtomicUsize::new(0),
            max,
        }
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    fn try_acquire(&self) -> bool {
        self.open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max).then_some(n + 1)
            })
            .is_ok()
    }

    fn release(&self) {
        self.open.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The admission state of one listener.
#[derive(Debug)]
pub struct ListenerGate {
    addr: ListenAddr,
    total: Arc<ConnectionCount>,
    open: ConnectionCount,
    refused: DropLog,
    timed_out: DropLog,
}

impl ListenerGate {
    /// A gate admitting at most `max` connections on `addr`, and none beyond `total`'s bound.
    pub fn new(addr: ListenAddr, max: usize, total: Arc<ConnectionCount>) -> Arc<Self> {
        Arc::new(ListenerGate {
            addr,
            total,
            open: ConnectionCount::new(max),
            refused: DropLog::new("connection limit reached"),
            timed_out: DropLog::new("handshake timeout"),
        })
    }

    /// The listener's address.
    pub fn addr(&self) -> &ListenAddr {
        &self.addr
    }

    /// Connections open on this listener now.
    pub fn open(&self) -> usize {
        self.open.open()
    }

    /// Takes a place for a new connection, or notes the connection as refused and returns
    /// None (the caller closes it at once).
    pub fn admit(self: &Arc<Self>) -> Option<Permit> {
        if self.total.try_acquire() {
            if self.open.try_acquire() {
                return Some(Permit {
                    gate: Arc::clone(self),
                });
            }
            self.total.release();
        }
        self.note_dropped(DropReason::Limit);
        None
    }

    /// Counts a dropped connection; logs at once when no line for this reason was written in
    /// the last [`DROP_LOG_INTERVAL`], otherwise [`ListenerGate::report_drops`] logs later.
    pub fn note_dropped(&self, reason: DropReason) {
        let log = match reason {
            DropReason::Limit => &self.refused,
            DropReason::HandshakeTimeout => &self.timed_out,
        };
        log.note(&self.addr);
    }

    /// Writes the deferred counts now, whenever the last lines were written (at shutdown).
    pub fn flush_drops(&self) {
        for log in [&self.refused, &self.timed_out] {
            *log.last.lock() = None;
            log.log(&self.addr, Instant::now());
        }
    }

    /// Writes the deferred log lines when they are due. Never returns: run it beside the
    /// listener's accept loop.
    pub async fn report_drops(&self) {
        tokio::join!(
            self.refused.report(&self.addr),
            self.timed_out.report(&self.addr)
        );
    }
}

/// A connection's place in its listener's and the target's counts, given back on drop.
#[derive(Debug)]
pub struct Permit {
    gate: Arc<ListenerGate>,
}

impl Permit {
    /// The listener that accepted the connection.
    pub fn gate(&self) -> &ListenerGate {
        &self.gate
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.gate.open.release();
        self.gate.total.release();
    }
}

/// Dropped connections of one reason on one listener, and when they were last logged.
#[derive(Debug)]
struct DropLog {
    reason: &'static str,
    pending: AtomicU64,
    last: Mutex<Option<Instant>>,
    due: Notify,
}

impl DropLog {
    fn new(reason: &'static str) -> Self {
        DropLog {
            reason,
            pending: AtomicU64::new(0),
            last: Mutex::new(None),
            due: Notify::new(),
        }
    }

    fn note(&self, addr: &ListenAddr) {
        self.pending.fetch_add(1, Ordering::Relaxed);
        if !self.log(addr, Instant::now()) {
            self.due.notify_one();
        }
    }

    /// Logs the count since the last line unless a line was written less than
    /// [`DROP_LOG_INTERVAL`] before `now`; returns false when it is too early.
    fn log(&self, addr: &ListenAddr, now: Instant) -> bool {
        let mut last = self.last.lock();
        if last.is_some_and(|t| now.saturating_duration_since(t) < DROP_LOG_INTERVAL) {
            return false;
        }
        let n = self.pending.swap(0, Ordering::Relaxed);
        if n > 0 {
            warn!(listener = %addr, reason = self.reason, dropped = n, "connections dropped");
            *last = Some(now);
        }
        true
    }

    async fn report(&self, addr: &ListenAddr) {
        loop {
            self.due.notified().await;
            let due = self
                .last
                .lock()
                .map_or_else(Instant::now, |t| t + DROP_LOG_INTERVAL);
            tokio::time::sleep_until(due.into()).await;
            if !self.log(addr, Instant::now()) {
                // A line was written meanwhile: wait for its interval to pass instead.
                self.due.notify_one();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gate(max: usize, total: &Arc<ConnectionCount>) -> Arc<ListenerGate> {
        let addr = "tcp://127.0.0.1:4420".parse().unwrap();
        ListenerGate::new(addr, max, Arc::clone(total))
    }

    #[test]
    fn limits_per_listener_and_in_total() {
        let total = Arc::new(ConnectionCount::new(3));
        let (a, b) = (gate(2, &total), gate(2, &total));
        let a1 = a.admit().unwrap();
        let _a2 = a.admit().unwrap();
        assert!(a.admit().is_none(), "listener limit");
        let _b1 = b.admit().unwrap();
        assert!(b.admit().is_none(), "total limit");
        assert_eq!((a.open(), b.open(), total.open()), (2, 1, 3));
        drop(a1);
        assert_eq!((a.open(), total.open()), (1, 2));
        let _b2 = b.admit().unwrap();
        assert_eq!((b.open(), total.open()), (2, 3));
        // A refusal by the listener gives back the place it took in the total.
        assert!(b.admit().is_none());
        assert_eq!(total.open(), 3);
    }

    #[test]
    fn drop_log_writes_once_per_interval() {
        let log = DropLog::new("test");
        let addr: ListenAddr = "tcp://127.0.0.1:4420".parse().unwrap();
        let t0 = Instant::now();
        log.pending.store(1, Ordering::Relaxed);
        assert!(log.log(&addr, t0), "the first drop is logged at once");
        assert_eq!(log.pending.load(Ordering::Relaxed), 0);
        log.pending.store(5, Ordering::Relaxed);
        assert!(!log.log(&addr, t0 + Duration::from_secs(9)));
        assert_eq!(
            log.pending.load(Ordering::Relaxed),
            5,
            "kept for the next line"
        );
        assert!(log.log(&addr, t0 + DROP_LOG_INTERVAL));
        assert_eq!(log.pending.load(Ordering::Relaxed), 0);
        assert_eq!(*log.last.lock(), Some(t0 + DROP_LOG_INTERVAL));
    }
}
