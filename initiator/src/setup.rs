//! Connection set-up: TCP connect and ICReq/ICResp (NVMe/TCP) or the RDMA-CM connection
//! (NVMe/RDMA), and commands issued one at a time before a queue is handed to its I/O task
//! (Fabrics Connect, properties, Identify, discovery).

use std::time::Duration;

use nvme_spec::fabrics::{ConnectData, csts, property};
use nvme_spec::{Cqe, FabricsCommand, IntoBytes, SglDescriptor, Sqe, Status};
use nvmf_tcp::{HostConfig, HostConn, HostEvent, HostParams};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::{Instant, timeout_at};

use crate::error::command_name;
use crate::queue::{Link, Live, READ_CHUNK};
use crate::rdma::{RdmaConn, SharedPd};
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

/// An NVMe/TCP connection: the socket and the engine.
pub(crate) struct TcpLink {
    pub stream: TcpStream,
    pub engine: HostConn,
}

/// The transport of a set-up connection.
// One value per queue, moved only while a connection is set up: no boxing on the data path.
#[allow(clippy::large_enum_variant)]
pub(crate) enum SetupLink {
    /// NVMe/TCP.
    Tcp(TcpLink),
    /// NVMe/RDMA.
    Rdma(RdmaConn),
}

/// A freshly opened queue connection driven one command at a time.
pub(crate) struct SetupConn {
    pub link: SetupLink,
    pub params: HostParams,
    pub addr: String,
    admin_timeout: Duration,
    next_cid: u16,
    admin: bool,
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
            return Ok(SetupConn {
                link: SetupLink::Rdma(conn),
                params: no_digests,
                addr: addr_s,
                admin_timeout,
                next_cid: 0,
                admin: true,
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
        let mut tcp = TcpLink { stream, engine };
        tcp.flush(&addr_s, deadline, "the ICResp", connect_timeout)
            .await?;
        loop {
            match tcp.engine.next_event() {
                Ok(Some(HostEvent::Connected(p))) => {
                    return Ok(SetupConn {
                        link: SetupLink::Tcp(tcp),
                        params: p,
                        addr: addr_s,
                        admin_timeout,
                        next_cid: 0,
                        admin: true,
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
    pub fn into_live(self, icd_limit: usize) -> Live {
        let link = match self.link {
            SetupLink::Tcp(TcpLink { stream, engine }) => Link::Tcp { stream, engine },
            SetupLink::Rdma(r) => Link::Rdma(r),
        };
        Live {
            link,
            icd_limit,
            addr: self.addr,
        }
    }

    /// Runs one command: `data_out` goes to the target, `data_in` bytes are expected back.
    /// A completion with an error status is returned as [`Error::Status`].
    pub async fn command(
        &mut self,
        sqe: Sqe,
        data_out: &[u8],
        data_in: usize,
    ) -> Result<(Cqe, Vec<u8>), Error> {
        let cid = self.next_cid;
        self.next_cid = self.next_cid.wrapping_add(1);
        let t = self.admin_timeout;
        match &mut self.link {
            SetupLink::Rdma(r) => r.command(sqe, cid, self.admin, data_out, data_in, t).await,
            SetupLink::Tcp(tcp) => {
                tcp.command(&self.addr, self.admin, cid, sqe, data_out, data_in, t)
                    .await
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
        self.admin = qid == 0;
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
        let cc = self.property_get(property::CC, false).await? as u32;
        self.property_set(property::CC, nvme_spec::fabrics::Cc::shutdown_value(cc))
            .await?;
        let deadline = Instant::now() + limit;
        loop {
            let v = self.property_get(property::CSTS, false).await? as u32;
            if v & csts::SHST_MASK == csts::SHST_COMPLETE {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(Error::timeout("CSTS.SHST after a shutdown request", limit));
            }
            tokio::time::sleep(CSTS_POLL).await;
        }
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

impl TcpLink {
    /// Writes everything queued in the engine.
    async fn flush(
        &mut self,
        addr: &str,
        deadline: Instant,
        what: &'static str,
        t: Duration,
    ) -> Result<(), Error> {
        while !self.engine.pending_send().is_empty() {
            let pending = self.engine.pending_send();
            let n = match timeout_at(deadline, self.stream.write(pending)).await {
                Err(_) => return Err(Error::timeout(what, t)),
                Ok(Err(e)) => return Err(Error::lost(addr, format!("send failed: {e}"))),
                Ok(Ok(0)) => return Err(Error::lost(addr, "send returned 0")),
                Ok(Ok(n)) => n,
            };
            self.engine.consume_sent(n);
        }
        Ok(())
    }

    /// Sends a queued TermReq if the socket takes it at once.
    async fn flush_best_effort(&mut self, addr: &str) {
        let deadline = Instant::now() + Duration::from_millis(100);
        let _ = self
            .flush(addr, deadline, "a TermReq", Duration::ZERO)
            .await;
    }

    async fn read_more(
        &mut self,
        addr: &str,
        deadline: Instant,
        what: &'static str,
        t: Duration,
    ) -> Result<(), Error> {
        let buf = self.engine.recv_buf(64 * 1024);
        match timeout_at(deadline, self.stream.read(buf)).await {
            Err(_) => Err(Error::timeout(what, t)),
            Ok(Err(e)) => Err(Error::lost(addr, format!("receive failed: {e}"))),
            Ok(Ok(0)) => Err(Error::lost(addr, "the target closed the connection")),
            Ok(Ok(n)) => {
                self.engine.commit_recv(n);
                Ok(())
            }
        }
    }

    /// One command over NVMe/TCP: `data_out` in the capsule, `data_in` bytes in C2HData.
    #[allow(clippy::too_many_arguments)]
    async fn command(
        &mut self,
        addr: &str,
        admin: bool,
        cid: u16,
        mut sqe: Sqe,
        data_out: &[u8],
        data_in: usize,
        t: Duration,
    ) -> Result<(Cqe, Vec<u8>), Error> {
        let name = command_name(admin, sqe.opcode, sqe.fctype());
        sqe.cid.set(cid);
        sqe.set_sgl();
        let len = u32::try_from(data_out.len().max(data_in))
            .map_err(|_| Error::InvalidArgument("transfer too large".into()))?;
        sqe.dptr = if data_out.is_empty() {
            SglDescriptor::tcp_transport(len)
        } else {
            SglDescriptor::in_capsule(len)
        };
        self.engine
            .send_capsule_cmd(&sqe.to_array(), data_out)
            .map_err(|e| Error::lost(addr, format!("cannot send {name}: {e}")))?;
        let deadline = Instant::now() + t;
        self.flush(addr, deadline, name, t).await?;
        let mut data = vec![0u8; data_in];
        let mut digest_error = false;
        loop {
            match self.engine.next_event() {
                Ok(Some(HostEvent::C2HData {
                    cccid,
                    datao,
                    data: d,
                    last,
                    success,
                })) if cccid == cid => {
                    let off = datao as usize;
                    if let Some(dst) = data.get_mut(off..off + d.len()) {
                        dst.copy_from_slice(d);
                    }
                    if last && success {
                        return Ok((Cqe::new(cid, Status::SUCCESS, 0), data));
                    }
                }
                Ok(Some(HostEvent::C2HDataDigestError {
                    cccid,
                    last,
                    success,
                })) if cccid == cid => {
                    digest_error = true;
                    if last && success {
                        return Err(digest_status(name));
                    }
                }
                Ok(Some(HostEvent::CapsuleResp { cqe })) => {
                    let cqe = Cqe::from_array(&cqe);
                    if cqe.cid() != cid {
                        continue;
                    }
                    let status = cqe.status();
                    if !status.is_success() {
                        return Err(Error::status_of(name, status));
                    }
                    if digest_error {
                        return Err(digest_status(name));
                    }
                    return Ok((cqe, data));
                }
                Ok(Some(HostEvent::TermReq { fes, fei, .. })) => {
                    return Err(Error::TermReq {
                        addr: addr.to_string(),
                        fes,
                        fei,
                    });
                }
                Ok(Some(_)) => {}
                Ok(None) => self.read_more(addr, deadline, name, t).await?,
                Err(source) => {
                    self.flush_best_effort(addr).await;
                    return Err(Error::Protocol {
                        addr: addr.to_string(),
                        source,
                    });
                }
            }
        }
    }
}

fn digest_status(name: &'static str) -> Error {
    Error::status_of(
        name,
        Status::generic(nvme_spec::status::generic::TRANSIENT_TRANSPORT_ERROR),
    )
}
