//! The Prometheus endpoint: a running target's figures ([`Target::metrics_snapshot`], added
//! up from the counter cells of [`crate::metrics`] at every scrape) and the process's own, in
//! the OpenMetrics or Prometheus text format, served over a small HTTP server on the control
//! runtime.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tracing::{debug, warn};

use crate::metrics::{
    IO_OPS, IoFigures, LATENCY_BUCKETS, MetricsSnapshot, bucket_bound_s, status_label,
};
use crate::target::Target;

impl Target {
    /// The target's figures now (a scrape adds up every live queue's cells).
    pub fn metrics_snapshot(&self) -> MetricsSnapshot {
        let mut snap = MetricsSnapshot {
            connections: self.connection_count() as u64,
            memory_budget_bytes: self.memory.limit(),
            memory_in_use_bytes: self.memory.in_use(),
            protocol_errors: BTreeMap::new(),
            host_term_reqs: BTreeMap::new(),
            connects_refused: BTreeMap::new(),
            auth_failures: BTreeMap::new(),
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
        };
        self.metrics.add_to(&mut snap);
        snap
    }
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
