//! Run-to-completion queue pairs: one I/O queue of a controller owned and driven by its
//! caller ([`QueuePair`], [`BlockingQueuePair`]).

use std::time::Duration;

use busy_poll::PollGate;
use nvme_spec::Cqe;
use nvme_spec::command::build;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::{Instant, timeout_at};
use tracing::{debug, info, warn};

use crate::buffer::SlotBuf;
use crate::controller::{PairQid, StateInfo};
use crate::link::{self, Link};
use crate::queue::{QueueStats, SupMsg};
use crate::queue_core::{Completions, Core, QueueCounters, Request, Retry, bump};
use crate::{ControllerState, Error, Namespace};

/// Bytes of NVMe/TCP PDUs one [`QueuePair::poll`] reads through the receive buffer at most
/// (about sixteen 4 KiB reads): the caller's next commands then leave while the rest of the
/// answers still arrive, instead of after all of them. Against a target that works through
/// its queue in batches (SPDK's `nvmf_tgt`) this kept both ends busy: 4-12% more IOPS from
/// eight queue pairs, no change against ours (BENCHMARKS.md, G7a).
const RECEIVE_BUDGET: usize = 64 * 1024;

/// One finished command of a [`QueuePair`].
#[derive(Debug)]
pub struct Completion {
    /// The value given when the command was submitted.
    pub user_data: u64,
    /// `Ok` when the command succeeded; [`Error::Status`] for an error status from the
    /// controller, or the transport error that ended it.
    pub result: Result<(), Error>,
    /// The command's buffer, given back (for a read that succeeded: the data).
    pub buf: Vec<u8>,
}

/// A command a [`QueuePair`] did not take: why, and the buffer, given back.
#[derive(Debug, thiserror::Error)]
#[error("{error}")]
pub struct Rejected {
    /// Why ([`Error::QueueFull`], or [`Error::InvalidArgument`] for a bad length or range).
    pub error: Error,
    /// The buffer of the command.
    pub buf: Vec<u8>,
}

/// What a queue pair knows of each command identifier.
struct Tag {
    user_data: u64,
    name: &'static str,
    /// The caller's buffer while the command moves its data through the identifier's
    /// registered staging buffer (over a link that cannot use the caller's memory), and
    /// whether it is a read (whose data is copied in when it succeeds).
    held: Option<(Vec<u8>, bool)>,
}

/// Where the core's completions go: a list the owner reaps, and the free identifiers.
struct Reaped {
    done: Vec<Completion>,
    tags: Box<[Tag]>,
    free: Vec<u16>,
    /// Each identifier's staging buffer: registered with the NVMe/RDMA protection domain the
    /// first time a command needs it and kept, so that no command registers memory once
    /// every identifier has been used (unused over NVMe/TCP, which receives into the
    /// caller's buffer).
    staging: Box<[SlotBuf]>,
    counters: QueueCounters,
}

impl Reaped {
    /// An empty list for `slots` command identifiers, all free.
    fn new(slots: u16) -> Reaped {
        let n = usize::from(slots);
        Reaped {
            done: Vec::with_capacity(n),
            tags: (0..n)
                .map(|_| Tag {
                    user_data: 0,
                    name: "Read",
                    held: None,
                })
                .collect(),
            free: (0..slots).rev().collect(),
            staging: (0..n).map(|_| SlotBuf::default()).collect(),
            counters: QueueCounters::default(),
        }
    }

    /// The buffer command `tag` sends: `buf` itself, or (`staged`) the identifier's staging
    /// buffer, holding write data copied from `buf`, while `buf` waits in the tag.
    fn take_buffer(&mut self, tag: u16, buf: Vec<u8>, write: bool, staged: bool) -> SlotBuf {
        let i = usize::from(tag);
        if !staged {
            self.tags[i].held = None;
            return SlotBuf::Heap(buf);
        }
        let mut stage = std::mem::take(&mut self.staging[i]);
        if write && stage.ensure(buf.len()).is_ok() {
            stage.as_mut_slice()[..buf.len()].copy_from_slice(&buf);
        }
        self.tags[i].held = Some((buf, !write));
        stage
    }
}

impl Completions for Reaped {
    fn finish(&mut self, tag: u16, result: Result<Cqe, Error>, buf: SlotBuf) {
        let i = usize::from(tag);
        let Some(t) = self.tags.get_mut(i) else {
            return;
        };
        let (name, user_data, held) = (t.name, t.user_data, t.held.take());
        let result = result.and_then(|cqe| {
            let st = cqe.status();
            if st.is_success() {
                Ok(())
            } else {
                Err(Error::status_of(name, st))
            }
        });
        let buf = match held {
            None => buf.into_vec(),
            Some((mut own, read)) => {
                if read && result.is_ok() {
                    if let Some(data) = buf.as_slice().get(..own.len()) {
                        own.copy_from_slice(data);
                    }
                }
                self.staging[i] = buf;
                own
            }
        };
        self.free.push(tag);
        self.done.push(Completion {
            user_data,
            result,
            buf,
        });
    }

