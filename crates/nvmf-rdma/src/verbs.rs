//! Verbs objects: devices, protection domains, memory regions and completion queues.

use std::ffi::c_int;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use tokio::io::unix::AsyncFd;

use crate::cm::DeviceAnchor;
use crate::loader::{c_string, libs};
use crate::sys::*;
use crate::{Error, os_error};

/// What a device can do (the subset of `ibv_device_attr` that sizing decisions need).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceAttr {
    /// Firmware version.
    pub fw_ver: String,
    /// Largest memory region in bytes.
    pub max_mr_size: u64,
    /// Most work requests per queue (send or receive).
    pub max_qp_wr: u32,
    /// Most scatter/gather entries per work request.
    pub max_sge: u32,
    /// Most entries per completion queue.
    pub max_cqe: u32,
    /// Most RDMA READs a queue pair accepts from its peer at once (IRD).
    pub max_qp_rd_atom: u8,
    /// Most RDMA READs a queue pair issues at once (ORD).
    pub max_qp_init_rd_atom: u8,
    /// Number of physical ports.
    pub phys_port_cnt: u8,
}

fn clamp_u8(v: c_int) -> u8 {
    v.clamp(0, 255) as u8
}

fn clamp_u32(v: c_int) -> u32 {
    v.max(0) as u32
}

impl DeviceAttr {
    fn from_raw(a: &ibv_device_attr) -> Self {
        let fw: Vec<u8> = a
            .fw_ver
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as u8)
            .collect();
        DeviceAttr {
            fw_ver: String::from_utf8_lossy(&fw).into_owned(),
            max_mr_size: a.max_mr_size,
            max_qp_wr: clamp_u32(a.max_qp_wr),
            max_sge: clamp_u32(a.max_sge),
            max_cqe: clamp_u32(a.max_cqe),
            max_qp_rd_atom: clamp_u8(a.max_qp_rd_atom),
            max_qp_init_rd_atom: clamp_u8(a.max_qp_init_rd_atom),
            phys_port_cnt: a.phys_port_cnt,
        }
    }
}

/// An RDMA device as listed by libibverbs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Kernel name (`mlx5_0`, `rxe0`, ...).
    pub name: String,
    /// Its attributes (None if the device could not be opened).
    pub attr: Option<DeviceAttr>,
}

/// Lists the RDMA devices of this host with their attributes.
pub fn devices() -> Result<Vec<DeviceInfo>, Error> {
    let v = &libs()?.verbs;
    let mut n: c_int = 0;
    // SAFETY: `n` is a valid out-pointer; the list is freed below.
    let list = unsafe { (v.get_device_list)(&mut n) };
    if list.is_null() {
        return Err(os_error("ibv_get_device_list"));
    }
    let mut out = Vec::new();
    for i in 0..n.max(0) as usize {
        // SAFETY: the list holds `n` device pointers followed by NULL.
        let dev = unsafe { *list.add(i) };
        if dev.is_null() {
            break;
        }
        // SAFETY: `dev` is a device of the list, valid until the list is freed.
        let name = c_string(unsafe { (v.get_device_name)(dev) });
        // SAFETY: as above; the context is closed right after the query.
        let ctx = unsafe { (v.open_device)(dev) };
        let attr = if ctx.is_null() {
            None
        } else {
            let attr = query_device(ctx).ok();
            // SAFETY: `ctx` was opened above and nothing else refers to it.
            unsafe { (v.close_device)(ctx) };
            attr
        };
        out.push(DeviceInfo { name, attr });
    }
    // SAFETY: `list` came from ibv_get_device_list and is freed once.
    unsafe { (v.free_device_list)(list) };
    Ok(out)
}

/// Queries the attributes of an open device context.
pub(crate) fn query_device(ctx: *mut ibv_context) -> Result<DeviceAttr, Error> {
    let v = &libs()?.verbs;
    // SAFETY: ibv_device_attr is plain data; all-zero bytes are a valid value.
    let mut raw: ibv_device_attr = unsafe { std::mem::zeroed() };
    // SAFETY: `ctx` is an open context (callers guarantee it) and `raw` a valid out-pointer
    // of the declared layout.
    let rc = unsafe { (v.query_device)(ctx, &mut raw) };
    if rc != 0 {
        return Err(Error::Os {
            op: "ibv_query_device",
            source: io::Error::from_raw_os_error(rc.abs()),
        });
    }
    Ok(DeviceAttr::from_raw(&raw))
}

