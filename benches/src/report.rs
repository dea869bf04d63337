//! Results: the JSON report (a stable schema), the markdown table, and medians over repeats.
//!
//! The JSON has `schema` = [`SCHEMA`]; fields are only ever added under that name. Layout:
//!
//! ```text
//! { schema, tool_version, started_utc, command, machine{..}, plan{..},
//!   points: [ { id, job, label, point{knobs}, results: [
//!       { mode, summary{iops, gbps, lat_*_us, cpu.., verify_errors, io_errors, ok, error},
//!         vs_das{iops_ratio, gbps_ratio, p50_ratio, p99_ratio} | null,
//!         repeats: [ { ..one measurement in full: read/write/all latency, cpu, namespaces.. } ] } ] } ] }
//! ```
//!
//! Every figure of a `summary` is a [`Stat`]: the median over repeats with min and max.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::hist::LatencySummary;
use crate::job::Point;
use crate::load::LoadStats;

/// Name and version of the JSON layout.
pub const SCHEMA: &str = "nvmeof-bench/1";

/// The machine the run was on.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Machine {
    /// Host name.
    pub hostname: String,
    /// CPUs this process may use (`nproc`).
    pub nproc: usize,
    /// CPU model from /proc/cpuinfo.
    pub cpu_model: String,
    /// Kernel release.
    pub kernel: String,
    /// Memory in GiB.
    pub memory_gib: f64,
}

impl Machine {
    /// Describes this machine.
    pub fn detect() -> Machine {
        let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
        let cpu_model = read("/proc/cpuinfo")
            .lines()
            .find(|l| l.starts_with("model name"))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
            .unwrap_or_else(|| "unknown".into());
        let memory_gib = read("/proc/meminfo")
            .lines()
            .find(|l| l.starts_with("MemTotal:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<f64>().ok())
            .map_or(0.0, |kb| (kb / (1024.0 * 1024.0) * 10.0).round() / 10.0);
        Machine {
            hostname: read("/proc/sys/kernel/hostname").trim().to_string(),
            nproc: crate::cpu::online_cpus(),
            cpu_model,
            kernel: read("/proc/sys/kernel/osrelease").trim().to_string(),
            memory_gib,
        }
    }
}

/// The run-wide settings, as reported.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PlanInfo {
    /// The job file's description.
    pub description: Option<String>,
    /// The job file, if one was given.
    pub job_file: Option<String>,
    /// Mode labels in run order.
    pub modes: Vec<String>,
    /// Backend of each namespace.
    pub backend: String,
    /// Namespaces.
    pub namespaces: u32,
    /// Reactor threads of the target the load generator starts.
    pub target_reactors: usize,
    /// Busy-poll window of the target's reactors in microseconds (0: event-driven).
    #[serde(default)]
    pub target_poll_us: u32,
    /// Busy-poll window of the initiator's queues in microseconds (0: event-driven).
    #[serde(default)]
    pub client_poll_us: u32,
    /// SQ flow control kept on at Connect (off: the initiator asked controllers to disable it).
    #[serde(default)]
    pub sq_flow_control: bool,
    /// Target CPUs.
    pub target_cpus: Option<String>,
    /// Client CPUs.
    pub client_cpus: Option<String>,
    /// Repeats.
    pub repeat: u32,
    /// Modes asked for that could not run here, with the reason (their rows are left out).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skipped_modes: Vec<String>,
}

impl PlanInfo {
    /// What the storage is: the backend for the modes that use the load generator's own
    /// storage (das, tcp, tcp-bin), and a target given by address for the others.
    pub fn storage(&self) -> String {
        let remote = |m: &&String| m.contains('@') || m.as_str() == "rdma";
        let (others, own): (Vec<&String>, Vec<&String>) = self.modes.iter().partition(remote);
        let join = |v: &[&String]| v.iter().map(|m| m.as_str()).collect::<Vec<_>>().join(", ");
        match (own.is_empty(), others.is_empty()) {
            (true, _) => format!("target at an address ({})", join(&others)),
            (false, true) => format!("backend {}", self.backend),
            (false, false) => format!(
                "backend {} ({}); {}: a target at an address",
                self.backend,
                join(&own),
                join(&others)
            ),
        }
    }
}

/// Reads or writes of one measurement.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct DirStats {
    /// I/Os completed.
    pub ops: u64,
    /// Bytes.
    pub bytes: u64,
    /// I/Os per second.
    pub iops: f64,
    /// GB/s (10^9 bytes).
    pub gbps: f64,
    /// Latency.
    pub latency: LatencySummary,
}

