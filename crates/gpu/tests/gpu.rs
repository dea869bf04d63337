//! GPU tests of the memory layer. Each prints `SKIP <name>: skipped: no CUDA driver ...` and
//! passes on machines without a driver (set NVMEOF_GPU_REQUIRE=1 to make that a failure).

use nvmeof_gpu as gpu;
use nvmeof_gpu::{
    CodeTarget, DeviceBuffer, FlushScope, GpuContext, GpuError, LaunchArgs, LaunchConfig, compile,
    device_count, ensure_driver, test_support::should_skip,
};

macro_rules! ctx_or_skip {
    ($name:expr) => {
        match GpuContext::new(0) {
            Ok(ctx) => ctx,
            Err(e) => {
                if should_skip($name, &e) {
                    return;
                }
                panic!("{}: cannot open GPU 0: {e}", $name);
            }
        }
    };
}

/// Deterministic pseudo-random bytes.
fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

#[test]
fn gpu_context_and_device_info() {
    let ctx = ctx_or_skip!("gpu_context_and_device_info");
    let info = ctx.info();
    let driver = ensure_driver().expect("driver loaded");
    println!(
        "device {}: {} ({}), cc {}.{}, {} SMs, {:.1} GiB, driver {}, dma-buf {}, GPUDirect RDMA {}, flush options {:#x}",
        info.ordinal,
        info.name,
        info.pci_bus_id,
        info.compute_capability.0,
        info.compute_capability.1,
        info.multiprocessors,
        info.total_memory as f64 / (1u64 << 30) as f64,
        info.driver_version,
        info.dma_buf_supported,
        info.gpudirect_rdma_supported,
        info.rdma_flush_options
    );
    assert!(!info.name.is_empty());
    assert!(info.total_memory >= 1 << 30);
    assert!(info.compute_capability.0 >= 5);
    assert!(info.multiprocessors > 0);
    assert!(driver.version >= gpu::MIN_DRIVER_VERSION);
    assert!(device_count().unwrap() >= 1);
    let (free, total) = ctx.memory_info().unwrap();
    assert!(free > 0 && free <= total && total == info.total_memory);
    ctx.synchronize().unwrap();
    assert!(matches!(
        GpuContext::new(1000),
        Err(GpuError::NoSuchDevice { ordinal: 1000, .. })
    ));
    let again = GpuContext::new(0).unwrap();
    assert!(!again.same_as(&ctx));
    assert!(ctx.clone().same_as(&ctx));
}

#[test]
fn gpu_alloc_copy_roundtrip_and_unaligned_slices() {
    let ctx = ctx_or_skip!("gpu_alloc_copy_roundtrip_and_unaligned_slices");
    for (i, len) in [1usize, 511, 512, 4096, 128 * 1024 + 3, 1 << 20, 16 << 20]
        .into_iter()
        .enumerate()
    {
        let data = bytes(i as u64, len);
        let mut buf = ctx.alloc(len).unwrap();
        buf.copy_from_host(&data).unwrap();
        assert_eq!(buf.to_vec().unwrap(), data, "round trip of {len} bytes");
    }

    // Writes at unaligned offsets leave the neighbours alone.
    let mut buf = ctx.alloc_zeroed(1 << 20).unwrap();
    assert!(buf.to_vec().unwrap().iter().all(|&b| b == 0));
    let piece = bytes(99, 777);
    buf.slice_mut(1..778)
        .unwrap()
        .copy_from_host(&piece)
        .unwrap();
    buf.slice_mut(4099..4199).unwrap().fill(0xAB).unwrap();
    let host = buf.to_vec().unwrap();
    assert_eq!(host[0], 0);
    assert_eq!(&host[1..778], &piece[..]);
    assert_eq!(host[778], 0);
    assert!(host[4099..4199].iter().all(|&b| b == 0xAB));
    assert_eq!(host[4098], 0);
    assert_eq!(host[4199], 0);
    // Sub-slices of sub-slices and reads at odd offsets.
    let view = buf.slice(1..).unwrap().slice(10..20).unwrap();
    assert_eq!(view.offset(), 11);
    assert_eq!(view.device_ptr(), buf.device_ptr() + 11);
    assert_eq!(view.to_vec().unwrap(), &piece[10..20]);

    // Device-to-device copy between unaligned offsets.
    let stream = ctx.new_stream().unwrap();
    let mut other = ctx.alloc_zeroed(4096).unwrap();
    stream
        .copy_d2d_async(
            &buf.slice(1..778).unwrap(),
            &mut other.slice_mut(3..780).unwrap(),
        )
        .unwrap();
    stream.synchronize().unwrap();
    assert_eq!(other.slice(3..780).unwrap().to_vec().unwrap(), piece);

    // Split views cover disjoint halves.
    let mut whole = other.as_slice_mut();
    let (mut left, mut right) = whole.reborrow().split_at_mut(100).unwrap();
    left.fill(1).unwrap();
    right.fill(2).unwrap();
    let host = other.to_vec().unwrap();
    assert!(host[..100].iter().all(|&b| b == 1) && host[100..].iter().all(|&b| b == 2));

    // Bad input is an error, never a panic.
    assert!(matches!(ctx.alloc(0), Err(GpuError::EmptyAllocation)));
    assert!(matches!(
        buf.slice(0..(1 << 20) + 1),
        Err(GpuError::OutOfBounds { .. })
    ));
    assert!(matches!(
        buf.slice_mut(0..10).unwrap().copy_from_host(&[0; 11]),
        Err(GpuError::LengthMismatch { .. })
    ));
    assert!(buf.copy_from_host(&vec![0; (1 << 20) + 1]).is_err());
}