    fn counters(&self) -> &QueueCounters {
        &self.counters
    }
}

/// What a queue pair does about its connection, given the controller's state.
#[derive(Debug)]
enum Plan {
    /// Keep the link: it belongs to the live association.
    Keep,
    /// Drop the link (its association is gone); keep the commands for the next one.
    Detach,
    /// Open the I/O queue again, in association `generation`.
    Open(u64),
    /// Wait: for the controller to reconnect, or for the open under way.
    Wait,
    /// Fail every command, now and later, with this error.
    Fail(Error),
}

/// Where the queue pair's connection stands.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Attachment {
    /// The association the link belongs to (None: no link).
    link: Option<u64>,
    /// The association the I/O queue is being opened in.
    opening: Option<u64>,
    /// The association in which the queue pair lost its link and reported it: it is not
    /// opened again in that one (the controller resets it).
    lost_in: Option<u64>,
}

impl Attachment {
    /// What to do, the controller being in `state` with association `generation`.
    fn plan(&self, state: &ControllerState, generation: u64, addr: &str) -> Plan {
        match state {
            ControllerState::Failed { error } => Plan::Fail(Error::ControllerFailed {
                addr: addr.to_string(),
                reason: error.clone(),
            }),
            ControllerState::Closed => Plan::Fail(Error::Closed),
            ControllerState::Reconnecting { .. } if self.link.is_some() => Plan::Detach,
            ControllerState::Reconnecting { .. } => Plan::Wait,
            ControllerState::Connected => match self.link {
                Some(g) if g == generation => Plan::Keep,
                Some(_) => Plan::Detach,
                None if self.opening == Some(generation) || self.lost_in == Some(generation) => {
                    Plan::Wait
                }
                None => Plan::Open(generation),
            },
        }
    }
}

/// The I/O queue being opened again: the association it is opened in, and where the link
/// comes back.
struct Opening {
    generation: u64,
    rx: oneshot::Receiver<Result<Link, Error>>,
    task: JoinHandle<()>,
}

