//! dma-buf export of device memory for RDMA registration (`ibv_reg_dmabuf_mr`).
//!
//! `cuMemGetHandleForAddressRange(CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD)` needs a range that starts
//! and ends on host-page boundaries inside one `cuMemAlloc` allocation. A slice at an arbitrary
//! offset is exported as the page-aligned range around it; the returned [`DmaBuf`] says where the
//! slice starts inside that dma-buf, which is exactly the `offset` argument of
//! `ibv_reg_dmabuf_mr(pd, offset, length, iova, fd, access)`.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;

use cudarc::driver::sys;

use crate::driver::check;
use crate::error::{GpuError, GpuResult};
use crate::memory::{DeviceAlloc, DeviceSlice, round_up};

/// A dma-buf file descriptor for (a page-aligned range around) a device slice.
///
/// Keeps the device allocation alive as long as it exists, so an RDMA memory region registered
/// from it never points at freed memory while this value lives. Drop it only after
/// deregistering the memory region.
pub struct DmaBuf {
    fd: OwnedFd,
    offset: u64,
    len: u64,
    iova: u64,
    mapped_start: u64,
    mapped_len: u64,
    _alloc: Arc<DeviceAlloc>,
}

impl std::fmt::Debug for DmaBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DmaBuf")
            .field("fd", &self.fd)
            .field("offset", &self.offset)
            .field("len", &self.len)
            .field("iova", &format_args!("{:#x}", self.iova))
            .field("mapped_start", &format_args!("{:#x}", self.mapped_start))
            .field("mapped_len", &self.mapped_len)
            .finish()
    }
}

impl DmaBuf {
    /// The dma-buf file descriptor (`fd` of `ibv_reg_dmabuf_mr`).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// The raw descriptor number.
    pub fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Offset of the slice's first byte inside the dma-buf (`offset` of `ibv_reg_dmabuf_mr`).
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Length of the slice in bytes (`length` of `ibv_reg_dmabuf_mr`).
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True for an empty slice (never returned by export, which rejects empty slices).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Device virtual address of the slice's first byte; a natural `iova` for the memory region
    /// so remote addresses equal device addresses.
    pub fn iova(&self) -> u64 {
        self.iova
    }

    /// Device address where the exported (page-aligned) range starts.
    pub fn mapped_start(&self) -> u64 {
        self.mapped_start
    }

    /// Length of the exported (page-aligned) range.
    pub fn mapped_len(&self) -> u64 {
        self.mapped_len
    }
}

/// Host page size (the alignment `cuMemGetHandleForAddressRange` requires).
pub fn host_page_size() -> u64 {
    // SAFETY: `sysconf` has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if page > 0 && (page as u64).is_power_of_two() {
        page as u64
    } else {
        4096
    }
}

/// Computes the page-aligned range `(start, len)` to export for a slice of `slice_len` bytes at
/// device address `slice_start`, inside an allocation at `alloc_start` of `alloc_capacity` bytes.
pub fn dmabuf_export_range(
    page: u64,
    alloc_start: u64,
    alloc_capacity: u64,
    slice_start: u64,
    slice_len: u64,
) -> GpuResult<(u64, u64)> {
    if !page.is_power_of_two() || slice_len == 0 {
        return Err(GpuError::OutOfBounds {
            offset: slice_start.wrapping_sub(alloc_start),
            len: slice_len,
            size: alloc_capacity,
        });
    }
    let alloc_end = alloc_start
        .checked_add(alloc_capacity)
        .ok_or(GpuError::SizeOverflow(alloc_capacity))?;
    let slice_end = slice_start
        .checked_add(slice_len)
        .ok_or(GpuError::SizeOverflow(slice_len))?;
    if slice_start < alloc_start || slice_end > alloc_end {
        return Err(GpuError::OutOfBounds {
            offset: slice_start.wrapping_sub(alloc_start),
            len: slice_len,
            size: alloc_capacity,
        });
    }
    let aligned_start = slice_start & !(page - 1);
    let aligned_end = round_up(slice_end, page).ok_or(GpuError::SizeOverflow(slice_end))?;
    if aligned_start < alloc_start || aligned_end > alloc_end {
        return Err(GpuError::DmaBufRange {
            aligned_start,
            aligned_end,
            alloc_start,
            alloc_end,
        });
    }
    Ok((aligned_start, aligned_end - aligned_start))
}

