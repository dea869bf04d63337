//! The coordinator: runs every point of a plan in every mode, side by side, and builds the
//! report.
//!
//! Order: for each repeat, for each point, for each mode. Interleaving the modes point by point
//! keeps slow drifts of a shared machine from favouring one mode.
//!
//! Each measurement gets a fresh client runtime (a multi-thread tokio runtime with `numjobs`
//! threads named `bench-client`; with `client_cpus`, each worker thread pinned to one CPU of
//! the list in turn, threads of its blocking pool to the whole list); a fabric mode connects
//! inside it, so the initiator's queue tasks run on the client threads. Targets the load
//! generator starts live on a small control runtime (`bench-ctl`), their data plane on their
//! own reactor threads, from the first point to the end of the run, restarted (with fresh
//! backends) only when a point asks for another number of them (`targets`). DAS backends and
//! the targets the load generator starts are prefilled with the verify pattern once, before
//! the first point that reads (again after a restart); a target given by address only when
//! the job says `prefill = true` (its reads are verified only then).

use std::io::{IsTerminal, Write as _};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use tokio::runtime::Runtime;

use crate::cpu::{self, CpuSnapshot};
use crate::fabric::{CpuSource, FabricTargets, TargetSpec};
use crate::gpu::{GpuPath, GpuSource};
use crate::hist::LatencyHist;
use crate::iscsi::{IscsiPath, IscsiSettings, Tgt, TgtSpec};
use crate::job::{Api, Dest, HostLoad, Issue, Mode, Plan, Point, TcpTarget};
use crate::load::BusyLoad;
use crate::path::{DasPath, HostChoice, IoPath, NsGeometry, TcpPath, TcpSettings};
use crate::pattern::Pattern;
use crate::report::{
    CpuStats, DirStats, Machine, Measurement, ModeReport, NsSpread, NsStats, PlanInfo, PointReport,
    QueueSpread, Report, SCHEMA, Summary, fmt_si, now_utc,
};
use crate::worker::{self, PHASE_MEASURE, PHASE_STOP, Shared, WorkerOutput, WorkerSpec};

/// Message of the `rdma` mode without an address (no RDMA target is started in-process).
pub const RDMA_UNAVAILABLE: &str = "mode rdma without an address has no target to reach (the load generator starts no RDMA target itself); use rdma=HOST:PORT (a target listening on rdma://) with --nqn";

/// Errors that stop a whole run (a mode that cannot run is reported in its results instead).
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// A runtime or thread could not be created.
    #[error("cannot start the runtime: {0}")]
    Runtime(#[from] std::io::Error),
}

/// How a run reports while it goes.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// The command line, for the report.
    pub command: String,
    /// The job file, for the report.
    pub job_file: Option<String>,
    /// Print a line per measurement on stderr (and a live progress line on a terminal).
    pub progress: bool,
}

/// What the load generator knows of a mode's storage: how much of each of the first
/// `namespaces` namespaces of each target holds the pattern of `seed` (written by a prefill or
/// by writes of that seed), and whether the storage is its own (see [`Mode::owns_target`]).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Prefilled {
    seed: u64,
    bytes: u64,
    namespaces: u32,
    own: bool,
}

impl Prefilled {
    fn new(mode: &Mode) -> Self {
        Prefilled {
            own: mode.owns_target(),
            ..Prefilled::default()
        }
    }

    fn holds(&self, seed: u64, region: u64, namespaces: u32) -> bool {
        self.seed == seed && self.bytes >= region && self.namespaces >= namespaces
    }
}

enum ModeState {
    Das {
        path: Arc<DasPath>,
        prefilled: Prefilled,
    },
    Tcp {
        /// How the targets are reached or started.
        kind: TcpTarget,
        /// The targets, or the count that could not be started and why.
        targets: Result<FabricTargets, (usize, String)>,
        prefilled: Prefilled,
    },
    Iscsi {
        /// The target, or why it could not be started.
        target: Result<IscsiTarget, String>,
        prefilled: Prefilled,
    },
    Unavailable(String),
}

/// The target of an iscsi mode.
enum IscsiTarget {
    /// tgtd started by the load generator.
    Tgt(Tgt),
    /// A target at an address, and its process on this machine when known.
    Remote { addr: String, pid: Option<u32> },
}

impl IscsiTarget {
    fn start(addr: &Option<String>, plan: &Plan, queue_depth: u32) -> Result<Self, String> {
        match addr {
            None => Tgt::start(&TgtSpec {
                iqn: plan.iqn.clone(),
                backend: plan.backend.clone(),
                namespaces: plan.namespaces,
                first_lun: plan.lun.unwrap_or(1),
                cpus: plan.target_cpus.clone(),
                queue_depth,
            })
            .map(IscsiTarget::Tgt)
            .map_err(|e| e.to_string()),
            Some(a) => {
                if let Some(pid) = plan.target_pid {
                    CpuSnapshot::take(Some(pid)).map_err(|e| e.to_string())?;
                    if let Some(cpus) = &plan.target_cpus {
                        cpu::pin_named(Some(pid), "", cpus).map_err(|e| e.to_string())?;
                    }
                }
                Ok(IscsiTarget::Remote {
                    addr: a.clone(),
                    pid: plan.target_pid,
                })
            }
        }
    }

    fn addr(&self) -> String {
        match self {
            IscsiTarget::Tgt(t) => t.addr(),
            IscsiTarget::Remote { addr, .. } => addr.clone(),
        }
    }

