//! Controller side of an NVMe/TCP connection, as used by a target.

use core::ops::Range;
use std::collections::VecDeque;
use std::sync::Arc;

use nvme_spec::tcp::{
    CH_LEN, CapsuleCmdHeader, CommonHeader, DATA_PDU_HLEN, DIGEST_LEN, H2cDataHeader, IC_PDU_LEN,
    IcReq, MAX_PDA, MIN_MAXH2CDATA, PFV_1_0, PduType, SQE_LEN, flags,
};

use crate::digest::{DataDigest, crc32c, read_digest};
use crate::encode::{Digests, PduHeader, pda_alignment};
use crate::error::{ConfigError, ProtocolError, SendError, Violation};
use crate::rx::{
    FirstPdu, Frame, RecvBuffer, Side, check_common_header, check_first_pdu, check_header_digest,
    offending_header_len, parse_term_req,
};
use crate::sendq::SendQueue;
use crate::tagmap::{TagMap, tag_map};

/// Bytes asked of the socket per read right after the ICReq; doubled while reads fill it.
const FIRST_READ: usize = 1024;
/// Why a command beyond the queue size ends the connection.
const QUEUE_OVERRUN: &str = "command beyond the queue size: the host already has as many commands outstanding as the queue holds";

/// Settings of the controller side of a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetConfig {
    /// MAXH2CDATA advertised in the ICResp: the most data one H2CData PDU may carry.
    /// At least 4096 and a multiple of 4.
    pub maxh2cdata: u32,
    /// Most in-capsule data accepted in one CapsuleCmd (8192 for admin queues; IOCCSZ*16-64
    /// for I/O queues).
    pub max_in_capsule_data: u32,
    /// Whether header and data digests may be enabled. When false, an ICReq asking for
    /// either is refused with a C2HTermReq (Unsupported Parameter).
    pub allow_digests: bool,
    /// [`TargetConn::send_c2h_data`] splits data into C2HData PDUs of at most this many bytes.
    pub max_c2h_data: u32,
    /// Most bytes [`TargetConn::recv_hint`] asks one socket read for. The receive buffer
    /// starts with room for the ICReq only and grows as the host sends: by the PDU that does
    /// not fit, and by doubling the bytes asked per read while reads fill what was asked, up to
    /// this size. So a connection that never finishes the handshake, or stays idle after it,
    /// costs little memory.
    pub recv_buffer_size: usize,
    /// Commands the host may have outstanding (the queue size) until
    /// [`TargetConn::set_queue_size`] sets it, normally to the SQSIZE of the Connect. A command
    /// counts from its CapsuleCmd until its completion (CapsuleResp, or the C2HData that
    /// carries SUCCESS) has left through [`TargetConn::consume_sent`]; a CapsuleCmd beyond the
    /// queue size is a fatal error (C2HTermReq, PDU Sequence Error).
    pub queue_size: usize,
}

impl Default for TargetConfig {
    fn default() -> Self {
        Self {
            maxh2cdata: 128 * 1024,
            max_in_capsule_data: 8192,
            allow_digests: true,
            max_c2h_data: 128 * 1024,
            recv_buffer_size: 256 * 1024,
            queue_size: 32,
        }
    }
}

/// Connection parameters the host asked for in its ICReq and the controller accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TargetParams {
    /// Digests in use.
    pub digests: Digests,
    /// HPDA: the host's data alignment for C2HData (0's based dwords).
    pub hpda: u8,
    /// MAXR2T: outstanding R2Ts per command the host supports, 0's based.
    pub maxr2t: u32,
}

/// Something the host sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TargetEvent<'a> {
    /// A valid ICReq arrived and the ICResp is queued: the connection is established.
    Connected(TargetParams),
    /// A command capsule, with its in-capsule data (empty if none).
    Command {
        /// The submission queue entry.
        sqe: [u8; SQE_LEN],
        /// In-capsule data, verified against its digest when data digests are on.
        data: &'a [u8],
    },
    /// A command capsule whose in-capsule data failed its data digest. The command must be
    /// completed with a Transient Transport Error status (section 3.5); the connection goes on.
    CommandDataDigestError {
        /// The submission queue entry.
        sqe: [u8; SQE_LEN],
    },
    /// Data answering an R2T, checked against it (tag, command, offset, range, LAST_PDU).
    H2CData {
        /// Command identifier.
        cccid: u16,
        /// Transfer tag of the R2T.
        ttag: u16,
        /// Offset of `data` in the command's data buffer.
        datao: u32,
        /// The data, verified against its digest when data digests are on.
        data: &'a [u8],
        /// This PDU completes the R2T.
        last: bool,
    },
    /// H2CData whose data failed its data digest. The transfer bookkeeping moved on as if
    /// the data had arrived; the command must be failed with a Transient Transport Error
    /// status once its transfer ends (section 3.5).
    H2CDataDigestError {
        /// Command identifier.
        cccid: u16,
        /// Transfer tag of the R2T.
        ttag: u16,
        /// Offset of the lost data in the command's data buffer.
        datao: u32,
        /// Length of the lost data.
        datal: u32,
        /// This PDU completed the R2T.
        last: bool,
    },
    /// The host terminated the connection (H2CTermReq). Nothing more will be received;
    /// the caller closes the connection.
    TermReq {
        /// Fatal error status as received (may be a reserved value).
        fes: u16,
        /// Fatal error information.
        fei: u32,
        /// The header the host was processing when it failed.
        data: &'a [u8],
    },
}

