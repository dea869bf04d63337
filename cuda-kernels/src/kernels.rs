//! Loading the kernels (NVRTC at run time) and their safe launch wrappers.

use gpu::{
    CodeTarget, CompiledModule, DeviceBuffer, DeviceSlice, DeviceSliceMut, GpuContext, GpuError,
    GpuStream, Kernel, LaunchArgs, LaunchConfig, PinnedBuffer, compile, ptx_isa_version,
};

use crate::checksum::checksum_finalize;
use crate::error::KernelError;
use crate::pattern::VerifyReport;
use crate::plan::{
    ByteRange, CHUNK_SIZE, PatternRegion, ScatterCopy, WorkPlan, validate_ranges, validate_regions,
    validate_scatter,
};

/// Definitions shared by all kernels (pattern, checksum term, work items).
pub const COMMON_CUH: &str = include_str!("common.cuh");
/// The scatter kernel source (needs [`COMMON_CUH`] in front).
pub const SCATTER_CU: &str = include_str!("scatter.cu");
/// The fill / verify / checksum kernel source (needs [`COMMON_CUH`] in front).
pub const VERIFY_CU: &str = include_str!("verify.cu");

/// Threads per block of every launch: 8 warps, each working on its own chunks (the kernels
/// distribute work per warp, so this must be a multiple of 32).
pub const THREADS_PER_BLOCK: u32 = 256;

const WARPS_PER_BLOCK: u64 = THREADS_PER_BLOCK as u64 / 32;
const _: () = assert!(THREADS_PER_BLOCK % 32 == 0);

/// The full translation unit of the scatter kernel.
pub fn scatter_source() -> String {
    format!("{COMMON_CUH}\n{SCATTER_CU}")
}

/// The full translation unit of the fill, verify and checksum kernels.
pub fn verify_source() -> String {
    format!("{COMMON_CUH}\n{VERIFY_CU}")
}

/// How the kernels were built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuildInfo {
    /// Code target (e.g. `sm_90` CUBIN, or `compute_90` PTX).
    pub target: CodeTarget,
    /// NVRTC version used.
    pub nvrtc_version: (i32, i32),
    /// PTX ISA version of the images, for PTX targets.
    pub ptx_isa: Option<(u32, u32)>,
    /// Image sizes in bytes (scatter, verify).
    pub image_bytes: (usize, usize),
}

/// The compiled kernels for one context.
pub struct NvmfKernels {
    ctx: GpuContext,
    info: BuildInfo,
    pub(crate) scatter: Kernel,
    fill: Kernel,
    verify: Kernel,
    checksum: Kernel,
    max_blocks: u32,
}

impl std::fmt::Debug for NvmfKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmfKernels")
            .field("info", &self.info)
            .field("max_blocks", &self.max_blocks)
            .finish()
    }
}

fn build(source: &str, name: &str, target: CodeTarget) -> Result<CompiledModule, KernelError> {
    Ok(compile(source, name, target, &["-lineinfo"])?)
}

impl NvmfKernels {
    /// Compiles the kernels for the device of `ctx` (CUBIN for its exact architecture when
    /// NVRTC supports it, otherwise PTX; see [`gpu::module`]) and loads them.
    pub fn load(ctx: &GpuContext) -> Result<Self, KernelError> {
        let target = ctx.default_code_target()?;
        Self::load_for(ctx, target)
    }

    /// Compiles the kernels for an explicit code target (e.g. `CodeTarget::Ptx { arch: 90 }` to
    /// exercise the driver's PTX JIT) and loads them.
    pub fn load_for(ctx: &GpuContext, target: CodeTarget) -> Result<Self, KernelError> {
        let scatter_img = build(&scatter_source(), "nvmf_scatter.cu", target)?;
        let verify_img = build(&verify_source(), "nvmf_verify.cu", target)?;
        let scatter_mod = ctx.load_module(&scatter_img)?;
        let verify_mod = ctx.load_module(&verify_img)?;
        let info = BuildInfo {
            target,
            nvrtc_version: scatter_img.nvrtc_version(),
            ptx_isa: scatter_img.ptx().and_then(ptx_isa_version),
            image_bytes: (scatter_img.image_len(), verify_img.image_len()),
        };
        let max_blocks = ctx
            .info()
            .multiprocessors
            .max(1)
            .saturating_mul(8)
            .min(i32::MAX as u32);
        Ok(NvmfKernels {
            ctx: ctx.clone(),
            info,
            scatter: scatter_mod.kernel("nvmf_scatter")?,
            fill: verify_mod.kernel("nvmf_fill_pattern")?,
            verify: verify_mod.kernel("nvmf_verify_pattern")?,
            checksum: verify_mod.kernel("nvmf_checksum")?,
            max_blocks,
        })
    }

