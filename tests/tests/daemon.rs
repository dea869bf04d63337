//! `nvmeof-targetd` as a user runs it: the embedded default, configuration files, signals,
//! keep-alive enforcement, held asynchronous events, stable identity across restarts.

use std::io::Read;
use std::process::Command;
use std::time::Duration;

use nvme_spec::command::{build, cns, log_id};
use nvme_spec::identify::{IdentifyController, IdentifyNamespace, get_trimmed};
use nvme_spec::log::{DiscoveryLogEntry, DiscoveryLogHeader};
use nvme_spec::{FromBytes, SglDescriptor, Sqe, Status};
use nvmeof_tests::{RawHost, Reply, TEST_HOSTNQN, TargetProcess, bin_path, free_port};

const DEFAULT_NQN: &str = "nqn.2026-11.io.nvmeof-direct:default";
const DISCOVERY_NQN: &str = "nqn.2014-08.org.nvmexpress.discovery";

fn data_cmd(mut sqe: Sqe, len: u32) -> Sqe {
    sqe.dptr = SglDescriptor::tcp_transport(len);
    sqe
}

fn ok_data(r: Reply) -> Vec<u8> {
    match r {
        Reply::Completion(c, d) => {
            assert!(c.status().is_success(), "{}", c.status());
            d
        }
        Reply::DataSuccess(d) => d,
        other => panic!("{other:?}"),
    }
}

fn discovery_entries(addr: std::net::SocketAddr) -> Vec<DiscoveryLogEntry> {
    let mut h = RawHost::connect(addr, false, false);
    let c = h.fabrics_connect(DISCOVERY_NQN, TEST_HOSTNQN, 0, 0xFFFF);
    assert!(c.status().is_success(), "{}", c.status());
    let id = ok_data(h.command(
        &data_cmd(build::identify(2, cns::CONTROLLER, 0), 4096),
        &[],
        &[],
    ));
    let id = IdentifyController::read_from_bytes(&id).unwrap();
    assert_eq!(id.cntrltype, 2, "discovery controller");
    let hdr = ok_data(h.command(
        &data_cmd(build::get_log_page(3, log_id::DISCOVERY, 0, 1024, 0), 1024),
        &[],
        &[],
    ));
    let hdr = DiscoveryLogHeader::read_from_bytes(&hdr).unwrap();
    let n = hdr.numrec.get() as u32;
    let page = ok_data(h.command(
        &data_cmd(
            build::get_log_page(4, log_id::DISCOVERY, 0, 1024 * n, 1024),
            1024 * n,
        ),
        &[],
        &[],
    ));
    page.chunks_exact(1024)
        .map(|c| DiscoveryLogEntry::read_from_bytes(c).unwrap())
        .collect()
}

fn identify_ns(addr: std::net::SocketAddr, nqn: &str) -> IdentifyNamespace {
    let (mut h, _) = RawHost::admin(addr, nqn);
    let d = ok_data(h.command(
        &data_cmd(build::identify(9, cns::NAMESPACE, 1), 4096),
        &[],
        &[],
    ));
    IdentifyNamespace::read_from_bytes(&d).unwrap()
}

#[test]
fn no_arguments_serves_the_embedded_default() {
    let t = TargetProcess::spawn(&[], 4420);
    let entries = discovery_entries(t.addr());
    let nqns: Vec<String> = entries.iter().map(|e| get_trimmed(&e.subnqn)).collect();
    assert!(nqns.contains(&DEFAULT_NQN.to_string()), "{nqns:?}");
    let e = entries
        .iter()
        .find(|e| get_trimmed(&e.subnqn) == DEFAULT_NQN)
        .unwrap();
    assert_eq!(get_trimmed(&e.traddr), "127.0.0.1");
    assert_eq!(get_trimmed(&e.trsvcid), "4420");
    assert_eq!(e.trtype, 3);
    let ns = identify_ns(t.addr(), DEFAULT_NQN);
    assert_eq!(
        ns.nsze.get() * u64::from(ns.block_size()),
        1 << 30,
        "1 GiB namespace"
    );
    let (code, log) = t.terminate();
    assert_eq!(code, Some(0), "{log}");
    assert!(log.contains("shutdown complete"), "{log}");
}

