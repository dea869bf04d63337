//! Typed errors.

use nvme_spec::Status;

/// A failure reported by the device layer (VFIO or a model).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("device: {0}")]
pub struct DeviceError(pub String);

/// Errors of the driver.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// A configuration value is out of range.
    #[error("invalid configuration: {0}")]
    InvalidConfig(&'static str),
    /// The device layer failed.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// The controller does not support what the driver needs.
    #[error("unsupported controller: {0}")]
    Unsupported(&'static str),
    /// CSTS.RDY did not reach the expected value in time.
    #[error("controller did not become {} within {ms} ms", if *.ready { "ready" } else { "not ready" })]
    ReadyTimeout {
        /// The awaited RDY value.
        ready: bool,
        /// How long the driver waited.
        ms: u64,
    },
    /// The controller reported a fatal status (CSTS.CFS) or vanished (all-ones reads).
    #[error("controller failed (CSTS.CFS set or device gone)")]
    ControllerFailed,
    /// The controller was reset; commands outstanding on the old queues were dropped.
    #[error("controller was reset; the queue must be created again")]
    Reset,
    /// A command completed with an error status.
    #[error("command failed: {0}")]
    Status(Status),
    /// An admin command got no completion in time.
    #[error("admin command {opcode:#04x} timed out")]
    AdminTimeout {
        /// The command's opcode.
        opcode: u8,
    },
    /// The queue has no free command slot; poll for completions first.
    #[error("queue full")]
    QueueFull,
    /// No more I/O queues are available on this controller.
    #[error("no I/O queue left (the controller granted {0})")]
    NoQueues(u16),
    /// The transfer is longer than the controller accepts (MDTS) or the buffer.
    #[error("transfer of {len} bytes exceeds the limit of {max}")]
    TooLarge {
        /// Requested bytes.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// A buffer does not meet the alignment the transfer needs.
    #[error("buffer must be 4-byte aligned and a whole number of blocks")]
    Misaligned,
    /// The namespace is not active on this controller.
    #[error("namespace {0} is not active")]
    NoNamespace(u32),
    /// An access outside a buffer.
    #[error("access outside the buffer")]
    OutOfBounds,
    /// The arena has no room left.
    #[error("DMA arena exhausted")]
    OutOfDmaMemory,
}
