//! Force Unit Access and Flush against a crash of `nvmeof-targetd`.
//!
//! A file namespace behind `volatile_cache` loses every write that no Flush or FUA made
//! durable when the daemon is killed with SIGKILL, as a drive's cache loses it in a power cut.
//! Our initiator (library and `nvmeof write --force-unit-access`) writes through a real daemon,
//! the daemon is killed and restarted on the same file, and what survived is read back. The
//! Volatile Write Cache bit and feature are checked against the backends that have one.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nvme_spec::command::{build, cns};
use nvme_spec::identify::IdentifyController;
use nvme_spec::status::generic;
use nvme_spec::{FromBytes, SglDescriptor, features};
use nvmeof_initiator::{
    ConnectOptions, Controller, HostIdentity, Namespace, ReconnectPolicy, TargetAddr, Timeouts,
};
use nvmeof_tests::verified_io::runtime;
use nvmeof_tests::{RawHost, Reply, TEST_HOSTNQN, TargetProcess, bin_path};

const NQN: &str = "nqn.2026-11.io.nvmeof-direct:fua";
const HOSTID: [u8; 16] = [0, 0, 0, 0, 0, 0, 0x40, 0, 0x80, 0, 0, 0, 0, 0, 0, 1];
const BS: usize = 4096;
/// Blocks per pattern.
const N: usize = 8;
/// Where each pattern goes: FUA, written then flushed, plain; then the CLI's FUA and plain.
const LBA_FUA: u64 = 16;
const LBA_FLUSHED: u64 = 32;
const LBA_PLAIN: u64 = 48;
const LBA_CLI_FUA: u64 = 64;
const LBA_CLI_PLAIN: u64 = 80;

fn pattern(tag: u8) -> Vec<u8> {
    (0..N * BS).map(|i| tag ^ (i % 251) as u8).collect()
}

/// Starts the daemon on `img` behind a volatile cache and checks its warning line.
fn start(img: &Path) -> TargetProcess {
    let spec = format!("file:{},size=16M,volatile_cache=1M", img.display());
    let mut t = TargetProcess::quick(NQN, &[&spec]);
    let log = t.log();
    assert!(
        log.contains("volatile_cache=1M (testing feature)") && log.contains("lost"),
        "no warning about the volatile cache:\n{log}"
    );
    t
}

async fn connect(t: &TargetProcess) -> (Controller, Namespace) {
    let host = HostIdentity::new(TEST_HOSTNQN, HOSTID).expect("host identity");
    let mut o = ConnectOptions::new(TargetAddr::new("127.0.0.1", t.port), NQN, host);
    o.io_queues = Some(1);
    o.timeouts = Timeouts {
        connect: Duration::from_secs(5),
        admin: Duration::from_secs(5),
        io: Duration::from_secs(10),
        shutdown: Duration::from_secs(3),
    };
    o.reconnect = ReconnectPolicy {
        initial_delay: Duration::from_millis(100),
        max_delay: Duration::from_millis(500),
        ..o.reconnect
    };
    let ctrl = Controller::connect(o).await.expect("connect");
    assert!(ctrl.info().volatile_write_cache, "VWC not reported");
    let ns = ctrl.namespace(1).await.expect("namespace");
    (ctrl, ns)
}

async fn read(ns: &Namespace, lba: u64) -> Vec<u8> {
    let mut buf = vec![0u8; N * BS];
    ns.read(lba, &mut buf).await.expect("read");
    buf
}

fn assert_blocks(got: &[u8], want: &[u8], what: &str) {
    assert!(
        got == want,
        "{what}: the blocks do not hold the expected data"
    );
}

/// A TCP proxy in front of the daemon that cuts every connection to it as soon as the target
/// has completed a Write: the host's later commands (the shutdown of `nvmeof write`'s
/// disconnect, which would flush) never arrive, as if the target had died right after the
/// write. The host's connections close when it sends its next PDU.
struct CutAfterWrite {
    port: u16,
    cut: Arc<AtomicBool>,
}

/// NVMe/TCP PDU types (NVMe/TCP Transport 1.0, Figure 21) and the Write opcode.
const CAPSULE_CMD: u8 = 0x04;
const CAPSULE_RESP: u8 = 0x05;
const WRITE: u8 = 0x01;

/// The proxy's sockets: host sides and target sides.
#[derive(Default)]
struct Sockets {
    hosts: Vec<TcpStream>,
    targets: Vec<TcpStream>,
}

fn close_all(streams: &[TcpStream]) {
    for s in streams {
        let _ = s.shutdown(Shutdown::Both);
    }
}

