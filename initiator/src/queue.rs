//! Queues: one task per queue drives the queue core ([`crate::queue_core`]: the command
//! table, deadlines, retries, reconnect hand-over) and owns the queue's link
//! ([`crate::link`]: the NVMe/TCP socket and engine, or the NVMe/RDMA queue pair).
//!
//! A caller takes a command slot (a tag, which is also the command identifier on the wire),
//! fills the slot's staging buffer, and hands the command to the queue task through a
//! channel. The task gives every command that is ready to the core, which sends it through
//! the link (NVMe/TCP gathers the capsules in the engine's send buffer and writes them with
//! one `write`); what the link receives goes to the core, which stores each completion in
//! its slot and wakes that one caller. A caller may lend its own buffer for a read (pinned
//! memory for a GPU copy, for example) so the data lands there directly (NVMe/TCP).
//!
//! Tags come from a free list and buffers stay with their slot, so steady-state I/O does not
//! allocate. Every command has a deadline (except Asynchronous Event Requests), checked by
//! the task on a timer: a target that stops answering gives a timeout error, never a hang.
//!
//! A queue task may also serve GPU request rings ([`crate::ring_proxy`]): it takes the
//! requests from its rings on each wake-up and starts them as reads with free tags, like
//! commands from callers.
//!
//! When the link is lost the core keeps reads (and everything idempotent) to resend on the
//! next link and fails writes with [`Error::Interrupted`] (unless writes may be retried); the
//! task reports the loss to the controller's supervisor, which reconnects and hands a new
//! link over.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use busy_poll::PollGate;
use nvme_spec::Cqe;
use parking_lot::Mutex;
use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio::time::{Instant, MissedTickBehavior};

use crate::Error;
use crate::buffer::{LentBuffer, SlotBuf};
use crate::error::command_name;
use crate::link::{self, Link, LinkWake};
use crate::queue_core::{Completions, Core, QueueCounters, RingDone, RingSlot, bump};
pub(crate) use crate::queue_core::{DataDir, Request, Retry};
use crate::registered::Direct;
use crate::ring_serve::{RingGrant, RingTable, RingWait, TagSource};

/// Submissions taken from the channel per wake-up.
const SUBMIT_BATCH: usize = 256;

/// Messages to the supervisor.
pub(crate) enum SupMsg {
    /// A queue lost its connection.
    QueueFailed {
        qid: u16,
        generation: u64,
        error: Error,
    },
    /// Keep Alive failed with an error status.
    KeepAliveFailed { generation: u64, error: Error },
    /// Disconnect gracefully.
    Shutdown {
        reply: Option<oneshot::Sender<Result<(), Error>>>,
    },
}

struct Submission {
    tag: u16,
    req: Request,
    buf: SlotBuf,
    direct: Option<Direct>,
}

/// Where a command's data lives instead of the slot's own buffer.
enum Data {
    /// Caller-registered memory the target reaches (NVMe/RDMA).
    Direct(Direct),
    /// A buffer the caller lent for a read.
    Lent(Box<dyn LentBuffer>),
}

