//! The Linux kernel NVMe/TCP host (in a QEMU guest) against `nvmeof-targetd`: discovery,
//! connect with several I/O queues, Identify, fio with verify, digests on and off, discard,
//! write zeroes, disconnect; and a file namespace that keeps its data across a daemon crash
//! while the host reconnects.
//!
//! Needs the guest prepared by `tests/interop/setup.sh` and `NVMEOF_INTEROP=1` (`.ci/run` does
//! both); without it each test prints why it did nothing.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use nvmeof_tests::{TargetProcess, guest_sh, interop_enabled};

const NQN: &str = "nqn.2026-11.io.nvmeof-direct:kernel-host";

fn skip() -> bool {
    if !interop_enabled() {
        eprintln!("skipped: set NVMEOF_INTEROP=1 after running tests/interop/setup.sh");
        return true;
    }
    false
}

fn script(name: &str) -> String {
    nvmeof_tests::workspace_root()
        .join("tests/guest")
        .join(name)
        .display()
        .to_string()
}

#[test]
fn kernel_host_discover_connect_fio_verify() {
    if skip() {
        return;
    }
    let mut t = TargetProcess::quick(NQN, &["mem:256M"]);
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
    let (code, _) = t.terminate();
    assert_eq!(code, Some(0));
}

fn wait_for(path: &Path, needle: &str, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if std::fs::read_to_string(path).is_ok_and(|s| s.contains(needle)) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    false
}

#[test]
fn kernel_host_file_namespace_survives_daemon_crash() {
    if skip() {
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