    fn first_lun(&self, plan: &Plan) -> u16 {
        plan.lun.unwrap_or(match self {
            IscsiTarget::Tgt(_) => 1,
            IscsiTarget::Remote { .. } => 0,
        })
    }

    fn cpu_source(&self) -> CpuSource {
        match self {
            IscsiTarget::Tgt(t) => CpuSource::Processes(vec![t.pid()]),
            IscsiTarget::Remote { pid: Some(p), .. } => CpuSource::Processes(vec![*p]),
            IscsiTarget::Remote { pid: None, .. } => CpuSource::None,
        }
    }
}

/// Whether stderr may carry colours: a terminal, and `NO_COLOR` unset or empty
/// (<https://no-color.org>).
pub fn stderr_color() -> bool {
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// What a run tells on stderr while it goes: a line per measurement with its position in the
/// run, the time spent and an estimate of the time left, a line before and after a prefill,
/// and on a terminal a live line (rewritten in place) during each.
pub(crate) struct Progress {
    enabled: bool,
    tty: bool,
    started: Instant,
    /// Measurements in the run (repeats x points x modes).
    total: usize,
    /// Measurements finished.
    finished: std::cell::Cell<usize>,
}

/// `42s`, `3m05s`, `1h02m`.
fn fmt_secs(s: f64) -> String {
    let s = s.max(0.0).round() as u64;
    if s < 60 {
        format!("{s}s")
    } else if s < 3600 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        format!("{}h{:02}m", s / 3600, s % 3600 / 60)
    }
}

impl Progress {
    fn new(enabled: bool, total: usize) -> Self {
        Progress {
            enabled,
            tty: std::io::stderr().is_terminal(),
            started: Instant::now(),
            total,
            finished: std::cell::Cell::new(0),
        }
    }

    /// `point 3/12, 1m05s elapsed, ~4m20s left` (the estimate: the mean time per measurement
    /// so far, times the measurements left).
    fn position(&self) -> String {
        let done = self.finished.get();
        let elapsed = self.started.elapsed().as_secs_f64();
        let left = if done > 0 {
            format!(
                ", ~{} left",
                fmt_secs(elapsed / done as f64 * (self.total - done.min(self.total)) as f64)
            )
        } else {
            String::new()
        };
        format!(
            "{}/{}, {} elapsed{left}",
            (done + 1).min(self.total),
            self.total,
            fmt_secs(elapsed)
        )
    }

    fn live(&self, mode: &str, label: &str, elapsed: f64, total: Option<f64>, shared: &Shared) {
        if !(self.enabled && self.tty) {
            return;
        }
        let ops = shared.ops.load(Ordering::Relaxed) as f64;
        let bytes = shared.bytes.load(Ordering::Relaxed) as f64;
        let rate = |v: f64| if elapsed > 0.0 { v / elapsed } else { 0.0 };
        let t = match total {
            Some(t) => format!("{elapsed:.1}/{t:.0}s"),
            None => format!("{elapsed:.1}s"),
        };
        eprint!(
            "\r\x1b[2K[{}] [{mode}] {label}  {t}  {} IOPS  {:.2} GB/s",
            self.position(),
            fmt_si(rate(ops)),
            rate(bytes) / 1e9
        );
        let _ = std::io::stderr().flush();
    }

    /// A prefill starts (`bytes` in all).
    fn prefill_start(&self, mode: &str, bytes: u64, namespaces: usize) {
        if self.enabled {
            self.clear();
            eprintln!(
                "[{mode}] prefill: writing the verify pattern over {} MiB of {namespaces} namespace(s)",
                bytes >> 20
            );
        }
    }

    /// A prefill has written `done` of `bytes` (a live line on a terminal).
    fn prefill_live(&self, mode: &str, done: u64, bytes: u64, secs: f64) {
        if self.enabled && self.tty {
            eprint!(
                "\r\x1b[2K[{mode}] prefill {} / {} MiB  {:.0}%  {:.1}s",
                done >> 20,
                bytes >> 20,
                done as f64 * 100.0 / bytes.max(1) as f64,
                secs
            );
            let _ = std::io::stderr().flush();
        }
    }

    /// A prefill has finished.
    fn prefill_done(&self, mode: &str, bytes: u64, secs: f64) {
        if self.enabled {
            self.clear();
            eprintln!(
                "[{mode}] prefill done: {} MiB in {secs:.1} s ({:.2} GB/s)",
                bytes >> 20,
                bytes as f64 / secs.max(1e-9) / 1e9
            );
        }
    }

    fn clear(&self) {
        if self.tty {
            eprint!("\r\x1b[2K");
        }
    }

    fn done(&self, mode: &str, label: &str, m: &Measurement) {
        let position = self.position();
        self.finished.set(self.finished.get() + 1);
        if !self.enabled {
            return;
        }
        self.clear();
        match &m.error {
            Some(e) => eprintln!("[{position}] [{mode}] {label}: {e}"),
            None => eprintln!(
                "[{position}] [{mode}] {label}: {} IOPS, {:.3} GB/s, p50 {:.1} us, p99 {:.1} us{}",
                fmt_si(m.all.iops),
                m.all.gbps,
                m.all.latency.p50_us,
                m.all.latency.p99_us,
                if m.verify_errors > 0 {
                    format!(", {} VERIFY ERRORS", m.verify_errors)
                } else {
                    String::new()
                }
            ),
        }
    }
}

