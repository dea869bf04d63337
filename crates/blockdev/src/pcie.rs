//! NVMe PCIe backend: a namespace of a local NVMe controller bound to `vfio-pci`, driven from
//! user space by [`nvme_pcie`] (no kernel block layer).
//!
//! A controller is opened once per process: further `pcie:` namespaces of the same PCI
//! function (another namespace, or the same one opened again, as `nvmeof-bench` does for its
//! DAS and in-process target modes) share its controller and queue pairs. Each thread that
//! issues I/O gets its own polled I/O queue pair on the controller, created on its first I/O
//! (an admin command, once per thread); when the controller has granted no more queues, later
//! threads share the existing ones round-robin. A target reactor thread therefore owns its
//! queue pair. Completions are polled, not interrupt-driven: a waiting future reaps its queue's
//! completion queue each time it is polled and asks to be polled again at once while its queue
//! saw a completion within the last millisecond; after that (a slow device, a lost command on
//! its way to a timeout) it polls once a millisecond, so a queue waiting on an idle device does
//! not keep a core busy.
//!
//! Data moves without a copy where it can. A read of at most the controller's transfer limit
//! (MDTS) lands in a buffer of the controller's DMA arena, which is handed back as the caller's
//! [`IoBuf`] (the caller's own buffer is dropped): the bytes the device wrote are the bytes the
//! target sends. A caller that passes such a buffer back (a target's buffer pool reuses them)
//! has its reads and writes run on it directly. Reads lend arena buffers only while less than
//! half the arena is in use; otherwise, for larger transfers (split into several commands of
//! at most MDTS that run together) and for writes from ordinary memory, data is copied through
//! buffers of the arena that each queue pair keeps for reuse (up to 2 MiB each).
//!
//! Flush is the NVMe Flush command, a write with Force Unit Access is an NVMe Write with FUA,
//! and the volatile write cache reported is the controller's (Identify Controller VWC). Write Zeroes and Deallocate are the NVMe Write Zeroes and
//! Dataset Management commands when the controller supports them (Identify Controller ONCS);
//! otherwise Write Zeroes writes zeroed buffers and Deallocate is accepted as the hint it is and
//! does nothing. Deallocated blocks are never promised to read as zeroes.
//!
//! A controller reset (after a command timed out and its Abort did not help) or failure
//! (CSTS.CFS) fails the commands in flight with an error; the next command on each queue pair
//! drops the dead pair, resets a failed controller (at most once a second; in between commands
//! fail at once) and creates a new pair.
//!
//! Dropping a future with commands in flight is safe: the driver owns the DMA buffers until
//! the device completes them, and the completions are reaped (and the buffers freed) by the
//! next poll of that queue.

use std::cell::RefCell;
use std::future::{Future, poll_fn};
use std::path::Path;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::task::Poll;
use std::time::{Duration, Instant};

use nvme_pcie::{
    ARENA_PAGE, Config, Controller, Device, DmaBuf, Error as DriverError, IoQueuePair, Namespace,
};
use parking_lot::Mutex;

use crate::{Backend, BackendError, BufResult, IoBuf, IoOp, check_range, check_transfer};

/// Completions reaped per poll of a queue.
const REAP_BATCH: usize = 64;
/// I/O queue pairs asked for at most (one per reactor thread).
const MAX_QUEUES: u16 = 64;
/// DMA arena bytes for the admin queue and the buffers reads lend to callers.
const ARENA_SHARED: usize = 32 << 20;
/// Entries per I/O queue.
const QUEUE_SIZE: u32 = 128;
/// DMA arena bytes per queue pair: its queues, a PRP list page per entry, and 2 MiB more of
/// bounce buffers.
const ARENA_PER_QUEUE: usize = (QUEUE_SIZE as usize + 8) * 4096 + (2 << 20);
/// Bounce buffer bytes each queue pair keeps for reuse (the 2 MiB of [`ARENA_PER_QUEUE`]).
const POOL_BYTES: usize = 2 << 20;
/// Interval of timeout and controller status checks of a queue with commands outstanding.
const CHECK_EVERY: Duration = Duration::from_millis(10);
/// A waiting request polls its queue continuously while the queue saw a completion (or the
/// request started) this recently ...
const SPIN_IDLE: Duration = Duration::from_millis(1);
/// ... and once per this interval otherwise.
const IDLE_POLL: Duration = Duration::from_millis(1);
/// Resets of a failed controller are attempted at most this often.
const RESET_INTERVAL: Duration = Duration::from_secs(1);
/// Longest wait for room in the DMA arena before a command fails.
const DMA_WAIT: Duration = Duration::from_secs(5);
/// Blocks per Write Zeroes command (its 16-bit NLB field).
const ZEROES_STEP: u64 = 1 << 16;
/// Blocks per Dataset Management range (its 32-bit length).
const DEALLOCATE_STEP: u64 = u32::MAX as u64;

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Controllers open in this process, by PCI address.
static OPEN: std::sync::Mutex<Vec<(String, Weak<Ctrl>)>> = std::sync::Mutex::new(Vec::new());

