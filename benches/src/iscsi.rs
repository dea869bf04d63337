//! The iscsi modes: Debian's `tgt` started on this machine, and the I/O path through the
//! workspace's iSCSI initiator (`iscsi-initiator`).
//!
//! [`Tgt::start`] runs `tgtd` in the foreground (pinned with `taskset` to the target CPUs, as
//! our target process is), on its own control port and a free portal port on 127.0.0.1, and
//! configures it with `tgtadm`: one target named by the job's `iqn`, one LUN per namespace
//! from the job's `lun` (default 1: LUN 0 is tgt's controller), each backed the way the job's
//! `backend` says:
//!
//! | backend | LUN |
//! |---|---|
//! | `mem:SIZE` | a sparse file of `SIZE` bytes in `/dev/shm` (tmpfs: RAM), backing store `rdwr` |
//! | `null:SIZE` | backing store `null` (reads return zeros: verification fails, use `--no-verify`) |
//! | `file:PATH`, `bdev:PATH` | that file or device, backing store `rdwr` |
//!
//! with the backend's block size, and the session parameters of the "best known methods":
//! `ImmediateData=Yes`, `InitialR2T=No`, 256 KiB `MaxRecvDataSegmentLength` and
//! `FirstBurstLength` (and `MaxXmitDataSegmentLength`, tgt's Data-In segment size), 1 MiB
//! `MaxBurstLength`, `MaxQueueCmd` deep enough for the job, digests off. tgt allows one
//! connection per session: the load generator opens `queue_pairs` sessions per host instead
//! (several connections), and its workers share them out as they share NVMe queues.
//!
//! [`IscsiPath`] logs in `queue_pairs` sessions and opens the job's LUNs in each; worker `w`
//! uses session `w % queue_pairs`. Its CPU time is the client's (the sessions' tasks run on
//! the client threads); tgtd's is read from its process, as for `tcp-bin`.

use std::future::Future;
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use blockdev::BackendSpec;
use iscsi_initiator::{Lun, Session, SessionConfig};

use crate::fabric::FabricError;
use crate::path::{IoPath, NsGeometry, PathError};

/// What the started tgt serves.
#[derive(Debug, Clone)]
pub struct TgtSpec {
    /// Target IQN.
    pub iqn: String,
    /// Backend of each LUN.
    pub backend: BackendSpec,
    /// LUNs.
    pub namespaces: u32,
    /// The first LUN.
    pub first_lun: u16,
    /// CPUs to pin tgtd to.
    pub cpus: Option<String>,
    /// Commands each session may have queued (tgt's `MaxQueueCmd`).
    pub queue_depth: u32,
}

/// A tgtd process serving the target of a [`TgtSpec`].
pub struct Tgt {
    child: Child,
    addr: SocketAddr,
    /// Its control port.
    ctl: u16,
    _log: tempfile::NamedTempFile,
}

/// The control ports of the tgtd instances this process runs. Every start of this process
/// tries the same ports: starts take turns, and each skips the ports held here, so that two
/// at once never race for one port (the loser's tgtadm met a tgtd that was going away).
static HELD: parking_lot::Mutex<Vec<u16>> = parking_lot::Mutex::new(Vec::new());