impl Drop for Opening {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A run-to-completion I/O queue of one namespace.
///
/// The shared queues of a [`Controller`](crate::Controller) are driven by one task each, and a
/// command reaches its queue through a channel and comes back through a slot and a waker. A
/// [`QueuePair`] has no task: it owns its I/O queue (its own queue ID, connection and Fabrics
/// Connect, set up like the shared queues) and the same queue core (command table, deadlines,
/// retries of transient transport errors), and its caller drives both:
///
/// - [`read`](QueuePair::read), [`write`](QueuePair::write) and [`flush`](QueuePair::flush)
///   put a command into the queue's send buffer and return at once, with no system call, no
///   channel and no lock; the caller's buffer (a `Vec<u8>`) travels with the command and comes
///   back in its [`Completion`], with the read data in it (NVMe/TCP receives large read data
///   straight into it);
/// - [`poll`](QueuePair::poll) sends every command submitted since the last call with one
///   `write` and reaps every completion that has arrived (each read takes as much as the
///   socket holds), without waiting;
/// - [`wait`](QueuePair::wait) does the same until some completions arrive: it busy-polls for
///   the connection's [`busy_poll`](crate::ConnectOptions::busy_poll) window after a
///   submission and while completions come back within it ([`busy_poll::PollGate`]), and
///   otherwise sleeps until the connection is readable; with nothing in flight it returns at
///   once, so an idle queue pair uses no CPU.
///
/// A [`QueuePair`] runs on the tokio runtime it was opened on (its socket is registered
/// there) and is used from one task. [`BlockingQueuePair`] is the same queue pair for a plain
/// OS thread (a data-loader thread): it owns a current-thread runtime that only its own calls
/// drive, so nothing else runs on that thread and no other thread is involved.
///
/// Every command has the controller's I/O timeout: one that does not complete in time
/// completes with [`Error::Timeout`] from `poll` or `wait` (the connection is then closed, as
/// the target stopped answering, and set up again as below).
///
/// # Lost connections
///
/// A queue pair reconnects through its controller's supervisor, like the shared queues, as
/// the controller's [`ReconnectPolicy`](crate::ReconnectPolicy) says. When its connection
/// fails (a socket or queue pair error, the target going away, a command timing out) it
/// reports the loss to the supervisor, which resets the association (admin queue and every
/// I/O queue) and re-establishes it with backoff; a loss that any other queue of the
/// controller reports detaches the queue pair the same way. Commands in flight are handed
/// over as the shared queues hand theirs over: reads and Flush (and writes, with
/// [`ConnectOptions::retry_writes`](crate::ConnectOptions::retry_writes)) wait, in their
/// order, and are sent again on the new connection, with their own deadlines still running
/// (one that passes completes with [`Error::Timeout`]); writes that were on the wire fail at
/// once with [`Error::Interrupted`], as they may or may not have reached the media. Commands
/// submitted meanwhile wait too.
/// Once the controller is connected again, the next [`poll`](QueuePair::poll) or
/// [`wait`](QueuePair::wait) opens the queue pair's I/O queue in the new association (same
/// queue ID, in the background: neither call blocks on it) and sends what waits. When the
/// supervisor gives up (`ctrl_loss_timeout`) every command, and every later one, completes
/// with [`Error::ControllerFailed`] naming the last error; after
/// [`Controller::disconnect`](crate::Controller::disconnect), with [`Error::Closed`]. A
/// reconnected controller that no longer grants the queue pair's queue ID or depth fails it
/// with [`Error::Refused`] saying so. [`is_connected`](QueuePair::is_connected) tells whether
/// the I/O queue is up now; [`QueueStats::connections`] counts its connections.
///
/// # Memory over NVMe/RDMA
///
/// The target reaches only registered memory. Each command identifier of a queue pair has a
/// staging buffer, registered with the controller's protection domain the first time a
/// command needs it (and again only when a larger transfer comes) and kept: a read lands
/// there and is copied into the caller's `Vec`, a write is copied there and fetched by the
/// target, and no command registers memory in steady state (the shape of the shared queues'
/// slot buffers). Over NVMe/TCP there is no staging: reads are received into the caller's
/// buffer.
///
/// # Example
///
/// ```no_run
/// use nvmeof_initiator::{Completion, Namespace, QueuePair};
///
/// # async fn run(ns: Namespace) -> Result<(), nvmeof_initiator::Error> {
/// // The controller was connected with `ConnectOptions::queue_pairs` >= 1.
/// let mut qp = QueuePair::open(&ns).await?;
/// let bs = ns.block_size() as usize;
/// for i in 0..32 {
///     qp.read(i * 8, vec![0u8; 8 * bs], i).map_err(|r| r.error)?;
/// }
/// let mut done: Vec<Completion> = Vec::new();
/// while done.len() < 32 {
///     qp.wait(&mut done, 1, None).await;
/// }
/// for c in &done {
///     c.result.as_ref().map_err(Clone::clone)?;
///     // c.buf holds the 8 blocks read at c.user_data * 8.
/// }
/// # Ok(())
/// # }
/// ```
pub struct QueuePair {
    ns: Namespace,
    lease: PairQid,
    link: Option<Link>,
    core: Core<Reaped>,
    /// Where the connection stands against the controller's association.
    at: Attachment,
    /// The controller's state and association generation.
    state: watch::Receiver<StateInfo>,
    /// Where a lost connection is reported.
    supervisor: mpsc::UnboundedSender<SupMsg>,
    /// The I/O queue being opened again.
    opening: Option<Opening>,
    /// The runtime the queue pair runs on (its links are opened there).
    rt: tokio::runtime::Handle,
    /// Whether commands move their data through the staging buffers (the link cannot reach
    /// the caller's memory).
    staged: bool,
    depth: usize,
    poll: PollGate,
    scan_period: Duration,
    next_scan: Instant,
}

impl std::fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueuePair")
            .field("qid", &self.lease.qid())
            .field("nsid", &self.ns.nsid())
            .field("in_flight", &self.in_flight())
            .field("connected", &self.link.is_some())
            .finish()
    }
}

impl QueuePair {
    /// Opens a queue pair for `ns` on the current tokio runtime: takes one of the queue IDs
    /// kept by [`ConnectOptions::queue_pairs`](crate::ConnectOptions::queue_pairs) and sets up
    /// that I/O queue (connection, Fabrics Connect). It holds `queue_depth - 1` commands.
    /// The queue ID is free again when the queue pair is dropped.
    pub async fn open(ns: &Namespace) -> Result<QueuePair, Error> {
        let ctrl = ns.controller();
        let lease = ctrl.lease_pair_qid()?;
        let mut state = ctrl.watch_state();
        let generation = state.borrow_and_update().generation;
        let spec = lease.spec(None)?;
        let link = lease.open(spec).await?;
        let opts = &ctrl.shared().opts;
        let slots = spec.depth.saturating_sub(1).max(1);
        let sink = Reaped::new(slots);
        bump(&sink.counters.connections, 1);
        let addr = ctrl.shared().addr.clone();
        let core = Core::new(sink, addr, slots, opts.retry_writes, false);
        let scan_period =
            (opts.timeouts.io / 8).clamp(Duration::from_millis(10), Duration::from_secs(1));
        Ok(QueuePair {
            ns: ns.clone(),
            staged: !lease.limits().lends_buffers,
            lease,
            link: Some(link),
            core,
            at: Attachment {
                link: Some(generation),
                ..Attachment::default()
            },
            state,
            supervisor: ctrl.supervisor(),
            opening: None,
            rt: tokio::runtime::Handle::current(),
            depth: usize::from(slots),
            poll: PollGate::new(opts.busy_poll),
            scan_period,
            next_scan: Instant::now() + scan_period,
        })
    }

