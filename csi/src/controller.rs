//! The Controller service: volumes as namespaces on a pool of storage nodes, managed through
//! each node's remote control API (mutual TLS, an admin client certificate).
//!
//! A volume is one subsystem with one namespace (NSID 1) on one storage node. Everything
//! about it derives from a key, the first 16 bytes of SHA-256 of the volume's name (hex):
//! the subsystem NQN ([`NQN_PREFIX`] + key), the namespace UUID (the key) and the volume ID
//! `NODE:KEY:NSID` ([`VolumeId`]). So the driver keeps no state of its own: after a restart
//! it finds every volume again by listing the storage nodes, a retried CreateVolume finds
//! what an earlier try made (and completes it), and the node plugin finds the block device
//! by the UUID in the volume ID.

use std::path::PathBuf;
use std::time::Duration;

use nvmeof_target::control::{Request, Response};
use nvmeof_target::remote::{ClientFiles, RemoteError, request};
use serde::Deserialize;
use serde_json::Value;
use sha2::{Digest, Sha256};
use tracing::{info, warn};

use crate::grpc::{Code, Status, fail};
use crate::proto::*;

/// The NQN prefix of the subsystems this driver makes; others are left alone.
pub const NQN_PREFIX: &str = "nqn.2026-11.io.nvmeof-direct:csi:";
/// The size of a volume whose request names none.
pub const DEFAULT_SIZE: u64 = 1 << 30;
/// The model number of the subsystems this driver makes.
const MODEL: &str = "nvmeof-csi";
/// The secret key holding a host's DH-HMAC-CHAP secret (`DHHC-1:...`, from
/// `nvme gen-dhchap-key`): ControllerPublish allows the host with it, NodeStage connects with it.
pub const SECRET_DHCHAP_KEY: &str = "dhchapKey";
/// The secret key holding the controller's DH-HMAC-CHAP secret, for bidirectional
/// authentication.
pub const SECRET_DHCHAP_CTRL_KEY: &str = "dhchapCtrlKey";
/// A host NQN every subsystem of this driver allows and no host uses: the target refuses a
/// subsystem that no host may connect to, and an unpublished volume has no host.
pub const NO_HOST: &str = "nqn.2026-11.io.nvmeof-direct:csi:unpublished";

/// The controller's configuration file (TOML).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ControllerConfig {
    /// The client certificate the driver presents to the storage nodes.
    pub tls: TlsFiles,
    /// How long a request is retried while a storage node cannot be reached (seconds).
    #[serde(default = "default_retry")]
    pub retry_seconds: u64,
    /// The storage nodes.
    #[serde(rename = "storage_node")]
    pub nodes: Vec<StorageNode>,
}

fn default_retry() -> u64 {
    30
}

/// Certificate files (PEM).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsFiles {
    /// The CA that signed the storage nodes' certificates.
    pub ca: PathBuf,
    /// The driver's client certificate; its CN must be an admin of each node.
    pub cert: PathBuf,
    /// Its private key.
    pub key: PathBuf,
}

/// One storage node running `nvmeof-targetd` with `[target.remote_control]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StorageNode {
    /// Its name in volume IDs (letters, digits, `-`, `_`, `.`); never rename a node that
    /// holds volumes.
    pub name: String,
    /// Its remote control API, `HOST:PORT`.
    pub control: String,
    /// The NVMe/TCP address hosts connect to.
    pub address: String,
    /// The NVMe/TCP port.
    #[serde(default = "default_port")]
    pub port: u16,
    /// The pool it belongs to (the StorageClass parameter `pool`).
    #[serde(default = "default_pool")]
    pub pool: String,
    /// Bytes it may give to volumes, e.g. `"500G"`.
    pub capacity: String,
    /// Where `file` volumes are made on the node (absolute; absent: no file volumes here).
    #[serde(default)]
    pub file_dir: Option<PathBuf>,
    /// Where the node's running configuration is saved after every change (absolute, on
    /// the node; absent: not saved, so a target restart forgets the volumes).
    #[serde(default)]
    pub save_config: Option<PathBuf>,
}

fn default_port() -> u16 {
    4420
}

fn default_pool() -> String {
    "default".into()
}

/// Why a configuration is refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// It could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Cause.
        source: std::io::Error,
    },
    /// It is not valid.
    #[error("{0}")]
    Invalid(String),
}

