//! Controller bring-up, the admin queue, reset and shutdown.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use nvme_spec::command::{build, cns};
use nvme_spec::identify::{IdentifyController, IdentifyNamespace, get_trimmed};
use nvme_spec::{Cqe, FromBytes, Sqe};
use parking_lot::Mutex;

use crate::arena::{ARENA_PAGE, DmaArena, DmaBuf};
use crate::error::Error;
use crate::prp;
use crate::queue::IoQueuePair;
use crate::regs::{self, Cap, Device};
use crate::ring::Ring;

/// Driver settings.
#[derive(Clone, Debug)]
pub struct Config {
    /// I/O queue pairs to ask the controller for (one per reactor).
    pub io_queues: u16,
    /// Admin queue entries (2..=4096, capped by CAP.MQES).
    pub admin_queue_size: u16,
    /// Entries per I/O queue (2..=65536, capped by CAP.MQES); one less may be outstanding.
    pub io_queue_size: u32,
    /// Time an admin command may take before the controller is reset.
    pub admin_timeout: Duration,
    /// Time an I/O command may take before it is aborted (and once more before a reset).
    pub io_timeout: Duration,
    /// Wait for CSTS.RDY changes at most this long (`None`: CAP.TO, as the specification says).
    pub ready_timeout: Option<Duration>,
    /// Wait for shutdown processing (CSTS.SHST) at most this long.
    pub shutdown_timeout: Duration,
    /// Bytes of DMA arena (queues, PRP lists and data buffers).
    pub arena_size: usize,
    /// IOVA where the arena starts (page aligned, below 2^39).
    pub iova_base: u64,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            io_queues: 1,
            admin_queue_size: 32,
            io_queue_size: 256,
            admin_timeout: Duration::from_secs(5),
            io_timeout: Duration::from_secs(30),
            ready_timeout: None,
            shutdown_timeout: Duration::from_secs(5),
            arena_size: 64 << 20,
            iova_base: crate::arena::DEFAULT_IOVA_BASE,
        }
    }
}

/// What Identify Controller said, reduced to what users of the driver need.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ControllerInfo {
    /// PCI vendor ID.
    pub vid: u16,
    /// Serial number.
    pub serial: String,
    /// Model number.
    pub model: String,
    /// Firmware revision.
    pub firmware: String,
    /// Version register (VS).
    pub version: u32,
    /// Controller memory page size the driver configured (CC.MPS).
    pub page_size: u64,
    /// Largest transfer of one command in bytes (MDTS, capped by one PRP list page).
    pub max_transfer: u64,
    /// I/O queue pairs the controller granted.
    pub io_queues: u16,
    /// Optional NVM commands supported (ONCS): Write Zeroes, Dataset Management, ...
    pub oncs: u16,
    /// A volatile write cache is present (VWC bit 0).
    pub volatile_write_cache: bool,
}

impl ControllerInfo {
    /// The controller supports Write Zeroes (ONCS bit 3).
    pub fn supports_write_zeroes(&self) -> bool {
        self.oncs & nvme_spec::identify::ONCS_WRITE_ZEROES != 0
    }

    /// The controller supports Dataset Management, i.e. Deallocate (ONCS bit 2).
    pub fn supports_deallocate(&self) -> bool {
        self.oncs & nvme_spec::identify::ONCS_DSM != 0
    }
}

/// An active namespace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Namespace {
    /// Namespace identifier.
    pub nsid: u32,
    /// Logical block size in bytes.
    pub block_size: u32,
    /// Size in logical blocks (NSZE).
    pub blocks: u64,
}

/// The admin queue: one synchronous command at a time, under the shared lock.
pub(crate) struct Admin {
    ring: Ring,
    /// A page for Identify data and the like; admin commands only ever point here or at queue
    /// memory, so a late DMA after a timeout cannot land in freed memory.
    data: DmaBuf,
    next_cid: u16,
    /// Queue identifiers in use (index = qid).
    qids: Vec<bool>,
}

