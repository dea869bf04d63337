//! The Linux kernel NVMe/TCP host (in a QEMU guest) against `nvmeof-targetd`: discovery,
//! connect with several I/O queues, Identify, fio with verify, digests on and off, discard,
//! write zeroes, disconnect, and the metrics those commands leave; a file namespace that keeps its data across a daemon crash while
//! the host reconnects; and ext4 on a namespace with a volatile write cache that stays
//! consistent, with every fsynced file intact, across power cuts (SIGKILL of the daemon loses
//! whatever the host did not make durable with Flush or FUA).
//!
//! Needs the guest prepared by `tests/interop/setup.sh` and `NVMEOF_INTEROP=1` (`.ci/run` does
//! both); without it each test prints why it did nothing.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use nvmeof_tests::{
    TargetProcess, guest_sh, http_get, promtool_accepts, scraped, skip_without_interop,
};

const NQN: &str = "nqn.2026-11.io.nvmeof-direct:kernel-host";

fn script(name: &str) -> String {
    nvmeof_tests::workspace_root()
        .join("tests/guest")
        .join(name)
        .display()
        .to_string()
}

#[test]
fn kernel_host_discover_connect_fio_verify() {
    if skip_without_interop() {
        return;
    }
    let args = [
        "--subsystem",
        NQN,
        "--namespace",
        "mem:256M",
        "--reactors",
        "2",
    ];
    let (mut t, metrics) = TargetProcess::with_metrics(&args);
    let out = Command::new(guest_sh())
        .args(["run", "--with-fio", "--timeout", "900"])
        .arg("--env")
        .arg(format!("TARGET_PORT={}", t.port))
        .arg("--env")
        .arg(format!("TARGET_NQN={NQN}"))
        .arg(script("kernel-host-tcp.sh"))
        .output()
        .expect("guest.sh");
    let console = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "guest failed ({:?}):\n{console}\n{}\ntarget log:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr),
        t.log()
    );
    assert!(console.contains("PASS: kernel NVMe/TCP host"));
    let log = t.log();
    assert!(log.contains("controller connected"), "{log}");
    assert!(log.contains("discovery controller connected"), "{log}");
    // What the kernel host did shows in the metrics: data both ways, the flush, the discard
    // and the write zeroes, and no controller left after its disconnect.
    let (code, scrape) = http_get(metrics, "/metrics").expect("scrape");
    assert_eq!(code, 200);
    let ns1 = format!("subsystem=\"{NQN}\",nsid=\"1\"");
    for (series, min) in [
        (
            format!("nvmeof_io_bytes_total{{{ns1},direction=\"read\"}}"),
            1 << 20,
        ),
        (
            format!("nvmeof_io_bytes_total{{{ns1},direction=\"write\"}}"),
            1 << 20,
        ),
        (
            format!("nvmeof_io_commands_total{{{ns1},opcode=\"flush\"}}"),
            1,
        ),
        (
            format!("nvmeof_io_commands_total{{{ns1},opcode=\"dsm\"}}"),
            1,
        ),
        (
            format!("nvmeof_io_commands_total{{{ns1},opcode=\"write_zeroes\"}}"),
            1,
        ),
    ] {
        let v = scraped(&scrape, &series);
        assert!(
            v.is_some_and(|v| v >= f64::from(min)),
            "{series} = {v:?}:\n{scrape}"
        );
    }
    let controllers = format!("nvmeof_controllers{{subsystem=\"{NQN}\"}}");
    assert_eq!(scraped(&scrape, &controllers), Some(0.0), "{scrape}");
    promtool_accepts(&scrape);
    let (code, _) = t.terminate();
    assert_eq!(code, Some(0));
}

/// Polls the file at `path` until `done` accepts its contents; false after `timeout`.
fn wait_until(path: &Path, timeout: Duration, done: impl Fn(&str) -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if std::fs::read_to_string(path).is_ok_and(|s| done(&s)) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    false
}

fn wait_for(path: &Path, needle: &str, timeout: Duration) -> bool {
    wait_until(path, timeout, |s| s.contains(needle))
}

