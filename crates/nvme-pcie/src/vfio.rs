//! The [`Device`] for a real controller bound to `vfio-pci`.
//!
//! [`VfioNvme::open`] opens the device through a VFIO container (type 1 IOMMU), maps BAR0,
//! and turns on memory space and bus mastering in the PCI command register. The driver's
//! [`Device::map_dma`] call maps the arena at its IOVAs; [`VfioNvme::iova_ranges`] reports the
//! ranges the IOMMU accepts (QEMU's emulated IOMMU: 39 bits) and [`choose_iova_base`] picks a
//! base for the arena inside them. Interrupts are never enabled: the driver polls.

use std::path::Path;
use std::sync::Arc;

use parking_lot::Mutex;
use vfio_bindings::bindings::vfio::{
    VFIO_IOMMU_INFO_CAPS, VFIO_IOMMU_TYPE1_INFO_CAP_IOVA_RANGE, VFIO_PCI_BAR0_REGION_INDEX,
    VFIO_PCI_CONFIG_REGION_INDEX, VFIO_REGION_INFO_FLAG_MMAP,
};
use vfio_ioctls::{VfioContainer, VfioDevice, VfioOps};

use crate::arena::{ARENA_PAGE, DmaWindow};
use crate::error::DeviceError;
use crate::regs::{self, Device};
use crate::sys::{self, Mmio};

/// PCI command register offset in configuration space.
const PCI_COMMAND: u64 = 0x04;
/// PCI command: memory space enable and bus master enable.
const PCI_COMMAND_MEMORY_MASTER: u16 = 0b110;

/// An NVMe controller bound to `vfio-pci`.
pub struct VfioNvme {
    bar0: Mmio,
    device: VfioDevice,
    container: Arc<VfioContainer>,
    /// The mapped arena: IOVA, length and the memory (kept alive while mapped).
    mapped: Mutex<Option<DmaWindow>>,
}

impl std::fmt::Debug for VfioNvme {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VfioNvme").finish_non_exhaustive()
    }
}

fn err(what: &str, e: impl std::fmt::Display) -> DeviceError {
    DeviceError(format!("{what}: {e}"))
}

impl VfioNvme {
    /// Opens the PCI function at `sysfs_path` (e.g. `/sys/bus/pci/devices/0000:00:04.0`),
    /// which must be bound to `vfio-pci` with its IOMMU group viable. A function bound to any
    /// other driver (or to none) is refused; nothing is ever unbound or rebound here.
    pub fn open(sysfs_path: &Path) -> Result<Self, DeviceError> {
        let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
        check_bound_to_vfio(sysfs_path, &mounts)?;
        let container = Arc::new(VfioContainer::new(None).map_err(|e| {
            err(
                "VFIO container (is vfio_iommu_type1 loaded and an IOMMU enabled?)",
                e,
            )
        })?);
        let ops: Arc<dyn VfioOps> = container.clone();
        let device = VfioDevice::new(sysfs_path, ops, false)
            .map_err(|e| err(&format!("VFIO device {}", sysfs_path.display()), e))?;
        let bar = VFIO_PCI_BAR0_REGION_INDEX;
        let size = device.get_region_size(bar);
        if device.get_region_flags(bar) & VFIO_REGION_INFO_FLAG_MMAP == 0 {
            return Err(DeviceError("BAR0 cannot be mapped".into()));
        }
        if size < u64::from(regs::DOORBELL_BASE) + 8 {
            return Err(DeviceError(format!(
                "BAR0 of {size} bytes is too small for NVMe"
            )));
        }
        let len = usize::try_from(size).map_err(|e| err("BAR0 size", e))?;
        let bar0 = {
            use std::os::fd::AsRawFd;
            Mmio::map(device.as_raw_fd(), device.get_region_offset(bar), len)
                .map_err(|e| err("mapping BAR0", e))?
        };
        let mut cmd = [0u8; 2];
        let cfg = VFIO_PCI_CONFIG_REGION_INDEX;
        device.region_read(cfg, &mut cmd, PCI_COMMAND);
        let value = u16::from_le_bytes(cmd) | PCI_COMMAND_MEMORY_MASTER;
        device.region_write(cfg, &value.to_le_bytes(), PCI_COMMAND);
        device.region_read(cfg, &mut cmd, PCI_COMMAND);
        if u16::from_le_bytes(cmd) & PCI_COMMAND_MEMORY_MASTER != PCI_COMMAND_MEMORY_MASTER {
            return Err(DeviceError("could not enable bus mastering".into()));
        }
        Ok(Self {
            bar0,
            device,
            container,
            mapped: Mutex::new(None),
        })
    }

