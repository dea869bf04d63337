// nvmf_gpu.cuh: GPU threads issue their own NVMe-oF reads through request rings served by the
// host (nvmeof-direct). Compiled by NVRTC with the user's kernel; needs no CUDA toolkit header.
// Requires compute capability 7.0 or newer (acquire/release PTX, __nanosleep).
//
// The host creates the rings (Rust: gpu_ring::RingSet::new_gpu), serves them (the initiator's
// queue tasks) and passes the descriptor table to kernels as a buffer: a pointer to
// `struct nvmf_gpu_ring[nrings]` and its length in bytes.
//
// API (all __device__):
//   nvmf_gpu_ring_for_sm(rings)               the ring of the calling SM (%smid % nrings)
//   nvmf_gpu_ring_for_warp(rings)             the calling warp's ring (warps round robin)
//   nvmf_gpu_submit(ring, ns, lba, nblocks, dst)       -> nvmf_gpu_ticket   (one thread)
//   nvmf_gpu_submit_warp(ring, ns, lba, nblocks, dst)  -> nvmf_gpu_ticket   (every active
//                                              lane its own request, one atomicAdd per warp)
//   nvmf_gpu_test(ticket)                     -> true once the completion arrived
//   nvmf_gpu_wait(ticket, dst, bytes, timeout_ns)      -> status (one thread copies)
//   nvmf_gpu_wait_warp(ticket, dst, bytes, timeout_ns) -> status (the active lanes copy
//                                              every lane's data together)
//   nvmf_gpu_read(ring, ns, lba, nblocks, dst, bytes, timeout_ns)      submit + wait
//   nvmf_gpu_read_warp(ring, ns, lba, nblocks, dst, bytes, timeout_ns) submit_warp + wait_warp
//
// `ns` indexes the ring's namespace table (bound by the host), `lba`/`nblocks` are in that
// namespace's blocks, `dst` is device memory of at least `bytes` = nblocks * block size.
// The status is the NVMe status field (SCT << 8 | SC; 0 = success; e.g. 0x000B Invalid
// Namespace, 0x0002 Invalid Field, 0x0080 LBA Out of Range), NVMF_GPU_TIMEOUT when the
// deadline passed (measured on %globaltimer, in ns) or NVMF_GPU_CLOSED when the host closed
// the ring. Every ticket must be waited on exactly once; a timed-out ticket is dead (its
// slot is released later by the next occupant, once the late completion has arrived). A
// thread or warp must not hold more unwaited tickets than the ring has slots, and all active
// lanes of a warp-collective call must pass the same ring. Submitting blocks while the slot's
// previous occupant has not released it.
//
// Example (complete): every warp reads 4 KiB blocks of namespace 0 into `out`.
//
// EXAMPLE BEGIN
// #include "nvmf_gpu.cuh"
//
// extern "C" __global__ void read_blocks(const unsigned char* rings, unsigned long long rings_len,
//                                        unsigned char* out, unsigned long long out_len,
//                                        unsigned long long first_lba, unsigned int* failures,
//                                        unsigned long long failures_len) {
//     if (rings_len < sizeof(struct nvmf_gpu_ring) || failures_len < 4) {
//         return;
//     }
//     const struct nvmf_gpu_ring* ring = nvmf_gpu_ring_for_sm((const struct nvmf_gpu_ring*)rings);
//     unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
//     if ((i + 1) * 4096ULL > out_len) {
//         return;
//     }
//     // 4 KiB = 8 blocks of 512 bytes; 1 ms timeout.
//     unsigned int status = nvmf_gpu_read_warp(ring, 0, first_lba + 8 * i, 8, out + 4096 * i,
//                                              4096, 1000000ULL);
//     if (status != 0) {
//         atomicAdd(failures, 1u);
//     }
// }
// EXAMPLE END
//
// Memory and ordering. A ring has N slots (a power of two). Device memory (device-only):
// `ticket` (u64, atomicAdd), `freed[N]` (u32 lap of the last occupant that released the slot,
// 65535 initially), `abandoned[N]` (u32 lap of an occupant that timed out), `dst[N]` (u64 push
// destinations). Pinned host memory mapped into the device: `req[N]` (two u64 words, device ->
// host), `cpl[N]` (u64, host -> device), `ctl` (u64 closed flag, host -> device) and
// `data[N * slot_bytes]`. No atomic is shared with the CPU (hostNativeAtomicSupported may be
// 0). Ticket t uses slot t % N and lap (t / N) % 65535 + 1; every shared word carries its lap in
// bits 48..63, so zeroed, stale or half-written words are never taken:
//  1. submit: t = atomicAdd(ticket); wait until freed[slot] == prev_lap (acquire, gpu scope),
//     meanwhile releasing an abandoned previous occupant whose completion has arrived; push
//     mode stores dst[slot] and fences at system scope; then w1 and w0 are stored with
//     system-scope stores. The host takes the request only when both words carry the lap.
//  2. the host writes the data, then the completion word (release; x86 keeps store order and
//     PCIe delivers the posted writes in order); in push mode the push kernel copies the data
//     to dst, fences at system scope and stores the word. Device-data mode (gpu_ring's
//     DataMode::Device): data[] is device memory the NIC writes by RDMA; the host flushes those
//     writes (cuFlushGPUDirectRDMAWrites) before it stores the word, and step 3 is unchanged.
//  3. wait: ld.acquire.sys of cpl[slot] until it carries the lap, so the data written before
//     the word is visible to the loads after it; pull mode copies data[slot] to dst.
//  4. release: __threadfence(), then atomicCAS(freed[slot], prev_lap, lap): only then may the
//     next lap's ticket holder write a request into the slot, so the host never overwrites data
//     that is still being read. A compare-and-swap makes a second release harmless.
//  5. timeout: abandoned[slot] = lap; the next occupant (step 1) releases the slot on the
//     waiter's behalf once cpl[slot] carries that lap.
// The same layout and protocol are implemented in Rust by crates/gpu-ring (proto.rs, and the
// CPU stand-in standin.rs); change them together.

