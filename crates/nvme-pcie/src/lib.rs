//! User-space NVMe PCIe driver core.
//!
//! This crate drives an NVMe controller's queues directly, as SPDK does: the submission and
//! completion queues live in memory the device reaches by DMA, completions are polled by phase
//! tag, and each doorbell is written once per batch. It is built around a narrow seam, the
//! [`Device`] trait: 32/64-bit accesses to BAR0 registers and doorbells, plus a one-time call
//! that maps the [`DmaArena`] for the device. [`vfio::VfioNvme`] implements it for a controller
//! bound to `vfio-pci` (BAR0 mapped, bus mastering on, the arena mapped through the IOMMU);
//! [`model::ModelController`] implements it with an in-memory controller for tests and
//! benchmarks. The `vfio_probe` example drives a real controller end to end (run against
//! QEMU's emulated NVMe controller by `tests/tests/nvme_pcie_vfio.rs`); `blockdev`'s `pcie:`
//! backend serves namespaces through it.
//!
//! - [`Controller::new`] brings a controller up: CC.EN = 0 and wait for CSTS.RDY = 0 (within
//!   CAP.TO), admin queue (AQA/ASQ/ACQ), CC with MPS, CSS = NVM, IOSQES = 6, IOCQES = 4 and
//!   EN = 1, wait for RDY, Identify Controller, the active namespace list and each namespace,
//!   Set Features Number of Queues. Dropping the last handle shuts it down (CC.SHN, wait for
//!   CSTS.SHST).
//! - [`Controller::create_io_queue`] creates one polled I/O CQ (interrupts off) and its SQ: an
//!   [`IoQueuePair`] for one reactor. [`IoQueuePair::read`]/[`write`](IoQueuePair::write)/
//!   [`flush`](IoQueuePair::flush) only write entries (command identifiers index preallocated
//!   trackers, each with its own PRP list page); [`IoQueuePair::ring`] writes the SQ tail
//!   doorbell once; [`IoQueuePair::poll`] reaps a bounded batch and writes the CQ head doorbell
//!   once. The SQ head reported in each completion bounds submissions.
//! - [`IoQueuePair::check`] (periodic) handles a failed controller (CSTS.CFS) and timeouts:
//!   Abort, then a controller reset. No caller ever waits forever: every outstanding command
//!   completes, with an error if need be.
//!
//! Addresses given to the device are IOVAs this crate hands out from its arena (low memory, as
//! QEMU's emulated IOMMU allows only 39-bit addresses), never process virtual addresses.
//! Queue memory and PRP lists are accessed only through volatile operations in the private
//! `sys` module, never through references; data buffers ([`DmaBuf`]) move into the driver on
//! submission and come back in the [`Completion`], so they cannot be freed or reused while the
//! device owns them, and their owner may borrow them as slices in between
//! ([`DmaBuf::as_slice`]), which is how callers read and write data without a copy.
//! [`IoQueuePair::write_zeroes`] and [`IoQueuePair::deallocate`] exist for controllers whose
//! ONCS lists them ([`ControllerInfo`]).
//!
//! What this crate must not do: spawn threads or tasks, depend on an async runtime, sleep or
//! read the clock on the I/O path (only bring-up, admin commands and [`IoQueuePair::check`]
//! wait), hand the device a process virtual address, create a Rust reference to memory the
//! device may be using (queues, PRP lists, a submitted buffer), use `unsafe` outside the `sys`
//! module, or panic on anything a device reports.
//! Only admin commands allocate; steady-state I/O does not.
#![deny(unsafe_code)]

mod arena;
mod controller;
mod error;
pub mod model;
pub mod prp;
mod queue;
pub mod regs;
mod ring;
#[allow(unsafe_code)]
mod sys;
pub mod vfio;

pub use arena::{ARENA_PAGE, DEFAULT_IOVA_BASE, DmaArena, DmaBuf, DmaWindow};
pub use controller::{Config, Controller, ControllerInfo, Namespace};
pub use error::{DeviceError, Error};
pub use queue::{ABORTED, Completion, IoQueuePair, Rejected};
pub use regs::Device;
