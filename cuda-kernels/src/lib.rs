//! CUDA kernels (scatter, verify, ring push) for GPU-side data movement, compiled at run time,
//! and the device header of the GPU request rings ([`ring::HEADER`]).
//!
//! The `.cu` sources in this crate's `src/` are embedded with `include_str!` and compiled with
//! NVRTC when [`NvmfKernels::load`] runs, for the device's own architecture (CUBIN `sm_XX`, or
//! PTX `compute_XX` when NVRTC does not know the device; see [`gpu::module`]). Kernels:
//!
//! - **scatter**: copy N staged blocks from one contiguous staging buffer in device memory to N
//!   destination byte offsets (any alignment) of a device buffer;
//! - **fill / verify**: write or check the seeded namespace [`pattern`] (each 8-byte word is a
//!   hash of the seed and the word's namespace byte offset), reporting the number of wrong bytes
//!   and the first wrong offset;
//! - **checksum**: a position-keyed 64-bit [`checksum`] per region;
//! - **ring push**: the push path of the GPU request rings ([`ring::RingPush`]).
//!
//! [`ring::HEADER`] (`include/nvmf_gpu.cuh`) is the device API of the rings of `gpu_ring`:
//! user kernels include it and submit, test and wait for their own reads.
//!
//! The pattern and checksum are defined once in Rust ([`pattern`], [`checksum`]) and mirrored in
//! `common.cuh`; the CPU versions are tested everywhere, the GPU versions against them on a GPU.
//! Launches go through `gpu`'s checked launch API, so this crate has no `unsafe`.
#![forbid(unsafe_code)]

pub mod checksum;
mod error;
mod kernels;
pub mod pattern;
pub mod plan;
pub mod ring;
mod staged;

pub use error::KernelError;
pub use kernels::{
    BuildInfo, COMMON_CUH, KernelWorkspace, NvmfKernels, SCATTER_CU, THREADS_PER_BLOCK, VERIFY_CU,
    scatter_source, verify_source,
};
pub use pattern::VerifyReport;
pub use plan::{ByteRange, CHUNK_SIZE, PatternRegion, ScatterCopy, WorkItem, WorkPlan};
pub use staged::{ChunkFlight, ChunksRefused, MappedStage, StageFlight, StageRefused};

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn handles_are_send_and_sync() {
        assert_send_sync::<NvmfKernels>();
        assert_send_sync::<KernelWorkspace>();
        assert_send_sync::<MappedStage>();
        assert_send_sync::<StageFlight>();
        assert_send_sync::<ChunkFlight>();
    }
}
