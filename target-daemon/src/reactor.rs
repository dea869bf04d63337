//! Reactors: one OS thread per core, each running a current-thread tokio runtime that owns the
//! connections handed to it. Connections never migrate, so per-connection state needs no locks.
//!
//! With a poll window (`poll_us`), a reactor that has just received data keeps asking the
//! kernel for socket readiness without sleeping (`epoll_wait` with a zero timeout, through the
//! runtime's own driver) until the window passes with no new data; then it sleeps as usual. A
//! busy host's next command is picked up without a wake-up from idle, which on virtual machines
//! and deep C-states costs tens of microseconds; an idle reactor costs nothing.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{Notify, mpsc};
use tracing::{error, warn};

use crate::admission::Permit;
use crate::target::Target;

/// The busy-poll state of one reactor thread.
struct Poller {
    window: Duration,
    last: Cell<Instant>,
    sleeping: Cell<bool>,
    stop: Cell<bool>,
    wake: Notify,
}

thread_local! {
    static POLLER: RefCell<Option<Rc<Poller>>> = const { RefCell::new(None) };
}

/// Notes that a connection on this thread just received data: the reactor keeps polling for
/// the poll window. Costs one thread-local check when polling is off.
pub(crate) fn note_activity() {
    POLLER.with(|p| {
        if let Some(p) = p.borrow().as_ref() {
            p.last.set(Instant::now());
            if p.sleeping.get() {
                p.wake.notify_one();
            }
        }
    });
}

/// Yields to the runtime (which then polls its I/O driver without blocking) while data arrived
/// within the window; sleeps until the next activity otherwise.
async fn poll_loop(p: Rc<Poller>) {
    while !p.stop.get() {
        if p.last.get().elapsed() < p.window {
            tokio::task::yield_now().await;
        } else {
            p.sleeping.set(true);
            p.wake.notified().await;
            p.sleeping.set(false);
        }
    }
}

/// Runs reactor `index` until its connection channel closes and its connections have ended.
pub fn run(
    index: usize,
    target: Arc<Target>,
    mut rx: mpsc::UnboundedReceiver<(std::net::TcpStream, Permit)>,
) {
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
        // Start asleep: the window opens with the first data received.
        let long_ago = Instant::now()
            .checked_sub(window)
            .unwrap_or_else(Instant::now);
        let p = Rc::new(Poller {
            window,
            last: Cell::new(long_ago),
            sleeping: Cell::new(false),
            stop: Cell::new(false),
            wake: Notify::new(),
        });
        POLLER.with(|slot| *slot.borrow_mut() = Some(Rc::clone(&p)));
        local.spawn_local(poll_loop(Rc::clone(&p)));
        p
    });
    local.block_on(&rt, async {
        while let Some((stream, permit)) = rx.recv().await {
            let stream = match tokio::net::TcpStream::from_std(stream) {
                Ok(s) => s,
                Err(e) => {
                    warn!(reactor = index, error = %e, "cannot register connection");
                    continue;
                }
            };
            let t = Arc::clone(&target);
            tokio::task::spawn_local(crate::tcp::serve(t, stream, permit));
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