/// Connection state: one enum, advanced only by [`TargetConn::step`].
#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    /// Nothing but an ICReq (or an H2CTermReq) is acceptable.
    AwaitIcReq,
    /// ICReq/ICResp exchanged; `pending` holds a validated header whose data is still
    /// arriving.
    Established {
        params: TargetParams,
        pending: Option<Pending>,
    },
    /// A fatal error was found; a C2HTermReq may be queued.
    Failed(ProtocolError),
    /// The host sent an H2CTermReq.
    Closed,
}

/// A validated PDU header waiting for the rest of its PDU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Pending {
    frame: Frame,
    kind: PendingKind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PendingKind {
    Command {
        sqe: [u8; SQE_LEN],
    },
    H2c {
        cccid: u16,
        ttag: u16,
        datao: u32,
        datal: u32,
        last: bool,
    },
}

/// An outstanding R2T.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct R2tSlot {
    cccid: u16,
    start: u32,
    next: u32,
    end: u32,
}

/// An event as positions in the receive buffer, turned into a [`TargetEvent`] afterwards.
enum Ev {
    Connected(TargetParams),
    Command {
        sqe: [u8; SQE_LEN],
        data: Range<usize>,
    },
    CommandDigest {
        sqe: [u8; SQE_LEN],
    },
    H2c {
        cccid: u16,
        ttag: u16,
        datao: u32,
        data: Range<usize>,
        last: bool,
    },
    H2cDigest {
        cccid: u16,
        ttag: u16,
        datao: u32,
        datal: u32,
        last: bool,
    },
    TermReq {
        fes: u16,
        fei: u32,
        data: Range<usize>,
    },
}

/// The controller side of one NVMe/TCP connection: bytes in, [`TargetEvent`]s out, PDUs to
/// send accumulated in a send buffer.
#[derive(Debug)]
pub struct TargetConn {
    config: TargetConfig,
    state: State,
    rx: RecvBuffer,
    /// Bytes the PDU at the front of the receive buffer needs in total (0 when unknown).
    need: usize,
    tx: SendQueue,
    r2ts: TagMap<R2tSlot>,
    /// Bytes [`recv_hint`](Self::recv_hint) asks for once established.
    read_size: usize,
    /// Commands received whose completion has not left yet.
    outstanding: usize,
    /// Positions in the outgoing stream of the ends of the completions queued and not yet
    /// sent, in order.
    completions: VecDeque<u64>,
}

impl TargetConn {
    /// A connection waiting for the host's ICReq.
    pub fn new(config: TargetConfig) -> Result<Self, ConfigError> {
        if config.maxh2cdata < MIN_MAXH2CDATA || config.maxh2cdata % 4 != 0 {
            return Err(ConfigError::MaxH2cData(config.maxh2cdata));
        }
        if config.max_c2h_data == 0 {
            return Err(ConfigError::MaxC2hData);
        }
        // Nothing but the ICReq may arrive before the ICResp: the full-size buffers wait
        // until it is accepted.
        Ok(Self {
            config,
            state: State::AwaitIcReq,
            rx: RecvBuffer::with_capacity(IC_PDU_LEN),
            need: 0,
            tx: SendQueue::default(),
            r2ts: tag_map(0),
            read_size: FIRST_READ,
            outstanding: 0,
            completions: VecDeque::new(),
        })
    }

    /// Sets the number of commands the host may have outstanding (see
    /// [`TargetConfig::queue_size`]).
    pub fn set_queue_size(&mut self, n: usize) {
        self.config.queue_size = n;
    }

    /// Commands received whose completion has not been sent yet.
    pub fn outstanding_commands(&self) -> usize {
        self.outstanding
    }

    /// Memory the connection's buffers hold: the send buffer's capacity, the namespace memory
    /// waiting to be sent from, and the receive buffer's capacity.
    pub fn memory_held(&self) -> usize {
        self.tx.held() + self.rx.capacity()
    }

    /// Bytes received and not handled yet.
    pub fn buffered(&self) -> usize {
        self.rx.len()
    }