thread_local! {
    /// This thread's queue of each open controller (by controller id).
    static QUEUES: RefCell<Vec<(u64, Weak<Mutex<Queue>>)>> = const { RefCell::new(Vec::new()) };
}

/// A namespace of an NVMe controller driven through VFIO.
pub struct PcieBackend {
    dev: Arc<Ctrl>,
    ns: Namespace,
    /// Bytes per read or write command: the controller's limit, in whole blocks.
    max_transfer: usize,
}

/// An open controller and its queue pairs, shared by the namespaces opened on it.
struct Ctrl {
    id: u64,
    name: String,
    queues: Mutex<Vec<Arc<Mutex<Queue>>>>,
    next_shared: AtomicUsize,
    /// When a failed controller was last reset.
    last_reset: Mutex<Option<Instant>>,
    // Dropped last: the queues above hold the controller too; it shuts down with the last.
    ctrl: Controller,
}

impl std::fmt::Debug for PcieBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PcieBackend")
            .field("device", &self.dev.name)
            .field("nsid", &self.ns.nsid)
            .finish_non_exhaustive()
    }
}

/// Bounce buffers a queue pair keeps for reuse, by power-of-two page count, so that steady
/// I/O neither searches the arena nor zeroes memory.
#[derive(Default)]
struct Pool {
    classes: Vec<Vec<DmaBuf>>,
    bytes: usize,
}

impl Pool {
    /// Pages of the buffer class holding `len` bytes.
    fn class_pages(len: usize) -> usize {
        len.div_ceil(ARENA_PAGE).max(1).next_power_of_two()
    }

    fn take(&mut self, ctrl: &Controller, len: usize) -> Result<DmaBuf, DriverError> {
        let pages = Self::class_pages(len);
        let class = pages.trailing_zeros() as usize;
        if let Some(buf) = self.classes.get_mut(class).and_then(Vec::pop) {
            self.bytes -= buf.len();
            return Ok(buf);
        }
        ctrl.alloc(pages * ARENA_PAGE)
    }

    /// Keeps `buf` for reuse, or frees it when the pool is full.
    fn give(&mut self, buf: DmaBuf) {
        let pages = buf.len() / ARENA_PAGE;
        if !pages.is_power_of_two() || self.bytes + buf.len() > POOL_BYTES {
            return;
        }
        let class = pages.trailing_zeros() as usize;
        if self.classes.len() <= class {
            self.classes.resize_with(class + 1, Vec::new);
        }
        self.bytes += buf.len();
        self.classes[class].push(buf);
    }
}

/// One queue pair and the requests in flight on it.
struct Queue {
    pool: Pool,
    /// `None` between dropping a dead pair (after a reset) and creating its replacement.
    qp: Option<IoQueuePair>,
    /// Requests by index (the high half of a command's tag); `free` lists unused slots.
    reqs: Vec<Req>,
    free: Vec<u32>,
    /// When [`IoQueuePair::check`] is due.
    next_check: Instant,
    /// When a completion last arrived.
    last_completion: Instant,
}

/// A request: one or more commands (a split transfer). Slots are reused, with their buffer
/// list's memory.
#[derive(Default)]
struct Req {
    /// Commands submitted and not completed yet.
    remaining: u32,
    /// The first error among its commands.
    error: Option<DriverError>,
    /// Keep the buffers that come back (reads, and writes from a caller's DMA buffer).
    keep: bool,
    /// Buffers that came back: (command index, buffer).
    bufs: Vec<(u32, DmaBuf)>,
    /// The future went away: free the slot when the last command completes.
    abandoned: bool,
}

