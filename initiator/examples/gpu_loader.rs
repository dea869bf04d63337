//! A data-loader-style benchmark: reads a namespace region into GPU memory over NVMe/TCP and,
//! in the same run, the same data from local memory (the direct-attached baseline: host RAM ->
//! pinned staging -> GPU) and over NVMe/TCP into host memory (no GPU: the ceiling of the
//! staging path), then verifies what landed with the verify kernel (on the CPU for host memory).
//!
//! ```text
//! cargo run --release -p nvmeof-initiator --example gpu_loader -- 127.0.0.1:4420 NQN \
//!     --queues 8 --threads 8 --tasks 32 --region-mib 4096 --seconds 4 --repeats 3
//! ```
//!
//! Workloads: `seq` (1 MiB sequential reads, `--span` of them per call, each task streaming
//! steps of `--step` such calls into its device ring, one synchronize per step) and `rand`
//! (4 KiB random reads, `--batch` per staging slot, `--slots-per-call` slots per call, `--lanes`
//! calls in flight per task, scattered to their sample offsets by the kernel). The region is
//! first written with the seeded pattern from GPU memory (the write path), unless `--no-fill`.
//! `initiator/examples/gpu-loader-bench.sh` runs it against `nvmeof-targetd` on loopback.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use nvmeof_initiator::gpu::cuda::GpuContext;
use nvmeof_initiator::gpu::kernels::pattern::{fill_pattern, verify_pattern};
use nvmeof_initiator::gpu::kernels::{NvmfKernels, PatternRegion, VerifyReport};
use nvmeof_initiator::gpu::{
    BlockSource, GpuIoError, GpuRead, GpuStaging, MemSource, StagingConfig, StagingStats,
};
use nvmeof_initiator::{
    ConnectOptions, Controller, HostIdentity, Namespace, TargetAddr, default_state_dir,
};

