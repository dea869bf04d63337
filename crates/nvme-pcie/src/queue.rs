//! I/O queue pairs: submission with PRPs, batched doorbells, polled completions, timeouts.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use nvme_spec::command::build;
use nvme_spec::opcode::admin;
use nvme_spec::{Sqe, Status};
use zerocopy::little_endian::{U32, U64};

use crate::arena::DmaBuf;
use crate::controller::{Namespace, Shared};
use crate::error::Error;
use crate::prp;
use crate::regs;
use crate::ring::Ring;

/// A finished command.
#[derive(Debug)]
pub struct Completion {
    /// The caller's tag given at submission.
    pub tag: u64,
    /// The data buffer given at submission, handed back now that the device is done with it.
    pub buf: Option<DmaBuf>,
    /// Completion dword 0 on success, or why the command failed.
    pub result: Result<u32, Error>,
}

/// A submission the queue did not take; the buffer comes back with the reason.
#[derive(Debug, thiserror::Error)]
#[error("{error}")]
pub struct Rejected {
    /// Why.
    pub error: Error,
    /// The buffer that was passed in.
    pub buf: Option<DmaBuf>,
}

struct Tracker {
    busy: bool,
    aborted: bool,
    tag: u64,
    buf: Option<DmaBuf>,
    /// Time of the last [`IoQueuePair::check`] before submission (or before the abort).
    since: Instant,
}

/// One I/O submission/completion queue pair, owned by one reactor.
///
/// Submissions only write queue entries; [`IoQueuePair::ring`] makes everything submitted
/// since the last call visible with one SQ tail doorbell write. [`IoQueuePair::poll`] reaps up
/// to a bounded number of completions by phase tag and writes the CQ head doorbell once.
/// [`IoQueuePair::check`], called periodically, detects a failed controller and commands past
/// their timeout (Abort first, controller reset if that does not help).
pub struct IoQueuePair {
    shared: Arc<Shared>,
    qid: u16,
    generation: u64,
    ring: Ring,
    trackers: Vec<Tracker>,
    free: Vec<u16>,
    /// One PRP list page per tracker, indexed by command identifier.
    prp_lists: DmaBuf,
    page: u64,
    max_transfer: u64,
    now: Instant,
    /// Set once the queue no longer exists on the controller.
    dead: Option<Error>,
}

impl std::fmt::Debug for IoQueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IoQueuePair")
            .field("qid", &self.qid)
            .field("size", &self.ring.size())
            .field("outstanding", &self.outstanding())
            .finish()
    }
}

impl IoQueuePair {
    pub(crate) fn create(shared: Arc<Shared>) -> Result<Self, Error> {
        let mut admin = shared.admin.lock();
        if shared.failed.load(Ordering::Acquire) {
            return Err(Error::ControllerFailed);
        }
        let qid = admin
            .take_qid()
            .ok_or(Error::NoQueues(shared.info.io_queues))?;
        let size = shared.config.io_queue_size.min(shared.cap.mqes).min(65536);
        let size = u16::try_from(size).unwrap_or(u16::MAX);
        let page = shared.page;
        let made = (|| {
            let ring = Ring::new(&shared.arena, qid, size, shared.cap.dstrd, page as usize)?;
            let depth = usize::from(size) - 1;
            let prp_lists = shared.arena.alloc(depth * page as usize, page as usize)?;
            let cdw10 = U32::new((u32::from(size) - 1) << 16 | u32::from(qid));
            let mut cq = build::flush(0, 0);
            cq.opcode = admin::CREATE_CQ;
            cq.dptr.address = U64::new(ring.cq.iova());
            cq.cdw10 = cdw10;
            cq.cdw11 = U32::new(1); // physically contiguous, interrupts off
            admin.exec(&shared, cq, false)?;
            let mut sq = build::flush(0, 0);
            sq.opcode = admin::CREATE_SQ;
            sq.dptr.address = U64::new(ring.sq.iova());
            sq.cdw10 = cdw10;
            sq.cdw11 = U32::new(u32::from(qid) << 16 | 1);
            if let Err(e) = admin.exec(&shared, sq, false) {
                let _ = admin.exec(&shared, delete(admin::DELETE_CQ, qid), false);
                return Err(e);
            }
            Ok((ring, prp_lists))
        })();
        let (ring, prp_lists) = match made {
            Ok(v) => v,
            Err(e) => {
                admin.release_qid(qid);
                return Err(e);
            }
        };
        drop(admin);
        let now = Instant::now();
        let depth = usize::from(size) - 1;
        Ok(Self {
            generation: shared.generation.load(Ordering::Acquire),
            max_transfer: shared.info.max_transfer,
            shared,
            qid,
            ring,
            trackers: (0..depth)
                .map(|_| Tracker {
                    busy: false,
                    aborted: false,
                    tag: 0,
                    buf: None,
                    since: now,
                })
                .collect(),
            free: (0..depth as u16).rev().collect(),
            prp_lists,
            page,
            now,
            dead: None,
        })
    }

