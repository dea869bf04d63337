//! Queues: a queue's core ([`crate::queue_core`]: the command table, deadlines, retries,
//! reconnect hand-over) and its link ([`crate::link`]: the NVMe/TCP socket and engine, or the
//! NVMe/RDMA queue pair) sit together in one [`Engine`], driven by whoever holds it: the
//! callers of the queue themselves, or the queue's task.
//!
//! How a command leaves and returns over NVMe/TCP (the callers drive):
//! 1. A caller takes a command slot (a tag, which is also the command identifier on the wire)
//!    and fills the slot's staging buffer, or lends its own buffer for the read data.
//! 2. It hands the command to the core itself ([`QueueHandle::start`]): the capsule joins the
//!    link's send buffer. No channel, no task wake-up. A command on an idle queue is written
//!    at once; otherwise the first caller to wait after it yields once so that every caller
//!    of the same round adds its capsule, then writes them all with one `write`.
//! 3. A waiting caller ([`Pending::wait`]) drives the queue: it writes what waits to be sent,
//!    reads what the socket has (the core stores each completion in its slot and wakes that
//!    one caller), and when the socket is empty registers one waiting caller, the *leader*,
//!    to be woken when it has more. A caller that reads its own completion is not woken for
//!    it (it looks at its slot once it has read); if no other command is in flight then, it
//!    returns at once, and the socket is read again by the next caller to wait (or by the
//!    queue's task on its timer). Commands of one thread go to one queue
//!    ([`crate::QueuePolicy::PerThread`]), so this is the thread's own socket and the locks
//!    on the way are taken without contention. A caller that finds the engine held by
//!    another thread (tasks of several threads pinned to one queue) leaves the driving to the
//!    holder, except the two parts nobody else does: the caller that is to write its round's
//!    capsules, and the leader, come back once the runtime had its turn. Within the busy-poll
//!    window a caller whose command is alone on its queue (a caller waiting for one answer at
//!    a time) reads the socket in a loop from its second look on ([`Engine::spin`]).
//!
//! The queue's task drives the rest: control messages from the supervisor (attach a new
//! connection, detach, fail, close), the deadline timer, GPU request rings
//! ([`crate::ring_proxy`]), commands handed over while another thread held the engine
//! (through a channel), and the socket when no caller waits on it. Over NVMe/RDMA the task
//! drives alone: it waits on the completion channel, and callers hand every command over
//! through the channel.
//!
//! Tags come from a free list and buffers stay with their slot, so steady-state I/O does not
//! allocate. An I/O queue has twice as many slots as its entries hold commands: commands
//! beyond the entries wait in the core, in order, and each response sends the next one
//! (SPDK's queued requests), so a caller keeping more commands in flight than the queue
//! holds (QD128 on a 128-entry queue) costs no extra wake-up per command. A caller that
//! finds every slot taken waits in line ([`crate::tags`]): a tag given back goes straight to
//! the oldest waiting caller, which is woken once, with it. Every
//! command has a deadline (except Asynchronous Event Requests), checked by the task on a
//! timer: a target that stops answering gives a timeout error, never a hang.
//!
//! When the link is lost the core keeps reads (and everything idempotent) to resend on the
//! next link and fails writes with [`Error::Interrupted`] (unless writes may be retried);
//! whoever saw the loss reports it to the controller's supervisor, which reconnects and hands
//! a new link over.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use busy_poll::{Alone, OneInFlight, PollGate, SPIN_CLOCK_EVERY, SPIN_MAX};
use nvme_spec::Cqe;
use parking_lot::Mutex;
use tokio::sync::{Notify, mpsc, oneshot};
use tokio::time::{Instant, MissedTickBehavior};

use crate::Error;
use crate::buffer::{Lent, SlotBuf};
use crate::error::command_name;
use crate::link::{self, Link, LinkWake};
use crate::queue_core::{Completions, Core, QueueCounters, RingDone, RingSlot, bump};
pub(crate) use crate::queue_core::{DataDir, Request, Retry};
use crate::registered::Direct;
use crate::ring_serve::{RingGrant, RingTable, RingWait, TagSource};
use crate::tags::TagPool;

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
    Lent(Lent),
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
    /// NVMe/TCP reads whose data its caller copied straight out of the connection's receive
    /// buffer (reads into a caller's slice, one data PDU each, not lent): one copy, where
    /// copying it into the command's buffer first would make two.
    pub kept_reads: u64,
    /// NVMe/TCP reads the controller completed with their last data PDU (its SUCCESS flag,
    /// sent only with SQ flow control off): no response capsule came for them.
    pub data_completions: u64,
    /// Reads started from GPU request rings (see `Controller::attach_gpu_rings`).
    pub ring_reads: u64,
    /// Requests taken from GPU request rings and completed at once with an error status
    /// (invalid, or the queue had failed).
    pub ring_rejected: u64,
}

/// Rounds of write-read-register one drive makes before it leaves the rest for a wake-up.
const DRIVE_ROUNDS: usize = 4;

/// Callers that submit while other commands are in flight leave their capsules for the next
/// drive's single write, except that every this many the submitting caller writes them: a
/// target that works while our callers gather (SPDK's polls its sockets) gets work sooner.
/// Each write costs the caller a system call (over loopback, also the kernel's delivery to
/// the target's socket): 32 rather than 16 gave a client-bound queue 6-8% more reads with no
/// change against `nvmf_tgt` (BENCHMARKS.md).
const FLUSH_AFTER: usize = 32;

/// No command (in [`QueueShared::flush_by`] and [`QueueShared::hint`]).
const NO_TAG: u32 = u32::MAX;

/// [`QueueShared::driving`] once the driving caller's command has ended.
const DRIVER_DONE: u32 = u32::MAX - 1;

/// State shared by a queue's engine, its task and its callers.
pub(crate) struct QueueShared {
    qid: u16,
    slots: Box<[Mutex<SlotState>]>,
    /// Commands the current link takes on the wire at once ([`QueueHandle::window`]).
    window: AtomicUsize,
    tags: TagPool,
    counters: QueueCounters,
    closed_error: Mutex<Option<Error>>,
    /// The command whose caller writes the send buffer when next polled (see
    /// [`Pending::wait`]), or [`NO_TAG`]. Changed with the engine held.
    flush_by: std::sync::atomic::AtomicU32,
    /// A command whose caller waited recently: the next leader when the leader's ends.
    hint: std::sync::atomic::AtomicU32,
    /// The leader's command (see [`Engine::pick_leader`]), or [`NO_TAG`].
    leader: std::sync::atomic::AtomicU32,
    /// The command whose caller drives the engine now ([`Engine::drive`]), [`DRIVER_DONE`]
    /// once that command has ended, or [`NO_TAG`]: its completion is not woken, the caller
    /// looks at its slot right after.
    driving: std::sync::atomic::AtomicU32,
    /// Where the socket's readiness goes.
    links: Arc<LinkWaker>,
}

