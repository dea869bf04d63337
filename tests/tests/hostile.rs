//! A hostile host against the `nvmeof-targetd` process: commands past the queue size from a
//! host that never reads its socket (I/O reads on memory and file namespaces, discovery log
//! pages), the same I/O queue connected twice, keep alive switched off, I/O after a shutdown,
//! duplicate command identifiers and fields the specification reserves, several queues that
//! together would overrun the daemon's memory budget. The daemon's memory must stay bounded
//! and every case must get the specification's answer.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use nvme_spec::command::build;
use nvme_spec::fabrics::{Cc, ConnectData, DISCOVERY_NQN, csts, property};
use nvme_spec::status::generic;
use nvme_spec::{Cqe, FabricsCommand, IntoBytes, SglDescriptor, Sqe, Status, features};
use nvmeof_tests::{
    RawHost, Reply, TEST_HOSTNQN, TargetProcess, free_port, raise_open_files_limit,
};
use nvmf_tcp::{Digests, PduHeader};

const NQN: &str = "nqn.2026-11.io.nvmeof-direct:hostile";
const MIB: u32 = 1 << 20;
/// Commands the hostile host sends in one burst, on a queue of size 32.
const BURST: u16 = 1024;
/// How much the daemon may grow while it works through a burst: a connection holds at most
/// its 8 MiB send backlog, one command's data and the buffers of the commands running (32 of
/// 1 MiB at most on a file namespace); the unbounded daemon grew by a GiB.
const BURST_GROWTH_KIB: u64 = 64 * 1024;

/// A CapsuleCmd PDU carrying `sqe` and `icd` (no digests).
fn capsule(sqe: &Sqe, icd: &[u8]) -> Vec<u8> {
    let hdr = PduHeader::capsule_cmd(Digests::default(), 0, &sqe.to_array(), icd.len())
        .expect("capsule header");
    let mut pdu = Vec::new();
    hdr.append_to(&mut pdu, icd);
    pdu
}

/// Reads one whole PDU.
fn read_pdu(s: &mut TcpStream) -> Vec<u8> {
    let mut pdu = vec![0u8; 8];
    s.read_exact(&mut pdu).expect("PDU header");
    let plen = u32::from_le_bytes(pdu[4..8].try_into().unwrap()) as usize;
    pdu.resize(plen, 0);
    s.read_exact(&mut pdu[8..]).expect("PDU");
    pdu
}

/// The CQE of a CapsuleResp PDU.
fn cqe_of(pdu: &[u8]) -> Cqe {
    assert_eq!(
        pdu[0], 0x05,
        "CapsuleResp expected, got PDU type {:#x}",
        pdu[0]
    );
    Cqe::from_array(pdu[8..24].try_into().unwrap())
}

/// The last whole PDU in `bytes`, a stream of PDUs.
fn last_pdu(bytes: &[u8]) -> Option<&[u8]> {
    let mut off = 0;
    let mut last = None;
    while bytes.len() >= off + 8 {
        let plen = u32::from_le_bytes(bytes[off + 4..off + 8].try_into().unwrap()) as usize;
        if plen < 8 || bytes.len() < off + plen {
            break;
        }
        last = Some(&bytes[off..off + plen]);
        off += plen;
    }
    last
}

/// A read of `len` bytes at LBA 0 of `nsid` (512-byte blocks), data by C2HData.
fn read(cid: u16, nsid: u32, len: u32) -> Sqe {
    let mut sqe = build::read_write(false, cid, nsid, 0, len / 512);
    sqe.dptr = SglDescriptor::tcp_transport(len);
    sqe
}

