//! Verified I/O through the nvmeof-direct initiator: the legitimate host that the fault tests
//! keep busy while they mistreat the target in other ways.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use nvmeof_initiator::{ConnectOptions, Controller, HostIdentity, Namespace, TargetAddr};

use crate::TEST_HOSTNQN;

/// A multi-threaded tokio runtime with two workers for the initiator.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// Connects a controller of subsystem `nqn` with `io_queues` I/O queues of 32 entries.
pub async fn connect(addr: SocketAddr, nqn: &str, io_queues: u16) -> Controller {
    let host = HostIdentity::new(TEST_HOSTNQN, [0x42; 16]).expect("host identity");
    let mut opts = ConnectOptions::new(
        TargetAddr::new(addr.ip().to_string(), addr.port()),
        nqn,
        host,
    );
    opts.io_queues = Some(io_queues);
    opts.queue_depth = 32;
    Controller::connect(opts).await.expect("connect")
}

/// Writes a pattern that depends on `round` to one of the first 64 extents of 64 KiB, reads
/// it back and compares. Panics on any error or difference.
pub async fn write_read_verify(ns: &Namespace, round: u64) {
    let bs = u64::from(ns.block_size());
    let blocks = 65536 / bs;
    let lba = (round % 64) * blocks;
    let data: Vec<u8> = (0..65536u64)
        .map(|i| (i.wrapping_mul(31) ^ round) as u8)
        .collect();
    ns.write(lba, &data).await.expect("write");
    let mut back = vec![0u8; data.len()];
    ns.read(lba, &mut back).await.expect("read");
    assert!(
        back == data,
        "read back differs at lba {lba} (round {round})"
    );
}

/// A controller doing [`write_read_verify`] rounds on one namespace until stopped, with a
/// 10 ms pause after each so that it leaves the machine's cores to the rest of the test.
pub struct BusyHost {
    stop: Arc<AtomicBool>,
    rounds: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<Controller>,
}

impl BusyHost {
    /// Connects (one I/O queue) and starts the rounds on namespace `nsid`.
    pub async fn start(addr: SocketAddr, nqn: &str, nsid: u32) -> Self {
        let ctrl = connect(addr, nqn, 1).await;
        let stop = Arc::new(AtomicBool::new(false));
        let rounds = Arc::new(AtomicU64::new(0));
        let (s, r) = (Arc::clone(&stop), Arc::clone(&rounds));
        let task = tokio::spawn(async move {
            let ns = ctrl.namespace(nsid).await.expect("namespace");
            let mut round = 0;
            while !s.load(Ordering::Relaxed) {
                write_read_verify(&ns, round).await;
                round += 1;
                r.store(round, Ordering::Relaxed);
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
            ctrl
        });
        BusyHost { stop, rounds, task }
    }

    /// Rounds completed so far.
    pub fn rounds(&self) -> u64 {
        self.rounds.load(Ordering::Relaxed)
    }

    /// Stops after the current round; panics if a round failed. Returns the controller.
    pub async fn stop(self) -> Controller {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.expect("the busy host failed")
    }
}
