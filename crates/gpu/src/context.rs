//! [`GpuContext`]: one CUDA device's primary context and what it reports about itself.

use std::ffi::CStr;
use std::sync::Arc;

use cudarc::driver::sys;

use crate::driver::{check, ensure_driver};
use crate::error::{GpuError, GpuResult};
use crate::stream::StreamHandle;

/// Static facts about a CUDA device, read once when the context is created.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Device ordinal (0-based).
    pub ordinal: usize,
    /// Marketing name, e.g. `NVIDIA H100 80GB HBM3`.
    pub name: String,
    /// Total device memory in bytes.
    pub total_memory: u64,
    /// Compute capability `(major, minor)`, e.g. `(9, 0)` for Hopper.
    pub compute_capability: (u32, u32),
    /// Number of streaming multiprocessors.
    pub multiprocessors: u32,
    /// PCI bus id, e.g. `0000:3b:00.0`.
    pub pci_bus_id: String,
    /// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`: device memory can be exported as dma-buf.
    pub dma_buf_supported: bool,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED`.
    pub gpudirect_rdma_supported: bool,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS` bit mask
    /// (bit 0: `cuFlushGPUDirectRDMAWrites` from the host, bit 1: stream memory operations).
    pub rdma_flush_options: u32,
    /// Default shared memory per block in bytes.
    pub max_shared_memory_per_block: u32,
    /// Driver API version, e.g. 13000.
    pub driver_version: i32,
}

impl DeviceInfo {
    /// Compute capability as `major * 10 + minor` (90 for Hopper), the number NVRTC uses in
    /// `sm_XX` / `compute_XX`.
    pub fn arch(&self) -> u32 {
        self.compute_capability.0 * 10 + self.compute_capability.1
    }
}

/// Scope of [`GpuContext::flush_gpudirect_rdma_writes`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlushScope {
    /// Make prior RDMA writes visible to work on the owning device.
    ToOwner,
    /// Make prior RDMA writes visible to all devices.
    ToAllDevices,
}

pub(crate) struct CtxInner {
    pub(crate) device: sys::CUdevice,
    pub(crate) raw: sys::CUcontext,
    pub(crate) info: DeviceInfo,
    /// Stream used by the blocking helpers (copies to/from pageable memory, zeroing).
    pub(crate) internal: StreamHandle,
}

// SAFETY: `CUcontext` and `CUstream` are driver handles that may be used from any thread once the
// context is made current there, which every method does through `CtxInner::bind`.
unsafe impl Send for CtxInner {}
// SAFETY: as above; the driver API is thread-safe and the struct has no interior mutability.
unsafe impl Sync for CtxInner {}

impl CtxInner {
    /// Makes this context current on the calling thread.
    pub(crate) fn bind(&self) -> GpuResult<()> {
        // SAFETY: `raw` is a retained primary context that stays valid until `Drop`.
        let rc = unsafe { sys::cuCtxSetCurrent(self.raw) };
        check(rc, "cuCtxSetCurrent")
    }
}

impl Drop for CtxInner {
    fn drop(&mut self) {
        if self.bind().is_ok() {
            // SAFETY: the internal stream was created by `GpuContext::new` and nothing else
            // destroys it; every buffer and stream holds an `Arc` of this context, so none is
            // left that could use it.
            let _ = unsafe { sys::cuStreamDestroy_v2(self.internal.raw) };
        }
        // SAFETY: balances the `cuDevicePrimaryCtxRetain` of `GpuContext::new`.
        let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.device) };
    }
}

/// A CUDA device's primary context: the entry point for allocations, streams, events, modules.
///
/// Cloning is cheap (an `Arc`); every buffer, stream and module keeps its context alive. The
/// primary context is shared with other CUDA users in the process (e.g. PyTorch), so device
/// pointers can be handed to them.
#[derive(Clone)]
pub struct GpuContext {
    pub(crate) inner: Arc<CtxInner>,
}

impl std::fmt::Debug for GpuContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuContext")
            .field("info", &self.inner.info)
            .finish()
    }
}

/// Number of CUDA devices, or the reason none can be used.
pub fn device_count() -> GpuResult<usize> {
    Ok(ensure_driver()?.device_count)
}

impl GpuContext {
    /// Opens device `ordinal`: loads the driver, retains the primary context and reads the
    /// device's attributes.
    pub fn new(ordinal: usize) -> GpuResult<Self> {
        let driver = ensure_driver()?;
        if ordinal >= driver.device_count {
            return Err(GpuError::NoSuchDevice {
                ordinal,
                count: driver.device_count,
            });
        }
        let ordinal_i32 = i32::try_from(ordinal).map_err(|_| GpuError::NoSuchDevice {
            ordinal,
            count: driver.device_count,
        })?;
        let mut device: sys::CUdevice = 0;
        // SAFETY: the driver is initialised and the ordinal is in range; valid out-pointer.
        let rc = unsafe { sys::cuDeviceGet(&mut device, ordinal_i32) };
        check(rc, "cuDeviceGet")?;
        let mut raw: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `device` is valid; the retained context is released in `CtxInner::drop` (or
        // below on the error path).
        let rc = unsafe { sys::cuDevicePrimaryCtxRetain(&mut raw, device) };
        check(rc, "cuDevicePrimaryCtxRetain")?;
        let release = |e: GpuError| {
            // SAFETY: balances the retain above on an error path before `CtxInner` exists.
            let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(device) };
            e
        };
        // SAFETY: `raw` was just retained.
        check(unsafe { sys::cuCtxSetCurrent(raw) }, "cuCtxSetCurrent").map_err(release)?;
        let info = read_info(device, ordinal, driver.version).map_err(release)?;
        let internal = StreamHandle::create().map_err(release)?;
        Ok(GpuContext {
            inner: Arc::new(CtxInner {
                device,
                raw,
                info,
                internal,
            }),
        })
    }

