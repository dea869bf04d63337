//! NVMe reservations through a real `nvmeof-targetd` and our initiator: hosts with different
//! host identifiers register, acquire, conflict, preempt and abort, release and clear; two
//! controllers of one host share its registration; a preempted host's controllers get the
//! Reservation Notification event; with Persist Through Power Loss the state survives SIGKILL and a restart.
//! The `nvmeof resv-*` commands are run against the same daemon.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use nvme_spec::command::log_id;
use nvme_spec::status::generic;
use nvmeof_initiator::{
    ConnectOptions, Controller, ControllerEvent, Error, HostIdentity, Namespace, ResvAcquire,
    ResvRegister, ResvRelease, TargetAddr, Timeouts,
};
use nvmeof_tests::verified_io::runtime;
use nvmeof_tests::{TargetProcess, bin_path, free_port};

const NQN: &str = "nqn.2026-11.io.nvmeof-direct:resv";
const HOST_A: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-00000000000a";
const HOST_B: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-00000000000b";
const HOST_C: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-00000000000c";
const ID_A: [u8; 16] = [0, 0, 0, 0, 0, 0, 0x40, 0, 0x80, 0, 0, 0, 0, 0, 0, 0x0a];
const ID_B: [u8; 16] = [0, 0, 0, 0, 0, 0, 0x40, 0, 0x80, 0, 0, 0, 0, 0, 0, 0x0b];
const ID_C: [u8; 16] = [0, 0, 0, 0, 0, 0, 0x40, 0, 0x80, 0, 0, 0, 0, 0, 0, 0x0c];
const KEY_A: u64 = 0xA0A0_0000_0000_000A;
const KEY_B: u64 = 0xB0B0;
const BS: usize = 4096;

/// Starts the daemon with a file namespace and reservations kept in `state`.
fn start(dir: &Path, img: &Path, state: &Path) -> TargetProcess {
    let port = free_port();
    let toml = format!(
        "[target]\nstate_dir = \"{}\"\n\n[[listener]]\naddress = \"tcp://127.0.0.1:{port}\"\n\n\
         [[subsystem]]\nnqn = \"{NQN}\"\nallow_any_host = true\n\n\
         [[subsystem.namespace]]\nbackend = \"file:{},size=4M\"\n",
        state.display(),
        img.display()
    );
    std::fs::create_dir_all(dir).expect("config dir");
    TargetProcess::with_config(dir, &toml, 0o600, port)
}

async fn connect(t: &TargetProcess, nqn: &str, id: [u8; 16]) -> (Controller, Namespace) {
    let host = HostIdentity::new(nqn, id).expect("host identity");
    let mut o = ConnectOptions::new(TargetAddr::new("127.0.0.1", t.port), NQN, host);
    o.io_queues = Some(1);
    o.timeouts = Timeouts {
        connect: Duration::from_secs(5),
        admin: Duration::from_secs(5),
        io: Duration::from_secs(10),
        shutdown: Duration::from_secs(3),
    };
    let ctrl = Controller::connect(o).await.expect("connect");
    let ns = ctrl.namespace(1).await.expect("namespace");
    (ctrl, ns)
}

/// The NVMe status code of a failed command.
fn sc(r: Result<(), Error>) -> Option<u8> {
    match r {
        Ok(()) => None,
        Err(e) => Some(e.status().unwrap_or_else(|| panic!("not a status: {e}")).sc),
    }
}

async fn write(ns: &Namespace) -> Option<u8> {
    sc(ns.write(0, &[7u8; BS]).await)
}

async fn read(ns: &Namespace) -> Option<u8> {
    let mut buf = vec![0u8; BS];
    sc(ns.read(0, &mut buf).await)
}

const CONFLICT: Option<u8> = Some(generic::RESERVATION_CONFLICT);

