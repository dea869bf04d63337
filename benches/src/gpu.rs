//! The `gpu` destination: read data lands in GPU memory.
//!
//! [`GpuPath`] wraps a mode's path; a read completes only once its data is in device memory.
//! Small blocks (up to [`GATHER_MAX_BLOCK`]) go through a gather per worker: each buffer owns
//! a part of the worker's mapped pinned memory, which its read lends to the queue (over
//! NVMe/TCP the queue puts the data there from its receive buffer, or from the socket for
//! PDUs of 8 KiB and more), and the reads that complete together leave for the GPU as one
//! batch: one scatter kernel that reads those parts in place over the bus and writes each
//! block to its buffer's place in the worker's device memory, with one stream mark the host
//! polls with a load, instead of a copy, an event and event polls per read (the copy engine
//! takes microseconds per copy however small, and every driver call costs the CPU a
//! microsecond or more).
//! Larger blocks go one by one through a [`GpuStaging`] per buffer (the NVMe/TCP queue
//! receives straight into its pinned slot, then one copy; with `copy_lag` the copy waits until
//! that many bytes more of the worker's data have landed, or none is on its way:
//! [`crate::lag`]). In DAS mode a memory backend copies its blocks into the receiving buffer
//! (the best local path, as `gpu_loader`'s RAM -> HBM).
//! With verify on, every read's device data is copied back (asynchronously, into pinned
//! memory) and checked against the pattern. Writes (the prefill included) go through the
//! wrapped path from host memory.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use blockdev::{AnyBackend, Backend, IoBuf};
use nvmeof_initiator::gpu::cuda::{
    DeviceBuffer, DeviceSlice, GpuContext, GpuError, GpuEvent, GpuStream, PinnedBuffer, PinnedChunk,
};
use nvmeof_initiator::gpu::kernels::{ChunkFlight, MappedStage, NvmfKernels};
use nvmeof_initiator::gpu::{BlockSource, GpuStaging, StagingConfig, wait_event};
use nvmeof_initiator::{BufferError, Lent, LentBuffer, Namespace, ReadDest};
use parking_lot::Mutex;

use crate::gather::{Batches, Waits};
use crate::lag::Lag;
use crate::path::{DasPath, IoPath, NsGeometry, PathError, TcpPath};

/// A path whose namespaces can feed a [`GpuStaging`].
pub trait GpuSource: IoPath {
    /// Where the staging reads blocks from.
    type Source: BlockSource + Send + Sync + 'static;

    /// The source of namespace index `ns` on queue `queue`.
    fn source(&self, queue: usize, ns: usize) -> &Self::Source;
}

/// A DAS backend as a [`BlockSource`]: each read lands in a host buffer first.
#[derive(Clone)]
pub struct DasBlocks {
    backend: Arc<AnyBackend>,
    block_size: u32,
}

impl DasBlocks {
    /// Blocks of `backend`.
    pub fn new(backend: Arc<AnyBackend>) -> Self {
        let block_size = backend.block_size();
        DasBlocks {
            backend,
            block_size,
        }
    }
}

impl BlockSource for DasBlocks {
    fn block_size(&self) -> u32 {
        self.block_size
    }

    fn read_blocks<D: ReadDest + Send + ?Sized>(
        &self,
        lba: u64,
        dest: &mut D,
    ) -> impl Future<Output = Result<(), nvmeof_initiator::Error>> + Send {
        let backend = Arc::clone(&self.backend);
        let len = dest.len();
        async move {
            if let AnyBackend::Memory(mem) = &*backend
                && let Some(mut lent) = dest.lend(0, len)
            {
                // Local memory: one copy, straight into the staging's pinned slot, whose
                // host-to-device copy is enqueued when it is taken back (the best local path,
                // as `gpu_loader`'s RAM -> HBM), instead of a fresh host buffer per read
                // copied once more into the slot.
                let r = mem.read_into(lba, &mut lent.bytes_mut()[..len]);
                dest.take_back(0, len, lent, r.is_ok())
                    .map_err(|e| nvmeof_initiator::Error::Buffer(e.to_string()))?;
                // Memory never waits: spend one unit of the task's cooperative budget so a
                // worker that always finds its data ready still lets the runtime run others.
                tokio::task::consume_budget().await;
                return r.map_err(|e| nvmeof_initiator::Error::Buffer(e.to_string()));
            }
            let (r, buf) = backend.read(lba, IoBuf::new(len)).await;
            r.map_err(|e| nvmeof_initiator::Error::Buffer(e.to_string()))?;
            dest.write_at(0, &buf)
                .map_err(|e| nvmeof_initiator::Error::Buffer(e.to_string()))
        }
    }
}

