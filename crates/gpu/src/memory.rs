//! Device buffers, byte-offset views into them, and page-locked host staging buffers.

use std::marker::PhantomData;
use std::ops::{Bound, RangeBounds};
use std::ptr::NonNull;
use std::sync::Arc;

use cudarc::driver::sys;

use crate::context::{CtxInner, GpuContext};
use crate::driver::check;
use crate::error::{GpuError, GpuResult};
use crate::tracker::UseTracker;

/// Padding granularity of [`GpuContext::alloc_exportable`]: the GPU's large page, so an exported
/// range never shares a page with another allocation.
pub const EXPORTABLE_GRANULARITY: u64 = 2 * 1024 * 1024;

/// Resolves `range` against a buffer of `size` bytes into `(offset, len)`.
pub fn resolve_range(size: u64, range: impl RangeBounds<usize>) -> GpuResult<(u64, u64)> {
    let start = match range.start_bound() {
        Bound::Included(&s) => s as u64,
        Bound::Excluded(&s) => (s as u64)
            .checked_add(1)
            .ok_or(GpuError::SizeOverflow(s as u64))?,
        Bound::Unbounded => 0,
    };
    let end = match range.end_bound() {
        Bound::Included(&e) => (e as u64)
            .checked_add(1)
            .ok_or(GpuError::SizeOverflow(e as u64))?,
        Bound::Excluded(&e) => e as u64,
        Bound::Unbounded => size,
    };
    if start > end || end > size {
        return Err(GpuError::OutOfBounds {
            offset: start,
            len: end.saturating_sub(start),
            size,
        });
    }
    Ok((start, end - start))
}

/// Checks that `offset..offset + len` lies inside `size` bytes.
pub fn check_range(offset: u64, len: u64, size: u64) -> GpuResult<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(GpuError::OutOfBounds { offset, len, size }),
    }
}

/// One device allocation; shared by its [`DeviceBuffer`] and any dma-buf exported from it.
pub(crate) struct DeviceAlloc {
    pub(crate) ctx: Arc<CtxInner>,
    pub(crate) ptr: sys::CUdeviceptr,
    pub(crate) len: u64,
    /// Bytes actually allocated (`len` rounded up for exportable buffers).
    pub(crate) capacity: u64,
    pub(crate) tracker: UseTracker,
    /// False for memory another CUDA user allocated ([`GpuContext::borrow_device_memory`]):
    /// never freed here.
    pub(crate) owned: bool,
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // Never free memory a stream may still use; if waiting fails the context is broken and
        // freeing is the best that can be done.
        let _ = self.tracker.wait_host();
        if self.owned {
            // SAFETY: `ptr` came from `cuMemAlloc_v2` in this context and is freed exactly
            // once, here, after all tracked uses completed.
            let _ = unsafe { sys::cuMemFree_v2(self.ptr) };
        }
        // While `ctx` is still held: dropping it may destroy the context.
        self.tracker.release();
    }
}

/// Device memory owned by one owner; freed on drop after all GPU work using it has finished.
///
/// Views at arbitrary byte offsets ([`DeviceSlice`], [`DeviceSliceMut`]) are used for copies and
/// kernel arguments; there is no alignment requirement on offsets or lengths.
pub struct DeviceBuffer {
    pub(crate) alloc: Arc<DeviceAlloc>,
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("ptr", &format_args!("{:#x}", self.alloc.ptr))
            .field("len", &self.alloc.len)
            .field("capacity", &self.alloc.capacity)
            .finish()
    }
}

impl GpuContext {
    /// Allocates `len` bytes of device memory (contents undefined until written).
    pub fn alloc(&self, len: usize) -> GpuResult<DeviceBuffer> {
        self.alloc_with_capacity(len as u64, len as u64)
    }

    /// Allocates `len` zeroed bytes of device memory.
    pub fn alloc_zeroed(&self, len: usize) -> GpuResult<DeviceBuffer> {
        let mut buf = self.alloc(len)?;
        buf.zero()?;
        Ok(buf)
    }

