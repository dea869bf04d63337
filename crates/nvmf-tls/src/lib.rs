//! TLS 1.3 with an external pre-shared key for NVMe/TCP connections (NVMe/TCP Transport 1.0
//! section 3.6): the handshake right after the TCP connection is set up and before the ICReq,
//! then a byte stream with the same non-blocking `ready`/`try_read`/`try_write` contract as
//! tokio's `TcpStream`, so that a transport loop serves plain and TLS connections alike.
//!
//! The TLS library is OpenSSL 3 (through the `openssl` crate): rustls has no external PSK
//! support, and OpenSSL's PSK callbacks give TLS 1.3 PSK handshakes (psk_ke and psk_dhe_ke)
//! with the TLS_AES_128_GCM_SHA256 cipher suite that GnuTLS (the Linux kernel's `tlshd`)
//! negotiates for a SHA-256 PSK. OpenSSL's callbacks bind every PSK to a SHA-256 suite, so
//! only PSKs of hash 01 (SHA-256) are offered or accepted; see [`check_psk_hash`].
//!
//! Keys come in as [`nvme_auth::Secret`]s and go straight to OpenSSL; identities are the
//! strings [`nvme_auth::tls`] derives.
//!
//! The same stream also carries the target's remote control API, over mutual TLS with X.509
//! certificates ([`ServerContext::mutual`], [`ClientContext::mutual`]).
//!
//! What this crate must not do: log or print key material, know anything about NVMe/TCP
//! PDUs or commands, or cost a plain connection anything: [`Stream::Plain`] calls the socket
//! directly.
#![forbid(unsafe_code)]

use std::io::{self, Read, Write};
use std::sync::OnceLock;

use nvme_auth::tls::TlsPsk;
use nvme_auth::{HashId, Secret};
use openssl::error::ErrorStack;
use openssl::ex_data::Index;
use openssl::nid::Nid;
use openssl::pkey::PKey;
use openssl::ssl::{
    ErrorCode, Ssl, SslContext, SslContextBuilder, SslMethod, SslMode, SslStream, SslVerifyMode,
    SslVersion,
};
use openssl::x509::X509;
use tokio::io::{Interest, Ready};
use tokio::net::TcpStream;

/// The one cipher suite offered: the SHA-256 suite every NVMe/TCP TLS implementation has.
const CIPHER_SUITE: &str = "TLS_AES_128_GCM_SHA256";

/// Why a TLS context could not be built or a handshake failed; each is one line.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// OpenSSL refused the context settings.
    #[error("TLS setup failed: {0}")]
    Setup(#[from] ErrorStack),
    /// The handshake failed (wrong or unknown PSK, a peer that does not speak TLS, ...).
    #[error("TLS handshake failed: {0}")]
    Handshake(String),
    /// A certificate or key could not be used.
    #[error("TLS certificate: {0}")]
    Certificate(String),
    /// The PSK cannot be used with the cipher suites this side offers.
    #[error("TLS PSK of hash {0:?} is not supported (only SHA-256, hash 01, PSKs are)")]
    UnsupportedHash(HashId),
}

/// Checks that a PSK of cipher hash `hash` can be used here (SHA-256 only).
pub fn check_psk_hash(hash: HashId) -> Result<(), TlsError> {
    match hash {
        HashId::Sha256 => Ok(()),
        h => Err(TlsError::UnsupportedHash(h)),
    }
}

/// The identity the peer's PSK was chosen for, kept on the connection.
fn identity_index() -> Result<Index<Ssl, String>, ErrorStack> {
    static INDEX: OnceLock<Index<Ssl, String>> = OnceLock::new();
    if let Some(i) = INDEX.get() {
        return Ok(*i);
    }
    let i = Ssl::new_ex_index()?;
    Ok(*INDEX.get_or_init(|| i))
}

fn builder() -> Result<SslContextBuilder, ErrorStack> {
    let mut b = SslContextBuilder::new(SslMethod::tls())?;
    b.set_min_proto_version(Some(SslVersion::TLS1_3))?;
    b.set_max_proto_version(Some(SslVersion::TLS1_3))?;
    b.set_ciphersuites(CIPHER_SUITE)?;
    // Retry writes with a buffer that may have moved or grown; report partial writes.
    b.set_mode(SslMode::ACCEPT_MOVING_WRITE_BUFFER | SslMode::ENABLE_PARTIAL_WRITE);
    b.set_num_tickets(0)?;
    Ok(b)
}

/// The target's TLS context: a handshake succeeds only with a PSK identity that `lookup`
/// knows, and the key it returns.
pub struct ServerContext(SslContext);