fn max_queue_depth(plan: &Plan) -> u16 {
    let need = plan
        .points
        .iter()
        .map(|p| {
            let per_queue = p.numjobs.div_ceil(u32::from(p.queue_pairs));
            u64::from(p.iodepth) * u64::from(per_queue) + 1
        })
        .max()
        .unwrap_or(128);
    need.clamp(128, 4096) as u16
}

/// Runs a plan and returns its report.
pub fn run(plan: &Plan, opts: &RunOptions) -> Result<Report, RunError> {
    let started_utc = now_utc();
    let progress = Progress::new(
        opts.progress,
        plan.repeat as usize * plan.points.len() * plan.modes.len(),
    );
    let ctl = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("bench-ctl")
        .enable_all()
        .build()?;
    let spec = TargetSpec {
        nqn: plan.nqn.clone(),
        backend: plan.backend.clone(),
        namespaces: plan.namespaces,
        reactors: plan.target_reactors,
        poll_us: plan.target_poll_us,
        max_queue_depth: max_queue_depth(plan),
        cpus: plan.target_cpus.clone(),
        remote_pid: plan.target_pid,
    };
    // The targets start with the count of the first point (the plan orders the points target
    // count by target count).
    let first_targets = plan.points.first().map_or(1, |p| p.targets as usize);
    let mut states: Vec<ModeState> = plan
        .modes
        .iter()
        .map(|m| match m {
            Mode::Das => match DasPath::open(&plan.backend, plan.namespaces) {
                Ok(p) => ModeState::Das {
                    path: Arc::new(p),
                    prefilled: Prefilled::new(m),
                },
                Err(e) => ModeState::Unavailable(format!("cannot open the backend: {e}")),
            },
            Mode::Tcp(kind) => match ctl.block_on(FabricTargets::start(kind, &spec, first_targets))
            {
                Ok(targets) => ModeState::Tcp {
                    kind: kind.clone(),
                    targets: Ok(targets),
                    prefilled: Prefilled::new(m),
                },
                Err(e) => ModeState::Unavailable(e.to_string()),
            },
            Mode::Rdma { addr: None } => ModeState::Unavailable(RDMA_UNAVAILABLE.into()),
            // NVMe/RDMA through the same initiator path: the address carries the transport.
            Mode::Rdma { addr: Some(a) } => {
                let remote = TcpTarget::Remote {
                    addr: format!("rdma://{a}"),
                };
                match ctl.block_on(FabricTargets::start(&remote, &spec, 1)) {
                    Ok(targets) => ModeState::Tcp {
                        kind: remote,
                        targets: Ok(targets),
                        prefilled: Prefilled::new(m),
                    },
                    Err(e) => ModeState::Unavailable(e.to_string()),
                }
            }
            Mode::Iscsi { addr } => ModeState::Iscsi {
                target: IscsiTarget::start(addr, plan, u32::from(spec.max_queue_depth)),
                prefilled: Prefilled::new(m),
            },
        })
        .collect();

    let mut results: Vec<Vec<Vec<Measurement>>> =
        vec![vec![Vec::new(); plan.modes.len()]; plan.points.len()];
    for repeat in 0..plan.repeat {
        for (pi, point) in plan.points.iter().enumerate() {
            for (mi, mode) in plan.modes.iter().enumerate() {
                let label = point.label();
                let mode_label = mode.label();
                ensure_targets(&ctl, &spec, mode, point, &mut states[mi]);
                let m = measure_in_mode(
                    plan,
                    point,
                    &mut states[mi],
                    repeat,
                    &progress,
                    &mode_label,
                    &label,
                );
                progress.done(&mode_label, &label, &m);
                results[pi][mi].push(m);
            }
        }
    }
    for st in states {
        match st {
            ModeState::Tcp {
                targets: Ok(targets),
                ..
            } => ctl.block_on(targets.stop()),
            ModeState::Iscsi {
                target: Ok(IscsiTarget::Tgt(t)),
                ..
            } => t.stop(),
            _ => {}
        }
    }
    ctl.shutdown_timeout(Duration::from_secs(2));

    let points = plan
        .points
        .iter()
        .enumerate()
        .map(|(pi, p)| PointReport {
            id: pi,
            job: p.job.clone(),
            label: p.label(),
            point: p.clone(),
            results: plan
                .modes
                .iter()
                .enumerate()
                .map(|(mi, m)| ModeReport {
                    mode: m.label(),
                    summary: Summary::of(&results[pi][mi]),
                    vs_das: None,
                    repeats: results[pi][mi].clone(),
                })
                .collect(),
        })
        .collect();
    let mut report = Report {
        schema: SCHEMA.into(),
        tool_version: env!("CARGO_PKG_VERSION").into(),
        started_utc,
        command: opts.command.clone(),
        machine: Machine::detect(),
        plan: PlanInfo {
            description: plan.description.clone(),
            job_file: opts.job_file.clone(),
            modes: plan.modes.iter().map(Mode::label).collect(),
            backend: plan.backend.to_string(),
            namespaces: plan.namespaces,
            target_reactors: plan.target_reactors,
            target_poll_us: plan.target_poll_us,
            client_poll_us: plan.client_poll_us,
            sq_flow_control: plan.sq_flow_control,
            target_cpus: plan.target_cpus.clone(),
            client_cpus: plan.client_cpus.clone(),
            repeat: plan.repeat,
            skipped_modes: plan.skipped.clone(),
        },
        points,
    };
    report.compute_ratios();
    Ok(report)
}