    /// Allocates `len` bytes padded to [`EXPORTABLE_GRANULARITY`], so that any slice of the
    /// buffer can be exported as dma-buf ([`DeviceSlice::export_dmabuf`]) without exposing
    /// another allocation. The contents are zeroed, padding included.
    pub fn alloc_exportable(&self, len: usize) -> GpuResult<DeviceBuffer> {
        let len = len as u64;
        let capacity = round_up(len, EXPORTABLE_GRANULARITY).ok_or(GpuError::SizeOverflow(len))?;
        let mut buf = self.alloc_with_capacity(len, capacity)?;
        buf.zero_capacity()?;
        Ok(buf)
    }

    fn alloc_with_capacity(&self, len: u64, capacity: u64) -> GpuResult<DeviceBuffer> {
        if len == 0 {
            return Err(GpuError::EmptyAllocation);
        }
        let bytes = usize::try_from(capacity).map_err(|_| GpuError::SizeOverflow(capacity))?;
        self.inner.bind()?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: the context is current; `bytes` is non-zero; valid out-pointer. The
        // allocation is owned by the returned `DeviceAlloc`, which frees it.
        check(unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) }, "cuMemAlloc")?;
        Ok(DeviceBuffer {
            alloc: Arc::new(DeviceAlloc {
                ctx: self.inner.clone(),
                ptr,
                len,
                capacity,
                tracker: UseTracker::new(),
                owned: true,
            }),
        })
    }

    /// `len` bytes of device memory at `ptr` that another CUDA user of this process allocated
    /// (PyTorch, CuPy...), as a buffer this crate's copies can write and read. The driver is
    /// asked whether the range is device memory of this context's device, inside one
    /// allocation ([`GpuError::NotDeviceMemory`] otherwise). Dropping the buffer waits for the
    /// work this crate enqueued on it and never frees the memory.
    ///
    /// # Safety
    ///
    /// The memory must stay allocated until the returned buffer is dropped, and nothing else
    /// may use it meanwhile in a way that races the copies made through it (ordering against
    /// the owner's streams is the caller's job, e.g. with
    /// [`synchronize_raw_stream`](Self::synchronize_raw_stream)).
    pub unsafe fn borrow_device_memory(&self, ptr: u64, len: usize) -> GpuResult<DeviceBuffer> {
        if len == 0 {
            return Err(GpuError::EmptyAllocation);
        }
        let ordinal = device_of_pointer(ptr)?;
        if ordinal != self.ordinal() {
            return Err(not_device(
                ptr,
                format!(
                    "memory of device {ordinal}, not of device {}",
                    self.ordinal()
                ),
            ));
        }
        let start: sys::CUdeviceptr = pointer_attribute(
            ptr,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
        )?;
        let size: usize = pointer_attribute(
            ptr,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
        )?;
        let end = ptr.checked_add(len as u64);
        if ptr < start || end.is_none_or(|end| end > start.saturating_add(size as u64)) {
            return Err(not_device(
                ptr,
                format!("{len} bytes do not fit in its allocation ({size} bytes at {start:#x})"),
            ));
        }
        Ok(DeviceBuffer {
            alloc: Arc::new(DeviceAlloc {
                ctx: self.inner.clone(),
                ptr,
                len: len as u64,
                capacity: len as u64,
                tracker: UseTracker::new(),
                owned: false,
            }),
        })
    }

    /// Blocks until the work queued so far on `stream`, a raw `CUstream` of this context that
    /// another CUDA user made (or `1`, the legacy default stream, or `2`, the per-thread
    /// default stream), has completed.
    ///
    /// # Safety
    ///
    /// `stream` must be `1`, `2` or a live stream of this context.
    pub unsafe fn synchronize_raw_stream(&self, stream: u64) -> GpuResult<()> {
        self.inner.bind()?;
        // SAFETY: the caller guarantees a live stream handle (or a special one); the context
        // it belongs to is current.
        let rc = unsafe { sys::cuStreamSynchronize(stream as usize as sys::CUstream) };
        check(rc, "cuStreamSynchronize")
    }
}

fn not_device(ptr: u64, reason: String) -> GpuError {
    GpuError::NotDeviceMemory { ptr, reason }
}