impl QueueShared {
    fn release(&self, tag: u16) {
        self.tags.give(tag);
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
                if self.driving.load(Ordering::Relaxed) == u32::from(tag) {
                    // Its caller is the one reading: no wake-up, it looks once it has read.
                    self.driving.store(DRIVER_DONE, Ordering::Relaxed);
                    return;
                }
                let waker = st.waker.take();
                drop(st);
                if let Some(w) = waker {
                    w.wake();
                }
            }
            Phase::Abandoned => {
                st.phase = Phase::Free;
                st.waker = None;
                st.buf.unkeep();
                drop(st);
                self.release(tag);
            }
            Phase::Free | Phase::Done => {}
        }
    }

    /// Whether command `tag` waits for its completion and its caller has polled.
    fn waits(&self, tag: u16) -> bool {
        let Some(slot) = self.slots.get(usize::from(tag)) else {
            return false;
        };
        let st = slot.lock();
        st.phase == Phase::Waiting && st.waker.is_some()
    }

    /// Makes the caller of command `tag` the one the socket wakes, if the command waits and
    /// its caller has polled. The slot's lock orders this with [`Pending::check`] replacing
    /// the caller's waker.
    fn lead(&self, tag: u16) -> bool {
        let Some(slot) = self.slots.get(usize::from(tag)) else {
            return false;
        };
        let st = slot.lock();
        let waker = match (&st.phase, &st.waker) {
            (Phase::Waiting, Some(w)) => w.clone(),
            _ => return false,
        };
        self.leader.store(u32::from(tag), Ordering::Relaxed);
        *self.links.leader.lock() = Some(waker);
        true
    }

    /// Leaves the socket's readiness to the queue's task: no caller leads.
    fn unlead(&self) {
        self.leader.store(NO_TAG, Ordering::Relaxed);
        *self.links.leader.lock() = None;
    }

    /// Whether the driving caller's command ended while it drove.
    fn driver_done(&self) -> bool {
        self.driving.load(Ordering::Relaxed) == DRIVER_DONE
    }

    /// Command slots taken.
    fn busy(&self) -> usize {
        self.tags.in_use()
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
            kept_reads: g(&c.kept_reads),
            data_completions: g(&c.data_completions),
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

    fn keeps_read_data(&self) -> bool {
        // Callers copy read data out of their slot (`Pending::with_data`): from where it was
        // received, that is one copy instead of two.
        true
    }
}

/// Where the socket's readiness goes: to the leader (a waiting caller), or to the queue's
/// task when no caller waits. Registered with the socket as its waker.
struct LinkWaker {
    leader: Mutex<Option<Waker>>,
    task: Notify,
}

impl std::task::Wake for LinkWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        // The leader stays until another is picked: the socket may wake it more than once.
        let leader = self.leader.lock().clone();
        match leader {
            Some(w) => w.wake(),
            None => self.task.notify_one(),
        }
    }
}

thread_local! {
    /// Which queue alone received data on this thread lately ([`Engine::spin`]).
    static ALONE: std::cell::Cell<Alone> = const {
        std::cell::Cell::new(Alone::new())
    };
}

/// A queue's core and link, and who drives them (see the module documentation).
pub(crate) struct Engine {
    core: Core<Arc<QueueShared>>,
    live: Option<Link>,
    /// The association `live` belongs to (reported with its loss).
    generation: u64,
    report: mpsc::UnboundedSender<SupMsg>,
    shared: Arc<QueueShared>,
    /// Callers drive the link (NVMe/TCP); otherwise only the task does (NVMe/RDMA).
    callers_drive: bool,
    /// The command submitted last (the likeliest to wait longest).
    newest: Option<u16>,
    /// Whether whoever drives busy-polls rather than sleeps (the window after activity,
    /// while traffic is dense enough to pay for it): a waiting caller that drove comes back
    /// at once instead of waiting for the socket, the task yields instead of sleeping.
    poll: PollGate,
    /// [`QueueShared::links`] as a waker.
    link_waker: Waker,
    /// Commands submitted since the last write ([`FLUSH_AFTER`]).
    unflushed: usize,
    /// Whether this queue's callers wait for one answer at a time ([`spin`](Self::spin)).
    one: OneInFlight,
}

impl Engine {
    /// Hands a command to the core: sent at once when the link is up and nothing waits before
    /// it, kept for the next link otherwise.
    fn submit(&mut self, cmd: (u16, Request, SlotBuf, Option<Direct>, Option<RingSlot>)) {
        let (tag, req, buf, direct, origin) = cmd;
        self.newest = Some(tag);
        let now = self.core.now.into_std();
        self.poll.submitted(now);
        self.one.submitted(self.shared.busy(), now);
        let sent = (self.core).submit(self.live.as_mut(), tag, req, buf, direct, origin);
        if let Err(e) = sent {
            self.lose(e);
        }
    }

    /// Writes what waits to be sent, as far as the socket takes it.
    fn flush(&mut self) {
        self.unflushed = 0;
        self.shared.flush_by.store(NO_TAG, Ordering::Relaxed);
        let Some(live) = self.live.as_mut() else {
            return;
        };
        if let Err(e) = live.try_flush() {
            let err = Error::lost(self.core.addr(), format!("send failed: {e}"));
            self.lose(err);
        }
    }

    /// Takes what the link has and hands it to the core. Returns whether anything arrived.
    fn receive(&mut self) -> bool {
        let got = match self.live.as_mut() {
            Some(live) => live.receive(&mut self.core, link::RECEIVE_ALL),
            None => Ok(false),
        };
        got.unwrap_or_else(|e| {
            self.lose(e);
            false
        })
    }

    /// Drives a link that callers drive: writes, reads until the socket has nothing more,
    /// picks the leader (`me` when its command still waits) and registers for the socket's
    /// next readiness.
    fn drive(&mut self, me: Option<u16>) {
        self.core.now = Instant::now();
        let driving = me.map_or(NO_TAG, u32::from);
        self.shared.driving.store(driving, Ordering::Relaxed);
        self.drive_rounds(me);
        self.shared.driving.store(NO_TAG, Ordering::Relaxed);
    }

    /// [`drive`](Self::drive)'s rounds of write, read, pick and register.
    fn drive_rounds(&mut self, me: Option<u16>) {
        for _ in 0..DRIVE_ROUNDS {
            self.flush();
            if self.receive() {
                self.arrived();
            }
            if self.core.has_ring_done() {
                // Ring reads ended: their completion words are the task's to write.
                self.shared.links.task.notify_one();
            }
            if self.shared.driver_done() && self.shared.busy() <= 1 {
                // This caller's command ended and no other command is in flight: its answer
                // goes back now, and nobody waits to lead. The socket is read again (and
                // registered) by the next caller to wait, or by the task on its timer.
                self.shared.unlead();
                return;
            }
            self.pick_leader(me);
            let mut cx = Context::from_waker(&self.link_waker);
            match self.live.as_ref() {
                Some(live) if live.poll_ready(&mut cx) => {}
                _ => return,
            }
        }
        // Still more after several rounds: whoever leads comes back for it.
        self.link_waker.wake_by_ref();
    }

    /// Notes data received at `core.now`: for the poll gate, and for whether this queue is
    /// the only one of its thread receiving ([`spin`](Self::spin)).
    fn arrived(&mut self) {
        let now = self.core.now.into_std();
        self.poll.arrived(now);
        let hold = self.spin_hold();
        let party = self.party();
        ALONE.with(|a| {
            let mut alone = a.get();
            alone.arrived(party, now, hold);
            a.set(alone);
        });
    }

