//! Reads into and writes from GPU memory over NVMe/TCP against our target (in process, on
//! loopback, memory namespaces), and reads GPU threads issue themselves through request rings
//! the queue tasks serve. Every test prints `SKIP <name>: skipped: no CUDA driver ...`
//! and passes on machines without a GPU; with NVMEOF_GPU_REQUIRE=1 that is a failure.

mod common;

use std::sync::Arc;

use common::{TestTarget, options};
use nvmeof_initiator::gpu::cuda::{GpuContext, test_support::should_skip};
use nvmeof_initiator::gpu::kernels::pattern::{fill_pattern, pattern_vec, verify_pattern};
use nvmeof_initiator::gpu::kernels::{KernelError, NvmfKernels, PatternRegion};
use nvmeof_initiator::gpu::{GpuIoError, GpuRead, GpuStaging, MemSource, StagingConfig};
use nvmeof_initiator::{Controller, Namespace};

const SEED: u64 = 0x6770_755f_7465_7374;

/// Opens GPU 0 and loads the kernels, or prints SKIP and returns None.
fn gpu_or_skip(name: &str) -> Option<(GpuContext, Arc<NvmfKernels>)> {
    let ctx = match GpuContext::new(0) {
        Ok(ctx) => ctx,
        Err(e) if should_skip(name, &e) => return None,
        Err(e) => panic!("{name}: cannot open GPU 0: {e}"),
    };
    match NvmfKernels::load(&ctx) {
        Ok(k) => Some((ctx, Arc::new(k))),
        Err(KernelError::Gpu(e)) if should_skip(name, &e) => None,
        Err(e) => panic!("{name}: cannot load the kernels: {e}"),
    }
}

/// A target with one memory namespace of `size` and `block`-byte blocks, a controller with
/// `queues` I/O queues, and the namespace filled with the seeded pattern.
async fn setup(spec: &str, queues: u16) -> (TestTarget, Controller, Namespace) {
    let target = TestTarget::start(&[spec], |s| s.reactors = 2);
    let mut opts = options(target.target_addr());
    opts.io_queues = Some(queues);
    opts.queue_depth = 64;
    let ctrl = Controller::connect(opts).await.expect("connect");
    let ns = ctrl.namespace(1).await.expect("namespace");
    let chunk = 4 << 20;
    let mut buf = vec![0u8; chunk];
    let mut off = 0u64;
    while off < ns.size_bytes() {
        let n = chunk.min((ns.size_bytes() - off) as usize);
        fill_pattern(SEED, off, &mut buf[..n]);
        ns.write(off / u64::from(ns.block_size()), &buf[..n])
            .await
            .expect("fill");
        off += n as u64;
    }
    (target, ctrl, ns)
}

fn region(offset: u64, ns_offset: u64, len: u64) -> PatternRegion {
    PatternRegion {
        offset,
        ns_offset,
        len,
    }
}

