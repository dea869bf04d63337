//! Every fatal error path yields the right FES/FEI and a well-formed TermReq echoing the
//! offending header; non-fatal data digest errors are reported and the connection goes on.

mod common;

use common::*;
use nvme_spec::tcp::{
    CommonHeader, FatalErrorStatus as Fes, IcReq, IcResp, PduType, TermReqHeader, flags,
};
use nvmf_tcp::{
    ConfigError, Digests, HostConn, PduHeader, ProtocolError, SendError, TargetConfig, TargetConn,
    crc32c,
};

const NONE: Digests = Digests {
    header: false,
    data: false,
};
const HDGST: Digests = Digests {
    header: true,
    data: false,
};
const DDGST: Digests = Digests {
    header: false,
    data: true,
};

fn target(d: Digests) -> TargetConn {
    let mut t = TargetConn::new(target_config()).unwrap();
    t.feed(PduHeader::ic_req(0, d, 0).as_bytes());
    assert!(matches!(
        t.next_event().unwrap(),
        Some(nvmf_tcp::TargetEvent::Connected(_))
    ));
    take_target_tx(&mut t);
    t
}

fn host(d: Digests) -> HostConn {
    let mut h = HostConn::new(host_config(d));
    take_host_tx(&mut h);
    h.feed(PduHeader::ic_resp(0, d, 8192).as_bytes());
    assert!(matches!(
        h.next_event().unwrap(),
        Some(nvmf_tcp::HostEvent::Connected(_))
    ));
    h
}

/// Checks the TermReq at the front of `tx` and that it echoes the offending header: HLEN
/// bytes (at least 8, at most 128) of `offending`, as far as they had been received.
fn check_term_req(tx: &[u8], ty: PduType, err: &ProtocolError, offending: &[u8]) {
    assert!(err.term_req_queued);
    let hdr = TermReqHeader::from_prefix(tx).expect("a TermReq is queued");
    assert_eq!(hdr.common().pdu_type(), Ok(ty));
    assert_eq!(hdr.common().plen() as usize, tx.len());
    assert_eq!(hdr.fes(), Ok(err.fes));
    assert_eq!(hdr.fei(), err.fei);
    let hlen = usize::from(offending[2]).clamp(8, 128).min(offending.len());
    assert_eq!(&tx[24..], &offending[..hlen]);
}

/// Feeds `bytes` one at a time; the target must fail with `fes`/`fei` and queue a TermReq.
fn target_fails(t: &mut TargetConn, bytes: &[u8], fes: Fes, fei: u32) -> ProtocolError {
    assert!(t.pending_send().is_empty());
    let mut err = None;
    let mut fed = 0;
    for b in bytes {
        t.feed(std::slice::from_ref(b));
        fed += 1;
        loop {
            match t.next_event() {
                Ok(Some(_)) => continue,
                Ok(None) => break,
                Err(e) => {
                    err = Some(e);
                    break;
                }
            }
        }
        if err.is_some() {
            break;
        }
    }
    let err = err.expect("the target must report a protocol error");
    assert_eq!((err.fes, err.fei), (fes, fei), "{err}");
    check_term_req(t.pending_send(), PduType::C2hTermReq, &err, &bytes[..fed]);
    assert_eq!(t.next_event(), Err(err.clone()), "errors are sticky");
    assert!(t.is_closed());
    assert_eq!(t.send_capsule_resp(&cqe(0, 0)), Err(SendError::Closed));
    err
}

fn host_fails(h: &mut HostConn, bytes: &[u8], fes: Fes, fei: u32) -> ProtocolError {
    h.feed(bytes);
    let err = loop {
        match h.next_event() {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("the host must report a protocol error"),
            Err(e) => break e,
        }
    };
    assert_eq!((err.fes, err.fei), (fes, fei), "{err}");
    check_term_req(take_host_tx(h).as_slice(), PduType::H2cTermReq, &err, bytes);
    assert_eq!(h.next_event(), Err(err.clone()));
    assert!(h.is_closed());
    err
}

fn encode(hdr: PduHeader, data: &[u8]) -> Vec<u8> {
    let mut v = Vec::new();
    hdr.append_to(&mut v, data);
    v
}

fn capsule(d: Digests, cid: u16, data: &[u8]) -> Vec<u8> {
    encode(
        PduHeader::capsule_cmd(
            d,
            0,
            &sqe(0x01, cid, SGL_ICD, data.len() as u32),
            data.len(),
        )
        .unwrap(),
        data,
    )
}

fn h2c(d: Digests, cccid: u16, ttag: u16, datao: u32, data: &[u8], last: bool) -> Vec<u8> {
    encode(
        PduHeader::h2c_data(d, 0, cccid, ttag, datao, data.len() as u32, last).unwrap(),
        data,
    )
}