    /// Counts the commands in the receive buffer that [`next_event`](Self::next_event) has
    /// not reached yet, for a caller that stops handling PDUs while its send backlog drains:
    /// when they take the host past the queue size, the connection fails now as it would on
    /// reaching them (C2HTermReq, PDU Sequence Error, echoing the first command too many),
    /// instead of when the host reads again.
    pub fn check_buffered_commands(&mut self) -> Result<(), ProtocolError> {
        if !matches!(self.state, State::Established { .. }) {
            return Ok(());
        }
        let data = self.rx.data();
        let mut off = 0;
        let mut commands = self.outstanding;
        while let Some(ch) = data.get(off..).and_then(CommonHeader::from_prefix) {
            let plen = ch.plen() as usize;
            if plen < CH_LEN {
                break;
            }
            if ch.pdu_type() == Ok(PduType::CapsuleCmd) {
                if commands >= self.config.queue_size {
                    return Err(self.fail_at(Violation::sequence(QUEUE_OVERRUN), off));
                }
                commands += 1;
            }
            off += plen;
        }
        Ok(())
    }

    /// Gives memory back while nothing is buffered: the send buffer keeps at most `keep`
    /// bytes of capacity, the receive buffer returns to its first size when it holds more
    /// than `keep`. Cheap when there is nothing to give back; call it when the connection
    /// goes idle.
    pub fn release_buffers(&mut self, keep: usize) {
        self.tx.shrink(keep);
        if self.rx.capacity() > keep && self.rx.len() == 0 {
            self.rx.shrink_to(FIRST_READ);
            self.read_size = FIRST_READ.min(self.config.recv_buffer_size.max(1));
        }
    }

    /// The configuration.
    pub fn config(&self) -> &TargetConfig {
        &self.config
    }

    /// The negotiated parameters once the connection is established.
    pub fn params(&self) -> Option<TargetParams> {
        match &self.state {
            State::Established { params, .. } => Some(*params),
            _ => None,
        }
    }

    /// True after a fatal error or the host's TermReq: nothing more will be received.
    pub fn is_closed(&self) -> bool {
        matches!(self.state, State::Failed(_) | State::Closed)
    }

    /// Free space to read socket bytes into: at least `min` bytes, and enough for the whole
    /// PDU being received. Pass the number of bytes written to [`commit_recv`](Self::commit_recv).
    ///
    /// Until the ICReq is accepted the buffer holds one ICReq (a host sends nothing else
    /// before it has the ICResp): ask for [`TargetConn::recv_hint`] bytes to keep it so.
    pub fn recv_buf(&mut self, min: usize) -> &mut [u8] {
        self.rx.spare(min, self.need)
    }

    /// How many bytes to ask [`recv_buf`](Self::recv_buf) for: `chunk` once the connection
    /// is established, only what the ICReq still lacks before.
    /// The bytes asked start small and double while reads fill them, up to `chunk` and
    /// [`TargetConfig::recv_buffer_size`].
    pub fn recv_hint(&self, chunk: usize) -> usize {
        match self.state {
            State::AwaitIcReq => IC_PDU_LEN.saturating_sub(self.rx.len()).max(1),
            _ => self
                .read_size
                .min(chunk)
                .min(self.config.recv_buffer_size)
                .max(1),
        }
    }

    /// Marks `n` bytes written into [`recv_buf`](Self::recv_buf) as received (clamped to its
    /// length). A read that filled what [`recv_hint`](Self::recv_hint) asked for doubles the
    /// next one.
    pub fn commit_recv(&mut self, n: usize) {
        self.rx.commit(n);
        if n >= self.read_size && !matches!(self.state, State::AwaitIcReq) {
            self.read_size = (self.read_size * 2).min(self.config.recv_buffer_size.max(FIRST_READ));
        }
    }

    /// Copies received bytes in (convenient for tests and simple callers).
    pub fn feed(&mut self, bytes: &[u8]) {
        self.rx.extend(bytes);
    }

