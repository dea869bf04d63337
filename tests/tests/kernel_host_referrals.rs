//! The Linux kernel NVMe/TCP host (in a QEMU guest) follows the discovery referrals of
//! `nvmeof-targetd`: two targets refer to each other; `nvme discover` at the first shows the
//! referral entry and `nvme connect-all` connects to the subsystems of both, once each.
//!
//! The targets listen on an address of this machine other than loopback: the guest reaches it
//! through QEMU's user networking as it is, so the addresses the discovery logs list are ones
//! the guest can connect to (10.0.2.2 would reach loopback, which the logs could not name).
//!
//! Needs the guest prepared by `tests/interop/setup.sh` and `NVMEOF_INTEROP=1`.

use std::net::{IpAddr, UdpSocket};
use std::process::Command;

use nvmeof_tests::{TargetProcess, free_port, guest_sh, skip_without_interop};

const NQN_A: &str = "nqn.2026-11.io.nvmeof-direct:referral-a";
const NQN_B: &str = "nqn.2026-11.io.nvmeof-direct:referral-b";

/// The address this machine sends from on its default route (no packet is sent).
fn outward_address() -> Option<IpAddr> {
    let s = UdpSocket::bind("0.0.0.0:0").ok()?;
    s.connect("10.255.255.255:9").ok()?;
    let ip = s.local_addr().ok()?.ip();
    (!ip.is_loopback() && !ip.is_unspecified()).then_some(ip)
}

fn start(dir: &std::path::Path, ip: IpAddr, nqn: &str, port: u16, refer: u16) -> TargetProcess {
    let config = dir.join(format!("{port}.toml"));
    std::fs::write(
        &config,
        format!(
            "[[listener]]\naddress = \"tcp://{ip}:{port}\"\n\n\
             [discovery]\nreferrals = [\"tcp://{ip}:{refer}\"]\n\n\
             [[subsystem]]\nnqn = \"{nqn}\"\nallow_any_host = true\n\n\
             [[subsystem.namespace]]\nbackend = \"mem:16M\"\n"
        ),
    )
    .unwrap();
    let socket = dir.join(format!("{port}.sock"));
    let (c, s) = (config.display().to_string(), socket.display().to_string());
    TargetProcess::spawn(&["--config", &c, "--control-socket", &s], port)
}

#[test]
fn kernel_host_discovers_and_connects_through_referrals() {
    if skip_without_interop() {
        return;
    }
    let Some(ip) = outward_address() else {
        eprintln!("skipped: this machine has no address besides loopback for the guest to reach");
        return;
    };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let (pa, pb) = (free_port(), free_port());
    let mut a = start(dir.path(), ip, NQN_A, pa, pb);
    let mut b = start(dir.path(), ip, NQN_B, pb, pa);
    let out = Command::new(guest_sh())
        .args(["run", "--timeout", "600"])
        .args(["--env", &format!("TARGET_ADDR={ip}")])
        .args(["--env", &format!("PORT_A={pa}")])
        .args(["--env", &format!("NQN_A={NQN_A}")])
        .args(["--env", &format!("PORT_B={pb}")])
        .args(["--env", &format!("NQN_B={NQN_B}")])
        .arg(nvmeof_tests::workspace_root().join("tests/guest/kernel-host-referrals.sh"))
        .output()
        .expect("guest.sh");
    let console = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && console.contains("PASS: kernel host follows referrals"),
        "guest failed ({:?}):\n{console}\n{}\ntarget A log:\n{}\ntarget B log:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr),
        a.log(),
        b.log()
    );
    // Each target served one I/O controller to the kernel host, and its discovery log.
    for t in [&mut a, &mut b] {
        let log = t.log();
        assert!(log.contains("discovery controller connected"), "{log}");
        assert!(
            log.lines().any(|l| l.contains("INFO controller connected")),
            "{log}"
        );
    }
    for t in [a, b] {
        let (code, log) = t.terminate();
        assert_eq!(code, Some(0), "{log}");
    }
}
