//! RDMA connection management (librdmacm): event channels, identifiers, listening, connection
//! requests with their private data, reject.

use std::ffi::c_int;
use std::io;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::ptr::NonNull;

use tokio::io::unix::AsyncFd;

use crate::loader::{c_string, libs};
use crate::sys::*;
use crate::verbs::{DeviceAttr, ForeignFd, query_device, register_fd, set_nonblocking};
use crate::{Error, os_error};

/// A librdmacm event channel whose descriptor is non-blocking and, once used from a tokio
/// runtime, registered with it.
pub(crate) struct EventChannel {
    ch: NonNull<rdma_event_channel>,
    fd: Option<AsyncFd<ForeignFd>>,
}

// SAFETY: librdmacm is thread safe; the channel is owned by one value and destroyed once. The
// AsyncFd registration is Send itself.
unsafe impl Send for EventChannel {}
// SAFETY: the shared-reference methods (try_next, next) call rdma_get_cm_event and
// rdma_ack_cm_event, which librdmacm serializes internally; AsyncFd is Sync.
unsafe impl Sync for EventChannel {}

/// A CM event copied out of librdmacm (the event itself is acknowledged at once).
pub(crate) struct RawEvent {
    pub kind: c_int,
    pub status: c_int,
    pub id: *mut rdma_cm_id,
    pub private_data: Vec<u8>,
    pub initiator_depth: u8,
    pub responder_resources: u8,
}

impl EventChannel {
    pub fn new() -> Result<Self, Error> {
        let cm = &libs()?.cm;
        // SAFETY: no arguments; returns NULL with errno on failure.
        let ch = unsafe { (cm.create_event_channel)() };
        let ch = NonNull::new(ch).ok_or_else(|| {
            let e = io::Error::last_os_error();
            let hint = match e.raw_os_error() {
                Some(libc::ENOENT) | Some(libc::ENODEV) => {
                    " (no RDMA-CM device: load rdma_ucm and set up an RDMA device, e.g. Soft-RoCE: rdma link add rxe0 type rxe netdev IFACE)"
                }
                _ => "",
            };
            Error::Unavailable(format!("rdma_create_event_channel: {e}{hint}"))
        })?;
        // SAFETY: the channel was just created; its fd is valid.
        let fd = unsafe { (*ch.as_ptr()).fd };
        let chan = EventChannel { ch, fd: None };
        set_nonblocking(fd)?;
        Ok(chan)
    }

    pub fn as_ptr(&self) -> *mut rdma_event_channel {
        self.ch.as_ptr()
    }

    /// Takes the next event if one is queued.
    pub fn try_next(&self) -> Result<Option<RawEvent>, Error> {
        let cm = &libs()?.cm;
        let mut ev: *mut rdma_cm_event = std::ptr::null_mut();
        // SAFETY: valid non-blocking channel and out-pointer.
        let rc = unsafe { (cm.get_cm_event)(self.ch.as_ptr(), &mut ev) };
        if rc != 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::WouldBlock {
                return Ok(None);
            }
            return Err(Error::Os {
                op: "rdma_get_cm_event",
                source: e,
            });
        }
        // SAFETY: `ev` is a valid event until acknowledged below; private data, when present,
        // is `private_data_len` readable bytes owned by the event.
        let raw = unsafe {
            let e = &*ev;
            let pd = if e.conn.private_data.is_null() || e.conn.private_data_len == 0 {
                Vec::new()
            } else {
                std::slice::from_raw_parts(
                    e.conn.private_data.cast::<u8>(),
                    usize::from(e.conn.private_data_len),
                )
                .to_vec()
            };
            RawEvent {
                kind: e.event,
                status: e.status,
                id: e.id,
                private_data: pd,
                initiator_depth: e.conn.initiator_depth,
                responder_resources: e.conn.responder_resources,
            }
        };
        // SAFETY: every event is acknowledged exactly once, after its data was copied.
        unsafe { (cm.ack_cm_event)(ev) };
        Ok(Some(raw))
    }

    /// Registers the descriptor with the current tokio runtime (once).
    pub fn register(&mut self) -> Result<(), Error> {
        if self.fd.is_none() {
            // SAFETY: the channel is valid; its fd stays open until the channel is destroyed.
            let fd = unsafe { (*self.ch.as_ptr()).fd };
            self.fd = Some(register_fd(fd, "register CM event channel")?);
        }
        Ok(())
    }

    /// Waits for the next event ([`EventChannel::register`] first). Costs no system call
    /// while the descriptor is not readable.
    pub async fn next(&self) -> Result<RawEvent, Error> {
        let Some(fd) = &self.fd else {
            return Err(Error::Invalid("event channel not registered".into()));
        };
        loop {
            let mut guard = fd.readable().await.map_err(|source| Error::Os {
                op: "wait for CM event channel",
                source,
            })?;
            match self.try_next()? {
                Some(ev) => return Ok(ev),
                None => guard.clear_ready(),
            }
        }
    }
}

