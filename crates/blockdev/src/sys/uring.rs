//! Per-thread io_uring rings driven by tokio.
//!
//! Each thread has one ring per tokio runtime it runs (thread-local). Submitting an operation
//! locks the ring (uncontended: only the owning thread submits, and the driver task takes the
//! lock once per batch), places the buffer and a reference to the file in a slot that the ring
//! owns, pushes the entry to the submission queue and, if it is the first entry queued since the
//! last `io_uring_enter`, wakes the ring's driver task.
//!
//! The driver task (one per ring, spawned on the runtime that created the ring) submits all
//! queued entries with one system call and reaps completions whenever the eventfd registered
//! with the ring becomes readable, waking the futures that wait for them.
//!
//! Soundness rests on the slots: an entry's buffer and file live in its slot from the push until
//! the kernel has posted the entry's completion, whatever happens to the [`Op`] future. A future
//! dropped early marks its slot abandoned and the slot is released when the completion arrives.
//! A ring dropped with operations in flight waits for them (or leaks their buffers when it
//! cannot wait) before its memory and the buffers are released.

use std::cell::RefCell;
use std::future::Future;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Waker};

use io_uring::{IoUring, opcode, squeue, types};
use parking_lot::Mutex;
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::sync::Notify;

use super::BackingFile;
use crate::IoBuf;

/// Submission queue entries per ring (the completion queue gets twice as many).
const RING_ENTRIES: u32 = 256;

/// Checks once per process that io_uring can be set up and supports the operations used here.
///
/// Returns the reason when it cannot (for example `ENOSYS` on old kernels or `EPERM` under
/// seccomp or `kernel.io_uring_disabled`).
pub(crate) fn availability() -> Result<(), &'static io::Error> {
    static AVAILABLE: OnceLock<Result<(), io::Error>> = OnceLock::new();
    AVAILABLE.get_or_init(probe).as_ref().map(|_| ())
}

fn probe() -> io::Result<()> {
    let ring: IoUring = IoUring::new(4)?;
    let mut probe = io_uring::Probe::new();
    ring.submitter().register_probe(&mut probe)?;
    for code in [
        opcode::Read::CODE,
        opcode::Write::CODE,
        opcode::Fsync::CODE,
        opcode::Fallocate::CODE,
    ] {
        if !probe.is_supported(code) {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("io_uring opcode {code} is not supported by this kernel"),
            ));
        }
    }
    Ok(())
}

/// What a slot holds.
enum SlotState {
    /// Not in use.
    Free,
    /// Submitted (or queued); the waker of the future waiting for it, once polled.
    Waiting(Option<Waker>),
    /// Completed with this result; the future has not collected it yet.
    Done(i32),
    /// The future was dropped; release the slot when the completion arrives.
    Abandoned,
}

/// One in-flight operation's resources, owned by the ring until its completion is reaped.
struct Slot {
    state: SlotState,
    buf: Option<IoBuf>,
    file: Option<Arc<BackingFile>>,
}

struct RingState {
    uring: IoUring,
    slots: Vec<Slot>,
    free: Vec<u32>,
    /// Entries pushed whose completion has not been reaped.
    in_flight: usize,
}

impl RingState {
    fn alloc_slot(&mut self) -> u32 {
        if let Some(idx) = self.free.pop() {
            return idx;
        }
        self.slots.push(Slot {
            state: SlotState::Free,
            buf: None,
            file: None,
        });
        (self.slots.len() - 1) as u32
    }

    fn release_slot(&mut self, idx: u32) -> Option<IoBuf> {
        let slot = &mut self.slots[idx as usize];
        slot.state = SlotState::Free;
        slot.file = None;
        let buf = slot.buf.take();
        self.free.push(idx);
        buf
    }

