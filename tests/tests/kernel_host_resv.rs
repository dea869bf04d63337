//! NVMe reservations with the Linux kernel host and nvme-cli in a QEMU guest (Linux 6.1,
//! native multipath off): two controllers with different host NQNs and host IDs register,
//! acquire, see conflicts in fio and dd, preempt and abort, release and clear; Persist Through
//! Power Loss keeps the reservation across a SIGKILL and restart of the daemon. One guest
//! boot; the guest script (tests/guest/kernel-host-resv.sh) prints "STEP kill" when the test
//! is to kill and restart the target.
//!
//! Needs the guest prepared by `tests/interop/setup.sh` and `NVMEOF_INTEROP=1`.

use std::path::Path;

use nvmeof_tests::{
    BackgroundGuest, GuestKernel, TargetProcess, free_port, skip_without_interop, workspace_root,
};

const NQN: &str = "nqn.2026-11.io.nvmeof-direct:resv";
const HOST_A: &str = "nqn.2014-08.org.nvmexpress:uuid:7e5e0000-0000-4000-8000-00000000000a";
const HOSTID_A: &str = "7e5e0000-0000-4000-8000-00000000000a";
const HOST_B: &str = "nqn.2014-08.org.nvmexpress:uuid:7e5e0000-0000-4000-8000-00000000000b";
const HOSTID_B: &str = "7e5e0000-0000-4000-8000-00000000000b";

fn start(dir: &Path, (port, port_b): (u16, u16), file: &Path, state: &Path) -> TargetProcess {
    std::fs::create_dir_all(dir).unwrap();
    let toml = format!(
        "[target]\nstate_dir = \"{}\"\n\n[[listener]]\naddress = \"tcp://127.0.0.1:{port}\"\n\n\
         [[listener]]\naddress = \"tcp://127.0.0.1:{port_b}\"\n\n\
         [[subsystem]]\nnqn = \"{NQN}\"\nhosts = [\"{HOST_A}\", \"{HOST_B}\"]\n\n\
         [[subsystem.namespace]]\nbackend = \"file:{},size=32M\"\n",
        state.display(),
        file.display()
    );
    TargetProcess::with_config(dir, &toml, 0o600, port)
}

#[test]
fn kernel_hosts_reserve_conflict_preempt_and_keep_reservations_across_a_kill() {
    if skip_without_interop() {
        return;
    }
    let root = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let (file, state) = (root.path().join("ns.img"), root.path().join("state"));
    std::fs::create_dir_all(&state).unwrap();
    let ports = (free_port(), free_port());
    let mut t = Some(start(&root.path().join("t1"), ports, &file, &state));
    let mut guest = BackgroundGuest::start(
        GuestKernel::Linux61
            .guest_sh("start")
            .args([
                "--with-fio",
                "--ready-marker",
                "STEP kill",
                "--timeout",
                "900",
            ])
            .args(["--env", &format!("PORT_A={}", ports.0)])
            .args(["--env", &format!("PORT_B={}", ports.1)])
            .args(["--env", &format!("TARGET_NQN={NQN}")])
            .args(["--env", &format!("HOST_A={HOST_A}")])
            .args(["--env", &format!("HOSTID_A={HOSTID_A}")])
            .args(["--env", &format!("HOST_B={HOST_B}")])
            .args(["--env", &format!("HOSTID_B={HOSTID_B}")])
            .arg(workspace_root().join("tests/guest/kernel-host-resv.sh")),
    );
    let mut first_log = String::new();
    if guest.wait_marker("STEP kill") {
        let mut old = t.take().expect("target runs");
        first_log = old.log();
        old.crash();
        t = Some(start(&root.path().join("t2"), ports, &file, &state));
    }
    let finished = guest.wait_marker("GUEST-EXIT");
    let code = guest.stop();
    let console = guest.console();
    let mut t = t.expect("target runs");
    assert!(
        finished && code == Some(0),
        "guest failed ({code:?}):\n{console}\nfirst target log:\n{first_log}\ntarget log:\n{}",
        t.log()
    );
    for pass in [
        "PASS: two hosts registered, host A holds Write Exclusive",
        "PASS: fio on host A verified; host B's fio writes failed with a conflict, its reads work",
        "PASS: preempt and abort: host A lost its registration and access, host B verified",
        "PASS: released",
        "PASS: the reservation survived the target's kill and restart",
        "PASS: cleared",
    ] {
        assert!(console.contains(pass), "{pass} missing:\n{console}");
    }
    assert!(t.log().contains("reservations restored"), "{}", t.log());
    let (code, _) = t.terminate();
    assert_eq!(code, Some(0));
}
