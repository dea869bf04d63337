//! Counting for operators: per-subsystem and per-namespace command counters, bytes, errors by
//! status, latency histograms, queue depth, controllers, connections, keep-alive expiries and
//! protocol errors, gathered into a [`MetricsSnapshot`] and served in the Prometheus text
//! format by [`serve`].
//!
//! The I/O path never takes a lock, allocates or touches a variable shared with another
//! connection to count. Every queue (connection) owns its cells ([`IoCell`] per namespace,
//! [`AdminCell`] on an admin queue); only the queue's own task writes them, with plain
//! relaxed loads and stores. The subsystem keeps a registry of the live cells
//! ([`SubsystemMetrics`]) that a scrape adds up; when a queue closes its cells are folded
//! into the subsystem's totals under the registry's lock, so no figure ever goes backwards.
//! Cells are made at Connect (and at the first command for a namespace added later).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use nvme_spec::Status;
use parking_lot::Mutex;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tracing::{debug, warn};

use crate::queue::IoOp;
use crate::target::Target;

/// Names of the I/O queue commands counted, in cell order ("fabrics": Fabrics commands such as
/// Disconnect; "other": any opcode the target does not implement).
pub const IO_OPS: [&str; 7] = [
    "read",
    "write",
    "flush",
    "write_zeroes",
    "dsm",
    "fabrics",
    "other",
];

/// Latency histogram buckets: bucket `k` holds latencies up to `2^(12 + k)` ns (4.096 µs up to
/// about 2.1 s); one more bucket holds the rest.
pub const LATENCY_BUCKETS: usize = 20;
const LATENCY_SHIFT: u32 = 12;

/// Distinct error statuses a cell keeps apart; further ones are counted together as
/// [`OTHER_STATUS`].
const ERROR_SLOTS: usize = 16;
/// The key of the error slot that counts statuses beyond [`ERROR_SLOTS`].
pub const OTHER_STATUS: u16 = 0xffff;

/// A counter written by one thread only: an increment is a relaxed load and store (no locked
/// instruction), readable from any thread.
#[derive(Default, Debug)]
struct Count(AtomicU64);

impl Count {
    #[inline]
    fn add(&self, n: u64) {
        self.0.store(
            self.0.load(Ordering::Relaxed).wrapping_add(n),
            Ordering::Relaxed,
        );
    }

    fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Error counts by status, in a fixed table written by one thread.
#[derive(Default, Debug)]
struct ErrorTable {
    /// Status key + 1 (0 = free), published before the slot's first count.
    keys: [AtomicU32; ERROR_SLOTS],
    counts: [Count; ERROR_SLOTS],
}

/// The key an error status is counted under: its type and code.
fn status_key(s: Status) -> u16 {
    (u16::from(s.sct) << 8) | u16::from(s.sc)
}

impl ErrorTable {
    fn add(&self, s: Status) {
        let want = u32::from(status_key(s)) + 1;
        for (i, k) in self.keys.iter().enumerate() {
            let key = k.load(Ordering::Relaxed);
            if key == want {
                self.counts[i].add(1);
                return;
            }
            if key == 0 {
                // The last slot is kept for the statuses that found no free slot.
                let want = if i == ERROR_SLOTS - 1 {
                    u32::from(OTHER_STATUS) + 1
                } else {
                    want
                };
                self.counts[i].add(1);
                k.store(want, Ordering::Release);
                return;
            }
        }
        self.counts[ERROR_SLOTS - 1].add(1);
    }

    fn add_to(&self, out: &mut BTreeMap<u16, u64>) {
        for (k, c) in self.keys.iter().zip(&self.counts) {
            match k.load(Ordering::Acquire) {
                0 => break,
                key => *out.entry((key - 1) as u16).or_default() += c.get(),
            }
        }
    }
}

/// The index of an I/O operation in [`IO_OPS`].
fn op_index(op: &IoOp) -> usize {
    match op {
        IoOp::Read { .. } => 0,
        IoOp::Write { .. } => 1,
        IoOp::Flush => 2,
        IoOp::WriteZeroes { .. } => 3,
        IoOp::Dsm { .. } => 4,
    }
}

/// The index in [`IO_OPS`] of an NVM command set opcode.
fn opcode_index(opcode: u8) -> usize {
    match opcode {
        0x02 => 0,
        0x01 => 1,
        0x00 => 2,
        0x08 => 3,
        0x09 => 4,
        nvme_spec::opcode::FABRICS => 5,
        _ => 6,
    }
}

/// The latency bucket of `ns` nanoseconds.
#[inline]
fn bucket(ns: u64) -> usize {
    let b = (64 - (ns.saturating_sub(1) >> LATENCY_SHIFT).leading_zeros()) as usize;
    b.min(LATENCY_BUCKETS)
}

/// Upper bound of latency bucket `k`, in seconds.
fn bucket_bound_s(k: usize) -> f64 {
    (1u64 << (LATENCY_SHIFT as usize + k)) as f64 * 1e-9
}

/// One queue's figures for one namespace (NSID 0: commands that named no namespace).
#[derive(Default, Debug)]
pub struct IoCell {
    commands: [Count; IO_OPS.len()],
    bytes_read: Count,
    bytes_written: Count,
    latency: [[Count; LATENCY_BUCKETS + 1]; IO_OPS.len()],
    latency_ns: [Count; IO_OPS.len()],
    errors: ErrorTable,
    /// Requests handed to a backend that waits, and those of them finished.
    started: Count,
    finished: Count,
}

impl IoCell {
    /// Counts a request that ran on the backend and took `ns` nanoseconds from its arrival.
    pub fn record(&self, op: &IoOp, status: Status, ns: u64) {
        let i = op_index(op);
        self.commands[i].add(1);
        self.latency[i][bucket(ns)].add(1);
        self.latency_ns[i].add(ns);
        if status.is_success() {
            match *op {
                IoOp::Read { len, .. } => self.bytes_read.add(len as u64),
                IoOp::Write { len, .. } => self.bytes_written.add(len as u64),
                _ => {}
            }
        } else {
            self.errors.add(status);
        }
    }