/// State shared by the controller handle and its I/O queue pairs.
pub(crate) struct Shared {
    pub(crate) dev: Arc<dyn Device>,
    pub(crate) arena: DmaArena,
    pub(crate) admin: Mutex<Admin>,
    /// Bumped whenever the controller is disabled (reset or failure): queues of an older
    /// generation no longer exist on the controller.
    pub(crate) generation: AtomicU64,
    pub(crate) failed: AtomicBool,
    pub(crate) cap: Cap,
    pub(crate) mps: u8,
    pub(crate) page: u64,
    pub(crate) config: Config,
    pub(crate) info: ControllerInfo,
    pub(crate) namespaces: Vec<Namespace>,
}

/// An NVMe controller driven from user space through a [`Device`].
///
/// Creating one brings the controller up (disable, admin queue, enable, Identify, Number of
/// Queues); dropping the last handle (the controller and every [`IoQueuePair`]) shuts it down
/// with CC.SHN. The handle is cheap to share between threads by reference; each reactor owns
/// its own [`IoQueuePair`].
pub struct Controller {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Controller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Controller")
            .field("info", &self.shared.info)
            .finish()
    }
}

fn ready_limit(cap: &Cap, config: &Config) -> Duration {
    let spec = Duration::from_millis(500 * u64::from(cap.to.max(1)));
    config.ready_timeout.map_or(spec, |t| t.min(spec))
}

/// Polls CSTS until `done` holds (`Ok(true)`), CFS appears (when `fail_on_cfs`) or `limit`
/// passes (`Ok(false)`).
fn wait_csts(
    dev: &dyn Device,
    limit: Duration,
    fail_on_cfs: bool,
    done: impl Fn(u32) -> bool,
) -> Result<bool, Error> {
    let start = Instant::now();
    loop {
        let csts = dev.read32(regs::CSTS);
        if csts == u32::MAX || (fail_on_cfs && csts & regs::CSTS_CFS != 0) {
            return Err(Error::ControllerFailed);
        }
        if done(csts) {
            return Ok(true);
        }
        if start.elapsed() >= limit {
            return Ok(false);
        }
        std::thread::sleep(Duration::from_micros(50));
    }
}

fn set_ready(dev: &dyn Device, cap: &Cap, config: &Config, cc: u32) -> Result<(), Error> {
    let enable = cc & regs::CC_EN != 0;
    dev.write32(regs::CC, cc);
    let limit = ready_limit(cap, config);
    let want = u32::from(enable);
    if wait_csts(dev, limit, enable, |c| c & regs::CSTS_RDY == want)? {
        Ok(())
    } else {
        Err(Error::ReadyTimeout {
            ready: enable,
            ms: limit.as_millis() as u64,
        })
    }
}

impl Admin {
    /// Disables the controller (CC.EN = 0, wait for RDY = 0).
    fn disable(dev: &dyn Device, cap: &Cap, config: &Config) -> Result<(), Error> {
        let cc = dev.read32(regs::CC);
        if cc == u32::MAX {
            return Err(Error::ControllerFailed);
        }
        set_ready(dev, cap, config, cc & !regs::CC_EN)
    }

    /// Programs the admin queue and enables the controller.
    fn enable(
        &mut self,
        dev: &dyn Device,
        cap: &Cap,
        mps: u8,
        config: &Config,
    ) -> Result<(), Error> {
        self.ring.reset();
        let n = u32::from(self.ring.size()) - 1;
        dev.write32(regs::AQA, n | (n << 16));
        dev.write64(regs::ASQ, self.ring.sq.iova());
        dev.write64(regs::ACQ, self.ring.cq.iova());
        set_ready(dev, cap, config, regs::cc_value(mps, true))
    }

