//! An in-memory NVMe controller behind the [`Device`] seam, for tests and benchmarks without
//! hardware.
//!
//! It enforces what QEMU's emulated controller checks when it is enabled (admin queue
//! attributes and page-aligned base addresses, the command set, MPS within CAP, IOSQES = 6 and
//! IOCQES = 4; a violation sets CSTS.CFS, as QEMU does), processes doorbell writes
//! synchronously (an SQ tail write executes the new entries before it returns), walks PRPs
//! with [`crate::prp::walk`] and rejects bad ones with the status a controller uses, executes
//! Identify (controller, namespace, active namespace list), Set Features Number of Queues,
//! Create/Delete I/O SQ/CQ, Abort, and Read/Write/Flush (and Write Zeroes and Dataset
//! Management Deallocate where [`ModelConfig::oncs`] has them) on one in-memory namespace, and posts
//! completions with the right phase tag, holding them back while a completion queue is full.
//!
//! Faults can be injected ([`Fault`]): error statuses, lost completions (the command is taken
//! but never completed, until an Abort for it arrives), a controller that ignores its
//! doorbells, one that reports a fatal status, and one that never becomes ready.

use nvme_spec::command::cns;
use nvme_spec::identify::{IdentifyController, IdentifyNamespace, put_ascii_padded};
use nvme_spec::opcode::{admin, io};
use nvme_spec::status::{generic, specific};
use nvme_spec::{IntoBytes, Sqe, Status};
use parking_lot::Mutex;

use crate::arena::DmaWindow;
use crate::error::DeviceError;
use crate::prp::{self, PRP_OFFSET_INVALID};
use crate::regs::{self, Cap, Device};

/// Command specific status "Invalid Queue Deletion" (NVMe Base 2.0, Figure 147).
const INVALID_QUEUE_DELETION: u8 = 0x0C;

/// What the model looks like.
#[derive(Clone, Debug)]
pub struct ModelConfig {
    /// Maximum entries per queue (CAP.MQES as a count).
    pub mqes: u32,
    /// CAP.TO in 500 ms units.
    pub to: u8,
    /// CAP.DSTRD.
    pub dstrd: u8,
    /// CAP.MPSMIN.
    pub mpsmin: u8,
    /// CAP.MPSMAX.
    pub mpsmax: u8,
    /// Identify MDTS (in units of the minimum page size; 0 = no limit).
    pub mdts: u8,
    /// I/O queue pairs the controller supports.
    pub max_queues: u16,
    /// Logical block size of namespace 1 (512 or 4096).
    pub block_size: u32,
    /// Namespace 1 size in blocks.
    pub blocks: u64,
    /// Complete reads and writes without walking PRPs or moving data (for measuring the
    /// driver alone).
    pub discard_data: bool,
    /// Identify ONCS: Write Zeroes and Dataset Management are executed only when their bit is
    /// set (otherwise Invalid Opcode).
    pub oncs: u16,
    /// Identify VWC bit 0: a volatile write cache is present.
    pub volatile_write_cache: bool,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            mqes: 1024,
            to: 2,
            dstrd: 0,
            mpsmin: 0,
            mpsmax: 4,
            mdts: 5,
            max_queues: 8,
            block_size: 512,
            blocks: 8192,
            discard_data: false,
            oncs: nvme_spec::identify::ONCS_WRITE_ZEROES | nvme_spec::identify::ONCS_DSM,
            volatile_write_cache: true,
        }
    }
}

/// A fault to inject.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The next command with `opcode` (on the admin queue if `admin`, else on any I/O queue)
    /// completes with `status` instead of executing.
    Status {
        /// Admin or I/O queue.
        admin: bool,
        /// Opcode to match.
        opcode: u8,
        /// Status to complete it with.
        status: Status,
    },
    /// The next command with `opcode` is taken from the queue but not completed until an
    /// Abort names it.
    Lose {
        /// Admin or I/O queue.
        admin: bool,
        /// Opcode to match.
        opcode: u8,
    },
    /// From now on doorbell writes are ignored: the controller stops without telling.
    Hang,
    /// The controller sets CSTS.CFS and stops, until it is disabled.
    Fatal,
    /// The next enable (CC.EN 0 -> 1) never sets CSTS.RDY.
    NeverReady,
}

