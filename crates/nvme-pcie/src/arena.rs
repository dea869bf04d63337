//! The DMA arena: the one memory region the device may touch, addressed by IOVAs.
//!
//! The arena is a single contiguous host allocation mapped at one contiguous device address
//! range starting at an IOVA this crate chooses (low, page aligned: QEMU's emulated IOMMU
//! accepts only 39-bit addresses). Queues, PRP list pages, Identify buffers and the caller's
//! data buffers are all carved out of it, so every address given to the device is
//! `iova_base + offset`, never a process virtual address.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;

use crate::error::Error;
use crate::sys::DmaRegion;

/// Allocation granule of the arena (the smallest controller memory page).
pub const ARENA_PAGE: usize = 4096;

/// Default IOVA of the arena's first byte: 256 MiB, far below the 39-bit limit.
pub const DEFAULT_IOVA_BASE: u64 = 0x1000_0000;

struct ArenaInner {
    region: DmaRegion,
    iova_base: u64,
    /// One flag per page: allocated or free.
    used: Mutex<Vec<bool>>,
    /// Pages allocated (the count of `used` flags set), readable without the lock.
    in_use: AtomicUsize,
}

/// The DMA arena: page-granular allocator over memory the device may touch.
#[derive(Clone)]
pub struct DmaArena {
    inner: Arc<ArenaInner>,
}

impl std::fmt::Debug for DmaArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DmaArena")
            .field("iova_base", &format_args!("{:#x}", self.inner.iova_base))
            .field("len", &self.inner.region.len())
            .finish()
    }
}

impl DmaArena {
    /// Allocates an arena of `len` bytes (rounded up to whole pages) addressed by the device
    /// from `iova_base` (page aligned; the range must end below 2^39).
    pub fn new(len: usize, iova_base: u64) -> Result<Self, Error> {
        let len = len.div_ceil(ARENA_PAGE).max(1) * ARENA_PAGE;
        let end = iova_base.checked_add(len as u64);
        if iova_base % ARENA_PAGE as u64 != 0 || end.is_none_or(|e| e > 1 << 39) {
            return Err(Error::InvalidConfig(
                "arena IOVA range must be page aligned and below 2^39",
            ));
        }
        let region = DmaRegion::new(len, ARENA_PAGE).ok_or(Error::OutOfDmaMemory)?;
        Ok(Self {
            inner: Arc::new(ArenaInner {
                region,
                iova_base,
                used: Mutex::new(vec![false; len / ARENA_PAGE]),
                in_use: AtomicUsize::new(0),
            }),
        })
    }

    /// Allocates `len` bytes (rounded up to pages) aligned to `align` bytes (a power of two,
    /// at least one page), zeroed.
    pub fn alloc(&self, len: usize, align: usize) -> Result<DmaBuf, Error> {
        let pages = len.div_ceil(ARENA_PAGE).max(1);
        let step = (align / ARENA_PAGE).max(1);
        let mut used = self.inner.used.lock();
        let total = used.len();
        let mut start = 0;
        while start + pages <= total {
            match used[start..start + pages].iter().rposition(|&u| u) {
                None => {
                    used[start..start + pages].fill(true);
                    self.inner.in_use.fetch_add(pages, Ordering::Relaxed);
                    drop(used);
                    let buf = DmaBuf {
                        arena: Arc::clone(&self.inner),
                        off: start * ARENA_PAGE,
                        len,
                    };
                    buf.zero();
                    return Ok(buf);
                }
                Some(busy) => start = (start + busy + 1).div_ceil(step) * step,
            }
        }
        Err(Error::OutOfDmaMemory)
    }

    /// The device's view of the whole arena, for [`crate::Device::map_dma`].
    pub fn window(&self) -> DmaWindow {
        DmaWindow {
            inner: Arc::clone(&self.inner),
        }
    }

    /// Pages currently allocated (for leak checks and budgets; no lock taken).
    pub fn pages_in_use(&self) -> usize {
        self.inner.in_use.load(Ordering::Relaxed)
    }

    /// Pages in the arena.
    pub fn pages(&self) -> usize {
        self.inner.region.len() / ARENA_PAGE
    }

