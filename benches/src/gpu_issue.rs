//! `issue = "gpu"`: GPU threads issue the reads themselves.
//!
//! A persistent CUDA kernel (compiled with NVRTC together with the ring header
//! `nvmf_gpu.cuh`) runs `numjobs * iodepth` threads, each with one read in flight, for
//! `ramp_time + runtime` measured on the GPU's `%globaltimer`. Each thread picks a uniform random
//! block-aligned LBA of `bs` (or, with `chase = true`, derives its next LBA from the first word
//! of its previous read: a dependent pointer chase), reads it through its warp's request ring
//! (`nvmf_gpu_ring_for_warp`: warps round robin over the rings, each ring with a slot for
//! every thread it serves; `nvmf_gpu_read_warp`, pull mode: the lanes of a warp take their tickets with one atomic,
//! the data lands in the ring's pinned slots and the warp's lanes copy each lane's data together
//! into its own device buffer, which reads pinned memory over PCIe far faster than one thread
//! copying alone), checks it against the verify pattern on the GPU, and records
//! the read's latency into a histogram in device memory (16 buckets per power of two of
//! nanoseconds, about 6 % resolution). The rings (one per I/O queue pair, each with enough
//! slots for its threads) are served by the initiator's queue tasks
//! (`Controller::attach_gpu_rings`), so the same target, queues, client cores, LBA range and
//! reads in flight serve CPU-issued and GPU-issued points of a job.
//!
//! With several targets (`targets = N`, one controller each) the set has `queue_pairs` rings
//! per controller, and controller `t` serves the contiguous share of rings `t * Q .. (t + 1) *
//! Q` (`Controller::attach_gpu_rings_n`). Every ring binds the same `K` namespaces (each target
//! has the same ones); a thread reads the namespace it picks on the target of its warp's ring,
//! and its latency lands in the histogram of (target, namespace), reported as namespace index
//! `t * K + k`, as for CPU-issued points.

use std::sync::Arc;
use std::time::{Duration, Instant};

use nvmeof_initiator::gpu::cuda::{GpuContext, LaunchArgs, LaunchConfig};
use nvmeof_initiator::gpu::kernels::COMMON_CUH;
use nvmeof_initiator::gpu::kernels::ring::compile_with_ring_header;
use nvmeof_initiator::gpu_ring::{DataMode, NsBinding, RingConfig, RingSet};
use tokio::runtime::Runtime;

use crate::cpu::CpuSnapshot;
use crate::fabric::CpuSource;
use crate::hist::LatencyHist;
use crate::job::{Point, RingMode};
use crate::path::{NsGeometry, TcpPath};
use crate::pattern::{Pattern, VERIFY_BLOCK};
use crate::report::Measurement;
use crate::run::{Prefilled, Progress, Timing, failed, prepare, summarize};
use crate::worker::{NsAcc, WorkerOutput};

/// Latency histogram buckets in device memory.
const BUCKETS: usize = 1024;
/// Counters before the histogram (u64 words).
const COUNTERS: usize = 8;
/// GPU threads per block.
const THREADS_PER_BLOCK: u32 = 128;
/// How long a GPU thread waits for one read.
const READ_TIMEOUT: Duration = Duration::from_secs(60);

/// The kernel (needs `COMMON_CUH` in front; includes the ring header).
pub const KERNEL: &str = r#"
#include "nvmf_gpu.cuh"

