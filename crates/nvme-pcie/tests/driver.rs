//! The driver against the in-memory controller model: bring-up, data integrity, doorbell
//! batching, queue wrap, timeouts, resets and failed controllers.

use std::sync::Arc;
use std::time::{Duration, Instant};

use nvme_pcie::model::{Fault, ModelConfig, ModelController};
use nvme_pcie::regs::{self, Device};
use nvme_pcie::{Completion, Config, Controller, Error, IoQueuePair, Namespace};
use nvme_spec::Status;
use nvme_spec::opcode::{admin, io};
use nvme_spec::status::{generic, sct};
use proptest::prelude::*;

/// Each reactor owns a queue pair; the controller is shared between them.
const _: () = {
    const fn send<T: Send>() {}
    const fn send_sync<T: Send + Sync>() {}
    send::<IoQueuePair>();
    send::<Completion>();
    send_sync::<Controller>();
};

fn setup(model: ModelConfig, config: Config) -> (Arc<ModelController>, Controller) {
    let m = Arc::new(ModelController::new(model));
    let c = Controller::new(m.clone(), config).expect("bring-up");
    (m, c)
}

fn default_setup() -> (Arc<ModelController>, Controller) {
    setup(ModelConfig::default(), Config::default())
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (seed.wrapping_mul(31).wrapping_add(i as u64 * 7) >> 1) as u8)
        .collect()
}

/// Polls until `n` completions arrived (the model completes synchronously, so one poll with
/// a large enough batch suffices; the loop bound keeps a broken driver from hanging a test).
fn reap(q: &mut IoQueuePair, n: usize) -> Vec<Completion> {
    let mut out = Vec::new();
    for _ in 0..1000 {
        q.poll(usize::MAX, |c| out.push(c));
        if out.len() >= n {
            break;
        }
    }
    assert_eq!(out.len(), n, "completions");
    out
}

fn io_one(
    q: &mut IoQueuePair,
    ns: &Namespace,
    write: bool,
    slba: u64,
    buf: nvme_pcie::DmaBuf,
) -> Completion {
    let nlb = (buf.len() / ns.block_size as usize) as u32;
    let r = if write {
        q.write(ns, slba, nlb, buf, 7)
    } else {
        q.read(ns, slba, nlb, buf, 7)
    };
    r.expect("submit");
    assert!(q.ring());
    reap(q, 1).pop().unwrap()
}

#[test]
fn bring_up_identify_and_shutdown() {
    let (m, c) = setup(
        ModelConfig::default(),
        Config {
            io_queues: 4,
            ..Config::default()
        },
    );
    let info = c.info().clone();
    assert_eq!(info.model, "nvme-pcie model");
    assert_eq!(info.serial, "MODEL0001");
    assert_eq!(info.vid, 0x1b36);
    assert_eq!(info.version, 0x0001_0400);
    assert_eq!(info.page_size, 4096);
    assert_eq!(info.max_transfer, 4096 << 5);
    assert_eq!(info.io_queues, 4);
    assert_eq!(
        c.namespaces(),
        &[Namespace {
            nsid: 1,
            block_size: 512,
            blocks: 8192
        }]
    );
    assert!(matches!(c.namespace(2), Err(Error::NoNamespace(2))));
    // CC as the driver programmed it: IOCQES 4, IOSQES 6, MPS 0, CSS NVM, enabled.
    assert_eq!(m.read32(regs::CC), 0x0046_0001);
    assert_eq!(m.read32(regs::CSTS) & regs::CSTS_RDY, 1);
    drop(c);
    let csts = m.read32(regs::CSTS);
    assert_eq!(csts & regs::CSTS_SHST_MASK, regs::CSTS_SHST_COMPLETE);
    assert_eq!(m.read32(regs::CC) & regs::CC_SHN_MASK, regs::CC_SHN_NORMAL);
    assert_eq!(m.bad_doorbells(), 0);
}

