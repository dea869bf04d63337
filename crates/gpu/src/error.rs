//! Typed errors of the GPU layer.

/// Everything that can go wrong in the GPU layer.
///
/// Without a CUDA driver every entry point returns [`GpuError::DriverNotFound`]; nothing in this
/// crate panics because a library or a device is missing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GpuError {
    /// `libcuda.so` could not be loaded.
    #[error("CUDA driver not found (libcuda.so): GPU features unavailable")]
    DriverNotFound,
    /// The driver is older than the CUDA version this crate's bindings target.
    #[error(
        "CUDA driver reports version {found}, but {required} or newer is required \
         (CUDA 13.0, driver 580): GPU features unavailable"
    )]
    DriverTooOld {
        /// Version reported by `cuDriverGetVersion` (e.g. 12040 for 12.4).
        found: i32,
        /// Minimum version (13000).
        required: i32,
    },
    /// The driver loaded but reports no CUDA device.
    #[error("CUDA driver found but no CUDA device is present: GPU features unavailable")]
    NoDevice,
    /// The requested device ordinal does not exist.
    #[error("CUDA device ordinal {ordinal} does not exist ({count} device(s) present)")]
    NoSuchDevice {
        /// Ordinal asked for.
        ordinal: usize,
        /// Number of devices the driver reports.
        count: usize,
    },
    /// A CUDA driver call returned an error.
    #[error("{call} failed: {name} ({code}): {description}")]
    Driver {
        /// Driver API function that failed.
        call: &'static str,
        /// Numeric `CUresult`.
        code: u32,
        /// Symbolic name, e.g. `CUDA_ERROR_OUT_OF_MEMORY`.
        name: String,
        /// Driver's description of the error.
        description: String,
    },
    /// `libnvrtc.so` could not be loaded.
    #[error(
        "NVRTC library not found (libnvrtc.so): run-time kernel compilation unavailable; \
         add the CUDA toolkit's lib64 directory to LD_LIBRARY_PATH"
    )]
    NvrtcNotFound,
    /// An NVRTC call other than the compilation itself failed.
    #[error("NVRTC {call} failed: {message}")]
    Nvrtc {
        /// NVRTC function that failed.
        call: &'static str,
        /// NVRTC's error string.
        message: String,
    },
    /// NVRTC rejected the source.
    #[error("NVRTC compilation of {program} for {target} failed: {log}")]
    Compile {
        /// Program name given to NVRTC.
        program: String,
        /// Code target, e.g. `sm_90`.
        target: String,
        /// Compiler log.
        log: String,
    },
    /// Kernel source text contains a NUL byte.
    #[error("kernel source {program} contains a NUL byte")]
    InvalidSource {
        /// Program name.
        program: String,
    },
    /// No code target exists that both NVRTC and the device support.
    #[error(
        "no code target for a device of compute capability {device}: \
         NVRTC supports {supported:?}"
    )]
    NoCodeTarget {
        /// Device compute capability as `major * 10 + minor`.
        device: u32,
        /// Architectures NVRTC reports.
        supported: Vec<u32>,
    },
    /// A byte range does not fit in the buffer it refers to.
    #[error("range at offset {offset} of {len} bytes does not fit in a buffer of {size} bytes")]
    OutOfBounds {
        /// Start of the range.
        offset: u64,
        /// Length of the range.
        len: u64,
        /// Size of the buffer.
        size: u64,
    },
    /// A range is not aligned as the operation requires.
    #[error("range at offset {offset} of {len} bytes is not aligned to {align} bytes")]
    Unaligned {
        /// Start of the range.
        offset: u64,
        /// Length of the range.
        len: u64,
        /// Required alignment of address and length.
        align: u64,
    },
    /// Source and destination of a copy differ in length.
    #[error("length mismatch: destination has {dst} bytes, source has {src} bytes")]
    LengthMismatch {
        /// Destination length.
        dst: u64,
        /// Source length.
        src: u64,
    },
    /// A zero-byte allocation was requested.
    #[error("zero-byte allocations are not supported")]
    EmptyAllocation,
    /// A size computation overflowed.
    #[error("size {0} overflows the address space")]
    SizeOverflow(u64),
    /// Objects from different contexts were used together.
    #[error("buffers, streams, events and kernels from different CUDA contexts were mixed")]
    ContextMismatch,
    /// The device or platform cannot export device memory as dma-buf.
    #[error(
        "dma-buf export is not supported on this device/driver \
         (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 0)"
    )]
    DmaBufUnsupported,
    /// The page-aligned range around a slice does not lie inside its allocation.
    #[error(
        "dma-buf export needs the host-page-aligned range {aligned_start:#x}..{aligned_end:#x} \
         inside the allocation {alloc_start:#x}..{alloc_end:#x}; allocate with \
         GpuContext::alloc_exportable"
    )]
    DmaBufRange {
        /// Start of the page-aligned range.
        aligned_start: u64,
        /// End of the page-aligned range.
        aligned_end: u64,
        /// Start of the allocation.
        alloc_start: u64,
        /// End of the allocation (including padding).
        alloc_end: u64,
    },
    /// The driver does not support flushing GPUDirect RDMA writes.
    #[error(
        "cuFlushGPUDirectRDMAWrites is not supported on this device \
         (CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS has no host option)"
    )]
    FlushUnsupported,
    /// A kernel was launched with the wrong number of parameters.
    #[error("kernel {kernel} takes {expected} parameter slots, {got} were supplied")]
    ParamCount {
        /// Kernel name.
        kernel: String,
        /// Parameter count of the compiled function.
        expected: usize,
        /// Parameter slots supplied.
        got: usize,
    },
    /// A kernel parameter has a different size than the supplied argument.
    #[error("kernel {kernel} parameter {index} is {expected} bytes, the argument is {got} bytes")]
    ParamSize {
        /// Kernel name.
        kernel: String,
        /// Parameter index.
        index: usize,
        /// Size in the compiled function.
        expected: usize,
        /// Size of the supplied argument.
        got: usize,
    },
    /// Grid, block or shared-memory sizes are out of range.
    #[error("invalid launch configuration: {0}")]
    InvalidLaunch(String),
    /// A module image could not be loaded by the driver.
    #[error("loading module {module} failed: {reason}")]
    ModuleLoad {
        /// Module name.
        module: String,
        /// Driver error and, for PTX, the PTX ISA version of the image.
        reason: String,
    },
    /// `elapsed_ms` was asked of an event created without timing.
    #[error("elapsed time needs two events created with timing enabled")]
    EventTimingDisabled,
    /// An address handed in as device memory is not (or not wholly) device memory of the
    /// expected device.
    #[error("address {ptr:#x} is not usable device memory: {reason}")]
    NotDeviceMemory {
        /// The address.
        ptr: u64,
        /// What the driver said about it.
        reason: String,
    },
    /// A name passed to the driver contains a NUL byte.
    #[error("name {0:?} contains a NUL byte")]
    InvalidName(String),
}

impl GpuError {
    /// True when the error means "no usable CUDA driver or device here", the condition under
    /// which GPU tests skip instead of failing.
    pub fn is_unavailable(&self) -> bool {
        matches!(
            self,
            GpuError::DriverNotFound | GpuError::DriverTooOld { .. } | GpuError::NoDevice
        )
    }
}

/// Result alias of this crate.
pub type GpuResult<T> = Result<T, GpuError>;
