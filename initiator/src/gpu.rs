//! GPU device memory as the destination of reads and the source of writes (feature `gpu`).
//!
//! Over NVMe/TCP the data arrives in host memory. A [`GpuStaging`] owns one CUDA stream and a
//! bounded ring of pinned (page-locked) host staging slots: each command's data is received
//! into a free slot (the slot is lent to the command, so the queue reads the socket straight
//! into pinned memory) and an asynchronous host-to-device copy from that slot is enqueued on
//! the stream as soon as the command completes, so the copy of one command runs while the next
//! command's data is still arriving. A slot is reused only after the copy that reads it has finished
//! (the stream writes a [`StreamMark`] ticket after each slot's work; waiting for a slot is a
//! load of that word, not a driver call). A read is complete only when its copies into device
//! memory are done.
//!
//! - [`GpuStaging::dest`] makes a [`ReadDest`] over a device slice, usable with the initiator's
//!   one read API ([`Namespace::read_into`]); [`GpuStaging::synchronize`] then waits, without
//!   blocking the runtime thread, until the data is in device memory. [`GpuStaging::read`]
//!   does both.
//! - [`GpuStaging::read_batch`] reads many small blocks into one slot's stage of mapped pinned
//!   memory (all in flight together); one scatter kernel reads the stage in place over the bus
//!   and puts each block at its destination offset (any byte alignment): one launch and one
//!   event per slot, no copy to the device.
//! - [`GpuStaging::write`] goes the other way: device -> pinned slot -> wire, the copy of the
//!   next piece overlapping the write of the current one.
//!
//! [`BlockSource`] abstracts where blocks come from, so the same staging code reads from a
//! remote [`Namespace`] or from local memory ([`MemSource`], the direct-attached baseline a
//! benchmark compares against).

use std::collections::VecDeque;
use std::future::Future;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ::gpu::{
    DeviceSlice, DeviceSliceMut, GpuContext, GpuError, GpuEvent, GpuStream, HostPinned,
    PinnedBuffer, StreamMark,
};
use nvmeof_cuda_kernels::{
    KernelError, KernelWorkspace, MappedStage, NvmfKernels, ScatterCopy, StageFlight, StageRefused,
};

use crate::buffer::{BufferError, Lent, LentBuffer, ReadDest};
use crate::{Error, Namespace};

/// The CUDA layer (`nvmeof-gpu`): contexts, device buffers, streams.
pub use ::gpu as cuda;
/// The kernels (`nvmeof-cuda-kernels`): scatter, pattern fill and verify, checksums.
pub use nvmeof_cuda_kernels as kernels;

/// Errors of the GPU staging path.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GpuIoError {
    /// The NVMe side failed (controller status, connection, timeout, bad range).
    #[error(transparent)]
    Io(#[from] Error),
    /// The CUDA side failed (no driver, out of memory, a failed copy).
    #[error(transparent)]
    Gpu(#[from] GpuError),
    /// A kernel launch was rejected or failed.
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// The request does not make sense (sizes, offsets, configuration).
    #[error("{0}")]
    InvalidArgument(String),
}

fn invalid(msg: impl Into<String>) -> GpuIoError {
    GpuIoError::InvalidArgument(msg.into())
}

/// Sizes of a [`GpuStaging`]'s pinned ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagingConfig {
    /// Number of pinned slots (at least 2: one filling while another is copied).
    pub slots: usize,
    /// Bytes per slot. Commands larger than a slot are staged through several slots; a batch
    /// of small reads fills at most one slot.
    pub slot_bytes: usize,
    /// Time each slot's device work with events ([`StagingStats::gpu_copy`]); costs one more
    /// driver call per copy.
    pub timing: bool,
}

impl Default for StagingConfig {
    fn default() -> Self {
        StagingConfig {
            slots: 4,
            slot_bytes: 1 << 20,
            timing: false,
        }
    }
}

impl StagingConfig {
    fn validate(&self) -> Result<(), GpuIoError> {
        if self.slots < 2 || self.slots > 1024 {
            return Err(invalid(format!(
                "staging slots = {}: must be between 2 and 1024",
                self.slots
            )));
        }
        if self.slot_bytes < 4096 || self.slot_bytes > 1 << 30 {
            return Err(invalid(format!(
                "staging slot size {} bytes: must be between 4 KiB and 1 GiB",
                self.slot_bytes
            )));
        }
        Ok(())
    }
}

/// Where the time of a [`GpuStaging`] went (cumulative since creation or the last
/// [`GpuStaging::take_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StagingStats {
    /// Bytes moved host -> device through the slots: copied, or read in place by the scatter
    /// kernel (batches).
    pub h2d_bytes: u64,
    /// Bytes copied device -> host through the slots (writes).
    pub d2h_bytes: u64,
    /// Asynchronous copies enqueued (either direction; batches are scatters, not copies).
    pub copies: u64,
    /// Scatter kernel launches (batched reads).
    pub scatters: u64,
    /// Time spent waiting for the source: network receive (or local memory reads), including
    /// the copy into the staging slot.
    pub source: Duration,
    /// Host time copying received data into pinned slots (part of `source` for reads through
    /// [`GpuStaging::dest`]); zero for data received straight into a slot.
    pub stage_copy: Duration,
    /// Bytes received straight into pinned slots lent to the commands (NVMe/TCP reads through
    /// [`GpuStaging::dest`]): no host copy.
    pub lent_bytes: u64,
    /// Device time of the copies and scatter launches, from events around each slot's work
    /// (with [`StagingConfig::timing`]).
    pub gpu_copy: Duration,
    /// Host time spent waiting for the GPU: for a free slot, or for a read's last copy.
    pub gpu_wait: Duration,
    /// Waits for a free slot that blocked the calling thread (inside `ReadDest::write_at`,
    /// which cannot yield); each lasts at most one slot's copy.
    pub blocking_waits: u64,
}