/// The model refuses an enable QEMU refuses, with CSTS.CFS.
#[test]
fn model_enable_checks() {
    let arena = nvme_pcie::DmaArena::new(1 << 20, nvme_pcie::DEFAULT_IOVA_BASE).unwrap();
    let base = nvme_pcie::DEFAULT_IOVA_BASE;
    let good_cc = regs::cc_value(0, true);
    let cases: [(u32, u64, u64, u32, bool); 7] = [
        (0x001F_001F, base, base + 4096, good_cc, true),
        (0, base, base + 4096, good_cc, false),
        (0x001F_001F, base + 64, base + 4096, good_cc, false),
        (0x001F_001F, base, 0, good_cc, false),
        (
            0x001F_001F,
            base,
            base + 4096,
            good_cc & !(0xF << 16) | (7 << 16),
            false,
        ),
        (
            0x001F_001F,
            base,
            base + 4096,
            good_cc & !(0xF << 20) | (3 << 20),
            false,
        ),
        (0x001F_001F, base, base + 4096, good_cc | (5 << 7), false),
    ];
    for (i, (aqa, asq, acq, cc, ready)) in cases.into_iter().enumerate() {
        let m = ModelController::new(ModelConfig::default());
        m.map_dma(&arena.window()).unwrap();
        m.write32(regs::AQA, aqa);
        m.write64(regs::ASQ, asq);
        m.write64(regs::ACQ, acq);
        m.write32(regs::CC, cc);
        let want = if ready {
            regs::CSTS_RDY
        } else {
            regs::CSTS_CFS
        };
        assert_eq!(m.read32(regs::CSTS), want, "case {i}");
        // Disabling clears the failure.
        m.write32(regs::CC, 0);
        assert_eq!(m.read32(regs::CSTS), 0, "case {i}");
    }
}

#[test]
fn read_after_write_across_pages() {
    // 4 KiB and 8 KiB controller pages (CAP.MPSMIN 0 and 1).
    for mpsmin in [0, 1] {
        read_after_write_with_pages(mpsmin);
    }
}

fn read_after_write_with_pages(mpsmin: u8) {
    let (m, c) = setup(
        ModelConfig {
            mpsmin,
            blocks: 16384,
            ..ModelConfig::default()
        },
        Config::default(),
    );
    assert_eq!(c.info().page_size, 4096 << mpsmin);
    let ns = c.namespace(1).unwrap();
    let mut q = c.create_io_queue().unwrap();
    let max_blocks = (c.info().max_transfer / u64::from(ns.block_size)) as usize;
    for (slba, blocks) in [
        (0u64, 1usize),
        (3, 8),
        (17, 9),
        (100, 24),
        (1000, max_blocks),
        (16383, 1),
    ] {
        let len = blocks * ns.block_size as usize;
        let data = pattern(slba, len);
        let buf = c.alloc(len).unwrap();
        buf.write(0, &data).unwrap();
        let done = io_one(&mut q, &ns, true, slba, buf);
        assert_eq!(done.result, Ok(0));
        assert_eq!(done.tag, 7);
        let mut media = vec![0u8; len];
        m.read_media(slba as usize * 512, &mut media);
        assert_eq!(media, data, "media at {slba}");
        let done = io_one(&mut q, &ns, false, slba, c.alloc(len).unwrap());
        let mut back = vec![0u8; len];
        done.buf.unwrap().read(0, &mut back).unwrap();
        assert_eq!(back, data, "read back at {slba}");
    }
    // Flush has no data.
    q.flush(&ns, 9).unwrap();
    q.ring();
    assert_eq!(reap(&mut q, 1)[0].result, Ok(0));
    assert_eq!(m.bad_doorbells(), 0);
}