/// `name` on `PATH` or in the sbin directories (where Debian puts tgtd and tgtadm, and which
/// a user's `PATH` may lack).
pub fn find_tool(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/local/sbin"].map(PathBuf::from))
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// What tgtd said, on one line, without its start-up noise (no RDMA for iSER, no right to
/// raise limits).
fn what_tgtd_said(log: &Path) -> String {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .map(str::trim)
        .filter(|l| {
            !l.is_empty()
                && !l.contains("iser")
                && !l.contains("can't adjust")
                && !l.contains("--help")
        })
        .collect::<Vec<_>>()
        .join("; ")
}

fn tgt_err(msg: impl Into<String>) -> FabricError {
    FabricError::Unavailable(format!("tgt: {}", msg.into()))
}

impl Tgt {
    /// Starts tgtd and configures its target (see the module docs). Fails with one line when
    /// tgt is not installed, does not start or refuses the configuration.
    pub fn start(spec: &TgtSpec) -> Result<Tgt, FabricError> {
        let not_installed = || {
            tgt_err(
                "tgtd and tgtadm not found: install Debian's tgt (apt-get install tgt) or use \
                 iscsi=HOST:PORT",
            )
        };
        let tgtd = find_tool("tgtd").ok_or_else(not_installed)?;
        let tgtadm = find_tool("tgtadm").ok_or_else(not_installed)?;
        if spec.first_lun == 0 {
            return Err(tgt_err("LUN 0 is tgt's controller: lun must be at least 1"));
        }
        let mut files = Vec::new();
        let mut luns = Vec::new();
        for _ in 0..spec.namespaces {
            luns.push(backing_store(&spec.backend, &mut files)?);
        }
        // Control ports of other tgtd instances (another run, the system's) are taken: tgtd
        // then exits at once and the next one is tried.
        // tgtd takes control ports up to 32767.
        let base = 100 + (std::process::id() % 3000) as u16 * 8;
        let mut last = String::new();
        let mut held = HELD.lock();
        for ctl in base..base + 8 {
            if held.contains(&ctl) {
                continue;
            }
            let log = tempfile::Builder::new()
                .prefix("nvmeof-bench-tgtd-")
                .suffix(".log")
                .tempfile()
                .map_err(|e| tgt_err(format!("cannot create its log: {e}")))?;
            let port =
                crate::fabric::free_port().map_err(|e| tgt_err(format!("no free port: {e}")))?;
            let addr = SocketAddr::from(([127, 0, 0, 1], port));
            let mut cmd = match &spec.cpus {
                Some(cpus) => {
                    let mut c = Command::new("taskset");
                    c.args(["-c", cpus]).arg(&tgtd);
                    c
                }
                None => Command::new(&tgtd),
            };
            let out = log
                .reopen()
                .map_err(|e| tgt_err(format!("cannot open its log: {e}")))?;
            let err = log
                .reopen()
                .map_err(|e| tgt_err(format!("cannot open its log: {e}")))?;
            cmd.args(["-f", "-C", &ctl.to_string(), "--iscsi"])
                .arg(format!("portal={addr}"))
                .stdin(Stdio::null())
                .stdout(out)
                .stderr(err);
            let mut child = cmd
                .spawn()
                .map_err(|e| tgt_err(format!("cannot start {}: {e}", tgtd.display())))?;
            let deadline = Instant::now() + Duration::from_secs(10);
            let listening = loop {
                if let Ok(Some(_)) = child.try_wait() {
                    break false;
                }
                if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
                    break true;
                }
                if Instant::now() > deadline {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(tgt_err(format!("tgtd not listening on {addr} after 10 s")));
                }
                std::thread::sleep(Duration::from_millis(20));
            };
            if !listening {
                last = what_tgtd_said(log.path());
                continue;
            }
            let mut tgt = Tgt {
                child,
                addr,
                ctl,
                _log: log,
            };
            if let Err(e) = configure(&tgtadm, ctl, spec, &luns) {
                drop(held);
                tgt.kill();
                return Err(e);
            }
            held.push(ctl);
            // tgtd holds its backing files open: their names go now, so their memory is
            // freed when tgtd ends, however the load generator ends.
            drop(files);
            return Ok(tgt);
        }
        Err(tgt_err(format!(
            "tgtd did not start on control ports {base}..{}: {last}",
            base + 7
        )))
    }

    /// `HOST:PORT` of its portal.
    pub fn addr(&self) -> String {
        self.addr.to_string()
    }

    /// The tgtd process.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    fn kill(&mut self) {
        // tgtd ignores SIGTERM while it serves targets: it holds nothing worth a clean stop.
        let _ = self.child.kill();
        let _ = self.child.wait();
        HELD.lock().retain(|&c| c != self.ctl);
    }

    /// Stops tgtd (the memory of its backing files goes with it).
    pub fn stop(mut self) {
        self.kill();
    }
}