impl StagingStats {
    /// Adds `other` to `self`.
    pub fn merge(&mut self, other: &StagingStats) {
        self.h2d_bytes += other.h2d_bytes;
        self.d2h_bytes += other.d2h_bytes;
        self.copies += other.copies;
        self.scatters += other.scatters;
        self.source += other.source;
        self.stage_copy += other.stage_copy;
        self.lent_bytes += other.lent_bytes;
        self.gpu_copy += other.gpu_copy;
        self.gpu_wait += other.gpu_wait;
        self.blocking_waits += other.blocking_waits;
    }
}

/// Bookkeeping of the slot ring: which slots are free and the order in which busy ones were
/// handed to the stream (work on one stream completes in submission order).
#[derive(Debug)]
struct SlotRing {
    free: Vec<usize>,
    busy: VecDeque<usize>,
}

impl SlotRing {
    fn new(slots: usize) -> Self {
        SlotRing {
            free: (0..slots).rev().collect(),
            busy: VecDeque::with_capacity(slots),
        }
    }

    /// Whether a slot is free.
    fn has_free(&self) -> bool {
        !self.free.is_empty()
    }

    /// A free slot, if any.
    fn take_free(&mut self) -> Option<usize> {
        self.free.pop()
    }

    /// The slot whose work was submitted first (the one to wait for when none is free).
    fn oldest_busy(&self) -> Option<usize> {
        self.busy.front().copied()
    }

    /// The slot whose work was submitted last (waiting for it waits for all).
    fn newest_busy(&self) -> Option<usize> {
        self.busy.back().copied()
    }

    /// Marks `slot` as having work on the stream.
    fn submitted(&mut self, slot: usize) {
        debug_assert!(!self.busy.contains(&slot) && !self.free.contains(&slot));
        self.busy.push_back(slot);
    }

    /// Marks the oldest busy slot as free again; returns it.
    fn retire_oldest(&mut self) -> Option<usize> {
        let slot = self.busy.pop_front()?;
        self.free.push(slot);
        Some(slot)
    }

    /// Marks `slot` (taken but never submitted) as free again.
    fn give_back(&mut self, slot: usize) {
        self.free.push(slot);
    }

    fn busy_len(&self) -> usize {
        self.busy.len()
    }
}

/// One read of a batch: `blocks` blocks from `lba` to byte `dst_offset` of the destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuRead {
    /// First block.
    pub lba: u64,
    /// Number of blocks.
    pub blocks: u32,
    /// Byte offset in the destination (any alignment).
    pub dst_offset: u64,
}

/// How a list of reads is cut into batches.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Batch {
    /// Reads `range` of the list, packed back to back in one staging slot.
    Staged(Range<usize>),
    /// One read larger than a slot, streamed through the slots directly into its destination.
    Direct(usize),
}

/// Cuts `reads` into batches of at most `slot_bytes` staged bytes, in order, after checking
/// every read against the destination size. Pure bookkeeping (unit tested without a GPU).
fn plan_batches(
    reads: &[GpuRead],
    block_size: u32,
    slot_bytes: usize,
    dst_len: u64,
) -> Result<Vec<Batch>, GpuIoError> {
    let mut batches = Vec::new();
    let mut start = 0usize;
    let mut used = 0u64;
    for (i, r) in reads.iter().enumerate() {
        if r.blocks == 0 {
            return Err(invalid(format!("read {i}: zero blocks")));
        }
        let len = u64::from(r.blocks) * u64::from(block_size);
        if r.dst_offset
            .checked_add(len)
            .is_none_or(|end| end > dst_len)
        {
            return Err(invalid(format!(
                "read {i}: {len} bytes at destination offset {} exceed the {dst_len}-byte destination",
                r.dst_offset
            )));
        }
        if len > slot_bytes as u64 {
            if start < i {
                batches.push(Batch::Staged(start..i));
            }
            batches.push(Batch::Direct(i));
            start = i + 1;
            used = 0;
            continue;
        }
        if used + len > slot_bytes as u64 {
            batches.push(Batch::Staged(start..i));
            start = i;
            used = 0;
        }
        used += len;
    }
    if start < reads.len() {
        batches.push(Batch::Staged(start..reads.len()));
    }
    Ok(batches)
}

/// Where blocks come from: a remote namespace, or local memory for comparison.
pub trait BlockSource: Sync {
    /// Logical block size in bytes.
    fn block_size(&self) -> u32;

    /// Reads `dest.len()` bytes starting at block `lba` into `dest`.
    fn read_blocks<D: ReadDest + Send + ?Sized>(
        &self,
        lba: u64,
        dest: &mut D,
    ) -> impl Future<Output = Result<(), Error>> + Send;

    /// Reads each `(lba, dest)` of `reads`: `dest.len()` bytes starting at block `lba`, all
    /// in flight together. The default joins one [`read_blocks`](Self::read_blocks) future
    /// per read; a [`Namespace`] sends them as one batch ([`Namespace::read_many`]).
    fn read_many(
        &self,
        reads: &mut [(u64, &mut [u8])],
    ) -> impl Future<Output = Result<(), Error>> + Send {
        let reads: Vec<_> = reads
            .iter_mut()
            .map(|(lba, dest)| self.read_blocks(*lba, &mut **dest))
            .collect();
        async move { futures_util::future::try_join_all(reads).await.map(|_| ()) }
    }
}

impl BlockSource for Namespace {
    fn block_size(&self) -> u32 {
        Namespace::block_size(self)
    }

    fn read_blocks<D: ReadDest + Send + ?Sized>(
        &self,
        lba: u64,
        dest: &mut D,
    ) -> impl Future<Output = Result<(), Error>> + Send {
        self.read_into(lba, dest)
    }

    fn read_many(
        &self,
        reads: &mut [(u64, &mut [u8])],
    ) -> impl Future<Output = Result<(), Error>> + Send {
        self.read_all(reads)
    }
}

