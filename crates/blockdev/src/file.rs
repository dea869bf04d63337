//! File and block device backend.
//!
//! Opens the file or device with `O_DIRECT` (unless asked not to) and submits I/O through the
//! calling thread's io_uring ring (see the crate docs for the ring design). Two fallbacks keep
//! it usable everywhere, each announced by one warning:
//!
//! - A file system that refuses `O_DIRECT` (`EINVAL` at open, or `statx` reporting an
//!   alignment the block size does not meet) gets buffered I/O. Durability is unchanged: a
//!   flush is `fdatasync` either way.
//! - Where io_uring is unavailable (`ENOSYS`, `EPERM`), reads and writes become positional
//!   `pread`/`pwrite` calls on tokio's blocking thread pool.
//!
//! Flush is `fdatasync` (`IORING_OP_FSYNC` with `IORING_FSYNC_DATASYNC`). Write Zeroes uses
//! `fallocate(FALLOC_FL_ZERO_RANGE)`, then punching a hole, then writing zeros, remembering
//! what the file system refused. Deallocate punches a hole (`FALLOC_FL_PUNCH_HOLE |
//! FALLOC_FL_KEEP_SIZE`) and becomes a no-op where that is unsupported, since deallocation is
//! only a hint.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};

use crate::sys::{self, BackingFile, uring};
use crate::{
    Backend, BackendError, BufResult, DEFAULT_BLOCK_SIZE, FileSpec, IoBuf, IoEngine, IoOp,
    check_range, check_transfer, validate_block_size,
};

/// How a [`FileBackend`] actually submits I/O.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FileEngine {
    /// io_uring, one ring per thread.
    Uring,
    /// Positional reads and writes on tokio's blocking pool.
    Blocking,
}

/// Largest single read or write submitted; longer transfers are split.
const MAX_SUBMIT: usize = 1 << 30;
/// Size of the buffer used to write zeros where `fallocate` cannot zero.
const ZERO_BUF: usize = 1 << 20;
/// Retries of a transfer that failed with `EINTR` or `EAGAIN`.
const RETRIES: u32 = 3;

const ZERO_RANGE: u8 = 0;
const ZERO_PUNCH: u8 = 1;
const ZERO_WRITE: u8 = 2;

/// A regular file or a block device used as a namespace.
pub struct FileBackend {
    file: Arc<BackingFile>,
    path: PathBuf,
    block_size: u32,
    num_blocks: u64,
    engine: FileEngine,
    direct: bool,
    block_device: bool,
    zero_method: AtomicU8,
    punch_supported: AtomicBool,
}

impl std::fmt::Debug for FileBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileBackend")
            .field("path", &self.path)
            .field("block_size", &self.block_size)
            .field("num_blocks", &self.num_blocks)
            .field("engine", &self.engine)
            .field("direct", &self.direct)
            .field("block_device", &self.block_device)
            .finish()
    }
}

fn open_error(path: &Path, source: io::Error) -> BackendError {
    BackendError::Open {
        path: path.to_path_buf(),
        source,
    }
}

/// Opens a path with the given options; the flag says whether they include `O_DIRECT`.
type Opener<'a> = dyn Fn(&Path, &OpenOptions, bool) -> io::Result<File> + 'a;

/// Opens `path`, with `O_DIRECT` if `direct`, retrying without it when the file system answers
/// `EINVAL`. Returns the file and whether it is in direct mode.
fn open_with_fallback(
    path: &Path,
    create: bool,
    direct: bool,
    open: &Opener<'_>,
) -> Result<(File, bool), BackendError> {
    let mut options = OpenOptions::new();
    options.read(true).write(true).create(create);
    if direct {
        let mut direct_options = options.clone();
        direct_options.custom_flags(libc::O_DIRECT);
        match open(path, &direct_options, true) {
            Ok(file) => return Ok((file, true)),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                tracing::warn!(
                    path = %path.display(),
                    "O_DIRECT is not supported here; using buffered I/O (flush still calls fdatasync)"
                );
            }
            Err(e) => return Err(open_error(path, e)),
        }
    }
    let file = open(path, &options, false).map_err(|e| open_error(path, e))?;
    Ok((file, false))
}

