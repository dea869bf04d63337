//! Block storage backends for the target: memory, null, file and block device through io_uring,
//! and a local NVMe controller driven from user space through VFIO.
//!
//! The target's data plane and the load generator call a [`Backend`] with owned, aligned
//! buffers ([`IoBuf`]); every call takes its buffer by value and returns it with the result, so
//! the buffer outlives whatever the kernel does with it even when the caller drops the future.
//! [`AnyBackend`] dispatches to the concrete backends without boxing; one instance is shared
//! (through an `Arc`) by every reactor thread, and every future it returns is `Send`.
//!
//! | backend | what it is for |
//! |---|---|
//! | [`MemoryBackend`] | sparse RAM namespace: chunks are allocated on first write |
//! | [`NullBackend`] | reads return zeros, writes vanish: measures the transport alone |
//! | [`FileBackend`] | a regular file or block device, `O_DIRECT` through io_uring |
//! | [`VolatileCache`] | testing: a bounded in-memory write cache in front of another backend, lost on a crash unless flushed or written with FUA |
//! | [`PcieBackend`] | a namespace of an NVMe controller bound to `vfio-pci`, polled queue pairs (one per thread), reads handed over in DMA memory without a copy |
//!
//! Backends are named by a [`BackendSpec`] (`mem:1G`, `null:512M`, `file:/path,size=10G`,
//! `bdev:/dev/nvme0n1`, `file:/path,volatile_cache=64M`, `pcie:0000:01:00.0,nsid=1`), parsed from a string or deserialized
//! from TOML, and opened with [`open`].
//!
//! # Durability
//!
//! [`Backend::volatile_write_cache`] says whether completed writes may be lost on a crash until
//! a [`Backend::flush`]: true for files and devices (page cache, device cache) and for
//! [`VolatileCache`], false for memory (lost at exit whatever is flushed) and null.
//! [`Backend::write_fua`] is a write that is durable when it completes (NVMe Force Unit
//! Access); its default is a write followed by a flush, and the file backend uses `RWF_DSYNC`.
//!
//! # Errors and NVMe status
//!
//! Every failure is a [`BackendError`]; [`BackendError::status_hint`] says which NVMe status
//! the target should complete the command with (LBA Out of Range, Write Fault, Unrecovered Read
//! Error, Capacity Exceeded, ...). Range checks happen here too, so a backend never touches
//! memory or file offsets outside the namespace.
//!
//! # The io_uring design
//!
//! Each thread that issues file I/O gets its own ring (thread-local, one per tokio runtime the
//! thread runs), so the reactors of a thread-per-core target never share a ring. A submission
//! only pushes an entry to the ring and, for the first entry of a batch, wakes the ring's driver
//! task; the driver submits everything queued with one `io_uring_enter`, so all I/O started
//! during one scheduler tick goes to the kernel together. Completions signal an eventfd
//! registered with tokio (`AsyncFd`); the driver reaps the completion queue and wakes the
//! waiting futures. This works the same on current-thread and multi-thread runtimes: a future
//! that migrates between worker threads keeps a handle to the ring it submitted to.
//!
//! Soundness: the ring, not the future, owns the buffer and a reference to the file for as long
//! as the kernel may use them. Dropping an I/O future marks its slot abandoned; the buffer is
//! freed when the completion arrives. A ring dropped with I/O in flight waits for those
//! completions before releasing memory (or leaks the buffers if it cannot wait).
//!
//! The runtime must have its I/O driver enabled (`enable_io` or `enable_all`) for the io_uring
//! engine. Where io_uring is unavailable (`ENOSYS`, `EPERM`: old kernels, seccomp, the
//! `io_uring_disabled` sysctl) the file backend warns once and uses positional reads and writes
//! on tokio's blocking pool instead.
//!
//! `unsafe` code lives only in the private `sys` module (io_uring submissions, ioctls,
//! `fallocate`, `statx`, `eventfd`).
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(unsafe_code)]

use std::future::Future;

mod buf;
mod cache;
mod error;
mod file;
mod mem;
mod null;
mod pcie;
mod spec;
#[allow(unsafe_code)]
mod sys;

pub use buf::{BufPool, CapacityError, IO_ALIGN, IoBuf};
pub use cache::VolatileCache;
pub use error::{BackendError, IoOp, StatusHint};
pub use file::{FileBackend, FileEngine};
pub use mem::{DEFAULT_CHUNK_SIZE, MemoryBackend, SharedPiece};
pub use null::NullBackend;
pub use pcie::PcieBackend;
pub use spec::{
    BackendSpec, DEFAULT_BLOCK_SIZE, FileSpec, IoEngine, SpecError, format_size, parse_size,
    validate_block_size,
};