fn c2h(d: Digests, cccid: u16, datao: u32, data: &[u8], last: bool, success: bool) -> Vec<u8> {
    encode(
        PduHeader::c2h_data(d, 0, cccid, datao, data.len() as u32, last, success).unwrap(),
        data,
    )
}

fn set_u32(pdu: &mut [u8], off: usize, v: u32) {
    pdu[off..off + 4].copy_from_slice(&v.to_le_bytes());
}

/// Recomputes the header digest after a header was edited.
fn fix_hdgst(pdu: &mut [u8]) {
    let hlen = usize::from(pdu[2]);
    let d = crc32c(&pdu[..hlen]).to_le_bytes();
    pdu[hlen..hlen + 4].copy_from_slice(&d);
}

// ---------------------------------------------------------------------------------------
// Target side.

#[test]
fn target_first_pdu_must_be_icreq() {
    let mut t = TargetConn::new(target_config()).unwrap();
    target_fails(&mut t, &capsule(NONE, 1, &[]), Fes::PduSequenceError, 0);
}

#[test]
fn target_unknown_pdu_type() {
    let mut pdu = vec![0x08, 0, 24, 0, 24, 0, 0, 0];
    pdu.resize(24, 0);
    let mut t = TargetConn::new(target_config()).unwrap();
    target_fails(&mut t, &pdu, Fes::InvalidPduHeaderField, 0);
    pdu[0] = 0x0A;
    target_fails(&mut target(NONE), &pdu, Fes::InvalidPduHeaderField, 0);
    pdu[0] = 0xFF;
    target_fails(&mut target(HDGST), &pdu, Fes::InvalidPduHeaderField, 0);
}

#[test]
fn target_rejects_controller_to_host_pdus() {
    let resp = encode(PduHeader::capsule_resp(NONE, &cqe(1, 0)), &[]);
    target_fails(&mut target(NONE), &resp, Fes::InvalidPduHeaderField, 0);
    let r2t = encode(PduHeader::r2t(NONE, 1, 1, 0, 4), &[]);
    target_fails(
        &mut TargetConn::new(target_config()).unwrap(),
        &r2t,
        Fes::InvalidPduHeaderField,
        0,
    );
}

#[test]
fn target_icreq_validation() {
    let fresh = || TargetConn::new(target_config()).unwrap();
    let good = IcReq::new(0, false, false, 0);

    let mut r = good;
    r.set_pfv(1);
    target_fails(
        &mut fresh(),
        r.as_wire_bytes(),
        Fes::UnsupportedParameter,
        IcReq::OFFSET_PFV,
    );

    let hpda = IcReq::new(32, false, false, 0);
    target_fails(
        &mut fresh(),
        hpda.as_wire_bytes(),
        Fes::InvalidPduHeaderField,
        IcReq::OFFSET_HPDA,
    );

    let mut bytes = good.as_wire_bytes().to_vec();
    bytes[2] = 127;
    target_fails(
        &mut fresh(),
        &bytes,
        Fes::InvalidPduHeaderField,
        CommonHeader::OFFSET_HLEN,
    );

    let mut bytes = good.as_wire_bytes().to_vec();
    set_u32(&mut bytes, 4, 132);
    target_fails(
        &mut fresh(),
        &bytes,
        Fes::InvalidPduHeaderField,
        CommonHeader::OFFSET_PLEN,
    );

    let no_digests = TargetConfig {
        allow_digests: false,
        ..target_config()
    };
    let asks = IcReq::new(0, true, false, 0);
    let mut t = TargetConn::new(no_digests.clone()).unwrap();
    target_fails(
        &mut t,
        asks.as_wire_bytes(),
        Fes::UnsupportedParameter,
        IcReq::OFFSET_DGST,
    );
    // Without digests the same configuration connects.
    let mut t = TargetConn::new(no_digests).unwrap();
    t.feed(good.as_wire_bytes());
    assert!(t.next_event().unwrap().is_some());
    let resp = IcResp::from_prefix(t.pending_send()).unwrap();
    assert_eq!(
        (resp.pfv(), resp.cpda(), resp.dgst(), resp.maxh2cdata()),
        (0, 0, 0, 8192)
    );
}

#[test]
fn target_icresp_echoes_requested_digests() {
    for (h, d) in [(false, false), (true, false), (false, true), (true, true)] {
        let mut t = TargetConn::new(target_config()).unwrap();
        t.feed(IcReq::new(3, h, d, 5).as_wire_bytes());
        let Some(nvmf_tcp::TargetEvent::Connected(p)) = t.next_event().unwrap() else {
            panic!()
        };
        assert_eq!(
            (p.digests.header, p.digests.data, p.hpda, p.maxr2t),
            (h, d, 3, 5)
        );
        let resp = IcResp::from_prefix(t.pending_send()).unwrap();
        assert_eq!(
            (
                resp.hdgst_enable(),
                resp.ddgst_enable(),
                resp.cpda(),
                resp.pfv()
            ),
            (h, d, 0, 0)
        );
        assert_eq!(resp.common().plen(), 128);
    }
}