/// Memory access rights of a registration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Access(c_int);

impl Access {
    /// The local device may write (needed for receives and RDMA READ destinations).
    pub const LOCAL_WRITE: Access = Access(IBV_ACCESS_LOCAL_WRITE);
    /// Remote peers may RDMA WRITE into the region (implies local write).
    pub const REMOTE_WRITE: Access = Access(IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE);
    /// Remote peers may RDMA READ from the region.
    pub const REMOTE_READ: Access = Access(IBV_ACCESS_REMOTE_READ);

    /// The raw `ibv_access_flags` bits.
    pub fn bits(self) -> i32 {
        self.0
    }
}

impl std::ops::BitOr for Access {
    type Output = Access;
    fn bitor(self, rhs: Access) -> Access {
        Access(self.0 | rhs.0)
    }
}

/// A protection domain: memory regions registered with it can be used by every queue pair of
/// the same domain. A host shares one among all its queues on a device (see
/// [`CapsuleQueue::connect`](crate::CapsuleQueue::connect)), so memory is registered once.
pub struct ProtectionDomain {
    // Field order is drop order: Drop deallocates the PD, then the anchor goes.
    pd: NonNull<ibv_pd>,
    ctx: *mut ibv_context,
    /// Keeps the device context open while the PD lives, when no connection may be left.
    _anchor: Option<DeviceAnchor>,
}

// SAFETY: libibverbs objects may be used from any thread; the PD is only read (its pointer is
// passed to thread-safe verbs calls) and freed once, in Drop. The context pointer is only
// compared, never dereferenced; the anchor is an identifier owned by this value.
unsafe impl Send for ProtectionDomain {}
// SAFETY: see Send; no method mutates through a shared reference.
unsafe impl Sync for ProtectionDomain {}

impl std::fmt::Debug for ProtectionDomain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProtectionDomain")
            .field("pd", &self.pd)
            .finish()
    }
}

impl ProtectionDomain {
    /// Allocates a protection domain on an open device context. With `anchor`, the PD holds
    /// an identifier bound to that local address of the device, so the device context stays
    /// open for as long as the PD lives, even after every connection on it is gone.
    pub(crate) fn alloc(
        ctx: *mut ibv_context,
        anchor: Option<std::net::SocketAddr>,
    ) -> Result<Arc<Self>, Error> {
        let v = &libs()?.verbs;
        // Without an anchor the PD works for its own queue pair, but is not shared.
        let anchor = anchor.and_then(|local| match DeviceAnchor::bind(local, ctx) {
            Ok(a) => Some(a),
            Err(e) => {
                tracing::debug!(%local, error = %e, "protection domain not anchored: not shared");
                None
            }
        });
        // SAFETY: `ctx` is an open device context owned by a live CM identifier (and by the
        // anchor, which is bound to the same context, when there is one).
        let pd = unsafe { (v.alloc_pd)(ctx) };
        NonNull::new(pd)
            .map(|pd| {
                Arc::new(ProtectionDomain {
                    pd,
                    ctx,
                    _anchor: anchor,
                })
            })
            .ok_or_else(|| os_error("ibv_alloc_pd"))
    }

    pub(crate) fn as_ptr(&self) -> *mut ibv_pd {
        self.pd.as_ptr()
    }

    /// Whether another queue pair of device context `ctx` may use this PD: it belongs to that
    /// context and is shareable.
    pub(crate) fn is_on(&self, ctx: *mut ibv_context) -> bool {
        self.is_shareable() && self.ctx == ctx
    }

    /// Whether the PD keeps its device open by itself, so it may serve several connections and
    /// outlive them (the PDs [`CapsuleQueue::connect`](crate::CapsuleQueue::connect) allocates,
    /// unless binding the anchor failed).
    pub fn is_shareable(&self) -> bool {
        self._anchor.is_some()
    }