#[test]
fn gpu_pinned_and_async_copies_on_several_streams() {
    let ctx = ctx_or_skip!("gpu_pinned_and_async_copies_on_several_streams");
    const STREAMS: usize = 4;
    const CHUNK: usize = 8 << 20;
    let total = STREAMS * CHUNK;
    let mut src = ctx.alloc_pinned(total).unwrap();
    assert!(src.as_slice().unwrap().iter().all(|&b| b == 0));
    let data = bytes(7, total);
    src.as_mut_slice().unwrap().copy_from_slice(&data);
    let mut dst = ctx.alloc_pinned(total).unwrap();
    let mut dev = ctx.alloc(total).unwrap();
    let streams: Vec<_> = (0..STREAMS).map(|_| ctx.new_stream().unwrap()).collect();

    let start = streams[0].record_event().unwrap();
    for (i, s) in streams.iter().enumerate() {
        let range = i * CHUNK..(i + 1) * CHUNK;
        s.copy_h2d_async(
            &src.slice(range.clone()).unwrap(),
            &mut dev.slice_mut(range.clone()).unwrap(),
        )
        .unwrap();
    }
    let h2d_done: Vec<_> = streams.iter().map(|s| s.record_event().unwrap()).collect();
    for e in &h2d_done {
        streams[0].wait_event(e).unwrap();
    }
    let end = streams[0].record_event().unwrap();
    for (i, s) in streams.iter().enumerate() {
        let range = i * CHUNK..(i + 1) * CHUNK;
        s.copy_d2h_async(
            &dev.slice(range.clone()).unwrap(),
            &mut dst.slice_mut(range).unwrap(),
        )
        .unwrap();
    }
    // as_slice waits for the pending device-to-host copies by itself.
    assert!(dst.as_slice().unwrap() == &data[..]);
    end.synchronize().unwrap();
    let ms = start.elapsed_ms(&end).unwrap();
    println!(
        "h2d of {} MiB from pinned memory on {STREAMS} streams: {ms:.3} ms ({:.1} GB/s)",
        total >> 20,
        total as f64 / (ms as f64 * 1e6)
    );
    assert!(end.is_complete().unwrap());
    for s in &streams {
        assert!({
            s.synchronize().unwrap();
            s.is_idle().unwrap()
        });
    }

    // Cross-stream ordering through an event: B reads what A wrote.
    let (a, b) = (&streams[1], &streams[2]);
    let mut scratch = ctx.alloc(CHUNK).unwrap();
    a.memset_async(&mut scratch.as_slice_mut(), 0x5A).unwrap();
    let written = a.record_event().unwrap();
    b.wait_event(&written).unwrap();
    b.copy_d2h_async(
        &scratch.slice(..CHUNK).unwrap(),
        &mut dst.slice_mut(..CHUNK).unwrap(),
    )
    .unwrap();
    assert!(dst.as_slice().unwrap()[..CHUNK].iter().all(|&x| x == 0x5A));

    // Dropping a buffer with work still queued waits for the work instead of freeing early.
    let mut big = ctx.alloc(256 << 20).unwrap();
    for _ in 0..8 {
        a.memset_async(&mut big.as_slice_mut(), 1).unwrap();
    }
    drop(big);
    // Host writes to pinned memory wait for the copy reading it.
    b.copy_h2d_async(
        &src.slice(..CHUNK).unwrap(),
        &mut dev.slice_mut(..CHUNK).unwrap(),
    )
    .unwrap();
    src.as_mut_slice().unwrap()[0] ^= 0xFF;
    b.synchronize().unwrap();
    assert_eq!(dev.slice(..1).unwrap().to_vec().unwrap()[0], data[0]);

    // Mismatched lengths are rejected.
    assert!(matches!(
        a.copy_h2d_async(&src.slice(..10).unwrap(), &mut dev.slice_mut(..11).unwrap()),
        Err(GpuError::LengthMismatch { .. })
    ));
    let no_timing = ctx.new_event(false).unwrap();
    a.record(&no_timing).unwrap();
    no_timing.synchronize().unwrap();
    assert!(matches!(
        no_timing.elapsed_ms(&end),
        Err(GpuError::EventTimingDisabled)
    ));
}