/// CPU use of one measurement.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct CpuStats {
    /// CPU seconds of the target (reactor threads or process); `None` where unknown or DAS.
    pub target_cpu_s: Option<f64>,
    /// CPU seconds of the load generator's own threads (workers, initiator, in DAS mode the
    /// backend too), without the target's reactors and the busy-load threads.
    pub client_cpu_s: f64,
    /// Target CPU seconds per second: cores' worth of CPU.
    pub target_cores: Option<f64>,
    /// Client CPU seconds per second.
    pub client_cores: f64,
    /// IOPS per target core (IOPS / target cores).
    pub iops_per_target_core: Option<f64>,
    /// IOPS per client core.
    pub iops_per_client_core: Option<f64>,
    /// CPU seconds per GB moved (target and client together).
    pub cpu_s_per_gb: Option<f64>,
}

/// One namespace in one measurement. A measurement lists the namespaces target by target
/// (with `targets = N` and `K` namespaces each, entry `t * K + k` is namespace `k` of target
/// `t`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct NsStats {
    /// The target (controller) serving it, from 0 (always 0 with one target and in das).
    #[serde(default)]
    pub target: u32,
    /// NSID (on its target).
    pub nsid: u32,
    /// I/Os.
    pub ops: u64,
    /// I/Os per second.
    pub iops: f64,
    /// GB/s.
    pub gbps: f64,
    /// Latency.
    pub latency: LatencySummary,
}

/// How evenly the namespaces were served.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct NsSpread {
    /// Lowest per-namespace IOPS.
    pub min_iops: f64,
    /// Highest per-namespace IOPS.
    pub max_iops: f64,
    /// Lowest IOPS as a fraction of the mean (1.0 = perfectly even; workers take the namespaces
    /// in turn, so it is 1.0 unless a namespace failed).
    pub min_over_mean: f64,
    /// Coefficient of variation of per-namespace IOPS.
    pub cv: f64,
    /// Highest per-namespace p99 latency over the lowest.
    pub p99_max_over_min: f64,
}

/// How evenly the I/O queues served the reads (GPU-issued points: reads each queue serving
/// rings started while measuring).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct QueueSpread {
    /// Lowest per-queue IOPS.
    pub min_iops: f64,
    /// Highest per-queue IOPS.
    pub max_iops: f64,
    /// Lowest IOPS as a fraction of the mean (1.0 = perfectly even).
    pub min_over_mean: f64,
    /// Coefficient of variation of per-queue IOPS.
    pub cv: f64,
}

/// One measurement of one point in one mode.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Measurement {
    /// Repeat number, from 0.
    pub repeat: u32,
    /// Whether it completed without any error.
    pub ok: bool,
    /// Why it did not run or did not finish.
    pub error: Option<String>,
    /// Measured seconds.
    pub seconds: f64,
    /// All I/Os.
    pub all: DirStats,
    /// Reads.
    pub read: DirStats,
    /// Writes.
    pub write: DirStats,
    /// CPU.
    pub cpu: CpuStats,
    /// Per namespace, of every target (target by target, see [`NsStats`]).
    pub namespaces: Vec<NsStats>,
    /// Spread over namespaces of every target (only with more than one).
    pub ns_spread: Option<NsSpread>,
    /// Reads each I/O queue serving GPU request rings started while measuring (GPU-issued
    /// points).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub queue_reads: Vec<u64>,
    /// Spread over those queues (only with more than one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_spread: Option<QueueSpread>,
    /// Reads checked against the pattern.
    pub verified_reads: u64,
    /// Reads that did not match.
    pub verify_errors: u64,
    /// The first mismatch.
    pub first_verify_error: Option<String>,
    /// Failed I/Os.
    pub io_errors: u64,
    /// The first failure.
    pub first_io_error: Option<String>,
    /// The busy-host load, when it ran.
    pub load: Option<LoadStats>,
    /// I/O queues actually used (fabric modes).
    pub queues: Option<usize>,
}