impl Req {
    /// Makes the slot unused, keeping its buffer list's memory.
    fn clear(&mut self, pool: &mut Pool) {
        self.remaining = 0;
        self.error = None;
        self.keep = false;
        self.abandoned = false;
        for (_, buf) in self.bufs.drain(..) {
            pool.give(buf);
        }
    }
}

impl Queue {
    fn new(qp: IoQueuePair) -> Self {
        let now = Instant::now();
        Queue {
            pool: Pool::default(),
            qp: Some(qp),
            reqs: Vec::new(),
            free: Vec::new(),
            next_check: now,
            last_completion: now,
        }
    }

    /// Writes the SQ tail doorbell for what was queued.
    fn ring(&mut self) {
        if let Some(qp) = &mut self.qp {
            qp.ring();
        }
    }

    fn start(&mut self, keep: bool) -> u32 {
        let id = self.free.pop().unwrap_or_else(|| {
            self.reqs.push(Req::default());
            (self.reqs.len() - 1) as u32
        });
        self.reqs[id as usize].keep = keep;
        id
    }

    /// Ends request `id`: its slot becomes free (or, with commands still in flight, is freed
    /// by the completion of the last one).
    fn abandon(&mut self, id: u32) {
        let Queue {
            reqs, free, pool, ..
        } = self;
        let r = &mut reqs[id as usize];
        if r.remaining == 0 {
            r.clear(pool);
            free.push(id);
        } else {
            r.abandoned = true;
            for (_, buf) in r.bufs.drain(..) {
                pool.give(buf);
            }
        }
    }

    /// Reaps a batch of completions, and every [`CHECK_EVERY`] lets the driver check for timed
    /// out commands and a failed controller. Returns the time it read.
    fn reap(&mut self) -> Instant {
        let now = Instant::now();
        let Queue {
            qp,
            reqs,
            free,
            next_check,
            pool,
            last_completion,
        } = self;
        let Some(qp) = qp else {
            return now;
        };
        let n = qp.poll(REAP_BATCH, |c| {
            let (id, index) = ((c.tag >> 32) as u32, c.tag as u32);
            let Some(r) = reqs.get_mut(id as usize) else {
                return;
            };
            r.remaining = r.remaining.saturating_sub(1);
            if let Err(e) = c.result {
                r.error.get_or_insert(e);
            }
            match (c.buf, r.keep && !r.abandoned) {
                (Some(buf), true) => r.bufs.push((index, buf)),
                (Some(buf), false) => pool.give(buf),
                (None, _) => {}
            }
            if r.abandoned && r.remaining == 0 {
                r.clear(pool);
                free.push(id);
            }
        });
        if n > 0 {
            *last_completion = now;
        }
        if now >= *next_check {
            qp.check(now);
            *next_check = now + CHECK_EVERY;
        }
        now
    }
}

/// Marks a request abandoned if its future is dropped before it ends.
struct ReqGuard<'a> {
    queue: &'a Mutex<Queue>,
    id: u32,
    done: bool,
}

impl Drop for ReqGuard<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.queue.lock().abandon(self.id);
        }
    }
}

/// Lets other tasks run once, polling `queue` on the way (waiting for room in the queue or
/// the arena).
async fn yield_polling(queue: &Mutex<Queue>) {
    let mut yielded = false;
    poll_fn(|cx| {
        if yielded {
            return Poll::Ready(());
        }
        yielded = true;
        queue.lock().reap();
        cx.waker().wake_by_ref();
        Poll::Pending
    })
    .await
}

/// What the commands of a request do.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Cmd {
    Read,
    Write,
    WriteFua,
    WriteZeroes,
    Deallocate,
    Flush,
}

impl Cmd {
    fn op(self) -> IoOp {
        match self {
            Cmd::Read => IoOp::Read,
            Cmd::Write | Cmd::WriteFua => IoOp::Write,
            Cmd::WriteZeroes => IoOp::WriteZeroes,
            Cmd::Deallocate => IoOp::Deallocate,
            Cmd::Flush => IoOp::Flush,
        }
    }
}

