//! Run-time compilation with NVRTC, module loading and a checked kernel launch API.
//!
//! # Code targets
//!
//! Kernels are compiled for the device's own architecture. When NVRTC knows the device's
//! `sm_XX` the result is a CUBIN (machine code): no PTX JIT happens, so an NVRTC newer than the
//! driver still works. Otherwise the highest `compute_XX` NVRTC supports below the device is
//! used and the driver JIT-compiles the PTX; then the PTX ISA version NVRTC emits must not be
//! newer than the driver accepts (CUDA 13.0 drivers, e.g. 580, accept up to ISA 9.0, which is
//! what NVRTC 13.0 emits).
//!
//! # The bounded-buffer kernel ABI
//!
//! [`Kernel::launch`] is a safe function. It can be, because of three rules:
//! 1. every device buffer is passed as two parameters, a pointer and its length in bytes
//!    (`const unsigned char* p, unsigned long long p_len`), built from a [`DeviceSlice`] or
//!    [`DeviceSliceMut`] by [`LaunchArgs`], so a kernel never receives an address without the
//!    size of the memory behind it;
//! 2. the parameter count and sizes supplied are checked against the compiled function
//!    (`cuFuncGetParamInfo`) before the launch, and buffers must belong to the stream's context;
//! 3. kernels loaded through this crate come from the project's own sources, which access
//!    memory only inside `[p, p + p_len)` of the buffers they were given (reviewed with the
//!    sources and exercised by the GPU tests).
//!
//! Every buffer argument is recorded in the buffer's use tracker, so buffers outlive the kernels
//! using them.

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys;
use cudarc::nvrtc::sys as nvrtc;

use crate::context::{CtxInner, GpuContext};
use crate::driver::{check, driver_error};
use crate::error::{GpuError, GpuResult};
use crate::memory::{DeviceAlloc, DeviceSlice, DeviceSliceMut};
use crate::stream::GpuStream;

/// What NVRTC produces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CodeTarget {
    /// Machine code for `sm_XX` (loaded without JIT).
    Cubin {
        /// Architecture number, e.g. 90.
        arch: u32,
    },
    /// PTX for `compute_XX`, JIT-compiled by the driver at load time.
    Ptx {
        /// Architecture number, e.g. 90.
        arch: u32,
    },
}

impl CodeTarget {
    /// The `--gpu-architecture` value, e.g. `sm_90` or `compute_90`.
    pub fn arch_option(&self) -> String {
        match self {
            CodeTarget::Cubin { arch } => format!("sm_{arch}"),
            CodeTarget::Ptx { arch } => format!("compute_{arch}"),
        }
    }
}

impl std::fmt::Display for CodeTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.arch_option())
    }
}

/// Chooses the code target for a device of architecture `device_arch` given the architectures
/// NVRTC supports: CUBIN for the exact architecture when available, else PTX for the highest
/// supported architecture not above the device's.
pub fn select_code_target(device_arch: u32, supported: &[u32]) -> GpuResult<CodeTarget> {
    if supported.contains(&device_arch) {
        return Ok(CodeTarget::Cubin { arch: device_arch });
    }
    supported
        .iter()
        .copied()
        .filter(|&a| a <= device_arch)
        .max()
        .map(|arch| CodeTarget::Ptx { arch })
        .ok_or_else(|| GpuError::NoCodeTarget {
            device: device_arch,
            supported: supported.to_vec(),
        })
}

/// Reads the `.version X.Y` directive of a PTX text, e.g. `(9, 0)`.
pub fn ptx_isa_version(ptx: &str) -> Option<(u32, u32)> {
    let line = ptx
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with(".version"))?;
    let ver = line.strip_prefix(".version")?.trim();
    let (major, minor) = ver.split_once('.')?;
    Some((major.trim().parse().ok()?, minor.trim().parse().ok()?))
}

/// Output of [`compile`]: a module image ready for [`GpuContext::load_module`].
#[derive(Debug, Clone)]
pub struct CompiledModule {
    name: String,
    target: CodeTarget,
    /// CUBIN bytes, or PTX text with a trailing NUL.
    image: Vec<u8>,
    log: String,
    nvrtc_version: (i32, i32),
}

impl CompiledModule {
    /// Program name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The target it was compiled for.
    pub fn target(&self) -> CodeTarget {
        self.target
    }

