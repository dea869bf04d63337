//! Buffers: the caller-side traits through which read data leaves and write data enters the
//! initiator ([`ReadDest`], [`WriteSource`], [`LentBuffer`]), and a command slot's own data
//! buffer ([`SlotBuf`]), plain or registered for NVMe/RDMA.
//!
//! A leaf of the crate: it depends on nothing here but [`Error`], so the queue core, both
//! links and the namespace API can all use it.

use std::sync::Arc;

use nvmf_rdma::{Access, ProtectionDomain, Registered, RemoteKey};
use nvmf_tcp::RxBytes;

use crate::Error;

/// An error reported by a caller buffer.
pub type BufferError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Where read data goes: host memory today; other memory (a GPU buffer staged through pinned
/// host memory, for example) implements this trait too.
///
/// The initiator delivers each command's data with one `write_at` call per command, in
/// completion order, so offsets arrive out of order when a transfer is split.
pub trait ReadDest {
    /// Size of the destination in bytes (the read length).
    fn len(&self) -> usize;

    /// Whether the destination is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Stores `data` at byte `offset`.
    fn write_at(&mut self, offset: usize, data: &[u8]) -> Result<(), BufferError>;

    /// Lends a buffer of at least `len` bytes for the command that reads bytes
    /// `offset..offset + len`, so that its data is received straight into it (over NVMe/TCP,
    /// from the socket) instead of being copied in with [`write_at`](Self::write_at). Every
    /// lent buffer comes back through [`take_back`](Self::take_back), unless the read is
    /// abandoned (its future dropped, a connection error): then the buffer is dropped once its
    /// command ended. The default lends nothing.
    fn lend(&mut self, offset: usize, len: usize) -> Option<Lent> {
        let _ = (offset, len);
        None
    }

    /// Takes back a buffer from [`lend`](Self::lend). When `filled`, its first `len` bytes are
    /// the data of `offset..offset + len`; otherwise the command failed and the bytes mean
    /// nothing.
    fn take_back(
        &mut self,
        offset: usize,
        len: usize,
        buf: Lent,
        filled: bool,
    ) -> Result<(), BufferError> {
        let _ = (offset, len, buf, filled);
        Err("this destination lends no buffers".into())
    }
}

/// A buffer a [`ReadDest`] lends to one read.
pub enum Lent {
    /// A vector: lent and given back with no allocation of its own.
    Vec(Vec<u8>),
    /// Other memory (for example a pinned staging slot), boxed.
    Other(Box<dyn LentBuffer>),
}

impl Lent {
    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        match self {
            Lent::Vec(v) => v,
            Lent::Other(b) => b.bytes(),
        }
    }

    /// The bytes, writable.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Lent::Vec(v) => v,
            Lent::Other(b) => b.bytes_mut(),
        }
    }
}

/// Memory other than a vector that a [`ReadDest`] lends to a read ([`Lent::Other`]; for
/// example pinned host memory that a GPU copy reads next), owned by the queue while the
/// command is in flight.
pub trait LentBuffer: Send + 'static {
    /// The bytes.
    fn bytes(&self) -> &[u8];

    /// The bytes, writable.
    fn bytes_mut(&mut self) -> &mut [u8];

    /// The buffer as [`Any`](std::any::Any), for the lender to recover its own type.
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send>;
}

/// Where write data comes from: host memory today, other memory through this trait.
pub trait WriteSource {
    /// Size of the source in bytes (the write length).
    fn len(&self) -> usize;

    /// Whether the source is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies `out.len()` bytes starting at byte `offset` into `out`.
    fn read_at(&self, offset: usize, out: &mut [u8]) -> Result<(), BufferError>;
}

fn out_of_bounds() -> BufferError {
    "offset outside the buffer".into()
}

impl ReadDest for [u8] {
    fn len(&self) -> usize {
        <[u8]>::len(self)
    }

    fn write_at(&mut self, offset: usize, data: &[u8]) -> Result<(), BufferError> {
        self.get_mut(offset..offset + data.len())
            .ok_or_else(out_of_bounds)?
            .copy_from_slice(data);
        Ok(())
    }
}