/// Blocks held in local memory: the direct-attached baseline (data already in host RAM, as
/// after a page-cache hit or a local NVMe read) that the staging path is compared with.
#[derive(Debug, Clone)]
pub struct MemSource {
    data: Arc<[u8]>,
    block_size: u32,
}

impl MemSource {
    /// Blocks of `block_size` bytes (a power of two, at least 512) over `data`, whose length
    /// must be a multiple of the block size.
    pub fn new(data: Arc<[u8]>, block_size: u32) -> Result<Self, GpuIoError> {
        if block_size < 512 || !block_size.is_power_of_two() {
            return Err(invalid(format!("block size {block_size}")));
        }
        if data.len() % block_size as usize != 0 {
            return Err(invalid(format!(
                "{} bytes is not a multiple of the block size {block_size}",
                data.len()
            )));
        }
        Ok(MemSource { data, block_size })
    }

    /// The bytes.
    pub fn data(&self) -> &[u8] {
        &self.data
    }
}

impl BlockSource for MemSource {
    fn block_size(&self) -> u32 {
        self.block_size
    }

    fn read_blocks<D: ReadDest + Send + ?Sized>(
        &self,
        lba: u64,
        dest: &mut D,
    ) -> impl Future<Output = Result<(), Error>> + Send {
        let len = dest.len();
        let range = lba
            .checked_mul(u64::from(self.block_size))
            .and_then(|start| Some(start..start.checked_add(len as u64)?))
            .filter(|r| r.end <= self.data.len() as u64 && len % self.block_size as usize == 0);
        let result = match range {
            Some(r) => dest
                .write_at(0, &self.data[r.start as usize..r.end as usize])
                .map_err(|e| Error::Buffer(e.to_string())),
            None => Err(Error::InvalidArgument(format!(
                "{len} bytes at block {lba} are outside the {}-byte source",
                self.data.len()
            ))),
        };
        async move {
            // The copy is already done. Spend one unit of the task's cooperative budget, so a
            // loop over this source yields now and then instead of starving the runtime's
            // timers and other tasks.
            tokio::task::consume_budget().await;
            result
        }
    }
}

/// One pinned slot, its mapped stage (for batches, allocated on first use) and the events that
/// bracket the stream work reading it.
struct Slot {
    /// `None` while lent to a command, or after a lent buffer was not given back (allocated
    /// again on next use).
    host: Option<PinnedBuffer>,
    stage: Option<BatchStage>,
    /// The staging's mark ticket written after the slot's last work (0: none yet).
    ticket: u32,
    /// Events around the slot's work, recorded only with [`StagingConfig::timing`].
    start: GpuEvent,
    done: GpuEvent,
}

/// The mapped pinned memory a slot receives a batch of reads into, which the scatter kernel
/// reads in place: the host's, or read by the slot's last kernel (the stage is the host's
/// again once the stream has passed the slot's ticket).
enum BatchStage {
    Idle(MappedStage),
    Flight(StageFlight),
}

/// Pinned staging between the network and device memory: one stream, a bounded ring of pinned
/// slots, and the kernels for batched reads. One per task that moves data (it is `Send`, not
/// shared); several stagings on one context run their copies concurrently.
pub struct GpuStaging {
    ctx: GpuContext,
    stream: GpuStream,
    cfg: StagingConfig,
    slots: Vec<Slot>,
    ring: SlotRing,
    /// Written by the stream after each slot's work: how far the stream got.
    mark: StreamMark,
    kernels: Option<(Arc<NvmfKernels>, KernelWorkspace)>,
    copies: Vec<ScatterCopy>,
    stats: StagingStats,
}

impl std::fmt::Debug for GpuStaging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuStaging")
            .field("stream", &self.stream)
            .field("cfg", &self.cfg)
            .field("busy", &self.ring.busy_len())
            .finish()
    }
}

/// How many times [`wait_mark`] looks at the mark, yielding in between, before it waits on the
/// blocking pool: a few milliseconds, longer than a slot's copy or scatter takes when the GPU
/// is not busy with other work.
const MARK_LOOKS: u32 = 4096;

/// Every how many looks a wait asks the driver whether the stream failed (a failed stream never
/// writes its ticket) or has finished.
const MARK_CHECK_EVERY: u32 = 256;

/// Waits until `stream` has written `ticket` to `mark` without blocking the runtime thread:
/// looks at the mark (one load), yielding to other tasks in between, asks the driver now and
/// then whether the stream failed, and after [`MARK_LOOKS`] looks waits for the stream on the
/// blocking pool. Outside a tokio runtime that last wait blocks the calling thread.
async fn wait_mark(mark: &StreamMark, stream: &GpuStream, ticket: u32) -> Result<(), GpuError> {
    for look in 1..=MARK_LOOKS {
        if mark.passed(ticket) {
            return Ok(());
        }
        if look % MARK_CHECK_EVERY == 0 && stream.is_idle()? {
            return Ok(());
        }
        tokio::task::yield_now().await;
    }
    if mark.passed(ticket) {
        return Ok(());
    }
    let stream = stream.clone();
    off_the_runtime("cuStreamSynchronize", move || stream.synchronize()).await
}

/// Runs the blocking `wait` (a `call` of the driver) on the blocking pool, or on the calling
/// thread outside a tokio runtime.
async fn off_the_runtime(
    call: &'static str,
    wait: impl FnOnce() -> Result<(), GpuError> + Send + 'static,
) -> Result<(), GpuError> {
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        return wait();
    };
    match rt.spawn_blocking(wait).await {
        Ok(r) => r,
        Err(e) => Err(GpuError::Driver {
            call,
            code: 0,
            name: String::from("join"),
            description: e.to_string(),
        }),
    }
}

/// [`wait_mark`] on the calling thread: spins on the mark, asking the driver now and then
/// whether the stream failed or has finished.
fn wait_mark_blocking(mark: &StreamMark, stream: &GpuStream, ticket: u32) -> Result<(), GpuError> {
    let mut looks = 0u32;
    while !mark.passed(ticket) {
        looks = looks.wrapping_add(1);
        if looks % MARK_CHECK_EVERY == 0 && stream.is_idle()? {
            break;
        }
        std::hint::spin_loop();
    }
    Ok(())
}