    /// How long another queue's data on this thread, or a second command in flight on this
    /// queue, keeps [`spin`](Self::spin) from looping: four windows.
    fn spin_hold(&self) -> Duration {
        self.poll.window() * 4
    }

    /// This queue among the parties of [`ALONE`].
    fn party(&self) -> u64 {
        Arc::as_ptr(&self.shared) as usize as u64
    }

    /// Inside the busy-poll window, when the command of `me` is the only one in flight, no
    /// command was submitted beside another one within the hold (the caller waits for one
    /// answer at a time, [`OneInFlight`]) and this queue is the only one of its thread that
    /// received data lately: reads the link in a loop, without going back to the runtime,
    /// until that command ends (or [`SPIN_MAX`], or the window, passes). The answer is then
    /// taken the moment it arrives, with no turn of the runtime in between; nobody else waits
    /// on this queue, and nothing else on this thread received anything lately. A busy queue
    /// drained to one command for a moment does not loop: its caller's other work (the copies
    /// to the GPU of the reads that ended, the next submissions) would wait behind the loop.
    /// Plain NVMe/TCP only ([`Link::reads_now`]).
    fn spin(&mut self, me: u16) {
        if self.shared.busy() > 1 || !self.live.as_ref().is_some_and(Link::reads_now) {
            return;
        }
        let now = self.core.now.into_std();
        if !self.one.alone(now, self.spin_hold()) {
            return;
        }
        let party = self.party();
        if !ALONE.with(|a| a.get().alone(party, now))
            || self.shared.slots[usize::from(me)].lock().phase != Phase::Waiting
        {
            return;
        }
        let until = now + self.poll.remaining(now).min(SPIN_MAX);
        self.shared.driving.store(u32::from(me), Ordering::Relaxed);
        let mut turns = 0u32;
        while let Some(live) = self.live.as_mut() {
            match live.receive_now(&mut self.core, link::RECEIVE_ALL) {
                Ok(true) => {
                    self.core.now = Instant::now();
                    self.arrived();
                    if self.shared.driver_done() {
                        if self.shared.busy() <= 1 {
                            self.shared.unlead();
                        }
                        break;
                    }
                }
                Ok(false) => {
                    turns += 1;
                    if turns % SPIN_CLOCK_EVERY == 0 && std::time::Instant::now() >= until {
                        break;
                    }
                }
                Err(e) => {
                    self.lose(e);
                    break;
                }
            }
        }
        self.shared.driving.store(NO_TAG, Ordering::Relaxed);
    }

    /// Keeps the leader while its command waits; otherwise makes the caller of `me`, else
    /// one that waited recently, else that of the newest command the one the socket wakes.
    /// When none of them waits (the queue's commands ended, or nearly all), the socket wakes
    /// the task, which drives for whoever still waits and picks again.
    fn pick_leader(&mut self, me: Option<u16>) {
        let shared = &self.shared;
        let leader = u16::try_from(shared.leader.load(Ordering::Relaxed)).ok();
        if leader.is_some_and(|t| shared.waits(t)) {
            return;
        }
        let hint = u16::try_from(shared.hint.load(Ordering::Relaxed)).ok();
        let pick = [me, hint, self.newest]
            .into_iter()
            .flatten()
            .find(|&t| shared.lead(t));
        if pick.is_none() {
            shared.unlead();
        }
    }

    /// Event: the timer. Fails the commands past their deadline (see [`link::expire`]).
    fn expire(&mut self) {
        let had_link = self.live.is_some();
        if let Some(err) = link::expire(&mut self.live, &mut self.core) {
            if had_link {
                self.report_loss(err);
            }
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
}

/// The caller side of a queue.
pub(crate) struct QueueHandle {
    shared: Arc<QueueShared>,
    engine: Arc<Mutex<Engine>>,
    sub_tx: mpsc::UnboundedSender<Submission>,
    ctl_tx: mpsc::UnboundedSender<QueueCtl>,
}

/// Settings of a queue task.
pub(crate) struct QueueConfig {
    pub qid: u16,
    /// Command slots (commands taken at once at most; those beyond what the link's entries
    /// hold wait in the core).
    pub slots: u16,
    pub addr: String,
    pub retry_writes: bool,
    /// How often deadlines are checked.
    pub scan_period: Duration,
    /// Busy-poll window after activity, for a link the task drives (zero: never poll).
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
            tags: TagPool::new(n),
            counters: QueueCounters::default(),
            closed_error: Mutex::new(None),
            window: AtomicUsize::new(usize::from(n)),
            flush_by: NO_TAG.into(),
            hint: NO_TAG.into(),
            leader: NO_TAG.into(),
            driving: NO_TAG.into(),
            links: Arc::new(LinkWaker {
                leader: Mutex::new(None),
                task: Notify::new(),
            }),
        });
        let core = Core::new(
            Arc::clone(&shared),
            cfg.addr,
            n,
            cfg.retry_writes,
            cfg.qid == 0,
        );
        let engine = Arc::new(Mutex::new(Engine {
            core,
            live: None,
            generation: 0,
            report,
            shared: Arc::clone(&shared),
            callers_drive: true,
            newest: None,
            poll: PollGate::new(cfg.busy_poll),
            link_waker: Waker::from(Arc::clone(&shared.links)),
            unflushed: 0,
            one: OneInFlight::default(),
        }));
        let (sub_tx, sub_rx) = mpsc::unbounded_channel();
        let (ctl_tx, ctl_rx) = mpsc::unbounded_channel();
        let task = Task {
            engine: Arc::clone(&engine),
            shared: Arc::clone(&shared),
            sub_rx,
            ctl_rx,
            scan_period: cfg.scan_period,
            batch: Vec::with_capacity(SUBMIT_BATCH),
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
            engine,
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

    /// Commands the queue puts on the wire at once, at most (its current link's entries less
    /// one; its slots before the first link).
    pub fn window(&self) -> usize {
        self.shared.window.load(Ordering::Relaxed)
    }

    fn closed_error(&self) -> Error {
        self.shared
            .closed_error
            .lock()
            .clone()
            .unwrap_or(Error::Closed)
    }

    /// Takes a slot, fills its buffer with `fill` for host-to-controller data, and hands the
    /// command to the queue: at once when a slot is free (before the returned future is
    /// polled), otherwise once the future has waited for one.
    pub fn start<F>(
        &self,
        req: Request,
        fill: F,
    ) -> impl Future<Output = Result<Pending<'_>, Error>>
    where
        F: FnOnce(&mut [u8]) -> Result<(), Error>,
    {
        self.start_with(req, fill, None)
    }

    /// Takes a slot and hands over a command whose data the target moves straight to or from
    /// caller-registered memory (NVMe/RDMA). The command holds the memory until it ends (or
    /// until its queue pair is destroyed), whatever happens to the returned [`Pending`].
    pub fn start_direct(
        &self,
        req: Request,
        direct: Direct,
    ) -> impl Future<Output = Result<Pending<'_>, Error>> {
        self.start_with(req, |_| Ok(()), Some(Data::Direct(direct)))
    }

