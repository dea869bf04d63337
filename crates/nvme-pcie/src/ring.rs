//! One submission/completion queue pair in arena memory: entry writes, the SQ tail and CQ
//! head doorbells, phase-tag polling and wrap.

use std::sync::atomic::{Ordering, fence};

use nvme_spec::{Cqe, IntoBytes, Sqe};

use crate::arena::{DmaArena, DmaBuf};
use crate::error::Error;
use crate::regs::{self, Device};

/// Size of a submission queue entry (CC.IOSQES = 6).
pub(crate) const SQE_SIZE: usize = 64;
/// Size of a completion queue entry (CC.IOCQES = 4).
pub(crate) const CQE_SIZE: usize = 16;

/// Ring state of one queue pair. The SQ and CQ share a queue identifier and a size.
pub(crate) struct Ring {
    pub(crate) sq: DmaBuf,
    pub(crate) cq: DmaBuf,
    size: u16,
    sq_tail: u16,
    sq_head: u16,
    cq_head: u16,
    phase: u32,
    sq_db: u32,
    cq_db: u32,
    /// Entries written since the last SQ tail doorbell.
    unrung: bool,
}

impl Ring {
    /// Allocates a ring of `size` entries (2..=65536) for queue `qid`, queue memory aligned
    /// to the controller page size `page`.
    pub(crate) fn new(
        arena: &DmaArena,
        qid: u16,
        size: u16,
        dstrd: u8,
        page: usize,
    ) -> Result<Self, Error> {
        Ok(Self {
            sq: arena.alloc(usize::from(size) * SQE_SIZE, page)?,
            cq: arena.alloc(usize::from(size) * CQE_SIZE, page)?,
            size,
            sq_tail: 0,
            sq_head: 0,
            cq_head: 0,
            phase: 1,
            sq_db: regs::sq_tail_doorbell(qid, dstrd),
            cq_db: regs::cq_head_doorbell(qid, dstrd),
            unrung: false,
        })
    }

    /// Entries in the ring.
    pub(crate) fn size(&self) -> u16 {
        self.size
    }

    /// Forgets all state and zeroes the queue memory (after the controller was disabled).
    pub(crate) fn reset(&mut self) {
        self.sq.clear();
        self.cq.clear();
        self.sq_tail = 0;
        self.sq_head = 0;
        self.cq_head = 0;
        self.phase = 1;
        self.unrung = false;
    }

    fn wrap(&self, i: u16) -> u16 {
        if i + 1 == self.size { 0 } else { i + 1 }
    }

    /// True when the controller has not yet consumed enough entries to take another.
    #[inline]
    pub(crate) fn is_full(&self) -> bool {
        self.wrap(self.sq_tail) == self.sq_head
    }

    /// Writes `sqe` at the tail. The controller sees it only after [`Ring::ring`].
    #[inline]
    pub(crate) fn push(&mut self, sqe: &Sqe) {
        let base = usize::from(self.sq_tail) * SQE_SIZE;
        for (i, w) in sqe.as_bytes().chunks_exact(8).enumerate() {
            let mut word = [0u8; 8];
            word.copy_from_slice(w);
            self.sq.write_u64(base + i * 8, u64::from_ne_bytes(word));
        }
        self.sq_tail = self.wrap(self.sq_tail);
        self.unrung = true;
    }

    /// Rings the SQ tail doorbell once for everything pushed since the last ring.
    #[inline]
    pub(crate) fn ring(&mut self, dev: &dyn Device) -> bool {
        if !self.unrung {
            return false;
        }
        // Entries must be visible in memory before the device learns of them.
        fence(Ordering::Release);
        dev.write32(self.sq_db, u32::from(self.sq_tail));
        self.unrung = false;
        true
    }

    /// Takes the next completion if its phase tag says the controller posted it, advancing the
    /// CQ head (the doorbell is written by [`Ring::ack`]) and the known SQ head.
    #[inline]
    pub(crate) fn next_cqe(&mut self) -> Option<Cqe> {
        let off = usize::from(self.cq_head) * CQE_SIZE;
        let dw3 = u32::from_le(self.cq.read_u32(off + 12));
        if (dw3 >> 16) & 1 != self.phase {
            return None;
        }
        // The rest of the entry was written before the phase tag.
        fence(Ordering::Acquire);
        let mut raw = [0u8; 16];
        for i in 0..3 {
            raw[i * 4..i * 4 + 4].copy_from_slice(&self.cq.read_u32(off + i * 4).to_ne_bytes());
        }
        raw[12..].copy_from_slice(&dw3.to_le_bytes());
        let cqe = Cqe::from_array(&raw);
        self.cq_head = self.wrap(self.cq_head);
        if self.cq_head == 0 {
            self.phase ^= 1;
        }
        let sqhd = cqe.sqhd.get();
        if sqhd < self.size {
            self.sq_head = sqhd;
        }
        Some(cqe)
    }

    /// Writes the CQ head doorbell (once per poll that consumed entries).
    #[inline]
    pub(crate) fn ack(&self, dev: &dyn Device) {
        dev.write32(self.cq_db, u32::from(self.cq_head));
    }
}
