//! The queue core: a queue's command table, deadlines, retries and reconnect hand-over,
//! without any connection.
//!
//! The core is driven by events and answers through two seams, so that it runs (and is
//! tested) without a socket or a queue pair:
//!
//! - events in: a command submitted ([`Core::submit`]), a response received
//!   ([`Core::on_response`]), the link lost ([`Core::link_lost`]), a link restored
//!   ([`Core::link_restored`]), the timer ([`Core::expire`]);
//! - actions out: capsules to put on the wire and transfer state to forget go to the link
//!   ([`Wire`]: NVMe/TCP in `tcp`, NVMe/RDMA in `rdma`); completions go to the callers
//!   ([`Completions`]: the queue's slots), or, for reads a GPU request ring asked for, to the
//!   core's list of ended ring reads ([`Core::take_ring_done`]), which the queue task turns
//!   into completion words.
//!
//! Rules the core keeps: every command completes exactly once (a response for a command
//! id the table does not hold is ignored); a command on the wire past its deadline fails
//! with a timeout and asks for the link to be reset; after a link loss, commands that may be
//! resent (reads, idempotent admin commands, writes where allowed) go back to the head of the
//! waiting list in their order and are sent first on the next link, the others fail; a
//! transient transport error is retried up to [`MAX_ATTEMPTS`] sends; no more commands are on
//! the wire than the link's queue entries hold (the window, [`Core::set_window`]): a command
//! submitted while the window is full waits in the same list, in order, and is sent when a
//! response frees its room (the queue may have more command identifiers than entries, so
//! that a caller with more commands than the queue holds does not wait for an identifier).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use nvme_spec::status::generic;
use nvme_spec::{Cqe, Sqe, Status};
use tokio::time::Instant;

use crate::Error;
use crate::buffer::SlotBuf;
use crate::error::command_name;
use crate::registered::Direct;

/// A command is sent at most this many times (first try included) before its error is
/// returned.
pub(crate) const MAX_ATTEMPTS: u8 = 5;

/// Direction of a command's data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DataDir {
    /// No data.
    None,
    /// Controller to host (read).
    ToHost,
    /// Host to controller (write).
    FromHost,
}

/// What happens to a command in flight when its connection is lost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Retry {
    /// Resend it on the next connection (reads, Identify, Flush).
    Always,
    /// Fail it (Keep Alive, Asynchronous Event Request, properties).
    Never,
    /// A write: resend only when the caller allowed retrying writes.
    Write,
}

/// A command as a caller hands it to a queue.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Request {
    /// The command; the command identifier and data pointer are filled in by the queue.
    pub sqe: Sqe,
    /// Data direction.
    pub dir: DataDir,
    /// Data length in bytes.
    pub len: u32,
    /// Behaviour across a connection loss.
    pub retry: Retry,
    /// Time allowed from submission to completion; `None` for no limit.
    pub timeout: Option<Duration>,
}

/// Counters of one queue: relaxed atomics written only by whoever holds the queue's core (see
/// [`bump`]), read by anyone.
#[derive(Default, Debug)]
pub(crate) struct QueueCounters {
    pub(crate) commands: AtomicU64,
    pub(crate) in_capsule_writes: AtomicU64,
    pub(crate) r2t_writes: AtomicU64,
    pub(crate) r2ts: AtomicU64,
    pub(crate) bytes_read: AtomicU64,
    pub(crate) bytes_written: AtomicU64,
    pub(crate) retries: AtomicU64,
    pub(crate) timeouts: AtomicU64,
    pub(crate) connections: AtomicU64,
    pub(crate) registered_commands: AtomicU64,
    pub(crate) registered_bytes: AtomicU64,
    pub(crate) buffer_registrations: AtomicU64,
    pub(crate) in_place_bytes: AtomicU64,
    pub(crate) lent_commands: AtomicU64,
    pub(crate) kept_reads: AtomicU64,
    pub(crate) data_completions: AtomicU64,
    pub(crate) ring_reads: AtomicU64,
    pub(crate) ring_rejected: AtomicU64,
}

/// Adds `n` to a counter of a queue's core. One writer at a time (the core's holder; the
/// lock or the thread that hands the core on orders the writers), so a load and a store do
/// instead of a locked read-modify-write on the path of every command.
pub(crate) fn bump(a: &AtomicU64, n: u64) {
    a.store(a.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
}

/// Where a read started from a GPU request ring came from: the ring (an index into the queue
/// task's ring table) and its slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RingSlot {
    /// Index of the ring in the queue task's table.
    pub ring: u16,
    /// Slot of the request in that ring.
    pub slot: u32,
}

/// A ring read that ended, with the NVMe status its completion word carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RingDone {
    /// The command identifier it used (free again).
    pub tag: u16,
    /// Where it came from.
    pub origin: RingSlot,
    /// Status field (SCT << 8 | SC; 0: success).
    pub status: u16,
}