/// One attribute of the memory at `ptr` (`T` must be the attribute's type).
fn pointer_attribute<T: Default>(ptr: u64, attr: sys::CUpointer_attribute) -> GpuResult<T> {
    let mut value = T::default();
    // SAFETY: the driver is loaded (callers ensured it); `value` is a valid out-pointer of the
    // attribute's type; the driver only inspects the address, it does not dereference it.
    let rc = unsafe {
        sys::cuPointerGetAttribute((&mut value as *mut T).cast(), attr, ptr as sys::CUdeviceptr)
    };
    if rc != sys::cudaError_enum::CUDA_SUCCESS {
        return Err(not_device(
            ptr,
            String::from("the CUDA driver does not know this address"),
        ));
    }
    Ok(value)
}

/// The ordinal of the device whose memory `ptr` points into; [`GpuError::NotDeviceMemory`]
/// for host memory or an address the driver does not know.
pub fn device_of_pointer(ptr: u64) -> GpuResult<usize> {
    crate::driver::ensure_driver()?;
    let kind: u32 = pointer_attribute(
        ptr,
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
    )?;
    if kind != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
        return Err(not_device(
            ptr,
            format!("memory type {kind}, not device memory"),
        ));
    }
    let ordinal: i32 = pointer_attribute(
        ptr,
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
    )?;
    usize::try_from(ordinal).map_err(|_| not_device(ptr, format!("device ordinal {ordinal}")))
}

impl DeviceBuffer {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.alloc.len as usize
    }

    /// Always false: zero-byte buffers cannot be allocated.
    pub fn is_empty(&self) -> bool {
        self.alloc.len == 0
    }

    /// Bytes actually allocated (larger than [`len`](Self::len) for exportable buffers).
    pub fn capacity(&self) -> usize {
        self.alloc.capacity as usize
    }

    /// Device virtual address of the first byte (for interop such as RDMA registration or
    /// handing the buffer to another CUDA library in the same process).
    pub fn device_ptr(&self) -> u64 {
        self.alloc.ptr
    }

    /// The context that owns the memory.
    pub fn context(&self) -> GpuContext {
        GpuContext {
            inner: self.alloc.ctx.clone(),
        }
    }

    /// A read-only view of the whole buffer.
    pub fn as_slice(&self) -> DeviceSlice<'_> {
        DeviceSlice {
            alloc: &self.alloc,
            offset: 0,
            len: self.alloc.len,
        }
    }

    /// A writable view of the whole buffer.
    pub fn as_slice_mut(&mut self) -> DeviceSliceMut<'_> {
        DeviceSliceMut {
            alloc: &self.alloc,
            offset: 0,
            len: self.alloc.len,
            _exclusive: PhantomData,
        }
    }

    /// A read-only view of a byte range (any offset, any length).
    pub fn slice(&self, range: impl RangeBounds<usize>) -> GpuResult<DeviceSlice<'_>> {
        self.as_slice().slice(range)
    }

    /// A writable view of a byte range (any offset, any length).
    pub fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> GpuResult<DeviceSliceMut<'_>> {
        let (offset, len) = resolve_range(self.alloc.len, range)?;
        Ok(DeviceSliceMut {
            alloc: &self.alloc,
            offset,
            len,
            _exclusive: PhantomData,
        })
    }

    /// Sets every byte to zero (blocking).
    pub fn zero(&mut self) -> GpuResult<()> {
        self.as_slice_mut().fill(0)
    }

    fn zero_capacity(&mut self) -> GpuResult<()> {
        let alloc = &self.alloc;
        blocking(alloc, |stream| {
            // SAFETY: the whole allocation of `capacity` bytes belongs to this buffer; the
            // stream is the context's internal stream.
            let rc = unsafe { sys::cuMemsetD8Async(alloc.ptr, 0, alloc.capacity as usize, stream) };
            check(rc, "cuMemsetD8Async")
        })
    }

    /// Copies `src` into the start of the buffer (blocking). `src` may be shorter than the
    /// buffer.
    pub fn copy_from_host(&mut self, src: &[u8]) -> GpuResult<()> {
        self.slice_mut(..src.len())?.copy_from_host(src)
    }

    /// Copies the start of the buffer into `dst` (blocking).
    pub fn copy_to_host(&self, dst: &mut [u8]) -> GpuResult<()> {
        self.slice(..dst.len())?.copy_to_host(dst)
    }

    /// Reads the whole buffer into a new vector (blocking).
    pub fn to_vec(&self) -> GpuResult<Vec<u8>> {
        self.as_slice().to_vec()
    }
}