    /// The IOVA ranges (inclusive start, inclusive end) the IOMMU accepts. Empty if the
    /// kernel does not report them.
    pub fn iova_ranges(&self) -> Result<Vec<(u64, u64)>, DeviceError> {
        use std::os::fd::AsRawFd;
        let info = sys::iommu_info(self.container.as_raw_fd()).map_err(|e| err("IOMMU info", e))?;
        parse_iova_ranges(&info)
            .ok_or_else(|| DeviceError("malformed IOMMU capability chain".into()))
    }

    /// An IOVA for an arena of `len` bytes inside the IOMMU's ranges ([`choose_iova_base`]
    /// from [`DEFAULT_IOVA_BASE`](crate::DEFAULT_IOVA_BASE) up): the value for
    /// [`Config::iova_base`](crate::Config::iova_base).
    pub fn arena_iova(&self, len: usize) -> Result<u64, DeviceError> {
        let ranges = self.iova_ranges()?;
        choose_iova_base(&ranges, len as u64, crate::DEFAULT_IOVA_BASE).ok_or_else(|| {
            DeviceError(format!(
                "no IOVA range of the IOMMU holds a {len}-byte DMA arena below 2^39: {ranges:x?}"
            ))
        })
    }
}

/// Refuses a PCI function that is not bound to `vfio-pci`, naming the driver it is bound to
/// and, for the kernel's nvme driver, a filesystem mounted from it (`mounts`: the text of
/// `/proc/self/mounts`) or another device stacked on it.
fn check_bound_to_vfio(sysfs_path: &Path, mounts: &str) -> Result<(), DeviceError> {
    let name = sysfs_path.display();
    if !sysfs_path.join("config").exists() {
        return Err(DeviceError(format!("{name}: no such PCI function")));
    }
    let Ok(link) = std::fs::read_link(sysfs_path.join("driver")) else {
        return Err(DeviceError(format!(
            "{name} is bound to no driver: bind it to vfio-pci first"
        )));
    };
    let driver = link.file_name().map(|n| n.to_string_lossy().into_owned());
    if driver.as_deref() == Some("vfio-pci") {
        return Ok(());
    }
    let driver = driver.unwrap_or_else(|| "?".into());
    let what = format!("{name} is bound to the {driver} driver, not vfio-pci");
    if let Some(busy) = in_use(sysfs_path, mounts) {
        return Err(DeviceError(format!(
            "{what}, and {busy}: stop using it before binding the device to vfio-pci"
        )));
    }
    Err(DeviceError(format!(
        "{what}: unbind it and bind it to vfio-pci first"
    )))
}