#[derive(Debug, Parser)]
#[command(about = "Reads a namespace region into GPU memory over NVMe/TCP, next to local memory")]
struct Args {
    /// Target address, ADDR:PORT.
    addr: String,
    /// Subsystem NQN.
    nqn: String,
    /// Namespace ID.
    #[arg(long, default_value_t = 1)]
    nsid: u32,
    /// I/O queues (TCP connections).
    #[arg(long, default_value_t = 8)]
    queues: u16,
    /// Queue depth per I/O queue.
    #[arg(long, default_value_t = 256)]
    queue_depth: u16,
    /// Loader tasks (each with its own stream and staging ring).
    #[arg(long, default_value_t = 32)]
    tasks: usize,
    /// Runtime worker threads (0: one per core).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Bytes of the namespace to use, in MiB.
    #[arg(long, default_value_t = 4096)]
    region_mib: u64,
    /// Seconds per measurement.
    #[arg(long, default_value_t = 4.0)]
    seconds: f64,
    /// Measurements per workload and path.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Reads per step of a seq task (one synchronize per step).
    #[arg(long, default_value_t = 8)]
    step: usize,
    /// MiB per seq read: consecutive 1 MiB chunks read with one call, so that many 1 MiB
    /// commands of a task are in flight together (a power of two; 1: one at a time).
    #[arg(long, default_value_t = 1)]
    span: usize,
    /// seq reads whole 1 MiB chunks in a scattered order (a fixed permutation of the region)
    /// instead of one after the other.
    #[arg(long)]
    scatter_seq: bool,
    /// 4 KiB reads per staging slot (rand).
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Staging slots filled per rand call.
    #[arg(long, default_value_t = 4)]
    slots_per_call: usize,
    /// Staging slots per task.
    #[arg(long, default_value_t = 4)]
    slots: usize,
    /// Independent call loops per rand task (each with its own staging and stream), joined
    /// in the task: while one call's last reads drain and its data is copied, the others'
    /// reads keep the queue busy (a loader prefetching its next batches).
    #[arg(long, default_value_t = 1)]
    lanes: usize,
    /// Workloads to run: seq, rand or both.
    #[arg(long, default_value = "seq,rand")]
    workloads: String,
    /// Paths to run: nvme (NVMe/TCP into GPU memory), das (local memory into GPU memory),
    /// host (NVMe/TCP into host memory, no GPU: the ceiling of the nvme path).
    #[arg(long, default_value = "nvme,das,host")]
    paths: String,
    /// Leave queue choice to the controller's per-thread policy instead of pinning task `t` to
    /// queue `t mod queues`.
    #[arg(long)]
    per_thread_queues: bool,
    /// Time the device work of every staging slot with events (adds driver calls).
    #[arg(long)]
    gpu_timing: bool,
    /// Do not write the pattern first (the region already holds it).
    #[arg(long)]
    no_fill: bool,
    /// Pattern seed.
    #[arg(long, default_value_t = 0x6c6f_6164_6572)]
    seed: u64,
    /// GPU ordinal.
    #[arg(long, default_value_t = 0)]
    gpu: usize,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

fn main() {
    let args = Args::parse();
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    rt.enable_all();
    if args.threads > 0 {
        rt.worker_threads(args.threads);
    }
    let result = match rt.build() {
        Ok(rt) => rt.block_on(run(args)),
        Err(e) => Err(e.into()),
    };
    if let Err(e) = result {
        eprintln!("gpu_loader: {e}");
        std::process::exit(1);
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Workload {
    Seq,
    Rand,
}

/// One measurement.
#[derive(Default)]
struct Sample {
    bytes: u64,
    ios: u64,
    wall: Duration,
    stats: StagingStats,
    verify: VerifyReport,
    verified_bytes: u64,
}

struct Shared {
    ctx: GpuContext,
    kernels: Arc<NvmfKernels>,
    args: Args,
    block_size: u32,
    region_blocks: u64,
}

async fn run(args: Args) -> Result<(), BoxError> {
    let host = HostIdentity::load_or_create(&default_state_dir())?;
    let mut opts = ConnectOptions::new(args.addr.parse::<TargetAddr>()?, args.nqn.clone(), host);
    opts.io_queues = Some(args.queues);
    opts.queue_depth = args.queue_depth;
    let ctrl = Controller::connect(opts).await?;
    let ns = ctrl.namespace(args.nsid).await?;
    let ctx = GpuContext::new(args.gpu)?;
    let kernels = Arc::new(NvmfKernels::load(&ctx)?);
    let bs = ns.block_size();
    let region = (args.region_mib << 20).min(ns.size_bytes()) / (1 << 20) * (1 << 20);
    if region < 64 << 20 {
        return Err(format!(
            "the region must hold at least 64 MiB, the namespace has {region} bytes"
        )
        .into());
    }
    println!(
        "gpu: {} (cc {}.{}, {:.0} GiB); target {} {} ns {}: {} MiB region of {} B blocks; {} queues x {}, {} tasks",
        ctx.name(),
        ctx.compute_capability().0,
        ctx.compute_capability().1,
        ctx.total_memory() as f64 / f64::from(1u32 << 30),
        args.addr,
        args.nqn,
        args.nsid,
        region >> 20,
        bs,
        ctrl.io_queue_count(),
        args.queue_depth,
        args.tasks
    );
    let shared = Arc::new(Shared {
        ctx,
        kernels,
        block_size: bs,
        region_blocks: region / u64::from(bs),
        args,
    });

    if !shared.args.no_fill {
        let t = Instant::now();
        fill_region(&shared, &ns, region).await?;
        let s = t.elapsed().as_secs_f64();
        println!(
            "fill: wrote {} MiB of pattern from GPU memory in {s:.2} s ({:.2} GB/s, device -> pinned -> NVMe/TCP)",
            region >> 20,
            region as f64 / s / 1e9
        );
    }
    // The direct-attached baseline: the same bytes in local memory.
    let t = Instant::now();
    let mut ram = vec![0u8; region as usize];
    let seed = shared.args.seed;
    std::thread::scope(|s| {
        let per = (region as usize / 16).max(1 << 20) / (1 << 20) * (1 << 20);
        for (i, chunk) in ram.chunks_mut(per).enumerate() {
            s.spawn(move || fill_pattern(seed, (i * per) as u64, chunk));
        }
    });
    let mem = Arc::new(MemSource::new(Arc::from(ram), bs)?);
    println!(
        "das: {} MiB pattern in local memory ({:.2} s)",
        region >> 20,
        t.elapsed().as_secs_f64()
    );

    let workloads: Vec<Workload> = shared
        .args
        .workloads
        .split(',')
        .map(|w| match w {
            "seq" => Ok(Workload::Seq),
            "rand" => Ok(Workload::Rand),
            o => Err(format!("unknown workload {o}")),
        })
        .collect::<Result<_, _>>()?;
    let paths: Vec<&str> = shared.args.paths.split(',').collect();
    let mut results: Vec<(Workload, &str, Vec<Sample>)> = Vec::new();
    for &w in &workloads {
        for &p in &paths {
            if !["nvme", "das", "host"].contains(&p) {
                return Err(format!("unknown path {p}").into());
            }
            results.push((w, p, Vec::new()));
        }
    }
    for rep in 0..shared.args.repeats {
        for (w, p, samples) in results.iter_mut() {
            let pin = !shared.args.per_thread_queues;
            let remote = |t: usize| Arc::new(if pin { ns.on_queue(t) } else { ns.clone() });
            let s = match *p {
                "nvme" => measure(&shared, *w, remote, false).await?,
                "host" => measure(&shared, *w, remote, true).await?,
                _ => measure(&shared, *w, |_| Arc::clone(&mem), false).await?,
            };
            print_sample(rep, *w, p, &s, shared.args.tasks, shared.args.gpu_timing);
            samples.push(s);
        }
    }
    print_summary(&results);
    let bad: u64 = results
        .iter()
        .flat_map(|r| r.2.iter())
        .map(|s| s.verify.mismatched_bytes)
        .sum();
    ctrl.disconnect().await?;
    if bad != 0 {
        return Err(format!("verification failed: {bad} wrong bytes in GPU memory").into());
    }
    Ok(())
}

/// Writes the pattern over the region from GPU memory: each task fills 16 MiB pieces on the
/// GPU and writes them through its staging ring.
async fn fill_region(shared: &Arc<Shared>, ns: &Namespace, region: u64) -> Result<(), BoxError> {
    let piece = 16u64 << 20;
    let next = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for t in 0..shared.args.tasks.min(16) {
        let (shared, next) = (Arc::clone(shared), Arc::clone(&next));
        let ns = ns.on_queue(t);
        tasks.push(tokio::spawn(async move {
            let mut st = GpuStaging::new(&shared.ctx, StagingConfig::default())?
                .with_kernels(Arc::clone(&shared.kernels))?;
            let mut dev = shared.ctx.alloc(piece as usize)?;
            let bs = u64::from(shared.block_size);
            loop {
                let off = next.fetch_add(piece, Ordering::Relaxed);
                if off >= region {
                    return Ok::<_, GpuIoError>(());
                }
                let len = piece.min(region - off);
                {
                    let (k, ws) = st.kernels().expect("kernels");
                    k.fill_pattern(
                        ws,
                        &mut dev.as_slice_mut(),
                        &[PatternRegion {
                            offset: 0,
                            ns_offset: off,
                            len,
                        }],
                        shared.args.seed,
                    )?;
                }
                // The write's device-to-host copies run on the same stream, after the fill.
                st.write(&ns, off / bs, &dev.slice(..len as usize)?).await?;
            }
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(())
}

/// Runs one workload on one source with all tasks for the configured time.
async fn measure<S: BlockSource + Send + 'static>(
    shared: &Arc<Shared>,
    w: Workload,
    src: impl Fn(usize) -> Arc<S>,
    host: bool,
) -> Result<Sample, BoxError> {
    let stop = Arc::new(AtomicBool::new(false));
    let cursor = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for t in 0..shared.args.tasks {
        let (shared, stop, cursor, src) = (
            Arc::clone(shared),
            Arc::clone(&stop),
            Arc::clone(&cursor),
            src(t),
        );
        tasks.push(tokio::spawn(async move {
            match (w, host) {
                (Workload::Seq, false) => seq_task(&shared, &*src, &stop, &cursor).await,
                (Workload::Rand, false) => {
                    lanes(&shared, t, |l| rand_task(&shared, &*src, l, &stop)).await
                }
                (Workload::Seq, true) => seq_host(&shared, &*src, &stop, &cursor).await,
                (Workload::Rand, true) => {
                    lanes(&shared, t, |l| rand_host(&shared, &*src, l, &stop)).await
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_secs_f64(shared.args.seconds)).await;
    stop.store(true, Ordering::Relaxed);
    let mut total = Sample::default();
    for t in tasks {
        total.merge(t.await??);
    }
    Ok(total)
}

impl Sample {
    /// Adds a sample of the same measurement run alongside (its wall time overlaps).
    fn merge(&mut self, s: Sample) {
        self.bytes += s.bytes;
        self.ios += s.ios;
        self.stats.merge(&s.stats);
        self.verify = self.verify.merge(s.verify);
        self.verified_bytes += s.verified_bytes;
        self.wall = self.wall.max(s.wall);
    }
}

/// Runs `--lanes` loops of a task side by side in the task; lane `l` of task `t` gets the
/// index `t * lanes + l` (its random stream).
async fn lanes<F, Fut>(shared: &Shared, task: usize, lane: F) -> Result<Sample, GpuIoError>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = Result<Sample, GpuIoError>>,
{
    let n = shared.args.lanes.max(1);
    let samples = futures_util::future::try_join_all((0..n).map(|l| lane(task * n + l))).await?;
    let mut total = Sample::default();
    for s in samples {
        total.merge(s);
    }
    Ok(total)
}

/// Task of the sequential workload: steps of `step` 1 MiB reads from a shared cursor into the
/// task's device ring, every read's copies enqueued as its data arrives, one wait per step.
async fn seq_task<S: BlockSource>(
    shared: &Shared,
    src: &S,
    stop: &AtomicBool,
    cursor: &AtomicU64,
) -> Result<Sample, GpuIoError> {
    let span = shared.args.span.max(1);
    let io = span << 20;
    let step = shared.args.step.max(1);
    let bs = u64::from(shared.block_size);
    let per_io = io as u64 / bs;
    let chunks = shared.region_blocks / per_io;
    let mut st = GpuStaging::new(
        &shared.ctx,
        StagingConfig {
            // One slot per command in flight, and as many again being copied.
            slots: shared.args.slots.max(2 * span),
            slot_bytes: 1 << 20,
            timing: shared.args.gpu_timing,
        },
    )?
    .with_kernels(Arc::clone(&shared.kernels))?;
    // An odd offset: destinations are not aligned.
    let mut dev = shared.ctx.alloc(step * io + 1)?;
    let mut regions = Vec::with_capacity(step);
    let (mut bytes, mut ios) = (0u64, 0u64);
    let mut source = Duration::ZERO;
    let start = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        regions.clear();
        let t = Instant::now();
        for i in 0..step {
            let lba = next_chunk(shared, cursor, chunks) * per_io;
            let off = 1 + i * io;
            let mut dest = st.dest(dev.slice_mut(off..off + io)?);
            src.read_blocks(lba, &mut dest).await?;
            regions.push(PatternRegion {
                offset: off as u64,
                ns_offset: lba * bs,
                len: io as u64,
            });
        }
        // Receive time (the staging cannot see read_blocks, so it is counted here).
        source += t.elapsed();
        st.synchronize().await?;
        bytes += (step * io) as u64;
        ios += (step * span) as u64;
    }
    let wall = start.elapsed();
    let (verify, verified_bytes) = verify(&mut st, &dev, &regions, shared.args.seed)?;
    let mut stats = st.take_stats();
    stats.source += source;
    Ok(Sample {
        bytes,
        ios,
        wall,
        stats,
        verify,
        verified_bytes,
    })
}

/// Task of the random workload: calls of `batch * slots_per_call` random 4 KiB reads, each
/// slot's reads in flight together, copied once and scattered to the sample's offsets.
async fn rand_task<S: BlockSource>(
    shared: &Shared,
    src: &S,
    task: usize,
    stop: &AtomicBool,
) -> Result<Sample, GpuIoError> {
    let io = 4096usize;
    let bs = u64::from(shared.block_size);
    let per_io = (io as u64 / bs).max(1);
    let chunks = shared.region_blocks / per_io;
    let n = shared.args.batch.max(1) * shared.args.slots_per_call.max(1);
    let mut st = GpuStaging::new(
        &shared.ctx,
        StagingConfig {
            slots: shared.args.slots,
            slot_bytes: shared.args.batch.max(1) * io,
            timing: shared.args.gpu_timing,
        },
    )?
    .with_kernels(Arc::clone(&shared.kernels))?;
    // Samples are laid out 4 KiB + 3 bytes apart: every destination is unaligned.
    let pitch = io + 3;
    let mut dev = shared.ctx.alloc(n * pitch)?;
    let mut reads = vec![
        GpuRead {
            lba: 0,
            blocks: (io as u64 / bs) as u32,
            dst_offset: 0,
        };
        n
    ];
    let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ (task as u64 + 1).wrapping_mul(0xD1B5_4A32_D192_ED03);
    let (mut bytes, mut ios) = (0u64, 0u64);
    let start = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        for (i, r) in reads.iter_mut().enumerate() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            r.lba = (x % chunks) * per_io;
            // Shuffled destinations: sample i of the call goes to slot (i * 7919) mod n.
            r.dst_offset = ((i * 7919) % n * pitch) as u64;
        }
        reads.sort_unstable_by_key(|r| r.dst_offset);
        st.read_batch(src, &reads, &mut dev.as_slice_mut()).await?;
        bytes += (n * io) as u64;
        ios += n as u64;
    }
    let wall = start.elapsed();
    let regions: Vec<_> = reads
        .iter()
        .map(|r| PatternRegion {
            offset: r.dst_offset,
            ns_offset: r.lba * bs,
            len: io as u64,
        })
        .collect();
    let (verify, verified_bytes) = verify(&mut st, &dev, &regions, shared.args.seed)?;
    Ok(Sample {
        bytes,
        ios,
        wall,
        stats: st.take_stats(),
        verify,
        verified_bytes,
    })
}

/// The next 1 MiB chunk of the seq workload: in order, or a fixed permutation of the chunks
/// with `--scatter-seq` (an odd multiplier permutes a power-of-two count).
fn next_chunk(shared: &Shared, cursor: &AtomicU64, chunks: u64) -> u64 {
    let c = cursor.fetch_add(1, Ordering::Relaxed) % chunks;
    if shared.args.scatter_seq && chunks.is_power_of_two() {
        c.wrapping_mul(0x9E37_79B9) & (chunks - 1)
    } else {
        c
    }
}

/// The sequential workload into host memory (no GPU): the ceiling of the staging path.
async fn seq_host<S: BlockSource>(
    shared: &Shared,
    src: &S,
    stop: &AtomicBool,
    cursor: &AtomicU64,
) -> Result<Sample, GpuIoError> {
    let span = shared.args.span.max(1);
    let io = span << 20;
    let bs = u64::from(shared.block_size);
    let per_io = io as u64 / bs;
    let chunks = shared.region_blocks / per_io;
    let mut buf = vec![0u8; io];
    let (mut bytes, mut ios, mut last) = (0u64, 0u64, None);
    let mut source = Duration::ZERO;
    let start = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        let lba = next_chunk(shared, cursor, chunks) * per_io;
        let t = Instant::now();
        src.read_blocks(lba, &mut buf[..]).await?;
        source += t.elapsed();
        last = Some(lba);
        bytes += io as u64;
        ios += span as u64;
    }
    host_sample(
        shared,
        bytes,
        ios,
        start.elapsed(),
        source,
        &buf,
        last.iter().map(|&l| (0, l)),
        io,
    )
}

/// The random workload into host memory (no GPU).
async fn rand_host<S: BlockSource>(
    shared: &Shared,
    src: &S,
    task: usize,
    stop: &AtomicBool,
) -> Result<Sample, GpuIoError> {
    let io = 4096usize;
    let bs = u64::from(shared.block_size);
    let per_io = (io as u64 / bs).max(1);
    let chunks = shared.region_blocks / per_io;
    let n = shared.args.batch.max(1);
    let mut buf = vec![0u8; n * io];
    let mut lbas = vec![0u64; n];
    let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ (task as u64 + 1).wrapping_mul(0xD1B5_4A32_D192_ED03);
    let (mut bytes, mut ios) = (0u64, 0u64);
    let mut source = Duration::ZERO;
    let start = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        for l in lbas.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *l = (x % chunks) * per_io;
        }
        let t = Instant::now();
        let mut reads: Vec<_> = lbas.iter().copied().zip(buf.chunks_mut(io)).collect();
        src.read_many(&mut reads).await?;
        source += t.elapsed();
        bytes += (n * io) as u64;
        ios += n as u64;
    }
    let last = lbas.iter().enumerate().map(|(i, &l)| (i * io, l));
    host_sample(shared, bytes, ios, start.elapsed(), source, &buf, last, io)
}

/// A sample of a host-memory task, with the last data checked on the CPU.
#[allow(clippy::too_many_arguments)]
fn host_sample(
    shared: &Shared,
    bytes: u64,
    ios: u64,
    wall: Duration,
    source: Duration,
    buf: &[u8],
    last: impl Iterator<Item = (usize, u64)>,
    io: usize,
) -> Result<Sample, GpuIoError> {
    let bs = u64::from(shared.block_size);
    let mut verify = VerifyReport::default();
    let mut verified_bytes = 0;
    for (off, lba) in last {
        verify = verify.merge(verify_pattern(
            shared.args.seed,
            lba * bs,
            &buf[off..off + io],
        ));
        verified_bytes += io as u64;
    }
    Ok(Sample {
        bytes,
        ios,
        wall,
        stats: StagingStats {
            source,
            ..StagingStats::default()
        },
        verify,
        verified_bytes,
    })
}

/// Checks the last data a task received, on the GPU.
fn verify(
    st: &mut GpuStaging,
    dev: &nvmeof_initiator::gpu::cuda::DeviceBuffer,
    regions: &[PatternRegion],
    seed: u64,
) -> Result<(VerifyReport, u64), GpuIoError> {
    let (k, ws) = st.kernels().expect("kernels");
    let report = k.verify_pattern(ws, &dev.as_slice(), regions, seed)?;
    Ok((report, regions.iter().map(|r| r.len).sum()))
}

fn name(w: Workload) -> &'static str {
    match w {
        Workload::Seq => "seq 1 MiB",
        Workload::Rand => "rand 4 KiB",
    }
}

fn print_sample(rep: usize, w: Workload, path: &str, s: &Sample, tasks: usize, timing: bool) {
    let secs = s.wall.as_secs_f64().max(1e-9);
    let busy = secs * tasks as f64;
    let pct = |d: Duration| 100.0 * d.as_secs_f64() / busy;
    let gpu_copy = if timing {
        format!("{:>5.1}% of the task time", pct(s.stats.gpu_copy))
    } else {
        "not timed (--gpu-timing)".to_string()
    };
    println!(
        "run {rep} {:<10} {:<4}: {:>7.2} GB/s {:>9.0} IOPS | per task: receive {:>4.1}% (of it staging memcpy {:>4.1}%), waiting for GPU {:>4.1}%, other {:>4.1}% | device copy+scatter busy {}, {} blocking slot waits | verify {} ({} MiB checked)",
        name(w),
        path,
        s.bytes as f64 / secs / 1e9,
        s.ios as f64 / secs,
        pct(s.stats.source),
        pct(s.stats.stage_copy),
        pct(s.stats.gpu_wait),
        (100.0 - pct(s.stats.source) - pct(s.stats.gpu_wait)).max(0.0),
        gpu_copy,
        s.stats.blocking_waits,
        if s.verify.is_ok() {
            "ok".to_string()
        } else {
            format!("FAILED {:?}", s.verify)
        },
        s.verified_bytes >> 20,
    );
}

fn median_spread(v: &mut [f64]) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let med = if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    };
    (med, v[0], v[n - 1])
}

fn print_summary(results: &[(Workload, &str, Vec<Sample>)]) {
    println!();
    println!(
        "{:<11} {:<5} {:>20} {:>24}",
        "workload", "path", "GB/s median (min-max)", "IOPS median (min-max)"
    );
    let mut medians = Vec::new();
    for (w, p, samples) in results {
        let secs = |s: &Sample| s.wall.as_secs_f64().max(1e-9);
        let mut gbs: Vec<f64> = samples
            .iter()
            .map(|s| s.bytes as f64 / secs(s) / 1e9)
            .collect();
        let mut iops: Vec<f64> = samples.iter().map(|s| s.ios as f64 / secs(s)).collect();
        let (g, g0, g1) = median_spread(&mut gbs);
        let (i, i0, i1) = median_spread(&mut iops);
        println!(
            "{:<11} {:<5} {:>7.2} ({:.2}-{:.2}) {:>9.0} ({:.0}-{:.0})",
            name(*w),
            p,
            g,
            g0,
            g1,
            i,
            i0,
            i1
        );
        medians.push((*w, *p, g));
    }
    for w in [Workload::Seq, Workload::Rand] {
        let get = |p: &str| medians.iter().find(|m| m.0 == w && m.1 == p).map(|m| m.2);
        if let (Some(n), Some(d)) = (get("nvme"), get("das")) {
            println!(
                "{:<11} nvme/das throughput ratio (medians): {:.2}",
                name(w),
                n / d
            );
        }
    }
}
