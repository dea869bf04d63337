//! Helpers for the end-to-end tests: find the built binaries, run `nvmeof-targetd` as a real
//! process, speak raw NVMe/TCP to it (through the `nvmf-tcp` host engine or as hand-made bytes),
//! and drive the QEMU guest that runs the Linux kernel's NVMe-oF host and target.
#![forbid(unsafe_code)]

pub mod pki;
pub mod verified_io;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nvme_spec::fabrics::ConnectData;
use nvme_spec::{Cqe, FabricsCommand, IntoBytes, SglDescriptor, Sqe};
use nvmf_tcp::{HostConfig, HostConn, HostEvent};

/// The workspace root.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Path of a binary built by this workspace (next to the test executable's `deps` folder).
/// Panics with a hint if it has not been built.
pub fn bin_path(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let dir = exe
        .parent()
        .and_then(|d| {
            if d.ends_with("deps") {
                d.parent()
            } else {
                Some(d)
            }
        })
        .expect("target dir");
    let p = dir.join(name);
    assert!(
        p.exists(),
        "{} is not built: run `cargo build --workspace --bins` first",
        p.display()
    );
    p
}

/// A TCP port that is free on 127.0.0.1 right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// A running `nvmeof-targetd` process whose log is collected.
pub struct TargetProcess {
    child: Child,
    log: Arc<Mutex<String>>,
    /// The thread that collects its stderr into `log`; it ends when the process closes stderr.
    reader: Option<std::thread::JoinHandle<()>>,
    /// Port of its first listener.
    pub port: u16,
}

impl TargetProcess {
    /// Starts `nvmeof-targetd ARGS` and waits (up to 20 s) for its readiness line.
    pub fn spawn(args: &[&str], port: u16) -> Self {
        Self::try_spawn(args, port)
            .unwrap_or_else(|log| panic!("nvmeof-targetd did not become ready:\n{log}"))
    }

    /// Starts a target on loopback ports that `args(ports)` places, picking `n` free ports
    /// again when one was taken between the pick and the target's bind (by a connection of
    /// a test running alongside). The first port is its first listener's; returns the ports.
    fn spawn_on_free_ports(n: usize, args: impl Fn(&[u16]) -> Vec<String>) -> (Self, Vec<u16>) {
        let mut tries = 0;
        loop {
            let ports: Vec<u16> = (0..n).map(|_| free_port()).collect();
            let a = args(&ports);
            let a: Vec<&str> = a.iter().map(String::as_str).collect();
            match Self::try_spawn(&a, ports[0]) {
                Ok(t) => return (t, ports),
                Err(log) if log.contains("Address already in use") && tries < 5 => tries += 1,
                Err(log) => panic!("nvmeof-targetd did not become ready:\n{log}"),
            }
        }
    }

