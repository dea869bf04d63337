//! [`HostRing`]: the host side of one ring, owned by the task that serves it.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::proto::{
    DecodedRequest, NsBinding, Read, RequestWords, decode_request, encode_completion, lap, validate,
};
use crate::set::DataMode;
use crate::shared::{DataArea, HostToken, RingMem, SlotData};

/// Counters of one ring.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RingStats {
    /// Requests taken from the ring (valid and invalid).
    pub taken: u64,
    /// Requests completed at once with an error status by validation.
    pub invalid: u64,
    /// Completions published by the owner (`complete` and `complete_push`).
    pub completed: u64,
    /// Calls to `complete*` for a slot that was not taken (ignored).
    pub stray_completions: u64,
    /// Requests taken and not completed yet.
    pub in_flight: u64,
}

/// What the push path needs for one completed slot (push mode): where its bytes are in the
/// ring's data area and the completion word the push kernel stores after copying them to the
/// slot's destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PushItem {
    /// The slot.
    pub slot: u32,
    /// Byte offset of the slot's data in the ring's data area (`slot * slot_bytes`).
    pub data_offset: u64,
    /// Bytes to copy (the read's size; 0 for an error status).
    pub bytes: u32,
    /// The completion word to store once the bytes are at the destination.
    pub cpl_word: u64,
}

/// The host side of one ring: takes requests in ticket order, validates them, hands the valid
/// ones out as [`Read`]s and publishes completions.
///
/// One owner (the queue task); `Send`. Dropping it closes the ring: the device side's waiters
/// and submitters get `CLOSED` instead of waiting for requests nobody will serve. Slots lent
/// out ([`HostRing::lend`]) stay valid after the drop, and their pending completions are still
/// published when the handles go.
pub struct HostRing {
    mem: Arc<RingMem>,
    token: HostToken,
    index: u32,
    slots: u32,
    slot_bytes: u32,
    mode: DataMode,
    namespaces: Arc<[NsBinding]>,
    next: u64,
    /// Per slot: lap and bytes of the taken request, `None` when not taken.
    taken: Box<[Option<(u16, u32)>]>,
    stats: RingStats,
    /// [`DataMode::Device`]: the data areas in device memory.
    device_data: Option<Arc<gpu::DeviceBuffer>>,
}

impl std::fmt::Debug for HostRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostRing")
            .field("index", &self.index)
            .field("slots", &self.slots)
            .field("slot_bytes", &self.slot_bytes)
            .field("mode", &self.mode)
            .field("next", &self.next)
            .field("stats", &self.stats)
            .finish()
    }
}

impl HostRing {
    pub(crate) fn new(
        mem: Arc<RingMem>,
        token: HostToken,
        index: u32,
        slot_bytes: u32,
        mode: DataMode,
        namespaces: Arc<[NsBinding]>,
        device_data: Option<Arc<gpu::DeviceBuffer>>,
    ) -> HostRing {
        let slots = mem.slots();
        HostRing {
            mem,
            token,
            index,
            slots,
            slot_bytes,
            mode,
            namespaces,
            next: 0,
            taken: vec![None; slots as usize].into_boxed_slice(),
            stats: RingStats::default(),
            device_data,
        }
    }

    /// Index of the ring in its [`crate::RingSet`].
    pub fn index(&self) -> u32 {
        self.index
    }

    /// Slots of the ring.
    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// Bytes of each slot's data area.
    pub fn slot_bytes(&self) -> u32 {
        self.slot_bytes
    }

    /// How completed data reaches the device.
    pub fn mode(&self) -> DataMode {
        self.mode
    }

    /// The ring's data areas in device memory ([`DataMode::Device`]; `None` otherwise), to
    /// register for a NIC; [`data_offset`](Self::data_offset) gives a slot's place in it.
    pub fn device_data(&self) -> Option<&Arc<gpu::DeviceBuffer>> {
        self.device_data.as_ref()
    }

    /// The ring's data areas as one range of host memory, to register for a NIC
    /// ([`DataArea`]; [`data_offset`](Self::data_offset) gives a slot's place in it). Empty in
    /// [`DataMode::Device`] (see [`device_data`](Self::device_data)).
    pub fn data_area(&self) -> DataArea {
        DataArea::new(self.mem.clone())
    }

    /// Offset of `slot`'s data inside the ring's [`DataArea`].
    pub fn data_offset(&self, slot: u32) -> usize {
        (slot & (self.slots - 1)) as usize * self.slot_bytes as usize
    }

    /// The namespace table (a request's `ns` field indexes it).
    pub fn namespaces(&self) -> &[NsBinding] {
        &self.namespaces
    }