#[test]
fn write_zeroes_and_deallocate_follow_oncs() {
    let (m, c) = default_setup();
    assert!(c.info().supports_write_zeroes() && c.info().supports_deallocate());
    assert!(c.info().volatile_write_cache);
    let ns = c.namespace(1).unwrap();
    let mut q = c.create_io_queue().unwrap();
    let data = pattern(1, 64 * 512);
    let buf = c.alloc(data.len()).unwrap();
    buf.write(0, &data).unwrap();
    assert_eq!(io_one(&mut q, &ns, true, 0, buf).result, Ok(0));
    // Blocks 3..8 zeroed, 20..60 deallocated (this model reads them as zeroes); no data
    // buffer for either, nothing allocated.
    let pages = c.arena().pages_in_use();
    q.write_zeroes(&ns, 3, 5, 1).unwrap();
    q.deallocate(&ns, 20, 40, 2).unwrap();
    q.ring();
    let done = reap(&mut q, 2);
    assert_eq!(
        done.iter().map(|d| d.result.clone()).collect::<Vec<_>>(),
        [Ok(0), Ok(0)]
    );
    assert_eq!(c.arena().pages_in_use(), pages);
    let mut media = vec![0u8; data.len()];
    m.read_media(0, &mut media);
    for (block, (got, want)) in media.chunks(512).zip(data.chunks(512)).enumerate() {
        let zeroed = (3..8).contains(&block) || (20..60).contains(&block);
        assert!(
            if zeroed {
                got.iter().all(|&b| b == 0)
            } else {
                got == want
            },
            "block {block}"
        );
    }
    assert_eq!(m.io_commands(io::WRITE_ZEROES), 1);
    assert_eq!(m.io_commands(io::DATASET_MANAGEMENT), 1);
    // Out of range and zero-length requests: a status from the controller, or refused.
    q.deallocate(&ns, 8190, 8, 3).unwrap();
    q.ring();
    assert!(matches!(reap(&mut q, 1)[0].result, Err(Error::Status(_))));
    assert!(q.write_zeroes(&ns, 0, 0, 4).is_err());
    assert!(q.deallocate(&ns, 0, 0, 4).is_err());
    drop(q);

    // A controller without them says so in ONCS and VWC, and refuses the opcodes.
    let (_, c) = setup(
        ModelConfig {
            oncs: 0,
            volatile_write_cache: false,
            ..ModelConfig::default()
        },
        Config::default(),
    );
    let info = c.info();
    assert!(!info.supports_write_zeroes() && !info.supports_deallocate());
    assert!(!info.volatile_write_cache);
    let mut q = c.create_io_queue().unwrap();
    q.write_zeroes(&ns, 0, 1, 1).unwrap();
    q.ring();
    assert!(matches!(reap(&mut q, 1)[0].result, Err(Error::Status(_))));
}

#[test]
fn one_doorbell_per_batch_and_per_poll() {
    let (m, c) = default_setup();
    let ns = c.namespace(1).unwrap();
    let mut q = c.create_io_queue().unwrap();
    let qid = q.qid();
    let before = m.doorbells(qid);
    for i in 0..32u64 {
        q.read(&ns, i, 1, c.alloc(512).unwrap(), i).unwrap();
    }
    // Nothing reaches the controller before the doorbell.
    assert_eq!(m.doorbells(qid).sq_tail, before.sq_tail);
    assert!(q.ring());
    assert!(!q.ring(), "nothing new to ring");
    assert_eq!(m.doorbells(qid).sq_tail, before.sq_tail + 1);
    // Bounded polls: 10 + 10 + 10 + 2, one CQ head doorbell each.
    let mut tags = Vec::new();
    for want in [10, 10, 10, 2] {
        assert_eq!(q.poll(10, |c| tags.push(c.tag)), want);
    }
    assert_eq!(q.poll(10, |_| unreachable!()), 0);
    assert_eq!(m.doorbells(qid).cq_head, before.cq_head + 4);
    assert_eq!(tags, (0..32).collect::<Vec<_>>());
}

#[test]
fn queue_full_hands_the_buffer_back() {
    let (_m, c) = setup(
        ModelConfig::default(),
        Config {
            io_queue_size: 4,
            ..Config::default()
        },
    );
    let ns = c.namespace(1).unwrap();
    let mut q = c.create_io_queue().unwrap();
    assert_eq!(q.depth(), 3);
    for i in 0..3 {
        q.read(&ns, i, 1, c.alloc(512).unwrap(), i).unwrap();
    }
    let rejected = q.read(&ns, 0, 1, c.alloc(512).unwrap(), 3).unwrap_err();
    assert_eq!(rejected.error, Error::QueueFull);
    assert!(rejected.buf.is_some());
    q.ring();
    reap(&mut q, 3);
    assert_eq!(q.outstanding(), 0);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Many laps around small queues: every command completes once, with its own data, the
    /// phase tag flips correctly, and each batch costs one SQ doorbell.
    #[test]
    fn wrap_and_phase_over_many_laps(size in 2u32..9, batches in prop::collection::vec(1usize..8, 20..80), dstrd in 0u8..3) {
        let (m, c) = setup(
            ModelConfig { dstrd, ..ModelConfig::default() },
            Config { io_queue_size: size, ..Config::default() },
        );
        let ns = c.namespace(1).unwrap();
        let mut q = c.create_io_queue().unwrap();
        let qid = q.qid();
        let depth = q.depth();
        let start = m.doorbells(qid);
        let mut tag = 0u64;
        let mut rings = 0;
        let mut polls = 0;
        for b in &batches {
            let n = (*b).min(depth);
            let mut sent = Vec::new();
            for _ in 0..n {
                let lba = tag % 64;
                let buf = c.alloc(512).unwrap();
                buf.write(0, &pattern(tag, 512)).unwrap();
                q.write(&ns, lba, 1, buf, tag).unwrap();
                sent.push(tag);
                tag += 1;
            }
            prop_assert!(q.ring());
            rings += 1;
            let mut got = Vec::new();
            q.poll(usize::MAX, |c| { assert_eq!(c.result, Ok(0)); got.push(c.tag) });
            polls += 1;
            prop_assert_eq!(&got, &sent);
            // Read the last one back.
            let last = *sent.last().unwrap();
            q.read(&ns, last % 64, 1, c.alloc(512).unwrap(), last).unwrap();
            q.ring();
            rings += 1;
            let mut back = vec![0u8; 512];
            q.poll(1, |c| c.buf.unwrap().read(0, &mut back).unwrap());
            polls += 1;
            prop_assert_eq!(back, pattern(last, 512));
        }
        let d = m.doorbells(qid);
        prop_assert_eq!(d.sq_tail - start.sq_tail, rings);
        prop_assert_eq!(d.cq_head - start.cq_head, polls);
        prop_assert_eq!(m.bad_doorbells(), 0);
    }
}

