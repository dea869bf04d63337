//! Run-to-completion queue pairs: one I/O queue of a controller owned and driven by its
//! caller ([`QueuePair`], [`BlockingQueuePair`]).

use std::time::Duration;

use busy_poll::PollGate;
use nvme_spec::Cqe;
use nvme_spec::command::build;
use tokio::time::{Instant, timeout_at};

use crate::buffer::SlotBuf;
use crate::controller::PairQid;
use crate::link::Link;
use crate::queue::QueueStats;
use crate::queue_core::{Completions, Core, QueueCounters, Request, Retry, bump};
use crate::{Error, Namespace};

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
#[derive(Clone, Copy)]
struct Tag {
    user_data: u64,
    name: &'static str,
}

/// Where the core's completions go: a list the owner reaps, and the free identifiers.
struct Reaped {
    done: Vec<Completion>,
    tags: Box<[Tag]>,
    free: Vec<u16>,
    counters: QueueCounters,
}

impl Reaped {
    /// An empty list for `slots` command identifiers, all free.
    fn new(slots: u16) -> Reaped {
        Reaped {
            done: Vec::with_capacity(usize::from(slots)),
            tags: vec![
                Tag {
                    user_data: 0,
                    name: "Read",
                };
                usize::from(slots)
            ]
            .into_boxed_slice(),
            free: (0..slots).rev().collect(),
            counters: QueueCounters::default(),
        }
    }
}

impl Completions for Reaped {
    fn finish(&mut self, tag: u16, result: Result<Cqe, Error>, buf: SlotBuf) {
        let Some(t) = self.tags.get(usize::from(tag)).copied() else {
            return;
        };
        let result = result.and_then(|cqe| {
            let st = cqe.status();
            if st.is_success() {
                Ok(())
            } else {
                Err(Error::status_of(t.name, st))
            }
        });
        self.free.push(tag);
        self.done.push(Completion {
            user_data: t.user_data,
            result,
            buf: buf.into_vec(),
        });
    }

    fn counters(&self) -> &QueueCounters {
        &self.counters
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
/// the target stopped answering). When the connection is lost every command in flight, and
/// every later one, completes with the error; the queue pair does not reconnect: open a new
/// one once the controller is connected again
/// ([`Controller::wait_for_state`](crate::Controller::wait_for_state)).
///
/// Over NVMe/RDMA each command's buffer is registered for that command (correct, but not the
/// fast path that [`RegisteredBuffer`](crate::RegisteredBuffer) gives the async API).
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
    depth: usize,
    poll: PollGate,
    /// When the last command was submitted (its answer is due: `wait` polls for the busy-poll
    /// window after it, whatever the gate says).
    last_submit: Option<Instant>,
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
        let (lease, link, depth) = ctrl.open_pair_queue().await?;
        let opts = &ctrl.shared().opts;
        let slots = depth.saturating_sub(1).max(1);
        let sink = Reaped::new(slots);
        bump(&sink.counters.connections, 1);
        let addr = ctrl.shared().addr.clone();
        let core = Core::new(sink, addr, slots, opts.retry_writes, false);
        let scan_period =
            (opts.timeouts.io / 8).clamp(Duration::from_millis(10), Duration::from_secs(1));
        Ok(QueuePair {
            ns: ns.clone(),
            lease,
            link: Some(link),
            core,
            depth: usize::from(slots),
            poll: PollGate::new(opts.busy_poll),
            last_submit: None,
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

    /// Whether the connection is up (once lost, every command fails).
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
        self.submit(req, "Flush", Vec::new(), user_data)
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
        self.submit(req, if write { "Write" } else { "Read" }, buf, user_data)
    }

    fn submit(
        &mut self,
        req: Request,
        name: &'static str,
        buf: Vec<u8>,
        user_data: u64,
    ) -> Result<(), Rejected> {
        let sink = self.core.sink_mut();
        let Some(tag) = sink.free.pop() else {
            let error = Error::QueueFull { depth: self.depth };
            return Err(Rejected { error, buf });
        };
        sink.tags[usize::from(tag)] = Tag { user_data, name };
        let now = Instant::now();
        self.core.now = now;
        self.poll.submitted(now.into_std());
        self.last_submit = Some(now);
        let r = self
            .core
            .submit(self.link.as_mut(), tag, req, SlotBuf::Heap(buf), None, None);
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
            let window = self.poll.window();
            let answer_due = self
                .last_submit
                .is_some_and(|t| now.saturating_duration_since(t) < window);
            if answer_due || self.poll.polling(now.into_std()) {
                tokio::task::yield_now().await;
                continue;
            }
            let until = deadline.map_or(self.next_scan, |d| d.min(self.next_scan));
            match self.link.as_ref() {
                Some(link) => {
                    if let Ok(wake) = timeout_at(until, link.ready()).await {
                        if let Some(err) = link.wake_error(self.core.addr(), wake) {
                            self.lose(err);
                        }
                    }
                }
                None => tokio::time::sleep_until(until).await,
            }
        }
    }

    /// Sends, receives and checks deadlines once, at `core.now`.
    fn drive(&mut self) {
        let now = self.core.now;
        if let Some(link) = self.link.as_mut() {
            if let Err(e) = link.try_flush() {
                let err = Error::lost(self.core.addr(), format!("send failed: {e}"));
                self.lose(err);
            }
        }
        if let Some(link) = self.link.as_mut() {
            match link.receive(&mut self.core) {
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
            // Over RDMA the target may still write a timed-out command's buffer: destroy the
            // queue pair before the buffer goes back to its owner.
            if self.link.as_ref().is_some_and(Link::is_rdma) && self.core.sent_command_expired() {
                self.link = None;
            }
            if let Some(err) = self.core.expire(self.link.as_mut()) {
                self.lose(err);
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

    /// Closes the connection after `err` and fails every command with it, now and later.
    fn lose(&mut self, err: Error) {
        if let Some(mut link) = self.link.take() {
            // A protocol error leaves a TermReq to send; give it one try.
            let _ = link.try_flush();
        }
        self.core.fail(err);
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
        let tag = core.sink_mut().free.pop().expect("a free tag");
        core.sink_mut().tags[usize::from(tag)] = Tag { user_data, name };
        core.submit(
            Some(link),
            tag,
            read(),
            SlotBuf::Heap(vec![7; 512]),
            None,
            None,
        )
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
}