#ifndef NVMF_GPU_CUH
#define NVMF_GPU_CUH

typedef unsigned long long nvmf_gpu_u64;
typedef unsigned int nvmf_gpu_u32;
typedef unsigned short nvmf_gpu_u16;
typedef unsigned char nvmf_gpu_u8;

// Waiter-only statuses (never written by the host).
#define NVMF_GPU_TIMEOUT 0xFFFFu
#define NVMF_GPU_CLOSED 0xFFFEu
// Data modes (struct nvmf_gpu_ring::mode).
#define NVMF_GPU_PULL 0u
#define NVMF_GPU_PUSH 1u
// Request flag: the arguments could not be encoded; the host answers Invalid Field.
#define NVMF_GPU_FLAG_BAD_ARGS 0x01ULL
#define NVMF_GPU_LAPS 65535ULL
// Waiting loops read the host's closed flag once every NVMF_GPU_CLOSED_CHECK + 1 rounds.
#define NVMF_GPU_CLOSED_CHECK 63u
#define NVMF_GPU_LAP_SHIFT 48

// One ring of the descriptor table (gpu_ring::RingDesc, 80 bytes).
struct nvmf_gpu_ring {
    nvmf_gpu_u64 req;        // u64 req[2 * slots], mapped host memory
    nvmf_gpu_u64 cpl;        // u64 cpl[slots], mapped host memory
    nvmf_gpu_u64 ctl;        // u64 closed flag, mapped host memory
    nvmf_gpu_u64 data;       // u8 data[slots * slot_bytes], mapped host memory (device memory in device-data mode)
    nvmf_gpu_u64 ticket;     // u64, device memory
    nvmf_gpu_u64 freed;      // u32 freed[slots], device memory
    nvmf_gpu_u64 abandoned;  // u32 abandoned[slots], device memory
    nvmf_gpu_u64 dst;        // u64 dst[slots], device memory
    nvmf_gpu_u32 slots;
    nvmf_gpu_u32 slot_bytes;
    nvmf_gpu_u32 mode;
    nvmf_gpu_u32 nrings;
};
static_assert(sizeof(struct nvmf_gpu_ring) == 80, "struct nvmf_gpu_ring must match gpu_ring::RingDesc");

