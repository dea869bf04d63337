//! Host side of an NVMe/TCP connection, as used by an initiator.

use core::ops::Range;

use nvme_spec::queue::{Cqe, Sqe};
use nvme_spec::tcp::{
    C2hDataHeader, CH_LEN, CQE_LEN, CapsuleRespHeader, CommonHeader, DIGEST_LEN, IC_PDU_LEN,
    IcResp, MAX_PDA, MIN_MAXH2CDATA, PFV_1_0, PduType, R2tHeader, SQE_LEN, flags,
};
use zerocopy::FromBytes;

use crate::digest::{DataDigest, read_digest};
use crate::encode::{Digests, PduHeader, pda_alignment};
use crate::error::{ProtocolError, SendError, Violation};
use crate::rx::{
    FirstPdu, Frame, RecvBuffer, RxBytes, Side, check_common_header, check_first_pdu,
    check_header_digest, offending_header_len, parse_term_req,
};
use crate::tagmap::{TagMap, tag_map};

/// Opcode of fabrics commands, whose data direction is in the fabrics command type.
const FABRICS_OPCODE: u8 = 0x7F;

/// Settings of the host side of a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostConfig {
    /// Ask for header digests.
    pub hdgst: bool,
    /// Ask for data digests.
    pub ddgst: bool,
    /// Initial size of the receive buffer in bytes. C2HData is delivered in pieces as it
    /// arrives, so the buffer does not have to hold a whole data PDU.
    pub recv_buffer_size: usize,
    /// Number of outstanding commands to reserve room for (the queue depth is a good value).
    pub max_outstanding_commands: usize,
}

impl Default for HostConfig {
    fn default() -> Self {
        Self {
            hdgst: false,
            ddgst: false,
            recv_buffer_size: 64 * 1024,
            max_outstanding_commands: 128,
        }
    }
}

/// Connection parameters from a valid ICResp.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostParams {
    /// Digests in use (always what the host asked for: anything else is refused).
    pub digests: Digests,
    /// MAXH2CDATA: [`HostConn::send_h2c_data`] splits data into PDUs of at most this size.
    pub maxh2cdata: u32,
    /// CPDA (always 0: other values are refused, as the Linux host does).
    pub cpda: u8,
}

/// Something the controller sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostEvent<'a> {
    /// A valid ICResp arrived: commands may be sent.
    Connected(HostParams),
    /// A response capsule; the command it completes is no longer outstanding.
    CapsuleResp {
        /// The completion queue entry.
        cqe: [u8; CQE_LEN],
    },
    /// A piece of read data, delivered as it arrives: one C2HData PDU may yield several
    /// events with increasing `datao`. `last` and `success` are set only on the piece that
    /// ends the PDU, and only after its data digest (if any) checked out.
    C2HData {
        /// Command identifier.
        cccid: u16,
        /// Offset of `data` in the command's data buffer.
        datao: u32,
        /// The data.
        data: &'a [u8],
        /// This piece ends the command's data transfer (LAST_PDU).
        last: bool,
        /// The command completed successfully and no CapsuleResp follows (SUCCESS).
        success: bool,
    },
    /// A C2HData PDU failed its data digest; the pieces of it already delivered are
    /// corrupt. The command must be failed with a transient transport error (section 3.5);
    /// if `success` is set no CapsuleResp will come for it. The connection goes on.
    C2HDataDigestError {
        /// Command identifier.
        cccid: u16,
        /// The PDU had LAST_PDU set.
        last: bool,
        /// The PDU had SUCCESS set.
        success: bool,
    },
    /// The controller asks for data of a command; answer with
    /// [`HostConn::send_h2c_data`].
    R2T {
        /// Command identifier.
        cccid: u16,
        /// Transfer tag to echo.
        ttag: u16,
        /// Offset of the requested data.
        r2to: u32,
        /// Length of the requested data.
        r2tl: u32,
    },
    /// The controller terminated the connection (C2HTermReq). Nothing more will be
    /// received; the caller closes the connection.
    TermReq {
        /// Fatal error status as received (may be a reserved value).
        fes: u16,
        /// Fatal error information.
        fei: u32,
        /// The header the controller was processing when it failed.
        data: &'a [u8],
    },
}