    /// The queue identifier.
    pub fn qid(&self) -> u16 {
        self.qid
    }

    /// Commands that may be outstanding at once (queue size - 1).
    pub fn depth(&self) -> usize {
        self.trackers.len()
    }

    /// Commands submitted and not yet completed.
    pub fn outstanding(&self) -> usize {
        self.trackers.len() - self.free.len()
    }

    fn live(&mut self) -> Result<(), Error> {
        if self.dead.is_none() && self.shared.generation.load(Ordering::Acquire) != self.generation
        {
            self.dead = Some(if self.shared.failed.load(Ordering::Acquire) {
                Error::ControllerFailed
            } else {
                Error::Reset
            });
        }
        match &self.dead {
            None => Ok(()),
            Some(e) => Err(e.clone()),
        }
    }

    fn submit(&mut self, mut sqe: Sqe, data: Data, tag: u64) -> Result<(), Rejected> {
        let (buf, range) = match data {
            Data::None => (None, None),
            Data::Buf(b, len) => (Some((b, len)), None),
            Data::Range(slba, nlb) => (None, Some((slba, nlb))),
        };
        let reject = |error, buf: Option<(DmaBuf, u64)>| {
            Err(Rejected {
                error,
                buf: buf.map(|(b, _)| b),
            })
        };
        if let Err(e) = self.live() {
            return reject(e, buf);
        }
        if let Some((b, len)) = &buf {
            let len = *len;
            if len > self.max_transfer || len > b.len() as u64 {
                let max = self.max_transfer.min(b.len() as u64);
                return reject(Error::TooLarge { len, max }, buf);
            }
            if b.iova() & 3 != 0 || len == 0 {
                return reject(Error::Misaligned, buf);
            }
        }
        if self.ring.is_full() {
            return reject(Error::QueueFull, buf);
        }
        let Some(cid) = self.free.pop() else {
            return reject(Error::QueueFull, buf);
        };
        sqe.cid = cid.into();
        sqe.flags = 0; // PRPs
        let list_off = usize::from(cid) * self.page as usize;
        let list_iova = self.prp_lists.iova() + list_off as u64;
        if let Some((b, len)) = &buf {
            let lists = &self.prp_lists;
            let (p1, p2) = prp::build(b.iova(), *len, self.page, list_iova, |i, e| {
                lists.write_u64(list_off + i * 8, e.to_le())
            });
            sqe.dptr.address = U64::new(p1);
            sqe.dptr.body[..7].copy_from_slice(&p2.to_le_bytes()[..7]);
            sqe.dptr.identifier = (p2 >> 56) as u8;
        }
        if let Some((slba, nlb)) = range {
            // One Dataset Management range (context attributes, length in blocks, starting
            // LBA) in this command's PRP list page: nothing to allocate.
            self.prp_lists
                .write_u64(list_off, (u64::from(nlb) << 32).to_le());
            self.prp_lists.write_u64(list_off + 8, slba.to_le());
            sqe.dptr.address = U64::new(list_iova);
        }
        let t = &mut self.trackers[usize::from(cid)];
        t.busy = true;
        t.aborted = false;
        t.tag = tag;
        t.buf = buf.map(|(b, _)| b);
        t.since = self.now;
        self.ring.push(&sqe);
        Ok(())
    }

    /// Queues a read of `nlb` blocks at `slba` of `ns` into `buf` (at least `nlb` blocks
    /// long, 4-byte aligned). The command starts after the next [`IoQueuePair::ring`].
    pub fn read(
        &mut self,
        ns: &Namespace,
        slba: u64,
        nlb: u32,
        buf: DmaBuf,
        tag: u64,
    ) -> Result<(), Rejected> {
        self.read_write(Rw::Read, ns, slba, nlb, buf, tag)
    }

    /// Queues a write of `nlb` blocks at `slba` of `ns` from `buf`.
    pub fn write(
        &mut self,
        ns: &Namespace,
        slba: u64,
        nlb: u32,
        buf: DmaBuf,
        tag: u64,
    ) -> Result<(), Rejected> {
        self.read_write(Rw::Write, ns, slba, nlb, buf, tag)
    }

