//! Caller-registered memory: buffers registered once with the controller's NVMe/RDMA
//! protection domain, which the target reaches directly. A read names the buffer in its keyed
//! SGL and the target RDMA WRITEs the data straight into it; a write's data is RDMA READ
//! straight from it. No slot buffer, no copy. GPU memory (feature `gpu`) is registered
//! through dma-buf (`ibv_reg_dmabuf_mr`), or by its device address where the NIC refuses
//! dma-buf regions (`ibv_reg_mr` resolved by nvidia-peermem).
//!
//! Lifetimes: every command that targets a buffer holds a reference to its registration
//! until the command ends, or until its queue pair is destroyed (a command that times out
//! tears the queue pair down first). A buffer dropped with commands in flight is released
//! only after them; its bytes are readable again ([`RegisteredBuffer::as_slice`]) only when
//! no command holds it.

use std::sync::Arc;

use nvmf_rdma::{Access, PageBuffer, ProtectionDomain, Registered, RemoteKey};

use crate::Error;

/// Access rights of caller-registered memory: the target writes read data and reads write data.
fn remote_access() -> Access {
    Access::REMOTE_WRITE | Access::REMOTE_READ
}

/// Memory registered with a controller's protection domain.
pub(crate) enum RegionMem {
    /// Host memory.
    Host(Registered<PageBuffer>),
    /// Device memory exported as a dma-buf. Field order is drop order: the region is
    /// deregistered before the dma-buf and the buffer go.
    #[cfg(feature = "gpu")]
    Dmabuf {
        region: nvmf_rdma::DmabufRegion,
        _dmabuf: gpu::DmaBuf,
        buf: Arc<gpu::DeviceBuffer>,
    },
    /// Device memory registered by address (nvidia-peermem).
    #[cfg(feature = "gpu")]
    Peer(nvmf_rdma::DeviceRegion<Arc<gpu::DeviceBuffer>>),
    /// The data areas of a GPU request ring (host memory the ring owns), registered by
    /// address: a ring read's keyed SGL names its slot.
    Ring(nvmf_rdma::DeviceRegion<gpu_ring::DataArea>),
}

impl RegionMem {
    /// Registers device memory with `pd`: its dma-buf first, the device address
    /// (nvidia-peermem) when the export or the dma-buf registration is refused. Returns the
    /// region and whether it went through dma-buf.
    #[cfg(feature = "gpu")]
    fn device(
        buf: Arc<gpu::DeviceBuffer>,
        pd: &Arc<ProtectionDomain>,
    ) -> Result<(RegionMem, bool), Error> {
        let dmabuf_err = match buf.as_slice().export_dmabuf() {
            Err(e) => e.to_string(),
            Ok(d) => {
                let req = DmabufRequest::for_dmabuf(&d)?;
                let fd = d.fd();
                match pd.register_dmabuf(fd, req.offset, req.len, req.iova, remote_access()) {
                    Ok(region) => {
                        let mem = RegionMem::Dmabuf {
                            region,
                            _dmabuf: d,
                            buf,
                        };
                        return Ok((mem, true));
                    }
                    Err(e) => e.to_string(),
                }
            }
        };
        match pd.register_device_memory(buf, remote_access()) {
            Ok(r) => Ok((RegionMem::Peer(r), false)),
            Err(e) => Err(Error::Unsupported(format!(
                "cannot register GPU memory for RDMA: dma-buf: {dmabuf_err}; by address (nvidia-peermem): {e}"
            ))),
        }
    }

    /// Orders the NIC's writes into device memory before later work on the GPU
    /// (`cuFlushGPUDirectRDMAWrites`; nothing to do for host memory or where the device does
    /// not offer it).
    pub(crate) fn flush(&self) -> Result<(), Error> {
        #[cfg(feature = "gpu")]
        {
            let ctx = match self {
                RegionMem::Dmabuf { buf, .. } => buf.context(),
                RegionMem::Peer(r) => r.memory().context(),
                RegionMem::Host(_) | RegionMem::Ring(_) => return Ok(()),
            };
            match ctx.flush_gpudirect_rdma_writes(gpu::FlushScope::ToOwner) {
                Ok(()) | Err(gpu::GpuError::FlushUnsupported) => Ok(()),
                Err(e) => Err(Error::Buffer(format!("cuFlushGPUDirectRDMAWrites: {e}"))),
            }
        }
        #[cfg(not(feature = "gpu"))]
        Ok(())
    }