    /// [`spawn`](Self::spawn), with the log of a target that did not become ready as the error.
    fn try_spawn(args: &[&str], port: u16) -> Result<Self, String> {
        let mut child = Command::new(bin_path("nvmeof-targetd"))
            .args(args)
            .env("NVMEOF_LOG", "debug")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn nvmeof-targetd");
        let log = Arc::new(Mutex::new(String::new()));
        let stderr = child.stderr.take().expect("stderr");
        let (tx, rx) = std::sync::mpsc::channel();
        let l = Arc::clone(&log);
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if line.contains("nvmeof-targetd ready") {
                    let _ = tx.send(());
                }
                let mut g = l.lock().unwrap();
                g.push_str(&line);
                g.push('\n');
            }
        });
        let ready = rx.recv_timeout(Duration::from_secs(20)).is_ok();
        let mut t = TargetProcess {
            child,
            log,
            reader: Some(reader),
            port,
        };
        if ready { Ok(t) } else { Err(t.log()) }
    }

    /// Starts a target on a free port exporting `namespaces` in `nqn` to any host.
    pub fn quick(nqn: &str, namespaces: &[&str]) -> Self {
        Self::quick_with(nqn, namespaces, &["--reactors", "2"])
    }

    /// Like [`quick`](Self::quick), with `extra` flags instead of two reactors.
    pub fn quick_with(nqn: &str, namespaces: &[&str], extra: &[&str]) -> Self {
        let (t, _) = Self::spawn_on_free_ports(1, |ports| {
            let mut args = vec![
                "--listen".to_string(),
                format!("tcp://127.0.0.1:{}", ports[0]),
                "--subsystem".into(),
                nqn.into(),
            ];
            for ns in namespaces {
                args.extend(["--namespace".to_string(), ns.to_string()]);
            }
            args.extend(extra.iter().map(|a| a.to_string()));
            args
        });
        t
    }

    /// Starts `nvmeof-targetd --listen tcp://127.0.0.1:PORT --metrics ADDR ARGS` on two free
    /// loopback ports; returns the target and its metrics endpoint.
    pub fn with_metrics(args: &[&str]) -> (Self, SocketAddr) {
        let (t, ports) = Self::spawn_on_free_ports(2, |ports| {
            let mut all = vec![
                "--listen".to_string(),
                format!("tcp://127.0.0.1:{}", ports[0]),
                "--metrics".into(),
                format!("127.0.0.1:{}", ports[1]),
            ];
            all.extend(args.iter().map(|a| a.to_string()));
            all
        });
        (t, SocketAddr::from(([127, 0, 0, 1], ports[1])))
    }

    /// Starts `nvmeof-targetd --config FILE`, FILE holding `toml` in `dir` with permission
    /// bits `mode`; `port` is its first listener's.
    pub fn with_config(dir: &Path, toml: &str, mode: u32, port: u16) -> Self {
        use std::os::unix::fs::OpenOptionsExt;
        let path = dir.join("target.toml");
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&path)
            .expect("create the config file");
        f.write_all(toml.as_bytes()).expect("write the config file");
        Self::spawn(&["--config", path.to_str().expect("UTF-8 path")], port)
    }

    /// The address of its first listener.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// Everything it logged so far.
    pub fn log(&mut self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// Sends a signal (SIGTERM, SIGKILL...).
    pub fn signal(&self, sig: i32) {
        let _ = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.child.id().to_string())
            .status();
    }

    /// Sends SIGTERM and waits for the exit status (up to 30 s).
    pub fn terminate(mut self) -> (Option<i32>, String) {
        self.signal(libc::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(Some(st)) = self.child.try_wait() {
                self.join_reader();
                return (st.code(), self.log());
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                self.join_reader();
                return (None, self.log());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits for the stderr reader to reach end of file, so the log holds every line the
    /// exited process wrote.
    fn join_reader(&mut self) {
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
    }

    /// Kills the process with SIGKILL (a crash) and reaps it.
    pub fn crash(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Its process ID.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// CPU time (user + system) it has used so far, from /proc.
    pub fn cpu_time(&self) -> Duration {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid())).expect("stat");
        // Fields after the parenthesised command name: state is field 3, utime 14, stime 15.
        let rest = &stat[stat.rfind(')').expect("comm") + 2..];
        let f: Vec<&str> = rest.split_whitespace().collect();
        let ticks: u64 = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
        // /proc reports in USER_HZ, which the kernel's ABI fixes at 100 on Linux.
        Duration::from_millis(ticks * 10)
    }

    /// Its resident memory (VmRSS) in KiB, from /proc.
    pub fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()))
            .expect("/proc/PID/status");
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmRSS")
    }

    /// Number of its open file descriptors, from /proc.
    pub fn open_fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .expect("/proc/PID/fd")
            .count()
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for TargetProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Raises this process's soft limit on open files to at least `n` (and the hard limit with
/// it when needed, which takes root), so that a test can hold `n` sockets. Processes started
/// afterwards (the daemon) inherit it.
pub fn raise_open_files_limit(n: u64) {
    let limits = std::fs::read_to_string("/proc/self/limits").expect("/proc/self/limits");
    let (soft, hard) = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let v = |s: &str| s.parse::<u64>().unwrap_or(u64::MAX);
            (v(f[3]), v(f[4]))
        })
        .expect("Max open files");
    if soft >= n {
        return;
    }
    let hard = hard.max(n);
    let ok = Command::new("prlimit")
        .arg("--pid")
        .arg(std::process::id().to_string())
        .arg(format!("--nofile={n}:{hard}"))
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok,
        "cannot raise the open files limit to {n} (prlimit, util-linux)"
    );
}

/// What a raw host observed.
#[derive(Debug)]
pub enum Reply {
    /// A completion, with the data that came before it.
    Completion(Cqe, Vec<u8>),
    /// C2HData with SUCCESS (no completion follows).
    DataSuccess(Vec<u8>),
    /// The controller sent a C2HTermReq with this FES.
    TermReq(u16),
    /// The connection closed.
    Closed,
}

/// A minimal NVMe/TCP host for tests: one queue, one command at a time.
pub struct RawHost {
    /// The socket.
    pub stream: TcpStream,
    /// The engine.
    pub conn: HostConn,
}

