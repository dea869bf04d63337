//! Work lists shared by the kernels: the 32-byte [`WorkItem`] layout (mirrored by `nvmf_work`
//! in `common.cuh`), chunking of items into equal pieces for thread blocks, and the host-side
//! validation of scatter copies and regions.

use crate::error::KernelError;

/// Bytes one warp handles at a time. A multiple of 16 (vector copies) and of 8 (checksum
/// words); small enough that a single large item still spreads over every SM.
pub const CHUNK_SIZE: u64 = 8 * 1024;

/// One work item as the kernels read it (little-endian, 32 bytes, `nvmf_work` in CUDA).
///
/// `a` and `b` depend on the kernel: scatter uses (source offset, destination offset), fill and
/// verify (buffer offset, namespace offset), checksum (buffer offset, output index).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WorkItem {
    /// First offset.
    pub a: u64,
    /// Second offset or index.
    pub b: u64,
    /// Length in bytes.
    pub len: u64,
    /// Index of the item's first chunk in the launch.
    pub first_chunk: u64,
}

const _: () = assert!(std::mem::size_of::<WorkItem>() == 32);
const _: () = assert!(std::mem::align_of::<WorkItem>() == 8);
const _: () = assert!(CHUNK_SIZE % 16 == 0);

/// Encoded size of one [`WorkItem`].
pub const WORK_ITEM_SIZE: usize = 32;

/// A validated, chunked list of work items.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct WorkPlan {
    items: Vec<WorkItem>,
    total_chunks: u64,
    chunk_size: u64,
}

impl WorkPlan {
    /// Builds a plan from `(a, b, len)` triples; empty items are dropped.
    pub fn new(
        entries: impl IntoIterator<Item = (u64, u64, u64)>,
        chunk_size: u64,
    ) -> Result<Self, KernelError> {
        if chunk_size == 0 {
            return Err(KernelError::PlanTooLarge);
        }
        let mut items = Vec::new();
        let mut next = 0u64;
        for (a, b, len) in entries {
            if len == 0 {
                continue;
            }
            let chunks = len.div_ceil(chunk_size);
            items.push(WorkItem {
                a,
                b,
                len,
                first_chunk: next,
            });
            next = next.checked_add(chunks).ok_or(KernelError::PlanTooLarge)?;
        }
        Ok(WorkPlan {
            items,
            total_chunks: next,
            chunk_size,
        })
    }

    /// The items, in order.
    pub fn items(&self) -> &[WorkItem] {
        &self.items
    }

    /// Total number of chunks (per-warp work units).
    pub fn total_chunks(&self) -> u64 {
        self.total_chunks
    }

    /// Chunk size the plan was cut with.
    pub fn chunk_size(&self) -> u64 {
        self.chunk_size
    }

    /// True when there is nothing to do.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Bytes of the encoded list.
    pub fn encoded_len(&self) -> usize {
        self.items.len() * WORK_ITEM_SIZE
    }

    /// Writes the little-endian encoding into `out[..encoded_len()]`.
    pub fn encode_into(&self, out: &mut [u8]) -> Result<(), KernelError> {
        if out.len() < self.encoded_len() {
            return Err(KernelError::PlanTooLarge);
        }
        for (item, dst) in self.items.iter().zip(out.chunks_exact_mut(WORK_ITEM_SIZE)) {
            dst[0..8].copy_from_slice(&item.a.to_le_bytes());
            dst[8..16].copy_from_slice(&item.b.to_le_bytes());
            dst[16..24].copy_from_slice(&item.len.to_le_bytes());
            dst[24..32].copy_from_slice(&item.first_chunk.to_le_bytes());
        }
        Ok(())
    }

    /// Which item and byte range `[lo, lo + n)` of it a chunk covers: the host mirror of
    /// `nvmf_chunk` in `common.cuh`.
    pub fn locate_chunk(&self, chunk: u64) -> Option<(usize, u64, u64)> {
        if self.items.is_empty() || chunk >= self.total_chunks {
            return None;
        }
        let idx = self.items.partition_point(|i| i.first_chunk <= chunk) - 1;
        let item = &self.items[idx];
        let k = chunk - item.first_chunk;
        let lo = k.checked_mul(self.chunk_size)?;
        if lo >= item.len {
            return None;
        }
        Some((idx, lo, (item.len - lo).min(self.chunk_size)))
    }
}

/// One staged block to scatter: `len` bytes from `src_offset` of the staging buffer to
/// `dst_offset` of the destination (both any byte offset).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScatterCopy {
    /// Offset in the staging buffer.
    pub src_offset: u64,
    /// Offset in the destination buffer.
    pub dst_offset: u64,
    /// Bytes to copy.
    pub len: u64,
}

/// A buffer region that holds (or should hold) the pattern of the namespace bytes starting at
/// `ns_offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PatternRegion {
    /// Offset in the buffer.
    pub offset: u64,
    /// Namespace byte offset of the region's first byte (e.g. `lba * block_size`).
    pub ns_offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// A byte range of a buffer (for checksums).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteRange {
    /// Offset in the buffer.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