    /// Whether the memory is on a device (its NIC writes need [`flush`](Self::flush)).
    pub(crate) fn is_device(&self) -> bool {
        !matches!(self, RegionMem::Host(_) | RegionMem::Ring(_))
    }

    /// The keyed SGL target for `len` bytes from `offset`, for a queue pair of domain `pd`.
    fn remote_key(
        &self,
        pd: &Arc<ProtectionDomain>,
        offset: usize,
        len: usize,
    ) -> Result<RemoteKey, Error> {
        let (same_pd, key) = match self {
            RegionMem::Host(r) => (r.is_registered_with(pd), r.remote_key(offset, len)),
            #[cfg(feature = "gpu")]
            RegionMem::Dmabuf { region, .. } => (
                region.is_registered_with(pd),
                region.remote_key(offset, len),
            ),
            #[cfg(feature = "gpu")]
            RegionMem::Peer(r) => (r.is_registered_with(pd), r.remote_key(offset, len)),
            RegionMem::Ring(r) => (r.is_registered_with(pd), r.remote_key(offset, len)),
        };
        if !same_pd {
            return Err(Error::InvalidArgument(
                "the buffer is registered with another RDMA device than this queue's (the controller reconnected through another device): register it again".into(),
            ));
        }
        key.ok_or_else(|| {
            Error::InvalidArgument(format!(
                "{len} bytes at offset {offset} are outside the registered buffer or longer than one keyed SGL"
            ))
        })
    }
}

/// Registers the data areas of a GPU request ring with `pd` (NVMe/RDMA ring reads): host
/// memory by address, device memory ([`gpu_ring::DataMode::Device`]) through dma-buf or
/// nvidia-peermem (feature `gpu`).
pub(crate) fn register_ring(
    pd: &Arc<ProtectionDomain>,
    ring: &gpu_ring::HostRing,
) -> Result<Arc<RegionMem>, Error> {
    if let Some(_data) = ring.device_data() {
        #[cfg(feature = "gpu")]
        return RegionMem::device(Arc::clone(_data), pd).map(|(m, _)| Arc::new(m));
        #[cfg(not(feature = "gpu"))]
        return Err(Error::Unsupported(
            "rings with device data areas need the initiator's `gpu` feature".into(),
        ));
    }
    pd.register_device_memory(ring.data_area(), remote_access())
        .map(|r| Arc::new(RegionMem::Ring(r)))
        .map_err(crate::error::registration_error)
}

/// One command's share of a registered buffer: the memory and where its data starts.
pub(crate) struct Direct {
    pub mem: Arc<RegionMem>,
    pub offset: usize,
}

impl Direct {
    /// What the target needs to reach the command's `len` bytes through a queue pair of `pd`.
    pub fn remote_key(&self, pd: &Arc<ProtectionDomain>, len: usize) -> Result<RemoteKey, Error> {
        self.mem.remote_key(pd, self.offset, len)
    }
}

/// Splits `len` bytes into commands of at most `max` bytes: `(offset, length)` pairs.
pub(crate) fn split(len: usize, max: usize) -> impl Iterator<Item = (usize, usize)> {
    let max = max.max(1);
    (0..len)
        .step_by(max)
        .map(move |off| (off, max.min(len - off)))
}

/// Checks that `offset..offset + len` lies inside a buffer of `size` bytes.
pub(crate) fn check_range(size: usize, offset: usize, len: usize) -> Result<(), Error> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(Error::InvalidArgument(format!(
            "{len} bytes at offset {offset} do not fit the {size}-byte registered buffer"
        ))),
    }
}

enum HostMem {
    /// NVMe/TCP: plain memory (reads and writes copy, as for any slice).
    Plain(PageBuffer),
    /// NVMe/RDMA: registered ([`RegionMem::Host`]).
    Rdma(Arc<RegionMem>),
}