// result (u64): [0] reads measured, [1] reads that differ from the pattern, [2] failed reads,
// [3] a failed status, [4] reads checked, then one latency histogram of the measured reads per
// target t and namespace index n at [8 + 1024 (t namespaces + n) ..] (1024 buckets): values
// below 16 ns in buckets 0..15, then 16 buckets per power of two. The rings are split among
// the targets' controllers in contiguous shares of nrings / targets rings.
extern "C" __global__ void bench_gpu_issue(
    const unsigned char* rings, unsigned long long rings_len,
    unsigned char* dst, unsigned long long dst_len,
    const unsigned char* key, unsigned long long key_len,
    unsigned char* result, unsigned long long result_len,
    unsigned long long seed, unsigned int block_size, unsigned int nblocks,
    unsigned long long region_blocks, unsigned int namespaces, unsigned int targets,
    unsigned int chase,
    unsigned int verify, unsigned long long ramp_ns, unsigned long long run_ns,
    unsigned long long timeout_ns)
{
    if (rings_len < sizeof(struct nvmf_gpu_ring) || key_len < 512 || targets == 0 ||
        result_len < 8ULL * (8 + 1024ULL * namespaces * targets) || nblocks == 0 ||
        namespaces == 0) {
        return;
    }
    const struct nvmf_gpu_ring* r = nvmf_gpu_ring_for_warp((const struct nvmf_gpu_ring*)rings);
    const unsigned int per_target = r->nrings / targets;
    if (per_target == 0) {
        return;
    }
    unsigned int target = (unsigned int)(r - (const struct nvmf_gpu_ring*)rings) / per_target;
    if (target >= targets) {
        target = targets - 1;
    }
    const unsigned long long hist = 8 + 1024ULL * ((unsigned long long)target * namespaces);
    const unsigned long long tid = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned long long bytes = (unsigned long long)block_size * nblocks;
    const unsigned long long extents = region_blocks / nblocks;
    if ((tid + 1) * bytes > dst_len || extents == 0) {
        return;
    }
    unsigned char* mine = dst + tid * bytes;
    unsigned long long* res = (unsigned long long*)result;
    const unsigned long long* keys = (const unsigned long long*)key;
    unsigned long long x = nvmf_fmix64(seed ^ ((tid + 1) * NVMF_GOLDEN));
    unsigned long long lba = (x % extents) * nblocks;
    unsigned int ns = (unsigned int)(tid % namespaces);
    const unsigned long long measure_from = nvmf_gpu_now_ns() + ramp_ns;
    const unsigned long long end = measure_from + run_ns;
    for (;;) {
        const unsigned long long t0 = nvmf_gpu_now_ns();
        if (t0 >= end) {
            return;
        }
        if (!chase) {
            x = nvmf_fmix64(x + NVMF_GOLDEN);
            lba = (x % extents) * nblocks;
            ns = (unsigned int)((x >> 40) % namespaces);
        }
        const unsigned int st = nvmf_gpu_read_warp(r, ns, lba, nblocks, mine, bytes, timeout_ns);
        const unsigned long long t1 = nvmf_gpu_now_ns();
        if (st != 0) {
            atomicAdd(&res[2], 1ULL);
            atomicCAS(&res[3], 0ULL, (unsigned long long)st);
            return;
        }
        const unsigned long long* words = (const unsigned long long*)mine;
        if (verify) {
            unsigned long long bad = 0;
            for (unsigned long long w = 0; w < bytes / 8; ++w) {
                const unsigned long long off = lba * block_size + (w / 64) * 512;
                if (words[w] != (keys[w % 64] ^ off)) {
                    ++bad;
                }
            }
            if (bad != 0) {
                atomicAdd(&res[1], 1ULL);
            }
            atomicAdd(&res[4], 1ULL);
        }
        if (t0 >= measure_from) {
            const unsigned long long lat = t1 > t0 ? t1 - t0 : 1;
            unsigned int e = 0;
            while (e < 63 && (lat >> (e + 1)) != 0) {
                ++e;
            }
            const unsigned int b = e < 4
                ? (unsigned int)lat
                : (e - 3) * 16 + (unsigned int)((lat >> (e - 4)) & 15);
            atomicAdd(&res[0], 1ULL);
            atomicAdd(&res[hist + 1024ULL * ns + b], 1ULL);
        }
        if (chase) {
            lba = (nvmf_fmix64(words[0]) % extents) * nblocks;
        }
    }
}
"#;