/// Where a request's data is.
enum Data<'a> {
    /// None moves (Flush, native Write Zeroes and Deallocate).
    None,
    /// Copied between the caller's buffer and bounce buffers, one per command.
    Bounce(&'a mut IoBuf),
    /// Zeroed bounce buffers written (Write Zeroes without the native command).
    Zeroes,
    /// One command on one arena buffer that becomes (or was) the caller's: `None` before
    /// submission takes one from the pool, and after it while the command owns it.
    Direct(Option<DmaBuf>),
}

/// A request: `blocks` blocks from `lba`, at most `step` per command (a Flush: one command).
#[derive(Clone, Copy)]
struct Plan {
    cmd: Cmd,
    lba: u64,
    blocks: u64,
    step: u64,
}

impl Plan {
    fn commands(&self) -> u64 {
        self.blocks.div_ceil(self.step).max(1)
    }

    /// Starting block and block count of command `index`.
    fn chunk(&self, index: u64) -> (u64, u32) {
        let at = index * self.step;
        let n = self.step.min(self.blocks.saturating_sub(at));
        (self.lba + at, u32::try_from(n).unwrap_or(u32::MAX))
    }
}

/// What one pass of submissions achieved.
enum Submitted {
    All,
    /// The queue is full: poll it and go on.
    QueueFull,
    /// No room in the DMA arena now: poll and go on, up to [`DMA_WAIT`].
    NoDma,
}

impl PcieBackend {
    /// Opens namespace `nsid` (default: the first active one) of the controller at PCI address
    /// `address` (`DOMAIN:BUS:DEV.FN`), which must be bound to `vfio-pci`. A controller this
    /// process already has open is shared, not opened again.
    pub fn open(address: &str, nsid: Option<u32>) -> Result<Self, BackendError> {
        let mut open = OPEN.lock().unwrap_or_else(|e| e.into_inner());
        open.retain(|(_, c)| c.strong_count() > 0);
        let found = open
            .iter()
            .find(|(a, _)| a == address)
            .and_then(|(_, c)| c.upgrade());
        let dev = match found {
            Some(dev) => dev,
            None => {
                let config_err = |e: &dyn std::fmt::Display| {
                    BackendError::Config(format!("pcie:{address}: {e}"))
                };
                let sysfs = Path::new("/sys/bus/pci/devices").join(address);
                let dev = nvme_pcie::vfio::VfioNvme::open(&sysfs).map_err(|e| config_err(&e))?;
                let mut config = Self::config();
                config.iova_base = dev
                    .arena_iova(config.arena_size)
                    .map_err(|e| config_err(&e))?;
                let dev = Ctrl::bring_up(Arc::new(dev), config, format!("pcie:{address}"))?;
                open.push((address.to_owned(), Arc::downgrade(&dev)));
                dev
            }
        };
        drop(open);
        Self::on(dev, nsid)
    }

    /// The driver settings [`open`](Self::open) uses: one queue pair per CPU (at most 64),
    /// each with room for its commands' PRP lists and bounce buffers in the arena, and 32 MiB
    /// more for buffers reads hand to callers.
    pub fn config() -> Config {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let io_queues = u16::try_from(cpus)
            .unwrap_or(MAX_QUEUES)
            .clamp(1, MAX_QUEUES);
        Config {
            io_queues,
            io_queue_size: QUEUE_SIZE,
            arena_size: ARENA_SHARED + usize::from(io_queues) * ARENA_PER_QUEUE,
            ..Config::default()
        }
    }

    /// Brings up the controller behind `dev` with `config` and uses namespace `nsid` (default:
    /// the first active one). `name` appears in errors.
    pub fn with_device(
        dev: Arc<dyn Device>,
        config: Config,
        nsid: Option<u32>,
        name: String,
    ) -> Result<Self, BackendError> {
        Self::on(Ctrl::bring_up(dev, config, name)?, nsid)
    }

    /// Namespace `nsid` (default: the first active one) of this backend's controller, sharing
    /// the controller and its queue pairs (what [`open`](Self::open) does for a controller
    /// that is already open).
    pub fn share(&self, nsid: Option<u32>) -> Result<Self, BackendError> {
        Self::on(Arc::clone(&self.dev), nsid)
    }