    /// The I/O queue ID.
    pub fn qid(&self) -> u16 {
        self.lease.qid()
    }

    /// The namespace.
    pub fn namespace(&self) -> &Namespace {
        &self.ns
    }

    /// Commands the queue pair holds at most.
    pub fn depth(&self) -> usize {
        self.depth
    }

    /// Commands submitted and not yet finished.
    pub fn in_flight(&self) -> usize {
        self.depth - self.core.sink().free.len()
    }

    /// Whether the I/O queue is connected now (false while it is set up again after a lost
    /// connection, and once the controller failed or was disconnected).
    pub fn is_connected(&self) -> bool {
        self.link.is_some()
    }

    /// Counters of the queue.
    pub fn stats(&self) -> QueueStats {
        QueueStats::of(self.qid(), self.core.counters())
    }

    /// Submits a read of `buf.len()` bytes (a non-zero multiple of the block size, at most the
    /// controller's transfer limit) at block `lba` into `buf`. It is sent by the next
    /// [`poll`](Self::poll) or [`wait`](Self::wait).
    pub fn read(&mut self, lba: u64, buf: Vec<u8>, user_data: u64) -> Result<(), Rejected> {
        self.submit_rw(false, lba, buf, user_data)
    }

    /// Submits a write of `buf` (a non-zero multiple of the block size, at most the
    /// controller's transfer limit) at block `lba`.
    pub fn write(&mut self, lba: u64, buf: Vec<u8>, user_data: u64) -> Result<(), Rejected> {
        self.submit_rw(true, lba, buf, user_data)
    }

    /// Submits a Flush of the namespace (its completion comes with an empty buffer).
    pub fn flush(&mut self, user_data: u64) -> Result<(), Rejected> {
        let req = self
            .ns
            .plain_request(build::flush(0, self.ns.nsid()), Retry::Always);
        self.submit(req, "Flush", Vec::new(), user_data, false, false)
    }

    fn submit_rw(
        &mut self,
        write: bool,
        lba: u64,
        buf: Vec<u8>,
        user_data: u64,
    ) -> Result<(), Rejected> {
        let len = buf.len();
        let checked = self.ns.check_len(lba, len).and_then(|()| {
            let max = self.ns.max_chunk();
            if len > max {
                return Err(Error::InvalidArgument(format!(
                    "a queue pair command moves at most {max} bytes (the transfer limit); {len} asked"
                )));
            }
            Ok(())
        });
        if let Err(error) = checked {
            return Err(Rejected { error, buf });
        }
        let req = self.ns.request(write, lba, len, false);
        let name = if write { "Write" } else { "Read" };
        self.submit(req, name, buf, user_data, write, self.staged)
    }

    /// Takes a free identifier for `req` and hands it to the core with `buf` (through the
    /// identifier's staging buffer when `staged`).
    fn submit(
        &mut self,
        req: Request,
        name: &'static str,
        buf: Vec<u8>,
        user_data: u64,
        write: bool,
        staged: bool,
    ) -> Result<(), Rejected> {
        let sink = self.core.sink_mut();
        let Some(tag) = sink.free.pop() else {
            let error = Error::QueueFull { depth: self.depth };
            return Err(Rejected { error, buf });
        };
        let t = &mut sink.tags[usize::from(tag)];
        t.user_data = user_data;
        t.name = name;
        let buf = sink.take_buffer(tag, buf, write, staged);
        let now = Instant::now();
        self.core.now = now;
        self.poll.submitted(now.into_std());
        let r = self
            .core
            .submit(self.link.as_mut(), tag, req, buf, None, None);
        if let Err(e) = r {
            self.lose(e);
        }
        Ok(())
    }

    /// Sends what was submitted (one `write` for the whole batch), takes what has arrived,
    /// fails commands past their deadline, and moves the finished commands to `out`. Never
    /// waits. Returns how many completions were added.
    ///
    /// In async code, call it after yielding to the runtime (or use [`wait`](Self::wait)):
    /// it reads what the runtime's reactor has seen arrive.
    pub fn poll(&mut self, out: &mut Vec<Completion>) -> usize {
        self.core.now = Instant::now();
        self.drive();
        self.reap(out)
    }