/// Doorbell writes seen for one queue identifier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Doorbells {
    /// SQ tail doorbell writes.
    pub sq_tail: u64,
    /// CQ head doorbell writes.
    pub cq_head: u64,
}

#[derive(Clone, Copy, Debug)]
struct Sq {
    base: u64,
    size: u16,
    head: u16,
    tail: u16,
    cqid: u16,
}

#[derive(Clone, Copy, Debug)]
struct Cq {
    base: u64,
    size: u16,
    head: u16,
    tail: u16,
    phase: bool,
}

struct Inner {
    cfg: ModelConfig,
    cc: u32,
    csts: u32,
    aqa: u32,
    asq: u64,
    acq: u64,
    page: u64,
    window: Option<DmaWindow>,
    sqs: Vec<Option<Sq>>,
    cqs: Vec<Option<Cq>>,
    data: Vec<u8>,
    faults: Vec<Fault>,
    hung: bool,
    never_ready: bool,
    /// Commands taken but not completed: (sqid, cid).
    lost: Vec<(u16, u16)>,
    doorbells: Vec<Doorbells>,
    bad_doorbells: u64,
    /// I/O commands executed, by opcode.
    io_commands: Vec<u64>,
    /// Writes executed with Force Unit Access.
    fua_writes: u64,
}

/// The in-memory controller. Share it as `Arc<ModelController>`: the driver gets one clone as
/// its [`Device`], the test keeps another to inject faults and read counters.
pub struct ModelController {
    inner: Mutex<Inner>,
    cap: u64,
}

impl std::fmt::Debug for ModelController {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelController").finish_non_exhaustive()
    }
}

type Outcome = Option<(Status, u32)>;

fn ok(dw0: u32) -> Outcome {
    Some((Status::SUCCESS, dw0))
}

fn fail(status: Status) -> Outcome {
    Some((status.with_dnr(), 0))
}

fn prp2(sqe: &Sqe) -> u64 {
    let mut b = [0u8; 8];
    b[..7].copy_from_slice(&sqe.dptr.body);
    b[7] = sqe.dptr.identifier;
    u64::from_le_bytes(b)
}

impl ModelController {
    /// A controller with one namespace (NSID 1) of zeroed blocks.
    pub fn new(cfg: ModelConfig) -> Self {
        let cap = Cap {
            mqes: cfg.mqes,
            cqr: true,
            to: cfg.to,
            dstrd: cfg.dstrd,
            css_nvm: true,
            mpsmin: cfg.mpsmin,
            mpsmax: cfg.mpsmax,
        }
        .to_raw();
        let data = if cfg.discard_data {
            Vec::new()
        } else {
            vec![0; (cfg.blocks * u64::from(cfg.block_size)) as usize]
        };
        let queues = usize::from(cfg.max_queues) + 1;
        Self {
            cap,
            inner: Mutex::new(Inner {
                cc: 0,
                csts: 0,
                aqa: 0,
                asq: 0,
                acq: 0,
                page: 4096,
                window: None,
                sqs: vec![None; queues],
                cqs: vec![None; queues],
                data,
                faults: Vec::new(),
                hung: false,
                never_ready: false,
                lost: Vec::new(),
                doorbells: vec![Doorbells::default(); queues],
                bad_doorbells: 0,
                io_commands: vec![0; 256],
                fua_writes: 0,
                cfg,
            }),
        }
    }

    /// Injects a fault (see [`Fault`]).
    pub fn inject(&self, fault: Fault) {
        let mut s = self.inner.lock();
        match fault {
            Fault::Hang => s.hung = true,
            Fault::Fatal => {
                s.csts |= regs::CSTS_CFS;
                s.hung = true;
            }
            Fault::NeverReady => s.never_ready = true,
            other => s.faults.push(other),
        }
    }

    /// Doorbell writes seen for queue `qid`.
    pub fn doorbells(&self, qid: u16) -> Doorbells {
        self.inner
            .lock()
            .doorbells
            .get(usize::from(qid))
            .copied()
            .unwrap_or_default()
    }

