//! NVMe/TCP queue connections: the socket and the `nvmf-tcp` engine. The twin of `rdma`:
//! opening a queue's connection (TCP connect, TLS, ICReq/ICResp), and the queue's side of the link
//! contract ([`Wire`]: capsules with in-capsule data or a transport SGL answered on R2T;
//! receiving PDUs, read data into the command's buffer, completions into the queue core).

use std::io;
use std::task::Context;
use std::time::Duration;

use nvme_spec::{Cqe, SglDescriptor, Status};
use nvmf_tcp::{DataCommit, HostConfig, HostConn, HostEvent, HostParams, PendingData};
use nvmf_tls::{ClientContext, Stream};
use tokio::io::{Interest, Ready};
use tokio::net::TcpStream;
use tokio::time::{Instant, timeout_at};

use crate::queue_core::{Cmd, Completions, Core, DataDir, LinkLimits, QueueCounters, Wire, bump};
use crate::{ConnectOptions, Error, TargetAddr, Transport};

/// Bytes asked of the socket per read.
pub(crate) const READ_CHUNK: usize = 256 * 1024;
/// The rest of a C2HData PDU at least this long is read from the socket straight into the
/// command's buffer; shorter rests go through the receive buffer with what follows them.
const IN_PLACE_MIN: usize = 8192;
/// While read data arrives in PDUs at least [`LARGE_PDU`] long, the receive buffer takes at
/// most this much per read (the next PDU header and a little data), so that the rest of each
/// PDU goes straight into its command's buffer.
const SMALL_READ: usize = 2048;
/// See [`SMALL_READ`].
const LARGE_PDU: u32 = 32 * 1024;

/// An NVMe/TCP connection: the socket and the engine.
pub(crate) struct TcpConn {
    pub stream: Stream,
    pub engine: HostConn,
    /// The target address (for errors).
    pub addr: String,
    /// Largest write sent in the capsule (0 until the queue is handed to its task).
    pub icd_limit: usize,
    /// The queue's entries (its ICReq's and Connect's queue size).
    pub entries: u16,
}

impl TcpConn {
    /// What NVMe/TCP allows: no transfer limit of its own, in-capsule data as the
    /// controller offers (8 KiB on the admin queue), and read data received by the host, so
    /// into a buffer the caller lends if it wants; set-up commands carry their data in the
    /// capsule.
    pub const LIMITS: LinkLimits = LinkLimits {
        max_transfer: None,
        max_in_capsule: None,
        admin_in_capsule: 8192,
        lends_buffers: true,
        needs_keyed_sgls: false,
        setup_in_capsule: usize::MAX,
    };

    /// Opens a queue's connection, all within `connect_timeout`: the TCP connection, the
    /// TLS handshake with `tls` when given, and the ICReq/ICResp exchange for a queue of
    /// `depth` entries with the `digests` (header, data) asked for. Returns the connection
    /// and the parameters the controller answered with.
    pub async fn open(
        addr: &TargetAddr,
        depth: u16,
        digests: (bool, bool),
        connect_timeout: Duration,
        tls: Option<&ClientContext>,
    ) -> Result<(Self, HostParams), Error> {
        let addr_s = addr.to_string();
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
        let stream = match tls {
            None => Stream::Plain(stream),
            Some(ctx) => match timeout_at(deadline, Stream::connect(ctx, stream)).await {
                Err(_) => return Err(Error::timeout("the TLS handshake", connect_timeout)),
                Ok(Err(e)) => {
                    return Err(Error::Tls {
                        addr: addr_s,
                        reason: e.to_string(),
                    });
                }
                Ok(Ok(s)) => s,
            },
        };
        let engine = HostConn::new(HostConfig {
            hdgst: digests.0,
            ddgst: digests.1,
            recv_buffer_size: READ_CHUNK,
            max_outstanding_commands: usize::from(depth).max(2),
        });
        let mut tcp = TcpConn {
            stream,
            engine,
            addr: addr_s.clone(),
            icd_limit: 0,
            entries: depth,
        };
        tcp.flush(
            deadline,
            "the answer to the NVMe/TCP connection request",
            connect_timeout,
        )
        .await?;
        loop {
            match tcp.engine.next_event() {
                Ok(Some(HostEvent::Connected(p))) => {
                    return Ok((tcp, p));
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
                    tcp.read_more(
                        deadline,
                        "the answer to the NVMe/TCP connection request",
                        connect_timeout,
                    )
                    .await?
                }
                Err(source) => {
                    tcp.flush_best_effort().await;
                    return Err(Error::Protocol {
                        addr: addr_s,
                        source,
                    });
                }
            }
        }
    }

