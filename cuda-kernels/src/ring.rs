//! The device side of the GPU request rings (`gpu_ring`): the header user kernels include, and
//! the push kernel with its launch wrapper.
//!
//! [`HEADER`] is `include/nvmf_gpu.cuh`: submit / warp submit / test / wait / read for GPU
//! threads. Give it to NVRTC as a header named [`HEADER_NAME`] (see [`compile_with_ring_header`])
//! and `#include "nvmf_gpu.cuh"` in the kernel. Kernels get the ring set's descriptor table
//! ([`gpu_ring::RingSet::table_buffer`]) as a buffer argument.
//!
//! [`RingPush`] is the push path of [`gpu_ring::DataMode::Push`]: one host-to-device copy of the
//! span of a ring's data area that holds a batch of completed slots, then `nvmf_ring_push`,
//! which copies each slot to its destination and publishes its completion word.

use gpu::{
    CodeTarget, CompiledModule, DeviceBuffer, GpuContext, GpuStream, Kernel, LaunchArgs,
    LaunchConfig, PinnedBuffer, compile_with_headers,
};
use gpu_ring::{PushItem, PushSource, RingSet};

use crate::error::KernelError;
use crate::kernels::THREADS_PER_BLOCK;

/// The device API of the rings (`nvmf_gpu.cuh`).
pub const HEADER: &str = include_str!("../include/nvmf_gpu.cuh");
/// The name kernels `#include`.
pub const HEADER_NAME: &str = "nvmf_gpu.cuh";
/// The push kernel's source (includes [`HEADER_NAME`]).
pub const PUSH_CU: &str = include_str!("ring_push.cu");
/// Bytes of one encoded push item (`struct nvmf_gpu_push_item`).
pub const PUSH_ITEM_BYTES: usize = 24;

/// Compiles a kernel source that includes `nvmf_gpu.cuh` (the header is supplied to NVRTC; no
/// file is needed).
pub fn compile_with_ring_header(
    source: &str,
    name: &str,
    target: CodeTarget,
    extra_options: &[&str],
) -> Result<CompiledModule, KernelError> {
    Ok(compile_with_headers(
        source,
        name,
        target,
        extra_options,
        &[(HEADER_NAME, HEADER)],
    )?)
}

/// The example kernel from the header's documentation (between `EXAMPLE BEGIN` and
/// `EXAMPLE END`, comment markers removed), kept compilable by the tests.
pub fn header_example() -> String {
    let mut out = String::new();
    let mut inside = false;
    for line in HEADER.lines() {
        if line.contains("EXAMPLE END") {
            break;
        }
        if inside {
            let code = line.strip_prefix("//").unwrap_or(line);
            out.push_str(code.strip_prefix(' ').unwrap_or(code));
            out.push('\n');
        }
        if line.contains("EXAMPLE BEGIN") {
            inside = true;
        }
    }
    out
}

/// Encodes push items for `nvmf_ring_push`; `base` is the data-area offset the staging buffer
/// starts at.
pub fn encode_push_items(items: &[PushItem], base: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(items.len() * PUSH_ITEM_BYTES);
    for it in items {
        let off = if it.bytes == 0 {
            0
        } else {
            it.data_offset - base
        };
        out.extend_from_slice(&off.to_le_bytes());
        out.extend_from_slice(&it.cpl_word.to_le_bytes());
        out.extend_from_slice(&it.slot.to_le_bytes());
        out.extend_from_slice(&it.bytes.to_le_bytes());
    }
    out
}

/// The span `[lo, hi)` of a ring's data area that holds the bytes of `items` (`None` when no
/// item carries bytes).
pub fn push_span(items: &[PushItem]) -> Option<(u64, u64)> {
    items
        .iter()
        .filter(|i| i.bytes != 0)
        .map(|i| (i.data_offset, i.data_offset + u64::from(i.bytes)))
        .reduce(|a, b| (a.0.min(b.0), a.1.max(b.1)))
}

/// Item buffers a [`RingPush`] rotates through, so that filling the next batch's list
/// rarely waits for the upload of an earlier one.
const ITEM_BUFFERS: usize = 4;

/// The push path of one context: the compiled `nvmf_ring_push`, a staging buffer and the
/// item list buffers, reused across batches. One per pushing thread (each has its own
/// stream); [`RingPush::fork`] makes another without compiling again.
///
/// Buffers grow when a batch needs more room; the outgrown ones are kept until the `RingPush`
/// is dropped, because freeing device memory may wait for the whole device, including the
/// kernels that wait on the rings this push serves.
pub struct RingPush {
    kernel: Kernel,
    staging: DeviceBuffer,
    items: Vec<(DeviceBuffer, PinnedBuffer)>,
    next_items: usize,
    retired: Vec<(Option<DeviceBuffer>, Option<PinnedBuffer>)>,
    max_blocks: u32,
}

