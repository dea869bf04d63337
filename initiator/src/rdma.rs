//! NVMe/RDMA queue connections (NVMe over Fabrics 1.1, section 7.3): an RDMA-CM connection
//! with the NVMe private data, command capsules SENT from registered slots, completions
//! received into registered slots, and command data described by keyed SGL data blocks that
//! point at registered host memory (the target RDMA WRITEs read data there and RDMA READs
//! write data from there), or carried in the capsule for small writes.
//!
//! The verbs and their `unsafe` live in `nvmf-rdma`; this module only uses its safe API.
//! Memory is general there: a command's data region is anything with a [`RemoteKey`] (a
//! registered host buffer here; a registered dma-buf such as GPU memory works the same way).

use std::net::SocketAddr;
use std::time::Duration;

use nvme_spec::{Cqe, SglDescriptor, Sqe};
use nvmf_rdma::{CapsuleQueue, CmEvent, Event, ProtectionDomain, QueueConfig, RemoteKey};
use tokio::time::{Instant, timeout_at};

use crate::buffer::SlotBuf;
use crate::error::rdma_error;
use crate::queue_core::{Cmd, Completions, Core, DataDir, LinkLimits, QueueCounters, Wire, bump};
use crate::{Error, TargetAddr};

/// RDMA READs the target may have in flight towards one host queue (the host's IRD).
const RESPONDER_RESOURCES: u8 = 16;

/// The protection domain a controller's NVMe/RDMA queues share (one per RDMA device): the
/// first queue allocates it, the others and later reconnects through the same device reuse it,
/// so memory registered with it serves every queue.
#[derive(Clone, Default)]
pub(crate) struct SharedPd(
    std::sync::Arc<parking_lot::Mutex<Option<std::sync::Arc<ProtectionDomain>>>>,
);

impl SharedPd {
    /// The domain in use (None before the first NVMe/RDMA connection).
    pub fn get(&self) -> Option<std::sync::Arc<ProtectionDomain>> {
        self.0.lock().clone()
    }

    fn set(&self, pd: &std::sync::Arc<ProtectionDomain>) {
        if !pd.is_shareable() {
            return;
        }
        let mut cur = self.0.lock();
        if !cur.as_ref().is_some_and(|c| std::sync::Arc::ptr_eq(c, pd)) {
            *cur = Some(std::sync::Arc::clone(pd));
        }
    }
}

/// How a command's data travels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DataPath {
    /// No data.
    None,
    /// In the command capsule.
    InCapsule,
    /// Keyed SGL: the target reaches registered host memory.
    Keyed,
}

/// Something the connection reported while waiting.
pub(crate) enum RdmaWake {
    /// The completion queue has entries (poll it).
    Completions(Result<(), nvmf_rdma::Error>),
    /// A connection event.
    Cm(Result<CmEvent, nvmf_rdma::Error>),
}

/// One NVMe/RDMA queue connection.
pub(crate) struct RdmaConn {
    q: CapsuleQueue<Box<[u8]>>,
    events: Vec<Event<Box<[u8]>>>,
    capsule: Vec<u8>,
    in_capsule: usize,
    addr: String,
    /// Largest write sent in the capsule by the queue task (at most `in_capsule`).
    pub icd_limit: usize,
    /// Completions taken from the completion queue (reused).
    cqes: Vec<Cqe>,
    /// The queue's entries (its Connect's queue size).
    pub entries: u16,
}

/// `sqe` with its data described by one keyed SGL data block for `remote`.
fn keyed_sqe(mut sqe: Sqe, remote: RemoteKey) -> Sqe {
    sqe.set_sgl();
    sqe.dptr = SglDescriptor::keyed(remote.addr, remote.len, remote.rkey, false);
    sqe
}

/// Why this host cannot do NVMe/RDMA, if it cannot.
pub(crate) fn unavailable() -> Option<String> {
    if let Some(why) = nvmf_rdma::unavailable_reason() {
        return Some(why);
    }
    if !std::path::Path::new(RDMA_CM_NODE).exists() {
        return Some(format!(
            "{RDMA_CM_NODE} is missing (no RDMA device, or the rdma_ucm module is not loaded)"
        ));
    }
    None
}

/// The RDMA-CM device node of the kernel.
const RDMA_CM_NODE: &str = "/dev/infiniband/rdma_cm";

