//! The Linux kernel NVMe/RDMA host (nvme-rdma over Soft-RoCE, in a QEMU guest) against
//! `nvmeof-targetd` listening on `rdma://10.0.2.15:4420` in the same guest: discovery over
//! RDMA, connect with two I/O queues, Identify with keyed SGLs, fio with verify (4k and 128k
//! random writes at iodepth 16), 1 MiB transfers, flush, discard, write zeroes, disconnect,
//! an RDMA listener added and removed live through `nvmeof-targetd ctl`, and a clean shutdown
//! of the daemon.
//!
//! Before that, nvmf-rdma's loopback example (when built) runs in the guest: an RDMA-CM
//! connect rejected with INVALID_QID, then one accepted, and rounds of SEND/RECV with RDMA
//! READ and RDMA WRITE of registered memory.
//!
//! The host kernel here has no RDMA, so both sides run in the guest (`tests/guest/
//! kernel-host-rdma.sh`). Needs the guest prepared by `tests/interop/setup.sh` and
//! `NVMEOF_INTEROP=1` (`.ci/run` does both); without it the test prints why it did nothing.
//! The daemon is copied into the guest from the build, so `cargo build --bins` must have run.

use std::process::Command;

use nvmeof_tests::{bin_path, guest_sh, run_guest, skip_without_interop, workspace_root};

const NQN: &str = "nqn.2026-11.io.nvmeof-direct:kernel-host-rdma";

#[test]
fn kernel_rdma_host_discover_connect_fio_verify() {
    if skip_without_interop() {
        return;
    }
    let targetd = bin_path("nvmeof-targetd");
    // nvmf-rdma's loopback example (built by `cargo test --workspace`) checks the verbs layer
    // on its own first: connect, reject, SEND/RECV, RDMA READ/WRITE.
    let loopback = targetd.with_file_name("examples").join("loopback");
    let mut cmd = Command::new(guest_sh());
    cmd.args(["run", "--with-rdma", "--with-fio", "--timeout", "900"])
        .arg("--add-bin")
        .arg(format!("{}:/usr/bin/nvmeof-targetd", targetd.display()));
    if loopback.exists() {
        cmd.arg("--add-bin").arg(format!(
            "{}:/usr/bin/nvmf-rdma-loopback",
            loopback.display()
        ));
    } else {
        eprintln!(
            "note: {} is not built (cargo build -p nvmf-rdma --examples): verbs loopback not run",
            loopback.display()
        );
    }
    cmd.arg("--env")
        .arg(format!("TARGET_NQN={NQN}"))
        .arg(workspace_root().join("tests/guest/kernel-host-rdma.sh"));
    let console = run_guest(&mut cmd);
    assert!(console.contains("PASS: kernel NVMe/RDMA host"), "{console}");
    if loopback.exists() {
        assert!(console.contains("LOOPBACK PASS"), "{console}");
        assert!(
            console.contains("client: rejected with Some(3)"),
            "{console}"
        );
    }
    // The daemon's log (printed by the guest script) shows the RDMA path was taken.
    for needle in [
        "listening listener=rdma://10.0.2.15:4420",
        "discovery controller connected",
        "controller connected",
        "NVMe/RDMA queue pair accepted",
        "qid=2",
        "listening listener=rdma://10.0.2.15:4422",
        "stopped listening listener=rdma://10.0.2.15:4422",
        "shutdown complete flush_failures=0",
    ] {
        assert!(
            console.contains(needle),
            "{needle:?} not in the log:\n{console}"
        );
    }
    assert!(
        !console.contains("transport error"),
        "a queue pair failed:\n{console}"
    );
}