/// Messages from the supervisor to a queue task.
pub(crate) enum QueueCtl {
    /// Use this connection (of association `generation`).
    Attach(Box<Link>, u64),
    /// Drop the connection (the supervisor is resetting the association); keep commands.
    Detach,
    /// Fail everything now and from now on.
    Fail(Error),
    /// Fail everything with [`Error::Closed`] and end the task.
    Close,
    /// Serve these GPU request rings.
    AttachRings(RingGrant),
    /// Stop serving the rings of attachment `id`; answer `done` once they are let go.
    DetachRings {
        id: u64,
        done: Option<oneshot::Sender<()>>,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Free,
    Waiting,
    Done,
    Abandoned,
}

struct SlotState {
    phase: Phase,
    waker: Option<Waker>,
    result: Option<Result<Cqe, Error>>,
    buf: SlotBuf,
    /// The slot's own buffer while `buf` is one lent by the caller.
    spare: SlotBuf,
}

/// A snapshot of a queue's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct QueueStats {
    /// Queue ID (0 is the admin queue).
    pub qid: u16,
    /// Commands sent (a retried command counts once per send).
    pub commands: u64,
    /// Writes whose data travelled in the command capsule.
    pub in_capsule_writes: u64,
    /// Writes whose data was sent on R2T requests (NVMe/RDMA: fetched by the target with
    /// RDMA READ through a keyed SGL).
    pub r2t_writes: u64,
    /// R2T PDUs answered.
    pub r2ts: u64,
    /// Bytes received as read data.
    pub bytes_read: u64,
    /// Bytes sent as write data.
    pub bytes_written: u64,
    /// Commands resent after a connection loss or a transient transport error.
    pub retries: u64,
    /// Commands that timed out.
    pub timeouts: u64,
    /// Connections this queue has used.
    pub connections: u64,
    /// NVMe/RDMA commands whose data the target moved straight to or from caller-registered
    /// memory (a `RegisteredBuffer`), with no slot buffer and no copy.
    pub registered_commands: u64,
    /// Bytes those commands moved.
    pub registered_bytes: u64,
    /// Command buffers registered for NVMe/RDMA (a slot's or a queue pair identifier's
    /// buffer, the first time a keyed command uses it and when a larger transfer comes):
    /// registrations are kept, so this stops growing once every buffer has been used.
    pub buffer_registrations: u64,
    /// NVMe/TCP read data received from the socket straight into the command's buffer (the
    /// rest: received into the connection's buffer, then copied).
    pub in_place_bytes: u64,
    /// Reads whose data went into a buffer lent by the caller (see `ReadDest::lend`).
    pub lent_commands: u64,
    /// Reads started from GPU request rings (see `Controller::attach_gpu_rings`).
    pub ring_reads: u64,
    /// Requests taken from GPU request rings and completed at once with an error status
    /// (invalid, or the queue had failed).
    pub ring_rejected: u64,
}

/// State shared by a queue's task and its callers.
pub(crate) struct QueueShared {
    qid: u16,
    slots: Box<[Mutex<SlotState>]>,
    free: Mutex<Vec<u16>>,
    permits: Semaphore,
    counters: QueueCounters,
    closed_error: Mutex<Option<Error>>,
}

impl QueueShared {
    fn release(&self, tag: u16) {
        self.free.lock().push(tag);
        self.permits.add_permits(1);
    }

    /// Takes up to `max` free tags without waiting, appending them to `out` (one lock).
    fn take_tags(&self, max: usize, out: &mut Vec<u16>) {
        let n = self.permits.available_permits().min(max);
        if n == 0 {
            return;
        }
        match self.permits.try_acquire_many(n as u32) {
            Ok(p) => p.forget(),
            Err(_) => return,
        }
        let mut free = self.free.lock();
        let k = n.min(free.len());
        let at = free.len() - k;
        out.extend(free.drain(at..));
        drop(free);
        if k < n {
            self.permits.add_permits(n - k);
        }
    }

    /// Releases several tags (one lock).
    fn release_many(&self, tags: &[u16]) {
        if tags.is_empty() {
            return;
        }
        self.free.lock().extend_from_slice(tags);
        self.permits.add_permits(tags.len());
    }

    /// Stores a result in a slot and wakes its caller (or frees an abandoned slot).
    fn finish_slot(&self, tag: u16, result: Result<Cqe, Error>, buf: SlotBuf) {
        let Some(slot) = self.slots.get(usize::from(tag)) else {
            return;
        };
        let mut st = slot.lock();
        st.buf = buf;
        match st.phase {
            Phase::Waiting => {
                st.result = Some(result);
                st.phase = Phase::Done;
                let waker = st.waker.take();
                drop(st);
                if let Some(w) = waker {
                    w.wake();
                }
            }
            Phase::Abandoned => {
                st.phase = Phase::Free;
                st.waker = None;
                drop(st);
                self.release(tag);
            }
            Phase::Free | Phase::Done => {}
        }
    }

    fn stats(&self) -> QueueStats {
        QueueStats::of(self.qid, &self.counters)
    }
}