    /// Waits until the socket is readable (or writable while bytes wait to be sent).
    pub async fn ready(&self) -> io::Result<Ready> {
        let interest = if self.engine.pending_send().is_empty() {
            Interest::READABLE
        } else {
            Interest::READABLE | Interest::WRITABLE
        };
        self.stream.ready(interest).await
    }

    /// Registers `cx` for the socket's readability (and writability while bytes wait to be
    /// sent). Returns whether the socket is ready already (an error counts: reading says it).
    pub fn poll_ready(&self, cx: &mut Context<'_>) -> bool {
        let tcp = self.stream.tcp();
        let mut ready = tcp.poll_read_ready(cx).is_ready();
        if !self.engine.pending_send().is_empty() {
            ready |= tcp.poll_write_ready(cx).is_ready();
        }
        ready
    }

    /// Writes as much of the engine's send buffer as the socket takes without blocking.
    pub fn try_flush(&mut self) -> io::Result<()> {
        let n = self.stream.try_write_some(self.engine.pending_send())?;
        self.engine.consume_sent(n);
        Ok(())
    }

    /// Reads what the socket has, up to about `budget` bytes through the receive buffer,
    /// and hands it to `core`. Returns whether bytes arrived.
    pub fn receive<C: Completions>(
        &mut self,
        core: &mut Core<C>,
        budget: usize,
    ) -> Result<bool, Error> {
        self.receive_with(core, budget, false)
    }

    /// [`receive`](Self::receive) without waiting for the runtime to have seen the socket
    /// readable (plain TCP: a `recv` straight on it; see [`Stream::read_now`]).
    pub fn receive_now<C: Completions>(
        &mut self,
        core: &mut Core<C>,
        budget: usize,
    ) -> Result<bool, Error> {
        self.receive_with(core, budget, true)
    }