/// A command in the table.
pub(crate) struct Cmd {
    /// The command as submitted.
    pub req: Request,
    /// Its data buffer (unused when `direct` is set).
    pub buf: SlotBuf,
    /// Caller-registered memory the data goes to or comes from (instead of `buf`).
    pub direct: Option<Direct>,
    /// The GPU request ring slot that asked for this read (its completion goes there).
    origin: Option<RingSlot>,
    deadline: Option<Instant>,
    sent: bool,
    /// Read data of this command failed its digest (NVMe/TCP): a successful completion
    /// becomes a transient transport error.
    pub digest_error: bool,
    attempts: u8,
}

/// Where the core's completions go: the callers' command slots (a queue task's, shared with
/// its callers), or a list the owner of a [`QueuePair`](crate::QueuePair) reaps.
pub(crate) trait Completions {
    /// Hands command `tag`'s result and buffer back to its caller.
    fn finish(&mut self, tag: u16, result: Result<Cqe, Error>, buf: SlotBuf);
    /// The queue's counters.
    fn counters(&self) -> &QueueCounters;
    /// Whether a read's data may stay in the NVMe/TCP receive buffer it arrived in until its
    /// caller copies it out ([`SlotBuf::Kept`]): where callers copy read data out of the
    /// slot's buffer anyway, this saves a copy.
    fn keeps_read_data(&self) -> bool {
        false
    }
}

/// The link contract as the core sees it: how a command reaches the wire.
pub(crate) trait Wire {
    /// Puts command `tag` on the wire (the link sets the command identifier and the data
    /// pointer, and counts its transport counters). `Err`: the link is broken. `Ok(Err)`:
    /// this command cannot go over this link (its memory cannot be reached, say); the link
    /// is fine and the command fails with that error.
    fn send(
        &mut self,
        tag: u16,
        cmd: &mut Cmd,
        counters: &QueueCounters,
    ) -> Result<Result<(), Error>, Error>;

    /// Forgets the transfer state of command `tag` (the core no longer waits for it).
    fn forget(&mut self, tag: u16);
}

/// What a transport allows; the controller combines it with what the controller reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LinkLimits {
    /// Largest transfer one command may describe (`None`: no limit of the transport's own).
    pub max_transfer: Option<u64>,
    /// Largest write data carried in an I/O command capsule (`None`: as the controller
    /// offers).
    pub max_in_capsule: Option<u32>,
    /// Write data carried in an admin command capsule.
    pub admin_in_capsule: usize,
    /// Whether read data may be received into a buffer the caller lends
    /// ([`ReadDest::lend`](crate::ReadDest::lend)).
    pub lends_buffers: bool,
    /// Whether the controller must support keyed SGL data blocks.
    pub needs_keyed_sgls: bool,
    /// Write data of set-up commands (the Fabrics Connect data) carried in the capsule.
    pub setup_in_capsule: usize,
}

/// A queue's command table and its rules (see the module documentation).
pub(crate) struct Core<C> {
    sink: C,
    addr: String,
    cmds: Vec<Option<Cmd>>,
    /// Commands not sent on the current link (no link, or the window full), in order.
    waiting: VecDeque<u16>,
    /// Commands on the wire at most (the queue's entries less one).
    window: u16,
    /// Commands on the wire now.
    on_wire: u16,
    failed: Option<Error>,
    retry_writes: bool,
    admin: bool,
    /// Ring reads that ended, for the driver to complete in their rings.
    ring_done: Vec<RingDone>,
    /// The time events are handled at (set by the driver before each event).
    pub now: Instant,
}

impl<C: Completions> Core<C> {
    /// A core for `slots` command identifiers of the queue to `addr` (`admin`: queue 0).
    pub fn new(sink: C, addr: String, slots: u16, retry_writes: bool, admin: bool) -> Self {
        Core {
            sink,
            addr,
            cmds: (0..slots).map(|_| None).collect(),
            waiting: VecDeque::with_capacity(usize::from(slots)),
            window: slots,
            on_wire: 0,
            failed: None,
            retry_writes,
            admin,
            ring_done: Vec::with_capacity(usize::from(slots)),
            now: Instant::now(),
        }
    }

    /// Puts at most `window` commands on the wire at once (at most one per identifier, the
    /// default); the others wait their turn in submission order. Set for each link, whose
    /// queue may hold fewer entries after a reconnect.
    pub fn set_window(&mut self, window: u16) {
        let ids = u16::try_from(self.cmds.len()).unwrap_or(u16::MAX);
        self.window = window.clamp(1, ids.max(1));
    }

    /// Commands put on the wire at once, at most.
    pub fn window(&self) -> u16 {
        self.window
    }

    /// Commands on the wire.
    #[cfg(test)]
    pub fn on_wire(&self) -> u16 {
        self.on_wire
    }