    /// Like [`poll`](Self::poll), then waits until at least `min` completions were added, no
    /// command is in flight, or `timeout` (if any) passed. It polls (yielding to the runtime)
    /// for the busy-poll window after a submission, and after arrivals while completions come
    /// back within the window; otherwise it sleeps until the connection is readable. With
    /// nothing in flight it returns at once, so an idle queue pair uses no CPU. Returns how
    /// many completions were added.
    pub async fn wait(
        &mut self,
        out: &mut Vec<Completion>,
        min: usize,
        timeout: Option<Duration>,
    ) -> usize {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut got = 0;
        loop {
            got += self.poll(out);
            let now = self.core.now;
            if got >= min || self.in_flight() == 0 || deadline.is_some_and(|d| now >= d) {
                return got;
            }
            if self.poll.polling(now.into_std()) {
                tokio::task::yield_now().await;
                continue;
            }
            let until = deadline.map_or(self.next_scan, |d| d.min(self.next_scan));
            if let Some(link) = self.link.as_ref() {
                if let Ok(wake) = timeout_at(until, link.ready()).await {
                    if let Some(err) = link.wake_error(self.core.addr(), wake) {
                        self.lose(err);
                    }
                }
            } else if let Some(op) = self.opening.as_mut() {
                if let Ok(r) = timeout_at(until, &mut op.rx).await {
                    let generation = op.generation;
                    self.opening = None;
                    self.opened(generation, r.unwrap_or_else(|_| Err(self.setup_gone())));
                }
            } else if self.core.failed().is_none() {
                // Until the controller's state changes (it reconnected, or gave up).
                let _ = timeout_at(until, self.state.changed()).await;
            } else {
                tokio::time::sleep_until(until).await;
            }
        }
    }

    /// Sends, receives and checks deadlines once, at `core.now`.
    fn drive(&mut self) {
        let now = self.core.now;
        if self.link.is_none() || self.state.has_changed().unwrap_or(true) {
            self.supervise();
        }
        if let Some(link) = self.link.as_mut() {
            if let Err(e) = link.try_flush() {
                let err = Error::lost(self.core.addr(), format!("send failed: {e}"));
                self.lose(err);
            }
        }
        if let Some(link) = self.link.as_mut() {
            match link.receive(&mut self.core, RECEIVE_BUDGET) {
                Ok(true) => {
                    self.poll.arrived(now.into_std());
                    // Retries of transient errors go out now.
                    if let Err(e) = link.try_flush() {
                        let err = Error::lost(self.core.addr(), format!("send failed: {e}"));
                        self.lose(err);
                    }
                }
                Ok(false) => {}
                Err(e) => self.lose(e),
            }
        }
        if now >= self.next_scan {
            self.next_scan = now + self.scan_period;
            let had_link = self.link.is_some();
            if let Some(err) = link::expire(&mut self.link, &mut self.core) {
                if had_link {
                    self.report_loss(err);
                }
            }
        }
    }

    /// Moves the finished commands to `out`.
    fn reap(&mut self, out: &mut Vec<Completion>) -> usize {
        let done = &mut self.core.sink_mut().done;
        let n = done.len();
        out.append(done);
        n
    }

    /// Follows the controller's association: takes the link an open brought, drops a link
    /// whose association is gone, starts opening the I/O queue in a new one, or fails
    /// everything once the controller failed or closed.
    fn supervise(&mut self) {
        if let Some(op) = self.opening.as_mut() {
            match op.rx.try_recv() {
                Err(oneshot::error::TryRecvError::Empty) => {}
                r => {
                    let generation = op.generation;
                    self.opening = None;
                    self.opened(generation, r.unwrap_or_else(|_| Err(self.setup_gone())));
                }
            }
        }
        loop {
            self.at.link = self.link.as_ref().and(self.at.link);
            self.at.opening = self.opening.as_ref().map(|o| o.generation);
            let plan = {
                let st = self.state.borrow_and_update();
                self.at.plan(&st.state, st.generation, self.core.addr())
            };
            match plan {
                Plan::Keep | Plan::Wait => return,
                Plan::Detach => {
                    self.link = None;
                    self.at.link = None;
                    let reason = Error::lost(self.core.addr(), "controller reset");
                    self.core.link_lost(&reason);
                }
                Plan::Open(generation) => return self.start_open(generation),
                Plan::Fail(err) => {
                    self.link = None;
                    self.opening = None;
                    if self.core.failed().is_none() {
                        debug!(qid = self.qid(), error = %err, "queue pair failed");
                        self.core.fail(err);
                    }
                    return;
                }
            }
        }
    }

    /// Starts opening the I/O queue in association `generation`, on the queue pair's
    /// runtime.
    fn start_open(&mut self, generation: u64) {
        let slots = u16::try_from(self.depth).unwrap_or(u16::MAX);
        let spec = match self.lease.spec(Some(slots)) {
            Ok(spec) => spec,
            Err(e) => {
                warn!(qid = self.qid(), error = %e, "queue pair cannot be set up again");
                self.core.fail(e);
                return;
            }
        };
        let (tx, rx) = oneshot::channel();
        let open = self.lease.open(spec);
        let task = self.rt.spawn(async move {
            let _ = tx.send(open.await);
        });
        self.opening = Some(Opening {
            generation,
            rx,
            task,
        });
    }

