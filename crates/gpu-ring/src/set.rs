//! [`RingSet`]: the rings of one consumer, their memory and the device descriptor table.

use std::sync::Arc;

use crate::host::HostRing;
use crate::proto::{LBA_LIMIT, MAX_NAMESPACES, NsBinding};
use crate::shared::{HostLayout, HostToken, RingMem};
use crate::standin::{DeviceMem, DeviceRing};

/// How the bytes of a completed read reach the destination the device asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataMode {
    /// The read lands in the slot's data area (pinned host memory); the waiting warp copies it
    /// to its destination (suits 512 B - 4 KiB).
    Pull,
    /// The host copies completed slots to the device in batches (one host-to-device copy and
    /// the `nvmf_ring_push` kernel), which also stores the completion words (larger reads).
    Push,
    /// The slots' data areas are device memory (GPU sets only) that the NIC writes: over
    /// NVMe/RDMA the keyed SGL of a read names its slot there (the proxy registers the areas
    /// through dma-buf) and the host writes the completion word after flushing the NIC's
    /// writes (`cuFlushGPUDirectRDMAWrites`); the waiting warp then copies the data to its
    /// destination from device memory, as in pull mode. No byte passes through host memory.
    Device,
}

impl DataMode {
    /// The value of `mode` in the device descriptor (0 pull, 1 push).
    pub const fn as_u32(self) -> u32 {
        match self {
            DataMode::Pull | DataMode::Device => 0,
            DataMode::Push => 1,
        }
    }
}

impl RingConfig {
    /// Bytes of each slot's data area in the host block: none in [`DataMode::Device`], whose
    /// data areas are device memory.
    pub const fn host_slot_bytes(&self) -> u32 {
        match self.mode {
            DataMode::Device => 0,
            DataMode::Pull | DataMode::Push => self.slot_bytes,
        }
    }
}

/// Shape of every ring of a set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingConfig {
    /// Slots per ring: a power of two, 2..=4096.
    pub slots: u32,
    /// Bytes of each slot's data area: a multiple of 512, at most 128 KiB.
    pub slot_bytes: u32,
    /// How data reaches the device.
    pub mode: DataMode,
}

/// Most rings in one set.
pub const MAX_RINGS: u32 = 1024;
/// Largest slot data area.
pub const MAX_SLOT_BYTES: u32 = 128 * 1024;

/// Why a ring set could not be created.
#[derive(Debug, thiserror::Error)]
pub enum RingError {
    /// A configuration value is out of range.
    #[error("invalid ring configuration: {0}")]
    Config(String),
    /// The GPU memory could not be set up.
    #[error(transparent)]
    Gpu(#[from] gpu::GpuError),
}

impl RingConfig {
    /// Checks the configuration and the namespace table for `nrings` rings.
    pub fn validate(&self, nrings: u32, namespaces: &[NsBinding]) -> Result<(), RingError> {
        let bad = |m: String| Err(RingError::Config(m));
        if !(1..=MAX_RINGS).contains(&nrings) {
            return bad(format!("{nrings} rings (1..={MAX_RINGS})"));
        }
        if !self.slots.is_power_of_two() || !(2..=4096).contains(&self.slots) {
            return bad(format!("{} slots (a power of two, 2..=4096)", self.slots));
        }
        if self.slot_bytes == 0 || self.slot_bytes % 512 != 0 || self.slot_bytes > MAX_SLOT_BYTES {
            return bad(format!(
                "slot size {} (a multiple of 512, at most {MAX_SLOT_BYTES})",
                self.slot_bytes
            ));
        }
        if namespaces.is_empty() || namespaces.len() > MAX_NAMESPACES {
            return bad(format!(
                "{} namespaces (1..={MAX_NAMESPACES})",
                namespaces.len()
            ));
        }
        for ns in namespaces {
            if !ns.block_size.is_power_of_two() || ns.block_size < 512 {
                return bad(format!(
                    "namespace {}: block size {}",
                    ns.nsid, ns.block_size
                ));
            }
            if ns.blocks > LBA_LIMIT {
                return bad(format!(
                    "namespace {}: {} blocks (at most 2^48)",
                    ns.nsid, ns.blocks
                ));
            }
        }
        Ok(())
    }
}

/// One ring's entry in the device descriptor table; `struct nvmf_gpu_ring` in
/// `nvmf_gpu.cuh` mirrors it field by field. All addresses are as the device sees them.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RingDesc {
    /// `req[slots]` (mapped host memory).
    pub req: u64,
    /// `cpl[slots]` (mapped host memory).
    pub cpl: u64,
    /// The `closed` control word (mapped host memory).
    pub ctl: u64,
    /// `data[slots * slot_bytes]` (mapped host memory).
    pub data: u64,
    /// `ticket` (device memory).
    pub ticket: u64,
    /// `freed[slots]` u32 (device memory).
    pub freed: u64,
    /// `abandoned[slots]` u32 (device memory).
    pub abandoned: u64,
    /// `dst[slots]` u64 (device memory).
    pub dst: u64,
    /// Slots (a power of two).
    pub slots: u32,
    /// Bytes per data slot.
    pub slot_bytes: u32,
    /// [`DataMode::as_u32`].
    pub mode: u32,
    /// Rings in the table (the same in every entry).
    pub nrings: u32,
}

