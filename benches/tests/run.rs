//! Short real runs of every available mode, checked for sane values (no timing thresholds).

use std::process::Command;
use std::time::Duration;

use nvmeof_bench::job::{JobFile, Mode, Overrides, Plan, TcpTarget};
use nvmeof_bench::report::{Measurement, Report, SCHEMA};
use nvmeof_bench::run::{RDMA_UNAVAILABLE, RunOptions, run};

const JOB: &str = r#"
[global]
backend = "mem:64M"
namespaces = 2
target_reactors = 1
size = "8M"
runtime = "700ms"
ramp_time = "150ms"
verify = true

[[job]]
name = "rand"
rw = "randread"
bs = "4k"
iodepth = 8
numjobs = 2
queue_pairs = 2

[[job]]
name = "mix"
rw = "randrw"
rwmixread = 60
bs = "8k"
iodepth = 4

[[job]]
name = "seq"
rw = "read"
bs = "128k"
iodepth = 2

[[job]]
name = "mix-rtc"
rw = "randrw"
rwmixread = 60
bs = "8k"
iodepth = 4
numjobs = 1
queue_pairs = 2
api = "rtc"
"#;

fn run_modes(modes: Vec<Mode>) -> Report {
    let file = JobFile::parse(JOB).unwrap();
    let plan = Plan::resolve(
        &file,
        &Overrides {
            modes: Some(modes),
            ..Default::default()
        },
    )
    .unwrap();
    run(
        &plan,
        &RunOptions {
            command: "test".into(),
            job_file: None,
            progress: false,
        },
    )
    .unwrap()
}

fn check_sane(m: &Measurement, mode: &str, reads: bool, fabric: bool) {
    assert!(m.ok, "{mode}: {m:?}");
    assert!(m.error.is_none());
    assert!(m.all.iops > 0.0 && m.all.gbps > 0.0, "{mode}: {m:?}");
    assert!(m.seconds > 0.5 && m.seconds < 5.0, "{mode}: {}", m.seconds);
    assert_eq!(m.verify_errors, 0);
    assert_eq!(m.io_errors, 0);
    if reads {
        assert!(m.verified_reads > 0, "{mode}: reads were not verified");
    }
    assert!(m.all.latency.is_ordered(), "{mode}: {:?}", m.all.latency);
    assert!(m.all.latency.p50_us > 0.0);
    assert_eq!(m.all.latency.samples, m.all.ops);
    assert_eq!(m.read.ops + m.write.ops, m.all.ops);
    assert!(m.cpu.client_cpu_s > 0.0, "{mode}: {:?}", m.cpu);
    if fabric {
        let t = m
            .cpu
            .target_cpu_s
            .expect("in-process target CPU is measured");
        assert!(t > 0.0, "{mode}: the target did work but used no CPU?");
        assert!(m.cpu.iops_per_target_core.unwrap() > 0.0);
    } else {
        assert!(m.cpu.target_cpu_s.is_none());
    }
    // Two namespaces, both used, counts adding up.
    assert_eq!(m.namespaces.len(), 2);
    assert!(m.namespaces.iter().all(|n| n.ops > 0));
    assert_eq!(m.namespaces.iter().map(|n| n.ops).sum::<u64>(), m.all.ops);
    let s = m.ns_spread.expect("spread with two namespaces");
    assert!(s.min_over_mean > 0.0 && s.min_over_mean <= 1.0);
}

#[test]
fn das_and_tcp_in_process_side_by_side() {
    let r = run_modes(vec![Mode::Das, Mode::Tcp(TcpTarget::InProcess)]);
    assert_eq!(r.points.len(), 4);
    for p in &r.points {
        assert_eq!(p.results.len(), 2);
        let reads = p.point.reads();
        let das = &p.results[0];
        let tcp = &p.results[1];
        assert_eq!((das.mode.as_str(), tcp.mode.as_str()), ("das", "tcp"));
        check_sane(&das.repeats[0], "das", reads, false);
        check_sane(&tcp.repeats[0], "tcp", reads, true);
        let v = tcp.vs_das.expect("ratio against DAS");
        assert!(v.iops_ratio > 0.0 && v.iops_ratio.is_finite());
        assert!(das.vs_das.is_none());
        if p.job.starts_with("mix") {
            let m = &tcp.repeats[0];
            assert!(m.read.ops > 0 && m.write.ops > 0, "{m:?}");
        }
        if p.job == "rand" {
            assert_eq!(tcp.repeats[0].queues, Some(2));
        }
    }
    assert!(r.all_ok());
    // The JSON of a real run parses and keeps its schema.
    let v: serde_json::Value = serde_json::from_str(&r.to_json()).unwrap();
    assert_eq!(v["schema"], SCHEMA);
    let s = &v["points"][0]["results"][1]["summary"];
    assert!(s["iops"]["median"].as_f64().unwrap() > 0.0);
    assert!(
        s["lat_p50_us"]["median"].as_f64().unwrap() <= s["lat_p99_us"]["median"].as_f64().unwrap()
    );
    assert!(
        s["lat_p99_us"]["median"].as_f64().unwrap()
            <= s["lat_p9999_us"]["median"].as_f64().unwrap()
    );
    let md = r.to_markdown();
    assert_eq!(
        md.lines().filter(|l| l.contains("| tcp |")).count(),
        4,
        "{md}"
    );
}

