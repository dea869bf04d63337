//! Low-level PDU encoders.
//!
//! Each constructor of [`PduHeader`] produces the wire bytes of one PDU up to its data: the
//! header, the header digest when header digests are on, and the padding up to PDO. The data
//! digest is computed separately ([`crate::digest_bytes`] or [`crate::DataDigest`]), so a caller
//! that sends large payloads can gather `header`, `payload` and `digest` with one vectored
//! write instead of copying the payload into a send buffer. [`PduHeader::data_digest_len`]
//! tells whether a data digest must follow the payload.

use nvme_spec::tcp::{
    C2hDataHeader, CAPSULE_CMD_HLEN, CQE_LEN, CapsuleCmdHeader, CapsuleRespHeader, CommonHeader,
    DATA_PDU_HLEN, DIGEST_LEN, FatalErrorStatus, H2cDataHeader, IcReq, IcResp, MAX_PDA, PduType,
    R2tHeader, SQE_LEN, TERM_REQ_MAX_DATA, TermReqHeader, flags,
};

use crate::digest::{crc32c, digest_bytes};
use crate::error::SendError;

/// Largest output of a [`PduHeader`] constructor: 128 bytes (an ICReq/ICResp, or a data PDU
/// header padded to a 128-byte data alignment).
pub const MAX_HEADER_LEN: usize = 128;

/// Which digests are in use on a connection.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Digests {
    /// Header digest (HDGST) on every PDU except ICReq, ICResp and TermReq.
    pub header: bool,
    /// Data digest (DDGST) on every PDU that carries data.
    pub data: bool,
}

/// Data alignment in bytes for a 0's based HPDA/CPDA value (values above 31 are treated as 31).
pub fn pda_alignment(pda: u8) -> usize {
    (usize::from(pda.min(MAX_PDA)) + 1) * 4
}

/// The encoded header part of one PDU: header, header digest and padding.
#[derive(Clone, Copy)]
pub struct PduHeader {
    bytes: [u8; MAX_HEADER_LEN],
    len: usize,
    ddgst: bool,
}

impl core::fmt::Debug for PduHeader {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("PduHeader")
            .field("bytes", &self.as_bytes())
            .finish()
    }
}

/// Computed layout of a data-carrying PDU.
struct DataLayout {
    digest_flags: u8,
    pdo: usize,
    plen: u32,
    ddgst: bool,
}

fn data_layout(
    hlen: usize,
    digests: Digests,
    pda: u8,
    data_len: usize,
) -> Result<DataLayout, SendError> {
    let full = hlen + if digests.header { DIGEST_LEN } else { 0 };
    let has_data = data_len > 0;
    let ddgst = digests.data && has_data;
    let pdo = if has_data {
        full.next_multiple_of(pda_alignment(pda))
    } else {
        0
    };
    let body_start = if has_data { pdo } else { full };
    let total = body_start
        .checked_add(data_len)
        .and_then(|t| t.checked_add(if ddgst { DIGEST_LEN } else { 0 }))
        .ok_or(SendError::TooLarge)?;
    let plen = u32::try_from(total).map_err(|_| SendError::TooLarge)?;
    let mut digest_flags = 0;
    if digests.header {
        digest_flags |= flags::HDGSTF;
    }
    if ddgst {
        digest_flags |= flags::DDGSTF;
    }
    Ok(DataLayout {
        digest_flags,
        pdo,
        plen,
        ddgst,
    })
}

impl PduHeader {
    /// Assembles header bytes, the optional header digest and zero padding up to `pdo`.
    fn assemble(header: &[u8], hdgst: bool, pdo: usize, ddgst: bool) -> Self {
        let mut bytes = [0u8; MAX_HEADER_LEN];
        let hlen = header.len();
        bytes[..hlen].copy_from_slice(header);
        let mut len = hlen;
        if hdgst {
            bytes[hlen..hlen + DIGEST_LEN].copy_from_slice(&digest_bytes(header));
            len += DIGEST_LEN;
        }
        // Padding bytes are already zero.
        len = len.max(pdo.min(MAX_HEADER_LEN));
        Self { bytes, len, ddgst }
    }

