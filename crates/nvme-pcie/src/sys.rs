//! Memory the device may touch and the VFIO calls the safe wrappers lack: the only place in
//! this crate with `unsafe`.
//!
//! A [`DmaRegion`] is a page-aligned, zeroed host allocation that a device reads and writes by
//! DMA behind the program's back. Queue memory and PRP lists are therefore never turned into a
//! Rust reference: every access to them is a bounds-checked volatile load or store through a
//! raw pointer. The one exception is a data buffer its owner holds (a `DmaBuf` outside the
//! driver): the device touches a data buffer only while a command the driver holds it for is
//! outstanding, so its owner may borrow its bytes ([`DmaRegion::slice`]). [`Mmio`] is a
//! mapping of a device BAR, accessed the same way. [`dma_map`] and [`iommu_info`] are the VFIO
//! container calls (IOMMU mapping of the arena, IOMMU information with its capability chain).

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::os::fd::RawFd;
use std::ptr::NonNull;

/// A zeroed, aligned host allocation accessed only through volatile operations.
pub(crate) struct DmaRegion {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: the region is plain memory owned by this value; all accesses are volatile loads and
// stores through raw pointers (no references are handed out), so sharing it between threads
// is no different from a device and the CPU sharing it. Callers order their accesses with the
// queue protocol (fences around doorbells and phase tags).
unsafe impl Send for DmaRegion {}
// SAFETY: as for `Send`: no `&`/`&mut` to the memory ever exists.
unsafe impl Sync for DmaRegion {}

impl DmaRegion {
    /// Allocates `len` zeroed bytes aligned to `align` (a power of two); `None` if `len` is
    /// zero, the layout is invalid or the allocation fails.
    pub(crate) fn new(len: usize, align: usize) -> Option<Self> {
        let layout = Layout::from_size_align(len, align).ok()?;
        if layout.size() == 0 {
            return None;
        }
        // SAFETY: the layout has a non-zero size (checked above).
        let raw = unsafe { alloc_zeroed(layout) };
        NonNull::new(raw).map(|ptr| Self { ptr, layout })
    }

    /// Length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.layout.size()
    }

    /// The host virtual address of the first byte (for mapping the region into an IOMMU).
    pub(crate) fn host_addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    fn in_bounds(&self, off: usize, n: usize, align: usize) -> bool {
        off % align == 0 && off.checked_add(n).is_some_and(|end| end <= self.len())
    }

    /// Volatile 32-bit load at byte offset `off` (4-byte aligned); `None` when out of range.
    pub(crate) fn read_u32(&self, off: usize) -> Option<u32> {
        if !self.in_bounds(off, 4, 4) {
            return None;
        }
        // SAFETY: `off..off + 4` lies inside the allocation and is 4-byte aligned (the base
        // is page aligned), so the pointer is valid and aligned for a `u32` read.
        Some(unsafe { self.ptr.as_ptr().add(off).cast::<u32>().read_volatile() })
    }

    /// Volatile 64-bit load at byte offset `off` (8-byte aligned); `None` when out of range.
    pub(crate) fn read_u64(&self, off: usize) -> Option<u64> {
        if !self.in_bounds(off, 8, 8) {
            return None;
        }
        // SAFETY: in bounds and 8-byte aligned, as checked above.
        Some(unsafe { self.ptr.as_ptr().add(off).cast::<u64>().read_volatile() })
    }

    /// Volatile 32-bit store at byte offset `off` (4-byte aligned); false when out of range.
    pub(crate) fn write_u32(&self, off: usize, value: u32) -> bool {
        if !self.in_bounds(off, 4, 4) {
            return false;
        }
        // SAFETY: in bounds and 4-byte aligned, as checked above.
        unsafe {
            self.ptr
                .as_ptr()
                .add(off)
                .cast::<u32>()
                .write_volatile(value)
        };
        true
    }

    /// Volatile 64-bit store at byte offset `off` (8-byte aligned); false when out of range.
    pub(crate) fn write_u64(&self, off: usize, value: u64) -> bool {
        if !self.in_bounds(off, 8, 8) {
            return false;
        }
        // SAFETY: in bounds and 8-byte aligned, as checked above.
        unsafe {
            self.ptr
                .as_ptr()
                .add(off)
                .cast::<u64>()
                .write_volatile(value)
        };
        true
    }