impl CutAfterWrite {
    fn start(target_port: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        let port = listener.local_addr().unwrap().port();
        let cut = Arc::new(AtomicBool::new(false));
        let c = cut.clone();
        std::thread::spawn(move || {
            let sockets: Arc<Mutex<Sockets>> = Arc::default();
            for host in listener.incoming() {
                let Ok(host) = host else { return };
                if c.load(Ordering::SeqCst) {
                    continue;
                }
                let target = TcpStream::connect(("127.0.0.1", target_port)).expect("connect");
                {
                    let mut s = sockets.lock().unwrap();
                    s.hosts.push(host.try_clone().unwrap());
                    s.targets.push(target.try_clone().unwrap());
                }
                let writes: Arc<Mutex<Vec<u16>>> = Arc::default();
                let (h, t) = (host.try_clone().unwrap(), target.try_clone().unwrap());
                let (w, c1, s1) = (writes.clone(), c.clone(), sockets.clone());
                std::thread::spawn(move || {
                    // Host to target: note the command IDs of writes; after the cut, close the
                    // host's connections instead of passing anything on.
                    pump(h, t, |pdu| {
                        if c1.load(Ordering::SeqCst) {
                            close_all(&s1.lock().unwrap().hosts);
                            return false;
                        }
                        if pdu[0] == CAPSULE_CMD && pdu.len() >= 72 && pdu[8] == WRITE {
                            w.lock()
                                .unwrap()
                                .push(u16::from_le_bytes([pdu[10], pdu[11]]));
                        }
                        true
                    });
                });
                let (c2, s2) = (c.clone(), sockets.clone());
                std::thread::spawn(move || {
                    // Target to host: once a write's completion has passed, cut the target off.
                    pump(target, host, |pdu| {
                        let done = pdu[0] == CAPSULE_RESP
                            && pdu.len() >= 24
                            && writes
                                .lock()
                                .unwrap()
                                .contains(&u16::from_le_bytes([pdu[20], pdu[21]]));
                        if done {
                            c2.store(true, Ordering::SeqCst);
                            close_all(&s2.lock().unwrap().targets);
                        }
                        true
                    });
                });
            }
        });
        CutAfterWrite { port, cut }
    }
}

/// Passes whole PDUs from `from` to `to` while `pass` (asked before each) says so, until either
/// side closes.
fn pump(mut from: TcpStream, mut to: TcpStream, mut pass: impl FnMut(&[u8]) -> bool) {
    let mut buf = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        let Ok(n) = from.read(&mut chunk) else { return };
        if n == 0 {
            return;
        }
        buf.extend_from_slice(&chunk[..n]);
        let mut off = 0;
        while buf.len() >= off + 8 {
            let plen = u32::from_le_bytes(buf[off + 4..off + 8].try_into().unwrap()) as usize;
            if plen < 8 || buf.len() < off + plen {
                break;
            }
            let pdu = &buf[off..off + plen];
            if !pass(pdu) || to.write_all(pdu).is_err() {
                return;
            }
            off += plen;
        }
        buf.drain(..off);
    }
}

/// `nvmeof write` of `data` at `lba` through a [`CutAfterWrite`] proxy, with `-f` when `fua`.
fn cli_write(t: &TargetProcess, dir: &Path, lba: u64, data: &[u8], fua: bool) {
    let file = dir.join(format!("cli-{lba}.bin"));
    std::fs::write(&file, data).expect("write the input file");
    let proxy = CutAfterWrite::start(t.port);
    let port = proxy.port.to_string();
    let lba = lba.to_string();
    let mut args = vec![
        "write",
        "-a",
        "127.0.0.1",
        "--trsvcid",
        &port,
        "-n",
        NQN,
        "-q",
        TEST_HOSTNQN,
        "--start-block",
        &lba,
    ];
    if fua {
        args.push("-f");
    }
    let out = Command::new(bin_path("nvmeof"))
        .args(&args)
        .arg("--data")
        .arg(&file)
        .arg("--state-dir")
        .arg(dir)
        .output()
        .expect("run nvmeof");
    assert!(
        out.status.success(),
        "nvmeof write failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        proxy.cut.load(Ordering::SeqCst),
        "the proxy saw no write complete"
    );
}

