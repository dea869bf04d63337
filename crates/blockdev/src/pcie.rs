//! NVMe PCIe backend: a namespace of a local NVMe controller bound to `vfio-pci`, driven from
//! user space by [`nvme_pcie`] (no kernel block layer).
//!
//! Each thread that issues I/O gets its own polled I/O queue pair on the controller, created
//! on its first I/O (an admin command, once per thread); when the controller has granted no
//! more queues, later threads share the existing ones round-robin. A target reactor thread
//! therefore owns its queue pair. Completions are polled, not interrupt-driven: a waiting
//! future reaps its queue's completion queue each time it is polled and asks to be polled
//! again, so a thread spins while it has I/O outstanding and is idle otherwise.
//!
//! Data is bounce-copied between the caller's [`IoBuf`] and buffers of the driver's DMA arena
//! (memory mapped through the IOMMU at IOVAs the device may use): one copy per read or write;
//! each queue pair keeps up to 2 MiB of those buffers for reuse.
//! Transfers larger than the controller's limit (MDTS) are split into several commands that
//! run together. Flush is the NVMe Flush command; Write Zeroes writes zeroed buffers;
//! Deallocate is accepted as the hint it is and does nothing (deallocated blocks keep their
//! data, so `deallocate_reads_zeroes` is false).
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
use std::future::poll_fn;
use std::path::Path;
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
/// DMA arena bytes for the admin queue and bounce buffers shared by all queue pairs.
const ARENA_SHARED: usize = 16 << 20;
/// Entries per I/O queue.
const QUEUE_SIZE: u32 = 128;
/// DMA arena bytes per queue pair: its queues, a PRP list page per entry, and 2 MiB more of
/// bounce buffers.
const ARENA_PER_QUEUE: usize = (QUEUE_SIZE as usize + 8) * 4096 + (2 << 20);
/// Bounce buffer bytes each queue pair keeps for reuse (the 2 MiB of [`ARENA_PER_QUEUE`]).
const POOL_BYTES: usize = 2 << 20;
/// Interval of timeout checks on a busy queue.
const CHECK_EVERY: Duration = Duration::from_millis(10);
/// Resets of a failed controller are attempted at most this often.
const RESET_INTERVAL: Duration = Duration::from_secs(1);
/// Longest wait for room in the DMA arena before a command fails.
const DMA_WAIT: Duration = Duration::from_secs(5);

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// This thread's queue of each open PCIe backend (by backend id).
    static QUEUES: RefCell<Vec<(u64, Weak<Mutex<Queue>>)>> = const { RefCell::new(Vec::new()) };
}

/// A namespace of an NVMe controller driven through VFIO.
pub struct PcieBackend {
    id: u64,
    name: String,
    ns: Namespace,
    max_transfer: usize,
    queues: Mutex<Vec<Arc<Mutex<Queue>>>>,
    next_shared: AtomicUsize,
    /// When a failed controller was last reset by this backend.
    last_reset: Mutex<Option<Instant>>,
    // Dropped last: the queues above hold the controller too; it shuts down with the last.
    ctrl: Controller,
}

impl std::fmt::Debug for PcieBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PcieBackend")
            .field("device", &self.name)
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
    /// When [`IoQueuePair::check`] is due even if completions keep arriving.
    next_check: Instant,
}

/// A request: one or more commands (a split transfer).
#[derive(Default)]
struct Req {
    /// Commands submitted and not completed yet.
    remaining: u32,
    /// The first error among its commands.
    error: Option<DriverError>,
    /// Keep the buffers that come back (reads): (command index, buffer).
    keep: bool,
    bufs: Vec<(u32, DmaBuf)>,
    /// The future went away: free the slot when the last command completes.
    abandoned: bool,
}

impl Queue {
    fn new(qp: IoQueuePair) -> Self {
        Queue {
            pool: Pool::default(),
            qp: Some(qp),
            reqs: Vec::new(),
            free: Vec::new(),
            next_check: Instant::now(),
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
        let r = &mut self.reqs[id as usize];
        *r = Req {
            keep,
            ..Req::default()
        };
        id
    }

    /// Reaps a batch of completions and lets the driver check for timed out commands and a
    /// failed controller.
    fn reap(&mut self) {
        let Queue {
            qp,
            reqs,
            free,
            next_check,
            pool,
        } = self;
        let Some(qp) = qp else {
            return;
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
                *r = Req::default();
                free.push(id);
            }
        });
        // Timeouts and a failed controller are checked when idle, and at least every
        // CHECK_EVERY under load.
        let now = Instant::now();
        if n == 0 || now >= *next_check {
            qp.check(now);
            *next_check = now + CHECK_EVERY;
        }
    }
}

/// Marks a request abandoned if its future is dropped before it ends.
struct ReqGuard<'a> {
    queue: &'a Mutex<Queue>,
    id: u32,
    done: bool,
}