/// The result of a read or write: the outcome and the buffer, handed back either way.
pub type BufResult = (Result<(), BackendError>, IoBuf);

/// A block storage backend.
///
/// Reads and writes transfer `buf.len()` bytes, which must be a non-zero multiple of
/// [`block_size`](Backend::block_size), starting at block `lba`. Writes are durable once a later
/// [`flush`](Backend::flush) has completed, or on completion when written with
/// [`write_fua`](Backend::write_fua) (when
/// [`volatile_write_cache`](Backend::volatile_write_cache) is false nothing a flush could save
/// is lost: they are durable as soon as they complete, or, for memory, never). Out-of-range requests fail with [`BackendError::OutOfRange`] before touching
/// anything.
pub trait Backend: Send + Sync {
    /// Bytes per logical block (512 or 4096 in practice).
    fn block_size(&self) -> u32;

    /// Capacity in logical blocks.
    fn num_blocks(&self) -> u64;

    /// Capacity in bytes.
    fn capacity_bytes(&self) -> u64 {
        self.num_blocks() * u64::from(self.block_size())
    }

    /// Whether completed writes may be lost without a flush (NVMe VWC).
    fn volatile_write_cache(&self) -> bool;

    /// Whether deallocated blocks are guaranteed to read back as zeros (NVMe DLFEAT).
    fn deallocate_reads_zeroes(&self) -> bool;

    /// Reads `buf.len()` bytes starting at block `lba` into `buf`.
    fn read(&self, lba: u64, buf: IoBuf) -> impl Future<Output = BufResult> + Send;

    /// Writes `buf.len()` bytes from `buf` starting at block `lba`.
    fn write(&self, lba: u64, buf: IoBuf) -> impl Future<Output = BufResult> + Send;

    /// Writes like [`write`](Backend::write) and completes only once the data is durable
    /// (NVMe Force Unit Access). The default writes and then flushes, which is correct for any
    /// backend; backends with a cheaper way override it.
    fn write_fua(&self, lba: u64, buf: IoBuf) -> impl Future<Output = BufResult> + Send {
        async move {
            match self.write(lba, buf).await {
                (Ok(()), buf) => (self.flush().await, buf),
                failed => failed,
            }
        }
    }

    /// Makes every completed write durable.
    fn flush(&self) -> impl Future<Output = Result<(), BackendError>> + Send;

    /// Sets `blocks` blocks from `lba` to zeros.
    fn write_zeroes(
        &self,
        lba: u64,
        blocks: u64,
    ) -> impl Future<Output = Result<(), BackendError>> + Send;

    /// Hints that `blocks` blocks from `lba` are no longer needed. Their contents afterwards
    /// are zeros if [`deallocate_reads_zeroes`](Backend::deallocate_reads_zeroes), else
    /// unspecified (old data or zeros).
    fn deallocate(
        &self,
        lba: u64,
        blocks: u64,
    ) -> impl Future<Output = Result<(), BackendError>> + Send;
}

/// Checks that `blocks` blocks from `lba` lie inside a namespace of `capacity` blocks.
pub(crate) fn check_range(lba: u64, blocks: u64, capacity: u64) -> Result<(), BackendError> {
    match lba.checked_add(blocks) {
        Some(end) if end <= capacity => Ok(()),
        _ => Err(BackendError::OutOfRange {
            lba,
            blocks,
            capacity,
        }),
    }
}

/// Validates a transfer of `len` bytes at `lba` and returns its byte offset.
pub(crate) fn check_transfer(
    lba: u64,
    len: usize,
    block_size: u32,
    capacity: u64,
) -> Result<u64, BackendError> {
    let bs = block_size as usize;
    if len == 0 || len % bs != 0 {
        return Err(BackendError::InvalidLength { len, block_size });
    }
    check_range(lba, (len / bs) as u64, capacity)?;
    Ok(lba * u64::from(block_size))
}

/// One of the backends, dispatched without boxing.
#[derive(Debug)]
pub enum AnyBackend {
    /// Sparse memory.
    Memory(MemoryBackend),
    /// Zeros in, nothing out.
    Null(NullBackend),
    /// File or block device.
    File(FileBackend),
    /// File or block device behind a volatile write cache (a testing feature).
    Cached(VolatileCache<FileBackend>),
    /// A namespace of an NVMe controller driven through VFIO.
    Pcie(PcieBackend),
}

