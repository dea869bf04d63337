//! Our initiator's multipath against the Linux kernel NVMe/TCP target (nvmet) in a QEMU guest:
//! one subsystem on two ports, port 1 optimized and port 2 non-optimized (configfs
//! `ports/N/ana_groups/1/ana_state`), both reached through hostfwd. Writers with read-back
//! verification run on a [`Multipath`] namespace while the guest makes port 1 inaccessible
//! (the head follows the change notice or the ANA status of I/O and moves to port 2) and
//! optimized again (it fails back); every acknowledged write is read back at the end.
//!
//! The guest script (tests/guest/nvmet-ana-target.sh) changes the state when the host has
//! connected both paths, and changes it back when the host connects a third controller.
//!
//! Needs the guest prepared by `tests/interop/setup.sh` and `NVMEOF_INTEROP=1`; without it the
//! test prints why it did nothing.

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use nvmeof_initiator::{
    ConnectOptions, Controller, HostIdentity, Multipath, MultipathNamespace, MultipathOptions,
    PathInfo, ReconnectPolicy, TargetAddr,
};
use nvmeof_tests::{BackgroundGuest, free_port, guest_sh, skip_without_interop, workspace_root};

const NQN: &str = "nqn.2014-08.org.nvmexpress:nvmeof-direct-ana-interop";
const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:6a0f0c4e-0000-4000-8000-0000000000a2";
const BLOCKS: u64 = 16;

fn options(port: u16) -> ConnectOptions {
    let host = HostIdentity::new(HOSTNQN, [0xa2; 16]).unwrap();
    let mut o = ConnectOptions::new(TargetAddr::new("127.0.0.1", port), NQN, host);
    o.io_queues = Some(1);
    o.queue_depth = 32;
    // The guest runs under emulation: be patient.
    o.timeouts.connect = Duration::from_secs(30);
    o.timeouts.admin = Duration::from_secs(30);
    o.timeouts.io = Duration::from_secs(60);
    o.reconnect = ReconnectPolicy {
        ctrl_loss_timeout: None,
        ..ReconnectPolicy::default()
    };
    o
}

fn pattern(lba: u64, v: u64, bs: usize) -> Vec<u8> {
    (0..bs)
        .map(|i| (lba as u8).wrapping_mul(31) ^ (v as u8) ^ (i as u8).wrapping_mul(7))
        .collect()
}

struct Shared {
    ops: AtomicU64,
    acked: Vec<AtomicU64>,
    stop: AtomicBool,
    error: std::sync::Mutex<Option<String>>,
}

/// Writes the blocks in turn, each a new version, reading each back at once.
async fn writer(ns: MultipathNamespace, s: Arc<Shared>) {
    let bs = ns.block_size() as usize;
    let mut back = vec![0u8; bs];
    let mut v = 1u64;
    while !s.stop.load(Ordering::Relaxed) {
        let lba = v % BLOCKS;
        let data = pattern(lba, v, bs);
        let r = match ns.write(lba, &data).await {
            Ok(()) => {
                s.acked[lba as usize].store(v, Ordering::Relaxed);
                ns.read(lba, &mut back).await
            }
            Err(e) => Err(e),
        };
        let failure = match r {
            Err(e) => Some(format!("block {lba} v{v}: {e}")),
            Ok(()) if back != data => Some(format!("block {lba}: read back differs from v{v}")),
            Ok(()) => None,
        };
        if let Some(f) = failure {
            s.error.lock().unwrap().get_or_insert(f);
            return;
        }
        s.ops.fetch_add(1, Ordering::Relaxed);
        v += 1;
    }
}