impl DeviceSlice<'_> {
    /// Exports the page-aligned range around this slice as a dma-buf.
    ///
    /// Works for any slice of a buffer from
    /// [`GpuContext::alloc_exportable`](crate::GpuContext::alloc_exportable); for other buffers
    /// only when the aligned range happens to lie inside the allocation.
    pub fn export_dmabuf(&self) -> GpuResult<DmaBuf> {
        let ctx = &self.alloc.ctx;
        if !ctx.info.dma_buf_supported {
            return Err(GpuError::DmaBufUnsupported);
        }
        let start = self.device_ptr();
        let (mapped_start, mapped_len) = dmabuf_export_range(
            host_page_size(),
            self.alloc.ptr,
            self.alloc.capacity,
            start,
            self.len,
        )?;
        let size = usize::try_from(mapped_len).map_err(|_| GpuError::SizeOverflow(mapped_len))?;
        ctx.bind()?;
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: the range is page-aligned and inside a live `cuMemAlloc` allocation of the
        // current context; for DMA_BUF_FD the handle out-parameter is an `int`; flags must be 0.
        let rc = unsafe {
            sys::cuMemGetHandleForAddressRange(
                (&mut fd as *mut std::ffi::c_int).cast(),
                mapped_start,
                size,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        };
        check(rc, "cuMemGetHandleForAddressRange")?;
        if fd < 0 {
            return Err(GpuError::Driver {
                call: "cuMemGetHandleForAddressRange",
                code: 0,
                name: String::from("CUDA_SUCCESS"),
                description: format!("returned an invalid file descriptor {fd}"),
            });
        }
        // SAFETY: the driver returned a new open descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(DmaBuf {
            fd,
            offset: start - mapped_start,
            len: self.len,
            iova: start,
            mapped_start,
            mapped_len,
            _alloc: self.alloc.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: u64 = 4096;
    const BASE: u64 = 0x7f00_0020_0000;

    #[test]
    fn aligned_slice_exports_itself() {
        assert_eq!(
            dmabuf_export_range(P, BASE, 2 << 20, BASE, 8192).unwrap(),
            (BASE, 8192)
        );
    }

    #[test]
    fn unaligned_slice_exports_enclosing_pages() {
        // 1000 bytes at offset 5000: pages 4096..8192.
        let (start, len) = dmabuf_export_range(P, BASE, 2 << 20, BASE + 5000, 1000).unwrap();
        assert_eq!(start, BASE + 4096);
        assert_eq!(len, 4096);
        // Crossing a page boundary: offset 4000, 200 bytes: pages 0..8192.
        let (start, len) = dmabuf_export_range(P, BASE, 2 << 20, BASE + 4000, 200).unwrap();
        assert_eq!(start, BASE);
        assert_eq!(len, 8192);
    }

    #[test]
    fn range_outside_allocation_is_rejected() {
        // Allocation of 6000 bytes (not padded): a slice ending at 6000 needs pages up to 8192.
        let err = dmabuf_export_range(P, BASE, 6000, BASE, 6000).unwrap_err();
        assert!(matches!(err, GpuError::DmaBufRange { .. }), "{err:?}");
        // Unaligned allocation base.
        let err = dmabuf_export_range(P, BASE + 256, 1 << 20, BASE + 256, 512).unwrap_err();
        assert!(matches!(err, GpuError::DmaBufRange { .. }), "{err:?}");
        // Slice beyond the allocation.
        assert!(matches!(
            dmabuf_export_range(P, BASE, 4096, BASE + 4000, 200),
            Err(GpuError::OutOfBounds { .. })
        ));
        // Empty slice and bad page size.
        assert!(dmabuf_export_range(P, BASE, 4096, BASE, 0).is_err());
        assert!(dmabuf_export_range(3000, BASE, 4096, BASE, 10).is_err());
        // Overflow.
        assert!(dmabuf_export_range(P, u64::MAX - 10, 4096, u64::MAX - 5, 4).is_err());
    }

    #[test]
    fn page_size_is_sane() {
        let p = host_page_size();
        assert!(p.is_power_of_two() && p >= 4096, "{p}");
    }
}
