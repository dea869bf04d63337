//! The Linux kernel NVMe/TCP host (in the QEMU guest) running fio with verify against
//! `nvmeof-targetd` through a proxy in this test that breaks the network path: it stalls
//! (forwards nothing) until the target's keep alive timeout has torn the controller down, and
//! it cuts every connection. The host reconnects each time and fio must see no error and no
//! verify mismatch; meanwhile our initiator does verified I/O on its own connection straight
//! to the daemon. At the end the guest is killed in the middle of a fio round, and the daemon
//! must close everything the host had (its file descriptors back to where they were) and serve
//! a new controller.
//!
//! Needs the guest prepared by `tests/interop/setup.sh` and `NVMEOF_INTEROP=1`.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nvmeof_tests::verified_io::{BusyHost, connect, runtime, write_read_verify};
use nvmeof_tests::{TargetProcess, free_port, guest_sh, skip_without_interop, workspace_root};

const NQN: &str = "nqn.2026-11.io.nvmeof-direct:kernel-faults";
/// Keep alive timeout the guest asks for, in seconds.
const KATO_S: u64 = 4;

/// A TCP proxy that can stall (forward nothing, read nothing) and cut every connection.
struct Proxy {
    port: u16,
    stalled: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<TcpStream>>>,
}

impl Proxy {
    fn start(upstream: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("proxy bind");
        let port = listener.local_addr().expect("proxy addr").port();
        let stalled = Arc::new(AtomicBool::new(false));
        let conns = Arc::new(Mutex::new(Vec::new()));
        let (s, c) = (Arc::clone(&stalled), Arc::clone(&conns));
        std::thread::spawn(move || {
            for down in listener.incoming().map_while(Result::ok) {
                let Ok(up) = TcpStream::connect(upstream) else {
                    continue;
                };
                let pair = [down, up];
                let mut list = c.lock().unwrap();
                for (from, to) in [(0, 1), (1, 0)] {
                    let (Ok(from), Ok(to)) = (pair[from].try_clone(), pair[to].try_clone()) else {
                        continue;
                    };
                    let s = Arc::clone(&s);
                    std::thread::spawn(move || pump(from, to, &s));
                }
                list.extend(pair);
            }
        });
        Proxy {
            port,
            stalled,
            conns,
        }
    }

    fn stall(&self, on: bool) {
        self.stalled.store(on, Ordering::SeqCst);
    }

    /// Closes every connection, both ways.
    fn cut(&self) {
        for s in self.conns.lock().unwrap().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

/// Copies `from` to `to` until either side closes; while stalled, reads nothing.
fn pump(mut from: TcpStream, mut to: TcpStream, stalled: &AtomicBool) {
    let tick = Some(Duration::from_millis(50));
    let _ = from.set_read_timeout(tick);
    let _ = to.set_write_timeout(Some(Duration::from_secs(60)));
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        if stalled.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(20));
            continue;
        }
        match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => break,
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}

fn count(text: &str, needle: &str) -> usize {
    text.matches(needle).count()
}

fn console(log: &Path) -> String {
    std::fs::read_to_string(log).unwrap_or_default()
}

/// Polls `f` every 200 ms until it holds or `timeout` passes; returns whether it held.
fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    f()
}

