//! Both sides of the handshake over a real loopback socket.

use nvme_auth::tls::{ConfiguredPsk, TlsPsk};
use nvme_auth::{HashId, Secret};
use nvmf_tls::{ClientContext, ServerContext, Stream, TlsError};
use tokio::net::{TcpListener, TcpStream};

const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:0000-host";
const SUB: &str = "nqn.2026-11.io.nvmeof-direct:tls";

fn psk(byte: u8) -> TlsPsk {
    ConfiguredPsk::new(Secret::new(vec![byte; 32]), Some(HashId::Sha256))
        .unwrap()
        .tls_psk(1, HOST, SUB)
        .unwrap()
}

/// Runs a handshake between a server that knows `server` and a client that offers `client`.
async fn pair(
    server: TlsPsk,
    client: TlsPsk,
) -> (Result<Stream, TlsError>, Result<Stream, TlsError>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let sctx =
        ServerContext::new(move |id| (id == server.identity).then(|| server.key.clone())).unwrap();
    let cctx = ClientContext::new(client).unwrap();
    let srv = async {
        let (tcp, _) = l.accept().await.unwrap();
        Stream::accept(&sctx, tcp).await
    };
    let cli = async { Stream::connect(&cctx, TcpStream::connect(addr).await.unwrap()).await };
    tokio::join!(srv, cli)
}

#[tokio::test]
async fn the_same_psk_connects_and_carries_bytes_both_ways() {
    let (s, c) = pair(psk(1), psk(1)).await;
    let (mut s, mut c) = (s.unwrap(), c.unwrap());
    assert!(s.is_tls() && c.is_tls());
    assert_eq!(s.psk_identity(), Some(psk(1).identity.as_str()));
    let big: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    let writer = async {
        let mut off = 0;
        while off < big.len() {
            off += c.write(&big[off..]).await.unwrap();
        }
    };
    let reader = async {
        let mut got = Vec::new();
        let mut buf = vec![0; 65536];
        while got.len() < big.len() {
            let n = s.read(&mut buf).await.unwrap();
            assert!(n > 0);
            got.extend_from_slice(&buf[..n]);
        }
        got
    };
    let ((), got) = tokio::join!(writer, reader);
    assert_eq!(got, big);
}

#[tokio::test]
async fn a_wrong_psk_fails_on_both_sides_with_one_line() {
    let (s, c) = pair(psk(1), psk(2)).await;
    let (s, c) = (s.unwrap_err().to_string(), c.unwrap_err().to_string());
    assert!(c.contains("the peer refused this PSK or identity"), "{c}");
    for m in [s, c] {
        assert!(m.starts_with("TLS handshake failed"), "{m}");
        assert!(!m.contains('\n'), "{m}");
    }
}

#[tokio::test]
async fn an_unknown_identity_is_refused() {
    let mut other = psk(1);
    other.identity = format!("NVMe0R01 {HOST} nqn.other");
    let (s, c) = pair(psk(1), other).await;
    assert!(s.is_err() && c.is_err());
}

#[test]
fn only_sha256_psks_are_supported() {
    assert!(nvmf_tls::check_psk_hash(HashId::Sha256).is_ok());
    let e = nvmf_tls::check_psk_hash(HashId::Sha384).unwrap_err();
    assert!(e.to_string().contains("only SHA-256"), "{e}");
}

#[tokio::test]
async fn the_server_names_the_offered_identity_when_it_fails() {
    let mut other = psk(1);
    other.identity = format!("NVMe0R01 {HOST} nqn.other");
    let (s, _) = pair(psk(1), other).await;
    let m = s.unwrap_err().to_string();
    assert!(m.contains("nqn.other"), "{m}");
    // Version 1 identities carry a digest of the key: another key is another identity.
    let (s, _) = pair(psk(1), psk(2)).await;
    let m = s.unwrap_err().to_string();
    assert!(m.contains("no PSK for the peer's identity"), "{m}");
    let v0 = |byte| {
        ConfiguredPsk::new(Secret::new(vec![byte; 32]), Some(HashId::Sha256))
            .unwrap()
            .tls_psk(0, HOST, SUB)
            .unwrap()
    };
    let (s, _) = pair(v0(1), v0(2)).await;
    let m = s.unwrap_err().to_string();
    assert!(m.contains("the peer holds another PSK"), "{m}");
    assert!(m.contains(&format!("NVMe0R01 {HOST} {SUB}")), "{m}");
}

/// A read that takes less than it asked for drained the socket: the readiness is cleared
/// (no `read` is spent finding nothing), and data that arrives later sets it again.
#[tokio::test]
async fn a_short_plain_read_clears_the_readiness_until_more_arrives() {
    use std::task::{Context, Waker};
    use tokio::io::{AsyncWriteExt, Interest};

    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut peer = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
    let mut s = Stream::Plain(l.accept().await.unwrap().0);
    let mut cx = Context::from_waker(Waker::noop());
    let mut buf = [0u8; 64];
    for word in [b"hello", b"again"] {
        peer.write_all(word).await.unwrap();
        s.ready(Interest::READABLE).await.unwrap();
        assert_eq!(s.try_read(&mut buf).unwrap(), word.len());
        assert_eq!(&buf[..word.len()], word);
        assert!(s.tcp().poll_read_ready(&mut cx).is_pending());
    }
    // A read that fills its buffer leaves the readiness alone: more may wait.
    peer.write_all(&[7; 100]).await.unwrap();
    s.ready(Interest::READABLE).await.unwrap();
    let mut iov = [std::io::IoSliceMut::new(&mut buf)];
    assert_eq!(s.try_read_vectored(&mut iov).unwrap(), 64);
    assert!(s.tcp().poll_read_ready(&mut cx).is_ready());
    assert_eq!(s.try_read(&mut buf).unwrap(), 36);
    assert!(s.tcp().poll_read_ready(&mut cx).is_pending());
}

#[tokio::test]
async fn a_read_now_takes_data_the_runtime_has_not_reported_yet() {
    use std::task::{Context, Waker};
    use tokio::io::AsyncWriteExt;

    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut peer = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
    let mut s = Stream::Plain(l.accept().await.unwrap().0);
    let mut cx = Context::from_waker(Waker::noop());
    let mut buf = [0u8; 64];
    // Nothing yet: "would block", straight from the socket.
    let e = s.read_now(&mut buf).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock);
    // The readiness is cleared by a read that finds nothing...
    while s.tcp().poll_read_ready(&mut cx).is_ready() {
        assert!(s.try_read(&mut buf).is_err());
    }
    // ...and data that arrives then is read at once, before the runtime reports it (on
    // loopback it is in the socket when the peer's write returns).
    peer.write_all(b"hello").await.unwrap();
    assert!(
        s.try_read(&mut buf).is_err(),
        "try_read waits for the runtime"
    );
    assert_eq!(s.read_now(&mut buf).unwrap(), 5);
    assert_eq!(&buf[..5], b"hello");
    peer.write_all(b"again").await.unwrap();
    let mut iov = [std::io::IoSliceMut::new(&mut buf)];
    assert_eq!(s.read_vectored_now(&mut iov).unwrap(), 5);
    assert_eq!(&buf[..5], b"again");
}
