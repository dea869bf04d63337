//! Workers: each keeps `iodepth` I/Os in flight on one path and records what completes.
//!
//! A worker is one tokio task: `iodepth` slots, each a future that keeps one I/O in flight
//! with its own buffer, so its I/Os, buffers and histograms stay on one task, nothing is
//! allocated per I/O, and nothing is shared with other workers per I/O (progress counts are
//! published in batches). The run goes through phases set by the coordinator: ramp
//! (I/O runs, nothing is recorded), measure (completions are recorded), stop (no new I/O;
//! in-flight I/O is drained).

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use nvmeof_initiator::QueuePair;
use parking_lot::Mutex;

use crate::hist::LatencyHist;
use crate::path::IoPath;
use crate::pattern::Pattern;

/// Phase: warming up.
pub const PHASE_RAMP: u8 = 0;
/// Phase: measuring.
pub const PHASE_MEASURE: u8 = 1;
/// Phase: stopping.
pub const PHASE_STOP: u8 = 2;

/// I/Os a worker completes between two additions to [`Shared::ops`].
pub const PROGRESS_BATCH: u64 = 256;

/// State shared by the coordinator and the workers of one run.
#[derive(Debug)]
pub struct Shared {
    /// The current phase.
    pub phase: AtomicU8,
    /// I/Os completed while measuring, all workers (progress display; each worker adds its
    /// count every [`PROGRESS_BATCH`] I/Os, so workers do not share a cache line per I/O).
    pub ops: AtomicU64,
    /// Bytes completed while measuring, all workers (progress display, as `ops`).
    pub bytes: AtomicU64,
}

impl Default for Shared {
    fn default() -> Self {
        Shared {
            phase: AtomicU8::new(PHASE_RAMP),
            ops: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
        }
    }
}

/// What one worker does.
#[derive(Debug, Clone)]
pub struct WorkerSpec {
    /// Worker number.
    pub index: usize,
    /// Queues it submits to, in turn (one per I/O).
    pub queues: Vec<usize>,
    /// Block size in bytes.
    pub bs: u64,
    /// In-flight I/Os.
    pub iodepth: u32,
    /// Percent reads.
    pub read_percent: u8,
    /// Random (true) or sequential offsets.
    pub random: bool,
    /// Region per namespace in bytes (a multiple of `bs`).
    pub region: u64,
    /// Where its sequential cursor starts.
    pub seq_start: u64,
    /// Namespaces (indices 0..n): with several targets, those of every target (see
    /// [`crate::path::TcpPath`]), taken in turn.
    pub namespaces: usize,
    /// Check reads against the pattern.
    pub verify: bool,
    /// Seed of the offsets.
    pub rng_seed: u64,
    /// Bytes to complete while measuring, then stop (`None`: until the phase says stop).
    pub budget: Option<u64>,
    /// Drive run-to-completion queue pairs of its own (one per namespace and entry of
    /// `queues`, taken in turn) instead of the path's shared queues (`api = "rtc"`).
    pub rtc: bool,
    /// Reads chase pointers: each buffer's next read is at the offset its previous read's
    /// first word names ([`chase_offset`]), so every read waits for the data of the one before.
    pub chase: bool,
}

/// The offset a pointer chase reads next after a read whose first 8 bytes are `data`: the
/// same mix and modulo as the GPU-issued chase, in `bs` units of a `region` bytes long.
pub fn chase_offset(data: &[u8], region: u64, bs: u64) -> u64 {
    let mut w = [0u8; 8];
    let n = data.len().min(8);
    w[..n].copy_from_slice(&data[..n]);
    let slots = (region / bs.max(1)).max(1);
    nvmeof_initiator::gpu::kernels::pattern::fmix64(u64::from_le_bytes(w)) % slots * bs
}

