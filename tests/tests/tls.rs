//! NVMe/TCP over TLS 1.3 with a PSK between the nvmeof initiator (library and CLI) and a
//! running `nvmeof-targetd` with a `tls = "required"` listener: identity versions 0 and 1
//! with verified data on every queue, a wrong PSK refused in one line on both sides, a plain
//! connection to the TLS listener refused, a host with a PSK refused on a plain listener, and
//! the discovery log's TREQ/TSAS. Keys never reach the daemon's log.

use std::process::Command;
use std::time::Duration;

use nvme_auth::tls::ConfiguredPsk;
use nvme_auth::{HashId, Secret};
use nvme_spec::log::{tcp_sectype, treq};
use nvmeof_initiator::{
    ConnectOptions, Controller, DiscoveryOptions, Error, HostIdentity, TargetAddr, TlsOptions,
    discover,
};
use nvmeof_tests::{TEST_HOSTNQN, TargetProcess, bin_path, free_port};

const NQN: &str = "nqn.2026-11.io.nvmeof-direct:tls";
const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:6a0f0c4e-0000-4000-8000-00000000b001";

fn psk(byte: u8) -> String {
    ConfiguredPsk::new(Secret::new(vec![byte; 32]), Some(HashId::Sha256))
        .unwrap()
        .to_interchange()
}

/// A daemon with a TLS listener (port `.0`) and a plain one (`.1`); HOST holds psk(1),
/// TEST_HOSTNQN has no key.
fn start(dir: &std::path::Path) -> (TargetProcess, u16, u16) {
    let (tls_port, plain_port) = (free_port(), free_port());
    let text = format!(
        r#"
[[listener]]
address = "tcp://127.0.0.1:{tls_port}"
tls = "required"

[[listener]]
address = "tcp://127.0.0.1:{plain_port}"

[[subsystem]]
nqn = "{NQN}"
hosts = ["{TEST_HOSTNQN}"]

[[subsystem.host]]
nqn = "{HOST}"
tls_psk = "{}"

[[subsystem.namespace]]
backend = "mem:8M"
"#,
        psk(1)
    );
    let t = TargetProcess::with_config(dir, &text, 0o600, tls_port);
    (t, tls_port, plain_port)
}

fn options(port: u16, hostnqn: &str, key: Option<&str>, version: u8) -> ConnectOptions {
    let id = HostIdentity::new(hostnqn, [9; 16]).unwrap();
    let mut o = ConnectOptions::new(TargetAddr::new("127.0.0.1", port), NQN, id);
    o.io_queues = Some(2);
    o.reconnect = nvmeof_initiator::ReconnectPolicy::never();
    o.timeouts.connect = Duration::from_secs(5);
    o.timeouts.admin = Duration::from_secs(5);
    o.tls = key.map(|k| TlsOptions {
        identity_version: version,
        ..TlsOptions::parse(k).unwrap()
    });
    o
}

/// Connects, writes a pattern through every I/O queue and reads it back.
async fn write_and_verify(o: ConnectOptions, tag: u8) {
    let ctrl = Controller::connect(o).await.expect("TLS connect");
    let ns = ctrl.namespace(1).await.expect("namespace");
    for q in 0..2 {
        let nsq = ns.on_queue(q);
        let lba = u64::from(tag) * 64 + q as u64 * 32;
        // Larger than a TLS record, so that data spans several.
        let data: Vec<u8> = (0..65536)
            .map(|i| tag ^ (i % 253) as u8 ^ q as u8)
            .collect();
        nsq.write(lba, &data).await.expect("write");
        let mut back = vec![0; data.len()];
        nsq.read(lba, &mut back).await.expect("read");
        assert!(back == data, "queue {q}: read data differs from written");
    }
    ctrl.disconnect().await.expect("disconnect");
}

async fn refused(o: ConnectOptions) -> Error {
    match Controller::connect(o).await {
        Err(e) => {
            assert!(!e.to_string().contains('\n'), "one line: {e}");
            e
        }
        Ok(_) => panic!("connected"),
    }
}

