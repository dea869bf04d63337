//! Aligned, owned I/O buffers and a pool of them.
//!
//! [`IoBuf`] is the only buffer type the backends accept. It is owned (not borrowed) so that an
//! operation can keep it alive for as long as the kernel may touch it: every I/O method takes the
//! buffer by value and hands it back with the result. Its memory is 4096-byte aligned and its
//! capacity is a whole number of 4096-byte pages, which satisfies `O_DIRECT` on every Linux block
//! device and file system.
//!
//! A buffer's memory is either the process heap or, for the `pcie:` backend, a buffer of an
//! NVMe controller's DMA arena ([`nvme_pcie::DmaBuf`]): that backend reads straight into
//! arena memory and hands it back as the caller's buffer, so the data the device wrote is the
//! data the target sends, without a copy. Either kind behaves the same for every user.
//!
//! [`BufPool`] keeps free lists of buffers by power-of-two size class so that the data plane does
//! not allocate per I/O.

use std::fmt;
use std::ops::{Deref, DerefMut};

use parking_lot::Mutex;
use zerocopy::{FromBytes, FromZeros, Immutable, IntoBytes, KnownLayout};

/// Alignment of every [`IoBuf`] and the granularity of its capacity, in bytes.
pub const IO_ALIGN: usize = 4096;

/// One aligned page of buffer memory.
#[derive(Clone, Copy, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C, align(4096))]
struct Page([u8; IO_ALIGN]);

const _: () = assert!(size_of::<Page>() == IO_ALIGN);
const _: () = assert!(align_of::<Page>() == IO_ALIGN);

/// An owned byte buffer whose memory is [`IO_ALIGN`]-aligned, usable for `O_DIRECT` I/O.
///
/// The buffer has a capacity (a multiple of [`IO_ALIGN`]) and a length (at most the capacity);
/// it dereferences to the first `len` bytes. An I/O call transfers exactly `len` bytes. All bytes
/// are always initialized: a new buffer is zero-filled, and a reused one holds whatever it held
/// before.
///
/// Moving an `IoBuf` does not move its memory, so a pointer to its data stays valid while an
/// operation owns it.
pub struct IoBuf {
    mem: Mem,
    len: usize,
}

/// Where an [`IoBuf`]'s memory lives.
enum Mem {
    Heap(Box<[Page]>),
    /// Memory of a controller's DMA arena (4096-byte aligned, whole pages), owned: no
    /// command is using it.
    Dma(nvme_pcie::DmaBuf),
}

/// The error returned by [`IoBuf::set_len`] when the length exceeds the capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("buffer length {requested} exceeds capacity {capacity}")]
pub struct CapacityError {
    /// The length that was asked for.
    pub requested: usize,
    /// The buffer's capacity.
    pub capacity: usize,
}

impl IoBuf {
    /// Allocates a zero-filled buffer of `len` bytes; the capacity is `len` rounded up to a
    /// multiple of [`IO_ALIGN`].
    ///
    /// Like `Vec`, this aborts the process if the memory cannot be allocated.
    pub fn new(len: usize) -> Self {
        let pages = len.div_ceil(IO_ALIGN);
        let pages = match <[Page]>::new_box_zeroed_with_elems(pages) {
            Ok(pages) => pages,
            Err(_) => std::alloc::handle_alloc_error(
                std::alloc::Layout::from_size_align(pages.saturating_mul(IO_ALIGN), IO_ALIGN)
                    .unwrap_or(std::alloc::Layout::new::<Page>()),
            ),
        };
        IoBuf {
            mem: Mem::Heap(pages),
            len,
        }
    }

    /// Wraps a DMA arena buffer (whose capacity is whole 4096-byte pages, 4096-byte aligned);
    /// the length is `len`, at most its capacity.
    pub(crate) fn from_dma(buf: nvme_pcie::DmaBuf, len: usize) -> Self {
        debug_assert!(len <= buf.capacity());
        let len = len.min(buf.capacity());
        IoBuf {
            mem: Mem::Dma(buf),
            len,
        }
    }

    /// The DMA arena buffer behind this one, if it is one (the length is the caller's to
    /// remember); otherwise the buffer itself back.
    pub(crate) fn into_dma(self) -> Result<nvme_pcie::DmaBuf, IoBuf> {
        match self.mem {
            Mem::Dma(d) => Ok(d),
            Mem::Heap(_) => Err(self),
        }
    }

    /// True if the memory belongs to an NVMe controller's DMA arena (a buffer the `pcie:`
    /// backend read into and handed over without copying).
    pub fn is_dma(&self) -> bool {
        matches!(self.mem, Mem::Dma(_))
    }