    /// ICReq (never carries digests): PFV 0, the given HPDA, requested digests and MAXR2T
    /// (0's based).
    pub fn ic_req(hpda: u8, requested: Digests, maxr2t: u32) -> Self {
        let pdu = IcReq::new(hpda, requested.header, requested.data, maxr2t);
        Self::assemble(pdu.as_wire_bytes(), false, 0, false)
    }

    /// ICResp (never carries digests): PFV 0, the given CPDA, digests in use and MAXH2CDATA.
    pub fn ic_resp(cpda: u8, digests: Digests, maxh2cdata: u32) -> Self {
        let pdu = IcResp::new(cpda, digests.header, digests.data, maxh2cdata);
        Self::assemble(pdu.as_wire_bytes(), false, 0, false)
    }

    /// Header of a TermReq that will carry `data_len` bytes of offending header (clamped to
    /// 128). `pdu_type` is [`PduType::H2cTermReq`] or [`PduType::C2hTermReq`]. TermReq PDUs
    /// never carry digests.
    pub fn term_req(pdu_type: PduType, fes: FatalErrorStatus, fei: u32, data_len: usize) -> Self {
        let pdu = TermReqHeader::new(pdu_type, fes, fei, data_len.min(TERM_REQ_MAX_DATA));
        Self::assemble(pdu.as_wire_bytes(), false, 0, false)
    }

    /// CapsuleCmd carrying `sqe` and `data_len` bytes of in-capsule data, with data aligned
    /// as the controller's CPDA requires.
    pub fn capsule_cmd(
        digests: Digests,
        cpda: u8,
        sqe: &[u8; SQE_LEN],
        data_len: usize,
    ) -> Result<Self, SendError> {
        let l = data_layout(CAPSULE_CMD_HLEN, digests, cpda, data_len)?;
        let pdu = CapsuleCmdHeader::new(l.digest_flags, l.pdo as u8, l.plen, sqe);
        Ok(Self::assemble(
            pdu.as_wire_bytes(),
            digests.header,
            l.pdo,
            l.ddgst,
        ))
    }

    /// CapsuleResp carrying `cqe`.
    pub fn capsule_resp(digests: Digests, cqe: &[u8; CQE_LEN]) -> Self {
        let hd = if digests.header { DIGEST_LEN } else { 0 };
        let fl = if digests.header { flags::HDGSTF } else { 0 };
        let pdu = CapsuleRespHeader::new(fl, (CapsuleRespHeader::WIRE_LEN + hd) as u32, cqe);
        Self::assemble(pdu.as_wire_bytes(), digests.header, 0, false)
    }

    /// H2CData header for `datal` bytes at `datao` answering the R2T `ttag` of `cccid`.
    #[allow(clippy::too_many_arguments)]
    pub fn h2c_data(
        digests: Digests,
        cpda: u8,
        cccid: u16,
        ttag: u16,
        datao: u32,
        datal: u32,
        last: bool,
    ) -> Result<Self, SendError> {
        if datal == 0 {
            return Err(SendError::EmptyData);
        }
        let l = data_layout(DATA_PDU_HLEN, digests, cpda, datal as usize)?;
        let fl = l.digest_flags | if last { flags::LAST_PDU } else { 0 };
        let ch = CommonHeader::new(
            PduType::H2cData,
            fl,
            DATA_PDU_HLEN as u8,
            l.pdo as u8,
            l.plen,
        );
        let pdu = H2cDataHeader::new(ch, cccid, ttag, datao, datal);
        Ok(Self::assemble(
            pdu.as_wire_bytes(),
            digests.header,
            l.pdo,
            l.ddgst,
        ))
    }

    /// C2HData header for `datal` bytes at `datao` of command `cccid`, with data aligned as
    /// the host's HPDA requires. `success` requires `last`.
    #[allow(clippy::too_many_arguments)]
    pub fn c2h_data(
        digests: Digests,
        hpda: u8,
        cccid: u16,
        datao: u32,
        datal: u32,
        last: bool,
        success: bool,
    ) -> Result<Self, SendError> {
        if datal == 0 {
            return Err(SendError::EmptyData);
        }
        if success && !last {
            return Err(SendError::SuccessWithoutLast);
        }
        let l = data_layout(DATA_PDU_HLEN, digests, hpda, datal as usize)?;
        let mut fl = l.digest_flags;
        if last {
            fl |= flags::LAST_PDU;
        }
        if success {
            fl |= flags::SUCCESS;
        }
        let ch = CommonHeader::new(
            PduType::C2hData,
            fl,
            DATA_PDU_HLEN as u8,
            l.pdo as u8,
            l.plen,
        );
        let pdu = C2hDataHeader::new(ch, cccid, datao, datal);
        Ok(Self::assemble(
            pdu.as_wire_bytes(),
            digests.header,
            l.pdo,
            l.ddgst,
        ))
    }