    fn reg(&self, addr: *mut u8, len: usize, access: Access) -> Result<NonNull<ibv_mr>, Error> {
        let v = &libs()?.verbs;
        // SAFETY: `addr..addr+len` is memory owned by the caller's buffer, which the resulting
        // region keeps alive (Registered) or which is checked again before any use
        // (Registration::attach).
        let mr = unsafe { (v.reg_mr)(self.pd.as_ptr(), addr.cast(), len, access.0) };
        NonNull::new(mr).ok_or_else(|| os_error("ibv_reg_mr"))
    }

    /// Registers `buf` for RDMA with the given access rights.
    ///
    /// With remote access rights the peer may change the bytes at any time; read them only
    /// once the protocol says the peer is done.
    pub fn register<B: StableBuffer>(
        self: &Arc<Self>,
        mut buf: B,
        access: Access,
    ) -> Result<Registered<B>, Error> {
        let (addr, len) = buf.region();
        if len == 0 {
            return Err(Error::Invalid("cannot register an empty buffer".into()));
        }
        let mr = self.reg(addr, len, access)?;
        Ok(Registered {
            buf,
            reg: Registration {
                mr: Mr {
                    mr,
                    _pd: Arc::clone(self),
                },
                addr: addr as usize,
                len,
            },
        })
    }

    /// Registers `len` bytes at `offset` of a dma-buf (for example GPU memory exported with
    /// `cuMemGetHandleForAddressRange`), addressed by the peer as `iova`.
    ///
    /// Needs rdma-core 34 or later and a device and kernel that support dma-buf regions.
    pub fn register_dmabuf(
        self: &Arc<Self>,
        fd: BorrowedFd<'_>,
        offset: u64,
        len: usize,
        iova: u64,
        access: Access,
    ) -> Result<DmabufRegion, Error> {
        let v = &libs()?.verbs;
        let Some(reg) = v.reg_dmabuf_mr else {
            return Err(Error::Unsupported(
                "ibv_reg_dmabuf_mr is missing: rdma-core 34 or later is needed for dma-buf regions"
                    .into(),
            ));
        };
        if len == 0 {
            return Err(Error::Invalid(
                "cannot register an empty dma-buf range".into(),
            ));
        }
        // SAFETY: the kernel takes its own reference on the dma-buf for the lifetime of the
        // region, so the memory stays valid independently of `fd`; all arguments are plain
        // values.
        let mr = unsafe {
            reg(
                self.pd.as_ptr(),
                offset,
                len,
                iova,
                fd.as_raw_fd(),
                access.0,
            )
        };
        let mr = NonNull::new(mr).ok_or_else(|| os_error("ibv_reg_dmabuf_mr"))?;
        Ok(DmabufRegion {
            mr: Mr {
                mr,
                _pd: Arc::clone(self),
            },
            iova,
            len,
        })
    }
}

impl Drop for ProtectionDomain {
    fn drop(&mut self) {
        if let Ok(l) = libs() {
            // SAFETY: every region and queue pair holds an Arc to the PD, so none is left.
            unsafe { (l.verbs.dealloc_pd)(self.pd.as_ptr()) };
        }
    }
}

/// An `ibv_mr`, deregistered on drop.
struct Mr {
    mr: NonNull<ibv_mr>,
    _pd: Arc<ProtectionDomain>,
}

// SAFETY: the MR is only read after creation and deregistered once; verbs are thread safe.
unsafe impl Send for Mr {}
// SAFETY: see Send.
unsafe impl Sync for Mr {}

impl Mr {
    fn lkey(&self) -> u32 {
        // SAFETY: the MR is valid until Drop; lkey is set at creation and never changes.
        unsafe { (*self.mr.as_ptr()).lkey }
    }

