//! Broken targets played by a plain TCP listener: every failure is a typed error within the
//! configured timeout.

mod common;

use std::time::{Duration, Instant};

use common::{host, options};
use nvmeof_initiator::nvme_spec::tcp::FatalErrorStatus;
use nvmeof_initiator::{Controller, DiscoveryOptions, Error, TargetAddr, discover};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// What the fake target does after reading the ICReq.
#[derive(Clone, Copy)]
enum Behaviour {
    /// Answers 128 bytes of garbage.
    Garbage,
    /// Never answers (keeps the connection open).
    Silent,
    /// Sends half a valid ICResp, then closes.
    HalfThenClose,
    /// Sends a valid ICResp, then garbage where the Connect response should be.
    GarbageAfterIcResp,
    /// Sends a valid ICResp, then a C2HTermReq.
    TermReq,
}

/// Reads the host's ICReq; returns a valid ICResp to answer it with (`None`: the host left).
async fn read_icreq(s: &mut tokio::net::TcpStream) -> Option<[u8; 128]> {
    let mut icreq = [0u8; 128];
    s.read_exact(&mut icreq).await.ok()?;
    let mut icresp = [0u8; 128];
    icresp[0] = 0x01; // ICResp
    icresp[2] = 128; // HLEN
    icresp[4..8].copy_from_slice(&128u32.to_le_bytes());
    icresp[12..16].copy_from_slice(&(128u32 * 1024).to_le_bytes()); // MAXH2CDATA
    Some(icresp)
}

async fn fake_target(b: Behaviour) -> TargetAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let Some(icresp) = read_icreq(&mut s).await else {
                    return;
                };
                match b {
                    Behaviour::Garbage => {
                        let _ = s.write_all(&[0xA5; 128]).await;
                    }
                    Behaviour::Silent => {}
                    Behaviour::HalfThenClose => {
                        let _ = s.write_all(&icresp[..64]).await;
                        return;
                    }
                    Behaviour::GarbageAfterIcResp => {
                        let _ = s.write_all(&icresp).await;
                        let _ = s.write_all(&[0x5A; 64]).await;
                    }
                    Behaviour::TermReq => {
                        let _ = s.write_all(&icresp).await;
                        let mut t = [0u8; 24];
                        t[0] = 0x03; // C2HTermReq
                        t[2] = 24;
                        t[4..8].copy_from_slice(&24u32.to_le_bytes());
                        t[8..10].copy_from_slice(&2u16.to_le_bytes()); // PDU sequence error
                        let _ = s.write_all(&t).await;
                    }
                }
                // Hold the connection open until the host gives up.
                let mut sink = [0u8; 4096];
                while let Ok(n) = s.read(&mut sink).await {
                    if n == 0 {
                        break;
                    }
                }
            });
        }
    });
    TargetAddr::new("127.0.0.1", addr.port())
}