impl GpuSource for DasPath {
    type Source = DasBlocks;

    fn source(&self, _queue: usize, ns: usize) -> &DasBlocks {
        self.blocks(ns)
    }
}

impl GpuSource for TcpPath {
    type Source = Namespace;

    fn source(&self, queue: usize, ns: usize) -> &Namespace {
        self.handle(queue, ns)
    }
}

/// Reads into GPU memory through a wrapped path (see the module docs).
pub struct GpuPath<P> {
    inner: Arc<P>,
    ctx: GpuContext,
    verify: bool,
    /// Bytes of a worker's other reads that land before a large read's copy leaves.
    copy_lag: u64,
    /// The scatter kernel, compiled when the first gather is made.
    kernels: OnceLock<Result<Arc<NvmfKernels>, String>>,
}

impl<P: GpuSource> GpuPath<P> {
    /// Wraps `inner` on GPU 0; large reads' copies wait for `copy_lag` bytes of their worker's
    /// other reads to land ([`crate::lag`]; 0: they leave at once). Fails when there is no
    /// CUDA driver or GPU.
    pub fn new(inner: Arc<P>, verify: bool, copy_lag: u64) -> Result<Self, PathError> {
        let ctx =
            GpuContext::new(0).map_err(|e| PathError::Setup(format!("destination gpu: {e}")))?;
        Ok(GpuPath {
            inner,
            ctx,
            verify,
            copy_lag,
            kernels: OnceLock::new(),
        })
    }

    fn kernels(&self) -> Result<Arc<NvmfKernels>, String> {
        self.kernels
            .get_or_init(|| {
                NvmfKernels::load(&self.ctx)
                    .map(Arc::new)
                    .map_err(|e| format!("scatter kernel: {e}"))
            })
            .clone()
    }
}

/// The largest block a worker's gather takes; larger reads go one by one through a staging.
pub const GATHER_MAX_BLOCK: usize = 64 << 10;

/// A [`GpuPath`] buffer: host memory for writes and verify, and its GPU side.
pub struct GpuBuf<B> {
    host: B,
    gpu: Result<GpuParts, String>,
}

/// The GPU side of a buffer.
enum GpuParts {
    /// A small block: received into `landing` (part `id` of its worker's [`Gather`]'s mapped
    /// memory; `None` while a read or a batch holds it), then scattered from there to device
    /// slot `id`.
    Gathered {
        gather: Arc<Gather>,
        id: usize,
        landing: Option<PinnedChunk>,
        back: Option<Back>,
    },
    /// A large block: received into the staging's pinned slot, then copied into `dev` (after
    /// its worker's [`Lag`], if it has one).
    Staged {
        staging: Box<GpuStaging>,
        dev: DeviceBuffer,
        lag: Option<Arc<Lag>>,
        back: Option<Back>,
    },
}

/// Pinned memory a read's device data is copied back into for verify, and the copy's event.
type Back = (PinnedBuffer, Arc<GpuEvent>);

fn back(ctx: &GpuContext, len: usize, verify: bool) -> Result<Option<Back>, GpuError> {
    if !verify {
        return Ok(None);
    }
    Ok(Some((
        ctx.alloc_pinned(len)?,
        Arc::new(ctx.new_event(false)?),
    )))
}

/// The most batches in flight on a worker's stream; more reads gather until one finishes.
const MAX_FLIGHTS: usize = 2;
/// A batch leaves once it holds a quarter of the worker's buffers, or this long after it opened.
const GATHER_WAIT: Duration = Duration::from_micros(200);