impl ReqGuard<'_> {
    /// Ends the request, returning its outcome and the buffers that came back.
    fn finish(mut self) -> (Option<DriverError>, Vec<(u32, DmaBuf)>) {
        self.done = true;
        let mut q = self.queue.lock();
        let r = std::mem::take(&mut q.reqs[self.id as usize]);
        q.free.push(self.id);
        (r.error, r.bufs)
    }
}

impl Drop for ReqGuard<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let mut q = self.queue.lock();
        let r = &mut q.reqs[self.id as usize];
        if r.remaining == 0 {
            *r = Req::default();
            q.free.push(self.id);
        } else {
            r.abandoned = true;
            r.bufs.clear();
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

/// What one command of a request does.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Cmd {
    Read,
    Write,
    Flush,
}

impl PcieBackend {
    /// Opens namespace `nsid` (default: the first active one) of the controller at PCI address
    /// `address` (`DOMAIN:BUS:DEV.FN`), which must be bound to `vfio-pci`.
    pub fn open(address: &str, nsid: Option<u32>) -> Result<Self, BackendError> {
        let config_err =
            |e: &dyn std::fmt::Display| BackendError::Config(format!("pcie:{address}: {e}"));
        let sysfs = Path::new("/sys/bus/pci/devices").join(address);
        let dev = nvme_pcie::vfio::VfioNvme::open(&sysfs).map_err(|e| config_err(&e))?;
        let mut config = Self::config();
        config.iova_base = dev
            .arena_iova(config.arena_size)
            .map_err(|e| config_err(&e))?;
        Self::with_device(Arc::new(dev), config, nsid, format!("pcie:{address}"))
    }