    /// True if `buf` was allocated from this arena.
    pub fn owns(&self, buf: &DmaBuf) -> bool {
        Arc::ptr_eq(&self.inner, &buf.arena)
    }
}

/// A buffer in the arena. The memory returns to the arena when the buffer is dropped; while a
/// command uses it the driver holds it, so it cannot be freed under the device.
pub struct DmaBuf {
    arena: Arc<ArenaInner>,
    off: usize,
    len: usize,
}

impl std::fmt::Debug for DmaBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DmaBuf")
            .field("iova", &format_args!("{:#x}", self.iova()))
            .field("len", &self.len)
            .finish()
    }
}

impl DmaBuf {
    /// The device address of the first byte.
    pub fn iova(&self) -> u64 {
        self.arena.iova_base + self.off as u64
    }

    /// Length in bytes as requested.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes the buffer spans: its length rounded up to whole arena pages.
    pub fn capacity(&self) -> usize {
        self.len.div_ceil(ARENA_PAGE).max(1) * ARENA_PAGE
    }

    /// The whole capacity as bytes. The device touches a data buffer only while a command
    /// holds it (it moves into the driver on submission and comes back in the
    /// [`Completion`](crate::Completion)), so the owner may borrow it like ordinary memory.
    pub fn as_slice(&self) -> &[u8] {
        self.arena
            .region
            .slice(self.off, self.capacity())
            .unwrap_or(&[])
    }

    /// The whole capacity as mutable bytes (see [`DmaBuf::as_slice`]).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.arena
            .region
            .slice_mut(self.off, self.capacity())
            .unwrap_or(&mut [])
    }

    fn range(&self, offset: usize, n: usize) -> Result<usize, Error> {
        match offset.checked_add(n) {
            Some(end) if end <= self.len => Ok(self.off + offset),
            _ => Err(Error::OutOfBounds),
        }
    }

    /// Copies `src` into the buffer at `offset`.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<(), Error> {
        let at = self.range(offset, src.len())?;
        self.arena.region.write_bytes(at, src);
        Ok(())
    }

    /// Copies from the buffer at `offset` into `dst`.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), Error> {
        let at = self.range(offset, dst.len())?;
        self.arena.region.read_bytes(at, dst);
        Ok(())
    }

    fn zero(&self) {
        let pages = self.len.div_ceil(ARENA_PAGE).max(1);
        for w in 0..pages * ARENA_PAGE / 8 {
            self.arena.region.write_u64(self.off + w * 8, 0);
        }
    }

    /// Volatile 32-bit load at `offset` (queue entries).
    pub(crate) fn read_u32(&self, offset: usize) -> u32 {
        self.arena.region.read_u32(self.off + offset).unwrap_or(0)
    }

    /// Volatile 64-bit store at `offset` (queue entries, PRP lists).
    pub(crate) fn write_u64(&self, offset: usize, value: u64) {
        self.arena.region.write_u64(self.off + offset, value);
    }

    /// Zeroes the whole buffer (queue memory before reuse).
    pub(crate) fn clear(&self) {
        self.zero();
    }
}

impl Drop for DmaBuf {
    fn drop(&mut self) {
        let first = self.off / ARENA_PAGE;
        let pages = self.len.div_ceil(ARENA_PAGE).max(1);
        self.arena.used.lock()[first..first + pages].fill(false);
        self.arena.in_use.fetch_sub(pages, Ordering::Relaxed);
    }
}

/// The device side of the arena: access by IOVA, as a DMA engine sees it. Every access is
/// checked against the arena's range; an address outside it is reported, never followed.
#[derive(Clone)]
pub struct DmaWindow {
    inner: Arc<ArenaInner>,
}

impl std::fmt::Debug for DmaWindow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DmaWindow")
            .field("iova_base", &format_args!("{:#x}", self.iova_base()))
            .field("len", &self.len())
            .finish()
    }
}

impl DmaWindow {
    /// The IOVA of the first byte.
    pub fn iova_base(&self) -> u64 {
        self.inner.iova_base
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.region.len()
    }