/// Reads of 512 B, 4 KiB, 128 KiB, 1 MiB and 16 MiB land in device memory at aligned and
/// unaligned destination offsets; checked by the verify kernel and after copying back, with
/// the bytes around the destination untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_reads_into_hbm_all_sizes_and_offsets() {
    let Some((ctx, kernels)) = gpu_or_skip("gpu_reads_into_hbm_all_sizes_and_offsets") else {
        return;
    };
    let (mut target, ctrl, ns) = setup("mem:64M,bs=512", 2).await;
    let bs = u64::from(ns.block_size());
    let mut staging = GpuStaging::new(
        &ctx,
        StagingConfig {
            slots: 3,
            slot_bytes: 256 << 10,
            timing: true,
        },
    )
    .unwrap()
    .with_kernels(kernels.clone())
    .unwrap();
    let size = 17 << 20;
    let mut dev = ctx.alloc(size).unwrap();
    for len in [512usize, 4096, 128 << 10, 1 << 20, 16 << 20] {
        for dst_off in [0usize, 3, 4096 + 1, 65_537] {
            if dst_off + len > size {
                continue;
            }
            let lba = (len as u64 * 7 / bs + 13) % (ns.num_blocks() - (len as u64 / bs));
            dev.as_slice_mut().fill(0xA5).unwrap();
            staging
                .read(&ns, lba, dev.slice_mut(dst_off..dst_off + len).unwrap())
                .await
                .unwrap_or_else(|e| panic!("read {len} at {dst_off}: {e}"));
            let (k, ws) = staging.kernels().unwrap();
            let report = k
                .verify_pattern(
                    ws,
                    &dev.as_slice(),
                    &[region(dst_off as u64, lba * bs, len as u64)],
                    SEED,
                )
                .unwrap();
            assert!(report.is_ok(), "{len} B at +{dst_off}: {report:?}");
            // Copy back: the data and the guard bytes around it.
            let lo = dst_off.saturating_sub(64);
            let hi = (dst_off + len + 64).min(size);
            let back = dev.slice(lo..hi).unwrap().to_vec().unwrap();
            let data = &back[dst_off - lo..dst_off - lo + len];
            assert!(
                verify_pattern(SEED, lba * bs, data).is_ok(),
                "{len} at {dst_off}"
            );
            assert!(back[..dst_off - lo].iter().all(|&b| b == 0xA5));
            assert!(back[dst_off - lo + len..].iter().all(|&b| b == 0xA5));
        }
    }
    let stats = staging.stats();
    assert!(stats.h2d_bytes > 0 && stats.copies > 0);
    assert!(stats.gpu_copy > std::time::Duration::ZERO, "{stats:?}");
    // Commands up to a slot (256 KiB) were received straight into lent slots; larger ones
    // (the 1 MiB commands of the larger reads) were copied into the slots.
    assert!(
        stats.lent_bytes > 0 && stats.lent_bytes < stats.h2d_bytes,
        "{stats:?}"
    );
    let queues = ctrl.queue_stats();
    assert!(queues.iter().map(|q| q.lent_commands).sum::<u64>() > 0);
    println!("staging stats: {stats:?}");
    ctrl.disconnect().await.unwrap();
    target.shutdown().await;
}

/// Several readers, each with its own staging and stream, on several queues, fill disjoint
/// parts of one device buffer concurrently; the whole buffer is then verified.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn gpu_concurrent_readers_on_several_streams() {
    let Some((ctx, kernels)) = gpu_or_skip("gpu_concurrent_readers_on_several_streams") else {
        return;
    };
    let (mut target, ctrl, ns) = setup("mem:128M", 4).await;
    let bs = u64::from(ns.block_size());
    let readers = 6usize;
    let per = 8usize << 20;
    let mut dev = ctx.alloc(readers * per + 5).unwrap();
    dev.as_slice_mut().fill(0).unwrap();
    // Odd base offset: every reader's destination is unaligned.
    let mut rest = dev.slice_mut(5..).unwrap();
    let mut parts = Vec::new();
    for _ in 0..readers - 1 {
        let (a, b) = rest.split_at_mut(per).unwrap();
        parts.push(a);
        rest = b;
    }
    parts.push(rest);
    let mut regions = Vec::new();
    let mut jobs = Vec::new();
    for (i, part) in parts.into_iter().enumerate() {
        let lba = (i as u64 * 2 + 1) * (per as u64 / bs);
        regions.push(region(5 + (i * per) as u64, lba * bs, per as u64));
        let ctx = ctx.clone();
        let ns = ns.on_queue(i);
        jobs.push(async move {
            let mut st = GpuStaging::new(&ctx, StagingConfig::default())?;
            // Several reads per reader, each of 1 MiB, back to back into its part.
            let mut part = part;
            for k in 0..per / (1 << 20) {
                let off = k << 20;
                st.read(
                    &ns,
                    lba + (off as u64) / bs,
                    part.slice_mut(off..off + (1 << 20))?,
                )
                .await?;
            }
            Ok::<_, GpuIoError>(st.take_stats())
        });
    }
    let stats = futures_util::future::try_join_all(jobs)
        .await
        .expect("readers");
    for s in &stats {
        assert_eq!(s.h2d_bytes, per as u64);
    }
    let stream = ctx.new_stream().unwrap();
    let mut ws = nvmeof_initiator::gpu::kernels::KernelWorkspace::new(&stream).unwrap();
    let report = kernels
        .verify_pattern(&mut ws, &dev.as_slice(), &regions, SEED)
        .unwrap();
    assert!(report.is_ok(), "{report:?}");
    let back = dev.to_vec().unwrap();
    for r in &regions {
        let data = &back[r.offset as usize..(r.offset + r.len) as usize];
        assert!(verify_pattern(SEED, r.ns_offset, data).is_ok());
    }
    assert!(back[..5].iter().all(|&b| b == 0));
    ctrl.disconnect().await.unwrap();
    target.shutdown().await;
}