    /// Takes a slot and hands over a read whose data is received into `lent` (at least
    /// `req.len` bytes) instead of the slot's buffer; [`Pending::take_lent`] gives it back.
    /// A lent buffer of a command that is abandoned is dropped when the slot is next used.
    pub fn start_lent(
        &self,
        req: Request,
        lent: Lent,
    ) -> impl Future<Output = Result<Pending<'_>, Error>> {
        self.start_with(req, |_| Ok(()), Some(Data::Lent(lent)))
    }

    /// Hands a read over when a slot is free now (`None` when none is, and `lend` is not
    /// called): its data is received into the buffer `lend` gives, or into the slot's buffer
    /// when it gives none. A caller with commands of its own in flight starts the next one
    /// this way, so it never waits for a slot while holding slots it has yet to look at.
    pub(crate) fn try_start_read(
        &self,
        req: Request,
        lend: impl FnOnce() -> Result<Option<Lent>, Error>,
    ) -> Option<Result<Pending<'_>, Error>> {
        let tag = self.shared.tags.try_take()?;
        Some(match lend() {
            Ok(lent) => self.start_tagged(tag, req, |_| Ok(()), lent.map(Data::Lent)),
            Err(e) => {
                self.shared.release(tag);
                Err(e)
            }
        })
    }

    /// [`try_start_read`](Self::try_start_read), waiting for a slot when none is free (the
    /// lent buffer waits with the command).
    pub(crate) async fn start_read(
        &self,
        req: Request,
        lend: impl FnOnce() -> Result<Option<Lent>, Error>,
    ) -> Result<Pending<'_>, Error> {
        let lent = lend()?;
        self.start_with(req, |_| Ok(()), lent.map(Data::Lent)).await
    }

    /// Hands the command over at once when a slot is free (the returned future is then
    /// ready); otherwise the future waits for a slot and hands it over then. The wait is
    /// boxed: it is rare (a queue has twice as many slots as its link takes commands), and
    /// the future every command awaits stays a few words long instead of carrying the
    /// request, the data and the wait (the caller's own future, which holds it, is moved
    /// into place by copying on every command).
    fn start_with<F>(
        &self,
        req: Request,
        fill: F,
        data: Option<Data>,
    ) -> Start<'_, impl Future<Output = Result<Pending<'_>, Error>>>
    where
        F: FnOnce(&mut [u8]) -> Result<(), Error>,
    {
        match self.shared.tags.try_take() {
            Some(tag) => Start::Now(Some(self.start_tagged(tag, req, fill, data))),
            None => Start::Later(Box::pin(async move {
                let tag = (self.shared.tags.take().await).ok_or_else(|| self.closed_error())?;
                self.start_tagged(tag, req, fill, data)
            })),
        }
    }

    /// [`start_with`](Self::start_with) once slot `tag` is taken.
    fn start_tagged<F>(
        &self,
        tag: u16,
        req: Request,
        fill: F,
        data: Option<Data>,
    ) -> Result<Pending<'_>, Error>
    where
        F: FnOnce(&mut [u8]) -> Result<(), Error>,
    {
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
        // From here on, returning drops the command's `Pending`, which frees the slot.
        let pending = Pending {
            q: self,
            tag,
            released: false,
            looked: false,
            lent: None,
        };
        if direct.is_none() {
            if let Err(e) = buf.ensure(len) {
                self.shared.finish_slot(tag, Err(e.clone()), buf);
                return Err(e);
            }
        }
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
        let Some(sub) = self.submit_here(sub) else {
            return Ok(pending);
        };
        if let Err(mpsc::error::SendError(s)) = self.sub_tx.send(sub) {
            let e = self.closed_error();
            self.shared.finish_slot(tag, Err(e.clone()), s.buf);
            return Err(e);
        }
        Ok(pending)
    }

    /// Hands a command to the core directly when callers drive the link and nobody holds the
    /// engine; gives it back otherwise (for the channel to the task). On an idle queue the
    /// capsule is written at once; on a busy one it waits for the round's write.
    fn submit_here(&self, sub: Submission) -> Option<Submission> {
        let Some(mut e) = self.engine.try_lock() else {
            return Some(sub);
        };
        if !e.callers_drive {
            return Some(sub);
        }
        if e.unflushed == 0 {
            // The first command since the last write reads the clock (for deadlines and the
            // poll gate); the others of its round, submitted before the round is written
            // (by their callers' next polls), use the same reading.
            e.core.now = Instant::now();
        }
        e.submit((sub.tag, sub.req, sub.buf, sub.direct, None));
        e.unflushed += 1;
        if self.shared.busy() <= 1 || e.unflushed >= FLUSH_AFTER {
            e.flush();
        }
        None
    }

    /// Runs one command to completion. A completion with an error status is an
    /// [`Error::Status`]; read data is passed to `out` before the slot is released. Like
    /// [`start`](Self::start), hands the command over at the call when a slot is free.
    pub fn execute<F, O, R>(
        &self,
        req: Request,
        fill: F,
        out: O,
    ) -> impl Future<Output = Result<(Cqe, R), Error>>
    where
        F: FnOnce(&mut [u8]) -> Result<(), Error>,
        O: FnOnce(&[u8]) -> R,
    {
        let len = req.len as usize;
        let admin = self.shared.qid == 0;
        let name = command_name(admin, req.sqe.opcode, req.sqe.fctype());
        let start = self.start(req, fill);
        async move {
            let mut p = start.await?;
            let cqe = p.wait().await?;
            let status = cqe.status();
            if !status.is_success() {
                return Err(Error::status_of(name, status));
            }
            let r = p.with_data(len, out);
            Ok((cqe, r))
        }
    }
}

/// A command handed to a queue. Await [`wait`](Self::wait); then read data with
/// [`with_data`](Self::with_data). Dropping it releases the slot (or, if the command is still
/// in flight, lets the queue release it when the command ends).
pub(crate) struct Pending<'a> {
    q: &'a QueueHandle,
    tag: u16,
    /// The slot went back already ([`take_lent`](Self::take_lent)).
    released: bool,
    /// Its caller polled it before: the poll that submitted it went back to the runtime once,
    /// so that the caller's other commands (futures beside this one) were submitted too.
    looked: bool,
    /// The buffer lent with [`QueueHandle::start_lent`], taken (and the slot released) by the
    /// look that found the command ended, under the same lock.
    lent: Option<Lent>,
}

/// What [`QueueHandle::start`] and its siblings return: the command handed over already
/// (a slot was free when it was called), or the wait for a slot.
pub(crate) enum Start<'a, W> {
    /// Handed over (or refused) at the call: the result, until polled.
    Now(Option<Result<Pending<'a>, Error>>),
    /// Waiting for a slot.
    Later(Pin<Box<W>>),
}

impl<'a, W: Future<Output = Result<Pending<'a>, Error>>> Future for Start<'a, W> {
    type Output = Result<Pending<'a>, Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.get_mut() {
            // Polled again after it gave its result: nothing more comes.
            Start::Now(r) => Poll::Ready(r.take().unwrap_or(Err(Error::Closed))),
            Start::Later(w) => w.as_mut().poll(cx),
        }
    }
}