    /// Parses the next complete PDU in the receive buffer. `Ok(None)` means more bytes are
    /// needed (or the connection is closed). On a fatal error a C2HTermReq is queued and the
    /// same error is returned on every later call.
    pub fn next_event(&mut self) -> Result<Option<TargetEvent<'_>>, ProtocolError> {
        Ok(self.next_event_and_responder()?.map(|(ev, _)| ev))
    }

    /// [`next_event`](Self::next_event), with a [`Responder`] that queues responses while the
    /// event still borrows the receive buffer (its in-capsule or H2CData data): a command can
    /// be answered, its read data sent, before its data is let go.
    pub fn next_event_and_responder(
        &mut self,
    ) -> Result<Option<(TargetEvent<'_>, Responder<'_>)>, ProtocolError> {
        if let State::Failed(e) = &self.state {
            return Err(e.clone());
        }
        match self.step() {
            Ok(None) => Ok(None),
            Ok(Some(ev)) => {
                let ev = materialize(self.rx.raw(), ev);
                let out = Responder {
                    config: &self.config,
                    params: established(&self.state),
                    tx: &mut self.tx,
                    completions: &mut self.completions,
                    r2ts: &mut self.r2ts,
                };
                Ok(Some((ev, out)))
            }
            Err(v) => Err(self.fail(v)),
        }
    }

    /// A [`Responder`] for queueing responses.
    pub fn responder(&mut self) -> Responder<'_> {
        Responder {
            config: &self.config,
            params: established(&self.state),
            tx: &mut self.tx,
            completions: &mut self.completions,
            r2ts: &mut self.r2ts,
        }
    }

    /// Records a fatal error, queues the C2HTermReq if one is due, and closes receiving.
    fn fail(&mut self, v: Violation) -> ProtocolError {
        self.fail_at(v, 0)
    }

    /// [`fail`](Self::fail) for the PDU `at` bytes into the received data.
    fn fail_at(&mut self, v: Violation, at: usize) -> ProtocolError {
        if v.reply {
            let data = self.rx.data().get(at..).unwrap_or(&[]);
            let n = offending_header_len(data);
            let hdr = PduHeader::term_req(PduType::C2hTermReq, v.fes, v.fei, n);
            self.tx.append(|v| {
                v.extend_from_slice(hdr.as_bytes());
                v.extend_from_slice(&data[..n]);
            });
        }
        let err = v.into_error(v.reply);
        self.rx.clear();
        self.need = 0;
        self.state = State::Failed(err.clone());
        err
    }

    /// The transition function: consumes at most one PDU from the receive buffer.
    fn step(&mut self) -> Result<Option<Ev>, Violation> {
        match &mut self.state {
            State::Failed(_) | State::Closed => Ok(None),
            State::AwaitIcReq => self.step_ic_req(),
            State::Established { params, pending } => {
                let params = *params;
                let pending = pending.take();
                self.step_established(params, pending)
            }
        }
    }

    fn step_ic_req(&mut self) -> Result<Option<Ev>, Violation> {
        let Some(ch) = CommonHeader::from_prefix(self.rx.data()) else {
            self.need = CH_LEN;
            return Ok(None);
        };
        if let FirstPdu::TermReq(frame) = check_first_pdu(ch, Side::Controller)? {
            return Ok(self.complete_term_req(&frame));
        }
        let Some(req) = IcReq::from_prefix(self.rx.data()) else {
            self.need = IC_PDU_LEN;
            return Ok(None);
        };
        if req.pfv() != PFV_1_0 {
            return Err(Violation::unsupported(
                IcReq::OFFSET_PFV,
                "unsupported PDU format version",
            ));
        }
        if req.hpda() > MAX_PDA {
            return Err(Violation::field(IcReq::OFFSET_HPDA, "HPDA out of range"));
        }
        let digests = Digests {
            header: req.hdgst_enable(),
            data: req.ddgst_enable(),
        };
        if (digests.header || digests.data) && !self.config.allow_digests {
            return Err(Violation::unsupported(
                IcReq::OFFSET_DGST,
                "digests are not allowed",
            ));
        }
        let params = TargetParams {
            digests,
            hpda: req.hpda(),
            maxr2t: req.maxr2t(),
        };
        self.rx.consume(IC_PDU_LEN);
        self.need = 0;
        // Section 3.6.2.3: PFV 0, CPDA 0 (no alignment needed), the digests exactly as asked.
        let resp = PduHeader::ic_resp(0, digests, self.config.maxh2cdata);
        self.tx.append(|v| resp.append_to(v, &[]));
        self.state = State::Established {
            params,
            pending: None,
        };
        Ok(Some(Ev::Connected(params)))
    }

    fn step_established(
        &mut self,
        params: TargetParams,
        pending: Option<Pending>,
    ) -> Result<Option<Ev>, Violation> {
        let pending = match pending {
            Some(p) => p,
            None => match self.parse_header(params)? {
                HeaderStep::NeedMore => return Ok(None),
                HeaderStep::TermReq(frame) => return Ok(self.complete_term_req(&frame)),
                HeaderStep::Pdu(p) => p,
            },
        };
        let frame = pending.frame;
        if self.rx.len() < frame.plen {
            self.need = frame.plen;
            self.set_pending(Some(pending));
            return Ok(None);
        }
        self.need = 0;
        let base = self.rx.start();
        let data = base + frame.data_off..base + frame.data_off + frame.data_len;
        let digest_ok = !frame.ddgst || {
            let pdu = self.rx.data();
            let d = frame.data_off..frame.data_off + frame.data_len;
            crc32c(&pdu[d.clone()]) == read_digest(&pdu[d.end..d.end + DIGEST_LEN])
        };
        self.rx.consume(frame.plen);
        let ev = match pending.kind {
            PendingKind::Command { sqe } => {
                self.outstanding += 1;
                if digest_ok {
                    Ev::Command { sqe, data }
                } else {
                    Ev::CommandDigest { sqe }
                }
            }
            PendingKind::H2c {
                cccid,
                ttag,
                datao,
                datal,
                last,
            } => {
                if last {
                    self.r2ts.remove(&ttag);
                } else if let Some(slot) = self.r2ts.get_mut(&ttag) {
                    slot.next = datao + datal;
                }
                if digest_ok {
                    Ev::H2c {
                        cccid,
                        ttag,
                        datao,
                        data,
                        last,
                    }
                } else {
                    Ev::H2cDigest {
                        cccid,
                        ttag,
                        datao,
                        datal,
                        last,
                    }
                }
            }
        };
        Ok(Some(ev))
    }

    fn set_pending(&mut self, p: Option<Pending>) {
        if let State::Established { pending, .. } = &mut self.state {
            *pending = p;
        }
    }

    /// Validates the header of the PDU at the front of the receive buffer.
    fn parse_header(&mut self, params: TargetParams) -> Result<HeaderStep, Violation> {
        let data = self.rx.data();
        let Some(ch) = CommonHeader::from_prefix(data) else {
            self.need = CH_LEN;
            return Ok(HeaderStep::NeedMore);
        };
        let d = params.digests;
        let frame = check_common_header(ch, Side::Controller, d.header, d.data, pda_alignment(0))?;
        if frame.ty == PduType::H2cTermReq {
            return Ok(HeaderStep::TermReq(frame));
        }
        if data.len() < frame.hdr_total {
            self.need = frame.hdr_total;
            return Ok(HeaderStep::NeedMore);
        }
        check_header_digest(data, &frame)?;
        // Bound what must be buffered before waiting for the data.
        match frame.ty {
            PduType::CapsuleCmd if frame.data_len > self.config.max_in_capsule_data as usize => {
                return Err(Violation::limit(
                    "in-capsule data larger than the configured limit",
                ));
            }
            PduType::H2cData if frame.data_len > self.config.maxh2cdata as usize => {
                return Err(Violation::limit("H2CData longer than MAXH2CDATA"));
            }
            _ => {}
        }
        let kind = match frame.ty {
            PduType::CapsuleCmd => {
                let hdr = CapsuleCmdHeader::from_prefix(data).ok_or(Violation::field(
                    CommonHeader::OFFSET_HLEN,
                    "short CapsuleCmd header",
                ))?;
                if self.outstanding >= self.config.queue_size {
                    return Err(Violation::sequence(QUEUE_OVERRUN));
                }
                PendingKind::Command { sqe: *hdr.sqe() }
            }
            PduType::H2cData => self.check_h2c(data, &frame)?,
            // Every other type was refused by the common-header check.
            _ => {
                return Err(Violation::field(
                    CommonHeader::OFFSET_PDU_TYPE,
                    "unexpected PDU type",
                ));
            }
        };
        Ok(HeaderStep::Pdu(Pending { frame, kind }))
    }

    /// Checks an H2CData header against the R2T it answers (section 3.3.2.2).
    fn check_h2c(&self, data: &[u8], frame: &Frame) -> Result<PendingKind, Violation> {
        let hdr = H2cDataHeader::from_prefix(data).ok_or(Violation::field(
            CommonHeader::OFFSET_HLEN,
            "short H2CData header",
        ))?;
        debug_assert_eq!(frame.hlen, DATA_PDU_HLEN);
        let (cccid, ttag, datao, datal) = (hdr.cccid(), hdr.ttag(), hdr.datao(), hdr.datal());
        let Some(slot) = self.r2ts.get(&ttag) else {
            return Err(Violation::field(
                H2cDataHeader::OFFSET_TTAG,
                "H2CData matches no outstanding R2T",
            ));
        };
        if slot.cccid != cccid {
            return Err(Violation::field(
                H2cDataHeader::OFFSET_CCCID,
                "H2CData CCCID differs from its R2T",
            ));
        }
        if datal as usize != frame.data_len || datal == 0 {
            return Err(Violation::field(
                H2cDataHeader::OFFSET_DATAL,
                "DATAL does not match PLEN",
            ));
        }
        let end = datao.checked_add(datal);
        if datao < slot.start || end.is_none_or(|e| e > slot.end) {
            return Err(Violation::out_of_range("H2CData outside the R2T range"));
        }
        if datao != slot.next {
            return Err(Violation::sequence(
                "H2CData is not contiguous with the previous one",
            ));
        }
        let last = frame.flags & flags::LAST_PDU != 0;
        if last != (end == Some(slot.end)) {
            return Err(Violation::field(
                CommonHeader::OFFSET_FLAGS,
                "LAST_PDU must be set exactly on the PDU that ends the R2T",
            ));
        }
        Ok(PendingKind::H2c {
            cccid,
            ttag,
            datao,
            datal,
            last,
        })
    }

    /// Completes a TermReq from the host once all of it is in the buffer.
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
        self.state = State::Closed;
        Some(Ev::TermReq { fes, fei, data })
    }

    fn established(&self) -> Result<TargetParams, SendError> {
        established(&self.state)
    }

    /// Queues a CapsuleResp carrying `cqe` ([`Responder::send_capsule_resp`]).
    pub fn send_capsule_resp(&mut self, cqe: &[u8; 16]) -> Result<(), SendError> {
        self.responder().send_capsule_resp(cqe)
    }

    /// Queues C2HData PDUs ([`Responder::send_c2h_data`]).
    pub fn send_c2h_data(
        &mut self,
        cccid: u16,
        datao: u32,
        data: &[u8],
        last: bool,
        success: bool,
    ) -> Result<(), SendError> {
        self.responder()
            .send_c2h_data(cccid, datao, data, last, success)
    }

    /// Queues a read's data written in place ([`Responder::send_c2h_data_with`]).
    pub fn send_c2h_data_with<E>(
        &mut self,
        cccid: u16,
        len: u32,
        success: bool,
        fill: impl FnMut(usize, &mut [u8]) -> Result<(), E>,
    ) -> Result<Result<(), E>, SendError> {
        self.responder()
            .send_c2h_data_with(cccid, len, success, fill)
    }

    /// Queues a read's data sent from shared buffers ([`Responder::send_c2h_data_shared`]).
    pub fn send_c2h_data_shared(
        &mut self,
        cccid: u16,
        len: u32,
        success: bool,
        pieces: &[(Arc<[u8]>, Range<usize>)],
    ) -> Result<(), SendError> {
        self.responder()
            .send_c2h_data_shared(cccid, len, success, pieces)
    }

    /// Encodes only the header (with header digest and padding) of one C2HData PDU for the
    /// negotiated parameters, for callers that send `header`, payload and data digest with
    /// one vectored write. Flush [`pending_send`](Self::pending_send) first to keep PDUs in
    /// order. A data digest ([`crate::digest_bytes`]) must follow the payload when
    /// [`PduHeader::data_digest_len`] is not 0.
    pub fn c2h_data_header(
        &self,
        cccid: u16,
        datao: u32,
        datal: u32,
        last: bool,
        success: bool,
    ) -> Result<PduHeader, SendError> {
        let p = self.established()?;
        datao.checked_add(datal).ok_or(SendError::TooLarge)?;
        PduHeader::c2h_data(p.digests, p.hpda, cccid, datao, datal, last, success)
    }

    /// Queues an R2T ([`Responder::send_r2t`]).
    pub fn send_r2t(
        &mut self,
        cccid: u16,
        ttag: u16,
        r2to: u32,
        r2tl: u32,
    ) -> Result<(), SendError> {
        self.responder().send_r2t(cccid, ttag, r2to, r2tl)
    }

    /// Forgets the outstanding R2T `ttag` (for a command abandoned early). Returns whether
    /// it was outstanding. H2CData for it that arrives later is a protocol error.
    pub fn cancel_r2t(&mut self, ttag: u16) -> bool {
        self.r2ts.remove(&ttag).is_some()
    }

    /// Number of R2Ts whose data has not fully arrived.
    pub fn outstanding_r2ts(&self) -> usize {
        self.r2ts.len()
    }

    /// The first contiguous run of bytes queued for sending (ICResp, responses, data, R2Ts, a
    /// TermReq): everything queued, unless data queued with
    /// [`send_c2h_data_shared`](Self::send_c2h_data_shared) waits too; then
    /// [`pending_send_slices`](Self::pending_send_slices) gives all of it. Empty only when
    /// nothing waits.
    pub fn pending_send(&self) -> &[u8] {
        self.tx.front()
    }

    /// Everything queued for sending, in order, as contiguous slices for one vectored write.
    pub fn pending_send_slices(&self) -> impl Iterator<Item = &[u8]> {
        self.tx.slices()
    }

    /// Number of bytes queued for sending, in every slice.
    pub fn pending_send_len(&self) -> usize {
        self.tx.len()
    }

    /// Marks `n` bytes of [`pending_send_slices`](Self::pending_send_slices) as written to the
    /// socket.
    pub fn consume_sent(&mut self, n: usize) {
        self.tx.consume(n);
        let sent = self.tx.sent();
        while self.completions.front().is_some_and(|&end| end <= sent) {
            self.completions.pop_front();
            self.outstanding = self.outstanding.saturating_sub(1);
        }
    }
}

