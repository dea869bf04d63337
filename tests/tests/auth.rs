//! DH-HMAC-CHAP between the nvmeof initiator (library and CLI) and a running `nvmeof-targetd`
//! configured with `[[subsystem.host]]` tables: one-way and two-way authentication of every
//! queue with verified data, and the refusals (wrong host key, no host key, a controller key
//! the target does not have, a wrong controller key, a host that skips authentication) while
//! the daemon keeps serving the others. Keys never reach the daemon's log.

use std::process::Command;
use std::time::Duration;

use nvme_auth::{DhchapKey, HashId, Secret};
use nvme_spec::command::build;
use nvme_spec::status::specific;
use nvme_spec::{SglDescriptor, Status};
use nvmeof_initiator::{
    ConnectOptions, Controller, DhchapSecrets, Error, HostIdentity, TargetAddr,
};
use nvmeof_tests::{RawHost, Reply, TEST_HOSTNQN, TargetProcess, bin_path, free_port};

const NQN: &str = "nqn.2026-11.io.nvmeof-direct:auth";
/// Authenticates one way.
const HOST_ONE: &str = "nqn.2014-08.org.nvmexpress:uuid:6a0f0c4e-0000-4000-8000-00000000a001";
/// Authenticates both ways.
const HOST_TWO: &str = "nqn.2014-08.org.nvmexpress:uuid:6a0f0c4e-0000-4000-8000-00000000a002";

fn key(byte: u8, hash: Option<HashId>, len: usize) -> String {
    DhchapKey::new(Secret::new(vec![byte; len]), hash)
        .unwrap()
        .to_dhhc1()
}

struct Keys {
    one: String,
    two: String,
    two_ctrl: String,
    wrong: String,
}

fn keys() -> Keys {
    Keys {
        one: key(0x11, Some(HashId::Sha256), 32),
        two: key(0x22, Some(HashId::Sha384), 48),
        two_ctrl: key(0x33, Some(HashId::Sha512), 64),
        wrong: key(0x44, Some(HashId::Sha256), 32),
    }
}

/// A daemon whose subsystem takes HOST_ONE (host key), HOST_TWO (host and controller keys)
/// and TEST_HOSTNQN without authentication. Its config file is group-readable on purpose.
fn start(dir: &std::path::Path, k: &Keys) -> TargetProcess {
    let port = free_port();
    let text = format!(
        r#"
[[listener]]
address = "tcp://127.0.0.1:{port}"

[[subsystem]]
nqn = "{NQN}"
hosts = ["{TEST_HOSTNQN}"]

[[subsystem.host]]
nqn = "{HOST_ONE}"
dhchap_key = "{}"

[[subsystem.host]]
nqn = "{HOST_TWO}"
dhchap_key = "{}"
dhchap_ctrl_key = "{}"

[[subsystem.namespace]]
backend = "mem:8M"
"#,
        k.one, k.two, k.two_ctrl
    );
    TargetProcess::with_config(dir, &text, 0o640, port)
}

fn options(
    t: &TargetProcess,
    hostnqn: &str,
    host: Option<&str>,
    ctrl: Option<&str>,
) -> ConnectOptions {
    let id = HostIdentity::new(hostnqn, [9; 16]).unwrap();
    let mut o = ConnectOptions::new(TargetAddr::new("127.0.0.1", t.port), NQN, id);
    o.io_queues = Some(2);
    o.reconnect = nvmeof_initiator::ReconnectPolicy::never();
    o.timeouts.connect = Duration::from_secs(5);
    o.timeouts.admin = Duration::from_secs(5);
    o.dhchap = host.map(|h| DhchapSecrets::parse(h, ctrl).unwrap());
    o
}

/// Connects, writes a pattern through every I/O queue and reads it back.
async fn write_and_verify(o: ConnectOptions, tag: u8) {
    let ctrl = Controller::connect(o).await.expect("authenticated connect");
    let ns = ctrl.namespace(1).await.expect("namespace");
    for q in 0..2 {
        let nsq = ns.on_queue(q);
        let lba = u64::from(tag) * 16 + q as u64 * 8;
        let data: Vec<u8> = (0..4096).map(|i| tag ^ (i % 253) as u8 ^ q as u8).collect();
        nsq.write(lba, &data).await.expect("write");
        let mut back = vec![0; 4096];
        nsq.read(lba, &mut back).await.expect("read");
        assert!(back == data, "queue {q}: read data differs from written");
    }
    ctrl.disconnect().await.expect("disconnect");
}