/// Batches the transfers to the GPU of one worker's small reads (see the module docs). Each
/// buffer owns a part of the worker's mapped pinned memory; a read receives into its part,
/// puts the part into the open batch and waits ([`Waits`]: one waiting read polls, at each
/// read that arrives from the network or, when none is on its way, between yields; the
/// others are woken when their batch ends). The batch leaves once it holds a quarter of the
/// worker's buffers or has waited [`GATHER_WAIT`], unless [`MAX_FLIGHTS`] batches are already
/// in flight: then reads gather until one finishes (a group commit: the busier the stream,
/// the larger the batches). A batch is one scatter kernel that reads the parts in place over
/// the bus and one stream mark: a launch and the mark's write per batch are what the driver
/// costs, so full batches leave the CPU to the network. A worker's reads all run on its one
/// task, so the lock is not contended.
struct Gather {
    state: Mutex<Waits<GpuBatches>>,
}

/// A worker's batches on their way to the GPU.
struct GpuBatches {
    stream: GpuStream,
    kernels: Arc<NvmfKernels>,
    bs: usize,
    /// The worker's buffers.
    buffers: usize,
    /// The worker's device memory: buffer `id` owns bytes `id * bs..(id + 1) * bs`.
    dest: DeviceBuffer,
    /// Stages for batches' plans (mapped pinned memory the scatter kernel reads in place)
    /// that are neither open nor in flight.
    free: Vec<MappedStage>,
    /// The open batch's stage, its reads and their parts, in the same order.
    open: Option<MappedStage>,
    members: Vec<usize>,
    parts: Vec<PinnedChunk>,
    flights: VecDeque<Flight>,
    /// The device offsets of the batch being sent, and lists to reuse.
    offsets: Vec<u64>,
    spare: Vec<(Vec<usize>, Vec<PinnedChunk>)>,
    /// When the open batch opened.
    opened_at: Instant,
}

struct Flight {
    chunks: ChunkFlight,
    members: Vec<usize>,
}

/// How a read's batch ended, and its buffer's part when it came back.
struct Done {
    result: Result<(), String>,
    landing: Option<PinnedChunk>,
}

/// Ends read `id` of a batch (see [`Waits::with_batches`]).
type End<'a> = &'a mut dyn FnMut(usize, Done);

impl Gather {
    /// A gather for `buffers` buffers of `bs` bytes, and each buffer's part of its mapped
    /// memory, by buffer id.
    fn new(
        ctx: &GpuContext,
        kernels: Arc<NvmfKernels>,
        bs: usize,
        buffers: usize,
    ) -> Result<(Self, Vec<PinnedChunk>), String> {
        let e = |e: GpuError| e.to_string();
        let stream = ctx.new_stream().map_err(e)?;
        let bytes = bs * buffers;
        let parts = ctx
            .alloc_pinned_mapped(bytes)
            .and_then(|m| m.into_host())
            .and_then(|h| h.into_chunks(bs))
            .map_err(e)?;
        let free = (0..=MAX_FLIGHTS)
            .map(|_| kernels.new_stage(0, buffers).map_err(|e| e.to_string()))
            .collect::<Result<Vec<_>, String>>()?;
        let batches = GpuBatches {
            stream,
            kernels,
            bs,
            buffers,
            dest: ctx.alloc(bytes).map_err(e)?,
            free,
            open: None,
            members: Vec::with_capacity(buffers),
            parts: Vec::with_capacity(buffers),
            flights: VecDeque::new(),
            offsets: Vec::with_capacity(buffers),
            spare: Vec::new(),
            opened_at: Instant::now(),
        };
        let gather = Gather {
            state: Mutex::new(Waits::new(batches, buffers)),
        };
        Ok((gather, parts))
    }

    /// A read leaves for the network; it arrives when it joins a batch ([`push`](Self::push))
    /// or when the [`Trip`] goes (the read failed or was dropped).
    fn depart(&self) -> Trip<'_> {
        self.state.lock().depart();
        Trip(Some(self))
    }

    /// Puts buffer `id`'s part, holding its block, into the open batch (its read back from
    /// the network: `trip` ends), and sends the batch if it is full enough.
    fn push(&self, id: usize, part: PinnedChunk, mut trip: Trip<'_>) -> Result<(), String> {
        trip.0 = None;
        let mut st = self.state.lock();
        st.arrive();
        st.join(id);
        st.with_batches(|b, end| b.push(id, part, end))
    }
}

/// A read of a [`Gather`]'s worker on its way from the network ([`Gather::depart`]); dropped
/// before it joins a batch, it counts as arrived.
struct Trip<'a>(Option<&'a Gather>);