/// A read-only view of `len` bytes at byte offset `offset` of a [`DeviceBuffer`].
#[derive(Clone, Copy)]
pub struct DeviceSlice<'a> {
    pub(crate) alloc: &'a Arc<DeviceAlloc>,
    pub(crate) offset: u64,
    pub(crate) len: u64,
}

impl std::fmt::Debug for DeviceSlice<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceSlice")
            .field("ptr", &format_args!("{:#x}", self.device_ptr()))
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

impl<'a> DeviceSlice<'a> {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len as usize
    }

    /// True for an empty view.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Byte offset of the view inside its buffer.
    pub fn offset(&self) -> usize {
        self.offset as usize
    }

    /// Device virtual address of the view's first byte.
    pub fn device_ptr(&self) -> u64 {
        self.alloc.ptr + self.offset
    }

    /// A sub-view; `range` is relative to this view.
    pub fn slice(&self, range: impl RangeBounds<usize>) -> GpuResult<DeviceSlice<'a>> {
        let (offset, len) = resolve_range(self.len, range)?;
        Ok(DeviceSlice {
            alloc: self.alloc,
            offset: self.offset + offset,
            len,
        })
    }

    /// Copies the view into `dst`, which must have the same length (blocking; waits for
    /// earlier tracked work on the buffer first).
    pub fn copy_to_host(&self, dst: &mut [u8]) -> GpuResult<()> {
        if dst.len() as u64 != self.len {
            return Err(GpuError::LengthMismatch {
                dst: dst.len() as u64,
                src: self.len,
            });
        }
        if self.len == 0 {
            return Ok(());
        }
        let src = self.device_ptr();
        blocking(self.alloc, |stream| {
            // SAFETY: `dst` is a valid writable host range of `len` bytes for the whole call
            // (the stream is synchronised before `blocking` returns); the device range lies in
            // the allocation.
            let rc = unsafe {
                sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr().cast(), src, dst.len(), stream)
            };
            check(rc, "cuMemcpyDtoHAsync")
        })
    }

    /// Reads the view into a new vector (blocking).
    pub fn to_vec(&self) -> GpuResult<Vec<u8>> {
        let mut out = vec![0u8; self.len as usize];
        self.copy_to_host(&mut out)?;
        Ok(out)
    }

    pub(crate) fn ctx(&self) -> &Arc<CtxInner> {
        &self.alloc.ctx
    }
}

/// A writable view of `len` bytes at byte offset `offset` of a [`DeviceBuffer`].
///
/// Obtained from `&mut DeviceBuffer`, so writable views of one buffer never overlap.
pub struct DeviceSliceMut<'a> {
    pub(crate) alloc: &'a Arc<DeviceAlloc>,
    pub(crate) offset: u64,
    pub(crate) len: u64,
    _exclusive: PhantomData<&'a mut DeviceBuffer>,
}

impl std::fmt::Debug for DeviceSliceMut<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceSliceMut")
            .field("ptr", &format_args!("{:#x}", self.device_ptr()))
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

