//! The initiator against our target, in process, over loopback TCP.

mod common;

use std::time::Duration;

use common::{NQN, TestTarget, host, options, pattern};
use nvmeof_initiator::nvme_spec::fabrics::DISCOVERY_NQN;
use nvmeof_initiator::nvme_spec::status::{generic, specific};
use nvmeof_initiator::{
    Controller, ControllerEvent, ControllerState, DiscoveryOptions, Error, Namespace, discover,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discovery_lists_the_subsystem() {
    let t = TestTarget::start(&["mem:16M"], |_| {});
    let log = discover(&DiscoveryOptions::new(t.target_addr(), host()))
        .await
        .expect("discover");
    let sub = log
        .entries
        .iter()
        .find(|e| e.subnqn == NQN)
        .expect("subsystem entry");
    assert_eq!(sub.trtype_name(), "tcp");
    assert_eq!(sub.adrfam_name(), "ipv4");
    assert_eq!(sub.subtype_name(), "nvme subsystem");
    assert_eq!(sub.traddr, "127.0.0.1");
    assert_eq!(sub.port(), Some(t.addr.port()));
    assert!(
        log.entries
            .iter()
            .any(|e| e.subnqn == DISCOVERY_NQN && e.subtype_name() == "current discovery subsystem")
    );
    assert!(log.genctr >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discovery_with_digests() {
    let t = TestTarget::start(&["mem:16M"], |_| {});
    let mut o = DiscoveryOptions::new(t.target_addr(), host());
    o.header_digest = true;
    o.data_digest = true;
    let log = discover(&o).await.expect("discover");
    assert!(log.entries.iter().any(|e| e.subnqn == NQN));
}

/// Writes and reads back in-capsule-sized and R2T-sized transfers with every digest
/// combination.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_read_back_with_and_without_digests() {
    let t = TestTarget::start(&["mem:32M"], |_| {});
    let combinations = [(false, false), (true, false), (false, true), (true, true)];
    for (i, (hd, dd)) in combinations.into_iter().enumerate() {
        let mut o = options(t.target_addr());
        o.header_digest = hd;
        o.data_digest = dd;
        // SQ flow control off (the default) but for one combination.
        let sq_flow_control = i == 2;
        o.disable_sq_flow_control = !sq_flow_control;
        let ctrl = Controller::connect(o).await.expect("connect");
        let info = ctrl.info();
        assert_eq!((info.header_digest, info.data_digest), (hd, dd));
        assert_eq!(info.sq_flow_control, sq_flow_control);
        assert_eq!(info.subnqn, NQN);
        assert_eq!(info.io_queues, 2);
        assert_eq!(info.in_capsule_data_bytes, 8192);
        let ns = ctrl.namespace(1).await.expect("namespace");
        assert_eq!(ns.block_size(), 4096);
        assert_eq!(ns.num_blocks(), 32 * 256);
        let seed = u64::from(hd) * 2 + u64::from(dd) + 1;
        // 4 KiB: in the capsule. 8 KiB: still in the capsule. 64 KiB and 1 MiB: R2T.
        for (lba, blocks) in [(0u64, 1usize), (10, 2), (100, 16), (1000, 256)] {
            let len = blocks * 4096;
            let data = pattern(seed, lba * 4096, len);
            ns.write(lba, &data).await.expect("write");
            let mut back = vec![0u8; len];
            ns.read(lba, &mut back).await.expect("read");
            assert!(
                back == data,
                "mismatch at lba {lba} ({blocks} blocks), digests {hd}/{dd}"
            );
        }
        let stats = ctrl.queue_stats();
        let in_capsule: u64 = stats.iter().map(|s| s.in_capsule_writes).sum();
        let r2t: u64 = stats.iter().map(|s| s.r2t_writes).sum();
        assert_eq!(in_capsule, 2, "{stats:?}");
        assert_eq!(r2t, 2, "{stats:?}");
        assert!(stats.iter().map(|s| s.r2ts).sum::<u64>() >= 2);
        // With SQ flow control off every read ended with its last data PDU, no response
        // capsule.
        let by_data: u64 = stats.iter().map(|s| s.data_completions).sum();
        assert_eq!(by_data, if sq_flow_control { 0 } else { 4 }, "{stats:?}");
        ctrl.disconnect().await.expect("disconnect");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_queues_with_concurrent_io() {
    let t = TestTarget::start(&["mem:64M"], |_| {});
    let mut o = options(t.target_addr());
    o.io_queues = Some(4);
    let ctrl = Controller::connect(o).await.expect("connect");
    assert_eq!(ctrl.io_queue_count(), 4);
    let ns = ctrl.namespace(1).await.expect("namespace");
    let mut tasks = Vec::new();
    for w in 0..8u64 {
        let ns = ns.on_queue(w as usize);
        tasks.push(tokio::spawn(async move {
            // Each worker owns 1024 blocks and keeps several commands in flight.
            let base = w * 1024;
            let mut futs = tokio::task::JoinSet::new();
            for i in 0..16u64 {
                let ns = ns.clone();
                futs.spawn(async move {
                    let lba = base + i * 64;
                    let data = pattern(w, lba * 4096, 8 * 4096);
                    ns.write(lba, &data).await?;
                    let mut back = vec![0u8; data.len()];
                    ns.read(lba, &mut back).await?;
                    assert!(back == data, "worker {w} lba {lba}");
                    Ok::<_, Error>(())
                });
            }
            while let Some(r) = futs.join_next().await {
                r.expect("task").expect("io");
            }
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    let stats = ctrl.queue_stats();
    assert_eq!(stats.len(), 5);
    for s in &stats[1..] {
        assert!(
            s.commands >= 64,
            "queue {} got {} commands",
            s.qid,
            s.commands
        );
    }
    ctrl.disconnect().await.expect("disconnect");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfers_larger_than_mdts_are_split() {
    let t = TestTarget::start(&["mem:32M"], |s| s.mdts_kib = 16);
    let ctrl = Controller::connect(options(t.target_addr()))
        .await
        .expect("connect");
    let info = ctrl.info();
    assert_eq!(info.mdts_bytes, Some(16 * 1024));
    assert_eq!(info.max_transfer_bytes, 16 * 1024);
    let ns = ctrl.namespace(1).await.expect("namespace").on_queue(0);
    let before = ctrl.queue_stats()[1].commands;
    let len = (1 << 20) + 3 * 4096;
    let data = pattern(7, 5 * 4096, len);
    ns.write(5, &data).await.expect("write");
    let mut back = vec![0u8; len];
    ns.read(5, &mut back).await.expect("read");
    assert!(back == data);
    let after = ctrl.queue_stats()[1].commands;
    // 1 MiB + 12 KiB in 16 KiB commands, written and read.
    assert_eq!(after - before, 2 * 65);
    ctrl.disconnect().await.expect("disconnect");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_side_transfer_cap_splits_too() {
    let t = TestTarget::start(&["mem:16M,bs=512"], |_| {});
    let mut o = options(t.target_addr());
    o.max_transfer = Some(8192);
    let ctrl = Controller::connect(o).await.expect("connect");
    let ns = ctrl.namespace(1).await.expect("namespace");
    assert_eq!(ns.block_size(), 512);
    let data = pattern(3, 512 * 3, 512 * 301);
    ns.write(3, &data).await.expect("write");
    let mut back = vec![0u8; data.len()];
    ns.read(3, &mut back).await.expect("read");
    assert!(back == data);
    ctrl.disconnect().await.expect("disconnect");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flush_write_zeroes_and_deallocate() {
    let t = TestTarget::start(&["mem:16M"], |_| {});
    let ctrl = Controller::connect(options(t.target_addr()))
        .await
        .expect("connect");
    let info = ctrl.info();
    assert!(info.write_zeroes && info.dataset_management);
    // A RAM namespace has no cache a flush could empty: it is lost with the process anyway.
    assert!(!info.volatile_write_cache);
    let ns = ctrl.namespace(1).await.expect("namespace");
    let data = pattern(11, 0, 64 * 4096);
    ns.write(0, &data).await.expect("write");
    ns.flush().await.expect("flush");

    ns.write_zeroes(8, 8).await.expect("write zeroes");
    let mut back = vec![0xAAu8; 64 * 4096];
    ns.read(0, &mut back).await.expect("read");
    assert!(back[..8 * 4096] == data[..8 * 4096]);
    assert!(back[8 * 4096..16 * 4096].iter().all(|&b| b == 0));
    assert!(back[16 * 4096..] == data[16 * 4096..]);

    ns.deallocate(32, 16).await.expect("deallocate");
    ns.deallocate_ranges(&[(50, 2), (60, 1)])
        .await
        .expect("deallocate ranges");
    ns.read(0, &mut back).await.expect("read");
    assert!(back[32 * 4096..48 * 4096].iter().all(|&b| b == 0));
    assert!(back[48 * 4096..50 * 4096] == data[48 * 4096..50 * 4096]);
    assert!(back[50 * 4096..52 * 4096].iter().all(|&b| b == 0));
    assert!(back[60 * 4096..61 * 4096].iter().all(|&b| b == 0));
    assert!(back[61 * 4096..] == data[61 * 4096..]);
    ctrl.disconnect().await.expect("disconnect");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_carry_the_status() {
    let t = TestTarget::start(&["mem:1M"], |_| {});
    let ctrl = Controller::connect(options(t.target_addr()))
        .await
        .expect("connect");
    let ns = ctrl.namespace(1).await.expect("namespace");
    assert_eq!(ns.num_blocks(), 256);

    let mut buf = vec![0u8; 2 * 4096];
    let e = ns.read(255, &mut buf).await.expect_err("out of range");
    let st = e.status().expect("a status error");
    assert_eq!((st.sct, st.sc), (0, generic::LBA_OUT_OF_RANGE));
    assert!(st.dnr);
    assert!(
        e.to_string().contains("Read failed: LBA Out of Range"),
        "{e}"
    );
    match &e {
        Error::Status { name, command, .. } => {
            assert_eq!(*name, "LBA Out of Range");
            assert_eq!(*command, "Read");
        }
        other => panic!("unexpected {other:?}"),
    }
    let e = ns.write(256, &buf).await.expect_err("out of range");
    assert_eq!(e.status().map(|s| s.sc), Some(generic::LBA_OUT_OF_RANGE));

    let e = ctrl.namespace(99).await.expect_err("invalid namespace");
    assert_eq!(e.status().map(|s| s.sc), Some(generic::INVALID_NAMESPACE));
    assert!(
        e.to_string()
            .contains("Identify failed: Invalid Namespace or Format"),
        "{e}"
    );

    let bogus = ctrl.namespace_unchecked(7, 4096, 100).expect("handle");
    let e = bogus
        .read(0, &mut buf)
        .await
        .expect_err("invalid namespace");
    assert_eq!(e.status().map(|s| s.sc), Some(generic::INVALID_NAMESPACE));

    let mut odd = vec![0u8; 1000];
    assert!(matches!(
        ns.read(0, &mut odd).await,
        Err(Error::InvalidArgument(_))
    ));

    // The controller still works after all that.
    ns.read(0, &mut buf).await.expect("read");
    ctrl.disconnect().await.expect("disconnect");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_to_an_unknown_subsystem_is_refused() {
    let t = TestTarget::start(&["mem:1M"], |_| {});
    let mut o = options(t.target_addr());
    o.subnqn = "nqn.2026-11.io.nvmeof-direct:does-not-exist".into();
    let e = Controller::connect(o).await.expect_err("refused");
    let st = e.status().expect("status");
    assert_eq!((st.sct, st.sc), (1, specific::CONNECT_INVALID_PARAMETERS));
    assert!(
        e.to_string()
            .starts_with("Connect failed: Connect Invalid Parameters"),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_alive_holds_an_idle_controller() {
    let t = TestTarget::start(&["mem:1M"], |_| {});
    let mut o = options(t.target_addr());
    o.kato = Duration::from_millis(2000);
    let ctrl = Controller::connect(o).await.expect("connect");
    let cntlid = ctrl.info().cntlid;
    assert_eq!(ctrl.info().kato_ms, 2000);
    let sub = t.target().subsystem(NQN).expect("subsystem").clone();
    assert!(sub.controller(cntlid).is_some());
    tokio::time::sleep(Duration::from_secs(5)).await;
    // Without Keep Alive the target would have torn the controller down after 2 s.
    assert!(sub.controller(cntlid).is_some(), "controller torn down");
    assert_eq!(ctrl.state(), ControllerState::Connected);
    assert_eq!(ctrl.reconnects(), 0);
    let ns = ctrl.namespace(1).await.expect("namespace");
    let mut buf = vec![0u8; 4096];
    ns.read(0, &mut buf).await.expect("read after idling");
    assert!(ctrl.queue_stats()[0].commands >= 4, "keep alives were sent");
    ctrl.disconnect().await.expect("disconnect");
    let mut gone = false;
    for _ in 0..100 {
        if sub.controller(cntlid).is_none() {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(gone, "controller still present after disconnect");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn namespace_change_event_refreshes_the_list() {
    let t = TestTarget::start(&["mem:1M", "mem:2M"], |_| {});
    let ctrl = Controller::connect(options(t.target_addr()))
        .await
        .expect("connect");
    assert_eq!(ctrl.namespace_ids(), vec![1, 2]);
    let mut events = ctrl.subscribe_events();
    // Give the controller time to post its Asynchronous Event Request.
    let sub = t.target().subsystem(NQN).expect("subsystem").clone();
    let target_ctrl = sub.controller(ctrl.info().cntlid).expect("controller");
    let dw0 = nvmeof_initiator::nvme_spec::features::aer_dw0(2, 0, 4);
    let mut raised = false;
    for _ in 0..50 {
        if target_ctrl.raise_event(0, dw0) {
            raised = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        raised,
        "no Asynchronous Event Request was held by the target"
    );
    let mut saw_async = false;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let ev = tokio::time::timeout_at(deadline, events.recv())
            .await
            .expect("event in time")
            .expect("event");
        match ev {
            ControllerEvent::AsyncEvent {
                event_type, info, ..
            } => {
                assert_eq!((event_type, info), (2, 0));
                saw_async = true;
            }
            ControllerEvent::NamespacesChanged { nsids, .. } => {
                assert!(saw_async);
                assert_eq!(nsids, vec![1, 2]);
                break;
            }
            ControllerEvent::Reconnected { .. } => panic!("unexpected reconnect"),
        }
    }
    // A new request is posted for the next event.
    let mut again = false;
    for _ in 0..50 {
        if target_ctrl.raise_event(0, dw0) {
            again = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(again, "the Asynchronous Event Request was not posted again");
    ctrl.disconnect().await.expect("disconnect");
}

/// Waits for the next refresh of the namespace list and returns it.
async fn next_namespace_list(
    events: &mut tokio::sync::broadcast::Receiver<ControllerEvent>,
) -> Vec<u32> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let ev = tokio::time::timeout_at(deadline, events.recv())
            .await
            .expect("event in time")
            .expect("event");
        if let ControllerEvent::NamespacesChanged { nsids, .. } = ev {
            return nsids;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_namespace_changes_on_the_target_refresh_the_namespace_list() {
    use nvmeof_target::config::{Config, NamespaceConfig};
    use nvmeof_target::reconfigure::Registry;
    use nvmeof_target::{RunningTarget, Target};

    let ns = vec!["mem:1M".parse().unwrap()];
    let listen = "tcp://127.0.0.1:0".parse().unwrap();
    let mut cfg = Config::quick(&[listen], NQN, &ns, true, &[]).unwrap();
    cfg.target.reactors = 1;
    let target = Target::build(&cfg).unwrap();
    let listeners = nvmeof_target::launcher::bind(&cfg).unwrap();
    let addr = listeners[0].addr.addr;
    let registry = Registry::new(RunningTarget::start(target, listeners).unwrap(), cfg);
    let o = options(nvmeof_initiator::TargetAddr::new(
        addr.ip().to_string(),
        addr.port(),
    ));
    let ctrl = Controller::connect(o).await.expect("connect");
    assert_eq!(ctrl.namespace_ids(), vec![1]);
    let mut events = ctrl.subscribe_events();

    // Added on the target: the Namespace Attribute Notice refreshes the list.
    registry
        .edit(|c| {
            c.subsystems[0].namespaces.push(NamespaceConfig {
                nsid: Some(2),
                backend: "mem:2M".parse().unwrap(),
                uuid: None,
                hosts: Vec::new(),
                ana_group: None,
            });
            Ok(())
        })
        .expect("add a namespace");
    assert_eq!(next_namespace_list(&mut events).await, vec![1, 2]);
    assert_eq!(ctrl.namespace_ids(), vec![1, 2]);
    let ns2 = ctrl.namespace(2).await.expect("namespace 2");
    let data = pattern(7, 0, 8192);
    ns2.write(0, &data)
        .await
        .expect("write to the new namespace");
    let mut back = vec![0u8; 8192];
    ns2.read(0, &mut back).await.expect("read");
    assert_eq!(back, data);

    // Removed: the list shrinks and I/O to it fails with Invalid Namespace.
    registry
        .edit(|c| {
            c.subsystems[0].namespaces.retain(|n| n.nsid != Some(2));
            Ok(())
        })
        .expect("remove the namespace");
    assert_eq!(next_namespace_list(&mut events).await, vec![1]);
    let e = ns2
        .read(0, &mut back)
        .await
        .expect_err("read of a removed namespace");
    assert!(e.to_string().contains("Invalid Namespace"), "{e}");
    ctrl.disconnect().await.expect("disconnect");
    registry.running().shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_only_controller_and_dropping_handles() {
    let t = TestTarget::start(&["mem:1M"], |_| {});
    let mut o = options(t.target_addr());
    o.io_queues = Some(0);
    let ctrl = Controller::connect(o).await.expect("connect");
    assert_eq!(ctrl.io_queue_count(), 0);
    let id = ctrl.identify_controller().await.expect("identify");
    assert_eq!(id.cntlid.get(), ctrl.info().cntlid);
    let ns = ctrl.namespace(1).await.expect("namespace");
    let mut buf = vec![0u8; 4096];
    assert!(matches!(
        ns.read(0, &mut buf).await,
        Err(Error::InvalidArgument(_))
    ));
    let sub = t.target().subsystem(NQN).expect("subsystem").clone();
    assert_eq!(sub.controller_count(), 1);
    drop(ns);
    drop(ctrl);
    // The last handle gone, the controller disconnects in the background.
    for _ in 0..100 {
        if sub.controller_count() == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("controller still connected after its handles were dropped");
}

/// CPU time (user + system) this process has used, from /proc (USER_HZ is 100 on Linux).
fn process_cpu() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").expect("stat");
    let f: Vec<&str> = stat[stat.rfind(')').expect("comm") + 2..]
        .split_whitespace()
        .collect();
    let ticks: u64 = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    Duration::from_millis(ticks * 10)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_poll_queues_do_io_and_rest_when_idle() {
    let t = TestTarget::start(&["mem:16M"], |_| {});
    let mut o = options(t.target_addr());
    o.busy_poll = Duration::from_millis(2);
    let ctrl = Controller::connect(o).await.expect("connect");
    let ns = ctrl.namespace(1).await.expect("namespace");
    for round in 0..3u64 {
        let data = pattern(round, round * 65536, 64 * 1024);
        ns.write(round * 16, &data).await.expect("write");
        let mut back = vec![0u8; data.len()];
        ns.read(round * 16, &mut back).await.expect("read");
        assert!(back == data, "round {round}");
        // Past the window the queues sleep; the next command must still complete.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // An idle queue must not keep polling: over a second the whole process (initiator and
    // target) uses a small fraction of a CPU, where a spinning queue would use all of one.
    let before = process_cpu();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let used = process_cpu() - before;
    assert!(
        used < Duration::from_millis(500),
        "idle initiator used {used:?} of CPU in 1 s"
    );
    ctrl.disconnect().await.expect("disconnect");
}

/// A destination that lends its own buffers (as the GPU staging lends pinned slots) and
/// records every buffer that comes back.
struct Lender {
    out: Vec<u8>,
    /// Lend buffers one byte short (of no use: the initiator must fall back to copying).
    short: bool,
    lent: usize,
    /// (offset, len, filled) of every buffer taken back.
    back: Vec<(usize, usize, bool)>,
    copied: usize,
}

struct LentVec(Vec<u8>);

impl nvmeof_initiator::LentBuffer for LentVec {
    fn bytes(&self) -> &[u8] {
        &self.0
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.0
    }
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send> {
        self
    }
}

impl Lender {
    fn new(len: usize, short: bool) -> Lender {
        Lender {
            out: vec![0; len],
            short,
            lent: 0,
            back: Vec::new(),
            copied: 0,
        }
    }
}

impl nvmeof_initiator::ReadDest for Lender {
    fn len(&self) -> usize {
        self.out.len()
    }
    fn write_at(
        &mut self,
        offset: usize,
        data: &[u8],
    ) -> Result<(), nvmeof_initiator::BufferError> {
        self.out[offset..offset + data.len()].copy_from_slice(data);
        self.copied += 1;
        Ok(())
    }
    fn lend(&mut self, _offset: usize, len: usize) -> Option<nvmeof_initiator::Lent> {
        self.lent += 1;
        // Garbage in the buffer: every byte read must be overwritten.
        let n = if self.short { len - 1 } else { len };
        Some(nvmeof_initiator::Lent::Other(Box::new(LentVec(vec![
            0xEE;
            n
        ]))))
    }
    fn take_back(
        &mut self,
        offset: usize,
        len: usize,
        buf: nvmeof_initiator::Lent,
        filled: bool,
    ) -> Result<(), nvmeof_initiator::BufferError> {
        let nvmeof_initiator::Lent::Other(buf) = buf else {
            return Err("not mine".into());
        };
        let v = buf
            .into_any()
            .downcast::<LentVec>()
            .map_err(|_| "not mine")?;
        if filled {
            self.out[offset..offset + len].copy_from_slice(&v.0[..len]);
        }
        self.back.push((offset, len, filled));
        Ok(())
    }
}

/// A controller of `t` with data digests on or off, and namespace 1 on its first I/O queue.
async fn first_io_queue(t: &TestTarget, data_digest: bool) -> (Controller, Namespace) {
    let mut o = options(t.target_addr());
    o.data_digest = data_digest;
    let ctrl = Controller::connect(o).await.expect("connect");
    let ns = ctrl.namespace(1).await.expect("namespace").on_queue(0);
    (ctrl, ns)
}

/// Reads into a destination that lends its buffers: every command's data lands in the lent
/// buffer (none is copied in), every buffer comes back (filled on success, not filled on an
/// error status), large PDUs are received straight from the socket into the buffer, and a
/// buffer too short is given back unused while the read still succeeds by copying. With and
/// without data digests; transfers split over several commands included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_land_in_buffers_the_destination_lends() {
    let t = TestTarget::start(&["mem:32M"], |s| s.mdts_kib = 512);
    for dd in [false, true] {
        let (ctrl, ns) = first_io_queue(&t, dd).await;
        let len = (2 << 20) + 3 * 4096;
        let data = pattern(21 + u64::from(dd), 7 * 4096, len);
        ns.write(7, &data).await.expect("write");
        let before = ctrl.queue_stats()[1];
        // One command of 4 KiB, one of 512 KiB, and 2 MiB + 12 KiB split into five.
        for (lba, bytes, commands) in [(7u64, 4096usize, 1usize), (7, 512 << 10, 1), (7, len, 5)] {
            let mut dest = Lender::new(bytes, false);
            ns.read_into(lba, &mut dest).await.expect("read");
            assert!(dest.out == data[..bytes], "{bytes} bytes, digest {dd}");
            assert_eq!(dest.lent, commands);
            assert_eq!(dest.copied, 0, "nothing copied in");
            assert_eq!(dest.back.len(), commands);
            assert!(dest.back.iter().all(|b| b.2), "{:?}", dest.back);
            let mut offsets: Vec<usize> = dest.back.iter().map(|b| b.0).collect();
            offsets.sort_unstable();
            assert_eq!(offsets[0], 0);
        }
        let after = ctrl.queue_stats()[1];
        assert_eq!(after.lent_commands - before.lent_commands, 7);
        // 2.5 MiB read in 128 KiB PDUs: most of it lands straight from the socket.
        let in_place = after.in_place_bytes - before.in_place_bytes;
        assert!(in_place > (1 << 20), "only {in_place} bytes in place");

        // Too short to use: the read copies into the destination instead.
        let mut dest = Lender::new(64 << 10, true);
        ns.read_into(7, &mut dest).await.expect("read");
        assert!(dest.out == data[..64 << 10]);
        assert_eq!((dest.lent, dest.copied), (1, 1));
        assert_eq!(dest.back, vec![(0, 64 << 10, false)]);

        // An error status gives the buffer back unfilled.
        let mut dest = Lender::new(2 * 4096, false);
        let e = ns
            .read_into(ns.num_blocks() - 1, &mut dest)
            .await
            .expect_err("out of range");
        assert_eq!(e.status().map(|s| s.sc), Some(generic::LBA_OUT_OF_RANGE));
        assert_eq!(dest.back, vec![(0, 2 * 4096, false)]);

        // Plain reads after all that: the queue's own buffers are back in use.
        let mut back = vec![0u8; len];
        ns.read(7, &mut back).await.expect("read");
        assert!(back == data);
        ctrl.disconnect().await.expect("disconnect");
    }
}

/// Reads into a caller's slice whose data comes in one PDU are copied once, straight out of
/// the connection's receive buffer (kept there until the caller reads them), with and
/// without data digests, many in flight on one queue; reads split over several PDUs or
/// commands are copied as before; slots that held kept data serve writes and reads after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slice_reads_are_copied_once_from_where_they_arrived() {
    let t = TestTarget::start(&["mem:32M"], |s| s.mdts_kib = 512);
    for dd in [false, true] {
        let (ctrl, ns) = first_io_queue(&t, dd).await;
        let blocks = 256usize;
        let data = pattern(31 + u64::from(dd), 0, blocks * 4096);
        ns.write(0, &data).await.expect("write");
        let before = ctrl.queue_stats()[1];
        let mut reads = tokio::task::JoinSet::new();
        for task in 0..32usize {
            let ns = ns.clone();
            reads.spawn(async move {
                let mut got = Vec::new();
                for i in 0..16usize {
                    let b = (task * 37 + i * 101) % blocks;
                    let mut buf = vec![0u8; 4096];
                    ns.read(b as u64, &mut buf).await.expect("read");
                    got.push((b, buf));
                }
                got
            });
        }
        let mut n = 0;
        while let Some(got) = reads.join_next().await {
            for (b, buf) in got.expect("task") {
                assert!(
                    buf == data[b * 4096..(b + 1) * 4096],
                    "block {b}, digest {dd}"
                );
                n += 1;
            }
        }
        assert_eq!(n, 32 * 16);
        let after = ctrl.queue_stats()[1];
        let kept = after.kept_reads - before.kept_reads;
        assert!(
            kept > 0 && kept <= 512,
            "{kept} of 512 reads kept, digest {dd}"
        );

        // Slots that held kept data: writes, then reads of one PDU and of several.
        let fresh = pattern(77, 0, 64 * 4096);
        ns.write(0, &fresh).await.expect("write");
        let mut one = vec![0u8; 4096];
        ns.read(5, &mut one).await.expect("read");
        assert!(one == fresh[5 * 4096..6 * 4096]);
        let mut many = vec![0u8; 64 * 4096];
        ns.read(0, &mut many).await.expect("read");
        assert!(many == fresh);
        let mut split = vec![0u8; 1 << 20];
        ns.read(0, &mut split).await.expect("read");
        assert!(split[..64 * 4096] == fresh[..]);
        assert!(split[64 * 4096..] == data[64 * 4096..]);
        ctrl.disconnect().await.expect("disconnect");
    }
}

/// A `Vec<u8>` read in one command lends itself: the data lands straight in the vector (no
/// copy from the queue's buffer), the vector comes back filled, and an error status gives it
/// back with its length. A read split over several commands copies into it as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vec_reads_land_in_the_vector() {
    let t = TestTarget::start(&["mem:32M"], |s| s.mdts_kib = 512);
    let ctrl = Controller::connect(options(t.target_addr()))
        .await
        .expect("connect");
    let ns = ctrl.namespace(1).await.expect("namespace").on_queue(0);
    let len = 1 << 20;
    let data = pattern(5, 3 * 4096, len);
    ns.write(3, &data).await.expect("write");
    let before = ctrl.queue_stats()[1];
    for bytes in [4096usize, 512 << 10] {
        let mut v = vec![0u8; bytes];
        ns.read_into(3, &mut v).await.expect("read");
        assert!(v == data[..bytes], "{bytes} bytes");
    }
    let after = ctrl.queue_stats()[1];
    assert_eq!(after.lent_commands - before.lent_commands, 2);

    // Split over two commands: copied in, nothing lent.
    let mut v = vec![0u8; len];
    ns.read_into(3, &mut v).await.expect("read");
    assert!(v == data);
    assert_eq!(ctrl.queue_stats()[1].lent_commands, after.lent_commands);

    // An error status: the vector comes back whole.
    let mut v = vec![0u8; 2 * 4096];
    let e = ns
        .read_into(ns.num_blocks() - 1, &mut v)
        .await
        .expect_err("out of range");
    assert_eq!(e.status().map(|s| s.sc), Some(generic::LBA_OUT_OF_RANGE));
    assert_eq!(v.len(), 2 * 4096);
    ctrl.disconnect().await.expect("disconnect");
}