/// Size of [`RingDesc`] (`sizeof(struct nvmf_gpu_ring)` on the device).
pub const RING_DESC_BYTES: usize = 80;
const _: () = assert!(std::mem::size_of::<RingDesc>() == RING_DESC_BYTES);
const _: () = assert!(std::mem::offset_of!(RingDesc, ticket) == 32);
const _: () = assert!(std::mem::offset_of!(RingDesc, dst) == 56);
const _: () = assert!(std::mem::offset_of!(RingDesc, slots) == 64);
const _: () = assert!(std::mem::offset_of!(RingDesc, nrings) == 76);

impl RingDesc {
    /// The table as bytes (little-endian, as the device reads it).
    pub fn table_bytes(table: &[RingDesc]) -> Vec<u8> {
        let mut out = Vec::with_capacity(table.len() * RING_DESC_BYTES);
        for d in table {
            for w in [
                d.req,
                d.cpl,
                d.ctl,
                d.data,
                d.ticket,
                d.freed,
                d.abandoned,
                d.dst,
            ] {
                out.extend_from_slice(&w.to_le_bytes());
            }
            for w in [d.slots, d.slot_bytes, d.mode, d.nrings] {
                out.extend_from_slice(&w.to_le_bytes());
            }
        }
        out
    }
}

/// Where the device side of a set lives.
enum Backing {
    /// Heap memory driven by the CPU stand-in.
    Host {
        device: Vec<Arc<DeviceMem>>,
        table: Box<[RingDesc]>,
    },
    /// Pinned+mapped host memory and device memory of a GPU.
    Gpu(Arc<crate::gpu_mem::GpuBacking>),
}

/// A set of rings and their device-side descriptor table, given to kernels by pointer.
///
/// Created with [`RingSet::new_gpu`] (pinned host memory mapped into the device, device
/// memory for the device-only words) or [`RingSet::new_host`] (heap memory for the CPU
/// stand-in, [`RingSet::standin_rings`]). The host sides are taken once with
/// [`RingSet::take_host_rings`] (or in parts, [`RingSet::take_host_rings_n`]); the memory stays alive until the set and every
/// [`HostRing`] and lent [`crate::SlotData`] are gone. Drop the set only after the kernels
/// using it have finished.
pub struct RingSet {
    config: RingConfig,
    namespaces: Arc<[NsBinding]>,
    mems: Vec<Arc<RingMem>>,
    tokens: Vec<HostToken>,
    backing: Backing,
}

impl std::fmt::Debug for RingSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingSet")
            .field("config", &self.config)
            .field("rings", &self.mems.len())
            .field("namespaces", &self.namespaces)
            .field("device_table", &format_args!("{:#x}", self.device_table()))
            .finish()
    }
}

