//! Helpers shared by the integration tests: an in-process target, a fault-injecting TCP proxy,
//! and data patterns.
#![allow(dead_code)]

pub mod cli;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::time::Duration;

use nvmeof_initiator::{
    Completion, ConnectOptions, HostIdentity, QueuePair, ReconnectPolicy, TargetAddr, Timeouts,
};
use nvmeof_target::config::TargetSettings;
use nvmeof_target::{Config, RunningTarget, Target};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

pub const NQN: &str = "nqn.2026-11.io.nvmeof-direct:initiator-test";
pub const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:6f1e8a52-1c1b-4c57-9a0e-3f2d9d1e0b11";
pub const HOSTID: [u8; 16] = [
    0x6f, 0x1e, 0x8a, 0x52, 0x1c, 0x1b, 0x4c, 0x57, 0x9a, 0x0e, 0x3f, 0x2d, 0x9d, 0x1e, 0x0b, 0x11,
];

pub fn host() -> HostIdentity {
    HostIdentity::new(HOSTNQN, HOSTID).expect("host identity")
}

/// Our target, running in this process.
pub struct TestTarget {
    pub running: Option<RunningTarget>,
    pub addr: SocketAddr,
}

impl TestTarget {
    /// Starts a target on `listen` (port 0 for any) exporting `namespaces` under [`NQN`], with
    /// settings adjusted by `tweak`.
    pub fn start_on(
        listen: SocketAddr,
        namespaces: &[&str],
        tweak: impl FnOnce(&mut TargetSettings),
    ) -> TestTarget {
        Self::from_config(&Self::config(listen, namespaces, tweak))
    }

    fn config(
        listen: SocketAddr,
        namespaces: &[&str],
        tweak: impl FnOnce(&mut TargetSettings),
    ) -> Config {
        let listen = format!("tcp://{listen}").parse().expect("listen address");
        let ns: Vec<_> = namespaces
            .iter()
            .map(|s| s.parse().expect("backend spec"))
            .collect();
        let mut cfg = Config::quick(&[listen], NQN, &ns, true, &[]).expect("config");
        cfg.target.reactors = 1;
        tweak(&mut cfg.target);
        cfg
    }

    /// Starts a target with the configuration `cfg`.
    pub fn from_config(cfg: &Config) -> TestTarget {
        let target = Target::build(cfg).expect("target build");
        let listeners = nvmeof_target::launcher::bind(cfg).expect("target bind");
        let addr = listeners[0].addr.addr;
        let running = RunningTarget::start(target, listeners).expect("target start");
        TestTarget {
            running: Some(running),
            addr,
        }
    }

    /// Starts a target on a free loopback port.
    pub fn start(namespaces: &[&str], tweak: impl FnOnce(&mut TargetSettings)) -> TestTarget {
        Self::start_on("127.0.0.1:0".parse().unwrap(), namespaces, tweak)
    }

    pub fn target_addr(&self) -> TargetAddr {
        TargetAddr::new(self.addr.ip().to_string(), self.addr.port())
    }

    pub fn target(&self) -> &Arc<Target> {
        &self.running.as_ref().expect("running").target
    }

    pub async fn shutdown(&mut self) {
        if let Some(r) = self.running.take() {
            r.shutdown().await;
        }
    }
}

/// Connection settings for tests: short timeouts, quick reconnects.
pub fn options(addr: TargetAddr) -> ConnectOptions {
    let mut o = ConnectOptions::new(addr, NQN, host());
    o.io_queues = Some(2);
    o.queue_depth = 32;
    o.timeouts = Timeouts {
        connect: Duration::from_secs(5),
        admin: Duration::from_secs(5),
        io: Duration::from_secs(10),
        shutdown: Duration::from_secs(3),
    };
    o.reconnect = ReconnectPolicy {
        initial_delay: Duration::from_millis(100),
        max_delay: Duration::from_millis(500),
        ctrl_loss_timeout: Some(Duration::from_secs(30)),
    };
    o
}

/// A deterministic pattern: every 8-byte word holds its absolute byte offset and a seed.
pub fn pattern(seed: u64, offset: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    for (i, w) in v.chunks_exact_mut(8).enumerate() {
        let x = (offset + (i as u64) * 8) ^ seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        w.copy_from_slice(&x.to_le_bytes());
    }
    v
}