impl RdmaConn {
    /// What NVMe/RDMA allows: a keyed SGL data block describes at most 16 MiB - 1 (8 MiB
    /// per command here), every send slot of a queue has room for the in-capsule data (16 KiB
    /// here, to keep the slots small), none on the admin queue, and the target writes read
    /// data into registered memory only (no lent buffers); set-up commands name their data
    /// (the Connect data) with a keyed SGL.
    pub const LIMITS: LinkLimits = LinkLimits {
        max_transfer: Some(8 << 20),
        max_in_capsule: Some(16384),
        admin_in_capsule: 0,
        lends_buffers: false,
        needs_keyed_sgls: true,
        setup_in_capsule: 0,
    };

    /// Connects queue `qid` of `depth` entries (controller `cntlid`, 0xFFFF for the admin
    /// queue), with capsules that carry up to `in_capsule` bytes of data, in protection domain
    /// `pd` when the route goes through its device (a new domain is stored there otherwise).
    pub async fn open(
        addr: &TargetAddr,
        qid: u16,
        depth: u16,
        cntlid: u16,
        in_capsule: usize,
        timeout: Duration,
        pd: &SharedPd,
    ) -> Result<Self, Error> {
        let addr_s = addr.to_string();
        if let Some(why) = unavailable() {
            return Err(Error::RdmaUnavailable(why));
        }
        let deadline = Instant::now() + timeout;
        let dst: SocketAddr = match timeout_at(
            deadline,
            tokio::net::lookup_host((addr.host.as_str(), addr.port)),
        )
        .await
        {
            Err(_) => return Err(Error::timeout("the address resolution", timeout)),
            Ok(Err(e)) => return Err(Error::connect(&addr_s, e)),
            Ok(Ok(mut it)) => it.next().ok_or_else(|| Error::Rdma {
                addr: addr_s.clone(),
                reason: "the host name has no address".into(),
            })?,
        };
        let cfg = QueueConfig::host(depth, in_capsule, RESPONDER_RESOURCES);
        let private = nvmf_rdma::nvme::request_data(qid, depth - 1, depth, cntlid);
        let connect = CapsuleQueue::connect(dst, cfg, &private, timeout, pd.get());
        let (q, accept) = match timeout_at(deadline, connect).await {
            Err(_) => return Err(Error::timeout("the RDMA-CM connection", timeout)),
            Ok(Err(e)) => return Err(rdma_error(&addr_s, e)),
            Ok(Ok(v)) => v,
        };
        pd.set(q.pd());
        if let Some(crqsize) = nvmf_rdma::nvme::parse_accept(&accept) {
            if crqsize < depth {
                return Err(Error::Refused(format!(
                    "the target accepted queue {qid} with {crqsize} receive buffers, fewer than its {depth} entries"
                )));
            }
        }
        if q.config().recv_slots < u32::from(depth) {
            return Err(Error::Rdma {
                addr: addr_s,
                reason: format!(
                    "the device allows {} work requests per queue, fewer than {depth}",
                    q.config().recv_slots
                ),
            });
        }
        Ok(RdmaConn {
            q,
            events: Vec::with_capacity(64),
            capsule: Vec::with_capacity(64 + in_capsule),
            in_capsule,
            addr: addr_s,
            icd_limit: 0,
            cqes: Vec::with_capacity(usize::from(depth)),
            entries: depth,
        })
    }

    /// Sends command `sqe` (its command identifier set) with `len` bytes of data in `buf`
    /// (`to_host`: read data). Data up to [`icd_limit`](Self::icd_limit) bytes of a write
    /// travels in the capsule; other data gets a keyed SGL data block on `buf`, registered
    /// once and kept with it (counted in `c`). A registration failure is an error of this
    /// command only ([`Error::Rdma`], `Ok(Err(..))`); a failed send is a connection error
    /// (`Err`).
    pub fn send_command(
        &mut self,
        mut sqe: Sqe,
        buf: &mut SlotBuf,
        len: usize,
        to_host: bool,
        c: &QueueCounters,
    ) -> Result<Result<DataPath, Error>, Error> {
        sqe.set_sgl();
        if len == 0 {
            sqe.dptr = SglDescriptor::keyed(0, 0, 0, false);
            self.post(&sqe, &[])?;
            return Ok(Ok(DataPath::None));
        }
        if !to_host && len <= self.icd_limit.min(self.in_capsule) {
            sqe.dptr = SglDescriptor::in_capsule(len as u32);
            self.post(&sqe, &buf.as_slice()[..len])?;
            return Ok(Ok(DataPath::InCapsule));
        }
        let remote = match buf.remote(self.q.pd(), len) {
            Ok((k, registered)) => {
                bump(&c.buffer_registrations, u64::from(registered));
                k
            }
            Err(e) => return Ok(Err(rdma_error(&self.addr, e))),
        };
        self.send_keyed(sqe, remote)?;
        Ok(Ok(DataPath::Keyed))
    }

