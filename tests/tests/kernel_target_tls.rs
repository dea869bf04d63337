//! The initiator (library and CLI) against the Linux 6.12 kernel NVMe/TCP target (nvmet, with
//! tlshd) on a port that requires TLS 1.3: the PSK the guest inserted with `nvme check-tls-key`
//! connects the admin queue and both I/O queues with written and read-back data; another PSK
//! and plain TCP end in a one-line error.
//!
//! Needs the 6.12 guest prepared by `tests/interop/setup.sh --with-k612` and
//! `NVMEOF_INTEROP=1`; without it the test prints why it did nothing.

use std::process::Command;
use std::time::Duration;

use nvme_auth::tls::ConfiguredPsk;
use nvme_auth::{HashId, Secret};
use nvmeof_initiator::{
    ConnectOptions, Controller, Error, HostIdentity, ReconnectPolicy, TargetAddr, TlsOptions,
};
use nvmeof_tests::{
    BackgroundGuest, bin_path, free_port, guest_sh, skip_without_interop, workspace_root,
};

const KNQN: &str = "nqn.2014-08.org.nvmexpress:nvmeof-direct-tls-interop";
const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:6a0f0c4e-0000-4000-8000-0000000000f1";

fn psk(byte: u8) -> String {
    ConfiguredPsk::new(Secret::new(vec![byte; 32]), Some(HashId::Sha256))
        .unwrap()
        .to_interchange()
}

fn options(port: u16, key: Option<&str>) -> ConnectOptions {
    let host = HostIdentity::new(HOSTNQN, [0xf1; 16]).unwrap();
    let mut o = ConnectOptions::new(TargetAddr::new("127.0.0.1", port), KNQN, host);
    o.io_queues = Some(2);
    o.queue_depth = 32;
    // The guest runs under emulation: be patient.
    o.timeouts.connect = Duration::from_secs(30);
    o.timeouts.admin = Duration::from_secs(30);
    o.timeouts.io = Duration::from_secs(60);
    o.reconnect = ReconnectPolicy::never();
    o.tls = key.map(|k| TlsOptions::parse(k).unwrap());
    o
}

#[test]
fn initiator_connects_to_the_kernel_target_over_tls() {
    if skip_without_interop() {
        return;
    }
    let (good, wrong) = (psk(0x61), psk(0x62));
    let port = free_port();
    let mut cmd = Command::new(guest_sh());
    cmd.args(["start", "--kernel", "612", "--ready-marker", "NVMET-READY"])
        .args(["--timeout", "300", "--hostfwd", &format!("{port}:4420")]);
    for env in [
        format!("NVMET_NQN={KNQN}"),
        format!("TLS_HOST={HOSTNQN}"),
        format!("TLS_PSK={good}"),
    ] {
        cmd.arg("--env").arg(env);
    }
    cmd.arg(workspace_root().join("tests/guest/nvmet-tls-target.sh"));
    let mut guest = BackgroundGuest::start(&mut cmd);

    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let ctrl = Controller::connect(options(port, Some(&good)))
            .await
            .expect("TLS connect to nvmet");
        let ns = ctrl.namespace(1).await.expect("namespace");
        for q in 0..2 {
            let nsq = ns.on_queue(q);
            let lba = q as u64 * 64;
            let data: Vec<u8> = (0..65536).map(|i| (i % 251) as u8 ^ q as u8).collect();
            nsq.write(lba, &data).await.expect("write");
            let mut back = vec![0; data.len()];
            nsq.read(lba, &mut back).await.expect("read");
            assert!(back == data, "queue {q}: read data differs from written");
        }
        ctrl.disconnect().await.expect("disconnect");

        match Controller::connect(options(port, Some(&wrong))).await {
            Err(e @ Error::Tls { .. }) => assert!(!e.to_string().contains('\n'), "{e}"),
            Err(e) => panic!("expected a TLS error, got: {e}"),
            Ok(_) => panic!("connected to nvmet with the wrong PSK"),
        }
        match Controller::connect(options(port, None)).await {
            Err(e) => assert!(!e.to_string().contains('\n'), "{e}"),
            Ok(_) => panic!("connected to nvmet's TLS port without TLS"),
        }
    });

    let out = Command::new(bin_path("nvmeof"))
        .args([
            "probe",
            "-a",
            "127.0.0.1",
            "-s",
            &port.to_string(),
            "-n",
            KNQN,
        ])
        .args(["-q", HOSTNQN, "-I", "6a0f0c4e-0000-4000-8000-0000000000f1"])
        .args(["--timeout", "30", "--tls-key", &wrong])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("TLS handshake failed"), "{err}");

    let code = guest.stop();
    let console = guest.console();
    assert_eq!(code, Some(0), "the guest script failed:\n{console}");
    // tlshd's account: the right PSK's three handshakes succeeded, the others failed.
    assert!(console.matches("was successful").count() >= 3, "{console}");
    assert!(console.matches("failed").count() >= 3, "{console}");
    assert!(console.contains("addr_treq required"), "{console}");
}
