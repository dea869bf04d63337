//! Connection set-up: a queue's link opened by its transport ([`TcpConn::open`],
//! [`RdmaConn::open`]), and commands issued one at a time before the queue is handed to its
//! task (Fabrics Connect and authentication, properties, Identify, discovery). Those commands
//! go through a queue core of one slot on the connection's link: the same command path as
//! I/O.

use std::sync::Arc;
use std::time::Duration;

use nvme_spec::fabrics::{CONNECT_AUTHREQ_ASCR, CONNECT_AUTHREQ_ATR, ConnectData};
use nvme_spec::{Cqe, FabricsCommand, IntoBytes, Sqe};
use nvmf_tcp::HostParams;
use nvmf_tls::ClientContext;
use parking_lot::Mutex;
use tokio::time::{Instant, timeout_at};

use crate::admin::{Admin, admin_request};
use crate::buffer::SlotBuf;
use crate::error::command_name;
use crate::link::{self, Link};
use crate::queue_core::{Completions, Core, QueueCounters, Retry};
use crate::rdma::{RdmaConn, SharedPd};
use crate::tcp::TcpConn;
use crate::{DhchapSecrets, Error, HostIdentity, TargetAddr, Transport};

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
    /// Ask the controller to disable SQ flow control at Connect.
    pub sq_flow_off: bool,
}

/// A freshly opened queue connection driven one command at a time.
pub(crate) struct SetupConn {
    pub link: Link,
    pub params: HostParams,
    pub addr: String,
    /// The queue this connection is for.
    spec: QueueSpec,
    admin_timeout: Duration,
    /// The queue core the set-up commands go through, one at a time (command identifier 0).
    core: Core<Arc<SetupSlot>>,
    slot: Arc<SetupSlot>,
}

/// The one command slot of a connection being set up.
#[derive(Default)]
struct SetupSlot {
    done: Mutex<Option<(Result<Cqe, Error>, SlotBuf)>>,
    counters: QueueCounters,
}

impl Completions for Arc<SetupSlot> {
    fn finish(&mut self, _tag: u16, result: Result<Cqe, Error>, buf: SlotBuf) {
        *self.done.lock() = Some((result, buf));
    }

    fn counters(&self) -> &QueueCounters {
        &self.counters
    }
}

impl SetupConn {
    /// A connection just opened, with its one-slot queue core.
    fn new(
        link: Link,
        params: HostParams,
        addr: String,
        spec: QueueSpec,
        admin_timeout: Duration,
    ) -> Self {
        let slot = Arc::new(SetupSlot::default());
        let core = Core::new(Arc::clone(&slot), addr.clone(), 1, false, true);
        SetupConn {
            link,
            params,
            addr,
            spec,
            admin_timeout,
            core,
            slot,
        }
    }

    /// Opens the connection of queue `q` within `connect_timeout`: [`TcpConn::open`] or
    /// [`RdmaConn::open`] (in the protection domain `pd` shares).
    #[allow(clippy::too_many_arguments)]
    pub async fn open(
        addr: &TargetAddr,
        q: QueueSpec,
        digests: (bool, bool),
        connect_timeout: Duration,
        admin_timeout: Duration,
        pd: &SharedPd,
        tls: Option<&ClientContext>,
    ) -> Result<Self, Error> {
        let (link, params) = match addr.transport {
            Transport::Tcp => {
                let (tcp, params) =
                    TcpConn::open(addr, q.depth, digests, connect_timeout, tls).await?;
                (Link::Tcp(tcp), params)
            }
            Transport::Rdma => {
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
                // Digests are NVMe/TCP's.
                let params = HostParams {
                    digests: nvmf_tcp::Digests::default(),
                    maxh2cdata: 0,
                    cpda: 0,
                };
                (Link::Rdma(conn), params)
            }
        };
        Ok(SetupConn::new(
            link,
            params,
            addr.to_string(),
            q,
            admin_timeout,
        ))
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
        let data_in_len = u32::try_from(data_in)
            .map_err(|_| Error::InvalidArgument("transfer too large".into()))?;
        let req = admin_request(sqe, data_out, data_in_len, Retry::Never, t)?;
        let mut buf = SlotBuf::Heap(data_out.to_vec());
        buf.ensure(len)?;
        let icd = self.link.limits().setup_in_capsule;
        self.link.set_icd_limit(icd);
        let deadline = Instant::now() + t;
        self.core.now = Instant::now();
        self.core
            .submit(Some(&mut self.link), 0, req, buf, None, None)?;
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
            let err = match self.link.wake_error(&self.addr, wake) {
                None => self.link.receive(&mut self.core, link::RECEIVE_ALL).err(),
                lost => lost,
            };
            if let Some(e) = err {
                // A protocol error leaves a TermReq to send; give it one try.
                let _ = self.link.try_flush();
                return Err(e);
            }
        }
    }

    /// Fabrics Connect for the queue the connection was opened for (its ID, entries,
    /// controller ID, and whether to ask to disable SQ flow control), then the DH-HMAC-CHAP
    /// transaction with `dhchap` when the controller asks for authentication; returns the
    /// controller ID from the response.
    pub async fn connect(
        &mut self,
        kato_ms: u32,
        subnqn: &str,
        host: &HostIdentity,
        dhchap: Option<&DhchapSecrets>,
    ) -> Result<u16, Error> {
        let QueueSpec {
            qid,
            cntlid,
            depth,
            sq_flow_off,
            ..
        } = self.spec;
        let cmd = FabricsCommand::Connect(nvme_spec::command::Connect {
            recfmt: 0,
            qid,
            sqsize: u32::from(depth),
            cattr: if sq_flow_off {
                nvme_spec::command::CATTR_SQ_FLOW_CONTROL_DISABLE
            } else {
                0
            },
            kato_ms,
        });
        let data = ConnectData::new(host.hostid, cntlid, subnqn, &host.hostnqn);
        let (cqe, _) = self.command(cmd.encode(0), data.as_bytes(), 0).await?;
        let dw0 = cqe.dw0.get();
        if dw0 & (CONNECT_AUTHREQ_ATR | CONNECT_AUTHREQ_ASCR) != 0 {
            crate::auth::authenticate(self, qid, dw0, subnqn, &host.hostnqn, dhchap).await?;
        }
        Ok((dw0 & 0xFFFF) as u16)
    }
}

impl Admin for SetupConn {
    async fn run(
        &mut self,
        sqe: Sqe,
        data_out: &[u8],
        data_in: u32,
        _retry: Retry,
    ) -> Result<(Cqe, Vec<u8>), Error> {
        self.command(sqe, data_out, data_in as usize).await
    }
}
