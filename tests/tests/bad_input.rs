//! Bad input against a real `nvmeof-targetd`: malformed and out-of-order PDUs, wrong digests,
//! refused Connects, invalid I/O. Each gets the right NVMe status, or a C2HTermReq and a closed
//! connection; the daemon keeps serving others and loses nothing it acknowledged.

use nvme_spec::command::build;
use nvme_spec::status::{generic, sct, specific};
use nvme_spec::{Cqe, SglDescriptor, Sqe, Status};
use nvmeof_tests::{RawHost, Reply, TEST_HOSTNQN, TargetProcess};
use nvmf_tcp::{Digests, PduHeader};

const NQN: &str = "nqn.2026-11.io.nvmeof-direct:bad-input";

fn status(r: Reply) -> Status {
    match r {
        Reply::Completion(c, _) => c.status(),
        other => panic!("expected a completion, got {other:?}"),
    }
}

fn read_sqe(cid: u16, nsid: u32, slba: u64, nlb: u32, bs: u32) -> Sqe {
    let mut sqe = build::read_write(false, cid, nsid, slba, nlb);
    sqe.dptr = SglDescriptor::tcp_transport(nlb * bs);
    sqe
}

fn write(h: &mut RawHost, cid: u16, slba: u64, data: &[u8]) -> Status {
    let mut sqe = build::read_write(true, cid, 1, slba, (data.len() / 4096) as u32);
    if data.len() <= 8192 {
        sqe.dptr = SglDescriptor::in_capsule(data.len() as u32);
        status(h.command(&sqe, data, &[]))
    } else {
        sqe.dptr = SglDescriptor::tcp_transport(data.len() as u32);
        status(h.command(&sqe, &[], data))
    }
}

fn read(h: &mut RawHost, cid: u16, slba: u64, nlb: u32) -> Vec<u8> {
    match h.command(&read_sqe(cid, 1, slba, nlb, 4096), &[], &[]) {
        Reply::Completion(c, d) => {
            assert!(c.status().is_success(), "read: {}", c.status());
            d
        }
        Reply::DataSuccess(d) => d,
        other => panic!("read: {other:?}"),
    }
}

/// The type byte of the first PDU in `bytes`.
fn first_pdu_type(bytes: &[u8]) -> Option<u8> {
    bytes.first().copied()
}

fn fes_of_term_req(bytes: &[u8]) -> u16 {
    // C2HTermReq: CH (8) then FES (2 bytes).
    assert_eq!(
        bytes.first(),
        Some(&0x03),
        "expected a C2HTermReq, got {bytes:02x?}"
    );
    u16::from_le_bytes([bytes[8], bytes[9]])
}

#[test]
fn capsule_before_icreq_is_terminated() {
    let t = TargetProcess::quick(NQN, &["mem:16M"]);
    let mut s = RawHost::tcp(t.addr());
    let sqe = build::flush(1, 1).to_array();
    let mut pdu = Vec::new();
    PduHeader::capsule_cmd(Digests::default(), 0, &sqe, 0)
        .unwrap()
        .append_to(&mut pdu, &[]);
    RawHost::send_raw(&mut s, &pdu);
    let got = RawHost::read_to_close(&mut s);
    assert_eq!(fes_of_term_req(&got), 0x02, "PDU sequence error");
}

#[test]
fn malformed_icreq_and_unknown_pdu_type_are_terminated() {
    let t = TargetProcess::quick(NQN, &["mem:16M"]);
    // ICReq with a wrong header length.
    let mut s = RawHost::tcp(t.addr());
    let mut icreq = vec![0u8; 128];
    icreq[0] = 0x00;
    icreq[2] = 64; // hlen must be 128
    icreq[4..8].copy_from_slice(&128u32.to_le_bytes());
    RawHost::send_raw(&mut s, &icreq);
    let got = RawHost::read_to_close(&mut s);
    assert_eq!(fes_of_term_req(&got), 0x01, "invalid header field");
    // A reserved PDU type after a good ICReq.
    let mut h = RawHost::connect(t.addr(), false, false);
    let mut junk = vec![0u8; 24];
    junk[0] = 0x0F;
    junk[2] = 24;
    junk[4..8].copy_from_slice(&24u32.to_le_bytes());
    RawHost::send_raw(&mut h.stream, &junk);
    let got = RawHost::read_to_close(&mut h.stream);
    assert_eq!(first_pdu_type(&got), Some(0x03));
}

