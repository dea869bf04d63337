//! The host-visible memory of one ring and every access to it: the only module with `unsafe`.
//!
//! Layout of a ring's host block (pinned and mapped into the device, or heap for the CPU
//! stand-in), `N` slots of `slot_bytes`:
//!
//! | offset                         | contents                                          |
//! |--------------------------------|---------------------------------------------------|
//! | 0                              | `req[N]`: 16 bytes each (`w0`, `w1`)               |
//! | `16 N`                         | `cpl[N]`: one u64 each                            |
//! | `24 N`                         | control: u64 `closed` (non-zero once the host closed the ring), 64 bytes |
//! | `round_up(24 N + 64, 4096)`    | `data[N * slot_bytes]`                            |
//!
//! Ordering: request words are read with Acquire loads, completion words written with Release
//! stores, so the data of a slot written by the host before its completion word is visible to
//! a reader that saw that word (on x86 these are plain moves; the device orders its own side,
//! see the header). Data areas are plain bytes; who may touch a slot's data is decided by the
//! per-slot state below, kept in host memory the device never sees:
//!
//! - `FREE`: the device side owns the slot (its request is not taken, or its completion is
//!   published); the host does not touch the data;
//! - `HOST`: taken by the host: the single [`HostToken`] holder may write the data;
//! - `LENT`: a [`SlotData`] handle owns the data (a command receiving into it);
//! - `LENT` with a pending completion word: the host completed the slot while it was lent; the
//!   handle publishes the word when it is dropped;
//! - `READING`: the CPU stand-in copies the data out after seeing the completion.
//!
//! Every transition is a compare-and-swap, so two parties can never hold the same data area.

use std::any::Any;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Bytes of the control area.
const CTL_BYTES: usize = 64;
/// Alignment of the data area inside the host block.
const DATA_ALIGN: usize = 4096;

const FREE: u64 = 0;
const HOST: u64 = 1;
const LENT: u64 = 2;
const READING: u64 = 3;
/// With [`LENT`]: a completion is pending; bits 32.. hold the completion word's upper half.
const PENDING_STORE: u64 = 4;
/// With [`LENT`]: the slot was handed to the push path; release to `FREE` without a store.
const PENDING_PUSH: u64 = 8;
const STATE_MASK: u64 = 0xFFFF_FFFF;

/// Offsets of the parts of a ring's host block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostLayout {
    /// Offset of `req[0]` (always 0).
    pub req: usize,
    /// Offset of `cpl[0]`.
    pub cpl: usize,
    /// Offset of the control word `closed`.
    pub ctl: usize,
    /// Offset of `data[0]`.
    pub data: usize,
    /// Total bytes.
    pub len: usize,
}

impl HostLayout {
    /// The layout for `slots` slots of `slot_bytes`.
    pub const fn new(slots: u32, slot_bytes: u32) -> HostLayout {
        let n = slots as usize;
        let cpl = 16 * n;
        let ctl = 24 * n;
        let data = (ctl + CTL_BYTES).div_ceil(DATA_ALIGN) * DATA_ALIGN;
        HostLayout {
            req: 0,
            cpl,
            ctl,
            data,
            len: data + n * slot_bytes as usize,
        }
    }
}

/// Proof of being the one host-side owner of a ring's data areas: [`RingMem::host_data`]
/// borrows it mutably, so the host never holds two views of data at once.
#[derive(Debug)]
pub struct HostToken(());

/// The host block of one ring plus the host-only slot states.
pub struct RingMem {
    base: NonNull<u8>,
    layout: HostLayout,
    slots: u32,
    slot_bytes: u32,
    state: Box<[AtomicU64]>,
    _owner: Box<dyn Any + Send + Sync>,
}

// SAFETY: `base` points into memory owned by `_owner` (heap or pinned host memory), which lives
// as long as the `RingMem` and is not tied to a thread. Shared words are accessed only as
// atomics; data areas only by the party the slot state names (see the module docs).
unsafe impl Send for RingMem {}
// SAFETY: as above: all shared access goes through atomics or through state-guarded exclusive
// ownership of a data area.
unsafe impl Sync for RingMem {}