/// Claims `file` for this backend alone: an exclusive `flock`, given up when the last
/// reference to the file is dropped ([`BackingFile`]), so a second namespace or a second daemon
/// on the same file or device is refused, naming the process that holds it. Returns whether
/// the file is claimed (not where the file system has no `flock`).
fn claim(file: &File, path: &Path) -> Result<bool, BackendError> {
    match sys::try_lock_exclusive(file) {
        Ok(()) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EWOULDBLOCK) => {
            let holder = file
                .metadata()
                .ok()
                .and_then(|m| lock_holder(std::os::unix::fs::MetadataExt::ino(&m)));
            let by = match holder {
                Some(pid) if pid == std::process::id() => {
                    "by this process (is it used by another namespace?)".to_string()
                }
                Some(pid) => {
                    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm"))
                        .map(|c| format!(" ({})", c.trim()))
                        .unwrap_or_default();
                    format!("by process {pid}{comm}")
                }
                None => "by another process".to_string(),
            };
            Err(BackendError::Config(format!(
                "{} is in use {by}: a file or device can back only one namespace",
                path.display()
            )))
        }
        // File systems without flock support cannot be claimed; the file is still usable.
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot lock; not claimed exclusively");
            Ok(false)
        }
    }
}

/// The process holding a `flock` on the inode `ino`, from `/proc/locks` (lines like
/// `1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF`).
fn lock_holder(ino: u64) -> Option<u32> {
    let locks = std::fs::read_to_string("/proc/locks").ok()?;
    locks.lines().find_map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        let (kind, pid, dev_ino) = (f.get(1)?, f.get(4)?, f.get(5)?);
        let lock_ino: u64 = dev_ino.rsplit(':').next()?.parse().ok()?;
        (*kind == "FLOCK" && lock_ino == ino).then(|| pid.parse().ok())?
    })
}

fn choose_engine(wanted: IoEngine) -> Result<FileEngine, BackendError> {
    choose_engine_given(wanted, uring::availability())
}

/// Picks the engine given whether io_uring is available.
fn choose_engine_given(
    wanted: IoEngine,
    availability: Result<(), &io::Error>,
) -> Result<FileEngine, BackendError> {
    match wanted {
        IoEngine::Blocking => Ok(FileEngine::Blocking),
        IoEngine::Uring => match availability {
            Ok(()) => Ok(FileEngine::Uring),
            Err(e) => Err(BackendError::Config(format!(
                "io_uring is unavailable: {e}"
            ))),
        },
        IoEngine::Auto => match availability {
            Ok(()) => Ok(FileEngine::Uring),
            Err(e) => {
                static WARNED: AtomicBool = AtomicBool::new(false);
                if !WARNED.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        error = %e,
                        "io_uring is unavailable; file I/O uses the blocking thread pool"
                    );
                }
                Ok(FileEngine::Blocking)
            }
        },
    }
}

impl FileBackend {
    /// Opens the file or block device a spec names.
    ///
    /// A regular file that is missing or empty is created / extended to `create_size` when
    /// that is given; otherwise its length is the capacity and must be a non-zero multiple of
    /// the block size (at least `create_size` when that is given: a larger file is served
    /// whole, with a warning, never cut off). Unless the spec says it is
    /// not [`exclusive`](FileSpec::exclusive), the file or device is claimed with an exclusive
    /// `flock` for as long as the backend lives; a second claim fails naming the holder. A block device's size and logical block size come from the
    /// `BLKGETSIZE64` and `BLKSSZGET` ioctls.
    pub fn open(spec: &FileSpec) -> Result<Self, BackendError> {
        Self::open_with(spec, &|path, options, _direct| options.open(path))
    }