/// Restarts the targets of a mode that starts its own when `point` asks for another number of
/// them (their backends are fresh: the prefill is done again). A target at an address is left
/// alone (the plan allows one only).
fn ensure_targets(
    ctl: &Runtime,
    spec: &TargetSpec,
    mode: &Mode,
    point: &Point,
    state: &mut ModeState,
) {
    let ModeState::Tcp {
        kind,
        targets,
        prefilled,
    } = state
    else {
        return;
    };
    let want = point.targets as usize;
    let have = match targets {
        Ok(t) => t.len(),
        Err((n, _)) => *n,
    };
    if have == want || !mode.owns_target() {
        return;
    }
    let old = std::mem::replace(targets, Err((0, String::new())));
    if let Ok(t) = old {
        ctl.block_on(t.stop());
    }
    *targets = ctl
        .block_on(FabricTargets::start(kind, spec, want))
        .map_err(|e| (want, e.to_string()));
    *prefilled = Prefilled::new(mode);
}

pub(crate) fn failed(repeat: u32, msg: impl Into<String>) -> Measurement {
    Measurement {
        repeat,
        ok: false,
        error: Some(msg.into()),
        ..Default::default()
    }
}

fn client_runtime(plan: &Plan, point: &Point) -> std::io::Result<Runtime> {
    let mut b = tokio::runtime::Builder::new_multi_thread();
    b.worker_threads(point.numjobs as usize)
        .thread_name("bench-client")
        .enable_all();
    if let Some(c) = plan.client_cpus.clone() {
        // The runtime starts its worker threads first: each gets one CPU of the list (in
        // turn), as a polling client keeps one thread per core; threads started later (the
        // blocking pool) get the whole list.
        let cores = cpu::parse_cpu_list(&c).unwrap_or_default();
        let workers = point.numjobs as usize;
        let started = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        b.on_thread_start(move || {
            let i = started.fetch_add(1, Ordering::Relaxed);
            let cpus = client_thread_cpus(&c, &cores, workers, i);
            if let Err(e) = cpu::pin_current(&cpus) {
                tracing::warn!(error = %e, "client thread not pinned");
            }
        });
    }
    b.build()
}

/// The CPUs of the `i`-th thread the client runtime starts: one CPU of `cores` (the parsed
/// `list`) in turn for each of the first `workers`, the whole list after them.
fn client_thread_cpus(list: &str, cores: &[u32], workers: usize, i: usize) -> String {
    match cores.get(i % cores.len().max(1)) {
        Some(cpu) if i < workers => cpu.to_string(),
        _ => list.to_string(),
    }
}

fn measure_in_mode(
    plan: &Plan,
    point: &Point,
    state: &mut ModeState,
    repeat: u32,
    progress: &Progress,
    mode_label: &str,
    label: &str,
) -> Measurement {
    if point.dest == Dest::Gpu && point.writes() {
        return failed(
            repeat,
            "destination gpu measures reads: use rw = read or randread",
        );
    }
    let rt = match client_runtime(plan, point) {
        Ok(rt) => rt,
        Err(e) => return failed(repeat, format!("cannot start the client runtime: {e}")),
    };
    let m = match state {
        ModeState::Unavailable(msg) => failed(repeat, msg.clone()),
        ModeState::Das { .. } if point.issue == Issue::Gpu => failed(
            repeat,
            "issue = \"gpu\" needs a fabric mode (tcp, tcp-bin, tcp=HOST:PORT, rdma=HOST:PORT): GPU threads read through the initiator's queues",
        ),
        ModeState::Das { path, prefilled } => measure_into(
            &rt,
            path,
            plan,
            point,
            prefilled,
            CpuSource::None,
            repeat,
            progress,
            "das",
            label,
        ),
        ModeState::Tcp {
            targets: Err((_, msg)),
            ..
        } => failed(repeat, msg.clone()),
        ModeState::Iscsi {
            target: Err(msg), ..
        } => failed(repeat, msg.clone()),
        ModeState::Iscsi { .. } if point.issue == Issue::Gpu || point.dest == Dest::Gpu => failed(
            repeat,
            "the iscsi modes read into host memory from CPU workers: use issue = cpu and dest = host",
        ),
        ModeState::Iscsi {
            target: Ok(target),
            prefilled,
        } => {
            let settings = IscsiSettings {
                addr: target.addr(),
                iqn: plan.iqn.clone(),
                sessions: point.queue_pairs,
                first_lun: target.first_lun(plan),
                luns: point.namespaces,
            };
            match rt.block_on(IscsiPath::connect(&settings)) {
                // The initiator's errors name the address where it helps.
                Err(e) => failed(repeat, e.to_string()),
                Ok(path) => {
                    let sessions = path.sessions();
                    let path = Arc::new(path);
                    let mut m = measure(
                        &rt,
                        Arc::clone(&path),
                        plan,
                        point,
                        prefilled,
                        target.cpu_source(),
                        repeat,
                        progress,
                        mode_label,
                        label,
                    );
                    m.queues = Some(sessions);
                    if let Ok(path) = Arc::try_unwrap(path) {
                        rt.block_on(path.logout());
                    }
                    m
                }
            }
        }
        ModeState::Tcp {
            targets: Ok(target),
            prefilled,
            kind,
        } => {
            let settings = TcpSettings {
                addrs: target.addrs(),
                nqn: plan.nqn.clone(),
                host: match &plan.host {
                    Some(h)
                        if plan.hostnqn.is_some() || matches!(kind, TcpTarget::Remote { .. }) =>
                    {
                        h.clone()
                    }
                    _ => HostChoice::bench(),
                },
                queue_pairs: point.queue_pairs,
                queue_depth: (point.iodepth * point.numjobs.div_ceil(u32::from(point.queue_pairs))
                    + 1)
                .min(4096) as u16,
                namespaces: point.namespaces,
                busy_poll: Duration::from_micros(u64::from(plan.client_poll_us)),
                sq_flow_control: plan.sq_flow_control,
                rtc_pairs: if point.api == Api::Rtc {
                    // One per namespace and queue of each worker (as `run_rtc` opens them).
                    let numjobs = point.numjobs as usize;
                    let per_ns: usize = (0..numjobs)
                        .map(|w| {
                            queues_of(w, numjobs, usize::from(point.queue_pairs))
                                .len()
                                .max(1)
                        })
                        .sum();
                    (per_ns * point.namespaces as usize).min(usize::from(u16::MAX / 2)) as u16
                } else {
                    0
                },
            };
            match rt.block_on(TcpPath::connect(&settings)) {
                Err(e) => failed(
                    repeat,
                    format!("connect to {}: {e}", settings.addrs.join(", ")),
                ),
                Ok(path) => {
                    let queues = path.queues();
                    let path = Arc::new(path);
                    let mut m = if point.issue == Issue::Gpu {
                        crate::gpu_issue::measure(
                            &rt,
                            &path,
                            point,
                            prefilled,
                            target.cpu_source(),
                            repeat,
                            mode_label,
                            progress,
                        )
                    } else {
                        measure_into(
                            &rt,
                            &path,
                            plan,
                            point,
                            prefilled,
                            target.cpu_source(),
                            repeat,
                            progress,
                            mode_label,
                            label,
                        )
                    };
                    m.queues = Some(queues);
                    if let Ok(path) = Arc::try_unwrap(path)
                        && let Err(e) = rt.block_on(path.disconnect())
                    {
                        tracing::warn!(error = %e, "disconnect failed");
                    }
                    m
                }
            }
        }
    };
    rt.shutdown_timeout(Duration::from_secs(2));
    m
}