#[test]
fn gpu_pinned_chunks_split_one_mapped_allocation() {
    let ctx = ctx_or_skip!("gpu_pinned_chunks_split_one_mapped_allocation");
    let host = ctx.alloc_pinned_mapped(10_000).unwrap();
    let base = host.mapped_device_ptr().unwrap();
    let mut chunks = host.into_host().unwrap().into_chunks(4096).unwrap();
    assert_eq!(
        chunks
            .iter()
            .map(|c| (c.offset(), c.len()))
            .collect::<Vec<_>>(),
        [(0, 4096), (4096, 4096), (8192, 1808)]
    );
    for c in &chunks {
        assert_eq!(c.region_len(), 10_000);
        assert_eq!(c.mapped_device_ptr(), Some(base));
        assert!(c.same_region(&chunks[0]));
        assert!(c.as_slice().iter().all(|&b| b == 0), "not zeroed");
    }
    // Each part writes only its own bytes.
    for (k, c) in chunks.iter_mut().enumerate() {
        c.as_mut_slice().fill(k as u8 + 1);
    }
    for (k, c) in chunks.iter().enumerate() {
        assert!(c.as_slice().iter().all(|&b| b == k as u8 + 1));
    }
    // Another allocation is another region; plain pinned memory has no mapped address.
    let other = ctx.alloc_pinned(4096).unwrap().into_host().unwrap();
    let other = other.into_chunks(4096).unwrap();
    assert!(!other[0].same_region(&chunks[0]));
    assert_eq!(other[0].mapped_device_ptr(), None);
    assert!(matches!(
        ctx.alloc_pinned(16)
            .unwrap()
            .into_host()
            .unwrap()
            .into_chunks(0),
        Err(GpuError::EmptyAllocation)
    ));
    // The allocation lives until its last part goes.
    let last = chunks.pop().unwrap();
    drop(chunks);
    assert!(last.as_slice().iter().all(|&b| b == 3));
}

#[test]
fn gpu_stream_mark_passes_after_the_work_before_it() {
    let ctx = ctx_or_skip!("gpu_stream_mark_passes_after_the_work_before_it");
    let stream = ctx.new_stream().unwrap();
    let mut mark = ctx.new_mark().unwrap();
    // Nothing enqueued: nothing to wait for.
    assert!(mark.check().unwrap());
    mark.wait().unwrap();
    // A ticket behind milliseconds of memsets is not passed at once (the write waits for the
    // work in front of it), then is.
    let mut big = ctx.alloc(1 << 30).unwrap();
    for v in 1..=32u8 {
        stream.memset_async(&mut big.as_slice_mut(), v).unwrap();
    }
    let first = mark.enqueue(&stream).unwrap();
    assert!(
        !mark.passed(first),
        "the mark passed before the work in front of it"
    );
    let t = std::time::Instant::now();
    while !mark.passed(first) {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(20),
            "mark never passed"
        );
        std::hint::spin_loop();
    }
    assert!(mark.check().unwrap());
    // Tickets increase; each later one passes; the earlier ones stay passed.
    let second = mark.enqueue(&stream).unwrap();
    assert_eq!(second, first.wrapping_add(1));
    mark.wait().unwrap();
    assert!(mark.passed(second) && mark.passed(first));
    // Dropped with a write pending, the mark waits for its stream.
    for v in 1..=8u8 {
        stream.memset_async(&mut big.as_slice_mut(), v).unwrap();
    }
    mark.enqueue(&stream).unwrap();
    drop(mark);
    assert!(stream.is_idle().unwrap());
}