#[test]
fn wrong_header_digest_is_terminated_wrong_data_digest_fails_the_command() {
    let t = TargetProcess::quick(NQN, &["mem:16M"]);
    let (mut admin, cntlid) = RawHost::admin(t.addr(), NQN);
    // Header digest error: fatal.
    let mut h = RawHost::connect(t.addr(), true, true);
    let sqe = build::keep_alive(9).to_array();
    let mut pdu = Vec::new();
    PduHeader::capsule_cmd(
        Digests {
            header: true,
            data: true,
        },
        0,
        &sqe,
        0,
    )
    .unwrap()
    .append_to(&mut pdu, &[]);
    let n = pdu.len();
    pdu[n - 1] ^= 0xFF;
    RawHost::send_raw(&mut h.stream, &pdu);
    let got = RawHost::read_to_close(&mut h.stream);
    assert_eq!(fes_of_term_req(&got), 0x03, "header digest error");

    // Data digest error on in-capsule data: Transient Transport Error, connection lives on.
    let mut io = RawHost::connect(t.addr(), true, true);
    let c = io.fabrics_connect(NQN, TEST_HOSTNQN, 1, cntlid);
    assert!(c.status().is_success());
    let data = vec![0xA5u8; 4096];
    let mut w = build::read_write(true, 5, 1, 0, 1);
    w.dptr = SglDescriptor::in_capsule(4096);
    let mut pdu = Vec::new();
    PduHeader::capsule_cmd(
        Digests {
            header: true,
            data: true,
        },
        0,
        &w.to_array(),
        4096,
    )
    .unwrap()
    .append_to(&mut pdu, &data);
    let n = pdu.len();
    pdu[n - 1] ^= 0xFF; // corrupt the data digest
    // Keep the engine's bookkeeping in step: it never saw this command.
    RawHost::send_raw(&mut io.stream, &pdu);
    let mut buf = [0u8; 64];
    std::io::Read::read_exact(&mut io.stream, &mut buf[..28]).unwrap();
    assert_eq!(buf[0], 0x05, "CapsuleResp");
    let cqe = Cqe::from_array(buf[8..24].try_into().unwrap());
    assert_eq!(
        cqe.status(),
        Status::generic(generic::TRANSIENT_TRANSPORT_ERROR)
    );
    // The admin queue still works.
    assert!(status(admin.command(&build::keep_alive(20), &[], &[])).is_success());
}

#[test]
fn refused_connects() {
    let port = nvmeof_tests::free_port();
    let listen = format!("tcp://127.0.0.1:{port}");
    let t = TargetProcess::spawn(
        &[
            "--listen",
            &listen,
            "--subsystem",
            NQN,
            "--namespace",
            "mem:16M",
            "--host",
            "nqn.2014-08.org.example:someone-else",
        ],
        port,
    );
    let mut h = RawHost::connect(t.addr(), false, false);
    let c = h.fabrics_connect("nqn.2026-11.io.nvmeof-direct:nope", TEST_HOSTNQN, 0, 0xFFFF);
    assert_eq!(
        c.status(),
        Status::specific(specific::CONNECT_INVALID_PARAMETERS).with_dnr()
    );
    assert_eq!(c.dw0.get(), 1 | (256 << 16), "IATTR data, IPO subnqn");
    let mut h = RawHost::connect(t.addr(), false, false);
    let c = h.fabrics_connect(NQN, TEST_HOSTNQN, 0, 0xFFFF);
    assert_eq!(
        c.status(),
        Status::specific(specific::CONNECT_INVALID_HOST).with_dnr()
    );
    // A host without a host NQN (SPDK's tools send none unless told) is not on the list either;
    // a malformed one is an invalid parameter.
    let mut h = RawHost::connect(t.addr(), false, false);
    let c = h.fabrics_connect(NQN, "", 0, 0xFFFF);
    assert_eq!(
        c.status(),
        Status::specific(specific::CONNECT_INVALID_HOST).with_dnr()
    );
    let mut h = RawHost::connect(t.addr(), false, false);
    let c = h.fabrics_connect(NQN, "not an nqn", 0, 0xFFFF);
    assert_eq!(
        c.status(),
        Status::specific(specific::CONNECT_INVALID_PARAMETERS).with_dnr()
    );
    assert_eq!(c.dw0.get(), 1 | (512 << 16), "IATTR data, IPO hostnqn");
    // An I/O queue for a controller that does not exist.
    let mut h = RawHost::connect(t.addr(), false, false);
    let c = h.fabrics_connect(NQN, "nqn.2014-08.org.example:someone-else", 1, 77);
    assert_eq!(c.status().sct, sct::COMMAND_SPECIFIC);
    assert_eq!(c.status().sc, specific::CONNECT_INVALID_PARAMETERS);
    // Commands before Connect.
    let mut h = RawHost::connect(t.addr(), false, false);
    assert_eq!(
        status(h.command(&build::keep_alive(3), &[], &[])),
        Status::generic(generic::COMMAND_SEQUENCE_ERROR).with_dnr()
    );
}