impl std::fmt::Debug for RingMem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingMem")
            .field("base", &self.base)
            .field("slots", &self.slots)
            .field("slot_bytes", &self.slot_bytes)
            .finish()
    }
}

impl RingMem {
    /// A ring block in zeroed heap memory (the CPU stand-in).
    pub fn new_heap(slots: u32, slot_bytes: u32) -> (Arc<RingMem>, HostToken) {
        let layout = HostLayout::new(slots, slot_bytes);
        let words: Box<[AtomicU64]> = (0..layout.len.div_ceil(8))
            .map(|_| AtomicU64::new(0))
            .collect();
        // The words have interior mutability, so writing through a pointer derived from them
        // is allowed; the box is kept alive as the owner.
        let base = NonNull::from(&words[0]).cast::<u8>();
        Self::build(base, layout, slots, slot_bytes, Box::new(words))
    }

    /// A ring block in page-locked host memory (zeroed here). `buffer` must hold at least
    /// [`HostLayout::len`] bytes; the ring keeps it alive and returns it shared, for copies
    /// from the data areas.
    #[allow(clippy::type_complexity)]
    pub fn new_pinned(
        mut buffer: gpu::PinnedBuffer,
        slots: u32,
        slot_bytes: u32,
    ) -> gpu::GpuResult<(Arc<RingMem>, HostToken, Arc<gpu::PinnedBuffer>)> {
        let layout = HostLayout::new(slots, slot_bytes);
        let bytes = buffer.as_mut_slice()?;
        if bytes.len() < layout.len {
            return Err(gpu::GpuError::OutOfBounds {
                offset: 0,
                len: layout.len as u64,
                size: bytes.len() as u64,
            });
        }
        bytes.fill(0);
        let base = NonNull::from(&mut bytes[0]);
        let buffer = Arc::new(buffer);
        let (mem, token) = Self::build(base, layout, slots, slot_bytes, Box::new(buffer.clone()));
        Ok((mem, token, buffer))
    }

    fn build(
        base: NonNull<u8>,
        layout: HostLayout,
        slots: u32,
        slot_bytes: u32,
        owner: Box<dyn Any + Send + Sync>,
    ) -> (Arc<RingMem>, HostToken) {
        debug_assert_eq!(base.as_ptr() as usize % 8, 0);
        let state = (0..slots).map(|_| AtomicU64::new(FREE)).collect();
        let mem = RingMem {
            base,
            layout,
            slots,
            slot_bytes,
            state,
            _owner: owner,
        };
        (Arc::new(mem), HostToken(()))
    }

    /// Host address of the block (the device maps the same bytes).
    pub fn host_addr(&self) -> u64 {
        self.base.as_ptr() as u64
    }

    /// Slots of the ring.
    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// The block's layout.
    pub fn layout(&self) -> HostLayout {
        self.layout
    }

    fn word(&self, offset: usize) -> &AtomicU64 {
        assert!(offset % 8 == 0 && offset + 8 <= self.layout.len);
        // SAFETY: the offset is 8-aligned (the base is at least 8-aligned) and inside the block,
        // which lives as long as `self`; every access to the word by either side is an atomic
        // (or, on the device, a single aligned 64-bit system-scope) access.
        unsafe { &*self.base.as_ptr().add(offset).cast::<AtomicU64>() }
    }

    fn slot_index(&self, slot: u32) -> usize {
        (slot & (self.slots - 1)) as usize
    }

    /// The two request words of `slot`.
    pub fn req(&self, slot: u32) -> (&AtomicU64, &AtomicU64) {
        let off = self.layout.req + 16 * self.slot_index(slot);
        (self.word(off), self.word(off + 8))
    }

    /// The completion word of `slot`.
    pub fn cpl(&self, slot: u32) -> &AtomicU64 {
        self.word(self.layout.cpl + 8 * self.slot_index(slot))
    }