#[test]
fn kernel_host_file_namespace_survives_daemon_crash() {
    if skip_without_interop() {
        return;
    }
    // Under the build directory, not /tmp: the namespace file needs a filesystem with O_DIRECT.
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    // Behind a volatile cache: only what the host flushed or wrote with FUA survives a crash.
    let ns = format!(
        "file:{}/ns1.img,size=64M,volatile_cache=32M",
        dir.path().display()
    );
    let port = nvmeof_tests::free_port();
    let listen = format!("tcp://127.0.0.1:{port}");
    let args = ["--listen", &listen, "--subsystem", NQN, "--namespace", &ns];
    let t = TargetProcess::spawn(&args, port);
    let log = dir.path().join("console.log");
    let start = Command::new(guest_sh())
        .args([
            "start",
            "--ready-marker",
            "DATA-WRITTEN",
            "--timeout",
            "600",
        ])
        .arg("--log")
        .arg(&log)
        .arg("--env")
        .arg(format!("TARGET_PORT={port}"))
        .arg("--env")
        .arg(format!("TARGET_NQN={NQN}"))
        .arg(script("kernel-host-restart.sh"))
        .output()
        .expect("guest.sh start");
    let console = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        start.status.success(),
        "guest did not write its data:\n{console}\n{}",
        String::from_utf8_lossy(&start.stderr)
    );
    let pidfile = String::from_utf8_lossy(&start.stdout).trim().to_string();

    // Crash: no shutdown, no flush beyond what the host's Flush already made durable.
    t.crash();
    std::thread::sleep(Duration::from_secs(2));
    let mut t = TargetProcess::spawn(&args, port);

    let finished = wait_for(&log, "GUEST-EXIT", Duration::from_secs(600));
    let stop = Command::new(guest_sh())
        .args(["stop", "--grace", "30", &pidfile])
        .output()
        .expect("guest.sh stop");
    let console = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        finished && stop.status.success(),
        "guest failed:\n{console}\ntarget log after restart:\n{}",
        t.log()
    );
    assert!(
        console.contains("PASS: data written before the crash"),
        "{console}"
    );
    assert!(
        console.contains("PASS: the FUA write survived the crash and the plain one did not"),
        "{console}"
    );
    assert!(t.log().contains("controller connected"));
}

/// Power cuts of `kernel_host_ext4_survives_power_cuts`: in round `i` the daemon is killed once
/// the guest has reported `POWER_CUTS[i]` returned fsyncs (more may return before it dies).
const POWER_CUTS: [usize; 4] = [1, 12, 3, 30];

/// Records `KIND ROUND NAME MD5` of the guest console with `ROUND` in `rounds`, as NAME -> MD5.
fn console_records(
    console: &str,
    kind: &str,
    rounds: std::ops::RangeInclusive<usize>,
) -> BTreeMap<String, String> {
    console
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.trim().split(' ').collect();
            match f[..] {
                [k, r, name, md5] if k == kind && r.parse().is_ok_and(|r| rounds.contains(&r)) => {
                    Some((name.to_string(), md5.to_string()))
                }
                _ => None,
            }
        })
        .collect()
}