impl<'a> DeviceSliceMut<'a> {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len as usize
    }

    /// True for an empty view.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Byte offset of the view inside its buffer.
    pub fn offset(&self) -> usize {
        self.offset as usize
    }

    /// Device virtual address of the view's first byte.
    pub fn device_ptr(&self) -> u64 {
        self.alloc.ptr + self.offset
    }

    /// The same bytes as a read-only view.
    pub fn as_slice(&self) -> DeviceSlice<'_> {
        DeviceSlice {
            alloc: self.alloc,
            offset: self.offset,
            len: self.len,
        }
    }

    /// A shorter-lived writable view of the same bytes.
    pub fn reborrow(&mut self) -> DeviceSliceMut<'_> {
        DeviceSliceMut {
            alloc: self.alloc,
            offset: self.offset,
            len: self.len,
            _exclusive: PhantomData,
        }
    }

    /// A writable sub-view; `range` is relative to this view.
    pub fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> GpuResult<DeviceSliceMut<'_>> {
        let (offset, len) = resolve_range(self.len, range)?;
        Ok(DeviceSliceMut {
            alloc: self.alloc,
            offset: self.offset + offset,
            len,
            _exclusive: PhantomData,
        })
    }

    /// Splits into two disjoint writable views at byte `mid` (e.g. to fill both halves from
    /// different streams).
    pub fn split_at_mut(self, mid: usize) -> GpuResult<(DeviceSliceMut<'a>, DeviceSliceMut<'a>)> {
        let mid = mid as u64;
        check_range(0, mid, self.len)?;
        let left = DeviceSliceMut {
            alloc: self.alloc,
            offset: self.offset,
            len: mid,
            _exclusive: PhantomData,
        };
        let right = DeviceSliceMut {
            alloc: self.alloc,
            offset: self.offset + mid,
            len: self.len - mid,
            _exclusive: PhantomData,
        };
        Ok((left, right))
    }

    /// Copies `src`, which must have the view's length, into the view (blocking).
    pub fn copy_from_host(&mut self, src: &[u8]) -> GpuResult<()> {
        if src.len() as u64 != self.len {
            return Err(GpuError::LengthMismatch {
                dst: self.len,
                src: src.len() as u64,
            });
        }
        if self.len == 0 {
            return Ok(());
        }
        let dst = self.device_ptr();
        blocking(self.alloc, |stream| {
            // SAFETY: `src` stays borrowed until the stream is synchronised inside `blocking`;
            // the device range lies in the allocation.
            let rc =
                unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.as_ptr().cast(), src.len(), stream) };
            check(rc, "cuMemcpyHtoDAsync")
        })
    }

    /// Sets every byte of the view to `value` (blocking).
    pub fn fill(&mut self, value: u8) -> GpuResult<()> {
        if self.len == 0 {
            return Ok(());
        }
        let dst = self.device_ptr();
        let len = self.len as usize;
        blocking(self.alloc, |stream| {
            // SAFETY: the device range lies in the allocation; the stream is the internal one.
            let rc = unsafe { sys::cuMemsetD8Async(dst, value, len, stream) };
            check(rc, "cuMemsetD8Async")
        })
    }

    /// Sets every 32-bit word of the view to `value` (blocking). The view's address and length
    /// must be multiples of 4.
    pub fn fill_u32(&mut self, value: u32) -> GpuResult<()> {
        let dst = self.device_ptr();
        if dst % 4 != 0 || self.len % 4 != 0 {
            return Err(GpuError::Unaligned {
                offset: self.offset,
                len: self.len,
                align: 4,
            });
        }
        if self.len == 0 {
            return Ok(());
        }
        let words = (self.len / 4) as usize;
        blocking(self.alloc, |stream| {
            // SAFETY: the device range (4-byte aligned, `words` words) lies in the allocation;
            // the stream is the internal one.
            let rc = unsafe { sys::cuMemsetD32Async(dst, value, words, stream) };
            check(rc, "cuMemsetD32Async")
        })
    }

    pub(crate) fn ctx(&self) -> &Arc<CtxInner> {
        &self.alloc.ctx
    }
}

/// Runs `op` on the context's internal stream after all tracked work on `alloc`, then waits for
/// it to finish.
fn blocking(alloc: &DeviceAlloc, op: impl FnOnce(sys::CUstream) -> GpuResult<()>) -> GpuResult<()> {
    let ctx = &alloc.ctx;
    ctx.bind()?;
    alloc.tracker.order_before(ctx.internal)?;
    op(ctx.internal.raw)?;
    ctx.internal.synchronize()
}

/// Page-locked host memory for staging transfers; zero-initialised.
///
/// Host access ([`as_slice`](Self::as_slice), [`as_mut_slice`](Self::as_mut_slice)) first waits
/// for asynchronous copies that still read from or write into the buffer, so the host never
/// observes a buffer while the GPU changes it.
pub struct PinnedBuffer {
    pub(crate) ctx: Arc<CtxInner>,
    ptr: NonNull<u8>,
    len: usize,
    /// Device address of the memory when it was allocated mapped.
    mapped: Option<u64>,
    /// Enqueued copies that read this buffer (host-to-device).
    pub(crate) device_reads: UseTracker,
    /// Enqueued copies that write this buffer (device-to-host).
    pub(crate) device_writes: UseTracker,
}