    /// How the kernels were built.
    pub fn build_info(&self) -> &BuildInfo {
        &self.info
    }

    /// The context the kernels are loaded in.
    pub fn context(&self) -> &GpuContext {
        &self.ctx
    }

    pub(crate) fn config(&self, total_chunks: u64) -> LaunchConfig {
        let blocks = total_chunks
            .div_ceil(WARPS_PER_BLOCK)
            .clamp(1, u64::from(self.max_blocks)) as u32;
        LaunchConfig::linear(blocks, THREADS_PER_BLOCK)
    }

    fn check_ws(&self, ws: &KernelWorkspace) -> Result<(), KernelError> {
        if ws.stream.context().same_as(&self.ctx) {
            Ok(())
        } else {
            Err(GpuError::ContextMismatch.into())
        }
    }

    /// Enqueues copies of staged blocks from `src` (the staging buffer) to their destination
    /// offsets in `dst`, on the workspace's stream. Offsets and lengths may be any byte values;
    /// copies are validated first (in bounds, no overlapping destinations). Returns once
    /// enqueued; synchronise the workspace stream (or record an event) before consuming `dst`.
    pub fn scatter(
        &self,
        ws: &mut KernelWorkspace,
        src: &DeviceSlice<'_>,
        dst: &mut DeviceSliceMut<'_>,
        copies: &[ScatterCopy],
    ) -> Result<(), KernelError> {
        self.check_ws(ws)?;
        validate_scatter(src.len() as u64, dst.len() as u64, copies)?;
        let plan = WorkPlan::new(
            copies.iter().map(|c| (c.src_offset, c.dst_offset, c.len)),
            CHUNK_SIZE,
        )?;
        if plan.is_empty() {
            return Ok(());
        }
        ws.upload(&plan)?;
        let items = ws.items.slice(..plan.encoded_len())?;
        let mut args = LaunchArgs::new();
        args.buffer(src)
            .buffer_mut(dst)
            .buffer(&items)
            .u64(plan.total_chunks())
            .u64(CHUNK_SIZE);
        self.scatter
            .launch(&ws.stream, &self.config(plan.total_chunks()), &args)?;
        Ok(())
    }

    /// Enqueues writing the seeded pattern into `regions` of `dst` (regions must not overlap).
    pub fn fill_pattern(
        &self,
        ws: &mut KernelWorkspace,
        dst: &mut DeviceSliceMut<'_>,
        regions: &[PatternRegion],
        seed: u64,
    ) -> Result<(), KernelError> {
        self.check_ws(ws)?;
        validate_regions(dst.len() as u64, regions, true)?;
        let plan = WorkPlan::new(
            regions.iter().map(|r| (r.offset, r.ns_offset, r.len)),
            CHUNK_SIZE,
        )?;
        if plan.is_empty() {
            return Ok(());
        }
        ws.upload(&plan)?;
        let items = ws.items.slice(..plan.encoded_len())?;
        let mut args = LaunchArgs::new();
        args.buffer_mut(dst)
            .buffer(&items)
            .u64(plan.total_chunks())
            .u64(CHUNK_SIZE)
            .u64(seed);
        self.fill
            .launch(&ws.stream, &self.config(plan.total_chunks()), &args)?;
        Ok(())
    }

