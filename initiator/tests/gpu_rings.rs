//! GPU request rings served by the queue tasks (`Controller::attach_gpu_rings`), driven by the
//! CPU stand-in of the device side (threads acting as warps, `gpu_ring::standin`) against
//! `nvmeof-targetd` running in this process: data checked against the written pattern, many
//! laps of small rings, bad requests, a target restart with ring reads in flight, detaching
//! with reads in flight, and one set split between two controllers
//! (`Controller::attach_gpu_rings_n`).

mod common;

use std::time::Duration;

use common::{Mode, Proxy, TestTarget, options, pattern};
use nvmeof_initiator::gpu_ring::proto::status;
use nvmeof_initiator::gpu_ring::standin::{DeviceRing, WarpRequest};
use nvmeof_initiator::gpu_ring::{DataMode, NsBinding, RingConfig, RingSet};
use nvmeof_initiator::{Controller, ControllerState, Error, Namespace};

/// Seed of the pattern written before the rings read.
const SEED: u64 = 0x5eed_0013;
/// Bytes written with the pattern from block 0 (the range bound to the rings).
const FILLED: usize = 1 << 20;
/// How long a warp waits for one read.
const WAIT: Duration = Duration::from_secs(30);

/// A 16 MiB file namespace of `bs`-byte blocks.
fn file_backend(dir: &std::path::Path, bs: u32) -> String {
    format!(
        "file:{},size=16M,bs={bs},direct=off",
        dir.join("ns1.img").display()
    )
}

/// Namespace 1 with the pattern written over its first [`FILLED`] bytes.
async fn filled(ctrl: &Controller) -> Namespace {
    let ns = ctrl.namespace(1).await.expect("namespace");
    ns.write(0, &pattern(SEED, 0, FILLED))
        .await
        .expect("write the pattern");
    ns
}

/// `nrings` stand-in rings of `slots` slots of `slot_bytes`, namespace index 0 bound to the
/// filled part of `ns`.
fn ring_set(ns: &Namespace, nrings: u32, slots: u32, slot_bytes: u32) -> RingSet {
    let bs = ns.block_size();
    let binding = NsBinding {
        nsid: ns.nsid(),
        block_size: bs,
        blocks: (FILLED / bs as usize) as u64,
    };
    let cfg = RingConfig {
        slots,
        slot_bytes,
        mode: DataMode::Pull,
    };
    RingSet::new_host(nrings, cfg, &[binding]).expect("ring set")
}