impl Drop for Trip<'_> {
    fn drop(&mut self) {
        if let Some(g) = self.0.take() {
            g.state.lock().arrive();
        }
    }
}

impl GpuBatches {
    /// See [`Gather::push`].
    fn push(&mut self, id: usize, part: PinnedChunk, end: End<'_>) -> Result<(), String> {
        if self.open.is_none() {
            // At most MAX_FLIGHTS stages are in flight: one is free.
            let stage = self.free.pop().ok_or("no free staging area")?;
            self.open = Some(stage);
            self.opened_at = Instant::now();
        }
        self.members.push(id);
        self.parts.push(part);
        self.try_send(end);
        Ok(())
    }

    /// Sends the open batch once it holds a quarter of the worker's buffers or has waited
    /// [`GATHER_WAIT`], unless [`MAX_FLIGHTS`] batches are in flight.
    fn try_send(&mut self, end: End<'_>) {
        if self.open.is_some()
            && self.flights.len() < MAX_FLIGHTS
            && (self.members.len() * 4 >= self.buffers || self.opened_at.elapsed() >= GATHER_WAIT)
        {
            self.flush(end);
        }
    }

    /// Sends the open batch: one scatter kernel that reads its parts in place.
    fn flush(&mut self, end: End<'_>) {
        let Some(stage) = self.open.take() else {
            return;
        };
        let (spare_members, spare_parts) = self.spare.pop().unwrap_or_default();
        let members = std::mem::replace(&mut self.members, spare_members);
        let parts = std::mem::replace(&mut self.parts, spare_parts);
        let bs = self.bs as u64;
        self.offsets.clear();
        self.offsets
            .extend(members.iter().map(|&id| id as u64 * bs));
        let r = self.kernels.scatter_chunks(
            &self.stream,
            stage,
            parts,
            &mut self.dest.as_slice_mut(),
            &self.offsets,
        );
        match r {
            Ok(chunks) => self.flights.push_back(Flight { chunks, members }),
            Err(refused) => {
                let e = refused.error.to_string();
                self.free.push(refused.stage);
                let mut members = members;
                let mut parts = refused.chunks;
                for (id, part) in members.drain(..).zip(parts.drain(..)) {
                    let result = Err(e.clone());
                    end(
                        id,
                        Done {
                            result,
                            landing: Some(part),
                        },
                    );
                }
                self.spare.push((members, parts));
            }
        }
    }
}

impl Batches for GpuBatches {
    type Done = Done;

    /// Ends the finished batches, oldest first, and sends the open batch if it is due.
    fn retire(&mut self, end: End<'_>) {
        while let Some(f) = self.flights.front_mut() {
            let done = f.chunks.is_done();
            if matches!(done, Ok(false)) {
                break;
            }
            let Some(f) = self.flights.pop_front() else {
                break;
            };
            let mut members = f.members;
            let r = done.and_then(|_| f.chunks.finish());
            let mut parts = match r {
                Ok((stage, mut parts)) => {
                    self.free.push(stage);
                    for (id, part) in members.drain(..).zip(parts.drain(..)) {
                        end(
                            id,
                            Done {
                                result: Ok(()),
                                landing: Some(part),
                            },
                        );
                    }
                    parts
                }
                Err(e) => {
                    // The stream failed: the parts went with the batch.
                    let e = e.to_string();
                    for id in members.drain(..) {
                        end(
                            id,
                            Done {
                                result: Err(e.clone()),
                                landing: None,
                            },
                        );
                    }
                    Vec::new()
                }
            };
            parts.clear();
            self.spare.push((members, parts));
        }
        self.try_send(end);
    }

    fn pending(&self) -> impl Iterator<Item = usize> + '_ {
        self.flights
            .iter()
            .flat_map(|f| f.members.iter().copied())
            .chain(self.members.iter().copied())
    }
}

/// Waits until buffer `id`'s block is in device memory, then hands back how it ended and the
/// buffer's part (see [`Waits::poll_wait`]).
struct GatherWait<'a> {
    gather: &'a Gather,
    id: usize,
    polling: bool,
    /// Whether the wait ended (nothing left to give up when it goes).
    ended: bool,
}

impl Future for GatherWait<'_> {
    type Output = Done;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        let r = this
            .gather
            .state
            .lock()
            .poll_wait(this.id, &mut this.polling, cx);
        this.ended = r.is_ready();
        r
    }
}