/// How a block device of an NVMe function on the kernel driver is in use, if it is: the first
/// of its namespaces or their partitions that is mounted (`/dev/NAME` in `mounts`) or holds
/// another device (an entry in its sysfs `holders`, e.g. device-mapper or md).
fn in_use(sysfs_path: &Path, mounts: &str) -> Option<String> {
    let dirs = |p: &Path| -> Vec<std::path::PathBuf> {
        let mut v: Vec<_> = std::fs::read_dir(p)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.is_dir())
            .collect();
        v.sort();
        v
    };
    let named = |p: &Path, prefix: &str| {
        p.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with(prefix))
    };
    // nvme/nvmeX/nvmeXnY (namespaces) and nvmeXnYpZ inside them (partitions).
    let mut blocks = Vec::new();
    for ctrl in dirs(&sysfs_path.join("nvme")) {
        for ns in dirs(&ctrl).into_iter().filter(|p| named(p, "nvme")) {
            let parts = dirs(&ns).into_iter().filter(|p| named(p, "nvme"));
            blocks.extend(parts);
            blocks.push(ns);
        }
    }
    for block in blocks {
        let dev = block.file_name()?.to_str()?.to_owned();
        let path = format!("/dev/{dev}");
        let mounted = mounts.lines().find_map(|l| {
            let mut f = l.split_whitespace();
            (f.next() == Some(path.as_str())).then(|| f.next().unwrap_or("?").to_owned())
        });
        if let Some(on) = mounted {
            return Some(format!("{path} is mounted on {on}"));
        }
        if let Some(holder) = dirs(&block.join("holders")).first() {
            let holder = holder.file_name()?.to_string_lossy();
            return Some(format!("{path} is held by {holder}"));
        }
    }
    None
}

/// Reads the IOVA ranges out of a `vfio_iommu_type1_info` and its capability chain. `None` if
/// the chain is malformed; an empty list if it carries no IOVA range capability.
pub fn parse_iova_ranges(info: &[u8]) -> Option<Vec<(u64, u64)>> {
    let u32_at = |o: usize| Some(u32::from_ne_bytes(info.get(o..o + 4)?.try_into().ok()?));
    let u64_at = |o: usize| Some(u64::from_ne_bytes(info.get(o..o + 8)?.try_into().ok()?));
    if info.len() < 24 {
        return None;
    }
    let flags = u32_at(4)?;
    if flags & VFIO_IOMMU_INFO_CAPS == 0 {
        return Some(Vec::new());
    }
    let mut at = u32_at(16)? as usize;
    let mut ranges = Vec::new();
    // Each capability lies after the structure and the chain only moves forward.
    let mut floor = 24;
    while at != 0 {
        if at < floor {
            return None;
        }
        let id = u32_at(at)? & 0xFFFF;
        let next = u32_at(at + 4)? as usize;
        if id == VFIO_IOMMU_TYPE1_INFO_CAP_IOVA_RANGE {
            let n = u32_at(at + 8)? as usize;
            for i in 0..n {
                let r = at + 16 + i * 16;
                ranges.push((u64_at(r)?, u64_at(r + 8)?));
            }
        }
        floor = at + 8;
        at = next;
    }
    Some(ranges)
}

/// The lowest page-aligned IOVA at or above `min` where `len` bytes fit inside one of
/// `ranges` (inclusive bounds) and end at or below 2^39. An empty `ranges` means the kernel
/// reported none; then `min` is taken as is.
pub fn choose_iova_base(ranges: &[(u64, u64)], len: u64, min: u64) -> Option<u64> {
    let page = ARENA_PAGE as u64;
    let fits = |base: u64, last: u64| {
        base.checked_add(len)
            .is_some_and(|end| end - 1 <= last && end <= 1 << 39)
    };
    if ranges.is_empty() {
        return fits(min, u64::MAX).then_some(min);
    }
    let mut sorted = ranges.to_vec();
    sorted.sort_unstable();
    sorted.into_iter().find_map(|(start, last)| {
        let base = start.max(min).checked_next_multiple_of(page)?;
        fits(base, last).then_some(base)
    })
}

impl Device for VfioNvme {
    fn read32(&self, offset: u32) -> u32 {
        // Outside BAR0 reads as a missing device does: all ones.
        self.bar0.read32(offset).unwrap_or(u32::MAX)
    }

    fn write32(&self, offset: u32, value: u32) {
        self.bar0.write32(offset, value);
    }