/// The bytes of each namespace a point uses: its `size` (or the whole namespace), rounded
/// down to whole blocks of `bs`.
fn region_of(point: &Point, geo: &[NsGeometry]) -> Result<u64, String> {
    let cap = geo.iter().map(|g| g.bytes).min().unwrap_or(0);
    for g in geo {
        if point.bs % u64::from(g.block_size) != 0 {
            return Err(format!(
                "bs {} is not a multiple of namespace {}'s block size {}",
                point.bs, g.nsid, g.block_size
            ));
        }
    }
    if let Some(size) = point.size.filter(|&size| size > cap) {
        return Err(format!(
            "size {} is larger than the namespace{} ({}): lower size or use a larger namespace",
            blockdev::format_size(size),
            if geo.len() > 1 { "s' smallest" } else { "" },
            blockdev::format_size(cap)
        ));
    }
    let region = point.size.unwrap_or(cap) / point.bs * point.bs;
    if region == 0 {
        return Err(format!(
            "the namespaces ({cap} bytes) are smaller than one block of {} bytes",
            point.bs
        ));
    }
    Ok(region)
}

async fn prefill<P: IoPath>(
    path: &P,
    namespaces: usize,
    region: u64,
    pattern: &Pattern,
    progress: &Progress,
    mode: &str,
) -> Result<(), String> {
    let total = region * namespaces as u64;
    let t0 = Instant::now();
    let mut last = t0;
    let mut written = 0u64;
    const CHUNK: u64 = 128 * 1024;
    const DEPTH: usize = 16;
    let mut inflight = FuturesUnordered::new();
    let mut work = (0..namespaces).flat_map(|ns| {
        (0..region.div_ceil(CHUNK)).map(move |i| (ns, i * CHUNK, CHUNK.min(region - i * CHUNK)))
    });
    loop {
        while inflight.len() < DEPTH {
            let Some((ns, off, len)) = work.next() else {
                break;
            };
            let mut buf = path.alloc(len as usize);
            pattern.fill(off, P::bytes_mut(&mut buf));
            inflight.push(async move {
                let (r, _buf) = path.write(0, ns, off, buf).await;
                r.map(|()| len)
                    .map_err(|e| format!("prefill write at ns index {ns} offset {off:#x}: {e}"))
            });
        }
        match inflight.next().await {
            Some(r) => written += r?,
            None => return Ok(()),
        }
        if last.elapsed() >= Duration::from_millis(250) {
            last = Instant::now();
            progress.prefill_live(mode, written, total, t0.elapsed().as_secs_f64());
        }
    }
}

/// Measures on `path`, or on a [`GpuPath`] over it when the point reads into GPU memory.
#[allow(clippy::too_many_arguments)]
fn measure_into<P: GpuSource>(
    rt: &Runtime,
    path: &Arc<P>,
    plan: &Plan,
    point: &Point,
    prefilled: &mut Prefilled,
    target_cpu: CpuSource,
    repeat: u32,
    progress: &Progress,
    mode: &str,
    label: &str,
) -> Measurement {
    if point.dest != Dest::Gpu {
        return measure(
            rt,
            Arc::clone(path),
            plan,
            point,
            prefilled,
            target_cpu,
            repeat,
            progress,
            mode,
            label,
        );
    }
    // A chase needs each read's data back on the host (its first word names the next read).
    match GpuPath::new(
        Arc::clone(path),
        point.verify || point.chase,
        point.copy_lag,
    ) {
        Err(e) => failed(repeat, e.to_string()),
        Ok(gpu) => measure(
            rt,
            Arc::new(gpu),
            plan,
            point,
            prefilled,
            target_cpu,
            repeat,
            progress,
            mode,
            label,
        ),
    }
}

