//! The iscsi modes against Debian's tgt: a short run with verification beside das, and the
//! one-line answers to a wrong target name, a missing LUN and a closed port. Skipped, with
//! the reason printed, where tgtd is not installed (the test command installs it) or this
//! is not root.

use nvmeof_bench::iscsi::{Tgt, TgtSpec, find_tool};
use nvmeof_bench::job::{JobFile, Mode, Overrides, Plan};
use nvmeof_bench::report::Report;
use nvmeof_bench::run::{RunOptions, run};

const JOB: &str = r#"
[global]
backend = "mem:64M"
namespaces = 2
size = "8M"
runtime = "500ms"
ramp_time = "100ms"
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
rwmixread = 70
bs = "8k"
iodepth = 4

[[job]]
name = "big-writes"
description = "beyond the first burst: immediate data, then Data-Out for an R2T"
rw = "randrw"
rwmixread = 50
bs = "512k"
iodepth = 2
"#;

fn tgt_missing() -> bool {
    if find_tool("tgtd").is_none() || find_tool("tgtadm").is_none() {
        eprintln!("skipped: tgtd and tgtadm are not installed (apt-get install tgt)");
        return true;
    }
    let root = std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().nth(1).map(|euid| euid == "0"))
        .unwrap_or(false);
    if !root {
        eprintln!("skipped: tgtd runs as root (its control socket lives in /var/run/tgtd)");
        return true;
    }
    false
}

fn run_job(text: &str, modes: Vec<Mode>, ov: Overrides) -> Report {
    let plan = Plan::resolve(
        &JobFile::parse(text).unwrap(),
        &Overrides {
            modes: Some(modes),
            ..ov
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

#[test]
fn tgt_serves_verified_reads_and_writes_beside_das() {
    if tgt_missing() {
        return;
    }
    let r = run_job(
        JOB,
        vec![Mode::Das, Mode::Iscsi { addr: None }],
        Overrides::default(),
    );
    assert!(r.all_ok(), "{}", r.to_markdown());
    for p in &r.points {
        let m = &p.results[1].repeats[0];
        assert_eq!(p.results[1].mode, "iscsi");
        assert!(m.ok, "{}: {m:?}", p.label);
        assert!(m.verified_reads > 0, "{}: reads were not verified", p.label);
        assert_eq!(m.verify_errors, 0);
        assert!(m.all.ops > 0);
        // tgtd's CPU time is read from its process.
        assert!(m.cpu.target_cpu_s.is_some(), "{}", p.label);
        // One session per queue pair; both LUNs read.
        assert_eq!(m.queues, Some(usize::from(p.point.queue_pairs)));
        let luns: Vec<u32> = m.namespaces.iter().map(|n| n.nsid).collect();
        assert_eq!(luns, [1, 2], "{}", p.label);
        assert!(m.namespaces.iter().all(|n| n.ops > 0));
    }
}

#[test]
fn bad_names_luns_and_ports_get_one_line() {
    if tgt_missing() {
        return;
    }
    let tgt = Tgt::start(&TgtSpec {
        iqn: "iqn.2026-11.io.nvmeof-direct:test".into(),
        backend: "mem:16M".parse().unwrap(),
        namespaces: 1,
        first_lun: 1,
        cpus: None,
        queue_depth: 128,
    })
    .unwrap();
    let job = "[[job]]\nrw = \"randread\"\nruntime = \"200ms\"\nsize = \"1M\"\n";
    let at = |addr: &str| {
        vec![Mode::Iscsi {
            addr: Some(addr.to_string()),
        }]
    };
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    for (modes, iqn, lun, needle) in [
        (
            at(&tgt.addr()),
            "iqn.2026-11.io.nvmeof-direct:nobody",
            1,
            "target not found",
        ),
        (
            at(&tgt.addr()),
            "iqn.2026-11.io.nvmeof-direct:test",
            9,
            "LUN 9 does not exist",
        ),
        (
            at(&closed),
            "iqn.2026-11.io.nvmeof-direct:test",
            1,
            "cannot connect",
        ),
    ] {
        let r = run_job(
            job,
            modes,
            Overrides {
                iqn: Some(iqn.into()),
                lun: Some(lun),
                ..Default::default()
            },
        );
        let m = &r.points[0].results[0].repeats[0];
        let e = m.error.clone().unwrap_or_default();
        assert!(!m.ok && e.contains(needle), "{needle}: {e}");
        assert_eq!(e.lines().count(), 1, "{e}");
    }
    // The target given by address answered every bad request and still serves.
    let r = run_job(
        job,
        at(&tgt.addr()),
        Overrides {
            iqn: Some("iqn.2026-11.io.nvmeof-direct:test".into()),
            lun: Some(1),
            prefill: Some(true),
            ..Default::default()
        },
    );
    assert!(r.all_ok(), "{}", r.to_markdown());
    assert!(r.points[0].results[0].repeats[0].verified_reads > 0);
    tgt.stop();
}
