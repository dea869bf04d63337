//! Callers drive their queue themselves (the initiator's `queue.rs`): many commands polled
//! together in one task, callers that give up while they wait (one of them leading the
//! socket, or holding the round's capsules), and runtime threads that share a queue.

mod common;

use std::future::Future;
use std::pin::Pin;
use std::task::Poll;
use std::time::Duration;

use common::{TestTarget, options, pattern};
use nvmeof_initiator::{Controller, Error, Namespace};

type Read<'a> = Pin<Box<dyn Future<Output = Result<(u64, Vec<u8>), Error>> + Send + 'a>>;

const BLOCKS: u64 = 1024;
const SEED: u64 = 25;

fn read_at(ns: &Namespace, lba: u64) -> Read<'_> {
    Box::pin(async move {
        let mut b = vec![0u8; 4096];
        ns.read(lba, &mut b).await?;
        Ok((lba, b))
    })
}

/// Polls `futs` together in the calling task until every one has ended (their wakers all
/// wake this one task, as a `FuturesUnordered` or `join_all` would).
async fn join_all(futs: Vec<Read<'_>>) -> Vec<Result<(u64, Vec<u8>), Error>> {
    let mut futs: Vec<Option<Read<'_>>> = futs.into_iter().map(Some).collect();
    let mut out = Vec::with_capacity(futs.len());
    std::future::poll_fn(|cx| {
        for slot in futs.iter_mut() {
            if let Some(f) = slot {
                if let Poll::Ready(r) = f.as_mut().poll(cx) {
                    out.push(r);
                    *slot = None;
                }
            }
        }
        if futs.iter().all(Option::is_none) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    })
    .await;
    out
}

/// Polls each of `futs` `passes` times (yielding in between) and drops them all, ended or not.
async fn poll_and_drop(mut futs: Vec<Option<Read<'_>>>, passes: usize) {
    for _ in 0..passes {
        std::future::poll_fn(|cx| {
            for slot in futs.iter_mut() {
                if let Some(f) = slot {
                    if f.as_mut().poll(cx).is_ready() {
                        *slot = None;
                    }
                }
            }
            Poll::Ready(())
        })
        .await;
        tokio::task::yield_now().await;
    }
}

async fn filled(t: &TestTarget, io_queues: u16) -> (Controller, Namespace, Vec<u8>) {
    let mut o = options(t.target_addr());
    o.io_queues = Some(io_queues);
    let ctrl = Controller::connect(o).await.expect("connect");
    let ns = ctrl.namespace(1).await.expect("namespace");
    let data = pattern(SEED, 0, (BLOCKS * 4096) as usize);
    ns.write(0, &data).await.expect("fill");
    (ctrl, ns, data)
}

fn check(data: &[u8], got: Vec<Result<(u64, Vec<u8>), Error>>) {
    for r in got {
        let (lba, b) = r.expect("read");
        let at = (lba * 4096) as usize;
        assert!(b == data[at..at + 4096], "block {lba} differs");
    }
}

/// A current-thread runtime: 3,000 reads polled together by one task, far more than the
/// queue's slots (the rest wait for a tag), every one verified.
#[tokio::test]
async fn many_reads_polled_together_in_one_task() {
    let t = TestTarget::start(&["mem:16M"], |_| {});
    let (ctrl, ns, data) = filled(&t, 1).await;
    let futs = (0..3000u64)
        .map(|i| read_at(&ns, (i * 37) % BLOCKS))
        .collect();
    let got = tokio::time::timeout(Duration::from_secs(60), join_all(futs))
        .await
        .expect("every read ends");
    assert_eq!(got.len(), 3000);
    check(&data, got);
    assert!(ctrl.queue_stats()[1].commands >= 3000);
    ctrl.disconnect().await.expect("disconnect");
}

