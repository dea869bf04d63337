//! Connection set-up: TCP connect and ICReq/ICResp (NVMe/TCP) or the RDMA-CM connection
//! (NVMe/RDMA), and commands issued one at a time before a queue is handed to its I/O task
//! (Fabrics Connect, properties, Identify, discovery). Those commands go through a queue
//! core of one slot on the connection's link: the same command path as I/O.

use std::sync::Arc;
use std::time::Duration;

use nvme_spec::fabrics::{ConnectData, csts, property};
use nvme_spec::{Cqe, FabricsCommand, IntoBytes, Sqe};
use nvmf_tcp::{HostConfig, HostConn, HostEvent, HostParams};
use parking_lot::Mutex;
use tokio::net::TcpStream;
use tokio::time::{Instant, timeout_at};

use crate::buffer::SlotBuf;
use crate::error::command_name;
use crate::link::{Link, LinkWake};
use crate::queue_core::{Completions, Core, DataDir, QueueCounters, Request, Retry};
use crate::rdma::{RdmaConn, RdmaWake, SharedPd};
use crate::tcp::{READ_CHUNK, TcpConn};
use crate::{Error, HostIdentity, TargetAddr, Transport};

/// Delay between two polls of CSTS.
const CSTS_POLL: Duration = Duration::from_millis(20);

/// Which queue a connection is for (NVMe/RDMA names it when connecting).
#[derive(Clone, Copy, Debug)]
pub(crate) struct QueueSpec {
    /// Queue ID (0: admin).
    pub qid: u16,
    /// Controller ID (0xFFFF on the admin queue).
    pub cntlid: u16,
    /// Entries.
    pub depth: u16,
    /// In-capsule data the queue's capsules may carry (NVMe/RDMA send slots).
    pub in_capsule: usize,
}

/// A freshly opened queue connection driven one command at a time.
pub(crate) struct SetupConn {
    pub link: Link,
    pub params: HostParams,
    pub addr: String,
    admin_timeout: Duration,
    /// The queue core the set-up commands go through, one at a time (command identifier 0).
    core: Core<SetupSlot>,
    slot: Arc<SetupSlot>,
}

/// The one command slot of a connection being set up.
#[derive(Default)]
struct SetupSlot {
    done: Mutex<Option<(Result<Cqe, Error>, SlotBuf)>>,
    counters: QueueCounters,
}

impl Completions for SetupSlot {
    fn finish(&self, _tag: u16, result: Result<Cqe, Error>, buf: SlotBuf) {
        *self.done.lock() = Some((result, buf));
    }

    fn counters(&self) -> &QueueCounters {
        &self.counters
    }
}

impl SetupConn {
    /// Opens the connection, all within `connect_timeout`: for NVMe/TCP the TCP connection
    /// and the ICReq/ICResp exchange, for NVMe/RDMA the RDMA-CM connection with the NVMe
    /// private data of queue `q`, in the protection domain `pd` shares.
    pub async fn open(
        addr: &TargetAddr,
        q: QueueSpec,
        digests: (bool, bool),
        connect_timeout: Duration,
        admin_timeout: Duration,
        pd: &SharedPd,
    ) -> Result<Self, Error> {
        let addr_s = addr.to_string();
        let no_digests = HostParams {
            digests: nvmf_tcp::Digests::default(),
            maxh2cdata: 0,
            cpda: 0,
        };
        if addr.transport == Transport::Rdma {
            let conn = RdmaConn::open(
                addr,
                q.qid,
                q.depth,
                q.cntlid,
                q.in_capsule,
                connect_timeout,
                pd,
            )
            .await?;
            let slot = Arc::new(SetupSlot::default());
            let core = Core::new(Arc::clone(&slot), addr_s.clone(), 1, false, true);
            return Ok(SetupConn {
                link: Link::Rdma(conn),
                params: no_digests,
                addr: addr_s,
                admin_timeout,
                core,
                slot,
            });
        }
        let deadline = Instant::now() + connect_timeout;
        let stream = match timeout_at(
            deadline,
            TcpStream::connect((addr.host.as_str(), addr.port)),
        )
        .await
        {
            Err(_) => return Err(Error::timeout("the TCP connection", connect_timeout)),
            Ok(Err(e)) => return Err(Error::connect(&addr_s, e)),
            Ok(Ok(s)) => s,
        };
        let _ = stream.set_nodelay(true);
        let engine = HostConn::new(HostConfig {
            hdgst: digests.0,
            ddgst: digests.1,
            recv_buffer_size: READ_CHUNK,
            max_outstanding_commands: usize::from(q.depth).max(2),
        });
        let mut tcp = TcpConn {
            stream,
            engine,
            addr: addr_s.clone(),
            icd_limit: 0,
        };
        tcp.flush(&addr_s, deadline, "the ICResp", connect_timeout)
            .await?;
        loop {
            match tcp.engine.next_event() {
                Ok(Some(HostEvent::Connected(p))) => {
                    let slot = Arc::new(SetupSlot::default());
                    let core = Core::new(Arc::clone(&slot), addr_s.clone(), 1, false, true);
                    return Ok(SetupConn {
                        link: Link::Tcp(tcp),
                        params: p,
                        addr: addr_s,
                        admin_timeout,
                        core,
                        slot,
                    });
                }
                Ok(Some(HostEvent::TermReq { fes, fei, .. })) => {
                    return Err(Error::TermReq {
                        addr: addr_s,
                        fes,
                        fei,
                    });
                }
                Ok(Some(_)) => {}
                Ok(None) => {
                    tcp.read_more(&addr_s, deadline, "the ICResp", connect_timeout)
                        .await?
                }
                Err(source) => {
                    tcp.flush_best_effort(&addr_s).await;
                    return Err(Error::Protocol {
                        addr: addr_s,
                        source,
                    });
                }
            }
        }
    }

