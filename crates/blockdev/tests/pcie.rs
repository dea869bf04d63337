//! The NVMe PCIe backend over the driver's in-memory controller model (the same driver that
//! runs against a real controller through VFIO; see `tests/tests/nvme_pcie_vfio.rs` for that):
//! one queue pair per reactor thread, transfers split at the controller's limit, back-pressure
//! from full queues, statuses mapped to NVMe, futures dropped with commands in flight, reads
//! handed over in DMA memory, native Write Zeroes and Deallocate, and timeouts.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use blockdev::{Backend, BackendError, BackendSpec, IoBuf, PcieBackend, StatusHint};
use common::pattern_buf;
use nvme_pcie::model::{Fault, ModelConfig, ModelController};
use nvme_pcie::{Config, Device};
use nvme_spec::Status;
use nvme_spec::opcode::io;

/// 8192 blocks of 512 bytes, 16 KiB per command (MDTS 2), queues of `queue_size` entries.
fn backend(max_queues: u16, queue_size: u32) -> (Arc<ModelController>, Arc<PcieBackend>) {
    let model = Arc::new(ModelController::new(ModelConfig {
        mdts: 2,
        max_queues,
        ..ModelConfig::default()
    }));
    let config = Config {
        io_queues: 8,
        io_queue_size: queue_size,
        arena_size: 8 << 20,
        ..Config::default()
    };
    let dev: Arc<dyn Device> = model.clone();
    let b = PcieBackend::with_device(dev, config, None, "model".into()).expect("bring-up");
    (model, Arc::new(b))
}

fn current_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Each of `threads` reactor threads runs `tasks` tasks that write their own blocks with
/// transfers of 1 to 80 blocks (above the 32-block limit: split), read them back and compare.
fn reactors(b: &Arc<PcieBackend>, threads: u64, tasks: u64) {
    std::thread::scope(|s| {
        for t in 0..threads {
            let b = b.clone();
            s.spawn(move || {
                current_thread().block_on(async move {
                    let mut set = tokio::task::JoinSet::new();
                    for k in 0..tasks {
                        let b = b.clone();
                        let region = (t * tasks + k) * 160;
                        set.spawn(async move {
                            for (i, blocks) in [1u64, 8, 33, 80, 2].into_iter().enumerate() {
                                let lba = region + i as u64 * 16;
                                let seed = (t * 17 + k * 5 + i as u64) as u8;
                                let data = pattern_buf(seed, lba, blocks, 512);
                                let (r, data) = b.write(lba, data).await;
                                r.unwrap();
                                let (r, got) = b.read(lba, IoBuf::new(data.len())).await;
                                r.unwrap();
                                assert!(got[..] == data[..], "thread {t} task {k} lba {lba}");
                            }
                            b.flush().await.unwrap();
                        });
                    }
                    while let Some(r) = set.join_next().await {
                        r.unwrap();
                    }
                });
            });
        }
    });
}

#[test]
fn one_queue_pair_per_reactor_thread_with_split_transfers() {
    let (model, b) = backend(8, 4);
    reactors(&b, 3, 4);
    assert_eq!(b.queue_pairs(), 3);
    assert_eq!(model.io_queues(), 3);
    // What the controller stored is what was written (thread 2, task 3, first transfer).
    let lba = (2 * 4 + 3) * 160;
    let mut media = vec![0u8; 512];
    model.read_media(lba as usize * 512, &mut media);
    assert!(media[..] == pattern_buf((2 * 17 + 3 * 5) as u8, lba, 1, 512)[..]);
    assert_eq!(b.block_size(), 512);
    assert_eq!(b.num_blocks(), 8192);
}

#[test]
fn threads_share_queue_pairs_once_the_controller_has_no_more() {
    let (model, b) = backend(2, 8);
    reactors(&b, 4, 2);
    assert_eq!(b.queue_pairs(), 2);
    assert_eq!(model.io_queues(), 2);
}

