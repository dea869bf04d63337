// Scatter: copy staged blocks from one contiguous staging buffer to their destinations.
//
// Work item: a = source offset in `src`, b = destination offset in `dst`, len = bytes.
// Items are cut into chunks of `chunk_size` bytes; each warp copies whole chunks, so one large
// block and many small blocks both spread over the GPU (a 512-byte block keeps one warp busy,
// not a whole thread block). Destinations may start at any
// byte offset: stores are 16-byte aligned on the destination, loads are realigned with funnel
// shifts when the source has a different alignment.
//
// Requires common.cuh (prepended by the host).

// Warp-cooperative copy of n bytes with any source and destination alignment.
__device__ void nvmf_copy_bytes(nvmf_u8* dst, const nvmf_u8* src, nvmf_u64 n) {
    const nvmf_u64 tid = nvmf_lane();
    const nvmf_u64 nthreads = NVMF_WARP_SIZE;

    nvmf_u64 head = (16ULL - (((nvmf_u64)dst) & 15ULL)) & 15ULL;
    if (head > n) {
        head = n;
    }
    for (nvmf_u64 i = tid; i < head; i += nthreads) {
        dst[i] = src[i];
    }
    dst += head;
    src += head;
    n -= head;

    nvmf_u64 nvec = n / 16ULL;
    uint4* d4 = (uint4*)dst;
    const nvmf_u64 saddr = (nvmf_u64)src;
    if ((saddr & 15ULL) == 0) {
        const uint4* s4 = (const uint4*)src;
        for (nvmf_u64 i = tid; i < nvec; i += nthreads) {
            d4[i] = s4[i];
        }
    } else if ((saddr & 3ULL) == 0) {
        const nvmf_u32* s1 = (const nvmf_u32*)src;
        for (nvmf_u64 i = tid; i < nvec; i += nthreads) {
            const nvmf_u32* p = s1 + 4ULL * i;
            uint4 v;
            v.x = p[0];
            v.y = p[1];
            v.z = p[2];
            v.w = p[3];
            d4[i] = v;
        }
    } else {
        // Aligned 32-bit loads around the source, realigned with funnel shifts. Vector i loads
        // the five words starting at (saddr & ~3) + 16 i. Only vectors whose five words lie
        // inside the source range take this path: vector 0 (whose first word starts before
        // src) is copied byte by byte, and vectors whose fifth word would end past src + n go
        // to the byte loop below. So no byte outside [src, src + n) is read.
        const nvmf_u32* sw = (const nvmf_u32*)(saddr & ~3ULL);
        const nvmf_u32 shift = (nvmf_u32)((saddr & 3ULL) * 8ULL);
        const nvmf_u64 reach = n + (saddr & 3ULL);
        nvmf_u64 safe = reach >= 20ULL ? (reach - 20ULL) / 16ULL + 1ULL : 0ULL;
        if (safe < nvec) {
            nvec = safe;
        }
        if (nvec > 0) {
            for (nvmf_u64 i = tid; i < 16ULL; i += nthreads) {
                dst[i] = src[i];
            }
        }
        for (nvmf_u64 i = 1ULL + tid; i < nvec; i += nthreads) {
            const nvmf_u32* p = sw + 4ULL * i;
            const nvmf_u32 w0 = p[0];
            const nvmf_u32 w1 = p[1];
            const nvmf_u32 w2 = p[2];
            const nvmf_u32 w3 = p[3];
            const nvmf_u32 w4 = p[4];
            uint4 v;
            v.x = __funnelshift_r(w0, w1, shift);
            v.y = __funnelshift_r(w1, w2, shift);
            v.z = __funnelshift_r(w2, w3, shift);
            v.w = __funnelshift_r(w3, w4, shift);
            d4[i] = v;
        }
    }

    for (nvmf_u64 i = nvec * 16ULL + tid; i < n; i += nthreads) {
        dst[i] = src[i];
    }
}

extern "C" __global__ void nvmf_scatter(
    const nvmf_u8* src, nvmf_u64 src_len,
    nvmf_u8* dst, nvmf_u64 dst_len,
    const nvmf_u8* items_raw, nvmf_u64 items_len,
    nvmf_u64 total_chunks, nvmf_u64 chunk_size)
{
    const nvmf_work* items;
    nvmf_u64 count;
    if (chunk_size == 0 || !nvmf_items(items_raw, items_len, &items, &count)) {
        return;
    }
    for (nvmf_u64 chunk = nvmf_first_warp(); chunk < total_chunks; chunk += nvmf_warp_stride()) {
        nvmf_work w;
        nvmf_u64 lo;
        nvmf_u64 n;
        if (!nvmf_chunk(items, count, chunk, chunk_size, &w, &lo, &n)) {
            continue;
        }
        // The host validated every item; re-check so a bad item can never write outside dst.
        if (!nvmf_in_bounds(w.a, w.len, src_len) || !nvmf_in_bounds(w.b, w.len, dst_len)) {
            continue;
        }
        nvmf_copy_bytes(dst + w.b + lo, src + w.a + lo, n);
    }
}