impl Drop for Tgt {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A LUN's backing store: `(path, bstype, block size)`.
type Store = (PathBuf, &'static str, u32);

fn backing_store(
    backend: &BackendSpec,
    files: &mut Vec<tempfile::TempPath>,
) -> Result<Store, FabricError> {
    match backend {
        BackendSpec::Memory { size, block_size } => {
            let f = tempfile::Builder::new()
                .prefix("nvmeof-bench-tgt-")
                .suffix(".img")
                .tempfile_in("/dev/shm")
                .map_err(|e| tgt_err(format!("cannot create a file in /dev/shm (tmpfs): {e}")))?;
            f.as_file()
                .set_len(*size)
                .map_err(|e| tgt_err(format!("cannot size the file in /dev/shm: {e}")))?;
            let p = f.into_temp_path();
            let path = p.to_path_buf();
            files.push(p);
            Ok((path, "rdwr", *block_size))
        }
        BackendSpec::Null { block_size, .. } => {
            Ok((PathBuf::from("/dev/null"), "null", *block_size))
        }
        BackendSpec::File(f) | BackendSpec::Bdev(f) => Ok((
            f.path.clone(),
            "rdwr",
            f.block_size.unwrap_or(blockdev::DEFAULT_BLOCK_SIZE),
        )),
        BackendSpec::Pcie { .. } => Err(tgt_err(
            "a pcie: backend is driven by this process; tgt cannot serve it",
        )),
    }
}

fn tgtadm(bin: &Path, ctl: u16, args: &[&str]) -> Result<(), FabricError> {
    let out = Command::new(bin)
        .args(["-C", &ctl.to_string(), "--lld", "iscsi"])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| tgt_err(format!("cannot run {}: {e}", bin.display())))?;
    if out.status.success() {
        return Ok(());
    }
    let msg = String::from_utf8_lossy(&out.stderr);
    Err(tgt_err(format!(
        "tgtadm {} failed: {}",
        args.join(" "),
        msg.split_whitespace().collect::<Vec<_>>().join(" ")
    )))
}

fn configure(bin: &Path, ctl: u16, spec: &TgtSpec, luns: &[Store]) -> Result<(), FabricError> {
    tgtadm(
        bin,
        ctl,
        &[
            "--mode", "target", "--op", "new", "--tid", "1", "-T", &spec.iqn,
        ],
    )?;
    for (i, (path, bstype, block_size)) in luns.iter().enumerate() {
        let lun = (u32::from(spec.first_lun) + i as u32).to_string();
        let path = path.display().to_string();
        let bs = block_size.to_string();
        let mut args = vec![
            "--mode",
            "logicalunit",
            "--op",
            "new",
            "--tid",
            "1",
            "--lun",
            &lun,
            "-b",
            &path,
            "--bstype",
            bstype,
        ];
        if *bstype == "rdwr" {
            args.extend(["--blocksize", &bs]);
        }
        tgtadm(bin, ctl, &args)?;
    }
    tgtadm(
        bin,
        ctl,
        &[
            "--mode", "target", "--op", "bind", "--tid", "1", "-I", "ALL",
        ],
    )?;
    let queue = spec.queue_depth.clamp(128, 2048).to_string();
    for (name, value) in [
        ("ImmediateData", "Yes"),
        ("InitialR2T", "No"),
        ("MaxRecvDataSegmentLength", "262144"),
        ("MaxXmitDataSegmentLength", "262144"),
        ("FirstBurstLength", "262144"),
        ("MaxBurstLength", "1048576"),
        ("HeaderDigest", "None"),
        ("DataDigest", "None"),
        ("MaxQueueCmd", queue.as_str()),
    ] {
        tgtadm(
            bin,
            ctl,
            &[
                "--mode", "target", "--op", "update", "--tid", "1", "--name", name, "--value",
                value,
            ],
        )?;
    }
    Ok(())
}

/// Connection settings of an [`IscsiPath`].
#[derive(Debug, Clone)]
pub struct IscsiSettings {
    /// `HOST:PORT` of the portal.
    pub addr: String,
    /// Target IQN.
    pub iqn: String,
    /// Sessions (one connection each).
    pub sessions: u16,
    /// The first LUN.
    pub first_lun: u16,
    /// LUNs (the first one and those after it).
    pub luns: u32,
}

/// iSCSI through the workspace's initiator: `sessions` sessions to one target, each with
/// every LUN of the job.
pub struct IscsiPath {
    sessions: Vec<Session>,
    luns: Vec<Lun>,
    geometry: Vec<NsGeometry>,
}

impl IscsiPath {
    /// Logs in every session and checks every LUN. Must run inside the runtime that will
    /// drive the I/O (each session's reader task lives there).
    pub async fn connect(s: &IscsiSettings) -> Result<IscsiPath, PathError> {
        let cfg = SessionConfig::new(s.addr.clone(), s.iqn.clone());
        let mut path = IscsiPath {
            sessions: Vec::new(),
            luns: Vec::new(),
            geometry: Vec::new(),
        };
        for _ in 0..s.sessions.max(1) {
            match Session::connect(&cfg).await {
                Ok(sess) => path.sessions.push(sess),
                Err(e) => {
                    path.logout().await;
                    return Err(e.into());
                }
            }
        }
        for i in 0..s.luns {
            let number = s.first_lun.saturating_add(i as u16);
            // Every session opens every LUN: a target reports a unit attention (power on or
            // reset) once per session and LUN, which the open takes instead of the first I/O.
            let mut opened = path.sessions[0].open_lun(number).await;
            for sess in &path.sessions[1..] {
                if opened.is_ok() {
                    opened = sess.open_lun(number).await;
                }
            }
            match opened {
                Ok(lun) => {
                    path.geometry.push(NsGeometry {
                        target: 0,
                        nsid: u32::from(number),
                        block_size: lun.capacity.block_size,
                        bytes: lun.capacity.bytes(),
                    });
                    path.luns.push(lun);
                }
                Err(e) => {
                    path.logout().await;
                    return Err(e.into());
                }
            }
        }
        Ok(path)
    }

