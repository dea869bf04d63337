//! The targets the fabric modes talk to: ours started in this process, ours started as a
//! separate process, or any NVMe/TCP target at an address.
//!
//! The target's CPU time is read from its reactor threads (in-process) or from every thread
//! of its process; a target at an address has a CPU figure only when its process ID is given
//! (`--target-pid`, for a user-space target such as SPDK's on this machine).

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use blockdev::BackendSpec;
use nvmeof_target::{Config, RunningTarget, Target};

use crate::cpu::{self, CpuSnapshot};
use crate::job::TcpTarget;

/// Errors starting or reaching a target.
#[derive(Debug, thiserror::Error)]
pub enum FabricError {
    /// The in-process target did not start.
    #[error("in-process target: {0}")]
    InProcess(String),
    /// The target process did not start or did not listen in time.
    #[error("target process {bin}: {msg}")]
    Process {
        /// The binary.
        bin: PathBuf,
        /// What went wrong.
        msg: String,
    },
    /// Pinning the target failed.
    #[error(transparent)]
    Cpu(#[from] cpu::CpuError),
    /// The transport is not available.
    #[error("{0}")]
    Unavailable(String),
}

/// What the target needs to serve.
#[derive(Debug, Clone)]
pub struct TargetSpec {
    /// Subsystem NQN.
    pub nqn: String,
    /// Backend of each namespace.
    pub backend: BackendSpec,
    /// Number of namespaces.
    pub namespaces: u32,
    /// Reactor threads (0: one per core).
    pub reactors: usize,
    /// Busy-poll window of the reactors in microseconds (0: event-driven).
    pub poll_us: u32,
    /// Entries per queue the target allows.
    pub max_queue_depth: u16,
    /// CPUs to pin the target to.
    pub cpus: Option<String>,
    /// Process of a target at an address, for its CPU time.
    pub remote_pid: Option<u32>,
}

/// A target in use by a fabric mode.
pub enum FabricTarget {
    /// Started in this process (on the caller's tokio runtime).
    InProcess {
        /// The running target.
        running: RunningTarget,
        /// Its listener.
        addr: SocketAddr,
    },
    /// A child process.
    Process {
        /// The child.
        child: Child,
        /// Its listener.
        addr: SocketAddr,
        /// Its configuration file (removed on stop).
        config: tempfile::TempPath,
    },
    /// Somebody else's target.
    Remote {
        /// `HOST:PORT`.
        addr: String,
        /// Its process on this machine, when known (for its CPU time).
        pid: Option<u32>,
    },
}

/// Where the target's CPU time is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CpuSource {
    /// Reactor threads of this process.
    Reactors,
    /// Every thread of this process.
    Process(u32),
    /// Not measurable.
    None,
}

fn target_config(spec: &TargetSpec, listen: &str) -> Result<Config, String> {
    let listen = listen.parse().map_err(|e| format!("{e}"))?;
    // One file behind every namespace, and behind the das mode too: shared on purpose.
    let ns: Vec<BackendSpec> = (0..spec.namespaces)
        .map(|_| spec.backend.shared())
        .collect();
    let mut cfg = Config::quick(&[listen], &spec.nqn, &ns, true, &[]).map_err(|e| e.to_string())?;
    cfg.target.reactors = spec.reactors;
    cfg.target.poll_us = spec.poll_us;
    cfg.target.max_queue_depth = spec.max_queue_depth;
    Ok(cfg)
}

impl FabricTarget {
    /// Starts (or names) the target of `kind`. In-process targets start on the current
    /// tokio runtime.
    pub fn start(kind: &TcpTarget, spec: &TargetSpec) -> Result<FabricTarget, FabricError> {
        match kind {
            TcpTarget::InProcess => {
                let cfg =
                    target_config(spec, "tcp://127.0.0.1:0").map_err(FabricError::InProcess)?;
                let (target, listeners) =
                    Target::build(&cfg).map_err(|e| FabricError::InProcess(e.to_string()))?;
                let addr = listeners
                    .first()
                    .map(|l| l.addr.addr)
                    .ok_or_else(|| FabricError::InProcess("no listener".into()))?;
                let running = RunningTarget::start(target, listeners)
                    .map_err(|e| FabricError::InProcess(e.to_string()))?;
                if let Some(cpus) = &spec.cpus {
                    pin_reactors(cpus, spec.reactors)?;
                }
                Ok(FabricTarget::InProcess { running, addr })
            }
            TcpTarget::Process(bin) => {
                let bin = match bin {
                    Some(b) => b.clone(),
                    None => default_target_bin().ok_or_else(|| FabricError::Process {
                        bin: PathBuf::from("nvmeof-targetd"),
                        msg: "not found next to nvmeof-bench; build it with `cargo build \
                              --release -p nvmeof-target` or pass --target-bin"
                            .into(),
                    })?,
                };
                start_process(&bin, spec)
            }
            TcpTarget::Remote { addr } => {
                if let Some(pid) = spec.remote_pid {
                    CpuSnapshot::take(Some(pid))?;
                    if let Some(cpus) = &spec.cpus {
                        cpu::pin_named(Some(pid), "", cpus)?;
                    }
                }
                Ok(FabricTarget::Remote {
                    addr: addr.clone(),
                    pid: spec.remote_pid,
                })
            }
        }
    }

