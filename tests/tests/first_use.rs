//! Both daemons as a new user meets them: signals that must not stop them, errors that say
//! their cause once, configuration mistakes told for what they are, namespace files claimed
//! exclusively, `--check` that changes nothing, and dedicated discovery listeners.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use nvme_spec::status::specific;
use nvme_spec::{Cqe, Status};
use nvmeof_tests::{RawHost, TEST_HOSTNQN, TargetProcess, bin_path, free_port};

const NQN: &str = "nqn.2026-11.io.nvmeof-direct:first-use";
const DISCOVERY_NQN: &str = "nqn.2014-08.org.nvmexpress.discovery";
const RELOAD_LINE: &str = "SIGHUP: started without --config; nothing to reload";

fn targetd(args: &[&str]) -> Output {
    Command::new(bin_path("nvmeof-targetd"))
        .args(args)
        .env_remove("NVMEOF_LOG")
        .output()
        .expect("run nvmeof-targetd")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Runs `nvmeof-targetd ARGS`, expects failure, and returns its stderr.
fn refused(args: &[&str]) -> String {
    let out = targetd(args);
    assert!(
        !out.status.success(),
        "{args:?} succeeded: {}",
        stderr(&out)
    );
    stderr(&out)
}

fn send_signal(pid: u32, sig: &str) {
    let st = Command::new("kill")
        .args([format!("-{sig}"), pid.to_string()])
        .status()
        .unwrap();
    assert!(st.success());
}

/// Waits up to 10 s for `cond` on the log.
fn wait_for(mut log: impl FnMut() -> String, what: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let l = log();
        if l.contains(what) {
            return l;
        }
        assert!(Instant::now() < deadline, "no {what:?} in the log:\n{l}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn connect_status(port: u16, subnqn: &str) -> Cqe {
    let mut h = RawHost::connect(
        std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        false,
        false,
    );
    h.fabrics_connect(subnqn, TEST_HOSTNQN, 0, 0xFFFF)
}

#[test]
fn targetd_without_a_config_file_logs_sighup_and_keeps_serving() {
    let mut t = TargetProcess::quick(NQN, &["mem:16M"]);
    send_signal(t.pid(), "HUP");
    wait_for(|| t.log(), RELOAD_LINE);
    std::thread::sleep(Duration::from_millis(200));
    assert!(t.is_running(), "SIGHUP stopped the daemon:\n{}", t.log());
    assert!(connect_status(t.port, NQN).status().is_success());
    // A second one too, and SIGTERM still stops it cleanly.
    send_signal(t.pid(), "HUP");
    std::thread::sleep(Duration::from_millis(200));
    assert!(t.is_running());
    let (code, log) = t.terminate();
    assert_eq!(code, Some(0), "{log}");
    assert_eq!(log.matches(RELOAD_LINE).count(), 2, "{log}");
    assert!(log.contains("shutdown complete"), "{log}");
}

/// `nvmeof-initd` on a socket and state directory of the test's own, its log collected line
/// by line until it closes stderr.
fn start_initd(dir: &Path, log_level: &str) -> (Child, LogReader) {
    let mut child = Command::new(bin_path("nvmeof-initd"))
        .arg("--socket")
        .arg(dir.join("initd.sock"))
        .arg("--state-dir")
        .arg(dir.join("state"))
        .env("NVMEOF_LOG", log_level)
        .env_remove("NVMEOF_INITD_SOCKET")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn nvmeof-initd");
    let (tx, rx) = mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    (child, LogReader { rx, reader })
}

/// The lines a child wrote to stderr, and the thread that forwards them.
struct LogReader {
    rx: mpsc::Receiver<String>,
    reader: std::thread::JoinHandle<()>,
}

impl LogReader {
    /// Every line after the child has exited: joins the reader (which ends at end of file)
    /// before reading what it forwarded, so no last line is missed.
    fn finish(self) -> Vec<String> {
        self.reader.join().expect("log reader");
        self.rx.try_iter().collect()
    }
}

#[test]
fn initd_logs_and_ignores_sighup() {
    let dir = tempfile::tempdir().unwrap();
    let (mut child, log_reader) = start_initd(dir.path(), "info");
    let mut log = String::new();
    let mut collect = || {
        while let Ok(l) = log_reader.rx.try_recv() {
            log.push_str(&l);
            log.push('\n');
        }
        log.clone()
    };
    wait_for(&mut collect, "nvmeof-initd ready");
    send_signal(child.id(), "HUP");
    wait_for(&mut collect, "SIGHUP");
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        child.try_wait().unwrap().is_none(),
        "SIGHUP stopped nvmeof-initd:\n{}",
        collect()
    );
    std::os::unix::net::UnixStream::connect(dir.path().join("initd.sock"))
        .expect("the socket still answers");
    send_signal(child.id(), "TERM");
    let status = child.wait().unwrap();
    let mut log = collect();
    for l in log_reader.finish() {
        log.push_str(&l);
        log.push('\n');
    }
    assert_eq!(status.code(), Some(0), "{log}");
    assert!(log.contains("stopped"), "{log}");
}

#[test]
fn unknown_log_levels_are_refused_by_both_daemons() {
    let out = Command::new(bin_path("nvmeof-targetd"))
        .env("NVMEOF_LOG", "verbose")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = stderr(&out);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains(
            "unknown log level \"verbose\"; use one of off, error, warn, info, debug, trace"
        ),
        "{err}"
    );
    let dir = tempfile::tempdir().unwrap();
    let (mut child, log_reader) = start_initd(dir.path(), "loud");
    let status = child.wait().unwrap();
    assert!(!status.success());
    let err = log_reader.finish();
    assert_eq!(err.len(), 1, "{err:?}");
    assert!(err[0].contains("unknown log level \"loud\""), "{err:?}");
}