/// The namespaces' geometry, the region a point uses and whether its reads are verified,
/// after prefilling the region with the pattern where the point and the mode ask for it.
pub(crate) fn prepare<P: IoPath>(
    rt: &Runtime,
    path: &P,
    point: &Point,
    prefilled: &mut Prefilled,
    mode: &str,
    progress: &Progress,
) -> Result<(Vec<NsGeometry>, u64, bool), String> {
    // The first `point.namespaces` of each target (a path may hold more: das opens every one).
    let mut per_target = Vec::new();
    let geo: Vec<NsGeometry> = path
        .geometry()
        .iter()
        .filter(|g| {
            let t = g.target as usize;
            if per_target.len() <= t {
                per_target.resize(t + 1, 0u32);
            }
            per_target[t] += 1;
            per_target[t] <= point.namespaces
        })
        .copied()
        .collect();
    let region = region_of(point, &geo)?;
    let wants_prefill = point.reads() && point.prefill.unwrap_or(prefilled.own);
    if wants_prefill && !prefilled.holds(point.seed, region, point.namespaces) {
        let t = Instant::now();
        let pattern = Pattern::new(point.seed);
        let bytes = region * geo.len() as u64;
        progress.prefill_start(mode, bytes, geo.len());
        rt.block_on(prefill(path, geo.len(), region, &pattern, progress, mode))?;
        progress.prefill_done(mode, bytes, t.elapsed().as_secs_f64());
        prefilled.seed = point.seed;
        prefilled.bytes = region;
        prefilled.namespaces = point.namespaces;
    }
    // A target given by address holds data of its own: its reads are checked only where this
    // run wrote the pattern.
    let verify =
        point.verify && (prefilled.own || prefilled.holds(point.seed, region, point.namespaces));
    if point.writes() && prefilled.seed != point.seed {
        // Writes of another seed make earlier prefilled data unusable for verification.
        prefilled.bytes = 0;
    }
    Ok((geo, region, verify))
}

#[allow(clippy::too_many_arguments)]
fn measure<P: IoPath>(
    rt: &Runtime,
    path: Arc<P>,
    plan: &Plan,
    point: &Point,
    prefilled: &mut Prefilled,
    target_cpu: CpuSource,
    repeat: u32,
    progress: &Progress,
    mode: &str,
    label: &str,
) -> Measurement {
    let (geo, region, verify) = match prepare(rt, &*path, point, prefilled, mode, progress) {
        Ok(p) => p,
        Err(e) => return failed(repeat, e),
    };
    let pattern = Arc::new(Pattern::new(point.seed));

    let load = if point.host_load == HostLoad::Busy {
        match BusyLoad::start(
            point.load_threads,
            point.load_mem,
            plan.load_cpus.as_deref(),
        ) {
            Ok(l) => Some(l),
            Err(e) => return failed(repeat, format!("cannot start the busy load: {e}")),
        }
    } else {
        None
    };

    let shared = Arc::new(Shared::default());
    let numjobs = point.numjobs as usize;
    let budget = match point.runtime {
        Some(_) => None,
        None => point
            .io_size
            .map(|b| (b / numjobs as u64).div_ceil(point.bs).max(1) * point.bs),
    };
    let mut handles = Vec::new();
    for w in 0..numjobs {
        let spec = WorkerSpec {
            index: w,
            queues: queues_of(w, numjobs, usize::from(point.queue_pairs)),
            bs: point.bs,
            iodepth: point.iodepth,
            read_percent: point.rw.read_percent(point.rwmixread),
            random: point.rw.is_random(),
            region,
            seq_start: region / numjobs as u64 * w as u64,
            namespaces: geo.len(),
            verify,
            rng_seed: point.seed
                ^ (u64::from(repeat) << 32)
                ^ (w as u64 + 1).wrapping_mul(0x9E37_79B9),
            budget,
            rtc: point.api == Api::Rtc,
            chase: point.chase && point.issue == Issue::Cpu,
        };
        handles.push(rt.spawn(worker::run(
            Arc::clone(&path),
            spec,
            Arc::clone(&pattern),
            Arc::clone(&shared),
        )));
    }

    let own_pids = target_cpu.pids();
    let timing = rt.block_on(async {
        tokio::time::sleep(point.ramp_time).await;
        let self0 = CpuSnapshot::take(None);
        let tgt0 = own_pids.map(CpuSnapshot::take_processes);
        let t0 = Instant::now();
        shared.phase.store(PHASE_MEASURE, Ordering::Relaxed);
        let total = point.runtime.map(|d| d.as_secs_f64());
        let tick = Duration::from_millis(250);
        match point.runtime {
            Some(rt_dur) => loop {
                let el = t0.elapsed();
                if el >= rt_dur {
                    break;
                }
                if handles.iter().all(|h| h.is_finished()) {
                    break;
                }
                tokio::time::sleep(tick.min(rt_dur - el)).await;
                progress.live(mode, label, t0.elapsed().as_secs_f64(), total, &shared);
            },
            None => {
                while !handles.iter().all(|h| h.is_finished()) {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    if t0.elapsed().as_millis() % 250 < 5 {
                        progress.live(mode, label, t0.elapsed().as_secs_f64(), total, &shared);
                    }
                }
            }
        }
        let secs = t0.elapsed().as_secs_f64();
        let self1 = CpuSnapshot::take(None);
        let tgt1 = own_pids.map(CpuSnapshot::take_processes);
        shared.phase.store(PHASE_STOP, Ordering::Relaxed);
        let mut outs = Vec::new();
        for h in handles.drain(..) {
            match h.await {
                Ok(o) => outs.push(o),
                Err(e) => {
                    outs.push(WorkerOutput {
                        io_errors: 1,
                        first_io_error: Some(format!("worker failed: {e}")),
                        ..Default::default()
                    });
                }
            }
        }
        (secs, self0, self1, tgt0, tgt1, outs)
    });
    let load_stats = load.map(BusyLoad::stop);
    let (secs, self0, self1, tgt0, tgt1, outs) = timing;
    let timing = Timing {
        secs,
        self0,
        self1,
        tgt0,
        tgt1,
    };
    summarize(repeat, &geo, &target_cpu, &timing, &outs, load_stats)
}