    /// Counts a command answered without running on a backend (it failed validation, the
    /// transport could not carry it, or there was nothing to do).
    pub fn record_answered(&self, opcode: u8, status: Status) {
        self.commands[opcode_index(opcode)].add(1);
        if !status.is_success() {
            self.errors.add(status);
        }
    }

    /// Notes a request handed to a backend that waits (it is in the queue depth until
    /// [`IoCell::record_finished`]).
    pub fn record_started(&self) {
        self.started.add(1);
    }

    /// Counts a request started by [`IoCell::record_started`] that finished.
    pub fn record_finished(&self, op: &IoOp, status: Status, arrived: Instant) {
        self.finished.add(1);
        self.record(op, status, arrived.elapsed().as_nanos() as u64);
    }

    fn add_to(&self, f: &mut IoFigures, live: bool) {
        for i in 0..IO_OPS.len() {
            f.commands[i] += self.commands[i].get();
            f.latency_ns[i] += self.latency_ns[i].get();
            for (b, c) in f.latency[i].iter_mut().zip(&self.latency[i]) {
                *b += c.get();
            }
        }
        f.bytes_read += self.bytes_read.get();
        f.bytes_written += self.bytes_written.get();
        self.errors.add_to(&mut f.errors);
        if live {
            f.queue_depth += self.started.get().saturating_sub(self.finished.get());
        }
    }
}

/// One admin queue's figures.
#[derive(Debug)]
pub struct AdminCell {
    commands: [Count; 256],
    errors: ErrorTable,
}

impl Default for AdminCell {
    fn default() -> Self {
        AdminCell {
            commands: std::array::from_fn(|_| Count::default()),
            errors: ErrorTable::default(),
        }
    }
}

impl AdminCell {
    /// Counts an admin (or fabrics) command and, unless None or successful, its status.
    pub fn record(&self, opcode: u8, status: Option<Status>) {
        self.commands[usize::from(opcode)].add(1);
        if let Some(s) = status.filter(|s| !s.is_success()) {
            self.errors.add(s);
        }
    }

    fn add_to(&self, f: &mut AdminFigures) {
        for (op, c) in self.commands.iter().enumerate() {
            let n = c.get();
            if n > 0 {
                *f.commands.entry(admin_opcode_name(op as u8)).or_default() += n;
            }
        }
        self.errors.add_to(&mut f.errors);
    }
}

/// The name of an admin opcode as a label value.
pub fn admin_opcode_name(opcode: u8) -> String {
    let name = match opcode {
        0x02 => "get_log_page",
        0x06 => "identify",
        0x08 => "abort",
        0x09 => "set_features",
        0x0a => "get_features",
        0x0c => "async_event_request",
        0x18 => "keep_alive",
        0x7f => "fabrics",
        _ => return format!("{opcode:#04x}"),
    };
    name.to_string()
}

/// Serializes per-operation figures as a map from the operation's name (see [`IO_OPS`]),
/// leaving out operations never seen.
fn by_op<S, T>(v: &[T; IO_OPS.len()], s: S) -> Result<S::Ok, S::Error>
where
    S: serde::Serializer,
    T: Serialize + Default + PartialEq,
{
    let zero = T::default();
    s.collect_map(IO_OPS.iter().zip(v).filter(|(_, x)| **x != zero))
}

/// Serializes error counts as a list of `{status, sct, sc, count}` with the status's name.
fn by_status<S: serde::Serializer>(v: &BTreeMap<u16, u64>, s: S) -> Result<S::Ok, S::Error> {
    #[derive(Serialize)]
    struct StatusCount {
        status: String,
        sct: String,
        sc: String,
        count: u64,
    }
    s.collect_seq(v.iter().map(|(k, n)| {
        let (status, sct, sc) = status_label(*k);
        StatusCount {
            status,
            sct,
            sc,
            count: *n,
        }
    }))
}

/// I/O figures of one namespace (summed over its queues). Serialized with per-operation
/// figures keyed by operation name and errors as a list with the status's name.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct IoFigures {
    /// Commands completed, by operation (in [`IO_OPS`] order).
    #[serde(serialize_with = "by_op")]
    pub commands: [u64; IO_OPS.len()],
    /// Bytes read by successful reads.
    pub bytes_read: u64,
    /// Bytes written by successful writes.
    pub bytes_written: u64,
    /// Latency histogram by operation: counts per bucket (see [`LATENCY_BUCKETS`]), the last
    /// one unbounded. Latency runs from the command's arrival to its completion.
    #[serde(serialize_with = "by_op")]
    pub latency: [[u64; LATENCY_BUCKETS + 1]; IO_OPS.len()],
    /// Sum of the latencies by operation, in nanoseconds.
    #[serde(serialize_with = "by_op")]
    pub latency_ns: [u64; IO_OPS.len()],
    /// Failed commands by status key (`sct << 8 | sc`, [`OTHER_STATUS`] for the rest).
    #[serde(serialize_with = "by_status")]
    pub errors: BTreeMap<u16, u64>,
    /// Requests running on a backend now.
    pub queue_depth: u64,
}

