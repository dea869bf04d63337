//! The user-space NVMe PCIe driver (`crates/nvme-pcie`) against a real controller: QEMU's
//! emulated NVMe controller in the guest, behind the emulated Intel IOMMU and bound to
//! `vfio-pci`. The guest kernel's nvme driver writes a pattern first; the driver's
//! `vfio_probe` example then brings the controller up through VFIO, reads the pattern back,
//! writes and reads every PRP shape up to MDTS on one queue pair, wraps a small queue on a
//! second one, and shuts the controller down. The function is rebound to the kernel's nvme
//! driver, which must read exactly what the probe wrote; the probe must then refuse the
//! kernel-bound function in one line. In the same boot, `nvmeof-targetd --namespace
//! pcie:ADDRESS` must refuse the kernel-bound function, then, with it on `vfio-pci`, serve it
//! over NVMe/TCP to the guest kernel's NVMe/TCP host (loopback) through a fio verify; then
//! `nvmeof-bench` reads it in its das and tcp (in-process target) modes with every read
//! verified (its figures are the emulation's, correctness only). See
//! `tests/interop/guest-scripts/nvme-pcie-vfio.sh`.
//!
//! Needs the guest prepared by `tests/interop/setup.sh` and `NVMEOF_INTEROP=1`; without it the
//! test prints why it did nothing. The probe is built by `cargo test` (an example of
//! `nvme-pcie`), the daemon and the load generator by `cargo build --workspace --bins`.

use std::process::Command;

use nvmeof_tests::{
    assert_console_has, bin_path, guest_sh, run_guest, skip_without_interop, workspace_root,
};

#[test]
fn user_space_driver_and_pcie_namespace_against_qemu_nvme_through_vfio() {
    if skip_without_interop() {
        return;
    }
    let targetd = bin_path("nvmeof-targetd");
    let probe = targetd.with_file_name("examples").join("vfio_probe");
    assert!(
        probe.exists(),
        "{} is not built (cargo build -p nvme-pcie --example vfio_probe)",
        probe.display()
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let disk = dir.path().join("nvme.img");
    std::fs::File::create(&disk)
        .and_then(|f| f.set_len(64 << 20))
        .expect("disk image");
    let console = run_guest(
        Command::new(guest_sh())
            .args([
                "run",
                "--with-fio",
                "--timeout",
                "300",
                "--fail-on-kernel-trace",
            ])
            .arg("--nvme-disk")
            .arg(&disk)
            .arg("--add-bin")
            .arg(format!("{}:/usr/bin/nvme-pcie-probe", probe.display()))
            .arg("--add-bin")
            .arg(format!("{}:/usr/bin/nvmeof-targetd", targetd.display()))
            .arg("--add-bin")
            .arg(format!(
                "{}:/usr/bin/nvmeof-bench",
                bin_path("nvmeof-bench").display()
            ))
            .arg(workspace_root().join("tests/interop/guest-scripts/nvme-pcie-vfio.sh")),
    );
    assert_console_has(
        &console,
        &[
            "PROBE IDENTIFY vid=0x1b36",
            "PROBE EXPECTED-DATA bytes=262144",
            "PROBE PRP-SHAPES qid=1 commands=14 max_transfer=524288",
            "PROBE WRAP qid=2 commands=80 depth=7",
            "PROBE CROSS-QUEUE",
            "PROBE PASS",
            "PASS: kernel nvme driver reads what the user-space driver wrote (1466880 bytes)",
            "PASS: user-space driver refuses a controller bound to the nvme driver",
            "namespace 1: invalid backend configuration: pcie:0000:00:02.0: device: \
         /sys/bus/pci/devices/0000:00:02.0 is bound to the nvme driver, not vfio-pci",
            "NVMe PCIe namespace opened (QEMU NVMe Ctrl",
            "PASS: kernel NVMe/TCP host -> nvmeof-targetd -> pcie:0000:00:02.0 (fio verify)",
            "PASS: nvmeof-bench das and tcp over pcie:0000:00:02.0 (verified reads)",
            "PASS: emulated NVMe PCIe controller",
        ],
    );
}
