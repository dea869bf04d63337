//! Asymmetric Namespace Access with the Linux 6.12 kernel host's native multipath in a QEMU
//! guest: two `nvmeof-targetd` processes export one namespace identity (one NQN and NSID, one
//! shared file, disjoint controller ID ranges), path A optimized and path B non-optimized. fio
//! with verify runs on the multipath device while path A is made inaccessible with
//! `ctl set-ana-state` and optimized again, and while the process behind path A is killed and
//! restarted; `nvme list-subsys` shows the states. Before that, a second namespace of path A's
//! target, masked from the guest's host, is not listed and has no block device until `ctl
//! ns-add-host` shows it (raw hosts check its reads are refused: `multipath.rs`). One guest boot; the guest script (tests/guest/kernel-host-ana.sh)
//! prints a marker before each change.
//!
//! Needs the guest prepared by `tests/interop/setup.sh --with-k612` and `NVMEOF_INTEROP=1`.

use std::path::Path;

use nvmeof_tests::{
    BackgroundGuest, GuestKernel, TargetProcess, ctl_ok, free_port, skip_without_interop,
    workspace_root,
};

const NQN: &str = "nqn.2026-11.io.nvmeof-direct:ha";
const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:6b1c2d4e-0000-4000-8000-0000000a7a01";
const HOSTID: &str = "6b1c2d4e-0000-4000-8000-0000000a7a01";
const OTHER_HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:6b1c2d4e-0000-4000-8000-0000000a7a02";

/// Writes the configuration of one target of the pair into `dir` and returns its path.
fn config(
    dir: &Path,
    port: u16,
    file: &Path,
    cntlids: (u16, u16),
    ana: &str,
    extra: &str,
) -> String {
    let path = dir.join("target.toml");
    std::fs::write(
        &path,
        format!(
            "[target]\ncontrol_socket = \"{}\"\n\n[[listener]]\naddress = \
             \"tcp://127.0.0.1:{port}\"\n{ana}\n\n[[subsystem]]\nnqn = \"{NQN}\"\nhosts = \
             [\"{HOST}\"]\ncntlid_min = {}\ncntlid_max = {}\n\n[[subsystem.namespace]]\nbackend \
             = \"file:{},size=64M,shared=on\"\n{extra}",
            dir.join("ctl.sock").display(),
            cntlids.0,
            cntlids.1,
            file.display()
        ),
    )
    .unwrap();
    path.display().to_string()
}

#[test]
fn kernel_multipath_rides_ana_changes_and_a_target_restart() {
    if skip_without_interop() {
        return;
    }
    // Under the build directory, not /tmp: the shared file needs a filesystem with O_DIRECT.
    let root = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let file = root.path().join("ns.img");
    let (dir_a, dir_b) = (root.path().join("a"), root.path().join("b"));
    std::fs::create_dir_all(&dir_a).unwrap();
    std::fs::create_dir_all(&dir_b).unwrap();
    let (port_a, port_b) = (free_port(), free_port());
    let masked =
        format!("\n[[subsystem.namespace]]\nbackend = \"mem:16M\"\nhosts = [\"{OTHER_HOST}\"]\n");
    let config_a = config(&dir_a, port_a, &file, (1, 999), "", &masked);
    let config_b = config(
        &dir_b,
        port_b,
        &file,
        (1000, 1999),
        "ana = [{ group = 1, state = \"non-optimized\" }]",
        "",
    );
    let mut a = Some(TargetProcess::spawn(&["--config", &config_a], port_a));
    let mut b = TargetProcess::spawn(&["--config", &config_b], port_b);
    let socket_a = dir_a.join("ctl.sock");
    let listener_a = format!("tcp://127.0.0.1:{port_a}");

    let mut guest = BackgroundGuest::start(
        GuestKernel::Linux612
            .guest_sh("start")
            .args([
                "--with-fio",
                "--ready-marker",
                "STEP unmask",
                "--timeout",
                "900",
            ])
            .args(["--env", &format!("TARGET_NQN={NQN}")])
            .args(["--env", &format!("HOST_NQN={HOST}")])
            .args(["--env", &format!("HOST_ID={HOSTID}")])
            .args(["--env", &format!("PORT_A={port_a}")])
            .args(["--env", &format!("PORT_B={port_b}")])
            .arg(workspace_root().join("tests/guest/kernel-host-ana.sh")),
    );
    let mut a_log = String::new();
    let mut ok = true;
    for marker in [
        "STEP unmask",
        "STEP inaccessible",
        "STEP optimized",
        "STEP kill",
        "STEP restart",
    ] {
        if !guest.wait_marker(marker) {
            ok = false;
            break;
        }
        match marker {
            "STEP unmask" => {
                let out = ctl_ok(
                    &socket_a,
                    &[
                        "ns-add-host",
                        "--subsystem",
                        NQN,
                        "--nsid",
                        "2",
                        "--host",
                        HOST,
                    ],
                );
                eprintln!("{marker}: {out}");
            }
            "STEP inaccessible" | "STEP optimized" => {
                let state = marker.trim_start_matches("STEP ");
                let out = ctl_ok(
                    &socket_a,
                    &["set-ana-state", "--listener", &listener_a, "--state", state],
                );
                eprintln!("{marker}: {out}");
            }
            "STEP kill" => {
                let mut t = a.take().expect("target A runs");
                a_log = t.log();
                t.crash();
            }
            _ => a = Some(TargetProcess::spawn(&["--config", &config_a], port_a)),
        }
    }
    let finished = ok && guest.wait_marker("GUEST-EXIT");
    let code = guest.stop();
    let console = guest.console();
    assert!(
        finished && code == Some(0),
        "guest failed ({code:?}):\n{console}\ntarget A log:\n{a_log}\ntarget B log:\n{}",
        b.log()
    );
    for pass in [
        "PASS: one multipath device over two target processes",
        "PASS: namespace 2 masked from this host: not listed, inactive, no block device",
        "PASS: namespace 2 appeared",
        "PASS: path A inaccessible by ctl set-ana-state",
        "PASS: path A optimized again",
        "PASS: fio with verify went on through path B while the target of path A was down",
        "PASS: path A reconnected to the restarted target and is optimized",
        "PASS: fio with verify ran",
    ] {
        assert!(console.contains(pass), "{pass} missing:\n{console}");
    }
    // The host enabled ANA change notices on path A and got one for each state change.
    assert!(
        a_log
            .lines()
            .any(|l| l.contains("asynchronous event completed") && l.contains("0x0c0302")),
        "{a_log}"
    );
    let (code, _) = a.take().expect("target A runs").terminate();
    assert_eq!(code, Some(0));
    let (code, _) = b.terminate();
    assert_eq!(code, Some(0));
}