    /// `HOST:PORT` to connect to.
    pub fn addr(&self) -> String {
        match self {
            FabricTarget::InProcess { addr, .. } | FabricTarget::Process { addr, .. } => {
                addr.to_string()
            }
            FabricTarget::Remote { addr, .. } => addr.clone(),
        }
    }

    /// Where the target's CPU time comes from.
    pub fn cpu_source(&self) -> CpuSource {
        match self {
            FabricTarget::InProcess { .. } => CpuSource::Reactors,
            FabricTarget::Process { child, .. } => CpuSource::Process(child.id()),
            FabricTarget::Remote { pid: Some(p), .. } => CpuSource::Process(*p),
            FabricTarget::Remote { pid: None, .. } => CpuSource::None,
        }
    }

    /// Stops the target (a remote target is left alone).
    pub async fn stop(self) {
        match self {
            FabricTarget::InProcess { running, .. } => {
                running.shutdown().await;
            }
            FabricTarget::Process {
                mut child, config, ..
            } => {
                let _ = Command::new("kill")
                    .args(["-TERM", &child.id().to_string()])
                    .status();
                let deadline = Instant::now() + Duration::from_secs(5);
                loop {
                    match child.try_wait() {
                        Ok(Some(_)) => break,
                        Ok(None) if Instant::now() < deadline => {
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                        _ => {
                            let _ = child.kill();
                            let _ = child.wait();
                            break;
                        }
                    }
                }
                drop(config);
            }
            FabricTarget::Remote { .. } => {}
        }
    }
}

/// Pins the in-process target's reactor threads, waiting briefly for them to appear.
fn pin_reactors(cpus: &str, reactors: usize) -> Result<(), FabricError> {
    let want = if reactors == 0 {
        cpu::online_cpus()
    } else {
        reactors
    };
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let snap = CpuSnapshot::take(None)?;
        let tids = snap.tids_named(cpu::REACTOR_PREFIX);
        if tids.len() >= want || Instant::now() > deadline {
            for t in tids {
                cpu::pin_thread(t, cpus)?;
            }
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// `nvmeof-targetd` next to the running executable (or one directory up, for test binaries
/// in `target/*/deps`).
pub fn default_target_bin() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    [
        dir.join("nvmeof-targetd"),
        dir.parent()?.join("nvmeof-targetd"),
    ]
    .into_iter()
    .find(|p| p.is_file())
}

fn free_port() -> std::io::Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

fn start_process(bin: &Path, spec: &TargetSpec) -> Result<FabricTarget, FabricError> {
    let err = |msg: String| FabricError::Process {
        bin: bin.to_path_buf(),
        msg,
    };
    let port = free_port().map_err(|e| err(format!("no free port: {e}")))?;
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let mut toml = String::new();
    toml.push_str(&format!(
        "[target]\nreactors = {}\npoll_us = {}\nmax_queue_depth = {}\n\n[[listener]]\naddress = \"tcp://{addr}\"\n\n\
         [[subsystem]]\nnqn = \"{}\"\nallow_any_host = true\n",
        spec.reactors, spec.poll_us, spec.max_queue_depth, spec.nqn
    ));
    for _ in 0..spec.namespaces {
        toml.push_str(&format!(
            "\n[[subsystem.namespace]]\nbackend = \"{}\"\n",
            spec.backend
        ));
    }
    let mut file = tempfile::Builder::new()
        .prefix("nvmeof-bench-target-")
        .suffix(".toml")
        .tempfile()
        .map_err(|e| err(format!("cannot write its configuration: {e}")))?;
    std::io::Write::write_all(&mut file, toml.as_bytes())
        .map_err(|e| err(format!("cannot write its configuration: {e}")))?;
    let config = file.into_temp_path();
    let mut cmd = match &spec.cpus {
        Some(cpus) => {
            let mut c = Command::new("taskset");
            c.args(["-c", cpus]).arg(bin);
            c
        }
        None => Command::new(bin),
    };
    cmd.arg("--config")
        .arg(&config)
        .env("NVMEOF_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    let mut child = cmd.spawn().map_err(|e| err(format!("cannot start: {e}")))?;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(err(format!("exited at start-up ({status})")));
        }
        if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(err(format!("not listening on {addr} after 10 s")));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(FabricTarget::Process {
        child,
        addr,
        config,
    })
}
