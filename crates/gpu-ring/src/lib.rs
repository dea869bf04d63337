//! Request and completion rings shared by GPU threads and the host, so GPU threads can issue
//! their own reads over NVMe-oF.
//!
//! A *ring* has `N` slots (a power of two). A GPU thread (or a warp, with one atomic for all of
//! its lanes) takes a *ticket* `t` from a counter in device memory; its slot is `t % N` and its
//! *lap* `(t / N) % 65535 + 1`. It writes a 16-byte request into the slot, the host's proxy
//! takes requests in ticket order, checks each one (namespace bound to the ring, LBA range,
//! size), reads the data over the fabric into the slot's data area and writes an 8-byte
//! completion word; the thread sees the word, copies the data to its destination and releases
//! the slot for the next lap.
//!
//! # Memory and ordering
//!
//! Devices whose host memory accesses are not coherent atomics (`hostNativeAtomicSupported =
//! 0`, e.g. H100 over PCIe) cannot share an atomic with the CPU on host memory. So:
//!
//! - everything that needs an atomic read-modify-write is device memory touched only by the
//!   device: the ticket counter, `freed[N]` (lap of the last occupant that released each slot),
//!   `abandoned[N]` (lap of an occupant that timed out) and `dst[N]` (push destinations);
//! - what the two sides exchange is pinned host memory mapped into the device, written by one
//!   side only: the requests `req[N]` (device -> host), the completion words `cpl[N]` and the
//!   data areas (host -> device), and a `closed` word (host -> device).
//!
//! Every exchanged word carries the lap of its ticket in bits 48..64 ([`proto`]). A reader
//! accepts a word only when the lap matches the one it expects, which gives the ordering rules:
//!
//! 1. *Request*: the device stores `w1` then `w0` with system-scope stores; the host takes the
//!    request only when both words carry the expected lap. A torn or stale request has a word
//!    with another lap, and is simply not ready yet; no fence per request is needed.
//! 2. *Completion*: the host writes the data area, then stores the completion word with Release
//!    ordering (on x86 stores are not reordered with earlier stores, and PCIe delivers posted
//!    writes of one host to the device in order). The device polls the word with an acquire
//!    load at system scope, so when it sees the lap, the data before it is visible.
//! 3. *Release*: after copying the data out, the device fences and moves `freed[slot]` from
//!    the previous lap to its own with an atomic compare-and-swap in device memory; only then
//!    can the next lap's ticket holder write a request into the slot, so the host never sees
//!    a new request in a slot whose data the device still reads. The host additionally never
//!    takes a request into a slot it has not completed.
//! 4. *Timeout*: a waiter that gives up marks `abandoned[slot] = lap`; the next occupant of
//!    the slot releases it on its behalf once the late completion word has arrived, so a
//!    timeout never leaves a slot stuck and never lets a late completion's data land in the
//!    next occupant's read.
//! 5. *Close*: dropping a [`HostRing`] sets `closed`; waiting and submitting device threads
//!    return `CLOSED` instead of waiting for a host that is gone.
//! 6. *Device data areas* ([`DataMode::Device`]): the data areas are device memory that a NIC
//!    writes (NVMe/RDMA). The host learns that a read's data is placed from the transport's
//!    completion (on a reliable connection it arrives after the data), then flushes the NIC's
//!    writes towards the GPU (`cuFlushGPUDirectRDMAWrites`), and only then stores the
//!    completion word; the device's acquire load of the word (rule 2) then orders its loads of
//!    the data after the flushed writes.
//!
//! The [`standin`] module implements the device side in Rust for tests; the CUDA header
//! `cuda-kernels/include/nvmf_gpu.cuh` implements it for kernels.
//!
//! # Host API
//!
//! [`RingSet::new_gpu`] (or [`RingSet::new_host`] for the stand-in) creates the rings and the
//! device descriptor table ([`RingSet::device_table`], one [`RingDesc`] per ring) that kernels
//! get by pointer. [`RingSet::take_host_rings`] gives one [`HostRing`] per ring to the task
//! that serves it ([`RingSet::take_host_rings_n`] takes them in contiguous parts, for several
//! consumers): [`HostRing::poll`] takes and validates requests, [`HostRing::data_mut`] /
//! [`HostRing::lend`] give the data area to receive into, and [`HostRing::complete`] (pull
//! mode) or [`HostRing::complete_push`] (push mode) finish them. Invalid requests are
//! completed by `poll` itself with Invalid Namespace or Format, Invalid Field or LBA Out of
//! Range ([`proto::status`]), never reaching the wire.
//!
//! # Details beyond the base layout
//!
//! - Each ring's host block has a 64-byte control area after `cpl[]` whose first word is the
//!   `closed` flag ([`HostLayout`]); `CLOSED` (0xFFFE) and `TIMEOUT` (0xFFFF) are statuses
//!   only the device side produces.
//! - The device writes arguments it cannot encode (zero or more than 65536 blocks, an LBA of
//!   2^48 or more, a namespace index above 255) as a request with [`proto::FLAG_BAD_ARGS`],
//!   answered with Invalid Field.
//! - [`HostRing::complete`] may be called while the slot's data is lent ([`SlotData`]): the
//!   completion word is published when the handle is dropped. `data_mut` / `lend` of a slot
//!   that is not taken give an empty slice / handle, and completing it is ignored and counted
//!   ([`RingStats::stray_completions`]).
//! - Push mode: [`HostRing::complete_push`] returns a [`PushItem`] for the push kernel, which
//!   stores the completion word after copying the data.
#![deny(unsafe_code)]

mod gpu_mem;
mod host;
pub mod proto;
mod set;
#[allow(unsafe_code)]
mod shared;
pub mod standin;

pub use gpu_mem::PushSource;
pub use host::{HostRing, PushItem, RingStats};
pub use proto::{NsBinding, Read};
pub use set::{
    DataMode, MAX_RINGS, MAX_SLOT_BYTES, RING_DESC_BYTES, RingConfig, RingDesc, RingError, RingSet,
};
pub use shared::{DataArea, HostLayout, SlotData};
