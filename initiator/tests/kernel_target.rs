//! The initiator against the Linux kernel's NVMe/TCP target (nvmet-tcp) running in the QEMU
//! interop guest, exposed on a host port through QEMU's hostfwd.
//!
//! Runs only with `NVMEOF_INTEROP=1` and the guest prepared by `tests/interop/setup.sh`;
//! otherwise it prints why it did nothing.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use common::cli::{Daemon, args, cli, json_of, list};
use common::{HOSTNQN, Mode, Proxy, collect_through, host, pattern};
use nvmeof_initiator::{
    BlockingQueuePair, ConnectOptions, Controller, ControllerState, DiscoveryOptions, Error,
    Namespace, QueuePair, ReconnectPolicy, TargetAddr, Timeouts, discover,
};

const KNQN: &str = "nqn.2014-08.org.nvmexpress:nvmeof-direct-initiator-interop";

fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn guest_sh() -> PathBuf {
    workspace_root().join("tests/interop/guest.sh")
}

/// Stops the guest when dropped (also when a check panics).
struct Guest {
    pidfile: Option<String>,
}

impl Guest {
    fn start(port: u16) -> Guest {
        let script = workspace_root().join("tests/interop/guest-scripts/nvmet-target.sh");
        let out = Command::new(guest_sh())
            .args(["start", "--ready-marker", "NVMET-READY", "--timeout", "300"])
            .arg("--hostfwd")
            .arg(format!("{port}:4420"))
            .arg("--env")
            .arg(format!("NVMET_NQN={KNQN}"))
            .args(["--env", "NVMET_NS_COUNT=1", "--env", "NVMET_NS_SIZE_MB=64"])
            .args([
                "--env",
                "NVMET_MODEL=interop-nvmet",
                "--env",
                "NVMET_BACKEND=brd",
            ])
            .arg(script)
            .output()
            .expect("run guest.sh");
        assert!(
            out.status.success(),
            "guest.sh start failed ({}):\n{}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let pidfile = String::from_utf8_lossy(&out.stdout).trim().to_string();
        Guest {
            pidfile: Some(pidfile),
        }
    }

    fn stop(&mut self) -> Option<i32> {
        let pidfile = self.pidfile.take()?;
        let st = Command::new(guest_sh())
            .args(["stop", "--grace", "30", &pidfile])
            .status()
            .ok()?;
        st.code()
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        self.stop();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

fn options(port: u16) -> ConnectOptions {
    let mut o = ConnectOptions::new(TargetAddr::new("127.0.0.1", port), KNQN, host());
    o.io_queues = Some(2);
    o.queue_depth = 32;
    // The guest runs under emulation: be patient.
    o.timeouts = Timeouts {
        connect: Duration::from_secs(30),
        admin: Duration::from_secs(30),
        io: Duration::from_secs(60),
        shutdown: Duration::from_secs(10),
    };
    o.reconnect = ReconnectPolicy {
        ctrl_loss_timeout: Some(Duration::from_secs(60)),
        ..ReconnectPolicy::default()
    };
    o
}

async fn verify_io(port: u16, hd: bool, dd: bool, max_transfer: Option<u32>, seed: u64) {
    let mut o = options(port);
    o.header_digest = hd;
    o.data_digest = dd;
    o.max_transfer = max_transfer;
    let ctrl = Controller::connect(o).await.expect("connect to nvmet");
    let info = ctrl.info();
    eprintln!(
        "  connected: cntlid {} model {:?} version {} queues {}x{} mdts {:?} max transfer {} in-capsule {} digests {hd}/{dd}",
        info.cntlid,
        info.model,
        info.version,
        info.io_queues,
        info.queue_depth,
        info.mdts_bytes,
        info.max_transfer_bytes,
        info.in_capsule_data_bytes
    );
    assert_eq!(info.subnqn, KNQN);
    assert_eq!((info.header_digest, info.data_digest), (hd, dd));
    assert!(
        !info.sq_flow_control,
        "nvmet disables SQ flow control when asked"
    );
    assert!(info.io_queues >= 1);
    let ns = ctrl.namespace(1).await.expect("namespace 1");
    let bs = ns.block_size() as usize;
    assert_eq!(ns.size_bytes(), 64 << 20);

    // Small (in-capsule), medium and large (R2T, split) transfers, on every queue at once.
    let mut tasks = Vec::new();
    for q in 0..usize::from(info.io_queues) {
        let ns = ns.on_queue(q);
        tasks.push(tokio::spawn(async move {
            let base = (q as u64) * 4096;
            for (i, len) in [bs, 2 * bs, 64 * 1024, 1 << 20].into_iter().enumerate() {
                let lba = base + (i as u64) * 1024;
                let data = pattern(seed + q as u64, lba, len);
                ns.write(lba, &data).await.expect("write");
                let mut back = vec![0u8; len];
                ns.read(lba, &mut back).await.expect("read");
                assert!(back == data, "queue {q}: mismatch for {len} bytes at {lba}");
            }
        }));
    }
    for t in tasks {
        t.await.expect("I/O task");
    }
    ns.flush().await.expect("flush");
    let stats = ctrl.queue_stats();
    let ic: u64 = stats.iter().map(|s| s.in_capsule_writes).sum();
    let r2t: u64 = stats.iter().map(|s| s.r2t_writes).sum();
    let by_data: u64 = stats.iter().map(|s| s.data_completions).sum();
    eprintln!("  in-capsule writes {ic}, R2T writes {r2t}, reads ended by their data {by_data}");
    // With SQ flow control off nvmet ends a successful read with its last data PDU.
    assert!(by_data > 0, "{stats:?}");
    assert!(r2t > 0, "no write was large enough for R2T");
    assert!(ic > 0, "no write travelled in the capsule");
    // nvmet advertises Write Zeroes and Dataset Management, and answers "not supported"
    // (SCT 1, SC 83h) when its backing device cannot do them.
    let unsupported =
        |e: &nvmeof_initiator::Error| e.status().is_some_and(|s| s.sct == 1 && s.sc == 0x83);
    if info.write_zeroes {
        match ns.write_zeroes(10, 4).await {
            Ok(()) => {
                let mut back = vec![0xFFu8; 4 * bs];
                ns.read(10, &mut back).await.expect("read");
                assert!(back.iter().all(|&b| b == 0), "write zeroes left data");
                eprintln!("  write zeroes verified");
            }
            Err(e) if unsupported(&e) => eprintln!("  write zeroes: {e}"),
            Err(e) => panic!("write zeroes: {e}"),
        }
    }
    if info.dataset_management {
        match ns.deallocate(2000, 8).await {
            Ok(()) => eprintln!("  deallocate ok"),
            Err(e) if unsupported(&e) => eprintln!("  deallocate: {e}"),
            Err(e) => panic!("deallocate: {e}"),
        }
    }
    ctrl.disconnect().await.expect("disconnect");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kernel_nvmet_tcp_target() {
    if std::env::var("NVMEOF_INTEROP").as_deref() != Ok("1") {
        eprintln!(
            "skipped: set NVMEOF_INTEROP=1 (after running tests/interop/setup.sh) to run against the kernel target"
        );
        return;
    }
    let port = free_port();
    let started = Instant::now();
    let mut guest = tokio::task::spawn_blocking(move || Guest::start(port))
        .await
        .expect("guest start");
    eprintln!(
        "guest with nvmet-tcp up on 127.0.0.1:{port} after {:?}",
        started.elapsed()
    );

    // Discovery (nvmet answers it on the same port).
    let mut d = DiscoveryOptions::new(TargetAddr::new("127.0.0.1", port), host());
    d.timeouts = options(port).timeouts;
    let log = discover(&d).await.expect("discovery");
    eprintln!(
        "discovery: genctr {}, {} entries",
        log.genctr,
        log.entries.len()
    );
    let e = log
        .entries
        .iter()
        .find(|e| e.subnqn == KNQN)
        .expect("the subsystem is in the discovery log");
    assert_eq!(e.trtype_name(), "tcp");
    assert_eq!(e.trsvcid, "4420");

    for (hd, dd) in [(false, false), (true, true), (true, false), (false, true)] {
        eprintln!("digests header {hd} data {dd}:");
        verify_io(port, hd, dd, None, 100 + u64::from(hd) * 2 + u64::from(dd)).await;
    }
    eprintln!("transfers above a 32 KiB per-command limit:");
    verify_io(port, true, true, Some(32 * 1024), 200).await;

    // Errors from the kernel carry the status.
    let mut o = options(port);
    o.queue_pairs = 2;
    let ctrl = Controller::connect(o).await.expect("connect");
    let ns = ctrl.namespace(1).await.expect("namespace");
    eprintln!("run-to-completion queue pairs:");
    queue_pairs_against_kernel(&ns).await;
    let bs = ns.block_size();
    let mut buf = vec![0u8; bs as usize];
    let e = ns
        .read(ns.num_blocks(), &mut buf)
        .await
        .expect_err("read past the end");
    eprintln!("  read past the end: {e}");
    // nvmet's answer depends on its backend (brd: Internal Error from the block layer); it
    // must be an NVMe status, not a transport failure.
    assert!(e.status().is_some(), "{e:?}");
    let e = ctrl.namespace(77).await.expect_err("inactive namespace");
    eprintln!("  namespace 77: {e}");
    ctrl.disconnect().await.expect("disconnect");

    eprintln!("connections cut with commands in flight:");
    reconnect_against_kernel(port).await;

    eprintln!("GPU request rings (CPU stand-in of the device side):");
    gpu_rings_against_kernel(port).await;

    eprintln!("the nvmeof CLI and nvmeof-initd:");
    cli_against_kernel(port, bs).await;

    let code = tokio::task::spawn_blocking(move || guest.stop())
        .await
        .expect("guest stop");
    assert_eq!(code, Some(0), "the guest script failed");
    eprintln!("kernel target interop passed in {:?}", started.elapsed());
}

/// A run-to-completion queue pair writes a batch of transfers (in the capsule and on R2T) and
/// reads them back; the shared queues and a blocking queue pair on a plain thread read the
/// same data.
async fn queue_pairs_against_kernel(ns: &Namespace) {
    let bs = ns.block_size() as usize;
    let mut qp = QueuePair::open(ns).await.expect("open a queue pair");
    eprintln!(
        "  queue pair on I/O queue {}, depth {}",
        qp.qid(),
        qp.depth()
    );
    let base = 1024u64;
    let extents: Vec<(u64, usize)> = (0..12u64)
        .map(|i| (base + i * 64, [1usize, 2, 16, 64][i as usize % 4]))
        .collect();
    for (i, &(lba, blocks)) in extents.iter().enumerate() {
        let data = pattern(300, lba, blocks * bs);
        qp.write(lba, data, i as u64).expect("submit write");
    }
    let mut done = Vec::new();
    while done.len() < extents.len() {
        qp.wait(&mut done, extents.len(), Some(Duration::from_secs(60)))
            .await;
    }
    for c in done.drain(..) {
        c.result.expect("queue pair write");
    }
    for (i, &(lba, blocks)) in extents.iter().enumerate() {
        qp.read(lba, vec![0; blocks * bs], i as u64)
            .expect("submit read");
    }
    while done.len() < extents.len() {
        qp.wait(&mut done, extents.len(), Some(Duration::from_secs(60)))
            .await;
    }
    for c in &done {
        c.result.as_ref().expect("queue pair read");
        let (lba, blocks) = extents[c.user_data as usize];
        assert!(
            c.buf == pattern(300, lba, blocks * bs),
            "queue pair read at {lba}"
        );
    }
    let stats = qp.stats();
    assert!(
        stats.in_capsule_writes > 0 && stats.r2t_writes > 0,
        "{stats:?}"
    );
    for &(lba, blocks) in &extents {
        let mut back = vec![0u8; blocks * bs];
        ns.read(lba, &mut back).await.expect("shared queue read");
        assert!(
            back == pattern(300, lba, blocks * bs),
            "shared queue read at {lba}"
        );
    }
    let ns2 = ns.clone();
    let read = tokio::task::spawn_blocking(move || {
        let mut qp = BlockingQueuePair::open(&ns2).expect("open a blocking queue pair");
        let mut done = Vec::new();
        for (i, &(lba, blocks)) in extents.iter().enumerate() {
            qp.read(lba, vec![0; blocks * bs], i as u64)
                .expect("submit");
        }
        while done.len() < extents.len() {
            qp.wait(&mut done, extents.len(), Some(Duration::from_secs(60)));
        }
        for c in &done {
            c.result.as_ref().expect("blocking queue pair read");
            let (lba, blocks) = extents[c.user_data as usize];
            assert!(
                c.buf == pattern(300, lba, blocks * bs),
                "blocking read at {lba}"
            );
        }
        qp.get().qid()
    });
    let qid = read.await.expect("blocking queue pair thread");
    eprintln!("  verified through queue pairs {} and {qid}", qp.qid());
}

/// Reconnect and retry against nvmet, through a proxy that holds back what the host sends and
/// then cuts every connection: through the shared queues and through a run-to-completion queue
/// pair, reads in flight are sent again in the new association and return the data, writes in
/// flight fail with `Interrupted` and never reach the target, and I/O goes on; with writes
/// allowed to be retried (`retry_writes`), writes in flight are sent again and land.
async fn reconnect_against_kernel(port: u16) {
    let proxy = Proxy::start(([127, 0, 0, 1], port).into()).await;
    for retry_writes in [false, true] {
        let mut o = options(port);
        o.addr = proxy.target_addr();
        o.io_queues = Some(1);
        o.queue_pairs = 1;
        o.retry_writes = retry_writes;
        let ctrl = Controller::connect(o)
            .await
            .expect("connect through the proxy");
        let ns = ctrl.namespace(1).await.expect("namespace");
        let bs = ns.block_size() as usize;
        // A region the other checks leave alone: 64 blocks read back, and blocks for writes.
        let base = ns.num_blocks() - 4096 + if retry_writes { 2048 } else { 0 };
        let seed = 500 + u64::from(retry_writes) * 10;
        let data = pattern(seed, base, 64 * bs);
        ns.write(base, &data).await.expect("write");
        let wl = base + 1024;
        let old = pattern(seed + 1, wl, 4 * bs);
        ns.write(wl, &old).await.expect("write");
        let mut qp = QueuePair::open(&ns).await.expect("open a queue pair");

        proxy.set_mode(Mode::Blackhole);
        let new = |i: u64| pattern(seed + 2, wl + i, bs);
        let writer = {
            let (ns, d) = (ns.clone(), new(0));
            tokio::spawn(async move { ns.write(wl, &d).await })
        };
        let reader = {
            let ns = ns.clone();
            tokio::spawn(async move {
                let mut back = vec![0u8; 64 * bs];
                ns.read(base, &mut back).await.map(|()| back)
            })
        };
        for i in 0..4u64 {
            qp.read(base + i * 16, vec![0; 16 * bs], i)
                .expect("submit read");
        }
        for i in 1..3u64 {
            qp.write(wl + i, new(i), 3 + i).expect("submit write");
        }
        // Sent now (a queue pair writes its capsules when polled), so that the proxy swallows
        // them while it holds everything back.
        let mut done = Vec::new();
        qp.poll(&mut done);
        tokio::time::sleep(Duration::from_millis(500)).await;
        qp.poll(&mut done);
        assert!(
            done.is_empty() && !writer.is_finished() && !reader.is_finished(),
            "commands held back by the proxy ended"
        );
        proxy.set_mode(Mode::Forward);
        proxy.kill_all();

        let back = reader.await.expect("task").expect("read sent again");
        assert!(back == data, "shared queue read after the reconnect");
        let w = writer.await.expect("task");
        collect_through(&mut qp, &mut done, 6).await;
        done.sort_by_key(|c| c.user_data);
        for c in &done[..4] {
            c.result.as_ref().expect("queue pair read sent again");
            let off = c.user_data as usize * 16 * bs;
            assert!(
                c.buf == data[off..off + 16 * bs],
                "queue pair read {}",
                c.user_data
            );
        }
        let mut back = vec![0u8; 4 * bs];
        if retry_writes {
            w.expect("shared queue write sent again");
            for c in &done[4..] {
                c.result.as_ref().expect("queue pair write sent again");
            }
            ns.read(wl, &mut back).await.expect("read");
            for i in 0..3u64 {
                let o = i as usize * bs;
                assert!(back[o..o + bs] == new(i)[..], "retried write {i} landed");
            }
        } else {
            assert!(
                matches!(
                    w,
                    Err(Error::Interrupted {
                        command: "Write",
                        ..
                    })
                ),
                "{w:?}"
            );
            for c in &done[4..] {
                assert!(
                    matches!(c.result, Err(Error::Interrupted { .. })),
                    "{:?}",
                    c.result
                );
                assert_eq!(c.buf.len(), bs, "an interrupted write's buffer comes back");
            }
            ns.read(wl, &mut back).await.expect("read");
            assert!(back == old, "an interrupted write reached the target");
        }
        assert!(ctrl.reconnects() >= 1);
        ctrl.wait_for_state(Duration::from_secs(60), |s| {
            *s == ControllerState::Connected
        })
        .await
        .expect("connected again");
        // Both APIs go on in the new association.
        qp.read(base, vec![0; bs], 9).expect("submit");
        done.clear();
        collect_through(&mut qp, &mut done, 1).await;
        assert!(done[0].result.is_ok() && done[0].buf == data[..bs]);
        eprintln!(
            "  retry_writes {retry_writes}: reads sent again, writes {} ({} reconnect(s))",
            if retry_writes {
                "sent again"
            } else {
                "interrupted"
            },
            ctrl.reconnects()
        );
        ctrl.disconnect().await.expect("disconnect");
    }
}

/// Reads that threads acting as warps put in GPU request rings (the CPU stand-in of the device
/// side), served by the queue tasks from nvmet: 512 B to 4 KiB reads over many laps, checked
/// against the pattern written first; a request past the bound range gets LBA Out of Range.
async fn gpu_rings_against_kernel(port: u16) {
    use nvmeof_initiator::gpu_ring::proto::status;
    use nvmeof_initiator::gpu_ring::{DataMode, NsBinding, RingConfig, RingSet};

    const SEED: u64 = 300;
    const FILLED: usize = 256 * 1024;
    let ctrl = Controller::connect(options(port)).await.expect("connect");
    let ns = ctrl.namespace(1).await.expect("namespace");
    let bs = ns.block_size() as usize;
    ns.write(0, &pattern(SEED, 0, FILLED)).await.expect("write");
    let blocks = (FILLED / bs) as u64;
    let binding = NsBinding {
        nsid: 1,
        block_size: bs as u32,
        blocks,
    };
    let cfg = RingConfig {
        slots: 8,
        slot_bytes: 4096,
        mode: DataMode::Pull,
    };
    let mut set = RingSet::new_host(2, cfg, &[binding]).expect("ring set");
    let rings = set.standin_rings();
    let attached = ctrl.attach_gpu_rings(&mut set).await.expect("attach");
    let max_blocks = (4096 / bs) as u64;
    let warps: Vec<_> = (0..4u64)
        .map(|w| {
            let ring = rings[w as usize % rings.len()].clone();
            tokio::task::spawn_blocking(move || {
                let mut buf = vec![0u8; 4096];
                for i in 0..100u64 {
                    let n = 1 + (i * 5 + w) % max_blocks;
                    let lba = (i * 131 + w * 17) % (blocks - n + 1);
                    let len = n as usize * bs;
                    let st = ring.read(0, lba, n as u32, &mut buf[..len], Duration::from_secs(60));
                    assert_eq!(st, status::SUCCESS, "warp {w} read {i}: status {st:#x}");
                    assert!(
                        buf[..len] == pattern(SEED, lba * bs as u64, len)[..],
                        "warp {w} read {i} at LBA {lba} differs"
                    );
                }
                let st = ring.read(0, blocks, 1, &mut buf, Duration::from_secs(60));
                assert_eq!(st, status::LBA_OUT_OF_RANGE);
            })
        })
        .collect();
    for w in warps {
        w.await.expect("warp");
    }
    for (i, r) in rings.iter().enumerate() {
        assert!(r.tickets() / 8 >= 25, "ring {i}: {} tickets", r.tickets());
    }
    let reads: u64 = ctrl.queue_stats().iter().map(|s| s.ring_reads).sum();
    assert_eq!(reads, 400);
    eprintln!("  400 ring reads checked over {} rings", rings.len());
    attached.detach().await;
    ctrl.disconnect().await.expect("disconnect");
}

/// What a user does with the kernel target: `nvmeof discover`, `write` and `read` of a file,
/// then `attach`, `list`, `read` by name and `detach` through `nvmeof-initd`.
async fn cli_against_kernel(port: u16, block_size: u32) {
    let port_s = port.to_string();
    let fabric = |mut a: Vec<String>| {
        a.extend(args(&[
            "-t",
            "tcp",
            "-a",
            "127.0.0.1",
            "--trsvcid",
            &port_s,
            "--hostnqn",
            HOSTNQN,
        ]));
        a
    };
    let v = json_of(&cli(fabric(args(&["discover", "-o", "json"])), None).await);
    let records = v["records"].as_array().expect("records");
    assert!(
        records
            .iter()
            .any(|r| r["subnqn"] == KNQN && r["trtype"] == "tcp"),
        "{v}"
    );

    let dir = tempfile::tempdir().unwrap();
    let data = pattern(900, 0, 96 * 1024);
    let count = (data.len() / block_size as usize).to_string();
    let src = dir.path().join("in.bin");
    std::fs::write(&src, &data).unwrap();
    let io = |verb: &str, file: &std::path::Path, extra: &[&str]| {
        let mut a = args(&[
            verb,
            "-n",
            KNQN,
            "--namespace-id",
            "1",
            "--start-block",
            "40",
        ]);
        a.extend(args(extra));
        a.push("--data".into());
        a.push(file.display().to_string());
        fabric(a)
    };
    let out = cli(io("write", &src, &["--flush"]), None).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dst = dir.path().join("out.bin");
    let out = cli(io("read", &dst, &["--blocks", &count]), None).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        std::fs::read(&dst).unwrap() == data,
        "nvmeof read returned other data"
    );
    eprintln!("  discover, write, read: ok");

    let socket = dir.path().join("initd.sock");
    let d = Daemon::start(
        &socket,
        &dir.path().join("state"),
        &dir.path().join("initd.log"),
    );
    d.wait_ready().await;
    let a = fabric(args(&[
        "attach",
        "kern0",
        "-o",
        "json",
        "-n",
        KNQN,
        "--namespace-id",
        "1",
    ]));
    let v = json_of(&cli(a, Some(socket.clone())).await);
    assert_eq!(v["state"], "connected", "{v}\n{}", d.log());
    let devices = list(&socket).await;
    assert_eq!(devices.len(), 1);
    assert_eq!(devices[0]["name"], "kern0");
    assert_eq!(devices[0]["subsystem"], KNQN);
    let blocks = devices[0]["blocks"].as_u64().expect("blocks");
    assert_eq!(blocks * u64::from(block_size), 64 << 20);
    let by_name = dir.path().join("by-name.bin");
    let r = args(&[
        "read",
        "kern0",
        "--start-block",
        "40",
        "--blocks",
        &count,
        "--data",
        &by_name.display().to_string(),
    ]);
    let out = cli(r, Some(socket.clone())).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        std::fs::read(&by_name).unwrap() == data,
        "read by name returned other data"
    );
    let out = cli(args(&["detach", "kern0"]), Some(socket.clone())).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(list(&socket).await.is_empty());
    assert_eq!(d.terminate().await, Some(0));
    eprintln!("  attach, list, read by name, detach: ok");
}