impl Pending<'_> {
    /// The result when the command has ended; registers the caller's waker otherwise. An
    /// ended command with a lent buffer gives it back here and releases its slot: nothing
    /// is left to read (see [`take_lent`](Self::take_lent)).
    fn check(&mut self, cx: &mut Context<'_>) -> Option<Result<Cqe, Error>> {
        let shared = &self.q.shared;
        let mut st = shared.slots[usize::from(self.tag)].lock();
        if st.phase == Phase::Done {
            let result = st.result.take().unwrap_or(Err(Error::Closed));
            if matches!(st.buf, SlotBuf::Lent(_)) {
                self.lent = self.give_back_lent(st);
            }
            return Some(result);
        }
        if !st.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            st.waker = Some(cx.waker().clone());
            if shared.leader.load(Ordering::Relaxed) == u32::from(self.tag) {
                // The leader moved to another task: the socket wakes that one now.
                *shared.links.leader.lock() = Some(cx.waker().clone());
            }
        }
        None
    }

    fn poll_complete(&mut self, cx: &mut Context<'_>) -> Poll<Result<Cqe, Error>> {
        if let Some(r) = self.check(cx) {
            if !self.released {
                self.ended();
            }
            return Poll::Ready(r);
        }
        let shared = &self.q.shared;
        let me = u32::from(self.tag);
        let flush_by = shared.flush_by.load(Ordering::Relaxed);
        if flush_by != NO_TAG && flush_by != me {
            // Another caller of this round writes its capsules and drives when next polled
            // (or when dropped): nothing for this one to do, and no lock to take for it.
            shared.hint.store(me, Ordering::Relaxed);
            return Poll::Pending;
        }
        let Some(mut e) = self.q.engine.try_lock() else {
            // Another thread holds the engine and may not do this caller's part: write the
            // round's capsules (which nobody else does), or read what woke the leader (the
            // socket wakes it once). Look again once the runtime had its turn.
            if shared.flush_by.load(Ordering::Relaxed) == me
                || shared.leader.load(Ordering::Relaxed) == me
            {
                cx.waker().wake_by_ref();
            }
            shared.hint.store(me, Ordering::Relaxed);
            return Poll::Pending;
        };
        if e.callers_drive {
            let flush_by = shared.flush_by.load(Ordering::Relaxed);
            let unsent = e.live.as_ref().is_some_and(Link::has_unsent);
            if unsent && flush_by == NO_TAG {
                // Let the other callers of this round add their capsules first: this
                // caller writes them all when polled again.
                shared.flush_by.store(me, Ordering::Relaxed);
                cx.waker().wake_by_ref();
            } else if !unsent || flush_by == me {
                e.drive(Some(self.tag));
                let spin = e.poll.polling(e.core.now.into_std());
                if spin && self.looked {
                    // Not on the first poll: a caller with more commands to submit (the
                    // futures beside this one) submits them first, and its queue is then
                    // no longer one command deep.
                    e.spin(self.tag);
                }
                self.looked = true;
                drop(e);
                if let Some(r) = self.check(cx) {
                    return Poll::Ready(r);
                }
                if spin {
                    // Inside the busy-poll window: look again as soon as the runtime has
                    // polled its sockets rather than sleep until the socket wakes the
                    // leader (a yield polled once: tokio wakes the task after its I/O
                    // driver ran, elsewhere at once).
                    let _ = std::pin::pin!(tokio::task::yield_now()).poll(cx);
                }
            }
        }
        shared.hint.store(me, Ordering::Relaxed);
        Poll::Pending
    }

    /// The command ended before its caller wrote the round's capsules (its link was lost, or
    /// the queue failed): write them now.
    fn ended(&self) {
        if self.q.shared.flush_by.load(Ordering::Relaxed) == u32::from(self.tag) {
            self.q.engine.lock().flush();
        }
    }

    /// Waits for the completion entry (any status) or a transport error. While it waits, the
    /// caller drives its queue (see the module documentation).
    pub async fn wait(&mut self) -> Result<Cqe, Error> {
        std::future::poll_fn(|cx| self.poll_complete(cx)).await
    }

    /// Gives the first `len` bytes of the slot's buffer (the read data) to `f`.
    pub fn with_data<R>(&self, len: usize, f: impl FnOnce(&[u8]) -> R) -> R {
        let st = self.q.shared.slots[usize::from(self.tag)].lock();
        let b = st.buf.as_slice();
        f(&b[..len.min(b.len())])
    }

    /// The buffer lent with [`QueueHandle::start_lent`], once the command has ended (`None`
    /// while it is in flight, or for a command without one). The slot is released with it
    /// (by the wait that saw the command end, or here, under the same lock): nothing is
    /// left to read.
    pub fn take_lent(&mut self) -> Option<Lent> {
        if self.released {
            // Given back by the wait already; the slot may be another command's now.
            return self.lent.take();
        }
        let st = self.q.shared.slots[usize::from(self.tag)].lock();
        if st.phase != Phase::Done || !matches!(st.buf, SlotBuf::Lent(_)) {
            return None;
        }
        self.give_back_lent(st)
    }

    /// Takes the lent buffer out of this command's ended slot `st` (locked) and releases
    /// the slot.
    fn give_back_lent(&mut self, mut st: parking_lot::MutexGuard<'_, SlotState>) -> Option<Lent> {
        let spare = std::mem::take(&mut st.spare);
        let lent = std::mem::replace(&mut st.buf, spare);
        st.phase = Phase::Free;
        st.waker = None;
        st.result = None;
        drop(st);
        // The round's capsules first: once released, the tag may name another command.
        self.ended();
        self.released = true;
        self.q.shared.release(self.tag);
        match lent {
            SlotBuf::Lent(l) => Some(l),
            _ => None,
        }
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        let shared = &self.q.shared;
        let mut st = shared.slots[usize::from(self.tag)].lock();
        match st.phase {
            Phase::Done => {
                st.phase = Phase::Free;
                st.waker = None;
                st.result = None;
                st.buf.unkeep();
                drop(st);
                shared.release(self.tag);
            }
            Phase::Waiting => {
                st.phase = Phase::Abandoned;
                st.waker = None;
                drop(st);
                // A caller that leads or writes the round's capsules hands its part on.
                let mut e = self.q.engine.lock();
                let writes = shared.flush_by.load(Ordering::Relaxed) == u32::from(self.tag);
                let leads = shared.leader.load(Ordering::Relaxed) == u32::from(self.tag);
                if e.callers_drive && (writes || leads) {
                    e.drive(None);
                }
            }
            Phase::Free | Phase::Abandoned => {}
        }
    }
}

/// A queue's task: control messages, the timer, the rings, commands handed over through the
/// channel, and the link when no caller drives it.
struct Task {
    engine: Arc<Mutex<Engine>>,
    shared: Arc<QueueShared>,
    sub_rx: mpsc::UnboundedReceiver<Submission>,
    ctl_rx: mpsc::UnboundedReceiver<QueueCtl>,
    scan_period: Duration,
    batch: Vec<Submission>,
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
        self.shared.tags.take_many(max, &mut self.tags);
        &self.tags
    }

    fn give_back(&mut self, used: usize) {
        (self.shared.tags).give_many(&self.tags[used.min(self.tags.len())..]);
        self.tags.clear();
    }
}