#[test]
fn bad_requests_get_a_status_or_are_refused() {
    let (m, c) = default_setup();
    let ns = c.namespace(1).unwrap();
    let mut q = c.create_io_queue().unwrap();
    // Past the end of the namespace: the controller's answer.
    let done = io_one(&mut q, &ns, false, 8190, c.alloc(2048).unwrap());
    match done.result {
        Err(Error::Status(s)) => {
            assert_eq!((s.sct, s.sc), (sct::GENERIC, generic::LBA_OUT_OF_RANGE));
            assert!(s.dnr);
        }
        other => panic!("{other:?}"),
    }
    assert!(done.buf.is_some());
    // Longer than MDTS, or than the buffer: refused before it reaches the queue.
    let big = c.alloc(256 << 10).unwrap();
    let r = q.read(&ns, 0, 512, big, 1).unwrap_err();
    assert!(matches!(r.error, Error::TooLarge { .. }));
    let r = q.read(&ns, 0, 2, c.alloc(512).unwrap(), 1).unwrap_err();
    assert!(matches!(
        r.error,
        Error::TooLarge {
            len: 1024,
            max: 512
        }
    ));
    assert!(!q.ring());
    // An injected media error comes back as that status.
    let media = Status::media(nvme_spec::status::media::UNRECOVERED_READ_ERROR);
    m.inject(Fault::Status {
        admin: false,
        opcode: io::READ,
        status: media,
    });
    let done = io_one(&mut q, &ns, false, 0, c.alloc(512).unwrap());
    assert_eq!(done.result, Err(Error::Status(media)));
    // The next read is fine again.
    assert_eq!(
        io_one(&mut q, &ns, false, 0, c.alloc(512).unwrap()).result,
        Ok(0)
    );
}

fn short_timeouts() -> Config {
    Config {
        io_timeout: Duration::from_secs(10),
        admin_timeout: Duration::from_millis(50),
        ..Config::default()
    }
}

#[test]
fn timed_out_command_is_aborted() {
    let (m, c) = setup(ModelConfig::default(), short_timeouts());
    let ns = c.namespace(1).unwrap();
    let mut q = c.create_io_queue().unwrap();
    let t0 = Instant::now();
    q.check(t0);
    m.inject(Fault::Lose {
        admin: false,
        opcode: io::READ,
    });
    q.read(&ns, 0, 1, c.alloc(512).unwrap(), 42).unwrap();
    q.ring();
    assert_eq!(q.poll(8, |_| unreachable!()), 0);
    assert_eq!(m.lost(), 1);
    // Not yet expired: nothing happens.
    q.check(t0 + Duration::from_secs(5));
    assert_eq!(m.lost(), 1);
    // Expired: Abort, and the controller completes the command as aborted.
    q.check(t0 + Duration::from_secs(11));
    assert_eq!(m.lost(), 0);
    let done = reap(&mut q, 1).pop().unwrap();
    assert_eq!(done.tag, 42);
    assert_eq!(done.result, Err(Error::Status(nvme_pcie::ABORTED)));
    // The queue carries on.
    assert_eq!(
        io_one(&mut q, &ns, false, 0, c.alloc(512).unwrap()).result,
        Ok(0)
    );
}