impl Drop for EventChannel {
    fn drop(&mut self) {
        self.fd = None;
        if let Ok(l) = libs() {
            // SAFETY: every identifier on this channel was destroyed or migrated first (owners
            // drop identifiers before their channel); destroyed once.
            unsafe { (l.cm.destroy_event_channel)(self.ch.as_ptr()) };
        }
    }
}

/// An `rdma_cm_id`, destroyed on drop.
pub(crate) struct CmId {
    id: NonNull<rdma_cm_id>,
}

// SAFETY: librdmacm identifiers may be used from any thread; ownership is unique.
unsafe impl Send for CmId {}
// SAFETY: shared-reference methods only read the identifier's fields or call thread-safe
// librdmacm/libibverbs functions on it.
unsafe impl Sync for CmId {}

impl CmId {
    pub fn create(ch: &EventChannel) -> Result<Self, Error> {
        let cm = &libs()?.cm;
        let mut id: *mut rdma_cm_id = std::ptr::null_mut();
        // SAFETY: valid channel and out-pointer; RDMA_PS_TCP gives RC semantics.
        let rc = unsafe { (cm.create_id)(ch.as_ptr(), &mut id, std::ptr::null_mut(), RDMA_PS_TCP) };
        if rc != 0 {
            return Err(os_error("rdma_create_id"));
        }
        NonNull::new(id)
            .map(|id| CmId { id })
            .ok_or_else(|| Error::Invalid("rdma_create_id returned no identifier".into()))
    }

    /// Takes ownership of an identifier librdmacm created for a connection request.
    ///
    /// # Safety
    /// `id` must be a live identifier that nothing else owns.
    pub unsafe fn from_raw(id: *mut rdma_cm_id) -> Option<Self> {
        NonNull::new(id).map(|id| CmId { id })
    }

    pub fn as_ptr(&self) -> *mut rdma_cm_id {
        self.id.as_ptr()
    }

    /// The device context the identifier is bound to (NULL before address resolution).
    pub fn verbs(&self) -> *mut ibv_context {
        // SAFETY: the identifier is valid until Drop.
        unsafe { (*self.id.as_ptr()).verbs }
    }

    pub fn local_addr(&self) -> Option<SocketAddr> {
        // SAFETY: the identifier is valid; its route addresses are plain data.
        sockaddr_to_std(unsafe { &(*self.id.as_ptr()).src })
    }

    pub fn peer_addr(&self) -> Option<SocketAddr> {
        // SAFETY: as above.
        sockaddr_to_std(unsafe { &(*self.id.as_ptr()).dst })
    }

    pub fn device_attr(&self) -> Result<DeviceAttr, Error> {
        let ctx = self.verbs();
        if ctx.is_null() {
            return Err(Error::Invalid("identifier is not bound to a device".into()));
        }
        query_device(ctx)
    }