    fn rkey(&self) -> u32 {
        // SAFETY: as for lkey.
        unsafe { (*self.mr.as_ptr()).rkey }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        if let Ok(l) = libs() {
            // SAFETY: the MR was registered by this crate and is deregistered exactly once;
            // no posted work request refers to it (owners keep buffers until completion or
            // until the queue pair is destroyed).
            unsafe { (l.verbs.dereg_mr)(self.mr.as_ptr()) };
        }
    }
}

/// Memory whose bytes stay at one address for as long as the value lives, even when the value
/// is moved, and whose size never changes.
///
/// # Safety
/// `region` must return the same pointer and length every time it is called on one value,
/// and the memory must stay valid and owned by the value until it is dropped.
pub unsafe trait StableBuffer: 'static {
    /// Address and length of the whole memory.
    fn region(&mut self) -> (*mut u8, usize);
}

// SAFETY: an IoBuf's pages are one boxed allocation that moves with neither the IoBuf nor
// set_len; its capacity is fixed at allocation.
unsafe impl StableBuffer for blockdev::IoBuf {
    fn region(&mut self) -> (*mut u8, usize) {
        let s = self.as_capacity_slice_mut();
        (s.as_mut_ptr(), s.len())
    }
}

// SAFETY: a boxed slice never reallocates and its heap memory does not move with the box.
unsafe impl StableBuffer for Box<[u8]> {
    fn region(&mut self) -> (*mut u8, usize) {
        (self.as_mut_ptr(), self.len())
    }
}

/// The address, length and key a peer uses to reach registered memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteKey {
    /// Remote virtual address (or IOVA).
    pub addr: u64,
    /// Bytes available there.
    pub len: u32,
    /// Remote key.
    pub rkey: u32,
}

/// The key for `len` bytes from `offset` of a region of `size` bytes at remote address `base`:
/// None when the range leaves the region or is longer than one keyed SGL data block.
fn key_for(base: u64, size: usize, rkey: u32, offset: usize, len: usize) -> Option<RemoteKey> {
    let end = offset.checked_add(len)?;
    if end > size || len > crate::capsule::MAX_KEYED_LEN {
        return None;
    }
    Some(RemoteKey {
        addr: base.checked_add(offset as u64)?,
        len: len as u32,
        rkey,
    })
}

/// A memory registration separated from its buffer (see [`Registered::detach`]).
pub struct Registration {
    mr: Mr,
    addr: usize,
    len: usize,
}

impl Registration {
    /// Joins the registration with its buffer again. Fails (handing both back) if `buf` is
    /// not the memory that was registered.
    pub fn attach<B: StableBuffer>(self, mut buf: B) -> Result<Registered<B>, (Registration, B)> {
        let (addr, len) = buf.region();
        if addr as usize != self.addr || len != self.len {
            return Err((self, buf));
        }
        Ok(Registered { buf, reg: self })
    }
}

/// A buffer registered with a protection domain. The registration lives exactly as long as
/// the buffer is owned by this value (or by a queue that is transferring it).
pub struct Registered<B> {
    buf: B,
    reg: Registration,
}

impl<B: StableBuffer> Registered<B> {
    /// The buffer.
    pub fn get(&self) -> &B {
        &self.buf
    }

    /// The buffer, mutable, for crate code that writes only ranges no work request uses.
    pub(crate) fn get_mut_unposted(&mut self) -> &mut B {
        &mut self.buf
    }