    /// The driver settings [`open`](Self::open) uses: one queue pair per CPU (at most 64),
    /// each with room for its commands' PRP lists and bounce buffers in the arena.
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
        let config_err = |e: &dyn std::fmt::Display| BackendError::Config(format!("{name}: {e}"));
        let ctrl = Controller::new(dev, config).map_err(|e| config_err(&e))?;
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
            dma_arena_bytes = ctrl.arena().window().len(),
            "NVMe PCIe namespace opened ({} {}, DMA arena pinned)",
            info.model,
            info.firmware
        );
        Ok(PcieBackend {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            name,
            ns,
            max_transfer,
            queues: Mutex::new(Vec::new()),
            next_shared: AtomicUsize::new(0),
            last_reset: Mutex::new(None),
            ctrl,
        })
    }

    /// The controller.
    pub fn controller(&self) -> &Controller {
        &self.ctrl
    }

    /// The namespace.
    pub fn namespace(&self) -> Namespace {
        self.ns
    }

    /// I/O queue pairs created so far (one per thread that did I/O, up to what the controller
    /// grants).
    pub fn queue_pairs(&self) -> usize {
        self.queues.lock().len()
    }

    /// Bytes of DMA memory the queue pairs keep as bounce buffers for reuse (at most 2 MiB
    /// each); the rest of [`DmaArena::pages_in_use`](nvme_pcie::DmaArena::pages_in_use) is
    /// queues and commands in flight.
    pub fn pooled_dma_bytes(&self) -> usize {
        self.queues.lock().iter().map(|q| q.lock().pool.bytes).sum()
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

    /// Runs one request: `buf` split into commands of at most the transfer limit (or one
    /// Flush when `buf` is `None`), all submitted together, then waited for.
    async fn run(&self, cmd: Cmd, lba: u64, buf: Option<&mut IoBuf>) -> Result<(), BackendError> {
        let op = match cmd {
            Cmd::Read => IoOp::Read,
            Cmd::Write => IoOp::Write,
            Cmd::Flush => IoOp::Flush,
        };
        let fail = |source| BackendError::Nvme { op, source };
        let queue = self.queue(op)?;
        let id = queue.lock().start(cmd == Cmd::Read);
        let guard = ReqGuard {
            queue: &queue,
            id,
            done: false,
        };
        let bs = self.ns.block_size as usize;
        // Command `index` moves `len` bytes at byte `at` of `buf` (a Flush: none).
        let total = buf.as_ref().map_or(0, |b| b.len());
        let chunk = |index: usize| {
            let at = index * self.max_transfer;
            (at, self.max_transfer.min(total - at))
        };
        let commands = buf
            .as_ref()
            .map_or(1, |b| b.len().div_ceil(self.max_transfer));
        let mut dma_wait: Option<Instant> = None;
        for index in 0..commands {
            let (at, len) = chunk(index);
            let tag = (u64::from(id) << 32) | index as u64;
            loop {
                let dma = if cmd == Cmd::Flush {
                    None
                } else {
                    let taken = queue.lock().pool.take(&self.ctrl, len);
                    match taken {
                        Ok(d) => Some(d),
                        Err(DriverError::OutOfDmaMemory)
                            if dma_wait.get_or_insert_with(Instant::now).elapsed() < DMA_WAIT =>
                        {
                            queue.lock().ring();
                            yield_polling(&queue).await;
                            continue;
                        }
                        Err(e) => return Err(fail(e)),
                    }
                };
                if let (Cmd::Write, Some(d), Some(b)) = (cmd, &dma, &buf) {
                    d.write(0, &b[at..at + len]).map_err(fail)?;
                }
                let slba = lba + (at / bs) as u64;
                let nlb = (len / bs) as u32;
                match self.submit(&queue, cmd, id, tag, slba, nlb, dma) {
                    Ok(true) => break,
                    Ok(false) => yield_polling(&queue).await,
                    // Commands already submitted finish on their own (the guard).
                    Err(e) => return Err(fail(e)),
                }
            }
        }
        queue.lock().ring();
        poll_fn(|cx| {
            let mut q = queue.lock();
            if q.reqs[id as usize].remaining > 0 {
                q.reap();
            }
            if q.reqs[id as usize].remaining == 0 {
                return Poll::Ready(());
            }
            cx.waker().wake_by_ref();
            Poll::Pending
        })
        .await;
        let (error, bufs) = guard.finish();
        if let Some(e) = error {
            return Err(fail(e));
        }
        let copied = match buf {
            Some(b) => bufs.iter().try_for_each(|(index, d)| {
                let (at, len) = chunk(*index as usize);
                d.read(0, &mut b[at..at + len])
            }),
            None => Ok(()),
        };
        let mut q = queue.lock();
        for (_, d) in bufs {
            q.pool.give(d);
        }
        copied.map_err(fail)
    }

    /// Submits one command of request `id`. `Ok(false)`: the queue is full (it was rung; poll
    /// and try again).
    #[allow(clippy::too_many_arguments)]
    fn submit(
        &self,
        queue: &Mutex<Queue>,
        cmd: Cmd,
        id: u32,
        tag: u64,
        slba: u64,
        nlb: u32,
        dma: Option<DmaBuf>,
    ) -> Result<bool, DriverError> {
        let mut q = queue.lock();
        let Some(qp) = &mut q.qp else {
            self.renew(&mut q)?;
            return Ok(false);
        };
        let submitted = match (cmd, dma) {
            (Cmd::Read, Some(d)) => qp.read(&self.ns, slba, nlb, d, tag),
            (Cmd::Write, Some(d)) => qp.write(&self.ns, slba, nlb, d, tag),
            _ => qp.flush(&self.ns, tag),
        };
        match submitted {
            Ok(()) => {
                q.reqs[id as usize].remaining += 1;
                Ok(true)
            }
            Err(r) => {
                q.ring();
                if let Some(buf) = r.buf {
                    q.pool.give(buf);
                }
                match r.error {
                    DriverError::QueueFull => Ok(false),
                    // The pair died with a controller reset or failure: replace it and retry.
                    DriverError::Reset | DriverError::ControllerFailed => {
                        self.renew(&mut q)?;
                        Ok(false)
                    }
                    e => Err(e),
                }
            }
        }
    }

    /// Replaces a queue pair that a reset or a controller failure killed: its commands fail
    /// (delivered to their requests), it is dropped, a failed controller is reset (at most once
    /// per [`RESET_INTERVAL`]; otherwise the command fails at once), and a new pair is created.
    fn renew(&self, q: &mut Queue) -> Result<(), DriverError> {
        if q.qp.is_some() {
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

    async fn transfer(&self, cmd: Cmd, lba: u64, mut buf: IoBuf) -> BufResult {
        let bs = self.ns.block_size;
        if let Err(e) = check_transfer(lba, buf.len(), bs, self.ns.blocks) {
            return (Err(e), buf);
        }
        let r = self.run(cmd, lba, Some(&mut buf)).await;
        (r, buf)
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
        // Flushes are always passed on; a controller without a cache completes them at once.
        true
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

    async fn flush(&self) -> Result<(), BackendError> {
        self.run(Cmd::Flush, 0, None).await
    }

    async fn write_zeroes(&self, lba: u64, blocks: u64) -> Result<(), BackendError> {
        check_range(lba, blocks, self.ns.blocks)?;
        let bs = u64::from(self.ns.block_size);
        let step = self.max_transfer as u64 / bs;
        let mut zeros = IoBuf::new((step.min(blocks) * bs) as usize);
        let mut at = lba;
        while at < lba + blocks {
            let n = step.min(lba + blocks - at);
            if n * bs != zeros.len() as u64 {
                zeros = IoBuf::new((n * bs) as usize);
            }
            self.run(Cmd::Write, at, Some(&mut zeros))
                .await
                .map_err(|e| match e {
                    BackendError::Nvme { source, .. } => BackendError::Nvme {
                        op: IoOp::WriteZeroes,
                        source,
                    },
                    e => e,
                })?;
            at += n;
        }
        Ok(())
    }

    async fn deallocate(&self, lba: u64, blocks: u64) -> Result<(), BackendError> {
        check_range(lba, blocks, self.ns.blocks)
    }
}