    /// Doorbell writes that named no queue or carried an out-of-range value.
    pub fn bad_doorbells(&self) -> u64 {
        self.inner.lock().bad_doorbells
    }

    /// Commands taken but not completed (lost completions not yet aborted).
    pub fn lost(&self) -> usize {
        self.inner.lock().lost.len()
    }

    /// Writes executed with Force Unit Access (CDW12 bit 30).
    pub fn fua_writes(&self) -> u64 {
        self.inner.lock().fua_writes
    }

    /// I/O commands with `opcode` executed (not counting those an injected fault consumed).
    pub fn io_commands(&self, opcode: u8) -> u64 {
        self.inner.lock().io_commands[usize::from(opcode)]
    }

    /// Existing I/O submission queues.
    pub fn io_queues(&self) -> usize {
        self.inner.lock().sqs.iter().skip(1).flatten().count()
    }

    /// Reads namespace bytes directly (to check what writes stored). Panics if the range is
    /// outside the namespace or the model discards data.
    pub fn read_media(&self, offset: usize, dst: &mut [u8]) {
        let s = self.inner.lock();
        dst.copy_from_slice(&s.data[offset..offset + dst.len()]);
    }

    /// Writes namespace bytes directly (to seed data for reads). Panics if the range is
    /// outside the namespace or the model discards data.
    pub fn write_media(&self, offset: usize, src: &[u8]) {
        let mut s = self.inner.lock();
        s.data[offset..offset + src.len()].copy_from_slice(src);
    }
}

impl Inner {
    fn reset(&mut self) {
        self.sqs.iter_mut().for_each(|q| *q = None);
        self.cqs.iter_mut().for_each(|q| *q = None);
        self.lost.clear();
        self.hung = false;
        self.csts = 0;
    }

    /// The checks QEMU's controller makes when it is enabled.
    fn start(&mut self, cap: &Cap, cc: u32) -> bool {
        let mps = ((cc >> 7) & 0xF) as u8;
        let page = 4096u64 << mps;
        let (asqs, acqs) = (self.aqa & 0xFFF, (self.aqa >> 16) & 0xFFF);
        let valid = self.asq != 0
            && self.acq != 0
            && self.asq & (page - 1) == 0
            && self.acq & (page - 1) == 0
            && (cc >> 4) & 0x7 == 0
            && (cap.mpsmin..=cap.mpsmax).contains(&mps)
            && (cc >> 16) & 0xF == 6
            && (cc >> 20) & 0xF == 4
            && asqs != 0
            && acqs != 0
            && self.window.is_some();
        if !valid {
            return false;
        }
        self.page = page;
        self.cqs[0] = Some(Cq {
            base: self.acq,
            size: acqs as u16 + 1,
            head: 0,
            tail: 0,
            phase: true,
        });
        self.sqs[0] = Some(Sq {
            base: self.asq,
            size: asqs as u16 + 1,
            head: 0,
            tail: 0,
            cqid: 0,
        });
        true
    }

    fn write_cc(&mut self, cap: &Cap, cc: u32) {
        let was = self.cc & regs::CC_EN != 0;
        let now = cc & regs::CC_EN != 0;
        self.cc = cc;
        if was && !now {
            self.reset();
            return;
        }
        if !was && now {
            if std::mem::take(&mut self.never_ready) {
                return;
            }
            if self.start(cap, cc) {
                self.csts = regs::CSTS_RDY;
            } else {
                self.csts = regs::CSTS_CFS;
            }
            return;
        }
        if now && cc & regs::CC_SHN_MASK != 0 && self.csts & regs::CSTS_CFS == 0 {
            self.csts = (self.csts & !regs::CSTS_SHST_MASK) | regs::CSTS_SHST_COMPLETE;
        }
    }