    fn bytes(&self) -> &[u8] {
        match &self.mem {
            Mem::Heap(p) => p.as_bytes(),
            Mem::Dma(d) => d.as_slice(),
        }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        match &mut self.mem {
            Mem::Heap(p) => p.as_mut_bytes(),
            Mem::Dma(d) => d.as_mut_slice(),
        }
    }

    /// Allocates a buffer holding a copy of `data`.
    pub fn from_slice(data: &[u8]) -> Self {
        let mut buf = IoBuf::new(data.len());
        buf.copy_from_slice(data);
        buf
    }

    /// The number of bytes an I/O on this buffer transfers.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the length is zero.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The allocated size in bytes (a multiple of [`IO_ALIGN`]).
    #[inline]
    pub fn capacity(&self) -> usize {
        match &self.mem {
            Mem::Heap(p) => p.len() * IO_ALIGN,
            Mem::Dma(d) => d.capacity(),
        }
    }

    /// Sets the length. Bytes that become visible keep their previous contents.
    pub fn set_len(&mut self, len: usize) -> Result<(), CapacityError> {
        if len > self.capacity() {
            return Err(CapacityError {
                requested: len,
                capacity: self.capacity(),
            });
        }
        self.len = len;
        Ok(())
    }

    /// The whole capacity as bytes, regardless of the length.
    #[inline]
    pub fn as_capacity_slice_mut(&mut self) -> &mut [u8] {
        self.bytes_mut()
    }

    /// A pointer to the first byte, valid for reads of `capacity()` bytes.
    #[inline]
    pub(crate) fn data_ptr(&self) -> *const u8 {
        self.bytes().as_ptr()
    }

    /// A pointer to the first byte, valid for writes of `capacity()` bytes.
    #[inline]
    pub(crate) fn data_mut_ptr(&mut self) -> *mut u8 {
        self.bytes_mut().as_mut_ptr()
    }
}

impl Deref for IoBuf {
    type Target = [u8];

    #[inline]
    fn deref(&self) -> &[u8] {
        &self.bytes()[..self.len]
    }
}

impl DerefMut for IoBuf {
    #[inline]
    fn deref_mut(&mut self) -> &mut [u8] {
        let len = self.len;
        &mut self.bytes_mut()[..len]
    }
}

impl Clone for IoBuf {
    fn clone(&self) -> Self {
        // A copy of arena memory lives on the heap: the arena is the device's, and small.
        let mut copy = IoBuf::new(self.capacity());
        copy.bytes_mut().copy_from_slice(self.bytes());
        copy.len = self.len;
        copy
    }
}

impl fmt::Debug for IoBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IoBuf")
            .field("len", &self.len)
            .field("capacity", &self.capacity())
            .field("dma", &self.is_dma())
            .finish()
    }
}

/// A pool of [`IoBuf`]s with one free list per power-of-two size class, from [`IO_ALIGN`] up to
/// a maximum.
///
/// Meant to be owned by one reactor (or shared by a few tasks); each free list has its own
/// short-held lock, so taking and returning a buffer costs one uncontended lock and no
/// allocation once the pool is warm. Buffers larger than the largest class are allocated and
/// freed directly.
///
/// A buffer from [`BufPool::get`] is not cleared: it holds data from its previous use beyond
/// what the caller writes. Callers must only expose bytes they filled (a backend read fills the
/// whole length).
pub struct BufPool {
    classes: Box<[Mutex<Vec<IoBuf>>]>,
    max_cached_per_class: usize,
}

const MIN_CLASS_SHIFT: u32 = IO_ALIGN.trailing_zeros();

impl BufPool {
    /// Creates an empty pool with classes from 4 KiB up to `max_class_size` (rounded up to a
    /// power of two), keeping at most `max_cached_per_class` free buffers per class.
    pub fn new(max_class_size: usize, max_cached_per_class: usize) -> Self {
        let max = max_class_size.max(IO_ALIGN).next_power_of_two();
        let count = (max.trailing_zeros() - MIN_CLASS_SHIFT + 1) as usize;
        let classes = (0..count).map(|_| Mutex::new(Vec::new())).collect();
        BufPool {
            classes,
            max_cached_per_class,
        }
    }

    /// The size of the largest class.
    pub fn max_class_size(&self) -> usize {
        IO_ALIGN << (self.classes.len() - 1)
    }

    fn class_of(&self, len: usize) -> Option<usize> {
        let size = len.max(IO_ALIGN).checked_next_power_of_two()?;
        let class = (size.trailing_zeros() - MIN_CLASS_SHIFT) as usize;
        (class < self.classes.len()).then_some(class)
    }