#[test]
fn gpu_dmabuf_export() {
    let ctx = ctx_or_skip!("gpu_dmabuf_export");
    let page = gpu::host_page_size();
    let buf = ctx.alloc_exportable((1 << 20) + 123).unwrap();
    assert_eq!(buf.len(), (1 << 20) + 123);
    assert_eq!(buf.capacity() as u64, gpu::EXPORTABLE_GRANULARITY);
    if !ctx.info().dma_buf_supported {
        assert!(matches!(
            buf.as_slice().export_dmabuf(),
            Err(GpuError::DmaBufUnsupported)
        ));
        println!(
            "SKIP gpu_dmabuf_export: skipped: device reports CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED=0"
        );
        return;
    }
    let whole = buf.as_slice().export_dmabuf().unwrap();
    assert!(whole.raw_fd() >= 0);
    assert_eq!(whole.offset(), 0);
    assert_eq!(whole.len(), (1 << 20) + 123);
    assert_eq!(whole.iova(), buf.device_ptr());
    assert_eq!(whole.mapped_len() % page, 0);
    let fdinfo = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", whole.raw_fd()))
        .unwrap_or_default();
    println!(
        "dma-buf fd {} for {:#x}+{}: mapped {:#x}+{}; fdinfo: {}",
        whole.raw_fd(),
        whole.iova(),
        whole.len(),
        whole.mapped_start(),
        whole.mapped_len(),
        fdinfo.split_whitespace().collect::<Vec<_>>().join(" ")
    );
    assert!(fdinfo.contains("exp_name"), "fd is not a dma-buf: {fdinfo}");

    // A slice at an unaligned offset: the page around it is exported, offset says where.
    let sub = buf.slice(5000..6000).unwrap().export_dmabuf().unwrap();
    assert_eq!(sub.offset(), 5000 % page);
    assert_eq!(sub.len(), 1000);
    assert_eq!(sub.iova(), buf.device_ptr() + 5000);
    assert_eq!(sub.mapped_start() % page, 0);
    assert!(sub.mapped_start() + sub.mapped_len() >= sub.iova() + 1000);

    // The dma-buf keeps the memory alive after the buffer is dropped.
    let fd = sub.raw_fd();
    drop(buf);
    let dup = sub.fd().try_clone_to_owned().unwrap();
    assert!(std::fs::metadata(format!("/proc/self/fd/{fd}")).is_ok());
    drop(dup);
    drop(whole);
    drop(sub);
}

#[test]
fn gpu_flush_gpudirect_rdma_writes() {
    let ctx = ctx_or_skip!("gpu_flush_gpudirect_rdma_writes");
    match ctx.flush_gpudirect_rdma_writes(FlushScope::ToOwner) {
        Ok(()) => {
            ctx.flush_gpudirect_rdma_writes(FlushScope::ToAllDevices)
                .unwrap();
            println!(
                "cuFlushGPUDirectRDMAWrites ok (options {:#x})",
                ctx.info().rdma_flush_options
            );
        }
        Err(GpuError::FlushUnsupported) => println!(
            "SKIP gpu_flush_gpudirect_rdma_writes: skipped: flush options {:#x} lack the host bit",
            ctx.info().rdma_flush_options
        ),
        Err(e) => panic!("flush failed: {e}"),
    }
}

const ADD_BYTES: &str = r#"
extern "C" __global__ void add_bytes(unsigned char* p, unsigned long long n, unsigned int v) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        p[i] = (unsigned char)(p[i] + v);
    }
}
"#;

fn run_add(ctx: &GpuContext, kernel: &gpu::Kernel, buf: &mut DeviceBuffer) {
    let stream = ctx.new_stream().unwrap();
    let mut view = buf.slice_mut(3..).unwrap();
    let mut args = LaunchArgs::new();
    args.buffer_mut(&mut view).u32(5);
    kernel
        .launch(&stream, &LaunchConfig::linear(4, 128), &args)
        .unwrap();
    stream.synchronize().unwrap();
}