/// Many small reads (512 B and 4 KiB blocks, random order, unaligned destinations) batched
/// into staging slots and scattered by the kernel, from the target and from local memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_batched_small_reads_scatter() {
    let Some((ctx, kernels)) = gpu_or_skip("gpu_batched_small_reads_scatter") else {
        return;
    };
    for spec in ["mem:32M,bs=512", "mem:32M"] {
        let (mut target, ctrl, ns) = setup(spec, 2).await;
        let bs = u64::from(ns.block_size());
        let mut staging = GpuStaging::new(
            &ctx,
            StagingConfig {
                slots: 2,
                slot_bytes: 64 << 10,
                timing: false,
            },
        )
        .unwrap()
        .with_kernels(kernels.clone())
        .unwrap();
        // 700 reads of 1-3 blocks, one of 40 blocks (larger than a slot for 4 KiB blocks),
        // pseudo-random LBAs, destinations packed in shuffled order with 1-byte gaps.
        let mut x = 0x1234_5678_9abc_def1u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let n = 700usize;
        let lens: Vec<u32> = (0..n)
            .map(|i| {
                if i == 350 {
                    40
                } else {
                    1 + (next() % 3) as u32
                }
            })
            .collect();
        let mut order: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            order.swap(i, (next() % (i as u64 + 1)) as usize);
        }
        let mut dst_of = vec![0u64; n];
        let mut off = 1u64;
        for &i in &order {
            dst_of[i] = off;
            off += u64::from(lens[i]) * bs + 1;
        }
        let reads: Vec<GpuRead> = (0..n)
            .map(|i| GpuRead {
                lba: next() % (ns.num_blocks() - 64),
                blocks: lens[i],
                dst_offset: dst_of[i],
            })
            .collect();
        let regions: Vec<_> = reads
            .iter()
            .map(|r| region(r.dst_offset, r.lba * bs, u64::from(r.blocks) * bs))
            .collect();
        let mut dev = ctx.alloc(off as usize + 7).unwrap();
        dev.as_slice_mut().fill(0).unwrap();
        staging
            .read_batch(&ns, &reads, &mut dev.as_slice_mut())
            .await
            .unwrap();
        let (k, ws) = staging.kernels().unwrap();
        let report = k
            .verify_pattern(ws, &dev.as_slice(), &regions, SEED)
            .unwrap();
        assert!(report.is_ok(), "{spec}: {report:?}");
        let back = dev.to_vec().unwrap();
        for r in &regions {
            let d = &back[r.offset as usize..(r.offset + r.len) as usize];
            assert!(verify_pattern(SEED, r.ns_offset, d).is_ok());
            // The gap byte after each read stays untouched.
            assert_eq!(back[(r.offset + r.len) as usize], 0);
        }
        let stats = staging.take_stats();
        assert!(stats.scatters > 1, "{stats:?}");

        // The same reads from local memory through the same staging.
        let mut ram = vec![0u8; ns.size_bytes() as usize];
        fill_pattern(SEED, 0, &mut ram);
        let mem = MemSource::new(Arc::from(ram), ns.block_size()).unwrap();
        dev.as_slice_mut().fill(0).unwrap();
        staging
            .read_batch(&mem, &reads, &mut dev.as_slice_mut())
            .await
            .unwrap();
        let (k, ws) = staging.kernels().unwrap();
        let report = k
            .verify_pattern(ws, &dev.as_slice(), &regions, SEED)
            .unwrap();
        assert!(report.is_ok(), "{spec} (memory): {report:?}");

        ctrl.disconnect().await.unwrap();
        target.shutdown().await;
    }
}