    /// Size of the image in bytes.
    pub fn image_len(&self) -> usize {
        self.image.len()
    }

    /// The PTX text (for PTX targets).
    pub fn ptx(&self) -> Option<&str> {
        match self.target {
            CodeTarget::Ptx { .. } => {
                let text = self.image.strip_suffix(&[0]).unwrap_or(&self.image);
                std::str::from_utf8(text).ok()
            }
            CodeTarget::Cubin { .. } => None,
        }
    }

    /// NVRTC's log (warnings), possibly empty.
    pub fn log(&self) -> &str {
        &self.log
    }

    /// NVRTC version that produced the image.
    pub fn nvrtc_version(&self) -> (i32, i32) {
        self.nvrtc_version
    }
}

fn ensure_nvrtc() -> GpuResult<()> {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: `is_culib_present` only probes whether the library can be opened.
    let present = *PRESENT.get_or_init(|| unsafe { nvrtc::is_culib_present() });
    if present {
        Ok(())
    } else {
        Err(GpuError::NvrtcNotFound)
    }
}

fn nvrtc_check(rc: nvrtc::nvrtcResult, call: &'static str) -> GpuResult<()> {
    if rc == nvrtc::nvrtcResult::NVRTC_SUCCESS {
        return Ok(());
    }
    // SAFETY: NVRTC is loaded (the failing call came from it); the returned pointer is a static
    // NUL-terminated string or null.
    let msg = unsafe { nvrtc::nvrtcGetErrorString(rc) };
    let message = if msg.is_null() {
        format!("{rc:?}")
    } else {
        // SAFETY: non-null static NUL-terminated string owned by NVRTC.
        unsafe { CStr::from_ptr(msg) }
            .to_string_lossy()
            .into_owned()
    };
    Err(GpuError::Nvrtc { call, message })
}

/// NVRTC's version `(major, minor)`.
pub fn nvrtc_version() -> GpuResult<(i32, i32)> {
    ensure_nvrtc()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: NVRTC is loaded; valid out-pointers.
    let rc = unsafe { nvrtc::nvrtcVersion(&mut major, &mut minor) };
    nvrtc_check(rc, "nvrtcVersion")?;
    Ok((major, minor))
}

/// Architectures NVRTC can compile for, e.g. `[75, 80, ..., 90, 100, 120]`.
pub fn nvrtc_supported_archs() -> GpuResult<Vec<u32>> {
    ensure_nvrtc()?;
    let mut n: c_int = 0;
    // SAFETY: NVRTC is loaded; valid out-pointer.
    let rc = unsafe { nvrtc::nvrtcGetNumSupportedArchs(&mut n) };
    nvrtc_check(rc, "nvrtcGetNumSupportedArchs")?;
    let mut archs = vec![0 as c_int; usize::try_from(n).unwrap_or(0)];
    if !archs.is_empty() {
        // SAFETY: the buffer holds exactly the number of entries NVRTC reported.
        let rc = unsafe { nvrtc::nvrtcGetSupportedArchs(archs.as_mut_ptr()) };
        nvrtc_check(rc, "nvrtcGetSupportedArchs")?;
    }
    Ok(archs
        .into_iter()
        .filter_map(|a| u32::try_from(a).ok())
        .collect())
}

/// Destroys an NVRTC program on every exit path.
struct Program(nvrtc::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program was created by `nvrtcCreateProgram` and is destroyed once.
        let _ = unsafe { nvrtc::nvrtcDestroyProgram(&mut self.0) };
    }
}

/// Compiles CUDA C++ `source` with NVRTC for `target`. `extra_options` are passed verbatim
/// after the architecture option (e.g. `-lineinfo`).
pub fn compile(
    source: &str,
    name: &str,
    target: CodeTarget,
    extra_options: &[&str],
) -> GpuResult<CompiledModule> {
    compile_with_headers(source, name, target, extra_options, &[])
}

