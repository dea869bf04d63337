//! The `gpu` destination: read data lands in GPU memory.
//!
//! [`GpuPath`] wraps a mode's path. Each buffer has pinned host memory a read lands in and
//! device memory it is copied to; a read completes only once its data is in device memory.
//! Over NVMe/TCP the initiator's queue receives the data straight into the pinned memory; in
//! DAS mode the backend's data is copied into it. The buffers of one worker share a
//! [`Gather`]: the copies of the reads that complete in the same round of the worker's task
//! leave together, as one `cuMemcpyBatchAsync` on the worker's stream with one event, instead
//! of a copy, an event and event polls per read. With verify on, every read's device data is
//! copied back (asynchronously, on the worker's stream, into pinned memory) and checked
//! against the pattern. Writes (the prefill included) go through the wrapped path from host
//! memory.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use blockdev::{AnyBackend, Backend, IoBuf};
use nvmeof_initiator::gpu::BlockSource;
use nvmeof_initiator::gpu::cuda::{
    DeviceBuffer, GpuContext, GpuError, GpuEvent, GpuStream, HostPinned, PinnedBuffer,
};
use parking_lot::Mutex;
use nvmeof_initiator::{BufferError, LentBuffer, Namespace, ReadDest};

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
}

impl<P: GpuSource> GpuPath<P> {
    /// Wraps `inner` on GPU 0. Fails when there is no CUDA driver or GPU.
    pub fn new(inner: Arc<P>, verify: bool) -> Result<Self, PathError> {
        let ctx =
            GpuContext::new(0).map_err(|e| PathError::Setup(format!("destination gpu: {e}")))?;
        Ok(GpuPath { inner, ctx, verify })
    }
}

/// A [`GpuPath`] buffer: host memory for writes and verify, and its GPU side.
pub struct GpuBuf<B> {
    host: B,
    gpu: Result<GpuParts, String>,
}

/// The GPU side of a buffer: its place in its worker's [`Gather`], the pinned memory a read
/// lands in and the device memory it is copied to (both held by the gather while the copy
/// runs), and the verify copy-back.
struct GpuParts {
    gather: Arc<Gather>,
    id: usize,
    idle: Option<(HostPinned, DeviceBuffer)>,
    /// Pinned memory the data is copied back into for verify, and the copy's event.
    back: Option<(PinnedBuffer, Arc<GpuEvent>)>,
}

/// Where one read lands while its copy is queued or runs: pinned host memory, then device
/// memory.
struct Landing {
    pinned: PinnedBuffer,
    dev: DeviceBuffer,
}

/// The pinned memory of a buffer as a read's destination: lent to the command whole, so the
/// queue receives the data from the socket straight into it (a DAS memory backend copies into
/// it).
struct LandingDest {
    host: Option<HostPinned>,
    len: usize,
}

/// Pinned memory lent to a command.
struct Lent(HostPinned);

impl LentBuffer for Lent {
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

impl ReadDest for LandingDest {
    fn len(&self) -> usize {
        self.len
    }

    fn write_at(&mut self, offset: usize, data: &[u8]) -> Result<(), BufferError> {
        let host = self.host.as_mut().ok_or("the pinned memory is lent")?;
        host.as_mut_slice()
            .get_mut(offset..offset + data.len())
            .ok_or("offset outside the buffer")?
            .copy_from_slice(data);
        Ok(())
    }

    fn lend(&mut self, offset: usize, len: usize) -> Option<Box<dyn LentBuffer>> {
        if offset != 0 || len != self.len {
            return None;
        }
        let host = self.host.take()?;
        Some(Box::new(Lent(host)))
    }