/// Writes from device memory (pattern filled on the GPU at a new seed, odd source offset)
/// reach the namespace: read back to the host and into the GPU, both verified.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_writes_from_hbm() {
    let Some((ctx, kernels)) = gpu_or_skip("gpu_writes_from_hbm") else {
        return;
    };
    let (mut target, ctrl, ns) = setup("mem:64M,bs=512", 2).await;
    let bs = u64::from(ns.block_size());
    let seed2 = SEED ^ 0xFFFF;
    let mut staging = GpuStaging::new(
        &ctx,
        StagingConfig {
            slots: 3,
            slot_bytes: 256 << 10,
            timing: true,
        },
    )
    .unwrap()
    .with_kernels(kernels.clone())
    .unwrap();
    for (len, lba) in [
        (512usize, 1u64),
        (4096, 77),
        (128 << 10, 1000),
        (16 << 20, 40_000),
    ] {
        let mut dev = ctx.alloc(len + 9).unwrap();
        {
            let (k, ws) = staging.kernels().unwrap();
            k.fill_pattern(
                ws,
                &mut dev.slice_mut(9..).unwrap(),
                &[region(0, lba * bs, len as u64)],
                seed2,
            )
            .unwrap();
            ws.synchronize().unwrap();
        }
        staging
            .write(&ns, lba, &dev.slice(9..).unwrap())
            .await
            .unwrap_or_else(|e| panic!("write {len}: {e}"));
        let mut host = vec![0u8; len];
        ns.read(lba, &mut host).await.unwrap();
        assert_eq!(host, pattern_vec(seed2, lba * bs, len), "{len}");
        // Back into the GPU at another offset.
        let mut dev2 = ctx.alloc(len + 1).unwrap();
        staging
            .read(&ns, lba, dev2.slice_mut(1..).unwrap())
            .await
            .unwrap();
        let (k, ws) = staging.kernels().unwrap();
        let report = k
            .verify_pattern(
                ws,
                &dev2.as_slice(),
                &[region(1, lba * bs, len as u64)],
                seed2,
            )
            .unwrap();
        assert!(report.is_ok(), "{len}: {report:?}");
    }
    // Blocks next to the written ranges still hold the original pattern.
    let mut host = vec![0u8; 512];
    ns.read(0, &mut host).await.unwrap();
    assert!(verify_pattern(SEED, 0, &host).is_ok());
    ctrl.disconnect().await.unwrap();
    target.shutdown().await;
}