/// [`compile`] with headers the source may `#include "name"`: `(name, contents)` pairs handed
/// to NVRTC (e.g. `nvmf_gpu.cuh`), so no header file needs to exist on disk.
pub fn compile_with_headers(
    source: &str,
    name: &str,
    target: CodeTarget,
    extra_options: &[&str],
    headers: &[(&str, &str)],
) -> GpuResult<CompiledModule> {
    ensure_nvrtc()?;
    let nvrtc_version = nvrtc_version()?;
    let src = CString::new(source).map_err(|_| GpuError::InvalidSource {
        program: name.to_owned(),
    })?;
    let cname = CString::new(name).map_err(|_| GpuError::InvalidName(name.to_owned()))?;
    let mut options = vec![
        CString::new(format!("--gpu-architecture={}", target.arch_option()))
            .map_err(|_| GpuError::InvalidName(target.arch_option()))?,
        CString::new("--std=c++17").map_err(|_| GpuError::InvalidName(String::new()))?,
    ];
    for opt in extra_options {
        options.push(CString::new(*opt).map_err(|_| GpuError::InvalidName((*opt).to_owned()))?);
    }
    let option_ptrs: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
    let num_options = c_int::try_from(option_ptrs.len())
        .map_err(|_| GpuError::InvalidName(String::from("too many options")))?;

    let mut header_strings = Vec::with_capacity(headers.len());
    for (hname, contents) in headers {
        let n = CString::new(*hname).map_err(|_| GpuError::InvalidName((*hname).to_owned()))?;
        let c = CString::new(*contents).map_err(|_| GpuError::InvalidSource {
            program: (*hname).to_owned(),
        })?;
        header_strings.push((n, c));
    }
    let header_names: Vec<*const c_char> = header_strings.iter().map(|h| h.0.as_ptr()).collect();
    let header_sources: Vec<*const c_char> = header_strings.iter().map(|h| h.1.as_ptr()).collect();
    let num_headers = c_int::try_from(headers.len())
        .map_err(|_| GpuError::InvalidName(String::from("too many headers")))?;
    let mut raw: nvrtc::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: `src`, `cname` and every header name and source are NUL-terminated and outlive
    // the program (they are dropped after `prog` below); both header arrays hold
    // `num_headers` pointers (null when there are none).
    let rc = unsafe {
        nvrtc::nvrtcCreateProgram(
            &mut raw,
            src.as_ptr(),
            cname.as_ptr(),
            num_headers,
            if headers.is_empty() {
                std::ptr::null()
            } else {
                header_sources.as_ptr()
            },
            if headers.is_empty() {
                std::ptr::null()
            } else {
                header_names.as_ptr()
            },
        )
    };
    nvrtc_check(rc, "nvrtcCreateProgram")?;
    let prog = Program(raw);
    // SAFETY: `prog` is a live program; the option array and its strings outlive the call.
    let compiled = unsafe { nvrtc::nvrtcCompileProgram(prog.0, num_options, option_ptrs.as_ptr()) };
    let log = program_log(&prog)?;
    if compiled != nvrtc::nvrtcResult::NVRTC_SUCCESS {
        return Err(GpuError::Compile {
            program: name.to_owned(),
            target: target.arch_option(),
            log,
        });
    }
    let image = match target {
        CodeTarget::Cubin { .. } => {
            let mut size = 0usize;
            // SAFETY: the program compiled successfully; valid out-pointer.
            let rc = unsafe { nvrtc::nvrtcGetCUBINSize(prog.0, &mut size) };
            nvrtc_check(rc, "nvrtcGetCUBINSize")?;
            let mut image = vec![0u8; size];
            // SAFETY: the buffer has the size NVRTC reported.
            let rc = unsafe { nvrtc::nvrtcGetCUBIN(prog.0, image.as_mut_ptr().cast()) };
            nvrtc_check(rc, "nvrtcGetCUBIN")?;
            image
        }
        CodeTarget::Ptx { .. } => {
            let mut size = 0usize;
            // SAFETY: the program compiled successfully; valid out-pointer.
            let rc = unsafe { nvrtc::nvrtcGetPTXSize(prog.0, &mut size) };
            nvrtc_check(rc, "nvrtcGetPTXSize")?;
            let mut image = vec![0u8; size];
            // SAFETY: the buffer has the size NVRTC reported (which includes the NUL).
            let rc = unsafe { nvrtc::nvrtcGetPTX(prog.0, image.as_mut_ptr().cast()) };
            nvrtc_check(rc, "nvrtcGetPTX")?;
            if image.last() != Some(&0) {
                image.push(0);
            }
            image
        }
    };
    drop(prog);
    drop(src);
    drop(header_strings);
    Ok(CompiledModule {
        name: name.to_owned(),
        target,
        image,
        log,
        nvrtc_version,
    })
}