impl ControllerConfig {
    /// Parses and checks a configuration.
    pub fn parse(text: &str) -> Result<ControllerConfig, ConfigError> {
        let cfg: ControllerConfig =
            toml::from_str(text).map_err(|e| ConfigError::Invalid(e.to_string()))?;
        if cfg.nodes.is_empty() {
            return Err(ConfigError::Invalid("no [[storage_node]]".into()));
        }
        for (i, n) in cfg.nodes.iter().enumerate() {
            let ok = !n.name.is_empty()
                && n.name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
            if !ok {
                return Err(ConfigError::Invalid(format!(
                    "storage node name {:?}: use letters, digits, '-', '_' and '.'",
                    n.name
                )));
            }
            if cfg.nodes[..i].iter().any(|m| m.name == n.name) {
                return Err(ConfigError::Invalid(format!(
                    "storage node {:?} twice",
                    n.name
                )));
            }
            blockdev::parse_size(&n.capacity).map_err(|e| {
                ConfigError::Invalid(format!("storage node {:?}: capacity: {e}", n.name))
            })?;
            for p in [&n.file_dir, &n.save_config].into_iter().flatten() {
                if !p.is_absolute() {
                    return Err(ConfigError::Invalid(format!(
                        "storage node {:?}: {} must be absolute",
                        n.name,
                        p.display()
                    )));
                }
            }
        }
        Ok(cfg)
    }

    /// Reads and checks the configuration file at `path`.
    pub fn load(path: &std::path::Path) -> Result<ControllerConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        ControllerConfig::parse(&text)
    }
}

/// A volume ID: `NODE:KEY:NSID`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeId {
    /// The storage node's name.
    pub node: String,
    /// 32 lowercase hex digits (the namespace UUID, the subsystem NQN's last part).
    pub key: String,
    /// The NSID.
    pub nsid: u32,
}

impl VolumeId {
    /// Parses a volume ID; `None` when it is not one of this driver's.
    pub fn parse(s: &str) -> Option<VolumeId> {
        let mut it = s.split(':');
        let (node, key, nsid) = (it.next()?, it.next()?, it.next()?);
        if it.next().is_some() || node.is_empty() {
            return None;
        }
        if key.len() != 32 || !key.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            return None;
        }
        Some(VolumeId {
            node: node.into(),
            key: key.into(),
            nsid: nsid.parse().ok().filter(|n| *n > 0)?,
        })
    }

    /// The subsystem's NQN.
    pub fn nqn(&self) -> String {
        format!("{NQN_PREFIX}{}", self.key)
    }

    /// The namespace's UUID (`8-4-4-4-12`).
    pub fn uuid(&self) -> String {
        let k = &self.key;
        format!(
            "{}-{}-{}-{}-{}",
            &k[..8],
            &k[8..12],
            &k[12..16],
            &k[16..20],
            &k[20..]
        )
    }
}

impl std::fmt::Display for VolumeId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}:{}", self.node, self.key, self.nsid)
    }
}