#[test]
fn config_file_check_and_errors() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let dport = free_port();
    let cfg = dir.path().join("t.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"
[target]
reactors = 2
[[listener]]
address = "tcp://127.0.0.1:{port}"
[discovery]
listen = ["tcp://127.0.0.1:{dport}"]
[[subsystem]]
nqn = "nqn.2026-11.io.example:a"
hosts = ["{TEST_HOSTNQN}"]
[[subsystem.namespace]]
backend = "file:{}/a.img,size=16M"
[[subsystem]]
nqn = "nqn.2026-11.io.example:hidden"
hosts = ["nqn.2014-08.org.example:other"]
[[subsystem.namespace]]
backend = "mem:1G"
"#,
            dir.path().display()
        ),
    )
    .unwrap();
    let out = Command::new(bin_path("nvmeof-targetd"))
        .arg("--config")
        .arg(&cfg)
        .arg("--check")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout)
            .contains("configuration OK: 2 subsystem(s), 2 listener(s)")
    );

    let t = TargetProcess::spawn(&["--config", cfg.to_str().unwrap()], port);
    // The dedicated discovery listener shows only what this host may see, on the I/O port.
    let entries = discovery_entries(std::net::SocketAddr::from(([127, 0, 0, 1], dport)));
    let io: Vec<_> = entries.iter().filter(|e| e.subtype == 2).collect();
    assert_eq!(io.len(), 1);
    assert_eq!(get_trimmed(&io[0].subnqn), "nqn.2026-11.io.example:a");
    assert_eq!(get_trimmed(&io[0].trsvcid), port.to_string());
    let ns = identify_ns(t.addr(), "nqn.2026-11.io.example:a");
    assert_eq!(ns.nsze.get(), 16 * 256);
    drop(t);

    // Bad configurations: one clear line, non-zero exit.
    std::fs::write(
        &cfg,
        "[[listener]]\naddress = \"tcp://127.0.0.1:1\"\n[[subsystem]]\nnqn = \"nqn.x\"\n",
    )
    .unwrap();
    let out = Command::new(bin_path("nvmeof-targetd"))
        .arg("--config")
        .arg(&cfg)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("nvmeof-targetd: invalid config: subsystem nqn.x: no host may connect"),
        "{err}"
    );
    let out = Command::new(bin_path("nvmeof-targetd"))
        .args(["--namespace", "file:/nonexistent/dir/x.img"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot open /nonexistent/dir/x.img"));
}

#[test]
fn sigterm_keeps_acknowledged_writes_and_identity_is_stable() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("ns.img");
    let ns = format!("file:{},size=8M", img.display());
    let nqn = "nqn.2026-11.io.example:durable";
    let port = free_port();
    let listen = format!("tcp://127.0.0.1:{port}");
    let args = ["--listen", &listen, "--subsystem", nqn, "--namespace", &ns];
    let t = TargetProcess::spawn(&args, port);
    let before = identify_ns(t.addr(), nqn);
    let (_admin, cntlid) = RawHost::admin(t.addr(), nqn);
    let mut io = RawHost::io_queue(t.addr(), nqn, cntlid, 1);
    let data: Vec<u8> = (0..64 * 1024u32).map(|i| (i * 7 % 253) as u8).collect();
    let mut w = build::read_write(true, 1, 1, 32, 16);
    w.dptr = SglDescriptor::tcp_transport(data.len() as u32);
    match io.command(&w, &[], &data) {
        Reply::Completion(c, _) => assert!(c.status().is_success(), "{}", c.status()),
        other => panic!("{other:?}"),
    }
    let (code, log) = t.terminate();
    assert_eq!(code, Some(0), "{log}");
    let mut on_disk = vec![0u8; data.len()];
    let mut f = std::fs::File::open(&img).unwrap();
    std::io::Seek::seek(&mut f, std::io::SeekFrom::Start(32 * 4096)).unwrap();
    f.read_exact(&mut on_disk).unwrap();
    assert!(
        on_disk == data,
        "acknowledged write not in the file after SIGTERM"
    );

    let t = TargetProcess::spawn(&args, port);
    let after = identify_ns(t.addr(), nqn);
    assert_eq!(before.nguid, after.nguid);
    assert_eq!(before.eui64, after.eui64);
    assert_ne!(before.nguid, [0; 16]);
}