    pub fn reject(&self, private_data: &[u8]) -> Result<(), Error> {
        let cm = &libs()?.cm;
        let len = u8::try_from(private_data.len())
            .map_err(|_| Error::Invalid("reject private data longer than 255 bytes".into()))?;
        // SAFETY: the identifier has a pending connection request; the data is `len` bytes.
        let rc = unsafe { (cm.reject)(self.id.as_ptr(), private_data.as_ptr().cast(), len) };
        if rc != 0 {
            return Err(os_error("rdma_reject"));
        }
        Ok(())
    }

    pub fn migrate(&self, ch: &EventChannel) -> Result<(), Error> {
        let cm = &libs()?.cm;
        // SAFETY: valid identifier and channel; all events of the identifier were
        // acknowledged (EventChannel::try_next acknowledges each at once).
        let rc = unsafe { (cm.migrate_id)(self.id.as_ptr(), ch.as_ptr()) };
        if rc != 0 {
            return Err(os_error("rdma_migrate_id"));
        }
        Ok(())
    }
}

impl Drop for CmId {
    fn drop(&mut self) {
        if let Ok(l) = libs() {
            // SAFETY: the owner destroyed the identifier's queue pair first; events were all
            // acknowledged; destroyed once.
            unsafe { (l.cm.destroy_id)(self.id.as_ptr()) };
        }
    }
}

fn sockaddr_to_std(s: &sockaddr_storage128) -> Option<SocketAddr> {
    let b = &s.bytes;
    let family = i32::from(u16::from_ne_bytes([b[0], b[1]]));
    let port = u16::from_be_bytes([b[2], b[3]]);
    if family == libc::AF_INET {
        let ip = Ipv4Addr::new(b[4], b[5], b[6], b[7]);
        Some(SocketAddr::V4(SocketAddrV4::new(ip, port)))
    } else if family == libc::AF_INET6 {
        let flowinfo = u32::from_be_bytes([b[4], b[5], b[6], b[7]]);
        let mut ip = [0u8; 16];
        ip.copy_from_slice(&b[8..24]);
        let scope = u32::from_ne_bytes([b[24], b[25], b[26], b[27]]);
        Some(SocketAddr::V6(SocketAddrV6::new(
            Ipv6Addr::from(ip),
            port,
            flowinfo,
            scope,
        )))
    } else {
        None
    }
}

/// Encodes a socket address as a C `sockaddr_storage`.
pub(crate) fn std_to_sockaddr(a: &SocketAddr) -> sockaddr_storage128 {
    let mut s = sockaddr_storage128 { bytes: [0; 128] };
    let b = &mut s.bytes;
    match a {
        SocketAddr::V4(v4) => {
            b[0..2].copy_from_slice(&(libc::AF_INET as u16).to_ne_bytes());
            b[2..4].copy_from_slice(&v4.port().to_be_bytes());
            b[4..8].copy_from_slice(&v4.ip().octets());
        }
        SocketAddr::V6(v6) => {
            b[0..2].copy_from_slice(&(libc::AF_INET6 as u16).to_ne_bytes());
            b[2..4].copy_from_slice(&v6.port().to_be_bytes());
            b[4..8].copy_from_slice(&v6.flowinfo().to_be_bytes());
            b[8..24].copy_from_slice(&v6.ip().octets());
            b[24..28].copy_from_slice(&v6.scope_id().to_ne_bytes());
        }
    }
    s
}

/// The readable name of a CM event type.
pub(crate) fn event_name(kind: c_int) -> String {
    match libs() {
        // SAFETY: rdma_event_str returns a static string for any value.
        Ok(l) => c_string(unsafe { (l.cm.event_str)(kind) }),
        Err(_) => format!("event {kind}"),
    }
}

/// An identifier bound to a local address of an RDMA device, which keeps librdmacm's context
/// of that device open: a protection domain that outlives every connection on the device (one
/// shared by a host's queues across reconnects) holds one.
pub(crate) struct DeviceAnchor {
    // Field order is drop order: the identifier before its channel.
    _id: CmId,
    _channel: EventChannel,
}