    /// The target address (for errors).
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The queue's counters.
    pub fn counters(&self) -> &QueueCounters {
        self.sink.counters()
    }

    /// Whether read data may stay where it was received ([`Completions::keeps_read_data`]).
    pub fn keeps_read_data(&self) -> bool {
        self.sink.keeps_read_data()
    }

    /// Where completions go.
    pub fn sink(&self) -> &C {
        &self.sink
    }

    /// Where completions go.
    pub fn sink_mut(&mut self) -> &mut C {
        &mut self.sink
    }

    /// The error every command gets since [`fail`](Self::fail), if any.
    pub fn failed(&self) -> Option<&Error> {
        self.failed.as_ref()
    }

    /// Command `tag`, if the table holds it.
    pub fn cmd_mut(&mut self, tag: u16) -> Option<&mut Cmd> {
        self.cmds.get_mut(usize::from(tag)).and_then(Option::as_mut)
    }

    /// Command `tag` if the table holds it and it is on the wire.
    pub fn sent_cmd(&self, tag: u16) -> Option<&Cmd> {
        self.cmds
            .get(usize::from(tag))
            .and_then(Option::as_ref)
            .filter(|c| c.sent)
    }

    fn name(&self, req: &Request) -> &'static str {
        command_name(self.admin, req.sqe.opcode, req.sqe.fctype())
    }

    fn retryable(&self, cmd: &Cmd) -> bool {
        match cmd.req.retry {
            Retry::Always => true,
            Retry::Never => false,
            Retry::Write => self.retry_writes,
        }
    }

    /// Completes a command towards its caller (nothing if the table does not hold `tag`).
    pub fn complete(&mut self, tag: u16, result: Result<Cqe, Error>) {
        let Some(cmd) = self.cmds.get_mut(usize::from(tag)).and_then(Option::take) else {
            return;
        };
        if cmd.sent {
            self.on_wire = self.on_wire.saturating_sub(1);
        }
        // Release registered memory before the caller wakes up: it may read the bytes at once.
        drop(cmd.direct);
        self.finish(tag, cmd.origin, result, cmd.buf);
    }

    /// Hands a result to the caller, or to the ring list for a ring read (whose data buffer,
    /// a lent ring slot, is dropped first: the slot is the ring's again).
    fn finish(
        &mut self,
        tag: u16,
        origin: Option<RingSlot>,
        result: Result<Cqe, Error>,
        buf: SlotBuf,
    ) {
        match origin {
            None => self.sink.finish(tag, result, buf),
            Some(origin) => {
                drop(buf);
                self.ring_done.push(RingDone {
                    tag,
                    origin,
                    status: crate::error::ring_status(&result),
                });
            }
        }
    }

    /// Whether ring reads ended since [`take_ring_done`](Self::take_ring_done) was last called.
    pub fn has_ring_done(&self) -> bool {
        !self.ring_done.is_empty()
    }

    /// Moves the ring reads that ended since the last call to `out` (emptied first).
    pub fn take_ring_done(&mut self, out: &mut Vec<RingDone>) {
        out.clear();
        std::mem::swap(out, &mut self.ring_done);
    }

    /// Puts command `tag` on `link`.
    fn send<W: Wire>(&mut self, link: &mut W, tag: u16) -> Result<(), Error> {
        let Some(cmd) = self.cmds.get_mut(usize::from(tag)).and_then(Option::as_mut) else {
            return Ok(());
        };
        let was_sent = cmd.sent;
        let c = self.sink.counters();
        let r = match link.send(tag, cmd, c) {
            Ok(Ok(())) => {
                if cmd.attempts > 0 {
                    bump(&c.retries, 1);
                }
                cmd.sent = true;
                cmd.digest_error = false;
                cmd.attempts = cmd.attempts.saturating_add(1);
                bump(&c.commands, 1);
                Ok(())
            }
            Ok(Err(e)) => {
                self.complete(tag, Err(e));
                return Ok(());
            }
            Err(e) => {
                // Part of it may have reached the wire: the link loss that follows decides
                // whether it is sent again.
                cmd.sent = true;
                cmd.attempts = cmd.attempts.saturating_add(1);
                Err(e)
            }
        };
        if !was_sent {
            self.on_wire += 1;
        }
        r
    }

    /// Sends waiting commands, oldest first, while the window has room. `Err`: the link
    /// broke (what was not sent keeps waiting for the link loss that follows).
    fn send_waiting<W: Wire>(&mut self, link: &mut W) -> Result<(), Error> {
        while self.on_wire < self.window {
            let Some(tag) = self.waiting.pop_front() else {
                break;
            };
            self.send(link, tag)?;
        }
        Ok(())
    }

    /// Event: a caller (or, with `origin`, a GPU request ring) submitted command `tag` (a free
    /// identifier) with its buffer. Sent at once on `link` if there is one, nothing waits
    /// before it and the window has room. `Err`: the link broke.
    pub fn submit<W: Wire>(
        &mut self,
        link: Option<&mut W>,
        tag: u16,
        req: Request,
        buf: SlotBuf,
        direct: Option<Direct>,
        origin: Option<RingSlot>,
    ) -> Result<(), Error> {
        if let Some(e) = &self.failed {
            let e = e.clone();
            self.finish(tag, origin, Err(e), buf);
            return Ok(());
        }
        let Some(entry) = self.cmds.get_mut(usize::from(tag)) else {
            let e = Error::InvalidArgument(format!("internal: command identifier {tag}"));
            self.finish(tag, origin, Err(e), buf);
            return Ok(());
        };
        if matches!(buf, SlotBuf::Lent(_)) {
            bump(&self.sink.counters().lent_commands, 1);
        }
        *entry = Some(Cmd {
            deadline: req.timeout.map(|t| self.now + t),
            req,
            buf,
            direct,
            origin,
            sent: false,
            digest_error: false,
            attempts: 0,
        });
        match link {
            Some(link) if self.waiting.is_empty() && self.on_wire < self.window => {
                self.send(link, tag)
            }
            _ => {
                self.waiting.push_back(tag);
                Ok(())
            }
        }
    }

    /// Event: a completion arrived on `link` for `cqe.cid()`. Completes the command (and sends
    /// the oldest waiting command in its room), or sends it again after a transient transport
    /// error it may be retried on; a completion for a command not on the wire is ignored.
    /// `Err`: the link broke while sending.
    pub fn on_response<W: Wire>(&mut self, link: &mut W, mut cqe: Cqe) -> Result<(), Error> {
        let tag = cqe.cid();
        let Some(cmd) = self.sent_cmd(tag) else {
            return Ok(());
        };
        if cmd.digest_error && cqe.status().is_success() {
            cqe = Cqe::new(tag, Status::generic(generic::TRANSIENT_TRANSPORT_ERROR), 0);
        }
        let st = cqe.status();
        let transient = st.sct == 0 && st.sc == generic::TRANSIENT_TRANSPORT_ERROR && !st.dnr;
        if transient && self.retryable(cmd) && cmd.attempts < MAX_ATTEMPTS {
            link.forget(tag);
            return self.send(link, tag);
        }
        self.complete(tag, Ok(cqe));
        self.send_waiting(link)
    }

    /// Event: the link is gone (`reason`). Commands on the wire that may be resent go back
    /// to the head of the waiting list, in their order; the others fail.
    pub fn link_lost(&mut self, reason: &Error) {
        let mut resend = Vec::new();
        for tag in 0..self.cmds.len() {
            let tag = tag as u16;
            let Some(cmd) = self.cmds[usize::from(tag)].as_ref() else {
                continue;
            };
            if !cmd.sent {
                continue;
            }
            if self.retryable(cmd) && cmd.attempts < MAX_ATTEMPTS {
                if let Some(c) = self.cmds[usize::from(tag)].as_mut() {
                    c.sent = false;
                }
                resend.push(tag);
                continue;
            }
            let name = self.name(&cmd.req);
            let err = if cmd.req.retry == Retry::Write {
                Error::Interrupted {
                    command: name,
                    addr: self.addr.clone(),
                    reason: reason.to_string(),
                }
            } else {
                Error::lost(&self.addr, format!("{name} interrupted: {reason}"))
            };
            self.complete(tag, Err(err));
        }
        for tag in resend.into_iter().rev() {
            self.waiting.push_front(tag);
        }
        // Nothing is on the wire without a link.
        self.on_wire = 0;
    }

    /// Event: a new link is up. Sends what waits, in order, as far as the window goes.
    /// `Err`: the link broke (what was not sent keeps waiting for the link loss that follows).
    pub fn link_restored<W: Wire>(&mut self, link: &mut W) -> Result<(), Error> {
        self.send_waiting(link)
    }

    /// Fails every command now and every later submission with `err`.
    pub fn fail(&mut self, err: Error) {
        self.fail_all(&err);
        self.failed = Some(err);
    }

    /// Fails every command, sent or waiting.
    pub fn fail_all(&mut self, err: &Error) {
        self.waiting.clear();
        for tag in 0..self.cmds.len() {
            self.complete(tag as u16, Err(err.clone()));
        }
    }

    /// Whether a command on the wire is past its deadline at [`now`](Self::now).
    pub fn sent_command_expired(&self) -> bool {
        self.cmds
            .iter()
            .flatten()
            .any(|c| c.sent && c.deadline.is_some_and(|d| d <= self.now))
    }

    /// Event: the timer. Fails the commands whose deadline passed at [`now`](Self::now).
    /// Returns the error of one that was on the wire: the target stopped answering, and the
    /// link must be reset.
    pub fn expire<W: Wire>(&mut self, mut link: Option<&mut W>) -> Option<Error> {
        let now = self.now;
        let mut on_wire: Option<Error> = None;
        for tag in 0..self.cmds.len() {
            let tag = tag as u16;
            let Some(cmd) = self.cmds[usize::from(tag)].as_ref() else {
                continue;
            };
            if cmd.deadline.is_none_or(|d| d > now) {
                continue;
            }
            let err = Error::timeout(self.name(&cmd.req), cmd.req.timeout.unwrap_or_default());
            if cmd.sent {
                if let Some(l) = link.as_deref_mut() {
                    l.forget(tag);
                }
                on_wire.get_or_insert_with(|| err.clone());
            } else {
                self.waiting.retain(|&t| t != tag);
            }
            bump(&self.sink.counters().timeouts, 1);
            self.complete(tag, Err(err));
        }
        on_wire
    }
}

