//! The crate's only `unsafe` code: io_uring submissions and the raw system calls the safe
//! standard library does not offer (`fallocate`, block device ioctls, `statx`, `eventfd`).
//!
//! Every function here is safe to call; each `unsafe` block states why its requirements hold.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

pub(crate) mod uring;

/// `BLKGETSIZE64`: `_IOR(0x12, 114, size_t)`, the device size in bytes.
#[cfg(any(
    target_arch = "powerpc",
    target_arch = "powerpc64",
    target_arch = "mips",
    target_arch = "mips64",
    target_arch = "sparc",
    target_arch = "sparc64"
))]
const BLKGETSIZE64: libc::Ioctl = 0x4008_1272;
/// `BLKGETSIZE64`: `_IOR(0x12, 114, size_t)`, the device size in bytes.
#[cfg(not(any(
    target_arch = "powerpc",
    target_arch = "powerpc64",
    target_arch = "mips",
    target_arch = "mips64",
    target_arch = "sparc",
    target_arch = "sparc64"
)))]
const BLKGETSIZE64: libc::Ioctl = 0x8008_1272;

/// Returns a block device's size in bytes and its logical block size.
pub(crate) fn block_device_geometry(file: &File) -> io::Result<(u64, u32)> {
    let fd = file.as_raw_fd();
    let mut size: u64 = 0;
    // SAFETY: `fd` is an open descriptor borrowed from `file`; BLKGETSIZE64 writes one u64
    // through the pointer, which points to a live, writable u64.
    let rc = unsafe { libc::ioctl(fd, BLKGETSIZE64, &mut size as *mut u64) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut lbs: libc::c_int = 0;
    // SAFETY: as above; BLKSSZGET writes one int through the pointer, which points to a live
    // c_int.
    let rc = unsafe { libc::ioctl(fd, libc::BLKSSZGET, &mut lbs as *mut libc::c_int) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    let lbs = u32::try_from(lbs).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    Ok((size, lbs))
}

/// Calls `fallocate(2)` on `file`.
pub(crate) fn fallocate(file: &File, mode: i32, offset: u64, len: u64) -> io::Result<()> {
    let offset =
        libc::off_t::try_from(offset).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    let len = libc::off_t::try_from(len).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    loop {
        // SAFETY: fallocate takes only integers; the descriptor is borrowed from `file` and
        // stays open for the call.
        let rc = unsafe { libc::fallocate(file.as_raw_fd(), mode, offset, len) };
        if rc == 0 {
            return Ok(());
        }
        let err = io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EINTR) {
            return Err(err);
        }
    }
}

/// Takes an exclusive advisory lock on `file` without waiting (`flock(LOCK_EX | LOCK_NB)`).
/// Fails with `EWOULDBLOCK` while another open file description holds one. The lock lasts
/// until it is given up ([`unlock`]) or the open file description is released.
pub(crate) fn try_lock_exclusive(file: &File) -> io::Result<()> {
    flock(file, libc::LOCK_EX | libc::LOCK_NB)
}

/// Gives up the advisory lock this open file description holds on `file` (`flock(LOCK_UN)`);
/// succeeds when it holds none.
pub(crate) fn unlock(file: &File) -> io::Result<()> {
    flock(file, libc::LOCK_UN)
}

fn flock(file: &File, operation: libc::c_int) -> io::Result<()> {
    loop {
        // SAFETY: flock takes only integers; the descriptor is borrowed from `file` and stays
        // open for the call.
        let rc = unsafe { libc::flock(file.as_raw_fd(), operation) };
        if rc == 0 {
            return Ok(());
        }
        let err = io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EINTR) {
            return Err(err);
        }
    }
}

/// An open file or block device shared by the backends that use it and the io_uring
/// operations in flight on it, with the exclusive lock taken on it if it was claimed
/// ([`try_lock_exclusive`]).
///
/// The lock is given up when the last reference is dropped, not left to the kernel's release
/// of the open file description: that can come a moment after the descriptor is closed (an
/// io_uring request lets go of its file after posting its completion, sometimes from a worker
/// thread or a deferred work item), and a claim left held until then would refuse a new
/// backend on the same file opened right after this one is gone.
pub(crate) struct BackingFile {
    file: File,
    claimed: bool,
}

impl BackingFile {
    /// Wraps `file`; `claimed` says whether it holds a lock to give up when dropped.
    pub(crate) fn new(file: File, claimed: bool) -> BackingFile {
        BackingFile { file, claimed }
    }
}

impl std::ops::Deref for BackingFile {
    type Target = File;

    fn deref(&self) -> &File {
        &self.file
    }
}

impl Drop for BackingFile {
    fn drop(&mut self) {
        if self.claimed
            && let Err(e) = unlock(&self.file)
        {
            // The claim then goes when the kernel releases the file.
            tracing::warn!(error = %e, "cannot give up the claim on a file");
        }
    }
}

/// Direct I/O alignment of an open file, from `statx(STATX_DIOALIGN)` (Linux 6.1+).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DioAlign {
    /// Required alignment of buffers in memory; 0 when direct I/O is unsupported.
    pub(crate) mem: u32,
    /// Required alignment of file offsets and lengths; 0 when direct I/O is unsupported.
    pub(crate) offset: u32,
}

/// Returns the direct I/O alignment of `file`, or `None` where the kernel or file system does
/// not report it.
pub(crate) fn dio_align(file: &File) -> Option<DioAlign> {
    // SAFETY: `libc::statx` is a plain C struct of integers, for which all-zero bytes are a
    // valid value.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: the path is a valid NUL-terminated string, AT_EMPTY_PATH makes statx inspect the
    // open descriptor itself, and `stx` is a live, writable statx struct.
    let rc = unsafe {
        libc::statx(
            file.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN,
            &mut stx,
        )
    };
    if rc != 0 || stx.stx_mask & libc::STATX_DIOALIGN == 0 {
        return None;
    }
    Some(DioAlign {
        mem: stx.stx_dio_mem_align,
        offset: stx.stx_dio_offset_align,
    })
}

/// Creates a non-blocking, close-on-exec eventfd.
pub(crate) fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: eventfd takes only integers and returns a new descriptor or -1.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by eventfd, is open, and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}