fn next(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// A read of 1..=`max_blocks` blocks at a pseudo-random LBA inside `blocks`.
fn random_read(x: &mut u64, blocks: u64, max_blocks: u32) -> (u64, u32) {
    let n = 1 + (next(x) % u64::from(max_blocks)) as u32;
    let lba = next(x) % (blocks - u64::from(n) + 1);
    (lba, n)
}

/// Checks one completed read against the pattern.
fn check(what: &str, st: u16, lba: u64, data: &[u8], bs: usize) {
    assert_eq!(st, status::SUCCESS, "{what}: status {st:#x}");
    let want = pattern(SEED, lba * bs as u64, data.len());
    assert!(data == &want[..], "{what}: data at LBA {lba} differs");
}

/// Threads acting as warps, `warps` of them over `rings` in turn: each issues `reads` reads
/// (one at a time, or with `batch` > 1 as warp-collective submits of `batch` reads) and checks
/// every one. Returns the reads done.
fn run_warps(rings: &[DeviceRing], warps: usize, reads: usize, batch: usize, bs: usize) -> u64 {
    let blocks = (FILLED / bs) as u64;
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..warps)
            .map(|w| {
                let ring = &rings[w % rings.len()];
                let max_blocks = ring.config().slot_bytes / bs as u32;
                s.spawn(move || {
                    let mut x = 0x9E37_79B9_7F4A_7C15 ^ (w as u64 + 1);
                    let mut buf = vec![0u8; max_blocks as usize * bs];
                    let mut done = 0;
                    while done < reads {
                        let k = batch.min(reads - done);
                        let reqs: Vec<WarpRequest> = (0..k)
                            .map(|_| {
                                let (lba, nblocks) = random_read(&mut x, blocks, max_blocks);
                                WarpRequest {
                                    ns: 0,
                                    lba,
                                    nblocks,
                                    dst: 0,
                                }
                            })
                            .collect();
                        let tickets = if k == 1 {
                            vec![ring.submit(0, reqs[0].lba, reqs[0].nblocks, 0)]
                        } else {
                            ring.submit_warp(&reqs)
                        };
                        for (r, t) in reqs.iter().zip(tickets) {
                            let len = r.nblocks as usize * bs;
                            let st = ring.wait(t, WAIT, &mut buf[..len]);
                            check(&format!("warp {w} read {done}"), st, r.lba, &buf[..len], bs);
                            done += 1;
                        }
                    }
                    done as u64
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("warp")).sum()
    })
}

fn ring_reads(ctrl: &Controller) -> u64 {
    ctrl.queue_stats().iter().map(|s| s.ring_reads).sum()
}

async fn wait_connected(ctrl: &Controller) {
    ctrl.wait_for_state(Duration::from_secs(20), |s| {
        *s == ControllerState::Connected
    })
    .await
    .expect("connected again");
}

/// Six warps over two rings of eight slots: every ring goes round well over a hundred times,
/// with single and warp-collective submits of 512 B to 4 KiB (1..8 blocks of 512 bytes);
/// every read is checked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warps_read_through_rings_over_many_laps() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut t = TestTarget::start(&[&file_backend(dir.path(), 512)], |_| {});
    let ctrl = Controller::connect(options(t.target_addr()))
        .await
        .expect("connect");
    let ns = filled(&ctrl).await;
    let bs = ns.block_size() as usize;
    assert_eq!(bs, 512);
    let mut set = ring_set(&ns, 2, 8, 4096);
    let rings = set.standin_rings();
    let attached = ctrl.attach_gpu_rings(&mut set).await.expect("attach");
    assert_eq!(attached.rings(), 2);
    assert_eq!(attached.queues(), [0, 1], "one ring per I/O queue");
    let devs = rings.clone();
    let single = tokio::task::spawn_blocking(move || run_warps(&devs, 4, 300, 1, bs));
    let devs = rings.clone();
    let collective = tokio::task::spawn_blocking(move || run_warps(&devs, 2, 300, 4, bs));
    let done = single.await.expect("warps") + collective.await.expect("warps");
    assert_eq!(done, 1800);
    for (i, r) in rings.iter().enumerate() {
        let laps = r.tickets() / 8;
        assert!(laps >= 100, "ring {i} went round {laps} times");
    }
    let stats = ctrl.queue_stats();
    assert_eq!(stats.iter().map(|s| s.ring_reads).sum::<u64>(), 1800);
    assert_eq!(stats.iter().map(|s| s.ring_rejected).sum::<u64>(), 0);
    // Ring reads share the queues with ordinary reads.
    let mut back = vec![0u8; 64 * 1024];
    ns.read(8, &mut back).await.expect("read");
    assert!(back == pattern(SEED, 8 * bs as u64, back.len()));
    attached.detach().await;
    // Detached: the rings are closed.
    assert_eq!(
        rings[0].read(0, 0, 1, &mut [0u8; 4096], WAIT),
        status::CLOSED
    );
    ctrl.disconnect().await.expect("disconnect");
    t.shutdown().await;
}

