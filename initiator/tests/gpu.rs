//! Reads into and writes from GPU memory over NVMe/TCP against our target (in process, on
//! loopback, memory namespaces). Every test prints `SKIP <name>: skipped: no CUDA driver ...`
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