    /// Sessions in use.
    pub fn sessions(&self) -> usize {
        self.sessions.len()
    }

    /// Logs every session out (failures are only logged: the sessions close either way).
    pub async fn logout(self) {
        for s in self.sessions {
            if let Err(e) = s.logout().await {
                tracing::warn!(error = %e, "iscsi logout failed");
            }
        }
    }
}

impl IoPath for IscsiPath {
    type Buf = Vec<u8>;

    fn geometry(&self) -> &[NsGeometry] {
        &self.geometry
    }

    fn alloc(&self, len: usize) -> Vec<u8> {
        vec![0u8; len]
    }

    fn bytes(buf: &Vec<u8>) -> &[u8] {
        buf
    }

    fn bytes_mut(buf: &mut Vec<u8>) -> &mut [u8] {
        buf
    }

    fn read(
        &self,
        queue: usize,
        ns: usize,
        offset: u64,
        buf: Vec<u8>,
    ) -> impl Future<Output = (Result<(), PathError>, Vec<u8>)> + Send {
        let s = &self.sessions[queue % self.sessions.len()];
        let lun = &self.luns[ns];
        let lba = offset / u64::from(lun.capacity.block_size);
        async move {
            let (r, buf) = s.read(lun, lba, buf).await;
            (r.map_err(PathError::from), buf)
        }
    }

    fn write(
        &self,
        queue: usize,
        ns: usize,
        offset: u64,
        buf: Vec<u8>,
    ) -> impl Future<Output = (Result<(), PathError>, Vec<u8>)> + Send {
        let s = &self.sessions[queue % self.sessions.len()];
        let lun = &self.luns[ns];
        let lba = offset / u64::from(lun.capacity.block_size);
        async move {
            let (r, buf) = s.write(lun, lba, buf).await;
            (r.map_err(PathError::from), buf)
        }
    }
}