    /// R2T asking for `r2tl` bytes at `r2to` of command `cccid` under transfer tag `ttag`.
    pub fn r2t(digests: Digests, cccid: u16, ttag: u16, r2to: u32, r2tl: u32) -> Self {
        let hd = if digests.header { DIGEST_LEN } else { 0 };
        let fl = if digests.header { flags::HDGSTF } else { 0 };
        let pdu = R2tHeader::new(
            fl,
            (R2tHeader::WIRE_LEN + hd) as u32,
            cccid,
            ttag,
            r2to,
            r2tl,
        );
        Self::assemble(pdu.as_wire_bytes(), digests.header, 0, false)
    }

    /// The bytes to send before the PDU data.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len]
    }

    /// PLEN of the PDU this header starts.
    pub fn plen(&self) -> u32 {
        CommonHeader::from_prefix(&self.bytes).map_or(0, CommonHeader::plen)
    }

    /// Number of data digest bytes (0 or 4) that must follow the PDU data.
    pub fn data_digest_len(&self) -> usize {
        if self.ddgst { DIGEST_LEN } else { 0 }
    }

    /// Appends this header, `data` and, when required, the data digest of `data` to `out`.
    pub fn append_to(&self, out: &mut Vec<u8>, data: &[u8]) {
        out.extend_from_slice(self.as_bytes());
        out.extend_from_slice(data);
        if self.ddgst {
            out.extend_from_slice(&crc32c(data).to_le_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use nvme_spec::tcp::{
        C2hDataHeader, CapsuleCmdHeader, CapsuleRespHeader, CommonHeader, H2cDataHeader, IcReq,
        IcResp, R2tHeader, TermReqHeader,
    };

    use super::*;

    const ALL: [Digests; 4] = [
        Digests {
            header: false,
            data: false,
        },
        Digests {
            header: true,
            data: false,
        },
        Digests {
            header: false,
            data: true,
        },
        Digests {
            header: true,
            data: true,
        },
    ];

    /// Encodes a whole PDU and checks the common-header layout, the header digest and the
    /// data digest; returns the PDU.
    fn whole(hdr: &PduHeader, data: &[u8], d: Digests, hlen: usize) -> Vec<u8> {
        let mut pdu = Vec::new();
        hdr.append_to(&mut pdu, data);
        let ch = CommonHeader::from_prefix(&pdu).unwrap();
        assert_eq!(usize::from(ch.hlen()), hlen);
        assert_eq!(ch.plen() as usize, pdu.len());
        assert_eq!(ch.hdgstf(), d.header);
        if d.header {
            assert_eq!(pdu[hlen..hlen + 4], digest_bytes(&pdu[..hlen]));
        }
        let has_ddgst = d.data && !data.is_empty();
        assert_eq!(ch.ddgstf(), has_ddgst);
        assert_eq!(hdr.data_digest_len(), if has_ddgst { 4 } else { 0 });
        if data.is_empty() {
            assert_eq!(ch.pdo(), 0);
        } else {
            let pdo = usize::from(ch.pdo());
            assert_eq!(&pdu[pdo..pdo + data.len()], data);
            if has_ddgst {
                assert_eq!(pdu[pdo + data.len()..], digest_bytes(data));
            }
        }
        pdu
    }

    #[test]
    fn ic_pdus_round_trip() {
        for d in ALL {
            let h = PduHeader::ic_req(5, d, 3);
            let pdu = whole(&h, &[], Digests::default(), 128);
            let r = IcReq::from_prefix(&pdu).unwrap();
            assert_eq!((r.pfv(), r.hpda(), r.maxr2t()), (0, 5, 3));
            assert_eq!((r.hdgst_enable(), r.ddgst_enable()), (d.header, d.data));

            let h = PduHeader::ic_resp(0, d, 65_536);
            let pdu = whole(&h, &[], Digests::default(), 128);
            let r = IcResp::from_prefix(&pdu).unwrap();
            assert_eq!((r.pfv(), r.cpda(), r.maxh2cdata()), (0, 0, 65_536));
            assert_eq!((r.hdgst_enable(), r.ddgst_enable()), (d.header, d.data));
        }
    }

    #[test]
    fn term_req_round_trip() {
        for ty in [PduType::H2cTermReq, PduType::C2hTermReq] {
            let h = PduHeader::term_req(ty, FatalErrorStatus::DataTransferOutOfRange, 77, 40);
            let mut pdu = h.as_bytes().to_vec();
            pdu.extend_from_slice(&[9; 40]);
            let t = TermReqHeader::from_prefix(&pdu).unwrap();
            assert_eq!(t.common().pdu_type(), Ok(ty));
            assert_eq!(t.common().plen() as usize, pdu.len());
            assert_eq!(
                (t.fes(), t.fei()),
                (Ok(FatalErrorStatus::DataTransferOutOfRange), 77)
            );
            assert_eq!(t.common().flags(), 0);
        }
    }

    #[test]
    fn capsule_pdus_round_trip() {
        let sqe: [u8; 64] = core::array::from_fn(|i| i as u8);
        let cqe: [u8; 16] = core::array::from_fn(|i| 0xF0 | i as u8);
        for d in ALL {
            for data in [&[][..], &[1, 2, 3, 4, 5][..]] {
                let h = PduHeader::capsule_cmd(d, 0, &sqe, data.len()).unwrap();
                let pdu = whole(&h, data, d, 72);
                assert_eq!(CapsuleCmdHeader::from_prefix(&pdu).unwrap().sqe(), &sqe);
                if !data.is_empty() {
                    assert_eq!(usize::from(pdu[3]), 72 + if d.header { 4 } else { 0 });
                }
            }
            let h = PduHeader::capsule_resp(d, &cqe);
            let pdu = whole(&h, &[], d, 24);
            assert_eq!(CapsuleRespHeader::from_prefix(&pdu).unwrap().cqe(), &cqe);
        }
    }

    #[test]
    fn data_pdus_round_trip() {
        let data: Vec<u8> = (0..300u32).map(|i| i as u8).collect();
        for d in ALL {
            for pda in [0u8, 3, 15, 31] {
                let h = PduHeader::h2c_data(d, pda, 1, 2, 4096, 300, true).unwrap();
                let pdu = whole(&h, &data, d, 24);
                assert_eq!(usize::from(pdu[3]) % pda_alignment(pda), 0);
                let x = H2cDataHeader::from_prefix(&pdu).unwrap();
                assert_eq!(
                    (x.cccid(), x.ttag(), x.datao(), x.datal()),
                    (1, 2, 4096, 300)
                );
                assert!(x.common().last_pdu());

                let h = PduHeader::c2h_data(d, pda, 3, 8192, 300, true, true).unwrap();
                let pdu = whole(&h, &data, d, 24);
                assert_eq!(usize::from(pdu[3]) % pda_alignment(pda), 0);
                let x = C2hDataHeader::from_prefix(&pdu).unwrap();
                assert_eq!((x.cccid(), x.datao(), x.datal()), (3, 8192, 300));
                assert!(x.common().last_pdu() && x.common().success());
            }
            let h = PduHeader::r2t(d, 4, 5, 12_000, 8000);
            let pdu = whole(&h, &[], d, 24);
            let x = R2tHeader::from_prefix(&pdu).unwrap();
            assert_eq!(
                (x.cccid(), x.ttag(), x.r2to(), x.r2tl()),
                (4, 5, 12_000, 8000)
            );
        }
    }

    #[test]
    fn encoder_refusals() {
        let d = Digests::default();
        assert_eq!(
            PduHeader::h2c_data(d, 0, 1, 1, 0, 0, true).unwrap_err(),
            SendError::EmptyData
        );
        assert_eq!(
            PduHeader::c2h_data(d, 0, 1, 0, 1, false, true).unwrap_err(),
            SendError::SuccessWithoutLast
        );
        assert_eq!(
            PduHeader::c2h_data(d, 0, 1, 0, u32::MAX, true, false).unwrap_err(),
            SendError::TooLarge
        );
        assert_eq!(pda_alignment(0), 4);
        assert_eq!(pda_alignment(31), 128);
        assert_eq!(pda_alignment(200), 128);
    }
}
