//! NVMe/TCP PDU encoding and decoding through the sans-IO engine (`nvmf-tcp`), with and
//! without digests.
//!
//! `cargo bench -p nvmeof-bench --bench pdu`
// criterion_group! expands to an undocumented public function.
#![allow(missing_docs)]

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use nvme_spec::command::build;
use nvmf_tcp::{
    Digests, HostConfig, HostConn, HostEvent, PduHeader, TargetConfig, TargetConn, TargetEvent,
};

const BATCH: usize = 64;

fn digests(on: bool) -> Digests {
    Digests {
        header: on,
        data: on,
    }
}

fn name(base: &str, on: bool) -> String {
    format!("{base}/{}", if on { "digests" } else { "plain" })
}

fn read_sqe(cid: u16, len: u32) -> [u8; 64] {
    let mut sqe = build::read_write(false, cid, 1, u64::from(cid) * 8, len / 4096);
    sqe.dptr = nvme_spec::SglDescriptor::tcp_transport(len);
    sqe.to_array()
}

fn connected_target(d: Digests) -> TargetConn {
    let mut t = TargetConn::new(TargetConfig::default()).expect("default config is valid");
    // Commands are fed in batches and answered late, or not at all: no queue size.
    t.set_queue_size(usize::MAX);
    t.feed(PduHeader::ic_req(0, d, 0).as_bytes());
    let _ = t.next_event();
    let n = t.pending_send().len();
    t.consume_sent(n);
    t
}

fn connected_host(d: Digests) -> HostConn {
    let mut h = HostConn::new(HostConfig {
        hdgst: d.header,
        ddgst: d.data,
        recv_buffer_size: 256 * 1024,
        max_outstanding_commands: 1024,
    });
    let n = h.pending_send().len();
    h.consume_sent(n);
    h.feed(PduHeader::ic_resp(0, d, 128 * 1024).as_bytes());
    let _ = h.next_event();
    h
}

fn encode(c: &mut Criterion) {
    let mut g = c.benchmark_group("pdu_encode");
    let data = vec![0xA5u8; 4096];
    for on in [false, true] {
        let d = digests(on);
        g.throughput(Throughput::Elements(1));
        let sqe = read_sqe(7, 4096);
        let mut out = Vec::with_capacity(1 << 20);
        g.bench_function(name("capsule_cmd_read", on), |b| {
            b.iter(|| {
                out.clear();
                PduHeader::capsule_cmd(d, 0, black_box(&sqe), 0)
                    .expect("a read capsule fits")
                    .append_to(&mut out, &[]);
                black_box(out.len())
            })
        });
        let cqe = [0u8; 16];
        g.bench_function(name("capsule_resp", on), |b| {
            b.iter(|| {
                out.clear();
                PduHeader::capsule_resp(d, black_box(&cqe)).append_to(&mut out, &[]);
                black_box(out.len())
            })
        });
        g.throughput(Throughput::Bytes(4096));
        g.bench_function(name("c2h_data_4k", on), |b| {
            b.iter(|| {
                out.clear();
                PduHeader::c2h_data(d, 0, 7, 0, 4096, true, false)
                    .expect("4 KiB fits")
                    .append_to(&mut out, black_box(&data));
                black_box(out.len())
            })
        });
        // The target's send path: C2HData (copied into the send buffer) plus CapsuleResp.
        let mut t = connected_target(d);
        g.bench_function(name("target_send_read_reply_4k", on), |b| {
            b.iter(|| {
                t.send_c2h_data(7, 0, black_box(&data), true, false)
                    .expect("send buffer grows");
                let mut cqe = [0u8; 16];
                cqe[12..14].copy_from_slice(&7u16.to_le_bytes());
                t.send_capsule_resp(&cqe).expect("send buffer grows");
                let n = t.pending_send().len();
                t.consume_sent(n);
            })
        });
    }
    g.finish();
}

fn decode(c: &mut Criterion) {
    let mut g = c.benchmark_group("pdu_decode");
    let data = vec![0x5Au8; 4096];
    for on in [false, true] {
        let d = digests(on);
        // Target side: a batch of read capsules as one receive.
        let mut wire = Vec::new();
        for i in 0..BATCH {
            PduHeader::capsule_cmd(d, 0, &read_sqe(i as u16, 4096), 0)
                .expect("a read capsule fits")
                .append_to(&mut wire, &[]);
        }
        g.throughput(Throughput::Elements(BATCH as u64));
        let mut t = connected_target(d);
        g.bench_function(name("target_read_capsules_x64", on), |b| {
            b.iter(|| {
                t.feed(black_box(&wire));
                let mut n = 0;
                while let Ok(Some(ev)) = t.next_event() {
                    if let TargetEvent::Command { sqe, .. } = ev {
                        n += usize::from(sqe[0]);
                    }
                }
                black_box(n)
            })
        });
        // Target side: 4 KiB in-capsule writes.
        let mut wire = Vec::new();
        for i in 0..BATCH {
            let mut sqe = build::read_write(true, i as u16, 1, 0, 1);
            sqe.dptr = nvme_spec::SglDescriptor::in_capsule(4096);
            PduHeader::capsule_cmd(d, 0, &sqe.to_array(), 4096)
                .expect("in-capsule write fits")
                .append_to(&mut wire, &data);
        }
        g.throughput(Throughput::Bytes((BATCH * 4096) as u64));
        let mut t = connected_target(d);
        g.bench_function(name("target_write_capsules_4k_x64", on), |b| {
            b.iter(|| {
                t.feed(black_box(&wire));
                let mut n = 0;
                while let Ok(Some(ev)) = t.next_event() {
                    if let TargetEvent::Command { data, .. } = ev {
                        n += data.len();
                    }
                }
                black_box(n)
            })
        });
        // Host side: C2HData + CapsuleResp for a batch of reads.
        let mut wire = Vec::new();
        for i in 0..BATCH {
            let cid = i as u16;
            PduHeader::c2h_data(d, 0, cid, 0, 4096, true, false)
                .expect("4 KiB fits")
                .append_to(&mut wire, &data);
            let mut cqe = [0u8; 16];
            cqe[12..14].copy_from_slice(&cid.to_le_bytes());
            PduHeader::capsule_resp(d, &cqe).append_to(&mut wire, &[]);
        }
        g.throughput(Throughput::Bytes((BATCH * 4096) as u64));
        let mut sink = vec![0u8; 4096];
        // One connection for every iteration (a fresh one per batch would time page faults
        // of its new receive buffer): each iteration sends the 64 read commands, then takes
        // their C2HData and CapsuleResp PDUs.
        let mut h = connected_host(d);
        let sqes: Vec<[u8; 64]> = (0..BATCH).map(|i| read_sqe(i as u16, 4096)).collect();
        g.bench_function(name("host_read_cmds_and_replies_4k_x64", on), |b| {
            b.iter(|| {
                for sqe in &sqes {
                    h.send_capsule_cmd(sqe, &[]).expect("command ids are free");
                }
                let n = h.pending_send().len();
                h.consume_sent(n);
                h.feed(black_box(&wire));
                while let Ok(Some(ev)) = h.next_event() {
                    if let HostEvent::C2HData { datao, data, .. } = ev {
                        let o = datao as usize;
                        sink[o..o + data.len()].copy_from_slice(data);
                    }
                }
                black_box(&sink);
            })
        });
    }
    g.finish();
}

criterion_group!(benches, encode, decode);
criterion_main!(benches);
