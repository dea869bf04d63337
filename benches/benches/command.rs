//! NVMe command parsing and building (`nvme-spec`): the typed decode every capsule goes
//! through on the target, and the SQE builders the host uses.
//!
//! `cargo bench -p nvmeof-bench --bench command`
// criterion_group! expands to an undocumented public function.
#![allow(missing_docs)]

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use nvme_spec::command::build;
use nvme_spec::{AdminCommand, Cqe, FabricsCommand, IoCommand, Sqe, Status};

fn parse(c: &mut Criterion) {
    let mut g = c.benchmark_group("command");
    g.throughput(Throughput::Elements(1));
    let read = build::read_write(false, 9, 1, 123_456, 8);
    let raw = read.to_array();
    g.bench_function("sqe_from_bytes", |b| {
        b.iter(|| Sqe::from_array(black_box(&raw)))
    });
    g.bench_function("io_parse_read", |b| {
        b.iter(|| IoCommand::parse(black_box(&read)))
    });
    let write = build::read_write(true, 9, 1, 123_456, 8);
    g.bench_function("io_parse_write", |b| {
        b.iter(|| IoCommand::parse(black_box(&write)))
    });
    let identify = build::identify(3, 1, 0);
    g.bench_function("admin_parse_identify", |b| {
        b.iter(|| AdminCommand::parse(black_box(&identify)))
    });
    let connect = FabricsCommand::Connect(nvme_spec::command::Connect {
        recfmt: 0,
        qid: 1,
        sqsize: 128,
        cattr: 0,
        kato_ms: 0,
    })
    .encode(1);
    g.bench_function("fabrics_parse_connect", |b| {
        b.iter(|| FabricsCommand::parse(black_box(&connect)))
    });
    g.bench_function("build_read_sqe", |b| {
        b.iter(|| build::read_write(false, black_box(9), 1, black_box(123_456), 8).to_array())
    });
    g.bench_function("cqe_encode_decode", |b| {
        b.iter(|| {
            let cqe = Cqe::new(black_box(9), Status::SUCCESS, 0).to_array();
            Cqe::from_array(black_box(&cqe)).status()
        })
    });
    g.finish();
}

criterion_group!(benches, parse);
criterion_main!(benches);