fn established(state: &State) -> Result<TargetParams, SendError> {
    match state {
        State::Established { params, .. } => Ok(*params),
        State::AwaitIcReq => Err(SendError::NotEstablished),
        State::Failed(_) | State::Closed => Err(SendError::Closed),
    }
}

fn materialize(raw: &[u8], ev: Ev) -> TargetEvent<'_> {
    let slice = |r: Range<usize>| raw.get(r).unwrap_or(&[]);
    match ev {
        Ev::Connected(p) => TargetEvent::Connected(p),
        Ev::Command { sqe, data } => TargetEvent::Command {
            sqe,
            data: slice(data),
        },
        Ev::CommandDigest { sqe } => TargetEvent::CommandDataDigestError { sqe },
        Ev::H2c {
            cccid,
            ttag,
            datao,
            data,
            last,
        } => TargetEvent::H2CData {
            cccid,
            ttag,
            datao,
            data: slice(data),
            last,
        },
        Ev::H2cDigest {
            cccid,
            ttag,
            datao,
            datal,
            last,
        } => TargetEvent::H2CDataDigestError {
            cccid,
            ttag,
            datao,
            datal,
            last,
        },
        Ev::TermReq { fes, fei, data } => TargetEvent::TermReq {
            fes,
            fei,
            data: slice(data),
        },
    }
}