    /// Runs one admin command to completion. `sqe` gets its CID and PRPs here (the data, if
    /// any, is the admin data page). On a timeout the controller is reset.
    pub(crate) fn exec(&mut self, shared: &Shared, mut sqe: Sqe, data: bool) -> Result<Cqe, Error> {
        if shared.failed.load(Ordering::Acquire) {
            return Err(Error::ControllerFailed);
        }
        let cid = self.next_cid;
        self.next_cid = self.next_cid.wrapping_add(1);
        sqe.cid = cid.into();
        sqe.flags = 0; // PRPs
        if data {
            sqe.dptr.address = self.data.iova().into();
        }
        let dev = &*shared.dev;
        self.ring.push(&sqe);
        self.ring.ring(dev);
        let start = Instant::now();
        loop {
            let mut found = None;
            let mut any = false;
            while let Some(cqe) = self.ring.next_cqe() {
                any = true;
                if cqe.cid() == cid {
                    found = Some(cqe);
                }
            }
            if any {
                self.ring.ack(dev);
            }
            if let Some(cqe) = found {
                let status = cqe.status();
                return if status.is_success() {
                    Ok(cqe)
                } else {
                    Err(Error::Status(status))
                };
            }
            let csts = dev.read32(regs::CSTS);
            if csts == u32::MAX || csts & regs::CSTS_CFS != 0 {
                shared.fail_locked();
                return Err(Error::ControllerFailed);
            }
            if start.elapsed() >= shared.config.admin_timeout {
                // Best effort: the reset reports its own failure by marking the controller failed.
                let _ = shared.reset_locked(self);
                return Err(Error::AdminTimeout { opcode: sqe.opcode });
            }
            std::thread::sleep(Duration::from_micros(20));
        }
    }

    /// Copies the admin data page out.
    fn data<T: FromBytes>(&self) -> Result<T, Error> {
        let mut raw = vec![0u8; size_of::<T>()];
        self.data.read(0, &mut raw)?;
        T::read_from_bytes(&raw).map_err(|_| Error::OutOfBounds)
    }

    /// Allocates a free I/O queue identifier.
    pub(crate) fn take_qid(&mut self) -> Option<u16> {
        let qid = self.qids.iter().skip(1).position(|&u| !u)? + 1;
        self.qids[qid] = true;
        u16::try_from(qid).ok()
    }

    /// Returns a queue identifier.
    pub(crate) fn release_qid(&mut self, qid: u16) {
        if let Some(q) = self.qids.get_mut(usize::from(qid)) {
            *q = false;
        }
    }

    fn set_queue_count(&mut self, shared: &Shared, wanted: u16) -> Result<u16, Error> {
        let n = u32::from(wanted.max(1) - 1);
        let sqe = build::set_features(0, nvme_spec::features::NUMBER_OF_QUEUES, n | (n << 16));
        let dw0 = self.exec(shared, sqe, false)?.dw0.get();
        let granted = ((dw0 & 0xFFFF).min(dw0 >> 16) + 1).min(u32::from(wanted));
        let granted = u16::try_from(granted).unwrap_or(wanted);
        // Identifiers still held by queue pairs of an earlier generation stay taken until those
        // are dropped, so a stale doorbell write can never reach a new queue.
        self.qids.resize(usize::from(granted) + 1, false);
        self.qids[0] = true;
        Ok(granted)
    }
}

