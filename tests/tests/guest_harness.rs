//! The interop harness itself: a guest whose kernel panics while booting, before its test
//! script started, is booted again (three boots in all) and then reported as a kernel panic
//! (exit code 125), in both of `guest.sh`'s modes. QEMU TCG with several vCPUs now and then
//! hands a vCPU stale code while the guest kernel patches its own text, which panics a boot;
//! such a boot touched nothing outside the guest, so the harness tries again instead of failing
//! a suite. Here every boot panics on purpose: the kernel is told to start an init that does
//! not exist.
//!
//! Needs the guest prepared by `tests/interop/setup.sh` and `NVMEOF_INTEROP=1`; without it the
//! test prints why it did nothing.

use std::process::Command;

use nvmeof_tests::{guest_sh, skip_without_interop};

fn boot_panics(mode: &[&str]) -> (Option<i32>, String) {
    let dir = tempfile::tempdir().expect("tempdir");
    let script = dir.path().join("never.sh");
    std::fs::write(&script, "echo never-runs\nexit 0\n").expect("script");
    let out = Command::new(guest_sh())
        .args(mode)
        .args([
            "--no-nvme-cli",
            // One vCPU: the boot then panics where it is told to, every time (with several,
            // TCG's stale code can also hang a boot, which would end in a timeout instead).
            "--smp",
            "1",
            "--timeout",
            "120",
            "--append",
            "rdinit=/nonexistent",
        ])
        .arg("--log")
        .arg(dir.path().join("boot.log"))
        .arg(&script)
        .output()
        .expect("guest.sh");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out.status.code(), stderr)
}

#[test]
fn a_guest_that_panics_while_booting_is_booted_three_times_then_reported() {
    if skip_without_interop() {
        return;
    }
    let (code, stderr) = boot_panics(&["run"]);
    assert_eq!(
        code,
        Some(125),
        "run: expected a kernel panic (125):\n{stderr}"
    );
    for attempt in ["booting again (2 of 3)", "booting again (3 of 3)"] {
        assert!(stderr.contains(attempt), "run: no '{attempt}':\n{stderr}");
    }
    assert_eq!(
        stderr.matches("booting 6.").count(),
        3,
        "run: three boots:\n{stderr}"
    );

    let (code, stderr) = boot_panics(&["start", "--ready-marker", "NEVER-READY"]);
    assert_eq!(code, Some(1), "start: expected a failed start:\n{stderr}");
    assert!(
        stderr.contains("booting again (3 of 3)") && stderr.contains("start failed: kernel panic"),
        "start: three boots, then a kernel panic:\n{stderr}"
    );
}