    fn doorbell(&mut self, offset: u32, value: u32) {
        let stride = 4u32 << self.cfg.dstrd;
        let rel = offset - regs::DOORBELL_BASE;
        let idx = rel / stride;
        let qid = (idx / 2) as usize;
        let is_cq = idx % 2 == 1;
        if self.hung || self.csts & regs::CSTS_RDY == 0 || rel % stride != 0 {
            return;
        }
        let size = if is_cq {
            self.cqs.get(qid).copied().flatten().map(|q| q.size)
        } else {
            self.sqs.get(qid).copied().flatten().map(|q| q.size)
        };
        match size {
            Some(size) if value < u32::from(size) => {}
            _ => {
                self.bad_doorbells += 1;
                return;
            }
        }
        let value = value as u16;
        if is_cq {
            self.doorbells[qid].cq_head += 1;
            if let Some(cq) = self.cqs[qid].as_mut() {
                cq.head = value;
            }
            for sqid in 0..self.sqs.len() {
                if self.sqs[sqid].is_some_and(|s| usize::from(s.cqid) == qid) {
                    self.process(sqid as u16);
                }
            }
        } else {
            self.doorbells[qid].sq_tail += 1;
            if let Some(sq) = self.sqs[qid].as_mut() {
                sq.tail = value;
            }
            self.process(qid as u16);
        }
    }

    fn process(&mut self, sqid: u16) {
        let Some(window) = self.window.clone() else {
            return;
        };
        loop {
            if self.hung {
                return;
            }
            let Some(sq) = self.sqs[usize::from(sqid)] else {
                return;
            };
            let Some(cq) = self.cqs[usize::from(sq.cqid)] else {
                return;
            };
            if sq.head == sq.tail || (cq.tail + 1) % cq.size == cq.head {
                return;
            }
            let mut raw = [0u8; 64];
            if !window.read(sq.base + u64::from(sq.head) * 64, &mut raw) {
                self.csts |= regs::CSTS_CFS;
                self.hung = true;
                return;
            }
            let sqe = Sqe::from_array(&raw);
            let head = (sq.head + 1) % sq.size;
            if let Some(s) = self.sqs[usize::from(sqid)].as_mut() {
                s.head = head;
            }
            let outcome = self.execute(&window, sqid, &sqe);
            if let Some((status, dw0)) = outcome {
                self.post(&window, sqid, sqe.cid(), status, dw0);
            } else {
                self.lost.push((sqid, sqe.cid()));
            }
        }
    }

    /// Posts a completion for `cid` of `sqid` on its completion queue.
    fn post(&mut self, window: &DmaWindow, sqid: u16, cid: u16, status: Status, dw0: u32) {
        let Some(sq) = self.sqs[usize::from(sqid)] else {
            return;
        };
        let Some(cq) = self.cqs[usize::from(sq.cqid)].as_mut() else {
            return;
        };
        let at = cq.base + u64::from(cq.tail) * 16;
        let dw3 =
            u32::from(cid) | (u32::from(status.to_field()) << 17) | (u32::from(cq.phase) << 16);
        let ok = window.write_u32(at, dw0)
            && window.write_u32(at + 4, 0)
            && window.write_u32(at + 8, u32::from(sq.head) | (u32::from(sqid) << 16))
            && window.write_u32(at + 12, dw3);
        cq.tail = (cq.tail + 1) % cq.size;
        if cq.tail == 0 {
            cq.phase = !cq.phase;
        }
        if !ok {
            self.csts |= regs::CSTS_CFS;
            self.hung = true;
        }
    }

    fn take_fault(&mut self, admin: bool, opcode: u8) -> Option<Fault> {
        let i = self.faults.iter().position(|f| match *f {
            Fault::Status {
                admin: a,
                opcode: o,
                ..
            }
            | Fault::Lose {
                admin: a,
                opcode: o,
            } => a == admin && o == opcode,
            _ => false,
        })?;
        Some(self.faults.remove(i))
    }

    fn execute(&mut self, window: &DmaWindow, sqid: u16, sqe: &Sqe) -> Outcome {
        match self.take_fault(sqid == 0, sqe.opcode) {
            Some(Fault::Status { status, .. }) => return Some((status, 0)),
            Some(Fault::Lose { .. }) => return None,
            _ => {}
        }
        if sqe.psdt() != 0 {
            return fail(Status::generic(generic::INVALID_FIELD));
        }
        if sqid == 0 {
            self.admin(window, sqe)
        } else {
            self.io_commands[usize::from(sqe.opcode)] += 1;
            if sqe.opcode == io::WRITE && sqe.cdw12.get() & (1 << 30) != 0 {
                self.fua_writes += 1;
            }
            self.io(window, sqe)
        }
    }