impl QueueStats {
    /// A snapshot of queue `qid`'s counters.
    pub(crate) fn of(qid: u16, c: &QueueCounters) -> QueueStats {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        QueueStats {
            qid,
            commands: g(&c.commands),
            in_capsule_writes: g(&c.in_capsule_writes),
            r2t_writes: g(&c.r2t_writes),
            r2ts: g(&c.r2ts),
            bytes_read: g(&c.bytes_read),
            bytes_written: g(&c.bytes_written),
            retries: g(&c.retries),
            timeouts: g(&c.timeouts),
            connections: g(&c.connections),
            registered_commands: g(&c.registered_commands),
            registered_bytes: g(&c.registered_bytes),
            buffer_registrations: g(&c.buffer_registrations),
            in_place_bytes: g(&c.in_place_bytes),
            lent_commands: g(&c.lent_commands),
            ring_reads: g(&c.ring_reads),
            ring_rejected: g(&c.ring_rejected),
        }
    }
}

impl Completions for Arc<QueueShared> {
    fn finish(&mut self, tag: u16, result: Result<Cqe, Error>, buf: SlotBuf) {
        self.finish_slot(tag, result, buf);
    }

    fn counters(&self) -> &QueueCounters {
        &self.counters
    }
}

/// The caller side of a queue.
pub(crate) struct QueueHandle {
    shared: Arc<QueueShared>,
    sub_tx: mpsc::UnboundedSender<Submission>,
    ctl_tx: mpsc::UnboundedSender<QueueCtl>,
}

/// Settings of a queue task.
pub(crate) struct QueueConfig {
    pub qid: u16,
    /// Command slots (commands in flight at most).
    pub slots: u16,
    pub addr: String,
    pub retry_writes: bool,
    /// How often deadlines are checked.
    pub scan_period: Duration,
    /// Busy-poll window after activity (zero: never poll).
    pub busy_poll: Duration,
    /// Poll window of the GPU request rings after activity.
    pub ring_poll: Duration,
}

impl QueueHandle {
    /// Creates a queue and spawns its task (on the current tokio runtime). The queue has no
    /// connection until the supervisor attaches one; commands wait until then.
    pub fn spawn(cfg: QueueConfig, report: mpsc::UnboundedSender<SupMsg>) -> QueueHandle {
        let n = cfg.slots.max(1);
        let slots: Vec<Mutex<SlotState>> = (0..n)
            .map(|_| {
                Mutex::new(SlotState {
                    phase: Phase::Free,
                    waker: None,
                    result: None,
                    buf: SlotBuf::default(),
                    spare: SlotBuf::default(),
                })
            })
            .collect();
        let shared = Arc::new(QueueShared {
            qid: cfg.qid,
            slots: slots.into_boxed_slice(),
            free: Mutex::new((0..n).rev().collect()),
            permits: Semaphore::new(usize::from(n)),
            counters: QueueCounters::default(),
            closed_error: Mutex::new(None),
        });
        let (sub_tx, sub_rx) = mpsc::unbounded_channel();
        let (ctl_tx, ctl_rx) = mpsc::unbounded_channel();
        let task = Task {
            live: None,
            core: Core::new(
                Arc::clone(&shared),
                cfg.addr,
                n,
                cfg.retry_writes,
                cfg.qid == 0,
            ),
            shared: Arc::clone(&shared),
            sub_rx,
            ctl_rx,
            report,
            generation: 0,
            scan_period: cfg.scan_period,
            batch: Vec::with_capacity(SUBMIT_BATCH),
            poll: PollGate::new(cfg.busy_poll),
            rings: RingTable::new(cfg.ring_poll),
            ring_done: Vec::with_capacity(usize::from(n)),
            ring_tags: RingTags {
                shared: Arc::clone(&shared),
                tags: Vec::new(),
            },
        };
        tokio::spawn(task.run());
        QueueHandle {
            shared,
            sub_tx,
            ctl_tx,
        }
    }

    /// Sends a control message to the task.
    pub fn control(&self, msg: QueueCtl) {
        let _ = self.ctl_tx.send(msg);
    }

    /// Counters.
    pub fn stats(&self) -> QueueStats {
        self.shared.stats()
    }

    /// Number of command slots.
    pub fn slots(&self) -> usize {
        self.shared.slots.len()
    }

    fn closed_error(&self) -> Error {
        self.shared
            .closed_error
            .lock()
            .clone()
            .unwrap_or(Error::Closed)
    }