/// Bad requests get typed errors, never a panic or a hang: reads past the namespace end,
/// partial blocks, overlapping or out-of-range batch destinations, batches without kernels.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_bad_requests_are_errors() {
    let Some((ctx, kernels)) = gpu_or_skip("gpu_bad_requests_are_errors") else {
        return;
    };
    let (mut target, ctrl, ns) = setup("mem:4M", 1).await;
    let mut plain = GpuStaging::new(&ctx, StagingConfig::default()).unwrap();
    let mut dev = ctx.alloc(1 << 20).unwrap();
    let err = plain
        .read(&ns, ns.num_blocks() - 1, dev.slice_mut(..8192).unwrap())
        .await
        .unwrap_err();
    assert!(matches!(err, GpuIoError::Io(_)), "{err}");
    let err = plain
        .read(&ns, 0, dev.slice_mut(..1000).unwrap())
        .await
        .unwrap_err();
    assert!(matches!(err, GpuIoError::Io(_)), "{err}");
    let one = |lba, dst_offset| GpuRead {
        lba,
        blocks: 1,
        dst_offset,
    };
    let err = plain
        .read_batch(&ns, &[one(0, 0)], &mut dev.as_slice_mut())
        .await
        .unwrap_err();
    assert!(matches!(err, GpuIoError::InvalidArgument(_)), "{err}");
    let mut staging = GpuStaging::new(&ctx, StagingConfig::default())
        .unwrap()
        .with_kernels(kernels)
        .unwrap();
    let err = staging
        .read_batch(&ns, &[one(0, 0), one(1, 100)], &mut dev.as_slice_mut())
        .await
        .unwrap_err();
    assert!(matches!(err, GpuIoError::Kernel(_)), "{err}");
    let err = staging
        .read_batch(&ns, &[one(0, (1 << 20) - 100)], &mut dev.as_slice_mut())
        .await
        .unwrap_err();
    assert!(matches!(err, GpuIoError::InvalidArgument(_)), "{err}");
    assert!(matches!(
        GpuStaging::new(
            &ctx,
            StagingConfig {
                slots: 1,
                ..StagingConfig::default()
            }
        ),
        Err(GpuIoError::InvalidArgument(_))
    ));
    // After the errors the staging still works.
    staging
        .read(&ns, 0, dev.slice_mut(..4096).unwrap())
        .await
        .unwrap();
    let back = dev.slice(..4096).unwrap().to_vec().unwrap();
    assert!(verify_pattern(SEED, 0, &back).is_ok());
    ctrl.disconnect().await.unwrap();
    target.shutdown().await;
}

/// The kernel of `gpu_threads_read_through_the_queue_tasks` (needs `COMMON_CUH` in front and
/// the ring header).
const GPU_ISSUE_KERNEL: &str = r#"
#include "nvmf_gpu.cuh"

// result (u64): [0] wrong words, [1] failed reads, [2] a failed status, [3] verified reads,
// [4] latency sum (ns), [5] latency max (ns), [8..8+256] latency histogram (4 buckets per
// power of two of nanoseconds).
extern "C" __global__ void gpu_issue(
    const unsigned char* rings, unsigned long long rings_len,
    unsigned char* dst, unsigned long long dst_len,
    unsigned char* result, unsigned long long result_len,
    unsigned long long seed, unsigned int block_size, unsigned int nblocks,
    unsigned long long ns_blocks, unsigned int iterations, unsigned int chase,
    unsigned long long timeout_ns)
{
    if (rings_len < sizeof(struct nvmf_gpu_ring) || result_len < 8 * (8 + 256) || nblocks == 0) {
        return;
    }
    const struct nvmf_gpu_ring* r = nvmf_gpu_ring_for_sm((const struct nvmf_gpu_ring*)rings);
    const unsigned long long tid = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned long long bytes = (unsigned long long)block_size * nblocks;
    if ((tid + 1) * bytes > dst_len) {
        return;
    }
    unsigned char* mine = dst + tid * bytes;
    unsigned long long* res = (unsigned long long*)result;
    const unsigned long long extents = ns_blocks / nblocks;
    unsigned long long lba = (nvmf_fmix64(seed ^ tid) % extents) * nblocks;
    for (unsigned int it = 0; it < iterations; ++it) {
        if (!chase) {
            lba = (nvmf_fmix64(seed ^ (tid * 1000003ULL + it)) % extents) * nblocks;
        }
        const unsigned long long t0 = nvmf_gpu_now_ns();
        const unsigned int st = nvmf_gpu_read(r, 0, lba, nblocks, mine, bytes, timeout_ns);
        const unsigned long long lat = nvmf_gpu_now_ns() - t0;
        if (st != 0) {
            atomicAdd(&res[1], 1ULL);
            atomicCAS(&res[2], 0ULL, (unsigned long long)st);
            return;
        }
        const unsigned long long bad =
            nvmf_pattern_mismatches(mine, bytes, seed, lba * block_size);
        if (bad != 0) {
            atomicAdd(&res[0], bad);
        }
        atomicAdd(&res[3], 1ULL);
        atomicAdd(&res[4], lat);
        atomicMax(&res[5], lat);
        unsigned int e = 0;
        while (e < 63 && (lat >> (e + 1)) != 0) {
            ++e;
        }
        const unsigned int sub = e >= 2 ? (unsigned int)((lat >> (e - 2)) & 3) : 0;
        atomicAdd(&res[8 + e * 4 + sub], 1ULL);
        // The chase: the next address comes from this read's data.
        lba = (((const unsigned long long*)mine)[0] % extents) * nblocks;
    }
}
"#;