    /// Moves `len` bytes between `buf` (at `at`) and the memory the command's PRPs describe.
    fn transfer(
        &self,
        window: &DmaWindow,
        sqe: &Sqe,
        len: u64,
        to_host: bool,
        buf: &mut [u8],
    ) -> Result<(), Status> {
        let segs = prp::walk(window, sqe.dptr.address.get(), prp2(sqe), len, self.page)?;
        let mut at = 0usize;
        for (iova, n) in segs {
            let n = n as usize;
            let chunk = &mut buf[at..at + n];
            let moved = if to_host {
                window.write(iova, chunk)
            } else {
                window.read(iova, chunk)
            };
            if !moved {
                return Err(Status::generic(generic::DATA_TRANSFER_ERROR).with_dnr());
            }
            at += n;
        }
        Ok(())
    }

    fn to_host(&self, window: &DmaWindow, sqe: &Sqe, mut data: Vec<u8>) -> Outcome {
        match self.transfer(window, sqe, data.len() as u64, true, &mut data) {
            Ok(()) => ok(0),
            Err(s) => Some((s, 0)),
        }
    }

    fn admin(&mut self, window: &DmaWindow, sqe: &Sqe) -> Outcome {
        let cdw10 = sqe.cdw10.get();
        let cdw11 = sqe.cdw11.get();
        let qid = (cdw10 & 0xFFFF) as u16;
        let qsize = (cdw10 >> 16) + 1;
        let max_q = self.cfg.max_queues;
        match sqe.opcode {
            admin::IDENTIFY => match (cdw10 & 0xFF) as u8 {
                cns::CONTROLLER => {
                    let mut id = IdentifyController::zeroed();
                    id.vid = 0x1b36.into();
                    put_ascii_padded(&mut id.sn, "MODEL0001");
                    put_ascii_padded(&mut id.mn, "nvme-pcie model");
                    put_ascii_padded(&mut id.fr, "1.0");
                    id.mdts = self.cfg.mdts;
                    id.ver = 0x0001_0400.into();
                    id.sqes = 0x66;
                    id.cqes = 0x44;
                    id.nn = 1.into();
                    id.oncs = self.cfg.oncs.into();
                    id.vwc = u8::from(self.cfg.volatile_write_cache);
                    self.to_host(window, sqe, id.as_bytes().to_vec())
                }
                cns::NAMESPACE => {
                    if sqe.nsid.get() != 1 {
                        return fail(Status::generic(generic::INVALID_NAMESPACE));
                    }
                    let mut ns = IdentifyNamespace::zeroed();
                    ns.nsze = self.cfg.blocks.into();
                    ns.ncap = self.cfg.blocks.into();
                    ns.nuse = self.cfg.blocks.into();
                    ns.lbaf[0].lbads = self.cfg.block_size.trailing_zeros() as u8;
                    self.to_host(window, sqe, ns.as_bytes().to_vec())
                }
                cns::ACTIVE_NS_LIST => {
                    let mut list = vec![0u8; 4096];
                    if sqe.nsid.get() < 1 {
                        list[..4].copy_from_slice(&1u32.to_le_bytes());
                    }
                    self.to_host(window, sqe, list)
                }
                _ => fail(Status::generic(generic::INVALID_FIELD)),
            },
            admin::SET_FEATURES => {
                if (cdw10 & 0xFF) as u8 != nvme_spec::features::NUMBER_OF_QUEUES
                    || cdw11 & 0xFFFF == 0xFFFF
                    || cdw11 >> 16 == 0xFFFF
                {
                    return fail(Status::generic(generic::INVALID_FIELD));
                }
                let n = u32::from(max_q) - 1;
                ok(n | (n << 16))
            }
            admin::CREATE_CQ | admin::CREATE_SQ => {
                let cq = sqe.opcode == admin::CREATE_CQ;
                let exists = if cq {
                    self.cqs.get(usize::from(qid)).is_some_and(Option::is_some)
                } else {
                    self.sqs.get(usize::from(qid)).is_some_and(Option::is_some)
                };
                let base = sqe.dptr.address.get();
                if qid == 0 || qid > max_q || exists {
                    return fail(Status::specific(specific::INVALID_QUEUE_ID));
                }
                if qsize < 2 || qsize > self.cfg.mqes {
                    return fail(Status::specific(specific::INVALID_QUEUE_SIZE));
                }
                if base == 0 || base & (self.page - 1) != 0 {
                    return fail(Status::generic(PRP_OFFSET_INVALID));
                }
                if cdw11 & 1 == 0 {
                    return fail(Status::generic(generic::INVALID_FIELD));
                }
                let size = qsize as u16;
                if cq {
                    if cdw11 & 0b10 != 0 {
                        // Interrupts are not modelled; a polled driver never asks.
                        return fail(Status::generic(generic::INVALID_FIELD));
                    }
                    self.cqs[usize::from(qid)] = Some(Cq {
                        base,
                        size,
                        head: 0,
                        tail: 0,
                        phase: true,
                    });
                } else {
                    let cqid = (cdw11 >> 16) as u16;
                    if cqid == 0 || !self.cqs.get(usize::from(cqid)).is_some_and(Option::is_some) {
                        return fail(Status::specific(specific::CQ_INVALID));
                    }
                    self.sqs[usize::from(qid)] = Some(Sq {
                        base,
                        size,
                        head: 0,
                        tail: 0,
                        cqid,
                    });
                }
                ok(0)
            }
            admin::DELETE_SQ => {
                if qid == 0 || !self.sqs.get(usize::from(qid)).is_some_and(Option::is_some) {
                    return fail(Status::specific(specific::INVALID_QUEUE_ID));
                }
                self.sqs[usize::from(qid)] = None;
                self.lost.retain(|&(s, _)| s != qid);
                ok(0)
            }
            admin::DELETE_CQ => {
                if qid == 0 || !self.cqs.get(usize::from(qid)).is_some_and(Option::is_some) {
                    return fail(Status::specific(specific::INVALID_QUEUE_ID));
                }
                if self.sqs.iter().flatten().any(|s| s.cqid == qid) {
                    return fail(Status::specific(INVALID_QUEUE_DELETION));
                }
                self.cqs[usize::from(qid)] = None;
                ok(0)
            }
            admin::ABORT => {
                let cid = (cdw10 >> 16) as u16;
                match self.lost.iter().position(|&l| l == (qid, cid)) {
                    Some(i) => {
                        self.lost.remove(i);
                        let aborted = Status::generic(generic::ABORT_REQUESTED);
                        self.post(window, qid, cid, aborted, 0);
                        ok(0)
                    }
                    None => ok(1),
                }
            }
            _ => fail(Status::generic(generic::INVALID_OPCODE)),
        }
    }

