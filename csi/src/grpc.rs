//! gRPC over HTTP/2 on a Unix socket, by hand: unary calls only, no compression, which is
//! all CSI uses. A request is `POST /csi.v1.SERVICE/METHOD` with one length-prefixed
//! protobuf message; the answer is one message and the trailers `grpc-status` and
//! `grpc-message`.

use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use tokio::net::{UnixListener, UnixStream};
use tracing::{debug, warn};

/// Largest request message accepted, in bytes.
pub const MAX_MESSAGE: usize = 4 << 20;

/// gRPC status codes used here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Code {
    /// Success.
    Ok = 0,
    /// A bad argument.
    InvalidArgument = 3,
    /// An object does not exist.
    NotFound = 5,
    /// An object exists, incompatible with the request.
    AlreadyExists = 6,
    /// Out of space.
    ResourceExhausted = 8,
    /// The system is not in a state that allows the operation.
    FailedPrecondition = 9,
    /// The operation was aborted (e.g. a stale pagination token).
    Aborted = 10,
    /// A value outside the supported range.
    OutOfRange = 11,
    /// The method is not implemented.
    Unimplemented = 12,
    /// An internal failure.
    Internal = 13,
    /// A peer (a storage node) could not be reached.
    Unavailable = 14,
}

impl Code {
    /// The code for its number (`Internal` for unknown numbers).
    pub fn from_u32(n: u32) -> Code {
        use Code::*;
        [
            Ok,
            InvalidArgument,
            NotFound,
            AlreadyExists,
            ResourceExhausted,
            FailedPrecondition,
            Aborted,
            OutOfRange,
            Unimplemented,
            Internal,
            Unavailable,
        ]
        .into_iter()
        .find(|c| *c as u32 == n)
        .unwrap_or(Internal)
    }
}

/// A failed call: a code and a one-line message.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{code:?}: {message}")]
pub struct Status {
    /// The code.
    pub code: Code,
    /// Why.
    pub message: String,
}

impl Status {
    /// A status of `code` with `message`.
    pub fn new(code: Code, message: impl Into<String>) -> Status {
        Status {
            code,
            message: message.into(),
        }
    }
}

/// Shorthand: `Err(Status)` of `code`.
pub fn fail<T>(code: Code, message: impl Into<String>) -> Result<T, Status> {
    Err(Status::new(code, message))
}

/// A boxed future answering one call with an encoded message.
pub type Reply = Pin<Box<dyn Future<Output = Result<Vec<u8>, Status>> + Send>>;

/// What serves calls: given the path (`/csi.v1.Identity/Probe`) and the request message,
/// the answer.
pub trait Service: Send + Sync + 'static {
    /// Answers one call.
    fn call(self: Arc<Self>, path: &str, message: Bytes) -> Reply;
}

/// Decodes `message` as `T` (INVALID_ARGUMENT when malformed).
pub fn decode<T: prost::Message + Default>(message: Bytes) -> Result<T, Status> {
    T::decode(message)
        .map_err(|e| Status::new(Code::InvalidArgument, format!("malformed message: {e}")))
}

/// Binds `path` (a stale socket file is replaced) and serves `service` on it forever.
pub async fn serve(path: &Path, service: Arc<dyn Service>) -> std::io::Result<()> {
    if path.exists() {
        std::fs::remove_file(path)?;
    }
    let listener = UnixListener::bind(path)?;
    loop {
        let (stream, _) = listener.accept().await?;
        let service = Arc::clone(&service);
        tokio::spawn(async move {
            if let Err(e) = connection(stream, service).await {
                debug!(error = %e, "gRPC connection ended");
            }
        });
    }
}

async fn connection(stream: UnixStream, service: Arc<dyn Service>) -> Result<(), h2::Error> {
    let mut conn = h2::server::handshake(stream).await?;
    while let Some(next) = conn.accept().await {
        let (request, respond) = next?;
        let service = Arc::clone(&service);
        tokio::spawn(async move {
            if let Err(e) = exchange(request, respond, service).await {
                warn!(error = %e, "gRPC call failed");
            }
        });
    }
    Ok(())
}

async fn read_body(mut body: h2::RecvStream) -> Result<BytesMut, Status> {
    let mut buf = BytesMut::new();
    while let Some(chunk) = body.data().await {
        let chunk = chunk.map_err(|e| Status::new(Code::Internal, e.to_string()))?;
        let _ = body.flow_control().release_capacity(chunk.len());
        buf.extend_from_slice(&chunk);
        if buf.len() > MAX_MESSAGE + 5 {
            return fail(Code::OutOfRange, "message too large");
        }
    }
    Ok(buf)
}

/// The one message of a gRPC body (5-byte prefix: compressed flag, big-endian length).
fn unframe(mut buf: BytesMut) -> Result<Bytes, Status> {
    if buf.is_empty() {
        return Ok(Bytes::new());
    }
    if buf.len() < 5 {
        return fail(Code::InvalidArgument, "truncated gRPC message");
    }
    let compressed = buf.get_u8();
    let len = buf.get_u32() as usize;
    if compressed != 0 {
        return fail(Code::Unimplemented, "compressed messages are not supported");
    }
    if len != buf.len() {
        return fail(Code::InvalidArgument, "gRPC message length mismatch");
    }
    Ok(buf.freeze())
}