enum Wake {
    Ctl(Option<QueueCtl>),
    Submit(usize),
    /// The link the task waits on (NVMe/RDMA).
    Ready(LinkWake),
    /// The socket has something and no caller waits on it.
    Link,
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
        let engine = Arc::clone(&self.engine);
        loop {
            let now = Instant::now();
            let (waits_on, callers, poll_link) = {
                let mut e = engine.lock();
                e.core.now = now;
                if e.callers_drive {
                    // Also takes what arrived for callers that have not polled since (before
                    // any deadline is judged).
                    e.drive(None);
                }
                if now >= next_scan {
                    next_scan = now + self.scan_period;
                    e.expire();
                    e.pick_leader(None);
                }
                let poll_link = e.live.is_some() && e.poll.polling(now.into_std());
                if e.callers_drive {
                    (None, true, false)
                } else {
                    e.flush();
                    // The task waits on the link: it takes it meanwhile (callers hand their
                    // commands over through the channel).
                    (e.live.take(), false, poll_link)
                }
            };
            let ring_wait = self.rings.wait(now);
            let polling = poll_link || ring_wait == RingWait::Poll;
            let ring_at = match ring_wait {
                RingWait::At(at) => Some(at),
                RingWait::Nothing | RingWait::Poll => None,
            };
            let wake = {
                let live = waits_on.as_ref();
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
                    _ = self.shared.links.task.notified(), if callers => Wake::Link,
                    _ = tick.tick() => Wake::Tick,
                    _ = tokio::task::yield_now(), if polling => Wake::Poll,
                    _ = async {
                        if let Some(at) = ring_at {
                            tokio::time::sleep_until(at).await;
                        }
                    }, if ring_at.is_some() => Wake::RingCheck,
                }
            };
            let mut guard = engine.lock();
            let e = &mut *guard;
            if let Some(live) = waits_on {
                e.live = Some(live);
            }
            e.core.now = Instant::now();
            match wake {
                Wake::Ctl(None) | Wake::Ctl(Some(QueueCtl::Close)) | Wake::Submit(0) => {
                    // Closed, or every handle is gone.
                    drop(guard);
                    self.shutdown(Error::Closed);
                    return;
                }
                Wake::Ctl(Some(msg)) => self.control(e, msg),
                Wake::Submit(_) => {
                    for s in self.batch.drain(..) {
                        e.submit((s.tag, s.req, s.buf, s.direct, None));
                    }
                }
                Wake::Ready(wake) => {
                    let err =
                        (e.live.as_ref()).and_then(|live| live.wake_error(e.core.addr(), wake));
                    match err {
                        Some(err) => e.lose(err),
                        None => {
                            if e.receive() {
                                e.poll.arrived(e.core.now.into_std());
                            }
                        }
                    }
                }
                Wake::Poll => {
                    if e.receive() {
                        e.poll.arrived(e.core.now.into_std());
                    }
                }
                Wake::Link | Wake::Tick | Wake::RingCheck => {}
            }
            self.serve_rings(e);
        }
    }

    /// Writes the completion words of the ring reads that ended (freeing their tags), lets
    /// detached rings go, and starts what the rings ask for.
    fn serve_rings(&mut self, e: &mut Engine) {
        self.finish_ring_reads(e);
        if self.rings.is_empty() {
            return;
        }
        let now = Instant::now();
        let failed = e.core.failed().cloned();
        let mut started = 0u64;
        let taken = self.rings.poll(
            now,
            failed.as_ref(),
            &mut self.ring_tags,
            &mut |tag, req, data, direct, origin| {
                started += 1;
                e.submit((tag, req, SlotBuf::Ring(data), direct, Some(origin)));
            },
        );
        let c = &self.shared.counters;
        bump(&c.ring_reads, started);
        bump(&c.ring_rejected, taken as u64 - started);
        // Commands refused by the link at once (or failed by a failed queue) ended already.
        self.finish_ring_reads(e);
    }

    /// Writes the completion words of the ring reads that ended and frees their tags.
    fn finish_ring_reads(&mut self, e: &mut Engine) {
        e.core.take_ring_done(&mut self.ring_done);
        if self.ring_done.is_empty() {
            return;
        }
        let tags = &mut self.ring_tags.tags;
        tags.clear();
        self.rings.complete_all(&self.ring_done);
        tags.extend(self.ring_done.iter().map(|d| d.tag));
        self.rings.push_pending();
        self.shared.tags.give_many(tags);
        tags.clear();
        self.rings.completed(Instant::now());
        self.rings.reap();
    }

    fn control(&mut self, e: &mut Engine, msg: QueueCtl) {
        match msg {
            QueueCtl::Attach(live, generation) => {
                if e.core.failed().is_some() {
                    return;
                }
                if e.live.take().is_some() {
                    let reason = Error::lost(e.core.addr(), "connection replaced");
                    e.core.link_lost(&reason);
                }
                let mut live = *live;
                e.core.set_window(live.entries().saturating_sub(1));
                let window = usize::from(e.core.window());
                self.shared.window.store(window, Ordering::Relaxed);
                e.generation = generation;
                e.callers_drive = live.callers_drive();
                bump(&self.shared.counters.connections, 1);
                let res = (e.core)
                    .link_restored(&mut live)
                    .and_then(|()| live.process(&mut e.core));
                e.live = Some(live);
                if let Err(err) = res {
                    e.lose(err);
                }
            }
            QueueCtl::Detach => {
                if e.live.take().is_some() {
                    let reason = Error::lost(e.core.addr(), "controller reset");
                    e.core.link_lost(&reason);
                }
            }
            QueueCtl::Fail(err) => {
                e.live = None;
                *self.shared.closed_error.lock() = Some(err.clone());
                self.shared.tags.close();
                e.core.fail(err);
            }
            QueueCtl::Close => {}
            QueueCtl::AttachRings(grant) => self.rings.attach(grant),
            QueueCtl::DetachRings { id, done } => self.rings.detach(id, done),
        }
    }

    fn shutdown(&mut self, err: Error) {
        let engine = Arc::clone(&self.engine);
        let mut guard = engine.lock();
        let e = &mut *guard;
        e.live = None;
        {
            let mut ce = self.shared.closed_error.lock();
            if ce.is_none() {
                *ce = Some(err.clone());
            }
        }
        self.shared.tags.close();
        self.sub_rx.close();
        while let Ok(s) = self.sub_rx.try_recv() {
            self.shared.finish_slot(s.tag, Err(err.clone()), s.buf);
        }
        if e.core.failed().is_none() {
            e.core.fail(err);
        } else {
            e.core.fail_all(&err);
        }
        self.finish_ring_reads(e);
    }
}