#[test]
fn two_hosts_register_acquire_conflict_preempt_and_release() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let state = dir.path().join("state");
    std::fs::create_dir(&state).unwrap();
    let t = start(&dir.path().join("cfg"), &dir.path().join("ns.img"), &state);
    runtime().block_on(async {
        let (ca, a) = connect(&t, HOST_A, ID_A).await;
        let (ca2, a2) = connect(&t, HOST_A, ID_A).await;
        let (cb, b) = connect(&t, HOST_B, ID_B).await;
        let (cc, c) = connect(&t, HOST_C, ID_C).await;

        let id = ca.identify_namespace(1).await.unwrap();
        assert_eq!(
            id.rescap, 0xFF,
            "PTPL, the six types and IEKEY as NVMe 1.3 defines it"
        );
        let ctrl = ca.identify_controller().await.unwrap();
        assert_ne!(ctrl.oncs.get() & (1 << 5), 0, "ONCS reservations");

        a.resv_register(ResvRegister::Register, 0, KEY_A, false, 0)
            .await
            .unwrap();
        b.resv_register(ResvRegister::Register, 0, KEY_B, false, 0)
            .await
            .unwrap();
        // The second controller of host A is registered already, with A's key.
        assert_eq!(
            sc(a2
                .resv_register(ResvRegister::Register, 0, 1, false, 0)
                .await),
            CONFLICT
        );
        // Acquire needs the right key.
        assert_eq!(
            sc(a.resv_acquire(ResvAcquire::Acquire, 1, KEY_B, 0, false)
                .await),
            CONFLICT
        );
        a.resv_acquire(ResvAcquire::Acquire, 1, KEY_A, 0, false)
            .await
            .unwrap();
        // Write Exclusive: the holder's host (both controllers) writes, others only read.
        assert_eq!(write(&a).await, None);
        assert_eq!(write(&a2).await, None);
        assert_eq!(write(&b).await, CONFLICT);
        assert_eq!(write(&c).await, CONFLICT);
        assert_eq!(sc(b.flush().await), CONFLICT);
        assert_eq!(sc(c.write_zeroes(0, 1).await), CONFLICT);
        assert_eq!(sc(c.deallocate(0, 1).await), CONFLICT);
        assert_eq!(read(&b).await, None);
        assert_eq!(read(&c).await, None);
        // Another type while holding: conflict; another host: conflict.
        assert_eq!(
            sc(a.resv_acquire(ResvAcquire::Acquire, 2, KEY_A, 0, false)
                .await),
            CONFLICT
        );
        assert_eq!(
            sc(b.resv_acquire(ResvAcquire::Acquire, 1, KEY_B, 0, false)
                .await),
            CONFLICT
        );

        let r = c.resv_report(true).await.unwrap();
        assert_eq!((r.rtype, r.registrants.len()), (1, 2));
        let ra = r.registrants.iter().find(|g| g.hostid == ID_A).unwrap();
        assert!(ra.holds && ra.rkey == KEY_A && ra.cntlid == 0xFFFF);
        let rb = r.registrants.iter().find(|g| g.hostid == ID_B).unwrap();
        assert!(!rb.holds && rb.rkey == KEY_B);
        // 128-bit host identifiers: the 64-bit structure is refused.
        assert_eq!(
            c.resv_report(false)
                .await
                .unwrap_err()
                .status()
                .map(|s| s.sc),
            Some(generic::HOST_ID_INCONSISTENT)
        );

        let mut ev_a = ca.subscribe_events();
        let mut ev_a2 = ca2.subscribe_events();
        // B preempts A and aborts: B holds Exclusive Access, A is no longer registered.
        b.resv_acquire(ResvAcquire::PreemptAndAbort, 2, KEY_B, KEY_A, false)
            .await
            .unwrap();
        assert_eq!(read(&a).await, CONFLICT);
        assert_eq!(read(&a2).await, CONFLICT);
        assert_eq!(write(&a2).await, CONFLICT);
        assert_eq!(read(&c).await, CONFLICT);
        assert_eq!(read(&b).await, None);
        assert_eq!(write(&b).await, None);
        let r = b.resv_report(true).await.unwrap();
        assert_eq!((r.rtype, r.registrants.len()), (2, 1));
        assert!(r.generation >= 3, "generation {}", r.generation);
        // Host A's controllers are told with an event for the Reservation Notification log
        // page (which our initiator reads, as the event asks).
        for events in [&mut ev_a, &mut ev_a2] {
            loop {
                let e = tokio::time::timeout(Duration::from_secs(20), events.recv())
                    .await
                    .expect("no reservation event")
                    .expect("events");
                if let ControllerEvent::AsyncEvent {
                    event_type,
                    info,
                    log_page,
                } = e
                {
                    assert_eq!((event_type, info), (6, 0));
                    assert_eq!(log_page, log_id::RESERVATION_NOTIFICATION);
                    break;
                }
            }
        }
        // A no longer has a key to unregister with.
        assert_eq!(
            sc(
                a.resv_register(ResvRegister::Unregister, KEY_A, 0, false, 0)
                    .await
            ),
            CONFLICT
        );

        // Release of another type is refused; of the held type it succeeds.
        assert_eq!(
            sc(b.resv_release(ResvRelease::Release, 1, KEY_B, false).await),
            Some(generic::INVALID_FIELD)
        );
        b.resv_release(ResvRelease::Release, 2, KEY_B, false)
            .await
            .unwrap();
        assert_eq!(write(&c).await, None);

        // Registrants Only: every registrant writes, others do not; Clear ends it all.
        a.resv_register(ResvRegister::Register, 0, KEY_A, false, 0)
            .await
            .unwrap();
        b.resv_acquire(ResvAcquire::Acquire, 3, KEY_B, 0, false)
            .await
            .unwrap();
        assert_eq!(write(&a).await, None);
        assert_eq!(write(&c).await, CONFLICT);
        a.resv_release(ResvRelease::Clear, 0, KEY_A, false)
            .await
            .unwrap();
        assert_eq!(write(&c).await, None);
        let r = c.resv_report(true).await.unwrap();
        assert_eq!((r.rtype, r.registrants.len()), (0, 0));

        for ctrl in [ca, ca2, cb, cc] {
            let _ = ctrl.disconnect().await;
        }
    });
    let (_, log) = t.terminate();
    assert!(!log.contains("panicked"), "{log}");
}