/// Read data of the C2HData PDU being received that is not in the receive buffer yet: the
/// caller may read it from the socket straight into the command's buffer (see
/// [`HostConn::pending_data`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PendingData {
    /// Command identifier.
    pub cccid: u16,
    /// Offset in the command's data buffer of the next byte.
    pub datao: u32,
    /// Bytes of the PDU's data still to come.
    pub len: usize,
}

/// What [`HostConn::commit_data`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataCommit {
    /// More of the PDU is to come: data, or its data digest (whose verdict then arrives from
    /// [`HostConn::next_event`] as a C2HData piece with no data, or as a digest error).
    More,
    /// The bytes ended the PDU (no data digest); `last` and `success` as in
    /// [`HostEvent::C2HData`].
    End {
        /// The PDU had LAST_PDU set.
        last: bool,
        /// The PDU had SUCCESS set: no CapsuleResp follows.
        success: bool,
    },
}

/// Connection state: one enum, advanced only by [`HostConn::step`].
#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    /// The ICReq is queued; nothing but an ICResp (or a C2HTermReq) is acceptable.
    AwaitIcResp,
    /// ICReq/ICResp exchanged.
    Established { params: HostParams, rx: RxStage },
    /// A fatal error was found; an H2CTermReq may be queued.
    Failed(ProtocolError),
    /// The controller sent a C2HTermReq.
    Closed,
}

/// Where the receiver is inside the PDU stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RxStage {
    /// At a PDU boundary.
    Header,
    /// Inside the data of a C2HData PDU whose header was validated and consumed.
    C2hBody(C2hBody),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct C2hBody {
    cccid: u16,
    /// Offset in the command buffer of the next data byte.
    datao: u32,
    /// Padding bytes still to skip before the data.
    skip: usize,
    /// Data bytes not yet delivered.
    remaining: usize,
    last: bool,
    success: bool,
    /// Running data digest when data digests are on.
    digest: Option<DataDigest>,
}

/// An outstanding command, as the host side tracks it to check what the controller sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct HostCmd {
    /// Length of the command data buffer (SGL1 length).
    len: u32,
    /// The command may transfer data controller to host.
    c2h: bool,
    /// The command may transfer data host to controller.
    h2c: bool,
    /// Next expected C2HData offset.
    c2h_next: u32,
    /// A C2HData with LAST_PDU arrived.
    c2h_done: bool,
    /// Next expected R2T offset (in-capsule data counts as already transferred).
    r2t_next: u32,
    /// The outstanding R2T (MAXR2T is 0: at most one per command).
    active: Option<ActiveR2t>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ActiveR2t {
    ttag: u16,
    next: u32,
    end: u32,
}

/// An event as positions in the receive buffer, turned into a [`HostEvent`] afterwards.
enum Ev {
    Connected(HostParams),
    CapsuleResp {
        cqe: [u8; CQE_LEN],
    },
    C2h {
        cccid: u16,
        datao: u32,
        data: Range<usize>,
        last: bool,
        success: bool,
    },
    C2hDigest {
        cccid: u16,
        last: bool,
        success: bool,
    },
    R2t {
        cccid: u16,
        ttag: u16,
        r2to: u32,
        r2tl: u32,
    },
    TermReq {
        fes: u16,
        fei: u32,
        data: Range<usize>,
    },
}

/// The host side of one NVMe/TCP connection: bytes in, [`HostEvent`]s out, PDUs to send
/// accumulated in a send buffer.
#[derive(Debug)]
pub struct HostConn {
    config: HostConfig,
    state: State,
    rx: RecvBuffer,
    need: usize,
    tx: Vec<u8>,
    tx_pos: usize,
    cmds: TagMap<HostCmd>,
    /// DATAL of the last C2HData header accepted.
    last_datal: u32,
    /// Where in the receive buffer the data of the last C2HData piece returned is, until
    /// more is received.
    last_data: Range<usize>,
}