    /// Queues a write with Force Unit Access: it completes once the data is in non-volatile
    /// media, without flushing anything else.
    pub fn write_fua(
        &mut self,
        ns: &Namespace,
        slba: u64,
        nlb: u32,
        buf: DmaBuf,
        tag: u64,
    ) -> Result<(), Rejected> {
        self.read_write(Rw::WriteFua, ns, slba, nlb, buf, tag)
    }

    fn read_write(
        &mut self,
        rw: Rw,
        ns: &Namespace,
        slba: u64,
        nlb: u32,
        buf: DmaBuf,
        tag: u64,
    ) -> Result<(), Rejected> {
        if let Err(mut r) = check_blocks(nlb, 65536) {
            r.buf = Some(buf);
            return Err(r);
        }
        let len = u64::from(nlb) * u64::from(ns.block_size);
        let sqe = match rw {
            Rw::Read => build::read_write(false, 0, ns.nsid, slba, nlb),
            Rw::Write => build::read_write(true, 0, ns.nsid, slba, nlb),
            Rw::WriteFua => build::write_fua(0, ns.nsid, slba, nlb),
        };
        self.submit(sqe, Data::Buf(buf, len), tag)
    }

    /// Queues a Write Zeroes of `nlb` blocks (1..=65536) at `slba` of `ns` (no data moves;
    /// check [`ControllerInfo::supports_write_zeroes`](crate::ControllerInfo) first).
    pub fn write_zeroes(
        &mut self,
        ns: &Namespace,
        slba: u64,
        nlb: u32,
        tag: u64,
    ) -> Result<(), Rejected> {
        check_blocks(nlb, 65536)?;
        let sqe = build::write_zeroes(0, ns.nsid, slba, nlb, false);
        self.submit(sqe, Data::None, tag)
    }

    /// Queues a Dataset Management Deallocate of one range: `nlb` blocks (at least 1) at
    /// `slba` of `ns`. The range goes in the command's own PRP list page, so nothing is
    /// allocated (check [`ControllerInfo::supports_deallocate`](crate::ControllerInfo) first).
    pub fn deallocate(
        &mut self,
        ns: &Namespace,
        slba: u64,
        nlb: u32,
        tag: u64,
    ) -> Result<(), Rejected> {
        check_blocks(nlb, u32::MAX)?;
        let sqe = build::deallocate(0, ns.nsid, 1);
        self.submit(sqe, Data::Range(slba, nlb), tag)
    }

    /// Queues a Flush of `ns`.
    pub fn flush(&mut self, ns: &Namespace, tag: u64) -> Result<(), Rejected> {
        self.submit(build::flush(0, ns.nsid), Data::None, tag)
    }

    /// Makes every command queued since the last call visible to the controller with one SQ
    /// tail doorbell write. Returns whether a doorbell was written.
    pub fn ring(&mut self) -> bool {
        if self.live().is_err() {
            return false;
        }
        self.ring.ring(&*self.shared.dev)
    }

    /// Reaps at most `max` completion queue entries, calling `done` for each completed
    /// command, and writes the CQ head doorbell once if any were reaped. Returns the number of
    /// commands completed. If the controller was reset or failed, every
    /// outstanding command completes here with [`Error::Reset`] or [`Error::ControllerFailed`].
    #[inline]
    pub fn poll(&mut self, max: usize, mut done: impl FnMut(Completion)) -> usize {
        if let Err(e) = self.live() {
            return self.fail_all(&e, &mut done);
        }
        let mut n = 0;
        let mut reaped = 0;
        while reaped < max {
            let Some(cqe) = self.ring.next_cqe() else {
                break;
            };
            reaped += 1;
            let cid = cqe.cid();
            let Some(t) = self.trackers.get_mut(usize::from(cid)).filter(|t| t.busy) else {
                // A completion for no outstanding command (a controller bug): consumed and
                // counted against `max`, so a misbehaving device cannot keep this loop going.
                continue;
            };
            t.busy = false;
            let status = cqe.status();
            let result = if status.is_success() {
                Ok(cqe.dw0.get())
            } else {
                Err(Error::Status(status))
            };
            done(Completion {
                tag: t.tag,
                buf: t.buf.take(),
                result,
            });
            self.free.push(cid);
            n += 1;
        }
        if reaped > 0 {
            self.ring.ack(&*self.shared.dev);
        }
        n
    }