fn cli(port: u16, host: &str, hostid: &str, args: &[&str], state: &Path) -> (bool, String) {
    let out = Command::new(bin_path("nvmeof"))
        .args(args)
        .args(["-a", "127.0.0.1", "-s", &port.to_string(), "-n", NQN])
        .args(["--hostnqn", host, "--hostid", hostid])
        .arg("--state-dir")
        .arg(state)
        .output()
        .expect("run nvmeof");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn reservations_persist_through_a_daemon_kill_when_ptpl_is_on() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let state = dir.path().join("state");
    std::fs::create_dir(&state).unwrap();
    let img = dir.path().join("ns.img");
    let cli_state = dir.path().join("cli");
    let uuid_a = "00000000-0000-4000-8000-00000000000a";
    let uuid_b = "00000000-0000-4000-8000-00000000000b";

    let t = start(&dir.path().join("cfg1"), &img, &state);
    let key_a = format!("{KEY_A:#x}");
    let (ok, out) = cli(
        t.port,
        HOST_A,
        uuid_a,
        &["resv-register", "--nrkey", &key_a, "--cptpl", "3"],
        &cli_state,
    );
    assert!(ok, "{out}");
    let (ok, out) = cli(
        t.port,
        HOST_A,
        uuid_a,
        &["resv-acquire", "--crkey", &key_a, "--rtype", "1"],
        &cli_state,
    );
    assert!(ok, "{out}");
    // Another host's acquire is a conflict, said on one line.
    let (ok, out) = cli(
        t.port,
        HOST_B,
        uuid_b,
        &["resv-acquire", "--rtype", "1"],
        &cli_state,
    );
    assert!(!ok && out.contains("Reservation Conflict"), "{out}");
    assert_eq!(out.trim().lines().count(), 1, "{out}");
    t.crash();

    let t = start(&dir.path().join("cfg2"), &img, &state);
    let (ok, out) = cli(
        t.port,
        HOST_B,
        uuid_b,
        &["resv-report", "--eds"],
        &cli_state,
    );
    assert!(ok, "{out}");
    assert!(out.contains("rtype     : 1 (Write Exclusive)"), "{out}");
    assert!(out.contains("ptpls     : 1"), "{out}");
    assert!(out.contains(&format!("rkey       : {KEY_A:x}")), "{out}");
    let hex: String = ID_A.iter().map(|b| format!("{b:02x}")).collect();
    assert!(out.contains(&format!("hostid     : {hex}")), "{out}");
    runtime().block_on(async {
        let (cb, b) = connect(&t, HOST_B, ID_B).await;
        assert_eq!(write(&b).await, CONFLICT);
        let (ca, a) = connect(&t, HOST_A, ID_A).await;
        assert_eq!(write(&a).await, None);
        assert!(
            ca.get_features(0x83).await.is_err(),
            "namespace specific: NSID 0 refused"
        );
        // Turning PTPL off removes the saved state: after the next kill nothing is left.
        a.resv_register(ResvRegister::Register, 0, KEY_A, false, 2)
            .await
            .unwrap();
        let _ = ca.disconnect().await;
        let _ = cb.disconnect().await;
    });
    assert!(
        std::fs::read_dir(&state).unwrap().next().is_none(),
        "state left behind"
    );
    t.crash();
    let t = start(&dir.path().join("cfg3"), &img, &state);
    runtime().block_on(async {
        let (cb, b) = connect(&t, HOST_B, ID_B).await;
        assert_eq!(write(&b).await, None);
        let r = b.resv_report(true).await.unwrap();
        assert_eq!((r.rtype, r.registrants.len(), r.ptpl), (0, 0, false));
        let _ = cb.disconnect().await;
    });
    let (_, log) = t.terminate();
    assert!(!log.contains("panicked"), "{log}");
}