impl HostConn {
    /// A connection with its ICReq queued (PFV 0, HPDA 0, MAXR2T 0, the configured digests).
    pub fn new(config: HostConfig) -> Self {
        let mut tx = Vec::with_capacity(4096);
        let asked = Digests {
            header: config.hdgst,
            data: config.ddgst,
        };
        PduHeader::ic_req(0, asked, 0).append_to(&mut tx, &[]);
        let rx = RecvBuffer::with_capacity(config.recv_buffer_size.max(IC_PDU_LEN * 2));
        let cmds = tag_map(config.max_outstanding_commands);
        Self {
            config,
            state: State::AwaitIcResp,
            rx,
            need: 0,
            tx,
            tx_pos: 0,
            cmds,
            last_datal: 0,
            last_data: 0..0,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &HostConfig {
        &self.config
    }

    /// The negotiated parameters once the connection is established.
    pub fn params(&self) -> Option<HostParams> {
        match &self.state {
            State::Established { params, .. } => Some(*params),
            _ => None,
        }
    }

    /// True after a fatal error or the controller's TermReq.
    pub fn is_closed(&self) -> bool {
        matches!(self.state, State::Failed(_) | State::Closed)
    }

    /// Number of commands sent and not yet completed.
    pub fn outstanding_commands(&self) -> usize {
        self.cmds.len()
    }

    /// Free space to read socket bytes into, at least `min` bytes. Pass the number of bytes
    /// written to [`commit_recv`](Self::commit_recv).
    pub fn recv_buf(&mut self, min: usize) -> &mut [u8] {
        self.last_data = 0..0;
        self.rx.spare(min, self.need)
    }

    /// Marks `n` bytes written into [`recv_buf`](Self::recv_buf) as received (clamped to its
    /// length).
    pub fn commit_recv(&mut self, n: usize) {
        self.rx.commit(n);
    }

    /// The rest of the C2HData PDU being received, when none of it is buffered. A caller
    /// that owns the command's data buffer can then read up to `len` bytes from the socket
    /// straight into it at `datao` and report them with [`commit_data`](Self::commit_data),
    /// saving the copy out of the receive buffer.
    pub fn pending_data(&self) -> Option<PendingData> {
        match &self.state {
            State::Established {
                rx: RxStage::C2hBody(b),
                ..
            } if b.skip == 0 && b.remaining > 0 && self.rx.len() == 0 => Some(PendingData {
                cccid: b.cccid,
                datao: b.datao,
                len: b.remaining,
            }),
            _ => None,
        }
    }

    /// Data length of the last C2HData PDU whose header was accepted (0 before the first): a
    /// hint for how much to read from the socket at a time.
    pub fn last_data_pdu_len(&self) -> u32 {
        self.last_datal
    }

    /// Accounts for `data`, the next bytes of the [`pending_data`](Self::pending_data), which
    /// the caller received in place (they are checked against the data digest, not copied).
    /// Bytes beyond the pending length are ignored; without pending data nothing happens.
    pub fn commit_data(&mut self, data: &[u8]) -> DataCommit {
        let Some(p) = self.pending_data() else {
            return DataCommit::More;
        };
        let State::Established {
            rx: RxStage::C2hBody(mut body),
            ..
        } = self.state
        else {
            return DataCommit::More;
        };
        let n = data.len().min(p.len);
        if let Some(d) = &mut body.digest {
            d.update(&data[..n]);
        }
        body.datao += n as u32;
        body.remaining -= n;
        self.need = 0;
        if body.remaining > 0 || body.digest.is_some() {
            self.set_rx(RxStage::C2hBody(body));
            return DataCommit::More;
        }
        self.set_rx(RxStage::Header);
        DataCommit::End {
            last: body.last,
            success: body.success,
        }
    }

    /// Copies received bytes in (convenient for tests and simple callers).
    pub fn feed(&mut self, bytes: &[u8]) {
        self.last_data = 0..0;
        self.rx.extend(bytes);
    }

    /// Parses the next event from the receive buffer. `Ok(None)` means more bytes are
    /// needed (or the connection is closed). On a fatal error an H2CTermReq is queued and the
    /// same error is returned on every later call.
    pub fn next_event(&mut self) -> Result<Option<HostEvent<'_>>, ProtocolError> {
        if let State::Failed(e) = &self.state {
            return Err(e.clone());
        }
        match self.step() {
            Ok(None) => Ok(None),
            Ok(Some(ev)) => {
                self.last_data = match &ev {
                    Ev::C2h { data, .. } => data.clone(),
                    _ => 0..0,
                };
                Ok(Some(self.materialize(ev)))
            }
            Err(v) => Err(self.fail(v)),
        }
    }

    /// Keeps the data of the [`HostEvent::C2HData`] that [`next_event`](Self::next_event)
    /// returned last where it was received, so that its command's reader copies it out
    /// later instead of the caller copying it into the command's buffer now. `None` when the
    /// last event was not C2HData with data, bytes were received since, or the connection
    /// already keeps as much as it may (then copy the data).
    pub fn keep_last_data(&self) -> Option<RxBytes> {
        if self.last_data.is_empty() {
            return None;
        }
        self.rx.keep(self.last_data.clone())
    }

    /// The data of the [`HostEvent::C2HData`] that [`next_event`](Self::next_event) returned
    /// last (empty once more bytes were received): for a caller that could not
    /// [keep](Self::keep_last_data) it.
    pub fn last_data(&self) -> &[u8] {
        self.rx.raw().get(self.last_data.clone()).unwrap_or(&[])
    }

    fn materialize(&self, ev: Ev) -> HostEvent<'_> {
        let raw = self.rx.raw();
        let slice = |r: Range<usize>| raw.get(r).unwrap_or(&[]);
        match ev {
            Ev::Connected(p) => HostEvent::Connected(p),
            Ev::CapsuleResp { cqe } => HostEvent::CapsuleResp { cqe },
            Ev::C2h {
                cccid,
                datao,
                data,
                last,
                success,
            } => HostEvent::C2HData {
                cccid,
                datao,
                data: slice(data),
                last,
                success,
            },
            Ev::C2hDigest {
                cccid,
                last,
                success,
            } => HostEvent::C2HDataDigestError {
                cccid,
                last,
                success,
            },
            Ev::R2t {
                cccid,
                ttag,
                r2to,
                r2tl,
            } => HostEvent::R2T {
                cccid,
                ttag,
                r2to,
                r2tl,
            },
            Ev::TermReq { fes, fei, data } => HostEvent::TermReq {
                fes,
                fei,
                data: slice(data),
            },
        }
    }