#[test]
fn target_second_icreq_is_a_sequence_error() {
    let icreq = PduHeader::ic_req(0, NONE, 0);
    target_fails(
        &mut target(NONE),
        icreq.as_bytes(),
        Fes::PduSequenceError,
        0,
    );
}

#[test]
fn target_bad_common_header_fields() {
    let good = capsule(NONE, 1, &[1, 2, 3, 4]);

    let mut p = good.clone();
    p[1] |= 0x80;
    target_fails(
        &mut target(NONE),
        &p,
        Fes::InvalidPduHeaderField,
        CommonHeader::OFFSET_FLAGS,
    );

    let mut p = good.clone();
    p[1] |= flags::HDGSTF;
    target_fails(
        &mut target(NONE),
        &p,
        Fes::InvalidPduHeaderField,
        CommonHeader::OFFSET_FLAGS,
    );

    // Data digest flag missing while data digests are on.
    target_fails(
        &mut target(DDGST),
        &good,
        Fes::InvalidPduHeaderField,
        CommonHeader::OFFSET_FLAGS,
    );

    let mut p = good.clone();
    p[2] = 70;
    target_fails(
        &mut target(NONE),
        &p,
        Fes::InvalidPduHeaderField,
        CommonHeader::OFFSET_HLEN,
    );

    for pdo in [0u8, 10, 74] {
        let mut p = good.clone();
        p[3] = pdo;
        target_fails(
            &mut target(NONE),
            &p,
            Fes::InvalidPduHeaderField,
            CommonHeader::OFFSET_PDO,
        );
    }

    let mut p = capsule(NONE, 1, &[]);
    set_u32(&mut p, 4, 50);
    target_fails(
        &mut target(NONE),
        &p,
        Fes::InvalidPduHeaderField,
        CommonHeader::OFFSET_PLEN,
    );

    // A data digest flag with no room for data and digest.
    let mut p = capsule(DDGST, 1, &[1, 2, 3, 4]);
    set_u32(&mut p, 4, 72 + 4);
    target_fails(
        &mut target(DDGST),
        &p,
        Fes::InvalidPduHeaderField,
        CommonHeader::OFFSET_PLEN,
    );
}

#[test]
fn target_header_digest_error() {
    let mut p = capsule(HDGST, 1, &[9; 8]);
    p[10] ^= 0xFF;
    let received = u32::from_le_bytes(p[72..76].try_into().unwrap());
    target_fails(&mut target(HDGST), &p, Fes::HeaderDigestError, received);
}

#[test]
fn target_in_capsule_data_limit() {
    let p = capsule(NONE, 1, &vec![0; 8196]);
    target_fails(&mut target(NONE), &p, Fes::DataTransferLimitExceeded, 0);
    // Exactly at the limit is fine.
    let mut t = target(NONE);
    t.feed(&capsule(NONE, 1, &vec![0; 8192]));
    assert!(
        matches!(t.next_event(), Ok(Some(nvmf_tcp::TargetEvent::Command { data, .. })) if data.len() == 8192)
    );
}

#[test]
fn target_commands_beyond_the_queue_size() {
    let mut t = target(NONE);
    t.set_queue_size(2);
    for cid in 1..=2 {
        t.feed(&capsule(NONE, cid, &[]));
        assert!(matches!(
            t.next_event(),
            Ok(Some(nvmf_tcp::TargetEvent::Command { .. }))
        ));
    }
    assert_eq!(t.outstanding_commands(), 2);
    // A completion queued but not sent yet still counts: the host has not seen it.
    t.send_capsule_resp(&cqe(1, 0)).unwrap();
    assert_eq!(t.outstanding_commands(), 2);
    let n = t.pending_send().len();
    t.consume_sent(n - 1);
    assert_eq!(t.outstanding_commands(), 2);
    t.consume_sent(1);
    assert_eq!(t.outstanding_commands(), 1);
    t.feed(&capsule(NONE, 3, &[]));
    assert!(matches!(
        t.next_event(),
        Ok(Some(nvmf_tcp::TargetEvent::Command { .. }))
    ));
    // A C2HData carrying SUCCESS is the completion of its command.
    t.send_c2h_data(2, 0, &[7; 16], true, true).unwrap();
    take_target_tx(&mut t);
    assert_eq!(t.outstanding_commands(), 1);
    t.feed(&capsule(NONE, 4, &[]));
    assert!(t.next_event().unwrap().is_some());
    // Two outstanding on a queue of two: the next command is refused.
    target_fails(&mut t, &capsule(NONE, 5, &[]), Fes::PduSequenceError, 0);
}