    /// The bytes `off..off + len` as a slice; `None` when out of range.
    ///
    /// Only for a data buffer its owner holds: the caller must guarantee that no device
    /// access to the range is in progress or can start while the borrow lives (the driver
    /// holds a data buffer for as long as a command uses it, so an owned `DmaBuf` qualifies).
    pub(crate) fn slice(&self, off: usize, len: usize) -> Option<&[u8]> {
        if !self.in_bounds(off, len, 1) {
            return None;
        }
        // SAFETY: `off..off + len` lies inside the allocation (checked above), which lives as
        // long as `self`; the bytes are initialised (zeroed at allocation). The caller
        // guarantees that neither the device nor another borrow writes the range meanwhile.
        Some(unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(off), len) })
    }

    /// The bytes `off..off + len` as a mutable slice; `None` when out of range.
    ///
    /// As [`DmaRegion::slice`], and the caller must hold the only access to the range (an
    /// owned `DmaBuf` borrowed mutably).
    #[allow(clippy::mut_from_ref)]
    pub(crate) fn slice_mut(&self, off: usize, len: usize) -> Option<&mut [u8]> {
        if !self.in_bounds(off, len, 1) {
            return None;
        }
        // SAFETY: in bounds and initialised, as in `slice`; the caller guarantees exclusive
        // access to the range (its `DmaBuf` is borrowed mutably, the device does not own it,
        // and distinct buffers never overlap: the arena hands each page to one buffer).
        Some(unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(off), len) })
    }

    /// Copies `src` into the region at `off` with volatile stores; false when out of range.
    pub(crate) fn write_bytes(&self, off: usize, src: &[u8]) -> bool {
        if !self.in_bounds(off, src.len(), 1) {
            return false;
        }
        let base = self.ptr.as_ptr();
        let mut i = 0;
        if off % 8 == 0 {
            for chunk in src.chunks_exact(8) {
                let mut word = [0u8; 8];
                word.copy_from_slice(chunk);
                // SAFETY: `off + i .. off + i + 8` is inside the range checked above and
                // 8-byte aligned (`off` and `i` are multiples of 8, the base is page aligned).
                unsafe {
                    base.add(off + i)
                        .cast::<u64>()
                        .write_volatile(u64::from_ne_bytes(word))
                };
                i += 8;
            }
        }
        for (j, &b) in src.iter().enumerate().skip(i) {
            // SAFETY: `off + j < off + src.len()`, inside the range checked above.
            unsafe { base.add(off + j).write_volatile(b) };
        }
        true
    }

    /// Copies bytes at `off` into `dst` with volatile loads; false when out of range.
    pub(crate) fn read_bytes(&self, off: usize, dst: &mut [u8]) -> bool {
        if !self.in_bounds(off, dst.len(), 1) {
            return false;
        }
        let base = self.ptr.as_ptr();
        let mut i = 0;
        if off % 8 == 0 {
            for chunk in dst.chunks_exact_mut(8) {
                // SAFETY: in bounds and 8-byte aligned, as in `write_bytes`.
                let word = unsafe { base.add(off + i).cast::<u64>().read_volatile() };
                chunk.copy_from_slice(&word.to_ne_bytes());
                i += 8;
            }
        }
        let n = dst.len();
        for (j, b) in dst.iter_mut().enumerate().take(n).skip(i) {
            // SAFETY: `off + j < off + dst.len()`, inside the range checked above.
            *b = unsafe { base.add(off + j).read_volatile() };
        }
        true
    }
}

impl Drop for DmaRegion {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `alloc_zeroed` with exactly this layout and is freed once.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

/// A mapping of a device region (BAR0) through the VFIO device file.
pub(crate) struct Mmio {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is device memory accessed only with volatile 32-bit operations through
// raw pointers; MMIO registers are meant to be accessed from any CPU.
unsafe impl Send for Mmio {}
// SAFETY: as for `Send`.
unsafe impl Sync for Mmio {}

impl Mmio {
    /// Maps `len` bytes of `fd` at `offset` shared, for reading and writing.
    pub(crate) fn map(fd: RawFd, offset: u64, len: usize) -> std::io::Result<Self> {
        let off = libc::off_t::try_from(offset)
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
        // SAFETY: a fresh shared mapping chosen by the kernel (no fixed address), so no existing
        // memory is affected; the result is checked against MAP_FAILED.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                off,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let ptr = NonNull::new(raw.cast::<u8>()).ok_or_else(std::io::Error::last_os_error)?;
        Ok(Self { ptr, len })
    }

    fn at(&self, offset: u32) -> Option<*mut u32> {
        let off = offset as usize;
        if off % 4 != 0 || off.checked_add(4).is_none_or(|end| end > self.len) {
            return None;
        }
        // SAFETY: `off + 4 <= len`, so the pointer stays inside the mapping.
        Some(unsafe { self.ptr.as_ptr().add(off).cast::<u32>() })
    }