    /// The open in association `generation` ended with `r`.
    fn opened(&mut self, generation: u64, r: Result<Link, Error>) {
        let current = {
            let st = self.state.borrow();
            st.state == ControllerState::Connected && st.generation == generation
        };
        if !current {
            // The association moved on: the next one is opened in its turn.
            return;
        }
        match r {
            Ok(mut link) => {
                self.at = Attachment {
                    link: Some(generation),
                    ..Attachment::default()
                };
                bump(&self.core.counters().connections, 1);
                let res = self
                    .core
                    .link_restored(&mut link)
                    .and_then(|()| link.process(&mut self.core));
                self.link = Some(link);
                info!(addr = %self.core.addr(), qid = self.qid(), "queue pair reconnected");
                if let Err(e) = res {
                    self.lose(e);
                }
            }
            Err(e) if e.is_transport() => {
                // Reported like a lost connection: the supervisor resets the association.
                self.at.link = Some(generation);
                self.report_loss(e);
                self.at.link = None;
            }
            Err(e) => {
                warn!(qid = self.qid(), error = %e, "queue pair cannot be set up again");
                self.core.fail(e);
            }
        }
    }

    fn setup_gone(&self) -> Error {
        Error::lost(self.core.addr(), "the queue set-up task ended")
    }

    /// Closes the connection after `err`: keeps or fails the commands in flight and reports
    /// the loss to the supervisor.
    fn lose(&mut self, err: Error) {
        if let Some(mut link) = self.link.take() {
            // A protocol error leaves a TermReq to send; give it one try.
            let _ = link.try_flush();
            drop(link);
            self.report_loss(err);
        }
    }

    /// After the connection was dropped: keeps the commands that may be sent again, fails
    /// the others, and tells the supervisor (the association is not opened again until it
    /// moved on).
    fn report_loss(&mut self, err: Error) {
        self.core.link_lost(&err);
        let generation = self.at.link.unwrap_or_default();
        debug!(addr = %self.core.addr(), qid = self.qid(), error = %err, "queue pair lost its connection");
        self.at.lost_in = Some(generation);
        self.at.link = None;
        let _ = self.supervisor.send(SupMsg::QueueFailed {
            qid: self.qid(),
            generation,
            error: err,
        });
    }
}

/// A [`QueuePair`] for a plain OS thread: it owns a current-thread tokio runtime on which its
/// queue is set up and which only its own calls drive. [`poll`](Self::poll) gives the
/// runtime's reactor one non-blocking turn; [`wait`](Self::wait) blocks the thread.
///
/// Open it on a thread that is not running a tokio runtime (a `std::thread`, or
/// `tokio::task::spawn_blocking`); the controller itself may live on any runtime.
///
/// ```no_run
/// use nvmeof_initiator::{BlockingQueuePair, Namespace};
///
/// fn loader(ns: Namespace) -> Result<u64, nvmeof_initiator::Error> {
///     let mut qp = BlockingQueuePair::open(&ns)?;
///     let bs = ns.block_size() as usize;
///     let mut done = Vec::new();
///     let mut bytes = 0u64;
///     for batch in 0..100u64 {
///         for i in 0..16 {
///             let lba = (batch * 16 + i) * 8;
///             qp.read(lba, vec![0u8; 8 * bs], lba).map_err(|r| r.error)?;
///         }
///         while qp.in_flight() > 0 {
///             qp.wait(&mut done, 16, None);
///             for c in done.drain(..) {
///                 c.result?;
///                 bytes += c.buf.len() as u64;
///             }
///         }
///     }
///     Ok(bytes)
/// }
/// ```
#[derive(Debug)]
pub struct BlockingQueuePair {
    // Dropped before the runtime its connection is registered with.
    qp: QueuePair,
    rt: tokio::runtime::Runtime,
}

impl BlockingQueuePair {
    /// Opens a queue pair for `ns` (see [`QueuePair::open`]) on a runtime of its own.
    ///
    /// # Panics
    ///
    /// When called from a task of an async runtime, as `Runtime::block_on` does (a thread of
    /// `tokio::task::spawn_blocking` is fine).
    pub fn open(ns: &Namespace) -> Result<BlockingQueuePair, Error> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| Error::InvalidArgument(format!("cannot start a runtime: {e}")))?;
        let qp = rt.block_on(QueuePair::open(ns))?;
        Ok(BlockingQueuePair { qp, rt })
    }

    /// The queue pair (queue ID, depth, counters, and submissions).
    pub fn get(&self) -> &QueuePair {
        &self.qp
    }

    /// See [`QueuePair::in_flight`].
    pub fn in_flight(&self) -> usize {
        self.qp.in_flight()
    }

    /// See [`QueuePair::read`].
    pub fn read(&mut self, lba: u64, buf: Vec<u8>, user_data: u64) -> Result<(), Rejected> {
        self.qp.read(lba, buf, user_data)
    }

    /// See [`QueuePair::write`].
    pub fn write(&mut self, lba: u64, buf: Vec<u8>, user_data: u64) -> Result<(), Rejected> {
        self.qp.write(lba, buf, user_data)
    }

    /// See [`QueuePair::flush`].
    pub fn flush(&mut self, user_data: u64) -> Result<(), Rejected> {
        self.qp.flush(user_data)
    }

    /// Sends what was submitted and reaps what has arrived, without blocking (the runtime's
    /// reactor gets one non-blocking turn). Returns how many completions were added to `out`.
    pub fn poll(&mut self, out: &mut Vec<Completion>) -> usize {
        let qp = &mut self.qp;
        self.rt.block_on(async {
            let n = qp.poll(out);
            if n > 0 || qp.in_flight() == 0 {
                return n;
            }
            tokio::task::yield_now().await;
            qp.poll(out)
        })
    }

    /// See [`QueuePair::wait`]; blocks the thread.
    pub fn wait(
        &mut self,
        out: &mut Vec<Completion>,
        min: usize,
        timeout: Option<Duration>,
    ) -> usize {
        let qp = &mut self.qp;
        self.rt.block_on(qp.wait(out, min, timeout))
    }
}

