//! Large reads from memory and null namespaces against the `nvmeof-targetd` process. Their
//! data leaves from the namespace's own memory, not from a copy: it must arrive whole and in
//! order, with or without digests, across chunk boundaries and never-written holes, and a read
//! must carry the data as it was when the read ran, even while later writes change it before
//! the read's data has left.

use nvme_spec::command::build;
use nvme_spec::status::generic;
use nvme_spec::{SglDescriptor, Status};
use nvmeof_tests::{RawHost, Reply, TEST_HOSTNQN, TargetProcess};

const NQN: &str = "nqn.2026-11.io.nvmeof-direct:large-reads";
const MIB: usize = 1 << 20;
/// Block size of the namespaces (the default).
const BS: usize = 4096;

/// A pattern that differs at every offset and between `seed`s.
fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[2] ^ seed)
        .collect()
}

/// Connects I/O queue `qid` of controller `cntlid`, with header and data digests or none.
fn io_queue(t: &TargetProcess, cntlid: u16, qid: u16, digests: bool) -> RawHost {
    let mut h = RawHost::connect(t.addr(), digests, digests);
    let c = h.fabrics_connect(NQN, TEST_HOSTNQN, qid, cntlid);
    assert!(c.status().is_success(), "I/O Connect: {}", c.status());
    h
}

fn rw(write: bool, cid: u16, nsid: u32, slba: u64, len: usize) -> nvme_spec::Sqe {
    let mut sqe = build::read_write(write, cid, nsid, slba, (len / BS) as u32);
    sqe.dptr = SglDescriptor::tcp_transport(len as u32);
    sqe
}

fn write(h: &mut RawHost, cid: u16, slba: u64, data: &[u8]) {
    match h.command(&rw(true, cid, 1, slba, data.len()), &[], data) {
        Reply::Completion(c, _) => assert!(c.status().is_success(), "write: {}", c.status()),
        other => panic!("write: {other:?}"),
    }
}

/// Reads `len` bytes at `slba` of `nsid`: the status and the data.
fn read(h: &mut RawHost, cid: u16, nsid: u32, slba: u64, len: usize) -> (Status, Vec<u8>) {
    match h.command(&rw(false, cid, nsid, slba, len), &[], &[]) {
        Reply::Completion(c, data) => (c.status(), data),
        other => panic!("read: {other:?}"),
    }
}

#[test]
fn large_reads_arrive_whole_with_and_without_digests() {
    let t = TargetProcess::quick(NQN, &["mem:16M", "null:16M"]);
    let (_admin, cntlid) = RawHost::admin(t.addr(), NQN);
    for (qid, digests) in [(1, false), (2, true)] {
        let mut h = io_queue(&t, cntlid, qid, digests);
        let seed = qid as u8;
        // 1.5 MiB written from LBA 0: a partly written chunk at its end, then a hole.
        // (Transfers of at most 1 MiB, the daemon's MDTS.)
        let data = pattern(seed, 3 * MIB / 2);
        write(&mut h, 1, 0, &data[..MIB]);
        write(&mut h, 1, (MIB / BS) as u64, &data[MIB..]);
        let mut want = data.clone();
        want.resize(2 * MIB, 0);
        for slba in [0, MIB / BS] {
            let (s, got) = read(&mut h, 2, 1, slba as u64, MIB);
            assert!(s.is_success(), "read: {s}");
            let off = slba * BS;
            assert!(
                got == want[off..off + MIB],
                "1 MiB from LBA {slba} (digests {digests})"
            );
        }
        // Starting inside a chunk, ending inside another; just above and just below the size
        // that is sent from the namespace's memory.
        for (slba, len) in [
            (3u64, MIB),
            (5, 32 * 1024),
            (7, 28 * 1024),
            (300, 64 * 1024),
        ] {
            let off = slba as usize * BS;
            let (s, got) = read(&mut h, 3, 1, slba, len);
            assert!(s.is_success(), "read: {s}");
            assert!(
                got == want[off..off + len],
                "{len} bytes from LBA {slba} (digests {digests})"
            );
        }
        // The null namespace: zeros.
        let (s, got) = read(&mut h, 4, 2, 8, MIB);
        assert!(s.is_success(), "read: {s}");
        assert!(got.len() == MIB && got.iter().all(|&b| b == 0));
        // Past the end: refused, and the queue goes on.
        let last = (16 * MIB / BS) as u64;
        let (s, got) = read(&mut h, 5, 1, last - 8, MIB);
        assert_eq!(s, Status::generic(generic::LBA_OUT_OF_RANGE).with_dnr());
        assert!(got.is_empty());
        let (s, got) = read(&mut h, 6, 1, 0, 64 * 1024);
        assert!(s.is_success() && got == want[..64 * 1024]);
    }
}

#[test]
fn a_read_carries_the_data_of_its_time_while_later_writes_change_it() {
    let t = TargetProcess::quick(NQN, &["mem:16M"]);
    let (_admin, cntlid) = RawHost::admin(t.addr(), NQN);
    let mut h = io_queue(&t, cntlid, 1, true);
    let old = pattern(7, MIB);
    write(&mut h, 1, 0, &old);
    // Eight reads of the same MiB, then a write into it with its data in the capsule, sent
    // at once without reading: the reads' data waits in the target (it holds up to its send
    // backlog) while the write runs.
    let reads = 8u16;
    for cid in 0..reads {
        h.submit(&rw(false, 10 + cid, 1, 0, MIB), &[]);
    }
    let new = pattern(9, BS);
    let mut w = build::read_write(true, 30, 1, 16, 1);
    w.dptr = SglDescriptor::in_capsule(BS as u32);
    h.submit(&w, &new);
    for cid in 0..reads {
        match h.wait(&[]) {
            Reply::Completion(c, data) => {
                assert_eq!(c.cid(), 10 + cid);
                assert!(c.status().is_success(), "read: {}", c.status());
                assert!(data == old, "read {cid} carries the data of its time");
            }
            other => panic!("read: {other:?}"),
        }
    }
    match h.wait(&[]) {
        Reply::Completion(c, _) => {
            assert_eq!(c.cid(), 30);
            assert!(c.status().is_success(), "write: {}", c.status());
        }
        other => panic!("write: {other:?}"),
    }
    let mut now = old.clone();
    now[16 * BS..17 * BS].copy_from_slice(&new);
    let (s, got) = read(&mut h, 40, 1, 0, MIB);
    assert!(s.is_success() && got == now, "the write landed");
}