    fn take_back(
        &mut self,
        _offset: usize,
        _len: usize,
        buf: Box<dyn LentBuffer>,
        _filled: bool,
    ) -> Result<(), BufferError> {
        let lent = buf
            .into_any()
            .downcast::<Lent>()
            .map_err(|_| "a buffer this destination did not lend")?;
        self.host = Some(lent.0);
        Ok(())
    }
}

/// The most copies one batch carries.
const MAX_BATCH: usize = 64;

/// The most batches in flight on a worker's stream; more copies wait for one to finish.
const MAX_FLIGHTS: usize = 2;

/// Batches the host-to-device copies of one worker's reads. A read lands in its buffer's
/// pinned memory, hands the buffer to the gather and waits. The first read of a round yields
/// once, so that the reads completing in the same round join it, and then enqueues all their
/// copies with one `cuMemcpyBatchAsync` and one event, unless [`MAX_FLIGHTS`] batches are
/// already in flight: then the copies gather until one finishes (a group commit: the busier
/// the stream, the larger the batches, since each batch costs the stream about the same time
/// however few copies it carries). A batch also leaves as soon as it holds [`MAX_BATCH`]
/// copies. One waiting read polls the oldest batch's event, yielding between looks; when a
/// batch is done its buffers go back to their reads, the copies that gathered leave, and the
/// other waiters are woken. All of a worker's reads run on its one task, so the lock is
/// never contended.
struct Gather {
    stream: GpuStream,
    ctx: GpuContext,
    state: Mutex<GatherState>,
}

#[derive(Default)]
struct GatherState {
    /// Buffers whose copies are not enqueued yet, and their batch's number.
    pending: Vec<(usize, Landing)>,
    pending_batch: u64,
    /// The pending batch's round has gathered (its first read came back after yielding).
    pending_ready: bool,
    /// Enqueued batches, oldest first.
    flights: VecDeque<Flight>,
    /// Buffers back from finished batches (or the error their batch met), by buffer id.
    returned: Vec<Option<Result<Landing, String>>>,
    /// Events of finished batches, for reuse.
    free_events: Vec<GpuEvent>,
    /// Whether a waiting read is polling the oldest batch's event.
    polling: bool,
    waiters: Vec<Waker>,
}

struct Flight {
    event: GpuEvent,
    members: Vec<(usize, Landing)>,
}

impl Gather {
    fn new(ctx: &GpuContext, buffers: usize) -> Result<Self, GpuError> {
        let mut state = GatherState::default();
        state.returned.resize_with(buffers, || None);
        Ok(Gather {
            stream: ctx.new_stream()?,
            ctx: ctx.clone(),
            state: Mutex::new(state),
        })
    }

    /// Queues buffer `id`'s copy; returns its batch number and whether it opened that batch.
    fn push(&self, id: usize, landing: Landing) -> (u64, bool) {
        let mut st = self.state.lock();
        st.pending.push((id, landing));
        let first = st.pending.len() == 1;
        let batch = st.pending_batch;
        if st.pending.len() >= MAX_BATCH {
            self.flush(&mut st);
        }
        (batch, first)
    }

    /// Enqueues the pending copies as one batch.
    fn flush(&self, st: &mut GatherState) {
        if st.pending.is_empty() {
            return;
        }
        let mut members = std::mem::take(&mut st.pending);
        st.pending_batch += 1;
        st.pending_ready = false;
        let event = match st.free_events.pop() {
            Some(e) => Ok(e),
            None => self.ctx.new_event(false),
        };
        let r = event.and_then(|event| {
            let mut copies = Vec::with_capacity(members.len());
            for (_, l) in members.iter_mut() {
                copies.push((l.pinned.slice(..)?, l.dev.as_slice_mut()));
            }
            self.stream.copy_h2d_batch_async(&mut copies)?;
            self.stream.record(&event)?;
            Ok(event)
        });
        match r {
            Ok(event) => st.flights.push_back(Flight { event, members }),
            Err(e) => {
                for (id, l) in members {
                    drop(l);
                    st.returned[id] = Some(Err(e.to_string()));
                }
                wake_all(st);
            }
        }
    }

    /// Retires finished batches, oldest first, and sends the copies that gathered meanwhile.
    fn retire(&self, st: &mut GatherState) {
        let mut any = false;
        while let Some(f) = st.flights.front() {
            let done = f.event.is_complete();
            if done == Ok(false) {
                break;
            }
            let Some(f) = st.flights.pop_front() else {
                break;
            };
            for (id, l) in f.members {
                st.returned[id] = Some(match &done {
                    Ok(_) => Ok(l),
                    Err(e) => Err(e.to_string()),
                });
            }
            if done.is_ok() {
                st.free_events.push(f.event);
            }
            any = true;
        }
        if st.pending_ready && st.flights.len() < MAX_FLIGHTS {
            self.flush(st);
        }
        if any {
            wake_all(st);
        }
    }