#[test]
fn busy_poll_reactors_serve_sleep_when_idle_and_stop() {
    let nqn = "nqn.2026-11.io.example:poll";
    let t = TargetProcess::quick_with(nqn, &["mem:16M"], &["--reactors", "1", "--poll-us", "2000"]);
    let (_admin, cntlid) = RawHost::admin(t.addr(), nqn);
    let mut io = RawHost::io_queue(t.addr(), nqn, cntlid, 1);
    let data: Vec<u8> = (0..16 * 1024u32).map(|i| (i * 13 % 251) as u8).collect();
    let mut read = build::read_write(false, 2, 1, 8, 4);
    read.dptr = SglDescriptor::tcp_transport(data.len() as u32);
    for round in 0..3u16 {
        let mut w = build::read_write(true, 1, 1, 8, 4);
        w.dptr = SglDescriptor::tcp_transport(data.len() as u32);
        match io.command(&w, &[], &data) {
            Reply::Completion(c, _) => assert!(c.status().is_success(), "{}", c.status()),
            other => panic!("{other:?}"),
        }
        assert!(
            ok_data(io.command(&read, &[], &[])) == data,
            "round {round}"
        );
        // Past the window the reactor sleeps; the next command must wake it.
        std::thread::sleep(Duration::from_millis(50));
    }
    // Idle connections must not keep the reactor spinning: over a second of idleness the
    // whole process uses a small fraction of a CPU (a spinning reactor would use all of it).
    let before = t.cpu_time();
    std::thread::sleep(Duration::from_secs(1));
    let used = t.cpu_time() - before;
    assert!(
        used < Duration::from_millis(500),
        "idle target used {used:?} of CPU in 1 s"
    );
    let (code, log) = t.terminate();
    assert_eq!(code, Some(0), "{log}");
}

/// An I/O queue's read of `blocks` 4 KiB blocks at `lba`.
fn read_sqe(lba: u64, blocks: u32) -> Sqe {
    let mut read = build::read_write(false, 2, 1, lba, blocks);
    read.dptr = SglDescriptor::tcp_transport(blocks * 4096);
    read
}