/// Median, minimum and maximum of a figure over repeats.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Stat {
    /// Median (mean of the middle two for an even count).
    pub median: f64,
    /// Minimum.
    pub min: f64,
    /// Maximum.
    pub max: f64,
    /// Values.
    pub n: usize,
}

impl Stat {
    /// The statistic of `values` (`None` when empty).
    pub fn of(values: &[f64]) -> Option<Stat> {
        let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        Some(Stat {
            median,
            min: v[0],
            max: v[n - 1],
            n,
        })
    }

    /// (max - min) / median, as a fraction.
    pub fn spread(&self) -> f64 {
        if self.median == 0.0 {
            0.0
        } else {
            (self.max - self.min) / self.median
        }
    }
}

/// Medians over the successful repeats of one point in one mode.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Every repeat succeeded.
    pub ok: bool,
    /// The first error of any repeat.
    pub error: Option<String>,
    /// IOPS.
    pub iops: Option<Stat>,
    /// GB/s.
    pub gbps: Option<Stat>,
    /// Mean latency (all I/Os), µs.
    pub lat_avg_us: Option<Stat>,
    /// Median latency, µs.
    pub lat_p50_us: Option<Stat>,
    /// p99 latency, µs.
    pub lat_p99_us: Option<Stat>,
    /// p99.9 latency, µs.
    pub lat_p999_us: Option<Stat>,
    /// p99.99 latency, µs.
    pub lat_p9999_us: Option<Stat>,
    /// Target cores used.
    pub target_cores: Option<Stat>,
    /// Client cores used.
    pub client_cores: Option<Stat>,
    /// IOPS per target core.
    pub iops_per_target_core: Option<Stat>,
    /// IOPS per client core.
    pub iops_per_client_core: Option<Stat>,
    /// Lowest per-namespace IOPS over the mean (workers take the namespaces in turn, so this
    /// is 1 unless a namespace failed; the latency spread is the telling figure).
    pub ns_min_over_mean: Option<Stat>,
    /// Highest per-namespace p99 latency over the lowest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ns_p99_max_over_min: Option<Stat>,
    /// Lowest per-queue IOPS over the mean (GPU-issued points).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_min_over_mean: Option<Stat>,
    /// Verify errors, all repeats.
    pub verify_errors: u64,
    /// Reads verified, all repeats.
    pub verified_reads: u64,
    /// I/O errors, all repeats.
    pub io_errors: u64,
}

impl Summary {
    /// Summarizes measurements.
    pub fn of(ms: &[Measurement]) -> Summary {
        let good: Vec<&Measurement> = ms.iter().filter(|m| m.error.is_none()).collect();
        let stat = |f: &dyn Fn(&Measurement) -> Option<f64>| {
            Stat::of(&good.iter().filter_map(|m| f(m)).collect::<Vec<_>>())
        };
        Summary {
            ok: !ms.is_empty() && ms.iter().all(|m| m.ok),
            error: ms.iter().find_map(|m| m.error.clone()),
            iops: stat(&|m| Some(m.all.iops)),
            gbps: stat(&|m| Some(m.all.gbps)),
            lat_avg_us: stat(&|m| Some(m.all.latency.avg_us)),
            lat_p50_us: stat(&|m| Some(m.all.latency.p50_us)),
            lat_p99_us: stat(&|m| Some(m.all.latency.p99_us)),
            lat_p999_us: stat(&|m| Some(m.all.latency.p999_us)),
            lat_p9999_us: stat(&|m| Some(m.all.latency.p9999_us)),
            target_cores: stat(&|m| m.cpu.target_cores),
            client_cores: stat(&|m| Some(m.cpu.client_cores)),
            iops_per_target_core: stat(&|m| m.cpu.iops_per_target_core),
            iops_per_client_core: stat(&|m| m.cpu.iops_per_client_core),
            ns_min_over_mean: stat(&|m| m.ns_spread.map(|s| s.min_over_mean)),
            ns_p99_max_over_min: stat(&|m| {
                m.ns_spread.map(|s| s.p99_max_over_min).filter(|&r| r > 0.0)
            }),
            queue_min_over_mean: stat(&|m| m.queue_spread.map(|s| s.min_over_mean)),
            verify_errors: ms.iter().map(|m| m.verify_errors).sum(),
            verified_reads: ms.iter().map(|m| m.verified_reads).sum(),
            io_errors: ms.iter().map(|m| m.io_errors).sum(),
        }
    }
}