#[cfg(test)]
mod tests {
    //! The core driven by synthetic events: a recording link and recording callers, no
    //! socket.
    use super::*;
    use nvme_spec::command::build;
    use parking_lot::Mutex;
    use std::sync::Arc;

    /// The callers' side: every completion, in order.
    #[derive(Default)]
    struct Callers {
        done: Mutex<Vec<(u16, Result<Cqe, Error>)>>,
        counters: QueueCounters,
    }

    impl Completions for Arc<Callers> {
        fn finish(&mut self, tag: u16, result: Result<Cqe, Error>, _buf: SlotBuf) {
            self.done.lock().push((tag, result));
        }

        fn counters(&self) -> &QueueCounters {
            &self.counters
        }
    }

    impl Callers {
        /// The completions so far, taken.
        fn take(&self) -> Vec<(u16, Result<Cqe, Error>)> {
            std::mem::take(&mut *self.done.lock())
        }
    }

    /// A link that records what the core asks of it.
    #[derive(Default)]
    struct Link {
        sent: Vec<u16>,
        forgotten: Vec<u16>,
        /// Refuse the next command (its memory is out of reach).
        refuse: bool,
        /// The link is broken: every send fails.
        broken: bool,
    }

    impl Wire for Link {
        fn send(
            &mut self,
            tag: u16,
            cmd: &mut Cmd,
            _c: &QueueCounters,
        ) -> Result<Result<(), Error>, Error> {
            assert!(cmd.buf.as_slice().len() >= cmd.req.len as usize);
            if self.broken {
                return Err(Error::lost("t", "broken"));
            }
            if std::mem::take(&mut self.refuse) {
                return Ok(Err(Error::InvalidArgument("refused".into())));
            }
            self.sent.push(tag);
            Ok(Ok(()))
        }