    /// Submits every queued entry.
    fn submit(&mut self) -> io::Result<()> {
        loop {
            if self.uring.submission().is_empty() {
                return Ok(());
            }
            match self.uring.submit() {
                Ok(_) => return Ok(()),
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) if matches!(e.raw_os_error(), Some(libc::EBUSY) | Some(libc::EAGAIN)) => {
                    // The kernel wants completions reaped first; entries stay queued and go
                    // with the next submission, which the next completion triggers.
                    self.reap();
                    return Ok(());
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Collects every posted completion and wakes the futures waiting for them.
    fn reap(&mut self) {
        let RingState {
            uring,
            slots,
            free,
            in_flight,
        } = self;
        for cqe in uring.completion() {
            let idx = cqe.user_data() as usize;
            let Some(slot) = slots.get_mut(idx) else {
                tracing::error!(user_data = idx, "io_uring completion for an unknown slot");
                continue;
            };
            match std::mem::replace(&mut slot.state, SlotState::Done(cqe.result())) {
                SlotState::Waiting(waker) => {
                    slot.file = None;
                    if let Some(waker) = waker {
                        waker.wake();
                    }
                }
                SlotState::Abandoned => {
                    slot.state = SlotState::Free;
                    slot.buf = None;
                    slot.file = None;
                    free.push(idx as u32);
                }
                other => {
                    tracing::error!(slot = idx, "io_uring completion for an idle slot");
                    slot.state = other;
                    continue;
                }
            }
            *in_flight -= 1;
        }
    }

    /// Submits and blocks the thread until at least one completion is posted, then reaps.
    fn wait_blocking(&mut self) -> io::Result<()> {
        match self.uring.submit_and_wait(1) {
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EINTR) | Some(libc::EBUSY) | Some(libc::EAGAIN)
                ) => {}
            Err(e) => return Err(e),
        }
        self.reap();
        Ok(())
    }

    /// Pushes an entry, submitting queued entries first if the queue is full.
    ///
    /// Returns whether the queue was empty before, that is whether the driver must be told.
    ///
    /// # Safety
    ///
    /// Every buffer and descriptor the entry refers to must stay valid until its completion
    /// has been reaped.
    unsafe fn push(&mut self, entry: &squeue::Entry) -> io::Result<bool> {
        let was_empty = self.uring.submission().is_empty();
        // SAFETY: the caller guarantees the entry's resources outlive the operation.
        if unsafe { self.uring.submission().push(entry) }.is_ok() {
            return Ok(was_empty);
        }
        self.submit()?;
        let was_empty = self.uring.submission().is_empty();
        // SAFETY: as above.
        match unsafe { self.uring.submission().push(entry) } {
            Ok(()) => Ok(was_empty),
            Err(_) => Err(io::Error::from_raw_os_error(libc::EAGAIN)),
        }
    }
}

/// A ring, its in-flight operations and the link to its driver task.
pub(crate) struct Ring {
    state: Mutex<RingState>,
    /// Wakes the driver when entries are queued or the owning thread has gone.
    notify: Notify,
    /// False once the driver task has ended (its runtime shut down).
    driver_alive: AtomicBool,
    /// True once the owning thread no longer uses the ring.
    orphaned: AtomicBool,
}

impl Ring {
    /// Creates a ring and spawns its driver on `handle`'s runtime. Must be called from inside
    /// that runtime.
    fn start(handle: &tokio::runtime::Handle) -> io::Result<Arc<Ring>> {
        let uring: IoUring = IoUring::new(RING_ENTRIES)?;
        let event_fd = super::eventfd()?;
        uring.submitter().register_eventfd(event_fd.as_raw_fd())?;
        // SAFETY: an `OwnedFd` is an open descriptor that stays open, and names the same
        // eventfd, until the `AsyncFd` that owns it is dropped; `as_raw_fd` always returns it.
        let event_fd = unsafe { AsyncFd::register_with_interest(event_fd, Interest::READABLE) }
            .map_err(io::Error::from)?;
        let ring = Arc::new(Ring {
            state: Mutex::new(RingState {
                uring,
                slots: Vec::with_capacity(RING_ENTRIES as usize),
                free: Vec::with_capacity(RING_ENTRIES as usize),
                in_flight: 0,
            }),
            notify: Notify::new(),
            driver_alive: AtomicBool::new(true),
            orphaned: AtomicBool::new(false),
        });
        // The guard is moved into the task, so it is dropped (marking the driver dead) even if
        // the runtime drops the task before ever polling it.
        let guard = DriverGuard(ring.clone());
        handle.spawn(drive(guard, event_fd));
        if !ring.driver_alive() {
            // A runtime that is shutting down drops new tasks at once. Refuse new I/O rather
            // than completing it inline, which would keep the task from ever yielding.
            return Err(io::Error::other("the tokio runtime is shutting down"));
        }
        Ok(ring)
    }

    fn driver_alive(&self) -> bool {
        self.driver_alive.load(Ordering::Acquire)
    }