/// Waits for `event` without blocking the runtime thread on the GPU: polls it a few times,
/// yielding to other tasks in between, then waits for it on the blocking pool. Outside a
/// tokio runtime (no blocking pool) it waits on the calling thread.
pub async fn wait_event(event: &Arc<GpuEvent>) -> Result<(), GpuError> {
    for _ in 0..32 {
        if event.is_complete()? {
            return Ok(());
        }
        tokio::task::yield_now().await;
    }
    let event = Arc::clone(event);
    off_the_runtime("cuEventSynchronize", move || event.synchronize()).await
}

impl GpuStaging {
    /// A staging ring on a new stream of `ctx`.
    pub fn new(ctx: &GpuContext, cfg: StagingConfig) -> Result<Self, GpuIoError> {
        cfg.validate()?;
        let stream = ctx.new_stream()?;
        let slots = (0..cfg.slots)
            .map(|_| {
                Ok(Slot {
                    host: Some(ctx.alloc_pinned(cfg.slot_bytes)?),
                    stage: None,
                    ticket: 0,
                    start: ctx.new_event(cfg.timing)?,
                    done: ctx.new_event(cfg.timing)?,
                })
            })
            .collect::<Result<Vec<_>, GpuError>>()?;
        Ok(GpuStaging {
            ctx: ctx.clone(),
            stream,
            cfg,
            slots,
            ring: SlotRing::new(cfg.slots),
            mark: ctx.new_mark()?,
            kernels: None,
            copies: Vec::new(),
            stats: StagingStats::default(),
        })
    }

    /// Adds the kernels [`read_batch`](Self::read_batch) needs (loaded once per context and
    /// shared).
    pub fn with_kernels(mut self, kernels: Arc<NvmfKernels>) -> Result<Self, GpuIoError> {
        if !kernels.context().same_as(&self.ctx) {
            return Err(GpuError::ContextMismatch.into());
        }
        let ws = KernelWorkspace::new(&self.stream)?;
        self.kernels = Some((kernels, ws));
        Ok(self)
    }

    /// The stream all copies and kernels of this staging run on. Work enqueued on it after a
    /// read is ordered after the read's copies.
    pub fn stream(&self) -> &GpuStream {
        &self.stream
    }

    /// The kernel workspace on this staging's stream, when kernels were added.
    pub fn kernels(&mut self) -> Option<(&NvmfKernels, &mut KernelWorkspace)> {
        self.kernels.as_mut().map(|(k, ws)| (&**k, ws))
    }

    /// The configuration.
    pub fn config(&self) -> StagingConfig {
        self.cfg
    }

    /// Where the time went so far.
    pub fn stats(&self) -> &StagingStats {
        &self.stats
    }

    /// Returns the statistics and resets them.
    pub fn take_stats(&mut self) -> StagingStats {
        std::mem::take(&mut self.stats)
    }

    /// A [`ReadDest`] that stages every command's data into the slots and copies it into
    /// `dst` at the command's offset. The copies are enqueued, not finished, when the read
    /// returns: call [`synchronize`](Self::synchronize) (or use [`read`](Self::read)).
    pub fn dest<'s, 'd>(&'s mut self, dst: DeviceSliceMut<'d>) -> GpuReadDest<'s, 'd> {
        GpuReadDest {
            staging: self,
            dst,
            lent: Vec::new(),
            hold: false,
            held: Vec::new(),
        }
    }

    /// Reads `dst.len()` bytes from block `lba` of `src` into device memory; returns when the
    /// data is in device memory.
    pub async fn read<S: BlockSource>(
        &mut self,
        src: &S,
        lba: u64,
        dst: DeviceSliceMut<'_>,
    ) -> Result<(), GpuIoError> {
        let t = Instant::now();
        let result = {
            let mut dest = self.dest(dst);
            src.read_blocks(lba, &mut dest).await
        };
        self.stats.source += t.elapsed();
        result?;
        self.synchronize().await
    }

    /// Like [`read`](Self::read), but the copies of the data received straight into pinned
    /// slots are enqueued only once `gate` (given how many bytes are waiting) has resolved.
    ///
    /// Over loopback, a host that copies each MiB to the GPU the moment its receiving core
    /// wrote it moves about a quarter less than one that lets a few more MiB arrive first
    /// (`benches/scripts/tcp-gpu-ceiling.py --why`, the `lag` row); a caller with several
    /// reads in flight on one thread can have `gate` wait until that much more has arrived.
    /// The slots held meanwhile are neither free nor copying; when a command finds none free
    /// the held copies are enqueued at once.
    pub async fn read_gated<S, F, G>(
        &mut self,
        src: &S,
        lba: u64,
        dst: DeviceSliceMut<'_>,
        gate: G,
    ) -> Result<(), GpuIoError>
    where
        S: BlockSource,
        G: FnOnce(usize) -> F,
        F: Future<Output = ()>,
    {
        let t = Instant::now();
        let mut source = Duration::ZERO;
        let result = async {
            let mut dest = self.dest(dst);
            dest.hold = true;
            let r = src.read_blocks(lba, &mut dest).await;
            source = t.elapsed();
            r?;
            if !dest.held.is_empty() {
                gate(dest.held_bytes()).await;
            }
            dest.release_held()
        }
        .await;
        self.stats.source += source;
        result?;
        self.synchronize().await
    }

    /// Waits until every copy enqueued so far has finished, without blocking the runtime
    /// thread; frees all slots.
    pub async fn synchronize(&mut self) -> Result<(), GpuIoError> {
        let Some(last) = self.ring.newest_busy() else {
            return Ok(());
        };
        let t = Instant::now();
        wait_mark(&self.mark, &self.stream, self.slots[last].ticket).await?;
        self.stats.gpu_wait += t.elapsed();
        while let Some(slot) = self.ring.retire_oldest() {
            self.account(slot);
        }
        Ok(())
    }