    /// True for an empty window (never, for an arena).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Host virtual address of the first byte (what an IOMMU mapping needs).
    pub fn host_addr(&self) -> usize {
        self.inner.region.host_addr()
    }

    fn offset(&self, iova: u64) -> Option<usize> {
        usize::try_from(iova.checked_sub(self.inner.iova_base)?).ok()
    }

    /// Reads `dst.len()` bytes at `iova`; false if any byte lies outside the window.
    pub fn read(&self, iova: u64, dst: &mut [u8]) -> bool {
        self.offset(iova)
            .is_some_and(|o| self.inner.region.read_bytes(o, dst))
    }

    /// Writes `src` at `iova`; false if any byte lies outside the window.
    pub fn write(&self, iova: u64, src: &[u8]) -> bool {
        self.offset(iova)
            .is_some_and(|o| self.inner.region.write_bytes(o, src))
    }

    /// Reads a little-endian 64-bit value at an 8-byte aligned `iova`.
    pub fn read_u64(&self, iova: u64) -> Option<u64> {
        self.offset(iova)
            .and_then(|o| self.inner.region.read_u64(o))
            .map(u64::from_le)
    }

    /// Writes a 32-bit value at a 4-byte aligned `iova` (as stored in memory: little endian).
    pub fn write_u32(&self, iova: u64, value: u32) -> bool {
        self.offset(iova)
            .is_some_and(|o| self.inner.region.write_u32(o, value.to_le()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_free_align_and_exhaustion() {
        let arena = DmaArena::new(8 * ARENA_PAGE, DEFAULT_IOVA_BASE).unwrap();
        let a = arena.alloc(100, ARENA_PAGE).unwrap();
        assert_eq!(a.iova(), DEFAULT_IOVA_BASE);
        let b = arena.alloc(3 * ARENA_PAGE, 4 * ARENA_PAGE).unwrap();
        assert_eq!(b.iova() % (4 * ARENA_PAGE as u64), 0);
        assert_eq!(arena.pages_in_use(), 4);
        assert!(matches!(
            arena.alloc(5 * ARENA_PAGE, ARENA_PAGE),
            Err(Error::OutOfDmaMemory)
        ));
        drop(b);
        let c = arena.alloc(5 * ARENA_PAGE, ARENA_PAGE).unwrap();
        assert_eq!(c.iova(), DEFAULT_IOVA_BASE + ARENA_PAGE as u64);
        assert!(a.write(96, &[1, 2, 3, 4]).is_ok());
        assert!(matches!(
            a.write(97, &[1, 2, 3, 4]),
            Err(Error::OutOfBounds)
        ));
        let w = arena.window();
        let mut got = [0u8; 4];
        assert!(w.read(DEFAULT_IOVA_BASE + 96, &mut got));
        assert_eq!(got, [1, 2, 3, 4]);
        assert!(!w.read(DEFAULT_IOVA_BASE - 1, &mut got));
        assert!(!w.read(DEFAULT_IOVA_BASE + 8 * ARENA_PAGE as u64 - 2, &mut got));
        // The owner borrows its whole capacity; the device's view sees the same bytes.
        let mut a = a;
        assert_eq!(a.capacity(), ARENA_PAGE);
        assert_eq!(&a.as_slice()[96..100], &[1, 2, 3, 4]);
        a.as_mut_slice()[ARENA_PAGE - 1] = 9;
        assert!(w.read(DEFAULT_IOVA_BASE + ARENA_PAGE as u64 - 1, &mut got[..1]));
        assert_eq!(got[0], 9);
        assert!(arena.owns(&a));
        let other = DmaArena::new(ARENA_PAGE, DEFAULT_IOVA_BASE).unwrap();
        assert!(!other.owns(&a));
        assert_eq!(arena.pages(), 8);
        drop((a, c));
        assert_eq!(arena.pages_in_use(), 0);
    }

    #[test]
    fn iova_range_is_checked() {
        assert!(DmaArena::new(4096, 1 << 39).is_err());
        assert!(DmaArena::new(4096, 0x1001).is_err());
    }
}