impl Drop for GatherWait<'_> {
    fn drop(&mut self) {
        // An ended wait neither polls nor waits to be woken: no lock per read for it.
        if !self.ended {
            self.gather.state.lock().leave(self.id, self.polling);
        }
    }
}

/// A read's destination that lends its buffer's part, so that the data is put straight
/// into it.
struct PartDest(Option<PinnedChunk>);

/// A part lent to a command.
struct LentPart(PinnedChunk);

impl LentBuffer for LentPart {
    fn bytes(&self) -> &[u8] {
        self.0.as_slice()
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        self.0.as_mut_slice()
    }

    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send> {
        self
    }
}

impl ReadDest for PartDest {
    fn len(&self) -> usize {
        self.0.as_ref().map_or(0, PinnedChunk::len)
    }

    fn write_at(&mut self, offset: usize, data: &[u8]) -> Result<(), BufferError> {
        let part = self.0.as_mut().ok_or("the part is lent")?;
        part.as_mut_slice()
            .get_mut(offset..offset + data.len())
            .ok_or("offset outside the part")?
            .copy_from_slice(data);
        Ok(())
    }

    fn lend(&mut self, offset: usize, len: usize) -> Option<Lent> {
        if offset != 0 || len != self.len() {
            return None;
        }
        let part = self.0.take()?;
        Some(Lent::Other(Box::new(LentPart(part))))
    }

    fn take_back(
        &mut self,
        offset: usize,
        len: usize,
        buf: Lent,
        filled: bool,
    ) -> Result<(), BufferError> {
        let _ = (offset, len, filled);
        let Lent::Other(buf) = buf else {
            return Err("a buffer this part did not lend".into());
        };
        let Ok(part) = buf.into_any().downcast::<LentPart>() else {
            return Err("a buffer this part did not lend".into());
        };
        self.0 = Some(part.0);
        Ok(())
    }
}

/// The GPU side of a large buffer: its own staging and device memory.
fn staged(
    ctx: &GpuContext,
    len: usize,
    lag: Option<Arc<Lag>>,
    verify: bool,
) -> Result<GpuParts, String> {
    let e = |e: GpuError| e.to_string();
    let cfg = StagingConfig {
        slots: 2,
        slot_bytes: len.clamp(4096, 1 << 30),
        timing: false,
    };
    Ok(GpuParts::Staged {
        staging: Box::new(GpuStaging::new(ctx, cfg).map_err(|e| e.to_string())?),
        dev: ctx.alloc(len).map_err(e)?,
        lag,
        back: back(ctx, len, verify).map_err(e)?,
    })
}

/// Enqueues the copy of `dev` back into `back`'s pinned memory on `stream` (verify).
fn start_back(stream: &GpuStream, dev: DeviceSlice<'_>, back: &mut Back) -> Result<(), GpuError> {
    let (pinned, event) = back;
    stream.copy_d2h_async(&dev, &mut pinned.slice_mut(..dev.len())?)?;
    stream.record(event)
}

/// Waits for [`start_back`]'s copy and hands its bytes to `host`.
async fn finish_back(back: &Back, host: &mut [u8]) -> Result<(), GpuError> {
    let (pinned, event) = back;
    wait_event(event).await?;
    host.copy_from_slice(&pinned.as_slice()?[..host.len()]);
    Ok(())
}

