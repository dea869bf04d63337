//! Live changes to `nvmeof-targetd` through `nvmeof-targetd ctl`, seen by the Linux kernel
//! NVMe/TCP host in a QEMU guest without reconnecting: a namespace added, grown and removed
//! while fio with verify runs on another, then the host removed from the allowed list and
//! disconnected. One guest boot; the guest script (tests/guest/kernel-host-ctl.sh) prints a
//! marker before each change and checks what the host sees after it.
//!
//! Needs the guest prepared by `tests/interop/setup.sh` and `NVMEOF_INTEROP=1`.

use std::process::Command;
use std::time::Duration;

use nvmeof_tests::{
    TargetProcess, ctl_ok, free_port, guest_sh, skip_without_interop, wait_console_marker,
};

const NQN: &str = "nqn.2026-11.io.nvmeof-direct:live";
const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:6b1c2d4e-0000-4000-8000-00000000c7a1";
const OTHER_HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:6b1c2d4e-0000-4000-8000-00000000c7a2";
const NS2_BYTES: u64 = 32 << 20;
const NS2_RESIZED_BYTES: u64 = 64 << 20;

#[test]
fn kernel_host_sees_namespaces_come_grow_and_go_and_a_removed_host_leave() {
    if skip_without_interop() {
        return;
    }
    // Under the build directory, not /tmp: the namespace file needs a filesystem with O_DIRECT.
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let port = free_port();
    let config = dir.path().join("target.toml");
    std::fs::write(
        &config,
        format!(
            "[[listener]]\naddress = \"tcp://127.0.0.1:{port}\"\n\n[[subsystem]]\nnqn = \"{NQN}\"\n\
             hosts = [\"{HOST}\", \"{OTHER_HOST}\"]\n\n[[subsystem.namespace]]\nbackend = \"mem:64M\"\n"
        ),
    )
    .unwrap();
    let socket = dir.path().join("ctl.sock");
    let (c, s) = (config.display().to_string(), socket.display().to_string());
    let mut t = TargetProcess::spawn(&["--config", &c, "--control-socket", &s], port);

    let log = dir.path().join("console.log");
    let script = nvmeof_tests::workspace_root().join("tests/guest/kernel-host-ctl.sh");
    let start = Command::new(guest_sh())
        .args([
            "start",
            "--with-fio",
            "--ready-marker",
            "STEP add",
            "--timeout",
            "600",
        ])
        .arg("--log")
        .arg(&log)
        .args(["--env", &format!("TARGET_PORT={port}")])
        .args(["--env", &format!("TARGET_NQN={NQN}")])
        .args(["--env", &format!("HOST_NQN={HOST}")])
        .args(["--env", &format!("NS2_BYTES={NS2_BYTES}")])
        .args(["--env", &format!("NS2_RESIZED_BYTES={NS2_RESIZED_BYTES}")])
        .arg(&script)
        .output()
        .expect("guest.sh start");
    let console = || std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        start.status.success(),
        "guest did not connect:\n{}\n{}\ntarget log:\n{}",
        console(),
        String::from_utf8_lossy(&start.stderr),
        t.log()
    );
    let pidfile = String::from_utf8_lossy(&start.stdout).trim().to_string();

    let ns2 = format!("file:{}/ns2.img,size={NS2_BYTES}", dir.path().display());
    let steps: [(&str, Vec<String>); 4] = [
        (
            "STEP add",
            vec![
                "add-namespace".into(),
                "--subsystem".into(),
                NQN.into(),
                "--backend".into(),
                ns2,
            ],
        ),
        (
            "STEP resize",
            vec![
                "resize-namespace".into(),
                "--subsystem".into(),
                NQN.into(),
                "--nsid".into(),
                "2".into(),
                "--size".into(),
                NS2_RESIZED_BYTES.to_string(),
            ],
        ),
        (
            "STEP remove",
            vec![
                "remove-namespace".into(),
                "--subsystem".into(),
                NQN.into(),
                "--nsid".into(),
                "2".into(),
            ],
        ),
        (
            "STEP unhost",
            vec![
                "remove-host".into(),
                "--subsystem".into(),
                NQN.into(),
                "--host".into(),
                HOST.into(),
            ],
        ),
    ];
    let mut ok = true;
    for (marker, args) in &steps {
        if !wait_console_marker(&log, marker, Duration::from_secs(300)) {
            ok = false;
            break;
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = ctl_ok(&socket, &args);
        eprintln!("{marker}: {out}");
    }
    let finished = ok && wait_console_marker(&log, "GUEST-EXIT", Duration::from_secs(300));
    let stop = Command::new(guest_sh())
        .args(["stop", "--grace", "30", &pidfile])
        .output()
        .expect("guest.sh stop");
    let console = console();
    assert!(
        finished && stop.status.success(),
        "guest failed:\n{console}\ntarget log:\n{}",
        t.log()
    );
    for pass in [
        "PASS: namespace 2 appeared",
        "PASS: namespace 2 grew to 67108864 bytes",
        "PASS: namespace 2 went away",
        "PASS: fio with verify on namespace 1 ran",
        "PASS: the removed host was disconnected and could not reconnect",
    ] {
        assert!(console.contains(pass), "{pass} missing:\n{console}");
    }
    let status = ctl_ok(&socket, &["status"]);
    assert!(
        !status.contains(HOST),
        "the removed host is still listed:\n{status}"
    );
    let log = t.log();
    assert!(log.contains("host no longer allowed"), "{log}");
    assert!(log.contains("connect rejected: host not allowed"), "{log}");
    // The host's persistent discovery controller enabled Discovery Log Page Change notices and
    // got one when its host was removed.
    assert!(
        log.lines()
            .any(|l| l.contains("asynchronous event completed")
                && l.contains("nqn.2014-08.org.nvmexpress.discovery")
                && l.contains("0x70f002")),
        "{log}"
    );
    // The I/O controller got Namespace Attribute Notices.
    assert!(
        log.lines()
            .any(|l| l.contains("asynchronous event completed")
                && l.contains(NQN)
                && l.contains("0x040002")),
        "{log}"
    );
    let (code, _) = t.terminate();
    assert_eq!(code, Some(0));
}