fn program_log(prog: &Program) -> GpuResult<String> {
    let mut size = 0usize;
    // SAFETY: live program; valid out-pointer.
    let rc = unsafe { nvrtc::nvrtcGetProgramLogSize(prog.0, &mut size) };
    nvrtc_check(rc, "nvrtcGetProgramLogSize")?;
    if size <= 1 {
        return Ok(String::new());
    }
    let mut log = vec![0u8; size];
    // SAFETY: the buffer has the size NVRTC reported.
    let rc = unsafe { nvrtc::nvrtcGetProgramLog(prog.0, log.as_mut_ptr().cast()) };
    nvrtc_check(rc, "nvrtcGetProgramLog")?;
    let text = log.strip_suffix(&[0]).unwrap_or(&log);
    Ok(String::from_utf8_lossy(text).trim_end().to_owned())
}

struct ModuleInner {
    ctx: Arc<CtxInner>,
    raw: sys::CUmodule,
    name: String,
}

// SAFETY: a `CUmodule` may be used from any thread with its context current.
unsafe impl Send for ModuleInner {}
// SAFETY: as above; the struct is immutable.
unsafe impl Sync for ModuleInner {}

impl Drop for ModuleInner {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            // Kernels of this module may still be running; unloading must wait for them.
            // SAFETY: the context is current.
            let _ = unsafe { sys::cuCtxSynchronize() };
        }
        // SAFETY: the module was loaded by `load_module` and is unloaded once; no `Kernel`
        // (which holds an `Arc` of this) is left.
        let _ = unsafe { sys::cuModuleUnload(self.raw) };
    }
}

/// A loaded module.
#[derive(Clone)]
pub struct Module {
    inner: Arc<ModuleInner>,
}

impl std::fmt::Debug for Module {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Module")
            .field("name", &self.inner.name)
            .finish()
    }
}

impl GpuContext {
    /// The code target [`compile_module`](Self::compile_module) uses for this device.
    pub fn default_code_target(&self) -> GpuResult<CodeTarget> {
        select_code_target(self.info().arch(), &nvrtc_supported_archs()?)
    }

    /// Compiles `source` for this device (see [`default_code_target`](Self::default_code_target))
    /// and loads it.
    pub fn compile_module(&self, source: &str, name: &str) -> GpuResult<Module> {
        let target = self.default_code_target()?;
        let compiled = compile(source, name, target, &["-lineinfo"])?;
        self.load_module(&compiled)
    }

    /// Loads a compiled module into this context.
    pub fn load_module(&self, compiled: &CompiledModule) -> GpuResult<Module> {
        self.inner.bind()?;
        let mut raw: sys::CUmodule = std::ptr::null_mut();
        // SAFETY: the image is a complete CUBIN or NUL-terminated PTX produced by NVRTC and
        // outlives the call; the context is current.
        let rc = unsafe { sys::cuModuleLoadData(&mut raw, compiled.image.as_ptr().cast()) };
        if rc != sys::cudaError_enum::CUDA_SUCCESS {
            let err = driver_error(rc, "cuModuleLoadData");
            let ptx_note = compiled
                .ptx()
                .and_then(ptx_isa_version)
                .map(|(ma, mi)| {
                    format!(
                        " (PTX ISA {ma}.{mi} from NVRTC {:?})",
                        compiled.nvrtc_version
                    )
                })
                .unwrap_or_default();
            return Err(GpuError::ModuleLoad {
                module: compiled.name.clone(),
                reason: format!("{err}{ptx_note}"),
            });
        }
        Ok(Module {
            inner: Arc::new(ModuleInner {
                ctx: self.inner.clone(),
                raw,
                name: compiled.name.clone(),
            }),
        })
    }
}

/// Size and offset of one kernel parameter as compiled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamInfo {
    /// Offset in the parameter buffer.
    pub offset: usize,
    /// Size in bytes.
    pub size: usize,
}

/// A kernel function of a loaded module.
#[derive(Clone)]
pub struct Kernel {
    module: Arc<ModuleInner>,
    raw: sys::CUfunction,
    name: String,
    params: Vec<ParamInfo>,
}

// SAFETY: a `CUfunction` may be used from any thread with its context current.
unsafe impl Send for Kernel {}
// SAFETY: as above; the struct is immutable.
unsafe impl Sync for Kernel {}