#[test]
fn errors_say_their_cause_once() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("t.toml");
    std::fs::write(&cfg, "[target]\nreactor = 2\n").unwrap();
    let err = refused(&["--config", cfg.to_str().unwrap()]);
    assert_eq!(err.matches("unknown field `reactor`").count(), 1, "{err}");
    assert_eq!(err.matches("reactor = 2").count(), 1, "one snippet: {err}");
    assert!(err.len() < 512, "{err}");

    let err = refused(&["--namespace", "file:/nonexistent/dir/x.img"]);
    let errors: Vec<&str> = err.lines().filter(|l| !l.contains(" WARN ")).collect();
    assert_eq!(errors.len(), 1, "{err}");
    assert_eq!(err.matches("No such file or directory").count(), 1, "{err}");
    assert!(
        errors[0].starts_with("nvmeof-targetd: subsystem nqn.2026-11.io.nvmeof-direct:default namespace 1: cannot open /nonexistent/dir/x.img"),
        "{err}"
    );
}

#[test]
fn configuration_mistakes_are_named() {
    for (args, needle) in [
        (
            vec!["-n", "nqn.2026-11.io.example:a b", "--namespace", "mem:1M"],
            "an NQN cannot contain ' '",
        ),
        (
            vec!["--listen", "tcp://localhost:4420"],
            "\"localhost\" is not an IP address",
        ),
        (
            vec!["--listen", "tcp://127.0.0.1:99999"],
            "port 99999 is out of range",
        ),
        (vec!["--listen", "tcp://127.0.0.1"], "the port is missing"),
    ] {
        let mut a = args.clone();
        a.push("--check");
        let err = refused(&a);
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(!err.contains("IPv6 needs"), "{err}");
        assert!(!err.contains("must start with"), "{err}");
    }
}

#[test]
fn namespace_files_are_sized_and_claimed_and_check_creates_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("a.img");
    let img_s = img.to_str().unwrap().to_string();
    let listen = format!("tcp://127.0.0.1:{}", free_port());

    // --check creates nothing and says what starting would create.
    let spec = format!("file:{img_s},size=4M");
    let out = targetd(&["--listen", &listen, "--namespace", &spec, "--check"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains(&format!("would create {img_s} (4M)")),
        "{stdout}"
    );
    assert!(!img.exists(), "--check created {img_s}");
    let missing_dir = format!("file:{}/no/such/dir/x.img,size=4M", dir.path().display());
    let err = refused(&["--listen", &listen, "--namespace", &missing_dir, "--check"]);
    assert!(err.contains("/no/such/dir does not exist"), "{err}");
    let not_dir = format!("file:{img_s}/x.img,size=4M");
    std::fs::write(&img, "").unwrap();
    let err = refused(&["--listen", &listen, "--namespace", &not_dir, "--check"]);
    assert!(
        err.contains(&format!("{img_s} is not a directory")),
        "{err}"
    );
    std::fs::remove_file(&img).unwrap();

    // One new file named twice, through `..` or a symlink: --check says so, as starting would.
    std::fs::create_dir(dir.path().join("sub")).unwrap();
    std::os::unix::fs::symlink(&img, dir.path().join("link.img")).unwrap();
    for other in ["sub/../a.img", "link.img"] {
        let twice = format!("file:{}/{other},size=4M", dir.path().display());
        let err = refused(&[
            "--listen",
            &listen,
            "--namespace",
            &spec,
            "--namespace",
            &twice,
            "--check",
        ]);
        assert!(err.contains("already backs"), "{other}: {err}");
        assert!(!img.exists());
    }

    // An existing file whose size disagrees with size=.
    std::fs::File::create(&img)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let err = refused(&["--listen", &listen, "--namespace", &spec, "--check"]);
    assert!(
        err.contains("is 1M (1048576 bytes) but size=4M was given"),
        "{err}"
    );
    assert_eq!(std::fs::metadata(&img).unwrap().len(), 1 << 20);

    // The same file twice in one configuration, under two names.
    let same = format!("file:{}/./a.img", dir.path().display());
    let err = refused(&[
        "--listen",
        &listen,
        "--namespace",
        &format!("file:{img_s}"),
        "--namespace",
        &same,
    ]);
    assert!(
        err.contains(&format!(
            "namespace 2: {}/./a.img already backs subsystem nqn.2026-11.io.nvmeof-direct:default namespace 1",
            dir.path().display()
        )),
        "{err}"
    );

    // And by a second daemon while the first serves it.
    let t = TargetProcess::quick(NQN, &[&format!("file:{img_s}")]);
    let err = refused(&["--listen", &listen, "--namespace", &same, "--check"]);
    assert!(
        err.contains(&format!(
            "is in use by process {} (nvmeof-targetd)",
            t.pid()
        )),
        "{err}"
    );
    let (code, log) = t.terminate();
    assert_eq!(code, Some(0), "{log}");
}

