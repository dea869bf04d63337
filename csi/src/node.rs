//! The Node service: attaches volumes to this machine with the Linux kernel's NVMe/TCP host
//! (`nvme-cli`), finds the block device by the namespace UUID in sysfs, makes an ext4 file
//! system when the volume has none and mounts it.
//!
//! Every call looks at the machine's state (sysfs, `/proc/self/mountinfo`) before it acts,
//! so a call repeated, or one made again after the driver restarted halfway, finishes the
//! job instead of failing or doing it twice.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::process::Command;
use tracing::info;

use crate::controller::{SECRET_DHCHAP_CTRL_KEY, SECRET_DHCHAP_KEY, VolumeId};
use crate::grpc::{Code, Status, fail};
use crate::proto::*;

/// How long a connected namespace, or a grown one, may take to appear.
const DEVICE_WAIT: Duration = Duration::from_secs(20);

/// The Node service.
pub struct Node {
    /// This machine's host NQN: the node ID.
    pub host_nqn: String,
    /// The sysfs root (`/sys`).
    pub sysfs: PathBuf,
    /// Serialises the calls: two calls on one volume never race.
    lock: tokio::sync::Mutex<()>,
}

async fn run(program: &str, args: &[&str]) -> Result<String, Status> {
    let out = Command::new(program)
        .args(args)
        .output()
        .await
        .map_err(|e| Status::new(Code::Internal, format!("{program}: {e}")))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        // Keys never reach a message or a log.
        let shown: Vec<&str> = args
            .iter()
            .enumerate()
            .map(|(i, a)| {
                if i > 0 && args[i - 1].starts_with("--dhchap") {
                    "(secret)"
                } else {
                    a
                }
            })
            .collect();
        return fail(
            Code::Internal,
            format!("{program} {}: {}", shown.join(" "), err.trim()),
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The mount points in `/proc/self/mountinfo`, with their sources.
fn mounts() -> Vec<(String, PathBuf)> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            let sep = f.iter().position(|x| *x == "-")?;
            let point = unescape(f.get(4)?);
            let source = f.get(sep + 2)?.to_string();
            Some((source, PathBuf::from(point)))
        })
        .collect()
}