#[test]
fn target_buffered_commands_beyond_the_queue_size() {
    let mut t = target(NONE);
    t.set_queue_size(2);
    t.feed(&capsule(NONE, 1, &[]));
    assert!(t.next_event().unwrap().is_some());
    // Two more arrive while the caller is not handling PDUs: one fits, the other does not.
    let second = capsule(NONE, 2, &[]);
    let third = capsule(NONE, 3, &[8; 8]);
    t.feed(&second);
    assert_eq!(t.check_buffered_commands(), Ok(()));
    t.feed(&third);
    assert_eq!(t.buffered(), second.len() + third.len());
    let err = t.check_buffered_commands().unwrap_err();
    assert_eq!((err.fes, err.fei), (Fes::PduSequenceError, 0));
    check_term_req(t.pending_send(), PduType::C2hTermReq, &err, &third);
    assert!(t.is_closed());
}

#[test]
fn target_receive_buffer_grows_with_reads_and_shrinks_when_idle() {
    let mut t = TargetConn::new(TargetConfig {
        recv_buffer_size: 16384,
        ..target_config()
    })
    .unwrap();
    t.feed(PduHeader::ic_req(0, NONE, 0).as_bytes());
    assert!(t.next_event().unwrap().is_some());
    assert_eq!(t.recv_hint(1 << 20), 1024);
    assert!(t.recv_buf(1024).len() < 4096, "no room reserved up front");
    // Reads that fill what was asked double the next one, up to the configured size.
    t.set_queue_size(1 << 20);
    let stream: Vec<u8> = (0..1000).flat_map(|cid| capsule(NONE, cid, &[])).collect();
    let mut off = 0;
    for want in [2048, 4096, 8192, 16384, 16384] {
        let n = t.recv_hint(1 << 20);
        t.recv_buf(n)[..n].copy_from_slice(&stream[off..off + n]);
        t.commit_recv(n);
        off += n;
        assert_eq!(t.recv_hint(1 << 20), want);
        while let Ok(Some(_)) = t.next_event() {}
    }
    // A partial PDU is still buffered: nothing is given back.
    assert_ne!(off % 72, 0);
    t.release_buffers(0);
    assert_eq!(t.recv_hint(1 << 20), 16384);
    // Once it is complete and handled, the buffer returns to its first size.
    t.feed(&stream[off..off.next_multiple_of(72)]);
    while let Ok(Some(_)) = t.next_event() {}
    t.release_buffers(0);
    assert_eq!(t.recv_hint(1 << 20), 1024);
    assert!(t.recv_buf(1).len() < 16384);
}

/// A target with an outstanding R2T: command 4, tag 9, 8192 bytes at offset 0.
fn target_with_r2t(d: Digests) -> TargetConn {
    let mut t = target(d);
    t.send_r2t(4, 9, 0, 8192).unwrap();
    take_target_tx(&mut t);
    t
}

#[test]
fn target_h2c_sequencing_errors() {
    let data = vec![7u8; 4096];
    target_fails(
        &mut target(NONE),
        &h2c(NONE, 4, 9, 0, &data, false),
        Fes::InvalidPduHeaderField,
        10,
    );
    let t = &mut target_with_r2t(NONE);
    target_fails(
        t,
        &h2c(NONE, 4, 8, 0, &data, false),
        Fes::InvalidPduHeaderField,
        10,
    );
    let t = &mut target_with_r2t(NONE);
    target_fails(
        t,
        &h2c(NONE, 5, 9, 0, &data, false),
        Fes::InvalidPduHeaderField,
        8,
    );
    let t = &mut target_with_r2t(NONE);
    target_fails(
        t,
        &h2c(NONE, 4, 9, 8192, &data, true),
        Fes::DataTransferOutOfRange,
        0,
    );
    let t = &mut target_with_r2t(NONE);
    target_fails(
        t,
        &h2c(NONE, 4, 9, 6000, &data, true),
        Fes::DataTransferOutOfRange,
        0,
    );
    let t = &mut target_with_r2t(NONE);
    target_fails(
        t,
        &h2c(NONE, 4, 9, 4, &data[..100], false),
        Fes::PduSequenceError,
        0,
    );
    let t = &mut target_with_r2t(NONE);
    target_fails(
        t,
        &h2c(NONE, 4, 9, 0, &vec![0; 8196], true),
        Fes::DataTransferLimitExceeded,
        0,
    );
    // LAST_PDU early, and missing on the final PDU.
    let t = &mut target_with_r2t(NONE);
    target_fails(
        t,
        &h2c(NONE, 4, 9, 0, &data, true),
        Fes::InvalidPduHeaderField,
        1,
    );
    let t = &mut target_with_r2t(NONE);
    t.feed(&h2c(NONE, 4, 9, 0, &data, false));
    assert!(t.next_event().unwrap().is_some());
    target_fails(
        t,
        &h2c(NONE, 4, 9, 4096, &data, false),
        Fes::InvalidPduHeaderField,
        1,
    );
    // DATAL that disagrees with PLEN.
    let t = &mut target_with_r2t(NONE);
    let mut p = h2c(NONE, 4, 9, 0, &data, false);
    set_u32(&mut p, 16, 4000);
    target_fails(t, &p, Fes::InvalidPduHeaderField, 16);
    // After the R2T completed, more data for it is unexpected.
    let t = &mut target_with_r2t(HDGST);
    t.feed(&h2c(HDGST, 4, 9, 0, &vec![1; 8192], true));
    assert!(t.next_event().unwrap().is_some());
    assert_eq!(t.outstanding_r2ts(), 0);
    target_fails(
        t,
        &h2c(HDGST, 4, 9, 0, &data, false),
        Fes::InvalidPduHeaderField,
        10,
    );
}