#[test]
fn a_discovery_listener_serves_only_discovery() {
    let dir = tempfile::tempdir().unwrap();
    let (port, dport) = (free_port(), free_port());
    let cfg = dir.path().join("t.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[listener]]\naddress = \"tcp://127.0.0.1:{port}\"\n\
             [discovery]\nlisten = [\"tcp://127.0.0.1:{dport}\"]\n\
             [[subsystem]]\nnqn = \"{NQN}\"\nallow_any_host = true\n\
             [[subsystem.namespace]]\nbackend = \"mem:16M\"\n"
        ),
    )
    .unwrap();
    let mut t = TargetProcess::spawn(&["--config", cfg.to_str().unwrap()], port);
    let c = connect_status(dport, NQN);
    assert_eq!(
        c.status(),
        Status::specific(specific::CONNECT_INVALID_PARAMETERS).with_dnr()
    );
    assert_eq!(c.dw0.get(), 1 | (256 << 16), "IATTR data, IPO subnqn");
    wait_for(
        || t.log(),
        "connect rejected: this listener serves discovery only",
    );
    assert!(connect_status(dport, DISCOVERY_NQN).status().is_success());
    assert!(connect_status(port, NQN).status().is_success());
    assert!(connect_status(port, DISCOVERY_NQN).status().is_success());
}

/// `--check` fails where starting would: the metrics port taken, the control socket held by
/// a running daemon, a discovery listener on an I/O listener's address; it warns about a
/// configuration with no subsystem.
#[test]
fn check_fails_where_starting_would() {
    let dir = tempfile::tempdir().unwrap();
    let listen = format!("tcp://127.0.0.1:{}", free_port());
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let metrics = taken.local_addr().unwrap().to_string();
    let err = refused(&["--listen", &listen, "--metrics", &metrics, "--check"]);
    assert!(
        err.contains(&format!("cannot bind the metrics endpoint {metrics}")),
        "{err}"
    );

    let socket = dir.path().join("ctl.sock");
    let s = socket.to_str().unwrap();
    let running = TargetProcess::spawn(
        &[
            "--listen",
            &format!("tcp://127.0.0.1:{}", free_port()),
            "--control-socket",
            s,
        ],
        0,
    );
    let err = refused(&["--listen", &listen, "--control-socket", s, "--check"]);
    assert!(
        err.contains("another nvmeof-targetd is running and holds it"),
        "{err}"
    );
    let (code, log) = running.terminate();
    assert_eq!(code, Some(0), "{log}");

    let port = free_port();
    let cfg = dir.path().join("t.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[listener]]\naddress = \"tcp://127.0.0.1:{port}\"\n\
             [discovery]\nlisten = [\"tcp://127.0.0.1:{port}\"]\n"
        ),
    )
    .unwrap();
    let err = refused(&["--config", cfg.to_str().unwrap(), "--check"]);
    assert!(err.contains("is the same address as listener"), "{err}");
    std::fs::write(
        &cfg,
        format!("[[listener]]\naddress = \"tcp://127.0.0.1:{port}\"\n"),
    )
    .unwrap();
    let out = targetd(&["--config", cfg.to_str().unwrap(), "--check"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("no subsystem configured: hosts can only discover"),
        "{}",
        stderr(&out)
    );

    // Hosts listed where any host may connect: said, not silently ignored.
    std::fs::write(
        &cfg,
        format!(
            "[[listener]]\naddress = \"tcp://127.0.0.1:{port}\"\n\
             [[subsystem]]\nnqn = \"{NQN}\"\nallow_any_host = true\nhosts = [\"{TEST_HOSTNQN}\"]\n"
        ),
    )
    .unwrap();
    let out = targetd(&["--config", cfg.to_str().unwrap(), "--check"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("the hosts list has no effect"),
        "{}",
        stderr(&out)
    );
}