/// Host NQN the tests use.
pub const TEST_HOSTNQN: &str =
    "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-000000000001";

impl RawHost {
    /// Opens a TCP connection without sending anything.
    pub fn tcp(addr: SocketAddr) -> TcpStream {
        let s = TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.set_nodelay(true).unwrap();
        s
    }

    /// Connects and completes ICReq/ICResp.
    pub fn connect(addr: SocketAddr, hdgst: bool, ddgst: bool) -> Self {
        let stream = Self::tcp(addr);
        let conn = HostConn::new(HostConfig {
            hdgst,
            ddgst,
            ..HostConfig::default()
        });
        let mut h = RawHost { stream, conn };
        h.flush();
        loop {
            h.fill();
            if let Some(ev) = h.conn.next_event().expect("ICResp") {
                assert!(matches!(ev, HostEvent::Connected(_)), "{ev:?}");
                break;
            }
        }
        h
    }

    fn flush(&mut self) {
        while !self.conn.pending_send().is_empty() {
            let n = self.stream.write(self.conn.pending_send()).expect("write");
            self.conn.consume_sent(n);
        }
    }

    /// Reads more bytes; returns false on EOF or error.
    fn fill(&mut self) -> bool {
        let buf = self.conn.recv_buf(65536);
        match self.stream.read(buf) {
            Ok(0) | Err(_) => false,
            Ok(n) => {
                self.conn.commit_recv(n);
                true
            }
        }
    }

    /// Sends a command without waiting for it.
    pub fn submit(&mut self, sqe: &Sqe, icd: &[u8]) {
        if let Err(e) = self.conn.send_capsule_cmd(&sqe.to_array(), icd) {
            panic!("cannot send command: {e}");
        }
        self.flush();
    }

    /// Sends a command (with in-capsule data, and `h2c` answering any R2T) and waits for its
    /// outcome.
    pub fn command(&mut self, sqe: &Sqe, icd: &[u8], h2c: &[u8]) -> Reply {
        self.submit(sqe, icd);
        self.wait(h2c)
    }

    /// Waits for the next outcome (answering R2Ts with `h2c`).
    pub fn wait(&mut self, h2c: &[u8]) -> Reply {
        let mut data = Vec::new();
        loop {
            let ev = match self.conn.next_event() {
                Ok(Some(ev)) => ev,
                Ok(None) => {
                    if !self.fill() {
                        return Reply::Closed;
                    }
                    continue;
                }
                Err(e) => panic!("host engine error: {e}"),
            };
            match ev {
                HostEvent::CapsuleResp { cqe } => {
                    return Reply::Completion(Cqe::from_array(&cqe), data);
                }
                HostEvent::C2HData {
                    datao,
                    data: d,
                    success,
                    last,
                    ..
                } => {
                    let end = datao as usize + d.len();
                    if data.len() < end {
                        data.resize(end, 0);
                    }
                    data[datao as usize..end].copy_from_slice(d);
                    if success && last {
                        return Reply::DataSuccess(data);
                    }
                }
                HostEvent::R2T {
                    cccid,
                    ttag,
                    r2to,
                    r2tl,
                } => {
                    let chunk = h2c[r2to as usize..(r2to + r2tl) as usize].to_vec();
                    self.conn
                        .send_h2c_data(cccid, ttag, r2to, &chunk, true)
                        .expect("h2c");
                    self.flush();
                }
                HostEvent::TermReq { fes, .. } => return Reply::TermReq(fes),
                other => panic!("unexpected {other:?}"),
            }
        }
    }

    /// Fabrics Connect with a 30 s keep alive timeout; returns the completion.
    pub fn fabrics_connect(&mut self, subnqn: &str, hostnqn: &str, qid: u16, cntlid: u16) -> Cqe {
        self.fabrics_connect_kato(subnqn, hostnqn, qid, cntlid, 30_000)
    }

    /// Fabrics Connect with the given keep alive timeout; returns the completion.
    pub fn fabrics_connect_kato(
        &mut self,
        subnqn: &str,
        hostnqn: &str,
        qid: u16,
        cntlid: u16,
        kato_ms: u32,
    ) -> Cqe {
        let mut sqe = FabricsCommand::Connect(nvme_spec::command::Connect {
            recfmt: 0,
            qid,
            sqsize: 32,
            cattr: 0,
            kato_ms,
        })
        .encode(1);
        sqe.dptr = SglDescriptor::in_capsule(1024);
        let data = ConnectData::new([7; 16], cntlid, subnqn, hostnqn);
        match self.command(&sqe, data.as_bytes(), &[]) {
            Reply::Completion(c, _) => c,
            other => panic!("Connect: {other:?}"),
        }
    }

