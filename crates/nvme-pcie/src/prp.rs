//! Physical Region Page lists (NVMe Base Specification 2.0, section 4.1.1).
//!
//! [`build`] is the driver side: it turns one IOVA-contiguous transfer into PRP1/PRP2 and,
//! when more than two pages are touched, the entries of one PRP list page. [`walk`] is the
//! controller side (used by the model): it follows PRP1/PRP2 and list pages as a controller
//! does and rejects what a controller rejects.

use nvme_spec::Status;
use nvme_spec::status::generic;

use crate::arena::DmaWindow;

/// Generic status "PRP Offset Invalid" (NVMe Base 2.0, Figure 100).
pub const PRP_OFFSET_INVALID: u8 = 0x13;

/// The largest transfer [`build`] handles for a controller page size: one PRP list page of
/// entries plus the first page (no chained lists).
pub const fn max_transfer(page: u64) -> u64 {
    page * (page / 8)
}

/// Builds PRP1/PRP2 for `len` bytes (non-zero) at `iova` (4-byte aligned) with controller
/// page size `page`. If the transfer touches more than two pages, `list` is called with each
/// list index and entry, and PRP2 points at `list_iova` (a page-aligned list page). The
/// caller guarantees `len <= max_transfer(page)`.
#[inline]
pub fn build(
    iova: u64,
    len: u64,
    page: u64,
    list_iova: u64,
    mut list: impl FnMut(usize, u64),
) -> (u64, u64) {
    let first = page - (iova & (page - 1));
    if len <= first {
        return (iova, 0);
    }
    let next = iova + first;
    let rest = len - first;
    if rest <= page {
        return (iova, next);
    }
    let entries = rest.div_ceil(page) as usize;
    for i in 0..entries {
        list(i, next + i as u64 * page);
    }
    (iova, list_iova)
}

/// Walks PRP1/PRP2 for a transfer of `len` bytes as a controller does, returning the
/// `(iova, length)` segments in order, or the status a controller completes the command with.
pub fn walk(
    window: &DmaWindow,
    prp1: u64,
    prp2: u64,
    len: u64,
    page: u64,
) -> Result<Vec<(u64, u64)>, Status> {
    let invalid_offset = Status::generic(PRP_OFFSET_INVALID).with_dnr();
    let transfer_error = Status::generic(generic::DATA_TRANSFER_ERROR).with_dnr();
    if prp1 & 3 != 0 {
        return Err(invalid_offset);
    }
    let first = (page - (prp1 & (page - 1))).min(len);
    let mut segs = vec![(prp1, first)];
    let mut rest = len - first;
    if rest == 0 {
        return Ok(segs);
    }
    if rest <= page {
        if prp2 & (page - 1) != 0 {
            return Err(invalid_offset);
        }
        segs.push((prp2, rest));
        return Ok(segs);
    }
    if prp2 & 7 != 0 {
        return Err(invalid_offset);
    }
    let mut list = prp2;
    while rest > 0 {
        let last_slot = list | (page - 8) == list;
        let entry = window.read_u64(list).ok_or(transfer_error)?;
        if last_slot && rest > page {
            // The last entry of a list page points at the next list page.
            if entry & 7 != 0 {
                return Err(invalid_offset);
            }
            list = entry;
            continue;
        }
        if entry & (page - 1) != 0 {
            return Err(invalid_offset);
        }
        let n = rest.min(page);
        segs.push((entry, n));
        rest -= n;
        list += 8;
    }
    Ok(segs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arena::{ARENA_PAGE, DEFAULT_IOVA_BASE, DmaArena};
    use proptest::prelude::*;

    const PAGE: u64 = ARENA_PAGE as u64;

    fn build_and_walk(arena: &DmaArena, offset: u64, len: u64) -> Vec<(u64, u64)> {
        let list = arena.alloc(ARENA_PAGE, ARENA_PAGE).unwrap();
        let iova = DEFAULT_IOVA_BASE + 64 * PAGE + offset;
        let (p1, p2) = build(iova, len, PAGE, list.iova(), |i, e| {
            list.write_u64(i * 8, e.to_le())
        });
        let segs = walk(&arena.window(), p1, p2, len, PAGE).expect("valid PRPs");
        // The segments are exactly the contiguous range, page-bounded.
        let mut at = iova;
        for &(a, n) in &segs {
            assert_eq!(a, at);
            assert!(n > 0 && n <= PAGE);
            assert!(a / PAGE == (a + n - 1) / PAGE, "segment crosses a page");
            at += n;
        }
        assert_eq!(at, iova + len);
        segs
    }

    proptest! {
        #[test]
        fn build_matches_controller_walk(offset in 0u64..PAGE / 4, len in 1u64..=max_transfer(PAGE) - PAGE) {
            let arena = DmaArena::new(1024 * ARENA_PAGE, DEFAULT_IOVA_BASE).unwrap();
            build_and_walk(&arena, offset * 4, len);
        }
    }

    #[test]
    fn edges() {
        let arena = DmaArena::new(1024 * ARENA_PAGE, DEFAULT_IOVA_BASE).unwrap();
        assert_eq!(build_and_walk(&arena, 0, PAGE).len(), 1);
        assert_eq!(build_and_walk(&arena, 0, 2 * PAGE).len(), 2);
        assert_eq!(build_and_walk(&arena, 0, 3 * PAGE).len(), 3);
        assert_eq!(build_and_walk(&arena, 4, PAGE).len(), 2);
        assert_eq!(build_and_walk(&arena, 0, max_transfer(PAGE)).len(), 512);
        let (p1, p2) = build(0x1000, 4096, PAGE, 0xdead000, |_, _| unreachable!());
        assert_eq!((p1, p2), (0x1000, 0));
    }

    #[test]
    fn walk_rejects_bad_prps() {
        let arena = DmaArena::new(16 * ARENA_PAGE, DEFAULT_IOVA_BASE).unwrap();
        let w = arena.window();
        let base = DEFAULT_IOVA_BASE;
        let bad = |r: Result<Vec<(u64, u64)>, Status>| r.unwrap_err().sc;
        assert_eq!(bad(walk(&w, base + 2, 0, 16, PAGE)), PRP_OFFSET_INVALID);
        assert_eq!(
            bad(walk(&w, base, base + 0x10, 2 * PAGE, PAGE)),
            PRP_OFFSET_INVALID
        );
        // A list entry that is not page aligned.
        let list = arena.alloc(ARENA_PAGE, ARENA_PAGE).unwrap();
        list.write_u64(0, base + PAGE + 8);
        assert_eq!(
            bad(walk(&w, base, list.iova(), 3 * PAGE, PAGE)),
            PRP_OFFSET_INVALID
        );
        // A list pointer outside the arena.
        assert_eq!(
            bad(walk(&w, base, 0x8000_0000, 3 * PAGE, PAGE)),
            generic::DATA_TRANSFER_ERROR
        );
    }
}