/// What a [`Proxy`] does with traffic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Mode {
    /// Forward both ways.
    Forward = 0,
    /// Swallow what the host sends (the target sees nothing; the host waits).
    Blackhole = 1,
}

/// A TCP proxy between the initiator and a target that can stall or cut connections.
pub struct Proxy {
    pub addr: SocketAddr,
    mode: Arc<AtomicU8>,
    kill: watch::Sender<u64>,
    /// Bytes sent to the host so far, over all connections.
    pub to_host: Arc<AtomicU64>,
    /// Cut every connection once this many bytes went to the host in total (0: never).
    pub cut_after: Arc<AtomicU64>,
    pub accepted: Arc<AtomicU64>,
}

impl Proxy {
    pub async fn start(upstream: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("proxy bind");
        let addr = listener.local_addr().unwrap();
        let mode = Arc::new(AtomicU8::new(Mode::Forward as u8));
        let (kill, _) = watch::channel(0u64);
        let to_host = Arc::new(AtomicU64::new(0));
        let cut_after = Arc::new(AtomicU64::new(0));
        let accepted = Arc::new(AtomicU64::new(0));
        let p = Proxy {
            addr,
            mode: Arc::clone(&mode),
            kill: kill.clone(),
            to_host: Arc::clone(&to_host),
            cut_after: Arc::clone(&cut_after),
            accepted: Arc::clone(&accepted),
        };
        tokio::spawn(async move {
            loop {
                let Ok((down, _)) = listener.accept().await else {
                    return;
                };
                accepted.fetch_add(1, Ordering::Relaxed);
                let Ok(up) = TcpStream::connect(upstream).await else {
                    continue;
                };
                let _ = down.set_nodelay(true);
                let _ = up.set_nodelay(true);
                tokio::spawn(pump(
                    down,
                    up,
                    Arc::clone(&mode),
                    kill.subscribe(),
                    Arc::clone(&to_host),
                    Arc::clone(&cut_after),
                ));
            }
        });
        p
    }

    pub fn target_addr(&self) -> TargetAddr {
        TargetAddr::new("127.0.0.1", self.addr.port())
    }

    pub fn set_mode(&self, m: Mode) {
        self.mode.store(m as u8, Ordering::SeqCst);
    }

    /// Closes every connection open now.
    pub fn kill_all(&self) {
        self.kill.send_modify(|g| *g += 1);
    }
}

async fn pump(
    down: TcpStream,
    up: TcpStream,
    mode: Arc<AtomicU8>,
    mut kill: watch::Receiver<u64>,
    to_host: Arc<AtomicU64>,
    cut_after: Arc<AtomicU64>,
) {
    let (mut dr, mut dw) = down.into_split();
    let (mut ur, mut uw) = up.into_split();
    let mut a = [0u8; 64 * 1024];
    let mut b = [0u8; 64 * 1024];
    loop {
        tokio::select! {
            _ = kill.changed() => return,
            r = dr.read(&mut a) => {
                let n = match r { Ok(0) | Err(_) => return, Ok(n) => n };
                if mode.load(Ordering::SeqCst) == Mode::Forward as u8
                    && uw.write_all(&a[..n]).await.is_err()
                {
                    return;
                }
            }
            r = ur.read(&mut b) => {
                let n = match r { Ok(0) | Err(_) => return, Ok(n) => n };
                let cut = cut_after.load(Ordering::SeqCst);
                let before = to_host.fetch_add(n as u64, Ordering::SeqCst);
                if cut > 0 && before + n as u64 >= cut {
                    // Deliver up to the cut point, then drop the connection mid-stream.
                    let keep = cut.saturating_sub(before) as usize;
                    let _ = dw.write_all(&b[..keep.min(n)]).await;
                    cut_after.store(0, Ordering::SeqCst);
                    return;
                }
                if dw.write_all(&b[..n]).await.is_err() {
                    return;
                }
            }
        }
    }
}

/// Waits until `qp` has `n` completions in `out` whatever happens to its connection (waits of
/// one second, through reconnects); fails after 60 s without a completion.
pub async fn collect_through(qp: &mut QueuePair, out: &mut Vec<Completion>, n: usize) {
    let mut idle = 0;
    while out.len() < n {
        let got = qp
            .wait(out, n - out.len(), Some(Duration::from_secs(1)))
            .await;
        idle = if got == 0 { idle + 1 } else { 0 };
        assert!(
            idle < 60,
            "no completion within 60 s ({} of {n})",
            out.len()
        );
    }
}