// A taken ticket.
struct nvmf_gpu_ticket {
    const struct nvmf_gpu_ring* ring;
    nvmf_gpu_u64 t;
    nvmf_gpu_u32 closed;  // the ring was closed before the request could be written
};

// ---- memory operations -------------------------------------------------------------------

__device__ __forceinline__ nvmf_gpu_u64 nvmf_gpu_ld_acquire_sys(const nvmf_gpu_u64* p) {
    nvmf_gpu_u64 v;
    asm volatile("ld.acquire.sys.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void nvmf_gpu_st_relaxed_sys(nvmf_gpu_u64* p, nvmf_gpu_u64 v) {
    asm volatile("st.relaxed.sys.u64 [%0], %1;" : : "l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ nvmf_gpu_u32 nvmf_gpu_ld_acquire_gpu_u32(const nvmf_gpu_u32* p) {
    nvmf_gpu_u32 v;
    asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ nvmf_gpu_u64 nvmf_gpu_now_ns() {
    nvmf_gpu_u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ nvmf_gpu_u32 nvmf_gpu_smid() {
    nvmf_gpu_u32 id;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
    return id;
}

__device__ __forceinline__ nvmf_gpu_u32 nvmf_gpu_laneid() {
    nvmf_gpu_u32 id;
    asm volatile("mov.u32 %0, %%laneid;" : "=r"(id));
    return id;
}

// ---- laps and words ----------------------------------------------------------------------

__device__ __forceinline__ nvmf_gpu_u32 nvmf_gpu_lap(nvmf_gpu_u64 t, nvmf_gpu_u32 slots) {
    return (nvmf_gpu_u32)((t / slots) % NVMF_GPU_LAPS + 1ULL);
}

__device__ __forceinline__ nvmf_gpu_u32 nvmf_gpu_prev_lap(nvmf_gpu_u32 lap) {
    return lap <= 1u ? (nvmf_gpu_u32)NVMF_GPU_LAPS : lap - 1u;
}

__device__ __forceinline__ nvmf_gpu_u32 nvmf_gpu_word_lap(nvmf_gpu_u64 w) {
    return (nvmf_gpu_u32)(w >> NVMF_GPU_LAP_SHIFT);
}

// The two request words (gpu_ring::proto::Request::from_args + encode).
__device__ __forceinline__ void nvmf_gpu_request_words(nvmf_gpu_u32 ns, nvmf_gpu_u64 lba,
                                                       nvmf_gpu_u32 nblocks, nvmf_gpu_u32 lap,
                                                       nvmf_gpu_u64* w0, nvmf_gpu_u64* w1) {
    nvmf_gpu_u64 flags = 0;
    if (ns > 0xFFu || lba >= (1ULL << NVMF_GPU_LAP_SHIFT) || nblocks == 0 || nblocks > 65536u) {
        ns = 0;
        lba = 0;
        nblocks = 1;
        flags = NVMF_GPU_FLAG_BAD_ARGS;
    }
    const nvmf_gpu_u64 l = ((nvmf_gpu_u64)lap) << NVMF_GPU_LAP_SHIFT;
    *w0 = l | ((nvmf_gpu_u64)ns << 40) | (flags << 32) | ((nvmf_gpu_u64)(nblocks - 1u) << 16);
    *w1 = l | lba;
}

__device__ __forceinline__ const struct nvmf_gpu_ring* nvmf_gpu_ring_for_sm(
    const struct nvmf_gpu_ring* rings) {
    return rings + nvmf_gpu_smid() % rings[0].nrings;
}

// The ring of the calling warp: the grid's warps round robin over the rings. Unlike the per-SM
// choice (where blocks sharing an SM, or SM numbers equal modulo the ring count, pile onto one
// ring), every ring gets the same number of warps give or take one, so slots for
// 32 * ceil(warps / nrings) threads per ring are enough. Every lane of a warp gets the same
// ring, as the warp-collective calls need.
__device__ __forceinline__ const struct nvmf_gpu_ring* nvmf_gpu_ring_for_warp(
    const struct nvmf_gpu_ring* rings) {
    const nvmf_gpu_u32 threads = blockDim.x * blockDim.y * blockDim.z;
    const nvmf_gpu_u32 lin = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    const nvmf_gpu_u64 block =
        blockIdx.x + (nvmf_gpu_u64)gridDim.x * (blockIdx.y + (nvmf_gpu_u64)gridDim.y * blockIdx.z);
    const nvmf_gpu_u64 warp = block * ((threads + 31u) / 32u) + lin / 32u;
    return rings + warp % rings[0].nrings;
}

__device__ __forceinline__ bool nvmf_gpu_closed(const struct nvmf_gpu_ring* r) {
    return *(const volatile nvmf_gpu_u64*)r->ctl != 0;
}

// ---- submit ------------------------------------------------------------------------------

// Releases slot `slot` for an occupant of lap `lap` (idempotent).
__device__ __forceinline__ void nvmf_gpu_release(const struct nvmf_gpu_ring* r, nvmf_gpu_u32 slot,
                                                 nvmf_gpu_u32 lap) {
    __threadfence();
    atomicCAS((nvmf_gpu_u32*)r->freed + slot, nvmf_gpu_prev_lap(lap), lap);
}

// Writes the request of ticket t once its slot is free; false if the ring closed first.
__device__ bool nvmf_gpu_fill(const struct nvmf_gpu_ring* r, nvmf_gpu_u64 t, nvmf_gpu_u32 ns,
                              nvmf_gpu_u64 lba, nvmf_gpu_u32 nblocks, void* dst) {
    const nvmf_gpu_u32 slot = (nvmf_gpu_u32)(t & (nvmf_gpu_u64)(r->slots - 1u));
    const nvmf_gpu_u32 lap = nvmf_gpu_lap(t, r->slots);
    const nvmf_gpu_u32 prev = nvmf_gpu_prev_lap(lap);
    const nvmf_gpu_u32* freed = (const nvmf_gpu_u32*)r->freed + slot;
    nvmf_gpu_u32* abandoned = (nvmf_gpu_u32*)r->abandoned + slot;
    const nvmf_gpu_u64* cpl = (const nvmf_gpu_u64*)r->cpl + slot;
    for (nvmf_gpu_u32 spins = 1;; ++spins) {
        if (*(volatile nvmf_gpu_u32*)abandoned == prev &&
            nvmf_gpu_word_lap(nvmf_gpu_ld_acquire_sys(cpl)) == prev) {
            nvmf_gpu_release(r, slot, prev);
            atomicCAS(abandoned, prev, 0u);
        }
        if (nvmf_gpu_ld_acquire_gpu_u32(freed) == prev) {
            break;
        }
        // The closed flag is host memory: read it across the bus only now and then.
        if ((spins & NVMF_GPU_CLOSED_CHECK) == 0 && nvmf_gpu_closed(r)) {
            return false;
        }
        __nanosleep(64);
    }
    if (r->mode == NVMF_GPU_PUSH) {
        ((nvmf_gpu_u64*)r->dst)[slot] = (nvmf_gpu_u64)dst;
        __threadfence_system();
    }
    nvmf_gpu_u64 w0;
    nvmf_gpu_u64 w1;
    nvmf_gpu_request_words(ns, lba, nblocks, lap, &w0, &w1);
    nvmf_gpu_u64* req = (nvmf_gpu_u64*)r->req + 2u * slot;
    nvmf_gpu_st_relaxed_sys(req + 1, w1);
    nvmf_gpu_st_relaxed_sys(req, w0);
    return true;
}

__device__ __forceinline__ struct nvmf_gpu_ticket nvmf_gpu_make_ticket(
    const struct nvmf_gpu_ring* r, nvmf_gpu_u64 t, bool written) {
    struct nvmf_gpu_ticket k;
    k.ring = r;
    k.t = t;
    k.closed = written ? 0u : 1u;
    return k;
}

// One thread submits one read.
__device__ struct nvmf_gpu_ticket nvmf_gpu_submit(const struct nvmf_gpu_ring* r, nvmf_gpu_u32 ns,
                                                  nvmf_gpu_u64 lba, nvmf_gpu_u32 nblocks,
                                                  void* dst) {
    const nvmf_gpu_u64 t = atomicAdd((nvmf_gpu_u64*)r->ticket, 1ULL);
    return nvmf_gpu_make_ticket(r, t, nvmf_gpu_fill(r, t, ns, lba, nblocks, dst));
}

// Every active lane submits its own read; the warp takes its tickets with one atomicAdd.
__device__ struct nvmf_gpu_ticket nvmf_gpu_submit_warp(const struct nvmf_gpu_ring* r,
                                                       nvmf_gpu_u32 ns, nvmf_gpu_u64 lba,
                                                       nvmf_gpu_u32 nblocks, void* dst) {
    const nvmf_gpu_u32 mask = __activemask();
    const nvmf_gpu_u32 lane = nvmf_gpu_laneid();
    const int leader = __ffs(mask) - 1;
    const nvmf_gpu_u32 rank = __popc(mask & ((1u << lane) - 1u));
    nvmf_gpu_u64 base = 0;
    if ((int)lane == leader) {
        base = atomicAdd((nvmf_gpu_u64*)r->ticket, (nvmf_gpu_u64)__popc(mask));
    }
    base = __shfl_sync(mask, base, leader);
    const nvmf_gpu_u64 t = base + rank;
    return nvmf_gpu_make_ticket(r, t, nvmf_gpu_fill(r, t, ns, lba, nblocks, dst));
}

// ---- test / wait -------------------------------------------------------------------------

__device__ __forceinline__ nvmf_gpu_u32 nvmf_gpu_slot(struct nvmf_gpu_ticket k) {
    return (nvmf_gpu_u32)(k.t & (nvmf_gpu_u64)(k.ring->slots - 1u));
}

// True once the ticket's completion has arrived (or the ticket is closed).
__device__ bool nvmf_gpu_test(struct nvmf_gpu_ticket k) {
    if (k.closed) {
        return true;
    }
    const nvmf_gpu_u64 c = nvmf_gpu_ld_acquire_sys((const nvmf_gpu_u64*)k.ring->cpl + nvmf_gpu_slot(k));
    return nvmf_gpu_word_lap(c) == nvmf_gpu_lap(k.t, k.ring->slots);
}

// Polls for the completion until the deadline; returns the status (or TIMEOUT / CLOSED, after
// marking the slot abandoned). Does not copy or release.
__device__ nvmf_gpu_u32 nvmf_gpu_poll(struct nvmf_gpu_ticket k, nvmf_gpu_u64 timeout_ns) {
    if (k.closed) {
        return NVMF_GPU_CLOSED;
    }
    const struct nvmf_gpu_ring* r = k.ring;
    const nvmf_gpu_u32 slot = nvmf_gpu_slot(k);
    const nvmf_gpu_u32 lap = nvmf_gpu_lap(k.t, r->slots);
    const nvmf_gpu_u64* cpl = (const nvmf_gpu_u64*)r->cpl + slot;
    const nvmf_gpu_u64 start = nvmf_gpu_now_ns();
    for (nvmf_gpu_u32 spins = 1;; ++spins) {
        const nvmf_gpu_u64 c = nvmf_gpu_ld_acquire_sys(cpl);
        if (nvmf_gpu_word_lap(c) == lap) {
            return (nvmf_gpu_u32)((c >> 32) & 0xFFFFULL);
        }
        nvmf_gpu_u32 give_up = 0;
        if ((spins & NVMF_GPU_CLOSED_CHECK) == 0 && nvmf_gpu_closed(r)) {
            give_up = NVMF_GPU_CLOSED;
        } else if (nvmf_gpu_now_ns() - start >= timeout_ns) {
            give_up = NVMF_GPU_TIMEOUT;
        }
        if (give_up != 0) {
            ((volatile nvmf_gpu_u32*)r->abandoned)[slot] = lap;
            __threadfence();
            return give_up;
        }
        __nanosleep(32);
    }
}

// The data area of the ticket's slot (pinned host memory, or device memory in device-data mode).
__device__ __forceinline__ const nvmf_gpu_u8* nvmf_gpu_slot_data(struct nvmf_gpu_ticket k) {
    return (const nvmf_gpu_u8*)k.ring->data + (nvmf_gpu_u64)nvmf_gpu_slot(k) * k.ring->slot_bytes;
}

// Copies the 16-byte words i, i + step, ... below nvec; each lane issues UNROLL loads before
// it stores any of them (a store that may alias the next load would otherwise wait for it).
template <int UNROLL>
__device__ __forceinline__ nvmf_gpu_u64 nvmf_gpu_copy_vec(uint4* d, const uint4* s,
                                                          nvmf_gpu_u64 i, nvmf_gpu_u64 nvec,
                                                          nvmf_gpu_u64 step) {
    for (; i + (UNROLL - 1) * step < nvec; i += UNROLL * step) {
        uint4 v[UNROLL];
#pragma unroll
        for (int j = 0; j < UNROLL; ++j) {
            v[j] = s[i + j * step];
        }
#pragma unroll
        for (int j = 0; j < UNROLL; ++j) {
            d[i + j * step] = v[j];
        }
    }
    return i;
}

// Copies n bytes; lanes `lane` of `nlanes` share the work (1 lane: a single thread). The
// source is pinned host memory, where every load crosses the bus (about a microsecond), so the
// loads are issued in groups: 8 per lane when lanes share the copy, 16 for a lone thread (512 B
// in two round trips rather than 32).
__device__ __forceinline__ void nvmf_gpu_copy(nvmf_gpu_u8* dst, const nvmf_gpu_u8* src,
                                              nvmf_gpu_u64 n, nvmf_gpu_u32 lane,
                                              nvmf_gpu_u32 nlanes) {
    nvmf_gpu_u64 done = 0;
    if ((((nvmf_gpu_u64)dst | (nvmf_gpu_u64)src) & 15ULL) == 0) {
        const nvmf_gpu_u64 nvec = n / 16ULL;
        const uint4* s = (const uint4*)src;
        uint4* d = (uint4*)dst;
        const nvmf_gpu_u64 step = (nvmf_gpu_u64)nlanes;
        nvmf_gpu_u64 i = nlanes == 1u ? nvmf_gpu_copy_vec<16>(d, s, lane, nvec, step)
                                      : nvmf_gpu_copy_vec<8>(d, s, lane, nvec, step);
        for (; i < nvec; i += step) {
            d[i] = s[i];
        }
        done = nvec * 16ULL;
    }
    for (nvmf_gpu_u64 i = done + lane; i < n; i += nlanes) {
        dst[i] = src[i];
    }
}

__device__ __forceinline__ nvmf_gpu_u64 nvmf_gpu_copy_len(struct nvmf_gpu_ticket k,
                                                          nvmf_gpu_u64 bytes) {
    return bytes < k.ring->slot_bytes ? bytes : k.ring->slot_bytes;
}

// One thread waits for its ticket, copies the data (pull mode, success) and releases the slot.
__device__ nvmf_gpu_u32 nvmf_gpu_wait(struct nvmf_gpu_ticket k, void* dst, nvmf_gpu_u64 bytes,
                                      nvmf_gpu_u64 timeout_ns) {
    const nvmf_gpu_u32 st = nvmf_gpu_poll(k, timeout_ns);
    if (st == NVMF_GPU_TIMEOUT || st == NVMF_GPU_CLOSED) {
        return st;
    }
    if (st == 0 && k.ring->mode == NVMF_GPU_PULL && dst != 0) {
        nvmf_gpu_copy((nvmf_gpu_u8*)dst, nvmf_gpu_slot_data(k), nvmf_gpu_copy_len(k, bytes), 0, 1);
    }
    nvmf_gpu_release(k.ring, nvmf_gpu_slot(k), nvmf_gpu_lap(k.t, k.ring->slots));
    return st;
}

// Every active lane waits for its own ticket; then the active lanes copy each lane's data
// together (pull mode) and each lane releases its slot.
__device__ nvmf_gpu_u32 nvmf_gpu_wait_warp(struct nvmf_gpu_ticket k, void* dst,
                                           nvmf_gpu_u64 bytes, nvmf_gpu_u64 timeout_ns) {
    const nvmf_gpu_u32 mask = __activemask();
    const nvmf_gpu_u32 lane = nvmf_gpu_laneid();
    const nvmf_gpu_u32 rank = __popc(mask & ((1u << lane) - 1u));
    const nvmf_gpu_u32 nlanes = __popc(mask);
    const nvmf_gpu_u32 st = nvmf_gpu_poll(k, timeout_ns);
    const bool copy = st == 0 && k.ring->mode == NVMF_GPU_PULL && dst != 0;
    const nvmf_gpu_u64 src = (nvmf_gpu_u64)nvmf_gpu_slot_data(k);
    const nvmf_gpu_u64 len = copy ? nvmf_gpu_copy_len(k, bytes) : 0ULL;
    nvmf_gpu_u32 todo = __ballot_sync(mask, copy);
    while (todo != 0) {
        const int owner = __ffs(todo) - 1;
        todo &= todo - 1u;
        const nvmf_gpu_u64 s = __shfl_sync(mask, src, owner);
        const nvmf_gpu_u64 d = __shfl_sync(mask, (nvmf_gpu_u64)dst, owner);
        const nvmf_gpu_u64 n = __shfl_sync(mask, len, owner);
        nvmf_gpu_copy((nvmf_gpu_u8*)d, (const nvmf_gpu_u8*)s, n, rank, nlanes);
    }
    __syncwarp(mask);
    if (st != NVMF_GPU_TIMEOUT && st != NVMF_GPU_CLOSED) {
        nvmf_gpu_release(k.ring, nvmf_gpu_slot(k), nvmf_gpu_lap(k.t, k.ring->slots));
    }
    return st;
}

// ---- blocking reads ----------------------------------------------------------------------

__device__ nvmf_gpu_u32 nvmf_gpu_read(const struct nvmf_gpu_ring* r, nvmf_gpu_u32 ns,
                                      nvmf_gpu_u64 lba, nvmf_gpu_u32 nblocks, void* dst,
                                      nvmf_gpu_u64 bytes, nvmf_gpu_u64 timeout_ns) {
    return nvmf_gpu_wait(nvmf_gpu_submit(r, ns, lba, nblocks, dst), dst, bytes, timeout_ns);
}

__device__ nvmf_gpu_u32 nvmf_gpu_read_warp(const struct nvmf_gpu_ring* r, nvmf_gpu_u32 ns,
                                           nvmf_gpu_u64 lba, nvmf_gpu_u32 nblocks, void* dst,
                                           nvmf_gpu_u64 bytes, nvmf_gpu_u64 timeout_ns) {
    return nvmf_gpu_wait_warp(nvmf_gpu_submit_warp(r, ns, lba, nblocks, dst), dst, bytes,
                              timeout_ns);
}

#endif  // NVMF_GPU_CUH
