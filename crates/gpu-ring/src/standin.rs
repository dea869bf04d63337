//! A CPU stand-in for the device side of the rings: the protocol of `nvmf_gpu.cuh` written
//! in Rust, so the host side and its users (the initiator's proxy) can be tested without a
//! GPU. Threads play warps: each calls [`DeviceRing::submit`] (or [`DeviceRing::submit_warp`],
//! one ticket increment for many requests) and then [`DeviceRing::wait`].
//!
//! The steps are those of the header, one for one:
//!
//! 1. `submit` takes a ticket `t` with one atomic add; slot `t % N`, lap `lap(t)`;
//! 2. it waits until `freed[slot] == prev_lap(lap)` (the previous occupant released the slot),
//!    meanwhile releasing a previous occupant that timed out (`abandoned[slot]`) once that
//!    occupant's completion word has arrived; it gives up when the host closed the ring;
//! 3. in push mode it records the destination in `dst[slot]`;
//! 4. it stores `w1`, then `w0` (Release);
//! 5. `wait` polls the completion word (Acquire) until it carries the lap, the deadline passes
//!    (`TIMEOUT`: the slot is marked abandoned) or the ring is closed (`CLOSED`);
//! 6. on completion, pull mode copies the data area to the destination, then the slot is
//!    released: `freed[slot]` goes from `prev_lap(lap)` to `lap` (compare-and-swap, so a
//!    second release is harmless).
//!
//! Stand-in rings come from [`crate::RingSet::new_host`] and
//! [`crate::RingSet::standin_rings`]. A [`Ticket`] is consumed by `wait`, as on the device a
//! ticket must be waited on once.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::host::PushItem;
use crate::proto::{
    LAPS, Request, RequestWords, decode_completion, lap, prev_lap, status, word_lap,
};
use crate::set::{DataMode, RingConfig};
use crate::shared::RingMem;

/// The device-only words of one ring (device memory on a GPU, heap here).
#[derive(Debug)]
pub(crate) struct DeviceMem {
    ticket: AtomicU64,
    freed: Box<[AtomicU32]>,
    abandoned: Box<[AtomicU32]>,
    dst: Box<[AtomicU64]>,
}

impl DeviceMem {
    pub(crate) fn new(slots: u32) -> DeviceMem {
        DeviceMem {
            ticket: AtomicU64::new(0),
            freed: (0..slots).map(|_| AtomicU32::new(LAPS as u32)).collect(),
            abandoned: (0..slots).map(|_| AtomicU32::new(0)).collect(),
            dst: (0..slots).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Addresses of ticket, freed, abandoned and dst (for the descriptor table).
    pub(crate) fn addresses(&self) -> [u64; 4] {
        [
            std::ptr::from_ref(&self.ticket) as u64,
            self.freed.as_ptr() as u64,
            self.abandoned.as_ptr() as u64,
            self.dst.as_ptr() as u64,
        ]
    }
}

/// A taken ticket: wait on it exactly once ([`DeviceRing::wait`]).
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a ticket must be waited on, or its slot is never released"]
pub struct Ticket {
    ticket: u64,
    closed: bool,
}

impl Ticket {
    /// The ticket number.
    pub fn value(&self) -> u64 {
        self.ticket
    }

    /// True when the ring was closed before the request could be written (waiting gives
    /// `CLOSED` at once).
    pub fn is_closed(&self) -> bool {
        self.closed
    }
}

/// One request of a warp-collective submit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WarpRequest {
    /// Namespace index.
    pub ns: u32,
    /// First block.
    pub lba: u64,
    /// Blocks.
    pub nblocks: u32,
    /// Destination (push mode: recorded in `dst[slot]`).
    pub dst: u64,
}

/// The device side of one ring, driven from CPU threads. Cheap to clone; every clone is the
/// same ring.
#[derive(Debug, Clone)]
pub struct DeviceRing {
    mem: Arc<RingMem>,
    dev: Arc<DeviceMem>,
    config: RingConfig,
}

impl DeviceRing {
    pub(crate) fn new(mem: Arc<RingMem>, dev: Arc<DeviceMem>, config: RingConfig) -> DeviceRing {
        DeviceRing { mem, dev, config }
    }