impl DeviceAnchor {
    /// Binds a new identifier to `local` (its port replaced by 0) and checks that it names
    /// device context `ctx`.
    pub fn bind(local: SocketAddr, ctx: *mut ibv_context) -> Result<Self, Error> {
        let cm = &libs()?.cm;
        let channel = EventChannel::new()?;
        let id = CmId::create(&channel)?;
        let mut any_port = local;
        any_port.set_port(0);
        let mut sa = std_to_sockaddr(&any_port);
        // SAFETY: valid identifier; `sa` is a sockaddr of the family it names.
        let rc =
            unsafe { (cm.bind_addr)(id.as_ptr(), (&mut sa as *mut sockaddr_storage128).cast()) };
        if rc != 0 {
            return Err(os_error("rdma_bind_addr"));
        }
        if id.verbs() != ctx {
            return Err(Error::Invalid(format!(
                "{local} is bound to another RDMA device than the connection"
            )));
        }
        Ok(DeviceAnchor {
            _id: id,
            _channel: channel,
        })
    }
}

/// A listening RDMA-CM endpoint (RC, port space TCP).
pub struct Listener {
    // Field order is drop order: the identifier before its channel.
    id: CmId,
    channel: EventChannel,
    local: SocketAddr,
}

impl Listener {
    /// Binds to `addr` (an address of an RDMA-capable interface, or a wildcard) and listens.
    /// Port 0 picks a free port; [`Listener::local_addr`] tells which.
    pub fn bind(addr: SocketAddr, backlog: i32) -> Result<Listener, Error> {
        let cm = &libs()?.cm;
        let channel = EventChannel::new()?;
        let id = CmId::create(&channel)?;
        let mut sa = std_to_sockaddr(&addr);
        // SAFETY: valid identifier; `sa` is a sockaddr of the family it names.
        let rc =
            unsafe { (cm.bind_addr)(id.as_ptr(), (&mut sa as *mut sockaddr_storage128).cast()) };
        if rc != 0 {
            let e = io::Error::last_os_error();
            let hint = if e.raw_os_error() == Some(libc::EADDRNOTAVAIL)
                || e.raw_os_error() == Some(libc::ENODEV)
            {
                " (no RDMA device serves this address)"
            } else {
                ""
            };
            return Err(Error::Os {
                op: "rdma_bind_addr",
                source: io::Error::new(e.kind(), format!("{e}{hint}")),
            });
        }
        // SAFETY: bound identifier.
        if unsafe { (cm.listen)(id.as_ptr(), backlog) } != 0 {
            return Err(os_error("rdma_listen"));
        }
        let local = id.local_addr().unwrap_or(addr);
        Ok(Listener { id, channel, local })
    }

    /// The bound address (with the port resolved).
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Waits for the next connection request. Other events of the listener are logged and
    /// skipped. Must run inside a tokio runtime.
    pub async fn next_request(&mut self) -> Result<ConnectRequest, Error> {
        self.channel.register()?;
        loop {
            let ev = self.channel.next().await?;
            if ev.kind == RDMA_CM_EVENT_CONNECT_REQUEST {
                // SAFETY: a connection request event hands the new identifier to the
                // application, which owns it from now on.
                let Some(id) = (unsafe { CmId::from_raw(ev.id) }) else {
                    continue;
                };
                let local = id.local_addr().unwrap_or(self.local);
                let peer = id
                    .peer_addr()
                    .unwrap_or(SocketAddr::from(([0, 0, 0, 0], 0)));
                return Ok(ConnectRequest {
                    id,
                    private_data: ev.private_data,
                    initiator_depth: ev.initiator_depth,
                    responder_resources: ev.responder_resources,
                    local,
                    peer,
                });
            }
            if ev.id == self.id.as_ptr() && ev.kind == RDMA_CM_EVENT_DEVICE_REMOVAL {
                return Err(Error::Cm(format!(
                    "the RDMA device of listener {} was removed",
                    self.local
                )));
            }
            tracing::debug!(
                listener = %self.local,
                event = %event_name(ev.kind),
                status = ev.status,
                "RDMA-CM event on listener"
            );
        }
    }
}

