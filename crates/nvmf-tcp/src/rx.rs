//! Receive buffer and common-header validation shared by both sides.

use nvme_spec::tcp::{
    CH_LEN, CommonHeader, DIGEST_LEN, IC_PDU_LEN, PduType, TERM_REQ_HLEN, TERM_REQ_MAX_DATA,
    TERM_REQ_MAX_PLEN, TermReqHeader, flags,
};

use std::sync::Arc;

use crate::digest::{crc32c, read_digest};
use crate::error::Violation;

/// A receive buffer: bytes `start..end` of `buf` are received and not yet consumed.
///
/// The buffer is allocated once; it grows only when one PDU does not fit, and consumed bytes
/// are reclaimed by moving the unconsumed tail to the front when room is needed. Received
/// bytes can be kept past their consumption ([`keep`](Self::keep)): the backing store they
/// are in is then never written again, and the next receive goes into another one (one
/// whose kept bytes were all dropped, or a new one).
#[derive(Debug)]
pub(crate) struct RecvBuffer {
    buf: Arc<Vec<u8>>,
    start: usize,
    end: usize,
    /// Backing stores given up while bytes were kept in them, for reuse once nothing keeps
    /// them: at most [`MAX_RETIRED`] with kept bytes (one more for the one receive after
    /// keeping stopped) and one without.
    retired: Vec<Arc<Vec<u8>>>,
}

/// Backing stores with kept bytes in them, beside the current one, past which
/// [`RecvBuffer::keep`] keeps nothing more (the bytes are then copied by their reader).
pub(crate) const MAX_RETIRED: usize = 4;

/// Bytes of a receive buffer kept after they were consumed: the data of a C2HData PDU that
/// its command's reader copies out later, instead of it being copied into the command's
/// buffer first. Holding them holds the receive buffer's backing store they are in.
#[derive(Clone)]
pub struct RxBytes {
    buf: Arc<Vec<u8>>,
    range: std::ops::Range<usize>,
}

impl RxBytes {
    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        self.buf.get(self.range.clone()).unwrap_or(&[])
    }
}

impl std::fmt::Debug for RxBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RxBytes")
            .field("len", &self.range.len())
            .finish()
    }
}

impl RecvBuffer {
    pub fn with_capacity(capacity: usize) -> Self {
        Self {
            buf: Arc::new(vec![0; capacity.max(CH_LEN)]),
            start: 0,
            end: 0,
            retired: Vec::new(),
        }
    }

    /// The received, unconsumed bytes.
    #[inline]
    pub fn data(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }

    /// Number of received, unconsumed bytes.
    #[inline]
    pub fn len(&self) -> usize {
        self.end - self.start
    }

    /// Absolute position of the first unconsumed byte (for building event ranges).
    #[inline]
    pub fn start(&self) -> usize {
        self.start
    }

    /// The whole backing store, for slicing absolute ranges.
    #[inline]
    pub fn raw(&self) -> &[u8] {
        &self.buf
    }

    /// Marks `n` bytes as consumed.
    #[inline]
    pub fn consume(&mut self, n: usize) {
        self.start += n.min(self.len());
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
    }

    /// Keeps bytes `range` (absolute, as [`raw`](Self::raw)) of the current backing store,
    /// consumed or not, until the returned handle and its clones are dropped; `None` when
    /// [`MAX_RETIRED`] stores already hold kept bytes or the range is outside the store.
    pub fn keep(&self, range: std::ops::Range<usize>) -> Option<RxBytes> {
        if range.end > self.buf.len() {
            return None;
        }
        let holding = self.retired.iter().filter(|b| Arc::strong_count(b) > 1);
        if holding.count() >= MAX_RETIRED {
            return None;
        }
        Some(RxBytes {
            buf: Arc::clone(&self.buf),
            range,
        })
    }

    /// Size of the backing store.
    pub fn capacity(&self) -> usize {
        self.buf.len()
    }