/// The Abort is acknowledged (or refused, as over the Abort Command Limit) but the command
/// stays lost: one timeout later the controller is reset and the command fails with `Reset`.
#[test]
fn abort_that_does_not_help_resets_the_controller() {
    let refused = Status::specific(nvme_spec::status::specific::ABORT_LIMIT_EXCEEDED).with_dnr();
    for abort_status in [Status::SUCCESS, refused] {
        let (m, c) = setup(ModelConfig::default(), short_timeouts());
        let ns = c.namespace(1).unwrap();
        let mut q = c.create_io_queue().unwrap();
        let t0 = Instant::now();
        q.check(t0);
        m.inject(Fault::Lose {
            admin: false,
            opcode: io::WRITE,
        });
        m.inject(Fault::Status {
            admin: true,
            opcode: admin::ABORT,
            status: abort_status,
        });
        q.write(&ns, 0, 1, c.alloc(512).unwrap(), 5).unwrap();
        q.ring();
        q.check(t0 + Duration::from_secs(11));
        assert_eq!(q.poll(8, |_| unreachable!()), 0);
        assert_eq!(m.lost(), 1);
        q.check(t0 + Duration::from_secs(22));
        let done = reap(&mut q, 1).pop().unwrap();
        assert_eq!((done.tag, done.result), (5, Err(Error::Reset)));
        assert!(done.buf.is_some());
        let r = q.read(&ns, 0, 1, c.alloc(512).unwrap(), 6).unwrap_err();
        assert_eq!(r.error, Error::Reset);
        drop(q);
        assert_eq!(m.io_queues(), 0);
        let mut q = c.create_io_queue().unwrap();
        assert_eq!(
            io_one(&mut q, &ns, false, 0, c.alloc(512).unwrap()).result,
            Ok(0)
        );
    }
}

#[test]
fn hung_controller_is_reset_and_nothing_hangs() {
    let (m, c) = setup(
        ModelConfig::default(),
        Config {
            io_queues: 2,
            ..short_timeouts()
        },
    );
    let ns = c.namespace(1).unwrap();
    let mut q = c.create_io_queue().unwrap();
    let t0 = Instant::now();
    q.check(t0);
    m.inject(Fault::Hang);
    for i in 0..5 {
        q.read(&ns, i, 1, c.alloc(512).unwrap(), i).unwrap();
    }
    q.ring();
    assert_eq!(q.poll(8, |_| unreachable!()), 0);
    // The Abort gets no answer within the admin timeout: reset.
    q.check(t0 + Duration::from_secs(11));
    let done = reap(&mut q, 5);
    assert!(done.iter().all(|c| c.result == Err(Error::Reset)));
    assert!(!c.is_failed());
    // While the dead pair lives, its queue identifier is not handed out again, and it writes
    // no more doorbells.
    let mut fresh = c.create_io_queue().unwrap();
    assert_ne!(fresh.qid(), q.qid());
    let old = m.doorbells(q.qid());
    let r = q.read(&ns, 0, 1, c.alloc(512).unwrap(), 9).unwrap_err();
    assert_eq!(r.error, Error::Reset);
    assert!(!q.ring());
    assert_eq!(m.doorbells(q.qid()), old);
    assert_eq!(
        io_one(&mut fresh, &ns, false, 0, c.alloc(512).unwrap()).result,
        Ok(0)
    );
    let old_qid = q.qid();
    drop(q);
    drop(fresh);
    let mut q = c.create_io_queue().unwrap();
    assert_eq!(q.qid(), old_qid);
    assert_eq!(
        io_one(&mut q, &ns, false, 0, c.alloc(512).unwrap()).result,
        Ok(0)
    );
    assert_eq!(m.bad_doorbells(), 0);
}

