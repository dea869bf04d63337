//! GPU request rings on a real GPU: kernels of many warps issue reads through `nvmf_gpu.cuh`
//! while a host thread serves the rings (`HostRing`) from the seeded namespace pattern; the
//! kernels verify every byte on the GPU. Pull, push and device-data modes, 512 B and 4 KiB, per-thread and
//! warp-collective calls, enough reads to wrap every ring many times; bad requests get their
//! NVMe status, a ring nobody serves times out, a closed ring answers CLOSED.
//!
//! Each test prints `SKIP <name>: skipped: ...` and passes without a GPU or NVRTC (set
//! NVMEOF_GPU_REQUIRE=1 to make that a failure). Run on a GPU machine with
//! `cuda-kernels/run-gpu-tests.sh`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use gpu::test_support::should_skip;
use gpu::{CodeTarget, GpuContext, Kernel, LaunchArgs, LaunchConfig};
use gpu_ring::proto::status;
use gpu_ring::{DataMode, HostRing, NsBinding, Read, RingConfig, RingSet};
use nvmeof_cuda_kernels::pattern::fill_pattern;
use nvmeof_cuda_kernels::ring::{self, RingPush};
use nvmeof_cuda_kernels::{COMMON_CUH, KernelError};

const SEED: u64 = 0x5EED_0013;
const NS_BLOCKS: u64 = 1 << 20;
/// The host thread gives up (and closes its rings, so every kernel finishes) after this.
const SERVE_LIMIT: Duration = Duration::from_secs(20);
const WAIT_NS: u64 = 5_000_000_000;

const TEST_KERNELS: &str = r#"
#include "nvmf_gpu.cuh"