    /// [`FileBackend::open`] with the `open` call replaceable, so tests can simulate file
    /// systems.
    fn open_with(spec: &FileSpec, open: &Opener<'_>) -> Result<Self, BackendError> {
        let path = spec.path.as_path();
        let engine = choose_engine(spec.engine)?;
        let create = spec.create_size.is_some();
        let (mut file, mut direct) = match open_with_fallback(path, create, spec.direct, open) {
            Err(BackendError::Open { source, .. })
                if !create
                    && source.kind() == io::ErrorKind::NotFound
                    && path.parent().is_some_and(|d| d.is_dir()) =>
            {
                return Err(BackendError::Config(format!(
                    "{} does not exist; add size=SIZE to create it (e.g. file:{},size=1G)",
                    path.display(),
                    path.display()
                )));
            }
            r => r?,
        };
        let mut claimed = spec.exclusive && claim(&file, path)?;
        let meta = file.metadata().map_err(|e| open_error(path, e))?;
        let file_type = meta.file_type();
        let block_device = file_type.is_block_device();
        let (size, block_size) = if block_device {
            let (size, lbs) = sys::block_device_geometry(&file).map_err(|e| open_error(path, e))?;
            if let Some(bs) = spec.block_size
                && bs != lbs
            {
                return Err(BackendError::Config(format!(
                    "{}: block size {bs} requested but the device's logical block size is {lbs}",
                    path.display()
                )));
            }
            (size, lbs)
        } else if file_type.is_file() {
            let bs = spec.block_size.unwrap_or(DEFAULT_BLOCK_SIZE);
            let mut size = meta.len();
            match spec.create_size {
                Some(create) if size == 0 => {
                    file.set_len(create).map_err(|e| open_error(path, e))?;
                    size = create;
                }
                // Larger than size= (grown while running, or by hand): its data is served,
                // never cut off.
                Some(wanted) if wanted < size => {
                    tracing::warn!(
                        path = %path.display(),
                        "the file is {} ({size} bytes), larger than size={}: serving all of \
                         it; raise size= to {size} to match",
                        crate::format_size(size),
                        crate::format_size(wanted),
                    );
                }
                Some(wanted) if wanted != size => {
                    return Err(BackendError::Config(format!(
                        "{p} is {} ({size} bytes) but size={} was given: grow the file \
                         (truncate -s {wanted} {p}) or drop size= to serve it as it is",
                        crate::format_size(size),
                        crate::format_size(wanted),
                        p = path.display()
                    )));
                }
                _ => {}
            }
            if direct && let Some(align) = sys::dio_align(&file) {
                let usable = align.offset != 0
                    && align.offset <= bs
                    && align.mem != 0
                    && align.mem as usize <= crate::IO_ALIGN;
                if !usable {
                    tracing::warn!(
                        path = %path.display(),
                        dio_offset_align = align.offset,
                        dio_mem_align = align.mem,
                        block_size = bs,
                        "O_DIRECT alignment does not fit the block size; using buffered I/O"
                    );
                    // The claim belongs to the descriptor being replaced: release it first.
                    drop(file);
                    (file, _) = open_with_fallback(path, false, false, open)?;
                    claimed = spec.exclusive && claim(&file, path)?;
                    direct = false;
                }
            }
            (size, bs)
        } else {
            return Err(BackendError::Config(format!(
                "{} is neither a regular file nor a block device",
                path.display()
            )));
        };
        validate_block_size(block_size).map_err(|e| BackendError::Config(e.to_string()))?;
        if size == 0 || size % u64::from(block_size) != 0 {
            return Err(BackendError::Config(format!(
                "{}: size {size} is not a non-zero multiple of the block size {block_size}{}",
                path.display(),
                if size == 0 && !block_device {
                    " (give size= to create it)"
                } else {
                    ""
                }
            )));
        }
        Ok(FileBackend {
            file: Arc::new(BackingFile::new(file, claimed)),
            path: path.to_path_buf(),
            block_size,
            num_blocks: size / u64::from(block_size),
            engine,
            direct,
            block_device,
            zero_method: AtomicU8::new(ZERO_RANGE),
            punch_supported: AtomicBool::new(true),
        })
    }

    /// The same regular file grown to `size` bytes, sharing this backend's descriptor (and
    /// so its `flock` claim). Refuses block devices, sizes that are not a multiple of the block
    /// size, and shrinking, which would discard the data at the end.
    pub fn grown(&self, size: u64) -> Result<Self, BackendError> {
        let current = self.num_blocks * u64::from(self.block_size);
        let refuse = |why: String| {
            Err(BackendError::Config(format!(
                "{}: {why}",
                self.path.display()
            )))
        };
        if self.block_device {
            return refuse("a block device's size is the device's own".into());
        }
        if size == 0 || size % u64::from(self.block_size) != 0 {
            return refuse(format!(
                "size {size} is not a non-zero multiple of the block size {}",
                self.block_size
            ));
        }
        if size < current {
            return refuse(format!(
                "shrinking from {} to {} would discard data; only growing is supported",
                crate::format_size(current),
                crate::format_size(size)
            ));
        }
        self.file
            .set_len(size)
            .map_err(|e| open_error(&self.path, e))?;
        Ok(FileBackend {
            file: Arc::clone(&self.file),
            path: self.path.clone(),
            block_size: self.block_size,
            num_blocks: size / u64::from(self.block_size),
            engine: self.engine,
            direct: self.direct,
            block_device: false,
            zero_method: AtomicU8::new(self.zero_method.load(Ordering::Relaxed)),
            punch_supported: AtomicBool::new(self.punch_supported.load(Ordering::Relaxed)),
        })
    }

    /// The path it was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The engine in use.
    pub fn engine(&self) -> FileEngine {
        self.engine
    }

    /// Whether the file is open with `O_DIRECT`.
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// Whether this is a block device rather than a regular file.
    pub fn is_block_device(&self) -> bool {
        self.block_device
    }