    /// Takes a slot (waiting for one if all are busy), fills its buffer with `fill` for
    /// host-to-controller data, and hands the command to the task.
    pub async fn start<F>(&self, req: Request, fill: F) -> Result<Pending<'_>, Error>
    where
        F: FnOnce(&mut [u8]) -> Result<(), Error>,
    {
        self.start_with(req, fill, None).await
    }

    /// Takes a slot and hands over a command whose data the target moves straight to or from
    /// caller-registered memory (NVMe/RDMA). The command holds the memory until it ends (or
    /// until its queue pair is destroyed), whatever happens to the returned [`Pending`].
    pub async fn start_direct(&self, req: Request, direct: Direct) -> Result<Pending<'_>, Error> {
        self.start_with(req, |_| Ok(()), Some(Data::Direct(direct)))
            .await
    }

    /// Takes a slot and hands over a read whose data is received into `lent` (at least
    /// `req.len` bytes) instead of the slot's buffer; [`Pending::take_lent`] gives it back.
    /// A lent buffer of a command that is abandoned is dropped when the slot is next used.
    pub async fn start_lent(
        &self,
        req: Request,
        lent: Box<dyn LentBuffer>,
    ) -> Result<Pending<'_>, Error> {
        self.start_with(req, |_| Ok(()), Some(Data::Lent(lent)))
            .await
    }

    async fn start_with<F>(
        &self,
        req: Request,
        fill: F,
        data: Option<Data>,
    ) -> Result<Pending<'_>, Error>
    where
        F: FnOnce(&mut [u8]) -> Result<(), Error>,
    {
        let permit = self
            .shared
            .permits
            .acquire()
            .await
            .map_err(|_| self.closed_error())?;
        permit.forget();
        let Some(tag) = self.shared.free.lock().pop() else {
            self.shared.permits.add_permits(1);
            return Err(Error::InvalidArgument(
                "internal: no free command slot".into(),
            ));
        };
        let slot = &self.shared.slots[usize::from(tag)];
        let len = req.len as usize;
        let (mut buf, direct) = {
            let mut st = slot.lock();
            st.phase = Phase::Waiting;
            st.result = None;
            if matches!(st.buf, SlotBuf::Lent(_)) {
                // Left by an abandoned command: its owner is gone.
                st.buf = std::mem::take(&mut st.spare);
            }
            match data {
                None => (std::mem::take(&mut st.buf), None),
                Some(Data::Direct(d)) => (std::mem::take(&mut st.buf), Some(d)),
                Some(Data::Lent(l)) => {
                    st.spare = std::mem::take(&mut st.buf);
                    (SlotBuf::Lent(l), None)
                }
            }
        };
        if direct.is_none() {
            if let Err(e) = buf.ensure(len) {
                self.shared.finish_slot(tag, Err(e.clone()), buf);
                return Err(e);
            }
        }
        if matches!(buf, SlotBuf::Lent(_)) {
            bump(&self.shared.counters.lent_commands, 1);
        }
        let pending = Pending {
            shared: &self.shared,
            tag,
        };
        if req.dir == DataDir::FromHost && direct.is_none() {
            if let Err(e) = fill(&mut buf.as_mut_slice()[..len]) {
                self.shared.finish_slot(tag, Err(e.clone()), buf);
                return Err(e);
            }
        }
        let sub = Submission {
            tag,
            req,
            buf,
            direct,
        };
        if let Err(mpsc::error::SendError(s)) = self.sub_tx.send(sub) {
            let e = self.closed_error();
            self.shared.finish_slot(tag, Err(e.clone()), s.buf);
            return Err(e);
        }
        Ok(pending)
    }

    /// Runs one command to completion. A completion with an error status is an
    /// [`Error::Status`]; read data is passed to `out` before the slot is released.
    pub async fn execute<F, O, R>(&self, req: Request, fill: F, out: O) -> Result<(Cqe, R), Error>
    where
        F: FnOnce(&mut [u8]) -> Result<(), Error>,
        O: FnOnce(&[u8]) -> R,
    {
        let len = req.len as usize;
        let admin = self.shared.qid == 0;
        let name = command_name(admin, req.sqe.opcode, req.sqe.fctype());
        let mut p = self.start(req, fill).await?;
        let cqe = p.wait().await?;
        let status = cqe.status();
        if !status.is_success() {
            return Err(Error::status_of(name, status));
        }
        let r = p.with_data(len, out);
        Ok((cqe, r))
    }
}

