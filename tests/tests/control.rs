//! The control socket of a real `nvmeof-targetd`: `nvmeof-targetd ctl`, bad input on the
//! socket, who may use it, SIGHUP reloads, and a saved configuration that restarts to the
//! same state.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use nvmeof_tests::{RawHost, TEST_HOSTNQN, TargetProcess, bin_path, free_port};
use serde_json::Value;

const NQN: &str = "nqn.2026-11.io.nvmeof-direct:ctl";

/// A daemon started from a configuration file, with its control socket in a temporary
/// directory.
struct Daemon {
    target: TargetProcess,
    dir: tempfile::TempDir,
    socket: PathBuf,
    config: PathBuf,
}

fn config_text(port: u16, namespaces: &[&str]) -> String {
    let mut c = format!(
        "[[listener]]\naddress = \"tcp://127.0.0.1:{port}\"\n\n[[subsystem]]\nnqn = \"{NQN}\"\nallow_any_host = true\n"
    );
    for ns in namespaces {
        c.push_str(&format!("\n[[subsystem.namespace]]\nbackend = \"{ns}\"\n"));
    }
    c
}

impl Daemon {
    fn start(namespaces: &[&str], extra: &[&str]) -> Daemon {
        let dir = tempfile::tempdir().unwrap();
        // Let other users reach the socket file itself: its own mode decides.
        std::fs::set_permissions(
            dir.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .unwrap();
        let port = free_port();
        let config = dir.path().join("target.toml");
        let here = dir.path().display().to_string();
        let namespaces: Vec<String> = namespaces.iter().map(|n| n.replace("DIR", &here)).collect();
        let namespaces: Vec<&str> = namespaces.iter().map(String::as_str).collect();
        std::fs::write(&config, config_text(port, &namespaces)).unwrap();
        let socket = dir.path().join("ctl.sock");
        let (c, s) = (config.display().to_string(), socket.display().to_string());
        let mut args = vec!["--config", &c, "--control-socket", &s];
        args.extend(extra);
        let target = TargetProcess::spawn(&args, port);
        Daemon {
            target,
            dir,
            socket,
            config,
        }
    }

    fn ctl_as(&self, setpriv: &[&str], args: &[&str]) -> Output {
        let bin = bin_path("nvmeof-targetd");
        let mut cmd = if setpriv.is_empty() {
            Command::new(&bin)
        } else {
            let mut c = Command::new("setpriv");
            c.args(setpriv).arg(&bin);
            c
        };
        cmd.arg("ctl")
            .arg("--socket")
            .arg(&self.socket)
            .args(args)
            .output()
            .expect("run nvmeof-targetd ctl")
    }

    /// `ctl -o json ARGS`, which must succeed.
    fn ctl_json(&self, args: &[&str]) -> Value {
        let mut a = vec!["-o", "json"];
        a.extend(args);
        let out = self.ctl_as(&[], &a);
        assert!(
            out.status.success(),
            "ctl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("JSON answer")
    }

    fn list(&self) -> Value {
        self.ctl_json(&["list"])["status"].clone()
    }

    /// Sends raw lines on one connection and returns the answers.
    fn raw(&self, lines: &[&str]) -> Vec<Value> {
        let mut s = UnixStream::connect(&self.socket).expect("connect to the control socket");
        let mut r = BufReader::new(s.try_clone().unwrap());
        lines
            .iter()
            .map(|l| {
                // The daemon may answer and close before it has read all of an over-long line.
                let _ = writeln!(s, "{l}");
                let mut answer = String::new();
                r.read_line(&mut answer).unwrap();
                serde_json::from_str(&answer).expect("a JSON answer")
            })
            .collect()
    }
}

fn nsids(status: &Value) -> Vec<u64> {
    status["subsystems"][0]["namespaces"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["nsid"].as_u64().unwrap())
        .collect()
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn one_line(e: &Value) -> &str {
    let s = e["error"].as_str().expect("an error");
    assert!(!s.contains('\n'), "more than one line: {s}");
    s
}

#[test]
fn bad_requests_get_one_clear_error_and_change_nothing() {
    let d = Daemon::start(&["file:DIR/ns1.img,size=1M"], &[]);
    let before = d.list();
    assert_eq!(nsids(&before), vec![1]);
    let ns1 = format!("{}/ns1.img", d.dir.path().display());
    let add = |extra: &str| {
        format!(r#"{{"version":1,"op":"add-namespace","subsystem":"{NQN}",{extra}}}"#)
    };
    let host =
        format!(r#"{{"version":1,"op":"add-host","subsystem":"{NQN}","host":"not an nqn"}}"#);
    let cases: Vec<(String, String)> = [
        ("{\"version\":1,\"op\":", "malformed request"),
        ("[]", "expected a JSON object"),
        (r#"{"op":"list"}"#, "missing \"version\""),
        (
            r#"{"version":9,"op":"list"}"#,
            "unsupported protocol version 9",
        ),
        (
            r#"{"version":1,"op":"list","verbose":true}"#,
            "unknown field `verbose`",
        ),
        (r#"{"version":1,"op":"wipe"}"#, "unknown variant `wipe`"),
        (
            &add(r#""backend":"null:1M","nsid":1"#),
            "already has namespace 1",
        ),
        (
            &add(r#""backend":"null:1M","nsdi":2"#),
            "unknown field `nsdi`",
        ),
        (&add(r#""backend":"tape:1M""#), "unknown backend kind"),
        (
            &add(r#""backend":"file:/nonexistent-dir/x.img""#),
            "cannot open /nonexistent-dir/x.img",
        ),
        (
            &add(&format!(r#""backend":"file:{ns1}""#)),
            "is in use by this process",
        ),
        (
            r#"{"version":1,"op":"remove-namespace","subsystem":"nqn.2026-11.io.x:none","nsid":1}"#,
            "no subsystem nqn.2026-11.io.x:none",
        ),
        (&host, "not an nqn"),
        (
            r#"{"version":1,"op":"save","path":"relative.toml"}"#,
            "give an absolute path",
        ),
    ]
    .iter()
    .map(|(l, w)| (l.to_string(), w.to_string()))
    .collect();
    let lines: Vec<&str> = cases.iter().map(|(l, _)| l.as_str()).collect();
    // All on one connection: an error does not end it.
    let answers = d.raw(&lines);
    for ((line, want), a) in cases.iter().zip(&answers) {
        assert_eq!(a["ok"], false, "{line}: {a}");
        let e = one_line(a);
        assert!(e.contains(want.as_str()), "{line}: {e:?} lacks {want:?}");
    }
    assert_eq!(d.list(), before, "nothing changed");

    // The CLI says it in one line on stderr and exits 1.
    let out = d.ctl_as(
        &[],
        &["remove-namespace", "--subsystem", NQN, "--nsid", "9"],
    );
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("has no namespace 9"), "{err}");

    // A line that is too long is refused and the connection closed.
    let long = format!(
        r#"{{"version":1,"op":"list","x":"{}"}}"#,
        "a".repeat(70_000)
    );
    let a = d.raw(&[&long]);
    assert!(one_line(&a[0]).contains("longer than"), "{}", a[0]);
    assert_eq!(d.list(), before);
}

#[test]
fn only_root_and_the_control_group_may_use_the_socket() {
    let d = Daemon::start(&["null:1M"], &["--control-group", "65534"]);
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(&d.socket).unwrap();
    assert_eq!((meta.mode() & 0o777, meta.gid()), (0o660, 65534));
    let member = ["--reuid=65534", "--regid=65534", "--clear-groups"];
    let stranger = ["--reuid=65534", "--regid=65533", "--clear-groups"];
    let out = d.ctl_as(&member, &["list"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = d.ctl_as(
        &stranger,
        &["add-namespace", "--subsystem", NQN, "--backend", "null:1M"],
    );
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains("Permission denied") && err.contains("only root and the socket's group"),
        "{err}"
    );
    assert_eq!(nsids(&d.list()), vec![1]);
}

#[test]
fn sighup_reloads_and_the_saved_configuration_restarts_the_same() {
    let mut d = Daemon::start(&["null:1M"], &[]);
    let port = d.target.port;
    // A valid file: a second namespace appears.
    std::fs::write(&d.config, config_text(port, &["null:1M", "null:2M"])).unwrap();
    d.target.signal(libc::SIGHUP);
    wait_for("the reload", || nsids(&d.list()) == vec![1, 2]);
    assert!(d.target.log().contains("added namespace 2"));
    // An invalid file: nothing changes and the log says why.
    std::fs::write(
        &d.config,
        config_text(port, &["null:1M", "file:/nonexistent-dir/x.img"]),
    )
    .unwrap();
    d.target.signal(libc::SIGHUP);
    wait_for("the refusal", || {
        d.target.log().contains("reload refused, nothing changed")
    });
    assert!(d.target.log().contains("/nonexistent-dir/x.img"));
    assert_eq!(nsids(&d.list()), vec![1, 2]);
    // Another backend for namespace 2: swapped under the same NSID.
    std::fs::write(&d.config, config_text(port, &["null:1M", "null:3M,bs=512"])).unwrap();
    d.target.signal(libc::SIGHUP);
    wait_for("the swap", || {
        d.list()["subsystems"][0]["namespaces"][1]["backend"]
            .as_str()
            .is_some_and(|b| b.starts_with("null:3M,bs=512"))
    });
    assert!(d.target.log().contains("namespace 2 is now null:3M,bs=512"));
    assert_eq!(nsids(&d.list()), vec![1, 2]);

    // Changes through ctl, saved, survive a restart.
    d.ctl_json(&[
        "resize-namespace",
        "--subsystem",
        NQN,
        "--nsid",
        "2",
        "--size",
        "4M",
    ]);
    d.ctl_json(&["remove-namespace", "--subsystem", NQN, "--nsid", "1"]);
    let added = d.ctl_json(&["add-namespace", "--subsystem", NQN, "--backend", "null:3M"]);
    assert!(
        added["changes"][0]
            .as_str()
            .unwrap()
            .contains("added namespace 3"),
        "{added}"
    );
    let saved = d.dir.path().join("saved.toml");
    d.ctl_json(&["save", saved.to_str().unwrap()]);
    let before = d.list();
    assert_eq!(nsids(&before), vec![2, 3]);
    let (code, log) = d.target.terminate();
    assert_eq!(code, Some(0), "{log}");
    let s = saved.display().to_string();
    let socket = d.socket.display().to_string();
    let t = TargetProcess::spawn(&["--config", &s, "--control-socket", &socket], port);
    let again = Daemon {
        target: t,
        dir: d.dir,
        socket: d.socket,
        config: PathBuf::from(Path::new(&s)),
    };
    assert_eq!(again.list(), before);
    let (code, log) = again.target.terminate();
    assert_eq!(code, Some(0), "{log}");
}

#[test]
fn subsystems_listeners_and_controllers_change_from_the_command_line() {
    let d = Daemon::start(&["null:1M"], &[]);
    let other = "nqn.2026-11.io.nvmeof-direct:ctl-db";
    let port = free_port();
    let listener = format!("tcp://127.0.0.1:{port}");
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    d.ctl_json(&["add-subsystem", "--nqn", other, "--host", TEST_HOSTNQN]);
    d.ctl_json(&[
        "add-namespace",
        "--subsystem",
        other,
        "--backend",
        "mem:1M",
        "--nsid",
        "5",
    ]);
    d.ctl_json(&["add-listener", &listener]);

    // A host connects to the new subsystem on the new listener.
    let (mut h, cntlid) = RawHost::admin(addr, other);
    let status = d.ctl_json(&["status"])["status"].clone();
    let sub = status["subsystems"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["nqn"] == other)
        .expect("the new subsystem")
        .clone();
    assert_eq!(sub["hosts"][0], TEST_HOSTNQN);
    assert_eq!(sub["namespaces"][0]["nsid"], 5);
    let c = &sub["controllers"][0];
    assert_eq!(
        (c["cntlid"].as_u64(), c["host"].as_str()),
        (Some(u64::from(cntlid)), Some(TEST_HOSTNQN))
    );
    assert_eq!(c["io_queues"], 4);
    assert!(
        status["listeners"]
            .as_array()
            .unwrap()
            .iter()
            .any(|l| l == &Value::from(listener.clone()))
    );

    // Disconnect: the target closes the host's connection.
    let out = d.ctl_as(
        &[],
        &[
            "disconnect",
            "--subsystem",
            other,
            "--cntlid",
            &cntlid.to_string(),
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    h.stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    RawHost::read_to_close(&mut h.stream);
    let err = d.ctl_as(
        &[],
        &[
            "disconnect",
            "--subsystem",
            other,
            "--cntlid",
            &cntlid.to_string(),
        ],
    );
    assert!(String::from_utf8_lossy(&err.stderr).contains("has no such controller"));

    // The listener goes: new connections are refused, the first listener still serves.
    d.ctl_json(&["remove-listener", &listener]);
    assert!(
        std::net::TcpStream::connect(addr).is_err(),
        "{listener} still accepts"
    );
    RawHost::admin(d.target.addr(), NQN);
    let gone = d.ctl_json(&["remove-subsystem", "--nqn", other]);
    assert!(
        gone["changes"][0]
            .as_str()
            .unwrap()
            .contains("removed subsystem"),
        "{gone}"
    );
    assert_eq!(d.list()["subsystems"].as_array().unwrap().len(), 1);
}

/// `add-host` with keys: the host must then authenticate (DH-HMAC-CHAP) with that key; the
/// key never reaches the daemon's log or `ctl status`, and a malformed key is refused in one
/// line that does not echo it.
#[test]
fn a_host_added_with_a_dhchap_key_must_authenticate() {
    const AUTH_NQN: &str = "nqn.2026-11.io.nvmeof-direct:ctl-auth";
    const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:6a0f0c4e-0000-4000-8000-00000000c001";
    let mut d = Daemon::start(&["null:1M"], &[]);
    let key = nvme_auth::DhchapKey::new(nvme_auth::Secret::new(vec![0x5a; 32]), None)
        .unwrap()
        .to_dhhc1();
    d.ctl_json(&["add-subsystem", "--nqn", AUTH_NQN, "--host", TEST_HOSTNQN]);
    d.ctl_json(&[
        "add-namespace",
        "--subsystem",
        AUTH_NQN,
        "--backend",
        "mem:1M",
    ]);
    let bad = d.ctl_as(
        &[],
        &[
            "add-host",
            "--subsystem",
            AUTH_NQN,
            "--host",
            HOST,
            "--dhchap-key",
            "DHHC-1:00:AAAAbadkeyZZZZ:",
        ],
    );
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(!bad.status.success());
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains("dhchap_key") && !err.contains("AAAAbadkeyZZZZ"),
        "{err}"
    );
    d.ctl_json(&[
        "add-host",
        "--subsystem",
        AUTH_NQN,
        "--host",
        HOST,
        "--dhchap-key",
        &key,
    ]);
    let status = d.ctl_json(&["status"]).to_string();
    assert!(
        status.contains(HOST) && !status.contains(&key[10..30]),
        "{status}"
    );

    let connect = |secret: Option<&str>| {
        let mut c = Command::new(bin_path("nvmeof"));
        c.args(["probe", "-a", "127.0.0.1", "-s", &d.target.port.to_string()])
            .args(["-n", AUTH_NQN, "-q", HOST])
            .args(["-I", "6a0f0c4e-0000-4000-8000-00000000c0ff"])
            .env("NVMEOF_STATE_DIR", d.dir.path());
        if let Some(s) = secret {
            c.args(["--dhchap-secret", s]);
        }
        c.output().unwrap()
    };
    let out = connect(None);
    assert!(!out.status.success(), "connected without the key");
    let out = connect(Some(&key));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    d.ctl_json(&["remove-host", "--subsystem", AUTH_NQN, "--host", HOST]);
    assert!(
        !connect(Some(&key)).status.success(),
        "a removed host connected"
    );
    let log = d.target.log();
    assert!(!log.contains(&key[10..30]), "the key reached the log");
}

/// Writes `data` (whole 4 KiB blocks, in-capsule) at `slba` of namespace `nsid` of `nqn`, then
/// reads it back on a new connection.
fn write_then_read(addr: std::net::SocketAddr, nqn: &str, nsid: u32, slba: u64, data: &[u8]) {
    use nvme_spec::SglDescriptor;
    use nvme_spec::command::build;
    use nvmeof_tests::Reply;
    let (_admin, cntlid) = RawHost::admin(addr, nqn);
    let mut io = RawHost::io_queue(addr, nqn, cntlid, 1);
    let mut w = build::read_write(true, 1, nsid, slba, (data.len() / 4096) as u32);
    w.dptr = SglDescriptor::in_capsule(data.len() as u32);
    match io.command(&w, data, &[]) {
        Reply::Completion(c, _) => assert!(c.status().is_success(), "write: {}", c.status()),
        other => panic!("write: {other:?}"),
    }
    assert_eq!(read_back(addr, nqn, nsid, slba, data.len()), data);
}

fn read_back(addr: std::net::SocketAddr, nqn: &str, nsid: u32, slba: u64, len: usize) -> Vec<u8> {
    use nvme_spec::SglDescriptor;
    use nvme_spec::command::build;
    use nvmeof_tests::Reply;
    let (_admin, cntlid) = RawHost::admin(addr, nqn);
    let mut io = RawHost::io_queue(addr, nqn, cntlid, 1);
    let mut r = build::read_write(false, 2, nsid, slba, (len / 4096) as u32);
    r.dptr = SglDescriptor::tcp_transport(len as u32);
    match io.command(&r, &[], &[]) {
        Reply::Completion(c, d) if c.status().is_success() => d,
        Reply::DataSuccess(d) => d,
        other => panic!("read: {other:?}"),
    }
}

/// Changes made with `ctl` (subsystems, namespaces added, grown and removed, hosts with keys)
/// are written back to the --config file: SIGHUP then changes nothing, and a stop and a start
/// from that file serve the same subsystems and the same data, with no step by the admin.
#[test]
fn live_changes_survive_a_restart_from_the_config_file() {
    use std::os::unix::fs::PermissionsExt as _;
    const AUTH_NQN: &str = "nqn.2026-11.io.nvmeof-direct:ctl-persist";
    const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:6a0f0c4e-0000-4000-8000-00000000c002";
    let mut d = Daemon::start(&["file:DIR/ns1.img,size=1M"], &[]);
    let original = std::fs::read_to_string(&d.config).unwrap();
    let key = nvme_auth::DhchapKey::new(nvme_auth::Secret::new(vec![0x3c; 32]), None)
        .unwrap()
        .to_dhhc1();
    let ns2 = format!("file:{}/ns2.img,size=1M", d.dir.path().display());
    d.ctl_json(&["add-subsystem", "--nqn", AUTH_NQN, "--host", TEST_HOSTNQN]);
    d.ctl_json(&["add-namespace", "--subsystem", AUTH_NQN, "--backend", &ns2]);
    #[rustfmt::skip]
    d.ctl_json(&["add-host", "--subsystem", AUTH_NQN, "--host", HOST, "--dhchap-key", &key]);
    #[rustfmt::skip]
    d.ctl_json(&["resize-namespace", "--subsystem", NQN, "--nsid", "1", "--size", "2M"]);
    d.ctl_json(&["add-namespace", "--subsystem", NQN, "--backend", "null:1M"]);
    d.ctl_json(&["add-namespace", "--subsystem", NQN, "--backend", "mem:1M"]);
    d.ctl_json(&["remove-namespace", "--subsystem", NQN, "--nsid", "2"]);
    let before = d.list();
    assert_eq!(nsids(&before), vec![1, 3]);
    // Data in the grown part of namespace 1 and in the new subsystem's namespace.
    let grown: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8).collect();
    write_then_read(d.target.addr(), NQN, 1, 300, &grown);
    write_then_read(d.target.addr(), AUTH_NQN, 1, 0, &grown[..4096]);

    // The file was rewritten privately, the admin's version kept.
    let mode = std::fs::metadata(&d.config).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    // The backup is the version before the last change.
    let bak = std::fs::read_to_string(d.dir.path().join("target.toml.bak")).unwrap();
    assert!(bak.contains(AUTH_NQN) && bak != original, "{bak}");
    // SIGHUP reads what runs: nothing to change, nothing refused.
    d.target.signal(libc::SIGHUP);
    wait_for("the reload", || {
        d.target.log().contains("reload: nothing changed")
    });
    assert!(
        !d.target.log().contains("reload refused"),
        "{}",
        d.target.log()
    );

    let port = d.target.port;
    let (code, log) = d.target.terminate();
    assert_eq!(code, Some(0), "{log}");
    let (c, s) = (
        d.config.display().to_string(),
        d.socket.display().to_string(),
    );
    let t = TargetProcess::spawn(&["--config", &c, "--control-socket", &s], port);
    let again = Daemon {
        target: t,
        dir: d.dir,
        socket: d.socket,
        config: d.config,
    };
    assert_eq!(again.list(), before);
    let addr = again.target.addr();
    assert_eq!(read_back(addr, NQN, 1, 300, grown.len()), grown);
    assert_eq!(read_back(addr, AUTH_NQN, 1, 0, 4096), &grown[..4096]);
    let status = again.ctl_json(&["status"]).to_string();
    assert!(
        status.contains(HOST) && !status.contains(&key[10..30]),
        "{status}"
    );
    // The text list names hosts with keys too, with the kind of key and never the key.
    let out = again.ctl_as(&[], &["list"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(&format!("hosts: {TEST_HOSTNQN}, {HOST} (DH-HMAC-CHAP)"))
            && !text.contains(&key[10..30]),
        "{text}"
    );
    let (code, log) = again.target.terminate();
    assert_eq!(code, Some(0), "{log}");
    assert!(!log.contains(&key[10..30]), "the key reached the log");
}

/// `ctl save` writes privately and atomically into the save directory only: a symlink planted
/// at a temporary name is not followed, a world-readable file in place becomes 0600, many
/// saves at once all succeed, and a path elsewhere is refused in one line.
#[test]
fn saves_are_private_atomic_and_stay_in_the_save_directory() {
    use std::os::unix::fs::PermissionsExt as _;
    let d = Daemon::start(&["null:1M"], &[]);
    let saved = d.dir.path().join("saved.toml");
    let victim = d.dir.path().join("victim");
    std::fs::write(&victim, "victim").unwrap();
    std::os::unix::fs::symlink(&victim, d.dir.path().join("saved.tmp")).unwrap();
    std::fs::write(&saved, "old").unwrap();
    std::fs::set_permissions(&saved, std::fs::Permissions::from_mode(0o644)).unwrap();
    d.ctl_json(&["save", saved.to_str().unwrap()]);
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "victim");
    let mode = std::fs::metadata(&saved).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    let text = std::fs::read_to_string(&saved).unwrap();
    assert!(text.contains(NQN), "{text}");

    std::thread::scope(|s| {
        let outs: Vec<_> = (0..8)
            .map(|_| s.spawn(|| d.ctl_as(&[], &["save", saved.to_str().unwrap()])))
            .collect();
        for o in outs {
            let o = o.join().unwrap();
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        }
    });
    assert_eq!(std::fs::read_to_string(&saved).unwrap(), text);

    let elsewhere = tempfile::tempdir().unwrap();
    for bad in [
        elsewhere.path().join("x.toml"),
        d.dir.path().join("../x.toml"),
    ] {
        let out = d.ctl_as(&[], &["save", bad.to_str().unwrap()]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(err.contains("saves go to"), "{err}");
    }
    assert_eq!(std::fs::read_dir(elsewhere.path()).unwrap().count(), 0);
}

/// Keys come from files or standard input (never the command line), and `add-host --replace`
/// changes a host's keys for its next authentications without dropping its connections.
#[test]
fn host_keys_come_from_files_and_change_without_dropping_connections() {
    use std::process::Stdio;
    const AUTH_NQN: &str = "nqn.2026-11.io.nvmeof-direct:ctl-rekey";
    const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:6a0f0c4e-0000-4000-8000-00000000c003";
    let d = Daemon::start(&["null:1M"], &[]);
    let key = |b: u8| {
        nvme_auth::DhchapKey::new(nvme_auth::Secret::new(vec![b; 32]), None)
            .unwrap()
            .to_dhhc1()
    };
    let (old, new) = (key(0x11), key(0x22));
    let file = d.dir.path().join("host.key");
    std::fs::write(&file, format!("{old}\n")).unwrap();
    let file = file.to_str().unwrap();
    d.ctl_json(&["add-subsystem", "--nqn", AUTH_NQN, "--host", TEST_HOSTNQN]);
    d.ctl_json(&[
        "add-namespace",
        "--subsystem",
        AUTH_NQN,
        "--backend",
        "mem:1M",
    ]);
    #[rustfmt::skip]
    d.ctl_json(&["add-host", "--subsystem", AUTH_NQN, "--host", HOST, "--dhchap-key-file", file]);
    let connect = |secret: &str| {
        Command::new(bin_path("nvmeof"))
            .args(["probe", "-a", "127.0.0.1", "-s", &d.target.port.to_string()])
            .args(["-n", AUTH_NQN, "-q", HOST, "--dhchap-secret", secret])
            .args(["-I", "6a0f0c4e-0000-4000-8000-00000000c0fe"])
            .env("NVMEOF_STATE_DIR", d.dir.path())
            .output()
            .unwrap()
            .status
            .success()
    };
    assert!(connect(&old), "the key from the file");

    // A connected host given keys (from standard input) keeps its controller.
    let (_admin, cntlid) = RawHost::admin(d.target.addr(), AUTH_NQN);
    let mut ctl = Command::new(bin_path("nvmeof-targetd"))
        .arg("ctl")
        .arg("--socket")
        .arg(&d.socket)
        .args([
            "add-host",
            "--replace",
            "--subsystem",
            AUTH_NQN,
            "--host",
            TEST_HOSTNQN,
        ])
        .args(["--dhchap-key-file", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    ctl.stdin.take().unwrap().write_all(new.as_bytes()).unwrap();
    let out = ctl.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let status = d.ctl_json(&["status"])["status"].clone();
    let sub = status["subsystems"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["nqn"] == AUTH_NQN)
        .unwrap()
        .clone();
    assert!(
        sub["controllers"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c["cntlid"] == cntlid && c["host"] == TEST_HOSTNQN),
        "{sub}"
    );
    assert_eq!(sub["dhchap_hosts"].as_array().unwrap().len(), 2, "{sub}");

    // New keys for HOST: the old key no longer authenticates, the new one does.
    std::fs::write(d.dir.path().join("host.key"), &new).unwrap();
    #[rustfmt::skip]
    d.ctl_json(&["add-host", "--replace", "--subsystem", AUTH_NQN, "--host", HOST, "--dhchap-key-file", file]);
    assert!(!connect(&old), "the replaced key still authenticates");
    assert!(connect(&new), "the new key");

    // Without --replace, or for a host not allowed, one clear line.
    for (args, why) in [
        (
            vec!["--host", HOST, "--dhchap-key-file", file],
            "--replace changes its keys",
        ),
        (
            vec![
                "--replace",
                "--host",
                "nqn.2014-08.org.nvmexpress:uuid:6a0f0c4e-0000-4000-8000-00000000c0aa",
            ],
            "is not on the allowed list",
        ),
        (
            vec!["--host", HOST, "--dhchap-key-file", "/nonexistent/key"],
            "cannot read a key from /nonexistent/key",
        ),
    ] {
        let mut a = vec!["add-host", "--subsystem", AUTH_NQN];
        a.extend(args);
        let out = d.ctl_as(&[], &a);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(err.contains(why), "{err}");
    }
    let saved = std::fs::read_to_string(&d.config).unwrap();
    assert!(
        saved.contains(&new[10..30]),
        "the new key is kept in the config file"
    );
}

/// A removed file namespace is closed and unlocked while a host's I/O queue that used it sits
/// idle, so the file can be added again at once (and errors name the NSID).
#[test]
fn a_removed_file_namespace_is_released_while_queues_idle() {
    use nvme_spec::SglDescriptor;
    use nvme_spec::command::build;
    use nvmeof_tests::Reply;
    let d = Daemon::start(&["null:1M", "file:DIR/ns2.img,size=1M"], &[]);
    let addr = d.target.addr();
    let (_admin, cntlid) = RawHost::admin(addr, NQN);
    let mut io = RawHost::io_queue(addr, NQN, cntlid, 1);
    let mut read = |cid: u16| {
        let mut r = build::read_write(false, cid, 2, 0, 1);
        r.dptr = SglDescriptor::tcp_transport(4096);
        match io.command(&r, &[], &[]) {
            Reply::Completion(c, _) => c.status().is_success(),
            Reply::DataSuccess(_) => true,
            other => panic!("read: {other:?}"),
        }
    };
    assert!(read(1));
    d.ctl_json(&["remove-namespace", "--subsystem", NQN, "--nsid", "2"]);
    let spec = format!("file:{}/ns2.img", d.dir.path().display());
    let add = [
        "add-namespace",
        "--subsystem",
        NQN,
        "--backend",
        &spec,
        "--nsid",
        "2",
    ];
    let mut last = String::new();
    wait_for("the file to be let go", || {
        let out = d.ctl_as(&[], &add);
        last = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!last.contains("namespace 3"), "{last}");
        out.status.success()
    });
    assert!(read(2), "the namespace added again serves the same queue");
}