// result: u64 [0] wrong words, [1] failed reads, [2] a failed status, [3] verified reads.
extern "C" __global__ void ring_reader(
    const unsigned char* rings, unsigned long long rings_len,
    unsigned char* dst, unsigned long long dst_len,
    unsigned char* result, unsigned long long result_len,
    unsigned long long seed, unsigned int block_size, unsigned int nblocks,
    unsigned long long ns_blocks, unsigned int iterations, unsigned int use_warp,
    unsigned long long timeout_ns)
{
    if (rings_len < sizeof(struct nvmf_gpu_ring) || result_len < 32 || nblocks == 0) {
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
    for (unsigned int it = 0; it < iterations; ++it) {
        const unsigned long long lba = (nvmf_fmix64(seed ^ (tid * 1000003ULL + it)) % extents) * nblocks;
        const unsigned int st = use_warp
            ? nvmf_gpu_read_warp(r, 0, lba, nblocks, mine, bytes, timeout_ns)
            : nvmf_gpu_read(r, 0, lba, nblocks, mine, bytes, timeout_ns);
        if (st != 0) {
            atomicAdd(&res[1], 1ULL);
            atomicCAS(&res[2], 0ULL, (unsigned long long)st);
            continue;
        }
        const unsigned long long bad =
            nvmf_pattern_mismatches(mine, bytes, seed, lba * block_size);
        if (bad != 0) {
            atomicAdd(&res[0], bad);
        }
        atomicAdd(&res[3], 1ULL);
    }
}

// Stands in for the NIC of device data areas: writes the namespace pattern into device
// memory, one block of threads per item of (device address u64, namespace offset u64, bytes u64).
extern "C" __global__ void nic_fill(
    const unsigned char* items, unsigned long long items_len, unsigned long long seed)
{
    const unsigned long long* it = (const unsigned long long*)items;
    if ((blockIdx.x + 1) * 24ULL > items_len) {
        return;
    }
    unsigned long long* data = (unsigned long long*)it[3 * blockIdx.x];
    const unsigned long long off = it[3 * blockIdx.x + 1];
    const unsigned long long words = it[3 * blockIdx.x + 2] / 8;
    for (unsigned long long w = threadIdx.x; w < words; w += blockDim.x) {
        data[w] = nvmf_pattern_word(seed, off + 8 * w);
    }
}

// One read per thread from a table of (ns u32, nblocks u32, lba u64); statuses to out (u32).
extern "C" __global__ void ring_status(
    const unsigned char* rings, unsigned long long rings_len,
    const unsigned char* reqs, unsigned long long reqs_len,
    unsigned char* out, unsigned long long out_len,
    unsigned char* dst, unsigned long long dst_len,
    unsigned long long timeout_ns)
{
    const unsigned long long i = threadIdx.x;
    if (rings_len < sizeof(struct nvmf_gpu_ring) || (i + 1) * 16 > reqs_len ||
        (i + 1) * 4 > out_len || (i + 1) * 4096 > dst_len) {
        return;
    }
    const struct nvmf_gpu_ring* r = (const struct nvmf_gpu_ring*)rings;
    const unsigned int ns = ((const unsigned int*)reqs)[4 * i];
    const unsigned int nblocks = ((const unsigned int*)reqs)[4 * i + 1];
    const unsigned long long lba = ((const unsigned long long*)reqs)[2 * i + 1];
    ((unsigned int*)out)[i] = nvmf_gpu_read(r, ns, lba, nblocks, dst + 4096 * i, 4096, timeout_ns);
}
"#;

#[test]
fn nvrtc_compiles_ring_test_kernels() {
    let name = "nvrtc_compiles_ring_test_kernels";
    let source = format!("{COMMON_CUH}\n{TEST_KERNELS}");
    match ring::compile_with_ring_header(&source, "ring_test.cu", CodeTarget::Ptx { arch: 90 }, &[])
    {
        Ok(image) => assert!(image.ptx().unwrap().contains(".entry ring_reader(")),
        Err(KernelError::Gpu(e)) if should_skip(name, &e) => {}
        Err(e) => panic!("{name}: {e}"),
    }
}

struct Setup {
    ctx: GpuContext,
    reader: Kernel,
    status: Kernel,
    nic: Kernel,
    push: RingPush,
}

fn setup(name: &str) -> Option<Setup> {
    let ctx = match GpuContext::new(0) {
        Ok(ctx) => ctx,
        Err(e) if should_skip(name, &e) => return None,
        Err(e) => panic!("{name}: cannot open GPU 0: {e}"),
    };
    let skip = |e: &KernelError| matches!(e, KernelError::Gpu(g) if should_skip(name, g));
    let target = ctx.default_code_target().unwrap();
    let source = format!("{COMMON_CUH}\n{TEST_KERNELS}");
    let image = match ring::compile_with_ring_header(&source, "ring_test.cu", target, &[]) {
        Ok(i) => i,
        Err(e) if skip(&e) => return None,
        Err(e) => panic!("{name}: {e}"),
    };
    let module = ctx.load_module(&image).unwrap();
    let push = match RingPush::load(&ctx) {
        Ok(p) => p,
        Err(e) if skip(&e) => return None,
        Err(e) => panic!("{name}: {e}"),
    };
    Some(Setup {
        reader: module.kernel("ring_reader").unwrap(),
        status: module.kernel("ring_status").unwrap(),
        nic: module.kernel("nic_fill").unwrap(),
        push,
        ctx,
    })
}

fn namespace(block_size: u32) -> NsBinding {
    NsBinding {
        nsid: 1,
        block_size,
        blocks: NS_BLOCKS,
    }
}

/// Serves `rings` until `done` is set and nothing is in flight (or the time limit passes):
/// every valid read gets the namespace pattern, pushed through `push` in push mode, written
/// into the device data area by `nic` (standing in for the NIC) in device mode.
fn serve(
    rings: Vec<HostRing>,
    set: &RingSet,
    (push, nic): (&mut RingPush, &Kernel),
    ctx: &GpuContext,
    done: &AtomicBool,
) -> Vec<HostRing> {
    let mut rings = rings;
    let stream = ctx.new_stream().unwrap();
    let src = set.push_source().expect("a GPU ring set");
    let start = Instant::now();
    let mut reads: Vec<Read> = Vec::new();
    let mut items = Vec::new();
    let mut nic_items: Vec<u8> = Vec::new();
    let mut nic_buf = ctx.alloc_zeroed(64 * 24).unwrap();
    loop {
        let mut busy = false;
        for h in rings.iter_mut() {
            reads.clear();
            h.poll(64, &mut reads);
            busy |= !reads.is_empty();
            items.clear();
            nic_items.clear();
            for r in &reads {
                let bs = h.namespaces()[0].block_size;
                let off = r.lba * u64::from(bs);
                match h.mode() {
                    DataMode::Device => {
                        let area = h.device_data().expect("device data areas");
                        let addr = area.device_ptr() + h.data_offset(r.slot) as u64;
                        for w in [addr, off, r.bytes as u64] {
                            nic_items.extend_from_slice(&w.to_le_bytes());
                        }
                        continue;
                    }
                    DataMode::Pull | DataMode::Push => {
                        fill_pattern(SEED, off, &mut h.data_mut(r.slot)[..r.bytes])
                    }
                }
                match h.mode() {
                    DataMode::Push => items.extend(h.complete_push(r.slot, status::SUCCESS)),
                    _ => h.complete(r.slot, status::SUCCESS),
                }
            }
            if !items.is_empty() {
                push.push(&stream, &src, h.index(), &items).unwrap();
            }
            if !nic_items.is_empty() {
                // The "NIC" writes the data, its writes are flushed, then the words go out.
                let n = nic_items.len() / 24;
                nic_buf
                    .slice_mut(..nic_items.len())
                    .unwrap()
                    .copy_from_host(&nic_items)
                    .unwrap();
                {
                    let view = nic_buf.slice(..nic_items.len()).unwrap();
                    let mut args = LaunchArgs::new();
                    args.buffer(&view).u64(SEED);
                    nic.launch(&stream, &LaunchConfig::linear(n as u32, 128), &args)
                        .unwrap();
                }
                stream.synchronize().unwrap();
                match ctx.flush_gpudirect_rdma_writes(gpu::FlushScope::ToOwner) {
                    Ok(()) | Err(gpu::GpuError::FlushUnsupported) => {}
                    Err(e) => panic!("flush: {e}"),
                }
                for r in &reads {
                    h.complete(r.slot, status::SUCCESS);
                }
            }
        }
        if start.elapsed() > SERVE_LIMIT {
            println!("host: time limit reached, closing the rings");
            return Vec::new();
        }
        if !busy {
            if done.load(Ordering::Acquire) && rings.iter().all(|h| h.in_flight() == 0) {
                stream.synchronize().unwrap();
                return rings;
            }
            thread::yield_now();
        }
    }
}

struct ReaderRun {
    mode: DataMode,
    block_size: u32,
    nblocks: u32,
    use_warp: bool,
    /// Thread blocks, threads per block, reads per thread.
    shape: (u32, u32, u32),
}

/// Runs `ring_reader` over 4 rings of 64 slots while a host thread serves them; returns the
/// result counters and the rings' total completions.
fn run_reader(g: &mut Setup, run: &ReaderRun) -> ([u64; 4], u64) {
    let (blocks, threads, iterations) = run.shape;
    let cfg = RingConfig {
        slots: 64,
        slot_bytes: 4096,
        mode: run.mode,
    };
    let mut set = RingSet::new_gpu(&g.ctx, 4, cfg, &[namespace(run.block_size)]).unwrap();
    g.push.reserve(&set).unwrap();
    let rings = set.take_host_rings();
    let bytes = (run.block_size * run.nblocks) as usize;
    let mut dst = g
        .ctx
        .alloc_zeroed((blocks * threads) as usize * bytes)
        .unwrap();
    let mut result = g.ctx.alloc_zeroed(32).unwrap();
    let stream = g.ctx.new_stream().unwrap();
    let done = AtomicBool::new(false);
    let ctx = g.ctx.clone();
    let (push, nic, reader) = (&mut g.push, &g.nic, &g.reader);
    let served = thread::scope(|s| {
        let set = &set;
        let server = s.spawn(|| serve(rings, set, (push, nic), &ctx, &done));
        {
            let table = set.table_buffer().unwrap().as_slice();
            let mut dst_view = dst.as_slice_mut();
            let mut result_view = result.as_slice_mut();
            let mut args = LaunchArgs::new();
            args.buffer(&table)
                .buffer_mut(&mut dst_view)
                .buffer_mut(&mut result_view)
                .u64(SEED)
                .u32(run.block_size)
                .u32(run.nblocks)
                .u64(NS_BLOCKS)
                .u32(iterations)
                .u32(u32::from(run.use_warp))
                .u64(WAIT_NS);
            reader
                .launch(&stream, &LaunchConfig::linear(blocks, threads), &args)
                .unwrap();
        }
        stream.synchronize().unwrap();
        done.store(true, Ordering::Release);
        server.join().unwrap()
    });
    let raw = result.to_vec().unwrap();
    let mut counters = [0u64; 4];
    for (i, c) in counters.iter_mut().enumerate() {
        *c = u64::from_le_bytes(raw[8 * i..8 * i + 8].try_into().unwrap());
    }
    let completed = served.iter().map(|h| h.stats().completed).sum();
    assert_eq!(
        completed,
        u64::from(blocks * threads * iterations),
        "host completions (0 when it hit its time limit)"
    );
    (counters, completed)
}

fn check_reader(name: &str, mode: DataMode) {
    let Some(mut g) = setup(name) else { return };
    for (block_size, nblocks) in [(512u32, 1u32), (512, 8), (4096, 1)] {
        for use_warp in [false, true] {
            let run = ReaderRun {
                mode,
                block_size,
                nblocks,
                use_warp,
                shape: (32, 128, 8),
            };
            let start = Instant::now();
            let ([bad, failed, first_status, verified], completed) = run_reader(&mut g, &run);
            println!(
                "{name}: {mode:?} {} B ({nblocks} x {block_size}) warp={use_warp}: {verified} \
                 reads verified, {completed} completions over 4 rings of 64 slots, {:?}",
                block_size * nblocks,
                start.elapsed()
            );
            assert_eq!(failed, 0, "failed reads, e.g. status {first_status:#x}");
            assert_eq!(bad, 0, "wrong words");
            assert_eq!(verified, completed);
        }
    }
}

#[test]
fn gpu_ring_reads_pull() {
    check_reader("gpu_ring_reads_pull", DataMode::Pull);
}

#[test]
fn gpu_ring_reads_push() {
    check_reader("gpu_ring_reads_push", DataMode::Push);
}

/// Device data areas: a fill kernel on the host's stream stands in for the NIC that writes
/// each read into its slot in device memory; the host flushes and publishes the completion
/// words, and the readers copy from device memory.
#[test]
fn gpu_ring_reads_device_data() {
    check_reader("gpu_ring_reads_device_data", DataMode::Device);
}

/// One GPU thread reads one block after another through a ring a spinning host thread serves
/// at once from memory (no network): the ring's own round trip at queue depth 1 (submit, the
/// host sees the request, fills and completes it, the thread sees the completion, the data
/// reaches its buffer, the slot is released), printed per mode and size. Every read is
/// verified.
#[test]
fn gpu_ring_round_trip_of_one_thread() {
    let name = "gpu_ring_round_trip_of_one_thread";
    let Some(mut g) = setup(name) else { return };
    const READS: u32 = 4000;
    for mode in [DataMode::Pull, DataMode::Push] {
        for nblocks in [1u32, 8] {
            let run = ReaderRun {
                mode,
                block_size: 512,
                nblocks,
                use_warp: false,
                shape: (1, 1, READS),
            };
            let start = Instant::now();
            let ([bad, failed, first_status, verified], _) = run_reader(&mut g, &run);
            let elapsed = start.elapsed();
            assert_eq!(failed, 0, "failed reads, e.g. status {first_status:#x}");
            assert_eq!(bad, 0, "wrong words");
            assert_eq!(verified, u64::from(READS));
            println!(
                "{name}: {mode:?} {} B: {READS} reads one after another in {elapsed:?}, \
                 {:.1} us per read (ring set-up and kernel launch included)",
                512 * nblocks,
                elapsed.as_secs_f64() * 1e6 / f64::from(READS)
            );
        }
    }
}

fn status_reqs(reqs: &[(u32, u32, u64)]) -> Vec<u8> {
    let mut out = Vec::new();
    for &(ns, nblocks, lba) in reqs {
        out.extend_from_slice(&ns.to_le_bytes());
        out.extend_from_slice(&nblocks.to_le_bytes());
        out.extend_from_slice(&lba.to_le_bytes());
    }
    out
}

/// Runs `ring_status` with one thread per request; returns the statuses.
fn run_status(
    ctx: &GpuContext,
    kernel: &Kernel,
    set: &RingSet,
    reqs: &[(u32, u32, u64)],
    timeout_ns: u64,
) -> Vec<u32> {
    let encoded = status_reqs(reqs);
    let mut req_buf = ctx.alloc(encoded.len()).unwrap();
    req_buf.copy_from_host(&encoded).unwrap();
    let mut out = ctx.alloc_zeroed(4 * reqs.len()).unwrap();
    let mut dst = ctx.alloc_zeroed(4096 * reqs.len()).unwrap();
    let stream = ctx.new_stream().unwrap();
    {
        let table = set.table_buffer().unwrap().as_slice();
        let reqs_view = req_buf.as_slice();
        let mut out_view = out.as_slice_mut();
        let mut dst_view = dst.as_slice_mut();
        let mut args = LaunchArgs::new();
        args.buffer(&table)
            .buffer(&reqs_view)
            .buffer_mut(&mut out_view)
            .buffer_mut(&mut dst_view)
            .u64(timeout_ns);
        kernel
            .launch(&stream, &LaunchConfig::linear(1, reqs.len() as u32), &args)
            .unwrap();
    }
    stream.synchronize().unwrap();
    out.to_vec()
        .unwrap()
        .chunks(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

#[test]
fn gpu_ring_bad_requests_timeouts_and_close() {
    let name = "gpu_ring_bad_requests_timeouts_and_close";
    let Some(mut g) = setup(name) else { return };
    let cfg = RingConfig {
        slots: 32,
        slot_bytes: 4096,
        mode: DataMode::Pull,
    };
    let mut set = RingSet::new_gpu(&g.ctx, 1, cfg, &[namespace(512)]).unwrap();
    let rings = set.take_host_rings();
    let reqs = [
        (0, 8, 0),             // valid
        (3, 1, 0),             // namespace index not bound
        (0, 1, NS_BLOCKS),     // LBA out of range
        (0, 2, NS_BLOCKS - 1), // runs past the end
        (0, 9, 0),             // larger than a slot
        (0, 0, 0),             // zero blocks: cannot be encoded
        (0, 1, 1 << 48),       // LBA cannot be encoded
        (0, 1, 77),            // valid
    ];
    let want = [
        status::SUCCESS,
        status::INVALID_NAMESPACE,
        status::LBA_OUT_OF_RANGE,
        status::LBA_OUT_OF_RANGE,
        status::INVALID_FIELD,
        status::INVALID_FIELD,
        status::INVALID_FIELD,
        status::SUCCESS,
    ];
    let done = AtomicBool::new(false);
    let ctx = g.ctx.clone();
    let status_kernel = g.status.clone();
    let rings = thread::scope(|s| {
        let set_ref = &set;
        let (push, nic) = (&mut g.push, &g.nic);
        let server = s.spawn(|| serve(rings, set_ref, (push, nic), &ctx, &done));
        let got = run_status(&ctx, &status_kernel, set_ref, &reqs, WAIT_NS);
        done.store(true, Ordering::Release);
        let rings = server.join().unwrap();
        let got: Vec<u16> = got.iter().map(|&s| s as u16).collect();
        assert_eq!(got, want, "statuses");
        rings
    });
    let stats = rings[0].stats();
    assert_eq!((stats.invalid, stats.completed), (6, 2), "{stats:?}");
    // Nobody serves: the waiter's deadline passes.
    let start = Instant::now();
    let got = run_status(&ctx, &status_kernel, &set, &[(0, 1, 5)], 20_000_000);
    assert_eq!(got, [u32::from(status::TIMEOUT)]);
    println!("{name}: timeout after {:?}", start.elapsed());
    // The host closes the ring: a new read is answered CLOSED at once.
    drop(rings);
    let got = run_status(&ctx, &status_kernel, &set, &[(0, 1, 6)], WAIT_NS);
    assert_eq!(got, [u32::from(status::CLOSED)]);
}