    fn io(&mut self, window: &DmaWindow, sqe: &Sqe) -> Outcome {
        if sqe.nsid.get() != 1 {
            return fail(Status::generic(generic::INVALID_NAMESPACE));
        }
        let supported = |bit| self.cfg.oncs & bit != 0;
        let lba_range = |slba: u64, nlb: u64| {
            slba.checked_add(nlb)
                .filter(|&end| end <= self.cfg.blocks)
                .map(|_| {
                    let bs = self.cfg.block_size as usize;
                    slba as usize * bs..(slba + nlb) as usize * bs
                })
        };
        match sqe.opcode {
            io::FLUSH => ok(0),
            io::WRITE_ZEROES if supported(nvme_spec::identify::ONCS_WRITE_ZEROES) => {
                let slba = u64::from(sqe.cdw10.get()) | (u64::from(sqe.cdw11.get()) << 32);
                let nlb = u64::from(sqe.cdw12.get() & 0xFFFF) + 1;
                let Some(r) = lba_range(slba, nlb) else {
                    return fail(Status::generic(generic::LBA_OUT_OF_RANGE));
                };
                self.data[r].fill(0);
                ok(0)
            }
            io::DATASET_MANAGEMENT if supported(nvme_spec::identify::ONCS_DSM) => {
                let nr = (sqe.cdw10.get() & 0xFF) as usize + 1;
                let mut list = vec![0u8; nr * 16];
                if let Err(s) = self.transfer(window, sqe, list.len() as u64, false, &mut list) {
                    return Some((s, 0));
                }
                let deallocate = sqe.cdw11.get() & (1 << 2) != 0;
                let mut ranges = Vec::with_capacity(nr);
                for r in list.chunks_exact(16) {
                    let nlb = u64::from(u32::from_le_bytes([r[4], r[5], r[6], r[7]]));
                    let mut slba = [0u8; 8];
                    slba.copy_from_slice(&r[8..]);
                    match lba_range(u64::from_le_bytes(slba), nlb) {
                        Some(range) => ranges.push(range),
                        None => return fail(Status::generic(generic::LBA_OUT_OF_RANGE)),
                    }
                }
                // This model's deallocated blocks read as zeroes.
                if deallocate {
                    for r in ranges {
                        self.data[r].fill(0);
                    }
                }
                ok(0)
            }
            io::READ | io::WRITE => {
                let slba = u64::from(sqe.cdw10.get()) | (u64::from(sqe.cdw11.get()) << 32);
                let nlb = u64::from(sqe.cdw12.get() & 0xFFFF) + 1;
                if slba
                    .checked_add(nlb)
                    .is_none_or(|end| end > self.cfg.blocks)
                {
                    return fail(Status::generic(generic::LBA_OUT_OF_RANGE));
                }
                let bs = u64::from(self.cfg.block_size);
                let len = nlb * bs;
                let min_page = 4096u64 << self.cfg.mpsmin;
                if self.cfg.mdts != 0 && len > min_page << self.cfg.mdts {
                    return fail(Status::generic(generic::INVALID_FIELD));
                }
                if self.cfg.discard_data {
                    return ok(0);
                }
                let at = (slba * bs) as usize;
                let len = len as usize;
                if sqe.opcode == io::READ {
                    let data = self.data[at..at + len].to_vec();
                    self.to_host(window, sqe, data)
                } else {
                    let mut data = vec![0u8; len];
                    match self.transfer(window, sqe, len as u64, false, &mut data) {
                        Ok(()) => {
                            self.data[at..at + len].copy_from_slice(&data);
                            ok(0)
                        }
                        Err(s) => Some((s, 0)),
                    }
                }
            }
            _ => fail(Status::generic(generic::INVALID_OPCODE)),
        }
    }
}

