//! Many threads and tasks on one shared backend: reactor threads with current-thread runtimes,
//! and a multi-thread runtime.

mod common;

use std::sync::Arc;

use blockdev::{AnyBackend, Backend, BackendSpec, FileEngine, IoBuf, open};
use common::pattern_buf;

const THREADS: u64 = 4;
const TASKS: u64 = 6;
const ROUNDS: u8 = 12;
const BLOCKS: u64 = 256;

/// Block `lba` belongs to writer `lba % (THREADS * TASKS)`; neighbouring blocks (same chunk,
/// same file page) belong to different writers.
async fn writer(b: Arc<AnyBackend>, id: u64) {
    let bs = b.block_size() as usize;
    let writers = THREADS * TASKS;
    for round in 0..ROUNDS {
        let seed = (id as u8).wrapping_mul(31).wrapping_add(round);
        for lba in (id..BLOCKS).step_by(writers as usize) {
            let (res, _) = b.write(lba, pattern_buf(seed, lba, 1, bs)).await;
            res.unwrap();
        }
        if round % 4 == 3 {
            b.flush().await.unwrap();
        }
        for lba in (id..BLOCKS).step_by(writers as usize) {
            let (res, buf) = b.read(lba, IoBuf::new(bs)).await;
            res.unwrap();
            assert!(
                buf[..] == pattern_buf(seed, lba, 1, bs)[..],
                "writer {id} block {lba} round {round}"
            );
        }
    }
}

fn final_seed(id: u64) -> u8 {
    (id as u8).wrapping_mul(31).wrapping_add(ROUNDS - 1)
}

fn verify_all(b: &AnyBackend) {
    let bs = b.block_size() as usize;
    common::current_thread().block_on(async {
        let (res, buf) = b.read(0, IoBuf::new(BLOCKS as usize * bs)).await;
        res.unwrap();
        for lba in 0..BLOCKS {
            let id = lba % (THREADS * TASKS);
            let want = pattern_buf(final_seed(id), lba, 1, bs);
            let got = &buf[lba as usize * bs..(lba as usize + 1) * bs];
            assert!(got == &want[..], "block {lba}");
        }
    });
}

/// One current-thread runtime per OS thread, all sharing the backend.
fn reactors(b: Arc<AnyBackend>) {
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let b = b.clone();
            std::thread::spawn(move || {
                common::current_thread().block_on(async move {
                    let tasks: Vec<_> = (0..TASKS)
                        .map(|k| tokio::spawn(writer(b.clone(), t * TASKS + k)))
                        .collect();
                    for task in tasks {
                        task.await.unwrap();
                    }
                })
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    verify_all(&b);
}

/// All writers as tasks of one multi-thread runtime.
fn multi_thread(b: Arc<AnyBackend>) {
    common::multi_thread(4).block_on(async {
        let mut set = tokio::task::JoinSet::new();
        for id in 0..THREADS * TASKS {
            set.spawn(writer(b.clone(), id));
        }
        while let Some(r) = set.join_next().await {
            r.unwrap();
        }
    });
    verify_all(&b);
}

fn memory() -> Arc<AnyBackend> {
    Arc::new(open(&"mem:1M,bs=512".parse().unwrap()).unwrap())
}

fn file(dir: &tempfile::TempDir, opts: &str) -> Arc<AnyBackend> {
    let spec: BackendSpec = format!(
        "file:{},size={}{opts}",
        dir.path().join("ns.img").display(),
        BLOCKS * 4096
    )
    .parse()
    .unwrap();
    let b = open(&spec).unwrap();
    if opts.contains("engine=blocking") {
        let AnyBackend::File(f) = &b else { panic!() };
        assert_eq!(f.engine(), FileEngine::Blocking);
    }
    Arc::new(b)
}

#[test]
fn memory_reactor_threads() {
    reactors(memory());
}

#[test]
fn memory_multi_thread_runtime() {
    multi_thread(memory());
}

#[test]
fn file_uring_reactor_threads() {
    let dir = tempfile::tempdir().unwrap();
    reactors(file(&dir, ""));
}

#[test]
fn file_uring_multi_thread_runtime() {
    let dir = tempfile::tempdir().unwrap();
    multi_thread(file(&dir, ""));
}

#[test]
fn file_uring_512_byte_blocks_multi_thread_runtime() {
    let dir = tempfile::tempdir().unwrap();
    multi_thread(file(&dir, ",bs=512"));
}

#[test]
fn file_blocking_engine_multi_thread_runtime() {
    let dir = tempfile::tempdir().unwrap();
    multi_thread(file(&dir, ",engine=blocking"));
}

#[test]
fn file_buffered_reactor_threads() {
    let dir = tempfile::tempdir().unwrap();
    reactors(file(&dir, ",direct=off"));
}