// SAFETY: the buffer owns its page-locked allocation exclusively; the pointer is only
// dereferenced through `&self`/`&mut self` methods that follow Rust's aliasing rules.
unsafe impl Send for PinnedBuffer {}
// SAFETY: shared access only hands out `&[u8]` after pending device writes completed.
unsafe impl Sync for PinnedBuffer {}

impl std::fmt::Debug for PinnedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedBuffer")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .finish()
    }
}

impl GpuContext {
    /// Allocates `len` bytes of page-locked (pinned) host memory, usable for asynchronous copies
    /// from every context (`CU_MEMHOSTALLOC_PORTABLE`). The memory is zeroed.
    pub fn alloc_pinned(&self, len: usize) -> GpuResult<PinnedBuffer> {
        self.alloc_pinned_flags(len, sys::CU_MEMHOSTALLOC_PORTABLE)
    }

    /// Allocates `len` bytes of zeroed pinned host memory that kernels can also read and write
    /// directly (`CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE`), at the address
    /// [`PinnedBuffer::mapped_device_ptr`] returns. Device accesses to it travel over the bus;
    /// whether device atomics on it are coherent with the CPU depends on the platform
    /// (`hostNativeAtomicSupported`), so share only plain loads and stores with the host.
    pub fn alloc_pinned_mapped(&self, len: usize) -> GpuResult<PinnedBuffer> {
        self.alloc_pinned_flags(
            len,
            sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP,
        )
    }

    fn alloc_pinned_flags(&self, len: usize, flags: u32) -> GpuResult<PinnedBuffer> {
        if len == 0 {
            return Err(GpuError::EmptyAllocation);
        }
        self.inner.bind()?;
        let mut raw: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: the context is current; valid out-pointer; `len` is non-zero; `flags` is a
        // combination of defined CU_MEMHOSTALLOC_* bits. The memory is owned by the returned
        // buffer, which frees it with `cuMemFreeHost`.
        let rc = unsafe { sys::cuMemHostAlloc(&mut raw, len, flags) };
        check(rc, "cuMemHostAlloc")?;
        let Some(ptr) = NonNull::new(raw.cast::<u8>()) else {
            return Err(GpuError::Driver {
                call: "cuMemHostAlloc",
                code: 0,
                name: String::from("CUDA_SUCCESS"),
                description: String::from("returned a null pointer"),
            });
        };
        let mut buf = PinnedBuffer {
            ctx: self.inner.clone(),
            ptr,
            len,
            mapped: None,
            device_reads: UseTracker::new(),
            device_writes: UseTracker::new(),
        };
        // SAFETY: `ptr` points to `len` freshly allocated writable bytes; zeroing makes them
        // initialised before any `&[u8]` is handed out.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, len) };
        if flags & sys::CU_MEMHOSTALLOC_DEVICEMAP != 0 {
            let mut dptr: sys::CUdeviceptr = 0;
            // SAFETY: the context is current and `ptr` is the start of a live allocation made
            // with DEVICEMAP; flags must be 0; valid out-pointer. On error `buf` frees the
            // memory when dropped.
            let rc = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dptr, raw, 0) };
            check(rc, "cuMemHostGetDevicePointer")?;
            buf.mapped = Some(dptr);
        }
        Ok(buf)
    }
}

impl PinnedBuffer {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: zero-byte buffers cannot be allocated.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Host address of the first byte (e.g. for registering it with an RDMA device).
    pub fn host_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// The address kernels use for the first byte, for memory from
    /// [`GpuContext::alloc_pinned_mapped`]; `None` for memory that is not mapped.
    pub fn mapped_device_ptr(&self) -> Option<u64> {
        self.mapped
    }

    /// The buffer's bytes, after pending device-to-host copies into it completed.
    pub fn as_slice(&self) -> GpuResult<&[u8]> {
        self.ctx.bind()?;
        self.device_writes.wait_host()?;
        // SAFETY: the allocation holds `len` initialised bytes (zeroed at allocation, then only
        // written by the host or by copies that have completed); no `&mut` exists while `&self`
        // is borrowed.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) })
    }