    /// The whole registered memory, writable.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let (addr, len) = self.buf.region();
        debug_assert_eq!((addr as usize, len), (self.reg.addr, self.reg.len));
        // SAFETY: StableBuffer guarantees `addr..addr+len` is memory owned by `self.buf`,
        // borrowed mutably through `self` for the returned lifetime.
        unsafe { std::slice::from_raw_parts_mut(addr, len) }
    }

    /// The registered length in bytes.
    pub fn capacity(&self) -> usize {
        self.reg.len
    }

    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.reg.mr.lkey()
    }

    /// Whether the buffer is registered with `pd` (a queue pair of another protection domain
    /// cannot use it).
    pub fn is_registered_with(&self, pd: &Arc<ProtectionDomain>) -> bool {
        Arc::ptr_eq(&self.reg.mr._pd, pd)
    }

    /// What a peer needs to reach `len` bytes from `offset` (when registered with remote
    /// access). None if the range is outside the buffer or longer than a keyed SGL allows.
    pub fn remote_key(&self, offset: usize, len: usize) -> Option<RemoteKey> {
        key_for(
            self.reg.addr as u64,
            self.reg.len,
            self.reg.mr.rkey(),
            offset,
            len,
        )
    }

    /// Separates the buffer from its registration, for code that needs the buffer by value
    /// (backend I/O). Nothing can be transferred with the registration alone.
    pub fn detach(self) -> (B, Registration) {
        (self.buf, self.reg)
    }

    pub(crate) fn sge(&self, offset: usize, len: usize) -> Option<ibv_sge> {
        let end = offset.checked_add(len)?;
        if end > self.reg.len || len > u32::MAX as usize {
            return None;
        }
        Some(ibv_sge {
            addr: (self.reg.addr + offset) as u64,
            length: len as u32,
            lkey: self.reg.mr.lkey(),
        })
    }
}

impl Registered<blockdev::IoBuf> {
    /// Sets the length of the registered I/O buffer (at most its capacity).
    pub fn set_len(&mut self, len: usize) -> Result<(), blockdev::CapacityError> {
        self.buf.set_len(len)
    }
}

/// A registered dma-buf range (device memory that the NIC reads and writes directly).
pub struct DmabufRegion {
    mr: Mr,
    iova: u64,
    len: usize,
}

impl DmabufRegion {
    /// Local key (for local work requests that use the range).
    pub fn lkey(&self) -> u32 {
        self.mr.lkey()
    }

    /// What a peer needs to reach `len` bytes from `offset` of the range.
    pub fn remote_key(&self, offset: usize, len: usize) -> Option<RemoteKey> {
        key_for(self.iova, self.len, self.mr.rkey(), offset, len)
    }

    /// Length of the range in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the range is empty (never: registration refuses empty ranges).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Memory at a fixed address, owned elsewhere, that this crate never reads or writes, only
/// registers by address: GPU memory on the nvidia-peermem path of `ibv_reg_mr`, or host memory
/// that another owner lays out (the data areas of a GPU request ring).
///
/// # Safety
/// `device_range` must return the same address and length every time it is called on one
/// value, and that range must stay allocated at that address, owned by the value, until the
/// value is dropped.
pub unsafe trait DeviceMemory: Send + Sync + 'static {
    /// Address (as the device and `ibv_reg_mr` see it) and length of the memory.
    fn device_range(&self) -> (u64, usize);
}

/// Device memory registered with `ibv_reg_mr` on its address (a peer-memory client such as
/// nvidia-peermem resolves it). The region owns the memory: it is deregistered before the
/// memory is released.
pub struct DeviceRegion<M> {
    // Field order is drop order: deregister, then release the memory.
    mr: Mr,
    mem: M,
    addr: u64,
    len: usize,
}

impl<M: DeviceMemory> DeviceRegion<M> {
    /// The registered memory.
    pub fn memory(&self) -> &M {
        &self.mem
    }

    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.mr.lkey()
    }

    /// What a peer needs to reach `len` bytes from `offset` of the memory.
    pub fn remote_key(&self, offset: usize, len: usize) -> Option<RemoteKey> {
        key_for(self.addr, self.len, self.mr.rkey(), offset, len)
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty (never: registration refuses empty memory).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the memory is registered with `pd`.
    pub fn is_registered_with(&self, pd: &Arc<ProtectionDomain>) -> bool {
        Arc::ptr_eq(&self.mr._pd, pd)
    }
}