/// The GPU-issue kernel compiles with the ring header wherever NVRTC is found (no GPU needed).
#[test]
fn nvrtc_compiles_the_gpu_issue_kernel() {
    use nvmeof_initiator::gpu::cuda::CodeTarget;
    use nvmeof_initiator::gpu::kernels::COMMON_CUH;
    use nvmeof_initiator::gpu::kernels::ring::compile_with_ring_header;

    let name = "nvrtc_compiles_the_gpu_issue_kernel";
    let source = format!("{COMMON_CUH}\n{GPU_ISSUE_KERNEL}");
    match compile_with_ring_header(&source, "gpu_issue.cu", CodeTarget::Ptx { arch: 90 }, &[]) {
        Ok(image) => assert!(image.ptx().unwrap().contains(".entry gpu_issue(")),
        Err(KernelError::Gpu(e)) if should_skip(name, &e) => {}
        Err(e) => panic!("{name}: {e}"),
    }
}

/// The ring-issue kernel compiled and loaded, or SKIP.
fn issue_kernel(name: &str) -> Option<(GpuContext, nvmeof_initiator::gpu::cuda::Kernel)> {
    use nvmeof_initiator::gpu::kernels::COMMON_CUH;
    use nvmeof_initiator::gpu::kernels::ring::compile_with_ring_header;

    let (ctx, _kernels) = gpu_or_skip(name)?;
    let target_code = ctx.default_code_target().unwrap();
    let source = format!("{COMMON_CUH}\n{GPU_ISSUE_KERNEL}");
    let image = compile_with_ring_header(&source, "gpu_issue.cu", target_code, &[]).unwrap();
    let module = ctx.load_module(&image).unwrap();
    let kernel = module.kernel("gpu_issue").unwrap();
    Some((ctx, kernel))
}

/// GPU thread blocks and threads per block of the ring-issue kernel.
const ISSUE_BLOCKS: u32 = 8;
const ISSUE_THREADS: u32 = 64;

/// One run of the ring-issue kernel.
struct Issue {
    mode: nvmeof_initiator::gpu_ring::DataMode,
    nblocks: u32,
    chase: bool,
    iterations: u32,
}

impl Issue {
    fn reads(&self) -> u64 {
        u64::from(ISSUE_BLOCKS * ISSUE_THREADS * self.iterations)
    }

    fn what(&self, bs: u32) -> String {
        format!(
            "{:?} mode, {} B {}",
            self.mode,
            bs * self.nblocks,
            if self.chase {
                "pointer chase"
            } else {
                "uniform random"
            }
        )
    }
}