    /// Waits until buffer `id`, queued in batch `batch`, is back with its copy done.
    fn wait(self: &Arc<Self>, id: usize, batch: u64, opened: bool) -> GatherWait {
        GatherWait {
            gather: Arc::clone(self),
            id,
            batch,
            opened,
            yielded: false,
            polling: false,
        }
    }
}

fn wake_all(st: &mut GatherState) {
    st.polling = false;
    for w in st.waiters.drain(..) {
        w.wake();
    }
}

/// The future of [`Gather::wait`].
struct GatherWait {
    gather: Arc<Gather>,
    id: usize,
    batch: u64,
    opened: bool,
    yielded: bool,
    polling: bool,
}

impl Future for GatherWait {
    type Output = Result<Landing, String>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let g = Arc::clone(&self.gather);
        let mut st = g.state.lock();
        if let Some(r) = st.returned[self.id].take() {
            if self.polling {
                wake_all(&mut st);
            }
            return Poll::Ready(r);
        }
        let mine_pending = st.pending_batch == self.batch && !st.pending.is_empty();
        if mine_pending && self.opened {
            if !self.yielded {
                // Let the reads of this round join the batch.
                self.yielded = true;
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            st.pending_ready = true;
            if st.flights.len() < MAX_FLIGHTS {
                g.flush(&mut st);
            }
        }
        if st.polling && !self.polling {
            st.waiters.push(cx.waker().clone());
            return Poll::Pending;
        }
        g.retire(&mut st);
        if let Some(r) = st.returned[self.id].take() {
            if self.polling {
                // Someone else polls for the rest.
                self.polling = false;
                wake_all(&mut st);
            }
            return Poll::Ready(r);
        }
        // Poll the event again once the runtime had its turn.
        st.polling = true;
        self.polling = true;
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

impl Drop for GatherWait {
    fn drop(&mut self) {
        // Hand on what this read owed the others: its batch's flush, the polling.
        let mut st = self.gather.state.lock();
        if self.opened && st.pending_batch == self.batch {
            self.gather.flush(&mut st);
        }
        if self.polling {
            wake_all(&mut st);
        }
    }
}

fn gpu_parts(
    ctx: &GpuContext,
    gather: &Arc<Gather>,
    id: usize,
    len: usize,
    verify: bool,
) -> Result<GpuParts, GpuError> {
    let idle = (ctx.alloc_pinned(len)?.into_host()?, ctx.alloc(len)?);
    let back = if verify {
        Some((ctx.alloc_pinned(len)?, Arc::new(ctx.new_event(false)?)))
    } else {
        None
    };
    Ok(GpuParts {
        gather: Arc::clone(gather),
        id,
        idle: Some(idle),
        back,
    })
}

/// Waits for `event` without blocking the runtime thread for long: a few polls between
/// yields, then on the blocking pool.
async fn wait(event: &Arc<GpuEvent>) -> Result<(), GpuError> {
    for _ in 0..64 {
        if event.is_complete()? {
            return Ok(());
        }
        tokio::task::yield_now().await;
    }
    let e = Arc::clone(event);
    tokio::task::spawn_blocking(move || e.synchronize())
        .await
        .unwrap_or_else(|j| {
            Err(GpuError::Driver {
                call: "cuEventSynchronize",
                code: 0,
                name: String::from("join"),
                description: j.to_string(),
            })
        })
}

async fn read_to_gpu<S: BlockSource>(
    g: &mut GpuParts,
    src: &S,
    lba: u64,
    host: &mut [u8],
) -> Result<(), String> {
    let (pinned, dev) = g
        .idle
        .take()
        .ok_or_else(|| String::from("the buffer was lost to an earlier error"))?;
    let len = host.len();
    let mut dest = LandingDest {
        host: Some(pinned),
        len,
    };
    let r = src.read_blocks(lba, &mut dest).await;
    let Some(pinned) = dest.host else {
        return Err(String::from("the read did not give its buffer back"));
    };
    if let Err(e) = r {
        g.idle = Some((pinned, dev));
        return Err(e.to_string());
    }
    let landing = Landing {
        pinned: pinned.into_pinned(),
        dev,
    };
    let (batch, opened) = g.gather.push(g.id, landing);
    let Landing { pinned, dev } = g.gather.wait(g.id, batch, opened).await?;
    let back = match &mut g.back {
        None => Ok(()),
        Some((back, event)) => {
            let stream = &g.gather.stream;
            let r = dev.slice(..len).and_then(|d| {
                stream.copy_d2h_async(&d, &mut back.slice_mut(..len)?)?;
                stream.record(event)
            });
            match r {
                Ok(()) => wait(event)
                    .await
                    .and_then(|()| back.as_slice().map(|p| host.copy_from_slice(&p[..len]))),
                Err(e) => Err(e),
            }
        }
    };
    g.idle = Some((pinned.into_host().map_err(|e| e.to_string())?, dev));
    back.map_err(|e| e.to_string())
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
        let gather = Gather::new(&self.ctx, n).map(Arc::new);
        (0..n)
            .map(|id| GpuBuf {
                host: self.inner.alloc(len),
                gpu: match &gather {
                    Ok(g) => gpu_parts(&self.ctx, g, id, len, self.verify),
                    Err(e) => Err(e.clone()),
                }
                .map_err(|e| e.to_string()),
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