    fn fail(&mut self, v: Violation) -> ProtocolError {
        if v.reply {
            let data = self.rx.data();
            let n = offending_header_len(data);
            let hdr = PduHeader::term_req(PduType::H2cTermReq, v.fes, v.fei, n);
            self.tx.extend_from_slice(hdr.as_bytes());
            self.tx.extend_from_slice(&data[..n]);
        }
        let err = v.into_error(v.reply);
        self.rx.clear();
        self.need = 0;
        self.cmds.clear();
        self.state = State::Failed(err.clone());
        err
    }

    /// The transition function: consumes at most one PDU, or one piece of C2HData.
    fn step(&mut self) -> Result<Option<Ev>, Violation> {
        match self.state {
            State::Failed(_) | State::Closed => Ok(None),
            State::AwaitIcResp => self.step_ic_resp(),
            State::Established {
                params,
                rx: RxStage::Header,
            } => self.step_header(params),
            State::Established {
                rx: RxStage::C2hBody(body),
                ..
            } => Ok(self.step_body(body)),
        }
    }

    fn set_rx(&mut self, stage: RxStage) {
        if let State::Established { rx, .. } = &mut self.state {
            *rx = stage;
        }
    }

    fn step_ic_resp(&mut self) -> Result<Option<Ev>, Violation> {
        let Some(ch) = CommonHeader::from_prefix(self.rx.data()) else {
            self.need = CH_LEN;
            return Ok(None);
        };
        if let FirstPdu::TermReq(frame) = check_first_pdu(ch, Side::Host)? {
            return Ok(self.complete_term_req(&frame));
        }
        let Some(resp) = IcResp::from_prefix(self.rx.data()) else {
            self.need = IC_PDU_LEN;
            return Ok(None);
        };
        // The checks of the Linux host, in field order.
        if resp.pfv() != PFV_1_0 {
            return Err(Violation::unsupported(
                IcResp::OFFSET_PFV,
                "unsupported PDU format version",
            ));
        }
        if resp.cpda() > MAX_PDA {
            return Err(Violation::field(IcResp::OFFSET_CPDA, "CPDA out of range"));
        }
        if resp.cpda() != 0 {
            return Err(Violation::unsupported(
                IcResp::OFFSET_CPDA,
                "CPDA other than 0",
            ));
        }
        let digests = Digests {
            header: resp.hdgst_enable(),
            data: resp.ddgst_enable(),
        };
        if digests
            != (Digests {
                header: self.config.hdgst,
                data: self.config.ddgst,
            })
        {
            return Err(Violation::field(
                IcResp::OFFSET_DGST,
                "digests differ from the ones requested",
            ));
        }
        let maxh2cdata = resp.maxh2cdata();
        if maxh2cdata < MIN_MAXH2CDATA || maxh2cdata % 4 != 0 {
            return Err(Violation::field(
                IcResp::OFFSET_MAXH2CDATA,
                "invalid MAXH2CDATA",
            ));
        }
        let params = HostParams {
            digests,
            maxh2cdata,
            cpda: resp.cpda(),
        };
        self.rx.consume(IC_PDU_LEN);
        self.need = 0;
        self.state = State::Established {
            params,
            rx: RxStage::Header,
        };
        Ok(Some(Ev::Connected(params)))
    }