/// What a kernel may write into a ring that is not a valid read gets an error status, never
/// reaches the target, and the ring keeps serving; a ring the controller cannot serve is
/// refused when attached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_statuses() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut t = TestTarget::start(&[&file_backend(dir.path(), 4096)], |_| {});
    let mut o = options(t.target_addr());
    o.io_queues = Some(1);
    let ctrl = Controller::connect(o).await.expect("connect");
    let ns = filled(&ctrl).await;
    let bs = ns.block_size() as usize;
    let blocks = (FILLED / bs) as u64;
    let max_blocks = (4096 / bs) as u32;

    // Bound to more blocks than the namespace has: refused.
    let too_big = NsBinding {
        nsid: 1,
        block_size: bs as u32,
        blocks: ns.num_blocks() + 1,
    };
    let cfg = RingConfig {
        slots: 4,
        slot_bytes: 4096,
        mode: DataMode::Pull,
    };
    let mut set = RingSet::new_host(1, cfg, &[too_big]).expect("ring set");
    let e = ctrl.attach_gpu_rings(&mut set).await.expect_err("refused");
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    // An inactive namespace: refused.
    let absent = NsBinding { nsid: 9, ..too_big };
    let mut set = RingSet::new_host(1, cfg, &[absent]).expect("ring set");
    assert!(ctrl.attach_gpu_rings(&mut set).await.is_err());
    // Push mode needs a ring set on a GPU (the push kernel copies to device memory).
    let push = RingConfig {
        mode: DataMode::Push,
        ..cfg
    };
    let mut set = ring_set(&ns, 1, 4, 4096);
    drop(set.take_host_rings());
    let e = ctrl
        .attach_gpu_rings(&mut set)
        .await
        .expect_err("no rings left");
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    let binding = NsBinding {
        nsid: 1,
        block_size: bs as u32,
        blocks,
    };
    let mut set = RingSet::new_host(1, push, &[binding]).expect("ring set");
    let e = ctrl.attach_gpu_rings(&mut set).await.expect_err("push");
    assert!(
        matches!(e, Error::InvalidArgument(_) | Error::Unsupported(_)),
        "{e}"
    );
    assert_eq!(
        set.take_host_rings().len(),
        1,
        "a refused set keeps its rings"
    );

    let mut set = ring_set(&ns, 1, 4, 4096);
    let ring = set.standin_rings().remove(0);
    let attached = ctrl.attach_gpu_rings(&mut set).await.expect("attach");
    let cases: Vec<(&str, u16)> = vec![
        ("unbound namespace index", status::INVALID_NAMESPACE),
        ("past the bound range", status::LBA_OUT_OF_RANGE),
        ("larger than a slot", status::INVALID_FIELD),
        ("zero blocks", status::INVALID_FIELD),
        ("flags set", status::INVALID_FIELD),
    ];
    let served = tokio::task::spawn_blocking(move || {
        let mut buf = vec![0u8; 4096];
        let got = [
            ring.read(3, 0, 1, &mut buf, WAIT),
            ring.read(0, blocks, 1, &mut buf, WAIT),
            ring.read(0, 0, max_blocks + 1, &mut buf, WAIT),
            ring.read(0, 0, 0, &mut buf, WAIT),
            {
                let t = ring.submit_words(0xFF << 32, 0);
                ring.wait(t, WAIT, &mut buf)
            },
        ];
        // The ring still serves: a good read, many laps later.
        for i in 0..40u64 {
            let lba = (i * 7) % (blocks - 1);
            let st = ring.read(0, lba, 1, &mut buf[..bs], WAIT);
            check("after bad requests", st, lba, &buf[..bs], bs);
        }
        got
    })
    .await
    .expect("warp");
    for ((what, want), got) in cases.iter().zip(served) {
        assert_eq!(got, *want, "{what}: status {got:#x}, expected {want:#x}");
    }
    let stats = ctrl.queue_stats();
    assert_eq!(stats[1].ring_rejected, 5);
    assert_eq!(stats[1].ring_reads, 40);
    attached.detach().await;
    ctrl.disconnect().await.expect("disconnect");
    t.shutdown().await;
}

/// The target goes away with ring reads in flight (a proxy holds them back so they surely
/// are) and comes back on the same port: the reads are sent again on the new connection and
/// the warps see only latency.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ring_reads_survive_a_target_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let spec = file_backend(dir.path(), 4096);
    let mut t = TestTarget::start(&[&spec], |_| {});
    let target_addr = t.addr;
    let proxy = Proxy::start(target_addr).await;
    let ctrl = Controller::connect(options(proxy.target_addr()))
        .await
        .expect("connect");
    let ns = filled(&ctrl).await;
    ns.flush().await.expect("flush");
    let bs = ns.block_size() as usize;
    let mut set = ring_set(&ns, 2, 16, 4096);
    let rings = set.standin_rings();
    let attached = ctrl.attach_gpu_rings(&mut set).await.expect("attach");
    let warps = tokio::task::spawn_blocking(move || run_warps(&rings, 4, 1000, 1, bs));
    while ring_reads(&ctrl) < 100 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    proxy.set_mode(Mode::Blackhole);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!warps.is_finished(), "the warps wait for the target");
    t.shutdown().await;
    proxy.set_mode(Mode::Forward);
    proxy.kill_all();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut t2 = TestTarget::start_on(target_addr, &[&spec], |_| {});
    assert_eq!(warps.await.expect("warps"), 4000);
    wait_connected(&ctrl).await;
    assert!(ctrl.reconnects() >= 1);
    let retries: u64 = ctrl.queue_stats().iter().map(|s| s.retries).sum();
    assert!(retries > 0, "no ring read was in flight across the restart");
    attached.detach().await;
    ctrl.disconnect().await.expect("disconnect");
    t2.shutdown().await;
}