    /// Shrinks an empty backing store to `capacity` bytes (at least a common header).
    pub fn shrink_to(&mut self, capacity: usize) {
        if self.len() == 0 {
            self.start = 0;
            self.end = 0;
            self.buf = Arc::new(vec![0; capacity.max(CH_LEN)]);
            self.retired.clear();
        }
    }

    /// Drops everything received.
    pub fn clear(&mut self) {
        self.start = 0;
        self.end = 0;
    }

    /// Makes the backing store writable: a store with kept bytes in it is retired and
    /// replaced (by a retired one nothing keeps any more, or a new one of at least `size`
    /// bytes) with the unconsumed bytes moved to its front.
    fn writable(&mut self, size: usize) {
        if Arc::get_mut(&mut self.buf).is_none() {
            let size = size.max(self.buf.len());
            let free = self
                .retired
                .iter()
                .position(|b| Arc::strong_count(b) == 1 && b.len() >= size);
            let mut fresh = match free {
                Some(i) => self.retired.swap_remove(i),
                None => Arc::new(vec![0; size]),
            };
            let used = self.len();
            Arc::make_mut(&mut fresh)[..used].copy_from_slice(&self.buf[self.start..self.end]);
            let old = std::mem::replace(&mut self.buf, fresh);
            self.start = 0;
            self.end = used;
            // Keep one store nothing keeps for the next change; let the others go.
            let mut idle = 0;
            self.retired.retain(|b| {
                let unkept = Arc::strong_count(b) == 1;
                idle += usize::from(unkept);
                !unkept || idle <= 1
            });
            self.retired.push(old);
        }
    }

    /// Free space after the received bytes: at least `min` bytes (at least 1), and enough
    /// that `need` bytes counted from the first unconsumed byte fit.
    pub fn spare(&mut self, min: usize, need: usize) -> &mut [u8] {
        let min = min.max(1);
        let used = self.len();
        let want = (used + min).max(need);
        self.writable(want);
        let (start, end) = (self.start, self.end);
        // Unique after `writable`: no copy is made.
        let buf = Arc::make_mut(&mut self.buf);
        if buf.len() - start < want || buf.len() - end < min {
            if start > 0 {
                buf.copy_within(start..end, 0);
            }
            if buf.len() < want {
                // A new zeroed allocation rather than `resize`: large ones come as fresh
                // pages that become resident only as bytes arrive in them.
                let grown = want.max(buf.len() + buf.len() / 2);
                let mut grown = vec![0; grown];
                grown[..used].copy_from_slice(&buf[..used]);
                *buf = grown;
            }
            self.start = 0;
            self.end = used;
        }
        let end = self.end;
        &mut Arc::make_mut(&mut self.buf)[end..]
    }

    /// Marks `n` bytes written into [`spare`](Self::spare) as received. `n` is clamped to the
    /// free space.
    #[inline]
    pub fn commit(&mut self, n: usize) {
        self.end += n.min(self.buf.len() - self.end);
    }

    /// Appends `bytes` (copying).
    pub fn extend(&mut self, bytes: &[u8]) {
        let n = bytes.len();
        let need = self.len() + n;
        self.spare(n, need)[..n].copy_from_slice(bytes);
        self.commit(n);
    }
}

/// Which side is receiving.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    /// The controller receives host-to-controller PDUs.
    Controller,
    /// The host receives controller-to-host PDUs.
    Host,
}

/// Layout of a received PDU, derived from its validated common header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Frame {
    pub ty: PduType,
    pub flags: u8,
    /// HLEN.
    pub hlen: usize,
    /// HLEN plus the header digest, if any.
    pub hdr_total: usize,
    /// Offset of the PDU data from the start of the PDU.
    pub data_off: usize,
    /// Length of the PDU data (without digest).
    pub data_len: usize,
    /// A data digest follows the data.
    pub ddgst: bool,
    /// PLEN.
    pub plen: usize,
}