/// mountinfo escapes space, tab, newline and backslash as octal.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 4 <= b.len() {
            let digits = std::str::from_utf8(&b[i + 1..i + 4]).ok();
            if let Some(v) = digits.and_then(|d| u8::from_str_radix(d, 8).ok()) {
                out.push(v);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// What a device holds, as far as staging cares.
#[derive(Debug, PartialEq, Eq)]
enum Contents {
    /// An ext2/3/4 file system (its superblock magic).
    Ext,
    /// Zeros: never written, so a file system may be made.
    Empty,
    /// Something else: left alone.
    Other,
}

/// Reads the first 64 KiB of `dev`: the ext superblock's magic (0xEF53 at byte 1080), or
/// nothing but zeros.
fn probe(dev: &Path) -> std::io::Result<Contents> {
    use std::io::Read;
    let mut head = vec![0u8; 64 << 10];
    let mut f = std::fs::File::open(dev)?;
    let mut n = 0;
    while n < head.len() {
        match f.read(&mut head[n..])? {
            0 => break,
            k => n += k,
        }
    }
    head.truncate(n);
    Ok(classify(&head))
}

fn classify(head: &[u8]) -> Contents {
    if head.get(1080..1082) == Some(&[0x53, 0xef][..]) {
        Contents::Ext
    } else if head.iter().all(|b| *b == 0) {
        Contents::Empty
    } else {
        Contents::Other
    }
}

fn is_mounted(path: &Path) -> bool {
    mounts().iter().any(|(_, p)| p == path)
}

/// `nvmeXnY` (a namespace, or a multipath head), not `nvmeXcZnY` (one controller's path).
fn is_namespace_head(name: &str) -> bool {
    let Some(rest) = name.strip_prefix("nvme") else {
        return false;
    };
    let Some((ctrl, ns)) = rest.split_once('n') else {
        return false;
    };
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    digits(ctrl) && digits(ns)
}

fn required(field: &str, value: &str) -> Result<(), Status> {
    if value.is_empty() {
        return fail(Code::InvalidArgument, format!("{field} missing"));
    }
    Ok(())
}

fn volume_id(s: &str) -> Result<VolumeId, Status> {
    required("volume ID", s)?;
    VolumeId::parse(s).ok_or_else(|| {
        Status::new(
            Code::NotFound,
            format!("volume {s:?} is not one of this driver's"),
        )
    })
}

impl Node {
    /// A node service for `host_nqn`.
    pub fn new(host_nqn: String) -> Node {
        Node {
            host_nqn,
            sysfs: PathBuf::from("/sys"),
            lock: tokio::sync::Mutex::new(()),
        }
    }

    /// The block device (`nvme0n1`) of the namespace with `uuid`, if the host has it.
    fn device(&self, id: &VolumeId) -> Option<String> {
        let uuid = id.uuid();
        let entries = std::fs::read_dir(self.sysfs.join("block")).ok()?;
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            // With native multipath each controller's path (`nvme0c1n1`) is listed too, but
            // only the namespace head (`nvme0n1`) has a device node.
            if !is_namespace_head(&name) {
                continue;
            }
            let read = |attr: &str| {
                std::fs::read_to_string(e.path().join(attr))
                    .map(|s| s.trim().to_lowercase())
                    .unwrap_or_default()
            };
            if read("uuid") == uuid || read("nguid").replace('-', "") == id.key {
                return Some(name);
            }
        }
        None
    }

    fn device_bytes(&self, dev: &str) -> u64 {
        std::fs::read_to_string(self.sysfs.join("block").join(dev).join("size"))
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .unwrap_or(0)
            * 512
    }

    /// The controllers (`nvme0`) of the subsystem `nqn`.
    fn controllers(&self, nqn: &str) -> Vec<String> {
        let mut out = Vec::new();
        let Ok(subs) = std::fs::read_dir(self.sysfs.join("class/nvme-subsystem")) else {
            return out;
        };
        for s in subs.flatten() {
            let sub = std::fs::read_to_string(s.path().join("subsysnqn")).unwrap_or_default();
            if sub.trim() != nqn {
                continue;
            }
            for c in std::fs::read_dir(s.path()).into_iter().flatten().flatten() {
                let n = c.file_name().to_string_lossy().into_owned();
                if n.strip_prefix("nvme")
                    .is_some_and(|r| !r.is_empty() && r.chars().all(|c| c.is_ascii_digit()))
                {
                    out.push(n);
                }
            }
        }
        out.sort();
        out.dedup();
        out
    }

    async fn wait_device(&self, id: &VolumeId) -> Option<String> {
        let deadline = tokio::time::Instant::now() + DEVICE_WAIT;
        loop {
            if let Some(d) = self.device(id) {
                return Some(d);
            }
            if tokio::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// NodeStageVolume.
    pub async fn stage(
        &self,
        req: NodeStageVolumeRequest,
    ) -> Result<NodeStageVolumeResponse, Status> {
        // Missing arguments first: an ID that is not this driver's is NotFound only when
        // everything else was given.
        required("volume ID", &req.volume_id)?;
        required("staging target path", &req.staging_target_path)?;
        let Some(cap) = req.volume_capability else {
            return fail(Code::InvalidArgument, "volume capability missing");
        };
        let id = volume_id(&req.volume_id)?;
        let _guard = self.lock.lock().await;
        let staging = PathBuf::from(&req.staging_target_path);
        let dev = match self.device(&id) {
            Some(d) => d,
            None => {
                let ctx = |k: &str| {
                    req.publish_context
                        .get(k)
                        .or_else(|| req.volume_context.get(k))
                        .cloned()
                        .unwrap_or_default()
                };
                let (traddr, trsvcid) = (ctx("traddr"), ctx("trsvcid"));
                required("traddr in the publish context", &traddr)?;
                required("trsvcid in the publish context", &trsvcid)?;
                let nqn = id.nqn();
                // "Already connected" is fine: the device check below decides.
                let mut args = vec![
                    "connect",
                    "-t",
                    "tcp",
                    "-a",
                    traddr.as_str(),
                    "-s",
                    trsvcid.as_str(),
                    "-n",
                    nqn.as_str(),
                    "--hostnqn",
                    self.host_nqn.as_str(),
                ];
                // DH-HMAC-CHAP keys from the node-stage secret (the ones ControllerPublish
                // allowed the host with).
                if let Some(k) = req.secrets.get(SECRET_DHCHAP_KEY) {
                    args.extend(["--dhchap-secret", k.as_str()]);
                }
                if let Some(k) = req.secrets.get(SECRET_DHCHAP_CTRL_KEY) {
                    args.extend(["--dhchap-ctrl-secret", k.as_str()]);
                }
                let connected = run("nvme", &args).await;
                match self.wait_device(&id).await {
                    Some(d) => d,
                    None => {
                        let why = connected
                            .err()
                            .map(|e| e.message)
                            .unwrap_or_else(|| "no namespace with its UUID appeared".into());
                        return fail(Code::Internal, format!("volume {id}: {why}"));
                    }
                }
            }
        };
        info!(volume = %id, device = %dev, "volume attached");
        let Some(AccessType::Mount(m)) = cap.access_type else {
            return Ok(NodeStageVolumeResponse {});
        };
        if is_mounted(&staging) {
            return Ok(NodeStageVolumeResponse {});
        }
        let devpath = format!("/dev/{dev}");
        let fs = if m.fs_type.is_empty() {
            "ext4"
        } else {
            m.fs_type.as_str()
        };
        if fs != "ext4" {
            return fail(
                Code::InvalidArgument,
                format!("file system {fs:?}: only ext4 is supported"),
            );
        }
        match probe(Path::new(&devpath))
            .map_err(|e| Status::new(Code::Internal, format!("{devpath}: {e}")))?
        {
            Contents::Ext => {}
            Contents::Empty => {
                run("mke2fs", &["-t", "ext4", "-F", "-q", &devpath]).await?;
                info!(volume = %id, device = %dev, "ext4 made");
            }
            Contents::Other => {
                return fail(
                    Code::FailedPrecondition,
                    format!(
                        "volume {id} holds data that is not an ext2/3/4 file system: not formatted"
                    ),
                );
            }
        }
        std::fs::create_dir_all(&staging)
            .map_err(|e| Status::new(Code::Internal, format!("{}: {e}", staging.display())))?;
        let mut args = vec!["-t", fs];
        let opts = m.mount_flags.join(",");
        if !opts.is_empty() {
            args.extend(["-o", &opts]);
        }
        args.extend([devpath.as_str(), &req.staging_target_path]);
        run("mount", &args).await?;
        info!(volume = %id, path = %staging.display(), "volume staged");
        Ok(NodeStageVolumeResponse {})
    }

    /// NodeUnstageVolume: unmounts, and disconnects when nothing else uses the device.
    pub async fn unstage(
        &self,
        req: NodeUnstageVolumeRequest,
    ) -> Result<NodeUnstageVolumeResponse, Status> {
        required("volume ID", &req.volume_id)?;
        required("staging target path", &req.staging_target_path)?;
        let id = volume_id(&req.volume_id)?;
        let _guard = self.lock.lock().await;
        let staging = PathBuf::from(&req.staging_target_path);
        if is_mounted(&staging) {
            run("umount", &[&req.staging_target_path]).await?;
        }
        if let Some(dev) = self.device(&id) {
            let devpath = format!("/dev/{dev}");
            if let Some((_, p)) = mounts().into_iter().find(|(s, _)| *s == devpath) {
                return fail(
                    Code::FailedPrecondition,
                    format!("volume {id} is still mounted at {}", p.display()),
                );
            }
            run("nvme", &["disconnect", "-n", &id.nqn()]).await?;
            info!(volume = %id, "volume detached");
        }
        Ok(NodeUnstageVolumeResponse {})
    }

    /// NodePublishVolume: a bind mount of the staged file system, or of the block device.
    pub async fn publish(
        &self,
        req: NodePublishVolumeRequest,
    ) -> Result<NodePublishVolumeResponse, Status> {
        required("volume ID", &req.volume_id)?;
        required("staging target path", &req.staging_target_path)?;
        required("target path", &req.target_path)?;
        let Some(cap) = req.volume_capability else {
            return fail(Code::InvalidArgument, "volume capability missing");
        };
        let id = volume_id(&req.volume_id)?;
        let _guard = self.lock.lock().await;
        let target = PathBuf::from(&req.target_path);
        if is_mounted(&target) {
            return Ok(NodePublishVolumeResponse {});
        }
        let io =
            |e: std::io::Error| Status::new(Code::Internal, format!("{}: {e}", target.display()));
        let source = match cap.access_type {
            Some(AccessType::Block(_)) => {
                let Some(dev) = self.device(&id) else {
                    return fail(
                        Code::FailedPrecondition,
                        format!("volume {id} is not staged"),
                    );
                };
                if let Some(parent) = target.parent() {
                    std::fs::create_dir_all(parent).map_err(io)?;
                }
                std::fs::OpenOptions::new()
                    .create(true)
                    .truncate(false)
                    .write(true)
                    .open(&target)
                    .map_err(io)?;
                format!("/dev/{dev}")
            }
            _ => {
                if !is_mounted(Path::new(&req.staging_target_path)) {
                    return fail(
                        Code::FailedPrecondition,
                        format!("volume {id} is not staged at {}", req.staging_target_path),
                    );
                }
                std::fs::create_dir_all(&target).map_err(io)?;
                req.staging_target_path.clone()
            }
        };
        run("mount", &["-o", "bind", &source, &req.target_path]).await?;
        if req.readonly {
            run("mount", &["-o", "remount,bind,ro", &req.target_path]).await?;
        }
        info!(volume = %id, path = %req.target_path, "volume published");
        Ok(NodePublishVolumeResponse {})
    }

    /// NodeUnpublishVolume.
    pub async fn unpublish(
        &self,
        req: NodeUnpublishVolumeRequest,
    ) -> Result<NodeUnpublishVolumeResponse, Status> {
        required("volume ID", &req.volume_id)?;
        required("target path", &req.target_path)?;
        volume_id(&req.volume_id)?;
        let _guard = self.lock.lock().await;
        let target = PathBuf::from(&req.target_path);
        if is_mounted(&target) {
            run("umount", &[&req.target_path]).await?;
        }
        let gone = if target.is_dir() {
            std::fs::remove_dir(&target)
        } else {
            std::fs::remove_file(&target)
        };
        match gone {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return fail(Code::Internal, format!("{}: {e}", target.display()));
            }
            _ => {}
        }
        Ok(NodeUnpublishVolumeResponse {})
    }

    /// NodeGetVolumeStats: bytes and inodes of a mounted volume, bytes of a block volume.
    pub async fn stats(
        &self,
        req: NodeGetVolumeStatsRequest,
    ) -> Result<NodeGetVolumeStatsResponse, Status> {
        required("volume ID", &req.volume_id)?;
        required("volume path", &req.volume_path)?;
        let id = volume_id(&req.volume_id)?;
        let path = Path::new(&req.volume_path);
        if !path.exists() {
            return fail(
                Code::NotFound,
                format!("{} does not exist", req.volume_path),
            );
        }
        if !path.is_dir() {
            let Some(dev) = self.device(&id) else {
                return fail(Code::NotFound, format!("volume {id} is not attached"));
            };
            let total = self.device_bytes(&dev) as i64;
            return Ok(NodeGetVolumeStatsResponse {
                usage: vec![VolumeUsage {
                    total,
                    unit: UNIT_BYTES,
                    ..Default::default()
                }],
            });
        }
        let s = rustix::fs::statvfs(path)
            .map_err(|e| Status::new(Code::Internal, format!("{}: {e}", req.volume_path)))?;
        let f = s.f_frsize as i64;
        Ok(NodeGetVolumeStatsResponse {
            usage: vec![
                VolumeUsage {
                    total: s.f_blocks as i64 * f,
                    available: s.f_bavail as i64 * f,
                    used: (s.f_blocks - s.f_bfree) as i64 * f,
                    unit: UNIT_BYTES,
                },
                VolumeUsage {
                    total: s.f_files as i64,
                    available: s.f_favail as i64,
                    used: (s.f_files - s.f_ffree) as i64,
                    unit: UNIT_INODES,
                },
            ],
        })
    }

    /// NodeExpandVolume: has the kernel read the namespace's new size, then grows ext4.
    pub async fn expand(
        &self,
        req: NodeExpandVolumeRequest,
    ) -> Result<NodeExpandVolumeResponse, Status> {
        required("volume ID", &req.volume_id)?;
        required("volume path", &req.volume_path)?;
        let id = volume_id(&req.volume_id)?;
        if !Path::new(&req.volume_path).exists() {
            return fail(
                Code::NotFound,
                format!("{} does not exist", req.volume_path),
            );
        }
        let _guard = self.lock.lock().await;
        let Some(dev) = self.device(&id) else {
            return fail(Code::NotFound, format!("volume {id} is not attached"));
        };
        let want = req
            .capacity_range
            .as_ref()
            .map_or(0, |r| r.required_bytes.max(0) as u64);
        if self.device_bytes(&dev) < want {
            for c in self.controllers(&id.nqn()) {
                let _ = run("nvme", &["ns-rescan", &format!("/dev/{c}")]).await;
            }
            let deadline = tokio::time::Instant::now() + DEVICE_WAIT;
            while self.device_bytes(&dev) < want && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            if self.device_bytes(&dev) < want {
                return fail(
                    Code::Internal,
                    format!(
                        "volume {id}: /dev/{dev} stays at {} bytes",
                        self.device_bytes(&dev)
                    ),
                );
            }
        }
        let block = matches!(
            req.volume_capability
                .as_ref()
                .and_then(|c| c.access_type.as_ref()),
            Some(AccessType::Block(_))
        );
        if !block && Path::new(&req.volume_path).is_dir() {
            run("resize2fs", &[&format!("/dev/{dev}")]).await?;
            info!(volume = %id, bytes = self.device_bytes(&dev), "file system grown");
        }
        Ok(NodeExpandVolumeResponse {
            capacity_bytes: self.device_bytes(&dev) as i64,
        })
    }

    /// NodeGetInfo: the node ID is the host NQN.
    pub fn info(&self) -> NodeGetInfoResponse {
        NodeGetInfoResponse {
            node_id: self.host_nqn.clone(),
            max_volumes_per_node: 0,
            accessible_topology: None,
        }
    }

    /// NodeGetCapabilities.
    pub fn capabilities() -> CapabilitiesResponse {
        use node_rpc::*;
        crate::controller::rpc_capabilities(&[
            STAGE_UNSTAGE_VOLUME,
            GET_VOLUME_STATS,
            EXPAND_VOLUME,
        ])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_empty_devices_are_formatted() {
        let mut head = vec![0u8; 4096];
        assert_eq!(classify(&head), Contents::Empty);
        head[1080] = 0x53;
        head[1081] = 0xef;
        assert_eq!(classify(&head), Contents::Ext);
        head[1080] = 1;
        assert_eq!(classify(&head), Contents::Other);
        assert_eq!(classify(&[]), Contents::Empty);
    }

    #[test]
    fn only_namespace_heads_are_devices() {
        assert!(is_namespace_head("nvme0n1"));
        assert!(is_namespace_head("nvme12n3"));
        for name in ["nvme0c0n1", "nvme0", "nvme0n", "sda", "nvmen1", "nvme0n1p1"] {
            assert!(!is_namespace_head(name), "{name}");
        }
    }

    #[test]
    fn mountinfo_escapes_are_undone() {
        assert_eq!(unescape("/a\\040b"), "/a b");
        assert_eq!(unescape("/plain"), "/plain");
        assert_eq!(unescape("/end\\04"), "/end\\04");
    }
}
