//! The daemon-wide memory budget (`[target] memory_budget`).
//!
//! Each connection accounts the big allocations it holds — its send backlog (its own bytes
//! and the namespace memory large reads are sent from), the PDUs waiting in its receive
//! buffer, the data buffers of writes waiting for their data and of requests running on a
//! backend — against one shared [`MemoryBudget`] through a [`Charge`]. A connection with
//! more than [`FREE_SHARE`] of work under way stops handling received commands while the daemon's total is
//! over the budget (it stops reading its socket, as with a full send backlog) and goes on
//! once other connections gave memory back; capacity it keeps for later it gives back
//! while the budget is exceeded. A connection with less under way may always take one
//! more command, so every connection makes progress — a correct host is served while
//! hostile ones hold the budget — and none waits for memory it could never get: the budget
//! is exceeded by at most [`FREE_SHARE`] and one command's data (MDTS) per connection.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::Notify;

/// The smallest budget accepted: room for a few commands of the largest transfer size.
pub const MIN_MEMORY_BUDGET: u64 = 16 << 20;

/// What a connection may hold and still take on more while the daemon is over its budget.
pub const FREE_SHARE: u64 = 256 << 10;

/// The memory shared by every connection of a target.
#[derive(Debug)]
pub struct MemoryBudget {
    limit: u64,
    used: AtomicU64,
    freed: Notify,
}

impl MemoryBudget {
    /// A budget of `limit` bytes, none used.
    pub fn new(limit: u64) -> Arc<Self> {
        Arc::new(MemoryBudget {
            limit,
            used: AtomicU64::new(0),
            freed: Notify::new(),
        })
    }

    /// The budget in bytes.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Bytes the connections account now.
    pub fn in_use(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    /// Whether the connections together hold more than the budget.
    pub fn exceeded(&self) -> bool {
        self.in_use() > self.limit
    }

    /// Resolves after some connection gave memory back (or at once, rarely, for a release
    /// that happened just before).
    pub async fn freed(&self) {
        self.freed.notified().await;
    }
}

/// The step in which a connection's holding is charged to the shared budget: changes
/// within one step (a 4 KiB command starting and completing) touch no shared cache line.
pub const GRANULE: u64 = 64 << 10;

/// What one connection holds of a [`MemoryBudget`]; released when dropped.
#[derive(Debug)]
pub struct Charge {
    budget: Arc<MemoryBudget>,
    held: u64,
    /// What is charged to the budget: `held` rounded up to a whole [`GRANULE`].
    charged: u64,
}

impl Charge {
    /// A charge of nothing against `budget`.
    pub fn new(budget: &Arc<MemoryBudget>) -> Self {
        Charge {
            budget: Arc::clone(budget),
            held: 0,
            charged: 0,
        }
    }

    /// Bytes this connection accounts now.
    pub fn held(&self) -> u64 {
        self.held
    }

    /// Accounts `bytes` for this connection from now on (more or less than before).
    ///
    /// The budget is charged in whole [`GRANULE`]s, so that the small changes of every
    /// command cost no atomic operation on the counter all reactors share; waiters are woken
    /// only when memory is given back while the budget is exceeded (no one waits otherwise).
    pub fn set(&mut self, bytes: u64) {
        self.held = bytes;
        let charge = bytes.div_ceil(GRANULE) * GRANULE;
        if charge > self.charged {
            self.budget
                .used
                .fetch_add(charge - self.charged, Ordering::Relaxed);
        } else if charge < self.charged {
            let before = self
                .budget
                .used
                .fetch_sub(self.charged - charge, Ordering::Relaxed);
            if before > self.budget.limit {
                self.budget.freed.notify_waiters();
            }
        }
        self.charged = charge;
    }

    /// Whether this connection must wait before it takes on more: the daemon is over its
    /// budget and this connection's work under way (`active` bytes: data waiting to be sent
    /// or received, buffers of running requests) is more than [`FREE_SHARE`]. Capacity it
    /// merely keeps for later does not count: it gives that back when the budget is
    /// exceeded.
    pub fn must_wait(&self, active: u64) -> bool {
        active > FREE_SHARE && self.budget.exceeded()
    }

    /// The budget this charge is against.
    pub fn budget(&self) -> &Arc<MemoryBudget> {
        &self.budget
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.set(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_add_up_and_are_released_when_dropped() {
        const M: u64 = 1 << 20;
        let b = MemoryBudget::new(100 * M);
        let mut a = Charge::new(&b);
        let mut c = Charge::new(&b);
        a.set(60 * M);
        c.set(30 * M);
        assert_eq!(b.in_use(), 90 * M);
        assert!(!a.must_wait(a.held()));
        c.set(50 * M);
        assert!(b.exceeded());
        assert!(a.must_wait(a.held()) && c.must_wait(c.held()));
        a.set(10 * M);
        assert_eq!(b.in_use(), 60 * M);
        assert!(!c.must_wait(c.held()));
        drop(c);
        assert_eq!(b.in_use(), 10 * M);
        drop(a);
        assert_eq!(b.in_use(), 0);
    }

    #[test]
    fn small_changes_stay_within_a_granule() {
        let b = MemoryBudget::new(MIN_MEMORY_BUDGET);
        let mut a = Charge::new(&b);
        a.set(1);
        assert_eq!(b.in_use(), GRANULE);
        a.set(GRANULE);
        assert_eq!((a.held(), b.in_use()), (GRANULE, GRANULE));
        a.set(GRANULE + 4096);
        assert_eq!(b.in_use(), 2 * GRANULE);
        a.set(4096);
        assert_eq!((a.held(), b.in_use()), (4096, GRANULE));
        a.set(0);
        assert_eq!(b.in_use(), 0);
    }

    #[test]
    fn a_connection_holding_little_never_waits() {
        let b = MemoryBudget::new(MIN_MEMORY_BUDGET);
        let mut a = Charge::new(&b);
        a.set(MIN_MEMORY_BUDGET + 1);
        let mut small = Charge::new(&b);
        small.set(FREE_SHARE);
        assert!(a.must_wait(a.held()));
        assert!(!small.must_wait(small.held()));
    }
}