/// A write of `data` at `lba` through `q`, checked.
fn write_checked(q: &mut RawHost, lba: u64, data: &[u8]) {
    let mut w = build::read_write(true, 1, 1, lba, (data.len() / 4096) as u32);
    w.dptr = SglDescriptor::tcp_transport(data.len() as u32);
    match q.command(&w, &[], data) {
        Reply::Completion(c, _) => assert!(c.status().is_success(), "{}", c.status()),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_connection_alone_on_its_reactor_reads_in_a_loop_and_the_others_are_still_served() {
    // One reactor, its window open between the test's commands: the queue that alone sends
    // dense commands reads its socket in a loop after each answer; the other queue, and
    // commands that arrive in pieces, must be served all the same.
    let nqn = "nqn.2026-11.io.example:spin";
    let t = TargetProcess::quick_with(nqn, &["mem:16M"], &["--reactors", "1", "--poll-us", "1000"]);
    let (_admin, cntlid) = RawHost::admin(t.addr(), nqn);
    let mut a = RawHost::io_queue(t.addr(), nqn, cntlid, 1);
    let mut b = RawHost::io_queue(t.addr(), nqn, cntlid, 2);
    let pattern = |seed: u32| -> Vec<u8> {
        (0..8 * 4096u32)
            .map(|i| (i.wrapping_mul(seed) % 251) as u8)
            .collect()
    };
    write_checked(&mut a, 0, &pattern(7));
    for round in 0..400u32 {
        assert!(
            ok_data(a.command(&read_sqe(0, 8), &[], &[])) == pattern(7),
            "round {round}: queue 1's read"
        );
        if round % 100 == 99 {
            // The other queue writes while the first reads in a loop; the first reads it.
            write_checked(&mut b, 64, &pattern(round));
            assert!(
                ok_data(a.command(&read_sqe(64, 8), &[], &[])) == pattern(round),
                "round {round}: queue 2's write read through queue 1"
            );
        }
    }
    // A command that arrives in two pieces, split at every place of its 72 bytes: the
    // reading loop takes the first piece, and the command once the rest came.
    for split in 1..72 {
        a.conn
            .send_capsule_cmd(&read_sqe(0, 1).to_array(), &[])
            .unwrap();
        let bytes = a.conn.pending_send().to_vec();
        a.conn.consume_sent(bytes.len());
        RawHost::send_raw(&mut a.stream, &bytes[..split]);
        let t0 = std::time::Instant::now();
        while t0.elapsed() < Duration::from_micros(20) {
            std::hint::spin_loop();
        }
        RawHost::send_raw(&mut a.stream, &bytes[split..]);
        assert!(
            ok_data(a.wait(&[])) == pattern(7)[..4096],
            "a read split after {split} bytes"
        );
    }
    let (code, log) = t.terminate();
    assert_eq!(code, Some(0), "{log}");
}

/// The CPU numbers of a `Cpus_allowed_list` line of `/proc/.../status` (`0-3,8`).
fn allowed_cpus(status: &str) -> Vec<usize> {
    let list = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .expect("Cpus_allowed_list")
        .trim();
    let mut cpus = Vec::new();
    for part in list.split(',') {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        cpus.extend(a.parse::<usize>().unwrap()..=b.parse::<usize>().unwrap());
    }
    cpus
}

#[test]
fn reactors_are_pinned_to_the_listed_cpus_in_turn() {
    let mine = allowed_cpus(&std::fs::read_to_string("/proc/self/status").unwrap());
    // Two CPUs where there are two (one where there is one), three reactors: the third
    // wraps around to the first CPU.
    let cpus: Vec<usize> = mine.iter().copied().take(2).collect();
    let list = cpus
        .iter()
        .map(|c| c.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let nqn = "nqn.2026-11.io.example:cpus";
    let t = TargetProcess::quick_with(nqn, &["mem:16M"], &["--reactors", "3", "--cpus", &list]);
    let task = format!("/proc/{}/task", t.pid());
    let reactor_cpus = || {
        let mut reactors: Vec<(u64, Vec<usize>)> = std::fs::read_dir(&task)
            .unwrap()
            .filter_map(|e| {
                let tid = e.ok()?.file_name().into_string().ok()?;
                let comm = std::fs::read_to_string(format!("{task}/{tid}/comm")).ok()?;
                let status = std::fs::read_to_string(format!("{task}/{tid}/status")).ok()?;
                comm.starts_with("nvmeof-reactor")
                    .then(|| (tid.parse().unwrap(), allowed_cpus(&status)))
            })
            .collect();
        reactors.sort();
        reactors.into_iter().map(|(_, c)| c).collect::<Vec<_>>()
    };
    let want: Vec<Vec<usize>> = (0..3).map(|i| vec![cpus[i % cpus.len()]]).collect();
    // Each reactor pins itself as it starts, which may come after the listener is up.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut pinned = reactor_cpus();
    while pinned != want && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        pinned = reactor_cpus();
    }
    assert_eq!(pinned, want, "reactor CPUs in start order");
    // And they serve.
    let (_admin, cntlid) = RawHost::admin(t.addr(), nqn);
    let mut io = RawHost::io_queue(t.addr(), nqn, cntlid, 1);
    let mut read = build::read_write(false, 1, 1, 0, 1);
    read.dptr = SglDescriptor::tcp_transport(4096);
    assert_eq!(ok_data(io.command(&read, &[], &[])).len(), 4096);
    let (code, log) = t.terminate();
    assert_eq!(code, Some(0), "{log}");

    // A CPU this process may not run on fails the start with one line.
    let listen = format!("tcp://127.0.0.1:{}", free_port());
    let out = Command::new(bin_path("nvmeof-targetd"))
        .args([
            "--listen",
            &listen,
            "--namespace",
            "null:1M",
            "--cpus",
            "4095",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("target.cpus: CPU 4095 of \"4095\" is not one this process may run on"),
        "{err}"
    );
}

#[test]
fn keep_alive_timeout_tears_the_controller_down() {
    let t = TargetProcess::quick("nqn.2026-11.io.example:ka", &["mem:8M"]);
    let mut admin = RawHost::connect(t.addr(), false, false);
    let c = admin.fabrics_connect_kato("nqn.2026-11.io.example:ka", TEST_HOSTNQN, 0, 0xFFFF, 1000);
    assert!(c.status().is_success());
    // Activity within KATO keeps it alive.
    for cid in 10..14 {
        std::thread::sleep(Duration::from_millis(400));
        match admin.command(&build::keep_alive(cid), &[], &[]) {
            Reply::Completion(c, _) => assert_eq!(c.status(), Status::SUCCESS),
            other => panic!("{other:?}"),
        }
    }
    // Then silence: the controller is torn down and the connection closed.
    std::thread::sleep(Duration::from_millis(2500));
    admin
        .stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    assert!(RawHost::read_to_close(&mut admin.stream).is_empty());
    let mut t = t;
    let log = t.log();
    assert!(log.contains("keep alive timeout expired"), "{log}");
}

#[test]
fn async_event_requests_are_held() {
    let t = TargetProcess::quick("nqn.2026-11.io.example:aer", &["mem:8M"]);
    let (mut admin, _) = RawHost::admin(t.addr(), "nqn.2026-11.io.example:aer");
    for cid in 40..44 {
        admin.submit(&build::async_event_request(cid), &[]);
    }
    // A fifth exceeds the limit (AERL + 1 = 4); Keep Alive completes; the four stay held.
    match admin.command(&build::async_event_request(44), &[], &[]) {
        Reply::Completion(c, _) => {
            assert_eq!(c.cid(), 44);
            assert_eq!(c.status().sc, 0x05, "AER limit exceeded: {}", c.status());
        }
        other => panic!("{other:?}"),
    }
    match admin.command(&build::keep_alive(45), &[], &[]) {
        Reply::Completion(c, _) => assert_eq!(c.cid(), 45),
        other => panic!("{other:?}"),
    }
}