impl Shared {
    /// Marks the controller failed and disables it, so that it no longer touches queue memory
    /// (best effort: a dead controller may not answer). Queues notice on their next call.
    pub(crate) fn fail_locked(&self) {
        let _ = Admin::disable(&*self.dev, &self.cap, &self.config);
        self.failed.store(true, Ordering::Release);
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// Resets the controller: disable, forget every I/O queue, enable the admin queue again and
    /// renegotiate the number of queues. Queues of the old generation fail their commands with
    /// [`Error::Reset`] and must be created again.
    pub(crate) fn reset_locked(&self, admin: &mut Admin) -> Result<(), Error> {
        let dev = &*self.dev;
        let disabled = Admin::disable(dev, &self.cap, &self.config);
        self.generation.fetch_add(1, Ordering::AcqRel);
        if let Err(e) = disabled {
            self.failed.store(true, Ordering::Release);
            return Err(e);
        }
        self.failed.store(false, Ordering::Release);
        let result = admin
            .enable(dev, &self.cap, self.mps, &self.config)
            .and_then(|()| {
                admin
                    .set_queue_count(self, self.config.io_queues)
                    .map(|_| ())
            });
        if result.is_err() {
            self.fail_locked();
        }
        result
    }
}

impl Controller {
    /// Brings up the controller behind `dev`: maps a new DMA arena, disables the controller,
    /// programs the admin queue, enables it, identifies the controller and its active
    /// namespaces and negotiates `config.io_queues` I/O queue pairs.
    pub fn new(dev: Arc<dyn Device>, config: Config) -> Result<Self, Error> {
        if config.io_queues == 0 || config.io_queues == u16::MAX {
            return Err(Error::InvalidConfig("io_queues must be 1..=65534"));
        }
        if config.admin_queue_size < 2 || config.io_queue_size < 2 || config.io_queue_size > 65536 {
            return Err(Error::InvalidConfig(
                "queue sizes must be at least 2 (I/O: at most 65536)",
            ));
        }
        let raw_cap = dev.read64(regs::CAP);
        if raw_cap == u64::MAX {
            return Err(Error::ControllerFailed);
        }
        let cap = Cap::from_raw(raw_cap);
        if cap.mqes < 2 {
            return Err(Error::Unsupported(
                "queues of fewer than 2 entries (CAP.MQES)",
            ));
        }
        if !cap.css_nvm {
            return Err(Error::Unsupported(
                "the NVM command set is not supported (CAP.CSS)",
            ));
        }
        // 4 KiB pages unless the controller's minimum is larger.
        let mps = cap.mpsmin;
        if mps > cap.mpsmax || mps > 4 {
            return Err(Error::Unsupported(
                "no usable memory page size (CAP.MPSMIN/MPSMAX)",
            ));
        }
        let page = (ARENA_PAGE as u64) << mps;
        let arena = DmaArena::new(config.arena_size, config.iova_base)?;
        dev.map_dma(&arena.window())?;
        Admin::disable(&*dev, &cap, &config)?;
        let admin_size = u32::from(config.admin_queue_size).min(cap.mqes).min(4096);
        let mut admin = Admin {
            ring: Ring::new(&arena, 0, admin_size as u16, cap.dstrd, page as usize)?,
            data: arena.alloc(page as usize, page as usize)?,
            next_cid: 0,
            qids: vec![true],
        };
        admin.enable(&*dev, &cap, mps, &config)?;
        let mut shared = Shared {
            dev,
            arena,
            admin: Mutex::new(admin),
            generation: AtomicU64::new(0),
            failed: AtomicBool::new(false),
            cap,
            mps,
            page,
            config,
            info: ControllerInfo {
                vid: 0,
                serial: String::new(),
                model: String::new(),
                firmware: String::new(),
                version: 0,
                page_size: page,
                max_transfer: 0,
                io_queues: 0,
                oncs: 0,
                volatile_write_cache: false,
            },
            namespaces: Vec::new(),
        };
        // On an error `shared` drops here, which shuts the controller down.
        let (info, namespaces) = {
            let mut admin = shared.admin.lock();
            identify(&shared, &mut admin)?
        };
        shared.info = info;
        shared.namespaces = namespaces;
        Ok(Self {
            shared: Arc::new(shared),
        })
    }

    /// Identify data.
    pub fn info(&self) -> &ControllerInfo {
        &self.shared.info
    }

    /// Active namespaces found at bring-up.
    pub fn namespaces(&self) -> &[Namespace] {
        &self.shared.namespaces
    }

    /// The active namespace `nsid`.
    pub fn namespace(&self, nsid: u32) -> Result<Namespace, Error> {
        self.shared
            .namespaces
            .iter()
            .find(|n| n.nsid == nsid)
            .copied()
            .ok_or(Error::NoNamespace(nsid))
    }

    /// Allocates a data buffer of `len` bytes in the DMA arena, page aligned and zeroed.
    pub fn alloc(&self, len: usize) -> Result<DmaBuf, Error> {
        self.shared.arena.alloc(len, self.shared.page as usize)
    }

