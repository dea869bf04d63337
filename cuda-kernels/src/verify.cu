// Pattern fill, pattern verification and per-region checksums.
//
// Work items for fill/verify: a = byte offset in the buffer, b = namespace byte offset of that
// byte, len = bytes. For checksums: a = byte offset in the buffer, b = index of the output sum,
// len = bytes. Items are cut into chunks of `chunk_size` bytes (a multiple of 8), one chunk per
// warp at a time.
//
// Requires common.cuh (prepended by the host).

// Writes the pattern into [p, p + n), whose first byte has namespace offset ns.
__device__ void nvmf_fill_range(nvmf_u8* p, nvmf_u64 n, nvmf_u64 ns, nvmf_u64 seed) {
    const nvmf_u64 tid = nvmf_lane();
    const nvmf_u64 nthreads = NVMF_WARP_SIZE;
    if ((((nvmf_u64)p) & 7ULL) == (ns & 7ULL)) {
        nvmf_u64 head = (8ULL - (ns & 7ULL)) & 7ULL;
        if (head > n) {
            head = n;
        }
        for (nvmf_u64 i = tid; i < head; i += nthreads) {
            p[i] = nvmf_pattern_byte(seed, ns + i);
        }
        const nvmf_u64 words = (n - head) / 8ULL;
        nvmf_u64* wp = (nvmf_u64*)(p + head);
        for (nvmf_u64 i = tid; i < words; i += nthreads) {
            wp[i] = nvmf_pattern_word(seed, ns + head + 8ULL * i);
        }
        for (nvmf_u64 i = head + words * 8ULL + tid; i < n; i += nthreads) {
            p[i] = nvmf_pattern_byte(seed, ns + i);
        }
    } else {
        const nvmf_u64 g0 = ns & ~7ULL;
        const nvmf_u64 groups = (((ns + n + 7ULL) & ~7ULL) - g0) / 8ULL;
        for (nvmf_u64 g = tid; g < groups; g += nthreads) {
            const nvmf_u64 wofs = g0 + 8ULL * g;
            const nvmf_u64 e = nvmf_pattern_word(seed, wofs);
            for (nvmf_u64 k = 0; k < 8ULL; k++) {
                const nvmf_u64 at = wofs + k;
                if (at >= ns && at < ns + n) {
                    p[at - ns] = (nvmf_u8)(e >> (8ULL * k));
                }
            }
        }
    }
}

extern "C" __global__ void nvmf_fill_pattern(
    nvmf_u8* buf, nvmf_u64 buf_len,
    const nvmf_u8* items_raw, nvmf_u64 items_len,
    nvmf_u64 total_chunks, nvmf_u64 chunk_size, nvmf_u64 seed)
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
        if (!nvmf_in_bounds(w.a, w.len, buf_len)) {
            continue;
        }
        nvmf_fill_range(buf + w.a + lo, n, w.b + lo, seed);
    }
}

