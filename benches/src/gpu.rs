//! The `gpu` destination: read data lands in GPU memory.
//!
//! [`GpuPath`] wraps a mode's path. Each buffer is a device buffer with its own
//! [`GpuStaging`] (a CUDA stream and two pinned slots of the block size); a read goes through
//! the staging into the device buffer and completes only once the data is in device memory.
//! Over NVMe/TCP the initiator's queue receives the data straight into a pinned slot, which is
//! then copied to the GPU. In DAS mode a memory backend copies the blocks straight into a
//! pinned slot (one copy, then the host-to-device copy: the best local path, as
//! `gpu_loader`'s RAM -> HBM); other backends read into host memory, which the staging copies
//! through a pinned slot (the CPU bounce path of a direct-attached device). With
//! verify on, every read's device data is copied back (asynchronously, on the buffer's stream,
//! into pinned memory) and checked against the pattern. Writes (the prefill included) go
//! through the wrapped path from host memory.

use std::future::Future;
use std::sync::Arc;

use blockdev::{AnyBackend, Backend, IoBuf};
use nvmeof_initiator::gpu::cuda::{DeviceBuffer, GpuContext, GpuError, GpuEvent, PinnedBuffer};
use nvmeof_initiator::gpu::{BlockSource, GpuIoError, GpuStaging, StagingConfig};
use nvmeof_initiator::{Namespace, ReadDest};

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

/// A [`GpuPath`] buffer: host memory for writes and verify, a device buffer and its staging.
pub struct GpuBuf<B> {
    host: B,
    gpu: Result<GpuParts, String>,
}

/// The GPU side of a buffer.
struct GpuParts {
    staging: GpuStaging,
    dev: DeviceBuffer,
    /// Pinned memory the data is copied back into for verify, and the copy's event.
    back: Option<(PinnedBuffer, Arc<GpuEvent>)>,
}

fn gpu_parts(ctx: &GpuContext, len: usize, verify: bool) -> Result<GpuParts, GpuIoError> {
    let cfg = StagingConfig {
        slots: 2,
        slot_bytes: len.clamp(4096, 1 << 30),
        timing: false,
    };
    let staging = GpuStaging::new(ctx, cfg)?;
    let dev = ctx.alloc(len)?;
    let back = if verify {
        Some((ctx.alloc_pinned(len)?, Arc::new(ctx.new_event(false)?)))
    } else {
        None
    };
    Ok(GpuParts { staging, dev, back })
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
) -> Result<(), GpuIoError> {
    g.staging.read(src, lba, g.dev.as_slice_mut()).await?;
    if let Some((pinned, event)) = &mut g.back {
        let len = g.dev.len();
        let stream = g.staging.stream();
        stream.copy_d2h_async(&g.dev.as_slice(), &mut pinned.slice_mut(..len)?)?;
        stream.record(event)?;
        wait(event).await?;
        host[..len].copy_from_slice(&pinned.as_slice()?[..len]);
    }
    Ok(())
}

impl<P: GpuSource> IoPath for GpuPath<P> {
    type Buf = GpuBuf<P::Buf>;

    fn geometry(&self) -> &[NsGeometry] {
        self.inner.geometry()
    }

    fn alloc(&self, len: usize) -> Self::Buf {
        GpuBuf {
            host: self.inner.alloc(len),
            gpu: gpu_parts(&self.ctx, len, self.verify).map_err(|e| e.to_string()),
        }
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
                    .map_err(|e| PathError::Gpu(e.to_string())),
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
