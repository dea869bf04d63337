//! A reliable-connected queue pair that exchanges NVMe capsules: fixed-size receive slots
//! (command capsules on a target, completions on a host), small SEND messages from registered
//! slots, and RDMA READ / RDMA WRITE of caller buffers that the queue owns while the device
//! uses them.
//!
//! Safety comes from ownership: memory the device may access is owned by the queue (receive
//! and message slots, and caller buffers from the moment they are posted until their
//! completion is returned), so safe code can never read a buffer the device is writing. The
//! queue pair is destroyed before any of that memory is released.
//!
//! A received command is a [`RecvSlot`] token: [`CapsuleQueue::respond`] consumes it, posts
//! its receive buffer again and sends the completion, so a target answers each command once
//! and never holds more commands than it has receive buffers.

use std::collections::VecDeque;
use std::ffi::c_int;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::cm::{CmEvent, CmId, ConnectRequest, EventChannel, classify, std_to_sockaddr};
use crate::credits::{RecvRing, RecvState, SendCredits, SlotPool};
use crate::loader::libs;
use crate::sys::*;
use crate::verbs::{
    Access, CompletionQueue, ProtectionDomain, Registered, RemoteKey, StableBuffer, wc_status_str,
};
use crate::{Error, os_error};

/// Largest transfer one keyed SGL data block describes (24-bit length).
pub const MAX_KEYED_LEN: usize = (1 << 24) - 1;

const KIND_SHIFT: u32 = 56;
const KIND_RECV: u64 = 1;
const KIND_SEND: u64 = 2;
const KIND_READ: u64 = 3;
const KIND_WRITE: u64 = 4;

/// Completions polled per call into the provider.
const POLL_BATCH: usize = 32;

static NEXT_QUEUE_ID: AtomicU64 = AtomicU64::new(1);

/// Sizes of a queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueConfig {
    /// Receive slots kept posted (a target: HSQSIZE + 1; a host: its HRQSIZE).
    pub recv_slots: u32,
    /// Bytes per receive slot (a target: 64 + in-capsule data; a host: 16).
    pub recv_size: usize,
    /// Message slots for SENDs (completions or command capsules in flight).
    pub send_slots: u32,
    /// Bytes per message slot.
    pub send_size: usize,
    /// Send queue entries (an RDMA WRITE + SEND pair takes two, an RDMA READ one).
    pub send_depth: u32,
    /// RDMA READs this side may have in flight (ORD), as negotiated.
    pub initiator_depth: u8,
    /// RDMA READs the peer may have in flight towards this side (IRD).
    pub responder_resources: u8,
}

impl QueueConfig {
    /// The sizes of a target queue with `depth` commands (HSQSIZE + 1) and `in_capsule`
    /// bytes of in-capsule data: two completion slots per command (a slot is busy until its
    /// SEND completes, while the command's receive buffer is already posted again) and three
    /// send queue entries per command (an RDMA READ, then an RDMA WRITE + SEND pair).
    pub fn target(depth: u16, in_capsule: usize, ord: u8) -> Self {
        let depth = u32::from(depth);
        QueueConfig {
            recv_slots: depth,
            recv_size: 64 + in_capsule,
            send_slots: depth * 2,
            send_size: 16,
            send_depth: depth * 3 + 1,
            initiator_depth: ord,
            responder_resources: 0,
        }
    }

    /// The sizes of a host queue with `depth` entries (HSQSIZE + 1) whose command capsules
    /// carry up to `in_capsule` bytes of data: `depth` receive slots for completions (the
    /// HRQSIZE), and room for two rounds of command SENDs (a capsule's slot is busy until its
    /// SEND completes, which may come after the command's completion). The target may RDMA
    /// READ from this side: `responder_resources` is its read depth.
    pub fn host(depth: u16, in_capsule: usize, responder_resources: u8) -> Self {
        let depth = u32::from(depth);
        QueueConfig {
            recv_slots: depth,
            recv_size: 16,
            send_slots: depth * 2,
            send_size: 64 + in_capsule,
            send_depth: depth * 2,
            initiator_depth: 0,
            responder_resources,
        }
    }

    /// Completion queue entries needed: one per posted work request.
    fn cq_entries(&self) -> u32 {
        self.recv_slots + self.send_depth
    }

    fn validate(&self) -> Result<(), Error> {
        if self.recv_slots == 0 || self.send_slots == 0 || self.send_depth < 2 {
            return Err(Error::Invalid("queue sizes must not be zero".into()));
        }
        if self.recv_size == 0 || self.send_size == 0 {
            return Err(Error::Invalid("slot sizes must not be zero".into()));
        }
        if self.recv_size > u32::MAX as usize || self.send_size > u32::MAX as usize {
            return Err(Error::Invalid("slot size too large".into()));
        }
        Ok(())
    }

    /// Fits the sizes to what the device supports.
    fn fit(mut self, max_qp_wr: u32) -> Self {
        if max_qp_wr > 0 {
            self.recv_slots = self.recv_slots.min(max_qp_wr);
            self.send_depth = self.send_depth.min(max_qp_wr);
        }
        self
    }
}