#[test]
fn statuses_and_bad_requests() {
    let (model, b) = backend(4, 8);
    let rt = current_thread();
    rt.block_on(async {
        let (r, _) = b.read(8190, IoBuf::new(4096)).await;
        assert!(matches!(r, Err(BackendError::OutOfRange { .. })), "{r:?}");
        let (r, _) = b.write(0, IoBuf::new(100)).await;
        assert!(
            matches!(r, Err(BackendError::InvalidLength { .. })),
            "{r:?}"
        );
        for (opcode, hint) in [
            (io::READ, StatusHint::UnrecoveredReadError),
            (io::WRITE, StatusHint::WriteFault),
        ] {
            model.inject(Fault::Status {
                admin: false,
                opcode,
                status: Status::media(0x81),
            });
            let (r, _) = if opcode == io::READ {
                b.read(0, IoBuf::new(512)).await
            } else {
                b.write(0, IoBuf::new(512)).await
            };
            let e = r.unwrap_err();
            assert_eq!(e.status_hint(), hint, "{e}");
        }
        // A generic error status from the controller is this target's internal error.
        model.inject(Fault::Status {
            admin: false,
            opcode: io::FLUSH,
            status: Status::generic(0x06),
        });
        let e = b.flush().await.unwrap_err();
        assert_eq!(e.status_hint(), StatusHint::InternalError, "{e}");
        // Everything works again afterwards.
        let (r, _) = b.write(0, pattern_buf(9, 0, 4, 512)).await;
        r.unwrap();
        b.write_zeroes(1, 40).await.unwrap();
        b.deallocate(64, 8).await.unwrap();
        assert!(b.deallocate(8190, 8).await.is_err());
        let (r, got) = b.read(0, IoBuf::new(42 * 512)).await;
        r.unwrap();
        assert!(got[..512] == pattern_buf(9, 0, 1, 512)[..]);
        assert!(got[512..].iter().all(|&x| x == 0));
    });
}