/// A `Vec<u8>` read in one command (no larger than the controller's maximum transfer) lends
/// itself: over NVMe/TCP the data is received from the socket straight into it, with no copy
/// from the queue's buffer. The vector is back, filled, when the read returns. A read whose
/// future is dropped while in flight, or that fails before it reaches the queue (the
/// controller closed or failed), leaves the vector empty; a read that fails later gives it
/// back unchanged in length.
impl ReadDest for Vec<u8> {
    fn len(&self) -> usize {
        Vec::len(self)
    }

    fn write_at(&mut self, offset: usize, data: &[u8]) -> Result<(), BufferError> {
        self.as_mut_slice().write_at(offset, data)
    }

    fn lend(&mut self, offset: usize, len: usize) -> Option<Lent> {
        if offset != 0 || len != Vec::len(self) {
            return None;
        }
        Some(Lent::Vec(std::mem::take(self)))
    }

    fn take_back(
        &mut self,
        offset: usize,
        len: usize,
        buf: Lent,
        filled: bool,
    ) -> Result<(), BufferError> {
        let _ = (offset, len, filled);
        match buf {
            Lent::Vec(v) => {
                *self = v;
                Ok(())
            }
            Lent::Other(_) => Err("a buffer this vector did not lend came back".into()),
        }
    }
}

impl WriteSource for [u8] {
    fn len(&self) -> usize {
        <[u8]>::len(self)
    }

    fn read_at(&self, offset: usize, out: &mut [u8]) -> Result<(), BufferError> {
        out.copy_from_slice(
            self.get(offset..offset + out.len())
                .ok_or_else(out_of_bounds)?,
        );
        Ok(())
    }
}

impl WriteSource for Vec<u8> {
    fn len(&self) -> usize {
        Vec::len(self)
    }

    fn read_at(&self, offset: usize, out: &mut [u8]) -> Result<(), BufferError> {
        self.as_slice().read_at(offset, out)
    }
}

pub(crate) fn buffer_error(e: BufferError) -> Error {
    Error::Buffer(e.to_string())
}

/// Registered data buffers grow in steps of at least this many bytes.
const MIN_REGISTRATION: usize = 4096;

/// A command slot's data buffer: plain memory (NVMe/TCP, or not yet used over RDMA), or memory
/// registered for remote access by the target of an RDMA queue.
///
/// Over RDMA the target reads or writes the bytes while the command is in flight; the queue
/// task owns the buffer during that time, and the queue pair is destroyed before a buffer of a
/// command that did not complete is handed back.
pub(crate) enum SlotBuf {
    /// Unregistered memory.
    Heap(Vec<u8>),
    /// Memory registered (remote read and write) with an RDMA queue's protection domain.
    Registered(Registered<Box<[u8]>>),
    /// A buffer the caller lent for one NVMe/TCP read, received into directly.
    Lent(Lent),
    /// The data slot of a GPU request ring's request (one NVMe/TCP read), received into
    /// directly.
    Ring(gpu_ring::SlotData),
    /// Read data left in the NVMe/TCP receive buffer it arrived in, for the command's caller
    /// to copy out (one copy where receiving into `heap` first would make two); `heap` is
    /// the slot's own buffer, unused meanwhile.
    Kept {
        /// The slot's buffer.
        heap: Vec<u8>,
        /// The data.
        data: RxBytes,
    },
}

/// `heap` holding `data` at its front.
fn settle(mut heap: Vec<u8>, data: &RxBytes) -> Vec<u8> {
    let d = data.as_slice();
    if heap.len() < d.len() {
        heap.resize(d.len(), 0);
    }
    heap[..d.len()].copy_from_slice(d);
    heap
}

impl Default for SlotBuf {
    fn default() -> Self {
        SlotBuf::Heap(Vec::new())
    }
}

impl SlotBuf {
    /// The whole buffer (kept read data: just the data).
    pub fn as_slice(&self) -> &[u8] {
        match self {
            SlotBuf::Heap(v) => v,
            SlotBuf::Registered(r) => r.get(),
            SlotBuf::Lent(l) => l.bytes(),
            SlotBuf::Ring(r) => r.as_ref(),
            SlotBuf::Kept { data, .. } => data.as_slice(),
        }
    }