impl RingSet {
    /// `nrings` rings in heap memory whose device side is the CPU stand-in
    /// ([`RingSet::standin_rings`]). `namespaces` is every ring's namespace table.
    pub fn new_host(
        nrings: u32,
        config: RingConfig,
        namespaces: &[NsBinding],
    ) -> Result<RingSet, RingError> {
        config.validate(nrings, namespaces)?;
        if config.mode == DataMode::Device {
            return Err(RingError::Config(
                "device data areas need a ring set on a GPU (RingSet::new_gpu)".into(),
            ));
        }
        let mut mems = Vec::new();
        let mut tokens = Vec::new();
        let mut device = Vec::new();
        let mut table = Vec::new();
        for _ in 0..nrings {
            let (mem, token) = RingMem::new_heap(config.slots, config.slot_bytes);
            let dev = Arc::new(DeviceMem::new(config.slots));
            table.push(ring_desc(
                &mem,
                mem.host_addr(),
                &dev.addresses(),
                &config,
                nrings,
            ));
            mems.push(mem);
            tokens.push(token);
            device.push(dev);
        }
        Ok(RingSet {
            config,
            namespaces: namespaces.into(),
            mems,
            tokens,
            backing: Backing::Host {
                device,
                table: table.into_boxed_slice(),
            },
        })
    }

    /// `nrings` rings for the GPU of `ctx`: each ring's request, completion, control and data
    /// areas in one pinned host allocation mapped into the device
    /// (`cuMemHostAlloc(DEVICEMAP | PORTABLE)`), its ticket, `freed`, `abandoned` and `dst`
    /// arrays in device memory, and the descriptor table in device memory. In
    /// [`DataMode::Device`] the data areas are device memory too, one allocation per ring
    /// ([`HostRing::device_data`]), and the host block has none.
    pub fn new_gpu(
        ctx: &gpu::GpuContext,
        nrings: u32,
        config: RingConfig,
        namespaces: &[NsBinding],
    ) -> Result<RingSet, RingError> {
        config.validate(nrings, namespaces)?;
        let blocks = (0..nrings)
            .map(|_| crate::gpu_mem::host_block(ctx, &config))
            .collect::<Result<Vec<_>, _>>()?;
        let backing = crate::gpu_mem::GpuBacking::new(ctx, &config, &blocks)?;
        let (mems, tokens) = blocks.into_iter().map(|b| (b.mem, b.token)).unzip();
        Ok(RingSet {
            config,
            namespaces: namespaces.into(),
            mems,
            tokens,
            backing: Backing::Gpu(Arc::new(backing)),
        })
    }

    /// The rings' shape.
    pub fn config(&self) -> RingConfig {
        self.config
    }

    /// Number of rings.
    pub fn len(&self) -> usize {
        self.mems.len()
    }

    /// Always false (a set has at least one ring).
    pub fn is_empty(&self) -> bool {
        self.mems.is_empty()
    }

    /// Address of the descriptor table (`const struct nvmf_gpu_ring*`, one entry per ring):
    /// device memory for a GPU set; host memory for a stand-in set.
    pub fn device_table(&self) -> u64 {
        match &self.backing {
            Backing::Host { table, .. } => table.as_ptr() as u64,
            Backing::Gpu(g) => g.table().device_ptr(),
        }
    }

    /// The descriptor table's entries (addresses as the device sees them).
    pub fn descriptors(&self) -> Vec<RingDesc> {
        match &self.backing {
            Backing::Host { table, .. } => table.to_vec(),
            Backing::Gpu(g) => g.descriptors().to_vec(),
        }
    }

    /// The host sides of the rings, in ring order; the first call takes them, later calls
    /// return an empty vector. The same as [`RingSet::take_host_rings_n`] with `usize::MAX`.
    pub fn take_host_rings(&mut self) -> Vec<HostRing> {
        self.take_host_rings_n(usize::MAX)
    }

    /// The host sides of the next `n` rings not taken yet (fewer when fewer are left), in
    /// ring order: calls in turn take contiguous parts of the set, so several consumers (one
    /// per controller, say) can each serve a share of its rings. Each [`HostRing`] keeps its
    /// index in the whole set ([`HostRing::index`]).
    pub fn take_host_rings_n(&mut self, n: usize) -> Vec<HostRing> {
        let first = self.mems.len() - self.tokens.len();
        let n = n.min(self.tokens.len());
        self.tokens
            .drain(..n)
            .zip(&self.mems[first..])
            .enumerate()
            .map(|(i, (token, mem))| {
                HostRing::new(
                    mem.clone(),
                    token,
                    (first + i) as u32,
                    self.config.slot_bytes,
                    self.config.mode,
                    self.namespaces.clone(),
                    match &self.backing {
                        Backing::Gpu(g) => g.device_data(first + i),
                        Backing::Host { .. } => None,
                    },
                )
            })
            .collect()
    }