/// Per-namespace results of one worker.
#[derive(Debug, Clone, Default)]
pub struct NsAcc {
    /// I/Os.
    pub ops: u64,
    /// Bytes.
    pub bytes: u64,
    /// Latency of every I/O on this namespace.
    pub hist: LatencyHist,
}

/// What a worker measured.
#[derive(Debug, Clone, Default)]
pub struct WorkerOutput {
    /// Reads completed while measuring.
    pub read_ops: u64,
    /// Bytes read while measuring.
    pub read_bytes: u64,
    /// Writes completed while measuring.
    pub write_ops: u64,
    /// Bytes written while measuring.
    pub write_bytes: u64,
    /// Read latency.
    pub read_hist: LatencyHist,
    /// Write latency.
    pub write_hist: LatencyHist,
    /// Per namespace.
    pub per_ns: Vec<NsAcc>,
    /// Reads checked against the pattern (every phase).
    pub verified_reads: u64,
    /// Reads that did not match the pattern.
    pub verify_errors: u64,
    /// The first mismatch.
    pub first_verify_error: Option<String>,
    /// Failed I/Os.
    pub io_errors: u64,
    /// The first failure.
    pub first_io_error: Option<String>,
}

impl WorkerOutput {
    /// A worker on one namespace records each latency once: its namespace's histogram is
    /// the reads' and the writes' together.
    fn one_namespace(mut self) -> Self {
        if let [n] = self.per_ns.as_mut_slice() {
            n.hist = self.read_hist.clone();
            n.hist.merge(&self.write_hist);
        }
        self
    }

    /// Adds another worker's results.
    pub fn merge(&mut self, o: &WorkerOutput) {
        self.read_ops += o.read_ops;
        self.read_bytes += o.read_bytes;
        self.write_ops += o.write_ops;
        self.write_bytes += o.write_bytes;
        self.read_hist.merge(&o.read_hist);
        self.write_hist.merge(&o.write_hist);
        if self.per_ns.len() < o.per_ns.len() {
            self.per_ns.resize_with(o.per_ns.len(), NsAcc::default);
        }
        for (a, b) in self.per_ns.iter_mut().zip(&o.per_ns) {
            a.ops += b.ops;
            a.bytes += b.bytes;
            a.hist.merge(&b.hist);
        }
        self.verified_reads += o.verified_reads;
        self.verify_errors += o.verify_errors;
        if self.first_verify_error.is_none() {
            self.first_verify_error = o.first_verify_error.clone();
        }
        self.io_errors += o.io_errors;
        if self.first_io_error.is_none() {
            self.first_io_error = o.first_io_error.clone();
        }
    }
}

/// xorshift64*: a small, fast generator for offsets and the read/write mix.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed` (any value).
    pub fn new(seed: u64) -> Self {
        let mut s = seed ^ 0x2545_F491_4F6C_DD1D;
        if s == 0 {
            s = 1;
        }
        Rng(s)
    }

    /// The next value.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A value in `0..n` (`n > 0`).
    #[inline]
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }
}

/// Chooses the next I/O of a worker.
#[derive(Debug, Clone)]
pub struct OffsetGen {
    rng: Rng,
    slots: u64,
    bs: u64,
    random: bool,
    cursor: u64,
    region: u64,
    next_ns: usize,
    namespaces: usize,
    read_percent: u8,
}

impl OffsetGen {
    /// The generator of `spec`.
    pub fn new(spec: &WorkerSpec) -> Self {
        OffsetGen {
            rng: Rng::new(spec.rng_seed),
            slots: (spec.region / spec.bs).max(1),
            bs: spec.bs,
            random: spec.random,
            cursor: spec.seq_start % spec.region.max(1) / spec.bs * spec.bs,
            region: spec.region,
            next_ns: spec.index % spec.namespaces.max(1),
            namespaces: spec.namespaces.max(1),
            read_percent: spec.read_percent,
        }
    }