impl ServerContext {
    /// Builds the context; `lookup` maps a PSK identity to its TLS PSK (`None`: unknown,
    /// the handshake fails).
    pub fn new(
        lookup: impl Fn(&str) -> Option<Secret> + Send + Sync + 'static,
    ) -> Result<Self, TlsError> {
        let index = identity_index()?;
        let mut b = builder()?;
        b.set_psk_server_callback(move |ssl, identity, out| {
            let Some(identity) = identity.and_then(|i| std::str::from_utf8(i).ok()) else {
                return Ok(0);
            };
            // Kept for the error message too: an identity names NQNs, never key material.
            ssl.set_ex_data(index, identity.to_string());
            let Some(key) = lookup(identity) else {
                return Ok(0);
            };
            let Some(dst) = out.get_mut(..key.len()) else {
                return Ok(0);
            };
            dst.copy_from_slice(key.expose());
            Ok(key.len())
        });
        Ok(Self(b.build()))
    }
}

/// The host's TLS context for one controller: the identity and TLS PSK it offers.
pub struct ClientContext(SslContext);

impl ClientContext {
    /// Builds the context that offers `psk` (its identity and key).
    pub fn new(psk: TlsPsk) -> Result<Self, TlsError> {
        let mut b = builder()?;
        b.set_psk_client_callback(move |_, _hint, identity, out| {
            let id = psk.identity.as_bytes();
            let (Some(id_dst), Some(key_dst)) =
                (identity.get_mut(..=id.len()), out.get_mut(..psk.key.len()))
            else {
                return Ok(0);
            };
            id_dst[..id.len()].copy_from_slice(id);
            id_dst[id.len()] = 0;
            key_dst.copy_from_slice(psk.key.expose());
            Ok(psk.key.len())
        });
        Ok(Self(b.build()))
    }
}

/// The PEM files of one side of a mutual TLS connection with X.509 certificates (the
/// target's remote control API, not NVMe/TCP): its certificate (chain) and key, and the CA
/// certificates its peer's certificate must be signed by.
pub struct CertFiles<'a> {
    /// The certificate, then any intermediate certificates.
    pub cert: &'a [u8],
    /// Its private key.
    pub key: &'a [u8],
    /// The CA certificates the peer must present a certificate of.
    pub ca: &'a [u8],
}

fn cert_builder(
    own: Option<(&[u8], &[u8])>,
    ca: &[u8],
    verify: SslVerifyMode,
) -> Result<SslContextBuilder, TlsError> {
    let mut b = builder()?;
    if let Some((cert, key)) = own {
        let mut chain = X509::stack_from_pem(cert)?.into_iter();
        let Some(first) = chain.next() else {
            return Err(TlsError::Certificate(
                "no certificate in the PEM data".into(),
            ));
        };
        b.set_certificate(&first)?;
        for c in chain {
            b.add_extra_chain_cert(c)?;
        }
        let key = PKey::private_key_from_pem(key)?;
        b.set_private_key(&key)?;
        b.check_private_key()
            .map_err(|_| TlsError::Certificate("the key does not match the certificate".into()))?;
    }
    let cas = X509::stack_from_pem(ca)?;
    if cas.is_empty() {
        return Err(TlsError::Certificate(
            "no CA certificate in the PEM data".into(),
        ));
    }
    for c in cas {
        b.cert_store_mut().add_cert(c)?;
    }
    b.set_verify(verify);
    Ok(b)
}

impl ServerContext {
    /// A context for mutual TLS with certificates: it presents `files.cert`, and a handshake
    /// succeeds only with a client certificate signed by a CA of `files.ca`.
    pub fn mutual(files: &CertFiles<'_>) -> Result<Self, TlsError> {
        let b = cert_builder(
            Some((files.cert, files.key)),
            files.ca,
            SslVerifyMode::PEER | SslVerifyMode::FAIL_IF_NO_PEER_CERT,
        )?;
        Ok(Self(b.build()))
    }
}

impl ClientContext {
    /// A context for mutual TLS with certificates: it presents `cert` and `key` when given,
    /// and accepts only a server certificate signed by a CA of `ca`, for the name or
    /// address connected to ([`Stream::connect_to`]).
    pub fn mutual(own: Option<(&[u8], &[u8])>, ca: &[u8]) -> Result<Self, TlsError> {
        Ok(Self(cert_builder(own, ca, SslVerifyMode::PEER)?.build()))
    }
}

/// An NVMe/TCP byte stream: the socket itself, or TLS over it.
#[derive(Debug)]
pub enum Stream {
    /// Plain TCP.
    Plain(TcpStream),
    /// TLS 1.3 over TCP, handshake done.
    Tls(Box<SslStream<TcpSock>>),
}