/// Attaches two rings of 64 slots in `issue.mode` to `ctrl` and starts the kernel on them
/// (namespace `ns`, filled with the pattern) on a blocking thread; the handle gives back the
/// kernel and the result words once the kernel ended.
async fn start_issue(
    ctx: &GpuContext,
    kernel: nvmeof_initiator::gpu::cuda::Kernel,
    ctrl: &Controller,
    ns: &Namespace,
    issue: &Issue,
) -> (
    nvmeof_initiator::AttachedRings,
    tokio::task::JoinHandle<(nvmeof_initiator::gpu::cuda::Kernel, Vec<u64>)>,
) {
    use nvmeof_initiator::gpu::cuda::{LaunchArgs, LaunchConfig};
    use nvmeof_initiator::gpu_ring::{NsBinding, RingConfig, RingSet};

    let (bs, blocks) = (ns.block_size(), ns.num_blocks());
    let cfg = RingConfig {
        slots: 64,
        slot_bytes: 4096,
        mode: issue.mode,
    };
    let binding = NsBinding {
        nsid: ns.nsid(),
        block_size: bs,
        blocks,
    };
    let mut set = RingSet::new_gpu(ctx, 2, cfg, &[binding]).unwrap();
    let attached = ctrl.attach_gpu_rings(&mut set).await.unwrap();
    let bytes = (bs * issue.nblocks) as usize;
    let mut dst = ctx
        .alloc_zeroed((ISSUE_BLOCKS * ISSUE_THREADS) as usize * bytes)
        .unwrap();
    let mut result = ctx.alloc_zeroed(8 * (8 + 256)).unwrap();
    let stream = ctx.new_stream().unwrap();
    let (nblocks, chase, iterations) = (issue.nblocks, issue.chase, issue.iterations);
    let run = tokio::task::spawn_blocking(move || {
        {
            let table = set.table_buffer().unwrap().as_slice();
            let mut dst_view = dst.as_slice_mut();
            let mut result_view = result.as_slice_mut();
            let mut args = LaunchArgs::new();
            args.buffer(&table)
                .buffer_mut(&mut dst_view)
                .buffer_mut(&mut result_view)
                .u64(SEED)
                .u32(bs)
                .u32(nblocks)
                .u64(blocks)
                .u32(iterations)
                .u32(u32::from(chase))
                .u64(20_000_000_000);
            kernel
                .launch(
                    &stream,
                    &LaunchConfig::linear(ISSUE_BLOCKS, ISSUE_THREADS),
                    &args,
                )
                .unwrap();
        }
        stream.synchronize().unwrap();
        let raw = result.to_vec().unwrap();
        let words = raw
            .chunks_exact(8)
            .map(|w| u64::from_le_bytes(w.try_into().unwrap()))
            .collect();
        drop((set, dst, stream));
        (kernel, words)
    });
    (attached, run)
}

/// Checks the result words of a run: no failed read, no wrong word, every read verified.
/// Prints the latency figures.
fn check_issue(name: &str, what: &str, words: &[u64], reads: u64, elapsed: std::time::Duration) {
    assert_eq!(
        words[1], 0,
        "{what}: failed reads, e.g. status {:#x}",
        words[2]
    );
    assert_eq!(words[0], 0, "{what}: wrong words");
    assert_eq!(words[3], reads, "{what}: verified reads");
    let hist = &words[8..8 + 256];
    let pct = |p: f64| {
        let want = (reads as f64 * p).ceil() as u64;
        let mut seen = 0;
        for (b, &n) in hist.iter().enumerate() {
            seen += n;
            if seen >= want {
                let (e, sub) = ((b / 4) as u32, (b % 4) as u64);
                return if e >= 2 {
                    (5 + sub) << (e - 2)
                } else {
                    1 << (e + 1)
                };
            }
        }
        0
    };
    println!(
        "{name}: {what}: {reads} reads by {} GPU threads in {elapsed:?} ({:.0} IOPS); \
         latency mean {:.1} us, p50 <= {:.1} us, p99 <= {:.1} us, max {:.1} us",
        ISSUE_BLOCKS * ISSUE_THREADS,
        reads as f64 / elapsed.as_secs_f64(),
        words[4] as f64 / reads as f64 / 1000.0,
        pct(0.5) as f64 / 1000.0,
        pct(0.99) as f64 / 1000.0,
        words[5] as f64 / 1000.0,
    );
}

fn ring_reads(ctrl: &Controller) -> u64 {
    ctrl.queue_stats().iter().map(|q| q.ring_reads).sum()
}