#[test]
fn target_data_digest_errors_are_not_fatal() {
    let d = Digests {
        header: true,
        data: true,
    };
    let mut t = target_with_r2t(d);
    let mut p = capsule(d, 1, &[5; 64]);
    let n = p.len();
    p[n - 1] ^= 1;
    t.feed(&p);
    let ev: TEv = t.next_event().unwrap().unwrap().into();
    assert!(matches!(ev, TEv::CommandDigestError { sqe } if sqe[2] == 1));

    let mut p = h2c(d, 4, 9, 0, &[6; 4096], false);
    p[100] ^= 0x10;
    t.feed(&p);
    let ev: TEv = t.next_event().unwrap().unwrap().into();
    assert_eq!(
        ev,
        TEv::H2cDigestError {
            cccid: 4,
            ttag: 9,
            datao: 0,
            datal: 4096,
            last: false
        }
    );
    // The transfer continues where the bad PDU ended.
    t.feed(&h2c(d, 4, 9, 4096, &[6; 4096], true));
    let ev: TEv = t.next_event().unwrap().unwrap().into();
    assert!(matches!(
        ev,
        TEv::H2c {
            datao: 4096,
            last: true,
            ..
        }
    ));
    t.feed(&capsule(d, 2, &[5; 64]));
    assert!(matches!(
        t.next_event().unwrap(),
        Some(nvmf_tcp::TargetEvent::Command { .. })
    ));
    assert!(t.pending_send().is_empty());
}

#[test]
fn target_term_req_from_host() {
    let mut t = target(HDGST);
    let offending = [0xAAu8; 30];
    let mut p = PduHeader::term_req(PduType::H2cTermReq, Fes::PduSequenceError, 0, 30)
        .as_bytes()
        .to_vec();
    p.extend_from_slice(&offending);
    let ev = to_target(&mut t, &p, &mut |_| 1);
    assert_eq!(
        ev,
        vec![TEv::TermReq {
            fes: 2,
            fei: 0,
            data: offending.to_vec()
        }]
    );
    assert!(t.is_closed());
    t.feed(&capsule(HDGST, 1, &[]));
    assert_eq!(t.next_event(), Ok(None));
    assert!(t.pending_send().is_empty());

    // A TermReq before the ICReq is accepted too.
    let mut t = TargetConn::new(target_config()).unwrap();
    let ev = to_target(&mut t, &p, &mut |n| n);
    assert_eq!(ev.len(), 1);
}

#[test]
fn target_malformed_term_req_closes_silently() {
    for plen in [20u32, 153, 4096] {
        let mut t = target(NONE);
        let mut p = PduHeader::term_req(PduType::H2cTermReq, Fes::PduSequenceError, 0, 0)
            .as_bytes()
            .to_vec();
        set_u32(&mut p, 4, plen);
        t.feed(&p);
        let err = t.next_event().unwrap_err();
        assert!(!err.term_req_queued);
        assert!(t.pending_send().is_empty());
        assert!(t.is_closed());
    }
}