    /// Marks slot `idx` as having work on the stream, enqueued just before: the stream writes
    /// the slot's ticket once that work is done.
    fn submitted(&mut self, idx: usize) -> Result<(), GpuError> {
        if self.cfg.timing {
            self.stream.record(&self.slots[idx].done)?;
        }
        self.slots[idx].ticket = self.mark.enqueue(&self.stream)?;
        self.ring.submitted(idx);
        Ok(())
    }

    /// Adds the device time of a slot's finished work to the statistics.
    fn account(&mut self, slot: usize) {
        if !self.cfg.timing {
            return;
        }
        let s = &self.slots[slot];
        if let Ok(ms) = s.start.elapsed_ms(&s.done) {
            self.stats.gpu_copy += Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3);
        }
    }

    /// A free slot; waits (blocking the thread, for at most one slot's copy) when none is.
    fn acquire_blocking(&mut self) -> Result<usize, GpuIoError> {
        if let Some(slot) = self.ring.take_free() {
            return Ok(slot);
        }
        let oldest = self.ring.oldest_busy().ok_or_else(|| invalid("no slots"))?;
        let ticket = self.slots[oldest].ticket;
        if !self.mark.passed(ticket) {
            let t = Instant::now();
            wait_mark_blocking(&self.mark, &self.stream, ticket)?;
            self.stats.gpu_wait += t.elapsed();
            self.stats.blocking_waits += 1;
        }
        self.retire_and_take()
    }

    /// A free slot; waits asynchronously when none is.
    async fn acquire(&mut self) -> Result<usize, GpuIoError> {
        if let Some(slot) = self.ring.take_free() {
            return Ok(slot);
        }
        let oldest = self.ring.oldest_busy().ok_or_else(|| invalid("no slots"))?;
        let t = Instant::now();
        wait_mark(&self.mark, &self.stream, self.slots[oldest].ticket).await?;
        self.stats.gpu_wait += t.elapsed();
        self.retire_and_take()
    }

    fn retire_and_take(&mut self) -> Result<usize, GpuIoError> {
        if let Some(slot) = self.ring.retire_oldest() {
            self.account(slot);
        }
        self.ring.take_free().ok_or_else(|| invalid("no free slot"))
    }

    /// Stages `data` (at most one slot) and enqueues its copy to `dst`.
    fn stage_h2d(&mut self, data: &[u8], dst: &mut DeviceSliceMut<'_>) -> Result<(), GpuIoError> {
        let idx = self.acquire_blocking()?;
        let r = self.stage_into(idx, data, dst);
        if r.is_err() {
            self.ring.give_back(idx);
        }
        r
    }

    fn stage_into(
        &mut self,
        idx: usize,
        data: &[u8],
        dst: &mut DeviceSliceMut<'_>,
    ) -> Result<(), GpuIoError> {
        let n = data.len();
        let t = Instant::now();
        self.host_mut(idx)?.as_mut_slice()?[..n].copy_from_slice(data);
        self.stats.stage_copy += t.elapsed();
        self.submit_h2d(idx, n, dst)
    }

    /// Slot `idx`'s pinned memory, allocated again if a lent buffer never came back.
    fn host_mut(&mut self, idx: usize) -> Result<&mut PinnedBuffer, GpuIoError> {
        let slot = self
            .slots
            .get_mut(idx)
            .ok_or_else(|| invalid("no such staging slot"))?;
        if slot.host.is_none() {
            slot.host = Some(self.ctx.alloc_pinned(self.cfg.slot_bytes)?);
        }
        slot.host
            .as_mut()
            .ok_or_else(|| invalid("staging slot without memory"))
    }

    /// Enqueues the copy of the first `n` bytes of slot `idx` to `dst`; the slot is busy until
    /// it finished.
    fn submit_h2d(
        &mut self,
        idx: usize,
        n: usize,
        dst: &mut DeviceSliceMut<'_>,
    ) -> Result<(), GpuIoError> {
        let slot = &self.slots[idx];
        let host = slot
            .host
            .as_ref()
            .ok_or_else(|| invalid("staging slot without memory"))?;
        if self.cfg.timing {
            self.stream.record(&slot.start)?;
        }
        self.stream.copy_h2d_async(&host.slice(..n)?, dst)?;
        self.submitted(idx)?;
        self.stats.h2d_bytes += n as u64;
        self.stats.copies += 1;
        Ok(())
    }

    /// Takes a free slot (waiting for the oldest copy if none is free) and hands its pinned
    /// memory over for a command to be received into.
    fn lend_slot(&mut self) -> Result<LentSlot, GpuIoError> {
        let idx = self.acquire_blocking()?;
        match self.take_host(idx) {
            Ok(host) => Ok(LentSlot { idx, host }),
            Err(e) => {
                self.ring.give_back(idx);
                Err(e)
            }
        }
    }

    /// Slot `idx`'s pinned memory, out of the slot and ready for the host alone.
    fn take_host(&mut self, idx: usize) -> Result<HostPinned, GpuIoError> {
        self.host_mut(idx)?;
        let buf = self.slots[idx]
            .host
            .take()
            .ok_or_else(|| invalid("staging slot without memory"))?;
        Ok(buf.into_host()?)
    }

    /// Reads many small blocks: each batch of reads (as many as fit in one slot) is in flight
    /// together into the slot's stage of mapped pinned memory, which the scatter kernel reads
    /// in place to put each block at its destination offset; the next batch is received while
    /// the previous one is scattered. Reads larger than a slot go through [`read`](Self::read).
    /// Destinations must not overlap. Returns when all data is in device memory.
    pub async fn read_batch<S: BlockSource>(
        &mut self,
        src: &S,
        reads: &[GpuRead],
        dst: &mut DeviceSliceMut<'_>,
    ) -> Result<(), GpuIoError> {
        if self.kernels.is_none() {
            return Err(invalid(
                "read_batch needs the scatter kernel: create the staging with with_kernels",
            ));
        }
        let bs = src.block_size();
        for batch in plan_batches(reads, bs, self.cfg.slot_bytes, dst.len() as u64)? {
            match batch {
                Batch::Direct(i) => {
                    let r = reads[i];
                    let len = r.blocks as usize * bs as usize;
                    let off = r.dst_offset as usize;
                    self.read(src, r.lba, dst.slice_mut(off..off + len)?)
                        .await?;
                }
                Batch::Staged(range) => {
                    self.stage_batch(src, &reads[range], bs, dst).await?;
                }
            }
        }
        self.synchronize().await
    }

    async fn stage_batch<S: BlockSource>(
        &mut self,
        src: &S,
        reads: &[GpuRead],
        bs: u32,
        dst: &mut DeviceSliceMut<'_>,
    ) -> Result<(), GpuIoError> {
        let idx = self.acquire().await?;
        let r = self.fill_and_scatter(idx, src, reads, bs, dst).await;
        if r.is_err() {
            self.ring.give_back(idx);
        }
        r
    }

    async fn fill_and_scatter<S: BlockSource>(
        &mut self,
        idx: usize,
        src: &S,
        reads: &[GpuRead],
        bs: u32,
        dst: &mut DeviceSliceMut<'_>,
    ) -> Result<(), GpuIoError> {
        let bs = bs as usize;
        let total: usize = reads.iter().map(|r| r.blocks as usize * bs).sum();
        // Where each read lands; bad destinations are rejected before any I/O.
        self.copies.clear();
        let mut off = 0u64;
        for r in reads {
            let len = u64::from(r.blocks) * bs as u64;
            self.copies.push(ScatterCopy {
                src_offset: off,
                dst_offset: r.dst_offset,
                len,
            });
            off += len;
        }
        // Reject bad destinations before anything is enqueued.
        nvmeof_cuda_kernels::plan::validate_scatter(total as u64, dst.len() as u64, &self.copies)?;
        let mut stage = self.take_stage(idx, reads.len(), bs)?;
        // Receive every read of the batch into its place in the stage, all in flight together.
        let t = Instant::now();
        let received = {
            let mut rest = &mut stage.data_mut()[..total];
            let mut parts = Vec::with_capacity(reads.len());
            for r in reads {
                let (head, tail) = rest.split_at_mut(r.blocks as usize * bs);
                rest = tail;
                parts.push((r.lba, head));
            }
            src.read_many(&mut parts).await
        };
        self.stats.source += t.elapsed();
        let slot = &mut self.slots[idx];
        if let Err(e) = received {
            slot.stage = Some(BatchStage::Idle(stage));
            return Err(e.into());
        }
        // One kernel scatters the stage in place to the destinations.
        let Some((kernels, _)) = self.kernels.as_ref() else {
            slot.stage = Some(BatchStage::Idle(stage));
            return Err(invalid("no kernels"));
        };
        if self.cfg.timing {
            self.stream.record(&slot.start)?;
        }
        match kernels.scatter_staged(&self.stream, stage, dst, &self.copies) {
            Ok(flight) => slot.stage = Some(BatchStage::Flight(flight)),
            Err(refused) => {
                let StageRefused { error, stage } = *refused;
                slot.stage = Some(BatchStage::Idle(stage));
                return Err(error.into());
            }
        }
        self.submitted(idx)?;
        self.stats.h2d_bytes += total as u64;
        self.stats.scatters += 1;
        Ok(())
    }

    /// Slot `idx`'s stage for a batch of `reads` reads of blocks of `bs` bytes, the host's
    /// (the slot is free: its last kernel has run), allocated on first use or when the batch
    /// has more reads than the stage has room for.
    fn take_stage(
        &mut self,
        idx: usize,
        reads: usize,
        bs: usize,
    ) -> Result<MappedStage, GpuIoError> {
        let stage = match self.slots[idx].stage.take() {
            Some(BatchStage::Idle(s)) => Some(s),
            Some(BatchStage::Flight(f)) => Some(f.finish()?),
            None => None,
        };
        match stage {
            Some(s) if s.copies() >= reads => Ok(s),
            _ => {
                let Some((kernels, _)) = self.kernels.as_ref() else {
                    return Err(invalid("no kernels"));
                };
                let copies = (self.cfg.slot_bytes / bs.max(1)).max(reads);
                Ok(kernels.new_stage(self.cfg.slot_bytes, copies)?)
            }
        }
    }

    /// Writes `src` (a whole number of blocks) to `ns` from block `lba`: each slot-sized piece
    /// is copied device -> pinned on the stream and written when its copy is done, while the
    /// copies of the next pieces run. Returns when every write completed.
    pub async fn write(
        &mut self,
        ns: &Namespace,
        lba: u64,
        src: &DeviceSlice<'_>,
    ) -> Result<(), GpuIoError> {
        let bs = ns.block_size() as usize;
        let total = src.len();
        if total == 0 || total % bs != 0 {
            return Err(invalid(format!(
                "write of {total} bytes is not a non-zero multiple of the block size {bs}"
            )));
        }
        if self.cfg.slot_bytes < bs {
            return Err(invalid("staging slots are smaller than a block"));
        }
        // Finish earlier work so that every busy slot below belongs to this write.
        self.synchronize().await?;
        let piece = self.cfg.slot_bytes / bs * bs;
        let mut queued: VecDeque<(usize, usize, usize)> = VecDeque::new();
        let mut next = 0usize;
        let result = async {
            while next < total || !queued.is_empty() {
                // Keep every free slot busy with the copies of the next pieces.
                while next < total {
                    let Some(idx) = self.ring.take_free() else {
                        break;
                    };
                    let n = piece.min(total - next);
                    queued.push_back((idx, next, n));
                    self.host_mut(idx)?;
                    let slot = &mut self.slots[idx];
                    let Some(host) = slot.host.as_mut() else {
                        return Err(invalid("staging slot without memory"));
                    };
                    if self.cfg.timing {
                        self.stream.record(&slot.start)?;
                    }
                    self.stream
                        .copy_d2h_async(&src.slice(next..next + n)?, &mut host.slice_mut(..n)?)?;
                    self.submitted(idx)?;
                    self.stats.d2h_bytes += n as u64;
                    self.stats.copies += 1;
                    next += n;
                }
                let Some((idx, off, n)) = queued.pop_front() else {
                    break;
                };
                let t = Instant::now();
                wait_mark(&self.mark, &self.stream, self.slots[idx].ticket).await?;
                self.stats.gpu_wait += t.elapsed();
                if self.ring.retire_oldest() != Some(idx) {
                    return Err(invalid("staging slots retired out of order"));
                }
                self.account(idx);
                let t = Instant::now();
                let data = &self.host_mut(idx)?.as_slice()?[..n];
                ns.write(lba + (off / bs) as u64, data).await?;
                self.stats.source += t.elapsed();
            }
            Ok(())
        }
        .await;
        if result.is_err() {
            // Leave no slot half-used: wait for the copies still queued.
            let _ = self.synchronize().await;
        }
        result
    }
}