    /// Reads or writes `buf` at byte `offset`; a write with `dsync` completes only once its
    /// data is durable.
    async fn transfer(&self, op: IoOp, offset: u64, mut buf: IoBuf, dsync: bool) -> BufResult {
        let total = buf.len();
        let mut done = 0usize;
        let mut retries = 0;
        while done < total {
            let len = (total - done).min(MAX_SUBMIT);
            let pos = offset + done as u64;
            let (res, back) = match self.engine {
                FileEngine::Uring => self.uring_transfer(op, pos, buf, done, len, dsync).await,
                FileEngine::Blocking => {
                    self.blocking_transfer(op, pos, buf, done, len, dsync).await
                }
            };
            buf = back;
            match res {
                Ok(0) => {
                    let kind = if op == IoOp::Read {
                        io::ErrorKind::UnexpectedEof
                    } else {
                        io::ErrorKind::WriteZero
                    };
                    return (Err(BackendError::io(op, kind.into())), buf);
                }
                Ok(n) => {
                    done += n;
                    retries = 0;
                }
                Err(e)
                    if retries < RETRIES
                        && matches!(e.raw_os_error(), Some(libc::EINTR) | Some(libc::EAGAIN)) =>
                {
                    retries += 1;
                }
                Err(e) => return (Err(e), buf),
            }
        }
        (Ok(()), buf)
    }

    async fn uring_transfer(
        &self,
        op: IoOp,
        pos: u64,
        buf: IoBuf,
        start: usize,
        len: usize,
        dsync: bool,
    ) -> (Result<usize, BackendError>, IoBuf) {
        let len_before = buf.len();
        let submitted = match op {
            IoOp::Read => uring::read_at(&self.file, pos, buf, start, len as u32),
            _ => uring::write_at(&self.file, pos, buf, start, len as u32, dsync),
        };
        let (res, back) = match submitted {
            Ok(fut) => fut.await,
            Err((e, back)) => {
                let buf = back.unwrap_or_else(|| IoBuf::new(len_before));
                return (Err(ring_error(op, e)), buf);
            }
        };
        // The buffer is always handed back unless the ring could not wait for the kernel and
        // had to keep it; the caller still gets a buffer of the same length.
        let buf = back.unwrap_or_else(|| IoBuf::new(len_before));
        if res < 0 {
            (Err(BackendError::errno(op, res)), buf)
        } else {
            (Ok(res as usize), buf)
        }
    }

    async fn blocking_transfer(
        &self,
        op: IoOp,
        pos: u64,
        buf: IoBuf,
        start: usize,
        len: usize,
        dsync: bool,
    ) -> (Result<usize, BackendError>, IoBuf) {
        let total = buf.len();
        let handle = match tokio::runtime::Handle::try_current() {
            Ok(h) => h,
            Err(_) => return (Err(BackendError::NoRuntime), buf),
        };
        let file = self.file.clone();
        let task = handle.spawn_blocking(move || {
            let mut buf = buf;
            let range = start..start + len;
            let res = match op {
                IoOp::Read => file.read_at(&mut buf[range], pos),
                _ => file.write_at(&buf[range], pos).and_then(|n| {
                    if dsync {
                        file.sync_data()?;
                    }
                    Ok(n)
                }),
            };
            (res, buf)
        });
        match task.await {
            Ok((res, buf)) => (res.map_err(|e| BackendError::io(op, e)), buf),
            Err(e) => (
                Err(BackendError::io(op, io::Error::other(e))),
                IoBuf::new(total),
            ),
        }
    }

    /// Runs `fallocate` through the engine.
    async fn fallocate(
        &self,
        op: IoOp,
        mode: i32,
        offset: u64,
        len: u64,
    ) -> Result<(), BackendError> {
        match self.engine {
            FileEngine::Uring => {
                let fut = uring::fallocate(&self.file, mode, offset, len)
                    .map_err(|(e, _)| ring_error(op, e))?;
                let (res, _) = fut.await;
                if res < 0 {
                    Err(BackendError::errno(op, res))
                } else {
                    Ok(())
                }
            }
            FileEngine::Blocking => {
                let file = self.file.clone();
                self.run_blocking(op, move || sys::fallocate(&file, mode, offset, len))
                    .await
            }
        }
    }

    async fn run_blocking(
        &self,
        op: IoOp,
        f: impl FnOnce() -> io::Result<()> + Send + 'static,
    ) -> Result<(), BackendError> {
        let handle = tokio::runtime::Handle::try_current().map_err(|_| BackendError::NoRuntime)?;
        match handle.spawn_blocking(f).await {
            Ok(res) => res.map_err(|e| BackendError::io(op, e)),
            Err(e) => Err(BackendError::io(op, io::Error::other(e))),
        }
    }