    /// The buffer's bytes for writing, after all pending copies from or into it completed.
    pub fn as_mut_slice(&mut self) -> GpuResult<&mut [u8]> {
        self.ctx.bind()?;
        self.device_reads.wait_host()?;
        self.device_writes.wait_host()?;
        // SAFETY: as in `as_slice`; `&mut self` guarantees exclusivity on the host side and no
        // device copy is in flight.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) })
    }

    /// A view of a byte range, usable as the source of an asynchronous host-to-device copy.
    pub fn slice(&self, range: impl RangeBounds<usize>) -> GpuResult<PinnedSlice<'_>> {
        let (offset, len) = resolve_range(self.len as u64, range)?;
        Ok(PinnedSlice {
            buf: self,
            offset: offset as usize,
            len: len as usize,
        })
    }

    /// A writable view of a byte range, usable as the destination of an asynchronous
    /// device-to-host copy.
    pub fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> GpuResult<PinnedSliceMut<'_>> {
        let (offset, len) = resolve_range(self.len as u64, range)?;
        Ok(PinnedSliceMut {
            buf: self,
            offset: offset as usize,
            len: len as usize,
        })
    }

    pub(crate) fn addr_at(&self, offset: usize) -> *mut u8 {
        self.ptr.as_ptr().wrapping_add(offset)
    }
}

impl PinnedBuffer {
    /// Gives the buffer to the host alone: waits for every enqueued copy from or into it,
    /// then returns a [`HostPinned`], whose bytes are accessed without further checks (no
    /// copy can be enqueued on it). [`HostPinned::into_pinned`] turns it back.
    pub fn into_host(self) -> GpuResult<HostPinned> {
        self.ctx.bind()?;
        self.device_reads.wait_host()?;
        self.device_writes.wait_host()?;
        Ok(HostPinned { buf: self })
    }
}

/// Pinned memory held by the host only: no device copy is in flight or can be enqueued, so
/// its bytes are plain memory (for a network receive to land in, for example).
#[derive(Debug)]
pub struct HostPinned {
    buf: PinnedBuffer,
}

impl HostPinned {
    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: every device copy from or into the allocation completed before this value
        // was made, and none can be enqueued while it exists (it exposes no device view); the
        // allocation holds `len` initialised bytes and `&self` excludes writers.
        unsafe { std::slice::from_raw_parts(self.buf.ptr.as_ptr(), self.buf.len) }
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.buf.ptr.as_ptr(), self.buf.len) }
    }

    /// The pinned buffer again, for device copies.
    pub fn into_pinned(self) -> PinnedBuffer {
        self.buf
    }
}

impl HostPinned {
    /// Splits the memory into owned parts of `chunk` bytes each (the last may be shorter), for
    /// example one per buffer that a network receive lands in and a kernel then reads through
    /// the mapped address ([`PinnedChunk::mapped_device_ptr`]). The allocation is freed with
    /// its last part.
    pub fn into_chunks(self, chunk: usize) -> GpuResult<Vec<PinnedChunk>> {
        if chunk == 0 {
            return Err(GpuError::EmptyAllocation);
        }
        let len = self.buf.len;
        let region = Arc::new(self.buf);
        Ok((0..len)
            .step_by(chunk)
            .map(|offset| PinnedChunk {
                region: Arc::clone(&region),
                offset,
                len: chunk.min(len - offset),
            })
            .collect())
    }
}

/// A part of a pinned allocation split by [`HostPinned::into_chunks`]: plain memory for the
/// host, like [`HostPinned`], disjoint from every other part. No device copy can be enqueued
/// on it; kernels reach mapped memory through [`mapped_device_ptr`](Self::mapped_device_ptr),
/// and an API that lets a kernel read a part takes it by value until the kernel has run (as
/// `nvmeof_cuda_kernels`' `scatter_chunks` does).
pub struct PinnedChunk {
    region: Arc<PinnedBuffer>,
    offset: usize,
    len: usize,
}

impl std::fmt::Debug for PinnedChunk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedChunk")
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

impl PinnedChunk {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: parts are never empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Where the part starts in its allocation.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Length of the whole allocation.
    pub fn region_len(&self) -> usize {
        self.region.len
    }