    fn on(dev: Arc<Ctrl>, nsid: Option<u32>) -> Result<Self, BackendError> {
        let name = &dev.name;
        let config_err = |e: &dyn std::fmt::Display| BackendError::Config(format!("{name}: {e}"));
        let ctrl = &dev.ctrl;
        let ns = match nsid {
            Some(n) => ctrl.namespace(n).map_err(|e| config_err(&e))?,
            None => *ctrl
                .namespaces()
                .first()
                .ok_or_else(|| config_err(&"the controller has no active namespace"))?,
        };
        crate::validate_block_size(ns.block_size).map_err(|e| config_err(&e))?;
        let max_transfer = usize::try_from(ctrl.info().max_transfer).unwrap_or(usize::MAX);
        // Whole blocks per command.
        let max_transfer = max_transfer - max_transfer % ns.block_size as usize;
        if max_transfer == 0 {
            return Err(config_err(
                &"the controller's transfer limit is below one block",
            ));
        }
        let info = ctrl.info();
        tracing::info!(
            device = %name,
            nsid = ns.nsid,
            block_size = ns.block_size,
            blocks = ns.blocks,
            max_transfer,
            io_queues = info.io_queues,
            volatile_write_cache = info.volatile_write_cache,
            write_zeroes = info.supports_write_zeroes(),
            deallocate = info.supports_deallocate(),
            dma_arena_bytes = ctrl.arena().window().len(),
            "NVMe PCIe namespace opened ({} {}, DMA arena pinned)",
            info.model,
            info.firmware
        );
        Ok(PcieBackend {
            dev,
            ns,
            max_transfer,
        })
    }

    /// The controller.
    pub fn controller(&self) -> &Controller {
        &self.dev.ctrl
    }

    /// The namespace.
    pub fn namespace(&self) -> Namespace {
        self.ns
    }

    /// I/O queue pairs created so far (one per thread that did I/O, up to what the controller
    /// grants).
    pub fn queue_pairs(&self) -> usize {
        self.dev.queues.lock().len()
    }

    /// Bytes of DMA memory the queue pairs keep as bounce buffers for reuse (at most 2 MiB
    /// each); the rest of [`DmaArena::pages_in_use`](nvme_pcie::DmaArena::pages_in_use) is
    /// queues, commands in flight and buffers handed to callers.
    pub fn pooled_dma_bytes(&self) -> usize {
        self.dev
            .queues
            .lock()
            .iter()
            .map(|q| q.lock().pool.bytes)
            .sum()
    }

    /// Whether a read may hand the caller an arena buffer: less than half the arena is in use.
    fn may_lend(&self) -> bool {
        let arena = self.dev.ctrl.arena();
        arena.pages_in_use() < arena.pages() / 2
    }

