//! The submission path, without sockets.
//!
//! - `target_submit_read_4k`: a 4 KiB Read capsule through the target's queue logic
//!   (`QueueState::submit`: decode, controller state, namespace and range checks), the read
//!   from a memory namespace (`io::execute`), and the completion entry.
//! - `target_submit_reject`: a Read past the end of the namespace, answered with an error.
//! - `host_submit_read`: the host engine queueing a Read CapsuleCmd (command tracking and
//!   PDU encoding into the send buffer).
//! - `metrics_record_read_4k`: what the target's metrics add per I/O: the arrival time stamp
//!   and the count of a finished 4 KiB read in its queue's cell (command, bytes, latency
//!   bucket and sum).
//!
//! `cargo bench -p nvmeof-bench --bench submit`
// criterion_group! expands to an undocumented public function.
#![allow(missing_docs)]

use std::hint::black_box;
use std::net::SocketAddr;
use std::sync::Arc;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use futures_util::FutureExt;
use nvme_spec::command::build;
use nvme_spec::fabrics::{Cc, ConnectData, property};
use nvme_spec::{FabricsCommand, IntoBytes, SglDescriptor, Status};
use nvmeof_target::config::Config;
use nvmeof_target::controller::QueueOrigin;
use nvmeof_target::queue::{IoOp, QueueState, Submit};
use nvmeof_target::{Target, io};
use nvmf_tcp::{Digests, HostConfig, HostConn, PduHeader};

const NQN: &str = "nqn.2026-11.io.nvmeof-direct:bench";
const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:6e766d65-6f66-2d62-656e-636800000001";

fn connect(q: &mut QueueState, qid: u16, cntlid: u16) {
    let mut sqe = FabricsCommand::Connect(nvme_spec::command::Connect {
        recfmt: 0,
        qid,
        sqsize: 128,
        cattr: 0,
        kato_ms: 0,
    })
    .encode(0);
    sqe.dptr = SglDescriptor::in_capsule(1024);
    let data = ConnectData::new([1; 16], cntlid, NQN, HOST);
    match q.submit(&sqe, data.as_bytes()) {
        Submit::Complete(cqe) if cqe.status().is_success() => {}
        _ => panic!("Connect qid {qid} was refused"),
    }
}

/// An admin queue (connected, enabled, 1 I/O queue granted) and a connected I/O queue.
fn queues() -> (QueueState, QueueState) {
    let cfg = Config::quick(
        &["tcp://127.0.0.1:0".parse().expect("valid listen address")],
        NQN,
        &["mem:64M".parse().expect("valid backend")],
        true,
        &[],
    )
    .expect("valid config");
    let target: Arc<Target> = Target::build(&cfg).expect("target builds");
    let origin = QueueOrigin {
        local: SocketAddr::from(([127, 0, 0, 1], 4420)),
        peer: SocketAddr::from(([127, 0, 0, 1], 40000)),
    };
    let mut admin = QueueState::new(Arc::clone(&target), origin);
    connect(&mut admin, 0, 0xFFFF);
    let ctrl = admin.ctrl.clone().expect("admin queue connected");
    let cc = FabricsCommand::PropertySet {
        size8: false,
        offset: property::CC,
        value: u64::from(Cc::enable_value()),
    }
    .encode(1);
    let _ = admin.submit(&cc, &[]);
    let _ = admin.submit(&build::set_features(2, 7, 0x0001_0001), &[]);
    let mut io = QueueState::new(target, origin);
    connect(&mut io, 1, ctrl.cntlid);
    (admin, io)
}

fn target_submit(c: &mut Criterion) {
    let (_admin, mut io) = queues();
    let ctrl = io.ctrl.clone().expect("I/O queue connected");
    let mut g = c.benchmark_group("submit");
    g.throughput(Throughput::Elements(1));
    let mut read = build::read_write(false, 5, 1, 64, 1);
    read.dptr = SglDescriptor::tcp_transport(4096);
    let mut buf = Some(blockdev::IoBuf::new(4096));
    g.bench_function("target_submit_read_4k", |b| {
        b.iter(|| {
            let Submit::Io(req) = io.submit(black_box(&read), &[]) else {
                panic!("a valid read was not accepted");
            };
            let len = match req.op {
                IoOp::Read { len, .. } => len,
                _ => 0,
            };
            let mut iobuf = buf.take().unwrap_or_else(|| blockdev::IoBuf::new(len));
            let _ = iobuf.set_len(len);
            let (status, iobuf) = io::execute(&ctrl, &req, iobuf)
                .now_or_never()
                .expect("memory namespaces complete at once");
            let cqe = io.completion(req.cid, status, 0);
            buf = Some(iobuf);
            black_box(cqe)
        })
    });
    let mut bad = build::read_write(false, 6, 1, u64::MAX / 8192, 1);
    bad.dptr = SglDescriptor::tcp_transport(4096);
    g.bench_function("target_submit_reject", |b| {
        b.iter(|| match io.submit(black_box(&bad), &[]) {
            Submit::Complete(cqe) => black_box(cqe.status() != Status::SUCCESS),
            _ => panic!("an out-of-range read was accepted"),
        })
    });
    ctrl.tear_down();
    g.finish();
}

fn host_submit(c: &mut Criterion) {
    let mut g = c.benchmark_group("submit");
    g.throughput(Throughput::Elements(1));
    let mut h = HostConn::new(HostConfig::default());
    let n = h.pending_send().len();
    h.consume_sent(n);
    h.feed(
        PduHeader::ic_resp(
            0,
            Digests {
                header: false,
                data: false,
            },
            128 * 1024,
        )
        .as_bytes(),
    );
    let _ = h.next_event();
    let mut sqe = build::read_write(false, 0, 1, 64, 1);
    sqe.dptr = SglDescriptor::tcp_transport(4096);
    let mut raw = sqe.to_array();
    let mut cid = 0u16;
    g.bench_function("host_submit_read", |b| {
        b.iter(|| {
            cid = (cid + 1) % 64;
            raw[2..4].copy_from_slice(&cid.to_le_bytes());
            h.send_capsule_cmd(black_box(&raw), &[])
                .expect("command id is free");
            // Forget it again so the id can be reused (as a completion would).
            h.forget_command(cid);
            let n = h.pending_send().len();
            h.consume_sent(n);
        })
    });
    g.finish();
}

fn metrics_record(c: &mut Criterion) {
    let cell = nvmeof_target::metrics::IoCell::default();
    let op = IoOp::Read { lba: 0, len: 4096 };
    let mut g = c.benchmark_group("metrics");
    g.throughput(Throughput::Elements(1));
    g.bench_function("metrics_record_read_4k", |b| {
        b.iter(|| cell.record(black_box(&op), Status::SUCCESS, black_box(0)))
    });
    g.finish();
}

criterion_group!(benches, target_submit, host_submit, metrics_record);
criterion_main!(benches);