    /// `(is_read, namespace index, byte offset)` of the next I/O.
    #[inline]
    pub fn next_io(&mut self) -> (bool, usize, u64) {
        let read = match self.read_percent {
            100 => true,
            0 => false,
            p => self.rng.below(100) < u64::from(p),
        };
        let ns = self.next_ns;
        self.next_ns += 1;
        if self.next_ns == self.namespaces {
            self.next_ns = 0;
        }
        let offset = if self.random {
            self.rng.below(self.slots) * self.bs
        } else {
            let o = self.cursor;
            self.cursor += self.bs;
            if self.cursor + self.bs > self.region {
                self.cursor = 0;
            }
            o
        };
        (read, ns, offset)
    }
}

/// Runs one worker until the phase is [`PHASE_STOP`] or its budget is spent.
pub async fn run<P: IoPath>(
    path: Arc<P>,
    spec: WorkerSpec,
    pattern: Arc<Pattern>,
    shared: Arc<Shared>,
) -> WorkerOutput {
    // The das mode has no initiator: it ignores `api`.
    if spec.rtc && path.queue_pair_namespace(0).is_some() {
        return run_rtc(path, spec, pattern, shared).await.one_namespace();
    }
    let out = WorkerOutput {
        per_ns: vec![NsAcc::default(); spec.namespaces],
        ..Default::default()
    };
    let queues = if spec.queues.is_empty() {
        vec![0]
    } else {
        spec.queues.clone()
    };
    let state = Mutex::new(Issuer {
        offsets: OffsetGen::new(&spec),
        issued_in_measure: 0,
        queues,
        next_queue: 0,
        out,
    });
    let w = Slots {
        path: &*path,
        spec: &spec,
        pattern: &pattern,
        shared: &shared,
        state: &state,
    };
    let bufs = path.alloc_set(spec.bs as usize, spec.iodepth as usize);
    crate::slots::join(bufs.into_iter().map(|buf| w.slot(buf))).await;
    state.into_inner().out.one_namespace()
}

/// What the I/O slots of a worker share: where the next I/O goes, and what completed.
struct Issuer {
    offsets: OffsetGen,
    issued_in_measure: u64,
    queues: Vec<usize>,
    next_queue: usize,
    out: WorkerOutput,
}

/// A worker's I/O slots: each keeps one I/O in flight with its own buffer, issuing the next
/// when one completes. The slots run as futures of the worker's task (nothing is allocated
/// per I/O); the lock on [`Issuer`] is never contended (the task polls one slot at a time).
struct Slots<'a, P> {
    path: &'a P,
    spec: &'a WorkerSpec,
    pattern: &'a Pattern,
    shared: &'a Shared,
    state: &'a Mutex<Issuer>,
}

