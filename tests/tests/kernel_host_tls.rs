//! The Linux 6.12 kernel NVMe/TCP host (in a QEMU guest, with tlshd) against an
//! `nvmeof-targetd` listener that requires TLS 1.3 with a PSK: the configured PSK comes from
//! `nvme gen-tls-key` and goes into the daemon's config; the guest inserts it into its keyring
//! and connects with `nvme connect --tls`, fio with verify on two I/O queues; plain TCP and a
//! different PSK under the same identity are refused, and the daemon logs the refusals in one
//! line each without key material.
//!
//! Needs the guest prepared by `tests/interop/setup.sh --with-k612` and `NVMEOF_INTEROP=1`;
//! without it the test prints why it did nothing.

use std::process::Command;

use nvme_auth::tls::ConfiguredPsk;
use nvme_auth::{HashId, Secret};
use nvmeof_tests::{
    TargetProcess, assert_console_has, free_port, guest_sh, run_guest, skip_without_interop,
    workspace_root,
};

const NQN: &str = "nqn.2026-11.io.nvmeof-direct:kernel-tls";
const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:6a0f0c4e-0000-4000-8000-0000000000d1";
const HOSTID: &str = "6a0f0c4e-0000-4000-8000-0000000000e1";

/// A configured PSK from nvme-cli, as an administrator makes one.
fn gen_tls_key() -> String {
    let out = Command::new("nvme")
        .args(["gen-tls-key", "--hmac=1"])
        .output()
        .expect("nvme-cli (installed by tests/interop/setup.sh)");
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    let key = text
        .split_whitespace()
        .find(|w| w.starts_with("NVMeTLSkey-1:01:"))
        .unwrap_or_else(|| panic!("no NVMeTLSkey-1:01 key in: {text}"))
        .to_string();
    ConfiguredPsk::parse(&key).expect("nvme-cli's key parses");
    key
}

#[test]
fn kernel_612_host_connects_over_tls_with_the_configured_psk_only() {
    if skip_without_interop() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let psk = gen_tls_key();
    let wrong = ConfiguredPsk::new(Secret::new(vec![0x5a; 32]), Some(HashId::Sha256))
        .unwrap()
        .to_interchange();
    let port = free_port();
    let toml = format!(
        "[[listener]]\naddress = \"tcp://127.0.0.1:{port}\"\ntls = \"required\"\n\n\
         [[subsystem]]\nnqn = \"{NQN}\"\n\n[[subsystem.host]]\nnqn = \"{HOST}\"\n\
         tls_psk = \"{psk}\"\n\n[[subsystem.namespace]]\nbackend = \"mem:64M\"\n"
    );
    let mut t = TargetProcess::with_config(dir.path(), &toml, 0o600, port);
    let mut cmd = Command::new(guest_sh());
    cmd.args(["run", "--kernel", "612", "--with-fio", "--timeout", "600"]);
    for env in [
        format!("TARGET_PORT={port}"),
        format!("TARGET_NQN={NQN}"),
        format!("TLS_HOSTNQN={HOST}"),
        format!("TLS_HOSTID={HOSTID}"),
        format!("TLS_PSK={psk}"),
        format!("WRONG_PSK={wrong}"),
    ] {
        cmd.arg("--env").arg(env);
    }
    cmd.arg(workspace_root().join("tests/guest/kernel-host-tls.sh"));
    let console = run_guest(&mut cmd);
    assert_console_has(
        &console,
        &[
            "refused as expected: plain TCP",
            "refused as expected: wrong PSK",
            "PASS: kernel host TLS against nvmeof-targetd",
        ],
    );
    let log = t.log();
    // The plain ICReq and the wrong PSK's handshakes failed; the right one connected all three
    // queues.
    assert!(log.matches("TLS handshake failed").count() >= 2, "{log}");
    assert!(log.contains(HOST), "{log}");
    for k in [&psk, &wrong] {
        assert!(!log.contains(&k[16..40]), "a key reached the log");
    }
    let (code, _) = t.terminate();
    assert_eq!(code, Some(0));
}
