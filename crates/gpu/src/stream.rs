//! Streams, events and asynchronous copies.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::sys;

use crate::context::{CtxInner, GpuContext};
use crate::driver::check;
use crate::error::{GpuError, GpuResult};
use crate::memory::{DeviceSlice, DeviceSliceMut, PinnedSlice, PinnedSliceMut};

static NEXT_STREAM_ID: AtomicU64 = AtomicU64::new(1);

/// A raw stream plus a process-unique id (raw handles can be reused after destruction).
#[derive(Clone, Copy, Debug)]
pub(crate) struct StreamHandle {
    pub(crate) raw: sys::CUstream,
    pub(crate) id: u64,
}

// SAFETY: a `CUstream` handle may be used from any thread with its context current.
unsafe impl Send for StreamHandle {}
// SAFETY: as above; the handle is an immutable value.
unsafe impl Sync for StreamHandle {}

impl StreamHandle {
    /// Creates a non-blocking stream in the current context.
    pub(crate) fn create() -> GpuResult<Self> {
        let mut raw: sys::CUstream = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: the caller made the owning context current; valid out-pointer.
        let rc = unsafe { sys::cuStreamCreate(&mut raw, flags) };
        check(rc, "cuStreamCreate")?;
        Ok(StreamHandle {
            raw,
            id: NEXT_STREAM_ID.fetch_add(1, Ordering::Relaxed),
        })
    }

    /// Blocks until all work on the stream completed.
    pub(crate) fn synchronize(&self) -> GpuResult<()> {
        // SAFETY: the stream is alive while its owner exists.
        let rc = unsafe { sys::cuStreamSynchronize(self.raw) };
        check(rc, "cuStreamSynchronize")
    }
}

struct StreamInner {
    ctx: Arc<CtxInner>,
    handle: StreamHandle,
}

impl Drop for StreamInner {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // SAFETY: the stream was created by `GpuContext::new_stream` and is destroyed once.
        // Work still queued on it completes normally; buffers it uses are protected by their
        // own trackers.
        let _ = unsafe { sys::cuStreamDestroy_v2(self.handle.raw) };
    }
}

/// A non-blocking CUDA stream: work on it runs in submission order, concurrently with other
/// streams. Cloning is cheap and refers to the same stream.
#[derive(Clone)]
pub struct GpuStream {
    inner: Arc<StreamInner>,
}

impl std::fmt::Debug for GpuStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuStream")
            .field("id", &self.inner.handle.id)
            .finish()
    }
}

impl GpuContext {
    /// Creates a new non-blocking stream.
    pub fn new_stream(&self) -> GpuResult<GpuStream> {
        self.inner.bind()?;
        let handle = StreamHandle::create()?;
        Ok(GpuStream {
            inner: Arc::new(StreamInner {
                ctx: self.inner.clone(),
                handle,
            }),
        })
    }

    /// Creates an event; `timing` enables [`GpuEvent::elapsed_ms`] at a small cost.
    pub fn new_event(&self, timing: bool) -> GpuResult<GpuEvent> {
        self.inner.bind()?;
        let flags = if timing {
            sys::CUevent_flags::CU_EVENT_DEFAULT as u32
        } else {
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32
        };
        let mut raw: sys::CUevent = std::ptr::null_mut();
        // SAFETY: the context is current; valid out-pointer; the event is owned by the
        // returned value.
        let rc = unsafe { sys::cuEventCreate(&mut raw, flags) };
        check(rc, "cuEventCreate")?;
        Ok(GpuEvent {
            ctx: self.inner.clone(),
            raw,
            timing,
        })
    }
}

impl GpuStream {
    /// The stream's context.
    pub fn context(&self) -> GpuContext {
        GpuContext {
            inner: self.inner.ctx.clone(),
        }
    }

    pub(crate) fn handle(&self) -> StreamHandle {
        self.inner.handle
    }

    pub(crate) fn ctx(&self) -> &Arc<CtxInner> {
        &self.inner.ctx
    }

