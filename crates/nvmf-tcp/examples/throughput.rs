//! Single-core throughput of the engine without sockets, for typical 4 KiB I/O.
//!
//! `cargo run --release -p nvmf-tcp --example throughput`
//!
//! Each workload pre-encodes a batch of PDUs, then times feeding them through the receive
//! path (copying into the receive buffer as a socket read would) and, where the target
//! answers, encoding the replies into the send buffer.

use std::hint::black_box;
use std::time::Instant;

use nvmf_tcp::{
    Digests, HostConfig, HostConn, HostEvent, PduHeader, TargetConfig, TargetConn, TargetEvent,
};

const BATCH: usize = 256;
const ROUNDS: usize = 400;

fn sqe(opcode: u8, cid: u16, sgl_id: u8, len: u32) -> [u8; 64] {
    let mut s = [0u8; 64];
    s[0] = opcode;
    s[1] = 0x40;
    s[2..4].copy_from_slice(&cid.to_le_bytes());
    s[32..36].copy_from_slice(&len.to_le_bytes());
    s[39] = sgl_id;
    s
}

fn target(d: Digests) -> TargetConn {
    let mut t = TargetConn::new(TargetConfig::default()).unwrap();
    // Commands are fed in batches and answered late, or not at all: no queue size.
    t.set_queue_size(usize::MAX);
    t.feed(PduHeader::ic_req(0, d, 0).as_bytes());
    t.next_event().unwrap();
    let n = t.pending_send().len();
    t.consume_sent(n);
    t
}

fn report(name: &str, d: Digests, ops: usize, bytes: usize, secs: f64) {
    println!(
        "{name:<34} hdgst={:<5} ddgst={:<5} {:>8.2} M ops/s {:>7.2} GiB/s",
        d.header,
        d.data,
        ops as f64 / secs / 1e6,
        bytes as f64 / secs / (1u64 << 30) as f64
    );
}

/// Target receives 4 KiB writes carried in the capsule and answers each with a CapsuleResp.
fn target_in_capsule_writes(d: Digests) {
    let data = vec![0x5Au8; 4096];
    let mut wire = Vec::new();
    for i in 0..BATCH {
        let s = sqe(0x01, i as u16, 0x01, 4096);
        PduHeader::capsule_cmd(d, 0, &s, 4096)
            .unwrap()
            .append_to(&mut wire, &data);
    }
    let mut t = target(d);
    let start = Instant::now();
    for _ in 0..ROUNDS {
        for chunk in wire.chunks(64 * 1024) {
            let buf = t.recv_buf(chunk.len());
            buf[..chunk.len()].copy_from_slice(chunk);
            t.commit_recv(chunk.len());
            while let Some(ev) = t.next_event().unwrap() {
                let TargetEvent::Command { sqe, data } = ev else {
                    unreachable!()
                };
                black_box(data);
                let mut cqe = [0u8; 16];
                cqe[12..14].copy_from_slice(&sqe[2..4]);
                t.send_capsule_resp(&cqe).unwrap();
            }
        }
        let n = t.pending_send().len();
        black_box(t.pending_send());
        t.consume_sent(n);
    }
    let ops = BATCH * ROUNDS;
    report(
        "target: 4 KiB in-capsule write",
        d,
        ops,
        ops * 4096,
        start.elapsed().as_secs_f64(),
    );
}

/// Target receives 4 KiB read commands and answers with C2HData (copied) + CapsuleResp.
fn target_reads(d: Digests) {
    let data = vec![0xA5u8; 4096];
    let mut wire = Vec::new();
    for i in 0..BATCH {
        let s = sqe(0x02, i as u16, 0x5A, 4096);
        PduHeader::capsule_cmd(d, 0, &s, 0)
            .unwrap()
            .append_to(&mut wire, &[]);
    }
    let mut t = target(d);
    let start = Instant::now();
    for _ in 0..ROUNDS {
        t.feed(&wire);
        while let Some(ev) = t.next_event().unwrap() {
            let TargetEvent::Command { sqe, .. } = ev else {
                unreachable!()
            };
            let cid = u16::from_le_bytes([sqe[2], sqe[3]]);
            t.send_c2h_data(cid, 0, &data, true, false).unwrap();
            let mut cqe = [0u8; 16];
            cqe[12..14].copy_from_slice(&cid.to_le_bytes());
            t.send_capsule_resp(&cqe).unwrap();
        }
        let n = t.pending_send().len();
        black_box(t.pending_send());
        t.consume_sent(n);
    }
    let ops = BATCH * ROUNDS;
    report(
        "target: 4 KiB read (C2H copy)",
        d,
        ops,
        ops * 4096,
        start.elapsed().as_secs_f64(),
    );
}

/// Host receives 4 KiB C2HData + CapsuleResp for outstanding reads.
fn host_reads(d: Digests) {
    let data = vec![0xA5u8; 4096];
    let mut wire = Vec::new();
    for i in 0..BATCH {
        let cid = i as u16;
        PduHeader::c2h_data(d, 0, cid, 0, 4096, true, false)
            .unwrap()
            .append_to(&mut wire, &data);
        let mut cqe = [0u8; 16];
        cqe[12..14].copy_from_slice(&cid.to_le_bytes());
        PduHeader::capsule_resp(d, &cqe).append_to(&mut wire, &[]);
    }
    let mut h = HostConn::new(HostConfig {
        hdgst: d.header,
        ddgst: d.data,
        recv_buffer_size: 256 * 1024,
        max_outstanding_commands: BATCH,
    });
    let n = h.pending_send().len();
    h.consume_sent(n);
    h.feed(PduHeader::ic_resp(0, d, 131_072).as_bytes());
    h.next_event().unwrap();
    let mut sink = vec![0u8; 4096];
    let start = Instant::now();
    for _ in 0..ROUNDS {
        for i in 0..BATCH {
            h.send_capsule_cmd(&sqe(0x02, i as u16, 0x5A, 4096), &[])
                .unwrap();
        }
        let n = h.pending_send().len();
        h.consume_sent(n);
        for chunk in wire.chunks(64 * 1024) {
            let buf = h.recv_buf(chunk.len());
            buf[..chunk.len()].copy_from_slice(chunk);
            h.commit_recv(chunk.len());
            while let Some(ev) = h.next_event().unwrap() {
                if let HostEvent::C2HData { datao, data, .. } = ev {
                    sink[datao as usize..datao as usize + data.len()].copy_from_slice(data);
                }
            }
        }
        black_box(&sink);
    }
    let ops = BATCH * ROUNDS;
    report(
        "host: 4 KiB read completion",
        d,
        ops,
        ops * 4096,
        start.elapsed().as_secs_f64(),
    );
}

fn main() {
    for d in [
        Digests {
            header: false,
            data: false,
        },
        Digests {
            header: true,
            data: true,
        },
    ] {
        target_in_capsule_writes(d);
        target_reads(d);
        host_reads(d);
    }
}
