//! Our initiator's multipath over an active/standby pair of real `nvmeof-targetd` processes:
//! two processes export one namespace identity over one shared file (disjoint controller ID
//! ranges), path A optimized and path B non-optimized. Writers with read-back verification
//! run on a [`Multipath`] namespace while `ctl set-ana-state` makes path A inaccessible and
//! optimized again, and while the process behind path A is killed and restarted; every
//! acknowledged write is read back at the end, through the multipath namespace and through a
//! plain controller on path B.

use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nvmeof_initiator::{
    ConnectOptions, Controller, HostIdentity, Multipath, MultipathNamespace, MultipathOptions,
    PathInfo, ReconnectPolicy, TargetAddr, Timeouts,
};
use nvmeof_tests::{TEST_HOSTNQN, TargetProcess, bin_path, free_port};

const NQN: &str = "nqn.2026-11.io.nvmeof-direct:mpath";
const WRITERS: u64 = 4;
const BLOCKS_PER_WRITER: u64 = 32;

/// One target of the pair: its directory (configuration, control socket) and port.
struct Node {
    dir: std::path::PathBuf,
    port: u16,
}

impl Node {
    fn new(root: &Path, name: &str, file: &Path, cntlids: (u16, u16), ana: &str) -> Node {
        let dir = root.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        let port = free_port();
        std::fs::write(
            dir.join("target.toml"),
            format!(
                "[target]\nreactors = 1\ncontrol_socket = \"{}\"\n\n[[listener]]\naddress = \
                 \"tcp://127.0.0.1:{port}\"\n{ana}\n\n[[subsystem]]\nnqn = \"{NQN}\"\n\
                 allow_any_host = true\ncntlid_min = {}\ncntlid_max = {}\n\n\
                 [[subsystem.namespace]]\nbackend = \"file:{},size=8M,shared=on\"\n",
                dir.join("ctl.sock").display(),
                cntlids.0,
                cntlids.1,
                file.display()
            ),
        )
        .unwrap();
        Node { dir, port }
    }

    fn start(&self) -> TargetProcess {
        let cfg = self.dir.join("target.toml");
        TargetProcess::spawn(&["--config", cfg.to_str().unwrap()], self.port)
    }

    fn listener(&self) -> String {
        format!("tcp://127.0.0.1:{}", self.port)
    }