impl<P: IoPath> Slots<'_, P> {
    async fn slot(&self, mut buf: P::Buf) {
        let spec = self.spec;
        // Pointer chase: the (namespace, offset) the previous read named for its successor.
        let mut chased: Option<(usize, u64)> = None;
        // The previous I/O, recorded under the same lock that picks the next one.
        let mut done = None;
        // When the previous read ended, if this slot went straight on to the next read: that
        // read's start. Below depth 2 every I/O reads the clock at both ends.
        let mut ended: Option<Instant> = None;
        loop {
            let phase = self.shared.phase.load(Ordering::Relaxed);
            let (read, ns, offset, queue) = {
                let mut s = self.state.lock();
                let s = &mut *s;
                if let Some((what, lat, r)) = done.take() {
                    complete(
                        &mut s.out,
                        spec,
                        self.pattern,
                        self.shared,
                        what,
                        lat,
                        r,
                        P::bytes(&buf),
                    );
                }
                if phase == PHASE_STOP
                    || s.out.io_errors > 0
                    || !take_budget(phase, spec, &mut s.issued_in_measure)
                {
                    return;
                }
                let (read, ns, offset) = match chased.take() {
                    Some((ns, offset)) => (true, ns, offset),
                    None => s.offsets.next_io(),
                };
                let queue = s.queues[s.next_queue];
                s.next_queue = (s.next_queue + 1) % s.queues.len();
                (read, ns, offset, queue)
            };
            if !read {
                self.pattern.fill(offset, P::bytes_mut(&mut buf));
            }
            let measured = phase == PHASE_MEASURE;
            // One clock reading per I/O at depth: between the previous read's end and this
            // read's start the slot only recorded it and picked this one (tens of
            // nanoseconds, counted in this read's latency). A write's fill, a verified read's
            // check or a turn given to the scheduler in between take a fresh reading.
            let start = match ended.take() {
                Some(t) if read => t,
                _ => Instant::now(),
            };
            let (r, b) = if read {
                self.path.read(queue, ns, offset, buf).await
            } else {
                self.path.write(queue, ns, offset, buf).await
            };
            buf = b;
            let end = Instant::now();
            let lat = end.duration_since(start).as_nanos() as u64;
            if spec.chase && read && r.is_ok() {
                chased = Some((ns, chase_offset(P::bytes(&buf), spec.region, spec.bs)));
            }
            done = Some(((read, ns, offset, measured), lat, r));
            // A path whose I/O completes at once (a memory backend) never returns Pending:
            // give the scheduler its turn now and then, so timers and other tasks keep running.
            let mut budget = std::pin::pin!(tokio::task::coop::consume_budget());
            let mut turned = false;
            std::future::poll_fn(|cx| {
                let p = budget.as_mut().poll(cx);
                turned |= p.is_pending();
                p
            })
            .await;
            if spec.iodepth > 1 && read && !spec.verify && !turned {
                ended = Some(end);
            }
        }
    }
}

/// Whether another I/O may be issued in `phase` (counting it against the budget).
fn take_budget(phase: u8, spec: &WorkerSpec, issued_in_measure: &mut u64) -> bool {
    if phase == PHASE_MEASURE
        && let Some(b) = spec.budget
    {
        if *issued_in_measure >= b {
            return false;
        }
        *issued_in_measure += spec.bs;
    }
    true
}

/// What an I/O in flight was: read, namespace index, offset, issued while measuring, and
/// when it was submitted.
type Issued = (bool, usize, u64, bool, Instant);