    /// Rings whose host sides have not been taken yet.
    pub fn rings_left(&self) -> usize {
        self.tokens.len()
    }

    /// The CPU stand-in's device sides of the rings, in ring order (empty for a GPU set).
    pub fn standin_rings(&self) -> Vec<DeviceRing> {
        match &self.backing {
            Backing::Host { device, .. } => device
                .iter()
                .zip(&self.mems)
                .map(|(dev, mem)| DeviceRing::new(mem.clone(), dev.clone(), self.config))
                .collect(),
            Backing::Gpu(_) => Vec::new(),
        }
    }

    /// The descriptor table in device memory (GPU sets), to pass to kernels as a buffer:
    /// `(const unsigned char* rings, unsigned long long rings_len)`, `rings_len / 80` rings.
    pub fn table_buffer(&self) -> Option<&gpu::DeviceBuffer> {
        match &self.backing {
            Backing::Gpu(g) => Some(g.table()),
            Backing::Host { .. } => None,
        }
    }

    /// The pinned host block of ring `ring` (GPU sets): the source of push-mode copies; the
    /// data area starts at [`RingSet::host_layout`]`.data`.
    pub fn host_block(&self, ring: usize) -> Option<&gpu::PinnedBuffer> {
        match &self.backing {
            Backing::Gpu(g) => g.pinned(ring),
            Backing::Host { .. } => None,
        }
    }

    /// What the push path needs (GPU sets; `None` for a stand-in set): the table and the
    /// pinned host blocks, kept alive by the handle.
    pub fn push_source(&self) -> Option<crate::PushSource> {
        match &self.backing {
            Backing::Gpu(g) => Some(crate::PushSource::new(g.clone(), self.host_layout())),
            Backing::Host { .. } => None,
        }
    }

    /// Layout of every ring's host block.
    pub fn host_layout(&self) -> HostLayout {
        HostLayout::new(self.config.slots, self.config.host_slot_bytes())
    }
}