/// The key of a volume name.
pub fn key_of(name: &str) -> String {
    Sha256::digest(name.as_bytes())[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A volume as a storage node lists it.
#[derive(Clone, Debug, PartialEq)]
struct Listed {
    nqn: String,
    hosts: Vec<String>,
    /// NSID 1: backend description, size, block size.
    ns: Option<(String, u64, u32)>,
}

/// The volume's parameters (the StorageClass's).
#[derive(Clone, Debug, PartialEq)]
struct Params {
    backend: String,
    block_size: u32,
    pool: Option<String>,
}

fn params(map: &Map) -> Result<Params, Status> {
    let mut p = Params {
        backend: "file".into(),
        block_size: 4096,
        pool: None,
    };
    for (k, v) in map {
        match k.as_str() {
            "backend" => match v.as_str() {
                "mem" | "file" | "null" => p.backend = v.clone(),
                _ => {
                    return fail(
                        Code::InvalidArgument,
                        format!("backend {v:?}: use mem, file or null"),
                    );
                }
            },
            "blockSize" => match v.as_str() {
                "512" => p.block_size = 512,
                "4096" => p.block_size = 4096,
                _ => {
                    return fail(
                        Code::InvalidArgument,
                        format!("blockSize {v:?}: use 512 or 4096"),
                    );
                }
            },
            "pool" => p.pool = Some(v.clone()),
            // Added by the external provisioner (PVC name, namespace, PV name).
            _ if k.starts_with("csi.storage.k8s.io/") => {}
            _ => return fail(Code::InvalidArgument, format!("unknown parameter {k:?}")),
        }
    }
    Ok(p)
}

fn check_capabilities(caps: &[VolumeCapability]) -> Result<(), Status> {
    if caps.is_empty() {
        return fail(Code::InvalidArgument, "volume capabilities missing");
    }
    for c in caps {
        if c.access_type.is_none() {
            return fail(
                Code::InvalidArgument,
                "a volume capability names neither block nor mount",
            );
        }
        match c.access_mode.as_ref().map(|m| m.mode) {
            None | Some(MODE_UNKNOWN) => {
                return fail(
                    Code::InvalidArgument,
                    "a volume capability has no access mode",
                );
            }
            Some(m) if m > 7 => return fail(Code::InvalidArgument, format!("access mode {m}")),
            _ => {}
        }
        if let Some(AccessType::Mount(m)) = &c.access_type {
            if !matches!(m.fs_type.as_str(), "" | "ext4") {
                return fail(
                    Code::InvalidArgument,
                    format!("file system {:?}: only ext4 is supported", m.fs_type),
                );
            }
        }
    }
    Ok(())
}

fn single_node(caps: &[VolumeCapability]) -> bool {
    caps.iter()
        .any(|c| matches!(c.access_mode.as_ref().map(|m| m.mode), Some(1 | 2 | 6 | 7)))
}

/// The size to make for `range`, a multiple of `bs`.
fn size_for(range: Option<&CapacityRange>, bs: u32) -> Result<u64, Status> {
    let (req, lim) = range.map_or((0, 0), |r| (r.required_bytes, r.limit_bytes));
    if req < 0 || lim < 0 {
        return fail(Code::InvalidArgument, "negative capacity");
    }
    let (req, lim) = (req as u64, lim as u64);
    if lim != 0 && req > lim {
        return fail(Code::InvalidArgument, "required bytes exceed the limit");
    }
    let want = if req == 0 {
        if lim == 0 {
            DEFAULT_SIZE
        } else {
            DEFAULT_SIZE.min(lim)
        }
    } else {
        req
    };
    let bs = u64::from(bs);
    let size = want.div_ceil(bs).max(1) * bs;
    if lim != 0 && size > lim {
        return fail(
            Code::OutOfRange,
            format!("no multiple of {bs} bytes lies in the capacity range"),
        );
    }
    Ok(size)
}

fn fits(size: u64, range: Option<&CapacityRange>) -> bool {
    let (req, lim) = range.map_or((0, 0), |r| {
        (r.required_bytes.max(0) as u64, r.limit_bytes.max(0) as u64)
    });
    size >= req && (lim == 0 || size <= lim)
}

/// The Controller service.
pub struct Controller {
    cfg: ControllerConfig,
    files: ClientFiles,
    /// One change at a time: a CreateVolume's placement must see the volumes made before it.
    lock: tokio::sync::Mutex<()>,
}

impl Controller {
    /// A controller for `cfg`.
    pub fn new(cfg: ControllerConfig) -> Controller {
        let files = ClientFiles {
            cert_key: Some((cfg.tls.cert.clone(), cfg.tls.key.clone())),
            ca: cfg.tls.ca.clone(),
        };
        Controller {
            cfg,
            files,
            lock: tokio::sync::Mutex::new(()),
        }
    }

    fn node(&self, name: &str) -> Option<&StorageNode> {
        self.cfg.nodes.iter().find(|n| n.name == name)
    }

    /// Sends `req` to `node`, retrying while the node cannot be reached (a target restarting),
    /// and returns its answer; a refusal is `FAILED_PRECONDITION` with the target's words.
    async fn remote(&self, node: &StorageNode, req: &Request) -> Result<Response, Status> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(self.cfg.retry_seconds);
        loop {
            match request(&node.control, &self.files, req).await {
                Ok(r) if r.ok => return Ok(r),
                Ok(r) => {
                    let why = r.error.unwrap_or_default();
                    return fail(
                        Code::FailedPrecondition,
                        format!("storage node {}: {why}", node.name),
                    );
                }
                Err(e @ RemoteError::Read { .. }) => {
                    return fail(Code::Internal, e.to_string());
                }
                Err(e) if tokio::time::Instant::now() >= deadline => {
                    return fail(
                        Code::Unavailable,
                        format!("storage node {}: {e}", node.name),
                    );
                }
                Err(e) => {
                    warn!(node = %node.name, error = %e, "storage node unreachable; retrying");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        }
    }

    async fn save(&self, node: &StorageNode) -> Result<(), Status> {
        if let Some(path) = &node.save_config {
            self.remote(node, &Request::Save { path: path.clone() })
                .await?;
        }
        Ok(())
    }

    /// This driver's volumes on `node`.
    async fn list(&self, node: &StorageNode) -> Result<Vec<Listed>, Status> {
        let r = self.remote(node, &Request::List {}).await?;
        let subsystems = r
            .status
            .as_ref()
            .and_then(|s| s.get("subsystems"))
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let strings = |v: Option<&Value>| -> Vec<String> {
            v.and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(|s| s.as_str().map(String::from))
                        .collect()
                })
                .unwrap_or_default()
        };
        Ok(subsystems
            .iter()
            .filter_map(|s| {
                let nqn = s.get("nqn")?.as_str()?;
                if !nqn.starts_with(NQN_PREFIX) {
                    return None;
                }
                let ns = s
                    .get("namespaces")
                    .and_then(Value::as_array)
                    .and_then(|a| {
                        a.iter()
                            .find(|n| n.get("nsid").and_then(Value::as_u64) == Some(1))
                    })
                    .map(|n| {
                        (
                            n.get("backend")
                                .and_then(Value::as_str)
                                .unwrap_or("")
                                .to_string(),
                            n.get("size").and_then(Value::as_u64).unwrap_or(0),
                            n.get("block_size").and_then(Value::as_u64).unwrap_or(0) as u32,
                        )
                    });
                let mut hosts = strings(s.get("hosts"));
                for h in strings(s.get("dhchap_hosts")) {
                    if !hosts.contains(&h) {
                        hosts.push(h);
                    }
                }
                hosts.retain(|h| h != NO_HOST);
                Some(Listed {
                    nqn: nqn.to_string(),
                    hosts,
                    ns,
                })
            })
            .collect())
    }

    /// Bytes `node` may still give to volumes, given its listing.
    fn free(node: &StorageNode, listed: &[Listed]) -> u64 {
        let cap = blockdev::parse_size(&node.capacity).unwrap_or(0);
        let used: u64 = listed
            .iter()
            .filter_map(|l| l.ns.as_ref().map(|n| n.1))
            .sum();
        cap.saturating_sub(used)
    }

    fn volume(&self, node: &StorageNode, id: &VolumeId, size: u64) -> Volume {
        Volume {
            capacity_bytes: size as i64,
            volume_id: id.to_string(),
            volume_context: context(node, id),
        }
    }

    /// The volume `id`, as its node lists it (`None`: no such volume).
    async fn find(&self, id: &VolumeId) -> Result<Option<(&StorageNode, Listed)>, Status> {
        let Some(node) = self.node(&id.node) else {
            return Ok(None);
        };
        let nqn = id.nqn();
        let found = self
            .list(node)
            .await?
            .into_iter()
            .find(|l| l.nqn == nqn && l.ns.is_some());
        Ok(found.map(|l| (node, l)))
    }

    /// CreateVolume.
    pub async fn create_volume(
        &self,
        req: CreateVolumeRequest,
    ) -> Result<CreateVolumeResponse, Status> {
        if req.name.is_empty() {
            return fail(Code::InvalidArgument, "volume name missing");
        }
        check_capabilities(&req.volume_capabilities)?;
        if req.volume_content_source.is_some() {
            return fail(
                Code::InvalidArgument,
                "volumes from snapshots or clones are not supported",
            );
        }
        let p = params(&req.parameters)?;
        let range = req.capacity_range.as_ref();
        let size = size_for(range, p.block_size)?;
        let key = key_of(&req.name);
        let nqn = format!("{NQN_PREFIX}{key}");
        let _guard = self.lock.lock().await;

        // An earlier try (or an earlier request of this name) may have made it, on any node.
        let mut listings = Vec::new();
        let mut home = None;
        for node in &self.cfg.nodes {
            let listed = self.list(node).await?;
            if let Some(l) = listed.iter().find(|l| l.nqn == nqn) {
                home = Some((node, l.clone()));
            }
            listings.push((node, listed));
        }
        let node = match home {
            Some((node, l)) => {
                let id = VolumeId {
                    node: node.name.clone(),
                    key: key.clone(),
                    nsid: 1,
                };
                if let Some((backend, have, bs)) = &l.ns {
                    let kind = backend.split(':').next().unwrap_or("");
                    if !fits(*have, range) || kind != p.backend || *bs != p.block_size {
                        return fail(
                            Code::AlreadyExists,
                            format!(
                                "volume {:?} exists as {backend} ({have} bytes, {bs}-byte blocks)",
                                req.name
                            ),
                        );
                    }
                    return Ok(CreateVolumeResponse {
                        volume: Some(self.volume(node, &id, *have)),
                    });
                }
                node
            }
            None => {
                // The node of the pool with the most room that fits it.
                let mut best: Option<(&StorageNode, u64)> = None;
                for (node, listed) in &listings {
                    if p.pool.as_ref().is_some_and(|pool| *pool != node.pool)
                        || (p.backend == "file" && node.file_dir.is_none())
                    {
                        continue;
                    }
                    let free = Self::free(node, listed);
                    if free >= size && best.is_none_or(|(_, f)| free > f) {
                        best = Some((node, free));
                    }
                }
                let Some((node, _)) = best else {
                    return fail(
                        Code::ResourceExhausted,
                        format!(
                            "no storage node{} has {size} bytes free for a {} volume",
                            p.pool
                                .as_ref()
                                .map(|p| format!(" in pool {p:?}"))
                                .unwrap_or_default(),
                            p.backend
                        ),
                    );
                };
                self.remote(
                    node,
                    &Request::AddSubsystem {
                        nqn: nqn.clone(),
                        allow_any_host: false,
                        hosts: vec![NO_HOST.into()],
                        serial: None,
                        model: Some(MODEL.into()),
                    },
                )
                .await?;
                node
            }
        };
        let id = VolumeId {
            node: node.name.clone(),
            key,
            nsid: 1,
        };
        let backend = match p.backend.as_str() {
            "file" => {
                let dir = node
                    .file_dir
                    .as_ref()
                    .map(|d| d.display().to_string())
                    .unwrap_or_default();
                // A new file each time: a deleted volume's file (which the target keeps)
                // never comes back as another volume's data.
                let stamp = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos())
                    .unwrap_or(0);
                format!(
                    "file:{dir}/{}-{stamp}.img,size={size},bs={}",
                    id.key, p.block_size
                )
            }
            kind => format!("{kind}:{size},bs={}", p.block_size),
        };
        self.remote(
            node,
            &Request::AddNamespace {
                subsystem: nqn,
                backend,
                nsid: Some(1),
                uuid: Some(id.uuid()),
                hosts: vec![],
                ana_group: None,
            },
        )
        .await?;
        self.save(node).await?;
        info!(name = %req.name, volume = %id, size, node = %node.name, "volume created");
        Ok(CreateVolumeResponse {
            volume: Some(self.volume(node, &id, size)),
        })
    }

    /// DeleteVolume.
    pub async fn delete_volume(
        &self,
        req: DeleteVolumeRequest,
    ) -> Result<DeleteVolumeResponse, Status> {
        if req.volume_id.is_empty() {
            return fail(Code::InvalidArgument, "volume ID missing");
        }
        let _guard = self.lock.lock().await;
        // An ID that is not one of this driver's names no volume: it is gone already.
        let Some(id) = VolumeId::parse(&req.volume_id) else {
            return Ok(DeleteVolumeResponse {});
        };
        let Some(node) = self.node(&id.node) else {
            return Ok(DeleteVolumeResponse {});
        };
        self.remote(node, &Request::RemoveSubsystem { nqn: id.nqn() })
            .await?;
        self.save(node).await?;
        info!(volume = %id, "volume deleted");
        Ok(DeleteVolumeResponse {})
    }

    /// ControllerPublishVolume: allows the node's host NQN on the volume's subsystem.
    pub async fn publish(
        &self,
        req: ControllerPublishVolumeRequest,
    ) -> Result<ControllerPublishVolumeResponse, Status> {
        if req.volume_id.is_empty() {
            return fail(Code::InvalidArgument, "volume ID missing");
        }
        if req.node_id.is_empty() {
            return fail(Code::InvalidArgument, "node ID missing");
        }
        let Some(cap) = req.volume_capability else {
            return fail(Code::InvalidArgument, "volume capability missing");
        };
        check_capabilities(std::slice::from_ref(&cap))?;
        let _guard = self.lock.lock().await;
        let Some((node, listed)) = self.lookup(&req.volume_id).await? else {
            return fail(
                Code::NotFound,
                format!("volume {} not found", req.volume_id),
            );
        };
        if !is_host_nqn(&req.node_id) {
            return fail(
                Code::NotFound,
                format!("node {:?} is not a host NQN", req.node_id),
            );
        }
        let id = VolumeId::parse(&req.volume_id).expect("looked up");
        let key = req.secrets.get(SECRET_DHCHAP_KEY).cloned();
        let ctrl_key = req.secrets.get(SECRET_DHCHAP_CTRL_KEY).cloned();
        if ctrl_key.is_some() && key.is_none() {
            return fail(
                Code::InvalidArgument,
                format!("secret {SECRET_DHCHAP_CTRL_KEY} needs {SECRET_DHCHAP_KEY}"),
            );
        }
        let allowed = listed.hosts.contains(&req.node_id);
        if !allowed && single_node(std::slice::from_ref(&cap)) && !listed.hosts.is_empty() {
            return fail(
                Code::FailedPrecondition,
                format!(
                    "volume {id} is published to {} already",
                    listed.hosts.join(", ")
                ),
            );
        }
        // With keys, the host is allowed (again) with them: an allowed host's keys are
        // replaced, the same keys change nothing.
        if !allowed || key.is_some() {
            self.remote(
                node,
                &Request::AddHost {
                    subsystem: id.nqn(),
                    host: req.node_id.clone(),
                    dhchap_key: key.clone(),
                    dhchap_key_file: None,
                    dhchap_ctrl_key: ctrl_key,
                    dhchap_ctrl_key_file: None,
                    tls_psk: None,
                    tls_psk_file: None,
                    replace: allowed,
                },
            )
            .await?;
            self.save(node).await?;
            info!(volume = %id, host = %req.node_id, dhchap = key.is_some(), "volume published");
        }
        Ok(ControllerPublishVolumeResponse {
            publish_context: context(node, &id),
        })
    }

    /// ControllerUnpublishVolume: stops allowing the node's host NQN (every host when the
    /// request names no node).
    pub async fn unpublish(
        &self,
        req: ControllerUnpublishVolumeRequest,
    ) -> Result<ControllerUnpublishVolumeResponse, Status> {
        if req.volume_id.is_empty() {
            return fail(Code::InvalidArgument, "volume ID missing");
        }
        let _guard = self.lock.lock().await;
        let Some((node, listed)) = self.lookup(&req.volume_id).await? else {
            return Ok(ControllerUnpublishVolumeResponse {});
        };
        let id = VolumeId::parse(&req.volume_id).expect("looked up");
        let hosts: Vec<String> = if req.node_id.is_empty() {
            listed.hosts.clone()
        } else {
            listed
                .hosts
                .iter()
                .filter(|h| **h == req.node_id)
                .cloned()
                .collect()
        };
        for host in hosts {
            self.remote(
                node,
                &Request::RemoveHost {
                    subsystem: id.nqn(),
                    host: host.clone(),
                },
            )
            .await?;
            info!(volume = %id, %host, "volume unpublished");
        }
        self.save(node).await?;
        Ok(ControllerUnpublishVolumeResponse {})
    }

    async fn lookup(&self, volume_id: &str) -> Result<Option<(&StorageNode, Listed)>, Status> {
        match VolumeId::parse(volume_id) {
            Some(id) => self.find(&id).await,
            None => Ok(None),
        }
    }

    /// ValidateVolumeCapabilities.
    pub async fn validate(
        &self,
        req: ValidateVolumeCapabilitiesRequest,
    ) -> Result<ValidateVolumeCapabilitiesResponse, Status> {
        if req.volume_id.is_empty() {
            return fail(Code::InvalidArgument, "volume ID missing");
        }
        if req.volume_capabilities.is_empty() {
            return fail(Code::InvalidArgument, "volume capabilities missing");
        }
        if self.lookup(&req.volume_id).await?.is_none() {
            return fail(
                Code::NotFound,
                format!("volume {} not found", req.volume_id),
            );
        }
        if let Err(e) =
            check_capabilities(&req.volume_capabilities).and_then(|_| params(&req.parameters))
        {
            return Ok(ValidateVolumeCapabilitiesResponse {
                confirmed: None,
                message: e.message,
            });
        }
        Ok(ValidateVolumeCapabilitiesResponse {
            confirmed: Some(Confirmed {
                volume_context: req.volume_context,
                volume_capabilities: req.volume_capabilities,
                parameters: req.parameters,
            }),
            message: String::new(),
        })
    }

    /// ListVolumes: every node's volumes, in volume ID order.
    pub async fn list_volumes(
        &self,
        req: ListVolumesRequest,
    ) -> Result<ListVolumesResponse, Status> {
        if req.max_entries < 0 {
            return fail(Code::InvalidArgument, "negative max_entries");
        }
        let mut all = Vec::new();
        for node in &self.cfg.nodes {
            for l in self.list(node).await? {
                let Some((_, size, _)) = l.ns else { continue };
                let key = l.nqn[NQN_PREFIX.len()..].to_string();
                let Some(id) = VolumeId::parse(&format!("{}:{key}:1", node.name)) else {
                    continue;
                };
                all.push(ListVolumesEntry {
                    volume: Some(self.volume(node, &id, size)),
                    status: Some(VolumeStatus {
                        published_node_ids: l.hosts,
                    }),
                });
            }
        }
        all.sort_by(|a, b| {
            let id = |e: &ListVolumesEntry| e.volume.as_ref().map(|v| v.volume_id.clone());
            id(a).cmp(&id(b))
        });
        // The token is the last volume ID returned: a volume deleted between pages shifts
        // nothing.
        let start = if req.starting_token.is_empty() {
            0
        } else {
            if VolumeId::parse(&req.starting_token).is_none() {
                return fail(
                    Code::Aborted,
                    format!("invalid starting token {:?}", req.starting_token),
                );
            }
            all.iter()
                .position(|e| {
                    e.volume
                        .as_ref()
                        .is_some_and(|v| v.volume_id > req.starting_token)
                })
                .unwrap_or(all.len())
        };
        let max = if req.max_entries == 0 {
            usize::MAX
        } else {
            req.max_entries as usize
        };
        let end = start.saturating_add(max).min(all.len());
        let next_token = if end < all.len() {
            all[end - 1]
                .volume
                .as_ref()
                .map(|v| v.volume_id.clone())
                .unwrap_or_default()
        } else {
            String::new()
        };
        Ok(ListVolumesResponse {
            entries: all.drain(start..end).collect(),
            next_token,
        })
    }

    /// GetCapacity: the bytes free in the pool (every node when the request names none).
    pub async fn get_capacity(
        &self,
        req: GetCapacityRequest,
    ) -> Result<GetCapacityResponse, Status> {
        if !req.volume_capabilities.is_empty() {
            check_capabilities(&req.volume_capabilities)?;
        }
        let p = params(&req.parameters)?;
        let (mut total, mut max) = (0u64, 0u64);
        for node in &self.cfg.nodes {
            if p.pool.as_ref().is_some_and(|pool| *pool != node.pool)
                || (p.backend == "file" && node.file_dir.is_none())
            {
                continue;
            }
            let free = Self::free(node, &self.list(node).await?);
            total += free;
            max = max.max(free);
        }
        Ok(GetCapacityResponse {
            available_capacity: total as i64,
            maximum_volume_size: Some(Int64Value { value: max as i64 }),
        })
    }

    /// ControllerExpandVolume: grows the namespace (hosts see it through a Namespace
    /// Attribute Notice).
    pub async fn expand(
        &self,
        req: ControllerExpandVolumeRequest,
    ) -> Result<ControllerExpandVolumeResponse, Status> {
        if req.volume_id.is_empty() {
            return fail(Code::InvalidArgument, "volume ID missing");
        }
        let Some(range) = req.capacity_range else {
            return fail(Code::InvalidArgument, "capacity range missing");
        };
        let _guard = self.lock.lock().await;
        let Some((node, listed)) = self.lookup(&req.volume_id).await? else {
            return fail(
                Code::NotFound,
                format!("volume {} not found", req.volume_id),
            );
        };
        let id = VolumeId::parse(&req.volume_id).expect("looked up");
        let (_, have, bs) = listed.ns.clone().expect("found volumes have a namespace");
        let want = size_for(Some(&range), bs.max(512))?;
        let block = matches!(
            req.volume_capability
                .as_ref()
                .and_then(|c| c.access_type.as_ref()),
            Some(AccessType::Block(_))
        );
        if want > have {
            let free = Self::free(node, &self.list(node).await?);
            if want - have > free {
                return fail(
                    Code::ResourceExhausted,
                    format!("storage node {} has {free} bytes free", node.name),
                );
            }
            self.remote(
                node,
                &Request::ResizeNamespace {
                    subsystem: id.nqn(),
                    nsid: id.nsid,
                    size: want.to_string(),
                },
            )
            .await?;
            self.save(node).await?;
            info!(volume = %id, from = have, to = want, "volume expanded");
        }
        Ok(ControllerExpandVolumeResponse {
            capacity_bytes: want.max(have) as i64,
            node_expansion_required: !block,
        })
    }

    /// ControllerGetCapabilities.
    pub fn capabilities() -> CapabilitiesResponse {
        use controller_rpc::*;
        rpc_capabilities(&[
            CREATE_DELETE_VOLUME,
            PUBLISH_UNPUBLISH_VOLUME,
            LIST_VOLUMES,
            GET_CAPACITY,
            EXPAND_VOLUME,
            LIST_VOLUMES_PUBLISHED_NODES,
        ])
    }
}