/// The first PDU a side receives: its initialization PDU, or a TermReq ending the connection.
#[derive(Debug)]
pub(crate) enum FirstPdu {
    /// An ICReq (at the controller) or ICResp (at the host) whose HLEN and PLEN are 128.
    Ic,
    /// A TermReq, to be read whole.
    TermReq(Frame),
}

/// Checks the common header of the first PDU `side` receives: the initialization PDU of the
/// other side (ICReq at the controller, ICResp at the host) with HLEN and PLEN of 128, or a
/// TermReq; anything else is a violation.
pub(crate) fn check_first_pdu(ch: &CommonHeader, side: Side) -> Result<FirstPdu, Violation> {
    let (ic, term, first, bad_hlen, bad_plen) = match side {
        Side::Controller => (
            PduType::IcReq,
            PduType::H2cTermReq,
            "the first PDU must be an ICReq",
            "ICReq HLEN is not 128",
            "ICReq PLEN is not 128",
        ),
        Side::Host => (
            PduType::IcResp,
            PduType::C2hTermReq,
            "the first PDU must be an ICResp",
            "ICResp HLEN is not 128",
            "ICResp PLEN is not 128",
        ),
    };
    match ch.pdu_type() {
        Ok(t) if t == term => {
            return check_common_header(ch, side, false, false, 4).map(FirstPdu::TermReq);
        }
        Ok(t) if t.is_controller_to_host() != (side == Side::Host) => {
            return Err(Violation::field(
                CommonHeader::OFFSET_PDU_TYPE,
                "PDU type belongs to the other direction",
            ));
        }
        Ok(t) if t != ic => return Err(Violation::sequence(first)),
        Ok(_) => {}
        Err(_) => {
            return Err(Violation::field(
                CommonHeader::OFFSET_PDU_TYPE,
                "reserved PDU type",
            ));
        }
    }
    if usize::from(ch.hlen()) != IC_PDU_LEN {
        return Err(Violation::field(CommonHeader::OFFSET_HLEN, bad_hlen));
    }
    if ch.plen() as usize != IC_PDU_LEN {
        return Err(Violation::field(CommonHeader::OFFSET_PLEN, bad_plen));
    }
    Ok(FirstPdu::Ic)
}

