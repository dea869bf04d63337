// Definitions shared by the nvmeof-direct kernels.
//
// The pattern, checksum and work-item layout below mirror cuda-kernels/src/pattern.rs,
// checksum.rs and plan.rs exactly: change both sides together (the CPU unit tests pin the
// values, the GPU tests compare the two sides).
//
// Kernel ABI: every buffer arrives as a pointer followed by its length in bytes, and kernels
// touch memory only inside [pointer, pointer + length).
//
// NVRTC compiles this without any system header, so only built-in types are used.

typedef unsigned long long nvmf_u64;
typedef unsigned int nvmf_u32;
typedef unsigned char nvmf_u8;

#define NVMF_GOLDEN 0x9E3779B97F4A7C15ULL
#define NVMF_MIX1 0xBF58476D1CE4E5B9ULL
#define NVMF_MIX2 0x94D049BB133111EBULL

// 64-bit finaliser (the splitmix64 output function).
__device__ __forceinline__ nvmf_u64 nvmf_fmix64(nvmf_u64 z) {
    z ^= z >> 30;
    z *= NVMF_MIX1;
    z ^= z >> 27;
    z *= NVMF_MIX2;
    z ^= z >> 31;
    return z;
}

// Pattern word for the 8 namespace bytes starting at (word_offset & ~7).
__device__ __forceinline__ nvmf_u64 nvmf_pattern_word(nvmf_u64 seed, nvmf_u64 word_offset) {
    return nvmf_fmix64(seed ^ nvmf_fmix64((word_offset & ~7ULL) ^ NVMF_GOLDEN));
}

// Words of the `bytes` bytes at `data` (8-aligned, `bytes` a multiple of 8) that differ from
// the pattern of the namespace bytes from `ns_offset` (8-aligned) on.
__device__ __forceinline__ nvmf_u64 nvmf_pattern_mismatches(const nvmf_u8* data, nvmf_u64 bytes,
                                                            nvmf_u64 seed, nvmf_u64 ns_offset) {
    const nvmf_u64* words = (const nvmf_u64*)data;
    nvmf_u64 bad = 0;
    for (nvmf_u64 w = 0; w < bytes / 8ULL; ++w) {
        bad += words[w] != nvmf_pattern_word(seed, ns_offset + 8ULL * w);
    }
    return bad;
}

// Pattern byte at a namespace byte offset (words are stored little-endian).
__device__ __forceinline__ nvmf_u8 nvmf_pattern_byte(nvmf_u64 seed, nvmf_u64 ns_offset) {
    return (nvmf_u8)(nvmf_pattern_word(seed, ns_offset) >> ((ns_offset & 7ULL) * 8ULL));
}

// Checksum contribution of the 8-byte little-endian word number `index` of a region.
__device__ __forceinline__ nvmf_u64 nvmf_checksum_term(nvmf_u64 word, nvmf_u64 index) {
    return nvmf_fmix64(word + (index + 1ULL) * NVMF_GOLDEN);
}

__device__ __forceinline__ nvmf_u64 nvmf_min(nvmf_u64 a, nvmf_u64 b) {
    return a < b ? a : b;
}

// Number of non-zero bytes in a 64-bit value.
__device__ __forceinline__ nvmf_u64 nvmf_nonzero_bytes(nvmf_u64 d) {
    d |= (d >> 4) & 0x0F0F0F0F0F0F0F0FULL;
    d |= (d >> 2) & 0x3333333333333333ULL;
    d |= (d >> 1) & 0x5555555555555555ULL;
    return (nvmf_u64)__popcll(d & 0x0101010101010101ULL);
}

// One work item (32 bytes, little-endian), WorkItem in plan.rs. The meaning of `a` and `b`
// depends on the kernel; `first_chunk` is the index of the item's first chunk in the launch.
struct nvmf_work {
    nvmf_u64 a;
    nvmf_u64 b;
    nvmf_u64 len;
    nvmf_u64 first_chunk;
};

// Work is distributed per warp: each warp takes whole chunks, its 32 lanes share a chunk.
#define NVMF_WARP_SIZE 32ULL

__device__ __forceinline__ nvmf_u64 nvmf_lane() {
    return (nvmf_u64)(threadIdx.x & 31u);
}

__device__ __forceinline__ nvmf_u64 nvmf_first_warp() {
    return (nvmf_u64)blockIdx.x * (nvmf_u64)(blockDim.x / 32u) + (nvmf_u64)(threadIdx.x / 32u);
}

__device__ __forceinline__ nvmf_u64 nvmf_warp_stride() {
    return (nvmf_u64)gridDim.x * (nvmf_u64)(blockDim.x / 32u);
}

__device__ __forceinline__ bool nvmf_in_bounds(nvmf_u64 off, nvmf_u64 len, nvmf_u64 size) {
    return off <= size && len <= size - off;
}

// Interprets a work-item buffer; false when it is misaligned or empty.
__device__ __forceinline__ bool nvmf_items(const nvmf_u8* raw, nvmf_u64 raw_len,
                                           const nvmf_work** items, nvmf_u64* count) {
    if ((((nvmf_u64)raw) & 7ULL) != 0) {
        return false;
    }
    *items = (const nvmf_work*)raw;
    *count = raw_len / (nvmf_u64)sizeof(nvmf_work);
    return *count != 0;
}

// Finds the item holding `chunk` (items are sorted by first_chunk) and the byte range
// [*lo, *lo + *n) of the item that the chunk covers. False when the chunk is empty.
__device__ bool nvmf_chunk(const nvmf_work* items, nvmf_u64 count, nvmf_u64 chunk,
                           nvmf_u64 chunk_size, nvmf_work* w, nvmf_u64* lo, nvmf_u64* n) {
    nvmf_u64 left = 0;
    nvmf_u64 right = count;
    while (right - left > 1) {
        nvmf_u64 mid = left + (right - left) / 2;
        if (items[mid].first_chunk <= chunk) {
            left = mid;
        } else {
            right = mid;
        }
    }
    *w = items[left];
    if (chunk < w->first_chunk) {
        return false;
    }
    nvmf_u64 k = chunk - w->first_chunk;
    if (k > w->len / chunk_size) {
        return false;
    }
    nvmf_u64 start = k * chunk_size;
    if (start >= w->len) {
        return false;
    }
    nvmf_u64 rest = w->len - start;
    *lo = start;
    *n = rest < chunk_size ? rest : chunk_size;
    return true;
}