#[test]
fn target_send_side_checks() {
    let mut t = TargetConn::new(target_config()).unwrap();
    assert_eq!(
        t.send_capsule_resp(&cqe(1, 0)),
        Err(SendError::NotEstablished)
    );
    let mut t = target(NONE);
    assert_eq!(
        t.send_c2h_data(1, 0, &[], true, false),
        Err(SendError::EmptyData)
    );
    assert_eq!(
        t.send_c2h_data(1, 0, &[1], false, true),
        Err(SendError::SuccessWithoutLast)
    );
    assert_eq!(
        t.send_c2h_data(1, u32::MAX, &[1, 2], true, false),
        Err(SendError::TooLarge)
    );
    assert_eq!(t.send_r2t(1, 1, 0, 0), Err(SendError::EmptyData));
    t.send_r2t(1, 1, 0, 4096).unwrap();
    assert_eq!(t.send_r2t(2, 1, 0, 4096), Err(SendError::TagInUse(1)));
    // MAXR2T is 0: one outstanding R2T per command.
    assert_eq!(t.send_r2t(1, 2, 4096, 4096), Err(SendError::R2tLimit(1)));
    assert!(t.cancel_r2t(1));
    t.send_r2t(1, 2, 4096, 4096).unwrap();
    assert_eq!(t.outstanding_r2ts(), 1);

    assert_eq!(
        TargetConn::new(TargetConfig {
            maxh2cdata: 4095,
            ..target_config()
        })
        .unwrap_err(),
        ConfigError::MaxH2cData(4095)
    );
    assert_eq!(
        TargetConn::new(TargetConfig {
            maxh2cdata: 4098,
            ..target_config()
        })
        .unwrap_err(),
        ConfigError::MaxH2cData(4098)
    );
    assert_eq!(
        TargetConn::new(TargetConfig {
            max_c2h_data: 0,
            ..target_config()
        })
        .unwrap_err(),
        ConfigError::MaxC2hData
    );
}

#[test]
fn target_c2h_split_and_alignment() {
    // HPDA 3 asks for 16-byte data alignment: PDO 32 instead of 24.
    let mut t = TargetConn::new(target_config()).unwrap();
    t.feed(PduHeader::ic_req(3, NONE, 0).as_bytes());
    t.next_event().unwrap();
    take_target_tx(&mut t);
    t.send_c2h_data(7, 0, &[1; 10_000], true, true).unwrap();
    let tx = take_target_tx(&mut t);
    let mut off = 0;
    let mut pdus = Vec::new();
    while off < tx.len() {
        let ch = CommonHeader::from_prefix(&tx[off..]).unwrap();
        assert_eq!(ch.pdo(), 32);
        pdus.push((ch.plen() - 32, ch.last_pdu(), ch.success()));
        off += ch.plen() as usize;
    }
    assert_eq!(
        pdus,
        vec![
            (4096, false, false),
            (4096, false, false),
            (1808, true, true)
        ]
    );
    let hdr = t.c2h_data_header(7, 0, 100, true, false).unwrap();
    assert_eq!(hdr.as_bytes().len(), 32);
    assert_eq!(hdr.plen(), 132);
}

// ---------------------------------------------------------------------------------------
// Host side.

#[test]
fn host_icresp_validation_matches_linux() {
    let fresh = |d: Digests| {
        let mut h = HostConn::new(host_config(d));
        take_host_tx(&mut h);
        h
    };
    let good = IcResp::new(0, false, false, 8192);

    let mut bytes = good.as_wire_bytes().to_vec();
    set_u32(&mut bytes, 4, 132);
    host_fails(
        &mut fresh(NONE),
        &bytes,
        Fes::InvalidPduHeaderField,
        CommonHeader::OFFSET_PLEN,
    );

    let mut bytes = good.as_wire_bytes().to_vec();
    bytes[2] = 100;
    host_fails(
        &mut fresh(NONE),
        &bytes,
        Fes::InvalidPduHeaderField,
        CommonHeader::OFFSET_HLEN,
    );

    let mut r = good;
    r.set_pfv(1);
    host_fails(
        &mut fresh(NONE),
        r.as_wire_bytes(),
        Fes::UnsupportedParameter,
        IcResp::OFFSET_PFV,
    );

    let mut r = good;
    r.set_cpda(1);
    host_fails(
        &mut fresh(NONE),
        r.as_wire_bytes(),
        Fes::UnsupportedParameter,
        IcResp::OFFSET_CPDA,
    );
    r.set_cpda(32);
    host_fails(
        &mut fresh(NONE),
        r.as_wire_bytes(),
        Fes::InvalidPduHeaderField,
        IcResp::OFFSET_CPDA,
    );

    // Digests granted that were not asked for, and asked for but not granted.
    let granted = IcResp::new(0, true, false, 8192);
    host_fails(
        &mut fresh(NONE),
        granted.as_wire_bytes(),
        Fes::InvalidPduHeaderField,
        IcResp::OFFSET_DGST,
    );
    host_fails(
        &mut fresh(DDGST),
        good.as_wire_bytes(),
        Fes::InvalidPduHeaderField,
        IcResp::OFFSET_DGST,
    );

    for max in [0u32, 1024, 4092, 4098] {
        let mut r = good;
        r.set_maxh2cdata(max);
        host_fails(
            &mut fresh(NONE),
            r.as_wire_bytes(),
            Fes::InvalidPduHeaderField,
            IcResp::OFFSET_MAXH2CDATA,
        );
    }

    let resp = encode(PduHeader::capsule_resp(NONE, &cqe(1, 0)), &[]);
    host_fails(&mut fresh(NONE), &resp, Fes::PduSequenceError, 0);
    let icreq = PduHeader::ic_req(0, NONE, 0);
    host_fails(
        &mut fresh(NONE),
        icreq.as_bytes(),
        Fes::InvalidPduHeaderField,
        0,
    );
}