#[cfg(test)]
mod tests {
    //! A queue pair's completion list driven through the queue core by synthetic events.
    use super::*;
    use crate::queue_core::{Cmd, DataDir, Wire};
    use nvme_spec::Status;
    use nvme_spec::status::generic;

    /// A link that takes every command.
    #[derive(Default)]
    struct Sent(Vec<u16>);

    impl Wire for Sent {
        fn send(
            &mut self,
            tag: u16,
            _cmd: &mut Cmd,
            _c: &QueueCounters,
        ) -> Result<Result<(), Error>, Error> {
            self.0.push(tag);
            Ok(Ok(()))
        }

        fn forget(&mut self, _tag: u16) {}
    }

    fn read() -> Request {
        Request {
            sqe: build::read_write(false, 0, 1, 0, 1),
            dir: DataDir::ToHost,
            len: 512,
            retry: Retry::Always,
            timeout: None,
        }
    }

    /// Takes a tag as `QueuePair::submit` does and hands the command to the core.
    fn submit(core: &mut Core<Reaped>, link: &mut Sent, user_data: u64, name: &'static str) -> u16 {
        submit_buf(core, link, user_data, name, vec![7; 512], false)
    }

    /// The same with buffer `buf` (a write when `name` says so), staged or not.
    fn submit_buf(
        core: &mut Core<Reaped>,
        link: &mut Sent,
        user_data: u64,
        name: &'static str,
        buf: Vec<u8>,
        staged: bool,
    ) -> u16 {
        let sink = core.sink_mut();
        let tag = sink.free.pop().expect("a free tag");
        let t = &mut sink.tags[usize::from(tag)];
        t.user_data = user_data;
        t.name = name;
        let buf = sink.take_buffer(tag, buf, name == "Write", staged);
        core.submit(Some(link), tag, read(), buf, None, None)
            .unwrap();
        tag
    }