    /// The ring's shape.
    pub fn config(&self) -> RingConfig {
        self.config
    }

    /// Tickets taken so far.
    pub fn tickets(&self) -> u64 {
        self.dev.ticket.load(Ordering::Acquire)
    }

    fn slot_of(&self, ticket: u64) -> u32 {
        (ticket % u64::from(self.config.slots)) as u32
    }

    /// Submits a read of `nblocks` blocks at `lba` of namespace index `ns`; `dst` is recorded
    /// as the destination in push mode. Blocks while the slot's previous occupant is not
    /// released. Arguments that cannot be encoded produce a request the host answers with
    /// Invalid Field.
    pub fn submit(&self, ns: u32, lba: u64, nblocks: u32, dst: u64) -> Ticket {
        let t = self.dev.ticket.fetch_add(1, Ordering::AcqRel);
        let l = lap(t, self.config.slots);
        self.fill(t, Request::from_args(ns, lba, nblocks).encode(l), dst)
    }

    /// Submits many requests with one ticket increment (as a warp does with one atomic add
    /// for its active lanes); tickets are consecutive, in the order of `reqs`. A caller must
    /// not hold more unwaited tickets than the ring has slots.
    pub fn submit_warp(&self, reqs: &[WarpRequest]) -> Vec<Ticket> {
        let base = self
            .dev
            .ticket
            .fetch_add(reqs.len() as u64, Ordering::AcqRel);
        reqs.iter()
            .enumerate()
            .map(|(i, r)| {
                let t = base + i as u64;
                let l = lap(t, self.config.slots);
                self.fill(
                    t,
                    Request::from_args(r.ns, r.lba, r.nblocks).encode(l),
                    r.dst,
                )
            })
            .collect()
    }

    /// Submits raw request words (bits below the lap as given, the lap set correctly): what
    /// a kernel writing anything into its ring produces.
    pub fn submit_words(&self, w0: u64, w1: u64) -> Ticket {
        let t = self.dev.ticket.fetch_add(1, Ordering::AcqRel);
        let lap_bits = u64::from(lap(t, self.config.slots)) << crate::proto::LAP_SHIFT;
        let mask = (1u64 << crate::proto::LAP_SHIFT) - 1;
        let words = RequestWords {
            w0: lap_bits | (w0 & mask),
            w1: lap_bits | (w1 & mask),
        };
        self.fill(t, words, 0)
    }

    /// Stores arbitrary request words into a slot without a ticket (a misbehaving kernel).
    pub fn scribble(&self, slot: u32, w0: u64, w1: u64) {
        let (a, b) = self.mem.req(slot);
        b.store(w1, Ordering::Release);
        a.store(w0, Ordering::Release);
    }

    fn closed(&self) -> bool {
        self.mem.closed().load(Ordering::Acquire) != 0
    }

    fn fill(&self, t: u64, words: RequestWords, dst: u64) -> Ticket {
        let slot = self.slot_of(t);
        let l = lap(t, self.config.slots);
        if !self.acquire_slot(slot, l) {
            return Ticket {
                ticket: t,
                closed: true,
            };
        }
        if self.config.mode == DataMode::Push {
            self.dev.dst[slot as usize].store(dst, Ordering::Relaxed);
        }
        let (w0, w1) = self.mem.req(slot);
        w1.store(words.w1, Ordering::Release);
        w0.store(words.w0, Ordering::Release);
        Ticket {
            ticket: t,
            closed: false,
        }
    }

    /// Waits until the previous occupant of `slot` released it; false when the ring closed.
    fn acquire_slot(&self, slot: u32, l: u16) -> bool {
        let prev = prev_lap(l);
        let freed = &self.dev.freed[slot as usize];
        loop {
            self.release_abandoned(slot, prev);
            if freed.load(Ordering::Acquire) == u32::from(prev) {
                return true;
            }
            if self.closed() {
                return false;
            }
            std::thread::yield_now();
        }
    }

