//! The targets the fabric modes talk to: ours started in this process, ours started as a
//! separate process, or any NVMe/TCP target at an address.
//!
//! [`FabricTargets`] starts several instances of ours (`targets = N`), each with its own
//! listener, subsystem and backends, sharing out the reactors and CPUs one instance would have
//! ([`share_out`]).
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
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CpuSource {
    /// Reactor threads of this process.
    Reactors,
    /// Every thread of these processes (one per target).
    Processes(Vec<u32>),
    /// Not measurable.
    None,
}

impl CpuSource {
    /// The processes whose CPU time is read, when the target is not in this process.
    pub fn pids(&self) -> Option<&[u32]> {
        match self {
            CpuSource::Processes(p) => Some(p),
            _ => None,
        }
    }
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
                // Reactor threads of targets already running keep their CPUs.
                let before = match &spec.cpus {
                    Some(_) => CpuSnapshot::take(None)?.tids_named(cpu::REACTOR_PREFIX),
                    None => Vec::new(),
                };
                let cfg =
                    target_config(spec, "tcp://127.0.0.1:0").map_err(FabricError::InProcess)?;
                let fail =
                    |e: nvmeof_target::target::StartError| FabricError::InProcess(e.to_string());
                let target = Target::build(&cfg).map_err(fail)?;
                let listeners = nvmeof_target::launcher::bind(&cfg).map_err(fail)?;
                let addr = listeners
                    .first()
                    .map(|l| l.addr.addr)
                    .ok_or_else(|| FabricError::InProcess("no listener".into()))?;
                let running = RunningTarget::start(target, listeners)
                    .map_err(|e| FabricError::InProcess(e.to_string()))?;
                if let Some(cpus) = &spec.cpus {
                    pin_reactors(cpus, spec.reactors, &before)?;
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
            FabricTarget::Process { child, .. } => CpuSource::Processes(vec![child.id()]),
            FabricTarget::Remote { pid: Some(p), .. } => CpuSource::Processes(vec![*p]),
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

/// Pins the in-process target's reactor threads (those not in `before`), waiting briefly for
/// them to appear.
fn pin_reactors(cpus: &str, reactors: usize, before: &[u32]) -> Result<(), FabricError> {
    let want = if reactors == 0 {
        cpu::online_cpus()
    } else {
        reactors
    };
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let snap = CpuSnapshot::take(None)?;
        let mut tids = snap.tids_named(cpu::REACTOR_PREFIX);
        tids.retain(|t| !before.contains(t));
        if tids.len() >= want || Instant::now() > deadline {
            for t in tids {
                cpu::pin_thread(t, cpus)?;
            }
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The settings of each of `n` target instances standing in for one target of `spec`: the
/// reactors divided among them (at least one each; `0`, one per CPU, counts the CPUs of
/// `spec.cpus` or of the machine) and a CPU list split into `n` contiguous parts (an instance
/// beyond the list's length shares a CPU), so `n` instances use the cores one would.
pub fn share_out(spec: &TargetSpec, n: usize) -> Result<Vec<TargetSpec>, FabricError> {
    let n = n.max(1);
    if n == 1 {
        return Ok(vec![spec.clone()]);
    }
    let cpus = match &spec.cpus {
        Some(list) => Some(cpu::parse_cpu_list(list)?),
        None => None,
    };
    let reactors = match (spec.reactors, &cpus) {
        (0, Some(c)) => c.len(),
        (0, None) => cpu::online_cpus(),
        (r, _) => r,
    };
    Ok((0..n)
        .map(|i| {
            let share = reactors / n + usize::from(i < reactors % n);
            let cpus = cpus.as_ref().map(|c| {
                let part: Vec<u32> = if c.len() >= n {
                    c[i * c.len() / n..(i + 1) * c.len() / n].to_vec()
                } else {
                    vec![c[i * c.len() / n]]
                };
                part.iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join(",")
            });
            TargetSpec {
                reactors: share.max(1),
                cpus,
                ..spec.clone()
            }
        })
        .collect())
}

/// The targets of one fabric mode: one, or several instances of ours standing in for several
/// drives (`targets = N`), one controller each.
pub struct FabricTargets {
    targets: Vec<FabricTarget>,
}

impl FabricTargets {
    /// Starts (or names) `n` targets of `kind`, sharing out `spec`'s reactors and CPUs
    /// ([`share_out`]). A target at an address is one target: `n > 1` there is
    /// [`FabricError::Unavailable`]. Targets started before one fails are stopped.
    pub async fn start(
        kind: &TcpTarget,
        spec: &TargetSpec,
        n: usize,
    ) -> Result<FabricTargets, FabricError> {
        if n > 1 && matches!(kind, TcpTarget::Remote { .. }) {
            return Err(FabricError::Unavailable(format!(
                "{} targets asked for, but a target at an address is one target",
                n
            )));
        }
        let mut targets = Vec::with_capacity(n);
        for s in share_out(spec, n)? {
            match FabricTarget::start(kind, &s) {
                Ok(t) => targets.push(t),
                Err(e) => {
                    for t in targets {
                        t.stop().await;
                    }
                    return Err(e);
                }
            }
        }
        Ok(FabricTargets { targets })
    }

    /// How many targets.
    pub fn len(&self) -> usize {
        self.targets.len()
    }

    /// Whether there is none (never, once started).
    pub fn is_empty(&self) -> bool {
        self.targets.is_empty()
    }

    /// `HOST:PORT` of each target, in order.
    pub fn addrs(&self) -> Vec<String> {
        self.targets.iter().map(FabricTarget::addr).collect()
    }

    /// Where the targets' CPU time comes from (all of them together).
    pub fn cpu_source(&self) -> CpuSource {
        let mut pids = Vec::new();
        for t in &self.targets {
            match t.cpu_source() {
                CpuSource::Reactors => return CpuSource::Reactors,
                CpuSource::Processes(p) => pids.extend(p),
                CpuSource::None => return CpuSource::None,
            }
        }
        CpuSource::Processes(pids)
    }

    /// Stops every target (a remote target is left alone).
    pub async fn stop(self) {
        for t in self.targets {
            t.stop().await;
        }
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

/// A TCP port on 127.0.0.1 that was free a moment ago.
pub(crate) fn free_port() -> std::io::Result<u16> {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(reactors: usize, cpus: Option<&str>) -> TargetSpec {
        TargetSpec {
            nqn: crate::job::DEFAULT_NQN.into(),
            backend: BackendSpec::Memory {
                size: 1 << 20,
                block_size: 512,
            },
            namespaces: 1,
            reactors,
            poll_us: 0,
            max_queue_depth: 128,
            cpus: cpus.map(str::to_string),
            remote_pid: None,
        }
    }

    fn shares(s: &TargetSpec, n: usize) -> Vec<(usize, Option<String>)> {
        share_out(s, n)
            .unwrap()
            .into_iter()
            .map(|t| (t.reactors, t.cpus))
            .collect()
    }

    #[test]
    fn reactors_and_cpus_are_shared_out() {
        let some = |s: &str| Some(s.to_string());
        assert_eq!(shares(&spec(8, Some("0-7")), 1), [(8, some("0-7"))]);
        assert_eq!(
            shares(&spec(8, Some("0-7")), 2),
            [(4, some("0,1,2,3")), (4, some("4,5,6,7"))]
        );
        assert_eq!(
            shares(&spec(3, Some("0-2,8")), 2),
            [(2, some("0,1")), (1, some("2,8"))]
        );
        // Fewer reactors or CPUs than targets: at least one each.
        assert_eq!(
            shares(&spec(1, Some("4-5")), 4),
            [
                (1, some("4")),
                (1, some("4")),
                (1, some("5")),
                (1, some("5"))
            ]
        );
        assert_eq!(
            shares(&spec(1, Some("3")), 2),
            [(1, some("3")), (1, some("3"))]
        );
        assert_eq!(shares(&spec(5, None), 2), [(3, None), (2, None)]);
        // One reactor per CPU of the list.
        assert_eq!(
            shares(&spec(0, Some("0-5")), 3),
            [(2, some("0,1")), (2, some("2,3")), (2, some("4,5"))]
        );
        assert!(share_out(&spec(1, Some("x")), 2).is_err());
    }
}