#[test]
fn dropped_futures_leave_no_memory_behind() {
    let model = Arc::new(ModelController::new(ModelConfig {
        mdts: 2,
        ..ModelConfig::default()
    }));
    let config = Config {
        io_timeout: std::time::Duration::from_millis(50),
        arena_size: 8 << 20,
        ..Config::default()
    };
    let dev: Arc<dyn Device> = model.clone();
    let b = PcieBackend::with_device(dev, config, None, "model".into()).unwrap();
    // Arena pages not kept for reuse.
    let pages =
        |b: &PcieBackend| b.controller().arena().pages_in_use() - b.pooled_dma_bytes() / 4096;
    current_thread().block_on(async {
        // Warm up: the thread's queue pair exists.
        b.flush().await.unwrap();
        let idle = pages(&b);
        // One command, and a split one of which the controller completes all but one: the
        // controller keeps the lost command until the driver aborts it.
        for blocks in [1usize, 40] {
            model.inject(Fault::Lose {
                admin: false,
                opcode: io::READ,
            });
            let mut fut = Box::pin(b.read(0, IoBuf::new(blocks * 512)));
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            assert!(fut.as_mut().poll(&mut cx).is_pending());
            assert!(pages(&b) > idle);
            drop(fut);
        }
        // Later requests reap the abandoned commands once aborted, and free their buffers.
        for _ in 0..100 {
            let (r, _) = b.read(0, IoBuf::new(512)).await;
            r.unwrap();
            if pages(&b) == idle {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert_eq!(pages(&b), idle);
    });
}

#[test]
fn spec_names_a_pci_function_that_must_be_bound_to_vfio() {
    let spec: BackendSpec = "pcie:0000:0A:1f.7,nsid=2".parse().unwrap();
    assert_eq!(
        spec,
        BackendSpec::Pcie {
            address: "0000:0a:1f.7".into(),
            nsid: Some(2)
        }
    );
    assert_eq!(spec.to_string(), "pcie:0000:0a:1f.7,nsid=2");
    // A function that does not exist: one line naming it, no panic.
    let spec: BackendSpec = "pcie:0000:ff:1f.7".parse().unwrap();
    let e = blockdev::open(&spec).unwrap_err().to_string();
    assert!(
        e.contains("pcie:0000:ff:1f.7") && e.contains("no such PCI function"),
        "{e}"
    );
    assert!(!e.contains('\n'), "{e}");
    for bad in [
        "pcie:",
        "pcie:00:01.0",
        "pcie:0000:00:20.0",
        "pcie:0000:00:01.8",
        "pcie:0000:00:1.0",
        "pcie:0000:00:01.0,nsid=0",
        "pcie:0000:00:01.0,nsid=x",
        "pcie:0000:00:01.0,bs=512",
    ] {
        assert!(bad.parse::<BackendSpec>().is_err(), "{bad}");
    }
    #[derive(serde::Deserialize)]
    struct Ns {
        backend: BackendSpec,
    }
    let ns: Ns =
        toml::from_str("[backend]\nkind = \"pcie\"\naddress = \"0000:01:00.0\"\n").unwrap();
    assert_eq!(ns.backend.to_string(), "pcie:0000:01:00.0");
    assert!(toml::from_str::<Ns>("[backend]\nkind = \"pcie\"\naddress = \"1:0.0\"\n").is_err());
}

#[test]
fn a_failed_controller_is_reset_and_queue_pairs_replaced() {
    let (model, b) = backend(4, 8);
    current_thread().block_on(async {
        let (r, _) = b.write(0, pattern_buf(3, 0, 2, 512)).await;
        r.unwrap();
        for round in 0..2 {
            // CSTS.CFS with a command in flight: that command fails, nothing hangs.
            model.inject(Fault::Fatal);
            let (r, _) = b.read(0, IoBuf::new(1024)).await;
            let e = r.unwrap_err();
            assert_eq!(e.status_hint(), StatusHint::InternalError, "{e}");
            assert!(b.controller().is_failed());
            if round == 1 {
                // A second failure within the reset interval fails at once, without a reset.
                let (r, _) = b.read(0, IoBuf::new(1024)).await;
                assert!(r.unwrap_err().to_string().contains("controller failed"));
                tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
            }
            // The next request resets the controller, replaces the dead pair and succeeds.
            let (r, got) = b.read(0, IoBuf::new(1024)).await;
            r.unwrap();
            assert!(got[..] == pattern_buf(3, 0, 2, 512)[..]);
            assert!(!b.controller().is_failed());
            assert_eq!(model.io_queues(), 1);
        }
    });
}

fn model_backend(model: ModelConfig, config: Config) -> (Arc<ModelController>, PcieBackend) {
    let model = Arc::new(ModelController::new(model));
    let dev: Arc<dyn Device> = model.clone();
    let b = PcieBackend::with_device(dev, config, None, "model".into()).expect("bring-up");
    (model, b)
}

#[test]
fn reads_hand_over_dma_memory_and_reuse_it_without_copies() {
    // 16 KiB per command; an 8 MiB arena, so that lending stops at 4 MiB in use.
    let (model, b) = model_backend(
        ModelConfig {
            mdts: 2,
            ..ModelConfig::default()
        },
        Config {
            arena_size: 8 << 20,
            ..Config::default()
        },
    );
    current_thread().block_on(async {
        let (r, data) = b.write(0, pattern_buf(5, 0, 64, 512)).await;
        r.unwrap();
        // A read from ordinary memory comes back in arena memory holding the data.
        let (r, got) = b.read(0, IoBuf::new(8192)).await;
        r.unwrap();
        assert!(got.is_dma());
        assert!(got[..] == data[..8192]);
        // Passed back for a write, the device reads that very buffer...
        let mut got = got;
        got[..512].fill(0xA5);
        let at = got.as_ptr();
        let (r, back) = b.write(100, got).await;
        r.unwrap();
        assert!(back.is_dma() && back.as_ptr() == at);
        let mut media = vec![0u8; 512];
        model.read_media(100 * 512, &mut media);
        assert!(media.iter().all(|&x| x == 0xA5));
        // ... and for a read, it writes into it.
        let (r, again) = b.read(8, back).await;
        r.unwrap();
        assert!(again.as_ptr() == at && again[..] == data[8 * 512..8 * 512 + 8192]);
        // Clones live on the heap.
        assert!(!again.clone().is_dma());
        // A read above the transfer limit (two commands) fills the caller's buffer.
        let mine = IoBuf::new(64 * 512);
        let ptr = mine.as_ptr();
        let (r, got) = b.read(0, mine).await;
        r.unwrap();
        assert!(!got.is_dma() && got.as_ptr() == ptr && got[..] == data[..]);
        // Lending stops at half the arena: buffers held by callers are bounded.
        let mut held = Vec::new();
        let arena = b.controller().arena();
        while held.len() < 10_000 {
            let (r, got) = b.read(0, IoBuf::new(16384)).await;
            r.unwrap();
            assert!(got[..] == data[..16384]);
            if !got.is_dma() {
                break;
            }
            held.push(got);
        }
        assert!(!held.is_empty() && held.len() < 10_000);
        assert!(arena.pages_in_use() >= arena.pages() / 2);
        drop(held);
        assert!(arena.pages_in_use() < arena.pages() / 2);
        let (r, got) = b.read(0, IoBuf::new(512)).await;
        r.unwrap();
        assert!(got.is_dma());
    });
}

#[test]
fn write_zeroes_deallocate_fua_and_cache_follow_the_controller() {
    for native in [true, false] {
        let (model, b) = model_backend(
            ModelConfig {
                mdts: 2,
                oncs: if native {
                    nvme_spec::identify::ONCS_WRITE_ZEROES | nvme_spec::identify::ONCS_DSM
                } else {
                    0
                },
                volatile_write_cache: native,
                ..ModelConfig::default()
            },
            Config::default(),
        );
        assert_eq!(b.volatile_write_cache(), native);
        assert!(!b.deallocate_reads_zeroes());
        current_thread().block_on(async {
            let data = pattern_buf(7, 0, 200, 512);
            let (r, data) = b.write(0, data).await;
            r.unwrap();
            let writes = model.io_commands(io::WRITE);
            b.write_zeroes(10, 100).await.unwrap();
            b.deallocate(150, 20).await.unwrap();
            b.write_zeroes(0, 0).await.unwrap();
            assert!(b.write_zeroes(8190, 4).await.is_err());
            assert!(b.deallocate(8190, 4).await.is_err());
            b.flush().await.unwrap();
            // Force Unit Access on each command of a split write, no Flush.
            let (r, _) = b.write_fua(300, pattern_buf(8, 300, 40, 512)).await;
            r.unwrap();
            assert_eq!(model.fua_writes(), 2);
            let (r, got) = b.read(300, IoBuf::new(40 * 512)).await;
            r.unwrap();
            assert!(got[..] == pattern_buf(8, 300, 40, 512)[..]);
            let (r, got) = b.read(0, IoBuf::new(200 * 512)).await;
            r.unwrap();
            for block in 0..200 {
                let span = block * 512..(block + 1) * 512;
                let zero = (10..110).contains(&block) || (native && (150..170).contains(&block));
                if zero {
                    assert!(got[span].iter().all(|&x| x == 0), "block {block}");
                } else {
                    assert!(got[span.clone()] == data[span], "block {block}");
                }
            }
            // Natively one Write Zeroes and one Dataset Management command; otherwise zeroed
            // writes of at most 32 blocks each and no command for the hint.
            let (wz, dsm, extra_writes) = if native { (1, 1, 0) } else { (0, 0, 4) };
            assert_eq!(model.io_commands(io::WRITE_ZEROES), wz);
            assert_eq!(model.io_commands(io::DATASET_MANAGEMENT), dsm);
            assert_eq!(model.io_commands(io::WRITE) - writes, extra_writes + 2);
            assert_eq!(model.io_commands(io::FLUSH), 1);
        });
    }
}

/// Polls `fut` on the current runtime to completion, counting its polls.
async fn counting_polls<F: std::future::Future>(fut: F) -> (F::Output, u64) {
    let mut fut = std::pin::pin!(fut);
    let mut polls = 0;
    let out = std::future::poll_fn(|cx| {
        polls += 1;
        fut.as_mut().poll(cx)
    })
    .await;
    (out, polls)
}

#[test]
fn lost_commands_and_a_stopped_controller_fail_callers_without_spinning() {
    let (model, b) = model_backend(
        ModelConfig::default(),
        Config {
            io_timeout: Duration::from_millis(300),
            admin_timeout: Duration::from_millis(100),
            ..Config::default()
        },
    );
    current_thread().block_on(async {
        let (r, _) = b.write(0, pattern_buf(1, 0, 1, 512)).await;
        r.unwrap();
        // A lost completion: aborted after the timeout, the caller gets the abort status.
        model.inject(Fault::Lose {
            admin: false,
            opcode: io::READ,
        });
        let t0 = Instant::now();
        let ((r, _), polls) = counting_polls(b.read(0, IoBuf::new(512))).await;
        let waited = t0.elapsed();
        let e = r.unwrap_err();
        assert!(e.to_string().to_lowercase().contains("abort"), "{e}");
        assert!(waited >= Duration::from_millis(300), "{waited:?}");
        // Waiting on an idle device is not a busy loop: after spinning 1 ms, about one
        // poll per millisecond (a busy loop polls hundreds of thousands of times).
        let bound = 2 * waited.as_millis() as u64 + 10_000;
        assert!(polls < bound, "{polls} polls in {waited:?}");
        // A controller that stops answering: Abort times out, the controller is reset, the
        // caller gets an error; the next request runs on a new queue pair.
        model.inject(Fault::Hang);
        let (r, _) = b.write(0, pattern_buf(2, 0, 1, 512)).await;
        let e = r.unwrap_err();
        assert_eq!(e.status_hint(), StatusHint::InternalError, "{e}");
        let (r, got) = b.read(0, IoBuf::new(512)).await;
        r.unwrap();
        assert!(got[..] == pattern_buf(1, 0, 1, 512)[..]);
        assert!(!b.controller().is_failed());
    });
}

#[test]
fn namespaces_of_one_controller_share_its_queue_pairs() {
    let (model, a) = model_backend(ModelConfig::default(), Config::default());
    let b = a.share(Some(1)).unwrap();
    assert!(a.share(Some(2)).unwrap_err().to_string().contains("model"));
    current_thread().block_on(async {
        let (r, _) = a.write(3, pattern_buf(4, 3, 2, 512)).await;
        r.unwrap();
        let (r, got) = b.read(3, IoBuf::new(1024)).await;
        r.unwrap();
        assert!(got[..] == pattern_buf(4, 3, 2, 512)[..]);
    });
    assert_eq!(
        (a.queue_pairs(), b.queue_pairs(), model.io_queues()),
        (1, 1, 1)
    );
    drop(a);
    current_thread().block_on(async { b.flush().await.unwrap() });
}