    /// Sends `sqe` with its data described by one keyed SGL data block: the target RDMA
    /// WRITEs (reads) or RDMA READs (writes) `remote`. Any memory registered for remote access
    /// on this queue's protection domain can be named: a slot buffer, or a registered dma-buf
    /// (device memory such as a GPU buffer, `nvmf_rdma::DmabufRegion::remote_key`).
    pub fn send_keyed(&mut self, sqe: Sqe, remote: RemoteKey) -> Result<(), Error> {
        self.post(&keyed_sqe(sqe, remote), &[])
    }

    /// The protection domain of the queue pair.
    pub fn pd(&self) -> &std::sync::Arc<ProtectionDomain> {
        self.q.pd()
    }

    /// SENDs the capsule: the command and its in-capsule data.
    fn post(&mut self, sqe: &Sqe, data: &[u8]) -> Result<(), Error> {
        self.capsule.clear();
        self.capsule.extend_from_slice(&sqe.to_array());
        self.capsule.extend_from_slice(data);
        self.q
            .send(&self.capsule, None, None, u64::from(sqe.cid.get()))
            .map_err(|e| Error::lost(&self.addr, format!("cannot send a command: {e}")))
    }

    /// Collects the completions that arrived into `out` (their receive slots are posted
    /// again). A failed work request or a malformed completion is a connection error.
    pub fn poll(&mut self, out: &mut Vec<Cqe>) -> Result<(), Error> {
        self.q
            .poll(&mut self.events)
            .map_err(|e| Error::lost(&self.addr, format!("completion queue: {e}")))?;
        let mut bad = None;
        for ev in self.events.drain(..) {
            match ev {
                Event::Received(slot) => {
                    let msg = self.q.message(&slot);
                    if msg.len() < 16 {
                        bad.get_or_insert_with(|| {
                            format!("a {}-byte message is not a completion", msg.len())
                        });
                    } else {
                        let mut raw = [0u8; 16];
                        raw.copy_from_slice(&msg[..16]);
                        out.push(Cqe::from_array(&raw));
                    }
                    if let Err(e) = self.q.repost(slot) {
                        bad.get_or_insert_with(|| format!("cannot post a receive: {e}"));
                    }
                }
                Event::Sent { ok: false, .. } | Event::ReadDone { ok: false, .. } => {
                    bad.get_or_insert_with(|| "a send failed".into());
                }
                Event::Sent { .. } | Event::ReadDone { .. } => {}
            }
        }
        if let Some(f) = self.q.failed() {
            return Err(Error::lost(
                &self.addr,
                format!("RDMA queue pair failed: {f}"),
            ));
        }
        match bad {
            Some(why) => Err(Error::lost(&self.addr, why)),
            None => Ok(()),
        }
    }

    /// Waits until the completion queue has entries or a connection event comes.
    pub async fn ready(&self) -> RdmaWake {
        tokio::select! {
            r = self.q.wait() => RdmaWake::Completions(r),
            e = self.q.cm_event() => RdmaWake::Cm(e),
        }
    }

    /// What a connection event means for the queue: `Some(error)` when the connection is gone.
    pub fn cm_outcome(&self, ev: Result<CmEvent, nvmf_rdma::Error>) -> Option<Error> {
        match ev {
            Ok(CmEvent::Established | CmEvent::Other(_)) => None,
            Ok(CmEvent::Disconnected) => Some(Error::lost(&self.addr, "the target disconnected")),
            Ok(other) => Some(Error::lost(&self.addr, format!("{other:?}"))),
            Err(e) => Some(Error::lost(&self.addr, e.to_string())),
        }
    }
}

impl RdmaConn {
    /// Hands the completions the queue pair delivered to `core`; returns whether there were
    /// any.
    pub fn process<C: Completions>(&mut self, core: &mut Core<C>) -> Result<bool, Error> {
        let mut cqes = std::mem::take(&mut self.cqes);
        let polled = self.poll(&mut cqes);
        let got = !cqes.is_empty();
        let mut res = Ok(());
        for cqe in cqes.drain(..) {
            if res.is_err() {
                continue;
            }
            if let Some(cmd) = core.sent_cmd(cqe.cid()) {
                if cmd.req.dir == DataDir::ToHost && cqe.status().is_success() {
                    bump(&core.counters().bytes_read, u64::from(cmd.req.len));
                }
            }
            res = core.on_response(self, cqe);
        }
        self.cqes = cqes;
        res.and(polled).map(|()| got)
    }
}