/// Clocks and CPU snapshots around a measured interval.
pub(crate) struct Timing {
    /// Seconds measured.
    pub secs: f64,
    /// This process's threads at the start.
    pub self0: Result<CpuSnapshot, cpu::CpuError>,
    /// This process's threads at the end.
    pub self1: Result<CpuSnapshot, cpu::CpuError>,
    /// The target process at the start (when it is another process).
    pub tgt0: Option<Result<CpuSnapshot, cpu::CpuError>>,
    /// The target process at the end.
    pub tgt1: Option<Result<CpuSnapshot, cpu::CpuError>>,
}

/// The measurement of what `outs` recorded over `timing`.
pub(crate) fn summarize(
    repeat: u32,
    geo: &[NsGeometry],
    target_cpu: &CpuSource,
    timing: &Timing,
    outs: &[WorkerOutput],
    load_stats: Option<crate::load::LoadStats>,
) -> Measurement {
    let Timing {
        secs,
        self0,
        self1,
        tgt0,
        tgt1,
    } = timing;
    let secs = *secs;

    let mut total = WorkerOutput::default();
    for o in outs {
        total.merge(o);
    }
    let secs = secs.max(1e-9);
    let dir = |ops: u64, bytes: u64, h: &LatencyHist| DirStats {
        ops,
        bytes,
        iops: ops as f64 / secs,
        gbps: bytes as f64 / secs / 1e9,
        latency: h.summary(),
    };
    let mut all_hist = total.read_hist.clone();
    all_hist.merge(&total.write_hist);
    let all = dir(
        total.read_ops + total.write_ops,
        total.read_bytes + total.write_bytes,
        &all_hist,
    );
    let read = dir(total.read_ops, total.read_bytes, &total.read_hist);
    let write = dir(total.write_ops, total.write_bytes, &total.write_hist);

    let (client_s, reactor_s) = match (self0, self1) {
        (Ok(a), Ok(b)) => (
            Some(a.seconds_until(b, |n| {
                !n.starts_with(cpu::REACTOR_PREFIX) && !n.starts_with(cpu::LOAD_PREFIX)
            })),
            Some(a.seconds_until(b, |n| n.starts_with(cpu::REACTOR_PREFIX))),
        ),
        _ => (None, None),
    };
    let target_s = match target_cpu {
        CpuSource::Reactors => reactor_s,
        CpuSource::Processes(_) => match (tgt0, tgt1) {
            (Some(Ok(a)), Some(Ok(b))) => Some(a.seconds_until(b, |_| true)),
            _ => None,
        },
        CpuSource::None => None,
    };
    let client_s = client_s.unwrap_or(f64::NAN);
    let per_core = |cores: f64| {
        if cores > 0.0 && cores.is_finite() {
            Some(all.iops / cores)
        } else {
            None
        }
    };
    let target_cores = target_s.map(|s| s / secs);
    let client_cores = client_s / secs;
    let gb = all.bytes as f64 / 1e9;
    let cpu = CpuStats {
        target_cpu_s: target_s,
        client_cpu_s: client_s,
        target_cores,
        client_cores,
        iops_per_target_core: target_cores.and_then(per_core),
        iops_per_client_core: per_core(client_cores),
        cpu_s_per_gb: if gb > 0.0 {
            Some((client_s + target_s.unwrap_or(0.0)) / gb)
        } else {
            None
        },
    };

    let namespaces: Vec<NsStats> = total
        .per_ns
        .iter()
        .zip(geo)
        .map(|(n, g)| NsStats {
            target: g.target,
            nsid: g.nsid,
            ops: n.ops,
            iops: n.ops as f64 / secs,
            gbps: n.bytes as f64 / secs / 1e9,
            latency: n.hist.summary(),
        })
        .collect();
    let ns_spread = (namespaces.len() > 1).then(|| spread(&namespaces));

    let error = total
        .first_io_error
        .clone()
        .or_else(|| (all.ops == 0).then(|| "no I/O completed while measuring".to_string()));
    Measurement {
        repeat,
        ok: error.is_none() && total.verify_errors == 0,
        error,
        seconds: secs,
        all,
        read,
        write,
        cpu,
        namespaces,
        ns_spread,
        queue_reads: Vec::new(),
        queue_spread: None,
        verified_reads: total.verified_reads,
        verify_errors: total.verify_errors,
        first_verify_error: total.first_verify_error,
        io_errors: total.io_errors,
        first_io_error: total.first_io_error,
        load: load_stats,
        queues: None,
    }
}