/// A capabilities answer listing `types`.
pub fn rpc_capabilities(types: &[i32]) -> CapabilitiesResponse {
    CapabilitiesResponse {
        capabilities: types
            .iter()
            .map(|t| RpcCapability {
                rpc: Some(TypeOnly { r#type: *t }),
            })
            .collect(),
    }
}

/// Whether `s` reads as an NVMe host NQN.
pub fn is_host_nqn(s: &str) -> bool {
    s.starts_with("nqn.")
        && s.len() <= 223
        && s.contains(':')
        && !s.chars().any(char::is_whitespace)
}

/// What the node plugin needs to connect: the volume context and publish context.
fn context(node: &StorageNode, id: &VolumeId) -> Map {
    [
        ("nqn", id.nqn()),
        ("uuid", id.uuid()),
        ("transport", "tcp".into()),
        ("traddr", node.address.clone()),
        ("trsvcid", node.port.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn volume_ids_round_trip_and_strangers_are_refused() {
        let key = key_of("pvc-1");
        assert_eq!(key.len(), 32);
        let id = VolumeId {
            node: "store-1".into(),
            key: key.clone(),
            nsid: 1,
        };
        assert_eq!(VolumeId::parse(&id.to_string()), Some(id.clone()));
        assert_eq!(id.nqn(), format!("{NQN_PREFIX}{key}"));
        assert_eq!(id.uuid().len(), 36);
        for bad in [
            "",
            "x",
            "a:b:1",
            &format!("a:{key}:0"),
            &format!(":{key}:1"),
            &format!("a:{key}:1:2"),
            &format!("a:{}:1", key.to_uppercase()),
        ] {
            assert_eq!(VolumeId::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn sizes_round_up_to_blocks_within_the_range() {
        let r = |req, lim| CapacityRange {
            required_bytes: req,
            limit_bytes: lim,
        };
        assert_eq!(size_for(None, 4096).unwrap(), DEFAULT_SIZE);
        assert_eq!(size_for(Some(&r(1, 0)), 4096).unwrap(), 4096);
        assert_eq!(size_for(Some(&r(0, 8192)), 4096).unwrap(), 8192);
        assert_eq!(size_for(Some(&r(5000, 0)), 512).unwrap(), 5120);
        assert_eq!(
            size_for(Some(&r(5000, 5000)), 4096).unwrap_err().code,
            Code::OutOfRange
        );
        assert_eq!(
            size_for(Some(&r(10, 5)), 4096).unwrap_err().code,
            Code::InvalidArgument
        );
        assert_eq!(
            size_for(Some(&r(-1, 0)), 4096).unwrap_err().code,
            Code::InvalidArgument
        );
    }

    #[test]
    fn parameters_are_checked() {
        let m = |k: &str, v: &str| Map::from([(k.to_string(), v.to_string())]);
        assert_eq!(params(&Map::new()).unwrap().backend, "file");
        assert_eq!(params(&m("backend", "mem")).unwrap().backend, "mem");
        assert_eq!(params(&m("blockSize", "512")).unwrap().block_size, 512);
        assert!(params(&m("csi.storage.k8s.io/pvc/name", "x")).is_ok());
        for (k, v) in [
            ("backend", "pcie"),
            ("blockSize", "1000"),
            ("colour", "red"),
        ] {
            assert_eq!(params(&m(k, v)).unwrap_err().code, Code::InvalidArgument);
        }
    }

    #[test]
    fn configs_are_checked() {
        let good = "[tls]\nca=\"/c\"\ncert=\"/c\"\nkey=\"/k\"\n[[storage_node]]\nname=\"s1\"\ncontrol=\"h:1\"\naddress=\"h\"\ncapacity=\"1G\"\n";
        let cfg = ControllerConfig::parse(good).unwrap();
        assert_eq!(
            (cfg.nodes[0].port, cfg.nodes[0].pool.as_str()),
            (4420, "default")
        );
        for bad in [
            good.replace("s1", "a:b"),
            good.replace("1G", "lots"),
            format!(
                "{good}[[storage_node]]\nname=\"s1\"\ncontrol=\"h:1\"\naddress=\"h\"\ncapacity=\"1G\"\n"
            ),
            good.replace("capacity", "capacityx"),
            format!("{good}file_dir=\"rel\"\n"),
        ] {
            assert!(ControllerConfig::parse(&bad).is_err(), "{bad}");
        }
    }
}