/// Admin figures of one subsystem.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct AdminFigures {
    /// Commands by opcode name.
    pub commands: BTreeMap<String, u64>,
    /// Failed commands by status key (`sct << 8 | sc`).
    #[serde(serialize_with = "by_status")]
    pub errors: BTreeMap<u16, u64>,
}

/// The figures of one subsystem.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct SubsystemFigures {
    /// Live controllers.
    pub controllers: u64,
    /// Controllers torn down because their keep-alive timer expired.
    pub keep_alive_expiries: u64,
    /// Admin queue figures.
    pub admin: AdminFigures,
    /// I/O figures by NSID (0: commands that named no namespace of the subsystem).
    pub namespaces: BTreeMap<u32, IoFigures>,
}

/// Everything the metrics endpoint serves, at one moment; also what a status report shows.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct MetricsSnapshot {
    /// Open connections (every transport, before and after Connect).
    pub connections: u64,
    /// The daemon-wide memory budget of the connections, in bytes.
    pub memory_budget_bytes: u64,
    /// What the connections hold of it now, in bytes.
    pub memory_in_use_bytes: u64,
    /// Protocol errors by transport: connections closed with a TermReq sent by the target.
    pub protocol_errors: BTreeMap<&'static str, u64>,
    /// TermReqs received from hosts, by transport.
    pub host_term_reqs: BTreeMap<&'static str, u64>,
    /// Fabrics Connects refused, by reason.
    pub connects_refused: BTreeMap<&'static str, u64>,
    /// Failed authentication transactions, by reason (the failure explanation sent, or a
    /// refusal: over a budget, the authentication threads busy).
    pub auth_failures: BTreeMap<&'static str, u64>,
    /// Log lines suppressed by the log limits, by event kind.
    pub log_lines_suppressed: BTreeMap<&'static str, u64>,
    /// Figures by subsystem NQN.
    pub subsystems: BTreeMap<String, SubsystemFigures>,
}

#[derive(Default)]
struct SubsystemRegistry {
    live_io: Vec<(u32, Arc<IoCell>)>,
    live_admin: Vec<Arc<AdminCell>>,
    closed_io: BTreeMap<u32, IoFigures>,
    closed_admin: AdminFigures,
}

/// A subsystem's registry of live queue cells and the totals of closed ones.
#[derive(Default)]
pub struct SubsystemMetrics {
    reg: Mutex<SubsystemRegistry>,
    keep_alive_expiries: AtomicU64,
}

impl SubsystemMetrics {
    /// Counts a keep-alive expiry.
    pub fn note_keep_alive_expiry(&self) {
        self.keep_alive_expiries.fetch_add(1, Ordering::Relaxed);
    }

    fn figures(&self, controllers: u64) -> SubsystemFigures {
        let reg = self.reg.lock();
        let mut f = SubsystemFigures {
            controllers,
            keep_alive_expiries: self.keep_alive_expiries.load(Ordering::Relaxed),
            admin: reg.closed_admin.clone(),
            namespaces: reg.closed_io.clone(),
        };
        for (nsid, c) in &reg.live_io {
            c.add_to(f.namespaces.entry(*nsid).or_default(), true);
        }
        for c in &reg.live_admin {
            c.add_to(&mut f.admin);
        }
        f
    }
}

/// A queue's cells: made at Connect, folded into the subsystem's totals when dropped.
pub struct QueueMetrics {
    subsystem: Arc<crate::subsystem::Subsystem>,
    /// By NSID, sorted (NSID 0 first).
    io: Vec<(u32, Arc<IoCell>)>,
    admin: Option<Arc<AdminCell>>,
}

impl QueueMetrics {
    /// Cells for a queue of `subsystem`: an admin cell for the admin queue (`qid` 0), a cell
    /// per namespace for an I/O queue.
    pub fn new(subsystem: Arc<crate::subsystem::Subsystem>, qid: u16) -> Self {
        let mut q = QueueMetrics {
            subsystem,
            io: Vec::new(),
            admin: None,
        };
        if qid == 0 {
            let cell = Arc::new(AdminCell::default());
            q.subsystem
                .metrics
                .reg
                .lock()
                .live_admin
                .push(Arc::clone(&cell));
            q.admin = Some(cell);
        } else {
            let nsids: Vec<u32> = q.subsystem.namespaces().keys().copied().collect();
            for nsid in std::iter::once(0).chain(nsids) {
                q.add_io_cell(nsid);
            }
        }
        q
    }

    fn add_io_cell(&mut self, nsid: u32) -> usize {
        let cell = Arc::new(IoCell::default());
        self.subsystem
            .metrics
            .reg
            .lock()
            .live_io
            .push((nsid, Arc::clone(&cell)));
        let at = self.io.partition_point(|(n, _)| *n < nsid);
        self.io.insert(at, (nsid, cell));
        at
    }

    /// The cell of namespace `nsid` (NSID 0's for one the subsystem does not have); None on
    /// an admin queue.
    #[inline]
    pub fn io(&mut self, nsid: u32) -> Option<&IoCell> {
        self.io_index(nsid).map(|at| &*self.io[at].1)
    }

