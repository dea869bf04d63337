//! CPU cost of a read through the `pcie:` backend (the `Backend` trait on a current-thread
//! runtime, this thread's queue pair) against the driver's controller model with data movement
//! off (`discard_data`), on its two paths:
//!
//! - `zero_copy`: the caller passes back the arena buffer the previous read handed it (as a
//!   target's buffer pool does), and the device reads into it directly;
//! - `bounce`: the caller's buffer is ordinary memory and the backend may not lend it an arena
//!   buffer (half the arena is held, as by callers keeping many), so the data is copied from a
//!   bounce buffer into it;
//!
//! beside the copy alone. The model's work and one `block_on` per read are included, so the
//! figures are an upper bound for the backend's own cost.
//!
//! `cargo bench -p blockdev --bench pcie_backend`
// criterion_group! expands to an undocumented public function.
#![allow(missing_docs)]

use std::sync::Arc;

use blockdev::{Backend, IoBuf, PcieBackend};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use nvme_pcie::model::{ModelConfig, ModelController};
use nvme_pcie::{Config, Device};

fn pcie_backend(c: &mut Criterion) {
    let model: Arc<dyn Device> = Arc::new(ModelController::new(ModelConfig {
        block_size: 4096,
        blocks: 1 << 20,
        discard_data: true,
        ..ModelConfig::default()
    }));
    let config = Config {
        arena_size: 32 << 20,
        ..Config::default()
    };
    let backend = PcieBackend::with_device(model, config, None, "model".into()).expect("open");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let mut lba = 0u64;
    let mut read = |buf: IoBuf| {
        lba = (lba + 32) & 0xF_FFFF;
        let (r, back) = rt.block_on(backend.read(lba, buf));
        r.expect("read");
        back
    };
    let mut group = c.benchmark_group("pcie-backend");
    let sizes = [4096usize, 128 << 10];
    for size in sizes {
        group.throughput(Throughput::Bytes(size as u64));
        let mut buf = Some(read(IoBuf::new(size)));
        assert!(buf.as_ref().is_some_and(IoBuf::is_dma));
        group.bench_function(format!("read_{}k/zero_copy", size >> 10), |b| {
            b.iter(|| buf = Some(read(buf.take().expect("buffer"))))
        });
    }
    // Half the arena held: reads into ordinary memory go through bounce buffers.
    let arena = backend.controller().arena().clone();
    let mut held = Vec::new();
    while arena.pages_in_use() < arena.pages() / 2 {
        held.push(backend.controller().alloc(1 << 20).expect("DMA buffer"));
    }
    for size in sizes {
        group.throughput(Throughput::Bytes(size as u64));
        let mut buf = Some(read(IoBuf::new(size)));
        assert!(buf.as_ref().is_some_and(|b| !b.is_dma()));
        group.bench_function(format!("read_{}k/bounce", size >> 10), |b| {
            b.iter(|| buf = Some(read(buf.take().expect("buffer"))))
        });
        let mut dma = backend.controller().alloc(size).expect("DMA buffer");
        let src = IoBuf::new(size);
        group.bench_function(format!("copy_{}k", size >> 10), |b| {
            b.iter(|| dma.as_mut_slice()[..size].copy_from_slice(&src))
        });
    }
    drop(held);
    group.finish();
}

criterion_group!(benches, pcie_backend);
criterion_main!(benches);