    /// Returns a buffer of length `len` whose capacity is the class size for `len`; reuses a
    /// free one when available.
    pub fn get(&self, len: usize) -> IoBuf {
        let Some(class) = self.class_of(len) else {
            return IoBuf::new(len);
        };
        let reused = self.classes[class].lock().pop();
        let mut buf = reused.unwrap_or_else(|| IoBuf::new(IO_ALIGN << class));
        // The class size is at least `len`, so this cannot fail; fall back to a fresh
        // buffer rather than trusting that.
        if buf.set_len(len).is_err() {
            buf = IoBuf::new(len);
        }
        buf
    }

    /// Returns a buffer to its free list. Buffers whose capacity is not exactly a class size,
    /// or whose class list is full, are freed.
    pub fn put(&self, buf: IoBuf) {
        let cap = buf.capacity();
        if !cap.is_power_of_two() {
            return;
        }
        if let Some(class) = self.class_of(cap) {
            let mut list = self.classes[class].lock();
            if list.len() < self.max_cached_per_class {
                list.push(buf);
            }
        }
    }

    /// Allocates `count` free buffers of the class for `len` ahead of time.
    pub fn prefill(&self, len: usize, count: usize) {
        if let Some(class) = self.class_of(len) {
            let size = IO_ALIGN << class;
            let mut list = self.classes[class].lock();
            while list.len() < count.min(self.max_cached_per_class) {
                list.push(IoBuf::new(size));
            }
        }
    }

    /// Frees every free buffer held.
    pub fn clear(&self) {
        for c in self.classes.iter() {
            c.lock().clear();
        }
    }

    /// The bytes of the free buffers held, over all classes.
    pub fn cached_bytes(&self) -> usize {
        self.classes
            .iter()
            .enumerate()
            .map(|(class, c)| c.lock().len() * (IO_ALIGN << class))
            .sum()
    }

    /// The number of free buffers held, over all classes.
    pub fn cached(&self) -> usize {
        self.classes.iter().map(|c| c.lock().len()).sum()
    }
}

impl fmt::Debug for BufPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BufPool")
            .field("max_class_size", &self.max_class_size())
            .field("cached", &self.cached())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alignment_and_zeroing() {
        for len in [1usize, 512, 4096, 4097, 65536, 1 << 20] {
            let buf = IoBuf::new(len);
            assert_eq!(buf.len(), len);
            assert_eq!(buf.capacity() % IO_ALIGN, 0);
            assert!(buf.capacity() >= len);
            assert_eq!(buf.data_ptr() as usize % IO_ALIGN, 0);
            assert!(buf.iter().all(|&b| b == 0));
        }
    }

    #[test]
    fn set_len_bounds() {
        let mut buf = IoBuf::new(100);
        assert_eq!(buf.capacity(), 4096);
        buf.set_len(4096).unwrap();
        assert_eq!(buf.len(), 4096);
        let err = buf.set_len(4097).unwrap_err();
        assert_eq!(err.capacity, 4096);
        assert_eq!(buf.len(), 4096);
    }

    #[test]
    fn moving_keeps_address() {
        let buf = IoBuf::from_slice(b"hello");
        let p = buf.data_ptr();
        let moved = [Box::new(buf)];
        assert_eq!(moved[0].data_ptr(), p);
        assert_eq!(&moved[0][..], b"hello");
    }

    #[test]
    fn pool_reuses_by_class() {
        let pool = BufPool::new(128 * 1024, 4);
        assert_eq!(pool.max_class_size(), 128 * 1024);
        let mut a = pool.get(5000);
        assert_eq!(a.len(), 5000);
        assert_eq!(a.capacity(), 8192);
        a[0] = 7;
        let p = a.data_ptr();
        pool.put(a);
        assert_eq!(pool.cached(), 1);
        let b = pool.get(8192);
        assert_eq!(b.data_ptr(), p);
        assert_eq!(b[0], 7, "pooled buffers are not cleared");
        assert_eq!(pool.cached(), 0);
        // A request for a different class does not take it.
        pool.put(b);
        let c = pool.get(4096);
        assert_ne!(c.data_ptr(), p);
        assert_eq!(c.capacity(), 4096);
    }

    #[test]
    fn pool_limits() {
        let pool = BufPool::new(16 * 1024, 2);
        // Larger than the largest class: allocated directly and not kept.
        let big = pool.get(1 << 20);
        assert_eq!(big.capacity(), 1 << 20);
        pool.put(big);
        assert_eq!(pool.cached(), 0);
        // Odd capacity: not kept.
        pool.put(IoBuf::new(3 * 4096));
        assert_eq!(pool.cached(), 0);
        // At most two per class.
        for _ in 0..5 {
            pool.put(IoBuf::new(4096));
        }
        assert_eq!(pool.cached(), 2);
        pool.prefill(16 * 1024, 10);
        assert_eq!(pool.cached(), 4);
        // Zero length maps to the smallest class.
        assert_eq!(pool.get(0).capacity(), 4096);
    }
}