impl Drop for Task {
    fn drop(&mut self) {
        // However the task ends (even when its runtime shuts down), no caller is left waiting.
        self.shutdown(Error::Closed);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;
    use std::task::Wake;

    use nvmeof_target::{Config, RunningTarget, Target};

    use super::*;
    use crate::{ConnectOptions, Controller, HostIdentity, TargetAddr};

    const NQN: &str = "nqn.2026-11.io.nvmeof-direct:queue-unit";

    /// A waker that counts its wake-ups.
    #[derive(Default)]
    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn target() -> (RunningTarget, TargetAddr) {
        let listen = "tcp://127.0.0.1:0".parse().expect("listen address");
        let ns = ["mem:4M".parse().expect("backend")];
        let mut cfg = Config::quick(&[listen], NQN, &ns, true, &[]).expect("config");
        cfg.target.reactors = 1;
        let target = Target::build(&cfg).expect("build");
        let listeners = nvmeof_target::launcher::bind(&cfg).expect("bind");
        let addr = listeners[0].addr.addr;
        let running = RunningTarget::start(target, listeners).expect("start");
        (running, TargetAddr::new(addr.ip().to_string(), addr.port()))
    }

    async fn connect(addr: TargetAddr) -> (Controller, crate::Namespace) {
        connect_polling(addr, crate::options::DEFAULT_BUSY_POLL).await
    }

    async fn connect_polling(
        addr: TargetAddr,
        busy_poll: Duration,
    ) -> (Controller, crate::Namespace) {
        connect_with(addr, |o| o.busy_poll = busy_poll).await
    }

    /// One I/O queue, options adjusted by `tweak`.
    async fn connect_with(
        addr: TargetAddr,
        tweak: impl FnOnce(&mut ConnectOptions),
    ) -> (Controller, crate::Namespace) {
        let host =
            HostIdentity::new("nqn.2014-08.org.nvmexpress:uuid:queue-unit", [7; 16]).expect("host");
        let mut o = ConnectOptions::new(addr, NQN, host);
        o.io_queues = Some(1);
        tweak(&mut o);
        // No keep-alive within a test: its answer on the admin queue would end an I/O queue's
        // being alone on the thread.
        o.kato = Duration::from_secs(60);
        let ctrl = Controller::connect(o).await.expect("connect");
        let ns = ctrl.namespace(1).await.expect("namespace");
        (ctrl, ns)
    }

    /// A completion read by its own caller while it drives wakes nobody (the caller looks at
    /// its slot once it has read) and says so; any other command's completion wakes its
    /// caller.
    #[tokio::test]
    async fn a_completion_its_own_caller_reads_wakes_nobody() {
        let (report, _reports) = mpsc::unbounded_channel();
        let q = QueueHandle::spawn(
            QueueConfig {
                qid: 1,
                slots: 4,
                addr: "127.0.0.1:4420".into(),
                retry_writes: false,
                scan_period: Duration::from_secs(1),
                busy_poll: Duration::ZERO,
                ring_poll: Duration::ZERO,
            },
            report,
        );
        let shared = &q.shared;
        let count = Arc::new(Count::default());
        let waker = Waker::from(Arc::clone(&count));
        let waiting = |tag: u16| {
            let mut st = shared.slots[usize::from(tag)].lock();
            st.phase = Phase::Waiting;
            st.waker = Some(waker.clone());
        };
        let (mine, other) = (
            shared.tags.try_take().unwrap(),
            shared.tags.try_take().unwrap(),
        );
        waiting(mine);
        waiting(other);
        let ok = |tag| Ok(Cqe::new(tag, nvme_spec::Status::SUCCESS, 0));
        shared.driving.store(u32::from(mine), Ordering::Relaxed);
        shared.finish_slot(mine, ok(mine), SlotBuf::default());
        assert_eq!(count.0.load(Ordering::SeqCst), 0);
        assert!(shared.driver_done());
        assert_eq!(shared.slots[usize::from(mine)].lock().phase, Phase::Done);
        shared.finish_slot(other, ok(other), SlotBuf::default());
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
        assert_eq!(shared.slots[usize::from(other)].lock().phase, Phase::Done);
    }

    /// The leader (the caller the socket wakes), finding the engine held by another thread
    /// when the socket woke it, is woken again: the socket wakes it only once.
    #[tokio::test]
    async fn the_leader_retries_when_the_engine_is_held() {
        let (_target, addr) = target();
        let (ctrl, ns) = connect(addr).await;
        let q = ctrl.io_queue(Some(0)).expect("queue");
        // Polled with the engine free, a read drives the queue and, while it waits, leads
        // (unless its completion came back at once: then another read tries).
        let mut checked = false;
        for lba in 0..100 {
            let mut p = q
                .start(ns.request(false, lba * 8, 4096, false), |_| Ok(()))
                .await
                .expect("start");
            let count = Arc::new(Count::default());
            let waker = Waker::from(Arc::clone(&count));
            let mut cx = Context::from_waker(&waker);
            if p.poll_complete(&mut cx).is_pending() {
                assert_eq!(q.shared.leader.load(Ordering::Relaxed), u32::from(p.tag));
                let before = count.0.load(Ordering::SeqCst);
                {
                    let _held = q.engine.lock();
                    assert!(p.poll_complete(&mut cx).is_pending());
                }
                assert!(
                    count.0.load(Ordering::SeqCst) > before,
                    "the leader comes back"
                );
                checked = true;
            }
            tokio::time::timeout(Duration::from_secs(5), p.wait())
                .await
                .expect("the read ends")
                .expect("read");
            drop(p);
            if checked {
                break;
            }
        }
        assert!(checked, "no read waited");
        ctrl.disconnect().await.expect("disconnect");
    }

    /// A caller that waits for one answer at a time reads its socket in a loop for it, but not
    /// on the poll that submitted its command: a caller with more commands to submit (futures
    /// beside this one) submits them first, and its queue is then no longer one command deep.
    #[tokio::test]
    async fn a_lone_caller_reads_in_a_loop_only_after_its_first_look() {
        let (_target, addr) = target();
        // A window long enough for the answer of a debug build on a busy machine.
        let (ctrl, ns) = connect_polling(addr, Duration::from_millis(100)).await;
        let q = ctrl.io_queue(Some(0)).expect("queue");
        let waker = Waker::from(Arc::new(Count::default()));
        let mut cx = Context::from_waker(&waker);
        // This queue received last on this thread, a hold (four windows) ago: alone.
        let mut buf = vec![0u8; 4096];
        ns.read(0, &mut buf).await.expect("read");
        tokio::time::sleep(Duration::from_millis(500)).await;
        let reads = 40;
        let mut first_pending = 0;
        for lba in 0..reads {
            let mut p = q
                .start(ns.request(false, lba * 8, 4096, false), |_| Ok(()))
                .await
                .expect("start");
            // The first look writes, reads what is there and goes back to the runtime: the
            // answer of a read just sent is not there yet.
            if p.poll_complete(&mut cx).is_ready() {
                continue;
            }
            first_pending += 1;
            // The next looks read the socket themselves until the answer comes: without
            // going back to the runtime in between, nothing else would see it arrive.
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            while p.poll_complete(&mut cx).is_pending() {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the answer was not read in a loop"
                );
            }
        }
        assert!(
            first_pending * 4 >= reads * 3,
            "the first look waited for the answer: {first_pending} of {reads} left it pending"
        );
        ctrl.disconnect().await.expect("disconnect");
    }

    /// Capsules submitted while other commands are in flight wait for the next drive's write,
    /// but never [`FLUSH_AFTER`] of them: the submitting caller writes them then.
    #[tokio::test]
    async fn gathered_capsules_are_written_every_flush_after() {
        let (_target, addr) = target();
        let (ctrl, ns) = connect(addr).await;
        let q = ctrl.io_queue(Some(0)).expect("queue");
        let mut pending = Vec::new();
        for lba in 0..(3 * FLUSH_AFTER as u64) {
            let p = q
                .start(ns.request(false, lba * 8, 4096, false), |_| Ok(()))
                .await
                .expect("start");
            pending.push(p);
            let waiting = q.engine.lock().unflushed;
            assert!(
                waiting < FLUSH_AFTER,
                "{waiting} capsules wait after {} submissions",
                lba + 1
            );
        }
        for mut p in pending {
            tokio::time::timeout(Duration::from_secs(5), p.wait())
                .await
                .expect("the read ends")
                .expect("read");
        }
        ctrl.disconnect().await.expect("disconnect");
    }