    /// The connection as a queue task's, with writes of up to `icd_limit` bytes in capsules.
    pub fn into_link(mut self, icd_limit: usize) -> Link {
        self.link.set_icd_limit(icd_limit);
        self.link
    }

    /// Runs one command: `data_out` goes to the target, `data_in` bytes are expected back.
    /// A completion with an error status is returned as [`Error::Status`].
    pub async fn command(
        &mut self,
        sqe: Sqe,
        data_out: &[u8],
        data_in: usize,
    ) -> Result<(Cqe, Vec<u8>), Error> {
        let name = command_name(true, sqe.opcode, sqe.fctype());
        let res = self.run(sqe, data_out, data_in).await;
        let (cqe, buf) = match res {
            Ok(r) => r,
            Err(e) => {
                // The connection is given up: nothing stays in the table.
                self.core.fail_all(&e);
                self.slot.done.lock().take();
                return Err(e);
            }
        };
        let status = cqe.status();
        if !status.is_success() {
            return Err(Error::status_of(name, status));
        }
        Ok((cqe, buf.as_slice()[..data_in].to_vec()))
    }

    /// Sends one command through the queue core and drives the link until it completes.
    async fn run(
        &mut self,
        sqe: Sqe,
        data_out: &[u8],
        data_in: usize,
    ) -> Result<(Cqe, SlotBuf), Error> {
        let t = self.admin_timeout;
        let name = command_name(true, sqe.opcode, sqe.fctype());
        let len = data_out.len().max(data_in);
        let req = Request {
            sqe,
            dir: if !data_out.is_empty() {
                DataDir::FromHost
            } else if data_in > 0 {
                DataDir::ToHost
            } else {
                DataDir::None
            },
            len: u32::try_from(len)
                .map_err(|_| Error::InvalidArgument("transfer too large".into()))?,
            retry: Retry::Never,
            timeout: Some(t),
        };
        let mut buf = SlotBuf::Heap(data_out.to_vec());
        buf.ensure(len)?;
        let icd = self.link.limits().setup_in_capsule;
        self.link.set_icd_limit(icd);
        let deadline = Instant::now() + t;
        self.core.now = Instant::now();
        self.core.submit(Some(&mut self.link), 0, req, buf, None)?;
        // What arrived already (a completion queue is polled before it is waited on).
        if let Err(e) = self.link.process(&mut self.core) {
            let _ = self.link.try_flush();
            return Err(e);
        }
        loop {
            if let Some((result, buf)) = self.slot.done.lock().take() {
                return result.map(|cqe| (cqe, buf));
            }
            if let Err(e) = self.link.try_flush() {
                return Err(Error::lost(&self.addr, format!("send failed: {e}")));
            }
            let wake = match timeout_at(deadline, self.link.ready()).await {
                Err(_) => return Err(Error::timeout(name, t)),
                Ok(w) => w,
            };
            let err = match wake {
                LinkWake::Tcp(Ok(_)) | LinkWake::Rdma(RdmaWake::Completions(Ok(()))) => {
                    self.link.receive(&mut self.core).err()
                }
                LinkWake::Tcp(Err(e)) => {
                    Some(Error::lost(&self.addr, format!("socket error: {e}")))
                }
                LinkWake::Rdma(RdmaWake::Completions(Err(e))) => {
                    Some(Error::lost(&self.addr, format!("completion queue: {e}")))
                }
                LinkWake::Rdma(RdmaWake::Cm(ev)) => match &self.link {
                    Link::Rdma(conn) => conn.cm_outcome(ev),
                    Link::Tcp(_) => None,
                },
            };
            if let Some(e) = err {
                // A protocol error leaves a TermReq to send; give it one try.
                let _ = self.link.try_flush();
                return Err(e);
            }
        }
    }