/// [`run`] over run-to-completion queue pairs: the worker owns one queue pair per namespace
/// and entry of its `queues` (the job's `queue_pairs` shared out among its workers, as the
/// async API's queues are), submits into its `iodepth` buffers, each I/O to a namespace's
/// next pair in turn, and reaps completions itself (no queue task).
async fn run_rtc<P: IoPath>(
    path: Arc<P>,
    spec: WorkerSpec,
    pattern: Arc<Pattern>,
    shared: Arc<Shared>,
) -> WorkerOutput {
    let mut out = WorkerOutput {
        per_ns: vec![NsAcc::default(); spec.namespaces],
        ..Default::default()
    };
    let fail = |out: &mut WorkerOutput, e: String| {
        out.io_errors += 1;
        out.first_io_error.get_or_insert(e);
    };
    // Namespace `ns`'s pairs are `qps[ns * per_ns..][..per_ns]`.
    let per_ns = spec.queues.len().max(1);
    let mut qps = Vec::with_capacity(spec.namespaces * per_ns);
    for ns in 0..spec.namespaces {
        let Some(n) = path.queue_pair_namespace(ns) else {
            fail(
                &mut out,
                "api = \"rtc\" needs a fabric mode (tcp, rdma)".into(),
            );
            return out;
        };
        for _ in 0..per_ns {
            match QueuePair::open(n).await {
                Ok(q) => qps.push(q),
                Err(e) => {
                    fail(&mut out, format!("cannot open a queue pair: {e}"));
                    return out;
                }
            }
        }
    }
    let block: Vec<u64> = path
        .geometry()
        .iter()
        .map(|g| u64::from(g.block_size))
        .collect();
    let mut offsets = OffsetGen::new(&spec);
    // A queue pair holds one command less than its queue size: a deeper job runs at its
    // queue pairs' depth, as the async API waits for a free slot.
    let pair_depth = qps.iter().map(QueuePair::depth).min().unwrap_or(1);
    let depth = (spec.iodepth as usize).min(pair_depth * per_ns);
    // Each namespace's pair for its next I/O.
    let mut turn = vec![0usize; spec.namespaces];
    // The pair waited on when none had anything (in turn, so that no pair waits behind another).
    let mut wait_next = 0usize;
    let mut free: Vec<Vec<u8>> = (0..depth).map(|_| vec![0u8; spec.bs as usize]).collect();
    let mut issued: Vec<Option<Issued>> = vec![None; depth];
    let mut free_ids: Vec<usize> = (0..depth).rev().collect();
    let mut done = Vec::with_capacity(depth);
    let mut issued_in_measure = 0u64;
    loop {
        let phase = shared.phase.load(Ordering::Relaxed);
        if phase != PHASE_STOP && out.io_errors == 0 {
            while let Some(id) = free_ids.pop() {
                if !take_budget(phase, &spec, &mut issued_in_measure) {
                    free_ids.push(id);
                    break;
                }
                let (read, ns, offset) = offsets.next_io();
                let mut buf = free.pop().unwrap_or_default();
                if !read {
                    pattern.fill(offset, &mut buf);
                }
                let lba = offset / block[ns];
                // One of the namespace's pairs has room: `depth` is at most their room together.
                let pairs = &mut qps[ns * per_ns..][..per_ns];
                let k = next_pair(&mut turn[ns], per_ns, |k| pairs[k].in_flight() < pair_depth);
                let qp = &mut pairs[k];
                let r = if read {
                    qp.read(lba, buf, id as u64)
                } else {
                    qp.write(lba, buf, id as u64)
                };
                if let Err(rej) = r {
                    fail(
                        &mut out,
                        format!("submit at offset {offset:#x}: {}", rej.error),
                    );
                    free.push(rej.buf);
                    free_ids.push(id);
                    break;
                }
                let measured = phase == PHASE_MEASURE;
                issued[id] = Some((read, ns, offset, measured, Instant::now()));
            }
        }
        if free_ids.len() == depth {
            // Nothing in flight: stopped, or the budget is spent.
            break;
        }
        if let [qp] = &mut qps[..] {
            qp.wait(&mut done, 1, Some(Duration::from_millis(100)))
                .await;
        } else {
            let got: usize = qps.iter_mut().map(|q| q.poll(&mut done)).sum();
            if got == 0 {
                let n = qps.len();
                let busy = (0..n)
                    .map(|i| (wait_next + i) % n)
                    .find(|&i| qps[i].in_flight() > 0);
                if let Some(i) = busy {
                    wait_next = (i + 1) % n;
                    qps[i]
                        .wait(&mut done, 1, Some(Duration::from_micros(200)))
                        .await;
                }
            }
        }
        for c in done.drain(..) {
            let id = c.user_data as usize;
            let Some((read, ns, offset, measured, start)) = issued[id].take() else {
                continue;
            };
            let lat = start.elapsed().as_nanos() as u64;
            let r = c.result.map_err(crate::path::PathError::from);
            complete(
                &mut out,
                &spec,
                &pattern,
                &shared,
                (read, ns, offset, measured),
                lat,
                r,
                &c.buf,
            );
            free.push(c.buf);
            free_ids.push(id);
        }
    }
    out
}

/// Of `n` queue pairs, the first from `turn` on (in turn, wrapping) that has room, or `turn`'s
/// own if none has; `turn` moves past the one chosen.
fn next_pair(turn: &mut usize, n: usize, has_room: impl Fn(usize) -> bool) -> usize {
    let n = n.max(1);
    let k = (0..n)
        .map(|i| (*turn + i) % n)
        .find(|&k| has_room(k))
        .unwrap_or(*turn % n);
    *turn = (k + 1) % n;
    k
}