/// The latency a histogram bucket of the kernel stands for (the middle of its range), in ns.
pub fn bucket_ns(b: usize) -> u64 {
    if b < 16 {
        return b as u64;
    }
    let e = (b / 16 + 3) as u32;
    let sub = (b % 16) as u64;
    let width = 1u64 << (e - 4);
    ((16 + sub) << (e - 4)) + width / 2
}

/// Measures a point whose reads GPU threads issue, over the fabric connection `path`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn measure(
    rt: &Runtime,
    path: &Arc<TcpPath>,
    point: &Point,
    prefilled: &mut Prefilled,
    target_cpu: CpuSource,
    repeat: u32,
    mode: &str,
    progress: &Progress,
) -> Measurement {
    let (geo, region, verify) = match prepare(rt, &**path, point, prefilled, mode, progress) {
        Ok(p) => p,
        Err(e) => return failed(repeat, e),
    };
    match run(rt, path, point, &geo, region, verify, target_cpu, repeat) {
        Ok(m) => m,
        Err(e) => failed(repeat, format!("issue gpu: {e}")),
    }
}

#[allow(clippy::too_many_arguments)]
fn run(
    rt: &Runtime,
    path: &TcpPath,
    point: &Point,
    geo: &[NsGeometry],
    region: u64,
    verify: bool,
    target_cpu: CpuSource,
    repeat: u32,
) -> Result<Measurement, String> {
    let targets = path.targets().max(1);
    // Every ring binds the namespaces of one target; each target must have the same ones.
    let local: Vec<NsGeometry> = geo.iter().filter(|g| g.target == 0).copied().collect();
    for t in 1..targets {
        let other = geo.iter().filter(|g| g.target as usize == t);
        if !other
            .map(|g| (g.nsid, g.block_size))
            .eq(local.iter().map(|g| (g.nsid, g.block_size)))
        {
            return Err(format!(
                "target {t} has other namespaces than target 0: each ring binds the same ones"
            ));
        }
    }
    let runtime = point
        .runtime
        .ok_or("GPU-issued reads run for a runtime, not an io_size")?;
    let block_size = geo.first().map_or(512, |g| g.block_size);
    if geo.iter().any(|g| g.block_size != block_size) {
        return Err("the namespaces have different block sizes".into());
    }
    let bs = point.bs;
    if bs % u64::from(block_size) != 0 || bs % VERIFY_BLOCK as u64 != 0 {
        return Err(format!(
            "bs {bs} is not a multiple of the block size {block_size}"
        ));
    }
    let ctx = GpuContext::new(0).map_err(|e| format!("GPU 0: {e}"))?;
    let target = ctx.default_code_target().map_err(|e| e.to_string())?;
    let source = format!("{COMMON_CUH}\n{KERNEL}");
    let image = compile_with_ring_header(&source, "bench_gpu_issue.cu", target, &[])
        .map_err(|e| e.to_string())?;
    let module = ctx.load_module(&image).map_err(|e| e.to_string())?;
    let kernel = module
        .kernel("bench_gpu_issue")
        .map_err(|e| e.to_string())?;

    let threads = point.numjobs * point.iodepth;
    // `queue_pairs` rings per controller, each controller serving a contiguous share.
    let per_target = u32::from(point.queue_pairs)
        .min(path.queues() as u32)
        .max(1);
    let nrings = per_target * targets as u32;
    let per_block = threads.min(THREADS_PER_BLOCK);
    // Warps take the rings round robin (`nvmf_gpu_ring_for_warp`): a slot for every thread of
    // the busiest ring, so no thread waits for a slot.
    let warps = threads.div_ceil(per_block) * per_block.div_ceil(32);
    let cfg = RingConfig {
        slots: (32 * warps.div_ceil(nrings))
            .next_power_of_two()
            .clamp(32, 4096),
        slot_bytes: bs as u32,
        mode: match point.ring_mode {
            RingMode::Pull => DataMode::Pull,
            RingMode::Push => DataMode::Push,
            RingMode::Device => DataMode::Device,
        },
    };
    let bindings: Vec<NsBinding> = local
        .iter()
        .map(|g| NsBinding {
            nsid: g.nsid,
            block_size: g.block_size,
            blocks: region / u64::from(g.block_size),
        })
        .collect();
    let mut set = RingSet::new_gpu(&ctx, nrings, cfg, &bindings).map_err(|e| e.to_string())?;
    // Ring reads per I/O queue of each controller (`queue_stats` lists the admin queue first).
    let ring_reads = || -> Vec<Vec<u64>> {
        (0..targets)
            .map(|t| {
                path.controller(t)
                    .queue_stats()
                    .iter()
                    .skip(1)
                    .map(|q| q.ring_reads)
                    .collect()
            })
            .collect()
    };
    let mut attached = Vec::with_capacity(targets);
    for t in 0..targets {
        let a = rt
            .block_on(
                path.controller(t)
                    .attach_gpu_rings_n(&mut set, per_target as usize),
            )
            .map_err(|e| format!("target {t}: {e}"))?;
        attached.push(a);
    }

    let gpu = |e: nvmeof_initiator::gpu::cuda::GpuError| e.to_string();
    let mut dst = ctx
        .alloc_zeroed(threads as usize * bs as usize)
        .map_err(gpu)?;
    let pattern = Pattern::new(point.seed);
    let key_bytes: Vec<u8> = pattern.key().iter().flat_map(|k| k.to_le_bytes()).collect();
    let mut key = ctx.alloc(key_bytes.len()).map_err(gpu)?;
    key.copy_from_host(&key_bytes).map_err(gpu)?;
    let mut result = ctx
        .alloc_zeroed(8 * (COUNTERS + BUCKETS * geo.len()))
        .map_err(gpu)?;
    let stream = ctx.new_stream().map_err(gpu)?;
    {
        let table = set
            .table_buffer()
            .ok_or("the ring set has no device table")?
            .as_slice();
        let key_view = key.as_slice();
        let mut dst_view = dst.as_slice_mut();
        let mut result_view = result.as_slice_mut();
        let mut args = LaunchArgs::new();
        args.buffer(&table)
            .buffer_mut(&mut dst_view)
            .buffer(&key_view)
            .buffer_mut(&mut result_view)
            .u64(point.seed)
            .u32(block_size)
            .u32((bs / u64::from(block_size)) as u32)
            .u64(region / u64::from(block_size))
            .u32(local.len() as u32)
            .u32(targets as u32)
            .u32(u32::from(point.chase))
            .u32(u32::from(verify))
            .u64(point.ramp_time.as_nanos() as u64)
            .u64(runtime.as_nanos() as u64)
            .u64(READ_TIMEOUT.as_nanos() as u64);
        kernel
            .launch(
                &stream,
                &LaunchConfig::linear(threads.div_ceil(per_block), per_block),
                &args,
            )
            .map_err(gpu)?;
    }
    // The kernel measures on the GPU's clock; the host takes its CPU snapshots over the same
    // interval (give or take the launch).
    std::thread::sleep(point.ramp_time);
    let own_pids = target_cpu.pids();
    let self0 = CpuSnapshot::take(None);
    let tgt0 = own_pids.map(CpuSnapshot::take_processes);
    let queue0 = ring_reads();
    let t0 = Instant::now();
    std::thread::sleep(runtime);
    let secs = t0.elapsed().as_secs_f64();
    let queue1 = ring_reads();
    // Reads each queue serving rings started while measuring, controller by controller.
    let queue_reads: Vec<u64> = attached
        .iter()
        .enumerate()
        .flat_map(|(t, a)| {
            let (q0, q1) = (&queue0[t], &queue1[t]);
            a.queues()
                .iter()
                .map(|&q| q1.get(q).zip(q0.get(q)).map_or(0, |(b, a)| b - a))
                .collect::<Vec<_>>()
        })
        .collect();
    let self1 = CpuSnapshot::take(None);
    let tgt1 = own_pids.map(CpuSnapshot::take_processes);
    let synced = stream.synchronize().map_err(gpu);
    for a in attached {
        rt.block_on(a.detach());
    }
    synced?;
    let raw = result.to_vec().map_err(gpu)?;
    drop(set);
    let word = |i: usize| u64::from_le_bytes(raw[8 * i..8 * i + 8].try_into().unwrap_or([0; 8]));

    let mut hist = LatencyHist::new();
    let mut per_ns = Vec::with_capacity(geo.len());
    for n in 0..geo.len() {
        let mut acc = NsAcc::default();
        for b in 0..BUCKETS {
            let k = word(COUNTERS + BUCKETS * n + b);
            if k > 0 {
                acc.hist.record_n(bucket_ns(b), k);
                hist.record_n(bucket_ns(b), k);
                acc.ops += k;
            }
        }
        acc.bytes = acc.ops * bs;
        per_ns.push(acc);
    }
    let ops = word(0);
    let (mismatched, failed_reads, first_status) = (word(1), word(2), word(3));
    let out = WorkerOutput {
        read_ops: ops,
        read_bytes: ops * bs,
        read_hist: hist,
        per_ns,
        verified_reads: word(4),
        verify_errors: mismatched,
        first_verify_error: (mismatched > 0).then(|| {
            format!("{mismatched} GPU-issued reads differ from the pattern (checked on the GPU)")
        }),
        io_errors: failed_reads,
        first_io_error: (failed_reads > 0)
            .then(|| format!("a GPU-issued read failed with status {first_status:#06x}")),
        ..Default::default()
    };
    let timing = Timing {
        secs: secs.max(runtime.as_secs_f64()),
        self0,
        self1,
        tgt0,
        tgt1,
    };
    let mut m = summarize(repeat, geo, &target_cpu, &timing, &[out], None);
    m.queue_reads = queue_reads;
    m.queue_spread = crate::run::queue_spread(&m.queue_reads, secs);
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cover_their_values() {
        // The kernel's bucket of a latency, as the CUDA code computes it.
        let bucket = |lat: u64| {
            let e = 63 - lat.leading_zeros();
            if e < 4 {
                lat as usize
            } else {
                ((e - 3) * 16 + ((lat >> (e - 4)) & 15) as u32) as usize
            }
        };
        for lat in [
            1u64,
            7,
            15,
            16,
            17,
            31,
            32,
            1000,
            4096,
            12_345,
            1 << 40,
            u64::MAX,
        ] {
            let b = bucket(lat);
            assert!(b < BUCKETS, "{lat}: bucket {b}");
            let mid = bucket_ns(b);
            let err = mid.abs_diff(lat) as f64 / lat as f64;
            assert!(
                err <= 1.0 / 32.0 + 1e-9,
                "{lat}: bucket {b} stands for {mid}"
            );
        }
    }

    #[test]
    fn the_kernel_compiles_where_nvrtc_is_found() {
        use nvmeof_initiator::gpu::cuda::CodeTarget;
        use nvmeof_initiator::gpu::cuda::test_support::should_skip;
        use nvmeof_initiator::gpu::kernels::KernelError;

        let name = "the_kernel_compiles_where_nvrtc_is_found";
        let source = format!("{COMMON_CUH}\n{KERNEL}");
        let target = CodeTarget::Ptx { arch: 90 };
        match compile_with_ring_header(&source, "bench_gpu_issue.cu", target, &[]) {
            Ok(image) => assert!(image.ptx().unwrap().contains(".entry bench_gpu_issue(")),
            Err(KernelError::Gpu(e)) if should_skip(name, &e) => {}
            Err(e) => panic!("{name}: {e}"),
        }
    }
}