#[test]
fn host_rejects_host_to_controller_and_unknown_pdus() {
    host_fails(
        &mut host(NONE),
        &capsule(NONE, 1, &[]),
        Fes::InvalidPduHeaderField,
        0,
    );
    let mut pdu = vec![0x0B, 0, 24, 0, 24, 0, 0, 0];
    pdu.resize(24, 0);
    host_fails(&mut host(NONE), &pdu, Fes::InvalidPduHeaderField, 0);
    let again = PduHeader::ic_resp(0, NONE, 8192);
    host_fails(&mut host(NONE), again.as_bytes(), Fes::PduSequenceError, 0);
}

/// A host with a read (cid 1, 8192 bytes) and a write (cid 2, 8192 bytes) outstanding.
fn host_with_commands(d: Digests) -> HostConn {
    let mut h = host(d);
    h.send_capsule_cmd(&sqe(0x02, 1, SGL_TCP, 8192), &[])
        .unwrap();
    h.send_capsule_cmd(&sqe(0x01, 2, SGL_TCP, 8192), &[])
        .unwrap();
    take_host_tx(&mut h);
    h
}

#[test]
fn host_capsule_resp_for_unknown_command() {
    let p = encode(PduHeader::capsule_resp(NONE, &cqe(9, 0)), &[]);
    host_fails(
        &mut host_with_commands(NONE),
        &p,
        Fes::InvalidPduHeaderField,
        20,
    );
}

#[test]
fn host_c2h_errors() {
    let data = [3u8; 4096];
    let h = &mut host_with_commands(NONE);
    host_fails(
        h,
        &c2h(NONE, 7, 0, &data, false, false),
        Fes::InvalidPduHeaderField,
        8,
    );
    let h = &mut host_with_commands(NONE);
    host_fails(
        h,
        &c2h(NONE, 2, 0, &data, false, false),
        Fes::PduSequenceError,
        0,
    );
    let h = &mut host_with_commands(NONE);
    host_fails(
        h,
        &c2h(NONE, 1, 8000, &data, true, false),
        Fes::DataTransferOutOfRange,
        0,
    );
    let h = &mut host_with_commands(NONE);
    host_fails(
        h,
        &c2h(NONE, 1, 4, &data, false, false),
        Fes::PduSequenceError,
        0,
    );
    let h = &mut host_with_commands(NONE);
    let mut p = c2h(NONE, 1, 0, &data, false, false);
    p[1] |= flags::SUCCESS;
    host_fails(h, &p, Fes::InvalidPduHeaderField, 1);
    let h = &mut host_with_commands(NONE);
    let mut p = c2h(NONE, 1, 0, &data, false, false);
    set_u32(&mut p, 16, 100);
    host_fails(h, &p, Fes::InvalidPduHeaderField, 16);
    // Data after the LAST_PDU.
    let h = &mut host_with_commands(NONE);
    h.feed(&c2h(NONE, 1, 0, &data, true, false));
    assert!(h.next_event().unwrap().is_some());
    host_fails(
        h,
        &c2h(NONE, 1, 4096, &data, false, false),
        Fes::PduSequenceError,
        0,
    );
    // Data after SUCCESS: the command is complete.
    let h = &mut host_with_commands(NONE);
    h.feed(&c2h(NONE, 1, 0, &[1; 8192], true, true));
    while h.next_event().unwrap().is_some() {}
    assert_eq!(h.outstanding_commands(), 1);
    host_fails(
        h,
        &c2h(NONE, 1, 0, &data, false, false),
        Fes::InvalidPduHeaderField,
        8,
    );
}

#[test]
fn host_r2t_errors() {
    let r2t = |cccid, ttag, r2to, r2tl| encode(PduHeader::r2t(NONE, cccid, ttag, r2to, r2tl), &[]);
    host_fails(
        &mut host_with_commands(NONE),
        &r2t(7, 1, 0, 4096),
        Fes::InvalidPduHeaderField,
        8,
    );
    host_fails(
        &mut host_with_commands(NONE),
        &r2t(2, 1, 0, 0),
        Fes::InvalidPduHeaderField,
        16,
    );
    host_fails(
        &mut host_with_commands(NONE),
        &r2t(1, 1, 0, 4096),
        Fes::PduSequenceError,
        0,
    );
    host_fails(
        &mut host_with_commands(NONE),
        &r2t(2, 1, 4096, 8192),
        Fes::DataTransferOutOfRange,
        0,
    );
    host_fails(
        &mut host_with_commands(NONE),
        &r2t(2, 1, 4096, 4096),
        Fes::PduSequenceError,
        0,
    );
    let h = &mut host_with_commands(NONE);
    h.feed(&r2t(2, 1, 0, 4096));
    assert!(h.next_event().unwrap().is_some());
    host_fails(h, &r2t(2, 2, 4096, 4096), Fes::R2T_LIMIT_EXCEEDED, 0);
}