    fn receive_with<C: Completions>(
        &mut self,
        core: &mut Core<C>,
        budget: usize,
        now: bool,
    ) -> Result<bool, Error> {
        let mut got = false;
        let mut left = budget.max(SMALL_READ);
        for _ in 0..8 {
            if left == 0 {
                break;
            }
            let pending = self.engine.pending_data().filter(|p| p.len >= IN_PLACE_MIN);
            if let Some((p, dst)) = pending.and_then(|p| Some((p, data_buf(core, p)?))) {
                // The rest of the PDU straight into the command's buffer, what follows it
                // (a little) into the receive buffer, in one read.
                let spare = self.engine.recv_buf(SMALL_READ);
                let spare_len = spare.len().min(SMALL_READ);
                let mut iov = [
                    io::IoSliceMut::new(&mut *dst),
                    io::IoSliceMut::new(&mut spare[..spare_len]),
                ];
                let read = if now {
                    self.stream.read_vectored_now(&mut iov)
                } else {
                    self.stream.try_read_vectored(&mut iov)
                };
                let n = match read {
                    Ok(0) => {
                        return Err(Error::lost(&self.addr, "the target closed the connection"));
                    }
                    Ok(n) => n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) => return Err(Error::lost(&self.addr, format!("receive failed: {e}"))),
                };
                got = true;
                let in_place = n.min(p.len);
                let commit = self.engine.commit_data(&dst[..in_place]);
                self.engine.commit_recv(n - in_place);
                let c = core.counters();
                bump(&c.bytes_read, in_place as u64);
                bump(&c.in_place_bytes, in_place as u64);
                if let DataCommit::End {
                    last: true,
                    success: true,
                } = commit
                {
                    self.complete_by_data(core, p.cccid)?;
                }
                if n > in_place {
                    self.process(core)?;
                }
                if n < p.len + spare_len {
                    break;
                }
                continue;
            }
            let want = if self.engine.last_data_pdu_len() >= LARGE_PDU {
                SMALL_READ
            } else {
                READ_CHUNK.min(left)
            };
            let buf = self.engine.recv_buf(want);
            let want = want.min(buf.len());
            let buf = &mut buf[..want];
            let read = if now {
                self.stream.read_now(buf)
            } else {
                self.stream.try_read(buf)
            };
            match read {
                Ok(0) => {
                    // Handle what arrived before the close (a TermReq explains it).
                    self.process(core)?;
                    return Err(Error::lost(&self.addr, "the target closed the connection"));
                }
                Ok(n) => {
                    got = true;
                    left = left.saturating_sub(n);
                    self.engine.commit_recv(n);
                    self.process(core)?;
                    if n < want {
                        break;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(Error::lost(&self.addr, format!("receive failed: {e}"))),
            }
        }
        Ok(got)
    }

    /// Completes read `cccid`, whose last data PDU carried the SUCCESS flag (no response
    /// capsule follows).
    fn complete_by_data<C: Completions>(
        &mut self,
        core: &mut Core<C>,
        cccid: u16,
    ) -> Result<(), Error> {
        bump(&core.counters().data_completions, 1);
        core.on_response(self, Cqe::new(cccid, Status::SUCCESS, 0))
    }

    /// Leaves the data of the C2HData just decoded, all of read `cccid`'s, in the receive
    /// buffer for its caller (or copies it into the command's buffer when the connection
    /// keeps as much as it may).
    fn keep_data<C: Completions>(&mut self, core: &mut Core<C>, cccid: u16) {
        let Some(cmd) = core.cmd_mut(cccid) else {
            return;
        };
        let n = self.engine.last_data().len();
        let kept = self
            .engine
            .keep_last_data()
            .is_some_and(|k| cmd.buf.keep(k).is_ok());
        if !kept && let Some(dst) = cmd.buf.as_mut_slice().get_mut(..n) {
            dst.copy_from_slice(self.engine.last_data());
        }
        let c = core.counters();
        bump(&c.kept_reads, u64::from(kept));
        bump(&c.bytes_read, n as u64);
    }

    /// Hands every PDU the engine has decoded so far to `core`: read data into the command's
    /// buffer (or left where it was received, for its caller to copy out), write data sent
    /// on R2T, completions.
    pub fn process<C: Completions>(&mut self, core: &mut Core<C>) -> Result<(), Error> {
        loop {
            let ev = match self.engine.next_event() {
                Ok(Some(ev)) => ev,
                Ok(None) => return Ok(()),
                Err(source) => {
                    return Err(Error::Protocol {
                        addr: self.addr.clone(),
                        source,
                    });
                }
            };
            match ev {
                HostEvent::CapsuleResp { cqe } => {
                    let cqe = Cqe::from_array(&cqe);
                    core.on_response(self, cqe)?;
                }
                HostEvent::C2HData {
                    cccid,
                    datao,
                    data,
                    last,
                    success,
                } => {
                    let keeps = core.keeps_read_data();
                    let mut keep = false;
                    if let Some(cmd) = core.cmd_mut(cccid) {
                        // All of a read's data in one piece, for the slot's own buffer: its
                        // caller copies it out of the receive buffer (one copy, not two).
                        keep = keeps
                            && datao == 0
                            && !data.is_empty()
                            && data.len() == cmd.req.len as usize
                            && cmd.buf.is_heap();
                        if !keep {
                            let off = datao as usize;
                            if let Some(dst) = cmd.buf.as_mut_slice().get_mut(off..off + data.len())
                            {
                                dst.copy_from_slice(data);
                            }
                            bump(&core.counters().bytes_read, data.len() as u64);
                        }
                    }
                    if keep {
                        self.keep_data(core, cccid);
                    }
                    if last && success {
                        self.complete_by_data(core, cccid)?;
                    }
                }
                HostEvent::C2HDataDigestError {
                    cccid,
                    last,
                    success,
                } => {
                    if let Some(cmd) = core.cmd_mut(cccid) {
                        cmd.digest_error = true;
                    }
                    if last && success {
                        self.complete_by_data(core, cccid)?;
                    }
                }
                HostEvent::R2T {
                    cccid,
                    ttag,
                    r2to,
                    r2tl,
                } => {
                    let Some(cmd) = core.sent_cmd(cccid) else {
                        return Err(Error::lost(&self.addr, "R2T for an unknown command"));
                    };
                    let (start, end) = (r2to as usize, r2to as usize + r2tl as usize);
                    let Some(data) = cmd.buf.as_slice().get(start..end) else {
                        return Err(Error::lost(&self.addr, "R2T outside the command data"));
                    };
                    self.engine
                        .send_h2c_data(cccid, ttag, r2to, data, true)
                        .map_err(|e| Error::lost(&self.addr, format!("cannot answer R2T: {e}")))?;
                    let c = core.counters();
                    bump(&c.r2ts, 1);
                    bump(&c.bytes_written, u64::from(r2tl));
                }
                HostEvent::TermReq { fes, fei, .. } => {
                    return Err(Error::TermReq {
                        addr: self.addr.clone(),
                        fes,
                        fei,
                    });
                }
                HostEvent::Connected(_) => {}
            }
        }
    }

    /// Writes everything queued in the engine.
    pub async fn flush(
        &mut self,
        deadline: Instant,
        what: &'static str,
        t: Duration,
    ) -> Result<(), Error> {
        while !self.engine.pending_send().is_empty() {
            let pending = self.engine.pending_send();
            let n = match timeout_at(deadline, self.stream.write(pending)).await {
                Err(_) => return Err(Error::timeout(what, t)),
                Ok(Err(e)) => return Err(Error::lost(&self.addr, format!("send failed: {e}"))),
                Ok(Ok(0)) => return Err(Error::lost(&self.addr, "send returned 0")),
                Ok(Ok(n)) => n,
            };
            self.engine.consume_sent(n);
        }
        Ok(())
    }

    /// Sends a queued TermReq if the socket takes it at once.
    pub async fn flush_best_effort(&mut self) {
        let deadline = Instant::now() + Duration::from_millis(100);
        let _ = self.flush(deadline, "a TermReq", Duration::ZERO).await;
    }

    /// Reads what the socket has into the engine's buffer (waiting until `deadline`).
    pub async fn read_more(
        &mut self,
        deadline: Instant,
        what: &'static str,
        t: Duration,
    ) -> Result<(), Error> {
        let buf = self.engine.recv_buf(64 * 1024);
        match timeout_at(deadline, self.stream.read(buf)).await {
            Err(_) => Err(Error::timeout(what, t)),
            Ok(Err(e)) => Err(Error::lost(&self.addr, format!("receive failed: {e}"))),
            Ok(Ok(0)) => Err(Error::lost(&self.addr, "the target closed the connection")),
            Ok(Ok(n)) => {
                self.engine.commit_recv(n);
                Ok(())
            }
        }
    }
}

/// NVMe/TCP capsules: write data up to the in-capsule limit travels in the capsule, the rest
/// is sent when the controller asks for it (R2T); read data arrives in C2HData PDUs.
impl Wire for TcpConn {
    fn send(
        &mut self,
        tag: u16,
        cmd: &mut Cmd,
        c: &QueueCounters,
    ) -> Result<Result<(), Error>, Error> {
        if cmd.direct.is_some() {
            return Ok(Err(Error::InvalidArgument(
                "internal: registered memory on an NVMe/TCP queue".into(),
            )));
        }
        let mut sqe = cmd.req.sqe;
        sqe.cid.set(tag);
        sqe.set_sgl();
        let len = cmd.req.len as usize;
        let in_capsule = cmd.req.dir == DataDir::FromHost && len > 0 && len <= self.icd_limit;
        let data: &[u8] = if in_capsule {
            sqe.dptr = SglDescriptor::in_capsule(cmd.req.len);
            bump(&c.in_capsule_writes, 1);
            bump(&c.bytes_written, len as u64);
            &cmd.buf.as_slice()[..len]
        } else {
            let l = if cmd.req.dir == DataDir::None {
                0
            } else {
                cmd.req.len
            };
            sqe.dptr = SglDescriptor::tcp_transport(l);
            if cmd.req.dir == DataDir::FromHost && len > 0 {
                bump(&c.r2t_writes, 1);
            }
            &[]
        };
        self.engine
            .send_capsule_cmd(&sqe.to_array(), data)
            .map(Ok)
            .map_err(|e| Error::lost(&self.addr, format!("cannot queue a command: {e}")))
    }