/// Validates the common header of a PDU received on an established connection, checking
/// fields in wire order so that FEI names the lowest invalid field.
pub(crate) fn check_common_header(
    ch: &CommonHeader,
    side: Side,
    hdgst: bool,
    ddgst: bool,
    rx_align: usize,
) -> Result<Frame, Violation> {
    let ty = ch
        .pdu_type()
        .map_err(|_| Violation::field(CommonHeader::OFFSET_PDU_TYPE, "reserved PDU type"))?;
    if ty.is_controller_to_host() != (side == Side::Host) {
        return Err(Violation::field(
            CommonHeader::OFFSET_PDU_TYPE,
            "PDU type belongs to the other direction",
        ));
    }
    let plen = ch.plen() as usize;
    let hlen = usize::from(ch.hlen());
    let pdo = usize::from(ch.pdo());
    match ty {
        PduType::IcReq | PduType::IcResp => {
            return Err(Violation::sequence(
                "connection initialization PDU on an established connection",
            ));
        }
        PduType::H2cTermReq | PduType::C2hTermReq => {
            // Section 3.5: a TermReq with a bad length is ignored and the connection closed.
            if !(TERM_REQ_HLEN..=TERM_REQ_MAX_PLEN).contains(&plen) {
                return Err(Violation::silent(
                    CommonHeader::OFFSET_PLEN,
                    "TermReq with invalid PLEN",
                ));
            }
            if hlen != TERM_REQ_HLEN {
                return Err(Violation::silent(
                    CommonHeader::OFFSET_HLEN,
                    "TermReq with invalid HLEN",
                ));
            }
            return Ok(Frame {
                ty,
                flags: ch.flags(),
                hlen,
                hdr_total: TERM_REQ_HLEN,
                data_off: TERM_REQ_HLEN,
                data_len: plen - TERM_REQ_HLEN,
                ddgst: false,
                plen,
            });
        }
        _ => {}
    }

    let fl = ch.flags();
    let hd = if hdgst { DIGEST_LEN } else { 0 };
    let full = ty.header_len() + hd;
    let carries = ty.may_carry_data();
    // Tentative amount of data (with its digest) for the flag check.
    let data_total = if !carries {
        0
    } else if pdo == 0 {
        plen.saturating_sub(full)
    } else {
        plen.saturating_sub(pdo)
    };

    // FLAGS.
    if fl & !ty.defined_flags() != 0 {
        return Err(Violation::field(
            CommonHeader::OFFSET_FLAGS,
            "reserved flag set",
        ));
    }
    let mut expect = 0;
    if hdgst {
        expect |= flags::HDGSTF;
    }
    if ddgst && carries && data_total > 0 {
        expect |= flags::DDGSTF;
    }
    if fl & (flags::HDGSTF | flags::DDGSTF) != expect {
        return Err(Violation::field(
            CommonHeader::OFFSET_FLAGS,
            "digest flags do not match the negotiated digests",
        ));
    }
    if ty == PduType::C2hData && fl & flags::SUCCESS != 0 && fl & flags::LAST_PDU == 0 {
        return Err(Violation::field(
            CommonHeader::OFFSET_FLAGS,
            "SUCCESS without LAST_PDU",
        ));
    }

    // HLEN.
    if hlen != ty.header_len() {
        return Err(Violation::field(CommonHeader::OFFSET_HLEN, "invalid HLEN"));
    }

    // PDO.
    if carries {
        if pdo == 0 {
            if plen > full {
                return Err(Violation::field(
                    CommonHeader::OFFSET_PDO,
                    "PDU data without PDO",
                ));
            }
        } else if pdo < full || pdo > plen || pdo % rx_align != 0 {
            return Err(Violation::field(CommonHeader::OFFSET_PDO, "invalid PDO"));
        }
    } else if pdo != 0 {
        return Err(Violation::field(
            CommonHeader::OFFSET_PDO,
            "PDO set on a PDU without data",
        ));
    }

    // PLEN.
    if plen < full {
        return Err(Violation::field(
            CommonHeader::OFFSET_PLEN,
            "PLEN shorter than the header",
        ));
    }
    if !carries && plen != full {
        return Err(Violation::field(
            CommonHeader::OFFSET_PLEN,
            "PLEN does not match the header",
        ));
    }
    let has_ddgst = fl & flags::DDGSTF != 0;
    let data_len = if has_ddgst {
        if data_total <= DIGEST_LEN {
            return Err(Violation::field(
                CommonHeader::OFFSET_PLEN,
                "PLEN too short for the data digest",
            ));
        }
        data_total - DIGEST_LEN
    } else {
        data_total
    };
    Ok(Frame {
        ty,
        flags: fl,
        hlen,
        hdr_total: full,
        data_off: if pdo == 0 { full } else { pdo },
        data_len,
        ddgst: has_ddgst,
        plen,
    })
}

/// Verifies the header digest of a PDU whose first `frame.hdr_total` bytes are in `pdu`.
pub(crate) fn check_header_digest(pdu: &[u8], frame: &Frame) -> Result<(), Violation> {
    if frame.hdr_total == frame.hlen {
        return Ok(());
    }
    let received = read_digest(&pdu[frame.hlen..frame.hdr_total]);
    if crc32c(&pdu[..frame.hlen]) != received {
        return Err(Violation::new(
            nvme_spec::tcp::FatalErrorStatus::HeaderDigestError,
            received,
            "header digest mismatch",
        ));
    }
    Ok(())
}