/// A command handed to a queue. Await [`wait`](Self::wait); then read data with
/// [`with_data`](Self::with_data). Dropping it releases the slot (or, if the command is still
/// in flight, lets the queue task release it when the command ends).
pub(crate) struct Pending<'a> {
    shared: &'a QueueShared,
    tag: u16,
}

impl Pending<'_> {
    fn poll_complete(&mut self, cx: &mut Context<'_>) -> Poll<Result<Cqe, Error>> {
        let mut st = self.shared.slots[usize::from(self.tag)].lock();
        match st.phase {
            Phase::Done => Poll::Ready(st.result.take().unwrap_or(Err(Error::Closed))),
            _ => {
                if !st.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                    st.waker = Some(cx.waker().clone());
                }
                Poll::Pending
            }
        }
    }

    /// Waits for the completion entry (any status) or a transport error.
    pub async fn wait(&mut self) -> Result<Cqe, Error> {
        std::future::poll_fn(|cx| self.poll_complete(cx)).await
    }

    /// Gives the first `len` bytes of the slot's buffer (the read data) to `f`.
    pub fn with_data<R>(&self, len: usize, f: impl FnOnce(&[u8]) -> R) -> R {
        let st = self.shared.slots[usize::from(self.tag)].lock();
        let b = st.buf.as_slice();
        f(&b[..len.min(b.len())])
    }

    /// The buffer lent with [`QueueHandle::start_lent`], once the command has ended (`None`
    /// while it is in flight, or for a command without one).
    pub fn take_lent(&self) -> Option<Box<dyn LentBuffer>> {
        let mut st = self.shared.slots[usize::from(self.tag)].lock();
        if st.phase != Phase::Done || !matches!(st.buf, SlotBuf::Lent(_)) {
            return None;
        }
        let spare = std::mem::take(&mut st.spare);
        match std::mem::replace(&mut st.buf, spare) {
            SlotBuf::Lent(l) => Some(l),
            _ => None,
        }
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        let mut st = self.shared.slots[usize::from(self.tag)].lock();
        match st.phase {
            Phase::Done => {
                st.phase = Phase::Free;
                st.waker = None;
                st.result = None;
                drop(st);
                self.shared.release(self.tag);
            }
            Phase::Waiting => {
                st.phase = Phase::Abandoned;
                st.waker = None;
            }
            Phase::Free | Phase::Abandoned => {}
        }
    }
}

/// A queue task: the core, its link and the channels that drive them.
struct Task {
    live: Option<Link>,
    core: Core<Arc<QueueShared>>,
    shared: Arc<QueueShared>,
    sub_rx: mpsc::UnboundedReceiver<Submission>,
    ctl_rx: mpsc::UnboundedReceiver<QueueCtl>,
    report: mpsc::UnboundedSender<SupMsg>,
    generation: u64,
    scan_period: Duration,
    batch: Vec<Submission>,
    /// Whether to busy-poll rather than sleep (the window after activity, while traffic is
    /// dense enough to pay for it).
    poll: PollGate,
    /// GPU request rings served by this queue.
    rings: RingTable,
    /// Scratch: ring reads that ended.
    ring_done: Vec<RingDone>,
    /// Free tags lent to the rings.
    ring_tags: RingTags,
}

/// The queue's free tags as the ring table takes them.
struct RingTags {
    shared: Arc<QueueShared>,
    tags: Vec<u16>,
}

impl TagSource for RingTags {
    fn take(&mut self, max: usize) -> &[u16] {
        self.tags.clear();
        self.shared.take_tags(max, &mut self.tags);
        &self.tags
    }

    fn give_back(&mut self, used: usize) {
        self.shared
            .release_many(&self.tags[used.min(self.tags.len())..]);
        self.tags.clear();
    }
}

enum Wake {
    Ctl(Option<QueueCtl>),
    Submit(usize),
    Ready(LinkWake),
    Tick,
    /// Inside the busy-poll window: check the connection without waiting.
    Poll,
    /// Time to check the GPU request rings.
    RingCheck,
}