/// A fabric mode against DAS on the same point (medians).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct VsDas {
    /// IOPS over DAS IOPS.
    pub iops_ratio: f64,
    /// GB/s over DAS GB/s.
    pub gbps_ratio: f64,
    /// Median latency over DAS median latency.
    pub p50_ratio: f64,
    /// p99 latency over DAS p99 latency.
    pub p99_ratio: f64,
}

/// One mode's results on one point.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ModeReport {
    /// Mode label.
    pub mode: String,
    /// Medians.
    pub summary: Summary,
    /// Against DAS, for fabric modes when DAS ran too.
    pub vs_das: Option<VsDas>,
    /// Every repeat.
    pub repeats: Vec<Measurement>,
}

/// One point and its results in every mode.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PointReport {
    /// Position in the run.
    pub id: usize,
    /// Job name.
    pub job: String,
    /// Short label.
    pub label: String,
    /// The knobs.
    pub point: Point,
    /// Per mode, in the plan's order.
    pub results: Vec<ModeReport>,
}

/// A whole run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    /// [`SCHEMA`].
    pub schema: String,
    /// The load generator's version.
    pub tool_version: String,
    /// When the run started (UTC, RFC 3339).
    pub started_utc: String,
    /// The command line.
    pub command: String,
    /// The machine.
    pub machine: Machine,
    /// Run-wide settings.
    pub plan: PlanInfo,
    /// Results.
    pub points: Vec<PointReport>,
}

impl Report {
    /// Fills in every mode's ratio against DAS.
    pub fn compute_ratios(&mut self) {
        for p in &mut self.points {
            let das = p
                .results
                .iter()
                .find(|r| r.mode == "das")
                .map(|r| r.summary.clone());
            for r in &mut p.results {
                r.vs_das = None;
                if r.mode == "das" {
                    continue;
                }
                let Some(d) = &das else { continue };
                let ratio = |a: Option<Stat>, b: Option<Stat>| match (a, b) {
                    (Some(a), Some(b)) if b.median > 0.0 => a.median / b.median,
                    _ => f64::NAN,
                };
                let v = VsDas {
                    iops_ratio: ratio(r.summary.iops, d.iops),
                    gbps_ratio: ratio(r.summary.gbps, d.gbps),
                    p50_ratio: ratio(r.summary.lat_p50_us, d.lat_p50_us),
                    p99_ratio: ratio(r.summary.lat_p99_us, d.lat_p99_us),
                };
                if v.iops_ratio.is_finite() {
                    r.vs_das = Some(v);
                }
            }
        }
    }

    /// Whether every measurement succeeded with no I/O or verify error.
    pub fn all_ok(&self) -> bool {
        self.points.iter().all(|p| {
            p.results
                .iter()
                .all(|r| r.summary.ok && r.summary.verify_errors == 0 && r.summary.io_errors == 0)
        })
    }

    /// The JSON text.
    pub fn to_json(&self) -> String {
        // Serializing plain data with finite or null floats cannot fail; NaN becomes null.
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }

    /// The markdown table (and a header describing the machine and the run).
    pub fn to_markdown(&self) -> String {
        let mut s = String::new();
        let m = &self.machine;
        let _ = writeln!(
            s,
            "nvmeof-bench {} | {} | {} CPUs ({}) | kernel {} | {}",
            self.tool_version,
            self.started_utc,
            m.nproc,
            m.cpu_model,
            m.kernel,
            self.plan.storage()
        );
        if let Some(d) = &self.plan.description {
            let _ = writeln!(s, "{d}");
        }
        for skipped in &self.plan.skipped_modes {
            let _ = writeln!(s, "skipped: {skipped}");
        }
        let repeats = self.plan.repeat;
        let _ = writeln!(
            s,
            "\n{}medians{}; point = pattern, block size, qdN = I/Os in flight per worker, xN = N workers (numjobs), qpN = N I/O queue pairs per controller, Ntgt = N targets, into-gpu = CPU-issued reads land in GPU memory; CPU = cores busy (CPU-s per s); IOPS/core = IOPS per target core (client core for das); verify = reads checked / errors\n",
            if repeats > 1 {
                format!("{repeats} repeats, ")
            } else {
                String::new()
            },
            if repeats > 1 {
                ", IOPS ±: half the max-min range over the median"
            } else {
                ""
            }
        );
        s.push_str("| point | mode | IOPS | GB/s | avg µs | p50 µs | p99 µs | p99.9 µs | p99.99 µs | target CPU | client CPU | IOPS/core | oF/DAS | verify |\n");
        s.push_str("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|\n");
        for p in &self.points {
            for r in &p.results {
                let sm = &r.summary;
                if let (Some(err), None) = (&sm.error, sm.iops) {
                    let _ = writeln!(
                        s,
                        "| {} | {} | error: {} | | | | | | | | | | | |",
                        p.label,
                        r.mode,
                        md_escape(err)
                    );
                    continue;
                }
                let iops = match sm.iops {
                    Some(st) if st.n > 1 => {
                        format!("{} ±{:.0}%", fmt_si(st.median), st.spread() * 50.0)
                    }
                    Some(st) => fmt_si(st.median),
                    None => "-".into(),
                };
                let per_core = if r.mode == "das" {
                    sm.iops_per_client_core
                } else {
                    sm.iops_per_target_core
                };
                let ratio = r
                    .vs_das
                    .map_or("-".into(), |v| format!("{:.2}", v.iops_ratio));
                let verify = if !p.point.reads() {
                    "- (no reads)".to_string()
                } else if sm.verified_reads == 0 && sm.verify_errors == 0 {
                    "off".to_string()
                } else if sm.verify_errors == 0 {
                    format!("{} ok", fmt_si(sm.verified_reads as f64))
                } else {
                    format!("**{} ERRORS**", sm.verify_errors)
                };
                let verify = if sm.io_errors > 0 {
                    format!("{verify}, **{} I/O errors**", sm.io_errors)
                } else {
                    verify
                };
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                    p.label,
                    r.mode,
                    iops,
                    med(sm.gbps, 3),
                    med(sm.lat_avg_us, 1),
                    med(sm.lat_p50_us, 1),
                    med(sm.lat_p99_us, 1),
                    med(sm.lat_p999_us, 1),
                    med(sm.lat_p9999_us, 1),
                    med(sm.target_cores, 2),
                    med(sm.client_cores, 2),
                    per_core.map_or("-".into(), |st| fmt_si(st.median)),
                    ratio,
                    verify
                );
            }
        }
        let spreads: Vec<String> = self
            .points
            .iter()
            .flat_map(|p| {
                p.results.iter().flat_map(move |r| {
                    // Workers take the namespaces in turn: their I/O counts are equal by
                    // construction, their latencies are not.
                    let ns = r.summary.ns_p99_max_over_min.map(|st| {
                        format!(
                            "{} / {}: p99 latency of the slowest namespace at {:.2}x the fastest's",
                            p.label, r.mode, st.median
                        )
                    });
                    let q = r.summary.queue_min_over_mean.map(|st| {
                        format!(
                            "{} / {}: slowest queue at {:.1}% of the mean IOPS",
                            p.label,
                            r.mode,
                            st.median * 100.0
                        )
                    });
                    ns.into_iter().chain(q)
                })
            })
            .collect();
        if !spreads.is_empty() {
            s.push_str("\nPer-namespace and per-queue spread:\n");
            for l in spreads {
                let _ = writeln!(s, "- {l}");
            }
        }
        s
    }
}