    fn bind_same(&self, other: &Arc<CtxInner>) -> GpuResult<()> {
        if !Arc::ptr_eq(&self.inner.ctx, other) {
            return Err(GpuError::ContextMismatch);
        }
        self.inner.ctx.bind()
    }

    /// Blocks until all work submitted to the stream has finished.
    pub fn synchronize(&self) -> GpuResult<()> {
        self.inner.ctx.bind()?;
        self.inner.handle.synchronize()
    }

    /// True when all submitted work has finished (does not block).
    pub fn is_idle(&self) -> GpuResult<bool> {
        self.inner.ctx.bind()?;
        // SAFETY: the stream is alive.
        let rc = unsafe { sys::cuStreamQuery(self.inner.handle.raw) };
        if rc == sys::cudaError_enum::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        check(rc, "cuStreamQuery")?;
        Ok(true)
    }

    /// Records `event` at the current end of the stream.
    pub fn record(&self, event: &GpuEvent) -> GpuResult<()> {
        self.bind_same(&event.ctx)?;
        // SAFETY: event and stream are alive and belong to the same context.
        let rc = unsafe { sys::cuEventRecord(event.raw, self.inner.handle.raw) };
        check(rc, "cuEventRecord")
    }

    /// Creates an event (timing enabled) and records it at the current end of the stream.
    pub fn record_event(&self) -> GpuResult<GpuEvent> {
        let event = self.context().new_event(true)?;
        self.record(&event)?;
        Ok(event)
    }

    /// Makes later work on this stream wait until `event` has completed (on the device; the
    /// host does not block).
    pub fn wait_event(&self, event: &GpuEvent) -> GpuResult<()> {
        self.bind_same(&event.ctx)?;
        // SAFETY: both handles are alive; flags 0 is the default wait.
        let rc = unsafe { sys::cuStreamWaitEvent(self.inner.handle.raw, event.raw, 0) };
        check(rc, "cuStreamWaitEvent")
    }

    /// Enqueues a host-to-device copy from pinned memory. Returns once enqueued; the pinned
    /// buffer is not handed back to the host for writing, nor freed, before the copy finished.
    pub fn copy_h2d_async(
        &self,
        src: &PinnedSlice<'_>,
        dst: &mut DeviceSliceMut<'_>,
    ) -> GpuResult<()> {
        if src.len as u64 != dst.len {
            return Err(GpuError::LengthMismatch {
                dst: dst.len,
                src: src.len as u64,
            });
        }
        self.bind_same(dst.ctx())?;
        self.bind_same(&src.buf.ctx)?;
        if dst.len == 0 {
            return Ok(());
        }
        let handle = self.inner.handle;
        // SAFETY: the host range lies inside a live pinned allocation whose tracker (recorded
        // below) keeps it alive and unwritten by the host until the copy completes; the device
        // range lies inside its allocation, which is tracked the same way.
        let rc = unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                dst.device_ptr(),
                src.buf.addr_at(src.offset).cast_const().cast(),
                src.len,
                handle.raw,
            )
        };
        check(rc, "cuMemcpyHtoDAsync")?;
        src.buf.device_reads.record(handle)?;
        dst.alloc.tracker.record(handle)
    }

    /// Enqueues a device-to-host copy into pinned memory. The host sees the data through
    /// [`PinnedBuffer::as_slice`](crate::PinnedBuffer::as_slice), which waits for the copy.
    pub fn copy_d2h_async(
        &self,
        src: &DeviceSlice<'_>,
        dst: &mut PinnedSliceMut<'_>,
    ) -> GpuResult<()> {
        if src.len != dst.len as u64 {
            return Err(GpuError::LengthMismatch {
                dst: dst.len as u64,
                src: src.len,
            });
        }
        self.bind_same(src.ctx())?;
        self.bind_same(&dst.buf.ctx)?;
        if src.len == 0 {
            return Ok(());
        }
        let handle = self.inner.handle;
        // SAFETY: the pinned destination is exclusively borrowed now and afterwards only
        // reachable through methods that wait for this copy (tracked below); the device range
        // lies inside its allocation.
        let rc = unsafe {
            sys::cuMemcpyDtoHAsync_v2(
                dst.buf.addr_at(dst.offset).cast(),
                src.device_ptr(),
                dst.len,
                handle.raw,
            )
        };
        check(rc, "cuMemcpyDtoHAsync")?;
        dst.buf.device_writes.record(handle)?;
        src.alloc.tracker.record(handle)
    }

    /// Enqueues a device-to-device copy.
    pub fn copy_d2d_async(
        &self,
        src: &DeviceSlice<'_>,
        dst: &mut DeviceSliceMut<'_>,
    ) -> GpuResult<()> {
        if src.len != dst.len {
            return Err(GpuError::LengthMismatch {
                dst: dst.len,
                src: src.len,
            });
        }
        self.bind_same(src.ctx())?;
        self.bind_same(dst.ctx())?;
        if src.len == 0 {
            return Ok(());
        }
        let handle = self.inner.handle;
        // SAFETY: both ranges lie inside live device allocations that are tracked below.
        let rc = unsafe {
            sys::cuMemcpyDtoDAsync_v2(
                dst.device_ptr(),
                src.device_ptr(),
                src.len as usize,
                handle.raw,
            )
        };
        check(rc, "cuMemcpyDtoDAsync")?;
        src.alloc.tracker.record(handle)?;
        dst.alloc.tracker.record(handle)
    }

    /// Enqueues setting every byte of `dst` to `value`.
    pub fn memset_async(&self, dst: &mut DeviceSliceMut<'_>, value: u8) -> GpuResult<()> {
        self.bind_same(dst.ctx())?;
        if dst.len == 0 {
            return Ok(());
        }
        let handle = self.inner.handle;
        // SAFETY: the range lies inside a live device allocation that is tracked below.
        let rc =
            unsafe { sys::cuMemsetD8Async(dst.device_ptr(), value, dst.len as usize, handle.raw) };
        check(rc, "cuMemsetD8Async")?;
        dst.alloc.tracker.record(handle)
    }
}

