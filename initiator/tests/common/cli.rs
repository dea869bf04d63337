//! The `nvmeof` CLI and the `nvmeof-initd` daemon as processes, for the tests that drive them.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use serde_json::Value;

pub fn nvmeof() -> &'static str {
    env!("CARGO_BIN_EXE_nvmeof")
}

pub fn initd() -> &'static str {
    env!("CARGO_BIN_EXE_nvmeof-initd")
}

/// Runs the CLI off the runtime's threads.
pub async fn cli(args: Vec<String>, socket: Option<PathBuf>) -> Output {
    tokio::task::spawn_blocking(move || {
        let mut c = Command::new(nvmeof());
        c.args(&args).env_remove("NVMEOF_INITD_SOCKET");
        if let Some(s) = socket {
            c.env("NVMEOF_INITD_SOCKET", s);
        }
        c.stdin(Stdio::null()).output().expect("run nvmeof")
    })
    .await
    .expect("join")
}

pub fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

pub fn json_of(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "command failed: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}):\n{}", String::from_utf8_lossy(&out.stdout)))
}

/// `nvmeof-initd` started on a socket and state directory of the test's own.
pub struct Daemon {
    child: Child,
    log: PathBuf,
}

impl Daemon {
    /// Starts the daemon, logging to `log`.
    pub fn start(socket: &Path, state: &Path, log: &Path) -> Daemon {
        Self::start_with(socket, state, log, &[])
    }

    /// [`Daemon::start`] with more arguments.
    pub fn start_with(socket: &Path, state: &Path, log: &Path, extra: &[&str]) -> Daemon {
        let logf = std::fs::File::create(log).unwrap();
        let child = Command::new(initd())
            .args(extra)
            .arg("--socket")
            .arg(socket)
            .arg("--state-dir")
            .arg(state)
            .env("NVMEOF_LOG", "debug")
            .env_remove("NVMEOF_INITD_SOCKET")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(logf)
            .spawn()
            .expect("spawn nvmeof-initd");
        Daemon {
            child,
            log: log.to_path_buf(),
        }
    }

    /// What it logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits for its readiness line.
    pub async fn wait_ready(&self) {
        for _ in 0..200 {
            if self.log().contains("nvmeof-initd ready") {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("nvmeof-initd did not start:\n{}", self.log());
    }

    /// SIGTERM, then the exit status.
    pub async fn terminate(mut self) -> Option<i32> {
        let pid = self.child.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        for _ in 0..400 {
            if let Ok(Some(st)) = self.child.try_wait() {
                return st.code();
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let _ = self.child.kill();
        None
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `nvmeof list -o json` through the daemon at `socket`.
pub async fn list(socket: &Path) -> Vec<Value> {
    let out = cli(args(&["list", "-o", "json"]), Some(socket.to_path_buf())).await;
    let v = json_of(&out);
    v["devices"].as_array().expect("devices").clone()
}