    async fn write_zeros_by_writing(&self, offset: u64, len: u64) -> Result<(), BackendError> {
        let chunk = (len.min(ZERO_BUF as u64)) as usize;
        let mut buf = IoBuf::new(chunk);
        let mut done = 0u64;
        while done < len {
            let n = (len - done).min(chunk as u64) as usize;
            if buf.set_len(n).is_err() {
                buf = IoBuf::new(n);
            }
            let (res, back) = self
                .transfer(IoOp::WriteZeroes, offset + done, buf, false)
                .await;
            res?;
            buf = back;
            done += n as u64;
        }
        Ok(())
    }
}

fn ring_error(op: IoOp, e: uring::RingError) -> BackendError {
    match e {
        uring::RingError::NoRuntime => BackendError::NoRuntime,
        uring::RingError::Io(e) => BackendError::io(op, e),
    }
}

/// Errors meaning "this fallocate mode is not available here".
fn unsupported(e: &BackendError) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EOPNOTSUPP | libc::EINVAL | libc::ENOSYS | libc::ENOTTY)
    )
}

impl Backend for FileBackend {
    fn block_size(&self) -> u32 {
        self.block_size
    }

    fn num_blocks(&self) -> u64 {
        self.num_blocks
    }

    fn volatile_write_cache(&self) -> bool {
        true
    }

    fn deallocate_reads_zeroes(&self) -> bool {
        false
    }

    async fn read(&self, lba: u64, buf: IoBuf) -> BufResult {
        match check_transfer(lba, buf.len(), self.block_size, self.num_blocks) {
            Ok(offset) => self.transfer(IoOp::Read, offset, buf, false).await,
            Err(e) => (Err(e), buf),
        }
    }

    async fn write(&self, lba: u64, buf: IoBuf) -> BufResult {
        match check_transfer(lba, buf.len(), self.block_size, self.num_blocks) {
            Ok(offset) => self.transfer(IoOp::Write, offset, buf, false).await,
            Err(e) => (Err(e), buf),
        }
    }

    /// A write with `RWF_DSYNC` through io_uring (one operation per write; measured against
    /// a write followed by `fdatasync` in BENCHMARKS.md), or `pwrite` then `fdatasync` on the
    /// blocking pool.
    async fn write_fua(&self, lba: u64, buf: IoBuf) -> BufResult {
        match check_transfer(lba, buf.len(), self.block_size, self.num_blocks) {
            Ok(offset) => self.transfer(IoOp::Write, offset, buf, true).await,
            Err(e) => (Err(e), buf),
        }
    }

    async fn flush(&self) -> Result<(), BackendError> {
        match self.engine {
            FileEngine::Uring => {
                let fut =
                    uring::fdatasync(&self.file).map_err(|(e, _)| ring_error(IoOp::Flush, e))?;
                let (res, _) = fut.await;
                if res < 0 {
                    Err(BackendError::errno(IoOp::Flush, res))
                } else {
                    Ok(())
                }
            }
            FileEngine::Blocking => {
                let file = self.file.clone();
                self.run_blocking(IoOp::Flush, move || file.sync_data())
                    .await
            }
        }
    }

    async fn write_zeroes(&self, lba: u64, blocks: u64) -> Result<(), BackendError> {
        check_range(lba, blocks, self.num_blocks)?;
        if blocks == 0 {
            return Ok(());
        }
        let bs = u64::from(self.block_size);
        let (offset, len) = (lba * bs, blocks * bs);
        loop {
            let method = self.zero_method.load(Ordering::Relaxed);
            let mode = match method {
                ZERO_RANGE => libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE,
                ZERO_PUNCH => libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                _ => return self.write_zeros_by_writing(offset, len).await,
            };
            match self.fallocate(IoOp::WriteZeroes, mode, offset, len).await {
                Ok(()) => return Ok(()),
                Err(e) if unsupported(&e) => {
                    tracing::debug!(
                        path = %self.path.display(),
                        error = %e,
                        "fallocate mode unsupported for write zeroes; trying the next method"
                    );
                    let next = if method == ZERO_RANGE {
                        ZERO_PUNCH
                    } else {
                        ZERO_WRITE
                    };
                    self.zero_method.store(next, Ordering::Relaxed);
                }
                Err(e) => return Err(e),
            }
        }
    }