    fn io_index(&mut self, nsid: u32) -> Option<usize> {
        if self.admin.is_some() {
            return None;
        }
        Some(match self.io.binary_search_by_key(&nsid, |(n, _)| *n) {
            Ok(at) => at,
            // A namespace that was added after the queue connected.
            Err(_) if self.subsystem.namespaces().contains_key(&nsid) => self.add_io_cell(nsid),
            Err(_) => 0,
        })
    }

    /// A shared handle to the cell of `nsid`, for a request that finishes later; None on an
    /// admin queue.
    pub fn io_handle(&mut self, nsid: u32) -> Option<Arc<IoCell>> {
        self.io_index(nsid).map(|at| Arc::clone(&self.io[at].1))
    }

    /// The admin cell (admin queues only).
    pub fn admin(&self) -> Option<&AdminCell> {
        self.admin.as_deref()
    }

    /// Counts a command the transport could not carry: on an I/O queue the command (it was
    /// not counted before) and its status, on the admin queue (where the command was counted
    /// at submission) the status.
    pub fn record_fault(&self, sqe: &nvme_spec::Sqe, status: Status) {
        if let Some(a) = &self.admin {
            a.errors.add(status);
            return;
        }
        let nsid = sqe.nsid.get();
        let at = self
            .io
            .binary_search_by_key(&nsid, |(n, _)| *n)
            .unwrap_or(0);
        if let Some((_, cell)) = self.io.get(at) {
            cell.record_answered(sqe.opcode, status);
        }
    }
}

impl Drop for QueueMetrics {
    fn drop(&mut self) {
        let mut reg = self.subsystem.metrics.reg.lock();
        let reg = &mut *reg;
        for (nsid, cell) in self.io.drain(..) {
            cell.add_to(reg.closed_io.entry(nsid).or_default(), false);
            reg.live_io.retain(|(_, c)| !Arc::ptr_eq(c, &cell));
        }
        if let Some(cell) = self.admin.take() {
            cell.add_to(&mut reg.closed_admin);
            reg.live_admin.retain(|c| !Arc::ptr_eq(c, &cell));
        }
    }
}

/// Target-wide counters (rare events only: never touched per I/O).
#[derive(Default)]
pub struct TargetMetrics {
    /// Connections closed for a protocol error, by transport (TCP, RDMA).
    protocol_errors: [AtomicU64; 2],
    /// TermReqs received from hosts, by transport.
    host_term_reqs: [AtomicU64; 2],
    /// Fabrics Connects refused, by reason.
    connects_refused: Mutex<BTreeMap<&'static str, u64>>,
    /// Failed authentications, by reason.
    auth_failures: Mutex<BTreeMap<&'static str, u64>>,
}

const TRANSPORTS: [&str; 2] = ["tcp", "rdma"];

fn transport_index(transport: &str) -> usize {
    usize::from(transport == "rdma")
}

impl TargetMetrics {
    /// Counts a connection closed for a protocol error on `transport` ("tcp" or "rdma").
    pub fn note_protocol_error(&self, transport: &str) {
        self.protocol_errors[transport_index(transport)].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a TermReq received from a host on `transport`.
    pub fn note_host_term_req(&self, transport: &str) {
        self.host_term_reqs[transport_index(transport)].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a Fabrics Connect refused for `reason` (a fixed label such as
    /// `unknown_subsystem`).
    pub fn note_connect_refused(&self, reason: &'static str) {
        *self.connects_refused.lock().entry(reason).or_default() += 1;
    }

    /// Counts a failed authentication transaction for `reason` (a fixed label).
    pub fn note_auth_failure(&self, reason: &'static str) {
        *self.auth_failures.lock().entry(reason).or_default() += 1;
    }
}

impl Target {
    /// The target's figures now (a scrape adds up every live queue's cells).
    pub fn metrics_snapshot(&self) -> MetricsSnapshot {
        let per_transport = |a: &[AtomicU64; 2]| {
            TRANSPORTS
                .iter()
                .zip(a)
                .map(|(t, n)| (*t, n.load(Ordering::Relaxed)))
                .collect()
        };
        MetricsSnapshot {
            connections: self.connection_count() as u64,
            memory_budget_bytes: self.memory.limit(),
            memory_in_use_bytes: self.memory.in_use(),
            protocol_errors: per_transport(&self.metrics.protocol_errors),
            host_term_reqs: per_transport(&self.metrics.host_term_reqs),
            connects_refused: self.metrics.connects_refused.lock().clone(),
            auth_failures: self.metrics.auth_failures.lock().clone(),
            log_lines_suppressed: crate::ratelimit::LOG_LIMITS
                .suppressed()
                .into_iter()
                .map(|(k, n)| (k.name(), n))
                .collect(),
            subsystems: self
                .subsystems()
                .iter()
                .map(|(nqn, s)| {
                    let f = s.metrics.figures(s.controller_count() as u64);
                    (nqn.clone(), f)
                })
                .collect(),
        }
    }
}

/// The readable label of an error status key.
pub fn status_label(key: u16) -> (String, String, String) {
    if key == OTHER_STATUS {
        return ("other".into(), String::new(), String::new());
    }
    let s = Status {
        sct: (key >> 8) as u8,
        sc: key as u8,
        dnr: false,
        more: false,
    };
    (
        s.name().to_string(),
        format!("{:#x}", s.sct),
        format!("{:#04x}", s.sc),
    )
}

/// Serves a [`MetricsSnapshot`] to `prometheus_client`'s encoder at every scrape.
struct TargetCollector(Arc<Target>);

impl std::fmt::Debug for TargetCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TargetCollector")
    }
}

type Labels = Vec<(&'static str, String)>;

/// Writes one metric family: `samples` are (labels, value).
fn family<M: EncodeMetric>(
    enc: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    kind: MetricType,
    samples: impl IntoIterator<Item = (Labels, M)>,
) -> Result<(), std::fmt::Error> {
    let mut m = enc.encode_descriptor(name, help, None, kind)?;
    for (labels, v) in samples {
        v.encode(m.encode_family(&labels)?)?;
    }
    Ok(())
}

fn counter(v: u64) -> ConstCounter<u64> {
    ConstCounter::new(v)
}

fn gauge(v: u64) -> ConstGauge<i64> {
    ConstGauge::new(i64::try_from(v).unwrap_or(i64::MAX))
}

fn error_samples<'a>(
    base: &'a Labels,
    errors: &'a BTreeMap<u16, u64>,
) -> impl Iterator<Item = (Labels, ConstCounter<u64>)> + 'a {
    errors.iter().map(move |(k, n)| {
        let (name, sct, sc) = status_label(*k);
        let mut l = base.clone();
        l.extend([("status", name), ("sct", sct), ("sc", sc)]);
        (l, counter(*n))
    })
}