async fn refused(o: ConnectOptions, want: &str) {
    match Controller::connect(o).await {
        Err(e @ Error::Auth { .. }) => {
            let s = e.to_string();
            assert!(s.contains(want), "{s}");
            assert!(!s.contains('\n'), "one line: {s}");
        }
        Err(e) => panic!("expected an authentication error, got: {e}"),
        Ok(_) => panic!("connected without the right keys"),
    }
}

fn count(log: &str, what: &str) -> usize {
    log.matches(what).count()
}

#[test]
fn dhchap_both_ways_refusals_and_a_daemon_that_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let k = keys();
    let mut t = start(dir.path(), &k);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        // One way: the admin queue and both I/O queues authenticate.
        write_and_verify(options(&t, HOST_ONE, Some(&k.one), None), 1).await;
        // Both ways.
        write_and_verify(options(&t, HOST_TWO, Some(&k.two), Some(&k.two_ctrl)), 2).await;
        refused(
            options(&t, HOST_ONE, Some(&k.wrong), None),
            "authentication of queue 0 failed: peer reported failure: authentication failed",
        )
        .await;
        refused(
            options(&t, HOST_ONE, None, None),
            "requires DH-HMAC-CHAP authentication and no host secret was given",
        )
        .await;
        // The target has no controller key for HOST_ONE.
        refused(
            options(&t, HOST_ONE, Some(&k.one), Some(&k.two_ctrl)),
            "peer reported failure: authentication failed",
        )
        .await;
        // A controller that cannot prove the key the host expects.
        refused(
            options(&t, HOST_TWO, Some(&k.two), Some(&k.wrong)),
            "authentication failed: controller response mismatch",
        )
        .await;
    });

    // A host that skips authentication gets Authentication Required for anything else.
    let mut h = RawHost::connect(t.addr(), false, false);
    let c = h.fabrics_connect(NQN, HOST_ONE, 0, 0xFFFF);
    assert!(c.status().is_success(), "{}", c.status());
    assert_eq!(
        c.dw0.get() & nvme_spec::fabrics::CONNECT_AUTHREQ_ATR,
        1 << 17
    );
    let mut id = build::identify(2, nvme_spec::command::cns::CONTROLLER, 0);
    id.dptr = SglDescriptor::tcp_transport(4096);
    match h.command(&id, &[], &[]) {
        Reply::Completion(c, _) => assert_eq!(
            c.status(),
            Status::specific(specific::AUTH_REQUIRED).with_dnr()
        ),
        other => panic!("{other:?}"),
    }
    drop(h);
    // A host without keys is not asked to authenticate.
    let mut h = RawHost::connect(t.addr(), false, false);
    let c = h.fabrics_connect(NQN, TEST_HOSTNQN, 0, 0xFFFF);
    assert_eq!(c.dw0.get() & nvme_spec::fabrics::CONNECT_AUTHREQ_ATR, 0);
    drop(h);

    // The daemon still serves an authenticated host after all that.
    rt.block_on(write_and_verify(
        options(&t, HOST_ONE, Some(&k.one), None),
        3,
    ));

    // The CLI reports the failure in one line and a distinct exit status.
    let out = Command::new(bin_path("nvmeof"))
        .args([
            "probe",
            "-a",
            "127.0.0.1",
            "-s",
            &t.port.to_string(),
            "-n",
            NQN,
        ])
        .args(["-q", HOST_ONE, "-I", "6a0f0c4e-0000-4000-8000-00000000a0ff"])
        .args(["--dhchap-secret", &k.wrong])
        .env("NVMEOF_STATE_DIR", dir.path())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("authentication of queue 0 failed"), "{err}");
    let out = Command::new(bin_path("nvmeof"))
        .args([
            "probe",
            "-a",
            "127.0.0.1",
            "-s",
            &t.port.to_string(),
            "-n",
            NQN,
        ])
        .args(["-q", HOST_TWO, "-I", "6a0f0c4e-0000-4000-8000-00000000a0fe"])
        .args([
            "--dhchap-secret",
            &k.two,
            "--dhchap-ctrl-secret",
            &k.two_ctrl,
        ])
        .env("NVMEOF_STATE_DIR", dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let log = t.log();
    // Three connects of three queues each succeeded (and the CLI's admin + one I/O queue).
    assert!(count(&log, "host authenticated") >= 11, "{log}");
    assert!(count(&log, "host authentication failed") >= 4, "{log}");
    assert!(log.contains("readable by group or others"), "{log}");
    for secret in [&k.one, &k.two, &k.two_ctrl, &k.wrong] {
        assert!(!log.contains(&secret[10..40]), "a key reached the log");
    }
    let (code, _) = t.terminate();
    assert_eq!(code, Some(0));
}