    /// The `closed` control word.
    pub fn closed(&self) -> &AtomicU64 {
        self.word(self.layout.ctl)
    }

    fn state(&self, slot: u32) -> &AtomicU64 {
        &self.state[self.slot_index(slot)]
    }

    fn data_ptr(&self, slot: u32) -> *mut u8 {
        let off = self.layout.data + self.slot_index(slot) * self.slot_bytes as usize;
        // SAFETY: `off + slot_bytes <= layout.len` by construction of the layout, so the
        // pointer stays inside the block.
        unsafe { self.base.as_ptr().add(off) }
    }

    /// Takes `slot` for the host (`FREE` -> `HOST`). False while the slot's data is still lent
    /// out or being read.
    pub fn claim(&self, slot: u32) -> bool {
        self.state(slot)
            .compare_exchange(FREE, HOST, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
    }

    /// The data area of a slot the host holds (`HOST`); empty for any other state.
    pub fn host_data<'a>(&'a self, slot: u32, _token: &'a mut HostToken) -> &'a mut [u8] {
        if self.state(slot).load(Ordering::Acquire) != HOST {
            return &mut [];
        }
        // SAFETY: in state `HOST` only the holder of the ring's single `HostToken` may touch
        // the data area, and the token is borrowed mutably for the slice's lifetime; the
        // state leaves `HOST` only through `lend` / `complete` / `complete_push`, which take
        // `&mut` of the same owner (`HostRing`), so they cannot run while the slice lives.
        unsafe { std::slice::from_raw_parts_mut(self.data_ptr(slot), self.slot_bytes as usize) }
    }

    /// Lends the data area of a `HOST` slot to an owned handle (`HOST` -> `LENT`); `None` for
    /// any other state.
    pub fn lend(self: &Arc<Self>, slot: u32) -> Option<SlotData> {
        self.state(slot)
            .compare_exchange(HOST, LENT, Ordering::Acquire, Ordering::Relaxed)
            .ok()?;
        Some(SlotData {
            mem: Some(self.clone()),
            slot,
        })
    }

    /// Publishes the completion word of a `HOST` or `LENT` slot. For a lent slot the word is
    /// stored when its [`SlotData`] is dropped. Returns false (and does nothing) in any other
    /// state.
    pub fn complete(&self, slot: u32, word: u64) -> bool {
        let state = self.state(slot);
        let pending = (word & !STATE_MASK) | LENT | PENDING_STORE;
        if state
            .compare_exchange(LENT, pending, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            return true;
        }
        if state.load(Ordering::Acquire) != HOST {
            return false;
        }
        self.cpl(slot).store(word, Ordering::Release);
        state.store(FREE, Ordering::Release);
        true
    }

    /// Ends the host's hold on a `HOST` or `LENT` slot without storing its completion word
    /// (push mode: the push kernel stores it after copying the data). A lent slot becomes
    /// `FREE` when its handle is dropped.
    pub fn complete_push(&self, slot: u32) -> bool {
        let state = self.state(slot);
        if state
            .compare_exchange(
                LENT,
                LENT | PENDING_PUSH,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
        {
            return true;
        }
        state
            .compare_exchange(HOST, FREE, Ordering::Release, Ordering::Relaxed)
            .is_ok()
    }

    /// Publishes the completion word of a slot handed to the push path whose push never ran
    /// (the push could not be enqueued): at once for a `FREE` slot, when its handle is dropped
    /// for a slot still lent (`LENT` with a pending push). The device owns a `FREE` slot only
    /// after seeing its completion word, which nobody else stores here, so the store cannot
    /// race a later occupant. Returns false (and does nothing) in any other state.
    pub fn publish_unpushed(&self, slot: u32, word: u64) -> bool {
        let state = self.state(slot);
        let pending = (word & !STATE_MASK) | LENT | PENDING_STORE;
        if state
            .compare_exchange(
                LENT | PENDING_PUSH,
                pending,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
        {
            return true;
        }
        if state.load(Ordering::Acquire) != FREE {
            return false;
        }
        self.cpl(slot).store(word, Ordering::Release);
        true
    }

    /// Runs `f` on the first `len` bytes of a slot's data while holding it `READING` (the CPU
    /// stand-in's copy after it saw the completion). Returns `None` when the slot is not
    /// `FREE` (the host still holds or lends it).
    pub fn device_read<R>(&self, slot: u32, len: usize, f: impl FnOnce(&[u8]) -> R) -> Option<R> {
        let state = self.state(slot);
        state
            .compare_exchange(FREE, READING, Ordering::Acquire, Ordering::Relaxed)
            .ok()?;
        let len = len.min(self.slot_bytes as usize);
        // SAFETY: in state `READING` no host party may write the data area (`claim` needs
        // `FREE`), and this shared view ends before the state returns to `FREE` below.
        let bytes = unsafe { std::slice::from_raw_parts(self.data_ptr(slot), len) };
        let out = f(bytes);
        state.store(FREE, Ordering::Release);
        Some(out)
    }
}

/// The data areas of one ring (every slot's, contiguous) as a range of host memory, for a NIC
/// to write read data straight into (NVMe/RDMA: the keyed SGL of a read names its slot). Keeps
/// the ring's memory alive. Get one from [`crate::HostRing::data_area`].
///
/// Registering the range gives the peer access to every slot's bytes; the proxy names a slot
/// only in the command of the read that holds it (`LENT`), and a command that may still be
/// written to after it ended has its queue pair destroyed first, so the device reads a slot's
/// data only after the command that filled it is over.
#[derive(Clone)]
pub struct DataArea {
    mem: Arc<RingMem>,
}

impl std::fmt::Debug for DataArea {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataArea")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .finish()
    }
}

impl DataArea {
    pub(crate) fn new(mem: Arc<RingMem>) -> DataArea {
        DataArea { mem }
    }

    /// Host address of slot 0's data.
    pub fn addr(&self) -> u64 {
        self.mem.host_addr() + self.mem.layout.data as u64
    }

    /// Bytes of all the data areas (slots times slot size).
    pub fn len(&self) -> usize {
        self.mem.layout.len - self.mem.layout.data
    }

    /// Always false (a ring has at least two slots).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

// SAFETY: `addr()..addr() + len()` lies inside the ring's host block (the layout puts the data
// areas last), which `mem` keeps allocated at a fixed address (heap words or a pinned
// allocation, never moved or resized) for as long as this value lives; both values are
// computed from immutable fields, so they are the same on every call.
unsafe impl nvmf_rdma::DeviceMemory for DataArea {
    fn device_range(&self) -> (u64, usize) {
        (self.addr(), self.len())
    }
}

/// An owned handle on the data area of a taken ring slot (from [`crate::HostRing::lend`]), to
/// give to a command that receives a read into it. Dropping it returns the area to the ring
/// and, when the slot was completed meanwhile, publishes its completion word.
pub struct SlotData {
    mem: Option<Arc<RingMem>>,
    slot: u32,
}

impl std::fmt::Debug for SlotData {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotData")
            .field("slot", &self.slot)
            .field("len", &self.len())
            .finish()
    }
}

impl SlotData {
    /// A handle with no bytes (what lending a slot that is not taken gives).
    pub fn empty() -> SlotData {
        SlotData { mem: None, slot: 0 }
    }

    /// The slot number.
    pub fn slot(&self) -> u32 {
        self.slot
    }

    /// Bytes of the data area (the ring's slot size; 0 for an empty handle).
    pub fn len(&self) -> usize {
        self.mem.as_ref().map_or(0, |m| m.slot_bytes as usize)
    }

    /// True for an empty handle.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl AsRef<[u8]> for SlotData {
    fn as_ref(&self) -> &[u8] {
        match &self.mem {
            // SAFETY: while this handle exists the slot is `LENT` (possibly with a pending
            // completion), a state in which nobody else touches the data; the view borrows the
            // handle.
            Some(m) => unsafe {
                std::slice::from_raw_parts(m.data_ptr(self.slot), m.slot_bytes as usize)
            },
            None => &[],
        }
    }
}

impl AsMut<[u8]> for SlotData {
    fn as_mut(&mut self) -> &mut [u8] {
        match &self.mem {
            // SAFETY: as in `as_ref`; the view borrows the handle mutably, so it is the only
            // view.
            Some(m) => unsafe {
                std::slice::from_raw_parts_mut(m.data_ptr(self.slot), m.slot_bytes as usize)
            },
            None => &mut [],
        }
    }
}

impl Drop for SlotData {
    fn drop(&mut self) {
        let Some(mem) = self.mem.take() else {
            return;
        };
        let state = mem.state(self.slot);
        loop {
            let cur = state.load(Ordering::Acquire);
            let next = if cur & PENDING_STORE != 0 {
                mem.cpl(self.slot)
                    .store(cur & !STATE_MASK, Ordering::Release);
                FREE
            } else if cur & PENDING_PUSH != 0 {
                FREE
            } else {
                HOST
            };
            // Only this handle and `complete*` (which move LENT to a pending state) change a
            // lent slot, so the exchange fails at most once.
            if state
                .compare_exchange(cur, next, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_packed_and_aligned() {
        let l = HostLayout::new(4, 512);
        assert_eq!(
            (l.req, l.cpl, l.ctl, l.data, l.len),
            (0, 64, 96, 4096, 6144)
        );
        let l = HostLayout::new(4096, 131072);
        assert_eq!(l.data % 4096, 0);
        assert!(l.data >= 24 * 4096 + 64);
    }

    #[test]
    fn slot_states_guard_the_data() {
        let (mem, mut token) = RingMem::new_heap(2, 512);
        assert!(mem.host_data(0, &mut token).is_empty());
        assert!(mem.claim(0));
        assert!(!mem.claim(0));
        mem.host_data(0, &mut token)[0] = 7;
        assert_eq!(mem.device_read(0, 1, |b| b[0]), None);
        let mut lent = mem.lend(0).unwrap();
        assert!(mem.lend(0).is_none());
        assert!(mem.host_data(0, &mut token).is_empty());
        lent.as_mut()[1] = 9;
        // Completed while lent: the word waits for the handle.
        assert!(mem.complete(0, 5 << 48));
        assert_eq!(mem.cpl(0).load(Ordering::Acquire), 0);
        drop(lent);
        assert_eq!(mem.cpl(0).load(Ordering::Acquire), 5 << 48);
        assert_eq!(mem.device_read(0, 2, |b| (b[0], b[1])), Some((7, 9)));
        assert!(!mem.complete(0, 6 << 48));
        // A lend returned before completion gives the slot back to the host.
        assert!(mem.claim(1));
        drop(mem.lend(1).unwrap());
        assert_eq!(mem.host_data(1, &mut token).len(), 512);
        assert!(mem.complete_push(1));
        assert_eq!(mem.cpl(1).load(Ordering::Acquire), 0);
        assert!(mem.claim(1));
    }

    #[test]
    fn a_push_that_never_ran_publishes_from_the_host() {
        let (mem, _token) = RingMem::new_heap(2, 512);
        // Completed for the push path while lent: the word waits for the handle.
        assert!(mem.claim(0));
        let lent = mem.lend(0).unwrap();
        assert!(mem.complete_push(0));
        assert!(mem.publish_unpushed(0, 3 << 48 | 6 << 32));
        assert_eq!(mem.cpl(0).load(Ordering::Acquire), 0);
        drop(lent);
        assert_eq!(mem.cpl(0).load(Ordering::Acquire), 3 << 48 | 6 << 32);
        // Completed for the push path while held: stored at once.
        assert!(mem.claim(1));
        assert!(mem.complete_push(1));
        assert!(mem.publish_unpushed(1, 4 << 48 | 6 << 32));
        assert_eq!(mem.cpl(1).load(Ordering::Acquire), 4 << 48 | 6 << 32);
        // Not for a slot the host holds.
        assert!(mem.claim(1));
        assert!(!mem.publish_unpushed(1, 5 << 48));
    }
}