impl Collector for TargetCollector {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let snap = self.0.metrics_snapshot();
        let e = &mut enc;
        family(
            e,
            "nvmeof_connections",
            "Open connections (every transport, before and after Connect).",
            MetricType::Gauge,
            [(Labels::new(), gauge(snap.connections))],
        )?;
        family(
            e,
            "nvmeof_memory_budget_bytes",
            "The memory all connections together may hold in send backlogs, receive buffers and data buffers.",
            MetricType::Gauge,
            [(Labels::new(), gauge(snap.memory_budget_bytes))],
        )?;
        family(
            e,
            "nvmeof_memory_in_use_bytes",
            "What the connections hold of the memory budget now.",
            MetricType::Gauge,
            [(Labels::new(), gauge(snap.memory_in_use_bytes))],
        )?;
        let per_transport = |m: &BTreeMap<&'static str, u64>| -> Vec<(Labels, ConstCounter<u64>)> {
            m.iter()
                .map(|(t, n)| (vec![("transport", t.to_string())], counter(*n)))
                .collect()
        };
        family(
            e,
            "nvmeof_protocol_errors",
            "Connections closed for a transport protocol violation by the host (a TermReq was sent).",
            MetricType::Counter,
            per_transport(&snap.protocol_errors),
        )?;
        family(
            e,
            "nvmeof_host_term_reqs",
            "TermReqs received from hosts.",
            MetricType::Counter,
            per_transport(&snap.host_term_reqs),
        )?;
        let by = |label: &'static str, m: &BTreeMap<&'static str, u64>| {
            m.iter()
                .map(|(r, n)| (vec![(label, r.to_string())], counter(*n)))
                .collect::<Vec<(Labels, ConstCounter<u64>)>>()
        };
        family(
            e,
            "nvmeof_connects_refused",
            "Fabrics Connects refused, by reason.",
            MetricType::Counter,
            by("reason", &snap.connects_refused),
        )?;
        family(
            e,
            "nvmeof_auth_failures",
            "Failed DH-HMAC-CHAP transactions, by reason (the failure explanation, or a refusal over a budget or with the authentication threads busy).",
            MetricType::Counter,
            by("reason", &snap.auth_failures),
        )?;
        family(
            e,
            "nvmeof_log_lines_suppressed",
            "Log lines of per-connection events suppressed by the log limits, by event kind.",
            MetricType::Counter,
            by("event", &snap.log_lines_suppressed),
        )?;
        process_families(e)?;
        let subs = || snap.subsystems.iter();
        let sub_label = |nqn: &String| vec![("subsystem", nqn.clone())];
        family(
            e,
            "nvmeof_controllers",
            "Live controllers.",
            MetricType::Gauge,
            subs().map(|(n, s)| (sub_label(n), gauge(s.controllers))),
        )?;
        family(
            e,
            "nvmeof_keep_alive_expiries",
            "Controllers torn down because their keep-alive timer expired.",
            MetricType::Counter,
            subs().map(|(n, s)| (sub_label(n), counter(s.keep_alive_expiries))),
        )?;
        family(
            e,
            "nvmeof_admin_commands",
            "Admin and fabrics commands on admin queues, by opcode.",
            MetricType::Counter,
            subs().flat_map(|(n, s)| {
                s.admin.commands.iter().map(move |(op, c)| {
                    let mut l = sub_label(n);
                    l.push(("opcode", op.clone()));
                    (l, counter(*c))
                })
            }),
        )?;
        let admin_errors: Vec<_> = subs()
            .flat_map(|(n, s)| {
                let base = sub_label(n);
                error_samples(&base, &s.admin.errors).collect::<Vec<_>>()
            })
            .collect();
        family(
            e,
            "nvmeof_admin_errors",
            "Failed admin commands, by status.",
            MetricType::Counter,
            admin_errors,
        )?;
        let namespaces = || {
            subs().flat_map(|(n, s)| {
                s.namespaces.iter().map(move |(nsid, f)| {
                    (
                        vec![("subsystem", n.clone()), ("nsid", nsid.to_string())],
                        f,
                    )
                })
            })
        };
        let per_op = |get: fn(&IoFigures, usize) -> u64| {
            namespaces()
                .flat_map(move |(base, f)| {
                    IO_OPS.iter().enumerate().filter_map(move |(i, op)| {
                        let v = get(f, i);
                        let mut l = base.clone();
                        l.push(("opcode", op.to_string()));
                        (f.commands[i] > 0).then(|| (l, counter(v)))
                    })
                })
                .collect::<Vec<_>>()
        };
        family(
            e,
            "nvmeof_io_commands",
            "I/O commands completed, by namespace (nsid 0: commands naming no namespace) and opcode.",
            MetricType::Counter,
            per_op(|f, i| f.commands[i]),
        )?;
        family(
            e,
            "nvmeof_io_bytes",
            "Bytes moved by successful reads and writes, by namespace.",
            MetricType::Counter,
            namespaces().flat_map(|(base, f)| {
                [("read", f.bytes_read), ("write", f.bytes_written)]
                    .into_iter()
                    .map(move |(dir, v)| {
                        let mut l = base.clone();
                        l.push(("direction", dir.to_string()));
                        (l, counter(v))
                    })
            }),
        )?;
        let io_errors: Vec<_> = namespaces()
            .flat_map(|(base, f)| error_samples(&base, &f.errors).collect::<Vec<_>>())
            .collect();
        family(
            e,
            "nvmeof_io_errors",
            "Failed I/O commands, by namespace and status.",
            MetricType::Counter,
            io_errors,
        )?;
        family(
            e,
            "nvmeof_io_queue_depth",
            "I/O requests running on a backend now, by namespace.",
            MetricType::Gauge,
            namespaces().map(|(base, f)| (base, gauge(f.queue_depth))),
        )?;
        let mut m = e.encode_descriptor(
            "nvmeof_io_latency_seconds",
            "Time from an I/O command's arrival to its completion, for commands that ran, by namespace and opcode.",
            None,
            MetricType::Histogram,
        )?;
        for (base, f) in namespaces() {
            for (i, op) in IO_OPS.iter().enumerate() {
                let count: u64 = f.latency[i].iter().sum();
                if count == 0 {
                    continue;
                }
                // Counts per bucket (the encoder accumulates them); f64::MAX is its +Inf.
                let buckets: Vec<(f64, u64)> = f.latency[i]
                    .iter()
                    .enumerate()
                    .map(|(k, n)| {
                        let bound = if k == LATENCY_BUCKETS {
                            f64::MAX
                        } else {
                            bucket_bound_s(k)
                        };
                        (bound, *n)
                    })
                    .collect();
                let mut l = base.clone();
                l.push(("opcode", op.to_string()));
                let sum = Duration::from_nanos(f.latency_ns[i]).as_secs_f64();
                m.encode_family(&l)?
                    .encode_histogram::<Labels>(sum, count, &buckets, None)?;
            }
        }
        Ok(())
    }
}