    /// A caller with more commands than the queue's entries hold gets a slot for each at
    /// once; the queue puts no more on the wire than the entries hold and sends the others as
    /// answers come back.
    #[tokio::test]
    async fn commands_beyond_the_entries_wait_in_the_queue_not_for_a_slot() {
        let (_target, addr) = target();
        let (ctrl, ns) = connect_with(addr, |o| o.queue_depth = 4).await;
        for i in 0..6u8 {
            let block = [i + 1; 4096];
            ns.write(u64::from(i) * 8, &block).await.expect("write");
        }
        let q = ctrl.io_queue(Some(0)).expect("queue");
        assert_eq!(q.window(), 3, "4 entries hold 3 commands");
        let mut pending = Vec::new();
        for i in 0..6u64 {
            let start = q.start(ns.request(false, i * 8, 4096, false), |_| Ok(()));
            let p = tokio::time::timeout(Duration::from_secs(5), start)
                .await
                .expect("a slot without waiting for an answer")
                .expect("start");
            pending.push(p);
            let on_wire = q.engine.lock().core.on_wire();
            assert!(on_wire <= 3, "{on_wire} commands on the wire");
        }
        for (i, mut p) in pending.into_iter().enumerate() {
            tokio::time::timeout(Duration::from_secs(5), p.wait())
                .await
                .expect("the read ends")
                .expect("read");
            let want = i as u8 + 1;
            assert!(
                p.with_data(4096, |d| d.iter().all(|&b| b == want)),
                "read {i}"
            );
        }
        ctrl.disconnect().await.expect("disconnect");
    }

    /// A response that makes room for a command waiting in the core has it written by the
    /// same drive: a link with bytes to send is ready again as soon as the socket takes them,
    /// and the next round writes them.
    #[tokio::test]
    async fn a_command_a_response_releases_is_written_by_the_same_drive() {
        let (_target, addr) = target();
        let (ctrl, ns) = connect_with(addr, |o| o.queue_depth = 2).await;
        let q = ctrl.io_queue(Some(0)).expect("queue");
        assert_eq!(q.window(), 1);
        let read = |lba| ns.request(false, lba, 4096, false);
        let mut first = q.start(read(0), |_| Ok(())).await.expect("start");
        let mut second = q.start(read(8), |_| Ok(())).await.expect("start");
        assert_eq!(
            q.engine.lock().core.on_wire(),
            1,
            "the second waits for room"
        );
        tokio::time::timeout(Duration::from_secs(5), first.wait())
            .await
            .expect("the first read ends")
            .expect("read");
        {
            let e = q.engine.lock();
            assert_eq!(e.core.on_wire(), 1, "the second took the room");
            let unsent = e.live.as_ref().is_some_and(Link::has_unsent);
            assert!(!unsent, "and was written");
        }
        tokio::time::timeout(Duration::from_secs(5), second.wait())
            .await
            .expect("the second read ends")
            .expect("read");
        drop((first, second));
        ctrl.disconnect().await.expect("disconnect");
    }

    /// A command refused before it leaves (a lent buffer too short for its read) gives its
    /// slot back.
    #[tokio::test]
    async fn a_command_refused_before_it_leaves_gives_its_slot_back() {
        let (_target, addr) = target();
        let (ctrl, ns) = connect(addr).await;
        let q = ctrl.io_queue(Some(0)).expect("queue");
        for _ in 0..q.slots() + 1 {
            let short = Lent::Vec(vec![0u8; 512]);
            let r = q.start_lent(ns.request(false, 0, 4096, false), short).await;
            assert!(matches!(r, Err(Error::InvalidArgument(_))), "refused");
            assert_eq!(q.shared.busy(), 0, "slot given back");
        }
        ctrl.disconnect().await.expect("disconnect");
    }

    /// The wait that sees a lent read end gives the buffer back and frees the slot under the
    /// slot's one lock: the slot is free before the caller takes the buffer, and the buffer
    /// holds the data.
    #[tokio::test]
    async fn a_lent_read_is_given_back_by_the_wait_that_sees_it_end() {
        let (_target, addr) = target();
        let (ctrl, ns) = connect(addr).await;
        ns.write(16, &[7u8; 4096]).await.expect("write");
        let q = ctrl.io_queue(Some(0)).expect("queue");
        let lent = Lent::Vec(vec![0u8; 4096]);
        let mut p = q
            .start_lent(ns.request(false, 16, 4096, false), lent)
            .await
            .expect("start");
        assert_eq!(q.shared.busy(), 1);
        let cqe = p.wait().await.expect("read");
        assert!(cqe.status().is_success());
        assert_eq!(q.shared.busy(), 0, "the slot went back with the wait");
        match p.take_lent() {
            Some(Lent::Vec(v)) => assert!(v.iter().all(|&b| b == 7), "the read's data"),
            _ => panic!("the lent buffer comes back"),
        }
        assert!(p.take_lent().is_none(), "given back once");
        drop(p);
        assert_eq!(q.shared.busy(), 0);
        ctrl.disconnect().await.expect("disconnect");
    }

    /// The caller that is to write a round's capsules, finding the engine held by another
    /// thread, is woken to try again: the holder does not write them for it, and nobody else
    /// would (the command would wait for the queue's timer).
    #[tokio::test]
    async fn the_caller_that_writes_the_round_retries_when_the_engine_is_held() {
        let (_target, addr) = target();
        let (ctrl, ns) = connect(addr).await;
        let q = ctrl.io_queue(Some(0)).expect("queue");
        // The first read leaves at once (idle queue); the second waits for its round's write.
        let mut first = q
            .start(ns.request(false, 0, 4096, false), |_| Ok(()))
            .await
            .unwrap();
        let mut second = q
            .start(ns.request(false, 8, 4096, false), |_| Ok(()))
            .await
            .unwrap();
        let count = Arc::new(Count::default());
        let waker = Waker::from(Arc::clone(&count));
        let mut cx = Context::from_waker(&waker);
        // Polled once: it takes the round's write and yields (wakes itself).
        assert!(second.poll_complete(&mut cx).is_pending());
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
        assert_eq!(
            q.shared.flush_by.load(Ordering::Relaxed),
            u32::from(second.tag)
        );
        // Polled again while another thread holds the engine: it must come back.
        {
            let _held = q.engine.lock();
            assert!(second.poll_complete(&mut cx).is_pending());
        }
        assert_eq!(
            count.0.load(Ordering::SeqCst),
            2,
            "woken to write the round"
        );
        // Polled again with the engine free: it writes, and both reads end.
        let both = async {
            first.wait().await.expect("first");
            second.wait().await.expect("second");
        };
        tokio::time::timeout(Duration::from_secs(5), both)
            .await
            .expect("both reads end");
        drop((first, second));
        ctrl.disconnect().await.expect("disconnect");
    }
}