/// GPU threads issue their own reads (`nvmf_gpu.cuh`) through request rings served by the
/// controller's queue tasks (`Controller::attach_gpu_rings`) over NVMe/TCP, in pull mode (the
/// waiting warp copies from the pinned slot) and in push mode (the queue task pushes each
/// batch with one host-to-device copy and the push kernel): uniform random reads of 512 B and
/// 4 KiB, and a dependent pointer chase (each read's LBA comes from the previous read's first
/// word), 512 threads on two rings of 64 slots (more reads than slots and command
/// identifiers, so the rings also wait for free ones), every byte checked on the GPU, per-read
/// latency taken with %globaltimer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn gpu_threads_read_through_the_queue_tasks() {
    use nvmeof_initiator::gpu_ring::DataMode;

    const NAME: &str = "gpu_threads_read_through_the_queue_tasks";
    let Some((ctx, mut kernel)) = issue_kernel(NAME) else {
        return;
    };
    let (mut target, ctrl, ns) = setup("mem:64M,bs=512", 2).await;
    for mode in [DataMode::Pull, DataMode::Push] {
        for (nblocks, chase) in [(1u32, false), (8, false), (8, true)] {
            let issue = Issue {
                mode,
                nblocks,
                chase,
                iterations: 16,
            };
            let before = ring_reads(&ctrl);
            let start = std::time::Instant::now();
            let (attached, run) = start_issue(&ctx, kernel, &ctrl, &ns, &issue).await;
            let (k, words) = run.await.unwrap();
            kernel = k;
            let elapsed = start.elapsed();
            attached.detach().await;
            let what = issue.what(ns.block_size());
            check_issue(NAME, &what, &words, issue.reads(), elapsed);
            assert_eq!(
                ring_reads(&ctrl) - before,
                issue.reads(),
                "{what}: reads the queue tasks started"
            );
        }
    }
    ctrl.disconnect().await.unwrap();
    target.shutdown().await;
}

/// The target is shut down while GPU threads have ring reads in flight and comes back on the
/// same port (a file namespace keeps the pattern): the initiator reconnects, the reads in
/// flight are sent again, and the kernel's reads all complete and verify (pull and push
/// mode); the threads see only latency.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn gpu_ring_reads_survive_a_target_restart() {
    use nvmeof_initiator::ControllerState;
    use nvmeof_initiator::gpu_ring::DataMode;

    const NAME: &str = "gpu_ring_reads_survive_a_target_restart";
    let Some((ctx, mut kernel)) = issue_kernel(NAME) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let spec = format!(
        "file:{},size=16M,bs=512,direct=off",
        dir.path().join("ns1.img").display()
    );
    let (mut target, ctrl, ns) = setup(&spec, 2).await;
    ns.flush().await.unwrap();
    let addr = target.addr;
    for mode in [DataMode::Pull, DataMode::Push] {
        let issue = Issue {
            mode,
            nblocks: 1,
            chase: false,
            iterations: 400,
        };
        let reconnects = ctrl.reconnects();
        let start = std::time::Instant::now();
        let (attached, run) = start_issue(&ctx, kernel, &ctrl, &ns, &issue).await;
        let before = ring_reads(&ctrl);
        while ring_reads(&ctrl) < before + 2000 && !run.is_finished() {
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
        assert!(!run.is_finished(), "the kernel ended before the restart");
        target.shutdown().await;
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        target = TestTarget::start_on(addr, &[&spec], |s| s.reactors = 2);
        let (k, words) = run.await.unwrap();
        kernel = k;
        let elapsed = start.elapsed();
        attached.detach().await;
        let what = format!("{} across a target restart", issue.what(ns.block_size()));
        check_issue(NAME, &what, &words, issue.reads(), elapsed);
        ctrl.wait_for_state(std::time::Duration::from_secs(20), |s| {
            *s == ControllerState::Connected
        })
        .await
        .unwrap();
        assert!(ctrl.reconnects() > reconnects, "{what}: no reconnect");
    }
    ctrl.disconnect().await.unwrap();
    target.shutdown().await;
}