impl std::fmt::Debug for Kernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kernel")
            .field("name", &self.name)
            .field("params", &self.params)
            .finish()
    }
}

/// Upper bound on parameters queried per kernel.
const MAX_PARAMS: usize = 256;

impl Module {
    /// Looks up an `extern "C"` kernel and reads its parameter layout.
    pub fn kernel(&self, name: &str) -> GpuResult<Kernel> {
        let cname = CString::new(name).map_err(|_| GpuError::InvalidName(name.to_owned()))?;
        self.inner.ctx.bind()?;
        let mut raw: sys::CUfunction = std::ptr::null_mut();
        // SAFETY: the module is loaded in the current context; `cname` is NUL-terminated.
        let rc = unsafe { sys::cuModuleGetFunction(&mut raw, self.inner.raw, cname.as_ptr()) };
        check(rc, "cuModuleGetFunction")?;
        let mut params = Vec::new();
        for index in 0..MAX_PARAMS {
            let (mut offset, mut size) = (0usize, 0usize);
            // SAFETY: `raw` is a valid function; an index past the last parameter returns
            // CUDA_ERROR_INVALID_VALUE, which ends the loop.
            let rc = unsafe { sys::cuFuncGetParamInfo(raw, index, &mut offset, &mut size) };
            if rc == sys::cudaError_enum::CUDA_ERROR_INVALID_VALUE {
                break;
            }
            check(rc, "cuFuncGetParamInfo")?;
            params.push(ParamInfo { offset, size });
        }
        Ok(Kernel {
            module: self.inner.clone(),
            raw,
            name: name.to_owned(),
            params,
        })
    }
}

/// Grid and block dimensions of a launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Blocks in x, y, z.
    pub grid: [u32; 3],
    /// Threads per block in x, y, z.
    pub block: [u32; 3],
    /// Dynamic shared memory per block in bytes.
    pub shared_mem_bytes: u32,
}

impl LaunchConfig {
    /// A one-dimensional launch of `blocks` blocks of `threads` threads.
    pub fn linear(blocks: u32, threads: u32) -> Self {
        LaunchConfig {
            grid: [blocks, 1, 1],
            block: [threads, 1, 1],
            shared_mem_bytes: 0,
        }
    }

    /// Checks the dimensions against CUDA's limits (and `max_shared` bytes of shared memory).
    pub fn validate(&self, max_shared: u32) -> GpuResult<()> {
        let [gx, gy, gz] = self.grid;
        let [bx, by, bz] = self.block;
        if gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0 {
            return Err(GpuError::InvalidLaunch(format!(
                "zero dimension in grid {:?} / block {:?}",
                self.grid, self.block
            )));
        }
        if gx > i32::MAX as u32 || gy > 65535 || gz > 65535 {
            return Err(GpuError::InvalidLaunch(format!(
                "grid {:?} exceeds (2^31-1, 65535, 65535)",
                self.grid
            )));
        }
        if bx > 1024 || by > 1024 || bz > 64 || u64::from(bx) * u64::from(by) * u64::from(bz) > 1024
        {
            return Err(GpuError::InvalidLaunch(format!(
                "block {:?} exceeds 1024 threads or (1024, 1024, 64)",
                self.block
            )));
        }
        if self.shared_mem_bytes > max_shared {
            return Err(GpuError::InvalidLaunch(format!(
                "{} bytes of shared memory exceed the {} byte limit",
                self.shared_mem_bytes, max_shared
            )));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy)]
enum Slot {
    U64(u64),
    U32(u32),
}

impl Slot {
    fn size(&self) -> usize {
        match self {
            Slot::U64(_) => 8,
            Slot::U32(_) => 4,
        }
    }
}

/// Kernel arguments following the bounded-buffer ABI (see the module documentation).
#[derive(Default)]
pub struct LaunchArgs<'a> {
    slots: Vec<Slot>,
    buffers: Vec<&'a Arc<DeviceAlloc>>,
}

impl std::fmt::Debug for LaunchArgs<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LaunchArgs")
            .field("slots", &self.slots)
            .field("buffers", &self.buffers.len())
            .finish()
    }
}