    async fn deallocate(&self, lba: u64, blocks: u64) -> Result<(), BackendError> {
        check_range(lba, blocks, self.num_blocks)?;
        if blocks == 0 || !self.punch_supported.load(Ordering::Relaxed) {
            return Ok(());
        }
        let bs = u64::from(self.block_size);
        let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
        match self
            .fallocate(IoOp::Deallocate, mode, lba * bs, blocks * bs)
            .await
        {
            Err(e) if unsupported(&e) => {
                tracing::debug!(
                    path = %self.path.display(),
                    error = %e,
                    "hole punching unsupported; deallocate is a no-op"
                );
                self.punch_supported.store(false, Ordering::Relaxed);
                Ok(())
            }
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(path: &Path, size: u64) -> FileSpec {
        FileSpec {
            create_size: Some(size),
            ..FileSpec::new(path)
        }
    }

    #[test]
    fn einval_on_direct_open_falls_back_to_buffered() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ns.img");
        let attempts = std::sync::Mutex::new(Vec::new());
        // Simulates a file system without O_DIRECT: a direct open fails with EINVAL, as
        // open(2) does there.
        let open = |p: &Path, o: &OpenOptions, direct: bool| -> io::Result<File> {
            attempts.lock().unwrap().push(direct);
            if direct {
                Err(io::Error::from_raw_os_error(libc::EINVAL))
            } else {
                o.open(p)
            }
        };
        let backend = FileBackend::open_with(&spec(&path, 1 << 20), &open).unwrap();
        assert!(!backend.is_direct());
        assert_eq!(*attempts.lock().unwrap(), vec![true, false]);
        assert_eq!(backend.num_blocks(), 256);
    }

    #[test]
    fn engine_choice_falls_back_when_io_uring_is_unavailable() {
        let enosys = io::Error::from_raw_os_error(libc::ENOSYS);
        let eperm = io::Error::from_raw_os_error(libc::EPERM);
        assert_eq!(
            choose_engine_given(IoEngine::Auto, Ok(())).unwrap(),
            FileEngine::Uring
        );
        assert_eq!(
            choose_engine_given(IoEngine::Auto, Err(&enosys)).unwrap(),
            FileEngine::Blocking
        );
        assert_eq!(
            choose_engine_given(IoEngine::Auto, Err(&eperm)).unwrap(),
            FileEngine::Blocking
        );
        assert!(matches!(
            choose_engine_given(IoEngine::Uring, Err(&eperm)),
            Err(BackendError::Config(_))
        ));
        assert_eq!(
            choose_engine_given(IoEngine::Blocking, Ok(())).unwrap(),
            FileEngine::Blocking
        );
        // This machine's kernel has io_uring.
        assert!(uring::availability().is_ok());
    }

    #[test]
    fn growing_keeps_the_claim_and_shrinking_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ns.img");
        let small = FileBackend::open(&spec(&path, 1 << 20)).unwrap();
        let big = small.grown(2 << 20).unwrap();
        assert_eq!(big.num_blocks(), 512);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 2 << 20);
        // The claim is shared, not taken twice; a new open still fails while either lives.
        drop(small);
        assert!(FileBackend::open(&FileSpec::new(&path)).is_err());
        let e = big.grown(1 << 20).unwrap_err().to_string();
        assert!(e.contains("would discard data"), "{e}");
        assert!(big.grown(3 << 20 | 1).is_err());
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 2 << 20);
    }

    #[test]
    fn a_size_above_the_file_is_refused_and_one_below_serves_the_whole_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ns.img");
        std::fs::File::create(&path)
            .unwrap()
            .set_len(100 << 20)
            .unwrap();
        let err = FileBackend::open(&spec(&path, 256 << 20))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("is 100M (104857600 bytes) but size=256M"),
            "{err}"
        );
        assert!(err.contains("truncate -s 268435456"), "{err}");
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 100 << 20);
        // The same size, a smaller one, or none, serves the file as it is: data is never
        // cut off.
        assert_eq!(
            FileBackend::open(&spec(&path, 1 << 20))
                .unwrap()
                .num_blocks(),
            25600
        );
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 100 << 20);
        assert_eq!(
            FileBackend::open(&spec(&path, 100 << 20))
                .unwrap()
                .num_blocks(),
            25600
        );
        assert_eq!(
            FileBackend::open(&FileSpec::new(&path))
                .unwrap()
                .num_blocks(),
            25600
        );
    }

    #[test]
    fn a_file_backs_one_namespace_at_a_time() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ns.img");
        let first = FileBackend::open(&spec(&path, 1 << 20)).unwrap();
        let err = FileBackend::open(&FileSpec::new(&path))
            .unwrap_err()
            .to_string();
        assert!(err.contains("is in use by this process"), "{err}");
        // A program that means to share the file says so.
        FileBackend::open(&FileSpec {
            exclusive: false,
            ..FileSpec::new(&path)
        })
        .unwrap();
        drop(first);
        FileBackend::open(&FileSpec::new(&path)).unwrap();
    }

    /// The claim goes with the last backend using the file, even while the open file
    /// description lives on: the kernel may hold it a moment longer (an io_uring request lets
    /// go of its file after posting its completion), which a second descriptor of it stands in
    /// for here.
    #[test]
    fn the_claim_goes_with_the_last_backend_using_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ns.img");
        let first = FileBackend::open(&spec(&path, 1 << 20)).unwrap();
        let grown = first.grown(2 << 20).unwrap();
        let description = first.file.try_clone().unwrap();
        drop(first);
        let err = FileBackend::open(&FileSpec::new(&path))
            .unwrap_err()
            .to_string();
        assert!(err.contains("is in use by this process"), "{err}");
        drop(grown);
        FileBackend::open(&FileSpec::new(&path)).unwrap();
        drop(description);
    }

    #[test]
    fn a_missing_file_without_a_size_names_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("missing.img");
        let err = FileBackend::open(&FileSpec::new(&path))
            .unwrap_err()
            .to_string();
        assert!(err.contains("does not exist; add size=SIZE"), "{err}");
        assert!(!path.exists());
    }

    #[test]
    fn other_open_errors_are_reported() {
        let err = FileBackend::open(&FileSpec::new("/nonexistent/dir/ns.img")).unwrap_err();
        match err {
            BackendError::Open { source, .. } => {
                assert_eq!(source.kind(), io::ErrorKind::NotFound)
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    use std::future::Future;
    use std::pin::Pin;
    use std::task::Poll;
    use std::time::{Duration, Instant};

    use crate::sys::uring::test_support::in_flight_on_current_ring;

    fn current_thread() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    fn pattern(tag: u8, len: usize) -> IoBuf {
        let mut buf = IoBuf::new(len);
        for (i, b) in buf.iter_mut().enumerate() {
            *b = tag ^ (i % 251) as u8;
        }
        buf
    }

    /// Polls a future exactly once.
    async fn poll_once<F: Future>(fut: &mut Pin<Box<F>>) -> Poll<F::Output> {
        std::future::poll_fn(|cx| Poll::Ready(fut.as_mut().poll(cx))).await
    }

    async fn wait_idle() {
        let deadline = Instant::now() + Duration::from_secs(20);
        while in_flight_on_current_ring().unwrap_or(0) > 0 {
            assert!(Instant::now() < deadline, "I/O still in flight");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    const REGION: usize = 256 * 1024;

    #[test]
    fn dropped_write_futures_still_write_their_buffers() {
        let dir = tempfile::tempdir().unwrap();
        let backend = FileBackend::open(&spec(&dir.path().join("ns.img"), 16 << 20)).unwrap();
        assert_eq!(backend.engine(), FileEngine::Uring);
        let bs = backend.block_size() as usize;
        current_thread().block_on(async {
            let mut pending = Vec::new();
            for i in 0..32u8 {
                let lba = (i as usize * REGION / bs) as u64;
                let mut fut = Box::pin(backend.write(lba, pattern(i, REGION)));
                assert!(poll_once(&mut fut).await.is_pending());
                pending.push(fut);
            }
            assert!(in_flight_on_current_ring().unwrap() >= 32);
            // Dropped before the driver even submitted them.
            drop(pending);
            // Churn the allocator: freed buffers would be reused and overwritten here.
            let churn: Vec<IoBuf> = (0..64).map(|_| pattern(0xEE, REGION)).collect();
            wait_idle().await;
            drop(churn);
            for i in 0..32u8 {
                let lba = (i as usize * REGION / bs) as u64;
                let (res, buf) = backend.read(lba, IoBuf::new(REGION)).await;
                res.unwrap();
                assert!(buf[..] == pattern(i, REGION)[..], "region {i} corrupted");
            }
        });
    }

    #[test]
    fn dropped_read_futures_are_released() {
        let dir = tempfile::tempdir().unwrap();
        let backend = FileBackend::open(&spec(&dir.path().join("ns.img"), 8 << 20)).unwrap();
        current_thread().block_on(async {
            let (res, _) = backend.write(0, pattern(7, 8 << 20)).await;
            res.unwrap();
            for round in 0..4 {
                let mut pending = Vec::new();
                for i in 0..64u64 {
                    let mut fut = Box::pin(backend.read(i * 8 % 2048, IoBuf::new(32 * 1024)));
                    assert!(poll_once(&mut fut).await.is_pending());
                    pending.push(fut);
                }
                if round % 2 == 1 {
                    // Let the driver submit first this time.
                    tokio::task::yield_now().await;
                }
                drop(pending);
                wait_idle().await;
            }
            let (res, buf) = backend.read(0, IoBuf::new(8 << 20)).await;
            res.unwrap();
            assert!(buf[..] == pattern(7, 8 << 20)[..]);
        });
    }

    #[test]
    fn runtime_shutdown_with_io_in_flight() {
        let dir = tempfile::tempdir().unwrap();
        let backend =
            Arc::new(FileBackend::open(&spec(&dir.path().join("ns.img"), 8 << 20)).unwrap());
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        for t in 0..8u64 {
            let backend = backend.clone();
            rt.spawn(async move {
                // Runs until the runtime drops it, or refuses new I/O while shutting down.
                loop {
                    let (res, _) = backend.read(t * 64, IoBuf::new(64 * 1024)).await;
                    if res.is_err() {
                        break;
                    }
                    let (res, _) = backend.write(t * 64, pattern(t as u8, 64 * 1024)).await;
                    if res.is_err() {
                        break;
                    }
                }
            });
        }
        std::thread::sleep(Duration::from_millis(50));
        drop(rt);
        // The backend still works in a new runtime.
        current_thread().block_on(async {
            let (res, buf) = backend.write(0, pattern(9, 4096)).await;
            res.unwrap();
            let (res, back) = backend.read(0, IoBuf::new(4096)).await;
            res.unwrap();
            assert!(back[..] == buf[..]);
        });
    }

    #[test]
    fn operation_outliving_its_runtime_completes() {
        let dir = tempfile::tempdir().unwrap();
        let backend = FileBackend::open(&spec(&dir.path().join("ns.img"), 1 << 20)).unwrap();
        current_thread().block_on(async {
            let (res, _) = backend.write(0, pattern(3, 1 << 20)).await;
            res.unwrap();
        });
        let rt1 = current_thread();
        let mut fut = Box::pin(backend.read(0, IoBuf::new(1 << 20)));
        rt1.block_on(async {
            assert!(poll_once(&mut fut).await.is_pending());
        });
        // The driver of the ring the read went to is gone with its runtime.
        drop(rt1);
        let (res, buf) = current_thread().block_on(fut);
        res.unwrap();
        assert!(buf[..] == pattern(3, 1 << 20)[..]);
    }

    #[test]
    fn outside_a_runtime_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let backend = FileBackend::open(&spec(&dir.path().join("ns.img"), 1 << 20)).unwrap();
        // A minimal executor that is not tokio.
        let waker = std::task::Waker::noop();
        let mut cx = std::task::Context::from_waker(waker);
        let mut fut = Box::pin(backend.read(0, IoBuf::new(4096)));
        match fut.as_mut().poll(&mut cx) {
            Poll::Ready((Err(BackendError::NoRuntime), buf)) => assert_eq!(buf.len(), 4096),
            other => panic!("unexpected {:?}", other.map(|(r, _)| r)),
        }
    }

    #[test]
    fn tmpfs_write_zeroes_falls_back_to_punching_holes() {
        let Ok(dir) = tempfile::tempdir_in("/dev/shm") else {
            eprintln!("no /dev/shm here; skipped");
            return;
        };
        let backend = FileBackend::open(&spec(&dir.path().join("ns.img"), 1 << 20)).unwrap();
        current_thread().block_on(async {
            let (res, _) = backend.write(0, pattern(5, 1 << 20)).await;
            res.unwrap();
            backend.write_zeroes(1, 2).await.unwrap();
            // tmpfs refuses FALLOC_FL_ZERO_RANGE but punches holes.
            assert_eq!(backend.zero_method.load(Ordering::Relaxed), ZERO_PUNCH);
            let (res, buf) = backend.read(0, IoBuf::new(4 * 4096)).await;
            res.unwrap();
            let expect = pattern(5, 1 << 20);
            assert!(buf[..4096] == expect[..4096]);
            assert!(buf[4096..3 * 4096].iter().all(|&b| b == 0));
            assert!(buf[3 * 4096..] == expect[3 * 4096..4 * 4096]);
        });
    }

    #[test]
    fn write_zeroes_by_writing_when_fallocate_cannot() {
        let dir = tempfile::tempdir().unwrap();
        let backend = FileBackend::open(&spec(&dir.path().join("ns.img"), 4 << 20)).unwrap();
        // As if the file system had refused both fallocate modes.
        backend.zero_method.store(ZERO_WRITE, Ordering::Relaxed);
        current_thread().block_on(async {
            let (res, _) = backend.write(0, pattern(6, 4 << 20)).await;
            res.unwrap();
            // Longer than the zero buffer, so it takes several writes.
            let blocks = (ZERO_BUF as u64 * 2 + 8192) / 4096;
            backend.write_zeroes(1, blocks).await.unwrap();
            let (res, buf) = backend.read(0, IoBuf::new(4 << 20)).await;
            res.unwrap();
            let expect = pattern(6, 4 << 20);
            let end = (1 + blocks as usize) * 4096;
            assert!(buf[..4096] == expect[..4096]);
            assert!(buf[4096..end].iter().all(|&b| b == 0));
            assert!(buf[end..] == expect[end..]);
        });
    }
}