#[test]
fn kernel_host_rides_through_stalls_and_cuts_and_its_death_is_cleaned_up() {
    if skip_without_interop() {
        return;
    }
    let port = free_port();
    let listen = format!("tcp://127.0.0.1:{port}");
    let args = [
        "--listen",
        &listen,
        "--subsystem",
        NQN,
        "--namespace",
        "mem:64M",
        "--namespace",
        "mem:16M",
    ];
    let began = Instant::now();
    let mut t = TargetProcess::spawn(&args, port);
    let rt = runtime();
    // Our initiator on namespace 2, straight to the daemon, for the whole test.
    let busy = rt.block_on(BusyHost::start(t.addr(), NQN, 2));
    assert!(wait_until(Duration::from_secs(30), || busy.rounds() >= 3));
    let base_fds = t.open_fds();
    let proxy = Proxy::start(t.addr());

    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("console.log");
    let script = workspace_root().join("tests/guest/kernel-host-faults.sh");
    let start = Command::new(guest_sh())
        .args(["start", "--with-fio", "--ready-marker", "FAULTS-READY"])
        .args(["--timeout", "300"])
        .arg("--log")
        .arg(&log)
        .arg("--env")
        .arg(format!("TARGET_PORT={}", proxy.port))
        .arg("--env")
        .arg(format!("TARGET_NQN={NQN}"))
        .arg("--env")
        .arg(format!("KATO={KATO_S}"))
        .arg(&script)
        .output()
        .expect("guest.sh start");
    assert!(
        start.status.success(),
        "guest did not connect:\n{}\n{}\ntarget log:\n{}",
        console(&log),
        String::from_utf8_lossy(&start.stderr),
        t.log()
    );
    let pidfile = String::from_utf8_lossy(&start.stdout).trim().to_string();
    eprintln!("{:?}: guest connected", began.elapsed());
    let verified = |log: &Path| {
        console(log)
            .lines()
            .filter(|l| l.contains("fio round ") && l.contains(" verified"))
            .count()
    };
    assert!(
        wait_until(Duration::from_secs(120), || verified(&log) >= 1),
        "no fio round finished:\n{}",
        console(&log)
    );

    for (i, fault) in ["stall", "cut", "stall"].into_iter().enumerate() {
        let rounds = verified(&log);
        let connects = count(&t.log(), "controller connected");
        let expiries = count(&t.log(), "keep alive timeout expired");
        let busy_before = busy.rounds();
        eprintln!(
            "{:?}: fault {i}: {fault} after {rounds} fio rounds",
            began.elapsed()
        );
        if fault == "stall" {
            proxy.stall(true);
            let expired = wait_until(Duration::from_secs(KATO_S * 4), || {
                count(&t.log(), "keep alive timeout expired") > expiries
            });
            std::thread::sleep(Duration::from_secs(1));
            proxy.stall(false);
            assert!(
                expired,
                "the target's keep alive did not expire during the stall:\n{}",
                t.log()
            );
            assert!(
                busy.rounds() > busy_before,
                "the other controller was not served during the stall"
            );
        } else {
            proxy.cut();
        }
        let recovered = wait_until(Duration::from_secs(180), || {
            count(&t.log(), "controller connected") > connects && verified(&log) >= rounds + 2
        });
        let text = console(&log);
        assert!(
            recovered && !text.contains("FAIL"),
            "the host did not recover from the {fault}:\n{text}\ntarget log:\n{}",
            t.log()
        );
    }

    eprintln!("{:?}: killing the guest", began.elapsed());
    // Kill the host in the middle of a round.
    std::thread::sleep(Duration::from_millis(700));
    let _ = Command::new(guest_sh())
        .args(["stop", "--grace", "0", &pidfile])
        .output();
    let text = console(&log);
    assert!(!text.contains("FAIL"), "{text}");
    let cleaned = wait_until(Duration::from_secs(30), || t.open_fds() == base_fds);
    assert!(
        cleaned,
        "daemon holds {} fds after the host died, {base_fds} before it came:\n{}",
        t.open_fds(),
        t.log()
    );
    let busy_rounds = busy.rounds();
    rt.block_on(async {
        let ctrl = connect(t.addr(), NQN, 2).await;
        let ns = ctrl.namespace(1).await.expect("namespace 1");
        write_read_verify(&ns, 7).await;
        ctrl.disconnect().await.expect("disconnect");
        let ctrl = busy.stop().await;
        ctrl.disconnect().await.expect("disconnect");
    });
    eprintln!(
        "{} fio rounds verified in the guest; {busy_rounds} initiator rounds",
        verified(&log)
    );
    let (code, log) = t.terminate();
    assert_eq!(code, Some(0), "{log}");
    assert!(!log.contains("panicked"), "{log}");
}