impl<'a> LaunchArgs<'a> {
    /// No arguments yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// A read-only buffer: adds two parameters, `const unsigned char*` and its byte length
    /// (`unsigned long long`).
    pub fn buffer(&mut self, slice: &DeviceSlice<'a>) -> &mut Self {
        self.slots.push(Slot::U64(slice.device_ptr()));
        self.slots.push(Slot::U64(slice.len));
        self.buffers.push(slice.alloc);
        self
    }

    /// A writable buffer: adds two parameters, `unsigned char*` and its byte length
    /// (`unsigned long long`). The view stays exclusively borrowed while the arguments live.
    pub fn buffer_mut(&mut self, slice: &'a mut DeviceSliceMut<'_>) -> &mut Self {
        self.slots.push(Slot::U64(slice.device_ptr()));
        self.slots.push(Slot::U64(slice.len));
        self.buffers.push(slice.alloc);
        self
    }

    /// An `unsigned long long` parameter.
    pub fn u64(&mut self, value: u64) -> &mut Self {
        self.slots.push(Slot::U64(value));
        self
    }

    /// An `unsigned int` parameter.
    pub fn u32(&mut self, value: u32) -> &mut Self {
        self.slots.push(Slot::U32(value));
        self
    }

    /// Number of parameter slots so far.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// True when no argument was added.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }
}

/// Checks supplied slot sizes against a kernel's compiled parameters.
fn check_params(kernel: &str, params: &[ParamInfo], sizes: &[usize]) -> GpuResult<()> {
    if params.len() != sizes.len() {
        return Err(GpuError::ParamCount {
            kernel: kernel.to_owned(),
            expected: params.len(),
            got: sizes.len(),
        });
    }
    for (index, (p, &got)) in params.iter().zip(sizes).enumerate() {
        if p.size != got {
            return Err(GpuError::ParamSize {
                kernel: kernel.to_owned(),
                index,
                expected: p.size,
                got,
            });
        }
    }
    Ok(())
}

impl Kernel {
    /// Kernel name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Parameter layout as compiled.
    pub fn params(&self) -> &[ParamInfo] {
        &self.params
    }