    /// Places `buf` and `file` in a new slot, builds the entry (which may point into the slot's
    /// buffer) and pushes it.
    fn submit_op(
        self: Arc<Self>,
        file: &Arc<BackingFile>,
        buf: Option<IoBuf>,
        build: impl FnOnce(types::Fd, Option<&mut IoBuf>) -> squeue::Entry,
    ) -> Result<Op, (io::Error, Option<IoBuf>)> {
        let mut st = self.state.lock();
        let idx = st.alloc_slot();
        let slot = &mut st.slots[idx as usize];
        slot.buf = buf;
        slot.file = Some(file.clone());
        slot.state = SlotState::Waiting(None);
        let entry = build(types::Fd(file.as_raw_fd()), slot.buf.as_mut()).user_data(u64::from(idx));
        // SAFETY: the entry refers to the descriptor of the file and to memory of the buffer,
        // both of which the slot now owns. The slot is released only by `reap` after the
        // entry's completion was posted, or by `Op` after it observed `Done`; `Ring::drop`
        // waits for every in-flight entry or leaks the slots. `IoBuf` memory does not move
        // when the `IoBuf` value moves into the slot.
        match unsafe { st.push(&entry) } {
            Ok(first) => {
                st.in_flight += 1;
                drop(st);
                if first {
                    self.notify.notify_one();
                }
                Ok(Op {
                    ring: self,
                    idx,
                    finished: false,
                })
            }
            Err(e) => {
                let buf = st.release_slot(idx);
                Err((e, buf))
            }
        }
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        let st = self.state.get_mut();
        while st.in_flight > 0 {
            if let Err(e) = st.wait_blocking() {
                tracing::error!(
                    error = %e,
                    in_flight = st.in_flight,
                    "cannot wait for io_uring completions; leaking their buffers"
                );
                std::mem::forget(std::mem::take(&mut st.slots));
                return;
            }
        }
    }
}

/// Owned by the driver task; marks the driver dead and wakes all waiters when dropped.
struct DriverGuard(Arc<Ring>);

impl Drop for DriverGuard {
    fn drop(&mut self) {
        self.0.driver_alive.store(false, Ordering::Release);
        // Waiters re-poll, see that no driver is left and wait for their completions
        // themselves.
        let mut st = self.0.state.lock();
        for slot in &mut st.slots {
            if let SlotState::Waiting(waker) = &mut slot.state
                && let Some(waker) = waker.take()
            {
                waker.wake();
            }
        }
    }
}

/// The driver task of one ring.
async fn drive(guard: DriverGuard, event_fd: AsyncFd<OwnedFd>) {
    let ring = &guard.0;
    loop {
        {
            let mut st = ring.state.lock();
            if let Err(e) = st.submit() {
                tracing::error!(error = %e, "io_uring submission failed");
            }
            st.reap();
            if ring.orphaned.load(Ordering::Acquire) && st.in_flight == 0 {
                return;
            }
        }
        tokio::select! {
            biased;
            ready = event_fd.readable() => match ready {
                // Cleared before reaping: a completion posted after this point raises the
                // eventfd again.
                Ok(mut ready) => ready.clear_ready(),
                Err(e) => {
                    tracing::error!(error = %e, "io_uring eventfd failed; completions are now waited for inline");
                    return;
                }
            },
            () = ring.notify.notified() => {}
        }
    }
}

/// The current thread's ring for one runtime.
struct LocalRing {
    runtime: tokio::runtime::Id,
    ring: Arc<Ring>,
}

impl Drop for LocalRing {
    fn drop(&mut self) {
        self.ring.orphaned.store(true, Ordering::Release);
        self.ring.notify.notify_one();
    }
}

thread_local! {
    static RINGS: RefCell<Vec<LocalRing>> = const { RefCell::new(Vec::new()) };
}

/// Why no ring could be had.
pub(crate) enum RingError {
    /// Not inside a tokio runtime.
    NoRuntime,
    /// Creating the ring failed.
    Io(io::Error),
}

/// Returns this thread's ring for the current runtime, creating it on first use.
fn current_ring() -> Result<Arc<Ring>, RingError> {
    let handle = tokio::runtime::Handle::try_current().map_err(|_| RingError::NoRuntime)?;
    let id = handle.id();
    RINGS
        .try_with(|rings| {
            let mut rings = rings.borrow_mut();
            if let Some(local) = rings.iter().find(|r| r.runtime == id)
                && local.ring.driver_alive()
            {
                return Ok(local.ring.clone());
            }
            rings.retain(|r| r.ring.driver_alive());
            let ring = Ring::start(&handle).map_err(RingError::Io)?;
            rings.push(LocalRing {
                runtime: id,
                ring: ring.clone(),
            });
            Ok(ring)
        })
        .map_err(|_| RingError::NoRuntime)?
}

/// A failed submission: the reason and the buffer, handed back.
pub(crate) type SubmitError = (RingError, Option<IoBuf>);

fn submit(
    file: &Arc<BackingFile>,
    buf: Option<IoBuf>,
    build: impl FnOnce(types::Fd, Option<&mut IoBuf>) -> squeue::Entry,
) -> Result<Op, SubmitError> {
    let ring = match current_ring() {
        Ok(ring) => ring,
        Err(e) => return Err((e, buf)),
    };
    ring.submit_op(file, buf, build)
        .map_err(|(e, buf)| (RingError::Io(e), buf))
}

fn einval() -> RingError {
    RingError::Io(io::Error::from_raw_os_error(libc::EINVAL))
}

/// Reads `len` bytes at file `offset` into `buf[start..start + len]`.
pub(crate) fn read_at(
    file: &Arc<BackingFile>,
    offset: u64,
    buf: IoBuf,
    start: usize,
    len: u32,
) -> Result<Op, SubmitError> {
    if start
        .checked_add(len as usize)
        .is_none_or(|end| end > buf.capacity())
    {
        return Err((einval(), Some(buf)));
    }
    submit(file, Some(buf), |fd, buf| match buf {
        Some(buf) => {
            let ptr = buf.data_mut_ptr().wrapping_add(start);
            opcode::Read::new(fd, ptr, len).offset(offset).build()
        }
        None => opcode::Nop::new().build(),
    })
}

/// Writes `buf[start..start + len]` at file `offset`; with `dsync` the write completes only
/// once the data is durable (`RWF_DSYNC`, as `pwritev2` takes it).
pub(crate) fn write_at(
    file: &Arc<BackingFile>,
    offset: u64,
    buf: IoBuf,
    start: usize,
    len: u32,
    dsync: bool,
) -> Result<Op, SubmitError> {
    if start
        .checked_add(len as usize)
        .is_none_or(|end| end > buf.capacity())
    {
        return Err((einval(), Some(buf)));
    }
    submit(file, Some(buf), |fd, buf| match buf {
        Some(buf) => {
            let ptr = buf.data_ptr().wrapping_add(start);
            let flags = if dsync { libc::RWF_DSYNC } else { 0 };
            opcode::Write::new(fd, ptr, len)
                .offset(offset)
                .rw_flags(flags)
                .build()
        }
        None => opcode::Nop::new().build(),
    })
}

/// `fdatasync(2)` of the file.
pub(crate) fn fdatasync(file: &Arc<BackingFile>) -> Result<Op, SubmitError> {
    submit(file, None, |fd, _| {
        opcode::Fsync::new(fd)
            .flags(types::FsyncFlags::DATASYNC)
            .build()
    })
}

/// `fallocate(2)` of `len` bytes at `offset` with `mode`.
pub(crate) fn fallocate(
    file: &Arc<BackingFile>,
    mode: i32,
    offset: u64,
    len: u64,
) -> Result<Op, SubmitError> {
    submit(file, None, |fd, _| {
        opcode::Fallocate::new(fd, len)
            .offset(offset)
            .mode(mode)
            .build()
    })
}

/// A submitted operation. Resolves to the completion's result (a byte count or a negative
/// errno) and the buffer. Dropping it before completion is sound: the ring keeps the buffer
/// until the kernel is done with it.
pub(crate) struct Op {
    ring: Arc<Ring>,
    idx: u32,
    finished: bool,
}

impl Future for Op {
    type Output = (i32, Option<IoBuf>);

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        if this.finished {
            return Poll::Ready((-libc::EINVAL, None));
        }
        let mut st = this.ring.state.lock();
        loop {
            let slot = &mut st.slots[this.idx as usize];
            match &mut slot.state {
                SlotState::Done(res) => {
                    let res = *res;
                    let buf = st.release_slot(this.idx);
                    this.finished = true;
                    return Poll::Ready((res, buf));
                }
                SlotState::Waiting(waker) => {
                    if this.ring.driver_alive() {
                        match waker {
                            Some(w) if w.will_wake(cx.waker()) => {}
                            _ => *waker = Some(cx.waker().clone()),
                        }
                        return Poll::Pending;
                    }
                    // The runtime that drove this ring is gone: wait for the completion here.
                    if let Err(e) = st.wait_blocking() {
                        tracing::error!(error = %e, "io_uring wait failed; abandoning the operation");
                        st.slots[this.idx as usize].state = SlotState::Abandoned;
                        this.finished = true;
                        return Poll::Ready((-e.raw_os_error().unwrap_or(libc::EIO), None));
                    }
                }
                SlotState::Free | SlotState::Abandoned => {
                    this.finished = true;
                    return Poll::Ready((-libc::EINVAL, None));
                }
            }
        }
    }
}

impl Drop for Op {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        let mut st = self.ring.state.lock();
        match st.slots[self.idx as usize].state {
            SlotState::Done(_) => {
                st.release_slot(self.idx);
            }
            SlotState::Waiting(_) => st.slots[self.idx as usize].state = SlotState::Abandoned,
            SlotState::Free | SlotState::Abandoned => {}
        }
    }
}

#[cfg(test)]
pub(crate) mod test_support {
    //! Introspection for tests.

    use super::*;

    /// The number of operations in flight on this thread's ring for the current runtime.
    pub(crate) fn in_flight_on_current_ring() -> Option<usize> {
        let handle = tokio::runtime::Handle::try_current().ok()?;
        let id = handle.id();
        RINGS.with(|rings| {
            rings
                .borrow()
                .iter()
                .find(|r| r.runtime == id)
                .map(|r| r.ring.state.lock().in_flight)
        })
    }
}
