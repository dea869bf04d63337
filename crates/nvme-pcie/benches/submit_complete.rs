//! Driver CPU cost per 4 KiB read: submit, one doorbell per batch, poll, one doorbell per
//! poll, against the in-memory controller model with data movement off (`discard_data`), so
//! the model only fetches each entry and posts its completion. The model's work is included
//! in the figure, which is therefore an upper bound for the driver's own cost.
//!
//! `cargo bench -p nvme-pcie --bench submit_complete`
// criterion_group! expands to an undocumented public function.
#![allow(missing_docs)]

use std::sync::Arc;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use nvme_pcie::model::{ModelConfig, ModelController};
use nvme_pcie::{Config, Controller, DmaBuf};

fn submit_complete(c: &mut Criterion) {
    let model = Arc::new(ModelController::new(ModelConfig {
        block_size: 4096,
        blocks: 1 << 20,
        discard_data: true,
        ..ModelConfig::default()
    }));
    let ctrl = Controller::new(model, Config::default()).expect("bring-up");
    let ns = ctrl.namespace(1).expect("namespace 1");
    let mut q = ctrl.create_io_queue().expect("queue");
    let mut group = c.benchmark_group("nvme-pcie");
    for batch in [1usize, 32] {
        let mut bufs: Vec<DmaBuf> = (0..batch)
            .map(|_| ctrl.alloc(4096).expect("buffer"))
            .collect();
        let mut lba = 0u64;
        group.throughput(Throughput::Elements(batch as u64));
        group.bench_function(format!("4k_read_batch{batch}"), |b| {
            b.iter(|| {
                for buf in bufs.drain(..) {
                    lba = (lba + 1) & 0xFFFFF;
                    q.read(&ns, lba, 1, buf, lba).expect("submit");
                }
                q.ring();
                q.poll(batch, |c| {
                    debug_assert!(c.result.is_ok());
                    bufs.extend(c.buf);
                });
                assert_eq!(bufs.len(), batch);
            })
        });
    }
    group.finish();
}

criterion_group!(benches, submit_complete);
criterion_main!(benches);