#[test]
fn unavailable_modes_and_destinations_say_why() {
    // Plain rdma names no target: it is skipped with its reason, and alone it is an error.
    let file = JobFile::parse(JOB).unwrap();
    let ov = |modes| Overrides {
        modes: Some(modes),
        ..Default::default()
    };
    let plan = Plan::resolve(&file, &ov(vec![Mode::Das, Mode::Rdma { addr: None }])).unwrap();
    assert_eq!(plan.modes, vec![Mode::Das]);
    assert_eq!(plan.skipped, vec![format!("rdma: {RDMA_UNAVAILABLE}")]);
    let e = Plan::resolve(&file, &ov(vec![Mode::Rdma { addr: None }])).unwrap_err();
    assert!(e.to_string().contains(RDMA_UNAVAILABLE), "{e}");

    // Writes have nothing to land in GPU memory.
    let file =
        JobFile::parse("[[job]]\ndest = \"gpu\"\nrw = \"randwrite\"\nruntime = \"100ms\"").unwrap();
    let plan = Plan::resolve(
        &file,
        &Overrides {
            modes: Some(vec![Mode::Das]),
            backend: Some("mem:16M".parse().unwrap()),
            ..Default::default()
        },
    )
    .unwrap();
    let r = run(&plan, &RunOptions::default()).unwrap();
    let err = r.points[0].results[0]
        .summary
        .error
        .clone()
        .unwrap_or_default();
    assert!(err.contains("destination gpu measures reads"), "{err}");
}

/// `dest = "gpu"`: reads land in GPU memory in DAS and NVMe/TCP mode, large blocks one by one
/// and small ones gathered in batches, and every block is verified after copying it back;
/// without a CUDA driver each point fails with one line that says so (what CI without a GPU
/// checks).
#[test]
fn gpu_destination_reads_into_device_memory_or_says_why_not() {
    let job = |bs: &str, depth: u32| {
        format!(
            "[[job]]\ndest = \"gpu\"\nrw = \"randread\"\nbs = \"{bs}\"\niodepth = {depth}\nnumjobs = 2\nruntime = \"300ms\"\nsize = \"8M\"\n"
        )
    };
    let file = JobFile::parse(&(job("128k", 4) + &job("4k", 32))).unwrap();
    let plan = Plan::resolve(
        &file,
        &Overrides {
            modes: Some(vec![Mode::Das, Mode::Tcp(TcpTarget::InProcess)]),
            backend: Some("mem:16M".parse().unwrap()),
            ..Default::default()
        },
    )
    .unwrap();
    let r = run(&plan, &RunOptions::default()).unwrap();
    let gpu = nvmeof_initiator::gpu::cuda::driver_available();
    assert_eq!(r.points.len(), 2);
    for res in r.points.iter().flat_map(|p| &p.results) {
        let s = &res.summary;
        if gpu {
            assert!(s.error.is_none(), "{:?}", s.error);
            let m = &res.repeats[0];
            assert!(m.ok && m.read.ops > 0, "{m:?}");
            assert!(m.verified_reads > 0 && m.verify_errors == 0, "{m:?}");
        } else {
            let err = s.error.clone().unwrap_or_default();
            assert!(err.starts_with("destination gpu: "), "{err}");
            println!("SKIP gpu_destination_reads_into_device_memory_or_says_why_not: {err}");
        }
    }
}

#[test]
fn io_size_bounded_run_transfers_what_was_asked() {
    let file = JobFile::parse(
        "[global]\nbackend = \"mem:16M\"\n[[job]]\nrw = \"write\"\nbs = \"64k\"\niodepth = 4\nnumjobs = 2\nio_size = \"8M\"",
    )
    .unwrap();
    let plan = Plan::resolve(
        &file,
        &Overrides {
            modes: Some(vec![Mode::Das, Mode::Tcp(TcpTarget::InProcess)]),
            ..Default::default()
        },
    )
    .unwrap();
    let r = run(&plan, &RunOptions::default()).unwrap();
    for res in &r.points[0].results {
        let m = &res.repeats[0];
        assert!(m.ok, "{}: {m:?}", res.mode);
        assert_eq!(m.write.bytes, 8 << 20, "{}", res.mode);
        assert_eq!(m.read.ops, 0);
    }
}