fn quick(addr: TargetAddr) -> nvmeof_initiator::ConnectOptions {
    let mut o = options(addr);
    o.timeouts.connect = Duration::from_millis(700);
    o.timeouts.admin = Duration::from_millis(700);
    o
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_icresp_is_a_protocol_error() {
    let addr = fake_target(Behaviour::Garbage).await;
    let start = Instant::now();
    let e = Controller::connect(quick(addr)).await.expect_err("garbage");
    assert!(start.elapsed() < Duration::from_secs(2));
    match e {
        Error::Protocol { source, .. } => {
            assert_eq!(source.fes, FatalErrorStatus::InvalidPduHeaderField);
        }
        other => panic!("expected a protocol error, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_target_times_out() {
    let addr = fake_target(Behaviour::Silent).await;
    let start = Instant::now();
    let e = Controller::connect(quick(addr.clone()))
        .await
        .expect_err("silent");
    let took = start.elapsed();
    assert!(e.is_timeout(), "{e:?}");
    assert!(
        e.to_string()
            .contains("the answer to the NVMe/TCP connection request"),
        "{e}"
    );
    assert!(
        took >= Duration::from_millis(600) && took < Duration::from_secs(2),
        "{took:?}"
    );

    let mut d = DiscoveryOptions::new(addr, host());
    d.timeouts.connect = Duration::from_millis(500);
    let start = Instant::now();
    let e = discover(&d).await.expect_err("silent discovery");
    assert!(e.is_timeout(), "{e:?}");
    assert!(start.elapsed() < Duration::from_secs(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_mid_icresp_is_a_lost_connection() {
    let addr = fake_target(Behaviour::HalfThenClose).await;
    let e = Controller::connect(quick(addr)).await.expect_err("closed");
    match e {
        Error::ConnectionLost { reason, .. } => {
            assert!(reason.contains("closed"), "{reason}");
        }
        other => panic!("expected a lost connection, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_instead_of_a_response() {
    let addr = fake_target(Behaviour::GarbageAfterIcResp).await;
    let start = Instant::now();
    let e = Controller::connect(quick(addr)).await.expect_err("garbage");
    assert!(matches!(e, Error::Protocol { .. }), "{e:?}");
    assert!(start.elapsed() < Duration::from_secs(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn target_termreq_is_reported() {
    let addr = fake_target(Behaviour::TermReq).await;
    let e = Controller::connect(quick(addr)).await.expect_err("termreq");
    match &e {
        Error::TermReq { fes, .. } => assert_eq!(*fes, 2),
        other => panic!("expected a TermReq error, got {other:?}"),
    }
    assert!(e.to_string().contains("PDU Sequence Error"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_listening() {
    // A port that was free a moment ago.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let e = Controller::connect(quick(TargetAddr::new("127.0.0.1", port)))
        .await
        .expect_err("refused");
    assert!(matches!(e, Error::Connect { .. }), "{e:?}");
}

/// A target that answers every Fabrics Connect with Connect Invalid Parameters and records
/// each Connect's attributes (CATTR).
async fn connect_refusing_target() -> (TargetAddr, std::sync::Arc<std::sync::Mutex<Vec<u8>>>) {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().unwrap();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = std::sync::Arc::clone(&seen);
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let log = std::sync::Arc::clone(&log);
            tokio::spawn(async move {
                let Some(icresp) = read_icreq(&mut s).await else {
                    return;
                };
                if s.write_all(&icresp).await.is_err() {
                    return;
                }
                // The Connect capsule: an 8-byte PDU header, the 64-byte command, 1 KiB data.
                let mut head = [0u8; 8];
                if s.read_exact(&mut head).await.is_err() {
                    return;
                }
                let plen = u32::from_le_bytes(head[4..8].try_into().unwrap()) as usize;
                let mut rest = vec![0u8; plen.saturating_sub(8)];
                if s.read_exact(&mut rest).await.is_err() {
                    return;
                }
                let sqe = &rest[..64];
                log.lock().unwrap().push(sqe[46]);
                let mut resp = [0u8; 24];
                resp[0] = 0x05; // CapsuleResp
                resp[2] = 24;
                resp[4..8].copy_from_slice(&24u32.to_le_bytes());
                resp[20..22].copy_from_slice(&sqe[2..4]); // command identifier
                // Status: SCT 1 (command specific), SC 0x82 (Connect Invalid Parameters).
                resp[22..24].copy_from_slice(&((1u16 << 9) | (0x82 << 1)).to_le_bytes());
                let _ = s.write_all(&resp).await;
                let mut sink = [0u8; 4096];
                while let Ok(n) = s.read(&mut sink).await {
                    if n == 0 {
                        break;
                    }
                }
            });
        }
    });
    (TargetAddr::new("127.0.0.1", addr.port()), seen)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_sq_flow_control_disable_is_asked_again_without_it() {
    let (addr, seen) = connect_refusing_target().await;
    let e = Controller::connect(quick(addr.clone()))
        .await
        .expect_err("refused");
    let status = e.status().expect("a Connect status");
    assert_eq!((status.sct, status.sc), (1, 0x82), "{e}");
    // First with CATTR bit 2 (disable SQ flow control), then on a new connection without.
    assert_eq!(*seen.lock().unwrap(), [0b100, 0]);

    // Asked not to, the host never sets the attribute.
    seen.lock().unwrap().clear();
    let mut o = quick(addr);
    o.disable_sq_flow_control = false;
    Controller::connect(o).await.expect_err("refused");
    assert_eq!(*seen.lock().unwrap(), [0]);
}