    fn forget(&mut self, tag: u16) {
        self.engine.forget_command(tag);
    }
}

/// Where the pending C2HData of a command goes in its buffer, if the command is known and the
/// range fits.
fn data_buf<C: Completions>(core: &mut Core<C>, p: PendingData) -> Option<&mut [u8]> {
    let cmd = core.cmd_mut(p.cccid)?;
    let start = p.datao as usize;
    cmd.buf
        .as_mut_slice()
        .get_mut(start..start.checked_add(p.len)?)
}

/// The TLS context of a controller's NVMe/TCP connections, when `opts` asks for TLS: the TLS
/// PSK and identity derived from the configured PSK for the host and subsystem NQNs.
pub(crate) fn tls_context(opts: &ConnectOptions) -> Result<Option<ClientContext>, Error> {
    let Some(t) = &opts.tls else {
        return Ok(None);
    };
    if opts.addr.transport != Transport::Tcp {
        return Err(Error::InvalidArgument(
            "TLS is available over NVMe/TCP only".into(),
        ));
    }
    let psk = t
        .psk
        .tls_psk(t.identity_version, &opts.host.hostnqn, &opts.subnqn)
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "TLS PSK identity version {}: expected 0 or 1",
                t.identity_version
            ))
        })?;
    ClientContext::new(psk).map(Some).map_err(|e| Error::Tls {
        addr: opts.addr.to_string(),
        reason: e.to_string(),
    })
}