/// A connection request received by a [`Listener`]: accept it with
/// [`crate::CapsuleQueue::accept`] or refuse it with [`ConnectRequest::reject`].
pub struct ConnectRequest {
    pub(crate) id: CmId,
    /// The private data of the request (for RoCE and InfiniBand, 56 bytes of which the NVMe
    /// request uses the first 32).
    pub private_data: Vec<u8>,
    /// RDMA READs the requester lets this side have in flight towards it (its IRD).
    pub initiator_depth: u8,
    /// RDMA READs the requester will have in flight towards this side (its ORD).
    pub responder_resources: u8,
    /// Local address the request arrived on.
    pub local: SocketAddr,
    /// The requester's address.
    pub peer: SocketAddr,
}

impl ConnectRequest {
    /// Attributes of the device the request arrived on.
    pub fn device_attr(&self) -> Result<DeviceAttr, Error> {
        self.id.device_attr()
    }

    /// Refuses the connection with `private_data` (the NVMe reject record).
    pub fn reject(self, private_data: &[u8]) -> Result<(), Error> {
        self.id.reject(private_data)
    }
}

impl std::fmt::Debug for ConnectRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectRequest")
            .field("local", &self.local)
            .field("peer", &self.peer)
            .field("private_data_len", &self.private_data.len())
            .field("initiator_depth", &self.initiator_depth)
            .field("responder_resources", &self.responder_resources)
            .finish()
    }
}

/// Connection events after a queue is set up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CmEvent {
    /// The connection is established.
    Established,
    /// The peer rejected the connection, with its private data.
    Rejected {
        /// Transport reject reason (IB CM: 28 = consumer reject).
        status: i32,
        /// The peer's private data (the NVMe reject record).
        private_data: Vec<u8>,
    },
    /// The connection ended (peer disconnect or local disconnect acknowledged).
    Disconnected,
    /// The connection failed (unreachable, connect error, device removal...).
    Failed(String),
    /// Any other event (time-wait exit, address change).
    Other(String),
}

pub(crate) fn classify(ev: &RawEvent) -> CmEvent {
    match ev.kind {
        RDMA_CM_EVENT_ESTABLISHED => CmEvent::Established,
        RDMA_CM_EVENT_REJECTED => CmEvent::Rejected {
            status: ev.status,
            private_data: ev.private_data.clone(),
        },
        RDMA_CM_EVENT_DISCONNECTED => CmEvent::Disconnected,
        RDMA_CM_EVENT_CONNECT_ERROR
        | RDMA_CM_EVENT_UNREACHABLE
        | RDMA_CM_EVENT_DEVICE_REMOVAL
        | RDMA_CM_EVENT_ADDR_ERROR
        | RDMA_CM_EVENT_ROUTE_ERROR => {
            CmEvent::Failed(format!("{} (status {})", event_name(ev.kind), ev.status))
        }
        RDMA_CM_EVENT_TIMEWAIT_EXIT | RDMA_CM_EVENT_ADDR_CHANGE => {
            CmEvent::Other(event_name(ev.kind))
        }
        k => CmEvent::Other(event_name(k)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sockaddr_round_trip() {
        for a in [
            "10.0.2.15:4420".parse::<SocketAddr>().unwrap(),
            SocketAddr::V6(SocketAddrV6::new("fe80::1".parse().unwrap(), 4420, 7, 3)),
            "0.0.0.0:0".parse().unwrap(),
        ] {
            assert_eq!(sockaddr_to_std(&std_to_sockaddr(&a)), Some(a));
        }
        assert_eq!(
            sockaddr_to_std(&sockaddr_storage128 { bytes: [0; 128] }),
            None
        );
    }
}
