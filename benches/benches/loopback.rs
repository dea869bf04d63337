//! An in-process loopback read: the initiator reads 4 KiB from our target over 127.0.0.1
//! (QD1, one I/O queue, memory namespace). This is the full path of one I/O: host engine,
//! socket, target reactor, queue logic, backend, C2HData, completion.
//!
//! `cargo bench -p nvmeof-bench --bench loopback`
// criterion_group! expands to an undocumented public function.
#![allow(missing_docs)]

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use nvmeof_bench::fabric::{FabricTarget, TargetSpec};
use nvmeof_bench::job::TcpTarget;
use nvmeof_bench::path::{IoPath, TcpPath, TcpSettings};

fn loopback(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let spec = TargetSpec {
        nqn: nvmeof_bench::job::DEFAULT_NQN.into(),
        backend: "mem:64M".parse().expect("valid backend"),
        namespaces: 1,
        reactors: 1,
        poll_us: 0,
        max_queue_depth: 128,
        cpus: None,
        remote_pid: None,
    };
    let target = {
        let _g = rt.enter();
        FabricTarget::start(&TcpTarget::InProcess, &spec).expect("target starts")
    };
    let settings = TcpSettings {
        addrs: vec![target.addr()],
        nqn: spec.nqn.clone(),
        host: nvmeof_bench::path::HostChoice::bench(),
        queue_pairs: 1,
        queue_depth: 32,
        namespaces: 1,
        busy_poll: std::time::Duration::ZERO,
        sq_flow_control: false,
        rtc_pairs: 0,
    };
    let path = rt.block_on(TcpPath::connect(&settings)).expect("connects");
    // Write the blocks once so reads return real data.
    let mut buf = path.alloc(4096);
    for i in 0..64u64 {
        let (r, b) = rt.block_on(path.write(0, 0, i * 4096, buf));
        r.expect("write");
        buf = b;
    }
    let mut g = c.benchmark_group("loopback");
    g.throughput(Throughput::Elements(1));
    g.measurement_time(Duration::from_secs(5));
    let path = Arc::new(path);
    g.bench_function("tcp_read_4k_qd1", |b| {
        b.iter_custom(|iters| {
            // Run the loop as a task on the runtime's thread, where the initiator's queue task
            // lives, as the load generator's workers do (block_on would add a cross-thread
            // wake-up to every I/O).
            let path = Arc::clone(&path);
            rt.block_on(rt.spawn(async move {
                let mut buf = path.alloc(4096);
                let start = Instant::now();
                for i in 0..iters {
                    let (r, b) = path.read(0, 0, (i % 64) * 4096, buf).await;
                    r.expect("read");
                    buf = black_box(b);
                }
                start.elapsed()
            }))
            .expect("the read loop ran")
        })
    });
    g.finish();
    let path = Arc::into_inner(path).expect("no other users left");
    rt.block_on(async {
        let _ = path.disconnect().await;
        target.stop().await;
    });
}

criterion_group!(benches, loopback);
criterion_main!(benches);