/// Detaching waits for the reads in flight: they complete (here after the connection they
/// were sent on is cut and they are sent again) before the rings are let go; afterwards the
/// rings are closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn detach_lets_reads_in_flight_complete() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut t = TestTarget::start(&[&file_backend(dir.path(), 4096)], |_| {});
    let proxy = Proxy::start(t.addr).await;
    let mut o = options(proxy.target_addr());
    o.io_queues = Some(1);
    let ctrl = Controller::connect(o).await.expect("connect");
    let ns = filled(&ctrl).await;
    let bs = ns.block_size() as usize;
    let mut set = ring_set(&ns, 1, 8, 4096);
    let ring = set.standin_rings().remove(0);
    let attached = ctrl.attach_gpu_rings(&mut set).await.expect("attach");

    proxy.set_mode(Mode::Blackhole);
    let lbas: Vec<u64> = (0..6).map(|i| 100 + i * 9).collect();
    let tickets: Vec<_> = lbas.iter().map(|&lba| ring.submit(0, lba, 1, 0)).collect();
    while ring_reads(&ctrl) < 6 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let detach = tokio::spawn(attached.detach());
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !detach.is_finished(),
        "detach waits for the reads in flight"
    );
    proxy.set_mode(Mode::Forward);
    proxy.kill_all();
    tokio::time::timeout(Duration::from_secs(20), detach)
        .await
        .expect("detach ends once the reads complete")
        .expect("detach task");
    let ring2 = ring.clone();
    tokio::task::spawn_blocking(move || {
        let mut buf = vec![0u8; bs];
        for (t, lba) in tickets.into_iter().zip(lbas) {
            let st = ring2.wait(t, WAIT, &mut buf);
            check("read in flight at detach", st, lba, &buf, bs);
        }
        assert_eq!(ring2.read(0, 0, 1, &mut buf, WAIT), status::CLOSED);
    })
    .await
    .expect("warp");
    assert!(ctrl.reconnects() >= 1);
    ctrl.disconnect().await.expect("disconnect");
    t.shutdown().await;
}

/// One ring set split between two controllers (two targets, each its own file namespace with
/// the same pattern): `attach_gpu_rings_n` gives each a contiguous share, each ring's reads go
/// to the controller serving it, and nothing is left to attach afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_set_split_between_two_controllers() {
    let dirs = [
        tempfile::tempdir().expect("tempdir"),
        tempfile::tempdir().expect("tempdir"),
    ];
    let mut targets: Vec<TestTarget> = dirs
        .iter()
        .map(|d| TestTarget::start(&[&file_backend(d.path(), 512)], |_| {}))
        .collect();
    let mut ctrls = Vec::new();
    for t in &targets {
        let ctrl = Controller::connect(options(t.target_addr()))
            .await
            .expect("connect");
        filled(&ctrl).await;
        ctrls.push(ctrl);
    }
    let ns = ctrls[0].namespace(1).await.expect("namespace");
    let bs = ns.block_size() as usize;
    let mut set = ring_set(&ns, 4, 8, 4096);
    let rings = set.standin_rings();
    let err = ctrls[0].attach_gpu_rings_n(&mut set, 0).await.unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    let first = ctrls[0]
        .attach_gpu_rings_n(&mut set, 2)
        .await
        .expect("attach the first half");
    let second = ctrls[1]
        .attach_gpu_rings_n(&mut set, 2)
        .await
        .expect("attach the second half");
    assert_eq!((first.rings(), second.rings()), (2, 2));
    assert_eq!(set.rings_left(), 0);
    let err = ctrls[1].attach_gpu_rings(&mut set).await.unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    // Rings 0 and 1 are served by the first controller, 2 and 3 by the second.
    let devs = rings[..2].to_vec();
    let a = tokio::task::spawn_blocking(move || run_warps(&devs, 2, 100, 1, bs));
    assert_eq!(a.await.expect("warps"), 200);
    assert_eq!((ring_reads(&ctrls[0]), ring_reads(&ctrls[1])), (200, 0));
    let devs = rings[2..].to_vec();
    let b = tokio::task::spawn_blocking(move || run_warps(&devs, 2, 50, 4, bs));
    assert_eq!(b.await.expect("warps"), 100);
    assert_eq!((ring_reads(&ctrls[0]), ring_reads(&ctrls[1])), (200, 100));
    first.detach().await;
    second.detach().await;
    for c in ctrls {
        c.disconnect().await.expect("disconnect");
    }
    for t in &mut targets {
        t.shutdown().await;
    }
}