impl Device for ModelController {
    fn read32(&self, offset: u32) -> u32 {
        let s = self.inner.lock();
        match offset {
            regs::CAP => self.cap as u32,
            0x04 => (self.cap >> 32) as u32,
            regs::VS => 0x0001_0400,
            regs::CC => s.cc,
            regs::CSTS => s.csts,
            regs::AQA => s.aqa,
            regs::ASQ => s.asq as u32,
            0x2C => (s.asq >> 32) as u32,
            regs::ACQ => s.acq as u32,
            0x34 => (s.acq >> 32) as u32,
            _ => 0,
        }
    }

    fn write32(&self, offset: u32, value: u32) {
        let mut s = self.inner.lock();
        let lo = |r: u64| (r & !0xFFFF_FFFF) | u64::from(value);
        let hi = |r: u64| (r & 0xFFFF_FFFF) | (u64::from(value) << 32);
        match offset {
            regs::CC => s.write_cc(&Cap::from_raw(self.cap), value),
            regs::AQA => s.aqa = value,
            regs::ASQ => s.asq = lo(s.asq),
            0x2C => s.asq = hi(s.asq),
            regs::ACQ => s.acq = lo(s.acq),
            0x34 => s.acq = hi(s.acq),
            o if o >= regs::DOORBELL_BASE => s.doorbell(o, value),
            _ => {}
        }
    }

    fn map_dma(&self, window: &DmaWindow) -> Result<(), DeviceError> {
        let mut s = self.inner.lock();
        if s.window.is_some() {
            return Err(DeviceError("the model maps one arena".into()));
        }
        s.window = Some(window.clone());
        Ok(())
    }
}
