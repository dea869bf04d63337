//! Errors of the backends and the NVMe status each one should become.

use std::fmt;
use std::io;
use std::path::PathBuf;

/// The kind of operation that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IoOp {
    /// A read.
    Read,
    /// A write.
    Write,
    /// A flush of the volatile write cache.
    Flush,
    /// Write Zeroes.
    WriteZeroes,
    /// Deallocate (Dataset Management discard).
    Deallocate,
}

impl fmt::Display for IoOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            IoOp::Read => "read",
            IoOp::Write => "write",
            IoOp::Flush => "flush",
            IoOp::WriteZeroes => "write zeroes",
            IoOp::Deallocate => "deallocate",
        })
    }
}

/// An error from opening a backend or from one of its operations.
///
/// The target turns each error into an NVMe completion status through
/// [`BackendError::status_hint`], which is the single place that decides the mapping intent.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The LBA range does not fit in the namespace (or overflows).
    #[error("LBA range {lba}+{blocks} is outside the namespace of {capacity} blocks")]
    OutOfRange {
        /// First block of the request.
        lba: u64,
        /// Number of blocks requested.
        blocks: u64,
        /// Capacity of the backend in blocks.
        capacity: u64,
    },
    /// The buffer length is zero or not a multiple of the block size.
    #[error("transfer length {len} is not a non-zero multiple of the block size {block_size}")]
    InvalidLength {
        /// The buffer length in bytes.
        len: usize,
        /// The backend's block size.
        block_size: u32,
    },
    /// The operating system reported an error for an operation.
    #[error("{op} failed: {source}")]
    Io {
        /// The operation that failed.
        op: IoOp,
        /// The error, with its errno in `raw_os_error()` where there is one.
        #[source]
        source: io::Error,
    },
    /// A file backend operation was started outside a tokio runtime.
    #[error("file backend I/O must run inside a tokio runtime")]
    NoRuntime,
    /// A file or block device could not be opened or inspected.
    #[error("cannot open {path}: {source}")]
    Open {
        /// The path given.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The backend's configuration is unusable (sizes, block size, file type).
    #[error("invalid backend configuration: {0}")]
    Config(String),
    /// The NVMe PCIe driver failed a command (a status from the controller, a reset, a failed
    /// controller, a timeout).
    #[error("{op} failed: {source}")]
    Nvme {
        /// The operation.
        op: IoOp,
        /// The driver's error.
        source: nvme_pcie::Error,
    },
}

/// The NVMe completion status a [`BackendError`] is meant to produce.
///
/// The values in the variant docs are the NVMe Base Specification's Status Code Type (SCT) and
/// Status Code (SC).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StatusHint {
    /// Generic (SCT 0h), LBA Out of Range (SC 80h).
    LbaOutOfRange,
    /// Generic (SCT 0h), Invalid Field in Command (SC 02h).
    InvalidField,
    /// Generic (SCT 0h), Capacity Exceeded (SC 81h): `ENOSPC`, `EDQUOT`.
    CapacityExceeded,
    /// Generic (SCT 0h), Namespace is Write Protected (SC 20h): `EROFS`.
    WriteProtected,
    /// Media and Data Integrity Errors (SCT 2h), Write Fault (SC 80h): `EIO` and similar on a
    /// write, flush, write zeroes or deallocate.
    WriteFault,
    /// Media and Data Integrity Errors (SCT 2h), Unrecovered Read Error (SC 81h): `EIO` and
    /// similar on a read.
    UnrecoveredReadError,
    /// Generic (SCT 0h), Internal Error (SC 06h): everything else.
    InternalError,
}

impl BackendError {
    /// Wraps an OS error from operation `op`.
    pub fn io(op: IoOp, source: io::Error) -> Self {
        BackendError::Io { op, source }
    }

    /// Builds an OS error from a negative or positive errno value.
    pub(crate) fn errno(op: IoOp, errno: i32) -> Self {
        BackendError::Io {
            op,
            source: io::Error::from_raw_os_error(errno.abs()),
        }
    }

    /// The errno of an OS error, if this is one.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            BackendError::Io { source, .. } | BackendError::Open { source, .. } => {
                source.raw_os_error()
            }
            _ => None,
        }
    }

    /// The NVMe status this error should be reported as.
    pub fn status_hint(&self) -> StatusHint {
        match self {
            BackendError::OutOfRange { .. } => StatusHint::LbaOutOfRange,
            BackendError::InvalidLength { .. } => StatusHint::InvalidField,
            BackendError::Io { op, source } => match source.raw_os_error() {
                Some(libc::ENOSPC | libc::EDQUOT) => StatusHint::CapacityExceeded,
                Some(libc::EROFS) => StatusHint::WriteProtected,
                Some(libc::EIO | libc::EILSEQ | libc::EBADMSG | libc::ENODATA | libc::EUCLEAN) => {
                    match op {
                        IoOp::Read => StatusHint::UnrecoveredReadError,
                        _ => StatusHint::WriteFault,
                    }
                }
                _ if source.kind() == io::ErrorKind::UnexpectedEof => match op {
                    IoOp::Read => StatusHint::UnrecoveredReadError,
                    _ => StatusHint::WriteFault,
                },
                _ => StatusHint::InternalError,
            },
            // Media errors the controller reports keep their meaning; anything else (a reset,
            // a failed controller, a timeout) is an internal error of this target.
            BackendError::Nvme {
                op,
                source: nvme_pcie::Error::Status(s),
            } if s.sct == nvme_spec::status::sct::MEDIA => match op {
                IoOp::Read => StatusHint::UnrecoveredReadError,
                _ => StatusHint::WriteFault,
            },
            BackendError::NoRuntime
            | BackendError::Open { .. }
            | BackendError::Config(_)
            | BackendError::Nvme { .. } => StatusHint::InternalError,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_mapping() {
        let oor = BackendError::OutOfRange {
            lba: 10,
            blocks: 2,
            capacity: 11,
        };
        assert_eq!(oor.status_hint(), StatusHint::LbaOutOfRange);
        assert_eq!(oor.raw_os_error(), None);
        assert_eq!(
            BackendError::errno(IoOp::Read, -libc::EIO).status_hint(),
            StatusHint::UnrecoveredReadError
        );
        assert_eq!(
            BackendError::errno(IoOp::Write, libc::EIO).status_hint(),
            StatusHint::WriteFault
        );
        assert_eq!(
            BackendError::errno(IoOp::Flush, libc::EIO).status_hint(),
            StatusHint::WriteFault
        );
        assert_eq!(
            BackendError::errno(IoOp::Write, libc::ENOSPC).status_hint(),
            StatusHint::CapacityExceeded
        );
        assert_eq!(
            BackendError::errno(IoOp::Write, libc::EROFS).status_hint(),
            StatusHint::WriteProtected
        );
        assert_eq!(
            BackendError::errno(IoOp::Read, libc::EBADF).status_hint(),
            StatusHint::InternalError
        );
        assert_eq!(
            BackendError::errno(IoOp::Read, -libc::EIO).raw_os_error(),
            Some(libc::EIO)
        );
        let eof = BackendError::io(IoOp::Read, io::ErrorKind::UnexpectedEof.into());
        assert_eq!(eof.status_hint(), StatusHint::UnrecoveredReadError);
        assert_eq!(
            BackendError::InvalidLength {
                len: 3,
                block_size: 512
            }
            .status_hint(),
            StatusHint::InvalidField
        );
    }
}
