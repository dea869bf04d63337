//! The initiator (library and CLI) against the Linux 6.12 kernel NVMe/TCP target (nvmet) with
//! DH-HMAC-CHAP: one-way and two-way authentication (SHA-512, ffdhe2048) of the admin queue
//! and both I/O queues with written and read-back data; a wrong host key, a wrong controller
//! key and no key at all each end in a one-line error.
//!
//! Needs the 6.12 guest prepared by `tests/interop/setup.sh --with-k612` and
//! `NVMEOF_INTEROP=1`; without it the test prints why it did nothing.

use std::process::Command;
use std::time::Duration;

use nvme_auth::{DhchapKey, HashId, Secret};
use nvmeof_initiator::{
    ConnectOptions, Controller, DhchapSecrets, Error, HostIdentity, ReconnectPolicy, TargetAddr,
};
use nvmeof_tests::{
    BackgroundGuest, bin_path, free_port, guest_sh, skip_without_interop, workspace_root,
};

const KNQN: &str = "nqn.2014-08.org.nvmexpress:nvmeof-direct-auth-interop";
const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:6a0f0c4e-0000-4000-8000-0000000000d1";

fn key(byte: u8, hash: HashId) -> String {
    DhchapKey::new(Secret::new(vec![byte; hash.digest_len()]), Some(hash))
        .unwrap()
        .to_dhhc1()
}

fn options(port: u16, secrets: Option<(&str, Option<&str>)>) -> ConnectOptions {
    let host = HostIdentity::new(HOSTNQN, [0xd1; 16]).unwrap();
    let mut o = ConnectOptions::new(TargetAddr::new("127.0.0.1", port), KNQN, host);
    o.io_queues = Some(2);
    o.queue_depth = 32;
    // The guest runs under emulation: be patient.
    o.timeouts.connect = Duration::from_secs(30);
    o.timeouts.admin = Duration::from_secs(30);
    o.timeouts.io = Duration::from_secs(60);
    o.reconnect = ReconnectPolicy::never();
    o.dhchap = secrets.map(|(h, c)| DhchapSecrets::parse(h, c).unwrap());
    o
}

async fn write_and_verify(o: ConnectOptions, tag: u8) {
    let ctrl = Controller::connect(o)
        .await
        .expect("authenticated connect to nvmet");
    let ns = ctrl.namespace(1).await.expect("namespace");
    for q in 0..2 {
        let nsq = ns.on_queue(q);
        let lba = u64::from(tag) * 64 + q as u64 * 16;
        let data: Vec<u8> = (0..8192).map(|i| tag ^ (i % 251) as u8 ^ q as u8).collect();
        nsq.write(lba, &data).await.expect("write");
        let mut back = vec![0; 8192];
        nsq.read(lba, &mut back).await.expect("read");
        assert!(back == data, "queue {q}: read data differs from written");
    }
    ctrl.disconnect().await.expect("disconnect");
}

async fn refused(o: ConnectOptions, want: &str) {
    match Controller::connect(o).await {
        Err(e @ Error::Auth { .. }) => {
            let s = e.to_string();
            assert!(s.contains(want) && !s.contains('\n'), "{s}");
        }
        Err(e) => panic!("expected an authentication error, got: {e}"),
        Ok(_) => panic!("connected to nvmet without the right keys"),
    }
}

#[test]
fn initiator_authenticates_to_the_kernel_target_both_ways() {
    if skip_without_interop() {
        return;
    }
    let (host_key, ctrl_key) = (key(0x51, HashId::Sha256), key(0x52, HashId::Sha384));
    let wrong = key(0x53, HashId::Sha256);
    let port = free_port();
    let mut cmd = Command::new(guest_sh());
    cmd.args(["start", "--kernel", "612", "--ready-marker", "NVMET-READY"])
        .args(["--timeout", "300", "--hostfwd", &format!("{port}:4420")]);
    for env in [
        format!("NVMET_NQN={KNQN}"),
        "NVMET_NS_SIZE_MB=32".into(),
        "NVMET_BACKEND=brd".into(),
        format!("AUTH_HOST={HOSTNQN}"),
        format!("AUTH_KEY={host_key}"),
        format!("AUTH_CTRL_KEY={ctrl_key}"),
        "AUTH_HASH=hmac(sha512)".into(),
        "AUTH_DHGROUP=ffdhe2048".into(),
    ] {
        cmd.arg("--env").arg(env);
    }
    cmd.arg(workspace_root().join("tests/guest/nvmet-auth-target.sh"));
    let mut guest = BackgroundGuest::start(&mut cmd);

    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        write_and_verify(options(port, Some((&host_key, None))), 1).await;
        write_and_verify(options(port, Some((&host_key, Some(&ctrl_key)))), 2).await;
        refused(
            options(port, Some((&wrong, None))),
            "authentication of queue 0 failed: peer reported failure: authentication failed",
        )
        .await;
        refused(
            options(port, Some((&host_key, Some(&wrong)))),
            "controller response mismatch",
        )
        .await;
        refused(options(port, None), "no host secret was given").await;
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
        .args(["-q", HOSTNQN, "-I", "6a0f0c4e-0000-4000-8000-0000000000d1"])
        .args(["--timeout", "30", "--dhchap-secret", &wrong])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("authentication of queue 0 failed"), "{err}");

    let code = guest.stop();
    let console = guest.console();
    assert_eq!(code, Some(0), "the guest script failed:\n{console}");
    // nvmet's own account: controllers that required DH-HMAC-CHAP, and the wrong host key.
    assert!(console.contains("with DH-HMAC-CHAP"), "{console}");
    assert!(
        console.contains("qid 0 host response mismatch"),
        "{console}"
    );
}