impl AnyBackend {
    /// A short name of the backend kind: `mem`, `null`, `file`, `bdev` or `pcie`.
    pub fn kind(&self) -> &'static str {
        match self {
            AnyBackend::Memory(_) => "mem",
            AnyBackend::Null(_) => "null",
            AnyBackend::File(f) if f.is_block_device() => "bdev",
            AnyBackend::File(_) => "file",
            AnyBackend::Cached(c) if c.inner().is_block_device() => "bdev",
            AnyBackend::Cached(_) => "file",
            AnyBackend::Pcie(_) => "pcie",
        }
    }

    /// A backend for the same storage with a new capacity of `size` bytes, for a namespace
    /// resized while it is served: a null namespace takes any size; a regular file is grown
    /// (never shrunk) and keeps its descriptor and claim. Memory namespaces, block devices,
    /// cached files and PCIe namespaces are refused.
    pub fn resized(&self, size: u64) -> Result<AnyBackend, BackendError> {
        match self {
            AnyBackend::Null(b) => Ok(AnyBackend::Null(NullBackend::new(size, b.block_size())?)),
            AnyBackend::File(f) => Ok(AnyBackend::File(f.grown(size)?)),
            other => Err(BackendError::Config(format!(
                "{} namespaces cannot be resized while served",
                match other {
                    AnyBackend::Cached(_) => "cached file",
                    o => o.kind(),
                }
            ))),
        }
    }

    /// What a crash does to this backend's data, for a line in the log when it is opened:
    /// `Some` for RAM (lost whatever the host does) and for a volatile cache (unflushed writes
    /// lost), `None` where completed and flushed writes survive.
    pub fn crash_warning(&self) -> Option<String> {
        match self {
            AnyBackend::Memory(_) => Some(
                "RAM namespace: its contents are lost when the process ends, whatever the host \
                 flushes"
                    .into(),
            ),
            AnyBackend::Cached(c) => Some(format!(
                "volatile_cache={} (testing feature): writes not made durable by a Flush or \
                 Force Unit Access are lost when the process is killed",
                format_size(c.capacity_bytes())
            )),
            AnyBackend::Null(_) | AnyBackend::File(_) | AnyBackend::Pcie(_) => None,
        }
    }
}

impl Backend for AnyBackend {
    fn block_size(&self) -> u32 {
        match self {
            AnyBackend::Memory(b) => b.block_size(),
            AnyBackend::Null(b) => b.block_size(),
            AnyBackend::File(b) => b.block_size(),
            AnyBackend::Cached(b) => b.block_size(),
            AnyBackend::Pcie(b) => b.block_size(),
        }
    }

    fn num_blocks(&self) -> u64 {
        match self {
            AnyBackend::Memory(b) => b.num_blocks(),
            AnyBackend::Null(b) => b.num_blocks(),
            AnyBackend::File(b) => b.num_blocks(),
            AnyBackend::Cached(b) => b.num_blocks(),
            AnyBackend::Pcie(b) => b.num_blocks(),
        }
    }

    fn volatile_write_cache(&self) -> bool {
        match self {
            AnyBackend::Memory(b) => b.volatile_write_cache(),
            AnyBackend::Null(b) => b.volatile_write_cache(),
            AnyBackend::File(b) => b.volatile_write_cache(),
            AnyBackend::Cached(b) => b.volatile_write_cache(),
            AnyBackend::Pcie(b) => b.volatile_write_cache(),
        }
    }

    fn deallocate_reads_zeroes(&self) -> bool {
        match self {
            AnyBackend::Memory(b) => b.deallocate_reads_zeroes(),
            AnyBackend::Null(b) => b.deallocate_reads_zeroes(),
            AnyBackend::File(b) => b.deallocate_reads_zeroes(),
            AnyBackend::Cached(b) => b.deallocate_reads_zeroes(),
            AnyBackend::Pcie(b) => b.deallocate_reads_zeroes(),
        }
    }

    async fn read(&self, lba: u64, buf: IoBuf) -> BufResult {
        match self {
            AnyBackend::Memory(b) => b.read(lba, buf).await,
            AnyBackend::Null(b) => b.read(lba, buf).await,
            AnyBackend::File(b) => b.read(lba, buf).await,
            AnyBackend::Cached(b) => b.read(lba, buf).await,
            AnyBackend::Pcie(b) => b.read(lba, buf).await,
        }
    }

    async fn write(&self, lba: u64, buf: IoBuf) -> BufResult {
        match self {
            AnyBackend::Memory(b) => b.write(lba, buf).await,
            AnyBackend::Null(b) => b.write(lba, buf).await,
            AnyBackend::File(b) => b.write(lba, buf).await,
            AnyBackend::Cached(b) => b.write(lba, buf).await,
            AnyBackend::Pcie(b) => b.write(lba, buf).await,
        }
    }