    /// Connects an admin queue, enables the controller, and returns the controller ID.
    pub fn admin(addr: SocketAddr, subnqn: &str) -> (Self, u16) {
        let mut h = Self::connect(addr, false, false);
        let c = h.fabrics_connect(subnqn, TEST_HOSTNQN, 0, 0xFFFF);
        assert!(c.status().is_success(), "admin Connect: {}", c.status());
        let cntlid = c.dw0.get() as u16;
        let set = FabricsCommand::PropertySet {
            size8: false,
            offset: nvme_spec::fabrics::property::CC,
            value: u64::from(nvme_spec::fabrics::Cc::enable_value()),
        }
        .encode(2);
        match h.command(&set, &[], &[]) {
            Reply::Completion(c, _) => assert!(c.status().is_success()),
            other => panic!("Property Set: {other:?}"),
        }
        let nq = nvme_spec::command::build::set_features(
            3,
            nvme_spec::features::NUMBER_OF_QUEUES,
            0x0003_0003,
        );
        match h.command(&nq, &[], &[]) {
            Reply::Completion(c, _) => assert!(c.status().is_success()),
            other => panic!("Set Features: {other:?}"),
        }
        (h, cntlid)
    }

    /// Connects I/O queue `qid` of controller `cntlid`.
    pub fn io_queue(addr: SocketAddr, subnqn: &str, cntlid: u16, qid: u16) -> Self {
        let mut h = Self::connect(addr, false, false);
        let c = h.fabrics_connect(subnqn, TEST_HOSTNQN, qid, cntlid);
        assert!(c.status().is_success(), "I/O Connect: {}", c.status());
        h
    }

    /// Sends raw bytes.
    pub fn send_raw(stream: &mut TcpStream, bytes: &[u8]) {
        stream.write_all(bytes).expect("write");
    }

    /// Reads until EOF (or the read timeout) and returns what arrived.
    pub fn read_to_close(stream: &mut TcpStream) -> Vec<u8> {
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match stream.read(&mut buf) {
                Ok(0) | Err(_) => return out,
                Ok(n) => out.extend_from_slice(&buf[..n]),
            }
        }
    }
}

/// Whether the kernel interop tests are enabled (`NVMEOF_INTEROP=1`, set by `.ci/run` after
/// `tests/interop/setup.sh`).
pub fn interop_enabled() -> bool {
    std::env::var("NVMEOF_INTEROP").is_ok_and(|v| v == "1")
}

/// Whether a guest test must do nothing: true, after saying why, unless [`interop_enabled`].
pub fn skip_without_interop() -> bool {
    if interop_enabled() {
        return false;
    }
    eprintln!("skipped: set NVMEOF_INTEROP=1 after running tests/interop/setup.sh");
    true
}

/// `tests/interop/guest.sh`.
pub fn guest_sh() -> PathBuf {
    workspace_root().join("tests/interop/guest.sh")
}

/// The kernels the QEMU guest boots (`guest.sh --kernel`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GuestKernel {
    /// Debian bookworm's Linux 6.1 with bookworm's nvme-cli (the default).
    Linux61,
    /// Debian trixie's Linux 6.12: NVMe in-band authentication (DH-HMAC-CHAP) and NVMe/TCP TLS
    /// on both the host and the target, with nvme-cli 2.13 and tlshd. Prepared by
    /// `tests/interop/setup.sh --with-k612`.
    Linux612,
}

impl GuestKernel {
    /// The value of `guest.sh --kernel`.
    pub fn arg(self) -> &'static str {
        match self {
            GuestKernel::Linux61 => "61",
            GuestKernel::Linux612 => "612",
        }
    }

    /// `guest.sh SUBCOMMAND --kernel K` (`run` or `start`); add the options and the script.
    pub fn guest_sh(self, subcommand: &str) -> Command {
        let mut cmd = Command::new(guest_sh());
        cmd.args([subcommand, "--kernel", self.arg()]);
        cmd
    }
}

/// `tests/interop/guest-scripts/NAME`, a guest script of the harness.
pub fn interop_script(name: &str) -> PathBuf {
    workspace_root()
        .join("tests/interop/guest-scripts")
        .join(name)
}

/// Runs `cmd` (a `guest.sh run` command line) to its end and returns the guest's console;
/// panics with the console and guest.sh's stderr if the guest failed.
pub fn run_guest(cmd: &mut Command) -> String {
    let out = cmd.output().expect("guest.sh");
    let console = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "guest failed ({:?}):\n{console}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    console
}