/// Page-aligned host memory that a controller allocated and, over NVMe/RDMA, registered once
/// for remote access: [`Namespace::read_registered`](crate::Namespace::read_registered) and
/// [`write_registered`](crate::Namespace::write_registered) move data between the target and
/// this memory with no copy (the target RDMA WRITEs and RDMA READs it directly). Get one from
/// [`Controller::register_buffer`](crate::Controller::register_buffer).
///
/// Over NVMe/TCP the same calls work on plain memory, with the copy every TCP read and write
/// makes: a data loader runs unchanged on both transports.
///
/// The bytes are reached with `&mut self` ([`as_slice`](Self::as_slice),
/// [`as_mut_slice`](Self::as_mut_slice)), and only while no command uses the buffer (a read
/// whose future was dropped may still be in flight: then they fail with
/// [`Error::BufferBusy`]).
pub struct RegisteredBuffer {
    mem: HostMem,
    len: usize,
}

impl std::fmt::Debug for RegisteredBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisteredBuffer")
            .field("len", &self.len)
            .field("registered", &self.is_registered())
            .finish()
    }
}

impl RegisteredBuffer {
    /// Allocates `len` zeroed bytes, registered with `pd` when there is one (NVMe/RDMA).
    pub(crate) fn new(len: usize, pd: Option<&Arc<ProtectionDomain>>) -> Result<Self, Error> {
        if len == 0 {
            return Err(Error::InvalidArgument(
                "cannot register an empty buffer".into(),
            ));
        }
        let page = PageBuffer::new(len).map_err(|e| Error::InvalidArgument(e.to_string()))?;
        let mem = match pd {
            None => HostMem::Plain(page),
            Some(pd) => {
                let reg = pd
                    .register(page, remote_access())
                    .map_err(crate::error::registration_error)?;
                HostMem::Rdma(Arc::new(RegionMem::Host(reg)))
            }
        };
        Ok(RegisteredBuffer { mem, len })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty (never: empty buffers are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the memory is registered for RDMA (the controller speaks NVMe/RDMA): reads and
    /// writes then move no bytes through the host CPU.
    pub fn is_registered(&self) -> bool {
        matches!(self.mem, HostMem::Rdma(_))
    }

    /// The bytes, once no command uses them.
    pub fn as_slice(&mut self) -> Result<&[u8], Error> {
        self.as_mut_slice().map(|s| &*s)
    }

    /// The bytes, writable, once no command uses them.
    pub fn as_mut_slice(&mut self) -> Result<&mut [u8], Error> {
        match &mut self.mem {
            HostMem::Plain(p) => Ok(p.as_mut_slice()),
            HostMem::Rdma(arc) => match Arc::get_mut(arc) {
                Some(RegionMem::Host(r)) => Ok(r.bytes_mut()),
                Some(_) => Err(Error::InvalidArgument("not host memory".into())),
                None => Err(Error::BufferBusy),
            },
        }
    }

    /// The registration, for commands (None over NVMe/TCP), or the plain bytes.
    pub(crate) fn target(&mut self) -> Result<&Arc<RegionMem>, &mut [u8]> {
        match &mut self.mem {
            HostMem::Plain(p) => Err(p.as_mut_slice()),
            HostMem::Rdma(arc) => Ok(arc),
        }
    }
}

/// GPU memory registered for NVMe/RDMA: reads land in it straight from the NIC (GPUDirect
/// RDMA), writes are read from it by the NIC. Get one from
/// [`Controller::register_gpu`](crate::Controller::register_gpu); read with
/// [`Namespace::read_registered_gpu`](crate::Namespace::read_registered_gpu).
#[cfg(feature = "gpu")]
pub struct RegisteredGpuBuffer {
    mem: Arc<RegionMem>,
    len: usize,
    dmabuf: bool,
}

#[cfg(feature = "gpu")]
impl std::fmt::Debug for RegisteredGpuBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisteredGpuBuffer")
            .field("len", &self.len)
            .field("dmabuf", &self.dmabuf)
            .finish()
    }
}

