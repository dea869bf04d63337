//! Reactors: one OS thread per core, each running a current-thread tokio runtime that owns the
//! connections handed to it, of every transport. Connections never migrate, so per-connection
//! state needs no locks. Listeners hand new connections round-robin through a [`Pool`].
//!
//! With a poll window (`poll_us`), a reactor that has just received data keeps asking the
//! kernel for socket readiness without sleeping (`epoll_wait` with a zero timeout, through the
//! runtime's own driver) until the window passes with no new data; then it sleeps as usual. A
//! busy host's next command is picked up without a wake-up from idle, which on virtual machines
//! and deep C-states costs tens of microseconds; an idle reactor costs nothing. The window
//! opens only while commands arrive densely enough for polling to catch them
//! ([`busy_poll::PollGate`]): sparse traffic does not keep a core spinning. While they do,
//! the reactor keeps polling for [`HOLD`] windows after the last command, so that a host that
//! sends in bursts (it reads a batch of answers, then submits the next commands) finds it
//! awake after each pause; steady traffic slower than the window still sleeps between
//! commands.
//!
//! A connection that is the only one of its reactor to have received data within the hold
//! may also, after answering, read its own socket in a loop for up to one window
//! (`spin_until`) instead of going back to the runtime: the next command is taken the moment
//! it arrives, without a turn of the runtime's I/O driver, timers and task queue in between
//! (on NVMe/TCP, a QD1 read's answer leaves about 0.8 µs sooner). While it does, nothing else
//! of the reactor runs, so it reads for [`SPIN_MAX`] at most at a time, and a connection
//! reads this way only while no other connection of the reactor received data within the
//! hold.

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use busy_poll::{Alone, PollGate, SPIN_MAX};
use tokio::sync::{Notify, mpsc};
use tracing::error;

use crate::target::{StartError, Target};

/// A new connection of some transport, on its way to a reactor.
pub trait Incoming: Send {
    /// The connection's task, run on the reactor that takes it until the connection ends.
    fn serve(self: Box<Self>, target: Arc<Target>) -> Pin<Box<dyn Future<Output = ()>>>;

    /// Refuses the connection: the reactors have stopped.
    fn refuse(self: Box<Self>) {}
}

/// A new connection on its way to a reactor.
pub type Connection = Box<dyn Incoming>;

/// The reactor threads' inboxes. Dropping every clone of the pool lets the reactors end once
/// their connections have.
pub struct Pool {
    senders: Vec<mpsc::UnboundedSender<Connection>>,
    next: AtomicUsize,
}

impl Pool {
    /// Starts the target's reactor threads (`reactors` in the settings; 0: one per CPU of
    /// `cpus`, else one per core), each pinned to its CPU of `cpus` when that is set.
    pub fn start(
        target: &Arc<Target>,
    ) -> Result<(Arc<Pool>, Vec<std::thread::JoinHandle<()>>), StartError> {
        let cpus = reactor_cpus(target.settings.cpus.as_deref())?;
        let n = match (target.settings.reactors, cpus.len()) {
            (0, 0) => std::thread::available_parallelism().map_or(1, |n| n.get()),
            (0, c) => c,
            (n, _) => n,
        };
        let mut senders = Vec::with_capacity(n);
        let mut threads = Vec::with_capacity(n);
        for i in 0..n {
            let (tx, rx) = mpsc::unbounded_channel();
            senders.push(tx);
            let t = Arc::clone(target);
            let cpu = (!cpus.is_empty()).then(|| cpus[i % cpus.len()]);
            let handle = std::thread::Builder::new()
                .name(format!("nvmeof-reactor-{i}"))
                .spawn(move || {
                    if let Some(cpu) = cpu {
                        pin_current_thread(i, cpu);
                    }
                    run(i, t, rx)
                })
                .map_err(StartError::Reactor)?;
            threads.push(handle);
        }
        let pool = Pool {
            senders,
            next: AtomicUsize::new(0),
        };
        Ok((Arc::new(pool), threads))
    }

    /// Hands `conn` to the next reactor; refuses it, and fails, when the reactors have
    /// stopped.
    pub fn hand(&self, conn: Connection) -> Result<(), Stopped> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.senders.len();
        self.senders[i]
            .send(conn)
            .map_err(|mpsc::error::SendError(c)| {
                c.refuse();
                Stopped
            })
    }
}

/// The CPUs of a `cpus` list (none when unset), each one this process may run on.
fn reactor_cpus(list: Option<&str>) -> Result<Vec<usize>, StartError> {
    let Some(list) = list else {
        return Ok(Vec::new());
    };
    let cpus = crate::config::parse_cpu_list(list).map_err(StartError::Cpus)?;
    let allowed = rustix::thread::sched_getaffinity(None)
        .map_err(|e| StartError::Cpus(format!("cannot read this process's CPUs: {e}")))?;
    let usable = |c: usize| c < rustix::thread::CpuSet::MAX_CPU && allowed.is_set(c);
    if let Some(c) = cpus.iter().find(|&&c| !usable(c)) {
        let mine: Vec<String> = (0..rustix::thread::CpuSet::MAX_CPU)
            .filter(|&c| allowed.is_set(c))
            .map(|c| c.to_string())
            .collect();
        return Err(StartError::Cpus(format!(
            "CPU {c} of {list:?} is not one this process may run on ({})",
            mine.join(",")
        )));
    }
    Ok(cpus)
}