    fn set_ana(&self, state: &str) {
        let out = Command::new(bin_path("nvmeof-targetd"))
            .arg("ctl")
            .arg("--socket")
            .arg(self.dir.join("ctl.sock"))
            .args(["set-ana-state", "--listener", &self.listener()])
            .args(["--state", state])
            .output()
            .expect("run nvmeof-targetd ctl");
        assert!(
            out.status.success(),
            "ctl set-ana-state {state}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

fn options(port: u16) -> ConnectOptions {
    let host = HostIdentity::new(TEST_HOSTNQN, [0x3c; 16]).expect("host identity");
    let mut o = ConnectOptions::new(TargetAddr::new("127.0.0.1", port), NQN, host);
    o.io_queues = Some(2);
    o.timeouts = Timeouts {
        connect: Duration::from_secs(5),
        admin: Duration::from_secs(5),
        io: Duration::from_secs(10),
        shutdown: Duration::from_secs(3),
    };
    o.reconnect = ReconnectPolicy {
        initial_delay: Duration::from_millis(50),
        max_delay: Duration::from_millis(300),
        ctrl_loss_timeout: None,
    };
    o
}

/// The contents of block `lba` written as version `v`.
fn pattern(lba: u64, v: u64, bs: usize) -> Vec<u8> {
    let mut b = vec![0u8; bs];
    for (k, c) in b.chunks_exact_mut(16).enumerate() {
        c[..8].copy_from_slice(&lba.to_le_bytes());
        c[8..].copy_from_slice(&(v ^ k as u64).to_le_bytes());
    }
    b
}

/// What the writers share: how many write-and-verify rounds completed, the version each
/// block last had acknowledged, whether to stop, and the first error.
struct Shared {
    ops: AtomicU64,
    acked: Vec<AtomicU64>,
    stop: AtomicBool,
    error: FirstError,
}

/// The first error a writer met.
#[derive(Default)]
struct FirstError(Mutex<Option<String>>);

impl FirstError {
    fn set(&self, e: String) {
        self.0.lock().unwrap().get_or_insert(e);
    }

    fn get(&self) -> Option<String> {
        self.0.lock().unwrap().clone()
    }
}

/// Writer `w`: writes its blocks in turn, each a new version, and reads each back at once.
async fn writer(ns: MultipathNamespace, w: u64, s: Arc<Shared>) {
    let bs = ns.block_size() as usize;
    let mut v = 1u64;
    let mut back = vec![0u8; bs];
    while !s.stop.load(Ordering::Relaxed) {
        let lba = w * BLOCKS_PER_WRITER + v % BLOCKS_PER_WRITER;
        let data = pattern(lba, v, bs);
        if let Err(e) = ns.write(lba, &data).await {
            s.error.set(format!("write of block {lba} v{v}: {e}"));
            return;
        }
        s.acked[lba as usize].store(v, Ordering::Relaxed);
        if let Err(e) = ns.read(lba, &mut back).await {
            s.error.set(format!("read of block {lba} v{v}: {e}"));
            return;
        }
        if back != data {
            s.error
                .set(format!("block {lba}: read back differs from v{v}"));
            return;
        }
        s.ops.fetch_add(1, Ordering::Relaxed);
        v += 1;
    }
}

/// Waits (bounded) until `f` holds, failing with `what`, the paths and the first error.
async fn wait_until(mp: &Multipath, s: &Shared, what: &str, f: impl Fn(&[PathInfo]) -> bool) {
    for _ in 0..1200 {
        if let Some(e) = s.error.get() {
            panic!("I/O failed while waiting for {what}: {e}");
        }
        if f(&mp.paths()) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{what} did not happen: {:#?}", mp.paths());
}

/// Waits (bounded) until `more` further rounds of I/O completed.
async fn progress(mp: &Multipath, s: &Shared, more: u64, what: &str) {
    let goal = s.ops.load(Ordering::Relaxed) + more;
    wait_until(mp, s, what, |_| s.ops.load(Ordering::Relaxed) >= goal).await;
}

fn ana_of(p: &PathInfo) -> Option<&str> {
    p.ana
        .iter()
        .find(|g| g.group == 1)
        .map(|g| g.state.as_str())
}

#[test]
fn multipath_io_rides_ana_changes_and_a_target_restart() {
    // Under the build directory, not /tmp: the shared file needs a filesystem with O_DIRECT.
    let root = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let file = root.path().join("ns.img");
    let a = Node::new(root.path(), "a", &file, (1, 999), "");
    let b = Node::new(
        root.path(),
        "b",
        &file,
        (1000, 1999),
        "ana = [{ group = 1, state = \"non-optimized\" }]",
    );
    let mut ta = Some(a.start());
    let tb = b.start();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (a_port, b_port) = (a.port, b.port);
    let restart = || a.start();
    let mut restarted = None;
    rt.block_on(async {
        let mp = Multipath::connect(
            options(a_port),
            vec![
                TargetAddr::new("127.0.0.1", a_port),
                TargetAddr::new("127.0.0.1", b_port),
            ],
            MultipathOptions::default(),
        )
        .await
        .expect("multipath connect");
        let paths = mp.paths();
        assert_eq!(paths.len(), 2);
        assert_eq!(ana_of(&paths[0]), Some("optimized"), "{paths:#?}");
        assert_eq!(ana_of(&paths[1]), Some("non-optimized"), "{paths:#?}");
        assert!(paths[0].current && !paths[1].current, "{paths:#?}");
        assert!(paths.iter().all(|p| p.ana_reporting), "{paths:#?}");
        let (ca, cb) = (paths[0].cntlid.unwrap(), paths[1].cntlid.unwrap());
        assert!(ca < 1000 && (1000..2000).contains(&cb), "{ca} {cb}");

        let ns = mp.namespace(1).await.expect("namespace");
        assert_eq!(ns.ana_group(), 1);
        let total = (WRITERS * BLOCKS_PER_WRITER) as usize;
        assert!(ns.num_blocks() >= total as u64);
        let s = Arc::new(Shared {
            ops: AtomicU64::new(0),
            acked: (0..total).map(|_| AtomicU64::new(0)).collect(),
            stop: AtomicBool::new(false),
            error: Default::default(),
        });
        let tasks: Vec<_> = (0..WRITERS)
            .map(|w| tokio::spawn(writer(ns.clone(), w, Arc::clone(&s))))
            .collect();
        progress(&mp, &s, 200, "I/O on path A").await;

        // Path A inaccessible: I/O moves to path B.
        a.set_ana("inaccessible");
        wait_until(&mp, &s, "path A inaccessible, path B current", |p| {
            ana_of(&p[0]) == Some("inaccessible") && p[1].current
        })
        .await;
        progress(&mp, &s, 200, "I/O on path B while A is inaccessible").await;

        // Path A optimized again: fail-back.
        a.set_ana("optimized");
        wait_until(&mp, &s, "path A optimized and current again", |p| {
            ana_of(&p[0]) == Some("optimized") && p[0].current
        })
        .await;
        progress(&mp, &s, 200, "I/O on path A again").await;

        // The process behind path A killed: I/O goes on through B.
        ta.take().expect("A runs").crash();
        wait_until(&mp, &s, "path A lost", |p| {
            !matches!(
                p[0].state,
                Some(nvmeof_initiator::ControllerState::Connected)
            ) && p[1].current
        })
        .await;
        progress(&mp, &s, 200, "I/O on path B while A is down").await;

        // Restarted: path A reconnects, reads its ANA log again, and takes the I/O back.
        restarted = Some(restart());
        wait_until(&mp, &s, "path A reconnected, optimized and current", |p| {
            p[0].state == Some(nvmeof_initiator::ControllerState::Connected)
                && ana_of(&p[0]) == Some("optimized")
                && p[0].current
        })
        .await;
        progress(&mp, &s, 200, "I/O on path A after the restart").await;

        s.stop.store(true, Ordering::Relaxed);
        for t in tasks {
            t.await.expect("writer task");
        }
        if let Some(e) = s.error.get() {
            panic!("I/O failed: {e}");
        }

        // Every acknowledged write is there, through the head and through path B alone.
        let bs = ns.block_size() as usize;
        let single = Controller::connect(options(b_port))
            .await
            .expect("connect to B");
        let nsb = single.namespace(1).await.expect("namespace on B");
        let mut buf = vec![0u8; bs];
        for lba in 0..total as u64 {
            let v = s.acked[lba as usize].load(Ordering::Relaxed);
            assert!(v > 0, "block {lba} was never written");
            let want = pattern(lba, v, bs);
            ns.read(lba, &mut buf).await.expect("final read");
            assert!(buf == want, "block {lba}: not v{v} through multipath");
            nsb.read(lba, &mut buf).await.expect("final read on B");
            assert!(buf == want, "block {lba}: not v{v} on path B");
        }
        single.disconnect().await.expect("disconnect B");
        drop(ns);
        mp.disconnect().await.expect("multipath disconnect");
    });
    let (code, log_a) = restarted.expect("A restarted").terminate();
    assert_eq!(code, Some(0), "{log_a}");
    let (code, log_b) = tb.terminate();
    assert_eq!(code, Some(0), "{log_b}");
}

/// `nvmeof list-paths -o json` over the pair.
fn list_paths(state_dir: &Path, args: &[&str]) -> serde_json::Value {
    let out = Command::new(bin_path("nvmeof"))
        .args([
            "-o",
            "json",
            "list-paths",
            "-n",
            NQN,
            "--hostnqn",
            TEST_HOSTNQN,
        ])
        .args(args)
        .arg("--state-dir")
        .arg(state_dir)
        .output()
        .expect("run nvmeof");
    assert!(
        out.status.success(),
        "nvmeof list-paths {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON")
}

/// The ANA state of group 1 and whether it is current, per path of a `list-paths` answer.
fn states(v: &serde_json::Value) -> Vec<(String, bool)> {
    v["paths"]
        .as_array()
        .expect("paths")
        .iter()
        .map(|p| {
            let st = p["ana"]
                .as_array()
                .and_then(|g| g.iter().find(|g| g["group"] == 1))
                .map_or("?", |g| g["state"].as_str().unwrap());
            (st.to_string(), p["current"].as_bool().unwrap())
        })
        .collect()
}

#[test]
fn list_paths_shows_each_path_and_its_ana_state() {
    let root = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let file = root.path().join("ns.img");
    let a = Node::new(root.path(), "a", &file, (1, 999), "");
    let b = Node::new(
        root.path(),
        "b",
        &file,
        (1000, 1999),
        "ana = [{ group = 1, state = \"non-optimized\" }]",
    );
    let (ta, tb) = (a.start(), b.start());
    let (pa, pb) = (a.port.to_string(), b.port.to_string());
    let path_b = format!("127.0.0.1:{}", b.port);
    let args = ["-a", "127.0.0.1", "-s", &pa, "--path", &path_b];
    let v = list_paths(root.path(), &args);
    assert_eq!(v["ana_group"], 1, "{v}");
    assert_eq!(v["paths"][0]["addr"], format!("127.0.0.1:{pa}"), "{v}");
    assert_eq!(v["paths"][1]["state"]["state"], "connected", "{v}");
    assert_eq!(
        states(&v),
        [("optimized".into(), true), ("non-optimized".into(), false)],
        "{v}"
    );
    a.set_ana("inaccessible");
    let v = list_paths(root.path(), &args);
    assert_eq!(
        states(&v),
        [
            ("inaccessible".into(), false),
            ("non-optimized".into(), true)
        ],
        "{v}"
    );
    // The discovery log of B's process lists B's listener only.
    let v = list_paths(root.path(), &["--discover", "-a", "127.0.0.1", "-s", &pb]);
    assert_eq!(states(&v), [("non-optimized".into(), true)], "{v}");
    for t in [ta, tb] {
        let (code, log) = t.terminate();
        assert_eq!(code, Some(0), "{log}");
    }
}

/// `nvmeof --socket SOCKET ARGS`: its standard output (the command must succeed).
fn cli(socket: &Path, args: &[&str]) -> String {
    let out = Command::new(bin_path("nvmeof"))
        .arg("--socket")
        .arg(socket)
        .args(args)
        .output()
        .expect("run nvmeof");
    assert!(
        out.status.success(),
        "nvmeof {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A multipath attachment of `nvmeof-initd`: `list` shows its paths and follows an ANA
/// change notice (no I/O passes through the daemon), and a process opens it over every path.
#[test]
fn initd_multipath_attachment_shows_paths_and_follows_ana_changes() {
    let root = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let file = root.path().join("ns.img");
    let a = Node::new(root.path(), "a", &file, (1, 999), "");
    let b = Node::new(
        root.path(),
        "b",
        &file,
        (1000, 1999),
        "ana = [{ group = 1, state = \"non-optimized\" }]",
    );
    let (ta, tb) = (a.start(), b.start());
    let socket = root.path().join("initd.sock");
    let log_path = root.path().join("initd.log");
    let mut initd = Command::new(bin_path("nvmeof-initd"))
        .arg("--socket")
        .arg(&socket)
        .arg("--state-dir")
        .arg(root.path().join("state"))
        .env_remove("NVMEOF_INITD_SOCKET")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log_path).unwrap())
        .spawn()
        .expect("spawn nvmeof-initd");
    let log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    for _ in 0..400 {
        if log().contains("nvmeof-initd ready") {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(log().contains("nvmeof-initd ready"), "{}", log());
    let pa = a.port.to_string();
    let path_b = format!("127.0.0.1:{}", b.port);
    // A path given twice, or not a port, is a usage error (exit status 2) in one line.
    for bad in [format!("127.0.0.1:{pa}"), "127.0.0.1:http".to_string()] {
        let out = Command::new(bin_path("nvmeof"))
            .arg("--socket")
            .arg(&socket)
            .args(["attach", "bad", "-a", "127.0.0.1", "-s", &pa, "-n", NQN])
            .args(["--path", &bad])
            .output()
            .expect("run nvmeof");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
    }
    let out = cli(
        &socket,
        &[
            "attach",
            "mp0",
            "-a",
            "127.0.0.1",
            "-s",
            &pa,
            "--path",
            &path_b,
            "-n",
            NQN,
        ],
    );
    assert!(out.contains("mp0"), "{out}");
    let list = || -> serde_json::Value {
        serde_json::from_str(&cli(&socket, &["-o", "json", "list"])).expect("JSON")
    };
    let v = list();
    let dev = &v["devices"][0];
    assert_eq!(dev["state"], "connected", "{v}");
    assert_eq!(
        states(dev),
        [("optimized".into(), true), ("non-optimized".into(), false)],
        "{v}"
    );
    let text = cli(&socket, &["list"]);
    assert!(
        text.contains(&format!(
            "path * 127.0.0.1:{pa} cntlid 1 live, group 1 optimized"
        )),
        "{text}"
    );

    // The daemon's paths carry no I/O: only the change notice tells it.
    a.set_ana("inaccessible");
    let mut seen = list();
    for _ in 0..400 {
        if states(&seen["devices"][0])
            == [
                ("inaccessible".into(), false),
                ("non-optimized".into(), true),
            ]
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
        seen = list();
    }
    assert_eq!(
        states(&seen["devices"][0]),
        [
            ("inaccessible".into(), false),
            ("non-optimized".into(), true)
        ],
        "{seen}\n{}",
        log()
    );

    // A process opens the attachment over both paths and does its I/O through B.
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let ns = nvmeof_initiator::daemon::open_attached_multipath(&socket, "mp0")
            .await
            .expect("open the multipath attachment");
        let bs = ns.block_size() as usize;
        let data = pattern(7, 99, bs);
        ns.write(7, &data).await.expect("write");
        let mut back = vec![0u8; bs];
        ns.read(7, &mut back).await.expect("read");
        assert!(back == data);
        let paths = ns.multipath().paths();
        assert!(paths[1].current, "{paths:#?}");
        ns.multipath().disconnect().await.expect("disconnect");
    });
    cli(&socket, &["detach", "mp0"]);
    let _ = Command::new("kill")
        .args(["-TERM", &initd.id().to_string()])
        .status();
    let status = initd.wait().unwrap();
    assert_eq!(status.code(), Some(0), "{}", log());
    for t in [ta, tb] {
        let (code, log) = t.terminate();
        assert_eq!(code, Some(0), "{log}");
    }
}