    /// The whole buffer, writable (kept read data is copied into the slot's buffer first).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        if let SlotBuf::Kept { heap, data } = self {
            *self = SlotBuf::Heap(settle(std::mem::take(heap), data));
        }
        match self {
            SlotBuf::Heap(v) | SlotBuf::Kept { heap: v, .. } => v,
            SlotBuf::Registered(r) => r.bytes_mut(),
            SlotBuf::Lent(l) => l.bytes_mut(),
            SlotBuf::Ring(r) => r.as_mut(),
        }
    }

    /// Whether the buffer is the slot's own, unregistered and empty of kept data.
    pub fn is_heap(&self) -> bool {
        matches!(self, SlotBuf::Heap(_))
    }

    /// Leaves read data `data` where it was received instead of in this buffer, which must
    /// be the slot's own ([`is_heap`](Self::is_heap)); any other gives `data` back.
    pub fn keep(&mut self, data: RxBytes) -> Result<(), RxBytes> {
        let SlotBuf::Heap(heap) = self else {
            return Err(data);
        };
        *self = SlotBuf::Kept {
            heap: std::mem::take(heap),
            data,
        };
        Ok(())
    }

    /// Lets kept read data go (once its caller has read it, or left): the slot's buffer
    /// again.
    pub fn unkeep(&mut self) {
        if let SlotBuf::Kept { heap, .. } = self {
            *self = SlotBuf::Heap(std::mem::take(heap));
        }
    }

    /// The buffer as a vector (a registration is dropped; a lent buffer or ring slot, which only the
    /// shared queues use, gives an empty one).
    pub fn into_vec(self) -> Vec<u8> {
        match self {
            SlotBuf::Heap(v) => v,
            SlotBuf::Kept { heap, data } => settle(heap, &data),
            SlotBuf::Registered(r) => r.detach().0.into_vec(),
            SlotBuf::Lent(_) | SlotBuf::Ring(_) => Vec::new(),
        }
    }

    /// Makes the buffer at least `len` bytes long (keeping its contents); a lent buffer
    /// cannot grow.
    pub fn ensure(&mut self, len: usize) -> Result<(), Error> {
        if self.as_slice().len() >= len {
            return Ok(());
        }
        let mut v = match std::mem::take(self) {
            SlotBuf::Heap(v) => v,
            SlotBuf::Kept { heap, data } => settle(heap, &data),
            SlotBuf::Registered(r) => r.detach().0.into_vec(),
            lent @ (SlotBuf::Lent(_) | SlotBuf::Ring(_)) => {
                let have = lent.as_slice().len();
                *self = lent;
                return Err(Error::InvalidArgument(format!(
                    "a lent buffer of {have} bytes cannot hold {len}"
                )));
            }
        };
        v.resize(len, 0);
        *self = SlotBuf::Heap(v);
        Ok(())
    }

    /// Registers the buffer (at least `len` bytes, contents kept) with `pd` unless it already
    /// is, and returns what the target needs to reach its first `len` bytes, and whether it
    /// registered the buffer now.
    pub(crate) fn remote(
        &mut self,
        pd: &Arc<ProtectionDomain>,
        len: usize,
    ) -> Result<(RemoteKey, bool), nvmf_rdma::Error> {
        let ok = matches!(self, SlotBuf::Registered(r)
            if r.is_registered_with(pd) && r.capacity() >= len);
        if !ok {
            let mut v = match std::mem::take(self) {
                SlotBuf::Heap(v) => v,
                SlotBuf::Kept { heap, data } => settle(heap, &data),
                SlotBuf::Registered(r) => r.detach().0.into_vec(),
                lent @ (SlotBuf::Lent(_) | SlotBuf::Ring(_)) => {
                    *self = lent;
                    return Err(nvmf_rdma::Error::Invalid(
                        "a lent buffer is not registered for RDMA".into(),
                    ));
                }
            };
            let want = len.max(MIN_REGISTRATION).next_power_of_two().max(v.len());
            v.resize(want, 0);
            let reg = pd.register(
                v.into_boxed_slice(),
                Access::REMOTE_WRITE | Access::REMOTE_READ,
            )?;
            *self = SlotBuf::Registered(reg);
        }
        match self {
            SlotBuf::Registered(r) => r.remote_key(0, len).map(|k| (k, !ok)).ok_or_else(|| {
                nvmf_rdma::Error::Invalid(format!("{len} bytes do not fit one keyed SGL"))
            }),
            SlotBuf::Heap(_) | SlotBuf::Lent(_) | SlotBuf::Ring(_) | SlotBuf::Kept { .. } => {
                Err(nvmf_rdma::Error::Invalid("buffer not registered".into()))
            }
        }
    }
}