#[test]
fn tls_psk_connects_and_everything_else_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (mut t, tls_port, plain_port) = start(dir.path());
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        write_and_verify(options(tls_port, HOST, Some(&psk(1)), 0), 1).await;
        write_and_verify(options(tls_port, HOST, Some(&psk(1)), 1), 2).await;

        let e = refused(options(tls_port, HOST, Some(&psk(2)), 0)).await;
        assert!(matches!(e, Error::Tls { .. }), "{e}");
        assert!(e.to_string().contains("TLS handshake failed"), "{e}");
        // A host the subsystem has no PSK for.
        let e = refused(options(tls_port, TEST_HOSTNQN, Some(&psk(1)), 0)).await;
        assert!(matches!(e, Error::Tls { .. }), "{e}");
        // Plain TCP to the TLS listener: the ICReq is not a TLS ClientHello.
        let e = refused(options(tls_port, TEST_HOSTNQN, None, 0)).await;
        assert!(e.to_string().contains("lost"), "{e}");
        // The host with a PSK may not skip TLS on the plain listener.
        let e = refused(options(plain_port, HOST, None, 0)).await;
        assert!(matches!(e, Error::Status { .. }), "{e}");
        assert!(e.to_string().contains("Invalid Host"), "{e}");
        // TLS to the plain listener: the target answers the ClientHello as a bad ICReq.
        let e = refused(options(plain_port, HOST, Some(&psk(1)), 0)).await;
        assert!(matches!(e, Error::Tls { .. }), "{e}");

        // Discovery (over the plain listener) shows each host the listener it may use: the
        // TLS one, with TREQ required and TSAS TLS 1.3, to the host with a PSK.
        for (host, port, want) in [
            (
                HOST,
                tls_port,
                (treq::SECURE_CHANNEL_REQUIRED, tcp_sectype::TLS13),
            ),
            (
                TEST_HOSTNQN,
                plain_port,
                (treq::SECURE_CHANNEL_NOT_SPECIFIED, tcp_sectype::NONE),
            ),
        ] {
            let id = HostIdentity::new(host, [9; 16]).unwrap();
            let addr = TargetAddr::new("127.0.0.1", plain_port);
            let log = discover(&DiscoveryOptions::new(addr, id))
                .await
                .expect("discovery");
            let mine: Vec<_> = log.entries.iter().filter(|e| e.subnqn == NQN).collect();
            assert_eq!(mine.len(), 1, "{host}: {mine:?}");
            let e = mine[0];
            assert_eq!(e.trsvcid, port.to_string(), "{host}: {e:?}");
            assert_eq!((e.treq & 3, e.tcp_sectype), (want.0, Some(want.1)), "{e:?}");
        }
    });

    // The CLI: a wrong key is one line and exit status 3; --tls without a key is a usage error.
    let cli = |extra: &[&str]| {
        Command::new(bin_path("nvmeof"))
            .args(["probe", "-a", "127.0.0.1", "-s", &tls_port.to_string()])
            .args(["-n", NQN, "-q", HOST])
            .args(["-I", "6a0f0c4e-0000-4000-8000-00000000b0ff"])
            .args(extra)
            .env("NVMEOF_STATE_DIR", dir.path())
            .output()
            .unwrap()
    };
    let out = cli(&["--tls-key", &psk(2)]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("TLS handshake failed"), "{err}");
    let out = cli(&["--tls"]);
    assert_eq!(out.status.code(), Some(2));
    let out = cli(&["--tls-key", &psk(1)]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let log = t.log();
    assert!(log.contains("TLS handshake failed"), "{log}");
    assert!(log.contains("must connect over TLS"), "{log}");
    for k in [psk(1), psk(2)] {
        assert!(!log.contains(&k[16..40]), "a key reached the log");
    }
    let (code, _) = t.terminate();
    assert_eq!(code, Some(0));
}

/// A PSK changed in the configuration file applies after SIGHUP without a restart: the old key
/// is refused at the next handshake, the new one connects.
#[test]
fn a_psk_changed_by_sighup_applies_at_the_next_handshake() {
    let dir = tempfile::tempdir().unwrap();
    let (mut t, tls_port, _) = start(dir.path());
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(write_and_verify(
        options(tls_port, HOST, Some(&psk(1)), 0),
        3,
    ));

    let path = dir.path().join("target.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, text.replace(&psk(1), &psk(3))).unwrap();
    t.signal(libc::SIGHUP);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !t.log().contains("reload applied") {
        assert!(
            std::time::Instant::now() < deadline,
            "no reload: {}",
            t.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    rt.block_on(async {
        let e = refused(options(tls_port, HOST, Some(&psk(1)), 0)).await;
        assert!(matches!(e, Error::Tls { .. }), "{e}");
        write_and_verify(options(tls_port, HOST, Some(&psk(3)), 0), 4).await;
    });
    let log = t.log();
    assert!(log.contains("new keys for host"), "{log}");
    assert!(!log.contains(&psk(3)[16..40]), "a key reached the log");
    let (code, _) = t.terminate();
    assert_eq!(code, Some(0));
}
