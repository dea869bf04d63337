//! Counting for operators, the cells the hot path writes: per-subsystem and per-namespace
//! command counters, bytes, errors by status, latency histograms, queue depth, keep-alive
//! expiries and protocol errors, and the figures they add up to ([`MetricsSnapshot`]). A
//! leaf: it knows no queue, subsystem or target; [`crate::exporter`] gathers the figures of
//! a running target and serves them in the Prometheus text format.
//!
//! The I/O path never takes a lock, allocates or touches a variable shared with another
//! connection to count. Every queue (connection) owns its cells ([`IoCell`] per namespace,
//! [`AdminCell`] on an admin queue); only the queue's own task writes them, with plain
//! relaxed loads and stores. The subsystem keeps a registry of the live cells
//! ([`SubsystemMetrics`]) that a scrape adds up; when a queue closes its cells are folded
//! into the subsystem's totals under the registry's lock, so no figure ever goes backwards.
//! Cells are made at Connect (and at the first command for a namespace added later).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Instant;

use nvme_spec::Status;
use parking_lot::Mutex;
use serde::Serialize;

use crate::op::IoOp;

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
/// The key of the error slot that counts statuses beyond the 16 a cell keeps apart.
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
        IoOp::Reservation { .. } | IoOp::ReservationReport { .. } => 6,
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
pub(crate) fn bucket_bound_s(k: usize) -> f64 {
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

    /// The subsystem's figures now: the closed queues' totals plus every live queue's cells.
    pub fn figures(&self, controllers: u64) -> SubsystemFigures {
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

/// What a queue's cells need of their subsystem: its registry, and its namespaces (only when
/// a queue connects, closes, or first meets a namespace: never per command).
pub trait CellRegistry: Send + Sync {
    /// The subsystem's registry of cells.
    fn cells(&self) -> &SubsystemMetrics;
    /// The subsystem's NSIDs now.
    fn nsids(&self) -> Vec<u32>;
    /// Whether the subsystem has namespace `nsid` now.
    fn has_namespace(&self, nsid: u32) -> bool;
}

/// A queue's cells: made at Connect, folded into the subsystem's totals when dropped.
pub struct QueueMetrics {
    subsystem: Arc<dyn CellRegistry>,
    /// By NSID, sorted (NSID 0 first).
    io: Vec<(u32, Arc<IoCell>)>,
    admin: Option<Arc<AdminCell>>,
}

impl QueueMetrics {
    /// Cells for a queue of `subsystem`: an admin cell for the admin queue (`qid` 0), a cell
    /// per namespace for an I/O queue.
    pub fn new(subsystem: Arc<dyn CellRegistry>, qid: u16) -> Self {
        let mut q = QueueMetrics {
            subsystem,
            io: Vec::new(),
            admin: None,
        };
        if qid == 0 {
            let cell = Arc::new(AdminCell::default());
            q.subsystem
                .cells()
                .reg
                .lock()
                .live_admin
                .push(Arc::clone(&cell));
            q.admin = Some(cell);
        } else {
            let nsids = q.subsystem.nsids();
            for nsid in std::iter::once(0).chain(nsids) {
                q.add_io_cell(nsid);
            }
        }
        q
    }

    fn add_io_cell(&mut self, nsid: u32) -> usize {
        let cell = Arc::new(IoCell::default());
        self.subsystem
            .cells()
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
            Err(_) if self.subsystem.has_namespace(nsid) => self.add_io_cell(nsid),
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
        let mut reg = self.subsystem.cells().reg.lock();
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

impl TargetMetrics {
    /// Adds the target-wide counters to `snap`.
    pub fn add_to(&self, snap: &mut MetricsSnapshot) {
        let per_transport = |a: &[AtomicU64; 2]| {
            TRANSPORTS
                .iter()
                .zip(a)
                .map(|(t, n)| (*t, n.load(Ordering::Relaxed)))
                .collect()
        };
        snap.protocol_errors = per_transport(&self.protocol_errors);
        snap.host_term_reqs = per_transport(&self.host_term_reqs);
        snap.connects_refused = self.connects_refused.lock().clone();
        snap.auth_failures = self.auth_failures.lock().clone();
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
