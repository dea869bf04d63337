// Ring push: after the host copied a batch of completed ring slots to a staging buffer in
// device memory (one host-to-device copy of the data area span), copy each slot's bytes to the
// destination its submitter recorded (dst[slot]) and publish its completion word.
//
// Work item (24 bytes, little-endian; gpu_ring::PushItem as encoded by ring.rs): the byte
// offset of the slot's data in `staging`, the completion word, the slot and the byte count.
// One warp per item. The destinations are device pointers chosen by the kernels that submitted
// the requests (the ring protocol's contract), not buffers of this launch.
#include "nvmf_gpu.cuh"

struct nvmf_gpu_push_item {
    nvmf_gpu_u64 staging_offset;
    nvmf_gpu_u64 cpl_word;
    nvmf_gpu_u32 slot;
    nvmf_gpu_u32 bytes;
};
static_assert(sizeof(struct nvmf_gpu_push_item) == 24, "push item layout");

extern "C" __global__ void nvmf_ring_push(
    const nvmf_gpu_u8* rings, nvmf_gpu_u64 rings_len,
    nvmf_gpu_u32 ring,
    const nvmf_gpu_u8* staging, nvmf_gpu_u64 staging_len,
    const nvmf_gpu_u8* items_raw, nvmf_gpu_u64 items_len)
{
    if ((((nvmf_gpu_u64)rings | (nvmf_gpu_u64)items_raw) & 7ULL) != 0) {
        return;
    }
    if ((nvmf_gpu_u64)ring >= rings_len / sizeof(struct nvmf_gpu_ring)) {
        return;
    }
    const struct nvmf_gpu_ring* r = (const struct nvmf_gpu_ring*)rings + ring;
    const struct nvmf_gpu_push_item* items = (const struct nvmf_gpu_push_item*)items_raw;
    const nvmf_gpu_u64 count = items_len / sizeof(struct nvmf_gpu_push_item);
    const nvmf_gpu_u32 lane = threadIdx.x & 31u;
    const nvmf_gpu_u64 warps = (nvmf_gpu_u64)gridDim.x * (blockDim.x / 32u);
    const nvmf_gpu_u64 first = (nvmf_gpu_u64)blockIdx.x * (blockDim.x / 32u) + threadIdx.x / 32u;
    for (nvmf_gpu_u64 i = first; i < count; i += warps) {
        const struct nvmf_gpu_push_item it = items[i];
        if (it.slot >= r->slots) {
            continue;
        }
        nvmf_gpu_u64 n = it.bytes;
        if (n > r->slot_bytes || it.staging_offset > staging_len || n > staging_len - it.staging_offset) {
            n = 0;
        }
        // Written by the submitter before its request (fenced at system scope); read past L1.
        const nvmf_gpu_u64 dst = ((const volatile nvmf_gpu_u64*)r->dst)[it.slot];
        if (dst != 0 && n != 0) {
            nvmf_gpu_copy((nvmf_gpu_u8*)dst, staging + it.staging_offset, n, lane, 32u);
        }
        __syncwarp();
        if (lane == 0) {
            __threadfence_system();
            nvmf_gpu_st_relaxed_sys((nvmf_gpu_u64*)r->cpl + it.slot, it.cpl_word);
        }
    }
}
