//! The application-level comparison of direct-attached, NVMe/TCP and iSCSI storage end to end,
//! at a size that proves each column works (its figures are not looked at): one run of
//! `benches/scripts/study1-rocksdb.sh`, which starts `nvmeof-targetd` (a `mem:` namespace) and
//! Debian's tgt on this machine and boots one guest in which RocksDB's `db_bench` fills a
//! database and runs its 80/20 `readrandomwriterandom` on ext4 over a virtio disk, over the
//! kernel NVMe/TCP host connected to our target and over the kernel iSCSI initiator logged in to
//! tgt, for 800 B and 10 KiB values. Every column must report its QD1 read probe and, for each
//! value size, its two result lines with a rate (and percentiles for the mix), and the table
//! must carry both ratios.
//!
//! Needs `NVMEOF_INTEROP=1` and tgt (`tgtd`, `tgtadm`), both provided by the test command; the
//! script builds the guest's rocksdb segment (`tests/interop/setup.sh --with-rocksdb`). Without
//! them the test prints why it did nothing.

use std::path::Path;
use std::process::Command;

use nvmeof_tests::{bin_path, skip_without_interop, workspace_root};

fn tgt_missing() -> bool {
    let found = |name: &str| {
        std::env::var_os("PATH")
            .map(|p| std::env::split_paths(&p).any(|d| d.join(name).is_file()))
            .unwrap_or(false)
            || Path::new("/usr/sbin").join(name).is_file()
    };
    if found("tgtd") && found("tgtadm") {
        return false;
    }
    eprintln!("skipped: tgtd and tgtadm are not installed (apt-get install tgt)");
    true
}

#[test]
fn db_bench_runs_on_a_local_disk_nvme_tcp_and_iscsi_in_one_guest() {
    if skip_without_interop() || tgt_missing() {
        return;
    }
    let out_dir = tempfile::tempdir().expect("tempdir");
    // 256 MiB devices: RocksDB preallocates each write-ahead log at ~70 MiB, and at 128 MiB a
    // mixed phase with 10 KiB values once failed a log write on one column (db_bench then
    // aborts on its assertion), most likely short of space with a second log beside the first.
    let out = Command::new(workspace_root().join("benches/scripts/study1-rocksdb.sh"))
        .arg("--targetd")
        .arg(bin_path("nvmeof-targetd"))
        .args(["--disk-mb", "256", "--num", "200", "--num-large", "30"])
        .args(["--duration", "2", "--threads", "2", "--timeout", "300"])
        .arg("--out")
        .arg(out_dir.path())
        .output()
        .expect("study1-rocksdb.sh");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let console = std::fs::read_to_string(out_dir.path().join("console.log")).unwrap_or_default();
    assert!(
        out.status.success(),
        "study1-rocksdb.sh failed ({:?}):\n{stdout}\n{}\nconsole:\n{console}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let results = std::fs::read_to_string(out_dir.path().join("results.txt")).expect("results");
    for column in ["das", "of", "iscsi"] {
        let probe = format!("ROCKSDB-PROBE column={column} read_4k_qd1_us=");
        assert!(
            results.lines().any(|l| l.starts_with(&probe)),
            "no {probe:?} line:\n{results}\nconsole:\n{console}"
        );
        for value in ["800", "10240"] {
            for phase in ["fill", "mix"] {
                let head = format!("ROCKSDB-RESULT column={column} value={value} phase={phase} ");
                let line = results
                    .lines()
                    .find(|l| l.starts_with(&head))
                    .unwrap_or_else(|| panic!("no {head:?} line:\n{results}\nconsole:\n{console}"));
                let ops: f64 = line
                    .split_whitespace()
                    .find_map(|f| f.strip_prefix("ops="))
                    .and_then(|v| v.parse().ok())
                    .unwrap_or_else(|| panic!("no rate in {line:?}"));
                assert!(ops > 0.0, "no operations in {line:?}");
                if phase == "mix" {
                    for key in [
                        "read_p50_us=",
                        "read_p99_us=",
                        "write_p50_us=",
                        "write_p99_us=",
                    ] {
                        let v = line.split_whitespace().find_map(|f| f.strip_prefix(key));
                        assert!(
                            v.and_then(|v| v.parse::<f64>().ok()).is_some(),
                            "no {key} percentile in {line:?}"
                        );
                    }
                }
            }
        }
    }
    assert!(
        stdout.contains("| oF/DAS |") && stdout.contains("| iSCSI/DAS |"),
        "no ratios in the table:\n{stdout}"
    );
}
