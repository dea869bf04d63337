//! The NVMe PCIe backend over the driver's in-memory controller model (the same driver that
//! runs against a real controller through VFIO; see `tests/tests/nvme_pcie_vfio.rs` for that):
//! one queue pair per reactor thread, transfers split at the controller's limit, back-pressure
//! from full queues, statuses mapped to NVMe, and futures dropped with commands in flight.

mod common;

use std::sync::Arc;

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
        b.deallocate(0, 8).await.unwrap();
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