    /// The DMA arena (for leak checks and sizing).
    pub fn arena(&self) -> &DmaArena {
        &self.shared.arena
    }

    /// Creates an I/O completion queue (polled: interrupts off) and its submission queue.
    pub fn create_io_queue(&self) -> Result<IoQueuePair, Error> {
        IoQueuePair::create(Arc::clone(&self.shared))
    }

    /// True once the controller reported a fatal status and was not reset since.
    pub fn is_failed(&self) -> bool {
        self.shared.failed.load(Ordering::Acquire)
    }

    /// Resets the controller (also the way back from a failure). Every existing
    /// [`IoQueuePair`] fails its outstanding commands with [`Error::Reset`] and stays dead;
    /// drop them and create new ones (a dead pair keeps its queue identifier until dropped).
    pub fn reset(&self) -> Result<(), Error> {
        let mut admin = self.shared.admin.lock();
        self.shared.reset_locked(&mut admin)
    }
}

fn identify(shared: &Shared, admin: &mut Admin) -> Result<(ControllerInfo, Vec<Namespace>), Error> {
    let dev = &*shared.dev;
    admin.exec(shared, build::identify(0, cns::CONTROLLER, 0), true)?;
    let id: IdentifyController = admin.data()?;
    let (sqes, cqes) = (id.sqes, id.cqes);
    if !(sqes & 0xF <= 6 && 6 <= sqes >> 4 && cqes & 0xF <= 4 && 4 <= cqes >> 4) {
        return Err(Error::Unsupported(
            "64-byte SQEs and 16-byte CQEs are required (SQES/CQES)",
        ));
    }
    let min_page = (ARENA_PAGE as u64) << shared.cap.mpsmin;
    let mdts = match id.mdts {
        0 => u64::MAX,
        m if m < 32 => min_page << m,
        _ => u64::MAX,
    };
    // Active namespace IDs above NSID 0: the whole list.
    admin.exec(shared, build::identify(0, cns::ACTIVE_NS_LIST, 0), true)?;
    let mut list = vec![0u8; 4096];
    admin.data.read(0, &mut list)?;
    let mut namespaces = Vec::new();
    for raw in list.chunks_exact(4) {
        let nsid = u32::from_le_bytes([raw[0], raw[1], raw[2], raw[3]]);
        if nsid == 0 {
            break;
        }
        admin.exec(shared, build::identify(0, cns::NAMESPACE, nsid), true)?;
        let ns: IdentifyNamespace = admin.data()?;
        let block_size = ns.block_size();
        if block_size != 0 && ns.nsze.get() != 0 {
            namespaces.push(Namespace {
                nsid,
                block_size,
                blocks: ns.nsze.get(),
            });
        }
    }
    let io_queues = admin.set_queue_count(shared, shared.config.io_queues)?;
    let info = ControllerInfo {
        vid: id.vid.get(),
        serial: get_trimmed(&id.sn),
        model: get_trimmed(&id.mn),
        firmware: get_trimmed(&id.fr),
        version: dev.read32(regs::VS),
        page_size: shared.page,
        max_transfer: mdts.min(prp::max_transfer(shared.page)),
        io_queues,
        oncs: id.oncs.get(),
        volatile_write_cache: id.vwc & 1 != 0,
    };
    Ok((info, namespaces))
}

impl Drop for Shared {
    fn drop(&mut self) {
        if self.failed.load(Ordering::Acquire) {
            return;
        }
        let dev = &*self.dev;
        let cc = dev.read32(regs::CC);
        if cc == u32::MAX || cc & regs::CC_EN == 0 {
            return;
        }
        dev.write32(regs::CC, (cc & !regs::CC_SHN_MASK) | regs::CC_SHN_NORMAL);
        let done = wait_csts(dev, self.config.shutdown_timeout, false, |c| {
            c & regs::CSTS_SHST_MASK == regs::CSTS_SHST_COMPLETE
        });
        if done != Ok(true) {
            // The controller did not finish shutting down: stop it before its memory goes.
            let _ = Admin::disable(dev, &self.cap, &self.config);
        }
    }
}