    fn fail_all(&mut self, e: &Error, done: &mut impl FnMut(Completion)) -> usize {
        let mut n = 0;
        for (cid, t) in self.trackers.iter_mut().enumerate() {
            if t.busy {
                t.busy = false;
                done(Completion {
                    tag: t.tag,
                    buf: t.buf.take(),
                    result: Err(e.clone()),
                });
                self.free.push(cid as u16);
                n += 1;
            }
        }
        n
    }

    /// Periodic health check, for the reactor to call every few milliseconds with the current
    /// time (the hot path never reads the clock: command ages are measured from the check
    /// before their submission, so a timeout fires within one check interval of
    /// `Config::io_timeout`).
    ///
    /// Reads CSTS: a fatal status (or a vanished device) disables the controller and fails
    /// every command. A command past its timeout is aborted with an admin Abort; if it is still
    /// outstanding one timeout later (or the Abort itself fails), the controller is reset.
    /// Commands failed either way are delivered by the next [`IoQueuePair::poll`].
    pub fn check(&mut self, now: Instant) {
        self.now = now;
        if self.live().is_err() {
            return;
        }
        let csts = self.shared.dev.read32(regs::CSTS);
        if csts == u32::MAX || csts & regs::CSTS_CFS != 0 {
            let _admin = self.shared.admin.lock();
            if self.shared.generation.load(Ordering::Acquire) == self.generation {
                self.shared.fail_locked();
            }
            return;
        }
        let timeout = self.shared.config.io_timeout;
        let expired = |t: &Tracker| t.busy && now.saturating_duration_since(t.since) >= timeout;
        if !self.trackers.iter().any(expired) {
            return;
        }
        let mut admin = self.shared.admin.lock();
        if self.shared.generation.load(Ordering::Acquire) != self.generation {
            return;
        }
        let mut reset = false;
        for (cid, t) in self.trackers.iter_mut().enumerate() {
            if !expired(t) {
                continue;
            }
            if t.aborted {
                reset = true;
                break;
            }
            t.aborted = true;
            t.since = now;
            let abort = build::abort(0, self.qid, cid as u16);
            match admin.exec(&self.shared, abort, false) {
                // Refused (e.g. Abort Command Limit Exceeded): the command is reset with the
                // controller if it is still outstanding one timeout from now.
                Ok(_) | Err(Error::Status(_)) => {}
                // The admin timeout already reset the controller, or the controller failed.
                Err(_) => return,
            }
        }
        if reset {
            let _ = self.shared.reset_locked(&mut admin);
        }
    }

    /// How long commands may take ([`crate::Config::io_timeout`]).
    pub fn timeout(&self) -> Duration {
        self.shared.config.io_timeout
    }
}

/// A data transfer's direction.
enum Rw {
    Read,
    Write,
    WriteFua,
}

/// What a command transfers.
enum Data {
    None,
    /// A data buffer and the bytes the command moves.
    Buf(DmaBuf, u64),
    /// One Dataset Management range: starting LBA and blocks.
    Range(u64, u32),
}

/// Refuses a block count of 0 or above `max`.
fn check_blocks(nlb: u32, max: u32) -> Result<(), Rejected> {
    if nlb == 0 || nlb > max {
        return Err(Rejected {
            error: Error::TooLarge {
                len: u64::from(nlb),
                max: u64::from(max),
            },
            buf: None,
        });
    }
    Ok(())
}

fn delete(opcode: u8, qid: u16) -> Sqe {
    let mut sqe = build::flush(0, 0);
    sqe.opcode = opcode;
    sqe.cdw10 = U32::new(u32::from(qid));
    sqe
}

impl Drop for IoQueuePair {
    fn drop(&mut self) {
        let mut admin = self.shared.admin.lock();
        if self.shared.generation.load(Ordering::Acquire) != self.generation {
            // The queue no longer exists on the controller (reset or failure).
            admin.release_qid(self.qid);
            return;
        }
        // Deleting the SQ aborts what it still holds; the buffers are dropped after that.
        let sq = admin.exec(&self.shared, delete(admin::DELETE_SQ, self.qid), false);
        let cq =
            sq.and_then(|_| admin.exec(&self.shared, delete(admin::DELETE_CQ, self.qid), false));
        // A queue the controller refused to delete keeps its identifier until the next reset.
        if cq.is_ok() {
            admin.release_qid(self.qid);
        }
    }
}

/// The status an aborted command completes with.
pub const ABORTED: Status = Status::generic(nvme_spec::status::generic::ABORT_REQUESTED);
