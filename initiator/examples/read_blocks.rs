//! Reads blocks from an NVMe/TCP namespace into a buffer and prints a summary.
//!
//! ```text
//! cargo run -p nvmeof-initiator --example read_blocks -- ADDR:PORT NQN [NSID] [START] [COUNT]
//! cargo run -p nvmeof-initiator --example read_blocks -- 127.0.0.1:4420 \
//!     nqn.2026-11.io.nvmeof-direct:default 1 0 256
//! ```
//!
//! Start a target to try it: `target/debug/nvmeof-targetd --listen tcp://127.0.0.1:4420
//! --namespace mem:64M`.

use std::time::Instant;

use nvmeof_initiator::{ConnectOptions, Controller, HostIdentity, TargetAddr, default_state_dir};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let (Some(addr), Some(nqn)) = (args.next(), args.next()) else {
        eprintln!("usage: read_blocks ADDR:PORT NQN [NSID] [START] [COUNT]");
        std::process::exit(2);
    };
    let nsid: u32 = args.next().map_or(Ok(1), |s| s.parse())?;
    let start: u64 = args.next().map_or(Ok(0), |s| s.parse())?;
    let count: u64 = args.next().map_or(Ok(256), |s| s.parse())?;

    // The host identity: /etc/nvme/hostnqn when present, else generated once and stored.
    let host = HostIdentity::load_or_create(&default_state_dir())?;
    let addr: TargetAddr = addr.parse()?;
    let mut opts = ConnectOptions::new(addr, nqn, host);
    opts.io_queues = Some(2);

    let ctrl = Controller::connect(opts).await?;
    let info = ctrl.info();
    println!(
        "connected to {} (controller {}, model {:?}, {} I/O queues of {} entries)",
        info.subnqn, info.cntlid, info.model, info.io_queues, info.queue_depth
    );
    let ns = ctrl.namespace(nsid).await?;
    println!(
        "namespace {}: {} blocks of {} bytes",
        ns.nsid(),
        ns.num_blocks(),
        ns.block_size()
    );

    let mut buf = vec![0u8; (count * u64::from(ns.block_size())) as usize];
    let t = Instant::now();
    ns.read(start, &mut buf).await?;
    let took = t.elapsed();
    let sum = buf.iter().fold(0u64, |acc, &b| {
        acc.wrapping_mul(31).wrapping_add(u64::from(b))
    });
    println!(
        "read {count} blocks ({} bytes) at block {start} in {:.3} ms ({:.1} MiB/s), checksum {sum:016x}",
        buf.len(),
        took.as_secs_f64() * 1e3,
        buf.len() as f64 / took.as_secs_f64() / (1 << 20) as f64
    );
    println!("first bytes: {:02x?}", &buf[..buf.len().min(32)]);

    ctrl.disconnect().await?;
    Ok(())
}