impl std::fmt::Debug for RingPush {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingPush")
            .field("staging", &self.staging.len())
            .field("items", &self.items.first().map(|i| i.0.len()))
            .finish()
    }
}

impl RingPush {
    /// Compiles and loads the push kernel for the device of `ctx`. The staging buffer starts
    /// at 64 KiB; use [`RingPush::reserve`] to size it for a ring set before kernels run.
    pub fn load(ctx: &GpuContext) -> Result<RingPush, KernelError> {
        let target = ctx.default_code_target()?;
        let image = compile_with_ring_header(PUSH_CU, "nvmf_ring_push.cu", target, &["-lineinfo"])?;
        let module = ctx.load_module(&image)?;
        Self::with_kernel(ctx, module.kernel("nvmf_ring_push")?)
    }

    fn with_kernel(ctx: &GpuContext, kernel: Kernel) -> Result<RingPush, KernelError> {
        Ok(RingPush {
            kernel,
            staging: ctx.alloc(64 * 1024)?,
            items: Self::item_buffers(ctx, 64 * PUSH_ITEM_BYTES)?,
            next_items: 0,
            retired: Vec::new(),
            max_blocks: ctx.info().multiprocessors.clamp(1, 1024),
        })
    }

    fn item_buffers(
        ctx: &GpuContext,
        bytes: usize,
    ) -> Result<Vec<(DeviceBuffer, PinnedBuffer)>, KernelError> {
        (0..ITEM_BUFFERS)
            .map(|_| Ok((ctx.alloc(bytes)?, ctx.alloc_pinned(bytes)?)))
            .collect()
    }

    /// Another push path with the same loaded kernel and buffers of the same sizes (for
    /// another thread and stream).
    pub fn fork(&self) -> Result<RingPush, KernelError> {
        let ctx = self.staging.context();
        let mut p = Self::with_kernel(&ctx, self.kernel.clone())?;
        if p.staging.len() < self.staging.len() {
            p.staging = ctx.alloc(self.staging.len())?;
        }
        let items = self.items[0].0.len();
        if p.items[0].0.len() < items {
            p.items = Self::item_buffers(&ctx, items)?;
        }
        Ok(p)
    }

    /// Sizes the buffers for any batch of `set` (its whole data area, one item per slot), so
    /// that pushing never allocates.
    pub fn reserve(&mut self, set: &RingSet) -> Result<(), KernelError> {
        let cfg = set.config();
        let ctx = self.staging.context();
        let data = cfg.slots as usize * cfg.slot_bytes as usize;
        if self.staging.len() < data {
            let old = std::mem::replace(&mut self.staging, ctx.alloc(data)?);
            self.retired.push((Some(old), None));
        }
        self.grow_items(cfg.slots as usize * PUSH_ITEM_BYTES)
    }

    fn grow_items(&mut self, bytes: usize) -> Result<(), KernelError> {
        if self.items[0].0.len() >= bytes {
            return Ok(());
        }
        let ctx = self.staging.context();
        let fresh = Self::item_buffers(&ctx, bytes.next_power_of_two())?;
        for (dev, host) in std::mem::replace(&mut self.items, fresh) {
            self.retired.push((Some(dev), Some(host)));
        }
        Ok(())
    }