// result (16 bytes, 8-aligned): [0] number of mismatching bytes (atomic add),
// [1] lowest buffer offset of a mismatching byte (atomic min; host initialises it to ~0).
extern "C" __global__ void nvmf_verify_pattern(
    const nvmf_u8* buf, nvmf_u64 buf_len,
    const nvmf_u8* items_raw, nvmf_u64 items_len,
    nvmf_u64 total_chunks, nvmf_u64 chunk_size, nvmf_u64 seed,
    nvmf_u8* result_raw, nvmf_u64 result_len)
{
    const nvmf_work* items;
    nvmf_u64 count;
    if (result_len < 16ULL || (((nvmf_u64)result_raw) & 7ULL) != 0) {
        return;
    }
    nvmf_u64* result = (nvmf_u64*)result_raw;
    if (chunk_size == 0 || !nvmf_items(items_raw, items_len, &items, &count)) {
        return;
    }
    const nvmf_u64 tid = nvmf_lane();
    const nvmf_u64 nthreads = NVMF_WARP_SIZE;
    nvmf_u64 bad = 0;
    nvmf_u64 first = ~0ULL;
    for (nvmf_u64 chunk = nvmf_first_warp(); chunk < total_chunks; chunk += nvmf_warp_stride()) {
        nvmf_work w;
        nvmf_u64 lo;
        nvmf_u64 n;
        if (!nvmf_chunk(items, count, chunk, chunk_size, &w, &lo, &n)) {
            continue;
        }
        if (!nvmf_in_bounds(w.a, w.len, buf_len)) {
            continue;
        }
        const nvmf_u8* p = buf + w.a + lo;
        const nvmf_u64 ns = w.b + lo;
        const nvmf_u64 pos0 = w.a + lo;
        if ((((nvmf_u64)p) & 7ULL) == (ns & 7ULL)) {
            nvmf_u64 head = (8ULL - (ns & 7ULL)) & 7ULL;
            if (head > n) {
                head = n;
            }
            for (nvmf_u64 i = tid; i < head; i += nthreads) {
                if (p[i] != nvmf_pattern_byte(seed, ns + i)) {
                    bad += 1;
                    first = nvmf_min(first, pos0 + i);
                }
            }
            const nvmf_u64 words = (n - head) / 8ULL;
            const nvmf_u64* wp = (const nvmf_u64*)(p + head);
            for (nvmf_u64 i = tid; i < words; i += nthreads) {
                const nvmf_u64 d = wp[i] ^ nvmf_pattern_word(seed, ns + head + 8ULL * i);
                if (d != 0) {
                    bad += nvmf_nonzero_bytes(d);
                    const nvmf_u64 byte = (nvmf_u64)(__ffsll((long long)d) - 1) / 8ULL;
                    first = nvmf_min(first, pos0 + head + 8ULL * i + byte);
                }
            }
            for (nvmf_u64 i = head + words * 8ULL + tid; i < n; i += nthreads) {
                if (p[i] != nvmf_pattern_byte(seed, ns + i)) {
                    bad += 1;
                    first = nvmf_min(first, pos0 + i);
                }
            }
        } else {
            const nvmf_u64 g0 = ns & ~7ULL;
            const nvmf_u64 groups = (((ns + n + 7ULL) & ~7ULL) - g0) / 8ULL;
            for (nvmf_u64 g = tid; g < groups; g += nthreads) {
                const nvmf_u64 wofs = g0 + 8ULL * g;
                const nvmf_u64 e = nvmf_pattern_word(seed, wofs);
                for (nvmf_u64 k = 0; k < 8ULL; k++) {
                    const nvmf_u64 at = wofs + k;
                    if (at >= ns && at < ns + n) {
                        const nvmf_u64 rel = at - ns;
                        if (p[rel] != (nvmf_u8)(e >> (8ULL * k))) {
                            bad += 1;
                            first = nvmf_min(first, pos0 + rel);
                        }
                    }
                }
            }
        }
    }
    if (bad != 0) {
        atomicAdd(&result[0], bad);
        atomicMin(&result[1], first);
    }
}

// sums: one 8-byte, 8-aligned raw sum per region (host zeroes them and finalises).
extern "C" __global__ void nvmf_checksum(
    const nvmf_u8* buf, nvmf_u64 buf_len,
    const nvmf_u8* items_raw, nvmf_u64 items_len,
    nvmf_u64 total_chunks, nvmf_u64 chunk_size,
    nvmf_u8* sums_raw, nvmf_u64 sums_len)
{
    const nvmf_work* items;
    nvmf_u64 count;
    if ((((nvmf_u64)sums_raw) & 7ULL) != 0 || (chunk_size & 7ULL) != 0 || chunk_size == 0) {
        return;
    }
    if (!nvmf_items(items_raw, items_len, &items, &count)) {
        return;
    }
    nvmf_u64* sums = (nvmf_u64*)sums_raw;
    const nvmf_u64 nsums = sums_len / 8ULL;
    const nvmf_u64 tid = nvmf_lane();
    const nvmf_u64 nthreads = NVMF_WARP_SIZE;
    for (nvmf_u64 chunk = nvmf_first_warp(); chunk < total_chunks; chunk += nvmf_warp_stride()) {
        nvmf_work w;
        nvmf_u64 lo;
        nvmf_u64 n;
        // All lanes of the warp work on the same chunk and take the same branches here, which
        // the warp reduction below relies on.
        if (!nvmf_chunk(items, count, chunk, chunk_size, &w, &lo, &n)) {
            continue;
        }
        if (!nvmf_in_bounds(w.a, w.len, buf_len) || w.b >= nsums) {
            continue;
        }
        const nvmf_u8* p = buf + w.a;
        const bool aligned = (((nvmf_u64)p) & 7ULL) == 0;
        const nvmf_u64 nwords = (n + 7ULL) / 8ULL;
        nvmf_u64 part = 0;
        for (nvmf_u64 i = tid; i < nwords; i += nthreads) {
            const nvmf_u64 widx = lo / 8ULL + i;
            const nvmf_u64 byte0 = widx * 8ULL;
            const nvmf_u64 avail = w.len - byte0;
            nvmf_u64 v = 0;
            if (aligned && avail >= 8ULL) {
                v = ((const nvmf_u64*)p)[widx];
            } else {
                const nvmf_u64 take = avail < 8ULL ? avail : 8ULL;
                for (nvmf_u64 k = 0; k < take; k++) {
                    v |= ((nvmf_u64)p[byte0 + k]) << (8ULL * k);
                }
            }
            part += nvmf_checksum_term(v, widx);
        }
        for (int offset = 16; offset > 0; offset >>= 1) {
            part += __shfl_down_sync(0xffffffffu, part, offset);
        }
        if ((threadIdx.x & 31u) == 0 && part != 0) {
            atomicAdd(&sums[w.b], part);
        }
    }
}