/// A received message: the command capsule (or completion) in receive slot `index`, held by
/// its owner until answered. Not copyable: answering consumes it.
#[must_use = "a received command must be answered (CapsuleQueue::respond) or its slot is lost"]
#[derive(Debug)]
pub struct RecvSlot {
    queue: u64,
    index: u32,
    len: u32,
}

impl RecvSlot {
    /// Bytes received.
    pub fn len(&self) -> usize {
        self.len as usize
    }

    /// Whether nothing was received (a zero-length SEND).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Data to RDMA WRITE to the peer before a SEND (read data before its completion).
pub struct DataOut<B> {
    /// The local data (`len` bytes from its start are written).
    pub buf: Registered<B>,
    /// Bytes to write.
    pub len: usize,
    /// Where they go.
    pub remote: RemoteKey,
}

/// Something that finished.
pub enum Event<B> {
    /// A message arrived in a receive slot.
    Received(RecvSlot),
    /// A SEND (and the RDMA WRITE before it) finished; the written buffer comes back.
    Sent {
        /// The caller's token.
        token: u64,
        /// The buffer of the RDMA WRITE, if there was one.
        data: Option<Registered<B>>,
        /// Whether it succeeded.
        ok: bool,
    },
    /// An RDMA READ finished; the buffer holds the data if `ok`.
    ReadDone {
        /// The caller's token.
        token: u64,
        /// The destination buffer.
        buf: Registered<B>,
        /// Whether it succeeded.
        ok: bool,
    },
}

enum Op<B> {
    Send {
        msg_slot: u32,
        data: Option<Registered<B>>,
        wrs: u32,
        token: u64,
    },
    Read {
        buf: Registered<B>,
        token: u64,
    },
}

enum Pending<B> {
    Send {
        msg: Vec<u8>,
        data: Option<DataOut<B>>,
        invalidate: Option<u32>,
        token: u64,
    },
    Read {
        buf: Registered<B>,
        len: usize,
        remote: RemoteKey,
        token: u64,
    },
}

/// Slot memory the device reads and writes while the queue runs: a raw allocation (never
/// borrowed as a whole), accessed one slot range at a time, only while that slot is not posted.
pub(crate) struct DmaMem {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

impl DmaMem {
    const ALIGN: usize = 4096;

    fn new(len: usize) -> Result<Self, Error> {
        let layout = std::alloc::Layout::from_size_align(len.max(1), Self::ALIGN)
            .map_err(|_| Error::Invalid("slot memory too large".into()))?;
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        let Some(ptr) = std::ptr::NonNull::new(p) else {
            std::alloc::handle_alloc_error(layout);
        };
        Ok(DmaMem { ptr, len })
    }

    /// Bytes `off..off + len`; None when out of range.
    fn range(&self, off: usize, len: usize) -> Option<&[u8]> {
        let end = off.checked_add(len)?;
        if end > self.len {
            return None;
        }
        // SAFETY: in bounds of the allocation; callers only read ranges of slots the device
        // does not access (held receive slots), and the reference covers only that range.
        Some(unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(off), len) })
    }

    /// Copies `data` to `off`; false when out of range.
    fn write(&mut self, off: usize, data: &[u8]) -> bool {
        match off.checked_add(data.len()) {
            Some(end) if end <= self.len => {
                // SAFETY: in bounds; callers only write message slots taken from the pool,
                // which no posted work request refers to.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        data.as_ptr(),
                        self.ptr.as_ptr().add(off),
                        data.len(),
                    )
                };
                true
            }
            _ => false,
        }
    }
}

// SAFETY: the memory is a plain heap allocation owned by this value.
unsafe impl Send for DmaMem {}

// SAFETY: the allocation never moves or changes size and is owned until Drop.
unsafe impl StableBuffer for DmaMem {
    fn region(&mut self) -> (*mut u8, usize) {
        (self.ptr.as_ptr(), self.len)
    }
}

