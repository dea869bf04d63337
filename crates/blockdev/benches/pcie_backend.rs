//! CPU cost of a read through the `pcie:` backend (the `Backend` trait on a current-thread
//! runtime, this thread's queue pair, bounce copy from the DMA arena into the caller's buffer)
//! against the driver's controller model with data movement off (`discard_data`), beside the
//! bounce copy alone. The model's work and one `block_on` per read are included, so the read
//! figures are an upper bound for the backend's own cost; the difference to the copy alone is
//! what is not the copy.
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
    let mut group = c.benchmark_group("pcie-backend");
    for size in [4096usize, 128 << 10] {
        group.throughput(Throughput::Bytes(size as u64));
        let mut buf = Some(IoBuf::new(size));
        let mut lba = 0u64;
        group.bench_function(format!("read_{}k", size >> 10), |b| {
            b.iter(|| {
                lba = (lba + 32) & 0xF_FFFF;
                let (r, back) = rt.block_on(backend.read(lba, buf.take().expect("buffer")));
                r.expect("read");
                buf = Some(back);
            })
        });
        let dma = backend.controller().alloc(size).expect("DMA buffer");
        let src = IoBuf::new(size);
        group.bench_function(format!("bounce_copy_{}k", size >> 10), |b| {
            b.iter(|| dma.write(0, &src).expect("copy"))
        });
    }
    group.finish();
}

criterion_group!(benches, pcie_backend);
criterion_main!(benches);