/// How many bytes of the PDU at the front of `data` to echo in a TermReq: its header
/// (HLEN bytes, at least the common header) as far as received, at most 128 bytes.
pub(crate) fn offending_header_len(data: &[u8]) -> usize {
    let hlen = data.get(2).map_or(CH_LEN, |&h| usize::from(h).max(CH_LEN));
    hlen.min(data.len()).min(TERM_REQ_MAX_DATA)
}

/// Raw FES and FEI of a received TermReq.
pub(crate) fn parse_term_req(pdu: &[u8]) -> (u16, u32) {
    TermReqHeader::from_prefix(pdu).map_or((0, 0), |t| (t.fes_raw(), t.fei()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use nvme_spec::tcp::FatalErrorStatus;

    /// A common header of `ty` (the raw PDU-Type byte) with these HLEN and PLEN.
    fn ch(ty: u8, hlen: u8, plen: u32) -> CommonHeader {
        let mut b = [0u8; CH_LEN];
        b[0] = ty;
        b[2] = hlen;
        b[4..8].copy_from_slice(&plen.to_le_bytes());
        *CommonHeader::from_prefix(&b).unwrap()
    }

    fn reason(r: Result<FirstPdu, Violation>) -> &'static str {
        r.unwrap_err().reason
    }

    #[test]
    fn the_first_pdu_is_the_other_sides_initialization_pdu_or_a_term_req() {
        let ic = IC_PDU_LEN as u8;
        let ic_len = IC_PDU_LEN as u32;
        let (ic_req, ic_resp) = (PduType::IcReq as u8, PduType::IcResp as u8);
        let (h2c_term, c2h_term) = (PduType::H2cTermReq as u8, PduType::C2hTermReq as u8);
        let cmd = PduType::CapsuleCmd as u8;
        let resp = PduType::CapsuleResp as u8;
        let c = Side::Controller;
        let h = Side::Host;
        assert!(matches!(
            check_first_pdu(&ch(ic_req, ic, ic_len), c),
            Ok(FirstPdu::Ic)
        ));
        assert!(matches!(
            check_first_pdu(&ch(ic_resp, ic, ic_len), h),
            Ok(FirstPdu::Ic)
        ));
        let term = |ty, side| check_first_pdu(&ch(ty, TERM_REQ_HLEN as u8, 28), side);
        assert!(matches!(term(h2c_term, c), Ok(FirstPdu::TermReq(f)) if f.data_len == 4));
        assert!(matches!(term(c2h_term, h), Ok(FirstPdu::TermReq(_))));
        // A TermReq with a bad length closes without a reply.
        let bad_term = check_first_pdu(&ch(c2h_term, 8, 28), h).unwrap_err();
        assert!(!bad_term.reply);
        let other = "PDU type belongs to the other direction";
        assert_eq!(reason(check_first_pdu(&ch(ic_resp, ic, ic_len), c)), other);
        assert_eq!(reason(check_first_pdu(&ch(ic_req, ic, ic_len), h)), other);
        assert_eq!(reason(check_first_pdu(&ch(resp, 24, 24), c)), other);
        let first = check_first_pdu(&ch(cmd, 72, 72), c).unwrap_err();
        assert_eq!(
            (first.fes, first.reason),
            (
                FatalErrorStatus::PduSequenceError,
                "the first PDU must be an ICReq"
            )
        );
        assert_eq!(
            reason(check_first_pdu(&ch(resp, 24, 24), h)),
            "the first PDU must be an ICResp"
        );
        assert_eq!(
            reason(check_first_pdu(&ch(0x7f, ic, ic_len), c)),
            "reserved PDU type"
        );
        let hlen = check_first_pdu(&ch(ic_req, 64, ic_len), c).unwrap_err();
        assert_eq!(
            (hlen.fei, hlen.reason),
            (CommonHeader::OFFSET_HLEN, "ICReq HLEN is not 128")
        );
        let plen = check_first_pdu(&ch(ic_resp, ic, 129), h).unwrap_err();
        assert_eq!(
            (plen.fei, plen.reason),
            (CommonHeader::OFFSET_PLEN, "ICResp PLEN is not 128")
        );
    }

    /// Receives `bytes` the way a connection does: into the spare room, then committed.
    fn receive(rx: &mut RecvBuffer, bytes: &[u8]) {
        rx.spare(bytes.len(), 0)[..bytes.len()].copy_from_slice(bytes);
        rx.commit(bytes.len());
    }

    #[test]
    fn kept_bytes_stay_as_received_while_the_buffer_receives_on() {
        let mut rx = RecvBuffer::with_capacity(64);
        receive(&mut rx, b"0123456789abcdef");
        let kept = rx.keep(4..12).unwrap();
        // The first 12 bytes consumed; "cdef" is the start of an unfinished PDU.
        rx.consume(12);
        assert_eq!(rx.retired.len(), 0);
        receive(&mut rx, &[b'x'; 60]);
        // The store with kept bytes was retired; the unconsumed bytes moved to the front of
        // a fresh one.
        assert_eq!(kept.as_slice(), b"456789ab");
        assert_eq!(rx.retired.len(), 1);
        assert_eq!(&rx.data()[..4], b"cdef");
        assert_eq!(rx.len(), 64);
        rx.consume(64);
        receive(&mut rx, &[b'y'; 64]);
        assert_eq!(kept.as_slice(), b"456789ab");

        // Once nothing keeps it, the retired store is written again instead of a new one.
        let retired = Arc::as_ptr(&rx.retired[0]);
        let again = rx.keep(0..8).unwrap();
        drop(kept);
        rx.consume(64);
        receive(&mut rx, b"z");
        assert_eq!(Arc::as_ptr(&rx.buf), retired);
        assert_eq!(rx.data(), b"z");
        assert_eq!(again.as_slice(), &[b'y'; 8]);
    }

    #[test]
    fn keeping_stops_at_the_retired_store_limit_and_unkept_stores_are_reused() {
        let mut rx = RecvBuffer::with_capacity(32);
        let mut kept = Vec::new();
        for round in 0..MAX_RETIRED + 2 {
            receive(&mut rx, &[round as u8; 32]);
            match rx.keep(0..32) {
                Some(k) => kept.push(k),
                None => assert_eq!(round, MAX_RETIRED, "kept past the limit"),
            }
            rx.consume(32);
            if round == MAX_RETIRED {
                break;
            }
        }
        assert_eq!(kept.len(), MAX_RETIRED);
        assert!(rx.retired.len() <= MAX_RETIRED + 1);
        for (round, k) in kept.iter().enumerate() {
            assert_eq!(k.as_slice(), &[round as u8; 32]);
        }
        // Nothing keeps anything: receiving goes on in the same store, at most one idle
        // store is held beside it after the next change.
        kept.clear();
        receive(&mut rx, b"abc");
        assert_eq!(rx.data(), b"abc");
        let k = rx.keep(0..3).unwrap();
        rx.consume(3);
        receive(&mut rx, b"def");
        assert_eq!(k.as_slice(), b"abc");
        assert_eq!(rx.data(), b"def");
        assert!(rx.retired.len() <= 2, "{} stores held", rx.retired.len());
        // Shrinking an idle buffer lets the retired stores go.
        rx.consume(3);
        rx.shrink_to(16);
        assert!(rx.retired.is_empty());
        assert_eq!(k.as_slice(), b"abc");
    }

    #[test]
    fn nothing_is_kept_outside_the_store() {
        let rx = RecvBuffer::with_capacity(16);
        assert!(rx.keep(8..17).is_none());
        assert_eq!(rx.keep(8..16).unwrap().as_slice().len(), 8);
    }
}