impl Task {
    async fn run(mut self) {
        let mut tick = tokio::time::interval(self.scan_period);
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut next_scan = Instant::now() + self.scan_period;
        loop {
            self.core.now = Instant::now();
            if self.core.now >= next_scan {
                next_scan = self.core.now + self.scan_period;
                let had_link = self.live.is_some();
                if let Some(err) = link::expire(&mut self.live, &mut self.core) {
                    if had_link {
                        self.report_loss(err);
                    }
                }
            }
            if let Some(live) = self.live.as_mut() {
                if let Err(e) = live.try_flush() {
                    let err = Error::lost(self.core.addr(), format!("send failed: {e}"));
                    self.lose(err);
                    continue;
                }
            }
            let ring_wait = self.rings.wait(self.core.now);
            let polling = (self.live.is_some() && self.poll.polling(self.core.now.into_std()))
                || ring_wait == RingWait::Poll;
            let ring_at = match ring_wait {
                RingWait::At(at) => Some(at),
                RingWait::Nothing | RingWait::Poll => None,
            };
            let wake = {
                let live = self.live.as_ref();
                tokio::select! {
                    biased;
                    c = self.ctl_rx.recv() => Wake::Ctl(c),
                    n = self.sub_rx.recv_many(&mut self.batch, SUBMIT_BATCH) => Wake::Submit(n),
                    r = async {
                        match live {
                            Some(l) => l.ready().await,
                            None => std::future::pending().await,
                        }
                    }, if live.is_some() => Wake::Ready(r),
                    _ = tick.tick() => Wake::Tick,
                    _ = tokio::task::yield_now(), if polling => Wake::Poll,
                    _ = async {
                        if let Some(at) = ring_at {
                            tokio::time::sleep_until(at).await;
                        }
                    }, if ring_at.is_some() => Wake::RingCheck,
                }
            };
            self.core.now = Instant::now();
            match wake {
                Wake::Ctl(None) | Wake::Ctl(Some(QueueCtl::Close)) => {
                    self.shutdown(Error::Closed);
                    return;
                }
                Wake::Ctl(Some(msg)) => self.control(msg),
                Wake::Submit(0) => {
                    // Every handle is gone.
                    self.shutdown(Error::Closed);
                    return;
                }
                Wake::Submit(_) => {
                    self.poll.submitted(self.core.now.into_std());
                    let mut batch = std::mem::take(&mut self.batch);
                    let mut res = Ok(());
                    for s in batch.drain(..) {
                        submit_to(
                            &mut self.core,
                            self.live.as_mut(),
                            &mut res,
                            (s.tag, s.req, s.buf, s.direct, None),
                        );
                    }
                    self.batch = batch;
                    if let Err(e) = res {
                        self.lose(e);
                    }
                }
                Wake::Ready(wake) => {
                    let err = (self.live.as_ref())
                        .and_then(|live| live.wake_error(self.core.addr(), wake));
                    match err {
                        Some(err) => self.lose(err),
                        None => self.poll_link(),
                    }
                }
                Wake::Poll => self.poll_link(),
                Wake::Tick | Wake::RingCheck => {}
            }
            self.serve_rings();
        }
    }

    /// Writes the completion words of the ring reads that ended (freeing their tags), lets
    /// detached rings go, and starts what the rings ask for.
    fn serve_rings(&mut self) {
        self.finish_ring_reads();
        if self.rings.is_empty() {
            return;
        }
        let now = Instant::now();
        let failed = self.core.failed().cloned();
        let mut res = Ok(());
        let mut started = 0u64;
        let core = &mut self.core;
        let mut live = self.live.as_mut();
        let taken = self.rings.poll(
            now,
            failed.as_ref(),
            &mut self.ring_tags,
            &mut |tag, req, data, direct, origin| {
                started += 1;
                submit_to(
                    core,
                    live.as_deref_mut(),
                    &mut res,
                    (tag, req, SlotBuf::Ring(data), direct, Some(origin)),
                );
            },
        );
        let c = &self.shared.counters;
        bump(&c.ring_reads, started);
        bump(&c.ring_rejected, taken as u64 - started);
        if started > 0 {
            self.poll.submitted(now.into_std());
        }
        if let Err(e) = res {
            self.lose(e);
        }
        // Commands refused by the link at once (or failed by a failed queue) ended already.
        self.finish_ring_reads();
    }