    /// The address kernels use for the allocation's first byte (not this part's) when it was
    /// allocated mapped ([`GpuContext::alloc_pinned_mapped`]).
    pub fn mapped_device_ptr(&self) -> Option<u64> {
        self.region.mapped
    }

    /// Whether both parts come from the same allocation.
    pub fn same_region(&self, other: &PinnedChunk) -> bool {
        Arc::ptr_eq(&self.region, &other.region)
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the allocation came from a `HostPinned` (no device copy in flight) and is
        // reachable only through its parts, which expose no device copy view; parts cover
        // disjoint ranges inside the allocation's `len` initialised bytes, and `&self`
        // excludes writers of this one.
        unsafe { std::slice::from_raw_parts(self.region.addr_at(self.offset), self.len) }
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; `&mut self` makes the access to this part exclusive, and
        // no other part overlaps it.
        unsafe { std::slice::from_raw_parts_mut(self.region.addr_at(self.offset), self.len) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        let _ = self.device_reads.wait_host();
        let _ = self.device_writes.wait_host();
        // SAFETY: the pointer came from `cuMemHostAlloc`, is freed once, after every tracked
        // copy completed, and no borrow of the buffer outlives `self`.
        let _ = unsafe { sys::cuMemFreeHost(self.ptr.as_ptr().cast()) };
        // While `ctx` is still held: dropping it may destroy the context.
        self.device_reads.release();
        self.device_writes.release();
    }
}

/// A read-only view of part of a [`PinnedBuffer`].
#[derive(Clone, Copy, Debug)]
pub struct PinnedSlice<'a> {
    pub(crate) buf: &'a PinnedBuffer,
    pub(crate) offset: usize,
    pub(crate) len: usize,
}

impl PinnedSlice<'_> {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty view.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A writable view of part of a [`PinnedBuffer`].
#[derive(Debug)]
pub struct PinnedSliceMut<'a> {
    pub(crate) buf: &'a mut PinnedBuffer,
    pub(crate) offset: usize,
    pub(crate) len: usize,
}

impl PinnedSliceMut<'_> {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty view.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Rounds `value` up to a multiple of `align` (a power of two), `None` on overflow.
pub(crate) fn round_up(value: u64, align: u64) -> Option<u64> {
    debug_assert!(align.is_power_of_two());
    value.checked_add(align - 1).map(|v| v & !(align - 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolve_range_forms() {
        assert_eq!(resolve_range(100, ..).unwrap(), (0, 100));
        assert_eq!(resolve_range(100, 3..10).unwrap(), (3, 7));
        assert_eq!(resolve_range(100, 3..=10).unwrap(), (3, 8));
        assert_eq!(resolve_range(100, ..7).unwrap(), (0, 7));
        assert_eq!(resolve_range(100, 99..).unwrap(), (99, 1));
        assert_eq!(resolve_range(100, 100..).unwrap(), (100, 0));
        assert_eq!(resolve_range(100, 5..5).unwrap(), (5, 0));
    }

    #[test]
    fn resolve_range_rejects_out_of_bounds() {
        assert_eq!(
            resolve_range(100, 90..101),
            Err(GpuError::OutOfBounds {
                offset: 90,
                len: 11,
                size: 100
            })
        );
        assert!(resolve_range(100, 101..).is_err());
        #[allow(clippy::reversed_empty_ranges)]
        let reversed = resolve_range(100, 10..5);
        assert!(reversed.is_err());
        assert!(resolve_range(10, ..=usize::MAX).is_err());
    }

    #[test]
    fn check_range_overflow_is_an_error() {
        assert!(check_range(0, 10, 10).is_ok());
        assert!(check_range(10, 0, 10).is_ok());
        assert!(check_range(1, 10, 10).is_err());
        assert!(check_range(u64::MAX, 2, u64::MAX).is_err());
    }

    #[test]
    fn round_up_works() {
        assert_eq!(round_up(0, 4096), Some(0));
        assert_eq!(round_up(1, 4096), Some(4096));
        assert_eq!(round_up(4096, 4096), Some(4096));
        assert_eq!(round_up(4097, 4096), Some(8192));
        assert_eq!(round_up(u64::MAX, 4096), None);
    }
}