/// A CUDA event: a marker in a stream that the host or other streams can wait for.
pub struct GpuEvent {
    ctx: Arc<CtxInner>,
    raw: sys::CUevent,
    timing: bool,
}

// SAFETY: an event handle may be used from any thread with its context current.
unsafe impl Send for GpuEvent {}
// SAFETY: as above; the struct is immutable.
unsafe impl Sync for GpuEvent {}

impl std::fmt::Debug for GpuEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuEvent")
            .field("timing", &self.timing)
            .finish()
    }
}

impl GpuEvent {
    /// Blocks until the work before the event's last record has finished.
    pub fn synchronize(&self) -> GpuResult<()> {
        self.ctx.bind()?;
        // SAFETY: the event is alive.
        let rc = unsafe { sys::cuEventSynchronize(self.raw) };
        check(rc, "cuEventSynchronize")
    }

    /// True when the recorded work has finished (does not block).
    pub fn is_complete(&self) -> GpuResult<bool> {
        self.ctx.bind()?;
        // SAFETY: the event is alive.
        let rc = unsafe { sys::cuEventQuery(self.raw) };
        if rc == sys::cudaError_enum::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        check(rc, "cuEventQuery")?;
        Ok(true)
    }

    /// Milliseconds between this event and `end`; both must have been created with timing and
    /// have completed.
    pub fn elapsed_ms(&self, end: &GpuEvent) -> GpuResult<f32> {
        if !Arc::ptr_eq(&self.ctx, &end.ctx) {
            return Err(GpuError::ContextMismatch);
        }
        if !self.timing || !end.timing {
            return Err(GpuError::EventTimingDisabled);
        }
        self.ctx.bind()?;
        let mut ms = 0f32;
        // SAFETY: both events are alive and belong to the current context; valid out-pointer.
        let rc = unsafe { sys::cuEventElapsedTime_v2(&mut ms, self.raw, end.raw) };
        check(rc, "cuEventElapsedTime")?;
        Ok(ms)
    }
}

impl Drop for GpuEvent {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // SAFETY: the event is owned by this value and destroyed once; pending waits on it are
        // released by the driver asynchronously.
        let _ = unsafe { sys::cuEventDestroy_v2(self.raw) };
    }
}