/// Sends [`BURST`] commands made by `sqe` at once on a queue of size 32 and reads nothing
/// while the daemon works through them: its memory must stay bounded. Then reads: the stream
/// must end with a C2HTermReq (PDU Sequence Error) and be closed.
fn overrun(t: &mut TargetProcess, stream: &mut TcpStream, sqe: impl Fn(u16) -> Sqe) {
    let base = t.rss_kib();
    let burst: Vec<u8> = (0..BURST).flat_map(|cid| capsule(&sqe(cid), &[])).collect();
    stream.write_all(&burst).expect("send the burst");
    // Sample the daemon's memory while it works (a bound, not a timing: the unbounded daemon
    // was past a GiB within the first samples).
    let mut peak = base;
    for _ in 0..20 {
        std::thread::sleep(Duration::from_millis(100));
        peak = peak.max(t.rss_kib());
    }
    let grown = peak.saturating_sub(base);
    eprintln!("daemon grew by {grown} KiB while the host did not read");
    assert!(
        grown < BURST_GROWTH_KIB,
        "the daemon grew by {grown} KiB for one connection"
    );
    let got = RawHost::read_to_close(stream);
    let log = t.log();
    let tail = &log[log.len().saturating_sub(3000)..];
    let last = last_pdu(&got).expect("PDUs before the close");
    assert_eq!(
        last[0],
        0x03,
        "the last PDU is a C2HTermReq ({} bytes received); the daemon's log ends:\n{tail}",
        got.len()
    );
    assert_eq!(
        u16::from_le_bytes([last[8], last[9]]),
        0x02,
        "FES: PDU Sequence Error"
    );
    assert!(
        got.len() < 64 << 20,
        "{} bytes sent: far more commands ran than the queue holds",
        got.len()
    );
}