    /// Enqueues on `stream` the copy of `items`' bytes from ring `ring` (of the set `src`
    /// comes from) to the device, the copies to their destinations and the completion words.
    /// `stream` must not be the stream of the kernels waiting on the ring (they run while the
    /// push runs). Returns once enqueued; on an error nothing of the batch runs.
    pub fn push(
        &mut self,
        stream: &GpuStream,
        src: &PushSource,
        ring: u32,
        items: &[PushItem],
    ) -> Result<(), KernelError> {
        if items.is_empty() {
            return Ok(());
        }
        let Some(pinned) = src.host_block(ring) else {
            return Err(KernelError::NotAGpuRing { ring });
        };
        let ctx = stream.context();
        let span = push_span(items);
        let base = span.map_or(0, |s| s.0);
        let encoded = encode_push_items(items, base);
        self.grow_items(encoded.len())?;
        if let Some((lo, hi)) = span {
            let len = (hi - lo) as usize;
            if self.staging.len() < len {
                let old = std::mem::replace(&mut self.staging, ctx.alloc(len.next_power_of_two())?);
                self.retired.push((Some(old), None));
            }
        }
        let (items_dev, items_host) = &mut self.items[self.next_items];
        self.next_items = (self.next_items + 1) % ITEM_BUFFERS;
        // Waits for the upload of the batch that last used this buffer (ITEM_BUFFERS ago).
        items_host.as_mut_slice()?[..encoded.len()].copy_from_slice(&encoded);
        if let Some((lo, hi)) = span {
            let len = (hi - lo) as usize;
            let data = src.layout().data;
            let from = pinned.slice(data + lo as usize..data + hi as usize)?;
            stream.copy_h2d_async(&from, &mut self.staging.slice_mut(..len)?)?;
        }
        stream.copy_h2d_async(
            &items_host.slice(..encoded.len())?,
            &mut items_dev.slice_mut(..encoded.len())?,
        )?;
        let table = src.table().as_slice();
        let staging = self.staging.as_slice();
        let items_dev = items_dev.slice(..encoded.len())?;
        let mut args = LaunchArgs::new();
        args.buffer(&table)
            .u32(ring)
            .buffer(&staging)
            .buffer(&items_dev);
        let warps_per_block = u64::from(THREADS_PER_BLOCK / 32);
        let blocks = (items.len() as u64)
            .div_ceil(warps_per_block)
            .clamp(1, u64::from(self.max_blocks)) as u32;
        self.kernel.launch(
            stream,
            &LaunchConfig::linear(blocks, THREADS_PER_BLOCK),
            &args,
        )?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_mirrors_the_rust_layout() {
        assert!(HEADER.contains("sizeof(struct nvmf_gpu_ring) == 80"));
        assert_eq!(gpu_ring::RING_DESC_BYTES, 80);
        assert!(HEADER.contains("#define NVMF_GPU_TIMEOUT 0xFFFFu"));
        assert_eq!(gpu_ring::proto::status::TIMEOUT, 0xFFFF);
        assert!(HEADER.contains("#define NVMF_GPU_CLOSED 0xFFFEu"));
        assert_eq!(gpu_ring::proto::status::CLOSED, 0xFFFE);
        assert!(HEADER.contains("#define NVMF_GPU_FLAG_BAD_ARGS 0x01ULL"));
        assert_eq!(gpu_ring::proto::FLAG_BAD_ARGS, 1);
        assert!(HEADER.contains("#define NVMF_GPU_PUSH 1u"));
        assert_eq!(gpu_ring::DataMode::Push.as_u32(), 1);
        assert!(PUSH_CU.contains("sizeof(struct nvmf_gpu_push_item) == 24"));
        assert!(!HEADER.contains('\0') && !PUSH_CU.contains('\0'));
    }

    #[test]
    fn the_example_is_extracted() {
        let ex = header_example();
        assert!(ex.starts_with("#include \"nvmf_gpu.cuh\"\n"), "{ex}");
        assert!(ex.contains("extern \"C\" __global__ void read_blocks("));
        assert!(ex.trim_end().ends_with('}'));
        assert!(!ex.contains("EXAMPLE"));
    }

    #[test]
    fn push_items_encode_relative_to_the_span() {
        let items = [
            PushItem {
                slot: 3,
                data_offset: 3 * 4096,
                bytes: 4096,
                cpl_word: 7 << 48,
            },
            PushItem {
                slot: 1,
                data_offset: 4096,
                bytes: 512,
                cpl_word: (7 << 48) | (0x80 << 32),
            },
            PushItem {
                slot: 2,
                data_offset: 2 * 4096,
                bytes: 0,
                cpl_word: 1,
            },
        ];
        assert_eq!(push_span(&items), Some((4096, 4 * 4096)));
        assert_eq!(push_span(&items[2..]), None);
        let enc = encode_push_items(&items, 4096);
        assert_eq!(enc.len(), 3 * PUSH_ITEM_BYTES);
        assert_eq!(u64::from_le_bytes(enc[0..8].try_into().unwrap()), 2 * 4096);
        assert_eq!(u64::from_le_bytes(enc[8..16].try_into().unwrap()), 7 << 48);
        assert_eq!(u32::from_le_bytes(enc[16..20].try_into().unwrap()), 3);
        assert_eq!(u32::from_le_bytes(enc[20..24].try_into().unwrap()), 4096);
        assert_eq!(u64::from_le_bytes(enc[24..32].try_into().unwrap()), 0);
        assert_eq!(u64::from_le_bytes(enc[48..56].try_into().unwrap()), 0);
    }
}