    /// Volatile 32-bit register read; `None` outside the mapping or misaligned.
    pub(crate) fn read32(&self, offset: u32) -> Option<u32> {
        // SAFETY: `at` returns only aligned pointers inside the live mapping.
        self.at(offset).map(|p| unsafe { p.read_volatile() })
    }

    /// Volatile 32-bit register write; false outside the mapping or misaligned.
    pub(crate) fn write32(&self, offset: u32, value: u32) -> bool {
        match self.at(offset) {
            // SAFETY: `at` returns only aligned pointers inside the live mapping.
            Some(p) => unsafe { p.write_volatile(value) },
            None => return false,
        }
        true
    }
}

impl Drop for Mmio {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `map`, once; no references into it exist.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// Maps the arena memory `[host_addr, host_addr + len)` for device DMA at `iova`.
///
/// The caller keeps the memory allocated until it is unmapped: the arena's region is
/// reference counted and the VFIO device holds a reference while the mapping exists.
pub(crate) fn dma_map(
    container: &vfio_ioctls::VfioContainer,
    iova: u64,
    len: usize,
    host_addr: usize,
) -> Result<(), vfio_ioctls::VfioError> {
    // SAFETY: the memory is a `DmaRegion`, accessed only through raw-pointer volatile
    // operations (never references), and it outlives the mapping (see above).
    unsafe { container.vfio_dma_map(iova, len, host_addr as *mut u8) }
}

/// `VFIO_IOMMU_GET_INFO` (`_IO(';', 100 + 12)`).
const VFIO_IOMMU_GET_INFO: libc::c_ulong = (0x3B << 8) | (100 + 12);

/// The container's IOMMU information with its capability chain, as the kernel wrote it.
pub(crate) fn iommu_info(container: RawFd) -> std::io::Result<Vec<u8>> {
    let mut argsz = 24u32;
    for _ in 0..2 {
        // u64 storage keeps the structure 8-byte aligned.
        let mut buf = vec![0u64; (argsz as usize).div_ceil(8)];
        let bytes = buf.len() * 8;
        let size = u32::try_from(bytes).unwrap_or(u32::MAX);
        buf[0] = u64::from(size);
        // SAFETY: `buf` is writable for `bytes` bytes and argsz tells the kernel so; the kernel
        // writes at most argsz bytes.
        let rc = unsafe { libc::ioctl(container, VFIO_IOMMU_GET_INFO as _, buf.as_mut_ptr()) };
        if rc < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let raw: Vec<u8> = buf.iter().flat_map(|w| w.to_ne_bytes()).collect();
        let needed = u32::from_ne_bytes([raw[0], raw[1], raw[2], raw[3]]);
        if needed <= size {
            return Ok(raw);
        }
        argsz = needed;
    }
    Err(std::io::Error::from(std::io::ErrorKind::InvalidData))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_and_alignment_are_checked() {
        let r = DmaRegion::new(4096, 4096).expect("alloc");
        assert!(r.write_u64(8, 0x1122_3344_5566_7788));
        assert_eq!(r.read_u32(8), Some(0x5566_7788));
        assert_eq!(r.read_u64(8), Some(0x1122_3344_5566_7788));
        assert_eq!(r.read_u32(4094), None);
        assert_eq!(r.read_u32(2), None);
        assert!(!r.write_u64(4092, 1));
        assert!(!r.write_bytes(4090, &[0; 7]));
        let data: Vec<u8> = (0..37).collect();
        assert!(r.write_bytes(16, &data));
        assert!(r.write_bytes(101, &data));
        let mut back = vec![0u8; 37];
        assert!(r.read_bytes(16, &mut back));
        assert_eq!(back, data);
        assert!(r.read_bytes(101, &mut back));
        assert_eq!(back, data);
        assert!(DmaRegion::new(0, 4096).is_none());
    }

    #[test]
    fn mmio_over_a_file_mapping() {
        let path = std::env::temp_dir().join(format!("nvme-pcie-mmio-{}", std::process::id()));
        let file = std::fs::File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        std::fs::remove_file(&path).unwrap();
        file.set_len(8192).unwrap();
        use std::os::fd::AsRawFd;
        let m = Mmio::map(file.as_raw_fd(), 4096, 4096).unwrap();
        assert!(m.write32(0x1c, 0xdead_beef));
        assert_eq!(m.read32(0x1c), Some(0xdead_beef));
        assert_eq!(m.read32(4096), None);
        assert_eq!(m.read32(2), None);
        assert!(!m.write32(4094, 1));
        assert!(Mmio::map(-1, 0, 4096).is_err());
    }
}