    /// Checks that `regions` of `buf` hold the seeded pattern; waits for the result (and for
    /// earlier work on the workspace stream). The first mismatch offset is relative to `buf`.
    pub fn verify_pattern(
        &self,
        ws: &mut KernelWorkspace,
        buf: &DeviceSlice<'_>,
        regions: &[PatternRegion],
        seed: u64,
    ) -> Result<VerifyReport, KernelError> {
        self.check_ws(ws)?;
        validate_regions(buf.len() as u64, regions, false)?;
        let plan = WorkPlan::new(
            regions.iter().map(|r| (r.offset, r.ns_offset, r.len)),
            CHUNK_SIZE,
        )?;
        if plan.is_empty() {
            return Ok(VerifyReport::default());
        }
        ws.upload(&plan)?;
        ws.ensure_results(16)?;
        {
            let (mut count, mut first) = ws.results.slice_mut(0..16)?.split_at_mut(8)?;
            ws.stream.memset_async(&mut count, 0)?;
            ws.stream.memset_async(&mut first, 0xFF)?;
        }
        {
            let items = ws.items.slice(..plan.encoded_len())?;
            let mut result = ws.results.slice_mut(0..16)?;
            let mut args = LaunchArgs::new();
            args.buffer(buf)
                .buffer(&items)
                .u64(plan.total_chunks())
                .u64(CHUNK_SIZE)
                .u64(seed)
                .buffer_mut(&mut result);
            self.verify
                .launch(&ws.stream, &self.config(plan.total_chunks()), &args)?;
        }
        let raw = ws.read_results(16)?;
        let count = u64_at(&raw, 0);
        let first = u64_at(&raw, 1);
        Ok(VerifyReport {
            mismatched_bytes: count,
            first_mismatch: (count != 0).then_some(first),
        })
    }

    /// Checksums of `ranges` of `buf` (see [`crate::checksum`]); waits for the result.
    pub fn checksums(
        &self,
        ws: &mut KernelWorkspace,
        buf: &DeviceSlice<'_>,
        ranges: &[ByteRange],
    ) -> Result<Vec<u64>, KernelError> {
        self.check_ws(ws)?;
        validate_ranges(buf.len() as u64, ranges)?;
        if ranges.is_empty() {
            return Ok(Vec::new());
        }
        let plan = WorkPlan::new(
            ranges
                .iter()
                .enumerate()
                .map(|(i, r)| (r.offset, i as u64, r.len)),
            CHUNK_SIZE,
        )?;
        let out_len = ranges
            .len()
            .checked_mul(8)
            .ok_or(KernelError::PlanTooLarge)?;
        ws.ensure_results(out_len)?;
        ws.stream
            .memset_async(&mut ws.results.slice_mut(..out_len)?, 0)?;
        if !plan.is_empty() {
            ws.upload(&plan)?;
            let items = ws.items.slice(..plan.encoded_len())?;
            let mut sums = ws.results.slice_mut(..out_len)?;
            let mut args = LaunchArgs::new();
            args.buffer(buf)
                .buffer(&items)
                .u64(plan.total_chunks())
                .u64(CHUNK_SIZE)
                .buffer_mut(&mut sums);
            self.checksum
                .launch(&ws.stream, &self.config(plan.total_chunks()), &args)?;
        }
        let raw = ws.read_results(out_len)?;
        Ok(ranges
            .iter()
            .enumerate()
            .map(|(i, r)| checksum_finalize(u64_at(&raw, i), r.len))
            .collect())
    }
}

fn u64_at(bytes: &[u8], index: usize) -> u64 {
    let mut w = [0u8; 8];
    if let Some(src) = bytes.get(index * 8..index * 8 + 8) {
        w.copy_from_slice(src);
    }
    u64::from_le_bytes(w)
}

/// Per-stream scratch memory of the kernel wrappers: the stream all launches go to, the staged
/// work lists (pinned and device copies) and the result buffers. Reused across launches; grows
/// when needed. One workspace per stream that launches kernels.
pub struct KernelWorkspace {
    stream: GpuStream,
    /// Two host staging buffers used in turn, so preparing the next work list only waits for
    /// the upload before the previous one.
    staging: [PinnedBuffer; 2],
    next_staging: usize,
    items: DeviceBuffer,
    results: DeviceBuffer,
    results_host: PinnedBuffer,
}

impl std::fmt::Debug for KernelWorkspace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelWorkspace")
            .field("stream", &self.stream)
            .field("items_capacity", &self.items.len())
            .field("results_capacity", &self.results.len())
            .finish()
    }
}

const INITIAL_ITEMS: usize = 64 * 1024;
const INITIAL_RESULTS: usize = 4 * 1024;