    /// Releases the slot on behalf of an occupant of lap `prev` that timed out, once its
    /// completion word has arrived.
    fn release_abandoned(&self, slot: u32, prev: u16) {
        let abandoned = &self.dev.abandoned[slot as usize];
        if abandoned.load(Ordering::Acquire) != u32::from(prev)
            || word_lap(self.mem.cpl(slot).load(Ordering::Acquire)) != prev
        {
            return;
        }
        self.release(slot, prev);
        let _ = abandoned.compare_exchange(u32::from(prev), 0, Ordering::AcqRel, Ordering::Relaxed);
    }

    fn release(&self, slot: u32, l: u16) {
        let _ = self.dev.freed[slot as usize].compare_exchange(
            u32::from(prev_lap(l)),
            u32::from(l),
            Ordering::AcqRel,
            Ordering::Relaxed,
        );
    }

    /// True when the ticket's completion has arrived (or the ticket is closed); `wait` then
    /// returns without waiting.
    pub fn test(&self, ticket: &Ticket) -> bool {
        ticket.closed || self.completion(ticket).is_some()
    }

    fn completion(&self, ticket: &Ticket) -> Option<u16> {
        let slot = self.slot_of(ticket.ticket);
        let (l, st) = decode_completion(self.mem.cpl(slot).load(Ordering::Acquire));
        (l == lap(ticket.ticket, self.config.slots)).then_some(st)
    }

    /// Waits for the ticket's completion for at most `timeout` and returns its NVMe status,
    /// `TIMEOUT` or `CLOSED`. In pull mode a successful read's bytes (up to `dst.len()`) are
    /// copied to `dst` first. The slot is released (or, on `TIMEOUT` / `CLOSED`, marked
    /// abandoned so the next occupant releases it once the completion arrives).
    pub fn wait(&self, ticket: Ticket, timeout: Duration, dst: &mut [u8]) -> u16 {
        if ticket.closed {
            return status::CLOSED;
        }
        let deadline = Instant::now() + timeout;
        let slot = self.slot_of(ticket.ticket);
        let l = lap(ticket.ticket, self.config.slots);
        let abandon = |st: u16| {
            self.dev.abandoned[slot as usize].store(u32::from(l), Ordering::Release);
            st
        };
        let st = loop {
            if let Some(st) = self.completion(&ticket) {
                break st;
            }
            if self.closed() {
                return abandon(status::CLOSED);
            }
            if Instant::now() >= deadline {
                return abandon(status::TIMEOUT);
            }
            std::thread::yield_now();
        };
        if st == status::SUCCESS && self.config.mode == DataMode::Pull && !dst.is_empty() {
            // The host marks the data free just after publishing the word.
            while self
                .mem
                .device_read(slot, dst.len(), |b| dst[..b.len()].copy_from_slice(b))
                .is_none()
            {
                if Instant::now() >= deadline {
                    return abandon(status::TIMEOUT);
                }
                std::thread::yield_now();
            }
        }
        self.release(slot, l);
        st
    }

    /// Submits a read and waits for it (`submit` + `wait`).
    pub fn read(&self, ns: u32, lba: u64, nblocks: u32, dst: &mut [u8], timeout: Duration) -> u16 {
        let t = self.submit(ns, lba, nblocks, 0);
        self.wait(t, timeout, dst)
    }

    /// The push kernel for one slot (push mode): gives `sink` the slot's destination
    /// (`dst[slot]`) and its bytes, then stores the completion word. False when the host
    /// still holds the slot's data.
    pub fn push(&self, item: &PushItem, sink: impl FnOnce(u64, &[u8])) -> bool {
        let dst = self.dev.dst[(item.slot % self.config.slots) as usize].load(Ordering::Relaxed);
        let copied = self
            .mem
            .device_read(item.slot, item.bytes as usize, |b| sink(dst, b))
            .is_some();
        if copied {
            self.mem
                .cpl(item.slot)
                .store(item.cpl_word, Ordering::Release);
        }
        copied
    }
}