/// Callers that give up while waiting leave the queue working for the others. Each round
/// polls 24 reads once in this task, then another task starts 24 more, polls them one to
/// three times (one of them may write the round's capsules, or lead the socket) and drops
/// them all, ended or not, and ends: the first 24 all end, with the right data.
#[tokio::test]
async fn callers_that_give_up_while_waiting_leave_the_queue_working() {
    let t = TestTarget::start(&["mem:16M"], |_| {});
    let (ctrl, ns, data) = filled(&t, 1).await;
    for round in 0..30u64 {
        let mut keep: Vec<Option<Read<'_>>> = (0..24u64)
            .map(|i| Some(read_at(&ns, (round * 7 + i * 13) % BLOCKS)))
            .collect();
        let mut early = Vec::new();
        std::future::poll_fn(|cx| {
            for slot in keep.iter_mut() {
                if let Some(f) = slot {
                    if let Poll::Ready(r) = f.as_mut().poll(cx) {
                        early.push(r);
                        *slot = None;
                    }
                }
            }
            Poll::Ready(())
        })
        .await;
        let other = ns.clone();
        let passes = 1 + (round % 3) as usize;
        tokio::spawn(async move {
            let doomed = (0..24u64)
                .map(|i| Some(read_at(&other, (round * 24 + i) % BLOCKS)))
                .collect();
            poll_and_drop(doomed, passes).await;
        })
        .await
        .expect("task");
        let keep: Vec<Read<'_>> = keep.into_iter().flatten().collect();
        let got = tokio::time::timeout(Duration::from_secs(5), join_all(keep))
            .await
            .unwrap_or_else(|_| panic!("round {round}: reads beside abandoned ones hang"));
        check(&data, early);
        check(&data, got);
    }
    ctrl.disconnect().await.expect("disconnect");
}

/// A multi-thread runtime with more threads than queues: threads share a queue, so a caller
/// sometimes finds the engine held by another thread and hands its command to the queue's
/// task instead; every read ends with the right data.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn threads_that_share_a_queue_all_get_their_reads() {
    let t = TestTarget::start(&["mem:16M"], |_| {});
    let (ctrl, ns, data) = filled(&t, 2).await;
    let data = std::sync::Arc::new(data);
    let mut tasks = tokio::task::JoinSet::new();
    for w in 0..32u64 {
        let ns = ns.clone();
        let data = std::sync::Arc::clone(&data);
        tasks.spawn(async move {
            for i in 0..100u64 {
                let lba = (w * 131 + i * 17) % BLOCKS;
                let mut b = vec![0u8; 4096];
                ns.read(lba, &mut b).await.expect("read");
                let at = (lba * 4096) as usize;
                assert!(b == data[at..at + 4096], "worker {w}: block {lba} differs");
            }
        });
    }
    let all = async {
        while let Some(r) = tasks.join_next().await {
            r.expect("task");
        }
    };
    tokio::time::timeout(Duration::from_secs(60), all)
        .await
        .expect("every task ends");
    let commands: u64 = ctrl.queue_stats()[1..].iter().map(|s| s.commands).sum();
    assert!(commands >= 3200);
    ctrl.disconnect().await.expect("disconnect");
}

