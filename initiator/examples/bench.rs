//! A small load generator for the initiator: random reads of a given size with a given number
//! of commands in flight, then prints IOPS and bandwidth.
//!
//! ```text
//! cargo run --release -p nvmeof-initiator --example bench -- ADDR:PORT NQN \
//!     [BLOCK_BYTES=4096] [INFLIGHT=32] [SECONDS=5] [QUEUES=1] [write]
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use nvmeof_initiator::{ConnectOptions, Controller, HostIdentity, TargetAddr, default_state_dir};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a: Vec<String> = std::env::args().skip(1).collect();
    if a.len() < 2 {
        eprintln!(
            "usage: bench ADDR:PORT NQN [BLOCK_BYTES=4096] [INFLIGHT=32] [SECONDS=5] [QUEUES=1] [write]"
        );
        std::process::exit(2);
    }
    let bs: usize = a.get(2).map_or(Ok(4096), |s| s.parse())?;
    let inflight: usize = a.get(3).map_or(Ok(32), |s| s.parse())?;
    let secs: u64 = a.get(4).map_or(Ok(5), |s| s.parse())?;
    let queues: u16 = a.get(5).map_or(Ok(1), |s| s.parse())?;
    let write = a.get(6).is_some_and(|s| s == "write");

    let host = HostIdentity::load_or_create(&default_state_dir())?;
    let mut opts = ConnectOptions::new(a[0].parse::<TargetAddr>()?, a[1].clone(), host);
    opts.io_queues = Some(queues);
    opts.queue_depth = (inflight as u16 + 1).max(2);
    let ctrl = Controller::connect(opts).await?;
    let ns = ctrl.namespace(1).await?;
    let blocks = (bs / ns.block_size() as usize) as u64;
    let span = ns.num_blocks().min(1 << 20) / blocks.max(1);
    let stop = Arc::new(AtomicBool::new(false));
    let ops = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for w in 0..inflight {
        let ns = ns.on_queue(w % usize::from(queues.max(1)));
        let (stop, ops) = (Arc::clone(&stop), Arc::clone(&ops));
        tasks.push(tokio::spawn(async move {
            let mut buf = vec![0x5Au8; bs];
            let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ w as u64;
            while !stop.load(Ordering::Relaxed) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let lba = (x % span.max(1)) * blocks;
                let r = if write {
                    ns.write(lba, &buf).await
                } else {
                    ns.read(lba, &mut buf).await
                };
                r.expect("I/O");
                ops.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    let t = Instant::now();
    tokio::time::sleep(Duration::from_secs(secs)).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await?;
    }
    let el = t.elapsed().as_secs_f64();
    let n = ops.load(Ordering::Relaxed) as f64;
    println!(
        "{} {bs} B x {inflight} in flight on {queues} queue(s): {:.0} IOPS, {:.1} MiB/s, mean latency {:.1} us",
        if write { "write" } else { "read" },
        n / el,
        n * bs as f64 / el / (1 << 20) as f64,
        el * 1e6 * inflight as f64 / n.max(1.0)
    );
    ctrl.disconnect().await?;
    Ok(())
}
