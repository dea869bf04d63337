//! The target's Prometheus endpoint as an operator uses it: Debian's `prometheus` server
//! scrapes a running `nvmeof-targetd` every second, the figures are read back through the
//! server's HTTP API while the `nvmeof` CLI (and a raw host, for an error and a protocol
//! violation) move data, and `promtool check metrics` accepts a scrape.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nvme_spec::SglDescriptor;
use nvme_spec::command::build;
use nvmeof_tests::{
    RawHost, Reply, TargetProcess, bin_path, free_port, http_get, promtool_accepts,
};

const NQN: &str = "nqn.2026-11.io.example:metrics";

/// Whether Debian's prometheus and promtool are installed; under CI their absence fails.
fn prometheus_installed() -> bool {
    let found = ["prometheus", "promtool"].iter().all(|b| {
        Command::new(b)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    });
    if !found {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "prometheus and promtool are not installed (scripts/test.sh installs them)"
        );
        eprintln!(
            "skipped: prometheus and promtool are not installed (apt-get install prometheus)"
        );
    }
    found
}

/// Percent-encodes a query for a URL.
fn encode(q: &str) -> String {
    q.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'_' | b'.' | b'-' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A Prometheus server with its own storage, scraping `target` every second.
struct Prometheus {
    child: Child,
    addr: SocketAddr,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    fn start(target: SocketAddr) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n\
                 scrape_configs:\n  - job_name: nvmeof\n    static_configs:\n      - targets: ['{target}']\n"
            ),
        )
        .unwrap();
        let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("log")).unwrap())
            .spawn()
            .expect("start prometheus");
        Prometheus {
            child,
            addr,
            _dir: dir,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self._dir.path().join("log")).unwrap_or_default()
    }

    /// The value of the instant query `q`, None while it has no result.
    fn query(&self, q: &str) -> Option<f64> {
        let (code, body) =
            http_get(self.addr, &format!("/api/v1/query?query={}", encode(q))).ok()?;
        if code != 200 {
            return None;
        }
        let v: serde_json::Value = serde_json::from_str(&body).ok()?;
        v["data"]["result"][0]["value"][1].as_str()?.parse().ok()
    }

    /// Waits (at most 60 s) until `q` satisfies `ok`; fails with the last value otherwise.
    fn wait_for(&self, q: &str, what: &str, ok: impl Fn(f64) -> bool) -> f64 {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut last = None;
        while Instant::now() < deadline {
            last = self.query(q);
            if let Some(v) = last.filter(|v| ok(*v)) {
                return v;
            }
            std::thread::sleep(Duration::from_millis(300));
        }
        panic!(
            "{what}: `{q}` is {last:?} after 60 s\nprometheus log:\n{}",
            self.log()
        );
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `nvmeof ARGS` against the target; asserts success.
fn cli(t: &TargetProcess, args: &[&str]) {
    let port = t.port.to_string();
    let out = Command::new(bin_path("nvmeof"))
        .args(args)
        .args([
            "-t",
            "tcp",
            "-a",
            "127.0.0.1",
            "--trsvcid",
            &port,
            "-n",
            NQN,
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "nvmeof {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn prometheus_scrapes_counters_that_follow_io() {
    if !prometheus_installed() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let file_ns = format!("file:{},size=8M", dir.path().join("ns2.img").display());
    let args = [
        "--subsystem",
        NQN,
        "--namespace",
        "mem:16M",
        "--namespace",
        &file_ns,
    ];
    let (t, metrics) = TargetProcess::with_metrics(&args);

    // The endpoint: 404 elsewhere, a clean scrape before any I/O.
    assert_eq!(http_get(metrics, "/").unwrap().0, 404);
    let (code, before) = http_get(metrics, "/metrics").unwrap();
    assert_eq!(code, 200, "{before}");
    assert!(!before.contains("nvmeof_io_commands_total{"), "{before}");
    promtool_accepts(&before);

    let prom = Prometheus::start(metrics);
    prom.wait_for("up{job=\"nvmeof\"}", "the target is scraped", |v| v == 1.0);
    prom.wait_for(
        &format!("nvmeof_controllers{{subsystem=\"{NQN}\"}}"),
        "no controller before I/O",
        |v| v == 0.0,
    );

    // 256 KiB written to and read back from each namespace (memory: inline; file: a backend
    // that waits).
    let data: Vec<u8> = (0..256 * 1024u32).map(|i| (i * 31 % 251) as u8).collect();
    let input = dir.path().join("in.bin");
    std::fs::write(&input, &data).unwrap();
    for nsid in ["1", "2"] {
        let input = input.to_str().unwrap();
        let output = dir.path().join(format!("out{nsid}.bin"));
        let output = output.to_str().unwrap();
        let range = [
            "--namespace-id",
            nsid,
            "--start-block",
            "8",
            "--blocks",
            "64",
        ];
        cli(&t, &[&["write"], &range[..], &["--data", input]].concat());
        cli(&t, &[&["read"], &range[..], &["--data", output]].concat());
        assert!(std::fs::read(output).unwrap() == data, "namespace {nsid}");
    }
    let sel = |nsid: &str| format!("subsystem=\"{NQN}\",nsid=\"{nsid}\"");
    for nsid in ["1", "2"] {
        for dir in ["read", "write"] {
            prom.wait_for(
                &format!("nvmeof_io_bytes_total{{{},direction=\"{dir}\"}}", sel(nsid)),
                "bytes follow the I/O",
                |v| v == data.len() as f64,
            );
        }
        for op in ["read", "write"] {
            prom.wait_for(
                &format!("nvmeof_io_commands_total{{{},opcode=\"{op}\"}}", sel(nsid)),
                "commands follow the I/O",
                |v| v >= 1.0,
            );
            prom.wait_for(
                &format!(
                    "nvmeof_io_latency_seconds_count{{{},opcode=\"{op}\"}}",
                    sel(nsid)
                ),
                "latency is observed",
                |v| v >= 1.0,
            );
        }
        prom.wait_for(
            &format!("nvmeof_io_queue_depth{{{}}}", sel(nsid)),
            "nothing left running",
            |v| v == 0.0,
        );
    }
    prom.wait_for(
        &format!("nvmeof_admin_commands_total{{subsystem=\"{NQN}\",opcode=\"identify\"}}"),
        "admin commands are counted",
        |v| v >= 1.0,
    );

    // A live controller, a read past the end of namespace 2 and a protocol violation.
    let (_admin, cntlid) = RawHost::admin(t.addr(), NQN);
    let mut io = RawHost::io_queue(t.addr(), NQN, cntlid, 1);
    let mut past_end = build::read_write(false, 5, 2, 4096, 1);
    past_end.dptr = SglDescriptor::tcp_transport(4096);
    match io.command(&past_end, &[], &[]) {
        Reply::Completion(c, _) => assert!(!c.status().is_success()),
        other => panic!("{other:?}"),
    }
    prom.wait_for(
        &format!("nvmeof_controllers{{subsystem=\"{NQN}\"}}"),
        "the raw host's controller is live",
        |v| v == 1.0,
    );
    prom.wait_for(
        &format!(
            "nvmeof_io_errors_total{{{},status=\"LBA Out of Range\",sct=\"0x0\",sc=\"0x80\"}}",
            sel("2")
        ),
        "errors are counted by status",
        |v| v == 1.0,
    );
    let mut bad = RawHost::connect(t.addr(), false, false);
    let mut junk = vec![0u8; 24];
    junk[0] = 0x0F;
    junk[2] = 24;
    junk[4..8].copy_from_slice(&24u32.to_le_bytes());
    RawHost::send_raw(&mut bad.stream, &junk);
    RawHost::read_to_close(&mut bad.stream);
    prom.wait_for(
        "nvmeof_protocol_errors_total{transport=\"tcp\"}",
        "protocol errors are counted",
        |v| v == 1.0,
    );
    prom.wait_for("nvmeof_connections", "connections are counted", |v| {
        v >= 2.0
    });

    // A second daemon cannot take the same endpoint: one line, non-zero exit.
    let out = Command::new(bin_path("nvmeof-targetd"))
        .args([
            "--listen",
            "tcp://127.0.0.1:0",
            "--metrics",
            &metrics.to_string(),
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains(&format!("cannot bind the metrics endpoint {metrics}")),
        "{stderr}"
    );

    let (code, after) = http_get(metrics, "/metrics").unwrap();
    assert_eq!(code, 200);
    promtool_accepts(&after);
    let (code, log) = t.terminate();
    assert_eq!(code, Some(0), "{log}");
}

#[test]
fn head_process_series_build_info_and_refused_connects() {
    use std::io::{Read, Write};
    let args = [
        "--subsystem",
        NQN,
        "--namespace",
        "mem:1M",
        "--host",
        nvmeof_tests::TEST_HOSTNQN,
    ];
    let (t, metrics) = TargetProcess::with_metrics(&args);
    // A host that is not allowed: refused and counted.
    let mut h = nvmeof_tests::RawHost::connect(t.addr(), false, false);
    let c = h.fabrics_connect(NQN, "nqn.2026-11.io.example:not-allowed", 0, 0xFFFF);
    assert!(!c.status().is_success());
    drop(h);
    // HEAD: the GET's head, no body.
    let mut s = std::net::TcpStream::connect(metrics).unwrap();
    write!(s, "HEAD /metrics HTTP/1.0\r\n\r\n").unwrap();
    let mut reply = String::new();
    s.read_to_string(&mut reply).unwrap();
    assert!(reply.starts_with("HTTP/1.1 200 OK\r\n"), "{reply}");
    assert!(reply.ends_with("\r\n\r\n"), "no body: {reply}");
    assert!(!reply.contains("Content-Length: 0\r\n"), "{reply}");
    let (code, scrape) = nvmeof_tests::http_get(metrics, "/metrics").unwrap();
    assert_eq!(code, 200);
    let version = env!("CARGO_PKG_VERSION");
    let build = format!("nvmeof_build_info{{version=\"{version}\"}}");
    assert_eq!(
        nvmeof_tests::scraped(&scrape, &build),
        Some(1.0),
        "{scrape}"
    );
    let refused = r#"nvmeof_connects_refused_total{reason="host_not_allowed"}"#;
    assert_eq!(
        nvmeof_tests::scraped(&scrape, refused),
        Some(1.0),
        "{scrape}"
    );
    // A daemon that has just started may have used less than one clock tick of CPU.
    let cpu = nvmeof_tests::scraped(&scrape, "process_cpu_seconds_total{}");
    assert!(cpu.is_some_and(|v| v >= 0.0), "{cpu:?}\n{scrape}");
    for series in [
        "process_resident_memory_bytes",
        "process_open_fds",
        "process_max_fds",
        "process_start_time_seconds",
    ] {
        let v = nvmeof_tests::scraped(&scrape, &format!("{series}{{}}"));
        assert!(v.is_some_and(|v| v > 0.0), "{series}: {v:?}\n{scrape}");
    }
    let rss = nvmeof_tests::scraped(&scrape, "process_resident_memory_bytes{}").unwrap();
    assert!(rss as u64 > t.rss_kib() * 1024 / 4, "RSS {rss}");
    promtool_accepts(&scrape);
    drop(t);
}
