//! Controller registers in BAR0 (NVMe Base Specification 2.0, section 3.1) and the device seam.

use crate::arena::DmaWindow;

/// Controller Capabilities (64-bit).
pub const CAP: u32 = 0x00;
/// Version.
pub const VS: u32 = 0x08;
/// Interrupt Mask Set.
pub const INTMS: u32 = 0x0C;
/// Controller Configuration.
pub const CC: u32 = 0x14;
/// Controller Status.
pub const CSTS: u32 = 0x1C;
/// Admin Queue Attributes.
pub const AQA: u32 = 0x24;
/// Admin Submission Queue Base Address (64-bit).
pub const ASQ: u32 = 0x28;
/// Admin Completion Queue Base Address (64-bit).
pub const ACQ: u32 = 0x30;
/// First doorbell register.
pub const DOORBELL_BASE: u32 = 0x1000;

/// CC.EN.
pub const CC_EN: u32 = 1;
/// CC.SHN normal shutdown (bits 15:14 = 01b).
pub const CC_SHN_NORMAL: u32 = 1 << 14;
/// CC.SHN field mask.
pub const CC_SHN_MASK: u32 = 0b11 << 14;
/// CSTS.RDY.
pub const CSTS_RDY: u32 = 1;
/// CSTS.CFS (controller fatal status).
pub const CSTS_CFS: u32 = 1 << 1;
/// CSTS.SHST field mask (bits 3:2).
pub const CSTS_SHST_MASK: u32 = 0b11 << 2;
/// CSTS.SHST = shutdown processing complete.
pub const CSTS_SHST_COMPLETE: u32 = 0b10 << 2;

/// Builds CC: I/O queue entry sizes 2^6 / 2^4, the NVM command set, memory page size
/// 2^(12 + `mps`), enabled or not.
pub const fn cc_value(mps: u8, enable: bool) -> u32 {
    (4 << 20) | (6 << 16) | ((mps as u32 & 0xF) << 7) | (enable as u32)
}

/// The fields of CAP this driver uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cap {
    /// Maximum queue entries supported (a count, converted from the 0's based field).
    pub mqes: u32,
    /// Contiguous queues required.
    pub cqr: bool,
    /// Worst-case time to become ready or not ready, in 500 ms units.
    pub to: u8,
    /// Doorbell stride: doorbells are `4 << dstrd` bytes apart.
    pub dstrd: u8,
    /// The NVM command set is supported (CSS bit 0).
    pub css_nvm: bool,
    /// Minimum memory page size, 2^(12 + mpsmin).
    pub mpsmin: u8,
    /// Maximum memory page size, 2^(12 + mpsmax).
    pub mpsmax: u8,
}

impl Cap {
    /// Decodes the 64-bit register.
    pub const fn from_raw(v: u64) -> Self {
        Cap {
            mqes: (v & 0xFFFF) as u32 + 1,
            cqr: (v >> 16) & 1 == 1,
            to: ((v >> 24) & 0xFF) as u8,
            dstrd: ((v >> 32) & 0xF) as u8,
            css_nvm: (v >> 37) & 1 == 1,
            mpsmin: ((v >> 48) & 0xF) as u8,
            mpsmax: ((v >> 52) & 0xF) as u8,
        }
    }

    /// Encodes the fields back into the register (other fields zero).
    pub const fn to_raw(&self) -> u64 {
        ((self.mqes.saturating_sub(1) as u64) & 0xFFFF)
            | ((self.cqr as u64) << 16)
            | ((self.to as u64) << 24)
            | ((self.dstrd as u64 & 0xF) << 32)
            | ((self.css_nvm as u64) << 37)
            | ((self.mpsmin as u64 & 0xF) << 48)
            | ((self.mpsmax as u64 & 0xF) << 52)
    }
}

/// Offset of the submission queue `qid` tail doorbell.
pub const fn sq_tail_doorbell(qid: u16, dstrd: u8) -> u32 {
    DOORBELL_BASE + (2 * qid as u32) * (4 << dstrd)
}

/// Offset of the completion queue `qid` head doorbell.
pub const fn cq_head_doorbell(qid: u16, dstrd: u8) -> u32 {
    DOORBELL_BASE + (2 * qid as u32 + 1) * (4 << dstrd)
}

/// The device seam: what the driver needs from a PCIe NVMe function. A VFIO-backed device
/// maps BAR0 and the arena through the IOMMU; [`crate::model::ModelController`] is an
/// in-memory controller behind the same calls.
///
/// Register accesses are MMIO: 32-bit accesses at 4-byte aligned offsets of BAR0. 64-bit
/// registers (CAP, ASQ, ACQ) default to two 32-bit accesses, low dword first.
pub trait Device: Send + Sync {
    /// Reads the 32-bit register at `offset`.
    fn read32(&self, offset: u32) -> u32;
    /// Writes the 32-bit register at `offset`.
    fn write32(&self, offset: u32, value: u32);
    /// Reads the 64-bit register at `offset`.
    fn read64(&self, offset: u32) -> u64 {
        u64::from(self.read32(offset)) | (u64::from(self.read32(offset + 4)) << 32)
    }
    /// Writes the 64-bit register at `offset`.
    fn write64(&self, offset: u32, value: u64) {
        self.write32(offset, value as u32);
        self.write32(offset + 4, (value >> 32) as u32);
    }
    /// Makes the arena reachable by the device at its IOVAs (an IOMMU mapping). Called once,
    /// before the controller is enabled.
    fn map_dma(&self, window: &DmaWindow) -> Result<(), crate::DeviceError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cap_round_trip_and_doorbells() {
        let cap = Cap {
            mqes: 1024,
            cqr: true,
            to: 20,
            dstrd: 2,
            css_nvm: true,
            mpsmin: 0,
            mpsmax: 4,
        };
        assert_eq!(Cap::from_raw(cap.to_raw()), cap);
        assert_eq!(sq_tail_doorbell(0, 0), 0x1000);
        assert_eq!(cq_head_doorbell(0, 0), 0x1004);
        assert_eq!(sq_tail_doorbell(3, 0), 0x1018);
        assert_eq!(cq_head_doorbell(1, 2), 0x1000 + 3 * 16);
        assert_eq!(cc_value(0, true), 0x0046_0001);
    }
}