    /// Takes up to `max` ready requests in ticket order; invalid ones are completed with a
    /// status here (counted in [`RingStats::invalid`]); valid ones are pushed to `out`.
    /// Returns how many were taken.
    ///
    /// A request is ready when both of its words carry the lap of the next expected ticket.
    /// Taking stops at the first slot that is not ready, or whose previous occupant is still
    /// taken (a device side writing into a slot it does not own cannot take it over).
    pub fn poll(&mut self, max: usize, out: &mut Vec<Read>) -> usize {
        let mut n = 0;
        while n < max {
            let Some((slot, l, decoded)) = self.published() else {
                break;
            };
            if !self.mem.claim(slot) {
                break;
            }
            self.next += 1;
            self.stats.taken += 1;
            n += 1;
            match validate(&decoded, slot, &self.namespaces, self.slot_bytes) {
                Ok(read) => {
                    self.taken[slot as usize] = Some((l, read.bytes as u32));
                    self.stats.in_flight += 1;
                    out.push(read);
                }
                Err(status) => {
                    self.stats.invalid += 1;
                    self.mem.complete(slot, encode_completion(l, status));
                }
            }
        }
        n
    }

    /// Whether the next request is ready for [`poll`](Self::poll): two atomic loads, no
    /// state changed (a caller can skip its own set-up for a poll that would take nothing).
    pub fn ready(&self) -> bool {
        self.published().is_some()
    }

    /// The next expected ticket's slot, lap and request, when both request words carry that
    /// lap and the slot's previous occupant is no longer taken.
    fn published(&self) -> Option<(u32, u16, DecodedRequest)> {
        let slot = (self.next % u64::from(self.slots)) as u32;
        let l = lap(self.next, self.slots);
        if self.taken[slot as usize].is_some() {
            return None;
        }
        let (w0, w1) = self.mem.req(slot);
        let decoded = decode_request(RequestWords {
            w0: w0.load(Ordering::Acquire),
            w1: w1.load(Ordering::Acquire),
        });
        (decoded.lap0 == l && decoded.lap1 == l).then_some((slot, l, decoded))
    }

    /// The data area of a slot that is taken and not completed yet (pull mode: receive here).
    /// Empty when the slot is not taken or its area is lent out.
    pub fn data_mut(&mut self, slot: u32) -> &mut [u8] {
        if slot >= self.slots || self.taken[slot as usize].is_none() {
            return &mut [];
        }
        self.mem.host_data(slot, &mut self.token)
    }

    /// An owned handle on a taken slot's data area (to lend to a command; `Send`,
    /// `AsMut<[u8]>`). The slot may be completed while the handle lives: its completion word
    /// is then published when the handle is dropped. An empty handle when the slot is not
    /// taken or already lent.
    pub fn lend(&mut self, slot: u32) -> SlotData {
        if slot >= self.slots || self.taken[slot as usize].is_none() {
            return SlotData::empty();
        }
        self.mem.lend(slot).unwrap_or_else(SlotData::empty)
    }

    /// Completes a taken slot with an NVMe status (0 = success): publishes its completion word
    /// (Release, after the data written into the slot). In push mode use
    /// [`HostRing::complete_push`] for reads whose data must be pushed; `complete` there
    /// publishes the status without data (for errors). A slot that is not taken is ignored
    /// (counted in [`RingStats::stray_completions`]).
    pub fn complete(&mut self, slot: u32, status: u16) {
        if let Some((l, _)) = self.finish(slot) {
            self.mem.complete(slot, encode_completion(l, status));
        }
    }

    /// Push mode: ends the host's part of a taken slot and returns what the push kernel needs
    /// (the completion word is stored by the kernel after it copied the bytes). `None` when
    /// the slot is not taken.
    pub fn complete_push(&mut self, slot: u32, status: u16) -> Option<PushItem> {
        let (l, bytes) = self.finish(slot)?;
        self.mem.complete_push(slot);
        Some(PushItem {
            slot,
            data_offset: u64::from(slot) * u64::from(self.slot_bytes),
            bytes: if status == 0 { bytes } else { 0 },
            cpl_word: encode_completion(l, status),
        })
    }

    /// Push mode: publishes from the host, with `status` instead of the item's own, the
    /// completion of an item whose push could not be enqueued (the push kernel never ran for
    /// it), so the waiting thread gets an error rather than a timeout.
    pub fn fail_push(&mut self, item: &PushItem, status: u16) {
        let (lap, _) = crate::proto::decode_completion(item.cpl_word);
        self.mem
            .publish_unpushed(item.slot, encode_completion(lap, status));
    }

    fn finish(&mut self, slot: u32) -> Option<(u16, u32)> {
        let taken = self.taken.get_mut(slot as usize).and_then(Option::take);
        match taken {
            Some(t) => {
                self.stats.completed += 1;
                self.stats.in_flight -= 1;
                Some(t)
            }
            None => {
                self.stats.stray_completions += 1;
                None
            }
        }
    }

    /// Requests taken and not completed yet.
    pub fn in_flight(&self) -> usize {
        self.stats.in_flight as usize
    }

    /// The ring's counters.
    pub fn stats(&self) -> RingStats {
        self.stats
    }

    /// The next ticket the ring expects (tickets taken so far).
    pub fn next_ticket(&self) -> u64 {
        self.next
    }
}

impl Drop for HostRing {
    fn drop(&mut self) {
        self.mem.closed().store(1, Ordering::Release);
    }
}