        fn forget(&mut self, tag: u16) {
            self.forgotten.push(tag);
        }
    }

    fn core(retry_writes: bool) -> (Core<Arc<Callers>>, Arc<Callers>) {
        let callers = Arc::new(Callers::default());
        let core = Core::new(Arc::clone(&callers), "t".into(), 8, retry_writes, false);
        (core, callers)
    }

    fn read(timeout: Option<Duration>) -> Request {
        Request {
            sqe: build::read_write(false, 0, 1, 0, 1),
            dir: DataDir::ToHost,
            len: 512,
            retry: Retry::Always,
            timeout,
        }
    }

    fn write() -> Request {
        Request {
            sqe: build::read_write(true, 0, 1, 0, 1),
            dir: DataDir::FromHost,
            len: 512,
            retry: Retry::Write,
            timeout: None,
        }
    }

    fn buf() -> SlotBuf {
        SlotBuf::Heap(vec![0; 512])
    }

    fn ok(tag: u16) -> Cqe {
        Cqe::new(tag, Status::SUCCESS, 0)
    }

    fn submit(core: &mut Core<Arc<Callers>>, link: Option<&mut Link>, tag: u16, req: Request) {
        core.submit(link, tag, req, buf(), None, None).unwrap();
    }

    fn lost() -> Error {
        Error::lost("t", "reset by peer")
    }

    #[test]
    fn response_completes_once_and_unknown_ids_are_ignored() {
        let (mut core, callers) = core(false);
        let mut link = Link::default();
        submit(&mut core, Some(&mut link), 3, read(None));
        assert_eq!(link.sent, [3]);
        // Not in the table, out of range, or already completed: ignored.
        core.on_response(&mut link, ok(4)).unwrap();
        core.on_response(&mut link, ok(999)).unwrap();
        assert!(callers.take().is_empty());
        core.on_response(&mut link, ok(3)).unwrap();
        core.on_response(&mut link, ok(3)).unwrap();
        let done = callers.take();
        assert_eq!(done.len(), 1);
        assert_eq!(done[0].0, 3);
        assert!(done[0].1.as_ref().unwrap().status().is_success());
    }