/// Queues responses on a connection ([`TargetConn::responder`],
/// [`TargetConn::next_event_and_responder`]): CapsuleResps and C2HData.
#[derive(Debug)]
pub struct Responder<'a> {
    config: &'a TargetConfig,
    params: Result<TargetParams, SendError>,
    tx: &'a mut SendQueue,
    completions: &'a mut VecDeque<u64>,
    r2ts: &'a mut TagMap<R2tSlot>,
}

impl Responder<'_> {
    /// Queues an R2T asking the host for `r2tl` bytes at `r2to` of command `cccid`, and
    /// registers it so the H2CData PDUs that answer it are checked. `ttag` must not belong
    /// to another outstanding R2T.
    pub fn send_r2t(
        &mut self,
        cccid: u16,
        ttag: u16,
        r2to: u32,
        r2tl: u32,
    ) -> Result<(), SendError> {
        let p = self.params?;
        if r2tl == 0 {
            return Err(SendError::EmptyData);
        }
        let end = r2to.checked_add(r2tl).ok_or(SendError::TooLarge)?;
        if self.r2ts.contains_key(&ttag) {
            return Err(SendError::TagInUse(ttag));
        }
        let allowed = u64::from(p.maxr2t) + 1;
        let outstanding = self.r2ts.values().filter(|s| s.cccid == cccid).count() as u64;
        if outstanding >= allowed {
            return Err(SendError::R2tLimit(cccid));
        }
        self.r2ts.insert(
            ttag,
            R2tSlot {
                cccid,
                start: r2to,
                next: r2to,
                end,
            },
        );
        let hdr = PduHeader::r2t(p.digests, cccid, ttag, r2to, r2tl);
        self.tx.append(|v| hdr.append_to(v, &[]));
        Ok(())
    }

    /// The connection's configuration.
    pub fn config(&self) -> &TargetConfig {
        self.config
    }

    /// Bytes queued for sending.
    pub fn pending_send_len(&self) -> usize {
        self.tx.len()
    }

    /// Queues a CapsuleResp carrying `cqe`.
    pub fn send_capsule_resp(&mut self, cqe: &[u8; 16]) -> Result<(), SendError> {
        let p = self.params?;
        let hdr = PduHeader::capsule_resp(p.digests, cqe);
        self.tx.append(|v| hdr.append_to(v, &[]));
        self.completions.push_back(self.tx.queued());
        Ok(())
    }

    /// Queues `data` (which lands at `datao` in the command's buffer) as C2HData PDUs of at
    /// most `max_c2h_data` bytes. When `last` is set, the final PDU carries LAST_PDU, and
    /// SUCCESS too if `success` is set: only allowed when SQ flow control is disabled, and
    /// then no CapsuleResp may be sent for the command.
    pub fn send_c2h_data(
        &mut self,
        cccid: u16,
        datao: u32,
        data: &[u8],
        last: bool,
        success: bool,
    ) -> Result<(), SendError> {
        let p = self.params?;
        if data.is_empty() {
            return Err(SendError::EmptyData);
        }
        if success && !last {
            return Err(SendError::SuccessWithoutLast);
        }
        let total = u32::try_from(data.len()).map_err(|_| SendError::TooLarge)?;
        datao.checked_add(total).ok_or(SendError::TooLarge)?;
        let max = self.config.max_c2h_data as usize;
        let count = data.len().div_ceil(max);
        for (i, chunk) in data.chunks(max).enumerate() {
            let fin = i + 1 == count;
            let off = datao + (i * max) as u32;
            let hdr = PduHeader::c2h_data(
                p.digests,
                p.hpda,
                cccid,
                off,
                chunk.len() as u32,
                fin && last,
                fin && success,
            )?;
            self.tx.append(|v| hdr.append_to(v, chunk));
        }
        if last && success {
            self.completions.push_back(self.tx.queued());
        }
        Ok(())
    }

    /// Queues all `len` bytes of a read's data for command `cccid` as C2HData PDUs (as
    /// [`send_c2h_data`](Self::send_c2h_data) does with `datao` 0 and `last`), with each PDU's
    /// payload written in place by `fill(offset, payload)`: the data goes from its source into
    /// the send buffer with one copy. When `fill` fails, nothing is queued and its error is
    /// returned inside `Ok`.
    pub fn send_c2h_data_with<E>(
        &mut self,
        cccid: u16,
        len: u32,
        success: bool,
        mut fill: impl FnMut(usize, &mut [u8]) -> Result<(), E>,
    ) -> Result<Result<(), E>, SendError> {
        let p = self.params?;
        if len == 0 {
            return Err(SendError::EmptyData);
        }
        let total = len as usize;
        let mark = self.tx.mark();
        let mut off = 0;
        while off < total {
            let (n, hdr) = match self.read_pdu(p, cccid, off, total, success) {
                Ok(x) => x,
                Err(e) => {
                    self.tx.rollback(mark);
                    return Err(e);
                }
            };
            let mut filled = Ok(());
            self.tx.append(|v| {
                v.extend_from_slice(hdr.as_bytes());
                let start = v.len();
                v.resize(start + n, 0);
                filled = fill(off, &mut v[start..]);
                if filled.is_ok() && hdr.data_digest_len() > 0 {
                    let d = crc32c(&v[start..]);
                    v.extend_from_slice(&d.to_le_bytes());
                }
            });
            if let Err(e) = filled {
                self.tx.rollback(mark);
                return Ok(Err(e));
            }
            off += n;
        }
        if success {
            self.completions.push_back(self.tx.queued());
        }
        Ok(Ok(()))
    }

    /// Queues all of a read's data for command `cccid` as C2HData PDUs (as
    /// [`send_c2h_data`](Self::send_c2h_data) does with `datao` 0 and `last`), sent from
    /// `pieces` themselves: ranges of shared buffers, in order, holding the data. Only the PDU
    /// headers and data digests are copied into the send buffer; each piece is held until its
    /// bytes have left through [`consume_sent`](TargetConn::consume_sent), so its owner must not
    /// change those bytes meanwhile (copy on write). Nothing is queued on an error, and when
    /// the pieces do not add up to exactly `len` bytes ([`SendError::TooLarge`] then).
    pub fn send_c2h_data_shared(
        &mut self,
        cccid: u16,
        len: u32,
        success: bool,
        pieces: &[(Arc<[u8]>, Range<usize>)],
    ) -> Result<(), SendError> {
        let p = self.params?;
        if len == 0 {
            return Err(SendError::EmptyData);
        }
        let given: usize = pieces
            .iter()
            .map(|(d, r)| d.get(r.clone()).map_or(usize::MAX, <[u8]>::len))
            .fold(0usize, usize::saturating_add);
        if given != len as usize {
            return Err(SendError::TooLarge);
        }
        let total = len as usize;
        let mark = self.tx.mark();
        // The piece being sent, and how much of it was.
        let (mut idx, mut used) = (0, 0);
        let mut off = 0;
        while off < total {
            let (n, hdr) = match self.read_pdu(p, cccid, off, total, success) {
                Ok(x) => x,
                Err(e) => {
                    self.tx.rollback(mark);
                    return Err(e);
                }
            };
            self.tx.append(|v| v.extend_from_slice(hdr.as_bytes()));
            let mut digest = DataDigest::new();
            let mut left = n;
            while left > 0 {
                let (data, range) = &pieces[idx];
                let start = range.start + used;
                let take = left.min(range.end - start);
                if hdr.data_digest_len() > 0 {
                    digest.update(&data[start..start + take]);
                }
                self.tx.push_shared(Arc::clone(data), start..start + take);
                left -= take;
                used += take;
                if range.start + used == range.end {
                    idx += 1;
                    used = 0;
                }
            }
            if hdr.data_digest_len() > 0 {
                let d = digest.to_bytes();
                self.tx.append(|v| v.extend_from_slice(&d));
            }
            off += n;
        }
        if success {
            self.completions.push_back(self.tx.queued());
        }
        Ok(())
    }

    /// The length and header of the C2HData PDU that starts at `off` in a read of `total`
    /// bytes for command `cccid`: at most `max_c2h_data` bytes; the final PDU carries
    /// LAST_PDU, and SUCCESS with `success`.
    fn read_pdu(
        &self,
        p: TargetParams,
        cccid: u16,
        off: usize,
        total: usize,
        success: bool,
    ) -> Result<(usize, PduHeader), SendError> {
        let n = (self.config.max_c2h_data as usize).min(total - off);
        let fin = off + n == total;
        let hdr = PduHeader::c2h_data(
            p.digests,
            p.hpda,
            cccid,
            off as u32,
            n as u32,
            fin,
            fin && success,
        )?;
        Ok((n, hdr))
    }
}

enum HeaderStep {
    NeedMore,
    TermReq(Frame),
    Pdu(Pending),
}