/// The queues worker `w` of `numjobs` uses: one (`w % queue_pairs`) when there are at least as
/// many workers as queues, else every queue `q` with `q % numjobs == w`, so all queues carry I/O.
fn queues_of(w: usize, numjobs: usize, queue_pairs: usize) -> Vec<usize> {
    if numjobs >= queue_pairs {
        vec![w % queue_pairs.max(1)]
    } else {
        (0..queue_pairs).filter(|q| q % numjobs == w).collect()
    }
}

/// The spread of per-queue read counts over `secs` (`None` with fewer than two queues).
pub(crate) fn queue_spread(reads: &[u64], secs: f64) -> Option<QueueSpread> {
    if reads.len() < 2 || secs <= 0.0 {
        return None;
    }
    let iops: Vec<f64> = reads.iter().map(|&r| r as f64 / secs).collect();
    let mean = iops.iter().sum::<f64>() / iops.len() as f64;
    let min = iops.iter().copied().fold(f64::INFINITY, f64::min);
    let max = iops.iter().copied().fold(0.0, f64::max);
    let var = iops.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / iops.len() as f64;
    Some(QueueSpread {
        min_iops: min,
        max_iops: max,
        min_over_mean: if mean > 0.0 { min / mean } else { 0.0 },
        cv: if mean > 0.0 { var.sqrt() / mean } else { 0.0 },
    })
}

fn spread(ns: &[NsStats]) -> NsSpread {
    let iops: Vec<f64> = ns.iter().map(|n| n.iops).collect();
    let mean = iops.iter().sum::<f64>() / iops.len() as f64;
    let min = iops.iter().copied().fold(f64::INFINITY, f64::min);
    let max = iops.iter().copied().fold(0.0, f64::max);
    let var = iops.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / iops.len() as f64;
    let p99: Vec<f64> = ns.iter().map(|n| n.latency.p99_us).collect();
    let p99_min = p99.iter().copied().fold(f64::INFINITY, f64::min);
    let p99_max = p99.iter().copied().fold(0.0, f64::max);
    NsSpread {
        min_iops: min,
        max_iops: max,
        min_over_mean: if mean > 0.0 { min / mean } else { 0.0 },
        cv: if mean > 0.0 { var.sqrt() / mean } else { 0.0 },
        p99_max_over_min: if p99_min > 0.0 {
            p99_max / p99_min
        } else {
            0.0
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_of_uneven_queues() {
        assert_eq!(queue_spread(&[100], 1.0), None);
        let s = queue_spread(&[100, 300], 2.0).unwrap();
        assert_eq!((s.min_iops, s.max_iops), (50.0, 150.0));
        assert!((s.min_over_mean - 0.5).abs() < 1e-9);
        assert!((s.cv - 0.5).abs() < 1e-9);
    }

    #[test]
    fn spread_of_uneven_namespaces() {
        let ns = |iops: f64, p99: f64| NsStats {
            iops,
            latency: crate::hist::LatencySummary {
                p99_us: p99,
                ..Default::default()
            },
            ..Default::default()
        };
        let s = spread(&[ns(100.0, 10.0), ns(300.0, 30.0)]);
        assert_eq!((s.min_iops, s.max_iops), (100.0, 300.0));
        assert!((s.min_over_mean - 0.5).abs() < 1e-9);
        assert!((s.cv - 0.5).abs() < 1e-9);
        assert!((s.p99_max_over_min - 3.0).abs() < 1e-9);
    }

    #[test]
    fn every_queue_gets_a_worker() {
        assert_eq!(queues_of(0, 2, 1), vec![0]);
        assert_eq!(queues_of(1, 2, 1), vec![0]);
        assert_eq!(queues_of(3, 4, 2), vec![1]);
        assert_eq!(queues_of(0, 2, 5), vec![0, 2, 4]);
        assert_eq!(queues_of(1, 2, 5), vec![1, 3]);
    }

    #[test]
    fn region_rounds_down_and_checks_block_size() {
        let plan = Plan::resolve(
            &crate::job::JobFile::parse("[[job]]\nbs = \"8k\"\nsize = \"100k\"").unwrap(),
            &Default::default(),
        )
        .unwrap();
        let p = &plan.points[0];
        let geo = |bytes, block_size| NsGeometry {
            target: 0,
            nsid: 1,
            bytes,
            block_size,
        };
        assert_eq!(region_of(p, &[geo(1 << 30, 4096)]).unwrap(), 96 * 1024);
        // A size beyond the namespace is refused, never clamped to it.
        let err = region_of(p, &[geo(64 * 1024, 4096)]).unwrap_err();
        assert!(
            err.contains("size 100K is larger than the namespace (64K)"),
            "{err}"
        );
        assert!(region_of(p, &[geo(1 << 30, 16384)]).is_err());
        assert!(region_of(p, &[geo(4096, 4096)]).is_err());
    }

    #[test]
    fn client_workers_get_one_cpu_each_and_later_threads_the_list() {
        let cores = [8, 9, 10];
        let at = |i| client_thread_cpus("8-10", &cores, 4, i);
        // Four workers on three CPUs: in turn, the fourth shares the first's.
        assert_eq!(
            (at(0), at(1), at(2), at(3)),
            ("8".into(), "9".into(), "10".into(), "8".into())
        );
        // The blocking pool, started after the workers.
        assert_eq!(at(4), "8-10");
        assert_eq!(client_thread_cpus("", &[], 2, 0), "");
    }
}