#[test]
fn invalid_io_gets_status_and_nothing_is_lost() {
    let t = TargetProcess::quick(NQN, &["mem:16M"]);
    let (mut admin, cntlid) = RawHost::admin(t.addr(), NQN);
    let mut io = RawHost::io_queue(t.addr(), NQN, cntlid, 1);
    let blocks = 16 * 256;
    // Acknowledged data: in-capsule and through R2T.
    let small: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8).collect();
    let big: Vec<u8> = (0..256 * 1024u32).map(|i| (i % 241) as u8).collect();
    assert!(write(&mut io, 1, 10, &small).is_success());
    assert!(write(&mut io, 2, 100, &big).is_success());

    let dnr = |sc| Status::generic(sc).with_dnr();
    // LBA out of range.
    assert_eq!(
        status(io.command(&read_sqe(3, 1, blocks - 1, 2, 4096), &[], &[])),
        dnr(generic::LBA_OUT_OF_RANGE)
    );
    // Oversized transfer (MDTS is 1 MiB).
    assert_eq!(
        status(io.command(&read_sqe(4, 1, 0, 512, 4096), &[], &[])),
        dnr(generic::INVALID_FIELD)
    );
    // Unknown namespace.
    assert_eq!(
        status(io.command(&read_sqe(5, 9, 0, 1, 4096), &[], &[])),
        dnr(generic::INVALID_NAMESPACE)
    );
    // SGL length that does not match the block count.
    assert_eq!(
        status(io.command(&read_sqe(6, 1, 0, 2, 512), &[], &[])),
        dnr(generic::DATA_SGL_LENGTH_INVALID)
    );
    // Unknown I/O and admin opcodes.
    let mut unk = build::flush(7, 1);
    unk.opcode = 0x99;
    assert_eq!(
        status(io.command(&unk, &[], &[])),
        dnr(generic::INVALID_OPCODE)
    );
    let mut unk = build::keep_alive(8);
    unk.opcode = 0xC5;
    assert_eq!(
        status(admin.command(&unk, &[], &[])),
        dnr(generic::INVALID_OPCODE)
    );
    // Unknown log page, invalid identify CNS.
    let glp = build::get_log_page(9, 0x42, 0, 512, 0);
    assert_eq!(
        status(admin.command(&glp, &[], &[])),
        Status::specific(specific::INVALID_LOG_PAGE).with_dnr()
    );
    // H2CData for which no R2T was sent: fatal for that connection only.
    let mut rogue = RawHost::io_queue(t.addr(), NQN, cntlid, 2);
    let mut pdu = Vec::new();
    PduHeader::h2c_data(Digests::default(), 0, 1, 0, 0, 4096, true)
        .unwrap()
        .append_to(&mut pdu, &[0u8; 4096]);
    RawHost::send_raw(&mut rogue.stream, &pdu);
    let got = RawHost::read_to_close(&mut rogue.stream);
    assert_eq!(first_pdu_type(&got), Some(0x03), "C2HTermReq");

    // Everything acknowledged is still there, on the surviving connection.
    assert_eq!(read(&mut io, 10, 10, 2), small);
    assert_eq!(read(&mut io, 11, 100, 64), big);
    // The error log recorded the failures.
    let mut glp = build::get_log_page(12, 0x01, 0, 4096, 0);
    glp.dptr = SglDescriptor::tcp_transport(4096);
    match admin.command(&glp, &[], &[]) {
        Reply::Completion(c, d) => {
            assert!(c.status().is_success());
            let count = u64::from_le_bytes(d[0..8].try_into().unwrap());
            assert!(count >= 5, "error count {count}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn empty_host_nqn_reaches_open_subsystems() {
    // SPDK's host tools send an empty host NQN unless told otherwise; Linux nvmet and SPDK's
    // target accept it where any host may connect, and so do we.
    let t = TargetProcess::quick(NQN, &["mem:16M"]);
    let mut h = RawHost::connect(t.addr(), false, false);
    let c = h.fabrics_connect(NQN, "", 0, 0xFFFF);
    assert!(c.status().is_success(), "{}", c.status());
}