/// `read_many`: 3,000 scattered 4 KiB reads (far more than the queue's slots) and two 1 MiB
/// ranges above the controller's maximum transfer (64 KiB), into slices and into vectors (lent to the
/// queue), in one future; every byte checked.
#[tokio::test]
async fn read_many_reads_scattered_ranges_in_one_future() {
    let t = TestTarget::start(&["mem:16M"], |s| s.mdts_kib = 64);
    let (ctrl, ns, data) = filled(&t, 1).await;
    let lbas: Vec<u64> = (0..3000u64).map(|i| (i * 37) % BLOCKS).collect();
    let mut buf = vec![0u8; lbas.len() * 4096];
    let reads = lbas.iter().copied().zip(buf.chunks_mut(4096));
    tokio::time::timeout(Duration::from_secs(60), ns.read_many(reads))
        .await
        .expect("read_many ends")
        .expect("read_many");
    for (lba, b) in lbas.iter().zip(buf.chunks(4096)) {
        let at = (lba * 4096) as usize;
        assert!(b == &data[at..at + 4096], "block {lba} differs");
    }
    // Vectors lend themselves to the queue; the 1 MiB ranges are split.
    let ranges = [(3u64, 256usize), (700, 1), (500, 256), (1023, 1)];
    let mut vecs: Vec<Vec<u8>> = ranges.iter().map(|r| vec![0u8; r.1 * 4096]).collect();
    let before = ctrl.queue_stats()[1].commands;
    ns.read_many(ranges.iter().map(|r| r.0).zip(vecs.iter_mut()))
        .await
        .expect("read_many into vectors");
    for ((lba, blocks), v) in ranges.iter().zip(&vecs) {
        let at = (lba * 4096) as usize;
        assert!(
            v[..] == data[at..at + blocks * 4096],
            "range at {lba} differs"
        );
    }
    let sent = ctrl.queue_stats()[1].commands - before;
    assert_eq!(sent, 2 * 16 + 2, "the 1 MiB ranges go in 64 KiB commands");
    ctrl.disconnect().await.expect("disconnect");
}

/// Bad ranges are refused before anything is sent: none of the batch's reads goes out.
#[tokio::test]
async fn read_many_refuses_a_batch_with_a_bad_range_before_sending() {
    let t = TestTarget::start(&["mem:16M"], |_| {});
    let (ctrl, ns, _) = filled(&t, 1).await;
    let before = ctrl.queue_stats()[1].commands;
    let mut bufs = [vec![0u8; 4096], vec![0u8; 4096], vec![0u8; 100]];
    let [a, b, c] = &mut bufs;
    let r = ns
        .read_many([(0u64, &mut a[..]), (1, &mut b[..]), (2, &mut c[..])])
        .await;
    assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
    let [a, b, _] = &mut bufs;
    let r = ns
        .read_many([(0u64, &mut a[..]), (u64::MAX, &mut b[..])])
        .await;
    assert!(r.is_err(), "a range past the end was accepted");
    assert_eq!(ctrl.queue_stats()[1].commands, before);
    ctrl.disconnect().await.expect("disconnect");
}

/// Batches of several tasks on one queue, each far larger than the queue's slots, in a
/// current-thread and a multi-thread runtime: a batch waits for a slot only when it holds
/// none whose command it has not looked at, so batches never wait on each other's slots.
#[test]
fn read_many_batches_sharing_a_queue_all_end() {
    for threads in [1usize, 4] {
        let rt = if threads == 1 {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
        } else {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(threads)
                .enable_all()
                .build()
        }
        .expect("runtime");
        rt.block_on(async {
            let t = TestTarget::start(&["mem:16M"], |_| {});
            let (ctrl, ns, data) = filled(&t, 1).await;
            let data = std::sync::Arc::new(data);
            let mut tasks = tokio::task::JoinSet::new();
            for w in 0..8u64 {
                let (ns, data) = (ns.clone(), std::sync::Arc::clone(&data));
                tasks.spawn(async move {
                    for round in 0..4u64 {
                        let lbas: Vec<u64> = (0..500u64)
                            .map(|i| (w * 131 + round * 7 + i * 17) % BLOCKS)
                            .collect();
                        let mut buf = vec![0u8; lbas.len() * 4096];
                        ns.read_many(lbas.iter().copied().zip(buf.chunks_mut(4096)))
                            .await
                            .expect("read_many");
                        for (lba, b) in lbas.iter().zip(buf.chunks(4096)) {
                            let at = (lba * 4096) as usize;
                            assert!(b == &data[at..at + 4096], "task {w}: block {lba} differs");
                        }
                    }
                });
            }
            let all = async {
                while let Some(r) = tasks.join_next().await {
                    r.expect("task");
                }
            };
            tokio::time::timeout(Duration::from_secs(60), all)
                .await
                .unwrap_or_else(|_| panic!("{threads} threads: batches sharing a queue hang"));
            ctrl.disconnect().await.expect("disconnect");
        });
    }
}