    /// Facts read from the device when the context was created.
    pub fn info(&self) -> &DeviceInfo {
        &self.inner.info
    }

    /// Device ordinal.
    pub fn ordinal(&self) -> usize {
        self.inner.info.ordinal
    }

    /// Device name.
    pub fn name(&self) -> &str {
        &self.inner.info.name
    }

    /// Total device memory in bytes.
    pub fn total_memory(&self) -> u64 {
        self.inner.info.total_memory
    }

    /// Compute capability `(major, minor)`.
    pub fn compute_capability(&self) -> (u32, u32) {
        self.inner.info.compute_capability
    }

    /// `(free, total)` device memory in bytes right now.
    pub fn memory_info(&self) -> GpuResult<(u64, u64)> {
        self.inner.bind()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: the context is current; valid out-pointers.
        let rc = unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) };
        check(rc, "cuMemGetInfo")?;
        Ok((free as u64, total as u64))
    }

    /// Blocks until all work submitted to this context has finished.
    pub fn synchronize(&self) -> GpuResult<()> {
        self.inner.bind()?;
        // SAFETY: the context is current.
        check(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize")
    }

    /// True when both handles refer to the same context object.
    pub fn same_as(&self, other: &GpuContext) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Orders earlier GPUDirect RDMA writes into this device's memory before later device work
    /// (`cuFlushGPUDirectRDMAWrites` on the current context). Call after the RDMA completions
    /// for reads into GPU memory arrived and before launching the consumers.
    pub fn flush_gpudirect_rdma_writes(&self, scope: FlushScope) -> GpuResult<()> {
        if self.inner.info.rdma_flush_options & 1 == 0 {
            return Err(GpuError::FlushUnsupported);
        }
        self.inner.bind()?;
        let scope = match scope {
            FlushScope::ToOwner => {
                sys::CUflushGPUDirectRDMAWritesScope::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER
            }
            FlushScope::ToAllDevices => {
                sys::CUflushGPUDirectRDMAWritesScope::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_ALL_DEVICES
            }
        };
        // SAFETY: the context is current; both enum values are valid for this call.
        let rc = unsafe {
            sys::cuFlushGPUDirectRDMAWrites(
                sys::CUflushGPUDirectRDMAWritesTarget::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
                scope,
            )
        };
        check(rc, "cuFlushGPUDirectRDMAWrites")
    }
}

fn attribute(device: sys::CUdevice, attr: sys::CUdevice_attribute) -> GpuResult<i32> {
    let mut value = 0i32;
    // SAFETY: `device` is valid, `attr` is a defined attribute, the out-pointer is valid.
    let rc = unsafe { sys::cuDeviceGetAttribute(&mut value, attr, device) };
    check(rc, "cuDeviceGetAttribute")?;
    Ok(value)
}

fn read_info(device: sys::CUdevice, ordinal: usize, driver_version: i32) -> GpuResult<DeviceInfo> {
    use sys::CUdevice_attribute as A;
    let mut name_buf = [0 as std::ffi::c_char; 256];
    // SAFETY: the buffer holds 256 chars and its length is passed; the driver NUL-terminates.
    let rc = unsafe { sys::cuDeviceGetName(name_buf.as_mut_ptr(), 256, device) };
    check(rc, "cuDeviceGetName")?;
    name_buf[255] = 0;
    // SAFETY: the driver wrote a NUL-terminated string into the buffer; its last byte is 0.
    let name = unsafe { CStr::from_ptr(name_buf.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    let mut bus = [0 as std::ffi::c_char; 64];
    // SAFETY: as above, a 64-char buffer with its length.
    let rc = unsafe { sys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), 64, device) };
    check(rc, "cuDeviceGetPCIBusId")?;
    bus[63] = 0;
    // SAFETY: NUL-terminated by the driver and by the assignment above.
    let pci_bus_id = unsafe { CStr::from_ptr(bus.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    let mut total = 0usize;
    // SAFETY: valid device and out-pointer.
    let rc = unsafe { sys::cuDeviceTotalMem_v2(&mut total, device) };
    check(rc, "cuDeviceTotalMem")?;
    let nonneg = |v: i32| u32::try_from(v).unwrap_or(0);
    Ok(DeviceInfo {
        ordinal,
        name,
        total_memory: total as u64,
        compute_capability: (
            nonneg(attribute(
                device,
                A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
            )?),
            nonneg(attribute(
                device,
                A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
            )?),
        ),
        multiprocessors: nonneg(attribute(
            device,
            A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )?),
        pci_bus_id,
        dma_buf_supported: attribute(device, A::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)? != 0,
        gpudirect_rdma_supported: attribute(
            device,
            A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED,
        )? != 0,
        rdma_flush_options: nonneg(attribute(
            device,
            A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS,
        )?),
        max_shared_memory_per_block: nonneg(attribute(
            device,
            A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK,
        )?),
        driver_version,
    })
}