impl ProtectionDomain {
    /// Registers memory by its address with `ibv_reg_mr`. Host memory registers as any
    /// buffer does; GPU memory needs a peer-memory client in the kernel, such as
    /// nvidia-peermem (prefer [`register_dmabuf`](Self::register_dmabuf) where the device
    /// supports it).
    pub fn register_device_memory<M: DeviceMemory>(
        self: &Arc<Self>,
        mem: M,
        access: Access,
    ) -> Result<DeviceRegion<M>, Error> {
        let (addr, len) = mem.device_range();
        if len == 0 {
            return Err(Error::Invalid("cannot register empty device memory".into()));
        }
        let v = &libs()?.verbs;
        // SAFETY: DeviceMemory guarantees `addr..addr+len` stays allocated, owned by `mem`,
        // which the returned region keeps until after the region is deregistered. The host
        // never dereferences the address.
        let mr = unsafe { (v.reg_mr)(self.pd.as_ptr(), addr as *mut _, len, access.0) };
        let mr = NonNull::new(mr).ok_or_else(|| os_error("ibv_reg_mr"))?;
        Ok(DeviceRegion {
            mr: Mr {
                mr,
                _pd: Arc::clone(self),
            },
            mem,
            addr,
            len,
        })
    }
}

impl DmabufRegion {
    /// Whether the range is registered with `pd`.
    pub fn is_registered_with(&self, pd: &Arc<ProtectionDomain>) -> bool {
        Arc::ptr_eq(&self.mr._pd, pd)
    }
}

/// Zeroed, page-aligned host memory for registration ([`ProtectionDomain::register`]): the
/// buffer a caller gets to read into and write from with no copy.
pub struct PageBuffer {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a plain heap allocation owned by this value.
unsafe impl Send for PageBuffer {}
// SAFETY: shared references only read.
unsafe impl Sync for PageBuffer {}

impl PageBuffer {
    /// Alignment of the memory.
    pub const ALIGN: usize = 4096;