    fn step_header(&mut self, params: HostParams) -> Result<Option<Ev>, Violation> {
        let data = self.rx.data();
        let Some(ch) = CommonHeader::from_prefix(data) else {
            self.need = CH_LEN;
            return Ok(None);
        };
        let d = params.digests;
        let frame = check_common_header(ch, Side::Host, d.header, d.data, pda_alignment(0))?;
        if frame.ty == PduType::C2hTermReq {
            return Ok(self.complete_term_req(&frame));
        }
        if data.len() < frame.hdr_total {
            self.need = frame.hdr_total;
            return Ok(None);
        }
        check_header_digest(data, &frame)?;
        self.need = 0;
        match frame.ty {
            PduType::CapsuleResp => {
                let hdr = CapsuleRespHeader::from_prefix(data).ok_or(Violation::field(
                    CommonHeader::OFFSET_HLEN,
                    "short CapsuleResp",
                ))?;
                let cqe = *hdr.cqe();
                let cid = Cqe::from_array(&cqe).cid();
                if self.cmds.remove(&cid).is_none() {
                    return Err(Violation::field(
                        CapsuleRespHeader::OFFSET_CQE + 12,
                        "CapsuleResp for a command that is not outstanding",
                    ));
                }
                self.rx.consume(frame.plen);
                Ok(Some(Ev::CapsuleResp { cqe }))
            }
            PduType::R2t => {
                let hdr = R2tHeader::read_from_prefix(data)
                    .ok_or(Violation::field(CommonHeader::OFFSET_HLEN, "short R2T"))?;
                let ev = self.check_r2t(&hdr)?;
                self.rx.consume(frame.plen);
                Ok(Some(ev))
            }
            PduType::C2hData => {
                let hdr = C2hDataHeader::read_from_prefix(data).ok_or(Violation::field(
                    CommonHeader::OFFSET_HLEN,
                    "short C2HData header",
                ))?;
                let body = self.check_c2h(&hdr, &frame)?;
                self.rx.consume(frame.hdr_total);
                Ok(self.step_body(body))
            }
            _ => Err(Violation::field(
                CommonHeader::OFFSET_PDU_TYPE,
                "unexpected PDU type",
            )),
        }
    }

    /// Checks an R2T against its command (section 3.3.2.2) and records it.
    fn check_r2t(&mut self, hdr: &R2tHeader) -> Result<Ev, Violation> {
        let (cccid, ttag, r2to, r2tl) = (hdr.cccid(), hdr.ttag(), hdr.r2to(), hdr.r2tl());
        let Some(cmd) = self.cmds.get_mut(&cccid) else {
            return Err(Violation::field(
                R2tHeader::OFFSET_CCCID,
                "R2T for a command that is not outstanding",
            ));
        };
        if r2tl == 0 {
            return Err(Violation::field(
                R2tHeader::OFFSET_R2TL,
                "R2T asks for no data",
            ));
        }
        if !cmd.h2c {
            return Err(Violation::sequence(
                "R2T for a command without host-to-controller data",
            ));
        }
        let end = r2to.checked_add(r2tl);
        let Some(end) = end.filter(|&e| e <= cmd.len) else {
            return Err(Violation::out_of_range(
                "R2T outside the command data buffer",
            ));
        };
        if r2to != cmd.r2t_next {
            return Err(Violation::sequence(
                "R2T is not contiguous with the previous one",
            ));
        }
        if cmd.active.is_some() {
            return Err(Violation::limit("R2T beyond MAXR2T"));
        }
        cmd.active = Some(ActiveR2t {
            ttag,
            next: r2to,
            end,
        });
        cmd.r2t_next = end;
        Ok(Ev::R2t {
            cccid,
            ttag,
            r2to,
            r2tl,
        })
    }