    /// Fabrics Connect; returns the controller ID from the response.
    pub async fn connect(
        &mut self,
        qid: u16,
        sqsize: u32,
        kato_ms: u32,
        cntlid: u16,
        subnqn: &str,
        host: &HostIdentity,
    ) -> Result<u16, Error> {
        let cmd = FabricsCommand::Connect(nvme_spec::command::Connect {
            recfmt: 0,
            qid,
            sqsize,
            cattr: 0,
            kato_ms,
        });
        let data = ConnectData::new(host.hostid, cntlid, subnqn, &host.hostnqn);
        let (cqe, _) = self.command(cmd.encode(0), data.as_bytes(), 0).await?;
        Ok((cqe.dw0.get() & 0xFFFF) as u16)
    }

    /// Property Get.
    pub async fn property_get(&mut self, offset: u32, size8: bool) -> Result<u64, Error> {
        let cmd = FabricsCommand::PropertyGet { size8, offset };
        let (cqe, _) = self.command(cmd.encode(0), &[], 0).await?;
        Ok(if size8 {
            cqe.value64()
        } else {
            u64::from(cqe.dw0.get())
        })
    }

    /// Property Set of a 4-byte property.
    pub async fn property_set(&mut self, offset: u32, value: u32) -> Result<(), Error> {
        let cmd = FabricsCommand::PropertySet {
            size8: false,
            offset,
            value: u64::from(value),
        };
        self.command(cmd.encode(0), &[], 0).await.map(|_| ())
    }

    /// Sets CC.EN and waits for CSTS.RDY, at most CAP.TO (and at least `min_wait`).
    pub async fn enable(&mut self, cap_timeout_ms: u32, min_wait: Duration) -> Result<(), Error> {
        self.property_set(property::CC, nvme_spec::fabrics::Cc::enable_value())
            .await?;
        let limit = Duration::from_millis(u64::from(cap_timeout_ms)).max(min_wait);
        let deadline = Instant::now() + limit;
        loop {
            let v = self.property_get(property::CSTS, false).await? as u32;
            if v & csts::CFS != 0 {
                return Err(Error::Refused(
                    "the controller reports a fatal status (CSTS.CFS) after enable".into(),
                ));
            }
            if v & csts::RDY != 0 {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(Error::timeout(
                    "CSTS.RDY after enabling the controller",
                    limit,
                ));
            }
            tokio::time::sleep(CSTS_POLL).await;
        }
    }

    /// Requests a normal shutdown (CC.SHN) and waits for CSTS.SHST, at most `limit`.
    pub async fn shutdown(&mut self, limit: Duration) -> Result<(), Error> {
        shutdown(self, limit).await
    }

    /// Identify with the given CNS and NSID (4096 bytes).
    pub async fn identify(&mut self, cns: u8, nsid: u32) -> Result<Vec<u8>, Error> {
        let sqe = nvme_spec::command::build::identify(0, cns, nsid);
        self.command(sqe, &[], 4096).await.map(|(_, d)| d)
    }

    /// Set Features; returns completion DW0.
    pub async fn set_features(&mut self, fid: u8, cdw11: u32) -> Result<u32, Error> {
        let sqe = nvme_spec::command::build::set_features(0, fid, cdw11);
        self.command(sqe, &[], 0).await.map(|(c, _)| c.dw0.get())
    }

    /// Get Log Page of `len` bytes at `offset`.
    pub async fn get_log_page(&mut self, lid: u8, len: u32, offset: u64) -> Result<Vec<u8>, Error> {
        let sqe = nvme_spec::command::build::get_log_page(0, lid, 0, len, offset);
        self.command(sqe, &[], len as usize).await.map(|(_, d)| d)
    }
}

/// Access to a controller's 4-byte properties: through the one-at-a-time commands of a
/// connection being set up, or through a running admin queue.
pub(crate) trait Properties {
    /// Property Get.
    async fn get(&mut self, offset: u32) -> Result<u32, Error>;
    /// Property Set.
    async fn set(&mut self, offset: u32, value: u32) -> Result<(), Error>;
}

impl Properties for SetupConn {
    async fn get(&mut self, offset: u32) -> Result<u32, Error> {
        Ok(self.property_get(offset, false).await? as u32)
    }

    async fn set(&mut self, offset: u32, value: u32) -> Result<(), Error> {
        self.property_set(offset, value).await
    }
}

/// Requests a normal shutdown (CC.SHN) and waits for CSTS.SHST, at most `limit`.
pub(crate) async fn shutdown<P: Properties>(p: &mut P, limit: Duration) -> Result<(), Error> {
    let cc = p.get(property::CC).await?;
    p.set(property::CC, nvme_spec::fabrics::Cc::shutdown_value(cc))
        .await?;
    let deadline = Instant::now() + limit;
    loop {
        let v = p.get(property::CSTS).await?;
        if v & csts::SHST_MASK == csts::SHST_COMPLETE {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(Error::timeout("CSTS.SHST after a shutdown request", limit));
        }
        tokio::time::sleep(CSTS_POLL).await;
    }
}