    /// Allocates `len` zeroed bytes (at least one) aligned to [`Self::ALIGN`].
    pub fn new(len: usize) -> Result<Self, Error> {
        let layout = std::alloc::Layout::from_size_align(len.max(1), Self::ALIGN)
            .map_err(|_| Error::Invalid(format!("{len} bytes is too large a buffer")))?;
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(p)
            .ok_or_else(|| Error::Invalid(format!("cannot allocate {len} bytes")))?;
        Ok(PageBuffer { ptr, len })
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` initialized (zeroed) bytes owned by this value, borrowed shared.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, borrowed exclusively through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for PageBuffer {
    fn drop(&mut self) {
        if let Ok(layout) = std::alloc::Layout::from_size_align(self.len.max(1), Self::ALIGN) {
            // SAFETY: allocated in `new` with this layout; freed once.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

// SAFETY: the allocation never moves or changes size and is owned until Drop.
unsafe impl StableBuffer for PageBuffer {
    fn region(&mut self) -> (*mut u8, usize) {
        (self.ptr.as_ptr(), self.len)
    }
}

#[cfg(feature = "gpu")]
// SAFETY: a DeviceBuffer owns its cuMemAlloc allocation (freed only when the last handle to
// it goes), which never moves; its device pointer and length are fixed at allocation.
unsafe impl DeviceMemory for gpu::DeviceBuffer {
    fn device_range(&self) -> (u64, usize) {
        (self.device_ptr(), self.len())
    }
}

// SAFETY: an `Arc` hands out the one value it owns, which does not move and is dropped only
// with the last handle; the range is the inner value's, which the trait already guarantees.
unsafe impl<M: DeviceMemory> DeviceMemory for Arc<M> {
    fn device_range(&self) -> (u64, usize) {
        (**self).device_range()
    }
}

/// A file descriptor owned by libibverbs or librdmacm, registered with tokio for wakeups.
pub(crate) struct ForeignFd(pub RawFd);

impl AsRawFd for ForeignFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// Registers a library-owned descriptor with the current tokio runtime, for readability.
pub(crate) fn register_fd(fd: RawFd, what: &'static str) -> Result<AsyncFd<ForeignFd>, Error> {
    // SAFETY: the descriptor belongs to a libibverbs/librdmacm channel that stays open for as
    // long as the returned AsyncFd: its owners drop the AsyncFd before destroying the channel.
    unsafe { AsyncFd::register_with_interest(ForeignFd(fd), tokio::io::Interest::READABLE) }
        .map_err(|e| Error::Os {
            op: what,
            source: io::Error::from(e),
        })
}

pub(crate) fn set_nonblocking(fd: RawFd) -> Result<(), Error> {
    // SAFETY: F_GETFL/F_SETFL on a descriptor the library keeps open; no memory is passed.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(os_error("fcntl(O_NONBLOCK)"));
    }
    Ok(())
}

/// A completion queue with its completion channel, armed for one notification at a time.
pub(crate) struct CompletionQueue {
    cq: NonNull<ibv_cq>,
    channel: NonNull<ibv_comp_channel>,
    fd: Option<AsyncFd<ForeignFd>>,
    unacked: AtomicU32,
}

// SAFETY: the queue and its channel are owned by this value and destroyed once, in Drop;
// libibverbs allows polling, arming and reading the channel from any thread.
unsafe impl Send for CompletionQueue {}
// SAFETY: `&self` methods only call thread-safe verbs (poll, arm, get/ack events; the
// acknowledgement count is atomic) and tokio's AsyncFd, which is Sync.
unsafe impl Sync for CompletionQueue {}

impl CompletionQueue {
    /// Creates a queue of at least `entries` completions on `ctx`, with its own channel.
    /// Must run inside a tokio runtime (the channel is registered with its reactor).
    pub fn new(ctx: *mut ibv_context, entries: u32) -> Result<Self, Error> {
        let v = &libs()?.verbs;
        // SAFETY: `ctx` is an open device context owned by a live CM identifier.
        let channel = unsafe { (v.create_comp_channel)(ctx) };
        let channel = NonNull::new(channel).ok_or_else(|| os_error("ibv_create_comp_channel"))?;
        // SAFETY: `channel` was just created; its fd field is valid.
        let fd = unsafe { (*channel.as_ptr()).fd };
        let destroy_channel = |e| {
            // SAFETY: the channel has no completion queue yet.
            unsafe { (v.destroy_comp_channel)(channel.as_ptr()) };
            e
        };
        set_nonblocking(fd).map_err(destroy_channel)?;
        let entries = entries.min(i32::MAX as u32) as c_int;
        // SAFETY: valid context and channel; no user context pointer.
        let cq = unsafe { (v.create_cq)(ctx, entries, std::ptr::null_mut(), channel.as_ptr(), 0) };
        let Some(cq) = NonNull::new(cq) else {
            return Err(destroy_channel(os_error("ibv_create_cq")));
        };
        let mut q = CompletionQueue {
            cq,
            channel,
            fd: None,
            unacked: AtomicU32::new(0),
        };
        q.fd = Some(register_fd(fd, "register completion channel")?);
        q.arm()?;
        Ok(q)
    }

    pub fn as_ptr(&self) -> *mut ibv_cq {
        self.cq.as_ptr()
    }

    /// Requests a notification for the next completion.
    fn arm(&self) -> Result<(), Error> {
        // SAFETY: the CQ is valid; its context's ops table is filled by the provider.
        let rc = unsafe {
            let ctx = (*self.cq.as_ptr()).context;
            match (*ctx).ops.req_notify_cq {
                Some(f) => f(self.cq.as_ptr(), 0),
                None => libc::ENOSYS,
            }
        };
        if rc != 0 {
            return Err(Error::Os {
                op: "ibv_req_notify_cq",
                source: io::Error::from_raw_os_error(rc.abs()),
            });
        }
        Ok(())
    }

    /// Polls up to `out.len()` completions.
    pub fn poll(&self, out: &mut [ibv_wc]) -> Result<usize, Error> {
        let n = out.len().min(i32::MAX as usize) as c_int;
        // SAFETY: `out` holds `n` writable ibv_wc of the declared layout; the CQ is valid.
        let rc = unsafe {
            let ctx = (*self.cq.as_ptr()).context;
            match (*ctx).ops.poll_cq {
                Some(f) => f(self.cq.as_ptr(), n, out.as_mut_ptr()),
                None => -libc::ENOSYS,
            }
        };
        if rc < 0 {
            return Err(Error::Os {
                op: "ibv_poll_cq",
                source: io::Error::from_raw_os_error(-rc),
            });
        }
        Ok(rc as usize)
    }

    /// Waits for the next completion notification, consumes it and re-arms the queue. Poll
    /// the queue empty afterwards: completions that came before the re-arm raise no event.
    pub async fn wait(&self) -> Result<(), Error> {
        let v = &libs()?.verbs;
        let Some(fd) = &self.fd else {
            return Err(Error::Invalid("completion queue without channel".into()));
        };
        loop {
            let mut guard = fd.readable().await.map_err(|source| Error::Os {
                op: "wait for completion channel",
                source,
            })?;
            let mut cq: *mut ibv_cq = std::ptr::null_mut();
            let mut ctx: *mut std::ffi::c_void = std::ptr::null_mut();
            // SAFETY: the channel is valid and non-blocking; out-pointers are valid.
            let rc = unsafe { (v.get_cq_event)(self.channel.as_ptr(), &mut cq, &mut ctx) };
            if rc != 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::WouldBlock {
                    guard.clear_ready();
                    continue;
                }
                return Err(Error::Os {
                    op: "ibv_get_cq_event",
                    source: e,
                });
            }
            let n = self.unacked.fetch_add(1, Ordering::AcqRel) + 1;
            if n >= 64 {
                let n = self.unacked.swap(0, Ordering::AcqRel);
                // SAFETY: acknowledges events that were received on this CQ (and counted).
                unsafe { (v.ack_cq_events)(self.cq.as_ptr(), n) };
            }
            return self.arm();
        }
    }
}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        // Unregister from the tokio reactor before the library closes the descriptor.
        self.fd = None;
        let Ok(l) = libs() else { return };
        let n = *self.unacked.get_mut();
        // SAFETY: the owner destroyed the queue pair using this CQ first (CapsuleQueue's Drop
        // order); events are acknowledged before destruction as libibverbs requires; each
        // object is destroyed once.
        unsafe {
            if n > 0 {
                (l.verbs.ack_cq_events)(self.cq.as_ptr(), n);
            }
            (l.verbs.destroy_cq)(self.cq.as_ptr());
            (l.verbs.destroy_comp_channel)(self.channel.as_ptr());
        }
    }
}

/// The readable text of a work completion status.
pub(crate) fn wc_status_str(status: c_int) -> String {
    match libs() {
        // SAFETY: ibv_wc_status_str returns a static string for any value.
        Ok(l) => c_string(unsafe { (l.verbs.wc_status_str)(status) }),
        Err(_) => format!("status {status}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MAX_KEYED_LEN;

    #[test]
    fn remote_keys_stay_inside_the_region() {
        let k = key_for(0x1000_0000, 64 << 20, 0xAB, 8 << 20, 4096).unwrap();
        assert_eq!(k.addr, 0x1000_0000 + (8 << 20));
        assert_eq!((k.len, k.rkey), (4096, 0xAB));
        assert!(key_for(0x1000, 8192, 1, 4096, 4096).is_some());
        assert!(key_for(0x1000, 8192, 1, 4096, 4097).is_none());
        assert!(key_for(0x1000, 8192, 1, usize::MAX, 2).is_none());
        assert!(key_for(0, 64 << 20, 1, 0, MAX_KEYED_LEN).is_some());
        assert!(key_for(0, 64 << 20, 1, 0, MAX_KEYED_LEN + 1).is_none());
        assert!(key_for(u64::MAX - 10, 64, 1, 32, 8).is_none());
    }

    #[test]
    fn page_buffers_are_aligned_and_zeroed() {
        let mut b = PageBuffer::new(10_000).unwrap();
        assert_eq!(b.as_slice().len(), 10_000);
        assert!(b.as_slice().iter().all(|&x| x == 0));
        assert_eq!(b.as_slice().as_ptr() as usize % PageBuffer::ALIGN, 0);
        b.as_mut_slice()[9_999] = 7;
        let (p, l) = b.region();
        assert_eq!((p as usize % PageBuffer::ALIGN, l), (0, 10_000));
        assert_eq!(b.as_slice()[9_999], 7);
    }
}