/// Pins the calling reactor thread to `cpu` (checked as allowed at start; a failure now is
/// logged and the reactor runs unpinned).
fn pin_current_thread(reactor: usize, cpu: usize) {
    let mut set = rustix::thread::CpuSet::new();
    set.set(cpu);
    if let Err(e) = rustix::thread::sched_setaffinity(None, &set) {
        error!(reactor, cpu, error = %e, "cannot pin reactor to its CPU; it runs unpinned");
    }
}

/// The reactors have stopped: no more connections are taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stopped;

/// While traffic is dense, a reactor polls for this many poll windows after the last command
/// (arrivals are still scored against one window).
pub const HOLD: u32 = 4;

/// Names a connection to its reactor's poller ([`note_activity`], [`spin_until`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ConnKey(u64);

impl ConnKey {
    /// A key no other connection of this process has.
    pub(crate) fn new() -> ConnKey {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        ConnKey(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

/// The busy-poll state of one reactor thread.
struct Poller {
    gate: Cell<PollGate>,
    alone: Cell<Alone>,
    /// The poll window.
    window: Duration,
    sleeping: Cell<bool>,
    stop: Cell<bool>,
    wake: Notify,
}

thread_local! {
    static POLLER: RefCell<Option<Rc<Poller>>> = const { RefCell::new(None) };
}

/// Notes that connection `conn` on this thread just received data: the reactor keeps polling
/// for the poll window. Costs one thread-local check when polling is off.
pub(crate) fn note_activity(conn: ConnKey) {
    POLLER.with(|p| {
        if let Some(p) = p.borrow().as_ref() {
            let now = Instant::now();
            let mut gate = p.gate.get();
            gate.arrived(now);
            p.gate.set(gate);
            let mut alone = p.alone.get();
            alone.arrived(conn.0, now, p.window * HOLD);
            p.alone.set(alone);
            if p.sleeping.get() && gate.polling(now) {
                p.wake.notify_one();
            }
        }
    });
}

/// Until when connection `conn`, which has just answered and waits for nothing but its
/// socket, may read that socket in a loop rather than go back to the runtime: the end of the
/// reactor's poll window (one window and [`SPIN_MAX`] at most), while it is the only
/// connection of the reactor that received data within the hold. `None` when the reactor does
/// not poll now or another connection is active.
pub(crate) fn spin_until(conn: ConnKey) -> Option<Instant> {
    POLLER.with(|p| {
        let p = p.borrow();
        let p = p.as_ref()?;
        let now = Instant::now();
        let left = p.gate.get().remaining(now);
        let spin = left.min(p.window).min(SPIN_MAX);
        (!left.is_zero() && p.alone.get().alone(conn.0, now)).then(|| now + spin)
    })
}

/// Yields to the runtime (which then polls its I/O driver without blocking) while data arrived
/// within the window; sleeps until the next activity otherwise.
async fn poll_loop(p: Rc<Poller>) {
    while !p.stop.get() {
        if p.gate.get().polling(Instant::now()) {
            tokio::task::yield_now().await;
        } else {
            p.sleeping.set(true);
            p.wake.notified().await;
            p.sleeping.set(false);
        }
    }
}

/// Runs reactor `index` until its connection channel closes and its connections have ended.
fn run(index: usize, target: Arc<Target>, mut rx: mpsc::UnboundedReceiver<Connection>) {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            error!(reactor = index, error = %e, "cannot start reactor runtime");
            return;
        }
    };
    let local = tokio::task::LocalSet::new();
    let poller = (target.settings.poll_us > 0).then(|| {
        let window = Duration::from_micros(u64::from(target.settings.poll_us));
        let p = Rc::new(Poller {
            gate: Cell::new(PollGate::with_hold(window, window * HOLD)),
            alone: Cell::new(Alone::default()),
            window,
            sleeping: Cell::new(false),
            stop: Cell::new(false),
            wake: Notify::new(),
        });
        POLLER.with(|slot| *slot.borrow_mut() = Some(Rc::clone(&p)));
        local.spawn_local(poll_loop(Rc::clone(&p)));
        p
    });
    local.block_on(&rt, async {
        while let Some(conn) = rx.recv().await {
            tokio::task::spawn_local(conn.serve(Arc::clone(&target)));
        }
    });
    // Stop polling, then let every connection finish its in-flight commands and close.
    if let Some(p) = poller {
        p.stop.set(true);
        p.wake.notify_one();
        POLLER.with(|slot| slot.borrow_mut().take());
    }
    rt.block_on(local);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cpu_out_of_reach_fails_the_start_with_one_line() {
        // (Pinning itself is tested on the daemon's process, whose threads are all its own.)
        let mut cfg = crate::testing::config(&["null:1M"]);
        cfg.target.cpus = Some((rustix::thread::CpuSet::MAX_CPU - 1).to_string());
        let t = Target::build(&cfg).unwrap();
        let e = Pool::start(&t)
            .err()
            .expect("a CPU out of reach")
            .to_string();
        assert!(
            e.starts_with("target.cpus: CPU") && e.contains("is not one this process may run on"),
            "{e}"
        );
        assert_eq!(reactor_cpus(None).unwrap(), Vec::<usize>::new());
    }
}