impl Drop for DmaMem {
    fn drop(&mut self) {
        if let Ok(layout) = std::alloc::Layout::from_size_align(self.len.max(1), Self::ALIGN) {
            // SAFETY: allocated in `new` with this layout; freed once.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

/// The CM identifier and its event channel, dropped in that order.
struct Endpoint {
    id: CmId,
    events: EventChannel,
}

/// An established (or being established) NVMe/RDMA queue pair. See the module docs.
pub struct CapsuleQueue<B: StableBuffer> {
    // Drop order matters: Drop destroys the queue pair, then these fields go in order:
    // caller buffers, slot memory (their regions), the CQ, the PD, the identifier, its channel.
    ops: Vec<Option<Op<B>>>,
    backlog: VecDeque<Pending<B>>,
    ready: Vec<Event<B>>,
    recv_mem: Registered<DmaMem>,
    send_mem: Registered<DmaMem>,
    cq: CompletionQueue,
    pd: Arc<ProtectionDomain>,
    ep: Endpoint,
    qp: *mut ibv_qp,
    op_free: Vec<u32>,
    recv: RecvRing,
    msgs: SlotPool,
    credits: SendCredits,
    cfg: QueueConfig,
    queue_id: u64,
    failed: Option<String>,
    disconnected: bool,
    local: SocketAddr,
    peer: SocketAddr,
    wc: Vec<ibv_wc>,
}

// SAFETY: every field is owned by the queue (the queue pair pointer too, destroyed once in
// Drop); libibverbs and librdmacm objects may be used from any thread, and the queue's
// methods that post or poll take `&mut self`, so one thread at a time does.
unsafe impl<B: StableBuffer + Send> Send for CapsuleQueue<B> {}
// SAFETY: the `&self` methods only read plain fields, read held receive slots (which the
// device does not write), or wait on the completion and event channels, which libibverbs
// and librdmacm allow from several threads (the acknowledgement counter is atomic).
unsafe impl<B: StableBuffer + Sync> Sync for CapsuleQueue<B> {}

fn zeroed_send_wr() -> ibv_send_wr {
    ibv_send_wr {
        wr_id: 0,
        next: std::ptr::null_mut(),
        sg_list: std::ptr::null_mut(),
        num_sge: 0,
        opcode: 0,
        send_flags: 0,
        imm_or_invalidate_rkey: 0,
        remote_addr: 0,
        rkey: 0,
        _wr_rest: [0; 5],
        remote_srqn: 0,
        _tail: [0; 6],
    }
}

impl<B: StableBuffer> CapsuleQueue<B> {
    /// Sets up the queue pair for a connection request and accepts it with `accept_data`
    /// (the NVMe accept record). If anything fails the request is rejected with
    /// `reject_data` (the NO_RESOURCES record). Must run inside a tokio runtime: the queue's
    /// event descriptors are registered with it.
    pub fn accept(
        req: ConnectRequest,
        cfg: QueueConfig,
        accept_data: &[u8],
        reject_data: &[u8],
    ) -> Result<Self, Error> {
        let ConnectRequest {
            id, local, peer, ..
        } = req;
        let mut events = match EventChannel::new() {
            Ok(e) => e,
            Err(e) => {
                let _ = id.reject(reject_data);
                return Err(e);
            }
        };
        let setup = id
            .migrate(&events)
            .and_then(|()| events.register())
            .and_then(|()| id.device_attr());
        let attr = match setup {
            Ok(a) => a,
            Err(e) => {
                let _ = id.reject(reject_data);
                return Err(e);
            }
        };
        let ep = Endpoint { id, events };
        let cfg = cfg.fit(attr.max_qp_wr);
        let mut q = match Self::build(ep, cfg, local, peer, None) {
            Ok(q) => q,
            Err((e, ep)) => {
                let _ = ep.id.reject(reject_data);
                return Err(e);
            }
        };
        let result = q.post_all_receives().and_then(|()| {
            let cm = &libs()?.cm;
            let len = u8::try_from(accept_data.len())
                .map_err(|_| Error::Invalid("accept private data too long".into()))?;
            let mut param = rdma_conn_param {
                private_data: accept_data.as_ptr().cast(),
                private_data_len: len,
                responder_resources: cfg.responder_resources,
                initiator_depth: cfg.initiator_depth,
                flow_control: 1,
                retry_count: 7,
                rnr_retry_count: 7,
                srq: 0,
                qp_num: 0,
            };
            // SAFETY: the identifier has a pending request and a queue pair; `param` and the
            // private data it points to outlive the call.
            if unsafe { (cm.accept)(q.ep.id.as_ptr(), &mut param) } != 0 {
                return Err(os_error("rdma_accept"));
            }
            Ok(())
        });
        match result {
            Ok(()) => Ok(q),
            Err(e) => {
                let _ = q.ep.id.reject(reject_data);
                Err(e)
            }
        }
    }

    /// Connects to an NVMe/RDMA listener at `dst` with the request record `private_data`,
    /// and waits (up to `timeout` per step) until the connection is established. Returns the
    /// queue and the peer's accept record. A rejection is [`Error::Rejected`]. Must run inside
    /// a tokio runtime.
    ///
    /// The queue uses protection domain `pd` when the route goes through its device, so memory
    /// registered with it serves this queue too; otherwise (or with `None`) it allocates one,
    /// which keeps the device open by itself and can be handed to the next connection
    /// ([`pd`](Self::pd)).
    pub async fn connect(
        dst: SocketAddr,
        cfg: QueueConfig,
        private_data: &[u8],
        timeout: Duration,
        pd: Option<Arc<ProtectionDomain>>,
    ) -> Result<(Self, Vec<u8>), Error> {
        let l = libs()?;
        let mut events = EventChannel::new()?;
        events.register()?;
        let id = CmId::create(&events)?;
        let ep = Endpoint { id, events };
        let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as c_int;
        let mut sa = std_to_sockaddr(&dst);
        // SAFETY: valid identifier; `sa` is a sockaddr of its family; no source address.
        let rc = unsafe {
            (l.cm.resolve_addr)(
                ep.id.as_ptr(),
                std::ptr::null_mut(),
                (&mut sa as *mut sockaddr_storage128).cast(),
                ms,
            )
        };
        if rc != 0 {
            return Err(os_error("rdma_resolve_addr"));
        }
        expect_event(&ep.events, RDMA_CM_EVENT_ADDR_RESOLVED, timeout).await?;
        // SAFETY: the address is resolved.
        if unsafe { (l.cm.resolve_route)(ep.id.as_ptr(), ms) } != 0 {
            return Err(os_error("rdma_resolve_route"));
        }
        expect_event(&ep.events, RDMA_CM_EVENT_ROUTE_RESOLVED, timeout).await?;
        let attr = ep.id.device_attr()?;
        let cfg = cfg.fit(attr.max_qp_wr);
        let local = ep
            .id
            .local_addr()
            .unwrap_or(SocketAddr::from(([0, 0, 0, 0], 0)));
        let mut q = Self::build(ep, cfg, local, dst, Some((pd, local))).map_err(|(e, _)| e)?;
        q.post_all_receives()?;
        let len = u8::try_from(private_data.len())
            .map_err(|_| Error::Invalid("connect private data too long".into()))?;
        {
            let mut param = rdma_conn_param {
                private_data: private_data.as_ptr().cast(),
                private_data_len: len,
                responder_resources: cfg.responder_resources.min(attr.max_qp_rd_atom),
                initiator_depth: cfg.initiator_depth.min(attr.max_qp_init_rd_atom),
                flow_control: 1,
                retry_count: 7,
                rnr_retry_count: 7,
                srq: 0,
                qp_num: 0,
            };
            // SAFETY: the route is resolved and the queue pair exists; `param` and its private
            // data outlive the call.
            if unsafe { (l.cm.connect)(q.ep.id.as_ptr(), &mut param) } != 0 {
                return Err(os_error("rdma_connect"));
            }
        }
        let ev = tokio::time::timeout(timeout, q.ep.events.next())
            .await
            .map_err(|_| Error::Cm("timed out waiting for the connection".into()))??;
        match classify(&ev) {
            CmEvent::Established => Ok((q, ev.private_data)),
            CmEvent::Rejected {
                status,
                private_data,
            } => Err(Error::Rejected {
                status,
                private_data,
            }),
            other => Err(Error::Cm(format!("connect: {other:?}"))),
        }
    }

    /// Allocates the PD, CQ, slot memory and queue pair for an endpoint bound to a device.
    /// `shared`: the active side's PD to reuse when it is of the same device, and the local
    /// address to anchor a new PD to the device with.
    #[allow(clippy::result_large_err, clippy::type_complexity)]
    fn build(
        ep: Endpoint,
        cfg: QueueConfig,
        local: SocketAddr,
        peer: SocketAddr,
        shared: Option<(Option<Arc<ProtectionDomain>>, SocketAddr)>,
    ) -> Result<Self, (Error, Endpoint)> {
        macro_rules! tri {
            ($e:expr) => {
                match $e {
                    Ok(v) => v,
                    Err(e) => return Err((e, ep)),
                }
            };
        }
        tri!(cfg.validate());
        let ctx = ep.id.verbs();
        if ctx.is_null() {
            return Err((Error::Invalid("identifier has no device".into()), ep));
        }
        let pd = match shared {
            None => tri!(ProtectionDomain::alloc(ctx, None)),
            Some((Some(pd), _)) if pd.is_on(ctx) => pd,
            Some((_, local)) => tri!(ProtectionDomain::alloc(ctx, Some(local))),
        };
        let recv_bytes = tri!(
            (cfg.recv_slots as usize)
                .checked_mul(cfg.recv_size)
                .ok_or_else(|| Error::Invalid("receive ring too large".into()))
        );
        let send_bytes = tri!(
            (cfg.send_slots as usize)
                .checked_mul(cfg.send_size)
                .ok_or_else(|| Error::Invalid("message ring too large".into()))
        );
        let recv_mem = tri!(pd.register(tri!(DmaMem::new(recv_bytes)), Access::LOCAL_WRITE));
        let send_mem = tri!(pd.register(tri!(DmaMem::new(send_bytes)), Access::LOCAL_WRITE));
        let cq = tri!(CompletionQueue::new(ctx, cfg.cq_entries()));
        let cm = &tri!(libs()).cm;
        let mut attr = ibv_qp_init_attr {
            qp_context: std::ptr::null_mut(),
            send_cq: cq.as_ptr(),
            recv_cq: cq.as_ptr(),
            srq: std::ptr::null_mut(),
            cap: ibv_qp_cap {
                max_send_wr: cfg.send_depth,
                max_recv_wr: cfg.recv_slots,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: IBV_QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: the identifier is bound to the device of `pd` and `cq`; `attr` is valid for
        // the call. The queue pair is destroyed in Drop before the CQ, PD and memory.
        if unsafe { (cm.create_qp)(ep.id.as_ptr(), pd.as_ptr(), &mut attr) } != 0 {
            return Err((os_error("rdma_create_qp"), ep));
        }
        // SAFETY: rdma_create_qp stored the new queue pair in the identifier.
        let qp = unsafe { (*ep.id.as_ptr()).qp };
        if qp.is_null() {
            return Err((
                Error::Invalid("rdma_create_qp made no queue pair".into()),
                ep,
            ));
        }
        Ok(CapsuleQueue {
            ops: Vec::new(),
            backlog: VecDeque::new(),
            ready: Vec::new(),
            recv_mem,
            send_mem,
            cq,
            pd,
            ep,
            qp,
            op_free: Vec::new(),
            recv: RecvRing::new(cfg.recv_slots),
            msgs: SlotPool::new(cfg.send_slots),
            credits: SendCredits::new(cfg.send_depth),
            cfg,
            queue_id: NEXT_QUEUE_ID.fetch_add(1, Ordering::Relaxed),
            failed: None,
            disconnected: false,
            local,
            peer,
            wc: vec![ibv_wc::default(); POLL_BATCH],
        })
    }

    /// The configuration in effect (fitted to the device).
    pub fn config(&self) -> &QueueConfig {
        &self.cfg
    }

    /// Local address of the connection.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    /// The protection domain, to register buffers for transfers on this queue.
    pub fn pd(&self) -> &Arc<ProtectionDomain> {
        &self.pd
    }

    /// Registers a buffer for local use by this queue's transfers.
    pub fn register(&self, buf: B) -> Result<Registered<B>, Error> {
        self.pd.register(buf, Access::LOCAL_WRITE)
    }

    /// The first error a work request completed with (the queue pair is then unusable).
    pub fn failed(&self) -> Option<&str> {
        self.failed.as_deref()
    }

    /// Whether no SEND or RDMA READ is in flight or waiting for room.
    pub fn is_idle(&self) -> bool {
        self.backlog.is_empty() && self.credits.in_use() == 0 && self.ready.is_empty()
    }

    /// Receive slots posted, and received but not yet answered.
    pub fn recv_counts(&self) -> (usize, usize) {
        (
            self.recv.count(RecvState::Posted),
            self.recv.count(RecvState::Held),
        )
    }

    fn post_all_receives(&mut self) -> Result<(), Error> {
        for i in 0..self.cfg.recv_slots {
            self.post_recv(i)?;
        }
        Ok(())
    }

    fn post_recv(&mut self, i: u32) -> Result<(), Error> {
        let off = i as usize * self.cfg.recv_size;
        let Some(mut sge) = self.recv_mem.sge(off, self.cfg.recv_size) else {
            return Err(Error::Invalid("receive slot out of range".into()));
        };
        if !self.recv.posted(i) {
            return Err(Error::Invalid(format!(
                "receive slot {i} is already posted"
            )));
        }
        let mut wr = ibv_recv_wr {
            wr_id: (KIND_RECV << KIND_SHIFT) | u64::from(i),
            next: std::ptr::null_mut(),
            sg_list: &mut sge,
            num_sge: 1,
        };
        let mut bad: *mut ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: the slot is memory of `recv_mem`, registered on this queue's PD and owned
        // by the queue (marked posted: nothing reads it until its completion); the queue pair
        // is live; `wr` and `sge` are valid for the call (the provider copies them).
        let rc = unsafe {
            let ctx = (*self.qp).context;
            match (*ctx).ops.post_recv {
                Some(f) => f(self.qp, &mut wr, &mut bad),
                None => libc::ENOSYS,
            }
        };
        if rc != 0 {
            self.recv.idle(i);
            return Err(Error::Os {
                op: "ibv_post_recv",
                source: std::io::Error::from_raw_os_error(rc.abs()),
            });
        }
        Ok(())
    }

    /// The bytes received in a slot (empty if the slot is not one of this queue's).
    pub fn message(&self, slot: &RecvSlot) -> &[u8] {
        if slot.queue != self.queue_id || self.recv.state(slot.index) != Some(RecvState::Held) {
            return &[];
        }
        let off = slot.index as usize * self.cfg.recv_size;
        let len = (slot.len as usize).min(self.cfg.recv_size);
        // The slot is held (not posted), so the device does not write it.
        self.recv_mem.get().range(off, len).unwrap_or(&[])
    }

    /// Answers a received command: posts its receive slot again, then RDMA WRITEs `data` (if
    /// any) and SENDs `msg` (the completion), with invalidation of the host's key `invalidate`
    /// when asked. [`Event::Sent`] with `token` reports the end.
    pub fn respond(
        &mut self,
        slot: RecvSlot,
        msg: &[u8],
        data: Option<DataOut<B>>,
        invalidate: Option<u32>,
        token: u64,
    ) -> Result<(), Error> {
        if slot.queue != self.queue_id || self.recv.state(slot.index) != Some(RecvState::Held) {
            return Err(Error::Invalid("receive slot of another queue".into()));
        }
        let reposted = self.post_recv(slot.index);
        if let Err(e) = &reposted {
            self.fail(format!("cannot post a receive: {e}"));
        }
        self.send(msg, data, invalidate, token)
    }

    /// Posts a receive slot again without answering (a host done with a completion).
    pub fn repost(&mut self, slot: RecvSlot) -> Result<(), Error> {
        if slot.queue != self.queue_id || self.recv.state(slot.index) != Some(RecvState::Held) {
            return Err(Error::Invalid("receive slot of another queue".into()));
        }
        self.post_recv(slot.index)
    }

    /// SENDs `msg`, after an RDMA WRITE of `data` when given (a host sends command capsules
    /// this way). [`Event::Sent`] with `token` reports the end.
    pub fn send(
        &mut self,
        msg: &[u8],
        data: Option<DataOut<B>>,
        invalidate: Option<u32>,
        token: u64,
    ) -> Result<(), Error> {
        if msg.len() > self.cfg.send_size {
            return Err(Error::Invalid(format!(
                "message of {} bytes exceeds the {}-byte slots",
                msg.len(),
                self.cfg.send_size
            )));
        }
        if let Some(d) = &data {
            check_transfer(&d.buf, d.len, &d.remote)?;
        }
        if self.backlog.is_empty() && self.failed.is_none() {
            // Straight into a message slot: no copy of the message is kept.
            if let Err(data) = self.try_post_send(msg, data, invalidate, token) {
                self.backlog.push_back(Pending::Send {
                    msg: msg.to_vec(),
                    data,
                    invalidate,
                    token,
                });
            }
            return Ok(());
        }
        self.submit(Pending::Send {
            msg: msg.to_vec(),
            data,
            invalidate,
            token,
        });
        Ok(())
    }

    /// RDMA READs `len` bytes from `remote` into the start of `buf`. [`Event::ReadDone`] with
    /// `token` hands the buffer back. On a bad argument the buffer comes back at once.
    #[allow(clippy::result_large_err)]
    pub fn read(
        &mut self,
        buf: Registered<B>,
        len: usize,
        remote: RemoteKey,
        token: u64,
    ) -> Result<(), (Error, Registered<B>)> {
        if let Err(e) = check_transfer(&buf, len, &remote) {
            return Err((e, buf));
        }
        self.submit(Pending::Read {
            buf,
            len,
            remote,
            token,
        });
        Ok(())
    }

    fn submit(&mut self, p: Pending<B>) {
        if !self.backlog.is_empty() {
            self.backlog.push_back(p);
            return;
        }
        if let Err(p) = self.try_post(p) {
            self.backlog.push_back(p);
        }
    }

    fn drain_backlog(&mut self) {
        while let Some(p) = self.backlog.pop_front() {
            if let Err(p) = self.try_post(p) {
                self.backlog.push_front(p);
                break;
            }
        }
    }

    fn alloc_op(&mut self, op: Op<B>) -> u32 {
        if let Some(i) = self.op_free.pop() {
            self.ops[i as usize] = Some(op);
            i
        } else {
            self.ops.push(Some(op));
            (self.ops.len() - 1) as u32
        }
    }

    fn take_op(&mut self, i: u32) -> Option<Op<B>> {
        let op = self.ops.get_mut(i as usize)?.take()?;
        self.op_free.push(i);
        Some(op)
    }

    /// Posts a request if the send queue and a message slot have room; hands it back if not.
    fn try_post(&mut self, p: Pending<B>) -> Result<(), Pending<B>> {
        if self.failed.is_some() {
            // The queue pair is in the error state: report the request as failed at once.
            self.fail_pending(p);
            return Ok(());
        }
        match p {
            Pending::Send {
                msg,
                data,
                invalidate,
                token,
            } => self
                .try_post_send(&msg, data, invalidate, token)
                .map_err(|data| Pending::Send {
                    msg,
                    data,
                    invalidate,
                    token,
                }),
            Pending::Read {
                buf,
                len,
                remote,
                token,
            } => {
                if self.credits.available() < 1 {
                    return Err(Pending::Read {
                        buf,
                        len,
                        remote,
                        token,
                    });
                }
                let Some(mut sge) = buf.sge(0, len) else {
                    self.ready.push(Event::ReadDone {
                        token,
                        buf,
                        ok: false,
                    });
                    return Ok(());
                };
                let _ = self.credits.try_take(1);
                let op = self.alloc_op(Op::Read { buf, token });
                let mut wr = zeroed_send_wr();
                wr.wr_id = (KIND_READ << KIND_SHIFT) | u64::from(op);
                wr.sg_list = &mut sge;
                wr.num_sge = 1;
                wr.opcode = IBV_WR_RDMA_READ;
                wr.send_flags = IBV_SEND_SIGNALED;
                wr.remote_addr = remote.addr;
                wr.rkey = remote.rkey;
                if let Err(e) = self.post_send(&mut wr) {
                    self.fail(format!("cannot post an RDMA READ: {e}"));
                    if let Some(Op::Read { buf, token }) = self.take_op(op) {
                        self.credits.release(1);
                        self.ready.push(Event::ReadDone {
                            token,
                            buf,
                            ok: false,
                        });
                    }
                }
                Ok(())
            }
        }
    }

    /// Posts a SEND (after an RDMA WRITE of `data`) if the send queue and a message slot have
    /// room; hands `data` back if not.
    fn try_post_send(
        &mut self,
        msg: &[u8],
        data: Option<DataOut<B>>,
        invalidate: Option<u32>,
        token: u64,
    ) -> Result<(), Option<DataOut<B>>> {
        let wrs = if data.as_ref().is_some_and(|d| d.len > 0) {
            2
        } else {
            1
        };
        if self.credits.available() < wrs {
            return Err(data);
        }
        let Some(msg_slot) = self.msgs.take() else {
            return Err(data);
        };
        let off = msg_slot as usize * self.cfg.send_size;
        self.send_mem.get_mut_unposted().write(off, msg);
        let msg_sge = self.send_mem.sge(off, msg.len());
        let (data_buf, data_wr) = match data {
            Some(d) if d.len > 0 => {
                let sge = d.buf.sge(0, d.len);
                (Some(d.buf), sge.map(|s| (s, d.remote)))
            }
            Some(d) => (Some(d.buf), None),
            None => (None, None),
        };
        let (Some(mut msg_sge), true) = (msg_sge, wrs == 1 || data_wr.is_some()) else {
            // Ranges were checked on entry; this cannot happen.
            self.msgs.give(msg_slot);
            self.ready.push(Event::Sent {
                token,
                data: data_buf,
                ok: false,
            });
            return Ok(());
        };
        let _ = self.credits.try_take(wrs);
        let op = self.alloc_op(Op::Send {
            msg_slot,
            data: data_buf,
            wrs,
            token,
        });
        let mut send = zeroed_send_wr();
        send.wr_id = (KIND_SEND << KIND_SHIFT) | u64::from(op);
        send.sg_list = &mut msg_sge;
        send.num_sge = 1;
        send.send_flags = IBV_SEND_SIGNALED;
        match invalidate {
            Some(rkey) => {
                send.opcode = IBV_WR_SEND_WITH_INV;
                send.imm_or_invalidate_rkey = rkey;
            }
            None => send.opcode = IBV_WR_SEND,
        }
        let mut write = zeroed_send_wr();
        let mut data_sge;
        let first: *mut ibv_send_wr = if let Some((sge, remote)) = data_wr {
            data_sge = sge;
            write.wr_id = (KIND_WRITE << KIND_SHIFT) | u64::from(op);
            write.sg_list = &mut data_sge;
            write.num_sge = 1;
            write.opcode = IBV_WR_RDMA_WRITE;
            write.remote_addr = remote.addr;
            write.rkey = remote.rkey;
            write.next = &mut send;
            &mut write
        } else {
            &mut send
        };
        if let Err(e) = self.post_send(first) {
            self.fail(format!("cannot post a send: {e}"));
            if let Some(Op::Send {
                msg_slot,
                data,
                wrs,
                token,
            }) = self.take_op(op)
            {
                self.credits.release(wrs);
                self.msgs.give(msg_slot);
                self.ready.push(Event::Sent {
                    token,
                    data,
                    ok: false,
                });
            }
        }
        Ok(())
    }

    fn post_send(&mut self, wr: *mut ibv_send_wr) -> Result<(), Error> {
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: `wr` is a chain of one or two valid work requests whose scatter/gather
        // entries lie in memory registered on this queue's PD and owned by the queue until
        // the chain's signaled completion (the op table holds caller buffers, message slots
        // are taken from the pool); the provider copies the requests during the call; the
        // queue pair is live.
        let rc = unsafe {
            let ctx = (*self.qp).context;
            match (*ctx).ops.post_send {
                Some(f) => f(self.qp, wr, &mut bad),
                None => libc::ENOSYS,
            }
        };
        if rc != 0 {
            return Err(Error::Os {
                op: "ibv_post_send",
                source: std::io::Error::from_raw_os_error(rc.abs()),
            });
        }
        Ok(())
    }

    fn fail(&mut self, why: String) {
        if self.failed.is_none() {
            tracing::debug!(peer = %self.peer, reason = %why, "RDMA queue pair failed");
            self.failed = Some(why);
        }
    }

    fn fail_pending(&mut self, p: Pending<B>) {
        match p {
            Pending::Send { data, token, .. } => self.ready.push(Event::Sent {
                token,
                data: data.map(|d| d.buf),
                ok: false,
            }),
            Pending::Read { buf, token, .. } => self.ready.push(Event::ReadDone {
                token,
                buf,
                ok: false,
            }),
        }
    }

    /// Collects everything that finished into `out`: polls the completion queue until it is
    /// empty and posts requests that were waiting for room.
    pub fn poll(&mut self, out: &mut Vec<Event<B>>) -> Result<(), Error> {
        out.append(&mut self.ready);
        loop {
            let mut wc = std::mem::take(&mut self.wc);
            let n = self.cq.poll(&mut wc);
            let n = match n {
                Ok(n) => n,
                Err(e) => {
                    self.wc = wc;
                    return Err(e);
                }
            };
            for w in &wc[..n] {
                self.completion(w, out);
            }
            self.wc = wc;
            if n < POLL_BATCH {
                break;
            }
        }
        self.drain_backlog();
        if self.failed.is_some() {
            // Requests that could not be posted finish as failed.
            while let Some(p) = self.backlog.pop_front() {
                self.fail_pending(p);
            }
        }
        out.append(&mut self.ready);
        Ok(())
    }

    fn completion(&mut self, w: &ibv_wc, out: &mut Vec<Event<B>>) {
        let ok = w.status == IBV_WC_SUCCESS;
        if !ok && w.status != IBV_WC_WR_FLUSH_ERR {
            self.fail(format!(
                "{} (vendor error {:#x})",
                wc_status_str(w.status),
                w.vendor_err
            ));
        } else if !ok {
            self.fail("work request flushed".into());
        }
        let kind = w.wr_id >> KIND_SHIFT;
        let index = (w.wr_id & 0xFFFF_FFFF) as u32;
        match kind {
            KIND_RECV => {
                if ok && self.recv.received(index) {
                    out.push(Event::Received(RecvSlot {
                        queue: self.queue_id,
                        index,
                        len: w.byte_len,
                    }));
                } else {
                    self.recv.idle(index);
                }
            }
            KIND_SEND => {
                if let Some(Op::Send {
                    msg_slot,
                    data,
                    wrs,
                    token,
                }) = self.take_op(index)
                {
                    self.credits.release(wrs);
                    self.msgs.give(msg_slot);
                    out.push(Event::Sent { token, data, ok });
                }
            }
            KIND_READ => {
                if let Some(Op::Read { buf, token }) = self.take_op(index) {
                    self.credits.release(1);
                    out.push(Event::ReadDone { token, buf, ok });
                }
            }
            // An unsignaled RDMA WRITE reports only when it fails; the SEND after it is
            // flushed and reports the whole chain.
            _ => {}
        }
    }

    /// Waits until the completion queue has something (then call [`CapsuleQueue::poll`]).
    pub async fn wait(&self) -> Result<(), Error> {
        self.cq.wait().await
    }

    /// Waits for the next connection event.
    pub async fn cm_event(&self) -> Result<CmEvent, Error> {
        let ev = self.ep.events.next().await?;
        Ok(classify(&ev))
    }

    /// Starts an orderly disconnect (the peer sees DISCONNECTED; outstanding work requests
    /// are flushed). Idempotent.
    pub fn disconnect(&mut self) {
        if self.disconnected {
            return;
        }
        self.disconnected = true;
        if let Ok(l) = libs() {
            // SAFETY: the identifier is live; disconnecting a connection that is not (or no
            // longer) connected only returns an error.
            unsafe { (l.cm.disconnect)(self.ep.id.as_ptr()) };
        }
    }
}

fn check_transfer<B: StableBuffer>(
    buf: &Registered<B>,
    len: usize,
    remote: &RemoteKey,
) -> Result<(), Error> {
    if len > buf.capacity() {
        return Err(Error::Invalid(format!(
            "transfer of {len} bytes exceeds the {}-byte buffer",
            buf.capacity()
        )));
    }
    if len > remote.len as usize {
        return Err(Error::Invalid(format!(
            "transfer of {len} bytes exceeds the {}-byte remote buffer",
            remote.len
        )));
    }
    Ok(())
}

async fn expect_event(ch: &EventChannel, want: c_int, timeout: Duration) -> Result<(), Error> {
    let ev = tokio::time::timeout(timeout, ch.next())
        .await
        .map_err(|_| Error::Cm("timed out resolving the address".into()))??;
    if ev.kind != want {
        return Err(Error::Cm(format!(
            "expected {}, got {} (status {})",
            crate::cm::event_name(want),
            crate::cm::event_name(ev.kind),
            ev.status
        )));
    }
    Ok(())
}

impl<B: StableBuffer> Drop for CapsuleQueue<B> {
    fn drop(&mut self) {
        self.disconnect();
        if let Ok(l) = libs() {
            // SAFETY: the queue pair was created on this identifier; destroying it first
            // guarantees the device no longer touches any memory the fields below release.
            unsafe { (l.cm.destroy_qp)(self.ep.id.as_ptr()) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_sizes_cover_every_command() {
        let c = QueueConfig::target(128, 8192, 16);
        assert_eq!(c.recv_slots, 128);
        assert_eq!(c.recv_size, 8256);
        assert!(c.send_slots >= 2 * 128);
        // A READ plus a WRITE + SEND pair for every command at once.
        assert!(c.send_depth >= 3 * 128);
        assert_eq!(c.cq_entries(), c.recv_slots + c.send_depth);
        assert!(c.validate().is_ok());
        let h = QueueConfig::host(32, 4096, 16);
        assert_eq!((h.recv_slots, h.recv_size, h.send_size), (32, 16, 4160));
        assert!(h.send_slots >= 32 && h.send_depth >= 32 && h.validate().is_ok());
        let fitted = c.fit(256);
        assert_eq!((fitted.recv_slots, fitted.send_depth), (128, 256));
        let mut bad = c;
        bad.recv_slots = 0;
        assert!(bad.validate().is_err());
    }
}