    /// Runs one request: its commands submitted together, then waited for. Returns the
    /// request's [`Data::Direct`] buffer, if it has one (also on failure, when it came back).
    async fn run(
        &self,
        plan: Plan,
        mut data: Data<'_>,
    ) -> (Result<(), BackendError>, Option<DmaBuf>) {
        let direct = |data: Data<'_>| match data {
            Data::Direct(d) => d,
            _ => None,
        };
        let fail = |source| BackendError::Nvme {
            op: plan.cmd.op(),
            source,
        };
        let queue = match self.dev.queue(plan.cmd.op()) {
            Ok(q) => q,
            Err(e) => return (Err(e), direct(data)),
        };
        let keep = match data {
            Data::Bounce(_) => plan.cmd == Cmd::Read,
            Data::Direct(_) => true,
            Data::None | Data::Zeroes => false,
        };
        let id = queue.lock().start(keep);
        let mut guard = ReqGuard {
            queue: &queue,
            id,
            done: false,
        };
        let mut next = 0;
        let mut dma_wait: Option<Instant> = None;
        loop {
            let submitted = self.submit_some(&mut queue.lock(), id, &plan, &mut data, &mut next);
            match submitted {
                Ok(Submitted::All) => break,
                Ok(Submitted::QueueFull) => yield_polling(&queue).await,
                Ok(Submitted::NoDma)
                    if dma_wait.get_or_insert_with(Instant::now).elapsed() < DMA_WAIT =>
                {
                    yield_polling(&queue).await
                }
                Ok(Submitted::NoDma) => return (Err(fail(DriverError::OutOfDmaMemory)), None),
                // Commands already submitted finish on their own (the guard).
                Err(e) => return (Err(fail(e)), direct(data)),
            }
        }
        let mut started: Option<Instant> = None;
        let mut sleep: Option<Pin<Box<tokio::time::Sleep>>> = None;
        let (error, buf) = poll_fn(|cx| {
            if let Some(s) = &mut sleep {
                if s.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                sleep = None;
            }
            let mut q = queue.lock();
            let now = q.reap();
            if q.reqs[id as usize].remaining == 0 {
                guard.done = true;
                return Poll::Ready(self.finish(&mut q, id, &plan, &mut data));
            }
            // Poll again at once while the queue is making progress, else in a while.
            let since = q.last_completion.max(*started.get_or_insert(now));
            drop(q);
            if now.saturating_duration_since(since) < SPIN_IDLE {
                cx.waker().wake_by_ref();
            } else {
                let mut s = Box::pin(tokio::time::sleep(IDLE_POLL));
                if s.as_mut().poll(cx).is_ready() {
                    cx.waker().wake_by_ref();
                } else {
                    sleep = Some(s);
                }
            }
            Poll::Pending
        })
        .await;
        (error.map_or(Ok(()), |e| Err(fail(e))), buf)
    }

    /// Ends request `id` (all its commands completed): copies read data out of its bounce
    /// buffers and returns its error and its direct buffer. One lock held throughout.
    fn finish(
        &self,
        q: &mut Queue,
        id: u32,
        plan: &Plan,
        data: &mut Data<'_>,
    ) -> (Option<DriverError>, Option<DmaBuf>) {
        let Queue {
            reqs, free, pool, ..
        } = q;
        let r = &mut reqs[id as usize];
        let error = r.error.take();
        let bs = self.ns.block_size as usize;
        let mut direct = None;
        for (index, buf) in r.bufs.drain(..) {
            match data {
                Data::Bounce(b) if error.is_none() => {
                    let (lba, blocks) = plan.chunk(u64::from(index));
                    let at = (lba - plan.lba) as usize * bs;
                    let len = blocks as usize * bs;
                    b[at..at + len].copy_from_slice(&buf.as_slice()[..len]);
                    pool.give(buf);
                }
                Data::Direct(_) => direct = Some(buf),
                _ => pool.give(buf),
            }
        }
        r.clear(pool);
        free.push(id);
        (error, direct)
    }

    /// Submits the commands of a request from `next` on, ringing the doorbell once.
    fn submit_some(
        &self,
        q: &mut Queue,
        id: u32,
        plan: &Plan,
        data: &mut Data<'_>,
        next: &mut u64,
    ) -> Result<Submitted, DriverError> {
        let bs = self.ns.block_size as usize;
        let mut outcome = Ok(Submitted::All);
        while *next < plan.commands() {
            let (slba, nlb) = plan.chunk(*next);
            let len = nlb as usize * bs;
            let taken = match data {
                Data::None => Ok(None),
                Data::Direct(d) => match d.take() {
                    Some(d) => Ok(Some(d)),
                    None => q.pool.take(&self.dev.ctrl, len).map(Some),
                },
                Data::Bounce(_) | Data::Zeroes => q.pool.take(&self.dev.ctrl, len).map(Some),
            };
            let mut dma = match taken {
                Ok(d) => d,
                Err(DriverError::OutOfDmaMemory) => {
                    outcome = Ok(Submitted::NoDma);
                    break;
                }
                Err(e) => {
                    outcome = Err(e);
                    break;
                }
            };
            match (&mut dma, &*data) {
                (Some(d), Data::Bounce(b)) if matches!(plan.cmd, Cmd::Write | Cmd::WriteFua) => {
                    let at = (slba - plan.lba) as usize * bs;
                    d.as_mut_slice()[..len].copy_from_slice(&b[at..at + len]);
                }
                (Some(d), Data::Zeroes) => d.as_mut_slice()[..len].fill(0),
                _ => {}
            }
            let tag = (u64::from(id) << 32) | *next;
            match self.submit(q, plan.cmd, id, tag, slba, nlb, dma) {
                Ok(()) => *next += 1,
                Err((e, buf)) => {
                    match (buf, &mut *data) {
                        (Some(buf), Data::Direct(d)) => *d = Some(buf),
                        (Some(buf), _) => q.pool.give(buf),
                        (None, _) => {}
                    }
                    outcome = match e {
                        DriverError::QueueFull => Ok(Submitted::QueueFull),
                        // The pair died with a controller reset or failure: replace it and
                        // retry.
                        DriverError::Reset | DriverError::ControllerFailed => {
                            self.dev.renew(q).map(|()| Submitted::QueueFull)
                        }
                        e => Err(e),
                    };
                    break;
                }
            }
        }
        q.ring();
        outcome
    }

    /// Submits one command of request `id`; a refused one gives its buffer back.
    #[allow(clippy::too_many_arguments)]
    fn submit(
        &self,
        q: &mut Queue,
        cmd: Cmd,
        id: u32,
        tag: u64,
        slba: u64,
        nlb: u32,
        dma: Option<DmaBuf>,
    ) -> Result<(), (DriverError, Option<DmaBuf>)> {
        let Some(qp) = &mut q.qp else {
            return Err((DriverError::Reset, dma));
        };
        let ns = &self.ns;
        let submitted = match (cmd, dma) {
            (Cmd::Read, Some(d)) => qp.read(ns, slba, nlb, d, tag),
            (Cmd::Write | Cmd::WriteZeroes, Some(d)) => qp.write(ns, slba, nlb, d, tag),
            (Cmd::WriteFua, Some(d)) => qp.write_fua(ns, slba, nlb, d, tag),
            (Cmd::WriteZeroes, None) => qp.write_zeroes(ns, slba, nlb, tag),
            (Cmd::Deallocate, None) => qp.deallocate(ns, slba, nlb, tag),
            (Cmd::Flush, None) => qp.flush(ns, tag),
            // Not built by this module: a data command without data or the reverse.
            (_, d) => return Err((DriverError::OutOfBounds, d)),
        };
        match submitted {
            Ok(()) => {
                q.reqs[id as usize].remaining += 1;
                Ok(())
            }
            Err(r) => Err((r.error, r.buf)),
        }
    }

    async fn transfer(&self, cmd: Cmd, lba: u64, mut buf: IoBuf) -> BufResult {
        let bs = self.ns.block_size;
        if let Err(e) = check_transfer(lba, buf.len(), bs, self.ns.blocks) {
            return (Err(e), buf);
        }
        let len = buf.len();
        let plan = Plan {
            cmd,
            lba,
            blocks: (len / bs as usize) as u64,
            step: (self.max_transfer / bs as usize) as u64,
        };
        if plan.commands() == 1 {
            // The caller's buffer is this controller's memory: the device uses it directly.
            let arena = self.dev.ctrl.arena();
            buf = match buf.into_dma() {
                Ok(d) if arena.owns(&d) => {
                    let (r, d) = self.run(plan, Data::Direct(Some(d))).await;
                    let back = d.map_or_else(|| IoBuf::new(len), |d| IoBuf::from_dma(d, len));
                    return (r, back);
                }
                Ok(d) => IoBuf::from_dma(d, len),
                Err(b) => b,
            };
            // A read lands in an arena buffer that replaces the caller's.
            if cmd == Cmd::Read && self.may_lend() {
                return match self.run(plan, Data::Direct(None)).await {
                    (Ok(()), Some(d)) => (Ok(()), IoBuf::from_dma(d, len)),
                    (r, _) => (r, buf),
                };
            }
        }
        let (r, _) = self.run(plan, Data::Bounce(&mut buf)).await;
        (r, buf)
    }

    /// Runs `cmd` over `blocks` blocks from `lba`, `step` blocks per command.
    async fn range(
        &self,
        cmd: Cmd,
        lba: u64,
        blocks: u64,
        step: u64,
        data: Data<'_>,
    ) -> Result<(), BackendError> {
        check_range(lba, blocks, self.ns.blocks)?;
        if blocks == 0 {
            return Ok(());
        }
        let plan = Plan {
            cmd,
            lba,
            blocks,
            step,
        };
        self.run(plan, data).await.0
    }
}