/// ext4 through the kernel host on a `volatile_cache` namespace, the daemon killed with SIGKILL
/// after `POWER_CUTS[i]` fsyncs in round `i` and restarted once the host has abandoned the
/// controller (`tests/guest/kernel-host-powercut.sh` describes the guest's side). After each cut
/// the journal must replay, `e2fsck -fn` must be clean, and every file whose fsync returned in any
/// round so far must be found with the checksum recorded when its fsync returned. It catches a
/// cache that keeps FUA writes volatile (the last fsynced file is gone after the first cut) and
/// one whose Flush writes nothing back (no mountable filesystem is left).
#[test]
fn kernel_host_ext4_survives_power_cuts() {
    if skip_without_interop() {
        return;
    }
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    // Every write stays in the daemon's memory (64 MiB: no eviction) until a Flush or FUA write.
    let ns = format!(
        "file:{}/ns1.img,size=64M,volatile_cache=64M",
        dir.path().display()
    );
    let port = nvmeof_tests::free_port();
    let listen = format!("tcp://127.0.0.1:{port}");
    let args = ["--listen", &listen, "--subsystem", NQN, "--namespace", &ns];
    let mut target = Some(TargetProcess::spawn(&args, port));
    let startup = target.as_mut().expect("target").log();
    assert!(startup.contains("(testing feature)"), "{startup}");
    let log = dir.path().join("console.log");
    let start = Command::new(guest_sh())
        .args(["start", "--with-ext4", "--timeout", "600"])
        .args(["--ready-marker", "WORKLOAD-START 1", "--log"])
        .arg(&log)
        .args(["--env", &format!("TARGET_PORT={port}")])
        .args(["--env", &format!("TARGET_NQN={NQN}")])
        .args(["--env", &format!("ROUNDS={}", POWER_CUTS.len())])
        .arg(script("kernel-host-powercut.sh"))
        .output()
        .expect("guest.sh start");
    let console = || std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        start.status.success(),
        "guest did not format the namespace:\n{}\n{}",
        console(),
        String::from_utf8_lossy(&start.stderr)
    );
    let pidfile = String::from_utf8_lossy(&start.stdout).trim().to_string();
    let minutes = Duration::from_secs(300);

    for (i, &cut_after) in POWER_CUTS.iter().enumerate() {
        let round = i + 1;
        let fsynced = format!("FSYNCED {round} ");
        let abandoned = format!("HOST-ABANDONED {round}");
        let reached = wait_until(&log, minutes, |c| {
            c.contains("GUEST-EXIT")
                || c.contains(&abandoned)
                || c.lines().filter(|l| l.starts_with(&fsynced)).count() >= cut_after
        });
        let c = console();
        assert!(
            reached && !c.contains("GUEST-EXIT") && !c.contains(&abandoned),
            "round {round}: no {cut_after} fsync records while the daemon ran:\n{c}\ntarget log:\n{}",
            target.as_mut().expect("target").log()
        );
        // Power cut: whatever the daemon did not make durable is gone.
        target.take().expect("target").crash();
        wait_until(&log, minutes, |c| {
            c.contains(&abandoned) || c.contains("GUEST-EXIT")
        });
        assert!(
            console().contains(&abandoned),
            "round {round}: the host did not abandon the controller:\n{}",
            console()
        );
        let mut t = TargetProcess::spawn(&args, port);
        let recovered = format!("RECOVERED {round}");
        let ok = wait_until(&log, minutes, |c| {
            c.contains(&recovered) || c.contains("GUEST-EXIT")
        });
        let c = console();
        assert!(
            ok && c.contains(&recovered),
            "round {round}: recovery failed:\n{c}\ntarget log after restart:\n{}",
            t.log()
        );
        assert!(c.contains(&format!("FSCK-CLEAN {round}")), "{c}");
        let found = console_records(&c, "FOUND", round..=round);
        let lost: Vec<String> = console_records(&c, "FSYNCED", 1..=round)
            .into_iter()
            .filter(|(name, md5)| found.get(name) != Some(md5))
            .map(|(name, md5)| format!("{name} (fsynced {md5}, found {:?})", found.get(&name)))
            .collect();
        assert!(
            lost.is_empty(),
            "round {round}: fsynced files lost or changed by the power cut: {lost:?}\n{c}"
        );
        eprintln!(
            "round {round}: power cut after {} fsyncs; {} fsynced files intact, fsck clean",
            console_records(&c, "FSYNCED", round..=round).len(),
            found.len()
        );
        target = Some(t);
    }

    let finished = wait_for(&log, "GUEST-EXIT", minutes);
    let stop = Command::new(guest_sh())
        .args(["stop", "--grace", "30", &pidfile])
        .output()
        .expect("guest.sh stop");
    let c = console();
    assert!(finished && stop.status.success(), "guest failed:\n{c}");
    assert!(c.contains("PASS: ext4 consistent"), "{c}");
}