/// Clock ticks per second of `/proc` CPU times (`USER_HZ`, 100 on every Linux platform).
const USER_HZ: f64 = 100.0;

/// The standard `process_*` figures of this process, read from `/proc`: CPU seconds, start
/// time, resident and virtual memory, open and maximum file descriptors.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ProcessFigures {
    /// User and system CPU time, in seconds.
    pub cpu_seconds: f64,
    /// Start time, in seconds since the Unix epoch.
    pub start_time_seconds: f64,
    /// Resident set size, in bytes.
    pub resident_memory_bytes: u64,
    /// Virtual memory size, in bytes.
    pub virtual_memory_bytes: u64,
    /// Open file descriptors.
    pub open_fds: u64,
    /// The open-files limit (soft).
    pub max_fds: u64,
}

impl ProcessFigures {
    /// This process's figures now; `None` where `/proc` cannot be read.
    pub fn read() -> Option<Self> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        // Fields after the command name, which is in parentheses and may hold spaces.
        let rest = &stat[stat.rfind(')')? + 2..];
        let f: Vec<&str> = rest.split_whitespace().collect();
        // Field n of proc(5) is f[n - 3].
        let num = |n: usize| f.get(n - 3).and_then(|v| v.parse::<u64>().ok());
        let ticks = num(14)? + num(15)?;
        let btime = std::fs::read_to_string("/proc/stat")
            .ok()?
            .lines()
            .find_map(|l| l.strip_prefix("btime ")?.trim().parse::<u64>().ok())?;
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        let kib = |key: &str| {
            status.lines().find_map(|l| {
                let v = l.strip_prefix(key)?.trim().strip_suffix("kB")?;
                v.trim().parse::<u64>().ok()
            })
        };
        let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
        let max_fds = limits.lines().find_map(|l| {
            let v = l
                .strip_prefix("Max open files")?
                .split_whitespace()
                .next()?;
            Some(v.parse::<u64>().unwrap_or(u64::MAX))
        })?;
        Some(ProcessFigures {
            cpu_seconds: ticks as f64 / USER_HZ,
            start_time_seconds: btime as f64 + num(22)? as f64 / USER_HZ,
            resident_memory_bytes: kib("VmRSS:").unwrap_or(0) * 1024,
            virtual_memory_bytes: kib("VmSize:").unwrap_or(0) * 1024,
            open_fds: std::fs::read_dir("/proc/self/fd").ok()?.count() as u64,
            max_fds,
        })
    }
}