    async fn write_fua(&self, lba: u64, buf: IoBuf) -> BufResult {
        match self {
            AnyBackend::Memory(b) => b.write_fua(lba, buf).await,
            AnyBackend::Null(b) => b.write_fua(lba, buf).await,
            AnyBackend::File(b) => b.write_fua(lba, buf).await,
            AnyBackend::Cached(b) => b.write_fua(lba, buf).await,
            AnyBackend::Pcie(b) => b.write_fua(lba, buf).await,
        }
    }

    async fn flush(&self) -> Result<(), BackendError> {
        match self {
            AnyBackend::Memory(b) => b.flush().await,
            AnyBackend::Null(b) => b.flush().await,
            AnyBackend::File(b) => b.flush().await,
            AnyBackend::Cached(b) => b.flush().await,
            AnyBackend::Pcie(b) => b.flush().await,
        }
    }

    async fn write_zeroes(&self, lba: u64, blocks: u64) -> Result<(), BackendError> {
        match self {
            AnyBackend::Memory(b) => b.write_zeroes(lba, blocks).await,
            AnyBackend::Null(b) => b.write_zeroes(lba, blocks).await,
            AnyBackend::File(b) => b.write_zeroes(lba, blocks).await,
            AnyBackend::Cached(b) => b.write_zeroes(lba, blocks).await,
            AnyBackend::Pcie(b) => b.write_zeroes(lba, blocks).await,
        }
    }

    async fn deallocate(&self, lba: u64, blocks: u64) -> Result<(), BackendError> {
        match self {
            AnyBackend::Memory(b) => b.deallocate(lba, blocks).await,
            AnyBackend::Null(b) => b.deallocate(lba, blocks).await,
            AnyBackend::File(b) => b.deallocate(lba, blocks).await,
            AnyBackend::Cached(b) => b.deallocate(lba, blocks).await,
            AnyBackend::Pcie(b) => b.deallocate(lba, blocks).await,
        }
    }
}

/// Opens the backend a spec names.
///
/// Memory and null backends are created at once. Files and devices are opened synchronously
/// (call this at start-up or from a blocking context); their I/O must then run inside a tokio
/// runtime.
pub fn open(spec: &BackendSpec) -> Result<AnyBackend, BackendError> {
    spec.validate()
        .map_err(|e| BackendError::Config(e.to_string()))?;
    match spec {
        BackendSpec::Memory { size, block_size } => {
            Ok(AnyBackend::Memory(MemoryBackend::new(*size, *block_size)?))
        }
        BackendSpec::Null { size, block_size } => {
            Ok(AnyBackend::Null(NullBackend::new(*size, *block_size)?))
        }
        BackendSpec::File(f) | BackendSpec::Bdev(f) => {
            let backend = FileBackend::open(f)?;
            if matches!(spec, BackendSpec::Bdev(_)) && !backend.is_block_device() {
                return Err(BackendError::Config(format!(
                    "{} is not a block device",
                    f.path.display()
                )));
            }
            match f.volatile_cache {
                Some(size) => Ok(AnyBackend::Cached(VolatileCache::new(backend, size)?)),
                None => Ok(AnyBackend::File(backend)),
            }
        }
        BackendSpec::Pcie { address, nsid } => {
            Ok(AnyBackend::Pcie(PcieBackend::open(address, *nsid)?))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn range_checks() {
        assert!(check_range(0, 10, 10).is_ok());
        assert!(check_range(9, 1, 10).is_ok());
        assert!(check_range(10, 0, 10).is_ok());
        assert!(matches!(
            check_range(9, 2, 10),
            Err(BackendError::OutOfRange {
                lba: 9,
                blocks: 2,
                capacity: 10
            })
        ));
        assert!(check_range(u64::MAX, 2, u64::MAX).is_err());
        assert_eq!(check_transfer(3, 1024, 512, 10).unwrap(), 1536);
        assert!(matches!(
            check_transfer(3, 0, 512, 10),
            Err(BackendError::InvalidLength { .. })
        ));
        assert!(matches!(
            check_transfer(3, 100, 512, 10),
            Err(BackendError::InvalidLength { .. })
        ));
        assert!(matches!(
            check_transfer(9, 1024, 512, 10),
            Err(BackendError::OutOfRange { .. })
        ));
    }

    fn assert_send_sync<T: Send + Sync>() {}
    fn assert_send<T: Send>(_: &T) {}

    #[test]
    fn futures_are_send() {
        assert_send_sync::<AnyBackend>();
        assert_send_sync::<IoBuf>();
        assert_send_sync::<BufPool>();
        let b = AnyBackend::Null(NullBackend::new(1 << 20, 512).unwrap());
        assert_send(&b.read(0, IoBuf::new(512)));
        assert_send(&b.write(0, IoBuf::new(512)));
        assert_send(&b.flush());
        assert_send(&b.write_zeroes(0, 1));
        assert_send(&b.deallocate(0, 1));
    }
}
