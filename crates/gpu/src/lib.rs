//! CUDA device memory, pinned staging, streams and dma-buf export through cudarc with dynamic
//! loading.
//!
//! This crate is the only place of the GPU data path that talks to the CUDA driver. It loads
//! `libcuda.so` (and, for run-time compilation, `libnvrtc.so`) when first needed; on a machine
//! without them every entry point returns a typed error
//! ([`GpuError::DriverNotFound`], [`GpuError::NvrtcNotFound`]) instead of panicking, so code
//! using it builds and runs everywhere.
//!
//! What it offers:
//! - [`GpuContext`]: a device's primary context and its [`DeviceInfo`];
//! - [`DeviceBuffer`] with byte-offset views [`DeviceSlice`] / [`DeviceSliceMut`] (any offset,
//!   any length), blocking copies to and from host memory; device memory of other CUDA users
//!   in the process borrowed as a buffer ([`GpuContext::borrow_device_memory`], checked with
//!   [`device_of_pointer`]);
//! - [`PinnedBuffer`]: page-locked host staging memory;
//! - [`GpuStream`] / [`GpuEvent`] and asynchronous copies (`copy_h2d_async`, ...);
//!   [`StreamMark`], a word in mapped memory a stream writes as it passes, which the host
//!   polls with a load instead of a driver call;
//! - dma-buf export of device memory ([`DeviceSlice::export_dmabuf`] -> [`DmaBuf`]) for
//!   `ibv_reg_dmabuf_mr`, and [`GpuContext::flush_gpudirect_rdma_writes`];
//! - NVRTC compilation ([`compile`]), module loading and a checked, safe kernel launch
//!   ([`Kernel::launch`] with [`LaunchArgs`]) under the bounded-buffer ABI described in
//!   [`module`].
//!
//! Memory safety with asynchronous work: every allocation records the streams that use it, so
//! dropping a buffer, or reading pinned memory on the host, first waits for the GPU work that
//! touches it. Ordering *between* streams is the caller's job (events), as in CUDA.
//!
//! It must not contain NVMe or transport logic; it knows nothing about blocks or queues.
#![deny(unsafe_op_in_unsafe_fn)]

mod context;
mod dmabuf;
mod driver;
mod error;
mod mark;
mod memory;
pub mod module;
mod stream;
pub mod test_support;
mod tracker;

pub use context::{DeviceInfo, FlushScope, GpuContext, device_count};
pub use dmabuf::{DmaBuf, dmabuf_export_range, host_page_size};
pub use driver::{DriverInfo, MIN_DRIVER_VERSION, driver_available, ensure_driver};
pub use error::{GpuError, GpuResult};
pub use mark::StreamMark;
pub use memory::{
    DeviceBuffer, DeviceSlice, DeviceSliceMut, EXPORTABLE_GRANULARITY, HostPinned, PinnedBuffer,
    PinnedChunk, PinnedSlice, PinnedSliceMut, check_range, device_of_pointer, resolve_range,
};
pub use module::{
    CodeTarget, CompiledModule, Kernel, LaunchArgs, LaunchConfig, Module, ParamInfo, compile,
    compile_with_headers, nvrtc_supported_archs, nvrtc_version, ptx_isa_version,
    select_code_target,
};
pub use stream::{GpuEvent, GpuStream};

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn handles_are_send_and_sync() {
        assert_send_sync::<GpuContext>();
        assert_send_sync::<DeviceBuffer>();
        assert_send_sync::<DeviceSlice<'static>>();
        assert_send_sync::<PinnedBuffer>();
        assert_send_sync::<GpuStream>();
        assert_send_sync::<GpuEvent>();
        assert_send_sync::<StreamMark>();
        assert_send_sync::<Module>();
        assert_send_sync::<Kernel>();
        assert_send_sync::<DmaBuf>();
    }

    #[test]
    fn entry_points_fail_cleanly_without_a_driver() {
        // On a machine without libcuda every entry point returns the typed error; with a driver
        // this test has nothing to check.
        if driver_available() {
            return;
        }
        let err = GpuContext::new(0).unwrap_err();
        assert!(err.is_unavailable(), "{err}");
        assert_eq!(device_count().unwrap_err(), err);
        assert_eq!(ensure_driver().unwrap_err(), err);
        assert_eq!(device_of_pointer(0x7f00_0000_0000).unwrap_err(), err);
    }
}