/// The `process_*` families and `nvmeof_build_info`.
fn process_families(e: &mut DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
    family(
        e,
        "nvmeof_build_info",
        "The daemon's version; always 1.",
        MetricType::Gauge,
        [(
            vec![("version", env!("CARGO_PKG_VERSION").to_string())],
            gauge(1),
        )],
    )?;
    let Some(p) = ProcessFigures::read() else {
        return Ok(());
    };
    fn one<M>(v: M) -> [(Labels, M); 1] {
        [(Labels::new(), v)]
    }
    family(
        e,
        "process_cpu_seconds",
        "Total user and system CPU time spent in seconds.",
        MetricType::Counter,
        one(ConstCounter::new(p.cpu_seconds)),
    )?;
    family(
        e,
        "process_start_time_seconds",
        "Start time of the process since unix epoch in seconds.",
        MetricType::Gauge,
        one(ConstGauge::new(p.start_time_seconds)),
    )?;
    for (name, help, v) in [
        (
            "process_resident_memory_bytes",
            "Resident memory size in bytes.",
            p.resident_memory_bytes,
        ),
        (
            "process_virtual_memory_bytes",
            "Virtual memory size in bytes.",
            p.virtual_memory_bytes,
        ),
        (
            "process_open_fds",
            "Number of open file descriptors.",
            p.open_fds,
        ),
        (
            "process_max_fds",
            "Maximum number of open file descriptors.",
            p.max_fds,
        ),
    ] {
        family(e, name, help, MetricType::Gauge, one(gauge(v)))?;
    }
    Ok(())
}

/// The OpenMetrics media type (what Prometheus asks for first).
pub const OPENMETRICS_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// The classic Prometheus text format's media type (what other clients get).
pub const TEXT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Renders the target's figures in the OpenMetrics text format.
pub fn render_openmetrics(target: &Arc<Target>) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(TargetCollector(Arc::clone(target))));
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut out, &registry);
    out
}

/// Renders the target's figures in the classic Prometheus text format (0.0.4): the
/// OpenMetrics rendering with counter families named by their samples' `_total` name and
/// without the `# EOF` marker.
pub fn render_text(target: &Arc<Target>) -> String {
    openmetrics_to_text(&render_openmetrics(target))
}

fn openmetrics_to_text(om: &str) -> String {
    let counters: std::collections::HashSet<&str> = om
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(om.len());
    for line in om.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let descriptor = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|p| Some((p, line.strip_prefix(p)?)));
        match descriptor {
            Some((prefix, rest)) => {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                let total = if counters.contains(name) {
                    "_total"
                } else {
                    ""
                };
                out.push_str(&format!("{prefix}{name}{total} {tail}\n"));
            }
            None => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    out
}

/// Longest request head accepted, in bytes.
const MAX_REQUEST: usize = 8192;
/// A scrape connection must send its request within this time.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// Binds the metrics endpoint.
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}