/// A device slice as the destination of the initiator's reads (see [`GpuStaging::dest`]).
///
/// Over NVMe/TCP it lends each command (up to a slot in size) a free pinned slot, which the
/// queue receives the data into, and enqueues the slot's copy to the device when the command
/// completes. Otherwise (larger commands, no slot free because all are lent, NVMe/RDMA) each
/// `write_at` copies the command's data into free slots and enqueues their copies. When every
/// slot is still being copied it waits for the oldest copy (blocking, at most one slot's copy
/// time, counted in [`StagingStats::blocking_waits`]).
pub struct GpuReadDest<'s, 'd> {
    staging: &'s mut GpuStaging,
    dst: DeviceSliceMut<'d>,
    /// Slots lent to commands and not yet back.
    lent: Vec<usize>,
    /// Whether the copies of slots that come back filled wait for [`Self::release_held`].
    hold: bool,
    /// Filled slots whose copies wait: slot, offset in `dst`, length.
    held: Vec<(usize, usize, usize)>,
}

impl GpuReadDest<'_, '_> {
    /// Bytes received into slots whose copies are held.
    fn held_bytes(&self) -> usize {
        self.held.iter().map(|&(_, _, len)| len).sum()
    }

    /// Enqueues the held copies, in the order their commands completed.
    fn release_held(&mut self) -> Result<(), GpuIoError> {
        let mut held = std::mem::take(&mut self.held).into_iter();
        while let Some((idx, offset, len)) = held.next() {
            let submitted = self
                .dst
                .slice_mut(offset..offset + len)
                .map_err(GpuIoError::from)
                .and_then(|mut dst| self.staging.submit_h2d(idx, len, &mut dst));
            if let Err(e) = submitted {
                self.staging.ring.give_back(idx);
                for (idx, _, _) in held {
                    self.staging.ring.give_back(idx);
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// Before taking a slot: with none free, the held copies go now, so that a slot frees up.
    fn unhold_if_full(&mut self) -> Result<(), GpuIoError> {
        if !self.held.is_empty() && !self.staging.ring.has_free() {
            self.release_held()?;
        }
        Ok(())
    }
}

/// A staging slot's pinned memory while a command receives into it.
struct LentSlot {
    idx: usize,
    host: HostPinned,
}

impl LentBuffer for LentSlot {
    fn bytes(&self) -> &[u8] {
        self.host.as_slice()
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        self.host.as_mut_slice()
    }

    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send> {
        self
    }
}

impl Drop for GpuReadDest<'_, '_> {
    fn drop(&mut self) {
        // Slots of abandoned commands: their memory goes with the command; the slot gets new
        // memory when next used.
        for idx in self.lent.drain(..) {
            self.staging.ring.give_back(idx);
        }
        // Held copies never enqueued (the read failed or went): the slots are free again.
        for (idx, _, _) in self.held.drain(..) {
            self.staging.ring.give_back(idx);
        }
    }
}

impl std::fmt::Debug for GpuReadDest<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuReadDest")
            .field("dst", &self.dst)
            .finish()
    }
}

impl ReadDest for GpuReadDest<'_, '_> {
    fn len(&self) -> usize {
        self.dst.len()
    }

    fn write_at(&mut self, offset: usize, data: &[u8]) -> Result<(), BufferError> {
        if offset
            .checked_add(data.len())
            .is_none_or(|end| end > self.dst.len())
        {
            return Err("offset outside the device buffer".into());
        }
        self.unhold_if_full()?;
        let slot = self.staging.cfg.slot_bytes;
        for (i, piece) in data.chunks(slot).enumerate() {
            let off = offset + i * slot;
            let mut dst = self.dst.slice_mut(off..off + piece.len())?;
            self.staging.stage_h2d(piece, &mut dst)?;
        }
        Ok(())
    }

    fn lend(&mut self, offset: usize, len: usize) -> Option<Lent> {
        let fits = offset
            .checked_add(len)
            .is_some_and(|end| end <= self.dst.len());
        if !fits || len == 0 || len > self.staging.cfg.slot_bytes {
            return None;
        }
        self.unhold_if_full().ok()?;
        // No free slot and none being copied (all lent): the command uses its own buffer.
        let slot = self.staging.lend_slot().ok()?;
        self.lent.push(slot.idx);
        Some(Lent::Other(Box::new(slot)))
    }

    fn take_back(
        &mut self,
        offset: usize,
        len: usize,
        buf: Lent,
        filled: bool,
    ) -> Result<(), BufferError> {
        let Lent::Other(buf) = buf else {
            return Err("a buffer this destination did not lend".into());
        };
        let Ok(slot) = buf.into_any().downcast::<LentSlot>() else {
            return Err("a buffer this destination did not lend".into());
        };
        let LentSlot { idx, host } = *slot;
        self.lent.retain(|&i| i != idx);
        let staging = &mut *self.staging;
        staging.slots[idx].host = Some(host.into_pinned());
        if !filled {
            staging.ring.give_back(idx);
            return Ok(());
        }
        if self.hold {
            staging.stats.lent_bytes += len as u64;
            self.held.push((idx, offset, len));
            return Ok(());
        }
        let submitted = self
            .dst
            .slice_mut(offset..offset + len)
            .map_err(GpuIoError::from)
            .and_then(|mut dst| staging.submit_h2d(idx, len, &mut dst));
        match submitted {
            Ok(()) => {
                staging.stats.lent_bytes += len as u64;
                Ok(())
            }
            Err(e) => {
                staging.ring.give_back(idx);
                Err(e.into())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(lba: u64, blocks: u32, dst_offset: u64) -> GpuRead {
        GpuRead {
            lba,
            blocks,
            dst_offset,
        }
    }

    #[test]
    fn slot_ring_reuses_in_submission_order() {
        let mut ring = SlotRing::new(3);
        let a = ring.take_free().unwrap();
        let b = ring.take_free().unwrap();
        let c = ring.take_free().unwrap();
        assert_eq!((a, b, c), (0, 1, 2));
        assert_eq!(ring.take_free(), None);
        ring.submitted(a);
        ring.submitted(b);
        ring.give_back(c);
        assert_eq!(ring.oldest_busy(), Some(a));
        assert_eq!(ring.newest_busy(), Some(b));
        assert_eq!(ring.busy_len(), 2);
        assert_eq!(ring.take_free(), Some(c));
        ring.submitted(c);
        assert_eq!(ring.retire_oldest(), Some(a));
        assert_eq!(ring.take_free(), Some(a));
        assert_eq!(ring.oldest_busy(), Some(b));
        assert_eq!(ring.retire_oldest(), Some(b));
        assert_eq!(ring.retire_oldest(), Some(c));
        assert_eq!(ring.retire_oldest(), None);
        assert_eq!(ring.newest_busy(), None);
    }

    #[test]
    fn batches_fill_slots_in_order() {
        // 4 KiB blocks, 16 KiB slots: 3 + 1 blocks, then 2 + 2, then a 5-block read alone.
        let reads = [
            read(0, 3, 0),
            read(9, 1, 1 << 20),
            read(4, 2, 12288),
            read(7, 2, 100_000),
            read(50, 5, 200_001),
            read(60, 1, 300_003),
        ];
        let plan = plan_batches(&reads, 4096, 16384, 1 << 21).unwrap();
        assert_eq!(
            plan,
            vec![
                Batch::Staged(0..2),
                Batch::Staged(2..4),
                Batch::Direct(4),
                Batch::Staged(5..6),
            ]
        );
        assert!(plan_batches(&[], 4096, 16384, 10).unwrap().is_empty());
        // 512-byte blocks: 32 one-block reads fill exactly one 16 KiB slot.
        let small: Vec<_> = (0..33).map(|i| read(i, 1, i * 513)).collect();
        assert_eq!(
            plan_batches(&small, 512, 16384, 1 << 20).unwrap(),
            vec![Batch::Staged(0..32), Batch::Staged(32..33)]
        );
    }

    #[test]
    fn batches_reject_bad_reads() {
        assert!(matches!(
            plan_batches(&[read(0, 0, 0)], 4096, 16384, 1 << 20),
            Err(GpuIoError::InvalidArgument(_))
        ));
        assert!(plan_batches(&[read(0, 1, 4096)], 4096, 16384, 8191).is_err());
        assert!(plan_batches(&[read(0, 1, 4095)], 4096, 16384, 8191).is_ok());
        assert!(plan_batches(&[read(0, 1, u64::MAX)], 4096, 16384, u64::MAX).is_err());
    }

    #[test]
    fn staging_config_limits() {
        assert!(StagingConfig::default().validate().is_ok());
        let bad = |slots, slot_bytes| {
            StagingConfig {
                slots,
                slot_bytes,
                timing: false,
            }
            .validate()
            .is_err()
        };
        assert!(bad(1, 1 << 20));
        assert!(bad(4, 100));
        assert!(bad(4, (1 << 30) + 1));
        assert!(!bad(2, 4096));
    }

    #[tokio::test]
    async fn mem_source_reads_and_rejects_out_of_range() {
        let data: Arc<[u8]> = (0..8192u32).map(|i| (i % 251) as u8).collect();
        let src = MemSource::new(data.clone(), 512).unwrap();
        let mut buf = vec![0u8; 1024];
        src.read_blocks(3, &mut buf).await.unwrap();
        assert_eq!(&buf[..], &data[1536..2560]);
        assert!(src.read_blocks(15, &mut buf).await.is_err());
        assert!(src.read_blocks(u64::MAX, &mut buf).await.is_err());
        let mut odd = vec![0u8; 100];
        assert!(src.read_blocks(0, &mut odd).await.is_err());
        assert!(MemSource::new(data.clone(), 500).is_err());
        assert!(MemSource::new(Arc::from(vec![0u8; 1000]), 512).is_err());
    }

    /// Compiles only if the staging futures can move between threads (`tokio::spawn`).
    #[allow(dead_code)]
    fn staging_futures_are_send(
        s: &mut GpuStaging,
        ns: &Namespace,
        mem: &MemSource,
        dst: DeviceSliceMut<'_>,
        reads: &[GpuRead],
    ) {
        fn send<T: Send>(_: T) {}
        send(s.read(ns, 0, dst));
        send(s.read_batch(mem, reads, &mut dst_of(s)));
        send(s.synchronize());
    }

    #[allow(dead_code)]
    fn dst_of(_: &GpuStaging) -> DeviceSliceMut<'static> {
        unimplemented!()
    }

    #[test]
    fn staging_without_a_driver_is_a_typed_error() {
        if ::gpu::driver_available() {
            return;
        }
        let err = GpuContext::new(0).unwrap_err();
        assert!(err.is_unavailable());
    }
}
