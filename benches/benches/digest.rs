//! CRC32C digests as NVMe/TCP uses them: whole-buffer and incremental, 4 KiB and 128 KiB.
//!
//! `cargo bench -p nvmeof-bench --bench digest`
// criterion_group! expands to an undocumented public function.
#![allow(missing_docs)]

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use nvmf_tcp::{DataDigest, crc32c, digest_bytes};

fn digests(c: &mut Criterion) {
    let mut g = c.benchmark_group("crc32c");
    for size in [4096usize, 128 * 1024] {
        let data: Vec<u8> = (0..size).map(|i| (i * 31 % 251) as u8).collect();
        g.throughput(Throughput::Bytes(size as u64));
        g.bench_function(format!("oneshot/{}k", size / 1024), |b| {
            b.iter(|| crc32c(black_box(&data)))
        });
        // Data arriving in 1460-byte pieces (one TCP segment each), as a receive path sees it.
        g.bench_function(format!("incremental_1460/{}k", size / 1024), |b| {
            b.iter(|| {
                let mut d = DataDigest::default();
                for piece in black_box(&data).chunks(1460) {
                    d.update(piece);
                }
                d.value()
            })
        });
    }
    // The header digest of a 72-byte CapsuleCmd header.
    let hdr = [0x42u8; 72];
    g.throughput(Throughput::Bytes(72));
    g.bench_function("header_72", |b| b.iter(|| digest_bytes(black_box(&hdr))));
    g.finish();
}

criterion_group!(benches, digests);
criterion_main!(benches);
