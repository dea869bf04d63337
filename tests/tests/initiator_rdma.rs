//! The nvmeof-direct initiator over NVMe/RDMA (Soft-RoCE in a QEMU guest) against two real
//! targets: the Linux kernel's nvmet-rdma, then `nvmeof-targetd --listen rdma://...`. Against
//! each: discovery (RDMA entry fields), Identify, the initiator's `verify` example (concurrent
//! writes on three I/O queues, a transfer above MDTS, in-capsule writes, read back and
//! compared; a transfer above MDTS written from and read back into registered memory with no
//! slot copy; GPU request rings driven by the CPU stand-in, each ring read written by the
//! target straight into its registered slot; a run-to-completion queue pair whose buffers are
//! registered once, not per command, and which reconnects with its controller after the
//! kernel target's port comes back and after our target's stall), a CLI write and read of a 3 MiB file, an `nvmeof-initd` attachment read back, and (against our target) the load
//! generator's rdma mode beside its tcp mode, and a read that times out while the daemon is
//! stopped (SIGSTOP), then a reconnect once it continues; against the kernel target also a
//! reconnect: its port drops the subsystem and takes it back while reads go on; against our
//! target also DH-HMAC-CHAP both ways over RDMA (admin and I/O queues), and a wrong secret
//! refused in one line. Before the
//! RDMA device exists the CLI must fail with a one-line error. See
//! `tests/guest/initiator-rdma.sh`.
//!
//! The host kernel here has no RDMA, so the initiator runs in the guest too. Needs the guest
//! prepared by `tests/interop/setup.sh` and `NVMEOF_INTEROP=1` (`.ci/run` does both); without
//! it the test prints why it did nothing. The binaries are copied into the guest from the
//! build: `cargo build --workspace --bins` and the initiator's examples (built by
//! `cargo test --workspace`) must exist.

use std::process::Command;

use nvmeof_tests::{
    assert_console_has, bin_path, guest_sh, run_guest, skip_without_interop, workspace_root,
};

/// A host that must authenticate to nvmeof-targetd (DH-HMAC-CHAP, both ways).
const AUTH_NQN: &str = "nqn.2014-08.org.nvmexpress:uuid:6a0f0c4e-0000-4000-8000-0000000000e1";
const AUTH_KEY: &str = "DHHC-1:00:ZXhhbXBsZS1rZXktZm9yLXVuaXQtdGVzdHMtMzJieXR38mKy:";
const AUTH_CTRL_KEY: &str =
    "DHHC-1:02:Y29udHJvbGxlci1rZXktZm9yLXJkbWEtdGVzdHMtNDgtc2l4dGVlbi1ieXRlcyEhmxm9aQ==:";

#[test]
fn initiator_over_rdma_against_kernel_and_own_target() {
    if skip_without_interop() {
        return;
    }
    let nvmeof = bin_path("nvmeof");
    let targetd = bin_path("nvmeof-targetd");
    let bench = bin_path("nvmeof-bench");
    let initd = bin_path("nvmeof-initd");
    let verify = nvmeof.with_file_name("examples").join("verify");
    assert!(
        verify.exists(),
        "{} is not built (cargo build -p nvmeof-initiator --example verify)",
        verify.display()
    );
    let console = run_guest(
        Command::new(guest_sh())
            .args(["run", "--with-rdma", "--timeout", "900"])
            // Five debug binaries in the initramfs: more than the default 1 GiB guest holds.
            .args(["--mem", "2048"])
            .arg("--add-bin")
            .arg(format!("{}:/usr/bin/nvmeof", nvmeof.display()))
            .arg("--add-bin")
            .arg(format!("{}:/usr/bin/nvmeof-verify", verify.display()))
            .arg("--add-bin")
            .arg(format!("{}:/usr/bin/nvmeof-targetd", targetd.display()))
            .arg("--add-bin")
            .arg(format!("{}:/usr/bin/nvmeof-bench", bench.display()))
            .arg("--add-bin")
            .arg(format!("{}:/usr/bin/nvmeof-initd", initd.display()))
            .args(["--env", &format!("AUTH_NQN={AUTH_NQN}")])
            .args(["--env", "AUTH_HOSTID=6a0f0c4e-0000-4000-8000-0000000000e1"])
            .args(["--env", &format!("AUTH_KEY={AUTH_KEY}")])
            .args(["--env", &format!("AUTH_CTRL_KEY={AUTH_CTRL_KEY}")])
            .arg(workspace_root().join("tests/guest/initiator-rdma.sh")),
    );
    assert_console_has(
        &console,
        &[
            "PASS: initiator over NVMe/RDMA against the kernel nvmet-rdma target",
            "PASS: initiator over NVMe/RDMA against nvmeof-targetd",
            "PASS: nvmeof-direct initiator over NVMe/RDMA",
            "VERIFY RECONNECTED reconnects=",
            "VERIFY REGISTERED-ACROSS-RECONNECT",
            "VERIFY STALL-RECOVERED",
            "VERIFY REGISTERED-TIMEOUT-RELEASED",
            "VERIFY RINGS transport=rdma",
            "VERIFY QUEUE-PAIR transport=rdma",
            "PASS: nvmeof-bench rdma mode",
            "NVMe/RDMA queue pair accepted",
            "qid=3",
            "+ /usr/bin/nvmeof detach rdma0",
            "PASS: DH-HMAC-CHAP over NVMe/RDMA",
        ],
    );
    // The admin queue and both I/O queues authenticated over NVMe/RDMA, both ways.
    let authenticated = console
        .lines()
        .filter(|l| l.contains("host authenticated") && l.contains("bidirectional=true"))
        .count();
    assert_eq!(authenticated, 3, "{console}");
    // Queue pairs reconnected with their controller, after the kernel target's port came
    // back and after our target's stall.
    assert_eq!(
        console
            .matches("VERIFY QUEUE-PAIR-ACROSS-RECONNECT")
            .count(),
        2,
        "{console}"
    );
    assert_eq!(
        console
            .matches("VERIFY PASS transport=rdma queues=3")
            .count(),
        2,
        "{console}"
    );
    // Registered memory against both targets: every command of the phase went straight to
    // or from the caller's registered buffer.
    assert_eq!(
        console
            .matches("VERIFY REGISTERED transport=rdma registered=yes")
            .count(),
        2,
        "{console}"
    );
    assert!(
        !console.contains("transport error"),
        "a queue pair failed:\n{console}"
    );
}