#[test]
fn cli_quick_writes_json_markdown_and_svg() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("r.json");
    let svg = dir.path().join("svg");
    let out = Command::new(env!("CARGO_BIN_EXE_nvmeof-bench"))
        .args([
            "--quick",
            "--runtime",
            "300ms",
            "--ramp-time",
            "100ms",
            "--size",
            "8M",
            "--quiet",
        ])
        .arg("--json")
        .arg(&json)
        .arg("--svg")
        .arg(&svg)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("| point | mode | IOPS |"), "{stdout}");
    assert_eq!(stdout.lines().filter(|l| l.contains("| das |")).count(), 3);
    assert_eq!(stdout.lines().filter(|l| l.contains("| tcp |")).count(), 3);
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(v["schema"], SCHEMA);
    assert_eq!(v["plan"]["modes"], serde_json::json!(["das", "tcp"]));
    let svg_file = std::fs::read_to_string(svg.join("das-vs-of.svg")).unwrap();
    assert!(svg_file.starts_with("<svg") && svg_file.trim_end().ends_with("</svg>"));
}

#[test]
fn cli_rejects_bad_jobs_with_a_message() {
    let dir = tempfile::tempdir().unwrap();
    let job = dir.path().join("bad.toml");
    std::fs::write(&job, "[[job]]\nbs = 1000\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_nvmeof-bench"))
        .arg(&job)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("bs") && err.contains("multiple of 512"),
        "{err}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_nvmeof-bench"))
        .args(["--quick", "--modes", "ftp"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let _ = Duration::ZERO;
}

/// Runs the binary on a job text; returns (exit code, stdout, stderr).
fn bench_on(job: &str, args: &[&str]) -> (Option<i32>, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("job.toml");
    std::fs::write(&path, job).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_nvmeof-bench"))
        .arg(&path)
        .args(args)
        .env_remove("NO_COLOR")
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A bad value names its key, the value and the valid values, on one line, once.
#[test]
fn cli_bad_values_are_named_once_on_one_line() {
    let (code, _, err) = bench_on("[[job]]\nname = \"a\"\nrw = \"randomread\"\n", &[]);
    assert_eq!(code, Some(2), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("line 3") && err.contains("rw = \"randomread\""),
        "{err}"
    );
    assert!(
        err.contains("randread") && err.contains("readwrite"),
        "the valid values are listed: {err}"
    );
    assert!(!err.contains("untagged"), "{err}");
    assert_eq!(err.matches("randomread").count(), 2, "printed once: {err}");
    // The same in a list, and for numbers and sizes.
    let (code, _, err) = bench_on("[[job]]\nrw = [\"read\", \"rand\"]\n", &[]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("unknown variant `rand`") && err.contains("line 2"),
        "{err}"
    );
    let (_, _, err) = bench_on("[[job]]\niodepth = \"deep\"\n", &[]);
    assert!(
        err.contains("iodepth = \"deep\"") && !err.contains("untagged"),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
    let (_, _, err) = bench_on("[[job]]\nbs = \"4q\"\n", &[]);
    assert!(
        err.contains("bs = \"4q\"") && !err.contains("untagged"),
        "{err}"
    );
    let (_, _, err) = bench_on("[[job]]\nruntime = true\n", &[]);
    assert!(
        err.contains("runtime = true") && !err.contains("untagged"),
        "{err}"
    );
}

/// The shipped disaggregated study lists plain rdma: without an RDMA target its rows are
/// skipped with one line and the job succeeds.
#[test]
fn cli_study4_disaggregated_skips_rdma_and_succeeds() {
    let job = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/jobs/study4-disaggregated.toml"
    ))
    .unwrap();
    let (code, out, err) = bench_on(
        &job,
        &[
            "--runtime",
            "1s",
            "--ramp-time",
            "300ms",
            "--size",
            "4M",
            "--backend",
            "mem:8M",
            "--quiet",
        ],
    );
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert_eq!(
        err.lines().filter(|l| l.contains("skipped rdma")).count(),
        1,
        "{err}"
    );
    assert!(!out.contains("| rdma |"), "{out}");
    assert!(out.contains("skipped: rdma"), "{out}");
    assert!(out.lines().any(|l| l.contains("| tcp |")), "{out}");
}

/// Off a terminal: a line per measurement with its position and the time left, lines around
/// the prefill, and no ANSI escapes (log lines included).
#[test]
fn cli_progress_lines_without_ansi_off_a_terminal() {
    let job = "[global]\nbackend = \"mem:16M\"\nsize = \"4M\"\nruntime = \"200ms\"\n\
               [[job]]\nrw = \"randread\"\niodepth = [1, 4]\n";
    let (code, out, err) = bench_on(job, &["--modes", "das,tcp"]);
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(!err.contains('\u{1b}'), "ANSI escapes in {err:?}");
    assert!(
        err.contains("WARN"),
        "the in-process target logs a warning: {err}"
    );
    let lines: Vec<&str> = err.lines().filter(|l| l.contains(" elapsed")).collect();
    assert_eq!(lines.len(), 4, "{err}");
    assert!(lines[0].starts_with("[1/4, "), "{err}");
    assert!(
        lines[3].starts_with("[4/4, ") && lines[3].contains(" left] [tcp] "),
        "{err}"
    );
    assert_eq!(
        err.matches("prefill: writing the verify pattern over 4 MiB")
            .count(),
        2,
        "{err}"
    );
    assert_eq!(err.matches("prefill done: 4 MiB").count(), 2, "{err}");
}