#[test]
fn fua_and_flushed_writes_survive_a_crash_and_plain_writes_do_not() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let img = dir.path().join("ns.img");
    let old = pattern(0x11);
    let (a, b, c, d, e) = (
        pattern(0xA0),
        pattern(0xB0),
        pattern(0xC0),
        pattern(0xD0),
        pattern(0xE0),
    );

    // 1. Old contents everywhere, made durable; then B followed by a Flush, A with FUA, C plain.
    let t = start(&img);
    let rt = runtime();
    let ctrl = rt.block_on(async {
        let (ctrl, ns) = connect(&t).await;
        for lba in [LBA_FUA, LBA_FLUSHED, LBA_PLAIN, LBA_CLI_FUA, LBA_CLI_PLAIN] {
            ns.write(lba, &old).await.expect("write old");
        }
        ns.flush().await.expect("flush");
        // A after the Flush, so that only its own FUA can make it durable.
        ns.write(LBA_FLUSHED, &b).await.expect("write B");
        ns.flush().await.expect("flush B");
        ns.write_fua(LBA_FUA, &a).await.expect("write A with FUA");
        ns.write(LBA_PLAIN, &c).await.expect("write C");
        // Before the crash every write reads back.
        assert_blocks(&read(&ns, LBA_FUA).await, &a, "A before the crash");
        assert_blocks(&read(&ns, LBA_FLUSHED).await, &b, "B before the crash");
        assert_blocks(&read(&ns, LBA_PLAIN).await, &c, "C before the crash");
        ctrl
    });
    // Killed while the host is still connected: no shutdown, no flush.
    t.crash();
    drop(ctrl);
    drop(rt);

    // 2. Restarted on the same file: A and B are there, C is gone.
    let t = start(&img);
    let rt = runtime();
    let ctrl = rt.block_on(async {
        let (ctrl, ns) = connect(&t).await;
        assert_blocks(&read(&ns, LBA_FUA).await, &a, "A (FUA) after the crash");
        assert_blocks(
            &read(&ns, LBA_FLUSHED).await,
            &b,
            "B (flushed) after the crash",
        );
        assert_blocks(
            &read(&ns, LBA_PLAIN).await,
            &old,
            "C (neither flushed nor FUA) after the crash: the old data",
        );
        ctrl
    });
    // 3. The CLI: D with --force-unit-access, E plain.
    cli_write(&t, dir.path(), LBA_CLI_FUA, &d, true);
    cli_write(&t, dir.path(), LBA_CLI_PLAIN, &e, false);
    rt.block_on(async {
        let ns = ctrl.namespace(1).await.expect("namespace");
        assert_blocks(&read(&ns, LBA_CLI_PLAIN).await, &e, "E before the crash");
    });
    t.crash();
    drop(ctrl);
    drop(rt);

    let t = start(&img);
    let rt = runtime();
    rt.block_on(async {
        let (ctrl, ns) = connect(&t).await;
        assert_blocks(&read(&ns, LBA_CLI_FUA).await, &d, "D (nvmeof write -f)");
        assert_blocks(
            &read(&ns, LBA_CLI_PLAIN).await,
            &old,
            "E (plain nvmeof write)",
        );
        assert_blocks(&read(&ns, LBA_FUA).await, &a, "A after the second crash");
        ctrl.disconnect().await.expect("disconnect");
    });
    let (code, log) = t.terminate();
    assert_eq!(code, Some(0), "{log}");
}

fn data_cmd(mut sqe: nvme_spec::Sqe, len: u32) -> nvme_spec::Sqe {
    sqe.dptr = SglDescriptor::tcp_transport(len);
    sqe
}

/// Identify Controller's VWC byte and Get Features (Volatile Write Cache)'s outcome.
fn vwc(t: &TargetProcess) -> (u8, Result<u32, u8>) {
    let (mut h, _) = RawHost::admin(t.addr(), NQN);
    let id = match h.command(
        &data_cmd(build::identify(7, cns::CONTROLLER, 0), 4096),
        &[],
        &[],
    ) {
        Reply::Completion(c, d) if c.status().is_success() => d,
        Reply::DataSuccess(d) => d,
        other => panic!("Identify: {other:?}"),
    };
    let id = IdentifyController::read_from_bytes(&id).expect("identify");
    let feature = match h.command(
        &build::get_features(8, features::VOLATILE_WRITE_CACHE),
        &[],
        &[],
    ) {
        Reply::Completion(c, _) if c.status().is_success() => Ok(c.dw0.get()),
        Reply::Completion(c, _) => Err(c.status().sc),
        other => panic!("Get Features: {other:?}"),
    };
    (id.vwc, feature)
}

#[test]
fn volatile_write_cache_is_reported_where_a_backend_has_one() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    // RAM: nothing a flush could save; the daemon says so in its log.
    let mut t = TargetProcess::quick(NQN, &["mem:16M"]);
    assert_eq!(vwc(&t), (0b110, Err(generic::INVALID_FIELD)));
    assert!(t.log().contains("RAM namespace"), "{}", t.log());
    t.crash();
    // A file: the page cache or the device's cache until a Flush.
    let spec = format!("file:{},size=1M", dir.path().join("ns.img").display());
    let t = TargetProcess::quick(NQN, &[&spec]);
    assert_eq!(vwc(&t), (0b111, Ok(1)));
    t.crash();
}