    #[test]
    fn completions_carry_user_data_status_and_buffer_and_free_their_tag() {
        let mut core = Core::new(Reaped::new(2), "t".into(), 2, false, false);
        let mut link = Sent::default();
        let a = submit(&mut core, &mut link, 10, "Read");
        let b = submit(&mut core, &mut link, 20, "Write");
        assert!(core.sink().free.is_empty());
        let bad = Status::generic(generic::LBA_OUT_OF_RANGE);
        core.on_response(&mut link, Cqe::new(b, bad, 0)).unwrap();
        core.on_response(&mut link, Cqe::new(a, Status::SUCCESS, 0))
            .unwrap();
        let done = std::mem::take(&mut core.sink_mut().done);
        assert_eq!(done.len(), 2);
        assert_eq!(done[0].user_data, 20);
        match &done[0].result {
            Err(e @ Error::Status { command, .. }) => {
                assert_eq!(*command, "Write");
                assert_eq!(e.status().unwrap().sc, generic::LBA_OUT_OF_RANGE);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(done[1].user_data, 10);
        assert!(done[1].result.is_ok());
        assert!(done.iter().all(|c| c.buf == [7; 512]));
        let mut free = core.sink().free.clone();
        free.sort_unstable();
        assert_eq!(free, [0, 1]);
        // A tag used again carries its new user data.
        let c = submit(&mut core, &mut link, 30, "Read");
        core.fail(Error::Closed);
        let done = std::mem::take(&mut core.sink_mut().done);
        assert!(matches!(
            done[..],
            [Completion {
                user_data: 30,
                result: Err(Error::Closed),
                ..
            }]
        ));
        assert!(core.sink().free.contains(&c));
    }

    #[test]
    fn staged_commands_keep_their_staging_buffer_and_copy_read_data_in() {
        let mut core = Core::new(Reaped::new(2), "t".into(), 2, false, false);
        let mut link = Sent::default();
        // A write: its data is copied into the identifier's staging buffer, which the link
        // sends; the caller's buffer comes back untouched.
        let w = submit_buf(&mut core, &mut link, 1, "Write", vec![5; 512], true);
        assert_eq!(core.cmd_mut(w).unwrap().buf.as_slice()[..512], [5; 512]);
        // The link grows the staging buffer, as registering it does.
        core.cmd_mut(w).unwrap().buf.ensure(4096).unwrap();
        let staging_ptr = core.cmd_mut(w).unwrap().buf.as_slice().as_ptr();
        core.on_response(&mut link, Cqe::new(w, Status::SUCCESS, 0))
            .unwrap();
        let c = core.sink_mut().done.pop().unwrap();
        assert_eq!((c.user_data, c.buf.len()), (1, 512));
        assert!(c.buf.iter().all(|&b| b == 5));
        assert_eq!(core.sink().staging[usize::from(w)].as_slice().len(), 4096);
        // A read with the same identifier uses the same staging buffer (no new one, no new
        // registration) and gets the data the target put there.
        let r = submit_buf(&mut core, &mut link, 2, "Read", vec![0; 1024], true);
        assert_eq!(r, w);
        let cmd = core.cmd_mut(r).unwrap();
        assert_eq!(cmd.buf.as_slice().as_ptr(), staging_ptr);
        cmd.buf.as_mut_slice()[..1024].fill(9);
        core.on_response(&mut link, Cqe::new(r, Status::SUCCESS, 0))
            .unwrap();
        let c = core.sink_mut().done.pop().unwrap();
        assert_eq!(c.user_data, 2);
        assert!(c.buf.len() == 1024 && c.buf.iter().all(|&b| b == 9));
        // A failed read gives the caller's buffer back as it was.
        let r = submit_buf(&mut core, &mut link, 3, "Read", vec![1; 512], true);
        core.cmd_mut(r).unwrap().buf.as_mut_slice()[..512].fill(4);
        let bad = Status::generic(generic::LBA_OUT_OF_RANGE);
        core.on_response(&mut link, Cqe::new(r, bad, 0)).unwrap();
        let c = core.sink_mut().done.pop().unwrap();
        assert!(c.result.is_err() && c.buf.iter().all(|&b| b == 1));
        // Unstaged, the caller's buffer is the command's.
        let u = submit_buf(&mut core, &mut link, 4, "Read", vec![2; 512], false);
        let ptr = core.cmd_mut(u).unwrap().buf.as_slice().as_ptr();
        core.fail(Error::Closed);
        let c = core.sink_mut().done.pop().unwrap();
        assert_eq!(c.buf.as_ptr(), ptr);
        assert_eq!(core.sink().staging[usize::from(w)].as_slice().len(), 4096);
    }

    fn plan(at: Attachment, state: ControllerState, generation: u64) -> String {
        format!("{:?}", at.plan(&state, generation, "t"))
    }

    fn reconnecting() -> ControllerState {
        ControllerState::Reconnecting {
            attempt: 1,
            last_error: "reset".into(),
        }
    }

    #[test]
    fn a_queue_pair_follows_the_association() {
        let up = |g| Attachment {
            link: Some(g),
            ..Attachment::default()
        };
        let down = Attachment::default();
        let connected = ControllerState::Connected;
        // Live in its association: nothing to do.
        assert_eq!(plan(up(1), connected.clone(), 1), "Keep");
        // The controller resets: the link goes, commands wait.
        assert_eq!(plan(up(1), reconnecting(), 2), "Detach");
        assert_eq!(plan(down, reconnecting(), 2), "Wait");
        // A new association: open the I/O queue in it, once.
        assert_eq!(plan(down, connected.clone(), 2), "Open(2)");
        let opening = Attachment {
            opening: Some(2),
            ..down
        };
        assert_eq!(plan(opening, connected.clone(), 2), "Wait");
        // An open for an older association does not stop one in the new one.
        let stale = Attachment {
            opening: Some(2),
            ..down
        };
        assert_eq!(plan(stale, connected.clone(), 3), "Open(3)");
        // A link of an older association is dropped even while connected.
        assert_eq!(plan(up(1), connected.clone(), 2), "Detach");
        // Lost and reported in association 2: no reopening in it, only in the next.
        let lost = Attachment {
            lost_in: Some(2),
            ..down
        };
        assert_eq!(plan(lost, connected.clone(), 2), "Wait");
        assert_eq!(plan(lost, connected, 3), "Open(3)");
        // The supervisor gave up, or the host disconnected: everything fails, clearly.
        let failed = ControllerState::Failed {
            error: "connection refused".into(),
        };
        for at in [up(1), down, opening] {
            let p = plan(at, failed.clone(), 2);
            assert!(
                p.starts_with("Fail(ControllerFailed") && p.contains("connection refused"),
                "{p}"
            );
            assert_eq!(plan(at, ControllerState::Closed, 2), "Fail(Closed)");
        }
    }
}