/// Waits (bounded: the guest is emulated) until `f` holds and `more` further rounds of I/O
/// completed after that.
async fn wait_until(
    mp: &Multipath,
    s: &Shared,
    what: &str,
    more: u64,
    f: impl Fn(&[PathInfo]) -> bool,
) {
    let mut goal = None;
    for _ in 0..6000 {
        if let Some(e) = s.error.lock().unwrap().clone() {
            panic!("I/O failed while waiting for {what}: {e}");
        }
        let ops = s.ops.load(Ordering::Relaxed);
        match goal {
            None if f(&mp.paths()) => goal = Some(ops + more),
            Some(g) if ops >= g => return,
            _ => {}
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{what} did not happen: {:#?}", mp.paths());
}

fn ana_of(p: &PathInfo) -> Option<&str> {
    p.ana
        .iter()
        .find(|g| g.group == 1)
        .map(|g| g.state.as_str())
}

#[test]
fn multipath_follows_the_kernel_targets_ana_states() {
    if skip_without_interop() {
        return;
    }
    let (p1, p2) = (free_port(), free_port());
    let mut cmd = Command::new(guest_sh());
    cmd.args(["start", "--ready-marker", "NVMET-READY", "--timeout", "600"])
        .args(["--hostfwd", &format!("{p1}:4420")])
        .args(["--hostfwd", &format!("{p2}:4421")])
        .args(["--env", &format!("NVMET_NQN={NQN}")])
        .arg(workspace_root().join("tests/guest/nvmet-ana-target.sh"));
    let mut guest = BackgroundGuest::start(&mut cmd);

    let rt = tokio::runtime::Runtime::new().unwrap();
    let (mp, ns) = rt.block_on(async {
        let mp = Multipath::connect(
            options(p1),
            vec![
                TargetAddr::new("127.0.0.1", p1),
                TargetAddr::new("127.0.0.1", p2),
            ],
            MultipathOptions {
                no_path_timeout: Duration::from_secs(120),
                ..MultipathOptions::default()
            },
        )
        .await
        .expect("multipath connect to nvmet");
        let ns = mp.namespace(1).await.expect("namespace");
        (mp, ns)
    });
    let s = Arc::new(Shared {
        ops: AtomicU64::new(0),
        acked: (0..BLOCKS).map(|_| AtomicU64::new(0)).collect(),
        stop: AtomicBool::new(false),
        error: Default::default(),
    });
    let task = rt.spawn(writer(ns.clone(), Arc::clone(&s)));

    assert!(guest.wait_marker("ANA-INACCESSIBLE"), "{}", guest.console());
    rt.block_on(wait_until(
        &mp,
        &s,
        "port 1 inaccessible, port 2 current",
        10,
        |p| {
            ana_of(&p[0]) == Some("inaccessible")
                && ana_of(&p[1]) == Some("non-optimized")
                && p[1].current
        },
    ));
    // The third controller tells the guest to make port 1 optimized again.
    let third = rt
        .block_on(Controller::connect(options(p2)))
        .expect("third controller");
    assert!(guest.wait_marker("ANA-OPTIMIZED"), "{}", guest.console());
    rt.block_on(wait_until(
        &mp,
        &s,
        "port 1 optimized and current again",
        10,
        |p| ana_of(&p[0]) == Some("optimized") && p[0].current,
    ));

    s.stop.store(true, Ordering::Relaxed);
    rt.block_on(task).expect("writer task");
    if let Some(e) = s.error.lock().unwrap().clone() {
        panic!("I/O failed: {e}");
    }
    rt.block_on(async {
        let bs = ns.block_size() as usize;
        let mut buf = vec![0u8; bs];
        for lba in 0..BLOCKS {
            let v = s.acked[lba as usize].load(Ordering::Relaxed);
            if v == 0 {
                continue;
            }
            ns.read(lba, &mut buf).await.expect("final read");
            assert!(buf == pattern(lba, v, bs), "block {lba}: not v{v}");
        }
        third
            .disconnect()
            .await
            .expect("disconnect the third controller");
        drop(ns);
        mp.disconnect().await.expect("multipath disconnect");
    });
    let code = guest.stop();
    let console = guest.console();
    assert_eq!(code, Some(0), "the guest script failed:\n{console}");
    assert!(
        console.contains("port 1: ANA group 1 inaccessible"),
        "{console}"
    );
}