#[test]
fn fatal_status_fails_everything_until_reset() {
    let (m, c) = default_setup();
    let ns = c.namespace(1).unwrap();
    let mut q = c.create_io_queue().unwrap();
    m.inject(Fault::Lose {
        admin: false,
        opcode: io::READ,
    });
    q.read(&ns, 0, 1, c.alloc(512).unwrap(), 1).unwrap();
    q.ring();
    m.inject(Fault::Fatal);
    q.check(Instant::now());
    assert!(c.is_failed());
    let done = reap(&mut q, 1).pop().unwrap();
    assert_eq!(done.result, Err(Error::ControllerFailed));
    let r = q.read(&ns, 0, 1, c.alloc(512).unwrap(), 2).unwrap_err();
    assert_eq!(r.error, Error::ControllerFailed);
    assert!(matches!(c.create_io_queue(), Err(Error::ControllerFailed)));
    drop(q);
    c.reset().unwrap();
    assert!(!c.is_failed());
    let mut q = c.create_io_queue().unwrap();
    assert_eq!(
        io_one(&mut q, &ns, false, 0, c.alloc(512).unwrap()).result,
        Ok(0)
    );
}

#[test]
fn controller_that_never_becomes_ready() {
    let m = Arc::new(ModelController::new(ModelConfig::default()));
    m.inject(Fault::NeverReady);
    let err = Controller::new(
        m.clone(),
        Config {
            ready_timeout: Some(Duration::from_millis(30)),
            ..Config::default()
        },
    )
    .unwrap_err();
    assert_eq!(
        err,
        Error::ReadyTimeout {
            ready: true,
            ms: 30
        }
    );
}

#[test]
fn unusable_capabilities_are_refused() {
    for (model, what) in [
        (
            ModelConfig {
                mqes: 1,
                ..ModelConfig::default()
            },
            "MQES",
        ),
        (
            ModelConfig {
                mpsmin: 5,
                mpsmax: 5,
                ..ModelConfig::default()
            },
            "MPSMIN",
        ),
    ] {
        let m = Arc::new(ModelController::new(model));
        match Controller::new(m, Config::default()) {
            Err(Error::Unsupported(msg)) => assert!(msg.contains(what), "{msg}"),
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn lost_admin_command_times_out_and_resets() {
    let (m, c) = setup(ModelConfig::default(), short_timeouts());
    m.inject(Fault::Lose {
        admin: true,
        opcode: admin::CREATE_CQ,
    });
    assert_eq!(
        c.create_io_queue().unwrap_err(),
        Error::AdminTimeout {
            opcode: admin::CREATE_CQ
        }
    );
    let ns = c.namespace(1).unwrap();
    let mut q = c.create_io_queue().unwrap();
    assert_eq!(
        io_one(&mut q, &ns, false, 0, c.alloc(512).unwrap()).result,
        Ok(0)
    );
}

#[test]
fn queues_are_limited_deleted_and_memory_returned() {
    let (m, c) = setup(
        ModelConfig {
            max_queues: 2,
            ..ModelConfig::default()
        },
        Config {
            io_queues: 4,
            ..Config::default()
        },
    );
    assert_eq!(c.info().io_queues, 2);
    let idle = c.arena().pages_in_use();
    let ns = c.namespace(1).unwrap();
    let mut a = c.create_io_queue().unwrap();
    let b = c.create_io_queue().unwrap();
    assert_eq!(c.create_io_queue().unwrap_err(), Error::NoQueues(2));
    assert_eq!(m.io_queues(), 2);
    // A queue dropped with a command in flight deletes its queues and frees everything.
    m.inject(Fault::Lose {
        admin: false,
        opcode: io::READ,
    });
    a.read(&ns, 0, 1, c.alloc(512).unwrap(), 1).unwrap();
    a.ring();
    drop(a);
    assert_eq!(m.io_queues(), 1);
    assert_eq!(m.lost(), 0);
    drop(b);
    assert_eq!(m.io_queues(), 0);
    assert_eq!(c.arena().pages_in_use(), idle);
    let _again = c.create_io_queue().unwrap();
}

#[test]
fn create_queue_errors_are_reported() {
    let (m, c) = default_setup();
    let bad = Status::specific(nvme_spec::status::specific::INVALID_QUEUE_SIZE).with_dnr();
    m.inject(Fault::Status {
        admin: true,
        opcode: admin::CREATE_SQ,
        status: bad,
    });
    assert_eq!(c.create_io_queue().unwrap_err(), Error::Status(bad));
    // The CQ created before was deleted again and the queue identifier is free.
    assert_eq!(m.io_queues(), 0);
    let q = c.create_io_queue().unwrap();
    assert_eq!(q.qid(), 1);
}