/// Runs `read` (a non-blocking read of up to `want` bytes) on `s`; when it returns fewer
/// bytes than `want` (but some), clears the socket's read readiness, which tokio does only
/// for a read that would block. A read that drained the socket is short; data arriving after
/// it is a new readiness event of the reactor, which the clear does not undo.
fn read_draining(
    s: &TcpStream,
    want: usize,
    read: impl FnOnce(&TcpStream) -> io::Result<usize>,
) -> io::Result<usize> {
    let mut short = None;
    let r = s.try_io(Interest::READABLE, || match read(s)? {
        n if n > 0 && n < want => {
            short = Some(n);
            // "Would block" is what makes tokio clear the readiness it read `s` with.
            Err(io::ErrorKind::WouldBlock.into())
        }
        n => Ok(n),
    });
    short.map_or(r, Ok)
}

/// The socket under OpenSSL in a [`Stream::Tls`]: non-blocking reads and writes on the
/// tokio socket, so that "would block" comes back as OpenSSL's WANT_READ/WANT_WRITE and
/// clears tokio's readiness.
#[derive(Debug)]
pub struct TcpSock(TcpStream);

impl Read for TcpSock {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.try_read(buf)
    }
}

impl Write for TcpSock {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.try_write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Runs a handshake step until it completes, waiting for the readiness OpenSSL asks for.
async fn handshake(
    mut s: SslStream<TcpSock>,
    step: fn(&mut SslStream<TcpSock>) -> Result<(), openssl::ssl::Error>,
) -> Result<Stream, TlsError> {
    loop {
        let interest = match step(&mut s) {
            Ok(()) => return Ok(Stream::Tls(Box::new(s))),
            Err(e) if e.code() == ErrorCode::WANT_READ => Interest::READABLE,
            Err(e) if e.code() == ErrorCode::WANT_WRITE => Interest::WRITABLE,
            Err(e) => {
                let mut why = describe(&e);
                let offered = identity_index().ok().and_then(|i| s.ssl().ex_data(i));
                if let Some(identity) = offered {
                    why = format!("{why} (PSK identity {identity:?})");
                }
                return Err(TlsError::Handshake(why));
            }
        };
        s.get_ref()
            .0
            .ready(interest)
            .await
            .map_err(|e| TlsError::Handshake(e.to_string()))?;
    }
}

/// One line for a failed handshake step: OpenSSL's reason, with what it usually means here.
fn describe(e: &openssl::ssl::Error) -> String {
    if let Some(stack) = e.ssl_error() {
        if let Some(first) = stack.errors().first() {
            let reason = first.reason().unwrap_or("unknown OpenSSL error");
            let meaning = match reason {
                "binder does not verify" => ", the peer holds another PSK for this identity",
                "wrong version number" | "record layer failure" => ", the peer does not speak TLS",
                "no suitable signature algorithm" | "no shared cipher" => {
                    ", no PSK for the peer's identity"
                }
                r if r.contains(" alert ") => ", the peer refused this PSK or identity",
                _ => "",
            };
            return format!("{reason}{meaning}");
        }
    }
    match e.io_error() {
        Some(io) => io.to_string(),
        None if e.code() == ErrorCode::SYSCALL || e.code() == ErrorCode::ZERO_RETURN => {
            "the peer closed the connection".to_string()
        }
        None => e.to_string(),
    }
}

impl Stream {
    /// The server side of the handshake on an accepted connection.
    pub async fn accept(ctx: &ServerContext, tcp: TcpStream) -> Result<Self, TlsError> {
        let s = SslStream::new(Ssl::new(&ctx.0)?, TcpSock(tcp))?;
        handshake(s, SslStream::accept).await
    }

    /// The client side of the handshake on a connected socket.
    pub async fn connect(ctx: &ClientContext, tcp: TcpStream) -> Result<Self, TlsError> {
        let s = SslStream::new(Ssl::new(&ctx.0)?, TcpSock(tcp))?;
        handshake(s, SslStream::connect).await
    }

    /// The socket.
    pub fn tcp(&self) -> &TcpStream {
        match self {
            Stream::Plain(s) => s,
            Stream::Tls(s) => &s.get_ref().0,
        }
    }

    /// The client side of a certificate handshake ([`ClientContext::mutual`]) with a server
    /// whose certificate must name `host` (a DNS name, or an IP address).
    pub async fn connect_to(
        ctx: &ClientContext,
        tcp: TcpStream,
        host: &str,
    ) -> Result<Self, TlsError> {
        let mut ssl = Ssl::new(&ctx.0)?;
        match host.trim_matches(['[', ']']).parse::<std::net::IpAddr>() {
            Ok(ip) => ssl.param_mut().set_ip(ip)?,
            Err(_) => {
                ssl.param_mut().set_host(host)?;
                ssl.set_hostname(host)?;
            }
        }
        let s = SslStream::new(ssl, TcpSock(tcp))?;
        handshake(s, SslStream::connect).await
    }