/// The descriptor of one ring whose host block the device sees at `host_block` and whose
/// device-only arrays are at `dev` (ticket, freed, abandoned, dst).
pub(crate) fn ring_desc(
    mem: &RingMem,
    host_block: u64,
    dev: &[u64; 4],
    config: &RingConfig,
    nrings: u32,
) -> RingDesc {
    let l = mem.layout();
    RingDesc {
        req: host_block + l.req as u64,
        cpl: host_block + l.cpl as u64,
        ctl: host_block + l.ctl as u64,
        data: host_block + l.data as u64,
        ticket: dev[0],
        freed: dev[1],
        abandoned: dev[2],
        dst: dev[3],
        slots: config.slots,
        slot_bytes: config.slot_bytes,
        mode: config.mode.as_u32(),
        nrings,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NS: [NsBinding; 1] = [NsBinding {
        nsid: 1,
        block_size: 512,
        blocks: 100,
    }];

    fn cfg(slots: u32, slot_bytes: u32) -> RingConfig {
        RingConfig {
            slots,
            slot_bytes,
            mode: DataMode::Pull,
        }
    }

    #[test]
    fn configuration_limits() {
        assert!(cfg(2, 512).validate(1, &NS).is_ok());
        assert!(cfg(4096, MAX_SLOT_BYTES).validate(MAX_RINGS, &NS).is_ok());
        for (c, n) in [
            (cfg(1, 512), 1),
            (cfg(3, 512), 1),
            (cfg(8192, 512), 1),
            (cfg(4, 0), 1),
            (cfg(4, 1000), 1),
            (cfg(4, MAX_SLOT_BYTES + 512), 1),
            (cfg(4, 512), 0),
            (cfg(4, 512), MAX_RINGS + 1),
        ] {
            let err = c.validate(n, &NS).unwrap_err();
            assert!(err.to_string().starts_with("invalid ring configuration"));
        }
        assert!(cfg(4, 512).validate(1, &[]).is_err());
        assert!(cfg(4, 512).validate(1, &[NS[0]; 9]).is_err());
        let odd = NsBinding {
            block_size: 520,
            ..NS[0]
        };
        assert!(cfg(4, 512).validate(1, &[odd]).is_err());
    }

    #[test]
    fn host_set_table_and_rings() {
        let mut set = RingSet::new_host(3, cfg(8, 4096), &NS).unwrap();
        let table = set.descriptors();
        assert_eq!(table.len(), 3);
        assert_ne!(set.device_table(), 0);
        for d in &table {
            assert_eq!((d.slots, d.slot_bytes, d.mode, d.nrings), (8, 4096, 0, 3));
            assert_eq!(d.cpl - d.req, 128);
            assert_eq!((d.data - d.req) % 4096, 0);
        }
        assert_eq!(RingDesc::table_bytes(&table).len(), 3 * RING_DESC_BYTES);
        assert_eq!(set.take_host_rings().len(), 3);
        assert!(set.take_host_rings().is_empty());
        assert_eq!(set.standin_rings().len(), 3);
    }

    #[test]
    fn host_rings_are_taken_in_contiguous_parts() {
        let mut set = RingSet::new_host(5, cfg(8, 4096), &NS).unwrap();
        assert_eq!(set.rings_left(), 5);
        let idx = |rings: &[HostRing]| rings.iter().map(HostRing::index).collect::<Vec<_>>();
        let a = set.take_host_rings_n(2);
        assert_eq!(idx(&a), [0, 1]);
        assert_eq!(set.rings_left(), 3);
        assert!(set.take_host_rings_n(0).is_empty());
        let b = set.take_host_rings_n(2);
        assert_eq!(idx(&b), [2, 3]);
        // More than are left: the rest.
        let c = set.take_host_rings_n(7);
        assert_eq!(idx(&c), [4]);
        assert_eq!(set.rings_left(), 0);
        assert!(set.take_host_rings_n(1).is_empty());
        assert!(set.take_host_rings().is_empty());
        // Each part serves its own rings: a request put in ring 3 by the device side shows up
        // in the host ring of index 3 and no other.
        let dev = set.standin_rings();
        assert_eq!(dev.len(), 5);
        assert_eq!(set.len(), 5);
        let mut all: Vec<HostRing> = a.into_iter().chain(b).chain(c).collect();
        assert!(all.iter().all(|r| !r.ready()));
        let _ticket = dev[3].submit(0, 7, 1, 0);
        let ready: Vec<u32> = all
            .iter()
            .filter(|r| r.ready())
            .map(HostRing::index)
            .collect();
        assert_eq!(ready, [3]);
        let mut reads = Vec::new();
        assert_eq!(all[3].poll(4, &mut reads), 1);
        assert_eq!((reads[0].nsid, reads[0].lba, reads[0].nblocks), (1, 7, 1));
    }

    #[test]
    fn gpu_sets_need_a_driver_and_map_every_ring() {
        let ctx = match gpu::GpuContext::new(0) {
            Ok(ctx) => ctx,
            Err(e) => {
                assert!(e.is_unavailable(), "{e}");
                let msg = e.to_string();
                println!("SKIP gpu_sets_need_a_driver_and_map_every_ring: {msg}");
                return;
            }
        };
        let mut set = RingSet::new_gpu(&ctx, 2, cfg(8, 4096), &NS).unwrap();
        assert_eq!(set.table_buffer().unwrap().len(), 2 * RING_DESC_BYTES);
        assert_eq!(set.device_table(), set.table_buffer().unwrap().device_ptr());
        for (i, d) in set.descriptors().iter().enumerate() {
            let block = set.host_block(i).unwrap();
            assert_eq!(d.req, block.mapped_device_ptr().unwrap());
            assert_eq!(d.freed, d.ticket + 8);
        }
        assert_eq!(set.take_host_rings().len(), 2);
        assert!(set.standin_rings().is_empty());
    }
}