fn frame(message: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(message.len() + 5);
    out.put_u8(0);
    out.put_u32(message.len() as u32);
    out.extend_from_slice(message);
    out.freeze()
}

/// `grpc-message` is percent-encoded outside printable ASCII.
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if (0x20..0x7f).contains(&b) && b != b'%' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

async fn exchange(
    request: http::Request<h2::RecvStream>,
    mut respond: h2::server::SendResponse<Bytes>,
    service: Arc<dyn Service>,
) -> Result<(), h2::Error> {
    let path = request.uri().path().to_string();
    let result = match read_body(request.into_body()).await.and_then(unframe) {
        Ok(message) => service.call(&path, message).await,
        Err(e) => Err(e),
    };
    let head = http::Response::builder()
        .status(200)
        .header("content-type", "application/grpc")
        .body(())
        .expect("static response head");
    let mut send = respond.send_response(head, false)?;
    let mut trailers = http::HeaderMap::new();
    match result {
        Ok(message) => {
            send.send_data(frame(&message), false)?;
            trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
        }
        Err(status) => {
            debug!(%path, code = ?status.code, message = %status.message, "call refused");
            trailers.insert("grpc-status", (status.code as u32).into());
            if let Ok(v) = http::HeaderValue::from_str(&percent_encode(&status.message)) {
                trailers.insert("grpc-message", v);
            }
        }
    }
    send.send_trailers(trailers)
}

/// A gRPC client on a Unix socket (for tests and the `call` command).
pub struct Client {
    send: h2::client::SendRequest<Bytes>,
}

impl Client {
    /// Connects to the socket at `path`.
    pub async fn connect(path: &Path) -> Result<Client, Status> {
        let unavailable = |e: &dyn std::fmt::Display| {
            Status::new(Code::Unavailable, format!("{}: {e}", path.display()))
        };
        let stream = UnixStream::connect(path)
            .await
            .map_err(|e| unavailable(&e))?;
        let (send, conn) = h2::client::handshake(stream)
            .await
            .map_err(|e| unavailable(&e))?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(Client { send })
    }

    /// Calls `path` with `req` and decodes the answer as `R`.
    pub async fn call<Q: prost::Message, R: prost::Message + Default>(
        &mut self,
        path: &str,
        req: &Q,
    ) -> Result<R, Status> {
        let internal = |e: &dyn std::fmt::Display| Status::new(Code::Internal, e.to_string());
        let mut send = self.send.clone().ready().await.map_err(|e| internal(&e))?;
        let head = http::Request::builder()
            .method("POST")
            .uri(format!("http://localhost{path}"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(())
            .map_err(|e| internal(&e))?;
        let (response, mut body) = send.send_request(head, false).map_err(|e| internal(&e))?;
        body.send_data(frame(&req.encode_to_vec()), true)
            .map_err(|e| internal(&e))?;
        let response = response.await.map_err(|e| internal(&e))?;
        let mut recv = response.into_body();
        let mut buf = BytesMut::new();
        while let Some(chunk) = recv.data().await {
            let chunk = chunk.map_err(|e| internal(&e))?;
            let _ = recv.flow_control().release_capacity(chunk.len());
            buf.extend_from_slice(&chunk);
        }
        let trailers = recv
            .trailers()
            .await
            .map_err(|e| internal(&e))?
            .unwrap_or_default();
        let code = trailers
            .get("grpc-status")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
            .unwrap_or(Code::Internal as u32);
        if code != 0 {
            let message = trailers
                .get("grpc-message")
                .and_then(|v| v.to_str().ok())
                .map(percent_decode)
                .unwrap_or_default();
            return Err(Status::new(Code::from_u32(code), message));
        }
        R::decode(unframe(buf)?).map_err(|e| internal(&e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_through_percent_encoding() {
        let s = "volume \"a\" 100% full\nnext";
        assert_eq!(percent_decode(&percent_encode(s)), s);
        assert_eq!(percent_encode("plain"), "plain");
    }

    #[test]
    fn frames_round_trip_and_bad_frames_are_refused() {
        let f = frame(b"abc");
        assert_eq!(
            unframe(BytesMut::from(&f[..])).unwrap(),
            Bytes::from_static(b"abc")
        );
        assert_eq!(
            unframe(BytesMut::from(&b"\0\0\0"[..])).unwrap_err().code,
            Code::InvalidArgument
        );
        assert_eq!(
            unframe(BytesMut::from(&b"\0\0\0\0\x09ab"[..]))
                .unwrap_err()
                .code,
            Code::InvalidArgument
        );
        assert_eq!(
            unframe(BytesMut::from(&b"\x01\0\0\0\0"[..]))
                .unwrap_err()
                .code,
            Code::Unimplemented
        );
    }
}