#[test]
fn host_header_digest_error() {
    let mut p = encode(PduHeader::capsule_resp(HDGST, &cqe(1, 0)), &[]);
    p[24] ^= 0x55;
    let received = u32::from_le_bytes(p[24..28].try_into().unwrap());
    host_fails(
        &mut host_with_commands(HDGST),
        &p,
        Fes::HeaderDigestError,
        received,
    );
    // The same header with its digest recomputed is accepted.
    let mut p = encode(PduHeader::capsule_resp(HDGST, &cqe(1, 0)), &[]);
    p[8] = 1;
    fix_hdgst(&mut p);
    let mut h = host_with_commands(HDGST);
    h.feed(&p);
    assert!(h.next_event().unwrap().is_some());
}

#[test]
fn host_data_digest_error_is_not_fatal() {
    let d = Digests {
        header: true,
        data: true,
    };
    let mut h = host_with_commands(d);
    let mut p = c2h(d, 1, 0, &[4; 8192], true, true);
    let n = p.len();
    p[n - 10] ^= 0x80;
    let ev = to_host(&mut h, &p, &mut |_| 1000);
    assert!(ev[..ev.len() - 1].iter().all(|e| matches!(
        e,
        HEv::C2h {
            last: false,
            success: false,
            ..
        }
    )));
    assert_eq!(
        ev.last(),
        Some(&HEv::C2hDigestError {
            cccid: 1,
            last: true,
            success: true
        })
    );
    assert_eq!(h.outstanding_commands(), 1);
    let ok = encode(PduHeader::capsule_resp(d, &cqe(2, 0)), &[]);
    assert_eq!(
        to_host(&mut h, &ok, &mut |n| n),
        vec![HEv::CapsuleResp { cqe: cqe(2, 0) }]
    );
}

#[test]
fn host_term_req_from_controller() {
    let mut h = host_with_commands(NONE);
    let p = PduHeader::term_req(PduType::C2hTermReq, Fes::HeaderDigestError, 0x1234, 0)
        .as_bytes()
        .to_vec();
    assert_eq!(
        to_host(&mut h, &p, &mut |n| n),
        vec![HEv::TermReq {
            fes: 3,
            fei: 0x1234,
            data: vec![]
        }]
    );
    assert!(h.is_closed());
    assert_eq!(
        h.send_capsule_cmd(&sqe(0, 3, 0, 0), &[]),
        Err(SendError::Closed)
    );
}

#[test]
fn host_send_side_checks() {
    let mut h = HostConn::new(host_config(NONE));
    assert_eq!(
        h.send_capsule_cmd(&sqe(0, 1, 0, 0), &[]),
        Err(SendError::NotEstablished)
    );
    let mut h = host_with_commands(NONE);
    assert_eq!(
        h.send_capsule_cmd(&sqe(0, 1, 0, 0), &[]),
        Err(SendError::CommandIdInUse(1))
    );
    assert_eq!(
        h.send_h2c_data(2, 1, 0, &[1; 4], true),
        Err(SendError::NoMatchingR2t { cccid: 2, ttag: 1 })
    );
    h.feed(&encode(PduHeader::r2t(NONE, 2, 1, 0, 4096), &[]));
    assert!(h.next_event().unwrap().is_some());
    assert_eq!(
        h.send_h2c_data(2, 2, 0, &[1; 4], false),
        Err(SendError::NoMatchingR2t { cccid: 2, ttag: 2 })
    );
    assert_eq!(
        h.send_h2c_data(2, 1, 4, &[1; 4], false),
        Err(SendError::OutOfOrder {
            datao: 4,
            expected: 0
        })
    );
    assert_eq!(
        h.send_h2c_data(2, 1, 0, &[1; 4100], true),
        Err(SendError::OutOfRange)
    );
    assert_eq!(
        h.send_h2c_data(2, 1, 0, &[1; 4096], false),
        Err(SendError::LastMismatch)
    );
    assert_eq!(
        h.send_h2c_data(2, 1, 0, &[1; 4], true),
        Err(SendError::LastMismatch)
    );
    assert_eq!(
        h.send_h2c_data(2, 1, 0, &[], false),
        Err(SendError::EmptyData)
    );
    assert!(h.pending_send().is_empty());
    h.send_h2c_data(2, 1, 0, &[1; 4096], true).unwrap();
    assert_eq!(
        h.send_h2c_data(2, 1, 4096, &[1; 4], true),
        Err(SendError::NoMatchingR2t { cccid: 2, ttag: 1 })
    );
    assert!(h.forget_command(2));
    assert!(!h.forget_command(2));
}
