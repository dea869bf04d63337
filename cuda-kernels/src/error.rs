//! Errors of the kernel wrappers.

use gpu::GpuError;

/// Everything the kernel wrappers can reject or report.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KernelError {
    /// The GPU layer failed (no driver, no NVRTC, a CUDA error, ...).
    #[error(transparent)]
    Gpu(#[from] GpuError),
    /// A scatter copy reads outside the staging buffer.
    #[error(
        "copy {index}: source range at {offset} of {len} bytes exceeds the {size}-byte staging buffer"
    )]
    SourceOutOfBounds {
        /// Index of the copy.
        index: usize,
        /// Source offset.
        offset: u64,
        /// Length.
        len: u64,
        /// Staging buffer size.
        size: u64,
    },
    /// A scatter copy writes outside the destination buffer.
    #[error(
        "copy {index}: destination range at {offset} of {len} bytes exceeds the {size}-byte destination"
    )]
    DestinationOutOfBounds {
        /// Index of the copy.
        index: usize,
        /// Destination offset.
        offset: u64,
        /// Length.
        len: u64,
        /// Destination size.
        size: u64,
    },
    /// Two copies (or two fill regions) write the same bytes.
    #[error("items {first} and {second} write overlapping bytes")]
    OverlappingWrites {
        /// Index of one item.
        first: usize,
        /// Index of the other item.
        second: usize,
    },
    /// A pattern or checksum region lies outside the buffer.
    #[error("region {index}: range at {offset} of {len} bytes exceeds the {size}-byte buffer")]
    RegionOutOfBounds {
        /// Index of the region.
        index: usize,
        /// Offset in the buffer.
        offset: u64,
        /// Length.
        len: u64,
        /// Buffer size.
        size: u64,
    },
    /// A region's namespace offsets overflow 64 bits.
    #[error("region {index}: namespace offset {ns_offset} + {len} bytes overflows")]
    NamespaceOverflow {
        /// Index of the region.
        index: usize,
        /// Namespace offset.
        ns_offset: u64,
        /// Length.
        len: u64,
    },
    /// A ring push names a ring that is not in the set or whose memory is not on a GPU.
    #[error("ring {ring} is not a GPU ring of this set")]
    NotAGpuRing {
        /// The ring index.
        ring: u32,
    },
    /// Pinned memory the kernels were to read in place has no device address.
    #[error("pinned memory is not mapped into the device's address space")]
    NotMapped,
    /// A staged batch holds more copies than its stage has room for in the plan.
    #[error("{copies} copies exceed the stage's room for {room}")]
    StageFull {
        /// Copies in the batch.
        copies: usize,
        /// Copies the stage's plan room holds.
        room: usize,
    },
    /// A chunk scatter was given a different number of destination offsets than chunks.
    #[error("{chunks} chunks but {offsets} destination offsets")]
    ChunkCount {
        /// Chunks given.
        chunks: usize,
        /// Destination offsets given.
        offsets: usize,
    },
    /// A chunk scatter was given parts of more than one allocation (the kernel reads one).
    #[error("the chunks of one scatter must come from one allocation")]
    ChunksOfSeveralRegions,
    /// The number of chunks or the encoded work list does not fit in memory sizes.
    #[error("work list too large")]
    PlanTooLarge,
}