    /// Enqueues the kernel on `stream`. Checks the configuration, the argument layout against
    /// the compiled parameters and that every buffer belongs to the stream's context; records
    /// the launch in each buffer's tracker.
    pub fn launch(
        &self,
        stream: &GpuStream,
        config: &LaunchConfig,
        args: &LaunchArgs<'_>,
    ) -> GpuResult<()> {
        let ctx = stream.ctx();
        if !Arc::ptr_eq(ctx, &self.module.ctx) {
            return Err(GpuError::ContextMismatch);
        }
        if args.buffers.iter().any(|b| !Arc::ptr_eq(&b.ctx, ctx)) {
            return Err(GpuError::ContextMismatch);
        }
        config.validate(ctx.info.max_shared_memory_per_block)?;
        let sizes: Vec<usize> = args.slots.iter().map(Slot::size).collect();
        check_params(&self.name, &self.params, &sizes)?;

        // Stable storage for the values; the driver copies them during the launch call.
        let mut values: Vec<u64> = args
            .slots
            .iter()
            .map(|s| match *s {
                Slot::U64(v) => v,
                Slot::U32(v) => u64::from(v),
            })
            .collect();
        let mut narrow: Vec<u32> = args
            .slots
            .iter()
            .map(|s| match *s {
                Slot::U32(v) => v,
                Slot::U64(_) => 0,
            })
            .collect();
        let wide_base = values.as_mut_ptr();
        let narrow_base = narrow.as_mut_ptr();
        let mut pointers: Vec<*mut c_void> = args
            .slots
            .iter()
            .enumerate()
            .map(|(i, slot)| match slot {
                Slot::U64(_) => wide_base.wrapping_add(i).cast(),
                Slot::U32(_) => narrow_base.wrapping_add(i).cast(),
            })
            .collect();
        ctx.bind()?;
        let handle = stream.handle();
        let [gx, gy, gz] = config.grid;
        let [bx, by, bz] = config.block;
        let params_ptr = if pointers.is_empty() {
            std::ptr::null_mut()
        } else {
            pointers.as_mut_ptr()
        };
        // SAFETY: the function belongs to a module loaded in the current context (kept alive
        // by `self.module`); the configuration is within CUDA's limits; `pointers` holds one
        // pointer per compiled parameter, each to a value of exactly that parameter's size, all
        // alive during the call (the driver copies them before returning). Buffer arguments
        // carry their lengths (bounded-buffer ABI) and are tracked below so they outlive the
        // kernel.
        let rc = unsafe {
            sys::cuLaunchKernel(
                self.raw,
                gx,
                gy,
                gz,
                bx,
                by,
                bz,
                config.shared_mem_bytes,
                handle.raw,
                params_ptr,
                std::ptr::null_mut(),
            )
        };
        check(rc, "cuLaunchKernel")?;
        for buffer in &args.buffers {
            buffer.tracker.record(handle)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code_target_prefers_exact_cubin() {
        let supported = [75, 80, 86, 89, 90, 100, 120];
        assert_eq!(
            select_code_target(90, &supported).unwrap(),
            CodeTarget::Cubin { arch: 90 }
        );
        assert_eq!(
            select_code_target(87, &supported).unwrap(),
            CodeTarget::Ptx { arch: 86 }
        );
        assert_eq!(
            select_code_target(130, &supported).unwrap(),
            CodeTarget::Ptx { arch: 120 }
        );
        assert!(matches!(
            select_code_target(70, &supported),
            Err(GpuError::NoCodeTarget { device: 70, .. })
        ));
        assert!(select_code_target(90, &[]).is_err());
    }

    #[test]
    fn arch_options() {
        assert_eq!(CodeTarget::Cubin { arch: 90 }.arch_option(), "sm_90");
        assert_eq!(CodeTarget::Ptx { arch: 90 }.to_string(), "compute_90");
    }

    #[test]
    fn ptx_version_parsing() {
        let ptx = "//\n// Generated by NVIDIA NVVM Compiler\n\n.version 9.0\n.target sm_90\n";
        assert_eq!(ptx_isa_version(ptx), Some((9, 0)));
        assert_eq!(ptx_isa_version("  .version 8.7  \n"), Some((8, 7)));
        assert_eq!(ptx_isa_version(".target sm_90"), None);
        assert_eq!(ptx_isa_version(".version x.y"), None);
    }

    #[test]
    fn launch_config_limits() {
        assert!(LaunchConfig::linear(1, 256).validate(48 * 1024).is_ok());
        assert!(LaunchConfig::linear(0, 256).validate(48 * 1024).is_err());
        assert!(LaunchConfig::linear(1, 2048).validate(48 * 1024).is_err());
        let mut c = LaunchConfig::linear(1, 32);
        c.block = [32, 32, 2];
        assert!(c.validate(0).is_err());
        c.block = [32, 32, 1];
        assert!(c.validate(0).is_ok());
        c.grid = [1, 70000, 1];
        assert!(c.validate(0).is_err());
        let mut c = LaunchConfig::linear(1, 32);
        c.shared_mem_bytes = 100;
        assert!(c.validate(99).is_err());
        assert!(c.validate(100).is_ok());
    }

    #[test]
    fn param_checks() {
        let params = [
            ParamInfo { offset: 0, size: 8 },
            ParamInfo { offset: 8, size: 8 },
            ParamInfo {
                offset: 16,
                size: 4,
            },
        ];
        assert!(check_params("k", &params, &[8, 8, 4]).is_ok());
        assert!(matches!(
            check_params("k", &params, &[8, 8]),
            Err(GpuError::ParamCount {
                expected: 3,
                got: 2,
                ..
            })
        ));
        assert!(matches!(
            check_params("k", &params, &[8, 8, 8]),
            Err(GpuError::ParamSize {
                index: 2,
                expected: 4,
                got: 8,
                ..
            })
        ));
    }

    #[test]
    fn launch_args_use_two_slots_per_buffer() {
        let mut args = LaunchArgs::new();
        assert!(args.is_empty());
        args.u64(1).u32(2);
        assert_eq!(args.len(), 2);
        let sizes: Vec<usize> = args.slots.iter().map(Slot::size).collect();
        assert_eq!(sizes, vec![8, 4]);
    }

    #[test]
    fn nvrtc_absence_is_an_error_not_a_panic() {
        // On machines without NVRTC this returns NvrtcNotFound; with it, a version.
        match nvrtc_version() {
            Ok((major, _)) => assert!(major >= 11),
            Err(e) => assert_eq!(e, GpuError::NvrtcNotFound),
        }
    }
}
