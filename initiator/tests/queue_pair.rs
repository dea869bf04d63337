//! Run-to-completion queue pairs against our target, in process, over loopback TCP: data
//! written and read through a queue pair and through the shared queues agree, from async code
//! and from a plain thread; bad input and a full queue each give their error without losing a
//! buffer; a silent target, a cut connection and a target restart are survived through the
//! controller's reconnect (reads sent again, writes interrupted), and a controller that gives
//! up fails every command clearly.

mod common;

use std::time::Duration;

use common::{Mode, Proxy, TestTarget, collect_through, options, pattern};
use nvmeof_initiator::nvme_spec::status::generic;
use nvmeof_initiator::{BlockingQueuePair, Completion, Controller, Error, QueuePair};

const BS: usize = 4096;

/// Waits until `n` completions are in `out` (each wait bounded).
async fn collect(qp: &mut QueuePair, out: &mut Vec<Completion>, n: usize) {
    while out.len() < n {
        let got = qp
            .wait(out, n - out.len(), Some(Duration::from_secs(20)))
            .await;
        assert!(got > 0 || out.len() >= n, "no completion within 20 s");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_pair_reads_and_writes_agree_with_the_shared_queues() {
    let t = TestTarget::start(&["mem:32M"], |_| {});
    let mut o = options(t.target_addr());
    o.queue_pairs = 1;
    let ctrl = Controller::connect(o).await.expect("connect");
    let ns = ctrl.namespace(1).await.expect("namespace");
    let mut qp = QueuePair::open(&ns).await.expect("open queue pair");
    assert_eq!(qp.qid(), 3, "the first ID past the two shared queues");
    assert_eq!(qp.depth(), 31);

    // Only one queue ID is kept: a second queue pair is refused until the first is dropped.
    let e = QueuePair::open(&ns).await.expect_err("no second queue ID");
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");

    // 31 writes of 1 to 16 blocks (in the capsule and on R2T) in one batch.
    let mut done = Vec::new();
    let mut lba = 0u64;
    let mut extents = Vec::new();
    for i in 0..31u64 {
        let blocks = 1 + (i as usize % 16);
        let data = pattern(7, lba * BS as u64, blocks * BS);
        qp.write(lba, data, i).expect("submit write");
        extents.push((lba, blocks));
        lba += blocks as u64;
    }
    let e = qp
        .read(0, vec![0; BS], 99)
        .expect_err("the queue pair is full");
    assert!(
        matches!(e.error, Error::QueueFull { depth: 31 }),
        "{}",
        e.error
    );
    assert_eq!(e.buf.len(), BS, "a rejected buffer comes back");
    collect(&mut qp, &mut done, 31).await;
    for c in done.drain(..) {
        c.result.expect("write");
    }
    assert_eq!(qp.in_flight(), 0);

    // The shared queues see the data the queue pair wrote...
    for &(lba, blocks) in &extents {
        let mut back = vec![0u8; blocks * BS];
        ns.read(lba, &mut back).await.expect("read");
        assert!(
            back == pattern(7, lba * BS as u64, blocks * BS),
            "lba {lba}"
        );
    }
    // ...and the queue pair reads what they wrote, with many reads in flight.
    let base = 4096u64;
    let all = pattern(9, base * BS as u64, 256 * BS);
    ns.write(base, &all).await.expect("write");
    for i in 0..256u64 {
        qp.read(base + i, vec![0; BS], i).expect("submit read");
        if qp.in_flight() == qp.depth() {
            qp.wait(&mut done, 1, Some(Duration::from_secs(20))).await;
        }
    }
    collect(&mut qp, &mut done, 256).await;
    assert_eq!(done.len(), 256);
    for c in &done {
        c.result.as_ref().expect("read");
        let off = c.user_data as usize * BS;
        assert!(c.buf == all[off..off + BS], "block {}", c.user_data);
    }
    done.clear();
    qp.flush(1).expect("submit flush");
    collect(&mut qp, &mut done, 1).await;
    done.pop().unwrap().result.expect("flush");

    let stats = qp.stats();
    assert_eq!(stats.qid, 3);
    assert_eq!(stats.commands, 31 + 256 + 1);
    assert_eq!(stats.bytes_read, 256 * BS as u64);
    assert!(
        stats.in_capsule_writes > 0 && stats.r2t_writes > 0,
        "{stats:?}"
    );

    // The queue ID is free again once the queue pair is dropped.
    drop(qp);
    let qp = QueuePair::open(&ns).await.expect("reopen");
    assert_eq!(qp.qid(), 3);
    drop(qp);
    ctrl.disconnect().await.expect("disconnect");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_commands_get_clear_answers_and_their_buffers_back() {
    let t = TestTarget::start(&["mem:16M"], |_| {});
    let mut o = options(t.target_addr());
    o.queue_pairs = 2;
    o.max_transfer = Some(64 * 1024);
    let ctrl = Controller::connect(o).await.expect("connect");
    let ns = ctrl.namespace(1).await.expect("namespace");
    let mut qp = QueuePair::open(&ns).await.expect("open");

    for (lba, len) in [(0u64, 100usize), (0, 0), (0, 128 * 1024), (u64::MAX, BS)] {
        let e = qp.read(lba, vec![0; len], 0).expect_err("rejected");
        assert!(matches!(e.error, Error::InvalidArgument(_)), "{}", e.error);
        assert_eq!(e.buf.len(), len);
    }
    // Past the end of the namespace: the controller's status.
    let end = ns.num_blocks();
    qp.read(end, vec![0; BS], 5).expect("submit");
    let mut done = Vec::new();
    collect(&mut qp, &mut done, 1).await;
    let c = done.pop().unwrap();
    assert_eq!(c.user_data, 5);
    let st = c
        .result
        .expect_err("out of range")
        .status()
        .expect("a status");
    assert_eq!(st.sc, generic::LBA_OUT_OF_RANGE);
    assert_eq!(c.buf.len(), BS);
    assert!(qp.is_connected());
    ctrl.disconnect().await.expect("disconnect");
}

/// A data-loader thread with no runtime of its own drives a queue pair; the controller lives
/// on the test's runtime.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocking_queue_pair_on_a_plain_thread() {
    let t = TestTarget::start(&["mem:16M"], |_| {});
    let mut o = options(t.target_addr());
    o.queue_pairs = 2;
    let ctrl = Controller::connect(o).await.expect("connect");
    let ns = ctrl.namespace(1).await.expect("namespace");
    let data = pattern(3, 0, 512 * BS);
    ns.write(0, &data).await.expect("write");

    // Both pairs open at once (a pair closed before the other opens gives its queue ID back).
    let both_open = std::sync::Arc::new(std::sync::Barrier::new(2));
    let threads: Vec<_> = (0..2u64)
        .map(|k| {
            let ns = ns.clone();
            let data = data.clone();
            let both_open = both_open.clone();
            std::thread::spawn(move || {
                let mut qp = BlockingQueuePair::open(&ns).expect("open");
                both_open.wait();
                let mut done = Vec::new();
                let mut verified = 0;
                // Reads of 2 blocks, 16 in flight, reaped with poll and wait by turns.
                let mut next = 0u64;
                while verified < 128 {
                    while next < 128 && qp.in_flight() < 16 {
                        let lba = k * 256 + next * 2;
                        qp.read(lba, vec![0; 2 * BS], lba).expect("submit");
                        next += 1;
                    }
                    if qp.poll(&mut done) == 0 {
                        qp.wait(&mut done, 1, Some(Duration::from_secs(20)));
                    }
                    for c in done.drain(..) {
                        c.result.expect("read");
                        let off = c.user_data as usize * BS;
                        assert!(c.buf == data[off..off + 2 * BS], "lba {}", c.user_data);
                        verified += 1;
                    }
                }
                qp.get().qid()
            })
        })
        .collect();
    let mut qids: Vec<u16> = threads.into_iter().map(|h| h.join().unwrap()).collect();
    qids.sort_unstable();
    assert_eq!(qids, [3, 4]);
    ctrl.disconnect().await.expect("disconnect");
}

/// A file namespace in `dir`, which outlives a target restart.
fn file_backend(dir: &std::path::Path) -> String {
    format!("file:{},size=16M,direct=off", dir.join("ns1.img").display())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_target_times_out_and_the_queue_pair_reconnects() {
    let t = TestTarget::start(&["mem:16M"], |_| {});
    let proxy = Proxy::start(t.addr).await;
    let mut o = options(proxy.target_addr());
    o.queue_pairs = 2;
    o.timeouts.io = Duration::from_millis(500);
    o.timeouts.connect = Duration::from_secs(1);
    o.timeouts.admin = Duration::from_secs(1);
    let ctrl = Controller::connect(o).await.expect("connect");
    let ns = ctrl.namespace(1).await.expect("namespace");
    let data = pattern(5, 0, 64 * BS);
    ns.write(0, &data).await.expect("write");

    // Silent: the command times out during wait, and the connection is given up.
    let mut qp = QueuePair::open(&ns).await.expect("open");
    proxy.set_mode(Mode::Blackhole);
    qp.read(0, vec![0; BS], 1).expect("submit");
    let mut done = Vec::new();
    collect(&mut qp, &mut done, 1).await;
    let c = done.pop().unwrap();
    assert!(
        matches!(c.result, Err(Error::Timeout { .. })),
        "{:?}",
        c.result
    );
    assert_eq!(c.buf.len(), BS);
    assert!(!qp.is_connected());
    assert_eq!(qp.stats().timeouts, 1);

    // The target answers again: commands submitted meanwhile wait for the reconnect of the
    // controller and of the queue pair, then complete with the data.
    proxy.set_mode(Mode::Forward);
    for i in 0..8u64 {
        qp.read(i * 8, vec![0; 8 * BS], i).expect("submit");
    }
    collect_through(&mut qp, &mut done, 8).await;
    for c in done.drain(..) {
        c.result.expect("read after the reconnect");
        let off = c.user_data as usize * 8 * BS;
        assert!(c.buf == data[off..off + 8 * BS], "read {}", c.user_data);
    }
    assert!(qp.is_connected());
    assert_eq!(qp.stats().connections, 2);
    assert!(ctrl.reconnects() >= 1);
    ctrl.disconnect().await.expect("disconnect");
}

/// The connections are cut with reads and writes in flight (held back by the proxy so they
/// surely are): the reads are sent again on the new connection and complete with the data,
/// the writes fail with `Interrupted`, as on the shared queues.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_connection_resends_reads_and_interrupts_writes() {
    let t = TestTarget::start(&["mem:16M"], |_| {});
    let proxy = Proxy::start(t.addr).await;
    let mut o = options(proxy.target_addr());
    o.queue_pairs = 1;
    let ctrl = Controller::connect(o).await.expect("connect");
    let ns = ctrl.namespace(1).await.expect("namespace");
    let data = pattern(6, 0, 64 * BS);
    ns.write(0, &data).await.expect("write");

    let mut qp = QueuePair::open(&ns).await.expect("open");
    proxy.set_mode(Mode::Blackhole);
    for i in 0..8u64 {
        qp.read(i * 8, vec![0; 8 * BS], i).expect("submit read");
    }
    for i in 8..10u64 {
        qp.write(1000 + i, vec![0xAB; BS], i).expect("submit write");
    }
    let mut done = Vec::new();
    qp.poll(&mut done);
    assert!(done.is_empty());
    proxy.kill_all();
    proxy.set_mode(Mode::Forward);
    collect_through(&mut qp, &mut done, 10).await;
    done.sort_by_key(|c| c.user_data);
    for c in &done[..8] {
        c.result
            .as_ref()
            .expect("a read in flight completes after the reconnect");
        let off = c.user_data as usize * 8 * BS;
        assert!(c.buf == data[off..off + 8 * BS], "read {}", c.user_data);
    }
    for c in &done[8..] {
        assert!(
            matches!(c.result, Err(Error::Interrupted { .. })),
            "{:?}",
            c.result
        );
        assert_eq!(c.buf.len(), BS, "an interrupted write's buffer comes back");
    }
    assert!(qp.stats().retries >= 8, "{:?}", qp.stats());
    // The queue pair goes on as before.
    qp.write(2000, vec![0xCD; BS], 20).expect("submit");
    qp.read(2000, vec![0; BS], 21).expect("submit");
    done.clear();
    collect_through(&mut qp, &mut done, 2).await;
    let read = done.iter().find(|c| c.user_data == 21).unwrap();
    read.result.as_ref().expect("read");
    assert!(read.buf.iter().all(|&b| b == 0xCD));
    ctrl.disconnect().await.expect("disconnect");
}

/// The target process goes away and comes back on the same port with the same file: reads
/// in flight and reads submitted while it is down complete on the reconnected queue pair,
/// from async code and from a plain thread, with the data written before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_pairs_survive_a_target_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let spec = file_backend(dir.path());
    let mut t = TestTarget::start(&[&spec], |_| {});
    let port = t.addr;
    let mut o = options(t.target_addr());
    o.queue_pairs = 2;
    let ctrl = Controller::connect(o).await.expect("connect");
    let ns = ctrl.namespace(1).await.expect("namespace");
    let data = pattern(8, 0, 256 * BS);
    let mut qp = QueuePair::open(&ns).await.expect("open");
    for i in 0..16u64 {
        let off = i as usize * 16 * BS;
        qp.write(i * 16, data[off..off + 16 * BS].to_vec(), i)
            .expect("submit");
    }
    qp.flush(99).expect("flush");
    let mut done = Vec::new();
    collect(&mut qp, &mut done, 17).await;
    for c in done.drain(..) {
        c.result.expect("write");
    }

    // A plain thread drives the second queue pair through the restart.
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let (open_tx, open_rx) = tokio::sync::oneshot::channel::<()>();
    let thread = {
        let ns = ns.clone();
        let data = data.clone();
        std::thread::spawn(move || {
            let mut qp = BlockingQueuePair::open(&ns).expect("open");
            open_tx.send(()).unwrap();
            go_rx.recv().expect("the target is down");
            let mut done = Vec::new();
            for i in 0..16u64 {
                qp.read(i * 16, vec![0; 16 * BS], i).expect("submit");
            }
            let mut idle = 0;
            while done.len() < 16 {
                let got = qp.wait(&mut done, 16, Some(Duration::from_secs(1)));
                idle = if got == 0 { idle + 1 } else { 0 };
                assert!(idle < 60, "no completion within 60 s");
            }
            for c in done {
                c.result
                    .expect("read on the plain thread after the restart");
                let off = c.user_data as usize * 16 * BS;
                assert!(c.buf == data[off..off + 16 * BS], "read {}", c.user_data);
            }
            qp.get().stats().connections
        })
    };

    open_rx.await.expect("the thread opened its queue pair");
    t.shutdown().await;
    go_tx.send(()).unwrap();
    for i in 0..16u64 {
        qp.read(i * 16, vec![0; 16 * BS], i)
            .expect("submit while down");
    }
    qp.poll(&mut done);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut t2 = TestTarget::start_on(port, &[&spec], |_| {});
    collect_through(&mut qp, &mut done, 16).await;
    for c in done.drain(..) {
        c.result.expect("read after the restart");
        let off = c.user_data as usize * 16 * BS;
        assert!(c.buf == data[off..off + 16 * BS], "read {}", c.user_data);
    }
    assert!(qp.is_connected());
    assert_eq!(qp.stats().connections, 2);
    assert_eq!(thread.join().expect("thread"), 2);
    drop(qp);
    ctrl.disconnect().await.expect("disconnect");
    t2.shutdown().await;
}

/// The target does not come back: once the controller gives up, every command of the queue
/// pair, in flight or later, fails with `ControllerFailed` and the last error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_pair_commands_fail_clearly_when_reconnecting_gives_up() {
    let mut t = TestTarget::start(&["mem:16M"], |_| {});
    let mut o = options(t.target_addr());
    o.queue_pairs = 1;
    o.reconnect.ctrl_loss_timeout = Some(Duration::from_millis(500));
    let ctrl = Controller::connect(o).await.expect("connect");
    let ns = ctrl.namespace(1).await.expect("namespace");
    let mut qp = QueuePair::open(&ns).await.expect("open");
    t.shutdown().await;
    for i in 0..4u64 {
        qp.read(i, vec![0; BS], i).expect("submit");
    }
    let mut done = Vec::new();
    collect_through(&mut qp, &mut done, 4).await;
    for c in &done {
        match &c.result {
            Err(Error::ControllerFailed { reason, .. }) => assert!(!reason.is_empty()),
            other => panic!("{other:?}"),
        }
        assert_eq!(c.buf.len(), BS);
    }
    assert!(!qp.is_connected());
    assert!(matches!(
        ctrl.state(),
        nvmeof_initiator::ControllerState::Failed { .. }
    ));
    // Later commands fail at once.
    done.clear();
    qp.read(0, vec![0; BS], 9).expect("submit");
    assert_eq!(qp.poll(&mut done), 1);
    assert!(matches!(
        done[0].result,
        Err(Error::ControllerFailed { .. })
    ));
}