/// Waits until the guest console log `log` shows `marker`; false if the guest ended first
/// (`GUEST-EXIT`) or `timeout` passed.
pub fn wait_console_marker(log: &Path, marker: &str, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if text.contains(marker) {
            return true;
        }
        if text.contains("GUEST-EXIT") {
            return false;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    false
}

/// Runs `nvmeof-targetd ctl --socket SOCKET ARGS...`; panics with its output unless it
/// succeeded; returns its standard output.
pub fn ctl_ok(socket: &Path, args: &[&str]) -> String {
    let out = Command::new(bin_path("nvmeof-targetd"))
        .arg("ctl")
        .arg("--socket")
        .arg(socket)
        .args(args)
        .output()
        .expect("nvmeof-targetd ctl");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "ctl {args:?} failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// The console log of the boot that came up, from `guest.sh start`'s pid file and its state
/// file's text: guest.sh boots again after a kernel panic during boot, into another log, and
/// names the current one in the state file (`LOG=`); `PIDFILE.log` without one.
fn boot_log(pidfile: &str, state: &str) -> PathBuf {
    state
        .lines()
        .find_map(|l| l.strip_prefix("LOG="))
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(pidfile).with_extension("log"))
}

/// A guest started in the background by `guest.sh start`, stopped (and its script's exit
/// code collected) by [`BackgroundGuest::stop`] or when dropped.
pub struct BackgroundGuest {
    pidfile: Option<String>,
    log: PathBuf,
}

impl BackgroundGuest {
    /// Runs `cmd` (a `guest.sh start` command line); panics with its output if it failed.
    pub fn start(cmd: &mut Command) -> Self {
        let out = cmd.output().expect("guest.sh start");
        assert!(
            out.status.success(),
            "guest.sh start failed ({}):\n{}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let pidfile = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let state = std::fs::read_to_string(format!("{pidfile}.state")).unwrap_or_default();
        BackgroundGuest {
            log: boot_log(&pidfile, &state),
            pidfile: Some(pidfile),
        }
    }

    /// The guest's console so far.
    pub fn console(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits (up to 10 minutes) until the console shows `marker`; false if the guest ended
    /// first.
    pub fn wait_marker(&self, marker: &str) -> bool {
        wait_console_marker(&self.log, marker, Duration::from_secs(600))
    }

    /// Asks the guest script to finish; returns its exit code.
    pub fn stop(&mut self) -> Option<i32> {
        let pidfile = self.pidfile.take()?;
        Command::new(guest_sh())
            .args(["stop", "--grace", "30", &pidfile])
            .status()
            .ok()?
            .code()
    }
}

impl Drop for BackgroundGuest {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Asserts that the guest's `console` holds every one of `needles`.
pub fn assert_console_has(console: &str, needles: &[&str]) {
    for needle in needles {
        assert!(
            console.contains(needle),
            "{needle:?} not in the console:\n{console}"
        );
    }
}

/// A GET over HTTP/1.0 (what a scraper sends); returns the status code and the body.
pub fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut reply = String::new();
    s.read_to_string(&mut reply)?;
    let (head, body) = reply.split_once("\r\n\r\n").unwrap_or((&reply, ""));
    let code = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    Ok((code, body.to_string()))
}

/// The value of the sample `series` (name and labels exactly as the target writes them) in
/// a scrape in the text format.
pub fn scraped(scrape: &str, series: &str) -> Option<f64> {
    scrape
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// Asserts that `promtool check metrics` accepts `scrape` (when promtool is installed).
pub fn promtool_accepts(scrape: &str) {
    let Ok(mut child) = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
    else {
        eprintln!("promtool is not installed: scrape not checked");
        return;
    };
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(scrape.as_bytes())
        .expect("write to promtool");
    let out = child.wait_with_output().expect("promtool");
    assert!(
        out.status.success(),
        "promtool check metrics: {}{}\n{scrape}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_console_is_the_boot_that_came_up() {
        let state = "LOG=/tmp/g/guest-boot2.log\nRUNDIR=/tmp/g/run\nPID=42\n";
        assert_eq!(
            boot_log("/tmp/g/guest.pid", state),
            PathBuf::from("/tmp/g/guest-boot2.log")
        );
        assert_eq!(
            boot_log("/tmp/g/guest.pid", ""),
            PathBuf::from("/tmp/g/guest.log")
        );
    }
}