    /// Checks a C2HData header against its command (section 3.3.2.1) and records it.
    fn check_c2h(&mut self, hdr: &C2hDataHeader, frame: &Frame) -> Result<C2hBody, Violation> {
        let (cccid, datao, datal) = (hdr.cccid(), hdr.datao(), hdr.datal());
        let Some(cmd) = self.cmds.get_mut(&cccid) else {
            return Err(Violation::field(
                C2hDataHeader::OFFSET_CCCID,
                "C2HData for a command that is not outstanding",
            ));
        };
        if datal as usize != frame.data_len || datal == 0 {
            return Err(Violation::field(
                C2hDataHeader::OFFSET_DATAL,
                "DATAL does not match PLEN",
            ));
        }
        if !cmd.c2h || cmd.c2h_done {
            return Err(Violation::sequence("unexpected C2HData"));
        }
        let end = datao.checked_add(datal);
        let Some(end) = end.filter(|&e| e <= cmd.len) else {
            return Err(Violation::out_of_range(
                "C2HData outside the command data buffer",
            ));
        };
        if datao != cmd.c2h_next {
            return Err(Violation::sequence(
                "C2HData is not contiguous with the previous one",
            ));
        }
        let last = frame.flags & flags::LAST_PDU != 0;
        let success = frame.flags & flags::SUCCESS != 0;
        cmd.c2h_next = end;
        cmd.c2h_done = last;
        self.last_datal = datal;
        if success {
            self.cmds.remove(&cccid);
        }
        Ok(C2hBody {
            cccid,
            datao,
            skip: frame.data_off - frame.hdr_total,
            remaining: frame.data_len,
            last,
            success,
            digest: frame.ddgst.then(DataDigest::new),
        })
    }

    /// Delivers the next piece of C2HData that is in the buffer.
    fn step_body(&mut self, mut body: C2hBody) -> Option<Ev> {
        if body.skip > 0 {
            let n = body.skip.min(self.rx.len());
            self.rx.consume(n);
            body.skip -= n;
            if body.skip > 0 {
                self.need = body.skip;
                self.set_rx(RxStage::C2hBody(body));
                return None;
            }
        }
        let avail = self.rx.len();
        let n = avail.min(body.remaining);
        let base = self.rx.start();
        let finishing = n == body.remaining;
        if let Some(mut digest) = body.digest {
            if finishing {
                // The final piece is delivered together with the digest verdict.
                if avail < n + DIGEST_LEN {
                    self.need = n + DIGEST_LEN;
                    self.set_rx(RxStage::C2hBody(body));
                    return None;
                }
                let chunk = &self.rx.data()[..n];
                digest.update(chunk);
                let ok = digest.value() == read_digest(&self.rx.data()[n..n + DIGEST_LEN]);
                self.rx.consume(n + DIGEST_LEN);
                self.need = 0;
                self.set_rx(RxStage::Header);
                let (cccid, last, success) = (body.cccid, body.last, body.success);
                return Some(if ok {
                    Ev::C2h {
                        cccid,
                        datao: body.datao,
                        data: base..base + n,
                        last,
                        success,
                    }
                } else {
                    Ev::C2hDigest {
                        cccid,
                        last,
                        success,
                    }
                });
            }
            digest.update(&self.rx.data()[..n]);
            body.digest = Some(digest);
        }
        if n == 0 {
            self.need = 1;
            self.set_rx(RxStage::C2hBody(body));
            return None;
        }
        self.rx.consume(n);
        let datao = body.datao;
        body.datao += n as u32;
        body.remaining -= n;
        self.need = 0;
        let (last, success) = if finishing {
            (body.last, body.success)
        } else {
            (false, false)
        };
        self.set_rx(if finishing {
            RxStage::Header
        } else {
            RxStage::C2hBody(body)
        });
        Some(Ev::C2h {
            cccid: body.cccid,
            datao,
            data: base..base + n,
            last,
            success,
        })
    }

    fn complete_term_req(&mut self, frame: &Frame) -> Option<Ev> {
        if self.rx.len() < frame.plen {
            self.need = frame.plen;
            return None;
        }
        let (fes, fei) = parse_term_req(self.rx.data());
        let base = self.rx.start();
        let data = base + frame.data_off..base + frame.plen;
        self.rx.consume(frame.plen);
        self.need = 0;
        self.cmds.clear();
        self.state = State::Closed;
        Some(Ev::TermReq { fes, fei, data })
    }

    fn established(&self) -> Result<HostParams, SendError> {
        match &self.state {
            State::Established { params, .. } => Ok(*params),
            State::AwaitIcResp => Err(SendError::NotEstablished),
            State::Failed(_) | State::Closed => Err(SendError::Closed),
        }
    }