fn fits(offset: u64, len: u64, size: u64) -> bool {
    offset.checked_add(len).is_some_and(|end| end <= size)
}

/// Finds two overlapping non-empty ranges among `(offset, len, index)`. Linear when the ranges
/// come in ascending order (the usual layout of a batch), `O(n log n)` otherwise.
fn find_overlap(mut ranges: Vec<(u64, u64, usize)>) -> Option<(usize, usize)> {
    ranges.retain(|r| r.1 > 0);
    if !ranges.is_sorted() {
        ranges.sort_unstable();
    }
    ranges.windows(2).find_map(|w| {
        let (a, b) = (w[0], w[1]);
        // Ends cannot overflow: callers checked `fits` first.
        (a.0 + a.1 > b.0).then(|| (a.2.min(b.2), a.2.max(b.2)))
    })
}

/// Checks scatter copies against the staging (`src_len`) and destination (`dst_len`) sizes and
/// rejects copies whose destinations overlap.
pub fn validate_scatter(
    src_len: u64,
    dst_len: u64,
    copies: &[ScatterCopy],
) -> Result<(), KernelError> {
    for (index, c) in copies.iter().enumerate() {
        if !fits(c.src_offset, c.len, src_len) {
            return Err(KernelError::SourceOutOfBounds {
                index,
                offset: c.src_offset,
                len: c.len,
                size: src_len,
            });
        }
        if !fits(c.dst_offset, c.len, dst_len) {
            return Err(KernelError::DestinationOutOfBounds {
                index,
                offset: c.dst_offset,
                len: c.len,
                size: dst_len,
            });
        }
    }
    let ranges = copies
        .iter()
        .enumerate()
        .map(|(i, c)| (c.dst_offset, c.len, i))
        .collect();
    match find_overlap(ranges) {
        Some((first, second)) => Err(KernelError::OverlappingWrites { first, second }),
        None => Ok(()),
    }
}

/// Checks pattern regions against a buffer of `size` bytes; with `exclusive`, also rejects
/// overlapping regions (needed when they are written).
pub fn validate_regions(
    size: u64,
    regions: &[PatternRegion],
    exclusive: bool,
) -> Result<(), KernelError> {
    for (index, r) in regions.iter().enumerate() {
        if !fits(r.offset, r.len, size) {
            return Err(KernelError::RegionOutOfBounds {
                index,
                offset: r.offset,
                len: r.len,
                size,
            });
        }
        // The kernels round namespace ranges up to whole words.
        if r.ns_offset
            .checked_add(r.len)
            .and_then(|e| e.checked_add(8))
            .is_none()
        {
            return Err(KernelError::NamespaceOverflow {
                index,
                ns_offset: r.ns_offset,
                len: r.len,
            });
        }
    }
    if exclusive {
        let ranges = regions
            .iter()
            .enumerate()
            .map(|(i, r)| (r.offset, r.len, i))
            .collect();
        if let Some((first, second)) = find_overlap(ranges) {
            return Err(KernelError::OverlappingWrites { first, second });
        }
    }
    Ok(())
}