fn md_escape(s: &str) -> String {
    s.replace('|', "\\|").replace('\n', " ")
}

fn med(s: Option<Stat>, decimals: usize) -> String {
    match s {
        Some(st) => format!("{:.*}", decimals, st.median),
        None => "-".into(),
    }
}

/// `412.3K`, `1.37M`, `950`: counts with an SI suffix.
pub fn fmt_si(v: f64) -> String {
    if !v.is_finite() {
        "-".into()
    } else if v >= 1e9 {
        format!("{:.2}G", v / 1e9)
    } else if v >= 1e6 {
        format!("{:.2}M", v / 1e6)
    } else if v >= 1e4 {
        format!("{:.1}K", v / 1e3)
    } else if v >= 1e3 {
        format!("{:.2}K", v / 1e3)
    } else {
        format!("{v:.0}")
    }
}

/// Seconds since the epoch as RFC 3339 UTC (`2026-11-22T03:04:05Z`).
pub fn rfc3339_utc(unix_secs: u64) -> String {
    let days = unix_secs / 86_400;
    let rem = unix_secs % 86_400;
    // Civil-from-days (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let mut y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    if m <= 2 {
        y += 1;
    }
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// The current time as RFC 3339 UTC.
pub fn now_utc() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    rfc3339_utc(secs)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::job::{JobFile, Overrides, Plan};

    pub(crate) fn measurement(iops: f64, p50: f64, repeat: u32) -> Measurement {
        let lat = LatencySummary {
            samples: 100,
            min_us: p50 / 2.0,
            avg_us: p50 * 1.1,
            stdev_us: 1.0,
            p50_us: p50,
            p90_us: p50 * 1.5,
            p99_us: p50 * 2.0,
            p999_us: p50 * 3.0,
            p9999_us: p50 * 4.0,
            max_us: p50 * 5.0,
            clamped: 0,
        };
        Measurement {
            repeat,
            ok: true,
            seconds: 1.0,
            all: DirStats {
                ops: iops as u64,
                bytes: iops as u64 * 4096,
                iops,
                gbps: iops * 4096.0 / 1e9,
                latency: lat,
            },
            read: DirStats::default(),
            cpu: CpuStats {
                target_cpu_s: Some(0.5),
                client_cpu_s: 0.8,
                target_cores: Some(0.5),
                client_cores: 0.8,
                iops_per_target_core: Some(iops / 0.5),
                iops_per_client_core: Some(iops / 0.8),
                cpu_s_per_gb: Some(1.0),
            },
            verified_reads: 100,
            namespaces: vec![
                NsStats {
                    nsid: 1,
                    ops: 60,
                    iops: iops * 0.6,
                    ..Default::default()
                },
                NsStats {
                    nsid: 2,
                    ops: 40,
                    iops: iops * 0.4,
                    ..Default::default()
                },
            ],
            ns_spread: Some(NsSpread {
                min_iops: iops * 0.4,
                max_iops: iops * 0.6,
                min_over_mean: 0.8,
                cv: 0.2,
                p99_max_over_min: 1.5,
            }),
            ..Default::default()
        }
    }

    pub(crate) fn sample_report() -> Report {
        let plan = Plan::resolve(
            &JobFile::parse("[[job]]\nname = \"j\"\niodepth = [1, 32]").unwrap(),
            &Overrides::default(),
        )
        .unwrap();
        let mut points = Vec::new();
        for (i, p) in plan.points.iter().enumerate() {
            let scale = (i + 1) as f64;
            points.push(PointReport {
                id: i,
                job: p.job.clone(),
                label: p.label(),
                point: p.clone(),
                results: vec![
                    ModeReport {
                        mode: "das".into(),
                        summary: Summary::of(&[
                            measurement(100_000.0 * scale, 10.0, 0),
                            measurement(110_000.0 * scale, 11.0, 1),
                            measurement(90_000.0 * scale, 9.0, 2),
                        ]),
                        vs_das: None,
                        repeats: vec![measurement(100_000.0 * scale, 10.0, 0)],
                    },
                    ModeReport {
                        mode: "tcp".into(),
                        summary: Summary::of(&[measurement(80_000.0 * scale, 20.0, 0)]),
                        vs_das: None,
                        repeats: vec![measurement(80_000.0 * scale, 20.0, 0)],
                    },
                ],
            });
        }
        let mut r = Report {
            schema: SCHEMA.into(),
            tool_version: "0.1.0".into(),
            started_utc: rfc3339_utc(0),
            command: "nvmeof-bench --quick".into(),
            machine: Machine {
                hostname: "h".into(),
                nproc: 2,
                cpu_model: "cpu <x> & y".into(),
                kernel: "6.1".into(),
                memory_gib: 24.0,
            },
            plan: PlanInfo {
                modes: vec!["das".into(), "tcp".into()],
                backend: "mem:1G".into(),
                namespaces: 2,
                repeat: 3,
                ..Default::default()
            },
            points,
        };
        r.compute_ratios();
        r
    }

    #[test]
    fn stat_median_and_spread() {
        let s = Stat::of(&[3.0, 1.0, 2.0]).unwrap();
        assert_eq!((s.median, s.min, s.max, s.n), (2.0, 1.0, 3.0, 3));
        assert_eq!(Stat::of(&[1.0, 2.0, 3.0, 10.0]).unwrap().median, 2.5);
        assert!((s.spread() - 1.0).abs() < 1e-9);
        assert!(Stat::of(&[]).is_none());
        assert!(Stat::of(&[f64::NAN]).is_none());
    }

    #[test]
    fn summary_uses_medians_and_ratios_follow() {
        let r = sample_report();
        let das = &r.points[0].results[0];
        assert_eq!(das.summary.iops.unwrap().median, 100_000.0);
        assert_eq!(das.summary.lat_p50_us.unwrap().median, 10.0);
        assert_eq!(das.summary.verified_reads, 300);
        assert!(das.vs_das.is_none());
        let tcp = &r.points[0].results[1];
        let v = tcp.vs_das.unwrap();
        assert!((v.iops_ratio - 0.8).abs() < 1e-9);
        assert!((v.p50_ratio - 2.0).abs() < 1e-9);
        assert!(r.all_ok());
    }

    #[test]
    fn failed_repeats_are_reported_not_averaged() {
        let mut bad = measurement(1.0, 1.0, 1);
        bad.ok = false;
        bad.error = Some("target went away".into());
        let s = Summary::of(&[measurement(100.0, 5.0, 0), bad]);
        assert!(!s.ok);
        assert_eq!(s.error.as_deref(), Some("target went away"));
        assert_eq!(s.iops.unwrap().n, 1);
        assert_eq!(s.iops.unwrap().median, 100.0);
    }

    #[test]
    fn json_has_the_stable_schema() {
        let r = sample_report();
        let v: serde_json::Value = serde_json::from_str(&r.to_json()).unwrap();
        assert_eq!(v["schema"], SCHEMA);
        for key in [
            "tool_version",
            "started_utc",
            "command",
            "machine",
            "plan",
            "points",
        ] {
            assert!(v.get(key).is_some(), "missing {key}");
        }
        let p = &v["points"][1];
        assert_eq!(p["point"]["iodepth"], 32);
        assert_eq!(p["point"]["rw"], "randread");
        assert_eq!(p["point"]["sweep"][0], "iodepth");
        let tcp = &p["results"][1];
        assert_eq!(tcp["mode"], "tcp");
        for key in [
            "iops",
            "gbps",
            "lat_avg_us",
            "lat_p50_us",
            "lat_p99_us",
            "lat_p999_us",
            "lat_p9999_us",
            "target_cores",
            "client_cores",
            "iops_per_target_core",
        ] {
            assert!(tcp["summary"][key]["median"].is_number(), "{key}");
        }
        assert!(tcp["vs_das"]["iops_ratio"].is_number());
        let m = &tcp["repeats"][0];
        for key in ["p50_us", "p99_us", "p999_us", "p9999_us", "avg_us"] {
            assert!(m["all"]["latency"][key].is_number(), "{key}");
        }
        assert!(m["cpu"]["iops_per_target_core"].is_number());
        assert_eq!(m["namespaces"].as_array().unwrap().len(), 2);
        assert!(m["ns_spread"]["min_over_mean"].is_number());
        assert_eq!(v["machine"]["nproc"], 2);
        // The measurement round-trips through its own schema.
        let back: Measurement = serde_json::from_value(m.clone()).unwrap();
        assert_eq!(back, r.points[1].results[1].repeats[0]);
    }

    #[test]
    fn markdown_table_has_a_row_per_point_and_mode() {
        let r = sample_report();
        let md = r.to_markdown();
        let rows: Vec<&str> = md.lines().filter(|l| l.starts_with("| randread")).collect();
        assert_eq!(rows.len(), 4, "{md}");
        assert!(
            rows[0].contains("| das |") && rows[0].contains("100.0K ±10%"),
            "{md}"
        );
        assert!(
            rows[1].contains("| tcp |") && rows[1].contains("| 0.80 |"),
            "{md}"
        );
        let header = md.lines().find(|l| l.starts_with("| point")).unwrap();
        assert_eq!(
            header.matches('|').count(),
            rows[0].matches('|').count(),
            "{md}"
        );
        assert!(md.contains("300 ok"));
        // Namespaces are taken in turn: their latency spread is reported, not their equal
        // I/O counts.
        assert!(
            md.contains("p99 latency of the slowest namespace at 1.50x the fastest's"),
            "{md}"
        );
        assert!(!md.contains("of the mean"), "{md}");
        // The point labels are explained.
        assert!(md.contains("xN = N workers (numjobs)"), "{md}");
    }

    #[test]
    fn header_names_the_storage_of_each_mode() {
        let mut info = PlanInfo {
            modes: vec!["das".into(), "tcp".into()],
            backend: "mem:1G".into(),
            ..Default::default()
        };
        assert_eq!(info.storage(), "backend mem:1G");
        info.modes = vec!["tcp@10.0.0.2:4420".into()];
        assert_eq!(info.storage(), "target at an address (tcp@10.0.0.2:4420)");
        info.modes = vec!["das".into(), "rdma@10.0.0.2:4420".into()];
        assert_eq!(
            info.storage(),
            "backend mem:1G (das); rdma@10.0.0.2:4420: a target at an address"
        );
    }

    #[test]
    fn markdown_shows_errors() {
        let mut r = sample_report();
        r.points[0].results[1].summary = Summary::of(&[Measurement {
            error: Some("not available | here".into()),
            ..Default::default()
        }]);
        r.points[1].results[1].summary.verify_errors = 3;
        let md = r.to_markdown();
        assert!(md.contains("error: not available \\| here"), "{md}");
        assert!(md.contains("**3 ERRORS**"), "{md}");
        assert!(!r.all_ok());
    }

    #[test]
    fn formatting_helpers() {
        assert_eq!(fmt_si(950.0), "950");
        assert_eq!(fmt_si(1500.0), "1.50K");
        assert_eq!(fmt_si(412_300.0), "412.3K");
        assert_eq!(fmt_si(1_370_000.0), "1.37M");
        assert_eq!(rfc3339_utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339_utc(1_795_000_000), "2026-11-18T11:06:40Z");
        assert_eq!(rfc3339_utc(951_782_400), "2000-02-29T00:00:00Z");
    }
}