    fn map_dma(&self, window: &DmaWindow) -> Result<(), DeviceError> {
        let mut mapped = self.mapped.lock();
        if mapped.is_some() {
            return Err(DeviceError("an arena is already mapped".into()));
        }
        sys::dma_map(
            &self.container,
            window.iova_base(),
            window.len(),
            window.host_addr(),
        )
        .map_err(|e| err("mapping the DMA arena", e))?;
        *mapped = Some(window.clone());
        Ok(())
    }
}

impl Drop for VfioNvme {
    fn drop(&mut self) {
        // Stop the device from mastering before its memory can go away.
        let mut cmd = [0u8; 2];
        let cfg = VFIO_PCI_CONFIG_REGION_INDEX;
        self.device.region_read(cfg, &mut cmd, PCI_COMMAND);
        let value = u16::from_le_bytes(cmd) & !0b100;
        self.device
            .region_write(cfg, &value.to_le_bytes(), PCI_COMMAND);
        if let Some(w) = self.mapped.lock().take() {
            let _ = self.container.vfio_dma_unmap(w.iova_base(), w.len());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(caps: &[(u16, u32, Vec<u8>)], flags: u32) -> Vec<u8> {
        let mut b = vec![0u8; 24];
        b[4..8].copy_from_slice(&flags.to_ne_bytes());
        let mut at = 24usize;
        let first = if caps.is_empty() { 0 } else { at as u32 };
        b[16..20].copy_from_slice(&first.to_ne_bytes());
        for (i, (id, _, body)) in caps.iter().enumerate() {
            let next = if i + 1 == caps.len() {
                0
            } else {
                (at + 8 + body.len()) as u32
            };
            b.extend_from_slice(&u32::from(*id).to_ne_bytes());
            b.extend_from_slice(&next.to_ne_bytes());
            b.extend_from_slice(body);
            at += 8 + body.len();
        }
        b
    }

    fn iova_cap(ranges: &[(u64, u64)]) -> Vec<u8> {
        let mut body = Vec::new();
        body.extend_from_slice(&(ranges.len() as u32).to_ne_bytes());
        body.extend_from_slice(&0u32.to_ne_bytes());
        for (s, e) in ranges {
            body.extend_from_slice(&s.to_ne_bytes());
            body.extend_from_slice(&e.to_ne_bytes());
        }
        body
    }

    #[test]
    fn iova_ranges_from_the_capability_chain() {
        let ranges = [(0, 0xfedf_ffff), (0xfef0_0000, (1 << 39) - 1)];
        let raw = info(
            &[(9, 0, vec![0; 8]), (1, 0, iova_cap(&ranges))],
            VFIO_IOMMU_INFO_CAPS,
        );
        assert_eq!(parse_iova_ranges(&raw), Some(ranges.to_vec()));
        // No capabilities reported.
        assert_eq!(parse_iova_ranges(&info(&[], 0)), Some(Vec::new()));
        // Truncated, and a chain that points backwards.
        assert_eq!(parse_iova_ranges(&raw[..raw.len() - 4]), None);
        let mut looped = info(&[(1, 0, iova_cap(&ranges))], VFIO_IOMMU_INFO_CAPS);
        looped[28..32].copy_from_slice(&24u32.to_ne_bytes());
        assert_eq!(parse_iova_ranges(&looped), None);
        assert_eq!(parse_iova_ranges(&[0; 8]), None);
    }

    #[test]
    fn iova_base_fits_a_range_below_39_bits() {
        let ranges = [(0xfef0_0000, (1 << 39) - 1), (0, 0xfedf_ffff)];
        assert_eq!(
            choose_iova_base(&ranges, 64 << 20, 0x1000_0000),
            Some(0x1000_0000)
        );
        // Too big for the low range: the next one, page aligned.
        assert_eq!(
            choose_iova_base(&ranges, 0x1_0000_0000, 0x1000_0000),
            Some(0xfef0_0000)
        );
        assert_eq!(choose_iova_base(&ranges, 1 << 39, 0), None);
        assert_eq!(
            choose_iova_base(&[(0x1001, 0x3fff)], 0x2000, 0),
            Some(0x2000)
        );
        assert_eq!(choose_iova_base(&[(0x1001, 0x3fff)], 0x3000, 0), None);
        assert_eq!(choose_iova_base(&[], 4096, 0x1000_0000), Some(0x1000_0000));
    }

    /// A fake sysfs directory for a PCI function on the kernel's nvme driver with namespace
    /// nvme0n1 and its partition nvme0n1p1.
    fn fake_function(tag: &str) -> std::path::PathBuf {
        let root = std::env::temp_dir().join(format!("nvme-pcie-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let func = root.join("devices/0000:00:04.0");
        std::fs::create_dir_all(func.join("nvme/nvme0/nvme0n1/nvme0n1p1/holders")).unwrap();
        std::fs::create_dir_all(func.join("nvme/nvme0/nvme0n1/holders")).unwrap();
        std::fs::create_dir_all(root.join("drivers/nvme")).unwrap();
        std::fs::write(func.join("config"), [0u8; 64]).unwrap();
        std::os::unix::fs::symlink(root.join("drivers/nvme"), func.join("driver")).unwrap();
        func
    }

    #[test]
    fn a_kernel_bound_function_is_refused_naming_what_uses_it() {
        let func = fake_function("bound");
        let refuse = |mounts: &str| check_bound_to_vfio(&func, mounts).unwrap_err().0;
        let e = refuse("/dev/sda1 / ext4 rw 0 0\n");
        assert!(
            e.ends_with(
                "is bound to the nvme driver, not vfio-pci: unbind it and bind it to vfio-pci first"
            ),
            "{e}"
        );
        let e = refuse("/dev/sda1 / ext4 rw 0 0\n/dev/nvme0n1p1 /data xfs rw 0 0\n");
        assert!(e.contains("bound to the nvme driver, not vfio-pci, and /dev/nvme0n1p1 is mounted on /data: stop using it"), "{e}");
        let e = refuse("/dev/nvme0n1 /srv ext4 rw 0 0\n");
        assert!(e.contains("/dev/nvme0n1 is mounted on /srv"), "{e}");
        std::fs::create_dir(func.join("nvme/nvme0/nvme0n1/holders/dm-0")).unwrap();
        let e = refuse("");
        assert!(e.contains("/dev/nvme0n1 is held by dm-0"), "{e}");
        assert!(!e.contains('\n'));
        // Nothing was unbound: the driver link is where it was.
        assert!(
            std::fs::read_link(func.join("driver"))
                .unwrap()
                .ends_with("drivers/nvme")
        );
        // On vfio-pci, mounts of other devices do not matter.
        let root = func.parent().unwrap().parent().unwrap().to_path_buf();
        std::fs::create_dir_all(root.join("drivers/vfio-pci")).unwrap();
        std::fs::remove_file(func.join("driver")).unwrap();
        std::os::unix::fs::symlink(root.join("drivers/vfio-pci"), func.join("driver")).unwrap();
        assert!(check_bound_to_vfio(&func, "/dev/nvme0n1p1 /data xfs rw 0 0\n").is_ok());
        std::fs::remove_file(func.join("driver")).unwrap();
        assert!(refuse("").contains("bound to no driver"));
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn open_without_vfio_is_an_error() {
        // This machine has no VFIO device: a clear error, no panic.
        let e = VfioNvme::open(Path::new("/sys/bus/pci/devices/0000:ff:1f.7")).unwrap_err();
        assert!(e.0.contains("no such PCI function"), "{e}");
        // A function bound to another driver (or none) is refused, naming it.
        let dir = std::env::temp_dir().join(format!("vfio-bound-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config"), [0u8; 64]).unwrap();
        let e = VfioNvme::open(&dir).unwrap_err();
        assert!(e.0.contains("bound to no driver"), "{e}");
        std::os::unix::fs::symlink("/sys/bus/pci/drivers/nvme", dir.join("driver")).unwrap();
        let e = VfioNvme::open(&dir).unwrap_err();
        assert!(
            e.0.contains("bound to the nvme driver, not vfio-pci"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