#[test]
fn gpu_kernel_launch_bounded_abi() {
    let name = "gpu_kernel_launch_bounded_abi";
    let ctx = ctx_or_skip!(name);
    let module = match ctx.compile_module(ADD_BYTES, "add_bytes.cu") {
        Ok(m) => m,
        Err(e) if should_skip(name, &e) => return,
        Err(e) => panic!("{e}"),
    };
    let kernel = module.kernel("add_bytes").unwrap();
    let sizes: Vec<usize> = kernel.params().iter().map(|p| p.size).collect();
    assert_eq!(sizes, vec![8, 8, 4]);

    let data = bytes(3, 1000);
    let mut buf = ctx.alloc(1000).unwrap();
    buf.copy_from_host(&data).unwrap();
    run_add(&ctx, &kernel, &mut buf);
    let out = buf.to_vec().unwrap();
    assert_eq!(&out[..3], &data[..3]);
    for i in 3..1000 {
        assert_eq!(out[i], data[i].wrapping_add(5), "byte {i}");
    }

    // PTX through the driver's JIT must also load (PTX ISA of this NVRTC vs the driver).
    let arch = ctx.info().arch();
    let ptx = compile(ADD_BYTES, "add_bytes_ptx.cu", CodeTarget::Ptx { arch }, &[]).unwrap();
    println!(
        "default target {}, NVRTC {:?}, PTX ISA {:?}",
        ctx.default_code_target().unwrap(),
        ptx.nvrtc_version(),
        ptx.ptx().and_then(gpu::ptx_isa_version)
    );
    let ptx_kernel = ctx.load_module(&ptx).unwrap().kernel("add_bytes").unwrap();
    run_add(&ctx, &ptx_kernel, &mut buf);
    assert_eq!(
        buf.slice(3..4).unwrap().to_vec().unwrap()[0],
        data[3].wrapping_add(10)
    );

    // Argument layout and configuration are checked before launching.
    let stream = ctx.new_stream().unwrap();
    let mut view = buf.as_slice_mut();
    let mut short = LaunchArgs::new();
    short.buffer_mut(&mut view);
    assert!(matches!(
        kernel.launch(&stream, &LaunchConfig::linear(1, 32), &short),
        Err(GpuError::ParamCount {
            expected: 3,
            got: 2,
            ..
        })
    ));
    let mut wrong = LaunchArgs::new();
    wrong.u64(0).u64(0).u64(5);
    assert!(matches!(
        kernel.launch(&stream, &LaunchConfig::linear(1, 32), &wrong),
        Err(GpuError::ParamSize { index: 2, .. })
    ));
    let mut fine = LaunchArgs::new();
    fine.u64(0).u64(0).u32(5);
    assert!(matches!(
        kernel.launch(&stream, &LaunchConfig::linear(1, 4096), &fine),
        Err(GpuError::InvalidLaunch(_))
    ));
    assert!(matches!(
        module.kernel("missing"),
        Err(GpuError::Driver { .. })
    ));
    assert!(matches!(
        ctx.compile_module("this is not CUDA", "bad.cu"),
        Err(GpuError::Compile { .. })
    ));
}

#[test]
fn borrowed_device_memory() {
    let ctx = ctx_or_skip!("borrowed_device_memory");
    let mut owner = ctx.alloc_zeroed(1 << 20).expect("alloc");
    let base = owner.device_ptr();
    assert_eq!(gpu::device_of_pointer(base).expect("device"), ctx.ordinal());
    let host = [0u8; 64];
    assert!(matches!(
        gpu::device_of_pointer(host.as_ptr() as u64),
        Err(GpuError::NotDeviceMemory { .. })
    ));
    {
        // SAFETY: `owner` outlives the borrowed buffer and is not used meanwhile.
        let mut borrowed = unsafe { ctx.borrow_device_memory(base + 4096, 8192) }.expect("borrow");
        let data = bytes(7, 8192);
        borrowed.copy_from_host(&data).expect("copy");
        assert_eq!(borrowed.to_vec().expect("read back"), data);
    }
    // Dropping the borrowed buffer did not free the memory: the owner still reads it.
    let all = owner.to_vec().expect("owner reads");
    assert_eq!(&all[4096..12288], &bytes(7, 8192)[..]);
    assert!(all[..4096].iter().all(|&b| b == 0));
    // Past the end of the allocation, or not device memory: refused.
    // SAFETY: the calls fail before anything is borrowed.
    let past = unsafe { ctx.borrow_device_memory(base + (1 << 20) - 4096, 8192) };
    assert!(
        matches!(past, Err(GpuError::NotDeviceMemory { .. })),
        "{past:?}"
    );
    // SAFETY: as above.
    let host_mem = unsafe { ctx.borrow_device_memory(host.as_ptr() as u64, 64) };
    assert!(matches!(host_mem, Err(GpuError::NotDeviceMemory { .. })));
    // SAFETY: 1 is the legacy default stream.
    unsafe { ctx.synchronize_raw_stream(1) }.expect("legacy stream");
    owner.zero().expect("owner still usable");
}