impl KernelWorkspace {
    /// A workspace launching on `stream`.
    pub fn new(stream: &GpuStream) -> Result<Self, KernelError> {
        let ctx = stream.context();
        Ok(KernelWorkspace {
            stream: stream.clone(),
            staging: [
                ctx.alloc_pinned(INITIAL_ITEMS)?,
                ctx.alloc_pinned(INITIAL_ITEMS)?,
            ],
            next_staging: 0,
            items: ctx.alloc(INITIAL_ITEMS)?,
            results: ctx.alloc(INITIAL_RESULTS)?,
            results_host: ctx.alloc_pinned(INITIAL_RESULTS)?,
        })
    }

    /// The stream every launch of this workspace is enqueued on.
    pub fn stream(&self) -> &GpuStream {
        &self.stream
    }

    /// Waits for everything enqueued on the workspace's stream.
    pub fn synchronize(&self) -> Result<(), KernelError> {
        Ok(self.stream.synchronize()?)
    }

    fn ensure_items(&mut self, needed: usize) -> Result<(), KernelError> {
        if self.items.len() >= needed {
            return Ok(());
        }
        let cap = needed.max(self.items.len().saturating_mul(2));
        let ctx = self.stream.context();
        // Dropping the old buffers waits for the work that still uses them.
        self.staging = [ctx.alloc_pinned(cap)?, ctx.alloc_pinned(cap)?];
        self.items = ctx.alloc(cap)?;
        Ok(())
    }

    fn ensure_results(&mut self, needed: usize) -> Result<(), KernelError> {
        if self.results.len() >= needed {
            return Ok(());
        }
        let cap = needed.max(self.results.len().saturating_mul(2));
        let ctx = self.stream.context();
        self.results = ctx.alloc(cap)?;
        self.results_host = ctx.alloc_pinned(cap)?;
        Ok(())
    }

    /// Stages the encoded plan and enqueues its upload to `items`.
    fn upload(&mut self, plan: &WorkPlan) -> Result<(), KernelError> {
        let n = plan.encoded_len();
        self.ensure_items(n)?;
        // The device copy of the list is reused in stream order (the upload runs after the
        // previous kernel); the host staging buffer alternates, and `as_mut_slice` waits until
        // the upload that last read it has run.
        let staging = &mut self.staging[self.next_staging];
        self.next_staging = (self.next_staging + 1) % 2;
        plan.encode_into(staging.as_mut_slice()?)?;
        let src = staging.slice(..n)?;
        let mut dst = self.items.slice_mut(..n)?;
        self.stream.copy_h2d_async(&src, &mut dst)?;
        Ok(())
    }

    /// Copies the first `len` result bytes to the host and waits for them.
    fn read_results(&mut self, len: usize) -> Result<Vec<u8>, KernelError> {
        {
            let src = self.results.slice(..len)?;
            let mut dst = self.results_host.slice_mut(..len)?;
            self.stream.copy_d2h_async(&src, &mut dst)?;
        }
        self.stream.synchronize()?;
        Ok(self.results_host.as_slice()?[..len].to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_are_embedded_and_consistent() {
        let s = scatter_source();
        assert!(s.contains("struct nvmf_work"));
        assert!(s.contains("extern \"C\" __global__ void nvmf_scatter("));
        let v = verify_source();
        for k in [
            "nvmf_fill_pattern(",
            "nvmf_verify_pattern(",
            "nvmf_checksum(",
        ] {
            assert!(v.contains(k), "{k}");
        }
        // The CUDA constants match the Rust definitions.
        assert!(COMMON_CUH.contains("0x9E3779B97F4A7C15ULL"));
        assert!(COMMON_CUH.contains("0xBF58476D1CE4E5B9ULL"));
        assert!(COMMON_CUH.contains("0x94D049BB133111EBULL"));
        assert_eq!(crate::pattern::GOLDEN, 0x9E37_79B9_7F4A_7C15);
        // No NUL bytes (NVRTC takes a C string).
        assert!(!s.contains('\0') && !v.contains('\0'));
    }

    #[test]
    fn results_are_little_endian_words() {
        let mut raw = vec![0u8; 16];
        raw[..8].copy_from_slice(&5u64.to_le_bytes());
        raw[8..].copy_from_slice(&u64::MAX.to_le_bytes());
        assert_eq!(u64_at(&raw, 0), 5);
        assert_eq!(u64_at(&raw, 1), u64::MAX);
        assert_eq!(u64_at(&raw, 2), 0);
    }
}