    /// Queues a CapsuleCmd with `sqe` and its in-capsule data, and starts tracking the
    /// command so the controller's C2HData, R2Ts and CapsuleResp for it can be checked.
    ///
    /// The command's data length is read from the length of SGL1 (SQE bytes 32..36), its
    /// direction from the opcode (or the fabrics command type) bits 1:0.
    pub fn send_capsule_cmd(
        &mut self,
        sqe: &[u8; SQE_LEN],
        in_capsule_data: &[u8],
    ) -> Result<(), SendError> {
        let p = self.established()?;
        let view = Sqe::ref_from_bytes(&sqe[..]).map_err(|_| SendError::TooLarge)?;
        let cid = view.cid();
        if self.cmds.contains_key(&cid) {
            return Err(SendError::CommandIdInUse(cid));
        }
        let icd = u32::try_from(in_capsule_data.len()).map_err(|_| SendError::TooLarge)?;
        let hdr = PduHeader::capsule_cmd(p.digests, p.cpda, sqe, in_capsule_data.len())?;
        let dir = if view.opcode == FABRICS_OPCODE {
            view.fctype()
        } else {
            view.opcode
        } & 0b11;
        self.cmds.insert(
            cid,
            HostCmd {
                len: view.dptr.length().max(icd),
                c2h: dir & 0b10 != 0,
                h2c: dir & 0b01 != 0,
                c2h_next: 0,
                c2h_done: false,
                r2t_next: icd,
                active: None,
            },
        );
        hdr.append_to(&mut self.tx, in_capsule_data);
        Ok(())
    }

    /// Queues `data` for the outstanding R2T `ttag` of command `cccid`, starting at `datao`,
    /// as H2CData PDUs of at most MAXH2CDATA bytes. `last` must be set exactly when the data
    /// ends the R2T's range; the final PDU then carries LAST_PDU.
    pub fn send_h2c_data(
        &mut self,
        cccid: u16,
        ttag: u16,
        datao: u32,
        data: &[u8],
        last: bool,
    ) -> Result<(), SendError> {
        let p = self.established()?;
        let no_match = SendError::NoMatchingR2t { cccid, ttag };
        let cmd = self.cmds.get_mut(&cccid).ok_or(no_match)?;
        let r2t = cmd
            .active
            .as_mut()
            .filter(|a| a.ttag == ttag)
            .ok_or(no_match)?;
        if data.is_empty() {
            return Err(SendError::EmptyData);
        }
        if datao != r2t.next {
            return Err(SendError::OutOfOrder {
                datao,
                expected: r2t.next,
            });
        }
        let len = u32::try_from(data.len()).map_err(|_| SendError::OutOfRange)?;
        let end = datao
            .checked_add(len)
            .filter(|&e| e <= r2t.end)
            .ok_or(SendError::OutOfRange)?;
        if last != (end == r2t.end) {
            return Err(SendError::LastMismatch);
        }
        let max = p.maxh2cdata as usize;
        let count = data.len().div_ceil(max);
        for (i, chunk) in data.chunks(max).enumerate() {
            let fin = i + 1 == count;
            let off = datao + (i * max) as u32;
            let hdr = PduHeader::h2c_data(
                p.digests,
                p.cpda,
                cccid,
                ttag,
                off,
                chunk.len() as u32,
                fin && last,
            )?;
            hdr.append_to(&mut self.tx, chunk);
        }
        if last {
            cmd.active = None;
        } else {
            r2t.next = end;
        }
        Ok(())
    }

    /// Stops tracking command `cid` (for a command the caller abandons, for example after a
    /// timeout). Returns whether it was outstanding.
    pub fn forget_command(&mut self, cid: u16) -> bool {
        self.cmds.remove(&cid).is_some()
    }

    /// Bytes queued for sending (ICReq, commands, data, a TermReq).
    pub fn pending_send(&self) -> &[u8] {
        &self.tx[self.tx_pos..]
    }

    /// Marks `n` bytes of [`pending_send`](Self::pending_send) as written to the socket.
    pub fn consume_sent(&mut self, n: usize) {
        self.tx_pos += n.min(self.tx.len() - self.tx_pos);
        if self.tx_pos == self.tx.len() {
            self.tx.clear();
            self.tx_pos = 0;
        }
    }
}
