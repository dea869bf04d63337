//! Receive buffer and common-header validation shared by both sides.

use nvme_spec::tcp::{
    CH_LEN, CommonHeader, DIGEST_LEN, IC_PDU_LEN, PduType, TERM_REQ_HLEN, TERM_REQ_MAX_DATA,
    TERM_REQ_MAX_PLEN, TermReqHeader, flags,
};

use crate::digest::{crc32c, read_digest};
use crate::error::Violation;

/// A receive buffer: bytes `start..end` of `buf` are received and not yet consumed.
///
/// The buffer is allocated once; it grows only when one PDU does not fit, and consumed bytes
/// are reclaimed by moving the unconsumed tail to the front when room is needed.
#[derive(Debug)]
pub(crate) struct RecvBuffer {
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

impl RecvBuffer {
    pub fn with_capacity(capacity: usize) -> Self {
        Self {
            buf: vec![0; capacity.max(CH_LEN)],
            start: 0,
            end: 0,
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

    /// Size of the backing store.
    pub fn capacity(&self) -> usize {
        self.buf.len()
    }

    /// Shrinks an empty backing store to `capacity` bytes (at least a common header).
    pub fn shrink_to(&mut self, capacity: usize) {
        if self.len() == 0 {
            self.start = 0;
            self.end = 0;
            self.buf = vec![0; capacity.max(CH_LEN)];
        }
    }

    /// Drops everything received.
    pub fn clear(&mut self) {
        self.start = 0;
        self.end = 0;
    }

    /// Free space after the received bytes: at least `min` bytes (at least 1), and enough
    /// that `need` bytes counted from the first unconsumed byte fit.
    pub fn spare(&mut self, min: usize, need: usize) -> &mut [u8] {
        let min = min.max(1);
        let used = self.len();
        let want = (used + min).max(need);
        if self.buf.len() - self.start < want || self.buf.len() - self.end < min {
            if self.start > 0 {
                self.buf.copy_within(self.start..self.end, 0);
                self.start = 0;
                self.end = used;
            }
            if self.buf.len() < want {
                // A new zeroed allocation rather than `resize`: large ones come as fresh
                // pages that become resident only as bytes arrive in them.
                let grown = want.max(self.buf.len() + self.buf.len() / 2);
                let mut buf = vec![0; grown];
                buf[..used].copy_from_slice(&self.buf[..used]);
                self.buf = buf;
            }
        }
        &mut self.buf[self.end..]
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
}