async fn read_to_gpu<S: BlockSource>(
    g: &mut GpuParts,
    src: &S,
    lba: u64,
    host: &mut [u8],
) -> Result<(), String> {
    let e = |e: GpuError| e.to_string();
    match g {
        GpuParts::Staged {
            staging,
            dev,
            lag,
            back,
        } => {
            let r = match lag {
                Some(lag) => {
                    let trip = lag.depart();
                    let gate = move |bytes| trip.land(bytes);
                    staging.read_gated(src, lba, dev.as_slice_mut(), gate).await
                }
                None => staging.read(src, lba, dev.as_slice_mut()).await,
            };
            r.map_err(|e| e.to_string())?;
            if let Some(b) = back {
                start_back(staging.stream(), dev.slice(..host.len()).map_err(e)?, b).map_err(e)?;
                finish_back(b, host).await.map_err(e)?;
            }
            Ok(())
        }
        GpuParts::Gathered {
            gather,
            id,
            landing,
            back,
        } => {
            let part = landing
                .take()
                .ok_or("the buffer's part went with an earlier read")?;
            let mut dest = PartDest(Some(part));
            let trip = gather.depart();
            let r = src.read_blocks(lba, &mut dest).await;
            // A read that lost its lent part (its connection failed) leaves none.
            let part = dest.0.ok_or("the read kept the buffer's part")?;
            if let Err(e) = r {
                *landing = Some(part);
                return Err(e.to_string());
            }
            gather.push(*id, part, trip)?;
            let done = GatherWait {
                gather,
                id: *id,
                polling: false,
                ended: false,
            }
            .await;
            *landing = done.landing;
            done.result?;
            if let Some(b) = back {
                {
                    // Enqueued under the lock, in stream order after the scatter; the wait
                    // happens without it.
                    let st = gather.state.lock();
                    let g = &st.batches;
                    let at = *id * g.bs;
                    let dev = g.dest.slice(at..at + host.len()).map_err(e)?;
                    start_back(&g.stream, dev, b).map_err(e)?;
                }
                finish_back(b, host).await.map_err(e)?;
            }
            Ok(())
        }
    }
}

impl<P: GpuSource> IoPath for GpuPath<P> {
    type Buf = GpuBuf<P::Buf>;

    fn geometry(&self) -> &[NsGeometry] {
        self.inner.geometry()
    }

    fn alloc(&self, len: usize) -> Self::Buf {
        self.alloc_set(len, 1).pop().unwrap_or_else(|| GpuBuf {
            host: self.inner.alloc(len),
            gpu: Err(String::from("no buffer")),
        })
    }

    fn alloc_set(&self, len: usize, n: usize) -> Vec<Self::Buf> {
        let gather = (len <= GATHER_MAX_BLOCK).then(|| {
            self.kernels()
                .and_then(|k| Gather::new(&self.ctx, k, len, n))
                .map(|(g, parts)| (Arc::new(g), parts))
        });
        let lag = (len > GATHER_MAX_BLOCK && self.copy_lag > 0)
            .then(|| Arc::new(Lag::new(self.copy_lag)));
        let (gather, mut parts) = match gather {
            Some(Ok((g, parts))) => (Some(Ok(g)), parts.into_iter()),
            other => (other.map(|r| r.map(|(g, _)| g)), Vec::new().into_iter()),
        };
        (0..n)
            .map(|id| {
                let gpu = match &gather {
                    Some(Ok(g)) => back(&self.ctx, len, self.verify)
                        .map(|back| GpuParts::Gathered {
                            gather: Arc::clone(g),
                            id,
                            landing: parts.next(),
                            back,
                        })
                        .map_err(|e| e.to_string()),
                    Some(Err(e)) => Err(e.clone()),
                    None => staged(&self.ctx, len, lag.clone(), self.verify),
                };
                GpuBuf {
                    host: self.inner.alloc(len),
                    gpu,
                }
            })
            .collect()
    }

    fn bytes(buf: &Self::Buf) -> &[u8] {
        P::bytes(&buf.host)
    }

    fn bytes_mut(buf: &mut Self::Buf) -> &mut [u8] {
        P::bytes_mut(&mut buf.host)
    }

    fn read(
        &self,
        queue: usize,
        ns: usize,
        offset: u64,
        mut buf: Self::Buf,
    ) -> impl Future<Output = (Result<(), PathError>, Self::Buf)> + Send {
        let src = self.inner.source(queue, ns);
        let lba = offset / u64::from(self.inner.geometry()[ns].block_size);
        async move {
            let r = match &mut buf.gpu {
                Err(e) => Err(PathError::Setup(format!("destination gpu: {e}"))),
                Ok(g) => read_to_gpu(g, src, lba, P::bytes_mut(&mut buf.host))
                    .await
                    .map_err(PathError::Gpu),
            };
            (r, buf)
        }
    }

    fn write(
        &self,
        queue: usize,
        ns: usize,
        offset: u64,
        buf: Self::Buf,
    ) -> impl Future<Output = (Result<(), PathError>, Self::Buf)> + Send {
        let GpuBuf { host, gpu } = buf;
        let w = self.inner.write(queue, ns, offset, host);
        async move {
            let (r, host) = w.await;
            (r, GpuBuf { host, gpu })
        }
    }
}