/// One AUTH_Negotiate offering SHA-256 and ffdhe2048 on `h`'s admin queue, and the message
/// the target answers it with.
fn negotiate(h: &mut RawHost, t_id: u16) -> nvme_spec::auth::AuthMessage {
    use nvme_spec::auth::{AuthCommand, AuthMessage, DhGroupId, DhchapProtocol, Protocol};
    use nvme_spec::command::FabricsCommand;
    let msg = AuthMessage::Negotiate {
        t_id,
        sc_c: 0,
        protocols: vec![Protocol::Dhchap(DhchapProtocol {
            hash_ids: vec![HashId::Sha256 as u8],
            dh_group_ids: vec![DhGroupId::Ffdhe2048 as u8],
        })],
    }
    .encode();
    let mut send = FabricsCommand::AuthSend.encode(t_id);
    AuthCommand::send(msg.len() as u32).write_to_sqe(&mut send);
    send.dptr = SglDescriptor::in_capsule(msg.len() as u32);
    match h.command(&send, &msg, &[]) {
        Reply::Completion(c, _) => assert!(c.status().is_success(), "{}", c.status()),
        other => panic!("Authentication Send: {other:?}"),
    }
    let mut recv = FabricsCommand::AuthSend.encode(t_id);
    AuthCommand::receive(4096).write_to_sqe(&mut recv);
    recv.dptr = SglDescriptor::tcp_transport(4096);
    match h.command(&recv, &[], &[]) {
        Reply::Completion(c, data) => {
            assert!(c.status().is_success(), "{}", c.status());
            AuthMessage::parse(&data).expect("an authentication message")
        }
        other => panic!("Authentication Receive: {other:?}"),
    }
}

#[test]
fn an_auth_negotiate_flood_is_refused_once_over_budget() {
    use nvme_spec::auth::{AuthMessage, FailureExplanation};
    let dir = tempfile::tempdir().unwrap();
    let k = keys();
    let port = free_port();
    let metrics = std::net::SocketAddr::from(([127, 0, 0, 1], free_port()));
    let text = format!(
        r#"
[target]
auth_rate = 1
auth_burst = 4
handshake_timeout = "60s"
metrics = "{metrics}"

[[listener]]
address = "tcp://127.0.0.1:{port}"

[[subsystem]]
nqn = "{NQN}"

[[subsystem.host]]
nqn = "{HOST_ONE}"
dhchap_key = "{}"

[[subsystem.namespace]]
backend = "mem:8M"
"#,
        k.one
    );
    let mut t = TargetProcess::with_config(dir.path(), &text, 0o600, port);
    // Two connections of one host negotiate over and over without ever replying.
    let mut hosts: Vec<RawHost> = (0..2)
        .map(|_| {
            let mut h = RawHost::connect(t.addr(), false, false);
            let c = h.fabrics_connect(NQN, HOST_ONE, 0, 0xFFFF);
            assert!(c.status().is_success(), "{}", c.status());
            h
        })
        .collect();
    // Each refusal is answered after the refusal delay (0.5 s).
    let (mut challenges, mut refusals) = (0, 0);
    for i in 0..16u16 {
        match negotiate(&mut hosts[usize::from(i % 2)], i + 1) {
            AuthMessage::Challenge { t_id, .. } => {
                assert_eq!(t_id, i + 1);
                challenges += 1;
            }
            AuthMessage::Failure1 {
                t_id, explanation, ..
            } => {
                assert_eq!(t_id, i + 1);
                assert_eq!(explanation, FailureExplanation::Failed as u8);
                refusals += 1;
            }
            other => panic!("{other:?}"),
        }
    }
    assert!(challenges >= 4, "the burst is served: {challenges}");
    assert!(refusals > 0, "never refused: {challenges} challenges");
    let (code, scrape) = nvmeof_tests::http_get(metrics, "/metrics").unwrap();
    assert_eq!(code, 200);
    let series = r#"nvmeof_auth_failures_total{reason="host_over_budget"}"#;
    assert_eq!(
        nvmeof_tests::scraped(&scrape, series),
        Some(f64::from(refusals)),
        "{scrape}"
    );
    drop(hosts);
    let log = t.log();
    assert!(
        log.contains("host authentication failed") && log.contains("host_over_budget"),
        "{log}"
    );
}