/// The arguments of `ibv_reg_dmabuf_mr(pd, offset, length, iova, fd, access)` for an exported
/// device buffer.
#[cfg(feature = "gpu")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DmabufRequest {
    /// The dma-buf file descriptor.
    pub fd: std::os::fd::RawFd,
    /// Offset of the buffer's first byte inside the dma-buf.
    pub offset: u64,
    /// Bytes to register.
    pub len: usize,
    /// Address the target uses for the first byte (the device address).
    pub iova: u64,
    /// `ibv_access_flags` bits: local write, remote write, remote read.
    pub access: i32,
}

#[cfg(feature = "gpu")]
impl DmabufRequest {
    /// The request for an exported range.
    pub fn for_dmabuf(d: &gpu::DmaBuf) -> Result<Self, Error> {
        let len = usize::try_from(d.len())
            .map_err(|_| Error::InvalidArgument("dma-buf longer than the address space".into()))?;
        Ok(DmabufRequest {
            fd: d.raw_fd(),
            offset: d.offset(),
            len,
            iova: d.iova(),
            access: remote_access().bits(),
        })
    }
}

#[cfg(feature = "gpu")]
impl RegisteredGpuBuffer {
    /// Registers `buf` with `pd`: dma-buf first, the device address (nvidia-peermem) when the
    /// export or the dma-buf registration is refused.
    pub(crate) fn new(buf: gpu::DeviceBuffer, pd: &Arc<ProtectionDomain>) -> Result<Self, Error> {
        let len = buf.len();
        let (mem, dmabuf) = RegionMem::device(Arc::new(buf), pd)?;
        Ok(RegisteredGpuBuffer {
            mem: Arc::new(mem),
            len,
            dmabuf,
        })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty (never: the GPU crate refuses empty allocations).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the registration went through dma-buf (false: by device address, nvidia-peermem).
    pub fn is_dmabuf(&self) -> bool {
        self.dmabuf
    }

    /// The device buffer (for kernels and copies once reads completed).
    pub fn device_buffer(&self) -> &gpu::DeviceBuffer {
        match &*self.mem {
            RegionMem::Dmabuf { buf, .. } => buf,
            RegionMem::Peer(r) => r.memory(),
            RegionMem::Host(_) | RegionMem::Ring(_) => {
                unreachable!("a RegisteredGpuBuffer holds device memory")
            }
        }
    }

    pub(crate) fn mem(&self) -> &Arc<RegionMem> {
        &self.mem
    }

    /// Orders the RDMA writes of completed reads before later work on the GPU
    /// (`cuFlushGPUDirectRDMAWrites`); nothing to do where the device does not offer it.
    pub(crate) fn flush(&self) -> Result<(), Error> {
        self.mem.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_covers_the_transfer_in_order() {
        let v: Vec<_> = split(20 << 20, 8 << 20).collect();
        assert_eq!(v, [(0, 8 << 20), (8 << 20, 8 << 20), (16 << 20, 4 << 20)]);
        let v: Vec<_> = split(4096, 8 << 20).collect();
        assert_eq!(v, [(0, 4096)]);
        let v: Vec<_> = split(3 * 4096, 4096).collect();
        assert_eq!(v, [(0, 4096), (4096, 4096), (8192, 4096)]);
        assert_eq!(split(0, 4096).count(), 0);
    }

    #[test]
    fn ranges_are_checked() {
        assert!(check_range(8192, 4096, 4096).is_ok());
        assert!(check_range(8192, 4096, 4097).is_err());
        assert!(check_range(8192, usize::MAX, 2).is_err());
    }

    #[test]
    fn tcp_buffers_are_plain_and_writable() {
        let mut b = RegisteredBuffer::new(10_000, None).unwrap();
        assert!(!b.is_registered());
        assert_eq!(b.len(), 10_000);
        assert!(b.as_slice().unwrap().iter().all(|&x| x == 0));
        b.as_mut_slice().unwrap()[..3].copy_from_slice(b"abc");
        assert_eq!(&b.as_slice().unwrap()[..3], b"abc");
        assert!(b.target().is_err());
        assert!(RegisteredBuffer::new(0, None).is_err());
    }
}