/// NVMe/RDMA capsules: write data up to the in-capsule limit travels in the capsule; other
/// data is described by a keyed SGL on the slot's registered buffer or on caller-registered
/// memory, which the target RDMA WRITEs (reads) or RDMA READs (writes).
impl Wire for RdmaConn {
    fn send(
        &mut self,
        tag: u16,
        cmd: &mut Cmd,
        c: &QueueCounters,
    ) -> Result<Result<(), Error>, Error> {
        let mut sqe = cmd.req.sqe;
        sqe.cid.set(tag);
        let len = match cmd.req.dir {
            DataDir::None => 0,
            _ => cmd.req.len as usize,
        };
        let to_host = cmd.req.dir == DataDir::ToHost;
        let path = if let Some(d) = &cmd.direct {
            match d.remote_key(self.pd(), len) {
                Ok(key) => {
                    self.send_keyed(sqe, key)?;
                    bump(&c.registered_commands, 1);
                    bump(&c.registered_bytes, len as u64);
                    DataPath::Keyed
                }
                // Not reachable through this queue pair; the connection is fine.
                Err(e) => return Ok(Err(e)),
            }
        } else {
            // Err inside: this command's buffer could not be registered; the connection is
            // fine.
            match self.send_command(sqe, &mut cmd.buf, len, to_host, c)? {
                Ok(p) => p,
                Err(e) => return Ok(Err(e)),
            }
        };
        if cmd.req.dir == DataDir::FromHost {
            bump(&c.bytes_written, len as u64);
            match path {
                DataPath::InCapsule => bump(&c.in_capsule_writes, 1),
                DataPath::Keyed => bump(&c.r2t_writes, 1),
                DataPath::None => {}
            }
        }
        Ok(Ok(()))
    }

    /// Nothing to forget: an NVMe/RDMA command has no transfer state on the host.
    fn forget(&mut self, _tag: u16) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_buffers_grow_and_keep_their_bytes() {
        let mut b = SlotBuf::default();
        assert!(b.as_slice().is_empty());
        b.ensure(8).unwrap();
        b.as_mut_slice()[..3].copy_from_slice(b"abc");
        b.ensure(4).unwrap();
        assert_eq!(b.as_slice().len(), 8);
        b.ensure(16).unwrap();
        assert_eq!(&b.as_slice()[..3], b"abc");
        assert_eq!(b.as_slice().len(), 16);
    }

    #[test]
    fn keyed_descriptor_layout() {
        let d = SglDescriptor::keyed(0x1122_3344_5566_7788, 0x12_3456, 0xAABB_CCDD, false);
        assert_eq!(d.desc_type(), nvme_spec::queue::sgl_type::KEYED_DATA_BLOCK);
        assert_eq!(d.subtype(), 0);
        assert_eq!(d.keyed_length(), 0x12_3456);
        assert_eq!(d.key(), 0xAABB_CCDD);
        assert_eq!(d.address.get(), 0x1122_3344_5566_7788);
    }

    #[test]
    fn keyed_commands_name_the_registered_memory() {
        let sqe = nvme_spec::command::build::read_write(false, 7, 1, 0x100, 2048);
        let key = RemoteKey {
            addr: 0x7f00_1234_5000 + (8 << 20),
            len: 8 << 20,
            rkey: 0x0102_0304,
        };
        let k = keyed_sqe(sqe, key);
        assert_eq!(k.opcode, sqe.opcode);
        assert_eq!(k.cid.get(), 7);
        assert_eq!(
            k.dptr.desc_type(),
            nvme_spec::queue::sgl_type::KEYED_DATA_BLOCK
        );
        assert_eq!(k.dptr.address.get(), key.addr);
        assert_eq!(k.dptr.keyed_length(), 8 << 20);
        assert_eq!(k.dptr.key(), 0x0102_0304);
        // PSDT says SGL (bits 15:14 of CDW0 = 01b).
        assert_eq!(k.to_array()[1] >> 6, 0b01);
    }

    #[tokio::test]
    async fn rdma_without_rdma_core_is_one_clear_error() {
        if unavailable().is_none() {
            return;
        }
        let addr = TargetAddr::rdma("127.0.0.1", 4420);
        let pd = SharedPd::default();
        let e = RdmaConn::open(&addr, 0, 32, 0xFFFF, 0, Duration::from_secs(1), &pd)
            .await
            .err()
            .expect("no RDMA here");
        assert!(matches!(e, Error::RdmaUnavailable(_)), "{e}");
        assert!(!e.to_string().contains('\n'));
    }
}
