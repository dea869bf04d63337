//! GPU backing of a [`crate::RingSet`]: pinned host blocks mapped into the device, the
//! device-only arrays and the descriptor table in device memory.

use std::sync::Arc;

use gpu::{DeviceBuffer, GpuContext, GpuError, PinnedBuffer};

use crate::proto::LAPS;
use crate::set::{RingConfig, RingDesc, RingError, ring_desc};
use crate::shared::{HostLayout, HostToken, RingMem};

/// Offsets of the device-only words of one ring in its device allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DeviceLayout {
    pub(crate) ticket: usize,
    pub(crate) freed: usize,
    pub(crate) abandoned: usize,
    pub(crate) dst: usize,
    pub(crate) len: usize,
}

impl DeviceLayout {
    pub(crate) const fn new(slots: u32) -> DeviceLayout {
        let n = slots as usize;
        DeviceLayout {
            ticket: 0,
            freed: 8,
            abandoned: 8 + 4 * n,
            dst: 8 + 8 * n,
            len: 8 + 16 * n,
        }
    }
}

/// One ring's host block in pinned memory mapped into the device.
pub(crate) struct HostBlock {
    pub(crate) mem: Arc<RingMem>,
    pub(crate) token: HostToken,
    pub(crate) pinned: Arc<PinnedBuffer>,
    pub(crate) device_addr: u64,
}

pub(crate) fn host_block(ctx: &GpuContext, config: &RingConfig) -> Result<HostBlock, RingError> {
    let layout = HostLayout::new(config.slots, config.host_slot_bytes());
    let buffer = ctx.alloc_pinned_mapped(layout.len)?;
    let device_addr = buffer.mapped_device_ptr().ok_or(GpuError::Driver {
        call: "cuMemHostGetDevicePointer",
        code: 0,
        name: String::from("CUDA_SUCCESS"),
        description: String::from("mapped memory without a device address"),
    })?;
    let (mem, token, pinned) = RingMem::new_pinned(buffer, config.slots, config.host_slot_bytes())?;
    Ok(HostBlock {
        mem,
        token,
        pinned,
        device_addr,
    })
}

/// The device memory of a GPU ring set. Field order is drop order: the table first, whose
/// drop waits for the kernels that were given it.
pub(crate) struct GpuBacking {
    table: DeviceBuffer,
    descs: Vec<RingDesc>,
    _device: Vec<DeviceBuffer>,
    /// [`crate::DataMode::Device`]: each ring's data areas.
    data: Vec<Arc<DeviceBuffer>>,
    pinned: Vec<Arc<PinnedBuffer>>,
}

impl GpuBacking {
    /// Allocates and initialises the device-only arrays (`freed` = 65535 so lap 1 may take
    /// every slot, the rest zero) and uploads the descriptor table.
    pub(crate) fn new(
        ctx: &GpuContext,
        config: &RingConfig,
        blocks: &[HostBlock],
    ) -> Result<GpuBacking, RingError> {
        let dl = DeviceLayout::new(config.slots);
        let nrings = blocks.len() as u32;
        let mut device = Vec::new();
        let mut data = Vec::new();
        let mut descs = Vec::new();
        for block in blocks {
            let mut buf = ctx.alloc_zeroed(dl.len)?;
            buf.slice_mut(dl.freed..dl.abandoned)?
                .fill_u32(LAPS as u32)?;
            let base = buf.device_ptr();
            let addrs = [
                base + dl.ticket as u64,
                base + dl.freed as u64,
                base + dl.abandoned as u64,
                base + dl.dst as u64,
            ];
            let mut desc = ring_desc(&block.mem, block.device_addr, &addrs, config, nrings);
            if config.mode == crate::DataMode::Device {
                let area =
                    ctx.alloc_exportable(config.slots as usize * config.slot_bytes as usize)?;
                desc.data = area.device_ptr();
                data.push(Arc::new(area));
            }
            descs.push(desc);
            device.push(buf);
        }
        let bytes = RingDesc::table_bytes(&descs);
        let mut table = ctx.alloc(bytes.len())?;
        table.copy_from_host(&bytes)?;
        Ok(GpuBacking {
            table,
            descs,
            _device: device,
            data,
            pinned: blocks.iter().map(|b| b.pinned.clone()).collect(),
        })
    }

    pub(crate) fn table(&self) -> &DeviceBuffer {
        &self.table
    }

    pub(crate) fn descriptors(&self) -> &[RingDesc] {
        &self.descs
    }

    pub(crate) fn device_data(&self, ring: usize) -> Option<Arc<DeviceBuffer>> {
        self.data.get(ring).cloned()
    }

    pub(crate) fn pinned(&self, ring: usize) -> Option<&PinnedBuffer> {
        self.pinned.get(ring).map(|p| &**p)
    }
}

/// What the push path of a GPU ring set needs after the set is handed out: the descriptor
/// table and the pinned host blocks (from [`crate::RingSet::push_source`]). It keeps that
/// memory alive, so a push never outlives the memory it reads or the table its kernel is
/// given, even when the [`crate::RingSet`] itself is dropped first.
#[derive(Clone)]
pub struct PushSource {
    backing: Arc<GpuBacking>,
    layout: HostLayout,
}

impl std::fmt::Debug for PushSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PushSource")
            .field("rings", &self.backing.pinned.len())
            .field("layout", &self.layout)
            .finish()
    }
}

impl PushSource {
    pub(crate) fn new(backing: Arc<GpuBacking>, layout: HostLayout) -> PushSource {
        PushSource { backing, layout }
    }

    /// The descriptor table in device memory (the push kernel's first argument).
    pub fn table(&self) -> &DeviceBuffer {
        self.backing.table()
    }

    /// The pinned host block of ring `ring`; its data area starts at [`PushSource::layout`]
    /// `.data`.
    pub fn host_block(&self, ring: u32) -> Option<&PinnedBuffer> {
        self.backing.pinned(ring as usize)
    }

    /// Layout of every ring's host block.
    pub fn layout(&self) -> HostLayout {
        self.layout
    }

    /// Number of rings in the set.
    pub fn rings(&self) -> usize {
        self.backing.pinned.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_layout_is_packed_and_aligned() {
        let l = DeviceLayout::new(4);
        assert_eq!(
            (l.ticket, l.freed, l.abandoned, l.dst, l.len),
            (0, 8, 24, 40, 72)
        );
        for slots in [2, 32, 4096] {
            assert_eq!(DeviceLayout::new(slots).dst % 8, 0);
        }
    }
}