    /// The common name (CN) of the peer's verified certificate, on a certificate connection.
    pub fn peer_common_name(&self) -> Option<String> {
        let Stream::Tls(s) = self else { return None };
        let cert = s.ssl().peer_certificate()?;
        let cn = cert.subject_name().entries_by_nid(Nid::COMMONNAME).next()?;
        std::str::from_utf8(cn.data().as_slice())
            .ok()
            .map(str::to_string)
    }

    /// Whether the connection is TLS.
    pub fn is_tls(&self) -> bool {
        matches!(self, Stream::Tls(_))
    }

    /// On the server side of a TLS connection, the PSK identity the peer authenticated with.
    pub fn psk_identity(&self) -> Option<&str> {
        let Stream::Tls(s) = self else { return None };
        let index = identity_index().ok()?;
        s.ssl().ex_data(index).map(String::as_str)
    }

    /// Waits for the socket's readiness, as [`TcpStream::ready`].
    pub async fn ready(&self, interest: Interest) -> io::Result<Ready> {
        self.tcp().ready(interest).await
    }

    /// Reads without blocking, as [`TcpStream::try_read`]: `Ok(0)` at the end of the stream,
    /// `WouldBlock` when nothing can be read now. On plain TCP a read that fills less than
    /// `buf` took everything the socket had, so it clears the socket's readiness as a read
    /// that would block does (and as tokio's own `poll_read` does): the next look for data
    /// waits for the reactor to see more instead of spending a `read` that finds nothing.
    pub fn try_read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => {
                let want = buf.len();
                read_draining(s, want, |s| s.try_read(buf))
            }
            Stream::Tls(s) => s.read(buf),
        }
    }

    /// Reads without blocking and without asking the runtime first: on plain TCP a `recv`
    /// straight on the socket, whether or not the runtime has seen it readable yet, for a
    /// caller that polls its socket itself; the runtime's readiness is left as it was (a later
    /// [`try_read`](Self::try_read) may find nothing). TLS: as `try_read`.
    pub fn read_now(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => (&*socket2::SockRef::from(&*s)).read(buf),
            Stream::Tls(_) => self.try_read(buf),
        }
    }

    /// [`read_now`](Self::read_now) into several buffers.
    pub fn read_vectored_now(&mut self, bufs: &mut [io::IoSliceMut<'_>]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => (&*socket2::SockRef::from(&*s)).read_vectored(bufs),
            Stream::Tls(_) => self.try_read_vectored(bufs),
        }
    }

    /// Reads into several buffers without blocking (TLS: into the first non-empty one); a
    /// short read clears the readiness of plain TCP as in [`try_read`](Self::try_read).
    pub fn try_read_vectored(&mut self, bufs: &mut [io::IoSliceMut<'_>]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => {
                let want = bufs.iter().map(|b| b.len()).sum();
                read_draining(s, want, |s| s.try_read_vectored(bufs))
            }
            Stream::Tls(s) => match bufs.iter_mut().find(|b| !b.is_empty()) {
                Some(b) => s.read(b),
                None => Ok(0),
            },
        }
    }

    /// Writes without blocking, as [`TcpStream::try_write`].
    pub fn try_write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => s.try_write(buf),
            Stream::Tls(s) => s.write(buf),
        }
    }

    /// Writes as much of `buf` as the socket takes without blocking and returns how much
    /// that was (0 when it takes nothing now). A socket that accepts no bytes is an error.
    pub fn try_write_some(&mut self, buf: &[u8]) -> io::Result<usize> {
        let mut done = 0;
        while done < buf.len() {
            match self.try_write(&buf[done..]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(e),
            }
        }
        Ok(done)
    }

    /// Writes as much of `bufs`, in order, as the socket takes without blocking and returns
    /// how much that was (0 when it takes nothing now): one vectored write on plain TCP;
    /// over TLS, buffer after buffer until one is not taken whole. A socket that accepts no
    /// bytes is an error.
    pub fn try_write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => match s.try_write_vectored(bufs) {
                Ok(0) if bufs.iter().any(|b| !b.is_empty()) => Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => Ok(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(0),
                Err(e) => Err(e),
            },
            Stream::Tls(_) => {
                let mut done = 0;
                for b in bufs {
                    let n = self.try_write_some(b)?;
                    done += n;
                    if n < b.len() {
                        break;
                    }
                }
                Ok(done)
            }
        }
    }

    /// Reads, waiting until something arrives.
    pub async fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            match self.try_read(buf) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.ready(Interest::READABLE).await?;
                }
                r => return r,
            }
        }
    }

    /// Writes, waiting until the socket takes something.
    pub async fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        loop {
            match self.try_write(buf) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.ready(Interest::WRITABLE).await?;
                }
                r => return r,
            }
        }
    }
}