impl Ctrl {
    fn bring_up(
        dev: Arc<dyn Device>,
        config: Config,
        name: String,
    ) -> Result<Arc<Self>, BackendError> {
        let ctrl = Controller::new(dev, config)
            .map_err(|e| BackendError::Config(format!("{name}: {e}")))?;
        Ok(Arc::new(Ctrl {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            name,
            queues: Mutex::new(Vec::new()),
            next_shared: AtomicUsize::new(0),
            last_reset: Mutex::new(None),
            ctrl,
        }))
    }

    /// This thread's queue pair, created on first use.
    fn queue(&self, op: IoOp) -> Result<Arc<Mutex<Queue>>, BackendError> {
        let found = QUEUES.with(|m| {
            m.borrow()
                .iter()
                .find(|(id, _)| *id == self.id)
                .and_then(|(_, q)| q.upgrade())
        });
        if let Some(q) = found {
            return Ok(q);
        }
        let q = match self.ctrl.create_io_queue() {
            Ok(qp) => {
                let q = Arc::new(Mutex::new(Queue::new(qp)));
                self.queues.lock().push(q.clone());
                q
            }
            Err(DriverError::NoQueues(_)) => {
                let queues = self.queues.lock();
                if queues.is_empty() {
                    return Err(BackendError::Nvme {
                        op,
                        source: DriverError::NoQueues(0),
                    });
                }
                let i = self.next_shared.fetch_add(1, Ordering::Relaxed) % queues.len();
                queues[i].clone()
            }
            Err(source) => return Err(BackendError::Nvme { op, source }),
        };
        QUEUES.with(|m| {
            let mut m = m.borrow_mut();
            m.retain(|(_, q)| q.strong_count() > 0);
            m.push((self.id, Arc::downgrade(&q)));
        });
        Ok(q)
    }