/// Serves `GET /metrics` (and `HEAD`) on `listener` until the target shuts down: one request
/// per connection, answered with the figures of the moment in OpenMetrics when the request
/// accepts it, in the classic text format otherwise; other paths get 404, other methods 405,
/// a request head over 8 KiB 431.
pub async fn serve(target: Arc<Target>, listener: TcpListener) {
    let mut shutdown = target.subscribe_shutdown();
    loop {
        tokio::select! {
            _ = shutdown.changed() => return,
            r = listener.accept() => match r {
                Ok((stream, peer)) => {
                    let t = Arc::clone(&target);
                    tokio::spawn(async move {
                        if let Err(e) = answer(&t, stream).await {
                            debug!(%peer, error = %e, "metrics request failed");
                        }
                    });
                }
                Err(e) => {
                    warn!(error = %e, "metrics endpoint: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }
}

/// Whether the request's Accept header names the OpenMetrics format.
fn wants_openmetrics(head: &[u8]) -> bool {
    String::from_utf8_lossy(head).lines().any(|l| {
        l.split_once(':').is_some_and(|(name, value)| {
            name.trim().eq_ignore_ascii_case("accept")
                && value.contains("application/openmetrics-text")
        })
    })
}

/// Reads one request head and answers it.
async fn answer(target: &Arc<Target>, mut stream: TcpStream) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(1024);
    let complete = tokio::time::timeout(REQUEST_TIMEOUT, async {
        let mut buf = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            if head.len() > MAX_REQUEST {
                return Ok(false);
            }
            let n = stream.read(&mut buf).await?;
            if n == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            head.extend_from_slice(&buf[..n]);
        }
        Ok::<_, std::io::Error>(true)
    })
    .await
    .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
    let (status, body, kind) = if !complete {
        (
            "431 Request Header Fields Too Large",
            String::new(),
            "text/plain",
        )
    } else {
        let line = head.split(|&b| b == b'\r').next().unwrap_or_default();
        let mut parts = line.split(|&b| b == b' ');
        let (method, path) = (
            parts.next().unwrap_or_default(),
            parts.next().unwrap_or_default(),
        );
        let path = path.split(|&b| b == b'?').next().unwrap_or_default();
        let get = matches!(method, b"GET" | b"HEAD");
        match (get, path) {
            (true, b"/metrics") if wants_openmetrics(&head) => {
                ("200 OK", render_openmetrics(target), OPENMETRICS_TYPE)
            }
            (true, b"/metrics") => ("200 OK", render_text(target), TEXT_TYPE),
            (true, _) => (
                "404 Not Found",
                "not found: try /metrics\n".into(),
                "text/plain",
            ),
            _ => ("405 Method Not Allowed", String::new(), "text/plain"),
        }
    };
    let head_only = head.starts_with(b"HEAD ");
    let reply = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}",
        body.len(),
        if head_only { "" } else { body.as_str() }
    );
    stream.write_all(reply.as_bytes()).await?;
    stream.shutdown().await
}

#[cfg(test)]
mod tests {
    use nvme_spec::command::build;
    use nvme_spec::queue::SglDescriptor;

    use super::*;
    use crate::engine::{Engine, Step};
    use crate::queue::HostSgl;
    use crate::testing::{NQN, Wire, connected, target};

    /// Hands `sqe` with its in-capsule `data` to the engine (memory: answered inline).
    fn run(e: &mut Engine<nvme_spec::Sqe>, sqe: &nvme_spec::Sqe, data: &[u8]) {
        let mut w = Wire {
            capsule: data.to_vec(),
            ..Wire::default()
        };
        assert!(
            matches!(e.command(&mut w, *sqe), Step::Answered),
            "memory runs inline"
        );
    }

    #[test]
    fn queues_count_io_and_their_totals_survive_the_close() {
        let t = target(&["mem:1M"]);
        let (admin, io) = connected(&t, HostSgl::Transport);
        let permit = t
            .listener_gate("tcp://127.0.0.1:4420".parse().unwrap())
            .admit()
            .unwrap();
        let mut e = Engine::new(io, permit);
        let mut w = build::read_write(true, 1, 1, 0, 2);
        w.dptr = SglDescriptor::in_capsule(8192);
        run(&mut e, &w, &[0x5a; 8192]);
        let mut r = build::read_write(false, 2, 1, 0, 1);
        r.dptr = SglDescriptor::tcp_transport(4096);
        run(&mut e, &r, &[]);
        let mut bad = build::read_write(false, 3, 1, 1 << 20, 1);
        bad.dptr = SglDescriptor::tcp_transport(4096);
        run(&mut e, &bad, &[]);
        let mut unknown_ns = build::read_write(false, 4, 9, 0, 1);
        unknown_ns.dptr = SglDescriptor::tcp_transport(4096);
        run(&mut e, &unknown_ns, &[]);

        let live = t.metrics_snapshot();
        let s = &live.subsystems[NQN];
        assert_eq!(s.controllers, 1);
        assert!(s.admin.commands["fabrics"] >= 1, "{:?}", s.admin);
        let ns1 = &s.namespaces[&1];
        assert_eq!((ns1.bytes_written, ns1.bytes_read), (8192, 4096));
        assert_eq!(ns1.commands[..2], [2, 1], "two reads, one write");
        assert_eq!(
            ns1.latency[0].iter().sum::<u64>(),
            1,
            "refused reads have no latency"
        );
        let lba = Status::generic(nvme_spec::status::generic::LBA_OUT_OF_RANGE);
        assert_eq!(ns1.errors[&status_key(lba)], 1);
        let invalid_ns = Status::generic(nvme_spec::status::generic::INVALID_NAMESPACE);
        assert_eq!(s.namespaces[&0].errors[&status_key(invalid_ns)], 1);
        // The serialized form names operations and statuses.
        let json = serde_json::to_value(&live).unwrap();
        let ns1 = &json["subsystems"][NQN]["namespaces"]["1"];
        assert_eq!(ns1["commands"]["read"], 2, "{ns1}");
        assert_eq!(ns1["errors"][0]["status"], "LBA Out of Range", "{ns1}");
        assert_eq!(ns1["errors"][0]["count"], 1, "{ns1}");

        drop(e);
        drop(admin);
        let closed = t.metrics_snapshot();
        let s = &closed.subsystems[NQN];
        assert_eq!(
            s.namespaces, live.subsystems[NQN].namespaces,
            "nothing lost at close"
        );
        assert_eq!(s.admin, live.subsystems[NQN].admin);
        assert!(t.subsystems()[NQN].metrics.reg.lock().live_io.is_empty());
    }

    #[test]
    fn latency_buckets_hold_their_bounds() {
        assert_eq!(bucket(0), 0);
        assert_eq!(bucket(4096), 0);
        assert_eq!(bucket(4097), 1);
        assert_eq!(bucket(8192), 1);
        assert_eq!(bucket(8193), 2);
        assert_eq!(bucket(u64::MAX), LATENCY_BUCKETS);
        for k in 0..LATENCY_BUCKETS {
            let ns = 1u64 << (LATENCY_SHIFT as usize + k);
            assert_eq!(bucket(ns), k, "{ns} ns");
            assert_eq!(bucket(ns + 1), k + 1, "{} ns", ns + 1);
        }
    }

    #[test]
    fn error_table_keeps_statuses_apart_and_folds_the_rest() {
        let t = ErrorTable::default();
        let lba = Status::generic(nvme_spec::status::generic::LBA_OUT_OF_RANGE).with_dnr();
        t.add(lba);
        t.add(lba);
        for sc in 0..40u8 {
            t.add(Status::specific(sc));
        }
        let mut out = BTreeMap::new();
        t.add_to(&mut out);
        assert_eq!(out[&status_key(lba)], 2);
        assert_eq!(out.len(), ERROR_SLOTS);
        assert_eq!(out.values().sum::<u64>(), 42);
        assert_eq!(out[&OTHER_STATUS], 40 - (ERROR_SLOTS as u64 - 2));
        assert_eq!(status_label(status_key(lba)).0, "LBA Out of Range");
    }
}