/// Waits (up to 10 s) for the daemon's log to hold `needle`.
fn wait_for_log(t: &mut TargetProcess, needle: &str) {
    for _ in 0..100 {
        if t.log().contains(needle) {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("no {needle:?} in the log:\n{}", t.log());
}

#[test]
fn reads_past_the_queue_size_from_a_host_that_never_reads_are_cut_off() {
    let dir = tempfile::tempdir().unwrap();
    let file = format!(
        "file:{},size=4M,bs=512,direct=off",
        dir.path().join("ns").display()
    );
    let mut t = TargetProcess::quick(NQN, &["mem:4M,bs=512", &file]);
    let addr = t.addr();
    let (_admin, cntlid) = RawHost::admin(addr, NQN);
    // Memory namespace (reads answered inline), then file namespace (reads in flight).
    for (qid, nsid) in [(1, 1), (2, 2)] {
        let mut io = RawHost::io_queue(addr, NQN, cntlid, qid);
        overrun(&mut t, &mut io.stream, |cid| read(cid, nsid, MIB));
    }
    wait_for_log(&mut t, "command beyond the queue size");
    // The target still serves a correct host.
    let mut io = RawHost::io_queue(addr, NQN, cntlid, 3);
    match io.command(&read(1, 1, 4096), &[], &[]) {
        Reply::Completion(c, data) => {
            assert_eq!(c.status(), Status::SUCCESS);
            assert_eq!(data.len(), 4096);
        }
        other => panic!("read: {other:?}"),
    }
}

#[test]
fn discovery_log_pages_past_the_queue_size_are_cut_off() {
    let mut t = TargetProcess::quick(NQN, &["mem:1M,bs=512"]);
    let mut h = RawHost::connect(t.addr(), false, false);
    let c = h.fabrics_connect(DISCOVERY_NQN, TEST_HOSTNQN, 0, 0xFFFF);
    assert!(c.status().is_success(), "discovery Connect: {}", c.status());
    overrun(&mut t, &mut h.stream, |cid| {
        let mut glp = build::get_log_page(cid, 0x70, 0, MIB, 0);
        glp.dptr = SglDescriptor::tcp_transport(MIB);
        glp
    });
    wait_for_log(&mut t, "command beyond the queue size");
}

/// Connects I/O queue `qid` of controller `cntlid` with raw PDUs, announcing `maxr2t` in
/// the ICReq; returns the socket and the Connect's completion.
fn raw_io_queue(addr: SocketAddr, cntlid: u16, qid: u16, maxr2t: u32) -> (TcpStream, Cqe) {
    let mut s = RawHost::tcp(addr);
    s.write_all(PduHeader::ic_req(0, Digests::default(), maxr2t).as_bytes())
        .unwrap();
    assert_eq!(read_pdu(&mut s)[0], 0x01, "ICResp");
    let mut sqe = FabricsCommand::Connect(nvme_spec::command::Connect {
        recfmt: 0,
        qid,
        sqsize: 32,
        cattr: 0,
        kato_ms: 0,
    })
    .encode(1);
    sqe.dptr = SglDescriptor::in_capsule(1024);
    let data = ConnectData::new([7; 16], cntlid, NQN, TEST_HOSTNQN);
    s.write_all(&capsule(&sqe, data.as_bytes())).unwrap();
    let cqe = cqe_of(&read_pdu(&mut s));
    (s, cqe)
}

#[test]
fn an_io_queue_is_connected_once_at_a_time() {
    let t = TargetProcess::quick(NQN, &["mem:1M,bs=512"]);
    let addr = t.addr();
    // Four I/O queues granted.
    let (_admin, cntlid) = RawHost::admin(addr, NQN);
    let (first, c) = raw_io_queue(addr, cntlid, 1, 0);
    assert!(
        c.status().is_success(),
        "first Connect of queue 1: {}",
        c.status()
    );
    for _ in 0..3 {
        let (_s, c) = raw_io_queue(addr, cntlid, 1, 0);
        assert_eq!(
            c.status(),
            Status::generic(generic::COMMAND_SEQUENCE_ERROR).with_dnr(),
            "queue 1 again"
        );
    }
    let (_s, c) = raw_io_queue(addr, cntlid, 5, 0);
    assert!(!c.status().is_success(), "queue 5 was not granted");
    // Once the first connection is gone, queue 1 can be connected again.
    drop(first);
    let mut again = None;
    for _ in 0..100 {
        let (s, c) = raw_io_queue(addr, cntlid, 1, 0);
        if c.status().is_success() {
            again = Some(s);
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(again.is_some(), "queue 1 was never given back");
}

#[test]
fn keep_alive_timer_zero_keeps_the_default_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let toml = format!(
        "[[listener]]\naddress = \"tcp://127.0.0.1:{port}\"\n\n[target]\ndefault_kato_ms = 1000\n\n\
         [[subsystem]]\nnqn = \"{NQN}\"\nallow_any_host = true\n\n[[subsystem.namespace]]\nbackend = \"mem:1M\"\n"
    );
    let mut t = TargetProcess::with_config(dir.path(), &toml, 0o600, port);
    let (mut admin, _) = RawHost::admin(t.addr(), NQN);
    let set = build::set_features(10, features::KEEP_ALIVE_TIMER, 0);
    match admin.command(&set, &[], &[]) {
        Reply::Completion(c, _) => assert_eq!(c.status(), Status::SUCCESS),
        other => panic!("Set Features: {other:?}"),
    }
    match admin.command(
        &build::get_features(11, features::KEEP_ALIVE_TIMER),
        &[],
        &[],
    ) {
        Reply::Completion(c, _) => assert_eq!(c.dw0.get(), 1000, "the default KATO"),
        other => panic!("Get Features: {other:?}"),
    }
    // A silent host loses its controller at the default timeout, not never.
    admin
        .stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut buf = [0u8; 64];
    match admin.stream.read(&mut buf) {
        Ok(0) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        other => panic!("expected the connection to close, got {other:?}"),
    }
    wait_for_log(&mut t, "keep alive timeout");
}

/// Property Set CC; the completion's status.
fn set_cc(admin: &mut RawHost, cid: u16, value: u32) -> Status {
    let set = FabricsCommand::PropertySet {
        size8: false,
        offset: property::CC,
        value: u64::from(value),
    }
    .encode(cid);
    match admin.command(&set, &[], &[]) {
        Reply::Completion(c, _) => c.status(),
        other => panic!("Property Set: {other:?}"),
    }
}

/// Property Get CSTS.
fn get_csts(admin: &mut RawHost, cid: u16) -> u32 {
    let get = FabricsCommand::PropertyGet {
        size8: false,
        offset: property::CSTS,
    }
    .encode(cid);
    match admin.command(&get, &[], &[]) {
        Reply::Completion(c, _) => {
            assert_eq!(c.status(), Status::SUCCESS);
            c.dw0.get()
        }
        other => panic!("Property Get: {other:?}"),
    }
}

#[test]
fn controller_status_after_a_failed_enable_and_after_a_shutdown() {
    let t = TargetProcess::quick(NQN, &["mem:1M,bs=512"]);
    let addr = t.addr();
    let (mut admin, cntlid) = RawHost::admin(addr, NQN);
    // Reset, then enable with queue entry sizes the controller does not support.
    assert_eq!(set_cc(&mut admin, 20, 0), Status::SUCCESS);
    assert_eq!(set_cc(&mut admin, 21, 1), Status::SUCCESS);
    assert_eq!(get_csts(&mut admin, 22), csts::CFS);
    // A reset clears the fatal status; a proper enable is ready and not failed.
    assert_eq!(set_cc(&mut admin, 23, 0), Status::SUCCESS);
    assert_eq!(get_csts(&mut admin, 24), 0);
    assert_eq!(set_cc(&mut admin, 25, Cc::enable_value()), Status::SUCCESS);
    assert_eq!(get_csts(&mut admin, 26), csts::RDY);

    let mut io = RawHost::io_queue(addr, NQN, cntlid, 1);
    match io.command(&read(1, 1, 4096), &[], &[]) {
        Reply::Completion(c, _) => assert_eq!(c.status(), Status::SUCCESS),
        other => panic!("read: {other:?}"),
    }
    // A normal shutdown completes; the controller is then not ready and refuses I/O.
    let shn = Cc::shutdown_value(Cc::enable_value());
    assert_eq!(set_cc(&mut admin, 27, shn), Status::SUCCESS);
    assert_eq!(get_csts(&mut admin, 28), csts::SHST_COMPLETE);
    match io.command(&read(2, 1, 4096), &[], &[]) {
        Reply::Completion(c, _) => assert_eq!(
            c.status(),
            Status::generic(generic::COMMAND_SEQUENCE_ERROR).with_dnr()
        ),
        other => panic!("read after shutdown: {other:?}"),
    }
}

#[test]
fn a_write_reusing_an_outstanding_command_identifier_is_refused() {
    let t = TargetProcess::quick(NQN, &["mem:1M,bs=512"]);
    let addr = t.addr();
    let (_admin, cntlid) = RawHost::admin(addr, NQN);
    // The host accepts 4 R2Ts per command, so the R2T limit does not catch a reused identifier.
    let (mut s, c) = raw_io_queue(addr, cntlid, 1, 3);
    assert!(c.status().is_success());
    let mut write = build::read_write(true, 5, 1, 0, 8);
    write.dptr = SglDescriptor::tcp_transport(4096);
    let mut burst = capsule(&write, &[]);
    burst.extend(capsule(&write, &[]));
    s.write_all(&burst).unwrap();
    let a = read_pdu(&mut s);
    let b = read_pdu(&mut s);
    assert_eq!(a[0], 0x09, "an R2T for the first write");
    let cqe = cqe_of(&b);
    assert_eq!(
        (cqe.cid(), cqe.status()),
        (5, Status::generic(generic::COMMAND_ID_CONFLICT).with_dnr()),
        "the second write"
    );
    // The first write completes once its data arrives.
    let ttag = u16::from_le_bytes([a[10], a[11]]);
    let hdr = PduHeader::h2c_data(Digests::default(), 0, 5, ttag, 0, 4096, true).unwrap();
    let mut h2c = Vec::new();
    hdr.append_to(&mut h2c, &[0x5a; 4096]);
    s.write_all(&h2c).unwrap();
    let cqe = cqe_of(&read_pdu(&mut s));
    assert_eq!((cqe.cid(), cqe.status()), (5, Status::SUCCESS));
}

#[test]
fn reserved_and_unsupported_command_fields_are_refused() {
    let t = TargetProcess::quick(NQN, &["mem:1M,bs=512"]);
    let addr = t.addr();
    let (mut admin, cntlid) = RawHost::admin(addr, NQN);
    let mut io = RawHost::io_queue(addr, NQN, cntlid, 1);
    let invalid_field = Status::generic(generic::INVALID_FIELD).with_dnr();
    let status = |h: &mut RawHost, sqe: &Sqe| match h.command(sqe, &[], &[]) {
        Reply::Completion(c, _) => c.status(),
        other => panic!("{other:?}"),
    };
    // PSDT 3 is reserved.
    let mut sqe = read(1, 1, 4096);
    sqe.flags |= 0b11 << 6;
    assert_eq!(status(&mut io, &sqe), invalid_field, "PSDT 3");
    // Fused operations are not supported.
    let mut sqe = read(2, 1, 4096);
    sqe.flags |= 0b01;
    assert_eq!(status(&mut io, &sqe), invalid_field, "FUSE");
    // A transport SGL data block of a subtype NVMe/TCP does not define.
    let mut sqe = read(3, 1, 4096);
    sqe.dptr = SglDescriptor::tcp_transport(4096);
    sqe.dptr.identifier = 0x50;
    assert_eq!(
        status(&mut io, &sqe),
        Status::generic(generic::SGL_TYPE_INVALID).with_dnr(),
        "SGL subtype"
    );
    // Get Features with a reserved SEL value.
    for sel in 4..8u32 {
        let mut sqe = build::get_features(10, features::KEEP_ALIVE_TIMER);
        sqe.cdw10.set(sqe.cdw10.get() | (sel << 8));
        assert_eq!(status(&mut admin, &sqe), invalid_field, "SEL {sel}");
    }
    // The queue still works.
    assert_eq!(status(&mut io, &read(4, 1, 4096)), Status::SUCCESS);
}

#[test]
fn idle_and_half_open_connections_cost_little_memory() {
    const HALF_OPEN: usize = 400;
    const CONTROLLERS: usize = 100;
    raise_open_files_limit(4096);
    // A daemon for each kind, so that neither reuses memory the other freed.
    let t = TargetProcess::quick(NQN, &["mem:1M,bs=512"]);
    let addr = t.addr();
    // Connections that send an ICReq and stall (the handshake timeout is 5 s).
    let before = t.rss_kib();
    let mut half_open = Vec::new();
    for _ in 0..HALF_OPEN {
        let mut s = RawHost::tcp(addr);
        s.write_all(PduHeader::ic_req(0, Digests::default(), 0).as_bytes())
            .unwrap();
        assert_eq!(read_pdu(&mut s)[0], 0x01, "ICResp");
        half_open.push(s);
    }
    let per_half_open = t.rss_kib().saturating_sub(before) as f64 / HALF_OPEN as f64;
    drop(half_open);
    drop(t);
    // Idle controllers: an admin queue and an I/O queue each.
    let t = TargetProcess::quick(NQN, &["mem:1M,bs=512"]);
    let addr = t.addr();
    let before = t.rss_kib();
    let mut idle = Vec::new();
    for _ in 0..CONTROLLERS {
        let (admin, cntlid) = RawHost::admin(addr, NQN);
        let io = RawHost::io_queue(addr, NQN, cntlid, 1);
        idle.push((admin, io));
    }
    let per_idle = t.rss_kib().saturating_sub(before) as f64 / (2 * CONTROLLERS) as f64;
    eprintln!(
        "{per_half_open:.1} KiB per connection after its ICReq, {per_idle:.1} KiB per idle queue"
    );
    // Goals: 8 KiB and 64 KiB; the bounds leave room for noise. A 256 KiB receive buffer per
    // connection, filled with zeros up front, cost 264-276 KiB.
    assert!(
        per_half_open < 16.0,
        "{per_half_open:.1} KiB per half-open connection"
    );
    assert!(per_idle < 64.0, "{per_idle:.1} KiB per idle queue");
}

#[test]
fn memory_returns_when_a_slow_reader_catches_up() {
    const READS: u16 = 32;
    let mut t = TargetProcess::quick(NQN, &["mem:4M,bs=512"]);
    let addr = t.addr();
    let (_admin, cntlid) = RawHost::admin(addr, NQN);
    let mut io = RawHost::io_queue(addr, NQN, cntlid, 1);
    let base = t.rss_kib();
    // A whole queue of 1 MiB reads, within the queue size; the host reads nothing yet.
    for cid in 0..READS {
        io.submit(&read(cid, 1, MIB), &[]);
    }
    std::thread::sleep(Duration::from_millis(500));
    let held = t.rss_kib().saturating_sub(base);
    for _ in 0..READS {
        match io.wait(&[]) {
            Reply::Completion(c, data) => {
                assert_eq!(c.status(), Status::SUCCESS);
                assert_eq!(data.len(), MIB as usize);
            }
            other => panic!("read: {other:?}"),
        }
    }
    // Caught up and idle: the connection gives its send buffer back.
    let mut kept = u64::MAX;
    for _ in 0..100 {
        kept = t.rss_kib().saturating_sub(base);
        if kept < 4 * 1024 {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("{held} KiB held while the host did not read, {kept} KiB once it caught up");
    assert!(kept < 4 * 1024, "{kept} KiB still held:\n{}", t.log());
}

#[test]
fn hostile_queues_together_stay_within_the_memory_budget() {
    /// Three controllers of three I/O queues each.
    const QUEUES: u16 = 9;
    const BUDGET_MIB: u64 = 32;
    let dir = tempfile::tempdir().unwrap();
    let file = format!(
        "file:{},size=4M,bs=512,direct=off",
        dir.path().join("ns").display()
    );
    let port = free_port();
    let listen = format!("tcp://127.0.0.1:{port}");
    let budget = format!("{BUDGET_MIB}M");
    let mut t = TargetProcess::spawn(
        &[
            "--listen",
            &listen,
            "--subsystem",
            NQN,
            "--reactors",
            "2",
            "--namespace",
            &file,
            "--memory-budget",
            &budget,
        ],
        port,
    );
    let addr = t.addr();
    let admins: Vec<(RawHost, u16)> = (0..4).map(|_| RawHost::admin(addr, NQN)).collect();
    let base = t.rss_kib();
    // Each queue sends a whole queue of 1 MiB reads and never reads its socket: alone, each
    // could hold 32 MiB; together they must stay within the budget.
    let mut hostile = Vec::new();
    for n in 0..QUEUES {
        let (cntlid, qid) = (admins[usize::from(n / 3)].1, n % 3 + 1);
        let mut io = RawHost::io_queue(addr, NQN, cntlid, qid);
        let burst: Vec<u8> = (0..32)
            .flat_map(|cid| capsule(&read(cid, 1, MIB), &[]))
            .collect();
        io.stream.write_all(&burst).expect("send the reads");
        hostile.push(io);
    }
    let mut peak = base;
    for _ in 0..20 {
        std::thread::sleep(Duration::from_millis(100));
        peak = peak.max(t.rss_kib());
    }
    let grown = peak.saturating_sub(base);
    eprintln!("{QUEUES} hostile queues: the daemon grew by {grown} KiB");
    // The budget, plus a command's data and a small share per connection, plus what the
    // allocator keeps (54-74 MiB measured; 578 MiB without a budget).
    assert!(
        grown < (BUDGET_MIB + 64) * 1024,
        "the daemon grew by {grown} KiB with a budget of {BUDGET_MIB} MiB"
    );
    // A correct host is still served, small reads and large.
    let mut io = RawHost::io_queue(addr, NQN, admins[3].1, 1);
    for (cid, len) in [(1, 4096), (2, MIB), (3, 128 * 1024)] {
        match io.command(&read(cid, 1, len), &[], &[]) {
            Reply::Completion(c, data) => {
                assert_eq!(c.status(), Status::SUCCESS);
                assert_eq!(data.len(), len as usize);
            }
            other => panic!("read: {other:?}"),
        }
    }
    assert!(t.is_running(), "the daemon ended:\n{}", t.log());
    drop(hostile);
}