    /// Replaces a queue pair that a reset or a controller failure killed: its commands fail
    /// (delivered to their requests), it is dropped, a failed controller is reset (at most once
    /// per [`RESET_INTERVAL`]; otherwise the command fails at once), and a new pair is created.
    fn renew(&self, q: &mut Queue) -> Result<(), DriverError> {
        if q.qp.is_some() {
            // Deliver the failed commands before the pair goes.
            q.reap();
            q.qp = None;
        }
        if self.ctrl.is_failed() {
            let mut last = self.last_reset.lock();
            if last.is_some_and(|t| t.elapsed() < RESET_INTERVAL) {
                return Err(DriverError::ControllerFailed);
            }
            *last = Some(Instant::now());
            if self.ctrl.is_failed() {
                tracing::warn!(device = %self.name, "NVMe controller failed; resetting it");
                self.ctrl.reset()?;
            }
        }
        q.qp = Some(self.ctrl.create_io_queue()?);
        Ok(())
    }
}

impl Backend for PcieBackend {
    fn block_size(&self) -> u32 {
        self.ns.block_size
    }

    fn num_blocks(&self) -> u64 {
        self.ns.blocks
    }

    fn volatile_write_cache(&self) -> bool {
        self.dev.ctrl.info().volatile_write_cache
    }

    fn deallocate_reads_zeroes(&self) -> bool {
        false
    }

    async fn read(&self, lba: u64, buf: IoBuf) -> BufResult {
        self.transfer(Cmd::Read, lba, buf).await
    }

    async fn write(&self, lba: u64, buf: IoBuf) -> BufResult {
        self.transfer(Cmd::Write, lba, buf).await
    }

    /// NVMe Write with Force Unit Access (every command of a split transfer), not a write
    /// and a Flush of the whole cache.
    async fn write_fua(&self, lba: u64, buf: IoBuf) -> BufResult {
        self.transfer(Cmd::WriteFua, lba, buf).await
    }

    async fn flush(&self) -> Result<(), BackendError> {
        let plan = Plan {
            cmd: Cmd::Flush,
            lba: 0,
            blocks: 0,
            step: 1,
        };
        self.run(plan, Data::None).await.0
    }

    async fn write_zeroes(&self, lba: u64, blocks: u64) -> Result<(), BackendError> {
        if self.dev.ctrl.info().supports_write_zeroes() {
            self.range(Cmd::WriteZeroes, lba, blocks, ZEROES_STEP, Data::None)
                .await
        } else {
            let step = (self.max_transfer / self.ns.block_size as usize) as u64;
            self.range(Cmd::WriteZeroes, lba, blocks, step, Data::Zeroes)
                .await
        }
    }

    async fn deallocate(&self, lba: u64, blocks: u64) -> Result<(), BackendError> {
        if self.dev.ctrl.info().supports_deallocate() {
            self.range(Cmd::Deallocate, lba, blocks, DEALLOCATE_STEP, Data::None)
                .await
        } else {
            check_range(lba, blocks, self.ns.blocks)
        }
    }
}