/// Checks checksum ranges against a buffer of `size` bytes.
pub fn validate_ranges(size: u64, ranges: &[ByteRange]) -> Result<(), KernelError> {
    for (index, r) in ranges.iter().enumerate() {
        if !fits(r.offset, r.len, size) {
            return Err(KernelError::RegionOutOfBounds {
                index,
                offset: r.offset,
                len: r.len,
                size,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn chunks_are_assigned_in_order() {
        let plan = WorkPlan::new([(0, 0, 10), (0, 0, 0), (5, 6, 25), (1, 1, 20)], 10).unwrap();
        assert_eq!(plan.items().len(), 3);
        assert_eq!(plan.total_chunks(), 1 + 3 + 2);
        assert_eq!(
            plan.items()[1],
            WorkItem {
                a: 5,
                b: 6,
                len: 25,
                first_chunk: 1
            }
        );
        assert_eq!(plan.locate_chunk(0), Some((0, 0, 10)));
        assert_eq!(plan.locate_chunk(1), Some((1, 0, 10)));
        assert_eq!(plan.locate_chunk(3), Some((1, 20, 5)));
        assert_eq!(plan.locate_chunk(5), Some((2, 10, 10)));
        assert_eq!(plan.locate_chunk(6), None);
    }

    #[test]
    fn encoding_is_little_endian_32_bytes() {
        let plan = WorkPlan::new([(1, 2, 3)], CHUNK_SIZE).unwrap();
        let mut out = vec![0u8; plan.encoded_len()];
        plan.encode_into(&mut out).unwrap();
        assert_eq!(out.len(), 32);
        assert_eq!(&out[0..8], &1u64.to_le_bytes());
        assert_eq!(&out[8..16], &2u64.to_le_bytes());
        assert_eq!(&out[16..24], &3u64.to_le_bytes());
        assert_eq!(&out[24..32], &0u64.to_le_bytes());
        assert!(plan.encode_into(&mut [0u8; 31]).is_err());
    }

    #[test]
    fn empty_and_degenerate_plans() {
        let plan = WorkPlan::new([(0, 0, 0)], CHUNK_SIZE).unwrap();
        assert!(plan.is_empty());
        assert_eq!(plan.total_chunks(), 0);
        assert_eq!(plan.locate_chunk(0), None);
        assert!(WorkPlan::new([(0, 0, 1)], 0).is_err());
        assert!(WorkPlan::new([(0, 0, u64::MAX), (0, 0, u64::MAX)], 1).is_err());
    }

    #[test]
    fn scatter_validation() {
        let ok = [
            ScatterCopy {
                src_offset: 0,
                dst_offset: 7,
                len: 512,
            },
            ScatterCopy {
                src_offset: 512,
                dst_offset: 519,
                len: 512,
            },
        ];
        assert!(validate_scatter(1024, 2048, &ok).is_ok());
        assert!(matches!(
            validate_scatter(1000, 2048, &ok),
            Err(KernelError::SourceOutOfBounds { index: 1, .. })
        ));
        assert!(matches!(
            validate_scatter(1024, 1000, &ok),
            Err(KernelError::DestinationOutOfBounds { index: 1, .. })
        ));
        let overlap = [
            ok[0],
            ScatterCopy {
                src_offset: 512,
                dst_offset: 518,
                len: 512,
            },
        ];
        assert_eq!(
            validate_scatter(1024, 2048, &overlap),
            Err(KernelError::OverlappingWrites {
                first: 0,
                second: 1
            })
        );
        let overflow = [ScatterCopy {
            src_offset: u64::MAX,
            dst_offset: 0,
            len: 2,
        }];
        assert!(validate_scatter(u64::MAX, u64::MAX, &overflow).is_err());
        // Zero-length copies never overlap.
        let empty = [
            ScatterCopy {
                src_offset: 0,
                dst_offset: 10,
                len: 0,
            },
            ScatterCopy {
                src_offset: 0,
                dst_offset: 5,
                len: 10,
            },
        ];
        assert!(validate_scatter(10, 20, &empty).is_ok());
    }

    #[test]
    fn region_validation() {
        let r = |offset, ns_offset, len| PatternRegion {
            offset,
            ns_offset,
            len,
        };
        assert!(validate_regions(100, &[r(0, 0, 50), r(40, 0, 60)], false).is_ok());
        assert!(matches!(
            validate_regions(100, &[r(0, 0, 50), r(40, 0, 60)], true),
            Err(KernelError::OverlappingWrites { .. })
        ));
        assert!(matches!(
            validate_regions(100, &[r(60, 0, 50)], false),
            Err(KernelError::RegionOutOfBounds { index: 0, .. })
        ));
        assert!(matches!(
            validate_regions(100, &[r(0, u64::MAX - 10, 5)], false),
            Err(KernelError::NamespaceOverflow { .. })
        ));
        let b = |offset, len| ByteRange { offset, len };
        assert!(validate_ranges(10, &[b(0, 10), b(3, 3)]).is_ok());
        assert!(validate_ranges(10, &[b(5, 6)]).is_err());
    }

    proptest! {
        #[test]
        fn every_byte_is_covered_exactly_once(lens in prop::collection::vec(0u64..200, 0..20), chunk in 1u64..64) {
            let plan = WorkPlan::new(lens.iter().map(|&l| (0, 0, l)), chunk).unwrap();
            let mut covered: Vec<Vec<u32>> = plan.items().iter().map(|i| vec![0; i.len as usize]).collect();
            for c in 0..plan.total_chunks() {
                let (idx, lo, n) = plan.locate_chunk(c).expect("every chunk maps to bytes");
                prop_assert!(n > 0 && n <= chunk);
                for b in lo..lo + n {
                    covered[idx][b as usize] += 1;
                }
            }
            for item in covered {
                prop_assert!(item.iter().all(|&c| c == 1));
            }
        }

        #[test]
        fn overlap_detection_matches_naive(ranges in prop::collection::vec((0u64..100, 0u64..20), 0..8)) {
            let copies: Vec<ScatterCopy> = ranges.iter().map(|&(o, l)| ScatterCopy { src_offset: 0, dst_offset: o, len: l }).collect();
            let naive = copies.iter().enumerate().any(|(i, a)| copies.iter().enumerate().any(|(j, b)| {
                i < j && a.len > 0 && b.len > 0 && a.dst_offset < b.dst_offset + b.len && b.dst_offset < a.dst_offset + a.len
            }));
            let res = validate_scatter(20, 200, &copies);
            prop_assert_eq!(naive, matches!(res, Err(KernelError::OverlappingWrites { .. })));
        }
    }
}