    /// Writes the completion words of the ring reads that ended and frees their tags.
    fn finish_ring_reads(&mut self) {
        self.core.take_ring_done(&mut self.ring_done);
        if self.ring_done.is_empty() {
            return;
        }
        let tags = &mut self.ring_tags.tags;
        tags.clear();
        self.rings.complete_all(&self.ring_done);
        tags.extend(self.ring_done.iter().map(|d| d.tag));
        self.rings.push_pending();
        self.shared.release_many(tags);
        tags.clear();
        self.rings.completed(Instant::now());
        self.rings.reap();
    }

    /// Takes what the link has and handles it.
    fn poll_link(&mut self) {
        let got = match self.live.as_mut() {
            Some(live) => live.receive(&mut self.core),
            None => Ok(false),
        };
        match got {
            Ok(true) => self.poll.arrived(self.core.now.into_std()),
            Ok(false) => {}
            Err(e) => self.lose(e),
        }
    }

    fn control(&mut self, msg: QueueCtl) {
        match msg {
            QueueCtl::Attach(live, generation) => {
                if self.core.failed().is_some() {
                    return;
                }
                if self.live.take().is_some() {
                    let reason = Error::lost(self.core.addr(), "connection replaced");
                    self.core.link_lost(&reason);
                }
                let mut live = *live;
                self.generation = generation;
                bump(&self.shared.counters.connections, 1);
                let res = self
                    .core
                    .link_restored(&mut live)
                    .and_then(|()| live.process(&mut self.core));
                self.live = Some(live);
                if let Err(e) = res {
                    self.lose(e);
                }
            }
            QueueCtl::Detach => {
                if self.live.take().is_some() {
                    let reason = Error::lost(self.core.addr(), "controller reset");
                    self.core.link_lost(&reason);
                }
            }
            QueueCtl::Fail(err) => {
                self.live = None;
                *self.shared.closed_error.lock() = Some(err.clone());
                self.shared.permits.close();
                self.core.fail(err);
            }
            QueueCtl::Close => self.shutdown(Error::Closed),
            QueueCtl::AttachRings(grant) => self.rings.attach(grant),
            QueueCtl::DetachRings { id, done } => self.rings.detach(id, done),
        }
    }

    /// Drops the connection after an error and tells the supervisor.
    fn lose(&mut self, err: Error) {
        let Some(mut live) = self.live.take() else {
            return;
        };
        // A protocol error leaves a TermReq to send; give it one try.
        let _ = live.try_flush();
        drop(live);
        self.report_loss(err);
    }

    /// After the connection was dropped: keeps or fails its commands and tells the supervisor.
    fn report_loss(&mut self, err: Error) {
        self.core.link_lost(&err);
        let _ = self.report.send(SupMsg::QueueFailed {
            qid: self.shared.qid,
            generation: self.generation,
            error: err,
        });
    }

    fn shutdown(&mut self, err: Error) {
        self.live = None;
        {
            let mut ce = self.shared.closed_error.lock();
            if ce.is_none() {
                *ce = Some(err.clone());
            }
        }
        self.shared.permits.close();
        self.sub_rx.close();
        while let Ok(s) = self.sub_rx.try_recv() {
            self.shared.finish_slot(s.tag, Err(err.clone()), s.buf);
        }
        if self.core.failed().is_none() {
            self.core.fail(err);
        } else {
            self.core.fail_all(&err);
        }
        self.finish_ring_reads();
    }
}

/// Hands a command to the core: on `link` while `res` is fine, after the link broke (`res`
/// holds why) to the waiting list, for the next link.
fn submit_to(
    core: &mut Core<Arc<QueueShared>>,
    link: Option<&mut Link>,
    res: &mut Result<(), Error>,
    cmd: (u16, Request, SlotBuf, Option<Direct>, Option<RingSlot>),
) {
    let (tag, req, buf, direct, origin) = cmd;
    let link = if res.is_ok() { link } else { None };
    let r = core.submit(link, tag, req, buf, direct, origin);
    if res.is_ok() {
        *res = r;
    }
}

impl Drop for Task {
    fn drop(&mut self) {
        // However the task ends (even when its runtime shuts down), no caller is left waiting.
        self.shutdown(Error::Closed);
    }
}