#[allow(clippy::too_many_arguments)]
fn complete(
    out: &mut WorkerOutput,
    spec: &WorkerSpec,
    pattern: &Pattern,
    shared: &Shared,
    (read, ns, offset, measured): (bool, usize, u64, bool),
    lat_ns: u64,
    r: Result<(), crate::path::PathError>,
    data: &[u8],
) {
    if let Err(e) = r {
        out.io_errors += 1;
        if out.first_io_error.is_none() {
            out.first_io_error = Some(format!(
                "{} of {} bytes at ns index {ns} offset {offset:#x}: {e}",
                if read { "read" } else { "write" },
                spec.bs
            ));
        }
        return;
    }
    if read && spec.verify {
        out.verified_reads += 1;
        if let Err(m) = pattern.check(offset, data) {
            out.verify_errors += 1;
            if out.first_verify_error.is_none() {
                out.first_verify_error = Some(format!("ns index {ns}: {m}"));
            }
        }
    }
    // Counted: I/Os issued and completed while measuring (exact totals for `io_size` runs).
    if !measured || shared.phase.load(Ordering::Relaxed) != PHASE_MEASURE {
        return;
    }
    if read {
        out.read_ops += 1;
        out.read_bytes += spec.bs;
        out.read_hist.record(lat_ns);
    } else {
        out.write_ops += 1;
        out.write_bytes += spec.bs;
        out.write_hist.record(lat_ns);
    }
    let n = &mut out.per_ns[ns];
    n.ops += 1;
    n.bytes += spec.bs;
    if spec.namespaces > 1 {
        // One namespace's latency is the reads' and writes' together (`one_namespace`).
        n.hist.record(lat_ns);
    }
    if (out.read_ops + out.write_ops) % PROGRESS_BATCH == 0 {
        shared.ops.fetch_add(PROGRESS_BATCH, Ordering::Relaxed);
        shared
            .bytes
            .fetch_add(PROGRESS_BATCH * spec.bs, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(random: bool, read_percent: u8) -> WorkerSpec {
        WorkerSpec {
            index: 1,
            queues: vec![0],
            bs: 4096,
            iodepth: 4,
            read_percent,
            random,
            region: 4096 * 10,
            seq_start: 4096 * 8,
            namespaces: 3,
            verify: true,
            rng_seed: 42,
            budget: None,
            rtc: false,
            chase: false,
        }
    }

    #[test]
    fn random_offsets_stay_aligned_inside_the_region() {
        let mut g = OffsetGen::new(&spec(true, 100));
        let mut seen = [false; 10];
        for _ in 0..1000 {
            let (read, _, o) = g.next_io();
            assert!(read);
            assert_eq!(o % 4096, 0);
            assert!(o + 4096 <= 4096 * 10);
            seen[(o / 4096) as usize] = true;
        }
        assert!(seen.iter().all(|&s| s));
    }

    #[test]
    fn sequential_offsets_wrap_and_namespaces_rotate() {
        let mut g = OffsetGen::new(&spec(false, 0));
        let v: Vec<(bool, usize, u64)> = (0..4).map(|_| g.next_io()).collect();
        assert_eq!(
            v,
            vec![
                (false, 1, 4096 * 8),
                (false, 2, 4096 * 9),
                (false, 0, 0),
                (false, 1, 4096)
            ]
        );
    }

    #[test]
    fn mix_follows_rwmixread() {
        let mut g = OffsetGen::new(&spec(true, 70));
        let reads = (0..10_000).filter(|_| g.next_io().0).count();
        assert!((6500..7500).contains(&reads), "{reads}");
    }

    /// A path over a byte vector that can corrupt one byte of what it returns.
    struct FakePath {
        data: parking_lot::Mutex<Vec<u8>>,
        geo: Vec<crate::path::NsGeometry>,
        corrupt_at: Option<u64>,
        fail_reads: bool,
        /// Offsets read, in order.
        reads: parking_lot::Mutex<Vec<u64>>,
    }

    impl FakePath {
        fn new(bytes: u64, corrupt_at: Option<u64>, fail_reads: bool) -> Self {
            FakePath {
                data: parking_lot::Mutex::new(vec![0; bytes as usize]),
                geo: vec![crate::path::NsGeometry {
                    target: 0,
                    nsid: 1,
                    block_size: 512,
                    bytes,
                }],
                corrupt_at,
                fail_reads,
                reads: parking_lot::Mutex::new(Vec::new()),
            }
        }
    }

    impl IoPath for FakePath {
        type Buf = Vec<u8>;

        fn geometry(&self) -> &[crate::path::NsGeometry] {
            &self.geo
        }

        fn alloc(&self, len: usize) -> Vec<u8> {
            vec![0; len]
        }

        fn bytes(buf: &Vec<u8>) -> &[u8] {
            buf
        }

        fn bytes_mut(buf: &mut Vec<u8>) -> &mut [u8] {
            buf
        }

        async fn read(
            &self,
            _queue: usize,
            _ns: usize,
            offset: u64,
            mut buf: Vec<u8>,
        ) -> (Result<(), crate::path::PathError>, Vec<u8>) {
            if self.fail_reads {
                return (
                    Err(crate::path::PathError::Setup("injected failure".into())),
                    buf,
                );
            }
            self.reads.lock().push(offset);
            let o = offset as usize;
            let n = buf.len();
            buf.copy_from_slice(&self.data.lock()[o..o + n]);
            if let Some(c) = self.corrupt_at
                && (offset..offset + n as u64).contains(&c)
            {
                buf[(c - offset) as usize] ^= 1;
            }
            tokio::task::yield_now().await;
            (Ok(()), buf)
        }

        async fn write(
            &self,
            _queue: usize,
            _ns: usize,
            offset: u64,
            buf: Vec<u8>,
        ) -> (Result<(), crate::path::PathError>, Vec<u8>) {
            let o = offset as usize;
            self.data.lock()[o..o + buf.len()].copy_from_slice(&buf);
            (Ok(()), buf)
        }
    }

    fn run_fake(path: FakePath, read_percent: u8) -> WorkerOutput {
        run_fake_with(Arc::new(path), read_percent, |_| {})
    }

    fn run_fake_with(
        path: Arc<FakePath>,
        read_percent: u8,
        adjust: impl FnOnce(&mut WorkerSpec),
    ) -> WorkerOutput {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let pattern = Arc::new(Pattern::new(9));
        {
            let mut d = path.data.lock();
            pattern.fill(0, &mut d);
        }
        let shared = Arc::new(Shared::default());
        shared.phase.store(PHASE_MEASURE, Ordering::Relaxed);
        let spec = WorkerSpec {
            index: 0,
            queues: vec![0],
            bs: 4096,
            iodepth: 4,
            read_percent,
            random: false,
            region: 64 * 4096,
            seq_start: 0,
            namespaces: 1,
            verify: true,
            rng_seed: 1,
            budget: Some(256 * 4096),
            rtc: false,
            chase: false,
        };
        let mut spec = spec;
        adjust(&mut spec);
        rt.block_on(run(path, spec, pattern, shared))
    }

    #[test]
    fn a_chase_reads_where_the_previous_read_points() {
        let path = Arc::new(FakePath::new(64 * 4096, None, false));
        let out = run_fake_with(Arc::clone(&path), 100, |s| {
            s.chase = true;
            s.iodepth = 1;
        });
        assert_eq!(out.read_ops, 256);
        assert_eq!(out.verify_errors, 0);
        let reads = path.reads.lock().clone();
        let data = path.data.lock().clone();
        assert_eq!(reads.len(), 256);
        let mut distinct = reads.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert!(distinct.len() > 8, "the chase moves around: {distinct:?}");
        for pair in reads.windows(2) {
            let o = pair[0] as usize;
            assert_eq!(pair[1], chase_offset(&data[o..o + 4096], 64 * 4096, 4096));
        }
    }

    #[test]
    fn clean_data_verifies_and_corruption_is_caught() {
        let ok = run_fake(FakePath::new(64 * 4096, None, false), 100);
        assert_eq!(ok.read_ops, 256);
        assert_eq!(ok.verified_reads, 256);
        assert_eq!(ok.verify_errors, 0);
        assert_eq!(ok.read_hist.count(), 256);
        assert_eq!(ok.per_ns[0].ops, 256);
        // One flipped bit in block 5: every read of that block (4 passes) is an error.
        let bad = run_fake(FakePath::new(64 * 4096, Some(5 * 4096 + 100), false), 100);
        assert_eq!(bad.verify_errors, 4);
        let msg = bad.first_verify_error.unwrap();
        assert!(msg.contains("0x5060"), "{msg}");
        // Mixed reads and writes: writes carry the pattern, so reads still verify.
        let mixed = run_fake(FakePath::new(64 * 4096, None, false), 50);
        assert_eq!(mixed.read_ops + mixed.write_ops, 256);
        assert!(mixed.write_ops > 0 && mixed.read_ops > 0);
        assert_eq!(mixed.verify_errors, 0);
    }

    /// Each latency lands in its namespace's histogram: recorded there beside the read and
    /// write histograms with several namespaces, made of those two with one.
    #[test]
    fn every_latency_lands_in_its_namespace() {
        let one = run_fake(FakePath::new(64 * 4096, None, false), 50);
        assert_eq!(one.per_ns[0].hist.count(), 256);
        assert_eq!(
            one.read_hist.count() + one.write_hist.count(),
            one.per_ns[0].hist.count()
        );
        let two = run_fake_with(Arc::new(FakePath::new(64 * 4096, None, false)), 50, |s| {
            s.namespaces = 2;
        });
        assert_eq!(two.per_ns.len(), 2);
        for n in &two.per_ns {
            assert_eq!(n.hist.count(), n.ops);
            assert!(n.ops > 0);
        }
        assert_eq!(two.per_ns[0].ops + two.per_ns[1].ops, 256);
    }

    /// A queue-pair worker's I/Os to one namespace go to its pairs in turn, past a full one.
    #[test]
    fn queue_pairs_are_taken_in_turn_past_full_ones() {
        let mut turn = 0;
        let picks: Vec<usize> = (0..5).map(|_| next_pair(&mut turn, 3, |_| true)).collect();
        assert_eq!(picks, [0, 1, 2, 0, 1]);
        // Pair 2 is full: the turn skips it.
        assert_eq!(next_pair(&mut turn, 3, |k| k != 2), 0);
        assert_eq!(turn, 1);
        // None has room (not reached by the worker): the next in turn.
        assert_eq!(next_pair(&mut turn, 3, |_| false), 1);
        // One pair: always it.
        let mut t = 0;
        assert_eq!(next_pair(&mut t, 1, |_| true), 0);
        assert_eq!(next_pair(&mut t, 1, |_| false), 0);
    }

    #[test]
    fn io_errors_stop_the_worker_and_are_reported() {
        let out = run_fake(FakePath::new(64 * 4096, None, true), 100);
        assert!(out.io_errors >= 1);
        assert!(out.io_errors <= 4, "stopped after the first failures");
        assert!(out.first_io_error.unwrap().contains("injected failure"));
        assert_eq!(out.read_ops, 0);
    }

    #[test]
    fn rng_below_is_in_range() {
        let mut r = Rng::new(0);
        for n in [1u64, 2, 3, 1000, u64::MAX] {
            for _ in 0..100 {
                assert!(r.below(n) < n);
            }
        }
    }
}