    #[test]
    fn link_loss_resends_reads_and_fails_writes() {
        let (mut core, callers) = core(false);
        let mut old = Link::default();
        submit(&mut core, Some(&mut old), 0, read(None));
        submit(&mut core, Some(&mut old), 1, write());
        submit(&mut core, Some(&mut old), 2, read(None));
        core.link_lost(&lost());
        let done = callers.take();
        assert_eq!(done.len(), 1);
        assert_eq!(done[0].0, 1);
        assert!(matches!(done[0].1, Err(Error::Interrupted { .. })));
        // Submitted while no link is up: waits behind the commands to resend.
        submit(&mut core, None, 5, read(None));
        let mut new = Link::default();
        core.link_restored(&mut new).unwrap();
        assert_eq!(new.sent, [0, 2, 5]);
        // A late response from the old link for the failed write changes nothing.
        core.on_response(&mut new, ok(1)).unwrap();
        for tag in [5, 0, 2] {
            core.on_response(&mut new, ok(tag)).unwrap();
        }
        let mut tags: Vec<u16> = callers
            .take()
            .into_iter()
            .map(|(t, r)| {
                assert!(r.is_ok());
                t
            })
            .collect();
        tags.sort_unstable();
        assert_eq!(tags, [0, 2, 5]);
        assert_eq!(core.counters().retries.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn commands_beyond_the_window_wait_and_leave_as_responses_make_room() {
        let callers = Arc::new(Callers::default());
        let mut core = Core::new(Arc::clone(&callers), "t".into(), 8, false, false);
        core.set_window(2);
        let mut link = Link::default();
        for tag in 0..5 {
            submit(&mut core, Some(&mut link), tag, read(None));
        }
        assert_eq!(link.sent, [0, 1], "two on the wire, three wait");
        assert_eq!(core.on_wire(), 2);
        // Each response sends the oldest waiting command in its room.
        core.on_response(&mut link, ok(1)).unwrap();
        assert_eq!(link.sent, [0, 1, 2]);
        // A transient error resends in place: it takes no more room.
        let transient = Status::generic(generic::TRANSIENT_TRANSPORT_ERROR);
        core.on_response(&mut link, Cqe::new(0, transient, 0))
            .unwrap();
        assert_eq!(link.sent, [0, 1, 2, 0]);
        assert_eq!(core.on_wire(), 2);
        // A response for a command that is not on the wire makes no room.
        core.on_response(&mut link, ok(4)).unwrap();
        assert_eq!(core.on_wire(), 2);
        assert_eq!(link.sent.len(), 4);
        // The link goes: the two on the wire go back to the head of the line, before the two
        // that never left; the new link's queue holds one command (the controller came back
        // with fewer entries), so they leave one by one.
        core.link_lost(&lost());
        assert_eq!(core.on_wire(), 0);
        core.set_window(1);
        let mut new = Link::default();
        core.link_restored(&mut new).unwrap();
        assert_eq!(new.sent, [0]);
        for (tag, sent) in [(0, 2), (2, 3), (3, 4)] {
            core.on_response(&mut new, ok(tag)).unwrap();
            assert_eq!(new.sent.last(), Some(&sent));
            assert_eq!(core.on_wire(), 1);
        }
        core.on_response(&mut new, ok(4)).unwrap();
        assert_eq!(core.on_wire(), 0);
        let mut done: Vec<u16> = callers.take().into_iter().map(|(t, _)| t).collect();
        done.sort_unstable();
        assert_eq!(done, [0, 1, 2, 3, 4], "each once");
    }

    #[test]
    fn a_refused_command_or_a_timeout_frees_its_room() {
        let callers = Arc::new(Callers::default());
        let mut core = Core::new(Arc::clone(&callers), "t".into(), 8, false, false);
        core.set_window(1);
        let mut link = Link {
            refuse: true,
            ..Link::default()
        };
        // Refused by the link: it never took the room, so the next command leaves at once.
        submit(&mut core, Some(&mut link), 0, read(None));
        assert_eq!(core.on_wire(), 0);
        submit(
            &mut core,
            Some(&mut link),
            1,
            read(Some(Duration::from_millis(10))),
        );
        submit(&mut core, Some(&mut link), 2, read(None));
        assert_eq!(link.sent, [1]);
        // The command on the wire times out: its room is free once the link is reset.
        core.now += Duration::from_millis(20);
        assert!(core.expire(Some(&mut link)).is_some());
        assert_eq!(core.on_wire(), 0);
        core.link_lost(&lost());
        let mut new = Link::default();
        core.link_restored(&mut new).unwrap();
        assert_eq!(new.sent, [2]);
    }

    #[test]
    fn writes_are_resent_when_allowed() {
        let (mut core, callers) = core(true);
        let mut old = Link::default();
        submit(&mut core, Some(&mut old), 1, write());
        core.link_lost(&lost());
        assert!(callers.take().is_empty());
        let mut new = Link::default();
        core.link_restored(&mut new).unwrap();
        assert_eq!(new.sent, [1]);
    }

    #[test]
    fn commands_stop_being_resent_after_max_attempts() {
        let (mut core, callers) = core(false);
        let mut link = Link::default();
        submit(&mut core, Some(&mut link), 0, read(None));
        for _ in 1..MAX_ATTEMPTS {
            core.link_lost(&lost());
            link = Link::default();
            core.link_restored(&mut link).unwrap();
            assert_eq!(link.sent, [0]);
        }
        core.link_lost(&lost());
        let done = callers.take();
        assert_eq!(done.len(), 1);
        assert!(matches!(done[0].1, Err(Error::ConnectionLost { .. })));
    }

    #[test]
    fn transient_transport_errors_are_retried_then_returned() {
        let (mut core, callers) = core(false);
        let mut link = Link::default();
        submit(&mut core, Some(&mut link), 2, read(None));
        let transient = Cqe::new(2, Status::generic(generic::TRANSIENT_TRANSPORT_ERROR), 0);
        for _ in 1..MAX_ATTEMPTS {
            core.on_response(&mut link, transient).unwrap();
        }
        assert_eq!(link.sent.len(), usize::from(MAX_ATTEMPTS));
        assert_eq!(link.forgotten.len(), usize::from(MAX_ATTEMPTS) - 1);
        assert!(callers.take().is_empty());
        core.on_response(&mut link, transient).unwrap();
        let done = callers.take();
        assert_eq!(done.len(), 1);
        let st = done[0].1.as_ref().unwrap().status();
        assert_eq!(st.sc, generic::TRANSIENT_TRANSPORT_ERROR);
        // A write is not retried when writes may not be.
        submit(&mut core, Some(&mut link), 3, write());
        let t3 = Cqe::new(3, Status::generic(generic::TRANSIENT_TRANSPORT_ERROR), 0);
        core.on_response(&mut link, t3).unwrap();
        assert_eq!(callers.take().len(), 1);
    }

    #[test]
    fn digest_error_turns_success_into_a_retry() {
        let (mut core, callers) = core(false);
        let mut link = Link::default();
        submit(&mut core, Some(&mut link), 0, read(None));
        core.cmd_mut(0).unwrap().digest_error = true;
        core.on_response(&mut link, ok(0)).unwrap();
        assert_eq!(link.sent, [0, 0]);
        assert!(callers.take().is_empty());
        // The resend clears the mark.
        core.on_response(&mut link, ok(0)).unwrap();
        assert!(callers.take()[0].1.is_ok());
    }

    #[test]
    fn deadline_on_the_wire_fails_the_command_and_asks_for_a_reset() {
        let (mut core, callers) = core(false);
        let t0 = core.now;
        let mut link = Link::default();
        submit(
            &mut core,
            Some(&mut link),
            4,
            read(Some(Duration::from_secs(1))),
        );
        submit(&mut core, Some(&mut link), 5, read(None));
        core.now = t0 + Duration::from_millis(999);
        assert!(!core.sent_command_expired());
        assert!(core.expire(Some(&mut link)).is_none());
        assert!(callers.take().is_empty());
        core.now = t0 + Duration::from_secs(1);
        assert!(core.sent_command_expired());
        let reset = core.expire(Some(&mut link));
        assert!(matches!(reset, Some(Error::Timeout { .. })));
        assert_eq!(link.forgotten, [4]);
        let done = callers.take();
        assert_eq!(done.len(), 1);
        assert_eq!(done[0].0, 4);
        assert!(matches!(done[0].1, Err(Error::Timeout { .. })));
        // Its late response is ignored; the command without a deadline lives on.
        core.on_response(&mut link, ok(4)).unwrap();
        assert!(callers.take().is_empty());
        core.now = t0 + Duration::from_secs(3600);
        assert!(core.expire(Some(&mut link)).is_none());
        assert!(callers.take().is_empty());
        assert_eq!(core.counters().timeouts.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn deadline_while_waiting_for_a_link_needs_no_reset() {
        let (mut core, callers) = core(false);
        let t0 = core.now;
        submit(&mut core, None, 1, read(Some(Duration::from_secs(1))));
        submit(&mut core, None, 2, read(None));
        core.now = t0 + Duration::from_secs(2);
        assert!(core.expire(None::<&mut Link>).is_none());
        assert_eq!(callers.take().len(), 1);
        let mut link = Link::default();
        core.link_restored(&mut link).unwrap();
        assert_eq!(link.sent, [2]);
    }

    #[test]
    fn a_refused_command_fails_alone_and_a_broken_link_loses_nothing() {
        let (mut core, callers) = core(false);
        let mut link = Link {
            refuse: true,
            ..Link::default()
        };
        submit(&mut core, Some(&mut link), 0, read(None));
        let done = callers.take();
        assert!(matches!(done[..], [(0, Err(Error::InvalidArgument(_)))]));
        // A send that breaks the link: the loss that follows resends the read.
        link.broken = true;
        assert!(
            core.submit(Some(&mut link), 1, read(None), buf(), None, None)
                .is_err()
        );
        core.link_lost(&lost());
        assert!(callers.take().is_empty());
        let mut new = Link::default();
        core.link_restored(&mut new).unwrap();
        assert_eq!(new.sent, [1]);
    }

    #[test]
    fn fail_completes_everything_now_and_later() {
        let (mut core, callers) = core(false);
        let mut link = Link::default();
        submit(&mut core, Some(&mut link), 0, read(None));
        submit(&mut core, None, 1, read(None));
        core.fail(Error::Closed);
        assert_eq!(callers.take().len(), 2);
        submit(&mut core, Some(&mut link), 2, read(None));
        assert!(matches!(callers.take()[..], [(2, Err(Error::Closed))]));
        assert_eq!(link.sent, [0]);
        let mut new = Link::default();
        core.link_restored(&mut new).unwrap();
        assert!(new.sent.is_empty());
    }

    #[test]
    fn ring_reads_end_in_the_ring_list_with_their_status() {
        let (mut core, callers) = core(false);
        let t0 = core.now;
        let mut link = Link::default();
        let origin = |slot| Some(RingSlot { ring: 1, slot });
        let mut done = Vec::new();
        for (tag, slot) in [(0u16, 10u32), (1, 11), (2, 12)] {
            core.submit(
                Some(&mut link),
                tag,
                read(Some(Duration::from_secs(1))),
                buf(),
                None,
                origin(slot),
            )
            .unwrap();
        }
        core.on_response(&mut link, ok(0)).unwrap();
        let bad = Cqe::new(1, Status::generic(generic::LBA_OUT_OF_RANGE), 0);
        core.on_response(&mut link, bad).unwrap();
        // A lost link resends the third; its deadline then fails it.
        core.link_lost(&lost());
        let mut new = Link::default();
        core.link_restored(&mut new).unwrap();
        assert_eq!(new.sent, [2]);
        core.now = t0 + Duration::from_secs(2);
        assert!(core.expire(Some(&mut new)).is_some());
        // A failed queue answers at once.
        core.fail(Error::Closed);
        core.submit(Some(&mut new), 3, read(None), buf(), None, origin(13))
            .unwrap();
        core.take_ring_done(&mut done);
        let got: Vec<(u16, u32, u16)> = done
            .iter()
            .map(|d| (d.tag, d.origin.slot, d.status))
            .collect();
        assert_eq!(
            got,
            [(0, 10, 0), (1, 11, 0x80), (2, 12, 0x371), (3, 13, 0x370)]
        );
        assert!(done.iter().all(|d| d.origin.ring == 1));
        assert!(
            callers.take().is_empty(),
            "ring reads never reach the callers"
        );
        core.take_ring_done(&mut done);
        assert!(done.is_empty());
    }

    /// Whatever the order of events, each command completes exactly once.
    #[test]
    fn every_command_completes_exactly_once() {
        let (mut core, callers) = core(false);
        let t0 = core.now;
        let mut link = Link::default();
        let mut up = true;
        let mut submitted = [0usize; 8];
        for step in 0u32..400 {
            let tag = (step % 8) as u16;
            core.now = t0 + Duration::from_millis(u64::from(step));
            match step.wrapping_mul(2_654_435_761) % 7 {
                0 | 1 => {
                    let req = if step % 3 == 0 {
                        write()
                    } else {
                        read(Some(Duration::from_millis(20)))
                    };
                    if core.cmd_mut(tag).is_none() {
                        core.submit(up.then_some(&mut link), tag, req, buf(), None, None)
                            .unwrap();
                        submitted[usize::from(tag)] += 1;
                    }
                }
                2 | 3 => {
                    let _ = core.on_response(&mut link, ok(tag));
                }
                4 => {
                    core.link_lost(&lost());
                    up = false;
                }
                5 => {
                    link = Link::default();
                    core.link_restored(&mut link).unwrap();
                    up = true;
                }
                _ => {
                    let _ = core.expire(Some(&mut link));
                }
            }
        }
        core.fail(Error::Closed);
        let mut completed = [0usize; 8];
        for (tag, _) in callers.take() {
            completed[usize::from(tag)] += 1;
        }
        // A tag is submitted again only once its command completed, so equal counts mean
        // exactly one completion per command.
        assert!(submitted.iter().all(|&n| n > 1));
        assert_eq!(completed, submitted);
        assert!(core.cmds.iter().all(Option::is_none));
    }
}
